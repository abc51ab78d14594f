"""conv -> BatchNorm -> ReLU runs as one fused node: output, every gradient, the running statistics and
num_batches_tracked against torch's modules in float64; the fused path must have run."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from cudnn_graphs.torch._chain import Chain, Stage  # noqa: E402

from .gpu_reference import queued_calls, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last
# Relative L2 error against float64 allowed beyond torch's own (its modules in the same dtype / AMP):
# a ReLU mask decided on fp16 values flips where the float64 pre-activation is within rounding of 0, and
# each flip moves a gradient element by its whole value, so gradients carry a few % against float64 for
# torch too. Ours must stay within twice torch's error plus this.
SLACK = 5e-3
# BatchNorm parameter gradients of a stage whose ReLU is the next conv's prologue: cuDNN reads scale and
# shift as float16 there (it declines float32 operands: tools/probe_bn_fusions.py), so the mask is decided
# on relu(y * scale16 + shift16), and elements within that rounding of 0 flip against float64 more often
# than torch's (which normalises in float32). Measured 1.3e-2 against torch's 2.6e-3 (H200, 8x40x16x16).
# The output pass normalises the last stage and a downsample branch with the same float16 coefficients:
# the branch's BatchNorm weight measured 1.85e-2 against torch's 4.3e-3 (H100, 8x64x16x16, stride 2).
PROLOGUE_SLACK = 2e-2


class Block(nn.Module):
    """A bottleneck body: 1x1 -> 3x3 (stride) -> 1x1, BatchNorm after each, ReLU between; then
    [+ residual] [-> ReLU]."""

    def __init__(self, c=64, mid=32, k=64, stride=1, bn_kwargs=None, final_relu=True, kernels=(1, 3, 1)):
        super().__init__()
        bn_kwargs = bn_kwargs or {}
        chans = [c, mid, mid, k]
        self.convs = nn.ModuleList(
            nn.Conv2d(chans[i], chans[i + 1], r, stride=stride if r == 3 else 1, padding=r // 2, bias=False)
            for i, r in enumerate(kernels))
        self.bns = nn.ModuleList(nn.BatchNorm2d(chans[i + 1], **bn_kwargs) for i in range(3))
        self.final_relu = final_relu
        for bn in self.bns:
            if bn.weight is not None:
                nn.init.uniform_(bn.weight, 0.5, 1.5)
                nn.init.uniform_(bn.bias, -0.5, 0.5)

    def forward(self, x, residual=None):
        for i in range(3):
            x = self.bns[i](self.convs[i](x))
            if i < 2:
                x = torch.relu(x)
        if residual is not None:
            x = x + residual
        return torch.relu(x) if self.final_relu else x

    def chain(self) -> Chain:
        stages = [Stage(self.convs[i], self.bns[i], relu=i < 2) for i in range(3)]
        return Chain(stages, final_relu=self.final_relu)


class DownsampleBlock(Block):
    """A bottleneck body whose residual is its downsample, conv 1x1 (stride) -> BatchNorm, of the input:
    torchvision's first block of a stage."""

    def __init__(self, c=64, mid=32, k=128, stride=2, final_relu=True, bn_kwargs=None):
        super().__init__(c=c, mid=mid, k=k, stride=stride, final_relu=final_relu, bn_kwargs=bn_kwargs)
        self.downsample = nn.Sequential(nn.Conv2d(c, k, 1, stride=stride, bias=False),
                                        nn.BatchNorm2d(k, **(bn_kwargs or {})))
        if self.downsample[1].weight is not None:
            nn.init.uniform_(self.downsample[1].weight, 0.5, 1.5)
            nn.init.uniform_(self.downsample[1].bias, -0.5, 0.5)

    def forward(self, x, residual=None):
        return super().forward(x, self.downsample(x))

    def chain(self) -> Chain:
        stages = [Stage(self.convs[i], self.bns[i], relu=i < 2) for i in range(3)]
        return Chain(stages, final_relu=self.final_relu, branch=Stage(*self.downsample, relu=False),
                     branch_module=self.downsample)


def rel(a, b):
    return rel_err(a.detach(), b.detach().double())


def close(ours, torch_, ref, what, slack=SLACK):
    mine, theirs = rel(ours, ref), rel(torch_, ref)
    assert mine <= 2 * theirs + slack, f"{what}: ours {mine:.2e} against float64, torch's {theirs:.2e}"


def parameters_and_buffers_close(ours, theirs, ref):
    """Every parameter's gradient and every buffer of `ours` against float64 `ref`, beside torch's `theirs`
    (num_batches_tracked exactly); then every gradient zeroed for the next step."""
    for (name, p), (_, t), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        close(p.grad, t.grad, q.grad, name, PROLOGUE_SLACK if name.startswith(("bns.", "downsample.1.")) else SLACK)
    for (name, b), (_, t), (_, q) in zip(ours.named_buffers(), theirs.named_buffers(), ref.named_buffers()):
        if b.dtype == torch.int64:
            assert torch.equal(b, q), name
        else:
            close(b, t, q, name)
    for m in (ours, theirs, ref):
        m.zero_grad()


def _run(block, chain, x, r, g, autocast):
    """r: a residual tensor, None, or "input": the input itself (a block's identity: x gets both gradients)."""
    xs = x.detach().clone().requires_grad_(True)
    rs = xs if r == "input" else None if r is None else r.detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
        out = chain(xs, rs) if chain is not None else block(xs, rs)
    out.backward(g)
    return out, xs.grad, None if rs is None or rs is xs else rs.grad


CASES = {
    "plain": dict(),
    "residual": dict(residual=True),
    "residual-strided": dict(residual=True, stride=2, k=64),
    "no-final-relu": dict(final_relu=False),
    "momentum-none": dict(bn_kwargs=dict(momentum=None)),
    "no-affine": dict(bn_kwargs=dict(affine=False)),
    "no-running-stats": dict(bn_kwargs=dict(track_running_stats=False)),
    "eps-momentum": dict(bn_kwargs=dict(eps=1e-3, momentum=0.3)),
    "odd-channels": dict(c=24, mid=40, k=24, residual=True),
    "residual-is-input": dict(residual="input"),  # torchvision's identity: the dgrad adds dz in its epilogue
    "residual-is-input-odd": dict(c=24, mid=40, k=24, residual="input"),
}


@pytest.mark.parametrize("autocast", [True, False], ids=["amp-fp32-params", "fp16-model"])
@pytest.mark.parametrize("name", list(CASES))
def test_chain_matches_torch_in_float64(name, autocast):
    case = dict(CASES[name])
    residual = case.pop("residual", False)
    stride = case.get("stride", 1)
    torch.manual_seed(0)
    block = Block(**case).cuda().to(memory_format=CL)
    if not autocast:
        block = block.half()
    ref = copy.deepcopy(block).double()
    ours, theirs = copy.deepcopy(block), copy.deepcopy(block)
    chain = ours.chain()
    n, c, hw = 8, block.convs[0].in_channels, 16
    dtype = torch.float32 if autocast else torch.float16
    for step in range(2):  # a second step: running statistics and num_batches_tracked move on
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=dtype).to(memory_format=CL)
        k, o = block.convs[2].out_channels, hw // stride
        r = torch.randn(n, k, o, o, device="cuda", dtype=dtype).to(memory_format=CL) if residual else None
        r = "input" if residual == "input" else r
        g = torch.randn(n, k, o, o, device="cuda", dtype=dtype).to(memory_format=CL)
        out, dx, dr = _run(ours, chain, x, r, g, autocast)
        t_out, t_dx, t_dr = _run(theirs, None, x, r, g, autocast)
        ref_r = r if r is None or r == "input" else r.double()
        ref_out, ref_dx, ref_dr = _run(ref, None, x.double(), ref_r, g.double(), False)
        # AMP (float32 parameters) runs fused; a .half() model's float16 BatchNorm parameters run torch's
        assert (chain.status() == "fused") == autocast, chain.status()
        assert out.dtype == t_out.dtype and out.is_contiguous(memory_format=CL)
        assert dx.dtype == x.dtype
        close(out, t_out, ref_out, "output")
        close(dx, t_dx, ref_dx, "input gradient")
        if residual is True:
            close(dr, t_dr, ref_dr, "residual gradient")
        if residual == "input" and autocast:  # the one node sums x's gradients
            program, = chain._plans.values()
            assert program is not None and program.shared
        parameters_and_buffers_close(ours, theirs, ref)


def test_an_identity_residual_without_the_one_graph_dgrad_sums_through_our_add(monkeypatch):
    """Where cuDNN plans no one-graph dgrad + z, the plain dgrad and our add pass sum x's two gradients."""
    from cudnn_graphs.torch import _chain

    monkeypatch.setattr(_chain._StagePlan, "_dgrad_adding", lambda self, *args: None)
    torch.manual_seed(5)
    block = Block().cuda().to(memory_format=CL)
    ref = copy.deepcopy(block).double()
    ours, theirs = copy.deepcopy(block), copy.deepcopy(block)
    chain = ours.chain()
    x = torch.randn(8, 64, 16, 16, device="cuda").to(memory_format=CL)
    g = torch.randn(8, 64, 16, 16, device="cuda").to(memory_format=CL)
    out, dx, _ = _run(ours, chain, x, "input", g, True)
    t_out, t_dx, _ = _run(theirs, None, x, "input", g, True)
    ref_out, ref_dx, _ = _run(ref, None, x.double(), "input", g.double(), False)
    program, = chain._plans.values()
    assert program is not None and program.shared, chain.status()
    assert not program.plans[0].dgrad_adds and program.add is not None
    close(out, t_out, ref_out, "output")
    close(dx, t_dx, ref_dx, "input gradient")
    parameters_and_buffers_close(ours, theirs, ref)


BRANCH_CASES = {
    "strided": dict(),
    "stride-1": dict(stride=1),
    "no-final-relu": dict(final_relu=False),
    "no-affine": dict(bn_kwargs=dict(affine=False)),
    "odd-channels": dict(c=24, mid=40, k=56),
}


@pytest.mark.parametrize("name", list(BRANCH_CASES))
def test_chain_with_a_downsample_branch_matches_torch_in_float64(name):
    """The downsample conv -> BatchNorm inside the node: output, input gradient (two paths added), every
    parameter gradient and running statistic of the block and its downsample against float64."""
    torch.manual_seed(4)
    block = DownsampleBlock(**BRANCH_CASES[name]).cuda().to(memory_format=CL)
    ref = copy.deepcopy(block).double()
    ours, theirs = copy.deepcopy(block), copy.deepcopy(block)
    chain = ours.chain()
    c = block.convs[0].in_channels
    for step in range(2):
        x = torch.randn(8, c, 16, 16, device="cuda").to(memory_format=CL)
        y = block(x)  # the output's shape
        g = torch.randn(y.shape, device="cuda", dtype=torch.float16).to(memory_format=CL)
        out, dx, _ = _run(ours, chain, x, None, g, True)
        t_out, t_dx, _ = _run(theirs, None, x, None, g, True)
        ref_out, ref_dx, _ = _run(ref, None, x.double(), None, g.double(), False)
        assert chain.status() == "fused", chain.status()
        close(out, t_out, ref_out, "output")
        close(dx, t_dx, ref_dx, "input gradient")
        parameters_and_buffers_close(ours, theirs, ref)


def test_a_sequential_run_of_more_weights_than_one_cast_takes():
    """Five conv -> BatchNorm -> ReLU slots in an nn.Sequential under AMP: five float32 weights cast to
    float16 (and their gradients back) by more than one launch (a launch casts four)."""
    import cudnn_graphs.torch as cgt

    torch.manual_seed(5)
    slots = [m for _ in range(5) for m in (nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())]
    theirs = nn.Sequential(*slots).cuda().to(memory_format=CL)
    ref = copy.deepcopy(theirs).double()
    ours = cgt.convert(copy.deepcopy(theirs))
    (where, chain), = ours.cudnn_graphs_report.chains
    assert len(chain.stages) == 5
    x = torch.randn(4, 32, 12, 12, device="cuda").to(memory_format=CL)
    g = torch.randn(4, 32, 12, 12, device="cuda", dtype=torch.float16).to(memory_format=CL)


    def run(model, x, g, amp):
        xs = x.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            out = model(xs)
        out.backward(g)
        return out, xs.grad

    got = run(ours, x, g, True)
    assert chain.status() == "fused", chain.status()
    want, exact = run(theirs, x, g, True), run(ref, x.double(), g.double(), False)
    close(got[0], want[0], exact[0], "output")
    close(got[1], want[1], exact[1], "input gradient")
    for (name, p), (_, t), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), ref.named_parameters()):
        close(p.grad, t.grad, q.grad, name, PROLOGUE_SLACK)


def test_chain_is_deterministic_and_never_synchronises():
    torch.manual_seed(1)
    block = Block(c=64, mid=64, k=64).cuda().half().to(memory_format=CL)
    for bn in block.bns:
        bn.float()  # float32 BatchNorm parameters beside float16 convs: the fused path's case
    x = torch.randn(16, 64, 28, 28, device="cuda", dtype=torch.float16).to(memory_format=CL)
    g = torch.randn_like(x)
    results = []
    torch.use_deterministic_algorithms(True)  # our ordered statistics in place of cuDNN's genstats
    try:
        for _ in range(2):
            b = copy.deepcopy(block)
            chain = b.chain()
            out, dx, _ = _run(b, chain, x, x, g, False)
            assert chain.status() == "fused", chain.status()
            results.append([out, dx] + [p.grad for p in b.parameters()])
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # warm, then a call behind a queued sleep returns before the sleep ends
    b = copy.deepcopy(block)
    chain = b.chain()
    _run(b, chain, x, x, g, False)
    torch.cuda.synchronize()
    host_s, busy, per_call = queued_calls(lambda: _run(b, chain, x, x, g, False), 3)
    assert busy and host_s < 0.5, per_call


def test_eval_mode_and_cpu_run_the_modules():
    block = Block().cuda().half().to(memory_format=CL).eval()
    chain = block.chain()
    x = torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.float16).to(memory_format=CL)
    with torch.no_grad():
        assert torch.equal(chain(x), block(x))
    assert not chain._plans  # eval never plans


def _offset_view(n, c, h, w):
    """A channels-last float16 tensor whose data starts 2 bytes past an allocation: misaligned."""
    flat = torch.randn(n * c * h * w + 8, device="cuda", dtype=torch.float16)[1:1 + n * c * h * w]
    return flat.view(n, h, w, c).permute(0, 3, 1, 2)


def test_misaligned_views_are_copied_not_misread():
    torch.manual_seed(2)
    block = Block(c=64, mid=32, k=64).cuda().half().to(memory_format=CL)
    with torch.no_grad():
        for bn in block.bns:
            bn.float()  # float32 BatchNorm parameters: the fused path's (AMP's) case
    ours, theirs, ref = copy.deepcopy(block), copy.deepcopy(block), copy.deepcopy(block).double()
    chain = ours.chain()
    x, r, g = _offset_view(4, 64, 12, 12), _offset_view(4, 64, 12, 12), _offset_view(4, 64, 12, 12)
    assert x.data_ptr() % 16 and x.is_contiguous(memory_format=CL)
    got = _run(ours, chain, x, r, g, False)
    assert chain.status() == "fused", chain.status()
    torch_ = _run(theirs, None, x, r, g, False)
    want = _run(ref, None, x.double(), r.double(), g.double(), False)
    for what, a, b, c in zip(("output", "input gradient", "residual gradient"), got, torch_, want):
        close(a, b, c, what)


REPLAY_CASES = {
    "residual": dict(),
    "downsample": dict(branch=True),
    "no-residual": dict(residual=False),        # the output pass's residual pointer is null
    "no-affine": dict(bn_kwargs=dict(affine=False)),  # no gamma, no dgamma / dbeta
    "no-input-grad": dict(input_grad=False),    # no dgrad of the first stage
    "residual-is-input": dict(residual="input"),  # x's two gradients summed in the node
    "residual-is-input-no-input-grad": dict(residual="input", input_grad=False),  # no dz, no dgrad
}


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_replayed_calls_equal_direct_ones_bit_for_bit(name):
    """From its second call a run replays one re-pointed graph forward and one backward, whichever pointers
    are null (a moved recording makes every pointer nonzero: the launches must not follow their values);
    the results of a replay (with new buffers) equal the first, direct call's exactly."""
    case = dict(REPLAY_CASES[name])
    branch, residual = case.pop("branch", False), case.pop("residual", True)
    input_grad = case.pop("input_grad", True)
    torch.manual_seed(3)
    block = DownsampleBlock(c=64, mid=32, k=64, stride=1) if branch else Block(c=64, mid=32, k=64, **case)
    block = block.cuda().to(memory_format=CL)
    chain = block.chain()
    x = torch.randn(8, 64, 16, 16, device="cuda").to(memory_format=CL)
    g = torch.randn(8, 64, 16, 16, device="cuda", dtype=torch.float16).to(memory_format=CL)
    r = x.detach().clone() if residual and not branch else None
    results = []
    torch.use_deterministic_algorithms(True)  # deterministic plans: any difference is the replay's
    try:
        for _ in range(4):
            xs = x.detach().clone().requires_grad_(input_grad)
            rs = xs if residual == "input" else None if r is None else r.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = chain(xs, rs)
            out.backward(g)
            got = {"out": out, "dx": xs.grad, "dres": None if rs is None else rs.grad}
            got.update((n, p.grad.clone()) for n, p in block.named_parameters())
            results.append({k: v for k, v in got.items() if v is not None})
            block.zero_grad()
    finally:
        torch.use_deterministic_algorithms(False)
    assert ("dx" in results[0]) == input_grad
    program, = chain._plans.values()
    assert program is not None, chain.status()
    assert program.forward.replays >= 2 and sum(r.replays for r in program.backward.values()) >= 2
    for n, later in enumerate(results[1:], start=1):
        differ = [(k, float((results[0][k].double() - v.double()).abs().max())) for k, v in later.items()
                  if not torch.equal(results[0][k], v)]
        assert not differ, f"call {n} against the first: {differ}"
