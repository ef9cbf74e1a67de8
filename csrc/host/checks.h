// Argument checks of the C++ host layer's ops: the same errors, word for word, as
// compiled_moe/ops/_dispatch.py's checks (tests compare them): ValueError for shapes and
// devices, TypeError for dtypes. Sizes are read as SymInts: under torch.compile the tensors are
// symbolic, and an int size would pin the token count.
//
// A failed check sets the Python exception itself and throws torch's python_error, which the
// dispatcher's Python boundary turns back into that exception (as for a Python kernel's
// error). Messages are built with cat (text.h), never c10::str: see there.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <array>
#include <optional>
#include <string>

#include "text.h"

namespace compiled_moe {

[[noreturn]] inline void raise_python(PyObject* type, const std::string& message) {
  pybind11::gil_scoped_acquire gil;
  PyErr_SetString(type, message.c_str());
  python_error error;
  error.persist();
  throw error;
}

#define CM_CHECK_VALUE(cond, ...) \
  do {                            \
    if (C10_UNLIKELY(!(cond))) raise_python(PyExc_ValueError, cat(__VA_ARGS__)); \
  } while (0)
#define CM_CHECK_TYPE(cond, ...) \
  do {                           \
    if (C10_UNLIKELY(!(cond))) raise_python(PyExc_TypeError, cat(__VA_ARGS__)); \
  } while (0)

inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Bool: return "torch.bool";
    case c10::ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case c10::ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// A size as Python prints it (symbolic sizes, under torch.compile, by their expression).
inline std::string size_str(const c10::SymInt& size) {
  if (auto value = size.maybe_as_int()) return std::to_string(*value);
  return size.toSymNode()->str();
}

// A shape as Python prints a tuple: (4, 5), (4,), ().
inline std::string shape_str(c10::SymIntArrayRef shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + size_str(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

inline bool is_op_dtype(c10::ScalarType t) {
  return t == c10::kBFloat16 || t == c10::kHalf || t == c10::kFloat || t == c10::kDouble;
}

inline constexpr const char* kOpDtypes = "bfloat16, float16, float32, float64";

inline void check_tensor(const char* name, const at::Tensor& t, int64_t ndim) {
  CM_CHECK_VALUE(t.dim() == ndim, name, " must be ", ndim, "-D, got shape ", shape_str(t.sym_sizes()));
  CM_CHECK_TYPE(is_op_dtype(t.scalar_type()), name, " must have dtype in (", kOpDtypes, "), got ",
                   dtype_name(t.scalar_type()));
}

inline void check_same_dtype(const char* ref_name, const at::Tensor& ref, const char* name, const at::Tensor& t) {
  CM_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", dtype_name(t.scalar_type()),
                   " but ", ref_name, " has ", dtype_name(ref.scalar_type()), "; they must match");
}

inline void check_same_device(const char* ref_name, const at::Tensor& ref, const char* name, const at::Tensor& t) {
  CM_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device().str(), " but ", ref_name,
                    " is on ", ref.device().str());
}

inline void check_offs(const at::Tensor& offs, const c10::SymInt& num_groups) {
  CM_CHECK_TYPE(offs.scalar_type() == c10::kInt,
                   "offs must be int32 (cumulative end row of each group), got ", dtype_name(offs.scalar_type()));
  CM_CHECK_VALUE(offs.dim() == 1 && offs.sym_size(0) == num_groups, "offs must have shape (", size_str(num_groups),
                    ",), one entry per group, got ", shape_str(offs.sym_sizes()));
  CM_CHECK_VALUE(num_groups >= 1, "need at least one group");
}

// check_offs(offs): any number of groups, at least one.
inline void check_offs(const at::Tensor& offs) {
  CM_CHECK_TYPE(offs.scalar_type() == c10::kInt,
                "offs must be int32 (cumulative end row of each group), got ", dtype_name(offs.scalar_type()));
  CM_CHECK_VALUE(offs.dim() == 1, "offs must have shape (G,), one entry per group, got ", shape_str(offs.sym_sizes()));
  CM_CHECK_VALUE(offs.sym_size(0) >= 1, "need at least one group");
}

inline void check_out_dtype(std::optional<c10::ScalarType> out_dtype) {
  CM_CHECK_TYPE(!out_dtype || is_op_dtype(*out_dtype),
                   "out_dtype must be one of (torch.bfloat16, torch.float16, torch.float32, torch.float64) "
                   "or None, got ", out_dtype ? dtype_name(*out_dtype) : "None");
}

// check_tensor(name, t, ndim, None): any dtype.
inline void check_dims(const char* name, const at::Tensor& t, int64_t ndim) {
  CM_CHECK_VALUE(t.dim() == ndim, name, " must be ", ndim, "-D, got shape ", shape_str(t.sym_sizes()));
}

// check_tensor(name, t, ndim, (torch.int32,)).
inline void check_int32_tensor(const char* name, const at::Tensor& t, int64_t ndim) {
  check_dims(name, t, ndim);
  CM_CHECK_TYPE(t.scalar_type() == c10::kInt, name, " must have dtype in (int32), got ", dtype_name(t.scalar_type()));
}

// ops/activations.py's names (reference.ACTIVATIONS, GATED_ACTIVATIONS: the first three; the
// index is the kernels' activation code) and layouts.
inline constexpr std::array<const char*, 6> kActivations = {"swiglu", "geglu", "gpt_oss", "relu2", "gelu", "silu"};
inline constexpr int kGated = 3;
inline constexpr std::array<const char*, 2> kLayouts = {"stacked", "interleaved"};

inline int activation_code(const std::string& activation) {  // -1: not an activation's name
  for (size_t i = 0; i < kActivations.size(); ++i)
    if (activation == kActivations[i]) return static_cast<int>(i);
  return -1;
}

// ops/activations.py's check_activation_input (rows.cpp).
void check_moe_activation(const at::Tensor& h, const std::string& activation, const std::string& gate_up_layout);

// A string as Python's repr writes it (no escapes needed for the names the ops take).
inline std::string py_repr(const std::string& s) {
  const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  return quote + s + quote;
}

// A tuple of strings as Python prints it: ('a', 'b').
template <size_t N>
std::string py_tuple(const std::array<const char*, N>& names) {
  std::string s = "(";
  for (size_t i = 0; i < N; ++i) s += (i ? ", " : "") + py_repr(names[i]);
  return s + (N == 1 ? ",)" : ")");
}

}  // namespace compiled_moe
