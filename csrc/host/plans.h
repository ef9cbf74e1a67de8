// The C++ host layer's per-shape decisions: what Python answers on an op's first call at a
// shape (whether a CUDA kernel applies, and its launch plan), kept for the later calls.
#pragma once

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <unordered_map>

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
      if (!p.is_none()) plan = read(p);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (plans_.size() >= kMaxDecisions) plans_.clear();
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  static Plan read(const pybind11::handle& p);
  std::mutex mutex_;
  std::unordered_map<ShapeKey, std::optional<Plan>, ShapeKeyHash> plans_;
};

// Each op reads its Plan from Python's answer (a tuple): PlanCache<Plan>::read is specialized
// beside the op.

}  // namespace compiled_moe
