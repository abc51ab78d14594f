// Vector loads and stores of VEC consecutive values in the math type (float), shared by the kernel sources.
// Header-free like types.cuh; compile.py pastes it in place of its #include line.
#include "types.cuh"

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
