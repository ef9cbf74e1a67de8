// The arguments of csrc/grouped_mm.cu's kernels: one struct per kernel, passed by value as its
// one `const __grid_constant__` parameter (the tensor maps must live in parameter space). The
// host layer (csrc/host/ops.cpp, csrc/host/fp8.cpp for the shared tile order) fills them and
// the kernels read them, both from this one definition: a field added, dropped or reordered
// changes both sides at once. NVRTC compiles it for the device and g++ for the host, in the
// CPU tier too; the size checks at the end fail the build of a compiler that lays a struct
// out otherwise.
#pragma once

#include "tensor_map.cuh"

// grouped_mm_{bf16,f16}[_nmajor][_skip[_split]]: out (M, N) = a (M, K) @ b[g] (+ bias[g]).
struct GroupedMmArgs {
  TensorMap a_map;       // a (M, K): bytes {2K, M}, box {128, 128} (skipping kernels: {128, 64})
  TensorMap a_rows_map;  // skipping kernels: the same, box {128, 16}
  TensorMap b_map;       // K-major: bytes {2K, N, G}, box {128, 256, 1}; N-major: {2N, K, G}, {128, 64, 1}
  TensorMap out_map;     // out (M, N): {N, M, 1}, box {64, 64, 1}
  void* out;
  const void* bias;      // (G, N) of bias_kind, or nullptr
  const int* offs;       // (G,)
  float* partial;        // split K: max_splits * M * N fp32 and two ints, or nullptr
  long long out_stride_m, bias_stride_g;
  int out_kind, bias_kind;  // 0 bf16, 1 fp16, 2 fp32; bias_kind -1: no bias
  int M, N, K, G, num_stages, max_splits, force_splits;
};

// grouped_mm_split_sum: out = the sum of split K's partial products.
struct GroupedMmSplitSumArgs {
  const float* partial;
  void* out;
  long long out_stride_m;
  int out_kind, M, N, max_splits;
};

// grouped_mm_wgrad_{bf16,f16}[_claimed]: out[g] (P, Q) (+)= a_g^T @ b_g.
struct GroupedMmWgradArgs {
  TensorMap a_map;    // a (M, P): bytes {2P, M}, box {128, 64}
  TensorMap b_map;    // b (M, Q): bytes {2Q, M}, box {128, 64}
  TensorMap out_map;  // out (G, P, Q): {Q, P, G}, box {128 bytes, 64, 1}
  const unsigned char* mask;     // accumulate into the groups whose entry is set; nullptr: every group
  const int* offs;               // (G,)
  const TensorMap* group_maps;   // wgrad_tile_order's: a_map, b_map a group (G x 2)
  int* order;                    // wgrad_tile_order's choice and claims' counter
  int out_kind, accumulate, M, P, Q, G, num_stages;
};

// wgrad_tile_order: the weight gradients' tile order (bf16 and FP8) and per-group maps.
struct WgradTileOrderArgs {
  TensorMap a_map, b_map;  // the weight gradient's operand maps, copied per group
  const int* offs;         // (G,)
  int* order;              // (2,): the choice, the claims' counter
  TensorMap* group_maps;   // (G x 2) out, or nullptr
  int M, G, tiles_per_group, rows_per_step, claim_steps, grid, row_dim;
};

static_assert(sizeof(GroupedMmArgs) == 640, "GroupedMmArgs: 4 maps, 4 pointers, 2 long longs, 9 ints, padding");
static_assert(sizeof(GroupedMmSplitSumArgs) == 40, "GroupedMmSplitSumArgs: 2 pointers, 1 long long, 4 ints");
static_assert(sizeof(GroupedMmWgradArgs) == 448, "GroupedMmWgradArgs: 3 maps, 4 pointers, 7 ints, padding");
static_assert(sizeof(WgradTileOrderArgs) == 320, "WgradTileOrderArgs: 2 maps, 3 pointers, 7 ints, padding");
