"""The dict form of a spec: JSON- and msgpack-safe, versioned, exact on round trip."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..errors import SpecError
from .specs import SPEC_TYPES

SPEC_SCHEMA_VERSION = 1


def spec_to_dict(spec: Any) -> dict[str, Any]:
    """Plain dict of lists, ints, floats, bools, strings and None; `spec_from_dict` inverts it."""
    out: dict[str, Any] = {"schema": SPEC_SCHEMA_VERSION, "op": spec.op}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.init and not ((spec.op, f.name) in _OMITTED_AT_DEFAULT and value == f.default):
            out[f.name] = _plain(f.name, value)
    return out


# Fields added after schema 1 shipped: left out at their defaults, so every earlier spec keeps its dict
# form and signature (stored plans stay valid), and an older reader refuses only specs that use them.
_OMITTED_AT_DEFAULT = frozenset((("conv_fwd", "prologue"), ("conv_fwd", "stats"), ("conv_bwd_filter", "prologue"),
                                 ("conv_bwd_data", "residual")))


def _plain(name: str, value: Any) -> Any:
    if name in ("activation", "activation_backward"):
        return value.to_dict()
    if name == "strides":
        return {role: list(s) for role, s in value} if value else None
    if name == "padding":
        return [list(pair) for pair in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def spec_from_dict(data: Mapping[str, Any]):
    """Rebuild a spec from `spec.to_dict()`; unknown keys, ops or schema versions are refused."""
    if not isinstance(data, Mapping):
        raise SpecError("spec", data, "expected a dict")
    schema = data.get("schema")
    if "schema" not in data:
        raise SpecError("schema", None, f'missing: add "schema": {SPEC_SCHEMA_VERSION} to the spec')
    if type(schema) is not int or schema != SPEC_SCHEMA_VERSION:  # 1.0 and True are not the schema 1
        raise SpecError("schema", schema, f"this version of cudnn-graphs reads spec schema {SPEC_SCHEMA_VERSION}")
    op = data.get("op")
    cls = SPEC_TYPES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise SpecError("op", op, f"expected one of {sorted(SPEC_TYPES)}")
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - allowed - {"schema", "op"}
    if unknown:
        raise SpecError(sorted(unknown)[0], data[sorted(unknown)[0]], f"unknown key for op {op!r}")
    missing = {f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING} - set(data)
    if missing:
        raise SpecError(sorted(missing)[0], None, f"required for op {op!r}")
    return cls(**{k: v for k, v in data.items() if k in allowed})
