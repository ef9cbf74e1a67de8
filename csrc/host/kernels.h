// The NVRTC kernels the C++ host layer launches outside the GEMMs (csrc/moe_route.cu,
// csrc/moe_rows.cu): their handles on a device, asked of Python once per device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <torch/extension.h>

#include "../row_args.cuh"
#include "cuda_driver.h"

namespace compiled_moe {

// The handles of the route kernels (csrc/moe_route.cu) and of the experts block's row kernels
// (csrc/moe_rows.cu) on a device, asked of Python once per device (compiled_moe/host.py's
// route_kernels and row_kernels, {kernel name: handle}, read by name): moe_route needs only the first, so it runs where the row
// kernels would not compile (before sm_80).
struct RouteKernels {
  CUfunction rank[2], place[2];  // by id dtype: int32, int64
  static pybind11::object& ask() {
    static pybind11::object* fn = new pybind11::object();
    return *fn;
  }
  static RouteKernels read(const pybind11::object& answer) {
    auto d = answer.cast<pybind11::dict>();
    auto f = [&d](const char* name) { return reinterpret_cast<CUfunction>(d[name].cast<int64_t>()); };
    return {{f("moe_route_rank_i32"), f("moe_route_rank_i64")}, {f("moe_route_place_i32"), f("moe_route_place_i64")}};
  }
};

// The row kernels need sm_80 (bf16 conversions): before it, Python answers None and the row
// ops' Python kernels serve (available false). Python answers {kernel name: handle, "sms": SM
// count}, read here by name (host.py's row_kernels lists the names from the file).
struct RowKernels {
  bool available;
  CUfunction gather, combine, activation, activation_backward, grouped_sum;
  unsigned sms;
  static pybind11::object& ask() {
    static pybind11::object* fn = new pybind11::object();
    return *fn;
  }
  static RowKernels read(const pybind11::object& answer) {
    if (answer.is_none()) return {};
    auto d = answer.cast<pybind11::dict>();
    auto f = [&d](const char* name) { return reinterpret_cast<CUfunction>(d[name].cast<int64_t>()); };
    return {true,
            f("moe_gather_rows"),
            f("moe_combine_rows"),
            f("moe_activation_rows"),
            f("moe_activation_backward_rows"),
            f("grouped_sum_rows"),
            static_cast<unsigned>(d["sms"].cast<int64_t>())};
  }
};

template <typename Kernels>
inline const Kernels& device_kernels(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, Kernels> kernels;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = kernels.find(device);
    if (it != kernels.end()) return it->second;
  }
  Kernels k;
  {
    pybind11::gil_scoped_acquire gil;
    k = Kernels::read(Kernels::ask()(device));
  }
  std::lock_guard<std::mutex> lock(mutex);
  return kernels.emplace(device, k).first->second;
}

// csrc/moe_rows.cu's element kind of a dtype (row_args.cuh's RowElementKind); kRowNone for the
// dtypes the row kernels do not take.
inline int element_kind(c10::ScalarType t) {
  return t == c10::kBFloat16 ? kRowBF16 : t == c10::kHalf ? kRowF16 : t == c10::kFloat ? kRowF32 : kRowNone;
}

inline unsigned grid_for(int64_t elements, unsigned sms) {  // grid-stride kernels: up to 8 blocks an SM
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((elements + 255) / 256, 8 * sms)));
}

}  // namespace compiled_moe
