// Grouped FP8 quantization with columnwise output: the fp8_blockwise blocks the weight gradient
// reads, and the rowwise ones of the same rows, x read once.
//
// What it computes is compiled_moe/reference.py's grouped_quantize for 2-D x (M, K) with
// recipe fp8_blockwise and columnwise=True, bit for bit:
//   col_q (K, M) e4m3, row stride ldcq; col_s (K, S) fp32 with S = ceil(M / 128) + G slots:
//   128-row block j of group g has slot sum_{h<g} ceil(m_h / 128) + j (the rows past offs[G-1]
//   are group G), unused slots hold the scale of a zero block (1);
//   with ROWWISE also row_q (M, K) e4m3 and row_s (M, ceil(K / 128)) fp32, 1 x 128 blocks.
//
// Persistent blocks of 256 threads walk (slot, column tile) items. A tile is 128 x 128 elements
// (32 KB of bf16): thread t holds 8 consecutive rows x 8 consecutive columns (chunk c = t % 16,
// row group rg = t / 16), copied by itself into shared memory with 16-byte cp.async one item
// ahead, so a warp reads whole 256-byte row segments and the next item's loads run under this
// item's work. Row blocks are reduced by shuffles across the 16 lanes of a row; column blocks by
// a per-thread max over its 8 rows, then across row groups in shared memory. Each column's 8
// quantized bytes (rows of one row group) go to a transposing buffer in shared memory and leave
// as 16-byte stores along M.
//
// The slots' first rows come from offs on the device (clamped to [0, M], made monotonic): a
// table in shared memory, made once per block by two block-wide scans. No host sync.
//
// Arithmetic as kernels/quantize.py, so the output equals the reference's bits: amax with NaN
// kept (then counted as Inf), scale = amax / 448 rounded once (1 for a zero block), the
// quotient x / scale rounded once (by Markstein's fma steps for 2^-90 <= scale < Inf, a division
// otherwise), the hardware fp32 -> e4m3 conversion with saturation (NaN -> 0x7F).
//
// The same structure for mxfp8 (32 x 512 tiles, E8M0 scales) measured 0.37-0.53 of copy
// bandwidth on the H200 against 0.37-0.43 for the Triton kernel it would replace, so mxfp8
// stays on Triton (benchmarks/RESULTS.md); the tile shape is kept as parameters (ROWS).

#include "block.cuh"

#define THREADS 256
#define MIN_BLOCKS 2  // blocks per SM the registers must allow

typedef unsigned int u32;
typedef unsigned long long u64;

enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2 };

// --------------------------------------------------------------------------- the slot's rows

__device__ __forceinline__ int group_end(const int* offs, int g, int G, int M) {
  return g < G ? min(max(offs[g], 0), M) : M;
}

// The first row of every columnwise slot (blocks of ROWS rows inside groups 0..G, group G being
// the rows past the last group) into slot_row[0..used], slot_row[used] = M; returns the number
// of used slots. Slots tile [0, M) in order, so slot s holds rows [slot_row[s], slot_row[s + 1]).
// Thread t owns groups [t * P, t * P + P); ends are clamped to [0, M] and made monotonic.
template <int ROWS>
__device__ int fill_slot_rows(const int* __restrict__ offs, int M, int G, int* scratch,
                              int* slot_row) {
  const int n = G + 1, per = (n + blockDim.x - 1) / blockDim.x, g0 = threadIdx.x * per;
  const int g1 = min(g0 + per, n);
  int local_max = 0;
  for (int g = g0; g < g1; ++g) local_max = max(local_max, group_end(offs, g, G, M));
  int unused;
  const int start0 = block_exclusive_scan<true>(local_max, scratch, &unused);
  int blocks = 0, start = start0;
  for (int g = g0; g < g1; ++g) {
    const int end = max(start, group_end(offs, g, G, M));
    blocks += (end - start + ROWS - 1) / ROWS;
    start = end;
  }
  int used;
  int first = block_exclusive_scan<false>(blocks, scratch, &used);
  start = start0;
  for (int g = g0; g < g1; ++g) {
    const int end = max(start, group_end(offs, g, G, M));
    for (int r = start; r < end; r += ROWS) slot_row[first++] = r;
    start = end;
  }
  if (threadIdx.x == 0) slot_row[used] = M;
  __syncthreads();
  return used;
}

// --------------------------------------------------------------------------- the arithmetic

__device__ __forceinline__ float max_keep_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ float nan_as_inf(float amax) {
  return amax == amax ? amax : __int_as_float(0x7f800000);
}

// The quantization of one block by its fp32 scale. (The kernel takes the scale as a type, so that
// an E8M0 scale (mxfp8) would be another such type.)
struct ScaleF32 {
  float s, y, neg_y;  // the scale, its correctly rounded reciprocal, and -y
  bool regular;       // 2^-90 <= s < Inf: Markstein's steps are exact (kernels/quantize.py)
  __device__ __forceinline__ static ScaleF32 from_amax(float amax) {
    ScaleF32 q;
    q.s = amax == 0.0f ? 1.0f : __fdiv_rn(amax, 448.0f);
    q.regular = q.s >= 8.077935669463161e-28f && q.s < __int_as_float(0x7f800000);  // 2^-90
    q.y = __frcp_rn(q.s);
    q.neg_y = -q.y;
    return q;
  }
  // x / s rounded once. EXACT: by division, for any scale; else Markstein's steps, which need
  // a regular scale (callers pick per block run, so that the branch is not per element).
  template <bool EXACT>
  __device__ __forceinline__ float apply(float x) const {
    if (EXACT) return __fdiv_rn(x, s);
    float q = x * y;
    q = fmaf(fmaf(q, s, -x), neg_y, q);  // the remainder is never negated (keeps -0)
    return fmaf(fmaf(q, s, -x), neg_y, q);
  }
  __device__ __forceinline__ void store(void* scales, long long i) const {
    static_cast<float*>(scales)[i] = s;
  }
  // What the quantization needs, through shared memory: (s, y).
  __device__ __forceinline__ float2 parts() const { return make_float2(s, y); }
  __device__ __forceinline__ static ScaleF32 from_parts(float s, float y) {
    ScaleF32 q;
    q.s = s;
    q.y = y;
    q.neg_y = -y;
    q.regular = s >= 8.077935669463161e-28f && s < __int_as_float(0x7f800000);
    return q;
  }
};

// Four fp32 values -> four e4m3 bytes, the first in the lowest byte.
__device__ __forceinline__ u32 pack_e4m3(float a, float b, float c, float d) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return (u32)lo | ((u32)hi << 16);
}

// Eight input values of a row, held as loaded: 4 words of 16-bit values or 8 of fp32.
template <int DT>
struct Row8 {
  static constexpr int WORDS = DT == DT_F32 ? 8 : 4;
  u32 w[WORDS];
  __device__ __forceinline__ float operator[](int j) const {
    if (DT == DT_F32) return __int_as_float(w[j]);
    const u32 word = w[j >> 1];
    if (DT == DT_BF16) return __int_as_float((j & 1) ? (word & 0xFFFF0000u) : (word << 16));
    float f;
    const unsigned short h = (unsigned short)((j & 1) ? (word >> 16) : word);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  // max(|a|, |b|) of each 16-bit half, NaN kept (the sign of the result is not |.|'s: callers
  // take fabsf of each half). One instruction for two values.
  __device__ __forceinline__ static u32 abs_max2(u32 a, u32 b) {
    u32 d;
    if (DT == DT_BF16)
      asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    else
      asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static float half_amax(u32 word) {  // max(|lo|, |hi|), NaN kept
    Row8 r;
    r.w[0] = word;
    return max_keep_nan(fabsf(r[0]), fabsf(r[1]));
  }
  // max |x| of the 8 values (NaN kept). 16-bit values pairwise: the amax of bf16 or fp16
  // values is one of them, so the packed max gives the fp32 one exactly.
  __device__ __forceinline__ float amax() const {
    if (DT == DT_F32) {
      float m = fabsf((*this)[0]);
#pragma unroll
      for (int j = 1; j < 8; ++j) m = max_keep_nan(m, fabsf((*this)[j]));
      return m;
    }
    return half_amax(abs_max2(abs_max2(w[0], w[1]), abs_max2(w[2], w[3])));
  }
  // part[j] = max over the 8 rows of |v[i][j]| (NaN kept).
  __device__ __forceinline__ static void column_amax(const Row8* v, float* part) {
#pragma unroll
    for (int k = 0; k < WORDS; ++k) {
      if (DT == DT_F32) {
        float m = fabsf(__int_as_float(v[0].w[k]));
#pragma unroll
        for (int i = 1; i < 8; ++i) m = max_keep_nan(m, fabsf(__int_as_float(v[i].w[k])));
        part[k] = m;
      } else {
        u32 m = abs_max2(v[0].w[k], v[1].w[k]);
#pragma unroll
        for (int i = 2; i < 8; ++i) m = abs_max2(m, v[i].w[k]);
        Row8 r;
        r.w[0] = m;
        part[2 * k] = fabsf(r[0]);
        part[2 * k + 1] = fabsf(r[1]);
      }
    }
  }
  // From shared memory; rows or columns outside the tile's block read as 0.
  __device__ __forceinline__ void load_shared(const unsigned char* p, bool ok) {
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < WORDS / 4; ++i) {
      uint4 u = ok ? v[i] : make_uint4(0, 0, 0, 0);
      w[4 * i] = u.x; w[4 * i + 1] = u.y; w[4 * i + 2] = u.z; w[4 * i + 3] = u.w;
    }
  }
};

template <bool EXACT, typename Scale, typename Row>
__device__ __forceinline__ uint2 quantize_row(const Scale& q, const Row& v) {
  uint2 bytes;
  bytes.x = pack_e4m3(q.template apply<EXACT>(v[0]), q.template apply<EXACT>(v[1]),
                      q.template apply<EXACT>(v[2]), q.template apply<EXACT>(v[3]));
  bytes.y = pack_e4m3(q.template apply<EXACT>(v[4]), q.template apply<EXACT>(v[5]),
                      q.template apply<EXACT>(v[6]), q.template apply<EXACT>(v[7]));
  return bytes;
}

// max |x| (NaN kept) of a row block: 8 values in each of LANES neighbouring lanes.
template <int LANES, typename Row>
__device__ __forceinline__ float row_amax(const Row& v) {
  float amax = v.amax();
#pragma unroll
  for (int d = 1; d < LANES; d <<= 1)
    amax = max_keep_nan(amax, __shfl_xor_sync(FULL_MASK, amax, d));
  return amax;
}

// A thread's 8 values of row r, quantized, into row_q (rows past the slot's end skipped).
template <typename Scale, typename Row>
__device__ __forceinline__ void store_row(const Scale& q, const Row& v, unsigned char* row_q,
                                          long long ldrq, int r, int row_end, int col, bool col_ok) {
  if (!col_ok || r >= row_end) return;
  const uint2 bytes = q.regular ? quantize_row<false>(q, v) : quantize_row<true>(q, v);
  *reinterpret_cast<uint2*>(row_q + (long long)r * ldrq + col) = bytes;
}

// The column blocks' bytes of a thread's 8 x 8 values into the transposing buffer. Column j's
// 8 bytes (rows of row group rg) form 8-byte unit u = column * GROUPS + rg, placed in 128-byte
// line u / 16 at position (u % 16) ^ (c % 16): the 32 lanes of a warp (16 chunks c, two row
// groups) then write distinct banks but for pairs, the fewest for 256 bytes.
template <bool EXACT, int GROUPS, typename Scale, typename Row>
__device__ __forceinline__ void transpose_columns(unsigned char* transposed, const Row* v,
                                                  const float* s, const float* y, int c, int rg) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const Scale q = Scale::from_parts(s[j], y[j]);
    uint2 bytes;
    bytes.x = pack_e4m3(q.template apply<EXACT>(v[0][j]), q.template apply<EXACT>(v[1][j]),
                        q.template apply<EXACT>(v[2][j]), q.template apply<EXACT>(v[3][j]));
    bytes.y = pack_e4m3(q.template apply<EXACT>(v[4][j]), q.template apply<EXACT>(v[5][j]),
                        q.template apply<EXACT>(v[6][j]), q.template apply<EXACT>(v[7][j]));
    const int u = (8 * c + j) * GROUPS + rg;
    reinterpret_cast<uint2*>(transposed)[(u & ~15) | ((u & 15) ^ (c & 15))] = bytes;
  }
}

// --------------------------------------------------------------------------- the kernel

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Shared memory of a block, in bytes (the launcher sizes the dynamic allocation with it).
template <int DT, int ROWS>
struct Layout {
  static constexpr int CHUNKS = 16 * 128 / ROWS;  // 8-column chunks across a tile
  static constexpr int COLS = 8 * CHUNKS;
  static constexpr int GROUPS = ROWS / 8;         // row groups of 8 rows
  static constexpr int ESIZE = DT == DT_F32 ? 4 : 2;
  static constexpr int TILE = ROWS * COLS * ESIZE;          // one stage of x
  static constexpr int TRANSPOSED = 2 * TILE;               // COLS x ROWS e4m3
  static constexpr int PARTIAL = TRANSPOSED + COLS * ROWS;  // GROUPS x COLS fp32
  static constexpr int PARTS = PARTIAL + GROUPS * COLS * 4; // 2 x COLS fp32
  static constexpr int SCRATCH = PARTS + 2 * COLS * 4;      // 32 ints
  static constexpr int SLOTS = SCRATCH + 32 * 4;            // (slots + 1) ints
};

// Persistent: block b takes items b, b + B, b + 2B, ... of the used slots x column tiles
// items, ordered in bands of slot_group slots: within a band, slot fastest, then column tile.
// The blocks running together then cover a few neighbouring slots across many column tiles:
// they read long runs of each row of x, and the 16-byte pieces they store along M fill the same
// sectors (the column scales of neighbouring slots the same lines) while those are in L2. Each
// thread copies its own next 8 x 8 sub-tile into the other stage (cp.async) before it
// works on the current one, and reads back only what it copied: no block barrier guards the
// stages, and the next item's loads run under this item's arithmetic and stores.
template <int DT, int ROWS, int ROW_BLOCK, typename Scale, bool ROWWISE>
__device__ void quantize_group_columns(
    const void* __restrict__ x_, long long ldx, const int* __restrict__ offs, int M, int K, int G,
    int S, int slot_group, unsigned char* __restrict__ col_q, long long ldcq,
    void* __restrict__ col_s, long long lds, unsigned char* __restrict__ row_q, long long ldrq,
    void* __restrict__ row_s, long long ldrs) {
  using L = Layout<DT, ROWS>;
  constexpr int CHUNKS = L::CHUNKS, COLS = L::COLS, GROUPS = L::GROUPS, ESIZE = L::ESIZE;
  constexpr int ROW_LANES = ROW_BLOCK / 8;  // lanes sharing a row block
  static_assert(ROW_LANES >= 8, "a row block spans at least 8 lanes (their scales are shared)");
  constexpr int PIECES = COLS * ROWS / 16 / THREADS;  // 16-byte pieces of the transposed tile
  constexpr int COPIES = 8 * ESIZE / 16;    // 16-byte copies per row of a sub-tile
  static_assert(GROUPS * CHUNKS == THREADS, "one thread per 8 x 8 sub-tile");

  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* transposed = smem + L::TRANSPOSED;
  float(*partial)[COLS] = reinterpret_cast<float(*)[COLS]>(smem + L::PARTIAL);
  float(*scale_parts)[COLS] = reinterpret_cast<float(*)[COLS]>(smem + L::PARTS);
  int* slot_row = reinterpret_cast<int*>(smem + L::SLOTS);
  const int used = fill_slot_rows<ROWS>(offs, M, G, reinterpret_cast<int*>(smem + L::SCRATCH),
                                        slot_row);

  const int num_tiles = (K + COLS - 1) / COLS;
  // Items cover the used slots only: the unused ones (past `used`) just get a zero block's scale
  // in every column, shared out evenly below, so that no block's items are mostly empty.
  const long long items = (long long)used * num_tiles;
  {
    const Scale zero = Scale::from_amax(0.0f);
    const long long unused = (long long)(S - used) * K;
    for (long long e = (long long)blockIdx.x * THREADS + threadIdx.x; e < unused;
         e += (long long)gridDim.x * THREADS)
      zero.store(col_s, (e % K) * lds + used + e / K);
  }
  // item w -> (slot, column tile): bands of slot_group slots (the last band may be narrower)
  auto item_slot_tile = [&](long long w, int* slot, int* tile) {
    const long long band = w / ((long long)slot_group * num_tiles);
    const int first = (int)band * slot_group, width = min(slot_group, used - first);
    const int within = (int)(w - band * slot_group * num_tiles);
    *slot = first + within % width;
    *tile = within / width;
  };
  const int t = threadIdx.x, c = t % CHUNKS, rg = t / CHUNKS;
  const char* x = static_cast<const char*>(x_);
  // This thread's sub-tile in stage `buf`: row rg * 8 + i, columns 8c .. 8c + 7.
  auto sub_tile = [&](int buf, int i) {
    return smem + buf * L::TILE + (rg * 8 + i) * (COLS * ESIZE) + c * 8 * ESIZE;
  };
  auto prefetch = [&](long long w, int buf) {
    int slot, tile;
    item_slot_tile(w, &slot, &tile);
    const int col = tile * COLS + 8 * c, row0 = slot_row[slot];
    const int rows = slot_row[slot + 1] - row0 - rg * 8;
    if (col >= K) return;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < rows)
#pragma unroll
        for (int k = 0; k < COPIES; ++k)
          cp_async_16(sub_tile(buf, i) + 16 * k,
                      x + ((long long)(row0 + rg * 8 + i) * ldx + col) * ESIZE + 16 * k);
  };

  if (blockIdx.x < items) prefetch(blockIdx.x, 0);
  cp_async_commit();
  int buf = 0;
  for (long long w = blockIdx.x; w < items; w += gridDim.x, buf ^= 1) {
    if (w + gridDim.x < items) prefetch(w + gridDim.x, buf ^ 1);
    cp_async_commit();
    int slot, tile;
    item_slot_tile(w, &slot, &tile);
    const int col0 = tile * COLS, col = col0 + 8 * c;
    const int row0 = slot_row[slot], row_end = slot_row[slot + 1];
    const bool col_ok = col < K;
    cp_async_wait<1>();  // this thread's copies of item w have landed
    Row8<DT> v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i].load_shared(sub_tile(buf, i), col_ok && row0 + rg * 8 + i < row_end);

    if (ROWWISE) {  // 1 x ROW_BLOCK blocks: 8 values here, the rest in ROW_LANES - 1 lanes
      // Lane i of a row block derives row i's scale (a division and a reciprocal) and the
      // others take it by shuffles: 8 times less of that arithmetic.
      const int lane_in_block = c % ROW_LANES;
      float a = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float amax = row_amax<ROW_LANES>(v[i]);
        a = lane_in_block == i ? amax : a;
      }
      const Scale mine = Scale::from_amax(nan_as_inf(a));
      const int r_mine = row0 + rg * 8 + lane_in_block;
      // (the row block is inside K when its first chunk is: lane 0's column)
      if (lane_in_block < 8 && col - 8 * lane_in_block < K && r_mine < row_end)
        mine.store(row_s, (long long)r_mine * ldrs + col / ROW_BLOCK);
      const float2 parts = mine.parts();
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int src = (threadIdx.x & 31 & ~(ROW_LANES - 1)) + i;
        const Scale q = Scale::from_parts(__shfl_sync(FULL_MASK, parts.x, src),
                                          __shfl_sync(FULL_MASK, parts.y, src));
        store_row(q, v[i], row_q, ldrq, row0 + rg * 8 + i, row_end, col, col_ok);
      }
    }

    // Column blocks: this thread's 8 rows, then every row group's in shared memory.
    float part[8];
    Row8<DT>::column_amax(v, part);
    float4* my_partial = reinterpret_cast<float4*>(&partial[rg][8 * c]);
    my_partial[0] = make_float4(part[0], part[1], part[2], part[3]);
    my_partial[1] = make_float4(part[4], part[5], part[6], part[7]);
    __syncthreads();
    for (int k = t; k < COLS; k += THREADS) {
      float amax = partial[0][k];
#pragma unroll
      for (int g = 1; g < GROUPS; ++g) amax = max_keep_nan(amax, partial[g][k]);
      const Scale q = Scale::from_amax(nan_as_inf(amax));
      const float2 parts = q.parts();
      scale_parts[0][k] = parts.x;
      scale_parts[1][k] = parts.y;
      if (col0 + k < K) q.store(col_s, (col0 + k) * lds + slot);
    }
    __syncthreads();

    // Each column's 8 bytes (this row group's rows) into the transposing buffer.
    float s[8], y[8];
    reinterpret_cast<float4*>(s)[0] = reinterpret_cast<const float4*>(&scale_parts[0][8 * c])[0];
    reinterpret_cast<float4*>(s)[1] = reinterpret_cast<const float4*>(&scale_parts[0][8 * c])[1];
    reinterpret_cast<float4*>(y)[0] = reinterpret_cast<const float4*>(&scale_parts[1][8 * c])[0];
    reinterpret_cast<float4*>(y)[1] = reinterpret_cast<const float4*>(&scale_parts[1][8 * c])[1];
    bool regular = true;
#pragma unroll
    for (int j = 0; j < 8; ++j) regular &= Scale::from_parts(s[j], y[j]).regular;
    // (sub-tiles wholly past the slot's rows or past K are not stored: skip their arithmetic)
    if (!col_ok || row0 + rg * 8 >= row_end)
      ;
    else if (regular)
      transpose_columns<false, GROUPS, Scale>(transposed, v, s, y, c, rg);
    else
      transpose_columns<true, GROUPS, Scale>(transposed, v, s, y, c, rg);
    __syncthreads();

    // 16-byte pieces along M: piece p is rows 16 * (p % (ROWS / 16)) of column p / (ROWS / 16).
    const bool aligned = (row0 & 15) == 0;
#pragma unroll
    for (int it = 0; it < PIECES; ++it) {
      const int p = it * THREADS + t;
      const int k = p / (ROWS / 16), piece_row = 16 * (p % (ROWS / 16));
      const int u = k * GROUPS + 2 * (p % (ROWS / 16));  // its first 8-byte unit (even)
      const int key = (k / 8) & 15;
      uint4 b = reinterpret_cast<const uint4*>(transposed)[((u & ~15) | ((u & 15) ^ key)) >> 1];
      if (key & 1) b = make_uint4(b.z, b.w, b.x, b.y);  // the two units swapped places
      const int r = row0 + piece_row, valid = min(16, row_end - r);
      if (col0 + k >= K || valid <= 0) continue;
      unsigned char* dst = col_q + (long long)(col0 + k) * ldcq + r;
      if (aligned && valid == 16) {
        *reinterpret_cast<uint4*>(dst) = b;
      } else {  // a group's last rows, or a group starting off a 16-byte boundary
        const u32 words[4] = {b.x, b.y, b.z, b.w};
#pragma unroll 1
        for (int i = 0; i < valid; ++i) dst[i] = (unsigned char)(words[i >> 2] >> (8 * (i & 3)));
      }
    }
    // No barrier here: the next item writes the partials after this item's third barrier
    // (their reads precede the second), the scales after its own first barrier and the
    // transposing buffer after its own second (their reads here precede the next item's first).
  }
  cp_async_wait<0>();
}

#define QUANTIZE_KERNEL(NAME, DT, ROWS, ROW_BLOCK, SCALE, ROWWISE)                            \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) NAME(                    \
      const void* x, long long ldx, const int* offs, int M, int K, int G, int S,             \
      int slot_group, unsigned char* col_q, long long ldcq, void* col_s, long long lds,      \
      unsigned char* row_q, long long ldrq, void* row_s, long long ldrs) {                   \
    quantize_group_columns<DT, ROWS, ROW_BLOCK, SCALE, ROWWISE>(                             \
        x, ldx, offs, M, K, G, S, slot_group, col_q, ldcq, col_s, lds, row_q, ldrq, row_s,   \
        ldrs);                                                                               \
  }

#define QUANTIZE_KERNELS(SUFFIX, DT)                                                       \
  QUANTIZE_KERNEL(quantize_columns_fp8_blockwise_##SUFFIX, DT, 128, 128, ScaleF32, false)  \
  QUANTIZE_KERNEL(quantize_rows_columns_fp8_blockwise_##SUFFIX, DT, 128, 128, ScaleF32, true)

QUANTIZE_KERNELS(bf16, DT_BF16)
QUANTIZE_KERNELS(f16, DT_F16)
QUANTIZE_KERNELS(f32, DT_F32)
