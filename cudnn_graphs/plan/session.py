"""Session: one cuDNN handle per device, plans kept in memory by signature."""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from gpu_launch import driver
from gpu_launch.memo import CallMemo

from .. import config
from ..cache import keep_stored, load_plan, open_remote, open_store, open_system_store, plan_to_record, rank
from ..cache.policy import PLAN_RULES, for_machine, key_matches
from ..environment import environment, gpu_problem
from ..execute import cudnn_backend
from ..errors import CudnnBackendError, NoGpuError, UnsupportedGraphError
from ..graph import ROLE_UIDS, build_graph, frontend, serialized
from ..signature import signature
from ..spec import dtypes
from . import resident
from .plan import UNPROBED, Plan, PlannedPart

if TYPE_CHECKING:
    from .prefetch import Prefetch

log = logging.getLogger("cudnn_graphs")


_COUNTERS = ("memory_hits", "disk_hits", "remote_hits", "remote_refused", "remote_writes", "builds", "autotuned",
             "timings", "rebuilds_from_knobs", "rebuilds_from_heuristics", "disk_writes", "build_ms", "load_ms")
POLICIES = config.POLICIES
_BACKEND_LOADS = True  # stored plans load through the backend where they can (tests turn it off)
AUTOTUNE_INPUTS = ("scratch", "request")


class HandlePool:
    """One cuDNN handle per thread for one device: a handle must not be driven from two threads.

    One pool per device for the process (`for_device`), shared by every session and plan: handles are
    never destroyed (cudnnDestroy synchronises the device) and a new Session pays no cudnnCreate.
    The handle is created through the backend (`raw()`); the frontend's wrapper around it
    (`current()`) is made only where a graph is built, so a warm process never imports the frontend.
    """

    _pools: dict[int, "HandlePool"] = {}
    _pools_lock = threading.Lock()

    @classmethod
    def for_device(cls, device: int) -> "HandlePool":
        pool = cls._pools.get(device)
        if pool is None:
            with cls._pools_lock:
                pool = cls._pools.setdefault(device, cls(device))
        return pool

    def __init__(self, device: int):
        self.device = device
        self._local = threading.local()

    def raw(self) -> int:
        """This thread's cudnnHandle_t."""
        local = self._local
        handle = getattr(local, "raw", None)
        if handle is None:
            with driver.device(self.device):  # a handle belongs to the device current at creation
                handle = local.raw = cudnn_backend.create_handle()
            local.stream, local.wrapped = None, None
        return handle

    def current(self) -> Any:
        """This thread's handle as the frontend takes it."""
        raw = self.raw()
        local = self._local
        if local.wrapped is None:
            local.wrapped = frontend.wrap_handle(raw, self.device, local.stream)
        return local.wrapped

    def on_stream(self, stream_ptr: int) -> int:
        """This thread's raw handle, set to `stream_ptr` unless it already is."""
        local = self._local
        raw = getattr(local, "raw", None) or self.raw()
        if local.stream != stream_ptr:
            cudnn_backend.set_stream(raw, stream_ptr)
            local.stream = stream_ptr
            if local.wrapped is not None:
                frontend.note_stream(local.wrapped, stream_ptr)
        return raw


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
        self.deterministic = bool(deterministic)
        self.allow_tf32 = bool(allow_tf32)
        self.max_workspace_bytes = max_workspace_bytes
        self.fuse = bool(fuse)
        self.env = environment(self.device, deterministic=self.deterministic, allow_tf32=self.allow_tf32)
        self.handles = HandlePool.for_device(self.device)
        self.store = open_store(cache)
        # A team's read-only tier, consulted after the user's (unless this session keeps no cache at all).
        self.system_store = open_system_store() if cache is not False else None
        self.remote = open_remote(remote) if cache is not False else None
        self._memory: OrderedDict[Any, Plan] = OrderedDict()  # LRU by spec: equal specs have equal signatures
        self._memory_size = config.memory_cache_size()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._lock = threading.Lock()  # the memory LRU, the lock table and the counters
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
            on_disk = any(store is not None and store.path_of(key).exists() for store in (self.store, self.system_store))
            if not on_disk and self.remote is None:
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
        record = self.store.get(key) if self.store is not None else None
        if record is None and self.system_store is not None:
            record = self.system_store.get(key)
        if record is None and self.remote is not None:
            record = self._remote_record(key)
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

    def _remote_record(self, key: str):
        """The remote's record for `key` once it proves itself: signed (the store checks), its key the
        signature of its own spec and environment, made on a machine like this one; then kept locally."""
        record = self.remote.get(key)
        if record is None:
            return None
        if not key_matches(record) or not for_machine(record.meta, self.env):
            self._count("remote_refused")
            log.warning("remote plan cache: record %s refused (its key is not its spec's and environment's "
                        "signature on this machine)", key[:16])
            return None
        self._count("remote_hits")
        if self.store is not None:
            self.store.put(record, keep_existing=functools.partial(keep_stored, record))
        return record

    def _store(self, plan: Plan) -> None:
        if self.store is None and self.remote is None:
            return
        record = plan_to_record(plan, env=self.env, policy=self._policy, rules=self.plan_rules(plan.spec))
        # Never let a heuristic choice overwrite an autotuned record another process wrote meanwhile.
        if self.store is not None and self.store.put(record, keep_existing=functools.partial(keep_stored, record)):
            self._count("disk_writes")
        if self.remote is not None:
            _write_through(self, record)

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

    def _require_gpu(self) -> None:
        if not self.env.has_gpu:  # say what is missing and what to do, not a driver error per spec
            raise NoGpuError(gpu_problem(self.device) or "no GPU was found when this session started")

    def _build(self, spec, key: str, buffers: dict | None = None) -> Plan:
        self._require_gpu()
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
                return self._new_plan(spec, key, fused=build.fused, parts=parts, intermediates=build.intermediates,
                                      acc_dtype=_acc_dtype(build), build_ms=(time.perf_counter() - start) * 1e3,
                                      chosen_by="autotune" if self.policy == "autotune" else "heuristics")
        raise UnsupportedGraphError(spec, " | ".join(failures))

    def _new_plan(self, spec, key: str, *, fused: bool, parts: tuple, intermediates: dict, acc_dtype, build_ms: float,
                  chosen_by: str = "heuristics"):
        return Plan(spec=spec, signature=key, device=self.device, fused=fused, parts=parts,
                    intermediates=intermediates, handles=self.handles, acc_dtype=acc_dtype, build_ms=build_ms,
                    chosen_by=chosen_by)

    def _restore_part(self, spec, meta: dict, i: int, entry: dict, blobs: list, intermediates: dict):
        """(part, how) for part `i` of a stored plan: "disk" when its blob loaded, "knobs" when rebuilt."""
        self._require_gpu()
        if entry["kind"] == "kernel":
            index, function = entry.get("blob_index"), entry.get("function")
            cubin = blobs[index] if isinstance(index, int) and index < len(blobs) else None
            compiled = (cubin, function) if isinstance(cubin, bytes) and isinstance(function, str) else None
            return _kernel_part(spec, entry["name"], intermediates, self.device, compiled), "disk"
        blob = blobs[entry["blob_index"]]
        scalars = _scalar_arrays(spec, {int(uid): v for uid, v in entry["scalars"]})
        graph, index, how = None, 0, "disk"
        backend = self._backend_plan(blob, entry, scalars) if blob is not None else None
        if blob is not None and backend is None:
            try:
                graph = frontend.deserialize(blob, handle=self.handle)
            except Exception as err:  # other cuDNN, other GPU, or a damaged blob that passed the checksum
                log.warning("%s: stored plan did not load (%s); rebuilding from engine id + knobs", entry["engine"], err)
        if graph is None and backend is None:
            graph, index, how = *self._rebuild_from_knobs(spec, meta, i, entry), "knobs"
        rank, modes = entry.get("heuristic_index"), tuple(entry.get("heuristic_modes", ("A", "FALLBACK")))
        part = PlannedPart(
            name=entry["name"], graph=graph, roles=tuple(entry["roles"]), index=index, engine=entry["engine"],
            engine_id=int(entry["engine_id"]), knobs=dict(entry["knobs"]),
            behavior_notes=tuple(entry["behavior_notes"]), workspace_size=int(entry["workspace_size"]),
            scalars=scalars, nondeterministic_excluded=bool(entry["nondeterministic_excluded"]), heuristic_index=rank,
            heuristic_modes=modes, tuning=entry.get("tuning"), notes=_stored_notes(entry),
            notes_source=None if rank is None else self._notes_source(spec, bool(meta["fused"]), meta.get("acc_dtype"),
                                                                       i, rank, entry["engine"], modes),
            backend=None if backend is None else backend[0], backend_uids=() if backend is None else backend[1],
            serialized=blob if backend is not None else None,
        )
        return part, how

    def _backend_plan(self, blob: bytes, entry: dict, scalars: dict) -> tuple[Any, tuple[int, ...]] | None:
        """(the backend's plan, its variant-pack uids) for a stored blob the backend runs by itself,
        or None: the frontend deserializes it instead (and reports what is wrong with it)."""
        if not _BACKEND_LOADS:
            return None
        try:
            found = serialized.backend_plan(blob)
        except serialized.UBJSONError as err:
            log.info("%s: stored plan not readable without the frontend (%s)", entry["engine"], err)
            return None
        known = {ROLE_UIDS[role] for role in entry["roles"] if role in ROLE_UIDS} | set(scalars)
        if found is None or not found.scalar_uids <= set(scalars) or not found.uids <= known:
            return None
        uids = tuple(sorted(found.uids | found.scalar_uids))
        try:
            with driver.device(self.device):
                plan = cudnn_backend.ExecutionPlan(self.handles.raw(), found.plan_json)
        except CudnnBackendError as err:  # e.g. an engine this cuDNN lacks: the frontend path reports it
            log.info("%s: the backend declined the stored plan (%s)", entry["engine"], err)
            return None
        if plan.workspace_size > int(entry["workspace_size"]):  # scratch is sized from the record
            plan.close()
            return None
        return plan, uids

    def _rebuild_from_knobs(self, spec, meta: dict, i: int, entry: dict) -> tuple[Any, int]:
        """Part `i` rebuilt with exactly the stored engine and knobs: no heuristics query."""
        with driver.device(self.device):
            build = build_graph(spec, fused=bool(meta["fused"]), handle=self.handle, acc_dtype=meta.get("acc_dtype"))
            g = build.parts[i].graph
            try:
                g.build_operation_graph()
                g.create_execution_plan(int(entry["engine_id"]), frontend.knobs_from_names(entry["knobs"]))
                index = g.get_execution_plan_count() - 1
                g.build_plan_at_index(index)
            finally:  # kept or dropped, the graph must hold no cycle for the collector
                frontend.release_declines(g)
            if int(g.get_workspace_size_plan_at_index(index)) != int(entry["workspace_size"]):
                raise RuntimeError("the rebuilt engine needs a different workspace than recorded")
        return g, index

    def _plan_build(self, spec, fused: bool, buffers: dict | None = None):
        """Plan every graph of a build; an unfused epilogue cuDNN cannot plan becomes our kernel."""
        acc_dtype = spec.dtype if not fused and _depthwise_fwd(spec) else None  # as torch: see _fusion_order
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
                parts.append(_kernel_part(spec, part.name, build.intermediates, self.device))
                continue
            try:
                parts.append(self._plan_part(build, i, acc_dtype, buffers))
            except Exception as err:  # standalone pointwise graphs do not plan on cuDNN 9.19
                log.info("%s: no cuDNN plan (%s); using the fallback kernel", part.name, err)
                parts.append(_kernel_part(spec, part.name, build.intermediates, self.device))
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
            scalars=_scalar_arrays(spec, part.scalars),
            nondeterministic_excluded=self.deterministic, heuristic_index=index, heuristic_modes=modes,
            tuning=None if tuned is None else _tuning_meta(tuned, self.autotune_inputs if buffers else "scratch"),
            notes_source=self._notes_source(spec, build.fused, acc_dtype, i, index, engine, modes),
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
                                scalars=_scalar_arrays(build.spec, part.scalars))
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

    def _notes_source(self, spec, fused: bool, acc_dtype, i: int, index: int, engine: str,
                      modes: tuple[str, ...] = ("A", "FALLBACK")):
        """A call that probes part `i`'s numerical notes on a fresh copy of its graph."""
        handles = self.handles  # not the session: a plan outlives it (resident.py)

        def fresh_graph():
            return build_graph(spec, fused=fused, handle=handles.current(), acc_dtype=acc_dtype).parts[i].graph

        return functools.partial(_probe_notes, fresh_graph, index=index, engine=engine, modes=modes)

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
_writer: list = []  # the process's one remote-writer thread, started on first use


def _write_through(session: Session, record) -> None:
    """Write `record` to the session's remote on a background thread: the caller never waits for the
    network; a record never replaces a better one there (checked atomically by the store)."""
    if not _writer:
        with _sessions_lock:
            if not _writer:
                from concurrent.futures import ThreadPoolExecutor

                _writer.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudnn-graphs-remote"))
    remote = session.remote

    def write() -> None:
        if remote.put(record, keep_existing=keep_stored):
            session._count("remote_writes")

    _writer[0].submit(write)


def flush_remote_writes(timeout: float | None = None) -> None:
    """Wait until every remote write queued so far is done (the CLI and tests; never needed on a hot path)."""
    if _writer:
        _writer[0].submit(lambda: None).result(timeout=timeout)


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


def _probe_notes(fresh_graph, **kwargs):
    from . import notes  # imported when someone asks: a warm process never probes

    return notes.probe(fresh_graph, **kwargs)


def _tuning_meta(tuned, inputs: str) -> dict:
    """The timing table a record keeps: every candidate's engine, knobs, median and workspace."""
    from . import autotune

    return {"candidates": [row.to_dict() for row in tuned.table], "winner": tuned.index,
            "heuristic_choice": tuned.heuristic_index, "tune_ms": round(tuned.tune_ms, 3), "inputs": inputs,
            "samples": autotune.SAMPLES, "warmup": autotune.WARMUP}


def _scalar_arrays(spec, values: dict[int, float]) -> dict[int, np.ndarray]:
    # cuDNN reads each scalar through a host pointer as exactly the declared compute type.
    dtype = np.float64 if spec.compute_dtype == dtypes.FLOAT64 else np.float32
    return {uid: np.full((1,), value, dtype=dtype) for uid, value in values.items()}


def _stored_notes(entry: dict) -> Any:
    if "numerical_notes" not in entry:
        return UNPROBED
    return None if entry["numerical_notes"] is None else tuple(entry["numerical_notes"])


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
    return (False, True) if _depthwise_fwd(spec) else (True, False)


def plan_rules(spec) -> dict[str, int]:
    """The PLAN_RULES that decide `spec`'s plan (stored in its record, checked when the record loads)."""
    if _depthwise_fwd(spec) and spec.has_epilogue:
        return {"depthwise_fwd_epilogue_unfused": PLAN_RULES["depthwise_fwd_epilogue_unfused"]}
    return {}


def _depthwise_fwd(spec) -> bool:
    """A forward conv with one input channel per group and several groups."""
    return spec.op == "conv_fwd" and spec.groups > 1 and spec.w_shape[1] == 1


def _acc_dtype(build) -> str | None:
    acc = build.intermediates.get("acc")
    return None if acc is None else acc.dtype


def _kernel_part(spec, name: str, intermediates: dict, device: int, compiled: tuple | None = None):
    """The fallback kernel for graph part `name`; `compiled` is (cubin, lowered name) from a record."""
    from fallback_kernels import epilogue

    if name == "fwd_epilogue":
        return epilogue.fwd_epilogue(spec, intermediates["acc"], device, compiled)
    if name == "act_backward":
        return epilogue.act_backward(spec, intermediates["acc"], device, compiled)
    if name == "bias_grad":
        return epilogue.bias_grad(spec, device, compiled)
    raise AssertionError(f"no fallback kernel for graph part {name!r}")
