// Grouped FP8 quantization with columnwise output: the fp8_blockwise blocks the weight gradient
// reads, and the rowwise ones of the same rows, x read once.
//
// What it computes is compiled_moe/reference.py's grouped_quantize for 2-D x (M, K) with
// recipe fp8_blockwise and columnwise=True, bit for bit:
//   col_q (K, M) e4m3, row stride ldcq; col_s (K, S) fp32 with S = ceil(M / 128) + G slots:
//   128-row block j of group g has slot sum_{h<g} ceil(m_h / 128) + j (the rows past offs[G-1]
//   are group G), unused slots hold the scale of a zero block (1);
//   with ROWWISE also row_q (M, K) e4m3 and row_s (M, ceil(K / 128)) fp32, 1 x 128 blocks.
//   The scales go through both strides (ScaleStrides). The op stores col_s with K contiguous,
//   so that an item's 128 column scales are one run of 512 bytes: in the row-major layout they
//   were 128 single-float stores to 128 sectors (with the row scales', 40% of the kernel's
//   write requests; benchmarks/RESULTS.md). row_s stays row-major (the FP8 forward's layout).
// The activate_quantize kernels compute the same of a = act(h) (* probs) from FC1's output h
// (reference.activation_quantize), both ways: see "the activation" below.
//
// Persistent CTAs, one per SM, walk (slot, 128-column tile) items: a producer warp copies each
// item's 128 x 128 tile of x into a ring of shared-memory stages (16-byte cp.async, completing
// on the stage's mbarrier), and teams of 8 consumer warps take alternate items. A consumer warp
// quantizes 16 rows and 16 columns of the tile straight from shared memory: row blocks are
// reduced by shuffles across the 8 lanes of a row, column blocks by a per-lane max over 16
// rows and shuffles across the 8 row groups, and each lane stores 16 bytes along M per column.
// No block-wide barrier in the loop (sm_90: mbarrier try_wait).
//
// The slots' first rows come from offs on the device (clamped to [0, M], made monotonic): a
// table in shared memory, made once per CTA by two block-wide scans. No host sync.
//
// Arithmetic as kernels/quantize.py, so the output equals the reference's bits: amax with NaN
// kept (then counted as Inf), scale = amax / 448 rounded once (1 for a zero block), the
// quotient x / scale rounded once (by Markstein's fma steps when every scale of a warp's rows,
// or columns, is in [2^-90, Inf); else by division, out of line), the hardware fp32 -> e4m3
// conversion with saturation (NaN -> 0x7F).
//
// An earlier kernel of the same structure for mxfp8 (32 x 512 tiles, E8M0 scales) measured
// 0.37-0.53 of copy bandwidth on the H200 against 0.37-0.43 for the Triton kernel it would
// replace, so mxfp8 stays on Triton (benchmarks/RESULTS.md).

#include "activation.cuh"
#include "block.cuh"
#include "sm90.cuh"

#define TEAM_WARPS 8  // each quantizes 16 rows and 16 columns of a 128 x 128 tile

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

// N input values (consecutive columns of a row), held as loaded: words of two 16-bit values or
// of one fp32 value.
template <int DT, int N>
struct Values {
  static constexpr int PER_WORD = DT == DT_F32 ? 1 : 2;
  static constexpr int WORDS = N / PER_WORD;
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
  // The larger magnitude of the values in each word's place, NaN kept. 16-bit values: one
  // instruction for two (the sign of the result is not |.|'s: word_amax takes fabsf).
  __device__ __forceinline__ static u32 abs_max_word(u32 a, u32 b) {
    if (DT == DT_F32)
      return __float_as_int(max_keep_nan(fabsf(__int_as_float(a)), fabsf(__int_as_float(b))));
    u32 d;
    if (DT == DT_BF16)
      asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    else
      asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  // |value| j of a word made by abs_max_word (j < PER_WORD).
  __device__ __forceinline__ static float word_amax(u32 word, int j) {
    Values v;
    v.w[0] = word;
    return fabsf(v[j]);
  }
  // max |x| of the N values (NaN kept). 16-bit values pairwise: the amax of bf16 or fp16 values
  // is one of them, so the packed max gives the fp32 one exactly.
  __device__ __forceinline__ float amax() const {
    u32 m = w[0];
#pragma unroll
    for (int k = 1; k < WORDS; ++k) m = abs_max_word(m, w[k]);
    return PER_WORD == 1 ? word_amax(m, 0) : max_keep_nan(word_amax(m, 0), word_amax(m, 1));
  }
  // From shared memory (16-byte pieces, or one 8-byte piece); zeros where !ok.
  __device__ __forceinline__ void load_shared(const unsigned char* p, bool ok) {
    if constexpr (WORDS == 2) {
      const uint2 u = ok ? *reinterpret_cast<const uint2*>(p) : make_uint2(0, 0);
      w[0] = u.x;
      w[1] = u.y;
    } else {
#pragma unroll
      for (int i = 0; i < WORDS / 4; ++i) {
        const uint4 u = ok ? reinterpret_cast<const uint4*>(p)[i] : make_uint4(0, 0, 0, 0);
        w[4 * i] = u.x; w[4 * i + 1] = u.y; w[4 * i + 2] = u.z; w[4 * i + 3] = u.w;
      }
    }
  }
};

// Eight values of a row quantized by their block's scale: 8 e4m3 bytes.
template <bool EXACT, typename Scale, typename Row>
__device__ __forceinline__ uint2 quantize8(const Scale& q, const Row& v) {
  uint2 bytes;
  bytes.x = pack_e4m3(q.template apply<EXACT>(v[0]), q.template apply<EXACT>(v[1]),
                      q.template apply<EXACT>(v[2]), q.template apply<EXACT>(v[3]));
  bytes.y = pack_e4m3(q.template apply<EXACT>(v[4]), q.template apply<EXACT>(v[5]),
                      q.template apply<EXACT>(v[6]), q.template apply<EXACT>(v[7]));
  return bytes;
}

// Column j of 16 rows (v[i][j]) quantized by its block's scale: 16 e4m3 bytes, row 0 first.
template <bool EXACT, typename Scale, typename Quad>
__device__ __forceinline__ uint4 quantize_column16(const Scale& q, const Quad* v, int j) {
  u32 b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    b[k] = pack_e4m3(q.template apply<EXACT>(v[4 * k][j]), q.template apply<EXACT>(v[4 * k + 1][j]),
                     q.template apply<EXACT>(v[4 * k + 2][j]), q.template apply<EXACT>(v[4 * k + 3][j]));
  return make_uint4(b[0], b[1], b[2], b[3]);
}

// --------------------------------------------------------------------------- the kernel

// Waits with a suspend-time hint (1 ms at most): a waiting warp sleeps until the phase completes
// instead of spinning on try_wait (spinning waits were 10% of the kernel's issued instructions).
__device__ __forceinline__ void mbar_wait_sleep(u64* bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n"
      " @!p bra WAIT;\n}\n" ::"r"(smem_addr(bar)), "r"(parity), "r"(1000000)
      : "memory");
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// A stage of the ring: a 128 x 128 tile of x, rows of 128 * ESIZE bytes, with BLOCK_PAD bytes
// after every 16 rows. The column pass reads rows 16g + i of 8 row groups g at once; the pad
// puts the row groups of a load phase in different banks (without it every 16th row starts at
// the same bank).
template <int DT>
struct Stage {
  static constexpr int ESIZE = DT == DT_F32 ? 4 : 2;
  static constexpr int ROW_BYTES = 128 * ESIZE;
  static constexpr int BLOCK_PAD = 16 * ESIZE;
  static constexpr int GROUP_BYTES = 16 * ROW_BYTES + BLOCK_PAD;
  static constexpr int BYTES = 8 * GROUP_BYTES;
  __device__ __forceinline__ static int row_offset(int r) {
    return (r >> 4) * GROUP_BYTES + (r & 15) * ROW_BYTES;
  }
};

// Element strides of the two scale tensors: col_s[c, s] and row_s[r, t].
struct ScaleStrides {
  long long col_k, col_slot, row_m, row_tile;
};

// What a consumer warp needs of an item: where its tile sits in x and the outputs.
struct Item {
  int slot, tile, row0, rows, col0, cols;  // rows <= 128 of the slot, cols <= 128 inside K
};

// --------------------------------------------------------------------------- the activation

// The ACTIVATE kernels read FC1's output h and quantize a = act(h) (* probs), FC2's input: a
// stage holds the item's gate and up columns of h (two pieces of 128 columns; one for the
// activations without gate), and the team first writes a over the first piece, in x's dtype,
// then quantizes it as any other tile. What a is: compiled_moe/reference.py's activation,
// rounded to x's dtype, then times probs in fp32 and rounded again (reference.moe_mlp's a).
struct Activation {
  int code;             // kernels/activations.py's CODES: swiglu geglu gpt_oss relu2 gelu silu
  int interleaved;      // gated: columns g0 u0 g1 u1 ... instead of [gate | up]
  const float* probs;   // (M,), or null
  float alpha, limit;   // gpt_oss's constants
  __device__ __forceinline__ bool gated() const { return code <= 2; }
};

// Warp wi writes a over rows 16 wi .. 16 wi + 15 of the stage's first piece: lane l takes
// row 2 i + l / 16 (i = 0..7), q = l % 16, and each row's 16 lanes read 256 contiguous bytes of
// each piece (no bank conflicts). Stacked: output columns 8 q .. 8 q + 7 from both pieces.
// Interleaved: the piece's h columns 8 q .. 8 q + 7 hold output columns 4 q .. 4 q + 3 (of the
// first piece) or 64 + 4 q .. (of the second). (Lanes reading 32 bytes at a 32-byte stride, one
// 16-byte store, ran 2-way bank conflicts on every load.) Each row's values are all loaded before
// any of its lanes stores (a row's lanes read what they overwrite). Columns past K (and the odd
// row of a pair past the item) compute on stale values, which the quantizer's loads mask.
template <int DT, int CODE>
__device__ __forceinline__ void activate_rows(unsigned char* stage, int piece_bytes, const Item& it,
                                              int wi, int lane, const Activation& act) {
  using S = Stage<DT>;
  const int q = lane & 15;
  const bool interleaved = CODE <= 2 && act.interleaved;
#pragma unroll 2
  for (int i = 0; i < 8; ++i) {
    // Rows past the item are skipped, a pair at a time (warp-uniform): a group of 135 rows has
    // a second slot of 7.
    if (16 * wi + 2 * i >= it.rows) break;
    const int r = 16 * wi + 2 * i + (lane >> 4);
    unsigned char* row = stage + S::row_offset(r);
    float g[8], u[8];
    Values<DT, 8> first, second;
    first.load_shared(row + 16 * q, true);
    if (CODE <= 2) second.load_shared(row + piece_bytes + 16 * q, true);
    if (interleaved) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        g[j] = first[2 * j], u[j] = first[2 * j + 1];
        g[4 + j] = second[2 * j], u[4 + j] = second[2 * j + 1];
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] = first[j], u[j] = CODE <= 2 ? second[j] : 0.0f;
    }
    const bool scaled = act.probs != nullptr;
    const float p = scaled && r < it.rows ? act.probs[it.row0 + r] : 1.0f;
    u32 out[4];
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      float v0 = activate<CODE>(g[j], u[j], act.alpha, act.limit);
      float v1 = activate<CODE>(g[j + 1], u[j + 1], act.alpha, act.limit);
      if (scaled) {  // a rounded to x's dtype, then times probs
        const float2 a = unpack_pair(pack_half2(DT, v0, v1), DT);
        v0 = a.x * p, v1 = a.y * p;
      }
      out[j / 2] = pack_half2(DT, v0, v1);
    }
    __syncwarp();
    if (interleaved) {
      *reinterpret_cast<uint2*>(row + 8 * q) = make_uint2(out[0], out[1]);
      *reinterpret_cast<uint2*>(row + 128 + 8 * q) = make_uint2(out[2], out[3]);
    } else {
      *reinterpret_cast<uint4*>(row + 16 * q) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
}

// The team's 8 warps turn the stage into a, then wait for each other (the quantizer's column
// pass reads every warp's rows).
template <int DT>
__device__ __forceinline__ void activate_item(unsigned char* stage, int piece_bytes, const Item& it,
                                              int wi, int lane, int team, const Activation& act) {
  switch (act.code) {
    case 0: activate_rows<DT, 0>(stage, piece_bytes, it, wi, lane, act); break;
    case 1: activate_rows<DT, 1>(stage, piece_bytes, it, wi, lane, act); break;
    case 2: activate_rows<DT, 2>(stage, piece_bytes, it, wi, lane, act); break;
    case 3: activate_rows<DT, 3>(stage, piece_bytes, it, wi, lane, act); break;
    case 4: activate_rows<DT, 4>(stage, piece_bytes, it, wi, lane, act); break;
    default: activate_rows<DT, 5>(stage, piece_bytes, it, wi, lane, act); break;
  }
  asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(32 * TEAM_WARPS) : "memory");
}


// Warp `wi` quantizes 16 rows and 16 columns of an item's tile, in two parts that share nothing
// but the stage.
//
// Rows 16 wi + 4 t + q (t = 0..3, q = lane / 8): the 8 lanes p = lane % 8 of a row hold its
// columns 16p..16p+15 and store them as one 16-byte piece, so a row's 128 bytes of row_q leave
// in one request. (Lanes holding columns 8p..8p+7 and 64+8p.. read shared memory without bank
// conflicts, where these take two wavefronts more per load, but stored each row in two 64-byte
// halves: same kernel otherwise, 0.50 / 0.60 / 0.63 / 0.57 of copy bandwidth against 0.50 /
// 0.67 / 0.62 / 0.57 on DeepSeek-V3 / Qwen3 / Mixtral / GPT-OSS.) Lane p < 4 derives row
// t = p's scale.
//
// Columns 16 wi + 4 cq + j (j = 0..3, cq = lane % 4): lane (g = lane / 4, cq) holds rows
// 16g..16g+15 of its 4 columns; a column's amax is reduced over the 8 row groups by shuffles,
// lane (g < 4, cq) derives column j = g's scale, and each lane stores 16 bytes along M per
// column (a warp's store: 4 columns' 128 contiguous bytes).
//
// Values outside the item (rows past the slot, columns past K) hold stale data in the stage:
// they load as zeros and are not stored.
__device__ __forceinline__ int row_of(int wi, int lane, int t) { return 16 * wi + 4 * t + (lane >> 3); }
__device__ __forceinline__ int row_col(int lane, int h) { return 16 * (lane & 7) + 8 * h; }
__device__ __forceinline__ int col_of(int wi, int lane) { return 16 * wi + 4 * (lane & 3); }

// Loads the warp's rows; returns the amax of row t = lane % 8 (lanes 0..3 of each 8).
template <int DT>
__device__ __forceinline__ float load_rows(Values<DT, 8> (&v)[4][2], const unsigned char* stage,
                                           const Item& it, int wi, int lane) {
  using S = Stage<DT>;
  float a = 0.0f;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int r = row_of(wi, lane, t);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = row_col(lane, h);
      v[t][h].load_shared(stage + S::row_offset(r) + c * S::ESIZE, r < it.rows && c < it.cols);
    }
    float amax = max_keep_nan(v[t][0].amax(), v[t][1].amax());
#pragma unroll
    for (int d = 1; d < 8; d <<= 1) amax = max_keep_nan(amax, __shfl_xor_sync(FULL_MASK, amax, d));
    a = (lane & 7) == t ? amax : a;
  }
  return a;
}

// Loads the warp's columns; returns the amax of column j = lane / 4 (lanes 0..15).
template <int DT>
__device__ __forceinline__ float load_columns(Values<DT, 4> (&v)[16], const unsigned char* stage,
                                              const Item& it, int wi, int lane) {
  using S = Stage<DT>;
  using Quad = Values<DT, 4>;
  const int g = lane >> 2;
#pragma unroll
  for (int i = 0; i < 16; ++i)
    v[i].load_shared(stage + S::row_offset(16 * g + i) + col_of(wi, lane) * S::ESIZE,
                     16 * g + i < it.rows && col_of(wi, lane) < it.cols);  // (cols: a multiple of 8)
  float a = 0.0f;
#pragma unroll
  for (int k = 0; k < Quad::WORDS; ++k) {
    u32 m = v[0].w[k];
#pragma unroll
    for (int i = 1; i < 16; ++i) m = Quad::abs_max_word(m, v[i].w[k]);
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) m = Quad::abs_max_word(m, __shfl_xor_sync(FULL_MASK, m, d));
#pragma unroll
    for (int e = 0; e < Quad::PER_WORD; ++e) {
      const int j = k * Quad::PER_WORD + e;
      a = g == j ? Quad::word_amax(m, e) : a;
    }
  }
  return a;
}

// Scale of row t (from lane 8q + t) and of column j (from lane 4j + cq).
template <typename Scale>
__device__ __forceinline__ Scale row_scale(float2 parts, int lane, int t) {
  const int src = (lane & ~7) + t;
  return Scale::from_parts(__shfl_sync(FULL_MASK, parts.x, src), __shfl_sync(FULL_MASK, parts.y, src));
}
template <typename Scale>
__device__ __forceinline__ Scale column_scale(float2 parts, int lane, int j) {
  const int src = 4 * j + (lane & 3);
  return Scale::from_parts(__shfl_sync(FULL_MASK, parts.x, src), __shfl_sync(FULL_MASK, parts.y, src));
}

// The common case, every scale of the warp's item regular: Markstein's steps, no branch per
// block, the whole item one straight run of code.
template <int DT, typename Scale>
__device__ __forceinline__ void store_rows(const Values<DT, 8> (&v)[4][2], float2 parts, const Item& it,
                                           int wi, int lane, unsigned char* __restrict__ row_q,
                                           long long ldrq, bool row16) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const Scale sc = row_scale<Scale>(parts, lane, t);
    const int r = row_of(wi, lane, t), c = row_col(lane, 0);
    unsigned char* dst = row_q + (long long)(it.row0 + r) * ldrq + it.col0 + c;
    const uint2 lo = quantize8<false>(sc, v[t][0]), hi = quantize8<false>(sc, v[t][1]);
    if (r >= it.rows || c >= it.cols) continue;
    const bool both = c + 8 < it.cols;  // (cols: a multiple of 8)
    if (row16 && both) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else {  // row_q's rows 8-byte aligned only, or the last 8 columns of K
      *reinterpret_cast<uint2*>(dst) = lo;
      if (both) *reinterpret_cast<uint2*>(dst + 8) = hi;
    }
  }
}

template <int DT, typename Scale>
__device__ __forceinline__ void store_columns(const Values<DT, 4> (&v)[16], float2 parts,
                                              const Item& it, int wi, int lane,
                                              unsigned char* __restrict__ col_q, long long ldcq) {
  const int g = lane >> 2, rows = min(16, it.rows - 16 * g);
  const bool whole = rows == 16 && (it.row0 & 15) == 0;  // (col_q's row stride: a multiple of 16)
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const Scale sc = column_scale<Scale>(parts, lane, j);
    const int c = col_of(wi, lane) + j;
    const uint4 b = quantize_column16<false>(sc, v, j);
    unsigned char* dst = col_q + (long long)(it.col0 + c) * ldcq + it.row0 + 16 * g;
    if (c >= it.cols || rows <= 0) continue;
    if (whole) {
      *reinterpret_cast<uint4*>(dst) = b;
    } else {  // a slot's last rows, or a group starting off a 16-byte boundary
      const u32 words[4] = {b.x, b.y, b.z, b.w};
#pragma unroll 1
      for (int i = 0; i < rows; ++i) dst[i] = (unsigned char)(words[i >> 2] >> (8 * (i & 3)));
    }
  }
}

template <int DT>
__device__ __forceinline__ float load_one(const unsigned char* stage, int r, int c) {
  Values<DT, 1 + (DT != DT_F32)> v;  // (a 16-bit value read alone, as the low half of a word)
  const unsigned char* p = stage + Stage<DT>::row_offset(r) + c * Stage<DT>::ESIZE;
  v.w[0] = DT == DT_F32 ? *reinterpret_cast<const u32*>(p) : *reinterpret_cast<const unsigned short*>(p);
  return v[0];
}

// The rare case, some block of the warp's rows (or columns) tiny or holding Inf or NaN: every
// value divided exactly, one at a time from the stage. Kept out of line so that the common path
// stays small: inlined per block, the exact paths made the kernel miss the instruction cache
// most of the time.
template <int DT, typename Scale>
__device__ __noinline__ void store_rows_exact(const unsigned char* stage, float2 parts,
                                              Item it, int wi, int lane,
                                              unsigned char* __restrict__ row_q, long long ldrq) {
#pragma unroll 1
  for (int t = 0; t < 4; ++t) {
    const Scale sc = row_scale<Scale>(parts, lane, t);
    const int r = row_of(wi, lane, t);
#pragma unroll 1
    for (int e = 0; e < 16; ++e) {
      const int c = row_col(lane, e >> 3) + (e & 7);
      if (r < it.rows && c < it.cols)
        row_q[(long long)(it.row0 + r) * ldrq + it.col0 + c] =
            (unsigned char)pack_e4m3(sc.template apply<true>(load_one<DT>(stage, r, c)), 0.f, 0.f, 0.f);
    }
  }
}

template <int DT, typename Scale>
__device__ __noinline__ void store_columns_exact(const unsigned char* stage, float2 parts,
                                                 Item it, int wi, int lane,
                                                 unsigned char* __restrict__ col_q, long long ldcq) {
#pragma unroll 1
  for (int j = 0; j < 4; ++j) {
    const Scale sc = column_scale<Scale>(parts, lane, j);
    const int c = col_of(wi, lane) + j;
#pragma unroll 1
    for (int i = 0; i < 16; ++i) {
      const int r = 16 * (lane >> 2) + i;
      if (r < it.rows && c < it.cols)
        col_q[(long long)(it.col0 + c) * ldcq + it.row0 + r] =
            (unsigned char)pack_e4m3(sc.template apply<true>(load_one<DT>(stage, r, c)), 0.f, 0.f, 0.f);
    }
  }
}

// One item's share of a consumer warp: its rows, then its columns; each part loads, derives its
// scales (stored by the deriving lanes) and stores its data.
template <int DT, typename Scale, bool ROWWISE>
__device__ __forceinline__ void quantize_item(
    const unsigned char* stage, const Item& it, int wi, int lane, unsigned char* __restrict__ col_q,
    long long ldcq, void* __restrict__ col_s, unsigned char* __restrict__ row_q, long long ldrq,
    bool row16, void* __restrict__ row_s, const ScaleStrides& ss) {
  if (ROWWISE && 16 * wi < it.rows) {  // (a warp whose rows all lie past the slot has none to do)
    Values<DT, 8> v[4][2];
    const Scale sc = Scale::from_amax(nan_as_inf(load_rows<DT>(v, stage, it, wi, lane)));
    const int r = row_of(wi, lane, lane & 7);  // the row of this lane's scale (lanes p < 4)
    if ((lane & 7) < 4 && r < it.rows)
      sc.store(row_s, (it.row0 + r) * ss.row_m + it.tile * ss.row_tile);
    if (__all_sync(FULL_MASK, sc.regular))
      store_rows<DT, Scale>(v, sc.parts(), it, wi, lane, row_q, ldrq, row16);
    else
      store_rows_exact<DT, Scale>(stage, sc.parts(), it, wi, lane, row_q, ldrq);
  }
  if (16 * wi >= it.cols) return;  // (likewise for the columns past K)
  Values<DT, 4> v[16];
  const Scale sc = Scale::from_amax(nan_as_inf(load_columns<DT>(v, stage, it, wi, lane)));
  const int c = col_of(wi, lane) + (lane >> 2);  // the column of this lane's scale (lanes < 16)
  if (lane < 16 && c < it.cols) sc.store(col_s, (it.col0 + c) * ss.col_k + it.slot * ss.col_slot);
  if (__all_sync(FULL_MASK, sc.regular))
    store_columns<DT, Scale>(v, sc.parts(), it, wi, lane, col_q, ldcq);
  else
    store_columns_exact<DT, Scale>(stage, sc.parts(), it, wi, lane, col_q, ldcq);
}

// Persistent CTAs of 8 * TEAMS consumer warps and a producer warp walk (slot, column tile)
// items: CTA b takes items b, b + B, b + 2B, ... of the used slots x column tiles, ordered in
// bands of slot_group slots (within a band, slot fastest, then column tile), so the CTAs running
// together read long runs of each row of x and their 16-byte stores along M fill the same
// sectors while those are in L2. The producer decodes each item into its stage and copies the
// item's rows there (16-byte cp.async, each lane's copies arriving on the stage's mbarrier);
// team k % TEAMS quantizes the CTA's k-th item and releases its stage. No block-wide barrier
// in the loop: warps drift apart by up to the ring's depth.
//
// ACTIVATE: x is FC1's output h (K = the activation's columns), and a = act(h) (* probs) is
// quantized; a stage holds the item's pieces of h (see Activation).
template <int DT, typename Scale, bool ROWWISE, int TEAMS, bool ACTIVATE>
__device__ void quantize_group_columns(
    const void* __restrict__ x_, long long ldx, const int* __restrict__ offs, int M, int K, int G,
    int S, int slot_group, int stages, unsigned char* __restrict__ col_q, long long ldcq,
    void* __restrict__ col_s, unsigned char* __restrict__ row_q, long long ldrq,
    void* __restrict__ row_s, const ScaleStrides ss, const Activation act) {
  using St = Stage<DT>;
  const bool row16 = ((ldrq | (long long)row_q) & 15) == 0;  // 16-byte row stores
  extern __shared__ __align__(128) unsigned char smem[];
  const int pieces = ACTIVATE && act.gated() ? 2 : 1, stage_bytes = pieces * St::BYTES;
  u64* full = reinterpret_cast<u64*>(smem + stages * stage_bytes);
  u64* empty = full + stages;
  Item* stage_item = reinterpret_cast<Item*>(empty + stages);  // each stage's item
  int* scratch = reinterpret_cast<int*>(stage_item + stages);
  int* slot_row = scratch + 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 33);  // each producer lane's copies, and the item written
      mbar_init(&empty[s], TEAM_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const int used = fill_slot_rows<128>(offs, M, G, scratch, slot_row);  // (ends in a barrier)

  const int num_tiles = (K + 127) / 128;
  const long long items = (long long)used * num_tiles;
  {  // unused slots (past `used`) get a zero block's scale in every column
    const Scale zero = Scale::from_amax(0.0f);
    const long long unused = (long long)(S - used) * K;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < unused;
         e += (long long)gridDim.x * blockDim.x)
      zero.store(col_s, (e % K) * ss.col_k + (used + e / K) * ss.col_slot);
  }
  auto item = [&](long long w) {
    Item it;
    const long long band = w / ((long long)slot_group * num_tiles);
    const int first = (int)band * slot_group, width = min(slot_group, used - first);
    const int within = (int)(w - band * slot_group * num_tiles);
    it.slot = first + within % width;
    it.tile = within / width;
    it.row0 = slot_row[it.slot];
    it.rows = slot_row[it.slot + 1] - it.row0;
    it.col0 = 128 * it.tile;
    it.cols = min(128, K - it.col0);
    return it;
  };
  const int wi = threadIdx.x / 32, lane = threadIdx.x % 32;
  int k = 0;
  if (wi == TEAMS * TEAM_WARPS) {  // the producer
    // 16-byte pieces: lane takes piece c of rows i0, i0 + ROWS_PER_STEP, ... of each 16
    constexpr int LANES_PER_ROW = St::ROW_BYTES / 16, ROWS_PER_STEP = 32 / LANES_PER_ROW;
    const int c = lane % LANES_PER_ROW, i0 = lane / LANES_PER_ROW;
    const char* x = static_cast<const char*>(x_) + 16 * c;
    const long long row_bytes = ldx * St::ESIZE;
    for (long long w = blockIdx.x; w < items; w += gridDim.x, ++k) {
      const int s = k % stages;
      if (k >= stages) mbar_wait_sleep(&empty[s], (k / stages - 1) & 1);
      const Item it = item(w);
      if (lane == 0) {
        stage_item[s] = it;
        mbar_arrive_if(&full[s], true);  // (releases the item's words)
      }
      for (int p = 0; p < pieces; ++p) {
        // piece p: columns [c0, c0 + n) of x (h: gate then up, stacked K apart or interleaved)
        int c0 = it.col0, n = it.cols;
        if (pieces == 2 && act.interleaved)
          c0 = 2 * it.col0 + 128 * p, n = min(128, max(0, 2 * it.cols - 128 * p));
        else if (pieces == 2)
          c0 = it.col0 + p * K;
        unsigned char* dst = smem + s * stage_bytes + p * St::BYTES + 16 * c + i0 * St::ROW_BYTES;
        const char* src = x + (it.row0 + i0) * row_bytes + c0 * St::ESIZE;
        if (16 * c < n * St::ESIZE)
          for (int r = 0; r < it.rows; r += 16, dst += St::GROUP_BYTES, src += 16 * row_bytes)
#pragma unroll
            for (int i = 0; i < 16; i += ROWS_PER_STEP)
              if (r + i0 + i < it.rows) cp_async_16(dst + i * St::ROW_BYTES, src + i * row_bytes);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(&full[s]))
                   : "memory");
    }
    return;
  }
  const int team = wi / TEAM_WARPS;
  k = team;
  for (long long w = blockIdx.x + (long long)team * gridDim.x; w < items;
       w += (long long)TEAMS * gridDim.x, k += TEAMS) {
    const int s = k % stages;
    unsigned char* stage = smem + s * stage_bytes;
    mbar_wait_sleep(&full[s], (k / stages) & 1);
    const Item it = stage_item[s];
    if (ACTIVATE) activate_item<DT>(stage, St::BYTES, it, wi % TEAM_WARPS, lane, team, act);
    quantize_item<DT, Scale, ROWWISE>(stage, it, wi % TEAM_WARPS, lane, col_q, ldcq, col_s,
                                      row_q, ldrq, row16, row_s, ss);
    __syncwarp();
    mbar_arrive_if(&empty[s], lane == 0);
  }
}

// Two teams for 16-bit x (96 registers a thread, no spills); one for fp32 x, whose 32 KB tile rows
// need more registers than two teams leave.
#define QUANTIZE_KERNEL(NAME, DT, SCALE, ROWWISE, TEAMS)                                         \
  extern "C" __global__ void __launch_bounds__(32 * (TEAM_WARPS * TEAMS + 1), 1) NAME(          \
      const void* x, long long ldx, const int* offs, int M, int K, int G, int S,               \
      int slot_group, int stages, unsigned char* col_q, long long ldcq, void* col_s,           \
      long long cs_k, long long cs_s, unsigned char* row_q, long long ldrq, void* row_s,       \
      long long rs_m, long long rs_t) {                                                        \
    quantize_group_columns<DT, SCALE, ROWWISE, TEAMS, false>(                                  \
        x, ldx, offs, M, K, G, S, slot_group, stages, col_q, ldcq, col_s, row_q, ldrq, row_s,   \
        ScaleStrides{cs_k, cs_s, rs_m, rs_t}, Activation{});                                   \
  }

#define QUANTIZE_KERNELS(SUFFIX, DT, TEAMS)                                                \
  QUANTIZE_KERNEL(quantize_columns_fp8_blockwise_##SUFFIX, DT, ScaleF32, false, TEAMS)     \
  QUANTIZE_KERNEL(quantize_rows_columns_fp8_blockwise_##SUFFIX, DT, ScaleF32, true, TEAMS)

QUANTIZE_KERNELS(bf16, DT_BF16, 2)
QUANTIZE_KERNELS(f16, DT_F16, 2)
QUANTIZE_KERNELS(f32, DT_F32, 1)

// FC2's input from FC1's output h (M, 2K gated, or K): a = act(h) (* probs) quantized both ways.
// 16-bit h only (two 66 KB stages of fp32 h would leave the ring too shallow).
#define ACTIVATE_QUANTIZE_KERNEL(NAME, DT)                                                      \
  extern "C" __global__ void __launch_bounds__(32 * (TEAM_WARPS * 2 + 1), 1) NAME(              \
      const void* h, long long ldh, const int* offs, int M, int K, int G, int S,               \
      int slot_group, int stages, unsigned char* col_q, long long ldcq, void* col_s,           \
      long long cs_k, long long cs_s, unsigned char* row_q, long long ldrq, void* row_s,       \
      long long rs_m, long long rs_t, int code, int interleaved, const float* probs,           \
      float alpha, float limit) {                                                              \
    quantize_group_columns<DT, ScaleF32, true, 2, true>(                                       \
        h, ldh, offs, M, K, G, S, slot_group, stages, col_q, ldcq, col_s, row_q, ldrq, row_s,   \
        ScaleStrides{cs_k, cs_s, rs_m, rs_t}, Activation{code, interleaved, probs, alpha, limit}); \
  }

ACTIVATE_QUANTIZE_KERNEL(activate_quantize_fp8_blockwise_bf16, DT_BF16)
ACTIVATE_QUANTIZE_KERNEL(activate_quantize_fp8_blockwise_f16, DT_F16)

// --------------------------------------------------------------------------- rowwise only

// The rowwise 1 x 128 blocks alone (row_q (M, K) e4m3, row_s fp32 through strides (rs_m, rs_t)),
// as the FP8 forward quantizes its activations: no columnwise output, so no group reads. A warp
// per block, four consecutive values a lane, x read once; a grid-stride loop over the blocks.
// The arithmetic above, the quotient by division (memory bounds this kernel, not its ALU).
template <int DT>
__device__ __forceinline__ float load_value(const void* x, long long i) {
  if (DT == DT_F32) return static_cast<const float*>(x)[i];
  const unsigned short h = static_cast<const unsigned short*>(x)[i];
  if (DT == DT_BF16) return __int_as_float((u32)h << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <int DT>
__device__ void quantize_rows(const void* __restrict__ x, long long ldx, long long M, int K,
                              unsigned char* __restrict__ row_q, long long ldrq, float* __restrict__ row_s,
                              long long rs_m, long long rs_t) {
  const int lane = threadIdx.x & 31, blocks_per_row = (K + 127) / 128;
  const long long blocks = M * blocks_per_row, warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < blocks; b += warps) {
    const long long r = b / blocks_per_row;
    const int t = (int)(b - r * blocks_per_row), c0 = 128 * t + 4 * lane;
    float v[4], amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = c0 + j < K ? load_value<DT>(x, r * ldx + c0 + j) : 0.0f;
      amax = max_keep_nan(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) amax = max_keep_nan(amax, __shfl_xor_sync(FULL_MASK, amax, d));
    const ScaleF32 q = ScaleF32::from_amax(nan_as_inf(amax));
    if (lane == 0) row_s[r * rs_m + t * rs_t] = q.s;
    const u32 bytes = pack_e4m3(q.apply<true>(v[0]), q.apply<true>(v[1]), q.apply<true>(v[2]), q.apply<true>(v[3]));
    unsigned char* out = row_q + r * ldrq + c0;
    if (c0 + 3 < K && ((unsigned long long)out & 3) == 0) {
      *reinterpret_cast<u32*>(out) = bytes;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c0 + j < K) out[j] = (unsigned char)(bytes >> (8 * j));
    }
  }
}

#define QUANTIZE_ROWS_KERNEL(NAME, DT)                                                               \
  extern "C" __global__ void NAME(const void* x, long long ldx, long long M, int K, unsigned char* row_q, \
                                  long long ldrq, float* row_s, long long rs_m, long long rs_t) {          \
    quantize_rows<DT>(x, ldx, M, K, row_q, ldrq, row_s, rs_m, rs_t);                                   \
  }

QUANTIZE_ROWS_KERNEL(quantize_rows_fp8_blockwise_bf16, DT_BF16)
QUANTIZE_ROWS_KERNEL(quantize_rows_fp8_blockwise_f16, DT_F16)
QUANTIZE_ROWS_KERNEL(quantize_rows_fp8_blockwise_f32, DT_F32)
