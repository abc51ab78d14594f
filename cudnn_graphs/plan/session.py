"""Session: one cuDNN handle per device, plans kept in memory by signature."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from ..environment import environment
from ..errors import BufferMismatchError, UnsupportedGraphError
from ..graph import build_graph, frontend
from ..signature import signature
from ..spec import dtypes
from . import notes
from .plan import Plan, PlannedPart

log = logging.getLogger("cudnn_graphs")


class HandlePool:
    """One cuDNN handle per thread for one device: a handle must not be driven from two threads."""

    def __init__(self, device: int):
        self.device = device
        self._local = threading.local()

    def current(self) -> Any:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            import cupy

            with cupy.cuda.Device(self.device):  # a handle belongs to the device current at creation
                handle = self._local.handle = frontend.cudnn().create_handle()
        return handle


class Session:
    """Plans specs on one device: validate -> operation graph -> heuristics A, FALLBACK -> build."""

    def __init__(self, *, device: int | None = None, deterministic: bool = False, allow_tf32: bool = True,
                 max_workspace_bytes: int | None = None, fuse: bool = True):
        """`fuse=False` skips the fused graph: conv graph, then the epilogue on its own (for comparison)."""
        if max_workspace_bytes is not None and (isinstance(max_workspace_bytes, bool) or
                                                not isinstance(max_workspace_bytes, int) or max_workspace_bytes < 0):
            raise ValueError(f"max_workspace_bytes={max_workspace_bytes!r}: expected None or an int >= 0")
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ValueError(f"device={device!r}: expected None or a CUDA device ordinal >= 0")
        self.device = 0 if device is None else device
        self.deterministic = bool(deterministic)
        self.allow_tf32 = bool(allow_tf32)
        self.max_workspace_bytes = max_workspace_bytes
        self.fuse = bool(fuse)
        self.env = environment(self.device, deterministic=self.deterministic, allow_tf32=self.allow_tf32)
        self.handles = HandlePool(self.device)
        self._plans: dict[str, Plan] = {}
        self._by_spec: dict[Any, Plan] = {}  # skips hashing the signature on repeated calls
        self._lock = threading.Lock()

    @property
    def handle(self) -> Any:
        """This thread's cuDNN handle on the session's device."""
        return self.handles.current()

    def signature(self, spec) -> str:
        """The stable key of `spec` on this session's device and settings."""
        return signature(spec, self.env)

    def plan(self, spec) -> Plan:
        plan = self._by_spec.get(spec)
        if plan is not None:
            return plan
        key = self.signature(spec)
        with self._lock:
            plan = self._plans.get(key) or self._build(spec, key)
            self._plans[key] = self._by_spec[spec] = plan
        return plan

    def run(self, request, *, stream: Any = None) -> Any:
        """Infer the spec from the request's buffers, plan it, allocate missing outputs, execute.

        Returns the output (y, dx or dw), or (dw, db) when a bias gradient is asked for.
        """
        if request.device != self.device:
            raise BufferMismatchError(request.primary, "device", self.device, request.device)
        spec = request.spec()
        plan = self.plan(spec)
        outputs = request.outputs(spec)
        buffers = {role: b for role, b in request.buffers.items() if b is not None}
        plan.execute(stream=stream, **{**buffers, **outputs})
        return request.result(outputs)

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
                return Plan(spec=spec, signature=key, device=self.device, fused=build.fused, parts=parts,
                            intermediates=build.intermediates, handles=self.handles,
                            build_ms=(time.perf_counter() - start) * 1e3)
        raise UnsupportedGraphError(spec, " | ".join(failures))

    def _plan_build(self, spec, fused: bool):
        """Plan every graph of a build; an unfused epilogue cuDNN cannot plan becomes our kernel."""
        acc_dtype = None
        build = build_graph(spec, fused=fused, handle=self.handle)
        try:
            conv = self._plan_part(build, 0, acc_dtype)
        except Exception:
            if fused or "acc" not in build.intermediates:
                raise
            # No engine writes the conv in compute precision: let it write the io dtype, as PyTorch does.
            acc_dtype = spec.dtype
            build = build_graph(spec, fused=False, handle=self.handle, acc_dtype=acc_dtype)
            conv = self._plan_part(build, 0, acc_dtype)
        parts = [conv]
        for i, part in enumerate(build.parts[1:], start=1):
            try:
                parts.append(self._plan_part(build, i, acc_dtype))
            except Exception as err:  # standalone pointwise graphs do not plan on cuDNN 9.19
                log.info("%s: no cuDNN plan (%s); using the fallback kernel", part.name, err)
                parts.append(_kernel_part(spec, part.name, build, self.device))
        return build, tuple(parts)

    def _plan_part(self, build, i: int, acc_dtype: str | None) -> PlannedPart:
        spec, part = build.spec, build.parts[i]
        g = part.graph
        g.build_operation_graph()
        self._rank_plans(g, spec)
        g.check_support()
        index = _build_first(g)
        engine_id, knobs = g.get_engine_and_knobs_at_index(index)
        engine = g.get_plan_name_at_index(index)
        scalar_dtype = np.float64 if spec.compute_dtype == dtypes.FLOAT64 else np.float32

        def fresh_graph():
            return build_graph(spec, fused=build.fused, handle=self.handle, acc_dtype=acc_dtype).parts[i].graph

        return PlannedPart(
            name=part.name, graph=g, roles=part.roles, index=index, engine=engine,
            engine_id=int(engine_id), knobs={str(k): int(v) for k, v in dict(knobs).items()},
            behavior_notes=tuple(str(n).rsplit(".", 1)[-1] for n in g.get_behavior_notes_for_plan_at_index(index)),
            numerical_notes=notes.probe(fresh_graph, index=index, engine=engine),
            workspace_size=int(g.get_workspace_size_plan_at_index(index)),
            scalars={uid: np.full((1,), value, dtype=scalar_dtype) for uid, value in part.scalars.items()},
            nondeterministic_excluded=self.deterministic,
        )

    def _rank_plans(self, g, spec) -> None:
        """Heuristics A then FALLBACK, minus what this session's settings rule out."""
        fe = frontend.cudnn()
        g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
        if self.deterministic:
            g.deselect_numeric_notes([fe.numerical_note.NONDETERMINISTIC])
        if spec.dtype == dtypes.FLOAT32 and not (spec.allow_tf32 and self.allow_tf32):
            g.deselect_numeric_notes([fe.numerical_note.TENSOR_CORE])  # fp32 on tensor cores means TF32
        if self.max_workspace_bytes is not None:
            g.deselect_workspace_greater_than(self.max_workspace_bytes)


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
