// grid_sample's layout passes (one program): gs_to_cl / gs_from_cl, tiled transposes between any-strided
// (N, C, spatial) and channels-last (gs_to_cl optionally folding in max |value|), and gs_absmax, that maximum
// alone for a grad_output already channels-last (the counting backward's scale).

#include "grid_sample_common.cuh"

// A transpose's strided side (N, C, D, H, W) against a channels-last contiguous (N, D, H, W, C) side.
// TR_FIELDS in grid_sample.py. packed: the spatial dims are contiguous (offset of spatial index s = s).
struct Tr {
    long long N, C, S, H, W;
    long long sN, sC, sD, sH, sW;
    long long packed;
};

// max over a block of its threads' m, folded into *out (double bits) with one atomic, skipped when *out is
// already larger (thousands of blocks on one word would serialise).
__device__ __forceinline__ void block_max_to(double m, unsigned long long* out) {
    __shared__ double warp_max[32];
    for (int s = 16; s > 0; s >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, s));
    const int tid = threadIdx.x + threadIdx.y * blockDim.x, warps = (blockDim.x * blockDim.y) >> 5;
    if ((tid & 31) == 0) warp_max[tid >> 5] = m;
    __syncthreads();
    if (tid < 32) {
        m = tid < warps ? warp_max[tid] : 0.0;
        for (int s = 16; s > 0; s >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, s));
        if (tid == 0 && m > 0.0 && m > __longlong_as_double((long long)*(volatile unsigned long long*)out))
            atomicMax(out, (unsigned long long)__double_as_longlong(m));
    }
}

__device__ __forceinline__ double finite_abs(double v) {
    v = fabs(v);
    return v <= 1.7976931348623157e308 ? v : 0.0;  // NaN and inf count as 0
}

// max |grad_output| over its finite values, as double bits in *out (non-negative doubles order as u64).
template <typename T>
__global__ void __launch_bounds__(256) gs_absmax(const T* __restrict__ go, long long n, unsigned long long* __restrict__ out) {
    double m = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        m = fmax(m, finite_abs(static_cast<double>(to_acc(go[i]))));
    block_max_to(m, out);
}

// ---------------------------------------------------------------------------------------------------
// Transposes (32 x 32 tiles through shared memory), converting the element type on the way.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ long long spatial_offset(long long s, const Tr& t) {
    if (t.packed) return s;
    const long long hw = t.H * t.W;
    return (s / hw) * t.sD + ((s / t.W) % t.H) * t.sH + (s % t.W) * t.sW;
}

template <typename D, typename S_> __device__ __forceinline__ D convert(S_ v) { return from_acc<D>(to_acc(v)); }

// A block's 32 x 32 (channel, spatial) tiles of every batch item it takes: read(n, c, s, tile[y][x]) for its
// elements, then write(n, c, s, tile[x][y]). FROM_CL (channels-last source): reads run along channels across
// threadIdx.x (c = c0 + x, s = s0 + y) and writes along spatial positions; else the other way round. Either way
// both global sides are read or written coalesced.
template <bool FROM_CL, typename D, typename R, typename W>
__device__ __forceinline__ void transpose_tiles(const Tr& t, D (&tile)[32][33], R read, W write) {
    const long long ctiles = (t.C + 31) / 32;
    const long long s0 = blockIdx.x * 32LL;
    for (long long n = blockIdx.z; n < t.N; n += gridDim.z) {
        for (long long ct = blockIdx.y; ct < ctiles; ct += gridDim.y) {
            const long long c0 = ct * 32;
#pragma unroll
            for (int k = 0; k < 32; k += 8) {
                const long long c = FROM_CL ? c0 + threadIdx.x : c0 + threadIdx.y + k;
                const long long s = FROM_CL ? s0 + threadIdx.y + k : s0 + threadIdx.x;
                if (c < t.C && s < t.S) read(n, c, s, tile[threadIdx.y + k][threadIdx.x]);
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 32; k += 8) {
                const long long c = FROM_CL ? c0 + threadIdx.y + k : c0 + threadIdx.x;
                const long long s = FROM_CL ? s0 + threadIdx.x : s0 + threadIdx.y + k;
                if (c < t.C && s < t.S) write(n, c, s, tile[threadIdx.x][threadIdx.y + k]);
            }
            __syncthreads();
        }
    }
}

// strided (N, C, spatial) -> channels-last contiguous; amax (or null): max |finite value| folded in.
template <typename S_, typename D>
__global__ void __launch_bounds__(256) gs_to_cl(const S_* __restrict__ src, D* __restrict__ dst, const Tr t,
                                                unsigned long long* __restrict__ amax) {
    __shared__ D tile[32][33];
    double m = 0.0;
    transpose_tiles<false>(t, tile, [&](long long n, long long c, long long s, D& slot) {
        const D v = convert<D>(src[n * t.sN + c * t.sC + spatial_offset(s, t)]);
        slot = v;
        if (amax) m = fmax(m, finite_abs(static_cast<double>(to_acc(v))));
    }, [&](long long n, long long c, long long s, D v) { dst[(n * t.S + s) * t.C + c] = v; });
    if (amax) block_max_to(m, amax);  // uniform per block: every thread gets here
}

// channels-last contiguous -> strided (N, C, spatial)
template <typename S_, typename D>
__global__ void __launch_bounds__(256) gs_from_cl(const S_* __restrict__ src, D* __restrict__ dst, const Tr t) {
    __shared__ D tile[32][33];
    transpose_tiles<true>(t, tile, [&](long long n, long long c, long long s, D& slot) { slot = convert<D>(src[(n * t.S + s) * t.C + c]); },
                          [&](long long n, long long c, long long s, D v) { dst[n * t.sN + c * t.sC + spatial_offset(s, t)] = v; });
}
