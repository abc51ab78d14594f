"""PROTOTYPE (session 6, not shipped; the library form is gs_tile_sort + gs_tile_gather).
Design D for the f16 fast backward. A sort kernel per (row group, n) builds a CSR of
(point, weight) entries per input pixel in global memory (once per batch item, shared by every
channel slice); a gather kernel per (channel slice, n) stages grad_output + input slices in shared
memory, gathers grad_input per pixel from the CSR, and computes grad_grid partials per point.
Variants: pixel ranges G, channels per slice CS, threads NT, entries in flight UNR, v2 = channel-interleaved
16-byte chunks (gather8), reread = re-read the grid in the place phase. H100 numbers in docs/kernels.md."""
import os, sys
import cupy, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_grid_sample as B

COMMON = r'''
struct half_t { unsigned short v; };
__device__ __forceinline__ float h2f(half_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.v)); return f; }
__device__ __forceinline__ float h2f_bits(unsigned short b) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b)); return f; }
__device__ __forceinline__ half_t f2h(float x) { half_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.v) : "f"(x)); return h; }
__device__ __forceinline__ int swz(int w) { return w ^ (int)(((unsigned)(w >> 5) * 0x9E3779B1u) >> 27); }
__device__ __forceinline__ int hidx(int i) { return (swz(i >> 1) << 1) | (i & 1); }
__device__ __forceinline__ void point_xy(const half_t* grid, long long i, float& x, float& y) {
    const unsigned v = __ldg(reinterpret_cast<const unsigned*>(grid) + i);
    x = h2f_bits((unsigned short)(v & 0xffff)); y = h2f_bits((unsigned short)(v >> 16));
}
// block-wide exclusive scan of a[swz(0..n)) in place; returns total
__device__ int block_scan(int* a, int n, int* warp_tot) {
    const int tid = threadIdx.x, bd = blockDim.x;
    const int per = (n + bd - 1) / bd, b0 = tid * per;
    int sum = 0;
    for (int i = 0; i < per; ++i) if (b0 + i < n) sum += a[swz(b0 + i)];
    int incl = sum;
    for (int m = 1; m < 32; m <<= 1) { const int v = __shfl_up_sync(0xffffffffu, incl, m); if ((tid & 31) >= m) incl += v; }
    if ((tid & 31) == 31) warp_tot[tid >> 5] = incl;
    __syncthreads();
    if (tid < 32) {
        int t = tid < (bd >> 5) ? warp_tot[tid] : 0, ti = t;
        for (int m = 1; m < 32; m <<= 1) { const int v = __shfl_up_sync(0xffffffffu, ti, m); if (tid >= m) ti += v; }
        warp_tot[tid] = ti - t;
        if (tid == 31) warp_tot[32] = ti;
    }
    __syncthreads();
    int run = warp_tot[tid >> 5] + incl - sum;
    for (int i = 0; i < per; ++i) if (b0 + i < n) { const int v = a[swz(b0 + i)]; a[swz(b0 + i)] = run; run += v; }
    return warp_tot[32];
}
'''

SORT = r'''
// one block per (row group g, batch item n): CSR of the group's pixels, entries (p, w) in region (n*G+g)*4P
extern "C" __global__ void __launch_bounds__(1024) sortk(const half_t* __restrict__ grid, int2* __restrict__ ents,
        int2* __restrict__ segs, int H, int W, int P, int G) {
    extern __shared__ int off[];
    __shared__ int warp_tot[33];
    const int S = H * W, g = blockIdx.x, n = blockIdx.y, R = (S + G - 1) / G, d0 = g * R;
    const int nr = min(S, d0 + R) - d0, tid = threadIdx.x, bd = blockDim.x;
    for (int i = tid; i < ((nr + 31) & ~31); i += bd) off[i] = 0;
    __syncthreads();
    int kx0[KEEP], ky0[KEEP];
    float kfx[KEEP], kfy[KEEP];
#pragma unroll
    for (int j = 0; j < KEEP; ++j) {
        const int p = tid + j * bd;
        float x, y;
        point_xy(grid, (long long)n * P + p, x, y);
        const float ix = ((x + 1.f) * W - 1.f) * 0.5f, iy = ((y + 1.f) * H - 1.f) * 0.5f;
        const int x0 = (int)floorf(ix), y0 = (int)floorf(iy);
        kx0[j] = x0; ky0[j] = y0; kfx[j] = ix - x0; kfy[j] = iy - y0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int xx = x0 + (k & 1), yy = y0 + (k >> 1);
            if (xx < 0 || xx >= W || yy < 0 || yy >= H) continue;
            const int d = yy * W + xx - d0;
            if ((unsigned)d < (unsigned)nr) atomicAdd(off + swz(d), 1);
        }
    }
    __syncthreads();
    block_scan(off, nr, warp_tot);
    __syncthreads();
    const int base = (n * G + g) * 4 * P;
    int2* sg = segs + (long long)n * S + d0;
    for (int i = tid; i < nr; i += bd) sg[i].x = base + off[swz(i)];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < KEEP; ++j) {
        const int p = tid + j * bd;
#if REREAD
        float x, y;
        point_xy(grid, (long long)n * P + p, x, y);
        const float ix = ((x + 1.f) * W - 1.f) * 0.5f, iy = ((y + 1.f) * H - 1.f) * 0.5f;
        const int x0 = (int)floorf(ix), y0 = (int)floorf(iy);
        const float fx = ix - x0, fy = iy - y0;
#else
        const int x0 = kx0[j], y0 = ky0[j];
        const float fx = kfx[j], fy = kfy[j];
#endif
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int xx = x0 + (k & 1), yy = y0 + (k >> 1);
            if (xx < 0 || xx >= W || yy < 0 || yy >= H) continue;
            const int d = yy * W + xx - d0;
            if ((unsigned)d >= (unsigned)nr) continue;
            const int pos = atomicAdd(off + swz(d), 1);
            const float w = ((k & 1) ? fx : 1.f - fx) * ((k >> 1) ? fy : 1.f - fy);
            ents[base + pos] = make_int2(p, __float_as_int(w));
        }
    }
    __syncthreads();
    for (int i = tid; i < nr; i += bd) sg[i].y = base + off[swz(i)];
}
'''

GATHER = r'''
extern "C" __global__ void __launch_bounds__(NT) gatherk(const half_t* __restrict__ go, const half_t* __restrict__ inp,
        const half_t* __restrict__ grid, const int2* __restrict__ ents, const int2* __restrict__ segs,
        half_t* __restrict__ gi, float* __restrict__ ggp, int N, int C, int H, int W, int P) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int S = H * W, slice = blockIdx.x, n = blockIdx.y, c0 = slice * CS;
    half_t* go_s = reinterpret_cast<half_t*>(smem);
    half_t* in_s = go_s + CS * P;
    const int tid = threadIdx.x, bd = blockDim.x;
    {
        const uint4* g4 = reinterpret_cast<const uint4*>(go + ((long long)n * C + c0) * P);
        const uint4* i4 = reinterpret_cast<const uint4*>(inp + ((long long)n * C + c0) * S);
        unsigned* gsw = reinterpret_cast<unsigned*>(go_s);
        unsigned* isw = reinterpret_cast<unsigned*>(in_s);
        for (int i = tid; i < CS * P / 8; i += bd) { const uint4 v = g4[i]; gsw[swz(4*i)] = v.x; gsw[swz(4*i+1)] = v.y; gsw[swz(4*i+2)] = v.z; gsw[swz(4*i+3)] = v.w; }
        for (int i = tid; i < CS * S / 8; i += bd) { const uint4 v = i4[i]; isw[swz(4*i)] = v.x; isw[swz(4*i+1)] = v.y; isw[swz(4*i+2)] = v.z; isw[swz(4*i+3)] = v.w; }
    }
    __syncthreads();
    half_t* gout = gi + ((long long)n * C + c0) * S;
    const int2* sgs = segs + (long long)n * S;
    for (int d = tid; d < S; d += bd) {
        const int2 sg = sgs[d];
        float acc[CS];
#pragma unroll
        for (int c = 0; c < CS; ++c) acc[c] = 0.f;
        for (int e = sg.x; e < sg.y; e += UNR) {
            int2 en[UNR];
#pragma unroll
            for (int u = 0; u < UNR; ++u) en[u] = e + u < sg.y ? __ldg(ents + e + u) : make_int2(0, 0);
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                if (e + u >= sg.y) break;
                const float w = __int_as_float(en[u].y);
#pragma unroll
                for (int c = 0; c < CS; ++c) acc[c] += w * h2f(go_s[hidx(c * P + en[u].x)]);
            }
        }
#pragma unroll
        for (int c = 0; c < CS; ++c) gout[c * S + d] = f2h(acc[c]);
    }
    for (int p = tid; p < P; p += bd) {
        float x, y;
        point_xy(grid, (long long)n * P + p, x, y);
        const float ix = ((x + 1.f) * W - 1.f) * 0.5f, iy = ((y + 1.f) * H - 1.f) * 0.5f;
        const int x0 = (int)floorf(ix), y0 = (int)floorf(iy);
        const float wx1 = ix - x0, wx0 = 1.f - wx1, wy1 = iy - y0, wy0 = 1.f - wy1;
        float gx = 0.f, gy = 0.f, gov[CS];
#pragma unroll
        for (int c = 0; c < CS; ++c) gov[c] = h2f(go_s[hidx(c * P + p)]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int xx = x0 + (k & 1), yy = y0 + (k >> 1);
            if (xx < 0 || xx >= W || yy < 0 || yy >= H) continue;
            const int d = yy * W + xx;
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < CS; ++c) dot += h2f(in_s[hidx(c * S + d)]) * gov[c];
            gx += ((k & 1) ? dot : -dot) * ((k >> 1) ? wy1 : wy0);
            gy += ((k >> 1) ? dot : -dot) * ((k & 1) ? wx1 : wx0);
        }
        reinterpret_cast<float2*>(ggp)[((long long)slice * N + n) * P + p] = make_float2(gx * (W * 0.5f), gy * (H * 0.5f));
    }
}
extern "C" __global__ void gg_sum(const float* __restrict__ ggp, half_t* __restrict__ gg, long long n, int slices) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = ggp[i];
        for (int k = 1; k < slices; ++k) s += ggp[k * n + i];
        gg[i] = f2h(s);
    }
}
'''

GATHER2 = r'''
// 16-byte chunk q (8 halves: one pixel's 8 channels) at cpos(q): low 3 bits XOR-folded with the row bits
__device__ __forceinline__ int cpos(int q) { return (q & ~7) | ((q ^ (q >> 3) ^ (q >> 6)) & 7); }
__device__ __forceinline__ void unpack8(uint4 u, float f[8]) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) { f[2*m] = h2f_bits((unsigned short)(w[m] & 0xffff)); f[2*m+1] = h2f_bits((unsigned short)(w[m] >> 16)); }
}
// stage 8 channel planes (each n8*8 halves, plane stride `plane` halves) into chunks
__device__ __forceinline__ void stage8(const half_t* src, long long plane, int n8, uint4* dst) {
    for (int i = threadIdx.x; i < n8; i += blockDim.x) {
        uint4 v[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) v[c] = __ldg(reinterpret_cast<const uint4*>(src + c * plane) + i);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
            unsigned o[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const unsigned a = (&v[2*m].x)[j >> 1], b = (&v[2*m+1].x)[j >> 1];
                o[m] = __byte_perm(a, b, sel);
            }
            dst[cpos(8 * i + j)] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}
extern "C" __global__ void __launch_bounds__(NT) gather8(const half_t* __restrict__ go, const half_t* __restrict__ inp,
        const half_t* __restrict__ grid, const int2* __restrict__ ents, const int2* __restrict__ segs,
        half_t* __restrict__ gi, float* __restrict__ ggp, int N, int C, int H, int W, int P) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int S = H * W, slice = blockIdx.x, n = blockIdx.y, c0 = slice * 8;
    uint4* go_s = reinterpret_cast<uint4*>(smem);
    uint4* in_s = go_s + P;
    const int tid = threadIdx.x, bd = blockDim.x;
    stage8(go + ((long long)n * C + c0) * P, P, P / 8, go_s);
    stage8(inp + ((long long)n * C + c0) * S, S, S / 8, in_s);
    __syncthreads();
    half_t* gout = gi + ((long long)n * C + c0) * S;
    const int2* sgs = segs + (long long)n * S;
    for (int d = tid; d < S; d += bd) {
        const int2 sg = sgs[d];
        float acc[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = 0.f;
        for (int e = sg.x; e < sg.y; e += UNR) {
            int2 en[UNR];
#pragma unroll
            for (int u = 0; u < UNR; ++u) en[u] = e + u < sg.y ? __ldg(ents + e + u) : make_int2(0, 0);
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                if (e + u >= sg.y) break;
                const float w = __int_as_float(en[u].y);
                float f[8];
                unpack8(go_s[cpos(en[u].x)], f);
#pragma unroll
                for (int c = 0; c < 8; ++c) acc[c] += w * f[c];
            }
        }
#pragma unroll
        for (int c = 0; c < 8; ++c) gout[c * S + d] = f2h(acc[c]);
    }
    for (int p = tid; p < P; p += bd) {
        float x, y;
        point_xy(grid, (long long)n * P + p, x, y);
        const float ix = ((x + 1.f) * W - 1.f) * 0.5f, iy = ((y + 1.f) * H - 1.f) * 0.5f;
        const int x0 = (int)floorf(ix), y0 = (int)floorf(iy);
        const float wx1 = ix - x0, wx0 = 1.f - wx1, wy1 = iy - y0, wy0 = 1.f - wy1;
        float gx = 0.f, gy = 0.f, gov[8];
        unpack8(go_s[cpos(p)], gov);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int xx = x0 + (k & 1), yy = y0 + (k >> 1);
            if (xx < 0 || xx >= W || yy < 0 || yy >= H) continue;
            float f[8];
            unpack8(in_s[cpos(yy * W + xx)], f);
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < 8; ++c) dot += f[c] * gov[c];
            gx += ((k & 1) ? dot : -dot) * ((k >> 1) ? wy1 : wy0);
            gy += ((k >> 1) ? dot : -dot) * ((k & 1) ? wx1 : wx0);
        }
        reinterpret_cast<float2*>(ggp)[((long long)slice * N + n) * P + p] = make_float2(gx * (W * 0.5f), gy * (H * 0.5f));
    }
}
'''

N, C, H, W = 32, 32, 64, 64
P = S = H * W
STREAM = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def u64(t):
    return cupy.uint64(t.data_ptr())


class DesignD:
    def __init__(self, G, CS, NT, UNR=4, v2=False, reread=0):
        self.G, self.CS, self.NT = G, CS, NT
        keep = P // 1024
        mod = cupy.RawModule(code=COMMON + SORT + GATHER + GATHER2, options=(
            "--std=c++17", f"-DKEEP={keep}", f"-DCS={CS}", f"-DNT={NT}", f"-DUNR={UNR}", f"-DREREAD={reread}"))
        self.sortk, self.gatherk, self.ggsum = (mod.get_function(k) for k in ("sortk", "gather8" if v2 else "gatherk", "gg_sum"))
        self.smem_sort = ((S + G - 1) // G + 31) // 32 * 32 * 4
        self.smem_g = CS * P * 2 + CS * S * 2
        self.gatherk.max_dynamic_shared_size_bytes = self.smem_g
        self.slices = C // CS
        self.ents = torch.empty(N * G * 4 * P * 2, device="cuda", dtype=torch.int32)
        self.segs = torch.empty(N * S * 2, device="cuda", dtype=torch.int32)
        self.ggp = torch.empty(self.slices * N * P * 2, device="cuda", dtype=torch.float32)
        self.name = f"D G={G} CS={CS} NT={NT} UNR={UNR} v2={v2} reread={reread}"
        print(self.name, "regs sort/gather", self.sortk.num_regs, self.gatherk.num_regs, "local",
              self.sortk.local_size_bytes, self.gatherk.local_size_bytes, flush=True)

    def sort(self, s):
        self.sortk((self.G, N), (1024,), (u64(s["grid"]), u64(self.ents), u64(self.segs), cupy.int32(H),
                   cupy.int32(W), cupy.int32(P), cupy.int32(self.G)), shared_mem=self.smem_sort, stream=STREAM)

    def gather(self, s, gi):
        self.gatherk((self.slices, N), (self.NT,), (u64(s["go"]), u64(s["x"]), u64(s["grid"]), u64(self.ents),
                     u64(self.segs), u64(gi), u64(self.ggp), cupy.int32(N), cupy.int32(C), cupy.int32(H),
                     cupy.int32(W), cupy.int32(P)), shared_mem=self.smem_g, stream=STREAM)

    def sum(self, gg):
        cnt = N * P * 2
        self.ggsum(((cnt + 255) // 256,), (256,), (u64(self.ggp), u64(gg), cupy.int64(cnt), cupy.int32(self.slices)),
                   stream=STREAM)

    def __call__(self, s, gi=None, gg=None):
        if gi is None:
            gi, gg = torch.empty_like(s["x"]), torch.empty_like(s["grid"])
        self.sort(s)
        self.gather(s, gi)
        self.sum(gg)
        return gi, gg


def poisoned_check(fn, s, ref64):
    g3, gg3 = torch.full_like(s["x"], float("nan")), torch.full_like(s["grid"], float("nan"))
    fn(s, g3, gg3)
    return B.rel(g3, ref64[0]), B.rel(gg3, ref64[1]), bool(torch.isfinite(g3).all() and torch.isfinite(gg3).all())


def time_parts(d, sets, reps=30):
    gi, gg = torch.empty_like(sets[0]["x"]), torch.empty_like(sets[0]["grid"])
    out = {}
    for label, f in (("sort", lambda s: d.sort(s)), ("gather", lambda s: d.gather(s, gi)), ("sum", lambda s: d.sum(gg))):
        out[label] = B.time_gpu(f, sets, reps) * 1e3
    return out


def main():
    shape = B.SHAPES[1]
    if os.environ.get("PROFILE"):
        d = DesignD(4, 8, 1024, 4, True)
        s = B.make_set(shape, "random")
        d(s); torch.cuda.synchronize()
        return
    variants = [DesignD(*a) for a in
                [(4, 8, 1024, 4), (1, 8, 1024, 4), (8, 8, 1024, 4), (4, 8, 1024, 4, True), (4, 8, 512, 4, True),
                 (4, 8, 1024, 2, True), (4, 8, 1024, 4, True, 1), (2, 8, 1024, 4, True), (8, 8, 1024, 4, True)]]
    for kind in ("random", "affine"):
        sets = [B.make_set(shape, kind) for _ in range(2)]
        ref64 = B.f64_reference(sets[0])
        t_torch = B.time_gpu(B.torch_backward, sets, 30) * 1e3
        t_fast = B.time_gpu(B.ours_backward(False), sets, 30) * 1e3
        print(f"{kind}: torch {t_torch:.1f} us, shipped fast {t_fast:.1f} us ({t_torch / t_fast:.2f}x)", flush=True)
        for d in variants:
            e_gi, e_gg, fin = poisoned_check(d, sets[0], ref64)
            t = B.time_gpu(d, sets, 30) * 1e3
            parts = time_parts(d, sets)
            print(f"  {d.name}: {t:.1f} us ({t_torch / t:.2f}x) parts " +
                  " ".join(f"{k} {v:.1f}" for k, v in parts.items()) + f"; err gi {e_gi:.1e} gg {e_gg:.1e} finite {fin}",
                  flush=True)


if __name__ == "__main__":
    main()
