"""The fused expert MLP on expert-sorted tokens (TransformerEngine's grouped MLP contract)."""

from __future__ import annotations

import torch
from torch import Tensor

from compiled_moe.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def activation_constants(activation: str, alpha: float, limit: float) -> dict:
    """alpha/limit keyword arguments for an op call, empty when they are the schema defaults:
    no Python floats then reach the graph, which torch.compile (dynamic=True) would otherwise
    trace as symbolic inputs and restart its analysis for."""
    if activation != "gpt_oss" or (alpha == GPT_OSS_ALPHA and limit == GPT_OSS_LIMIT):
        return {}
    return {"alpha": alpha, "limit": limit}


def moe_mlp(x_sorted: Tensor, offs: Tensor, w1: Tensor, w2: Tensor, *, activation: str = "swiglu",
            gate_up_layout: str = "stacked", probs: Tensor | None = None,
            b1: Tensor | None = None, b2: Tensor | None = None, alpha: float = GPT_OSS_ALPHA,
            limit: float = GPT_OSS_LIMIT) -> Tensor:
    """FC1 -> activation (* probs) -> FC2 per expert, on rows already sorted by expert.

    ``y[r] = (act(x[r] @ w1[g]^T + b1[g]) * probs[r]) @ w2[g]^T + b2[g]`` for the rows r of
    group g (``offs``: int32 (G,) cumulative end rows); rows past offs[-1] are zero.

    Two kernels forward: FC1 computes the gate and up columns of an output index in one
    program and applies bias, activation and probs to its accumulators; FC2 is the grouped
    GEMM. For backward only FC1's pre-activation (M, N1) is kept: the activation is recomputed
    inside FC2's dgrad kernel, which also applies the activation backward.

    Args:
        x_sorted: (M, H) bf16/fp16/fp32, expert-sorted rows (as after an expert-parallel
            all-to-all, or :func:`compiled_moe.moe_permute`).
        offs: int32 (G,), cumulative end row of each expert's group.
        w1: (G, N1, H), nn.Linear layout (N1 = 2I for gated activations), any strides.
        w2: (G, H, I), nn.Linear layout, any strides.
        activation: ``swiglu, geglu, gpt_oss, relu2, gelu, silu``.
        gate_up_layout: ``stacked`` ([gate | up]) or ``interleaved`` (g0 u0 g1 u1 ...).
        probs: optional (M,) routing probability of each row, applied to the activation
            before FC2 (TransformerEngine's scaled activation).
        b1: optional (G, N1); b2: optional (G, H).
        alpha, limit: the ``gpt_oss`` activation's constants.

    Returns:
        (M, H) in x's dtype. Differentiable in x_sorted, w1, w2, probs, b1 and b2.
    """
    y, _ = torch.ops.compiled_moe.moe_mlp(x_sorted, offs, w1, w2, activation, gate_up_layout,
                                          probs, b1, b2,
                                          save_h=_needs_grad(x_sorted, w1, w2, probs, b1, b2),
                                          **activation_constants(activation, alpha, limit))
    return y
