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
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW, pad = (int)g.pad;
    const bool align = g.align != 0, point_fast = (g.flags & F_POINT_FAST) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, out_vec = (g.flags & F_GO_VEC) != 0;
    constexpr int K = Taps<ND, MODE>::K;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        long long n, p, lane;
        if (point_fast) n = div_rem(div_rem(t, P, p), L, lane);
        else n = div_rem(div_rem(t, L, lane), P, p);
        long long ow, oh;
        const long long od = div_rem(div_rem(p, g.OW, ow), g.OH, oh);
        const T* gp = grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW;
        const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
        const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);

        // Each tap once: its offset within a channel plane (-1 where it falls outside) and its weight.
        long long off[K];
        A w[K];
        A tx = static_cast<A>(0), ty = static_cast<A>(0);
        if constexpr (MODE == MODE_BILINEAR) {
            const A ix = source_index(x, IW, pad, align), iy = source_index(y, IH, pad, align);
            const A iz = ND == 3 ? source_index(z, ID, pad, align) : static_cast<A>(0);
            const int x0 = static_cast<int>(m_floor(ix)), y0 = static_cast<int>(m_floor(iy)), z0 = static_cast<int>(m_floor(iz));
            const A wx[2] = {static_cast<A>(x0 + 1) - ix, ix - static_cast<A>(x0)};
            const A wy[2] = {static_cast<A>(y0 + 1) - iy, iy - static_cast<A>(y0)};
            const A wz[2] = {static_cast<A>(z0 + 1) - iz, iz - static_cast<A>(z0)};
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int dx = k & 1, dy = (k >> 1) & 1, dz = k >> 2;
                const int xx = x0 + dx, yy = y0 + dy, zz = z0 + dz;
                const bool inside = xx >= 0 && xx < IW && yy >= 0 && yy < IH && zz >= 0 && zz < ID;
                off[k] = inside ? zz * g.in_sD + yy * g.in_sH + xx * g.in_sW : -1;
                w[k] = ND == 3 ? wx[dx] * wy[dy] * wz[dz] : wx[dx] * wy[dy];
            }
        } else if constexpr (MODE == MODE_NEAREST) {
            const A ix = source_index(x, IW, pad, align), iy = source_index(y, IH, pad, align);
            const A iz = ND == 3 ? source_index(z, ID, pad, align) : static_cast<A>(0);
            const int xn = static_cast<int>(m_rint(ix)), yn = static_cast<int>(m_rint(iy)), zn = static_cast<int>(m_rint(iz));
            const bool inside = xn >= 0 && xn < IW && yn >= 0 && yn < IH && zn >= 0 && zn < ID;
            off[0] = inside ? zn * g.in_sD + yn * g.in_sH + xn * g.in_sW : -1;
            w[0] = static_cast<A>(1);  // unused
        } else {  // bicubic, 2-D: rows of 4 taps interpolated along x, then the 4 rows along y
            const A ix = unnormalize(x, IW, align), iy = unnormalize(y, IH, align);
            const A fx = m_floor(ix), fy = m_floor(iy);
            tx = ix - fx;
            ty = iy - fy;
            int rx[4], ry[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) { rx[i] = cubic_tap(fx, i, IW, pad, align); ry[i] = cubic_tap(fy, i, IH, pad, align); }
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int i = k & 3, j = k >> 2;
                off[k] = rx[i] >= 0 && ry[j] >= 0 ? ry[j] * g.in_sH + rx[i] * g.in_sW : -1;
                w[k] = static_cast<A>(1);  // unused: the cubic coefficients come from tx and ty
            }
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
                    for (int c = 0; c < VEC; ++c) rows[j][c] = cubic_interp1d<A>(v[0][c], v[1][c], v[2][c], v[3][c], tx);
                }
#pragma unroll
                for (int c = 0; c < VEC; ++c) acc[c] = cubic_interp1d<A>(rows[0][c], rows[1][c], rows[2][c], rows[3][c], ty);
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
