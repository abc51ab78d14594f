// grid_sample forward and backward with torch.nn.functional.grid_sample's semantics (ATen's
// GridSampler.cuh / GridSampler.cu): bilinear, nearest and bicubic (2-D only) interpolation, zeros /
// border / reflection padding, align_corners, 2-D (N, C, H, W) and 3-D (N, C, D, H, W) inputs.
//
// T: io type, A: math / accumulation type (float for half, bfloat16 and float; double for double).
// ND: 2 or 3 spatial dims. MODE: 0 bilinear, 1 nearest, 2 bicubic (torch's GridSamplerInterpolation).
// Header-free (no cuda_fp16.h / cuda_bf16.h / climits) so NVRTC needs no CUDA toolkit include path.
//
// Kernels:
//   gs_forward   one thread per (output point, group of VEC channels); any strides.
//   gs_backward  the fast backward: L lanes per output point, VEC contiguous channels per lane. grad_input
//                is scattered with atomics into a channels-last accumulator in A (vector red.v4.f32 on
//                sm_90); grad_grid is reduced over channels in registers + warp shuffles (no atomics).
//   gs_keys / gs_bounds / gs_gather   the deterministic backward for grad_input: one int64 key per
//                (point, tap) = destination pixel * (P * taps) + point * taps + tap, sorted (unique keys,
//                so any sort gives the same order), then one lane group per destination pixel sums its
//                contributions in key order and writes once.
//   gs_absmax / gs_count / (scan) / gs_place / gs_gather_exact   the deterministic backward for 16- and 32-bit
//                inputs: a counting sort by destination pixel (no order within a pixel), then exact sums in
//                int64 fixed point, which do not depend on the order.
//   gs_to_cl / gs_from_cl   tiled transposes between any-strided (N, C, spatial) and channels-last.
//
// All element offsets are 64-bit; pixel coordinates are int, as in ATen (sizes are checked on the host).

#include "types.cuh"

// Shared with grid_sample.py.
enum { MODE_BILINEAR, MODE_NEAREST, MODE_BICUBIC };
enum { PAD_ZEROS, PAD_BORDER, PAD_REFLECTION };
enum { F_GI = 1, F_GG = 2, F_IN_VEC = 4, F_GO_VEC = 8, F_GI_VEC = 16, F_POINT_FAST = 32 };

#define VEC 4
#define KEY_NONE 0x7fffffffffffffffLL

// Geometry, all int64, in the field order of GEO_FIELDS in grid_sample.py. 2-D: ID = OD = 1, D strides 0.
// in_*: input strides; gr_*: grid strides (K: the coordinate); go_*: grad_output (forward: output) strides.
struct Geo {
    long long N, C, ID, IH, IW, OD, OH, OW;
    long long in_sN, in_sC, in_sD, in_sH, in_sW;
    long long gr_sN, gr_sD, gr_sH, gr_sW, gr_sK;
    long long go_sN, go_sC, go_sD, go_sH, go_sW;
    long long pad, align, lanes_log2, flags;
};

// A transpose's strided side (N, C, D, H, W) against a channels-last contiguous (N, D, H, W, C) side.
// TR_FIELDS in grid_sample.py. packed: the spatial dims are contiguous (offset of spatial index s = s).
struct Tr {
    long long N, C, S, H, W;
    long long sN, sC, sD, sH, sW;
    long long packed;
};

// ---------------------------------------------------------------------------------------------------
// Math in A, spelled as ATen spells it (CUDA's ::min / ::max on floats are fminf / fmaxf: NaN-dropping).
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ float m_floor(float x) { return floorf(x); }
__device__ __forceinline__ double m_floor(double x) { return floor(x); }
__device__ __forceinline__ float m_rint(float x) { return rintf(x); }  // std::nearbyint: half to even
__device__ __forceinline__ double m_rint(double x) { return rint(x); }
__device__ __forceinline__ float m_fmod(float x, float y) { return fmodf(x, y); }
__device__ __forceinline__ double m_fmod(double x, double y) { return fmod(x, y); }
__device__ __forceinline__ float m_fabs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_fabs(double x) { return fabs(x); }
__device__ __forceinline__ float m_fmin(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double m_fmin(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ float m_fmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double m_fmax(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ bool m_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool m_finite(double x) {
    return (__double_as_longlong(x) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL;
}

// -1 -> 0 and +1 -> size - 1 (align_corners) or -1 -> -0.5 and +1 -> size - 0.5.
template <typename A> __device__ __forceinline__ A unnormalize(A coord, int size, bool align) {
    if (align) return ((coord + 1.f) / 2) * (size - 1);
    return ((coord + 1.f) * size - 1) / 2;
}

template <typename A> __device__ __forceinline__ A unnormalize_set_grad(A coord, int size, bool align, A* g) {
    if (align) {
        *g = static_cast<A>(size - 1) / 2;
        return ((coord + 1.f) / 2) * (size - 1);
    }
    *g = static_cast<A>(size) / 2;
    return ((coord + 1.f) * size - 1) / 2;
}

template <typename A> __device__ __forceinline__ A clip_coordinates(A in, int limit) {
    return m_fmin(static_cast<A>(limit - 1), m_fmax(in, static_cast<A>(0)));
}

// The borders count as out of bounds for the gradient; NaN passes through (then safe_downgrade: -100).
template <typename A> __device__ __forceinline__ A clip_coordinates_set_grad(A in, int limit, A* g) {
    if (in <= static_cast<A>(0)) { *g = static_cast<A>(0); return static_cast<A>(0); }
    const A mx = static_cast<A>(limit - 1);
    if (in >= mx) { *g = static_cast<A>(0); return mx; }
    *g = static_cast<A>(1);
    return in;
}

// Reflect until within [low, high]; bounds passed doubled so half-integers stay ints.
template <typename A> __device__ __forceinline__ A reflect_coordinates(A in, int twice_low, int twice_high) {
    if (twice_low == twice_high) return static_cast<A>(0);
    const A mn = static_cast<A>(twice_low) / 2;
    const A span = static_cast<A>(twice_high - twice_low) / 2;
    in = m_fabs(in - mn);
    const A extra = m_fmod(in, span);
    const int flips = static_cast<int>(m_floor(in / span));
    return (flips % 2 == 0) ? extra + mn : span - extra + mn;
}

template <typename A> __device__ __forceinline__ A reflect_coordinates_set_grad(A in, int twice_low, int twice_high, A* g) {
    if (twice_low == twice_high) { *g = static_cast<A>(0); return static_cast<A>(0); }
    int mult;
    const A mn = static_cast<A>(twice_low) / 2;
    const A span = static_cast<A>(twice_high - twice_low) / 2;
    in = in - mn;
    if (in < static_cast<A>(0)) { mult = -1; in = -in; } else { mult = 1; }
    const A extra = m_fmod(in, span);
    const int flips = static_cast<int>(m_floor(in / span));
    if (flips % 2 == 0) { *g = static_cast<A>(mult); return extra + mn; }
    *g = static_cast<A>(-mult);
    return span - extra + mn;
}

// Anything an int cannot hold (and NaN / inf) becomes -100: out of bounds for every tap.
template <typename A> __device__ __forceinline__ A safe_downgrade_to_int_range(A x) {
    if (x > static_cast<A>(2147483647 - 1) || x < static_cast<A>(-2147483647 - 1) || !m_finite(x)) return static_cast<A>(-100.0);
    return x;
}

template <typename A> __device__ __forceinline__ A compute_coordinates(A coord, int size, int pad, bool align) {
    if (pad == PAD_BORDER) {
        coord = clip_coordinates(coord, size);
    } else if (pad == PAD_REFLECTION) {
        coord = align ? reflect_coordinates(coord, 0, 2 * (size - 1)) : reflect_coordinates(coord, -1, 2 * size - 1);
        coord = clip_coordinates(coord, size);
    }
    return safe_downgrade_to_int_range(coord);
}

template <typename A> __device__ __forceinline__ A source_index(A coord, int size, int pad, bool align) {
    return compute_coordinates(unnormalize(coord, size, align), size, pad, align);
}

template <typename A> __device__ __forceinline__ A source_index_set_grad(A coord, int size, int pad, bool align, A* g) {
    A gclip, grefl;
    coord = unnormalize_set_grad(coord, size, align, g);
    if (pad == PAD_BORDER) {
        coord = clip_coordinates_set_grad(coord, size, &gclip);
        *g = (*g) * gclip;
    } else if (pad == PAD_REFLECTION) {
        coord = align ? reflect_coordinates_set_grad(coord, 0, 2 * (size - 1), &grefl)
                      : reflect_coordinates_set_grad(coord, -1, 2 * size - 1, &grefl);
        coord = clip_coordinates_set_grad(coord, size, &gclip);
        *g = (*g) * grefl * gclip;
    }
    return safe_downgrade_to_int_range(coord);
}

// Bicubic convolution with A = -0.75 (ATen's UpSample.cuh); the gradient is ATen's (d coeff / d t, negated).
template <typename A> __device__ __forceinline__ A cubic_convolution1(A x, A a) { return ((a + 2) * x - (a + 3)) * x * x + 1; }
template <typename A> __device__ __forceinline__ A cubic_convolution2(A x, A a) { return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a; }

template <typename A> __device__ __forceinline__ void cubic_coefficients(A c[4], A t) {
    const A a = static_cast<A>(-0.75);
    const A x1 = t;
    c[0] = cubic_convolution2<A>(x1 + static_cast<A>(1), a);
    c[1] = cubic_convolution1<A>(x1, a);
    const A x2 = static_cast<A>(1) - t;
    c[2] = cubic_convolution1<A>(x2, a);
    c[3] = cubic_convolution2<A>(x2 + static_cast<A>(1), a);
}

template <typename A> __device__ __forceinline__ void cubic_coefficients_grad(A c[4], A t) {
    const A a = static_cast<A>(-0.75);
    A x;
    x = -1 - t;
    c[0] = (-3 * a * x - 10 * a) * x - 8 * a;
    x = -t;
    c[1] = (-3 * (a + 2) * x - 2 * (a + 3)) * x;
    x = 1 - t;
    c[2] = (3 * (a + 2) * x - 2 * (a + 3)) * x;
    x = 2 - t;
    c[3] = (3 * a * x - 10 * a) * x + 8 * a;
}

template <typename A> __device__ __forceinline__ A cubic_interp1d(A x0, A x1, A x2, A x3, A t) {
    A c[4];
    cubic_coefficients<A>(c, t);
    return x0 * c[0] + x1 * c[1] + x2 * c[2] + x3 * c[3];
}

// A bicubic tap index after padding (computed per tap, as ATen's get_value_bounded does); -1 if outside.
template <typename A> __device__ __forceinline__ int cubic_tap(A base, int i, int size, int pad, bool align) {
    const A c = compute_coordinates(base - 1 + i, size, pad, align);
    const int ic = static_cast<int>(c);
    return (ic >= 0 && ic < size) ? ic : -1;
}

// ---------------------------------------------------------------------------------------------------
// Vector loads / stores / atomics over VEC consecutive channels (the vector forms need the caller's
// guarantee of alignment, given by the F_*_VEC flags; the tail of C takes the scalar path).
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void unpack2(unsigned int u, float& a, float& b, const half_t*) {
    half_t lo, hi;
    lo.v = (unsigned short)(u & 0xffffu);
    hi.v = (unsigned short)(u >> 16);
    a = to_acc(lo);
    b = to_acc(hi);
}
__device__ __forceinline__ void unpack2(unsigned int u, float& a, float& b, const bf16_t*) {
    a = __uint_as_float(u << 16);
    b = __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ void load_vec4(const float* p, float v[4]) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
__device__ __forceinline__ void load_vec4(const double* p, double v[4]) {
    const double2 a = reinterpret_cast<const double2*>(p)[0], b = reinterpret_cast<const double2*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
template <typename H> __device__ __forceinline__ void load_vec4(const H* p, float v[4]) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    unpack2(q.x, v[0], v[1], p);
    unpack2(q.y, v[2], v[3], p);
}

// v[k] = p[k * stride] for k < nc, 0 beyond.
template <typename T, typename A> __device__ __forceinline__ void load_ch(const T* p, long long stride, int nc, bool vec, A v[VEC]) {
    if (vec && nc == VEC) {
        load_vec4(p, v);
        return;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = k < nc ? static_cast<A>(to_acc(p[k * stride])) : static_cast<A>(0);
}

__device__ __forceinline__ void store_vec4(float* p, const float v[4]) { *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]); }
__device__ __forceinline__ void store_vec4(double* p, const double v[4]) {
    reinterpret_cast<double2*>(p)[0] = make_double2(v[0], v[1]);
    reinterpret_cast<double2*>(p)[1] = make_double2(v[2], v[3]);
}
template <typename H> __device__ __forceinline__ void store_vec4(H* p, const float v[4]) {
    uint2 q;
    q.x = (unsigned int)from_acc<H>(v[0]).v | ((unsigned int)from_acc<H>(v[1]).v << 16);
    q.y = (unsigned int)from_acc<H>(v[2]).v | ((unsigned int)from_acc<H>(v[3]).v << 16);
    *reinterpret_cast<uint2*>(p) = q;
}

template <typename T, typename A> __device__ __forceinline__ void store_ch(T* p, long long stride, int nc, bool vec, const A v[VEC]) {
    if (vec && nc == VEC) {
        store_vec4(p, v);
        return;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        if (k < nc) p[k * stride] = from_acc<T>(v[k]);
}

__device__ __forceinline__ void red_add(float* p, float v) { asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) ); }
__device__ __forceinline__ void red_add(double* p, double v) { asm volatile("red.global.add.f64 [%0], %1;" :: "l"(p), "d"(v) ); }

// p[k] += v[k] for k < nc (channels-last accumulator: consecutive channels are consecutive in memory).
__device__ __forceinline__ void red_add_ch(float* p, int nc, bool vec, const float v[VEC]) {
#if __CUDA_ARCH__ >= 900
    if (vec && nc == VEC) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]));
        return;
    }
#endif
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        if (k < nc) red_add(p + k, v[k]);
}
__device__ __forceinline__ void red_add_ch(double* p, int nc, bool, const double v[VEC]) {
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        if (k < nc) red_add(p + k, v[k]);
}

__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ double shfl_xor(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }

__device__ __forceinline__ int min_nc(long long C, long long c0) { return (int)((C - c0) < VEC ? (C - c0) : VEC); }

template <int ND, int MODE> struct Taps { static constexpr int K = MODE == MODE_NEAREST ? 1 : MODE == MODE_BICUBIC ? 16 : (1 << ND); };

// ---------------------------------------------------------------------------------------------------
// Forward: one thread per (point, group of VEC channels). F_POINT_FAST: points vary fastest across threads
// (channels-first output: coalesced stores); else channel groups do (channels-last).
// ---------------------------------------------------------------------------------------------------
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_forward(const T* __restrict__ inp, const T* __restrict__ grid,
                                                  T* __restrict__ out, const Geo g) {
    const long long P = g.OD * g.OH * g.OW, C = g.C;
    const long long G = (C + VEC - 1) / VEC;
    const long long total = g.N * P * G;
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW, pad = (int)g.pad;
    const bool align = g.align != 0, point_fast = (g.flags & F_POINT_FAST) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, out_vec = (g.flags & F_GO_VEC) != 0;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        long long n, p, cg;
        if (point_fast) { p = t % P; const long long r = t / P; cg = r % G; n = r / G; }
        else { cg = t % G; const long long np = t / G; n = np / P; p = np - n * P; }
        const long long ow = p % g.OW, r2 = p / g.OW, oh = r2 % g.OH, od = r2 / g.OH;
        const T* gp = grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW;
        const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
        const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);
        const long long c0 = cg * VEC;
        const int nc = min_nc(C, c0);
        const T* in_c = inp + n * g.in_sN + c0 * g.in_sC;
        T* out_p = out + n * g.go_sN + c0 * g.go_sC + od * g.go_sD + oh * g.go_sH + ow * g.go_sW;
        A acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = static_cast<A>(0);

        if constexpr (MODE == MODE_BILINEAR) {
            const A ix = source_index(x, IW, pad, align), iy = source_index(y, IH, pad, align);
            const A iz = ND == 3 ? source_index(z, ID, pad, align) : static_cast<A>(0);
            const int x0 = static_cast<int>(m_floor(ix)), y0 = static_cast<int>(m_floor(iy)), z0 = static_cast<int>(m_floor(iz));
            const A wx[2] = {static_cast<A>(x0 + 1) - ix, ix - static_cast<A>(x0)};
            const A wy[2] = {static_cast<A>(y0 + 1) - iy, iy - static_cast<A>(y0)};
            const A wz[2] = {static_cast<A>(z0 + 1) - iz, iz - static_cast<A>(z0)};
#pragma unroll
            for (int k = 0; k < (1 << ND); ++k) {
                const int dx = k & 1, dy = (k >> 1) & 1, dz = k >> 2;
                const int xx = x0 + dx, yy = y0 + dy, zz = z0 + dz;
                if (xx < 0 || xx >= IW || yy < 0 || yy >= IH || zz < 0 || zz >= ID) continue;
                const A w = ND == 3 ? wx[dx] * wy[dy] * wz[dz] : wx[dx] * wy[dy];
                A v[VEC];
                load_ch(in_c + zz * g.in_sD + yy * g.in_sH + xx * g.in_sW, g.in_sC, nc, in_vec, v);
#pragma unroll
                for (int c = 0; c < VEC; ++c) acc[c] += v[c] * w;
            }
        } else if constexpr (MODE == MODE_NEAREST) {
            const A ix = source_index(x, IW, pad, align), iy = source_index(y, IH, pad, align);
            const A iz = ND == 3 ? source_index(z, ID, pad, align) : static_cast<A>(0);
            const int xn = static_cast<int>(m_rint(ix)), yn = static_cast<int>(m_rint(iy)), zn = static_cast<int>(m_rint(iz));
            if (xn >= 0 && xn < IW && yn >= 0 && yn < IH && zn >= 0 && zn < ID)
                load_ch(in_c + zn * g.in_sD + yn * g.in_sH + xn * g.in_sW, g.in_sC, nc, in_vec, acc);
        } else {  // bicubic, 2-D
            const A ix = unnormalize(x, IW, align), iy = unnormalize(y, IH, align);
            const A fx = m_floor(ix), fy = m_floor(iy);
            const A tx = ix - fx, ty = iy - fy;
            int rx[4], ry[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) { rx[i] = cubic_tap(fx, i, IW, pad, align); ry[i] = cubic_tap(fy, i, IH, pad, align); }
            A rows[4][VEC];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                A v[4][VEC];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (rx[i] >= 0 && ry[j] >= 0) {
                        load_ch(in_c + ry[j] * g.in_sH + rx[i] * g.in_sW, g.in_sC, nc, in_vec, v[i]);
                    } else {
#pragma unroll
                        for (int c = 0; c < VEC; ++c) v[i][c] = static_cast<A>(0);
                    }
                }
#pragma unroll
                for (int c = 0; c < VEC; ++c) rows[j][c] = cubic_interp1d<A>(v[0][c], v[1][c], v[2][c], v[3][c], tx);
            }
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[c] = cubic_interp1d<A>(rows[0][c], rows[1][c], rows[2][c], rows[3][c], ty);
        }
        store_ch(out_p, g.go_sC, nc, out_vec, acc);
    }
}

// ---------------------------------------------------------------------------------------------------
// Fast backward. L = 2^lanes_log2 lanes share one output point; lane l takes channels [l*VEC, l*VEC+VEC),
// then + L*VEC. gi: channels-last (N, D, H, W, C) accumulator in A, zeroed by the caller (F_GI).
// gg: contiguous (N, OD, OH, OW, ND) grad_grid (F_GG). inp (for grad_grid) and go: any strides.
// ---------------------------------------------------------------------------------------------------
// Blocks of 256 per SM the fast backward is compiled for: as many as fit without spilling (sm_90, ptxas -v);
// -DGS_BWD_MIN_BLOCKS=n overrides (tuning).
#ifdef GS_BWD_MIN_BLOCKS
#define GS_BWD_BLOCKS(A, ND, MODE) GS_BWD_MIN_BLOCKS
#else
#define GS_BWD_BLOCKS(A, ND, MODE) \
    (sizeof(A) == 8 || (MODE) == MODE_BICUBIC ? 1 : (MODE) == MODE_NEAREST ? 4 : (ND) == 2 ? 3 : 2)
#endif
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256, GS_BWD_BLOCKS(A, ND, MODE)) gs_backward(const T* __restrict__ go, const T* __restrict__ inp,
                                                   const T* __restrict__ grid, A* __restrict__ gi,
                                                   T* __restrict__ gg, const Geo g) {
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, C = g.C;
    const long long total = NP << lg;
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW, pad = (int)g.pad;
    const bool align = g.align != 0;
    const bool do_gi = (g.flags & F_GI) != 0, do_gg = (g.flags & F_GG) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    const long long S = (long long)ID * IH * IW;
    // Whole warps iterate together so the shuffles below always see all 32 lanes.
    for (long long base = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); base < total;
         base += (long long)gridDim.x * blockDim.x) {
        const long long t = base + (threadIdx.x & 31);
        const long long np = t >> lg;
        const int l = (int)(t & (L - 1));
        const bool active = np < NP;
        A gsum[ND], mult[ND];
#pragma unroll
        for (int a = 0; a < ND; ++a) { gsum[a] = static_cast<A>(0); mult[a] = static_cast<A>(0); }
        if (active) {
            const long long n = np / P, p = np - n * P;
            const long long ow = p % g.OW, r2 = p / g.OW, oh = r2 % g.OH, od = r2 / g.OH;
            const T* gp = grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW;
            const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
            const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);
            const T* go_p = go + n * g.go_sN + od * g.go_sD + oh * g.go_sH + ow * g.go_sW;
            const T* in_n = inp + n * g.in_sN;
            A* gi_n = gi + n * S * C;

            if constexpr (MODE == MODE_BILINEAR) {
                const A ix = source_index_set_grad(x, IW, pad, align, &mult[0]);
                const A iy = source_index_set_grad(y, IH, pad, align, &mult[1]);
                A iz = static_cast<A>(0), mz;
                if constexpr (ND == 3) { iz = source_index_set_grad(z, ID, pad, align, &mz); mult[ND - 1] = mz; }
                const int x0 = static_cast<int>(m_floor(ix)), y0 = static_cast<int>(m_floor(iy)), z0 = static_cast<int>(m_floor(iz));
                const A wx[2] = {static_cast<A>(x0 + 1) - ix, ix - static_cast<A>(x0)};
                const A wy[2] = {static_cast<A>(y0 + 1) - iy, iy - static_cast<A>(y0)};
                const A wz[2] = {static_cast<A>(z0 + 1) - iz, iz - static_cast<A>(z0)};
                constexpr int K = 1 << ND;
                // Corner k = dz * 4 + dy * 2 + dx (ATen's nw, ne, sw, se; t* then b* in 3-D).
                unsigned int okmask = 0;
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    const int xx = x0 + (k & 1), yy = y0 + ((k >> 1) & 1), zz = z0 + (k >> 2);
                    if (xx >= 0 && xx < IW && yy >= 0 && yy < IH && zz >= 0 && zz < ID) okmask |= 1u << k;
                }
                const long long in_base = z0 * g.in_sD + y0 * g.in_sH + x0 * g.in_sW;
                const long long gi_base = ((long long)(z0 * (long long)IH + y0) * IW + x0) * C;
#pragma unroll 1
                for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
                    const int nc = min_nc(C, c0);
                    A gv[VEC];
                    load_ch(go_p + c0 * g.go_sC, g.go_sC, nc, go_vec, gv);
                    if (do_gg) {  // every corner's loads first, so they are in flight together
                        A v[K][VEC];
#pragma unroll
                        for (int k = 0; k < K; ++k) {
                            if (okmask & (1u << k)) {
                                const long long off = in_base + (k >> 2) * g.in_sD + ((k >> 1) & 1) * g.in_sH + (k & 1) * g.in_sW;
                                load_ch(in_n + off + c0 * g.in_sC, g.in_sC, nc, in_vec, v[k]);
                            } else {
#pragma unroll
                                for (int c = 0; c < VEC; ++c) v[k][c] = static_cast<A>(0);
                            }
                        }
#pragma unroll
                        for (int k = 0; k < K; ++k) {
                            if (!(okmask & (1u << k))) continue;
                            const int dx = k & 1, dy = (k >> 1) & 1, dz = k >> 2;
                            A dot = static_cast<A>(0);
#pragma unroll
                            for (int c = 0; c < VEC; ++c) dot += v[k][c] * gv[c];
                            const A sx = dx ? dot : -dot, sy = dy ? dot : -dot;
                            if constexpr (ND == 3) {
                                const A sz = dz ? dot : -dot;
                                gsum[0] += sx * (wy[dy] * wz[dz]);
                                gsum[1] += sy * (wx[dx] * wz[dz]);
                                gsum[ND - 1] += sz * (wx[dx] * wy[dy]);
                            } else {
                                gsum[0] += sx * wy[dy];
                                gsum[1] += sy * wx[dx];
                            }
                        }
                    }
                    if (do_gi) {
#pragma unroll
                        for (int k = 0; k < K; ++k) {
                            if (!(okmask & (1u << k))) continue;
                            const int dx = k & 1, dy = (k >> 1) & 1, dz = k >> 2;
                            const A w = ND == 3 ? wx[dx] * wy[dy] * wz[dz] : wx[dx] * wy[dy];
                            A d[VEC];
#pragma unroll
                            for (int c = 0; c < VEC; ++c) d[c] = w * gv[c];
                            const long long off = gi_base + ((long long)(dz * (long long)IH + dy) * IW + dx) * C;
                            red_add_ch(gi_n + off + c0, nc, gi_vec, d);
                        }
                    }
                }
            } else if constexpr (MODE == MODE_NEAREST) {
                A m;
                const A ix = source_index_set_grad(x, IW, pad, align, &m);
                const A iy = source_index_set_grad(y, IH, pad, align, &m);
                const A iz = ND == 3 ? source_index_set_grad(z, ID, pad, align, &m) : static_cast<A>(0);
                const int xn = static_cast<int>(m_rint(ix)), yn = static_cast<int>(m_rint(iy)), zn = static_cast<int>(m_rint(iz));
                if (do_gi && xn >= 0 && xn < IW && yn >= 0 && yn < IH && zn >= 0 && zn < ID) {
                    A* dst = gi_n + ((long long)(zn * (long long)IH + yn) * IW + xn) * C;
    #pragma unroll 1
                for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
                        const int nc = min_nc(C, c0);
                        A gv[VEC];
                        load_ch(go_p + c0 * g.go_sC, g.go_sC, nc, go_vec, gv);
                        red_add_ch(dst + c0, nc, gi_vec, gv);
                    }
                }
            } else {  // bicubic, 2-D
                const A ix = unnormalize_set_grad(x, IW, align, &mult[0]);
                const A iy = unnormalize_set_grad(y, IH, align, &mult[1]);
                const A fx = m_floor(ix), fy = m_floor(iy);
                const A tx = ix - fx, ty = iy - fy;
                A xc[4], yc[4], xg[4], yg[4];
                cubic_coefficients<A>(xc, tx);
                cubic_coefficients<A>(yc, ty);
                cubic_coefficients_grad<A>(xg, tx);
                cubic_coefficients_grad<A>(yg, ty);
                int rx[4], ry[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) { rx[i] = cubic_tap(fx, i, IW, pad, align); ry[i] = cubic_tap(fy, i, IH, pad, align); }
#pragma unroll 1
                for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
                    const int nc = min_nc(C, c0);
                    A gv[VEC];
                    load_ch(go_p + c0 * g.go_sC, g.go_sC, nc, go_vec, gv);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const bool ok = rx[i] >= 0 && ry[j] >= 0;
                            if (do_gi && ok) {
                                const A wij = xc[i] * yc[j];
                                A d[VEC];
#pragma unroll
                                for (int c = 0; c < VEC; ++c) d[c] = gv[c] * wij;
                                red_add_ch(gi_n + ((long long)ry[j] * IW + rx[i]) * C + c0, nc, gi_vec, d);
                            }
                            if (do_gg) {  // ATen adds val = 0 for taps outside too: 0 * NaN coefficients is NaN
                                A v[VEC];
                                if (ok) {
                                    load_ch(in_n + ry[j] * g.in_sH + rx[i] * g.in_sW + c0 * g.in_sC, g.in_sC, nc, in_vec, v);
                                } else {
#pragma unroll
                                    for (int c = 0; c < VEC; ++c) v[c] = static_cast<A>(0);
                                }
                                A dot = static_cast<A>(0);
#pragma unroll
                                for (int c = 0; c < VEC; ++c) dot += v[c] * gv[c];
                                gsum[0] -= xg[i] * yc[j] * dot;
                                gsum[1] -= yg[j] * xc[i] * dot;
                            }
                        }
                    }
                }
            }
        }
        if (do_gg) {  // uniform across the grid: every lane of the warp reaches the shuffles
#pragma unroll
            for (int a = 0; a < ND; ++a)
                for (int m = L >> 1; m > 0; m >>= 1) gsum[a] += shfl_xor(gsum[a], m);
            if (active && l == 0) {
#pragma unroll
                for (int a = 0; a < ND; ++a)
                    gg[np * ND + a] = from_acc<T>(MODE == MODE_NEAREST ? static_cast<A>(0) : mult[a] * gsum[a]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Deterministic backward for grad_input.
// ---------------------------------------------------------------------------------------------------

// Bilinear / nearest: the padded source index (backward semantics). Bicubic: the unnormalised one.
template <typename A, int ND, int MODE>
__device__ __forceinline__ void point_coords(A x, A y, A z, const Geo& g, A c[ND]) {
    const int pad = (int)g.pad;
    const bool align = g.align != 0;
    A m;
    if constexpr (MODE == MODE_BICUBIC) {
        c[0] = unnormalize(x, (int)g.IW, align);
        c[1] = unnormalize(y, (int)g.IH, align);
    } else {
        c[0] = source_index_set_grad(x, (int)g.IW, pad, align, &m);
        c[1] = source_index_set_grad(y, (int)g.IH, pad, align, &m);
        if constexpr (ND == 3) c[ND - 1] = source_index_set_grad(z, (int)g.ID, pad, align, &m);
    }
}

// Destination pixel (within the batch item) of tap `k` of a point, or -1.
template <typename A, int ND, int MODE>
__device__ __forceinline__ long long tap_dest(const A c[ND], int k, const Geo& g) {
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW;
    int xx, yy, zz = 0;
    if constexpr (MODE == MODE_BILINEAR) {
        xx = static_cast<int>(m_floor(c[0])) + (k & 1);
        yy = static_cast<int>(m_floor(c[1])) + ((k >> 1) & 1);
        if constexpr (ND == 3) zz = static_cast<int>(m_floor(c[ND - 1])) + (k >> 2);
    } else if constexpr (MODE == MODE_NEAREST) {
        xx = static_cast<int>(m_rint(c[0]));
        yy = static_cast<int>(m_rint(c[1]));
        if constexpr (ND == 3) zz = static_cast<int>(m_rint(c[ND - 1]));
    } else {
        xx = cubic_tap(m_floor(c[0]), k & 3, IW, (int)g.pad, g.align != 0);
        yy = cubic_tap(m_floor(c[1]), k >> 2, IH, (int)g.pad, g.align != 0);
    }
    if (xx < 0 || xx >= IW || yy < 0 || yy >= IH || zz < 0 || zz >= ID) return -1;
    return ((long long)zz * IH + yy) * IW + xx;
}

// The weight of tap `k` (what multiplies grad_output in ATen's grad_input update).
template <typename A, int ND, int MODE>
__device__ __forceinline__ A tap_weight(const A c[ND], int k) {
    if constexpr (MODE == MODE_BILINEAR) {
        const int x0 = static_cast<int>(m_floor(c[0])), y0 = static_cast<int>(m_floor(c[1]));
        const A wx = (k & 1) ? c[0] - static_cast<A>(x0) : static_cast<A>(x0 + 1) - c[0];
        const A wy = ((k >> 1) & 1) ? c[1] - static_cast<A>(y0) : static_cast<A>(y0 + 1) - c[1];
        if constexpr (ND == 3) {
            const int z0 = static_cast<int>(m_floor(c[ND - 1]));
            const A wz = (k >> 2) ? c[ND - 1] - static_cast<A>(z0) : static_cast<A>(z0 + 1) - c[ND - 1];
            return wx * wy * wz;
        }
        return wx * wy;
    } else if constexpr (MODE == MODE_NEAREST) {
        return static_cast<A>(1);
    } else {
        A xc[4], yc[4];
        cubic_coefficients<A>(xc, c[0] - m_floor(c[0]));
        cubic_coefficients<A>(yc, c[1] - m_floor(c[1]));
        return xc[k & 3] * yc[k >> 2];
    }
}

// Point p of batch item n: its coordinates (point_coords), also stored to out[0 .. ND).
template <typename T, typename A, int ND, int MODE>
__device__ __forceinline__ void store_point_coords(const T* grid, long long n, long long p, const Geo& g, A c[ND], A* out) {
    const long long ow = p % g.OW, r2 = p / g.OW, oh = r2 % g.OH, od = r2 / g.OH;
    const T* gp = grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW;
    const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
    const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);
    point_coords<A, ND, MODE>(x, y, z, g, c);
#pragma unroll
    for (int a = 0; a < ND; ++a) out[a] = c[a];
}

// One thread per point: its coordinates, and one key per tap (KEY_NONE when the tap falls outside).
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_keys(const T* __restrict__ grid, long long* __restrict__ keys,
                                               A* __restrict__ coords, const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, S = g.ID * g.IH * g.IW, PT = P * K;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        const long long n = np / P, p = np - n * P;
        A c[ND];
        store_point_coords<T, A, ND, MODE>(grid, n, p, g, c, coords + np * ND);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const long long d = tap_dest<A, ND, MODE>(c, k, g);
            keys[np * K + k] = d < 0 ? KEY_NONE : (n * S + d) * PT + p * K + k;
        }
    }
}

// After the sort: bounds[2d], bounds[2d + 1] = the range of entries whose destination is pixel d
// (zero-filled by the caller, so untouched pixels get an empty range).
__global__ void __launch_bounds__(256) gs_bounds(const long long* __restrict__ keys, long long* __restrict__ bounds,
                                                 long long E, long long PT) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < E; i += (long long)gridDim.x * blockDim.x) {
        const long long k = keys[i];
        if (k == KEY_NONE) continue;
        const long long d = k / PT;
        if (i == 0 || keys[i - 1] / PT != d) bounds[2 * d] = i;
        if (i == E - 1 || keys[i + 1] == KEY_NONE || keys[i + 1] / PT != d) bounds[2 * d + 1] = i + 1;
    }
}

// A gather entry (point * K + tap, the point within the batch item starting at point n0): the tap's weight,
// and the point's grad_output values for channels c0 .. c0 + nc in gv.
template <typename T, typename A, int ND, int MODE>
__device__ __forceinline__ A entry_contribution(long long local, long long n0, const A* __restrict__ coords,
                                                const T* __restrict__ go, long long C, long long c0, int nc, bool go_vec,
                                                A gv[VEC]) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long p = local / K, np = n0 + p;
    A cc[ND];
#pragma unroll
    for (int a = 0; a < ND; ++a) cc[a] = coords[np * ND + a];
    load_ch(go + np * C + c0, 1, nc, go_vec, gv);
    return tap_weight<A, ND, MODE>(cc, (int)(local - p * K));
}

// L lanes per destination pixel, VEC channels per lane: sum its entries in key order, write once.
// go: channels-last contiguous (N, OD, OH, OW, C); gi: channels-last contiguous (N, D, H, W, C), type T.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_gather(const long long* __restrict__ keys, const long long* __restrict__ bounds,
                                                 const A* __restrict__ coords, const T* __restrict__ go,
                                                 T* __restrict__ gi, const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const long long P = g.OD * g.OH * g.OW, S = g.ID * g.IH * g.IW, C = g.C, PT = P * K;
    const long long total = (g.N * S) << lg;
    const bool go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        const long long q = t >> lg;
        const int l = (int)(t & (L - 1));
        const long long n = q / S;
        const long long start = bounds[2 * q], end = bounds[2 * q + 1];
        const long long qbase = q * PT;
        for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
            const int nc = min_nc(C, c0);
            A acc[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[c] = static_cast<A>(0);
            for (long long e = start; e < end; ++e) {
                A gv[VEC];
                const A w = entry_contribution<T, A, ND, MODE>(keys[e] - qbase, n * P, coords, go, C, c0, nc, go_vec, gv);
#pragma unroll
                for (int c = 0; c < VEC; ++c) acc[c] += w * gv[c];
            }
            store_ch(gi + q * C + c0, 1, nc, gi_vec, acc);
        }
    }
}

// max over a block of its threads' m, folded into *out (double bits) with one atomic, skipped when *out is
// already larger (thousands of blocks on one word would serialise).
__device__ __forceinline__ void block_max_to(double m, unsigned long long* out) {
    __shared__ double warp_max[32];
    for (int s = 16; s > 0; s >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, s));
    const int tid = threadIdx.x + threadIdx.y * blockDim.x, warps = (blockDim.x * blockDim.y) >> 5;
    if ((tid & 31) == 0) warp_max[tid >> 5] = m;
    __syncthreads();
    if (tid < 32) {
        m = tid < warps ? warp_max[tid] : 0.0;
        for (int s = 16; s > 0; s >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, s));
        if (tid == 0 && m > 0.0 && m > __longlong_as_double((long long)*(volatile unsigned long long*)out))
            atomicMax(out, (unsigned long long)__double_as_longlong(m));
    }
}

__device__ __forceinline__ double finite_abs(double v) {
    v = fabs(v);
    return v <= 1.7976931348623157e308 ? v : 0.0;  // NaN and inf count as 0
}

// Deterministic backward, counting form (16- and 32-bit inputs; TUNING det_keys = "count"): gs_count
// counts each destination pixel's contributions (and stores the points' coordinates), a scan turns the
// counts into segment offsets, gs_place writes each (point, tap) into its destination's segment (in
// whatever order the atomics give), and gs_gather_exact sums each segment exactly in int64 fixed point,
// so that order does not matter: no sort. The scale, 2^e with e = 59 - ceil(log2(count)) - k and
// max |grad_output| < 2^k (gs_absmax, or the transpose that makes grad_output channels-last), keeps every
// sum below 2^61 (a contribution is |grad_output| times weights summing to at most 4, bicubic's included)
// and rounds each contribution to a multiple of 2^-e: at most 2^-(57 - ceil(log2(count))) * max.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_count(const T* __restrict__ grid, A* __restrict__ coords,
                                                unsigned long long* __restrict__ counts, const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, S = g.ID * g.IH * g.IW;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        const long long n = np / P, p = np - n * P;
        A c[ND];
        store_point_coords<T, A, ND, MODE>(grid, n, p, g, c, coords + np * ND);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const long long d = tap_dest<A, ND, MODE>(c, k, g);
            if (d >= 0) atomicAdd(counts + n * S + d, 1ULL);
        }
    }
}

// After the scan (offsets[q + 1] = counts[0] + ... + counts[q], offsets[0] = 0): entries[slot] = p * K + k.
// counts count down to 0 on the way (they are not needed afterwards).
template <typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_place(const A* __restrict__ coords, const long long* __restrict__ offsets,
                                                unsigned long long* __restrict__ counts, long long* __restrict__ entries,
                                                const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, S = g.ID * g.IH * g.IW;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        const long long n = np / P, p = np - n * P;
        A c[ND];
#pragma unroll
        for (int a = 0; a < ND; ++a) c[a] = coords[np * ND + a];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const long long d = tap_dest<A, ND, MODE>(c, k, g);
            if (d < 0) continue;
            const long long q = n * S + d;
            const unsigned long long left = atomicAdd(counts + q, ~0ULL);  // -1: slots fill from the end
            entries[offsets[q] + (long long)left - 1] = p * K + k;
        }
    }
}

// max |grad_output| over its finite values, as double bits in *out (non-negative doubles order as u64).
template <typename T>
__global__ void __launch_bounds__(256) gs_absmax(const T* __restrict__ go, long long n, unsigned long long* __restrict__ out) {
    double m = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        m = fmax(m, finite_abs(static_cast<double>(to_acc(go[i]))));
    block_max_to(m, out);
}

// L lanes per destination pixel, VEC channels per lane: the segment's contributions (w * grad_output in A)
// rounded to multiples of 2^-e and summed exactly in int64 (one conversion and one add each); NaN / inf contributions tracked apart (NaN, or +inf
// with -inf, gives NaN; otherwise the infinity), as an IEEE sum in any order would.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_gather_exact(const long long* __restrict__ entries,
                                                       const long long* __restrict__ offsets,
                                                       const A* __restrict__ coords, const T* __restrict__ go,
                                                       T* __restrict__ gi, const Geo g,
                                                       const unsigned long long* __restrict__ go_max) {
    constexpr int K = Taps<ND, MODE>::K;
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const long long P = g.OD * g.OH * g.OW, S = g.ID * g.IH * g.IW, C = g.C;
    const long long total = (g.N * S) << lg;
    const bool go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    const double mx = __longlong_as_double((long long)*go_max);
    int kmax = 0;
    if (mx > 0.0) frexp(mx, &kmax);
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        const long long q = t >> lg;
        const int l = (int)(t & (L - 1));
        const long long n = q / S;
        const long long start = offsets[q], end = offsets[q + 1];
        const int count_log2 = end - start > 1 ? 64 - __clzll((unsigned long long)(end - start - 1)) : 0;
        const int e = 59 - count_log2 - kmax;
        const double scale = ldexp(1.0, e), unscale = ldexp(1.0, -e);
        for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
            const int nc = min_nc(C, c0);
            long long acc[VEC];
            unsigned int special[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) { acc[c] = 0; special[c] = 0u; }
            for (long long i = start; i < end; ++i) {
                A gv[VEC];
                const A w = entry_contribution<T, A, ND, MODE>(entries[i], n * P, coords, go, C, c0, nc, go_vec, gv);
#pragma unroll
                for (int c = 0; c < VEC; ++c) {
                    const double v = static_cast<double>(w * gv[c]);
                    const double x = v * scale;  // exact: the scale is a power of two
                    if (fabs(x) < 2305843009213693952.0) acc[c] += __double2ll_rn(x);  // 2^61: finite, in range
                    else special[c] |= v != v ? 1u : v > 0 ? 2u : 4u;
                }
            }
            A out[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) {
                const unsigned int f = special[c];
                const double nan = __longlong_as_double(0x7ff8000000000000LL), inf = __longlong_as_double(0x7ff0000000000000LL);
                const double v = f == 0 ? static_cast<double>(acc[c]) * unscale
                               : ((f & 1u) || (f & 6u) == 6u) ? nan : (f & 2u) ? inf : -inf;
                out[c] = static_cast<A>(v);
            }
            store_ch(gi + q * C + c0, 1, nc, gi_vec, out);
        }
    }
}

// Deterministic backward with one key per point (bilinear and nearest, whose taps are never remapped):
// the key is the point's cell, i.e. the pixel of its lowest corner + 1 per axis (so -1 is a cell too) for
// bilinear, the rounded pixel + 1 for nearest: key = (n * cells + cell) * P + point. A destination pixel
// then sums the points of the (up to 8) cells it is a corner of, cell by cell in corner order, each cell's
// points in index order. 4x (8x in 3-D) fewer keys to sort than one per tap.
template <int ND> __device__ __forceinline__ long long cell_count(const Geo& g) {
    return (ND == 3 ? g.ID + 1 : 1LL) * (g.IH + 1) * (g.IW + 1);
}

template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_cell_keys(const T* __restrict__ grid, long long* __restrict__ keys,
                                                    A* __restrict__ coords, const Geo g) {
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, NCELL = cell_count<ND>(g);
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        const long long n = np / P, p = np - n * P;
        A c[ND];
        store_point_coords<T, A, ND, MODE>(grid, n, p, g, c, coords + np * ND);
        int cx, cy, cz = 0;
        bool ok;
        if constexpr (MODE == MODE_BILINEAR) {
            const int x0 = static_cast<int>(m_floor(c[0])), y0 = static_cast<int>(m_floor(c[1]));
            const int z0 = ND == 3 ? static_cast<int>(m_floor(c[ND - 1])) : 0;
            ok = x0 >= -1 && x0 < IW && y0 >= -1 && y0 < IH && (ND == 2 || (z0 >= -1 && z0 < ID));
            cx = x0 + 1; cy = y0 + 1;
            if constexpr (ND == 3) cz = z0 + 1;
        } else {  // nearest
            const int xn = static_cast<int>(m_rint(c[0])), yn = static_cast<int>(m_rint(c[1]));
            const int zn = ND == 3 ? static_cast<int>(m_rint(c[ND - 1])) : 0;
            ok = xn >= 0 && xn < IW && yn >= 0 && yn < IH && zn >= 0 && zn < ID;
            cx = xn + 1; cy = yn + 1;
            if constexpr (ND == 3) cz = zn + 1;
        }
        keys[np] = ok ? (n * NCELL + ((long long)cz * (IH + 1) + cy) * (IW + 1) + cx) * P + p : KEY_NONE;
    }
}

// L lanes per destination pixel, VEC channels per lane. bounds: per (n, cell), from gs_bounds with PT = P.
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_cell_gather(const long long* __restrict__ keys, const long long* __restrict__ bounds,
                                                      const A* __restrict__ coords, const T* __restrict__ go,
                                                      T* __restrict__ gi, const Geo g) {
    constexpr int K = MODE == MODE_NEAREST ? 1 : (1 << ND);
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const int IH = (int)g.IH, IW = (int)g.IW;
    const long long P = g.OD * g.OH * g.OW, S = g.ID * g.IH * g.IW, C = g.C, NCELL = cell_count<ND>(g);
    const long long total = (g.N * S) << lg;
    const bool go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        const long long q = t >> lg;
        const int l = (int)(t & (L - 1));
        const long long n = q / S, s = q - n * S;
        const int x = (int)(s % IW);
        const long long r = s / IW;
        const int y = (int)(r % IH), z = (int)(r / IH);
        for (long long c0 = (long long)l * VEC; c0 < C; c0 += (long long)L * VEC) {
            const int nc = min_nc(C, c0);
            A acc[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[c] = static_cast<A>(0);
#pragma unroll
            for (int k = 0; k < K; ++k) {  // this pixel is corner k of the points in cell (x - dx, y - dy, z - dz)
                const int dx = k & 1, dy = (k >> 1) & 1, dz = k >> 2;
                const long long cell = ((long long)(ND == 3 ? z - dz + 1 : 0) * (IH + 1) + (y - dy + 1)) * (IW + 1) + (x - dx + 1);
                const long long cg = n * NCELL + cell;
                const long long start = bounds[2 * cg], end = bounds[2 * cg + 1], base = cg * P;
                for (long long e = start; e < end; ++e) {
                    const long long np = n * P + (keys[e] - base);
                    A cc[ND];
#pragma unroll
                    for (int a = 0; a < ND; ++a) cc[a] = coords[np * ND + a];
                    const A w = tap_weight<A, ND, MODE>(cc, k);
                    A gv[VEC];
                    load_ch(go + np * C + c0, 1, nc, go_vec, gv);
#pragma unroll
                    for (int c = 0; c < VEC; ++c) acc[c] += w * gv[c];
                }
            }
            store_ch(gi + q * C + c0, 1, nc, gi_vec, acc);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Transposes (32 x 32 tiles through shared memory), converting the element type on the way.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ long long spatial_offset(long long s, const Tr& t) {
    if (t.packed) return s;
    const long long hw = t.H * t.W;
    return (s / hw) * t.sD + ((s / t.W) % t.H) * t.sH + (s % t.W) * t.sW;
}

template <typename D, typename S_> __device__ __forceinline__ D convert(S_ v) { return from_acc<D>(to_acc(v)); }

// strided (N, C, spatial) -> channels-last contiguous; amax (or null): max |finite value| folded in.
template <typename S_, typename D>
__global__ void __launch_bounds__(256) gs_to_cl(const S_* __restrict__ src, D* __restrict__ dst, const Tr t,
                                                unsigned long long* __restrict__ amax) {
    __shared__ D tile[32][33];
    double m = 0.0;
    const long long ctiles = (t.C + 31) / 32;
    const long long s0 = blockIdx.x * 32LL;
    for (long long n = blockIdx.z; n < t.N; n += gridDim.z) {
        for (long long ct = blockIdx.y; ct < ctiles; ct += gridDim.y) {
            const long long c0 = ct * 32;
#pragma unroll
            for (int k = 0; k < 32; k += 8) {
                const long long c = c0 + threadIdx.y + k, s = s0 + threadIdx.x;
                if (c < t.C && s < t.S) {
                    const D v = convert<D>(src[n * t.sN + c * t.sC + spatial_offset(s, t)]);
                    tile[threadIdx.y + k][threadIdx.x] = v;
                    if (amax) m = fmax(m, finite_abs(static_cast<double>(to_acc(v))));
                }
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 32; k += 8) {
                const long long s = s0 + threadIdx.y + k, c = c0 + threadIdx.x;
                if (c < t.C && s < t.S) dst[(n * t.S + s) * t.C + c] = tile[threadIdx.x][threadIdx.y + k];
            }
            __syncthreads();
        }
    }
    if (amax) block_max_to(m, amax);  // uniform per block: every thread gets here
}

// channels-last contiguous -> strided (N, C, spatial)
template <typename S_, typename D>
__global__ void __launch_bounds__(256) gs_from_cl(const S_* __restrict__ src, D* __restrict__ dst, const Tr t) {
    __shared__ D tile[32][33];
    const long long ctiles = (t.C + 31) / 32;
    const long long s0 = blockIdx.x * 32LL;
    for (long long n = blockIdx.z; n < t.N; n += gridDim.z) {
        for (long long ct = blockIdx.y; ct < ctiles; ct += gridDim.y) {
            const long long c0 = ct * 32;
#pragma unroll
            for (int k = 0; k < 32; k += 8) {
                const long long s = s0 + threadIdx.y + k, c = c0 + threadIdx.x;
                if (c < t.C && s < t.S) tile[threadIdx.y + k][threadIdx.x] = convert<D>(src[(n * t.S + s) * t.C + c]);
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 32; k += 8) {
                const long long c = c0 + threadIdx.y + k, s = s0 + threadIdx.x;
                if (c < t.C && s < t.S) dst[n * t.sN + c * t.sC + spatial_offset(s, t)] = tile[threadIdx.x][threadIdx.y + k];
            }
            __syncthreads();
        }
    }
}
