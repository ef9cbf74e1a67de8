"""How close the grouped GEMMs run to cuBLAS on the same work: a ceiling for the speed-ups.

With uniform routing a grouped GEMM is a batched one: G groups of M / G rows. cuBLAS's batched
GEMM (`torch.bmm`) on exactly that problem is what the vendor library reaches on the same
arithmetic and the same bytes, without the grouped kernels' device-side schedule. The ratio
torch.bmm / torch._grouped_mm bounds what a grouped kernel that matches cuBLAS could gain over
torch._grouped_mm on that case. Skewed routing has no batched equivalent; its forward cases are
timed for ours and torch._grouped_mm, and the table ends with the forward geometric mean over
all cases that a kernel at cuBLAS's speed on the uniform ones (and ours on the skewed) gives.

FP8 forward: our fp8_blockwise grouped GEMM against cuBLAS's FP8 GEMM of the same M x K x N as
one dense product (`torch.nn.functional.scaled_mm`: rowwise scales, and 1x128 x 128x128 block
scales where this torch and cuBLAS offer them). One dense weight instead of G makes it an
optimistic ceiling.

Same process, interleaved rounds, the best median of each contender.

    python benchmarks/tools/bench_ceiling.py --json out.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common, bench_*
from bench_grouped_mm import problem  # noqa: E402
from common import MODELS, environment, gmean, interleaved, offsets, write_json  # noqa: E402

import compiled_moe as cm  # noqa: E402


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of fn launches (torch.profiler): the tile and cluster shapes
    cuBLAS picked are in its kernels' names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.self_device_time_total > 0})


def best_of(fns: dict, rounds: int, show_kernels: bool = False) -> dict:
    """Best median ms of each callable over interleaved rounds."""
    if show_kernels:
        for k, fn in fns.items():
            print(f"  kernels of {k}: {'; '.join(n[:160] for n in kernel_names(fn))}", flush=True)
    return interleaved(fns, rounds)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def uniform_problem(shape, proj):
    """(M, K, N, G, x, w) of a projection, M rounded down to a multiple of G (equal groups)."""
    M, K, N, G = problem(shape, proj)
    M = M // G * G
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    return M, K, N, G, x, w


def bf16_rows(shape, proj, rounds, show_kernels=False):
    M, K, N, G, x, w = uniform_problem(shape, proj)
    r = M // G
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    offs = offsets(M, G, "uniform")
    xg, dyg = x.view(G, r, K), dy.view(G, r, N)
    passes = {
        "forward": {"ours": lambda: cm.grouped_mm(x, w.transpose(1, 2), offs),
                    "torch._grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs),
                    "cuBLAS bmm": lambda: torch.bmm(xg, w.transpose(1, 2))},
        "dgrad": {"ours": lambda: cm.grouped_mm(dy, w, offs),
                  "torch._grouped_mm": lambda: torch._grouped_mm(dy, w, offs),
                  "cuBLAS bmm": lambda: torch.bmm(dyg, w)},
        "wgrad": {"ours": lambda: cm.grouped_mm_wgrad(dy, x, offs),
                  "torch._grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs),
                  "cuBLAS bmm": lambda: torch.bmm(dyg.transpose(1, 2), xg)},
    }
    offs_skewed = offsets(M, G, "skewed")
    passes["forward skewed"] = {
        "ours": lambda: cm.grouped_mm(x, w.transpose(1, 2), offs_skewed),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs_skewed)}
    rows = []
    for pas, fns in passes.items():
        ref = fns.get("cuBLAS bmm", fns["torch._grouped_mm"])().reshape(-1)
        for who, fn in fns.items():
            err = rel_err(fn().reshape(-1), ref)
            if not err < 2e-2:
                raise AssertionError(f"{shape.name} {proj} {pas} {who}: relative error {err:.2e}")
        ms = best_of(fns, rounds, show_kernels)
        tf = {k: 2 * M * K * N / t / 1e9 for k, t in ms.items()}
        rows.append(dict(model=shape.name, proj=proj, pas=pas, M=M, K=K, N=N, G=G, ms=ms, tflops=tf))
        print(f"bf16 {shape.name:16s} {proj} {pas:14s} " +
              " ".join(f"{k}={v:5.0f}" for k, v in tf.items()) + " TFLOP/s", flush=True)
    return rows


def _dense_fp8(x, wt, recipe):
    """cuBLAS FP8 GEMM x (M, K) @ wt (K, N) through torch.nn.functional.scaled_mm, checked
    against x @ wt; None where this torch does not offer the recipe. Scales fp32: rowwise
    (M, 1) x (1, N), or 1x128 blocks of x (M, K/128) and 128x128 blocks of wt (K/128, N/128),
    each tried in both storage orders (which one cuBLAS wants is not documented in torch)."""
    from torch.nn.functional import ScalingType, scaled_mm

    M, K = x.shape
    N = wt.shape[1]
    e4m3 = torch.float8_e4m3fn
    if recipe == "rowwise":
        sx = x.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448
        sw = wt.float().abs().amax(0, keepdim=True).clamp_min(1e-12) / 448
        xq, wq = (x.float() / sx).to(e4m3), (wt.float() / sw).to(e4m3)
        kinds = (ScalingType.RowWise, ScalingType.RowWise)
        layouts = [(sx, sw)]
    elif K % 128 or N % 128:
        print(f"  cuBLAS dense FP8 {recipe}: K = {K}, N = {N} not multiples of 128", flush=True)
        return None
    else:
        sx = x.float().view(M, K // 128, 128).abs().amax(2).clamp_min(1e-12) / 448
        sw = (wt.float().view(K // 128, 128, N // 128, 128).abs().amax((1, 3)).clamp_min(1e-12)
              / 448)
        xq = (x.float().view(M, K // 128, 128) / sx[:, :, None]).view(M, K).to(e4m3)
        wq = (wt.float().view(K // 128, 128, N // 128, 128) / sw[:, None, :, None]).view(K, N)
        wq = wq.to(e4m3)
        kinds = (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128)
        outer = lambda s: s.t().contiguous().t()  # noqa: E731
        layouts = [(outer(sx), sw), (outer(sx), outer(sw)), (sx, sw), (sx, outer(sw))]
    wq = wq.t().contiguous().t()  # (K, N) column-major: both operands K-major
    ref = x.float() @ wt.float()
    why = ""
    for sa, sb in layouts:
        fn = lambda sa=sa, sb=sb: scaled_mm(xq, wq, sa, kinds[0], sb, kinds[1],  # noqa: E731
                                            output_dtype=torch.bfloat16)
        try:
            err = rel_err(fn(), ref)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            why = str(e).splitlines()[0][:120]
            continue
        if err < 0.08:
            return fn
        why = f"relative error {err:.2e}"
    print(f"  cuBLAS dense FP8 {recipe}: not available ({why})", flush=True)
    return None


def fp8_rows(shape, proj, rounds, show_kernels=False):
    M, K, N, G, x, w = uniform_problem(shape, proj)
    offs = offsets(M, G, "uniform")
    xq = cm.grouped_quantize(x, offs, "fp8_blockwise", rowwise=True, columnwise=False)
    wq = cm.grouped_quantize(w, None, "fp8_blockwise", rowwise=True, columnwise=False)
    fns = {"ours blockwise": lambda: cm.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs,
                                                           recipe="fp8_blockwise")}
    wt = w[0].t()  # one expert's weight as the dense product's (K, N)
    for recipe in ("rowwise", "blockwise"):
        fn = _dense_fp8(x, wt, recipe)
        if fn is not None:
            fns[f"cuBLAS dense {recipe}"] = fn
    err = rel_err(fns["ours blockwise"](), cm.grouped_mm(x, w.transpose(1, 2), offs))
    if not err < 0.08:
        raise AssertionError(f"ours blockwise: relative error {err:.2e}")
    ms = best_of(fns, rounds, show_kernels)
    tf = {k: 2 * M * K * N / t / 1e9 for k, t in ms.items()}
    print(f"fp8  {shape.name:16s} {proj} forward " +
          " ".join(f"{k}={v:5.0f}" for k, v in tf.items()) + " TFLOP/s", flush=True)
    return [dict(model=shape.name, proj=proj, pas="forward fp8", M=M, K=K, N=N, G=G, ms=ms,
                 tflops=tf)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", nargs="*")
    p.add_argument("--kernels", action="store_true", help="print each contender's CUDA kernels")
    args = p.parse_args()
    rows = []
    for shape in MODELS:
        if args.models and not any(m.lower() in shape.name.lower() for m in args.models):
            continue
        for proj in ("fc1", "fc2"):
            rows += bf16_rows(shape, proj, args.rounds, args.kernels)
            rows += fp8_rows(shape, proj, args.rounds, args.kernels)

    print("\nbf16, uniform routing: TFLOP/s and time ratios (> 1: the first is faster)")
    print(f"{'case':28s} {'pass':14s} {'ours':>5s} {'torch':>5s} {'bmm':>5s} "
          f"{'ours/torch':>10s} {'bmm/torch':>9s} {'ours/bmm':>8s}")
    nan = float("nan")
    for r in rows:
        tf = r["tflops"]
        if r["pas"] != "forward fp8":
            o, t, b = tf["ours"], tf["torch._grouped_mm"], tf.get("cuBLAS bmm", nan)
            print(f"{r['model'] + ' ' + r['proj']:28s} {r['pas']:14s} {o:5.0f} {t:5.0f} {b:5.0f} "
                  f"{o / t:10.2f} {b / t:9.2f} {o / b:8.2f}")
    forward = [r["tflops"] for r in rows if r["pas"] in ("forward", "forward skewed")]
    if forward:
        ours = gmean([f["ours"] / f["torch._grouped_mm"] for f in forward])
        bound = gmean([max(f["ours"], f.get("cuBLAS bmm", 0)) / f["torch._grouped_mm"]
                       for f in forward])
        print(f"forward over torch._grouped_mm, geometric mean of {len(forward)} cases: ours "
              f"{ours:.3f}; each uniform case at the faster of ours and cuBLAS bmm: {bound:.3f}")
    print("\nFP8 forward, uniform routing: TFLOP/s of our fp8_blockwise grouped GEMM and of "
          "cuBLAS's dense FP8 GEMM of the same size")
    print(f"{'case':28s} {'ours':>5s} {'dense rowwise':>13s} {'dense blockwise':>15s}")
    for r in rows:
        tf = r["tflops"]
        if r["pas"] == "forward fp8":
            print(f"{r['model'] + ' ' + r['proj']:28s} {tf['ours blockwise']:5.0f} "
                  f"{tf.get('cuBLAS dense rowwise', float('nan')):13.0f} "
                  f"{tf.get('cuBLAS dense blockwise', float('nan')):15.0f}")
    if args.json:
        write_json(args.json, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
