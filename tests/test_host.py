"""CPU tier: the C++ host layer (csrc/host): its build, its registrations, the errors it raises,
its autograd formula, and the package with the layer off or unbuildable.

conftest.py turns the layer on for the whole tier (on a CPU build of torch it is off by
default), so the other tests run grouped_mm's C++ checks and autograd too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import compiled_moe as cm
from compiled_moe import host
from compiled_moe.ops import grouped_mm as grouped_mm_ops
from helpers import random_offsets

pytestmark = pytest.mark.skipif(host.module() is None, reason="the C++ host layer did not build here")


def _registered_in_cpp(op: str, key: str) -> bool:
    """The op's kernel for the dispatch key comes from csrc/host (the dispatcher records the
    registering file)."""
    dump = torch._C._dispatch_dump(f"compiled_moe::{op}")
    return any(line.split(":")[0].split("[")[0] == key and "csrc/host/" in line
               for line in dump.splitlines())


def assert_same_error(python_check, cpp_check, *args):
    """The C++ check raises the Python check's exception type and message, word for word."""
    with pytest.raises((TypeError, ValueError)) as python_error:
        python_check(*args)
    with pytest.raises((TypeError, ValueError)) as cpp_error:
        cpp_check(*args)
    assert type(cpp_error.value) is type(python_error.value)
    assert str(cpp_error.value) == str(python_error.value)


def test_registrations_and_schema():
    assert _registered_in_cpp("grouped_mm", "Autograd")
    assert _registered_in_cpp("grouped_mm", "CUDA") == host.module().has_cuda
    assert not _registered_in_cpp("grouped_mm", "CPU")  # the reference stays the CPU path
    # The weight gradient: its CUDA kernel only; its autograd formula and CPU path are Python's.
    assert _registered_in_cpp("grouped_mm_wgrad", "CUDA") == host.module().has_cuda
    assert not _registered_in_cpp("grouped_mm_wgrad", "Autograd")
    assert "Autograd" in torch._C._dispatch_dump("compiled_moe::grouped_mm_wgrad")
    # The route: its CUDA kernel (the op has no autograd); CPU stays the reference.
    assert _registered_in_cpp("moe_route", "CUDA") == host.module().has_cuda
    assert not _registered_in_cpp("moe_route", "CPU")
    # The in-place weight gradient: its CUDA kernel, and its autograd kernel for CPU and CUDA
    # tensors in place of its custom_op's Python layers (which serve the other devices).
    assert _registered_in_cpp("grouped_mm_wgrad_accumulate_", "CUDA") == host.module().has_cuda
    assert _registered_in_cpp("grouped_mm_wgrad_accumulate_", "AutogradCPU")
    assert _registered_in_cpp("grouped_mm_wgrad_accumulate_", "AutogradCUDA")
    assert not _registered_in_cpp("grouped_mm_wgrad_accumulate_", "ADInplaceOrView")
    assert _registered_in_cpp("grouped_quantize", "CUDA") == host.module().has_cuda
    assert not _registered_in_cpp("grouped_quantize", "CPU")
    assert _registered_in_cpp("scaled_grouped_mm", "CUDA") == host.module().has_cuda
    assert _registered_in_cpp("moe_activation_quantize", "CUDA") == host.module().has_cuda
    assert _registered_in_cpp("scaled_grouped_mm_wgrad", "CUDA") == host.module().has_cuda
    assert not _registered_in_cpp("scaled_grouped_mm", "CPU")
    # The row ops: their CUDA kernels; autograd formulas and CPU paths stay Python's.
    for op in _ROW_OPS:
        assert _registered_in_cpp(op, "CUDA") == host.module().has_cuda, op
        assert not _registered_in_cpp(op, "CPU") and not _registered_in_cpp(op, "Autograd"), op
    assert str(torch.ops.compiled_moe.grouped_mm.default._schema) == (
        "compiled_moe::grouped_mm(Tensor a, Tensor b, Tensor offs, Tensor? bias=None, "
        "ScalarType? out_dtype=None) -> Tensor")


def _bad_grouped_mm_calls():
    a = torch.randn(10, 8)
    w = torch.randn(3, 6, 8)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    bias = torch.randn(3, 6)
    return {
        "a 1-D": (a[0], w.mT, offs, None, None),
        "b 2-D": (a, w[0], offs, None, None),
        "a int": (a.int(), w.mT, offs, None, None),
        "dtypes differ": (a, w.mT.double(), offs, None, None),
        "offs int64": (a, w.mT, offs.long(), None, None),
        "offs too short": (a, w.mT, offs[:2], None, None),
        "offs 2-D": (a, w.mT, offs[None], None, None),
        "K differs": (a, w, offs, None, None),
        "bias shape": (a, w.mT, offs, bias[:2], None),
        "bias 1-D": (a, w.mT, offs, bias[0], None),
        "bias int": (a, w.mT, offs, bias.int(), None),
        "out_dtype": (a, w.mT, offs, None, torch.int32),
        "no groups": (a, w[:0].mT, offs[:0], None, None),
    }


@pytest.mark.parametrize("case", sorted(_bad_grouped_mm_calls()))
def test_errors_are_the_python_checks(case):
    """The C++ checks raise the Python checks' exception types and messages, word for word."""
    args = _bad_grouped_mm_calls()[case]
    assert_same_error(grouped_mm_ops._check_grouped_mm, torch.ops.compiled_moe.grouped_mm, *args)


def _bad_wgrad_calls():
    a = torch.randn(10, 8)
    g = torch.randn(10, 6)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    return {
        "a 1-D": (a[0], g, offs, None),
        "grad_out 3-D": (a, g[None], offs, None),
        "a int": (a.int(), g, offs, None),
        "dtypes differ": (a, g.double(), offs, None),
        "offs int64": (a, g, offs.long(), None),
        "offs 2-D": (a, g, offs[None], None),
        "no groups": (a, g, offs[:0], None),
        "rows differ": (a, g[:9], offs, None),
        "out_dtype": (a, g, offs, torch.int8),
    }


@pytest.mark.parametrize("case", sorted(_bad_wgrad_calls()))
def test_wgrad_errors_are_the_python_checks(case):
    """grouped_mm_wgrad's C++ checks (its CUDA kernel makes them) raise the Python checks'
    exception types and messages, word for word; run here without a GPU."""
    from compiled_moe.ops._dispatch import check_out_dtype

    def python_check(a, g, offs, out_dtype):
        grouped_mm_ops._check_wgrad(a, g, offs)
        check_out_dtype(out_dtype)

    assert_same_error(python_check, host.module().check_grouped_mm_wgrad, *_bad_wgrad_calls()[case])
    good = (torch.randn(10, 8), torch.randn(10, 6), torch.tensor([3, 3, 9], dtype=torch.int32), None)
    host.module().check_grouped_mm_wgrad(*good)  # good arguments pass


def _bad_wgrad_accumulate_calls():
    main, a, g = torch.zeros(3, 8, 6), torch.randn(10, 8), torch.randn(10, 6)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    mask = torch.tensor([True, False, True])
    return {
        "main_grad 2-D": (main[0], a, g, offs, None),
        "main_grad int": (main.int(), a, g, offs, None),
        "main_grad expanded": (torch.zeros(1, 8, 6).expand(3, 8, 6), a, g, offs, None),
        "a 1-D": (main, a[0], g, offs, None),
        "dtypes differ": (main, a, g.double(), offs, None),
        "offs too short": (main, a, g, offs[:2], None),
        "rows differ": (main, a, g[:9], offs, None),
        "main_grad elsewhere": (main.to("meta"), a, g, offs, None),
        "main_grad shape": (main.mT, a, g, offs, None),
        "mask elsewhere": (main, a, g, offs, mask.to("meta")),
        "mask 2-D": (main, a, g, offs, mask[None]),
        "mask int": (main, a, g, offs, mask.int()),
        "mask shape": (main, a, g, offs, mask[:2]),
    }


@pytest.mark.parametrize("case", sorted(_bad_wgrad_accumulate_calls()))
def test_wgrad_accumulate_errors_are_the_python_checks(case):
    """grouped_mm_wgrad_accumulate_'s C++ checks (its CUDA kernel makes them): the Python
    checks' exception types and messages, word for word; run here without a GPU."""
    args = _bad_wgrad_accumulate_calls()[case]
    assert_same_error(grouped_mm_ops._check_wgrad_accumulate, host.module().check_grouped_mm_wgrad_accumulate,
                      *args)
    main, a, g = torch.zeros(3, 8, 6), torch.randn(10, 8), torch.randn(10, 6)
    offs, mask = torch.tensor([3, 3, 9], dtype=torch.int32), torch.tensor([True, False, True])
    host.module().check_grouped_mm_wgrad_accumulate(main, a, g, offs, mask)  # good arguments pass
    host.module().check_grouped_mm_wgrad_accumulate(torch.zeros(3, 6, 8).mT, a, g, offs, None)


def _bad_quantize_calls():
    x, w = torch.randn(10, 256), torch.randn(2, 128, 256)
    offs = torch.tensor([3, 10], dtype=torch.int32)
    return {
        "recipe": (x, offs, "fp4", True, True),
        "x 1-D": (x[0], offs, "fp8_blockwise", True, True),
        "x 4-D": (w[None], None, "fp8_blockwise", True, False),
        "x int": (x.int(), offs, "mxfp8", True, False),
        "no output": (x, offs, "fp8_rowwise", False, False),
        "offs with 3-D x": (w, offs, "fp8_blockwise", True, True),
        "no offs for columns": (x, None, "fp8_blockwise", False, True),
        "offs int64": (x, offs.long(), "fp8_blockwise", True, True),
        "offs 2-D": (x, offs[None], "fp8_blockwise", True, True),
        "no groups": (x, offs[:0], "fp8_blockwise", True, True),
        "offs elsewhere": (x, offs.to("meta"), "fp8_blockwise", True, True),
    }


@pytest.mark.parametrize("case", sorted(_bad_quantize_calls()))
def test_quantize_errors_are_the_python_checks(case):
    """grouped_quantize's C++ checks (its CUDA kernel makes them): the Python checks' exception
    types and messages, word for word; run here without a GPU."""
    from compiled_moe.ops import fp8

    args = _bad_quantize_calls()[case]
    assert_same_error(fp8._check_quantize, host.module().check_grouped_quantize, *args)
    offs = torch.tensor([3, 10], dtype=torch.int32)
    host.module().check_grouped_quantize(torch.randn(10, 256), offs, "fp8_blockwise", True, True)
    host.module().check_grouped_quantize(torch.randn(2, 128, 256), None, "mxfp8", True, True)
    host.module().check_grouped_quantize(torch.randn(10, 256), None, "fp8_rowwise", True, False)


def _scaled_mm_operands(recipe="fp8_blockwise", M=10, K=256, N=192, G=3):
    """Good scaled_grouped_mm arguments: (a, b, a_scale, b_scale, offs) of a recipe."""
    from compiled_moe import reference

    _, ac = reference.fp8_block(recipe)
    br, bc = reference.fp8_block(recipe, weight=True)
    blocks = lambda cols, block: 1 if block == 0 else -(-cols // block)  # noqa: E731
    scale = torch.uint8 if recipe == "mxfp8" else torch.float32
    a = torch.zeros(M, K, dtype=torch.float8_e4m3fn)
    b = torch.zeros(G, N, K, dtype=torch.float8_e4m3fn).mT
    return (a, b, torch.ones(M, blocks(K, ac), dtype=scale), torch.ones(G, -(-N // br), blocks(K, bc), dtype=scale),
            torch.tensor([3, 3, 10], dtype=torch.int32))


def _bad_scaled_mm_calls():
    a, b, a_s, b_s, offs = _scaled_mm_operands()
    r = "fp8_blockwise"
    bias = torch.zeros(3, 192)
    return {
        "recipe": (a, b, a_s, b_s, offs, "fp4", None, None),
        "a 3-D": (a[None], b, a_s, b_s, offs, r, None, None),
        "a bf16": (a.bfloat16(), b, a_s, b_s, offs, r, None, None),
        "b 2-D": (a, b[0], a_s, b_s, offs, r, None, None),
        "b e5m2": (a, b.to(torch.float8_e5m2), a_s, b_s, offs, r, None, None),
        "offs groups": (a, b, a_s, b_s, offs[:2], r, None, None),
        "offs int64": (a, b, a_s, b_s, offs.long(), r, None, None),
        "b_scale elsewhere": (a, b, a_s, b_s.to("meta"), offs, r, None, None),
        "bias elsewhere": (a, b, a_s, b_s, offs, r, None, bias.to("meta")),
        "bias shape": (a, b, a_s, b_s, offs, r, None, bias[:, :5]),
        "bias int": (a, b, a_s, b_s, offs, r, None, bias.int()),
        "K": (a[:, :128], b, a_s, b_s, offs, r, None, None),
        "a column-major": (a.T.contiguous().T, b, a_s, b_s, offs, r, None, None),
        "b N-major": (a, b.contiguous(), a_s, b_s, offs, r, None, None),
        "a_scale dtype": (a, b, a_s.double(), b_s, offs, r, None, None),
        "a_scale 1-D": (a, b, a_s[:, 0], b_s, offs, r, None, None),
        "a_scale shape": (a, b, a_s[:, :1], b_s, offs, r, None, None),
        "b_scale shape": (a, b, a_s, b_s[:, :1], offs, r, None, None),
        "mxfp8 scales": (*_scaled_mm_operands("fp8_blockwise")[:4], offs, "mxfp8", None, None),
        "rowwise scales": (*_scaled_mm_operands("mxfp8")[:4], offs, "fp8_rowwise", None, None),
        "out_dtype": (a, b, a_s, b_s, offs, r, torch.float64, None),
    }


@pytest.mark.parametrize("case", sorted(_bad_scaled_mm_calls()))
def test_scaled_mm_errors_are_the_python_checks(case):
    """scaled_grouped_mm's C++ checks (its CUDA kernel makes them): the Python checks' exception
    types and messages, word for word; good arguments of each recipe pass."""
    from compiled_moe.ops import fp8

    args = _bad_scaled_mm_calls()[case]
    assert_same_error(fp8._check_scaled_mm, host.module().check_scaled_grouped_mm, *args)
    for recipe in ("fp8_blockwise", "fp8_rowwise", "mxfp8"):
        for out_dtype, bias in ((None, None), (torch.float32, torch.zeros(3, 192, dtype=torch.bfloat16))):
            host.module().check_scaled_grouped_mm(*_scaled_mm_operands(recipe), recipe, out_dtype, bias)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise", "mxfp8"])
def test_fp8_grouped_mm_formula_matches_python(recipe):
    """fp8_grouped_mm's C++ autograd function (csrc/host/fp8.cpp) and the Python one
    (compiled_moe/fp8.py's _FP8GroupedMM) give the same output and gradients to the bit: with
    and without a bias and the weight quantized beforehand, for a transposed and a contiguous
    weight, and with only some inputs needing gradients (the bias alone too)."""
    from compiled_moe import fp8

    gen = torch.Generator().manual_seed(5)
    M, K, N, G = 96, 256, 128, 3
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=3)
    grad = torch.randn(M, N, generator=gen)
    for with_bias, cached, transposed, need in ((False, False, True, (1, 1, 0)), (True, True, True, (1, 1, 1)),
                                                (True, False, False, (0, 1, 1)), (False, True, True, (1, 0, 0)),
                                                (True, False, True, (0, 0, 1))):
        a = torch.randn(M, K, generator=gen).requires_grad_(bool(need[0]))
        w = (torch.randn(G, N, K, generator=gen) / K ** 0.5).requires_grad_(bool(need[1]))
        b = w.mT if transposed else w.mT.contiguous().detach().requires_grad_(bool(need[1]))
        bias = torch.randn(G, N, generator=gen).requires_grad_(bool(need[2])) if with_bias else None
        weight_fp8 = cm.quantize_weight(b.mT, recipe) if cached else None
        leaves = [t for t in (a, b if not transposed else w, bias) if t is not None and t.requires_grad]
        got = host.module().fp8_grouped_mm(a, b, offs, bias, recipe, list(weight_fp8 or ()))
        assert "Fp8GroupedMmFunction" in got.grad_fn.name()
        want = fp8._FP8GroupedMM.apply(a, b, offs, bias, recipe, weight_fp8)
        assert torch.equal(got, want)
        for x, y in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
            assert torch.equal(x, y) and x.stride() == y.stride()
    with torch.no_grad():
        assert host.module().fp8_grouped_mm(a, b, offs, None, recipe, []).grad_fn is None


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise", "mxfp8"])
def test_fp8_activation_grouped_mm_formula_matches_python(recipe):
    """fp8_activation_grouped_mm's C++ autograd function (FC2 of the FP8 MLP) and the Python one
    give the same output and gradients to the bit: gated and plain activations, with and
    without probs, a bias and the weight quantized beforehand, gpt_oss with its own constants,
    and with only some inputs needing gradients (the bias alone too)."""
    from compiled_moe import fp8
    from compiled_moe.ops.activations import activation_constants

    gen = torch.Generator().manual_seed(6)
    M, I, N, G = 80, 128, 256, 3
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=3)
    grad = torch.randn(M, N, generator=gen)
    cases = [("swiglu", "stacked", False, False, False, (1, 1, 0, 0)),
             ("gpt_oss", "interleaved", True, True, False, (1, 1, 1, 1)),
             ("relu2", "stacked", True, False, True, (0, 1, 1, 0)),
             ("geglu", "interleaved", False, True, True, (1, 0, 0, 1)),
             ("swiglu", "stacked", True, True, False, (0, 0, 0, 1))]
    for activation, layout, with_probs, with_bias, cached, need in cases:
        n1 = I if activation == "relu2" else 2 * I
        h = torch.randn(M, n1, generator=gen).requires_grad_(bool(need[0]))
        w = (torch.randn(G, N, I, generator=gen) / I ** 0.5).requires_grad_(bool(need[1]))
        probs = torch.rand(M, generator=gen).requires_grad_(bool(need[2])) if with_probs else None
        bias = torch.randn(G, N, generator=gen).requires_grad_(bool(need[3])) if with_bias else None
        weight_fp8 = cm.quantize_weight(w, recipe) if cached else None
        alpha, limit = (1.5, 6.0) if activation == "gpt_oss" else (1.702, 7.0)
        constants = activation_constants(activation, alpha, limit)
        leaves = [t for t in (h, w, probs, bias) if t is not None and t.requires_grad]
        got = host.module().fp8_activation_grouped_mm(h, w.mT, offs, probs, bias, recipe, list(weight_fp8 or ()),
                                                      activation, layout, alpha, limit)
        assert "Fp8ActivationGroupedMmFunction" in got.grad_fn.name()
        want = fp8._FP8ActivationGroupedMM.apply(h, w.mT, offs, probs, bias, recipe, weight_fp8, activation, layout,
                                                 constants)
        assert torch.equal(got, want), activation
        for x, y in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
            assert torch.equal(x, y) and x.dtype == y.dtype, activation


def _bad_fp8_grouped_mm_calls():
    w = torch.randn(3, 128, 256)
    a, offs = torch.randn(10, 256), torch.tensor([3, 3, 10], dtype=torch.int32)
    good = list(cm.quantize_weight(w, "fp8_blockwise"))
    return {
        "recipe": (a, w.mT, offs, None, "fp16", []),
        "a 3-D": (a[None], w.mT, offs, None, "fp8_blockwise", []),
        "b int": (a, w.mT.int(), offs, None, "fp8_blockwise", []),
        "weight data shape": (a, w.mT, offs, None, "fp8_blockwise", [good[2]] + good[1:]),
        "weight scale dtype": (a, w.mT, offs, None, "fp8_blockwise", good[:3] + [good[3].double()]),
        "weight of another recipe": (a, w.mT, offs, None, "mxfp8", good),
        "weight elsewhere": (a, w.mT, offs, None, "fp8_blockwise", good[:1] + [good[1].to("meta")] + good[2:]),
    }


@pytest.mark.parametrize("case", sorted(_bad_fp8_grouped_mm_calls()))
def test_fp8_grouped_mm_errors_are_the_python_checks(case):
    """fp8_grouped_mm's C++ checks: the Python wrapper's exception types and messages, word for
    word (the wrapper itself checks that weight_fp8 is a tuple of 4 tensors)."""
    a, b, offs, bias, recipe, weight_fp8 = _bad_fp8_grouped_mm_calls()[case]
    from compiled_moe import fp8

    assert_same_error(lambda *args: fp8._check_operands("a", a, b, recipe, tuple(weight_fp8) or None),
                      lambda *args: host.module().fp8_grouped_mm(*args), a, b, offs, bias, recipe, weight_fp8)


def _scaled_wgrad_operands(recipe="fp8_blockwise", M=300, P=256, Q=128, G=3):
    """Good scaled_grouped_mm_wgrad arguments: (a_t, d_t, a_scale, d_scale, offs) of a recipe."""
    from compiled_moe import reference

    slots = reference.fp8_column_slots(M, G, recipe)
    scale = torch.uint8 if recipe == "mxfp8" else torch.float32
    return (torch.zeros(P, M, dtype=torch.float8_e4m3fn), torch.zeros(Q, M, dtype=torch.float8_e4m3fn),
            torch.ones(P, slots, dtype=scale), torch.ones(Q, slots, dtype=scale),
            torch.tensor([100, 100, 290], dtype=torch.int32))


def _bad_scaled_wgrad_calls():
    a_t, d_t, a_s, d_s, offs = _scaled_wgrad_operands()
    r = "fp8_blockwise"
    return {
        "recipe": (a_t, d_t, a_s, d_s, offs, "fp8", None),
        "a_t 3-D": (a_t[None], d_t, a_s, d_s, offs, r, None),
        "d_t bf16": (a_t, d_t.bfloat16(), a_s, d_s, offs, r, None),
        "offs 2-D": (a_t, d_t, a_s, d_s, offs[None], r, None),
        "d_scale elsewhere": (a_t, d_t, a_s, d_s.to("meta"), offs, r, None),
        "M": (a_t, d_t[:, :200], a_s, d_s, offs, r, None),
        "a_t rowwise": (a_t.T.contiguous().T, d_t, a_s, d_s, offs, r, None),
        "d_t rowwise": (a_t, d_t.T.contiguous().T, a_s, d_s, offs, r, None),
        "a_scale slots": (a_t, d_t, a_s[:, :2], d_s, offs, r, None),
        "d_scale dtype": (a_t, d_t, a_s, d_s.half(), offs, r, None),
        "rowwise slots": (a_t, d_t, a_s, d_s, offs, "fp8_rowwise", None),
        "mxfp8 dtype": (a_t, d_t, a_s, d_s, offs, "mxfp8", None),
        "out_dtype": (a_t, d_t, a_s, d_s, offs, r, torch.int32),
    }


@pytest.mark.parametrize("case", sorted(_bad_scaled_wgrad_calls()))
def test_scaled_wgrad_errors_are_the_python_checks(case):
    """scaled_grouped_mm_wgrad's C++ checks (its CUDA kernel makes them): the Python checks'
    exception types and messages, word for word; good arguments of each recipe pass."""
    from compiled_moe.ops import fp8

    args = _bad_scaled_wgrad_calls()[case]
    assert_same_error(fp8._check_scaled_wgrad, host.module().check_scaled_grouped_mm_wgrad, *args)
    for recipe in ("fp8_blockwise", "fp8_rowwise", "mxfp8"):
        host.module().check_scaled_grouped_mm_wgrad(*_scaled_wgrad_operands(recipe), recipe, torch.float32)


def _bad_activation_quantize_calls():
    h, offs, probs = torch.randn(10, 256), torch.tensor([3, 3, 10], dtype=torch.int32), torch.rand(10)
    r = "fp8_blockwise"
    return {
        "recipe": (h, offs, "swiglu", "stacked", "int8", None, True, True),
        "h 1-D": (h[0], offs, "swiglu", "stacked", r, None, True, True),
        "activation": (h, offs, "tanh", "stacked", r, None, True, True),
        "layout": (h, offs, "swiglu", "blocked", r, None, True, True),
        "odd columns": (h[:, :255], offs, "geglu", "stacked", r, None, True, True),
        "offs int64": (h, offs.long(), "relu2", "stacked", r, None, True, True),
        "probs 2-D": (h, offs, "swiglu", "stacked", r, probs[None], True, True),
        "probs int": (h, offs, "swiglu", "stacked", r, probs.int(), True, True),
        "probs rows": (h, offs, "swiglu", "stacked", r, probs[:9], True, True),
        "probs elsewhere": (h, offs, "swiglu", "stacked", r, probs.to("meta"), True, True),
        "no output": (h, offs, "silu", "stacked", r, None, False, False),
    }


@pytest.mark.parametrize("case", sorted(_bad_activation_quantize_calls()))
def test_activation_quantize_errors_are_the_python_checks(case):
    """moe_activation_quantize's C++ checks (its CUDA kernel makes them): the Python checks'
    exception types and messages, word for word; good arguments pass."""
    from compiled_moe.ops import fp8

    args = _bad_activation_quantize_calls()[case]
    assert_same_error(fp8._check_activation_quantize, host.module().check_moe_activation_quantize, *args)
    h, offs = torch.randn(10, 256), torch.tensor([3, 3, 10], dtype=torch.int32)
    host.module().check_moe_activation_quantize(h, offs, "gpt_oss", "interleaved", "mxfp8", torch.rand(10), True, False)


_BAD_ROUTES = {
    "ids 1-D": (torch.zeros(8, dtype=torch.int32), 4, 1),
    "ids float": (torch.zeros(2, 4), 4, 1),
    "ids int16": (torch.zeros(2, 4, dtype=torch.int16), 4, 1),
    "no experts": (torch.zeros(2, 4, dtype=torch.int32), 0, 1),
    "too many experts": (torch.zeros(2, 4, dtype=torch.int64), 4097, 1),
    "pad 0": (torch.zeros(2, 4, dtype=torch.int32), 4, 0),
}


@pytest.mark.parametrize("case", sorted(_BAD_ROUTES))
def test_route_errors_are_the_python_checks(case):
    """moe_route's C++ checks (its CUDA kernel makes them): the Python checks' exception types
    and messages, word for word; run here without a GPU."""
    from compiled_moe.ops import routing

    ids, num_experts, pad = _BAD_ROUTES[case]
    assert_same_error(routing._check_route, host.module().check_moe_route, ids, num_experts, pad)
    host.module().check_moe_route(torch.zeros(2, 4, dtype=torch.int64), 4096, 8)  # good arguments pass


_ROW_OPS = ("moe_permute", "moe_unpermute", "moe_unpermute_backward", "moe_activation",
            "moe_activation_backward", "grouped_sum")


def _bad_row_op_calls() -> dict:
    """{case: (the Python check, the C++ check's name, arguments)} of the row ops."""
    from compiled_moe.ops import activations, routing

    T, k, H, rows = 3, 2, 8, 7
    hidden, y = torch.randn(T, H), torch.randn(rows, H)
    row_of = torch.zeros(T, k, dtype=torch.int32)
    source = torch.zeros(rows, dtype=torch.int32)
    w = torch.rand(T, k)
    meta = torch.empty(T, k, dtype=torch.int32, device="meta")
    permute = (routing._check_permute, "check_moe_permute")
    unpermute = (routing._check_unpermute, "check_moe_unpermute")
    unpermute_backward = (routing._check_unpermute_backward, "check_moe_unpermute_backward")
    act = (activations.check_activation_input, "check_moe_activation")
    act_backward = (activations._check_backward, "check_moe_activation_backward")
    grouped_sum = (grouped_mm_ops._check_grouped_sum, "check_grouped_sum")
    h, grad = torch.randn(5, 8), torch.randn(5, 4)
    offs = torch.tensor([2, 5], dtype=torch.int32)
    return {
        "permute hidden 1-D": (*permute, (hidden[0], row_of, source, None)),
        "permute hidden int": (*permute, (hidden.int(), row_of, source, None)),
        "permute row_of int64": (*permute, (hidden, row_of.long(), source, None)),
        "permute row_of 1-D": (*permute, (hidden, row_of[0], source, None)),
        "permute source 2-D": (*permute, (hidden, row_of, source[None], None)),
        "permute source int64": (*permute, (hidden, row_of, source.long(), None)),
        "permute row_of elsewhere": (*permute, (hidden, meta, source, None)),
        "permute tokens differ": (*permute, (hidden[:2], row_of, source, None)),
        "permute scale 1-D": (*permute, (hidden, row_of, source, w[0])),
        "permute scale int": (*permute, (hidden, row_of, source, w.int())),
        "permute scale shape": (*permute, (hidden, row_of, source, w[:2])),
        "permute scale elsewhere": (*permute, (hidden, row_of, source, w.to("meta"))),
        "unpermute rows differ": (*unpermute, (y[:5], row_of, source, None)),
        "unpermute y 3-D": (*unpermute, (y[None], row_of, source, None)),
        "unpermute weights shape": (*unpermute, (y, row_of, source, w[:, :1])),
        "unpermute_backward columns differ": (*unpermute_backward, (hidden[:, :4], y, row_of, source, w)),
        "unpermute_backward tokens differ": (*unpermute_backward, (hidden[:1], y, row_of, source, w)),
        "unpermute_backward y rows": (*unpermute_backward, (hidden, y[:1], row_of, source, w)),
        "activation name": (*act, (h, "swish", "stacked")),
        "activation name quoted": (*act, (h, "it's", "stacked")),
        "activation layout": (*act, (h, "swiglu", "split")),
        "activation odd columns": (*act, (h[:, :7], "geglu", "interleaved")),
        "activation h 3-D": (*act, (h[None], "silu", "stacked")),
        "activation h int": (*act, (h.int(), "silu", "stacked")),
        "activation_backward grad shape": (*act_backward, (grad[:, :3], h, "swiglu", "stacked")),
        "activation_backward grad rows": (*act_backward, (grad, h[:4], "gelu", "stacked")),
        "activation_backward grad int": (*act_backward, (grad.int(), h, "swiglu", "stacked")),
        "activation_backward grad elsewhere": (*act_backward, (grad.to("meta"), h, "swiglu", "stacked")),
        "grouped_sum x 1-D": (*grouped_sum, (h[0], offs, None)),
        "grouped_sum offs int64": (*grouped_sum, (h, offs.long(), None)),
        "grouped_sum offs 2-D": (*grouped_sum, (h, offs[None], None)),
        "grouped_sum no groups": (*grouped_sum, (h, offs[:0], None)),
        "grouped_sum offs elsewhere": (*grouped_sum, (h, offs.to("meta"), None)),
        "grouped_sum out_dtype": (*grouped_sum, (h, offs, torch.int32)),
    }


@pytest.mark.parametrize("case", sorted(_bad_row_op_calls()))
def test_row_op_errors_are_the_python_checks(case):
    """The row ops' C++ checks (their CUDA kernels make them): the Python checks' exception
    types and messages, word for word; run here without a GPU."""
    python_check, cpp_check, args = _bad_row_op_calls()[case]
    assert_same_error(python_check, getattr(host.module(), cpp_check), *args)


def test_row_op_checks_pass_good_arguments():
    m = host.module()
    hidden, y, w = torch.randn(3, 8), torch.randn(7, 8), torch.rand(3, 2)
    row_of, source = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(7, dtype=torch.int32)
    m.check_moe_permute(hidden, row_of, source, w)
    m.check_moe_unpermute(y, row_of, source, None)
    m.check_moe_unpermute_backward(hidden, y, row_of, source, w)
    for activation in ("swiglu", "geglu", "gpt_oss"):
        m.check_moe_activation_backward(torch.randn(5, 4), torch.randn(5, 8), activation, "interleaved")
    m.check_moe_activation_backward(torch.randn(5, 7), torch.randn(5, 7), "relu2", "stacked")
    m.check_grouped_sum(torch.randn(5, 8), torch.tensor([2, 5], dtype=torch.int32), torch.float32)


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_autograd_formula_gradcheck(transposed, with_bias):
    """The C++ formula (dgrad, weight gradient in the weight's storage order, grouped dbias)
    against finite differences, float64 on the reference path; groups with empty ones and rows
    past the last group."""
    torch.manual_seed(0)
    M, K, N, G = 13, 8, 6, 4
    a = torch.randn(M, K, dtype=torch.float64, requires_grad=True)
    w = torch.randn(G, N, K, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(G, N, dtype=torch.float64, requires_grad=True) if with_bias else None
    offs = random_offsets(M, G, empty_groups=1, tail=2)

    def f(a, w, *bias):
        b = w.mT if transposed else w.mT.contiguous()
        return cm.grouped_mm(a, b, offs, bias=bias[0] if bias else None)

    inputs = (a, w) + ((bias,) if with_bias else ())
    assert torch.autograd.gradcheck(f, inputs)
    out = f(*inputs)
    assert "GroupedMmFunction" in out.grad_fn.name()  # the C++ formula's node
    out.sum().backward()
    assert w.grad.stride() == w.stride()  # written in the weight's own layout


def test_autograd_matches_python_formula():
    """The C++ formula and the Python one (the layer off, in a subprocess) give the same
    gradients to the bit on the same inputs."""
    script = textwrap.dedent("""
        import torch, compiled_moe as cm
        torch.manual_seed(1)
        a = torch.randn(11, 8, requires_grad=True)
        w = torch.randn(3, 6, 8, requires_grad=True)
        bias = torch.randn(3, 6, requires_grad=True)
        offs = torch.tensor([2, 2, 9], dtype=torch.int32)
        y = cm.grouped_mm(a, w.mT, offs, bias=bias)
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        torch.save([y.detach(), a.grad, w.grad, bias.grad], OUT)
    """)
    results = []
    for setting in ("1", "0"):
        out = f"{os.environ.get('TMPDIR', '/tmp')}/host_formula_{setting}_{os.getpid()}.pt"
        env = dict(os.environ, COMPILED_MOE_HOST=setting)
        run = subprocess.run([sys.executable, "-c", script.replace("OUT", repr(out))], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        results.append(torch.load(out))
        os.remove(out)
    for with_layer, without in zip(*results):
        assert torch.equal(with_layer, without)


def test_wgrad_accumulate_autograd_kernel():
    """The in-place weight gradient's C++ autograd kernel: the reference's sums in place (masked
    groups kept), main_grad's version bumped (what a saved tensor's check reads), inputs that
    need gradients taken as the custom_op's layers took them (nothing recorded)."""
    from compiled_moe import reference

    torch.manual_seed(0)
    main = torch.randn(3, 6, 8)
    a, g = torch.randn(11, 6, requires_grad=True), torch.randn(11, 8)
    offs, mask = torch.tensor([2, 2, 9], dtype=torch.int32), torch.tensor([True, False, True])
    want = main.clone()
    reference.grouped_mm_wgrad_accumulate_(want, a.detach(), g, offs, mask)
    version = main._version
    torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_(main, a, g, offs, mask)
    assert torch.equal(main, want) and main._version > version
    saved = torch.randn(3, 6, 8, requires_grad=True) * 1  # an in-place write after a save is caught
    y = saved.sin()  # saves its input
    torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_(saved, a.detach(), g, offs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


BLOCK_CASES = [  # (activation, layout, biases, weights need a gradient, w2 a transposed view)
    ("swiglu", "stacked", False, True, False),
    ("gpt_oss", "interleaved", True, True, True),
    ("relu2", "stacked", True, False, False),
    ("geglu", "interleaved", False, False, True),
]


def _block_inputs(activation, biases, weights_grad, transposed_w2, dtype=torch.float64, T=7, H=12, inter=5, E=4,
                  k=2):
    g = torch.Generator().manual_seed(T + E)
    n1 = 2 * inter if activation in ("swiglu", "geglu", "gpt_oss") else inter
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[0, -1] = -1  # a pair for an expert elsewhere: dropped
    hidden = torch.randn(T, H, generator=g, dtype=dtype).requires_grad_()
    weights = torch.softmax(torch.randn(T, k, generator=g, dtype=dtype), -1).requires_grad_(weights_grad)
    w1 = torch.randn(E, n1, H, generator=g, dtype=dtype).requires_grad_()
    w2 = torch.randn(E, H, inter, generator=g, dtype=dtype)
    w2 = (w2.mT.contiguous().mT if transposed_w2 else w2).requires_grad_()
    b1 = torch.randn(E, n1, generator=g, dtype=dtype).requires_grad_() if biases else None
    b2 = torch.randn(E, H, generator=g, dtype=dtype).requires_grad_() if biases else None
    return hidden, ids, weights, w1, w2, b1, b2


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-bias{c[2]}-dw{c[3]}-wT{c[4]}")
def test_experts_block_gradcheck(case):
    """The one-call block's C++ autograd function (csrc/host/ops.cpp's moe_experts): forward and
    every gradient against finite differences, float64 on the ops' CPU kernels; a dropped pair
    (an expert elsewhere) and transposed weights."""
    activation, layout, biases, weights_grad, transposed = case
    hidden, ids, weights, w1, w2, b1, b2 = _block_inputs(activation, biases, weights_grad, transposed)

    def block(hidden, weights, w1, w2, *bias):
        return host.module().moe_experts(hidden, ids, weights, w1, w2, bias[0] if bias else None,
                                         bias[1] if bias else None, activation, layout, 1.702, 7.0)

    inputs = (hidden, weights, w1, w2) + ((b1, b2) if biases else ())
    assert torch.autograd.gradcheck(block, inputs)
    out = block(*inputs)
    assert "ExpertsBlockFunction" in out.grad_fn.name()  # the C++ function's node


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-bias{c[2]}-dw{c[3]}-wT{c[4]}")
def test_experts_block_matches_the_python_composition(case):
    """Forward and gradients of the one-call block equal the Python composition of the same ops
    (moe_experts with fused=False) to the bit in float32, gradients laid out like their
    weights; without gradient it runs no autograd function."""
    activation, layout, biases, weights_grad, transposed = case
    inputs = _block_inputs(activation, biases, weights_grad, transposed, dtype=torch.float32)
    hidden, ids, weights, w1, w2, b1, b2 = inputs
    out = host.module().moe_experts(hidden, ids, weights, w1, w2, b1, b2, activation, layout, 1.702, 7.0)
    ref = cm.moe_experts(hidden, ids, weights, w1, w2, activation=activation, gate_up_layout=layout, b1=b1, b2=b2,
                         fused=False)
    assert torch.equal(out, ref)
    leaves = [t for t in (hidden, weights, w1, w2, b1, b2) if t is not None and t.requires_grad]
    grad = torch.randn_like(out)
    for got, want, leaf in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), leaves):
        assert torch.equal(got, want)
        assert got.stride() == leaf.stride()
    with torch.no_grad():
        no_grad = host.module().moe_experts(hidden, ids, weights, w1, w2, b1, b2, activation, layout, 1.702, 7.0)
    assert no_grad.grad_fn is None and torch.equal(no_grad, out)


def test_layer_off_and_unbuildable(tmp_path):
    """COMPILED_MOE_HOST=0: nothing registered from C++, the Python kernels serve. A layer that
    cannot be built (no compiler): importing warns once, and the Python path serves."""
    script = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch, compiled_moe as cm
            from compiled_moe import host
        dump = torch._C._dispatch_dump("compiled_moe::grouped_mm")
        a, w = torch.randn(5, 4, requires_grad=True), torch.randn(2, 3, 4)
        y = cm.grouped_mm(a, w.mT, torch.tensor([2, 5], dtype=torch.int32))
        y.sum().backward()
        messages = [str(w.message) for w in caught if "host layer" in str(w.message)]
        print(host.module() is None, "csrc/host" in dump, len(messages), tuple(a.grad.shape) == (5, 4))
    """)
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, COMPILED_MOE_HOST="0"))
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.split() == ["True", "False", "0", "True"], off.stdout
    broken = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, COMPILED_MOE_HOST="1", CXX=str(tmp_path / "no-such-compiler"),
                                     COMPILED_MOE_CACHE_DIR=str(tmp_path)))
    assert broken.returncode == 0, broken.stderr[-3000:]
    assert broken.stdout.split() == ["True", "False", "1", "True"], broken.stdout


def test_builds_without_cuda_h(tmp_path):
    """Without cuda.h the layer builds without its CUDA kernels (checks and autograd only), as
    on a machine with no nvidia-cuda-runtime headers; its checks still raise the Python
    messages. (Built under another name into tmp_path: the package's own build stays loaded.)"""
    from torch.utils import cpp_extension

    m = cpp_extension.load(name="compiled_moe_host_no_cuda", sources=[str(s) for s in host.sources()],
                           build_directory=str(tmp_path), extra_cflags=["-O2"], extra_ldflags=["-ldl"])
    if m.has_cuda:
        pytest.skip("this compiler finds cuda.h on its default include paths")
    a, g = torch.randn(10, 8), torch.randn(9, 6)
    with pytest.raises(ValueError, match="a has 10 rows but grad_out has 9; they must match"):
        m.check_grouped_mm_wgrad(a, g, torch.tensor([3, 3, 9], dtype=torch.int32), None)


def test_compile_dynamic_one_compile_through_the_cpp_formula():
    """The C++ checks read sizes as SymInts: a dynamic compile of forward+backward stays one
    graph for every token count (an int size there pinned the token count)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    w = torch.randn(4, 24, 16, requires_grad=True)

    def step(x, offs):
        return cm.grouped_mm(x, w.mT, offs).relu().sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for M in (23, 40):
        x = torch.randn(M, 16, requires_grad=True)
        compiled(x, random_offsets(M, 4, empty_groups=1, tail=2)).backward()
    # (the failing guards, where it recompiled: with opt_einsum installed, the reference's
    # three-operand einsum once pinned the token count)
    assert counter.frame_count == 1, dict(torch._dynamo.utils.guard_failures)


# ------------------------------------------------------------------ the plans' boundary

_PLAN_MODULES = {  # plan -> (module, attribute) of the Python side that builds it
    "GroupedMmPlan": ("compiled_moe.kernels.grouped_mm_sm90", "GroupedMmPlan"),
    "GroupedMmWgradPlan": ("compiled_moe.kernels.grouped_mm_sm90", "GroupedMmWgradPlan"),
    "ScaledGroupedMmPlan": ("compiled_moe.kernels.scaled_grouped_mm_sm90", "ScaledGroupedMmPlan"),
    "ScaledGroupedMmWgradPlan": ("compiled_moe.kernels.scaled_grouped_mm_sm90",
                                 "ScaledGroupedMmWgradPlan"),
    "QuantizeColumnsPlan": ("compiled_moe.kernels.quantize_cuda", "QuantizeColumnsPlan"),
    "QuantizeRowsPlan": ("compiled_moe.kernels.quantize_cuda", "QuantizeRowsPlan"),
}
_LIMITS = {"int": 2**31 - 1, "unsigned": 2**32 - 1, "int64_t": 2**63 - 1, "CUfunction": 2**63 - 1}


def _cuda_layer():
    if not host.module().has_cuda:
        pytest.skip("the layer built without cuda.h: it reads no plans")
    return host.module()


def test_every_plan_is_built_from_plans_h():
    """Each plan type the launchers build is the one parsed from csrc/host/plans.h, and every
    plan there has a builder here."""
    import importlib

    assert set(host.plan_fields()) == set(_PLAN_MODULES)
    for name, (module, attribute) in _PLAN_MODULES.items():
        plan_type = getattr(importlib.import_module(module), attribute)
        assert plan_type is host.plan_type(name)
        assert plan_type._fields == tuple(field for _, field in host.plan_fields()[name])
        assert {t for t, _ in host.plan_fields()[name]} <= set(_LIMITS), name


@pytest.mark.parametrize("name", sorted(_PLAN_MODULES))
def test_plan_round_trips_through_the_layer(name):
    """The layer reads every field of every plan by name, into a C++ type that holds the
    largest value of its declared type: distinct values, then each field's maximum, come back
    as sent."""
    layer = _cuda_layer()
    fields = host.plan_fields()[name]
    plan_type = host.plan_type(name)
    distinct = plan_type(**{field: 1000 + 7 * i for i, (_, field) in enumerate(fields)})
    assert layer.read_plan(name, distinct) == distinct._asdict()
    largest = plan_type(**{field: _LIMITS[t] for t, field in fields})
    assert layer.read_plan(name, largest) == largest._asdict()


def test_plan_field_errors_name_the_field():
    """A plan without a field the layer reads, or a value its C++ type cannot hold, raises
    with the plan's and the field's names (not a shifted read)."""
    layer = _cuda_layer()
    fields = host.plan_fields()["GroupedMmPlan"]
    values = {field: 1 for _, field in fields}
    shorter = host.plan_type("GroupedMmWgradPlan")(**{f: 1 for _, f in host.plan_fields()["GroupedMmWgradPlan"]})
    with pytest.raises(TypeError, match="GroupedMmPlan has no field 'split_sum'"):
        layer.read_plan("GroupedMmPlan", shorter)
    too_big = host.plan_type("GroupedMmPlan")(**{**values, "num_stages": 2**31})
    with pytest.raises(ValueError, match=r"GroupedMmPlan.num_stages = 2147483648 does not fit"):
        layer.read_plan("GroupedMmPlan", too_big)
    negative = host.plan_type("GroupedMmPlan")(**{**values, "grid": -1})
    with pytest.raises(ValueError, match=r"GroupedMmPlan.grid = -1 does not fit"):
        layer.read_plan("GroupedMmPlan", negative)
    with pytest.raises(ValueError, match="no plan NoSuchPlan"):
        layer.read_plan("NoSuchPlan", shorter)
