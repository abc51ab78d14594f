"""CPU: msgpack is decoded within what a record or a bundle can hold. A few megabytes of empty maps or
lists inside a well-framed, correctly checksummed record or bundle are refused before they are built
(they decoded to ~140 bytes of objects per byte), and `cache import` and `unpack_bundle` read a
payload by one rule: a truncated records array is refused by both."""

from __future__ import annotations

import logging
import time
import tracemalloc

import msgpack
import pytest

from cudnn_graphs import ConvFwdSpec, Session, signature
from cudnn_graphs.plan import restore
from cudnn_graphs.environment import Environment
from plan_cache import CorruptRecordError, PlanRecord, PlanStore
from plan_cache import record as record_mod
from plan_cache.bundle import CorruptBundleError, ImportReport, import_bundle, pack_bundle, pack_frame, unpack_bundle

SPEC = ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1)
ENV = Environment(gpu_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132,
                  cudnn_backend_version=91900, cudnn_frontend_version="1.28.0", cuda_driver_version=13000,
                  cuda_runtime_version=13000)
# 2 MB of empty maps in lists short enough for any per-list limit: ~2M objects if built.
EMPTY_MAPS = [[{}] * 50_000 for _ in range(40)]


def _meta(**extra) -> dict:
    return {"schema": 1, "spec": SPEC.to_dict(), "environment": ENV.to_dict(), "fused": True, "intermediates": {},
            "parts": [{"kind": "cudnn", "name": "conv_fwd", "engine": "eng0", "engine_id": 0, "knobs": {},
                       "workspace_size": 0, "behavior_notes": [], "roles": ["x", "w", "y"], "scalars": [],
                       "nondeterministic_excluded": False, "blob_index": 0}], "chosen_by": "heuristics", **extra}


def _record_file(meta) -> bytes:
    """A record file with a correct frame and checksum around any meta (PlanRecord would refuse it)."""
    return pack_frame_record({"key": signature(SPEC, ENV), "blob": b"\x91\xc0", "meta": meta, "created": 1.0})


def pack_frame_record(fields: dict) -> bytes:
    return record_mod.pack_frame(msgpack.packb(fields, use_bin_type=True))


def _peak_mb(call) -> float:
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 1e6


@pytest.mark.parametrize("meta", [{"junk": EMPTY_MAPS}, EMPTY_MAPS], ids=["in-meta", "as-meta"])
def test_a_record_of_megabytes_of_empty_maps_is_refused_before_it_is_built(meta):
    data = _record_file(meta)
    assert len(data) > 2_000_000

    def decode():
        with pytest.raises(CorruptRecordError, match="over the 1048576-byte limit"):
            record_mod.decode(data)

    assert _peak_mb(decode) < 3 * len(data) / 1e6  # built, it was over 200 MB


def test_such_an_entry_in_a_bundle_counts_as_corrupt_without_being_built(tmp_path):
    (tmp_path / "b.cgb").write_bytes(pack_bundle([_record_file({"junk": EMPTY_MAPS})]))
    store = PlanStore(tmp_path / "cache")
    report = {}
    assert _peak_mb(lambda: report.update(r=import_bundle(store, tmp_path / "b.cgb"))) < 20
    assert report["r"] == ImportReport(corrupt=1) and list(store.keys()) == []


def test_a_record_within_the_limits_still_decodes():
    meta = _meta(tuning={"candidates": [{"engine": f"eng{i}", "knobs": {"k": i}, "median_ms": 0.1 * i,
                                         "error": "e" * 300} for i in range(1000)]})
    record = PlanRecord(key=signature(SPEC, ENV), blob=b"\x00" * 300_000, meta=meta)
    assert record_mod.decode(record_mod.encode(record)).record == record


@pytest.mark.parametrize("fields", [{"format": 1, "created": EMPTY_MAPS, "records": []},
                                    {"format": 1, "created": 0.0, "records": [EMPTY_MAPS]}], ids=["created", "entry"])
def test_a_bundle_field_of_megabytes_of_empty_maps_is_refused_before_it_is_built(tmp_path, fields):
    data = pack_frame(msgpack.packb(fields, use_bin_type=True))
    (tmp_path / "b.cgb").write_bytes(data)
    store = PlanStore(tmp_path / "cache")

    def refused():
        with pytest.raises(CorruptBundleError, match="wrong types|not binary"):
            import_bundle(store, tmp_path / "b.cgb")
        with pytest.raises(CorruptBundleError, match="wrong types|not binary"):
            unpack_bundle(data)

    assert _peak_mb(refused) < 3 * len(data) / 1e6


def test_a_truncated_records_array_is_refused_by_import_and_unpack_alike(tmp_path):
    entries = [record_mod.encode(PlanRecord(key=signature(SPEC.replace(padding=p), ENV), blob=b"x", meta=_meta()))
               for p in (0, 1)]
    pack = msgpack.Packer(use_bin_type=True).pack
    head = b"\x83" + pack("format") + pack(1) + pack("created") + pack(0.0) + pack("records")
    data = pack_frame(head + b"\x93" + b"".join(map(pack, entries)))  # says three records; the payload ends after two
    (tmp_path / "cut.cgb").write_bytes(data)
    store = PlanStore(tmp_path / "cache")
    with pytest.raises(CorruptBundleError, match="truncated"):
        unpack_bundle(data)
    with pytest.raises(CorruptBundleError, match="truncated"):
        import_bundle(store, tmp_path / "cut.cgb")
    assert list(store.keys()) == []


def test_a_blob_holding_more_than_its_parts_is_refused_on_load(caplog):
    blob = msgpack.packb([b"plan"] + [b""] * 100_000, use_bin_type=True)  # one part; 100k empty bins after it
    record = PlanRecord(key=signature(SPEC, ENV), blob=blob, meta=_meta(created=time.time()))
    with caplog.at_level(logging.WARNING, logger="cudnn_graphs"):
        assert restore.load_plan(record, spec=SPEC, session=Session(cache=False)) is None
    assert "unusable" in caplog.text and "max_array_len" in caplog.text
