"""Grouped GEMM benchmark: compiled_moe vs torch._grouped_mm, same process, same inputs.

Every model shape of DESIGN.md section 6 x {uniform, skewed} x {fc1, fc2} x {forward, dgrad,
wgrad}, bf16. Prints ratios (peer time / our time: > 1 means we are faster). "ours" is what the
ops run (on Hopper the CUDA kernels of csrc/grouped_mm.cu); the Triton kernels they replace
(COMPILED_MOE_GEMM=triton) are timed in the same run.

    python benchmarks/bench_grouped_mm.py --json out.json            # the RESULTS.md table
    python benchmarks/bench_grouped_mm.py --sweep --routing uniform  # tile-config sweep
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import MODELS, bench, environment, gmean, interleaved, offsets, write_json  # noqa: E402

import compiled_moe as cm  # noqa: E402
from compiled_moe.kernels import configs  # noqa: E402

PASSES = ("forward", "dgrad", "wgrad")

# Candidate tiles for --sweep: "BM,BN,BK,GROUP_M,warps,stages[,warp_specialize[,ctas_per_sm]]".
SWEEP_MM = ["128,256,64,8,8,3", "128,256,64,8,8,3,2", "128,128,64,8,4,2,0,2",
            "128,128,64,8,8,2,0,2", "64,256,64,8,4,2,0,2", "128,128,64,8,4,2,2,2"]
SWEEP_WGRAD = ["64,256,128,8,8,3", "32,256,128,8,8,4", "64,128,128,8,4,2,0,2",
               "32,128,128,8,4,3,0,2", "64,128,128,8,8,2,0,2", "64,256,128,4,8,3"]


def problem(shape, proj):
    """(M, K, N, G) of a projection: fc1 maps hidden -> 2*inter, fc2 inter -> hidden."""
    rows = shape.tokens * shape.top_k
    if proj == "fc1":
        return rows, shape.hidden, 2 * shape.inter, shape.experts
    return rows, shape.inter, shape.hidden, shape.experts


def make_fns(M, K, N, G, routing):
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    offs = offsets(M, G, routing)
    ours = {
        "forward": lambda: cm.grouped_mm(x, w.transpose(1, 2), offs),
        "dgrad": lambda: cm.grouped_mm(dy, w, offs),
        # The weight gradient in the weight's own (G, N, K) layout.
        "wgrad": lambda: cm.grouped_mm_wgrad(dy, x, offs),
    }
    peer = {
        "forward": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs),
        "dgrad": lambda: torch._grouped_mm(dy, w, offs),
        "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs),
    }
    return ours, peer


def check(ours, peer, name):
    o, p = ours().float(), peer().float()
    err = ((o - p).norm() / p.norm().clamp_min(1e-30)).item()
    if not err < 2e-2:
        raise AssertionError(f"{name}: ours vs torch._grouped_mm relative error {err:.2e}")


def clear_config_caches():
    configs.grouped_mm_config.cache_clear()
    configs.grouped_mm_wgrad_config.cache_clear()


def on_triton(fn):
    """fn with the ops on the Triton kernels (COMPILED_MOE_GEMM=triton) for the call."""
    def run():
        os.environ["COMPILED_MOE_GEMM"] = "triton"
        try:
            return fn()
        finally:
            del os.environ["COMPILED_MOE_GEMM"]
    return run


def run(args):
    rows = []
    for shape in MODELS:
        if args.models and not any(m.lower() in shape.name.lower() for m in args.models):
            continue
        for routing in args.routing:
            for proj in ("fc1", "fc2"):
                M, K, N, G = problem(shape, proj)
                ours, peer = make_fns(M, K, N, G, routing)
                for p in args.passes:
                    name = f"{shape.name} {routing} {proj} {p}"
                    flops = 2.0 * M * N * K
                    check(ours[p], peer[p], name)
                    check(on_triton(ours[p]), peer[p], name + " (Triton)")
                    t = interleaved({"peer": peer[p], "ours": ours[p], "triton": on_triton(ours[p])},
                                    args.rounds)
                    t_peer, t_ours, t_triton = t["peer"], t["ours"], t["triton"]
                    row = {"model": shape.name, "routing": routing, "proj": proj, "pass": p,
                           "M": M, "K": K, "N": N, "G": G, "peer_ms": t_peer,
                           "peer_tflops": flops / t_peer / 1e9}
                    if args.sweep:
                        cands = args.tiles or (SWEEP_WGRAD if p == "wgrad" else SWEEP_MM)
                        sweep = {}
                        for tile in cands + ["heuristic", "heuristic-notma"]:
                            if tile.startswith("heuristic"):
                                os.environ.pop("COMPILED_MOE_TILE", None)
                            else:
                                os.environ["COMPILED_MOE_TILE"] = tile
                            os.environ["COMPILED_MOE_TMA"] = "0" if tile.endswith("notma") else "1"
                            clear_config_caches()
                            try:
                                check(ours[p], peer[p], name)
                                sweep[tile] = bench(ours[p])
                            except Exception as e:  # a tile that does not fit shared memory
                                sweep[tile] = float("inf")
                                print(f"  {tile}: {type(e).__name__}: {str(e)[:120]}")
                        os.environ.pop("COMPILED_MOE_TILE", None)
                        os.environ["COMPILED_MOE_TMA"] = "1"
                        clear_config_caches()
                        row["sweep_ms"] = sweep
                        best = min(sweep, key=sweep.get)
                        row["best_tile"] = best
                        print(f"{name:42s} peer {t_peer:7.3f} ms | best {best} "
                              f"{sweep[best]:7.3f} ms ({t_peer / sweep[best]:.2f}x) | heuristic "
                              f"{sweep['heuristic']:7.3f} ms ({t_peer / sweep['heuristic']:.2f}x)",
                              flush=True)
                    row.update(ours_ms=t_ours, ours_tflops=flops / t_ours / 1e9,
                               speedup=t_peer / t_ours, triton_ms=t_triton,
                               triton_tflops=flops / t_triton / 1e9, vs_triton=t_triton / t_ours)
                    rows.append(row)
                    if not args.sweep:
                        print(f"{name:42s} ours {t_ours:7.3f} ms {row['ours_tflops']:6.0f} TF/s | "
                              f"torch._grouped_mm {t_peer:7.3f} ms {row['peer_tflops']:6.0f} TF/s "
                              f"| {row['speedup']:.2f}x | Triton {row['triton_tflops']:6.0f} TF/s "
                              f"({row['vs_triton']:.2f}x)", flush=True)
                del ours, peer
                torch.cuda.empty_cache()
    return rows


def summary(rows):
    lines = ["", "| model | routing | proj | pass | ours TFLOP/s | torch._grouped_mm TFLOP/s | speedup "
                 "| our Triton TFLOP/s | ours/Triton |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['routing']} | {r['proj']} | {r['pass']} | "
                     f"{r['ours_tflops']:.0f} | {r['peer_tflops']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['triton_tflops']:.0f} | {r['vs_triton']:.2f}x |")
    for p in PASSES:
        s = [r["speedup"] for r in rows if r["pass"] == p]
        if s:
            lines.append(f"\n{p}: geomean {gmean(s):.3f}x, min {min(s):.3f}x over {len(s)} cases")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--routing", nargs="+", default=["uniform", "skewed"])
    ap.add_argument("--passes", nargs="+", default=list(PASSES))
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--tiles", nargs="*", default=None, help="--sweep candidates instead of the lists")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best median of each)")
    args = ap.parse_args()
    env = environment()
    print(env)
    rows = run(args)
    print(summary(rows))
    if args.json:
        write_json(args.json, {"environment": env, "command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
