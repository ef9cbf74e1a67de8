"""The MoE experts block and its routing metadata against the peers, same GPU, same run.

  routing:  compiled_moe.moe_route (NVRTC kernel) vs the composition a user writes
            (stable argsort + histc + cumsum + inverse permutation), as in HF's grouped_mm backend.
  experts:  compiled_moe.moe_experts vs Hugging Face transformers' grouped_mm experts backend
            (its grouped_mm_experts_forward on a Qwen3MoeExperts module of each model shape),
            eager and torch.compile'd, forward and forward+backward, bf16.

  small routings (--small-routes): moe_route's one-program Triton kernel against its NVRTC
            kernels and the composition, GPU time, 16 to 4096 pairs.

    python benchmarks/bench_experts.py [--models qwen ...] [--tokens 8192] [--json out.json]
    python benchmarks/bench_experts.py --small-routes
"""

from __future__ import annotations

import argparse

import torch

import compiled_moe as cm
from common import MODELS, bench, environment, graph_of, write_json


def route_composition(ids: torch.Tensor, num_experts: int):
    """The same three outputs as moe_route, from stock torch ops."""
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    counts = torch.histc(sorted_ids.int(), bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=ids.device)
    return offs, row_of.view(ids.shape).int(), order.int()


def bench_graph(fn) -> float:
    """Median ms of replaying fn from a CUDA graph: the GPU time, without host launch cost."""
    return bench(graph_of(fn).replay)


def skewed_topk(tokens, experts, k, seed=0, device="cuda"):
    """Skewed routing: expert probabilities softmax(N(0,1)), k distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen), 0)
    ids = torch.multinomial(probs.expand(tokens, -1), k, generator=gen)
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    return ids.to(device), weights.to(device)


def hf_experts_module(shape, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                         num_experts=shape.experts, num_experts_per_tok=shape.top_k)
    cfg._experts_implementation = "grouped_mm"
    mod = Qwen3MoeExperts(cfg).to("cuda", dtype)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, shape.hidden ** -0.5)
        mod.down_proj.normal_(0, shape.inter ** -0.5)
    return mod


def small_route_rows():
    """GPU time (CUDA-graph replay) of moe_route where it may run one Triton program, that
    kernel forced on and off (ops.routing.ROUTE_ONE_PROGRAM_PAIRS), against the composition."""
    from compiled_moe.ops import routing

    limit = routing.ROUTE_ONE_PROGRAM_PAIRS
    print(f"{'experts':>7s} {'pairs':>6s} {'one program':>12s} {'NVRTC':>7s} {'composition':>12s}"
          f"   (us, graph replay; one program is the default up to {limit} pairs)")
    rows = []
    for experts in (8, 64, 128, 256, 2048):
        for pairs in (16, 128, 512, 1024, 4096):
            k = 8
            ids = torch.randint(0, experts, (pairs // k, k), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(pairs))
            times = {}
            for name, forced in (("one_program", 1 << 30), ("nvrtc", 0)):
                routing.ROUTE_ONE_PROGRAM_PAIRS = forced
                try:
                    times[name] = bench_graph(lambda: cm.moe_route(ids, experts)) * 1e3
                finally:
                    routing.ROUTE_ONE_PROGRAM_PAIRS = limit
            times["composition"] = bench_graph(lambda: route_composition(ids, experts)) * 1e3
            rows.append(dict(experts=experts, pairs=pairs, **times))
            print(f"{experts:7d} {pairs:6d} {times['one_program']:12.1f} {times['nvrtc']:7.1f} "
                  f"{times['composition']:12.1f}")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="*", default=None, help="substrings of model names")
    p.add_argument("--tokens", type=int, default=None, help="override tokens (default: 8192 for "
                   "Qwen3-30B-A3B, the table's value otherwise)")
    p.add_argument("--json", default=None)
    p.add_argument("--small-routes", action="store_true", help="only the small-routing table")
    args = p.parse_args()
    if args.small_routes:
        rows = small_route_rows()
        if args.json:
            write_json(args.json, dict(environment=environment(), small_routes=rows))
        return
    from transformers.integrations.moe import grouped_mm_experts_forward

    dtype = torch.bfloat16
    env = environment()
    rows = []
    models = [m for m in MODELS if not args.models or any(s.lower() in m.name.lower() for s in args.models)]
    print(f"# {env}")
    print(f"{'model':18s} {'T':>5s} {'pass':8s} {'ours eager':>10s} {'HF eager':>9s} {'x':>6s} "
          f"{'ours comp':>10s} {'HF comp':>9s} {'x':>6s}   (ms)")
    route_rows = []
    for shape in models:
        tokens = args.tokens or (8192 if shape.name.startswith("Qwen3") else shape.tokens)
        torch.manual_seed(0)
        mod = hf_experts_module(shape, dtype)
        ids, weights = skewed_topk(tokens, shape.experts, shape.top_k)
        weights = weights.to(dtype)
        hidden = torch.randn(tokens, shape.hidden, device="cuda", dtype=dtype, requires_grad=True)

        # Routing metadata: eager (host launch cost included when it exceeds the GPU time) and
        # replayed from a CUDA graph (GPU time alone).
        ours_route = lambda: cm.moe_route(ids, shape.experts)  # noqa: E731
        comp_route = lambda: route_composition(ids, shape.experts)  # noqa: E731
        route_rows.append(dict(model=shape.name, tokens=tokens,
                               ours_ms=bench(ours_route), composition_ms=bench(comp_route),
                               ours_graph_ms=bench_graph(ours_route),
                               composition_graph_ms=bench_graph(comp_route)))

        def ours(h, i, w):
            return cm.moe_experts(h, i, w, mod.gate_up_proj, mod.down_proj)

        def hf(h, i, w):
            return grouped_mm_experts_forward(mod, h, i, w)

        with torch.no_grad():
            err = (ours(hidden, ids, weights).float() - hf(hidden, ids, weights).float()).abs().max().item()
        impls = {"ours": ours, "hf": hf}
        compiled = {n: torch.compile(f, fullgraph=True, dynamic=False) for n, f in impls.items()}
        grad = torch.randn_like(hidden)
        res = {}
        for mode, table in (("eager", impls), ("compiled", compiled)):
            for name, fn in table.items():
                with torch.no_grad():
                    res[(name, mode, "fwd")] = bench(lambda: fn(hidden, ids, weights))

                def fwd_bwd():
                    out = fn(hidden, ids, weights)
                    out.backward(grad)
                    hidden.grad = None
                    mod.gate_up_proj.grad = None
                    mod.down_proj.grad = None

                res[(name, mode, "fwd+bwd")] = bench(fwd_bwd)
        for pas in ("fwd", "fwd+bwd"):
            r = dict(model=shape.name, tokens=tokens, pass_=pas, max_abs_diff_vs_hf=err,
                     **{f"{n}_{m}_ms": res[(n, m, pas)] for n in impls for m in ("eager", "compiled")})
            rows.append(r)
            print(f"{shape.name:18s} {tokens:5d} {pas:8s} {r['ours_eager_ms']:10.3f} {r['hf_eager_ms']:9.3f} "
                  f"{r['hf_eager_ms'] / r['ours_eager_ms']:5.2f}x {r['ours_compiled_ms']:10.3f} "
                  f"{r['hf_compiled_ms']:9.3f} {r['hf_compiled_ms'] / r['ours_compiled_ms']:5.2f}x")
    print(f"\n{'routing metadata':18s} {'T':>5s} {'moe_route':>10s} {'composition':>12s} {'x':>6s}"
          f" {'graph: ours':>12s} {'composition':>12s} {'x':>6s}   (us)")
    for r in route_rows:
        print(f"{r['model']:18s} {r['tokens']:5d} {r['ours_ms'] * 1e3:10.1f} {r['composition_ms'] * 1e3:12.1f} "
              f"{r['composition_ms'] / r['ours_ms']:5.2f}x {r['ours_graph_ms'] * 1e3:12.1f} "
              f"{r['composition_graph_ms'] * 1e3:12.1f} {r['composition_graph_ms'] / r['ours_graph_ms']:5.2f}x")
    if args.json:
        write_json(args.json, dict(environment=env, experts=rows, routing=route_rows))


if __name__ == "__main__":
    main()
