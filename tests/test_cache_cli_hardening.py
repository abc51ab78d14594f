"""CPU: `cudnn-graphs cache` as a careless user and an imported bundle meet it: an empty or mistyped path,
a directory that is not a cache, an output that is a FIFO or a device, hostile record meta; `--json`
stays JSON. Also record mode's lock file and `warmup --emit`'s output."""

from __future__ import annotations

import logging
import os

import pytest

import cudnn_graphs as cg
from cudnn_graphs import recording

from .test_plan_cache_bundle import SPECS

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX FIFOs, device nodes and modes")


# --- item 2: record mode's lock file -----------------------------------------------------------------------------

def test_record_mode_never_follows_a_linked_lock_file(tmp_path, caplog):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "specs.jsonl"
    os.symlink(victim, f"{path}.lock")
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"), cg.record(path):
        recording.note(SPECS[0])
    assert victim.read_text() == "precious" and os.path.islink(f"{path}.lock")
    assert "recording stops" in caplog.text
