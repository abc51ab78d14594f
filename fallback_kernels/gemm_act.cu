// The elementwise parts of a linear layer y = act(a @ b + bias) around cuBLAS's GEMMs, forward and backward.
// Header-free (no cuda_fp16.h / cuda_bf16.h) so NVRTC needs no CUDA toolkit include path; the activation
// formulas are epilogue.cu's (activations.cuh), with a faster exp. Every matrix here is row-major
// [rows, n] and contiguous; math in f32.
//
// Bit mask (relu, leaky_relu): uint32 words [rows, ceil(n / 32)], bit (c % 32) of word (row, c / 32) is 1
// where pre[row, c] > 0 (so relu'(0) = 0, as in torch).

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
constexpr int WARPS = 8;    // blockDim.x == 32 * WARPS; lanes run along columns, warps along rows
constexpr int UNROLL = 4;   // rows in flight per warp (loads issued before any math)

// grad_pre = dy * act'(pre) and, fused into the same pass (grad_pre is never read back), per-block
// column sums for the bias gradient: partial[blockIdx.y, c] = sum over this block's rows, in a fixed order.
// AUX_NONE (identity): only the column sums (g is null). AUX_MASK: pre > 0 from the bit mask (relu,
// leaky_relu). AUX_PRE: the saved pre-activation. g or partial may be null (not needed).
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

// Forward epilogue on the GEMM's f32 result: pre = round(acc + bias) (one rounding, as torch's addmm with
// its bias epilogue), y = act(pre) computed from the rounded pre (as torch's activation on addmm's
// output), and the bit mask of pre > 0 when mask is not null. pre may be null (not saved); acc may be
// the same memory as pre or y (float32 io: in place), so those three are not __restrict__.
template <typename T, int V>
__global__ void __launch_bounds__(32 * WARPS) act_fwd_rows(
        const float* acc, const T* __restrict__ bias, long long bias_stride, T* pre, T* y,
        unsigned int* __restrict__ mask, long long rows, int n, int mask_ld, int act, float p) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int c = (blockIdx.x * 32 + lane) * V;
    const bool in = c < n;
    float bv[V];
#pragma unroll
    for (int j = 0; j < V; ++j) bv[j] = (bias != nullptr && in) ? to_acc(bias[(long long)(c + j) * bias_stride]) : 0.f;
    for (long long r = (long long)blockIdx.y * WARPS + w; r < rows; r += (long long)gridDim.y * WARPS) {
        unsigned int bits = 0u;
        if (in) {
            float v[V];
            load_f32<V>(acc + r * n + c, v);
            Vec<T, V> pv, yv;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                pv.t[j] = from_acc<T>(v[j] + bv[j]);
                const float x = to_acc(pv.t[j]);
                bits |= (x > 0.f ? 1u : 0u) << j;
                yv.t[j] = from_acc<T>(act_fwd<float>(x, act, p));
            }
            if (pre != nullptr) store_vec<T, V>(pre + r * n + c, pv);
            store_vec<T, V>(y + r * n + c, yv);
        }
        if (mask != nullptr) {  // uniform: every lane of the warp takes part in the shuffles
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
