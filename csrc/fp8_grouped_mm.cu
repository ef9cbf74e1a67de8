// FP8 grouped GEMM with 1x128 x 128x128 block scales (the DeepSeek-V3 recipe) for Hopper, sm_90a.
//
//   out[r, :] = sum over 128-deep k blocks kb of (a[r, kb] . b[g, :, kb]) * a_scale[r, kb] * b_scale[g, n/128, kb]
//               (+ bias[g, :])
//
// for the rows r of group g (offs: cumulative group ends); rows past the last group get 0.
// a (M, K) and b (G, N, K) are e4m3 and K-major (the layout Hopper's FP8 tensor cores read),
// out (M, N) bf16, fp16 or fp32 (out_kind 0, 1, 2), plus bias[g] (G, N; bf16, fp16 or fp32, bias_kind
// 0, 1, 2; the *_bias kernels) added before the rounding. compiled_moe/reference.py: scaled_grouped_mm is the oracle.
//
// Why CUDA and not Triton: every 128-deep step's product has to leave the tensor cores and be
// scaled in fp32 before it is added. Triton 3.6 waits for each step's wgmma to finish before it
// issues the next (one `wgmma.wait_group 0` per step in its PTX), so its kernel ran at 600-720
// TFLOP/s. Here a producer warp keeps a ring of TMA loads in flight, and each of two consumer
// warpgroups (64 rows each) keeps two buffers of partial products: step k + 1's wgmma runs
// while step k's is scaled and added (1.26-1.98x the Triton kernel on the H200, RESULTS.md).
//
// Block: 384 threads. Warpgroup 0 is the producer (one thread issues TMA), warpgroups 1 and 2
// compute a 128 x 128 output tile (or 128 x 256: HALVES, below, where groups have the rows).
// Persistent: one block per SM walks the tiles of all groups; the tile list is derived in each
// block from offs (no host loop, no host sync). A tile's 128
// rows start at a row of its group; rows of the next group that the last tile loads are
// computed and not stored.

#include "sm90.cuh"

// 128 x 128 output tiles, 128-deep k steps: one scale of a per row and one of b per step.
constexpr int BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128;
constexpr int TILE_BYTES = BLOCK_M * BLOCK_K;  // one e4m3 operand tile, 16 KB
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int FRAG = BLOCK_N / 2;  // fp32 accumulators per consumer thread
constexpr int MAX_STAGES = 8;
constexpr int THREADS = SM90_THREADS;

// d (64 x 128 fp32, this warpgroup's fragment) = (accumulate ? d : 0) + a (64 x 32) . b (128 x 32)^T,
// with a from shared memory (SS: a descriptor) or from registers (RS: 4 registers a thread, the
// layout ldmatrix_a_step loads).
// C: the fragment's constraint, "+f" (read and written) or "=f" (written only: with scale-d 0
// the old values are not read, and telling the compiler so frees their registers before the
// first wgmma of a product).
#define FRAG64_REGS                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FRAG64_OPERANDS(C)                                                                       \
  C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), C(d[8]), C(d[9]),      \
      C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), C(d[16]), C(d[17]), C(d[18]),  \
      C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), C(d[24]), C(d[25]), C(d[26]), C(d[27]),  \
      C(d[28]), C(d[29]), C(d[30]), C(d[31]), C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]),  \
      C(d[37]), C(d[38]), C(d[39]), C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]),  \
      C(d[46]), C(d[47]), C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]),  \
      C(d[55]), C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63])
#define WGMMA_M64N128K32_E4M3(C, SCALE_D)                                                      \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                  \
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FRAG64_REGS            \
               ", %64, %65, p, 1, 1;\n}\n"                                                     \
               : FRAG64_OPERANDS(C)                                                            \
               : "l"(desc_a), "l"(desc_b), "r"(SCALE_D))
#define WGMMA_M64N128K32_E4M3_RS(C, SCALE_D)                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                  \
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FRAG64_REGS            \
               ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"                                    \
               : FRAG64_OPERANDS(C)                                                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(SCALE_D))
#define READ_WRITE(x) "+f"(x)
#define WRITE_ONLY(x) "=f"(x)

__device__ __forceinline__ void wgmma_m64n128k32(float* d, u64 desc_a, u64 desc_b, int accumulate) {
  WGMMA_M64N128K32_E4M3(READ_WRITE, accumulate);
}

// The first wgmma of a product: d = a . b^T, without reading d.
__device__ __forceinline__ void wgmma_m64n128k32_first(float* d, u64 desc_a, u64 desc_b) {
  WGMMA_M64N128K32_E4M3(WRITE_ONLY, 0);
}

__device__ __forceinline__ void wgmma_m64n128k32_rs(float* d, const u32* a, u64 desc_b) {
  WGMMA_M64N128K32_E4M3_RS(READ_WRITE, 1);
}

__device__ __forceinline__ void wgmma_m64n128k32_rs_first(float* d, const u32* a, u64 desc_b) {
  WGMMA_M64N128K32_E4M3_RS(WRITE_ONLY, 0);
}

// A 128-deep step of a warpgroup's 64 x 128-byte a tile (128-byte swizzle, as TMA writes it)
// into the registers of four RS wgmma m64nNk32: a[4k .. 4k + 3] for the k-th 32 bytes. Warp w
// holds rows 16w .. 16w + 15; a thread's register i has 4 bytes of row lane / 4 + 8 (i % 2),
// columns 4 (lane % 4) + 16 (i / 2) (wgmma's register layout of an 8-bit a). One ldmatrix.x4
// (8 x 8 matrices of 16-bit elements) loads exactly that: lanes 8q .. 8q + 7 address matrix
// q's rows, row 8 (q % 2) + lane % 8 at 16-byte chunk 2k + q / 2.
__device__ __forceinline__ void ldmatrix_a_step(u32* a, u32 a_tile, int warp_in_group, int lane) {
  const int row = warp_in_group * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
  const u32 base = a_tile + row * 128;
#pragma unroll
  for (int k = 0; k < BLOCK_K / 32; ++k) {
    const u32 addr = base + ((((2 * k) + (lane >> 4)) ^ (row & 7)) << 4);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[4 * k]), "=r"(a[4 * k + 1]), "=r"(a[4 * k + 2]), "=r"(a[4 * k + 3])
                 : "r"(addr));
  }
}

// The scales of one k step for a consumer thread's two rows (r0, r0 + 8): a's times b's.
struct StepScales {
  float s0, s1;
};

// A consumer's 64 x 128 output staged for TMA stores: 2 boxes of 64 columns (2-byte outputs)
// or 4 of 32 (fp32), each 64 rows x 128 bytes.
__device__ __forceinline__ int staging_boxes(int out_kind) { return out_kind == 2 ? 4 : 2; }

// The epilogue of both kernels: consumer warpgroup `consumer` writes its fragment into its
// staging boxes once the previous tile's store has read them. Returns after the warpgroup's
// barrier, with the boxes ready for tma_store_3d (fenced) or for reading back. Every thread
// waits for its own bulk groups (only the storing thread has any), so the code holds no
// divergent branch and may run while a wgmma is in flight. (The row goes through an opaque
// move: otherwise the compiler computes the 32 staging addresses once, before the tile loop,
// and keeps them in registers the k loop needs.)
//
// HAS_BIAS: tile_bias is the shared address of the consumer's copy of the tile's 128 bias
// columns (bias_kind 0 bf16, 1 fp16, 2 fp32; cp.async, waited for here and published by the
// barrier), added to the fp32 fragment before it is rounded. A thread's 16 bias pairs are read
// before its first store: asm volatile keeps loads and stores in program order, so a load
// between the stores would wait for the store before it. Without a bias the code is that of a
// kernel without one.
__device__ __forceinline__ float2 shared_bias_pair(u32 tile_bias, int c, int kind) {
  if (kind == 2) return ld_shared_f32x2(tile_bias + 4 * c);
  return unpack_pair(ld_shared_u32(tile_bias + 2 * c), kind);
}

//
// HALVES 128-column halves (acc[64 h ..], bias columns 128 h ..) go to consecutive staging areas
// of staging_boxes(out_kind) boxes each.
template <bool HAS_BIAS, int HALVES = 1>
__device__ __forceinline__ void stage_output(unsigned char* staging, const float* acc, int out_kind, int consumer,
                                             int frag_row, int frag_col, u32 tile_bias = 0, int bias_kind = -1) {
  bulk_wait_read();
  if constexpr (HAS_BIAS) asm volatile("cp.async.wait_all;" ::: "memory");
  named_barrier(2 + consumer, 128);
  int row;
  asm volatile("mov.b32 %0, %1;" : "=r"(row) : "r"(frag_row));
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
    unsigned char* half_staging = staging + h * staging_boxes(out_kind) * STAGING_BOX_BYTES;
    const float* half_acc = acc + h * FRAG;
    if constexpr (HAS_BIAS) {
      float2 b[FRAG / 4];
      const int c0 = h * BLOCK_N + frag_col;
      if (bias_kind == 2) {  // (the kind's branch outside the column groups)
#pragma unroll
        for (int j = 0; j < FRAG / 4; ++j) b[j] = shared_bias_pair(tile_bias, 8 * j + c0, 2);
      } else {
#pragma unroll
        for (int j = 0; j < FRAG / 4; ++j) b[j] = shared_bias_pair(tile_bias, 8 * j + c0, bias_kind);
      }
      auto bias = [&](int j) { return b[j]; };
      if (out_kind == 2) stage_fragment_fp32<FRAG / 4>(half_staging, half_acc, 0, row, frag_col, bias);
      else stage_fragment_16bit<FRAG / 4>(half_staging, half_acc, row, frag_col, out_kind, bias);
    } else {
      if (out_kind == 2) stage_fragment_fp32<FRAG / 4>(half_staging, half_acc, 0, row, frag_col, nullptr);
      else stage_fragment_16bit<FRAG / 4>(half_staging, half_acc, row, frag_col, out_kind, nullptr);
    }
  }
  fence_async_shared();
  named_barrier(2 + consumer, 128);
}

// CLUSTER 2: the two CTAs of a cluster compute the two 128-column halves of a 128 x 256 tile
// (tiles are walked in pairs of column tiles) and each loads half of the shared a tile (64 rows)
// by TMA multicast into both; a stage goes back to the producers once the consumers of both CTAs
// have released it.
// HAS_BIAS: a separate instantiation, so that the kernel without a bias keeps its code (with
// the bias's branches in one kernel, the bias-free forward ran 0.986x in one A/B on the H200,
// 0.955x on Qwen3 fc2).
// HALVES 2 (CLUSTER 1 only): 128 x 256 tiles, 2-byte outputs only (the staging of fp32 would not
// fit beside the ring). A consumer's 64 x 256 accumulator and one 64 x 128 buffer of partial
// products fill its registers, so a k step is two half-width products in turn, each waited for
// and promoted, whose a comes from registers (RS wgmma: one ldmatrix pass over the stage's a
// tile serves both halves). Per flop, that reads 17% fewer bytes from shared memory than the
// 128 x 128 tile's SS wgmma, and the ring takes 25% fewer bytes from L2: H200, same process,
// outputs bitwise equal, 1.07-1.12x on the DeepSeek-V3, Qwen3 and Mixtral training shapes,
// 0.99-1.05x on GPT-OSS's (geometric mean 1.081x; RESULTS.md, which also has the variants
// that lost: the consumers' products in turns, four 64-column products into two buffers).
template <int CLUSTER, bool HAS_BIAS, int HALVES = 1>
__device__ __forceinline__ void fp8_blockwise_grouped_mm_body(
    const TensorMap& a_map, const TensorMap& a_rows_map, const TensorMap& b_map, const TensorMap& out_map,
    const float* __restrict__ a_scale, long long a_scale_stride_m, int a_scale_stride_k,
    const float* __restrict__ b_scale, long long b_scale_stride_g, int b_scale_stride_n, int b_scale_stride_k,
    void* __restrict__ out, int out_kind, long long out_stride_m,
    const void* __restrict__ bias, int bias_kind, long long bias_stride_g,
    const int* __restrict__ offs, int M, int N, int K, int G, int num_stages) {
  extern __shared__ __align__(1024) unsigned char fwd_smem_raw[];
  // 1024-byte alignment of every tile: the 128-byte swizzle pattern repeats every 1024 bytes.
  static_assert(HALVES == 1 || CLUSTER == 1, "128 x 256 tiles without clusters");
  constexpr int stage_bytes = (1 + HALVES) * TILE_BYTES;  // a, then HALVES 128-row tiles of b
  unsigned char* smem = (unsigned char*)(((u64)fwd_smem_raw + 1023) & ~1023ull);
  const int staging_bytes = HALVES * staging_boxes(out_kind) * STAGING_BOX_BYTES;
  unsigned char* out_stage = smem + num_stages * stage_bytes;
  unsigned char* bias_stage = out_stage + 2 * staging_bytes;  // 2 consumers x HALVES x 128 fp32
  u64* full = (u64*)(bias_stage + 2 * HALVES * BLOCK_N * 4);
  u64* empty = full + MAX_STAGES;
  int* scratch = (int*)(empty + MAX_STAGES);
  Schedule sched{scratch + 32, scratch + 32 + G, scratch + 32 + 2 * G};

  const int tile_n = BLOCK_N * CLUSTER * HALVES;  // the columns of the tiles the schedule walks
  const int num_n = (N + tile_n - 1) / tile_n;
  const int num_kb = (K + BLOCK_K - 1) / BLOCK_K;
  const int warpgroup = threadIdx.x / 128;
  const u32 rank = CLUSTER > 1 ? cluster_rank() : 0;
  const int first_tile = blockIdx.x / CLUSTER, tile_step = gridDim.x / CLUSTER;
  init_ring(full, empty, num_stages, 8 * CLUSTER);
  build_schedule(offs, G, M, num_n, BLOCK_M, sched, scratch);  // ends with __syncthreads
  if (CLUSTER > 1) cluster_sync();  // the peer's barriers are initialized before it is sent bytes
  const int num_tiles = sched.tile_end[G - 1];
  // This CTA's tile: the schedule's, columns shifted to its half.
  auto my_tile = [&](int t) {
    Tile tile = locate(t, sched, G, BLOCK_M, tile_n, num_n);
    tile.col0 += BLOCK_N * rank;
    return tile;
  };

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_rows_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&b_map) : "memory");
      int stage = 0;
      u32 phase = 0;
      for (int t = first_tile; t < num_tiles; t += tile_step) {
        const Tile tile = my_tile(t);
        // Without a cluster, a's tile loads only the rows the consumers use: the second 64-row
        // box where the second consumer has rows of the group (it skips the tile otherwise,
        // below), and 16-row boxes where the group has 48 rows or fewer left. At a few rows a
        // group the rest of the tile is TMA's zeros (past M) or the next groups' rows, and
        // filling shared memory with them slowed the stream of weights: H200, same process,
        // serving shapes (T = 1-128 tokens, L2 flushed), outputs bitwise equal: 64-row halves
        // 1.13x geometric mean over the 128-row box (up to 1.59x on DeepSeek-V3's FC1 at
        // T = 8), then 16-row boxes 1.03x more (up to 1.14x on GPT-OSS at T = 8); training
        // shapes 0.999x and 0.995x (0.96-1.03x per case).
        const bool second_half = CLUSTER > 1 || tile.row0 + 64 < tile.row_end;
        const int rows_left = tile.row_end - tile.row0;
        const int row_boxes = CLUSTER == 1 && rows_left <= 48 ? (rows_left + 15) / 16 : 0;
        const int a_bytes = row_boxes > 0 ? row_boxes * 16 * BLOCK_K : second_half ? TILE_BYTES : TILE_BYTES / 2;
        // A 128 x 256 tile's second half past N (N's last 128 columns or fewer) is not loaded.
        const int b_halves = HALVES == 2 && tile.col0 + BLOCK_N < N ? 2 : 1;
        for (int kb = 0; kb < num_kb; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          unsigned char* dst = smem + stage * stage_bytes;
          mbar_expect_tx(&full[stage], a_bytes + b_halves * TILE_BYTES);
          if constexpr (CLUSTER > 1) {  // this CTA's half of a, to both CTAs
            tma_load_2d_multicast(dst + rank * (TILE_BYTES / 2), &a_map, &full[stage], kb * BLOCK_K,
                                  tile.row0 + 64 * rank, (unsigned short)((1 << CLUSTER) - 1));
          } else if (row_boxes > 0) {  // the first consumer's rows in 16-row boxes
            for (int i = 0; i < row_boxes; ++i)
              tma_load_2d(dst + i * (16 * BLOCK_K), &a_rows_map, &full[stage], kb * BLOCK_K, tile.row0 + 16 * i);
          } else {
            tma_load_2d(dst, &a_map, &full[stage], kb * BLOCK_K, tile.row0);
            if (second_half)
              tma_load_2d(dst + TILE_BYTES / 2, &a_map, &full[stage], kb * BLOCK_K, tile.row0 + 64);
          }
          // Columns past N (the second half of the last pair) load as zeros.
          for (int h = 0; h < b_halves; ++h)
            tma_load_3d(dst + (1 + h) * TILE_BYTES, &b_map, &full[stage], kb * BLOCK_K, tile.col0 + h * BLOCK_N,
                        tile.group);
          if (++stage == num_stages) { stage = 0; phase ^= 1; }
        }
      }
    }
    if (CLUSTER > 1) cluster_sync();
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;  // rows consumer*64 .. +64 of the tile
  const int tid_wg = threadIdx.x & 127;
  const int warp_in_group = tid_wg / 32, lane = threadIdx.x & 31;
  const int frag_row = warp_in_group * 16 + lane / 4;  // within the consumer's 64 rows, and + 8
  const int frag_col = (lane % 4) * 2;                 // + 8 j, and + 1
  unsigned char* staging = out_stage + consumer * staging_bytes;
  unsigned char* tile_bias = bias_stage + consumer * (HALVES * BLOCK_N * 4);
  const int es = out_kind == 2 ? 4 : 2;
  // Two buffers of partial products: the wgmma of step kb + 1 runs on the tensor cores while
  // this thread scales and adds step kb's. With one buffer (wait for every step's wgmma, then
  // scale) the kernel ran at 980 TFLOP/s at most on the DeepSeek-V3 fc1 shape even with no
  // loads at all, and 830 with them. (HALVES 2 uses part_a only.)
  float acc[HALVES * FRAG], part_a[FRAG], part_b[FRAG];
  int stage = 0;
  u32 phase = 0;

  // (128 x 256 tiles: the bound is read from shared memory, which keeps ptxas from spilling it
  // and the tile index.)
  for (int t = first_tile; t < (HALVES == 2 ? (int)ld_shared_u32(smem_addr(&sched.tile_end[G - 1])) : num_tiles);
       t += tile_step) {
    const Tile tile = my_tile(t);
    const int row0 = tile.row0 + consumer * 64;
    // A group's last tile with 64 rows or fewer left: the second consumer's rows all lie past
    // the group, so it hands the stages back without wgmma or stores (about half the groups
    // under skewed routing end so). The test is made uniform for ptxas (see below). H200,
    // same process against the kernel without it (benchmarks/tools/ab_csrc.py): 1.04-1.09x on the
    // Qwen3 and GPT-OSS skewed shapes, 1.026x geometric mean over the 16 forward cases.
    if (__shfl_sync(0xffffffffu, row0 >= tile.row_end, 0)) {
      pass_steps(num_kb, stage, phase, num_stages, full, [&](int s) {
        mbar_arrive_if(&empty[s], lane == 0);
        if constexpr (CLUSTER > 1) mbar_arrive_remote_if(&empty[s], rank ^ 1, lane == 0);
      });
      continue;
    }
    // The tile's bias goes to shared memory under the k loop, two columns a thread of the first
    // two warps (zeros past N); the previous tile's epilogue has read the buffer (its barrier).
    if (HAS_BIAS && tid_wg < HALVES * BLOCK_N / 2)
      copy_bias_pair(tile_bias, tid_wg, bias, bias_kind, tile.group * bias_stride_g, tile.col0, N);
    const int r0 = row0 + frag_row, r1 = r0 + 8;
    const float* sa0 = a_scale + (long long)min(r0, M - 1) * a_scale_stride_m;
    const float* sa1 = a_scale + (long long)min(r1, M - 1) * a_scale_stride_m;
    const float* sb = b_scale + tile.group * b_scale_stride_g +
                      (long long)(min(tile.col0, N - 1) / BLOCK_N) * b_scale_stride_n;
    auto scales = [&](int kb) {
      const float b = sb[kb * b_scale_stride_k];
      return StepScales{sa0[kb * a_scale_stride_k] * b, sa1[kb * a_scale_stride_k] * b};
    };
    // Waits for the next stage and issues its four wgmma into `part`; returns the stage.
    auto issue = [&](float* part) {
      mbar_wait(&full[stage], phase);
      const unsigned char* a_tile = smem + stage * stage_bytes + consumer * (64 * BLOCK_K);
      const unsigned char* b_tile = smem + stage * stage_bytes + TILE_BYTES;
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BLOCK_K / 32; ++k)
        wgmma_m64n128k32(part, smem_desc(a_tile + 32 * k), smem_desc(b_tile + 32 * k), k > 0);
      wgmma_commit();
      const int issued = stage;
      if (++stage == num_stages) { stage = 0; phase ^= 1; }
      return issued;
    };
    auto release = [&](int s) {
      mbar_arrive_if(&empty[s], lane == 0);
      if constexpr (CLUSTER > 1) mbar_arrive_remote_if(&empty[s], rank ^ 1, lane == 0);
    };
    // The DeepSeek-V3 promotion: each 128-deep product is scaled and added in fp32.
    auto add_scaled = [&](float* into, const float* part, StepScales sc) {
#pragma unroll
      for (int j = 0; j < FRAG / 4; ++j) {
        into[4 * j + 0] = fmaf(part[4 * j + 0], sc.s0, into[4 * j + 0]);
        into[4 * j + 1] = fmaf(part[4 * j + 1], sc.s0, into[4 * j + 1]);
        into[4 * j + 2] = fmaf(part[4 * j + 2], sc.s1, into[4 * j + 2]);
        into[4 * j + 3] = fmaf(part[4 * j + 3], sc.s1, into[4 * j + 3]);
      }
    };
    // A step's product is read, its stage goes back to the producer, then it is added.
    auto promote = [&](const float* part, int part_stage, StepScales sc) {
      fence_registers<FRAG>(const_cast<float*>(part));
      release(part_stage);
      add_scaled(acc, part, sc);
    };

#pragma unroll
    for (int i = 0; i < HALVES * FRAG; ++i) acc[i] = 0.f;
    if constexpr (HALVES == 1) {
      // Steady state, two steps per turn so both buffers keep fixed registers: issue step kb + 1,
      // wait until only it is in flight, promote step kb. Only uniform branches: ptxas serializes
      // all wgmma when their flight spans a divergent one.
      StepScales s_a = scales(0), s_b;
      int stage_a = issue(part_a), stage_b;
      int kb = 0;
      for (; kb + 2 < num_kb; kb += 2) {
        s_b = scales(kb + 1);
        stage_b = issue(part_b);
        wgmma_wait<1>();
        promote(part_a, stage_a, s_a);
        s_a = scales(kb + 2);
        stage_a = issue(part_a);
        wgmma_wait<1>();
        promote(part_b, stage_b, s_b);
      }
      if (kb + 1 < num_kb) {  // two steps left
        s_b = scales(kb + 1);
        stage_b = issue(part_b);
        wgmma_wait<1>();
        promote(part_a, stage_a, s_a);
        wgmma_wait<0>();
        promote(part_b, stage_b, s_b);
      } else {  // one step left
        wgmma_wait<0>();
        promote(part_a, stage_a, s_a);
      }
    } else {
      // Per step: a's 64 x 128 bytes into registers, then per 128-column half four RS wgmma,
      // waited for, and the promotion; the other consumer's wgmma keep the tensor cores busy
      // meanwhile. The second half lies past N in N's last tile or two (not loaded, skipped).
      // The scales by 32-bit offsets (the launcher checks that they fit): with 64-bit
      // pointers, ptxas spilled registers in the bias kernel's k loop.
      const bool half1 = __shfl_sync(0xffffffffu, tile.col0 + BLOCK_N < N, 0);
      int sa_0 = min(r0, M - 1) * (int)a_scale_stride_m, sa_1 = min(r1, M - 1) * (int)a_scale_stride_m;
      int sb_0 = tile.group * (int)b_scale_stride_g + (min(tile.col0, N - 1) / BLOCK_N) * b_scale_stride_n;
      u32 a_regs[BLOCK_K / 8];  // 4 registers per 32-deep wgmma
      auto half_product = [&](const unsigned char* b_tile) {
        wgmma_fence();
        wgmma_m64n128k32_rs_first(part_a, a_regs, smem_desc(b_tile));
#pragma unroll
        for (int k = 1; k < BLOCK_K / 32; ++k) wgmma_m64n128k32_rs(part_a, a_regs + 4 * k, smem_desc(b_tile + 32 * k));
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers<FRAG>(part_a);
      };
      for (int kb = 0; kb < num_kb; ++kb) {
        const float x0 = a_scale[sa_0], x1 = a_scale[sa_1];
        const float y0 = b_scale[sb_0], y1 = b_scale[sb_0 + (half1 ? b_scale_stride_n : 0)];
        sa_0 += a_scale_stride_k;
        sa_1 += a_scale_stride_k;
        sb_0 += b_scale_stride_k;
        mbar_wait(&full[stage], phase);
        const unsigned char* st = smem + stage * stage_bytes;
        ldmatrix_a_step(a_regs, smem_addr(st + consumer * (64 * BLOCK_K)), warp_in_group, lane);
        half_product(st + TILE_BYTES);
        if (half1) {
          add_scaled(acc, part_a, StepScales{x0 * y0, x1 * y0});
          half_product(st + 2 * TILE_BYTES);
          release(stage);
          add_scaled(acc + FRAG, part_a, StepScales{x0 * y1, x1 * y1});
        } else {
          release(stage);
          add_scaled(acc, part_a, StepScales{x0 * y0, x1 * y0});
        }
        if (++stage == num_stages) { stage = 0; phase ^= 1; }
      }
    }

    // Epilogue: 64 rows inside the group leave by TMA store (clipped at N), which runs on under
    // the next tile's wgmma; a group's last rows by 16-byte stores of whole rows that stop at
    // the group's end (TMA would write the next group's rows). Storing from registers instead
    // (4-byte stores, 8 rows per warp instruction) took 1.01-1.27x this version's time on 13
    // of the 16 bench_fp8 shapes, most where K is short (Qwen3 fc2 1.27x, DeepSeek-V3 fc2
    // 1.09-1.13x), and 0.99-1.00x on the other three (H200).
    stage_output<HAS_BIAS, HALVES>(staging, acc, out_kind, consumer, frag_row, frag_col, smem_addr(tile_bias),
                                   bias_kind);
    if (row0 + 64 <= tile.row_end) {
      if (tid_wg == 0) {
        for (int box = 0; box < HALVES * staging_boxes(out_kind); ++box)
          if (tile.col0 + box * (128 / es) < N)
            tma_store_3d(&out_map, staging + box * STAGING_BOX_BYTES, tile.col0 + box * (128 / es), row0, 0);
        bulk_commit();
      }
    } else {
      // Lane l copies 16-byte chunk c = l % chunks of a row (box c / 8, chunk c % 8 swizzled),
      // 32 / chunks rows per warp instruction; N is a multiple of 8 (16 bytes of bf16).
      const int chunks = 8 * es, c = lane % chunks;
      for (int h = 0; h < HALVES; ++h) {
        const int col = tile.col0 + h * BLOCK_N + c * (16 / es);
        const u32 half_staging = smem_addr(staging) + h * (staging_bytes / HALVES);
        for (int row = warp_in_group * (32 / chunks) + lane / chunks; row < 64; row += 128 / chunks) {
          const int r = row0 + row;
          uint4 v;
          const u32 addr = half_staging + row * 128 + (c / 8) * STAGING_BOX_BYTES + (((c % 8) ^ (row & 7)) * 16);
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
          if (r < tile.row_end && col < N) *(uint4*)((unsigned char*)out + ((long long)r * out_stride_m + col) * es) = v;
        }
      }
    }
  }
  if (tid_wg == 0) bulk_wait();

  // Rows past the last group are defined as 0.
  const int rows_end = sched.row_end[G - 1];
  const long long tail = (long long)(M - rows_end) * N;
  for (long long i = (long long)blockIdx.x * 256 + (threadIdx.x - 128); i < tail; i += (long long)gridDim.x * 256) {
    const long long r = rows_end + i / N, c = i % N;
    store_one(out, out_kind, r * out_stride_m + c, 0.f);
  }
  // The peer may still arrive on this CTA's barriers until its consumers are done.
  if (CLUSTER > 1) cluster_sync();
}

#define FP8_BLOCKWISE_KERNEL(NAME, CLUSTER, HAS_BIAS, HALVES, ATTRS)                                        \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) ATTRS NAME(                                      \
      const __grid_constant__ TensorMap a_map, /* a (M, K) e4m3: dims {K, M}, box {128, 64} */              \
      const __grid_constant__ TensorMap a_rows_map, /* the same, box {128, 16} */                           \
      const __grid_constant__ TensorMap b_map, /* b (G, N, K) e4m3: dims {K, N, G}, box {128, 128, 1} */    \
      const __grid_constant__ TensorMap out_map, /* out (M, N): dims {N, M, 1}, box {128 bytes, 64, 1} */   \
      const float* __restrict__ a_scale, long long a_scale_stride_m, int a_scale_stride_k,                  \
      const float* __restrict__ b_scale, long long b_scale_stride_g, int b_scale_stride_n,                  \
      int b_scale_stride_k, void* __restrict__ out, int out_kind, long long out_stride_m,                   \
      const void* __restrict__ bias, int bias_kind, long long bias_stride_g, /* HAS_BIAS only */            \
      const int* __restrict__ offs, int M, int N, int K, int G, int num_stages) {                           \
    fp8_blockwise_grouped_mm_body<CLUSTER, HAS_BIAS, HALVES>(                                               \
        a_map, a_rows_map, b_map, out_map, a_scale, a_scale_stride_m, a_scale_stride_k, b_scale,            \
        b_scale_stride_g, b_scale_stride_n, b_scale_stride_k, out, out_kind, out_stride_m, bias, bias_kind, \
        bias_stride_g, offs, M, N, K, G, num_stages);                                                       \
  }

FP8_BLOCKWISE_KERNEL(fp8_blockwise_grouped_mm, 1, false, 1, )
FP8_BLOCKWISE_KERNEL(fp8_blockwise_grouped_mm_bias, 1, true, 1, )
// Launched on an even grid.
FP8_BLOCKWISE_KERNEL(fp8_blockwise_grouped_mm_x2, 2, false, 1, __cluster_dims__(2, 1, 1))
FP8_BLOCKWISE_KERNEL(fp8_blockwise_grouped_mm_x2_bias, 2, true, 1, __cluster_dims__(2, 1, 1))
// 128 x 256 tiles, 2-byte outputs.
FP8_BLOCKWISE_KERNEL(fp8_blockwise_grouped_mm_n256, 1, false, 2, )
FP8_BLOCKWISE_KERNEL(fp8_blockwise_grouped_mm_n256_bias, 1, true, 2, )

// ---------------------------------------------------------------------------------------------
// fp8_grouped_mm_wgrad: the weight gradient from columnwise data,
//
//   out[g] (P x Q) = sum over the 128-row chunks c of group g (from its first row) of
//                    (a_t[:, c] . d_t[:, c]^T) * a_scale[:, slot] (x) d_scale[:, slot],
//
// slot = the group's first columnwise scale slot + c for fp8_blockwise (1x128 blocks), or g
// for fp8_rowwise (`scale_per_group`: one scale per column of each group; compiled_moe/
// reference.py: fp8_column_slots, scaled_grouped_mm_wgrad). a_t (P, M) and d_t (Q, M) are grouped_quantize's
// columnwise e4m3 data: K-major along the rows (tokens) that the product reduces, as Hopper's
// FP8 tensor cores read. out (G, P, Q) bf16, fp16 or fp32 with unit column stride.
//
// Why CUDA: the Triton kernel waits for every chunk's wgmma before scaling it, and stored its
// tile from registers; it ran at 0.39-0.83x of torch._grouped_mm in bf16. This kernel:
// 0.89-1.15x (RESULTS.md), about level with bf16. It is the forward kernel's block (producer
// warp, two consumer warpgroups of 64 rows) walking (group, P tile, Q tile) tiles (claimed at
// run time in fp8_grouped_mm_wgrad_claimed, where the fixed order is unbalanced: TileQueue,
// sm90.cuh); the producer warpgroup's other three warps stage each chunk's scales (per row of
// a_t and of d_t); a group's chunk that passes its end loads through the group's copies of the
// maps, which end there (write_group_maps, sm90.cuh), so TMA fills the columns past it with
// zeros; the bf16 weight gradient's TMA-store epilogue (the tile leaves under the next tile's
// wgmma). A TMA box starts at a 16-byte multiple along the rows (a misaligned start is an
// illegal instruction): a group that starts elsewhere loads each chunk from the 16-row
// boundary below it, plus a 16-row side box past the window, and the helper warp that stages
// the chunk's scales moves its rows into place (shift_chunk), so every group runs here.

constexpr int WGRAD_BAND_P = 8;  // tile order: see band_tile (sm90.cuh)
// A stage's side boxes (an unaligned group's 16 rows past the window): a_t's 128 rows x 16
// bytes, then d_t's, unswizzled.
constexpr int SIDE_BYTES = 2 * 128 * 16;

__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ void st_shared_v4(u32 addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Bytes 4 Q + s / 8 .. + 15 of the 32 bytes lo, hi (Q, the shift's whole words, a constant: the
// words are picked without registers to spare, which the helper warps lack).
template <int Q>
__device__ __forceinline__ uint4 bytes_from(uint4 lo, uint4 hi, int s) {
  const u32 u[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  return make_uint4(__funnelshift_r(u[Q], u[Q + 1], s), __funnelshift_r(u[Q + 1], u[Q + 2], s),
                    __funnelshift_r(u[Q + 2], u[Q + 3], s), __funnelshift_r(u[Q + 3], u[Q + 4], s));
}

// v with its bytes from n on (0 <= n < 16) set to zero.
__device__ __forceinline__ uint4 first_bytes(uint4 v, int n) {
  auto keep = [n](u32 w, int at) {
    const int k = min(max(n - at, 0), 4);
    return k == 4 ? w : w & ((1u << (8 * k)) - 1u);
  };
  return make_uint4(keep(v.x, 0), keep(v.y, 4), keep(v.z, 8), keep(v.w, 12));
}

// An unaligned group's chunk into place, by one warp: TMA loaded the stage's a_t and d_t tiles
// (256 rows of 128 bytes, 128-byte swizzled: row r's 16-byte chunk k at chunk k ^ (r % 8))
// from the 16-byte boundary `lead` = 4 Q + s / 8 bytes before the chunk's first row, and
// `side` the 16 bytes after them; every row moves `lead` bytes toward its start, and bytes
// from `valid` on (the group's end) become zeros. Lane l takes rows l, l + 32, ...: the 32
// lanes' 16-byte accesses fall in 8 different chunk columns, as few shared-memory wavefronts as
// 512 bytes take.
template <int Q>
__device__ __forceinline__ void shift_rows(u32 tiles_addr, u32 side_addr, int s, int lane) {
#pragma unroll 1
  for (int j = 0; j < 8; ++j) {
    const int r = lane + 32 * j;
    // Chunk k of the row at row ^ (k << 4): the tiles are 1024-byte aligned, so bits 4-6 of
    // row are the swizzle's r % 8 (one XOR an access, and no table of addresses to keep).
    const u32 row = (tiles_addr + r * 128) | ((r & 7) << 4);
    uint4 cur = ld_shared_v4(row);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 next = k < 7 ? ld_shared_v4(row ^ ((k + 1) << 4)) : ld_shared_v4(side_addr + r * 16);
      st_shared_v4(row ^ (k << 4), bytes_from<Q>(cur, next, s));
      cur = next;
    }
  }
}

// Zeros from byte `valid` (< 128) on of every row of the stage's tiles (as shift_rows lays
// them out): a separate pass, only where a chunk passes its group's end, so that the shift
// keeps no masks in registers.
__device__ __forceinline__ void zero_from(u32 tiles_addr, int valid, int lane) {
#pragma unroll 1
  for (int j = 0; j < 8; ++j) {
    const int r = lane + 32 * j;
    const u32 row = (tiles_addr + r * 128) | ((r & 7) << 4);
    const int k0 = valid >> 4;
    st_shared_v4(row ^ (k0 << 4), first_bytes(ld_shared_v4(row ^ (k0 << 4)), valid & 15));
    for (int k = k0 + 1; k < 8; ++k) st_shared_v4(row ^ (k << 4), make_uint4(0, 0, 0, 0));
  }
}

__device__ __forceinline__ void shift_chunk(const unsigned char* tiles, const unsigned char* side, int lead,
                                            int valid, int lane) {
  const u32 t = smem_addr(tiles), sd = smem_addr(side);
  const int s = 8 * (lead & 3);
  switch (lead >> 2) {
    case 0: shift_rows<0>(t, sd, s, lane); break;
    case 1: shift_rows<1>(t, sd, s, lane); break;
    case 2: shift_rows<2>(t, sd, s, lane); break;
    default: shift_rows<3>(t, sd, s, lane); break;
  }
  if (valid < BLOCK_K) zero_from(t, valid, lane);
}

template <bool CLAIMED>
__device__ __forceinline__ void fp8_grouped_mm_wgrad_body(
    const TensorMap& a_map, const TensorMap& d_map, const TensorMap& a_side_map, const TensorMap& d_side_map,
    const TensorMap& out_map, const float* __restrict__ a_scale, long long a_scale_stride_p, int a_scale_stride_s,
    const float* __restrict__ d_scale, long long d_scale_stride_q, int d_scale_stride_s,
    int out_kind, const int* __restrict__ offs, int M, int P, int Q, int G, int num_stages,
    int scale_per_group, const TensorMap* __restrict__ group_maps, int* __restrict__ order) {
  if (order[0] != (int)CLAIMED) return;
  extern __shared__ __align__(1024) unsigned char wgrad_smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)wgrad_smem_raw + 1023) & ~1023ull);
  const int staging_bytes = staging_boxes(out_kind) * STAGING_BOX_BYTES;
  unsigned char* side = smem + num_stages * STAGE_BYTES;  // [stage][SIDE_BYTES]
  unsigned char* out_stage = side + num_stages * SIDE_BYTES;
  u64* full = (u64*)(out_stage + 2 * staging_bytes);
  u64* empty = full + MAX_STAGES;
  u64* ready = empty + MAX_STAGES;  // a stage's scales (and an unaligned chunk's rows) are in place
  const TileQueue tiles = TileQueue::at(ready + MAX_STAGES);  // CLAIMED only
  // [stage][256]: a_t's 128 rows, d_t's 128
  float* stage_scales = (float*)((unsigned char*)(ready + MAX_STAGES) + TileQueue::BYTES);
  int* scratch = (int*)(stage_scales + num_stages * 256);
  // The groups' rows, and (as tile_end, chunks of 128 rows) the end of their scale slots.
  Schedule groups{scratch + 32, scratch + 32 + G, scratch + 32 + 2 * G};

  const int num_p = (P + BLOCK_M - 1) / BLOCK_M, num_q = (Q + BLOCK_N - 1) / BLOCK_N;
  const int num_tiles = G * num_p * num_q;
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x & 31;
  if (CLAIMED) tiles.init(8 + 3);  // read by the consumers' 8 warps and the 3 helper warps
  init_ring(full, empty, num_stages, 8);
  if (threadIdx.x == 0)
    for (int st = 0; st < num_stages; ++st) mbar_init(&ready[st], 32);  // fenced by the barrier below
  build_schedule(offs, G, M, 1, BLOCK_K, groups, scratch);  // ends with __syncthreads

  auto tile_of = [&](int t, int& g, int& p0, int& q0) {  // tile order: band_tile
    g = band_tile(t, num_p, num_q, WGRAD_BAND_P, p0, q0);
    p0 *= BLOCK_M;
    q0 *= BLOCK_N;
  };

  if (warpgroup == 0) {
    // Warp 0 loads the stages by TMA; warps 1-3 put each 128-row chunk's 256 scales into the
    // stage's slot of stage_scales. Kept off the consumers, whose registers hold three
    // fragments, and off their barriers.
    // 64 registers, not the forward's 40: the helper warps' loop holds more (with 40/232 the
    // kernel spilled 168 bytes, with 64/216 128, and ran 1.02-1.23x faster on the H200;
    // 64 x 128 + 216 x 256 = 63488 of the 64512 registers the launch holds).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 64;");
    const int warp = threadIdx.x / 32;
    if (warp == 0 && lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&d_map) : "memory");
      int stage = 0;
      u32 phase = 0;
      for (int t = blockIdx.x, next, k = 0, acquired = -1; t < num_tiles; t = next) {
        next = CLAIMED ? TileQueue::claim(order + 1) : t + (int)gridDim.x;
        int g, p0, q0;
        tile_of(t, g, p0, q0);
        const int start = groups.row_start[g], end = groups.row_end[g];
        // An unaligned group's windows start `lead` rows before its chunks (the helper warp
        // shifts them into place); their side boxes hold the 16 rows after each window.
        const int lead = start & 15;
        // A group's last window, where it passes the group's end, through the group's maps;
        // every other through the parameter maps, so that groups ending on whole chunks
        // acquire no map.
        auto load_chunk = [&](int m0, const TensorMap* a_src, const TensorMap* d_src) {
          mbar_wait(&empty[stage], phase ^ 1);
          unsigned char* dst = smem + stage * STAGE_BYTES;
          mbar_expect_tx(&full[stage], lead ? STAGE_BYTES + SIDE_BYTES : STAGE_BYTES);
          tma_load_2d(dst, a_src, &full[stage], m0 - lead, p0);
          tma_load_2d(dst + TILE_BYTES, d_src, &full[stage], m0 - lead, q0);
          if (lead) {
            unsigned char* side_dst = side + stage * SIDE_BYTES;
            tma_load_2d(side_dst, &a_side_map, &full[stage], m0 - lead + BLOCK_K, p0);
            tma_load_2d(side_dst + SIDE_BYTES / 2, &d_side_map, &full[stage], m0 - lead + BLOCK_K, q0);
          }
          if (++stage == num_stages) { stage = 0; phase ^= 1; }
          if (CLAIMED && m0 == start) tiles.push(k++, next);  // after the tile's first load
        };
        int m0 = start;
        for (; m0 - lead + BLOCK_K <= end; m0 += BLOCK_K) load_chunk(m0, &a_map, &d_map);
        if (m0 < end) {
          if (g != acquired) {
            map_acquire(group_maps + 2 * g);
            map_acquire(group_maps + 2 * g + 1);
            acquired = g;
          }
          load_chunk(m0, group_maps + 2 * g, group_maps + 2 * g + 1);
        }
        if (CLAIMED && start == end) tiles.push(k++, next);  // (no loads)
      }
    } else if (warp > 0) {
      // Warps 1-3 take chunks in turn: a chunk's scale loads take a global load's latency,
      // which one warp alone would pay once per chunk, slower than the consumers reduce one.
      // The parity waits below need num_stages >= 3: a warp's previous chunk is 3 before, so
      // an empty barrier it waits on is never two phases behind.
      int stage = 0, seq = 0;
      u32 phase = 0;
      for (int t = blockIdx.x, k = 0; t < num_tiles; t = CLAIMED ? tiles.pop(k++, lane) : t + (int)gridDim.x) {
        int g, p0, q0;
        tile_of(t, g, p0, q0);
        const int start = groups.row_start[g], rows = groups.row_end[g] - start, lead = start & 15;
        const int steps = (rows + BLOCK_K - 1) / BLOCK_K;
        const int first_slot = groups.tile_end[g] - steps;
        for (int s = 0; s < steps; ++s, ++seq) {
          if (seq % 3 == warp - 1) {
            // Loaded before the slot is free, so the latency overlaps the wait. Rows past P
            // or Q take the last row's scales (their outputs are not stored).
            const long long slot = scale_per_group ? g : first_slot + s;
            float sa[4], sd[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int p = min(p0 + lane + 32 * i, P - 1), q = min(q0 + lane + 32 * i, Q - 1);
              sa[i] = a_scale[p * a_scale_stride_p + slot * a_scale_stride_s];
              sd[i] = d_scale[q * d_scale_stride_q + slot * d_scale_stride_s];
            }
            mbar_wait(&empty[stage], phase ^ 1);  // the consumers are done with the slot
            float* sc = stage_scales + stage * 256;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              sc[lane + 32 * i] = sa[i];
              sc[128 + lane + 32 * i] = sd[i];
            }
            if (lead) {  // the chunk's rows into place once they have landed, seen by wgmma
              mbar_wait(&full[stage], phase);
              shift_chunk(smem + stage * STAGE_BYTES, side + stage * SIDE_BYTES, lead, rows - s * BLOCK_K, lane);
              fence_async_shared();
            }
            mbar_arrive_if(&ready[stage], true);
          }
          if (++stage == num_stages) { stage = 0; phase ^= 1; }
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
  const int consumer = warpgroup - 1;
  const int tid_wg = threadIdx.x & 127;
  const int warp_in_group = tid_wg / 32;
  const int frag_row = warp_in_group * 16 + lane / 4;  // within the consumer's 64 rows, and + 8
  const int frag_col = (lane % 4) * 2;
  unsigned char* staging = out_stage + consumer * staging_bytes;
  float acc[FRAG], part[FRAG];
  int stage = 0;
  u32 phase = 0;

  // The chunks of group g's tiles, the same in every lane: ptxas then treats the branches on it
  // as uniform (a divergent branch inside a wgmma's flight serializes every wgmma).
  auto group_steps = [&](int g) {
    return __shfl_sync(0xffffffffu, (groups.row_end[g] - groups.row_start[g] + BLOCK_K - 1) / BLOCK_K, 0);
  };
  // Waits for the next stage (landed, scales in place) and issues its four wgmma into
  // `part`, the buffer of partial products; returns the stage.
  auto issue = [&]() {
    mbar_wait(&full[stage], phase);
    mbar_wait(&ready[stage], phase);
    const unsigned char* a_rows = smem + stage * STAGE_BYTES + consumer * (64 * BLOCK_K);
    const unsigned char* d_tile = smem + stage * STAGE_BYTES + TILE_BYTES;
    wgmma_fence();
    wgmma_m64n128k32_first(part, smem_desc(a_rows), smem_desc(d_tile));
#pragma unroll
    for (int k = 1; k < BLOCK_K / 32; ++k)
      wgmma_m64n128k32(part, smem_desc(a_rows + 32 * k), smem_desc(d_tile + 32 * k), 1);
    wgmma_commit();
    const int issued = stage;
    if (++stage == num_stages) { stage = 0; phase ^= 1; }
    return issued;
  };
  // A chunk's scales for this thread: its two rows' of a_t and its columns' of d_t, read by
  // ld.shared (through the generic pointer the compiler emitted generic loads).
  struct ChunkScales {
    float a0, a1;
    float2 d[FRAG / 4];
  };
  auto load_scales = [&](int part_stage) {
    ChunkScales c;
    const u32 base = smem_addr(stage_scales + part_stage * 256);
    c.a0 = ld_shared_f32(base + 4 * (consumer * 64 + frag_row));
    c.a1 = ld_shared_f32(base + 4 * (consumer * 64 + frag_row + 8));
#pragma unroll
    for (int j = 0; j < FRAG / 4; ++j) c.d[j] = ld_shared_f32x2(base + 4 * (128 + 8 * j + frag_col));
    return c;
  };
  // The stage (data and scales) goes back once the chunk's wgmma are done and its scales read;
  // then acc (+)= part * (a scale of the row) * (d scale of the column) (first: =).
  auto promote = [&](int part_stage, const ChunkScales& c, bool first) {
    fence_registers<FRAG>(part);
    __syncwarp();
    mbar_arrive_if(&empty[part_stage], lane == 0);
#pragma unroll
    for (int j = 0; j < FRAG / 4; ++j) {
      const float2 d = c.d[j];
      if (first) {  // a literal at every call: no branch remains
        acc[4 * j + 0] = part[4 * j + 0] * (c.a0 * d.x);
        acc[4 * j + 1] = part[4 * j + 1] * (c.a0 * d.y);
        acc[4 * j + 2] = part[4 * j + 2] * (c.a1 * d.x);
        acc[4 * j + 3] = part[4 * j + 3] * (c.a1 * d.y);
      } else {
        acc[4 * j + 0] = fmaf(part[4 * j + 0], c.a0 * d.x, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], c.a0 * d.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], c.a1 * d.x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], c.a1 * d.y, acc[4 * j + 3]);
      }
    }
  };
  constexpr bool Accumulate = false, Initialize = true;
  // One thread stores the staged tile by TMA, which clips rows past P and columns past Q; the
  // store runs on under the next tile's wgmma.
  auto store_tile = [&](int g, int p0, int q0) {
    if (tid_wg == 0) {
      const int box_cols = out_kind == 2 ? 32 : 64, row0 = p0 + consumer * 64;
      for (int box = 0; box < staging_boxes(out_kind); ++box)
        if (q0 + box * box_cols < Q && row0 < P)
          tma_store_3d(&out_map, staging + box * STAGING_BOX_BYTES, q0 + box * box_cols, row0, g);
      bulk_commit();
    }
  };

  // A tile's epilogue runs under the next tile's first wgmma: the output staged while it is
  // in flight and stored after it, the next tile's place computed meanwhile too; the first
  // chunk's promotion initializes acc.
  // CLAIMED: the next tile is popped once this tile's first stage is in hand (the producer has
  // issued that load, and passes the next tile on right after it).
  int t = blockIdx.x, g = 0, p0 = 0, q0 = 0, k = 0;
  if (t < num_tiles) tile_of(t, g, p0, q0);
  int steps = group_steps(g);
  int done_g = -1, done_p0 = 0, done_q0 = 0;  // the tile whose output acc holds, unstored
#pragma unroll
  for (int i = 0; i < FRAG; ++i) acc[i] = 0.f;
  for (int next; t < num_tiles; t = next) {
    int next_g, next_p0, next_q0;
    if (steps > 0) {
      const int issued = issue();
      stage_output<false>(staging, acc, out_kind, consumer, frag_row, frag_col);
      next = CLAIMED ? tiles.pop(k++, lane) : t + (int)gridDim.x;
      tile_of(min(next, num_tiles - 1), next_g, next_p0, next_q0);
      wgmma_wait<0>();
      if (done_g >= 0) store_tile(done_g, done_p0, done_q0);
      promote(issued, load_scales(issued), Initialize);
      for (int s = 1; s < steps; ++s) {
        const int issued_s = issue();
        wgmma_wait<0>();
        promote(issued_s, load_scales(issued_s), Accumulate);
      }
    } else {  // an empty group: its tile is zeros
      stage_output<false>(staging, acc, out_kind, consumer, frag_row, frag_col);
      next = CLAIMED ? tiles.pop(k++, lane) : t + (int)gridDim.x;
      tile_of(min(next, num_tiles - 1), next_g, next_p0, next_q0);
      if (done_g >= 0) store_tile(done_g, done_p0, done_q0);
#pragma unroll
      for (int i = 0; i < FRAG; ++i) acc[i] = 0.f;
    }
    done_g = g, done_p0 = p0, done_q0 = q0;
    g = next_g, p0 = next_p0, q0 = next_q0;
    steps = group_steps(g);
  }
  if (done_g >= 0) {
    stage_output<false>(staging, acc, out_kind, consumer, frag_row, frag_col);
    store_tile(done_g, done_p0, done_q0);
  }
  if (tid_wg == 0) bulk_wait();
}

#define FP8_WGRAD_KERNEL(NAME, CLAIMED)                                                                       \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                              \
      const __grid_constant__ TensorMap a_map,   /* a_t (P, M) e4m3: dims {M, P}, box {128, 128} */           \
      const __grid_constant__ TensorMap d_map,   /* d_t (Q, M) e4m3: dims {M, Q}, box {128, 128} */           \
      const __grid_constant__ TensorMap a_side_map, /* a_t: box {16, 128}, unswizzled */                      \
      const __grid_constant__ TensorMap d_side_map, /* d_t: box {16, 128}, unswizzled */                      \
      const __grid_constant__ TensorMap out_map, /* out (G, P, Q): dims {Q, P, G}, box {128 B, 64, 1} */      \
      const float* __restrict__ a_scale, long long a_scale_stride_p, int a_scale_stride_s,                    \
      const float* __restrict__ d_scale, long long d_scale_stride_q, int d_scale_stride_s,                    \
      int out_kind, const int* __restrict__ offs, int M, int P, int Q, int G, int num_stages,                 \
      int scale_per_group,                                                                                    \
      const TensorMap* __restrict__ group_maps, /* wgrad_tile_order's: a_map, d_map a group (G x 2) */         \
      int* __restrict__ order /* wgrad_tile_order's (csrc/grouped_mm.cu) */) {                                \
    fp8_grouped_mm_wgrad_body<CLAIMED>(a_map, d_map, a_side_map, d_side_map, out_map, a_scale,                \
                                       a_scale_stride_p, a_scale_stride_s, d_scale, d_scale_stride_q,         \
                                       d_scale_stride_s, out_kind, offs, M, P, Q, G, num_stages,              \
                                       scale_per_group, group_maps, order);                                   \
  }

FP8_WGRAD_KERNEL(fp8_grouped_mm_wgrad, false)
FP8_WGRAD_KERNEL(fp8_grouped_mm_wgrad_claimed, true)
