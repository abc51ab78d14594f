"""A built plan: the spec's cuDNN graph(s) with one execution plan each, ready to execute."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BufferMismatchError
from ..execute import buffers as _buffers
from ..execute.streams import allocate, stream_pointer
from ..graph import ROLE_UIDS, frontend
from ..spec.dtypes import ITEMSIZE


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

    def prepare(self, ptrs: dict[str, int]) -> dict[int, int]:
        pack = {ROLE_UIDS[role]: ptrs[role] for role in self.roles}
        pack.update({uid: arr.ctypes.data for uid, arr in self.scalars.items()})
        return pack

    def run(self, pack: dict[int, int], workspace_ptr: int, stream_ptr: int, handle: Any) -> None:
        self.graph.execute_plan_at_index(pack, workspace_ptr, self.index, handle=handle)


@dataclass
class Plan:
    """Executable plan for one spec on one device."""

    spec: Any
    signature: str
    device: int
    fused: bool
    deterministic: bool
    parts: tuple  # PlannedPart (cuDNN) or fallback_kernels' KernelPart, in execution order
    intermediates: dict
    handle: Any = field(repr=False)
    build_ms: float = 0.0
    _scratch: dict = field(default_factory=dict, repr=False)  # (stream, framework) -> (owners, ptrs)

    @property
    def workspace_size(self) -> int:
        return max(p.workspace_size for p in self.parts)

    @property
    def accumulator_dtype(self) -> str:
        return self.spec.compute_dtype

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(p.engine for p in self.parts)

    def execute(self, *, workspace: Any = None, stream: Any = None, **buffers: Any) -> None:
        """Run on `stream` (default: the buffers' framework's current stream); checks every buffer first."""
        self.bind(workspace=workspace, stream=stream, **buffers).launch()

    def bind(self, *, workspace: Any = None, stream: Any = None, **buffers: Any) -> "BoundPlan":
        """Check buffers once; the returned object's `launch()` re-runs with no re-validation."""
        infos = self._check(buffers)
        framework = next((i.framework for i in infos.values() if i.framework != "pointer"), "pointer")
        stream_ptr = stream_pointer(stream, framework, self.device)
        owners, scratch = self._scratch_for(stream_ptr, framework)
        ws_ptr = scratch["workspace"] if workspace is None else self._given_workspace(workspace)
        ptrs = {role: info.ptr for role, info in infos.items()}
        ptrs.update({role: scratch[role] for role in self.intermediates})
        packs = [(part.prepare(ptrs), part) for part in self.parts]
        return BoundPlan(self, packs, ws_ptr, stream_ptr, owners)

    def _check(self, buffers: dict[str, Any]) -> dict[str, _buffers.BufferInfo]:
        expected = self.spec.tensors()
        for role in buffers:
            if role not in expected:
                raise BufferMismatchError(role, "role", sorted(expected), role)
        infos = {}
        for role, desc in expected.items():
            if buffers.get(role) is None:
                raise BufferMismatchError(role, "buffer", f"a {desc.dtype} tensor of shape {desc.shape}", None)
            info = _buffers.describe(buffers[role], role)
            _buffers.check(info, desc, role, self.device)
            infos[role] = info
        return infos

    def _scratch_for(self, stream_ptr: int, framework: str) -> tuple[list, dict[str, int]]:
        """Workspace and intermediates, allocated once per (plan, stream) and reused by every launch."""
        key = (stream_ptr, framework)
        if key not in self._scratch:
            sizes = {"workspace": self.workspace_size, **{r: _nbytes(d) for r, d in self.intermediates.items()}}
            owned = {name: allocate(n, framework, self.device) for name, n in sizes.items()}
            self._scratch[key] = ([o for o, _ in owned.values()], {name: p for name, (_, p) in owned.items()})
        return self._scratch[key]

    def _given_workspace(self, workspace: Any) -> int:
        info = _buffers.describe(workspace, "workspace")
        if info.shape is not None and math.prod(info.shape) < self.workspace_size:  # uint8 buffers
            raise BufferMismatchError("workspace", "bytes", f">= {self.workspace_size}", math.prod(info.shape))
        return info.ptr


@dataclass
class BoundPlan:
    """A plan with its buffers checked and its variant packs built: `launch()` is the hot path."""

    plan: Plan
    packs: list
    workspace_ptr: int
    stream_ptr: int
    owners: list = field(repr=False)

    def launch(self) -> None:
        handle = self.plan.handle
        frontend.cudnn().set_stream(handle=handle, stream=self.stream_ptr)
        for pack, part in self.packs:
            part.run(pack, self.workspace_ptr, self.stream_ptr, handle)


def _nbytes(desc) -> int:
    span = 1 + sum((d - 1) * s for d, s in zip(desc.shape, desc.strides))
    return span * ITEMSIZE[desc.dtype]
