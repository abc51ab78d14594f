"""Stable cache keys: sha256 over labelled, length-prefixed parts, schema version first.

Never Python's hash() (salted per process) nor the frontend's key() (a std::hash of graph JSON
that omits the GPU architecture): the key must be equal across processes and machines with equal
inputs, and change when any input changes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Iterable

from .environment import Environment, environment
from .errors import SpecError

SIGNATURE_SCHEMA = 1


def _canonical_json(data) -> bytes:
    # sort_keys + repr-exact floats: one byte string per value, whatever dict order built it.
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _digest(parts: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for label, payload in parts:
        for chunk in (label.encode(), payload):
            h.update(struct.pack("<Q", len(chunk)))
            h.update(chunk)
    return h.hexdigest()


def spec_bytes(spec) -> bytes:
    """The canonical encoding of a spec (its versioned dict form)."""
    return _canonical_json(spec.to_dict())


def environment_bytes(env: Environment) -> bytes:
    return _canonical_json(env.to_dict())


def _check_arguments(spec, env, policy) -> None:
    if not callable(getattr(spec, "to_dict", None)):
        raise SpecError("spec", spec, "expected an op spec (cudnn_graphs.ConvFwdSpec, ...)")
    if not isinstance(env, Environment):
        raise SpecError("env", env, "expected None (this machine) or an Environment: cudnn_graphs.environment(device) "
                        "here, environment_from_file(path) for another machine")
    if policy is not None and not isinstance(policy, dict):
        raise SpecError("policy", policy, "expected None or a dict of session settings")


def signature(spec, env: Environment | None = None, *, policy: dict | None = None) -> str:
    """Hex sha256 naming `spec` built in `env` (default: this process, GPU 0, default flags).

    `policy`: session settings that change which plan is chosen (workspace cap, fusion); a policy
    of None or {} keeps the key of the default choice.
    """
    env = environment() if env is None else env
    _check_arguments(spec, env, policy)
    parts = [
        ("schema", str(SIGNATURE_SCHEMA).encode()),
        ("spec", spec_bytes(spec)),
        ("environment", environment_bytes(env)),
    ]
    if policy:
        parts.append(("policy", _canonical_json(policy)))
    return _digest(parts)
