"""grid_sample kernels compile with NVRTC for sm_80 and sm_90 (no GPU), and its argument checking runs on CPU."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from cudnn_graphs.errors import BufferMismatchError, SpecError
from fallback_kernels import compile as kc
from fallback_kernels import grid_sample as gs


# (dtype, program) for every program a plan of that dtype may compile, and the instantiations it holds.
_PROGRAM_CASES = [(dtype, program) for dtype in gs.CTYPES for program in gs.programs(dtype)]


@pytest.mark.parametrize("dtype, program", _PROGRAM_CASES, ids=[f"{d}-{p}" for d, p in _PROGRAM_CASES])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_program_compiles_from_its_own_source(arch, dtype, program):
    """What a plan compiles: one program (its .cu, the shared header pasted in) with its instantiations of a dtype."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    names = gs.programs(dtype)[program]
    lowered = kc.nvrtc_check(program, names, arch, gs.OPTIONS)
    assert all(lowered[name] for name in names)  # every instantiation exists


def test_the_one_file_view_holds_every_program():
    """grid_sample.cu (for tools taking one file per source) pastes every program and the shared header once."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    text = kc.source("grid_sample.cu")
    assert text.count("struct Geo {") == 1 and text.count("struct half_t {") == 1 and '#include "' not in text
    one_each = [next(n for n in names if n.startswith(gs.PROGRAMS[program][0])) for program, names in
                gs.programs("float32").items()]
    assert len(one_each) == len(gs.PROGRAMS)
    assert all(kc.nvrtc_check("grid_sample.cu", one_each, "sm_90", gs.OPTIONS).values())


def _globals(text: str) -> set[str]:
    return set(re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\)\)?\s*)?(\w+)\(", text))


def test_each_kernel_is_defined_in_its_program_only():
    assert not _globals(kc.source("grid_sample_common.cuh"))
    for program, kernels in gs.PROGRAMS.items():
        text = kc.source(program)
        assert _globals(text) == set(kernels), program
        assert text.count("struct PointTaps<") == 3 and '#include "' not in text  # the shared header, once
    assert set(gs.name_expressions()) == {n for d in gs.CTYPES for names in gs.programs(d).values() for n in names}


def test_a_header_edit_changes_every_program_text_and_the_kernel_cache_key(monkeypatch):
    """CuPy's kernel cache (and NVRTC) see only the text compile.source makes: a header edit must reach it, or a
    stale binary would be loaded for an edited header."""
    pytest.importorskip("cupy")
    read = kc._read
    files = [*gs.PROGRAMS, "grid_sample.cu"]
    before = {f: kc.source(f) for f in files}
    for header in ("grid_sample_common.cuh", "types.cuh"):  # included directly, and through the shared header
        monkeypatch.setattr(kc, "_read", lambda f, h=header: read(f) + ("\n// edited\n" if f == h else ""))
        for f in files:
            edited = kc.source(f)
            assert edited != before[f] and edited.count("// edited") == 1, (header, f)
    # load_module hands that text to CuPy, whose on-disk cache keys on it (plus options, arch, NVRTC version)
    import cupy

    codes = []

    class FakeModule:
        def __init__(self, code, options, name_expressions):
            codes.append(code)

        def compile(self):
            pass

    monkeypatch.setattr(cupy, "RawModule", FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: __import__("contextlib").nullcontext())
    names = tuple(gs.programs("float32")["grid_sample_forward.cu"])
    monkeypatch.setattr(kc, "_read", read)
    kc.load_module.__wrapped__("grid_sample_forward.cu", names, 0)
    monkeypatch.setattr(kc, "_read", lambda f: read(f) + ("\n// edited\n" if f == "grid_sample_common.cuh" else ""))
    kc.load_module.__wrapped__("grid_sample_forward.cu", names, 0)
    assert codes[0] == before["grid_sample_forward.cu"] and codes[1] != codes[0] and "// edited" in codes[1]


# The kernels that read a point's taps through PointTaps, float io (f32 math), every mode. A tap index known only
# at run time (the deterministic gathers) once indexed PointTaps' arrays and put it in local memory (32-64 byte
# stack frames); the 16-bit and float64 variants have a few small frames of other origins.
_TAP_READERS = [f"{k}<float, float, {nd}, {m}>" for k in ("gs_forward", "gs_forward_plane", "gs_backward", "gs_keys", "gs_count",
                                                          "gs_gather", "gs_gather_exact") for nd, m in gs.VARIANTS]
_TAP_READERS += [f"gs_place<float, {nd}, {m}>" for nd, m in gs.VARIANTS]
_TAP_READERS += [f"{k}<float, float, {nd}, {m}>" for k in gs.CELL_KERNELS for nd, m in gs.VARIANTS if m != gs.BICUBIC]
_TAP_READERS += [f"gs_tile_gather<float, {nd}, {m}>" for nd, m in gs.VARIANTS]  # gs_tile_sort<float, 2, 2>: 8 bytes


def test_tap_readers_keep_the_taps_in_registers():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    found = {}
    for program in {gs.program_of(name) for name in _TAP_READERS}:
        names = [name for name in _TAP_READERS if gs.program_of(name) == program]
        found.update(kc.ptxas_resources(program, names, "sm_90", gs.OPTIONS))
    framed = {name: r for name, r in found.items() if r["stack_bytes"] or r["spill_stores"]}
    assert not framed, f"local memory in: {framed}"
    assert set(found) == set(_TAP_READERS) and all(r["registers"] > 0 for r in found.values())


def test_every_kernel_and_variant_is_instantiated():
    names = gs.name_expressions()
    for dtype, (t, a) in gs.CTYPES.items():
        for kernel in gs.KERNELS + gs.CELL_KERNELS:
            for nd, mode in gs.VARIANTS:
                expected = kernel in gs.KERNELS or mode != gs.BICUBIC  # cell keys: bilinear and nearest only
                assert (f"{kernel}<{t}, {a}, {nd}, {mode}>" in names) == expected
            for nd, mode in gs.VARIANTS:  # the counting deterministic backward: not for float64
                for kernel in gs.COUNT_KERNELS:
                    assert (f"{kernel}<{t}, {a}, {nd}, {mode}>" in names) == (dtype != "float64")
                assert (f"gs_place<{a}, {nd}, {mode}>" in names) == (dtype != "float64")
        assert (f"gs_absmax<{t}>" in names) == (dtype != "float64")
        assert (f"gs_gg_sum<{t}>" in names) == (dtype != "float64")
        for nd, mode in gs.VARIANTS:  # the shared-memory fast backward: float accumulation only
            for kernel in gs.TILE_KERNELS:
                assert (f"{kernel}<{t}, {nd}, {mode}>" in names) == (dtype != "float64")
        assert f"gs_to_cl<{t}, {t}>" in names and f"gs_from_cl<{a}, {t}>" in names
    assert "gs_bounds" in names
    assert (3, gs.BICUBIC) not in gs.VARIANTS  # bicubic is 2-D only
    assert sorted(set(names)) == sorted(set(n for d in gs.CTYPES for n in gs.name_expressions(d)))


def _struct_fields(name: str) -> list[str]:
    body = gs.source().split(f"struct {name} {{", 1)[1].split("};", 1)[0]
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:
            assert decl.startswith("long long "), decl
            fields += [f.strip() for f in decl[len("long long "):].split(",")]
    return fields


def test_structs_match_the_cuda_source():
    assert _struct_fields("Geo") == list(gs.GEO_FIELDS)
    assert _struct_fields("Tr") == list(gs.TR_FIELDS)
    assert gs._GEO_DTYPE.itemsize == 8 * len(gs.GEO_FIELDS)


def test_enums_match_the_cuda_source():
    src = gs.source()

    def enum(first):
        body = src.split(f"enum {{ {first}", 1)[1].split("}", 1)[0]
        return [first] + [n.strip() for n in body.split(",") if n.strip()]

    assert enum("MODE_BILINEAR") == [f"MODE_{m.upper()}" for m in gs.MODES]
    assert enum("PAD_ZEROS") == [f"PAD_{p.upper()}" for p in gs.PADDINGS]
    flags = dict(re.findall(r"(F_\w+) = (\d+)", src))
    for name in ("F_GI", "F_GG", "F_IN_VEC", "F_GO_VEC", "F_GI_VEC", "F_POINT_FAST", "F_PLANE_VEC"):
        assert int(flags[name]) == getattr(gs, name)
    assert f"#define VEC {gs.VEC}" in src


@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="linear"), "mode"), (dict(mode=None), "mode"), (dict(padding_mode="zero"), "padding_mode"),
    (dict(padding_mode="reflect"), "padding_mode"), (dict(align_corners="yes"), "align_corners"),
    (dict(align_corners=None), "align_corners"),
])
def test_bad_options_raise_spec_error_before_touching_buffers(kwargs, field):
    opts = dict(mode="bilinear", padding_mode="zeros", align_corners=False) | kwargs
    cpu = np.zeros((1, 1, 2, 2), np.float32), np.zeros((1, 2, 2, 2), np.float32)
    with pytest.raises(SpecError) as err:
        gs.grid_sample(*cpu, **opts)
    assert err.value.field == field
    with pytest.raises(SpecError):
        gs.grid_sample_backward(np.zeros((1, 1, 2, 2), np.float32), *cpu, **opts)


def test_host_buffers_are_refused():
    with pytest.raises(BufferMismatchError) as err:
        gs.grid_sample(np.zeros((1, 1, 2, 2), np.float32), np.zeros((1, 2, 2, 2), np.float32),
                       mode="bilinear", padding_mode="zeros", align_corners=False)
    assert err.value.role == "input"


def _geo(ishape, gshape, dtype="float32", gdtype=None, **kw):
    return gs.geometry(ishape, gshape, dtype, gdtype or dtype, **kw)


def test_geometry_of_valid_shapes():
    g = _geo((2, 3, 5, 7), (2, 4, 6, 2))
    assert (g.nd, g.N, g.C, g.in_sp, g.out_sp) == (2, 2, 3, (1, 5, 7), (1, 4, 6))
    assert g.output_shape() == (2, 3, 4, 6)
    g = _geo((2, 3, 4, 5, 7), (2, 1, 4, 6, 3), mode="nearest", padding_mode="reflection", align_corners=True)
    assert (g.nd, g.in_sp, g.out_sp, g.mode, g.pad, g.align) == (3, (4, 5, 7), (1, 4, 6), gs.NEAREST, 2, True)
    assert g.output_shape() == (2, 3, 1, 4, 6)
    # empty batch, channels or output grid are valid (nothing to do)
    assert _geo((0, 3, 5, 7), (0, 4, 6, 2)).N == 0
    assert _geo((2, 0, 5, 7), (2, 4, 6, 2)).C == 0
    assert _geo((2, 3, 5, 7), (2, 0, 6, 2)).points == 0


@pytest.mark.parametrize("ishape, gshape, dtype, gdtype, kw, role, what", [
    ((2, 3, 5), (2, 4, 2), "float32", None, {}, "input", "rank"),
    ((2, 3, 5, 7, 1, 1), (2, 4, 6, 2, 1, 1), "float32", None, {}, "input", "rank"),
    ((2, 3, 5, 7), (2, 4, 6, 4, 3), "float32", None, {}, "grid", "rank"),
    ((2, 3, 5, 7), (2, 4, 6, 3), "float32", None, {}, "grid", "last dimension"),
    ((2, 3, 4, 5, 7), (2, 4, 6, 1, 2), "float32", None, {}, "grid", "last dimension"),
    ((2, 3, 5, 7), (3, 4, 6, 2), "float32", None, {}, "grid", "batch size"),
    ((2, 3, 0, 7), (2, 4, 6, 2), "float32", None, {}, "input", "spatial size"),
    ((2, 3, 5, 2**31), (2, 4, 6, 2), "float32", None, {}, "input", "spatial size"),
    ((2, 3, 5, 7), (2, 4, 6, 2), "int32", None, {}, "input", "dtype"),
    ((2, 3, 5, 7), (2, 4, 6, 2), "float16", "float32", {}, "grid", "dtype"),
])
def test_geometry_refuses(ishape, gshape, dtype, gdtype, kw, role, what):
    with pytest.raises(BufferMismatchError) as err:
        _geo(ishape, gshape, dtype, gdtype, **kw)
    assert (err.value.role, err.value.what) == (role, what)


def test_bicubic_is_2d_only():
    _geo((1, 1, 4, 4), (1, 2, 2, 2), mode="bicubic")
    with pytest.raises(SpecError) as err:
        _geo((1, 1, 4, 4, 4), (1, 2, 2, 2, 3), mode="bicubic")
    assert (err.value.field, err.value.value) == ("mode", "bicubic")


def test_grad_output_checks():
    g = _geo((2, 3, 5, 7), (2, 4, 6, 2))
    gs._check_grad_output(g, (2, 3, 4, 6), "float32")
    with pytest.raises(BufferMismatchError, match="grad_output"):
        gs._check_grad_output(g, (2, 3, 6, 4), "float32")
    with pytest.raises(BufferMismatchError, match="dtype"):
        gs._check_grad_output(g, (2, 3, 4, 6), "float16")


def test_layout_helpers():
    shape = (2, 3, 4, 5)
    assert gs._cl_strides(shape) == (60, 1, 15, 3)
    assert gs._cl_strides((2, 3, 4, 5, 6)) == (360, 1, 90, 18, 3)
    assert gs._format_strides(shape, gs._cl_strides(shape), (2, 3, 6, 7)) == gs._cl_strides((2, 3, 6, 7))
    assert gs._format_strides(shape, (60, 20, 5, 1), (2, 3, 6, 7)) == (126, 42, 7, 1)
    assert gs._format_strides(shape, (1, 2, 6, 24), shape) == (60, 20, 5, 1)  # neither: contiguous
    assert gs._lanes_log2(1) == 0 and gs._lanes_log2(4) == 0 and gs._lanes_log2(5) == 1
    assert gs._lanes_log2(64) == 4 and gs._lanes_log2(32) == 3 and gs._lanes_log2(4096) == 5
    assert gs._vec_ok(0, gs._cl_strides((2, 4, 4, 5)), (2, 4, 4, 5), 4)
    assert not gs._vec_ok(0, (60, 20, 5, 1), (2, 4, 4, 5), 4)
    assert not gs._vec_ok(8, gs._cl_strides((2, 4, 4, 5)), (2, 4, 4, 5), 4)


def test_geo_struct_packs_fields_in_order():
    g = _geo((2, 3, 5, 7), (2, 4, 6, 2), padding_mode="border", align_corners=True)
    s = gs._geo_struct(g, inp=(1, 2, 3, 4, 5), grid=(6, 7, 8, 9, 10), go=(11, 12, 13, 14, 15), lanes_log2=2,
                       flags=gs.F_GI | gs.F_GG)
    values = s.view(np.int64).tolist()
    assert values == [2, 3, 1, 5, 7, 1, 4, 6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 1, 2, 3]


def test_backward_guarantee(monkeypatch):
    g = gs.backward_guarantee(deterministic=True, dtype="float16")
    assert (g["deterministic"], g["accumulator"], g["algorithm"]) == (True, "int64 fixed point",
                                                                      "counting-exact-gather")
    assert "sorted by (point, weight)" in g["shared_memory_form"]
    g = gs.backward_guarantee(deterministic=True, dtype="float64")  # float64 sums stay float64, sorted
    assert (g["deterministic"], g["accumulator"], g["algorithm"]) == (True, "float64", "sorted-gather")
    monkeypatch.setitem(gs.TUNING, "det_keys", "tap")
    g = gs.backward_guarantee(deterministic=True, dtype="bfloat16")
    assert (g["deterministic"], g["accumulator"], g["algorithm"]) == (True, "float32", "sorted-gather")
    g = gs.backward_guarantee(deterministic=False, dtype="float64")
    assert (g["deterministic"], g["accumulator"], g["algorithm"]) == (False, "float64", "atomic-scatter")
    with pytest.raises(SpecError):
        gs.backward_guarantee(deterministic=False, dtype="int8")


def _kernel_arity() -> dict[str, int]:
    """Parameter count of every __global__ function in grid_sample.cu."""
    src = gs.source()
    arity = {}
    for m in re.finditer(r"__global__ void (?:__launch_bounds__\([^)]*\)\)?\s*)?(\w+)\(([^)]*)\)", src):
        name, params = m.group(1), m.group(2)
        arity[name] = len([p for p in params.split(",") if p.strip()])
    return arity


H100_SHARED, H100_SMS = 232448, 132  # opt-in shared memory per block, multiprocessors


class _FakeFunction:
    def __init__(self, name):
        self.name = name


@pytest.fixture
def cpu_plans(monkeypatch):
    """Plans built on CPU: kernels are looked up by name in the program (and dtype) a plan would compile, never
    compiled or launched; yields the list of (program, dtype) lookups."""
    lookups = []

    def functions(device, program, dtype, options, variant):
        lookups.append((program, dtype))
        # KeyError: a name outside its program or its variant
        return {n: _FakeFunction(n) for n in gs.programs(dtype)[program] if gs.variant_of(n) == variant}

    monkeypatch.setattr(gs, "_functions", functions)
    monkeypatch.setattr(gs, "_device_limits", lambda device: (H100_SHARED, H100_SMS))
    gs._forward_plan.cache_clear()
    gs._backward_plan.cache_clear()
    yield lookups
    gs._forward_plan.cache_clear()
    gs._backward_plan.cache_clear()


def _check_plan(plan, external):
    arity = _kernel_arity()
    assert set(arity) >= {"gs_forward", "gs_backward", "gs_keys", "gs_gather", "gs_bounds", "gs_to_cl", "gs_from_cl",
                          "gs_cell_keys", "gs_cell_gather", "gs_absmax", "gs_count", "gs_place", "gs_gather_exact"}
    known = set(external) | {name for name, _ in plan.scratch}
    for op in plan.ops:
        refs = [a for a in (op[4] if op[0] == "launch" else op[1:]) if isinstance(a, gs._Ref)]
        assert all(r.name in known for r in refs), op
        if op[0] == "launch":
            _, fn, grid, block, args, name, shared = op
            assert name == fn.name
            base = fn.name.split("<")[0]
            assert len(args) == arity[base], (fn.name, len(args))
            assert all(0 < d < 2**31 for d in grid) and grid[1:] <= (65535, 65535)[: len(grid) - 1]
            assert 0 < __import__("math").prod(block) <= 1024
            assert 0 <= shared <= H100_SHARED and (shared > 0) == (base in gs.TILE_KERNELS + ("gs_forward_plane",))
            for a in args:
                if isinstance(a, np.ndarray):
                    assert a.dtype in (gs._GEO_DTYPE, gs._TR_DTYPE) and a.shape == (1,)
        elif op[0] == "zero":
            assert op[2] > 0


def _layouts(shape):
    yield gs._contiguous_strides(shape)
    yield gs._cl_strides(shape)
    yield tuple(s * 2 for s in gs._contiguous_strides(shape))  # a strided view


@pytest.mark.parametrize("det_keys", ["count", "cell", "tap"])
@pytest.mark.parametrize("nd", [2, 3])
def test_plans_for_every_configuration_build_on_cpu(cpu_plans, monkeypatch, nd, det_keys):
    monkeypatch.setitem(gs.TUNING, "det_keys", det_keys)
    ishape = (2, 6, 5, 7) if nd == 2 else (2, 6, 4, 5, 7)
    gshape = (2, 3, 4, 2) if nd == 2 else (2, 2, 3, 4, 3)
    oshape = ishape[:2] + gshape[1:-1]
    for dtype in gs.CTYPES:
        for mode in gs.MODES:
            if nd == 3 and mode == "bicubic":
                continue
            for strides in _layouts(ishape):
                ikey = (ishape, strides, dtype, 0)
                gkey = (gshape, gs._contiguous_strides(gshape), dtype, 0)
                okey = (oshape, gs._format_strides(ishape, strides, oshape), dtype, 0)
                plan = gs._forward_plan(0, ikey, gkey, mode, "border", True, gs._tuning_key())
                _check_plan(plan, {"input", "grid", "output"})
                assert plan.outputs["output"].shape == oshape
                for det in (False, True):
                    for need in ((True, True), (True, False), (False, True)):
                        plan = gs._backward_plan(0, okey, ikey, gkey, mode, "zeros", False, *need, det,
                                                 gs._tuning_key())
                        _check_plan(plan, {"grad_output", "input", "grid", "grad_input", "grad_grid"})
                        assert set(plan.outputs) == {r for r, n in zip(("grad_input", "grad_grid"), need) if n}
                        if need[0]:
                            assert plan.outputs["grad_input"].strides == gs._format_strides(ishape, strides, ishape)
                        kernels = {op[5].split("<")[0] for op in plan.ops if op[0] == "launch"}
                        counting = det_keys == "count" and dtype != "float64"
                        if det and need[0] and counting:  # no sort: count, scan, place, exact gather
                            assert not any(op[0] == "sort" for op in plan.ops)
                            launched = [op[5] for op in plan.ops if op[0] == "launch"]
                            assert [k for k in launched if k in gs.SCAN_KERNELS] == list(gs.SCAN_KERNELS)
                            assert {"gs_count", "gs_place", "gs_gather_exact"} <= kernels
                            # max |grad_output|: folded into its transpose, or its own kernel when none is needed
                            go_cl = gs._is_cl_layout(oshape, okey[1])
                            assert ("gs_absmax" in kernels) == go_cl
                            maxed = [op for op in plan.ops if op[0] == "launch" and op[5].startswith("gs_to_cl")
                                     and op[4][3] is not None]
                            assert len(maxed) == (0 if go_cl else 1)
                        elif det and need[0]:
                            assert any(op[0] == "sort" for op in plan.ops)
                            cell = det_keys == "cell" and mode != "bicubic"
                            assert ("gs_cell_gather" in kernels) == cell and ("gs_gather" in kernels) == (not cell)
                        else:
                            assert not {"gs_count", "gs_gather_exact"} & kernels


def test_each_plan_compiles_only_the_programs_of_its_kernels(cpu_plans):
    def programs_of(build):
        cpu_plans.clear()
        build()
        return {program for program, _ in cpu_plans}

    ishape, gshape = (2, 6, 5, 7), (2, 3, 4, 2)
    oshape = ishape[:2] + gshape[1:-1]
    for dtype in gs.CTYPES:
        ikey = (ishape, gs._contiguous_strides(ishape), dtype, 0)
        gkey = (gshape, gs._contiguous_strides(gshape), dtype, 0)
        okey = (oshape, gs._contiguous_strides(oshape), dtype, 0)
        forward = programs_of(lambda: gs._forward_plan(0, ikey, gkey, "bilinear", "zeros", False, gs._tuning_key()))
        assert forward == {"grid_sample_forward.cu"}
        fast = programs_of(lambda: gs._backward_plan(0, okey, ikey, gkey, "bilinear", "zeros", False, True, True,
                                                     False, gs._tuning_key()))
        assert fast == {"grid_sample_backward.cu", "grid_sample_layout.cu"}  # + the channels-last transposes
        det = programs_of(lambda: gs._backward_plan(0, okey, ikey, gkey, "bilinear", "zeros", False, True, True,
                                                    True, gs._tuning_key()))
        grad_input = "grid_sample_sorted.cu" if dtype == "float64" else "grid_sample_counting.cu"
        assert det == {grad_input, "grid_sample_backward.cu", "grid_sample_layout.cu"}
    plan = _fast_plan((32, 32, 64, 64), (32, 64, 64, 2))  # the shared-memory kernels alone
    assert {gs.program_of(op[5]) for op in plan.ops if op[0] == "launch"} == {"grid_sample_tile.cu"}


def test_empty_plans_launch_nothing(cpu_plans):
    for ishape, gshape in [((0, 3, 5, 6), (0, 4, 4, 2)), ((2, 0, 5, 6), (2, 4, 4, 2)), ((2, 3, 5, 6), (2, 0, 4, 2))]:
        ikey = (ishape, gs._contiguous_strides(ishape), "float32", 0)
        gkey = (gshape, gs._contiguous_strides(gshape), "float32", 0)
        oshape = ishape[:2] + gshape[1:-1]
        okey = (oshape, gs._contiguous_strides(oshape), "float32", 0)
        assert not gs._forward_plan(0, ikey, gkey, "bilinear", "zeros", False, gs._tuning_key()).ops
        for det in (False, True):
            plan = gs._backward_plan(0, okey, ikey, gkey, "bilinear", "zeros", False, True, True, det,
                                     gs._tuning_key())
            assert all(op[0] == "zero" for op in plan.ops)


def _fast_plan(ishape, gshape, dtype="float16", mode="bilinear", layout="contiguous", need=(True, True), residue=0):
    strides = {"contiguous": gs._contiguous_strides(ishape), "channels_last": gs._cl_strides(ishape),
               "strided": tuple(st * 2 for st in gs._contiguous_strides(ishape))}[layout]
    oshape = ishape[:2] + gshape[1:-1]
    ikey = (ishape, strides, dtype, residue)
    gkey = (gshape, gs._contiguous_strides(gshape), dtype, 0)
    okey = (oshape, gs._format_strides(ishape, strides, oshape), dtype, residue)
    plan = gs._backward_plan(0, okey, ikey, gkey, mode, "zeros", False, *need, False, gs._tuning_key())
    _check_plan(plan, {"grad_output", "input", "grid", "grad_input", "grad_grid"})
    return plan


def _launches(plan):
    return {op[5].split("<")[0]: op for op in plan.ops if op[0] == "launch"}


def _rounded(*sizes):
    return sum(-(-n // 256) * 256 for n in sizes)


def test_fast_backward_takes_the_tile_kernels_where_they_fit(cpu_plans):
    # the issue's f16 shape: 8 channels per 16-byte chunk -> 4 slices; 132 SMs // 32 items -> 4 pixel ranges
    plan = _fast_plan((32, 32, 64, 64), (32, 64, 64, 2))
    ops = _launches(plan)
    assert list(ops) == ["gs_tile_sort", "gs_tile_gather", "gs_gg_sum"]  # no memset, transposes or atomics
    assert not any(op[0] == "zero" for op in plan.ops)
    sort, gather = ops["gs_tile_sort"], ops["gs_tile_gather"]
    assert (sort[2], sort[3], gather[2], gather[3]) == ((4, 32), (1024,), (4, 32), (1024,))
    assert int(sort[4][-3]) == 1024 and int(gather[4][-1]) == 1024  # pixels per range
    # counts for 1024 pixels + as many staged entries as fit in 96 KiB; grad_output + input chunks
    assert sort[6] == 96 * 1024 and int(sort[4][-2]) == (96 * 1024 - 4096) // 8
    assert gather[6] == 16 * (4096 + 4096)
    entries, ends, partials = 32 * 4 * 4 * 4096 * 8, 32 * 4096 * 4, 4 * 32 * 4096 * 2 * 4
    assert plan.scratch_bytes == _rounded(entries, ends, partials)
    # grad_input only: the input is not read, nor staged; no partials
    plan = _fast_plan((32, 32, 64, 64), (32, 64, 64, 2), need=(True, False))
    gather = _launches(plan)["gs_tile_gather"]
    assert gather[6] == 16 * 4096 and gather[4][1] is None and gather[4][6] is None and gather[4][7] is None
    assert list(_launches(plan)) == ["gs_tile_sort", "gs_tile_gather"]
    # f32: 4 channels per chunk; one slice writes grad_grid itself
    plan = _fast_plan((160, 4, 32, 32), (160, 32, 32, 2), dtype="float32")
    assert list(_launches(plan)) == ["gs_tile_sort", "gs_tile_gather"]
    assert _launches(plan)["gs_tile_gather"][2] == (1, 160)
    # bicubic: 512 threads, 16 taps per point; nearest: grad_grid zeroed, nothing but grad_output staged
    plan = _fast_plan((32, 32, 64, 64), (32, 64, 64, 2), mode="bicubic")
    assert {op[3] for op in _launches(plan).values() if op[5].startswith("gs_tile")} == {(512,)}
    plan = _fast_plan((32, 32, 64, 64), (32, 64, 64, 2), mode="nearest")
    assert [op[0] for op in plan.ops].count("zero") == 1 and _launches(plan)["gs_tile_gather"][6] == 16 * 4096
    # 3-D, bf16, an odd channel count (the last slice holds 3 of 8)
    plan = _fast_plan((32, 19, 8, 16, 16), (32, 8, 16, 16, 3), dtype="bfloat16")
    assert _launches(plan)["gs_tile_gather"][2] == (3, 32)


def test_deterministic_backward_takes_the_tile_kernels_ordered(cpu_plans):
    oshape, ishape = (32, 32, 64, 64), (32, 32, 64, 64)
    ikey = (ishape, gs._contiguous_strides(ishape), "float16", 0)
    gkey = ((32, 64, 64, 2), gs._contiguous_strides((32, 64, 64, 2)), "float16", 0)
    okey = (oshape, gs._contiguous_strides(oshape), "float16", 0)
    for det in (False, True):
        plan = gs._backward_plan(0, okey, ikey, gkey, "bilinear", "zeros", False, True, True, det, gs._tuning_key())
        _check_plan(plan, {"grad_output", "input", "grid", "grad_input", "grad_grid"})
        ops = _launches(plan)
        assert list(ops) == ["gs_tile_sort", "gs_tile_gather", "gs_gg_sum"]
        assert int(ops["gs_tile_sort"][4][-1]) == det  # deterministic: segments sorted
    plan = gs._backward_plan(0, okey, ikey, gkey, "bilinear", "zeros", False, False, True, True, gs._tuning_key())
    assert "gs_tile_sort" not in _launches(plan)  # grad_grid alone: the global kernel, deterministic as is


@pytest.mark.parametrize("kw, why", [
    (dict(ishape=(8, 64, 128, 128), gshape=(8, 128, 128, 2)), "2 * 16384 chunks of 16 bytes > 227 KiB"),
    (dict(ishape=(2, 32, 64, 64), gshape=(2, 64, 64, 2)), "2 * 4 blocks fill 8 of 132 SMs"),
    (dict(ishape=(32, 32, 64, 64), gshape=(32, 64, 64, 2), dtype="float64"), "float64 keeps the global kernel"),
    (dict(ishape=(32, 32, 64, 64), gshape=(32, 64, 64, 2), layout="channels_last"), "channels-last planes"),
    (dict(ishape=(32, 32, 64, 64), gshape=(32, 64, 64, 2), layout="strided"), "planes with gaps"),
    (dict(ishape=(32, 32, 64, 64), gshape=(32, 64, 64, 2), residue=8), "planes not 16-byte aligned"),
    (dict(ishape=(32, 32, 64, 64), gshape=(32, 63, 63, 2)), "3969 points: not whole chunks"),
])
def test_fast_backward_keeps_the_global_kernel_elsewhere(cpu_plans, kw, why):
    kernels = _launches(_fast_plan(**kw))
    assert "gs_backward" in kernels and not set(gs.TILE_KERNELS) & set(kernels), why


def test_tile_knobs(cpu_plans, monkeypatch):
    monkeypatch.setitem(gs.TUNING, "tile", False)
    assert "gs_tile_sort" not in _launches(_fast_plan((32, 32, 64, 64), (32, 64, 64, 2)))
    monkeypatch.setitem(gs.TUNING, "tile", True)
    monkeypatch.setitem(gs.TUNING, "tile_min_fill", 0)
    sort = _launches(_fast_plan((2, 32, 64, 64), (2, 64, 64, 2)))["gs_tile_sort"]
    assert sort[2] == (8, 2)  # 4096 pixels // 512 caps the ranges at 8
    monkeypatch.setitem(gs.TUNING, "tile_scratch_bytes", 2 * 4 * 4096 * 8 * 3)  # room for 3 ranges
    assert _launches(_fast_plan((2, 32, 64, 64), (2, 64, 64, 2)))["gs_tile_sort"][2] == (3, 2)
    monkeypatch.setitem(gs.TUNING, "tile_sort_bytes", 1024)  # counts alone exceed it: nothing staged
    sort = _launches(_fast_plan((2, 32, 64, 64), (2, 64, 64, 2)))["gs_tile_sort"]
    assert int(sort[4][-2]) == 0 and sort[6] == 1376 * 4  # 1366 pixels per range, rounded up to 32


@pytest.mark.parametrize("in_shape, out_sp, channels_last, lanes_log2", [
    ((8, 64, 128, 128), (128, 128), False, 1),  # 16 groups of 4 channels: 8 a lane at most
    ((32, 32, 64, 64), (64, 64), False, 0),  # 8 groups, 131072 points: one lane loops over all
    ((32, 32, 64, 64), (64, 64), True, 3),  # channels-last: a lane per group up to 32, reads coalesced
    ((4, 32, 64, 64), (64, 64), False, 1),  # 16384 points: lanes until 2^15 threads
    ((2, 512, 16, 16), (8, 8), False, 7),  # 128 points: a lane per group
    ((2, 3, 5, 5), (4, 4), False, 0),  # one group
])
def test_forward_lanes_per_point(in_shape, out_sp, channels_last, lanes_log2):
    geo = gs.geometry(in_shape, (in_shape[0], *out_sp, len(out_sp)), "float32", "float32")
    assert gs._forward_lanes_log2(geo, channels_last=channels_last) == lanes_log2


def test_forward_knobs_reach_the_kernels_as_macros(monkeypatch):
    src = (Path(gs.__file__).parent / "grid_sample_forward.cu").read_text()
    assert f"#define GS_PLANE_THREADS {gs.TUNING['fwd_plane_threads']}\n" in src  # the source's default, the same
    assert f"#define GS_PLANE_POINTS {gs.TUNING['fwd_plane_points']}\n" in src
    assert f"#define GS_CF_UNROLL {gs.TUNING['fwd_cf_unroll']}\n" in src
    assert f"#define GS_CF_SPLIT {gs.TUNING['fwd_cf_split']}\n" in src
    monkeypatch.setitem(gs.TUNING, "fwd_plane_threads", 256)
    monkeypatch.setitem(gs.TUNING, "fwd_cf_unroll", 2)
    monkeypatch.setitem(gs.TUNING, "fwd_cf_split", 3)
    monkeypatch.setitem(gs.TUNING, "options", ("-DX=1",))
    assert gs._options()[-5:] == ("-DGS_PLANE_THREADS=256", f"-DGS_PLANE_POINTS={gs.TUNING['fwd_plane_points']}",
                                  "-DGS_CF_UNROLL=2", "-DGS_CF_SPLIT=3", "-DX=1")


def _forward_launch(in_shape, out_sp, *, strides=None, dtype="float32", residue=0):
    """The forward plan's launch of the plane kernel (checked: the ops around it), else its one launch."""
    strides = strides or gs._contiguous_strides(in_shape)
    gshape = (in_shape[0], *out_sp, len(out_sp))
    plan = gs._forward_plan(0, (in_shape, strides, dtype, residue), (gshape, gs._contiguous_strides(gshape), dtype, 0),
                            "bilinear", "zeros", False, gs._tuning_key())
    _check_plan(plan, gs.FORWARD_INPUTS + ("output",))
    if len(plan.ops) == 1:  # the gather kernel or ATen's loop order alone, told nothing
        (op,) = plan.ops
        assert op[5].split("<")[0] in ("gs_forward", "gs_forward_cf") and op[4][-1] is None
        return op
    # the count zeroed, the coordinates' pass counting into it, then both kernels reading it
    zero, coords, plane, gather = plan.ops
    flag, points = gs._Ref("scratch0"), gs._Ref("scratch1")
    assert zero == ("zero", flag, 8) and plan.scratch[:2] == (("scratch0", 0), ("scratch1", 256))
    assert coords[5].startswith("gs_forward_coords<") and coords[4][1] == points and coords[4][-1] == flag
    assert plane[5].startswith("gs_forward_plane<") and plane[4][1] == points and plane[4][-1] == flag
    assert gather[5].startswith("gs_forward<") and gather[4][-1] == flag
    acc = gs.ITEMSIZE["float32" if dtype in ("float16", "bfloat16") else dtype]
    assert plan.scratch_bytes == 256 + -(-math.prod(in_shape[:1] + out_sp) * len(out_sp) * acc // 256) * 256
    return plane


@pytest.mark.parametrize("in_shape, out_sp, dtype, cpb, blocks, shared", [
    ((8, 64, 128, 128), (128, 128), "float32", 1, 1024, 65536),  # one 64 KiB plane a block, 2 point ranges
    ((32, 32, 64, 64), (64, 64), "float16", 6, 192 * 3, 6 * 8192),  # 6 planes in 48 KiB, 3 ranges
    ((2, 16, 32, 32, 32), (32, 32, 32), "float32", 1, 32 * 17, 131072),  # 128 KiB: above 48, within the opt-in
    ((2, 5, 7, 9), (6, 5), "float32", 5, 2, 5 * 256),  # 63 values a plane, rounded up to 16 bytes
])
def test_channels_first_forward_stages_planes_in_shared_memory(cpu_plans, monkeypatch, in_shape, out_sp, dtype, cpb,
                                                                blocks, shared):
    monkeypatch.setitem(gs.TUNING, "fwd_plane_min_values", 0)
    _, fn, grid, block, args, name, sh = _forward_launch(in_shape, out_sp, dtype=dtype)
    assert name.startswith("gs_forward_plane<") and block == (gs.TUNING["fwd_plane_threads"],)
    assert (int(args[-3]), grid[0], sh) == (cpb, blocks, shared)
    assert int(args[3]["flags"][0]) & gs.F_PLANE_VEC == (gs.F_PLANE_VEC if in_shape[-1] % 4 == 0 else 0)


@pytest.mark.parametrize("in_shape, out_sp, kernel, why", [
    ((8, 3, 256, 256), (224, 224), "gs_forward_cf", "a 256 KiB plane is above the shared memory a block may have"),
    ((2, 8, 64, 64), (16, 16), "gs_forward", "256 points read less than a 4096-pixel plane; too few for a thread each"),
    ((32, 32, 64, 64), (64, 64), "gs_forward_cf", "2^22 output values: the pass and the launch that exits cost more"),
    ((2, 16, 32, 32, 32), (32, 32, 32), "gs_forward_cf", "2^20 output values"),
])
def test_channels_first_forward_without_planes(cpu_plans, in_shape, out_sp, kernel, why):
    op = _forward_launch(in_shape, out_sp)
    assert op[5].split("<")[0] == kernel, why
    if kernel == "gs_forward_cf":  # a thread a point
        points = in_shape[0] * math.prod(out_sp)
        assert op[2] == (-(-points // gs.BLOCK),) and op[3] == (gs.BLOCK,)


def test_point_kernel_choice(cpu_plans, monkeypatch):
    """gs_forward_cf: channels-first bilinear / nearest with a thread's worth of points each, 32-bit offsets."""
    def kernel(in_shape, out_sp, mode="bilinear", strides=None):
        gshape = (in_shape[0], *out_sp, len(out_sp))
        plan = gs._forward_plan(0, (in_shape, strides or gs._contiguous_strides(in_shape), "float32", 0),
                                (gshape, gs._contiguous_strides(gshape), "float32", 0), mode, "zeros", False,
                                gs._tuning_key())
        return plan.ops[-1][5].split("<")[0]

    shape = (32, 32, 64, 64)
    assert [kernel(shape, (64, 64), m) for m in gs.MODES] == ["gs_forward_cf", "gs_forward_cf", "gs_forward"]
    assert kernel(shape, (64, 64), strides=gs._cl_strides(shape)) == "gs_forward"  # channels-last: lanes
    assert kernel(shape, (32, 31)) == "gs_forward"  # 31744 points: lanes fill the GPU
    huge = (1, 1, 1 << 16, 1 << 16)  # a plane beyond 32-bit tap offsets
    assert kernel(huge, (256, 256), strides=(1 << 32, 1 << 32, 1 << 16, 1)) == "gs_forward"
    assert kernel((1, 3, 64, 64), (256, 256), strides=(1 << 32, 1 << 31, 64, 1)) == "gs_forward"  # channel stride
    monkeypatch.setitem(gs.TUNING, "fwd_cf", False)
    assert kernel(shape, (64, 64)) == "gs_forward"


def test_plane_kernel_modes(cpu_plans, monkeypatch):
    geo = gs.geometry((8, 64, 128, 128), (8, 128, 128, 2), "float32", "float32", mode="nearest")
    assert gs._plane_shape(geo, gs._contiguous_strides((8, 64, 128, 128)), 0, 0) is None  # bilinear only
    monkeypatch.setitem(gs.TUNING, "fwd_plane_modes", gs.MODES)
    assert gs._plane_shape(geo, gs._contiguous_strides((8, 64, 128, 128)), 0, 0).cpb == 1


def test_forward_layouts_and_knobs(cpu_plans, monkeypatch):
    monkeypatch.setitem(gs.TUNING, "fwd_plane_min_values", 0)
    shape = (2, 8, 16, 16)
    cl = _forward_launch(shape, (16, 16), strides=gs._cl_strides(shape))
    assert cl[5].startswith("gs_forward<")  # channels-last: the gather kernel reads channels coalesced
    strided = _forward_launch(shape, (16, 16), strides=tuple(2 * s for s in gs._contiguous_strides(shape)))
    assert strided[5].startswith("gs_forward_plane<") and not int(strided[4][3]["flags"][0]) & gs.F_PLANE_VEC
    misaligned = _forward_launch(shape, (16, 16), residue=4)
    assert misaligned[5].startswith("gs_forward_plane<") and not int(misaligned[4][3]["flags"][0]) & gs.F_PLANE_VEC
    monkeypatch.setitem(gs.TUNING, "fwd_plane", False)
    assert _forward_launch(shape, (16, 16))[5].startswith("gs_forward<")


def test_a_call_compiles_its_own_variant_and_the_shared_kernels_only():
    """Kernels compile per (program, dtype, (nd, mode)) plus one module of the variant-free ones: the groups
    partition each program, and a forward call's module holds a fifth of its program's instantiations."""
    assert gs.variant_of("gs_forward<float, float, 3, 1>") == (3, 1)
    assert gs.variant_of("gs_place<float, 2, 2>") == (2, 2)
    assert gs.variant_of("gs_to_cl<float, float>") is None and gs.variant_of("gs_bounds") is None
    for dtype in gs.CTYPES:
        for program, names in gs.programs(dtype).items():
            groups = {gs.variant_of(n) for n in names}
            assert groups <= set(gs.VARIANTS) | {None}, (program, groups)
            assert sorted(n for g in groups for n in names if gs.variant_of(n) == g) == sorted(names)
    forward = gs.programs("float32")["grid_sample_forward.cu"]
    assert len([n for n in forward if gs.variant_of(n) == (2, 0)]) * 4 < len(forward)
