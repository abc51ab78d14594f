// The activations of cudnn_graphs.spec.activations (same order as its ACTIVATIONS), forward and derivative.
// The including file defines the math it wants first: m_exp, m_erf, m_tanh, m_log1p for its math types
// (precise libm calls in epilogue.cu, the SFU's exp in gemm_act.cu).

// Activation codes, shared with the launchers (ACT_CODES).
enum { ACT_IDENTITY, ACT_RELU, ACT_LEAKY, ACT_ELU, ACT_GELU, ACT_GELU_TANH, ACT_SILU, ACT_SIGMOID, ACT_TANH, ACT_SOFTPLUS };

template <typename A> __device__ __forceinline__ A act_fwd(A x, int act, A p) {
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

template <typename A> __device__ __forceinline__ A act_grad(A x, int act, A p) {
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
