"""Same-process A/B of the Hopper CUDA GEMM kernels' launch variants (the choices in
kernels/configs.py). Every model shape x {uniform, skewed} x {fc1, fc2}; variants timed in
interleaved rounds (best of the rounds' medians), outputs compared bitwise with the first
variant's; `torch._grouped_mm` is timed beside the bf16 ones.

    python benchmarks/tools/ab_variants.py fp8-forward 1,5 2,5 1,6 1,3,256   # cluster,stages[,block_n]
    python benchmarks/tools/ab_variants.py fp8-wgrad 4 3 5               # stages
    python benchmarks/tools/ab_variants.py bf16-forward 3,0 3,1          # stages,skip_past_rows
    python benchmarks/tools/ab_variants.py bf16-dgrad 3,0 3,1 --models Qwen3 --tokens 8192
    python benchmarks/tools/ab_variants.py bf16-wgrad 3 2                     # stages
    python benchmarks/tools/ab_variants.py fp8-forward 1,5 2,5 --serving --models Mixtral

--serving: the forward passes at bench_decode's serving shapes instead (T = 1, 8, 32, 128, 512,
or --tokens; skewed top-k routing), timed by CUDA-graph replay with the L2 flushed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common, bench_*
from bench_fp8 import padded_offsets, problem  # noqa: E402
from common import MODELS, gmean, graph_of, interleaved, offsets  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.kernels import grouped_mm_sm90, scaled_grouped_mm_sm90 as fp8_sm90  # noqa: E402

PASSES = ("fp8-forward", "fp8-wgrad", "bf16-forward", "bf16-dgrad", "bf16-wgrad")
TORCH = "torch._grouped_mm"


def name(v) -> str:
    return v if isinstance(v, str) else ",".join(map(str, v))


def case(pas, variants, M0, K, N, G, routing, inputs=None):
    """(flops, {variant: fn}, {variant: output}) of one problem; bf16 passes add torch's fn.
    inputs: (x, w, offs) to use instead of drawing them."""
    torch.manual_seed(0)
    if inputs is not None:
        x, w, offs = inputs
        M, (G, N, K) = x.shape[0], w.shape
    else:
        offs, M = padded_offsets(M0, G, routing) if pas.startswith("fp8") else (offsets(M0, G, routing), M0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    if pas == "fp8-forward":
        xq = cm.grouped_quantize(x, offs, "fp8_blockwise")
        wq = cm.grouped_quantize(w, None, "fp8_blockwise")
        outs = {v: torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: fp8_sm90.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, outs[v],
                                                          num_stages=v[1], cluster=v[0],
                                                          block_n=v[2] if len(v) > 2 else None))
               for v in variants}
    elif pas == "fp8-wgrad":
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        xq = cm.grouped_quantize(x, offs, "fp8_blockwise", rowwise=False, columnwise=True)
        dq = cm.grouped_quantize(dy, offs, "fp8_blockwise", rowwise=False, columnwise=True)
        outs = {v: torch.empty(G, K, N, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: fp8_sm90.scaled_grouped_mm_wgrad(xq[2], dq[2], xq[3], dq[3], offs,
                                                                "fp8_blockwise", outs[v], num_stages=v[0]))
               for v in variants}
    elif pas == "bf16-wgrad":  # dy_g^T @ x_g, the weight's (G, N, K) gradient (bench_grouped_mm's)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        outs = {v: torch.empty(G, N, K, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: grouped_mm_sm90.grouped_mm_wgrad(dy, x, offs, outs[v], False, None,
                                                                num_stages=v[0]))
               for v in variants}
        fns[TORCH] = lambda: torch._grouped_mm(dy.mT, x, offs)
    else:  # bf16: forward x @ w^T (K-major weight), dgrad dy @ w (N-major)
        a, b, cols = (x, w.mT, N) if pas == "bf16-forward" else (
            torch.randn(M, N, device="cuda", dtype=torch.bfloat16), w, K)
        outs = {v: torch.empty(M, cols, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: grouped_mm_sm90.grouped_mm(a, b, offs, None, outs[v], num_stages=v[0],
                                                          skip_past_rows=bool(v[1])))
               for v in variants}
        fns[TORCH] = lambda: torch._grouped_mm(a, b, offs)
    return 2 * M * K * N, fns, outs


def training_cases(args, variants, models):
    for shape, routing, proj in itertools.product(models, ("uniform", "skewed"), ("fc1", "fc2")):
        if args.tokens:
            shape = dataclasses.replace(shape, tokens=args.tokens[0])
        M0, K, N, G = problem(shape, proj)
        yield (f"{shape.name} T={shape.tokens} {routing} {proj}",
               *case(args.pass_, variants, M0, K, N, G, routing))


def serving_cases(args, variants, models):
    from bench_decode import serving_gemms

    if not args.pass_.endswith("forward"):
        raise SystemExit("--serving times the forward passes")
    for shape, tokens in itertools.product(models, args.tokens or (1, 8, 32, 128, 512)):
        for proj, x, w, offs, _ in serving_gemms(shape, tokens):
            yield (f"{shape.name} T={tokens} {proj}",
                   *case(args.pass_, variants, 0, 0, 0, 0, None, inputs=(x, w, offs)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pass_", choices=PASSES)
    p.add_argument("variants", nargs="+", help="comma-separated ints, as in the examples")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", nargs="*", help="name prefixes of the shapes to run (default: all)")
    p.add_argument("--tokens", type=int, nargs="*", help="tokens of every shape instead of its own")
    p.add_argument("--serving", action="store_true", help="bench_decode's serving shapes (forward passes)")
    args = p.parse_args()
    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants]
    models = [m for m in MODELS if not args.models or any(m.name.startswith(n) for n in args.models)]
    rows = []
    for label, flops, fns, outs in (serving_cases(args, variants, models) if args.serving
                                    else training_cases(args, variants, models)):
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        same = all(torch.equal(outs[variants[0]], outs[v]) for v in variants)
        if args.serving:
            fns = {v: graph_of(f).replay for v, f in fns.items()}
        tf = {v: flops / (t * 1e-3) / 1e12 for v, t in interleaved(fns, args.rounds).items()}
        rows.append(tf)
        print(label.ljust(42) + " ".join(f"{name(v)}: {tf[v]:5.0f} ({tf[v] / tf[variants[0]]:.3f})" for v in fns)
              + ("" if same else "  OUTPUTS DIFFER"), flush=True)
        del fns, outs
        torch.cuda.empty_cache()
    print("geometric mean against " + name(variants[0]) + ": " + " ".join(
        f"{name(v)} {gmean(r[v] / r[variants[0]] for r in rows):.3f}" for v in rows[0]))


if __name__ == "__main__":
    main()
