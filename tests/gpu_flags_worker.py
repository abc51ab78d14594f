"""Run in a fresh process by test_gpu_torch_flags: one conv layer's forward and backward under
`torch.backends.cudnn.benchmark` on or off; prints the planning session's counters as JSON.

    python -m tests.gpu_flags_worker on|off   (the cache root comes from $CUDNN_GRAPHS_CACHE_DIR)
"""

from __future__ import annotations

import json
import sys


def _step(conv, x):
    import torch

    x = x.detach().requires_grad_(True)
    y = conv(x)
    y.float().square().sum().backward()
    torch.cuda.synchronize()
    return y, x.grad


def main() -> int:
    import torch
    import torch.nn.functional as F

    import cudnn_graphs.torch as cgt
    from cudnn_graphs.plan import default_session
    from cudnn_graphs.torch import _conv

    torch.backends.cudnn.benchmark = sys.argv[1] == "on"
    torch.manual_seed(0)
    fmt = torch.channels_last
    conv = cgt.Conv2d(24, 40, 3, padding=1).to("cuda", torch.float16).to(memory_format=fmt)
    x = torch.randn(3, 24, 19, 23, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
    y, _ = _step(conv, x)
    session = _conv._session(0) or default_session(0)
    first = session.counters()
    _step(conv, x)  # the same geometry again: the layer's memo, no planning at all
    again = session.counters()
    with torch.no_grad():
        want = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    err = float((y.double() - want).norm() / want.norm())
    print(json.dumps({"policy": session.policy, "first": first, "again": again, "rel_err": err,
                      "chosen_by": sorted({plan.chosen_by for plan in session._memory.values()})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
