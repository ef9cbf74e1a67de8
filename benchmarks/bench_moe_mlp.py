"""The fused expert MLP against the unfused path and Hugging Face's grouped_mm backend.

Same GPU, same run, same module and inputs (bf16, skewed routing, Qwen3-30B-A3B at T = 8192
and the other shapes at their table's token count), all three under
torch.compile(fullgraph=True):
  fused:    compiled_moe.moe_experts(..., fused=True)
  unfused:  compiled_moe.moe_experts(..., fused=False)  (permute, grouped_mm, moe_activation, ...)
  HF:       transformers' grouped_mm_experts_forward on a Qwen3MoeExperts module
Reported: forward and forward+backward time; peak memory of forward+backward above the inputs
(the weight gradients included: at Qwen3's shape they are 1.2 GB of the 1.6 GB peak); memory
held between forward and backward; the number of GPU kernels one forward launches
(torch.profiler, eager and compiled).

    python benchmarks/bench_moe_mlp.py [--models qwen ...] [--tokens N] [--json out.json]
                                       [--profile]   (per-kernel GPU time of fused and unfused)
                                       [--kernels]   (the fused kernels vs the unfused ops)
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import compiled_moe as cm
from bench_lowering import _fwd_bwd, _hf_problem, profile_step
from common import MODELS, bench, environment, write_json


def _variants(mod):
    from transformers.integrations.moe import grouped_mm_experts_forward

    def fused(h, i, w):
        return cm.moe_experts(h, i, w, mod.gate_up_proj, mod.down_proj, fused=True)

    def unfused(h, i, w):
        return cm.moe_experts(h, i, w, mod.gate_up_proj, mod.down_proj, fused=False)

    def hf(h, i, w):
        return grouped_mm_experts_forward(mod, h, i, w)

    return {"fused": fused, "unfused": unfused, "hf": hf}


def peak_mib(step) -> float:
    """Peak memory of one call of step above what was allocated before it, MiB."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def saved_mib(fn) -> float:
    """Memory held from the end of a forward to its backward (what autograd keeps, plus the
    output), MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del out
    return held / 2**20


def kernels_per_call(fn) -> int:
    """GPU kernels one call launches (memsets and copies not counted)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not any(s in e.name.lower() for s in ("memset", "memcpy")))


def kernel_rows(models, tokens_override):
    """The fused kernels against the unfused ops doing the same work, one shape at a time:
    FC1 + activation, and moe_mlp_fc2_dgrad against grouped_mm dgrad + moe_activation_backward
    + moe_activation."""
    from compiled_moe.kernels import moe_mlp as kernels
    from common import offsets

    ops = torch.ops.compiled_moe
    rows = []
    for shape in models:
        tokens = tokens_override or (8192 if shape.name.startswith("Qwen3") else shape.tokens)
        act, layout = ("gpt_oss", "interleaved") if shape.name.startswith("GPT") else ("swiglu", "stacked")
        m, e, hid, inter = tokens * shape.top_k, shape.experts, shape.hidden, shape.inter
        torch.manual_seed(0)
        mk = lambda *s, scale=1.0: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * scale  # noqa: E731
        x, dy = mk(m, hid), mk(m, hid)
        offs = offsets(m, e, "skewed")
        w1, w2 = mk(e, 2 * inter, hid, scale=hid ** -0.5), mk(e, hid, inter, scale=inter ** -0.5)
        probs = torch.rand(m, device="cuda")
        h = cm.grouped_mm(x, w1.mT, offs)
        a = x.new_empty(m, inter)
        extra = (act, layout, 1.702, 7.0)
        r = dict(model=shape.name, rows=m, activation=act, gate_up_layout=layout)
        r["fc1_fused_us"] = bench(lambda: kernels.mlp_fc1(x, None, 1, w1, offs, None, None, h, a,
                                                          *extra)) * 1e3
        r["fc1_unfused_us"] = bench(lambda: ops.moe_activation(cm.grouped_mm(x, w1.mT, offs),
                                                               act, layout)) * 1e3
        r["fc1_gemm_us"] = bench(lambda: cm.grouped_mm(x, w1.mT, offs)) * 1e3
        r["dgrad_fused_us"] = bench(lambda: ops.moe_mlp_fc2_dgrad(dy, w2, h, offs, None,
                                                                  *extra)) * 1e3
        r["dgrad_fused_probs_us"] = bench(lambda: ops.moe_mlp_fc2_dgrad(dy, w2, h, offs, probs,
                                                                        *extra)) * 1e3
        r["dgrad_unfused_us"] = bench(lambda: (
            ops.moe_activation_backward(cm.grouped_mm(dy, w2, offs), h, *extra),
            ops.moe_activation(h, act, layout))) * 1e3
        rows.append(r)
        print(f"{shape.name:16s} M={m:6d} {act:8s} | FC1+act fused {r['fc1_fused_us']:8.1f} us "
              f"unfused {r['fc1_unfused_us']:8.1f} (GEMM {r['fc1_gemm_us']:.1f}) | FC2 dgrad+act bwd fused "
              f"{r['dgrad_fused_us']:8.1f} ({r['dgrad_fused_probs_us']:.1f} with probs) unfused "
              f"{r['dgrad_unfused_us']:8.1f}")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="*", default=None, help="substrings of model names")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--kernels", action="store_true",
                   help="only the fused kernels against the unfused ops doing the same work")
    args = p.parse_args()
    env = environment()
    models = [m for m in MODELS
              if not args.models or any(s.lower() in m.name.lower() for s in args.models)]
    print(f"# {env}")
    if args.kernels:
        rows = kernel_rows(models, args.tokens)
        if args.json:
            write_json(args.json, dict(environment=env, kernels=rows))
        return
    rows = []
    for shape in models:
        tokens, mod, hidden, ids, weights, grad = _hf_problem(shape, args.tokens)
        eager = _variants(mod)
        compiled = {n: torch.compile(f, fullgraph=True) for n, f in eager.items()}
        with torch.no_grad():
            ref = compiled["hf"](hidden, ids, weights).float()
            errs = {n: (f(hidden, ids, weights).float() - ref).abs().max().item()
                    for n, f in compiled.items()}
        if args.profile:
            for n in ("fused", "unfused"):
                profile_step(f"{shape.name} T={tokens} fwd+bwd {n}",
                             _fwd_bwd(compiled[n], mod, hidden, ids, weights, grad))
            continue
        r = dict(model=shape.name, tokens=tokens, max_abs_diff_vs_hf=errs)
        for n, fn in compiled.items():
            with torch.no_grad():
                r[f"{n}_fwd_ms"] = bench(lambda: fn(hidden, ids, weights))
                r[f"{n}_kernels_fwd_compiled"] = kernels_per_call(lambda: fn(hidden, ids, weights))
                r[f"{n}_kernels_fwd_eager"] = kernels_per_call(lambda: eager[n](hidden, ids, weights))
            step = _fwd_bwd(fn, mod, hidden, ids, weights, grad)
            r[f"{n}_fwd_bwd_ms"] = bench(step)
            r[f"{n}_peak_mib"] = peak_mib(step)
            r[f"{n}_saved_mib"] = saved_mib(lambda: fn(hidden, ids, weights))
        rows.append(r)
    if args.profile:
        return
    print(f"\n{'model':16s} {'T':>5s} | {'fwd ms: fused':>13s} {'unfused':>8s} {'HF':>7s} "
          f"{'xunf':>5s} {'xHF':>5s} | {'fwd+bwd: fused':>14s} {'unfused':>8s} {'HF':>7s} "
          f"{'xunf':>5s} {'xHF':>5s} | {'peak MiB: fused':>15s} {'unfused':>8s} {'HF':>7s} "
          f"{'/HF':>5s} | {'saved MiB: fused':>16s} {'unfused':>8s} {'HF':>7s} "
          f"| kernels/fwd (compiled, eager): fused unfused HF")
    for r in rows:
        f, u, h = (r[f"{n}_fwd_ms"] for n in ("fused", "unfused", "hf"))
        fb, ub, hb = (r[f"{n}_fwd_bwd_ms"] for n in ("fused", "unfused", "hf"))
        fm, um, hm = (r[f"{n}_peak_mib"] for n in ("fused", "unfused", "hf"))
        fs, us, hs = (r[f"{n}_saved_mib"] for n in ("fused", "unfused", "hf"))
        kern = " ".join(f"{r[f'{n}_kernels_fwd_compiled']},{r[f'{n}_kernels_fwd_eager']}"
                        for n in ("fused", "unfused", "hf"))
        print(f"{r['model']:16s} {r['tokens']:5d} | {f:13.3f} {u:8.3f} {h:7.3f} {u / f:4.2f}x "
              f"{h / f:4.2f}x | {fb:14.3f} {ub:8.3f} {hb:7.3f} {ub / fb:4.2f}x {hb / fb:4.2f}x | "
              f"{fm:15.0f} {um:8.0f} {hm:7.0f} {fm / hm:5.2f} | {fs:16.0f} {us:8.0f} {hs:7.0f} "
              f"| {kern}")
    if args.json:
        write_json(args.json, dict(environment=env, moe_mlp=rows))


if __name__ == "__main__":
    main()
