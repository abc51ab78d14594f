"""CPU: how a recorded kernel's argument bytes are read as pointer words (gpu_launch.graph_patch):
every difference between the two recordings must be one role's pointer plus a constant."""

from __future__ import annotations

import struct

import pytest

from gpu_launch import graph_patch as gp

PTRS = (0x7F00_0000_0000, 0x7F00_1000_0200, 0x7F00_2000_0000)  # x, w, y as torch might hand them


def _args(*words: int, tail: bytes = b"") -> bytes:
    return b"".join(struct.pack("<Q", w & gp.MASK) for w in words) + tail


def _moved(ptrs=PTRS, move=0):
    return gp.moved_pointers(ptrs, move)


def test_plain_and_offset_pointers_are_found_with_their_constants():
    moved = _moved()
    data = _args(PTRS[0], 42, PTRS[2] + 4096, PTRS[1])
    moved_data = _args(moved[0], 42, moved[2] + 4096, moved[1])
    assert gp.pointer_sites(data, moved_data, PTRS, 0) == [(0, 0, 0), (16, 2, 4096), (24, 1, 0)]


def test_a_pointer_relative_to_a_fixed_base_is_a_pointer_plus_a_constant():
    base, moved = 0x7E00_0000_0000, _moved()
    sites = gp.pointer_sites(_args(PTRS[1] - base), _args(moved[1] - base), PTRS, 0)
    assert sites == [(0, 1, (-base) & gp.MASK)]
    (start, role, const), = sites
    assert (0x7F00_5000_0000 + const) & gp.MASK == 0x7F00_5000_0000 - base


def test_a_value_equal_to_a_pointer_that_did_not_move_is_left_alone():
    data = _args(PTRS[0], 7)
    assert gp.pointer_sites(data, data, PTRS, 0) == []


@pytest.mark.parametrize("case", ["shifted", "low half only", "difference of two", "scaled"])
def test_any_other_difference_is_refused(case):
    moved = _moved()
    if case == "shifted":  # an address stored >> 4, as an opaque descriptor might
        data, moved_data = _args(PTRS[0] >> 4), _args(moved[0] >> 4)
    elif case == "low half only":  # a 32-bit offset beside an unrelated word
        data = struct.pack("<II", PTRS[0] & 0xFFFFFFFF, 5)
        moved_data = struct.pack("<II", moved[0] & 0xFFFFFFFF, 5)
    elif case == "difference of two":
        data, moved_data = _args(PTRS[2] - PTRS[0]), _args(moved[2] - moved[0])
    else:
        data, moved_data = _args(PTRS[1] // 2), _args(moved[1] // 2)
    with pytest.raises(gp.PatchError):
        gp.pointer_sites(data, moved_data, PTRS, 0)


def test_a_change_in_a_trailing_partial_word_is_refused():
    with pytest.raises(gp.PatchError, match="outside a pointer-sized word"):
        gp.pointer_sites(_args(1, tail=b"\x01\x02"), _args(1, tail=b"\x01\x03"), PTRS, 0)


@pytest.mark.parametrize("move", range(gp.MOVES))
def test_moved_pointers_keep_the_alignment_class_and_no_two_roles_or_pairs_collide(move):
    ptrs = (512, 512, 1024 + 16, 4096)  # two roles on one buffer (in place), one at an offset
    moved = gp.moved_pointers(ptrs, move)
    assert [p % gp.ALIGNMENT_CLASS for p in moved] == [p % gp.ALIGNMENT_CLASS for p in ptrs]
    offsets = [gp.offset(i, move) for i in range(8)]
    differences = {(a - b) & gp.MASK for a in offsets for b in offsets if a != b}
    assert len(set(offsets)) == 8 and not differences & set(offsets)
    assert all(o % gp.ALIGNMENT_CLASS == 0 and (o // gp.ALIGNMENT_CLASS) % 2 for o in offsets)
    # the address mod every power of two from 512 to 2^34 changes
    assert all((p + o) % (1 << k) != p % (1 << k) for o in offsets for p in (0, 1 << 20) for k in range(9, 35))


def test_a_dependence_on_high_address_bits_is_seen_by_some_move():
    """A kernel argument that is a function of the address other than pointer + constant (here the
    4 KiB page offset, as an alignment-peeling kernel might take) differs in a moved recording."""
    page = lambda p: p % 4096  # noqa: E731
    for move in range(gp.MOVES):
        moved = _moved(move=move)
        with pytest.raises(gp.PatchError):
            gp.pointer_sites(_args(page(PTRS[1])), _args(page(moved[1])), PTRS, move)
