// Routing metadata for the MoE experts block: from topk_ids (T, k) to the expert-sorted layout.
//
// Outputs (see compiled_moe/reference.py: moe_route, the oracle of these kernels):
//   offs   int32 (E,): cumulative end row of each expert's group, each padded to pad_multiple.
//   row_of int32 (n,) with n = T*k: sorted row of every (token, slot); -1 for ids outside [0, E).
//   source int32 (capacity,): flat pair index of every sorted row; -1 on padding / past the end.
// Pairs keep ascending flat order inside an expert (a stable counting sort), so the result is
// deterministic: every count comes from warp votes and per-warp rows of shared memory, no
// atomics whose order could leak into the output.
//
// Two launches over `num_chunks` blocks, each owning a contiguous chunk of pairs:
//   moe_route_rank_*: per chunk, each pair's rank among the chunk's pairs of its expert, and the
//                     chunk's histogram hist[chunk][e].
//   moe_route_place:  per chunk, its base per expert (sum of earlier chunks' histograms) and the
//                     padded offsets (a scan over experts), then row_of / source; the chunks
//                     also share the -1 fill of padding rows and rows past the end.
// Inside a chunk, warp w owns a contiguous slice, so ranks only need per-warp counts
// (warp_count[w][e] in shared memory) and one scan over warps per expert.

#include "block.cuh"

template <typename IdT>
__device__ __forceinline__ int load_expert(const IdT* ids, long long i, long long n, int num_experts) {
  if (i >= n) return -1;
  long long e = (long long)ids[i];
  return (e >= 0 && e < num_experts) ? (int)e : -1;
}

// Dynamic shared memory: warp_count[num_warps][num_experts] ints.
template <typename IdT>
__device__ void route_rank(const IdT* __restrict__ ids, int* __restrict__ rank, int* __restrict__ hist,
                           long long n, int num_experts, int items_per_lane) {
  extern __shared__ int warp_count[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const long long warp_span = 32LL * items_per_lane;
  const long long chunk_start = (long long)blockIdx.x * num_warps * warp_span;
  const long long warp_start = chunk_start + warp * warp_span;
  int* my_count = warp_count + warp * num_experts;
  for (int e = threadIdx.x; e < num_warps * num_experts; e += blockDim.x) warp_count[e] = 0;
  __syncthreads();

  const unsigned lanes_below = (1u << lane) - 1u;
  for (int it = 0; it < items_per_lane; ++it) {
    const long long i = warp_start + it * 32LL + lane;
    const int e = load_expert(ids, i, n, num_experts);
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    const int before = e >= 0 ? my_count[e] : 0;
    __syncwarp();
    if (e >= 0) {
      if (i < n) rank[i] = before + __popc(peers & lanes_below);
      if ((peers & lanes_below) == 0) my_count[e] = before + __popc(peers);  // the group's first lane
    }
    __syncwarp();
  }
  __syncthreads();
  // Exclusive scan over warps, per expert: warp_count[w][e] becomes the count in warps < w.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int c = warp_count[w * num_experts + e];
      warp_count[w * num_experts + e] = run;
      run += c;
    }
    hist[(long long)blockIdx.x * num_experts + e] = run;
  }
  __syncthreads();
  for (int it = 0; it < items_per_lane; ++it) {
    const long long i = warp_start + it * 32LL + lane;
    const int e = load_expert(ids, i, n, num_experts);
    if (e >= 0) rank[i] += my_count[e];
  }
}

extern "C" __global__ void moe_route_rank_i32(const int* ids, int* rank, int* hist, long long n,
                                              int num_experts, int items_per_lane) {
  route_rank<int>(ids, rank, hist, n, num_experts, items_per_lane);
}

extern "C" __global__ void moe_route_rank_i64(const long long* ids, int* rank, int* hist, long long n,
                                              int num_experts, int items_per_lane) {
  route_rank<long long>(ids, rank, hist, n, num_experts, items_per_lane);
}

// Dynamic shared memory: 2 * num_experts + 32 ints (chunk base, expert start, scan scratch).
template <typename IdT>
__device__ void route_place(const IdT* __restrict__ ids, int* __restrict__ row_of, const int* __restrict__ hist,
                            int* __restrict__ offs, int* __restrict__ source, long long n, long long capacity,
                            int num_experts, int num_chunks, int chunk_size, int pad_multiple) {
  extern __shared__ int smem[];
  int* chunk_base = smem;                  // rows of this expert in earlier chunks
  int* expert_start = smem + num_experts;  // first row of each expert's (padded) group
  int* scratch = smem + 2 * num_experts;
  const int c = blockIdx.x;

  // Chunk base and total count per expert, summed over the histogram rows in parallel (integer
  // adds: the order of the shared-memory atomics cannot change the result).
  for (int e = threadIdx.x; e < 2 * num_experts; e += blockDim.x) smem[e] = 0;
  __syncthreads();
  const long long hist_size = (long long)num_chunks * num_experts;
  for (long long idx = threadIdx.x; idx < hist_size; idx += blockDim.x) {
    const int e = (int)(idx % num_experts);
    const int h = hist[idx];
    if (h) {
      atomicAdd(&expert_start[e], h);  // the count for now; the start after the scan
      if (idx / num_experts < c) atomicAdd(&chunk_base[e], h);
    }
  }
  __syncthreads();
  // Each thread owns a contiguous run of experts for the scan over experts.
  const int per_thread = (num_experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(num_experts, (int)threadIdx.x * per_thread);
  const int e1 = min(num_experts, e0 + per_thread);
  int run = 0;
  for (int e = e0; e < e1; ++e) run += (expert_start[e] + pad_multiple - 1) / pad_multiple * pad_multiple;
  int grand_total;
  int start = block_exclusive_scan(run, scratch, &grand_total);
  for (int e = e0; e < e1; ++e) {
    const int count = expert_start[e];
    const int padded = (count + pad_multiple - 1) / pad_multiple * pad_multiple;
    expert_start[e] = start;
    if (c == 0) offs[e] = start + padded;
    // Padding rows of this expert: shared out over the chunks by expert index.
    if (e % num_chunks == c)
      for (int r = start + count; r < start + padded; ++r) source[r] = -1;
    start += padded;
  }
  __syncthreads();

  // Rows past the last group.
  for (long long r = grand_total + (long long)c * blockDim.x + threadIdx.x; r < capacity;
       r += (long long)num_chunks * blockDim.x)
    source[r] = -1;

  const long long chunk_start = (long long)c * chunk_size;
  const long long chunk_end = min(n, chunk_start + chunk_size);
  for (long long i = chunk_start + threadIdx.x; i < chunk_end; i += blockDim.x) {
    const int e = load_expert(ids, i, n, num_experts);
    if (e < 0) {
      row_of[i] = -1;
    } else {
      const int row = expert_start[e] + chunk_base[e] + row_of[i];  // row_of holds the chunk rank
      row_of[i] = row;
      source[row] = (int)i;
    }
  }
}

extern "C" __global__ void moe_route_place_i32(const int* ids, int* row_of, const int* hist, int* offs,
                                               int* source, long long n, long long capacity, int num_experts,
                                               int num_chunks, int chunk_size, int pad_multiple) {
  route_place<int>(ids, row_of, hist, offs, source, n, capacity, num_experts, num_chunks, chunk_size,
                   pad_multiple);
}

extern "C" __global__ void moe_route_place_i64(const long long* ids, int* row_of, const int* hist, int* offs,
                                               int* source, long long n, long long capacity, int num_experts,
                                               int num_chunks, int chunk_size, int pad_multiple) {
  route_place<long long>(ids, row_of, hist, offs, source, n, capacity, num_experts, num_chunks, chunk_size,
                         pad_multiple);
}
