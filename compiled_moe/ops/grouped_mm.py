"""Grouped GEMM ops: schema, fake, autograd and device dispatch, side by side.

torch.ops.compiled_moe.grouped_mm                 out = a @ b[g] per row group (+ bias[g])
torch.ops.compiled_moe.grouped_mm_wgrad           out[g] = a_g^T @ grad_out_g
torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_  main_grad[g] (+)= a_g^T @ grad_out_g, in place
torch.ops.compiled_moe.grouped_sum                out[g] = sum of x's rows in group g (dbias)
torch.ops.compiled_moe.grouped_mm_sm90, grouped_mm_wgrad_sm90, grouped_mm_wgrad_accumulate_sm90_
                                                  the Hopper CUDA kernels the ops above call

They are ``kernel_op``s whose bodies compiled graphs trace, as a ``triton_op``'s (``traced=True``):
on CUDA the body launches Triton kernels through ``wrap_triton`` so inductor sees and inlines
them, or, on Hopper with TMA-friendly operands, calls the CUDA kernels of csrc/grouped_mm.cu
through opaque ops; elsewhere the body is the pure-torch reference. The in-place weight
gradients stay ``triton_op``/``custom_op`` (custom_op bumps the mutated buffer's version).
No kernels need fixed strides (both b layouts and any a strides are handled; TMA is used when
the strides allow it), so no layout tag is set.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compiled_moe import reference
from compiled_moe.ops._dispatch import (
    check_bias,
    check_offs,
    check_out_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
    host_layer,
    host_row_op,
    is_transposed_weight,
    kernel_op,
    on_tensor_device,
    use_kernel,
)

_ops = torch.ops.compiled_moe


def _kernels():
    from compiled_moe.kernels import grouped_mm as kernels  # Triton loads only when needed
    return kernels


def _sm90():
    from compiled_moe.kernels import grouped_mm_sm90  # the Hopper CUDA kernels' launchers
    return grouped_mm_sm90


# ---------------------------------------------------------------------------- checks


def _check_grouped_mm(a, b, offs, bias, out_dtype) -> None:
    check_tensor("a", a, 2)
    check_tensor("b", b, 3)
    check_same_dtype("a", a, b=b)
    check_offs(offs, b.shape[0])
    check_same_device("a", a, b=b, offs=offs, bias=bias)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a has K={a.shape[1]} columns but b is (G, K, N) = {tuple(b.shape)}; "
                         f"K must match (pass an (G, N, K) weight as w.transpose(-2, -1))")
    check_bias(bias, b.shape[0], b.shape[2])
    check_out_dtype(out_dtype)


def _check_wgrad(a, grad_out, offs, num_groups=None) -> None:
    check_tensor("a", a, 2)
    check_tensor("grad_out", grad_out, 2)
    check_same_dtype("a", a, grad_out=grad_out)
    check_offs(offs, num_groups)
    check_same_device("a", a, grad_out=grad_out, offs=offs)
    if a.shape[0] != grad_out.shape[0]:
        raise ValueError(f"a has {a.shape[0]} rows but grad_out has {grad_out.shape[0]}; "
                         f"they must match")


# ---------------------------------------------------------------------------- grouped_mm


def _host_fallback(a, b, offs, bias, out) -> None:
    """What the C++ host layer's grouped_mm runs where the Hopper kernel does not apply: as the
    Python kernel, the Triton kernel, or the reference for float64 (use_kernel)."""
    if use_kernel(a, b):
        _kernels().grouped_mm(a, b, offs, bias, out)
    else:
        out.copy_(reference.grouped_mm(a, b, offs, bias, out.dtype))


def _register_host_kernels(module) -> list[str]:
    """The C++ host layer's grouped_mm (csrc/host/ops.cpp): checks, autograd and the Hopper
    launch in C++; it asks sm90.host_plan once per shape, and _host_fallback serves the rest."""
    return module.register_grouped_mm(lambda a, b, bias, out: _sm90().host_plan(a, b, bias, out),
                                      _host_fallback)


@kernel_op("grouped_mm", device_types=("cuda", "cpu"), traced=True,
           autograd="formula", host=_register_host_kernels)
@on_tensor_device
def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor, bias: Optional[Tensor] = None,
                out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_grouped_mm(a, b, offs, bias, out_dtype)
    if not use_kernel(a):
        return reference.grouped_mm(a, b, offs, bias, out_dtype)
    return grouped_mm_on_device(a, b, offs, bias, out_dtype)


def cuda_kernel_applies(a: Tensor, b: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype
                        ) -> bool:
    """Whether grouped_mm's operands suit the Hopper CUDA kernel (device, dtypes, strides;
    known while tracing)."""
    return _sm90().supported(a, b, bias, out_dtype)


def grouped_mm_on_device(a: Tensor, b: Tensor, offs: Tensor, bias: Optional[Tensor] = None,
                         out_dtype: Optional[torch.dtype] = None, cuda: bool = True) -> Tensor:
    """grouped_mm's GPU path, also for the bodies of ops that run a grouped GEMM inside (the
    caller has checked its own arguments): the Hopper CUDA kernel where it applies and
    ``cuda`` allows it, else the Triton kernel (which a compiled graph launches itself,
    without a call back into Python)."""
    if cuda and cuda_kernel_applies(a, b, bias, out_dtype or a.dtype):
        return _ops.grouped_mm_sm90(a, b, offs, bias, out_dtype)
    out = a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)
    _kernels().grouped_mm(a, b, offs, bias, out)
    return out


@_grouped_mm.register_fake
def _(a, b, offs, bias=None, out_dtype=None):
    _check_grouped_mm(a, b, offs, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)


def _grouped_mm_setup(ctx, inputs, output):
    a, b, offs, bias, _ = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.to(a.dtype)
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dgrad: the same kernel with b transposed, no copy (b.mT of an nn.Linear weight view
        # is the contiguous weight itself).
        grad_a = _ops.grouped_mm(grad, b.mT, offs)
    if ctx.needs_input_grad[1]:
        if is_transposed_weight(b):
            # Write the gradient in the weight's own (G, N, K) storage order.
            grad_b = _ops.grouped_mm_wgrad(grad, a, offs, out_dtype=b.dtype).mT
        else:
            grad_b = _ops.grouped_mm_wgrad(a, grad, offs, out_dtype=b.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        grad_bias = _ops.grouped_sum(grad, offs, out_dtype=ctx.bias_dtype)
    return grad_a, grad_b, None, grad_bias, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


# ---------------------------------------------------------------------------- grouped_mm_wgrad


def _host_wgrad_fallback(a, grad_out, offs, out) -> None:
    """What the C++ host layer's grouped_mm_wgrad runs where the Hopper kernel does not apply:
    as the Python kernel, the Triton kernel, or the reference for float64 (use_kernel)."""
    if use_kernel(a):
        _kernels().grouped_mm_wgrad(a, grad_out, offs, out, accumulate=False, accumulate_mask=None)
    else:
        out.copy_(reference.grouped_mm_wgrad(a, grad_out, offs, out.dtype))


def _register_host_wgrad(module) -> list[str]:
    """The C++ host layer's grouped_mm_wgrad CUDA kernel (csrc/host/ops.cpp): checks and the
    Hopper launch in C++ (sm90.host_wgrad_plan asked once per shape), _host_wgrad_fallback for
    the rest; the autograd formula below stays."""
    return module.register_grouped_mm_wgrad(lambda a, grad_out, out: _sm90().host_wgrad_plan(a, grad_out, out),
                                            _host_wgrad_fallback)


@kernel_op("grouped_mm_wgrad", device_types=("cuda", "cpu"), traced=True,
           autograd="formula", host=_register_host_wgrad)
@on_tensor_device
def _grouped_mm_wgrad(a: Tensor, grad_out: Tensor, offs: Tensor,
                      out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_wgrad(a, grad_out, offs)
    check_out_dtype(out_dtype)
    if not use_kernel(a):
        return reference.grouped_mm_wgrad(a, grad_out, offs, out_dtype)
    if _sm90().wgrad_supported(a, grad_out, out_dtype or a.dtype):
        return _ops.grouped_mm_wgrad_sm90(a, grad_out, offs, out_dtype)
    out = a.new_empty((offs.shape[0], a.shape[1], grad_out.shape[1]), dtype=out_dtype or a.dtype)
    _kernels().grouped_mm_wgrad(a, grad_out, offs, out, accumulate=False, accumulate_mask=None)
    return out


@_grouped_mm_wgrad.register_fake
def _(a, grad_out, offs, out_dtype=None):
    _check_wgrad(a, grad_out, offs)
    check_out_dtype(out_dtype)
    return a.new_empty((offs.shape[0], a.shape[1], grad_out.shape[1]), dtype=out_dtype or a.dtype)


def _wgrad_setup(ctx, inputs, output):
    a, grad_out, offs, _ = inputs
    ctx.save_for_backward(a, grad_out, offs)


def _wgrad_backward(ctx, dw):
    a, grad_out, offs = ctx.saved_tensors
    dw = dw.to(a.dtype)
    da = dd = None
    if ctx.needs_input_grad[0]:
        da = _ops.grouped_mm(grad_out, dw.mT, offs)
    if ctx.needs_input_grad[1]:
        dd = _ops.grouped_mm(a, dw, offs)
    return da, dd, None, None


_grouped_mm_wgrad.register_autograd(_wgrad_backward, setup_context=_wgrad_setup)


# ---------------------------------------------------------------------------- in-place wgrad


def check_accumulate_mask(accumulate_mask, num_groups: int) -> None:
    """accumulate_mask: None, or bool (G,), one entry per group."""
    if accumulate_mask is None:
        return
    check_tensor("accumulate_mask", accumulate_mask, 1, dtypes=(torch.bool,))
    if accumulate_mask.shape[0] != num_groups:
        raise ValueError(f"accumulate_mask must have shape ({num_groups},), one entry per group, "
                         f"got {tuple(accumulate_mask.shape)}")


def _check_wgrad_accumulate(main_grad, a, grad_out, offs, accumulate_mask) -> None:
    check_tensor("main_grad", main_grad, 3)
    # (1: some elements share memory, e.g. an expanded tensor: the kernels' tiles would race)
    if torch._debug_has_internal_overlap(main_grad) == 1:
        raise ValueError("main_grad must not have elements that share memory (an expand()ed "
                         "tensor, for instance)")
    _check_wgrad(a, grad_out, offs, main_grad.shape[0])
    check_same_device("a", a, main_grad=main_grad, accumulate_mask=accumulate_mask)
    expected = (main_grad.shape[0], a.shape[1], grad_out.shape[1])
    if tuple(main_grad.shape) != expected:
        raise ValueError(f"main_grad must have shape (G, K, N) = {expected} (pass a (G, N, K) "
                         f"buffer as main_grad.transpose(-2, -1)), got {tuple(main_grad.shape)}")
    check_accumulate_mask(accumulate_mask, main_grad.shape[0])


@torch.library.triton_op("compiled_moe::grouped_mm_wgrad_accumulate_", mutates_args=("main_grad",))
@on_tensor_device
def _grouped_mm_wgrad_accumulate_(main_grad: Tensor, a: Tensor, grad_out: Tensor, offs: Tensor,
                                  accumulate_mask: Optional[Tensor] = None) -> None:
    _check_wgrad_accumulate(main_grad, a, grad_out, offs, accumulate_mask)
    if not use_kernel(a):
        reference.grouped_mm_wgrad_accumulate_(main_grad, a, grad_out, offs, accumulate_mask)
        return
    if main_grad.dtype == torch.float32 and _sm90().wgrad_supported(a, grad_out, main_grad.dtype,
                                                                     main_grad):
        torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_sm90_(main_grad, a, grad_out, offs,
                                                                 accumulate_mask)
        return
    _kernels().grouped_mm_wgrad(a, grad_out, offs, main_grad, accumulate=True,
                                accumulate_mask=accumulate_mask)


@_grouped_mm_wgrad_accumulate_.register_fake
def _(main_grad, a, grad_out, offs, accumulate_mask=None):
    _check_wgrad_accumulate(main_grad, a, grad_out, offs, accumulate_mask)


def _host_wgrad_accumulate_fallback(main_grad, a, grad_out, offs, accumulate_mask) -> None:
    """What the C++ host layer's grouped_mm_wgrad_accumulate_ runs where the Hopper kernel does
    not apply: as the Python kernel, the Triton kernel, or the reference for float64."""
    if use_kernel(a):
        _kernels().grouped_mm_wgrad(a, grad_out, offs, main_grad, accumulate=True,
                                    accumulate_mask=accumulate_mask)
    else:
        reference.grouped_mm_wgrad_accumulate_(main_grad, a, grad_out, offs, accumulate_mask)


def _register_host_wgrad_accumulate() -> None:
    """The C++ host layer's kernels of the in-place weight gradient (csrc/host/ops.cpp): its
    autograd kernel (CPU and CUDA tensors), in place of the custom_op's Python autograd and
    in-place layers, and its CUDA kernel (checks and the Hopper launch). The eager call then
    skips the two custom_ops' Python bodies (25.8 us a call, 134 before, against 21.1-21.7
    for torch._grouped_mm on the H200's host, benchmarks/bench_eager.py --tables ops) and the
    custom_op's layers."""
    module = host_layer()
    if module is not None:
        module.register_grouped_mm_wgrad_accumulate(_host_wgrad_accumulate_fallback)


_register_host_wgrad_accumulate()


# ---------------------------------------------------------------------------- Hopper CUDA kernels
# csrc/grouped_mm.cu, which the ops above call on sm_90 when the operands suit TMA. Opaque
# custom ops, because inductor cannot trace a driver launch. Each makes its op's checks: they
# are reachable through torch.ops, and a bad call must not reach a kernel (on the H200's host
# they cost 5-17 us a call, repeated from the op that calls them; in eager mode the C++ host
# layer's kernels launch the CUDA kernels without these ops). Calls the kernels cannot take at
# run time (M = 0, an unaligned address) go to the Triton kernels.


@kernel_op("grouped_mm_sm90", autograd="none")
@on_tensor_device
def _grouped_mm_sm90(a: Tensor, b: Tensor, offs: Tensor, bias: Optional[Tensor] = None,
                     out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_grouped_mm(a, b, offs, bias, out_dtype)
    out = a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)
    sm90 = _sm90()
    if a.shape[0] > 0 and sm90.supported(a, b, bias, out.dtype) and sm90.aligned(a, b, out):
        sm90.grouped_mm(a, b, offs, bias, out)
    else:
        _kernels().grouped_mm(a, b, offs, bias, out)
    return out


@_grouped_mm_sm90.register_fake
def _(a, b, offs, bias=None, out_dtype=None):
    _check_grouped_mm(a, b, offs, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)


@kernel_op("grouped_mm_wgrad_sm90", autograd="none")
@on_tensor_device
def _grouped_mm_wgrad_sm90(a: Tensor, grad_out: Tensor, offs: Tensor,
                           out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_wgrad(a, grad_out, offs)
    check_out_dtype(out_dtype)
    out = a.new_empty((offs.shape[0], a.shape[1], grad_out.shape[1]), dtype=out_dtype or a.dtype)
    sm90 = _sm90()
    if (a.shape[0] > 0 and sm90.wgrad_supported(a, grad_out, out.dtype, out)
            and sm90.aligned(a, grad_out, out)):
        sm90.grouped_mm_wgrad(a, grad_out, offs, out, accumulate=False, accumulate_mask=None)
    else:
        _kernels().grouped_mm_wgrad(a, grad_out, offs, out, accumulate=False, accumulate_mask=None)
    return out


@_grouped_mm_wgrad_sm90.register_fake
def _(a, grad_out, offs, out_dtype=None):
    _check_wgrad(a, grad_out, offs)
    check_out_dtype(out_dtype)
    return a.new_empty((offs.shape[0], a.shape[1], grad_out.shape[1]), dtype=out_dtype or a.dtype)


@torch.library.custom_op("compiled_moe::grouped_mm_wgrad_accumulate_sm90_", mutates_args=("main_grad",),
                         device_types="cuda")
@on_tensor_device
def _grouped_mm_wgrad_accumulate_sm90_(main_grad: Tensor, a: Tensor, grad_out: Tensor, offs: Tensor,
                                       accumulate_mask: Optional[Tensor] = None) -> None:
    _check_wgrad_accumulate(main_grad, a, grad_out, offs, accumulate_mask)
    sm90 = _sm90()
    if accumulate_mask is not None:
        accumulate_mask = accumulate_mask.contiguous()  # the kernel reads mask[g] as bytes
    if (a.shape[0] > 0 and main_grad.dtype == torch.float32
            and sm90.wgrad_supported(a, grad_out, main_grad.dtype, main_grad)
            and sm90.aligned(a, grad_out, main_grad)):
        sm90.grouped_mm_wgrad(a, grad_out, offs, main_grad, accumulate=True,
                              accumulate_mask=accumulate_mask)
    else:
        _kernels().grouped_mm_wgrad(a, grad_out, offs, main_grad, accumulate=True,
                                    accumulate_mask=accumulate_mask)


@_grouped_mm_wgrad_accumulate_sm90_.register_fake
def _(main_grad, a, grad_out, offs, accumulate_mask=None):
    _check_wgrad_accumulate(main_grad, a, grad_out, offs, accumulate_mask)


# ---------------------------------------------------------------------------- grouped_sum


def _check_grouped_sum(x, offs, out_dtype) -> None:
    check_tensor("x", x, 2)
    check_offs(offs)
    check_same_device("x", x, offs=offs)
    check_out_dtype(out_dtype)


@kernel_op("grouped_sum", device_types=("cuda", "cpu"), traced=True,
           autograd="formula", host=host_row_op("grouped_sum"))
@on_tensor_device
def _grouped_sum(x: Tensor, offs: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_grouped_sum(x, offs, out_dtype)
    if not use_kernel(x):
        return reference.grouped_sum(x, offs, out_dtype)
    out = x.new_empty((offs.shape[0], x.shape[1]), dtype=out_dtype or x.dtype)
    _kernels().grouped_sum(x, offs, out)
    return out


@_grouped_sum.register_fake
def _(x, offs, out_dtype=None):
    _check_grouped_sum(x, offs, out_dtype)
    return x.new_empty((offs.shape[0], x.shape[1]), dtype=out_dtype or x.dtype)


def _grouped_sum_setup(ctx, inputs, output):
    x, offs, _ = inputs
    ctx.save_for_backward(offs)
    ctx.x_shape = x.shape
    ctx.x_dtype = x.dtype


def _grouped_sum_backward(ctx, grad):
    (offs,) = ctx.saved_tensors
    return reference.expand_groups(grad, offs, ctx.x_shape[0]).to(ctx.x_dtype), None, None


_grouped_sum.register_autograd(_grouped_sum_backward, setup_context=_grouped_sum_setup)
