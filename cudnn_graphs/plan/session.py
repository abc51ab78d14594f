"""Session: one cuDNN handle per device, plans kept in memory by signature."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from ..environment import environment
from ..errors import UnsupportedGraphError
from ..graph import build_graph, frontend
from ..signature import signature
from ..spec import dtypes
from .plan import Plan, PlannedPart

log = logging.getLogger("cudnn_graphs")


class Session:
    """Plans specs on one device: validate -> operation graph -> heuristics A, FALLBACK -> build."""

    def __init__(self, *, device: int | None = None, deterministic: bool = False, allow_tf32: bool = True,
                 max_workspace_bytes: int | None = None, fuse: bool = True):
        """`fuse=False` skips the fused graph: conv graph, then the epilogue on its own (for comparison)."""
        if max_workspace_bytes is not None and (not isinstance(max_workspace_bytes, int) or max_workspace_bytes < 0):
            raise ValueError(f"max_workspace_bytes={max_workspace_bytes!r}: expected None or an int >= 0")
        self.device = 0 if device is None else int(device)
        self.deterministic = bool(deterministic)
        self.allow_tf32 = bool(allow_tf32)
        self.max_workspace_bytes = max_workspace_bytes
        self.fuse = bool(fuse)
        self.env = environment(self.device, deterministic=self.deterministic, allow_tf32=self.allow_tf32)
        self._handle: Any = None
        self._plans: dict[str, Plan] = {}
        self._lock = threading.Lock()

    @property
    def handle(self) -> Any:
        if self._handle is None:
            import cupy

            with cupy.cuda.Device(self.device):  # a handle belongs to the device current at creation
                self._handle = frontend.cudnn().create_handle()
        return self._handle

    def plan(self, spec) -> Plan:
        key = signature(spec, self.env)
        plan = self._plans.get(key)
        if plan is None:
            with self._lock:
                plan = self._plans.get(key) or self._build(spec, key)
                self._plans[key] = plan
        return plan

    def _build(self, spec, key: str) -> Plan:
        import cupy

        start = time.perf_counter()
        failures = []
        with cupy.cuda.Device(self.device):
            for fused in ((True, False) if spec.has_epilogue and self.fuse else (not spec.has_epilogue,)):
                try:
                    build, parts = self._plan_build(spec, fused)
                except Exception as err:  # cuDNN declines with several exception types
                    failures.append(f"{'fused' if fused else 'unfused'}: {err}")
                    log.info("no plan for %s (%s): %s", spec.op, "fused" if fused else "unfused", err)
                    continue
                return Plan(spec=spec, signature=key, device=self.device, fused=build.fused,
                            deterministic=self.deterministic, parts=parts, intermediates=build.intermediates,
                            handle=self.handle, build_ms=(time.perf_counter() - start) * 1e3)
        raise UnsupportedGraphError(spec, " | ".join(failures))

    def _plan_build(self, spec, fused: bool):
        """Plan every graph of a build; an unfused epilogue cuDNN cannot plan becomes our kernel."""
        build = build_graph(spec, fused=fused, handle=self.handle)
        try:
            conv = self._plan_part(build.parts[0], spec)
        except Exception:
            if fused or "acc" not in build.intermediates:
                raise
            # No engine writes the conv in compute precision: let it write the io dtype, as PyTorch does.
            build = build_graph(spec, fused=False, handle=self.handle, acc_dtype=spec.dtype)
            conv = self._plan_part(build.parts[0], spec)
        parts = [conv]
        for part in build.parts[1:]:
            try:
                parts.append(self._plan_part(part, spec))
            except Exception as err:  # standalone pointwise graphs do not plan on cuDNN 9.19
                log.info("%s: no cuDNN plan (%s); using the fallback kernel", part.name, err)
                parts.append(_kernel_part(spec, part.name, build, self.device))
        return build, tuple(parts)

    def _plan_part(self, part, spec) -> PlannedPart:
        fe = frontend.cudnn()
        g = part.graph
        g.build_operation_graph()
        g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
        if self.deterministic:
            g.deselect_numeric_notes([fe.numerical_note.NONDETERMINISTIC])
        if spec.dtype == dtypes.FLOAT32 and not (spec.allow_tf32 and self.allow_tf32):
            g.deselect_numeric_notes([fe.numerical_note.TENSOR_CORE])  # fp32 on tensor cores means TF32
        if self.max_workspace_bytes is not None:
            g.deselect_workspace_greater_than(self.max_workspace_bytes)
        g.check_support()
        index = _build_first(g)
        engine_id, knobs = g.get_engine_and_knobs_at_index(index)
        scalar_dtype = np.float64 if spec.compute_dtype == dtypes.FLOAT64 else np.float32
        return PlannedPart(
            name=part.name, graph=g, roles=part.roles, index=index, engine=g.get_plan_name_at_index(index),
            engine_id=int(engine_id), knobs={str(k): int(v) for k, v in dict(knobs).items()},
            behavior_notes=tuple(str(n) for n in g.get_behavior_notes_for_plan_at_index(index)),
            workspace_size=int(g.get_workspace_size_plan_at_index(index)),
            scalars={uid: np.full((1,), value, dtype=scalar_dtype) for uid, value in part.scalars.items()},
        )


def _build_first(g) -> int:
    """Build plans in heuristic order; the first that builds wins (deselected ones are skipped)."""
    errors = []
    for index in range(g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(index)
            return index
        except Exception as err:  # a declined engine: try the next one
            errors.append(f"[{index}] {err}")
    raise RuntimeError("no execution plan could be built: " + ("; ".join(errors[-3:]) or "empty plan list"))


def _kernel_part(spec, name: str, build, device: int):
    from fallback_kernels import epilogue

    if name == "fwd_epilogue":
        return epilogue.fwd_epilogue(spec, build.intermediates["acc"], device)
    if name == "act_backward":
        return epilogue.act_backward(spec, build.intermediates["acc"], device)
    if name == "bias_grad":
        return epilogue.bias_grad(spec, device)
    raise AssertionError(f"no fallback kernel for graph part {name!r}")
