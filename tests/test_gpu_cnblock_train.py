"""torchvision's CNBlock in AMP training as one autograd node (`_cnblock_train`): its output and every
gradient against float64 next to torch's own AMP block, with stochastic depth drawing the same noise as
torch's, float16 and float32 inputs, odd maps; backward twice and run to run; the calls it declines; saved
memory, checkpointing, replayed launches; convnext_tiny's AMP steps and a small ConvNeXt's 300-step loss
curve against torch's."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
nn = torch.nn

import cudnn_graphs.torch as cgt  # noqa: E402
from cudnn_graphs.torch import _cnblock_train  # noqa: E402
from torchvision.models.convnext import CNBlock  # noqa: E402

from .gpu_reference import rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
CL = torch.channels_last


class _Noise(nn.Module):
    """Stochastic depth with a given noise: the float64 reference's, drawn as torch's block draws it."""

    def __init__(self, noise):
        super().__init__()
        self.noise = noise

    def forward(self, x):
        return x * self.noise.to(x.dtype)


def _block(dim, p, mode, seed=0):
    torch.manual_seed(seed)
    block = CNBlock(dim, layer_scale=0.5, stochastic_depth_prob=p)
    block.stochastic_depth.mode = mode
    for q in block.parameters():
        q.data.add_(torch.randn_like(q) * 0.2)
    return block.cuda().to(memory_format=CL).train()


def _draw(n, p, mode, seed):
    """The noise torchvision's block draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    if p == 0.0:
        return None
    noise = torch.empty([n if mode == "row" else 1, 1, 1, 1], device="cuda").bernoulli_(1 - p)
    return noise.div_(1 - p) if p < 1 else noise


def _step(model, x, dy, seed):
    torch.manual_seed(seed)
    xi = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(xi)
    grads = torch.autograd.grad(out, (xi, *model.parameters()), dy)
    return out, grads


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("dim,h,w,p,mode", [(96, 14, 14, 0.0, "row"), (96, 14, 14, 0.5, "row"),
                                            (40, 9, 11, 0.3, "batch"), (192, 7, 7, 0.5, "row"),
                                            (8, 5, 3, 0.0, "row"), (32, 6, 6, 1.0, "row")])
def test_the_node_matches_float64_as_closely_as_torchs_amp_block(x_dtype, dim, h, w, p, mode):
    block = _block(dim, p, mode)
    ours = cgt.convert(nn.Sequential(copy.deepcopy(block)))
    torch.manual_seed(1)
    n = 4
    x = torch.randn(n, dim, h, w, device="cuda").to(x_dtype).to(memory_format=CL)
    dy = torch.randn(n, dim, h, w, device="cuda").to(memory_format=CL)
    got, got_g = _step(ours, x, dy, seed=7)
    assert type(got.grad_fn).__name__ == "CNBlockFunctionBackward"
    theirs, theirs_g = _step(block, x, dy, seed=7)
    assert got.dtype == theirs.dtype == torch.float32 and got.is_contiguous(memory_format=CL)
    ref = copy.deepcopy(block).double()
    noise = _draw(n, p, mode, seed=7)
    ref.stochastic_depth = nn.Identity() if noise is None else _Noise(noise)
    xd = x.detach().double().requires_grad_()
    out = ref(xd)
    want = (out, torch.autograd.grad(out, (xd, *ref.parameters()), dy.double()))
    assert rel_err(got, want[0]) < 2 * rel_err(theirs, want[0]) + 1e-4
    names = ["x"] + [name for name, _ in ref.named_parameters()]
    for name, g, t, wd in zip(names, got_g, theirs_g, want[1]):
        assert g.shape == wd.shape and (name != "x" or g.dtype == x_dtype), name
        assert rel_err(g, wd) < 2 * rel_err(t, wd) + 2e-3, name


def test_backward_twice_and_run_to_run_are_bit_identical():
    block = _block(96, 0.5, "row")
    model = cgt.convert(nn.Sequential(block))
    x = torch.randn(2, 96, 14, 14, device="cuda", dtype=torch.float16).to(memory_format=CL).requires_grad_()
    dy = torch.randn(2, 96, 14, 14, device="cuda").to(memory_format=CL)
    params = list(model.parameters())
    runs = []
    for _ in range(2):
        torch.manual_seed(5)  # the same noise both runs
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        assert type(out.grad_fn).__name__ == "CNBlockFunctionBackward"
        first = torch.autograd.grad(out, params, dy, retain_graph=True)
        second = torch.autograd.grad(out, params, dy)
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        runs.append(first)
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # the parameters' sums: a fixed order


def test_calls_it_does_not_take_run_torchs_block():
    block = _block(64, 0.2, "row")
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)))
    x = torch.randn(2, 64, 8, 8, device="cuda").to(memory_format=CL).requires_grad_()

    def node(**autocast):
        with torch.autocast("cuda", **autocast):
            return type(model(x).grad_fn).__name__ == "CNBlockFunctionBackward"

    assert node(dtype=torch.float16)
    assert not node(dtype=torch.bfloat16)  # bf16: torch's block
    assert not node(enabled=False)
    xc = x.detach().contiguous().requires_grad_()  # NCHW in memory
    with torch.autocast("cuda", dtype=torch.float16):
        assert type(model(xc).grad_fn).__name__ != "CNBlockFunctionBackward"
        with torch.no_grad():  # no gradient: the eval path's launches or torch's, never the node
            assert model(x).grad_fn is None
    handle = model[0].block[2].register_forward_hook(lambda *a: None)
    assert not node(dtype=torch.float16)  # a hook on a module inside: the modules compute
    handle.remove()
    assert node(dtype=torch.float16)


def test_convnext_tiny_amp_training_tracks_torch():
    torch.manual_seed(0)
    base = torchvision.models.convnext_tiny(num_classes=10).cuda().to(memory_format=CL)
    model = cgt.convert(copy.deepcopy(base))
    x = torch.randn(8, 3, 64, 64, device="cuda").to(memory_format=CL)
    target = torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):  # stage 1's first block (no stochastic depth: no draw)
        assert type(model.features[1][0](model.features[0](x)).grad_fn).__name__ == "CNBlockFunctionBackward"
    losses = []
    for m in (model, base):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler()
        torch.manual_seed(3)  # stochastic depth's draws: the same sequence on both sides
        run = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.float16):
                out = m(x)
                loss = nn.functional.cross_entropy(out.float(), target)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            run.append(loss.item())
        losses.append(run)
    ours, theirs = losses
    assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(ours, theirs)), (ours, theirs)
    assert ours[-1] < ours[0]


def test_frozen_parameters_and_an_input_without_a_gradient():
    block = _block(96, 0.0, "row")
    for q in (block.layer_scale, block.block[0].weight, block.block[3].bias):
        q.requires_grad_(False)
    ours = cgt.convert(nn.Sequential(copy.deepcopy(block)))
    x = torch.randn(2, 96, 10, 10, device="cuda", dtype=torch.float16).to(memory_format=CL)
    dy = torch.randn(2, 96, 10, 10, device="cuda").to(memory_format=CL)
    grads, nodes = [], []
    for m in (ours, block):
        with torch.autocast("cuda", dtype=torch.float16):
            out = m(x)  # x wants no gradient: the parameters' still flow
        nodes.append(type(out.grad_fn).__name__)
        out.backward(dy)
        grads.append([(n, p.grad) for n, p in m.named_parameters()])
    assert nodes[0] == "CNBlockFunctionBackward" != nodes[1]
    for (name, got), (_, theirs) in zip(*grads):
        if theirs is None:
            assert got is None, name
        else:
            assert rel_err(got, theirs) < 1e-2, name


def test_checkpointed_blocks_recompute_the_same_noise_and_gradients():
    from torch.utils.checkpoint import checkpoint

    block = _block(64, 0.5, "row")
    model = cgt.convert(nn.Sequential(block))
    x = torch.randn(8, 64, 8, 8, device="cuda").to(memory_format=CL)
    dy = torch.randn(8, 64, 8, 8, device="cuda").to(memory_format=CL)
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(11)
        xi = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.float16):
            out = checkpoint(model, xi, use_reentrant=False) if ckpt else model(xi)
        if not ckpt:
            assert type(out.grad_fn).__name__ == "CNBlockFunctionBackward"
        grads = torch.autograd.grad(out, (xi, *model.parameters()), dy)
        runs.append((out, grads))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(ga, gb))


def test_saved_activations_go_with_backward_while_the_output_lives_and_eval_draws_no_noise():
    block = _block(96, 0.5, "row")
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)))
    x = torch.randn(8, 96, 14, 14, device="cuda").to(memory_format=CL)
    dy = torch.randn(8, 96, 14, 14, device="cuda").to(memory_format=CL)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
    assert type(out.grad_fn).__name__ == "CNBlockFunctionBackward"
    held = torch.cuda.memory_allocated() - base
    out.backward(dy)
    after = torch.cuda.memory_allocated() - base  # out, the parameters' gradients: not the saved activations
    assert after < 0.5 * held, (after, held)
    model.eval()  # a gradient wanted in eval: no stochastic depth, so no draw from the RNG
    state = torch.cuda.get_rng_state()
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x.requires_grad_())
        want = block.eval()(x)
    assert type(out.grad_fn).__name__ == "CNBlockFunctionBackward" and torch.equal(state, torch.cuda.get_rng_state())
    assert rel_err(out, want) < 2e-3


def test_replayed_calls_follow_fresh_pointers():
    """From a stream's second call the node's launches replay as re-pointed graphs: each call's own tensors."""
    block = _block(96, 0.3, "row")
    model = cgt.convert(nn.Sequential(copy.deepcopy(block)))
    dy = torch.randn(2, 96, 14, 14, device="cuda").to(memory_format=CL)
    for seed in range(4):
        torch.manual_seed(100 + seed)
        x = torch.randn(2, 96, 14, 14, device="cuda").to(memory_format=CL)
        keep = torch.empty(seed * 4096 + 1, device="cuda")  # noqa: F841 - shifts the allocator's next addresses
        got, got_g = _step(model, x, dy, seed=seed)
        theirs, theirs_g = _step(block, x, dy, seed=seed)
        assert rel_err(got, theirs) < 2e-3
        for g, t in zip(got_g, theirs_g):
            assert rel_err(g, t) < 2e-2
    launches = next(v for v in _cnblock_train._geometries.values()
                    if v is not None and v.geometry == (2, 96, 196, 384, "float32"))
    assert sum(r.replays for r in launches._forward.values()) >= 2
    assert sum(r.replays for r in launches._backward.values()) >= 2


CURVE_STEPS = 300


def _task(n=1024, classes=10, seed=0):
    """Noisy images around one fixed random template a class: learnable in a few hundred steps, not at once."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    templates = torch.randn(classes, 3, 32, 32, device="cuda", generator=g)
    y = torch.randint(0, classes, (n,), device="cuda", generator=g)
    x = 0.3 * templates[y] + torch.randn(n, 3, 32, 32, device="cuda", generator=g)
    return x.contiguous(memory_format=CL), y


def _convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)], stochastic_depth_prob=0.2,
                    layer_scale=0.1, num_classes=10)


def _curve(model, x, y, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler()
    torch.manual_seed(seed)  # stochastic depth's draws: the same sequence on both sides
    losses = []
    for step in range(CURVE_STEPS):
        i = (step * 64) % x.shape[0]
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x[i:i + 64]).float(), y[i:i + 64])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return torch.stack(losses).cpu()


def _smoothed(curve, width=20):
    return curve.unfold(0, width, 1).mean(1)


def test_300_amp_steps_of_a_small_convnext_track_torchs_loss_curve():
    """300 AMP steps (SGD with momentum, GradScaler, stochastic depth on) of a converted small ConvNeXt on a
    learnable synthetic task against torch's own run: same data, seeds and optimizer (the ResNet's fused
    runs: test_gpu_torch_convert's 300-step curve)."""
    torch.manual_seed(0)
    base = _convnext().cuda().to(memory_format=CL)
    ours = cgt.convert(copy.deepcopy(base))
    report = ours.cudnn_graphs_report
    assert report.convnext_blocks, str(report)
    x, y = _task()
    with torch.autocast("cuda", dtype=torch.float16):  # the node trains (stage 1's first block: no draw)
        first = ours.features[1][0](ours.features[0](x[:64]))
    assert type(first.grad_fn).__name__ == "CNBlockFunctionBackward"
    theirs, got = _curve(base, x, y), _curve(ours, x, y)
    assert torch.isfinite(got).all()
    start = float(theirs[:20].mean())
    ends = (float(_smoothed(theirs)[-1]), float(_smoothed(got)[-1]))
    assert max(ends) < 0.3 * start, (start, ends)  # both learn
    gap = (_smoothed(got) - _smoothed(theirs)).abs()
    # the curves stay together all along, not only at their ends
    assert float(gap.mean()) < 0.05 * start and float(gap.max()) < 0.2 * start, (start, ends, gap.mean(), gap.max())
