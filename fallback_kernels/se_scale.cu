// Squeeze-excitation's scale over a channels-last map x (N, H*W rows of C channels) by s (N, C):
//   forward   out = x * s[n, c]  (torch's `scale * input`: the product of two io values rounded once, so the
//             same bits as torch's);
//   backward  dx = dy * s[n, c], and ds[n, c] = the sum over sample n's rows of dy * x, products and sums in
//             float32, in a fixed order (each thread's rows in order, then a block's threads, then the blocks
//             in se_scale_bwd_sum): the same bits run to run, deterministic mode or not.
// torch runs the forward and backward's two multiplies through TensorIterator's non-vectorised kernel (the
// (N, C, 1, 1) operand broadcast over a channels-last map) and sums dy * x in a separate reduction: 2.3 ms of
// efficientnet_b0's 13.9 ms training step (H100, batch 64).
// C % VEC == 0 and every pointer 16-byte aligned (se_scale.py checks).
#include "types.cuh"
#include "vectors.cuh"

#define SE_THREADS 256  // THREADS in se_scale.py

template <typename T, int VEC>
__global__ void __launch_bounds__(SE_THREADS) se_scale_fwd(const T* __restrict__ x, const T* __restrict__ s,
                                                           T* __restrict__ out, long long vectors, int C,
                                                           long long sample_elems) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vectors;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = i * VEC;
        float v[VEC], sv[VEC];
        load<T, VEC>(x, e, v);
        load<T, VEC>(s, (e / sample_elems) * C + e % C, sv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] *= sv[k];
        store<T, VEC>(out, e, v);
    }
}

// Grid (column chunks, splits, N): a block covers up to SE_THREADS vectors of a row (its chunk) over a range of
// `rows_per_split` of sample n's rows, `cols` threads across a row and SE_THREADS / cols rows at a time. dx
// (null: not wanted) is written as it goes; the block's column sums (partials null: ds not wanted) go to
// partials[n][split][c].
template <typename T, int VEC>
__global__ void __launch_bounds__(SE_THREADS) se_scale_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                                           const T* __restrict__ s, T* __restrict__ dx,
                                                           float* __restrict__ partials, long long rows, int C,
                                                           long long rows_per_split) {
    __shared__ float sums[SE_THREADS * VEC];
    const int nv = C / VEC, chunk0 = blockIdx.x * SE_THREADS;
    const int cols = min(nv - chunk0, SE_THREADS), rpi = SE_THREADS / cols;
    const int col = threadIdx.x % cols, sub = threadIdx.x / cols, c = (chunk0 + col) * VEC;
    const long long n = blockIdx.z, r0 = blockIdx.y * rows_per_split;
    const long long r1 = min(r0 + rows_per_split, rows);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    if (sub < rpi) {
        float sv[VEC];
        load<T, VEC>(s, n * C + c, sv);
        for (long long r = r0 + sub; r < r1; r += rpi) {
            const long long e = (n * rows + r) * C + c;
            float g[VEC];
            load<T, VEC>(dy, e, g);
            if (partials != nullptr) {
                float v[VEC];
                load<T, VEC>(x, e, v);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] += g[k] * v[k];
            }
            if (dx != nullptr) {
#pragma unroll
                for (int k = 0; k < VEC; ++k) g[k] *= sv[k];
                store<T, VEC>(dx, e, g);
            }
        }
    }
    if (partials == nullptr) return;  // the same for the whole grid: no thread waits at the barrier alone
#pragma unroll
    for (int k = 0; k < VEC; ++k) sums[threadIdx.x * VEC + k] = acc[k];
    __syncthreads();
    if (sub != 0) return;
    for (int j = 1; j < rpi; ++j) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += sums[(j * cols + col) * VEC + k];
    }
    float* p = partials + (n * gridDim.y + blockIdx.y) * C + c;
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = acc[k];
}

// ds[n, c] = the sum of partials[n][0 .. splits)[c] in order, rounded once.
template <typename T>
__global__ void __launch_bounds__(SE_THREADS) se_scale_bwd_sum(const float* __restrict__ partials,
                                                               T* __restrict__ ds, int C, int splits,
                                                               long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / C, c = i % C;
        const float* p = partials + n * splits * C + c;
        float a = 0.f;
        for (int j = 0; j < splits; ++j) a += p[(long long)j * C];
        ds[i] = from_acc<T>(a);
    }
}
