// The C++ host layer's GEMM and routing ops, and its extension module: what an eager call of
// torch.ops.compiled_moe.grouped_mm, grouped_mm_wgrad, grouped_mm_wgrad_accumulate_ and
// moe_route runs, from the dispatcher to the driver without Python (argument checks, autograd,
// the device guard, tensor maps, the launch on torch's current stream), and the experts block
// as one call forward and one backward. The row ops are in rows.cpp, the FP8 ops in fp8.cpp.
//
// Python keeps what a compiled graph needs (schemas, fake functions, the traced bodies that
// inductor inlines, the CPU reference) and what is chosen once per problem shape: whether the
// Hopper kernel applies and its launch plan (kernels/grouped_mm_sm90.py's forward_plan and
// wgrad_plan, whose heuristics live in kernels/configs.py). This layer asks Python for that
// decision on the first call at a shape and keeps it; later calls at that shape make no call
// into Python.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "checks.h"
#include "text.h"

#if __has_include(<cuda.h>)
#define COMPILED_MOE_CUDA 1
#include "cuda_driver.h"
#include "hopper.h"
#include "kernels.h"
#include "plans.h"
#endif

namespace compiled_moe {
namespace {

// compiled_moe/ops/grouped_mm.py's _check_grouped_mm.
void check_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                      const std::optional<at::Tensor>& bias, std::optional<c10::ScalarType> out_dtype) {
  check_tensor("a", a, 2);
  check_tensor("b", b, 3);
  check_same_dtype("a", a, "b", b);
  check_offs(offs, b.sym_size(0));
  check_same_device("a", a, "b", b);
  check_same_device("a", a, "offs", offs);
  if (bias) check_same_device("a", a, "bias", *bias);
  CM_CHECK_VALUE(a.sym_size(1) == b.sym_size(1), "a has K=", size_str(a.sym_size(1)), " columns but b is (G, K, N) = ",
                    shape_str(b.sym_sizes()), "; K must match (pass an (G, N, K) weight as w.transpose(-2, -1))");
  if (bias) {
    check_tensor("bias", *bias, 2);
    CM_CHECK_VALUE(bias->sym_size(0) == b.sym_size(0) && bias->sym_size(1) == b.sym_size(2),
                      "bias must have shape (G, N) = (", size_str(b.sym_size(0)), ", ", size_str(b.sym_size(2)), "), got ",
                      shape_str(bias->sym_sizes()));
  }
  check_out_dtype(out_dtype);
}

// compiled_moe/ops/grouped_mm.py's _check_wgrad (num_groups: the groups offs must have).
void check_wgrad(const at::Tensor& a, const at::Tensor& grad_out, const at::Tensor& offs,
                 const std::optional<c10::SymInt>& num_groups) {
  check_tensor("a", a, 2);
  check_tensor("grad_out", grad_out, 2);
  check_same_dtype("a", a, "grad_out", grad_out);
  if (num_groups) check_offs(offs, *num_groups);
  else check_offs(offs);
  check_same_device("a", a, "grad_out", grad_out);
  check_same_device("a", a, "offs", offs);
  CM_CHECK_VALUE(a.sym_size(0) == grad_out.sym_size(0), "a has ", size_str(a.sym_size(0)), " rows but grad_out has ",
                 size_str(grad_out.sym_size(0)), "; they must match");
}

// grouped_mm_wgrad's checks: _check_wgrad and check_out_dtype.
void check_grouped_mm_wgrad(const at::Tensor& a, const at::Tensor& grad_out, const at::Tensor& offs,
                            std::optional<c10::ScalarType> out_dtype) {
  check_wgrad(a, grad_out, offs, std::nullopt);
  check_out_dtype(out_dtype);
}

// compiled_moe/ops/grouped_mm.py's _check_wgrad_accumulate (with _check_wgrad and
// check_accumulate_mask).
void check_grouped_mm_wgrad_accumulate(const at::Tensor& main_grad, const at::Tensor& a, const at::Tensor& grad_out,
                                       const at::Tensor& offs, const std::optional<at::Tensor>& accumulate_mask) {
  check_tensor("main_grad", main_grad, 3);
  // (some elements share memory, e.g. an expanded tensor: the kernels' tiles would race)
  CM_CHECK_VALUE(at::has_internal_overlap(main_grad) != at::MemOverlap::Yes,
                 "main_grad must not have elements that share memory (an expand()ed tensor, for instance)");
  check_wgrad(a, grad_out, offs, main_grad.sym_size(0));
  check_same_device("a", a, "main_grad", main_grad);
  if (accumulate_mask) check_same_device("a", a, "accumulate_mask", *accumulate_mask);
  const std::vector<c10::SymInt> expected = {main_grad.sym_size(0), a.sym_size(1), grad_out.sym_size(1)};
  CM_CHECK_VALUE(main_grad.sym_sizes() == c10::SymIntArrayRef(expected), "main_grad must have shape (G, K, N) = ",
                 shape_str(expected), " (pass a (G, N, K) buffer as main_grad.transpose(-2, -1)), got ",
                 shape_str(main_grad.sym_sizes()));
  if (accumulate_mask) {
    check_dims("accumulate_mask", *accumulate_mask, 1);
    CM_CHECK_TYPE(accumulate_mask->scalar_type() == c10::kBool, "accumulate_mask must have dtype in (bool), got ",
                  dtype_name(accumulate_mask->scalar_type()));
    CM_CHECK_VALUE(accumulate_mask->sym_size(0) == main_grad.sym_size(0), "accumulate_mask must have shape (",
                   size_str(main_grad.sym_size(0)), ",), one entry per group, got ",
                   shape_str(accumulate_mask->sym_sizes()));
  }
}

// compiled_moe/ops/routing.py's _check_route.
constexpr int64_t kMaxExperts = 4096;  // routing.py's MAX_EXPERTS (the route kernels' shared memory)

void check_moe_route(const at::Tensor& topk_ids, int64_t num_experts, int64_t pad_multiple) {
  CM_CHECK_VALUE(topk_ids.dim() == 2, "topk_ids must be 2-D, got shape ", shape_str(topk_ids.sym_sizes()));
  CM_CHECK_TYPE(topk_ids.scalar_type() == c10::kInt || topk_ids.scalar_type() == c10::kLong,
                "topk_ids must have dtype in (int32, int64), got ", dtype_name(topk_ids.scalar_type()));
  CM_CHECK_VALUE(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts must be in [1, ", kMaxExperts,
                 "], got ", num_experts);
  CM_CHECK_VALUE(pad_multiple >= 1, "pad_multiple must be >= 1, got ", pad_multiple);
  if (auto n = topk_ids.sym_numel().maybe_as_int())
    CM_CHECK_VALUE(*n < (int64_t(1) << 31), "topk_ids has ", *n, " entries; at most 2**31 - 1 are supported");
}

// ------------------------------------------------------------------------------ dispatcher calls

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, std::optional<c10::ScalarType>)>&
grouped_mm_op() {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, std::optional<c10::ScalarType>)>(
      "compiled_moe::grouped_mm");
  return op;
}

at::Tensor grouped_mm_wgrad(const at::Tensor& a, const at::Tensor& grad_out, const at::Tensor& offs,
                            std::optional<c10::ScalarType> out_dtype) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         std::optional<c10::ScalarType>)>("compiled_moe::grouped_mm_wgrad");
  return op.call(a, grad_out, offs, out_dtype);
}

at::Tensor grouped_sum(const at::Tensor& x, const at::Tensor& offs, std::optional<c10::ScalarType> out_dtype) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, std::optional<c10::ScalarType>)>(
      "compiled_moe::grouped_sum");
  return op.call(x, offs, out_dtype);
}

// grad (G, P, Q) of a weight w of that shape from d_g^T @ a_g, in w's own storage order.
at::Tensor weight_grad(const at::Tensor& d, const at::Tensor& a, const at::Tensor& offs, const at::Tensor& w) {
  return is_transposed_weight(w) ? grouped_mm_wgrad(a, d, offs, w.scalar_type()).mT()
                                 : grouped_mm_wgrad(d, a, offs, w.scalar_type());
}

// ------------------------------------------------------------------------------ autograd
// compiled_moe/ops/grouped_mm.py's formula: dgrad is the same op on b's transpose (no copy),
// the weight gradient is written in the weight's own storage order, dbias a grouped sum.

class GroupedMmFunction : public torch::autograd::Function<GroupedMmFunction> {
 public:
  // bias as a list of zero or one tensors: autograd gives an optional<Tensor> argument no
  // gradient and takes no undefined tensor.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& offs, at::TensorList bias, std::optional<c10::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::optional<at::Tensor> maybe_bias = bias.empty() ? std::nullopt : std::optional<at::Tensor>(bias[0]);
    at::Tensor out = grouped_mm_op().call(a, b, offs, maybe_bias, out_dtype);
    ctx->save_for_backward({a, b, offs});
    ctx->saved_data["bias_dtype"] = bias.empty() ? int64_t(-1) : static_cast<int64_t>(bias[0].scalar_type());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1], &offs = saved[2];
    // Without create_graph nothing records the gradient's ops: they dispatch below autograd,
    // straight to their kernels (grouped_mm_wgrad's autograd formula is Python's).
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    at::Tensor grad = grads[0].to(a.scalar_type());
    at::Tensor grad_a, grad_b, grad_bias;
    if (ctx->needs_input_grad(0)) grad_a = grouped_mm_op().call(grad, b.mT(), offs, std::nullopt, std::nullopt);
    if (ctx->needs_input_grad(1)) grad_b = weight_grad(a, grad, offs, b);  // b[g] = a_g^T @ grad_g
    int64_t bias_dtype = ctx->saved_data["bias_dtype"].toInt();
    if (bias_dtype < 0) return {grad_a, grad_b, at::Tensor(), at::Tensor()};
    if (ctx->needs_input_grad(3)) grad_bias = grouped_sum(grad, offs, static_cast<c10::ScalarType>(bias_dtype));
    return {grad_a, grad_b, at::Tensor(), grad_bias, at::Tensor()};
  }
};

at::Tensor grouped_mm_autograd(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                               const std::optional<at::Tensor>& bias, std::optional<c10::ScalarType> out_dtype) {
  check_grouped_mm(a, b, offs, bias, out_dtype);
  std::vector<at::Tensor> bias_list;
  if (bias) bias_list.push_back(*bias);
  return GroupedMmFunction::apply(a, b, offs, at::TensorList(bias_list), out_dtype);
}

// compiled_moe::grouped_mm_wgrad_accumulate_'s autograd kernel, in place of its custom_op's
// Python autograd and in-place layers (21 us of a call's host time on the H200's host: 45.4
// against 24.4 us), doing what they do for this op: it returns nothing, so nothing is recorded;
// main_grad's version is bumped (as for any in-place write) and the call goes on below both
// layers to the device's kernel.
void grouped_mm_wgrad_accumulate_autograd(const at::Tensor& main_grad, const at::Tensor& a,
                                          const at::Tensor& grad_out, const at::Tensor& offs,
                                          const std::optional<at::Tensor>& accumulate_mask) {
  static auto op = package_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&)>("compiled_moe::grouped_mm_wgrad_accumulate_");
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.call(main_grad, a, grad_out, offs, accumulate_mask);
  }
  main_grad.unsafeGetTensorImpl()->bump_version();
}

#ifdef COMPILED_MOE_CUDA
// ------------------------------------------------------------------------------ Hopper launch


// out (M, N) = a (M, K) @ b[g] (K, N) (+ bias[g]): the maps and launches of csrc/grouped_mm.cu's
// forward kernels (their only launcher: kernels/grouped_mm_sm90.py's grouped_mm calls this).
// The caller checked that the kernel applies.
void launch_grouped_mm_sm90(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                            const std::optional<at::Tensor>& bias, const at::Tensor& out, const GroupedMmPlan& plan) {
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(2);
  const int device = a.device().index();
  ensure_context(device);
  const uint64_t a_ptr = reinterpret_cast<uint64_t>(a.data_ptr());
  const uint64_t b_ptr = reinterpret_cast<uint64_t>(b.data_ptr());
  CUtensorMap b_map;
  if (b.stride(2) == 1) {  // dgrad: b is the (G, N_out, K_in) weight itself
    b_map = tensor_map({b_ptr, {uint64_t(N * 2), uint64_t(K), uint64_t(G)},
                        {uint64_t(b.stride(1) * 2), uint64_t(b.stride(0) * 2)}, {128, 64, 1}, 3,
                        CU_TENSOR_MAP_DATA_TYPE_UINT8});
  } else {  // forward: b is the transposed view of the weight
    b_map = tensor_map({b_ptr, {uint64_t(K * 2), uint64_t(N), uint64_t(G)},
                        {uint64_t(b.stride(2) * 2), uint64_t(b.stride(0) * 2)}, {128, 256, 1}, 3,
                        CU_TENSOR_MAP_DATA_TYPE_UINT8});
  }
  CUtensorMap a_map = map2d(a_ptr, K * 2, M, a.stride(0) * 2, 128, plan.skipping ? 64 : 128);
  CUtensorMap a_rows_map = plan.skipping ? map2d(a_ptr, K * 2, M, a.stride(0) * 2, 128, 16) : a_map;
  CUtensorMap out_map = tensor_map({reinterpret_cast<uint64_t>(out.data_ptr()), {uint64_t(N), uint64_t(M), 1},
                                    {uint64_t(out.stride(0) * 2), uint64_t(out.stride(0) * 2 * M)}, {64, 64, 1}, 3,
                                    out_map_type(out.scalar_type())});
  at::Tensor partial;
  if (plan.max_splits > 1) partial = at::empty({plan.max_splits * M * N + 2}, a.options().dtype(at::kFloat));
  const at::Tensor bias_t = bias_in_pairs(bias);

  void* out_ptr = out.data_ptr();
  int32_t kind = out_kind(out.scalar_type());
  int64_t out_stride = out.stride(0);
  void* bias_ptr = bias_t.defined() ? bias_t.data_ptr() : nullptr;
  int32_t bias_kind = bias_t.defined() ? out_kind(bias_t.scalar_type()) : -1;
  int64_t bias_stride = bias_t.defined() ? bias_t.stride(0) : 0;
  const at::Tensor offs_c = offs.contiguous();  // the kernel reads offs[g] at offs + g
  void* offs_ptr = offs_c.data_ptr();
  int32_t m = M, n = N, k = K, g = G, stages = plan.num_stages, splits = plan.max_splits,
          forced = plan.forced_splits;
  void* partial_ptr = partial.defined() ? partial.data_ptr() : nullptr;
  void* args[] = {&a_map, &a_rows_map, &b_map, &out_map, &out_ptr, &kind, &out_stride, &bias_ptr,
                  &bias_kind, &bias_stride, &offs_ptr, &m, &n, &k, &g, &stages, &partial_ptr, &splits, &forced};
  launch(device, plan.function, plan.grid, SM90_THREADS, plan.shared_bytes, args);
  if (partial.defined()) {
    void* sum_args[] = {&partial_ptr, &out_ptr, &kind, &out_stride, &m, &n, &splits};
    launch(device, plan.split_sum, plan.split_sum_grid, 256, 0, sum_args);
  }
}

pybind11::object& grouped_mm_decide() {  // kernels/grouped_mm_sm90.py's host_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& grouped_mm_fallback() {  // kernels/grouped_mm.py's Triton launcher
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

bool triton_forced() {  // COMPILED_MOE_GEMM=triton turns the CUDA kernels off
  const char* gemm = std::getenv("COMPILED_MOE_GEMM");
  return gemm != nullptr && std::string(gemm) == "triton";
}

// grouped_mm on a CUDA device past its checks, under the caller's device guard.
at::Tensor grouped_mm_device(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                             const std::optional<at::Tensor>& bias, c10::ScalarType out_type) {
  ShapeKey key{{a.size(0), a.size(1), b.size(0), b.size(2), a.stride(0) * 4 + a.stride(1),
                b.stride(0), b.stride(1) * 2 + (b.stride(2) == 1), static_cast<int64_t>(a.scalar_type()),
                static_cast<int64_t>(out_type),
                bias ? static_cast<int64_t>(bias->scalar_type()) * 2 + (bias->stride(1) == 1) : -1,
                bias ? bias->stride(0) : 0, a.device().index(), triton_forced()}};
  static PlanCache<GroupedMmPlan> plans;
  std::optional<GroupedMmPlan> plan = plans.get(key, [&] {
    return grouped_mm_decide()(a, b, bias, at::empty({0}, a.options().dtype(out_type)));
  });
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options().dtype(out_type));
  if (plan && tma_aligned({&a, &b, &out}) && a.size(0) > 0) {
    launch_grouped_mm_sm90(a, b, offs, bias, out, *plan);
  } else {
    pybind11::gil_scoped_acquire gil;
    grouped_mm_fallback()(a, b, offs, bias, out);
  }
  return out;
}

at::Tensor grouped_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                           const std::optional<at::Tensor>& bias, std::optional<c10::ScalarType> out_dtype) {
  check_grouped_mm(a, b, offs, bias, out_dtype);
  c10::DeviceGuard guard(a.device());
  return grouped_mm_device(a, b, offs, bias, out_dtype.value_or(a.scalar_type()));
}

// ------------------------------------------------------------------------------ Hopper weight gradient

pybind11::object& wgrad_decide() {  // kernels/grouped_mm_sm90.py's host_wgrad_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& wgrad_fallback() {  // kernels/grouped_mm.py's Triton weight gradient
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

// out[g] (P, Q) = a_g^T @ grad_out_g (accumulate: +=, for the groups whose accumulate_mask
// entry is set, every group without a mask), into out with unit column stride (the only
// launcher: kernels/grouped_mm_sm90.py's grouped_mm_wgrad calls this). wgrad_tile_order picks between the fixed tile order and tiles
// claimed at run time from offs on the device, and writes per-group copies of the operand
// maps; then both kernels launch and the one not chosen returns at once.
void launch_grouped_mm_wgrad_sm90(const at::Tensor& a, const at::Tensor& grad_out, const at::Tensor& offs,
                                  const at::Tensor& out, const GroupedMmWgradPlan& plan, bool accumulate = false,
                                  const at::Tensor& accumulate_mask = at::Tensor()) {
  const int64_t M = a.size(0), P = a.size(1), Q = grad_out.size(1), G = out.size(0);
  const int device = a.device().index();
  ensure_context(device);
  const int64_t es = out.element_size();
  CUtensorMap a_map = map2d(reinterpret_cast<uint64_t>(a.data_ptr()), P * 2, M, a.stride(0) * 2, 128, 64);
  CUtensorMap g_map = map2d(reinterpret_cast<uint64_t>(grad_out.data_ptr()), Q * 2, M, grad_out.stride(0) * 2, 128, 64);
  CUtensorMap out_map = tensor_map({reinterpret_cast<uint64_t>(out.data_ptr()), {uint64_t(Q), uint64_t(P), uint64_t(G)},
                                    {uint64_t(out.stride(1) * es), uint64_t(out.stride(0) * es)},
                                    {uint32_t(128 / es), 64, 1}, 3, out_map_type(out.scalar_type())});
  at::Tensor order = at::empty({2}, a.options().dtype(at::kInt));  // the choice, the claims' counter
  at::Tensor maps = at::empty({G * 2 * 128}, a.options().dtype(at::kByte));
  const at::Tensor offs_c = offs.contiguous();
  void *offs_p = offs_c.data_ptr(), *order_p = order.data_ptr(), *maps_p = maps.data_ptr();
  int32_t m = M, p = P, q = Q, g = G, tiles = plan.tiles_per_group, rows_per_step = 64, claim_steps = 0,
          grid = plan.grid, row_dim = 1, kind = out_kind(out.scalar_type()), add = accumulate,
          stages = plan.num_stages;
  void* mask = accumulate_mask.defined() ? accumulate_mask.data_ptr() : nullptr;  // null: every group
  void* order_args[] = {&offs_p, &m, &g, &tiles, &rows_per_step, &claim_steps, &grid, &order_p, &a_map, &g_map,
                        &maps_p, &row_dim};
  launch(device, plan.tile_order, 1, ORDER_THREADS, ORDER_SCRATCH_BYTES, order_args);
  void* args[] = {&a_map, &g_map, &out_map, &kind, &add, &mask, &offs_p, &m, &p, &q, &g, &stages,
                  &maps_p, &order_p};
  launch(device, plan.function, plan.grid, SM90_THREADS, plan.shared_bytes, args);
  launch(device, plan.claimed, plan.grid, SM90_THREADS, plan.shared_bytes, args);
}

at::Tensor grouped_mm_wgrad_cuda(const at::Tensor& a, const at::Tensor& grad_out, const at::Tensor& offs,
                                 std::optional<c10::ScalarType> out_dtype) {
  check_grouped_mm_wgrad(a, grad_out, offs, out_dtype);
  c10::DeviceGuard guard(a.device());
  const c10::ScalarType out_type = out_dtype.value_or(a.scalar_type());
  at::Tensor out = at::empty({offs.size(0), a.size(1), grad_out.size(1)}, a.options().dtype(out_type));
  if (out.numel() == 0) return out;
  ShapeKey key{{a.size(1), grad_out.size(1), offs.size(0), a.stride(0), a.stride(1), grad_out.stride(0),
                grad_out.stride(1), static_cast<int64_t>(a.scalar_type()), static_cast<int64_t>(out_type),
                a.device().index(), triton_forced(), 0, 0}};
  static PlanCache<GroupedMmWgradPlan> plans;
  std::optional<GroupedMmWgradPlan> plan = plans.get(key, [&] { return wgrad_decide()(a, grad_out, out); });
  if (plan && tma_aligned({&a, &grad_out, &out}) && a.size(0) > 0) {
    launch_grouped_mm_wgrad_sm90(a, grad_out, offs, out, *plan);
  } else {
    pybind11::gil_scoped_acquire gil;
    wgrad_fallback()(a, grad_out, offs, out);
  }
  return out;
}

pybind11::object& wgrad_accumulate_fallback() {  // the Triton kernel, the reference for float64
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

// main_grad[g] (+)= a_g^T @ grad_out_g in place: kernels/grouped_mm_sm90.py's grouped_mm_wgrad
// with accumulate, the plan asked of Python as grouped_mm_wgrad's (host_wgrad_plan).
void grouped_mm_wgrad_accumulate_cuda(const at::Tensor& main_grad, const at::Tensor& a, const at::Tensor& grad_out,
                                      const at::Tensor& offs, const std::optional<at::Tensor>& accumulate_mask) {
  check_grouped_mm_wgrad_accumulate(main_grad, a, grad_out, offs, accumulate_mask);
  c10::DeviceGuard guard(a.device());
  // A (G, N, K) buffer seen as (G, K, N): its transpose gets grad_out_g^T @ a_g.
  const bool transposed = main_grad.stride(2) != 1;
  const at::Tensor& lhs = transposed ? grad_out : a;
  const at::Tensor& rhs = transposed ? a : grad_out;
  const at::Tensor out = transposed ? main_grad.transpose(1, 2) : main_grad;
  if (out.numel() == 0) return;
  std::optional<GroupedMmWgradPlan> plan;
  if (main_grad.scalar_type() == at::kFloat && a.size(0) > 0) {
    ShapeKey key{{lhs.size(1), rhs.size(1), offs.size(0), lhs.stride(0), lhs.stride(1), rhs.stride(0), rhs.stride(1),
                  static_cast<int64_t>(a.scalar_type()), out.stride(0), out.stride(1), a.device().index(),
                  triton_forced(), 0}};
    static PlanCache<GroupedMmWgradPlan> plans;
    plan = plans.get(key, [&] { return wgrad_decide()(lhs, rhs, out); });
  }
  if (plan && tma_aligned({&a, &grad_out, &main_grad})) {
    launch_grouped_mm_wgrad_sm90(lhs, rhs, offs, out, *plan, true,
                                 accumulate_mask ? accumulate_mask->contiguous() : at::Tensor());
  } else {
    pybind11::gil_scoped_acquire gil;
    wgrad_accumulate_fallback()(main_grad, a, grad_out, offs, accumulate_mask);
  }
}

// ------------------------------------------------------------------------------ routing

// moe_route's CUDA kernels into offs (E,), row_of (T, k), source (T*k + E*(pad_multiple-1),):
// the launch arithmetic of compiled_moe/ops/routing.py's _route_cuda (which serves where this
// layer does not).
void route(const at::Tensor& ids, int64_t num_experts, int64_t pad_multiple, const at::Tensor& offs,
           const at::Tensor& row_of, const at::Tensor& source, const RouteKernels& k, int device) {
  constexpr int64_t kSharedInts = 12288;
  const int64_t n = ids.numel();
  const int64_t num_warps = std::max<int64_t>(1, std::min<int64_t>(32, kSharedInts / num_experts));
  const int64_t block = 32 * num_warps;
  int32_t items = static_cast<int32_t>(std::max<int64_t>(1, (n + block * 128 - 1) / (block * 128)));
  int32_t chunk = static_cast<int32_t>(block * items);
  int32_t num_chunks = static_cast<int32_t>(std::max<int64_t>(1, (n + chunk - 1) / chunk));
  at::Tensor hist = at::empty({num_chunks * num_experts}, ids.options().dtype(at::kInt));
  const int wide = ids.scalar_type() == at::kLong;
  void *ids_p = ids.data_ptr(), *row_of_p = row_of.data_ptr(), *hist_p = hist.data_ptr(),
       *offs_p = offs.data_ptr(), *source_p = source.data_ptr();
  int64_t n64 = n, source_rows = source.size(0);
  int32_t experts = static_cast<int32_t>(num_experts), pad = static_cast<int32_t>(pad_multiple);
  void* rank_args[] = {&ids_p, &row_of_p, &hist_p, &n64, &experts, &items};
  launch(device, k.rank[wide], num_chunks, block, 4 * num_warps * num_experts, rank_args);
  void* place_args[] = {&ids_p, &row_of_p, &hist_p, &offs_p, &source_p, &n64, &source_rows, &experts,
                        &num_chunks, &chunk, &pad};
  launch(device, k.place[wide], num_chunks, block, 4 * (2 * num_experts + 32), place_args);
}

// torch.ops.compiled_moe.moe_route's CUDA kernel: (offs, row_of, source) of the expert-sorted
// layout, compiled_moe.reference.moe_route's contract. No pairs: every group empty, every row
// padding.
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& topk_ids, int64_t num_experts,
                                                              int64_t pad_multiple) {
  check_moe_route(topk_ids, num_experts, pad_multiple);
  c10::DeviceGuard guard(topk_ids.device());
  const int device = topk_ids.device().index();
  const int64_t pairs = topk_ids.numel();
  const auto options = topk_ids.options().dtype(at::kInt);
  const int64_t capacity = pairs + num_experts * (pad_multiple - 1);  // reference.routing_capacity
  at::Tensor row_of = at::empty({topk_ids.size(0), topk_ids.size(1)}, options);
  if (pairs == 0) return {at::zeros({num_experts}, options), row_of, at::full({capacity}, -1, options)};
  at::Tensor offs = at::empty({num_experts}, options);
  at::Tensor source = at::empty({capacity}, options);
  ensure_context(device);
  route(topk_ids.contiguous(), num_experts, pad_multiple, offs, row_of, source, device_kernels<RouteKernels>(device),
        device);
  return {offs, row_of, source};
}

#endif  // COMPILED_MOE_CUDA

// ------------------------------------------------------------------------------ the experts block
// route -> gather -> FC1 -> activation -> FC2 -> weighted combine, and its backward, each one
// host call: a C++ autograd function composed of the package's ops, called through the
// dispatcher below autograd. On CUDA each op is this layer's kernel, so an eager step's block
// makes no call into Python (what the Python composition cost: about 0.9 ms of host time a
// forward+backward at decode sizes on the H200, benchmarks/RESULTS.md); elsewhere the ops' own
// kernels serve, which is how the CPU tier tests it. Backward keeps FC1's output h (and FC2's
// output y where the routing weights need a gradient) and recomputes the gathered rows and the
// activation, as the fused MLP does.

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_moe_route(const at::Tensor& ids, int64_t experts) {
  static auto op =
      package_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t)>(
          "compiled_moe::moe_route");
  return op.call(ids, experts, 1);
}

// moe_permute (gather) and moe_unpermute (combine) share a signature.
using RowsSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&);

at::Tensor call_moe_permute(const at::Tensor& hidden, const at::Tensor& row_of, const at::Tensor& source,
                            const std::optional<at::Tensor>& scale) {
  static auto op = package_op<RowsSignature>("compiled_moe::moe_permute");
  return op.call(hidden, row_of, source, scale);
}

at::Tensor call_moe_unpermute(const at::Tensor& y, const at::Tensor& row_of, const at::Tensor& source,
                              const std::optional<at::Tensor>& weights) {
  static auto op = package_op<RowsSignature>("compiled_moe::moe_unpermute");
  return op.call(y, row_of, source, weights);
}

std::tuple<at::Tensor, at::Tensor> call_moe_unpermute_backward(const at::Tensor& grad_out, const at::Tensor& y,
                                                               const at::Tensor& row_of, const at::Tensor& source,
                                                               const at::Tensor& weights) {
  static auto op = package_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&)>(
      "compiled_moe::moe_unpermute_backward");
  return op.call(grad_out, y, row_of, source, weights);
}

struct Activation {
  std::string name, layout;
  double alpha, limit;
};

at::Tensor call_moe_activation(const at::Tensor& h, const Activation& act) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const std::string&, const std::string&, double, double)>(
      "compiled_moe::moe_activation");
  return op.call(h, act.name, act.layout, act.alpha, act.limit);
}

at::Tensor call_moe_activation_backward(const at::Tensor& grad, const at::Tensor& h, const Activation& act) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::string&, const std::string&,
                                         double, double)>("compiled_moe::moe_activation_backward");
  return op.call(grad, h, act.name, act.layout, act.alpha, act.limit);
}

struct BlockForward {
  at::Tensor out, offs, row_of, source, h, y;
};

// The forward's ops, under the caller's dispatch below autograd.
BlockForward block_forward(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const at::Tensor& w1, const at::Tensor& w2, const std::optional<at::Tensor>& b1,
                           const std::optional<at::Tensor>& b2, const Activation& act) {
  auto [offs, row_of, source] = call_moe_route(topk_ids, w1.size(0));
  at::Tensor h = grouped_mm_op().call(call_moe_permute(hidden, row_of, source, std::nullopt), w1.mT(), offs, b1,
                                      std::nullopt);
  at::Tensor y = grouped_mm_op().call(call_moe_activation(h, act), w2.mT(), offs, b2, std::nullopt);
  at::Tensor out = call_moe_unpermute(y, row_of, source, topk_weights);
  return {out, offs, row_of, source, h, y};
}

std::optional<at::Tensor> bias_at(at::TensorList biases, bool present, size_t index) {
  return present ? std::optional<at::Tensor>(biases[index]) : std::nullopt;
}

// Inputs: hidden, topk_ids, topk_weights, w1, w2, then the biases as a list (b1 and b2 where
// given: autograd takes no undefined tensor and gives an optional<Tensor> no gradient).
class ExpertsBlockFunction : public torch::autograd::Function<ExpertsBlockFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w1,
                            const at::Tensor& w2, at::TensorList biases, bool has_b1, bool has_b2,
                            const std::string& activation, const std::string& gate_up_layout, double alpha,
                            double limit) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Activation act{activation, gate_up_layout, alpha, limit};
    BlockForward f = block_forward(hidden, topk_ids, topk_weights, w1, w2, bias_at(biases, has_b1, 0),
                                   bias_at(biases, has_b2, has_b1 ? 1 : 0), act);
    const bool weights_grad = topk_weights.requires_grad();
    ctx->save_for_backward({hidden, topk_weights, w1, w2, f.offs, f.row_of, f.source, f.h,
                            weights_grad ? f.y : at::Tensor()});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["gate_up_layout"] = gate_up_layout;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    ctx->saved_data["b1_dtype"] = has_b1 ? static_cast<int64_t>(biases[0].scalar_type()) : int64_t(-1);
    ctx->saved_data["b2_dtype"] = has_b2 ? static_cast<int64_t>(biases.back().scalar_type()) : int64_t(-1);
    return f.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weights = saved[1], &w1 = saved[2], &w2 = saved[3], &offs = saved[4],
                     &row_of = saved[5], &source = saved[6], &h = saved[7], &y = saved[8];
    const Activation act{ctx->saved_data["activation"].toStringRef(), ctx->saved_data["gate_up_layout"].toStringRef(),
                         ctx->saved_data["alpha"].toDouble(), ctx->saved_data["limit"].toDouble()};
    const int64_t b1_dtype = ctx->saved_data["b1_dtype"].toInt(), b2_dtype = ctx->saved_data["b2_dtype"].toInt();
    const size_t b1_index = 5, b2_index = b1_dtype >= 0 ? 6 : 5;
    // Without create_graph nothing records the gradient's ops: they dispatch straight to their
    // kernels.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const at::Tensor dout = grads[0].to(hidden.scalar_type());
    at::Tensor dy, grad_weights;  // FC2's output gradient, the routing weights' gradient
    if (ctx->needs_input_grad(2)) {
      std::tie(dy, grad_weights) = call_moe_unpermute_backward(dout, y, row_of, source, weights);
    } else {
      dy = call_moe_permute(dout, row_of, source, weights);
    }
    at::Tensor grad_w2, grad_b2, grad_w1, grad_b1, grad_hidden;
    if (ctx->needs_input_grad(4)) grad_w2 = weight_grad(dy, call_moe_activation(h, act), offs, w2);
    if (b2_dtype >= 0 && ctx->needs_input_grad(b2_index))
      grad_b2 = grouped_sum(dy, offs, static_cast<c10::ScalarType>(b2_dtype));
    const at::Tensor dh =
        call_moe_activation_backward(grouped_mm_op().call(dy, w2, offs, std::nullopt, std::nullopt), h, act);
    if (b1_dtype >= 0 && ctx->needs_input_grad(b1_index))
      grad_b1 = grouped_sum(dh, offs, static_cast<c10::ScalarType>(b1_dtype));
    if (ctx->needs_input_grad(3))
      grad_w1 = weight_grad(dh, call_moe_permute(hidden, row_of, source, std::nullopt), offs, w1);
    if (ctx->needs_input_grad(0)) {
      grad_hidden = call_moe_unpermute(grouped_mm_op().call(dh, w1, offs, std::nullopt, std::nullopt), row_of,
                                       source, std::nullopt);
    }
    torch::autograd::variable_list out = {grad_hidden, at::Tensor(), grad_weights, grad_w1, grad_w2};
    if (b1_dtype >= 0) out.push_back(grad_b1);
    if (b2_dtype >= 0) out.push_back(grad_b2);
    out.resize(out.size() + 6);  // has_b1, has_b2, activation, gate_up_layout, alpha, limit
    return out;
  }
};

// compiled_moe.moe_experts's eager block (compiled_moe/experts.py checks the arguments and
// calls it where host_block_applies): the autograd function where a gradient is needed, else
// the forward's ops alone.
at::Tensor moe_experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w1, const at::Tensor& w2, const std::optional<at::Tensor>& b1,
                       const std::optional<at::Tensor>& b2, const std::string& activation,
                       const std::string& gate_up_layout, double alpha, double limit) {
  bool grad = hidden.requires_grad() || topk_weights.requires_grad() || w1.requires_grad() || w2.requires_grad() ||
              (b1 && b1->requires_grad()) || (b2 && b2->requires_grad());
  if (!grad || !at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return block_forward(hidden, topk_ids, topk_weights, w1, w2, b1, b2,
                         Activation{activation, gate_up_layout, alpha, limit})
        .out;
  }
  std::vector<at::Tensor> biases;
  if (b1) biases.push_back(*b1);
  if (b2) biases.push_back(*b2);
  return ExpertsBlockFunction::apply(hidden, topk_ids, topk_weights, w1, w2, at::TensorList(biases), b1.has_value(),
                                     b2.has_value(), activation, gate_up_layout, alpha, limit);
}

torch::Library& library() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "compiled_moe", std::nullopt, __FILE__, __LINE__);
  return *lib;
}

}  // namespace

// route_kernels(device), row_kernels(device): the handles of the route and the row kernels on
// a device (RouteKernels, RowKernels), which the experts block and moe_route launch.
void register_kernels(pybind11::object route_kernels, pybind11::object row_kernels) {
#ifdef COMPILED_MOE_CUDA
  RouteKernels::ask() = std::move(route_kernels);
  RowKernels::ask() = std::move(row_kernels);
#endif
}

// compiled_moe::moe_route's CUDA kernel (the op has no autograd). Returns the dispatch keys
// registered.
std::vector<std::string> register_moe_route() {
#ifdef COMPILED_MOE_CUDA
  library().impl("moe_route", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(moe_route_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

// compiled_moe::grouped_mm_wgrad's CUDA kernel (its autograd formula stays Python's):
// decide(a, grad_out, out) gives the Hopper kernel's plan or None; fallback(a, grad_out, offs,
// out) writes the gradient with the Triton kernel. Returns the dispatch keys registered.
std::vector<std::string> register_grouped_mm_wgrad(pybind11::object decide, pybind11::object fallback) {
#ifdef COMPILED_MOE_CUDA
  wgrad_decide() = std::move(decide);
  wgrad_fallback() = std::move(fallback);
  library().impl("grouped_mm_wgrad", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(grouped_mm_wgrad_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

// compiled_moe::grouped_mm_wgrad_accumulate_'s autograd kernel for CPU and CUDA tensors (its
// custom_op's layers serve the other devices), and its CUDA kernel: the plans of
// grouped_mm_wgrad's decide (registered with it); fallback(main_grad, a, grad_out, offs,
// accumulate_mask) for the rest. Returns the dispatch keys registered.
std::vector<std::string> register_grouped_mm_wgrad_accumulate(pybind11::object fallback) {
  for (auto key : {c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA})
    library().impl("grouped_mm_wgrad_accumulate_", torch::dispatch(key, TORCH_FN(grouped_mm_wgrad_accumulate_autograd)));
#ifdef COMPILED_MOE_CUDA
  wgrad_accumulate_fallback() = std::move(fallback);
  library().impl("grouped_mm_wgrad_accumulate_",
                 torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(grouped_mm_wgrad_accumulate_cuda)));
  return {"AutogradCPU", "AutogradCUDA", "CUDA"};
#else
  return {"AutogradCPU", "AutogradCUDA"};
#endif
}

// Registers this layer's kernels of compiled_moe::grouped_mm (defined by the Python package):
// autograd for every device; CUDA where this build has the driver API. decide(a, b, bias, out)
// gives the Hopper kernel's plan for a shape, or None where the kernel does not apply (out: an
// empty tensor of the output's dtype); fallback(a, b, offs, bias, out) writes the product into
// out with the Triton kernel, for the rest. Returns the dispatch keys registered.
std::vector<std::string> register_grouped_mm(pybind11::object decide, pybind11::object fallback) {
  library().impl("grouped_mm", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(grouped_mm_autograd)));
#ifdef COMPILED_MOE_CUDA
  grouped_mm_decide() = std::move(decide);
  grouped_mm_fallback() = std::move(fallback);
  library().impl("grouped_mm", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(grouped_mm_cuda)));
  return {"Autograd", "CUDA"};
#else
  return {"Autograd"};
#endif
}

}  // namespace compiled_moe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "compiled_moe's C++ host layer (csrc/host)";
  m.def("register_grouped_mm", &compiled_moe::register_grouped_mm);
  m.def("register_grouped_mm_wgrad", &compiled_moe::register_grouped_mm_wgrad);
  m.def("register_kernels", &compiled_moe::register_kernels);
  m.def("register_moe_route", &compiled_moe::register_moe_route);
  // The route's checks alone (its CUDA kernel makes them), for tests on any machine.
  m.def("check_moe_route", &compiled_moe::check_moe_route);
  // The weight gradient's checks alone (the CUDA kernel makes them), for tests on any machine.
  m.def("check_grouped_mm_wgrad", &compiled_moe::check_grouped_mm_wgrad);
  m.def("register_grouped_mm_wgrad_accumulate", &compiled_moe::register_grouped_mm_wgrad_accumulate);
  m.def("check_grouped_mm_wgrad_accumulate", &compiled_moe::check_grouped_mm_wgrad_accumulate);
  m.def("moe_experts", &compiled_moe::moe_experts);
  compiled_moe::bind_rows(m);
  compiled_moe::bind_fp8(m);
#ifdef COMPILED_MOE_CUDA
  m.attr("has_cuda") = true;
  m.def("launch_grouped_mm_sm90", [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                                     const std::optional<at::Tensor>& bias, const at::Tensor& out,
                                     pybind11::handle plan) {
    compiled_moe::launch_grouped_mm_sm90(a, b, offs, bias, out, compiled_moe::GroupedMmPlan::read(plan));
  });
  m.def("launch_grouped_mm_wgrad_sm90", [](const at::Tensor& a, const at::Tensor& grad_out, const at::Tensor& offs,
                                           const at::Tensor& out, pybind11::handle plan, bool accumulate,
                                           const std::optional<at::Tensor>& accumulate_mask) {
    const at::Tensor offs_c = offs.contiguous();
    compiled_moe::launch_grouped_mm_wgrad_sm90(a, grad_out, offs_c, out, compiled_moe::GroupedMmWgradPlan::read(plan),
                                               accumulate, accumulate_mask ? *accumulate_mask : at::Tensor());
  });
  // wgrad_tile_order's choice alone (no group maps), for its test.
  m.def("launch_wgrad_tile_order", [](int64_t function, const at::Tensor& offs, int64_t M, int64_t tiles_per_group,
                                      int64_t rows_per_step, int64_t claim_steps, int64_t grid, const at::Tensor& order) {
    CUtensorMap unread{};  // no group maps are written
    void *offs_p = offs.data_ptr(), *order_p = order.data_ptr(), *maps_p = nullptr;
    int32_t m = static_cast<int32_t>(M), g = static_cast<int32_t>(offs.size(0)), tiles = static_cast<int32_t>(tiles_per_group),
            rows = static_cast<int32_t>(rows_per_step), claims = static_cast<int32_t>(claim_steps),
            blocks = static_cast<int32_t>(grid), row_dim = 1;
    void* args[] = {&offs_p, &m, &g, &tiles, &rows, &claims, &blocks, &order_p, &unread, &unread, &maps_p, &row_dim};
    compiled_moe::ensure_context(offs.device().index());
    compiled_moe::launch(offs.device().index(), reinterpret_cast<CUfunction>(function), 1, ORDER_THREADS,
                         ORDER_SCRATCH_BYTES, args);
  });
  // A plan as this layer reads it (csrc/host/plans.h), as {field: value}: the boundary test.
  m.def("read_plan", [](const std::string& name, pybind11::handle plan) -> pybind11::dict {
#define COMPILED_MOE_READ_NAMED_PLAN(Name, FIELDS) \
  if (name == #Name) return compiled_moe::Name::read(plan).to_dict();
    COMPILED_MOE_PLANS(COMPILED_MOE_READ_NAMED_PLAN)
#undef COMPILED_MOE_READ_NAMED_PLAN
    throw pybind11::value_error("csrc/host/plans.h has no plan " + name);
  });
#else
  m.attr("has_cuda") = false;
#endif
}
