"""Shapes, padding, stride, dilation and memory layouts: parsing, checking, inference.

Shapes are logical: (N, C, *spatial) for activations and (K, C/groups, *filter) for filters,
whatever the memory layout; layouts only decide strides.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable, Mapping

from ..errors import SpecError

CHANNELS_FIRST = "channels_first"
CHANNELS_LAST = "channels_last"
_LAYOUT_ALIASES = {
    CHANNELS_FIRST: (CHANNELS_FIRST, None), CHANNELS_LAST: (CHANNELS_LAST, None),
    "NCW": (CHANNELS_FIRST, 3), "NCL": (CHANNELS_FIRST, 3), "NCHW": (CHANNELS_FIRST, 4),
    "NCDHW": (CHANNELS_FIRST, 5), "NWC": (CHANNELS_LAST, 3), "NLC": (CHANNELS_LAST, 3),
    "NHWC": (CHANNELS_LAST, 4), "NDHWC": (CHANNELS_LAST, 5),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or _is_numpy_int(value)


def _is_numpy_int(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu"


# cuDNN takes int64 dims and strides; a conv parameter or dim beyond int32, or a tensor of more than
# 2**62 elements (whose strides would overflow int64), describes no real convolution.
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**62


def _bounded(field: str, value: Any, items: tuple[int, ...]) -> None:
    if any(abs(v) > MAX_DIM for v in items):
        raise SpecError(field, value, f"every value must be at most {MAX_DIM}")


def shape(field: str, value: Any, *, rank: int | None = None) -> tuple[int, ...]:
    """A conv tensor shape: 3 to 5 positive ints (N, C and 1 to 3 spatial dims)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SpecError(field, value, "expected a sequence of ints")
    dims = tuple(value)
    if not all(_is_int(d) for d in dims):
        raise SpecError(field, value, "every dim must be an int")
    dims = tuple(int(d) for d in dims)
    if rank is None and not 3 <= len(dims) <= 5:
        raise SpecError(field, value, "expected 3 to 5 dims: N, C and 1, 2 or 3 spatial dims")
    if rank is not None and len(dims) != rank:
        raise SpecError(field, value, f"expected {rank} dims to match the other tensors")
    if any(d <= 0 for d in dims):
        raise SpecError(field, value, "every dim must be positive")
    _bounded(field, value, dims)
    if math.prod(dims) > MAX_ELEMENTS:
        raise SpecError(field, value, f"more than {MAX_ELEMENTS} elements: strides would overflow int64")
    return dims


# -- the conv arguments: stride, padding, dilation, groups -------------------------------------------
# One normaliser and one set of messages for every entry point: the specs (and so the requests and the
# functional helpers) and the torch layer, which passes torch_rules=True for the spellings torch's
# convolutions take: any integer (an object with __index__: numpy's, a SymInt), a tuple or list of one
# value for every dim, and only symmetric padding (torch pads both sides alike). Under torch's rules
# values beyond int32 pass here: torch's own convolution takes them, and the spec refuses them when a
# CUDA call builds one.

def conv_arguments(nd: int, stride: Any, padding: Any, dilation: Any, *, filter_dims: tuple[int, ...],
                   torch_rules: bool = False) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
    """(stride, padding as (pre, post) per spatial dim, dilation), checked in that order."""
    stride = per_dim("stride", stride, nd, minimum=1, torch_rules=torch_rules)
    dilation = per_dim("dilation", dilation, nd, minimum=1, torch_rules=torch_rules)
    pads = padding_pairs(padding, nd=nd, stride=stride, dilation=dilation, filter_dims=filter_dims,
                         torch_rules=torch_rules)
    return stride, pads, dilation


def per_dim(field: str, value: Any, nd: int, *, minimum: int, torch_rules: bool = False) -> tuple[int, ...]:
    """An int or one int per spatial dim (stride, dilation, explicit strides), each >= `minimum`."""
    single = _integer(value, torch_rules)
    items = (single,) * nd if single is not None else _sequence(value, nd, torch_rules)
    if single is None and len(items) == nd:
        items = tuple([_integer(v, torch_rules) for v in items])
    if len(items) != nd or not all(v is not None and v >= minimum for v in items):
        raise SpecError(field, value, f"expected an int >= {minimum} or {nd} of them")
    if not torch_rules:
        _bounded(field, value, items)
    return items


def groups(value: Any, *, torch_rules: bool = False) -> int:
    count = _integer(value, torch_rules)
    if count is None or count < 1:
        raise SpecError("groups", value, "expected an int >= 1")
    return count


def padding_pairs(value: Any, *, nd: int, stride: tuple[int, ...], dilation: tuple[int, ...],
                  filter_dims: tuple[int, ...], torch_rules: bool = False) -> tuple[tuple[int, int], ...]:
    """Padding as (pre, post) per spatial dim; takes an int, one per dim, (pre, post) pairs (not under
    torch's rules), 'valid' or 'same'."""
    if isinstance(value, str):
        return _padding_mode(value, nd=nd, stride=stride, dilation=dilation, filter_dims=filter_dims)
    single = _integer(value, torch_rules)
    pairs = ((single, single),) * nd if single is not None else _sequence(value, nd, torch_rules)
    if single is None and len(pairs) == nd:
        pairs = tuple([_pad_pair(value, item, torch_rules) for item in pairs])
    if len(pairs) != nd or any(p is None or p[0] < 0 or p[1] < 0 for p in pairs):
        raise SpecError("padding", value, f"expected 'valid', 'same', an int >= 0 or {nd} of them")
    if not torch_rules:
        _bounded("padding", value, tuple(p for pair in pairs for p in pair))
    return pairs


def _integer(value: Any, torch_rules: bool) -> int | None:
    """`value` as an int when it is one (never a bool): a Python or numpy int, or under torch's rules
    anything with __index__ (as torch's argument parser); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if torch_rules else int(value)  # the specs keep plain ints (an IntEnum would print apart)
    if torch_rules:  # no try/except: dynamo (torch 2.11) cannot trace a TypeError raised by operator.index
        return operator.index(value) if hasattr(type(value), "__index__") else None
    return int(value) if _is_numpy_int(value) else None


def _sequence(value: Any, nd: int, torch_rules: bool) -> tuple:
    """The items of a per-dim sequence (the caller checks there are `nd`): under torch's rules a tuple or
    list (torch.Size is one) of `nd` or of one for all dims."""
    if torch_rules:
        items = tuple(value) if isinstance(value, (tuple, list)) else ()
        return items * nd if len(items) == 1 else items
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return ()
    return tuple(value)


def _pad_pair(whole: Any, item: Any, torch_rules: bool) -> tuple[int, int] | None:
    """An item of a per-dim padding as (pre, post), None where it is neither an int nor a pair of them."""
    single = _integer(item, torch_rules)
    if single is not None:
        return single, single
    if isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
        pair = tuple(item)
        if len(pair) == 2 and all(_integer(p, torch_rules) is not None for p in pair):
            if torch_rules:
                raise SpecError("padding", whole, "torch's convolutions pad both sides alike: one int >= 0 per "
                                "spatial dim")
            return _integer(pair[0], False), _integer(pair[1], False)
    return None


def _padding_mode(mode: str, *, nd, stride, dilation, filter_dims) -> tuple[tuple[int, int], ...]:
    if mode == "valid":
        return ((0, 0),) * nd
    if mode != "same":
        raise SpecError("padding", mode, "the string forms are 'valid' and 'same'")
    if any(s != 1 for s in stride):
        raise SpecError("padding", mode, f"'same' needs stride 1, as in PyTorch (stride={stride})")
    # PyTorch puts the odd pixel of total padding at the end.
    totals = [d * (int(k) - 1) for d, k in zip(dilation, filter_dims)]
    return tuple((t // 2, t - t // 2) for t in totals)


def conv_output_dims(in_dims, filter_dims, pads, stride, dilation) -> tuple[int, ...]:
    """The textbook formula, per spatial dim: floor((i + pre + post - d*(k-1) - 1) / s) + 1."""
    return tuple(
        (i + pre + post - d * (k - 1) - 1) // s + 1
        for i, k, (pre, post), s, d in zip(in_dims, filter_dims, pads, stride, dilation)
    )


# torch's memory formats, recognised by name so that nothing here imports torch
_TORCH_FORMATS = {"torch.contiguous_format": CHANNELS_FIRST, "torch.channels_last": CHANNELS_LAST,
                  "torch.channels_last_3d": CHANNELS_LAST}


def canonical_layout(value: Any, rank: int) -> str:
    """The layout named by `value`: channels_first / channels_last, a dim-order name in any case
    (NCHW, nhwc, NDHWC ...), or torch's memory formats (torch.channels_last, torch.contiguous_format)."""
    if type(value).__name__ == "memory_format" and str(value) in _TORCH_FORMATS:
        return _TORCH_FORMATS[str(value)]
    key = None
    if isinstance(value, str):
        key = value if value in _LAYOUT_ALIASES else (value.lower() if value.lower() in _LAYOUT_ALIASES
                                                       else value.upper())
    if key not in _LAYOUT_ALIASES:
        raise SpecError("layout", value, f"expected one of {list(_LAYOUT_ALIASES)} (any case), or a torch memory "
                        "format")
    layout, alias_rank = _LAYOUT_ALIASES[key]
    if alias_rank is not None and alias_rank != rank:
        raise SpecError("layout", value, f"names a {alias_rank - 2}-D layout for {rank - 2}-D tensors")
    return layout


def packed_strides(dims: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Dense strides for logical dims (N, C, *spatial) in the given layout."""
    order = list(range(len(dims)))  # slowest to fastest
    if layout == CHANNELS_LAST:
        order = [0, *range(2, len(dims)), 1]
    strides = [0] * len(dims)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= dims[axis]
    return tuple(strides)


def strides_like_channels_last(dims: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """torch's reading of a 4-d / 5-d tensor's strides (c10's is_channels_last_strides_2d / _3d, step for
    step): the strides grow along C, W, H(, D), N. It decides the cases packed both ways (one channel,
    spatial dims of 1) by the strides given to the size-1 dims."""
    if len(dims) not in (4, 5) or strides[1] == 0:
        return False
    bound = 0
    for d in (1, *range(len(dims) - 1, 1, -1), 0):
        if dims[d] == 0 or strides[d] < bound or (d == 0 and bound == strides[1]):
            return False
        bound = strides[d] * dims[d] if dims[d] > 1 else strides[d]
    return True


def explicit_strides(value: Any, roles: Mapping[str, int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Validate {role: strides}; roles maps each allowed role to its rank. Canonical: sorted pairs."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = {str(role): strides for role, strides in items}
    except (TypeError, ValueError):
        raise SpecError("strides", value, "expected a mapping of tensor role to strides") from None
    out = []
    for role, strides in sorted(pairs.items()):
        if role not in roles:
            raise SpecError("strides", value, f"unknown tensor role {role!r}; expected one of {sorted(roles)}")
        out.append((role, per_dim(f"strides[{role!r}]", strides, roles[role], minimum=1)))
    return tuple(out)


def check_no_overlap(field: str, dims: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """Refuse strides under which two elements share memory (outputs would race, inputs alias)."""
    extent = 1
    for stride, dim in sorted((s, d) for s, d in zip(strides, dims) if d > 1):
        if stride < extent:
            raise SpecError(field, strides, f"strides overlap for dims {dims}: elements would alias")
        extent = stride * dim
