"""FC2's FP8 input from FC1's output, on the GPU: ``moe_activation_quantize`` (one pass over h)
against the two launches it replaces (the activation op, then ``grouped_quantize``), and the FP8
expert MLP's training step with each.

    python benchmarks/bench_activation_quantize.py            # the four model shapes
    python benchmarks/bench_activation_quantize.py --models qwen gpt --rounds 5

Part 1, the activation and its fp8_blockwise quantization both ways (FC2's forward and its
weight gradient), each timed from a CUDA graph (GPU time only), in interleaved rounds:
  fused     torch.ops.compiled_moe.moe_activation_quantize(h, ...) (the CUDA kernel)
  unfused   moe_activation(h), then grouped_quantize(a, rowwise=True, columnwise=True) (in
            parentheses: that grouped_quantize alone)
  copy      a bf16 copy of h: the fused pass's bytes are h read, FP8 data both ways and the
            scales written; "of copy" is its GB/s over the copy's.
Part 2, ``moe_mlp(fp8_recipe="fp8_blockwise", fp8_weights=...)`` forward and backward (the weights
quantized beforehand, as with several micro-batches per step), against the same MLP composed
as before: fp8_grouped_mm, the activation op (* probs), fp8_grouped_mm; and the bf16 moe_mlp
(no recipe) on the same inputs. Each step is timed from a CUDA graph (GPU time) and eager (the
last column: host time included, which bounds the small shapes).
Routing: skewed, groups rounded up to 16 rows (as bench_fp8.py). Ratios are unfused / fused
(> 1: fused is faster); the paired median over the rounds, with its range.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import compiled_moe as cm  # noqa: E402
from compiled_moe import reference as R  # noqa: E402
from compiled_moe.mlp import apply_activation  # noqa: E402
from common import (MODELS, environment, graph_of, group_counts, paired_ratio,  # noqa: E402
                    timed_rounds, write_json)

RECIPE = "fp8_blockwise"


def activation_of(model):
    return ("gpt_oss", "interleaved") if model.name.startswith("GPT-OSS") else ("swiglu", "stacked")


def offsets(rows, groups):
    counts = (group_counts(rows, groups, "skewed") + 15) // 16 * 16
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), int(counts.sum())


def replay(fn):
    graph = graph_of(fn)
    return graph.replay


def part_activation(model, rounds):
    act, layout = activation_of(model)
    offs, rows = offsets(model.tokens * model.top_k, model.experts)
    h = torch.randn(rows, 2 * model.inter, device="cuda", dtype=torch.bfloat16)
    copy_out = torch.empty_like(h)

    def fused():
        return torch.ops.compiled_moe.moe_activation_quantize(h, offs, act, layout, RECIPE, None,
                                                              True, True)

    def unfused():
        a = apply_activation(h, act, layout, R.GPT_OSS_ALPHA, R.GPT_OSS_LIMIT)
        return torch.ops.compiled_moe.grouped_quantize(a, offs, RECIPE, True, True)

    a = apply_activation(h, act, layout, R.GPT_OSS_ALPHA, R.GPT_OSS_LIMIT)

    def quantize_only():  # the second of the two launches, for where the time goes
        return torch.ops.compiled_moe.grouped_quantize(a, offs, RECIPE, True, True)

    got, want = fused(), unfused()
    differ = sum(int((g.view(torch.uint8) != w.view(torch.uint8)).sum()) if g.dtype == R.FP8_DTYPE
                 else int((g != w).sum()) for g, w in zip(got, want))
    times = timed_rounds({"fused": replay(fused), "unfused": replay(unfused),
                          "quantize": replay(quantize_only),
                          "copy": replay(lambda: copy_out.copy_(h))}, rounds)
    ratio, lo, hi = paired_ratio(times, "fused", "unfused")
    best = {k: min(v) for k, v in times.items()}
    moved = h.numel() * 2 + 2 * rows * model.inter + sum(t.numel() * 4 for t in (got[1], got[3]))
    gbs = moved / best["fused"] / 1e6
    copy_gbs = 2 * h.numel() * 2 / best["copy"] / 1e6
    return dict(model=model.name, rows=rows, inter=model.inter, activation=act,
                fused_us=best["fused"] * 1e3, unfused_us=best["unfused"] * 1e3,
                quantize_us=best["quantize"] * 1e3, ratio=ratio,
                ratio_range=(lo, hi), fused_gbs=gbs, of_copy=gbs / copy_gbs,
                elements_differing=differ, elements=sum(t.numel() for t in got))


def part_mlp(model, rounds):
    act, layout = activation_of(model)
    offs, rows = offsets(model.tokens * model.top_k, model.experts)
    H, I, G = model.hidden, model.inter, model.experts
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(G, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_(True)
    w2 = (torch.randn(G, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_(True)
    probs = torch.rand(rows, device="cuda", requires_grad=True)
    fp8_weights = (cm.quantize_weight(w1, RECIPE), cm.quantize_weight(w2, RECIPE))
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    inputs = (x, w1, w2, probs)

    def fused():
        y = cm.moe_mlp(x, offs, w1, w2, activation=act, gate_up_layout=layout, probs=probs,
                       fp8_recipe=RECIPE, fp8_weights=fp8_weights)
        return torch.autograd.grad(y, inputs, dy)

    def composed():  # the FP8 MLP before moe_activation_quantize
        h = cm.fp8_grouped_mm(x, w1.mT, offs, recipe=RECIPE, weight_fp8=fp8_weights[0])
        a = apply_activation(h, act, layout, R.GPT_OSS_ALPHA, R.GPT_OSS_LIMIT)
        a = a * probs[:, None].to(a.dtype)
        y = cm.fp8_grouped_mm(a, w2.mT, offs, recipe=RECIPE, weight_fp8=fp8_weights[1])
        return torch.autograd.grad(y, inputs, dy)

    def bf16():  # the same MLP without a recipe (the fused bf16 moe_mlp)
        y = cm.moe_mlp(x, offs, w1, w2, activation=act, gate_up_layout=layout, probs=probs)
        return torch.autograd.grad(y, inputs, dy)

    steps = {"fused": fused, "composed": composed, "bf16": bf16}
    # Eager calls pay every op's host time; graph replays time the GPU alone.
    times = timed_rounds({**steps, **{f"{k} graph": replay(f) for k, f in steps.items()}}, rounds)
    ratio, lo, hi = paired_ratio(times, "fused graph", "composed graph")
    best = {k: min(v) for k, v in times.items()}
    return dict(model=model.name, rows=rows, fused_ms=best["fused graph"],
                composed_ms=best["composed graph"], bf16_ms=best["bf16 graph"], ratio=ratio,
                ratio_range=(lo, hi),
                bf16_ratio=paired_ratio(times, "fused graph", "bf16 graph")[0],
                fused_eager_ms=best["fused"], bf16_eager_ms=best["bf16"],
                bf16_eager_ratio=paired_ratio(times, "fused", "bf16")[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="*", default=None, help="substrings of model names")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    models = [m for m in MODELS
              if not args.models or any(s.lower() in m.name.lower() for s in args.models)]
    env = environment()
    print("#", env)
    acts = [part_activation(m, args.rounds) for m in models]
    print("| model | M x I | activation | fused us | unfused us (its quantize) | "
          "unfused / fused (range) | fused GB/s | of copy | elements differing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in acts:
        print(f"| {r['model']} | {r['rows']} x {r['inter']} | {r['activation']} | "
              f"{r['fused_us']:.1f} | {r['unfused_us']:.1f} ({r['quantize_us']:.1f}) | "
              f"{r['ratio']:.3f}x "
              f"({r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}) | {r['fused_gbs']:.0f} | "
              f"{r['of_copy']:.2f} | {r['elements_differing']} of {r['elements']} |")
    mlps = [part_mlp(m, args.rounds) for m in models]
    print("\n| model | rows | FP8 moe_mlp fwd+bwd ms | composed ms | composed / moe_mlp (range) | "
          "bf16 moe_mlp ms | bf16 / FP8 | eager: FP8 ms, bf16 ms, bf16 / FP8 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in mlps:
        print(f"| {r['model']} | {r['rows']} | {r['fused_ms']:.3f} | {r['composed_ms']:.3f} | "
              f"{r['ratio']:.3f}x ({r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}) | "
              f"{r['bf16_ms']:.3f} | {r['bf16_ratio']:.3f}x | {r['fused_eager_ms']:.3f}, "
              f"{r['bf16_eager_ms']:.3f}, {r['bf16_eager_ratio']:.3f}x |")
    if args.json:
        write_json(args.json, {"env": env, "activation_quantize": acts, "mlp": mlps})


if __name__ == "__main__":
    main()
