"""GPU: grid_sample forward and both backward algorithms against torch's own grid_sample (the oracle).

The oracle is torch.nn.functional.grid_sample + autograd in float64 on upcast copies of the inputs. Grids
are uniform in [-1.2, 1.2] (they reach outside the image) but keep every sampling coordinate at least
`MARGIN` pixels away from integers and half-integers, where grid_sample is discontinuous (floor, round,
clip and reflection folds): there a float32 coordinate and its float64 oracle may fall on different sides.
Edge cases at exact boundaries and non-finite grids are compared with torch in the same dtype instead.

Set GS_REPORT_DIR to get every failure of the matrix tests as JSON lines in failures.jsonl.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from cudnn_graphs.errors import BufferMismatchError, SpecError  # noqa: E402
from fallback_kernels import grid_sample as gs  # noqa: E402

pytestmark = pytest.mark.gpu

TD = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# Relative L2 error allowed per dtype (the oracle is float64 on the same, already rounded, inputs).
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 5e-5, "float64": 1e-10}
MODES = {2: ("bilinear", "nearest", "bicubic"), 3: ("bilinear", "nearest")}
PADS = ("zeros", "border", "reflection")
LAYOUTS = ("contiguous", "channels_last")
MARGIN = 2e-3
REPO = Path(__file__).resolve().parents[1]


def _report(test: str, failures: list) -> None:
    folder = os.environ.get("GS_REPORT_DIR")
    if folder and failures:
        with open(Path(folder) / "failures.jsonl", "a") as f:
            for item in failures:
                f.write(json.dumps({"test": test, **item}, default=str) + "\n")


def _fail_if_any(test: str, failures: list) -> None:
    _report(test, failures)
    if failures:
        lines = [json.dumps(f, default=str) for f in failures[:25]]
        pytest.fail(f"{len(failures)} failing case(s):\n" + "\n".join(lines), pytrace=False)


def _memory_format(nd: int):
    return torch.channels_last if nd == 2 else torch.channels_last_3d


def rand(shape, dtype, layout="contiguous"):
    """Fresh random data (never zeros) in the given layout."""
    t = torch.randn(shape, dtype=torch.float64, device="cuda").to(TD[dtype])
    if layout == "channels_last":
        t = t.contiguous(memory_format=_memory_format(len(shape) - 2))
    return t


def _unnormalize(g, size, align):
    return (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2


def make_grid(n, out_sp, in_sp, align, dtype, lo=-1.2, hi=1.2, margin=MARGIN):
    """Uniform grid in [lo, hi] whose coordinates stay `margin` pixels off integers and half-integers."""
    nd = len(in_sp)
    g = torch.empty((n, *out_sp, nd), dtype=torch.float64, device="cuda").uniform_(lo, hi)
    sizes = list(reversed(in_sp))  # grid[..., 0] indexes W, [..., 1] H, [..., 2] D
    for _ in range(200):
        q = g.to(TD[dtype]).double()
        bad = torch.zeros(q.shape[:-1], dtype=torch.bool, device="cuda")
        for a, size in enumerate(sizes):
            ix = _unnormalize(q[..., a], size, align)
            bad |= (ix * 2 - torch.round(ix * 2)).abs() / 2 < margin
        if not bad.any():
            return g.to(TD[dtype])
        g[bad] = torch.empty((int(bad.sum()), nd), dtype=torch.float64, device="cuda").uniform_(lo, hi)
    raise AssertionError("could not draw a grid away from the discontinuities")


def oracle(inp, grid, go, mode, pad, align):
    i = inp.detach().double().requires_grad_()
    g = grid.detach().double().requires_grad_()
    out = F.grid_sample(i, g, mode=mode, padding_mode=pad, align_corners=align)
    gi, gg = torch.autograd.grad(out, (i, g), go.double())
    return out, gi, gg


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else a.norm().item()


def run_case(nd, mode, pad, align, dtype, layout, n, c, in_sp, out_sp, algorithms=(False, True)):
    """Errors (relative L2) of forward and each backward algorithm; {} when all pass."""
    inp = rand((n, c, *in_sp), dtype, layout)
    grid = make_grid(n, out_sp, in_sp, align, dtype)
    go = rand((n, c, *out_sp), dtype, layout)
    ref_out, ref_gi, ref_gg = oracle(inp, grid, go, mode, pad, align)
    errors = {}
    out = gs.grid_sample(inp, grid, mode=mode, padding_mode=pad, align_corners=align)
    errors["out"] = rel(out, ref_out)
    problems = {}
    if layout == "channels_last" and not out.is_contiguous(memory_format=_memory_format(nd)):
        problems["out_layout"] = tuple(out.stride())
    for det in algorithms:
        gi, gg = gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode=pad, align_corners=align,
                                         deterministic=det)
        tag = "det" if det else "fast"
        errors[f"gi_{tag}"] = rel(gi, ref_gi)
        errors[f"gg_{tag}"] = rel(gg, ref_gg)
        if gi.dtype != inp.dtype or gg.dtype != grid.dtype or gi.shape != inp.shape or gg.shape != grid.shape:
            problems[f"{tag}_meta"] = (gi.dtype, gi.shape, gg.dtype, gg.shape)
        if layout == "channels_last" and not gi.is_contiguous(memory_format=_memory_format(nd)):
            problems[f"{tag}_gi_layout"] = tuple(gi.stride())
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    bad.update(problems)
    if bad:
        return dict(nd=nd, mode=mode, pad=pad, align=align, dtype=dtype, layout=layout, c=c, in_sp=in_sp,
                    out_sp=out_sp, bad=bad, tol=TOL[dtype])
    return {}


def _matrix(nd, dtypes, layouts, n, c, in_sp, out_sp, aligns=(False, True), modes=None, pads=PADS):
    failures = []
    for dtype in dtypes:
        for layout in layouts:
            for mode in modes or MODES[nd]:
                for pad in pads:
                    for align in aligns:
                        try:
                            f = run_case(nd, mode, pad, align, dtype, layout, n, c, in_sp, out_sp)
                        except Exception as err:  # keep going: one summary for the whole matrix
                            f = dict(nd=nd, mode=mode, pad=pad, align=align, dtype=dtype, layout=layout,
                                     error=f"{type(err).__name__}: {err}"[:500])
                        if f:
                            failures.append(f)
    return failures


# ------------------------------------------------------------------------------------------------------
# The full matrix at small sizes
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TD))
@pytest.mark.parametrize("nd", [2, 3])
def test_full_matrix_small(nd, dtype):
    torch.manual_seed(1)
    in_sp, out_sp = ((7, 9), (5, 6)) if nd == 2 else ((4, 5, 6), (3, 4, 5))
    failures = _matrix(nd, [dtype], LAYOUTS, 2, 6, in_sp, out_sp)  # C = 6: the scalar channel path
    # C = 16 channels-last: the vector loads / stores / atomics
    failures += _matrix(nd, [dtype], ["channels_last"], 2, 16, in_sp, out_sp)
    _fail_if_any(f"full_matrix_small[{nd}-{dtype}]", failures)


@pytest.mark.parametrize("nd", [2, 3])
def test_larger_shapes_subset(nd):
    torch.manual_seed(2)
    if nd == 2:
        failures = _matrix(2, ["float32", "float16"], LAYOUTS, 3, 64, (33, 47), (40, 50), aligns=(False,))
        failures += _matrix(2, ["bfloat16"], ["channels_last"], 2, 36, (20, 30), (31, 17), aligns=(True,),
                            pads=("zeros",))
    else:
        failures = _matrix(3, ["float32"], LAYOUTS, 2, 16, (9, 10, 11), (7, 8, 9), aligns=(False,))
        failures += _matrix(3, ["float16"], ["channels_last"], 2, 20, (6, 7, 8), (5, 6, 7), aligns=(True,),
                            pads=("reflection",))
    _fail_if_any(f"larger_shapes_subset[{nd}]", failures)


def test_strided_and_expanded_buffers():
    """Non-contiguous views, an expanded (stride 0) grad_output and a strided grid."""
    torch.manual_seed(3)
    failures = []
    for dtype in ("float32", "float16"):
        base = rand((2, 10, 13, 17), dtype)
        inp = base[:, 1:9, ::2, 1:]  # strided view
        gbase = make_grid(2, (6, 14), (7, 16), False, dtype)
        grid = torch.cat([gbase, gbase], dim=2)[:, :, ::2]  # strided grid (same values)
        go = rand((1, 8, 1, 14), dtype).expand(2, 8, 6, 14)  # stride-0 dims, as autograd gives for sums
        ref_out, ref_gi, ref_gg = oracle(inp, grid, go, "bilinear", "reflection", False)
        out = gs.grid_sample(inp, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        errs = {"out": rel(out, ref_out)}
        for det in (False, True):
            gi, gg = gs.grid_sample_backward(go, inp, grid, mode="bilinear", padding_mode="reflection",
                                             align_corners=False, deterministic=det)
            errs[f"gi{det}"], errs[f"gg{det}"] = rel(gi, ref_gi), rel(gg, ref_gg)
        bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
        if bad:
            failures.append(dict(dtype=dtype, bad=bad))
    _fail_if_any("strided_and_expanded_buffers", failures)


@pytest.mark.parametrize("lanes_log2", [0, 1, 5])
def test_forward_lanes_looping_over_channel_groups(monkeypatch, lanes_log2):
    """One lane per point looping over every channel group (a ragged last group), two lanes, and one lane
    per group: the forward's every channel loop, in both layouts and every mode, against float64."""
    monkeypatch.setitem(gs.TUNING, "fwd_threads", 1)
    monkeypatch.setitem(gs.TUNING, "fwd_groups_per_lane", 1 << 20)
    monkeypatch.setitem(gs.TUNING, "fwd_lanes_log2", (lanes_log2, lanes_log2))
    monkeypatch.setitem(gs.TUNING, "fwd_plane", False)  # the gather kernel alone (planes: the test below)
    monkeypatch.setitem(gs.TUNING, "fwd_cf", False)  # (ATen's loop order: test_forward_point_kernel)
    torch.manual_seed(4)
    failures = []
    for nd, (in_sp, out_sp) in ((2, ((9, 11), (6, 7))), (3, ((4, 5, 6), (3, 4, 5)))):
        for dtype in ("float32", "float16"):
            for layout in LAYOUTS:
                for mode in MODES[nd]:
                    for c in (13, 16):
                        f = run_case(nd, mode, "reflection", False, dtype, layout, 2, c, in_sp, out_sp, algorithms=())
                        if f:
                            failures.append(f)
    _fail_if_any(f"forward_lanes[{lanes_log2}]", failures)


@pytest.mark.parametrize("spread", [0, 1 << 40], ids=["plane", "gather"])
def test_forward_planes_in_shared_memory(monkeypatch, spread):
    """Channels-first forwards through the plane kernel (GS_PLANE_SPREAD=0: every warp counts as scattered)
    and, in the same four-op plan, through the gather kernel (no warp does): every mode and padding, ragged
    channel groups, planes not a 16-byte multiple, strided inputs (element copies), several point ranges."""
    monkeypatch.setitem(gs.TUNING, "options", (f"-DGS_PLANE_SPREAD={spread}",))
    monkeypatch.setitem(gs.TUNING, "fwd_plane_bytes", 2048)  # a few planes a block, several channel groups
    monkeypatch.setitem(gs.TUNING, "fwd_plane_min_values", 0)  # small shapes too
    monkeypatch.setitem(gs.TUNING, "fwd_plane_modes", gs.MODES)
    torch.manual_seed(9)
    failures = []
    # the gather kernel's dtypes are the point tests' too: here its two widths (each dtype is a compile)
    dtypes = ("float32", "float16", "bfloat16", "float64") if spread == 0 else ("float32", "float16")
    for nd, (in_sp, out_sp) in ((2, ((9, 11), (6, 7))), (2, ((16, 16), (40, 40))), (3, ((4, 5, 6), (3, 4, 5)))):
        for dtype in dtypes:
            for mode in MODES[nd]:
                for pad in PADS:
                    f = run_case(nd, mode, pad, pad == "border", dtype, "contiguous", 3, 13, in_sp, out_sp,
                                 algorithms=())
                    if f:
                        failures.append(f)
    for dtype in ("float32", "float16"):  # a strided view: planes copied element by element
        base = rand((2, 10, 13, 34), dtype)
        inp = base[:, 1:9, ::2, ::2]
        grid = make_grid(2, (20, 21), (7, 17), False, dtype)
        ref = oracle(inp, grid, torch.zeros((2, 8, 20, 21), device="cuda", dtype=torch.float64), "bilinear",
                     "zeros", False)[0]
        err = rel(gs.grid_sample(inp, grid), ref)
        if not err <= TOL[dtype]:
            failures.append(dict(dtype=dtype, strided=err))
    _fail_if_any(f"forward_planes[{spread}]", failures)


@pytest.mark.parametrize("spread", [0, 1 << 40], ids=["scattered", "smooth"])
def test_forward_point_kernel(monkeypatch, spread):
    """Channels-first forwards through gs_forward_cf (ATen's loop order): a channel an iteration
    (GS_CF_SPREAD=0: every warp counts as scattered) and GS_CF_UNROLL (no warp does), channel counts not a
    multiple of it, every padding, both modes, four dtypes, a strided input, against float64; and at the
    benchmark's sizes, with TUNING as shipped, outputs bit-identical to torch's kernel."""
    monkeypatch.setitem(gs.TUNING, "options", (f"-DGS_CF_SPREAD={spread}",))
    monkeypatch.setitem(gs.TUNING, "fwd_cf_min_points", 1)  # small shapes too
    monkeypatch.setitem(gs.TUNING, "fwd_plane", False)
    torch.manual_seed(11)
    failures = []
    # float64 never unrolls (it spilled): the smooth setting's own path is the 16- and 32-bit ones
    dtypes = ("float32", "float16", "bfloat16", "float64") if spread == 0 else ("float32", "float16", "bfloat16")
    for nd, (in_sp, out_sp) in ((2, ((9, 11), (6, 7))), (2, ((16, 16), (40, 40))), (3, ((4, 5, 6), (3, 4, 5)))):
        for dtype in dtypes:
            for mode in ("bilinear", "nearest"):
                for pad in PADS:
                    for c in (1, 7):
                        f = run_case(nd, mode, pad, pad == "border", dtype, "contiguous", 3, c, in_sp, out_sp,
                                     algorithms=())
                        if f:
                            failures.append(f)
    base = rand((2, 10, 13, 34), "float32")
    inp, grid = base[:, 1:9, ::2, ::2], make_grid(2, (20, 21), (7, 17), False, "float32")
    ref = oracle(inp, grid, torch.zeros((2, 8, 20, 21), device="cuda", dtype=torch.float64), "bilinear", "zeros",
                 False)[0]
    if not rel(gs.grid_sample(inp, grid), ref) <= TOL["float32"]:
        failures.append(dict(strided=rel(gs.grid_sample(inp, grid), ref)))
    monkeypatch.setitem(gs.TUNING, "fwd_cf_min_points", 1 << 15)  # as shipped: the sizes take it by themselves
    monkeypatch.setitem(gs.TUNING, "fwd_plane", True)
    for dtype, shape, out_sp in ((torch.float16, (32, 32, 64, 64), (64, 64)), (torch.float32, (2, 16, 32, 32, 32), (32,) * 3)):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        for smooth in (False, True):
            g = torch.rand(shape[0], *out_sp, len(out_sp), device="cuda") * 2.2 - 1.1
            if smooth:
                g = torch.stack(torch.meshgrid(*[torch.linspace(-0.9, 0.8, n, device="cuda") for n in out_sp],
                                               indexing="ij")[::-1], -1).expand_as(g)
            g = g.to(dtype).contiguous()
            for mode in ("bilinear", "nearest"):
                want = torch.nn.functional.grid_sample(x, g, mode=mode, align_corners=False)
                if not torch.equal(gs.grid_sample(x, g, mode=mode), want):
                    failures.append(dict(shape=shape, smooth=smooth, mode=mode, bitwise="differs from torch"))
    _fail_if_any(f"forward_point_kernel[{spread}]", failures)


@pytest.mark.parametrize("knob", [("fwd_cf_split", 3), ("fwd_cf_blocks_per_sm", 1)], ids=["split3", "capped"])
def test_forward_point_kernel_knobs(monkeypatch, knob):
    """gs_forward_cf with a point's channels over 3 threads (channel counts leaving the last range short or
    empty) or its grid capped at a block an SM (grid-stride): outputs bit-identical to torch's."""
    monkeypatch.setitem(gs.TUNING, knob[0], knob[1])
    monkeypatch.setitem(gs.TUNING, "fwd_cf_min_points", 1)
    monkeypatch.setitem(gs.TUNING, "fwd_plane", False)
    torch.manual_seed(12)
    failures = []
    # the last: 512 blocks of points, so a grid capped at one block an SM strides
    for shape, out_sp in (((2, 7, 9, 11), (6, 7)), ((3, 2, 4, 5, 6), (3, 4, 5)), ((2, 4, 8, 8, 8), (64, 32, 32))):
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            g = (torch.rand(shape[0], *out_sp, len(out_sp), device="cuda") * 2.2 - 1.1).to(dtype)
            for mode in ("bilinear", "nearest"):
                want = torch.nn.functional.grid_sample(x, g, mode=mode, align_corners=False)
                if not torch.equal(gs.grid_sample(x, g, mode=mode), want):
                    failures.append(dict(shape=shape, dtype=dtype, mode=mode))
    _fail_if_any(f"forward_point_kernel_knobs[{knob}]", failures)


@pytest.mark.parametrize("go_transpose, input_transpose", [(True, True), (False, False)])
def test_fast_backward_tuning_variants(monkeypatch, go_transpose, input_transpose):
    monkeypatch.setitem(gs.TUNING, "go_transpose", go_transpose)
    monkeypatch.setitem(gs.TUNING, "input_transpose", input_transpose)
    torch.manual_seed(4)
    failures = []
    for nd, in_sp, out_sp in ((2, (11, 13), (9, 10)), (3, (5, 6, 7), (4, 5, 6))):
        for mode in MODES[nd]:
            for dtype in ("float32", "float16"):
                f = run_case(nd, mode, "zeros", False, dtype, "contiguous", 2, 12, in_sp, out_sp, algorithms=(False,))
                if f:
                    failures.append(f)
    _fail_if_any(f"tuning[{go_transpose}-{input_transpose}]", failures)


# ------------------------------------------------------------------------------------------------------
# Determinism
# ------------------------------------------------------------------------------------------------------
def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4 else torch.int64)


@pytest.mark.parametrize("det_keys", ["count", "cell", "tap"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_deterministic_backward_is_bit_identical(monkeypatch, dtype, det_keys):
    """Many points per input cell (upsampling grid, border padding piles points on the edges). "count" (the
    default) places contributions in a different order each run: only its exact sums make it identical."""
    monkeypatch.setitem(gs.TUNING, "det_keys", det_keys)
    torch.manual_seed(5)
    failures = []
    cases = [(2, "bilinear", (6, 7), (48, 40)), (2, "bicubic", (6, 7), (30, 40)), (2, "nearest", (6, 7), (48, 40)),
             (3, "bilinear", (4, 5, 6), (12, 14, 16)), (3, "nearest", (4, 5, 6), (12, 14, 16))]
    for nd, mode, in_sp, out_sp in cases:
        for layout in LAYOUTS:
            inp = rand((2, 12, *in_sp), dtype, layout)
            grid = make_grid(2, out_sp, in_sp, True, dtype, lo=-1.5, hi=1.5)
            go = rand((2, 12, *out_sp), dtype, layout)
            runs = [gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode="border", align_corners=True,
                                            deterministic=True) for _ in range(5)]
            same = all(torch.equal(_bits(r[0]), _bits(runs[0][0])) and torch.equal(_bits(r[1]), _bits(runs[0][1]))
                       for r in runs[1:])
            _, ref_gi, ref_gg = oracle(inp, grid, go, mode, "border", True)
            e_gi, e_gg = rel(runs[0][0], ref_gi), rel(runs[0][1], ref_gg)
            if not (same and e_gi <= TOL[dtype] and e_gg <= TOL[dtype]):
                failures.append(dict(nd=nd, mode=mode, layout=layout, dtype=dtype, identical=same, gi=e_gi, gg=e_gg))
    _fail_if_any(f"deterministic[{dtype}-{det_keys}]", failures)


def test_deterministic_cell_keys_variant(monkeypatch):
    """The sorted deterministic backward's per-point (cell) keys agree with torch too."""
    monkeypatch.setitem(gs.TUNING, "det_keys", "cell")
    torch.manual_seed(13)
    failures = []
    for nd, in_sp, out_sp in ((2, (7, 9), (5, 6)), (3, (4, 5, 6), (3, 4, 5))):
        for mode in MODES[nd]:
            for pad in PADS:
                for dtype, layout in (("float32", "contiguous"), ("float16", "channels_last")):
                    f = run_case(nd, mode, pad, True, dtype, layout, 2, 8, in_sp, out_sp, algorithms=(True,))
                    if f:
                        failures.append(f)
    _fail_if_any("deterministic_cell_keys", failures)


# ------------------------------------------------------------------------------------------------------
# Edge semantics against torch in the same dtype
# ------------------------------------------------------------------------------------------------------
def _torch_same_dtype(inp, grid, go, mode, pad, align):
    """torch's own CUDA kernel (GridSampler.cu). cuDNN is switched off: torch sends 2-D bilinear / zeros /
    align_corners=True to cuDNN's sampler otherwise, which treats non-finite grids its own way."""
    i, g = inp.detach().clone().requires_grad_(), grid.detach().clone().requires_grad_()
    with torch.backends.cudnn.flags(enabled=False):
        out = F.grid_sample(i, g, mode=mode, padding_mode=pad, align_corners=align)
        gi, gg = torch.autograd.grad(out, (i, g), go)
    return out, gi, gg


def _close(a, b, dtype) -> bool:
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    try:
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-4 if dtype == torch.float32 else 1e-2,
                                   atol=1e-4 if dtype == torch.float32 else 2e-2)
    except AssertionError:
        return False
    return True


def test_non_finite_and_huge_grid_values_like_torch():
    torch.manual_seed(6)
    failures = []
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.25], dtype=torch.float64)
    for nd in (2, 3):
        in_sp, out_sp = ((5, 6), (4, 5)) if nd == 2 else ((3, 4, 5), (2, 3, 4))
        for mode in MODES[nd]:
            for pad in PADS:
                for align in (False, True):
                    inp = rand((2, 3, *in_sp), "float32")
                    grid = make_grid(2, out_sp, in_sp, align, "float32").double()
                    flat = grid.view(-1)
                    idx = torch.randperm(flat.numel(), device="cuda")[: flat.numel() // 3]
                    flat[idx] = specials.to("cuda")[torch.randint(0, len(specials), (len(idx),), device="cuda")]
                    grid = grid.float()
                    go = rand((2, 3, *out_sp), "float32")
                    ref = _torch_same_dtype(inp, grid, go, mode, pad, align)
                    ours = [gs.grid_sample(inp, grid, mode=mode, padding_mode=pad, align_corners=align)]
                    for det in (False, True):
                        ours += list(gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode=pad,
                                                             align_corners=align, deterministic=det))
                    names = ["out", "gi_fast", "gg_fast", "gi_det", "gg_det"]
                    refs = [ref[0], ref[1], ref[2], ref[1], ref[2]]
                    bad = [n for n, a, b in zip(names, ours, refs) if not _close(a, b, torch.float32)]
                    if bad:
                        failures.append(dict(nd=nd, mode=mode, pad=pad, align=align, bad=bad))
    _fail_if_any("non_finite_grid", failures)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_non_finite_and_zero_grad_output_like_torch(dtype):
    """NaN / +inf / -inf in grad_output: both backwards give NaN / inf exactly where torch's sums do; an
    all-zero grad_output gives zeros; one large value among small ones stays within tolerance."""
    torch.manual_seed(21)
    failures = []
    for case in ("nan", "inf", "mixed_inf", "zeros", "range"):
        for layout in LAYOUTS:
            inp = rand((2, 8, 9, 10), dtype, layout)
            grid = make_grid(2, (12, 11), (9, 10), False, dtype, lo=-1.1, hi=1.1)
            go = rand((2, 8, 12, 11), dtype, layout)
            flat = go.view(-1) if go.is_contiguous() else go.permute(0, 2, 3, 1).view(-1)  # a view: writes land in go
            if case == "zeros":
                go.zero_()
            elif case == "range":  # one huge value per batch item: the rest sit 2^-12 below it
                go.mul_(2.0 ** -12)
                go[:, 0, 0, 0] = 1.0
            else:
                idx = torch.randperm(go.numel(), device="cuda")[:5]
                values = {"nan": [float("nan")], "inf": [float("inf")], "mixed_inf": [float("inf"), -float("inf")]}[case]
                for k, i in enumerate(idx.tolist()):
                    flat[i] = values[k % len(values)]
            ref = _torch_same_dtype(inp.float(), grid.float(), go.float(), "bilinear", "zeros", False)
            for det in (False, True):
                gi, _ = gs.grid_sample_backward(go, inp, grid, deterministic=det)
                if not _close(gi.float(), ref[1], torch.float32 if dtype == "float32" else torch.float16):
                    failures.append(dict(case=case, layout=layout, dtype=dtype, deterministic=det))
                if case == "zeros" and not torch.equal(gi, torch.zeros_like(gi)):
                    failures.append(dict(case=case, layout=layout, dtype=dtype, deterministic=det, nonzero=True))
    _fail_if_any(f"non_finite_grad_output[{dtype}]", failures)


def test_exact_boundaries_like_torch():
    """Coordinates exactly on half-integers (nearest: round half to even), integers and the borders."""
    failures = []
    vals = torch.tensor([-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float32)
    for nd in (2, 3):
        in_sp = (5, 5) if nd == 2 else (5, 5, 5)
        mesh = torch.stack(torch.meshgrid(*([vals] * nd), indexing="ij"), dim=-1).reshape(1, -1, 1, nd)
        grid = (mesh if nd == 2 else mesh.unsqueeze(1)).cuda()
        for mode in MODES[nd]:
            for pad in PADS:
                for align in (False, True):
                    inp = rand((1, 3, *in_sp), "float32")
                    go = rand((1, 3, *grid.shape[1:-1]), "float32")
                    ref = _torch_same_dtype(inp, grid, go, mode, pad, align)
                    out = gs.grid_sample(inp, grid, mode=mode, padding_mode=pad, align_corners=align)
                    gi, gg = gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode=pad, align_corners=align)
                    gid, ggd = gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode=pad,
                                                       align_corners=align, deterministic=True)
                    pairs = {"out": (out, ref[0]), "gi": (gi, ref[1]), "gg": (gg, ref[2]), "gi_det": (gid, ref[1]),
                             "gg_det": (ggd, ref[2])}
                    bad = [k for k, (a, b) in pairs.items() if not _close(a, b, torch.float32)]
                    if bad:
                        failures.append(dict(nd=nd, mode=mode, pad=pad, align=align, bad=bad))
    _fail_if_any("exact_boundaries", failures)


def test_nearest_rounds_half_to_even():
    inp = torch.arange(5, dtype=torch.float32, device="cuda").view(1, 1, 1, 5)
    # align_corners=True, W=5: x = 2g + 2 -> 0.5, 1.5, 2.5, 3.5 -> nearbyint: 0, 2, 2, 4
    g = torch.tensor([-0.75, -0.25, 0.25, 0.75], device="cuda")
    grid = torch.stack([g, torch.zeros_like(g)], -1).view(1, 1, 4, 2)
    out = gs.grid_sample(inp, grid, mode="nearest", padding_mode="zeros", align_corners=True)
    assert out.flatten().tolist() == [0.0, 2.0, 2.0, 4.0]
    assert torch.equal(out, F.grid_sample(inp, grid, mode="nearest", padding_mode="zeros", align_corners=True))


# ------------------------------------------------------------------------------------------------------
# Finite differences, autograd wrapper, frameworks, streams
# ------------------------------------------------------------------------------------------------------
def test_gradcheck_float64_through_the_wrapper():
    from cudnn_graphs.torch import grid_sample as cg_grid_sample

    torch.manual_seed(7)
    failures = []
    for nd in (2, 3):
        in_sp, out_sp = ((4, 5), (3, 3)) if nd == 2 else ((3, 3, 4), (2, 2, 3))
        for mode in MODES[nd]:
            for pad in PADS:
                for align in (False, True):
                    inp = rand((1, 2, *in_sp), "float64").requires_grad_()
                    grid = make_grid(1, out_sp, in_sp, align, "float64", margin=1e-2).requires_grad_()
                    for det in (False, True):
                        def fn(i, g, mode=mode, pad=pad, align=align, det=det):
                            return cg_grid_sample(i, g, mode, pad, align, deterministic=det)
                        try:
                            # the atomics of the fast backward may reorder float64 sums: allow for it
                            ok = torch.autograd.gradcheck(fn, (inp, grid), eps=1e-6, atol=1e-6, rtol=1e-4,
                                                          nondet_tol=0.0 if det else 1e-12)
                        except Exception as err:
                            ok = f"{type(err).__name__}: {str(err)[:300]}"
                        if ok is not True:
                            failures.append(dict(nd=nd, mode=mode, pad=pad, align=align, det=det, result=ok))
    _fail_if_any("gradcheck", failures)


def test_torch_wrapper_matches_torch_and_respects_requires_grad():
    import cudnn_graphs.torch as cgt

    torch.manual_seed(8)
    x = rand((2, 8, 9, 10), "float32", "channels_last").requires_grad_()
    grid = make_grid(2, (6, 7), (9, 10), False, "float32").requires_grad_()
    out = cgt.grid_sample(x, grid, "bilinear", "border", False)
    ref = F.grid_sample(x, grid, "bilinear", "border", False)
    assert rel(out, ref) < 1e-5
    w = torch.randn_like(ref)
    gx, gg = torch.autograd.grad((out * w).sum(), (x, grid))
    rx, rg = torch.autograd.grad((ref * w).sum(), (x, grid))
    assert rel(gx, rx) < 5e-5 and rel(gg, rg) < 5e-5
    # only the input needs a gradient
    grid2 = grid.detach()
    y = cgt.grid_sample(x, grid2, "bicubic", "zeros", True)
    (g_only,) = torch.autograd.grad(y.sum(), (x,))
    assert rel(g_only, torch.autograd.grad(F.grid_sample(x, grid2, "bicubic", "zeros", True).sum(), (x,))[0]) < 5e-5
    # only the grid needs a gradient
    x2 = x.detach()
    y = cgt.grid_sample(x2, grid, "bilinear", "reflection", True)
    (gg_only,) = torch.autograd.grad(y.sum(), (grid,))
    assert rel(gg_only, torch.autograd.grad(F.grid_sample(x2, grid, "bilinear", "reflection", True).sum(),
                                            (grid,))[0]) < 5e-5
    # the module form and the align_corners=None warning
    m = cgt.GridSample("nearest", "zeros", None, deterministic=True)
    with pytest.warns(UserWarning, match="align_corners"):
        assert torch.equal(m(x2, grid2), F.grid_sample(x2, grid2, "nearest", "zeros", False))
    # CPU tensors go to torch's own op
    xc, gc = x2.cpu(), grid2.cpu()
    assert torch.equal(cgt.grid_sample(xc, gc, "bilinear", "zeros", False), F.grid_sample(xc, gc, align_corners=False))
    with pytest.raises(SpecError):
        cgt.grid_sample(x2, grid2, "cubic", "zeros", False)


def test_wrapper_under_deterministic_algorithms():
    import cudnn_graphs.torch as cgt

    torch.manual_seed(9)
    x = rand((2, 16, 12, 12), "float32").requires_grad_()
    grid = make_grid(2, (40, 40), (12, 12), False, "float32").requires_grad_()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(3):
            out = cgt.grid_sample(x, grid, "bilinear", "zeros", False)
            results.append(torch.autograd.grad(out.square().sum(), (x, grid)))
    finally:
        torch.use_deterministic_algorithms(was)
    for r in results[1:]:
        assert torch.equal(_bits(r[0]), _bits(results[0][0])) and torch.equal(_bits(r[1]), _bits(results[0][1]))
    out = F.grid_sample(x, grid, "bilinear", "zeros", False)
    ref = torch.autograd.grad(out.square().sum(), (x, grid))
    assert rel(results[0][0], ref[0]) < 5e-5 and rel(results[0][1], ref[1]) < 5e-5


def test_autocast_casts_to_float32_like_torch():
    import cudnn_graphs.torch as cgt

    x = rand((1, 4, 6, 6), "float16")
    grid = make_grid(1, (3, 3), (6, 6), False, "float32")
    with torch.autocast("cuda", dtype=torch.float16):
        out = cgt.grid_sample(x, grid, "bilinear", "zeros", False)
    assert out.dtype == torch.float32
    assert rel(out, F.grid_sample(x.float(), grid, "bilinear", "zeros", False)) < 1e-5


def test_cupy_arrays_in_cupy_arrays_out():
    cupy = pytest.importorskip("cupy")
    torch.manual_seed(10)
    for dtype in ("float32", "float16", "float64"):
        x = rand((2, 5, 8, 9), dtype, "channels_last")
        grid = make_grid(2, (4, 6), (8, 9), True, dtype)
        go = rand((2, 5, 4, 6), dtype, "channels_last")
        cx, cg, cgo = cupy.asarray(x), cupy.asarray(grid), cupy.asarray(go)
        out = gs.grid_sample(cx, cg, mode="bicubic", padding_mode="border", align_corners=True)
        gi, gg = gs.grid_sample_backward(cgo, cx, cg, mode="bicubic", padding_mode="border", align_corners=True,
                                         deterministic=True)
        assert isinstance(out, cupy.ndarray) and isinstance(gi, cupy.ndarray) and isinstance(gg, cupy.ndarray)
        assert gi.strides[1] == gi.itemsize  # channels-last in, channels-last out
        ref_out, ref_gi, ref_gg = oracle(x, grid, go, "bicubic", "border", True)
        for a, b in ((out, ref_out), (gi, ref_gi), (gg, ref_gg)):
            assert rel(torch.as_tensor(a, device="cuda"), b) < TOL[dtype]
    with pytest.raises(BufferMismatchError, match="framework"):
        gs.grid_sample(cupy.asarray(rand((1, 1, 3, 3), "float32")), make_grid(1, (2, 2), (3, 3), False, "float32"))


def test_runs_on_the_current_stream():
    """Inputs produced on a busy side stream: kernels launched on any other stream would read them too early."""
    torch.manual_seed(11)
    x = rand((4, 32, 40, 40), "float32")
    grid = make_grid(4, (64, 64), (40, 40), False, "float32")
    go = rand((4, 32, 64, 64), "float32")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x2, grid2, go2 = x * 1, grid * 1, go * 1
        out = gs.grid_sample(x2, grid2, mode="bilinear", padding_mode="zeros", align_corners=False)
        gi, gg = gs.grid_sample_backward(go2, x2, grid2, mode="bilinear", padding_mode="zeros", align_corners=False)
        gid, ggd = gs.grid_sample_backward(go2, x2, grid2, mode="bilinear", padding_mode="zeros",
                                           align_corners=False, deterministic=True)
    torch.cuda.current_stream().wait_stream(side)
    ref_out, ref_gi, ref_gg = oracle(x, grid, go, "bilinear", "zeros", False)
    errs = [rel(out, ref_out), rel(gi, ref_gi), rel(gg, ref_gg), rel(gid, ref_gi), rel(ggd, ref_gg)]
    assert max(errs) < 5e-5, errs


# ------------------------------------------------------------------------------------------------------
# Argument checking, empty tensors, 64-bit sizes
# ------------------------------------------------------------------------------------------------------
def test_bad_inputs_are_refused_before_launch():
    x = rand((2, 3, 5, 6), "float32")
    g = make_grid(2, (4, 4), (5, 6), False, "float32")
    go = rand((2, 3, 4, 4), "float32")
    cases = [
        (lambda: gs.grid_sample(x, g, mode="area"), SpecError, "mode"),
        (lambda: gs.grid_sample(x, g, padding_mode="wrap"), SpecError, "padding_mode"),
        (lambda: gs.grid_sample(rand((1, 1, 3, 3, 3), "float32"), make_grid(1, (2, 2, 2), (3, 3, 3), False, "float32"),
                                mode="bicubic"), SpecError, "mode"),
        (lambda: gs.grid_sample(x, g.double()), BufferMismatchError, "dtype"),
        (lambda: gs.grid_sample(x, g[:1]), BufferMismatchError, "batch"),
        (lambda: gs.grid_sample(x, torch.cat([g, g[..., :1]], -1)), BufferMismatchError, "last dimension"),
        (lambda: gs.grid_sample(x[0], g[0]), BufferMismatchError, "rank"),
        (lambda: gs.grid_sample(x.cpu(), g), BufferMismatchError, "device"),
        (lambda: gs.grid_sample(x[:, :, :0], g), BufferMismatchError, "spatial"),
        (lambda: gs.grid_sample_backward(go[:, :2], x, g), BufferMismatchError, "grad_output"),
        (lambda: gs.grid_sample_backward(go.half(), x, g), BufferMismatchError, "dtype"),
    ]
    failures = []
    for i, (fn, exc, match) in enumerate(cases):
        try:
            fn()
            failures.append(dict(case=i, raised=None))
        except exc as err:
            if match not in str(err):
                failures.append(dict(case=i, message=str(err)))
        except Exception as err:
            failures.append(dict(case=i, raised=f"{type(err).__name__}: {err}"))
    _fail_if_any("bad_inputs", failures)


def test_empty_tensors_are_a_no_op():
    for shape, gshape in [((0, 3, 5, 6), (0, 4, 4, 2)), ((2, 0, 5, 6), (2, 4, 4, 2)), ((2, 3, 5, 6), (2, 0, 4, 2)),
                          ((2, 3, 4, 5, 6), (2, 3, 0, 4, 3))]:
        x = rand(shape, "float32")
        g = torch.rand(gshape, device="cuda") * 2 - 1
        out = gs.grid_sample(x, g, mode="bilinear", padding_mode="zeros", align_corners=False)
        ref = F.grid_sample(x, g, align_corners=False)
        assert out.shape == ref.shape
        go = torch.randn(ref.shape, device="cuda")
        for det in (False, True):
            gi, gg = gs.grid_sample_backward(go, x, g, deterministic=det)
            assert gi.shape == x.shape and gg.shape == g.shape
            assert not gi.any() and not gg.any()
    assert gs.grid_sample_backward(go, x, g, input_requires_grad=False, grid_requires_grad=False) == (None, None)


def test_more_than_2_31_elements():
    """64-bit offsets: a float32 image of 46341 x 46341 pixels (2**31 + 4633 elements), sampled at its far corner."""
    free, _ = torch.cuda.mem_get_info()
    if free < 40e9:
        pytest.skip("needs 40 GB of free GPU memory")
    torch.manual_seed(12)
    side = 46341
    x = torch.empty((1, 1, side, side), dtype=torch.float32, device="cuda").normal_()
    assert x.numel() > 2**31
    corners = torch.tensor([[0.99995, 0.99995], [-0.9999, 0.99995], [0.99995, -0.9999], [0.3, 0.7]], device="cuda")
    grid = torch.cat([corners, torch.rand(12, 2, device="cuda") * 2 - 1]).view(1, 4, 4, 2)
    go = torch.randn((1, 1, 4, 4), device="cuda")
    x.requires_grad_()
    g = grid.clone().requires_grad_()
    ref_out = F.grid_sample(x, g, mode="bilinear", padding_mode="zeros", align_corners=False)
    ref_gi, ref_gg = torch.autograd.grad(ref_out, (x, g), go)
    x = x.detach()
    out = gs.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    gi, gg = gs.grid_sample_backward(go, x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    errs = {"out": (out - ref_out).abs().max().item(),
            "gg": ((gg - ref_gg).abs().max() / ref_gg.abs().max()).item()}  # grad_grid ~ W / 2 = 23170
    errs["gi"] = gi.sub(ref_gi).abs_().max().item()  # one temporary of 8.6 GB
    far = gi[0, 0, -2:, -2:]
    assert far.abs().sum().item() > 0, "the far corner (offsets past 2**31) was not written"
    assert max(errs.values()) < 1e-3, errs


# ------------------------------------------------------------------------------------------------------
# The shared-memory fast backward (gs_tile_sort + gs_tile_gather)
# ------------------------------------------------------------------------------------------------------
def _kernels_of(call) -> set:
    """Kernel names (without template arguments) that `call()` launched."""
    gs.PROFILE = []
    try:
        call()
        torch.cuda.synchronize()
        return {label.split("<")[0] for label, _, _ in gs.PROFILE}
    finally:
        gs.PROFILE = None


def _force_tile(monkeypatch, **knobs):
    monkeypatch.setitem(gs.TUNING, "tile_min_fill", 0)  # small test shapes take it too
    for k, v in knobs.items():
        monkeypatch.setitem(gs.TUNING, k, v)


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("nd", [2, 3])
def test_tile_backward_full_matrix(monkeypatch, nd, staged):
    """mode x padding x align x f16 / bf16 / f32 through the tile kernels (fast and deterministic), with 1 and
    several (uneven) channel slices; entries staged in shared memory or (tile_sort_bytes too small) placed
    straight into global."""
    _force_tile(monkeypatch, **({} if staged else {"tile_sort_bytes": 0}))
    torch.manual_seed(31 + nd)
    # whole 16-byte chunks (8 values in 16-bit, 4 in f32); the f32 sizes are not multiples of 8 chunks
    shapes = {2: (((8, 12), (6, 4)), ((5, 4), (3, 4))), 3: (((4, 4, 6), (2, 4, 4)), ((3, 2, 2), (1, 3, 4)))}
    n = 3
    failures = []
    for dtype in ("float16", "bfloat16", "float32"):
        in_sp, out_sp = shapes[nd][dtype == "float32"]
        for c in (3, 11):  # one slice; 2 (f16) or 3 (f32) slices, the last one partial
            for mode in MODES[nd]:
                for pad in PADS:
                    for align in (False, True):
                        def case():
                            return run_case(nd, mode, pad, align, dtype, "contiguous", n, c, in_sp, out_sp)
                        try:
                            kernels = _kernels_of(lambda: failures.append(case()))
                            if not {"gs_tile_sort", "gs_tile_gather"} <= kernels:
                                failures.append(dict(dtype=dtype, c=c, mode=mode, kernels=sorted(kernels)))
                        except Exception as err:
                            failures.append(dict(nd=nd, mode=mode, pad=pad, align=align, dtype=dtype, c=c,
                                                 error=f"{type(err).__name__}: {err}"[:500]))
    _fail_if_any(f"tile_matrix[{nd}-{staged}]", [f for f in failures if f])


@pytest.mark.parametrize("staged", [True, False])
def test_tile_deterministic_backward_is_bit_identical(monkeypatch, staged):
    """Sorted segments: 5 runs give the same bits, also where border padding clamps many points onto the edge
    pixels (long segments: the heapsort); and the values match the oracle."""
    _force_tile(monkeypatch, **({} if staged else {"tile_sort_bytes": 0}))
    torch.manual_seed(37)
    failures = []
    for nd, mode, in_sp, out_sp in ((2, "bilinear", (16, 16), (32, 16)), (2, "bicubic", (8, 16), (16, 16)),
                                    (3, "bilinear", (4, 8, 8), (4, 8, 8)), (2, "nearest", (16, 16), (32, 16))):
        for dtype in ("float16", "bfloat16", "float32"):
            inp, go = rand((3, 12, *in_sp), dtype), rand((3, 12, *out_sp), dtype)
            grid = make_grid(3, out_sp, in_sp, False, dtype, lo=-3.0, hi=3.0)  # 2/3 of the points clamp
            runs = [gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode="border", deterministic=True)
                    for _ in range(5)]
            same = all(torch.equal(_bits(r[0]), _bits(runs[0][0])) and torch.equal(_bits(r[1]), _bits(runs[0][1]))
                       for r in runs[1:])
            _, ref_gi, ref_gg = oracle(inp, grid, go, mode, "border", False)
            errs = (rel(runs[0][0], ref_gi), rel(runs[0][1], ref_gg))
            kernels = _kernels_of(lambda: gs.grid_sample_backward(go, inp, grid, mode=mode, padding_mode="border",
                                                                  deterministic=True))
            if not same or max(errs) > TOL[dtype] or "gs_tile_sort" not in kernels:
                failures.append(dict(nd=nd, mode=mode, dtype=dtype, same=same, errs=errs, kernels=sorted(kernels)))
    _fail_if_any(f"tile_deterministic[{staged}]", failures)


def test_tile_backward_gradient_subsets(monkeypatch):
    """grad_input only, grad_grid only (the global kernel), and both, through the tile path."""
    _force_tile(monkeypatch)
    torch.manual_seed(33)
    inp, go = rand((4, 16, 16, 16), "float16"), rand((4, 16, 8, 16), "float16")
    grid = make_grid(4, (8, 16), (16, 16), False, "float16")
    _, ref_gi, ref_gg = oracle(inp, grid, go, "bilinear", "reflection", False)
    for need in ((True, True), (True, False), (False, True)):
        got = {}
        kernels = _kernels_of(lambda: got.update(zip("ab", gs.grid_sample_backward(
            go, inp, grid, padding_mode="reflection", input_requires_grad=need[0], grid_requires_grad=need[1]))))
        assert ("gs_tile_gather" in kernels) == need[0], (need, kernels)
        assert (got["a"] is None) != need[0] and (got["b"] is None) != need[1]
        if need[0]:
            assert rel(got["a"], ref_gi) < TOL["float16"]
        if need[1]:
            assert rel(got["b"], ref_gg) < TOL["float16"]


def test_tile_backward_non_finite_like_torch(monkeypatch):
    """NaN / inf / huge grid values and NaN / inf grad_output values through the tile kernels, against torch's own
    kernel in the same dtype."""
    _force_tile(monkeypatch)
    torch.manual_seed(34)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.25], dtype=torch.float64)
    failures = []
    for nd in (2, 3):
        in_sp, out_sp = ((4, 8), (4, 6)) if nd == 2 else ((2, 4, 4), (2, 2, 6))
        for dtype in ("float32", "float16"):
            for mode in MODES[nd]:
                for pad in PADS:
                    for align in (False, True):
                        inp = rand((2, 5, *in_sp), dtype)
                        grid = make_grid(2, out_sp, in_sp, align, dtype).double()
                        flat = grid.view(-1)
                        idx = torch.randperm(flat.numel(), device="cuda")[: flat.numel() // 3]
                        flat[idx] = specials.cuda()[torch.randint(0, len(specials), (len(idx),), device="cuda")]
                        grid = grid.to(TD[dtype])
                        go = rand((2, 5, *out_sp), dtype)
                        go.view(-1)[torch.randperm(go.numel(), device="cuda")[:2]] = float("inf")
                        go.view(-1)[torch.randperm(go.numel(), device="cuda")[:1]] = float("nan")
                        ref = _torch_same_dtype(inp.float(), grid.float(), go.float(), mode, pad, align)
                        got = {}
                        kernels = _kernels_of(lambda: got.update(zip(("gi", "gg"), gs.grid_sample_backward(
                            go, inp, grid, mode=mode, padding_mode=pad, align_corners=align))))
                        bad = [k for k, r in (("gi", ref[1]), ("gg", ref[2]))
                               if not _close(got[k].float(), r, torch.float32 if dtype == "float32" else torch.float16)]
                        if bad or "gs_tile_gather" not in kernels:
                            failures.append(dict(nd=nd, dtype=dtype, mode=mode, pad=pad, align=align, bad=bad))
    _fail_if_any("tile_non_finite", failures)


@pytest.mark.parametrize("kind", ["random", "affine"])
def test_issue_f16_shape_takes_the_tile_path_by_default(kind):
    """(32, 32, 64, 64) f16 -> 64 x 64: no knob needed; within f16 rounding of a float64 reference."""
    torch.manual_seed(35)
    inp, go = rand((32, 32, 64, 64), "float16"), rand((32, 32, 64, 64), "float16")
    if kind == "random":
        grid = (torch.rand((32, 64, 64, 2), device="cuda") * 2 - 1).half()
    else:
        theta = torch.tensor([[0.8, -0.45, 0.05], [0.45, 0.8, -0.05]], device="cuda").expand(32, 2, 3)
        grid = F.affine_grid(theta, (32, 1, 64, 64), align_corners=False).half()
    got = {}
    kernels = _kernels_of(lambda: got.update(zip(("gi", "gg"), gs.grid_sample_backward(go, inp, grid))))
    assert {"gs_tile_sort", "gs_tile_gather", "gs_gg_sum"} == kernels
    ref = _torch_same_dtype(inp.double(), grid.double(), go.double(), "bilinear", "zeros", False)
    assert rel(got["gi"], ref[1]) < 1e-3 and rel(got["gg"], ref[2]) < 1e-3


def test_tile_backward_more_than_65535_batch_items(monkeypatch):
    """Blocks loop over batch items past the grid's 65535 limit (both kernels)."""
    _force_tile(monkeypatch)
    torch.manual_seed(36)
    n = 65535 + 7
    inp, go = rand((n, 5, 2, 4), "float32"), rand((n, 5, 2, 2), "float32")
    grid = make_grid(n, (2, 2), (2, 4), True, "float32")
    got = {}
    kernels = _kernels_of(lambda: got.update(zip(("gi", "gg"), gs.grid_sample_backward(go, inp, grid,
                                                                                        align_corners=True))))
    assert "gs_tile_gather" in kernels
    _, ref_gi, ref_gg = oracle(inp, grid, go, "bilinear", "zeros", True)
    assert rel(got["gi"], ref_gi) < TOL["float32"] and rel(got["gg"], ref_gg) < TOL["float32"]
    assert got["gi"][-1].abs().sum() > 0 and got["gg"][-1].abs().sum() > 0  # the last items were written


# ------------------------------------------------------------------------------------------------------
# compute-sanitizer memcheck, one configuration per kernel
# ------------------------------------------------------------------------------------------------------
SANITIZER_SCRIPT = r"""
import cupy, numpy as np
from fallback_kernels import grid_sample as gs
rng = np.random.default_rng(0)
def arr(shape, dt):
    return cupy.asarray(rng.standard_normal(shape).astype(dt))
for nd, mode in gs.VARIANTS:
    m = gs.MODES[mode]
    sp, osp = ((5, 6), (4, 3)) if nd == 2 else ((3, 4, 5), (2, 3, 4))
    for c, dt in ((6, "float32"), (8, "float16")):
        x = arr((2, c) + sp, dt)
        g = cupy.asarray(rng.uniform(-1.2, 1.2, (2,) + osp + (nd,)).astype(dt))
        go = arr((2, c) + osp, dt)
        xcl = cupy.ascontiguousarray(cupy.moveaxis(x, 1, -1))
        xcl = cupy.moveaxis(xcl, -1, 1)  # channels-last strides
        for inp in (x, xcl):
            gs.grid_sample(inp, g, mode=m, padding_mode="reflection", align_corners=False)
            for det, keys in ((False, "count"), (True, "count"), (True, "tap")):
                gs.TUNING["det_keys"] = keys
                gs.grid_sample_backward(go, inp, g, mode=m, padding_mode="border", align_corners=True, deterministic=det)
gs.TUNING["tile_min_fill"] = 0  # the tile kernels, entries staged and placed directly
for nd, mode in gs.VARIANTS:
    m = gs.MODES[mode]
    sp, osp = ((4, 6), (2, 4)) if nd == 2 else ((2, 2, 6), (2, 2, 2))
    for c, dt in ((5, "float32"), (11, "float16")):
        for sort_bytes in (96 * 1024, 0):
            gs.TUNING["tile_sort_bytes"] = sort_bytes
            g = cupy.asarray(rng.uniform(-1.2, 1.2, (2,) + osp + (nd,)).astype(dt))
            gs.grid_sample_backward(arr((2, c) + osp, dt), arr((2, c) + sp, dt), g, mode=m, padding_mode="zeros")
cupy.cuda.runtime.deviceSynchronize()
print("SANITIZER-SCRIPT-OK")
"""


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        candidate = root / "bin" / "compute-sanitizer"
        if candidate.exists():
            return str(candidate)
    return None


RACECHECK_SCRIPT = r"""
import cupy, numpy as np
from fallback_kernels import grid_sample as gs
rng = np.random.default_rng(1)
gs.TUNING["tile_min_fill"] = 0
for nd, sp, osp in ((2, (8, 8), (4, 8)), (3, (2, 4, 4), (2, 2, 4))):
    for sort_bytes in (96 * 1024, 0):
        gs.TUNING["tile_sort_bytes"] = sort_bytes
        g = cupy.asarray(rng.uniform(-1.1, 1.1, (2,) + osp + (nd,)).astype("float16"))
        x = cupy.asarray(rng.standard_normal((2, 11) + sp).astype("float16"))
        go = cupy.asarray(rng.standard_normal((2, 11) + osp).astype("float16"))
        gs.grid_sample_backward(go, x, g)
cupy.cuda.runtime.deviceSynchronize()
print("SANITIZER-SCRIPT-OK")
"""


@pytest.mark.parametrize("tool_name, script", [("memcheck", SANITIZER_SCRIPT), ("racecheck", RACECHECK_SCRIPT)])
def test_compute_sanitizer(tool_name, script):
    """memcheck over every kernel; racecheck (shared-memory hazards) over the tile kernels."""
    pytest.importorskip("cupy")
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found (PATH, /usr/local/cuda*/bin)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    start = time.time()
    proc = subprocess.run([tool, "--tool", tool_name, "--error-exitcode", "3", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=240, env=env)
    text = proc.stdout + proc.stderr
    summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
    _report(f"sanitizer-{tool_name}", [] if proc.returncode == 0 else [dict(rc=proc.returncode, tail=text[-3000:])])
    assert proc.returncode == 0 and "SANITIZER-SCRIPT-OK" in text, text[-3000:]
    assert summary and re.search(r"(?<!\d)0 errors", summary[-1]), summary
    if tool_name == "racecheck":
        assert re.search(r"(?<!\d)0 hazards", summary[-1]), summary
    print(f"compute-sanitizer {tool_name}: {summary[-1].strip()} in {time.time() - start:.0f}s")
