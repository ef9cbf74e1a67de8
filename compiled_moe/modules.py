"""nn.Modules over the ops: GroupedLinear and MoEExperts.

Weights use nn.Linear's (out_features, in_features) layout per group, which is also how Hugging
Face stores expert weights (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)), so state
dicts load as they are. Models that store experts transposed (GPT-OSS: (E, H, 2I) and (E, I, H))
set ``weights_transposed=True``; the ops take either layout without a copy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from compiled_moe.experts import moe_experts
from compiled_moe.fp8 import fp8_grouped_mm, quantize_weight
from compiled_moe.reference import (ACTIVATIONS, GATE_UP_LAYOUTS, GATED_ACTIVATIONS, GPT_OSS_ALPHA,
                                   GPT_OSS_LIMIT, check_recipe)


def _init_like_linear(weight: Tensor, bias: Tensor | None, in_features: int) -> None:
    """nn.Linear's default init, per group: kaiming_uniform(a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


def _fp8_weights(module: nn.Module, weights: tuple, is_first_microbatch: bool | None):
    """The FP8 quantization of the module's weights for this call (TransformerEngine's
    is_first_microbatch): None quantizes them in the call; True quantizes them now and keeps
    them; False reuses what the last True call kept (the weights must not have changed since:
    call with True after each optimizer step). Without an fp8_recipe there is nothing to keep."""
    if module.fp8_recipe is None or is_first_microbatch is None:
        return None
    if is_first_microbatch:
        module._fp8_weight_cache = tuple(quantize_weight(w, module.fp8_recipe) for w in weights)
    elif getattr(module, "_fp8_weight_cache", None) is None:
        raise ValueError("is_first_microbatch=False reuses the weights' FP8 quantization of an "
                         "earlier is_first_microbatch=True call, and there was none")
    return module._fp8_weight_cache


class GroupedLinear(nn.Module):
    """G independent linear layers over row groups: ``y[r] = x[r] @ weight[g].T + bias[g]``.

    forward(x (M, in_features), offs int32 (G,)) -> (M, out_features); rows past offs[-1] are 0.
    ``fp8_recipe`` (``fp8_blockwise``, ``fp8_rowwise``, ``mxfp8``) runs forward and backward
    GEMMs in FP8 (:func:`compiled_moe.fp8.fp8_grouped_mm`); None keeps the weight's dtype.
    forward's ``is_first_microbatch`` (FP8 only, as in TransformerEngine): True quantizes the
    weight and keeps it, False reuses it for the next micro-batches, None (default) quantizes it
    in every call.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, fp8_recipe: str | None = None):
        super().__init__()
        if fp8_recipe is not None:
            check_recipe(fp8_recipe)
        self.fp8_recipe = fp8_recipe
        kw = dict(device=device, dtype=dtype)
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_like_linear(self.weight, self.bias, self.in_features)

    def forward(self, x: Tensor, offs: Tensor, is_first_microbatch: bool | None = None) -> Tensor:
        from compiled_moe import grouped_mm

        if self.fp8_recipe is not None:
            cached = _fp8_weights(self, (self.weight,), is_first_microbatch)
            return fp8_grouped_mm(x, self.weight.transpose(-2, -1), offs, recipe=self.fp8_recipe,
                                  bias=self.bias, weight_fp8=cached and cached[0])
        return grouped_mm(x, self.weight.transpose(-2, -1), offs, bias=self.bias)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8_recipe={self.fp8_recipe}")


class MoEExperts(nn.Module):
    """The experts of an MoE layer: forward(hidden (T, H), topk_ids (T, k), topk_weights (T, k)) -> (T, H).

    Parameters (Hugging Face names): ``gate_up_proj`` (E, N1, H) with N1 = 2I for gated
    activations (I otherwise), ``down_proj`` (E, H, I), and with ``bias=True``
    ``gate_up_proj_bias`` (E, N1), ``down_proj_bias`` (E, H). ``weights_transposed=True`` stores
    the two weights as (E, H, N1) and (E, I, H) instead. ``fp8_recipe`` runs both grouped GEMMs
    in FP8 (see :func:`compiled_moe.moe_experts`), with forward's ``is_first_microbatch`` as in
    :class:`GroupedLinear`.

    Expert parallelism: with ``ep_group`` (a ProcessGroup of P ranks) ``num_experts`` is the
    global count E and this module holds rank r's experts [r * E/P, (r+1) * E/P) (parameters
    of E/P experts); forward takes this rank's tokens with global ids and returns their
    outputs. ``ep_capacity_factor``, ``ep_max_tokens`` (required by the sync-free mode: the most
    tokens any rank passes to one forward) and ``ep_num_chunks`` are moe_experts'; the pairs
    dropped by the last forward are in ``self.dropped`` (int64 () device tensor).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 activation: str = "swiglu", gate_up_layout: str = "stacked", bias: bool = False,
                 weights_transposed: bool = False, alpha: float = GPT_OSS_ALPHA,
                 limit: float = GPT_OSS_LIMIT, fp8_recipe: str | None = None, device=None,
                 dtype=None, ep_group=None, ep_capacity_factor: float | None = 1.25,
                 ep_max_tokens: int | None = None, ep_num_chunks: int | None = None):
        super().__init__()
        # Checked here rather than at the first forward.
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
        if fp8_recipe is not None:
            check_recipe(fp8_recipe)
        self.fp8_recipe = fp8_recipe
        kw = dict(device=device, dtype=dtype)
        n1 = 2 * intermediate_size if activation in GATED_ACTIVATIONS else intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.ep_group, self.ep_capacity_factor = ep_group, ep_capacity_factor
        self.ep_max_tokens, self.ep_num_chunks = ep_max_tokens, ep_num_chunks
        self.dropped = None
        if ep_group is not None:
            from compiled_moe.distributed.dispatch import (check_group, check_mode,
                                                           check_num_experts)

            check_num_experts(num_experts, check_group(ep_group))
            check_mode(ep_capacity_factor, 1 if ep_num_chunks is None else ep_num_chunks,
                       ep_max_tokens)
            num_experts //= ep_group.size()  # the experts this rank holds
        self.activation, self.gate_up_layout = activation, gate_up_layout
        self.weights_transposed = weights_transposed
        self.alpha, self.limit = alpha, limit
        shape1, shape2 = (num_experts, n1, hidden_size), (num_experts, hidden_size, intermediate_size)
        if weights_transposed:
            shape1, shape2 = (num_experts, hidden_size, n1), (num_experts, intermediate_size, hidden_size)
        self.gate_up_proj = nn.Parameter(torch.empty(shape1, **kw))
        self.down_proj = nn.Parameter(torch.empty(shape2, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, n1, **kw)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_like_linear(self.gate_up_proj, self.gate_up_proj_bias, self.hidden_size)
        _init_like_linear(self.down_proj, self.down_proj_bias, self.intermediate_size)

    def forward(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                is_first_microbatch: bool | None = None) -> Tensor:
        if (not torch.compiler.is_compiling() and isinstance(hidden, Tensor)
                and hidden.shape[-1] != self.hidden_size):
            raise ValueError(f"hidden has {hidden.shape[-1]} features but this MoEExperts has "
                             f"hidden_size={self.hidden_size}")
        w1, w2 = self.gate_up_proj, self.down_proj
        if self.weights_transposed:
            w1, w2 = w1.transpose(-2, -1), w2.transpose(-2, -1)
        out = moe_experts(hidden, topk_ids, topk_weights, w1, w2, activation=self.activation,
                          gate_up_layout=self.gate_up_layout, b1=self.gate_up_proj_bias,
                          b2=self.down_proj_bias, alpha=self.alpha, limit=self.limit,
                          fp8_recipe=self.fp8_recipe,
                          fp8_weights=_fp8_weights(self, (w1, w2), is_first_microbatch),
                          **self._ep_kwargs())
        if self.ep_group is not None:
            out, self.dropped = out
        return out

    def _ep_kwargs(self) -> dict:
        if self.ep_group is None:
            return {}
        return dict(ep_group=self.ep_group, ep_capacity_factor=self.ep_capacity_factor,
                    ep_max_tokens=self.ep_max_tokens, ep_num_chunks=self.ep_num_chunks)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation}, "
                f"gate_up_layout={self.gate_up_layout}, bias={self.gate_up_proj_bias is not None}, "
                f"weights_transposed={self.weights_transposed}, fp8_recipe={self.fp8_recipe}"
                + (f", ep_size={self.ep_group.size()}, ep_capacity_factor="
                   f"{self.ep_capacity_factor}, ep_max_tokens={self.ep_max_tokens}"
                   if self.ep_group is not None else ""))
