// grid_sample forward (one program): gs_forward, L lanes per output point, each building the point's taps once
// (PointTaps, grid_sample_common.cuh) and looping over channel groups.

#include "grid_sample_common.cuh"

// ---------------------------------------------------------------------------------------------------
// Forward: L = 2^lanes_log2 lanes per output point (at most one per group of VEC channels); lane l computes
// the point's taps and weights once, then takes channel groups l, l + L, ... (ATen's kernel is L = 1: one
// thread loops over every channel). F_POINT_FAST: points vary fastest across threads (channels-first
// output: coalesced stores); else lanes do (channels-last: a warp reads consecutive channel groups).
// A channels-first lane taking one channel at a time instead of 4 measured 1.3-4.6x slower (H100).
// ---------------------------------------------------------------------------------------------------
// Blocks of 256 per SM the forward is compiled for. Left alone, f32 bilinear took 96 registers (2 blocks);
// capped for 3 (2-D bilinear) or 2 it ran 1.3-2x faster on channels-last inputs and on smooth grids, 1.1-1.3x
// slower on uniformly random channels-first ones (more warps evict each other's lines, we suppose), H100:
// tools/results/2026-11-25-h100-probe_grid_sample_forward_min_blocks.json. -DGS_FWD_MIN_BLOCKS=n overrides.
#ifdef GS_FWD_MIN_BLOCKS
#define GS_FWD_BLOCKS(A, ND, MODE) GS_FWD_MIN_BLOCKS
#else
#define GS_FWD_BLOCKS(A, ND, MODE) \
    ((MODE) == MODE_BICUBIC || sizeof(A) == 8 ? 1 : (ND) == 2 && (MODE) == MODE_BILINEAR ? 3 : 2)
#endif
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256, GS_FWD_BLOCKS(A, ND, MODE)) gs_forward(const T* __restrict__ inp, const T* __restrict__ grid,
                                                  T* __restrict__ out, const Geo g) {
    const long long P = g.OD * g.OH * g.OW, C = g.C;
    const long long G = (C + VEC - 1) / VEC;
    const long long L = (1LL << g.lanes_log2) < G ? (1LL << g.lanes_log2) : G;
    const long long total = g.N * P * L;
    const bool point_fast = (g.flags & F_POINT_FAST) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, out_vec = (g.flags & F_GO_VEC) != 0;
    constexpr int K = Taps<ND, MODE>::K;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        long long n, p, lane;
        if (point_fast) n = div_rem(div_rem(t, P, p), L, lane);
        else n = div_rem(div_rem(t, L, lane), P, p);
        long long od, oh, ow;
        point_at(p, g, od, oh, ow);
        A c[ND];
        grid_coords<T, A, ND, MODE, false>(grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW, g, c, nullptr);

        // Each tap once (PointTaps): its offset within a channel plane (-1 where it falls outside) and its weight
        // (bilinear; bicubic interpolates rows of taps with tp.xc, then the rows with tp.yc, as ATen does).
        const PointTaps<A, ND, MODE> tp(c, g);
        long long off[K];
        A w[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            off[k] = tp.ok(k) ? tp.src(k, g) : -1;
            w[k] = tp.w(k);
        }

        const T* in_n = inp + n * g.in_sN;
        T* out_n = out + n * g.go_sN + od * g.go_sD + oh * g.go_sH + ow * g.go_sW;
        for (long long cg = lane; cg < G; cg += L) {
            const long long c0 = cg * VEC;
            const int nc = min_nc(C, c0);
            const T* in_c = in_n + c0 * g.in_sC;
            A acc[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[c] = static_cast<A>(0);
            if constexpr (MODE == MODE_BICUBIC) {
                A rows[4][VEC];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    A v[4][VEC];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        if (off[4 * j + i] >= 0) {
                            load_ch(in_c + off[4 * j + i], g.in_sC, nc, in_vec, v[i]);
                        } else {
#pragma unroll
                            for (int c = 0; c < VEC; ++c) v[i][c] = static_cast<A>(0);
                        }
                    }
#pragma unroll
                    for (int c = 0; c < VEC; ++c) rows[j][c] = cubic_interp1d<A>(v[0][c], v[1][c], v[2][c], v[3][c], tp.xc);
                }
#pragma unroll
                for (int c = 0; c < VEC; ++c) acc[c] = cubic_interp1d<A>(rows[0][c], rows[1][c], rows[2][c], rows[3][c], tp.yc);
            } else if constexpr (MODE == MODE_NEAREST) {
                if (off[0] >= 0) load_ch(in_c + off[0], g.in_sC, nc, in_vec, acc);  // the value itself: -0.0 stays
            } else {
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (off[k] < 0) continue;
                    A v[VEC];
                    load_ch(in_c + off[k], g.in_sC, nc, in_vec, v);
#pragma unroll
                    for (int c = 0; c < VEC; ++c) acc[c] += v[c] * w[k];
                }
            }
            store_ch(out_n + c0 * g.go_sC, g.go_sC, nc, out_vec, acc);
        }
    }
}
