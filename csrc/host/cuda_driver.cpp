// Without cuda.h (a build for CPU only) this file compiles to nothing.
#if __has_include(<cuda.h>)
#include "cuda_driver.h"

#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <bitset>
#include <mutex>
#include <unordered_map>

namespace compiled_moe {
namespace {

// cuda.h maps some names to versioned entry points (cuCtxCreate -> cuCtxCreate_v4); the symbol
// looked up must be the macro-expanded one.
#define CM_STRINGIFY(x) #x
#define CM_SYMBOL(x) CM_STRINGIFY(x)

struct Driver {
  decltype(&cuGetErrorName) get_error_name = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) primary_ctx_retain = nullptr;
  decltype(&cuCtxSetCurrent) ctx_set_current = nullptr;
  decltype(&cuTensorMapEncodeTiled) tensor_map_encode_tiled = nullptr;
  decltype(&cuLaunchKernel) launch_kernel = nullptr;
};

template <typename F>
void load(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(fn != nullptr, cat("compiled_moe: libcuda has no ", name));
}

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, cat("compiled_moe: cannot load libcuda.so.1 (", dlerror(), ")"));
    Driver d;
    load(lib, d.get_error_name, CM_SYMBOL(cuGetErrorName));
    load(lib, d.primary_ctx_retain, CM_SYMBOL(cuDevicePrimaryCtxRetain));
    load(lib, d.ctx_set_current, CM_SYMBOL(cuCtxSetCurrent));
    load(lib, d.tensor_map_encode_tiled, CM_SYMBOL(cuTensorMapEncodeTiled));
    load(lib, d.launch_kernel, CM_SYMBOL(cuLaunchKernel));
    return d;
  }();
  return d;
}

struct TensorMapHash {
  size_t operator()(const TensorMapKey& k) const {
    size_t h = std::hash<uint64_t>()(k.address);
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (auto v : k.dims) mix(v);
    for (auto v : k.strides) mix(v);
    for (auto v : k.box) mix(v);
    mix(k.rank);
    mix(static_cast<uint64_t>(k.data_type));
    mix(static_cast<uint64_t>(k.swizzle));
    return h;
  }
};

// About 20 descriptors per MoE layer and training step; 8192 hold a step of a few hundred
// layers. Past that the cache starts over (a step re-encodes at most once).
constexpr size_t kMaxTensorMaps = 8192;

}  // namespace

void check_cuda(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* name = "unknown error";
  if (driver().get_error_name != nullptr) driver().get_error_name(result, &name);
  TORCH_CHECK(false, cat("compiled_moe: ", what, " failed (", name, ": ", static_cast<int>(result), ")"));
}

void ensure_context(int device) {
  thread_local std::bitset<64> done;
  TORCH_CHECK(device >= 0 && device < 64, cat("compiled_moe: device index ", device, " out of range"));
  if (done.test(device)) return;
  CUcontext ctx = nullptr;
  check_cuda(driver().primary_ctx_retain(&ctx, device), "cuDevicePrimaryCtxRetain");
  check_cuda(driver().ctx_set_current(ctx), "cuCtxSetCurrent");
  done.set(device);
}

CUstream current_stream(int device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Stream stream = impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return static_cast<CUstream>(impl->getStreamNativeHandle(stream));
}

bool TensorMapKey::operator==(const TensorMapKey& o) const {
  return address == o.address && dims == o.dims && strides == o.strides && box == o.box &&
         rank == o.rank && data_type == o.data_type && swizzle == o.swizzle;
}

CUtensorMap tensor_map(const TensorMapKey& key) {
  static std::mutex mutex;  // autograd's backward thread encodes too
  static std::unordered_map<TensorMapKey, CUtensorMap, TensorMapHash> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= kMaxTensorMaps) cache.clear();
  CUtensorMap map;
  cuuint64_t dims[3], strides[2];
  cuuint32_t box[3], element_strides[3] = {1, 1, 1};
  for (uint32_t i = 0; i < key.rank; ++i) {
    dims[i] = key.dims[i];
    box[i] = key.box[i];
    if (i + 1 < key.rank) strides[i] = key.strides[i];
  }
  CUresult result = driver().tensor_map_encode_tiled(
      &map, key.data_type, key.rank, reinterpret_cast<void*>(key.address), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, key.swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    check_cuda(result, (std::string("cuTensorMapEncodeTiled for dims (") + std::to_string(key.dims[0]) +
                        ", " + std::to_string(key.dims[1]) + ", " + std::to_string(key.dims[2]) + ")")
                           .c_str());
  }
  return cache.emplace(key, map).first->second;
}

void launch(int device, CUfunction function, unsigned grid, unsigned block, unsigned shared_bytes,
            void** args) {
  check_cuda(driver().launch_kernel(function, grid, 1, 1, block, 1, 1, shared_bytes,
                                    current_stream(device), args, nullptr),
             "cuLaunchKernel");
}

}  // namespace compiled_moe

#endif  // __has_include(<cuda.h>)
