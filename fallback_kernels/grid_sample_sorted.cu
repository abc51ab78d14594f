// grid_sample's deterministic backward for grad_input by sorted keys (one program; float64, or TUNING det_keys
// "tap" / "cell"): gs_keys / gs_bounds / gs_gather, one int64 key per (point, tap) = destination pixel * (P *
// taps) + point * taps + tap, sorted between the launches (CuPy's thrust sort; unique keys, so any sort gives
// one order), then one lane group per destination pixel sums its contributions in key order and writes once;
// gs_cell_keys / gs_cell_gather, one key per point (its cell), for bilinear and nearest.

#include "grid_sample_common.cuh"

#define KEY_NONE 0x7fffffffffffffffLL

// One thread per point: its coordinates, and one key per tap (KEY_NONE when the tap falls outside).
template <typename T, typename A, int ND, int MODE>
__global__ void __launch_bounds__(256) gs_keys(const T* __restrict__ grid, long long* __restrict__ keys,
                                               A* __restrict__ coords, const Geo g) {
    constexpr int K = Taps<ND, MODE>::K;
    const long long S = g.ID * g.IH * g.IW, PT = g.OD * g.OH * g.OW * K;
    store_points<T, A, ND, MODE>(grid, coords, g, [&](long long n, long long p, long long np, const PointTaps<A, ND, MODE>& tp) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            keys[np * K + k] = tp.ok(k) ? (n * S + tp.dst(k)) * PT + p * K + k : KEY_NONE;
        }
    });
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
    const long long P = g.OD * g.OH * g.OW, NCELL = cell_count<ND>(g);
    const int ID = (int)g.ID, IH = (int)g.IH, IW = (int)g.IW;
    store_points<T, A, ND, MODE>(grid, coords, g, [&](long long n, long long p, long long np, const PointTaps<A, ND, MODE>& tp) {
        // The cell: bilinear's lowest corner (which may lie one pixel before the input) or nearest's pixel, + 1.
        const int lo = MODE == MODE_BILINEAR ? -1 : 0;
        const bool ok = tp.x0 >= lo && tp.x0 < IW && tp.y0 >= lo && tp.y0 < IH && (ND == 2 || (tp.z0 >= lo && tp.z0 < ID));
        const int cx = tp.x0 + 1, cy = tp.y0 + 1, cz = ND == 3 ? tp.z0 + 1 : 0;
        keys[np] = ok ? (n * NCELL + ((long long)cz * (IH + 1) + cy) * (IW + 1) + cx) * P + p : KEY_NONE;
    });
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
