"""FP8 ops: schema, fake and device dispatch, side by side.

torch.ops.compiled_moe.grouped_quantize         e4m3 data + scales of every group, one launch
                                                per direction (one for both on 2-D block recipes)
torch.ops.compiled_moe.moe_activation_quantize  FC2's FP8 input: grouped_quantize of the
                                                activation (* probs) of FC1's output h
torch.ops.compiled_moe.scaled_grouped_mm        out = a @ b[g] per row group, FP8 operands
torch.ops.compiled_moe.scaled_grouped_mm_wgrad  out[g] = a_g^T @ d_g from columnwise FP8 data

``kernel_op``s whose bodies compiled graphs trace (as a ``triton_op``'s): Triton kernels on
CUDA, the reference elsewhere; on Hopper the fp8_blockwise GEMM and the fp8_blockwise /
fp8_rowwise weight gradient call the CUDA kernels of ``csrc/fp8_grouped_mm.cu`` through opaque
ops (below). Layouts of data and scales are documented in ``reference.grouped_quantize``. None
of them is differentiable (a backward through them raises): training goes through
``compiled_moe.fp8.fp8_grouped_mm``, whose autograd quantizes the gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compiled_moe import reference
from compiled_moe.ops._dispatch import (
    OP_DTYPES,
    check_bias,
    check_offs,
    check_same_device,
    check_tensor,
    kernel_op,
    on_tensor_device,
    use_kernel,
)
from compiled_moe.reference import FP8_DTYPE, check_recipe, fp8_block, fp8_column_slots

_ops = torch.ops.compiled_moe

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Recipes whose rowwise and columnwise output come from one Triton launch: the columnwise kernel
# also writes the rowwise blocks of its tiles, so x is read once. Measured on the H200
# (2026-11-23, row+col of the FC1 input of the four model shapes, fraction of copy bandwidth,
# fused against two launches): mxfp8 0.38-0.43 against 0.28-0.35; fp8_blockwise 0.12-0.21
# against 0.29-0.39 (its fused 128-row tile does twice the scale work per element and holds more
# registers). On sm_90+ fp8_blockwise columnwise output runs the CUDA kernel below instead.
FUSE_ROW_AND_COLUMN = ("mxfp8",)


def _kernels():
    from compiled_moe.kernels import quantize, scaled_grouped_mm  # Triton loads only when needed
    return quantize, scaled_grouped_mm


def _sm90():
    from compiled_moe.kernels import scaled_grouped_mm_sm90  # the CUDA kernel's launcher
    return scaled_grouped_mm_sm90


def _quantize_cuda():
    from compiled_moe.kernels import quantize_cuda  # the CUDA columnwise quantizer's launcher
    return quantize_cuda


def _cdiv(a, b):
    return (a + b - 1) // b


def quantized_scale_dtype(recipe: str) -> torch.dtype:
    return torch.uint8 if recipe == "mxfp8" else torch.float32


def _blocks(cols, block: int):
    return 1 if block == 0 else _cdiv(cols, block)


# ---------------------------------------------------------------------------- grouped_quantize


def _check_quantize(x, offs, recipe, rowwise, columnwise) -> None:
    check_recipe(recipe)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D (M, K) activations or 3-D (G, N, K) weights, "
                         f"got shape {tuple(x.shape)}")
    check_tensor("x", x, x.dim(), OP_DTYPES)
    if not (rowwise or columnwise):
        raise ValueError("ask for rowwise and/or columnwise output")
    if x.dim() == 3:
        if offs is not None:
            raise ValueError("offs must be None for 3-D x (its groups are the leading dimension)")
        return
    if offs is None:
        if columnwise:
            raise ValueError("offs is required for columnwise quantization of 2-D x: "
                             "columnwise blocks stop at group ends")
        return
    check_offs(offs)
    check_same_device("x", x, offs=offs)


def weight_quantized_shapes(shape: tuple, recipe: str) -> tuple[tuple, ...]:
    """Shapes of grouped_quantize's four outputs (rowwise data and scales, columnwise data and
    scales) for a (G, N, K) weight; data is e4m3, scales ``quantized_scale_dtype(recipe)``."""
    g, n, k = shape
    br, bc = fp8_block(recipe, weight=True)
    return ((g, n, k), (g, _cdiv(n, br), _blocks(k, bc)),
            (g, k, n), (g, _cdiv(k, br), _blocks(n, bc)))


def _column_scale_tensor(x, shape: tuple, recipe: str) -> Tensor:
    """An empty columnwise scale tensor (K, slots) of 2-D x. fp8_blockwise stores it with K
    contiguous (the .t() of a (slots, K) buffer): the CUDA quantizer writes an item's 128
    column scales as one run of 512 bytes, where the row-major layout took 128 single-float
    stores to 128 sectors, and the weight-gradient kernels read a chunk's scales as runs too.
    Every kernel takes scales through both strides. (The rowwise scales stay row-major: the
    FP8 forward reads a row's scales step after step from one cached line, and stored with M
    contiguous they made it 5-10% slower; benchmarks/RESULTS.md.)"""
    if recipe == "fp8_blockwise":
        return x.new_empty(shape[::-1], dtype=quantized_scale_dtype(recipe)).t()
    return x.new_empty(shape, dtype=quantized_scale_dtype(recipe))


def _quantize_outputs(x, offs, recipe, rowwise, columnwise, shape=None):
    """Empty outputs of the right shapes (and strides) for the kernels and the fake; x gives
    the dtype and device, and the shape unless ``shape`` does."""
    sdt = quantized_scale_dtype(recipe)
    data = scale = col_data = col_scale = None
    shape = tuple(x.shape) if shape is None else shape
    if len(shape) == 3:
        shapes = weight_quantized_shapes(shape, recipe)
        if rowwise:
            data = x.new_empty(shapes[0], dtype=FP8_DTYPE)
            scale = x.new_empty(shapes[1], dtype=sdt)
        if columnwise:
            col_data = x.new_empty(shapes[2], dtype=FP8_DTYPE)
            col_scale = x.new_empty(shapes[3], dtype=sdt)
    else:
        m, k = shape
        _, bc = fp8_block(recipe)
        if rowwise:
            data = x.new_empty((m, k), dtype=FP8_DTYPE)
            scale = x.new_empty((m, _blocks(k, bc)), dtype=sdt)
        if columnwise:
            # Rows padded to 16 bytes: the weight-gradient kernel reads it through TMA.
            col_data = x.new_empty_strided((k, m), (_cdiv(m, 16) * 16, 1), dtype=FP8_DTYPE)
            col_scale = _column_scale_tensor(x, (k, fp8_column_slots(m, offs.shape[0], recipe)),
                                             recipe)
    if data is None or col_data is None:  # an output not asked for: empty (allocated only then)
        none8, none_s = x.new_empty((0,), dtype=FP8_DTYPE), x.new_empty((0,), dtype=sdt)
        data, scale = (none8, none_s) if data is None else (data, scale)
        col_data, col_scale = (none8, none_s) if col_data is None else (col_data, col_scale)
    return data, scale, col_data, col_scale


def _register_host_quantize(module) -> list[str]:
    """The C++ host layer's grouped_quantize CUDA kernel (csrc/host/fp8.cpp): checks and
    the launch of the CUDA kernels for 2-D fp8_blockwise x, columnwise (its plan asked of
    quantize_cuda.host_plan once per shape) or rowwise only (quantize_cuda.host_rows_plan, once
    per dtype and device); the op's Python kernel serves the rest."""
    from compiled_moe import native

    if not (module.has_cuda and native.available()):
        return []
    return module.register_grouped_quantize(
        lambda x, offs, rowwise: _quantize_cuda().host_plan(x, offs, rowwise),
        lambda x: _quantize_cuda().host_rows_plan(x),
        lambda *args: _grouped_quantize._kernel(*args))


@kernel_op("grouped_quantize", device_types=("cuda", "cpu"), traced=True, host=_register_host_quantize)
@on_tensor_device
def _grouped_quantize(x: Tensor, offs: Optional[Tensor], recipe: str, rowwise: bool = True,
                      columnwise: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_quantize(x, offs, recipe, rowwise, columnwise)
    if columnwise and x.dim() == 2 and _quantize_cuda().supported(x, recipe):
        return _ops.grouped_quantize_columns_cuda(x, offs, recipe, rowwise)
    outs = _quantize_outputs(x, offs, recipe, rowwise, columnwise)
    if not use_kernel(x):
        # Copied into the kernels' layouts (padded col_data rows), so every path has one layout.
        for out, ref in zip(outs, reference.grouped_quantize(x, offs, recipe, rowwise, columnwise)):
            out.copy_(ref)
        return outs
    _quantize_into(x, offs, recipe, rowwise, columnwise, outs)
    return outs


def _quantize_into(x, offs, recipe, rowwise, columnwise, outs) -> None:
    """The kernel launches of grouped_quantize, writing into outs (from _quantize_outputs)."""
    data, scale, col_data, col_scale = outs
    quantize, _ = _kernels()
    if x.dim() == 3:
        br, bc = fp8_block(recipe, weight=True)
        if rowwise and columnwise and br == bc:  # 128 x 128: both directions from one read
            quantize.quantize_tiles(x, data, scale, recipe, weight=True,
                                    col=(col_data, col_scale))
            return
        if rowwise:
            quantize.quantize_tiles(x, data, scale, recipe, weight=True)
        if columnwise:
            quantize.quantize_tiles(x.mT, col_data, col_scale, recipe, weight=True)
        return
    fused = recipe in FUSE_ROW_AND_COLUMN and columnwise and rowwise
    if rowwise and not fused:
        quantize.quantize_tiles(x, data, scale, recipe, weight=False)
    if columnwise:
        quantize.quantize_group_columns(x, offs, col_data, col_scale,
                                        data if fused else None, scale if fused else None, recipe)


@_grouped_quantize.register_fake
def _(x, offs, recipe, rowwise=True, columnwise=False):
    _check_quantize(x, offs, recipe, rowwise, columnwise)
    return _quantize_outputs(x, offs, recipe, rowwise, columnwise)


# The CUDA kernels of csrc/grouped_quantize.cu, which grouped_quantize calls for fp8_blockwise
# columnwise output of 2-D x (0.58-0.70 of copy bandwidth on the H200 with rowwise output too,
# where the Triton launches reached 0.32-0.41; benchmarks/RESULTS.md). Opaque, as the Hopper
# GEMMs: inductor cannot trace a driver launch. It repeats the checks (it is reachable as
# torch.ops.compiled_moe.grouped_quantize_columns_cuda) and runs the Triton kernels where x's
# address is not 16-byte aligned or the slot table does not fit in shared memory.
@kernel_op("grouped_quantize_columns_cuda", autograd="none")
@on_tensor_device
def _grouped_quantize_columns_cuda(x: Tensor, offs: Tensor, recipe: str,
                                   rowwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_quantize(x, offs, recipe, rowwise, True)
    if not _quantize_cuda().supported(x, recipe):
        raise ValueError(f"x (shape {tuple(x.shape)}, strides {x.stride()}, {x.dtype}) or recipe "
                         f"{recipe!r} is not supported by the CUDA quantize kernels")
    outs = _quantize_outputs(x, offs, recipe, rowwise, True)
    data, scale, col_data, col_scale = outs
    cuda = _quantize_cuda()
    if cuda.aligned(x) and cuda.fits(x, recipe, col_scale.shape[1]):
        cuda.quantize_group_columns(x, offs, col_data, col_scale, data if rowwise else None,
                                    scale if rowwise else None, recipe)
    else:
        _quantize_into(x, offs, recipe, rowwise, True, outs)
    return outs


@_grouped_quantize_columns_cuda.register_fake
def _(x, offs, recipe, rowwise):
    _check_quantize(x, offs, recipe, rowwise, True)
    return _quantize_outputs(x, offs, recipe, rowwise, True)


# ---------------------------------------------------------------------- moe_activation_quantize


def _check_activation_quantize(h, offs, activation, gate_up_layout, recipe, probs, rowwise,
                               columnwise) -> None:
    from compiled_moe.ops.activations import check_activation_input
    from compiled_moe.ops.moe_mlp import check_probs

    check_recipe(recipe)
    check_activation_input(h, activation, gate_up_layout)
    check_offs(offs)
    check_probs(probs, h.shape[0])
    check_same_device("h", h, offs=offs, probs=probs)
    if not (rowwise or columnwise):
        raise ValueError("ask for rowwise and/or columnwise output")


def _activation_outputs(h, offs, activation, recipe, rowwise, columnwise):
    from compiled_moe.ops.activations import activation_columns

    return _quantize_outputs(h, offs, recipe, rowwise, columnwise,
                             shape=(h.shape[0], activation_columns(h, activation)))


# On sm_90 with fp8_blockwise both ways (FC2's forward and its weight gradient) and 16-bit h, one
# CUDA kernel reads h and writes only the FP8 data and scales (kernels/quantize_cuda.py); a in
# h's dtype never goes through memory. Elsewhere: the activation op, then grouped_quantize.
# Opaque in compiled graphs, as the CUDA quantizer is.
def _register_host_activation_quantize(module) -> list[str]:
    """The C++ host layer's moe_activation_quantize CUDA kernel (csrc/host/fp8.cpp): checks and
    the launch of the one-pass kernel (fp8_blockwise both ways; its plan asked of
    quantize_cuda.host_activation_plan once per shape); the op's Python kernel serves the rest."""
    from compiled_moe import native

    if not (module.has_cuda and native.available()):
        return []
    return module.register_moe_activation_quantize(
        lambda h, offs, activation: _quantize_cuda().host_activation_plan(h, offs, activation),
        lambda *args: _moe_activation_quantize._kernel(*args))


@kernel_op("moe_activation_quantize", device_types=("cuda", "cpu"), host=_register_host_activation_quantize)
@on_tensor_device
def _moe_activation_quantize(h: Tensor, offs: Tensor, activation: str, gate_up_layout: str,
                             recipe: str, probs: Optional[Tensor] = None, rowwise: bool = True,
                             columnwise: bool = False, alpha: float = reference.GPT_OSS_ALPHA,
                             limit: float = reference.GPT_OSS_LIMIT
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_activation_quantize(h, offs, activation, gate_up_layout, recipe, probs, rowwise,
                               columnwise)
    cuda = _quantize_cuda() if rowwise and columnwise and h.device.type == "cuda" else None
    if cuda is not None and cuda.activation_supported(h, recipe, activation) and cuda.aligned(h):
        outs = _activation_outputs(h, offs, activation, recipe, True, True)
        data, scale, col_data, col_scale = outs
        if cuda.activation_fits(h, activation, col_scale.shape[1]):
            cuda.activate_quantize(h, offs,
                                   None if probs is None else probs.to(torch.float32).contiguous(),
                                   activation, gate_up_layout == "interleaved", alpha, limit,
                                   col_data, col_scale, data, scale)
            return outs
    a = torch.ops.compiled_moe.moe_activation(h, activation, gate_up_layout, alpha, limit)
    return torch.ops.compiled_moe.grouped_quantize(reference.scale_rows(a, probs), offs, recipe,
                                                   rowwise, columnwise)


@_moe_activation_quantize.register_fake
def _(h, offs, activation, gate_up_layout, recipe, probs=None, rowwise=True, columnwise=False,
      alpha=reference.GPT_OSS_ALPHA, limit=reference.GPT_OSS_LIMIT):
    _check_activation_quantize(h, offs, activation, gate_up_layout, recipe, probs, rowwise,
                               columnwise)
    return _activation_outputs(h, offs, activation, recipe, rowwise, columnwise)


# ---------------------------------------------------------------------------- scaled_grouped_mm


def _check_fp8(name: str, t, ndim: int) -> None:
    check_tensor(name, t, ndim, dtypes=(FP8_DTYPE,))


def _check_scale(name: str, scale, shape: tuple, recipe: str) -> None:
    check_tensor(name, scale, len(shape), dtypes=(quantized_scale_dtype(recipe),))
    if tuple(scale.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} for recipe {recipe!r}, "
                         f"got {tuple(scale.shape)}")


def _check_out(out_dtype) -> None:
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES} or None, got {out_dtype}")


def _check_scaled_mm(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias=None) -> None:
    check_recipe(recipe)
    _check_fp8("a", a, 2)
    _check_fp8("b", b, 3)
    check_offs(offs, b.shape[0])
    check_same_device("a", a, b=b, a_scale=a_scale, b_scale=b_scale, offs=offs, bias=bias)
    check_bias(bias, b.shape[0], b.shape[2])
    m, k = a.shape
    g, kb, n = b.shape
    if k != kb:
        raise ValueError(f"a has K={k} columns but b is (G, K, N) = {tuple(b.shape)}; "
                         f"K must match")
    if a.stride(1) != 1:
        raise ValueError("a must be row-major (a.stride(1) == 1): FP8 tensor cores read it K-major")
    if b.stride(1) != 1:
        raise ValueError("b must be K-major (b.stride(1) == 1): pass the rowwise data of a "
                         "(G, N, K) weight as data.transpose(-2, -1)")
    br, bc = fp8_block(recipe, weight=True)
    _, ac = fp8_block(recipe)
    _check_scale("a_scale", a_scale, (m, _blocks(k, ac)), recipe)
    _check_scale("b_scale", b_scale, (g, _cdiv(n, br), _blocks(k, bc)), recipe)
    _check_out(out_dtype)


def _register_host_scaled_mm(module) -> list[str]:
    """The C++ host layer's scaled_grouped_mm CUDA kernel (csrc/host/fp8.cpp): checks and the
    Hopper kernel's launch for fp8_blockwise (its plan asked of scaled_grouped_mm_sm90.host_plan
    once per shape); the op's Python kernel serves the rest."""
    from compiled_moe import native

    if not (module.has_cuda and native.available()):
        return []
    return module.register_scaled_grouped_mm(lambda *args: _sm90().host_plan(*args),
                                             lambda *args: _scaled_grouped_mm._kernel(*args))


# bias (G, N), optional: added to each group's fp32 product before it is rounded to out_dtype
# (as grouped_mm does); it comes last in the schema so that calls without it keep their form.
@kernel_op("scaled_grouped_mm", device_types=("cuda", "cpu"), traced=True, host=_register_host_scaled_mm)
@on_tensor_device
def _scaled_grouped_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
                       recipe: str, out_dtype: Optional[torch.dtype] = None,
                       bias: Optional[Tensor] = None) -> Tensor:
    _check_scaled_mm(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias)
    if not use_kernel(a):
        return reference.scaled_grouped_mm(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias)
    if _sm90().supported(a, b, recipe, bias):
        return _ops.fp8_blockwise_grouped_mm_sm90(a, b, a_scale, b_scale, offs, out_dtype,
                                                  bias)
    out = a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or torch.bfloat16)
    _kernels()[1].scaled_grouped_mm(a, b, a_scale, b_scale, offs, recipe, out, bias)
    return out


@_scaled_grouped_mm.register_fake
def _(a, b, a_scale, b_scale, offs, recipe, out_dtype=None, bias=None):
    _check_scaled_mm(a, b, a_scale, b_scale, offs, recipe, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or torch.bfloat16)


# The CUDA kernel of csrc/fp8_grouped_mm.cu, which scaled_grouped_mm calls for fp8_blockwise on
# Hopper. An opaque custom op, because inductor cannot trace a driver launch. It makes
# scaled_grouped_mm's checks (it is reachable as
# torch.ops.compiled_moe.fp8_blockwise_grouped_mm_sm90, and a bad call must not reach the
# kernel).
@kernel_op("fp8_blockwise_grouped_mm_sm90", autograd="none")
@on_tensor_device
def _fp8_blockwise_grouped_mm_sm90(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                                   offs: Tensor, out_dtype: Optional[torch.dtype] = None,
                                   bias: Optional[Tensor] = None) -> Tensor:
    _check_scaled_mm(a, b, a_scale, b_scale, offs, "fp8_blockwise", out_dtype, bias)
    (m, k), n = a.shape, b.shape[2]
    out = a.new_empty((m, n), dtype=out_dtype or torch.bfloat16)
    if m == 0 or n == 0:
        return out
    sm90 = _sm90()
    if k > 0 and sm90.supported(a, b, "fp8_blockwise", bias) and sm90.aligned(a, b):
        sm90.scaled_grouped_mm(a, b, a_scale, b_scale, offs, out, bias)
    else:  # K = 0, an unaligned view or a strided bias: the Triton kernel handles them
        _kernels()[1].scaled_grouped_mm(a, b, a_scale, b_scale, offs, "fp8_blockwise", out, bias)
    return out


@_fp8_blockwise_grouped_mm_sm90.register_fake
def _(a, b, a_scale, b_scale, offs, out_dtype=None, bias=None):
    _check_scaled_mm(a, b, a_scale, b_scale, offs, "fp8_blockwise", out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or torch.bfloat16)


def _check_scaled_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype) -> None:
    check_recipe(recipe)
    _check_fp8("a_t", a_t, 2)
    _check_fp8("d_t", d_t, 2)
    check_offs(offs)
    check_same_device("a_t", a_t, d_t=d_t, a_scale=a_scale, d_scale=d_scale, offs=offs)
    k, m = a_t.shape
    n, md = d_t.shape
    if m != md:
        raise ValueError(f"a_t is (K, M) = {tuple(a_t.shape)} but d_t is (N, M) = "
                         f"{tuple(d_t.shape)}; M must match")
    for name, t in (("a_t", a_t), ("d_t", d_t)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be columnwise data of grouped_quantize "
                             f"({name}.stride(1) == 1)")
    slots = fp8_column_slots(m, offs.shape[0], recipe)
    _check_scale("a_scale", a_scale, (k, slots), recipe)
    _check_scale("d_scale", d_scale, (n, slots), recipe)
    _check_out(out_dtype)


def _register_host_scaled_wgrad(module) -> list[str]:
    """The C++ host layer's scaled_grouped_mm_wgrad CUDA kernel (csrc/host/fp8.cpp): checks and
    the Hopper kernel's launch (its plan asked of scaled_grouped_mm_sm90.host_wgrad_plan once per
    shape); the op's Python kernel serves the rest."""
    from compiled_moe import native

    if not (module.has_cuda and native.available()):
        return []
    return module.register_scaled_grouped_mm_wgrad(lambda *args: _sm90().host_wgrad_plan(*args),
                                                   lambda *args: _scaled_grouped_mm_wgrad._kernel(*args))


@kernel_op("scaled_grouped_mm_wgrad", device_types=("cuda", "cpu"), traced=True,
           host=_register_host_scaled_wgrad)
@on_tensor_device
def _scaled_grouped_mm_wgrad(a_t: Tensor, d_t: Tensor, a_scale: Tensor, d_scale: Tensor,
                             offs: Tensor, recipe: str,
                             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_scaled_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype)
    if not use_kernel(a_t):
        return reference.scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe,
                                                 out_dtype)
    if _sm90().wgrad_supported(a_t, d_t, recipe, offs.shape[0]):
        return _ops.fp8_grouped_mm_wgrad_sm90(a_t, d_t, a_scale, d_scale, offs, recipe,
                                              out_dtype)
    out = a_t.new_empty((offs.shape[0], a_t.shape[0], d_t.shape[0]),
                        dtype=out_dtype or torch.bfloat16)
    _kernels()[1].scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out)
    return out


@_scaled_grouped_mm_wgrad.register_fake
def _(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype=None):
    _check_scaled_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype)
    return a_t.new_empty((offs.shape[0], a_t.shape[0], d_t.shape[0]),
                         dtype=out_dtype or torch.bfloat16)


def _check_sm90_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype) -> None:
    _check_scaled_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype)
    recipes = _sm90().WGRAD_RECIPES
    if recipe not in recipes:
        raise ValueError(f"recipe must be one of {recipes} for the Hopper kernel, got {recipe!r}")


# The CUDA weight-gradient kernel of csrc/fp8_grouped_mm.cu (fp8_blockwise and fp8_rowwise on
# Hopper), opaque for the same reason as the forward's, with the same checks.
@kernel_op("fp8_grouped_mm_wgrad_sm90", autograd="none")
@on_tensor_device
def _fp8_grouped_mm_wgrad_sm90(a_t: Tensor, d_t: Tensor, a_scale: Tensor, d_scale: Tensor,
                               offs: Tensor, recipe: str,
                               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    _check_sm90_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype)
    sm90 = _sm90()
    (k, _), n, g = a_t.shape, d_t.shape[0], offs.shape[0]
    out = a_t.new_empty((g, k, n), dtype=out_dtype or torch.bfloat16)
    if k == 0 or n == 0 or g == 0:
        return out
    if a_t.shape[1] == 0:  # no rows: every group is empty
        return out.zero_()
    if sm90.aligned(a_t, d_t, out):
        sm90.scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out)
    else:  # an unaligned view: the Triton kernel
        _kernels()[1].scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out)
    return out


@_fp8_grouped_mm_wgrad_sm90.register_fake
def _(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype=None):
    _check_sm90_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe, out_dtype)
    return a_t.new_empty((offs.shape[0], a_t.shape[0], d_t.shape[0]),
                         dtype=out_dtype or torch.bfloat16)
