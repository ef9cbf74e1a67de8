"""Dispatch and combine across an expert-parallel group: global topk_ids -> each rank's
expert-sorted rows (grouped_mm offsets) -> back to the tokens' ranks.

Rank r of a group of P owns experts [r * E/P, (r+1) * E/P). A (token, slot) pair with expert
e goes to rank e // (E/P) as local expert e % (E/P).

Send layout. Every rank lays the rows it sends out in one buffer, chunk-major, then by
destination rank: chunk c holds, for destination 0, 1, ..., P-1, that destination's rows of
the chunk. A chunk is one exchange (``all_to_all_single``), so the chunk pipeline of
:func:`compiled_moe.distributed.ep_moe_experts` can run one chunk's exchange while another
chunk's GEMMs run. A destination's pairs fill its rows in flat pair order (t * k + s).

Two modes, told apart by ``capacity_factor``:

* sync-free (a float): every (source, destination) rank pair gets ``capacity`` rows,
  ``ceil(capacity_factor * max_tokens * k / P)`` rounded up to a multiple of the chunk count,
  where ``max_tokens`` is a static bound on any rank's token count, the same on every rank.
  The exchange sizes therefore never depend on this rank's T: ranks with different token
  counts agree on every exchange without telling each other. Exchanges have fixed sizes,
  every count and offset stays on the device, CUDA graphs capture it. Pairs past a
  destination's capacity are dropped (a rank with more than ``max_tokens`` tokens only drops
  more): for each destination, the pairs of this rank in
  ascending flat order (token, then slot) take the rows, and those after the first
  ``capacity`` get none. Pairs whose expert id lies outside [0, E) are dropped too. Dropped
  pairs contribute zero to the output (and get zero gradient); their number comes back as a
  device tensor. Unused rows are zero and carry local expert id -1.
* exact (None): no pair is dropped. Each rank's count per destination is exchanged and read
  on the host (one sync), and exchanges carry exactly the rows sent. Expert ids outside
  [0, E), and a hidden width, dtype or expert count that differs between ranks, raise
  ValueError on every rank of the group alike (the counts carry them) before any row moves.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from compiled_moe.distributed.exchange import exchange
from compiled_moe.reference import offsets_to_counts

# Capacity factors are taken in thousandths, so that the capacity is integer arithmetic on the
# token count (a symbolic size under torch.compile(dynamic=True): no float guard, one graph).
_CAPACITY_FACTOR_SCALE = 1000


class ExchangePlan(NamedTuple):
    """Where each routed pair of this rank goes, and how the exchanges are split.

    row_of: int32 (T, k), the send-buffer row of each (token, slot) pair; -1 if dropped.
    source: int32 (S,), the flat pair index t * k + s of each send row; -1 on unused rows.
    local_ids: int32 (S,), the destination's local expert id of each send row; -1 unused.
    dropped: int64 (), pairs of this rank that were dropped (0 in exact mode).
    chunk_rows: per chunk, (first, end) send rows.
    send_splits / recv_splits: per chunk, rows sent to / received from each rank (host ints,
        exact mode), or None (sync-free: every rank pair exchanges rows / P of the chunk).
    recv_rows: per chunk, rows this rank receives.
    """
    row_of: Tensor
    source: Tensor
    local_ids: Tensor
    dropped: Tensor
    chunk_rows: list
    send_splits: list | None
    recv_splits: list | None
    recv_rows: list


def capacity_rows(max_tokens: int, top_k: int, group_size: int, capacity_factor: float,
                  num_chunks: int = 1) -> int:
    """Rows per (source, destination) rank pair of the sync-free mode:
    ``ceil(capacity_factor * max_tokens * k / P)``, rounded up to a multiple of ``num_chunks``.
    ``capacity_factor`` counts in thousandths. Every argument is the same on every rank of the
    group (the model's configuration), so every rank sizes the exchanges alike."""
    # as_integer_ratio: torch.compile specializes the factor (a guarded constant of the graph)
    # where arithmetic on it would trace a symbolic float into the exchange sizes.
    numerator, denominator = capacity_factor.as_integer_ratio()
    scaled = max_tokens * top_k * round(numerator * _CAPACITY_FACTOR_SCALE / denominator)
    per_pair = (scaled + group_size * _CAPACITY_FACTOR_SCALE - 1) // (
        group_size * _CAPACITY_FACTOR_SCALE)
    return (per_pair + num_chunks - 1) // num_chunks * num_chunks


def check_group(group, name: str = "ep_group") -> int:
    """The group's size; TypeError if it is no ProcessGroup, ValueError if this rank is not in it."""
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of {name} "
                         "(dist.new_group returned GroupMember.NON_GROUP_MEMBER); only the "
                         "group's ranks may call with it")
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup (e.g. "
                        f"dist.new_group(ranks) or a DeviceMesh's get_group()), got "
                        f"{type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of {name}; "
                         "every rank must pass the expert-parallel group it belongs to")
    return group.size()


def check_backend(group, t: Tensor, name: str) -> None:
    """A CUDA tensor over a gloo-only group, or a CPU tensor over an NCCL-only group, is a
    mismatch no exchange can run."""
    backend = str(dist.get_backend(group))
    if t.is_cuda and backend == "gloo" or t.device.type == "cpu" and backend == "nccl":
        raise ValueError(f"{name} is on {t.device} but ep_group's backend is {backend!r}; use "
                         "NCCL for CUDA tensors and gloo for CPU tensors")


def check_mode(capacity_factor, num_chunks, max_tokens) -> None:
    """The mode's arguments; they depend on no data, so every rank of a group raises alike and
    before any collective. Traced (torch.compile), only the bound's presence is checked: the
    other checks read the numbers, which may be symbolic there, and eager calls made them."""
    if capacity_factor is not None and not torch.compiler.is_compiling():
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise TypeError(f"capacity_factor must be a float (sync-free mode) or None (exact "
                            f"mode), got {type(capacity_factor).__name__}")
        if not math.isfinite(capacity_factor) or capacity_factor * _CAPACITY_FACTOR_SCALE < 1:
            raise ValueError(f"capacity_factor must be finite and at least "
                             f"{1 / _CAPACITY_FACTOR_SCALE}, got {capacity_factor}")
    if capacity_factor is not None and max_tokens is None:
        raise ValueError(
            f"the sync-free mode (capacity_factor={capacity_factor}) needs max_tokens "
            "(ep_max_tokens), the most tokens any rank of the group passes in one call, the "
            "same on every rank: the exchange sizes derive from it, so that ranks with "
            "different token counts agree on them; or pass capacity_factor=None for the "
            "exact mode")
    if torch.compiler.is_compiling():
        return
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens (ep_max_tokens) must be a positive int, got {max_tokens!r}")
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")


def _chunk_bounds(quota: Tensor, num_chunks: int) -> Tensor:
    """(N + 1, P) first quota row of each chunk per destination: ceil(c * quota[d] / N). Chunk c
    of destination d holds that destination's quota rows [bounds[c, d], bounds[c + 1, d])."""
    c = torch.arange(num_chunks + 1, device=quota.device, dtype=torch.int64)[:, None]
    return (c * quota[None, :] + num_chunks - 1) // num_chunks


def _host_chunk_splits(quota: list, num_chunks: int) -> list:
    """_chunk_bounds on host ints: per chunk, the rows of each destination."""
    bounds = [[-(-c * q // num_chunks) for q in quota] for c in range(num_chunks + 1)]
    return [[hi - lo for lo, hi in zip(bounds[c], bounds[c + 1])] for c in range(num_chunks)]


def _place_pairs(topk_ids: Tensor, num_experts: int, group_size: int, quota: Tensor,
                 num_chunks: int, num_rows, counts_and_invalid: bool = False):
    """Send rows of every pair under a per-destination quota (int64 (P,) on the device), in the
    send layout of this module. Reads nothing on the host.

    Returns (row_of, source, local_ids, dropped) as in :class:`ExchangePlan`, and with
    ``counts_and_invalid`` also (counts int32 (P,) pairs per destination, invalid int64 ()
    pairs with ids outside [0, E)).
    """
    num_tokens, top_k = topk_ids.shape
    local_experts = num_experts // group_size
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    dest = torch.where(valid, ids // local_experts, -1)
    # Rank of each pair among this rank's pairs for its destination, in flat order: the
    # package's routing op over destinations (stable, deterministic, no host sync).
    ends, dest_row, _ = torch.ops.compiled_moe.moe_route(dest.view(num_tokens, top_k),
                                                         group_size, 1)
    counts = offsets_to_counts(ends)
    dest0 = dest.clamp(min=0)
    pos = dest_row.reshape(-1).to(torch.int64) - (ends - counts).to(torch.int64)[dest0]
    pair_quota = quota[dest0]
    keep = valid & (pos < pair_quota)
    chunk = (pos * num_chunks // pair_quota.clamp(min=1)).clamp(0, num_chunks - 1)
    bounds = _chunk_bounds(quota, num_chunks)
    rows = (bounds[1:] - bounds[:-1]).reshape(-1)  # (N * P,) rows of (chunk, destination)
    first_row = torch.cumsum(rows, 0) - rows
    cell = chunk * group_size + dest0
    row = first_row[cell] + pos - bounds[:-1].reshape(-1)[cell]
    # Pairs without a row write to a spare row past the end, cut off below.
    target = torch.where(keep, row, num_rows)
    flat = torch.arange(ids.shape[0], device=dev, dtype=torch.int32)
    source = torch.full((num_rows + 1,), -1, device=dev, dtype=torch.int32)
    source = source.scatter(0, target, flat)[:num_rows]
    local = torch.full((num_rows + 1,), -1, device=dev, dtype=torch.int32)
    local = local.scatter(0, target, (ids - dest0 * local_experts).to(torch.int32))[:num_rows]
    row_of = torch.where(keep, row, -1).to(torch.int32).view(num_tokens, top_k)
    dropped = ids.shape[0] - keep.sum()
    if counts_and_invalid:
        return row_of, source, local, dropped, counts, (~valid).sum()
    return row_of, source, local, dropped


def plan_exchange(topk_ids: Tensor, num_experts: int, group, capacity_factor: float | None,
                  num_chunks: int = 1, *, max_tokens: int | None = None,
                  hidden: Tensor | None = None) -> ExchangePlan:
    """The send rows of this rank's routed pairs and the exchanges' splits.

    Args:
        topk_ids: (T, k) int32/int64 global expert ids.
        num_experts: E over the whole group; a multiple of the group size.
        group: the expert-parallel ProcessGroup (P ranks).
        capacity_factor: float for the sync-free mode, None for the exact mode (one host sync).
        num_chunks: exchanges the rows are split into (the pipeline's chunks).
        max_tokens: the sync-free mode's static bound on any rank's T, the same on every rank
            (the exchange sizes derive from it); ignored by the exact mode.
        hidden: (T, H), the rows that will be exchanged: the exact mode checks that every rank
            has the same H, dtype and num_experts (raising on every rank alike).
    """
    group_size = group.size()
    top_k = topk_ids.shape[1]
    dev = topk_ids.device
    if capacity_factor is not None:
        capacity = capacity_rows(max_tokens, top_k, group_size, capacity_factor, num_chunks)
        quota = torch.full((group_size,), capacity, device=dev, dtype=torch.int64)
        num_rows = group_size * capacity
        row_of, source, local, dropped = _place_pairs(topk_ids, num_experts, group_size, quota,
                                                      num_chunks, num_rows)
        step = num_rows // num_chunks
        chunk_rows = [(c * step, (c + 1) * step) for c in range(num_chunks)]
        return ExchangePlan(row_of, source, local, dropped, chunk_rows, None, None,
                            [step] * num_chunks)
    if torch.compiler.is_compiling():
        raise ValueError("the exact mode (capacity_factor=None) reads the exchange sizes on the "
                         "host, which a compiled graph cannot; pass a capacity_factor")
    quota, send_counts, recv_counts = _exchange_counts(topk_ids, num_experts, group, hidden)
    num_rows = sum(send_counts)
    row_of, source, local, dropped = _place_pairs(topk_ids, num_experts, group_size, quota,
                                                  num_chunks, num_rows)
    send_splits = _host_chunk_splits(send_counts, num_chunks)
    recv_splits = _host_chunk_splits(recv_counts, num_chunks)
    chunk_rows, first = [], 0
    for splits in send_splits:
        chunk_rows.append((first, first + sum(splits)))
        first += sum(splits)
    return ExchangePlan(row_of, source, local, dropped, chunk_rows, send_splits, recv_splits,
                        [sum(s) for s in recv_splits])


# Codes for the dtypes the exact mode's check compares across ranks (any other dtype: -1).
_ROW_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _exchange_counts(topk_ids: Tensor, num_experts: int, group, hidden: Tensor | None):
    """The exact mode's one sync: each rank sends every destination its pair count together
    with what every rank must agree on (its count of ids outside [0, E), E, and the exchanged
    rows' width and dtype), so that a disagreement raises on every rank alike before a row
    moves (an exchange whose sizes disagree aborts a gloo group and can hang an NCCL one).
    Returns the pairs this rank sends to each rank (int64 (P,) on the device, and as host
    ints) and the pairs it receives from each rank (host ints)."""
    group_size = group.size()
    dev = topk_ids.device
    valid_ids = (topk_ids >= 0) & (topk_ids < num_experts)
    dest = torch.where(valid_ids, topk_ids // (num_experts // group_size), -1)
    dest = dest.reshape(-1).to(torch.int64)
    counts = torch.zeros(group_size + 1, device=dev, dtype=torch.int64)
    counts = counts.scatter_add(0, torch.where(dest >= 0, dest, group_size), torch.ones_like(dest))
    width, dtype = (-1, -1) if hidden is None else (
        hidden.shape[-1], _ROW_DTYPES.index(hidden.dtype) if hidden.dtype in _ROW_DTYPES else -1)
    agreed = torch.tensor([num_experts, width, dtype], device=dev, dtype=torch.int64)
    # (P, 5) to each destination: [pairs for it, invalid ids, E, H, dtype code].
    sent = torch.cat([counts[:group_size, None], counts[group_size:].expand(group_size, 1),
                      agreed.expand(group_size, 3)], 1)
    received = exchange(sent, group)  # (P, 5) from each source
    host = torch.cat([counts[:group_size], received.reshape(-1)]).tolist()
    send_counts = host[:group_size]
    received = [host[group_size + 5 * r:group_size + 5 * (r + 1)] for r in range(group_size)]
    recv_counts = [r[0] for r in received]
    invalid = [r[1] for r in received]
    if any(invalid):
        raise ValueError(f"topk_ids holds expert ids outside [0, {num_experts}) on the "
                         f"expert-parallel group's ranks (per rank: {invalid}); the exact mode "
                         "has no row for them")
    for i, what in enumerate(("num_experts (w1.shape[0] times the group size)",
                              "hidden's width H", "hidden's dtype")):
        seen = [r[2 + i] for r in received]
        if len(set(seen)) > 1:
            if i == 2:
                seen = [str(_ROW_DTYPES[c]) if c >= 0 else "other" for c in seen]
            raise ValueError(f"{what} differs between the expert-parallel group's ranks "
                             f"(per rank: {seen}); every rank must pass the same")
    return counts[:group_size], send_counts, recv_counts


class EPDispatch(NamedTuple):
    """What :func:`ep_dispatch` returns: this rank's expert-sorted rows and the way back.

    x: (R, H), the rows this rank received, sorted by local expert; rows past offs[-1] are zero.
    offs: int32 (E / P,), cumulative end row of each local expert (the grouped_mm convention).
    dropped: int64 (), pairs of this rank dropped (sync-free mode; 0 in exact mode).
    The other fields are the layouts :func:`ep_combine` needs.
    """
    x: Tensor
    offs: Tensor
    dropped: Tensor
    plan: ExchangePlan
    sorted_row_of: Tensor
    sorted_source: Tensor
    group: object


def ep_dispatch(hidden: Tensor, topk_ids: Tensor, num_experts: int, ep_group, *,
                capacity_factor: float | None = 1.25, max_tokens: int | None = None) -> EPDispatch:
    """Send every routed (token, slot) pair's hidden row to the rank owning its expert, and
    sort what this rank receives by local expert.

    Args:
        hidden: (T, H) bf16/fp16/fp32/fp64. Differentiable.
        topk_ids: (T, k) int32/int64 global expert ids in [0, num_experts).
        num_experts: E, the experts of the whole group; a multiple of the group size P. Rank r
            owns experts [r * E/P, (r+1) * E/P).
        ep_group: the expert-parallel ProcessGroup; every rank of it calls this together.
        capacity_factor: sync-free mode with ``ceil(capacity_factor * max_tokens * k / P)``
            rows per rank pair, or None for the exact mode (one host sync); see this module's
            docstring for the drop order.
        max_tokens: the sync-free mode's bound on any rank's T, the same on every rank;
            required there (ranks may pass different T up to it), ignored in exact mode.

    Returns:
        :class:`EPDispatch`: ``x`` (R, H) expert-sorted with ``offs`` int32 (E/P,); R is
        P * capacity (sync-free; the same on every rank) or the rows received (exact).
    """
    check_mode(capacity_factor, 1, max_tokens)
    if torch.compiler.is_compiling():
        group_size = ep_group.size()
    else:
        group_size = check_group(ep_group)
        _check_dispatch_args(hidden, topk_ids, num_experts, group_size, ep_group)
    plan = plan_exchange(topk_ids, num_experts, ep_group, capacity_factor,
                         max_tokens=max_tokens, hidden=hidden)
    send_x = torch.ops.compiled_moe.moe_permute(hidden, plan.row_of, plan.source)
    split = plan.recv_splits and plan.recv_splits[0], plan.send_splits and plan.send_splits[0]
    recv_x = exchange(send_x, ep_group, *split)
    recv_ids = exchange(plan.local_ids, ep_group, *split)
    offs, sorted_row_of, sorted_source = torch.ops.compiled_moe.moe_route(
        recv_ids.view(-1, 1), num_experts // group_size, 1)
    x = torch.ops.compiled_moe.moe_permute(recv_x, sorted_row_of, sorted_source)
    return EPDispatch(x, offs, plan.dropped, plan, sorted_row_of, sorted_source, ep_group)


def ep_combine(y: Tensor, topk_weights: Tensor, dispatched: EPDispatch) -> Tensor:
    """Send expert outputs back and sum each token's pairs with its routing weights:
    ``out[t] = sum_s topk_weights[t, s] * y_row(t, s)``, dropped pairs adding nothing.

    Args:
        y: (R, H), expert outputs in the row order of ``dispatched.x``. Differentiable.
        topk_weights: (T, k) float routing weights, applied here on the tokens' own rank (so
            their gradient stays local). Differentiable.
        dispatched: what :func:`ep_dispatch` returned for these tokens.

    Returns:
        (T, H) in y's dtype, summed in fp32 in slot order (deterministic).
    """
    if not torch.compiler.is_compiling():
        if not isinstance(dispatched, EPDispatch):
            raise TypeError(f"dispatched must be what ep_dispatch returned, got "
                            f"{type(dispatched).__name__}")
        if y.dim() != 2 or y.shape[0] != dispatched.x.shape[0]:
            raise ValueError(f"y must be (R, H) with R = {dispatched.x.shape[0]} rows like "
                             f"dispatched.x, got {tuple(y.shape)}")
        if tuple(topk_weights.shape) != tuple(dispatched.plan.row_of.shape):
            raise ValueError(f"topk_weights must be (T, k) = {tuple(dispatched.plan.row_of.shape)} "
                             f"like the dispatched topk_ids, got {tuple(topk_weights.shape)}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    plan = dispatched.plan
    # Back to the received order (one row per received row, k = 1), then to the senders.
    y_recv = torch.ops.compiled_moe.moe_unpermute(y, dispatched.sorted_row_of,
                                                  dispatched.sorted_source)
    split = plan.send_splits and plan.send_splits[0], plan.recv_splits and plan.recv_splits[0]
    y_back = exchange(y_recv, dispatched.group, *split)
    return torch.ops.compiled_moe.moe_unpermute(y_back, plan.row_of, plan.source, topk_weights)


def _check_dispatch_args(hidden, topk_ids, num_experts, group_size, group) -> None:
    from compiled_moe.ops._dispatch import check_same_device, check_tensor

    check_tensor("hidden", hidden, 2)
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids must be (T, k) with T = {hidden.shape[0]} like hidden, got "
                         f"{tuple(topk_ids.shape)}")
    check_same_device("hidden", hidden, topk_ids=topk_ids)
    check_num_experts(num_experts, group_size)
    check_backend(group, hidden, "hidden")


def check_num_experts(num_experts, group_size: int, name: str = "num_experts") -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{name} must be a positive int, got {num_experts!r}")
    if num_experts % group_size:
        raise ValueError(f"{name} = {num_experts} is not divisible by the expert-parallel group "
                         f"size {group_size}: every rank holds {name} / group size experts")
