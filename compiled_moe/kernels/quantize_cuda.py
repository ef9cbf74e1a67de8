"""Launcher of the CUDA columnwise quantize kernels in ``csrc/grouped_quantize.cu``.

``grouped_quantize`` of 2-D x with columnwise output and recipe fp8_blockwise runs them on sm_90
and later GPUs (the e4m3 conversion instruction, mbarrier waits), when x's rows are 16-byte
aligned 8-column chunks (``supported``); with rowwise output too, the same launch writes the
rowwise blocks (x is read once). Everything else runs the Triton kernels of ``kernels/quantize.py``.
Both give the reference's bits.

``activate_quantize`` runs the same kernel on FC1's output h: the stages hold h's gate and up
columns, and each team writes a = act(h) (* probs) over them before quantizing it (FC2's FP8
input, both ways, without a going through memory in x's dtype).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from compiled_moe import host as host_layer, native
from compiled_moe.kernels.activations import CODES, GATED  # the CUDA kernel's codes too
from compiled_moe.kernels.configs import quantize_columns_cuda_config
from compiled_moe.kernels.grouped_mm import _num_sms
from compiled_moe.reference import fp8_column_slots

# The C++ host layer's plans (csrc/host/plans.h): what a launch needs beyond its tensors.
QuantizeColumnsPlan = host_layer.plan_type("QuantizeColumnsPlan")
QuantizeRowsPlan = host_layer.plan_type("QuantizeRowsPlan")

RECIPES = ("fp8_blockwise",)  # mxfp8: see csrc/grouped_quantize.cu
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def enabled() -> bool:
    """COMPILED_MOE_QUANTIZE=triton turns the CUDA kernels off (for comparisons)."""
    return os.environ.get("COMPILED_MOE_QUANTIZE", "cuda") != "triton"


def supported(x, recipe: str) -> bool:
    """Static conditions (known while tracing): recipe, device, dtype and x's layout. The
    address is checked at launch, where the Triton kernels take over if it is unaligned."""
    if recipe not in RECIPES or not enabled() or x.dim() != 2 or x.dtype not in _SUFFIX:
        return False
    if x.device.type != "cuda" or not _sm90_or_later(x.device.index or 0):
        return False
    return (x.shape[1] % 8 == 0 and x.stride(1) == 1
            and (x.stride(0) * x.element_size()) % native.TMA_ALIGN == 0)


@functools.lru_cache(maxsize=None)
def _sm90_or_later(device_index: int) -> bool:
    """The kernels need sm_90 (mbarrier try_wait) and NVRTC."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and native.available()


def aligned(x) -> bool:
    return x.data_ptr() % native.TMA_ALIGN == 0


_SHARED_LIMIT = 227 * 1024


def threads(dtype: torch.dtype) -> int:
    """A CTA's threads: teams of 8 consumer warps (two for 16-bit x, one for fp32) and a producer
    warp (csrc/grouped_quantize.cu)."""
    return 32 * (8 * (1 if dtype == torch.float32 else 2) + 1)


def stage_bytes(dtype: torch.dtype) -> int:
    """One stage of the kernel's ring: a 128 x 128 tile of x with 16 elements of padding after
    every 16 rows (csrc/grouped_quantize.cu, Stage)."""
    esize = 4 if dtype == torch.float32 else 2
    return 8 * (16 * 128 * esize + 16 * esize)


def shared_bytes(dtype: torch.dtype, stages: int, slots: int, pieces: int = 1) -> int:
    """A CTA's shared memory: the ring's stages (pieces tiles each) with two mbarriers and an
    item (6 ints) each, 32 scan ints, the slot table."""
    return stages * (pieces * stage_bytes(dtype) + 16 + 24) + 32 * 4 + (slots + 1) * 4


def fits(x, recipe: str, slots: int) -> bool:
    """Two stages fit beside the slot table (up to about 41 K slots for 16-bit x, M of about 5 M
    rows; 25 K for fp32); larger inputs run the Triton kernels."""
    return shared_bytes(x.dtype, 2, slots) <= _SHARED_LIMIT


def _columns_launch(x, slots: int, rowwise: bool) -> tuple[str, int, int, int, int]:
    """(kernel name, grid, shared bytes, stages, rows per band) of quantize_group_columns."""
    K = x.shape[1]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cfg = quantize_columns_cuda_config(stage_bytes(x.dtype), shared_bytes(x.dtype, 0, slots), rowwise)
    grid = max(1, min(cfg.ctas_per_sm * _num_sms(dev), slots * -(-K // 128)))
    name = f"quantize_{'rows_columns' if rowwise else 'columns'}_fp8_blockwise_{_SUFFIX[x.dtype]}"
    return name, grid, shared_bytes(x.dtype, cfg.num_stages, slots), cfg.num_stages, cfg.group_m


def quantize_group_columns(x, offs, col_q, col_s, row_q, row_s, recipe: str,
                           slot_group=None) -> None:
    """Columnwise blocks of x (M, K) inside the groups of offs into col_q (K, M) / col_s (K, S)
    and, when row_q is not None, the rowwise blocks into row_q (M, K) / row_s. The caller checked
    ``supported``, ``aligned`` and ``fits``; outputs as ``ops.fp8._quantize_outputs`` makes them.
    slot_group (default: the config's): slots per band of the kernel's item order."""
    M, K = x.shape
    if K == 0:
        return
    G, S = offs.shape[0], col_s.shape[1]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    rowwise = row_q is not None
    name, grid, shared, stages, group_m = _columns_launch(x, S, rowwise)
    rq, rs = (row_q, row_s) if rowwise else (col_q, col_s)  # unused pointers when not rowwise
    i32, i64 = native.int32, native.int64
    native.launch_driver(native.kernel("grouped_quantize", name, dev), grid, threads(x.dtype),
                         shared,
                         x, i64(x.stride(0)), offs.contiguous(), i32(M), i32(K), i32(G), i32(S),
                         i32(max(1, slot_group or group_m)), i32(stages),
                         col_q, i64(col_q.stride(0)), col_s, *_strides(col_s),
                         rq, i64(rq.stride(0)), rs, *_strides(rs))


def host_plan(x, offs, rowwise: bool):
    """The C++ host layer's question on its first grouped_quantize call at a shape (2-D x,
    fp8_blockwise, columnwise output): its QuantizeColumnsPlan, or None where the kernel does
    not take x (then the op's Python kernel serves). The address is checked at each call."""
    recipe = "fp8_blockwise"
    slots = fp8_column_slots(x.shape[0], offs.shape[0], recipe)
    if not supported(x, recipe) or not fits(x, recipe, slots):
        return None
    dev = x.device.index
    name, grid, shared, stages, group_m = _columns_launch(x, slots, rowwise)
    handle = native.function_handle(native.kernel("grouped_quantize", name, dev), dev)
    return QuantizeColumnsPlan(function=handle, grid=grid, threads=threads(x.dtype),
                               shared_bytes=shared, num_stages=stages, group_m=max(1, group_m),
                               slots=slots)


def host_rows_plan(x):
    """The C++ host layer's question on its first rowwise-only grouped_quantize call (2-D x,
    fp8_blockwise) of a dtype on a device: the QuantizeRowsPlan of
    csrc/grouped_quantize.cu's quantize_rows kernel, or None where it does not run (then the
    op's Python kernel serves)."""
    if not enabled() or x.dtype not in _SUFFIX or not _sm90_or_later(x.device.index):
        return None
    dev = x.device.index
    name = f"quantize_rows_fp8_blockwise_{_SUFFIX[x.dtype]}"
    return QuantizeRowsPlan(function=native.function_handle(native.kernel("grouped_quantize", name, dev), dev),
                            sms=_num_sms(dev))


def _strides(scale):
    """A scale tensor's two element strides, as the kernels take them. Any layout works; the
    op's columnwise scales, K contiguous, make an item's 128 column-scale stores one run."""
    return native.int64(scale.stride(0)), native.int64(scale.stride(1))


def _pieces(activation: str) -> int:
    """128-column pieces of h per stage: gate and up, or the one input of the plain ones."""
    return 2 if CODES[activation] in GATED else 1


def activation_supported(h, recipe: str, activation: str) -> bool:
    """``supported`` for FC1's output h: 16-bit only (two stages of fp32 gate and up tiles would
    leave the ring one stage deep), and the activation's columns a multiple of 8 (the up piece
    of stacked h starts 16-byte aligned)."""
    if h.dtype == torch.float32 or not supported(h, recipe):
        return False
    return _pieces(activation) == 1 or h.shape[1] % 16 == 0


def activation_fits(h, activation: str, slots: int) -> bool:
    return shared_bytes(h.dtype, 2, slots, _pieces(activation)) <= _SHARED_LIMIT


def _activation_launch(h, inter: int, slots: int, activation: str) -> tuple[str, int, int, int, int]:
    """(kernel name, grid, shared bytes, stages, rows per band) of activate_quantize for FC1's
    output h and the activation's inter columns."""
    pieces = _pieces(activation)
    dev = h.device.index if h.device.index is not None else torch.cuda.current_device()
    cfg = quantize_columns_cuda_config(pieces * stage_bytes(h.dtype), shared_bytes(h.dtype, 0, slots), True)
    grid = max(1, min(cfg.ctas_per_sm * _num_sms(dev), slots * -(-inter // 128)))
    return (f"activate_quantize_fp8_blockwise_{_SUFFIX[h.dtype]}", grid,
            shared_bytes(h.dtype, cfg.num_stages, slots, pieces), cfg.num_stages, max(1, cfg.group_m))


def host_activation_plan(h, offs, activation: str):
    """The C++ host layer's question on its first moe_activation_quantize call at a shape
    (fp8_blockwise, both ways): the QuantizeColumnsPlan of activate_quantize, or None where the kernel
    does not take h (then the op's Python kernel serves). The address is checked at each
    call."""
    recipe = "fp8_blockwise"
    slots = fp8_column_slots(h.shape[0], offs.shape[0], recipe)
    if not activation_supported(h, recipe, activation) or not activation_fits(h, activation, slots):
        return None
    inter = h.shape[1] // _pieces(activation)
    name, grid, shared, stages, group_m = _activation_launch(h, inter, slots, activation)
    dev = h.device.index
    handle = native.function_handle(native.kernel("grouped_quantize", name, dev), dev)
    return QuantizeColumnsPlan(function=handle, grid=grid, threads=threads(h.dtype),
                               shared_bytes=shared, num_stages=stages, group_m=group_m, slots=slots)


def activate_quantize(h, offs, probs, activation: str, interleaved: bool, alpha: float,
                      limit: float, col_q, col_s, row_q, row_s) -> None:
    """a = act(h) (* probs, fp32 (M,)) quantized fp8_blockwise both ways into row_q (M, I) /
    row_s and col_q (I, M) / col_s, as ``grouped_quantize(a, offs, "fp8_blockwise", True,
    True)`` lays them out. The caller checked ``activation_supported``, ``aligned`` and
    ``activation_fits``."""
    M, inter = row_q.shape
    if inter == 0:
        return
    G, S = offs.shape[0], col_s.shape[1]
    dev = h.device.index if h.device.index is not None else torch.cuda.current_device()
    name, grid, shared, stages, group_m = _activation_launch(h, inter, S, activation)
    i32, i64 = native.int32, native.int64
    native.launch_driver(
        native.kernel("grouped_quantize", name, dev), grid, threads(h.dtype), shared,
        h, i64(h.stride(0)), offs.contiguous(), i32(M), i32(inter), i32(G), i32(S),
        i32(group_m), i32(stages),
        col_q, i64(col_q.stride(0)), col_s, *_strides(col_s),
        row_q, i64(row_q.stride(0)), row_s, *_strides(row_s),
        i32(CODES[activation]), i32(int(interleaved)),
        probs if probs is not None else ctypes.c_uint64(0),
        ctypes.c_float(alpha), ctypes.c_float(limit))
