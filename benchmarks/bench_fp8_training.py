"""A training step of one grouped linear layer, forward + backward (input and weight gradients),
bf16 against FP8, on the GPU:

    python benchmarks/bench_fp8_training.py [--json out.json] [--models qwen gpt]

Per model shape of DESIGN.md section 6 and projection (fc1: K = hidden, N = 2 x inter; fc2:
K = inter, N = hidden), skewed routing with groups rounded up to 16 rows:
  torch bf16     torch._grouped_mm with its autograd
  ours bf16      compiled_moe.grouped_mm
  fp8            compiled_moe.fp8_grouped_mm, recipe fp8_blockwise: the activation and the
                 gradient quantized both ways in one launch each (grouped_quantize), the weight
                 both ways, then the three FP8 GEMMs
  fp8 (Triton quantize)  the same with COMPILED_MOE_QUANTIZE=triton: the Triton quantize
                 kernels, two launches for each activation and gradient
  fp8, weight beforehand  fp8 with weight_fp8=quantize_weight(w): the weight quantized once
                 per optimizer step, outside the timed micro-batch step
Each step is torch.autograd.grad of the output with a fixed gradient, timed from CUDA-graph
replay (GPU time; do_bench_cudagraph median), all variants on the same inputs in one process.
Also timed: the weight's quantization both ways (every FP8 step does it), one launch
(grouped_quantize: 128 x 128 blocks of w and w.mT from one read) against the two launches it
replaced (quantize_tiles of w, then of w.mT).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, environment, group_counts, write_json  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.kernels import quantize  # noqa: E402
from compiled_moe.ops import fp8 as fp8_ops  # noqa: E402


def step(forward, x, w, dy):
    def run():
        return torch.autograd.grad(forward(x, w), (x, w), dy)
    return run


def graph_ms(fn):
    fn()  # compile and warm up outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--models", nargs="*")
    args = p.parse_args()
    rows = []
    for shape in MODELS:
        if args.models and not any(m.lower() in shape.name.lower() for m in args.models):
            continue
        for proj in ("fc1", "fc2"):
            M = shape.tokens * shape.top_k
            K, N = (shape.hidden, 2 * shape.inter) if proj == "fc1" else (shape.inter, shape.hidden)
            G = shape.experts
            counts = (group_counts(M, G, "skewed") + 15) // 16 * 16
            offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
            M = int(counts.sum())
            torch.manual_seed(0)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = (torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K))
            w.requires_grad_()
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            w_fp8 = cm.quantize_weight(w, "fp8_blockwise")
            variants = {
                "torch bf16": lambda a, b: torch._grouped_mm(a, b.mT, offs=offs),
                "ours bf16": lambda a, b: cm.grouped_mm(a, b.mT, offs),
                "fp8": lambda a, b: cm.fp8_grouped_mm(a, b.mT, offs, recipe="fp8_blockwise"),
                "fp8, weight beforehand": lambda a, b: cm.fp8_grouped_mm(
                    a, b.mT, offs, recipe="fp8_blockwise", weight_fp8=w_fp8),
            }
            ms = {}
            for name, fwd in variants.items():
                ms[name] = graph_ms(step(fwd, x, w, dy))
            os.environ["COMPILED_MOE_QUANTIZE"] = "triton"
            try:
                ms["fp8 (Triton quantize)"] = graph_ms(step(variants["fp8"], x, w, dy))
            finally:
                os.environ.pop("COMPILED_MOE_QUANTIZE")
            wd = w.detach()
            outs = fp8_ops._quantize_outputs(wd, None, "fp8_blockwise", True, True)
            ms["weight quantize"] = graph_ms(
                lambda: torch.ops.compiled_moe.grouped_quantize(wd, None, "fp8_blockwise", True, True))
            ms["weight quantize, two launches"] = graph_ms(lambda: (
                quantize.quantize_tiles(wd, outs[0], outs[1], "fp8_blockwise", weight=True),
                quantize.quantize_tiles(wd.mT, outs[2], outs[3], "fp8_blockwise", weight=True)))
            row = dict(model=shape.name, proj=proj, M=M, K=K, N=N, G=G, ms=ms,
                       fp8_vs_torch_bf16=ms["torch bf16"] / ms["fp8"],
                       fp8_vs_ours_bf16=ms["ours bf16"] / ms["fp8"],
                       quantize_gain=ms["fp8 (Triton quantize)"] / ms["fp8"],
                       cached_vs_ours_bf16=ms["ours bf16"] / ms["fp8, weight beforehand"])
            rows.append(row)
            print(f"{shape.name:16s} {proj} {M}x{K}x{N} G={G}: " +
                  "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()) +
                  f" | fp8 vs torch bf16 {row['fp8_vs_torch_bf16']:.2f}x, vs ours bf16 "
                  f"{row['fp8_vs_ours_bf16']:.2f}x, CUDA vs Triton quantize "
                  f"{row['quantize_gain']:.2f}x", flush=True)
    print("\n| model | proj | torch bf16 ms | ours bf16 ms | fp8 ms | fp8 (Triton quantize) ms "
          "| fp8 vs torch bf16 | fp8 vs ours bf16 | CUDA / Triton quantize "
          "| weight quantize ms, one launch / two | fp8, weight beforehand ms | its speedup over "
          "ours bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["ms"]
        print(f"| {r['model']} | {r['proj']} | {m['torch bf16']:.3f} | {m['ours bf16']:.3f} | "
              f"{m['fp8']:.3f} | {m['fp8 (Triton quantize)']:.3f} | "
              f"{r['fp8_vs_torch_bf16']:.2f}x | {r['fp8_vs_ours_bf16']:.2f}x | "
              f"{r['quantize_gain']:.2f}x | {m['weight quantize']:.3f} / "
              f"{m['weight quantize, two launches']:.3f} | {m['fp8, weight beforehand']:.3f} | "
              f"{r['cached_vs_ours_bf16']:.2f}x |")
    if args.json:
        write_json(args.json, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
