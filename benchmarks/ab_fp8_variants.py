"""Same-process A/B of the Hopper FP8 CUDA kernels' variants (the choices in kernels/configs.py):
the forward's cluster size and ring depth, the weight gradient's ring depth. Every model shape x {uniform, skewed}; variants timed in interleaved rounds (best
of the rounds' medians), outputs compared bitwise with the first variant's.

    python benchmarks/ab_fp8_variants.py forward 1,5 2,5 1,6     # cluster,stages
    python benchmarks/ab_fp8_variants.py wgrad 4 3 5             # stages
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fp8 import padded_offsets, problem  # noqa: E402
from common import MODELS, bench, gmean  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.kernels import scaled_grouped_mm_sm90 as sm90  # noqa: E402


def name(v: tuple[int, ...]) -> str:
    return ",".join(map(str, v))


def main(pas: str, variants: list[tuple[int, ...]], rounds: int = 3) -> None:
    rows = []
    for shape, routing, proj in itertools.product(MODELS, ("uniform", "skewed"), ("fc1", "fc2")):
        M0, K, N, G = problem(shape, proj)
        torch.manual_seed(0)
        offs, M = padded_offsets(M0, G, routing)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        if pas == "forward":
            w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
            xq = cm.grouped_quantize(x, offs, "fp8_blockwise")
            wq = cm.grouped_quantize(w, None, "fp8_blockwise")
            outs = {v: torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for v in variants}
            fns = {v: (lambda v=v: sm90.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, outs[v],
                                                           num_stages=v[1], cluster=v[0]))
                   for v in variants}
        else:
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            xq = cm.grouped_quantize(x, offs, "fp8_blockwise", rowwise=False, columnwise=True)
            dq = cm.grouped_quantize(dy, offs, "fp8_blockwise", rowwise=False, columnwise=True)
            outs = {v: torch.empty(G, K, N, device="cuda", dtype=torch.bfloat16) for v in variants}
            fns = {v: (lambda v=v: sm90.scaled_grouped_mm_wgrad(xq[2], dq[2], xq[3], dq[3], offs,
                                                                 "fp8_blockwise", outs[v], num_stages=v[0]))
                   for v in variants}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        same = all(torch.equal(outs[variants[0]], outs[v]) for v in variants)
        times = {v: [] for v in variants}
        for _ in range(rounds):
            for v, f in fns.items():
                times[v].append(bench(f))
        tf = {v: 2 * M * K * N / (min(t) * 1e-3) / 1e12 for v, t in times.items()}
        rows.append(tf)
        print(f"{shape.name} {routing} {proj}".ljust(36)
              + " ".join(f"{name(v)}: {tf[v]:5.0f} ({tf[v] / tf[variants[0]]:.3f})" for v in variants)
              + ("" if same else "  OUTPUTS DIFFER"), flush=True)
        del x, xq, outs, fns
        torch.cuda.empty_cache()
    print("geometric mean against " + name(variants[0]) + ": " + " ".join(
        f"{name(v)} {gmean(r[v] / r[variants[0]] for r in rows):.3f}"
        for v in variants))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("forward", "wgrad"):
        sys.exit(__doc__)
    main(sys.argv[1], [tuple(int(x) for x in v.split(",")) for v in sys.argv[2:]])
