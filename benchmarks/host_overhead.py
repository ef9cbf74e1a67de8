"""Host time per eager call (CPU timer, no synchronisation): compiled_moe.grouped_mm vs
torch._grouped_mm on a tiny problem, so the GPU never holds the host back.

    python benchmarks/host_overhead.py
"""

from __future__ import annotations

import time

import torch

import compiled_moe as cm


def host_us(fn, calls=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


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


if __name__ == "__main__":
    main()
