"""The experts block's row ops against the copy bound, and the eager block against the compiled
block, same GPU, same run.

  rows:  each row op at the Qwen3-30B-A3B shape (T = 8192 tokens, top-8: 65,536 rows of
         H = 2048, bf16), GPU time (CUDA events, L2 flushed between calls) against the copy
         bound: the least bytes the op must read and write, over the bandwidth of a
         device-to-device copy moving as many bytes, timed beside it.
  block: compiled_moe.moe_experts forward+backward (hidden, routing weights and both expert
         weights need gradients), eager against torch.compile(fullgraph=True) of the same call,
         Qwen3-30B-A3B shape, uniform and Zipf-skewed routing.

    python benchmarks/bench_rows.py [--tables rows block] [--tokens 8192 32768] [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

import compiled_moe as cm
from common import MODELS, bench, environment, write_json

QWEN3 = next(m for m in MODELS if m.name.startswith("Qwen3"))


def routing(tokens: int, experts: int, k: int, kind: str, seed: int = 0, device="cuda"):
    """topk_ids (T, k) of k distinct experts a token: "uniform" (every expert alike) or "zipf"
    (expert e drawn with probability proportional to 1 / (e + 1), a hot few and a long tail);
    topk_weights (T, k) fp32 softmax of random logits."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        probs = torch.ones(experts)
    else:
        probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        probs = probs[torch.randperm(experts, generator=gen)]
    ids = torch.multinomial(probs.float().expand(tokens, -1), k, generator=gen)
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    return ids.to(device), weights.to(device)


def copy_ms(nbytes: int) -> float:
    """A device-to-device copy that reads and writes nbytes / 2 each: the same traffic."""
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def row_rows(tokens: int) -> list[dict]:
    ops = torch.ops.compiled_moe
    shape, dt = QWEN3, torch.bfloat16
    k, H, inter = shape.top_k, shape.hidden, shape.inter
    ids, weights = routing(tokens, shape.experts, k, "uniform")
    _, row_of, source = ops.moe_route(ids, shape.experts, 1)
    R, es = source.shape[0], 2
    hidden = torch.randn(tokens, H, device="cuda", dtype=dt)
    y = torch.randn(R, H, device="cuda", dtype=dt)
    grad = torch.randn(tokens, H, device="cuda", dtype=dt)
    h = torch.randn(R, 2 * inter, device="cuda", dtype=dt)
    da = torch.randn(R, inter, device="cuda", dtype=dt)
    # (name, call, least bytes read + written: a token row read once however many pairs use it)
    cases = [
        ("moe_permute (gather)", lambda: ops.moe_permute(hidden, row_of, source), (tokens + R) * H * es),
        ("moe_permute, scaled", lambda: ops.moe_permute(grad, row_of, source, weights),
         (tokens + R) * H * es),
        ("moe_unpermute (weighted combine)", lambda: ops.moe_unpermute(y, row_of, source, weights),
         (R + tokens) * H * es),
        ("moe_unpermute_backward (rows + weights' gradient)",
         lambda: ops.moe_unpermute_backward(grad, y, row_of, source, weights), (tokens + 2 * R) * H * es),
        ("moe_activation (swiglu)", lambda: ops.moe_activation(h, "swiglu", "stacked"),
         R * 3 * inter * es),
        ("moe_activation_backward (swiglu)",
         lambda: ops.moe_activation_backward(da, h, "swiglu", "stacked"), R * 5 * inter * es),
    ]
    rows = []
    print(f"row ops, {shape.name}: T = {tokens}, {R} rows of H = {H} (activations: 2I = {2 * inter}), "
          f"bf16; GPU ms, L2 flushed")
    print(f"  {'op':52s} {'ms':>8s} {'copy ms':>8s} {'of copy bound':>14s}")
    for name, fn, nbytes in cases:
        ms, bound = bench(fn), copy_ms(nbytes)
        rows.append(dict(table="rows", op=name, tokens=tokens, ms=ms, copy_ms=bound, bytes=nbytes,
                         fraction_of_copy_bound=bound / ms))
        print(f"  {name:52s} {ms:8.4f} {bound:8.4f} {bound / ms:13.1%}")
    return rows


def block_rows(tokens_list, routings) -> list[dict]:
    shape, dt = QWEN3, torch.bfloat16
    torch.manual_seed(0)
    w1 = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device="cuda") * shape.hidden ** -0.5).to(dt)
    w2 = (torch.randn(shape.experts, shape.hidden, shape.inter, device="cuda") * shape.inter ** -0.5).to(dt)
    w1.requires_grad_()
    w2.requires_grad_()

    def block(h, i, w):
        return cm.moe_experts(h, i, w, w1, w2)

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    rows = []
    print(f"\nexperts block forward+backward, {shape.name}, bf16: eager against compiled (ms)")
    print(f"  {'T':>6s} {'routing':8s} {'eager':>8s} {'compiled':>9s} {'eager speed / compiled':>23s}")
    for tokens in tokens_list:
        for kind in routings:
            ids, weights = routing(tokens, shape.experts, shape.top_k, kind)
            hidden = torch.randn(tokens, shape.hidden, device="cuda", dtype=dt, requires_grad=True)
            weights = weights.to(dt).requires_grad_()
            dy = torch.randn(tokens, shape.hidden, device="cuda", dtype=dt)
            leaves = [hidden, weights, w1, w2]
            with torch.no_grad():  # the same block both ways (same kernels; fusion may round apart)
                want, got = block(hidden, ids, weights).float(), compiled(hidden, ids, weights).float()
                assert (got - want).abs().max() <= 2e-2 * want.abs().max(), "compiled != eager"
            eager, comp = (bench(lambda: torch.autograd.grad(fn(hidden, ids, weights), leaves, dy))
                           for fn in (block, compiled))
            rows.append(dict(table="block", tokens=tokens, routing=kind, eager_ms=eager,
                             compiled_ms=comp, eager_speed_vs_compiled=comp / eager))
            print(f"  {tokens:6d} {kind:8s} {eager:8.3f} {comp:9.3f} {comp / eager:22.3f}x")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tables", nargs="*", default=["rows", "block"])
    p.add_argument("--tokens", nargs="*", type=int, default=[8192, 32768], help="block table's T")
    p.add_argument("--routings", nargs="*", default=["uniform", "zipf"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = environment()
    print(f"# {env}")
    rows = []
    if "rows" in args.tables:
        rows += row_rows(8192)
    if "block" in args.tables:
        rows += block_rows(args.tokens, args.routings)
    if args.json:
        write_json(args.json, dict(environment=env, results=rows))


if __name__ == "__main__":
    main()
