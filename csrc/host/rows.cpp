// The C++ host layer's row ops: the CUDA kernels of moe_permute, moe_unpermute (and its
// weights' backward), moe_activation (and its backward) and grouped_sum, from the dispatcher
// to the driver without Python (checks with the Python messages, the device guard, the launch
// of csrc/moe_rows.cu's kernels on torch's current stream).
//
// Their autograd formulas stay Python's (ops/routing.py, ops/activations.py,
// ops/grouped_mm.py), as do their fake functions and the traced bodies that compiled graphs
// inline. What these kernels do not take (float64, which the reference serves; GPUs before
// sm_80) goes to the op's Python kernel, handed over at registration.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "checks.h"
#include "bindings.h"

#if __has_include(<cuda.h>)
#define COMPILED_MOE_CUDA 1
#include "cuda_driver.h"
#include "kernels.h"
#endif

namespace compiled_moe {

// ------------------------------------------------------------------------------ checks
// compiled_moe/ops/routing.py's _check_layout, _check_pair_tensor, _check_permute,
// _check_unpermute and _check_unpermute_backward.

namespace {

void check_layout(const char* name, const at::Tensor& x, const at::Tensor& row_of, const at::Tensor& source) {
  check_tensor(name, x, 2);
  check_int32_tensor("row_of", row_of, 2);
  check_int32_tensor("source", source, 1);
  check_same_device(name, x, "row_of", row_of);
  check_same_device(name, x, "source", source);
}

void check_pair_tensor(const char* name, const std::optional<at::Tensor>& t, const at::Tensor& row_of) {
  if (!t) return;
  check_dims(name, *t, 2);
  CM_CHECK_TYPE(at::isFloatingType(t->scalar_type()), name, " must be a floating-point tensor, got ",
                dtype_name(t->scalar_type()));
  CM_CHECK_VALUE(t->sym_sizes() == row_of.sym_sizes(), name, " must be (T, k) = ", shape_str(row_of.sym_sizes()),
                 " like row_of, got ", shape_str(t->sym_sizes()));
  check_same_device("row_of", row_of, name, *t);
}

void check_permute_as(const char* name, const at::Tensor& hidden, const at::Tensor& row_of, const at::Tensor& source,
                      const std::optional<at::Tensor>& scale) {
  check_layout(name, hidden, row_of, source);
  CM_CHECK_VALUE(hidden.sym_size(0) == row_of.sym_size(0), name, " has ", size_str(hidden.sym_size(0)),
                 " tokens but row_of is ", shape_str(row_of.sym_sizes()), "; they must match");
  check_pair_tensor("scale", scale, row_of);
}

c10::SymInt activation_columns(const at::Tensor& h, int code) {
  return code < kGated ? h.sym_size(1) / 2 : h.sym_size(1);
}

}  // namespace

void check_moe_permute(const at::Tensor& hidden, const at::Tensor& row_of, const at::Tensor& source,
                       const std::optional<at::Tensor>& scale) {
  check_permute_as("hidden", hidden, row_of, source, scale);
}

void check_moe_unpermute(const at::Tensor& y, const at::Tensor& row_of, const at::Tensor& source,
                         const std::optional<at::Tensor>& weights) {
  check_layout("y", y, row_of, source);
  CM_CHECK_VALUE(y.sym_size(0) == source.sym_size(0), "y has ", size_str(y.sym_size(0)), " rows but source has ",
                 size_str(source.sym_size(0)), "; y must hold one row per sorted row");
  check_pair_tensor("weights", weights, row_of);
}

void check_moe_unpermute_backward(const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& row_of,
                                  const at::Tensor& source, const at::Tensor& weights) {
  check_moe_unpermute(y, row_of, source, weights);
  check_permute_as("grad_out", grad_out, row_of, source, weights);
  CM_CHECK_VALUE(grad_out.sym_size(1) == y.sym_size(1), "grad_out has ", size_str(grad_out.sym_size(1)),
                 " columns but y has ", size_str(y.sym_size(1)), "; they must match");
}

// ops/activations.py's check_activation_input and _check_backward.
void check_moe_activation(const at::Tensor& h, const std::string& activation, const std::string& gate_up_layout) {
  check_tensor("h", h, 2);
  const int code = activation_code(activation);
  CM_CHECK_VALUE(code >= 0, "activation must be one of ", py_tuple(kActivations), ", got ", py_repr(activation));
  CM_CHECK_VALUE(gate_up_layout == kLayouts[0] || gate_up_layout == kLayouts[1], "gate_up_layout must be one of ",
                 py_tuple(kLayouts), ", got ", py_repr(gate_up_layout));
  CM_CHECK_VALUE(code >= kGated || h.sym_size(1) % 2 == 0, "h must have an even number of columns (gate and up) for ",
                 activation, ", got ", size_str(h.sym_size(1)));
}

void check_moe_activation_backward(const at::Tensor& grad, const at::Tensor& h, const std::string& activation,
                                   const std::string& gate_up_layout) {
  check_moe_activation(h, activation, gate_up_layout);
  check_tensor("grad", grad, 2);
  check_same_device("h", h, "grad", grad);
  const c10::SymInt columns = activation_columns(h, activation_code(activation));
  CM_CHECK_VALUE(grad.sym_size(0) == h.sym_size(0) && grad.sym_size(1) == columns, "grad must be (",
                 size_str(h.sym_size(0)), ", ", size_str(columns), "), got ", shape_str(grad.sym_sizes()));
}

// ops/grouped_mm.py's _check_grouped_sum.
void check_grouped_sum(const at::Tensor& x, const at::Tensor& offs, std::optional<c10::ScalarType> out_dtype) {
  check_tensor("x", x, 2);
  check_offs(offs);
  check_same_device("x", x, "offs", offs);
  check_out_dtype(out_dtype);
}

#ifdef COMPILED_MOE_CUDA
namespace {

// ------------------------------------------------------------------------------ CUDA kernels

std::unordered_map<std::string, pybind11::object>& fallbacks() {  // op name -> its Python kernel
  static auto* map = new std::unordered_map<std::string, pybind11::object>();
  return *map;
}

// The op's Python kernel, for what the row kernels do not take.
template <typename Result, typename... Args>
Result python_kernel(const char* op, const Args&... args) {
  pybind11::gil_scoped_acquire gil;
  return fallbacks().at(op)(args...).template cast<Result>();
}

// The row kernels of the tensor's device where they take these dtypes, else nullptr.
const RowKernels* row_kernels(const at::Tensor& t, std::initializer_list<c10::ScalarType> dtypes) {
  for (c10::ScalarType d : dtypes)
    if (element_kind(d) < 0) return nullptr;
  const int device = t.device().index();
  ensure_context(device);
  const RowKernels& k = device_kernels<RowKernels>(device);
  return k.available ? &k : nullptr;
}

// Rows with unit column stride (a copy otherwise).
at::Tensor unit_columns(const at::Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous(); }

// Whether rows of these tensors move as 16-byte vectors: H and every row stride a whole number
// of 16 bytes, every address 16-byte aligned.
bool vector_rows(int64_t H, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    const int64_t es = t->element_size();
    if ((H * es) % 16 || (t->stride(0) * es) % 16 || reinterpret_cast<uint64_t>(t->data_ptr()) % 16) return false;
  }
  return true;
}

// One warp an item: up to 8 blocks of 8 warps an SM.
unsigned warp_grid(int64_t items, unsigned sms) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + 7) / 8, 8 * sms)));
}

// out (rows, H) contiguous: x[source[r] / top_k] (times scale[source[r]]), 0 on padding; with
// `other` (rows, H), dot[s] = <x[t], other[r]> for the pairs that own a row. x, other and out
// share a dtype.
void gather_rows(const RowKernels& k, const at::Tensor& x_in, const at::Tensor& row_of_in, const at::Tensor& source_in,
                 const std::optional<at::Tensor>& scale, const at::Tensor& out, const at::Tensor* other_in = nullptr,
                 const at::Tensor* dot = nullptr) {
  const int64_t top_k = row_of_in.size(1), num_pairs = x_in.size(0) * top_k, H = out.size(1);
  if (num_pairs == 0) {  // no pairs: every row is padding
    out.zero_();
    return;
  }
  const at::Tensor x = unit_columns(x_in), source = source_in.contiguous(), row_of = row_of_in.contiguous();
  const at::Tensor other = other_in ? unit_columns(*other_in) : at::Tensor();
  const at::Tensor scale_c = scale ? scale->contiguous() : at::Tensor();
  GatherRowsArgs a{};
  a.x = x.data_ptr();
  a.source = static_cast<const int*>(source.data_ptr());
  a.row_of = static_cast<const int*>(row_of.data_ptr());
  a.scale = scale ? scale_c.data_ptr() : nullptr;
  a.other = other_in ? other.data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.dot = dot ? dot->data_ptr() : nullptr;
  a.x_stride = x.stride(0);
  a.other_stride = other_in ? other.stride(0) : 0;
  a.rows = out.size(0);
  a.tokens = x.size(0);
  a.num_pairs = num_pairs;
  a.H = static_cast<int>(H);
  a.top_k = static_cast<int>(top_k);
  a.kind = element_kind(out.scalar_type());
  a.scale_kind = scale ? element_kind(scale_c.scalar_type()) : kRowNone;
  a.dot_kind = dot ? element_kind(dot->scalar_type()) : kRowNone;
  a.vector = other_in ? vector_rows(H, {&x, &out, &other}) : vector_rows(H, {&x, &out});
  void* args[] = {&a};
  launch(out.device().index(), k.gather, warp_grid(a.tokens + (a.rows + 31) / 32, k.sms), 256, 0, args);
}

at::Tensor moe_permute_cuda(const at::Tensor& hidden, const at::Tensor& row_of, const at::Tensor& source,
                            const std::optional<at::Tensor>& scale) {
  check_moe_permute(hidden, row_of, source, scale);
  c10::DeviceGuard guard(hidden.device());
  const RowKernels* k = row_kernels(hidden, {hidden.scalar_type(), scale ? scale->scalar_type() : hidden.scalar_type()});
  if (!k) return python_kernel<at::Tensor>("moe_permute", hidden, row_of, source, scale);
  at::Tensor out = at::empty({source.size(0), hidden.size(1)}, hidden.options());
  if (out.numel() > 0) gather_rows(*k, hidden, row_of, source, scale, out);
  return out;
}

at::Tensor moe_unpermute_cuda(const at::Tensor& y_in, const at::Tensor& row_of_in, const at::Tensor& source,
                              const std::optional<at::Tensor>& weights) {
  check_moe_unpermute(y_in, row_of_in, source, weights);
  c10::DeviceGuard guard(y_in.device());
  const RowKernels* k = row_kernels(y_in, {y_in.scalar_type(), weights ? weights->scalar_type() : y_in.scalar_type()});
  if (!k) return python_kernel<at::Tensor>("moe_unpermute", y_in, row_of_in, source, weights);
  const int64_t H = y_in.size(1);
  at::Tensor out = at::empty({row_of_in.size(0), H}, y_in.options());
  if (out.numel() == 0) return out;
  const at::Tensor y = unit_columns(y_in), row_of = row_of_in.contiguous();
  const at::Tensor w = weights ? weights->contiguous() : at::Tensor();
  CombineRowsArgs a{};
  a.y = y.data_ptr();
  a.row_of = static_cast<const int*>(row_of.data_ptr());
  a.weights = weights ? w.data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.y_rows = y.size(0);
  a.y_stride = y.stride(0);
  a.tokens = out.size(0);
  a.H = static_cast<int>(H);
  a.top_k = static_cast<int>(row_of.size(1));
  a.kind = element_kind(y.scalar_type());
  a.weight_kind = weights ? element_kind(w.scalar_type()) : kRowNone;
  a.vector = vector_rows(H, {&y, &out});
  const int64_t per_row = a.vector ? H * y.element_size() / 16 : H;
  void* args[] = {&a};
  launch(y.device().index(), k->combine, grid_for(a.tokens * per_row, k->sms), 256, 0, args);
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& y,
                                                               const at::Tensor& row_of, const at::Tensor& source,
                                                               const at::Tensor& weights) {
  check_moe_unpermute_backward(grad_out_in, y, row_of, source, weights);
  c10::DeviceGuard guard(y.device());
  const RowKernels* k = row_kernels(y, {grad_out_in.scalar_type(), y.scalar_type(), weights.scalar_type()});
  if (!k) {
    return python_kernel<std::tuple<at::Tensor, at::Tensor>>("moe_unpermute_backward", grad_out_in, y, row_of,
                                                             source, weights);
  }
  // One pass over the sorted rows: grad_y[r] = w * grad_out[t] and grad_weights[t, s] =
  // <grad_out[t], y[r]>. Zeros first: dropped pairs own no row, so no warp writes theirs.
  const at::Tensor grad_out = grad_out_in.scalar_type() == y.scalar_type() ? grad_out_in : grad_out_in.to(y.scalar_type());
  at::Tensor grad_y = at::empty(y.sizes(), y.options());
  at::Tensor grad_weights = at::zeros(weights.sizes(), weights.options());
  if (grad_y.numel() > 0) gather_rows(*k, grad_out, row_of, source, weights, grad_y, &y, &grad_weights);
  return {grad_y, grad_weights};
}

at::Tensor moe_activation_cuda(const at::Tensor& h_in, const std::string& activation, const std::string& gate_up_layout,
                               double alpha, double limit) {
  check_moe_activation(h_in, activation, gate_up_layout);
  c10::DeviceGuard guard(h_in.device());
  const RowKernels* k = row_kernels(h_in, {h_in.scalar_type()});
  if (!k) return python_kernel<at::Tensor>("moe_activation", h_in, activation, gate_up_layout, alpha, limit);
  const int code = activation_code(activation);
  const int64_t rows = h_in.size(0), inter = code < kGated ? h_in.size(1) / 2 : h_in.size(1);
  at::Tensor out = at::empty({rows, inter}, h_in.options());
  if (out.numel() == 0) return out;
  const at::Tensor h = unit_columns(h_in);
  const void* h_p = h.data_ptr();
  void* out_p = out.data_ptr();
  int64_t h_stride = h.stride(0), rows64 = rows;
  int32_t inter32 = static_cast<int32_t>(inter), kind = element_kind(h.scalar_type()), code32 = code,
          interleaved = gate_up_layout == kLayouts[1];
  float alpha32 = static_cast<float>(alpha), limit32 = static_cast<float>(limit);
  void* args[] = {&h_p, &h_stride, &out_p, &rows64, &inter32, &kind, &code32, &interleaved, &alpha32, &limit32};
  launch(h.device().index(), k->activation, grid_for(rows * inter, k->sms), 256, 0, args);
  return out;
}

at::Tensor moe_activation_backward_cuda(const at::Tensor& grad_in, const at::Tensor& h_in, const std::string& activation,
                                        const std::string& gate_up_layout, double alpha, double limit) {
  check_moe_activation_backward(grad_in, h_in, activation, gate_up_layout);
  c10::DeviceGuard guard(h_in.device());
  const RowKernels* k = row_kernels(h_in, {h_in.scalar_type(), grad_in.scalar_type()});
  if (!k) {
    return python_kernel<at::Tensor>("moe_activation_backward", grad_in, h_in, activation, gate_up_layout, alpha,
                                     limit);
  }
  at::Tensor dh = at::empty(h_in.sizes(), h_in.options());
  if (dh.numel() == 0) return dh;
  const int code = activation_code(activation);
  const at::Tensor h = unit_columns(h_in), grad = unit_columns(grad_in);
  const int64_t rows = h.size(0), inter = grad.size(1);
  const void *grad_p = grad.data_ptr(), *h_p = h.data_ptr();
  void* dh_p = dh.data_ptr();
  int64_t grad_stride = grad.stride(0), h_stride = h.stride(0), rows64 = rows;
  int32_t grad_kind = element_kind(grad.scalar_type()), inter32 = static_cast<int32_t>(inter),
          kind = element_kind(h.scalar_type()), code32 = code, interleaved = gate_up_layout == kLayouts[1];
  float alpha32 = static_cast<float>(alpha), limit32 = static_cast<float>(limit);
  void* args[] = {&grad_p, &grad_kind, &grad_stride, &h_p, &h_stride, &dh_p, &rows64, &inter32, &kind, &code32,
                  &interleaved, &alpha32, &limit32};
  launch(h.device().index(), k->activation_backward, grid_for(rows * inter, k->sms), 256, 0, args);
  return dh;
}

at::Tensor grouped_sum_cuda(const at::Tensor& x_in, const at::Tensor& offs_in, std::optional<c10::ScalarType> out_dtype) {
  check_grouped_sum(x_in, offs_in, out_dtype);
  c10::DeviceGuard guard(x_in.device());
  const c10::ScalarType out_type = out_dtype.value_or(x_in.scalar_type());
  const RowKernels* k = row_kernels(x_in, {x_in.scalar_type(), out_type});
  if (!k) return python_kernel<at::Tensor>("grouped_sum", x_in, offs_in, out_dtype);
  const int64_t G = offs_in.size(0), N = x_in.size(1);
  at::Tensor out = at::empty({G, N}, x_in.options().dtype(out_type));
  if (out.numel() == 0) return out;
  const at::Tensor x = unit_columns(x_in), offs = offs_in.contiguous();
  const void *x_p = x.data_ptr(), *offs_p = offs.data_ptr();
  void* out_p = out.data_ptr();
  int32_t kind = element_kind(x.scalar_type()), g32 = static_cast<int32_t>(G), n32 = static_cast<int32_t>(N),
          out_kind = element_kind(out_type), column_blocks = static_cast<int32_t>((N + SUM_COLUMNS - 1) / SUM_COLUMNS);
  int64_t x_stride = x.stride(0), M = x.size(0);
  void* args[] = {&x_p, &kind, &x_stride, &offs_p, &g32, &M, &n32, &out_p, &out_kind, &column_blocks};
  launch(x.device().index(), k->grouped_sum, static_cast<unsigned>(G * column_blocks), SUM_COLUMNS * SUM_LANES, 0,
         args);
  return out;
}

torch::Library& library() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "compiled_moe", std::nullopt, __FILE__, __LINE__);
  return *lib;
}

}  // namespace
#endif  // COMPILED_MOE_CUDA

std::vector<std::string> register_row_op(const std::string& op, pybind11::object python_kernel) {
#ifdef COMPILED_MOE_CUDA
  auto cuda = [](auto fn) { return torch::dispatch(c10::DispatchKey::CUDA, fn); };
  if (op == "moe_permute") library().impl(op.c_str(), cuda(TORCH_FN(moe_permute_cuda)));
  else if (op == "moe_unpermute") library().impl(op.c_str(), cuda(TORCH_FN(moe_unpermute_cuda)));
  else if (op == "moe_unpermute_backward") library().impl(op.c_str(), cuda(TORCH_FN(moe_unpermute_backward_cuda)));
  else if (op == "moe_activation") library().impl(op.c_str(), cuda(TORCH_FN(moe_activation_cuda)));
  else if (op == "moe_activation_backward") library().impl(op.c_str(), cuda(TORCH_FN(moe_activation_backward_cuda)));
  else if (op == "grouped_sum") library().impl(op.c_str(), cuda(TORCH_FN(grouped_sum_cuda)));
  else TORCH_CHECK(false, cat("compiled_moe: the host layer has no row op ", op));
  fallbacks()[op] = std::move(python_kernel);
  return {"CUDA"};
#else
  return {};
#endif
}

void bind_rows(pybind11::module_& m) {
  m.def("register_row_op", &register_row_op);
  // The checks alone (the CUDA kernels make them), for tests on any machine.
  m.def("check_moe_permute", &check_moe_permute);
  m.def("check_moe_unpermute", &check_moe_unpermute);
  m.def("check_moe_unpermute_backward", &check_moe_unpermute_backward);
  m.def("check_moe_activation", &check_moe_activation);
  m.def("check_moe_activation_backward", &check_moe_activation_backward);
  m.def("check_grouped_sum", &check_grouped_sum);
}

}  // namespace compiled_moe
