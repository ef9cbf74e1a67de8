// FP8 grouped GEMM with 1x128 x 128x128 block scales (the DeepSeek-V3 recipe) for Hopper, sm_90a.
//
//   out[r, :] = sum over 128-deep k blocks kb of (a[r, kb] . b[g, :, kb]) * a_scale[r, kb] * b_scale[g, n/128, kb]
//
// for the rows r of group g (offs: cumulative group ends); rows past the last group get 0.
// a (M, K) and b (G, N, K) are e4m3 and K-major (the layout Hopper's FP8 tensor cores read),
// out (M, N) bf16, fp16 or fp32 (out_kind 0, 1, 2). compiled_moe/reference.py: scaled_grouped_mm is the oracle.
//
// Why CUDA and not Triton: every 128-deep step's product has to leave the tensor cores and be
// scaled in fp32 before it is added. Triton 3.6 waits for each step's wgmma to finish before it
// issues the next (one `wgmma.wait_group 0` per step in its PTX), so its kernel ran at 600-720
// TFLOP/s. Here a producer warp keeps a ring of TMA loads in flight, and each of two consumer
// warpgroups (64 rows each) keeps two buffers of partial products: step k + 1's wgmma runs
// while step k's is scaled and added (1.20-1.53x the Triton kernel on the H200, RESULTS.md).
//
// Block: 384 threads. Warpgroup 0 is the producer (one thread issues TMA), warpgroups 1 and 2
// compute a 128 x 128 output tile. Persistent: one block per SM walks the tiles of all groups;
// the tile list is derived in each block from offs (no host loop, no host sync). A tile's 128
// rows start at a row of its group; rows of the next group that the last tile loads are
// computed and not stored.

#include "sm90.cuh"

// 128 x 128 output tiles, 128-deep k steps: one scale of a per row and one of b per step.
constexpr int BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128;
constexpr int TILE_BYTES = BLOCK_M * BLOCK_K;  // one e4m3 operand tile, 16 KB
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int FRAG = BLOCK_N / 2;  // fp32 accumulators per consumer thread
constexpr int MAX_STAGES = 8;
constexpr int THREADS = 384;

// d (64 x 128 fp32, this warpgroup's fragment) = (accumulate ? d : 0) + a (64 x 32) . b (128 x 32)^T
__device__ __forceinline__ void wgmma_m64n128k32(float* d, u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The scales of one k step for a consumer thread's two rows (r0, r0 + 8): a's times b's.
struct StepScales {
  float s0, s1;
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) fp8_blockwise_grouped_mm(
    const __grid_constant__ TensorMap a_map,  // a (M, K) e4m3: dims {K, M}, box {128, 128}
    const __grid_constant__ TensorMap b_map,  // b (G, N, K) e4m3: dims {K, N, G}, box {128, 128, 1}
    const float* __restrict__ a_scale, long long a_scale_stride_m, int a_scale_stride_k,
    const float* __restrict__ b_scale, long long b_scale_stride_g, int b_scale_stride_n, int b_scale_stride_k,
    void* __restrict__ out, int out_kind, long long out_stride_m,  // (M, N), unit column stride
    const int* __restrict__ offs, int M, int N, int K, int G, int num_stages) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 1024-byte alignment of every tile: the 128-byte swizzle pattern repeats every 1024 bytes.
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  u64* full = (u64*)(smem + num_stages * STAGE_BYTES);
  u64* empty = full + MAX_STAGES;
  int* scratch = (int*)(empty + MAX_STAGES);
  Schedule sched{scratch + 32, scratch + 32 + G, scratch + 32 + 2 * G};

  const int num_n = (N + BLOCK_N - 1) / BLOCK_N;
  const int num_kb = (K + BLOCK_K - 1) / BLOCK_K;
  const int warpgroup = threadIdx.x / 128;
  init_ring(full, empty, num_stages, 8);
  build_schedule(offs, G, M, num_n, BLOCK_M, sched, scratch);  // ends with __syncthreads
  const int num_tiles = sched.tile_end[G - 1];

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&a_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&b_map) : "memory");
      int stage = 0;
      u32 phase = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const Tile tile = locate(t, sched, G, BLOCK_M, BLOCK_N);
        for (int kb = 0; kb < num_kb; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          unsigned char* dst = smem + stage * STAGE_BYTES;
          mbar_expect_tx(&full[stage], STAGE_BYTES);
          tma_load_2d(dst, &a_map, &full[stage], kb * BLOCK_K, tile.row0);
          tma_load_3d(dst + TILE_BYTES, &b_map, &full[stage], kb * BLOCK_K, tile.col0, tile.group);
          if (++stage == num_stages) { stage = 0; phase ^= 1; }
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;  // rows consumer*64 .. +64 of the tile
  const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
  const int frag_row = consumer * 64 + warp_in_group * 16 + lane / 4;  // and frag_row + 8
  const int frag_col = (lane % 4) * 2;                                  // + 8 j, and + 1
  // Two adjacent outputs in one store when every row starts at an even element.
  const bool paired = (out_stride_m % 2) == 0;
  // Two buffers of partial products: the wgmma of step kb + 1 runs on the tensor cores while
  // this thread scales and adds step kb's. With one buffer (wait for every step's wgmma, then
  // scale) the kernel ran at 980 TFLOP/s at most on the DeepSeek-V3 fc1 shape even with no
  // loads at all, and 830 with them.
  float acc[FRAG], part_a[FRAG], part_b[FRAG];
  int stage = 0;
  u32 phase = 0;

  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = locate(t, sched, G, BLOCK_M, BLOCK_N);
    const int r0 = tile.row0 + frag_row, r1 = r0 + 8;
    const float* sa0 = a_scale + (long long)min(r0, M - 1) * a_scale_stride_m;
    const float* sa1 = a_scale + (long long)min(r1, M - 1) * a_scale_stride_m;
    const float* sb = b_scale + tile.group * b_scale_stride_g + (long long)(tile.col0 / BLOCK_N) * b_scale_stride_n;
    auto scales = [&](int kb) {
      const float b = sb[kb * b_scale_stride_k];
      return StepScales{sa0[kb * a_scale_stride_k] * b, sa1[kb * a_scale_stride_k] * b};
    };
    // Waits for the next stage and issues its four wgmma into `part`; returns the stage.
    auto issue = [&](float* part) {
      mbar_wait(&full[stage], phase);
      const unsigned char* a_tile = smem + stage * STAGE_BYTES + consumer * (64 * BLOCK_K);
      const unsigned char* b_tile = smem + stage * STAGE_BYTES + TILE_BYTES;
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BLOCK_K / 32; ++k)
        wgmma_m64n128k32(part, smem_desc(a_tile + 32 * k), smem_desc(b_tile + 32 * k), k > 0);
      wgmma_commit();
      const int issued = stage;
      if (++stage == num_stages) { stage = 0; phase ^= 1; }
      return issued;
    };
    // The DeepSeek-V3 promotion: each 128-deep product is scaled and added in fp32, then its
    // stage goes back to the producer.
    auto promote = [&](const float* part, int part_stage, StepScales sc) {
      fence_registers<FRAG>(const_cast<float*>(part));
      mbar_arrive_if(&empty[part_stage], lane == 0);
#pragma unroll
      for (int j = 0; j < FRAG / 4; ++j) {
        acc[4 * j + 0] = fmaf(part[4 * j + 0], sc.s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], sc.s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], sc.s1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], sc.s1, acc[4 * j + 3]);
      }
    };

#pragma unroll
    for (int i = 0; i < FRAG; ++i) acc[i] = 0.f;
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

    // Fragment: acc[4j + 0..1] are (r0, c .. c+1), acc[4j + 2..3] are (r1, ...), c = col0 + 8j + frag_col.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? r1 : r0;
      if (r >= tile.row_end) continue;
#pragma unroll
      for (int j = 0; j < FRAG / 4; ++j)
        store_pair(out, out_kind, (long long)r * out_stride_m, tile.col0 + 8 * j + frag_col, N,
                   paired, acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
    }
  }

  // Rows past the last group are defined as 0.
  const int rows_end = sched.row_end[G - 1];
  const long long tail = (long long)(M - rows_end) * N;
  for (long long i = (long long)blockIdx.x * 256 + (threadIdx.x - 128); i < tail; i += (long long)gridDim.x * 256) {
    const long long r = rows_end + i / N, c = i % N;
    store_one(out, out_kind, r * out_stride_m + c, 0.f);
  }
}
