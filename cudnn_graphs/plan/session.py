"""Session: one cuDNN handle per device, plans kept in memory by signature."""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from gpu_launch import driver
from gpu_launch.memo import CallMemo

from .. import config
from ..cache import plan_to_record, rank
from ..cache.policy import depthwise_fwd, plan_rules
from ..environment import environment
from ..errors import UnsupportedGraphError
from ..graph import build_graph, frontend
from ..signature import signature
from ..spec import dtypes
from ..spec.specs import flag
from . import resident
from .handles import HandlePool, require_gpu
from .parts import kernel_part, notes_source, scalar_arrays
from .plan import Plan, PlannedPart
from .restore import load_plan
from .tiers import Tiers, flush_remote_writes  # noqa: F401  flush_remote_writes: the session's API, as before

if TYPE_CHECKING:
    from .prefetch import Prefetch

log = logging.getLogger("cudnn_graphs")


_COUNTERS = ("memory_hits", "disk_hits", "remote_hits", "remote_refused", "remote_writes", "builds", "autotuned",
             "timings", "rebuilds_from_knobs", "rebuilds_from_heuristics", "disk_writes", "build_ms", "load_ms")
POLICIES = config.POLICIES
AUTOTUNE_INPUTS = ("scratch", "request")


class Session:
    """Plans specs on one device: validate -> operation graph -> heuristics A, FALLBACK -> build."""

    def __init__(self, *, device: int | None = None, deterministic: bool = False, allow_tf32: bool = True,
                 max_workspace_bytes: int | None = None, fuse: bool = True, cache: Any = None,
                 policy: str | None = None, autotune_limit: int | None = None, autotune_inputs: str = "scratch",
                 remote: Any = None):
        """`cache`: None for the configured on-disk cache, False for memory only, a directory, or a
        `plan_cache.PlanStore`. `fuse=False` skips the fused graph: conv graph, then the epilogue alone.
        `remote`: None for $CUDNN_GRAPHS_REMOTE_CACHE, False for none, a redis:// URL or a
        `plan_cache.RemoteStore`: read after the local stores, written through off the caller's path
        (never with `cache=False`, which keeps plans in memory only).

        `policy="autotune"` times every candidate plan (heuristics A, B, FALLBACK) and keeps the fastest;
        `autotune_limit` caps how many are timed (like torch's benchmark_limit); `autotune_inputs="request"`
        times on the request's own buffers in `run()` instead of random scratch buffers.
        `policy=None` reads $CUDNN_GRAPHS_POLICY (default "heuristic").
        """
        policy = config.default_policy() if policy is None else policy
        _check_choice("policy", policy, POLICIES)
        _check_choice("autotune_inputs", autotune_inputs, AUTOTUNE_INPUTS)
        if autotune_limit is not None and (isinstance(autotune_limit, bool) or not isinstance(autotune_limit, int)
                                           or autotune_limit < 1):
            raise ValueError(f"autotune_limit={autotune_limit!r}: expected None or an int >= 1")
        self.policy, self.autotune_limit, self.autotune_inputs = policy, autotune_limit, autotune_inputs
        if max_workspace_bytes is not None and (isinstance(max_workspace_bytes, bool) or
                                                not isinstance(max_workspace_bytes, int) or max_workspace_bytes < 0):
            raise ValueError(f"max_workspace_bytes={max_workspace_bytes!r}: expected None or an int >= 0")
        self.device = device_ordinal(device)
        # Flags are taken as given, never bool()ed: bool("no") is True
        self.deterministic = flag("deterministic", deterministic)
        self.allow_tf32 = flag("allow_tf32", allow_tf32)
        self.max_workspace_bytes = max_workspace_bytes
        self.fuse = flag("fuse", fuse)
        self.env = environment(self.device, deterministic=self.deterministic, allow_tf32=self.allow_tf32)
        self.handles = HandlePool.for_device(self.device)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._lock = threading.Lock()  # the memory LRU, the lock table and the counters
        self.tiers = Tiers(cache, remote, self.env, counts=self._counts, lock=self._lock)
        self.store, self.system_store, self.remote = self.tiers.store, self.tiers.system_store, self.tiers.remote
        self._memory: OrderedDict[Any, Plan] = OrderedDict()  # LRU by spec: equal specs have equal signatures
        self._memory_size = config.memory_cache_size()
        self._spec_locks: dict[Any, threading.Lock] = {}
        self._build_lock = threading.Lock()
        # the request path's memo (requests.run_buffers): buffer geometry + params -> prepared call
        self.calls = CallMemo(1024)

    @property
    def handle(self) -> Any:
        """This thread's cuDNN handle on the session's device."""
        return self.handles.current()

    def signature(self, spec) -> str:
        """The stable key of `spec` on this session's device and settings."""
        return signature(spec, self.env, policy=self._policy)

    @property
    def _policy(self) -> dict:
        # Settings that change the chosen plan; the defaults add nothing, so default keys stay stable.
        policy = {}
        if self.max_workspace_bytes is not None:
            policy["max_workspace_bytes"] = self.max_workspace_bytes
        if not self.fuse:
            policy["fuse"] = False
        return policy

    def plan(self, spec, *, buffers: dict | None = None) -> Plan:
        """The plan for `spec`: from memory, else from the on-disk cache, else built (and stored).

        Under `policy="autotune"` a stored heuristic plan is tuned again and its record upgraded;
        `buffers` (role -> buffer) are what autotuning times on when `autotune_inputs="request"`.
        """
        plan = self._memory.get(spec)
        if plan is not None:
            self._count("memory_hits")
            try:
                self._memory.move_to_end(spec)
            except KeyError:  # evicted by another thread since the get: the plan is still good
                pass
            return plan
        with self._spec_lock(spec):  # one load or build per spec; other specs load meanwhile
            plan = self._memory.get(spec) or self._load_or_build(spec, buffers)
            self._remember(spec, plan)
        return plan

    def _spec_lock(self, spec) -> threading.Lock:
        lock = self._spec_locks.get(spec)
        if lock is None:
            with self._lock:
                lock = self._spec_locks.setdefault(spec, threading.Lock())
        return lock

    def _remember(self, spec, plan: Plan) -> None:
        with self._lock:
            self._spec_locks.pop(spec, None)  # later callers find the plan in memory (or plan it anew)
            if self._memory_size == 0:
                return
            self._memory[spec] = plan
            while len(self._memory) > self._memory_size:
                self._memory.popitem(last=False)

    def release_plans(self) -> None:
        """Let go of every plan this session holds (and the process holds for it). For tools that plan
        many specs once, such as `cudnn-graphs warmup`: destroying plans can wait for the GPU, so a
        training loop never calls this."""
        with self._lock:
            plans = list(self._memory.values())
            self._memory.clear()
            self.calls.clear()
        resident.drop(plans)
        del plans
        gc.collect()  # plans sit in reference cycles: destroy them here, not in a later hot loop's collection

    def _count(self, name: str, amount: float = 1) -> None:
        with self._lock:  # loads run on several threads (prefetch): no lost updates
            self._counts[name] += amount

    def prefetch(self, specs: Any, *, background: bool = True, workers: int = 4) -> "Prefetch":
        """Load into memory every plan the on-disk cache holds for `specs` (a spec file's path, as
        `cudnn-graphs warmup` reads, or an iterable of specs) ahead of the first calls; builds nothing.

        With `background=True` (default) it runs on its own thread and returns at once: start it early
        (before building the model, say) and the first step finds its plans in memory. `wait()` on
        the result returns counts of loaded / in_memory / missing / failed. Up to `workers` threads
        load at once; a call whose plan is being loaded waits for that load alone.
        """
        from .prefetch import Prefetch, specs_of

        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r}: expected an int >= 1")
        return Prefetch(self, specs_of(specs), background=background, workers=workers)

    def _prefetch_one(self, spec) -> str:
        if spec in self._memory:
            return "in_memory"
        with self._spec_lock(spec):
            if spec in self._memory:
                return "in_memory"
            key = self.signature(spec)
            held = self._resident(key)
            if held is not None:
                self._remember(spec, held)
                return "in_memory"
            if not self.tiers.may_hold(key):
                return "missing"
            with driver.device(self.device):  # a background thread starts with no current device
                plan = self._load_stored(spec, key)
            if plan is None:
                return "missing"
            self._remember(spec, resident.keep(plan))
        return "loaded"

    def _load_or_build(self, spec, buffers: dict | None) -> Plan:
        from .. import recording

        recording.note(spec)
        key = self.signature(spec)
        plan = self._resident(key)
        if plan is not None:
            self._count("memory_hits")
            return plan
        plan = self._load_stored(spec, key)
        if plan is not None:
            return resident.keep(plan)
        with self._build_lock:  # builds one at a time: autotune timings must not share the GPU
            plan = self._build(spec, key, buffers)
        self._count("autotuned" if plan.chosen_by == "autotune" else "builds")
        self._count("build_ms", plan.build_ms)
        self._store(plan)
        return resident.keep(plan)

    def _resident(self, key: str) -> Plan | None:
        """The plan another session of this process holds for `key`, unless this session would tune it."""
        plan = resident.get(self.device, key)
        if plan is None or (self.policy == "autotune" and plan.chosen_by != "autotune"):
            return None
        return plan

    def _load_stored(self, spec, key: str) -> Plan | None:
        """The plan stored under `key`, or None when there is none this session may use."""
        record = self.tiers.record(key)
        if record is not None and self.policy == "autotune" and rank(record.meta) == 0:
            return None  # a heuristic choice: tune it now and upgrade the record
        if record is None:
            return None
        start = time.perf_counter()
        outcome = load_plan(record, spec=spec, session=self)
        self._count("load_ms", (time.perf_counter() - start) * 1e3)
        if outcome is None:
            self._count("rebuilds_from_heuristics")
            return None
        self._count("disk_hits" if outcome.path == "disk" else "rebuilds_from_knobs")
        if outcome.rewrite:
            self._store(outcome.plan)
        return outcome.plan

    def _store(self, plan: Plan) -> None:
        if self.tiers.writable:
            self.tiers.put(plan_to_record(plan, env=self.env, policy=self._policy, rules=self.plan_rules(plan.spec)))

    def plan_rules(self, spec) -> dict[str, int]:
        """The planning rules (name -> version) that decide `spec`'s plan: a stored record planned under
        older ones is built anew."""
        return plan_rules(spec)

    def counters(self) -> dict[str, Any]:
        """This session's counters alone (memory/disk hits, builds, autotunes, timings, ...): no disk access."""
        return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        """Where plans came from in this session, and the time spent building and loading them."""
        out: dict[str, Any] = self.counters()
        out["build_ms"], out["load_ms"] = round(out["build_ms"], 3), round(out["load_ms"], 3)
        out["in_memory"] = len(self._memory)
        store = self.store.stats() if self.store is not None else {}
        out["corrupt_records"] = store.get("corrupt", 0)
        out["cache_dir"] = str(self.store.root) if self.store is not None else None
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    def run(self, request, *, stream: Any = None) -> Any:
        """Infer the spec from the request's buffers, plan it, allocate missing outputs, execute.

        Returns the output (y, dx or dw), or (dw, db) when a bias gradient is asked for. A geometry
        seen before skips straight to allocation and launch (see `requests.run_buffers`).
        """
        return request._run(self, stream)

    def _build(self, spec, key: str, buffers: dict | None = None) -> Plan:
        require_gpu(self.env, self.device)
        start = time.perf_counter()
        failures = []
        with driver.device(self.device):
            for fused in _fusion_order(spec, self.fuse):
                try:
                    build, parts = self._plan_build(spec, fused, buffers)
                except Exception as err:  # cuDNN declines with several exception types
                    failures.append(f"{'fused' if fused else 'unfused'}: {err}")
                    log.info("no plan for %s (%s): %s", spec.op, "fused" if fused else "unfused", err)
                    frontend.clear_tracebacks(err)  # its frames hold this session: no cycle for the collector
                    continue
                return Plan(spec=spec, signature=key, device=self.device, fused=build.fused, parts=parts,
                            intermediates=build.intermediates, handles=self.handles, acc_dtype=_acc_dtype(build),
                            build_ms=(time.perf_counter() - start) * 1e3,
                            chosen_by="autotune" if self.policy == "autotune" else "heuristics")
        raise UnsupportedGraphError(spec, " | ".join(failures))

    def _plan_build(self, spec, fused: bool, buffers: dict | None = None):
        """Plan every graph of a build; an unfused epilogue cuDNN cannot plan becomes our kernel."""
        acc_dtype = spec.dtype if not fused and depthwise_fwd(spec) else None  # as torch: see _fusion_order
        build = build_graph(spec, fused=fused, handle=self.handle, acc_dtype=acc_dtype)
        try:
            conv = self._plan_part(build, 0, acc_dtype, buffers)
        except Exception:
            if fused or "acc" not in build.intermediates or acc_dtype is not None:
                raise
            # No engine writes the conv in compute precision: let it write the io dtype, as PyTorch does.
            acc_dtype = spec.dtype
            build = build_graph(spec, fused=False, handle=self.handle, acc_dtype=acc_dtype)
            conv = self._plan_part(build, 0, acc_dtype, buffers)
        parts = [conv]
        for i, part in enumerate(build.parts[1:], start=1):
            if acc_dtype is not None:
                # With an io-dtype acc cuDNN plans the epilogue graph on its own, and with a residual and gelu
                # its fp16 / bf16 results missed the tolerances (H100, cuDNN 9.19, not investigated): ours runs it.
                parts.append(kernel_part(spec, part.name, build.intermediates, self.device))
                continue
            try:
                parts.append(self._plan_part(build, i, acc_dtype, buffers))
            except Exception as err:  # standalone pointwise graphs do not plan on cuDNN 9.19
                log.info("%s: no cuDNN plan (%s); using the fallback kernel", part.name, err)
                parts.append(kernel_part(spec, part.name, build.intermediates, self.device))
        return build, tuple(parts)

    def _plan_part(self, build, i: int, acc_dtype: str | None, buffers: dict | None = None) -> PlannedPart:
        spec, part = build.spec, build.parts[i]
        g = part.graph
        modes = ("A", "B", "FALLBACK") if self.policy == "autotune" else ("A", "FALLBACK")
        tuned = None
        try:
            g.build_operation_graph()
            self._rank_plans(g, spec, modes)
            g.check_support()
            if self.policy == "autotune":
                tuned = self._tune(build, i, g, buffers)
                index = tuned.index
            else:
                index = _build_first(g)
        finally:  # kept or dropped, the graph must hold no cycle for the collector
            frontend.release_declines(g)
        engine_id, knobs = g.get_engine_and_knobs_at_index(index)
        engine = g.get_plan_name_at_index(index)

        return PlannedPart(
            name=part.name, graph=g, roles=part.roles, index=index, engine=engine,
            engine_id=int(engine_id), knobs=frontend.knob_names(knobs),
            behavior_notes=tuple(str(n).rsplit(".", 1)[-1] for n in g.get_behavior_notes_for_plan_at_index(index)),
            workspace_size=int(g.get_workspace_size_plan_at_index(index)),
            scalars=scalar_arrays(spec, part.scalars),
            nondeterministic_excluded=self.deterministic, heuristic_index=index, heuristic_modes=modes,
            tuning=None if tuned is None else _tuning_meta(tuned, self.autotune_inputs if buffers else "scratch"),
            notes_source=notes_source(self.handles, spec, build.fused, acc_dtype, i, index, engine, modes),
        )

    def _tune(self, build, i: int, g, buffers: dict | None):
        """Time every candidate of part `i` (see `autotune`) on random scratch buffers or the caller's."""
        import cupy

        from . import autotune

        part, owners, ws = build.parts[i], [], [None, 0]  # the workspace allocation and its size
        descs = {**build.spec.tensors(), **build.intermediates}
        stream_ptr = cupy.cuda.get_current_stream().ptr

        def make_buffers():
            ptrs = {}
            for n, role in enumerate(part.roles):
                given = (buffers or {}).get(role) if role not in build.intermediates else None
                owner, ptr = (given, _pointer(given)) if given is not None else \
                    autotune.random_fill(descs[role], device=self.device, seed=n + 1)
                owners.append(owner)
                ptrs[role] = ptr
            return ptrs, workspace

        def workspace(nbytes: int) -> int:  # one allocation, grown to the largest candidate's need
            if nbytes == 0:
                return 0
            if ws[1] < nbytes:
                ws[0], ws[1] = cupy.cuda.alloc(nbytes), nbytes
            return ws[0].ptr

        def make_call(index: int, ptrs: dict, ws_ptr: int):
            trial = PlannedPart(name=part.name, graph=g, roles=part.roles, index=index, engine="", engine_id=0,
                                knobs={}, behavior_notes=(), workspace_size=0,
                                scalars=scalar_arrays(build.spec, part.scalars))
            slots = {role: i for i, role in enumerate(ptrs)}
            run = trial.runner(slots, {}, ws_ptr, stream_ptr, self.handles)
            return functools.partial(_run_keeping, run, tuple(ptrs.values()), trial.scalars)

        self.handles.on_stream(stream_ptr)
        try:
            tuned = autotune.tune_part(g, buffers=make_buffers, make_call=make_call, limit=self.autotune_limit,
                                       stream_ptr=stream_ptr)
        finally:
            # The scratch came from CuPy's pool, which keeps freed blocks: in a torch process (autotune under
            # cudnn.benchmark) that memory would stay out of torch's reach for the process's life. Tuning
            # has synchronised already, so giving the pool's free blocks back costs no extra wait.
            owners.clear()
            ws[0] = None
            cupy.get_default_memory_pool().free_all_blocks()
        self._count("timings", sum(r.median_ms is not None for r in tuned.table))
        return tuned

    def _rank_plans(self, g, spec, modes: tuple[str, ...] = ("A", "FALLBACK")) -> None:
        """Heuristics `modes` in order, minus what this session's settings rule out."""
        fe = frontend.cudnn()
        g.create_execution_plans([getattr(fe.heur_mode, m) for m in modes])
        if self.deterministic:
            g.deselect_numeric_notes([fe.numerical_note.NONDETERMINISTIC])
        if spec.dtype == dtypes.FLOAT32 and not (spec.allow_tf32 and self.allow_tf32):
            g.deselect_numeric_notes([fe.numerical_note.TENSOR_CORE])  # fp32 on tensor cores means TF32
        if self.max_workspace_bytes is not None:
            g.deselect_workspace_greater_than(self.max_workspace_bytes)


_sessions: dict[int, Session] = {}
_sessions_lock = threading.Lock()
def default_session(device: int = 0) -> Session:
    """The shared session for `device` (default settings), created on first use."""
    session = _sessions.get(device)
    if session is None:
        with _sessions_lock:
            session = _sessions.get(device) or _sessions.setdefault(device, Session(device=device))
    return session


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


def device_ordinal(device: Any) -> int:
    """A CUDA device as an ordinal: None (device 0), an int, "cuda", "cuda:N", or a torch.device."""
    if device is None:
        return 0
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    text = device if isinstance(device, str) else None
    if type(device).__name__ == "device" and getattr(device, "type", None) == "cuda":  # torch.device
        return 0 if device.index is None else int(device.index)
    if text is not None:
        kind, _, index = text.strip().partition(":")
        if kind == "cuda" and (index == "" or index.isdigit()):
            return int(index or 0)
    raise ValueError(f"device={device!r}: expected None, a CUDA device ordinal >= 0, 'cuda', 'cuda:N' or a "
                     "torch.device('cuda', N)")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {list(choices)}")


def _pointer(buffer: Any) -> int:
    from gpu_launch.buffers import describe

    return describe(buffer, "autotune").ptr


def _run_keeping(run, ptrs, scalars) -> None:  # `scalars` rides along: cuDNN reads them through host pointers
    run(ptrs)


def _tuning_meta(tuned, inputs: str) -> dict:
    """The timing table a record keeps: every candidate's engine, knobs, median and workspace."""
    from . import autotune

    return {"candidates": [row.to_dict() for row in tuned.table], "winner": tuned.index,
            "heuristic_choice": tuned.heuristic_index, "tune_ms": round(tuned.tune_ms, 3), "inputs": inputs,
            "samples": autotune.SAMPLES, "warmup": autotune.WARMUP}


def _fusion_order(spec, fuse: bool) -> tuple[bool, ...]:
    """The builds to try, fused (one graph) or not (conv, then the epilogue on its own).

    A depthwise forward goes unfused first: with a bias or activation fused, cuDNN 9.19 offers only
    generic grouped engines (1.1-1.2 ms for convnext_tiny's first 7x7 depthwise conv at batch 32 on an
    H100), while the plain conv gets its depthwise kernel (~72 us; torch runs that one, then a bias add).
    Its conv writes the io dtype, as torch's does (`tools/probe_depthwise.py`).
    """
    if not spec.has_epilogue:
        return (True,)
    if not fuse:
        return (False,)
    return (False, True) if depthwise_fwd(spec) else (True, False)


def _acc_dtype(build) -> str | None:
    acc = build.intermediates.get("acc")
    return None if acc is None else acc.dtype
