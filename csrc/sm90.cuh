// Hopper (sm_90a) building blocks shared by the csrc/ GEMM kernels: mbarriers, TMA loads,
// wgmma fences and waits, and the epilogue's stores.

#pragma once

#include "sm90_launch.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned, passed by value.
struct __align__(64) TensorMap { u64 opaque[16]; };

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// mbarriers by shared address (u32) or by pointer.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) { mbar_init(smem_addr(bar), count); }

// The ring's barriers, by thread 0: full[s] completes when stage s's TMA bytes have landed
// (the producer's one arrival), empty[s] when lane 0 of each of the `consumer_warps` has
// released it.
__device__ __forceinline__ void init_ring(u64* full, u64* empty, int num_stages, int consumer_warps) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < num_stages; ++s) {
    mbar_init(&full[s], 1);
    mbar_init(&empty[s], consumer_warps);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Predicated rather than branched: it runs while a wgmma is in flight, and nvcc 13.0's ptxas
// serializes every wgmma (waits for each) when a divergent branch sits inside a flight.
__device__ __forceinline__ void mbar_arrive_if(u32 bar, bool pred) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
               ::"r"(bar), "r"((int)pred) : "memory");
}
__device__ __forceinline__ void mbar_arrive_if(u64* bar, bool pred) { mbar_arrive_if(smem_addr(bar), pred); }

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}\n"
      ::"r"(bar), "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) { mbar_wait(smem_addr(bar), parity); }

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"((u64)map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(smem_addr(dst)), "l"((u64)map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Clusters of CTAs (TMA multicast): this CTA's rank, a barrier of every thread of the cluster
// (threads that have exited do not count), a load that lands at the same shared-memory offset
// in every CTA of `cta_mask` and completes bytes on each one's mbarrier at `bar`'s offset, and
// an arrival on the mbarrier at `bar`'s offset in CTA `cta`. The arrival has the default
// (CTA-scope) release: it only tells the peer's producer that this CTA's wgmma have read a
// stage. `.release.cluster` compiles to MEMBAR.ALL.GPU before every arrival, and the kernel ran at
// 0.57x the one-CTA kernel's speed with it (H200).
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TensorMap* map, u64* bar, int c0, int c1,
                                                      unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(smem_addr(dst)), "l"((u64)map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void mbar_arrive_remote_if(u64* bar, u32 cta, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b32 a;\n setp.ne.b32 p, %2, 0;\n mapa.shared::cluster.u32 a, %0, %1;\n"
      " @p mbarrier.arrive.shared::cluster.b64 _, [a];\n}\n"
      ::"r"(smem_addr(bar)), "r"(cta), "r"((int)pred) : "memory");
}

// TMA stores of a shared-memory box (asynchronous bulk groups of the issuing thread): plain,
// or added to global memory in the tensor map's element type.
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               ::"l"((u64)map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

__device__ __forceinline__ void tma_reduce_add_3d(const TensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
               ::"l"((u64)map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk stores have read their shared memory (it may be overwritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... and have completed.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Makes this thread's shared-memory stores visible to TMA and wgmma (the async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Barrier `id` (1..15) of `count` threads (a warpgroup: 128).
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// wgmma shared-memory descriptor of a K-major tile stored as 128-byte rows with the 128-byte
// swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): 8-row atoms 1024 bytes apart.
__device__ __forceinline__ u64 smem_desc(const void* p) {
  const u64 addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

// wgmma descriptor of an M/N-major operand stored as boxes of 64 M/N-elements (128 bytes) x
// k rows with the 128-byte swizzle: leading byte offset = from one 64-element chunk to the
// next (one box), stride byte offset = from one 8-row group of k to the next (1024 bytes).
__device__ __forceinline__ u64 smem_desc_mn(const void* p, u32 box_bytes) {
  const u64 addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | ((u64)(box_bytes >> 4) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory"); }

// Keeps the compiler from moving reads of wgmma results above the wait (the asm above does not
// tell it when the asynchronous write lands).
template <int N>
__device__ __forceinline__ void fence_registers(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Output element types (out_kind): 0 bf16, 1 fp16, 2 fp32; rounding to nearest even.
__device__ __forceinline__ u32 pack_half2(int out_kind, float lo, float hi) {
  u32 r;
  if (out_kind == 0) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ void store_one(void* out, int out_kind, long long i, float v) {
  if (out_kind == 2) ((float*)out)[i] = v;
  else ((unsigned short*)out)[i] = (unsigned short)(pack_half2(out_kind, v, 0.f) & 0xffff);
}

// Two 16-bit values of a word (the first in the low half) as floats: kind 0 bf16, 1 fp16.
__device__ __forceinline__ float2 unpack_pair(u32 w, int kind) {
  if (kind == 0) return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  float lo, hi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(w & 0xffffu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(w >> 16)));
  return make_float2(lo, hi);
}

// cp.async of 4 or 8 bytes (BYTES) into shared memory; with src_bytes 0 it writes zeros and reads
// nothing. No registers wait for it: cp.async.wait_all does.
template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES),
               "r"(src_bytes) : "memory");
}

// Pair p of a tile's bias (columns col0 + 2p and + 1 of the group's bias row, which starts
// group_offset elements in; kind 2 fp32, else 16-bit) into tile_bias by cp.async; zeros past N
// (N even: a pair never straddles it).
__device__ __forceinline__ void copy_bias_pair(unsigned char* tile_bias, int p, const void* bias, int kind,
                                               long long group_offset, int col0, int N) {
  const int col = col0 + 2 * p, in_range = col < N;
  const long long i = group_offset + (in_range ? col : 0);
  if (kind == 2) cp_async_zfill<8>(tile_bias + 8 * p, (const float*)bias + i, in_range ? 8 : 0);
  else cp_async_zfill<4>(tile_bias + 4 * p, (const unsigned short*)bias + i, in_range ? 4 : 0);
}

__device__ __forceinline__ float ld_shared_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ float2 ld_shared_f32x2(u32 addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// Staging a consumer warpgroup's wgmma fragment (64 rows) for TMA stores: boxes of 64 rows x
// 128 bytes in the 128-byte-swizzled layout (conflict-free: the 8 rows of a store land in 8
// different 16-byte chunks). Fragment: acc[4j + 0..1] are (row, 8j + frag_col + 0..1),
// acc[4j + 2..3] the same columns of row + 8.
constexpr int STAGING_BOX_BYTES = 64 * 128;

template <typename T> struct IsNull { static constexpr bool value = false; };
template <> struct IsNull<decltype(nullptr)> { static constexpr bool value = true; };

// Column groups j of the fragment, plus bias(j) = the bias pair of its columns (bias: a callable,
// or nullptr for none: adding zeros costs an FADD per element, x + 0 not being x for x = -0),
// as 2-byte values: box j / 8 holds columns 64 (j / 8) ... Two column groups (four 8 x 8
// matrices: rows +0 and +8 of groups j and j + 1) go out in one stmatrix, whose four 8-lane
// quarters give the rows' addresses; the fragment is stmatrix's register layout.
template <int J, typename Bias>
__device__ __forceinline__ void stage_fragment_16bit(unsigned char* staging, const float* acc, int frag_row,
                                                     int frag_col, int out_kind, Bias&& bias) {
  static_assert(J % 2 == 0, "column groups go in pairs");
  const int lane = (frag_row & 7) * 4 + frag_col / 2;
  const int row = (frag_row & ~15) + (lane & 8) + (lane & 7);  // this lane's address: matrix lane / 8
  const u32 base = smem_addr(staging) + row * 128;
  const int second = lane >> 4, swizzle = lane & 7;  // column group j + second; row % 8
#pragma unroll
  for (int j = 0; j < J; j += 2) {
    u32 r[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float2 b = make_float2(0.f, 0.f);
      if constexpr (!IsNull<Bias>::value) b = bias(j + h);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float lo = acc[4 * (j + h) + 2 * e], hi = acc[4 * (j + h) + 2 * e + 1];
        if constexpr (!IsNull<Bias>::value) { lo += b.x; hi += b.y; }
        r[2 * h + e] = pack_half2(out_kind, lo, hi);
      }
    }
    const u32 addr = base + (j / 8) * STAGING_BOX_BYTES + ((((j % 8) + second) ^ swizzle) * 16);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  }
}

// Column groups j0 .. j0 + J - 1 as fp32, plus bias(j) as above: box (j - j0) / 4 holds 32 columns.
template <int J, typename Bias>
__device__ __forceinline__ void stage_fragment_fp32(unsigned char* staging, const float* acc, int j0, int frag_row,
                                                    int frag_col, Bias&& bias) {
  float2 b[J];
  if constexpr (!IsNull<Bias>::value) {
#pragma unroll
    for (int j = 0; j < J; ++j) b[j] = bias(j0 + j);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = frag_row + 8 * r;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int col = (j % 4) * 8 + frag_col;  // within a 32-column box
      const u32 addr = smem_addr(staging) + row * 128 + (j / 4) * STAGING_BOX_BYTES + (((col / 4) ^ (row & 7)) * 16) + (col % 4) * 4;
      float lo = acc[4 * (j0 + j) + 2 * r], hi = acc[4 * (j0 + j) + 2 * r + 1];
      if constexpr (!IsNull<Bias>::value) { lo += b[j].x; hi += b[j].y; }
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(lo), "f"(hi) : "memory");
    }
  }
}

// A consumer with no rows in a tile: waits for each of its `steps` stages and hands it back
// unread; release(s) signals stage s's release (predicated arrivals: see mbar_arrive_if).
template <typename Release>
__device__ __forceinline__ void pass_steps(int steps, int& stage, u32& phase, int num_stages, u64* full,
                                           Release&& release) {
  for (int i = 0; i < steps; ++i) {
    mbar_wait(&full[stage], phase);
    release(stage);
    if (++stage == num_stages) { stage = 0; phase ^= 1; }
  }
}

// The tile list of all groups, in shared memory: tile_end[g] is the inclusive prefix over groups
// of (row tiles x column tiles); group g owns rows [row_start[g], row_end[g]), as
// reference.group_bounds reads offs: each end clamped to [0, M), then a running maximum, so
// corrupt (decreasing) offsets never give two groups the same rows.
struct Schedule {
  int* tile_end;
  int* row_start;
  int* row_end;
};

__device__ __forceinline__ int clamped_end(const int* __restrict__ offs, int g, int M) {
  return min(max(offs[g], 0), M);
}

// Every thread of the block takes part (it ends with __syncthreads); scratch holds 32 ints.
__device__ void build_schedule(const int* __restrict__ offs, int G, int M, int num_n, int block_m, Schedule s,
                               int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x / 32;
  int carry = 0, carry_end = 0;  // tiles and running maximum of the ends before this chunk
  for (int base = 0; base < G; base += blockDim.x) {
    const int g = base + threadIdx.x;
    // Running maximum of the ends: a scan within warps, then over the warps' maxima.
    int end = g < G ? clamped_end(offs, g, M) : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, end, d);
      if (lane >= d) end = max(end, o);
    }
    if (lane == 31) scratch[warp] = end;
    __syncthreads();
    int end_before = carry_end;  // the running maximum before this warp's first group
    for (int w = 0; w < warp; ++w) end_before = max(end_before, scratch[w]);
    end = max(end, end_before);
    const int end_of_previous = __shfl_up_sync(0xffffffffu, end, 1);  // every lane takes part
    const int start = lane == 0 ? end_before : end_of_previous;
    for (int w = 0; w < num_warps; ++w) carry_end = max(carry_end, scratch[w]);
    __syncthreads();  // scratch is reused by the tile scan
    int count = 0;
    if (g < G) {
      s.row_start[g] = start;
      s.row_end[g] = end;
      count = ((end - start + block_m - 1) / block_m) * num_n;
    }
    int inc = count;
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += o;
    }
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    int before = carry;
    for (int w = 0; w < warp; ++w) before += scratch[w];
    if (g < G) s.tile_end[g] = before + inc;
    int total = 0;
    for (int w = 0; w < num_warps; ++w) total += scratch[w];
    carry += total;
    __syncthreads();
  }
}

// Group rows for a thread that visits groups in non-decreasing order (without a Schedule in
// shared memory): the same bounds as build_schedule's, from the running maximum of the ends
// of the groups passed so far.
struct GroupRows {
  int next = 0, end_before = 0;  // end_before: the running maximum of the ends of groups < next
  __device__ __forceinline__ void of(const int* __restrict__ offs, int M, int g, int& start, int& end) {
    for (; next < g; ++next) end_before = max(end_before, clamped_end(offs, next, M));
    start = end_before;
    end = max(clamped_end(offs, g, M), start);
  }
};

// The weight gradients' tile order over G groups of num_p x num_q output tiles: tile t is in
// group t / (num_p num_q); within a group, bands of `band` P tiles with P varying fastest, so
// the blocks running at once read few columns of both operands (L2 reuse). With P varying
// fastest over all of P, Mixtral's fc1 (P = 28672) read a from DRAM once per Q tile: 0.99x
// torch._grouped_mm, 1.07x with bands of 8. Returns the group; p0, q0 are tile indices.
// Unsigned: the signed divisions' sign fix-ups cost instructions and registers in every tile's
// place, in the producer (40 registers) and the consumers. On the H200 the change is about
// neutral (paired rounds over the 16 shapes: 1.004x bf16, 1.010x FP8 weight gradient; RESULTS.md);
// kept for the producer's registers, which a spill had reached in a variant with more code there.
__device__ __forceinline__ int band_tile(int t, int num_p, int num_q, int band, int& p0, int& q0) {
  const u32 per_group = (u32)(num_p * num_q);
  const u32 g = (u32)t / per_group, local = (u32)t - g * per_group;
  const u32 b = local / (u32)(band * num_q), first = b * band;
  const u32 band_p = min((u32)num_p - first, (u32)band), in_band = local - b * band * num_q;
  p0 = (int)(first + in_band % band_p);
  q0 = (int)(in_band / band_p);
  return (int)g;
}

// The weight gradients' tile order: fixed, or claimed at run time. A weight-gradient tile
// reduces its group's rows, so under skewed routing tiles differ in length. In the fixed order
// (CTA b takes tiles b, b + gridDim.x, ...) with fewer tiles a group than CTAs (Qwen3's 128
// experts: 48 and 96 bf16 tiles of 128 x 256), each CTA meets the same few groups' tiles round
// after round: a simulation put the most loaded CTA 11-30% past the mean on Qwen3's skewed
// shapes (2-4% on the other models', 1% or less under uniform routing); claimed at run time,
// 1-2%. But claiming in the kernel that runs the fixed order cost the fixed order 7-10% on the
// H200 (not its instructions' time; RESULTS.md), so each weight gradient has two instantiations:
// wgrad_tile_order decides from offs (claims_tiles) and both launch after it, and
// the one not chosen returns at once. Measured against the fixed order (same launches): Qwen3
// skewed fc2 1.06-1.09x bf16 and FP8, bf16 fc1 1.00-1.02x, the other shapes level (they keep
// the fixed order); the two extra launches cost about 5 us a call. The FP8 weight gradient also
// claims where its tiles are long (configs.FP8_WGRAD_CLAIM_STEPS; DeepSeek-V3 and Mixtral
// 1.00-1.07x): handed out by one counter, the tiles that run at once stay neighbours in the
// order, where CTAs walking the fixed order drift apart over hundreds of rounds (a reading, not
// measured).
//
// Claimed at run time, each CTA's first tile is blockIdx.x and each next one comes from a
// global counter (zeroed by wgrad_tile_order), claimed as the producer starts the tile before it
// (the atomic's latency passes under that tile's loads), so tiles still start in index order
// (the band order's L2 reuse holds). The producer passes each claimed tile to the CTA's other
// warps through a ring of TILE_SLOTS slots in shared memory right after it has issued the
// previous tile's first load (a reader that pops while it holds a stage of that tile never
// waits on loads it holds back), then the first claim past the last tile. Every reader warp
// pops every tile in order (whole warps: the value is broadcast, so ptxas sees it uniform).
struct TileQueue {
  // One shared address (the producer runs in 40 registers): full[TILE_SLOTS] (the producer's
  // write), empty[TILE_SLOTS] (lane 0 of every reader warp has read), tile[TILE_SLOTS].
  u32 base;
  static constexpr int BYTES = TILE_QUEUE_BYTES;
  __device__ __forceinline__ static TileQueue at(void* smem) {  // BYTES there, 8-byte aligned
    return TileQueue{smem_addr(smem)};
  }
  __device__ __forceinline__ u32 full(int s) const { return base + 8 * s; }
  __device__ __forceinline__ u32 empty(int s) const { return base + 8 * (TILE_SLOTS + s); }
  __device__ __forceinline__ u32 tile(int s) const { return base + 16 * TILE_SLOTS + 4 * s; }
  // By thread 0 before the block's first barrier (which publishes it).
  __device__ __forceinline__ void init(int reader_warps) const {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < TILE_SLOTS; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), reader_warps);
    }
  }
  // A tile after the first gridDim.x, from the counter (>= num_tiles: none left).
  __device__ __forceinline__ static int claim(int* counter) { return (int)gridDim.x + atomicAdd(counter, 1); }
  // The producer's k-th claimed tile.
  __device__ __forceinline__ void push(int k, int t) const {
    const int s = k % TILE_SLOTS;
    mbar_wait(empty(s), ((k / TILE_SLOTS) & 1) ^ 1);
    asm volatile("st.shared.b32 [%0], %1;\n mbarrier.arrive.shared::cta.b64 _, [%2];"
                 ::"r"(tile(s)), "r"(t), "r"(full(s)) : "memory");
  }
  __device__ __forceinline__ int pop(int k, int lane) const {
    const int s = k % TILE_SLOTS;
    mbar_wait(full(s), (k / TILE_SLOTS) & 1);
    int t;  // (read by every lane, a broadcast: no branch; lane 0's copy is the one kept)
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(t) : "r"(tile(s)) : "memory");
    t = __shfl_sync(0xffffffffu, t, 0);
    mbar_arrive_if(empty(s), lane == 0);
    return t;
  }
};

// Whether a weight gradient claims its tiles at run time: where the fixed order over `grid` CTAs
// would leave the most loaded one more than ORDER_PERCENT % past the mean, a tile costing its
// group's steps of rows_per_step rows plus one for the epilogue (about a step's worth:
// RESULTS.md), groups holding tiles_per_group tiles each in order; or, for a kernel that passes
// claim_steps > 0, where the mean tile costs claim_steps + 1 or more (long tiles: the FP8 weight
// gradient, RESULTS.md). The loads come from a circular difference array over the CTAs (a
// group's tiles add to runs of CTAs), O(G + grid). Group rows from offs as the kernels take them
// when offs is valid (a corrupt offs can only change the choice of order). All threads of one
// block. scratch: ORDER_SCRATCH long longs.
constexpr int ORDER_PERCENT = 6;  // (ORDER_MAX_GRID, ORDER_SCRATCH: sm90_launch.cuh)
__device__ bool claims_tiles(const int* __restrict__ offs, int M, int G, int tiles_per_group,
                             int rows_per_step, int claim_steps, int grid, long long* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (grid > ORDER_MAX_GRID) return false;
  int* runs = (int*)scratch;  // [grid + 1]; a run's sum is at most the groups' steps
  long long* warp_sums = scratch + (ORDER_MAX_GRID + 2) / 2;
  int* answer = (int*)(warp_sums + 2 * 32);
  // (32-bit: shared-memory atomics on 64-bit values are compare-and-swap loops.)
  auto add = [&](int i, int v) { asm volatile("red.shared.add.s32 [%0], %1;" ::"r"(smem_addr(runs + i)), "r"(v) : "memory"); };
  for (int i = threadIdx.x; i <= grid; i += blockDim.x) runs[i] = 0;
  __syncthreads();
  const long long whole = tiles_per_group / grid;
  const int rest = tiles_per_group % grid;
  long long common = 0, total = 0;
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    const int rows = max(clamped_end(offs, g, M) - (g > 0 ? clamped_end(offs, g - 1, M) : 0), 0);
    const int cost = (rows + rows_per_step - 1) / rows_per_step + 1;
    total += (long long)cost * tiles_per_group;
    common += cost * whole;  // every CTA's share of the group's whole rounds
    if (rest > 0) {          // the rest: CTAs first .. first + rest - 1, circularly
      const int first = (int)(((long long)g * tiles_per_group) % grid), end = first + rest;
      add(first, cost);
      if (end <= grid) {
        add(end, -cost);
      } else {
        add(0, cost);
        add(end - grid, -cost);
      }
    }
  }
  for (int d = 16; d > 0; d >>= 1) {
    common += __shfl_xor_sync(0xffffffffu, common, d);
    total += __shfl_xor_sync(0xffffffffu, total, d);
  }
  if (lane == 0) {
    warp_sums[2 * warp] = common;
    warp_sums[2 * warp + 1] = total;
  }
  __syncthreads();
  if (warp == 0) {  // prefix sums over the CTAs in chunks, the largest load
    const int per = (grid + 31) / 32, b0 = lane * per, b1 = min(b0 + per, grid);
    long long chunk = 0;
    for (int b = b0; b < b1; ++b) chunk += runs[b];
    long long before = chunk;
    for (int d = 1; d < 32; d <<= 1) {
      const long long o = __shfl_up_sync(0xffffffffu, before, d);
      if (lane >= d) before += o;
    }
    before -= chunk;
    long long most = 0;
    for (int b = b0; b < b1; ++b) most = max(most, before += runs[b]);
    for (int d = 16; d > 0; d >>= 1) most = max(most, __shfl_xor_sync(0xffffffffu, most, d));
    if (lane == 0) {
      long long all_common = 0, all_total = 0;
      for (int w = 0; w < (int)blockDim.x / 32; ++w) {
        all_common += warp_sums[2 * w];
        all_total += warp_sums[2 * w + 1];
      }
      const bool long_tiles = claim_steps > 0 && all_total >= (claim_steps + 1LL) * G * tiles_per_group;
      *answer = long_tiles || (most + all_common) * grid * 100 > all_total * (100 + ORDER_PERCENT);
    }
  }
  __syncthreads();
  return *answer;
}

// Group rows by TMA: group_maps[2g] and [2g + 1] are copies of a_map and b_map whose
// dimension DIM, the one that counts the rows (tokens) the weight gradient reduces (1 for the
// bf16/fp16 operands, row-major; 0 for FP8's columnwise data, token-major), ends where group
// g's rows end, so that TMA fills a group's last step past its end with zeros, as it does past
// a tensor's end. That step then needs no zeroing in shared memory: before, each consumer
// zeroed its a rows and all of b's in every group's last step, and the bf16 weight gradient
// ran 1.03-1.11x slower under skewed routing (H200, same outputs; uniform routing, whose
// groups end on whole steps, level; the FP8 one, whose helper warps zeroed, level). The end
// is offs[g] clamped to [0, M] (at least 1): where a corrupt offs makes it smaller than the
// group's start, the kernels' group is empty and reads no map.
// Written in the generic proxy and released to the tensor-map proxy; a reader acquires each
// map before its first use (map_acquire).
template <int DIM>
__device__ __forceinline__ void write_group_maps(const TensorMap& a_map, const TensorMap& b_map,
                                                 TensorMap* __restrict__ group_maps,
                                                 const int* __restrict__ offs, int M, int G) {
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    const int end = max(clamped_end(offs, g, M), 1);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      TensorMap* map = group_maps + 2 * g + m;
      *map = m == 0 ? a_map : b_map;
      asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], %1, %2;"
                   ::"l"((u64)map), "n"(DIM), "r"(end) : "memory");
    }
  }
  asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
}

__device__ __forceinline__ void map_acquire(const TensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"((u64)map) : "memory");
}

// order[0] = 1 where the weight gradient's tiles are to be claimed at run time (0: the fixed
// order), order[1] = 0 (the claims' counter); where group_maps is not null, write_group_maps
// with the rows in dimension row_dim (0 or 1). One block; ORDER_SCRATCH long longs of dynamic
// shared memory.
__device__ __forceinline__ void wgrad_tile_order_body(const int* __restrict__ offs, int M, int G,
                                                      int tiles_per_group, int rows_per_step, int claim_steps,
                                                      int grid, int* __restrict__ order, const TensorMap& a_map,
                                                      const TensorMap& b_map, TensorMap* __restrict__ group_maps,
                                                      int row_dim) {
  extern __shared__ long long order_scratch[];
  if (group_maps != nullptr && row_dim == 0) write_group_maps<0>(a_map, b_map, group_maps, offs, M, G);
  if (group_maps != nullptr && row_dim == 1) write_group_maps<1>(a_map, b_map, group_maps, offs, M, G);
  const bool claimed =
      claims_tiles(offs, M, G, tiles_per_group, rows_per_step, claim_steps, grid, order_scratch);
  if (threadIdx.x == 0) {
    order[0] = claimed;
    order[1] = 0;
  }
}

struct Tile {
  int group, row0, row_end, col0;
};

// Row tiles per band of a group's tile order (below).
constexpr int ROW_TILES_PER_BAND = 16;

// Tile t of the schedule; num_n: column tiles per group.
__device__ __forceinline__ Tile locate(int t, const Schedule& s, int G, int block_m, int block_n, int num_n) {
  int lo = 0, hi = G - 1;  // first group whose tile_end exceeds t
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (s.tile_end[mid] > t) hi = mid; else lo = mid + 1;
  }
  const int local = t - (lo == 0 ? 0 : s.tile_end[lo - 1]);
  const int rows = s.row_end[lo] - s.row_start[lo];
  const int m_tiles = (rows + block_m - 1) / block_m;
  // Row tiles vary fastest: the blocks running at once share few weight column blocks. A group
  // with more row tiles than a band is walked band by band, so that the blocks share its rows
  // too: 132 blocks cover 16 row tiles x 8 column tiles instead of 64 x 2, whose a rows (an
  // 8192-row group at K = 7168: 59 MB in FP8) overflow L2.
  int row_tile, col_tile;
  if (m_tiles <= ROW_TILES_PER_BAND) {
    row_tile = local % m_tiles;
    col_tile = local / m_tiles;
  } else {
    const int band = local / (ROW_TILES_PER_BAND * num_n);
    const int band_rows = min(ROW_TILES_PER_BAND, m_tiles - band * ROW_TILES_PER_BAND);
    const int within = local - band * ROW_TILES_PER_BAND * num_n;
    row_tile = band * ROW_TILES_PER_BAND + within % band_rows;
    col_tile = within / band_rows;
  }
  Tile tile;
  tile.group = lo;
  tile.row0 = s.row_start[lo] + row_tile * block_m;
  tile.row_end = s.row_end[lo];
  tile.col0 = col_tile * block_n;
  return tile;
}
