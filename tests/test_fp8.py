"""CPU tier of the FP8 ops: reference quantizers against a block-by-block oracle, the Triton
kernels under the interpreter against the reference, GEMMs against float64, autograd, opcheck,
torch.compile and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

import compiled_moe as cm
from compiled_moe import reference as R
from helpers import loop_bounds, random_offsets, special_values

RECIPES = R.FP8_RECIPES


# ------------------------------------------------------------------ independent oracle


def oracle_block(values: torch.Tensor, recipe: str):
    """(scale, data) of one block by the documented rule, with Python floats for the exponent."""
    v = values.double().flatten()
    finite = bool(torch.isfinite(v).all())
    amax = v.abs().max().item() if v.numel() else 0.0
    if recipe == "mxfp8":
        if not finite:
            return 255, torch.where(torch.isfinite(v), 0.0, float("nan"))
        amax32 = float(torch.tensor(amax, dtype=torch.float32))
        e = -127
        while 448.0 * 2.0 ** e < amax32 and e < 127:  # the smallest power of two that fits
            e += 1
        q = (v * 2.0 ** -e).clamp(-448, 448)
        return e + 127, q
    if not finite:
        return float("inf"), torch.where(torch.isfinite(v), 0.0, float("nan"))
    amax32 = torch.tensor(amax, dtype=torch.float32)
    scale = torch.tensor(1.0) if amax == 0 else amax32 / torch.tensor(448.0)
    q = (v.float() / scale).clamp(-448, 448)
    return scale.item(), q


def oracle_rows(x2: torch.Tensor, block_cols: int, recipe: str):
    """Rowwise quantization of a 2-D tensor block by block: (data fp64 values, scale list)."""
    rows, cols = x2.shape
    bc = cols if block_cols == 0 else block_cols
    data = torch.empty(rows, cols, dtype=torch.float64)
    scales = []
    for r in range(rows):
        row_scales = []
        for c0 in range(0, max(cols, 1), max(bc, 1)):
            s, q = oracle_block(x2[r, c0:c0 + bc], recipe)
            data[r, c0:c0 + bc] = q.to(R.FP8_DTYPE).double()
            row_scales.append(s)
        scales.append(row_scales)
    return data, scales


def as_values(scale: torch.Tensor):
    return scale.tolist() if scale.dtype == torch.uint8 else scale.double().tolist()


# ------------------------------------------------------------------ reference vs oracle


@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_rowwise_matches_oracle(recipe):
    torch.manual_seed(0)
    x = torch.randn(9, 200, dtype=torch.float32) * torch.logspace(-4, 4, 9)[:, None]
    x[3] = 0  # a zero row
    data, scale, _, _ = R.grouped_quantize(x, None, recipe, True, False)
    want, want_scales = oracle_rows(x, R.fp8_block(recipe)[1], recipe)
    assert as_values(scale) == want_scales
    torch.testing.assert_close(data.double(), want, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_columnwise_matches_oracle(recipe):
    torch.manual_seed(1)
    M, K = 300, 24
    offs = torch.tensor([40, 40, 200, 290], dtype=torch.int32)  # an empty group, 10 tail rows
    # neighbouring groups six decades apart: each block must get its own scale
    x = torch.randn(M, K) * torch.where(torch.arange(M) < 40, 1e3, 1e-3)[:, None]
    _, _, col, col_scale = R.grouped_quantize(x, offs, recipe, False, True)
    assert col.shape == (K, M)
    block = R.fp8_column_block(recipe)
    slot = 0
    bounds = list(loop_bounds(offs, M)) + [(int(offs[-1]), M)]
    for s, e in bounds:
        step = (e - s) if block == 0 else block
        starts = [s] if block == 0 else range(s, e, step)
        for r0 in starts:
            r1 = min(e, r0 + max(step, 1))
            for k in range(K):
                sc, q = oracle_block(x[r0:r1, k], recipe)
                got = col_scale[k, slot]
                assert (got.item() if recipe == "mxfp8" else got.double().item()) == sc
                torch.testing.assert_close(col[k, r0:r1].double(), q.to(R.FP8_DTYPE).double(),
                                           rtol=0, atol=0)
            slot += 1
    # unused slots are zero blocks
    zero = R.fp8_scale_from_amax(torch.zeros(()), recipe)
    assert (col_scale[:, slot:] == zero).all()


def test_reference_weight_blocks_128x128():
    torch.manual_seed(2)
    w = torch.randn(2, 200, 136)
    data, scale, col, col_scale = R.grouped_quantize(w, None, "fp8_blockwise", True, True)
    assert scale.shape == (2, 2, 2) and col_scale.shape == (2, 2, 2)
    for g in range(2):
        for i in range(2):
            for j in range(2):
                blk = w[g, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                s, q = oracle_block(blk, "fp8_blockwise")
                assert scale[g, i, j].item() == s == col_scale[g, j, i].item()
                torch.testing.assert_close(
                    data[g, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].double(),
                    q.to(R.FP8_DTYPE).double().view_as(blk), rtol=0, atol=0)
    torch.testing.assert_close(col.double(), data.mT.double(), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_non_finite_blocks_are_reported(recipe):
    x = torch.randn(4, 256)
    x[1, 5] = float("inf")
    x[2, 200] = float("nan")
    data, scale, _, _ = R.grouped_quantize(x, None, recipe, True, False)
    deq = R.dequantize_rows(data, scale, recipe)
    assert torch.isfinite(deq[0]).all() and torch.isfinite(deq[3]).all()
    assert torch.isnan(deq[1, 5]) and torch.isnan(deq[2, 200])
    bad = R.E8M0_NAN if recipe == "mxfp8" else float("inf")
    assert (scale[1] == bad).any() and (scale[2] == bad).any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_and_extreme_blocks(recipe):
    x = torch.zeros(3, 128)
    x[1] = 3e38  # near fp32 max
    x[2] = 1e-38
    data, scale, _, _ = R.grouped_quantize(x, None, recipe, True, False)
    s = R.scale_to_float(scale)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (data[0].float() == 0).all()
    deq = R.dequantize_rows(data, scale, recipe)
    torch.testing.assert_close(deq[1], x[1], rtol=0.07, atol=0)
    if recipe == "mxfp8":  # power-of-two scales reach 2^-127: tiny values survive
        torch.testing.assert_close(deq[2], x[2], rtol=0.07, atol=0)


# ------------------------------------------------------------------ kernels under the interpreter


def _require_interpreter():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton interpreter tests run in the CPU tier")
    pytest.importorskip("triton")


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.fill_(0xAB)
    if t.dtype == R.FP8_DTYPE:
        t.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        return t
    return t.fill_(float("nan"))


def _run_quantize_kernel(x, offs, recipe, rowwise, columnwise):
    """The op's launch sequence on poisoned outputs (so an unwritten element shows)."""
    from compiled_moe.ops import fp8 as fp8_ops

    outs = fp8_ops._quantize_outputs(x, offs, recipe, rowwise, columnwise)
    for t in outs:
        _poison(t)
    fp8_ops._quantize_into(x, offs, recipe, rowwise, columnwise, outs)
    return outs


def _assert_same_quantization(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype == torch.uint8:
            assert torch.equal(g, w)
        else:  # fp8 data compared as values (+0 and -0 are the same number)
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("directions", [(True, False), (False, True), (True, True)])
def test_kernel_quantize_2d_interpreter(recipe, directions):
    _require_interpreter()
    gen = torch.Generator().manual_seed(3)
    M, K = 170, 200  # K not a multiple of 128
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, M)[:, None]).half()
    x[5, 7] = float("nan")
    offs = random_offsets(M, 5, generator=gen, empty_groups=1, tail=9)
    got = _run_quantize_kernel(x, offs, recipe, *directions)
    _assert_same_quantization(got, R.grouped_quantize(x, offs, recipe, *directions))


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "mxfp8"])
def test_kernel_quantize_fused_row_and_column_interpreter(recipe, monkeypatch):
    _require_interpreter()
    from compiled_moe.ops import fp8 as fp8_ops

    monkeypatch.setattr(fp8_ops, "FUSE_ROW_AND_COLUMN", ("fp8_blockwise", "mxfp8"))
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(150, 256, generator=gen).half()
    offs = random_offsets(150, 4, generator=gen, empty_groups=1, tail=6)
    got = _run_quantize_kernel(x, offs, recipe, True, True)
    _assert_same_quantization(got, R.grouped_quantize(x, offs, recipe, True, True))


def _interpreter_fma_rounds_once() -> bool:
    """True when the interpreter's fma rounds once, as the GPU's (Triton >= 3.9)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_probe(out_ptr):
        a = tl.full((1,), 1.0 + 2.0 ** -12, tl.float32)
        tl.store(out_ptr + tl.arange(0, 1), tl.math.fma(a, a, -(1.0 + 2.0 ** -11)))

    out = torch.zeros(1)
    fma_probe[(1,)](out)
    return out.item() == 2.0 ** -24  # a product then a sum rounds it to 0


def _assert_bitwise(got, want):
    """Data compared as bytes (so -0 and +0 differ), scales as bits."""
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        view = {R.FP8_DTYPE: torch.uint8, torch.float32: torch.int32}.get(g.dtype, g.dtype)
        assert torch.equal(g.view(view), w.view(view))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fma_division", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_quantize_bitwise_special_values_interpreter(recipe, fma_division, fused,
                                                            monkeypatch):
    """Every kernel path bit for bit against the reference: the division by fma steps (the
    GPU's; run here when the interpreter's fma rounds once), the fused and separate
    row+column launches, and columnwise stores of groups aligned to 16 rows and not. The
    columnwise blocks are read in one step, as on the GPU (the interpreter's small tile reads
    them in several: the other tests)."""
    _require_interpreter()
    if recipe == "fp8_rowwise" and fused:
        pytest.skip("fp8_rowwise has no fused launch")
    import dataclasses

    from compiled_moe.kernels import quantize
    from compiled_moe.ops import fp8 as fp8_ops

    if fma_division and not _interpreter_fma_rounds_once():
        pytest.skip("this Triton's interpreter rounds an fma twice")
    monkeypatch.setattr(quantize, "FMA_DIVISION", fma_division)
    monkeypatch.setattr(fp8_ops, "FUSE_ROW_AND_COLUMN", ("fp8_blockwise", "mxfp8") if fused else ())
    tile = quantize.quantize_config

    def one_step(kind, device_type, cols=0):
        cfg = tile(kind, device_type, cols)
        return dataclasses.replace(cfg, block_m=128) if kind.startswith("group_columns_") else cfg

    monkeypatch.setattr(quantize, "quantize_config", one_step)
    gen = torch.Generator().manual_seed(12)
    M, K = 160, 256
    x = special_values(M, K, gen)
    # ends 32 and 80 are multiples of 16 (16-byte column stores), 101 and 144 are not; an
    # empty group; 16 rows past the last group
    offs = torch.tensor([32, 32, 80, 101, 144], dtype=torch.int32)
    got = _run_quantize_kernel(x, offs, recipe, True, True)
    _assert_bitwise(got, R.grouped_quantize(x, offs, recipe, True, True))


def test_block_amax_nan_max_interpreter():
    """The GPU's NaN-keeping amax (block_amax with NAN_MAX) equals the per-element one."""
    _require_interpreter()
    import triton
    import triton.language as tl

    import compiled_moe.kernels.quantize  # noqa: F401 (cm.kernels.quantize below)

    @triton.jit
    def amax_kernel(x_ptr, out_ptr, NAN_MAX: tl.constexpr):
        r = tl.arange(0, 8)
        c = tl.arange(0, 16)
        x = tl.load(x_ptr + r[:, None] * 16 + c[None, :])
        tl.store(out_ptr + r, cm.kernels.quantize.block_amax(x, 1, NAN_MAX))
        tl.store(out_ptr + 8 + c, cm.kernels.quantize.block_amax(x, 0, NAN_MAX))

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(14))
    x[1, 3] = float("nan")
    x[2, 5] = float("-inf")
    x[4] = 0.0
    x[5, 0] = -1e30
    abs_x = R._amax_nonfinite_as_inf(x)
    want = torch.cat([abs_x.amax(1), abs_x.amax(0)])
    for nan_max in (False, True):
        out = torch.full((24,), -1.0)
        amax_kernel[(1,)](x, out, nan_max)
        assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fused", [False, True])
def test_quantize_bitwise_special_values_gpu(recipe, fused, monkeypatch):
    """The GPU arithmetic (hardware e4m3 cast, fma division) bit for bit, data as bytes."""
    from compiled_moe.ops import fp8 as fp8_ops

    monkeypatch.setattr(fp8_ops, "FUSE_ROW_AND_COLUMN", ("fp8_blockwise", "mxfp8") if fused else ())
    gen = torch.Generator().manual_seed(13)
    M, K = 4096 + 160, 2880
    x = special_values(M, K, gen).to(torch.bfloat16).cuda()
    x[11] = (torch.randn(K, generator=gen) * 1e-30).to(torch.bfloat16)  # divides
    counts = torch.randint(0, 9, (31,), generator=gen) * 16  # aligned groups, then not
    counts[20:] += torch.randint(0, 16, (11,), generator=gen)
    offs = torch.cumsum(counts, 0).clamp(max=M - 7).to(torch.int32).cuda()
    for directions in ((True, False), (False, True), (True, True)):
        got = torch.ops.compiled_moe.grouped_quantize(x, offs, recipe, *directions)
        _assert_bitwise(got, R.grouped_quantize(x, offs, recipe, *directions))


@pytest.mark.parametrize("recipe", RECIPES)
def test_kernel_quantize_weights_interpreter(recipe):
    _require_interpreter()
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2, 136, 160, generator=gen, dtype=torch.float32)  # N, K not multiples of 128
    got = _run_quantize_kernel(w.mT, None, recipe, True, True)  # a strided view
    _assert_same_quantization(got, R.grouped_quantize(w.mT, None, recipe, True, True))


def _fp8_operands(M, K, N, G, recipe, gen, tail=5):
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(G, N, K, generator=gen) / K ** 0.5
    d = torch.randn(M, N, generator=gen)
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=tail)
    xq = R.grouped_quantize(x, offs, recipe, True, True)
    wq = R.grouped_quantize(w, None, recipe, True, True)
    dq = R.grouped_quantize(d, offs, recipe, True, True)
    return x, w, offs, xq, wq, dq


@pytest.mark.parametrize("recipe", RECIPES)
def test_kernel_scaled_grouped_mm_interpreter(recipe):
    _require_interpreter()
    from compiled_moe.kernels import scaled_grouped_mm as kernels

    gen = torch.Generator().manual_seed(5)
    M, K, N, G = 90, 256, 40, 4
    x, w, offs, xq, wq, dq = _fp8_operands(M, K, N, G, recipe, gen)
    out = torch.full((M, N), float("nan"))
    kernels.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, recipe, out)
    want = R.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, recipe, torch.float32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    exact = R.grouped_mm(x.double(), w.mT.double(), offs)
    assert (out.double() - exact).norm() / exact.norm() < 0.06  # FP8 error, not a wrong result
    # with a bias: added to the fp32 product before the rounding
    bias = torch.randn(G, N, generator=gen).half()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    kernels.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, recipe, out, bias)
    want = R.scaled_grouped_mm(xq[0], wq[0].mT, xq[1], wq[1], offs, recipe, torch.float32, bias)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    assert (out[int(offs[-1]):] == 0).all()
    # dgrad: grad (M, N) @ W (N, K) from the weight's columnwise data
    out = torch.full((M, K), float("nan"))
    kernels.scaled_grouped_mm(dq[0], wq[2].mT, dq[1], wq[3], offs, recipe, out)
    want = R.scaled_grouped_mm(dq[0], wq[2].mT, dq[1], wq[3], offs, recipe, torch.float32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_kernel_scaled_wgrad_interpreter(recipe, aligned):
    _require_interpreter()
    from compiled_moe.kernels import scaled_grouped_mm as kernels

    gen = torch.Generator().manual_seed(6)
    M, K, N, G = 320, 24, 40, 3
    x = torch.randn(M, K, generator=gen)
    d = torch.randn(M, N, generator=gen)
    # 16-row aligned group starts take the TMA path, others the pointer path
    offs = torch.tensor([0, 144, 304] if aligned else [0, 137, 301], dtype=torch.int32)
    xq = cm.grouped_quantize(x, offs, recipe, rowwise=False, columnwise=True)
    dq = cm.grouped_quantize(d, offs, recipe, rowwise=False, columnwise=True)
    out = torch.full((G, K, N), float("nan"))
    kernels.scaled_grouped_mm_wgrad(xq[2], dq[2], xq[3], dq[3], offs, recipe, out)
    want = R.scaled_grouped_mm_wgrad(xq[2], dq[2], xq[3], dq[3], offs, recipe, torch.float32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    exact = R.grouped_mm_wgrad(x.double(), d.double(), offs)
    assert out[0].abs().max() == 0  # the empty group
    assert (out.double() - exact).norm() / exact.norm() < 0.06


def test_kernel_fp8_grouped_mm_autograd_interpreter():
    _require_interpreter()
    from compiled_moe.ops._dispatch import kernels_on_cpu

    gen = torch.Generator().manual_seed(7)
    M, K, N, G = 64, 128, 32, 3
    x = torch.randn(M, K, generator=gen).half().requires_grad_(True)
    w = (torch.randn(G, N, K, generator=gen) / K ** 0.5).half().requires_grad_(True)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    with kernels_on_cpu():
        y = cm.fp8_grouped_mm(x, w.mT, offs, recipe="fp8_blockwise")
        y.float().square().sum().backward()
    got = (y.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    y_ref = cm.fp8_grouped_mm(x, w.mT, offs, recipe="fp8_blockwise")  # reference path
    y_ref.float().square().sum().backward()
    for g, want in zip(got, (y_ref.detach(), x.grad, w.grad)):
        torch.testing.assert_close(g.float(), want.float(), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ training path


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_mm_gradients_close_to_exact(recipe):
    gen = torch.Generator().manual_seed(8)
    M, K, N, G = 200, 256, 64, 4
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    w = (torch.randn(G, N, K, generator=gen) / K ** 0.5).requires_grad_(True)
    bias = torch.randn(G, N, generator=gen, requires_grad=True)
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=3)
    grad = torch.randn(M, N, generator=gen)
    y = cm.fp8_grouped_mm(x, w.mT, offs, recipe=recipe, bias=bias)
    y.backward(grad)
    # In the weight's own storage order: a transposed gradient makes every later gradient add
    # and optimizer step a strided kernel (in GPT-OSS's FP8 block, 8 ms an add on the H200).
    assert w.grad.is_contiguous()
    got = (y.detach(), x.grad, w.grad, bias.grad)
    for t in (x, w, bias):
        t.grad = None
    # b given as a (G, K, N) tensor of its own: its gradient in that order
    b = w.detach().mT.contiguous().requires_grad_(True)
    cm.fp8_grouped_mm(x.detach(), b, offs, recipe=recipe).backward(grad)
    assert b.grad.is_contiguous()
    y64 = cm.grouped_mm(x.double(), w.double().mT, offs, bias=bias.double())
    y64.backward(grad.double())
    for g, want in zip(got, (y64.detach(), x.grad, w.grad, bias.grad)):
        rel = (g.double() - want).norm() / want.norm()
        assert rel < 0.06, rel
    assert (got[0][int(offs[-1]):] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_mm_with_weight_quantized_beforehand(recipe):
    """weight_fp8 (quantize_weight, once per optimizer step) gives the same output and gradients
    as quantizing the weight in the call, bit for bit."""
    gen = torch.Generator().manual_seed(18)
    M, K, N, G = 160, 256, 128, 3
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    w = (torch.randn(G, N, K, generator=gen) / K ** 0.5).requires_grad_(True)
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=3)
    grad = torch.randn(M, N, generator=gen)
    results = []
    for weight_fp8 in (None, cm.quantize_weight(w, recipe)):
        y = cm.fp8_grouped_mm(x, w.mT, offs, recipe=recipe, weight_fp8=weight_fp8)
        y.backward(grad)
        results.append((y.detach(), x.grad, w.grad))
        x.grad = w.grad = None
    for got, want in zip(*results):
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="weight_fp8 must be the 4 tensors"):
        cm.fp8_grouped_mm(x, w.mT, offs, recipe=recipe, weight_fp8=cm.quantize_weight(w, recipe)[:2])
    other = "fp8_rowwise" if recipe != "fp8_rowwise" else "fp8_blockwise"
    with pytest.raises(ValueError, match=r"weight_fp8\[1\] must be"):
        cm.fp8_grouped_mm(x, w.mT, offs, recipe=recipe, weight_fp8=cm.quantize_weight(w, other))
    with pytest.raises(ValueError, match=r"weight_fp8\[0\] must be"):
        cm.fp8_grouped_mm(x, w.mT, offs, recipe=recipe,
                          weight_fp8=cm.quantize_weight(w[:, :64], recipe))


def test_moe_experts_fp8_close_to_high_precision():
    gen = torch.Generator().manual_seed(9)
    T, H, I, E, k = 48, 128, 64, 4, 2
    hidden = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    ids = torch.randint(0, E, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    want = cm.moe_experts(hidden.double(), ids, weights.double(), w1.double(), w2.double())
    for recipe in RECIPES:
        got = cm.moe_experts(hidden, ids, weights, w1, w2, fp8_recipe=recipe)
        assert (got.double() - want).norm() / want.norm() < 0.08


@pytest.mark.parametrize("activation, layout, extras", [
    ("swiglu", "stacked", False), ("gpt_oss", "interleaved", True), ("relu2", "stacked", True)])
def test_moe_mlp_fp8_close_to_high_precision(activation, layout, extras):
    """moe_mlp(fp8_recipe=...) against the float64 moe_mlp: output and every gradient."""
    gen = torch.Generator().manual_seed(11)
    M, H, I, G = 72, 128, 64, 4
    n1 = I if activation == "relu2" else 2 * I
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=5)
    tensors = {"x": torch.randn(M, H, generator=gen),
               "w1": torch.randn(G, n1, H, generator=gen) / H ** 0.5,
               "w2": torch.randn(G, H, I, generator=gen) / I ** 0.5}
    if extras:
        tensors.update(probs=torch.rand(M, generator=gen), b1=0.1 * torch.randn(G, n1, generator=gen),
                       b2=0.1 * torch.randn(G, H, generator=gen))
    grad = torch.randn(M, H, generator=gen)

    def run(recipe, dtype):
        ins = {k: v.to(dtype, copy=True).requires_grad_(True) for k, v in tensors.items()}
        x, w1, w2 = ins.pop("x"), ins.pop("w1"), ins.pop("w2")
        y = cm.moe_mlp(x, offs, w1, w2, activation=activation, gate_up_layout=layout,
                       fp8_recipe=recipe, **ins)
        y.backward(grad.to(dtype))
        return [y.detach(), x.grad, w1.grad, w2.grad] + [ins[k].grad for k in sorted(ins)]

    exact = run(None, torch.float64)
    for recipe in RECIPES:
        got = run(recipe, torch.float32)
        assert (got[0][int(offs[-1]):] == 0).all()
        for g, want in zip(got, exact):
            # e4m3 rounds each quantized operand by about 3.6% rms; two chained GEMMs of two
            # quantized operands each measured up to 0.073 here.
            rel = (g.double() - want).norm() / want.norm()
            assert rel < 0.1, (recipe, rel)


ACTIVATION_CASES = [("swiglu", "stacked"), ("gpt_oss", "interleaved"), ("geglu", "interleaved"),
                    ("relu2", "stacked"), ("silu", "stacked"), ("gelu", "stacked")]


def _fp8_bytes(t):
    return t.view(torch.uint8) if t.dtype == R.FP8_DTYPE else t


@pytest.mark.parametrize("activation, layout", ACTIVATION_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_activation_quantize_is_the_quantized_activation(activation, layout, dtype):
    """moe_activation_quantize(h) == grouped_quantize(scaled_activation(h)), every recipe and
    direction; col_data keeps the kernels' padded rows."""
    gen = torch.Generator().manual_seed(12)
    M, I, G = 150, 160, 4
    n1 = 2 * I if activation in R.GATED_ACTIVATIONS else I
    h = (3 * torch.randn(M, n1, generator=gen)).to(dtype)
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=7)
    for recipe in RECIPES:
        for probs in (None, torch.rand(M, generator=gen)):
            for directions in ((True, True), (True, False), (False, True)):
                got = torch.ops.compiled_moe.moe_activation_quantize(
                    h, offs, activation, layout, recipe, probs, *directions)
                a = R.scaled_activation(h, activation, layout, probs)
                want = R.grouped_quantize(a, offs, recipe, *directions)
                if directions[1]:
                    assert got[2].stride(0) == -(-M // 16) * 16
                    got = (got[0], got[1], got[2][:, :M], got[3])
                for g, w in zip(got, want):
                    assert g.dtype == w.dtype and torch.equal(_fp8_bytes(g), _fp8_bytes(w))


def test_scaled_activation_oracle():
    """scaled_activation: the activation rounded to h's dtype, then times probs, rounded again."""
    h = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.bfloat16)
    probs = torch.tensor([0.3])
    g, u = h.double()[:, :2], h.double()[:, 2:]
    act = (g / (1 + torch.exp(-g)) * u).to(torch.bfloat16)
    want = (act.double() * 0.3).to(torch.bfloat16)
    assert torch.equal(R.scaled_activation(h, "swiglu", "stacked", probs), want)


@pytest.mark.parametrize("activation, layout", [("swiglu", "stacked"), ("gpt_oss", "interleaved"),
                                                ("relu2", "stacked")])
def test_fp8_activation_grouped_mm_is_the_composition(activation, layout):
    """fp8_activation_grouped_mm(h, ...) == fp8_grouped_mm(scaled_activation(h), ...) forward
    (bitwise), and its gradients of h, b, probs and bias against autograd of that composition."""
    gen = torch.Generator().manual_seed(13)
    M, H, I, G = 96, 64, 128, 3
    n1 = 2 * I if activation in R.GATED_ACTIVATIONS else I
    offs = random_offsets(M, G, generator=gen, empty_groups=1, tail=4)
    base = {"h": 2 * torch.randn(M, n1, generator=gen), "w": torch.randn(G, H, I, generator=gen),
            "probs": torch.rand(M, generator=gen), "bias": torch.randn(G, H, generator=gen)}
    grad = torch.randn(M, H, generator=gen)
    for recipe in RECIPES:
        ins = [{k: v.clone().requires_grad_(True) for k, v in base.items()} for _ in range(2)]
        got = cm.fp8_activation_grouped_mm(ins[0]["h"], ins[0]["w"].mT, offs,
                                           activation=activation, gate_up_layout=layout,
                                           probs=ins[0]["probs"], recipe=recipe,
                                           bias=ins[0]["bias"])
        a = R.scaled_activation(ins[1]["h"], activation, layout, ins[1]["probs"])
        want = cm.fp8_grouped_mm(a, ins[1]["w"].mT, offs, recipe=recipe, bias=ins[1]["bias"])
        assert torch.equal(got, want)
        got.backward(grad)
        want.backward(grad)
        for k in base:
            torch.testing.assert_close(ins[0][k].grad, ins[1][k].grad, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{recipe} {k}: {m}")


def test_moe_activation_quantize_bad_inputs():
    h = torch.randn(8, 64)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    op = torch.ops.compiled_moe.moe_activation_quantize
    with pytest.raises(ValueError, match="recipe"):
        op(h, offs, "swiglu", "stacked", "fp4")
    with pytest.raises(ValueError, match="activation must be one of"):
        op(h, offs, "tanh", "stacked", "fp8_blockwise")
    with pytest.raises(ValueError, match="gate_up_layout"):
        op(h, offs, "swiglu", "zigzag", "fp8_blockwise")
    with pytest.raises(ValueError, match="even number of columns"):
        op(h[:, :63], offs, "swiglu", "stacked", "fp8_blockwise")
    with pytest.raises(ValueError, match="h must be 2-D"):
        op(h[0], offs, "swiglu", "stacked", "fp8_blockwise")
    with pytest.raises(TypeError, match="offs must be int32"):
        op(h, offs.long(), "swiglu", "stacked", "fp8_blockwise")
    with pytest.raises(ValueError, match="probs"):
        op(h, offs, "swiglu", "stacked", "fp8_blockwise", torch.rand(7))
    with pytest.raises(ValueError, match="rowwise and/or columnwise"):
        op(h, offs, "swiglu", "stacked", "fp8_blockwise", None, False, False)
    with pytest.raises(ValueError, match="b must be 3-D"):
        cm.fp8_activation_grouped_mm(h, torch.randn(32, 16), offs, activation="swiglu")


def test_moe_mlp_fp8_bad_inputs():
    x, w1, w2 = torch.randn(8, 32), torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="recipe"):
        cm.moe_mlp(x, offs, w1, w2, fp8_recipe="fp4")
    with pytest.raises(ValueError, match="wgrad_store"):
        cm.moe_mlp(x, offs, w1, w2, fp8_recipe="fp8_rowwise", wgrad_store=cm.WeightGradStore())
    with pytest.raises(ValueError, match="w2"):
        cm.moe_mlp(x, offs, w1, w2[:, :, :16], fp8_recipe="fp8_rowwise")
    with pytest.raises(TypeError, match="fp8_weights must be"):
        cm.moe_mlp(x, offs, w1, w2, fp8_recipe="fp8_rowwise", fp8_weights=(None, None))
    # The FP8 wrappers name their own arguments.
    with pytest.raises(ValueError, match="a must be 2-D"):
        cm.fp8_grouped_mm(x[None], w1.mT, offs)
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        cm.fp8_grouped_mm(x, [1.0], offs)
    with pytest.raises(ValueError, match="w must be 3-D"):
        cm.quantize_weight(torch.randn(16, 16))


def test_modules_take_a_recipe():
    lin = cm.GroupedLinear(3, 128, 32, fp8_recipe="fp8_rowwise")
    x = torch.randn(40, 128, requires_grad=True)
    offs = torch.tensor([10, 25, 40], dtype=torch.int32)
    y = lin(x, offs)
    y.sum().backward()
    exact = cm.grouped_mm(x.detach().double(), lin.weight.detach().double().mT, offs,
                          bias=lin.bias.detach().double())
    assert (y.detach().double() - exact).norm() / exact.norm() < 0.06
    assert lin.weight.grad is not None and "fp8_recipe=fp8_rowwise" in repr(lin)
    moe = cm.MoEExperts(4, 128, 32, fp8_recipe="mxfp8")
    out = moe(torch.randn(8, 128), torch.randint(0, 4, (8, 2)), torch.rand(8, 2))
    assert out.shape == (8, 128) and torch.isfinite(out).all()


def test_weights_quantized_once_per_step():
    """is_first_microbatch (modules) and fp8_weights (moe_experts, moe_mlp): the micro-batches
    after the first reuse the weights' quantization and give what quantizing in every call
    gives, bit for bit, gradients included."""
    gen = torch.Generator().manual_seed(19)
    moe = cm.MoEExperts(4, 128, 64, fp8_recipe="fp8_blockwise", bias=True)
    batches = [(torch.randn(12, 128, generator=gen), torch.randint(0, 4, (12, 2), generator=gen),
                torch.rand(12, 2, generator=gen)) for _ in range(3)]

    def run(flags):
        moe.zero_grad()
        outs = [moe(*b, is_first_microbatch=f) for b, f in zip(batches, flags)]
        sum(o.square().sum() for o in outs).backward()
        return outs + [p.grad.clone() for p in moe.parameters()]

    for got, want in zip(run([True, False, False]), run([None, None, None])):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="is_first_microbatch=False"):
        cm.GroupedLinear(2, 128, 32, fp8_recipe="fp8_blockwise")(
            torch.randn(8, 128), torch.tensor([3, 8], dtype=torch.int32), is_first_microbatch=False)
    lin = cm.GroupedLinear(2, 128, 32)  # no recipe: nothing to keep, the flag is ignored
    lin(torch.randn(8, 128), torch.tensor([3, 8], dtype=torch.int32), is_first_microbatch=False)

    x = torch.randn(40, 128, generator=gen)
    offs = torch.tensor([16, 16, 40], dtype=torch.int32)
    w1, w2 = torch.randn(3, 128, 128, generator=gen) / 12, torch.randn(3, 128, 64, generator=gen) / 8
    pair = (cm.quantize_weight(w1, "mxfp8"), cm.quantize_weight(w2, "mxfp8"))
    assert torch.equal(cm.moe_mlp(x, offs, w1, w2, fp8_recipe="mxfp8", fp8_weights=pair),
                       cm.moe_mlp(x, offs, w1, w2, fp8_recipe="mxfp8"))
    with pytest.raises(ValueError, match="fp8_weights needs fp8_recipe"):
        cm.moe_mlp(x, offs, w1, w2, fp8_weights=pair)
    with pytest.raises(TypeError, match="fp8_weights must be"):
        cm.moe_mlp(x, offs, w1, w2, fp8_recipe="mxfp8", fp8_weights=pair[:1])


# ------------------------------------------------------------------ opcheck, compile


def _opcheck_samples():
    gen = torch.Generator().manual_seed(10)
    M, K, N, G = 40, 128, 32, 3
    x = torch.randn(M, K, generator=gen)
    offs = torch.tensor([10, 10, 35], dtype=torch.int32)
    samples = []
    for recipe in RECIPES:
        xq = R.grouped_quantize(x, offs, recipe, True, True)
        wq = R.grouped_quantize(torch.randn(G, N, K, generator=gen), None, recipe, True, True)
        dq = R.grouped_quantize(torch.randn(M, N, generator=gen), offs, recipe, False, True)
        samples += [
            (torch.ops.compiled_moe.grouped_quantize.default, (x, offs, recipe, True, True)),
            (torch.ops.compiled_moe.grouped_quantize.default,
             (torch.randn(G, N, K, generator=gen), None, recipe, True, True)),
            (torch.ops.compiled_moe.scaled_grouped_mm.default,
             (xq[0], wq[0].mT, xq[1], wq[1], offs, recipe, None)),
            (torch.ops.compiled_moe.scaled_grouped_mm.default,
             (xq[0], wq[0].mT, xq[1], wq[1], offs, recipe, torch.float32,
              torch.randn(G, N, generator=gen))),
            (torch.ops.compiled_moe.scaled_grouped_mm_wgrad.default,
             (xq[2], dq[2], xq[3], dq[3], offs, recipe, torch.float32)),
            (torch.ops.compiled_moe.moe_activation_quantize.default,
             (x, offs, "swiglu", "stacked", recipe, torch.rand(M, generator=gen), True, True)),
            (torch.ops.compiled_moe.moe_activation_quantize.default,
             (x, offs, "gpt_oss", "interleaved", recipe, None, True, False, 1.5, 6.0)),
        ]
    return samples


@pytest.mark.parametrize("recipe", RECIPES)
def test_columnwise_scale_layout(recipe):
    """fp8_blockwise's columnwise scales come K-contiguous (the CUDA quantizer writes an item's
    column scales as one run), from the op and from its fake alike, with the reference's values;
    the other recipes' and every rowwise scale tensor are row-major."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(300, 256)
    offs = torch.tensor([100, 100, 260], dtype=torch.int32)
    got = cm.grouped_quantize(x, offs, recipe, rowwise=True, columnwise=True)
    want = R.grouped_quantize(x, offs, recipe, True, True)
    (K, S), blocks = want[3].shape, want[1].shape[1]
    assert got[3].shape == (K, S)
    assert got[3].stride() == ((1, K) if recipe == "fp8_blockwise" else (S, 1))
    assert got[1].stride() == (blocks, 1)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8) if g.dtype == R.FP8_DTYPE else g,
                           w.view(torch.uint8) if w.dtype == R.FP8_DTYPE else w)
    with FakeTensorMode() as mode:
        fake = torch.ops.compiled_moe.grouped_quantize(mode.from_tensor(x), mode.from_tensor(offs),
                                                       recipe, True, True)
    assert [t.stride() for t in fake] == [t.stride() for t in got]


@pytest.mark.parametrize("sample", range(21))
def test_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    utils = ["test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic"]
    if args[0].dtype == R.FP8_DTYPE:
        utils.remove("test_schema")  # SchemaCheckMode compares inputs with allclose: no CPU fp8
    torch.library.opcheck(op, args, test_utils=utils)


def test_compile_dynamic_one_compile_fp8_training_step():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    H, I, G = 128, 32, 4
    w1 = (torch.randn(G, 2 * I, H) / H ** 0.5).requires_grad_(True)
    w2 = (torch.randn(G, H, I) / I ** 0.5).requires_grad_(True)
    b1 = torch.randn(G, 2 * I).requires_grad_(True)
    b2 = torch.randn(G, H).requires_grad_(True)
    params = (w1, w2, b1, b2)

    def step(x, offs, probs):  # the FP8 expert MLP: two fp8_grouped_mm (with biases) and the activation
        return cm.moe_mlp(x, offs, w1, w2, probs=probs, b1=b1, b2=b2,
                          fp8_recipe="fp8_blockwise").square().sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    # Above 32 rows: inductor's CPU code for the reference path guards on M <= 32 once.
    for M in (40, 57, 83):
        x = torch.randn(M, H, requires_grad=True)
        offs = random_offsets(M, G, empty_groups=1, tail=2)
        probs = torch.rand(M)
        got = compiled(x, offs, probs)
        got.backward()
        grads = [t.grad.clone() for t in (x, *params)]
        for t in (x, *params):
            t.grad = None
        want = step(x, offs, probs)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grads, [t.grad for t in (x, *params)], rtol=1e-4, atol=1e-4)
        for t in (x, *params):
            t.grad = None
    assert counter.frame_count == 1


# ------------------------------------------------------------------ bad inputs


def test_quantize_bad_inputs():
    x = torch.randn(8, 32)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="recipe"):
        cm.grouped_quantize(x, offs, "fp4")
    with pytest.raises(ValueError, match="x must be 2-D"):
        cm.grouped_quantize(torch.randn(8), offs)
    with pytest.raises(TypeError, match="x must have dtype"):
        cm.grouped_quantize(x.int(), offs)
    with pytest.raises(ValueError, match="offs is required"):
        cm.grouped_quantize(x, None, columnwise=True)
    with pytest.raises(ValueError, match="offs must be None"):
        cm.grouped_quantize(torch.randn(2, 8, 32), offs)
    with pytest.raises(TypeError, match="offs must be int32"):
        cm.grouped_quantize(x, offs.long(), columnwise=True)
    with pytest.raises(ValueError, match="rowwise and/or columnwise"):
        cm.grouped_quantize(x, offs, rowwise=False)
    # The CUDA columnwise kernel's op checks like grouped_quantize (its fake, on meta tensors).
    cuda_op = torch.ops.compiled_moe.grouped_quantize_columns_cuda
    xm, om = torch.randn(256, 128, device="meta"), offs.to("meta")
    assert [t.shape for t in cuda_op(xm, om, "fp8_blockwise", True)] == [
        (256, 128), (256, 1), (128, 256), (128, 2 + 2)]
    with pytest.raises(TypeError, match="offs must be int32"):
        cuda_op(xm, om.long(), "fp8_blockwise", True)
    with pytest.raises(ValueError, match="recipe"):
        cuda_op(xm, om, "fp4", False)
    with pytest.raises(ValueError, match="x must be 2-D"):
        cuda_op(torch.randn(256, device="meta"), om, "fp8_blockwise", False)


def test_scaled_mm_bad_inputs():
    M, K, N, G = 16, 256, 32, 2
    offs = torch.tensor([8, 16], dtype=torch.int32)
    xq = cm.grouped_quantize(torch.randn(M, K), offs, "fp8_blockwise", columnwise=True)
    wq = cm.grouped_quantize(torch.randn(G, N, K), None, "fp8_blockwise")
    ok = dict(a=xq[0], b=wq[0].mT, a_scale=xq[1], b_scale=wq[1], offs=offs)

    def call(**kw):
        args = {**ok, **kw}
        return cm.scaled_grouped_mm(args["a"], args["b"], args["a_scale"], args["b_scale"],
                                    args["offs"], recipe=kw.get("recipe", "fp8_blockwise"))

    with pytest.raises(TypeError, match="a must have dtype"):
        call(a=torch.randn(M, K))
    with pytest.raises(ValueError, match="b must be K-major"):
        call(b=wq[0].mT.contiguous())
    with pytest.raises(ValueError, match="a_scale must have shape"):
        call(a_scale=xq[1][:, :1].contiguous())
    with pytest.raises(ValueError, match="K must match"):
        call(a=xq[0][:, :128])
    with pytest.raises(TypeError, match="a_scale must have dtype in \(uint8\)"):
        call(recipe="mxfp8")
    with pytest.raises(ValueError, match="offs must have shape"):
        call(offs=offs[:1])
    with pytest.raises(ValueError, match=r"bias must have shape \(G, N\) = \(2, 32\)"):
        cm.scaled_grouped_mm(*ok.values(), bias=torch.zeros(G, N + 1))
    with pytest.raises(TypeError, match="bias must have dtype"):
        cm.scaled_grouped_mm(*ok.values(), bias=torch.zeros(G, N, dtype=torch.int32))
    with pytest.raises(ValueError, match="M must match"):
        cm.scaled_grouped_mm_wgrad(xq[2], xq[2][:, :8], xq[3], xq[3], offs)
    with pytest.raises(ValueError, match="recipe"):
        cm.fp8_grouped_mm(torch.randn(M, K), torch.randn(G, K, N), offs, recipe="int8")
    # The CUDA kernel's op checks its inputs too (its fake runs them on meta tensors here).
    sm90 = torch.ops.compiled_moe.fp8_blockwise_grouped_mm_sm90
    meta = {k: v.to("meta") for k, v in ok.items()}
    assert sm90(*meta.values()).shape == (M, N)
    with pytest.raises(ValueError, match="K must match"):
        sm90(meta["a"][:, :128], *list(meta.values())[1:])
    with pytest.raises(TypeError, match="a must have dtype"):
        sm90(torch.empty(M, K, device="meta"), *list(meta.values())[1:])
    wgrad = torch.ops.compiled_moe.fp8_grouped_mm_wgrad_sm90
    a_t, a_s, offs_m = xq[2].to("meta"), xq[3].to("meta"), offs.to("meta")
    assert wgrad(a_t, a_t, a_s, a_s, offs_m, "fp8_blockwise").shape == (G, K, K)
    with pytest.raises(ValueError, match="M must match"):
        wgrad(a_t, a_t[:, :8], a_s, a_s, offs_m, "fp8_blockwise")
    with pytest.raises(ValueError, match="d_scale must have shape"):
        wgrad(a_t, a_t, a_s, a_s[:, :1], offs_m, "fp8_blockwise")
    with pytest.raises(ValueError, match="for the Hopper kernel"):
        mx = cm.grouped_quantize(torch.randn(M, K), offs, "mxfp8", columnwise=True)
        wgrad(mx[2].to("meta"), mx[2].to("meta"), mx[3].to("meta"), mx[3].to("meta"), offs_m, "mxfp8")


def test_e8m0_exponent_rule():
    """Round-up exponents: amax in (448 * 2^(e-1), 448 * 2^e] gets 2^e; 448 itself gets 2^0."""
    amax = torch.tensor([448.0, 448.0001, 224.0, 1.0, 0.0, math.inf, 3.0e38])
    byte = R.fp8_scale_from_amax(amax, "mxfp8").tolist()
    assert byte[:4] == [127, 128, 126, 127 - 8]
    assert byte[4] == 0 and byte[5] == R.E8M0_NAN
    assert 448 * 2.0 ** (byte[6] - 127) >= 3.0e38 > 448 * 2.0 ** (byte[6] - 128)


def test_fp8_cuda_kernel_limits():
    """The CUDA FP8 kernel's shared memory at the most groups it takes fits a Hopper block
    (227 KB, all of it dynamic: test_csrc checks that ptxas reports no static shared memory),
    and CPU tensors never reach it."""
    from compiled_moe.kernels import configs
    from compiled_moe.kernels import scaled_grouped_mm_sm90 as sm90
    cfg = configs.fp8_blockwise_sm90_config(8192, 4096, 7168, sm90.MAX_GROUPS)
    for dtype in (torch.bfloat16, torch.float32):  # fp32 outputs stage twice the bytes
        for groups in (8, sm90.MAX_GROUPS):
            shared = lambda n: sm90._shared_bytes(groups, n, dtype)  # noqa: E731
            stages = sm90.fit_stages(cfg.num_stages, shared)
            assert stages >= 4 and shared(stages) <= 227 * 1024
    # 128 x 256 tiles (2-byte outputs): 3 stages of 48 KB up to 256 groups, 2 at the most.
    for groups, want in ((8, 3), (256, 3), (sm90.MAX_GROUPS, 2)):
        shared = lambda n: sm90._shared_bytes(groups, n, torch.bfloat16, 256)  # noqa: E731
        stages = sm90.fit_stages(cfg.num_stages, shared)
        assert stages == want and shared(stages) <= 227 * 1024, groups
    a = torch.zeros(256, 512, dtype=R.FP8_DTYPE)
    b = torch.zeros(4, 256, 512, dtype=R.FP8_DTYPE).mT
    assert not sm90.supported(a, b, "fp8_blockwise")


def test_fp8_forward_tile_rule():
    """The CUDA FP8 forward takes 128 x 256 tiles where the groups average 128 rows or more
    (training shapes, Mixtral at T = 512) and 128 x 128 tiles at fewer rows (decoding, where half
    as many tiles would stream the weights); no shape pairs CTAs."""
    from compiled_moe.kernels import configs
    tiles = {  # (m, n, k, groups): block_n
        (8192, 28672, 4096, 8): 256,    # Mixtral FC1, T = 4096
        (1024, 4096, 14336, 8): 256,    # Mixtral FC2, T = 512
        (64, 28672, 4096, 8): 128,      # Mixtral, T = 32
        (32768, 4096, 7168, 32): 256,   # DeepSeek-V3 EP8
        (32768, 1536, 2048, 128): 256,  # Qwen3, T = 4096
        (4096, 1536, 2048, 128): 128,   # Qwen3, T = 512
        (16384, 5760, 2880, 128): 256,  # GPT-OSS, T = 4096
    }
    for shape, block_n in tiles.items():
        cfg = configs.fp8_blockwise_sm90_config(*shape)
        assert (cfg.block_n, cfg.cluster) == (block_n, 1), shape
