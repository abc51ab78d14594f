"""One rank of test_gpu_ddp: a converted small ResNet under DistributedDataParallel beside torch's own
model under DDP, from the same initialisation and data; prints what it saw as JSON on its last line.

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.gpu_ddp_worker

Phases: `train` (20 steps, float16 autocast, channels-last: convert's fused BatchNorm runs are in play),
`no_sync` (two micro-batches, the first under no_sync), `captured` (DDP around
`cudnn_graphs.torch.capture(model)` beside DDP around the eager converted model).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cudnn_graphs.torch as cgt

STEPS, BATCH, LR = 20, 32, 0.02
FMT = torch.channels_last


def _block(cin: int, cout: int, stride: int) -> nn.Module:
    down = None if stride == 1 and cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                                  nn.BatchNorm2d(cout))
    try:
        from torchvision.models.resnet import BasicBlock
    except ImportError:  # the same block as torchvision writes it
        from tests.test_torch_convert import BasicBlock as Local

        return Local(cin, cout, stride)
    return BasicBlock(cin, cout, stride, down)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initialisation on every rank (DDP broadcasts rank 0's anyway)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
                        _block(32, 32, 1), _block(32, 64, 2), _block(64, 64, 1),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return net.to(device).to(memory_format=FMT)


def _data(rank: int, device: torch.device, n: int = 4) -> list:
    g = torch.Generator(device=device).manual_seed(100 + rank)  # each rank its own shard
    return [(torch.randn(BATCH, 3, 32, 32, device=device, generator=g).contiguous(memory_format=FMT),
             torch.randint(0, 10, (BATCH,), device=device, generator=g)) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def _train(model: nn.Module, data: list, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = _loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def _buckets(ddp: DDP) -> dict:
    data = ddp._get_ddp_logging_data()
    return {k: data.get(k) for k in ("bucket_sizes", "rebuilt_bucket_sizes", "num_buckets_reduced")}


def _phase_train(device, rank) -> dict:
    theirs = _model(device)
    ours = cgt.convert(copy.deepcopy(theirs))
    # small buckets: several all-reduces per step, launched as their gradients become ready
    ddp_theirs, ddp_ours = (DDP(m, device_ids=[device.index], bucket_cap_mb=0.25) for m in (theirs, ours))
    data = _data(rank, device)
    out = {"torch": _train(ddp_theirs, data, STEPS), "ours": _train(ddp_ours, data, STEPS)}
    out["chains"] = [chain.status() for _, chain in ours.cudnn_graphs_report.chains]
    out["buckets"] = {"torch": _buckets(ddp_theirs), "ours": _buckets(ddp_ours)}
    out["params_in_sync"] = _same_on_every_rank(torch.cat([p.detach().float().flatten() for p in ours.parameters()]))
    return out


def _accumulate(ddp: DDP, data: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Local grads after a first micro-batch under no_sync, then all-reduced ones after the second."""
    ddp.zero_grad(set_to_none=True)
    with ddp.no_sync():
        _loss(ddp, *data[0]).backward()
    local = _grads(ddp.module).clone()
    _loss(ddp, *data[1]).backward()
    return local, _grads(ddp.module).clone()


def _phase_no_sync(device, rank) -> dict:
    theirs = _model(device)
    ours = cgt.convert(copy.deepcopy(theirs))
    data = _data(rank, device, n=2)
    local_t, synced_t = _accumulate(DDP(theirs, device_ids=[device.index]), data)
    local_o, synced_o = _accumulate(DDP(ours, device_ids=[device.index]), data)
    return {"local_rel_err": _rel(local_o, local_t), "synced_rel_err": _rel(synced_o, synced_t),
            "local_same_on_ranks": {"torch": _same_on_every_rank(local_t), "ours": _same_on_every_rank(local_o)},
            "synced_same_on_ranks": {"torch": _same_on_every_rank(synced_t), "ours": _same_on_every_rank(synced_o)}}


def _phase_captured(device, rank) -> dict:
    eager = cgt.convert(_model(device))
    graphed = copy.deepcopy(eager)
    data = _data(rank, device)
    with torch.autocast("cuda", dtype=torch.float16):
        step = cgt.capture(graphed, (data[0][0],))
    ddp_eager, ddp_graphed = DDP(eager, device_ids=[device.index]), DDP(step, device_ids=[device.index])
    return {"eager": _train(ddp_eager, data, 6), "captured": _train(ddp_graphed, data, 6), "captures": step.captures}


def main() -> int:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    start = time.perf_counter()
    out: dict = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, phase in (("train", _phase_train), ("no_sync", _phase_no_sync), ("captured", _phase_captured)):
            out[name] = phase(device, rank)
        torch.cuda.synchronize()
    out["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    out["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(out), flush=True)  # before teardown: a failure there still leaves the report
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
