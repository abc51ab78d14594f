"""Hypothesis fuzz of what users and files hand the library: any JSON value in any spec field, any
bytes in a spec file. Anything but a spec, a SpecError, or (for files) an error on the line fails."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudnn_graphs as cg
from cudnn_graphs import SpecError
from cudnn_graphs.recording import read_spec_file

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = ["x_shape", "w_shape", "dy_shape", "padding", "stride", "dilation", "groups", "dtype", "compute_dtype",
          "allow_tf32", "layout", "strides", "bias", "activation", "residual", "alpha", "beta",
          "activation_backward", "bias_grad", "schema", "op"]
BASE = {"fwd": cg.ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3)).to_dict(),
        "bwd_data": cg.ConvBwdDataSpec((2, 4, 9, 9), (4, 8, 3, 3), (2, 8, 11, 11)).to_dict(),
        "bwd_filter": cg.ConvBwdFilterSpec((2, 8, 11, 11), (2, 4, 9, 9), (4, 8, 3, 3)).to_dict()}

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                    st.integers(min_value=-10 ** 500, max_value=10 ** 500), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["same", "valid", "NHWC", "relu", "float16", "cuda"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=20)


@FUZZ
@given(family=st.sampled_from(sorted(BASE)), changes=st.dictionaries(st.sampled_from(FIELDS), values, max_size=4))
def test_any_value_in_any_field_is_a_spec_or_a_spec_error(family, changes):
    data = {**BASE[family], **changes}
    try:
        spec = cg.spec_from_dict(data)
    except SpecError as err:
        assert len(str(err)) < 2000 and err.field  # bounded, and names a field
        return
    assert cg.spec_from_dict(spec.to_dict()) == spec  # what was accepted round-trips


@FUZZ
@given(lines=st.lists(st.one_of(st.binary(max_size=40), st.just(b"[" * 3000), values.map(
    lambda v: json.dumps(v, default=str).encode())), max_size=6))
def test_any_bytes_in_a_spec_file_are_lines_or_errors_on_their_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fuzz") / "specs.jsonl"
    path.write_bytes(b"\n".join(lines))
    for _, number, data, error in read_spec_file(str(path)):
        assert number >= 1 and (data is None) != (error is None)
        if data is not None:
            try:
                cg.spec_from_dict(data)
            except SpecError:
                pass
