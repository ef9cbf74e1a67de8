"""Eager calls: host time per op call, and the eager experts block at serving sizes.

Same process, same inputs. Tables:
  ops:   host time per eager call (CPU timer over calls, no synchronisation; tiny problems, so
         the GPU never holds the host back), interleaved rounds, medians: each op the experts
         block runs, through torch.ops (what a user's direct call and the package's own calls
         pay), against torch._grouped_mm on the same operands.
  block: the eager experts block (moe_experts, no grad) at T tokens, Qwen3-30B-A3B shape,
         against Hugging Face's grouped_mm experts backend, wall time per call (host and GPU
         together, as a decoding model sees it), and forward+backward (the default fused MLP,
         and fused=False) with its GPU kernel time.

  fp8:   the eager experts block's forward+backward with fp8_blockwise GEMMs against the same
         block in bf16, at the four model shapes (T from common.MODELS, skewed routing, weights
         quantized in every call, as a training step without weight caching does); wall time,
         and the GPU's kernel time per step (torch.profiler), which says whether the host or
         the GPU holds the step back.
  generate: Hugging Face generate() tokens/s (eager, greedy) on an 8-layer Qwen3-MoE-shaped
         model (random weights, bf16), experts_implementation "compiled_moe" against
         "grouped_mm" and "eager", batch 1 and 8. (generate_static, asked for by name: the
         same with a static cache, where transformers compiles the decoding step.)

The C++ host layer (on by default with a CUDA build of torch) launches the ops' CUDA kernels;
on a GPU without it they raise.

    python benchmarks/bench_eager.py [--tokens 1 4 16 64 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import compiled_moe as cm
from compiled_moe import host
from bench_experts import hf_experts_module, skewed_topk
from common import MODELS, environment, gpu_us, host_us, timed_rounds, write_json


def wall_us(fn, calls=100):
    return host_us(fn, calls, wall=True)


def interleaved_medians(fns: dict, timer, rounds=9) -> dict:
    """{name: median over common.timed_rounds' interleaved rounds} of timer(fn)."""
    return {name: statistics.median(t) for name, t in timed_rounds(fns, rounds, timer).items()}


def op_rows(device="cuda", calls=300, rounds=9):
    """Host time of one eager call of each op the experts block runs (tiny operands: 256 x 128
    rows in 8 groups, a decode step's routing of 4 tokens, top-8 of 128 experts), through
    torch.ops as a user's direct call and the package's own calls pay it, against
    torch._grouped_mm's on the same operands. device="cpu" runs the same calls on the CPU
    reference (a check of the calls, no figure)."""
    bf = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(256, 128, **bf)
    w = torch.randn(8, 256, 128, **bf)
    offs = torch.arange(1, 9, device=device, dtype=torch.int32) * 32
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(256, 256, **bf)
    ids = torch.randint(0, 128, (4, 8), device=device, dtype=torch.int32)
    _, row_of, source = torch.ops.compiled_moe.moe_route(ids, 128, 1)
    hidden, y = torch.randn(4, 128, **bf), torch.randn(32, 128, **bf)
    weights = torch.softmax(torch.randn(4, 8, device=device), -1)
    h, dh = torch.randn(256, 256, **bf), torch.randn(256, 128, **bf)
    main_grad = torch.zeros(8, 128, 256, device=device)
    w_fp8 = cm.quantize_weight(w)
    x_fp8 = torch.ops.compiled_moe.grouped_quantize(x, offs, "fp8_blockwise", True, True)
    dy_fp8 = torch.ops.compiled_moe.grouped_quantize(dy, offs, "fp8_blockwise", False, True)
    ops = torch.ops.compiled_moe
    fns = {
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w.mT, offs),
        "grouped_mm": lambda: ops.grouped_mm(x, w.mT, offs, None, None),
        "torch._grouped_mm fwd+bwd": lambda: torch._grouped_mm(xg, wg.mT, offs).backward(dy),
        "grouped_mm fwd+bwd": lambda: cm.grouped_mm(xg, wg.mT, offs).backward(dy),
        "grouped_mm_wgrad": lambda: ops.grouped_mm_wgrad(dy, x, offs, None),
        "grouped_mm_wgrad_accumulate_": lambda: ops.grouped_mm_wgrad_accumulate_(main_grad, x, dy, offs, None),
        "grouped_sum": lambda: ops.grouped_sum(dy, offs, None),
        "moe_route": lambda: ops.moe_route(ids, 128, 1),
        "moe_permute": lambda: ops.moe_permute(hidden, row_of, source, None),
        "moe_unpermute": lambda: ops.moe_unpermute(y, row_of, source, weights),
        "moe_activation": lambda: ops.moe_activation(h, "swiglu", "stacked", 1.702, 7.0),
        "moe_activation_backward": lambda: ops.moe_activation_backward(dh, h, "swiglu", "stacked", 1.702, 7.0),
        # rowwise only: an FP8 forward's input; both ways: a training step's (each the C++ kernel
        # of csrc/host/fp8.cpp on sm_90)
        "grouped_quantize rowwise": lambda: ops.grouped_quantize(x, offs, "fp8_blockwise", True, False),
        "grouped_quantize both ways": lambda: ops.grouped_quantize(x, offs, "fp8_blockwise", True, True),
        "scaled_grouped_mm": lambda: ops.scaled_grouped_mm(x_fp8[0], w_fp8[0].mT, x_fp8[1], w_fp8[1], offs,
                                                           "fp8_blockwise", None, None),
        "scaled_grouped_mm_wgrad": lambda: ops.scaled_grouped_mm_wgrad(
            x_fp8[2], dy_fp8[2], x_fp8[3], dy_fp8[3], offs, "fp8_blockwise", None),
        "moe_activation_quantize": lambda: ops.moe_activation_quantize(
            h, offs, "swiglu", "stacked", "fp8_blockwise", None, True, True),
        "fp8_grouped_mm (weight cached)": lambda: cm.fp8_grouped_mm(x, w.mT, offs, weight_fp8=w_fp8),
        "fp8_grouped_mm fwd+bwd (weight cached)": lambda: cm.fp8_grouped_mm(
            xg, wg.mT, offs, weight_fp8=w_fp8).backward(dy),
    }
    us = interleaved_medians(fns, lambda fn: host_us(fn, calls), rounds)
    base = us["torch._grouped_mm"]
    rows = []
    print(f"host time per eager call (us; C++ host layer {'on' if host.cuda_module() else 'off'}; {device})")
    for name, t in us.items():
        ref = us["torch._grouped_mm fwd+bwd"] if "fwd+bwd" in name else base
        print(f"  {name:32s} {t:8.1f}   {t / ref:5.2f}x torch._grouped_mm's")
        rows.append(dict(table="ops", op=name, host_us=t, vs_torch=t / ref))
    return rows


def block_rows(tokens_list):
    from transformers.integrations.moe import grouped_mm_experts_forward

    shape = next(m for m in MODELS if m.name.startswith("Qwen3"))
    torch.manual_seed(0)
    mod = hf_experts_module(shape, torch.bfloat16)
    rows = []
    print(f"eager experts block, {shape.name} (us per call, wall; HF = its grouped_mm backend)")
    for tokens in tokens_list:
        ids, weights = skewed_topk(tokens, shape.experts, shape.top_k)
        weights = weights.to(torch.bfloat16)
        hidden = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ours = cm.moe_experts(hidden, ids, weights, mod.gate_up_proj, mod.down_proj)
            theirs = grouped_mm_experts_forward(mod, hidden, ids, weights)
            err = (ours.float() - theirs.float()).abs().max().item()
            assert err < 5e-2 * theirs.float().abs().max().item() + 1e-3, err
            fwd = interleaved_medians({
                "ours": lambda: cm.moe_experts(hidden, ids, weights, mod.gate_up_proj, mod.down_proj),
                "hf": lambda: grouped_mm_experts_forward(mod, hidden, ids, weights)}, wall_us, rounds=5)
        hidden_g = hidden.clone().requires_grad_()
        dy = torch.randn_like(hidden)
        # ours: the default (up to configs.HOST_BLOCK_MAX_PAIRS pairs, the C++ block: one host
        # call forward, one backward); fused: the fused MLP (its autograd formula and Triton
        # launches in Python); unfused: the Python composition of ops whose CUDA kernels the C++
        # layer launches.
        steps = {
            "ours": lambda: cm.moe_experts(hidden_g, ids, weights, mod.gate_up_proj, mod.down_proj).backward(dy),
            "fused": lambda: cm.moe_experts(hidden_g, ids, weights, mod.gate_up_proj, mod.down_proj,
                                            fused=True).backward(dy),
            "unfused": lambda: cm.moe_experts(hidden_g, ids, weights, mod.gate_up_proj, mod.down_proj,
                                              fused=False).backward(dy),
            "hf": lambda: grouped_mm_experts_forward(mod, hidden_g, ids, weights).backward(dy)}
        both = interleaved_medians(steps, wall_us, rounds=5)
        gpu = {name: gpu_us(fn) for name, fn in steps.items()}  # GPU-bound where it nears the wall
        print(f"  T={tokens:4d} forward: ours {fwd['ours']:8.1f} HF {fwd['hf']:8.1f} ({fwd['hf'] / fwd['ours']:.2f}x)"
              f" | fwd+bwd (GPU): " + " ".join(
                  f"{name} {both[name]:7.1f} ({gpu[name]:7.1f})" + ("" if name == "hf" else f" {both['hf'] / both[name]:.2f}x")
                  for name in steps))
        rows.append(dict(table="block", tokens=tokens, fwd_us=fwd["ours"], hf_fwd_us=fwd["hf"],
                         **{f"{name}_fwd_bwd_us": both[name] for name in steps},
                         **{f"{name}_fwd_bwd_gpu_us": gpu[name] for name in steps}))
    return rows


def fp8_rows(profile=False):
    rows = []
    print("eager experts block forward+backward, fp8_blockwise against bf16: ms per step, wall and "
          "GPU kernel time; fp8 quantizes the weights in each step, fp8 cached takes them from "
          "quantize_weight (once per optimizer step, shared by micro-batches)")
    for shape in MODELS:
        torch.manual_seed(0)
        E, H, inter, T = shape.experts, shape.hidden, shape.inter, shape.tokens
        w1 = (torch.randn(E, 2 * inter, H, device="cuda") * H ** -0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(E, H, inter, device="cuda") * inter ** -0.5).bfloat16().requires_grad_()
        hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids, weights = skewed_topk(T, E, shape.top_k)
        weights = weights.bfloat16()
        dy = torch.randn_like(hidden)
        cached = (cm.quantize_weight(w1), cm.quantize_weight(w2))
        steps = {
            "bf16": lambda: cm.moe_experts(hidden, ids, weights, w1, w2).backward(dy),
            "fp8": lambda: cm.moe_experts(hidden, ids, weights, w1, w2,
                                          fp8_recipe="fp8_blockwise").backward(dy),
            "fp8 cached": lambda: cm.moe_experts(hidden, ids, weights, w1, w2, fp8_recipe="fp8_blockwise",
                                                 fp8_weights=cached).backward(dy)}
        ms = interleaved_medians(steps, lambda fn: wall_us(fn, calls=10) / 1e3, rounds=5)
        gpu = {name: gpu_us(fn) / 1e3 for name, fn in steps.items()}
        print(f"  {shape.name:16s} T={T}: " + " | ".join(
            f"{name} {ms[name]:6.3f} (GPU {gpu[name]:6.3f})" + (
                "" if name == "bf16" else f" {ms['bf16'] / ms[name]:.2f}x") for name in steps))
        rows.append(dict(table="fp8", model=shape.name, tokens=T,
                         **{f"{name.replace(' ', '_')}_ms": ms[name] for name in steps},
                         **{f"{name.replace(' ', '_')}_gpu_ms": gpu[name] for name in steps}))
        if profile and ms["fp8"] > ms["bf16"]:  # which kernels make FP8's GPU time
            for name in ("bf16", "fp8"):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    steps[name]()
                    torch.cuda.synchronize()
                print(f"  kernels of one {name} step, {shape.name}:")
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12,
                                                max_name_column_width=70))
        del w1, w2, hidden, cached
        torch.cuda.empty_cache()
    return rows


def generate_rows(batches=(1, 8), new_tokens=64, layers=8, rounds=3, profile=False, static=False):
    """static: generate(cache_implementation="static"), where transformers compiles the model's
    decoding step (torch.compile, on CUDA) for both backends; the eager backend is left out."""
    import compiled_moe.integrations.transformers  # noqa: F401 (registers "compiled_moe")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         vocab_size=32000, norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    rows = []
    extra = dict(cache_implementation="static") if static else {}
    print(f"generate() tokens/s, {layers}-layer Qwen3-MoE-shaped model, {new_tokens} new tokens, greedy"
          + (", static cache (the decoding step compiled by transformers)" if static else ""))
    for batch in batches:
        prompt = torch.randint(0, cfg.vocab_size, (batch, 16), device="cuda")
        impls = ["compiled_moe", "grouped_mm"] + ([] if static else ["eager"])

        def run(impl):
            def generate():
                model.set_experts_implementation(impl)
                model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0, **extra)
            return generate

        fns = {impl: run(impl) for impl in impls}
        for fn in fns.values():  # warm-up (and, static, the compiles)
            fn()
        secs = interleaved_medians(fns, lambda fn: host_us(fn, 1, wall=True, warmup=0) / 1e6, rounds)
        rates = {impl: batch * new_tokens / t for impl, t in secs.items()}
        if profile:  # where a decode step's host and GPU time go, per implementation
            for impl in ("compiled_moe", "grouped_mm"):
                model.set_experts_implementation(impl)
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   pad_token_id=0)
                print(f"  profile, {impl}, batch {batch}, 16 new tokens:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print(f"  batch {batch}: compiled_moe {rates['compiled_moe']:7.1f} | " + " | ".join(
            f"{impl} {rates[impl]:7.1f} ({rates['compiled_moe'] / rates[impl]:.2f}x)" for impl in impls[1:]))
        rows.append(dict(table="generate_static" if static else "generate", batch=batch,
                         **{f"{k}_tok_s": v for k, v in rates.items()}))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--tables", nargs="+", default=["ops", "block", "fp8", "generate"])
    parser.add_argument("--profile", action="store_true",
                        help="fp8: the kernels of a step where FP8 is slower; generate: torch.profiler's "
                             "top host-time ops per implementation")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    if "ops" in args.tables:
        rows += op_rows()
    if "block" in args.tables:
        rows += block_rows(args.tokens)
    if "fp8" in args.tables:
        rows += fp8_rows(profile=args.profile)
    if "generate" in args.tables:
        rows += generate_rows(profile=args.profile)
    if "generate_static" in args.tables:  # not in the default tables: two compiles of the model
        rows += generate_rows(static=True)
    if args.json:
        write_json(args.json, dict(environment=environment(), host_layer=host.cuda_module() is not None,
                                   COMPILED_MOE_HOST=os.environ.get("COMPILED_MOE_HOST"), rows=rows))


if __name__ == "__main__":
    main()
