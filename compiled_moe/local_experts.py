"""The experts block on this process's experts: route -> permute -> FC1 -> activation -> FC2 ->
weighted combine, composed of the package's ops (what :func:`compiled_moe.moe_experts` runs
without an expert-parallel group, and what expert parallelism runs on each rank's received
rows).

Two sync-free paths: the fused MLP (route -> moe_mlp with the gather in FC1 -> combine), the
default, and the unfused one (separate permute, grouped GEMMs and activation), which also takes
a callable activation and FP8 recipes (with a named activation, FC2's FP8 input is quantized
straight from FC1's output). Eager calls of a few pairs on Hopper run as one C++ host call.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from compiled_moe.reference import (ACTIVATIONS, GATE_UP_LAYOUTS, GATED_ACTIVATIONS,
                                    GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_recipe)
from compiled_moe.fp8 import fp8_activation_grouped_mm
from compiled_moe.kernels.configs import HOST_BLOCK_MAX_PAIRS, fp8_group_rows, mlp_gathers_input
from compiled_moe.mlp import (_needs_grad, activation_constants, apply_activation,
                              check_fp8_weights, grouped_linear)
from compiled_moe.ops._dispatch import check_same_device, check_same_dtype, check_tensor, is_real_tensor


def _host_block():
    from compiled_moe import host

    return host.module()


def host_block_applies(hidden, topk_ids, w1) -> bool:
    """The block runs as one C++ host call forward and one backward (csrc/host/ops.cpp,
    moe_experts, composed of the ops' C++ kernels): an eager call on real CUDA tensors, bf16 or
    fp16, on Hopper (whose GEMMs the layer launches), up to configs.HOST_BLOCK_MAX_PAIRS pairs
    (where host time dominates: decoding, small batches; above it the fused MLP's Triton FC1 is
    the faster GPU work)."""
    if (torch.compiler.is_compiling() or hidden.device.type != "cuda" or not is_real_tensor(hidden)
            or torch._C._len_torch_dispatch_stack() != 0
            or hidden.dtype not in (torch.bfloat16, torch.float16)
            or not 0 < topk_ids.numel() <= HOST_BLOCK_MAX_PAIRS):
        return False
    from compiled_moe.native import hopper

    return hopper(hidden.device.index) and _host_block() is not None


def check_experts_args(hidden, topk_ids, topk_weights, w1, w2, activation, gate_up_layout,
                        b1, b2, fp8_recipe) -> None:
    check_tensor("hidden", hidden, 2)
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    check_tensor("topk_weights", topk_weights, 2, None)
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    check_tensor("w1", w1, 3)
    check_tensor("w2", w2, 3)
    if not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
    num_tokens, hidden_size = hidden.shape
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids and topk_weights must both be (T, k) with T = {num_tokens}, "
                         f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    num_experts, n1, k1 = w1.shape
    if k1 != hidden_size:
        raise ValueError(f"w1 must be (E, N1, H) with H = {hidden_size} (like nn.Linear weights; "
                         f"pass .transpose(-2, -1) of an (E, H, N1) tensor), got {tuple(w1.shape)}")
    gated = activation in GATED_ACTIVATIONS or callable(activation)
    inter = w2.shape[2] if callable(activation) else (n1 // 2 if gated else n1)
    if activation in GATED_ACTIVATIONS and n1 % 2:
        raise ValueError(f"w1's dim 1 must be even (gate and up) for {activation}, got {n1}")
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(f"w2 must be (E, H, I) = ({num_experts}, {hidden_size}, {inter}), "
                         f"got {tuple(w2.shape)}")
    for name, b in (("b1", b1), ("b2", b2)):
        if b is not None:
            check_tensor(name, b, 2, None)
    if b1 is not None and tuple(b1.shape) != (num_experts, n1):
        raise ValueError(f"b1 must be (E, N1) = ({num_experts}, {n1}), got {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (num_experts, hidden_size):
        raise ValueError(f"b2 must be (E, H) = ({num_experts}, {hidden_size}), got {tuple(b2.shape)}")
    check_same_device("hidden", hidden, topk_ids=topk_ids, topk_weights=topk_weights, w1=w1,
                      w2=w2, b1=b1, b2=b2)
    if fp8_recipe is not None:
        check_recipe(fp8_recipe)
    else:  # (FP8 quantizes the weights from any float dtype, e.g. fp32 master weights)
        check_same_dtype("hidden", hidden, w1=w1, w2=w2)


def local_moe_experts(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor,
                      w2: Tensor, *, activation: str | Callable[[Tensor], Tensor] = "swiglu",
                      gate_up_layout: str = "stacked", b1: Tensor | None = None,
                      b2: Tensor | None = None, alpha: float = GPT_OSS_ALPHA,
                      limit: float = GPT_OSS_LIMIT, fp8_recipe: str | None = None,
                      fused: bool | None = None, fp8_weights: tuple | None = None) -> Tensor:
    """:func:`compiled_moe.moe_experts` without ``ep_group``: every expert is here; ids outside
    [0, E) are skipped. Same arguments and result."""
    if not torch.compiler.is_compiling():
        # Compiled, the ops check these arguments when the graph is built (their fake
        # functions), and the tensors' guards pin what was checked. Traced, these checks put
        # about 20 more guards on the block, checked on every call (guard check on a CPU host:
        # about 1.7x that of the same five tensors alone, against 1.8x-2.3x before).
        check_experts_args(hidden, topk_ids, topk_weights, w1, w2, activation, gate_up_layout, b1,
                            b2, fp8_recipe)
    w1_fp8, w2_fp8 = check_fp8_weights(fp8_weights, fp8_recipe)
    num_experts = w1.shape[0]
    if (fused is None and fp8_recipe is None and not callable(activation)
            and host_block_applies(hidden, topk_ids, w1)):
        return _host_block().moe_experts(hidden, topk_ids, topk_weights, w1, w2, b1, b2, activation,
                                         gate_up_layout, alpha, limit)
    if fused is None:
        fused = fp8_recipe is None and not callable(activation)
    if fused:
        if fp8_recipe is not None or callable(activation):
            raise ValueError("fused=True needs a named activation and no fp8_recipe")
        offs, row_of, source = torch.ops.compiled_moe.moe_route(topk_ids, num_experts, 1)
        save_h = _needs_grad(hidden, w1, w2, b1, b2, topk_weights)
        constants = activation_constants(activation, alpha, limit)
        if mlp_gathers_input(w2.shape[2]):
            y, _ = torch.ops.compiled_moe.moe_mlp(
                hidden, offs, w1, w2, activation, gate_up_layout, b1=b1, b2=b2, source=source,
                row_of=row_of, save_h=save_h, **constants)
        else:
            x = torch.ops.compiled_moe.moe_permute(hidden, row_of, source)
            y, _ = torch.ops.compiled_moe.moe_mlp(x, offs, w1, w2, activation, gate_up_layout,
                                                  b1=b1, b2=b2, save_h=save_h, **constants)
        return torch.ops.compiled_moe.moe_unpermute(y, row_of, source, topk_weights)
    # FP8: groups start on 16-row boundaries (so the FP8 weight-gradient kernel reads by TMA)
    # or 32 (see fp8_group_rows).
    pad = 1 if fp8_recipe is None else fp8_group_rows(num_experts)
    offs, row_of, source = torch.ops.compiled_moe.moe_route(topk_ids, num_experts, pad)
    x = torch.ops.compiled_moe.moe_permute(hidden, row_of, source)
    h = grouped_linear(x, w1, offs, b1, fp8_recipe, w1_fp8)
    if fp8_recipe is not None and not callable(activation):  # FC2's FP8 input in one pass over h
        y = fp8_activation_grouped_mm(h, w2.transpose(-2, -1), offs, activation=activation,
                                      gate_up_layout=gate_up_layout, recipe=fp8_recipe, bias=b2,
                                      weight_fp8=w2_fp8, alpha=alpha, limit=limit)
    else:
        a = activation(h) if callable(activation) else apply_activation(
            h, activation, gate_up_layout, alpha, limit)
        y = grouped_linear(a, w2, offs, b2, fp8_recipe, w2_fp8)
    return torch.ops.compiled_moe.moe_unpermute(y, row_of, source, topk_weights)
