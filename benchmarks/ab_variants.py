"""Same-process A/B of the Hopper CUDA GEMM kernels' launch variants (the choices in
kernels/configs.py). Every model shape x {uniform, skewed} x {fc1, fc2}; variants timed in
interleaved rounds (best of the rounds' medians), outputs compared bitwise with the first
variant's; `torch._grouped_mm` (bf16 passes) is timed beside them.

    python benchmarks/ab_variants.py fp8-forward 1,5,0 2,5,0 1,5,8   # cluster,stages,prefetch
    python benchmarks/ab_variants.py fp8-wgrad 4 3 5                  # stages
    python benchmarks/ab_variants.py bf16-forward 3,0 3,4 3,8         # stages,prefetch
    python benchmarks/ab_variants.py bf16-dgrad 3,0 3,4               # stages,prefetch

prefetch: k steps ahead that the producer asks L2 for the weight's boxes (0: none).
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fp8 import padded_offsets, problem  # noqa: E402
from common import MODELS, bench, gmean, offsets  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.kernels import grouped_mm_sm90, scaled_grouped_mm_sm90 as fp8_sm90  # noqa: E402

PASSES = ("fp8-forward", "fp8-wgrad", "bf16-forward", "bf16-dgrad")
TORCH = "torch._grouped_mm"


def name(v) -> str:
    return v if isinstance(v, str) else ",".join(map(str, v))


def variant_fns(pas, variants, M0, K, N, G, routing):
    """(flops, {variant: fn}, {variant: out}) of one case."""
    torch.manual_seed(0)
    if pas.startswith("fp8"):
        offs, M = padded_offsets(M0, G, routing)
    else:
        offs, M = offsets(M0, G, routing), M0
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    if pas == "fp8-forward":
        xq = cm.grouped_quantize(x, offs, "fp8_blockwise")
        wq = cm.grouped_quantize(w, None, "fp8_blockwise")
        outs = {v: torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: fp8_sm90.scaled_grouped_mm(
            xq[0], wq[0].mT, xq[1], wq[1], offs, outs[v], cluster=v[0], num_stages=v[1],
            prefetch=v[2] if len(v) > 2 else None)) for v in variants}
    elif pas == "fp8-wgrad":
        xq = cm.grouped_quantize(x, offs, "fp8_blockwise", rowwise=False, columnwise=True)
        dq = cm.grouped_quantize(dy, offs, "fp8_blockwise", rowwise=False, columnwise=True)
        outs = {v: torch.empty(G, K, N, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: fp8_sm90.scaled_grouped_mm_wgrad(
            xq[2], dq[2], xq[3], dq[3], offs, "fp8_blockwise", outs[v], num_stages=v[0]))
            for v in variants}
    else:  # bf16: forward x @ w^T, dgrad dy @ w (the weight read N-major)
        a, b, cols = (x, w.mT, N) if pas == "bf16-forward" else (dy, w, K)
        outs = {v: torch.empty(M, cols, device="cuda", dtype=torch.bfloat16) for v in variants}
        fns = {v: (lambda v=v: grouped_mm_sm90.grouped_mm(a, b, offs, None, outs[v],
                                                           num_stages=v[0], prefetch=v[1]))
               for v in variants}
        fns[TORCH] = lambda: torch._grouped_mm(a, b, offs)
    return 2 * M * K * N, fns, outs


def main(pas: str, variants: list[tuple[int, ...]], rounds: int = 3) -> None:
    rows = []
    for shape, routing, proj in itertools.product(MODELS, ("uniform", "skewed"), ("fc1", "fc2")):
        M0, K, N, G = problem(shape, proj)
        flops, fns, outs = variant_fns(pas, variants, M0, K, N, G, routing)
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        same = all(torch.equal(outs[variants[0]], outs[v]) for v in variants)
        times = {v: [] for v in fns}
        for _ in range(rounds):
            for v, f in fns.items():
                times[v].append(bench(f))
        tf = {v: flops / (min(t) * 1e-3) / 1e12 for v, t in times.items()}
        rows.append(tf)
        print(f"{shape.name} {routing} {proj}".ljust(36)
              + " ".join(f"{name(v)}: {tf[v]:5.0f} ({tf[v] / tf[variants[0]]:.3f})" for v in fns)
              + ("" if same else "  OUTPUTS DIFFER"), flush=True)
        del fns, outs
        torch.cuda.empty_cache()
    print("geometric mean against " + name(variants[0]) + ": " + " ".join(
        f"{name(v)} {gmean(r[v] / r[variants[0]] for r in rows):.3f}" for v in rows[0]))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in PASSES:
        sys.exit(__doc__)
    main(sys.argv[1], [tuple(int(x) for x in v.split(",")) for v in sys.argv[2:]])
