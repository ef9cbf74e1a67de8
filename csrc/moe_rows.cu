// Row kernels of the experts block, launched by the C++ host layer (csrc/host/): the gather of
// token rows into expert-sorted rows (moe_permute), the weighted combine back (moe_unpermute)
// and its weights' gradient, the activation between the two GEMMs and its backward, and the
// per-group row sums (grouped_sum, a bias gradient), each the CUDA kernel of the op of that
// name (csrc/host/rows.cpp), which the one-call experts block (csrc/host/ops.cpp's moe_experts)
// composes. Their oracles are
// compiled_moe/reference.py's functions of the same names; the Triton kernels of
// kernels/routing.py, kernels/activations.py and kernels/grouped_mm.py do the same inside
// compiled graphs.
//
// Element kinds: 0 bf16, 1 fp16, 2 fp32 (-1: no tensor). Arithmetic in fp32, one rounding at
// the store. Grid-stride loops over the elements: these kernels are memory-bound at every size
// they run, and what the host layer is for is the host time of one launch each.

#include "activation.cuh"

typedef unsigned short u16;

__device__ __forceinline__ float to_float(u16 v, int kind) {
  if (kind == 0) return __uint_as_float(((unsigned)v) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

__device__ __forceinline__ u16 from_float(float v, int kind) {  // round to nearest even
  unsigned r;
  if (kind == 0) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.0f), "f"(v));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.0f), "f"(v));
  return (u16)(r & 0xffffu);
}

__device__ __forceinline__ float load(const void* p, long long i, int kind) {
  return kind == 2 ? ((const float*)p)[i] : to_float(((const u16*)p)[i], kind);
}

__device__ __forceinline__ void store(void* p, long long i, float v, int kind) {
  if (kind == 2) ((float*)p)[i] = v;
  else ((u16*)p)[i] = from_float(v, kind);
}

#define GRID_STRIDE(i, total) \
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (total); i += (long long)gridDim.x * blockDim.x)

// x[r] = hidden[source[r] / top_k]; rows whose source is not a pair in [0, num_pairs) (padding:
// moe_route marks them -1) are zero. Rows move as 16-byte chunks: chunks = H * element size / 16,
// and the host checks hidden's row stride (in chunks) and addresses.
extern "C" __global__ void moe_gather_rows(const uint4* __restrict__ hidden, long long hidden_stride,
                                           const int* __restrict__ source, uint4* __restrict__ x, long long rows,
                                           int chunks, int top_k, long long num_pairs) {
  GRID_STRIDE(i, rows * chunks) {
    const long long r = i / chunks;
    const int c = (int)(i - r * chunks);
    const int s = source[r];
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (s >= 0 && s < num_pairs) v = hidden[(long long)(s / top_k) * hidden_stride + c];
    x[i] = v;
  }
}

// The same gather element by element, times scale[source[r]] where scale_kind >= 0 (scale (T, k)
// contiguous), from hidden of hidden_kind into out (rows, H) contiguous of out_kind.
extern "C" __global__ void moe_permute_rows(const void* __restrict__ hidden, int hidden_kind, long long hidden_stride,
                                            const int* __restrict__ source, const void* __restrict__ scale,
                                            int scale_kind, void* __restrict__ out, int out_kind, long long rows,
                                            int H, int top_k, long long num_pairs) {
  GRID_STRIDE(i, rows * H) {
    const long long r = i / H;
    const int c = (int)(i - r * H);
    const int s = source[r];
    float v = 0.0f;
    if (s >= 0 && s < num_pairs) {
      v = load(hidden, (long long)(s / top_k) * hidden_stride + c, hidden_kind);
      if (scale_kind >= 0) v *= load(scale, s, scale_kind);
    }
    store(out, i, v, out_kind);
  }
}

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

// out[t] (contiguous, of kind) = sum over slots s (in order) of weights[t, s] *
// y[row_of[t, s]], in fp32; slots whose row_of names no row of y (dropped pairs: -1) count 0.
// weights (T, k) contiguous of weight_kind, or none (weight_kind -1: every weight 1).
extern "C" __global__ void moe_combine_rows(const void* __restrict__ y, long long y_rows, long long y_stride,
                                            const int* __restrict__ row_of, const void* __restrict__ weights,
                                            int weight_kind, void* __restrict__ out, long long tokens, int top_k,
                                            int hidden, int kind) {
  GRID_STRIDE(i, tokens * hidden) {
    const long long t = i / hidden;
    const int c = (int)(i - t * hidden);
    float acc = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      const long long pair = t * top_k + s;
      const int r = row_of[pair];
      if (r < 0 || r >= y_rows) continue;
      const float w = weight_kind >= 0 ? load(weights, pair, weight_kind) : 1.0f;
      acc += w * load(y, r * y_stride + c, kind);
    }
    store(out, i, acc, kind);
  }
}

// dot[t, s] = <grad_out[t], y[row_of[t, s]]> in fp32, 0 where row_of[t, s] names no row of y:
// moe_unpermute's weight gradient. One warp a pair (lanes over the columns, then a fixed-order
// shuffle sum); dot (T, k) contiguous of dot_kind.
extern "C" __global__ void moe_pair_dot(const void* __restrict__ grad_out, int grad_kind, long long grad_stride,
                                        const void* __restrict__ y, int y_kind, long long y_rows, long long y_stride,
                                        const int* __restrict__ row_of, void* __restrict__ dot, int dot_kind,
                                        long long pairs, int top_k, int H) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long p = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; p < pairs; p += warps) {
    const int r = row_of[p];
    float acc = 0.0f;
    if (r >= 0 && r < y_rows) {
      const long long t = p / top_k;
      for (int c = lane; c < H; c += 32)
        acc += load(grad_out, t * grad_stride + c, grad_kind) * load(y, r * y_stride + c, y_kind);
    }
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0) store(dot, p, acc, dot_kind);
  }
}

// out[g, n] (G, N) contiguous of out_kind = sum of x[r, n] over the rows r of group g, in fp32
// and in a fixed order. Groups are [offs[g-1], offs[g]) clamped to [0, M] and made monotone (a
// running max), as the Triton kernel reads them. One block a (group, 64 columns); its 4 row
// lanes take every 4th row and their sums add in lane order.
constexpr int SUM_COLUMNS = 64, SUM_LANES = 4;

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
