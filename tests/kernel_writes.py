"""Which arguments torch's mutation analysis says each Triton kernel of the ops writes.

Run as a script (tests/test_lowering.py does, in a process without TRITON_INTERPRET: the
analysis compiles the kernels to Triton IR, which interpreted kernels cannot give). Every
launcher is called on small CPU tensors with the GPU tile configs; the launches are recorded,
not run, and analysed for an sm_90 target with
``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``, the function that
decides what a compiled graph must copy before a launch. Prints one JSON line: a list of
[kernel name, written arguments, tensor arguments] per distinct launch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Hopper:
    """A Triton driver that only names an sm_90 target: enough to lower kernels to TTIR."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_Hopper())

from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors  # noqa: E402

import compiled_moe.kernels.activations as activations  # noqa: E402
import compiled_moe.kernels.grouped_mm as grouped_mm  # noqa: E402
import compiled_moe.kernels.moe_mlp as moe_mlp  # noqa: E402
import compiled_moe.kernels.quantize as quantize  # noqa: E402
import compiled_moe.kernels.routing as routing  # noqa: E402
import compiled_moe.kernels.scaled_grouped_mm as scaled_grouped_mm  # noqa: E402
import compiled_moe.ops.fp8 as fp8_ops  # noqa: E402

MODULES = (activations, grouped_mm, moe_mlp, quantize, routing, scaled_grouped_mm)
launches: list[tuple] = []


class _Record:
    """Stands in for wrap_triton(kernel): ``[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args))
            named.update((k, v) for k, v in kwargs.items() if k in self.kernel.arg_names)
            launches.append((self.kernel, named))
        return launch


def _gpu_config(fn):
    def config(*args, **kwargs):
        return fn(*("cuda" if a == "cpu" else a for a in args), **kwargs)
    return config


for module in MODULES:
    module.wrap_triton = _Record
    for name in dir(module):
        if name.endswith("_config") and callable(getattr(module, name)):
            setattr(module, name, _gpu_config(getattr(module, name)))
    if hasattr(module, "_num_sms"):
        module._num_sms = lambda device: 132
fp8_ops._kernels = lambda: (quantize, scaled_grouped_mm)


def launch_everything() -> None:
    bf16 = torch.bfloat16
    M, K, N, G, I = 256, 256, 128, 4, 128
    offs = torch.tensor([40, 130, 130, 256], dtype=torch.int32)
    a, b = torch.randn(M, K, dtype=bf16), torch.randn(G, K, N, dtype=bf16)
    d = torch.randn(M, N, dtype=bf16)
    for bias in (None, torch.randn(G, N, dtype=bf16)):
        grouped_mm.grouped_mm(a, b, offs, bias, torch.empty(M, N, dtype=bf16))
        grouped_mm.grouped_mm(a, b.mT.contiguous().mT, offs, bias, torch.empty(M, N, dtype=bf16))
    grouped_mm.grouped_mm_wgrad(a, d, offs, torch.empty(G, K, N, dtype=bf16), accumulate=False,
                                accumulate_mask=None)
    grouped_mm.grouped_mm_wgrad(a, d, offs, torch.zeros(G, K, N), accumulate=True,
                                accumulate_mask=torch.ones(G, dtype=torch.bool))
    grouped_mm.grouped_sum(d, offs, torch.empty(G, N, dtype=bf16))

    T, k = 128, 2
    source = torch.arange(M, dtype=torch.int32)
    w1 = torch.randn(G, 2 * I, K, dtype=bf16)
    for src, probs in ((None, None), (source, torch.rand(M, dtype=bf16))):
        moe_mlp.mlp_fc1(a, src, k, w1, offs, None, probs, torch.empty(M, 2 * I, dtype=bf16),
                        torch.empty(M, I, dtype=bf16), "swiglu", "stacked", 1.702, 7.0)
    h = torch.randn(M, 2 * I, dtype=bf16)
    activations.activation_forward(h, torch.empty(M, I, dtype=bf16), "swiglu", "stacked",
                                   1.702, 7.0)
    activations.activation_backward(torch.randn(M, I, dtype=bf16), h,
                                    torch.empty(M, 2 * I, dtype=bf16), "swiglu", "stacked",
                                    1.702, 7.0, act_out=torch.empty(M, I, dtype=bf16),
                                    probs=torch.rand(M, dtype=bf16), dprobs=torch.empty(M))

    ids = torch.randint(0, G, (T, k))
    routing.route_one_program(ids, G, 16, torch.empty(G, dtype=torch.int32),
                              torch.empty(T * k, dtype=torch.int32),
                              torch.empty(M, dtype=torch.int32), traced=True)
    x = torch.randn(T, K, dtype=bf16)
    routing.gather_rows(x, source, k, torch.empty(M, K, dtype=bf16))
    routing.gather_rows(x, source, k, torch.empty(M, K, dtype=bf16),
                        scale=torch.rand(T * k, dtype=bf16), other=torch.randn(M, K, dtype=bf16),
                        dot=torch.empty(T * k))
    routing.combine_rows(torch.randn(M, K, dtype=bf16), source.view(T, k),
                         torch.empty(T, K, dtype=bf16), torch.rand(T, k, dtype=bf16))

    for recipe in ("fp8_rowwise", "fp8_blockwise", "mxfp8"):
        xq = {}
        for name, t, o in (("x", a, offs), ("d", d, offs), ("w", torch.randn(G, N, K, dtype=bf16),
                                                            None)):
            for rowwise, columnwise in ((True, False), (False, True), (True, True)):
                outs = fp8_ops._quantize_outputs(t, o, recipe, rowwise, columnwise)
                fp8_ops._quantize_into(t, o, recipe, rowwise, columnwise, outs)
                xq[name, rowwise, columnwise] = outs
        xs, ws = xq["x", True, False], xq["w", True, False]
        scaled_grouped_mm.scaled_grouped_mm(xs[0], ws[0].mT, xs[1], ws[1].mT, offs, recipe,
                                            torch.empty(M, N, dtype=bf16))
        xc, dc = xq["x", False, True], xq["d", False, True]
        scaled_grouped_mm.scaled_grouped_mm_wgrad(xc[2], dc[2], xc[3], dc[3], offs, recipe,
                                                  torch.empty(G, K, N, dtype=bf16))


def main() -> None:
    launch_everything()
    found = []
    for kernel, named in launches:
        tensors = sorted(n for n, v in named.items() if isinstance(v, torch.Tensor))
        accesses = identify_accessed_tensors(kernel, named, {})
        writes = sorted(dep.name for dep in accesses.read_writes.writes)
        entry = [kernel.fn.__name__, writes, tensors]
        if entry not in found:
            found.append(entry)
    print(json.dumps(found))


if __name__ == "__main__":
    sys.exit(main())
