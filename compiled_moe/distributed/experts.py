"""The experts block over an expert-parallel group: dispatch -> local experts -> combine, with
the exchanges of one chunk of rows running while another chunk's expert GEMMs run.

Pipeline (N chunks; the send layout of :mod:`compiled_moe.distributed.dispatch` makes each
chunk a contiguous block of rows and one exchange)::

    compute stream:  route, gather | wait D0, experts 0 | wait D1, experts 1 | ... | combine
    exchange stream:                 D0 D1 ... DN-1     | C0 (after experts 0) | C1 ...

D = dispatch exchange, C = the exchange back. In eager CUDA runs with N > 1 the exchanges are
issued from a side stream; backward then runs each exchange's backward on that stream too
(autograd replays forward's streams), so one chunk's gradient exchange runs while another
chunk's backward GEMMs run, and event waits order them. Tensors crossing streams are marked for
the caching allocator (record_stream) where they are used. Compiled graphs and CPU runs issue
the same ops in the same order on one stream.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from compiled_moe.distributed.dispatch import (check_backend, check_group, check_mode,
                                               plan_exchange)
from compiled_moe.distributed.exchange import exchange
from compiled_moe.local_experts import check_experts_args, local_moe_experts

_exchange_streams: dict = {}


def exchange_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the pipeline issues exchanges from, one per device (kept for the
    process: streams are cheap and a fresh one per call would cost a stream creation)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _exchange_streams:
        _exchange_streams[index] = torch.cuda.Stream(device=index)
    return _exchange_streams[index]


def default_num_chunks(group_size: int) -> int:
    """Two chunks over several ranks (half of the exchanges' time hides behind GEMMs, at the
    cost of GEMMs on half the rows); one over a single rank, where there is nothing to hide."""
    return 1 if group_size == 1 else 2


def ep_moe_experts(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor,
                   w2: Tensor, *, ep_group, capacity_factor: float | None = 1.25,
                   max_tokens: int | None = None, num_chunks: int | None = None,
                   **block_kwargs) -> tuple[Tensor, Tensor]:
    """The experts block with the experts spread over ``ep_group``: each rank passes its own
    tokens, global expert ids and its own experts' weights.

    ``out[t] = sum_s topk_weights[t, s] * FC2_e(act(FC1_e(hidden[t])))``, e = topk_ids[t, s],
    whichever rank holds expert e: the same as :func:`compiled_moe.moe_experts` over all E
    experts, except for dropped pairs (sync-free mode), which add nothing.

    This function always runs the exchanges, over one rank too; ``moe_experts(...,
    ep_group=g)`` skips them when g has one rank.

    Args:
        hidden: (T, H) this rank's tokens. Differentiable.
        topk_ids: (T, k) int32/int64 global expert ids in [0, E), E = w1.shape[0] * P.
        topk_weights: (T, k) float routing weights, applied on this rank. Differentiable.
        w1, w2: this rank's experts, (E/P, N1, H) and (E/P, H, I), as for moe_experts; rank r
            holds experts [r * E/P, (r+1) * E/P). Differentiable (and b1, b2).
        ep_group: the expert-parallel ProcessGroup (P ranks); all its ranks call together.
        capacity_factor: float: sync-free mode, ``ceil(capacity_factor * max_tokens * k / P)``
            rows per rank pair (rounded up to a multiple of num_chunks); None: exact mode, no
            drops, one host sync. See :mod:`compiled_moe.distributed.dispatch` for the drop
            order.
        max_tokens: the sync-free mode's static bound on any rank's T, the same on every rank
            (required there; ranks may pass different T). A rank past it drops more pairs, in
            the same order, counted in ``dropped``. Ignored by the exact mode.
        num_chunks: chunks of the exchange/GEMM pipeline; default 1 over one rank, else 2.
        block_kwargs: moe_experts' keyword arguments (activation, gate_up_layout, b1, b2,
            alpha, limit, fp8_recipe, fused, fp8_weights), for the local experts.

    Returns:
        ``(out, dropped)``: out (T, H) in hidden's dtype; dropped int64 () on the device, the
        pairs of this rank that were dropped (past capacity, or ids outside [0, E)).
    """
    compiling = torch.compiler.is_compiling()
    group_size = ep_group.size() if compiling else check_group(ep_group)
    if num_chunks is None:
        num_chunks = default_num_chunks(group_size)
    check_mode(capacity_factor, num_chunks, max_tokens)
    if not compiling:
        check_experts_args(hidden, topk_ids, topk_weights, w1, w2,
                            block_kwargs.get("activation", "swiglu"),
                            block_kwargs.get("gate_up_layout", "stacked"), block_kwargs.get("b1"),
                            block_kwargs.get("b2"), block_kwargs.get("fp8_recipe"))
        check_backend(ep_group, hidden, "hidden")
    num_experts = w1.shape[0] * group_size
    plan = plan_exchange(topk_ids, num_experts, ep_group, capacity_factor, num_chunks,
                         max_tokens=max_tokens, hidden=hidden)
    send_x = torch.ops.compiled_moe.moe_permute(hidden, plan.row_of, plan.source)

    pipelined = hidden.is_cuda and num_chunks > 1 and not compiling
    compute = torch.cuda.current_stream(hidden.device) if pipelined else None
    side = exchange_stream(hidden.device) if pipelined else None
    on_side = (lambda: torch.cuda.stream(side)) if pipelined else contextlib.nullcontext

    def splits(c, back=False):
        if plan.send_splits is None:
            return None, None
        pair = plan.recv_splits[c], plan.send_splits[c]
        return pair[::-1] if back else pair

    # Dispatch every chunk up front: the side stream runs them back to back while the compute
    # stream starts on the first chunk as soon as it has arrived.
    if pipelined:
        side.wait_stream(compute)
    received = []
    for c, (first, end) in enumerate(plan.chunk_rows):
        x_c, ids_c = send_x[first:end], plan.local_ids[first:end]
        with on_side():
            recv_x = exchange(x_c, ep_group, *splits(c), input_stream=compute)
            recv_ids = exchange(ids_c, ep_group, *splits(c))
            arrived = _record_event(side) if pipelined else None
        received.append((recv_x, recv_ids, arrived))

    returned = []
    for c, (recv_x, recv_ids, arrived) in enumerate(received):
        if pipelined:
            compute.wait_event(arrived)
            recv_x.record_stream(compute)
            recv_ids.record_stream(compute)
        # The local block on the received rows: one slot per row, weight 1 (routing weights
        # are applied at the source), ids -1 on unused rows, which it skips.
        ones = torch.ones(recv_x.shape[0], 1, device=recv_x.device, dtype=recv_x.dtype)
        y = local_moe_experts(recv_x, recv_ids.view(-1, 1), ones, w1, w2, **block_kwargs)
        if pipelined:
            side.wait_stream(compute)
        with on_side():
            returned.append(exchange(y, ep_group, *splits(c, back=True), input_stream=compute))
    if pipelined:
        compute.wait_stream(side)
        for y_back in returned:
            y_back.record_stream(compute)
    y_back = returned[0] if num_chunks == 1 else torch.cat(returned)
    out = torch.ops.compiled_moe.moe_unpermute(y_back, plan.row_of, plan.source, topk_weights)
    return out, plan.dropped


def _record_event(stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def ep_block(hidden, topk_ids, topk_weights, w1, w2, *, ep_group, capacity_factor, max_tokens,
             num_chunks, **block_kwargs) -> tuple[Tensor, Tensor]:
    """What ``moe_experts(..., ep_group=...)`` runs: :func:`ep_moe_experts`, except over a
    group of one rank, where the exchanges are the identity and the block is the local one on
    the tokens with dropped pairs' ids set to -1 (same drops, same sums, no copies)."""
    compiling = torch.compiler.is_compiling()
    group_size = ep_group.size() if compiling else check_group(ep_group)
    if group_size > 1:
        return ep_moe_experts(hidden, topk_ids, topk_weights, w1, w2, ep_group=ep_group,
                              capacity_factor=capacity_factor, max_tokens=max_tokens,
                              num_chunks=num_chunks, **block_kwargs)
    check_mode(capacity_factor, 1 if num_chunks is None else num_chunks, max_tokens)
    if not compiling:
        check_backend(ep_group, hidden, "hidden")
    plan = plan_exchange(topk_ids, w1.shape[0], ep_group, capacity_factor, max_tokens=max_tokens)
    kept_ids = torch.where(plan.row_of >= 0, topk_ids, -1)
    return local_moe_experts(hidden, kept_ids, topk_weights, w1, w2, **block_kwargs), plan.dropped
