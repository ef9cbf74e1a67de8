"""torchtitan's own MoE layer (torchtitan 0.3.0, its router, dispatch, experts and combine) under
three ways of running it, same GPU, same run: eager, plain ``torch.compile`` and
``torch.compile(backend="compiled_moe")`` (the rewrites onto compiled_moe's ops), forward+backward,
bf16, uniform routing by a random router, T tokens. Shapes: Qwen3-30B-A3B (dim 2048, 128 experts,
top 8, hidden 768) and DeepSeek-V3-16B (dim 2048, 64 experts, top 6, hidden 1408, two shared
experts). Prints the rewrite counts of the backend's graph and checks that the compiled steps
do not sync the host (``torch.cuda.set_sync_debug_mode("error")``).

    python benchmarks/bench_torchtitan.py [--tokens 8192] [--models qwen deepseek] [--json out.json]

Needs torchtitan (its MoE layer imports with torch 2.11 and newer): pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser typeguard
"""

from __future__ import annotations

import argparse
import logging

import torch

from common import bench, environment, write_json

SHAPES = {  # name: (dim, experts, top_k, hidden, shared experts' hidden or None)
    "Qwen3-30B-A3B": (2048, 128, 8, 768, None),
    "DeepSeek-V3-16B": (2048, 64, 6, 1408, 2 * 1408),
}


def torchtitan_moe(dim: int, experts: int, top_k: int, hidden: int, shared_hidden: int | None,
                   route_norm: bool = False, device="cuda", dtype=torch.bfloat16, scale=0.02):
    """torchtitan's MoE layer at a shape, built by the config helpers its model definitions use
    (softmax router, shared experts when shared_hidden is set). Built from
    ``torchtitan.models.common`` rather than a model package: the model packages import
    torchtitan's FSDP code, which needs a newer torch than 2.11, the layer does not. Parameters
    random (normal times ``scale``), ``dtype`` on ``device``."""
    from torchtitan.models.common import config_utils as tt

    config = tt.make_moe_config(
        num_experts=experts,
        router=tt.make_router_config(dim=dim, num_experts=experts, gate_param_init={},
                                     top_k=top_k, score_func="softmax", route_norm=route_norm),
        routed_experts=tt.make_routed_experts_config(dim=dim, hidden_dim=hidden,
                                                     num_experts=experts, top_k=top_k,
                                                     param_init={}, comm_backend="standard"),
        shared_experts=None if shared_hidden is None else tt.make_ffn_config(
            dim=dim, hidden_dim=shared_hidden, w1_param_init={}, w2w3_param_init={}))
    torch.manual_seed(0)
    with torch.device(device):
        moe = config.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return moe.to(dtype)


class _Counts(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--models", nargs="*", default=["qwen", "deepseek"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = environment()
    print("#", env)
    log = logging.getLogger("compiled_moe.lowering")
    counts = _Counts()
    log.addHandler(counts)
    log.setLevel(logging.DEBUG)
    rows = []
    print(f"{'model':18s} {'eager ms':>9s} {'compile ms':>11s} {'compiled_moe ms':>16s} "
          f"{'x eager':>8s} {'x compile':>10s}")
    for name, shape in SHAPES.items():
        if not any(m.lower() in name.lower() for m in args.models):
            continue
        moe = torchtitan_moe(*shape)
        x = torch.randn(1, args.tokens, shape[0], device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        grad = torch.randn_like(x)
        torch._dynamo.reset()
        steps = {"eager": moe,
                 "compile": torch.compile(moe, fullgraph=True),
                 "compiled_moe": torch.compile(moe, backend="compiled_moe", fullgraph=True)}

        def step(fn):
            return lambda: fn(x).backward(grad)

        times = {}
        for label, fn in steps.items():
            step(fn)()  # compile, warm up
            if label != "eager":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")  # a host sync inside the step raises
                try:
                    step(fn)()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            times[label] = bench(step(fn))
        rewrites = counts.lines[-1] if counts.lines else "(no rewrite log)"
        row = dict(model=name, tokens=args.tokens, **{f"{k}_ms": v for k, v in times.items()},
                   speedup_vs_eager=times["eager"] / times["compiled_moe"],
                   speedup_vs_compile=times["compile"] / times["compiled_moe"], rewrites=rewrites)
        rows.append(row)
        print(f"{name:18s} {times['eager']:9.3f} {times['compile']:11.3f} {times['compiled_moe']:16.3f} "
              f"{row['speedup_vs_eager']:7.2f}x {row['speedup_vs_compile']:9.2f}x   {rewrites}")
    if args.json:
        write_json(args.json, dict(environment=env, rows=rows))


if __name__ == "__main__":
    main()
