// What every grid_sample kernel shares (torch.nn.functional.grid_sample's semantics, ATen's GridSampler.cuh /
// GridSampler.cu): the Geo struct and the enums grid_sample.py mirrors, ATen's coordinate math (unnormalise,
// border clipping, reflection, the *_set_grad forms the backward needs), the bicubic coefficients, vector
// loads / stores over VEC channels, and the one per-tap helper, PointTaps: a point's taps (which fall inside,
// their pixels and input offsets, weights and grad_grid coefficients), built from its grid values
// (grid_coords / grid_point) or from coordinates the deterministic backwards stored (stored_taps). Every kernel
// that visits a point's taps -- forward, fast backward, tile, both deterministic backwards -- goes through it.
//
// T: io type, A: math / accumulation type (float for half, bfloat16 and float; double for double).
// ND: 2 or 3 spatial dims. MODE: 0 bilinear, 1 nearest, 2 bicubic (torch's GridSamplerInterpolation).
// Header-free (no cuda_fp16.h / cuda_bf16.h / climits) so NVRTC needs no CUDA toolkit include path: compile.py
// pastes this file (and types.cuh) in place of the #include lines, so the kernel cache keys on their text.
// All element offsets are 64-bit; pixel coordinates are int, as in ATen (sizes are checked on the host).

#include "types.cuh"

// Shared with grid_sample.py.
enum { MODE_BILINEAR, MODE_NEAREST, MODE_BICUBIC };
enum { PAD_ZEROS, PAD_BORDER, PAD_REFLECTION };
enum { F_GI = 1, F_GG = 2, F_IN_VEC = 4, F_GO_VEC = 8, F_GI_VEC = 16, F_POINT_FAST = 32, F_PLANE_VEC = 64 };

#define VEC 4

// Geometry, all int64, in the field order of GEO_FIELDS in grid_sample.py. 2-D: ID = OD = 1, D strides 0.
// in_*: input strides; gr_*: grid strides (K: the coordinate); go_*: grad_output (forward: output) strides.
struct Geo {
    long long N, C, ID, IH, IW, OD, OH, OW;
    long long in_sN, in_sC, in_sD, in_sH, in_sW;
    long long gr_sN, gr_sD, gr_sH, gr_sW, gr_sK;
    long long go_sN, go_sC, go_sD, go_sH, go_sW;
    long long pad, align, lanes_log2, flags;
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

// ATen's cubic_interp1d with its coefficients (cubic_coefficients of the row's t) computed once per point.
template <typename A> __device__ __forceinline__ A cubic_interp1d(A x0, A x1, A x2, A x3, const A c[4]) {
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

__device__ __forceinline__ int min_nc(long long C, long long c0) { return (int)((C - c0) < VEC ? (C - c0) : VEC); }

template <int ND, int MODE> struct Taps { static constexpr int K = MODE == MODE_NEAREST ? 1 : MODE == MODE_BICUBIC ? 16 : (1 << ND); };

// ---------------------------------------------------------------------------------------------------
// One point's taps: the single per-tap helper of every kernel that visits them (forward, fast, tile, sorted and
// counting backwards).
// ---------------------------------------------------------------------------------------------------
// A point's source coordinates from its grid values: bilinear / nearest the padded source index, bicubic the
// unnormalised one (its padding applies per tap). GRAD (the backwards): mult[a] = d coordinate / d grid value
// (ATen's gInp multipliers; 0 for nearest, whose grad_grid is 0), through ATen's *_set_grad functions. The
// forward (GRAD false; mult unused, may be null) keeps ATen's forward functions: their border / reflection clip
// takes a NaN coordinate to 0, where the set_grad clip passes it on (to -100: every tap outside).
template <typename A, int ND, int MODE, bool GRAD = true>
__device__ __forceinline__ void point_coords(A x, A y, A z, const Geo& g, A c[ND], A mult[ND]) {
    const int pad = (int)g.pad;
    const bool align = g.align != 0;
    if constexpr (!GRAD && MODE == MODE_BICUBIC) {
        c[0] = unnormalize(x, (int)g.IW, align);
        c[1] = unnormalize(y, (int)g.IH, align);
    } else if constexpr (!GRAD) {
        c[0] = source_index(x, (int)g.IW, pad, align);
        c[1] = source_index(y, (int)g.IH, pad, align);
        if constexpr (ND == 3) c[ND - 1] = source_index(z, (int)g.ID, pad, align);
    } else if constexpr (MODE == MODE_BICUBIC) {
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
template <typename T, typename A, int ND, int MODE, bool GRAD = true>
__device__ __forceinline__ void grid_coords(const T* __restrict__ gp, const Geo& g, A c[ND], A mult[ND]) {
    const A x = to_acc(gp[0]), y = to_acc(gp[g.gr_sK]);
    const A z = ND == 3 ? static_cast<A>(to_acc(gp[2 * g.gr_sK])) : static_cast<A>(0);
    point_coords<A, ND, MODE, GRAD>(x, y, z, g, c, mult);
}

// Point p of batch item n: its coordinates from its grid values, read through the grid's strides (GRAD: as
// grid_coords).
template <typename T, typename A, int ND, int MODE, bool GRAD = true, typename I>
__device__ __forceinline__ void grid_point(const T* __restrict__ grid, long long n, I p, const Geo& g, A c[ND],
                                           A mult[ND]) {
    I od, oh, ow;
    point_at(p, g, od, oh, ow);
    grid_coords<T, A, ND, MODE, GRAD>(grid + n * g.gr_sN + od * g.gr_sD + oh * g.gr_sH + ow * g.gr_sW, g, c, mult);
}

// A point's taps from its coordinates: ok(k) when tap k falls inside (any(): some tap does); its pixel dst(k)
// within the batch item (dense planes) and its offset src(k, g) through the input's strides; its weight w(k),
// what multiplies grad_output in ATen's grad_input update and the input value in its bilinear forward; and the
// grad_grid coefficients: grad_grid[a] = mult[a] * the sum over taps in_gg(k) and channels of cg(a, k) * input
// value * grad_output (ATen's sums, regrouped). Bicubic's forward interpolates a row of taps with xc, then the
// rows with yc, as ATen's does (not w(k) = xc * yc). Built from the stored coordinates too (the deterministic
// gathers): every algorithm sees the same taps.
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

// f(n, p, np, taps) for each output point np = n * P + p (batch item n, point p) this thread takes, one thread
// per point (a grid-stride loop): its taps from its grid values, its coordinates stored to coords[np * ND ..]
// for the gathers (the deterministic backwards' first kernels).
template <typename T, typename A, int ND, int MODE, typename F>
__device__ __forceinline__ void store_points(const T* __restrict__ grid, A* __restrict__ coords, const Geo& g, F f) {
    const long long P = g.OD * g.OH * g.OW, NP = g.N * P;
    for (long long np = blockIdx.x * (long long)blockDim.x + threadIdx.x; np < NP; np += (long long)gridDim.x * blockDim.x) {
        long long p;
        const long long n = div_rem(np, P, p);
        A c[ND], mult[ND];
        grid_point<T, A, ND, MODE>(grid, n, p, g, c, mult);
#pragma unroll
        for (int a = 0; a < ND; ++a) coords[np * ND + a] = c[a];
        f(n, p, np, PointTaps<A, ND, MODE>(c, g));
    }
}

// The taps of point np (over the batch) from its stored coordinates.
template <typename A, int ND, int MODE>
__device__ __forceinline__ PointTaps<A, ND, MODE> stored_taps(const A* __restrict__ coords, long long np, const Geo& g) {
    A c[ND];
#pragma unroll
    for (int a = 0; a < ND; ++a) c[a] = coords[np * ND + a];
    return PointTaps<A, ND, MODE>(c, g);
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
