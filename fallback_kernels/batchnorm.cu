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
// The ReLU's mask in the backward: from y*scale + shift (a stage the next conv's prologue activates), or, at a
// run's end, from the bits bn_apply wrote beside the output (one a value: 8 channels a byte, VEC == 8 only),
// which read 1/16 of the bytes the stored float16 output would (the output itself where bits cannot be).
// Sums over y - mean, not y: a channel whose mean is large against its spread loses nothing to cancellation.
// scale and shift are stored in the io type: cuDNN's prologue reads them so (it declines float32
// operands), and bn_apply and the mask in the backward use the same rounded values.
#include "types.cuh"
#include "vectors.cuh"

// One block (the counter is read before it is written): C <= a few thousand channels, a trivial pass.
template <typename T>
__global__ void __launch_bounds__(1024) bn_finalize(const float* __restrict__ sum, const float* __restrict__ sq_sum,
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

// r == nullptr: no residual; else + r, or + r*scale2 + shift2 where scale2 is given (a downsample branch's own
// BatchNorm). scale == nullptr: y as it is (out = y + r: the two input gradients of a block with a
// downsample branch). Decided by the pointers, not by a mode word: a re-pointed graph's moved recordings
// give every pointer a nonzero value, and a word that followed them would differ between recordings.
template <typename T, int VEC>
__global__ void bn_apply(const T* __restrict__ y, const T* __restrict__ scale, const T* __restrict__ shift,
                         const T* __restrict__ r, const T* __restrict__ scale2, const T* __restrict__ shift2,
                         T* __restrict__ out, unsigned char* __restrict__ bits, long long n, int C, int relu) {
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
        if constexpr (VEC == 8) {
            if (bits != nullptr) {  // of the stored (rounded) values: the mask torch's relu backward reads
                unsigned int b = 0;
#pragma unroll
                for (int j = 0; j < VEC; ++j) b |= (to_acc(from_acc<T>(v[j])) > 0.f ? 1u : 0u) << j;
                bits[i / 8] = (unsigned char)b;
            }
        }
    }
}

// Whether the ReLU passed value j: from the bits (RV == 8), the stored output, or y*scale + shift.
template <typename T, int RV>
__device__ __forceinline__ bool passed(int j, unsigned int m, const Vec<T, RV>& pre, float y, float s, float t,
                                       int mode) {
    return mode == 2 ? (m >> j) & 1u : mode == 1 ? to_acc(pre.v[j]) > 0.f : y * s + t > 0.f;
}

#ifndef BN_UNROLL
#define BN_UNROLL 4      // rows a thread loads before it adds any (the reduction is latency-bound without)
#endif
#define THREADS 256      // threads of a reduction block: TX channel groups x THREADS / TX row lanes
// Blocks an SM must hold (__launch_bounds__): the backward's BN_UNROLL rows of three 16-byte loads need ~114
// registers (at 64 they spilled 772 bytes); the statistics' one tensor fits 64.
#define REDUCE_MIN_BLOCKS 2
#define STATS_MIN_BLOCKS 4

// RV floats at p through L2 (other blocks wrote them), in 16-byte loads where RV allows.
template <int RV>
__device__ __forceinline__ void load_cg(const float* __restrict__ p, float (&out)[RV]) {
    if constexpr (RV % 4 == 0) {
#pragma unroll
        for (int q = 0; q < RV / 4; ++q) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(p) + q);
            out[4 * q] = v.x; out[4 * q + 1] = v.y; out[4 * q + 2] = v.z; out[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < RV; ++j) out[j] = __ldcg(p + j);
    }
}

// A reduction block's layout: thread t owns channels [tile * COLS + (t % TX) * RV, + RV) of rows t / TX,
// t / TX + LANES, ...: TX threads of RV channels read a row's tile (16-byte loads where RV * sizeof(T) == 16).
template <int RV, int TX>
struct Tile {
    static constexpr int LANES = THREADS / TX, WARPS = THREADS / 32, COLS = TX * RV;
    float part[2][WARPS][COLS + 1];
    float total[2][COLS];
};

// The block's sums of (s1, s2) per channel into tile.total, in a fixed order (deterministic): a butterfly
// over the warp's row lanes (every lane gets the same bits), then the warps' sums in warp order.
template <int RV, int TX>
__device__ __forceinline__ void block_totals(Tile<RV, TX>& tile, float (&s1)[RV], float (&s2)[RV]) {
#pragma unroll
    for (int off = TX; off < 32; off <<= 1) {
#pragma unroll
        for (int j = 0; j < RV; ++j) {
            s1[j] += __shfl_xor_sync(0xffffffffu, s1[j], off);
            s2[j] += __shfl_xor_sync(0xffffffffu, s2[j], off);
        }
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane < TX) {
#pragma unroll
        for (int j = 0; j < RV; ++j) {
            tile.part[0][warp][lane * RV + j] = s1[j];
            tile.part[1][warp][lane * RV + j] = s2[j];
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < 2 * Tile<RV, TX>::COLS; k += THREADS) {
        const int s = k / Tile<RV, TX>::COLS, col = k % Tile<RV, TX>::COLS;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < Tile<RV, TX>::WARPS; ++w) sum += tile.part[s][w][col];
        tile.total[s][col] = sum;
    }
    __syncthreads();
}

// A chunk's block stores its sums as partials[chunk][2][C]; the tile's last block to arrive (counted in
// `counters[tile]`, left at 0 again for the next launch) sums every chunk in chunk order -- the same order
// whichever block is last: deterministic -- into tile.total and returns true. One launch where a second
// one for the chunks' sum cost ~5-20 us of latency a stage.
template <int RV, int TX>
__device__ bool last_block_totals(Tile<RV, TX>& tile, float (&s1)[RV], float (&s2)[RV],
                                  float* __restrict__ partials, unsigned int* __restrict__ counters, int C,
                                  long long chunks) {
    constexpr int COLS = Tile<RV, TX>::COLS, LANES = Tile<RV, TX>::LANES;
    __shared__ bool last;
    block_totals<RV, TX>(tile, s1, s2);
    const int cbase = blockIdx.x * COLS;
    for (int k = threadIdx.x; k < 2 * COLS; k += THREADS) {
        const int s = k / COLS, col = k % COLS;
        if (cbase + col < C) partials[(2 * blockIdx.y + s) * C + cbase + col] = tile.total[s][col];
    }
    __threadfence();  // this block's partials are visible before its count is
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned int)(chunks - 1);
        if (last) counters[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return false;
#pragma unroll
    for (int j = 0; j < RV; ++j) s1[j] = s2[j] = 0.f;
    const int c0 = cbase + (threadIdx.x % TX) * RV;
    if (c0 < C) {
#pragma unroll 4
        for (long long k = threadIdx.x / TX; k < chunks; k += LANES) {  // a few L2 round trips, not one a chunk
            float p1[RV], p2[RV];
            load_cg<RV>(partials + (2 * k) * C + c0, p1);
            load_cg<RV>(partials + (2 * k + 1) * C + c0, p2);
#pragma unroll
            for (int j = 0; j < RV; ++j) { s1[j] += p1[j]; s2[j] += p2[j]; }
        }
    }
    block_totals<RV, TX>(tile, s1, s2);
    return true;
}

template <typename T, int RV>
__device__ __forceinline__ Vec<T, RV> load_vec(const T* __restrict__ p, long long i) {
    return *reinterpret_cast<const Vec<T, RV>*>(p + i);
}

// mode: 0 mask from y*scale + shift, 1 from the stored output (pre), 2 from the bits (m); relu == 0: none.
template <typename T, int RV>
__device__ __forceinline__ void accumulate(const Vec<T, RV>& g, const Vec<T, RV>& v, const Vec<T, RV>& pre,
                                           unsigned int m, const float (&s)[RV], const float (&t)[RV],
                                           const float (&mean)[RV], int mode, int relu, float (&dz_sum)[RV],
                                           float (&dzy_sum)[RV]) {
#pragma unroll
    for (int j = 0; j < RV; ++j) {
        const float y = to_acc(v.v[j]);
        const float dz = !relu || passed<T, RV>(j, m, pre, y, s[j], t[j], mode) ? to_acc(g.v[j]) : 0.f;
        dz_sum[j] += dz;
        dzy_sum[j] += dz * (y - mean[j]);
    }
}

template <typename T>
struct Rows {
    const T* __restrict__ da; const T* __restrict__ y; const T* __restrict__ a; const unsigned char* __restrict__ bits;
    const T* __restrict__ scale; const T* __restrict__ shift; const float* __restrict__ mean;
    int C, c0, relu;
};

// A thread's sums over rows [r0, r1) of its block's lanes, the mask from MODE's source (accumulate).
template <typename T, int RV, int TX, int MODE>
__device__ __forceinline__ void sum_rows(const Rows<T>& in, long long r0, long long r1, float (&dz_sum)[RV],
                                         float (&dzy_sum)[RV]) {
    constexpr int LANES = Tile<RV, TX>::LANES;
    float s[RV], t[RV], mean[RV];
    if (MODE == 0) { load<T, RV>(in.scale, in.c0, s); load<T, RV>(in.shift, in.c0, t); }
    load<RV>(in.mean, in.c0, mean);
    long long r = r0 + threadIdx.x / TX;
    // BN_UNROLL rows' loads issued before any is used: one row's loads in flight per thread left the
    // reduction latency-bound (3.5x off the memory bandwidth on ResNet-50's layers).
    for (; r + (BN_UNROLL - 1) * LANES < r1; r += BN_UNROLL * LANES) {
        Vec<T, RV> g[BN_UNROLL], v[BN_UNROLL], pre[BN_UNROLL];
        unsigned int m[BN_UNROLL];
#pragma unroll
        for (int u = 0; u < BN_UNROLL; ++u) {
            const long long i = (r + u * LANES) * in.C + in.c0;
            g[u] = load_vec<T, RV>(in.da, i);
            v[u] = load_vec<T, RV>(in.y, i);
            if (MODE == 2) m[u] = in.bits[i / 8];
            if (MODE == 1) pre[u] = load_vec<T, RV>(in.a, i);
        }
#pragma unroll
        for (int u = 0; u < BN_UNROLL; ++u)
            accumulate<T, RV>(g[u], v[u], pre[u], m[u], s, t, mean, MODE, in.relu, dz_sum, dzy_sum);
    }
    for (; r < r1; r += LANES) {
        const long long i = r * in.C + in.c0;
        Vec<T, RV> pre;
        unsigned int m = 0;
        if (MODE == 2) m = in.bits[i / 8];
        if (MODE == 1) pre = load_vec<T, RV>(in.a, i);
        accumulate<T, RV>(load_vec<T, RV>(in.da, i), load_vec<T, RV>(in.y, i), pre, m, s, t, mean, MODE, in.relu,
                          dz_sum, dzy_sum);
    }
}

// Block (tile, chunk) sums dz and dz*(y - mean) over its rows; the tile's last block writes dgamma, dbeta and
// the coefficients (last_block_totals). `counters` is the caller's, one per tile, zero between launches: two
// launches using the same counters must not overlap.
template <typename T, int RV, int TX>
__global__ void __launch_bounds__(THREADS, REDUCE_MIN_BLOCKS) bn_bwd_reduce(
        const T* __restrict__ da, const T* __restrict__ y, const T* __restrict__ a,
        const unsigned char* __restrict__ bits, const T* __restrict__ scale, const T* __restrict__ shift,
        const float* __restrict__ gamma, const float* __restrict__ save_mean,
        const float* __restrict__ save_invstd, float* __restrict__ partials, float* __restrict__ dgamma,
        float* __restrict__ dbeta, float* __restrict__ coef, unsigned int* __restrict__ counters,
        long long rows, int C, long long chunk_rows, long long chunks, int relu) {
    using Layout = Tile<RV, TX>;
    __shared__ Layout tile;
    const int c0 = blockIdx.x * Layout::COLS + (threadIdx.x % TX) * RV;
    float dz_sum[RV], dzy_sum[RV];
#pragma unroll
    for (int j = 0; j < RV; ++j) dz_sum[j] = dzy_sum[j] = 0.f;
    if (c0 < C) {
        const long long r0 = blockIdx.y * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
        const Rows<T> in{da, y, a, bits, scale, shift, save_mean, C, c0, relu};
        // one loop a mask source: each keeps only its own values live (one loop for all spilled at bf16)
        if (RV == 8 && bits != nullptr) sum_rows<T, RV, TX, 2>(in, r0, r1, dz_sum, dzy_sum);
        else if (a != nullptr) sum_rows<T, RV, TX, 1>(in, r0, r1, dz_sum, dzy_sum);
        else sum_rows<T, RV, TX, 0>(in, r0, r1, dz_sum, dzy_sum);
    }
    if (!last_block_totals<RV, TX>(tile, dz_sum, dzy_sum, partials, counters, C, chunks)) return;
    for (int col = threadIdx.x; col < Layout::COLS && blockIdx.x * Layout::COLS + col < C; col += THREADS) {
        const int c = blockIdx.x * Layout::COLS + col;
        const float total = tile.total[0][col], invstd = save_invstd[c], m = (float)rows;
        const float dzx = invstd * tile.total[1][col];  // sum(dz * xhat)
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
template <typename T, int RV, int TX>
__global__ void __launch_bounds__(THREADS, STATS_MIN_BLOCKS) bn_stats(
        const T* __restrict__ y, float* __restrict__ partials, float* __restrict__ sum, float* __restrict__ sq_sum,
        unsigned int* __restrict__ counters, long long rows, int C, long long chunk_rows, long long chunks) {
    using Layout = Tile<RV, TX>;
    __shared__ Layout tile;
    const int c0 = blockIdx.x * Layout::COLS + (threadIdx.x % TX) * RV;
    float s1[RV], s2[RV];
#pragma unroll
    for (int j = 0; j < RV; ++j) s1[j] = s2[j] = 0.f;
    if (c0 < C) {
        const long long r0 = blockIdx.y * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
#pragma unroll 4
        for (long long r = r0 + threadIdx.x / TX; r < r1; r += Layout::LANES) {
            float v[RV];
            load<T, RV>(y, r * C + c0, v);
#pragma unroll
            for (int j = 0; j < RV; ++j) { s1[j] += v[j]; s2[j] += v[j] * v[j]; }
        }
    }
    if (!last_block_totals<RV, TX>(tile, s1, s2, partials, counters, C, chunks)) return;
    for (int col = threadIdx.x; col < Layout::COLS && blockIdx.x * Layout::COLS + col < C; col += THREADS) {
        sum[blockIdx.x * Layout::COLS + col] = tile.total[0][col];
        sq_sum[blockIdx.x * Layout::COLS + col] = tile.total[1][col];
    }
}

template <typename T, int VEC>
__global__ void bn_bwd_apply(const T* __restrict__ da, const T* __restrict__ y, const T* __restrict__ a,
                             const unsigned char* __restrict__ bits, const T* __restrict__ scale, const T* __restrict__ shift,
                             const float* __restrict__ save_mean, const float* __restrict__ coef,
                             T* __restrict__ dy, T* __restrict__ dz_out, long long n, int C, int relu) {
    const long long stride = (long long)gridDim.x * blockDim.x * VEC;
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const int step = (int)(stride % C);  // as in bn_apply: per-channel values reloaded only when c moves
    const int mode = VEC == 8 && bits != nullptr ? 2 : a != nullptr ? 1 : 0;  // as in accumulate
    const bool from_y = relu && mode == 0;
    float s[VEC], t[VEC], A[VEC], B[VEC], K[VEC], mean[VEC];
    for (int c = (int)(i % C), loaded = -1; i < n; i += stride, c = c + step >= C ? c + step - C : c + step) {
        if (c != loaded) {
            if (from_y) { load<T, VEC>(scale, c, s); load<T, VEC>(shift, c, t); }
            load<VEC>(coef, c, A);
            load<VEC>(coef, C + c, B);
            load<VEC>(coef, 2 * C + c, K);
            load<VEC>(save_mean, c, mean);
            loaded = c;
        }
        float g[VEC], v[VEC], pre[VEC];
        load<T, VEC>(da, i, g);
        load<T, VEC>(y, i, v);
        if (relu && mode == 2) {
            const unsigned int m = bits[i / 8];
#pragma unroll
            for (int j = 0; j < VEC; ++j) g[j] = (m >> j) & 1u ? g[j] : 0.f;
        } else if (relu) {
            if (from_y) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) pre[j] = v[j] * s[j] + t[j];
            } else {
                load<T, VEC>(a, i, pre);
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) g[j] = pre[j] > 0.f ? g[j] : 0.f;
        }
        if (dz_out != nullptr) store<T, VEC>(dz_out, i, g);
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
