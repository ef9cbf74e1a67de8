"""GPU cases of expert parallelism, on every rank of an NCCL group: in the pytest process over a
group of one rank (tests/test_gpu_distributed.py), or spawned on two GPUs (tests/ep_pool.py).

Each rank builds the same global bf16 problem (all ranks' tokens, all E experts) and compares
its part of the EP block with the plain single-GPU block on the global problem.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import compiled_moe as cm
from compiled_moe.distributed import ep_combine, ep_dispatch, ep_moe_experts
from helpers import capture_graph, no_sync

TOKENS, TOP_K, EXPERTS, HIDDEN, INTER = 1024, 4, 16, 512, 256


def world_group():
    return dist.group.WORLD


def problem(seed=0, tokens=TOKENS, skew=False):
    world = dist.get_world_size()
    T = tokens * world
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, EXPERTS, generator=g)
    if skew:  # rank 0's experts draw most pairs
        logits[:, : EXPERTS // world] += 3
    weights, ids = torch.softmax(logits, -1).topk(TOP_K)
    # (CPU without a GPU: the cases that need no CUDA feature also run there, over gloo.)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    bf = dict(device=dev, dtype=torch.bfloat16)
    return dict(hidden=torch.randn(T, HIDDEN, generator=g).to(**bf),
                topk_ids=ids.to(dev), topk_weights=weights.to(**bf),
                w1=(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5).to(**bf),
                w2=(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5).to(**bf),
                dy=torch.randn(T, HIDDEN, generator=g).to(**bf))


def rows(t):
    """This rank's share along dim 0: its tokens of a global tensor, or its experts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


local = rows


def mine(p):
    """This rank's leaves: its tokens, routing and experts."""
    return dict(hidden=rows(p["hidden"]).clone().requires_grad_(), topk_ids=rows(p["topk_ids"]),
                topk_weights=rows(p["topk_weights"]).clone().requires_grad_(),
                w1=local(p["w1"]).clone().requires_grad_(), w2=local(p["w2"]).clone().requires_grad_())


def ep_step(x, dy, **kw):
    out, dropped = ep_moe_experts(x["hidden"], x["topk_ids"], x["topk_weights"], x["w1"],
                                  x["w2"], ep_group=world_group(), max_tokens=TOKENS, **kw)
    wrt = [x[n] for n in ("hidden", "topk_weights", "w1", "w2")]
    return (out, dropped, *torch.autograd.grad(out, wrt, grad_outputs=dy))


def plain_results(p, topk_ids=None):
    x = {n: p[n].clone().requires_grad_(p[n].is_floating_point()) for n in
         ("hidden", "topk_ids", "topk_weights", "w1", "w2")}
    out = cm.moe_experts(x["hidden"], x["topk_ids"] if topk_ids is None else topk_ids,
                         x["topk_weights"], x["w1"], x["w2"])
    grads = torch.autograd.grad(out, [x[n] for n in ("hidden", "topk_weights", "w1", "w2")],
                                grad_outputs=p["dy"])
    return [rows(out), rows(grads[0]), rows(grads[1]), local(grads[2]), local(grads[3])]


def assert_near(got, want, name, rel=1e-2):
    """bf16: max error within rel of the reference's largest value (weight gradients summed
    over chunks round once more than the plain block's)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= rel * scale + 1e-3, f"{name}: max error {err:.3e} vs scale {scale:.3e}"


NAMES = ("out", "grad hidden", "grad topk_weights", "grad w1", "grad w2")


def matches_plain(capacity_factor, num_chunks):
    """bf16 EP block (exchanges over NCCL) against the plain block holding every expert."""
    p = problem()
    want = plain_results(p)
    got = ep_step(mine(p), rows(p["dy"]), capacity_factor=capacity_factor, num_chunks=num_chunks)
    assert int(got[1]) == 0
    for g, w, n in zip((got[0], *got[2:]), want, NAMES):
        assert_near(g, w, n)
    # moe_experts(ep_group=...): over one rank it is the plain block on this rank's tokens.
    x = mine(p)
    out, dropped = cm.moe_experts(x["hidden"], x["topk_ids"], x["topk_weights"], x["w1"], x["w2"],
                                  ep_group=world_group(), ep_capacity_factor=capacity_factor,
                                  ep_max_tokens=TOKENS)
    assert_near(out, want[0], "moe_experts(ep_group)")
    return True


def overflow_matches_masked_plain(capacity_factor=0.5):
    """Skewed routing past capacity: equals the plain block with the dropped pairs' ids -1."""
    p = problem(skew=True)
    x = mine(p)
    got = ep_step(x, rows(p["dy"]), capacity_factor=capacity_factor, num_chunks=2)
    dropped = got[1].clone()
    # The kept pairs of every rank: gathered so the plain block can run on the global routing.
    from compiled_moe.distributed import plan_exchange

    plan = plan_exchange(x["topk_ids"], EXPERTS, world_group(), capacity_factor, 2,
                         max_tokens=TOKENS)
    kept = torch.empty(p["topk_ids"].shape, dtype=torch.uint8, device=p["topk_ids"].device)
    dist.all_gather_into_tensor(kept, (plan.row_of >= 0).to(torch.uint8))
    kept = kept.bool()
    want = plain_results(p, topk_ids=torch.where(kept, p["topk_ids"], -1))
    assert int(dropped) == int((~rows(kept)).sum()) > 0
    for g, w, n in zip((got[0], *got[2:]), want, NAMES):
        assert_near(g, w, n)
    return int(dropped)


def no_host_sync(num_chunks):
    """Forward and backward of the sync-free mode under set_sync_debug_mode('error')."""
    p = problem(seed=1)
    ep_step(mine(p), rows(p["dy"]), capacity_factor=1.5, num_chunks=num_chunks)  # warm up
    x = mine(p)
    with no_sync():
        ep_step(x, rows(p["dy"]), capacity_factor=1.5, num_chunks=num_chunks)
        d = ep_dispatch(x["hidden"], x["topk_ids"], EXPERTS, world_group(), capacity_factor=1.5,
                        max_tokens=TOKENS)
        out = ep_combine(d.x * 2, x["topk_weights"], d)
        out.backward(rows(p["dy"]))
    return True


def bitwise_deterministic(num_chunks):
    p = problem(seed=2, skew=True)
    first = ep_step(mine(p), rows(p["dy"]), capacity_factor=0.75, num_chunks=num_chunks)
    for _ in range(2):
        again = ep_step(mine(p), rows(p["dy"]), capacity_factor=0.75, num_chunks=num_chunks)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    return True


def cuda_graph_replays(num_chunks, capacity_factor=1.25):
    """Forward+backward captured once, replayed under changing routing: equal to eager."""
    p = problem(seed=3)
    x = mine(p)
    dy = rows(p["dy"]).clone()

    graph, captured = capture_graph(lambda: ep_step(x, dy, capacity_factor=capacity_factor,
                                                    num_chunks=num_chunks))
    for seed in (4, 5, 6):
        q = problem(seed=seed, skew=seed == 5)
        new = mine(q)
        with torch.no_grad():
            for n in ("hidden", "topk_ids", "topk_weights"):
                x[n].copy_(new[n])
            dy.copy_(rows(q["dy"]))
        graph.replay()
        eager = ep_step(x, dy, capacity_factor=capacity_factor, num_chunks=num_chunks)
        for a, b in zip(captured, eager):
            assert torch.equal(a, b), "replay differs from eager"
    return True


def compiled_matches_eager(num_chunks=2):
    """torch.compile(fullgraph=True, dynamic=True): one graph for several token counts, close to
    eager (inductor may fuse the small index ops differently; the GEMMs are the same kernels)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    group = world_group()

    def step(hidden, ids, weights, w1, w2):
        return ep_moe_experts(hidden, ids, weights, w1, w2, ep_group=group,
                              capacity_factor=1.25, max_tokens=TOKENS, num_chunks=num_chunks)

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    # Token counts equal to no weight size: dynamo gives input sizes of equal value one symbol
    # ("duck shaping"), so T = 512 = H would guard on that equality and recompile at the next T.
    for tokens in (384, 640, 896):
        p = problem(seed=tokens, tokens=tokens)
        outs = []
        for fn in (compiled, step):
            x = mine(p)
            out, dropped = fn(x["hidden"], x["topk_ids"], x["topk_weights"], x["w1"], x["w2"])
            grads = torch.autograd.grad(out, [x["hidden"], x["w1"]], grad_outputs=rows(p["dy"]))
            outs.append((out, dropped, *grads))
        frames.append(counter.frame_count)
        for a, b, n in zip(outs[0], outs[1], ("out", "dropped", "grad hidden", "grad w1")):
            if a.is_floating_point():
                assert_near(a, b, n, rel=1e-2)
            else:
                assert torch.equal(a, b), n
    assert frames[0] == frames[-1], f"recompiled: {frames}"
    return True


def exact_mode_matches_plain(num_chunks):
    p = problem(seed=7, skew=True)
    want = plain_results(p)
    got = ep_step(mine(p), rows(p["dy"]), capacity_factor=None, num_chunks=num_chunks)
    for g, w, n in zip((got[0], *got[2:]), want, NAMES):
        assert_near(g, w, n)
    return True
