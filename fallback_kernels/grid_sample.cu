// grid_sample forward and backward with torch.nn.functional.grid_sample's semantics (ATen's
// GridSampler.cuh / GridSampler.cu): bilinear, nearest and bicubic (2-D only) interpolation, zeros /
// border / reflection padding, align_corners, 2-D (N, C, H, W) and 3-D (N, C, D, H, W) inputs.
//
// Every program in one translation unit, for what takes one file per kernel source (tools/kernel_resources.py,
// the CPU tests' struct and arity checks). Plans never compile this file: each compiles only the programs its
// kernels are in (grid_sample.py, PROGRAMS), each of which includes the shared header once:
//
//   grid_sample_common.cuh   Geo, coordinate math, loads / stores, and the one per-tap helper, PointTaps
//   grid_sample_forward.cu   gs_forward, gs_forward_plane (channels-first planes in shared memory)
//   grid_sample_backward.cu  gs_backward: the fast backward (atomics into a channels-last accumulator); also
//                            grad_grid for the deterministic backwards
//   grid_sample_tile.cu      gs_tile_sort / gs_tile_gather / gs_gg_sum: the shared-memory backward (fast or
//                            deterministic), 16- and 32-bit inputs
//   grid_sample_counting.cu  gs_count / gs_scan_* / gs_place / gs_gather_exact: the deterministic backward by
//                            counting sort and exact int64 sums, 16- and 32-bit inputs
//   grid_sample_sorted.cu    gs_keys / gs_bounds / gs_gather, gs_cell_keys / gs_cell_gather: the deterministic
//                            backward by sorted keys (float64)
//   grid_sample_layout.cu    gs_to_cl / gs_from_cl / gs_absmax: transposes to and from channels-last

#include "grid_sample_forward.cu"
#include "grid_sample_backward.cu"
#include "grid_sample_tile.cu"
#include "grid_sample_counting.cu"
#include "grid_sample_sorted.cu"
#include "grid_sample_layout.cu"
