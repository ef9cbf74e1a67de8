"""Hugging Face transformers experts backend: ``experts_implementation="compiled_moe"``.

Importing this module registers the backend (``register()`` runs on import and is idempotent).
Every MoE model whose experts class carries transformers' ``@use_experts_implementation``
decorator (Qwen2/3-MoE, Mixtral, DeepSeek-V3, GPT-OSS, ... in transformers >= 5.17) can then
switch to it in one line::

    import compiled_moe.integrations.transformers  # noqa: F401  (registers "compiled_moe")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="compiled_moe")
    # or, on a model already loaded:
    model.set_experts_implementation("compiled_moe")
    # or through the config (also for AutoModelForCausalLM.from_config):
    config = AutoConfig.from_pretrained(name, experts_implementation="compiled_moe")

The choice is not written by ``save_pretrained``: pass it again when loading. Register before
building or loading the model (transformers validates the name then).

The backend runs :func:`compiled_moe.moe_experts` on the module's own parameters (no copy: a
transposed (E, H, N) storage such as GPT-OSS's is passed as a strided view) and is differentiable
in the hidden states, the routing weights and every expert parameter. It never reads device data
on the host, so it works under CUDA graphs and ``torch.compile(fullgraph=True)``.

The activation between the two projections is recognised once per module: when the model's
``_apply_gate`` (gated experts) or ``act_fn`` (non-gated experts) computes one of the package's
named activations (``swiglu``, ``geglu``, ``gpt_oss`` with the module's alpha/limit, ``relu2``,
``gelu``, ``silu``; stacked or interleaved gate/up), that name is used, so the package's own
kernels serve it. Anything else runs the model's own function between the two grouped GEMMs.
The choice is cached on the module the first time it runs outside ``torch.compile``; reset it
with :func:`reset_activation_cache` after changing a module's activation or its constants.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

import compiled_moe
from compiled_moe import reference

from transformers.integrations.moe import ExpertsInterface

__all__ = ["NAME", "register", "experts_forward", "resolve_activation", "reset_activation_cache"]

NAME = "compiled_moe"

# (activation, gate_up_layout, alpha, limit); activation None means "the module's own function".
ActivationSpec = tuple

_CACHE_ATTR = "_compiled_moe_activation"
_OWN: ActivationSpec = (None, "stacked", reference.GPT_OSS_ALPHA, reference.GPT_OSS_LIMIT)

# Attribute names under which models keep GPT-OSS-style gate constants (GPT-OSS and
# openai_privacy_filter: alpha/limit; MiniMax-M3: swiglu_alpha/swiglu_limit).
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")
_LIMIT_ATTRS = ("limit", "swiglu_limit")


def _number_attr(module: torch.nn.Module, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = getattr(module, name, None)
        # Tensors are skipped: reading their value would be a host sync (and they may be learned).
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
    return None


def _candidates(module: torch.nn.Module, gated: bool) -> list[ActivationSpec]:
    alpha0, limit0 = reference.GPT_OSS_ALPHA, reference.GPT_OSS_LIMIT
    if not gated:
        return [(name, "stacked", alpha0, limit0) for name in ("silu", "gelu", "relu2")]
    out = [(name, layout, alpha0, limit0)
           for name in ("swiglu", "geglu") for layout in ("stacked", "interleaved")]
    alpha = _number_attr(module, _ALPHA_ATTRS)
    limit = _number_attr(module, _LIMIT_ATTRS)
    constants = {(alpha if alpha is not None else alpha0, limit if limit is not None else limit0),
                 (alpha0, limit0)}
    for a, lim in sorted(constants):
        out += [("gpt_oss", layout, a, lim) for layout in ("stacked", "interleaved")]
    return out


def _probe(module: torch.nn.Module, gated: bool) -> Tensor:
    # float64 on the CPU: the comparison below reads values, and doing it on a small host tensor
    # costs no device sync. Values reach well past any clamp limit so that clamps, GELU
    # approximations and layouts all give different outputs.
    limit = _number_attr(module, _LIMIT_ATTRS) or reference.GPT_OSS_LIMIT
    span = max(12.0, 2.0 * abs(limit))
    gen = torch.Generator().manual_seed(0)
    width = 128 if gated else 64
    return (torch.rand(32, width, generator=gen, dtype=torch.float64) * 2 - 1) * span


def resolve_activation(module: torch.nn.Module) -> ActivationSpec:
    """Which of the package's named activations the module's experts compute, by behaviour.

    Runs the module's ``_apply_gate`` (``has_gate``) or ``act_fn`` on a float64 CPU probe and
    compares it with each named activation (both gate/up layouts; for ``gpt_oss``, the alpha
    and limit found on the module and the defaults). Returns ``(activation, gate_up_layout,
    alpha, limit)``; ``activation`` is None when none matches (the module's own function is
    then used).
    """
    gated = bool(getattr(module, "has_gate", True))
    own = module._apply_gate if gated else getattr(module, "act_fn", None)
    if own is None:
        return _OWN
    probe = _probe(module, gated)
    try:
        with torch.no_grad():
            got = own(probe)
    except Exception:  # noqa: BLE001  a device-only or custom function: keep the model's own.
        return _OWN
    if not isinstance(got, Tensor) or got.dtype not in (torch.float32, torch.float64):
        return _OWN
    got = got.to(torch.float64)
    for spec in _candidates(module, gated):
        name, layout, alpha, limit = spec
        want = reference.activation(probe, name, layout, alpha, limit)
        # rtol covers gates that compute in fp32 internally (a mathematically identical function).
        if want.shape == got.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return spec
    return _OWN


def _activation_of(module: torch.nn.Module) -> ActivationSpec:
    spec = getattr(module, _CACHE_ATTR, None)
    if spec is not None:
        return spec
    if torch.compiler.is_compiling():
        # Probing while tracing would put value-dependent Python control flow in the graph;
        # the model's own function is exact, and inductor fuses it with its neighbours anyway.
        return _OWN
    spec = resolve_activation(module)
    setattr(module, _CACHE_ATTR, spec)
    return spec


def reset_activation_cache(model: torch.nn.Module) -> None:
    """Forget the recognised activation of every experts module in ``model``."""
    for module in model.modules():
        module.__dict__.pop(_CACHE_ATTR, None)


def _maybe_cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def experts_forward(self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """The ExpertsInterface entry: (T, H), (T, k), (T, k) -> (T, H) in ``hidden_states``' dtype.

    ``self`` is a module decorated by ``use_experts_implementation``; its flags (``has_gate``,
    ``has_bias``, ``is_transposed``, ``has_post_expert_norm``) say where the weights are and
    how they are laid out. Expert ids outside [0, E) (expert-parallel sentinels) are dropped.
    """
    gated = self.has_gate
    w1 = self.gate_up_proj if gated else self.up_proj
    w2 = self.down_proj
    b1 = b2 = None
    if self.has_bias:
        b1 = getattr(self, "gate_up_proj_bias" if gated else "up_proj_bias", None)
        b2 = getattr(self, "down_proj_bias", None)
    if self.is_transposed:
        # Stored (E, H, N1) / (E, I, H): the nn.Linear-layout view is free.
        w1 = w1.transpose(-2, -1)
        w2 = w2.transpose(-2, -1)

    name, layout, alpha, limit = _activation_of(self)
    activation = name if name is not None else (self._apply_gate if gated else self.act_fn)

    # Like transformers' grouped_mm backend: activations may arrive in a wider dtype than the
    # weights (autocast, fp32 norms), and the GEMMs run in the weights' dtype.
    dtype = w1.dtype
    x = _maybe_cast(hidden_states, dtype)
    b1, b2 = _maybe_cast(b1, dtype), _maybe_cast(b2, dtype)

    if getattr(self, "has_post_expert_norm", False):
        out = _experts_with_post_norm(self, x, top_k_index, top_k_weights, w1, w2, b1, b2,
                                      activation, layout, alpha, limit)
    else:
        out = compiled_moe.moe_experts(x, top_k_index, top_k_weights, w1, w2,
                                       activation=activation, gate_up_layout=layout, b1=b1, b2=b2,
                                       alpha=alpha, limit=limit)
    return out.to(hidden_states.dtype)


def _experts_with_post_norm(module, x, topk_ids, topk_weights, w1, w2, b1, b2, activation,
                            layout, alpha, limit) -> Tensor:
    # A norm on every expert's output before the routing weights (has_post_expert_norm) sits
    # between FC2 and the weighted combine, inside moe_experts; so the same block is composed
    # here from the package's public ops with the norm in its place.
    offs, row_of, source = compiled_moe.moe_route(topk_ids, w1.shape[0])
    rows = compiled_moe.moe_permute(x, row_of, source)
    h = compiled_moe.grouped_mm(rows, w1.transpose(-2, -1), offs, bias=b1)
    if callable(activation):
        a = activation(h)
    else:
        a = torch.ops.compiled_moe.moe_activation(h, activation, layout, alpha, limit)
    y = compiled_moe.grouped_mm(a, w2.transpose(-2, -1), offs, bias=b2)
    y = module.post_expert_norm(y)
    return compiled_moe.moe_unpermute(y, row_of, source, weights=topk_weights)


def register() -> None:
    """Register ``"compiled_moe"`` in transformers' ExpertsInterface (idempotent).

    After this, ``experts_implementation="compiled_moe"`` is accepted by ``from_pretrained``,
    ``from_config``, the model configs and ``model.set_experts_implementation``.
    """
    if ExpertsInterface._global_mapping.get(NAME) is not experts_forward:
        ExpertsInterface.register(NAME, experts_forward)


register()
