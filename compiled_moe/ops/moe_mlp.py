"""The fused expert MLP op: schema, fake, autograd and device dispatch, side by side.

torch.ops.compiled_moe.moe_mlp             (y, h): FC1 -> activation (* probs) -> FC2 on
                                           expert-sorted rows, optionally gathered from tokens;
                                           the gate and up weights stacked in w1, or as w1
                                           and w3 (two tensors, read as they are)
torch.ops.compiled_moe.moe_mlp_fc2_dgrad   (dh, a, dprobs): FC2's input gradient, then the
                                           activation backward, its recomputed output and
                                           the gradient of probs in one pass over h

Forward is two kernels: the fused FC1 (gather, gate and up, bias, activation, probs; the
activation never goes through memory as FC1 output and back) and the grouped GEMM for FC2.
Large problems run their GEMMs on the Hopper CUDA kernel instead (kernels.configs:
fused_mlp_fc1_on_cuda, fused_mlp_fc2_on_cuda): for wide experts FC1 is then the gather (into a
buffer freed after FC1), the CUDA GEMM and the activation kernel, which beat the fused Triton
FC1 there.
Backward keeps only h (FC1's pre-activation). FC2's input gradient is the grouped GEMM; one
pointwise kernel then reads it and h once and writes dh, the recomputed activation (FC2's
weight-gradient operand) and dprobs. (The activation backward in the dgrad GEMM's epilogue was
built and measured slower: 682 against 578 us for the two kernels at the Qwen3 shape on the
H200, TMA epilogue; the epilogue's gate, up, activation and gradient tiles beside the
accumulator exceed the registers of a 128x128 tile.) The other backward GEMMs are the
grouped GEMM ops. ``kernel_op``s whose bodies compiled graphs trace (as a ``triton_op``'s): on
CUDA the bodies launch Triton kernels; elsewhere they run the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compiled_moe import reference
from compiled_moe.kernels.configs import fused_mlp_fc1_on_cuda, fused_mlp_fc2_on_cuda, size_hint
from compiled_moe.ops.grouped_mm import cuda_kernel_applies, grouped_mm_on_device
from compiled_moe.ops._dispatch import (
    check_offs,
    check_same_device,
    check_same_dtype,
    check_tensor,
    kernel_op,
    on_tensor_device,
    use_kernel,
)
from compiled_moe.reference import ACTIVATIONS, GATE_UP_LAYOUTS, GATED_ACTIVATIONS

_ops = torch.ops.compiled_moe


def _kernels():
    from compiled_moe.kernels import moe_mlp as kernels  # Triton loads only when needed
    return kernels


def _fc1_width(w1: Tensor, w3: Optional[Tensor]) -> int:
    """N1, the width of h: w1's rows, and w3's beside them (stacked) when the up projection
    comes as its own tensor."""
    return w1.shape[1] * (1 if w3 is None else 2)


def _inter(w1: Tensor, activation: str, w3: Optional[Tensor] = None):
    n1 = _fc1_width(w1, w3)
    return n1 // 2 if activation in GATED_ACTIVATIONS else n1


def check_probs(probs, rows: int) -> None:
    if probs is None:
        return
    check_tensor("probs", probs, 1, None)
    if not probs.is_floating_point():
        raise TypeError(f"probs must be a floating-point tensor, got {probs.dtype}")
    if probs.shape[0] != rows:
        raise ValueError(f"probs must be ({rows},), one per sorted row, got {tuple(probs.shape)}")


def check_inputs(x, offs, w1, w2, activation, gate_up_layout, probs, b1, b2, source=None,
                 row_of=None, w3=None) -> None:
    """Host-side checks of moe_mlp's arguments (shapes, dtypes, devices; no data reads)."""
    check_tensor("x", x, 2)
    check_tensor("w1", w1, 3)
    check_tensor("w2", w2, 3)
    check_same_dtype("x", x, w1=w1, w2=w2)
    if w3 is not None:
        check_tensor("w3", w3, 3)
        check_same_dtype("x", x, w3=w3)
        if activation not in GATED_ACTIVATIONS or gate_up_layout != "stacked":
            raise ValueError("w3 (the up projection as its own tensor) needs a gated activation "
                             f"and gate_up_layout='stacked', got {activation!r}, "
                             f"{gate_up_layout!r}")
        if w3.shape != w1.shape:
            raise ValueError(f"w3 must be shaped like w1 (G, I, H) = {tuple(w1.shape)}, got "
                             f"{tuple(w3.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    num_groups, _, k1 = w1.shape
    n1 = _fc1_width(w1, w3)
    check_offs(offs, num_groups)
    hidden = x.shape[1]
    if k1 != hidden:
        raise ValueError(f"w1 must be (G, N1, H) with H = {hidden} (nn.Linear layout), "
                         f"got {tuple(w1.shape)}")
    if activation in GATED_ACTIVATIONS and n1 % 2:
        raise ValueError(f"w1's dim 1 must be even (gate and up) for {activation}, got {n1}")
    inter = _inter(w1, activation, w3)
    if tuple(w2.shape) != (num_groups, hidden, inter):
        raise ValueError(f"w2 must be (G, H, I) = ({num_groups}, {hidden}, {inter}), "
                         f"got {tuple(w2.shape)}")
    if (source is None) != (row_of is None):
        raise ValueError("source and row_of come together (from moe_route), or neither")
    if source is not None:
        check_tensor("source", source, 1, (torch.int32,))
        check_tensor("row_of", row_of, 2, (torch.int32,))
        if row_of.shape[0] != x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} tokens but row_of is {tuple(row_of.shape)}")
    rows = x.shape[0] if source is None else source.shape[0]
    check_probs(probs, rows)
    if b1 is not None:
        check_tensor("b1", b1, 2)
        if tuple(b1.shape) != (num_groups, n1):
            raise ValueError(f"b1 must be (G, N1) = ({num_groups}, {n1}), got {tuple(b1.shape)}")
    if b2 is not None:
        check_tensor("b2", b2, 2)
        if tuple(b2.shape) != (num_groups, hidden):
            raise ValueError(f"b2 must be (G, H) = ({num_groups}, {hidden}), got {tuple(b2.shape)}")
    check_same_device("x", x, offs=offs, w1=w1, w2=w2, probs=probs, b1=b1, b2=b2, source=source,
                      row_of=row_of, w3=w3)


def _rows(x, source):
    return x.shape[0] if source is None else source.shape[0]


def _outputs(x, w1, w3, source, save_h):
    rows = _rows(x, source)
    h = x.new_empty((rows if save_h else 0, _fc1_width(w1, w3)))
    return x.new_empty((rows, x.shape[1])), h


def _dims(rows_operand: Tensor, w: Tensor) -> tuple[int, int, int, int]:
    """(rows, n, k, groups) of the forward GEMM of a (G, n, k) weight."""
    return (size_hint(rows_operand.shape[0]), size_hint(w.shape[1]), size_hint(w.shape[2]),
            size_hint(w.shape[0]))


def _fc2_on_cuda(rows_operand: Tensor, w2: Tensor) -> bool:
    """FC2's grouped GEMMs (forward and input gradient) on the CUDA kernel where it applies
    and the problem is large enough (configs.fused_mlp_fc2_on_cuda says why)."""
    return fused_mlp_fc2_on_cuda(*_dims(rows_operand, w2))


def _fc1_on_cuda(x: Tensor, source: Optional[Tensor], w1: Tensor, b1: Optional[Tensor],
                 a: Tensor) -> bool:
    """FC1 as the CUDA GEMM plus the activation kernel (configs.fused_mlp_fc1_on_cuda), where
    the CUDA kernel takes FC1's operands (gathered rows are a contiguous copy of x's)."""
    rows = x if source is None else x.new_empty((0, x.shape[1]))
    return (fused_mlp_fc1_on_cuda(size_hint(a.shape[1]), *_dims(a, w1))
            and cuda_kernel_applies(rows, w1.transpose(-2, -1), b1, x.dtype))


# ---------------------------------------------------------------------------- moe_mlp


@kernel_op("moe_mlp", device_types=("cuda", "cpu"), traced=True,
           autograd="formula")
@on_tensor_device
def _moe_mlp(x: Tensor, offs: Tensor, w1: Tensor, w2: Tensor, activation: str,
             gate_up_layout: str = "stacked", probs: Optional[Tensor] = None,
             b1: Optional[Tensor] = None, b2: Optional[Tensor] = None,
             source: Optional[Tensor] = None, row_of: Optional[Tensor] = None,
             alpha: float = reference.GPT_OSS_ALPHA, limit: float = reference.GPT_OSS_LIMIT,
             save_h: bool = True, w3: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    check_inputs(x, offs, w1, w2, activation, gate_up_layout, probs, b1, b2, source, row_of, w3)
    top_k = 1 if row_of is None else row_of.shape[1]
    if not use_kernel(x):
        # (The reference's stacked copy of w1 and w3 is the CPU path's only.)
        w_fc1 = w1 if w3 is None else torch.cat([w1, w3], dim=1)
        y, h = reference.moe_mlp(x, offs, w_fc1, w2, activation, gate_up_layout, probs, b1, b2,
                                 source, top_k, alpha, limit)
        return y, (h if save_h else h[:0])
    rows_n = _rows(x, source)
    n1 = _fc1_width(w1, w3)
    a = x.new_empty((rows_n, w2.shape[2]))
    h = x.new_empty((0, n1))  # what is kept without save_h
    # Two weights take the fused kernel, which reads both; the CUDA GEMM reads one.
    if w3 is None and _fc1_on_cuda(x, source, w1, b1, a):
        from compiled_moe.kernels import activations

        rows = sorted_input(x, source, row_of)  # the gathered rows live until FC1 is done
        h_full = grouped_mm_on_device(rows, w1.transpose(-2, -1), offs, b1)
        activations.activation_forward(h_full, a, activation, gate_up_layout, alpha, limit,
                                       probs=None if probs is None else probs.contiguous())
        if save_h:
            h = h_full
    else:
        if save_h:
            h = x.new_empty((rows_n, n1))
        _kernels().mlp_fc1(x, source, top_k, w1, offs, b1,
                           None if probs is None else probs.contiguous(),
                           h if save_h else None, a, activation, gate_up_layout, alpha, limit,
                           w3)
    y = grouped_mm_on_device(a, w2.transpose(-2, -1), offs, b2, cuda=_fc2_on_cuda(a, w2))
    return y, h


@_moe_mlp.register_fake
def _(x, offs, w1, w2, activation, gate_up_layout="stacked", probs=None, b1=None, b2=None,
      source=None, row_of=None, alpha=reference.GPT_OSS_ALPHA, limit=reference.GPT_OSS_LIMIT,
      save_h=True, w3=None):
    check_inputs(x, offs, w1, w2, activation, gate_up_layout, probs, b1, b2, source, row_of, w3)
    return _outputs(x, w1, w3, source, save_h)


def _setup(ctx, inputs, output):
    (x, offs, w1, w2, activation, gate_up_layout, probs, b1, b2, source, row_of, alpha, limit,
     save_h, w3) = inputs
    _, h = output
    ctx.mark_non_differentiable(h)
    ctx.save_for_backward(x, offs, w1, w2, probs, source, row_of, h, w3)
    ctx.args = (activation, gate_up_layout, alpha, limit)
    ctx.save_h = save_h
    ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)


def _weight_grad(d: Tensor, a: Tensor, offs: Tensor, w: Tensor) -> Tensor:
    """Per-group d_g^T @ a_g shaped like w (G, P, Q), written in w's own storage order."""
    if w.stride(1) == 1 and w.stride(2) != 1:  # w is a transposed view
        return _ops.grouped_mm_wgrad(a, d, offs, out_dtype=w.dtype).mT
    return _ops.grouped_mm_wgrad(d, a, offs, out_dtype=w.dtype)


def _gate_up(dh: Tensor, w1: Tensor) -> tuple[Tensor, Tensor]:
    """The gate and up columns of a stacked (M, 2I) gradient, as views."""
    inter = w1.shape[1]
    return dh[:, :inter], dh[:, inter:]


def input_grads(dy, x, offs, w1, w2, probs, source, row_of, h, activation_args, need_x,
                w3=None):
    """Backward to the inputs: ``(grad_x or None, dh, a, dprobs)``; dh and a (FC2's input,
    recomputed) are what the weight gradients need."""
    dh, a, dprobs = _ops.moe_mlp_fc2_dgrad(dy, w2, h, offs, probs, *activation_args)
    grad_x = None
    if need_x:
        if w3 is None:
            dx = _ops.grouped_mm(dh, w1, offs)
        else:  # the two halves of dh against their own weights (no stacked copy of w1, w3)
            dh_gate, dh_up = _gate_up(dh, w1)
            dx = _ops.grouped_mm(dh_gate, w1, offs) + _ops.grouped_mm(dh_up, w3, offs)
        grad_x = dx if source is None else _ops.moe_unpermute(dx, row_of, source)
    return grad_x, dh, a, dprobs


def sorted_input(x, source, row_of):
    """FC1's input rows in sorted order (gathered again in backward instead of kept)."""
    return x if source is None else _ops.moe_permute(x, row_of, source)


def weight_grads(dy, dh, a, x, offs, w1, w2, source, row_of, need_w1=True, need_w2=True):
    """(grad_w1, grad_w2) shaped and laid out like the weights (None where not needed)."""
    grad_w1 = grad_w2 = None
    if need_w1:
        grad_w1 = _weight_grad(dh, sorted_input(x, source, row_of), offs, w1)
    if need_w2:
        grad_w2 = _weight_grad(dy, a, offs, w2)
    return grad_w1, grad_w2


def gate_up_weight_grads(dh, x, offs, w1, w3, source, row_of, need_w1, need_w3):
    """(grad_w1, grad_w3) of separate gate and up weights, from their halves of dh."""
    xs = sorted_input(x, source, row_of) if need_w1 or need_w3 else None
    dh_gate, dh_up = _gate_up(dh, w1)
    return (_weight_grad(dh_gate, xs, offs, w1) if need_w1 else None,
            _weight_grad(dh_up, xs, offs, w3) if need_w3 else None)


def bias_grads(dy, dh, offs, bias_dtypes, need_b1, need_b2):
    b1_dtype, b2_dtype = bias_dtypes
    grad_b1 = grad_b2 = None
    if b1_dtype is not None and need_b1:
        grad_b1 = _ops.grouped_sum(dh, offs, out_dtype=b1_dtype)
    if b2_dtype is not None and need_b2:
        grad_b2 = _ops.grouped_sum(dy, offs, out_dtype=b2_dtype)
    return grad_b1, grad_b2


def _backward(ctx, grad_y, _grad_h):
    x, offs, w1, w2, probs, source, row_of, h, w3 = ctx.saved_tensors
    if not ctx.save_h:
        raise RuntimeError("moe_mlp ran with save_h=False, which keeps nothing for backward")
    # The dispatcher drops trailing arguments left at their defaults: pad to the schema.
    need = tuple(ctx.needs_input_grad) + (False,) * 15
    dy = grad_y.to(x.dtype)
    grad_x, dh, a, dprobs = input_grads(dy, x, offs, w1, w2, probs, source, row_of, h, ctx.args,
                                        need[0], w3)
    if w3 is None:
        grad_w1, grad_w2 = weight_grads(dy, dh, a, x, offs, w1, w2, source, row_of, need[2],
                                        need[3])
        grad_w3 = None
    else:
        _, grad_w2 = weight_grads(dy, dh, a, x, offs, w1, w2, source, row_of, False, need[3])
        grad_w1, grad_w3 = gate_up_weight_grads(dh, x, offs, w1, w3, source, row_of, need[2],
                                                need[14])
    grad_probs = dprobs.to(probs.dtype) if probs is not None and need[6] else None
    grad_b1, grad_b2 = bias_grads(dy, dh, offs, ctx.bias_dtypes, need[7], need[8])
    return (grad_x, None, grad_w1, grad_w2, None, None, grad_probs, grad_b1, grad_b2, None, None,
            None, None, None, grad_w3)


_moe_mlp.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------- moe_mlp_fc2_dgrad


def _check_dgrad(dy, w2, h, offs, probs, activation, gate_up_layout) -> None:
    check_tensor("dy", dy, 2)
    check_tensor("w2", w2, 3)
    check_tensor("h", h, 2)
    check_same_dtype("dy", dy, w2=w2, h=h)
    check_offs(offs, w2.shape[0])
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    inter = w2.shape[2]
    n1 = 2 * inter if activation in GATED_ACTIVATIONS else inter
    if tuple(h.shape) != (dy.shape[0], n1) or dy.shape[1] != w2.shape[1]:
        raise ValueError(f"need dy (M, H), w2 (G, H, I), h (M, N1) with N1 = {n1}; got dy "
                         f"{tuple(dy.shape)}, w2 {tuple(w2.shape)}, h {tuple(h.shape)}")
    check_probs(probs, dy.shape[0])
    check_same_device("dy", dy, w2=w2, h=h, offs=offs, probs=probs)


def _dgrad_outputs(dy, w2, h, probs):
    dprobs = h.new_empty((dy.shape[0] if probs is not None else 0,), dtype=torch.float32)
    return (h.new_empty(h.shape), h.new_empty((dy.shape[0], w2.shape[2])), dprobs)


@kernel_op("moe_mlp_fc2_dgrad", device_types=("cuda", "cpu"), traced=True)
@on_tensor_device
def _moe_mlp_fc2_dgrad(dy: Tensor, w2: Tensor, h: Tensor, offs: Tensor, probs: Optional[Tensor],
                       activation: str, gate_up_layout: str, alpha: float, limit: float
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, a, dprobs): see reference.moe_mlp_fc2_dgrad; dprobs is fp32, empty without probs."""
    _check_dgrad(dy, w2, h, offs, probs, activation, gate_up_layout)
    if not use_kernel(dy):
        dh, a, dprobs = reference.moe_mlp_fc2_dgrad(dy, w2, h, offs, probs, activation,
                                                    gate_up_layout, alpha, limit)
        if dprobs is None:
            dprobs = h.new_empty((0,), dtype=torch.float32)
        return dh, a, dprobs.to(torch.float32)
    from compiled_moe.kernels import activations

    dh, a, dprobs = _dgrad_outputs(dy, w2, h, probs)
    da = grouped_mm_on_device(dy, w2, offs, cuda=_fc2_on_cuda(dy, w2))
    activations.activation_backward(da, h, dh, activation, gate_up_layout, alpha, limit,
                                    act_out=a, probs=probs,
                                    dprobs=dprobs if probs is not None else None)
    return dh, a, dprobs


@_moe_mlp_fc2_dgrad.register_fake
def _(dy, w2, h, offs, probs, activation, gate_up_layout, alpha, limit):
    _check_dgrad(dy, w2, h, offs, probs, activation, gate_up_layout)
    return _dgrad_outputs(dy, w2, h, probs)
