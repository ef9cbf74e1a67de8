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
from compiled_moe.modules import GroupedLinear, MoEExperts

__all__ = [
    "grouped_mm",
    "grouped_mm_wgrad",
    "grouped_mm_wgrad_accumulate_",
    "grouped_sum",
    "counts_to_offsets",
    "offsets_to_counts",
    "moe_experts",
    "moe_route",
    "moe_permute",
    "moe_unpermute",
    "GroupedLinear",
    "MoEExperts",
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
    """Expert-sorted layout of routed tokens, computed on the device in two kernel launches.

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
    Differentiable in hidden and scale. row_of/source come from :func:`moe_route`.
    """
    return torch.ops.compiled_moe.moe_permute(hidden, row_of, source, scale)


def moe_unpermute(y: Tensor, row_of: Tensor, source: Tensor, *,
                  weights: Tensor | None = None) -> Tensor:
    """Combine expert outputs per token: ``out[t] = sum_s weights[t, s] * y[row_of[t, s]]`` (T, H).

    Each token sums its own k rows in slot order, in fp32 (no atomics: deterministic); dropped
    pairs add nothing. Differentiable in y and weights.
    """
    return torch.ops.compiled_moe.moe_unpermute(y, row_of, source, weights)
