"""Compile the package's Triton kernels for Hopper (sm_90) without a GPU and report, per launch,
the registers a thread, spilled bytes and shared memory, at the tiles the heuristics pick for a
model shape.

The launchers of ``compiled_moe.kernels`` run on fake CUDA tensors (FakeTensorMode); their
launches are recorded instead of run, then compiled by ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` with the argument specialisation Triton's launcher would use
(pointers and integers divisible by 16, integers equal to 1 as constants). Nothing is timed.
Use it to check a tile or kernel change (spills, shared memory beyond the 227 KB a Hopper block
may use, registers that cap programs per SM) before spending GPU time. With the GPU's Triton
version it gives the GPU's figures: on the H200 (Triton 3.6.0) the columnwise quantize kernel
took 254 registers at a 128-column tile and 128 at 64 columns, as here.

    python scripts/kernel_report.py                     # Qwen3-30B-A3B shape
    python scripts/kernel_report.py --model deepseek    # a substring of a model name
    python scripts/kernel_report.py --check             # exit status 1 on a failing launch
    COMPILED_MOE_TILE=128,128,64,8,8,4 python scripts/kernel_report.py   # a forced GEMM tile
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile the kernels, not their interpreted form

import torch  # noqa: E402
import triton  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import MODELS  # noqa: E402

from compiled_moe.kernels import (activations, grouped_mm, moe_mlp, quantize,  # noqa: E402
                                  routing, scaled_grouped_mm)
from compiled_moe.kernels.configs import ROUTE_ONE_PROGRAM_PAIRS  # noqa: E402
from compiled_moe.ops import fp8 as fp8_ops  # noqa: E402
from compiled_moe.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
NUM_SMS = 132  # H100 SXM and H200
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8",
          torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}
MODULES = (activations, grouped_mm, moe_mlp, quantize, routing, scaled_grouped_mm)


class Recorder:
    """Stands in for ``traceable``: ``traceable(kernel)[grid](*args, **kwargs)`` records."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel):
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append((kernel, args, kwargs))

        return _Grid()


def _specialise(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) as Triton's launcher specialises this call."""
    values = dict(zip(kernel.arg_names, args))
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values.get(name, param.default)
        if param.is_constexpr or value is None or isinstance(value, (str, triton.language.dtype)):
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + DTYPES[value.dtype]
            if value.storage_offset() * value.element_size() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[(i,)] = "constexpr", 1
            else:
                signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot specialise {name}={value!r}")
    return signature, constexprs, attrs, options


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, spilled bytes) of a cubin, from the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1


def compile_launch(kernel, args, kwargs) -> dict:
    signature, constexprs, attrs, options = _specialise(kernel, args, kwargs)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=TARGET, options=options)
    regs, spilled = _resources(compiled.asm["cubin"])
    shown = {k[0]: v for k, v in constexprs.items()}
    tiles = {kernel.arg_names[i]: v for i, v in shown.items()
             if kernel.arg_names[i].startswith(("BLOCK", "STEP", "TILES")) and v is not None}
    return {"kernel": kernel.fn.__name__, "tile": tiles, "warps": options.get("num_warps", 4),
            "stages": options.get("num_stages", 3), "registers": regs, "spilled": spilled,
            "shared": compiled.metadata.shared}


def record(model, launch_all=None) -> list:
    """The launches of one forward, dgrad and weight gradient of each op family at a shape, with
    the variants training makes (fp32 main_grad accumulation, fp32 outputs, biases, fp16 and fp32
    inputs to the GEMMs, the fused FC1 and the quantizers, the fused FC1 gathering rows, every FP8
    recipe) (launch_all(model) makes them, on fake CUDA tensors; default: _launch_all)."""
    recorder = Recorder()
    saved = {}
    for module in MODULES:
        for name, stub in (("traceable", recorder), ("_num_sms", lambda index: NUM_SMS)):
            if hasattr(module, name):
                saved[(module, name)] = getattr(module, name)
                setattr(module, name, stub)
    try:
        with FakeTensorMode():
            (launch_all or _launch_all)(model)
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
    return recorder.launches


def _launch_all(model) -> None:
    cuda, bf16 = "cuda", torch.bfloat16
    M, H, I, E = model.tokens * model.top_k, model.hidden, model.inter, model.experts
    offs = torch.empty(E, device=cuda, dtype=torch.int32)
    x = torch.empty(M, H, device=cuda, dtype=bf16)
    w1 = torch.empty(E, 2 * I, H, device=cuda, dtype=bf16)
    h = torch.empty(M, 2 * I, device=cuda, dtype=bf16)
    a = torch.empty(M, I, device=cuda, dtype=bf16)
    grouped_mm.grouped_mm(x, w1.transpose(1, 2), offs, None, h)  # FC1 forward
    grouped_mm.grouped_mm(h, w1, offs, None, torch.empty_like(x))  # FC1 dgrad
    grouped_mm.grouped_mm_wgrad(h, x, offs, torch.empty_like(w1), False, None)  # FC1 wgrad
    # Training's other forms: fp32 main_grad accumulated in place under a mask (TransformerEngine's
    # fuse_wgrad_accumulation), in both layouts; fp32 outputs; a bias; fp16 and fp32 inputs.
    main_grad = torch.empty(E, 2 * I, H, device=cuda, dtype=torch.float32)
    mask = torch.empty(E, device=cuda, dtype=torch.bool)
    grouped_mm.grouped_mm_wgrad(h, x, offs, main_grad, True, mask)
    grouped_mm.grouped_mm_wgrad(x, h, offs, main_grad.transpose(1, 2), True, mask)
    grouped_mm.grouped_mm(x, w1.transpose(1, 2), offs, torch.empty(E, 2 * I, device=cuda, dtype=bf16),
                          torch.empty(M, 2 * I, device=cuda, dtype=torch.float32))
    for dtype in (torch.float16, torch.float32):
        xd, hd, w1d = x.to(dtype), h.to(dtype), w1.to(dtype)
        grouped_mm.grouped_mm(xd, w1d.transpose(1, 2), offs, None, hd)
        grouped_mm.grouped_mm_wgrad(hd, xd, offs, torch.empty_like(w1d), False, None)
    constants = (GPT_OSS_ALPHA, GPT_OSS_LIMIT)
    moe_mlp.mlp_fc1(x, None, 1, w1, offs, None, None, h, a, "swiglu", "stacked", *constants)
    # GPT-OSS's form: interleaved gate/up with b1, rows gathered through the routing map, probs.
    moe_mlp.mlp_fc1(x, torch.empty(M, device=cuda, dtype=torch.int32), model.top_k, w1, offs,
                    torch.empty(E, 2 * I, device=cuda, dtype=bf16),
                    torch.empty(M, device=cuda, dtype=torch.float32), h, a, "gpt_oss",
                    "interleaved", *constants)
    for dtype in (torch.float16, torch.float32):
        moe_mlp.mlp_fc1(x.to(dtype), None, 1, w1.to(dtype), offs, None, None, h.to(dtype),
                        a.to(dtype), "swiglu", "stacked", *constants)
    activations.activation_forward(h, a, "swiglu", "stacked", *constants)
    activations.activation_backward(a, h, torch.empty_like(h), "swiglu", "stacked", *constants)
    # The one-program route at its largest size, for the model's experts.
    pairs = ROUTE_ONE_PROGRAM_PAIRS
    routing.route_one_program(
        torch.empty(pairs // model.top_k, model.top_k, device=cuda, dtype=torch.int64), E, 1,
        offs, torch.empty(pairs // model.top_k, model.top_k, device=cuda, dtype=torch.int32),
        torch.empty(pairs, device=cuda, dtype=torch.int32), traced=True)
    for recipe in ("fp8_blockwise", "mxfp8", "fp8_rowwise"):
        xq, xs, xq_t, xs_t = fp8_ops._quantize_outputs(x, offs, recipe, True, True)
        quantize.quantize_tiles(x, xq, xs, recipe, weight=False)
        quantize.quantize_group_columns(x, offs, xq_t, xs_t, None, None, recipe)
        quantize.quantize_group_columns(x, offs, xq_t, xs_t, xq, xs, recipe)
        wq, ws, _, _ = fp8_ops._quantize_outputs(w1, None, recipe, True, False)
        quantize.quantize_tiles(w1, wq, ws, recipe, weight=True)
        scaled_grouped_mm.scaled_grouped_mm(xq, wq.transpose(1, 2), xs, ws, offs, recipe, h)
        scaled_grouped_mm.scaled_grouped_mm(xq, wq.transpose(1, 2), xs, ws, offs, recipe,
                                            torch.empty(M, 2 * I, device=cuda, dtype=torch.float32),
                                            torch.empty(E, 2 * I, device=cuda, dtype=bf16))
        hq, hs, hq_t, hs_t = fp8_ops._quantize_outputs(h, offs, recipe, True, True)
        scaled_grouped_mm.scaled_grouped_mm_wgrad(hq_t, xq_t, hs_t, xs_t, offs, recipe,
                                                  torch.empty_like(w1))
        for dtype in (torch.float16, torch.float32):  # the quantizers' other inputs
            xd = x.to(dtype)
            xq, xs, xq_t, xs_t = fp8_ops._quantize_outputs(xd, offs, recipe, True, True)
            quantize.quantize_tiles(xd, xq, xs, recipe, weight=False)
            quantize.quantize_group_columns(xd, offs, xq_t, xs_t, xq, xs, recipe)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3", help="a substring of a benchmark model name")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if a launch does not compile or needs more "
                             "shared memory than sm_90 has")
    args = parser.parse_args()
    failures = 0
    model = next(m for m in MODELS if args.model.lower() in m.name.lower())
    print(f"{model.name}: M = {model.tokens * model.top_k}, H = {model.hidden}, "
          f"I = {model.inter}, E = {model.experts}; sm_90, Triton {triton.__version__}")
    print(f"{'kernel':38s} {'tile':44s} {'warps':>5s} {'stages':>6s} {'regs':>5s} "
          f"{'spill B':>7s} {'shared B':>9s}")
    seen = set()
    for kernel, launch_args, kwargs in record(model):
        try:
            row = compile_launch(kernel, launch_args, kwargs)
        except Exception as e:  # a launch that does not compile is a finding too
            print(f"{kernel.fn.__name__:38s} does not compile: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:100]}")
            failures += 1
            continue
        failures += row["shared"] > SHARED_LIMIT
        key = (row["kernel"], str(row["tile"]), row["registers"], row["shared"])
        if key in seen:
            continue
        seen.add(key)
        tile = " ".join(f"{k}={v}" for k, v in row["tile"].items())
        flag = "  over the shared-memory limit" if row["shared"] > SHARED_LIMIT else ""
        print(f"{row['kernel']:38s} {tile:44s} {row['warps']:5d} {row['stages']:6d} "
              f"{row['registers']:5d} {row['spilled']:7d} {row['shared']:9d}{flag}")
    print(f"{len(seen)} distinct launches compiled, {failures} failing")
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
