"""The MoE experts block, the Hugging Face ExpertsInterface contract:
hidden (T, H), topk_ids (T, k), topk_weights (T, k) -> (T, H).

:func:`moe_experts` runs the block on this process's experts (compiled_moe.local_experts) or,
with an expert-parallel group, across ranks (compiled_moe.distributed.experts, imported on
first use so that ``import compiled_moe`` does not import torch.distributed's pieces).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from compiled_moe.local_experts import local_moe_experts
from compiled_moe.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT


def moe_experts(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor,
                *, activation: str | Callable[[Tensor], Tensor] = "swiglu", gate_up_layout: str = "stacked",
                b1: Tensor | None = None, b2: Tensor | None = None,
                alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT,
                fp8_recipe: str | None = None, fused: bool | None = None,
                fp8_weights: tuple | None = None, ep_group=None,
                ep_capacity_factor: float | None = 1.25, ep_max_tokens: int | None = None,
                ep_num_chunks: int | None = None):
    """Run every token through its top-k experts and sum the outputs with the routing weights.

    ``out[t] = sum_s topk_weights[t, s] * FC2_e(act(FC1_e(hidden[t])))`` with e = topk_ids[t, s].

    Args:
        hidden: (T, H) bf16/fp16/fp32.
        topk_ids: (T, k) int32/int64 expert ids; ids outside [0, E) are skipped (expert
            parallelism: experts that live on another rank).
        topk_weights: (T, k) routing weights, any float dtype.
        w1: (E, N1, H), nn.Linear layout (HF's ``gate_up_proj``); N1 = 2I for gated
            activations. Any strides: pass ``.transpose(-2, -1)`` of an (E, H, N1) tensor.
        w2: (E, H, I), nn.Linear layout (HF's ``down_proj``); any strides.
        activation: one of ``swiglu, geglu, gpt_oss, relu2, gelu, silu``, or a callable that
            maps FC1's output (rows, N1) to (rows, I) (a model's own activation; it runs as
            plain torch ops between the two grouped GEMMs).
        gate_up_layout: ``stacked`` ([gate | up] halves) or ``interleaved`` (g0 u0 g1 u1 ...).
        b1: optional (E, N1); b2: optional (E, H).
        alpha, limit: the ``gpt_oss`` activation's constants.
        fp8_recipe: None (GEMMs in hidden's dtype) or an FP8 recipe (``fp8_blockwise``,
            ``fp8_rowwise``, ``mxfp8``): both grouped GEMMs, forward and backward, run in FP8
            (see :func:`compiled_moe.fp8.fp8_grouped_mm`); weights stay in their dtype.
        fused: run the fused MLP (:func:`compiled_moe.moe_mlp`'s kernels: FC1 reads hidden
            rows through the routing map (experts up to I = 4096; wider ones permute first,
            see ``kernels.configs.mlp_gathers_input``) and applies the activation in its
            epilogue; backward keeps only FC1's output and recomputes the activation in one
            pass with its backward). Needs a named activation and no FP8 recipe; None (the
            default) picks it whenever those hold, except in eager calls of up to
            ``configs.HOST_BLOCK_MAX_PAIRS`` pairs on Hopper, which run the block as one C++
            host call forward and one backward (``host_block_applies``; it keeps what the fused
            MLP keeps). The fused MLP keeps 0.35-0.71x the memory for backward of the unfused
            path at about the same speed (H200, compiled forward+backward 0.98-1.02x over the
            four model shapes, forward 0.98-1.06x; benchmarks/RESULTS.md).
        fp8_weights: with fp8_recipe, ``(quantize_weight(w1, recipe), quantize_weight(w2,
            recipe))`` computed beforehand (once per optimizer step for several micro-batches);
            None quantizes the weights in the call.
        ep_group: a torch.distributed ProcessGroup of P ranks for expert parallelism: each rank
            passes its own tokens with global ids in [0, E), E = P * w1.shape[0], and its own
            experts (rank r: [r * E/P, (r+1) * E/P)) as w1, w2, b1, b2; see
            docs/expert_parallel.md and :func:`compiled_moe.distributed.ep_moe_experts`.
        ep_capacity_factor: with ep_group, a float for the sync-free mode (rows per rank pair
            ``ceil(factor * ep_max_tokens * k / P)``, pairs past it dropped and counted) or
            None for the exact mode (no drops, one host sync per call).
        ep_max_tokens: with ep_group in the sync-free mode (required there), the most tokens
            any rank passes in one call, the same on every rank: the exchange sizes derive
            from it, so ranks may pass different T (a rank past it drops more, counted).
        ep_num_chunks: with ep_group, the chunks of the exchange/GEMM pipeline (default 2
            over several ranks).

    Returns:
        (T, H) in hidden's dtype. Differentiable in hidden, w1, w2, b1, b2 and topk_weights.
        With ep_group: ``(out, dropped)``, dropped an int64 () device tensor counting this
        rank's dropped pairs.
    """
    if ep_group is not None:
        from compiled_moe.distributed.experts import ep_block

        return ep_block(hidden, topk_ids, topk_weights, w1, w2, ep_group=ep_group,
                        capacity_factor=ep_capacity_factor, max_tokens=ep_max_tokens,
                        num_chunks=ep_num_chunks,
                        activation=activation, gate_up_layout=gate_up_layout, b1=b1, b2=b2,
                        alpha=alpha, limit=limit, fp8_recipe=fp8_recipe, fused=fused,
                        fp8_weights=fp8_weights)
    return local_moe_experts(hidden, topk_ids, topk_weights, w1, w2, activation=activation,
                             gate_up_layout=gate_up_layout, b1=b1, b2=b2, alpha=alpha,
                             limit=limit, fp8_recipe=fp8_recipe, fused=fused,
                             fp8_weights=fp8_weights)
