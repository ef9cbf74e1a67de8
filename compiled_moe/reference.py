"""Pure-torch reference of every compiled_moe op.

These functions are the CPU implementation of the ops and the oracle the GPU
kernels are tested against. They read no tensor values on the host, so they
trace under ``torch.compile(fullgraph=True, dynamic=True)``; they trade speed
for that (a one-hot matmul costs G times the FLOPs of the grouped product).
Half-precision inputs are computed in float32, float64 stays float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_bounds(offs: Tensor, num_rows) -> tuple[Tensor, Tensor]:
    """Start and end row of every group, as every kernel of the package reads them.

    ``offs`` holds cumulative end rows. Values are clamped to [0, num_rows] and made
    non-decreasing (a running maximum), so that corrupt offsets can never address a
    row outside the tensor: group g owns rows [starts[g], ends[g]).
    """
    ends = offs.to(torch.int64).clamp(0, num_rows)
    ends = torch.cummax(ends, 0).values if ends.numel() else ends
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, ends


def row_group_ids(offs: Tensor, num_rows) -> Tensor:
    """Group index of every row (int64, shape (num_rows,)); rows past the last group get G."""
    _, ends = group_bounds(offs, num_rows)
    rows = torch.arange(num_rows, device=offs.device, dtype=torch.int64)
    return torch.searchsorted(ends, rows, right=True)


def _group_one_hot(offs: Tensor, num_rows, dtype: torch.dtype) -> Tensor:
    """(num_rows, G) matrix with a 1 where a row belongs to a group; rows past the end are 0."""
    num_groups = offs.shape[0]
    gid = row_group_ids(offs, num_rows)
    groups = torch.arange(num_groups, device=offs.device, dtype=torch.int64)
    return (gid[:, None] == groups[None, :]).to(dtype)


def counts_to_offsets(counts: Tensor) -> Tensor:
    """Group sizes (G,) -> cumulative end offsets (G,), int32."""
    return torch.cumsum(counts, 0, dtype=torch.int32)


def offsets_to_counts(offs: Tensor) -> Tensor:
    """Cumulative end offsets (G,) -> group sizes (G,), int32 (offsets taken as they are)."""
    return torch.diff(offs.to(torch.int32), prepend=offs.new_zeros(1, dtype=torch.int32))


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """out[r] = a[r] @ b[g(r)] (+ bias[g(r)]) for every row r of group g(r); other rows 0."""
    cdt = _compute_dtype(a.dtype)
    num_rows, k = a.shape
    num_groups, _, n = b.shape
    one_hot = _group_one_hot(offs, num_rows, cdt)  # (M, G)
    # Spread each row of a into its group's K-slot, then one (M, G*K) @ (G*K, N) product.
    a_spread = (one_hot[:, :, None] * a.to(cdt)[:, None, :]).reshape(num_rows, num_groups * k)
    out = a_spread @ b.to(cdt).reshape(num_groups * k, n)
    if bias is not None:
        out = out + one_hot @ bias.to(cdt)
    return out.to(out_dtype or a.dtype)


def grouped_mm_wgrad(a: Tensor, grad_out: Tensor, offs: Tensor,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    """out[g] = a_g^T @ grad_out_g, shape (G, K, N); empty groups give zeros."""
    cdt = _compute_dtype(a.dtype)
    one_hot = _group_one_hot(offs, a.shape[0], cdt)
    out = torch.einsum("mg,mk,mn->gkn", one_hot, a.to(cdt), grad_out.to(cdt))
    return out.to(out_dtype or a.dtype)


def grouped_mm_wgrad_accumulate_(main_grad: Tensor, a: Tensor, grad_out: Tensor, offs: Tensor,
                                 accumulate_mask: Tensor | None = None) -> None:
    """main_grad[g] = (main_grad[g] if accumulate_mask[g] else 0) + a_g^T @ grad_out_g, in place."""
    wgrad = grouped_mm_wgrad(a, grad_out, offs, out_dtype=main_grad.dtype)
    if accumulate_mask is None:
        main_grad.add_(wgrad)
    else:
        keep = accumulate_mask.to(main_grad.dtype)[:, None, None]
        main_grad.copy_(main_grad * keep + wgrad)


def grouped_sum(x: Tensor, offs: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """out[g] = sum of x's rows in group g, shape (G, N) (the bias gradient of grouped_mm)."""
    cdt = _compute_dtype(x.dtype)
    one_hot = _group_one_hot(offs, x.shape[0], cdt)
    return (one_hot.t() @ x.to(cdt)).to(out_dtype or x.dtype)


def expand_groups(x: Tensor, offs: Tensor, num_rows) -> Tensor:
    """out[r] = x[g(r)] for rows inside a group, 0 past the last group: the adjoint of grouped_sum."""
    gid = row_group_ids(offs, num_rows)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return padded[gid]
