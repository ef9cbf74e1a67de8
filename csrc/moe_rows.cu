// Row kernels of the experts block for the C++ host layer's one-call forward
// (csrc/host/ops.cpp, moe_experts_forward): the gather of token rows into expert-sorted rows,
// the activation between the two GEMMs, and the weighted combine. Their oracles are
// compiled_moe/reference.py's moe_permute, activation and moe_unpermute; the Triton kernels of
// kernels/routing.py and kernels/activations.py do the same inside compiled graphs.
//
// 16-bit element kinds: 0 bf16, 1 fp16 (2 fp32, routing weights only). Grid-stride loops over
// the elements; the block is memory-bound at every size it runs (a few tokens to a few
// thousand), and what matters here is the host time of one launch each.

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

// x[r] = hidden[source[r] / top_k]; rows whose source is not a pair in [0, num_pairs) (padding:
// moe_route marks them -1) are zero. Rows move as 16-byte chunks: chunks = H * 2 / 16, and the
// host checks hidden's row stride (in chunks) and addresses.
extern "C" __global__ void moe_gather_rows(const uint4* __restrict__ hidden, long long hidden_stride,
                                           const int* __restrict__ source, uint4* __restrict__ x, long long rows,
                                           int chunks, int top_k, long long num_pairs) {
  const long long total = rows * chunks;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / chunks;
    const int c = (int)(i - r * chunks);
    const int s = source[r];
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (s >= 0 && s < num_pairs) v = hidden[(long long)(s / top_k) * hidden_stride + c];
    x[i] = v;
  }
}

template <int CODE>
__device__ __forceinline__ void activation_rows(const u16* __restrict__ h, long long h_stride, u16* __restrict__ a,
                                                long long rows, int inter, int kind, int interleaved, float alpha,
                                                float limit) {
  const long long total = rows * inter;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / inter;
    const int j = (int)(i - r * inter);
    const u16* row = h + r * h_stride;
    float g, u = 0.0f;
    if (CODE <= 2) {  // gated: [gate | up] halves, or g0 u0 g1 u1 ...
      g = to_float(row[interleaved ? 2 * j : j], kind);
      u = to_float(row[interleaved ? 2 * j + 1 : inter + j], kind);
    } else {
      g = to_float(row[j], kind);
    }
    a[i] = from_float(activate<CODE>(g, u, alpha, limit), kind);
  }
}

// a (rows, inter) = act(h) for h (rows, N1) with row stride h_stride; code: activations.py's CODES.
extern "C" __global__ void moe_activation_rows(const u16* __restrict__ h, long long h_stride, u16* __restrict__ a,
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

// out[t] = sum over slots s (in order) of weights[t, s] * y[row_of[t, s]], in fp32; slots whose
// row_of names no row of y (dropped pairs: -1) count 0. weights (T, k) contiguous, of weight_kind.
extern "C" __global__ void moe_combine_rows(const u16* __restrict__ y, long long y_rows, const int* __restrict__ row_of,
                                            const void* __restrict__ weights, int weight_kind, u16* __restrict__ out,
                                            long long tokens, int top_k, int hidden, int kind) {
  const long long total = tokens * hidden;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / hidden;
    const int c = (int)(i - t * hidden);
    float acc = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      const long long pair = t * top_k + s;
      const int r = row_of[pair];
      if (r < 0 || r >= y_rows) continue;
      const float w = weight_kind == 2 ? ((const float*)weights)[pair] : to_float(((const u16*)weights)[pair], weight_kind);
      acc += w * to_float(y[(long long)r * hidden + c], kind);
    }
    out[i] = from_float(acc, kind);
  }
}
