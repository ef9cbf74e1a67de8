"""The FP8 weight gradient (`scaled_grouped_mm_wgrad`, fp8_blockwise) with groups that start
off 16-row boundaries, as routing without padding makes them: the Hopper kernel (which loads
such a group's chunks from the boundary below and shifts them into place, csrc/fp8_grouped_mm.cu)
against the same kernel on the same counts rounded up to 16 rows, and against the Triton kernel
(`COMPILED_MOE_FP8_GEMM=triton`) on the unaligned groups. GPU time from CUDA-graph replay, best
of 3 interleaved rounds; the error column is the largest difference from the Triton kernel's
fp32 output over its largest value.

    python benchmarks/tools/bench_wgrad_unaligned.py [--rows 16384]

Cases: FC1's weight gradient at each model shape (a_t: the input's H columns, d_t: the 2I
columns of FC1's output gradient), skewed routing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common, bench_*
from common import MODELS, bench_graph, group_counts, timed_rounds  # noqa: E402

import compiled_moe as cm  # noqa: E402


@contextlib.contextmanager
def triton_kernels():
    os.environ["COMPILED_MOE_FP8_GEMM"] = "triton"
    try:
        yield
    finally:
        del os.environ["COMPILED_MOE_FP8_GEMM"]


def problems(model, rows: int, device="cuda") -> dict:
    """{"unaligned": the op's arguments for FC1's weight gradient over `rows` skewed rows,
    "aligned": the same counts rounded up to 16 rows}."""
    counts = group_counts(rows, model.experts, "skewed", seed=1)
    offs = {"unaligned": torch.cumsum(counts, 0), "aligned": torch.cumsum((counts + 15) // 16 * 16, 0)}
    x = torch.randn(int(offs["aligned"][-1]), model.hidden, device=device, dtype=torch.bfloat16)
    d = torch.randn(x.shape[0], 2 * model.inter, device=device, dtype=torch.bfloat16)
    out = {}
    for name, o in offs.items():
        o = o.to(torch.int32).to(device)
        m = int(offs[name][-1])
        _, _, x_t, x_s = cm.grouped_quantize(x[:m], o, "fp8_blockwise", rowwise=False, columnwise=True)
        _, _, d_t, d_s = cm.grouped_quantize(d[:m], o, "fp8_blockwise", rowwise=False, columnwise=True)
        out[name] = (x_t, d_t, x_s, d_s, o, "fp8_blockwise")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384, help="rows (tokens x top-k) of the unaligned case")
    args = parser.parse_args()
    op = torch.ops.compiled_moe.scaled_grouped_mm_wgrad
    print(f"{'model':16s} {'aligned':>8s} {'unaligned':>9s} {'triton':>8s} {'unal./al.':>9s} "
          f"{'triton/ours':>11s} {'error':>8s}   (ms)")
    for m in MODELS:
        problem = problems(m, args.rows)
        ours = op(*problem["unaligned"], torch.float32)
        with triton_kernels():
            theirs = op(*problem["unaligned"], torch.float32)
            triton_ms = min(timed_rounds({"t": lambda: op(*problem["unaligned"], None)}, 3, bench_graph)["t"])
        error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        times = timed_rounds({name: (lambda p=p: op(*p, None)) for name, p in problem.items()}, 3, bench_graph)
        al, un = min(times["aligned"]), min(times["unaligned"])
        print(f"{m.name:16s} {al:8.3f} {un:9.3f} {triton_ms:8.3f} {un / al:9.2f} {triton_ms / un:11.2f} "
              f"{error:8.1e}")


if __name__ == "__main__":
    main()
