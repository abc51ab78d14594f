// Conv epilogues for when cuDNN has no fused engine: y = act(alpha*acc + bias + beta*z),
// dx = acc * act'(pre), db = sum(dy). T: io type, A: math type, C: type the conv wrote acc in. Header-free (no cuda_fp16.h / cuda_bf16.h) so NVRTC needs no
// CUDA toolkit include path. acc is the conv output in the accumulation type A.

#include "types.cuh"

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }

#include "activations.cuh"

// meta: rank, shape[5], then 5 strides for each of up to 4 tensors (elements; logical N, C, ...).
// Passed by value as a kernel argument: a plan needs no device memory of its own for it.
struct Meta { long long v[26]; };

__device__ __forceinline__ void offsets(long long i, const long long* meta, int ntensors, long long* off) {
    const int rank = (int)meta[0];
    for (int t = 0; t < ntensors; ++t) off[t] = 0;
    for (int d = rank - 1; d >= 0; --d) {
        long long c = i % meta[1 + d];
        i /= meta[1 + d];
        for (int t = 0; t < ntensors; ++t) off[t] += c * meta[6 + 5 * t + d];
    }
}

__device__ __forceinline__ long long channel_of(long long i, const long long* meta) {
    const int rank = (int)meta[0];
    long long inner = 1;
    for (int d = rank - 1; d >= 2; --d) inner *= meta[1 + d];
    return (i / inner) % meta[2];
}

// tensors in meta order: 0 = acc, 1 = y, 2 = z
template <typename T, typename A, typename C>
__global__ void epilogue_fwd(const C* __restrict__ acc, const T* __restrict__ bias, const T* __restrict__ z,
                             T* __restrict__ y, const Meta m, long long n, A alpha, A beta, int act, A param) {
    const long long* meta = m.v;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long off[3];
        offsets(i, meta, 3, off);
        A v = alpha * (A)to_acc(acc[off[0]]);
        if (bias) v += (A)to_acc(bias[channel_of(i, meta)]);
        if (z) v += beta * (A)to_acc(z[off[2]]);
        y[off[1]] = from_acc<T>(act_fwd<A>(v, act, param));
    }
}

// acc, y and z dense with one layout: element i is at offset i in each, its channel (i / cstride) % channels.
// The index math is 32-bit where n fits (the general kernel's per-dimension 64-bit divisions cost more
// than its memory traffic on large activations).
template <typename T, typename A, typename C, typename I>
__device__ __forceinline__ void epilogue_dense_range(const C* __restrict__ acc, const T* __restrict__ bias,
                                                     const T* __restrict__ z, T* __restrict__ y, I n, I cstride,
                                                     I channels, A alpha, A beta, int act, A param) {
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        A v = alpha * (A)to_acc(acc[i]);
        if (bias) v += (A)to_acc(bias[(i / cstride) % channels]);
        if (z) v += beta * (A)to_acc(z[i]);
        y[i] = from_acc<T>(act_fwd<A>(v, act, param));
    }
}

template <typename T, typename A, typename C>
__global__ void epilogue_fwd_dense(const C* __restrict__ acc, const T* __restrict__ bias, const T* __restrict__ z,
                                   T* __restrict__ y, long long n, long long cstride, long long channels, A alpha,
                                   A beta, int act, A param) {
    if (n <= 0x7fffffffLL)
        epilogue_dense_range<T, A, C, unsigned int>(acc, bias, z, y, (unsigned int)n, (unsigned int)cstride,
                                                    (unsigned int)channels, alpha, beta, act, param);
    else
        epilogue_dense_range<T, A, C, long long>(acc, bias, z, y, n, cstride, channels, alpha, beta, act, param);
}

// tensors in meta order: 0 = acc (dgrad output), 1 = dx, 2 = pre
template <typename T, typename A, typename C>
__global__ void epilogue_act_backward(const C* __restrict__ acc, const T* __restrict__ pre, T* __restrict__ dx,
                                      const Meta m, long long n, int act, A param) {
    const long long* meta = m.v;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long off[3];
        offsets(i, meta, 3, off);
        dx[off[1]] = from_acc<T>((A)to_acc(acc[off[0]]) * act_grad<A>((A)to_acc(pre[off[2]]), act, param));
    }
}

// One block per channel, a fixed summation order: deterministic. tensor 0 = dy.
template <typename T, typename A>
__global__ void bias_grad(const T* __restrict__ dy, T* __restrict__ db, const Meta m) {
    const long long* meta = m.v;
    __shared__ A partial[256];
    const int rank = (int)meta[0];
    const long long k = blockIdx.x;
    long long inner = 1;
    for (int d = 2; d < rank; ++d) inner *= meta[1 + d];
    const long long count = meta[1] * inner;
    A sum = A(0);
    for (long long j = threadIdx.x; j < count; j += blockDim.x) {
        long long nidx = j / inner, rest = j % inner, off = nidx * meta[6] + k * meta[7];
        for (int d = rank - 1; d >= 2; --d) { off += (rest % meta[1 + d]) * meta[6 + d]; rest /= meta[1 + d]; }
        sum += (A)to_acc(dy[off]);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) db[k] = from_acc<T>(partial[0]);
}

// Channels-last dy (dense, channel stride 1): rows of K channels. A block sums a tile of 32 channels (a warp
// reads them coalesced) over a chunk of rows, 32 row lanes with 4 accumulators each, then adds the lanes
// in a fixed order. One block per tile left a 96-channel 56x56 map on three SMs (280 us against torch's
// ~55 us two-pass reduction, H100), so rows are cut into chunks and the kernel runs twice:
//   phase 0: block (tile, chunk) writes its chunk's sums to partials[chunk * K + k];
//   phase 1: the same kernel over the partials as rows (rows = chunks), writing db;
//   phase 2: one launch over every row of dy straight into db (few rows: one chunk).
// Chunks depend on the shape alone: deterministic.
template <typename S, typename A>
__device__ __forceinline__ A sum_rows(const S* __restrict__ src, long long r0, long long r1, int K, int k) {
    A acc[4] = {A(0), A(0), A(0), A(0)};
    long long r = r0 + threadIdx.y;
    for (; r + 96 < r1; r += 128)
        for (int u = 0; u < 4; ++u) acc[u] += (A)to_acc(src[(r + 32 * u) * K + k]);
    for (int u = 0; r < r1; r += 32, u = (u + 1) & 3) acc[u] += (A)to_acc(src[r * K + k]);
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T, typename A>
__global__ void bias_grad_chunks(const T* __restrict__ dy, A* __restrict__ partials, T* __restrict__ db,
                                 long long rows, int K, long long chunk_rows, int phase) {
    __shared__ A lanes[32][33];
    const int k = blockIdx.x * 32 + threadIdx.x;
    A sum = A(0);
    if (k < K) {
        if (phase == 1) {
            sum = sum_rows<A, A>(partials, 0, rows, K, k);
        } else {
            const long long r0 = blockIdx.y * chunk_rows;
            sum = sum_rows<T, A>(dy, r0, r0 + chunk_rows < rows ? r0 + chunk_rows : rows, K, k);
        }
    }
    lanes[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && k < K) {
        A total = A(0);
        for (int y = 0; y < 32; ++y) total += lanes[y][threadIdx.x];
        if (phase == 0) partials[blockIdx.y * (long long)K + k] = total;
        else db[k] = from_acc<T>(total);
    }
}
