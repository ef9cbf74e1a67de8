"""grouped_quantize on the GPU: time, GB/s and fraction of copy bandwidth, and a bitwise check
against the reference, for the new kernels (fused and separate row+column launches) and, when
a module quant_baseline (an earlier version's kernels exposing grouped_quantize_into) is
importable, those kernels too.

    python benchmarks/bench_quantize.py            # all four shapes, ~60-80 s on an H200
    python benchmarks/bench_quantize.py --shapes Mixtral GPT-OSS
    python benchmarks/bench_quantize.py --tiles    # also a few other tiles (graph timings only)

Byte accounting as benchmarks/bench_fp8.py quantize_rows: x read once (2 bytes per element)
plus every output written (data, scales), against a bf16 y.copy_(x) of the same tensor
(4 bytes per element). Columnwise modes are timed three ways: "cuda", what grouped_quantize
runs (for fp8_blockwise the CUDA kernels of csrc/grouped_quantize.cu), and the Triton kernels
with row and column blocks in two launches ("separate") or one ("fused"). Two timings per case:
  eager  cm.grouped_quantize as a user calls it (triton.testing.do_bench; includes the
         op's host overhead, which small shapes may not hide)
  graph  the same call replayed from a CUDA graph (do_bench_cudagraph): GPU time only
The baseline is timed in a graph only (its launcher is called directly).
Group sizes: skewed routing, each group rounded up to 16 rows (as bench_fp8.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import compiled_moe as cm  # noqa: E402
from compiled_moe import reference as R  # noqa: E402
from compiled_moe.ops import fp8 as fp8_ops  # noqa: E402
import common  # noqa: E402
from common import group_counts  # noqa: E402
from helpers import special_values  # noqa: E402  (the quantizer tests' special input)

try:
    import quant_baseline  # noqa: E402
except ImportError:
    quant_baseline = None

# (name, rows = tokens * top_k, hidden, local experts)
SHAPES = [("DeepSeek-V3", 32768, 7168, 32), ("Qwen3", 65536, 2048, 128),
          ("Mixtral", 8192, 4096, 8), ("GPT-OSS", 16384, 2880, 128)]
# (recipe, rowwise, columnwise): the modes of bench_fp8.quantize_rows
MODES = [("fp8_blockwise", True, True), ("fp8_blockwise", True, False),
         ("mxfp8", True, True), ("fp8_rowwise", True, False)]
WARMUP, REP, GRAPH_REP = 10, 30, 20  # ms per timing: the whole run stays under 90 s
DEVICE = "cuda"


def offsets(rows, groups):
    counts = (group_counts(rows, groups, "skewed") + 15) // 16 * 16
    return torch.cumsum(counts, 0).to(torch.int32).to(DEVICE), int(counts.sum())


def bench_eager(fn):
    return triton.testing.do_bench(fn, warmup=WARMUP, rep=REP, return_mode="median") * 1e3


def bench_graph(fn):
    return common.bench_graph(fn, rep=GRAPH_REP) * 1e3


def as_bits(t):
    view = {R.FP8_DTYPE: torch.uint8, torch.float32: torch.int32}.get(t.dtype, t.dtype)
    return t.view(view)


def mismatches(got, want):
    """Elements that differ bit for bit (data as bytes, fp32 scales as bits), per output."""
    bad = []
    for g, w in zip(got, want):
        if g is None:  # a direction not asked for (the reference returns an empty tensor)
            bad.append(0 if w.numel() == 0 else -1)
        elif g.shape != w.shape or g.dtype != w.dtype:
            bad.append(-1)
        else:
            bad.append(int((as_bits(g) != as_bits(w)).sum()))
    return bad


# --tiles: other tiles for some kernels, (mode, fused, quantize_config kind, TileConfig args)
TILE_VARIANTS = [
    (("fp8_blockwise", True, True), True, "group_columns_128_rowwise",
     dict(block_m=128, block_n=128, block_k=1, num_warps=8)),  # one step: 1 program/SM
    (("fp8_blockwise", True, True), True, "group_columns_128_rowwise",
     dict(block_m=128, block_n=128, block_k=1, num_warps=16)),
    (("fp8_blockwise", True, True), True, "group_columns_128_rowwise",
     dict(block_m=32, block_n=128, block_k=1, num_warps=4)),
    (("fp8_blockwise", True, True), False, "group_columns_128",
     dict(block_m=128, block_n=128, block_k=1, num_warps=8)),
    (("fp8_blockwise", True, False), None, "tiles_1x128",
     dict(block_m=4, block_n=1024, block_k=1, num_warps=4)),
    (("fp8_blockwise", True, False), None, "tiles_1x128",
     dict(block_m=16, block_n=1024, block_k=1, num_warps=16)),
    (("mxfp8", True, True), True, "group_columns_32_rowwise",
     dict(block_m=32, block_n=512, block_k=1, num_warps=8)),
    (("mxfp8", True, True), True, "group_columns_32_rowwise",
     dict(block_m=16, block_n=256, block_k=1, num_warps=4)),
    (("fp8_rowwise", True, False), None, "rows",
     dict(block_m=1, block_n=8192, block_k=1, num_warps=16)),
]


def with_tile(kind, tile_args):
    """Make the kernels' launcher take another tile for one quantize_config kind."""
    from compiled_moe.kernels import configs, quantize

    original = configs.quantize_config

    def patched(k, device_type, cols=0):
        if k != kind:
            return original(k, device_type, cols)
        args = dict(tile_args)
        if k == "rows" and args["block_n"] > cols:  # keep whole rows in one tile
            args["block_n"] = max(128, 1 << (cols - 1).bit_length())
        return configs.TileConfig(**args)

    quantize.quantize_config = patched
    return lambda: setattr(quantize, "quantize_config", original)


def run_new(x, offs, recipe, rowwise, columnwise, fused):
    """fused None: what grouped_quantize runs (the CUDA columnwise kernels where they apply);
    True / False: the Triton kernels with rowwise and columnwise in one launch or two."""
    if fused is None:
        os.environ.pop("COMPILED_MOE_QUANTIZE", None)
    else:
        os.environ["COMPILED_MOE_QUANTIZE"] = "triton"
        fp8_ops.FUSE_ROW_AND_COLUMN = ("fp8_blockwise", "mxfp8") if fused else ()
    return cm.grouped_quantize(x, offs, recipe, rowwise=rowwise, columnwise=columnwise)


def run_baseline(x, offs, recipe, rowwise, columnwise, fused):
    outs = fp8_ops._quantize_outputs(x, offs, recipe, rowwise, columnwise)
    quant_baseline.grouped_quantize_into(x, offs, recipe, rowwise, columnwise, outs, fused)
    return outs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", help="substrings of shape names")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--tiles", action="store_true", help="also time TILE_VARIANTS")
    args = p.parse_args()
    assert DEVICE != "cuda" or torch.cuda.is_available(), "needs a GPU"
    start = time.time()
    default_fuse = fp8_ops.FUSE_ROW_AND_COLUMN
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  "
          f"FUSE_ROW_AND_COLUMN default={default_fuse}  baseline="
          f"{'yes' if quant_baseline and not args.no_baseline else 'no'}", flush=True)
    variants = [("new", run_new)]
    if quant_baseline is not None and not args.no_baseline:
        variants.append(("old", run_baseline))
    rows = []
    total_bad = 0
    for name, rows0, hidden, experts in SHAPES:
        if args.shapes and not any(s.lower() in name.lower() for s in args.shapes):
            continue
        torch.manual_seed(0)
        offs, M = offsets(rows0, experts)
        x = torch.randn(M, hidden, device=DEVICE, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_eager = bench_eager(lambda: y.copy_(x))
        copy_graph = bench_graph(lambda: y.copy_(x))
        copy_gbs = (4 * x.numel() / copy_eager / 1e3, 4 * x.numel() / copy_graph / 1e3)
        print(f"{name}: x {M} x {hidden} bf16, {experts} groups; copy: eager {copy_eager:.1f} us "
              f"({copy_gbs[0]:.0f} GB/s), graph {copy_graph:.1f} us ({copy_gbs[1]:.0f} GB/s)",
              flush=True)
        xs = special_values(4096 + 160, hidden, torch.Generator().manual_seed(5))
        xs = xs.to(DEVICE, torch.bfloat16)
        offs_s = offs.clamp(max=xs.shape[0] - 16)  # same groups, cut to the small input
        for recipe, rowwise, columnwise in MODES:
            mode = "row+col" if columnwise else "row"
            fuse_options = (None, False, True) if columnwise else (None,)
            for who, fn in variants:
                for fused in fuse_options:
                    if who != "new" and fused is None:
                        continue
                    label = who + {None: " cuda" * columnwise, False: " separate",
                                   True: " fused"}[fused]
                    call = (lambda: fn(x, offs, recipe, rowwise, columnwise, fused))
                    outs = call()
                    want = R.grouped_quantize(x, offs, recipe, rowwise, columnwise)
                    bad = mismatches(outs, want)
                    bad_s = mismatches(fn(xs, offs_s, recipe, rowwise, columnwise, fused),
                                       R.grouped_quantize(xs, offs_s, recipe, rowwise,
                                                          columnwise))
                    del want
                    nbytes = 2 * x.numel() + sum(t.numel() * t.element_size() for t in outs
                                                 if t is not None)
                    t_eager = bench_eager(call) if who == "new" else float("nan")
                    t_graph = bench_graph(call)
                    gbs = (nbytes / t_eager / 1e3, nbytes / t_graph / 1e3)
                    frac = (gbs[0] / copy_gbs[0], gbs[1] / copy_gbs[1])
                    nbad = sum(max(b, 0) for b in bad + bad_s) + (-1 in bad + bad_s)
                    total_bad += nbad if who == "new" else 0
                    row = dict(shape=name, M=M, K=hidden, recipe=recipe, mode=mode,
                               variant=label, eager_us=t_eager, graph_us=t_graph,
                               gbs=gbs, frac=frac, bad=bad, bad_special=bad_s)
                    rows.append(row)
                    print(f"{name:11s} {M:6d}x{hidden:<5d} {recipe:13s} {mode:7s} "
                          f"{label:13s} eager {t_eager:8.1f} us {gbs[0]:5.0f} GB/s "
                          f"{frac[0]:5.2f} | graph {t_graph:8.1f} us {gbs[1]:5.0f} GB/s "
                          f"{frac[1]:5.2f} | mismatches random {bad} special {bad_s}",
                          flush=True)
        if args.tiles:
            for (recipe, rowwise, columnwise), fused, kind, tile in TILE_VARIANTS:
                restore = with_tile(kind, tile)
                try:
                    call = (lambda: run_new(x, offs, recipe, rowwise, columnwise, fused))
                    outs = call()
                    bad = mismatches(outs, R.grouped_quantize(x, offs, recipe, rowwise,
                                                              columnwise))
                    nbytes = 2 * x.numel() + sum(t.numel() * t.element_size() for t in outs
                                                 if t is not None)
                    t_graph = bench_graph(call)
                finally:
                    restore()
                gbs = nbytes / t_graph / 1e3
                mode = "row+col" if columnwise else "row"
                label = "tile " + ("fused" if fused and columnwise else "")
                rows.append(dict(shape=name, M=M, K=hidden, recipe=recipe, mode=mode,
                                 variant=f"{kind}:{tile['block_m']}x{tile['block_n']}"
                                         f"w{tile['num_warps']}",
                                 eager_us=float("nan"), graph_us=t_graph,
                                 gbs=(float("nan"), gbs), frac=(float("nan"), gbs / copy_gbs[1]),
                                 bad=bad, bad_special=[]))
                print(f"{name:11s} {recipe:13s} {mode:7s} {label:6s} {kind} {tile} graph "
                      f"{t_graph:8.1f} us {gbs:5.0f} GB/s {gbs / copy_gbs[1]:5.2f} | mismatches "
                      f"{bad}", flush=True)
        del x, y
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    fp8_ops.FUSE_ROW_AND_COLUMN = default_fuse
    os.environ.pop("COMPILED_MOE_QUANTIZE", None)
    print("\nfraction of copy bandwidth (eager / graph); mismatching elements (random+special)")
    print(f"{'shape':11s} {'recipe':13s} {'mode':7s} {'variant':13s} {'eager':>6s} "
          f"{'graph':>6s} {'us(g)':>8s} {'bad':>5s}")
    for r in rows:
        nbad = sum(max(b, 0) for b in r["bad"] + r["bad_special"]) + (-1 in r["bad"])
        print(f"{r['shape']:11s} {r['recipe']:13s} {r['mode']:7s} {r['variant']:13s} "
              f"{r['frac'][0]:6.2f} {r['frac'][1]:6.2f} {r['graph_us']:8.1f} {nbad:5d}")
    print(f"\nnew kernels: {total_bad} mismatching elements in all; "
          f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
