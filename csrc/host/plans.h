// The C++ host layer's per-shape decisions: what Python answers on an op's first call at a
// shape (whether a CUDA kernel applies, and its launch plan), kept for the later calls.
#pragma once

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>

#ifdef COMPILED_MOE_CUDA
#include "cuda_driver.h"
#endif

namespace compiled_moe {

// What a shape decides (kernel or not, and the plan), keyed by everything the decision reads.
struct ShapeKey {
  std::array<int64_t, 13> v;
  bool operator==(const ShapeKey& o) const { return v == o.v; }
};
struct ShapeKeyHash {
  size_t operator()(const ShapeKey& k) const {
    size_t h = 0;
    for (auto x : k.v) h ^= std::hash<int64_t>()(x) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};
inline constexpr size_t kMaxDecisions = 8192;

// The plans Python hands this layer: what a launch needs beyond its tensors (kernel handles,
// launch sizes, the heuristics' choices), fixed for a problem's shape. Each plan is one list of
// fields, written only here: this layer reads a plan's fields by these names (Plan::read), and
// Python builds its plan types from the same lists (compiled_moe/host.py's plan_type parses
// this file). A field one side renames or drops fails by name, never as a shifted position.
// Types: a CUfunction is an integer handle in Python; integers must fit their C++ type.
// (Each line: F(type, name); tests/test_host.py round-trips every plan through this layer.)

// kernels/grouped_mm_sm90.py: forward and dgrad (csrc/grouped_mm.cu).
#define COMPILED_MOE_GROUPED_MM_PLAN(F)                                           \
  F(CUfunction, function)   /* the main kernel */                                  \
  F(CUfunction, split_sum)  /* grouped_mm_split_sum, or 0 without split K */       \
  F(unsigned, grid)       /* persistent: one block per SM */                     \
  F(unsigned, shared_bytes)                                                      \
  F(int, num_stages)                                                             \
  F(int, max_splits)      /* the most k ranges a tile (1: no split K) */         \
  F(int, forced_splits)   /* 1 where the caller forced the split count */        \
  F(int, skipping)        /* the skipping instantiation (64- and 16-row boxes) */ \
  F(unsigned, split_sum_grid)

// kernels/grouped_mm_sm90.py: the weight gradient's two kernels and their tile order.
#define COMPILED_MOE_GROUPED_MM_WGRAD_PLAN(F)                                  \
  F(CUfunction, function)                                                       \
  F(CUfunction, claimed)     /* its _claimed twin (tiles claimed at run time) */ \
  F(CUfunction, tile_order)  /* wgrad_tile_order */                             \
  F(unsigned, grid)                                                           \
  F(unsigned, shared_bytes)                                                   \
  F(int, num_stages)                                                          \
  F(int, tiles_per_group)

// kernels/scaled_grouped_mm_sm90.py: the FP8 forward (csrc/fp8_grouped_mm.cu).
#define COMPILED_MOE_SCALED_GROUPED_MM_PLAN(F) \
  F(CUfunction, function)                       \
  F(unsigned, grid)                           \
  F(unsigned, shared_bytes)                   \
  F(int, num_stages)

// kernels/scaled_grouped_mm_sm90.py: the FP8 weight gradient.
#define COMPILED_MOE_SCALED_GROUPED_MM_WGRAD_PLAN(F) \
  F(CUfunction, function)                             \
  F(CUfunction, claimed)                              \
  F(CUfunction, tile_order)                           \
  F(unsigned, grid)                                 \
  F(unsigned, shared_bytes)                         \
  F(int, num_stages)                                \
  F(int, tiles_per_group)                           \
  F(int, claim_steps)

// kernels/quantize_cuda.py: columnwise (and both-ways) quantize, and activate_quantize.
#define COMPILED_MOE_QUANTIZE_COLUMNS_PLAN(F) \
  F(CUfunction, function)                      \
  F(unsigned, grid)                          \
  F(unsigned, threads)                       \
  F(unsigned, shared_bytes)                  \
  F(int, num_stages)                         \
  F(int, group_m)        /* rows per band */ \
  F(int64_t, slots)

// kernels/quantize_cuda.py: rowwise-only quantize.
#define COMPILED_MOE_QUANTIZE_ROWS_PLAN(F) \
  F(CUfunction, function)                   \
  F(unsigned, sms)

#define COMPILED_MOE_PLANS(PLAN)                                \
  PLAN(GroupedMmPlan, COMPILED_MOE_GROUPED_MM_PLAN)             \
  PLAN(GroupedMmWgradPlan, COMPILED_MOE_GROUPED_MM_WGRAD_PLAN)  \
  PLAN(ScaledGroupedMmPlan, COMPILED_MOE_SCALED_GROUPED_MM_PLAN) \
  PLAN(ScaledGroupedMmWgradPlan, COMPILED_MOE_SCALED_GROUPED_MM_WGRAD_PLAN) \
  PLAN(QuantizeColumnsPlan, COMPILED_MOE_QUANTIZE_COLUMNS_PLAN) \
  PLAN(QuantizeRowsPlan, COMPILED_MOE_QUANTIZE_ROWS_PLAN)

#ifdef COMPILED_MOE_CUDA
// Field `name` of Python's plan p, as T: a handle, or an integer that must fit T.
template <typename T>
T plan_field(const pybind11::handle& p, const char* plan, const char* name) {
  if (!pybind11::hasattr(p, name))
    throw pybind11::type_error(std::string(plan) + " has no field '" + name + "' (csrc/host/plans.h)");
  const int64_t value = p.attr(name).cast<int64_t>();
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(value);
  } else {
    if (static_cast<int64_t>(static_cast<T>(value)) != value)
      throw pybind11::value_error(std::string(plan) + "." + name + " = " + std::to_string(value) +
                                  " does not fit its C++ type");
    return static_cast<T>(value);
  }
}

template <typename T>
int64_t plan_value(T v) {
  if constexpr (std::is_pointer_v<T>) return reinterpret_cast<int64_t>(v);
  else return static_cast<int64_t>(v);
}

#define COMPILED_MOE_PLAN_DECLARE(type, name) type name;
#define COMPILED_MOE_PLAN_READ(type, name) plan.name = plan_field<type>(p, kName, #name);
#define COMPILED_MOE_PLAN_TO_DICT(type, name) d[#name] = plan_value(name);
#define COMPILED_MOE_PLAN_STRUCT(Name, FIELDS)            \
  struct Name {                                         \
    FIELDS(COMPILED_MOE_PLAN_DECLARE)                   \
    static constexpr const char* kName = #Name;         \
    static Name read(const pybind11::handle& p) {       \
      Name plan;                                        \
      FIELDS(COMPILED_MOE_PLAN_READ)                    \
      return plan;                                      \
    }                                                   \
    pybind11::dict to_dict() const {                    \
      pybind11::dict d;                                 \
      FIELDS(COMPILED_MOE_PLAN_TO_DICT)                 \
      return d;                                         \
    }                                                   \
  };
COMPILED_MOE_PLANS(COMPILED_MOE_PLAN_STRUCT)
#endif

// The decisions of one op, per shape: a plan, or none where its CUDA kernel does not apply.
// A miss asks Python (under the GIL) once; prompts of many lengths fill it, so past
// kMaxDecisions it starts over.
template <typename Plan>
class PlanCache {
 public:
  template <typename Ask>
  std::optional<Plan> get(const ShapeKey& key, Ask ask) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    std::optional<Plan> plan;
    {
      pybind11::gil_scoped_acquire gil;
      pybind11::object p = ask();
      if (!p.is_none()) plan = Plan::read(p);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (plans_.size() >= kMaxDecisions) plans_.clear();
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<ShapeKey, std::optional<Plan>, ShapeKeyHash> plans_;
};

}  // namespace compiled_moe
