// bf16/fp16 grouped GEMMs for Hopper (sm_90a): wgmma on TMA-fed shared memory.
//
// grouped_mm_wgrad_{bf16,f16}: the weight gradient, reduced over each group's rows,
//
//   out[g] (P x Q) (+)= a[s_g:e_g]^T (P x rows) . b[s_g:e_g] (rows x Q),   fp32 accumulation,
//
// a (M, P) and b (M, Q) with unit column stride (token-major, as activations and gradients are
// stored), [s_g, e_g) the rows of group g (offs: cumulative ends). Both operands reach the
// tensor cores M/N-major (wgmma's transposed forms), so nothing is copied. Empty groups give
// zeros. out (G, P, Q) bf16, fp16 or fp32 (out_kind 0, 1, 2) with unit column stride; with
// `accumulate`, fp32 out is added to where mask[g] (or every group when mask is null).
// compiled_moe/reference.py: grouped_mm_wgrad is the oracle.
//
// Why CUDA and not Triton: with 128-256 rows per group (Qwen3, GPT-OSS) each output tile is a
// short reduction, and Triton 3.6's kernel spent most of its time waiting (ncu: a warp eligible
// in 23% of cycles, tensor pipes mostly idle; 0.83-0.89x torch._grouped_mm). Here a producer
// warp streams the next tiles' rows while the consumers reduce, and the output tile leaves by
// TMA store under the next tile's wgmma: 0.98-1.29x torch._grouped_mm on the H200 (RESULTS.md).
// The store is what matters at these sizes: the first version wrote the fragment straight
// from registers (4-byte stores, 8 rows per warp instruction) and ran at 0.46-0.83x.
//
// Block: 384 threads. Warpgroup 0 is the producer (one thread issues TMA), warpgroups 1 and 2
// each own 64 of a 128 x 256 output tile's rows (P). Persistent: one block per SM walks
// tiles t = blockIdx.x, + gridDim.x, ... over (group, P tile, Q tile), or (the _claimed
// kernels) tiles claimed at run time where that order is unbalanced (TileQueue, sm90.cuh);
// every group has the same number of tiles, so a tile's place needs no table. A group's last
// 64-row step may run past its end: its loads go through the group's copies of the maps, whose
// rows end there (write_group_maps, sm90.cuh), so TMA fills those rows with zeros.

#include "sm90.cuh"

constexpr int BLOCK_P = 128, BLOCK_Q = 256, BLOCK_R = 64;  // output tile, rows per step
constexpr int CHUNK = 64;                // elements in one 128-byte swizzled row of a box
constexpr int BOX_BYTES = BLOCK_R * 128;  // one 64-row x 64-column box, 8 KB
constexpr int A_BOXES = BLOCK_P / CHUNK, B_BOXES = BLOCK_Q / CHUNK;
constexpr int STAGE_BYTES = (A_BOXES + B_BOXES) * BOX_BYTES;  // 48 KB
constexpr int FRAG = BLOCK_Q / 2;  // fp32 accumulators per consumer thread (64 x 256 / 128)
// A consumer's 64 x 256 output, staged for the TMA store: 4 boxes of 64 rows x 128 bytes for
// 2-byte outputs; fp32 outputs go in two halves of 128 columns.
constexpr int OUT_STAGE_BYTES = 64 * BLOCK_Q * 2;  // 32 KB
constexpr int MAX_STAGES = 8;
constexpr int BAND_P = 8;  // tile order: see band_tile (sm90.cuh)
constexpr int THREADS = SM90_THREADS;

// d (64 x 256 fp32, this warpgroup's fragment) += a (64 x 16) . b (16 x 256); TA / TB: 0 K-major,
// 1 M/N-major (wgmma's transposed forms, 16-bit types only).
#define WGMMA_M64N256K16(TYPE, TA, TB) \
  asm volatile( \
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
      "{" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
      "%128, %129, p, 1, 1, " TA ", " TB ";\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(desc_a), "l"(desc_b))

template <bool F16, bool TA, bool TB>
__device__ __forceinline__ void wgmma_m64n256k16(float* d, u64 desc_a, u64 desc_b) {
  static_assert(TB || !TA, "no kernel reads a M-major with b K-major");
  if constexpr (F16 && TA && TB) WGMMA_M64N256K16("f16", "1", "1");
  else if constexpr (TA && TB) WGMMA_M64N256K16("bf16", "1", "1");
  else if constexpr (F16 && TB) WGMMA_M64N256K16("f16", "0", "1");
  else if constexpr (TB) WGMMA_M64N256K16("bf16", "0", "1");
  else if constexpr (F16) WGMMA_M64N256K16("f16", "0", "0");
  else WGMMA_M64N256K16("bf16", "0", "0");
}

__device__ __forceinline__ int uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// The consumers' k loop over `steps` stages of the ring: wait for a stage, issue(step, stage)
// its wgmma, and give the previous stage back once its wgmma are done, so that one step stays
// in flight while the next is issued. Returns with every wgmma done. UNROLL: the loop's unroll
// factor (0: the compiler's choice).
template <int UNROLL = 0, typename Issue>
__device__ __forceinline__ void consume_steps(int steps, int& stage, u32& phase, int num_stages, u64* full,
                                              u64* empty, unsigned char* smem, int lane, Issue&& issue) {
  int prev_stage = 0;
#pragma unroll UNROLL
  for (int i = 0; i < steps; ++i) {
    mbar_wait(&full[stage], phase);
    issue(i, smem + stage * STAGE_BYTES);
    wgmma_commit();
    wgmma_wait<1>();
    mbar_arrive_if(&empty[prev_stage], lane == 0 && i > 0);
    prev_stage = stage;
    if (++stage == num_stages) { stage = 0; phase ^= 1; }
  }
  wgmma_wait<0>();
  mbar_arrive_if(&empty[prev_stage], lane == 0 && steps > 0);
}

// CLAIMED: the tiles claimed at run time (order[0] set by wgrad_tile_order; this kernel returns
// at once otherwise, and the fixed-order one where it is set).
template <bool F16, bool CLAIMED>
__device__ __forceinline__ void grouped_mm_wgrad(
    const TensorMap& a_map, const TensorMap& b_map, const TensorMap& out_map, int out_kind,
    int accumulate, const unsigned char* __restrict__ mask, const int* __restrict__ offs, int M, int P,
    int Q, int G, int num_stages, const TensorMap* __restrict__ group_maps, int* __restrict__ order) {
  if (order[0] != (int)CLAIMED) return;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 1024-byte alignment of every box: the 128-byte swizzle pattern repeats every 1024 bytes.
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* out_stage = smem + num_stages * STAGE_BYTES;  // 2 consumers x 32 KB
  u64* full = (u64*)(out_stage + 2 * OUT_STAGE_BYTES);
  u64* empty = full + MAX_STAGES;
  const TileQueue tiles = TileQueue::at(empty + MAX_STAGES);  // CLAIMED only

  const int num_p = (P + BLOCK_P - 1) / BLOCK_P, num_q = (Q + BLOCK_Q - 1) / BLOCK_Q;
  const int num_tiles = G * num_p * num_q;
  const int warpgroup = threadIdx.x / 128;
  if (CLAIMED) tiles.init(8);
  init_ring(full, empty, num_stages, 8);
  __syncthreads();

  auto tile_of = [&](int t, int& g, int& p0, int& q0) {  // tile order: band_tile
    g = band_tile(t, num_p, num_q, BAND_P, p0, q0);
    p0 *= BLOCK_P;
    q0 *= BLOCK_Q;
  };

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&b_map) : "memory");
      // Boxes wholly past P or Q are not loaded: they feed only outputs that are not stored.
      int stage = 0;
      u32 phase = 0;
      GroupRows group_rows;  // tiles go in group order
      for (int t = blockIdx.x, next, k = 0, acquired = -1; t < num_tiles; t = next) {
        next = CLAIMED ? TileQueue::claim(order + 1) : t + (int)gridDim.x;
        int g, p0, q0, start, end;
        tile_of(t, g, p0, q0);
        group_rows.of(offs, M, g, start, end);
        // A group's last step, where partial, loads through the group's maps (write_group_maps);
        // every other step through the parameter maps, as before, so that groups that end on
        // whole steps (uniform routing) take no map from global memory and acquire none.
        const TensorMap* a_rows = group_maps + 2 * g;
        const TensorMap* b_rows = a_rows + 1;
        const int a_boxes = min(A_BOXES, (P - p0 + CHUNK - 1) / CHUNK);
        const int b_boxes = min(B_BOXES, (Q - q0 + CHUNK - 1) / CHUNK);
        // (The loads of a step, through the given maps; the full steps, then a partial last one.)
        auto load_step = [&](int row, const TensorMap* a_src, const TensorMap* b_src) {
          mbar_wait(&empty[stage], phase ^ 1);
          unsigned char* dst = smem + stage * STAGE_BYTES;
          mbar_expect_tx(&full[stage], (a_boxes + b_boxes) * BOX_BYTES);
          for (int j = 0; j < a_boxes; ++j)
            tma_load_2d(dst + j * BOX_BYTES, a_src, &full[stage], (p0 + j * CHUNK) * 2, row);
          for (int j = 0; j < b_boxes; ++j)
            tma_load_2d(dst + (A_BOXES + j) * BOX_BYTES, b_src, &full[stage], (q0 + j * CHUNK) * 2, row);
          if (++stage == num_stages) { stage = 0; phase ^= 1; }
          if (CLAIMED && row == start) tiles.push(k++, next);  // after the tile's first load
        };
        int row = start;
        for (; row + BLOCK_R <= end; row += BLOCK_R) load_step(row, &a_map, &b_map);
        if (row < end) {
          if (g != acquired) {
            map_acquire(a_rows);
            map_acquire(b_rows);
            acquired = g;
          }
          load_step(row, a_rows, b_rows);
        }
        if (CLAIMED && start == end) tiles.push(k++, next);  // (an empty group's tile: no loads)
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;  // output rows consumer * 64 .. + 64 of the tile
  const int tid = threadIdx.x - 128 * warpgroup;
  const int warp_in_group = tid / 32, lane = threadIdx.x & 31;
  // This thread's fragment rows within the consumer's 64 (and + 8), and column in each 8.
  const int frag_row = warp_in_group * 16 + lane / 4, frag_col = (lane % 4) * 2;
  unsigned char* staging = out_stage + consumer * OUT_STAGE_BYTES;
  float acc[FRAG];
  int stage = 0;
  u32 phase = 0;
  GroupRows group_rows;

  for (int t = blockIdx.x, k = 0; t < num_tiles; t = CLAIMED ? tiles.pop(k++, lane) : t + (int)gridDim.x) {
    int g, p0, q0, start, end;
    tile_of(t, g, p0, q0);
    group_rows.of(offs, M, g, start, end);
    // The same in every lane (ptxas then sees the loop and the cut's branch as uniform; a
    // branch it takes for divergent inside a wgmma's flight serializes every wgmma).
    const int rows = uniform(end - start);
    const int steps = (rows + BLOCK_R - 1) / BLOCK_R;
#pragma unroll
    for (int i = 0; i < FRAG; ++i) acc[i] = 0.f;
    // Rolled: ptxas unrolls the branch-free loop 3 times otherwise, which ran the weight gradient
    // at 0.94-0.99x on uniform routing (H200; the loop had been rolled while it held a branch).
    consume_steps<1>(steps, stage, phase, num_stages, full, empty, smem, lane, [&](int, unsigned char* st) {
      const unsigned char* a_box = st + consumer * BOX_BYTES;
      const unsigned char* b_box = st + A_BOXES * BOX_BYTES;
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BLOCK_R / 16; ++k)  // 16 rows of k = 2048 bytes of a box
        wgmma_m64n256k16<F16, true, true>(acc, smem_desc_mn(a_box + 2048 * k, BOX_BYTES),
                                            smem_desc_mn(b_box + 2048 * k, BOX_BYTES));
    });
    fence_registers<FRAG>(acc);

    // Epilogue: the fragment goes to shared memory in the 128-byte-swizzled layout of the
    // output map's boxes, then one thread stores it by TMA, which clips rows past P and
    // columns past Q. The store runs on under the next tile's wgmma; only the next epilogue
    // waits for it. With `accumulate`, groups whose mask is set are added to out (fp32)
    // instead of stored.
    const bool add = accumulate && (mask == nullptr || mask[g]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // fp32: 128 columns (4 boxes of 32) at a time
      if (h == 1 && out_kind != 2) break;
      if (tid == 0) bulk_wait_read();  // the previous store has left the staging buffer
      named_barrier(1 + consumer, 128);
      if (out_kind == 2)  // 16 column groups of 8 per half
        stage_fragment_fp32<FRAG / 8>(staging, acc, h * (FRAG / 8), frag_row, frag_col, nullptr);
      else
        stage_fragment_16bit<FRAG / 4>(staging, acc, frag_row, frag_col, out_kind, nullptr);
      fence_async_shared();
      named_barrier(1 + consumer, 128);
      if (tid == 0) {
        const int box_cols = out_kind == 2 ? 32 : 64, row0 = p0 + consumer * 64;
        for (int box = 0; box < 4; ++box) {
          const int col0 = q0 + h * 128 + box * box_cols;
          if (col0 >= Q || row0 >= P) continue;
          if (add) tma_reduce_add_3d(&out_map, staging + box * BOX_BYTES, col0, row0, g);
          else tma_store_3d(&out_map, staging + box * BOX_BYTES, col0, row0, g);
        }
        bulk_commit();
      }
    }
  }
  if (tid == 0) bulk_wait();
}

#define WGRAD_KERNEL(NAME, F16, CLAIMED)                                                                      \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                              \
      const __grid_constant__ TensorMap a_map,   /* a (M, P): bytes {2P, M}, box {128, 64} */                 \
      const __grid_constant__ TensorMap b_map,   /* b (M, Q): bytes {2Q, M}, box {128, 64} */                 \
      const __grid_constant__ TensorMap out_map, /* out (G, P, Q): {Q, P, G}, box {128 bytes, 64, 1} */       \
      int out_kind, int accumulate, const unsigned char* __restrict__ mask, const int* __restrict__ offs,     \
      int M, int P, int Q, int G, int num_stages,                                                             \
      const TensorMap* __restrict__ group_maps, /* wgrad_tile_order's: a_map, b_map a group (G x 2) */         \
      int* __restrict__ order /* wgrad_tile_order's */) {                                                     \
    grouped_mm_wgrad<F16, CLAIMED>(a_map, b_map, out_map, out_kind, accumulate, mask, offs, M, P, Q, G,       \
                                   num_stages, group_maps, order);                                            \
  }

WGRAD_KERNEL(grouped_mm_wgrad_bf16, false, false)
WGRAD_KERNEL(grouped_mm_wgrad_f16, true, false)
WGRAD_KERNEL(grouped_mm_wgrad_bf16_claimed, false, true)
WGRAD_KERNEL(grouped_mm_wgrad_f16_claimed, true, true)

// Both weight gradients' tile order (TileQueue, sm90.cuh), and where group_maps is not null
// their per-group maps (write_group_maps, rows in dimension row_dim): one block, launched
// before them.
extern "C" __global__ void __launch_bounds__(ORDER_THREADS, 1) wgrad_tile_order(
    const int* __restrict__ offs, int M, int G, int tiles_per_group, int rows_per_step, int claim_steps,
    int grid, int* __restrict__ order, const __grid_constant__ TensorMap a_map,
    const __grid_constant__ TensorMap b_map, TensorMap* __restrict__ group_maps, int row_dim) {
  wgrad_tile_order_body(offs, M, G, tiles_per_group, rows_per_step, claim_steps, grid, order, a_map, b_map,
                        group_maps, row_dim);
}

// ---------------------------------------------------------------------------------------------
// grouped_mm_{bf16,f16}[_nmajor]: forward and dgrad,
//
//   out[r, :] = a[r, :] . b[g] (+ bias[g])   for the rows r of group g; rows past offs[-1] get 0,
//
// a (M, K) K-major; b (G, K, N) K-major (the transposed view of an (G, N, K) weight: forward)
// or N-major (_nmajor: the weight itself, for dgrad); out (M, N) bf16/fp16 (out_kind 0, 1)
// with unit column stride and N a multiple of 8; bias (G, N) of any float type (bias_kind 0,
// 1, 2; -1: none). compiled_moe/reference.py: grouped_mm is the oracle.
//
// Same block as the weight gradient: a producer warp, two consumer warpgroups of 64 rows of a
// 128 x 256 tile, 64-deep k steps; persistent over the tile list that every block derives
// from offs (build_schedule). A tile's 128 rows start at a row of its group; rows of the next
// group that its last tile computes are not stored. The fragment goes to shared memory
// (swizzled, conflict-free); 64 rows inside the group leave by TMA store, a group's last rows
// by 16-byte stores of whole 512-byte rows that stop at the group's end.
//
// Split K (max_splits > 1): where the tiles leave SMs idle (a few tokens, as when a model
// decodes), each tile's k steps are cut into ranges taken by different blocks. Each writes its
// fp32 partial products of the group's rows to partial (splits, M, N), the first range with the
// bias, and grouped_mm_split_sum adds them up into out. The count comes from the tile count,
// which only the device knows (split_count); it is stored after the partials for the sum, with
// the groups' last row.

constexpr int BLOCK_M = 128, BLOCK_N = 256, BLOCK_K = 64;

// K ranges per tile for `tiles` tiles on `blocks` blocks, at most max_splits: the fewest that
// bring the waves of tiles (a wave: one tile per block, a tile's time taken as proportional to
// its k steps) down by 10% or more. At a few rows a group a block streams weights at a rate
// set by its own loads in flight, so a wave with idle SMs takes a full wave's time (Mixtral's
// FC2 at T = 8: 96 tiles ran 1.43x faster as 4 ranges of 96); a 5% bar had Qwen3's FC1 at
// T = 128 split 3 ways for 5.5% fewer waves, and run 7% slower (H200, bench_decode.py).
__device__ __forceinline__ int split_count(int tiles, int blocks, int max_splits) {
  int best_splits = 1;
  float best = (float)((tiles + blocks - 1) / blocks);
  for (int s = 2; s <= max_splits; ++s) {
    const float waves = (float)((tiles * s + blocks - 1) / blocks) / s;
    if (waves < 0.9f * best) { best = waves; best_splits = s; }
  }
  return best_splits;
}

constexpr int MAX_GROUPS = 1024;  // the tile list lives in shared memory beside the ring

// Columns c and c + 1 of a tile's bias as staged by the forward (kind: 2 fp32, else 16-bit).
__device__ __forceinline__ float2 staged_bias_pair(const unsigned char* tile_bias, int c, int kind) {
  if (kind == 2) return *(const float2*)(tile_bias + 4 * c);
  return unpack_pair(*(const u32*)(tile_bias + 2 * c), kind);
}

template <bool F16, bool B_NMAJOR, bool SKIP_PAST_ROWS, bool SPLIT_K>
__device__ __forceinline__ void grouped_mm_fwd(
    const TensorMap& a_map, const TensorMap& a_rows_map, const TensorMap& b_map, const TensorMap& out_map,
    void* __restrict__ out,
    int out_kind, long long out_stride_m,
    const void* __restrict__ bias, int bias_kind, long long bias_stride_g, const int* __restrict__ offs, int M,
    int N, int K, int G, int num_stages, float* __restrict__ partial, int max_splits, int force_splits) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* out_stage = smem + num_stages * STAGE_BYTES;  // 2 consumers x 32 KB
  // Each consumer's copy of its tile's bias (up to 256 fp32). Static: through a pointer into the
  // dynamic buffer, ptxas read it with generic loads instead of shared-memory ones.
  __shared__ __align__(16) unsigned char bias_stage[2 * BLOCK_N * 4];
  u64* full = (u64*)(out_stage + 2 * OUT_STAGE_BYTES);
  u64* empty = full + MAX_STAGES;
  int* scratch = (int*)(empty + MAX_STAGES);
  Schedule sched{scratch + 32, scratch + 32 + G, scratch + 32 + 2 * G};

  const int num_n = (N + BLOCK_N - 1) / BLOCK_N;
  const int num_kb = (K + BLOCK_K - 1) / BLOCK_K;
  const int warpgroup = threadIdx.x / 128;
  init_ring(full, empty, num_stages, 8);
  build_schedule(offs, G, M, num_n, BLOCK_M, sched, scratch);  // ends with __syncthreads
  const int num_tiles = sched.tile_end[G - 1];
  // SPLIT_K: the instantiations that may split (the others keep none of its code: in them it
  // had cost 1% on the benchmark's shapes, geometric mean of a same-process A/B).
  const int splits = !SPLIT_K ? 1 : force_splits ? max_splits : split_count(num_tiles, gridDim.x, max_splits);
  if (SPLIT_K && blockIdx.x == 0 && threadIdx.x == 0) {  // for the sum: the count and the groups' last row
    int* tail = (int*)(partial + (long long)max_splits * M * N);
    tail[0] = splits;
    tail[1] = sched.row_end[G - 1];
  }
  const int num_items = num_tiles * splits;  // (tile, k range), the range fastest
  // Item t's tile and k steps [kb0, kb1).
  auto item = [&](int t, int& kb0, int& kb1) {
    kb0 = 0;
    kb1 = num_kb;
    if (!SPLIT_K) return locate(t, sched, G, BLOCK_M, BLOCK_N, num_n);
    const int tile = t / splits, split = t - tile * splits;
    kb0 = split * num_kb / splits;
    kb1 = (split + 1) * num_kb / splits;
    return locate(tile, sched, G, BLOCK_M, BLOCK_N, num_n);
  };

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_map) : "memory");
      if (SKIP_PAST_ROWS) asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_rows_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&b_map) : "memory");
      int stage = 0;
      u32 phase = 0;
      for (int t = blockIdx.x; t < num_items; t += gridDim.x) {
        int kb0, kb1;
        const Tile tile = item(t, kb0, kb1);
        // N-major b: boxes wholly past N are not loaded (they feed only columns not stored).
        const int b_boxes = B_NMAJOR ? min(4, (N - tile.col0 + CHUNK - 1) / CHUNK) : 4;
        // SKIP_PAST_ROWS (a_map's box is 64 rows): a's tile loads only the rows the consumers
        // use, as in the FP8 forward (csrc/fp8_grouped_mm.cu): the second 64-row box where the
        // second consumer has rows of the group, 16-row boxes where 48 or fewer are left.
        // Otherwise one 128-row box. H200, same process against one 128-row box, outputs
        // bitwise equal: serving shapes (T = 1-128, L2 flushed) 1.075x geometric mean, up to
        // 1.39x (Mixtral's FC1 at T = 1); Qwen3 and GPT-OSS training shapes 0.998x (0.97-1.04x).
        const int rows_left = tile.row_end - tile.row0;
        const int row_boxes = SKIP_PAST_ROWS && rows_left <= 48 ? (rows_left + 15) / 16 : 0;
        const int a_bytes = row_boxes > 0 ? row_boxes * 16 * 128
                            : !SKIP_PAST_ROWS || rows_left > 64 ? 2 * BOX_BYTES : BOX_BYTES;
        for (int kb = kb0; kb < kb1; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          unsigned char* dst = smem + stage * STAGE_BYTES;
          mbar_expect_tx(&full[stage], a_bytes + b_boxes * BOX_BYTES);
          if (!SKIP_PAST_ROWS) {
            tma_load_2d(dst, &a_map, &full[stage], kb * BLOCK_K * 2, tile.row0);  // 128 rows x 128 bytes
          } else if (row_boxes > 0) {
            for (int i = 0; i < row_boxes; ++i)
              tma_load_2d(dst + i * 16 * 128, &a_rows_map, &full[stage], kb * BLOCK_K * 2, tile.row0 + 16 * i);
          } else {
            tma_load_2d(dst, &a_map, &full[stage], kb * BLOCK_K * 2, tile.row0);
            if (rows_left > 64) tma_load_2d(dst + BOX_BYTES, &a_map, &full[stage], kb * BLOCK_K * 2, tile.row0 + 64);
          }
          if (B_NMAJOR) {
            for (int j = 0; j < b_boxes; ++j)
              tma_load_3d(dst + (2 + j) * BOX_BYTES, &b_map, &full[stage], (tile.col0 + j * CHUNK) * 2,
                          kb * BLOCK_K, tile.group);
          } else {  // 256 rows of n x 128 bytes of k
            tma_load_3d(dst + 2 * BOX_BYTES, &b_map, &full[stage], kb * BLOCK_K * 2, tile.col0, tile.group);
          }
          if (++stage == num_stages) { stage = 0; phase ^= 1; }
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;  // rows consumer * 64 .. + 64 of the tile
  const int tid = threadIdx.x - 128 * warpgroup;
  const int warp_in_group = tid / 32, lane = threadIdx.x & 31;
  const int frag_row = warp_in_group * 16 + lane / 4, frag_col = (lane % 4) * 2;
  unsigned char* staging = out_stage + consumer * OUT_STAGE_BYTES;
  unsigned char* tile_bias = bias_stage + consumer * (BLOCK_N * 4);
  float acc[FRAG];
  int stage = 0;
  u32 phase = 0;

  for (int t = blockIdx.x; t < num_items; t += gridDim.x) {
    int kb0, kb1;
    const Tile tile = item(t, kb0, kb1);
    const int row0 = tile.row0 + consumer * 64;
    const int steps = kb1 - kb0;
    // SKIP_PAST_ROWS: the second consumer of a group's last tile with 64 rows or fewer has no
    // rows of the group, and hands the stages back without wgmma or stores (the FP8 forward's
    // skip; the test is uniform for ptxas). A separate instantiation: see
    // configs.grouped_mm_sm90_config for where it runs and what it measured.
    if (SKIP_PAST_ROWS && __shfl_sync(0xffffffffu, row0 >= tile.row_end, 0)) {
      pass_steps(steps, stage, phase, num_stages, full, [&](int s) { mbar_arrive_if(&empty[s], lane == 0); });
      continue;
    }
    // The bias of the tile's 256 columns goes to shared memory under the k loop (cp.async of each
    // thread's two columns; columns past N get zeros), for the epilogue to read. Loaded column
    // group by column group inside the epilogue, each load's latency was paid in turn: 1.05-1.52x
    // the time of the forward without a bias (H200). The previous tile's epilogue has read the
    // buffer: every thread passed the barrier after it. (Split K: the first range adds it.)
    const bool staged_bias = bias_kind >= 0 && (!(SPLIT_K && splits > 1) || t % splits == 0);
    if (staged_bias) copy_bias_pair(tile_bias, tid, bias, bias_kind, tile.group * bias_stride_g, tile.col0, N);
#pragma unroll
    for (int i = 0; i < FRAG; ++i) acc[i] = 0.f;
    // The fine-grained training instantiations (SKIP_PAST_ROWS: 256 rows a group or fewer; not
    // split K, which was not measured) keep the k loop rolled; ptxas unrolls it 3 times
    // otherwise. H200, same process, against the unrolled loop (benchmarks/tools/ab_csrc.py, 3
    // rounds, paired): Qwen3 uniform 1.010-1.025x forward and dgrad, skewed fc2 forward 1.024x,
    // GPT-OSS 0.98-1.01x; rolled everywhere, DeepSeek-V3 and Mixtral ran 0.976-1.022x (skewed
    // DeepSeek-V3 0.99x), so they keep the unrolled loop.
    constexpr int UNROLL = SKIP_PAST_ROWS && !SPLIT_K ? 1 : 0;
    consume_steps<UNROLL>(steps, stage, phase, num_stages, full, empty, smem, lane, [&](int, unsigned char* st) {
      const unsigned char* a_tile = st + consumer * (64 * 128);
      const unsigned char* b_tile = st + 2 * BOX_BYTES;
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BLOCK_K / 16; ++k) {
        if constexpr (B_NMAJOR)  // 16 rows of k = 2048 bytes of a box
          wgmma_m64n256k16<F16, false, true>(acc, smem_desc(a_tile + 32 * k), smem_desc_mn(b_tile + 2048 * k, BOX_BYTES));
        else  // 16 elements of k = 32 bytes of a 128-byte row
          wgmma_m64n256k16<F16, false, false>(acc, smem_desc(a_tile + 32 * k), smem_desc(b_tile + 32 * k));
      }
    });
    fence_registers<FRAG>(acc);

    if (SPLIT_K && splits > 1) {
      // Split K: this range's fp32 partial products of the group's rows, straight from the
      // fragment (a few rows: no staging), the bias with the first range.
      float* part = partial + (long long)(t % splits) * M * N;
      if (staged_bias) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        named_barrier(1 + consumer, 128);
      }
#pragma unroll
      for (int j = 0; j < FRAG / 4; ++j) {
        const int col = tile.col0 + 8 * j + frag_col;
        float2 b = make_float2(0.f, 0.f);
        if (staged_bias) b = staged_bias_pair(tile_bias, 8 * j + frag_col, bias_kind);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + frag_row + 8 * r;
          if (row < tile.row_end && col < N)
            *(float2*)(part + (long long)row * N + col) = make_float2(acc[4 * j + 2 * r] + b.x, acc[4 * j + 2 * r + 1] + b.y);
        }
      }
      if (staged_bias) named_barrier(1 + consumer, 128);  // read by all before the next tile's copy
      continue;
    }

    // Epilogue. The staging buffer is free once the previous tile's TMA store has read it and
    // every thread has copied the previous tile out; the barrier also publishes the bias.
    if (tid == 0) bulk_wait_read();
    if (staged_bias) asm volatile("cp.async.wait_all;" ::: "memory");
    named_barrier(1 + consumer, 128);
    // Without a bias the fragment is staged as it is. Through the bias function, each column
    // group took its branches and four additions of 0 (x + 0 is not x for x = -0, so ptxas keeps
    // them): about 16 instructions a column group against 6 (SASS), on the path where the
    // tensor cores wait for the epilogue.
    if (bias_kind < 0) {
      stage_fragment_16bit<FRAG / 4>(staging, acc, frag_row, frag_col, out_kind, nullptr);
    } else if (bias_kind == 2) {  // (the kind's branch outside the column groups)
      stage_fragment_16bit<FRAG / 4>(staging, acc, frag_row, frag_col, out_kind,
                                     [&](int j) { return staged_bias_pair(tile_bias, 8 * j + frag_col, 2); });
    } else {
      stage_fragment_16bit<FRAG / 4>(staging, acc, frag_row, frag_col, out_kind,
                                     [&](int j) { return staged_bias_pair(tile_bias, 8 * j + frag_col, bias_kind); });
    }
    if (row0 + 64 <= tile.row_end) {
      // All 64 rows are the group's: one thread stores them by TMA (clipped at N), and the
      // store runs on under the next tile's wgmma.
      fence_async_shared();
      named_barrier(1 + consumer, 128);
      if (tid == 0) {
        for (int box = 0; box < 4; ++box)
          if (tile.col0 + box * CHUNK < N)
            tma_store_3d(&out_map, staging + box * BOX_BYTES, tile.col0 + box * CHUNK, row0, 0);
        bulk_commit();
      }
    } else {
      // The group ends inside these rows: warp w copies rows w, w + 4, ... up to the end, each
      // lane 16 bytes (8 columns) of the 512-byte row.
      named_barrier(1 + consumer, 128);
      const int col = tile.col0 + 8 * lane;
#pragma unroll 4
      for (int row = warp_in_group; row < 64; row += 4) {
        const int r = row0 + row;
        uint4 v;
        const u32 addr = smem_addr(staging) + row * 128 + (lane / 8) * BOX_BYTES + (((lane % 8) ^ (row & 7)) * 16);
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
        if (r < tile.row_end && col < N) *(uint4*)((unsigned short*)out + (long long)r * out_stride_m + col) = v;
      }
    }
  }
  if (tid == 0) bulk_wait();

  // Rows past the last group are defined as 0.
  const int rows_end = sched.row_end[G - 1];
  const int chunks = N / 8;
  const long long tail = (long long)(M - rows_end) * chunks;
  for (long long i = (long long)blockIdx.x * 256 + (threadIdx.x - 128); i < tail; i += (long long)gridDim.x * 256) {
    const long long r = rows_end + i / chunks, c = (i % chunks) * 8;
    *(uint4*)((unsigned short*)out + r * out_stride_m + c) = make_uint4(0, 0, 0, 0);
  }
}

#define FWD_KERNEL(NAME, F16, B_NMAJOR, SKIP, SPLIT)                                                      \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                          \
      const __grid_constant__ TensorMap a_map, /* a (M, K): bytes {2K, M}, box {128, 128} (SKIP: 64) */    \
      const __grid_constant__ TensorMap a_rows_map, /* SKIP: the same, box {128, 16} */                    \
      const __grid_constant__ TensorMap b_map, /* K-major: bytes {2K, N, G}, box {128, 256, 1};             \
                                                  N-major: bytes {2N, K, G}, box {128, 64, 1} */           \
      const __grid_constant__ TensorMap out_map, /* out (M, N): {N, M, 1}, box {64, 64, 1} */              \
      void* __restrict__ out, int out_kind, long long out_stride_m, const void* __restrict__ bias,         \
      int bias_kind, long long bias_stride_g, const int* __restrict__ offs, int M, int N, int K, int G,    \
      int num_stages, float* __restrict__ partial, int max_splits, int force_splits) {                     \
    grouped_mm_fwd<F16, B_NMAJOR, SKIP, SPLIT>(a_map, a_rows_map, b_map, out_map, out, out_kind,          \
                                               out_stride_m, bias, bias_kind, bias_stride_g, offs, M, N, K, \
                                               G, num_stages, partial, max_splits, force_splits);          \
  }

FWD_KERNEL(grouped_mm_bf16, false, false, false, false)
FWD_KERNEL(grouped_mm_f16, true, false, false, false)
FWD_KERNEL(grouped_mm_bf16_nmajor, false, true, false, false)
FWD_KERNEL(grouped_mm_f16_nmajor, true, true, false, false)
FWD_KERNEL(grouped_mm_bf16_skip, false, false, true, false)
FWD_KERNEL(grouped_mm_f16_skip, true, false, true, false)
FWD_KERNEL(grouped_mm_bf16_nmajor_skip, false, true, true, false)
FWD_KERNEL(grouped_mm_f16_nmajor_skip, true, true, true, false)
// Split K runs where groups have a few rows, so with the skipping consumer.
FWD_KERNEL(grouped_mm_bf16_skip_split, false, false, true, true)
FWD_KERNEL(grouped_mm_f16_skip_split, true, false, true, true)
FWD_KERNEL(grouped_mm_bf16_nmajor_skip_split, false, true, true, true)
FWD_KERNEL(grouped_mm_f16_nmajor_skip_split, true, true, true, true)

// out[r, :] = the sum over the k ranges of partial[s, r, :] (split K, above), for the rows of the
// groups (rows past the last group were zeroed by the GEMM kernel); 4 columns a thread. Nothing
// to do where the GEMM kernel chose one range (it stored out itself).
extern "C" __global__ void grouped_mm_split_sum(const float* __restrict__ partial, void* __restrict__ out,
                                                int out_kind, long long out_stride_m,
                                                int M, int N, int max_splits) {
  const int* tail = (const int*)(partial + (long long)max_splits * M * N);
  const int splits = tail[0], rows = tail[1];  // stored by the GEMM kernel
  if (splits <= 1) return;
  const int quads = N / 4;
  const long long n = (long long)rows * quads;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / quads, c = (i % quads) * 4;
    float4 sum = *(const float4*)(partial + r * N + c);
    for (int s = 1; s < splits; ++s) {
      const float4 v = *(const float4*)(partial + ((long long)s * M + r) * N + c);
      sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
    }
    *(uint2*)((unsigned short*)out + r * out_stride_m + c) =
        make_uint2(pack_half2(out_kind, sum.x, sum.y), pack_half2(out_kind, sum.z, sum.w));
  }
}
