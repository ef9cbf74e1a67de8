// Block-wide helpers shared by the csrc kernels that are not Hopper-specific.
#pragma once

#ifndef FULL_MASK
#define FULL_MASK 0xffffffffu
#endif

// Block-wide exclusive scan of one int per thread (blockDim.x a multiple of 32, <= 1024).
// `scratch` holds 32 ints of shared memory. MAX: a running max (of values >= 0) instead of a
// sum. Returns the exclusive prefix; *total gets the whole block's sum (or max).
template <bool MAX = false>
__device__ int block_exclusive_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  int inc = v;
  for (int d = 1; d < 32; d <<= 1) {
    int o = __shfl_up_sync(FULL_MASK, inc, d);
    if (lane >= d) inc = MAX ? max(inc, o) : inc + o;
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = lane < num_warps ? scratch[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      int o = __shfl_up_sync(FULL_MASK, w, d);
      if (lane >= d) w = MAX ? max(w, o) : w + o;
    }
    scratch[lane] = w;  // inclusive prefix of warp totals
  }
  __syncthreads();
  *total = scratch[num_warps - 1];
  const int before = warp > 0 ? scratch[warp - 1] : 0;
  if (MAX) {
    const int below_in_warp = __shfl_up_sync(FULL_MASK, inc, 1);  // lanes before this one
    return lane > 0 ? max(before, below_in_warp) : before;
  }
  return before + inc - v;
}
