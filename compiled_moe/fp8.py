"""FP8 training of grouped linear layers: quantize, FP8 GEMMs forward, dgrad and wgrad.

``fp8_grouped_mm(a, b, offs, recipe=...)`` is ``grouped_mm`` with FP8 tensor-core math: the
inputs stay in bf16/fp16/fp32 (master weights too), every GEMM of forward and backward runs on
e4m3 operands quantized in one launch per tensor, and gradients come back in the inputs'
dtypes. Forward quantizes the activation both ways (rowwise for this GEMM, columnwise for the
weight gradient) and keeps only the columnwise copy for backward, one byte per element.

The weight is quantized in every call unless ``weight_fp8`` brings its quantization (both
ways, from ``quantize_weight``): with several micro-batches per optimizer step, quantize once
per step and pass it to each (benchmarks/bench_fp8_training.py measures both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compiled_moe.ops._dispatch import (check_tensor, host_layer, is_real_tensor,
                                        is_transposed_weight)
from compiled_moe.ops.activations import activation_constants
from compiled_moe.reference import (
    FP8_DTYPE,
    FP8_RECIPES,
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    check_recipe,
)

_ops = torch.ops.compiled_moe


def _quantize(x, offs, recipe, rowwise, columnwise):
    return _ops.grouped_quantize(x, offs, recipe, rowwise, columnwise)


def quantize_weight(w: Tensor, recipe: str = "fp8_blockwise") -> tuple[Tensor, ...]:
    """The quantization of a (G, N, K) weight that ``fp8_grouped_mm(a, w.mT, offs,
    weight_fp8=...)`` uses: ``grouped_quantize(w, None, recipe, rowwise=True,
    columnwise=True)``, the rowwise data and scales (forward) and the columnwise ones (dgrad).
    Compute it once per optimizer step (after the weight changes) and reuse it across
    micro-batches; it holds two bytes per weight element. Not differentiable (w is detached)."""
    check_recipe(recipe)
    check_tensor("w", w, 3)
    return _quantize(w.detach(), None, recipe, True, True)


def _host_autograd(a, b, offs, bias, weight_fp8, probs=None):
    """The C++ host layer where an eager call takes its autograd function: real tensors (and
    weight_fp8 None or 4 of them; the Python checks name what else was passed), not traced
    (torch.compile traces the Python function, whose ops it sees), no dispatch mode."""
    tensors = (a, b, offs) + tuple(t for t in (bias, probs) if t is not None)
    if weight_fp8 is not None:
        if not isinstance(weight_fp8, (tuple, list)) or len(weight_fp8) != 4:
            return None
        tensors += tuple(weight_fp8)
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() != 0
            or not all(isinstance(t, Tensor) and is_real_tensor(t) for t in tensors)):
        return None
    return host_layer()


def _check_weight_fp8(weight_fp8, b: Tensor, recipe: str) -> None:
    from compiled_moe.ops.fp8 import quantized_scale_dtype, weight_quantized_shapes

    # The shapes and dtypes quantize_weight gives, computed on the host (meta tensors from the
    # op's fake cost 97 us per call on the H200's host, twice per FP8 MLP step).
    shapes = weight_quantized_shapes(tuple(b.mT.shape), recipe)
    dtypes = (FP8_DTYPE, quantized_scale_dtype(recipe)) * 2
    if not isinstance(weight_fp8, (tuple, list)) or len(weight_fp8) != 4:
        raise TypeError("weight_fp8 must be the 4 tensors of quantize_weight(w, recipe), "
                        f"got {type(weight_fp8).__name__}")
    for i, (t, shape, dtype) in enumerate(zip(weight_fp8, shapes, dtypes)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"weight_fp8[{i}] must be {shape} {dtype}, as "
                             f"quantize_weight(b.mT, {recipe!r}) gives, got {got}")
        if t.device != b.device:
            raise ValueError(f"weight_fp8[{i}] is on {t.device} but b is on {b.device}")


def _check_operands(a_name: str, a, b, recipe: str, weight_fp8) -> tuple | None:
    """The wrappers' checks of their activation, weight and recipe; weight_fp8 as a tuple."""
    check_recipe(recipe)
    check_tensor(a_name, a, 2)
    check_tensor("b", b, 3)
    if weight_fp8 is None:
        return None
    _check_weight_fp8(weight_fp8, b, recipe)
    return tuple(weight_fp8)


class _FP8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, offs, bias, recipe, weight_fp8):
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        a_q, a_s, a_col, a_col_s = _quantize(a, offs, recipe, True, need_b)
        # b (G, K, N) is usually the transposed view of a (G, N, K) weight: b.mT is that weight.
        if weight_fp8 is None:
            weight_fp8 = _quantize(b.mT, None, recipe, True, need_a)
        w_q, w_s, w_col, w_col_s = weight_fp8
        out = _ops.scaled_grouped_mm(a_q, w_q.mT, a_s, w_s, offs, recipe, a.dtype, bias)
        ctx.save_for_backward(a_col, a_col_s, w_col, w_col_s, offs)
        _save_weight_args(ctx, a, b, bias, recipe)
        return out

    @staticmethod
    def backward(ctx, grad):
        a_col, a_col_s, w_col, w_col_s, offs = ctx.saved_tensors
        grad_a, grad_b, grad_bias = _backward(ctx, grad, a_col, a_col_s, w_col, w_col_s, offs,
                                              ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                              ctx.needs_input_grad[3])
        return grad_a, grad_b, None, grad_bias, None, None


def _save_weight_args(ctx, a, b, bias, recipe) -> None:
    ctx.recipe, ctx.a_dtype, ctx.b_dtype = recipe, a.dtype, b.dtype
    ctx.b_transposed = is_transposed_weight(b)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad, a_col, a_col_s, w_col, w_col_s, offs, need_a, need_b, need_bias):
    """(grad of a, of b, of bias) of out = a @ b[g] (+ bias[g]) in FP8, from the columnwise data
    of a and of the weight (None where not needed)."""
    grad_a = grad_b = grad_bias = None
    if need_a or need_b:  # (the bias alone needs no quantized gradient)
        g_q, g_s, g_col, g_col_s = _quantize(grad.to(ctx.a_dtype), offs, ctx.recipe, need_a, need_b)
    if need_a:
        # dgrad: grad (M, N) @ W (N, K); w_col (G, K, N) is W's columnwise data.
        grad_a = _ops.scaled_grouped_mm(g_q, w_col.mT, g_s, w_col_s, offs, ctx.recipe,
                                        ctx.a_dtype)
    if need_b and ctx.b_transposed:  # (G, N, K), the weight's own storage order
        grad_b = _ops.scaled_grouped_mm_wgrad(g_col, a_col, g_col_s, a_col_s, offs,
                                              ctx.recipe, ctx.b_dtype).mT
    elif need_b:
        grad_b = _ops.scaled_grouped_mm_wgrad(a_col, g_col, a_col_s, g_col_s, offs,
                                              ctx.recipe, ctx.b_dtype)
    if ctx.bias_dtype is not None and need_bias:  # from the unquantized grad
        grad_bias = _ops.grouped_sum(grad, offs, out_dtype=ctx.bias_dtype)
    return grad_a, grad_b, grad_bias


class _FP8ActivationGroupedMM(torch.autograd.Function):
    """out = (act(h) (* probs)) @ b[g] (+ bias[g]) in FP8: FC2 of the FP8 MLP, its input quantized
    both ways straight from FC1's output h by moe_activation_quantize. Keeps h (the activation's
    backward recomputes from it) and the activation's columnwise FP8 data."""

    @staticmethod
    def forward(ctx, h, b, offs, probs, bias, recipe, weight_fp8, activation, gate_up_layout,
                constants):
        need_b = ctx.needs_input_grad[1]
        a_q, a_s, a_col, a_col_s = _ops.moe_activation_quantize(
            h, offs, activation, gate_up_layout, recipe, probs, True, need_b, **constants)
        if weight_fp8 is None:
            weight_fp8 = _quantize(b.mT, None, recipe, True,
                                   ctx.needs_input_grad[0] or ctx.needs_input_grad[3])
        w_q, w_s, w_col, w_col_s = weight_fp8
        out = _ops.scaled_grouped_mm(a_q, w_q.mT, a_s, w_s, offs, recipe, h.dtype, bias)
        ctx.save_for_backward(h, probs, a_col, a_col_s, w_col, w_col_s, offs)
        _save_weight_args(ctx, h, b, bias, recipe)
        ctx.activation = (activation, gate_up_layout)
        ctx.constants = constants
        return out

    @staticmethod
    def backward(ctx, grad):
        h, probs, a_col, a_col_s, w_col, w_col_s, offs = ctx.saved_tensors
        need_h, need_b, _, need_probs, need_bias = ctx.needs_input_grad[:5]
        grad_a, grad_b, grad_bias = _backward(ctx, grad, a_col, a_col_s, w_col, w_col_s, offs,
                                              need_h or need_probs, need_b, need_bias)
        grad_h = grad_probs = None
        if grad_a is not None and probs is not None:  # a = act(h) * probs
            grad_h, grad_probs = _ops.moe_scaled_activation_backward(
                grad_a, h, probs, *ctx.activation, **ctx.constants)
            grad_probs = grad_probs.to(probs.dtype)
        elif grad_a is not None:
            grad_h = _ops.moe_activation_backward(grad_a, h, *ctx.activation,
                                                  **ctx.constants)
        return grad_h, grad_b, None, grad_probs, grad_bias, None, None, None, None, None


def fp8_activation_grouped_mm(h: Tensor, b: Tensor, offs: Tensor, *, activation: str,
                              gate_up_layout: str = "stacked", probs: Tensor | None = None,
                              recipe: str = "fp8_blockwise", bias: Tensor | None = None,
                              weight_fp8: tuple | None = None, alpha: float = GPT_OSS_ALPHA,
                              limit: float = GPT_OSS_LIMIT) -> Tensor:
    """``fp8_grouped_mm(scaled_activation(h, activation, gate_up_layout, probs), b, offs, ...)``
    with the activation's FP8 data and scales made in one pass over h (FC2 of an FP8 expert MLP:
    a in h's dtype is neither written nor kept). Differentiable in h, b, probs and bias; the
    arguments as for fp8_grouped_mm and moe_mlp."""
    constants = activation_constants(activation, alpha, limit)
    host = _host_autograd(h, b, offs, bias, weight_fp8, probs)
    if host is not None:  # the autograd function in C++ (csrc/host/fp8.cpp), with these checks
        return host.fp8_activation_grouped_mm(
            h, b, offs, probs, bias, recipe, [] if weight_fp8 is None else list(weight_fp8), activation,
            gate_up_layout, constants.get("alpha", GPT_OSS_ALPHA), constants.get("limit", GPT_OSS_LIMIT))
    weight_fp8 = _check_operands("h", h, b, recipe, weight_fp8)
    return _FP8ActivationGroupedMM.apply(h, b, offs, probs, bias, recipe, weight_fp8, activation,
                                         gate_up_layout, constants)


def fp8_grouped_mm(a: Tensor, b: Tensor, offs: Tensor, *, recipe: str = "fp8_blockwise",
                   bias: Tensor | None = None, weight_fp8: tuple | None = None) -> Tensor:
    """``grouped_mm`` with every GEMM of forward and backward in FP8 (e4m3).

    Args:
        a: (M, K) bf16/fp16/fp32 activations. K a multiple of 16 lets the Hopper CUDA kernels
            run; other K run the Triton kernels.
        b: (G, K, N), bf16/fp16/fp32 (not necessarily a's dtype: it is quantized either way);
            usually the ``transpose(-2, -1)`` view of a (G, N, K) nn.Linear-style weight (the
            master weight, kept in its own dtype). Its gradient comes back in its dtype.
        offs: int32 (G,), cumulative end row of each group. Group starts that are multiples of
            16 rows are the Hopper weight-gradient kernel's fast case (route with
            ``pad_multiple=16``); it takes other starts too, shifting each chunk into place, in
            1.20-1.55x the time of the same counts padded (fp8_blockwise, H200). Multiples of 32 also
            let the columnwise quantizer write whole sectors, worth the padding where groups
            are large (``kernels.configs.fp8_group_rows``).
        recipe: ``fp8_blockwise`` (1x128 activations and gradients, 128x128 weights: the
            DeepSeek-V3 recipe), ``fp8_rowwise`` or ``mxfp8`` (1x32 E8M0 blocks).
        bias: optional (G, N), any float dtype: added to the fp32 product before it is rounded
            to a's dtype (in the GEMM's epilogue, as ``grouped_mm`` does); its gradient is the
            group sum of the unquantized output gradient.
        weight_fp8: ``quantize_weight(b.mT, recipe)`` computed beforehand (for the weight as it
            is now: nothing checks that it still matches b's values). The gradient of b is
            still computed and returned.

    Returns:
        (M, N) in a's dtype; rows past offs[-1] are zero (no bias is added there).
        Differentiable in a, b and bias.
    """
    host = _host_autograd(a, b, offs, bias, weight_fp8)
    if host is not None:  # the autograd function in C++ (csrc/host/fp8.cpp), with these checks
        return host.fp8_grouped_mm(a, b, offs, bias, recipe, [] if weight_fp8 is None else list(weight_fp8))
    weight_fp8 = _check_operands("a", a, b, recipe, weight_fp8)
    return _FP8GroupedMM.apply(a, b, offs, bias, recipe, weight_fp8)


__all__ = ["FP8_RECIPES", "fp8_activation_grouped_mm", "fp8_grouped_mm", "quantize_weight"]
