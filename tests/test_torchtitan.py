"""CPU tier against a real client: torchtitan's MoE layer (its debug models' shapes) under
``torch.compile(backend="compiled_moe")``. The backend rewrites its routing (a stable argsort
and per-expert counts from a one-hot sum), its gather, its score-weighted scatter-add combine
(torchtitan's ``deterministic_scatter_add``) and its three ``torch._grouped_mm`` calls onto
compiled_moe's ops, in one graph, and the layer's output, every gradient and its
load-balancing buffer stay those of eager.

Skipped where torchtitan is not installed or does not import (CI installs it with the README's
test command; torchtitan 0.3.0 imports with torch 2.15, not 2.11)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("torchtitan")
try:
    import torchtitan.models.qwen3  # noqa: F401  (0.3.0 needs a newer torch than 2.11)
except ImportError as e:
    pytest.skip(f"torchtitan does not import with torch {torch.__version__}: {e}",
                allow_module_level=True)

from helpers import RewriteCapture  # noqa: E402

CM = torch.ops.compiled_moe


def _moe_layer(model: str, seed: int = 0):
    """The MoE layer of torchtitan's debug model (`model`: qwen3 or deepseek_v3), weights
    random at a scale that keeps the routing and activations away from saturation."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model == "qwen3":
            from torchtitan.models.qwen3 import _debugmodel_moe

            config = _debugmodel_moe("flex")
        else:
            from torchtitan.models.deepseek_v3 import _debugmodel

            config = _debugmodel("flex", "standard")
    layer = next(l.moe for l in config.layers if getattr(l, "moe", None) is not None)
    torch.manual_seed(seed)
    moe = layer.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return moe


def _run(call, moe, x, grad):
    """call(x) forward and backward; the gradients of x and of moe's parameters, and moe's
    load-balancing counts."""
    x = x.detach().clone().requires_grad_(True)
    out = call(x)
    out.backward(grad)
    grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    return out.detach(), grads, moe.tokens_per_expert_E.clone()


def _assert_close_to(got, want, name):
    """Within bf16's rounding of the layer's scale: torchtitan runs its expert GEMMs in bf16
    whatever the model dtype, so eager itself is exact only to that."""
    scale = want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * scale + 1e-6, f"{name}: max error {err} against scale {scale}"


@pytest.mark.parametrize("model", ["qwen3", "deepseek_v3"])
def test_every_part_of_the_layer_is_rewritten(model):
    moe = _moe_layer(model)
    dim = moe.router.gate.in_features
    x = torch.randn(2, 24, dim)
    cap = RewriteCapture()
    torch._dynamo.reset()
    out = torch.compile(copy.deepcopy(moe), backend=cap, fullgraph=True)(x)
    assert len(cap.counts) == 1  # one graph: no breaks
    counts = cap.counts[0]
    assert counts["grouped_mm"] == 3
    assert counts["sorted_dispatch"] == 2  # the gather and the scatter-add combine
    assert counts["sort_routing"] == 1
    targets = set(cap.targets())
    assert {CM.moe_route.default, CM.moe_permute.default, CM.moe_unpermute.default,
            CM.grouped_mm.default} <= targets
    assert torch.argsort not in targets and torch._grouped_mm not in targets
    assert not any("deterministic_scatter_add" in str(t) for t in targets)
    torch.testing.assert_close(out, moe(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model", ["qwen3"])
def test_layer_under_the_backend_matches_eager(model):
    """Forward, every gradient (input, router, w1, w2, w3) and the load-balancing buffer
    under backend="compiled_moe" (inductor, fullgraph) against eager, at two token counts
    (the second compiles dynamic shapes once)."""
    moe = _moe_layer(model)
    dim = moe.router.gate.in_features
    compiled_moe_layer = copy.deepcopy(moe)
    torch._dynamo.reset()
    step = torch.compile(compiled_moe_layer, backend="compiled_moe", fullgraph=True)
    for tokens in (24, 40):
        x = torch.randn(2, tokens, dim)
        grad = torch.randn(2, tokens, dim)
        for m in (moe, compiled_moe_layer):
            m.zero_grad(set_to_none=True)
        want, want_grads, want_counts = _run(moe, moe, x, grad)
        got, got_grads, got_counts = _run(step, compiled_moe_layer, x, grad)
        _assert_close_to(got, want, "out")
        for name, g in want_grads.items():
            assert got_grads[name] is not None, name
            _assert_close_to(got_grads[name], g, name)
        torch.testing.assert_close(got_counts, want_counts)  # tokens_per_expert_E, summed
