"""The MoE activation op: schema, fake, autograd and device dispatch, side by side.

torch.ops.compiled_moe.moe_activation            a = act(h), gate/up read in either layout
torch.ops.compiled_moe.moe_activation_backward   d h from d a (recomputes from h, stores nothing)
torch.ops.compiled_moe.moe_scaled_activation_backward
                                                 (d h, d probs) of a = act(h) * probs, one pass

``kernel_op``s whose bodies compiled graphs trace (as a ``triton_op``'s): on CUDA one Triton
kernel each way; elsewhere the reference formulas.
One kernel reads gate and up once and writes both gradient halves; the composition of torch ops
it replaces (cast, split, silu, mul, cast, and their backward) takes 5 kernels eager, and
inductor's fusion of its backward reads h more than once (measured: 207 us on the Qwen3
T = 8192 FC1 output on the H200).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compiled_moe import reference
from compiled_moe.ops._dispatch import (
    check_same_device,
    check_tensor,
    host_row_op,
    kernel_op,
    on_tensor_device,
    use_kernel,
)
from compiled_moe.reference import ACTIVATIONS, GATE_UP_LAYOUTS, GATED_ACTIVATIONS

_ops = torch.ops.compiled_moe


def _kernels():
    from compiled_moe.kernels import activations as kernels  # Triton loads only when needed
    return kernels


def activation_columns(h, activation) -> int:
    """I: the activation's columns for FC1 output h."""
    return h.shape[1] // 2 if activation in GATED_ACTIVATIONS else h.shape[1]


def check_activation_input(h, activation, gate_up_layout) -> None:
    check_tensor("h", h, 2)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    if activation in GATED_ACTIVATIONS and h.shape[1] % 2:
        raise ValueError(f"h must have an even number of columns (gate and up) for {activation}, "
                         f"got {h.shape[1]}")


def activation_constants(activation: str, alpha: float, limit: float) -> dict:
    """alpha/limit keyword arguments for an op call, empty when they are the schema defaults:
    no Python floats then reach the graph, which torch.compile (dynamic=True) would otherwise
    trace as symbolic inputs and restart its analysis for."""
    if activation != "gpt_oss" or (alpha, limit) == (reference.GPT_OSS_ALPHA,
                                                      reference.GPT_OSS_LIMIT):
        return {}
    return {"alpha": alpha, "limit": limit}


@kernel_op("moe_activation", device_types=("cuda", "cpu"), traced=True,
           autograd="formula", host=host_row_op("moe_activation"))
@on_tensor_device
def _moe_activation(h: Tensor, activation: str, gate_up_layout: str = "stacked",
                    alpha: float = reference.GPT_OSS_ALPHA,
                    limit: float = reference.GPT_OSS_LIMIT) -> Tensor:
    check_activation_input(h, activation, gate_up_layout)
    if not use_kernel(h):
        return reference.activation(h, activation, gate_up_layout, alpha, limit)
    out = h.new_empty((h.shape[0], activation_columns(h, activation)))
    _kernels().activation_forward(h, out, activation, gate_up_layout, alpha, limit)
    return out


@_moe_activation.register_fake
def _(h, activation, gate_up_layout="stacked", alpha=reference.GPT_OSS_ALPHA,
      limit=reference.GPT_OSS_LIMIT):
    check_activation_input(h, activation, gate_up_layout)
    return h.new_empty((h.shape[0], activation_columns(h, activation)))


def _check_backward(grad, h, activation, gate_up_layout) -> None:
    check_activation_input(h, activation, gate_up_layout)
    check_tensor("grad", grad, 2)
    check_same_device("h", h, grad=grad)
    if tuple(grad.shape) != (h.shape[0], activation_columns(h, activation)):
        raise ValueError(f"grad must be {(h.shape[0], activation_columns(h, activation))}, "
                         f"got {tuple(grad.shape)}")


@kernel_op("moe_activation_backward", device_types=("cuda", "cpu"), traced=True,
           host=host_row_op("moe_activation_backward"))
@on_tensor_device
def _moe_activation_backward(grad: Tensor, h: Tensor, activation: str,
                             gate_up_layout: str = "stacked",
                             alpha: float = reference.GPT_OSS_ALPHA,
                             limit: float = reference.GPT_OSS_LIMIT) -> Tensor:
    _check_backward(grad, h, activation, gate_up_layout)
    if not use_kernel(h):
        return reference.activation_backward(grad, h, activation, gate_up_layout, alpha, limit)
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    _kernels().activation_backward(grad, h, out, activation, gate_up_layout, alpha, limit)
    return out


@_moe_activation_backward.register_fake
def _(grad, h, activation, gate_up_layout="stacked", alpha=reference.GPT_OSS_ALPHA,
      limit=reference.GPT_OSS_LIMIT):
    _check_backward(grad, h, activation, gate_up_layout)
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    h, activation, gate_up_layout, alpha, limit = inputs
    ctx.save_for_backward(h)
    ctx.args = (activation, gate_up_layout, alpha, limit)


def _backward(ctx, grad):
    (h,) = ctx.saved_tensors
    grad_h = _ops.moe_activation_backward(grad.to(h.dtype), h, *ctx.args)
    return grad_h, None, None, None, None


_moe_activation.register_autograd(_backward, setup_context=_setup)


def _check_scaled_backward(grad, h, probs, activation, gate_up_layout) -> None:
    from compiled_moe.ops.moe_mlp import check_probs

    _check_backward(grad, h, activation, gate_up_layout)
    if probs is None:
        raise TypeError("probs must be a tensor (moe_activation_backward serves a without probs)")
    check_probs(probs, h.shape[0])
    check_same_device("h", h, probs=probs)


def _scaled_backward_outputs(h):
    return (torch.empty_like(h, memory_format=torch.contiguous_format),
            h.new_empty((h.shape[0],), dtype=torch.float32))


# The backward of a = act(h) * probs (FP8 FC2's input, fp8.fp8_activation_grouped_mm): one kernel
# reads grad and h once and writes dh and dprobs, where the composition of the activation's
# recompute, the fp32 products and the sum made the FP8 MLP's step slower than before it.
@kernel_op("moe_scaled_activation_backward", device_types=("cuda", "cpu"),
           traced=True)
@on_tensor_device
def _moe_scaled_activation_backward(grad: Tensor, h: Tensor, probs: Tensor, activation: str,
                                    gate_up_layout: str = "stacked",
                                    alpha: float = reference.GPT_OSS_ALPHA,
                                    limit: float = reference.GPT_OSS_LIMIT
                                    ) -> tuple[Tensor, Tensor]:
    _check_scaled_backward(grad, h, probs, activation, gate_up_layout)
    if not use_kernel(h):
        dh, dprobs = reference.scaled_activation_backward(grad, h, probs, activation,
                                                          gate_up_layout, alpha, limit)
        return dh, dprobs.to(torch.float32)
    dh, dprobs = _scaled_backward_outputs(h)
    _kernels().activation_backward(grad, h, dh, activation, gate_up_layout, alpha, limit,
                                   probs=probs.contiguous(), dprobs=dprobs)
    return dh, dprobs


@_moe_scaled_activation_backward.register_fake
def _(grad, h, probs, activation, gate_up_layout="stacked", alpha=reference.GPT_OSS_ALPHA,
      limit=reference.GPT_OSS_LIMIT):
    _check_scaled_backward(grad, h, probs, activation, gate_up_layout)
    return _scaled_backward_outputs(h)
