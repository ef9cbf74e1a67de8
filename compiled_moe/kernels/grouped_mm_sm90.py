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
_THREADS = _LAUNCH["SM90_THREADS"]
_BOX_BYTES = 64 * 128  # one 64-row x 64-element box of a 2-byte operand
_STAGE_BYTES = (2 + 4) * _BOX_BYTES  # 128 columns of a, 256 of b
_OUT_STAGE_BYTES = 2 * 64 * 256 * 2  # the two consumers' output tiles, staged for TMA stores
_MAX_STAGES = 3  # what fits a Hopper block's 227 KB beside the output staging
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_OUT_MAP_TYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16", torch.float32: "FLOAT32"}
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
    out_ok = (grad_out.shape[1] * out_dtype.itemsize) % _ALIGN == 0 if out is None else _tma_out(out)
    return (a.dtype in _WGRAD_KERNELS and out_dtype in _OUT_KINDS and _token_major(a)
            and _token_major(grad_out) and out_ok)


def _shared_bytes(num_stages: int, num_groups: int = 0) -> int:
    # ring of 48 KB stages + output staging + 1024 alignment slack + 2 x 8 mbarriers
    # (+ forward: 32 scan ints and 3 ints per group; weight gradient: the tile queue)
    schedule = 4 * (32 + 3 * num_groups) if num_groups else TILE_QUEUE_BYTES
    return num_stages * _STAGE_BYTES + _OUT_STAGE_BYTES + 1024 + 2 * 8 * 8 + schedule


def launch_wgrad(source: str, kernel: str, grid: int, shared_bytes: int, offs, M: int, G: int,
                 tiles_per_group: int, rows_per_step: int, claim_steps: int, row_dim: int, dev: int,
                 *args) -> None:
    """A weight gradient's two kernels (csrc/sm90.cuh, TileQueue): wgrad_tile_order chooses from
    offs between its tiles in the fixed order and tiles claimed at run time (where the fixed
    order is unbalanced, or where tiles average claim_steps steps or more; 0: never for that
    reason), on the device (no host sync), and writes per-group copies of the operand maps
    args[0] and args[1] whose dimension row_dim (the rows the gradient reduces) ends at each
    group's end (write_group_maps); then `kernel` and `kernel`_claimed of csrc/`source`.cu launch
    with args, those maps and that choice, and the one not chosen returns at once."""
    order = torch.empty(2, dtype=torch.int32, device=offs.device)  # the choice, the claims' counter
    maps = torch.empty(G * 2 * 128, dtype=torch.uint8, device=offs.device)
    i32 = native.int32
    native.launch_driver(native.kernel("grouped_mm", "wgrad_tile_order", dev), 1, _LAUNCH["ORDER_THREADS"],
                         _LAUNCH["ORDER_SCRATCH_BYTES"],
                         offs, i32(M), i32(G), i32(tiles_per_group), i32(rows_per_step), i32(claim_steps),
                         i32(grid), order, args[0], args[1], maps, i32(row_dim))
    for function in (kernel, kernel + "_claimed"):
        native.launch_driver(native.kernel(source, function, dev), grid, _THREADS, shared_bytes, *args, maps, order)


def _map(t: torch.Tensor) -> native.TensorMap:
    """(rows, cols) 2-byte tensor as bytes: dims {2 cols, rows}, boxes of 64 rows x 128 bytes."""
    rows, cols = t.shape
    return native.tensor_map(t.data_ptr(), (cols * 2, rows), (t.stride(0) * 2,), (128, 64))


def _out_map(out: torch.Tensor) -> native.TensorMap:
    """(G, P, Q) output with unit column stride: dims {Q, P, G}, boxes of 128 bytes x 64 rows."""
    G, P, Q = out.shape
    es = out.element_size()
    return native.tensor_map(out.data_ptr(), (Q, P, G), (out.stride(1) * es, out.stride(0) * es),
                             (128 // es, 64, 1), _OUT_MAP_TYPES[out.dtype])


def grouped_mm_wgrad(a, grad_out, offs, out, accumulate: bool, accumulate_mask,
                     num_stages=None) -> None:
    """out[g] (K, N) (+)= a_g^T @ grad_out_g. The caller checked ``wgrad_supported`` and
    ``aligned``; accumulate needs fp32 out."""
    if out.stride(2) != 1:  # a (G, N, K) buffer seen as (G, K, N): out^T[g] = grad_out_g^T @ a_g
        a, grad_out, out = grad_out, a, out.transpose(1, 2)
    M, P = a.shape
    Q = grad_out.shape[1]
    G = out.shape[0]
    if P == 0 or Q == 0 or G == 0:
        return
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid, tiles_per_group, num_stages = _wgrad_launch_sizes(P, Q, G, dev, num_stages)
    offs = offs.contiguous()
    i32, i64 = native.int32, native.int64
    launch_wgrad(
        "grouped_mm", _WGRAD_KERNELS[a.dtype], grid,
        _shared_bytes(num_stages), offs, M, G, tiles_per_group, 64, 0, 1, dev,
        _map(a), _map(grad_out), _out_map(out),
        i32(_OUT_KINDS[out.dtype]), i32(int(accumulate)),
        accumulate_mask if accumulate_mask is not None else i64(0),  # null: every group adds
        offs, i32(M), i32(P), i32(Q), i32(G), i32(num_stages),
    )


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
def wgrad_plan(P: int, Q: int, G: int, dtype: torch.dtype, dev: int) -> GroupedMmWgradPlan:
    grid, tiles_per_group, num_stages = _wgrad_launch_sizes(P, Q, G, dev)

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


def bias_in_pairs(bias):
    """bias, or a contiguous copy where its rows do not start at even elements: the kernels
    copy each thread's two bias columns as one 4- or 8-byte piece."""
    if bias is not None and (bias.stride(0) % 2 or bias.data_ptr() % (2 * bias.element_size())):
        return bias.clone(memory_format=torch.contiguous_format)
    return bias


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
    host = host_layer.cuda_module()
    if host is not None:  # maps and launches from C++, without ctypes' argument packing
        host.launch_grouped_mm_sm90(a, b, offs, bias, out, plan)  # it pairs bias, makes offs contiguous
        return
    bias = bias_in_pairs(bias)
    offs = offs.contiguous()
    # Operands as bytes (2 per element): a in 128-row x 128-byte boxes; b in 64 k-rows x 128 bytes
    # of n (N-major) or 256 n-rows x 128 bytes of k (K-major); out in 64 x 64-element boxes.
    # (csrc/host/ops.cpp's launch_grouped_mm_sm90 builds the same maps.)
    if _b_n_major(b):  # dgrad: b is the (G, N_out, K_in) weight itself
        b_map = native.tensor_map(b.data_ptr(), (N * 2, K, G), (b.stride(1) * 2, b.stride(0) * 2),
                                  (128, 64, 1))
    else:  # forward: b is the transposed view of the weight
        b_map = native.tensor_map(b.data_ptr(), (K * 2, N, G), (b.stride(2) * 2, b.stride(0) * 2),
                                  (128, 256, 1))
    # The skipping kernels load a's tile as two 64-row boxes, or 16-row boxes where a group has
    # a few rows left; the others as one box of 128 rows (the second map is then unused).
    a_map = native.tensor_map(a.data_ptr(), (K * 2, M), (a.stride(0) * 2,), (128, 64 if plan.skipping else 128))
    a_rows_map = (native.tensor_map(a.data_ptr(), (K * 2, M), (a.stride(0) * 2,), (128, 16))
                  if plan.skipping else a_map)
    out_map = native.tensor_map(out.data_ptr(), (N, M, 1), (out.stride(0) * 2, out.stride(0) * 2 * M),
                                (64, 64, 1), _OUT_MAP_TYPES[out.dtype])
    partial = (torch.empty(plan.max_splits * M * N + 2, device=a.device, dtype=torch.float32)
               if plan.max_splits > 1 else None)
    i32, i64 = native.int32, native.int64
    out_kind = i32(_OUT_KINDS[out.dtype])
    native.launch_function(
        plan.function, plan.grid, _THREADS, plan.shared_bytes,
        a_map, a_rows_map, b_map, out_map, out, out_kind, i64(out.stride(0)),
        bias if bias is not None else i64(0), i32(_OUT_KINDS[bias.dtype] if bias is not None else -1),
        i64(bias.stride(0) if bias is not None else 0),
        offs, i32(M), i32(N), i32(K), i32(G), i32(plan.num_stages),
        partial if partial is not None else i64(0), i32(plan.max_splits), i32(plan.forced_splits),
    )
    if partial is not None:
        native.launch_function(plan.split_sum, plan.split_sum_grid, 256, 0,
                               partial, out, out_kind, i64(out.stride(0)), i32(M), i32(N),
                               i32(plan.max_splits))
