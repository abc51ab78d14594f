// 16-bit storage types and their conversions to and from the math type, shared by every kernel source.
// Header-free (no cuda_fp16.h / cuda_bf16.h) so NVRTC needs no CUDA toolkit include path; compile.py
// pastes this file in place of its #include line, so CuPy's kernel cache keys on the full text.

struct half_t { unsigned short v; };
struct bf16_t { unsigned short v; };

__device__ __forceinline__ float to_acc(half_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.v)); return f; }
__device__ __forceinline__ float to_acc(bf16_t h) { return __uint_as_float(((unsigned int)h.v) << 16); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ half_t from_acc<half_t>(float x) { half_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.v) : "f"(x)); return h; }
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
    bf16_t h;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.v) : "f"(x));  // one instruction: elementwise passes are bound by it
#else
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { h.v = 0x7fc0; return h; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    h.v = (unsigned short)(u >> 16);
#endif
    return h;
}
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
