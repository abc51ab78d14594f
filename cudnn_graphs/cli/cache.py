"""`cudnn-graphs cache ...`: list, summarise, check, trim, clear and share (export/import) the on-disk plan cache.

Exit status: 0 done; 1 the command found problems (corrupt or unusable records, a corrupt bundle, records that
could not be written or removed); 2 usage or configuration errors (bad paths, a directory that is not a plan
cache, `--load` without a GPU, `clear` refused). Looking at the cache (`ls`, `stats`, `verify`, `export`) never
counts as a use of its records and never creates it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections import Counter
from typing import Any, NamedTuple

from plan_cache import CacheError, PlanRecord, PlanStore, redact_url
from plan_cache.bundle import CorruptBundleError, export_bundle, import_bundle

from .. import config
from ..cache.policy import importable, keep_stored, key_matches
from ..environment import NO_GPU, environment
from ..errors import CudnnGraphsError, shown
from ..plan.verify import verify_load
from ..spec import SPEC_TYPES, spec_from_dict

__all__ = ["add_cache_parser", "device_option", "int_arg", "human_bytes", "parse_size", "run_cache"]

_NEVER_TOUCH = 1e12  # seconds, the store's last-use throttle: opened with it, a get() never marks a record used
_SHAPE_FIELDS = (("x_shape", "x"), ("w_shape", "w"), ("dy_shape", "dy"))
_LOAD_STATUSES = ("loads", "rebuilt", "foreign", "unusable")
_FILE_COUNTS = ("ok", "corrupt", "untrusted", "unreadable", "removed_temp")  # PlanStore.verify()'s report


class _Exit(Exception):
    """Stop the command: print `message` as `cudnn-graphs: <message>` and exit with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# --- the parser ----------------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """`--max-bytes`: a byte count such as 1048576, 500M or 4G, parsed as $CUDNN_GRAPHS_CACHE_MAX_BYTES is."""
    try:
        return config.parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_cache_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `cache` command and its subcommands to `subparsers` (from `ArgumentParser.add_subparsers`)."""
    cache = subparsers.add_parser("cache", help="list, check, trim, clear, export, import, push and pull cached plans",
                                  description="Inspect and maintain the on-disk plan cache.")
    _cache_option(cache, argparse.SUPPRESS)
    common = argparse.ArgumentParser(add_help=False)
    _cache_option(common, argparse.SUPPRESS)
    subs = cache.add_subparsers(dest="cache_command", metavar="SUBCOMMAND", required=True)
    ls = subs.add_parser("ls", parents=[common], help="one row per record, most recently used first")
    ls.add_argument("--op", choices=sorted(SPEC_TYPES), help="only records of this op")
    _json_option(ls)
    stats = subs.add_parser("stats", parents=[common], help="totals by op, by chooser, by environment")
    stats.add_argument("--remote", action="store_true", help="also the remote cache's ($%s) records and counters"
                       % config.REMOTE_CACHE)
    _json_option(stats)
    verify = subs.add_parser("verify", parents=[common], help="check every record (and with a GPU, that it loads)")
    verify.add_argument("--load", action=argparse.BooleanOptionalAction, default=None,
                        help="also load each plan on the GPU (default: when a GPU and cuDNN are present)")
    device_option(verify)
    _json_option(verify)
    prune = subs.add_parser("prune", parents=[common], help="evict least recently used records down to a size")
    prune.add_argument("--max-bytes", type=parse_size, required=True, metavar="N",
                       help="bytes to keep, or with a K/M/G/T suffix (500M)")
    clear = subs.add_parser("clear", parents=[common], help="remove every record")
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    export = subs.add_parser("export", parents=[common], help="write records to one portable bundle file")
    export.add_argument("file", help="bundle file to write")
    export.add_argument("--key", dest="keys", action="append", metavar="KEY",
                        help="only this record (a key or a unique prefix of one, as `ls` shows); repeatable")
    imp = subs.add_parser("import", parents=[common], help="merge a bundle's records into the cache")
    imp.add_argument("file", help="bundle file to read")
    imp.add_argument("--all", action="store_true",
                     help="import records made for any environment, not only for this machine")
    device_option(imp)
    push = subs.add_parser("push", parents=[common], help="copy local records to the remote cache (signed)")
    pull = subs.add_parser("pull", parents=[common], help="copy the remote cache's records here (verified)")
    for sub in (push, pull):
        sub.add_argument("--remote", metavar="URL", help="redis://host:port/db (default: $%s)" % config.REMOTE_CACHE)
    pull.add_argument("--all", action="store_true", help="pull records made for any environment, not only this machine's")
    device_option(pull)
    return cache


def _cache_option(parser: argparse.ArgumentParser, default: Any) -> None:
    # SUPPRESS on both levels: `cache --cache D ls` and `cache ls --cache D` both work, neither resets the other.
    parser.add_argument("--cache", metavar="DIR", default=default,
                        help="cache directory (default: $CUDNN_GRAPHS_CACHE_DIR or the user cache dir)")


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def device_option(parser: argparse.ArgumentParser) -> None:
    """`--device I`: a GPU ordinal, >= 0 (a negative one is a usage error, not device 0's fingerprint)."""
    parser.add_argument("--device", type=int_arg(0, "a GPU ordinal (an integer >= 0)"), default=0,
                        help="GPU ordinal (default 0)")


def int_arg(minimum: int, what: str = "an integer"):
    """An argparse type: an integer >= `minimum`; a message that quotes a 5000-digit value quotes it bounded."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


_NO_CREATE = ("ls", "stats", "verify", "export", "push", "prune", "clear")  # only import and pull create a cache
_OPEN_READ_ONLY = ("ls", "stats")  # as a system tier is opened: they can list a root-owned one too
_OPEN_LATE = ("import", "pull")  # given an opener: the cache is created once the bundle or the remote proved usable


def run_cache(args: argparse.Namespace) -> int:
    """Run the parsed `cache` subcommand; the exit status."""
    try:
        root = _root(args)
        if args.cache_command in _NO_CREATE and not os.path.lexists(root):
            return _no_cache(root, args)
        if args.cache_command in _OPEN_LATE:
            return _COMMANDS[args.cache_command](functools.partial(_open_late, root), args)
        store = _open_store(root, read_only=args.cache_command in _OPEN_READ_ONLY)
        return _COMMANDS[args.cache_command](store, args)
    except CorruptBundleError as err:
        return _fail(f"{err}; nothing imported", 1)
    except _Exit as err:
        return _fail(str(err), err.code)
    except (CudnnGraphsError, CacheError, OSError) as err:  # CacheError: NotACacheError from clear and prune
        return _fail(str(err), 2)


def _root(args: argparse.Namespace):
    if getattr(args, "cache", None) is None:
        return config.cache_dir()
    if not args.cache.strip():  # Path("") is the working directory: never take an unset variable for a cache
        raise _Exit(f"--cache {args.cache!r}: an empty path names no cache directory (an unset shell variable?); "
                    "nothing done")
    return args.cache


def _no_cache(root, args: argparse.Namespace) -> int:
    """What a command that must not create the cache says when there is none at `root`."""
    command = args.cache_command
    if command in ("clear", "prune"):
        return _fail(f"no plan cache at {root}: nothing to {command} (is the path right?)", 2)
    if command in ("export", "push"):
        return _fail(f"no plan cache at {root}: nothing to {command}", 1)
    note = f"no plan cache at {root} (nothing has been cached there yet)"
    if not args.json:
        print(note)
        if command == "stats" and args.remote:  # the remote has its own story to tell
            print("\n" + _remote_table(_remote_stats(args)))
        return 0
    print(note, file=sys.stderr)  # standard output stays JSON
    if command == "ls":
        _dump([])
    elif command == "stats":
        info = _stats_from(root, [], entries=0, total_bytes=0, max_bytes=config.cache_max_bytes())
        _dump({**info, "remote": _remote_stats(args)} if args.remote else info)
    else:
        _dump(_verify_json(root, dict.fromkeys(_FILE_COUNTS, 0), False, {"ok": 0, "unusable": 0}, [], 0))
    return 0


def _fail(message: str, code: int) -> int:
    print(f"cudnn-graphs: {message}", file=sys.stderr)
    return code


def _open_store(root, *, read_only: bool = False) -> PlanStore:
    return PlanStore(root, max_bytes=config.cache_max_bytes(), touch_interval=_NEVER_TOUCH, read_only=read_only)


def _open_late(root) -> PlanStore:
    """The store for import and pull, opened (and created) only when there is something to write: its
    OSError (an untrusted root) is the cache's trouble, never taken for the bundle's or the remote's."""
    try:
        return _open_store(root)
    except OSError as err:
        raise _Exit(str(err)) from None


# --- reading records without side effects --------------------------------------------------------------------

class _Row(NamedTuple):
    key: str
    size: int
    used: float  # last use: the file's mtime
    record: PlanRecord | None
    error: str | None  # why the record is unreadable


def _rows(store: PlanStore) -> list[_Row]:
    """Every record, most recently used first. Read-only: no touch, no quarantine (unlike `store.get`)."""
    rows = [row for row in (_peek(store, key) for key in store.keys()) if row is not None]
    return sorted(rows, key=lambda r: r.used, reverse=True)


def _peek(store: PlanStore, key: str) -> _Row | None:
    peeked = store.peek(key)  # read-only, and safe against FIFOs, directories and links at record paths
    if peeked.status == "missing":  # evicted since keys() listed it
        return None
    st = peeked.stat
    size, used = (st.st_size, st.st_mtime) if st is not None else (0, 0.0)
    if peeked.status == "ok":
        return _Row(key, size, used, peeked.record, None)
    return _Row(key, size, used, None, peeked.reason or peeked.status)


def _dig(data: Any, *path: str) -> Any:
    """data[path[0]][path[1]]..., or None where a level is missing or not a dict: meta may come from anywhere."""
    for name in path:
        if not isinstance(data, dict):
            return None
        data = data.get(name)
    return data


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _stamp(value: Any) -> float | None:
    """A time stamp from meta, or None: -inf or nan in an imported record must not crash `ls` or break JSON."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return value if math.isfinite(value) else None


def _parts(meta: dict) -> list[dict]:
    parts = meta.get("parts")
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _shapes(spec: Any) -> dict[str, list]:
    out = {}
    for name, label in _SHAPE_FIELDS:
        shape = _dig(spec, name)
        if isinstance(shape, list) and all(isinstance(n, int) for n in shape):
            out[label] = shape
    return out


def _workspace(parts: list[dict]) -> int | None:
    sizes = [p["workspace_size"] for p in parts if isinstance(p.get("workspace_size"), int)]
    return max(sizes) if sizes else None  # parts run one after another: the plan needs the largest


def _env_label(env: Any) -> str:
    if not isinstance(env, dict):
        return "unknown environment"
    gpu = _text(env.get("gpu_name")) or "?"
    return f"{gpu}, cuDNN {_cudnn_version(env.get('cudnn_backend_version'))}"


def _cudnn_version(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 90000:  # cuDNN 9: 91900 is 9.19.0
        return f"{value // 10000}.{value // 100 % 100}.{value % 100}"
    return "?" if value is None else str(value)


def _summary(row: _Row) -> dict[str, Any]:
    """What `ls --json` prints for a row; every field None where the record does not say."""
    meta = row.record.meta if row.record is not None else {}
    parts = _parts(meta)
    return {"key": row.key, "status": "ok" if row.error is None else "unreadable", "error": row.error,
            "op": _text(_dig(meta, "spec", "op")), "dtype": _text(_dig(meta, "spec", "dtype")),
            "shapes": _shapes(meta.get("spec")), "chosen_by": _text(meta.get("chosen_by")),
            "engines": [_text(p.get("engine")) or "?" for p in parts], "workspace_bytes": _workspace(parts),
            "size_bytes": row.size, "created": _stamp(meta.get("created")), "last_used": row.used,
            "environment": _env_label(meta["environment"]) if "environment" in meta else None}


# --- formatting ----------------------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[Any]], *, right: tuple[int, ...] = ()) -> str:
    """Columns padded to their widest cell, two spaces apart; columns in `right` right-aligned. Every cell is
    printable: meta from an imported bundle must not reach the terminal raw (ESC sequences, BEL, CR)."""
    cells = [[_printable(c) for c in header]] + [["-" if c is None else _printable(str(c)) for c in row]
                                                 for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _printable(text: str) -> str:
    """`text` with each non-printable character escaped as Python writes it (ESC -> \\x1b)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _age(stamp: float | None, now: float) -> str:
    """'45s', '3m', '2h', '5d': how long ago `stamp` was."""
    if stamp is None:
        return "-"
    seconds = max(0.0, now - stamp)
    for limit, unit_seconds, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds // unit_seconds)}{unit}"
    return f"{int(seconds // 86400)}d"


def _ago(stamp: float | None, now: float) -> str:
    return "-" if stamp is None else f"{_age(stamp, now)} ago"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _dump(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


# --- ls, stats -----------------------------------------------------------------------------------------------

def _ls(store: PlanStore, args) -> int:
    summaries = [_summary(row) for row in _rows(store)]
    if args.op is not None:
        summaries = [s for s in summaries if s["op"] == args.op]
    if args.json:
        _dump(summaries)
        return 0
    if not summaries:
        print(f"no plan records in {store.root}")
        return 0
    now = time.time()
    header = ["KEY", "OP", "DTYPE", "SHAPES", "CHOSEN", "ENGINES", "WORKSPACE", "SIZE", "CREATED", "USED"]
    print(_table(header, [_ls_cells(s, now) for s in summaries], right=(6, 7, 8, 9)))
    total = sum(s["size_bytes"] for s in summaries)
    print(f"\n{_plural(len(summaries), 'record')}, {human_bytes(total)} in {store.root}")
    return 0


def _ls_cells(s: dict, now: float) -> list[Any]:
    shapes = " ".join(f"{label}={'x'.join(map(str, shape))}" for label, shape in s["shapes"].items())
    if s["status"] != "ok":
        return [s["key"][:16], "unreadable", None, None, None, _clip(s["error"], 48), None,
                human_bytes(s["size_bytes"]), None, _age(s["last_used"], now)]
    return [s["key"][:16], s["op"] or "?", s["dtype"], shapes or None, s["chosen_by"],
            _clip("+".join(s["engines"]), 48) or None, human_bytes(s["workspace_bytes"]),
            human_bytes(s["size_bytes"]), _age(s["created"], now), _age(s["last_used"], now)]


def _stats(store: PlanStore, args) -> int:
    info = _stats_info(store)
    if args.remote:
        info["remote"] = _remote_stats(args)
    if args.json:
        _dump(info)
        return 0
    now = time.time()
    cap = info["max_bytes"]
    share = f", {100 * info['total_bytes'] / cap:.0f}% of it" if cap else ""
    print(_table(["CACHE", str(store.root)], [
        ["entries", f"{info['entries']}" + (f" ({info['unreadable']} unreadable)" if info["unreadable"] else "")],
        ["size", f"{human_bytes(info['total_bytes'])} (cap {human_bytes(cap) if cap else 'none'}{share})"],
        ["created", f"oldest {_ago(info['oldest_created'], now)}, newest {_ago(info['newest_created'], now)}"],
        ["last used", f"least recently {_ago(info['least_recently_used'], now)}, "
                      f"most recently {_ago(info['most_recently_used'], now)}"],
    ]))
    for title, field in (("OP", "by_op"), ("CHOSEN BY", "by_chosen_by"), ("ENVIRONMENT", "by_environment")):
        counts = sorted(info[field].items(), key=lambda item: (-item[1], item[0]))
        print("\n" + _table([title, "ENTRIES"], [list(item) for item in counts], right=(1,)))
    if args.remote:
        print("\n" + _remote_table(info["remote"]))
    return 0


def _remote_table(remote: dict) -> str:
    cap = remote.get("server_maxmemory")
    return _table(["REMOTE", remote["url"]], [
        ["reachable", "yes" if remote["reachable"] else "no"], ["records", remote["records"]],
        ["server memory", f"{human_bytes(remote.get('server_used_memory'))} used, cap "
                          f"{human_bytes(cap) if cap else 'none'}"],
        ["this process", f"{remote['hits']} hits, {remote['misses']} misses, {remote['puts']} puts, "
                         f"{remote['refused_unsigned'] + remote['refused_signature']} refused"]])


def _stats_info(store: PlanStore) -> dict[str, Any]:
    counts = store.stats()
    return _stats_from(store.root, [_summary(row) for row in _rows(store)], entries=counts["entries"],
                       total_bytes=counts["total_bytes"], max_bytes=store.max_bytes)


def _stats_from(root, summaries: list[dict], *, entries: int, total_bytes: int, max_bytes: int | None) -> dict:
    readable = [s for s in summaries if s["status"] == "ok"]
    created = [s["created"] for s in readable if s["created"] is not None]
    used = [s["last_used"] for s in summaries]
    return {"cache": str(root), "entries": entries, "total_bytes": total_bytes,
            "max_bytes": max_bytes, "unreadable": len(summaries) - len(readable),
            "by_op": dict(Counter(s["op"] or "?" for s in readable)),
            "by_chosen_by": dict(Counter(s["chosen_by"] or "?" for s in readable)),
            "by_environment": dict(Counter(s["environment"] or "unknown environment" for s in readable)),
            "oldest_created": min(created, default=None), "newest_created": max(created, default=None),
            "least_recently_used": min(used, default=None), "most_recently_used": max(used, default=None)}


# --- verify --------------------------------------------------------------------------------------------------

def _verify(store: PlanStore, args) -> int:
    load = _want_load(args.load, args.device)
    files = store.verify()
    tally, problems, sessions = Counter(), [], {}
    for key in sorted(store.keys()):
        record = store.get(key)  # after verify(): a trusted, whole record, or None if it went meanwhile
        if record is None:
            continue
        status, detail = _check_record(record, load, args.device, sessions)
        tally[status] += 1
        if status not in ("ok", "loads"):
            problems.append({"key": key, "status": status, "detail": detail})
    statuses = _LOAD_STATUSES if load else ("ok", "unusable")
    records = {name: tally[name] for name in statuses}
    bad = files["corrupt"] + files["untrusted"] + files["unreadable"] + records["unusable"]
    if args.json:
        _dump(_verify_json(store.root, files, load, records, problems, bad))
    else:
        _print_verify(store, files, load, args.device, records, problems, bad)
    return 1 if bad else 0


def _verify_json(root, files: dict, load: bool, records: dict, problems: list, bad: int) -> dict:
    return {"cache": str(root), "files": files, "load": load, "records": records, "problems": problems,
            "ok": bad == 0}


def _want_load(flag: bool | None, device: int) -> bool:
    """Whether to load plans: as asked, else when a GPU and cuDNN are present; asked without them is an error."""
    if flag is False:
        return False
    env = environment(device)
    if flag is None:
        return env.has_gpu and env.cudnn_frontend_version != NO_GPU
    if not env.has_gpu:
        raise _Exit(f"--load needs a GPU and none is visible (device {device}); "
                    "run `cache verify --no-load` to check files and specs only")
    if env.cudnn_frontend_version == NO_GPU:
        raise _Exit("--load needs the cuDNN frontend and `import cudnn` failed; "
                    "run `cache verify --no-load` to check files and specs only")
    return True


def _check_record(record: PlanRecord, load: bool, device: int, sessions: dict) -> tuple[str, str]:
    try:
        spec_from_dict(record.meta.get("spec"))
    except Exception as err:  # a record from another version of the library, or a synthetic one
        return "unusable", f"spec not readable by this version of cudnn-graphs: {err}"
    if not load:
        return "ok", ""
    try:
        return verify_load(record, device=device, sessions=sessions)
    except Exception as err:  # one bad record must not stop the check of the others
        return "unusable", f"{type(err).__name__}: {err}"


def _print_verify(store, files, load, device, records, problems, bad) -> None:
    print(_table(["FILES", "COUNT"], [
        ["ok", files["ok"]], ["corrupt (quarantined)", files["corrupt"]],
        ["untrusted (quarantined)", files["untrusted"]], ["unreadable", files["unreadable"]],
        ["stale temp files removed", files["removed_temp"]]], right=(1,)))
    title = f"RECORDS (loaded on GPU {device})" if load else "RECORDS (specs only, not loaded)"
    print("\n" + _table([title, "COUNT"], [[name, n] for name, n in records.items()], right=(1,)))
    if problems:
        rows = [[p["key"][:16], p["status"], _clip(p["detail"], 100)] for p in problems]
        print("\n" + _table(["KEY", "STATUS", "DETAIL"], rows))
    print(f"\n{store.root}: " + (f"{bad} problem(s) found" if bad else "no problems found"))


# --- prune, clear --------------------------------------------------------------------------------------------

def _prune(store: PlanStore, args) -> int:
    store.check_marked()  # NotACacheError: nothing is deleted in a directory that is not a cache
    before = store.stats()["total_bytes"]
    removed = store.prune(args.max_bytes)
    after = store.stats()["total_bytes"]
    print(f"pruned {_plural(removed, 'record')}: {human_bytes(before)} -> {human_bytes(after)} "
          f"(target {human_bytes(args.max_bytes)}) in {store.root}")
    if after > args.max_bytes:
        raise _Exit(f"{store.root} still holds {human_bytes(after)}, over the target: another process holds its "
                    "eviction lock, or records could not be removed (the warning above says why)", 1)
    return 0


def _clear(store: PlanStore, args) -> int:
    store.check_marked()  # before asking: a directory that is not a cache is refused, whatever the answer
    count = len(store)
    if not args.yes:
        if not sys.stdin.isatty():
            raise _Exit(f"refusing to remove {_plural(count, 'record')} from {store.root} without --yes "
                        "(standard input is not a terminal)")
        if not _confirm(f"remove all {_plural(count, 'plan record')} from {store.root}? [y/N] "):
            print("nothing removed")
            return 1
    print(f"removed {_plural(store.clear(), 'record')} from {store.root}")
    left = len(store)
    if left:
        raise _Exit(f"{_plural(left, 'record')} could not be removed from {store.root} (the warning above says why)", 1)
    return 0


def _confirm(prompt: str) -> bool:
    try:
        return input(prompt).strip().lower() in ("y", "yes")
    except EOFError:
        return False


# --- export, import ------------------------------------------------------------------------------------------

def _export(store: PlanStore, args) -> int:
    keys = None if not args.keys else _resolve_keys(store, args.keys)
    try:
        count = export_bundle(store, args.file, keys=keys)
    except KeyError as err:  # listed a moment ago, now evicted or found corrupt (and quarantined)
        raise _Exit(f"{err.args[0]}; nothing exported", 1) from None
    except OSError as err:
        raise _Exit(f"cannot write {args.file}: {err.strerror or err}") from None
    print(f"exported {_plural(count, 'record')} to {args.file} ({human_bytes(os.path.getsize(args.file))})")
    return 0


def _resolve_keys(store: PlanStore, wanted: list[str]) -> list[str]:
    """Full keys for keys or unique key prefixes (as `ls` shows them), in order, without repeats."""
    stored = sorted(store.keys())
    out = []
    for prefix in wanted:
        matches = [prefix] if prefix in stored else [k for k in stored if k.startswith(prefix)]
        if not matches:
            raise _Exit(f"no record key starts with {prefix!r} in {store.root}")
        if len(matches) > 1:
            raise _Exit(f"key prefix {prefix!r} is ambiguous: {len(matches)} records start with it")
        out.append(matches[0])
    return list(dict.fromkeys(out))


def _import(open_store, args) -> int:
    env = None if args.all else environment(args.device)
    accept = functools.partial(importable, env=env)
    try:
        report = import_bundle(open_store, args.file, accept=accept, keep_existing=keep_stored)
    except OSError as err:
        raise _Exit(f"cannot read {args.file}: {err.strerror or err}") from None
    print(_table(["IMPORT", "RECORDS"], [
        ["imported", report.imported], ["already stored, unchanged", report.unchanged],
        ["skipped: for another environment, made with no GPU, or a key not its own", report.skipped_rejected],
        ["skipped: stored record kept (it was autotuned)", report.skipped_kept],
        ["corrupt entries", report.corrupt], ["not written (the log says why)", report.failed]], right=(1,)))
    if report.skipped_rejected:
        print("\n" + _foreign_note(env))
    return 1 if report.corrupt or report.failed else 0


def _foreign_note(env) -> str:
    if env is None:  # --all: only records whose key is not their own are refused
        return ("note: those records carry a key that is not the signature of their own spec and environment "
                "(renamed, copied under another key, or forged): never imported")
    if not env.has_gpu:
        return (f"note: no GPU is visible here (gpu_name {NO_GPU!r}), so every record counts as made for another "
                "environment; --all imports them anyway (to stage a cache for identical nodes)")
    return (f"note: those records were made on another GPU or with other cuDNN/CUDA versions than this "
            f"{env.gpu_name}; --all imports them anyway")


# --- the remote tier --------------------------------------------------------------------------------------

def _remote(url: str | None):
    from ..cache import open_remote

    url = url or config.remote_cache_url()
    if url is None:
        raise _Exit(f"no remote cache: pass --remote URL or set ${config.REMOTE_CACHE}", 2)
    if config.remote_cache_key() is None:
        raise _Exit(f"the remote cache needs a signing key: set ${config.REMOTE_KEY} or ${config.REMOTE_KEY_FILE} "
                    "(the same on every machine that shares it)", 2)
    remote = open_remote(url)
    if remote is None:
        raise _Exit(f"remote cache {redact_url(url)} could not be set up (the warning above says why)", 2)
    return remote


def _reachable(remote) -> None:
    if not remote.stats()["reachable"]:
        raise _Exit(f"remote cache {remote.url} is not reachable (the warning above says why)", 1)


def _push(store: PlanStore, args) -> int:
    remote = _remote(args.remote)
    _reachable(remote)
    counts = Counter()
    for row in _rows(store):
        if row.record is None:
            counts["unreadable here, skipped"] += 1
        elif not key_matches(row.record):
            counts["skipped: key not its own"] += 1
        else:
            counts[_push_one(remote, row.record)] += 1
    print(_table(["PUSH", "RECORDS"], [[k, v] for k, v in sorted(counts.items())] or [["pushed", 0]], right=(1,)))
    failed = counts[_NOT_WRITTEN_THERE]
    if failed:
        raise _Exit(f"remote cache {remote.url}: {_plural(failed, 'record')} not written (the warning above says "
                    "why: a read-only replica, a full server, a server that failed)", 1)
    return 0


_NOT_WRITTEN_THERE = "not pushed: the remote refused or failed the write"
_NOT_WRITTEN_HERE = "not written here (the warning above says why)"


def _push_one(remote, record: PlanRecord) -> str:
    kept = _Kept(keep_stored)
    if remote.put(record, keep_existing=kept):
        return "pushed"
    return "not pushed: the remote's is autotuned" if kept.kept else _NOT_WRITTEN_THERE


class _Kept:
    """A keep_existing callback that remembers whether it kept the stored record: a put that returns False
    was either kept (fine) or failed (a problem), and only this tells which."""

    def __init__(self, keep):
        self.keep, self.kept = keep, False

    def __call__(self, *records: PlanRecord) -> bool:
        self.kept = bool(self.keep(*records))
        return self.kept


_NOT_PULLED = {"refused": "refused: unsigned or signed with another key", "corrupt": "refused: damaged",
               "wrong_type": "skipped: not a plan record (another type, or too large)",
               "too_large": "skipped: not a plan record (another type, or too large)",
               "miss": "skipped: deleted while pulling", "failed": "not read: the remote failed (see the warning)"}


_PROBLEMS = (_NOT_PULLED["refused"], _NOT_PULLED["corrupt"], _NOT_PULLED["failed"], _NOT_WRITTEN_HERE)


def _pull(open_store, args) -> int:
    remote = _remote(args.remote)
    _reachable(remote)
    env = None if args.all else environment(args.device)
    counts = Counter()
    keys = _listed_keys(remote, counts)
    store = open_store()
    for key in keys:
        record, outcome = remote.fetch(key)
        if record is None:
            counts[_NOT_PULLED[outcome]] += 1
        elif not importable(record, env):
            counts["skipped: for another environment, made with no GPU, or a key not its own"] += 1
        else:
            counts[_pull_one(store, record)] += 1
    print(_table(["PULL", "RECORDS"], [[k, v] for k, v in sorted(counts.items())] or [["pulled", 0]], right=(1,)))
    return 1 if any(counts[problem] for problem in _PROBLEMS) else 0


def _pull_one(store: PlanStore, record: PlanRecord) -> str:
    kept = _Kept(functools.partial(keep_stored, record))
    if store.put(record, keep_existing=kept):
        return "pulled"
    return "kept the local record (it was autotuned)" if kept.kept else _NOT_WRITTEN_HERE


def _listed_keys(remote, counts: Counter) -> list[str]:
    """The remote's record keys; names there that are no plan key (planted, or another program's) are
    counted in `counts`, each on its own, never fatal."""
    before = remote.counters()["ignored_names"]
    keys = list(remote.keys())
    if remote.backing_off():
        raise _Exit(f"remote cache {remote.url}: listing its records failed (the warning above says why)", 1)
    ignored = remote.counters()["ignored_names"] - before
    if ignored:
        counts["skipped: a name that is no plan key"] += ignored
    return keys


def _remote_stats(args) -> dict[str, Any]:
    remote = _remote(None)
    out = remote.stats()
    out["records"] = len(list(remote.keys())) if out["reachable"] else None
    return out


_COMMANDS = {"ls": _ls, "stats": _stats, "verify": _verify, "prune": _prune, "clear": _clear,
             "export": _export, "import": _import, "push": _push, "pull": _pull}
