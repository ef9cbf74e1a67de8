"""Same-process A/B of the CUDA columnwise quantizer (csrc/grouped_quantize.cu): the package's
build against the sources of other directories (each a copy of csrc/ with its *.cuh, edited),
all run through the package's launcher on the same inputs, in interleaved rounds.

`grouped_quantize(x, offs, "fp8_blockwise", rowwise=True, columnwise=True)` on each model's FC1
input (bf16, skewed groups on 16 rows, as bench_fp8.py's quantizer table). Prints, per build, the
GPU time (best of the rounds' CUDA-graph medians), the fraction of copy bandwidth and the
package build's time over this one's, and how many bytes of each output differ from the
package build's (a build may change the rounding on purpose; 0 everywhere otherwise).

    python benchmarks/tools/ab_quantize.py DIR [DIR ...] [--rounds 3] [--models DeepSeek ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common, bench_*
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/tools/: ab_csrc
from ab_csrc import kernels_from  # noqa: E402
from bench_fp8 import padded_offsets  # noqa: E402
from common import MODELS, bench_graph, timed_rounds, warm_up  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe import native  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("builds", nargs="+", type=Path, help="directories with other csrc/ sources")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", nargs="*", help="name prefixes of the shapes to run (default: all)")
    args = p.parse_args()

    package = native.kernel
    builds = {"package": package}
    builds.update({str(d): kernels_from(d.resolve()) for d in args.builds})
    warm_up()
    for shape in MODELS:
        if args.models and not any(shape.name.startswith(m) for m in args.models):
            continue
        offs, M = padded_offsets(shape.tokens * shape.top_k, shape.experts, "skewed")
        torch.manual_seed(0)
        x = torch.randn(M, shape.hidden, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_ms = bench_graph(lambda: y.copy_(x))

        def quantizer(kernel):
            def fn():
                native.kernel = kernel  # the launcher looks its kernel up at every call
                try:
                    return cm.grouped_quantize(x, offs, "fp8_blockwise", rowwise=True,
                                               columnwise=True)
                finally:
                    native.kernel = package
            return fn

        fns = {name: quantizer(kernel) for name, kernel in builds.items()}
        outs = {name: fn() for name, fn in fns.items()}
        nbytes = 2 * x.numel() + sum(t.numel() * t.element_size() for t in outs["package"])
        times = timed_rounds(fns, args.rounds, timer=bench_graph)
        copy_gbs = 4 * x.numel() / copy_ms / 1e6
        for name in fns:
            t = min(times[name])
            differing = [int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())
                         for a, b in zip(outs[name], outs["package"])]
            print(f"{shape.name:16s} {name:24s} {t * 1e3:7.1f} us  "
                  f"{nbytes / t / 1e6 / copy_gbs:.3f} of copy  package/this "
                  f"{min(times['package']) / t:.3f}  bytes differing (row_q, row_s, col_q, col_s) "
                  f"{differing}", flush=True)


if __name__ == "__main__":
    main()
