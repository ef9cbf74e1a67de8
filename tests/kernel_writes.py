"""Which arguments torch's mutation analysis says each Triton kernel of the ops writes.

Run as a script (tests/test_lowering.py does, in a process without TRITON_INTERPRET: the
analysis compiles the kernels to Triton IR, which interpreted kernels cannot give). The
launches are recorded as scripts/kernel_report.py records them (fake CUDA tensors, so the GPU
tile configs), with more variants of each launcher (biases, gathers, probs, every recipe), and
analysed for an sm_90 target with
``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors`` (``identify_mutated_tensors``
before torch 2.13), the function that
decides what a compiled graph must copy before a launch. Prints one JSON line: a list of
[kernel name, written arguments, tensor arguments] per distinct launch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402

from kernel_report import LAUNCH_OPTIONS, TARGET, record  # noqa: E402


class _Hopper:
    """A Triton driver that only names the sm_90 target: the analysis asks the active driver."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_Hopper())

try:  # torch 2.13 and later
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors  # noqa: E402

    def written(kernel, named) -> list[str]:
        return sorted(dep.name for dep in identify_accessed_tensors(kernel, named, {}).read_writes.writes)
except ImportError:  # torch 2.11 and 2.12: the same analysis, naming the written tensors only
    from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors  # noqa: E402

    def written(kernel, named) -> list[str]:
        return sorted(identify_mutated_tensors(kernel, named, {}))

from compiled_moe.kernels import (activations, grouped_mm, moe_mlp, quantize,  # noqa: E402
                                  routing, scaled_grouped_mm)
from compiled_moe.ops import fp8 as fp8_ops  # noqa: E402


def launch_everything(_model) -> None:
    cuda, bf16, i32 = "cuda", torch.bfloat16, torch.int32
    M, K, N, G, I = 256, 256, 128, 4, 128
    T, k = 128, 2
    offs = torch.empty(G, device=cuda, dtype=i32)
    a, b = torch.empty(M, K, device=cuda, dtype=bf16), torch.empty(G, K, N, device=cuda, dtype=bf16)
    d = torch.empty(M, N, device=cuda, dtype=bf16)
    b_nk = torch.empty(G, N, K, device=cuda, dtype=bf16)
    for bias in (None, torch.empty(G, N, device=cuda, dtype=bf16)):
        grouped_mm.grouped_mm(a, b, offs, bias, torch.empty_like(d))
        grouped_mm.grouped_mm(a, b_nk.mT, offs, bias, torch.empty_like(d))  # nn.Linear layout
    grouped_mm.grouped_mm_wgrad(a, d, offs, torch.empty_like(b), False, None)
    grouped_mm.grouped_mm_wgrad(a, d, offs, torch.empty(G, K, N, device=cuda), True,
                                torch.empty(G, device=cuda, dtype=torch.bool))
    grouped_mm.grouped_sum(d, offs, torch.empty(G, N, device=cuda, dtype=bf16))

    source = torch.empty(M, device=cuda, dtype=i32)
    w1 = torch.empty(G, 2 * I, K, device=cuda, dtype=bf16)
    h = torch.empty(M, 2 * I, device=cuda, dtype=bf16)
    act = torch.empty(M, I, device=cuda, dtype=bf16)
    probs = torch.empty(M, device=cuda, dtype=bf16)
    constants = ("swiglu", "stacked", 1.702, 7.0)
    for src, p in ((None, None), (source, probs)):
        moe_mlp.mlp_fc1(a, src, k, w1, offs, None, p, h, act, *constants)
    activations.activation_forward(h, act, *constants)
    activations.activation_backward(act, h, torch.empty_like(h), *constants,
                                    act_out=torch.empty_like(act), probs=probs,
                                    dprobs=torch.empty(M, device=cuda))

    routing.route_one_program(torch.empty(T, k, device=cuda, dtype=torch.int64), G, 16, offs,
                              torch.empty(T, k, device=cuda, dtype=i32), source, traced=True)

    for recipe in ("fp8_rowwise", "fp8_blockwise", "mxfp8"):
        q = {}
        for name, t, o in (("x", a, offs), ("d", d, offs),
                           ("w", b_nk, None)):
            for rowwise, columnwise in ((True, False), (False, True), (True, True)):
                outs = fp8_ops._quantize_outputs(t, o, recipe, rowwise, columnwise)
                fp8_ops._quantize_into(t, o, recipe, rowwise, columnwise, outs)
                q[name, rowwise, columnwise] = outs
        xs, ws = q["x", True, False], q["w", True, False]
        scaled_grouped_mm.scaled_grouped_mm(xs[0], ws[0].mT, xs[1], ws[1].mT, offs, recipe,
                                            torch.empty_like(d))
        xc, dc = q["x", False, True], q["d", False, True]
        scaled_grouped_mm.scaled_grouped_mm_wgrad(xc[2], dc[2], xc[3], dc[3], offs, recipe,
                                                  torch.empty_like(b))


def main() -> None:
    found = []
    for kernel, args, kwargs in record(None, launch_everything):
        named = dict(zip(kernel.arg_names, args))
        named.update((k, v) for k, v in kwargs.items() if k not in LAUNCH_OPTIONS)
        tensors = sorted(n for n, v in named.items() if isinstance(v, torch.Tensor))
        writes = written(kernel, named)
        entry = [kernel.fn.__name__, writes, tensors]
        if entry not in found:
            found.append(entry)
    print(json.dumps(found))


if __name__ == "__main__":
    sys.exit(main())
