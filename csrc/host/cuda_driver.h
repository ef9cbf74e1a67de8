// The CUDA driver API as the C++ host layer uses it: entry points looked up in libcuda at run
// time (no link-time dependency, no CUDA toolkit: cuda.h comes from the nvidia-cuda-runtime
// wheel), the primary context made current per thread, torch's current stream, a cache of TMA
// descriptors, and kernel launches.
//
// Host code only; the kernels are csrc/*.cu, compiled by NVRTC (compiled_moe/native.py), whose
// CUfunction handles reach this layer as integers.
#pragma once

#include <cuda.h>

#include <array>
#include <cstdint>

#include "text.h"

namespace compiled_moe {

// Raises a RuntimeError naming `what` and the driver's error name unless `result` is success.
void check_cuda(CUresult result, const char* what);

// Makes the primary context of `device` (the one torch uses) current on this thread, once per
// thread and device: autograd's backward thread may have none, and every driver call needs it.
void ensure_context(int device);

// torch's current stream on `device`, through c10's device-guard interface (libc10 only).
CUstream current_stream(int device);

// A tiled TMA descriptor over `rank` dimensions (innermost first), byte strides of
// dims[1..rank), box in elements, the 128-byte swizzle unless told otherwise; cached by all of
// its parameters (a step reuses its buffers: 0.14 against 5.5 us to encode, H200 host).
struct TensorMapKey {
  uint64_t address;
  std::array<uint64_t, 3> dims;
  std::array<uint64_t, 2> strides;
  std::array<uint32_t, 3> box;
  uint32_t rank;
  CUtensorMapDataType data_type;
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  bool operator==(const TensorMapKey& o) const;
};
CUtensorMap tensor_map(const TensorMapKey& key);

// Launches `function` on torch's current stream of `device` with `args` (pointers to each
// kernel parameter, as cuLaunchKernel takes them).
void launch(int device, CUfunction function, unsigned grid, unsigned block, unsigned shared_bytes,
            void** args);

}  // namespace compiled_moe
