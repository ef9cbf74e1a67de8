"""Launchers of the Hopper bf16/fp16 grouped GEMM kernels in ``csrc/grouped_mm.cu`` (wgmma + TMA).

``grouped_mm`` (forward and dgrad) and ``grouped_mm_wgrad`` run the CUDA kernels on sm_90
when the operands meet TMA's rules (``supported`` / ``wgrad_supported``, then ``aligned`` at
launch); everything else runs the Triton kernels.
"""

from __future__ import annotations

import functools
import os

import torch

from compiled_moe import host as host_layer, native
from compiled_moe.native import TMA_ALIGN as _ALIGN, hopper
from compiled_moe.native import tma_aligned as aligned  # noqa: F401 (the ops' launch check)
from compiled_moe.kernels.configs import (grouped_mm_sm90_config, grouped_mm_sm90_split_k,
                                          grouped_mm_wgrad_sm90_config)
from compiled_moe.kernels.grouped_mm import _num_sms

_LAUNCH = native.launch_constants()  # csrc/sm90_launch.cuh
_BOX_BYTES = 64 * 128  # one 64-row x 64-element box of a 2-byte operand
_STAGE_BYTES = (2 + 4) * _BOX_BYTES  # 128 columns of a, 256 of b
_OUT_STAGE_BYTES = 2 * 64 * 256 * 2  # the two consumers' output tiles, staged for TMA stores
_MAX_STAGES = 3  # what fits a Hopper block's 227 KB beside the output staging
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_WGRAD_KERNELS = {torch.bfloat16: "grouped_mm_wgrad_bf16", torch.float16: "grouped_mm_wgrad_f16"}
TILE_QUEUE_BYTES = _LAUNCH["TILE_QUEUE_BYTES"]
_FWD_KERNELS = {torch.bfloat16: "grouped_mm_bf16", torch.float16: "grouped_mm_f16"}
MAX_GROUPS = 1024  # forward: the tile list lives in shared memory beside the ring


def enabled() -> bool:
    """COMPILED_MOE_GEMM=triton turns the CUDA kernels off (for comparisons)."""
    return os.environ.get("COMPILED_MOE_GEMM", "cuda") != "triton"


def _token_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % _ALIGN == 0


def _tma_out(out: torch.Tensor) -> bool:
    """out (G, P, Q) or its (G, Q, P) transpose has unit column stride and 16-byte outer strides."""
    if out.stride(2) != 1:
        out = out.transpose(1, 2)
    es = out.element_size()
    return out.stride(2) == 1 and (out.stride(1) * es) % _ALIGN == 0 and (out.stride(0) * es) % _ALIGN == 0


def _b_n_major(b: torch.Tensor) -> bool:
    return b.stride(2) == 1


def _aligned_strides(t: torch.Tensor) -> bool:
    es = t.element_size()
    return all((st * es) % _ALIGN == 0 for st, size in zip(t.stride(), t.shape) if st != 1)


def supported(a: torch.Tensor, b: torch.Tensor, bias, out_dtype: torch.dtype) -> bool:
    """Forward/dgrad into a fresh (M, N) output, static conditions (known while tracing):
    device, dtypes, strides, group count; N a multiple of 8 (16-byte output stores).
    Addresses are checked by ``aligned`` at launch."""
    if not enabled() or a.device.type != "cuda" or not hopper(a.device.index or 0):
        return False
    host_layer.require_cuda_module("grouped_mm")  # the one launcher of these kernels
    (_, k), (g, _, n) = a.shape, b.shape
    return (a.dtype in _FWD_KERNELS and out_dtype in _FWD_KERNELS and 0 < g <= MAX_GROUPS
            and k > 0 and n % 8 == 0 and n > 0
            and a.stride(1) == 1 and (b.stride(1) == 1 or b.stride(2) == 1)
            and _aligned_strides(a) and _aligned_strides(b)
            and (bias is None or (bias.stride(1) == 1 and bias.dtype in _OUT_KINDS)))


def wgrad_supported(a: torch.Tensor, grad_out: torch.Tensor, out_dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> bool:
    """Weight gradient into ``out`` (an fp32 main_grad, any layout) or, without it, a fresh
    contiguous (G, K, N) output: static conditions. Addresses are checked by ``aligned``."""
    if not enabled() or a.device.type != "cuda" or not hopper(a.device.index or 0):
        return False
    host_layer.require_cuda_module("grouped_mm_wgrad")
    out_ok = (grad_out.shape[1] * out_dtype.itemsize) % _ALIGN == 0 if out is None else _tma_out(out)
    return (a.dtype in _WGRAD_KERNELS and out_dtype in _OUT_KINDS and _token_major(a)
            and _token_major(grad_out) and out_ok)


def _shared_bytes(num_stages: int, num_groups: int = 0) -> int:
    # ring of 48 KB stages + output staging + 1024 alignment slack + 2 x 8 mbarriers
    # (+ forward: 32 scan ints and 3 ints per group; weight gradient: the tile queue)
    schedule = 4 * (32 + 3 * num_groups) if num_groups else TILE_QUEUE_BYTES
    return num_stages * _STAGE_BYTES + _OUT_STAGE_BYTES + 1024 + 2 * 8 * 8 + schedule


def grouped_mm_wgrad(a, grad_out, offs, out, accumulate: bool, accumulate_mask,
                     num_stages=None) -> None:
    """out[g] (K, N) (+)= a_g^T @ grad_out_g. The caller checked ``wgrad_supported`` and
    ``aligned``; accumulate needs fp32 out."""
    if out.stride(2) != 1:  # a (G, N, K) buffer seen as (G, K, N): out^T[g] = grad_out_g^T @ a_g
        a, grad_out, out = grad_out, a, out.transpose(1, 2)
    P = a.shape[1]
    Q = grad_out.shape[1]
    G = out.shape[0]
    if P == 0 or Q == 0 or G == 0:
        return
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan = wgrad_plan(P, Q, G, a.dtype, dev, num_stages)
    host_layer.require_cuda_module("grouped_mm_wgrad").launch_grouped_mm_wgrad_sm90(
        a, grad_out, offs, out, plan, accumulate, accumulate_mask)


def _wgrad_launch_sizes(P: int, Q: int, G: int, dev: int, num_stages=None) -> tuple[int, int, int]:
    """(grid, tiles per group, pipeline stages) of a (G, P, Q) weight gradient: 128 x 256
    tiles, one persistent block per SM at most."""
    num_stages = min(num_stages or grouped_mm_wgrad_sm90_config().num_stages, _MAX_STAGES)
    tiles_per_group = -(-P // 128) * -(-Q // 256)
    return min(_num_sms(dev), G * tiles_per_group), tiles_per_group, num_stages


# What a launch needs beyond its tensors (the kernels as driver handles, their launch sizes and
# the heuristics' choices), fixed for a problem's shape: computed once per shape, used by this
# module's launchers and by the C++ host layer (compiled_moe.host), which asks for it on its
# first call at a shape. Fields: csrc/host/plans.h, the one definition both sides read.
GroupedMmPlan = host_layer.plan_type("GroupedMmPlan")
GroupedMmWgradPlan = host_layer.plan_type("GroupedMmWgradPlan")


@functools.lru_cache(maxsize=4096)
def wgrad_plan(P: int, Q: int, G: int, dtype: torch.dtype, dev: int,
               num_stages=None) -> GroupedMmWgradPlan:
    grid, tiles_per_group, num_stages = _wgrad_launch_sizes(P, Q, G, dev, num_stages)

    def handle(name):
        return native.function_handle(native.kernel("grouped_mm", name, dev), dev)
    name = _WGRAD_KERNELS[dtype]
    return GroupedMmWgradPlan(function=handle(name), claimed=handle(name + "_claimed"),
                              tile_order=handle("wgrad_tile_order"), grid=grid,
                              shared_bytes=_shared_bytes(num_stages), num_stages=num_stages,
                              tiles_per_group=tiles_per_group)


def host_wgrad_plan(a, grad_out, out):
    """The C++ host layer's question on its first grouped_mm_wgrad call at a shape (out: the
    fresh (G, P, Q) output): the plan where the Hopper kernel applies, else None."""
    if not wgrad_supported(a, grad_out, out.dtype, out):
        return None
    return wgrad_plan(a.shape[1], grad_out.shape[1], out.shape[0], a.dtype, a.device.index)


@functools.lru_cache(maxsize=4096)
def forward_plan(M: int, N: int, K: int, G: int, dtype: torch.dtype, n_major: bool, dev: int,
                 num_stages=None, skip_past_rows=None, splits=None) -> GroupedMmPlan:
    name = _FWD_KERNELS[dtype] + ("_nmajor" if n_major else "")
    cfg = grouped_mm_sm90_config(M, G)
    # Split K: at most max_splits k ranges a tile (the kernel picks the count unless forced),
    # their fp32 partial products summed by grouped_mm_split_sum; the count and the groups'
    # last row follow them. Its kernels skip too (a few rows a group).
    max_splits = splits or grouped_mm_sm90_split_k(M, N, K, G)
    skipping = max_splits > 1 or (cfg.skip_past_rows if skip_past_rows is None else skip_past_rows)
    name += "_skip_split" if max_splits > 1 else "_skip" if skipping else ""
    num_stages = min(num_stages or cfg.num_stages, _MAX_STAGES)
    sms = _num_sms(dev)
    split_sum = (native.function_handle(native.kernel("grouped_mm", "grouped_mm_split_sum", dev), dev)
                 if max_splits > 1 else 0)
    return GroupedMmPlan(function=native.function_handle(native.kernel("grouped_mm", name, dev), dev),
                         split_sum=split_sum, grid=sms, shared_bytes=_shared_bytes(num_stages, G),
                         num_stages=num_stages, max_splits=max_splits,
                         forced_splits=int(splits is not None), skipping=int(bool(skipping)),
                         split_sum_grid=max(1, min(-(-M * N // 4 // 256), 4 * sms)))


def host_plan(a, b, bias, out):
    """The C++ host layer's question on its first grouped_mm call at a shape: the plan where
    the Hopper kernel applies to these operands (``supported``), else None."""
    if not supported(a, b, bias, out.dtype):
        return None
    (M, K), (G, _, N) = a.shape, b.shape
    return forward_plan(M, N, K, G, a.dtype, _b_n_major(b), a.device.index)


def grouped_mm(a, b, offs, bias, out, num_stages=None, skip_past_rows=None, splits=None) -> None:
    """out (M, N) = a (M, K) @ b[g] (K, N) (+ bias[g]) per row group; rows past offs[-1] get 0.
    The caller checked ``supported`` and ``aligned``. num_stages and skip_past_rows (bool)
    default to the configs'; splits forces that many k ranges a tile (split K), where by
    default the kernel chooses up to configs.grouped_mm_sm90_split_k."""
    M, K = a.shape
    G, _, N = b.shape
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan = forward_plan(M, N, K, G, a.dtype, _b_n_major(b), dev, num_stages, skip_past_rows, splits)
    # (the C++ layer builds the tensor maps, pairs bias, makes offs contiguous)
    host_layer.require_cuda_module("grouped_mm").launch_grouped_mm_sm90(a, b, offs, bias, out, plan)
