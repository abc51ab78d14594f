"""plan_cache.bundle: export/import of many records in one self-checking file. CPU only."""

from __future__ import annotations

import os
import pickle
import time

import msgpack
import pytest

from cudnn_graphs import ConvBwdDataSpec, ConvBwdFilterSpec, ConvFwdSpec, signature
from cudnn_graphs.cache.policy import keep_stored as policy_keep
from cudnn_graphs.environment import Environment
from plan_cache import CacheError, CorruptRecordError, PlanRecord, PlanStore
from plan_cache import record as record_mod
from plan_cache.bundle import (BUNDLE_MAGIC, HEADER_SIZE, CorruptBundleError, ImportReport, export_bundle,
                               import_bundle, pack_bundle, pack_frame, unpack_bundle)

H100 = Environment(gpu_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132,
                   cudnn_backend_version=91900, cudnn_frontend_version="1.28.0",
                   cuda_driver_version=13000, cuda_runtime_version=13000)
A100 = Environment(gpu_name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), sm_count=108,
                   cudnn_backend_version=91900, cudnn_frontend_version="1.28.0",
                   cuda_driver_version=13000, cuda_runtime_version=13000)
SPECS = (ConvFwdSpec((2, 8, 9, 9), (4, 8, 3, 3), padding=1),
         ConvBwdDataSpec((2, 4, 9, 9), (4, 8, 3, 3), (2, 8, 9, 9), padding=1, dtype="float16"),
         ConvBwdFilterSpec((2, 8, 9, 9), (2, 4, 9, 9), (4, 8, 3, 3), padding=1))


def make_record(spec=SPECS[0], env=H100, *, chosen_by="heuristics", blob=b"\x01plan" * 40) -> PlanRecord:
    """A record shaped like cudnn_graphs.cache.records.plan_to_record makes, without a GPU."""
    meta = {"schema": 1, "library_version": "0.0.test", "spec": spec.to_dict(), "environment": env.to_dict(),
            "fused": True, "acc_dtype": "float32", "intermediates": {},
            "parts": [{"kind": "cudnn", "name": spec.op, "engine": "eng0_k2=1_k3=0", "engine_id": 0,
                       "knobs": {"k2": 1, "k3": 0}, "workspace_size": 4096, "behavior_notes": []}],
            "chosen_by": chosen_by, "created": time.time(), "build_ms": 12.5}
    return PlanRecord(key=signature(spec, env), blob=blob, meta=meta)


@pytest.fixture
def source(tmp_path) -> PlanStore:
    store = PlanStore(tmp_path / "source")
    for spec in SPECS:
        assert store.put(make_record(spec))
    return store


@pytest.fixture
def dest(tmp_path) -> PlanStore:
    return PlanStore(tmp_path / "dest")


def records_of(store: PlanStore) -> dict[str, PlanRecord]:
    return {key: store.get(key) for key in store.keys()}


# --- round trip ----------------------------------------------------------------------------------------------

def test_round_trip_keeps_every_record(source, dest, tmp_path):
    path = tmp_path / "plans.cgb"
    assert export_bundle(source, path) == 3
    assert path.read_bytes().startswith(BUNDLE_MAGIC)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp debris
    assert import_bundle(dest, path) == ImportReport(imported=3)
    assert records_of(dest) == records_of(source)


def test_export_of_chosen_keys_and_of_an_empty_store(source, dest, tmp_path):
    keys = sorted(source.keys())[:2]
    assert export_bundle(source, tmp_path / "two.cgb", keys=keys) == 2
    assert import_bundle(dest, tmp_path / "two.cgb").imported == 2
    assert sorted(dest.keys()) == keys
    assert export_bundle(PlanStore(tmp_path / "empty"), tmp_path / "none.cgb") == 0
    assert import_bundle(dest, tmp_path / "none.cgb") == ImportReport()


def test_export_of_a_missing_key_writes_nothing(source, tmp_path):
    path = tmp_path / "x.cgb"
    with pytest.raises(KeyError):
        export_bundle(source, path, keys=[next(source.keys()), "ff" + "0" * 62])
    assert not path.exists()
    with pytest.raises(ValueError):
        export_bundle(source, path, keys=["../escape"])


def test_export_replaces_a_file_atomically_and_cleans_up_on_failure(source, tmp_path):
    path = tmp_path / "plans.cgb"
    path.write_bytes(b"old")
    assert export_bundle(source, path) == 3
    assert len(unpack_bundle(path.read_bytes())) == 3
    with pytest.raises(FileNotFoundError):
        export_bundle(source, tmp_path / "no-such-dir" / "plans.cgb")
    assert sorted(os.listdir(tmp_path)) == ["plans.cgb", "source"]


# --- the outer check -----------------------------------------------------------------------------------------

def _bundle_bytes(source, tmp_path) -> bytes:
    export_bundle(source, tmp_path / "good.cgb")
    return (tmp_path / "good.cgb").read_bytes()


@pytest.mark.parametrize("where", [0, 7, 8, 10, 17, 18, 49, HEADER_SIZE, -1],
                         ids=["magic", "magic-nul", "version", "length", "length-top", "digest", "digest-end",
                              "payload-start", "payload-end"])
def test_a_flipped_bit_anywhere_refuses_the_whole_bundle(source, dest, tmp_path, where):
    data = bytearray(_bundle_bytes(source, tmp_path))
    data[where] ^= 0x10
    path = tmp_path / "bad.cgb"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBundleError) as err:
        import_bundle(dest, path)
    assert err.value.path == os.fspath(path) and str(path) in str(err.value)
    assert isinstance(err.value, CorruptRecordError) and isinstance(err.value, CacheError)
    assert list(dest.keys()) == []


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, -1])
def test_truncated_or_extended_bundle_is_refused(source, dest, tmp_path, cut):
    data = _bundle_bytes(source, tmp_path)
    for forged in (data[:cut], data + b"\0"):
        (tmp_path / "bad.cgb").write_bytes(forged)
        with pytest.raises(CorruptBundleError):
            import_bundle(dest, tmp_path / "bad.cgb")
    assert list(dest.keys()) == []


def test_wrong_magic_names_the_file_kind(source, dest, tmp_path):
    record_file = record_mod.encode(make_record())  # a record file is not a bundle
    (tmp_path / "rec.cgb").write_bytes(record_file)
    with pytest.raises(CorruptBundleError, match="not a cudnn-graphs plan bundle"):
        import_bundle(dest, tmp_path / "rec.cgb")


@pytest.mark.parametrize("payload, match", [
    (msgpack.packb([1, 2]), "payload fields"),
    (msgpack.packb({"format": 1, "created": 0.0}), "payload fields"),
    (msgpack.packb({"format": 1, "created": 0.0, "records": [b"x"], "extra": 1}), "payload fields"),
    (msgpack.packb({"format": True, "created": 0.0, "records": []}), "payload format"),
    (msgpack.packb({"format": 2, "created": 0.0, "records": []}), "payload format"),
    (msgpack.packb({"format": 1, "created": 0, "records": []}), "wrong types"),
    (msgpack.packb({"format": 1, "created": 0.0, "records": {}}), "wrong types"),
    (msgpack.packb({"format": 1, "created": 0.0, "records": ["text"]}, use_bin_type=True), "not binary"),
    (msgpack.packb({"format": 1, "created": 0.0, "records": [msgpack.ExtType(1, b"x")]}), "extension type"),
    (b"\xc1", "not msgpack"),
], ids=["list", "missing", "extra", "bool-format", "format-2", "int-created", "dict-records", "str-entry", "ext",
        "garbage"])
def test_a_well_framed_bad_payload_is_refused(dest, tmp_path, payload, match):
    (tmp_path / "bad.cgb").write_bytes(pack_frame(payload))
    with pytest.raises(CorruptBundleError, match=match):
        import_bundle(dest, tmp_path / "bad.cgb")


def test_another_format_version_is_refused(dest, tmp_path):
    (tmp_path / "v2.cgb").write_bytes(pack_bundle([record_mod.encode(make_record())], version=2))
    with pytest.raises(CorruptBundleError, match="format version 2"):
        import_bundle(dest, tmp_path / "v2.cgb")


def test_missing_file_is_an_os_error(dest, tmp_path):
    with pytest.raises(FileNotFoundError):
        import_bundle(dest, tmp_path / "nope.cgb")


def test_corrupt_bundle_error_pickles():
    err = pickle.loads(pickle.dumps(CorruptBundleError("checksum mismatch", "/x/y.cgb")))
    assert (err.reason, err.path, str(err)) == ("checksum mismatch", "/x/y.cgb",
                                                 "corrupt plan bundle '/x/y.cgb': checksum mismatch")


# --- entries -------------------------------------------------------------------------------------------------

def test_corrupt_entries_are_counted_and_the_rest_imported(dest, tmp_path):
    good = [record_mod.encode(make_record(spec)) for spec in SPECS]
    flipped = bytearray(good[1])
    flipped[-3] ^= 1
    bad_key = record_mod.pack_frame(msgpack.packb(
        {"key": "../../etc/passwd", "blob": b"", "meta": {}, "created": 0.0}, use_bin_type=True))
    entries = [good[0], bytes(flipped), good[2], b"junk", bad_key]
    (tmp_path / "mixed.cgb").write_bytes(pack_bundle(entries))
    assert import_bundle(dest, tmp_path / "mixed.cgb") == ImportReport(imported=2, corrupt=3)
    assert sorted(dest.keys()) == sorted(make_record(s).key for s in (SPECS[0], SPECS[2]))
    assert not (tmp_path / "etc").exists()


def test_accept_filters_records_and_counts_them(dest, tmp_path):
    records = [make_record(SPECS[0], H100), make_record(SPECS[1], A100), make_record(SPECS[2], A100)]
    (tmp_path / "fleet.cgb").write_bytes(pack_bundle(record_mod.encode(r) for r in records))
    report = import_bundle(dest, tmp_path / "fleet.cgb",
                           accept=lambda r: r.meta["environment"]["gpu_name"] == H100.gpu_name)
    assert report == ImportReport(imported=1, skipped_rejected=2)
    assert list(dest.keys()) == [records[0].key]


def test_keep_existing_never_replaces_autotuned_with_heuristic(dest, tmp_path):
    tuned = make_record(chosen_by="autotune", blob=b"tuned")
    assert dest.put(tuned)
    (tmp_path / "h.cgb").write_bytes(pack_bundle([record_mod.encode(make_record(chosen_by="heuristics"))]))
    assert import_bundle(dest, tmp_path / "h.cgb", keep_existing=policy_keep) == ImportReport(skipped_kept=1)
    assert dest.get(tuned.key) == tuned
    assert import_bundle(dest, tmp_path / "h.cgb").imported == 1  # no policy: the bundle's record replaces it
    assert dest.get(tuned.key).meta["chosen_by"] == "heuristics"


def test_keep_existing_lets_autotuned_replace_heuristic(dest, tmp_path):
    assert dest.put(make_record(chosen_by="heuristics", blob=b"heur"))
    tuned = make_record(chosen_by="autotune", blob=b"tuned")
    (tmp_path / "t.cgb").write_bytes(pack_bundle([record_mod.encode(tuned)]))
    assert import_bundle(dest, tmp_path / "t.cgb", keep_existing=policy_keep) == ImportReport(imported=1)
    assert dest.get(tuned.key) == tuned


def test_keep_existing_gets_new_and_old(dest, tmp_path):
    old = make_record(blob=b"old")
    dest.put(old)
    new = make_record(blob=b"new")
    seen = []
    (tmp_path / "n.cgb").write_bytes(pack_bundle([record_mod.encode(new)]))
    import_bundle(dest, tmp_path / "n.cgb", keep_existing=lambda n, o: seen.append((n, o)) or False)
    assert seen == [(new, old)] and dest.get(new.key) == new


def test_records_the_store_cannot_write_are_counted_as_failed(tmp_path):
    small = PlanStore(tmp_path / "small", max_bytes=64)  # smaller than any record
    (tmp_path / "b.cgb").write_bytes(pack_bundle([record_mod.encode(make_record())]))
    assert import_bundle(small, tmp_path / "b.cgb") == ImportReport(failed=1)
    assert import_bundle(small, tmp_path / "b.cgb", keep_existing=policy_keep) == ImportReport(failed=1)


def test_a_bad_field_after_the_records_still_writes_nothing(dest, tmp_path):
    """Import streams a record at a time, but checks the whole payload before writing the first."""
    payload = msgpack.packb({"records": [record_mod.encode(make_record())], "format": 2, "created": 0.0},
                            use_bin_type=True)
    (tmp_path / "late.cgb").write_bytes(pack_frame(payload))
    with pytest.raises(CorruptBundleError, match="payload format"):
        import_bundle(dest, tmp_path / "late.cgb")
    assert list(dest.keys()) == []
