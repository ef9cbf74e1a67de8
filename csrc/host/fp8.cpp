// The C++ host layer's FP8 ops, from the dispatcher to the driver without Python: checks with
// the Python messages (compiled_moe/ops/fp8.py), the device guard, outputs in the Python
// layouts, and the launch of the CUDA kernels whose plans Python gives once per shape; every
// other call (other recipes, 3-D weights, float64, operands the kernels do not take) goes to
// the op's Python kernel.
//
// grouped_quantize (2-D x, fp8_blockwise: columnwise, with rowwise in the same launch, or
// rowwise only) and moe_activation_quantize (both ways, from FC1's output in one pass):
// csrc/grouped_quantize.cu's kernels, plans from kernels/quantize_cuda.py. scaled_grouped_mm
// (fp8_blockwise) and scaled_grouped_mm_wgrad (fp8_blockwise, fp8_rowwise) on Hopper:
// csrc/fp8_grouped_mm.cu's kernels, plans from kernels/scaled_grouped_mm_sm90.py. Then the
// autograd functions of compiled_moe.fp8_grouped_mm and fp8_activation_grouped_mm, composed of
// those ops through the dispatcher.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "checks.h"

#if __has_include(<cuda.h>)
#define COMPILED_MOE_CUDA 1
#include "cuda_driver.h"
#include "hopper.h"
#include "kernels.h"
#include "plans.h"
#endif

namespace compiled_moe {

// grouped_quantize's outputs: rowwise data and scales, columnwise data and scales.
using Quantized = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// ------------------------------------------------------------------------------ checks

constexpr std::array<const char*, 3> kRecipes = {"fp8_rowwise", "fp8_blockwise", "mxfp8"};  // reference.FP8_RECIPES

namespace {

void check_recipe(const std::string& recipe) {  // reference.check_recipe
  CM_CHECK_VALUE(recipe == kRecipes[0] || recipe == kRecipes[1] || recipe == kRecipes[2], "recipe must be one of ",
                 py_tuple(kRecipes), ", got ", py_repr(recipe));
}

// check_tensor(name, t, ndim, (dtype,)) of one dtype.
void check_tensor_of(const char* name, const at::Tensor& t, int64_t ndim, c10::ScalarType dtype) {
  check_dims(name, t, ndim);
  CM_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype in (", dtype_name(dtype).substr(6), "), got ",
                dtype_name(t.scalar_type()));
}

c10::ScalarType scale_dtype(const std::string& recipe) {  // ops/fp8.py's quantized_scale_dtype
  return recipe == kRecipes[2] ? at::kByte : at::kFloat;
}

// ops/fp8.py's _check_scale.
void check_scale(const char* name, const at::Tensor& scale, c10::SymIntArrayRef shape, const std::string& recipe) {
  check_tensor_of(name, scale, static_cast<int64_t>(shape.size()), scale_dtype(recipe));
  CM_CHECK_VALUE(scale.sym_sizes() == shape, name, " must have shape ", shape_str(shape), " for recipe ",
                 py_repr(recipe), ", got ", shape_str(scale.sym_sizes()));
}

// Scales of `cols` columns in blocks of `block` (0: the whole row): ops/fp8.py's _blocks.
c10::SymInt blocks(const c10::SymInt& cols, int64_t block) { return block == 0 ? c10::SymInt(1) : (cols + block - 1) / block; }

// reference.fp8_block: the columns of a row's scale block (0: the whole row), and the rows of a
// weight's (128 x 128 for fp8_blockwise, one row for the others).
int64_t block_columns(const std::string& recipe) { return recipe == kRecipes[1] ? 128 : recipe == kRecipes[2] ? 32 : 0; }
int64_t weight_block_rows(const std::string& recipe) { return recipe == kRecipes[1] ? 128 : 1; }

// reference.fp8_column_slots: 2-D data's columnwise scale slots, every group's column blocks
// (of reference.fp8_column_block rows; 0: the whole group) plus the rows past the last group.
c10::SymInt column_slots(const c10::SymInt& rows, const c10::SymInt& groups, const std::string& recipe) {
  const int64_t block = recipe == kRecipes[1] ? 128 : recipe == kRecipes[2] ? 32 : 0;
  return block == 0 ? groups + 1 : (rows + block - 1) / block + groups;
}

void check_fp8_out_dtype(std::optional<c10::ScalarType> out_dtype) {  // ops/fp8.py's _check_out
  CM_CHECK_TYPE(!out_dtype || *out_dtype == at::kBFloat16 || *out_dtype == at::kHalf || *out_dtype == at::kFloat,
                "out_dtype must be one of (torch.bfloat16, torch.float16, torch.float32) or None, got ",
                out_dtype ? dtype_name(*out_dtype) : "None");
}

}  // namespace

// compiled_moe/ops/fp8.py's _check_quantize.
void check_grouped_quantize(const at::Tensor& x, const std::optional<at::Tensor>& offs, const std::string& recipe,
                            bool rowwise, bool columnwise) {
  check_recipe(recipe);
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

// compiled_moe/ops/fp8.py's _check_scaled_wgrad.
void check_scaled_grouped_mm_wgrad(const at::Tensor& a_t, const at::Tensor& d_t, const at::Tensor& a_scale,
                                   const at::Tensor& d_scale, const at::Tensor& offs, const std::string& recipe,
                                   std::optional<c10::ScalarType> out_dtype) {
  check_recipe(recipe);
  check_tensor_of("a_t", a_t, 2, at::kFloat8_e4m3fn);
  check_tensor_of("d_t", d_t, 2, at::kFloat8_e4m3fn);
  check_offs(offs);
  check_same_device("a_t", a_t, "d_t", d_t);
  check_same_device("a_t", a_t, "a_scale", a_scale);
  check_same_device("a_t", a_t, "d_scale", d_scale);
  check_same_device("a_t", a_t, "offs", offs);
  const c10::SymInt &m = a_t.sym_size(1);
  CM_CHECK_VALUE(m == d_t.sym_size(1), "a_t is (K, M) = ", shape_str(a_t.sym_sizes()), " but d_t is (N, M) = ",
                 shape_str(d_t.sym_sizes()), "; M must match");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"a_t", &a_t}, {"d_t", &d_t}})
    CM_CHECK_VALUE(t->stride(1) == 1, name, " must be columnwise data of grouped_quantize (", name,
                   ".stride(1) == 1)");
  const c10::SymInt slots = column_slots(m, offs.sym_size(0), recipe);
  check_scale("a_scale", a_scale, {a_t.sym_size(0), slots}, recipe);
  check_scale("d_scale", d_scale, {d_t.sym_size(0), slots}, recipe);
  check_fp8_out_dtype(out_dtype);
}

// compiled_moe/ops/fp8.py's _check_activation_quantize.
void check_moe_activation_quantize(const at::Tensor& h, const at::Tensor& offs, const std::string& activation,
                                   const std::string& gate_up_layout, const std::string& recipe,
                                   const std::optional<at::Tensor>& probs, bool rowwise, bool columnwise) {
  check_recipe(recipe);
  check_moe_activation(h, activation, gate_up_layout);
  check_offs(offs);
  if (probs) {  // ops/moe_mlp.py's check_probs
    check_dims("probs", *probs, 1);
    CM_CHECK_TYPE(at::isFloatingType(probs->scalar_type()), "probs must be a floating-point tensor, got ",
                  dtype_name(probs->scalar_type()));
    CM_CHECK_VALUE(probs->sym_size(0) == h.sym_size(0), "probs must be (", size_str(h.sym_size(0)),
                   ",), one per sorted row, got ", shape_str(probs->sym_sizes()));
  }
  check_same_device("h", h, "offs", offs);
  if (probs) check_same_device("h", h, "probs", *probs);
  CM_CHECK_VALUE(rowwise || columnwise, "ask for rowwise and/or columnwise output");
}

// compiled_moe/ops/fp8.py's _check_scaled_mm.
void check_scaled_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                             const at::Tensor& b_scale, const at::Tensor& offs, const std::string& recipe,
                             std::optional<c10::ScalarType> out_dtype, const std::optional<at::Tensor>& bias) {
  check_recipe(recipe);
  check_tensor_of("a", a, 2, at::kFloat8_e4m3fn);
  check_tensor_of("b", b, 3, at::kFloat8_e4m3fn);
  check_offs(offs, b.sym_size(0));
  check_same_device("a", a, "b", b);
  check_same_device("a", a, "a_scale", a_scale);
  check_same_device("a", a, "b_scale", b_scale);
  check_same_device("a", a, "offs", offs);
  if (bias) {
    check_same_device("a", a, "bias", *bias);
    check_tensor("bias", *bias, 2);
    CM_CHECK_VALUE(bias->sym_size(0) == b.sym_size(0) && bias->sym_size(1) == b.sym_size(2),
                   "bias must have shape (G, N) = (", size_str(b.sym_size(0)), ", ", size_str(b.sym_size(2)), "), got ",
                   shape_str(bias->sym_sizes()));
  }
  const c10::SymInt &m = a.sym_size(0), &k = a.sym_size(1), &g = b.sym_size(0), &n = b.sym_size(2);
  CM_CHECK_VALUE(k == b.sym_size(1), "a has K=", size_str(k), " columns but b is (G, K, N) = ", shape_str(b.sym_sizes()),
                 "; K must match");
  CM_CHECK_VALUE(a.stride(1) == 1, "a must be row-major (a.stride(1) == 1): FP8 tensor cores read it K-major");
  CM_CHECK_VALUE(b.stride(1) == 1, "b must be K-major (b.stride(1) == 1): pass the rowwise data of a (G, N, K) weight "
                                   "as data.transpose(-2, -1)");
  const int64_t rows = weight_block_rows(recipe), columns = block_columns(recipe);
  check_scale("a_scale", a_scale, {m, blocks(k, columns)}, recipe);
  check_scale("b_scale", b_scale, {g, (n + rows - 1) / rows, blocks(k, columns)}, recipe);
  check_fp8_out_dtype(out_dtype);
}

#ifdef COMPILED_MOE_CUDA
namespace {

pybind11::object& columns_plan() {  // kernels/quantize_cuda.py's host_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& rows_plan() {  // kernels/quantize_cuda.py's host_rows_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& quantize_python_kernel() {  // the op's Python kernel
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}



// row_q (M, K) e4m3 and row_s (M, ceil(K / 128)) fp32 of 2-D x with unit column stride.
Quantized quantize_rows(const at::Tensor& x, const QuantizeRowsPlan& plan) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto fp8 = x.options().dtype(at::kFloat8_e4m3fn), fp32 = x.options().dtype(at::kFloat);
  at::Tensor row_q = at::empty({M, K}, fp8), row_s = at::empty({M, (K + 127) / 128}, fp32);
  const Quantized out{row_q, row_s, at::empty({0}, fp8), at::empty({0}, fp32)};
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
std::optional<QuantizeColumnsPlan> plan_for(const at::Tensor& x, const at::Tensor& offs, bool rowwise) {
  static PlanCache<QuantizeColumnsPlan> plans;
  const ShapeKey key{{x.size(0), x.size(1), offs.size(0), x.stride(0), x.stride(1), static_cast<int64_t>(x.scalar_type()),
                      rowwise, x.device().index(), 0, 0, 0, 0, 0}};
  return plans.get(key, [&] { return columns_plan()(x, offs, rowwise); });
}

// The activation of moe_activation_quantize's kernel (activate_quantize_*): its code and
// layout, probs (fp32, or null) and the gpt_oss constants.
struct ActivationArgs {
  int32_t code, interleaved;
  const void* probs;
  float alpha, limit;
};

// The columnwise kernels' launch: quantize_columns_* of x (M, K), or, with `act`,
// activate_quantize_* of FC1's output x (M, N1), K being the activation's columns. Outputs in
// ops/fp8.py's _quantize_outputs layouts: e4m3 data, fp32 scales; columnwise data (K, M) with
// rows padded to 16 bytes (TMA), columnwise scales (K, slots) with K contiguous; rowwise ones
// empty unless asked for.
Quantized launch_columns(const at::Tensor& x, const at::Tensor& offs, int64_t K, const QuantizeColumnsPlan& plan, bool rowwise,
                         const ActivationArgs* act) {
  const int64_t M = x.size(0), G = offs.size(0);
  const auto fp8 = x.options().dtype(at::kFloat8_e4m3fn), fp32 = x.options().dtype(at::kFloat);
  at::Tensor col_q = at::empty_strided({K, M}, {(M + 15) / 16 * 16, 1}, fp8);
  at::Tensor col_s = at::empty({plan.slots, K}, fp32).t();
  at::Tensor row_q = rowwise ? at::empty({M, K}, fp8) : at::empty({0}, fp8);
  at::Tensor row_s = rowwise ? at::empty({M, (K + 127) / 128}, fp32) : at::empty({0}, fp32);
  if (K == 0) return {row_q, row_s, col_q, col_s};
  const int device = x.device().index();
  ensure_context(device);
  const at::Tensor offs_c = offs.contiguous();
  const at::Tensor& rq = rowwise ? row_q : col_q;  // unused pointers when not rowwise
  const at::Tensor& rs = rowwise ? row_s : col_s;
  const void *x_p = x.data_ptr(), *offs_p = offs_c.data_ptr();
  void *col_q_p = col_q.data_ptr(), *col_s_p = col_s.data_ptr(), *rq_p = rq.data_ptr(), *rs_p = rs.data_ptr();
  int64_t x_stride = x.stride(0), col_q_stride = col_q.stride(0), col_s_0 = col_s.stride(0), col_s_1 = col_s.stride(1),
          rq_stride = rq.stride(0), rs_0 = rs.stride(0), rs_1 = rs.stride(1);
  int32_t m = static_cast<int32_t>(M), k = static_cast<int32_t>(K), g = static_cast<int32_t>(G),
          s = static_cast<int32_t>(plan.slots), group_m = plan.group_m, stages = plan.num_stages;
  ActivationArgs a = act ? *act : ActivationArgs{};
  std::vector<void*> args = {&x_p,         &x_stride, &offs_p,  &m,       &k,    &g,         &s,
                             &group_m,     &stages,   &col_q_p, &col_q_stride, &col_s_p, &col_s_0, &col_s_1,
                             &rq_p,        &rq_stride, &rs_p,   &rs_0,    &rs_1};
  if (act) args.insert(args.end(), {&a.code, &a.interleaved, &a.probs, &a.alpha, &a.limit});
  launch(device, plan.function, plan.grid, plan.threads, plan.shared_bytes, args.data());
  return {row_q, row_s, col_q, col_s};
}

Quantized grouped_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& offs, const std::string& recipe,
                              bool rowwise, bool columnwise) {
  check_grouped_quantize(x, offs, recipe, rowwise, columnwise);
  c10::DeviceGuard guard(x.device());
  const bool blockwise_2d = x.dim() == 2 && recipe == kRecipes[1] && x.scalar_type() != at::kDouble;
  if (blockwise_2d && !columnwise && x.stride(1) == 1) {
    static PlanCache<QuantizeRowsPlan> rows_plans;
    const ShapeKey key{{static_cast<int64_t>(x.scalar_type()), x.device().index(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
    if (std::optional<QuantizeRowsPlan> rows = rows_plans.get(key, [&] { return rows_plan()(x); })) return quantize_rows(x, *rows);
  }
  std::optional<QuantizeColumnsPlan> plan;
  if (blockwise_2d && columnwise && reinterpret_cast<uint64_t>(x.data_ptr()) % 16 == 0)
    plan = plan_for(x, *offs, rowwise);
  if (!plan) {
    pybind11::gil_scoped_acquire gil;
    return quantize_python_kernel()(x, offs, recipe, rowwise, columnwise).cast<Quantized>();
  }
  return launch_columns(x, *offs, x.size(1), *plan, rowwise, nullptr);
}

pybind11::object& activation_plan() {  // kernels/quantize_cuda.py's host_activation_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& activation_python_kernel() {  // moe_activation_quantize's Python kernel
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

// torch.ops.compiled_moe.moe_activation_quantize's CUDA kernel: fp8_blockwise both ways of
// a = act(h) (* probs) from FC1's output h, in one pass over h (csrc/grouped_quantize.cu's
// activate_quantize); the rest goes to the op's Python kernel.
Quantized moe_activation_quantize_cuda(const at::Tensor& h, const at::Tensor& offs, const std::string& activation,
                                       const std::string& gate_up_layout, const std::string& recipe,
                                       const std::optional<at::Tensor>& probs, bool rowwise, bool columnwise,
                                       double alpha, double limit) {
  check_moe_activation_quantize(h, offs, activation, gate_up_layout, recipe, probs, rowwise, columnwise);
  c10::DeviceGuard guard(h.device());
  const int code = activation_code(activation);
  std::optional<QuantizeColumnsPlan> plan;
  if (rowwise && columnwise && recipe == kRecipes[1] && reinterpret_cast<uint64_t>(h.data_ptr()) % 16 == 0) {
    static PlanCache<QuantizeColumnsPlan> plans;
    const ShapeKey key{{h.size(0), h.size(1), offs.size(0), h.stride(0), h.stride(1), static_cast<int64_t>(h.scalar_type()),
                        code, h.device().index(), 0, 0, 0, 0, 0}};
    plan = plans.get(key, [&] { return activation_plan()(h, offs, activation); });
  }
  if (!plan) {
    pybind11::gil_scoped_acquire gil;
    return activation_python_kernel()(h, offs, activation, gate_up_layout, recipe, probs, rowwise, columnwise, alpha,
                                      limit)
        .cast<Quantized>();
  }
  const at::Tensor probs32 = probs ? probs->to(at::kFloat).contiguous() : at::Tensor();
  const ActivationArgs act{code, gate_up_layout == kLayouts[1], probs ? probs32.data_ptr() : nullptr,
                           static_cast<float>(alpha), static_cast<float>(limit)};
  return launch_columns(h, offs, code < kGated ? h.size(1) / 2 : h.size(1), *plan, true, &act);
}

// ------------------------------------------------------------------------------ scaled_grouped_mm


pybind11::object& scaled_mm_plan() {  // kernels/scaled_grouped_mm_sm90.py's host_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& scaled_mm_python_kernel() {  // the op's Python kernel
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

bool fp8_triton_forced() {  // COMPILED_MOE_FP8_GEMM=triton turns the CUDA kernel off
  const char* gemm = std::getenv("COMPILED_MOE_FP8_GEMM");
  return gemm != nullptr && std::string(gemm) == "triton";
}

// kernels/scaled_grouped_mm_sm90.py's scale_offsets_fit: the largest scale offset below 2^30.
bool scale_offsets_fit(const at::Tensor& a_scale, const at::Tensor& b_scale) {
  for (const at::Tensor* t : {&a_scale, &b_scale}) {
    int64_t last = 0;
    for (int64_t d = 0; d < t->dim(); ++d) last += (t->size(d) - 1) * t->stride(d);
    if (last >= (int64_t(1) << 30)) return false;
  }
  return true;
}


}  // namespace


// out (M, N) = a (M, K) @ b (G, K, N) (+ bias (G, N)) from e4m3 K-major operands and their
// fp8_blockwise scales: the maps and launch of csrc/fp8_grouped_mm.cu's forward kernel (its only
// launcher: kernels/scaled_grouped_mm_sm90.py's scaled_grouped_mm calls this). The caller checked that the kernel applies (the plan's conditions, M, N,
// K > 0, aligned addresses).
void launch_fp8_blockwise_sm90(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                               const at::Tensor& b_scale, const at::Tensor& offs,
                               const std::optional<at::Tensor>& bias, const at::Tensor& out, const ScaledGroupedMmPlan& plan) {
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(2);
  const int device = a.device().index();
  ensure_context(device);
  const uint64_t a_ptr = reinterpret_cast<uint64_t>(a.data_ptr());
  // Boxes of 64 rows (a tile's two halves), and of 16 rows where a group has a few rows left.
  CUtensorMap a_map = map2d(a_ptr, K, M, a.stride(0), 128, 64);
  CUtensorMap a_rows_map = map2d(a_ptr, K, M, a.stride(0), 128, 16);
  CUtensorMap b_map = tensor_map({reinterpret_cast<uint64_t>(b.data_ptr()), {uint64_t(K), uint64_t(N), uint64_t(G)},
                                  {uint64_t(b.stride(2)), uint64_t(b.stride(0))}, {128, 128, 1}, 3,
                                  CU_TENSOR_MAP_DATA_TYPE_UINT8});
  const int64_t es = out.element_size();
  CUtensorMap out_map = tensor_map({reinterpret_cast<uint64_t>(out.data_ptr()), {uint64_t(N), uint64_t(M), 1},
                                    {uint64_t(out.stride(0) * es), uint64_t(out.stride(0) * es * M)},
                                    {uint32_t(128 / es), 64, 1}, 3, out_map_type(out.scalar_type())});
  const at::Tensor offs_c = offs.contiguous(), bias_t = bias_in_pairs(bias);
  void *a_scale_p = a_scale.data_ptr(), *b_scale_p = b_scale.data_ptr(), *out_p = out.data_ptr(),
       *bias_p = bias_t.defined() ? bias_t.data_ptr() : nullptr, *offs_p = offs_c.data_ptr();
  int64_t a_scale_0 = a_scale.stride(0), b_scale_0 = b_scale.stride(0), out_stride = out.stride(0),
          bias_stride = bias_t.defined() ? bias_t.stride(0) : 0;
  int32_t a_scale_1 = static_cast<int32_t>(a_scale.stride(1)), b_scale_1 = static_cast<int32_t>(b_scale.stride(1)),
          b_scale_2 = static_cast<int32_t>(b_scale.stride(2)), kind = out_kind(out.scalar_type()),
          bias_kind = bias_t.defined() ? out_kind(bias_t.scalar_type()) : -1, m = static_cast<int32_t>(M),
          n = static_cast<int32_t>(N), k = static_cast<int32_t>(K), g = static_cast<int32_t>(G),
          stages = plan.num_stages;
  void* args[] = {&a_map,     &a_rows_map, &b_map, &out_map, &a_scale_p, &a_scale_0, &a_scale_1, &b_scale_p,
                  &b_scale_0, &b_scale_1,  &b_scale_2, &out_p, &kind,   &out_stride, &bias_p,   &bias_kind,
                  &bias_stride, &offs_p,   &m,     &n,       &k,         &g,         &stages};
  launch(device, plan.function, plan.grid, SM90_THREADS, plan.shared_bytes, args);
}

namespace {

at::Tensor scaled_grouped_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                                  const at::Tensor& b_scale, const at::Tensor& offs, const std::string& recipe,
                                  std::optional<c10::ScalarType> out_dtype, const std::optional<at::Tensor>& bias) {
  check_scaled_grouped_mm(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias);
  c10::DeviceGuard guard(a.device());
  const c10::ScalarType out_type = out_dtype.value_or(at::kBFloat16);
  std::optional<ScaledGroupedMmPlan> plan;
  if (recipe == kRecipes[1]) {
    static PlanCache<ScaledGroupedMmPlan> plans;
    const ShapeKey key{{a.size(0), b.size(2), a.size(1), b.size(0), a.stride(0), b.stride(0), b.stride(2),
                        static_cast<int64_t>(out_type),
                        bias ? static_cast<int64_t>(bias->scalar_type()) * 2 + (bias->stride(1) == 1) : -1,
                        a.device().index(), scale_offsets_fit(a_scale, b_scale), fp8_triton_forced(), 0}};
    plan = plans.get(key, [&] { return scaled_mm_plan()(a, b, a_scale, b_scale, bias, out_type); });
  }
  if (!plan || !tma_aligned({&a, &b})) {
    pybind11::gil_scoped_acquire gil;
    return scaled_mm_python_kernel()(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias).cast<at::Tensor>();
  }
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options().dtype(out_type));
  launch_fp8_blockwise_sm90(a, b, a_scale, b_scale, offs, bias, out, *plan);
  return out;
}

// ------------------------------------------------------------------------------ scaled_grouped_mm_wgrad


pybind11::object& wgrad_plan() {  // kernels/scaled_grouped_mm_sm90.py's host_wgrad_plan
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}
pybind11::object& wgrad_python_kernel() {  // scaled_grouped_mm_wgrad's Python kernel
  static pybind11::object* fn = new pybind11::object();
  return *fn;
}

}  // namespace


// out[g] (P, Q) = a_g^T @ d_g from columnwise e4m3 data a_t (P, M), d_t (Q, M) and their
// scales: the maps and launches of the weight-gradient kernels (their only launcher:
// kernels/scaled_grouped_mm_sm90.py's scaled_grouped_mm_wgrad calls this) (wgrad_tile_order, then the kernel and its _claimed twin, of which the one not chosen
// returns at once). The caller checked that the kernel applies (the plan's conditions, P, Q,
// G > 0, aligned addresses); out (G, P, Q) contiguous.
void launch_fp8_wgrad_sm90(const at::Tensor& a_t, const at::Tensor& d_t, const at::Tensor& a_scale,
                           const at::Tensor& d_scale, const at::Tensor& offs, bool rowwise_recipe, const at::Tensor& out,
                           const ScaledGroupedMmWgradPlan& plan) {
  const int64_t P = a_t.size(0), M = a_t.size(1), Q = d_t.size(0), G = out.size(0);
  const int device = a_t.device().index();
  ensure_context(device);
  const uint64_t m_extent = std::max<int64_t>(M, 1);  // a tensor map needs a nonzero extent; M = 0 loads nothing
  const uint64_t a_ptr = reinterpret_cast<uint64_t>(a_t.data_ptr()), d_ptr = reinterpret_cast<uint64_t>(d_t.data_ptr());
  CUtensorMap a_map = map2d(a_ptr, m_extent, P, a_t.stride(0), 128, 128);
  CUtensorMap d_map = map2d(d_ptr, m_extent, Q, d_t.stride(0), 128, 128);
  // 16 rows past an unaligned group's window (csrc/fp8_grouped_mm.cu: shift_chunk)
  CUtensorMap a_side_map = map2d(a_ptr, m_extent, P, a_t.stride(0), 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  CUtensorMap d_side_map = map2d(d_ptr, m_extent, Q, d_t.stride(0), 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  const int64_t es = out.element_size();
  CUtensorMap out_map = tensor_map({reinterpret_cast<uint64_t>(out.data_ptr()), {uint64_t(Q), uint64_t(P), uint64_t(G)},
                                    {uint64_t(out.stride(1) * es), uint64_t(out.stride(0) * es)},
                                    {uint32_t(128 / es), 64, 1}, 3, out_map_type(out.scalar_type())});
  at::Tensor order = at::empty({2}, a_t.options().dtype(at::kInt));  // the choice, the claims' counter
  at::Tensor maps = at::empty({G * 2 * 128}, a_t.options().dtype(at::kByte));
  const at::Tensor offs_c = offs.contiguous();
  void *offs_p = offs_c.data_ptr(), *order_p = order.data_ptr(), *maps_p = maps.data_ptr(),
       *a_scale_p = a_scale.data_ptr(), *d_scale_p = d_scale.data_ptr();
  int32_t m = static_cast<int32_t>(M), p = static_cast<int32_t>(P), q = static_cast<int32_t>(Q),
          g = static_cast<int32_t>(G), tiles = plan.tiles_per_group, rows_per_step = 128,
          claim_steps = plan.claim_steps, grid = static_cast<int32_t>(plan.grid), row_dim = 0,
          kind = out_kind(out.scalar_type()), stages = plan.num_stages, rowwise = rowwise_recipe,
          a_scale_1 = static_cast<int32_t>(a_scale.stride(1)), d_scale_1 = static_cast<int32_t>(d_scale.stride(1));
  int64_t a_scale_0 = a_scale.stride(0), d_scale_0 = d_scale.stride(0);
  void* order_args[] = {&offs_p, &m, &g, &tiles, &rows_per_step, &claim_steps, &grid, &order_p, &a_map, &d_map,
                        &maps_p, &row_dim};
  launch(device, plan.tile_order, 1, ORDER_THREADS, ORDER_SCRATCH_BYTES, order_args);
  void* args[] = {&a_map, &d_map,     &a_side_map, &d_side_map, &out_map, &a_scale_p, &a_scale_0,
                  &a_scale_1, &d_scale_p, &d_scale_0, &d_scale_1, &kind, &offs_p, &m, &p, &q, &g, &stages,
                  &rowwise, &maps_p, &order_p};
  launch(device, plan.function, plan.grid, SM90_THREADS, plan.shared_bytes, args);
  launch(device, plan.claimed, plan.grid, SM90_THREADS, plan.shared_bytes, args);
}

namespace {

// torch.ops.compiled_moe.scaled_grouped_mm_wgrad's CUDA kernel: the Hopper kernel where it
// applies (every group, wherever it starts), else the op's Python kernel.
at::Tensor scaled_grouped_mm_wgrad_cuda(const at::Tensor& a_t, const at::Tensor& d_t, const at::Tensor& a_scale,
                                        const at::Tensor& d_scale, const at::Tensor& offs, const std::string& recipe,
                                        std::optional<c10::ScalarType> out_dtype) {
  check_scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype);
  c10::DeviceGuard guard(a_t.device());
  const c10::ScalarType out_type = out_dtype.value_or(at::kBFloat16);
  std::optional<ScaledGroupedMmWgradPlan> plan;
  if (recipe != kRecipes[2]) {
    static PlanCache<ScaledGroupedMmWgradPlan> plans;
    const ShapeKey key{{a_t.size(0), d_t.size(0), a_t.size(1), offs.size(0), a_t.stride(0), d_t.stride(0),
                        static_cast<int64_t>(out_type), recipe == kRecipes[0], a_t.device().index(),
                        fp8_triton_forced(), 0, 0, 0}};
    plan = plans.get(key, [&] { return wgrad_plan()(a_t, d_t, recipe, out_type, offs.size(0)); });
  }
  at::Tensor out = at::empty({offs.size(0), a_t.size(0), d_t.size(0)}, a_t.options().dtype(out_type));
  if (!plan || !tma_aligned({&a_t, &d_t, &out}) || a_t.size(1) == 0) {
    pybind11::gil_scoped_acquire gil;
    return wgrad_python_kernel()(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype).cast<at::Tensor>();
  }
  launch_fp8_wgrad_sm90(a_t, d_t, a_scale, d_scale, offs, recipe == kRecipes[0], out, *plan);
  return out;
}

torch::Library& library() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "compiled_moe", std::nullopt, __FILE__, __LINE__);
  return *lib;
}

}  // namespace
#endif  // COMPILED_MOE_CUDA

// ------------------------------------------------------------------------------ fp8_grouped_mm
// compiled_moe.fp8_grouped_mm's autograd function (compiled_moe/fp8.py's _FP8GroupedMM), as a
// C++ autograd function composed of the FP8 ops through the dispatcher below autograd: on CUDA
// each is this layer's kernel, so neither forward nor backward enters Python; elsewhere the
// ops' own kernels serve (the CPU tier compares it with the Python function to the bit).

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x,
                                                                    const std::optional<at::Tensor>& offs,
                                                                    const std::string& recipe, bool rowwise,
                                                                    bool columnwise) {
  static auto op = package_op<Quantized(const at::Tensor&, const std::optional<at::Tensor>&, const std::string&, bool,
                                       bool)>("compiled_moe::grouped_quantize");
  return op.call(x, offs, recipe, rowwise, columnwise);
}

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                     const at::Tensor& offs, const std::string& recipe, c10::ScalarType out_dtype,
                     const std::optional<at::Tensor>& bias) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const std::string&, std::optional<c10::ScalarType>,
                                         const std::optional<at::Tensor>&)>("compiled_moe::scaled_grouped_mm");
  return op.call(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias);
}

at::Tensor scaled_mm_wgrad(const at::Tensor& a_t, const at::Tensor& d_t, const at::Tensor& a_scale,
                           const at::Tensor& d_scale, const at::Tensor& offs, const std::string& recipe,
                           c10::ScalarType out_dtype) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const std::string&, std::optional<c10::ScalarType>)>(
      "compiled_moe::scaled_grouped_mm_wgrad");
  return op.call(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype);
}

at::Tensor grouped_sum(const at::Tensor& x, const at::Tensor& offs, c10::ScalarType out_dtype) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, std::optional<c10::ScalarType>)>(
      "compiled_moe::grouped_sum");
  return op.call(x, offs, out_dtype);
}

Quantized activation_quantize(const at::Tensor& h, const at::Tensor& offs, const std::string& activation,
                              const std::string& layout, const std::string& recipe,
                              const std::optional<at::Tensor>& probs, bool columnwise, double alpha, double limit) {
  static auto op = package_op<Quantized(const at::Tensor&, const at::Tensor&, const std::string&, const std::string&,
                                        const std::string&, const std::optional<at::Tensor>&, bool, bool, double,
                                        double)>("compiled_moe::moe_activation_quantize");
  return op.call(h, offs, activation, layout, recipe, probs, true, columnwise, alpha, limit);
}

std::tuple<at::Tensor, at::Tensor> scaled_activation_backward(const at::Tensor& grad, const at::Tensor& h,
                                                              const at::Tensor& probs, const std::string& activation,
                                                              const std::string& layout, double alpha, double limit) {
  static auto op = package_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const std::string&,
                                                                  const std::string&, double, double)>(
      "compiled_moe::moe_scaled_activation_backward");
  return op.call(grad, h, probs, activation, layout, alpha, limit);
}

at::Tensor activation_backward(const at::Tensor& grad, const at::Tensor& h, const std::string& activation,
                               const std::string& layout, double alpha, double limit) {
  static auto op = package_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::string&, const std::string&,
                                         double, double)>("compiled_moe::moe_activation_backward");
  return op.call(grad, h, activation, layout, alpha, limit);
}

std::optional<at::Tensor> first(at::TensorList list) {  // an optional tensor passed as a list of 0 or 1
  return list.empty() ? std::nullopt : std::optional<at::Tensor>(list[0]);
}

// The FP8 GEMM of both functions' forward: out = a @ b[g] (+ bias[g]) from a's quantization and
// the weight's (weight_fp8, or made here: rowwise, and columnwise where dgrad needs it); saves
// what _backward reads. ctx's saved tensors: a's and the weight's columnwise data and scales,
// offs, then `extra`.
at::Tensor fp8_forward(torch::autograd::AutogradContext* ctx, const Quantized& a_fp8, c10::ScalarType a_dtype,
                       const at::Tensor& b, const at::Tensor& offs, const std::optional<at::Tensor>& bias,
                       const std::string& recipe, at::TensorList weight_fp8, bool need_dgrad,
                       std::vector<at::Tensor> extra) {
  // b (G, K, N) is usually the transposed view of a (G, N, K) weight: b.mT is that weight.
  const Quantized w = weight_fp8.empty() ? quantize(b.mT(), std::nullopt, recipe, true, need_dgrad)
                                         : Quantized{weight_fp8[0], weight_fp8[1], weight_fp8[2], weight_fp8[3]};
  at::Tensor out = scaled_mm(std::get<0>(a_fp8), std::get<0>(w).mT(), std::get<1>(a_fp8), std::get<1>(w), offs,
                             recipe, a_dtype, bias);
  std::vector<at::Tensor> saved = {std::get<2>(a_fp8), std::get<3>(a_fp8), std::get<2>(w), std::get<3>(w), offs};
  saved.insert(saved.end(), extra.begin(), extra.end());
  ctx->save_for_backward(saved);
  ctx->saved_data["recipe"] = recipe;
  ctx->saved_data["a_dtype"] = static_cast<int64_t>(a_dtype);
  ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
  ctx->saved_data["b_transposed"] = is_transposed_weight(b);
  ctx->saved_data["bias_dtype"] = bias ? static_cast<int64_t>(bias->scalar_type()) : int64_t(-1);
  return out;
}

// compiled_moe/fp8.py's _backward: (grad of a, of b, of bias) from fp8_forward's saved tensors:
// dgrad from the weight's columnwise data, the weight gradient from the columnwise data of a
// and of the gradient, dbias from the unquantized gradient (undefined where not needed).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_backward(torch::autograd::AutogradContext* ctx,
                                                            const torch::autograd::variable_list& saved,
                                                            const at::Tensor& grad, bool need_a, bool need_b,
                                                            bool need_bias) {
  const at::Tensor &a_col = saved[0], &a_col_s = saved[1], &w_col = saved[2], &w_col_s = saved[3], &offs = saved[4];
  const std::string recipe = ctx->saved_data["recipe"].toStringRef();
  const auto a_dtype = static_cast<c10::ScalarType>(ctx->saved_data["a_dtype"].toInt());
  const auto b_dtype = static_cast<c10::ScalarType>(ctx->saved_data["b_dtype"].toInt());
  const int64_t bias_dtype = ctx->saved_data["bias_dtype"].toInt();
  at::Tensor grad_a, grad_b, grad_bias;
  if (need_a || need_b) {
    auto [g_q, g_s, g_col, g_col_s] = quantize(grad.to(a_dtype), offs, recipe, need_a, need_b);
    // dgrad: grad (M, N) @ W (N, K); w_col (G, K, N) is W's columnwise data.
    if (need_a) grad_a = scaled_mm(g_q, w_col.mT(), g_s, w_col_s, offs, recipe, a_dtype, std::nullopt);
    if (need_b && ctx->saved_data["b_transposed"].toBool()) {  // (G, N, K), the weight's own storage order
      grad_b = scaled_mm_wgrad(g_col, a_col, g_col_s, a_col_s, offs, recipe, b_dtype).mT();
    } else if (need_b) {
      grad_b = scaled_mm_wgrad(a_col, g_col, a_col_s, g_col_s, offs, recipe, b_dtype);
    }
  }
  if (bias_dtype >= 0 && need_bias) grad_bias = grouped_sum(grad, offs, static_cast<c10::ScalarType>(bias_dtype));
  return {grad_a, grad_b, grad_bias};
}

// Backward's ops dispatch straight to their kernels where nothing records them (no
// create_graph).
struct BelowAutogradUnlessRecording {
  std::optional<at::AutoDispatchBelowADInplaceOrView> guard;
  BelowAutogradUnlessRecording() {
    if (!at::GradMode::is_enabled()) guard.emplace();
  }
};

// fp8_grouped_mm. Inputs: a, b, offs, then the bias as a list of zero or one tensors (autograd
// takes no undefined tensor and gives an optional<Tensor> no gradient), the weight's
// quantization (quantize_weight's four tensors, or none), and whether a and b need gradients
// (which directions of a and of the weight forward must quantize).
class Fp8GroupedMmFunction : public torch::autograd::Function<Fp8GroupedMmFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& offs, at::TensorList bias, const std::string& recipe,
                            at::TensorList weight_fp8, bool need_a, bool need_b) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["inputs"] = static_cast<int64_t>(6 + bias.size() + weight_fp8.size());  // as forward's arguments
    return fp8_forward(ctx, quantize(a, offs, recipe, true, need_b), a.scalar_type(), b,
                       offs, first(bias), recipe, weight_fp8, need_a, {});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    BelowAutogradUnlessRecording below_autograd;
    const bool has_bias = ctx->saved_data["bias_dtype"].toInt() >= 0;
    auto [grad_a, grad_b, grad_bias] = fp8_backward(ctx, ctx->get_saved_variables(), grads[0], ctx->needs_input_grad(0),
                                                    ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(3));
    torch::autograd::variable_list out = {grad_a, grad_b, at::Tensor()};  // a, b, offs
    if (has_bias) out.push_back(grad_bias);
    out.resize(ctx->saved_data["inputs"].toInt());  // the rest take no gradient
    return out;
  }
};

// fp8_activation_grouped_mm (FC2 of the FP8 MLP): out = (act(h) (* probs)) @ b[g] (+ bias[g]),
// FC2's input quantized both ways from h by moe_activation_quantize (compiled_moe/fp8.py's
// _FP8ActivationGroupedMM). Inputs: h, b, offs, probs and bias as lists of zero or one, the
// weight's quantization, the activation, and whether h, b and probs need gradients. Keeps h
// (the activation's backward recomputes from it) and the activation's columnwise FP8 data.
class Fp8ActivationGroupedMmFunction : public torch::autograd::Function<Fp8ActivationGroupedMmFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h, const at::Tensor& b,
                            const at::Tensor& offs, at::TensorList probs, at::TensorList bias,
                            const std::string& recipe, at::TensorList weight_fp8, const std::string& activation,
                            const std::string& gate_up_layout, double alpha, double limit, bool need_h, bool need_b,
                            bool need_probs) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["inputs"] = static_cast<int64_t>(11 + probs.size() + bias.size() + weight_fp8.size());
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["gate_up_layout"] = gate_up_layout;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    std::vector<at::Tensor> extra = {h};
    if (!probs.empty()) extra.push_back(probs[0]);
    const Quantized a_fp8 = activation_quantize(h, offs, activation, gate_up_layout, recipe, first(probs), need_b,
                                                alpha, limit);
    return fp8_forward(ctx, a_fp8, h.scalar_type(), b, offs, first(bias), recipe, weight_fp8, need_h || need_probs,
                       extra);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    BelowAutogradUnlessRecording below_autograd;
    const auto saved = ctx->get_saved_variables();
    const bool has_probs = saved.size() > 6, has_bias = ctx->saved_data["bias_dtype"].toInt() >= 0;
    const bool need_h = ctx->needs_input_grad(0), need_probs = has_probs && ctx->needs_input_grad(3);
    const size_t bias_index = has_probs ? 4 : 3;
    auto [grad_a, grad_b, grad_bias] = fp8_backward(ctx, saved, grads[0], need_h || need_probs, ctx->needs_input_grad(1),
                                                    has_bias && ctx->needs_input_grad(bias_index));
    const at::Tensor& h = saved[5];
    const std::string& activation = ctx->saved_data["activation"].toStringRef();
    const std::string& layout = ctx->saved_data["gate_up_layout"].toStringRef();
    const double alpha = ctx->saved_data["alpha"].toDouble(), limit = ctx->saved_data["limit"].toDouble();
    at::Tensor grad_h, grad_probs;
    if (grad_a.defined() && has_probs) {  // a = act(h) * probs
      std::tie(grad_h, grad_probs) = scaled_activation_backward(grad_a, h, saved[6], activation, layout, alpha, limit);
      grad_probs = grad_probs.to(saved[6].scalar_type());
    } else if (grad_a.defined()) {
      grad_h = activation_backward(grad_a, h, activation, layout, alpha, limit);
    }
    torch::autograd::variable_list out = {grad_h, grad_b, at::Tensor()};  // h, b, offs
    if (has_probs) out.push_back(grad_probs);
    if (has_bias) out.push_back(grad_bias);
    out.resize(ctx->saved_data["inputs"].toInt());  // the rest take no gradient
    return out;
  }
};

}  // namespace

// compiled_moe/fp8.py's _check_weight_fp8, past its check that weight_fp8 is a tuple of 4.
void check_weight_fp8(at::TensorList weight_fp8, const at::Tensor& b, const std::string& recipe) {
  const c10::SymInt &g = b.sym_size(0), &k = b.sym_size(1), &n = b.sym_size(2);  // b.mT is (G, N, K)
  const int64_t rows = weight_block_rows(recipe), columns = block_columns(recipe);
  const std::array<std::vector<c10::SymInt>, 4> shapes = {
      std::vector<c10::SymInt>{g, n, k}, std::vector<c10::SymInt>{g, (n + rows - 1) / rows, blocks(k, columns)},
      std::vector<c10::SymInt>{g, k, n}, std::vector<c10::SymInt>{g, (k + rows - 1) / rows, blocks(n, columns)}};
  for (size_t i = 0; i < 4; ++i) {
    const at::Tensor& t = weight_fp8[i];
    const c10::ScalarType dtype = i % 2 ? scale_dtype(recipe) : at::kFloat8_e4m3fn;
    CM_CHECK_VALUE(t.sym_sizes() == c10::SymIntArrayRef(shapes[i]) && t.scalar_type() == dtype, "weight_fp8[", i,
                   "] must be ", shape_str(shapes[i]), " ", dtype_name(dtype), ", as quantize_weight(b.mT, ",
                   py_repr(recipe), ") gives, got (", shape_str(t.sym_sizes()), ", ", dtype_name(t.scalar_type()), ")");
    CM_CHECK_VALUE(t.device() == b.device(), "weight_fp8[", i, "] is on ", t.device().str(), " but b is on ",
                   b.device().str());
  }
}

// compiled_moe/fp8.py's _check_operands, past its check that weight_fp8 is a tuple of 4
// tensors (given here as a list of 4, or empty).
void check_fp8_operands(const char* a_name, const at::Tensor& a, const at::Tensor& b, const std::string& recipe,
                        at::TensorList weight_fp8) {
  check_recipe(recipe);
  check_tensor(a_name, a, 2);
  check_tensor("b", b, 3);
  if (!weight_fp8.empty()) check_weight_fp8(weight_fp8, b, recipe);
}

std::vector<at::Tensor> as_list(const std::optional<at::Tensor>& t) {
  return t ? std::vector<at::Tensor>{*t} : std::vector<at::Tensor>{};
}

// compiled_moe.fp8_grouped_mm past its Python wrapper's check of weight_fp8's type: the
// wrapper's checks, then the autograd function.
at::Tensor fp8_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                          const std::optional<at::Tensor>& bias, const std::string& recipe,
                          std::vector<at::Tensor> weight_fp8) {
  check_fp8_operands("a", a, b, recipe, weight_fp8);
  const bool grad = at::GradMode::is_enabled();
  return Fp8GroupedMmFunction::apply(a, b, offs, at::TensorList(as_list(bias)), recipe, at::TensorList(weight_fp8),
                                     grad && a.requires_grad(), grad && b.requires_grad());
}

// compiled_moe.fp8_activation_grouped_mm past its Python wrapper's check of weight_fp8's type
// (alpha and limit: the activation's constants as the ops take them).
at::Tensor fp8_activation_grouped_mm(const at::Tensor& h, const at::Tensor& b, const at::Tensor& offs,
                                     const std::optional<at::Tensor>& probs, const std::optional<at::Tensor>& bias,
                                     const std::string& recipe, std::vector<at::Tensor> weight_fp8,
                                     const std::string& activation, const std::string& gate_up_layout, double alpha,
                                     double limit) {
  check_fp8_operands("h", h, b, recipe, weight_fp8);
  const bool grad = at::GradMode::is_enabled();
  return Fp8ActivationGroupedMmFunction::apply(h, b, offs, at::TensorList(as_list(probs)),
                                               at::TensorList(as_list(bias)), recipe, at::TensorList(weight_fp8),
                                               activation, gate_up_layout, alpha, limit, grad && h.requires_grad(),
                                               grad && b.requires_grad(), grad && probs && probs->requires_grad());
}

// compiled_moe::grouped_quantize's CUDA kernel: plan(x, offs, rowwise) gives the columnwise
// kernel's plan for 2-D fp8_blockwise x, or None; rows(x) the rowwise kernel's of x's dtype and
// device, or None; python_kernel(x, offs, recipe, rowwise, columnwise) serves the rest. Returns
// the dispatch keys registered.
std::vector<std::string> register_grouped_quantize(pybind11::object plan, pybind11::object rows,
                                                   pybind11::object python_kernel_fn) {
#ifdef COMPILED_MOE_CUDA
  columns_plan() = std::move(plan);
  rows_plan() = std::move(rows);
  quantize_python_kernel() = std::move(python_kernel_fn);
  library().impl("grouped_quantize", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(grouped_quantize_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

// compiled_moe::scaled_grouped_mm's CUDA kernel: plan(a, b, a_scale, b_scale, bias, out_dtype)
// gives the Hopper kernel's plan for fp8_blockwise operands, or None; python_kernel(a, b,
// a_scale, b_scale, offs, recipe, out_dtype, bias) serves the rest. Returns the dispatch keys
// registered.
std::vector<std::string> register_scaled_grouped_mm(pybind11::object plan, pybind11::object python_kernel_fn) {
#ifdef COMPILED_MOE_CUDA
  scaled_mm_plan() = std::move(plan);
  scaled_mm_python_kernel() = std::move(python_kernel_fn);
  library().impl("scaled_grouped_mm", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(scaled_grouped_mm_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

// compiled_moe::scaled_grouped_mm_wgrad's CUDA kernel: plan(a_t, d_t, recipe, out_dtype,
// num_groups) gives the Hopper kernel's plan (fp8_blockwise, fp8_rowwise), or None;
// python_kernel(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype) serves the rest. Returns the
// dispatch keys registered.
std::vector<std::string> register_scaled_grouped_mm_wgrad(pybind11::object plan, pybind11::object python_kernel_fn) {
#ifdef COMPILED_MOE_CUDA
  wgrad_plan() = std::move(plan);
  wgrad_python_kernel() = std::move(python_kernel_fn);
  library().impl("scaled_grouped_mm_wgrad",
                 torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(scaled_grouped_mm_wgrad_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

// compiled_moe::moe_activation_quantize's CUDA kernel: plan(h, offs, activation) gives the
// activate_quantize kernel's plan (fp8_blockwise both ways), or None; python_kernel(h, offs,
// activation, gate_up_layout, recipe, probs, rowwise, columnwise, alpha, limit) serves the rest.
// Returns the dispatch keys registered.
std::vector<std::string> register_moe_activation_quantize(pybind11::object plan, pybind11::object python_kernel_fn) {
#ifdef COMPILED_MOE_CUDA
  activation_plan() = std::move(plan);
  activation_python_kernel() = std::move(python_kernel_fn);
  library().impl("moe_activation_quantize",
                 torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(moe_activation_quantize_cuda)));
  return {"CUDA"};
#else
  return {};
#endif
}

void bind_fp8(pybind11::module_& m) {
  m.def("register_grouped_quantize", &register_grouped_quantize);
  m.def("register_scaled_grouped_mm", &register_scaled_grouped_mm);
  m.def("register_moe_activation_quantize", &register_moe_activation_quantize);
  m.def("register_scaled_grouped_mm_wgrad", &register_scaled_grouped_mm_wgrad);
  // The checks alone (the CUDA kernels make them), for tests on any machine.
  m.def("check_grouped_quantize", &check_grouped_quantize);
  m.def("check_scaled_grouped_mm", &check_scaled_grouped_mm);
  m.def("check_moe_activation_quantize", &check_moe_activation_quantize);
  m.def("check_scaled_grouped_mm_wgrad", &check_scaled_grouped_mm_wgrad);
  m.def("check_weight_fp8", &check_weight_fp8);
  m.def("fp8_grouped_mm", &fp8_grouped_mm);
  m.def("fp8_activation_grouped_mm", &fp8_activation_grouped_mm);
#ifdef COMPILED_MOE_CUDA
  // kernels/scaled_grouped_mm_sm90.py's launcher launches through it (plan: its ScaledGroupedMmPlan).
  m.def("launch_fp8_blockwise_sm90",
        [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
           const at::Tensor& offs, const std::optional<at::Tensor>& bias, const at::Tensor& out,
           pybind11::handle plan) {
          launch_fp8_blockwise_sm90(a, b, a_scale, b_scale, offs, bias, out, ScaledGroupedMmPlan::read(plan));
        });
  // and its weight-gradient launcher (plan: its ScaledGroupedMmWgradPlan).
  m.def("launch_fp8_wgrad_sm90",
        [](const at::Tensor& a_t, const at::Tensor& d_t, const at::Tensor& a_scale, const at::Tensor& d_scale,
           const at::Tensor& offs, bool rowwise_recipe, const at::Tensor& out, pybind11::handle plan) {
          launch_fp8_wgrad_sm90(a_t, d_t, a_scale, d_scale, offs, rowwise_recipe, out, ScaledGroupedMmWgradPlan::read(plan));
        });
#endif
}

}  // namespace compiled_moe
