"""compiled_moe.lowering, CPU tier: the rewrites replace the stock ops in the FX graph (checked on
the graph itself), the rewritten graphs give the float64 loop's results and gradients, dynamic
token counts compile once, the named backend and enable() run them through inductor, an
unknown torch version falls back to the plain ops, and a MoE block exports and runs from an
AOTInductor package and under cpp_wrapper."""

from __future__ import annotations

import logging
import math
import operator
import warnings

import pytest
import torch

import compiled_moe.lowering as lowering
from helpers import RewriteCapture as Capture, loop_grouped_mm, loop_moe_experts, loop_wgrad, random_offsets

CM = torch.ops.compiled_moe


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


# ------------------------------------------------------------------ torch._grouped_mm


def test_rewrites_grouped_mm_and_gradients():
    g = torch.Generator().manual_seed(0)
    # bf16: torch._grouped_mm's meta function takes nothing else.
    x = torch.randn(37, 24, generator=g).bfloat16()
    w = torch.randn(5, 16, 24, generator=g).bfloat16()  # (G, N, K): nn.Linear layout, used as w.mT
    offs = random_offsets(37, 5, generator=g, empty_groups=1, tail=3)

    def f(x, w, offs):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    cap = Capture()
    xs, ws = _leaf(x), _leaf(w)
    out = torch.compile(f, backend=cap, fullgraph=True)(xs, ws, offs)
    assert cap.counts[-1]["grouped_mm"] == 1
    assert CM.grouped_mm.default in cap.targets() and torch._grouped_mm not in cap.targets()

    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = loop_grouped_mm(x64, w64.transpose(-2, -1), offs)
    cot = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    out.backward(cot.bfloat16())
    ref.backward(cot)
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(ws.grad.double(), w64.grad, rtol=2e-2, atol=5e-2)


def test_rewrites_weight_gradient_form():
    g = torch.Generator().manual_seed(1)
    a, d = torch.randn(29, 16, generator=g).bfloat16(), torch.randn(29, 8, generator=g).bfloat16()
    offs = random_offsets(29, 4, generator=g, empty_groups=1, tail=2)

    def f(a, d, offs):  # torch's 2-D x 2-D form: out[g] = a[rows_g].T @ d[rows_g]
        return torch._grouped_mm(a.t(), d, offs=offs)

    cap = Capture()
    out = torch.compile(f, backend=cap, fullgraph=True)(a, d, offs)
    assert cap.counts[-1]["grouped_mm"] == 1 and torch._grouped_mm not in cap.targets()
    torch.testing.assert_close(out.double(), loop_wgrad(a, d, offs), rtol=2e-2, atol=5e-2)


def test_leaves_other_forms_alone():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 8, 16, generator=g).bfloat16()
    b = torch.randn(3, 16, 8, generator=g).bfloat16()

    def batched(a, b):  # 3-D x 3-D: no offsets, not a MoE projection
        return torch._grouped_mm(a, b)

    cap = Capture()
    out = torch.compile(batched, backend=cap, fullgraph=True)(a, b)
    assert cap.counts[-1] == {"sorted_dispatch": 0, "grouped_mm": 0, "row_masks": 0,
                              "sort_routing": 0, "gated_activation": 0}
    torch.testing.assert_close(out.float(), torch.bmm(a.float(), b.float()), rtol=2e-2, atol=2e-2)

    idx = torch.tensor([2, 0, 1])

    def gather(x, ids):
        # Not a sort permutation, and a permutation of 6 pairs over 8 rows (k=2 needs 3 rows).
        return x[idx // 1].sum(0) + x[ids.sort().indices // 2].sum(0)

    out = torch.compile(gather, backend=cap, fullgraph=True)(a[0], torch.tensor([5, 1, 3, 0, 2, 4]))
    assert cap.counts[-1]["sorted_dispatch"] == 0


def test_gated_activation_rewrite_and_the_forms_it_leaves():
    """silu(gate) * up of x.chunk(2, -1) (either operand order) becomes moe_activation and
    matches eager in value and gradient; other activations, halves of different tensors, a
    chunk along rows, and an in-place silu stay as they are."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 12, generator=g, requires_grad=True)
    y = torch.randn(10, 12, generator=g)

    def gated(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up + up * torch.nn.functional.silu(gate)

    cap = Capture()
    out = torch.compile(gated, backend=cap, fullgraph=True)(x)
    assert cap.counts[-1]["gated_activation"] == 2
    assert cap.targets().count(CM.moe_activation.default) == 2
    want = gated(x.detach().requires_grad_(True))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    x_ref = x.detach().requires_grad_(True)
    gated(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)

    def others(x, y):
        a, b = x.chunk(2, dim=-1)
        c, d = y.chunk(2, dim=-1)
        r0, r1 = x.chunk(2, dim=0)
        return (torch.nn.functional.gelu(a) * b, torch.nn.functional.silu(a) * d,
                torch.nn.functional.silu(r0) * r1, torch.nn.functional.silu(c.clone(), inplace=True) * d)

    cap = Capture()
    outs = torch.compile(others, backend=cap, fullgraph=True)(x.detach(), y)
    assert cap.counts[-1]["gated_activation"] == 0
    for got, want in zip(outs, others(x.detach(), y)):
        torch.testing.assert_close(got, want)


def _two_weight_experts(seed=5, rows=41, hidden=24, inter=16, groups=5):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.3).bfloat16()  # noqa: E731
    return (mk(rows, hidden), mk(groups, inter, hidden), mk(groups, hidden, inter),
            mk(groups, inter, hidden), random_offsets(rows, groups, generator=g, empty_groups=1,
                                                      tail=4))


def test_gate_and_up_grouped_mm_become_one_moe_mlp():
    """grouped_mm(silu(grouped_mm(x, w1^T)) * grouped_mm(x, w3^T), w2^T) on one offs (w1 and
    w3 two weights, as torchtitan keeps them) becomes one moe_mlp reading both, with the
    float64 loop's output and every gradient."""
    x, w1, w2, w3, offs = _two_weight_experts()

    def experts(x, w1, w2, w3, offs):
        gmm = lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)  # noqa: E731
        return gmm(torch.nn.functional.silu(gmm(x, w1)) * gmm(x, w3), w2)

    leaves = [_leaf(t) for t in (x, w1, w2, w3)]
    cap = Capture()
    out = torch.compile(experts, backend=cap, fullgraph=True)(*leaves, offs)
    assert cap.counts[-1]["grouped_mm"] == 3 and cap.counts[-1]["gated_activation"] == 1
    targets = cap.targets()
    assert targets.count(CM.moe_mlp.default) == 1 and CM.grouped_mm.default not in targets

    f64 = [t.double().requires_grad_(True) for t in (x, w1, w2, w3)]
    stacked = torch.cat([f64[1], f64[3]], dim=1)
    want = loop_moe_mlp_sorted(f64[0], stacked, f64[2], offs)
    cot = torch.randn(want.shape, dtype=torch.float64)
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)
    out.backward(cot.bfloat16())
    want.backward(cot)
    for got, ref in zip(leaves, f64):
        scale = ref.grad.abs().max().item()
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=3e-2, atol=3e-2 * scale)


def loop_moe_mlp_sorted(x, w13, w2, offs):
    """swiglu MLP on sorted rows, a loop over groups; rows past the last group 0."""
    out = torch.zeros(x.shape, dtype=x.dtype)
    inter = w2.shape[2]
    start = 0
    for gi, end in enumerate(offs.tolist()):
        h = x[start:end] @ w13[gi].T
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out = out.index_put((torch.arange(start, end),), a @ w2[gi].T)
        start = end
    return out


def test_gate_and_up_grouped_mm_forms_left_alone(caplog):
    """Different rows, different offsets, a gate read elsewhere too: each stays as written,
    and the log says why."""
    x, w1, w2, w3, offs = _two_weight_experts()
    y = torch.randn(x.shape).bfloat16()
    offs2 = offs.clone()
    offs2[0] = 0  # other offsets, the same rows in all

    def gmm(a, w, o):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=o)

    silu = torch.nn.functional.silu
    end = int(offs[-1])  # (torch leaves the rows past the last group unwritten)

    def forms(x, y, w1, w2, w3, offs, offs2):
        other_rows = gmm(silu(gmm(x, w1, offs)) * gmm(y, w3, offs), w2, offs)
        other_offs = gmm(silu(gmm(x, w1, offs)) * gmm(x, w3, offs2), w2, offs)
        gate = gmm(x, w1, offs)
        gate_read_twice = gmm(silu(gate) * gmm(x, w3, offs), w2, offs) + gate[:end].sum()
        return other_rows, other_offs, gate_read_twice

    cap = Capture()
    with caplog.at_level(logging.DEBUG, logger="compiled_moe.lowering"):
        outs = torch.compile(forms, backend=cap, fullgraph=True)(x, y, w1, w2, w3, offs, offs2)
    assert cap.counts[-1]["gated_activation"] == 0
    reasons = "\n".join(r.getMessage() for r in caplog.records)
    for why in ("read different rows", "different offsets", "read elsewhere too"):
        assert why in reasons, reasons
    assert CM.moe_mlp.default not in cap.targets()
    for got, want in zip(outs, forms(x, y, w1, w2, w3, offs, offs2)):
        torch.testing.assert_close(got[:end], want[:end], rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ HF's grouped_mm backend


def _hf_experts(dtype, experts=6, hidden=32, inter=16, k=2, seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    mod = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, hidden ** -0.5)
        mod.down_proj.normal_(0, inter ** -0.5)
    return mod


def _hf_inputs(mod, tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, k, hdim = mod.num_experts, mod.config.num_experts_per_tok, mod.config.hidden_size
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dtype)
    hidden = torch.randn(tokens, hdim, generator=g).to(dtype)
    return hidden, ids, weights


def _hf_forward(mod):
    from transformers.integrations.moe import grouped_mm_experts_forward

    return lambda h, i, w: grouped_mm_experts_forward(mod, h, i, w)


def _errors(mod, fn, hidden, ids, weights, ref, cot):
    """Max abs error of fn's output and gradients (h, w, gate_up_proj, down_proj) against the
    float64 ones."""
    h, w = _leaf(hidden), _leaf(weights)
    out = fn(h, ids, w)
    out.backward(cot.to(out.dtype))
    got = (out, h.grad, w.grad, mod.gate_up_proj.grad, mod.down_proj.grad)
    errs = [(g.double() - r).abs().max().item() for g, r in zip(got, ref)]
    mod.zero_grad(set_to_none=True)
    return errs


def _check_against_loop(mod, fn, hidden, ids, weights, atol, unchecked=()):
    """DESIGN.md's tolerance rule: fn's error against a float64 loop over experts is at most
    twice that of Hugging Face's backend run eagerly in the same dtype, plus atol (except the
    gradients named in ``unchecked``, whose errors are only required finite)."""
    h64, w64 = hidden.double().requires_grad_(True), weights.double().requires_grad_(True)
    w1 = mod.gate_up_proj.detach().double().requires_grad_(True)
    w2 = mod.down_proj.detach().double().requires_grad_(True)
    out = loop_moe_experts(h64, ids, w64, w1, w2, "swiglu", "stacked", None, None)
    cot = torch.randn(out.shape, dtype=torch.float64)
    out.backward(cot)
    ref = (out.detach(), h64.grad, w64.grad, w1.grad, w2.grad)
    errs = _errors(mod, fn, hidden, ids, weights, ref, cot)
    eager = _errors(mod, _hf_forward(mod), hidden, ids, weights, ref, cot)
    for name, e, b in zip(("out", "d hidden", "d weights", "d gate_up_proj", "d down_proj"), errs, eager):
        assert e <= 2 * b + atol or name in unchecked and math.isfinite(e), \
            f"{name}: error {e:.3g} against eager's {b:.3g}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_hf_grouped_mm_backend_is_rewritten(dtype, tol):
    """fp32 goes through transformers' fallback op, bf16 through torch._grouped_mm."""
    mod = _hf_experts(dtype)
    hidden, ids, weights = _hf_inputs(mod, 13, dtype)
    cap = Capture()
    fn = torch.compile(_hf_forward(mod), backend=cap, fullgraph=True)
    # On torch 2.11's CPU, HF's eager bf16 routing-weight gradient is three times as close to
    # float64 as on 2.13-2.15 (error 0.021 against 0.066 here), while ours is the same on every
    # torch (0.054-0.066: an fp32 dot of the bf16 expert outputs, rounded once), so against
    # that peer the rule's bound does not hold there.
    old_cpu_bf16 = dtype == torch.bfloat16 and torch.__version__ < (2, 13)
    _check_against_loop(mod, fn, hidden, ids, weights, tol,
                        unchecked=("d weights",) if old_cpu_bf16 else ())
    assert cap.counts[-1] == {"sorted_dispatch": 2, "grouped_mm": 2, "row_masks": 0,
                              "sort_routing": 1, "gated_activation": 1}
    targets = cap.targets()
    # The sort of the ids and the offsets counted from it are one moe_route, and the inverse
    # permutation the combine had built (empty_like, then a setitem nobody reads) is gone.
    assert CM.moe_route.default in targets
    assert torch.sort not in targets and torch.histc not in targets and torch.cumsum not in targets
    assert operator.setitem not in targets and torch.empty_like not in targets
    assert not any(n.op == "call_method" and n.target == "sort" for n in cap.graphs[-1].nodes)
    assert targets.count(CM.grouped_mm.default) == 2
    # silu(gate) * up of the chunked FC1 output is one moe_activation (swiglu, stacked).
    assert CM.moe_activation.default in targets
    assert torch.nn.functional.silu not in targets and operator.mul not in targets
    assert not any(n.op == "call_method" and n.target == "chunk" for n in cap.graphs[-1].nodes)
    assert CM.moe_permute.default in targets and CM.moe_unpermute.default in targets
    assert torch._grouped_mm not in targets
    # The gather hidden[perm // k] and the combine's sum are gone from the graph.
    assert operator.floordiv not in targets and torch.sum not in targets
    assert not any(n.op == "call_method" and n.target == "sum" for n in cap.graphs[-1].nodes)


def test_expert_parallel_sentinel_masks_are_dropped():
    """Under expert parallelism (and always in transformers 5.17) the backend zero-fills the
    rows of sentinel ids (>= E) three times; past offs[-1] our grouped_mm already writes and
    reads nothing, so the pass drops the fills and the results stay exact."""
    mod = _hf_experts(torch.float32)
    mod._is_expert_parallel = True
    hidden, ids, weights = _hf_inputs(mod, 13, torch.float32)
    ids[::3, 0] = mod.num_experts  # pairs routed to another rank
    ids[5, 1] = mod.num_experts + 4
    cap = Capture()
    fn = torch.compile(_hf_forward(mod), backend=cap, fullgraph=True)
    _check_against_loop(mod, fn, hidden, ids, weights, 1e-4)
    assert cap.counts[-1] == {"sorted_dispatch": 2, "grouped_mm": 2, "row_masks": 3,
                              "sort_routing": 1, "gated_activation": 1}
    nodes = cap.graphs[-1].nodes
    assert not any(n.op == "call_method" and n.target.startswith("masked_fill") for n in nodes)


def test_keeps_masks_that_are_not_past_the_offsets():
    """A fill of rows that grouped_mm computes (the bound is inside histc's range, or the mask
    comes from other ids) is real work and stays."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 8, generator=g)
    w = torch.randn(4, 8, 16, generator=g)  # torch._grouped_mm wants 16-byte strides
    bias = torch.randn(4, 16, generator=g).bfloat16()

    def f(x, w, ids, other, bound):
        ids_sorted, _ = torch.sort(ids)
        offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        y = torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs)
        # A bias added in place (as HF does) writes every row, the rows past offs[-1] too.
        z = torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs)
        z.add_(bias[ids_sorted.clamp(max=3)])
        return (y.masked_fill((ids_sorted >= bound).unsqueeze(-1), 0)
                + y.masked_fill((other >= 4).unsqueeze(-1), 0)
                + z.masked_fill((ids_sorted >= 4).unsqueeze(-1), 0))

    ids = torch.tensor([3, 0, 5, 1, 1, 2, 0, 3, 4, 2, 1, 0])
    for bound in (4, 3):
        cap = Capture()
        out = torch.compile(f, backend=cap, fullgraph=True)(x, w, ids, ids.flip(0), bound)
        assert cap.counts[-1]["grouped_mm"] == 2
        assert cap.counts[-1]["row_masks"] == (1 if bound == 4 else 0)
        ids_sorted = ids.sort().values
        offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=4, min=0, max=3), 0).int()
        ref = loop_grouped_mm(x.bfloat16(), w.bfloat16(), offs).float()
        z = (ref.bfloat16() + bias[ids_sorted.clamp(max=3)]).float()
        want = (ref.masked_fill((ids_sorted >= bound)[:, None], 0)
                + ref.masked_fill((ids.flip(0) >= 4)[:, None], 0)
                + z.masked_fill((ids_sorted >= 4)[:, None], 0))
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("extra", [None, "perm", "vals", "descending"])
def test_sort_routing_only_where_nothing_else_reads_the_sort(extra):
    """The routing of HF's backend (sort of the flattened (T, k) ids, offsets counted by histc)
    becomes one moe_route; a sort whose permutation or values something else reads, or a
    descending one, stays."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(4, 8, 16, generator=g)
    ids = torch.tensor([[3, 0], [1, 1], [2, 0], [3, 2], [0, 1], [2, 3]])

    def f(x, w, ids):
        vals, perm = torch.sort(ids.reshape(-1), descending=extra == "descending")
        offs = torch.cumsum(torch.histc(vals.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        y = torch._grouped_mm(x[perm // 2].bfloat16(), w.bfloat16(), offs=offs).float()
        if extra == "perm":
            y = y + perm[:, None]
        if extra == "vals":
            y = y + vals[:, None]
        return y

    cap = Capture()
    out = torch.compile(f, backend=cap, fullgraph=True)(x, w, ids)
    rewritten = extra is None
    assert cap.counts[-1]["sort_routing"] == int(rewritten)
    assert (CM.moe_route.default in cap.targets()) == rewritten
    if extra == "descending":
        return  # (its offsets do not describe its rows: nothing to compare)
    # moe_route's order of equal ids is the stable one; a kept sort runs as torch.sort does.
    vals, perm = torch.sort(ids.reshape(-1), stable=rewritten)
    offs = torch.cumsum(torch.bincount(vals, minlength=4), 0).to(torch.int32)
    want = loop_grouped_mm(x[perm // 2].bfloat16(), w.bfloat16(), offs).float()
    if extra == "perm":
        want = want + perm[:, None]
    if extra == "vals":
        want = want + vals[:, None]
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_hf_backend_dynamic_tokens_one_compile():
    mod = _hf_experts(torch.float32)
    cap = Capture()
    fn = torch.compile(_hf_forward(mod), backend=cap, fullgraph=True, dynamic=True)
    for tokens in (9, 16, 23):
        hidden, ids, weights = _hf_inputs(mod, tokens, torch.float32, seed=tokens)
        _check_against_loop(mod, fn, hidden, ids, weights, 1e-4)
    assert len(cap.graphs) == 1
    assert cap.counts[0] == {"sorted_dispatch": 2, "grouped_mm": 2, "row_masks": 0,
                             "sort_routing": 1, "gated_activation": 1}


# ------------------------------------------------------------------ entry points


def test_named_backend_through_inductor():
    assert "compiled_moe" in torch._dynamo.list_backends()
    torch._dynamo.reset()
    mod = _hf_experts(torch.float32)
    hidden, ids, weights = _hf_inputs(mod, 11, torch.float32)
    fn = torch.compile(_hf_forward(mod), backend="compiled_moe", fullgraph=True)
    _check_against_loop(mod, fn, hidden, ids, weights, 1e-4)


class Spy:
    def __init__(self, monkeypatch):
        self.counts = []
        self._rewrite = lowering.rewrite
        monkeypatch.setattr(lowering, "rewrite", self)

    def __call__(self, graph):
        self.counts.append(self._rewrite(graph))
        return self.counts[-1]


def test_enable_runs_the_pass_in_default_inductor(monkeypatch):
    from torch._inductor import config

    spy = Spy(monkeypatch)
    assert not lowering.is_enabled()
    try:
        assert lowering.enable() and lowering.is_enabled()
        torch._dynamo.reset()
        g = torch.Generator().manual_seed(3)
        x = torch.randn(21, 16, generator=g).bfloat16()
        w = torch.randn(3, 8, 16, generator=g).bfloat16()
        offs = random_offsets(21, 3, generator=g)
        # A warm compile cache would skip the pass (its uuid keys the cache): compile afresh.
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            out = torch.compile(lambda x, w, o: torch._grouped_mm(x, w.mT, offs=o))(x, w, offs)
        torch.testing.assert_close(out.double(), loop_grouped_mm(x, w.mT, offs), rtol=2e-2, atol=2e-2)
        assert spy.counts and spy.counts[0]["grouped_mm"] == 1
    finally:
        lowering.disable()
    assert not lowering.is_enabled() and config.pre_grad_custom_pass is None


def test_enable_keeps_an_existing_pass():
    from torch._inductor import config

    seen = []
    # config.patch, not monkeypatch: inductor's config module restores its own entries.
    with config.patch(pre_grad_custom_pass=seen.append):
        try:
            lowering.enable()
            graph = torch.fx.Graph()
            config.pre_grad_custom_pass(graph)
            assert seen == [graph]
        finally:
            lowering.disable()
        assert config.pre_grad_custom_pass == seen.append
    assert config.pre_grad_custom_pass is None


def test_this_torch_has_every_hook():
    """The hooks the rewrites need are all there on every torch the tests run on: a torch that
    moved one fails here rather than skipping the rewrites quietly."""
    assert lowering.missing_hooks() == ()
    assert lowering.supported()


def test_missing_hook_falls_back(monkeypatch):
    spy = Spy(monkeypatch)
    monkeypatch.setattr(lowering, "missing_hooks", lambda: ("torch._inductor.config.pre_grad_custom_pass",))
    monkeypatch.setattr(lowering, "_warned", False)
    with pytest.warns(UserWarning, match="pre_grad_custom_pass: graph rewrites are off"):
        assert lowering.enable() is False
    assert not lowering.is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        gm = torch.fx.symbolic_trace(lambda x: x + 1)
        lowering._apply(gm.graph)
    assert spy.counts == []


# ------------------------------------------------------------------ torch.export, AOTInductor, cpp_wrapper


class _MoEBlock(torch.nn.Module):
    """Router + MoEExperts + residual: a model's MoE layer, small."""

    def __init__(self):
        import compiled_moe as cm

        super().__init__()
        self.router = torch.nn.Linear(64, 8, bias=False)
        self.experts = cm.MoEExperts(8, 64, 32)

    def forward(self, x):
        weights, ids = torch.softmax(self.router(x), -1).topk(2, -1)
        return x + self.experts(x, ids, weights)


def test_kernel_op_traced_body():
    """KernelOp.register_traced (what lets compiled graphs launch the small route's Triton
    kernel themselves): eager calls run the kernel; a compiled graph runs the traced body, or
    keeps the op where that returns NotImplemented; torch.export keeps the op. The traced body
    here computes something else than the kernel, so each test tells which one ran."""
    from compiled_moe.ops._dispatch import kernel_op

    @kernel_op("test_only_traced_double", device_types=("cpu",))
    def double(x: torch.Tensor, traced_differs: bool) -> torch.Tensor:
        return x * 2

    double.register_fake(lambda x, traced_differs: torch.empty_like(x))

    @double.register_traced
    def _(x, traced_differs):
        return x * 2 + 1 if traced_differs else NotImplemented

    op = torch.ops.compiled_moe.test_only_traced_double
    x = torch.arange(4.0)
    assert torch.equal(op(x, True), x * 2)
    compiled = torch.compile(lambda x, t: op(x, t), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, True), x * 2 + 1)
    assert torch.equal(compiled(x, False), x * 2)

    class Block(torch.nn.Module):
        def forward(self, x):
            return op(x, True)

    ep = torch.export.export(Block(), (x,))
    assert any("test_only_traced_double" in str(n.target) for n in ep.graph.nodes)
    assert torch.equal(ep.module()(x), x * 2)


def test_export_and_aot_inductor_package(tmp_path):
    """The block exported with a dynamic token count, packaged by AOTInductor, loaded and run at
    two token counts: the same as eager. (The GPU tier's version skips where the torch build
    cannot load any package.)"""
    torch.manual_seed(0)
    block = _MoEBlock()
    tokens = torch.export.Dim("tokens", min=2, max=8192)
    with torch.no_grad():
        ep = torch.export.export(block, (torch.randn(100, 64),), dynamic_shapes=({0: tokens},))
        assert any("compiled_moe" in str(n.target) for n in ep.graph.nodes)
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "moe.pt2"))
        runner = torch._inductor.aoti_load_package(path)
        for t in (100, 333):
            x = torch.randn(t, 64)
            torch.testing.assert_close(runner(x), block(x), rtol=1e-5, atol=1e-5)


def test_cpp_wrapper_cpu():
    """inductor's cpp_wrapper (C++ instead of Python around the kernels) runs the block like
    eager on CPU (the GPU tier runs it on the GPU)."""
    torch.manual_seed(0)
    block = _MoEBlock()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, options={"cpp_wrapper": True})
    with torch.no_grad():
        for t in (100, 333):
            x = torch.randn(t, 64)
            torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)


def test_cpp_wrapper_cpu_training_step():
    """Forward and backward of the block under cpp_wrapper give eager's gradients (CPU)."""
    torch.manual_seed(0)
    block = _MoEBlock()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, options={"cpp_wrapper": True})
    grads = []
    for fn in (compiled, block):
        x = torch.randn(100, 64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        block.zero_grad(set_to_none=True)
        fn(x).square().mean().backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@torch.library.triton_op("compiled_moe_test::descriptor_probe", mutates_args=())
def _descriptor_probe(x: torch.Tensor) -> torch.Tensor:
    from compiled_moe.kernels import grouped_mm as kernels

    _descriptor_probe.seen.append(kernels.device_descriptors_ok(x))
    return x + 1


_descriptor_probe.seen = []


@pytest.mark.parametrize("scratch_covers_grid", [True, False])
def test_device_descriptors_under_cpp_wrapper(monkeypatch, scratch_covers_grid):
    """The Triton launchers' choice of device-side tensor descriptors, seen from inside a
    triton_op body: off only while inductor traces for a C++ wrapper that gives the launch one
    program's scratch (torch 2.11's cpp_wrapper; the GPU tier's test_cpp_wrapper runs the case
    on the H200), on in eager calls and under the Python wrapper."""
    from compiled_moe.kernels import grouped_mm as kernels

    monkeypatch.setattr(kernels, "cpp_wrapper_scratch_covers_grid", lambda: scratch_covers_grid)

    def seen_by(fn):
        _descriptor_probe.seen.clear()
        fn(torch.ones(4))
        return set(_descriptor_probe.seen)

    def f(x):
        return _descriptor_probe(x) * 2

    assert seen_by(f) == {True}
    # The patched answer is not part of the compile caches' keys: trace every time. (torch's
    # config modules are patched through their own patch(): pytest's monkeypatch deletes
    # such an attribute on undo, which breaks every later compile in the process.)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for options, expected in (({}, {True}), ({"cpp_wrapper": True}, {True, scratch_covers_grid})):
            torch._dynamo.reset()
            assert seen_by(torch.compile(f, fullgraph=True, options=options)) == expected


def test_device_descriptors_on_fake_tensors(monkeypatch):
    """Tensors of a trace count as tracing even where torch.compiler.is_compiling() says no
    (torch 2.11 inside AOTAutograd); real tensors never turn the descriptors off."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiled_moe.kernels import grouped_mm as kernels

    monkeypatch.setattr(kernels, "cpp_wrapper_scratch_covers_grid", lambda: False)
    with torch._inductor.config.patch(cpp_wrapper=True):
        assert kernels.device_descriptors_ok(torch.ones(2))
        with FakeTensorMode():
            assert not kernels.device_descriptors_ok(torch.ones(2))


def test_cpp_wrapper_scratch_detection():
    """torch 2.13 sizes the C++ wrapper's scratch for the whole grid; the detection sees it."""
    from compiled_moe.kernels import grouped_mm as kernels

    if torch.__version__ < (2, 13):  # TorchVersion compares as a version
        pytest.skip("the fix is known present from torch 2.13")
    assert kernels.cpp_wrapper_scratch_covers_grid()


# What each Triton kernel may write: its output arguments. Anything else that torch's mutation
# analysis counts as written, a compiled graph copies before the launch whenever the tensor is
# used afterwards (offs, read inside helper calls, was: one more kernel per GEMM in a backward).
KERNEL_OUTPUTS = {
    "_grouped_mm_kernel": {"out_ptr"},
    "_grouped_mm_wgrad_kernel": {"out_ptr"},
    "_grouped_sum_kernel": {"out_ptr"},
    "_mlp_fc1_kernel": {"h_ptr", "out_ptr"},
    "_activation_kernel": {"out_ptr", "act_ptr", "dprobs_ptr"},
    "_route_one_program_kernel": {"offs_ptr", "row_of_ptr", "source_ptr"},
    "_quantize_rows_kernel": {"q_ptr", "s_ptr"},
    "_quantize_row_blocks_kernel": {"q_ptr", "s_ptr"},
    "_quantize_tiles_kernel": {"q_ptr", "s_ptr", "qt_ptr", "st_ptr"},
    "_quantize_group_columns_kernel": {"cq_ptr", "cs_ptr", "rq_ptr", "rs_ptr"},
    "_quantize_group_columns_whole_kernel": {"cq_ptr", "cs_ptr"},
    "_scaled_grouped_mm_kernel": {"out_ptr"},
    "_scaled_grouped_mm_wgrad_kernel": {"out_ptr"},
}


def test_triton_kernels_write_only_their_outputs():
    """torch's mutation analysis (the one that decides what a compiled graph copies before a
    traced Triton launch) names only each kernel's outputs as written, for every kernel the
    ops launch, on sm_90 tile configs. tests/kernel_writes.py runs it in a process without the
    interpreter."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = pathlib.Path(__file__).with_name("kernel_writes.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "assuming every input is mutated" not in done.stderr, done.stderr[-4000:]
    launches = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name for name, _, _ in launches} == set(KERNEL_OUTPUTS)
    for name, writes, tensors in launches:
        assert writes, name  # every launch writes something
        assert set(writes) <= KERNEL_OUTPUTS[name], (name, writes, tensors)


# ------------------------------------------------------------------ argsort routing, scatter-add combine


def _scatter_add_block(hidden, ids, weights, w, counts_form: str, combine_form: str):
    """One grouped GEMM between a torchtitan-style dispatch and combine: a stable argsort of the
    flattened ids, counts from a one-hot sum, the gather by perm // k, and the
    weighted rows scatter-added into zeros at their tokens."""
    T, k = ids.shape
    E = w.shape[0]
    one_hot = torch.zeros(T, E, dtype=torch.bool).scatter_(-1, ids, True)
    counts = one_hot.sum(dim=0) if counts_form == "sum_dim0" else one_hot.sum(dim=(0,))
    perm = torch.argsort(ids.view(-1), stable=True)
    scores = weights.view(-1)[perm]
    token = perm // k
    rows = hidden[token]
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    y = torch._grouped_mm(rows.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs).type_as(rows)
    index = token.reshape(-1, 1).expand(-1, hidden.shape[1])
    if combine_form == "fp32_cast":
        src = (y.to(torch.float32) * scores.reshape(-1, 1)).to(y.dtype)
    else:
        src = y * scores.unsqueeze(-1)
    return torch.zeros_like(hidden).scatter_add(0, index, src)


@pytest.mark.parametrize("counts_form,combine_form", [("sum_dim0", "fp32_cast"), ("sum_dims", "plain")])
def test_argsort_routing_and_scatter_add_combine_are_rewritten(counts_form, combine_form):
    """torchtitan's dispatch written out: the routing becomes one moe_route, the gather
    moe_permute and the scatter-add combine moe_unpermute; values and gradients (hidden,
    routing weights, expert weights) as the float64 loop's."""
    g = torch.Generator().manual_seed(3)
    T, k, E, H, N = 19, 3, 6, 16, 24
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    hidden = torch.randn(T, H, generator=g)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    w = torch.randn(E, H, N, generator=g) * 0.3  # (E, N_out, K_in) as nn.Linear: here N_out = H
    w = w[:, :, :H]
    cap = Capture()
    args = [_leaf(hidden), ids, _leaf(weights), _leaf(w)]
    fn = torch.compile(lambda h, i, s, w: _scatter_add_block(h, i, s, w, counts_form, combine_form),
                       backend=cap, fullgraph=True)
    out = fn(*args)
    assert cap.counts[-1]["sort_routing"] == 1 and cap.counts[-1]["sorted_dispatch"] == 2
    targets = cap.targets()
    assert CM.moe_route.default in targets and CM.moe_unpermute.default in targets
    assert torch.argsort not in targets and torch.cumsum not in targets
    assert torch.scatter_add not in targets
    assert not any(n.op == "call_method" and n.target in ("scatter_add", "scatter_") for n in cap.graphs[-1].nodes)

    h64, s64, w64 = (a.detach().double().requires_grad_(True) for a in (hidden, weights, w))
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for s in range(k):
            want[t] += s64[t, s] * (h64[t].bfloat16().double() @ w64[ids[t, s]].bfloat16().double().T)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    cot = torch.randn(T, H, generator=g)
    out.backward(cot)
    want.backward(cot.double())
    for got, ref in ((args[0].grad, h64.grad), (args[2].grad, s64.grad), (args[3].grad, w64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=3e-2, atol=5e-2)


def test_unstable_argsort_keeps_its_routing():
    """moe_route's order is a stable sort's: an argsort without stable=True is left in place
    (its order among equal ids is unspecified), while the gather and combine still move."""
    g = torch.Generator().manual_seed(4)
    T, k, E, H = 11, 2, 4, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    hidden, weights = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)

    def block(hidden, ids, weights):
        perm = torch.argsort(ids.view(-1))
        rows = hidden[perm // k] * 2.0
        index = (perm // k).reshape(-1, 1).expand(-1, H)
        return torch.zeros_like(hidden).scatter_add(0, index, rows * weights.view(-1)[perm].unsqueeze(-1))

    cap = Capture()
    out = torch.compile(block, backend=cap, fullgraph=True)(hidden, ids, weights)
    assert cap.counts[-1]["sort_routing"] == 0 and cap.counts[-1]["sorted_dispatch"] == 2
    assert torch.argsort in cap.targets()
    torch.testing.assert_close(out, block(hidden, ids, weights), rtol=1e-5, atol=1e-5)


def test_scatter_add_of_some_columns_is_left_alone():
    """An index narrower than the rows adds only its columns: not a combine, left in place."""
    g = torch.Generator().manual_seed(5)
    T, k, E, H = 9, 2, 4, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    hidden = torch.randn(T, H, generator=g)

    def block(hidden, ids):
        perm = torch.argsort(ids.view(-1), stable=True)
        rows = hidden[perm // k] * 3.0
        index = (perm // k).reshape(-1, 1).expand(-1, H // 2)
        return torch.zeros_like(hidden).scatter_add(0, index, rows)

    cap = Capture()
    out = torch.compile(block, backend=cap, fullgraph=True)(hidden, ids)
    assert cap.counts[-1]["sorted_dispatch"] == 1  # the gather only
    assert CM.moe_unpermute.default not in cap.targets()
    torch.testing.assert_close(out, block(hidden, ids))
