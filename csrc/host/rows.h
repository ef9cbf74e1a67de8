// The C++ host layer's row ops (rows.cpp): their registration and bindings.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace compiled_moe {

// Registers the CUDA kernel of compiled_moe::<op> (moe_permute, moe_unpermute,
// moe_unpermute_backward, moe_activation, moe_activation_backward, grouped_sum);
// python_kernel(*args) serves the calls its kernels do not take. Returns the dispatch keys
// registered (none in a build without cuda.h).
std::vector<std::string> register_row_op(const std::string& op, pybind11::object python_kernel);

// register_row_op and the ops' checks, on the extension module.
void bind_rows(pybind11::module_& m);

}  // namespace compiled_moe
