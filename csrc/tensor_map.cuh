// The driver's CUtensorMap as the kernels' arguments carry it: 128 opaque bytes, 64-byte
// aligned, in parameter space (a `const __grid_constant__` parameter or a field of one). The
// host layer copies its encoded CUtensorMap in (csrc/host/hopper.h: as_arg).
#pragma once

struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

static_assert(sizeof(TensorMap) == 128 && alignof(TensorMap) == 64, "TensorMap: a CUtensorMap");
