"""CPU: a spec whose own fields are in bounds but whose derived output is not (padding=2**31-1 makes a
4294967297-wide output; many output channels an output of over 2**62 elements) is a SpecError when it is
made, naming the derived shape and what it comes from, in the API, `check` and `warmup --dry-run`: it
passed both, and the graph build then printed the frontend's pybind signature."""

from __future__ import annotations

import json

import pytest

import cudnn_graphs as cg
from cudnn_graphs.cli import main

HUGE = 2 ** 31 - 1


@pytest.mark.parametrize("make, field", [
    (lambda: cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1), padding=HUGE), "y_shape"),
    (lambda: cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1), padding=(0, HUGE), residual=True), "y_shape"),
    (lambda: cg.ConvFwdSpec((1, 2, 3), (2, 2, 1), padding=((HUGE, HUGE),)), "y_shape"),
    (lambda: cg.ConvFwdSpec((2 ** 20, 1, 2 ** 20, 2 ** 20), (2 ** 12, 1, 1, 1)), "y_shape"),
    (lambda: cg.ConvBwdDataSpec((1, 2, 3, 3), (2, 2, 1, 1), (1, 2, 3, 3), padding=HUGE), "dy_shape"),
    (lambda: cg.ConvBwdFilterSpec((1, 2, 3, 3), (1, 2, 3, 3), (2, 2, 1, 1), padding=HUGE), "dy_shape"),
], ids=["fwd", "fwd-one-dim-residual", "fwd-1d", "fwd-elements", "dgrad", "wgrad"])
def test_a_derived_output_beyond_the_bounds_is_a_spec_error(make, field):
    with pytest.raises(cg.SpecError) as info:
        make()
    err = info.value
    assert err.field == field and "derived from x_shape=" in str(err)
    assert "at most 2147483647" in str(err) or "more than 4611686018427387904 elements" in str(err)


def test_the_largest_output_within_the_bounds_is_still_a_spec():
    spec = cg.ConvFwdSpec((1, 1, 1), (1, 1, 1), padding=((0, HUGE - 1),))
    assert spec.y_shape == (1, 1, HUGE)


def test_check_and_dry_run_report_it_on_its_line(tmp_path, capsys):
    data = cg.ConvFwdSpec((1, 2, 3, 3), (2, 2, 1, 1)).to_dict()
    data["padding"] = HUGE
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(data) + "\n")
    for argv in (["check", str(path)], ["warmup", "--dry-run", str(path)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert f"{path}:1: SpecError: y_shape=" in err and "incompatible function arguments" not in err
