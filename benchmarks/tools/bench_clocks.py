"""Sustained speed, SM clock and board power of each GEMM contender, run back to back for a few
seconds with nvidia-smi sampled beside it.

Under sustained load an H200 holds its board power at the 700 W limit by lowering the SM
clock, so a kernel's speed is its work per clock cycle times the clock its power draw allows.
This prints both: TFLOP/s, the median SM clock, TFLOP/s per GHz, that as a fraction of the
tensor cores' peak at that clock (132 SMs x 4096 dense bf16 or 8192 FP8 flop per cycle), the
median power and whether the power cap was holding the clock down.

    python benchmarks/tools/bench_clocks.py [--seconds 3] [--models Qwen3 ...] [--json out.json]

Cases: dense 8192^3 bf16 matmul (cuBLAS); per model shape, uniform routing, fc1 and fc2: bf16
forward of ours, `torch._grouped_mm` and cuBLAS's batched GEMM on the same problem (uniform
groups are a batch); FP8 forward of our fp8_blockwise kernel and `torch._scaled_grouped_mm`
rowwise.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common, bench_*
from bench_fp8 import make_fns as fp8_fns  # noqa: E402
from bench_grouped_mm import problem  # noqa: E402
from common import MODELS, environment, offsets, warm_up, write_json  # noqa: E402

import compiled_moe as cm  # noqa: E402

PEAK_FLOP_PER_CYCLE_PER_SM = {"bf16": 4096, "fp8": 8192}
_QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
_SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit: software power cap


def _sample(stop: threading.Event, samples: list) -> None:
    while not stop.is_set():
        line = subprocess.run(["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
                               "-i", str(torch.cuda.current_device())],
                              capture_output=True, text=True).stdout.strip()
        clock, power, reasons = (v.strip() for v in line.split(","))
        samples.append((int(clock), float(power), int(reasons, 16)))
        time.sleep(0.1)


def sustained(fn, flops: int, kind: str, seconds: float) -> dict:
    """Run fn back to back for `seconds`; GPU time per call from CUDA events over the whole run,
    clock and power from the samples of its middle half."""
    fn()
    torch.cuda.synchronize()
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(stop, samples))
    sampler.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    stop.set()
    sampler.join()
    ms = start.elapsed_time(end) / calls
    mid = samples[len(samples) // 4: 3 * len(samples) // 4] or samples
    clock = sorted(s[0] for s in mid)[len(mid) // 2]
    power = sorted(s[1] for s in mid)[len(mid) // 2]
    capped = sum(bool(s[2] & _SW_POWER_CAP) for s in mid) / len(mid)
    tflops = flops / ms / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = sms * PEAK_FLOP_PER_CYCLE_PER_SM[kind] * clock * 1e6 / 1e12
    return dict(tflops=tflops, clock_mhz=clock, tflops_per_ghz=tflops / clock * 1e3,
                of_clock_peak=tflops / peak, power_w=power, power_capped=capped)


def cases(models):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    yield "dense 8192^3", "cuBLAS matmul", "bf16", 2 * 8192 ** 3, lambda: a @ a
    for shape in models:
        for proj in ("fc1", "fc2"):
            M, K, N, G = problem(shape, proj)
            torch.manual_seed(0)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
            offs = offsets(M, G, "uniform")
            name, flops = f"{shape.name} {proj}", 2 * M * K * N
            yield name, "ours bf16", "bf16", flops, lambda x=x, w=w, o=offs: cm.grouped_mm(x, w.mT, o)
            yield name, "torch._grouped_mm", "bf16", flops, lambda x=x, w=w, o=offs: torch._grouped_mm(x, w.mT, o)
            if M % G == 0:
                xb = x.view(G, M // G, K)
                yield name, "cuBLAS bmm", "bf16", flops, lambda xb=xb, w=w: torch.bmm(xb, w.mT)
            del x, w
            PM, fns, _, _ = fp8_fns(M, K, N, G, "uniform")
            flops = 2 * PM * K * N
            yield name, "ours fp8_blockwise", "fp8", flops, fns["forward"]["blockwise"]
            yield name, "torch._scaled_grouped_mm rowwise", "fp8", flops, fns["forward"]["torch_rowwise"]
            del fns
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--models", nargs="*", help="name prefixes of the shapes to run (default: all)")
    p.add_argument("--json")
    args = p.parse_args()
    models = [m for m in MODELS if not args.models or any(m.name.startswith(n) for n in args.models)]
    warm_up()
    rows = []
    print(f"{'case':24s} {'contender':34s} {'TFLOP/s':>8s} {'MHz':>6s} {'TF/s/GHz':>9s} "
          f"{'of peak':>8s} {'W':>5s} {'capped':>7s}")
    for name, who, kind, flops, fn in cases(models):
        r = sustained(fn, flops, kind, args.seconds)
        rows.append(dict(case=name, contender=who, kind=kind, **r))
        print(f"{name:24s} {who:34s} {r['tflops']:8.0f} {r['clock_mhz']:6d} {r['tflops_per_ghz']:9.1f} "
              f"{r['of_clock_peak']:8.2f} {r['power_w']:5.0f} {r['power_capped']:7.0%}", flush=True)
    if args.json:
        write_json(args.json, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
