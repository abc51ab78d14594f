"""CPU: Session.prefetch reads spec files and iterables, counts what it finds, never raises."""

from __future__ import annotations

import json

import cudnn_graphs as cg


def _specs():
    return [cg.ConvFwdSpec((2, 8, 9, 9), (8, 8, 3, 3), padding=1, bias=True, activation="relu"),
            cg.ConvBwdDataSpec((2, 8, 9, 9), (8, 8, 3, 3), (2, 8, 9, 9), padding=1)]


def test_prefetch_of_an_empty_cache_finds_every_spec_missing(cache_dir):
    session = cg.Session()
    assert session.prefetch(_specs()).wait(timeout=30) == {"loaded": 0, "in_memory": 0, "missing": 2, "failed": 0}
    assert session.counters()["builds"] == 0  # a prefetch never builds


def test_prefetch_reads_a_spec_file_and_counts_bad_lines(tmp_path):
    path = tmp_path / "specs.jsonl"
    lines = [json.dumps(s.to_dict()) for s in _specs()] + ["{not json", json.dumps({"schema": 1, "op": "nope"})]
    path.write_text("\n".join(lines) + "\n# a comment\n")
    prefetch = cg.Session().prefetch(path, background=False)
    assert prefetch.done()
    assert prefetch.wait() == {"loaded": 0, "in_memory": 0, "missing": 2, "failed": 2}


def test_prefetch_skips_plans_already_in_memory():
    session = cg.Session(cache=False)
    spec = _specs()[0]
    session._memory[spec] = object()  # stands for a plan planned earlier
    assert session.prefetch([spec, _specs()[1]], background=False).wait() == \
        {"loaded": 0, "in_memory": 1, "missing": 1, "failed": 0}


def test_prefetch_of_an_unreadable_file_is_a_warning_not_an_error(tmp_path, caplog):
    result = cg.Session().prefetch(tmp_path / "absent.jsonl").wait(timeout=30)
    assert result["failed"] == 1 and "prefetch stopped" in caplog.text
