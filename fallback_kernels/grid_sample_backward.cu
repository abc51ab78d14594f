// grid_sample's fast backward through global memory (one program): gs_backward, L lanes per output point, VEC
// contiguous channels per lane. grad_input is scattered with atomics into a channels-last accumulator in A
// (vector red.v4.f32 on sm_90); grad_grid is reduced over channels in registers + warp shuffles (no atomics),
// so it is deterministic, and the deterministic backwards launch this kernel for grad_grid alone.
// The shared-memory form of the fast backward is grid_sample_tile.cu.

#include "grid_sample_common.cuh"

__device__ __forceinline__ void red_add(float* p, float v) { asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) ); }
__device__ __forceinline__ void red_add(double* p, double v) { asm volatile("red.global.add.f64 [%0], %1;" :: "l"(p), "d"(v) ); }

// p[k] += v[k] for k < nc (channels-last accumulator: consecutive channels are consecutive in memory).
__device__ __forceinline__ void red_add_ch(float* p, int nc, bool vec, const float v[VEC]) {
#if __CUDA_ARCH__ >= 900
    if (vec && nc == VEC) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]));
        return;
    }
#endif
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        if (k < nc) red_add(p + k, v[k]);
}
__device__ __forceinline__ void red_add_ch(double* p, int nc, bool, const double v[VEC]) {
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        if (k < nc) red_add(p + k, v[k]);
}

__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ double shfl_xor(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }

// ---------------------------------------------------------------------------------------------------
// Fast backward. L = 2^lanes_log2 lanes share one output point; lane l takes channels [l*VEC, l*VEC+VEC),
// then + L*VEC. gi: channels-last (N, D, H, W, C) accumulator in A, zeroed by the caller (F_GI).
// gg: contiguous (N, OD, OH, OW, ND) grad_grid (F_GG). inp (for grad_grid) and go: any strides.
// ---------------------------------------------------------------------------------------------------
// Blocks of 256 per SM the fast backward is compiled for: as many as fit without spilling (sm_90, ptxas -v);
// -DGS_BWD_MIN_BLOCKS=n overrides (tuning).
#ifdef GS_BWD_MIN_BLOCKS
#define GS_BWD_BLOCKS(A, ND, MODE) GS_BWD_MIN_BLOCKS
#else
#define GS_BWD_BLOCKS(A, ND, MODE) \
    (sizeof(A) == 8 || (MODE) == MODE_BICUBIC ? 1 : (MODE) == MODE_NEAREST ? 4 : (ND) == 2 ? 3 : 2)
#endif
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256, GS_BWD_BLOCKS(A, ND, MODE)) gs_backward(const T* __restrict__ go, const T* __restrict__ inp,
                                                   const T* __restrict__ grid, A* __restrict__ gi,
                                                   T* __restrict__ gg, const Geo g) {
    constexpr int K = PointTaps<A, ND, MODE>::K;
    constexpr int KB = K <= 8 ? K : 4;  // taps whose input loads are in flight together (bicubic: a row)
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, C = g.C;
    const long long total = NP << lg;
    const bool do_gi = (g.flags & F_GI) != 0, do_gg = (g.flags & F_GG) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    const long long S = g.ID * g.IH * g.IW;
    // Whole warps iterate together so the shuffles below always see all 32 lanes.
    for (long long base = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); base < total;
         base += (long long)gridDim.x * blockDim.x) {
        const long long t = base + (threadIdx.x & 31);
        const long long np = t >> lg;
        const int l = (int)(t & (L - 1));
        const bool active = np < NP;
        A gsum[ND], mult[ND];
#pragma unroll
        for (int a = 0; a < ND; ++a) { gsum[a] = static_cast<A>(0); mult[a] = static_cast<A>(0); }
        if (active) {
            long long p;
            const long long n = div_rem(np, P, p);
            long long od, oh, ow;
            point_at(p, g, od, oh, ow);
            A c[ND];
            grid_coords<T, A, ND, MODE>(grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW, g, c, mult);
            const PointTaps<A, ND, MODE> tp(c, g);
            const T* go_p = go + n * g.go_sN + od * g.go_sD + oh * g.go_sH + ow * g.go_sW;
            const T* in_n = inp + n * g.in_sN;
            A* gi_n = gi + n * S * C;
            // Channels to visit: for grad_input where a tap falls inside; for grad_grid (nearest's is 0) too, or
            // always for bicubic, whose outside taps count (0 * NaN).
            const bool work = (do_gi && tp.any()) || (MODE != MODE_NEAREST && do_gg && (tp.any() || MODE == MODE_BICUBIC));
            const long long c_end = work ? C : 0;
#pragma unroll 1
            for (long long c0 = (long long)l * VEC; c0 < c_end; c0 += (long long)L * VEC) {
                const int nc = min_nc(C, c0);
                A gv[VEC];
                load_ch(go_p + c0 * g.go_sC, g.go_sC, nc, go_vec, gv);
                if (MODE != MODE_NEAREST && do_gg) {  // nearest: grad_grid is 0 (mult is 0), no input read
#pragma unroll
                    for (int k0 = 0; k0 < K; k0 += KB) {
                        A v[KB][VEC];
#pragma unroll
                        for (int b = 0; b < KB; ++b) {
                            if (tp.ok(k0 + b)) {
                                load_ch(in_n + tp.src(k0 + b, g) + c0 * g.in_sC, g.in_sC, nc, in_vec, v[b]);
                            } else {
#pragma unroll
                                for (int c = 0; c < VEC; ++c) v[b][c] = static_cast<A>(0);
                            }
                        }
#pragma unroll
                        for (int b = 0; b < KB; ++b) {
                            if (!tp.in_gg(k0 + b)) continue;
                            A dot = static_cast<A>(0);
#pragma unroll
                            for (int c = 0; c < VEC; ++c) dot += v[b][c] * gv[c];
#pragma unroll
                            for (int a = 0; a < ND; ++a) gsum[a] += tp.cg(a, k0 + b) * dot;
                        }
                    }
                }
                if (do_gi) {
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        if (!tp.ok(k)) continue;
                        const A w = tp.w(k);
                        A d[VEC];
#pragma unroll
                        for (int c = 0; c < VEC; ++c) d[c] = w * gv[c];
                        red_add_ch(gi_n + tp.dst(k) * C + c0, nc, gi_vec, d);
                    }
                }
            }
        }
        if (do_gg) {  // uniform across the grid: every lane of the warp reaches the shuffles
#pragma unroll
            for (int a = 0; a < ND; ++a)
                for (int m = L >> 1; m > 0; m >>= 1) gsum[a] += shfl_xor(gsum[a], m);
            if (active && l == 0) {
#pragma unroll
                for (int a = 0; a < ND; ++a) gg[np * ND + a] = from_acc<T>(mult[a] * gsum[a]);
            }
        }
    }
}
