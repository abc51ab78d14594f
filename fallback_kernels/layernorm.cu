// LayerNorm over rows of C contiguous values (a tensor's last dim; a channels-last map's channels), as
// torch's F.layer_norm computes it in float32:
//   v = x [+ add]   (add: per-channel, a conv's bias the conv left out, so its output is read once)
//   y = (v - mean) * rsqrt(var + eps) [* gamma] [+ beta],  var biased; mean and rsqrt(var + eps) kept per row
//   for the backward where asked. T: x's and y's type, P: the per-channel operands' (T, or float32 parameters
//   under autocast).
// A group of `lanes` threads (a power of two up to 32; several groups a warp for narrow rows) holds its row
// in registers, NV vectors of VEC values a thread: x is read once and y written once. The mean first, then
// the sum of squared deviations from it (no cancellation where the mean is large against the spread).
// torch's vectorized kernel runs a block a row: 113 us on 100352 rows of 96 float16 channels (convnext_tiny's
// first stage at batch 32, H100), a sixth of the memory bandwidth.
#include "types.cuh"
#include "vectors.cuh"

#define LN_MAX_CHANNELS 1024  // the backward's per-block sums in shared memory: 8 KB
#define LN_THREADS 256  // threads a block (THREADS in layernorm.py); 2 blocks an SM at least: with
                        // the bound alone ptxas spilled a few bytes on some row widths (sm_90)

__device__ __forceinline__ float group_sum(float v, int lanes) {
    for (int off = lanes >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// A thread's place among the row groups: `lanes` threads a row, 32 / lanes rows a warp at a time, the warps
// of the grid striding over the rows together (a warp's loop bound is the same for all its lanes, so every
// lane reaches every shuffle).
struct Groups {
    int lanes, lane, sub;
    long long first, step;
};

__device__ __forceinline__ Groups groups(int lanes_log2) {
    Groups g;
    g.lanes = 1 << lanes_log2;
    g.lane = threadIdx.x & (g.lanes - 1);
    g.sub = (threadIdx.x & 31) >> lanes_log2;
    const int per_warp = 32 >> lanes_log2;
    g.first = (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * per_warp;
    g.step = (((long long)gridDim.x * blockDim.x) >> 5) * per_warp;
    return g;
}

// Pointers aligned to VEC values (16 or 8 bytes of T; P's vectors as many values), C % VEC == 0,
// C <= NV * VEC * lanes.
template <typename T, typename P, int VEC, int NV>
__global__ void __launch_bounds__(LN_THREADS, 2) layer_norm_rows(
        const T* __restrict__ x, const P* __restrict__ add, const P* __restrict__ gamma,
        const P* __restrict__ beta, T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
        long long rows, int C, int lanes_log2, float eps) {
    const Groups grp = groups(lanes_log2);
    const int lanes = grp.lanes, lane = grp.lane, sub = grp.sub;
    const float inv_c = 1.f / (float)C;
    for (long long base = grp.first; base < rows; base += grp.step) {
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
                    load<P, VEC>(add, c, b);
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
        if (mean_out != nullptr && live && lane == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * lanes + lane) * VEC;
            if (live && c < C) {
                float g[VEC], b[VEC];
                if (gamma != nullptr) load<P, VEC>(gamma, c, g);
                else for (int k = 0; k < VEC; ++k) g[k] = 1.f;
                if (beta != nullptr) load<P, VEC>(beta, c, b);
                else for (int k = 0; k < VEC; ++k) b[k] = 0.f;
#pragma unroll
                for (int k = 0; k < VEC; ++k) v[j][k] = (v[j][k] - mean) * rstd * g[k] + b[k];
                store<T, VEC>(y, row * C + c, v[j]);
            }
        }
    }
}

template <int VEC, int NV>
__device__ __forceinline__ void zero_sums(float (&first)[NV][VEC], float (&second)[NV][VEC]) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int k = 0; k < VEC; ++k) first[j][k] = second[j][k] = 0.f;
}

// A block's row of `partials` (2C floats: first's sums, then second's) from every thread's per-channel sums
// over the rows it visited: the groups of a warp hold the same channels, so they add across the lane bits
// above a group's, then the block's warps add theirs in a fixed order. layer_norm_bwd_params sums the rows.
template <int VEC, int NV>
__device__ __forceinline__ void block_partials(float (&first)[NV][VEC], float (&second)[NV][VEC], const Groups& grp,
                                               int C, float* __restrict__ partials) {
    __shared__ float block_sums[2 * LN_MAX_CHANNELS];
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            for (int off = grp.lanes; off < 32; off <<= 1) {
                first[j][k] += __shfl_xor_sync(0xffffffffu, first[j][k], off);
                second[j][k] += __shfl_xor_sync(0xffffffffu, second[j][k], off);
            }
    const int w = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int i = threadIdx.x; i < 2 * C; i += blockDim.x) block_sums[i] = 0.f;
    for (int turn = 0; turn < warps; ++turn) {  // the warps in order: a fixed summation order
        __syncthreads();
        if (w == turn && grp.sub == 0) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int c = (j * grp.lanes + grp.lane) * VEC;
                if (c < C)
#pragma unroll
                    for (int k = 0; k < VEC; ++k) {
                        block_sums[c + k] += first[j][k];
                        block_sums[C + c + k] += second[j][k];
                    }
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * C; i += blockDim.x) partials[(long long)blockIdx.x * 2 * C + i] = block_sums[i];
}

// The backward of layer_norm_rows from the forward's mean and rstd: per row, with xhat = (x [+ add] - mean) *
// rstd and g = dy * gamma,  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); per channel, dgamma = sum(dy *
// xhat) and dbeta = sum(dy) over the rows. Each thread sums its channels over the rows it visits; the groups
// of a warp, then the block's warps in a fixed order, add theirs into the block's row of `partials` (2C floats
// a block: dgamma's, then dbeta's); layer_norm_bwd_params sums those rows in order: deterministic for a grid.
template <typename T, typename P, int VEC, int NV>
__global__ void __launch_bounds__(LN_THREADS, 1) layer_norm_bwd_rows(
        const T* __restrict__ dy, const T* __restrict__ x, const P* __restrict__ add,
        const float* __restrict__ mean_in, const float* __restrict__ rstd_in, const P* __restrict__ gamma,
        T* __restrict__ dx, float* __restrict__ partials, long long rows, int C, int lanes_log2) {
    const Groups grp = groups(lanes_log2);
    const int lanes = grp.lanes, lane = grp.lane, sub = grp.sub;
    const float inv_c = 1.f / (float)C;
    float dg[NV][VEC], db[NV][VEC];
    zero_sums<VEC, NV>(dg, db);
    for (long long base = grp.first; base < rows; base += grp.step) {
        const long long row = base + sub;
        const bool live = row < rows;
        const float mean = live ? mean_in[row] : 0.f, rstd = live ? rstd_in[row] : 0.f;
        float xh[NV][VEC], g[NV][VEC];
        float sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * lanes + lane) * VEC;
            if (live && c < C) {
                float d[VEC], w[VEC];
                load<T, VEC>(x, row * C + c, xh[j]);
                load<T, VEC>(dy, row * C + c, d);
                if (add != nullptr) {
                    float b[VEC];
                    load<P, VEC>(add, c, b);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) xh[j][k] += b[k];
                }
                if (gamma != nullptr) load<P, VEC>(gamma, c, w);
                else for (int k = 0; k < VEC; ++k) w[k] = 1.f;
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    xh[j][k] = (xh[j][k] - mean) * rstd;
                    g[j][k] = d[k] * w[k];
                    sg += g[j][k];
                    sgx += g[j][k] * xh[j][k];
                    dg[j][k] += d[k] * xh[j][k];
                    db[j][k] += d[k];
                }
            }
        }
        const float mg = group_sum(sg, lanes) * inv_c, mgx = group_sum(sgx, lanes) * inv_c;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * lanes + lane) * VEC;
            if (live && c < C) {
#pragma unroll
                for (int k = 0; k < VEC; ++k) g[j][k] = rstd * (g[j][k] - mg - xh[j][k] * mgx);
                store<T, VEC>(dx, row * C + c, g[j]);
            }
        }
    }
    block_partials<VEC, NV>(dg, db, grp, C, partials);
}

// dgamma[c], dbeta[c] = the sums of the blocks' partial rows, in block order; either may be null (not wanted).
template <typename P>
__global__ void layer_norm_bwd_params(const float* __restrict__ partials, P* __restrict__ dgamma,
                                      P* __restrict__ dbeta, int blocks, int C) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * C) return;
    float sum = 0.f;
    for (int b = 0; b < blocks; ++b) sum += partials[(long long)b * 2 * C + i];
    if (i < C) {
        if (dgamma != nullptr) dgamma[i] = from_acc<P>(sum);
    } else if (dbeta != nullptr) {
        dbeta[i - C] = from_acc<P>(sum);
    }
}

// ConvNeXt's block end in training (torchvision's CNBlock under autocast): out = x + (z + bias) * gamma *
// noise[sample], float32 as torch's type promotion makes it (gamma, the layer scale, is float32). z: fc2's
// output without its bias, rows of C; noise: stochastic depth's per-sample factor (null: none), a sample
// `sample_elems` values. TX: the block input's type (T, or float32 between blocks). C % VEC == 0; x, z and out
// aligned to VEC values.
template <typename TX, typename T, int VEC>
__global__ void __launch_bounds__(256) layer_scale_residual(
        const TX* __restrict__ x, const T* __restrict__ z, const float* __restrict__ bias,
        const float* __restrict__ gamma, const float* __restrict__ noise, float* __restrict__ out,
        long long vectors, int C, long long sample_elems) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vectors;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = i * VEC;
        const int c = (int)(e % C);
        float v[VEC], zv[VEC], b[VEC], g[VEC];
        load<TX, VEC>(x, e, v);
        load<T, VEC>(z, e, zv);
        load<float, VEC>(bias, c, b);
        load<float, VEC>(gamma, c, g);
        const float s = noise != nullptr ? noise[e / sample_elems] : 1.f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] += (zv[k] + b[k]) * g[k] * s;
        store<float, VEC>(out, e, v);
    }
}

// Its backward: dz = dy * gamma * noise (T, fc2's output gradient) and, per channel, the layer scale's gradient
// sum(dy * noise * (z + bias)) and fc2's bias gradient sum(dz) (unrounded) into the block's row of `partials`
// (layer_norm_bwd_params finishes them). The rows in LayerNorm's groups: narrow rows keep every lane busy.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(LN_THREADS, 2) layer_scale_bwd(
        const float* __restrict__ dy, const T* __restrict__ z, const float* __restrict__ bias,
        const float* __restrict__ gamma, const float* __restrict__ noise, T* __restrict__ dz,
        float* __restrict__ partials, long long rows, int C, int lanes_log2, long long sample_rows) {
    const Groups grp = groups(lanes_log2);
    float dg[NV][VEC], db[NV][VEC];
    zero_sums<VEC, NV>(dg, db);
    for (long long base = grp.first; base < rows; base += grp.step) {
        const long long row = base + grp.sub;
        if (row >= rows) continue;  // no shuffle below: lanes may leave
        const float s = noise != nullptr ? noise[row / sample_rows] : 1.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = (j * grp.lanes + grp.lane) * VEC;
            if (c < C) {
                float d[VEC], zv[VEC], b[VEC], g[VEC];
                load<float, VEC>(dy, row * C + c, d);
                load<T, VEC>(z, row * C + c, zv);
                load<float, VEC>(bias, c, b);
                load<float, VEC>(gamma, c, g);
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    const float ds = d[k] * s;
                    dg[j][k] += ds * (zv[k] + b[k]);
                    d[k] = ds * g[k];
                    db[j][k] += d[k];
                }
                store<T, VEC>(dz, row * C + c, d);
            }
        }
    }
    block_partials<VEC, NV>(dg, db, grp, C, partials);
}
