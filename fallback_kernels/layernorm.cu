// LayerNorm over rows of C contiguous values (a tensor's last dim; a channels-last map's channels), as
// torch's F.layer_norm computes it in float32:
//   v = x [+ add]   (add: per-channel, a conv's bias the conv left out, so its output is read once)
//   y = (v - mean) * rsqrt(var + eps) [* gamma] [+ beta],  var biased.
// A group of `lanes` threads (a power of two up to 32; several groups a warp for narrow rows) holds its row
// in registers, NV vectors of VEC values a thread: x is read once and y written once. The mean first, then
// the sum of squared deviations from it (no cancellation where the mean is large against the spread).
// torch's vectorized kernel runs a block a row: 113 us on 100352 rows of 96 float16 channels (convnext_tiny's
// first stage at batch 32, H100), a sixth of the memory bandwidth.
#include "types.cuh"
#include "vectors.cuh"

#define LN_THREADS 256  // threads a block (THREADS in layernorm.py); 2 blocks an SM at least: with
                        // the bound alone ptxas spilled a few bytes on some row widths (sm_90)

__device__ __forceinline__ float group_sum(float v, int lanes) {
    for (int off = lanes >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Pointers 16-byte aligned where VEC * sizeof(T) == 16, C % VEC == 0, C <= NV * VEC * lanes.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(LN_THREADS, 2) layer_norm_rows(
        const T* __restrict__ x, const T* __restrict__ add, const T* __restrict__ gamma,
        const T* __restrict__ beta, T* __restrict__ y, long long rows, int C, int lanes_log2, float eps) {
    const int lanes = 1 << lanes_log2;
    const int lane = threadIdx.x & (lanes - 1);
    const int per_warp = 32 >> lanes_log2;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long step = (((long long)gridDim.x * blockDim.x) >> 5) * per_warp;
    const int sub = (threadIdx.x & 31) >> lanes_log2;
    const float inv_c = 1.f / (float)C;
    // the loop's bound is the same for the whole warp: every lane reaches every shuffle
    for (long long base = warp * per_warp; base < rows; base += step) {
        const long long row = base + sub;
        const bool live = row < rows;
        float v[NV][VEC];
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * lanes + lane) * VEC;
            if (live && c < C) {
                load<T, VEC>(x, row * C + c, v[j]);
                if (add != nullptr) {
                    float b[VEC];
                    load<T, VEC>(add, c, b);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) v[j][k] += b[k];
                }
#pragma unroll
                for (int k = 0; k < VEC; ++k) sum += v[j][k];
            }
        }
        const float mean = group_sum(sum, lanes) * inv_c;
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * lanes + lane) * VEC;
            if (live && c < C) {
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    const float d = v[j][k] - mean;
                    sq += d * d;
                }
            }
        }
        const float rstd = rsqrtf(group_sum(sq, lanes) * inv_c + eps);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * lanes + lane) * VEC;
            if (live && c < C) {
                float g[VEC], b[VEC];
                if (gamma != nullptr) load<T, VEC>(gamma, c, g);
                else for (int k = 0; k < VEC; ++k) g[k] = 1.f;
                if (beta != nullptr) load<T, VEC>(beta, c, b);
                else for (int k = 0; k < VEC; ++k) b[k] = 0.f;
#pragma unroll
                for (int k = 0; k < VEC; ++k) v[j][k] = (v[j][k] - mean) * rstd * g[k] + b[k];
                store<T, VEC>(y, row * C + c, v[j]);
            }
        }
    }
}
