"""Registers, stack bytes and spill stores of every fallback kernel, as ptxas reports them (NVRTC, no GPU).

    python -m tools.kernel_resources [--arch sm_90] [--source grid_sample] [--match gs_backward] [--framed]
    python -m tools.kernel_resources --out resources.json
    python -m tools.kernel_resources --check   # exit 1 if a kernel's frame exceeds STACK_LIMIT

A stack frame in a kernel that should have none is usually an array indexed at run time (see PointTaps'
`pick()` in grid_sample.cu) or a spill under a `__launch_bounds__` cap; registers set how many blocks fit an
SM. Prints one line per instantiation; --framed keeps only those with stack bytes or spills.

A frame above the context's stack limit (CU_LIMIT_STACK_SIZE, 1024 bytes unless raised) makes the kernel's first
launch, or the instantiation of the first graph holding it, wait for all queued work while the driver grows the
context's local memory: 1010 ms behind a 1 s sleep for a 2048-byte frame, nothing for 1024 bytes, H100, driver
580 (`tools/probe_stall_sources.py`; docs/kernels.md, "First launches that wait for the GPU"). `--check` fails then.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SOURCES = ("grid_sample", "gemm_act", "epilogue")
STACK_LIMIT = 1024  # bytes a thread: the driver's default CU_LIMIT_STACK_SIZE


def resources(source: str, arch: str) -> dict[str, dict[str, int]]:
    """{name expression: ptxas's registers / stack_bytes / spill_stores} for one kernel source."""
    import importlib

    from fallback_kernels import compile as kc

    module = importlib.import_module(f"fallback_kernels.{source}")
    names = list(dict.fromkeys(module.name_expressions()))
    return kc.ptxas_resources(f"{source}.cu", names, arch, module.OPTIONS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--source", choices=SOURCES, action="append", help="default: all")
    ap.add_argument("--match", default="", help="only instantiations whose name contains this")
    ap.add_argument("--framed", action="store_true", help="only kernels with stack bytes or spill stores")
    ap.add_argument("--out", type=Path, help="also write the table as JSON here")
    ap.add_argument("--check", action="store_true", help=f"exit 1 if a frame exceeds {STACK_LIMIT} bytes")
    args = ap.parse_args(argv)
    table = {}
    for source in args.source or SOURCES:
        for name, r in resources(source, args.arch).items():
            if args.match in name and (not args.framed or r.get("stack_bytes") or r.get("spill_stores")):
                table[name] = r
                print(f"{name:55s} {r.get('registers', 0):4d} regs  {r.get('stack_bytes', 0):4d} B stack  "
                      f"{r.get('spill_stores', 0):4d} B spilled", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"arch": args.arch, "kernels": table}, indent=1))
    over = {name: r["stack_bytes"] for name, r in table.items() if r.get("stack_bytes", 0) > STACK_LIMIT}
    if args.check and over:
        print(f"frames over {STACK_LIMIT} bytes (their first launch behind queued work waits for it): {over}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
