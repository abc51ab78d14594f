// Training-mode BatchNorm around cuDNN's fused convs, channels-last (rows of C channels, dense).
//
// The conv writes its raw output y and the per-channel sum / sum of squares (cuDNN's genstats). Then:
//   bn_finalize    : mean, 1/std, scale = gamma/std, shift = beta - mean*scale, the running statistics
//                    (torch's momentum, or its cumulative average for momentum=None), num_batches_tracked;
//   bn_apply       : out = [relu](y*scale + shift [+ r | + r*scale2 + shift2]) where the activation must
//                    exist in memory (a block's end; else the next conv applies it in its prologue);
//   bn_bwd_reduce  : per channel, sum(dz) and sum(dz * (y - mean)) with dz = da * [pre-activation > 0], in
//                    row chunks summed in a fixed order by the last block to finish: deterministic. It
//                    also writes dgamma, dbeta and the coefficients of dy = A*dz + B*(y - mean) + C;
//   bn_bwd_apply   : dy = A*dz + B*(y - mean) + C, and dz itself where a residual input needs it.
// Sums over y - mean, not y: a channel whose mean is large against its spread loses nothing to cancellation.
// scale and shift are stored in the io type: cuDNN's prologue reads them so (it declines float32
// operands), and bn_apply and the mask in the backward use the same rounded values.
#include "types.cuh"

#define ROWS_LANES 16   // threadIdx.y of the row-chunk reductions (512 threads: two blocks an SM at 48 registers)
#define TILE 32         // channels per block of the reductions (threadIdx.x, one warp reads them coalesced)

// One block (the counter is read before it is written): C <= a few thousand channels, a trivial pass.
template <typename T>
__global__ void bn_finalize(const float* __restrict__ sum, const float* __restrict__ sq_sum,
                            const float* __restrict__ gamma, const float* __restrict__ beta,
                            float* __restrict__ running_mean, float* __restrict__ running_var,
                            long long* __restrict__ num_batches, T* __restrict__ scale, T* __restrict__ shift,
                            float* __restrict__ save_mean, float* __restrict__ save_invstd,
                            int C, double count, float eps, float momentum) {
    // momentum < 0: torch's momentum=None, the cumulative average 1 / num_batches_tracked (after this batch)
    float factor = momentum;
    if (num_batches != nullptr && momentum < 0.f) factor = (float)(1.0 / (double)(*num_batches + 1));
    __syncthreads();
    if (num_batches != nullptr && threadIdx.x == 0) *num_batches += 1;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const double mean = (double)sum[c] / count;
        const double var = fmax((double)sq_sum[c] / count - mean * mean, 0.0);  // biased: what normalises
        const float invstd = (float)(1.0 / sqrt(var + (double)eps));
        const float g = gamma != nullptr ? gamma[c] : 1.f, b = beta != nullptr ? beta[c] : 0.f;
        const T s = from_acc<T>(g * invstd);
        scale[c] = s;
        shift[c] = from_acc<T>(b - (float)mean * to_acc(s));
        save_mean[c] = (float)mean;
        save_invstd[c] = invstd;
        if (running_mean != nullptr) {
            running_mean[c] = (1.f - factor) * running_mean[c] + factor * (float)mean;
            const double unbiased = count > 1.0 ? var * count / (count - 1.0) : var;
            running_var[c] = (1.f - factor) * running_var[c] + factor * (float)unbiased;
        }
    }
}

// VEC consecutive channels a thread (C % VEC == 0, 16-byte aligned rows when VEC * sizeof(T) == 16).
// The alignment makes one vector load of the struct: without it a Vec of halves has the alignment of one
// half, and the compiler loads element by element (bn_bwd_apply ran 5x off the memory bandwidth so).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec { T v[VEC]; };

template <typename T, int VEC>
__device__ __forceinline__ void load(const T* __restrict__ p, long long i, float (&out)[VEC]) {
    const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(p + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = to_acc(v.v[j]);
}

template <int VEC>
__device__ __forceinline__ void load(const float* __restrict__ p, long long i, float (&out)[VEC]) {
    const Vec<float, VEC> v = *reinterpret_cast<const Vec<float, VEC>*>(p + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = v.v[j];
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* __restrict__ p, long long i, const float (&in)[VEC]) {
    Vec<T, VEC> v;
#pragma unroll
    for (int j = 0; j < VEC; ++j) v.v[j] = from_acc<T>(in[j]);
    *reinterpret_cast<Vec<T, VEC>*>(p + i) = v;
}

// r == nullptr: no residual; else + r, or + r*scale2 + shift2 where scale2 is given (a downsample branch's own
// BatchNorm). scale == nullptr: y as it is (out = y + r: the two input gradients of a block with a
// downsample branch). Decided by the pointers, not by a mode word: a re-pointed graph's moved recordings
// give every pointer a nonzero value, and a word that followed them would differ between recordings.
template <typename T, int VEC>
__global__ void bn_apply(const T* __restrict__ y, const T* __restrict__ scale, const T* __restrict__ shift,
                         const T* __restrict__ r, const T* __restrict__ scale2, const T* __restrict__ shift2,
                         T* __restrict__ out, long long n, int C, int relu) {
    const long long stride = (long long)gridDim.x * blockDim.x * VEC;
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    // the channel follows i by a fixed step: no 64-bit remainder per element group
    const int step = (int)(stride % C);
    for (int c = (int)(i % C); i < n; i += stride, c = c + step >= C ? c + step - C : c + step) {
        float v[VEC], s[VEC], t[VEC];
        load<T, VEC>(y, i, v);
        if (scale != nullptr) {
            load<T, VEC>(scale, c, s);
            load<T, VEC>(shift, c, t);
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = v[j] * s[j] + t[j];
        }
        if (r != nullptr) {
            float rv[VEC];
            load<T, VEC>(r, i, rv);
            if (scale2 != nullptr) {
                load<T, VEC>(scale2, c, s);
                load<T, VEC>(shift2, c, t);
#pragma unroll
                for (int j = 0; j < VEC; ++j) rv[j] = rv[j] * s[j] + t[j];
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] += rv[j];
        }
        if (relu) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = fmaxf(v[j], 0.f);
        }
        store<T, VEC>(out, i, v);
    }
}

// dz of one element: da where the activation passed it. The mask comes from the stored output (a > 0)
// where there is one, else from y*scale + shift > 0 (the prologue's own input to its relu); relu == 0: da.
template <typename T>
__device__ __forceinline__ float masked(const T* __restrict__ da, const T* __restrict__ y, const T* __restrict__ a,
                                        long long i, float s, float t, int relu) {
    const float g = to_acc(da[i]);
    if (!relu) return g;
    const float pre = a != nullptr ? to_acc(a[i]) : to_acc(y[i]) * s + t;
    return pre > 0.f ? g : 0.f;
}

#define UNROLL 4

// The ROWS_LANES row lanes' sums of each channel added in lane order; thread row 0 gets the totals.
template <int RV>
__device__ __forceinline__ void sum_lanes(float (&lanes)[2][ROWS_LANES][TILE * RV + 1], float (&s1)[RV],
                                          float (&s2)[RV]) {
#pragma unroll
    for (int j = 0; j < RV; ++j) {
        lanes[0][threadIdx.y][threadIdx.x * RV + j] = s1[j];
        lanes[1][threadIdx.y][threadIdx.x * RV + j] = s2[j];
    }
    __syncthreads();
    if (threadIdx.y == 0) {
#pragma unroll
        for (int j = 0; j < RV; ++j) {
            float a = 0.f, b = 0.f;
            for (int l = 0; l < ROWS_LANES; ++l) {
                a += lanes[0][l][threadIdx.x * RV + j];
                b += lanes[1][l][threadIdx.x * RV + j];
            }
            s1[j] = a;
            s2[j] = b;
        }
    }
    __syncthreads();  // the lanes may be written again after this
}

// A chunk's block adds its lanes and stores the sums as partials[chunk][2][C]; the tile's last block to
// arrive (counted in `counters[tile]`, left at 0 again for the next launch) sums every chunk in chunk order
// -- the same order whichever block is last: deterministic -- and returns true, thread row 0 holding the
// totals. One launch where a second one for the chunks' sum cost ~5-20 us of latency a stage.
template <int RV>
__device__ bool last_block_totals(float (&lanes)[2][ROWS_LANES][TILE * RV + 1], float (&s1)[RV], float (&s2)[RV],
                                  float* __restrict__ partials, unsigned int* __restrict__ counters, int C, int c0,
                                  long long chunks) {
    __shared__ bool last;
    sum_lanes<RV>(lanes, s1, s2);
    if (threadIdx.y == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < RV; ++j) {
            partials[(2 * blockIdx.y) * C + c0 + j] = s1[j];
            partials[(2 * blockIdx.y + 1) * C + c0 + j] = s2[j];
        }
    }
    __threadfence();  // this block's partials are visible before its count is
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(chunks - 1);
        if (last) counters[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return false;
#pragma unroll
    for (int j = 0; j < RV; ++j) s1[j] = s2[j] = 0.f;
    if (c0 < C) {
#pragma unroll 8
        for (long long k = threadIdx.y; k < chunks; k += ROWS_LANES) {
#pragma unroll
            for (int j = 0; j < RV; ++j) {
                s1[j] += __ldcg(partials + (2 * k) * C + c0 + j);  // through L2: other blocks wrote them
                s2[j] += __ldcg(partials + (2 * k + 1) * C + c0 + j);
            }
        }
    }
    sum_lanes<RV>(lanes, s1, s2);
    return true;
}

template <int RV>
__device__ __forceinline__ void accumulate(const float (&g)[RV], const float (&v)[RV], const float (&pre)[RV],
                                           const float (&s)[RV], const float (&t)[RV], const float (&mean)[RV],
                                           bool stored, int relu, float (&dz_sum)[RV], float (&dzy_sum)[RV]) {
#pragma unroll
    for (int j = 0; j < RV; ++j) {
        const float p = stored ? pre[j] : v[j] * s[j] + t[j];
        const float dz = !relu || p > 0.f ? g[j] : 0.f;
        dz_sum[j] += dz;
        dzy_sum[j] += dz * (v[j] - mean[j]);
    }
}

// Block (tile, chunk) sums dz and dz*(y - mean) over its rows; the tile's last block writes dgamma, dbeta and
// the coefficients (last_block_totals). A thread owns RV adjacent channels (one RV-wide load a row): a warp
// reads whole 128-byte lines. `counters` is the caller's, one per tile, zero between launches: two launches
// using the same counters must not overlap.
template <typename T, int RV>
__global__ void __launch_bounds__(TILE * ROWS_LANES, 2) bn_bwd_reduce(
        const T* __restrict__ da, const T* __restrict__ y, const T* __restrict__ a, const T* __restrict__ scale,
        const T* __restrict__ shift, const float* __restrict__ gamma, const float* __restrict__ save_mean,
        const float* __restrict__ save_invstd, float* __restrict__ partials, float* __restrict__ dgamma,
        float* __restrict__ dbeta, float* __restrict__ coef, unsigned int* __restrict__ counters,
        long long rows, int C, long long chunk_rows, long long chunks, int relu) {
    __shared__ float lanes[2][ROWS_LANES][TILE * RV + 1];
    const int c0 = (blockIdx.x * TILE + threadIdx.x) * RV;
    float dz_sum[RV], dzy_sum[RV];
#pragma unroll
    for (int j = 0; j < RV; ++j) dz_sum[j] = dzy_sum[j] = 0.f;
    if (c0 < C) {
        float s[RV], t[RV], mean[RV];
        load<T, RV>(scale, c0, s);
        load<T, RV>(shift, c0, t);
        load<RV>(save_mean, c0, mean);
        const long long r0 = blockIdx.y * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
        // UNROLL rows' loads issued before any is used: one row's pair of loads in flight per thread left
        // the reduction latency-bound (3.5x off the memory bandwidth on ResNet-50's layers).
        long long r = r0 + threadIdx.y;
        for (; r + (UNROLL - 1) * ROWS_LANES < r1; r += UNROLL * ROWS_LANES) {
            float g[UNROLL][RV], v[UNROLL][RV], pre[UNROLL][RV];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long i = (r + u * ROWS_LANES) * C + c0;
                load<T, RV>(da, i, g[u]);
                load<T, RV>(y, i, v[u]);
                if (a != nullptr) load<T, RV>(a, i, pre[u]);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) accumulate<RV>(g[u], v[u], pre[u], s, t, mean, a != nullptr, relu, dz_sum, dzy_sum);
        }
        for (; r < r1; r += ROWS_LANES) {
            const long long i = r * C + c0;
            float g[RV], v[RV], pre[RV];
            load<T, RV>(da, i, g);
            load<T, RV>(y, i, v);
            if (a != nullptr) load<T, RV>(a, i, pre);
            accumulate<RV>(g, v, pre, s, t, mean, a != nullptr, relu, dz_sum, dzy_sum);
        }
    }
    if (!last_block_totals<RV>(lanes, dz_sum, dzy_sum, partials, counters, C, c0, chunks)) return;
    if (threadIdx.y != 0 || c0 >= C) return;
#pragma unroll
    for (int j = 0; j < RV; ++j) {
        const int c = c0 + j;
        const float total = dz_sum[j], invstd = save_invstd[c], m = (float)rows;
        const float dzx = invstd * dzy_sum[j];  // sum(dz * xhat)
        const float g = gamma != nullptr ? gamma[c] : 1.f;
        if (dgamma != nullptr) dgamma[c] = dzx;
        if (dbeta != nullptr) dbeta[c] = total;
        // dy = g*invstd*(dz - dbeta/m - xhat*dgamma/m), xhat = (y - mean)*invstd
        const float A = g * invstd;
        coef[c] = A;
        coef[C + c] = -A * invstd * dzx / m;
        coef[2 * C + c] = -A * total / m;
    }
}

// The conv output's per-channel sum and sum of squares in a fixed order, for deterministic mode: cuDNN's
// genstats adds its blocks' sums in no fixed order (bit-different statistics call to call, measured on an
// H200 with deterministic plans). Same chunks and counters as bn_bwd_reduce; the last block writes sum, sq_sum.
template <typename T, int RV>
__global__ void __launch_bounds__(TILE * ROWS_LANES, 2) bn_stats(const T* __restrict__ y, float* __restrict__ partials,
                                                                float* __restrict__ sum, float* __restrict__ sq_sum,
                                                                unsigned int* __restrict__ counters, long long rows,
                                                                int C, long long chunk_rows, long long chunks) {
    __shared__ float lanes[2][ROWS_LANES][TILE * RV + 1];
    const int c0 = (blockIdx.x * TILE + threadIdx.x) * RV;
    float s1[RV], s2[RV];
#pragma unroll
    for (int j = 0; j < RV; ++j) s1[j] = s2[j] = 0.f;
    if (c0 < C) {
        const long long r0 = blockIdx.y * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += ROWS_LANES) {
            float v[RV];
            load<T, RV>(y, r * C + c0, v);
#pragma unroll
            for (int j = 0; j < RV; ++j) { s1[j] += v[j]; s2[j] += v[j] * v[j]; }
        }
    }
    if (!last_block_totals<RV>(lanes, s1, s2, partials, counters, C, c0, chunks)) return;
    if (threadIdx.y != 0 || c0 >= C) return;
#pragma unroll
    for (int j = 0; j < RV; ++j) {
        sum[c0 + j] = s1[j];
        sq_sum[c0 + j] = s2[j];
    }
}

template <typename T, int VEC>
__global__ void bn_bwd_apply(const T* __restrict__ da, const T* __restrict__ y, const T* __restrict__ a,
                             const T* __restrict__ scale, const T* __restrict__ shift,
                             const float* __restrict__ save_mean, const float* __restrict__ coef,
                             T* __restrict__ dy, T* __restrict__ dz_out, long long n, int C, int relu) {
    const long long stride = (long long)gridDim.x * blockDim.x * VEC;
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    // the channel follows i by a fixed step: no 64-bit remainder per element group
    const int step = (int)(stride % C);
    for (int c = (int)(i % C); i < n; i += stride, c = c + step >= C ? c + step - C : c + step) {
        float g[VEC], v[VEC], pre[VEC], s[VEC], t[VEC];
        load<T, VEC>(da, i, g);
        load<T, VEC>(y, i, v);
        if (relu) {
            if (a != nullptr) {
                load<T, VEC>(a, i, pre);
            } else {
                load<T, VEC>(scale, c, s);
                load<T, VEC>(shift, c, t);
#pragma unroll
                for (int j = 0; j < VEC; ++j) pre[j] = v[j] * s[j] + t[j];
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) g[j] = pre[j] > 0.f ? g[j] : 0.f;
        }
        if (dz_out != nullptr) store<T, VEC>(dz_out, i, g);
        float A[VEC], B[VEC], K[VEC], mean[VEC];
        load<VEC>(coef, c, A);
        load<VEC>(coef, C + c, B);
        load<VEC>(coef, 2 * C + c, K);
        load<VEC>(save_mean, c, mean);
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] = A[j] * g[j] + B[j] * (v[j] - mean[j]) + K[j];
        store<T, VEC>(dy, i, g);
    }
}

// Up to 4 same-layout casts in one launch (a run's conv weights to float16 for the forward, their float16
// gradients to float32 after it): blockIdx.y picks the tensor. Plain arguments, picked by a switch: a
// by-value struct indexed by blockIdx.y was copied to local memory.
template <typename S, typename D>
__global__ void cast_multi(const S* __restrict__ s0, const S* __restrict__ s1, const S* __restrict__ s2,
                           const S* __restrict__ s3, D* __restrict__ d0, D* __restrict__ d1, D* __restrict__ d2,
                           D* __restrict__ d3, long long n0, long long n1, long long n2, long long n3) {
    const S* src;
    D* dst;
    long long n;
    switch (blockIdx.y) {
        case 0: src = s0; dst = d0; n = n0; break;
        case 1: src = s1; dst = d1; n = n1; break;
        case 2: src = s2; dst = d2; n = n2; break;
        default: src = s3; dst = d3; n = n3; break;
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = from_acc<D>(to_acc(src[i]));
}
