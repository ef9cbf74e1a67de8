"""CPU tier against a real client: torchtitan's MoE layer (its debug models' shapes) under
``torch.compile(backend="compiled_moe")``. The backend rewrites its routing (a stable argsort
and per-expert counts from a one-hot sum), its score-weighted scatter-add combine
(torchtitan's ``deterministic_scatter_add``), and its gather with its three
``torch._grouped_mm`` calls and the gated activation between them (one moe_mlp that reads
w1 and w3 as they are) onto compiled_moe's ops, in one graph, and the layer's output, every gradient and its
load-balancing buffer stay those of eager.

Skipped where torchtitan is not installed (CI installs it with the README's test command). The
layer is built from ``torchtitan.models.common``, which imports with torch 2.11 and newer."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from bench_torchtitan import torchtitan_moe  # noqa: E402
from helpers import RewriteCapture  # noqa: E402

CM = torch.ops.compiled_moe

# The MoE layers of torchtitan's debug models: (dim, experts, top_k, hidden, shared experts'
# hidden, route_norm) of qwen3's debugmodel_moe and deepseek_v3's debugmodel.
LAYERS = {"qwen3": (256, 64, 8, 768, None, True), "deepseek_v3": (256, 8, 3, 256, 512, False)}


def _moe_layer(model: str):
    """fp32 on the CPU, weights at a scale that keeps the routing and activations away from
    saturation."""
    *shape, route_norm = LAYERS[model]
    return torchtitan_moe(*shape, route_norm=route_norm, device="cpu", dtype=torch.float32,
                          scale=0.05)


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
    assert counts["gated_activation"] == 1  # the three GEMMs and the gather: one moe_mlp
    targets = set(cap.targets())
    assert {CM.moe_route.default, CM.moe_mlp.default, CM.moe_unpermute.default} <= targets
    assert torch.argsort not in targets and torch._grouped_mm not in targets
    assert CM.grouped_mm.default not in targets and CM.moe_permute.default not in targets
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
