// grid_sample's backward through shared memory (one program, 16- and 32-bit inputs with dense channel planes):
// gs_tile_sort, gs_tile_gather and gs_gg_sum; fast, or deterministic with each segment sorted.

#include "grid_sample_common.cuh"

// ---------------------------------------------------------------------------------------------------
// Fast backward through shared memory ("tile"): 16- and 32-bit inputs whose channel planes are dense, float
// accumulation, no atomics on grad_input, no zeroed scratch, no transposes. Two kernels:
//   gs_tile_sort    block (g, n): a counting sort in shared memory of the (point, tap) contributions of batch
//                   item n that land in pixel range g (pixels [g * R, g * R + R)): entries (point, weight)
//                   grouped by destination pixel in region n * G + g of `entries` (K * P slots, room for every
//                   tap), and ends[n * S + d] = the end of pixel d's segment in that region (its start is the
//                   previous pixel's end, 0 at the range's first pixel). Sorted once, read by every channel slice.
//   gs_tile_gather  block (slice, n): copies the slice's V = 16 / sizeof(T) channels of grad_output (and of the
//                   input, for grad_grid) to shared memory pixel-major, one 16-byte chunk per point or pixel;
//                   then each thread sums pixels' segments (per entry: one chunk load, V FMAs) and writes their
//                   grad_input once, and takes points for grad_grid (one chunk per tap). grad_grid goes out
//                   directly (one slice) or as float partials that gs_gg_sum adds in slice order.
// The order of entries within a segment follows shared-memory atomics (fast), or, for the deterministic
// backward, is sorted by (point, weight) in the sort kernel: then every sum has one order, bit-identical run to run.
// ---------------------------------------------------------------------------------------------------

// Threads per block (TILE_THREADS in grid_sample.py): bicubic's 16 taps need more than 64 registers.
#define GS_TILE_THREADS(MODE) ((MODE) == MODE_BICUBIC ? 512 : 1024)

// Word d of a shared array at word_at(d): its low 5 bits XORed with a hash of the rest, a permutation within each
// 32 words, so points stepping down a column (or any regular stride) hit scattered banks instead of one.
__device__ __forceinline__ int word_at(int d) { return d ^ (int)(((unsigned int)(d >> 5) * 0x9E3779B1u) >> 27); }

// 16-byte chunk q at chunk_at(q): its low 3 bits (the position in a 128-byte bank row) XOR-folded with the higher
// bits, so chunks a power-of-two stride apart (a column of a 2^k-wide plane) spread over the row.
__device__ __forceinline__ int chunk_at(int q) { return (q & ~7) | ((q ^ (q >> 3) ^ (q >> 6) ^ (q >> 9)) & 7); }

template <typename T> struct Chunk { static constexpr int V = 16 / (int)sizeof(T); };  // values per chunk

__device__ __forceinline__ unsigned int word_of(const uint4& u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

__device__ __forceinline__ void chunk_values(const uint4& u, float f[4], const float*) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
template <typename H> __device__ __forceinline__ void chunk_values(const uint4& u, float f[8], const H* tag) {
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack2(word_of(u, i), f[2 * i], f[2 * i + 1], tag);
}

// Value j of each of V chunks (V channels' runs of V values), as one chunk: a V x V transpose in registers.
__device__ __forceinline__ uint4 chunk_transpose(const uint4 (&v)[4], int j) {
    return make_uint4(word_of(v[0], j), word_of(v[1], j), word_of(v[2], j), word_of(v[3], j));
}
__device__ __forceinline__ uint4 chunk_transpose(const uint4 (&v)[8], int j) {
    const unsigned int sel = (j & 1) ? 0x7632u : 0x5410u, w = (unsigned int)j >> 1;
    return make_uint4(__byte_perm(word_of(v[0], w), word_of(v[1], w), sel), __byte_perm(word_of(v[2], w), word_of(v[3], w), sel),
                      __byte_perm(word_of(v[4], w), word_of(v[5], w), sel), __byte_perm(word_of(v[6], w), word_of(v[7], w), sel));
}

// Channels [0, nc) of dense planes `sC` apart (16-byte aligned, `count` values each, a multiple of V) to chunks:
// chunk q = the V channels of value q, zeros past nc.
template <typename T>
__device__ __forceinline__ void tile_stage(const T* __restrict__ src, long long sC, int nc, int count, uint4* dst) {
    constexpr int V = Chunk<T>::V;
    for (int i = threadIdx.x; i < count / V; i += blockDim.x) {
        uint4 v[V];
#pragma unroll
        for (int c = 0; c < V; ++c) v[c] = c < nc ? __ldg(reinterpret_cast<const uint4*>(src + c * sC) + i) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int j = 0; j < V; ++j) dst[chunk_at(V * i + j)] = chunk_transpose(v, j);
    }
}

// Exclusive prefix sum of a[word_at(0 .. n)) in place (a block-wide call); returns the total.
__device__ int block_exclusive_scan(int* a, int n) {
    __shared__ int warp_sum[33];
    const int tid = threadIdx.x, per = (n + blockDim.x - 1) / blockDim.x, b0 = tid * per;
    int sum = 0;
    for (int i = 0; i < per; ++i) if (b0 + i < n) sum += a[word_at(b0 + i)];
    int incl = sum;
    for (int m = 1; m < 32; m <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, m);
        if ((tid & 31) >= m) incl += v;
    }
    if ((tid & 31) == 31) warp_sum[tid >> 5] = incl;
    __syncthreads();
    if (tid < 32) {
        const int t = tid < (int)(blockDim.x >> 5) ? warp_sum[tid] : 0;
        int ti = t;
        for (int m = 1; m < 32; m <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, ti, m);
            if (tid >= m) ti += v;
        }
        warp_sum[tid] = ti - t;
        if (tid == 31) warp_sum[32] = ti;
    }
    __syncthreads();
    int run = warp_sum[tid >> 5] + incl - sum;
    for (int i = 0; i < per; ++i)
        if (b0 + i < n) {
            const int v = a[word_at(b0 + i)];
            a[word_at(b0 + i)] = run;
            run += v;
        }
    const int total = warp_sum[32];
    __syncthreads();  // warp_sum is reused by the next call
    return total;
}

// f(point, pixel - d0, weight) for every tap of batch item n's points (this thread's share) landing in pixels
// [d0, d0 + nr).
template <typename T, int ND, int MODE, typename F>
__device__ __forceinline__ void range_taps(const T* __restrict__ grid, long long n, const Geo& g, int d0, int nr, F f) {
    constexpr int K = PointTaps<float, ND, MODE>::K;
    const int P = (int)(g.OD * g.OH * g.OW);
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        float c[ND], mult[ND];
        grid_point<T, float, ND, MODE>(grid, n, p, g, c, mult);
        const PointTaps<float, ND, MODE> tp(c, g);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!tp.ok(k)) continue;
            const int d = tp.template dst<int>(k) - d0;
            if ((unsigned int)d < (unsigned int)nr) f(p, d, tp.w(k));
        }
    }
}

// Entries in (point, weight bits) order: one order for a segment whatever order the atomics placed it in.
__device__ __forceinline__ unsigned long long entry_key(int2 e) {
    return ((unsigned long long)(unsigned int)e.x << 32) | (unsigned int)e.y;
}

__device__ __forceinline__ void sift_down(int2* e, int root, int n) {
    for (int c = 2 * root + 1; c < n; root = c, c = 2 * root + 1) {
        if (c + 1 < n && entry_key(e[c + 1]) > entry_key(e[c])) ++c;
        if (entry_key(e[root]) >= entry_key(e[c])) return;
        const int2 t = e[root];
        e[root] = e[c];
        e[c] = t;
    }
}

// Sort e[0 .. n) by entry_key: insertion sort for the usual few entries, heapsort (n log n) for the long
// segments of pixels many points clamp onto (border padding, degenerate grids).
__device__ void sort_segment(int2* e, int n) {
    if (n <= 16) {
        for (int i = 1; i < n; ++i) {
            const int2 v = e[i];
            const unsigned long long k = entry_key(v);
            int j = i - 1;
            for (; j >= 0 && entry_key(e[j]) > k; --j) e[j + 1] = e[j];
            e[j + 1] = v;
        }
        return;
    }
    for (int i = n / 2 - 1; i >= 0; --i) sift_down(e, i, n);
    for (int end = n - 1; end > 0; --end) {
        const int2 t = e[0];
        e[0] = e[end];
        e[end] = t;
        sift_down(e, 0, end);
    }
}

// Shared memory: roundup(R, 32) ints of counts / offsets, then `cap` staged entries (copied out with coalesced
// stores when the range's entries fit, else placed straight into global memory). ordered: sort each segment
// (the deterministic backward), so the gather sums it in one order.
template <typename T, int ND, int MODE>
__global__ void __launch_bounds__(GS_TILE_THREADS(MODE)) gs_tile_sort(const T* __restrict__ grid, int2* __restrict__ entries,
                                                                      int* __restrict__ ends, const Geo g, int R, int cap,
                                                                      int ordered) {
    constexpr int K = PointTaps<float, ND, MODE>::K;
    extern __shared__ __align__(16) unsigned char smem[];
    const int S = (int)(g.ID * g.IH * g.IW), P = (int)(g.OD * g.OH * g.OW), G = gridDim.x;
    const int d0 = blockIdx.x * R, nr = min(S - d0, R), rows = (nr + 31) & ~31;
    int* off = reinterpret_cast<int*>(smem);
    int2* staged = reinterpret_cast<int2*>(smem + (((R + 31) & ~31) * 4 + 15) / 16 * 16);
    for (long long n = blockIdx.y; n < g.N; n += gridDim.y) {
        for (int i = threadIdx.x; i < rows; i += blockDim.x) off[i] = 0;
        __syncthreads();
        range_taps<T, ND, MODE>(grid, n, g, d0, nr, [&](int, int d, float) { atomicAdd(off + word_at(d), 1); });
        __syncthreads();
        const int total = block_exclusive_scan(off, nr);
        const long long base = ((long long)n * G + blockIdx.x) * K * P;
        int2* out = total <= cap ? staged : entries + base;  // uniform per block
        range_taps<T, ND, MODE>(grid, n, g, d0, nr, [&](int p, int d, float w) {
            out[atomicAdd(off + word_at(d), 1)] = make_int2(p, __float_as_int(w));
        });
        __syncthreads();
        if (ordered) {
            for (int i = threadIdx.x; i < nr; i += blockDim.x) {
                const int start = i ? off[word_at(i - 1)] : 0;
                sort_segment(out + start, off[word_at(i)] - start);
            }
            __syncthreads();
        }
        if (total <= cap)
            for (int i = threadIdx.x; i < total; i += blockDim.x) entries[base + i] = staged[i];
        for (int i = threadIdx.x; i < nr; i += blockDim.x) ends[n * S + d0 + i] = off[word_at(i)];
        __syncthreads();  // the next batch item reuses off and staged
    }
}

// Entries per segment loaded together (their loads in flight at once).
#define GS_TILE_UNROLL 4

// Pixel d's grad_input over the slice's V channels: the sum of its segment's weight * grad_output chunk.
template <typename T, int V>
__device__ __forceinline__ void tile_pixel_sum(const int2* __restrict__ seg, int e0, int e1, const uint4* go_s, float acc[V]) {
#pragma unroll
    for (int c = 0; c < V; ++c) acc[c] = 0.0f;
    for (int e = e0; e < e1; e += GS_TILE_UNROLL) {
        int2 en[GS_TILE_UNROLL];
#pragma unroll
        for (int u = 0; u < GS_TILE_UNROLL; ++u) en[u] = e + u < e1 ? __ldg(seg + e + u) : make_int2(0, 0);
#pragma unroll
        for (int u = 0; u < GS_TILE_UNROLL; ++u) {
            if (e + u >= e1) break;
            const float w = __int_as_float(en[u].y);
            float f[V];
            chunk_values(go_s[chunk_at(en[u].x)], f, static_cast<const T*>(nullptr));
#pragma unroll
            for (int c = 0; c < V; ++c) acc[c] += w * f[c];
        }
    }
}

// Shared memory: P grad_output chunks, then (for grad_grid) S input chunks, each rounded up to 8 chunks. gi: grad_input (dense planes,
// strides gi_sN / gi_sC) or null; gg: grad_grid (one slice), ggp: its float partials (several), or both null.
template <typename T, int ND, int MODE>
__global__ void __launch_bounds__(GS_TILE_THREADS(MODE)) gs_tile_gather(
        const T* __restrict__ go, const T* __restrict__ inp, const T* __restrict__ grid, const int2* __restrict__ entries,
        const int* __restrict__ ends, T* __restrict__ gi, T* __restrict__ gg, float* __restrict__ ggp, const Geo g,
        long long gi_sN, long long gi_sC, int R) {
    constexpr int K = PointTaps<float, ND, MODE>::K, V = Chunk<T>::V;
    extern __shared__ uint4 chunks[];
    const int S = (int)(g.ID * g.IH * g.IW), P = (int)(g.OD * g.OH * g.OW), G = (S + R - 1) / R;
    const int slices = gridDim.x;
    const long long c0 = (long long)blockIdx.x * V;
    const int nc = (int)min((long long)V, g.C - c0);
    const bool do_gg = gg != nullptr || ggp != nullptr;
    uint4* go_s = chunks;
    uint4* in_s = chunks + ((P + 7) & ~7);  // chunk_at permutes within groups of 8
    for (long long n = blockIdx.y; n < g.N; n += gridDim.y) {
        tile_stage(go + n * g.go_sN + c0 * g.go_sC, g.go_sC, nc, P, go_s);
        if (do_gg) tile_stage(inp + n * g.in_sN + c0 * g.in_sC, g.in_sC, nc, S, in_s);
        __syncthreads();
        if (gi != nullptr) {
            const int* en = ends + n * S;
            T* out = gi + n * gi_sN + c0 * gi_sC;
            for (int d = threadIdx.x; d < S; d += blockDim.x) {
                const int r = d / R, first = d == r * R;
                float acc[V];
                tile_pixel_sum<T, V>(entries + ((long long)n * G + r) * K * P, first ? 0 : en[d - 1], en[d], go_s, acc);
#pragma unroll
                for (int c = 0; c < V; ++c)
                    if (c < nc) out[c * gi_sC + d] = from_acc<T>(acc[c]);
            }
        }
        if (do_gg) {
            for (int p = threadIdx.x; p < P; p += blockDim.x) {
                float c[ND], mult[ND];
                grid_point<T, float, ND, MODE>(grid, n, p, g, c, mult);
                const PointTaps<float, ND, MODE> tp(c, g);
                float gv[V], gsum[ND];
                chunk_values(go_s[chunk_at(p)], gv, static_cast<const T*>(nullptr));
#pragma unroll
                for (int a = 0; a < ND; ++a) gsum[a] = 0.0f;
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (!tp.in_gg(k)) continue;
                    float f[V];
                    // outside taps add 0 * grad_output, as ATen's do (0 * inf is NaN)
                    chunk_values(tp.ok(k) ? in_s[chunk_at(tp.template dst<int>(k))] : make_uint4(0u, 0u, 0u, 0u), f, static_cast<const T*>(nullptr));
                    float dot = 0.0f;
#pragma unroll
                    for (int c = 0; c < V; ++c) dot += f[c] * gv[c];
#pragma unroll
                    for (int a = 0; a < ND; ++a) gsum[a] += tp.cg(a, k) * dot;
                }
                const long long np = n * P + p;
#pragma unroll
                for (int a = 0; a < ND; ++a) {
                    if (slices == 1) gg[np * ND + a] = from_acc<T>(mult[a] * gsum[a]);
                    else ggp[((long long)blockIdx.x * g.N * P + np) * ND + a] = mult[a] * gsum[a];
                }
            }
        }
        __syncthreads();  // the next batch item restages
    }
}

// grad_grid = the sum of `slices` partials (each n elements), in slice order.
template <typename T>
__global__ void __launch_bounds__(256) gs_gg_sum(const float* __restrict__ ggp, T* __restrict__ gg, long long n, int slices) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = ggp[i];
        for (int k = 1; k < slices; ++k) s += ggp[k * n + i];
        gg[i] = from_acc<T>(s);
    }
}
