// grid_sample's deterministic backward for grad_input by counting (one program; 16- and 32-bit inputs, TUNING
// det_keys "count", the default): gs_count / gs_scan_* / gs_place / gs_gather_exact, a counting sort by
// destination pixel (no order within a pixel), then exact sums in int64 fixed point, which do not depend on the
// order. max |grad_output| comes from gs_absmax or gs_to_cl (grid_sample_layout.cu).

#include "grid_sample_common.cuh"

// Inclusive scan of n int64 (the counting sort's offsets): dst[i] = src[0] + ... + src[i]; exact, our own
// kernels so that a deterministic backward is one graph of our launches (CuPy's cumsum could not be
// recorded). In order: gs_scan_tiles (each block sums one tile of GS_SCAN_TILE), gs_scan_sums (one block:
// the tile sums become exclusive prefixes, in place), gs_scan_apply (each block scans its tile from its
// prefix).
#define GS_SCAN_THREADS 256
#define GS_SCAN_ITEMS 16
#define GS_SCAN_TILE (GS_SCAN_THREADS * GS_SCAN_ITEMS)

// Exclusive prefix of v over the block (blockDim.x a multiple of 32); *total: the block's sum.
__device__ __forceinline__ long long block_exclusive(long long v, long long* total) {
    __shared__ long long warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        long long s = lane < warps ? warp_sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const long long y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < warps) warp_sums[lane] = s;
    }
    __syncthreads();
    const long long before = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[warps - 1];
    __syncthreads();  // warp_sums is reused by the caller's next round
    return before + x - v;
}

__global__ void __launch_bounds__(GS_SCAN_THREADS) gs_scan_tiles(const long long* __restrict__ src,
                                                                 long long* __restrict__ sums, long long n) {
    const long long base = blockIdx.x * (long long)GS_SCAN_TILE;
    long long v = 0;
    for (int k = 0; k < GS_SCAN_ITEMS; ++k) {
        const long long i = base + k * GS_SCAN_THREADS + threadIdx.x;
        if (i < n) v += src[i];
    }
    long long total;
    block_exclusive(v, &total);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

__global__ void __launch_bounds__(1024) gs_scan_sums(long long* __restrict__ sums, long long tiles) {
    long long carry = 0;
    for (long long start = 0; start < tiles; start += blockDim.x) {
        const long long i = start + threadIdx.x;
        const long long v = i < tiles ? sums[i] : 0;
        long long total;
        const long long before = block_exclusive(v, &total);
        if (i < tiles) sums[i] = carry + before;
        carry += total;
    }
}

__global__ void __launch_bounds__(GS_SCAN_THREADS) gs_scan_apply(const long long* __restrict__ src,
                                                                 long long* __restrict__ dst,
                                                                 const long long* __restrict__ sums, long long n) {
    const long long first = blockIdx.x * (long long)GS_SCAN_TILE + threadIdx.x * (long long)GS_SCAN_ITEMS;
    long long v[GS_SCAN_ITEMS], local = 0;
    for (int k = 0; k < GS_SCAN_ITEMS; ++k) {
        v[k] = first + k < n ? src[first + k] : 0;
        local += v[k];
    }
    long long total;
    long long run = sums[blockIdx.x] + block_exclusive(local, &total);
    for (int k = 0; k < GS_SCAN_ITEMS; ++k) {
        run += v[k];
        if (first + k < n) dst[first + k] = run;
    }
}

// Deterministic backward, counting form (16- and 32-bit inputs; TUNING det_keys = "count"): gs_count
// counts each destination pixel's contributions (and stores the points' coordinates), a scan turns the
// counts into segment offsets, gs_place writes each (point, tap) into its destination's segment (in
// whatever order the atomics give), and gs_gather_exact sums each segment exactly in int64 fixed point,
// so that order does not matter: no sort. The scale, 2^e with e = 59 - ceil(log2(count)) - k and
// max |grad_output| < 2^k (gs_absmax, or the transpose that makes grad_output channels-last), keeps every
// sum below 2^61 (a contribution is |grad_output| times weights summing to at most 4, bicubic's included)
// and rounds each contribution to a multiple of 2^-e: at most 2^-(57 - ceil(log2(count))) * max.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_count(const T* __restrict__ grid, A* __restrict__ coords,
                                                unsigned long long* __restrict__ counts, const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long S = g.ID * g.IH * g.IW;
    store_points<T, A, ND, MODE>(grid, coords, g, [&](long long n, long long, long long, const PointTaps<A, ND, MODE>& tp) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (tp.ok(k)) atomicAdd(counts + n * S + tp.dst(k), 1ULL);
        }
    });
}

// After the scan (offsets[q + 1] = counts[0] + ... + counts[q], offsets[0] = 0): entries[slot] = p * K + k.
// counts count down to 0 on the way (they are not needed afterwards).
template <typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_place(const A* __restrict__ coords, const long long* __restrict__ offsets,
                                                unsigned long long* __restrict__ counts, long long* __restrict__ entries,
                                                const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, S = g.ID * g.IH * g.IW;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        long long p;
        const long long n = div_rem(np, P, p);
        const PointTaps<A, ND, MODE> tp = stored_taps<A, ND, MODE>(coords, np, g);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!tp.ok(k)) continue;
            const long long q = n * S + tp.dst(k);
            const unsigned long long left = atomicAdd(counts + q, ~0ULL);  // -1: slots fill from the end
            entries[offsets[q] + (long long)left - 1] = p * K + k;
        }
    }
}

// L lanes per destination pixel, VEC channels per lane: the segment's contributions (w * grad_output in A)
// rounded to multiples of 2^-e and summed exactly in int64 (one conversion and one add each); NaN / inf contributions tracked apart (NaN, or +inf
// with -inf, gives NaN; otherwise the infinity), as an IEEE sum in any order would.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_gather_exact(const long long* __restrict__ entries,
                                                       const long long* __restrict__ offsets,
                                                       const A* __restrict__ coords, const T* __restrict__ go,
                                                       T* __restrict__ gi, const Geo g,
                                                       const unsigned long long* __restrict__ go_max) {
    constexpr int K = Taps<ND, MODE>::K;
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const long long P = g.OD * g.OH * g.OW, S = g.ID * g.IH * g.IW, C = g.C;
    const long long total = (g.N * S) << lg;
    const bool go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    const double mx = __longlong_as_double((long long)*go_max);
    int kmax = 0;
    if (mx > 0.0) frexp(mx, &kmax);
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        const long long q = t >> lg;
        const int l = (int)(t & (L - 1));
        const long long n = q / S;
        const long long start = offsets[q], end = offsets[q + 1];
        const int count_log2 = end - start > 1 ? 64 - __clzll((unsigned long long)(end - start - 1)) : 0;
        const int e = 59 - count_log2 - kmax;
        const double scale = ldexp(1.0, e), unscale = ldexp(1.0, -e);
        for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
            const int nc = min_nc(C, c0);
            long long acc[VEC];
            unsigned int special[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) { acc[c] = 0; special[c] = 0u; }
            for (long long i = start; i < end; ++i) {
                A gv[VEC];
                const A w = entry_contribution<T, A, ND, MODE>(entries[i], n * P, coords, go, g, c0, nc, go_vec, gv);
#pragma unroll
                for (int c = 0; c < VEC; ++c) {
                    const double v = static_cast<double>(w * gv[c]);
                    const double x = v * scale;  // exact: the scale is a power of two
                    if (fabs(x) < 2305843009213693952.0) acc[c] += __double2ll_rn(x);  // 2^61: finite, in range
                    else special[c] |= v != v ? 1u : v > 0 ? 2u : 4u;
                }
            }
            A out[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) {
                const unsigned int f = special[c];
                const double nan = __longlong_as_double(0x7ff8000000000000LL), inf = __longlong_as_double(0x7ff0000000000000LL);
                const double v = f == 0 ? static_cast<double>(acc[c]) * unscale
                               : ((f & 1u) || (f & 6u) == 6u) ? nan : (f & 2u) ? inf : -inf;
                out[c] = static_cast<A>(v);
            }
            store_ch(gi + q * C + c0, 1, nc, gi_vec, out);
        }
    }
}
