"""Launchers of the Hopper FP8 grouped GEMMs in ``csrc/fp8_grouped_mm.cu`` (wgmma + TMA).

Used on sm_90 for ``scaled_grouped_mm`` with recipe fp8_blockwise and for
``scaled_grouped_mm_wgrad`` with fp8_blockwise or fp8_rowwise, when the operands meet TMA's
alignment rules (``supported`` / ``wgrad_supported``); everything else runs the Triton kernels.
"""

from __future__ import annotations

import os

import torch

from compiled_moe import host as host_layer, native
from compiled_moe.native import TMA_ALIGN as _ALIGN, hopper
from compiled_moe.native import tma_aligned as aligned  # noqa: F401 (the ops' launch check)
from compiled_moe.kernels.configs import (FP8_WGRAD_CLAIM_STEPS, fp8_blockwise_sm90_config,
                                          fp8_wgrad_sm90_config, size_hint)
from compiled_moe.kernels.grouped_mm import _num_sms
from compiled_moe.kernels.grouped_mm_sm90 import TILE_QUEUE_BYTES

_THREADS = native.launch_constants()["SM90_THREADS"]  # csrc/sm90_launch.cuh
MAX_GROUPS = 2048  # the tile list lives in shared memory beside the ring
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_TILE_BYTES = 128 * 128  # one 128 x 128 e4m3 tile
_STAGE_BYTES = 2 * _TILE_BYTES
_WGRAD_SIDE_BYTES = 2 * 128 * 16  # the weight gradient's side boxes of a stage (csrc: SIDE_BYTES)
_SHARED_LIMIT = 227 * 1024


def enabled() -> bool:
    """COMPILED_MOE_FP8_GEMM=triton turns the CUDA kernel off (for comparisons)."""
    return os.environ.get("COMPILED_MOE_FP8_GEMM", "cuda") != "triton"


def supported(a, b, recipe: str, bias=None) -> bool:
    """Static conditions (known while tracing): the recipe, device, group count and strides
    (of bias too: unit column stride). Addresses are checked at launch, where the Triton kernel
    takes over if one is unaligned."""
    if recipe != "fp8_blockwise" or not enabled():
        return False
    if bias is not None and (bias.stride(1) != 1 or bias.dtype not in _OUT_KINDS):
        return False
    if a.device.type != "cuda" or not hopper(a.device.index or 0):
        return False
    host_layer.require_cuda_module("scaled_grouped_mm")  # the one launcher of these kernels
    k, n = a.shape[1], b.shape[2]
    # n % 8: the output's rows (bf16 or wider) start at 16-byte multiples, for its TMA stores.
    return (k % _ALIGN == 0 and n % 8 == 0 and b.shape[0] <= MAX_GROUPS
            and a.stride(1) == 1 and a.stride(0) % _ALIGN == 0
            and b.stride(1) == 1 and b.stride(2) % _ALIGN == 0 and b.stride(0) % _ALIGN == 0)


def _shared_bytes(num_groups: int, num_stages: int, out_dtype: torch.dtype,
                  block_n: int = 128) -> int:
    # ring of stages (a's tile and block_n / 128 tiles of b) + the two consumers' 64 x block_n
    # output staging + their copies of the tile's bias (block_n fp32 each) + 1024 alignment
    # slack + 2 x 8 mbarriers + 32 scan ints + 3 ints per group
    staging = 2 * 64 * block_n * out_dtype.itemsize
    return ((1 + block_n // 128) * _TILE_BYTES * num_stages + staging + 2 * block_n * 4 + 1024
            + 2 * 8 * 8 + 4 * (32 + 3 * num_groups))


def _last_offset(t: torch.Tensor) -> int:
    """The element offset of t's last element from its first."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def fit_stages(requested: int, shared_bytes) -> int:
    """The requested ring depth, less where shared_bytes(stages) does not fit in a block."""
    n = requested
    while n > 2 and shared_bytes(n) > _SHARED_LIMIT:
        n -= 1
    return n


# (cluster, block_n) -> kernel
_KERNELS = {(1, 128): "fp8_blockwise_grouped_mm", (2, 128): "fp8_blockwise_grouped_mm_x2",
            (1, 256): "fp8_blockwise_grouped_mm_n256"}


# What a launch needs beyond its tensors, fixed for a problem's shape: computed once per shape,
# used by this module's launchers and by the C++ host layer, which asks for it on its first call
# at a shape. Fields: csrc/host/plans.h, the one definition both sides read.
ScaledGroupedMmPlan = host_layer.plan_type("ScaledGroupedMmPlan")
ScaledGroupedMmWgradPlan = host_layer.plan_type("ScaledGroupedMmWgradPlan")


def scale_offsets_fit(a_scale, b_scale) -> bool:
    """The consumers index the scales with int32 offsets and step one past the last: the
    128 x 256 tiles need the largest offset below 2**30."""
    return max(_last_offset(a_scale), _last_offset(b_scale)) < 2**30


def forward_plan(M: int, N: int, K: int, G: int, out_dtype: torch.dtype, has_bias: bool,
                 scales_fit: bool, dev: int, num_stages=None, cluster=None,
                 block_n=None) -> ScaledGroupedMmPlan:
    """The launch of out (M, N) = a (M, K) @ b (G, K, N): cluster (1 or 2) and block_n (128 or
    256: the tile's columns; 256 without a cluster and for 2-byte outputs only), by default the
    config's: CTAs that share each a tile by TMA multicast."""
    cfg = fp8_blockwise_sm90_config(size_hint(M), N, K, G)
    cluster = cluster or cfg.cluster
    block_n = block_n or cfg.block_n
    # 128 x 256 tiles: 2-byte outputs (fp32 staging would not fit beside the ring), no cluster,
    # and scale offsets that fit in an int32 with a k step to spare.
    if out_dtype.itemsize > 2 or cluster > 1 or not scales_fit:
        block_n = 128
    shared = lambda n: _shared_bytes(G, n, out_dtype, block_n)  # noqa: E731
    num_stages = fit_stages(num_stages or cfg.num_stages, shared)
    name = _KERNELS[cluster, block_n] + ("_bias" if has_bias else "")
    kernel = native.kernel("fp8_grouped_mm", name, dev)
    grid = _num_sms(dev) // cluster * cluster
    if cluster > 1:
        fit = native.max_active_clusters(kernel, _THREADS, shared(num_stages), grid)
        grid = min(grid, cluster * max(fit, 1))
    return ScaledGroupedMmPlan(function=native.function_handle(kernel, dev), grid=grid,
                               shared_bytes=shared(num_stages), num_stages=num_stages)


def host_plan(a, b, a_scale, b_scale, bias, out_dtype):
    """The C++ host layer's question on its first scaled_grouped_mm call (fp8_blockwise) at a
    shape: the plan where the Hopper kernel applies to these operands (``supported``, M, N,
    K > 0), else None (then the op's Python kernel serves). Addresses are checked at each
    call."""
    (M, K), (G, _, N) = a.shape, b.shape
    if not (supported(a, b, "fp8_blockwise", bias) and M > 0 and N > 0 and K > 0):
        return None
    return forward_plan(M, N, K, G, out_dtype, bias is not None,
                        scale_offsets_fit(a_scale, b_scale), a.device.index)


def scaled_grouped_mm(a, b, a_scale, b_scale, offs, out, bias=None, num_stages=None,
                      cluster=None, block_n=None) -> None:
    """out (M, N) = a (M, K) @ b (G, K, N) (+ bias (G, N)), e4m3 K-major operands with
    blockwise scales. The caller checked ``supported``, ``aligned`` and M, N, K > 0; the
    launch options are forward_plan's."""
    M, K = a.shape
    G, _, N = b.shape
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan = forward_plan(M, N, K, G, out.dtype, bias is not None,
                        scale_offsets_fit(a_scale, b_scale), dev, num_stages, cluster, block_n)
    # (the C++ layer builds the tensor maps, pairs bias, makes offs contiguous)
    host_layer.require_cuda_module("scaled_grouped_mm").launch_fp8_blockwise_sm90(
        a, b, a_scale, b_scale, offs, bias, out, plan)


WGRAD_RECIPES = ("fp8_blockwise", "fp8_rowwise")  # fp32 scales, per 128 rows or per group


def wgrad_supported(a_t, d_t, recipe: str, num_groups: int) -> bool:
    """Weight gradient from columnwise data, static conditions: the recipe, device, group count
    and strides (rows of 16-byte multiples: TMA's rule). Addresses are checked at launch."""
    if recipe not in WGRAD_RECIPES or not enabled():
        return False
    if a_t.device.type != "cuda" or not hopper(a_t.device.index or 0):
        return False
    host_layer.require_cuda_module("scaled_grouped_mm_wgrad")
    return (num_groups <= MAX_GROUPS
            and all(t.stride(1) == 1 and t.stride(0) % _ALIGN == 0 for t in (a_t, d_t)))


def _wgrad_shared_bytes(num_groups: int, num_stages: int, out_dtype: torch.dtype) -> int:
    # ring (tiles, side boxes, 256 scales a stage) + the two consumers' 64 x 128 output
    # staging + 1024 alignment slack + 3 x 8 mbarriers + the tile queue + 32 scan ints + 3
    # ints per group
    staging = 2 * 64 * 128 * out_dtype.itemsize
    return (num_stages * (_STAGE_BYTES + _WGRAD_SIDE_BYTES + 256 * 4) + staging + 1024 + 3 * 8 * 8
            + TILE_QUEUE_BYTES + 4 * (32 + 3 * num_groups))


def wgrad_stages(requested: int, num_groups: int, out_dtype: torch.dtype) -> int:
    """The requested ring depth, less where it does not fit beside the output staging and the
    groups' table (fp32 outputs stage twice the bytes of bf16)."""
    return fit_stages(requested, lambda n: _wgrad_shared_bytes(num_groups, n, out_dtype))


def wgrad_plan(M: int, P: int, Q: int, G: int, out_dtype: torch.dtype, dev: int, num_stages=None) -> ScaledGroupedMmWgradPlan:
    """The launch of out (G, P, Q) from a_t (P, M) and d_t (Q, M); num_stages by default the
    config's, fitted to shared memory."""
    cfg = fp8_wgrad_sm90_config(size_hint(M) // G)
    num_stages = wgrad_stages(num_stages or cfg.num_stages, G, out_dtype)
    tiles_per_group = -(-P // 128) * -(-Q // 128)

    def handle(source, name):
        return native.function_handle(native.kernel(source, name, dev), dev)
    return ScaledGroupedMmWgradPlan(
        function=handle("fp8_grouped_mm", "fp8_grouped_mm_wgrad"),
        claimed=handle("fp8_grouped_mm", "fp8_grouped_mm_wgrad_claimed"),
        tile_order=handle("grouped_mm", "wgrad_tile_order"), grid=min(_num_sms(dev), G * tiles_per_group),
        shared_bytes=_wgrad_shared_bytes(G, num_stages, out_dtype), num_stages=num_stages,
        tiles_per_group=tiles_per_group, claim_steps=FP8_WGRAD_CLAIM_STEPS)


def host_wgrad_plan(a_t, d_t, recipe: str, out_dtype, num_groups: int):
    """The C++ host layer's question on its first scaled_grouped_mm_wgrad call at a shape: the
    plan where the Hopper kernel applies (``wgrad_supported``, P, Q > 0), else None (then the
    op's Python kernel serves). Addresses are checked at each call."""
    (P, M), Q = a_t.shape, d_t.shape[0]
    if not (wgrad_supported(a_t, d_t, recipe, num_groups) and P > 0 and Q > 0):
        return None
    return wgrad_plan(M, P, Q, num_groups, out_dtype, a_t.device.index)


def scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe: str, out,
                            num_stages=None) -> None:
    """out[g] (P, Q) = a_g^T @ d_g from columnwise e4m3 data a_t (P, M), d_t (Q, M) with their
    columnwise scales (P, S), (Q, S): 1x128 blocks (fp8_blockwise) or one per group
    (fp8_rowwise). The caller checked ``wgrad_supported``, ``aligned`` and P, Q, G > 0; out
    (G, P, Q) is contiguous."""
    P, M = a_t.shape
    Q = d_t.shape[0]
    G = out.shape[0]
    dev = a_t.device.index if a_t.device.index is not None else torch.cuda.current_device()
    plan = wgrad_plan(M, P, Q, G, out.dtype, dev, num_stages)
    host_layer.require_cuda_module("scaled_grouped_mm_wgrad").launch_fp8_wgrad_sm90(
        a_t, d_t, a_scale, d_scale, offs, recipe == "fp8_rowwise", out, plan)
