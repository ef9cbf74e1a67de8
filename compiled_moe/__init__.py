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

__all__ = [
    "grouped_mm",
    "grouped_mm_wgrad",
    "grouped_mm_wgrad_accumulate_",
    "grouped_sum",
    "counts_to_offsets",
    "offsets_to_counts",
    "moe_experts",
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
