"""Triton kernels of routing: the sorted layout of few pairs, and moving rows between token
order and expert-sorted order.

route_one_program: moe_route for up to ROUTE_ONE_PROGRAM_PAIRS pairs in one program (larger
              routings run the NVRTC kernels of csrc/moe_route.cu)
gather_rows:  out[r] = scale[source[r]] * x[source[r] // k]      (moe_permute, and the backward
              of moe_unpermute, which also takes dot[source[r]] = <x[t], other[r]>)
combine_rows: out[t] = sum_s weights[t, s] * y[row_of[t, s]]     (moe_unpermute)

Each token sums its own k rows in slot order: no atomics, bitwise deterministic.
Last dimensions must be contiguous (the launchers copy when they are not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from compiled_moe.kernels.configs import (combine_rows_config, gather_rows_config,
                                         route_one_program_config, size_hint)


@triton.jit
def _route_one_program_kernel(ids_ptr, offs_ptr, row_of_ptr, source_ptr, n, capacity, num_experts,
                              pad_multiple, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    i = tl.arange(0, BLOCK_N)
    in_range = i < n
    e = tl.load(ids_ptr + i, mask=in_range, other=-1)
    valid = in_range & (e >= 0) & (e < num_experts)  # compared before the int32 cast
    e = tl.where(valid, e, num_experts).to(tl.int32)
    # Unique keys, expert-major and pair-minor: one sort is a stable sort by expert, and
    # dropped pairs (and lanes past n) come last.
    order = tl.sort(e * BLOCK_N + i)
    sorted_e = order // BLOCK_N
    pair = order % BLOCK_N
    counts = tl.histogram(e, BLOCK_E, mask=valid)
    padded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    ends = tl.cumsum(padded, 0)
    shift = (ends - padded) - (tl.cumsum(counts, 0) - counts)  # padded start - unpadded start
    experts = tl.arange(0, BLOCK_E)
    tl.store(offs_ptr + experts, ends, mask=experts < num_experts)
    kept = sorted_e < num_experts
    row = i + tl.gather(shift, tl.minimum(sorted_e, BLOCK_E - 1), 0)  # sorted position -> row
    for r0 in range(0, capacity, BLOCK_N):
        tl.store(source_ptr + r0 + i, -1, mask=r0 + i < capacity)
    tl.debug_barrier()  # every -1 lands before the rows that hold pairs are written
    tl.store(source_ptr + row, pair, mask=kept)
    tl.store(row_of_ptr + pair, row, mask=kept)
    tl.store(row_of_ptr + i, -1, mask=in_range & ~valid)


@triton.jit
def _gather_rows_kernel(x_ptr, source_ptr, scale_ptr, other_ptr, out_ptr, dot_ptr, num_rows, H,
                        top_k, num_pairs, stride_x, stride_other, stride_out,
                        HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """BLOCK_R rows; the grid's second axis splits the columns, except with HAS_DOT (one
    program then walks the whole row, whose dot product it needs)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    s = tl.load(source_ptr + r, mask=r_ok, other=-1).to(tl.int64)
    valid = (s >= 0) & (s < num_pairs)  # padding rows (-1), and no pair outside the tensors
    s = tl.where(valid, s, 0)
    t = s // top_k
    h_valid = tl.where(valid, H, 0)  # padding rows read nothing and write zeros
    r = r.to(tl.int64)
    if HAS_SCALE:
        w = tl.load(scale_ptr + s, mask=valid, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for h0 in range(tl.program_id(1) * BLOCK_H, H, tl.num_programs(1) * BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        inside = cols[None, :] < h_valid[:, None]
        x = tl.load(x_ptr + t[:, None] * stride_x + cols[None, :], mask=inside, other=0.0)
        if HAS_DOT:
            o = tl.load(other_ptr + r[:, None] * stride_other + cols[None, :], mask=inside,
                        other=0.0)
            dot += x.to(tl.float32) * o.to(tl.float32)
        if HAS_SCALE:
            x = x.to(tl.float32) * w[:, None]
        tl.store(out_ptr + r[:, None] * stride_out + cols[None, :],
                 x.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (cols[None, :] < H))
    if HAS_DOT:
        tl.store(dot_ptr + s, tl.sum(dot, 1).to(dot_ptr.dtype.element_ty), mask=r_ok & valid)


@triton.jit
def _combine_rows_kernel(y_ptr, row_of_ptr, weights_ptr, out_ptr, H, top_k, y_rows, stride_y,
                         stride_out, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in range(0, top_k):
        r = tl.load(row_of_ptr + t * top_k + s).to(tl.int64)
        r_ok = (r >= 0) & (r < y_rows)  # dropped pairs (-1) add nothing, nor rows outside y
        h_valid = tl.where(r_ok, H, 0)
        y = tl.load(y_ptr + tl.where(r_ok, r, 0) * stride_y + cols, mask=cols < h_valid, other=0.0)
        y = y.to(tl.float32)
        if HAS_WEIGHTS:
            y = y * tl.load(weights_ptr + t * top_k + s).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def route_one_program(topk_ids: torch.Tensor, num_experts: int, pad_multiple: int,
                      offs: torch.Tensor, row_of: torch.Tensor, source: torch.Tensor,
                      traced: bool) -> None:
    """moe_route's outputs for at most ROUTE_ONE_PROGRAM_PAIRS pairs, by one program: a sort
    of (expert, pair) keys, a histogram and two scans. ``traced``: launched inside a graph
    trace (wrap_triton records it); otherwise launched directly (an opaque op's body)."""
    n = topk_ids.numel()
    cfg = route_one_program_config(n, num_experts, topk_ids.device.type)
    kernel = wrap_triton(_route_one_program_kernel) if traced else _route_one_program_kernel
    kernel[(1,)](
        topk_ids.contiguous(), offs, row_of, source, n, source.shape[0], num_experts, pad_multiple,
        BLOCK_N=cfg.block_m, BLOCK_E=cfg.block_n, num_warps=cfg.num_warps,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gather_rows(x: torch.Tensor, source: torch.Tensor, top_k: int, out: torch.Tensor,
                scale: torch.Tensor | None = None, other: torch.Tensor | None = None,
                dot: torch.Tensor | None = None) -> None:
    """out[r] = (scale[s] *) x[s // top_k] with s = source[r], 0 where s is not a pair index in
    [0, T * top_k) (padding: -1); dot[s] = <x[t], other[r]>."""
    num_rows, H = out.shape
    if num_rows == 0:
        return
    x = _rows(x)
    source = source.contiguous()
    scale = scale.contiguous() if scale is not None else None
    other = _rows(other) if other is not None else None
    cfg = gather_rows_config(size_hint(H), out.device.type)
    column_programs = 1 if dot is not None else triton.cdiv(H, cfg.block_n)
    grid = (triton.cdiv(num_rows, cfg.block_m), column_programs)
    wrap_triton(_gather_rows_kernel)[grid](
        x, source, scale, other, out, dot, num_rows, H, max(top_k, 1), x.shape[0] * top_k,
        x.stride(0), other.stride(0) if other is not None else 0, out.stride(0),
        HAS_SCALE=scale is not None, HAS_DOT=dot is not None, BLOCK_R=cfg.block_m,
        BLOCK_H=cfg.block_n, num_warps=cfg.num_warps,
    )


def combine_rows(y: torch.Tensor, row_of: torch.Tensor, out: torch.Tensor,
                 weights: torch.Tensor | None = None) -> None:
    """out[t] = sum_s (weights[t, s] *) y[row_of[t, s]]; entries that name no row of y (dropped
    pairs: -1) skipped."""
    num_tokens, H = out.shape
    top_k = row_of.shape[1]
    if num_tokens == 0 or H == 0:
        return
    y = _rows(y)
    cfg = combine_rows_config(size_hint(H), out.device.type)
    grid = (num_tokens, triton.cdiv(H, cfg.block_n))
    wrap_triton(_combine_rows_kernel)[grid](
        y, row_of.contiguous(), weights.contiguous() if weights is not None else None, out,
        H, top_k, y.shape[0], y.stride(0), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK_H=cfg.block_n, num_warps=cfg.num_warps,
    )
