"""benchmarks/fused_graphs.py without a GPU: its rows (ResNet-50's fused pieces and their counts), its bytes
model against counts made by hand, its figures and table; and every piece run end to end on the CPU against
stand-ins for the library's launchers, written in torch from what batchnorm.cu and the conv graphs compute,
so that each row's torch side, its checks and its pointer plumbing run: a stand-in that computes the right
thing passes every check, one that drops a term or leaves an output unwritten fails it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import fused_graphs as fg

# -- the bytes model, by hand ------------------------------------------------------------------------------
# A 3x3 conv, pad 1, stride 1, batch 2: x 2x4x4x4 = 128 values (256 bytes), w 8x4x3x3 = 288 (576 bytes),
# y 2x8x4x4 = 256 (512 bytes), the ReLU's mask bits of y: 256 / 8 = 32 bytes.
X, W, Y, BITS = 256, 576, 512, 32
BY_HAND = {
    ("conv_stats", None): (X + W + Y, X + W + Y),  # 1344 both: the statistics add no pass
    ("prologue_conv_stats", None): (1344, X + 2 * X + 2 * X + 1344),  # torch: bn stats, apply, relu_, conv: 2624
    ("output_pass", "identity"): (3 * Y + BITS, Y + 2 * Y + 3 * Y + 2 * Y),  # 1568 against 4096
    ("output_pass", "branch"): (1568, 4096 + 3 * Y),  # + the downsample's BatchNorm: 5632
    ("bn_backward", "relu"): (5 * Y, 3 * Y + 5 * Y),  # 2560 against 4096
    ("bn_backward", "last"): (2 * Y + BITS + 4 * Y + BITS, 4096),  # 3136: dz written too
    ("bn_backward", "last_down"): (5 * Y + 2 * BITS, 4096),  # 2624
    ("bn_backward", "branch"): (2624, 5 * Y),  # torch: the BatchNorm's backward alone, 2560
    ("prologue_wgrad", None): (X + Y + W, 1344),
    ("dgrad_residual", None): (Y + W + 2 * X, Y + W + X + 3 * X),  # 1600 against 2112
}


@pytest.mark.parametrize("key", list(BY_HAND))
def test_bytes_model_matches_the_counts_made_by_hand(key):
    got = fg.passes(*key, x=128, y=256, w=288)
    total = {s: sum(b for _, b in got[s]) for s in ("fused", "torch")}
    assert (total["fused"], total["torch"]) == BY_HAND[key]


def test_bytes_model_details():
    torch_side = fg.passes("prologue_conv_stats", None, x=128, y=256, w=288)["torch"]
    assert [name for name, _ in torch_side] == ["batch_norm statistics", "batch_norm apply", "relu_", "conv"]
    unfused = fg.passes("dgrad_residual", None, x=128, y=256, w=288, fused_graph=False)
    assert sum(b for _, b in unfused["fused"]) == 2112  # no dgrad + z graph: our dgrad and add pass, as torch's
    with pytest.raises(ValueError):
        fg.passes("bn_backward", "nope", x=1, y=8, w=1)
    with pytest.raises(ValueError):
        fg.passes("conv", None, x=1, y=8, w=1)


def test_figures_of_a_side():
    s = fg.side(2.0, [("a", 4_000_000), ("b", 2_700_000)], peak_tbps=3.35)
    assert s["bytes"] == 6_700_000 and s["GBps"] == 3350.0 and s["of_peak"] == 1.0 and s["passes"] == ["a", "b"]
    assert math.isnan(fg.side(float("nan"), [("a", 1)], peak_tbps=3.35)["GBps"])


# -- the rows: ResNet-50's pieces ---------------------------------------------------------------------------

def test_rows_cover_every_fused_conv_of_resnet50_once_per_piece():
    rows = fg.entries(batch=64)
    per_piece: dict[str, int] = {}
    for r in rows:
        per_piece[r["piece"]] = per_piece.get(r["piece"], 0) + r["count"]
        assert r["count"] == len(r["layers"])
    # 16 blocks: 16 first convs + 4 downsamples without a prologue, 32 second and third convs with it, 16 output
    # passes, a BatchNorm backward for each of the 52 convs, 12 identity blocks' first dgrads adding the residual's
    assert per_piece == {"conv_stats": 20, "prologue_conv_stats": 32, "prologue_wgrad": 32, "output_pass": 16,
                         "bn_backward": 52, "dgrad_residual": 12}
    assert len(rows) == 65
    relu56 = [r for r in rows if r["piece"] == "bn_backward" and r["y"] == (64, 64, 56, 56)]
    assert len(relu56) == 1 and relu56[0]["variant"] == "relu" and relu56[0]["count"] == 6
    assert relu56[0]["layers"][:2] == ["layer1.0.conv1", "layer1.0.conv2"]
    strided = [r for r in rows
               if r["piece"] == "prologue_conv_stats" and r["w"] == (128, 128, 3, 3) and r["stride"] == 2]
    assert len(strided) == 1 and strided[0]["x"] == (64, 128, 56, 56) and strided[0]["y"] == (64, 128, 28, 28)
    assert fg.numels(strided[0]) == {"x": 64 * 128 * 56 * 56, "y": 64 * 128 * 28 * 28, "w": 128 * 128 * 9}
    assert fg.numels(relu56[0]) == {"x": 0, "y": 64 * 64 * 56 * 56, "w": 0}
    assert fg.out_hw(5, 3, 2, 1) == 3 and fg.out_hw(56, 1, 2, 0) == 28 and fg.out_hw(14, 3, 1, 1) == 14


def test_layers_keeps_the_first_convs():
    rows = fg.entries(batch=2, layers=4)  # layer1.0: conv1, conv2, conv3, downsample
    assert {n for r in rows for n in r["layers"]} == {"layer1.0.conv1", "layer1.0.conv2", "layer1.0.conv3",
                                                       "layer1.0.downsample"}
    assert [(r["piece"], r["variant"]) for r in rows] == [
        ("conv_stats", None), ("bn_backward", "relu"), ("prologue_conv_stats", None), ("prologue_wgrad", None),
        ("prologue_conv_stats", None), ("prologue_wgrad", None), ("output_pass", "branch"),
        ("bn_backward", "last_down"), ("conv_stats", None), ("bn_backward", "branch")]
    assert rows[1]["count"] == 2  # conv1's and conv2's outputs: 64x56x56 both


def _result() -> dict:
    def sides(torch_us, fused_us):
        return {"torch": fg.side(torch_us, [("t", 3_350_000)], peak_tbps=3.35),
                "fused": fg.side(fused_us, [("f", 1_675_000)], peak_tbps=3.35)}

    rows = [{**fg.row_base(e), **sides(10.0, 4.0), "speedup": 2.5, "rel_err": {"y": 1e-3}, "max_rel_err": 1e-3,
             "check": "ok"} for e in fg.entries(batch=2, layers=1)]
    rows.append({**fg.row_base(fg.entries(batch=2, layers=2)[2]), "error": "UnsupportedGraphError: declined"})
    return {"device": "X", "torch": "t", "rows": rows, "totals": fg.totals(rows)}


def test_totals_table_and_table_from(tmp_path, capsys):
    result = _result()
    # layer1.0.conv1 at batch 2: conv_stats once, the relu BatchNorm backward once (counts of that layer alone)
    assert result["totals"]["all"] == {"torch_ms": 0.02, "fused_ms": 0.008, "torch_gb": 0.007, "fused_gb": 0.003,
                                       "speedup": 2.5}
    assert list(result["totals"]) == ["conv_stats", "bn_backward", "all"]
    table = fg.markdown(result)
    assert "| conv_stats | 64x56x56 -> 64 1x1 | layer1.0.conv1 (1) | 10.0 | 4.0 | 2.50x | 3.4 MB, 0.34 TB/s (10 %) " \
           "| 1.7 MB, 0.42 TB/s (12 %) | 1.0e-03 |" in table
    assert "| prologue_conv_stats | 64x56x56 -> 64 3x3 | layer1.0.conv2 (1) | | | | | | UnsupportedGraphError" in table
    assert "| all | 0.02 | 0.01 | 2.50x | 0.01 | 0.00 |" in table
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert fg.main(["--table-from", str(path)]) == 0
    assert table in capsys.readouterr().out


# -- every piece on the CPU, against stand-ins for the library's launchers ---------------------------------

class Pointers:
    """_p's stand-in: each tensor handed to a launcher by pointer, found again by it."""

    def __init__(self):
        self.live: dict = {}

    def __call__(self, t) -> int:
        if t is None:
            return 0
        self.live[t.data_ptr()] = t
        return t.data_ptr()

    def __getitem__(self, ptr: int):
        return self.live[ptr]


def _chan(t, ptr):
    return t[ptr].float().view(1, -1, 1, 1)


def _pack(mask, torch):
    """batchnorm.cu's bits: value 8i + j of memory (NHWC) order is bit j of byte i."""
    flat = mask.permute(0, 2, 3, 1).reshape(-1, 8).int()
    return (flat << torch.arange(8)).sum(1).to(torch.uint8)


def _unpack(bits, shape, torch):
    n, c, h, w = shape
    return ((bits.view(-1, 1).int() >> torch.arange(8)) & 1).bool().reshape(n, h, w, c).permute(0, 3, 1, 2)


class StandInKernels:
    """BatchNormKernels' launches in torch, from batchnorm.cu; `broken` names a term one of them drops."""

    partials_bytes, tiles, bits = 64, 4, True

    def __init__(self, t: Pointers, shape, broken: str):
        self.t, self.shape, self.broken = t, tuple(shape), broken
        self.rows, self.bits_bytes = math.prod(shape) // shape[1], math.prod(shape) // 8

    def finalize(self, stream, *, sum, sq_sum, gamma, beta, running_mean, running_var, num_batches, scale, shift,
                 mean, invstd, eps, momentum):
        t = self.t
        m = t[sum].double() / self.rows
        inv = ((t[sq_sum].double() / self.rows - m * m).clamp_min(0) + eps).rsqrt().float()
        s = (t[gamma] * inv).half()
        t[scale].copy_(s)
        t[shift].copy_((t[beta] - m.float() * s.float()).half())
        t[mean].copy_(m.float())
        t[invstd].copy_(inv)

    def apply(self, stream, *, y, scale, shift, out, relu, residual=0, scale2=0, shift2=0, bits=0):
        import torch

        t = self.t
        v = t[y].float() * _chan(t, scale) + _chan(t, shift)
        if residual and self.broken != "residual":
            r = t[residual].float()
            v = v + (r * _chan(t, scale2) + _chan(t, shift2) if scale2 else r)
        o = (v.clamp_min(0) if relu else v).half()
        t[out].copy_(o)
        if bits:
            t[bits].copy_(_pack(o > 0, torch))

    def add(self, stream, *, a, b, out):
        self.t[out].copy_((self.t[a].float() + self.t[b].float()).half())

    def backward(self, stream, *, da, y, out, scale, shift, gamma, mean, invstd, partials, coef, dgamma, dbeta, dy,
                 relu, counters, dz=0, bits=0):
        import torch

        t = self.t
        yv, g = t[y].float(), t[da].float()
        if relu and self.broken != "mask":
            keep = _unpack(t[bits], self.shape, torch) if bits else t[out].float() > 0 if out \
                else yv * _chan(t, scale) + _chan(t, shift) > 0
            g = g * keep
        xc, inv = yv - _chan(t, mean), _chan(t, invstd)
        db, dg = g.sum((0, 2, 3)), (g * xc).sum((0, 2, 3)) * inv.flatten()
        t[dgamma].copy_(dg)
        t[dbeta].copy_(db)
        t[dy].copy_((_chan(t, gamma) * inv * (g - db.view(1, -1, 1, 1) / self.rows
                                               - xc * inv * dg.view(1, -1, 1, 1) / self.rows)).half())
        if dz:
            t[dz].copy_(g.half())


class _Run:
    def __init__(self, fn):
        self.run = lambda ptrs, stream: fn(*ptrs)


class StandInStage:
    """_StagePlan's launchers in torch: the conv + statistics graph, the wgrad, the dgrad (+ z)."""

    def __init__(self, t: Pointers, e: dict, prologue: bool, residual_grad: bool, broken: str):
        self.t, self.e, self.prologue, self.broken = t, e, prologue, broken
        self.bn = StandInKernels(t, e["y"], broken)
        self.dgrad_adds = residual_grad and broken != "no_dgrad_add"
        self.fwd, self.wgrad, self.dgrad = _Run(self._fwd), _Run(self._wgrad), _Run(self._dgrad)

    def _input(self, x, pro):
        if not self.prologue:
            return self.t[x]
        t = self.t
        return (t[x].float() * _chan(t, pro[0]) + _chan(t, pro[1])).clamp_min(0).half()

    def _conv(self, mask, dy, a, w):
        import torch

        e = self.e
        return torch.ops.aten.convolution_backward(dy, a, w, None, [e["stride"]] * 2, [e["pad"]] * 2, [1, 1], False,
                                                   [0, 0], 1, mask)

    def _fwd(self, x, *rest):
        import torch.nn.functional as F

        pro, (w, y, sm, sq) = rest[:-4], rest[-4:]
        t = self.t
        out = F.conv2d(self._input(x, pro), t[w], stride=self.e["stride"], padding=self.e["pad"])
        if self.broken != "unwritten":
            t[y].copy_(out)
        t[sm].copy_(out.float().sum((0, 2, 3)))
        t[sq].copy_((out.float() ** 2).sum((0, 2, 3)))

    def _wgrad(self, x, *rest):
        import torch

        pro, (dy, dw) = rest[:-2], rest[-2:]
        w = torch.empty(self.e["w"], dtype=torch.float16)
        self.t[dw].copy_(self._conv([False, True, False], self.t[dy], self._input(x, pro), w)[1])

    def _dgrad(self, dy, w, *rest):
        import torch

        x = torch.empty(self.e["x"], dtype=torch.float16)
        dx = self._conv([True, False, False], self.t[dy], x, self.t[w])[0]
        if len(rest) == 2:  # dy, w, z, dx
            dx = (dx.float() + self.t[rest[0]].float()).half()
        self.t[rest[-1]].copy_(dx)


class StandInBench(fg.Bench):
    def __init__(self, t: Pointers, broken: str = ""):
        self.t, self.broken, self.stream = t, broken, 0

    def stage(self, e, *, prologue, residual_grad=False):
        return StandInStage(self.t, e, prologue, residual_grad, self.broken)

    def kernels(self, shape):
        return StandInKernels(self.t, shape, self.broken)


CONV = {"x": (4, 16, 16, 16), "w": (32, 16, 3, 3), "y": (4, 32, 8, 8), "stride": 2, "pad": 1}
BN = {"x": None, "w": None, "y": (4, 32, 16, 16), "stride": None, "pad": None}
CASES = [("conv_stats", None, CONV), ("prologue_conv_stats", None, CONV), ("prologue_wgrad", None, CONV),
         ("dgrad_residual", None, {**CONV, "y": (4, 16, 16, 16), "w": (16, 16, 3, 3), "stride": 1}),
         ("output_pass", "identity", BN), ("output_pass", "branch", BN), ("bn_backward", "relu", BN),
         ("bn_backward", "last", BN), ("bn_backward", "last_down", BN), ("bn_backward", "branch", BN)]


def _check(monkeypatch, piece, variant, geometry, broken=""):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    t = Pointers()
    monkeypatch.setattr(fg, "DEVICE", "cpu")
    monkeypatch.setattr(fg, "_p", t)
    e = {"piece": piece, "variant": variant, **geometry, "layers": ["l"], "count": 1}
    with torch.no_grad():
        fused, theirs, check, info = fg.BUILDERS[piece](StandInBench(t, broken), e, variant)
        return check(), info, (fused, theirs)


@pytest.mark.parametrize("piece, variant, geometry", CASES, ids=[f"{p}-{v}" for p, v, _ in CASES])
def test_each_piece_checks_out_against_a_right_stand_in(monkeypatch, piece, variant, geometry):
    errors, info, (fused, theirs) = _check(monkeypatch, piece, variant, geometry)
    assert errors and max(errors.values()) < fg.TOLERANCE, errors
    if piece == "dgrad_residual":
        assert info == {"fused_graph": True}
    fused()  # both sides run again (the timed calls)
    theirs()


@pytest.mark.parametrize("piece, variant, geometry, broken, output", [
    ("output_pass", "identity", BN, "residual", "out"),
    ("output_pass", "branch", BN, "residual", "out"),
    ("bn_backward", "relu", BN, "mask", "dy"),
    ("bn_backward", "last", BN, "mask", "dz"),
    ("bn_backward", "branch", BN, "mask", "dbeta"),
    ("conv_stats", None, CONV, "unwritten", "y"),
    ("prologue_conv_stats", None, CONV, "unwritten", "y"),
])
def test_a_wrong_stand_in_fails_the_check(monkeypatch, piece, variant, geometry, broken, output):
    errors, _, _ = _check(monkeypatch, piece, variant, geometry, broken)
    assert errors[output] > fg.TOLERANCE, errors


def test_dgrad_residual_without_the_fused_graph_runs_our_add(monkeypatch):
    geometry = {**CONV, "y": (4, 16, 16, 16), "w": (16, 16, 3, 3), "stride": 1}
    errors, info, _ = _check(monkeypatch, "dgrad_residual", None, geometry, "no_dgrad_add")
    assert info == {"fused_graph": False} and errors["dx"] < fg.TOLERANCE
