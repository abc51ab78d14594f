"""Reading the frontend's serialized plans without the frontend (graph/serialized.py)."""

from __future__ import annotations

import struct

import pytest

from cudnn_graphs.graph import serialized
from cudnn_graphs.graph.serialized import UBJSONError, backend_plan, loads

from .ubjson import dumps

PLAN_JSON = '{"engineId": 4, "knobs": {"k24": 23}, "operationGraph": "..."}'


def _doc(**changes):
    doc = {"context": {"name": "conv_fwd", "sm_count": -1}, "json_version": "1.0", "cudnn_backend_version": "9.19.0",
           "cudnn_frontend_version": 12800, "nodes": [{"tag": "CONV_FPROP", "inputs": {"X": "x"}}],
           "tensors": {"x": {"uid": 1, "dim": [2, 16, 10, 10], "stride": [1600, 1, 160, 16]}},
           "cudnn_backend_data": PLAN_JSON, "variant_pack_uids": [1, 2, 3, 4], "behavior_notes": [[]],
           "pass_by_values": {}, "workspace_modifications": {}, "variant_pack_replacements": {},
           "fe_workspace_size": 0, "tensors_to_dump": []}
    doc.update(changes)
    return doc


@pytest.mark.parametrize("value", [None, True, False, 0, -1, 127, 128, 255, 256, -129, 2**15, -2**31 - 1, 2**40,
                                   -2**63, 2**64 - 1, 1.5, -0.0, "", "héllo", [], {}, [1, [2, [3]]],
                                   {"a": {"b": [1, "x", None]}}])
def test_round_trips_what_nlohmann_writes(value):
    assert loads(dumps(value)) == value


def test_optimized_containers_and_noops():
    assert loads(b"[$i#U\x03\x01\x02\x03") == [1, 2, 3]  # typed, counted array
    assert loads(b"[#i\x02Si\x01aT") == ["a", True]
    assert loads(b"{#i\x01i\x01kSi\x01v") == {"k": "v"}
    assert loads(b"[$Z#i\x02") == [None, None]
    assert loads(b"N[NU\x05N]") == [5]
    assert loads(b"d" + struct.pack(">f", 0.5)) == 0.5
    assert loads(b"Cx") == "x"


@pytest.mark.parametrize("data", [b"", b"S", b"Si\x05abc", b"[U\x01", b"{i\x01k", b"Q", b"Si\xffab", b"[$U]",
                                  b"S" + b"d" + b"\x00" * 4, b"Si\x02\xff\xfe", b"TT"])
def test_damaged_bytes_are_a_typed_error(data):
    with pytest.raises(UBJSONError):
        loads(data)


def test_nesting_is_bounded():
    with pytest.raises(UBJSONError, match="nested"):
        loads(b"[" * 5000 + b"]" * 5000)


def test_a_plain_plan_runs_on_the_backend():
    found = backend_plan(dumps(_doc()))
    assert found == serialized.BackendPlan(PLAN_JSON.encode(), frozenset({1, 2, 3, 4}), frozenset())


def test_pass_by_value_scalars_are_reported():
    found = backend_plan(dumps(_doc(pass_by_values={"7": {"index": 1, "value": 0.5}})))
    assert found is not None and found.scalar_uids == {7}


@pytest.mark.parametrize("changes", [{"workspace_modifications": {"9": [0, 64, [0.0]]}},
                                     {"variant_pack_replacements": {"3": 5}}, {"fe_workspace_size": 256},
                                     {"tensors_to_dump": [[4, "b"]]}, {"variant_pack_uids": []},
                                     {"variant_pack_uids": ["x"]}, {"pass_by_values": {"x": 1}}])
def test_what_the_frontend_adds_at_execute_time_keeps_it_on_the_frontend(changes):
    assert backend_plan(dumps(_doc(**changes))) is None


def test_a_frontend_without_the_newer_fields_still_loads():
    doc = _doc()
    for field in ("pass_by_values", "workspace_modifications", "tensors_to_dump", "fe_workspace_size"):
        del doc[field]
    assert backend_plan(dumps(doc)) is not None


@pytest.mark.parametrize("doc", [[1, 2], {"cudnn_backend_data": 3}, {}])
def test_not_a_serialized_plan(doc):
    with pytest.raises(UBJSONError):
        backend_plan(dumps(doc))


# The backend binding and the environment read without the frontend (execute/cudnn_backend.py).

def _has_gpu() -> bool:
    from cudnn_graphs import environment

    return environment().has_gpu


def test_backend_binding_reads_the_library_the_frontend_loads():
    cudnn = pytest.importorskip("cudnn")
    from cudnn_graphs.execute import cudnn_backend

    assert cudnn_backend.version() == int(cudnn.backend_version())
    assert cudnn_backend.cudart_version() > 0


def test_environment_versions_match_the_frontend_without_importing_it():
    import subprocess
    import sys

    code = ("import sys, importlib; env = importlib.import_module('cudnn_graphs.environment'); "
            "print(env._cudnn_versions(), 'cudnn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    cudnn = pytest.importorskip("cudnn")
    assert out[-1] == "False", "reading the versions imported the frontend"
    assert " ".join(out[:-1]) == str((int(cudnn.backend_version()), cudnn.__version__,
                                      int(__import__("ctypes").CDLL("libcudnn.so.9").cudnnGetCudartVersion())))


def test_no_gpu_gives_a_typed_backend_error():
    pytest.importorskip("cudnn")
    if _has_gpu():
        pytest.skip("a GPU is present")
    from cudnn_graphs.errors import CudnnBackendError, CudnnGraphsError
    from cudnn_graphs.execute import cudnn_backend

    with pytest.raises(CudnnBackendError) as info:
        cudnn_backend.create_handle()
    assert isinstance(info.value, CudnnGraphsError) and info.value.call == "cudnnCreate" and info.value.status != 0
    assert "CUDNN_STATUS" in str(info.value)
