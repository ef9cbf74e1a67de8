// Row kernels of the experts block, launched by the C++ host layer (csrc/host/rows.cpp): the
// gather of token rows into expert-sorted rows (moe_permute, and with the routing weights'
// gradient in the same pass, moe_unpermute_backward), the weighted combine back
// (moe_unpermute), the activation between the two GEMMs and its backward, and the per-group
// row sums (grouped_sum, a bias gradient). The gather and combine kernels are the only CUDA
// kernels of their ops, eager and compiled alike (compiled graphs call the ops). Their oracles
// are compiled_moe/reference.py's functions of the same names.
//
// Element kinds: row_args.cuh's RowElementKind. Arithmetic in fp32, one rounding at the store.

#include "activation.cuh"
#include "row_args.cuh"

typedef unsigned short u16;

__device__ __forceinline__ float to_float(u16 v, int kind) {
  if (kind == kRowBF16) return __uint_as_float(((unsigned)v) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

__device__ __forceinline__ u16 from_float(float v, int kind) {  // round to nearest even
  unsigned r;
  if (kind == kRowBF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.0f), "f"(v));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.0f), "f"(v));
  return (u16)(r & 0xffffu);
}

__device__ __forceinline__ float load(const void* p, long long i, int kind) {
  return kind == kRowF32 ? ((const float*)p)[i] : to_float(((const u16*)p)[i], kind);
}

__device__ __forceinline__ void store(void* p, long long i, float v, int kind) {
  if (kind == kRowF32) ((float*)p)[i] = v;
  else ((u16*)p)[i] = from_float(v, kind);
}

#define GRID_STRIDE(i, total) \
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (total); i += (long long)gridDim.x * blockDim.x)

// ------------------------------------------------------------------ gather and combine
// Rows move as 16-byte vectors (8 bf16/fp16 or 4 fp32 values) where the host found H, the row
// strides and the addresses 16-byte aligned, else element by element (VEC 1). Each kernel
// reads and writes every byte once: at these sizes they are bound by memory bandwidth.

template <int KIND> struct Element;
template <> struct Element<kRowBF16> {
  typedef u16 T;
  static __device__ __forceinline__ float value(T v) { return to_float(v, kRowBF16); }
  static __device__ __forceinline__ T of(float v) { return from_float(v, kRowBF16); }
};
template <> struct Element<kRowF16> {
  typedef u16 T;
  static __device__ __forceinline__ float value(T v) { return to_float(v, kRowF16); }
  static __device__ __forceinline__ T of(float v) { return from_float(v, kRowF16); }
};
template <> struct Element<kRowF32> {
  typedef float T;
  static __device__ __forceinline__ float value(T v) { return v; }
  static __device__ __forceinline__ T of(float v) { return v; }
};

// VEC consecutive elements, aligned to their size: a 16-byte vector moves in one instruction.
template <int KIND, int VEC>
struct alignas(sizeof(typename Element<KIND>::T) * VEC) Piece {
  typename Element<KIND>::T v[VEC];
  __device__ __forceinline__ float at(int j) const { return Element<KIND>::value(v[j]); }
  __device__ __forceinline__ void set(int j, float f) { v[j] = Element<KIND>::of(f); }
};

template <int KIND, int VEC>
__device__ __forceinline__ Piece<KIND, VEC> zero_piece() {
  Piece<KIND, VEC> p;
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = typename Element<KIND>::T(0);
  return p;
}

__device__ __forceinline__ float warp_sum(float v) {  // a fixed order: deterministic
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Slots a token's warp takes at once: their rows, weights and dot sums stay in registers.
constexpr int kScatterSlots = 8;

// The gather, read from the token side: token t's warp reads x[t] once and writes it (scaled)
// to the rows of its pairs, so every token row crosses memory once however many experts it
// went to (read from the rows' side, each of the k reads of a row came from memory again: the
// rows of an expert span every token, and the rows written push the tokens out of L2). A
// pair's row is written here only where source[row] names the pair back; rows that no pair
// reaches so (padding, or maps that disagree) take the row-side gather below, so every row is
// written exactly once.
template <int KIND, int VEC, bool SCALE, bool DOT>
__device__ __forceinline__ void scatter_token(const GatherRowsArgs& a, long long t, int lane) {
  typedef Piece<KIND, VEC> P;
  const int pieces = a.H / VEC;
  const P* x_row = static_cast<const P*>(a.x) + t * (a.x_stride / VEC);
  for (int s0 = 0; s0 < a.top_k; s0 += kScatterSlots) {
    long long row[kScatterSlots];
    float w[kScatterSlots], dot[kScatterSlots];
#pragma unroll
    for (int j = 0; j < kScatterSlots; ++j) {
      const long long pair = t * a.top_k + s0 + j;
      const int r = s0 + j < a.top_k ? a.row_of[pair] : -1;
      const bool owned = r >= 0 && r < a.rows && a.source[r] == pair;
      row[j] = owned ? r : -1;
      w[j] = SCALE && owned ? load(a.scale, pair, a.scale_kind) : 0.0f;
      dot[j] = 0.0f;
    }
    for (int c = lane; c < pieces; c += 32) {
      const P v = x_row[c];
#pragma unroll
      for (int j = 0; j < kScatterSlots; ++j) {
        if (row[j] < 0) continue;
        if (DOT) {
          const P o = static_cast<const P*>(a.other)[row[j] * (a.other_stride / VEC) + c];
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[j] += v.at(e) * o.at(e);
        }
        P u = v;
        if (SCALE) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) u.set(e, v.at(e) * w[j]);
        }
        static_cast<P*>(a.out)[row[j] * pieces + c] = u;
      }
    }
    if (DOT) {
#pragma unroll
      for (int j = 0; j < kScatterSlots; ++j) {
        const float d = warp_sum(dot[j]);
        if (lane == 0 && row[j] >= 0) store(a.dot, t * a.top_k + s0 + j, d, a.dot_kind);
      }
    }
  }
}

// Row r from the row side: zero for padding (source not a pair in [0, num_pairs)), else
// x[source[r] / top_k] (scaled, with its dot).
template <int KIND, int VEC, bool SCALE, bool DOT>
__device__ __forceinline__ void gather_row(const GatherRowsArgs& a, long long r, int lane) {
  typedef Piece<KIND, VEC> P;
  const int s = a.source[r];
  const bool valid = s >= 0 && s < a.num_pairs;
  const int pieces = a.H / VEC;
  const P* x_row = static_cast<const P*>(a.x) + (valid ? (long long)(s / a.top_k) * (a.x_stride / VEC) : 0);
  const P* other_row = DOT ? static_cast<const P*>(a.other) + r * (a.other_stride / VEC) : nullptr;
  P* out_row = static_cast<P*>(a.out) + r * (long long)pieces;
  const float w = SCALE && valid ? load(a.scale, s, a.scale_kind) : 0.0f;
  float dot = 0.0f;
  for (int c = lane; c < pieces; c += 32) {
    P v = valid ? x_row[c] : zero_piece<KIND, VEC>();
    if (DOT && valid) {
      const P o = other_row[c];
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += v.at(e) * o.at(e);
    }
    if (SCALE) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) v.set(e, v.at(e) * w);
    }
    out_row[c] = v;
  }
  if (DOT) {
    dot = warp_sum(dot);
    if (lane == 0 && valid) store(a.dot, s, dot, a.dot_kind);
  }
}

// Rows [first, first + 32): each lane checks one; the warp gathers, from the row side, those
// the token side does not write.
template <int KIND, int VEC, bool SCALE, bool DOT>
__device__ __forceinline__ void gather_unreached_rows(const GatherRowsArgs& a, long long first, int lane) {
  const long long r = first + lane;
  bool unreached = false;
  if (r < a.rows) {
    const int s = a.source[r];
    unreached = !(s >= 0 && s < a.num_pairs && a.row_of[s] == r);
  }
  for (unsigned mask = __ballot_sync(0xffffffffu, unreached); mask; mask &= mask - 1)
    gather_row<KIND, VEC, SCALE, DOT>(a, first + __ffs(mask) - 1, lane);
}

// One warp an item: items [0, tokens) scatter a token, the rest check 32 rows each.
template <int KIND, int VEC, bool SCALE, bool DOT>
__device__ __forceinline__ void gather_rows(const GatherRowsArgs& a) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5), items = a.tokens + (a.rows + 31) / 32;
  for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; i < items; i += warps) {
    if (i < a.tokens) scatter_token<KIND, VEC, SCALE, DOT>(a, i, lane);
    else gather_unreached_rows<KIND, VEC, SCALE, DOT>(a, (i - a.tokens) * 32, lane);
  }
}

template <int KIND, int VEC>
__device__ __forceinline__ void gather_rows_mode(const GatherRowsArgs& a) {
  if (a.other) gather_rows<KIND, VEC, true, true>(a);
  else if (a.scale) gather_rows<KIND, VEC, true, false>(a);
  else gather_rows<KIND, VEC, false, false>(a);
}

// (A minimum of one block an SM: with the default, ptxas for sm_80 held the kernel to 40
// registers and spilled.)
extern "C" __global__ void __launch_bounds__(256, 1) moe_gather_rows(const GatherRowsArgs a) {
  switch (a.kind) {
    case kRowBF16: a.vector ? gather_rows_mode<kRowBF16, 8>(a) : gather_rows_mode<kRowBF16, 1>(a); break;
    case kRowF16: a.vector ? gather_rows_mode<kRowF16, 8>(a) : gather_rows_mode<kRowF16, 1>(a); break;
    default: a.vector ? gather_rows_mode<kRowF32, 4>(a) : gather_rows_mode<kRowF32, 1>(a); break;
  }
}

template <int KIND, int VEC>
__device__ __forceinline__ void combine_rows(const CombineRowsArgs a) {
  typedef Piece<KIND, VEC> P;
  const P* y = static_cast<const P*>(a.y);
  P* out = static_cast<P*>(a.out);
  const int pieces = a.H / VEC;
  const long long y_stride = a.y_stride / VEC;
  GRID_STRIDE(i, a.tokens * pieces) {
    const long long t = i / pieces;
    const int c = (int)(i - t * pieces);
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    for (int s = 0; s < a.top_k; ++s) {
      const long long pair = t * a.top_k + s;
      const int r = a.row_of[pair];
      if (r < 0 || r >= a.y_rows) continue;
      const float w = a.weights ? load(a.weights, pair, a.weight_kind) : 1.0f;
      const P v = y[r * y_stride + c];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += v.at(j) * w;
    }
    P o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.set(j, acc[j]);
    out[i] = o;
  }
}

extern "C" __global__ void __launch_bounds__(256) moe_combine_rows(const CombineRowsArgs a) {
  switch (a.kind) {
    case kRowBF16: a.vector ? combine_rows<kRowBF16, 8>(a) : combine_rows<kRowBF16, 1>(a); break;
    case kRowF16: a.vector ? combine_rows<kRowF16, 8>(a) : combine_rows<kRowF16, 1>(a); break;
    default: a.vector ? combine_rows<kRowF32, 4>(a) : combine_rows<kRowF32, 1>(a); break;
  }
}

// ------------------------------------------------------------------ activations

template <int CODE>
__device__ __forceinline__ void activation_rows(const void* __restrict__ h, long long h_stride, void* __restrict__ a,
                                                long long rows, int inter, int kind, int interleaved, float alpha,
                                                float limit) {
  GRID_STRIDE(i, rows * inter) {
    const long long r = i / inter;
    const int j = (int)(i - r * inter);
    const long long row = r * h_stride;
    float g, u = 0.0f;
    if (CODE <= 2) {  // gated: [gate | up] halves, or g0 u0 g1 u1 ...
      g = load(h, row + (interleaved ? 2 * j : j), kind);
      u = load(h, row + (interleaved ? 2 * j + 1 : inter + j), kind);
    } else {
      g = load(h, row + j, kind);
    }
    store(a, i, activate<CODE>(g, u, alpha, limit), kind);
  }
}

// a (rows, inter) contiguous = act(h) for h (rows, N1) with row stride h_stride; code:
// activations.py's CODES.
extern "C" __global__ void moe_activation_rows(const void* __restrict__ h, long long h_stride, void* __restrict__ a,
                                               long long rows, int inter, int kind, int code, int interleaved,
                                               float alpha, float limit) {
  switch (code) {
    case 0: activation_rows<0>(h, h_stride, a, rows, inter, kind, interleaved, alpha, limit); break;
    case 1: activation_rows<1>(h, h_stride, a, rows, inter, kind, interleaved, alpha, limit); break;
    case 2: activation_rows<2>(h, h_stride, a, rows, inter, kind, interleaved, alpha, limit); break;
    case 3: activation_rows<3>(h, h_stride, a, rows, inter, kind, interleaved, alpha, limit); break;
    case 4: activation_rows<4>(h, h_stride, a, rows, inter, kind, interleaved, alpha, limit); break;
    default: activation_rows<5>(h, h_stride, a, rows, inter, kind, interleaved, alpha, limit); break;
  }
}

// d act / d g and d act / d u at (g, u), times da: reference.activation_backward's formulas.
template <int CODE>
__device__ __forceinline__ void activation_grad(float g, float u, float da, float alpha, float limit, float& dg,
                                                float& du) {
  du = 0.0f;
  if (CODE == 0) {  // swiglu
    const float s = sigmoid_fast(g);
    dg = da * u * s * (1.0f + g * (1.0f - s));
    du = da * g * s;
  } else if (CODE == 1) {  // geglu (tanh gelu)
    const float c = 0.7978845608028654f;
    const float t = 2.0f * sigmoid_fast(2.0f * c * (g + 0.044715f * g * g * g)) - 1.0f;
    dg = da * u * (0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * g * g));
    du = da * 0.5f * g * (1.0f + t);
  } else if (CODE == 2) {  // gpt_oss: clamp passes the gradient where the value is inside its range
    const float gc = g > limit ? limit : g;
    const float uc = u > limit ? limit : (u < -limit ? -limit : u);
    const float s = sigmoid_fast(alpha * gc);
    dg = g <= limit ? da * (uc + 1.0f) * s * (1.0f + alpha * gc * (1.0f - s)) : 0.0f;
    du = (u >= -limit && u <= limit) ? da * gc * s : 0.0f;
  } else if (CODE == 3) {  // relu2
    dg = 2.0f * (g > 0.0f ? g : 0.0f) * da;
  } else if (CODE == 4) {  // gelu (erf)
    dg = da * (0.5f * (1.0f + erff(g * 0.7071067811865476f)) + g * __expf(-0.5f * g * g) * 0.3989422804014327f);
  } else {  // silu
    const float s = sigmoid_fast(g);
    dg = da * s * (1.0f + g * (1.0f - s));
  }
}

template <int CODE>
__device__ __forceinline__ void activation_backward_rows(const void* __restrict__ grad, int grad_kind,
                                                         long long grad_stride, const void* __restrict__ h,
                                                         long long h_stride, void* __restrict__ dh, long long rows,
                                                         int inter, int kind, int interleaved, float alpha,
                                                         float limit) {
  const int n1 = CODE <= 2 ? 2 * inter : inter;
  GRID_STRIDE(i, rows * inter) {
    const long long r = i / inter;
    const int j = (int)(i - r * inter);
    const int gj = CODE <= 2 && interleaved ? 2 * j : j;
    const int uj = interleaved ? 2 * j + 1 : inter + j;
    const float g = load(h, r * h_stride + gj, kind);
    const float u = CODE <= 2 ? load(h, r * h_stride + uj, kind) : 0.0f;
    float dg, du;
    activation_grad<CODE>(g, u, load(grad, r * grad_stride + j, grad_kind), alpha, limit, dg, du);
    store(dh, r * n1 + gj, dg, kind);
    if (CODE <= 2) store(dh, r * n1 + uj, du, kind);
  }
}

// dh (rows, N1) contiguous = d act(h) / d h times grad (rows, inter), with grad of grad_kind.
extern "C" __global__ void moe_activation_backward_rows(const void* __restrict__ grad, int grad_kind,
                                                        long long grad_stride, const void* __restrict__ h,
                                                        long long h_stride, void* __restrict__ dh, long long rows,
                                                        int inter, int kind, int code, int interleaved, float alpha,
                                                        float limit) {
#define CM_ACTIVATION_BACKWARD(C) \
  activation_backward_rows<C>(grad, grad_kind, grad_stride, h, h_stride, dh, rows, inter, kind, interleaved, alpha, limit)
  switch (code) {
    case 0: CM_ACTIVATION_BACKWARD(0); break;
    case 1: CM_ACTIVATION_BACKWARD(1); break;
    case 2: CM_ACTIVATION_BACKWARD(2); break;
    case 3: CM_ACTIVATION_BACKWARD(3); break;
    case 4: CM_ACTIVATION_BACKWARD(4); break;
    default: CM_ACTIVATION_BACKWARD(5); break;
  }
#undef CM_ACTIVATION_BACKWARD
}

// out[g, n] (G, N) contiguous of out_kind = sum of x[r, n] over the rows r of group g, in fp32
// and in a fixed order. Groups are [offs[g-1], offs[g]) clamped to [0, M] and made monotone (a
// running max), as the Triton kernel reads them. One block a (group, 64 columns); its 4 row
// lanes take every 4th row and their sums add in lane order.
extern "C" __global__ void __launch_bounds__(SUM_COLUMNS * SUM_LANES)
grouped_sum_rows(const void* __restrict__ x, int kind, long long x_stride, const int* __restrict__ offs, int G,
                 long long M, int N, void* __restrict__ out, int out_kind, int column_blocks) {
  __shared__ int bounds[2][SUM_COLUMNS * SUM_LANES / 32];
  __shared__ float partial[SUM_LANES][SUM_COLUMNS];
  const int g = blockIdx.x / column_blocks;
  const int column = (blockIdx.x - g * column_blocks) * SUM_COLUMNS + (threadIdx.x % SUM_COLUMNS);
  const int lane = threadIdx.x / SUM_COLUMNS;
  // start = max over i < g of clamp(offs[i]), end = max(start, clamp(offs[g])).
  int start = 0, end = 0;
  for (int i = threadIdx.x; i <= g; i += blockDim.x) {
    const long long o = offs[i];
    const int c = (int)(o < 0 ? 0 : (o > M ? M : o));
    end = max(end, c);
    if (i < g) start = max(start, c);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    start = max(start, __shfl_xor_sync(0xffffffffu, start, offset));
    end = max(end, __shfl_xor_sync(0xffffffffu, end, offset));
  }
  if ((threadIdx.x & 31) == 0) {
    bounds[0][threadIdx.x >> 5] = start;
    bounds[1][threadIdx.x >> 5] = end;
  }
  __syncthreads();
  start = end = 0;
  for (int w = 0; w < SUM_COLUMNS * SUM_LANES / 32; ++w) {
    start = max(start, bounds[0][w]);
    end = max(end, bounds[1][w]);
  }
  float acc = 0.0f;
  if (column < N)
    for (long long r = start + lane; r < end; r += SUM_LANES) acc += load(x, r * x_stride + column, kind);
  partial[lane][threadIdx.x % SUM_COLUMNS] = acc;
  __syncthreads();
  if (lane == 0 && column < N) {
    float total = partial[0][threadIdx.x];
    for (int l = 1; l < SUM_LANES; ++l) total += partial[l][threadIdx.x];
    store(out, (long long)g * N + column, total, out_kind);
  }
}
