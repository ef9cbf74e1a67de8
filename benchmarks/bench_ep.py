"""Expert parallelism: the EP block's cost, forward+backward, bf16, CUDA-event medians.

One GPU (``python benchmarks/bench_ep.py``): NCCL over a group of one rank. (a) the EP
machinery's own cost against the plain block at the Qwen3-30B-A3B shape (E=128, H=2048,
I=768, top-8, T=8192): ``moe_experts(..., ep_group=g)`` (which skips the exchanges over one
rank), and ``ep_moe_experts`` (which runs them: real NCCL all_to_all_single over one rank, i.e.
copies), sync-free and exact. Target: at most 1.1x the plain block.

N GPUs (``torchrun --nproc-per-node N benchmarks/bench_ep.py``): (b) EP=N at Qwen3 (64
experts per rank for N=2) and DeepSeek-V3 (H=7168, I=2048, 32 experts per rank), T=8192 per
rank, top-8, against a torchtitan-style composition (count exchange, split sizes to the host,
all_to_all_single with those splits, torch._grouped_mm, all_to_all back) and against the
single-GPU block on the same per-rank work (T tokens over the rank's own experts); the exchanges
alone in GB/s beside NCCL all_to_all_single of the same bytes; the overlap target
EP step <= single-GPU block + 0.5 x exchanges alone.

JSON goes to --out (default benchmarks/bench_ep.json); the table prints last, on rank 0.

``--device cpu`` runs the same script over gloo at small shapes (``--tokens 64``): no figure of
it means anything, it checks the script's logic where no GPU is (the CPU test tier runs it with
one and two processes). Every run first checks that the torchtitan-style composition and the
EP block's exact mode give the same outputs, so the peer being timed computes the same thing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.distributed import capacity_rows, ep_moe_experts  # noqa: E402

SHAPES = {  # name: (experts per rank, hidden, inter)
    "Qwen3-30B-A3B": (None, 2048, 768),  # E = 128 over one GPU, 64 per rank over N
    "DeepSeek-V3": (32, 7168, 2048),
}
CPU_SHAPES = {"Qwen3-30B-A3B": (None, 64, 32), "DeepSeek-V3": (8, 128, 64)}  # --device cpu (E = 16)
TOP_K = 8


def init(device_type: str) -> tuple[int, int, torch.device]:
    """NCCL on GPUs (one per rank), gloo on CPU; torchrun's environment or one process."""
    cuda = device_type == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    kw = dict(device_id=device) if cuda else {}
    if cuda:
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend, **kw)
    else:
        path = tempfile.mktemp(prefix="bench_ep_")
        dist.init_process_group(backend, store=dist.FileStore(path, 1), rank=0, world_size=1, **kw)
    return dist.get_rank(), dist.get_world_size(), device


def timed(fn, reps: int) -> float:
    """Median ms over reps calls, CUDA events around each (a wall clock on CPU); every rank
    makes the same calls (do_bench picks its repeat count from a first estimate, which could
    differ between ranks and leave a collective without its peer)."""
    for _ in range(3):
        fn()
    if dist.get_backend() != "nccl":
        dist.barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def check_peer(group, x, num_experts) -> None:
    """The torchtitan-style composition and the EP block (exact mode, no drops) agree."""
    args = (x["hidden"], x["topk_ids"], x["topk_weights"], x["w1"], x["w2"])
    with torch.no_grad():
        ours = ep(group, capacity_factor=None, num_chunks=1)(*args)[0].float()
        peer = titan_style(group, num_experts)(*args).float()
    err = (ours - peer).abs().max().item() / max(peer.abs().max().item(), 1e-6)
    if err > 2e-2:
        raise AssertionError(f"the torchtitan-style composition differs from the EP block: "
                             f"max error {err:.3g} of the largest output")


def routing(tokens: int, experts: int, seed: int, device):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=device, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K)
    return ids, weights.bfloat16()


def leaves(tokens, local_experts, hidden, inter, num_experts, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    ids, weights = routing(tokens, num_experts, seed + 1, device)
    return dict(
        hidden=torch.randn(tokens, hidden, generator=g, device=device).bfloat16().requires_grad_(),
        topk_ids=ids, topk_weights=weights.requires_grad_(),
        w1=(torch.randn(local_experts, 2 * inter, hidden, generator=g, device=device) / hidden ** 0.5)
        .to(**bf).requires_grad_(),
        w2=(torch.randn(local_experts, hidden, inter, generator=g, device=device) / inter ** 0.5)
        .to(**bf).requires_grad_(),
        dy=torch.randn(tokens, hidden, generator=g, device=device).bfloat16())


def fwd_bwd(block, x):
    """One training step of the block: forward, then the gradients of every input."""
    def step():
        out = block(x["hidden"], x["topk_ids"], x["topk_weights"], x["w1"], x["w2"])
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, [x["hidden"], x["topk_weights"], x["w1"], x["w2"]],
                            grad_outputs=x["dy"])
    return step


def ep(group, **kw):
    """ep_moe_experts over ``group``; every rank passes the same T here, which is the bound."""
    return lambda h, i, w, w1, w2: ep_moe_experts(h, i, w, w1, w2, ep_group=group,
                                                  max_tokens=h.shape[0], **kw)


def titan_style(group, num_experts):
    """torchtitan's expert-parallel composition: counts exchanged, split sizes copied to the
    host, all_to_all_single with them, a stable sort into expert order, torch._grouped_mm,
    and back."""
    P = group.size()
    local_experts = num_experts // P

    def block(hidden, ids, weights, w1, w2):
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by destination rank
        counts = torch.bincount(flat, minlength=num_experts)
        recv_counts = funcol.all_to_all_single(counts, None, None, group).wait()
        host = torch.cat([counts.view(P, local_experts).sum(1),
                          recv_counts.view(P, local_experts).sum(1)]).tolist()  # the sync
        send_splits, recv_splits = host[:P], host[P:]
        x = funcol.all_to_all_single_autograd(hidden[order // k], recv_splits, send_splits,
                                              group).wait()
        # Received rows come by (source rank, expert): sort them by expert for grouped_mm.
        recv_expert = torch.arange(local_experts, device=ids.device).repeat(P).repeat_interleave(
            recv_counts, output_size=x.shape[0])
        perm = torch.argsort(recv_expert, stable=True)
        offs = torch.cumsum(recv_counts.view(P, local_experts).sum(0), 0, dtype=torch.int32)
        h = torch._grouped_mm(x[perm], w1.transpose(-2, -1), offs)
        gate, up = h.chunk(2, -1)
        y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)
        y = y[torch.argsort(perm)]
        y = funcol.all_to_all_single_autograd(y, send_splits, recv_splits, group).wait()
        y = y[torch.argsort(order)].view(T, k, -1)
        return (y * weights[..., None]).sum(1)
    return block


def exchange_alone(group, rows, hidden, device, reps):
    """ms of the four exchanges of one EP step (dispatch and back, forward and backward) on
    a (rows, hidden) bf16 buffer through the package's exchange op, and of NCCL
    all_to_all_single on the same buffer (a preallocated output)."""
    from compiled_moe.distributed import exchange

    buf = torch.randn(rows, hidden, device=device).bfloat16()
    out = torch.empty_like(buf)

    def ours():
        y = buf
        for _ in range(4):
            y = exchange(y, group)

    def nccl():
        for _ in range(4):
            dist.all_to_all_single(out, buf, group=group)
    return timed(ours, reps), timed(nccl, reps), buf.numel() * buf.element_size()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--chunks", default="1,2,4")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "bench_ep.json"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo at small shapes, a check of the script (no figures)")
    args = parser.parse_args()
    rank, world, device = init(args.device)
    shapes = SHAPES if device.type == "cuda" else CPU_SHAPES
    group = dist.group.WORLD
    if device.type == "cuda":
        common.warm_up(2.0)
    f, T = args.capacity_factor, args.tokens
    results, table = [], []

    def record(part, shape, name, ms, ref_ms=None, **extra):
        row = dict(part=part, shape=shape, name=name, ms=ms, **extra)
        if ref_ms:
            row["ratio"] = ms / ref_ms
        results.append(row)
        table.append(row)

    if world == 1:  # (a) the machinery at a group of one, Qwen3-30B-A3B
        _, H, I = shapes["Qwen3-30B-A3B"]
        E = 128 if device.type == "cuda" else 16
        x = leaves(T, E, H, I, E, 0, device)
        check_peer(group, x, E)
        plain = timed(fwd_bwd(cm.moe_experts, x), args.reps)
        record("a", "Qwen3-30B-A3B", "plain block (moe_experts)", plain)
        variants = {
            f"moe_experts(ep_group) sync-free f={f}": lambda *a: cm.moe_experts(
                *a, ep_group=group, ep_capacity_factor=f, ep_max_tokens=T),
            "moe_experts(ep_group) exact": lambda *a: cm.moe_experts(
                *a, ep_group=group, ep_capacity_factor=None),
            f"ep_moe_experts sync-free f={f} N=1 (NCCL exchanges)": ep(group, capacity_factor=f,
                                                                        num_chunks=1),
            f"ep_moe_experts sync-free f={f} N=2 (NCCL exchanges)": ep(group, capacity_factor=f,
                                                                        num_chunks=2),
            "ep_moe_experts exact N=1 (NCCL exchanges)": ep(group, capacity_factor=None,
                                                             num_chunks=1),
        }
        for name, block in variants.items():
            record("a", "Qwen3-30B-A3B", name, timed(fwd_bwd(block, x), args.reps), plain)
    else:  # (b) EP over the ranks
        for shape in args.shapes.split(","):
            per_rank, H, I = shapes[shape]
            per_rank = per_rank or (128 if device.type == "cuda" else 16) // world
            E = per_rank * world
            x = leaves(T, per_rank, H, I, E, 10 + rank, device)
            check_peer(group, x, E)
            # The single-GPU block on the same per-rank work: T tokens over this rank's experts.
            local = dict(x, topk_ids=routing(T, per_rank, 20 + rank, device)[0])
            single = timed(fwd_bwd(cm.moe_experts, local), args.reps)
            record("b", shape, f"single-GPU block, {per_rank} experts, same work", single)
            titan = timed(fwd_bwd(titan_style(group, E), x), args.reps)
            record("b", shape, "torchtitan-style (splits to host, _grouped_mm)", titan, single)
            best = None
            for n in map(int, args.chunks.split(",")):
                ms = timed(fwd_bwd(ep(group, capacity_factor=f, num_chunks=n), x), args.reps)
                record("b", shape, f"EP sync-free f={f} N={n}", ms, single, vs_titan=ms / titan)
                best = ms if best is None else min(best, ms)
            ms = timed(fwd_bwd(ep(group, capacity_factor=None, num_chunks=1), x), args.reps)
            record("b", shape, "EP exact N=1", ms, single, vs_titan=ms / titan)
            rows = world * capacity_rows(T, TOP_K, world, f, 1)
            ours, nccl, nbytes = exchange_alone(group, rows, H, device, args.reps)
            # Bytes leaving each rank per exchange (the rows it keeps stay home).
            moved = 4 * nbytes * (world - 1) / world
            record("b", shape, "exchanges alone (4 per step, package op)", ours,
                   gbps=moved / ours / 1e6)
            record("b", shape, "NCCL all_to_all_single x4, same bytes", nccl,
                   gbps=moved / nccl / 1e6)
            target = single + 0.5 * ours
            record("b", shape, "overlap target: single + 0.5 x exchanges", target,
                   met=best <= target, best_ep_ms=best)
    if rank == 0:
        payload = dict(environment=common.environment(), world_size=world, tokens=T,
                       capacity_factor=f, top_k=TOP_K, results=results,
                       command=" ".join(sys.argv))
        common.write_json(args.out, payload)
        print(f"\nexpert parallelism, {world} rank(s) on {device.type}, T={T} per rank, top-{TOP_K}, bf16, "
              f"forward+backward, median ms ({args.out})")
        print(f"{'part':4} {'shape':15} {'variant':56} {'ms':>8} {'ratio':>6} {'extra':>18}")
        for r in table:
            ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
            extra = (f"{r['gbps']:.0f} GB/s" if "gbps" in r else
                     f"met={r['met']}" if "met" in r else
                     f"{r['vs_titan']:.2f}x titan" if "vs_titan" in r else "")
            print(f"{r['part']:4} {r['shape']:15} {r['name'][:56]:56} {r['ms']:8.3f} {ratio:>6} "
                  f"{extra:>18}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
