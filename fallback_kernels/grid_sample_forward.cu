// grid_sample forward (one program): gs_forward, L lanes per output point, each building the point's taps once
// (PointTaps, grid_sample_common.cuh) and looping over channel groups, reading taps from global memory; and
// gs_forward_plane, channels-first planes staged in shared memory (grid_sample.py picks, _plane_shape).

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
// The plane kernel's choice (see gs_forward_coords): more than a quarter of the warps of points scattered.
__device__ __forceinline__ bool plane_chosen(const unsigned long long* scattered, const Geo& g) {
    const unsigned long long warps = (unsigned long long)((g.N * g.OD * g.OH * g.OW + 31) / 32);
    return *scattered * 4 > warps;
}

// `scattered` (null: always run): gs_forward_coords' count; the gather kernel runs where the plane kernel does not.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256, GS_FWD_BLOCKS(A, ND, MODE)) gs_forward(const T* __restrict__ inp, const T* __restrict__ grid,
                                                  T* __restrict__ out, const Geo g,
                                                  const unsigned long long* __restrict__ scattered) {
    if (scattered != nullptr && plane_chosen(scattered, g)) return;
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

// ---------------------------------------------------------------------------------------------------
// Forward through shared memory (channels-first input and output): gs_forward_coords stores each point's
// source coordinates, then gs_forward_plane block b takes batch item n, channels c0 .. c0 + nc (cpb a block) and
// one of `splits` ranges of points. It copies its nc input planes into shared memory, each read from global
// memory once and coalesced, then a thread takes GS_PLANE_R points at a time (their coordinates' reads in flight
// together), builds each point's taps once and reads them from shared memory for each channel. The gather
// kernel above reads every tap from global memory: on a scattered grid each tap is a separate line in L2, and
// ATen's kernel (the same reads) ran 1.1-1.6x faster than it there; here the grid's order does not matter.
// F_PLANE_VEC: dense planes whose starts and sizes are 16-byte multiples, copied in 16-byte chunks
// asynchronously (cp.async, sm_80+) while the first coordinates load; else element by element.
// ---------------------------------------------------------------------------------------------------
#ifndef GS_PLANE_THREADS
#define GS_PLANE_THREADS 256
#endif
#ifndef GS_PLANE_POINTS
#define GS_PLANE_POINTS 4
#endif
// Points a thread takes at once: GS_PLANE_POINTS, one for bicubic and float64 (their taps alone fill registers).
#define GS_PLANE_R(A, MODE) ((MODE) == MODE_BICUBIC || sizeof(A) == 8 ? 1 : GS_PLANE_POINTS)

__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::);
#endif
}

template <typename T> __device__ __forceinline__ void copy_planes(T* planes, int Es, const T* in_c, int nc, const Geo& g) {
    const int IW = (int)g.IW, IH = (int)g.IH, E = (int)(g.ID * g.IH * g.IW);
    if (g.flags & F_PLANE_VEC) {
        const int chunks = (int)((long long)E * sizeof(T) / 16);
        for (int i = threadIdx.x; i < nc * chunks; i += blockDim.x) {
            const int ch = i / chunks, j = i - ch * chunks;
            copy16_async(reinterpret_cast<uint4*>(planes + ch * Es) + j, reinterpret_cast<const uint4*>(in_c + ch * g.in_sC) + j);
        }
    } else {
        for (int i = threadIdx.x; i < nc * E; i += blockDim.x) {
            const int ch = i / E, e = i - ch * E, x = e % IW, r = e / IW, y = r % IH, z = r / IH;
            planes[ch * Es + e] = in_c[ch * g.in_sC + z * g.in_sD + y * g.in_sH + x * g.in_sW];
        }
    }
}

// One point's output for nc channels from the planes in shared memory (taps built once).
template <typename T, typename A, int ND, int MODE>
__device__ __forceinline__ void plane_point(const T* planes, int Es, int nc, const A c[ND], const Geo& g, T* o) {
    constexpr int K = Taps<ND, MODE>::K;
    const PointTaps<A, ND, MODE> tp(c, g);
    int at[K];  // each tap's index within a plane, -1 outside
    A w[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        at[k] = tp.ok(k) ? tp.template dst<int>(k) : -1;
        w[k] = tp.w(k);
    }
    for (int ch = 0; ch < nc; ++ch) {
        const T* pl = planes + ch * Es;
        A acc = static_cast<A>(0);
        if constexpr (MODE == MODE_BICUBIC) {
            A rows[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                A v[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) v[i] = at[4 * j + i] >= 0 ? static_cast<A>(to_acc(pl[at[4 * j + i]])) : static_cast<A>(0);
                rows[j] = cubic_interp1d<A>(v[0], v[1], v[2], v[3], tp.xc);
            }
            acc = cubic_interp1d<A>(rows[0], rows[1], rows[2], rows[3], tp.yc);
        } else if constexpr (MODE == MODE_NEAREST) {
            if (at[0] >= 0) acc = static_cast<A>(to_acc(pl[at[0]]));  // the value itself: -0.0 stays
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (at[k] >= 0) acc += static_cast<A>(to_acc(pl[at[k]])) * w[k];
        }
        o[ch * g.go_sC] = from_acc<T>(acc);
    }
}

// The plane kernel's first pass: each output point's source coordinates, coords[np * ND + a] (np = n * P + p),
// from its grid values through ATen's forward coordinate functions. Per point and channel group the plane
// kernel then only builds the taps from them: computed in its own loop (64-bit index decoding, padding, the
// grid's strides) they measured ~300 issue slots a warp of points, the kernel's whole time (H100).
// It also counts the warps whose 32 points' taps spread over a box of more than GS_PLANE_SPREAD pixels
// (`scattered`, zeroed before): on smooth grids the gather kernel reads few lines a warp and ran 1.5-3x faster
// than staging planes, on scattered ones 1.5-3x slower; the kernels after it run whichever the count says.
#ifndef GS_PLANE_SPREAD
#define GS_PLANE_SPREAD 1024
#endif
__device__ __forceinline__ int warp_extent(int v, int size, unsigned int mask) {
#if __CUDA_ARCH__ >= 800
    const int c = v < -1 ? -1 : v > size ? size : v;  // taps beyond the edge are alike: no overflow below
    return __reduce_max_sync(mask, c) - __reduce_min_sync(mask, c) + 1;
#else
    return 1;  // no warp reductions before sm_80: no warp counts as scattered, the gather kernel runs
#endif
}

template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_forward_coords(const T* __restrict__ grid, A* __restrict__ coords, const Geo g,
                                                         unsigned long long* __restrict__ scattered) {
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        long long p;
        const long long n = div_rem(np, P, p);
        A c[ND];
        grid_point<T, A, ND, MODE, false>(grid, n, p, g, c, nullptr);
#pragma unroll
        for (int a = 0; a < ND; ++a) coords[np * ND + a] = c[a];
        const unsigned int mask = __activemask();
        const A big = static_cast<A>(1 << 30);  // a NaN or huge coordinate: outside, as any beyond the edge
        auto cell = [&](A v) { return m_finite(v) && m_fabs(v) < big ? static_cast<int>(m_floor(v)) : -2; };
        long long box = (long long)warp_extent(cell(c[0]), (int)g.IW, mask) * warp_extent(cell(c[1]), (int)g.IH, mask);
        if constexpr (ND == 3) box *= warp_extent(cell(c[2]), (int)g.ID, mask);
        if (box > GS_PLANE_SPREAD && (threadIdx.x & 31) == __ffs(mask) - 1) atomicAdd(scattered, 1ULL);
    }
}

// Output planes are dense (the output is ours): point p of channel c is out_n[c * go_sC + p].
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(GS_PLANE_THREADS, 1) gs_forward_plane(const T* __restrict__ inp, const A* __restrict__ coords,
                                                                        T* __restrict__ out, const Geo g, const int cpb,
                                                                        const int splits,
                                                                        const unsigned long long* __restrict__ scattered) {
    if (!plane_chosen(scattered, g)) return;
    extern __shared__ __align__(16) unsigned char gs_plane_smem[];
    T* planes = reinterpret_cast<T*>(gs_plane_smem);
    const int Es = (int)((((long long)(g.ID * g.IH * g.IW) * sizeof(T) + 15) / 16) * 16 / sizeof(T));  // plane stride
    const long long CG = (g.C + cpb - 1) / cpb;
    long long s, cg;
    const long long n = div_rem(div_rem((long long)blockIdx.x, splits, s), CG, cg);
    const long long c0 = cg * cpb;
    const int nc = (int)((g.C - c0) < cpb ? (g.C - c0) : cpb);
    copy_planes(planes, Es, inp + n * g.in_sN + c0 * g.in_sC, nc, g);

    constexpr int R = GS_PLANE_R(A, MODE);
    const long long P = g.OD * g.OH * g.OW, per = (P + splits - 1) / splits, p1 = (s + 1) * per < P ? (s + 1) * per : P;
    const long long step = (long long)R * blockDim.x;
    const A* coords_n = coords + n * P * ND;
    T* out_n = out + n * g.go_sN + c0 * g.go_sC;
    A c[R][ND];
    auto load = [&](long long q) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long p = q + (long long)r * blockDim.x;
            if (p < p1) {
#pragma unroll
                for (int a = 0; a < ND; ++a) c[r][a] = coords_n[p * ND + a];
            }
        }
    };
    long long q = s * per + threadIdx.x;
    load(q);  // the first points' coordinates load while the planes copy
    copy_async_wait();
    __syncthreads();
    for (; q < p1; q += step) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (q + (long long)r * blockDim.x < p1) plane_point<T, A, ND, MODE>(planes, Es, nc, c[r], g, out_n + q + (long long)r * blockDim.x);
        load(q + step);
    }
}

// ---------------------------------------------------------------------------------------------------
// Channels-first with many points (grid_sample.py's _point_kernel says where): ATen's loop order, one thread
// per output point over every channel, a channel's taps then the next channel's, with 32-bit tap offsets
// (the plan checks a batch item's input span fits). Against gs_forward on f16 (32,32,64,64) it ran 40 % fewer
// instructions (ncu, H100: gs_forward 9.8M, ATen's 5.9M), and on 3-D random grids ATen's loop order had twice
// gs_forward's L1 hit rate (53 % against 22 %: one channel's taps share lines; four channels' taps in flight
// do not). On 2-D grids a warp whose points' taps lie in a box of at most GS_CF_SPREAD pixels (a smooth
// grid) issues GS_CF_UNROLL channels an iteration, a scattered one a channel at a time: unrolled, affine grids
// ran up to 1.2x faster and random ones up to 1.15x slower (H100, tools/probe_grid_sample_forward.py); 3-D
// grids (eight taps a channel) ran slower unrolled on affine grids too (10.3 against 9.2 us), so one. Bilinear and
// nearest; `scattered` as gs_forward's (null: always run).
// ---------------------------------------------------------------------------------------------------
#ifndef GS_CF_UNROLL
#define GS_CF_UNROLL 4
#endif
#ifndef GS_CF_SPREAD
#define GS_CF_SPREAD 1024
#endif
// Fewer channels than this never unroll and skip the warp reductions that measure the box: at C = 3 (fewer than
// an unrolled iteration takes) the unrolled loop and the reductions cost affine grids 6 % (f32 (8,3,256,256) ->
// 224x224, H100: 9.63 -> 9.07 us, torch 8.53; random 19.81 -> 19.73, torch 19.45).
#ifndef GS_CF_MIN_UNROLL_C
#define GS_CF_MIN_UNROLL_C GS_CF_UNROLL
#endif
// GS_CF_SPLIT threads share a point's channels, a contiguous range each (thread t: range t / (N*P)), so a
// small grid has that many more threads in flight; 1 (ATen's): one thread a point over every channel.
#ifndef GS_CF_SPLIT
#define GS_CF_SPLIT 1
#endif
template <typename T, typename A, int MODE, int K, int UNROLL>
__device__ __forceinline__ void cf_channels(const T* __restrict__ in_c, T* __restrict__ out_c, const int (&off)[K],
                                            const A (&w)[K], int C, int in_sC, long long go_sC) {
#pragma unroll UNROLL
    for (int ch = 0; ch < C; ++ch) {
        A acc = static_cast<A>(0);
        if constexpr (MODE == MODE_NEAREST) {
            if (off[0] >= 0) acc = to_acc(in_c[off[0]]);  // the value itself: -0.0 stays
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (off[k] >= 0) acc += static_cast<A>(to_acc(in_c[off[k]])) * w[k];
        }
        *out_c = from_acc<T>(acc);
        in_c += in_sC;
        out_c += go_sC;
    }
}

template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_forward_cf(const T* __restrict__ inp, const T* __restrict__ grid,
                                                     T* __restrict__ out, const Geo g,
                                                     const unsigned long long* __restrict__ scattered) {
    static_assert(MODE != MODE_BICUBIC, "bicubic forwards take gs_forward");
    if (scattered != nullptr && plane_chosen(scattered, g)) return;
    constexpr int K = Taps<ND, MODE>::K;
    const int P = (int)(g.OD * g.OH * g.OW), points = (int)g.N * P;  // N * P * GS_CF_SPLIT < 2^31: the plan checks
    const int span = ((int)g.C + GS_CF_SPLIT - 1) / GS_CF_SPLIT;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < points * GS_CF_SPLIT; t += gridDim.x * blockDim.x) {
        const int part = t / points, q = t - part * points;
        const int c0 = part * span, C = min((int)g.C - c0, span);
        if (C <= 0) continue;
        const int n = q / P, p = q - n * P;
        int od, oh, ow;
        point_at(p, g, od, oh, ow);
        A c[ND];
        grid_coords<T, A, ND, MODE, false>(grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW, g, c, nullptr);
        const PointTaps<A, ND, MODE> tp(c, g);
        int off[K];
        A w[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            off[k] = tp.ok(k) ? (int)tp.src(k, g) : -1;
            w[k] = tp.w(k);
        }
        const T* in_c = inp + n * g.in_sN + (long long)c0 * g.in_sC;
        T* out_c = out + n * g.go_sN + od * g.go_sD + oh * g.go_sH + ow * g.go_sW + (long long)c0 * g.go_sC;
        if constexpr (ND == 3 || sizeof(A) == 8) {  // 3-D: unrolled ran slower (above); float64: it spilled
            cf_channels<T, A, MODE, K, 1>(in_c, out_c, off, w, C, (int)g.in_sC, g.go_sC);
        } else if (C < GS_CF_MIN_UNROLL_C) {  // uniform at GS_CF_SPLIT 1 (else the shuffles' __activemask copes)
            cf_channels<T, A, MODE, K, 1>(in_c, out_c, off, w, C, (int)g.in_sC, g.go_sC);
        } else {
            const unsigned int mask = __activemask();
            const long long box = (long long)warp_extent(tp.x0, (int)g.IW, mask) * warp_extent(tp.y0, (int)g.IH, mask);
            if (box <= GS_CF_SPREAD) cf_channels<T, A, MODE, K, GS_CF_UNROLL>(in_c, out_c, off, w, C, (int)g.in_sC, g.go_sC);
            else cf_channels<T, A, MODE, K, 1>(in_c, out_c, off, w, C, (int)g.in_sC, g.go_sC);
        }
    }
}
