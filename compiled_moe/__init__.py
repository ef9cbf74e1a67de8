"""compiled_moe: Mixture-of-Experts kernels for PyTorch, as ``torch.ops.compiled_moe`` ops.

Group offsets follow ``torch._grouped_mm``: ``offs`` is int32 of shape (G,), the cumulative
END row of each group; group g owns rows [offs[g-1], offs[g]). Empty groups are legal. Rows
past offs[-1] are outputs of zero. Offsets stay on the device: no op reads them on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compiled_moe import ops as _ops  # noqa: F401  (registers torch.ops.compiled_moe.*)
from compiled_moe.reference import counts_to_offsets, offsets_to_counts
from compiled_moe.experts import moe_experts
from compiled_moe.mlp import WeightGradStore, moe_mlp
from compiled_moe.fp8 import FP8_RECIPES, fp8_activation_grouped_mm, fp8_grouped_mm, quantize_weight
from compiled_moe.modules import GroupedLinear, MoEExperts

__all__ = [
    "grouped_mm",
    "grouped_mm_wgrad",
    "grouped_mm_wgrad_accumulate_",
    "grouped_sum",
    "counts_to_offsets",
    "offsets_to_counts",
    "moe_experts",
    "moe_mlp",
    "WeightGradStore",
    "moe_route",
    "moe_permute",
    "moe_unpermute",
    "GroupedLinear",
    "MoEExperts",
    "FP8_RECIPES",
    "grouped_quantize",
    "scaled_grouped_mm",
    "scaled_grouped_mm_wgrad",
    "fp8_activation_grouped_mm",
    "fp8_grouped_mm",
    "quantize_weight",
]
__version__ = "0.1.0"


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, *, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """Grouped matrix product: ``out[r] = a[r] @ b[g] (+ bias[g])`` for the rows r of group g.

    Args:
        a: (M, K) bf16/fp16/fp32 (fp64 on the reference path), any strides.
        b: (G, K, N), same dtype as ``a``; either contiguous or the ``transpose(-2, -1)``
            view of an nn.Linear-style (G, N, K) weight (no copy is made of either).
        offs: int32 (G,), cumulative end row of each group.
        bias: optional (G, N), per-group bias.
        out_dtype: dtype of the result; default ``a.dtype``. Accumulation is fp32.

    Returns:
        (M, N) tensor; rows past ``offs[-1]`` are zero. Differentiable in a, b and bias.
    """
    return torch.ops.compiled_moe.grouped_mm(a, b, offs, bias, out_dtype)


def grouped_mm_wgrad(a: Tensor, grad_out: Tensor, offs: Tensor, *,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    """Per-group ``a_g^T @ grad_out_g``: the weight gradient of :func:`grouped_mm`.

    Args:
        a: (M, K); grad_out: (M, N), same dtype; offs: int32 (G,).
        out_dtype: dtype of the result; default ``a.dtype``. Accumulation is fp32.

    Returns:
        (G, K, N); empty groups give zeros.
    """
    return torch.ops.compiled_moe.grouped_mm_wgrad(a, grad_out, offs, out_dtype)


def grouped_mm_wgrad_accumulate_(main_grad: Tensor, a: Tensor, grad_out: Tensor, offs: Tensor,
                                 *, accumulate_mask: Tensor | None = None) -> Tensor:
    """In place: ``main_grad[g] = (main_grad[g] if accumulate_mask[g] else 0) + a_g^T @ grad_out_g``.

    The fused weight-gradient accumulation of training frameworks (TransformerEngine's
    fuse_wgrad_accumulation and wgrad_accumulation_mask).

    Args:
        main_grad: (G, K, N), usually fp32, any strides: a (G, N, K) buffer shaped like an
            nn.Linear weight is passed as ``main_grad.transpose(-2, -1)``.
        a: (M, K); grad_out: (M, N); offs: int32 (G,).
        accumulate_mask: optional bool (G,) on the device; False overwrites that group's
            gradient instead of adding to it. None accumulates every group.

    Returns:
        ``main_grad``.
    """
    torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_(main_grad, a, grad_out, offs,
                                                        accumulate_mask)
    return main_grad


def grouped_sum(x: Tensor, offs: Tensor, *, out_dtype: torch.dtype | None = None) -> Tensor:
    """Per-group sum of rows: ``out[g] = x[offs[g-1]:offs[g]].sum(0)``, (G, N); fp32 accumulation.

    The bias gradient of :func:`grouped_mm`. x: (M, N); offs: int32 (G,).
    """
    return torch.ops.compiled_moe.grouped_sum(x, offs, out_dtype)


def moe_route(topk_ids: Tensor, num_experts: int, *, pad_multiple: int = 1
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Expert-sorted layout of routed tokens, computed on the device with no host sync.

    One Triton program up to ``kernels.configs.ROUTE_ONE_PROGRAM_PAIRS`` (1024) (token, slot)
    pairs, two NVRTC kernels above.

    Args:
        topk_ids: (T, k) int32/int64 expert ids; ids outside [0, num_experts) are dropped
            (expert parallelism: experts on other ranks).
        num_experts: E, the number of (local) experts.
        pad_multiple: pad every expert's group to a multiple of this many rows.

    Returns:
        ``(offs, row_of, source)``: offs int32 (E,), cumulative end row of each group (the
        grouped_mm convention); row_of int32 (T, k), the sorted row of each (token, slot), -1 if
        dropped; source int32 (capacity,) with capacity = T*k + E*(pad_multiple - 1), the flat
        pair index t*k + s of each sorted row, -1 on padding rows and rows past offs[-1].
        Pairs keep ascending (token, slot) order inside an expert: deterministic.
    """
    return torch.ops.compiled_moe.moe_route(topk_ids, num_experts, pad_multiple)


def moe_permute(hidden: Tensor, row_of: Tensor, source: Tensor, *,
                scale: Tensor | None = None) -> Tensor:
    """Gather tokens into expert-sorted order: ``x[r] = hidden[source[r] // k]`` (capacity, H).

    ``scale`` (T, k), optional, multiplies each row by its pair's value. Padding rows are zero.
    Differentiable in hidden and scale. row_of/source come from :func:`moe_route`; a source entry
    that is no pair index in [0, T*k) gives a zero row, as padding (-1) does, so corrupt values
    never address outside the tensors (as offs values are clamped).
    """
    return torch.ops.compiled_moe.moe_permute(hidden, row_of, source, scale)


def moe_unpermute(y: Tensor, row_of: Tensor, source: Tensor, *,
                  weights: Tensor | None = None) -> Tensor:
    """Combine expert outputs per token: ``out[t] = sum_s weights[t, s] * y[row_of[t, s]]`` (T, H).

    Each token sums its own k rows in slot order, in fp32 (no atomics: deterministic); dropped
    pairs (row_of -1, or any entry that names no row of y) add nothing. Differentiable in y and
    weights.
    """
    return torch.ops.compiled_moe.moe_unpermute(y, row_of, source, weights)


def grouped_quantize(x: Tensor, offs: Tensor | None = None, recipe: str = "fp8_blockwise", *,
                     rowwise: bool = True, columnwise: bool = False
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """FP8 (e4m3) quantization of every group in one launch: ``(data, scale, col_data, col_scale)``.

    Recipes: ``fp8_rowwise`` (one fp32 scale per row), ``fp8_blockwise`` (fp32 scales of 1x128
    blocks of activations/gradients and 128x128 blocks of weights, DeepSeek-V3), ``mxfp8`` (1x32
    blocks, E8M0 uint8 scales 2^(byte-127), exponent rounded up so nothing saturates, as NVIDIA's
    MXFP8 training recipe does; OCP's floor rule can clip a block's largest values).
    Scales multiply: ``x ~ data * scale``; fp32 scales are amax/448.

    Args:
        x: 2-D (M, K) activations with ``offs`` int32 (G,), or 3-D (G, N, K) weights (offs None).
        rowwise: blocks along the last dimension: data like x, scale (M, K/b) or
            (G, N/br, K/bc) (fp8_rowwise: last dimension 1).
        columnwise: blocks along the other dimension, data transposed so that the reduction of
            a weight gradient (or of a dgrad for weights) is contiguous: 2-D col_data (K, M)
            with col_scale (K, slots) (fp8_blockwise: stored K-contiguous, strides (1, K)),
            blocks never crossing a group's end; 3-D col_data
            (G, K, N) with the scales of x.mT. See ``compiled_moe.reference.grouped_quantize``.

    Zero blocks get scale 1.0 (byte 0 for E8M0) and zero data. A block holding Inf or NaN gets
    scale +Inf (byte 255, E8M0's NaN), NaN where x was not finite and 0 elsewhere, so the
    product of a GEMM over it is NaN, not a silently wrong number.
    """
    outs = torch.ops.compiled_moe.grouped_quantize(x, offs, recipe, rowwise, columnwise)
    keep = (rowwise, rowwise, columnwise, columnwise)
    return tuple(t if k else None for t, k in zip(outs, keep))


def scaled_grouped_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor, *,
                      recipe: str = "fp8_blockwise", out_dtype: torch.dtype | None = None,
                      bias: Tensor | None = None) -> Tensor:
    """FP8 grouped product ``out[r] = (a[r] * a_scale) @ (b[g] * b_scale[g]) (+ bias[g])``, (M, N).

    a: (M, K) e4m3 rowwise data with its scale; b: (G, K, N) e4m3, the ``transpose(-2, -1)`` of
    a (G, N, K) weight's rowwise data, with that weight's scale (both from
    :func:`grouped_quantize`). For dgrad pass the weight's columnwise data the same way.
    fp32 accumulation (blockwise: promoted every 128 K); bias (G, N), any float dtype, is added
    to the fp32 product, which is then rounded once to out_dtype (default bf16); rows past
    offs[-1] are zero.
    """
    return torch.ops.compiled_moe.scaled_grouped_mm(a, b, a_scale, b_scale, offs, recipe,
                                                     out_dtype, bias)


def scaled_grouped_mm_wgrad(a_t: Tensor, d_t: Tensor, a_scale: Tensor, d_scale: Tensor,
                            offs: Tensor, *, recipe: str = "fp8_blockwise",
                            out_dtype: torch.dtype | None = None) -> Tensor:
    """FP8 weight gradient ``out[g] = a_g^T @ d_g``, (G, K, N), from the columnwise data and
    scales of a (M, K) and d (M, N) (:func:`grouped_quantize` with ``columnwise=True``);
    out_dtype default bf16; empty groups give zeros."""
    return torch.ops.compiled_moe.scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs,
                                                           recipe, out_dtype)
