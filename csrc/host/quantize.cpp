// The C++ host layer's grouped_quantize: the CUDA kernels of the FP8 step's activation
// quantizations, 2-D x to fp8_blockwise, with columnwise output (and rowwise in the same launch:
// a training step's) or rowwise only (the forward's), from the dispatcher to the driver without
// Python: checks with the Python messages, the outputs in the layouts of
// compiled_moe/ops/fp8.py's _quantize_outputs, and the launch of csrc/grouped_quantize.cu's
// kernels, whose plans kernels/quantize_cuda.py gives once per shape (host_plan) or per dtype
// (host_rows_plan). Every other call (3-D weights, other recipes, float64, x not taken by the
// kernels) goes to the op's Python kernel.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "bindings.h"
#include "checks.h"

#if __has_include(<cuda.h>)
#define COMPILED_MOE_CUDA 1
#include "cuda_driver.h"
#include "kernels.h"
#include "plans.h"
#endif

namespace compiled_moe {

constexpr std::array<const char*, 3> kRecipes = {"fp8_rowwise", "fp8_blockwise", "mxfp8"};  // reference.FP8_RECIPES

// compiled_moe/ops/fp8.py's _check_quantize.
void check_grouped_quantize(const at::Tensor& x, const std::optional<at::Tensor>& offs, const std::string& recipe,
                            bool rowwise, bool columnwise) {
  CM_CHECK_VALUE(recipe == kRecipes[0] || recipe == kRecipes[1] || recipe == kRecipes[2], "recipe must be one of ",
                 py_tuple(kRecipes), ", got ", py_repr(recipe));
  CM_CHECK_VALUE(x.dim() == 2 || x.dim() == 3,
                 "x must be 2-D (M, K) activations or 3-D (G, N, K) weights, got shape ", shape_str(x.sym_sizes()));
  check_tensor("x", x, x.dim());
  CM_CHECK_VALUE(rowwise || columnwise, "ask for rowwise and/or columnwise output");
  if (x.dim() == 3) {
    CM_CHECK_VALUE(!offs, "offs must be None for 3-D x (its groups are the leading dimension)");
    return;
  }
  if (!offs) {
    CM_CHECK_VALUE(!columnwise, "offs is required for columnwise quantization of 2-D x: columnwise blocks stop at "
                                "group ends");
    return;
  }
  check_offs(*offs);
  check_same_device("x", x, "offs", *offs);
}

#ifdef COMPILED_MOE_CUDA
namespace {

// kernels/quantize_cuda.py's ColumnsPlan, read once per shape.
struct ColumnsPlan {
  CUfunction function;
  unsigned grid, threads, shared_bytes;
  int num_stages, group_m;
  int64_t slots;
};

pybind11::object& columns_plan() {  // kernels/quantize_cuda.py's host_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
// kernels/quantize_cuda.py's host_rows_plan: the rowwise kernel of a dtype on a device.
struct RowsPlan {
  CUfunction function;
  unsigned sms;
};

pybind11::object& rows_plan() {  // kernels/quantize_cuda.py's host_rows_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& python_kernel() {  // the op's Python kernel
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

}  // namespace

template <>
ColumnsPlan PlanCache<ColumnsPlan>::read(const pybind11::handle& p) {
  auto t = p.cast<pybind11::tuple>();
  auto i = [&t](int k) { return t[k].cast<int64_t>(); };
  return {reinterpret_cast<CUfunction>(i(0)), static_cast<unsigned>(i(1)), static_cast<unsigned>(i(2)),
          static_cast<unsigned>(i(3)), static_cast<int>(i(4)), static_cast<int>(i(5)), i(6)};
}

template <>
RowsPlan PlanCache<RowsPlan>::read(const pybind11::handle& p) {
  auto t = p.cast<pybind11::tuple>();
  return {reinterpret_cast<CUfunction>(t[0].cast<int64_t>()), static_cast<unsigned>(t[1].cast<int64_t>())};
}

namespace {

// row_q (M, K) e4m3 and row_s (M, ceil(K / 128)) fp32 of 2-D x with unit column stride.
Outputs quantize_rows(const at::Tensor& x, const RowsPlan& plan) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto fp8 = x.options().dtype(at::kFloat8_e4m3fn), fp32 = x.options().dtype(at::kFloat);
  at::Tensor row_q = at::empty({M, K}, fp8), row_s = at::empty({M, (K + 127) / 128}, fp32);
  const Outputs out{row_q, row_s, at::empty({0}, fp8), at::empty({0}, fp32)};
  if (row_q.numel() == 0) return out;
  const int device = x.device().index();
  ensure_context(device);
  const void* x_p = x.data_ptr();
  void *q_p = row_q.data_ptr(), *s_p = row_s.data_ptr();
  int64_t x_stride = x.stride(0), m = M, q_stride = row_q.stride(0), s_0 = row_s.stride(0), s_1 = row_s.stride(1);
  int32_t k = static_cast<int32_t>(K);
  void* args[] = {&x_p, &x_stride, &m, &k, &q_p, &q_stride, &s_p, &s_0, &s_1};
  launch(device, plan.function, grid_for(M * ((K + 127) / 128) * 32, plan.sms), 256, 0, args);  // a warp a block
  return out;
}

// The plan of 2-D x at its shape, or none where the CUDA kernel does not take it.
std::optional<ColumnsPlan> plan_for(const at::Tensor& x, const at::Tensor& offs, bool rowwise) {
  static PlanCache<ColumnsPlan> plans;
  const ShapeKey key{{x.size(0), x.size(1), offs.size(0), x.stride(0), x.stride(1), static_cast<int64_t>(x.scalar_type()),
                      rowwise, x.device().index(), 0, 0, 0, 0, 0}};
  return plans.get(key, [&] { return columns_plan()(x, offs, rowwise); });
}

Outputs grouped_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& offs, const std::string& recipe,
                              bool rowwise, bool columnwise) {
  check_grouped_quantize(x, offs, recipe, rowwise, columnwise);
  c10::DeviceGuard guard(x.device());
  const bool blockwise_2d = x.dim() == 2 && recipe == kRecipes[1] && x.scalar_type() != at::kDouble;
  if (blockwise_2d && !columnwise && x.stride(1) == 1) {
    static PlanCache<RowsPlan> rows_plans;
    const ShapeKey key{{static_cast<int64_t>(x.scalar_type()), x.device().index(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
    if (std::optional<RowsPlan> rows = rows_plans.get(key, [&] { return rows_plan()(x); })) return quantize_rows(x, *rows);
  }
  std::optional<ColumnsPlan> plan;
  if (blockwise_2d && columnwise && reinterpret_cast<uint64_t>(x.data_ptr()) % 16 == 0)
    plan = plan_for(x, *offs, rowwise);
  if (!plan) {
    pybind11::gil_scoped_acquire gil;
    return python_kernel()(x, offs, recipe, rowwise, columnwise).cast<Outputs>();
  }
  // ops/fp8.py's _quantize_outputs: e4m3 data, fp32 scales; columnwise data (K, M) with rows
  // padded to 16 bytes (TMA), columnwise scales (K, slots) with K contiguous; an output not
  // asked for is empty.
  const int64_t M = x.size(0), K = x.size(1), G = offs->size(0);
  const auto fp8 = x.options().dtype(at::kFloat8_e4m3fn), fp32 = x.options().dtype(at::kFloat);
  at::Tensor col_q = at::empty_strided({K, M}, {(M + 15) / 16 * 16, 1}, fp8);
  at::Tensor col_s = at::empty({plan->slots, K}, fp32).t();
  at::Tensor row_q = rowwise ? at::empty({M, K}, fp8) : at::empty({0}, fp8);
  at::Tensor row_s = rowwise ? at::empty({M, (K + 127) / 128}, fp32) : at::empty({0}, fp32);
  if (K == 0) return {row_q, row_s, col_q, col_s};
  const int device = x.device().index();
  ensure_context(device);
  const at::Tensor offs_c = offs->contiguous();
  const at::Tensor& rq = rowwise ? row_q : col_q;  // unused pointers when not rowwise
  const at::Tensor& rs = rowwise ? row_s : col_s;
  const void *x_p = x.data_ptr(), *offs_p = offs_c.data_ptr();
  void *col_q_p = col_q.data_ptr(), *col_s_p = col_s.data_ptr(), *rq_p = rq.data_ptr(), *rs_p = rs.data_ptr();
  int64_t x_stride = x.stride(0), col_q_stride = col_q.stride(0), col_s_0 = col_s.stride(0), col_s_1 = col_s.stride(1),
          rq_stride = rq.stride(0), rs_0 = rs.stride(0), rs_1 = rs.stride(1);
  int32_t m = static_cast<int32_t>(M), k = static_cast<int32_t>(K), g = static_cast<int32_t>(G),
          s = static_cast<int32_t>(plan->slots), group_m = plan->group_m, stages = plan->num_stages;
  void* args[] = {&x_p,    &x_stride,     &offs_p,  &m,       &k,       &g,    &s,     &group_m, &stages, &col_q_p,
                  &col_q_stride, &col_s_p, &col_s_0, &col_s_1, &rq_p, &rq_stride, &rs_p, &rs_0,    &rs_1};
  launch(device, plan->function, plan->grid, plan->threads, plan->shared_bytes, args);
  return {row_q, row_s, col_q, col_s};
}

torch::Library& library() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "compiled_moe", std::nullopt, __FILE__, __LINE__);
  return *lib;
}

}  // namespace
#endif  // COMPILED_MOE_CUDA

// compiled_moe::grouped_quantize's CUDA kernel: plan(x, offs, rowwise) gives the columnwise
// kernel's plan for 2-D fp8_blockwise x, or None; rows(x) the rowwise kernel's of x's dtype and
// device, or None; python_kernel(x, offs, recipe, rowwise, columnwise) serves the rest. Returns
// the dispatch keys registered.
std::vector<std::string> register_grouped_quantize(pybind11::object plan, pybind11::object rows,
                                                   pybind11::object python_kernel_fn) {
#ifdef COMPILED_MOE_CUDA
  columns_plan() = std::move(plan);
  rows_plan() = std::move(rows);
  python_kernel() = std::move(python_kernel_fn);
  library().impl("grouped_quantize", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(grouped_quantize_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

void bind_quantize(pybind11::module_& m) {
  m.def("register_grouped_quantize", &register_grouped_quantize);
  // The checks alone (the CUDA kernel makes them), for tests on any machine.
  m.def("check_grouped_quantize", &check_grouped_quantize);
}

}  // namespace compiled_moe
