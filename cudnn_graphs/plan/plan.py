"""A built plan: the spec's cuDNN graph(s) with one execution plan each, ready to execute."""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from gpu_launch import buffers as _buffers
from gpu_launch.memo import CallMemo
from gpu_launch.streams import allocate_kept, capture_probe, stream_pointer

from ..cache.records import UNPROBED
from ..errors import BufferMismatchError, GraphCaptureError
from ..graph import ROLE_UIDS
from ..spec.dtypes import ITEMSIZE
from .launcher import Launcher

if TYPE_CHECKING:
    from ..execute.capture import CapturedPlan


log = logging.getLogger("cudnn_graphs")


@dataclass
class PlannedPart:
    """One graph of a build with its chosen execution plan."""

    name: str
    graph: Any = field(repr=False)
    roles: tuple[str, ...]
    index: int
    engine: str
    engine_id: int
    knobs: dict
    behavior_notes: tuple[str, ...]
    workspace_size: int
    # cuDNN reads pass-by-value scalars through a host pointer at every execute: keep them alive here.
    scalars: dict[int, np.ndarray] = field(repr=False)
    nondeterministic_excluded: bool = False  # chosen from a list filtered to deterministic plans
    heuristic_index: int | None = None  # its rank under `heuristic_modes`, which the note probe replays
    heuristic_modes: tuple[str, ...] = ("A", "FALLBACK")
    tuning: dict | None = None  # autotune's timing table for this part, when it was autotuned
    notes: Any = UNPROBED  # numerical notes: a tuple, None (unknowable), or UNPROBED until first asked
    notes_source: Any = field(default=None, repr=False, compare=False)  # () -> notes; costs heuristics queries
    # Loaded from a record without the frontend: the backend's plan (graph is None), the uids of its
    # variant pack in the order it is passed, and the stored blob (a rewritten record keeps it).
    backend: Any = field(default=None, repr=False)
    backend_uids: tuple[int, ...] = ()
    serialized: bytes | None = field(default=None, repr=False)

    @property
    def numerical_notes(self) -> tuple[str, ...] | None:
        """cuDNN's numerical notes for this engine, probed on first use (not on the planning path)."""
        if self.notes is UNPROBED:
            self.notes = self.notes_source() if self.notes_source is not None else None
        return self.notes

    @property
    def deterministic(self) -> bool | None:
        if self.nondeterministic_excluded:
            return True
        notes = self.numerical_notes
        return None if notes is None else "NONDETERMINISTIC" not in notes

    def prepare(self, ptrs: dict[str, int]) -> dict[int, int]:
        """The variant pack {uid: pointer} of this part, scalars included."""
        pack = {ROLE_UIDS[role]: ptrs[role] for role in self.roles}
        pack.update({uid: arr.ctypes.data for uid, arr in self.scalars.items()})
        return pack

    def runner(self, slots: dict[str, int], fixed: dict[str, int], workspace_ptr: int, stream_ptr: int,
               handles: Any) -> Callable[[Sequence[int]], None]:
        """`run(ptrs)` executing this part, where `ptrs[slots[role]]` is a role's pointer in this call
        and `fixed` holds the rest (scratch). `handles` is the session's HandlePool; the handle's
        stream is the caller's to set."""
        roles = {role: (slots[role] if role in slots else None) for role in self.roles}
        missing = [role for role, slot in roles.items() if slot is None and role not in fixed]
        if missing:
            raise ValueError(f"no pointer for roles {missing} of {self.name}")
        template = self.prepare({role: fixed.get(role, 0) for role in self.roles})
        patch = [(ROLE_UIDS[role], slot) for role, slot in roles.items() if slot is not None]
        if self.backend is not None:
            position = {uid: i for i, uid in enumerate(self.backend_uids)}
            return self.backend.runner(self.backend_uids, [template[uid] for uid in self.backend_uids],
                                       [(position[uid], slot) for uid, slot in patch if uid in position],
                                       workspace_ptr, handles.raw())
        handle = handles.current()
        fast = _backend_entry(self.graph, self.index, handle)
        if fast is not None:
            execute, cpp_index, backend_handle = fast
            raw = _raw_pointer_runner(self.graph, template, patch, workspace_ptr, cpp_index, backend_handle)
            if raw is not None:
                return raw

            def call(pack: dict[int, int]) -> None:
                execute(pack, workspace_ptr, cpp_index, backend_handle)
        else:
            graph, index = self.graph, self.index

            def call(pack: dict[int, int]) -> None:
                graph.execute_plan_at_index(pack, workspace_ptr, index, handle=handle)

        def run(ptrs: Sequence[int]) -> None:
            pack = dict(template)
            for uid, slot in patch:
                pack[uid] = ptrs[slot]
            call(pack)

        return run


def _backend_entry(graph: Any, index: int, handle: Any) -> tuple | None:
    """(execute, backend index, backend handle) under FE >= 1.28's Python pygraph, else None.

    That layer re-normalises the variant pack on every call (~10 us); for a backend plan it ends in
    `_lowered_graph._execute_plan_at_index`, which we call directly with the pack built once.
    Private names: any mismatch falls back to the public call.
    """
    try:
        from cudnn._handle import to_backend_handle

        plans, lowered = graph._plans, graph._lowered_graph
        if not graph._planning_done and lowered is not None:  # deserialized: the backend holds its one plan
            return lowered._execute_plan_at_index, index, to_backend_handle(handle)
        if graph._engine_for(plans[index]) is not None:
            return None  # a Python engine serves this plan
        cfg = graph._materialize_backend_plan(index)
        execute = lowered._execute_plan_at_index
    except (AttributeError, ImportError, IndexError, TypeError):
        return None
    return (execute, cfg.cpp_index, to_backend_handle(handle)) if cfg.cpp_index is not None else None


def _raw_pointer_runner(graph: Any, template: dict[int, int], patch: list[tuple[int, int]], workspace_ptr: int,
                        cpp_index: int, backend_handle: Any) -> Callable[[Sequence[int]], None] | None:
    """The backend's sorted-pointer entry (FE >= 1.28): one pointer array patched in place per call,
    no dict to convert or map to copy. The array is in the ascending-uid order the backend reports."""
    try:
        lowered = graph._lowered_graph
        lowered._prepare_variant_pack_template()
        order = list(lowered._get_variant_pack_uids_sorted())
        execute = lowered._execute_with_raw_ptrs
    except Exception:  # an older frontend, or a graph without a template: the dict entry serves
        return None
    if not order or any(uid not in template for uid in order):
        return None
    ptrs = (ctypes.c_uint64 * len(order))(*(template[uid] for uid in order))
    position = {uid: i for i, uid in enumerate(order)}
    moves = tuple((position[uid], slot) for uid, slot in patch if uid in position)
    args = (ctypes.addressof(ptrs), len(order), workspace_ptr, backend_handle or 0, cpp_index)

    def run(values: Sequence[int], ptrs=ptrs) -> None:  # the default argument keeps the array alive
        for i, slot in moves:
            ptrs[i] = values[slot]
        execute(*args)

    return run


@dataclass
class Plan:
    """Executable plan for one spec on one device."""

    spec: Any
    signature: str
    device: int
    fused: bool
    parts: tuple  # PlannedPart (cuDNN) or fallback_kernels' KernelPart, in execution order
    intermediates: dict
    handles: Any = field(repr=False)  # the session's per-thread cuDNN handles for this device
    acc_dtype: str | None = None  # dtype of the conv output an unfused plan hands to its epilogue
    build_ms: float = 0.0
    chosen_by: str = "heuristics"  # or "autotune": timed against every candidate
    _scratch: dict = field(default_factory=dict, repr=False)  # (stream, framework) -> (owners, ptrs)
    # execute()'s memo: what was checked -> Launcher; geometries that keep changing clear it, not grow it
    _checked: CallMemo = field(default_factory=lambda: CallMemo(_CHECKED_CACHE_SIZE), repr=False)
    _launchers: dict = field(default_factory=dict, repr=False)  # (roles, framework) -> Launcher

    def __post_init__(self) -> None:
        self._descs = self.spec.tensors()

    @property
    def workspace_size(self) -> int:
        return max(p.workspace_size for p in self.parts)

    @property
    def accumulator_dtype(self) -> str:
        return self.spec.compute_dtype

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(p.engine for p in self.parts)

    @property
    def deterministic(self) -> bool | None:
        """True when every part is deterministic; None when cuDNN's notes for a part are unknown."""
        flags = [p.deterministic for p in self.parts]
        return False if False in flags else (None if None in flags else True)

    def describe(self) -> dict[str, Any]:
        """What was chosen, per part: engine name, id, knobs, notes and workspace."""
        return {
            "op": self.spec.op, "signature": self.signature, "device": self.device, "fused": self.fused,
            "deterministic": self.deterministic, "accumulator_dtype": self.accumulator_dtype,
            "workspace_size": self.workspace_size, "build_ms": round(self.build_ms, 3), "chosen_by": self.chosen_by,
            "parts": [_describe_part(p) for p in self.parts],
        }

    def execute(self, *, workspace: Any = None, stream: Any = None, **buffers: Any) -> None:
        """Run on `stream` (default: the buffers' framework's current stream); checks every buffer first.

        Each buffer is read once per call; what the checks depend on (shapes, strides, dtypes,
        devices, 16-byte alignment) keys a memo of checked launchers, so a repeated geometry costs
        a dict lookup, and a repeated set of pointers a CUDA-graph replay (see `Launcher`).
        """
        if workspace is not None:
            return self.bind(workspace=workspace, stream=stream, cuda_graph=False, **buffers).launch()
        roles = tuple(role for role, b in buffers.items() if b is not None)
        objs = [buffers[role] for role in roles]
        framework = _buffers.framework_of(objs[0]) if objs else "pointer"
        stream_ptr = stream_pointer(stream, framework, self.device)
        key, ptrs, owners = _buffers.read_all(roles, objs, stream_ptr)
        key = (roles, key)
        launcher = self._checked.get(key)
        if launcher is None:
            launcher = self._checked_launcher(key, buffers, roles, stream_ptr)
        launcher.launch(ptrs, stream_ptr, capture_probe(framework, stream))
        del owners  # DLPack exports stay alive until the work is queued

    def _checked_launcher(self, key: tuple, buffers: dict, roles: tuple, stream_ptr: int) -> Launcher:
        return self._checked.put(key, self.launcher(roles, self.check_buffers(buffers, stream_ptr)))

    def check_buffers(self, buffers: dict[str, Any], stream: Any) -> str:
        """Refuse, with a typed error, buffers that do not fit this plan (a role it lacks or needs, shape,
        dtype, strides, device, alignment); returns their framework. A caller that memoises launchers
        (`requests.prepare_call`) runs this once per key."""
        framework, _, infos = self._describe(buffers, stream)
        self._check(buffers, infos)
        return framework

    def launcher(self, roles: tuple[str, ...], framework: str) -> Launcher:
        """The launcher taking pointers in `roles` order; scratch from `framework`'s allocator."""
        launcher = self._launchers.get((roles, framework))
        if launcher is None:
            launcher = self._launchers.setdefault((roles, framework), Launcher(self, roles, framework))
        return launcher

    def bind(self, *, workspace: Any = None, stream: Any = None, cuda_graph: bool | str = "auto",
             **buffers: Any) -> "BoundPlan":
        """Check buffers once; the returned object's `launch()` re-runs with no re-validation.

        `cuda_graph="auto"`: from the second launch (recorded behind queued work unless a recording was
        once seen to wait for it), launches replay a CUDA graph (one graph launch instead of a cuDNN
        execute per part: about a quarter of the host time), within the plan's graph budget (`launcher.py`);
        launches run directly whenever the stream is being captured by someone else or capture failed.
        True captures at the first launch and raises GraphCaptureError if it cannot; False never captures.
        """
        if cuda_graph not in (True, False, "auto"):
            raise ValueError(f"cuda_graph={cuda_graph!r}: expected True, False or 'auto'")
        framework, stream_ptr, infos = self._describe(buffers, stream)
        self._check(buffers, infos)
        roles = tuple(infos)
        if workspace is None:
            launcher = self.launcher(roles, framework)
        else:
            launcher = Launcher(self, roles, framework, workspace_ptr=self._given_workspace(workspace))
        owners = [i.owner for i in infos.values() if i.owner is not None]
        return BoundPlan(self, launcher, tuple(i.ptr for i in infos.values()), stream_ptr, owners,
                         cuda_graph=cuda_graph, capturing=capture_probe("pointer", stream_ptr))

    def _describe(self, buffers: dict[str, Any], stream: Any) -> tuple[str, int, dict]:
        framework = _framework(buffers.values())
        stream_ptr = stream_pointer(stream, framework, self.device)
        infos = {role: _buffers.describe(b, role, stream=stream_ptr) for role, b in buffers.items() if b is not None}
        return framework, stream_ptr, infos

    def _check(self, buffers: dict[str, Any], infos: dict[str, _buffers.BufferInfo]) -> None:
        expected = self._descs
        for role in buffers:
            if role not in expected:
                raise BufferMismatchError(role, "role", sorted(expected), role)
        for role, desc in expected.items():
            if role not in infos:
                raise BufferMismatchError(role, "buffer", f"a {desc.dtype} tensor of shape {desc.shape}", None)
            _buffers.check(infos[role], desc, role, self.device)

    def _scratch_for(self, stream_ptr: int, framework: str) -> tuple[list, dict[str, int]]:
        """Workspace and intermediates, allocated once per (plan, stream) and reused by every launch."""
        key = (stream_ptr, framework)
        if key not in self._scratch:
            sizes = {"workspace": self.workspace_size, **{r: _nbytes(d) for r, d in self.intermediates.items()}}
            owned = {name: allocate_kept(n, framework, self.device, stream_ptr) for name, n in sizes.items()}
            self._scratch[key] = ([o for o, _ in owned.values()], {name: p for name, (_, p) in owned.items()})
        return self._scratch[key]

    def _given_workspace(self, workspace: Any) -> int:
        info = _buffers.describe(workspace, "workspace")
        if info.shape is not None and math.prod(info.shape) < self.workspace_size:  # uint8 buffers
            raise BufferMismatchError("workspace", "bytes", f">= {self.workspace_size}", math.prod(info.shape))
        return info.ptr


@dataclass
class BoundPlan:
    """A plan with its buffers checked and its calls prepared: `launch()` is the hot path."""

    plan: Plan
    launcher: Launcher = field(repr=False)
    ptrs: tuple = field(repr=False)
    stream_ptr: int = 0
    owners: list = field(default_factory=list, repr=False)  # DLPack exports

    cuda_graph: bool | str = False  # see Plan.bind
    capturing: Callable[[int], bool] = field(default=None, repr=False)
    _launches: int = field(default=0, repr=False)
    _replay: Any = field(default=None, repr=False)  # the captured graph's replay, once there is one

    def launch(self) -> None:
        replay = self._replay
        if replay is not None and not self.capturing(self.stream_ptr):
            return replay()
        self.launcher.run(self.ptrs, self.stream_ptr)
        if self.cuda_graph and replay is None:
            self._launches += 1
            if self._launches >= (1 if self.cuda_graph is True else 2):
                self._auto_capture()

    def _auto_capture(self) -> None:
        if self.capturing(self.stream_ptr):  # inside the caller's own capture: their graph records our calls
            return
        try:
            self._replay = self._capture().replay
        except GraphCaptureError as err:
            if self.cuda_graph is True:
                raise
            log.info("launch() stays direct for %s: %s", self.plan.spec.op, err)
            self.cuda_graph = False

    def _capture(self) -> "CapturedPlan":
        from ..execute.capture import CapturedPlan

        return CapturedPlan(self, self.launcher.capture(self.ptrs, self.stream_ptr), self.stream_ptr)

    def capture(self) -> "CapturedPlan":
        """Record one launch into a CUDA graph (stream capture); `replay()` re-runs it on this stream.

        Runs the plan once first, so every kernel is loaded before capture. Raises GraphCaptureError
        when some engine cannot be captured (the plan still runs through `launch()`).
        """
        self.launcher.run(self.ptrs, self.stream_ptr)
        return self._capture()


def _describe_part(part) -> dict[str, Any]:
    return {"name": part.name, "engine": part.engine, "engine_id": getattr(part, "engine_id", None),
            "knobs": dict(getattr(part, "knobs", {}) or {}), "behavior_notes": list(part.behavior_notes),
            "numerical_notes": None if part.numerical_notes is None else list(part.numerical_notes),
            "deterministic": part.deterministic, "workspace_size": part.workspace_size,
            "tuning": getattr(part, "tuning", None)}


_CHECKED_CACHE_SIZE = 64


def _framework(buffers) -> str:
    """The first framework among the buffers (raw pointers have none): its stream and allocator serve."""
    return next((f for f in map(_buffers.framework_of, buffers) if f != "pointer"), "pointer")


def _nbytes(desc) -> int:
    span = 1 + sum((d - 1) * s for d, s in zip(desc.shape, desc.strides))
    return span * ITEMSIZE[desc.dtype]
