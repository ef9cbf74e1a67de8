"""Triton kernel of routing: the sorted layout of few pairs.

route_one_program: moe_route for up to ROUTE_ONE_PROGRAM_PAIRS pairs in one program (larger
              routings run the NVRTC kernels of csrc/moe_route.cu)

Moving rows between token order and expert-sorted order (moe_permute, moe_unpermute) is
csrc/moe_rows.cu's, launched by the C++ layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compiled_moe.kernels import traceable

from compiled_moe.kernels.configs import route_one_program_config


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


def route_one_program(topk_ids: torch.Tensor, num_experts: int, pad_multiple: int,
                      offs: torch.Tensor, row_of: torch.Tensor, source: torch.Tensor,
                      traced: bool) -> None:
    """moe_route's outputs for at most ROUTE_ONE_PROGRAM_PAIRS pairs, by one program: a sort
    of (expert, pair) keys, a histogram and two scans. ``traced``: launched inside a graph
    trace (wrap_triton records it); otherwise launched directly (an opaque op's body)."""
    n = topk_ids.numel()
    cfg = route_one_program_config(n, num_experts, topk_ids.device.type)
    kernel = traceable(_route_one_program_kernel) if traced else _route_one_program_kernel
    kernel[(1,)](
        topk_ids.contiguous(), offs, row_of, source, n, source.shape[0], num_experts, pad_multiple,
        BLOCK_N=cfg.block_m, BLOCK_E=cfg.block_n, num_warps=cfg.num_warps,
    )
