// The parts of the C++ host layer beside ops.cpp (which holds the extension module): their
// registrations and bindings, added to the module by ops.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace compiled_moe {

// One of the package's ops (compiled_moe::<name>) as C++ calls it through the dispatcher: what
// the C++ autograd functions compose (keep the handle in a function-local static).
template <typename Signature>
c10::TypedOperatorHandle<Signature> package_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// b (G, K, N) is the transposed view of a (G, N, K) weight: its gradient is written in that
// weight's storage order.
inline bool is_transposed_weight(const at::Tensor& b) { return b.stride(1) == 1 && b.stride(2) != 1; }

// rows.cpp: registers the CUDA kernel of compiled_moe::<op> (moe_permute, moe_unpermute,
// moe_unpermute_backward, moe_activation, moe_activation_backward, grouped_sum);
// python_kernel(*args) serves the calls its kernels do not take. Returns the dispatch keys
// registered (none in a build without cuda.h).
std::vector<std::string> register_row_op(const std::string& op, pybind11::object python_kernel);

// register_row_op and the row ops' checks, on the extension module.
void bind_rows(pybind11::module_& m);

// fp8.cpp: the FP8 ops' registrations and checks (grouped_quantize, scaled_grouped_mm), on the
// extension module.
void bind_fp8(pybind11::module_& m);

}  // namespace compiled_moe
