// What the Hopper GEMM launches of the C++ host layer share (ops.cpp's bf16 GEMMs, fp8.cpp's
// FP8 GEMM): the kernels' block size and output kinds, the tensor maps' element types, 2-D
// byte maps and TMA's alignment rule.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>

#include "../sm90_launch.cuh"
#include "cuda_driver.h"

namespace compiled_moe {

// (Block sizes and wgrad_tile_order's shared memory: csrc/sm90_launch.cuh.)

inline int out_kind(c10::ScalarType t) {  // the kernels' output (and bias) kinds
  return t == c10::kBFloat16 ? 0 : t == c10::kHalf ? 1 : 2;
}

inline CUtensorMapDataType out_map_type(c10::ScalarType t) {
  return t == c10::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
         : t == c10::kHalf   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                             : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

// A 2-D map of rows of bytes (the operands are read as bytes: 2 a bf16/fp16 element, 1 an e4m3).
inline CUtensorMap map2d(uint64_t address, uint64_t cols_bytes, uint64_t rows, uint64_t row_stride_bytes,
                         uint32_t box_cols, uint32_t box_rows,
                         CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  return tensor_map({address, {cols_bytes, rows, 0}, {row_stride_bytes, 0}, {box_cols, box_rows, 0}, 2,
                     CU_TENSOR_MAP_DATA_TYPE_UINT8, swizzle});
}

// TMA: base addresses (and strides, which the ops' supported() checks) of 16-byte multiples.
inline bool tma_aligned(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    if (reinterpret_cast<uint64_t>(t->data_ptr()) % 16 != 0) return false;
  return true;
}

// A bias whose rows start on even elements: the bias, or a contiguous copy (the kernels copy
// each thread's two bias columns as one 4- or 8-byte piece).
inline at::Tensor bias_in_pairs(const std::optional<at::Tensor>& bias) {
  if (!bias) return at::Tensor();
  if (bias->stride(0) % 2 || reinterpret_cast<uint64_t>(bias->data_ptr()) % (2 * bias->element_size()))
    return bias->clone(at::MemoryFormat::Contiguous);
  return *bias;
}

}  // namespace compiled_moe
