"""FP8 benchmark: our FP8 grouped GEMMs vs torch._scaled_grouped_mm (rowwise) vs bf16, and
grouped_quantize against copy bandwidth. Same process, same inputs.

Every model shape of DESIGN.md section 6 x {uniform, skewed} x {fc1, fc2}:
  forward  ours blockwise (the CUDA kernel on Hopper), our Triton blockwise kernel, ours
           rowwise, torch._scaled_grouped_mm rowwise, ours bf16
  dgrad    the same
  wgrad    ours blockwise, ours rowwise, ours bf16, torch._grouped_mm bf16
GEMM times exclude quantization (operands are quantized once, as a training step reuses them);
group sizes are rounded to multiples of 16 rows for every contender (routing padding).

    python benchmarks/bench_fp8.py --json out.json
    python benchmarks/bench_fp8.py --deepgemm        # only DeepGEMM's published grouped shapes
    python benchmarks/bench_fp8.py --quantize-only   # only the grouped_quantize table

The grouped_quantize table's fraction of copy bandwidth is GPU time (CUDA-graph replays of the
op and of a bf16 copy); the eager call's time is printed beside it.

--deepgemm times the forward on the shapes of DeepGEMM's published table of grouped GEMMs in
its contiguous layout (README of February 2025: H800, NVCC 12.8, the kernel alone, groups of
equal size), prints that table's TFLOP/s beside ours, and times torch._scaled_grouped_mm rowwise
and our bf16 GEMM in the same run. DeepGEMM itself is not run: its figures are from another GPU
(H800) and another day.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (MODELS, bench, bench_graph, environment, group_counts,  # noqa: E402
                    interleaved, write_json)

import compiled_moe as cm  # noqa: E402
from compiled_moe.kernels import scaled_grouped_mm as triton_fp8  # noqa: E402


def problem(shape, proj):
    rows = shape.tokens * shape.top_k
    if proj == "fc1":
        return rows, shape.hidden, 2 * shape.inter, shape.experts
    return rows, shape.inter, shape.hidden, shape.experts


def padded_offsets(M, G, routing, multiple=16):
    counts = group_counts(M, G, routing)
    counts = (counts + multiple - 1) // multiple * multiple
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), int(counts.sum())


def torch_rowwise(x, w):
    """x (M, K) -> e4m3 + (M,) scales; w (G, N, K) -> e4m3 + (G, N) scales (torch's layout)."""
    xs = x.float().abs().amax(1).clamp_min(1e-12) / 448
    ws = w.float().abs().amax(2).clamp_min(1e-12) / 448
    xq = (x.float() / xs[:, None]).to(torch.float8_e4m3fn)
    wq = (w.float() / ws[:, :, None]).to(torch.float8_e4m3fn)
    return xq, xs, wq, ws


def make_fns(M, K, N, G, routing):
    torch.manual_seed(0)
    offs, M = padded_offsets(M, G, routing)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    q = {}
    for recipe in ("fp8_blockwise", "fp8_rowwise"):
        xq = cm.grouped_quantize(x, offs, recipe, rowwise=True, columnwise=True)
        wq = cm.grouped_quantize(w, None, recipe, rowwise=True, columnwise=True)
        dq = cm.grouped_quantize(dy, offs, recipe, rowwise=True, columnwise=True)
        q[recipe] = (xq, wq, dq)
    t_xq, t_xs, t_wq, t_ws = torch_rowwise(x, w)
    t_dq, t_ds, t_wtq, t_wts = torch_rowwise(dy, w.transpose(1, 2).contiguous())

    def fwd(recipe):
        xq, wq, _ = q[recipe]
        return lambda: cm.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, recipe=recipe)

    def dgrad(recipe):
        _, wq, dq = q[recipe]
        return lambda: cm.scaled_grouped_mm(dq[0], wq[2].mT, dq[1], wq[3], offs, recipe=recipe)

    def triton_blockwise(a, b, a_scale, b_scale):
        """Our Triton kernel for fp8_blockwise (the CUDA kernel replaces it on Hopper)."""
        out = torch.empty(a.shape[0], b.shape[2], device="cuda", dtype=torch.bfloat16)
        def run():
            triton_fp8.scaled_grouped_mm(a, b, a_scale, b_scale, offs, "fp8_blockwise", out)
            return out
        return run

    xb, wb, db = q["fp8_blockwise"]

    def wgrad(recipe):
        xq, _, dq = q[recipe]
        return lambda: cm.scaled_grouped_mm_wgrad(xq[2], dq[2], xq[3], dq[3], offs, recipe=recipe)

    sgm = torch._scaled_grouped_mm
    fns = {
        "forward": {
            "blockwise": fwd("fp8_blockwise"), "rowwise": fwd("fp8_rowwise"),
            "blockwise_triton": triton_blockwise(xb[0], wb[0].mT, xb[1], wb[1]),
            "torch_rowwise": lambda: sgm(t_xq, t_wq.transpose(1, 2), t_xs, t_ws, offs=offs,
                                         out_dtype=torch.bfloat16),
            "bf16": lambda: cm.grouped_mm(x, w.transpose(1, 2), offs),
        },
        "dgrad": {
            "blockwise": dgrad("fp8_blockwise"), "rowwise": dgrad("fp8_rowwise"),
            "blockwise_triton": triton_blockwise(db[0], wb[2].mT, db[1], wb[3]),
            "torch_rowwise": lambda: sgm(t_dq, t_wtq.transpose(1, 2), t_ds, t_wts, offs=offs,
                                         out_dtype=torch.bfloat16),
            "bf16": lambda: cm.grouped_mm(dy, w, offs),
        },
        "wgrad": {
            "blockwise": wgrad("fp8_blockwise"), "rowwise": wgrad("fp8_rowwise"),
            "bf16": lambda: cm.grouped_mm_wgrad(x, dy, offs),
            "torch_bf16": lambda: torch._grouped_mm(x.t(), dy, offs),
        },
    }
    exact = {"forward": fns["forward"]["bf16"], "dgrad": fns["dgrad"]["bf16"],
             "wgrad": fns["wgrad"]["bf16"]}
    return M, fns, exact, (x, offs)


# DeepGEMM's README (February 2025), grouped GEMMs, contiguous layout, H800:
# (groups, rows per group, N, K, TFLOP/s). out (rows, N) = a (rows, K) @ b[g] (N, K)^T.
DEEPGEMM_CONTIGUOUS = [(4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099),
                       (8, 4096, 4096, 7168, 1288), (8, 4096, 7168, 2048, 1093)]


def run_deepgemm_shapes(args):
    rows = []
    for G, m, N, K, published in DEEPGEMM_CONTIGUOUS:
        M, fns, exact, _ = make_fns(G * m, K, N, G, "uniform")
        check({"forward": fns["forward"]}, exact, f"DeepGEMM shape {G}x{m}x{N}x{K}")
        group = {who: fns["forward"][who] for who in ("blockwise", "torch_rowwise", "bf16")}
        times = interleaved(group, args.rounds)
        tf = {who: 2 * M * K * N / t / 1e9 for who, t in times.items()}
        rows.append(dict(groups=G, m=m, N=N, K=K, tflops=tf, deepgemm_h800=published))
        print(f"groups {G} x {m} rows, N {N}, K {K}: ours blockwise {tf['blockwise']:6.0f} "
              f"TFLOP/s (DeepGEMM, H800, published: {published}; ours / theirs "
              f"{tf['blockwise'] / published:.2f}) | torch rowwise {tf['torch_rowwise']:6.0f} | "
              f"our bf16 {tf['bf16']:6.0f}", flush=True)
    return rows


def check(fns, exact, name):
    """Every FP8 contender within FP8 error of our bf16 result (catches a wrong layout)."""
    for pas, group in fns.items():
        ref = exact[pas]().float()
        for who, fn in group.items():
            err = ((fn().float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err < 0.08:
                raise AssertionError(f"{name} {pas} {who}: relative error {err:.3e} vs bf16")


def quantize_rows():
    """grouped_quantize GB/s (bytes read + written) against a bf16 copy of the same tensor. The
    fraction of copy bandwidth is taken on GPU time (both replayed from CUDA graphs); the eager
    call, host time included, is timed too (small shapes are launch-bound there).

    Skewed groups padded to 16 rows; fp8_blockwise rows and columns also on the row multiple
    the FP8 experts block pads groups to (configs.fp8_group_rows: 32 for 32 experts or fewer),
    where that differs: groups on 32 rows give whole 32-byte sectors of col_q."""
    from compiled_moe.kernels.configs import fp8_group_rows

    out = []
    for shape in MODELS:
        tokens = shape.tokens * shape.top_k
        offs16, M = padded_offsets(tokens, shape.experts, "skewed")
        x = torch.randn(M, shape.hidden, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_gbs = 4 * x.numel() / bench_graph(lambda: y.copy_(x)) / 1e6
        cases = [("fp8_blockwise", True, True, 16), ("fp8_blockwise", True, False, 16),
                 ("mxfp8", True, True, 16), ("fp8_rowwise", True, False, 16)]
        block_rows = fp8_group_rows(shape.experts)
        if block_rows != 16:
            cases.insert(1, ("fp8_blockwise", True, True, block_rows))
        for recipe, rowwise, columnwise, multiple in cases:
            # the same rows; groups rounded up to `multiple`, the last ones cut at M
            offs = (offs16 if multiple == 16 else
                    padded_offsets(tokens, shape.experts, "skewed", multiple)[0].clamp_max(M))
            outs = cm.grouped_quantize(x, offs, recipe, rowwise=rowwise, columnwise=columnwise)
            nbytes = 2 * x.numel() + sum(t.numel() * t.element_size() for t in outs
                                         if t is not None)

            def fn():
                cm.grouped_quantize(x, offs, recipe, rowwise=rowwise, columnwise=columnwise)

            t, t_eager = bench_graph(fn), bench(fn)
            gbs = nbytes / t / 1e6
            mode = ("row+col" if columnwise else "row") + ("" if multiple == 16 else f"/{multiple}")
            out.append(dict(model=shape.name, M=M, K=shape.hidden, recipe=recipe, mode=mode,
                            ms=t, gbs=gbs, copy_gbs=copy_gbs, fraction=gbs / copy_gbs,
                            eager_ms=t_eager))
            print(f"quantize {shape.name:16s} {recipe:13s} {mode:7s} {t * 1e3:7.1f} us "
                  f"{gbs:6.0f} GB/s  copy {copy_gbs:6.0f} GB/s  {gbs / copy_gbs:5.2f}  "
                  f"(eager call {t_eager * 1e3:6.1f} us)", flush=True)
    return out


def run(args):
    rows = []
    for shape in MODELS:
        if args.models and not any(m.lower() in shape.name.lower() for m in args.models):
            continue
        for routing in ("uniform", "skewed"):
            for proj in ("fc1", "fc2"):
                M0, K, N, G = problem(shape, proj)
                M, fns, exact, _ = make_fns(M0, K, N, G, routing)
                name = f"{shape.name} {routing} {proj}"
                check(fns, exact, name)
                for pas, group in fns.items():
                    times = interleaved(group, args.rounds)
                    flops = 2 * M * K * N
                    tf = {who: flops / t / 1e9 for who, t in times.items()}
                    peer = times.get("torch_rowwise", times.get("torch_bf16"))
                    row = dict(model=shape.name, routing=routing, proj=proj, pas=pas,
                               M=M, K=K, N=N, G=G, ms=times, tflops=tf,
                               blockwise_vs_peer=peer / times["blockwise"],
                               rowwise_vs_peer=peer / times["rowwise"],
                               blockwise_vs_bf16=times["bf16"] / times["blockwise"])
                    rows.append(row)
                    print(f"{name:36s} {pas:7s} " + " ".join(
                        f"{who}={tf[who]:6.0f}" for who in group) +
                        f"  TFLOP/s | blockwise/peer {row['blockwise_vs_peer']:.2f}x "
                        f"rowwise/peer {row['rowwise_vs_peer']:.2f}x "
                        f"blockwise/bf16 {row['blockwise_vs_bf16']:.2f}x", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--models", nargs="*")
    p.add_argument("--skip-quantize", action="store_true")
    p.add_argument("--quantize-only", action="store_true", help="only the grouped_quantize table")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best median of each)")
    p.add_argument("--deepgemm", action="store_true",
                   help="only the forward on DeepGEMM's published grouped shapes")
    args = p.parse_args()
    if args.deepgemm:
        rows = run_deepgemm_shapes(args)
        if args.json:
            write_json(args.json, {"env": environment(), "deepgemm_shapes": rows})
        return
    rows = [] if args.quantize_only else run(args)
    quant = [] if args.skip_quantize else quantize_rows()
    print("\nsummary (TFLOP/s; ratios are peer time / our time):")
    print(f"{'case':36s} {'pass':7s} {'blockwise':>9s} {'bw_triton':>9s} {'rowwise':>8s} "
          f"{'peer':>8s} {'bw/peer':>8s} {'rw/peer':>8s} {'bw/bf16':>8s}")
    for r in rows:
        peer = r["tflops"].get("torch_rowwise", r["tflops"].get("torch_bf16"))
        print(f"{r['model'] + ' ' + r['routing'] + ' ' + r['proj']:36s} {r['pas']:7s} "
              f"{r['tflops']['blockwise']:9.0f} {r['tflops'].get('blockwise_triton', float('nan')):9.0f} "
              f"{r['tflops']['rowwise']:8.0f} {peer:8.0f} "
              f"{r['blockwise_vs_peer']:8.2f} {r['rowwise_vs_peer']:8.2f} "
              f"{r['blockwise_vs_bf16']:8.2f}")
    if args.json:
        write_json(args.json, {"env": environment(), "gemm": rows, "quantize": quant})


if __name__ == "__main__":
    main()
