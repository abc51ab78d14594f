// The elementwise parts of a linear layer y = act(a @ b + bias) around cuBLAS's GEMMs, forward and backward.
// Header-free (no cuda_fp16.h / cuda_bf16.h) so NVRTC needs no CUDA toolkit include path; the activation
// formulas are epilogue.cu's (activations.cuh), with a faster exp. Every matrix here is row-major
// [rows, n] and contiguous; math in f32.
//
// Bit mask (leaky_relu): uint32 words [rows, ceil(n / 32)], bit (c % 32) of word (row, c / 32) is 1
// where pre[row, c] > 0 (so the slope at 0 is leaky_relu's negative one, as in torch).

#include "types.cuh"

// exp as 2^(x log2 e) on the SFU: ~2 ulp (plus |x| * 2^-24 from the scaling), a few instructions where
// expf's full-range reduction takes a dozen; the elementwise passes are otherwise bound by this math.
__device__ __forceinline__ float m_exp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }

#include "activations.cuh"

// 16-bit outputs: gelu, silu and sigmoid from the SFU's reciprocal and exp, a few 1e-7 (relative) off the
// exact values, far below a 16-bit ulp. With erff and IEEE division the forward pass was compute-bound on an
// H100 (gelu 85 us where elu took 50, bf16 8192 x 4096); float32 io keeps the exact formulas.
__device__ __forceinline__ float m_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// erfc(z) for z >= 0 with relative error < 1.2e-7 everywhere (Numerical Recipes' Chebyshev fit), plus the SFU's
// few ulps; branch-free, and relative accuracy in the tail where 1 + erf(-z) would cancel.
__device__ __forceinline__ float erfc_fast(float z) {
    const float t = m_rcp(1.f + 0.5f * z);
    const float s = -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * (-0.18628806f +
                    t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
    return t * m_exp(s - z * z);
}
// gelu(x) = x / 2 * (1 + erf(x / sqrt 2)), with 1 + erf(z) = 2 - erfc(z) for z >= 0 and erfc(-z) below.
__device__ __forceinline__ float gelu_fast(float x) {
    const float c = erfc_fast(fabsf(x) * 0.7071067811865476f);
    return 0.5f * x * (x >= 0.f ? 2.f - c : c);
}

// V consecutive elements: one 16-byte access when V > 1 (the caller guarantees alignment and n % V == 0).
template <typename T, int V> struct Vec { T t[V]; };

template <typename T, int V> __device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
    Vec<T, V> out;
    if constexpr (V == 1) {
        out.t[0] = p[0];
    } else {
        static_assert(sizeof(T) * V == 16, "vectors are 16 bytes");
        union { uint4 u; Vec<T, V> v; } pack;
        pack.u = *reinterpret_cast<const uint4*>(p);
        out = pack.v;
    }
    return out;
}

template <typename T, int V> __device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& v) {
    if constexpr (V == 1) {
        p[0] = v.t[0];
    } else {
        union { uint4 u; Vec<T, V> v; } pack;
        pack.v = v;
        *reinterpret_cast<uint4*>(p) = pack.u;
    }
}

enum { AUX_NONE, AUX_MASK, AUX_PRE };

template <typename T, int ACT> __device__ __forceinline__ float fwd_value(float x, float p) {
    // (CUDA's erff here, as torch's gelu kernel has it, took 61 us against 53, H100 bf16 8192 x 4096)
    if constexpr (sizeof(T) == 2 && ACT == ACT_GELU) return gelu_fast(x);
    if constexpr (sizeof(T) == 2 && ACT == ACT_SILU) return x * m_rcp(1.f + m_exp(-x));
    if constexpr (sizeof(T) == 2 && ACT == ACT_SIGMOID) return m_rcp(1.f + m_exp(-x));
    if constexpr (ACT == ACT_ELU) {  // exp(x) - 1 cancels near 0: a series there (float32 io: expm1f)
        if constexpr (sizeof(T) == 4) return x > 0.f ? x : p * expm1f(x);
        const float series = x * (1.f + x * (0.5f + x * (0.16666667f + x * 0.041666668f)));
        const float e = x > -0.0625f ? series : m_exp(x) - 1.f;
        return x > 0.f ? x : p * e;
    }
    return act_fwd<float>(x, ACT, p);
}
constexpr int WARPS = 8;    // blockDim.x == 32 * WARPS; lanes run along columns, warps along rows
constexpr int UNROLL = 4;   // rows in flight per warp (loads issued before any math)

// grad_pre = dy * act'(pre) and, fused into the same pass (grad_pre is never read back), per-block
// column sums for the bias gradient: partial[blockIdx.y, c] = sum over this block's rows, in a fixed order.
// AUX_NONE (identity): only the column sums (g is null). AUX_MASK: pre > 0 from the bit mask (leaky_relu).
// AUX_PRE: the saved pre-activation, or relu's y (relu'(y) = relu'(pre)). g or partial may be null (not needed).
template <typename T, int V, int AUX, int ACT>
__global__ void __launch_bounds__(32 * WARPS) act_bwd(
        const T* __restrict__ dy, const T* __restrict__ pre, const unsigned int* __restrict__ mask,
        T* __restrict__ g, float* __restrict__ partial, long long rows, int n, int rows_per_block,
        int mask_ld, float p) {
    __shared__ float red[WARPS * 32 * V];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int c = (blockIdx.x * 32 + lane) * V;
    const long long r0 = (long long)blockIdx.y * rows_per_block;
    const long long r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
    float sum[V];
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] = 0.f;
    if (c < n) {
        for (long long r = r0 + w; r < r1; r += WARPS * UNROLL) {
            Vec<T, V> d[UNROLL], x[UNROLL];
            unsigned int bits[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long rr = r + (long long)u * WARPS;
                if (rr < r1) {
                    d[u] = load_vec<T, V>(dy + rr * n + c);
                    if constexpr (AUX == AUX_PRE) x[u] = load_vec<T, V>(pre + rr * n + c);
                    if constexpr (AUX == AUX_MASK) bits[u] = mask[rr * mask_ld + (c >> 5)] >> (c & 31);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long rr = r + (long long)u * WARPS;
                if (rr < r1) {
                    Vec<T, V> out;
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        float gv = to_acc(d[u].t[j]);
                        if constexpr (AUX == AUX_MASK) {
                            const bool on = (bits[u] >> j) & 1u;
                            gv = on ? gv : (ACT == ACT_LEAKY ? gv * p : 0.f);
                        } else if constexpr (AUX == AUX_PRE) {
                            gv *= act_grad<float>(to_acc(x[u].t[j]), ACT, p);
                        }
                        sum[j] += gv;
                        out.t[j] = from_acc<T>(gv);
                    }
                    if (AUX != AUX_NONE && g) store_vec<T, V>(g + rr * n + c, out);
                }
            }
        }
    }
    if (partial == nullptr) return;  // uniform over the block
#pragma unroll
    for (int j = 0; j < V; ++j) red[w * 32 * V + lane * V + j] = sum[j];
    __syncthreads();
    for (int t = threadIdx.x; t < 32 * V; t += 32 * WARPS) {
        const int col = blockIdx.x * 32 * V + t;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) s += red[k * 32 * V + t];
        if (col < n) partial[(long long)blockIdx.y * n + col] = s;
    }
}

// dbias[c] (+)= sum over the partial rows, in a fixed order: deterministic, no atomics.
template <typename T>
__global__ void bias_finalize(const float* __restrict__ partial, int nparts, int n, T* __restrict__ out,
                              long long out_stride, int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float s = 0.f;
    for (int k = 0; k < nparts; ++k) s += partial[(long long)k * n + c];
    if (accumulate) s += to_acc(out[c * out_stride]);
    out[c * out_stride] = from_acc<T>(s);
}

template <int V> __device__ __forceinline__ void load_f32(const float* p, float (&out)[V]) {
    if constexpr (V == 1) {
        out[0] = p[0];
    } else {
#pragma unroll
        for (int q = 0; q < V / 4; ++q) {
            const float4 f = *reinterpret_cast<const float4*>(p + 4 * q);
            out[4 * q] = f.x; out[4 * q + 1] = f.y; out[4 * q + 2] = f.z; out[4 * q + 3] = f.w;
        }
    }
}

// V accumulator values as f32: the GEMM's f32 result, or a pre-activation it already wrote in the io type.
template <typename A, typename T, int V> __device__ __forceinline__ void load_acc(const A* p, float (&out)[V]) {
    if constexpr (sizeof(A) == 4) {
        load_f32<V>(reinterpret_cast<const float*>(p), out);
    } else {
        const Vec<T, V> v = load_vec<T, V>(reinterpret_cast<const T*>(p));
#pragma unroll
        for (int j = 0; j < V; ++j) out[j] = to_acc(v.t[j]);
    }
}

// Forward epilogue on the GEMM's result acc (A = float: f32 accumulators; A = T: the pre-activation the
// GEMM already wrote in the io type): pre = round(acc + bias) (one rounding; with A = T bias is null and pre
// is acc), y = act(pre) computed from the rounded pre (as torch's activation on addmm's output), and the
// bit mask of pre > 0 when mask is not null. pre may be null (not saved); acc may be the same memory as pre
// or y (in place), so those three are not __restrict__. Each warp has UNROLL rows' loads in flight before
// any math (one row at a time left the pass at half of torch's elementwise bandwidth on an H100); the
// activation is a template argument, so the loop holds only its own formula.
// Blocks per SM the pass is compiled for: 4 (64 registers) where it reads the io type, which fits them with no
// spill; gelu and tanh took 73-74 registers otherwise (3 blocks). f32 accumulators need more (UNROLL x V floats).
#define FWD_MIN_BLOCKS(T, A) (sizeof(A) == sizeof(T) ? 4 : 1)
template <typename T, typename A, int V, int ACT>
__global__ void __launch_bounds__(32 * WARPS, FWD_MIN_BLOCKS(T, A)) act_fwd_rows(
        const A* acc, const T* __restrict__ bias, long long bias_stride, T* pre, T* y,
        unsigned int* __restrict__ mask, long long rows, int n, int mask_ld, float p) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int c = (blockIdx.x * 32 + lane) * V;
    const bool in = c < n;
    float bv[V];
#pragma unroll
    for (int j = 0; j < V; ++j) bv[j] = (bias != nullptr && in) ? to_acc(bias[(long long)(c + j) * bias_stride]) : 0.f;
    const long long stride = (long long)gridDim.y * WARPS * UNROLL;
    for (long long r0 = (long long)blockIdx.y * WARPS * UNROLL + w; r0 < rows; r0 += stride) {
        float v[UNROLL][V];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long r = r0 + (long long)u * WARPS;
            if (in && r < rows) load_acc<A, T, V>(acc + r * n + c, v[u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long r = r0 + (long long)u * WARPS;
            if (r >= rows) break;  // uniform over the warp: the mask's shuffles below see every lane
            unsigned int bits = 0u;
            if (in) {
                Vec<T, V> pv, yv;
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    float x = v[u][j];  // A = T (16-bit): already the rounded pre, no bias left to add
                    if constexpr (sizeof(A) == 4) {
                        pv.t[j] = from_acc<T>(x + bv[j]);
                        x = to_acc(pv.t[j]);
                    }
                    bits |= (x > 0.f ? 1u : 0u) << j;
                    yv.t[j] = from_acc<T>(fwd_value<T, ACT>(x, p));
                }
                if (sizeof(A) == 4 && pre != nullptr) store_vec<T, V>(pre + r * n + c, pv);
                store_vec<T, V>(y + r * n + c, yv);
            }
            if (mask != nullptr) {
                bits <<= (c & 31);
                if constexpr (V == 1) {
                    bits = __ballot_sync(0xffffffffu, bits != 0u);
                } else {
#pragma unroll
                    for (int o = 1; o < 32 / V; o <<= 1) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
                }
                if (in && (c & 31) == 0) mask[r * mask_ld + (c >> 5)] = bits;
            }
        }
    }
}

// y = act(x) over `vectors` runs of V contiguous elements: the forward pass where the GEMM already wrote the
// rounded pre-activation (no bias left to add, no mask), as one flat array the way torch's elementwise
// kernels run it: each thread loads ITEMS vectors THREADS apart, then computes and stores them. x may be y
// (in place), so neither is __restrict__.
template <typename T, int V, int ACT, int THREADS, int ITEMS>
__global__ void __launch_bounds__(THREADS) act_fwd_flat(const T* x, T* y, long long vectors, float p) {
    const long long base = (long long)blockIdx.x * (THREADS * ITEMS) + threadIdx.x;
    Vec<T, V> v[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * THREADS;
        if (i < vectors) v[k] = load_vec<T, V>(x + i * V);
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * THREADS;
        if (i < vectors) {
            Vec<T, V> out;
#pragma unroll
            for (int j = 0; j < V; ++j) out.t[j] = from_acc<T>(fwd_value<T, ACT>(to_acc(v[k].t[j]), p));
            store_vec<T, V>(y + i * V, out);
        }
    }
}

// dst[r, c] (+)= src[r * cols + c]: an f32 GEMM result (summed over batches) into the io-typed gradient.
template <typename T>
__global__ void convert_add(const float* __restrict__ src, T* __restrict__ dst, int rows, int cols,
                            long long rs, long long cs, int accumulate) {
    const long long total = (long long)rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols, c = i % cols;
        float v = src[i];
        if (accumulate) v += to_acc(dst[r * rs + c * cs]);
        dst[r * rs + c * cs] = from_acc<T>(v);
    }
}
