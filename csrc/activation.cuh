// The activations between FC1 and FC2 (compiled_moe/reference.py's activation), in fp32, shared
// by the kernels that apply them (the activation quantizer of grouped_quantize.cu, the row
// kernels of moe_rows.cu). Codes: kernels/activations.py's CODES.
#pragma once

// The Triton activation kernel's sigmoid: ex2.approx and an approximate reciprocal (the
// correctly rounded expf and division made the kernel 0.73x the speed of the two launches it
// replaces at GPT-OSS's shape, where the activation's ALU work, on the quantizer's consumer
// warps, sets the pace). 1 / (1 + Inf) is 0: sigmoid of a large negative x is 0, as it should.
__device__ __forceinline__ float sigmoid_fast(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}

// act(g, u) in fp32 (u unused by the activations without gate). NaN stays NaN, as in torch.
template <int CODE>
__device__ __forceinline__ float activate(float g, float u, float alpha, float limit) {
  if (CODE == 0) return g * sigmoid_fast(g) * u;  // swiglu
  if (CODE == 1) {                                // geglu (tanh gelu, tanh z = 2 sigmoid(2z) - 1)
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + (2.0f * sigmoid_fast(2.0f * z) - 1.0f)) * u;
  }
  if (CODE == 2) {  // gpt_oss: gate clamped above, up both ways
    const float gc = g > limit ? limit : g;
    const float uc = u > limit ? limit : (u < -limit ? -limit : u);
    return gc * sigmoid_fast(alpha * gc) * (uc + 1.0f);
  }
  if (CODE == 3) {  // relu2 (exact: the square of a 16-bit value fits fp32's significand)
    const float r = g < 0.0f ? 0.0f : g;
    return r * r;
  }
  if (CODE == 4) return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));  // gelu (erf)
  return g * sigmoid_fast(g);                                                // silu
}
