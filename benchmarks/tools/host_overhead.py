"""Host time per eager call (CPU timer, no synchronisation): compiled_moe.grouped_mm vs
torch._grouped_mm on a tiny problem, so the GPU never holds the host back; then the cost of how
the opaque CUDA ops are registered: the same op bodies as ``kernel_op`` (what the package
does) against ``torch.library.custom_op``, interleaved rounds in one process.

    python benchmarks/tools/host_overhead.py
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from common import host_us, interleaved_us  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.ops import grouped_mm as grouped_mm_ops  # noqa: E402
from compiled_moe.ops import routing as routing_ops  # noqa: E402


def main():
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 256, 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, 9, device="cuda", dtype=torch.int32) * 32
    rows = {
        "compiled_moe.grouped_mm": lambda: cm.grouped_mm(x, w.mT, offs),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w.mT, offs),
        "compiled_moe.grouped_mm_wgrad": lambda: cm.grouped_mm_wgrad(dy, x, offs),
        "torch._grouped_mm (wgrad form)": lambda: torch._grouped_mm(dy.t(), x, offs),
    }
    for name, fn in rows.items():
        print(f"{name:34s} {host_us(fn):7.1f} us/call (host)")
    registration_rows(x, w, offs)


def registration_rows(x, w, offs, rounds=15):
    """The bodies of two kernel_ops (the route, the Hopper grouped GEMM) registered again as
    custom_ops: what the custom_op wrapper (autograd layer, aliasing check, dynamo's disable)
    adds per call. Medians over interleaved rounds, so drifts of the host hit both sides."""
    route_body = routing_ops._moe_route.__wrapped__
    mm_body = grouped_mm_ops._grouped_mm_sm90.__wrapped__

    @torch.library.custom_op("compiled_moe_bench::route", mutates_args=())
    def route(topk_ids: torch.Tensor, num_experts: int,
              pad_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return route_body(topk_ids, num_experts, pad_multiple)

    @torch.library.custom_op("compiled_moe_bench::grouped_mm_sm90", mutates_args=(),
                             device_types="cuda")
    def mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
           bias: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return mm_body(a, b, offs, bias, out_dtype)

    ids = torch.randint(0, 8, (64, 2), device="cuda")
    rows = {
        "moe_route as custom_op": lambda: route(ids, 8),
        "moe_route as kernel_op (ours)": lambda: torch.ops.compiled_moe.moe_route(ids, 8),
        "grouped_mm_sm90 as custom_op": lambda: mm(x, w.mT, offs),
        "grouped_mm_sm90 as kernel_op (ours)": lambda: torch.ops.compiled_moe.grouped_mm_sm90(x, w.mT, offs),
        "grouped_mm_sm90 body, plain call": lambda: mm_body(x, w.mT, offs),
    }
    print(f"\nregistration of the opaque CUDA ops, median of {rounds} interleaved rounds:")
    for name, (median, lo, hi) in interleaved_us(rows, rounds).items():
        print(f"{name:38s} {median:7.1f} us/call (host)  (min {lo:.1f}, max {hi:.1f})")


if __name__ == "__main__":
    main()
