"""Same-process A/B of the Hopper GEMM kernels of csrc/: the package's sources against those of
another directory (for instance `mkdir old && git show HEAD~1:csrc/grouped_mm.cu > old/...`,
with every *.cuh beside them). Both builds run through the package's own launch code, on the
same inputs, in interleaved rounds; outputs must be bitwise equal. Each case prints the best of
the rounds' medians (TFLOP/s) and, as "paired", the median (min-max) over the rounds of the old
build's time over the new one's: the figure to trust for differences of a few %.

Cases: bf16 forward, dgrad and weight gradient (`grouped_mm`, `grouped_mm_wgrad`), FP8
blockwise forward and weight gradient (`scaled_grouped_mm`, `scaled_grouped_mm_wgrad`), every
model shape x {uniform, skewed} x {fc1, fc2};
`torch._grouped_mm` is timed beside the bf16 ones so that the ratios to it can be read off the
same run.

The other build's kernels must take the arguments the package's launchers pass now (for
instance, the bf16 weight gradient takes its per-group tensor maps since 2026-11-26, the FP8
one since 2026-11-27, and wgrad_tile_order the maps' row dimension: an older build's outputs
then differ and the script stops).

    python benchmarks/tools/ab_csrc.py OLD_DIR [--rounds 4] [--json out.json]
        [--passes forward dgrad wgrad "fp8 forward" "fp8 wgrad"] [--models Qwen3 ...] [--tokens 8192]
        [--deepgemm]   # DeepGEMM's published grouped shapes (bench_fp8.py) instead
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common, bench_*
from bench_fp8 import DEEPGEMM_CONTIGUOUS, padded_offsets  # noqa: E402
from bench_grouped_mm import problem  # noqa: E402
from common import (MODELS, environment, gmean, offsets, paired_ratio, timed_rounds,  # noqa: E402
                    write_json)

import compiled_moe as cm  # noqa: E402
from compiled_moe import native  # noqa: E402


PASSES = ["forward", "dgrad", "wgrad", "fp8 forward", "fp8 wgrad"]


def kernels_from(directory: Path):
    """A stand-in for native.kernel that loads csrc/<name>.cu from ``directory``."""
    from cuda.core import ObjectCode

    @functools.lru_cache(maxsize=None)
    def kernel(name: str, function: str, device_index: int):
        path = directory / f"{name}.cu"
        cubin = native.compile_source(path, native.source_arch(path, native.device_arch(device_index)))
        return ObjectCode.from_cubin(cubin).get_kernel(function)

    return kernel


def cases(models, tokens, passes, deepgemm=False):
    if deepgemm:  # DeepGEMM's published grouped shapes (bench_fp8.py --deepgemm), equal groups
        for G, m, N, K, _ in DEEPGEMM_CONTIGUOUS:
            yield from problem_cases(f"{G} groups x {m} rows N={N} K={K}", G * m, K, N, G, "uniform", passes)
        return
    for shape, routing, proj in itertools.product(models, ("uniform", "skewed"), ("fc1", "fc2")):
        if tokens:
            shape = dataclasses.replace(shape, tokens=tokens)
        M, K, N, G = problem(shape, proj)
        yield from problem_cases(f"{shape.name} T={shape.tokens} {routing} {proj}", M, K, N, G, routing, passes)


def problem_cases(name, M, K, N, G, routing, passes):
    torch.manual_seed(0)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    offs = offsets(M, G, routing)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    flops = 2 * M * K * N
    yield (name, "forward", flops, lambda x=x, w=w, o=offs: cm.grouped_mm(x, w.mT, o),
           lambda x=x, w=w, o=offs: torch._grouped_mm(x, w.mT, o))
    yield (name, "dgrad", flops, lambda dy=dy, w=w, o=offs: cm.grouped_mm(dy, w, o),
           lambda dy=dy, w=w, o=offs: torch._grouped_mm(dy, w, o))
    # The weight gradient in the weight's (G, N, K) layout, as autograd asks for it.
    yield (name, "wgrad", flops, lambda x=x, dy=dy, o=offs: cm.grouped_mm_wgrad(dy, x, o),
           lambda x=x, dy=dy, o=offs: torch._grouped_mm(dy.mT, x, o))
    if "fp8 forward" not in passes and "fp8 wgrad" not in passes:
        return
    poffs, PM = padded_offsets(M, G, routing)
    xp = torch.randn(PM, K, device="cuda", dtype=torch.bfloat16)
    xq = cm.grouped_quantize(xp, poffs, "fp8_blockwise", rowwise=True, columnwise="fp8 wgrad" in passes)
    wq = cm.grouped_quantize(w, None, "fp8_blockwise", rowwise=True, columnwise=False)
    yield (name, "fp8 forward", 2 * PM * K * N,
           lambda xq=xq, wq=wq, o=poffs: cm.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], o,
                                                              recipe="fp8_blockwise"), None)
    if "fp8 wgrad" not in passes:
        return
    # The weight's gradient in its (G, N, K) layout: d_t's columns by x_t's.
    dq = cm.grouped_quantize(torch.randn(PM, N, device="cuda", dtype=torch.bfloat16), poffs,
                             "fp8_blockwise", rowwise=False, columnwise=True)
    yield (name, "fp8 wgrad", 2 * PM * K * N,
           lambda xq=xq, dq=dq, o=poffs: cm.scaled_grouped_mm_wgrad(dq[2], xq[2], dq[3], xq[3], o,
                                                                    recipe="fp8_blockwise"), None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("old", type=Path, help="directory with the other build's csrc/*.cu and *.cuh")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json")
    p.add_argument("--passes", nargs="*", default=PASSES, choices=PASSES)
    p.add_argument("--models", nargs="*", help="name prefixes of the shapes to run (default: all)")
    p.add_argument("--tokens", type=int, help="tokens of every shape instead of its own")
    p.add_argument("--deepgemm", action="store_true",
                   help="DeepGEMM's published grouped shapes instead of the models'")
    args = p.parse_args()
    models = [m for m in MODELS if not args.models or any(m.name.startswith(n) for n in args.models)]
    builds = {"new": native.kernel, "old": kernels_from(args.old.resolve())}
    rows = []
    for name, pas, flops, ours, peer in cases(models, args.tokens, args.passes, args.deepgemm):
        if pas not in args.passes:
            continue
        outs = {}

        def timed(build):  # every call of a build's function first selects its kernels
            native.kernel = builds[build]
            return ours()

        for build in builds:
            outs[build] = timed(build)
        if not torch.equal(outs["new"].view(torch.uint8), outs["old"].view(torch.uint8)):
            raise AssertionError(f"{name} {pas}: the two builds' outputs differ")
        fns = {b: (lambda b=b: timed(b)) for b in builds}
        if peer is not None:
            fns["torch"] = peer
        times = timed_rounds(fns, args.rounds)
        native.kernel = builds["new"]
        best = {k: min(t) for k, t in times.items()}
        paired = paired_ratio(times, "new", "old")
        tf = {k: flops / t / 1e9 for k, t in best.items()}
        rows.append(dict(case=name, pas=pas, ms=best, tflops=tf, paired=paired))
        line = (f"{name:32s} {pas:12s} new {tf['new']:5.0f} old {tf['old']:5.0f} new/old {best['old'] / best['new']:.3f}"
                f" paired {paired[0]:.3f} ({paired[1]:.3f}-{paired[2]:.3f})")
        if "torch" in tf:
            line += f"  torch {tf['torch']:5.0f} new/torch {best['torch'] / best['new']:.3f} old/torch {best['torch'] / best['old']:.3f}"
        print(line, flush=True)
    print("\ngeometric means (time ratios, > 1: the first is faster)")
    for pas in args.passes:
        sel = [r["ms"] for r in rows if r["pas"] == pas]
        line = (f"{pas:12s} new/old {gmean([m['old'] / m['new'] for m in sel]):.3f}"
                f" paired {gmean([r['paired'][0] for r in rows if r['pas'] == pas]):.3f}")
        if "torch" in sel[0]:
            line += (f"  new/torch {gmean([m['torch'] / m['new'] for m in sel]):.3f}"
                     f" (min {min(m['torch'] / m['new'] for m in sel):.3f})"
                     f"  old/torch {gmean([m['torch'] / m['old'] for m in sel]):.3f}")
        print(line)
    if args.json:
        write_json(args.json, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
