"""Cases of the distributed CPU tier, run on every rank of a gloo group by tests/ep_pool.py.

Every rank builds the same global problem from one seed (all ranks' tokens, all E experts'
weights), runs its own part through the expert-parallel code, and compares with the
single-process block on the global problem (and an independent per-expert loop), outputs and
every gradient. A case returns what the test checks across ranks, or raises.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import compiled_moe as cm
from compiled_moe.distributed import ep_combine, ep_dispatch, ep_moe_experts
from helpers import loop_moe_experts

_groups: dict = {}


def world_group():
    """The expert-parallel group of every rank (made once per process)."""
    if "world" not in _groups:
        _groups["world"] = dist.new_group(list(range(dist.get_world_size())))
    return _groups["world"]


def own_group():
    """A group of this rank alone (every rank takes part in creating each)."""
    if "own" not in _groups:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _groups["own"] = groups[dist.get_rank()]
    return _groups["own"]


def problem(tokens=12, top_k=3, experts_per_rank=4, hidden=16, inter=8, bias=True,
            dtype=torch.float64, seed=0, allowed=None):
    """The global problem: dict of tensors over all ranks' tokens and all experts.
    ``tokens``: each rank's token count, or a list of them per rank (ragged: p["counts"]).
    ``allowed``: the experts routing may pick (others get no pair)."""
    world = dist.get_world_size()
    counts = [tokens] * world if isinstance(tokens, int) else list(tokens)
    E, T = experts_per_rank * world, sum(counts)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if allowed is not None:
        mask = torch.full((E,), float("-inf"))
        mask[list(allowed)] = 0
        logits = logits + mask
    weights, ids = torch.softmax(logits, -1).topk(top_k)
    p = dict(hidden=torch.randn(T, hidden, generator=g, dtype=dtype),
             topk_ids=ids, topk_weights=weights.to(dtype),
             w1=torch.randn(E, 2 * inter, hidden, generator=g, dtype=dtype) / hidden ** 0.5,
             w2=torch.randn(E, hidden, inter, generator=g, dtype=dtype) / inter ** 0.5,
             dy=torch.randn(T, hidden, generator=g, dtype=dtype), counts=counts)
    if bias:
        p["b1"] = 0.1 * torch.randn(E, 2 * inter, generator=g, dtype=dtype)
        p["b2"] = 0.1 * torch.randn(E, hidden, generator=g, dtype=dtype)
    return p


def _leaves(p, names):
    return {n: p[n].detach().clone().requires_grad_(p[n].is_floating_point()) for n in names}


def _rank_rows(t, counts=None):
    """This rank's tokens of a global tensor: equal shares, or ``counts[r]`` rows per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = counts or [t.shape[0] // world] * world
    first = sum(counts[:rank])
    return t[first:first + counts[rank]]


def _block_names(p):
    return ["hidden", "topk_ids", "topk_weights", "w1", "w2"] + [n for n in ("b1", "b2") if n in p]


def run_single(p, topk_ids=None):
    """The single-process block on the global problem: output and gradients (float64)."""
    x = _leaves(p, _block_names(p))
    ids = x["topk_ids"] if topk_ids is None else topk_ids
    out = cm.moe_experts(x["hidden"], ids, x["topk_weights"], x["w1"], x["w2"],
                         b1=x.get("b1"), b2=x.get("b2"))
    (out * p["dy"]).sum().backward()
    return out.detach(), {n: t.grad for n, t in x.items() if t.grad is not None}


def run_ep(p, fn="moe_experts", group=None, topk_ids=None, **ep_kwargs):
    """This rank's part through the expert-parallel block: (out, dropped, grads)."""
    group = group or world_group()
    rank, size = dist.get_rank(group), group.size()
    E = p["w1"].shape[0]
    local = slice(rank * E // size, (rank + 1) * E // size)
    mine = {n: (_rank_rows(p[n], p["counts"]) if n in ("hidden", "topk_ids", "topk_weights")
                else p[n][local]) for n in _block_names(p)}
    if size == 1:  # a group of one holds every expert and this rank's tokens
        mine.update({n: p[n] for n in ("w1", "w2", "b1", "b2") if n in p})
    x = _leaves(mine, list(mine))
    ids = x["topk_ids"] if topk_ids is None else topk_ids
    args = (x["hidden"], ids, x["topk_weights"], x["w1"], x["w2"])
    ep_kwargs.setdefault("max_tokens", max(p["counts"]))
    if fn == "moe_experts":
        out, dropped = cm.moe_experts(*args, b1=x.get("b1"), b2=x.get("b2"), ep_group=group,
                                      **{"ep_" + k: v for k, v in ep_kwargs.items()})
    else:
        out, dropped = ep_moe_experts(*args, b1=x.get("b1"), b2=x.get("b2"), ep_group=group,
                                      **ep_kwargs)
    (out * _rank_rows(p["dy"], p["counts"])).sum().backward()
    return out.detach(), dropped, {n: t.grad for n, t in x.items() if t.grad is not None}


def assert_matches_single(out, grads, p, want_out, want_grads, group=None, atol=1e-10):
    group = group or world_group()
    rank, size = dist.get_rank(group), group.size()
    E = p["w1"].shape[0]
    local = slice(rank * E // size, (rank + 1) * E // size) if size > 1 else slice(None)
    counts = p["counts"] if size > 1 else None
    torch.testing.assert_close(out, _rank_rows(want_out, counts), rtol=1e-10, atol=atol)
    assert set(grads) == set(want_grads), (set(grads), set(want_grads))
    for n, g in grads.items():
        want = (_rank_rows(want_grads[n], counts) if n in ("hidden", "topk_weights")
                else want_grads[n][local])
        torch.testing.assert_close(g, want, rtol=1e-10, atol=atol, msg=lambda m: f"grad {n}: {m}")


# ---------------------------------------------------------------------------------------- cases


def block_matches_single(capacity_factor, num_chunks, fn="moe_experts", bias=True, **problem_kw):
    """No pair dropped (sync-free with capacity factor P: max_tokens * k rows per rank pair, or
    exact): the EP block equals the single-process block, output and every gradient."""
    p = problem(bias=bias, **problem_kw)
    want_out, want_grads = run_single(p)
    oracle = loop_moe_experts(p["hidden"], p["topk_ids"], p["topk_weights"], p["w1"], p["w2"],
                              b1=p.get("b1"), b2=p.get("b2"))
    torch.testing.assert_close(want_out, oracle, rtol=1e-10, atol=1e-10)
    if capacity_factor == "P":
        capacity_factor = float(dist.get_world_size())
    out, dropped, grads = run_ep(p, fn, capacity_factor=capacity_factor, num_chunks=num_chunks)
    assert int(dropped) == 0
    assert_matches_single(out, grads, p, want_out, want_grads)
    return out.sum().item()


def skewed_routing(capacity_factor, case):
    """"nothing": the last rank's experts get no pair (it receives nothing, in exact mode zero
    rows); "one_rank": every pair goes to rank 0's experts."""
    world = dist.get_world_size()
    per_rank = 4
    if case == "nothing":
        allowed = range(0, per_rank * (world - 1))
    else:
        allowed = range(0, per_rank)
    p = problem(allowed=allowed, experts_per_rank=per_rank)
    want_out, want_grads = run_single(p)
    if capacity_factor == "P":
        capacity_factor = float(world)
    for num_chunks in (1, 2):
        out, dropped, grads = run_ep(p, capacity_factor=capacity_factor, num_chunks=num_chunks)
        assert int(dropped) == 0
        assert_matches_single(out, grads, p, want_out, want_grads)
    return True


def expected_kept(topk_ids_global, E, counts, capacity):
    """Host loop: which pairs the sync-free mode keeps. Per source rank (``counts[r]`` tokens
    each) and destination rank, the first `capacity` pairs in (token, slot) order; ids outside
    [0, E) never."""
    world, k = len(counts), topk_ids_global.shape[1]
    per_rank = E // world
    kept = torch.zeros(topk_ids_global.shape, dtype=torch.bool)
    first = 0
    for src in range(world):
        used = [0] * world
        for t in range(first, first + counts[src]):
            for s in range(k):
                e = int(topk_ids_global[t, s])
                if 0 <= e < E and used[e // per_rank] < capacity:
                    used[e // per_rank] += 1
                    kept[t, s] = True
        first += counts[src]
    return kept


def overflow(capacity_factor, num_chunks, invalid_ids=False, tokens=12, max_tokens=None):
    """Pairs past capacity dropped in the documented order and counted; ids outside [0, E)
    dropped and counted too; same bits on a second run; zero gradient for dropped pairs.
    ``tokens``: per rank (a list: ragged); ``max_tokens``: the bound (default: the largest
    count; smaller: the ranks past it drop more)."""
    world = dist.get_world_size()
    p = problem(tokens=tokens, allowed=range(0, 4 + 2) if world > 1 else None)  # rank 0 overloaded
    k, counts = p["topk_ids"].shape[1], p["counts"]
    max_tokens = max_tokens or max(counts)
    E = p["w1"].shape[0]
    if invalid_ids:
        p["topk_ids"][::5, 0] = -1
        p["topk_ids"][1::7, 1] = E + 3
    capacity = math.ceil(capacity_factor * max_tokens * k / world)
    capacity = -(-capacity // num_chunks) * num_chunks
    kept = expected_kept(p["topk_ids"], E, counts, capacity)
    mine = _rank_rows(kept, counts)
    masked = torch.where(kept, p["topk_ids"], -1)
    want_out, want_grads = run_single(p, topk_ids=masked)
    kw = dict(capacity_factor=capacity_factor, num_chunks=num_chunks, max_tokens=max_tokens)
    out, dropped, grads = run_ep(p, **kw)
    assert int(dropped) == int((~mine).sum()), (int(dropped), int((~mine).sum()))
    assert_matches_single(out, grads, p, want_out, want_grads)
    assert (grads["topk_weights"][~mine] == 0).all()
    out2, dropped2, grads2 = run_ep(p, **kw)
    assert torch.equal(out, out2) and int(dropped2) == int(dropped)
    for n in grads:
        assert torch.equal(grads[n], grads2[n]), n
    total = torch.tensor([int(dropped)])
    dist.all_reduce(total)
    return int(total)


def ragged_tokens(capacity_factor, num_chunks, fn="moe_experts"):
    """Every rank passes a different T (rank 1: none): no rank aborts or waits, and with
    nothing dropped (capacity factor P, or exact) the block equals the single-process block,
    output and every gradient."""
    world = dist.get_world_size()
    counts = [5 + 3 * r for r in range(world)]
    counts[1] = 0
    return block_matches_single(capacity_factor, num_chunks, fn, tokens=counts)


def past_the_bound():
    """Ranks past max_tokens drop the pairs past capacity in the documented order, counted;
    the group then serves the next call (with a bound that holds: nothing dropped)."""
    world = dist.get_world_size()
    counts = [4 + 5 * r for r in range(world)]
    total = overflow(1.0, 2, tokens=counts, max_tokens=counts[0] + 1)
    block_matches_single("P", 2, tokens=counts)
    return total


def exact_mode_rejects_bad_ids():
    """One rank holds an id >= E: every rank raises ValueError naming topk_ids (no hang)."""
    p = problem()
    if dist.get_rank() == 0:
        p["topk_ids"][0, 0] = p["w1"].shape[0]
    with pytest.raises(ValueError, match="topk_ids"):
        run_ep(p, capacity_factor=None, num_chunks=1)
    return True


def exact_mode_rejects_mismatch(what):
    """Ranks whose rows differ in width (H) or dtype, or whose expert count differs: each
    rank's arguments are consistent on their own, and every rank raises ValueError naming what
    differs, before a row moves (an exchange of mismatched sizes would abort the group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    p = problem(hidden=8 if what == "width" and odd else 16,
                dtype=torch.float32 if what == "dtype" and odd else torch.float64)
    E = p["w1"].shape[0] + (world if what == "experts" and odd else 0)
    match = {"width": "width H", "dtype": "dtype", "experts": "num_experts"}[what]
    h, ids = _rank_rows(p["hidden"]), _rank_rows(p["topk_ids"])
    with pytest.raises(ValueError, match=match):
        ep_dispatch(h, ids, E, world_group(), capacity_factor=None)
    block_matches_single(None, 1)  # the group serves the next call
    return True


def bad_arguments():
    world = dist.get_world_size()
    p = problem()
    g = world_group()
    h, ids, w = _rank_rows(p["hidden"]), _rank_rows(p["topk_ids"]), _rank_rows(p["topk_weights"])
    E = p["w1"].shape[0]
    w1, w2 = p["w1"][: E // world], p["w2"][: E // world]
    with pytest.raises(ValueError, match="num_experts"):
        cm.MoEExperts(4 * world + 1, 16, 8, ep_group=g, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_experts"):
        ep_dispatch(h, ids, E + 1, g, max_tokens=12)
    with pytest.raises(TypeError, match="ep_group"):
        cm.moe_experts(h, ids, w, w1, w2, ep_group="world")
    with pytest.raises(TypeError, match="ep_group"):
        cm.MoEExperts(E, 16, 8, ep_group=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        cm.moe_experts(h, ids, w, w1, w2, ep_group=g, ep_capacity_factor=0.0)
    with pytest.raises(TypeError, match="capacity_factor"):
        cm.moe_experts(h, ids, w, w1, w2, ep_group=g, ep_capacity_factor="1.0")
    with pytest.raises(ValueError, match="num_chunks"):
        cm.moe_experts(h, ids, w, w1, w2, ep_group=g, ep_num_chunks=0, ep_max_tokens=12)
    # The sync-free mode sizes its exchanges from the bound, never from this rank's T: without
    # it every rank raises alike, before any collective.
    with pytest.raises(ValueError, match="ep_max_tokens"):
        cm.moe_experts(h, ids, w, w1, w2, ep_group=g)
    with pytest.raises(ValueError, match="ep_max_tokens"):
        cm.MoEExperts(E, 16, 8, ep_group=g, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_tokens"):
        ep_dispatch(h, ids, E, g)
    with pytest.raises(ValueError, match="max_tokens"):
        ep_moe_experts(h, ids, w, w1, w2, ep_group=g, capacity_factor=1.5, max_tokens=0)
    with pytest.raises(ValueError, match="topk_ids"):
        cm.moe_experts(h, ids[:-1], w[:-1], w1, w2, ep_group=g, ep_max_tokens=12)
    with pytest.raises(ValueError, match="w2"):
        cm.moe_experts(h, ids, w, w1, w2[:-1], ep_group=g, ep_max_tokens=12)
    # A group rank 0 alone is in (made by every rank, as dist.new_group requires).
    others = dist.new_group([0])
    if dist.get_rank() != 0:
        with pytest.raises(ValueError, match="not a member of ep_group"):
            cm.moe_experts(h, ids, w, w1, w2, ep_group=others, ep_max_tokens=12)
    d = ep_dispatch(h, ids, E, g, capacity_factor=2.0, max_tokens=12)
    with pytest.raises(ValueError, match="y must be"):
        ep_combine(d.x[:-1], w, d)
    with pytest.raises(ValueError, match="topk_weights"):
        ep_combine(d.x, w[:, :-1], d)
    return True


def dispatch_combine(capacity_factor):
    """ep_dispatch gives this rank's expert-sorted rows (offs in the grouped_mm convention)
    in (source rank, token, slot) order; a per-expert linear map between dispatch and
    combine gives the routed sum; gradients of hidden, weights and the map match autograd of
    the same computation on the global problem."""
    world, rank = dist.get_world_size(), dist.get_rank()
    p = problem(bias=False)
    E, H = p["w1"].shape[0], p["hidden"].shape[1]
    per_rank = E // world
    gen = torch.Generator().manual_seed(7)
    maps = torch.randn(E, H, H, generator=gen, dtype=torch.float64)
    hidden, w = _rank_rows(p["hidden"]).requires_grad_(), _rank_rows(p["topk_weights"]).requires_grad_()
    local_map = maps[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
    d = ep_dispatch(hidden, _rank_rows(p["topk_ids"]), E, world_group(),
                    capacity_factor=capacity_factor, max_tokens=max(p["counts"]))
    # The rows of local expert j: every rank's pairs for expert rank * per_rank + j in order.
    ends = d.offs.tolist()
    start = 0
    for j, end in enumerate(ends):
        tok, _ = torch.nonzero(p["topk_ids"] == rank * per_rank + j, as_tuple=True)
        assert end - start == tok.numel(), (j, end - start, tok.numel())
        torch.testing.assert_close(d.x[start:end], p["hidden"][tok], rtol=0, atol=0)
        start = end
    assert (d.x[start:] == 0).all()
    y = cm.grouped_mm(d.x, local_map.transpose(-2, -1), d.offs)
    out = ep_combine(y, w, d)
    (out * _rank_rows(p["dy"])).sum().backward()
    # The same on the global problem, by a loop.
    gh = p["hidden"].clone().requires_grad_()
    gw = p["topk_weights"].clone().requires_grad_()
    gm = maps.clone().requires_grad_()
    want = sum(gw[:, s:s + 1] * torch.einsum("th,tnh->tn", gh, gm[p["topk_ids"][:, s]])
               for s in range(p["topk_ids"].shape[1]))
    (want * p["dy"]).sum().backward()
    torch.testing.assert_close(out, _rank_rows(want.detach()), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hidden.grad, _rank_rows(gh.grad), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w.grad, _rank_rows(gw.grad), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(local_map.grad, gm.grad[rank * per_rank:(rank + 1) * per_rank],
                               rtol=1e-10, atol=1e-10)
    assert int(d.dropped) == 0
    return True


def module_ep():
    """MoEExperts(num_experts=E, ep_group=g) holds E/P experts, returns (T, H), keeps the
    dropped count; loaded with the global block's slice it gives the global block's output."""
    world, rank = dist.get_world_size(), dist.get_rank()
    p = problem(bias=True)
    E = p["w1"].shape[0]
    m = cm.MoEExperts(E, 16, 8, bias=True, ep_group=world_group(), ep_capacity_factor=None,
                      dtype=torch.float64)
    assert m.gate_up_proj.shape == (E // world, 16, 16)
    local = slice(rank * E // world, (rank + 1) * E // world)
    with torch.no_grad():
        m.gate_up_proj.copy_(p["w1"][local])
        m.down_proj.copy_(p["w2"][local])
        m.gate_up_proj_bias.copy_(p["b1"][local])
        m.down_proj_bias.copy_(p["b2"][local])
    out = m(_rank_rows(p["hidden"]), _rank_rows(p["topk_ids"]), _rank_rows(p["topk_weights"]))
    want, _ = run_single(p)
    torch.testing.assert_close(out.detach(), _rank_rows(want), rtol=1e-10, atol=1e-10)
    assert int(m.dropped) == 0 and "ep_size" in repr(m)
    return True


def group_of_one(capacity_factor):
    """Over a group of one rank moe_experts skips the exchanges; ep_moe_experts runs them;
    both equal the plain block on this rank's tokens with every expert."""
    p = problem()
    world = dist.get_world_size()
    mine = {n: _rank_rows(p[n]) if n in ("hidden", "topk_ids", "topk_weights", "dy") else p[n]
            for n in p if n != "counts"}
    want_out, want_grads = _run_local(mine)
    for fn in ("moe_experts", "ep_moe_experts"):
        out, dropped, grads = run_ep(p, fn, group=own_group(), capacity_factor=capacity_factor,
                                     num_chunks=1 if fn == "moe_experts" else 2)
        assert int(dropped) == 0
        torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
        for n in grads:
            torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-10, atol=1e-10)
    return world


def _run_local(p):
    x = _leaves(p, _block_names(p))
    out = cm.moe_experts(x["hidden"], x["topk_ids"], x["topk_weights"], x["w1"], x["w2"],
                         b1=x.get("b1"), b2=x.get("b2"))
    (out * p["dy"]).sum().backward()
    return out.detach(), {n: t.grad for n, t in x.items() if t.grad is not None}


def compiled_one_graph(capacity_factor=1.5, num_chunks=2, max_tokens=20):
    """torch.compile(fullgraph=True, dynamic=True) traces the block with its exchanges (the
    functional collectives) in the graph: one frame for several token counts, different on
    every rank, equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    group = world_group()

    def step(hidden, ids, weights, w1, w2):
        out, dropped = ep_moe_experts(hidden, ids, weights, w1, w2, ep_group=group,
                                      capacity_factor=capacity_factor, max_tokens=max_tokens,
                                      num_chunks=num_chunks)
        return out, dropped

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    frames = []
    # Token counts equal to no weight size (duck shaping would tie T to it and recompile).
    for tokens in (5, 9, 13):
        p = problem(tokens=[tokens + 2 * r for r in range(world)], bias=False, seed=tokens)
        E, counts = p["w1"].shape[0], p["counts"]
        local = slice(rank * E // world, (rank + 1) * E // world)
        results = []
        for fn in (compiled, step):
            x = dict(hidden=_rank_rows(p["hidden"], counts).clone().requires_grad_(),
                     weights=_rank_rows(p["topk_weights"], counts).clone().requires_grad_(),
                     w1=p["w1"][local].clone().requires_grad_(),
                     w2=p["w2"][local].clone().requires_grad_())
            out, dropped = fn(x["hidden"], _rank_rows(p["topk_ids"], counts), x["weights"],
                              x["w1"], x["w2"])
            (out * _rank_rows(p["dy"], counts)).sum().backward()
            results.append((out.detach(), int(dropped), {n: t.grad for n, t in x.items()}))
        frames.append(counter.frame_count)
        (out_c, drop_c, grads_c), (out_e, drop_e, grads_e) = results
        torch.testing.assert_close(out_c, out_e, rtol=1e-12, atol=1e-12)
        assert drop_c == drop_e
        for n in grads_c:
            torch.testing.assert_close(grads_c[n], grads_e[n], rtol=1e-12, atol=1e-12)
    assert frames[0] == frames[-1], f"recompiled for a new token count: frames {frames}"
    graph_ops = str([str(n.target) for g in counter.graphs for m in g.modules()
                     if hasattr(m, "graph") for n in m.graph.nodes])
    assert "all_to_all_single" in graph_ops, "the exchanges are not in the graph"
    return frames[-1]
