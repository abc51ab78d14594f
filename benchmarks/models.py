"""Benchmark (GPU host): torchvision networks with `cudnn_graphs.torch.convert` against torch, one run.

    python -m benchmarks.models --out models.json [--models resnet50 ...] [--compile] [--plot models.png]
    python -m benchmarks.models --plot-from models.json [--plot models.png]   # redraw, no GPU

Per model (AMP fp16 autocast, channels_last, cudnn.benchmark=True for torch):
- train: steady-state ms per training step (forward, cross-entropy, backward, SGD) at --train-batch,
  ours (`convert(model)`, parameters shared) against torch eager; blocks of steps alternate, CUDA
  events, medians. With --compile, torch.compile(model) beside them.
- infer: ms per forward at --infer-batch under no_grad, ours `convert(model.eval(), inference=True)`
  (BatchNorm folded, epilogues fused) against torch eager (and compiled).
- losses: --loss-steps training steps from one initialisation on fixed random batches, both losses.
Plans are built (or loaded) before timing: the first iteration is `benchmarks.first_iteration`'s subject.
Inputs are random; outputs of ours and torch's are compared once per model.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from benchmarks import harness

MODELS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "regnet_y_800mf")


def alternate(steps_by_name: dict, *, rounds: int, steps: int) -> dict[str, float]:
    """{name: median ms per step}: CUDA events around blocks of `steps` steps, the candidates' blocks
    alternating round by round."""
    block = {"ms": lambda step: harness.device_ms(step, calls=steps, sleep_cycles=0)}
    return harness.interleaved(steps_by_name, block, rounds=rounds)["ms"]


def train_step(model, opt, x, target):
    import torch

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def bench_model(name: str, args) -> dict:
    import torch
    import torchvision

    import cudnn_graphs.torch as cgt

    cl = torch.channels_last
    torch.manual_seed(0)
    base = getattr(torchvision.models, name)(weights=None).cuda().to(memory_format=cl)
    out: dict = {"model": name}
    t0 = time.perf_counter()

    # -- training steady state --------------------------------------------------------------------
    x = torch.randn(args.train_batch, 3, 224, 224, device="cuda").contiguous(memory_format=cl)
    target = torch.randint(0, 1000, (args.train_batch,), device="cuda")
    models = {"torch": copy.deepcopy(base), "ours": cgt.convert(copy.deepcopy(base))}
    out["converted"] = len(models["ours"].cudnn_graphs_report.replaced)
    if args.compile:
        models["torch_compile"] = torch.compile(copy.deepcopy(base))
    steps = {k: train_step(m, torch.optim.SGD(m.parameters(), lr=1e-4), x, target) for k, m in models.items()}
    for step in steps.values():  # plans built, kernels loaded, autotuned by torch, compiled
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    out["setup_s"] = round(time.perf_counter() - t0, 1)
    train = alternate(steps, rounds=args.rounds, steps=args.steps)
    out["train_ms"] = train
    out["train_speedup"] = train["torch"] / train["ours"]
    print(json.dumps({"model": name, "train_ms": train}), flush=True)  # kept if a time limit cuts the rest
    del steps, models

    # -- inference --------------------------------------------------------------------------------
    base.eval()
    xi = torch.randn(args.infer_batch, 3, 224, 224, device="cuda").half().contiguous(memory_format=cl)
    infer_models = {"torch": copy.deepcopy(base).half(),
                    "ours": cgt.convert(copy.deepcopy(base).half(), inference=True)}
    if args.compile:
        infer_models["torch_compile"] = torch.compile(copy.deepcopy(base).half())
    report = infer_models["ours"].cudnn_graphs_report
    out["inference_fusion"] = {"folded_batchnorm": len(report.folded_batchnorm),
                               "fused_activation": len(report.fused_activation),
                               "fused_residual": len(report.fused_residual)}

    def forward(model):
        def step():
            with torch.no_grad():
                return model(xi)
        return step

    fwd = {k: forward(m) for k, m in infer_models.items()}
    with torch.no_grad():
        ref, got = infer_models["torch"](xi).double(), infer_models["ours"](xi).double()
    out["infer_finite"] = {"torch": bool(ref.isfinite().all()), "ours": bool(got.isfinite().all())}
    # relative to the reference, or absolute where it is all zeros (a randomly initialised head can be)
    out["infer_rel_err_fp16"] = float((got - ref).norm() / ref.norm()) if ref.norm() > 0 else None
    out["infer_max_abs_err_fp16"] = float((got - ref).abs().max())
    out["infer_rel_err_fp32"] = _fp32_check(base, xi.float())
    for step in fwd.values():
        for _ in range(3):
            step()
    infer = alternate(fwd, rounds=args.rounds, steps=args.steps)
    out["infer_ms"] = infer
    out["infer_speedup"] = infer["torch"] / infer["ours"]
    del fwd, infer_models

    # -- loss curves from one initialisation ------------------------------------------------------
    if args.loss_steps:
        out["losses"] = loss_curves(base.train(), args)
    print(json.dumps({k: v for k, v in out.items() if k != "losses"}), flush=True)
    return out


def _fp32_check(base, x) -> float:
    """Relative error of the converted inference model against torch's, both float32 with TF32 off
    (random-initialised networks can overflow float16 in torch and ours alike)."""
    import torch

    import cudnn_graphs.torch as cgt

    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            want = copy.deepcopy(base).float()(x).double()
            got = cgt.convert(copy.deepcopy(base).float(), inference=True)(x).double()
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    return float((got - want).norm() / want.norm())


def loss_curves(base, args) -> dict[str, list[float]]:
    import torch

    import cudnn_graphs.torch as cgt

    cl = torch.channels_last
    curves = {}
    for name in ("torch", "ours"):
        model = copy.deepcopy(base)
        if name == "ours":
            cgt.convert(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # a descent both can follow
        gen = torch.Generator(device="cuda").manual_seed(7)
        batches = [(torch.randn(16, 3, 128, 128, device="cuda", generator=gen).contiguous(memory_format=cl),
                    torch.randint(0, 10, (16,), device="cuda", generator=gen)) for _ in range(4)]
        step_losses = []
        for i in range(args.loss_steps):
            x, target = batches[i % len(batches)]
            step_losses.append(float(train_step(model, opt, x, target)()))
        curves[name] = step_losses
    return curves


def plot(results: list[dict], path: Path, *, title: str = "") -> None:
    """Speedups (torch ms / ours ms) for training and inference, and each model's loss curves."""
    def draw(plt):
        names = [r["model"] for r in results]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for ax, key, label in ((axes[0], "train_speedup", "training step"), (axes[1], "infer_speedup", "inference")):
            bars = ax.bar(names, [r[key] for r in results], color=["tab:green" if r[key] >= 1 else "tab:red"
                                                                  for r in results])
            ax.bar_label(bars, fmt="%.2fx", fontsize=8)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_title(f"{label}: torch ms / ours ms")
            ax.tick_params(axis="x", rotation=30)
        for i, r in enumerate(results):
            losses = r.get("losses") or {}
            color = f"C{i}"
            if "torch" in losses:
                axes[2].plot(losses["torch"], color=color, lw=1.2, label=f"{r['model']} torch")
            if "ours" in losses:
                axes[2].plot(losses["ours"], color=color, lw=1.2, ls="--", label=f"{r['model']} ours")
        axes[2].set_title("training loss, one initialisation (solid torch, dashed ours)", fontsize=10)
        axes[2].set_xlabel("step")
        axes[2].legend(fontsize=6, ncol=2)
        if title:
            fig.suptitle(title)
        return fig

    harness.png(path, draw)


def _summary(results: list[dict], args, *, device: str, torch_version: str, complete: bool) -> dict:
    return {"device": device, "torch": torch_version, "models": results, "complete": complete,
            "policy": args.policy, "autotune_limit": args.autotune_limit if args.policy == "autotune" else None,
            "train_geomean": harness.geomean(r["train_speedup"] for r in results),
            "infer_geomean": harness.geomean(r["infer_speedup"] for r in results)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--infer-batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--loss-steps", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="add torch.compile columns (slow to compile)")
    p.add_argument("--policy", choices=("heuristic", "autotune"), default="heuristic",
                   help="how our plans are chosen: torch autotunes (benchmark=True), so `autotune` compares like "
                        "with like, as a job whose cache `warmup --autotune` filled")
    p.add_argument("--autotune-limit", type=int, default=3, help="candidates timed per spec with --policy autotune")
    p.add_argument("--plot-from", type=Path, metavar="JSON", help="only draw --plot from results written by --out "
                   "(no GPU needed)")
    args = p.parse_args(argv)
    if args.plot_from:
        stored = json.loads(args.plot_from.read_text())
        plot(stored["models"], args.plot or args.plot_from.with_suffix(".png"),
             title=f"{stored.get('device', '')}, torch {stored.get('torch', '')}: AMP fp16, channels_last")
        return 0
    if not args.models:
        p.error("--models: name at least one model")
    import torch

    torch.backends.cudnn.benchmark = True
    if args.policy == "autotune":  # the device's shared session, which the modules use, made autotuning
        from cudnn_graphs.plan import session as sessions

        sessions._sessions[0] = sessions.Session(device=0, policy="autotune", autotune_limit=args.autotune_limit)
    results: list[dict] = []
    for name in args.models:  # the JSON is rewritten after each model: a run cut short keeps what it measured
        results.append(bench_model(name, args))
        summary = _summary(results, args, device=torch.cuda.get_device_name(), torch_version=torch.__version__,
                           complete=len(results) == len(args.models))
        if args.out:
            harness.write_json(args.out, summary)
    print(f"geo-mean speedup: training {summary['train_geomean']:.2f}x, inference {summary['infer_geomean']:.2f}x")
    if args.plot:
        plot(results, args.plot, title=f"{summary['device']}, torch {summary['torch']}: AMP fp16, channels_last")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
