// grid_sample forward and backward with torch.nn.functional.grid_sample's semantics (ATen's
// GridSampler.cuh / GridSampler.cu): bilinear, nearest and bicubic (2-D only) interpolation, zeros /
// border / reflection padding, align_corners, 2-D (N, C, H, W) and 3-D (N, C, D, H, W) inputs.
//
// T: io type, A: math / accumulation type (float for half, bfloat16 and float; double for double).
// ND: 2 or 3 spatial dims. MODE: 0 bilinear, 1 nearest, 2 bicubic (torch's GridSamplerInterpolation).
// Header-free (no cuda_fp16.h / cuda_bf16.h / climits) so NVRTC needs no CUDA toolkit include path.
//
// Kernels:
//   gs_forward   L lanes per output point, each computing the taps once and looping over channel groups.
//   gs_backward  the fast backward: L lanes per output point, VEC contiguous channels per lane. grad_input
//                is scattered with atomics into a channels-last accumulator in A (vector red.v4.f32 on
//                sm_90); grad_grid is reduced over channels in registers + warp shuffles (no atomics).
//   gs_keys / gs_bounds / gs_gather   the deterministic backward for grad_input: one int64 key per
//                (point, tap) = destination pixel * (P * taps) + point * taps + tap, sorted (unique keys,
//                so any sort gives the same order), then one lane group per destination pixel sums its
//                contributions in key order and writes once.
//   gs_absmax / gs_count / gs_scan_* / gs_place / gs_gather_exact   the deterministic backward for 16- and 32-bit
//                inputs: a counting sort by destination pixel (no order within a pixel), then exact sums in
//                int64 fixed point, which do not depend on the order.
//   gs_to_cl / gs_from_cl   tiled transposes between any-strided (N, C, spatial) and channels-last.
//
// Every backward kernel reads a point's taps (which fall inside, their pixels and input offsets, weights and
// grad_grid coefficients) through one helper, PointTaps (point_coords / grid_point build its coordinates).
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
// a / b, and a % b in r: in 32 bits where both fit (a 64-bit division costs the GPU ~10x as many
// instructions, and a thread decodes its index with several: the forward measured 1.6x torch's time).
__device__ __forceinline__ long long div_rem(long long a, long long b, long long& r) {
    if ((((unsigned long long)a | (unsigned long long)b) >> 32) == 0) {
        const unsigned int q = (unsigned int)a / (unsigned int)b;
        r = (long long)((unsigned int)a - q * (unsigned int)b);
        return q;
    }
    const long long q = a / b;
    r = a - q * b;
    return q;
}

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
// One point's taps, the single per-tap helper of the three backward algorithms (fast, tile, deterministic).
// ---------------------------------------------------------------------------------------------------
// A point's source coordinates from its grid values: bilinear / nearest the padded source index, bicubic the
// unnormalised one (its padding applies per tap); mult[a] = d coordinate / d grid value (ATen's gInp
// multipliers; 0 for nearest, whose grad_grid is 0).
template <typename A, int ND, int MODE>
__device__ __forceinline__ void point_coords(A x, A y, A z, const Geo& g, A c[ND], A mult[ND]) {
    const int pad = (int)g.pad;
    const bool align = g.align != 0;
    if constexpr (MODE == MODE_BICUBIC) {
        c[0] = unnormalize_set_grad(x, (int)g.IW, align, &mult[0]);
        c[1] = unnormalize_set_grad(y, (int)g.IH, align, &mult[1]);
    } else {
        c[0] = source_index_set_grad(x, (int)g.IW, pad, align, &mult[0]);
        c[1] = source_index_set_grad(y, (int)g.IH, pad, align, &mult[1]);
        if constexpr (ND == 3) c[ND - 1] = source_index_set_grad(z, (int)g.ID, pad, align, &mult[ND - 1]);
        if constexpr (MODE == MODE_NEAREST) {
#pragma unroll
            for (int a = 0; a < ND; ++a) mult[a] = static_cast<A>(0);
        }
    }
}

// Output point p's (od, oh, ow) within its batch item. I: p's type (the tile kernels' int points decode in
// 32 bits with no range check).
template <typename I> __device__ __forceinline__ void point_at(I p, const Geo& g, I& od, I& oh, I& ow) {
    if constexpr (sizeof(I) == 4) {
        const int OW = (int)g.OW, OH = (int)g.OH, r = p / OW;
        ow = p % OW; oh = r % OH; od = r / OH;
    } else {
        od = div_rem(div_rem(p, g.OW, ow), g.OH, oh);
    }
}

// A point's coordinates (point_coords) from its grid values at gp, the coordinate gr_sK apart.
template <typename T, typename A, int ND, int MODE>
__device__ __forceinline__ void grid_coords(const T* __restrict__ gp, const Geo& g, A c[ND], A mult[ND]) {
    const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
    const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);
    point_coords<A, ND, MODE>(x, y, z, g, c, mult);
}

// Point p of batch item n: its coordinates from its grid values, read through the grid's strides.
template <typename T, typename A, int ND, int MODE, typename I>
__device__ __forceinline__ void grid_point(const T* __restrict__ grid, long long n, I p, const Geo& g, A c[ND],
                                           A mult[ND]) {
    I od, oh, ow;
    point_at(p, g, od, oh, ow);
    grid_coords<T, A, ND, MODE>(grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW, g, c, mult);
}

// A point's taps from its coordinates: ok(k) when tap k falls inside (any(): some tap does); its pixel dst(k)
// within the batch item (dense planes) and its offset src(k, g) through the input's strides; its weight w(k),
// what multiplies grad_output in ATen's grad_input update; and the grad_grid coefficients: grad_grid[a] =
// mult[a] * the sum over taps in_gg(k) and channels of cg(a, k) * input value * grad_output (ATen's sums,
// regrouped). Built from the stored coordinates too (the deterministic gathers): every algorithm sees the
// same taps.
template <typename A, int ND, int MODE> struct PointTaps;

// a[i] by selects: a tap index known only at run time (the deterministic gathers) would otherwise index the
// arrays dynamically and put the whole PointTaps in local memory.
template <typename V, int N> __device__ __forceinline__ V pick(const V (&a)[N], int i) {
    V v = a[0];
#pragma unroll
    for (int j = 1; j < N; ++j) v = i == j ? a[j] : v;
    return v;
}

template <typename A, int ND> struct PointTaps<A, ND, MODE_BILINEAR> {
    static constexpr int K = Taps<ND, MODE_BILINEAR>::K;  // corner k = dz * 4 + dy * 2 + dx (ATen's nw, ne, sw, se)
    int x0, y0, z0, IH, IW;  // the lowest corner
    unsigned int okmask;
    A wx[2], wy[2], wz[2];  // per axis, the weights of the lower and the upper corner
    __device__ __forceinline__ PointTaps(const A c[ND], const Geo& g) : IH((int)g.IH), IW((int)g.IW) {
        const A iz = ND == 3 ? c[ND - 1] : static_cast<A>(0);
        x0 = static_cast<int>(m_floor(c[0])); y0 = static_cast<int>(m_floor(c[1])); z0 = static_cast<int>(m_floor(iz));
        wx[0] = static_cast<A>(x0 + 1) - c[0]; wx[1] = c[0] - static_cast<A>(x0);
        wy[0] = static_cast<A>(y0 + 1) - c[1]; wy[1] = c[1] - static_cast<A>(y0);
        wz[0] = static_cast<A>(z0 + 1) - iz; wz[1] = iz - static_cast<A>(z0);
        const int ID = (int)g.ID;
        okmask = 0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int xx = x0 + (k & 1), yy = y0 + ((k >> 1) & 1), zz = z0 + (k >> 2);
            if (xx >= 0 && xx < IW && yy >= 0 && yy < IH && zz >= 0 && zz < ID) okmask |= 1u << k;
        }
    }
    __device__ __forceinline__ bool any() const { return okmask != 0u; }
    __device__ __forceinline__ bool ok(int k) const { return (okmask >> k) & 1u; }
    __device__ __forceinline__ bool in_gg(int k) const { return ok(k); }
    template <typename I = long long> __device__ __forceinline__ I dst(int k) const {
        return ((I)(z0 + (k >> 2)) * IH + y0 + ((k >> 1) & 1)) * IW + x0 + (k & 1);
    }
    __device__ __forceinline__ long long src(int k, const Geo& g) const {  // the lowest corner's + a constant
        return (z0 * g.in_sD + y0 * g.in_sH + x0 * g.in_sW) +
               ((k >> 2) * g.in_sD + ((k >> 1) & 1) * g.in_sH + (k & 1) * g.in_sW);
    }
    __device__ __forceinline__ A w(int k) const {
        const A v = pick(wx, k & 1) * pick(wy, (k >> 1) & 1);
        return ND == 3 ? v * pick(wz, k >> 2) : v;
    }
    __device__ __forceinline__ A cg(int a, int k) const {  // d w(k) / d (ix, iy, iz)
        const A x = pick(wx, k & 1), y = pick(wy, (k >> 1) & 1), z = pick(wz, k >> 2);
        const A v = a == 0 ? (ND == 3 ? y * z : y) : a == 1 ? (ND == 3 ? x * z : x) : x * y;
        return (a == 0 ? k & 1 : a == 1 ? (k >> 1) & 1 : k >> 2) ? v : -v;
    }
};

template <typename A, int ND> struct PointTaps<A, ND, MODE_NEAREST> {
    static constexpr int K = 1;
    int x0, y0, z0, IH, IW;  // the nearest pixel
    bool inside;
    __device__ __forceinline__ PointTaps(const A c[ND], const Geo& g) : IH((int)g.IH), IW((int)g.IW) {
        x0 = static_cast<int>(m_rint(c[0]));
        y0 = static_cast<int>(m_rint(c[1]));
        z0 = ND == 3 ? static_cast<int>(m_rint(c[ND - 1])) : 0;
        inside = x0 >= 0 && x0 < IW && y0 >= 0 && y0 < IH && z0 >= 0 && z0 < (int)g.ID;
    }
    __device__ __forceinline__ bool any() const { return inside; }
    __device__ __forceinline__ bool ok(int) const { return inside; }
    __device__ __forceinline__ bool in_gg(int) const { return false; }  // nearest: grad_grid is 0
    template <typename I = long long> __device__ __forceinline__ I dst(int) const { return ((I)z0 * IH + y0) * IW + x0; }
    __device__ __forceinline__ long long src(int, const Geo& g) const { return z0 * g.in_sD + y0 * g.in_sH + x0 * g.in_sW; }
    __device__ __forceinline__ A w(int) const { return static_cast<A>(1); }
    __device__ __forceinline__ A cg(int, int) const { return static_cast<A>(0); }
};

template <typename A> struct PointTaps<A, 2, MODE_BICUBIC> {
    static constexpr int K = 16;  // k = 4 * row + column
    int rx[4], ry[4], IW;
    A xc[4], yc[4], xg[4], yg[4];
    __device__ __forceinline__ PointTaps(const A c[2], const Geo& g) : IW((int)g.IW) {
        const int pad = (int)g.pad, IH = (int)g.IH;
        const bool align = g.align != 0;
        const A fx = m_floor(c[0]), fy = m_floor(c[1]);
        cubic_coefficients<A>(xc, c[0] - fx);
        cubic_coefficients<A>(yc, c[1] - fy);
        cubic_coefficients_grad<A>(xg, c[0] - fx);
        cubic_coefficients_grad<A>(yg, c[1] - fy);
#pragma unroll
        for (int i = 0; i < 4; ++i) { rx[i] = cubic_tap(fx, i, IW, pad, align); ry[i] = cubic_tap(fy, i, IH, pad, align); }
    }
    __device__ __forceinline__ bool any() const {
        return (rx[0] >= 0 || rx[1] >= 0 || rx[2] >= 0 || rx[3] >= 0) && (ry[0] >= 0 || ry[1] >= 0 || ry[2] >= 0 || ry[3] >= 0);
    }
    __device__ __forceinline__ bool ok(int k) const { return pick(rx, k & 3) >= 0 && pick(ry, k >> 2) >= 0; }
    // ATen adds value 0 for taps outside too: 0 * a NaN coefficient is NaN.
    __device__ __forceinline__ bool in_gg(int) const { return true; }
    template <typename I = long long> __device__ __forceinline__ I dst(int k) const {
        return (I)pick(ry, k >> 2) * IW + pick(rx, k & 3);
    }
    __device__ __forceinline__ long long src(int k, const Geo& g) const {
        return pick(ry, k >> 2) * g.in_sH + pick(rx, k & 3) * g.in_sW;
    }
    __device__ __forceinline__ A w(int k) const { return pick(xc, k & 3) * pick(yc, k >> 2); }
    __device__ __forceinline__ A cg(int a, int k) const {
        return a == 0 ? -(pick(xg, k & 3) * pick(yc, k >> 2)) : -(pick(yg, k >> 2) * pick(xc, k & 3));
    }
};

// ---------------------------------------------------------------------------------------------------
// Forward: L = 2^lanes_log2 lanes per output point (at most one per group of VEC channels); lane l computes
// the point's taps and weights once, then takes channel groups l, l + L, ... (ATen's kernel is L = 1: one
// thread loops over every channel). F_POINT_FAST: points vary fastest across threads (channels-first
// output: coalesced stores); else lanes do (channels-last: a warp reads consecutive channel groups).
// A channels-first lane taking one channel at a time instead of 4 measured 1.3-4.6x slower (H100).
// ---------------------------------------------------------------------------------------------------
// Blocks of 256 per SM the forward is compiled for. Left alone, f32 bilinear took 96 registers (2 blocks);
// capped for 3 (2-D bilinear) or 2 it ran 1.3-2x faster on channels-last inputs and on smooth grids, 1.1-1.3x
// slower on uniformly random channels-first ones (more warps evict each other's lines, we suppose), H100:
// tools/results/2026-11-25-h100-probe_grid_sample_forward_min_blocks.json. -DGS_FWD_MIN_BLOCKS=n overrides.
#ifdef GS_FWD_MIN_BLOCKS
#define GS_FWD_BLOCKS(A, ND, MODE) GS_FWD_MIN_BLOCKS
#else
#define GS_FWD_BLOCKS(A, ND, MODE) \
    ((MODE) == MODE_BICUBIC || sizeof(A) == 8 ? 1 : (ND) == 2 && (MODE) == MODE_BILINEAR ? 3 : 2)
#endif
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256, GS_FWD_BLOCKS(A, ND, MODE)) gs_forward(const T* __restrict__ inp, const T* __restrict__ grid,
                                                  T* __restrict__ out, const Geo g) {
    const long long P = g.OD * g.OH * g.OW, C = g.C;
    const long long G = (C + VEC - 1) / VEC;
    const long long L = (1LL << g.lanes_log2) < G ? (1LL << g.lanes_log2) : G;
    const long long total = g.N * P * L;
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW, pad = (int)g.pad;
    const bool align = g.align != 0, point_fast = (g.flags & F_POINT_FAST) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, out_vec = (g.flags & F_GO_VEC) != 0;
    constexpr int K = Taps<ND, MODE>::K;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        long long n, p, lane;
        if (point_fast) n = div_rem(div_rem(t, P, p), L, lane);
        else n = div_rem(div_rem(t, L, lane), P, p);
        long long ow, oh;
        const long long od = div_rem(div_rem(p, g.OW, ow), g.OH, oh);
        const T* gp = grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW;
        const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
        const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);

        // Each tap once: its offset within a channel plane (-1 where it falls outside) and its weight.
        long long off[K];
        A w[K];
        A tx = static_cast<A>(0), ty = static_cast<A>(0);
        if constexpr (MODE == MODE_BILINEAR) {
            const A ix = source_index(x, IW, pad, align), iy = source_index(y, IH, pad, align);
            const A iz = ND == 3 ? source_index(z, ID, pad, align) : static_cast<A>(0);
            const int x0 = static_cast<int>(m_floor(ix)), y0 = static_cast<int>(m_floor(iy)), z0 = static_cast<int>(m_floor(iz));
            const A wx[2] = {static_cast<A>(x0 + 1) - ix, ix - static_cast<A>(x0)};
            const A wy[2] = {static_cast<A>(y0 + 1) - iy, iy - static_cast<A>(y0)};
            const A wz[2] = {static_cast<A>(z0 + 1) - iz, iz - static_cast<A>(z0)};
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int dx = k & 1, dy = (k >> 1) & 1, dz = k >> 2;
                const int xx = x0 + dx, yy = y0 + dy, zz = z0 + dz;
                const bool inside = xx >= 0 && xx < IW && yy >= 0 && yy < IH && zz >= 0 && zz < ID;
                off[k] = inside ? zz * g.in_sD + yy * g.in_sH + xx * g.in_sW : -1;
                w[k] = ND == 3 ? wx[dx] * wy[dy] * wz[dz] : wx[dx] * wy[dy];
            }
        } else if constexpr (MODE == MODE_NEAREST) {
            const A ix = source_index(x, IW, pad, align), iy = source_index(y, IH, pad, align);
            const A iz = ND == 3 ? source_index(z, ID, pad, align) : static_cast<A>(0);
            const int xn = static_cast<int>(m_rint(ix)), yn = static_cast<int>(m_rint(iy)), zn = static_cast<int>(m_rint(iz));
            const bool inside = xn >= 0 && xn < IW && yn >= 0 && yn < IH && zn >= 0 && zn < ID;
            off[0] = inside ? zn * g.in_sD + yn * g.in_sH + xn * g.in_sW : -1;
            w[0] = static_cast<A>(1);  // unused
        } else {  // bicubic, 2-D: rows of 4 taps interpolated along x, then the 4 rows along y
            const A ix = unnormalize(x, IW, align), iy = unnormalize(y, IH, align);
            const A fx = m_floor(ix), fy = m_floor(iy);
            tx = ix - fx;
            ty = iy - fy;
            int rx[4], ry[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) { rx[i] = cubic_tap(fx, i, IW, pad, align); ry[i] = cubic_tap(fy, i, IH, pad, align); }
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int i = k & 3, j = k >> 2;
                off[k] = rx[i] >= 0 && ry[j] >= 0 ? ry[j] * g.in_sH + rx[i] * g.in_sW : -1;
                w[k] = static_cast<A>(1);  // unused: the cubic coefficients come from tx and ty
            }
        }

        const T* in_n = inp + n * g.in_sN;
        T* out_n = out + n * g.go_sN + od * g.go_sD + oh * g.go_sH + ow * g.go_sW;
        for (long long cg = lane; cg < G; cg += L) {
            const long long c0 = cg * VEC;
            const int nc = min_nc(C, c0);
            const T* in_c = in_n + c0 * g.in_sC;
            A acc[VEC];
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[c] = static_cast<A>(0);
            if constexpr (MODE == MODE_BICUBIC) {
                A rows[4][VEC];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    A v[4][VEC];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        if (off[4 * j + i] >= 0) {
                            load_ch(in_c + off[4 * j + i], g.in_sC, nc, in_vec, v[i]);
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
            } else if constexpr (MODE == MODE_NEAREST) {
                if (off[0] >= 0) load_ch(in_c + off[0], g.in_sC, nc, in_vec, acc);  // the value itself: -0.0 stays
            } else {
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (off[k] < 0) continue;
                    A v[VEC];
                    load_ch(in_c + off[k], g.in_sC, nc, in_vec, v);
#pragma unroll
                    for (int c = 0; c < VEC; ++c) acc[c] += v[c] * w[k];
                }
            }
            store_ch(out_n + c0 * g.go_sC, g.go_sC, nc, out_vec, acc);
        }
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
    constexpr int K = PointTaps<A, ND, MODE>::K;
    constexpr int KB = K <= 8 ? K : 4;  // taps whose input loads are in flight together (bicubic: a row)
    const int lg = (int)g.lanes_log2, L = 1 << lg;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, C = g.C;
    const long long total = NP << lg;
    const bool do_gi = (g.flags & F_GI) != 0, do_gg = (g.flags & F_GG) != 0;
    const bool in_vec = (g.flags & F_IN_VEC) != 0, go_vec = (g.flags & F_GO_VEC) != 0, gi_vec = (g.flags & F_GI_VEC) != 0;
    const long long S = g.ID * g.IH * g.IW;
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
            long long p;
            const long long n = div_rem(np, P, p);
            long long od, oh, ow;
            point_at(p, g, od, oh, ow);
            A c[ND];
            grid_coords<T, A, ND, MODE>(grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW, g, c, mult);
            const PointTaps<A, ND, MODE> tp(c, g);
            const T* go_p = go + n * g.go_sN + od * g.go_sD + oh * g.go_sH + ow * g.go_sW;
            const T* in_n = inp + n * g.in_sN;
            A* gi_n = gi + n * S * C;
            // Channels to visit: for grad_input where a tap falls inside; for grad_grid (nearest's is 0) too, or
            // always for bicubic, whose outside taps count (0 * NaN).
            const bool work = (do_gi && tp.any()) || (MODE != MODE_NEAREST && do_gg && (tp.any() || MODE == MODE_BICUBIC));
            const long long c_end = work ? C : 0;
#pragma unroll 1
            for (long long c0 = (long long)l * VEC; c0 < c_end; c0 += (long long)L * VEC) {
                const int nc = min_nc(C, c0);
                A gv[VEC];
                load_ch(go_p + c0 * g.go_sC, g.go_sC, nc, go_vec, gv);
                if (MODE != MODE_NEAREST && do_gg) {  // nearest: grad_grid is 0 (mult is 0), no input read
#pragma unroll
                    for (int k0 = 0; k0 < K; k0 += KB) {
                        A v[KB][VEC];
#pragma unroll
                        for (int b = 0; b < KB; ++b) {
                            if (tp.ok(k0 + b)) {
                                load_ch(in_n + tp.src(k0 + b, g) + c0 * g.in_sC, g.in_sC, nc, in_vec, v[b]);
                            } else {
#pragma unroll
                                for (int c = 0; c < VEC; ++c) v[b][c] = static_cast<A>(0);
                            }
                        }
#pragma unroll
                        for (int b = 0; b < KB; ++b) {
                            if (!tp.in_gg(k0 + b)) continue;
                            A dot = static_cast<A>(0);
#pragma unroll
                            for (int c = 0; c < VEC; ++c) dot += v[b][c] * gv[c];
#pragma unroll
                            for (int a = 0; a < ND; ++a) gsum[a] += tp.cg(a, k0 + b) * dot;
                        }
                    }
                }
                if (do_gi) {
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        if (!tp.ok(k)) continue;
                        const A w = tp.w(k);
                        A d[VEC];
#pragma unroll
                        for (int c = 0; c < VEC; ++c) d[c] = w * gv[c];
                        red_add_ch(gi_n + tp.dst(k) * C + c0, nc, gi_vec, d);
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
                for (int a = 0; a < ND; ++a) gg[np * ND + a] = from_acc<T>(mult[a] * gsum[a]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Fast backward through shared memory ("tile"): 16- and 32-bit inputs whose channel planes are dense, float
// accumulation, no atomics on grad_input, no zeroed scratch, no transposes. Two kernels:
//   gs_tile_sort    block (g, n): a counting sort in shared memory of the (point, tap) contributions of batch
//                   item n that land in pixel range g (pixels [g * R, g * R + R)): entries (point, weight)
//                   grouped by destination pixel in region n * G + g of `entries` (K * P slots, room for every
//                   tap), and ends[n * S + d] = the end of pixel d's segment in that region (its start is the
//                   previous pixel's end, 0 at the range's first pixel). Sorted once, read by every channel slice.
//   gs_tile_gather  block (slice, n): copies the slice's V = 16 / sizeof(T) channels of grad_output (and of the
//                   input, for grad_grid) to shared memory pixel-major, one 16-byte chunk per point or pixel;
//                   then each thread sums pixels' segments (per entry: one chunk load, V FMAs) and writes their
//                   grad_input once, and takes points for grad_grid (one chunk per tap). grad_grid goes out
//                   directly (one slice) or as float partials that gs_gg_sum adds in slice order.
// The order of entries within a segment follows shared-memory atomics (fast), or, for the deterministic
// backward, is sorted by (point, weight) in the sort kernel: then every sum has one order, bit-identical run to run.
// ---------------------------------------------------------------------------------------------------

// Threads per block (TILE_THREADS in grid_sample.py): bicubic's 16 taps need more than 64 registers.
#define GS_TILE_THREADS(MODE) ((MODE) == MODE_BICUBIC ? 512 : 1024)

// Word d of a shared array at word_at(d): its low 5 bits XORed with a hash of the rest, a permutation within each
// 32 words, so points stepping down a column (or any regular stride) hit scattered banks instead of one.
__device__ __forceinline__ int word_at(int d) { return d ^ (int)(((unsigned int)(d >> 5) * 0x9E3779B1u) >> 27); }

// 16-byte chunk q at chunk_at(q): its low 3 bits (the position in a 128-byte bank row) XOR-folded with the higher
// bits, so chunks a power-of-two stride apart (a column of a 2^k-wide plane) spread over the row.
__device__ __forceinline__ int chunk_at(int q) { return (q & ~7) | ((q ^ (q >> 3) ^ (q >> 6) ^ (q >> 9)) & 7); }

template <typename T> struct Chunk { static constexpr int V = 16 / (int)sizeof(T); };  // values per chunk

__device__ __forceinline__ unsigned int word_of(const uint4& u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

__device__ __forceinline__ void chunk_values(const uint4& u, float f[4], const float*) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
template <typename H> __device__ __forceinline__ void chunk_values(const uint4& u, float f[8], const H* tag) {
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack2(word_of(u, i), f[2 * i], f[2 * i + 1], tag);
}

// Value j of each of V chunks (V channels' runs of V values), as one chunk: a V x V transpose in registers.
__device__ __forceinline__ uint4 chunk_transpose(const uint4 (&v)[4], int j) {
    return make_uint4(word_of(v[0], j), word_of(v[1], j), word_of(v[2], j), word_of(v[3], j));
}
__device__ __forceinline__ uint4 chunk_transpose(const uint4 (&v)[8], int j) {
    const unsigned int sel = (j & 1) ? 0x7632u : 0x5410u, w = (unsigned int)j >> 1;
    return make_uint4(__byte_perm(word_of(v[0], w), word_of(v[1], w), sel), __byte_perm(word_of(v[2], w), word_of(v[3], w), sel),
                      __byte_perm(word_of(v[4], w), word_of(v[5], w), sel), __byte_perm(word_of(v[6], w), word_of(v[7], w), sel));
}

// Channels [0, nc) of dense planes `sC` apart (16-byte aligned, `count` values each, a multiple of V) to chunks:
// chunk q = the V channels of value q, zeros past nc.
template <typename T>
__device__ __forceinline__ void tile_stage(const T* __restrict__ src, long long sC, int nc, int count, uint4* dst) {
    constexpr int V = Chunk<T>::V;
    for (int i = threadIdx.x; i < count / V; i += blockDim.x) {
        uint4 v[V];
#pragma unroll
        for (int c = 0; c < V; ++c) v[c] = c < nc ? __ldg(reinterpret_cast<const uint4*>(src + c * sC) + i) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int j = 0; j < V; ++j) dst[chunk_at(V * i + j)] = chunk_transpose(v, j);
    }
}

// Exclusive prefix sum of a[word_at(0 .. n)) in place (a block-wide call); returns the total.
__device__ int block_exclusive_scan(int* a, int n) {
    __shared__ int warp_sum[33];
    const int tid = threadIdx.x, per = (n + blockDim.x - 1) / blockDim.x, b0 = tid * per;
    int sum = 0;
    for (int i = 0; i < per; ++i) if (b0 + i < n) sum += a[word_at(b0 + i)];
    int incl = sum;
    for (int m = 1; m < 32; m <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, m);
        if ((tid & 31) >= m) incl += v;
    }
    if ((tid & 31) == 31) warp_sum[tid >> 5] = incl;
    __syncthreads();
    if (tid < 32) {
        const int t = tid < (int)(blockDim.x >> 5) ? warp_sum[tid] : 0;
        int ti = t;
        for (int m = 1; m < 32; m <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, ti, m);
            if (tid >= m) ti += v;
        }
        warp_sum[tid] = ti - t;
        if (tid == 31) warp_sum[32] = ti;
    }
    __syncthreads();
    int run = warp_sum[tid >> 5] + incl - sum;
    for (int i = 0; i < per; ++i)
        if (b0 + i < n) {
            const int v = a[word_at(b0 + i)];
            a[word_at(b0 + i)] = run;
            run += v;
        }
    const int total = warp_sum[32];
    __syncthreads();  // warp_sum is reused by the next call
    return total;
}

// f(point, pixel - d0, weight) for every tap of batch item n's points (this thread's share) landing in pixels
// [d0, d0 + nr).
template <typename T, int ND, int MODE, typename F>
__device__ __forceinline__ void range_taps(const T* __restrict__ grid, long long n, const Geo& g, int d0, int nr, F f) {
    constexpr int K = PointTaps<float, ND, MODE>::K;
    const int P = (int)(g.OD * g.OH * g.OW);
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        float c[ND], mult[ND];
        grid_point<T, float, ND, MODE>(grid, n, p, g, c, mult);
        const PointTaps<float, ND, MODE> tp(c, g);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!tp.ok(k)) continue;
            const int d = tp.template dst<int>(k) - d0;
            if ((unsigned int)d < (unsigned int)nr) f(p, d, tp.w(k));
        }
    }
}

// Entries in (point, weight bits) order: one order for a segment whatever order the atomics placed it in.
__device__ __forceinline__ unsigned long long entry_key(int2 e) {
    return ((unsigned long long)(unsigned int)e.x << 32) | (unsigned int)e.y;
}

__device__ __forceinline__ void sift_down(int2* e, int root, int n) {
    for (int c = 2 * root + 1; c < n; root = c, c = 2 * root + 1) {
        if (c + 1 < n && entry_key(e[c + 1]) > entry_key(e[c])) ++c;
        if (entry_key(e[root]) >= entry_key(e[c])) return;
        const int2 t = e[root];
        e[root] = e[c];
        e[c] = t;
    }
}

// Sort e[0 .. n) by entry_key: insertion sort for the usual few entries, heapsort (n log n) for the long
// segments of pixels many points clamp onto (border padding, degenerate grids).
__device__ void sort_segment(int2* e, int n) {
    if (n <= 16) {
        for (int i = 1; i < n; ++i) {
            const int2 v = e[i];
            const unsigned long long k = entry_key(v);
            int j = i - 1;
            for (; j >= 0 && entry_key(e[j]) > k; --j) e[j + 1] = e[j];
            e[j + 1] = v;
        }
        return;
    }
    for (int i = n / 2 - 1; i >= 0; --i) sift_down(e, i, n);
    for (int end = n - 1; end > 0; --end) {
        const int2 t = e[0];
        e[0] = e[end];
        e[end] = t;
        sift_down(e, 0, end);
    }
}

// Shared memory: roundup(R, 32) ints of counts / offsets, then `cap` staged entries (copied out with coalesced
// stores when the range's entries fit, else placed straight into global memory). ordered: sort each segment
// (the deterministic backward), so the gather sums it in one order.
template <typename T, int ND, int MODE>
__global__ void __launch_bounds__(GS_TILE_THREADS(MODE)) gs_tile_sort(const T* __restrict__ grid, int2* __restrict__ entries,
                                                                      int* __restrict__ ends, const Geo g, int R, int cap,
                                                                      int ordered) {
    constexpr int K = PointTaps<float, ND, MODE>::K;
    extern __shared__ __align__(16) unsigned char smem[];
    const int S = (int)(g.ID * g.IH * g.IW), P = (int)(g.OD * g.OH * g.OW), G = gridDim.x;
    const int d0 = blockIdx.x * R, nr = min(S - d0, R), rows = (nr + 31) & ~31;
    int* off = reinterpret_cast<int*>(smem);
    int2* staged = reinterpret_cast<int2*>(smem + (((R + 31) & ~31) * 4 + 15) / 16 * 16);
    for (long long n = blockIdx.y; n < g.N; n += gridDim.y) {
        for (int i = threadIdx.x; i < rows; i += blockDim.x) off[i] = 0;
        __syncthreads();
        range_taps<T, ND, MODE>(grid, n, g, d0, nr, [&](int, int d, float) { atomicAdd(off + word_at(d), 1); });
        __syncthreads();
        const int total = block_exclusive_scan(off, nr);
        const long long base = ((long long)n * G + blockIdx.x) * K * P;
        int2* out = total <= cap ? staged : entries + base;  // uniform per block
        range_taps<T, ND, MODE>(grid, n, g, d0, nr, [&](int p, int d, float w) {
            out[atomicAdd(off + word_at(d), 1)] = make_int2(p, __float_as_int(w));
        });
        __syncthreads();
        if (ordered) {
            for (int i = threadIdx.x; i < nr; i += blockDim.x) {
                const int start = i ? off[word_at(i - 1)] : 0;
                sort_segment(out + start, off[word_at(i)] - start);
            }
            __syncthreads();
        }
        if (total <= cap)
            for (int i = threadIdx.x; i < total; i += blockDim.x) entries[base + i] = staged[i];
        for (int i = threadIdx.x; i < nr; i += blockDim.x) ends[n * S + d0 + i] = off[word_at(i)];
        __syncthreads();  // the next batch item reuses off and staged
    }
}

// Entries per segment loaded together (their loads in flight at once).
#define GS_TILE_UNROLL 4

// Pixel d's grad_input over the slice's V channels: the sum of its segment's weight * grad_output chunk.
template <typename T, int V>
__device__ __forceinline__ void tile_pixel_sum(const int2* __restrict__ seg, int e0, int e1, const uint4* go_s, float acc[V]) {
#pragma unroll
    for (int c = 0; c < V; ++c) acc[c] = 0.0f;
    for (int e = e0; e < e1; e += GS_TILE_UNROLL) {
        int2 en[GS_TILE_UNROLL];
#pragma unroll
        for (int u = 0; u < GS_TILE_UNROLL; ++u) en[u] = e + u < e1 ? __ldg(seg + e + u) : make_int2(0, 0);
#pragma unroll
        for (int u = 0; u < GS_TILE_UNROLL; ++u) {
            if (e + u >= e1) break;
            const float w = __int_as_float(en[u].y);
            float f[V];
            chunk_values(go_s[chunk_at(en[u].x)], f, static_cast<const T*>(nullptr));
#pragma unroll
            for (int c = 0; c < V; ++c) acc[c] += w * f[c];
        }
    }
}

// Shared memory: P grad_output chunks, then (for grad_grid) S input chunks, each rounded up to 8 chunks. gi: grad_input (dense planes,
// strides gi_sN / gi_sC) or null; gg: grad_grid (one slice), ggp: its float partials (several), or both null.
template <typename T, int ND, int MODE>
__global__ void __launch_bounds__(GS_TILE_THREADS(MODE)) gs_tile_gather(
        const T* __restrict__ go, const T* __restrict__ inp, const T* __restrict__ grid, const int2* __restrict__ entries,
        const int* __restrict__ ends, T* __restrict__ gi, T* __restrict__ gg, float* __restrict__ ggp, const Geo g,
        long long gi_sN, long long gi_sC, int R) {
    constexpr int K = PointTaps<float, ND, MODE>::K, V = Chunk<T>::V;
    extern __shared__ uint4 chunks[];
    const int S = (int)(g.ID * g.IH * g.IW), P = (int)(g.OD * g.OH * g.OW), G = (S + R - 1) / R;
    const int slices = gridDim.x;
    const long long c0 = (long long)blockIdx.x * V;
    const int nc = (int)min((long long)V, g.C - c0);
    const bool do_gg = gg != nullptr || ggp != nullptr;
    uint4* go_s = chunks;
    uint4* in_s = chunks + ((P + 7) & ~7);  // chunk_at permutes within groups of 8
    for (long long n = blockIdx.y; n < g.N; n += gridDim.y) {
        tile_stage(go + n * g.go_sN + c0 * g.go_sC, g.go_sC, nc, P, go_s);
        if (do_gg) tile_stage(inp + n * g.in_sN + c0 * g.in_sC, g.in_sC, nc, S, in_s);
        __syncthreads();
        if (gi != nullptr) {
            const int* en = ends + n * S;
            T* out = gi + n * gi_sN + c0 * gi_sC;
            for (int d = threadIdx.x; d < S; d += blockDim.x) {
                const int r = d / R, first = d == r * R;
                float acc[V];
                tile_pixel_sum<T, V>(entries + ((long long)n * G + r) * K * P, first ? 0 : en[d - 1], en[d], go_s, acc);
#pragma unroll
                for (int c = 0; c < V; ++c)
                    if (c < nc) out[c * gi_sC + d] = from_acc<T>(acc[c]);
            }
        }
        if (do_gg) {
            for (int p = threadIdx.x; p < P; p += blockDim.x) {
                float c[ND], mult[ND];
                grid_point<T, float, ND, MODE>(grid, n, p, g, c, mult);
                const PointTaps<float, ND, MODE> tp(c, g);
                float gv[V], gsum[ND];
                chunk_values(go_s[chunk_at(p)], gv, static_cast<const T*>(nullptr));
#pragma unroll
                for (int a = 0; a < ND; ++a) gsum[a] = 0.0f;
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (!tp.in_gg(k)) continue;
                    float f[V];
                    // outside taps add 0 * grad_output, as ATen's do (0 * inf is NaN)
                    chunk_values(tp.ok(k) ? in_s[chunk_at(tp.template dst<int>(k))] : make_uint4(0u, 0u, 0u, 0u), f, static_cast<const T*>(nullptr));
                    float dot = 0.0f;
#pragma unroll
                    for (int c = 0; c < V; ++c) dot += f[c] * gv[c];
#pragma unroll
                    for (int a = 0; a < ND; ++a) gsum[a] += tp.cg(a, k) * dot;
                }
                const long long np = n * P + p;
#pragma unroll
                for (int a = 0; a < ND; ++a) {
                    if (slices == 1) gg[np * ND + a] = from_acc<T>(mult[a] * gsum[a]);
                    else ggp[((long long)blockIdx.x * g.N * P + np) * ND + a] = mult[a] * gsum[a];
                }
            }
        }
        __syncthreads();  // the next batch item restages
    }
}

// grad_grid = the sum of `slices` partials (each n elements), in slice order.
template <typename T>
__global__ void __launch_bounds__(256) gs_gg_sum(const float* __restrict__ ggp, T* __restrict__ gg, long long n, int slices) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = ggp[i];
        for (int k = 1; k < slices; ++k) s += ggp[k * n + i];
        gg[i] = from_acc<T>(s);
    }
}


// ---------------------------------------------------------------------------------------------------
// Deterministic backward for grad_input.
// ---------------------------------------------------------------------------------------------------

// Point p of batch item n: its taps, and its coordinates stored to out[0 .. ND) for the gathers.
template <typename T, typename A, int ND, int MODE>
__device__ __forceinline__ PointTaps<A, ND, MODE> stored_point(const T* __restrict__ grid, long long n, long long p,
                                                               const Geo& g, A* __restrict__ out) {
    A c[ND], mult[ND];
    grid_point<T, A, ND, MODE>(grid, n, p, g, c, mult);
#pragma unroll
    for (int a = 0; a < ND; ++a) out[a] = c[a];
    return PointTaps<A, ND, MODE>(c, g);
}

// The taps of point np (over the batch) from its stored coordinates.
template <typename A, int ND, int MODE>
__device__ __forceinline__ PointTaps<A, ND, MODE> stored_taps(const A* __restrict__ coords, long long np, const Geo& g) {
    A c[ND];
#pragma unroll
    for (int a = 0; a < ND; ++a) c[a] = coords[np * ND + a];
    return PointTaps<A, ND, MODE>(c, g);
}

// One thread per point: its coordinates, and one key per tap (KEY_NONE when the tap falls outside).
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_keys(const T* __restrict__ grid, long long* __restrict__ keys,
                                               A* __restrict__ coords, const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P, S = g.ID * g.IH * g.IW, PT = P * K;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        long long p;
        const long long n = div_rem(np, P, p);
        const PointTaps<A, ND, MODE> tp = stored_point<T, A, ND, MODE>(grid, n, p, g, coords + np * ND);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            keys[np * K + k] = tp.ok(k) ? (n * S + tp.dst(k)) * PT + p * K + k : KEY_NONE;
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

// Inclusive scan of n int64 (the counting sort's offsets): dst[i] = src[0] + ... + src[i]; exact, our own
// kernels so that a deterministic backward is one graph of our launches (CuPy's cumsum could not be
// recorded). In order: gs_scan_tiles (each block sums one tile of GS_SCAN_TILE), gs_scan_sums (one block:
// the tile sums become exclusive prefixes, in place), gs_scan_apply (each block scans its tile from its
// prefix).
#define GS_SCAN_THREADS 256
#define GS_SCAN_ITEMS 16
#define GS_SCAN_TILE (GS_SCAN_THREADS * GS_SCAN_ITEMS)

// Exclusive prefix of v over the block (blockDim.x a multiple of 32); *total: the block's sum.
__device__ __forceinline__ long long block_exclusive(long long v, long long* total) {
    __shared__ long long warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        long long s = lane < warps ? warp_sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const long long y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < warps) warp_sums[lane] = s;
    }
    __syncthreads();
    const long long before = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[warps - 1];
    __syncthreads();  // warp_sums is reused by the caller's next round
    return before + x - v;
}

__global__ void __launch_bounds__(GS_SCAN_THREADS) gs_scan_tiles(const long long* __restrict__ src,
                                                                 long long* __restrict__ sums, long long n) {
    const long long base = blockIdx.x * (long long)GS_SCAN_TILE;
    long long v = 0;
    for (int k = 0; k < GS_SCAN_ITEMS; ++k) {
        const long long i = base + k * GS_SCAN_THREADS + threadIdx.x;
        if (i < n) v += src[i];
    }
    long long total;
    block_exclusive(v, &total);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

__global__ void __launch_bounds__(1024) gs_scan_sums(long long* __restrict__ sums, long long tiles) {
    long long carry = 0;
    for (long long start = 0; start < tiles; start += blockDim.x) {
        const long long i = start + threadIdx.x;
        const long long v = i < tiles ? sums[i] : 0;
        long long total;
        const long long before = block_exclusive(v, &total);
        if (i < tiles) sums[i] = carry + before;
        carry += total;
    }
}

__global__ void __launch_bounds__(GS_SCAN_THREADS) gs_scan_apply(const long long* __restrict__ src,
                                                                 long long* __restrict__ dst,
                                                                 const long long* __restrict__ sums, long long n) {
    const long long first = blockIdx.x * (long long)GS_SCAN_TILE + threadIdx.x * (long long)GS_SCAN_ITEMS;
    long long v[GS_SCAN_ITEMS], local = 0;
    for (int k = 0; k < GS_SCAN_ITEMS; ++k) {
        v[k] = first + k < n ? src[first + k] : 0;
        local += v[k];
    }
    long long total;
    long long run = sums[blockIdx.x] + block_exclusive(local, &total);
    for (int k = 0; k < GS_SCAN_ITEMS; ++k) {
        run += v[k];
        if (first + k < n) dst[first + k] = run;
    }
}

// A gather entry (point * K + tap, the point within the batch item starting at point n0): the tap's weight,
// and the point's grad_output values for channels c0 .. c0 + nc in gv.
template <typename T, typename A, int ND, int MODE>
__device__ __forceinline__ A entry_contribution(long long local, long long n0, const A* __restrict__ coords,
                                                const T* __restrict__ go, const Geo& g, long long c0, int nc,
                                                bool go_vec, A gv[VEC]) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long p = local / K, np = n0 + p;
    load_ch(go + np * g.C + c0, 1, nc, go_vec, gv);
    return stored_taps<A, ND, MODE>(coords, np, g).w((int)(local - p * K));
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
                const A w = entry_contribution<T, A, ND, MODE>(keys[e] - qbase, n * P, coords, go, g, c0, nc, go_vec, gv);
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
        long long p;
        const long long n = div_rem(np, P, p);
        const PointTaps<A, ND, MODE> tp = stored_point<T, A, ND, MODE>(grid, n, p, g, coords + np * ND);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (tp.ok(k)) atomicAdd(counts + n * S + tp.dst(k), 1ULL);
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
        long long p;
        const long long n = div_rem(np, P, p);
        const PointTaps<A, ND, MODE> tp = stored_taps<A, ND, MODE>(coords, np, g);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!tp.ok(k)) continue;
            const long long q = n * S + tp.dst(k);
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
                const A w = entry_contribution<T, A, ND, MODE>(entries[i], n * P, coords, go, g, c0, nc, go_vec, gv);
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
        long long p;
        const long long n = div_rem(np, P, p);
        const PointTaps<A, ND, MODE> tp = stored_point<T, A, ND, MODE>(grid, n, p, g, coords + np * ND);
        // The cell: bilinear's lowest corner (which may lie one pixel before the input) or nearest's pixel, + 1.
        const int lo = MODE == MODE_BILINEAR ? -1 : 0;
        const bool ok = tp.x0 >= lo && tp.x0 < IW && tp.y0 >= lo && tp.y0 < IH && (ND == 2 || (tp.z0 >= lo && tp.z0 < ID));
        const int cx = tp.x0 + 1, cy = tp.y0 + 1, cz = ND == 3 ? tp.z0 + 1 : 0;
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
                    const A w = stored_taps<A, ND, MODE>(coords, np, g).w(k);
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
