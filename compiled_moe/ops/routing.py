"""Routing ops: schema, fake, autograd and device dispatch, side by side.

torch.ops.compiled_moe.moe_route      topk_ids -> (offs, row_of, source): the expert-sorted layout
torch.ops.compiled_moe.moe_permute    x[r] = hidden[source[r] // k]            (gather)
torch.ops.compiled_moe.moe_unpermute  out[t] = sum_s w[t, s] * y[row_of[t, s]]  (combine)

moe_route is an opaque op (``kernel_op``: no autograd, integer outputs). Small routings run one
Triton program, which compiled graphs launch themselves (``register_traced``); larger ones the
NVRTC kernels of csrc/moe_route.cu, launched by the C++ layer (csrc/host/ops.cpp's
moe_route_cuda), eager or compiled; on CUDA without the C++ layer it raises, naming what to
install.

moe_permute, moe_unpermute and moe_unpermute_backward have one CUDA kernel each, the C++
layer's (csrc/host/rows.cpp launching csrc/moe_rows.cu's gather and combine kernels), which
eager calls and compiled graphs (an opaque call of the op) both run. On CPU, in float64 and on
GPUs before sm_80 they run the reference (compiled_moe.reference); on CUDA without the C++
layer they raise, naming what to install.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compiled_moe import host, reference
from compiled_moe.kernels.configs import ROUTE_ONE_PROGRAM_PAIRS
from compiled_moe.ops._dispatch import (
    check_same_device,
    check_tensor,
    host_row_op,
    host_rows_serve,
    kernel_op,
    on_tensor_device,
    use_kernel,
)

_ops = torch.ops.compiled_moe

_ID_DTYPES = (torch.int32, torch.int64)
MAX_EXPERTS = 4096


def _kernels():
    from compiled_moe.kernels import routing as kernels  # Triton loads only when needed
    return kernels


# ---------------------------------------------------------------------------- moe_route


def _check_route(topk_ids, num_experts, pad_multiple) -> None:
    check_tensor("topk_ids", topk_ids, 2, _ID_DTYPES)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if isinstance(topk_ids.numel(), int) and topk_ids.numel() >= 2**31:
        raise ValueError(f"topk_ids has {topk_ids.numel()} entries; at most 2**31 - 1 are supported")


def _route_outputs(topk_ids, num_experts, pad_multiple):
    num_tokens, k = topk_ids.shape
    capacity = reference.routing_capacity(num_tokens * k, num_experts, pad_multiple)
    new = lambda *shape: topk_ids.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(num_experts), new(num_tokens, k), new(capacity)


def _register_host_route(module) -> list[str]:
    """The C++ host layer's moe_route CUDA kernel (csrc/host/ops.cpp): checks and the NVRTC
    route kernels launched from C++, at every size (the one-program Triton route stays what
    compiled graphs launch)."""
    from compiled_moe import native

    return module.register_moe_route() if module.has_cuda and native.available() else []


@kernel_op("moe_route", device_types=("cuda", "cpu"), autograd="none", host=_register_host_route)
@on_tensor_device
def _moe_route(topk_ids: Tensor, num_experts: int, pad_multiple: int = 1
               ) -> tuple[Tensor, Tensor, Tensor]:
    _check_route(topk_ids, num_experts, pad_multiple)
    if _one_program(topk_ids, num_experts) and use_kernel(topk_ids):
        return _route_one_program(topk_ids, num_experts, pad_multiple, traced=False)
    if topk_ids.device.type != "cuda":
        return reference.moe_route(topk_ids, num_experts, pad_multiple)
    raise host.missing("moe_route")  # (its CUDA kernel is the C++ layer's, registered above)


@_moe_route.register_fake
def _(topk_ids, num_experts, pad_multiple=1):
    _check_route(topk_ids, num_experts, pad_multiple)
    return _route_outputs(topk_ids, num_experts, pad_multiple)


@_moe_route.register_traced
def _(topk_ids, num_experts, pad_multiple=1):
    # A compiled graph launches the one-program route itself: a Triton launch from inductor's
    # wrapper (from C++ under cpp_wrapper) instead of a call back into Python.
    if topk_ids.device.type == "cuda" and _one_program(topk_ids, num_experts):
        _check_route(topk_ids, num_experts, pad_multiple)
        return _route_one_program(topk_ids, num_experts, pad_multiple, traced=True)
    return NotImplemented


def _one_program(topk_ids: Tensor, num_experts) -> bool:
    """Few pairs, and sizes known when a graph is built (eager calls, static-shape graphs:
    the decode steps whose host time matters most)."""
    pairs = topk_ids.numel()
    return (isinstance(pairs, int) and isinstance(num_experts, int)
            and pairs <= ROUTE_ONE_PROGRAM_PAIRS)


def _route_one_program(topk_ids, num_experts, pad_multiple, traced):
    offs, row_of, source = _route_outputs(topk_ids, num_experts, pad_multiple)
    _kernels().route_one_program(topk_ids, num_experts, pad_multiple, offs, row_of, source,
                                 traced=traced)
    return offs, row_of, source


# ---------------------------------------------------------------------------- permute / unpermute


def _check_layout(name, x, row_of, source) -> None:
    check_tensor(name, x, 2)
    check_tensor("row_of", row_of, 2, (torch.int32,))
    check_tensor("source", source, 1, (torch.int32,))
    check_same_device(name, x, row_of=row_of, source=source)


def _check_pair_tensor(name, t, row_of) -> None:
    if t is None:
        return
    check_tensor(name, t, 2, None)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.shape != row_of.shape:
        raise ValueError(f"{name} must be (T, k) = {tuple(row_of.shape)} like row_of, "
                         f"got {tuple(t.shape)}")
    check_same_device("row_of", row_of, **{name: t})


def _check_permute(hidden, row_of, source, scale, name="hidden") -> None:
    _check_layout(name, hidden, row_of, source)
    if hidden.shape[0] != row_of.shape[0]:
        raise ValueError(f"{name} has {hidden.shape[0]} tokens but row_of is "
                         f"{tuple(row_of.shape)}; they must match")
    _check_pair_tensor("scale", scale, row_of)


def _check_unpermute(y, row_of, source, weights) -> None:
    _check_layout("y", y, row_of, source)
    if y.shape[0] != source.shape[0]:
        raise ValueError(f"y has {y.shape[0]} rows but source has {source.shape[0]}; "
                         f"y must hold one row per sorted row")
    _check_pair_tensor("weights", weights, row_of)


@kernel_op("moe_permute", device_types=("cuda", "cpu"), autograd="formula",
           host=host_row_op("moe_permute"))
@on_tensor_device
def _moe_permute(hidden: Tensor, row_of: Tensor, source: Tensor,
                 scale: Optional[Tensor] = None) -> Tensor:
    _check_permute(hidden, row_of, source, scale)
    if host_rows_serve(hidden):
        raise host.missing("moe_permute")
    return reference.moe_permute(hidden, source, row_of.shape[1], scale)


@_moe_permute.register_fake
def _(hidden, row_of, source, scale=None):
    _check_permute(hidden, row_of, source, scale)
    return hidden.new_empty((source.shape[0], hidden.shape[1]))


def _permute_setup(ctx, inputs, output):
    hidden, row_of, source, scale = inputs
    ctx.save_for_backward(hidden if scale is not None else None, row_of, source, scale)


def _permute_backward(ctx, grad):
    hidden, row_of, source, scale = ctx.saved_tensors
    grad_hidden = grad_scale = None
    if ctx.needs_input_grad[0]:
        grad_hidden = _ops.moe_unpermute(grad, row_of, source, scale)
    if scale is not None and ctx.needs_input_grad[3]:
        # <hidden[t], grad_x[row_of[t, s]]>: only double backward of moe_unpermute gets here.
        grad_scale = reference.moe_unpermute_dot(hidden, grad, row_of).to(scale.dtype)
    return grad_hidden, None, None, grad_scale


_moe_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@kernel_op("moe_unpermute", device_types=("cuda", "cpu"), autograd="formula",
           host=host_row_op("moe_unpermute"))
@on_tensor_device
def _moe_unpermute(y: Tensor, row_of: Tensor, source: Tensor,
                   weights: Optional[Tensor] = None) -> Tensor:
    _check_unpermute(y, row_of, source, weights)
    if host_rows_serve(y):
        raise host.missing("moe_unpermute")
    return reference.moe_unpermute(y, row_of, weights)


@_moe_unpermute.register_fake
def _(y, row_of, source, weights=None):
    _check_unpermute(y, row_of, source, weights)
    return y.new_empty((row_of.shape[0], y.shape[1]))


def _unpermute_setup(ctx, inputs, output):
    y, row_of, source, weights = inputs
    ctx.save_for_backward(y if weights is not None else None, row_of, source, weights)


def _unpermute_backward(ctx, grad):
    y, row_of, source, weights = ctx.saved_tensors
    grad_y = grad_weights = None
    if weights is None:
        if ctx.needs_input_grad[0]:
            grad_y = _ops.moe_permute(grad, row_of, source)
        return grad_y, None, None, None
    if ctx.needs_input_grad[3]:
        # One pass gives both: grad_y[r] = w * grad[t] and grad_w[t, s] = <grad[t], y[r]>.
        grad_y, grad_weights = _ops.moe_unpermute_backward(grad, y, row_of, source,
                                                           weights)
        if not ctx.needs_input_grad[0]:
            grad_y = None
    elif ctx.needs_input_grad[0]:
        grad_y = _ops.moe_permute(grad, row_of, source, weights)
    return grad_y, None, None, grad_weights


_moe_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def _check_unpermute_backward(grad_out, y, row_of, source, weights) -> None:
    _check_unpermute(y, row_of, source, weights)
    _check_permute(grad_out, row_of, source, weights, name="grad_out")
    if grad_out.shape[1] != y.shape[1]:
        raise ValueError(f"grad_out has {grad_out.shape[1]} columns but y has {y.shape[1]}; "
                         "they must match")


@kernel_op("moe_unpermute_backward", device_types=("cuda", "cpu"),
           host=host_row_op("moe_unpermute_backward"))
@on_tensor_device
def _moe_unpermute_backward(grad_out: Tensor, y: Tensor, row_of: Tensor, source: Tensor,
                            weights: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_y, grad_weights) of moe_unpermute with weights, in one pass over the sorted rows
    on CUDA. Not differentiable itself."""
    _check_unpermute_backward(grad_out, y, row_of, source, weights)
    if host_rows_serve(y):
        raise host.missing("moe_unpermute_backward")
    grad_y = reference.moe_permute(grad_out, source, row_of.shape[1], weights)
    return grad_y, reference.moe_unpermute_dot(grad_out, y, row_of).to(weights.dtype)


@_moe_unpermute_backward.register_fake
def _(grad_out, y, row_of, source, weights):
    _check_unpermute_backward(grad_out, y, row_of, source, weights)
    return y.new_empty(y.shape), weights.new_empty(weights.shape)

