"""Serving shapes: a few tokens per step, where an expert GEMM is a stream of its weights.

Same GPU, same run, same inputs; bf16; skewed top-k routing (bench_experts.skewed_topk). GPU
time from CUDA-graph replay with the L2 flushed before each replay (triton's do_bench), since a
decoding model reads each layer's weights cold. Two tables:
  gemm:  the grouped GEMM forward of FC1 and FC2 alone: ours, torch._grouped_mm and our Triton
         kernel (COMPILED_MOE_GEMM=triton), and ours without split K. "TB/s" is the bytes of the
         experts that received rows over the time (the H200's HBM3e peak: 4.8 TB/s).
  block: the compiled experts block (moe_experts, its default path) against Hugging Face's
         grouped_mm backend compiled plainly and with backend="compiled_moe".
  fp8:   the FC1/FC2 forward GEMM on FP8 weights quantized beforehand, as FP8 serving runs it
         (activations quantized beforehand too: the GEMM alone): ours fp8_blockwise against
         torch._scaled_grouped_mm rowwise and our bf16 GEMM. "TB/s" is the FP8 weight bytes
         (scales left out) over our time.

    python benchmarks/bench_decode.py [--tables gemm block fp8] [--tokens 1 8 32 128 512] [--models qwen ...]
        [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

import compiled_moe as cm
from compiled_moe.kernels import grouped_mm_sm90 as sm90
from bench_experts import bench_graph, hf_experts_module, skewed_topk
from bench_fp8 import torch_rowwise
from bench_grouped_mm import on_triton
from common import MODELS, environment, graph_of, interleaved, write_json


def serving_gemms(shape, tokens):
    """FC1 and FC2 of `shape` at `tokens` tokens, skewed top-k routing: yields the projection,
    x (tokens * top_k, K) and w (experts, N, K) in bf16, offs, and the experts with rows."""
    ids, _ = skewed_topk(tokens, shape.experts, shape.top_k)
    counts = torch.bincount(ids.flatten(), minlength=shape.experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    active = int((counts > 0).sum())
    for proj, k, n in (("fc1", shape.hidden, 2 * shape.inter), ("fc2", shape.inter, shape.hidden)):
        torch.manual_seed(0)
        x = torch.randn(tokens * shape.top_k, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(shape.experts, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        yield proj, x, w, offs, active
        del x, w
        torch.cuda.empty_cache()


def timed_row(fns, rounds, weight_bytes, **row):
    """The contenders' GPU time (us) from CUDA-graph replay in interleaved rounds, as a table
    row with ours in TB/s of weight_bytes. graph_of calls each fn while it captures, so a
    setting a fn makes at call time (on_triton's) holds for the capture."""
    us = {name: t * 1e3 for name, t in interleaved({n: graph_of(fn).replay for n, fn in fns.items()},
                                                   rounds).items()}
    row.update(weight_mb=weight_bytes / 1e6, ours_tbps=weight_bytes / us["ours"] / 1e6,
               **{f"{n}_us": t for n, t in us.items()})
    return row, us


def gemm_rows(shape, tokens, rounds):
    rows = []
    for proj, x, w, offs, active in serving_gemms(shape, tokens):
        n, k = w.shape[1:]
        out = x.new_empty(x.shape[0], n)
        fns = {"ours": lambda: cm.grouped_mm(x, w.mT, offs),
               "torch": lambda: torch._grouped_mm(x, w.mT, offs),
               # the CUDA kernel without split K (configs.grouped_mm_sm90_split_k)
               "one_range": lambda: sm90.grouped_mm(x, w.mT, offs, None, out, splits=1)}
        fns["triton"] = on_triton(fns["ours"])
        ref = fns["torch"]().float()
        for name in ("ours", "triton", "one_range"):
            got = fns[name]()
            got = out if got is None else got
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{shape.name} T={tokens} {proj} {name}: relative error {err:.2e}"
        r, us = timed_row(fns, rounds, active * n * k * 2, model=shape.name, tokens=tokens, proj=proj,
                          active_experts=active)
        rows.append(r)
        print(f"{shape.name:16s} T={tokens:4d} {proj} experts {active:3d} {r['weight_mb']:7.1f} MB | "
              f"ours {us['ours']:7.1f} us {r['ours_tbps']:5.2f} TB/s | "
              f"torch {us['torch']:7.1f} ({us['torch'] / us['ours']:.2f}x) | "
              f"Triton {us['triton']:7.1f} ({us['triton'] / us['ours']:.2f}x) | "
              f"one k range {us['one_range']:7.1f} ({us['one_range'] / us['ours']:.2f}x)", flush=True)
    return rows


def fp8_rows(shape, tokens, rounds):
    rows = []
    for proj, x, w, offs, active in serving_gemms(shape, tokens):
        n, k = w.shape[1:]
        xq, xs = cm.grouped_quantize(x, offs, "fp8_blockwise")[:2]
        wq, ws = cm.grouped_quantize(w, None, "fp8_blockwise")[:2]
        t_xq, t_xs, t_wq, t_ws = torch_rowwise(x, w)
        fns = {"ours": lambda: cm.scaled_grouped_mm(xq, wq.mT, xs, ws, offs, recipe="fp8_blockwise"),
               "torch": lambda: torch._scaled_grouped_mm(t_xq, t_wq.mT, t_xs, t_ws, offs=offs,
                                                         out_dtype=torch.bfloat16),
               "bf16": lambda: cm.grouped_mm(x, w.mT, offs)}
        ref = fns["bf16"]().float()
        for name in ("ours", "torch"):
            err = ((fns[name]().float() - ref).norm() / ref.norm()).item()
            assert err < 8e-2, f"{shape.name} T={tokens} {proj} {name}: relative error {err:.2e}"
        r, us = timed_row(fns, rounds, active * n * k, model=shape.name, tokens=tokens, proj=proj,
                          active_experts=active)
        rows.append(r)
        print(f"{shape.name:16s} T={tokens:4d} {proj} fp8 {r['weight_mb']:7.1f} MB | "
              f"ours {us['ours']:7.1f} us {r['ours_tbps']:5.2f} TB/s | "
              f"torch rowwise {us['torch']:7.1f} ({us['torch'] / us['ours']:.2f}x) | "
              f"our bf16 {us['bf16']:7.1f} ({us['bf16'] / us['ours']:.2f}x)", flush=True)
    return rows


def block_rows(shape, tokens_list):
    from transformers.integrations.moe import grouped_mm_experts_forward

    torch._dynamo.config.recompile_limit = 64  # one graph per token count and variant
    torch.manual_seed(0)
    mod = hf_experts_module(shape, torch.bfloat16)

    def ours(h, i, w):
        return cm.moe_experts(h, i, w, mod.gate_up_proj, mod.down_proj)

    def hf(h, i, w):
        return grouped_mm_experts_forward(mod, h, i, w)

    variants = {"ours": torch.compile(ours, fullgraph=True, dynamic=False),
                "hf": torch.compile(hf, fullgraph=True, dynamic=False),
                "hf_pass": torch.compile(hf, fullgraph=True, dynamic=False, backend="compiled_moe")}
    rows = []
    for tokens in tokens_list:
        ids, weights = skewed_topk(tokens, shape.experts, shape.top_k)
        weights = weights.to(torch.bfloat16)
        hidden = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        us = {}
        with torch.no_grad():
            ref = variants["hf"](hidden, ids, weights).float()
            for name, fn in variants.items():
                err = (fn(hidden, ids, weights).float() - ref).abs().max().item()
                assert err < 5e-2 * ref.abs().max().item() + 1e-3, f"{shape.name} T={tokens} {name}: {err}"
                us[name] = bench_graph(lambda: fn(hidden, ids, weights)) * 1e3
        r = dict(model=shape.name, tokens=tokens, **{f"{n}_us": t for n, t in us.items()})
        rows.append(r)
        print(f"{shape.name:16s} T={tokens:4d} block | ours {us['ours']:7.1f} us | HF {us['hf']:7.1f} "
              f"({us['hf'] / us['ours']:.2f}x) | HF with the pass {us['hf_pass']:7.1f} "
              f"({us['hf_pass'] / us['ours']:.2f}x)", flush=True)
    del mod
    torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    p.add_argument("--models", nargs="*", default=None, help="substrings of model names")
    p.add_argument("--tables", nargs="+", default=["gemm", "block", "fp8"], choices=["gemm", "block", "fp8"])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (best median of each)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = environment()
    print(f"# {env}")
    models = [m for m in MODELS if not args.models or any(s.lower() in m.name.lower() for s in args.models)]
    gemm, block, fp8 = [], [], []
    for shape in models:
        if "gemm" in args.tables:
            for tokens in args.tokens:
                gemm += gemm_rows(shape, tokens, args.rounds)
        if "fp8" in args.tables:
            for tokens in args.tokens:
                fp8 += fp8_rows(shape, tokens, args.rounds)
        if "block" in args.tables:
            block += block_rows(shape, args.tokens)
    if args.json:
        write_json(args.json, dict(environment=env, gemm=gemm, block=block, fp8=fp8))


if __name__ == "__main__":
    main()
