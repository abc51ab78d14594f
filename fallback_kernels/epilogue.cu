// Conv epilogues for when cuDNN has no fused engine: y = act(alpha*acc + bias + beta*z),
// dx = acc * act'(pre), db = sum(dy). T: io type, A: math type, C: type the conv wrote acc in. Header-free (no cuda_fp16.h / cuda_bf16.h) so NVRTC needs no
// CUDA toolkit include path. acc is the conv output in the accumulation type A.

struct half_t { unsigned short v; };
struct bf16_t { unsigned short v; };

__device__ __forceinline__ float to_acc(half_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.v)); return f; }
__device__ __forceinline__ float to_acc(bf16_t h) { return __uint_as_float(((unsigned int)h.v) << 16); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ half_t from_acc<half_t>(float x) { half_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.v) : "f"(x)); return h; }
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16_t h;
    if ((u & 0x7fffffffu) > 0x7f800000u) { h.v = 0x7fc0; return h; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    h.v = (unsigned short)(u >> 16);
    return h;
}
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }

// Activation codes, shared with epilogue.py.
enum { ACT_IDENTITY, ACT_RELU, ACT_LEAKY, ACT_ELU, ACT_GELU, ACT_GELU_TANH, ACT_SILU, ACT_SIGMOID, ACT_TANH, ACT_SOFTPLUS };

template <typename A> __device__ A act_fwd(A x, int act, A p) {
    const A k0 = A(0.7978845608028654), k1 = A(0.044715);
    switch (act) {
        case ACT_RELU: return x > A(0) ? x : A(0);
        case ACT_LEAKY: return x > A(0) ? x : p * x;
        case ACT_ELU: return x > A(0) ? x : p * (m_exp(x) - A(1));
        case ACT_GELU: return A(0.5) * x * (A(1) + m_erf(x * A(0.7071067811865476)));
        case ACT_GELU_TANH: return A(0.5) * x * (A(1) + m_tanh(k0 * (x + k1 * x * x * x)));
        case ACT_SILU: return x / (A(1) + m_exp(-x));
        case ACT_SIGMOID: return A(1) / (A(1) + m_exp(-x));
        case ACT_TANH: return m_tanh(x);
        // Exact, overflow-free, no threshold: the same function as cuDNN's fused softplus.
        case ACT_SOFTPLUS: { A b = p * x; return ((b > A(0) ? b : A(0)) + m_log1p(m_exp(-(b > A(0) ? b : -b)))) / p; }
        default: return x;
    }
}

template <typename A> __device__ A act_grad(A x, int act, A p) {
    const A k0 = A(0.7978845608028654), k1 = A(0.044715);
    switch (act) {
        case ACT_RELU: return x > A(0) ? A(1) : A(0);
        case ACT_LEAKY: return x > A(0) ? A(1) : p;
        case ACT_ELU: return x > A(0) ? A(1) : p * m_exp(x);
        case ACT_GELU: return A(0.5) * (A(1) + m_erf(x * A(0.7071067811865476)))
                              + x * A(0.3989422804014327) * m_exp(A(-0.5) * x * x);
        case ACT_GELU_TANH: {
            A t = m_tanh(k0 * (x + k1 * x * x * x));
            return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * k0 * (A(1) + A(3) * k1 * x * x);
        }
        case ACT_SILU: { A s = A(1) / (A(1) + m_exp(-x)); return s * (A(1) + x * (A(1) - s)); }
        case ACT_SIGMOID: { A s = A(1) / (A(1) + m_exp(-x)); return s * (A(1) - s); }
        case ACT_TANH: { A t = m_tanh(x); return A(1) - t * t; }
        case ACT_SOFTPLUS: return A(1) / (A(1) + m_exp(-p * x));
        default: return A(1);
    }
}

// meta: rank, shape[5], then 5 strides for each of up to 4 tensors (elements; logical N, C, ...).
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
                             T* __restrict__ y, const long long* __restrict__ meta, long long n,
                             A alpha, A beta, int act, A param) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long off[3];
        offsets(i, meta, 3, off);
        A v = alpha * (A)to_acc(acc[off[0]]);
        if (bias) v += (A)to_acc(bias[channel_of(i, meta)]);
        if (z) v += beta * (A)to_acc(z[off[2]]);
        y[off[1]] = from_acc<T>(act_fwd<A>(v, act, param));
    }
}

// tensors in meta order: 0 = acc (dgrad output), 1 = dx, 2 = pre
template <typename T, typename A, typename C>
__global__ void epilogue_act_backward(const C* __restrict__ acc, const T* __restrict__ pre, T* __restrict__ dx,
                                      const long long* __restrict__ meta, long long n, int act, A param) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long off[3];
        offsets(i, meta, 3, off);
        dx[off[1]] = from_acc<T>((A)to_acc(acc[off[0]]) * act_grad<A>((A)to_acc(pre[off[2]]), act, param));
    }
}

// One block per channel, a fixed summation order: deterministic. tensor 0 = dy.
template <typename T, typename A>
__global__ void bias_grad(const T* __restrict__ dy, T* __restrict__ db, const long long* __restrict__ meta) {
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
