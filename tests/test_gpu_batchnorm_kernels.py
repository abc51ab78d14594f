"""batchnorm.cu's reductions and passes alone against float64, on every reduction layout (1, 2 or 16 bytes of
channels a thread; 8, 16 or 32 threads a row; a last tile part-filled) and row counts no chunk divides.

Values are small multiples of powers of two, so y * scale + shift is exact in float32 with or without a fused
multiply-add: the ReLU mask is the same bits in the kernel and the reference, and only the sums round."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fallback_kernels.batchnorm import BatchNormKernels, reduce_layout  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPES = [(1000, 7), (777, 20), (3001, 96), (2500, 320), (50176, 64), (1568, 2048)]


def _grid(*shape, steps, scale, lo=-1, g=None):
    """Random multiples of 1 / scale in [lo * steps, steps] / scale: exact in float16."""
    return torch.randint(lo * steps, steps + 1, shape, device="cuda", generator=g).float() / scale


def _case(rows, c, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = {"y": _grid(rows, c, steps=64, scale=64, g=g), "da": _grid(rows, c, steps=64, scale=64, g=g),
         "a": _grid(rows, c, steps=64, scale=64, g=g), "scale": _grid(c, steps=4, scale=4, lo=0, g=g) + 0.25,
         "shift": _grid(c, steps=8, scale=64, g=g)}
    t["gamma"] = torch.rand(c, device="cuda", generator=g) + 0.5
    t["mean"] = t["y"].mean(0)
    t["invstd"] = torch.rand(c, device="cuda", generator=g) + 0.5
    half = {k: t[k].half() for k in ("y", "da", "a", "scale", "shift")}
    return t, half


def _reference(t, stored):
    d = {k: v.double() for k, v in t.items()}
    pre = d["a"] if stored else d["y"] * d["scale"] + d["shift"]
    dz = torch.where(pre > 0, d["da"], torch.zeros_like(d["da"]))
    m = d["y"].shape[0]
    dbeta = dz.sum(0)
    dgamma = d["invstd"] * (dz * (d["y"] - d["mean"])).sum(0)
    a = d["gamma"] * d["invstd"]
    dy = a * dz - a * d["invstd"] * dgamma / m * (d["y"] - d["mean"]) - a * dbeta / m
    return {"dz": dz, "dbeta": dbeta, "dgamma": dgamma, "dy": dy, "sum": d["y"].sum(0),
            "sq_sum": (d["y"] ** 2).sum(0)}


def _bits(bn, half):
    """The mask bits of a > 0 as the output pass writes them: apply(a * 1 + 0) with relu."""
    c = half["a"].shape[1]
    ones, zeros = torch.ones(c, device="cuda", dtype=torch.half), torch.zeros(c, device="cuda", dtype=torch.half)
    bits = torch.full((bn.bits_bytes,), 0xA5, dtype=torch.uint8, device="cuda")  # poisoned
    out = torch.empty_like(half["a"])
    bn.apply(torch.cuda.current_stream().cuda_stream, y=half["a"].data_ptr(), scale=ones.data_ptr(),
             shift=zeros.data_ptr(), out=out.data_ptr(), relu=True, bits=bits.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(out, half["a"].clamp_min(0))
    return bits


def _run(bn, t, half, mask):
    rows, c = t["y"].shape
    f32 = lambda n: torch.full((n,), float("nan"), device="cuda")  # noqa: E731 - poisoned outputs
    out = {"dgamma": f32(c), "dbeta": f32(c), "coef": f32(3 * c), "sum": f32(c), "sq_sum": f32(c),
           "dy": torch.full_like(half["y"], float("nan")), "dz": torch.full_like(half["y"], float("nan"))}
    partials = torch.empty(bn.partials_bytes // 4 + 1, device="cuda")
    counters = torch.zeros(bn.tiles, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    bn.stats(stream, y=half["y"].data_ptr(), partials=partials.data_ptr(), sum=out["sum"].data_ptr(),
             sq_sum=out["sq_sum"].data_ptr(), counters=counters.data_ptr())
    bits = _bits(bn, half) if mask == "bits" else None
    stored = half["a"].data_ptr() if mask == "stored" else 0
    bn.backward(stream, da=half["da"].data_ptr(), y=half["y"].data_ptr(), out=stored,
                bits=0 if bits is None else bits.data_ptr(),
                scale=half["scale"].data_ptr(), shift=half["shift"].data_ptr(), gamma=t["gamma"].data_ptr(),
                mean=t["mean"].data_ptr(), invstd=t["invstd"].data_ptr(), partials=partials.data_ptr(),
                coef=out["coef"].data_ptr(), dgamma=out["dgamma"].data_ptr(), dbeta=out["dbeta"].data_ptr(),
                dy=out["dy"].data_ptr(), relu=True, counters=counters.data_ptr(), dz=out["dz"].data_ptr())
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0  # left zeroed for the next launch
    return out


@pytest.mark.parametrize("mask", ["from-y", "stored", "bits"])
@pytest.mark.parametrize("rows,c", SHAPES, ids=[f"{r}x{c}-{reduce_layout('float16', c)}" for r, c in SHAPES])
def test_reductions_and_backward_pass_match_float64(rows, c, mask):
    t, half = _case(rows, c)
    bn = BatchNormKernels(rows, c, "float16", 0)
    if mask == "bits" and not bn.bits:
        with pytest.raises(ValueError, match="bits"):
            bn.apply(0, y=1, scale=0, shift=0, out=1, relu=True, bits=1)
        return
    got, want = _run(bn, t, half, mask), _reference(t, mask != "from-y")
    assert torch.equal(got["dz"].double(), want["dz"])  # the mask, bit for bit
    for name in ("sum", "sq_sum", "dbeta", "dgamma"):
        err = (got[name].double() - want[name]).abs().max() / want[name].abs().max()
        assert err < 1e-5, (name, float(err))
    err = (got["dy"].double() - want["dy"]).abs() - 2e-3 * want["dy"].abs()
    assert float(err.max()) < 2e-3 * float(want["dy"].abs().max()), "dy"
    again = _run(bn, t, half, mask)
    for name in ("sum", "sq_sum", "dbeta", "dgamma", "dy"):  # a fixed order of sums: the same bits
        assert torch.equal(again[name], got[name]), name


def test_output_pass_with_a_branch_matches_float64():
    rows, c = 3001, 96
    t, half = _case(rows, c)
    r, s2, t2 = half["a"], half["scale"].flip(0), half["shift"].flip(0)
    bn = BatchNormKernels(rows, c, "float16", 0)
    out = torch.full_like(half["y"], float("nan"))
    stream = torch.cuda.current_stream().cuda_stream
    bn.apply(stream, y=half["y"].data_ptr(), scale=half["scale"].data_ptr(), shift=half["shift"].data_ptr(),
             out=out.data_ptr(), relu=True, residual=r.data_ptr(), scale2=s2.data_ptr(), shift2=t2.data_ptr())
    want = (half["y"].double() * half["scale"].double() + half["shift"].double()
            + r.double() * s2.double() + t2.double()).clamp_min(0)
    assert torch.allclose(out.double(), want, rtol=1e-3, atol=1e-3)
