// What the Hopper GEMMs' launches must agree on with their kernels: block sizes and the sizes of
// the schedules' shared memory. One definition, read by the kernels (csrc/sm90.cuh, compiled by
// NVRTC), the C++ host layer (csrc/host/hopper.h) and Python (compiled_moe/native.py's
// launch_constants parses this file: keep each a `constexpr int NAME = integer expression;`).
#pragma once

// The GEMM kernels' block: a producer warpgroup (one thread issues TMA) and two consumers.
constexpr int SM90_THREADS = 384;

// TileQueue (sm90.cuh): a ring of TILE_SLOTS slots, each a full and an empty mbarrier and a tile.
constexpr int TILE_SLOTS = 8;
constexpr int TILE_QUEUE_BYTES = TILE_SLOTS * (2 * 8 + 4);

// wgrad_tile_order: one block of ORDER_THREADS over at most ORDER_MAX_GRID CTAs' loads; its
// dynamic shared memory is ORDER_SCRATCH long longs: runs (ints), 2 sums a warp, the answer.
constexpr int ORDER_THREADS = 256;
constexpr int ORDER_MAX_GRID = 256;
constexpr int ORDER_SCRATCH = (ORDER_MAX_GRID + 2) / 2 + 2 * 32 + 1;
constexpr int ORDER_SCRATCH_BYTES = 8 * ORDER_SCRATCH;
