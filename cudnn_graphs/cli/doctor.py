"""`cudnn-graphs doctor`: what this machine has, what a first call would do, and the fix for what is wrong."""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Callable

from plan_cache import redact_url

from .. import config
from ..environment import environment, frontend_version, gpu_problem, libcudnn_problem


def run_doctor(args) -> int:
    """Print one line per check (ok / warn / FAIL with the fix); exit 1 when any check fails."""
    failed = 0
    for name, check in _CHECKS:
        status, detail = _run_check(check, args)
        failed += status == "FAIL"
        print(f"{status:4s}  {name:14s} {detail}")
    print("\nno problems found" if not failed else f"\n{failed} problem(s): fix them before the first call")
    return 1 if failed else 0


def _run_check(check: Callable, args) -> tuple[str, str]:
    try:
        return check(args)
    except Exception as err:  # one check that cannot finish must not hide the others and the summary
        return "FAIL", f"could not be checked ({type(err).__name__}: {err})"


def _gpu(args) -> tuple[str, str]:
    problem = gpu_problem(args.device)
    if problem is not None:
        check = "`check --no-graph`" if libcudnn_problem() else "`check`"  # graphs are built with libcudnn
        return "FAIL", (f"{problem}. Fix: run on a GPU host with the NVIDIA driver; without one only "
                        f"{check} and `warmup --dry-run/--emit` work")
    env = environment(args.device)
    return "ok", (f"{env.gpu_name}, compute capability {env.compute_capability[0]}.{env.compute_capability[1]}, "
                  f"{env.sm_count} SMs, driver {env.cuda_driver_version}")


def _cudnn(args) -> tuple[str, str]:
    from ..execute import cudnn_backend

    try:
        version, runtime = cudnn_backend.version(), cudnn_backend.cudart_version()
    except Exception as err:
        return "FAIL", (f"libcudnn not loadable ({err}). Fix: pip install 'cudnn-graphs[cu12]' (or [cu13]); "
                        "until then `check` builds no graph (`check --no-graph` validates specs)")
    return "ok", f"libcudnn {version} (CUDA runtime {runtime}), loaded from {cudnn_backend.lib()._name}"


def _frontend(args) -> tuple[str, str]:
    try:  # the package alone: the fingerprint's version says "none" when libcudnn is what is missing
        version = frontend_version()
    except Exception:  # ImportError, PackageNotFoundError
        return "FAIL", "the cuDNN frontend is not installed. Fix: pip install 'nvidia-cudnn-frontend>=1.26,<1.29'"
    return "ok", f"nvidia-cudnn-frontend {version} (imported only to build plans)"


def _configuration(args) -> tuple[str, str]:
    problems = config.problems()
    if problems:
        return "FAIL", "; ".join(problems.values())
    set_ = {k: v for k, v in config.describe().items() if v is not None}
    return "ok", ", ".join(f"{k}={v}" for k, v in set_.items()) or "defaults (no CUDNN_GRAPHS_* variable set)"


def _cache(args) -> tuple[str, str]:
    status, detail = _cache_dir(args)
    if status == "FAIL" or config.CACHE_DIR in config.problems() or config.cache_disabled():
        return status, detail
    root = config.cache_dir()
    if root.is_absolute():
        return status, detail
    # Each process resolves it against its own working directory: ranks started elsewhere share nothing
    return "warn", (f"{detail}; {config.CACHE_DIR}={os.fspath(root)!r} is relative: a process started in another "
                    f"directory uses another cache. Fix: set it to an absolute path ({os.path.abspath(root)})")


def _cache_dir(args) -> tuple[str, str]:
    problems = config.problems()
    if config.CACHE_DIR in problems or config.DISABLE_CACHE in problems:
        return "FAIL", "see configuration"
    if config.cache_disabled():
        return "warn", f"disabled by {config.DISABLE_CACHE}: every process builds its plans again"
    root = config.cache_dir()
    if not os.path.lexists(root):
        return _cache_to_create(root)
    try:
        st = os.stat(root)
    except OSError as err:  # a dangling link, a symlink loop
        return "FAIL", f"{root} cannot be opened ({err.strerror}). Fix: set {config.CACHE_DIR} to a directory of yours"
    problems_here = _cache_dir_problems(root, st)
    if problems_here:
        return "FAIL", (f"{root} {', '.join(problems_here)}. Fix: chmod 700 {root} (if yours) or set "
                        f"{config.CACHE_DIR}")
    return _cache_contents(root, cap_known=config.CACHE_MAX_BYTES not in problems)


def _cache_to_create(root) -> tuple[str, str]:
    """A cache root that does not exist yet: can the first plan create it? Asked of the file system itself."""
    ancestor = next(p for p in root.parents if os.path.lexists(p))
    fix = f"Fix: set {config.CACHE_DIR} to a directory of yours"
    if not os.path.isdir(ancestor):
        return "FAIL", (f"{root} cannot be created: {ancestor} is not a directory (a file, a dangling link or a "
                        f"symlink loop). {fix}")
    problem = _mkdir_problem(ancestor)
    if problem is not None:
        return "FAIL", f"{root} cannot be created under {ancestor} ({problem}). {fix}"
    return "ok", f"{root} does not exist yet; the first plan creates it (0700)"


def _mkdir_problem(directory) -> str | None:
    """Why no directory can be made in `directory`, found by making one and removing it: os.access says
    yes to root in /proc and /sys, and knows nothing of read-only mounts."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".cudnn-graphs-doctor-", dir=directory))
    except OSError as err:
        return err.strerror or str(err)
    return None


def _cache_dir_problems(root, st: os.stat_result) -> list[str]:
    problems = []
    if not stat.S_ISDIR(st.st_mode):
        problems.append("is not a directory")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        problems.append(f"is owned by uid {st.st_uid}, not by you")
    if st.st_mode & 0o022:
        problems.append(f"mode {oct(st.st_mode & 0o777)} lets group or others write")
    if not os.access(root, os.W_OK):
        problems.append("is not writable")
    return problems


def _cache_contents(root, *, cap_known: bool) -> tuple[str, str]:
    from plan_cache import PlanStore

    try:
        stats = PlanStore(root, touch_interval=1e12).stats()
    except OSError as err:  # UntrustedCacheError names the directory and the fix
        return "FAIL", str(err)
    cap = config.cache_max_bytes() if cap_known else None
    capped = (f" of a {cap}-byte cap" if cap else ", no cap") if cap_known else ", cap: see configuration"
    return "ok", (f"{root}: {stats['entries']} records, {stats['total_bytes']} bytes{capped}; a first call "
                  "loads its plan from here")


def _remote(args) -> tuple[str, str]:
    problems = config.problems()
    if any(name.startswith("CUDNN_GRAPHS_REMOTE") for name in problems):
        return "FAIL", "see configuration"
    url = config.remote_cache_url()
    if url is None:
        return "ok", f"off (set {config.REMOTE_CACHE}=redis://host:port/db to share plans across machines)"
    shown = redact_url(url)  # a password in the URL stays out of job logs
    if config.remote_cache_key() is None:
        return "warn", (f"{shown} is off: no signing key. Fix: set {config.REMOTE_KEY} or {config.REMOTE_KEY_FILE} "
                        "(a file only you can read), the same secret on every machine")
    from ..cache import open_remote

    remote = open_remote(url)
    if remote is None:
        return "FAIL", f"{shown} could not be set up (the warning above says why); pip install 'cudnn-graphs[remote]'"
    stats = remote.stats()
    if not stats["reachable"]:
        return "warn", f"{shown} is not reachable now; sessions go on from the local cache"
    return "ok", f"{shown}: {len(list(remote.keys()))} records; read after the local cache, written through"


_CHECKS: list[tuple[str, Callable]] = [("GPU", _gpu), ("libcudnn", _cudnn), ("frontend", _frontend),
                                       ("configuration", _configuration), ("plan cache", _cache),
                                       ("remote cache", _remote)]
