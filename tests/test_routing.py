"""CPU tier for routing (moe_route, moe_permute, moe_unpermute) and the experts block:
reference vs host-loop oracles, Triton kernels in the interpreter, gradients, opcheck,
torch.compile with dynamic token counts, csrc compiled by NVRTC, bad inputs."""


import pytest
import torch

import compiled_moe as cm
from compiled_moe import reference
from compiled_moe.kernels.configs import ROUTE_ONE_PROGRAM_PAIRS
from compiled_moe.ops._dispatch import kernels_on_cpu
from helpers import (assert_matches_oracle, assert_one_dynamic_compile, loop_moe_experts,
                     loop_route)

route = torch.ops.compiled_moe.moe_route
permute = torch.ops.compiled_moe.moe_permute
unpermute = torch.ops.compiled_moe.moe_unpermute
unpermute_backward = torch.ops.compiled_moe.moe_unpermute_backward

# (tokens, top_k, experts, pad_multiple, id range): ids drawn from [lo, hi) so that some fall
# outside [0, E) (dropped pairs) where lo < 0 or hi > E.
ROUTE_CASES = [
    (0, 2, 4, 1, (0, 4)),        # no tokens
    (1, 1, 1, 1, (0, 1)),        # one token, one expert
    (1, 8, 128, 1, (0, 128)),    # decode step
    (37, 2, 8, 1, (0, 3)),       # most experts empty
    (64, 4, 16, 8, (0, 16)),     # padded groups
    (50, 3, 6, 4, (-2, 9)),      # dropped pairs and padding
    (200, 8, 32, 1, (-1, 32)),
]


def _ids(tokens, k, lo_hi, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(*lo_hi, (tokens, k), generator=g).to(dtype)


@pytest.mark.parametrize("case", ROUTE_CASES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_matches_loop(case, dtype):
    tokens, k, experts, pad, lo_hi = case
    ids = _ids(tokens, k, lo_hi, dtype)
    got = route(ids, experts, pad)
    want = loop_route(ids, experts, pad)
    for name, g, w in zip(("offs", "row_of", "source"), got, want):
        assert g.dtype == torch.int32, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("case", [
    c for c in ROUTE_CASES if c[0] * c[1] <= ROUTE_ONE_PROGRAM_PAIRS] + [
    (5, 3, 4096, 4, (0, 4096)),        # the most experts supported
    (64, 8, 64, 16, (-1, 70)),         # 512 pairs, dropped and padded
    (128, 8, 256, 128, (-1, 260)),     # ROUTE_ONE_PROGRAM_PAIRS pairs, dropped and padded
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_one_program_interpreter(case, dtype):
    """The one-program Triton route (what small routings run on the GPU) against the loop."""
    tokens, k, experts, pad, lo_hi = case
    assert tokens * k <= ROUTE_ONE_PROGRAM_PAIRS
    ids = _ids(tokens, k, lo_hi, dtype, seed=tokens)
    if dtype == torch.int64 and tokens:
        ids[0, 0] = 2**32 + 1  # in range once cast to int32: must still be dropped
    with kernels_on_cpu():
        got = route(ids, experts, pad)
    for name, g, w in zip(("offs", "row_of", "source"), got, loop_route(ids, experts, pad)):
        assert g.dtype == torch.int32, name
        assert torch.equal(g, w), name


def test_route_layout_is_consistent():
    """source and row_of are inverse maps, and each sorted row lies in its expert's group."""
    ids = _ids(300, 6, (0, 20))
    offs, row_of, source = route(ids, 20, 4)
    flat = row_of.reshape(-1).long()
    assert torch.equal(source[flat].long(), torch.arange(flat.numel()))
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    e = ids.reshape(-1)
    assert bool(((flat >= starts[e]) & (flat < offs.long()[e])).all())


# ------------------------------------------------------------------ permute / unpermute


def _layout(tokens=23, k=3, experts=5, pad=4, lo_hi=(-1, 6), seed=1):
    ids = _ids(tokens, k, lo_hi, seed=seed)
    return ids, *route(ids, experts, pad)


def _loop_permute(hidden, source, k, scale=None):
    out = torch.zeros(source.shape[0], hidden.shape[1], dtype=torch.float64)
    for r, s in enumerate(source.tolist()):
        if 0 <= s < hidden.shape[0] * k:  # else padding, or no pair: a zero row
            w = 1.0 if scale is None else scale.reshape(-1)[s].double()
            out[r] = hidden[s // k].double() * w
    return out


def _loop_unpermute(y, row_of, weights=None):
    out = torch.zeros(row_of.shape[0], y.shape[1], dtype=torch.float64)
    for t in range(row_of.shape[0]):
        for s in range(row_of.shape[1]):
            r = int(row_of[t, s])
            if 0 <= r < y.shape[0]:  # else dropped, or no row of y: adds nothing
                w = 1.0 if weights is None else weights[t, s].double()
                out[t] += w * y[r].double()
    return out


@pytest.mark.parametrize("scaled", [False, True])
def test_permute_unpermute_reference_match_loops(scaled):
    ids, offs, row_of, source = _layout()
    hidden = torch.randn(ids.shape[0], 12, dtype=torch.float64)
    w = torch.rand(ids.shape, dtype=torch.float64) if scaled else None
    torch.testing.assert_close(permute(hidden, row_of, source, w), _loop_permute(hidden, source, 3, w))
    y = torch.randn(source.shape[0], 12, dtype=torch.float64)
    torch.testing.assert_close(unpermute(y, row_of, source, w), _loop_unpermute(y, row_of, w))


# The row ops' CUDA kernels (csrc/moe_rows.cu) run on the GPU tier only
# (tests/test_gpu_host_rows.py); NVRTC compiles them here (tests/test_csrc.py).


def test_padding_rows_and_dropped_pairs_are_zero():
    """Padding rows come out zero and dropped pairs get a zero weight gradient."""
    ids, offs, row_of, source = _layout(lo_hi=(-3, 8))
    hidden = torch.randn(ids.shape[0], 9)
    w = torch.rand(ids.shape)
    y = torch.randn(source.shape[0], 9)
    x = permute(hidden, row_of, source)
    gy, gw = unpermute_backward(hidden, y, row_of, source, w)
    assert bool((x[source < 0] == 0).all()) and bool((gy[source < 0] == 0).all())
    assert bool((gw[row_of < 0] == 0).all())
    assert torch.isfinite(x).all() and torch.isfinite(gw).all()


def _corrupt(row_of, source):
    """Entries moe_route never makes: source values past the T*k pairs and below -1, row_of
    values past y's rows."""
    source, row_of = source.clone(), row_of.clone()
    pairs, rows = row_of.numel(), source.shape[0]
    source[::3] += pairs
    source[1::5] = -7
    row_of[::2, 0] += rows
    row_of[1::4, -1] = rows + 1000
    return row_of, source


def test_entries_outside_the_tensors_are_padding():
    """A source entry outside [0, T*k) gives a zero row and a row_of entry outside y's rows adds
    nothing (the reference once raised IndexError; the GPU tier checks the CUDA kernels)."""
    ids, offs, row_of, source = _layout()
    k = ids.shape[1]
    row_of, source = _corrupt(row_of, source)
    hidden = torch.randn(ids.shape[0], 24)
    w = torch.rand(ids.shape)
    y = torch.randn(source.shape[0], 24)
    g = torch.randn(ids.shape[0], 24)
    x = permute(hidden, row_of, source, w)
    out = unpermute(y, row_of, source, w)
    gy, gw = unpermute_backward(g, y, row_of, source, w)
    assert_matches_oracle(x, _loop_permute(hidden, source, k, w), reference.moe_permute(hidden, source, k, w))
    assert_matches_oracle(out, _loop_unpermute(y, row_of, w), reference.moe_unpermute(y, row_of, w))
    assert_matches_oracle(gy, _loop_permute(g, source, k, w), reference.moe_permute(g, source, k, w))
    # The weights' gradient: the kernel finds each pair's row through source, the reference
    # through row_of; where the corrupt maps disagree only finiteness is defined.
    rows = row_of.clamp(0, y.shape[0] - 1).long()
    pair = torch.arange(row_of.numel()).view(row_of.shape)
    agree = (row_of >= 0) & (row_of < y.shape[0]) & (source.long()[rows] == pair)
    assert 0 < int(agree.sum()) < row_of.numel()
    dot = torch.einsum("th,tkh->tk", g.double(), y.double()[rows])
    torch.testing.assert_close(gw.double()[agree], dot[agree], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(gw).all()


def test_no_pairs_gives_zero_rows():
    """row_of of k = 0 slots: every source entry names no pair (nothing may divide by k = 0)."""
    hidden = torch.randn(4, 8)
    source = torch.tensor([0, 1, -1], dtype=torch.int32)
    x = permute(hidden, torch.empty(4, 0, dtype=torch.int32), source)
    assert x.shape == (3, 8) and bool((x == 0).all())


def test_unpermute_backward_checks_grad_out():
    ids, offs, row_of, source = _layout()
    y = torch.randn(source.shape[0], 16)
    w = torch.rand(ids.shape)
    with pytest.raises(ValueError, match="grad_out has 15 columns but y has 16"):
        unpermute_backward(torch.randn(ids.shape[0], 15), y, row_of, source, w)
    with pytest.raises(ValueError, match="grad_out has 5 tokens"):
        unpermute_backward(torch.randn(5, 16), y, row_of, source, w)


def test_permute_unpermute_gradcheck():
    ids, offs, row_of, source = _layout(tokens=7, k=2, experts=3, pad=2, lo_hi=(-1, 3))
    hidden = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(7, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(source.shape[0], 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda h, s: permute(h, row_of, source, s), (hidden, scale))
    torch.autograd.gradcheck(lambda v, s: unpermute(v, row_of, source, s), (y, scale))
    torch.autograd.gradcheck(lambda v: unpermute(v, row_of, source), (y,))


# ------------------------------------------------------------------ the experts block

EXPERT_CASES = [  # activation, gate_up_layout, biases
    ("swiglu", "stacked", False),
    ("swiglu", "interleaved", True),
    ("geglu", "stacked", False),
    ("gpt_oss", "interleaved", True),
    ("relu2", "stacked", False),
    ("gelu", "stacked", True),
    ("silu", "stacked", False),
]


def _experts_inputs(activation, biases, tokens=19, hidden=16, inter=8, experts=5, k=2,
                    dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if activation in reference.GATED_ACTIVATIONS else inter
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    ids = torch.randint(0, experts, (tokens, k), generator=g)
    weights = torch.rand(tokens, k, generator=g).to(dtype).requires_grad_(requires_grad)
    return dict(hidden=mk(tokens, hidden), topk_ids=ids, topk_weights=weights,
                w1=mk(experts, n1, hidden), w2=mk(experts, hidden, inter),
                b1=mk(experts, n1) if biases else None, b2=mk(experts, hidden) if biases else None)


def _loop(inp, activation, layout):
    return loop_moe_experts(inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w1"],
                            inp["w2"], activation, layout, inp["b1"], inp["b2"])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("activation,layout,biases", EXPERT_CASES)
def test_experts_reference_matches_loop(activation, layout, biases, fused):
    inp = _experts_inputs(activation, biases)
    got = cm.moe_experts(**inp, activation=activation, gate_up_layout=layout, fused=fused)
    torch.testing.assert_close(got, _loop(inp, activation, layout).to(got.dtype))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("activation,layout,biases", EXPERT_CASES)
def test_experts_kernels_interpreter(activation, layout, biases, fused):
    inp = _experts_inputs(activation, biases, dtype=torch.float32)
    with kernels_on_cpu():
        got = cm.moe_experts(**inp, activation=activation, gate_up_layout=layout, fused=fused)
    ref32 = cm.moe_experts(**inp, activation=activation, gate_up_layout=layout, fused=fused)
    assert_matches_oracle(got, _loop(inp, activation, layout), ref32)


def test_experts_gradcheck():
    inp = _experts_inputs("gpt_oss", True, tokens=6, hidden=4, inter=3, experts=3,
                          requires_grad=True)
    names = ["hidden", "topk_weights", "w1", "w2", "b1", "b2"]

    def f(*tensors):
        kw = dict(inp, **dict(zip(names, tensors)))
        return cm.moe_experts(**kw, activation="gpt_oss", gate_up_layout="interleaved")

    torch.autograd.gradcheck(f, tuple(inp[n] for n in names))


@pytest.mark.parametrize("fused", [True, False])
def test_experts_backward_kernels_interpreter(fused):
    inp = _experts_inputs("swiglu", True, dtype=torch.float32, requires_grad=True)
    names = ["hidden", "topk_weights", "w1", "w2", "b1", "b2"]
    with kernels_on_cpu():
        out = cm.moe_experts(**inp, fused=fused)
        grads = torch.autograd.grad(out, [inp[n] for n in names], torch.ones_like(out))
    out_ref = cm.moe_experts(**inp, fused=fused)
    want = torch.autograd.grad(out_ref, [inp[n] for n in names], torch.ones_like(out_ref))
    for n, got, exp in zip(names, grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4, msg=n)


def test_experts_skips_ids_outside_range():
    """Expert parallelism: ids of experts on other ranks (-1, or >= E) contribute nothing."""
    inp = _experts_inputs("swiglu", False)
    ids = inp["topk_ids"].clone()
    ids[::3, 0] = -1
    ids[1::4, 1] = 99
    got = cm.moe_experts(**dict(inp, topk_ids=ids))
    torch.testing.assert_close(got, _loop(dict(inp, topk_ids=ids), "swiglu", "stacked"))


def test_experts_callable_activation_and_transposed_weights():
    inp = _experts_inputs("swiglu", False)
    inter = inp["w2"].shape[2]
    act = lambda h: torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]  # noqa: E731
    # Weights stored as (E, H, N1) and passed as transposed views: no copy, same result.
    w1_t = inp["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    got = cm.moe_experts(**dict(inp, w1=w1_t), activation=act)
    torch.testing.assert_close(got, _loop(inp, "swiglu", "stacked"))


# ------------------------------------------------------------------ opcheck, compile


def _opcheck_samples():
    ids, offs, row_of, source = _layout()
    hidden = torch.randn(ids.shape[0], 8)
    y = torch.randn(source.shape[0], 8)
    w = torch.rand(ids.shape)
    return {
        "route": (route, (ids, 5, 4)),
        "route_i32": (route, (ids.int(), 5, 1)),
        "permute": (permute, (hidden, row_of, source, None)),
        "permute_scaled": (permute, (hidden, row_of, source, w)),
        "unpermute": (unpermute, (y, row_of, source, w)),
        "unpermute_backward": (unpermute_backward, (hidden, y, row_of, source, w)),
    }


@pytest.mark.parametrize("sample", list(_opcheck_samples()))
def test_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


def test_experts_compile_dynamic_one_compile():
    base = _experts_inputs("swiglu", True, dtype=torch.float32, requires_grad=True)
    params = [base[n] for n in ("w1", "w2", "b1", "b2")]

    def step(hidden, ids, weights):
        return cm.moe_experts(hidden, ids, weights, *params[:2], b1=params[2], b2=params[3]).sum()

    sizes = [_experts_inputs("swiglu", True, tokens=tokens, dtype=torch.float32, seed=tokens,
                             requires_grad=True) for tokens in (11, 24, 37)]
    assert_one_dynamic_compile(
        step, [(i["hidden"], i["topk_ids"], i["topk_weights"]) for i in sizes],
        lambda args: [args[0], args[2], *params])


# ------------------------------------------------------------------ csrc, bad inputs


def test_csrc_compiles_with_nvrtc(tmp_path, monkeypatch, capfd):
    """Every CUDA source compiles for Hopper (no GPU needed), and the cache serves a rebuild.
    A compile says so on stderr, with the time it took; a cache hit says nothing."""
    from compiled_moe import native

    monkeypatch.setenv("COMPILED_MOE_CACHE_DIR", str(tmp_path))
    sources = native.source_files()
    assert sources, "no csrc/*.cu found"
    for path in sources:
        arch = native.source_arch(path, "sm_90")
        capfd.readouterr()
        cubin = native.compile_source(path, arch)
        said = capfd.readouterr().err
        assert f"compiling csrc/{path.name} for {arch}" in said and "compiled in" in said, said
        assert cubin[:4] == b"\x7fELF", path.name
        assert native.compile_source(path, arch) == cubin
        assert "compiling" not in capfd.readouterr().err
    assert len(list((tmp_path / "nvrtc").glob("*.cubin"))) == len(sources)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: route(torch.zeros(4, 2), 4), TypeError, "topk_ids"),
    (lambda: route(torch.zeros(4, dtype=torch.int64), 4), ValueError, "topk_ids"),
    (lambda: route(torch.zeros(4, 2, dtype=torch.int64), 0), ValueError, "num_experts"),
    (lambda: route(torch.zeros(4, 2, dtype=torch.int64), 4, 0), ValueError, "pad_multiple"),
])
def test_route_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_permute_unpermute_bad_inputs():
    ids, offs, row_of, source = _layout()
    hidden = torch.randn(ids.shape[0], 8)
    with pytest.raises(ValueError, match="tokens"):
        permute(hidden[:-1], row_of, source)
    with pytest.raises(TypeError, match="row_of"):
        permute(hidden, row_of.long(), source)
    with pytest.raises(ValueError, match="scale"):
        permute(hidden, row_of, source, torch.rand(3))
    with pytest.raises(ValueError, match="source"):
        unpermute(torch.randn(source.shape[0] + 1, 8), row_of, source)
    with pytest.raises(TypeError, match="weights"):
        unpermute(torch.randn(source.shape[0], 8), row_of, source, row_of)


@pytest.mark.parametrize("change,exc,match", [
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(gate_up_layout="split"), ValueError, "gate_up_layout"),
    (dict(w1=torch.randn(5, 16, 15)), ValueError, "w1"),
    (dict(w2=torch.randn(5, 16, 7)), ValueError, "w2"),
    (dict(b1=torch.randn(5, 3)), ValueError, "b1"),
    (dict(b2=torch.randn(4, 16)), ValueError, "b2"),
    (dict(topk_weights=torch.rand(19, 3)), ValueError, "topk_weights"),
    (dict(topk_ids=torch.zeros(19, 2)), TypeError, "topk_ids"),
    # Checked before any compute, naming the argument:
    (dict(topk_weights=torch.ones(19, 2, dtype=torch.int64)), TypeError,
     "topk_weights must be a floating-point"),
    (dict(w1=torch.randn(5, 16, 16, dtype=torch.float64)), TypeError, "w1 has dtype .* but hidden"),
    (dict(b1=[[0.0] * 16] * 5), TypeError, "b1 must be a torch.Tensor"),
])
def test_experts_bad_inputs(change, exc, match):
    inp = _experts_inputs("swiglu", False, dtype=torch.float32)
    with pytest.raises(exc, match=match):
        cm.moe_experts(**dict(inp, **change))


def test_modules_check_arguments_early():
    """The modules reject bad constructor arguments when built, and a hidden size that is not
    theirs by name (not as a weight shape error)."""
    with pytest.raises(ValueError, match="activation must be one of"):
        cm.MoEExperts(3, 8, 4, activation="relu")
    with pytest.raises(ValueError, match="gate_up_layout must be one of"):
        cm.MoEExperts(3, 8, 4, gate_up_layout="split")
    with pytest.raises(ValueError, match="recipe"):
        cm.MoEExperts(3, 8, 4, fp8_recipe="fp4")
    with pytest.raises(ValueError, match="recipe"):
        cm.GroupedLinear(3, 8, 4, fp8_recipe="fp4")
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden has 9 features but this MoEExperts has hidden_size=8"):
        cm.MoEExperts(3, 8, 4)(torch.randn(4, 9), ids, torch.rand(4, 2))


@pytest.mark.parametrize("change,match", [
    (dict(activation="tanh"), "activation"),
    (dict(gate_up_layout="split"), "gate_up_layout"),
    (dict(w1=torch.randn(5, 16, 15)), "w1"),
    (dict(w2=torch.randn(5, 16, 7)), "w2"),
    (dict(b1=torch.randn(5, 3)), "b1"),
    (dict(b2=torch.randn(4, 16)), "b2"),
    (dict(topk_weights=torch.rand(19, 3)), "weights"),
    (dict(topk_ids=torch.zeros(19, 2)), "topk_ids"),
])
def test_experts_bad_inputs_compiled(change, match):
    # Compiled, moe_experts leaves the argument checks to its ops (their fake functions run
    # when the graph is built): the error still names the argument.
    inp = _experts_inputs("swiglu", False, dtype=torch.float32)
    compiled = torch.compile(cm.moe_experts, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=match):
        compiled(**dict(inp, **change))


def test_compiled_experts_guards_only_what_the_graph_depends_on():
    """Every guard costs host time on every compiled call. moe_experts' Python argument checks
    only read what the tensors' own guards pin, so a compiled block must not guard on them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    inp = _experts_inputs("swiglu", False, dtype=torch.float32)

    def block(hidden, topk_ids, topk_weights):
        return cm.moe_experts(hidden, topk_ids, topk_weights, inp["w1"], inp["w2"])

    torch.compile(block, backend="eager", fullgraph=True)(
        inp["hidden"], inp["topk_ids"], inp["topk_weights"])
    guards = str(_debug_get_cache_entry_list(block.__code__)[0].guard_manager)
    # (a guard's comment names the source line that made it: ops/_dispatch.py holds the checks)
    for helper in ("check_experts_args", "ops/_dispatch.py", "ACTIVATIONS", "GATE_UP_LAYOUTS"):
        assert helper not in guards, helper
    # (one Python-level guard is torch's own; a second one compared two modules' `torch`)
    assert guards.count("LAMBDA_GUARD") <= 1


# ------------------------------------------------------------------ modules


def test_grouped_linear_matches_per_group_linear():
    torch.manual_seed(0)
    layer = cm.GroupedLinear(3, 8, 5, dtype=torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    want = torch.zeros(10, 5, dtype=torch.float64)
    for g, (s, e) in enumerate([(0, 4), (4, 4), (4, 9)]):
        want[s:e] = torch.nn.functional.linear(x[s:e], layer.weight[g], layer.bias[g])
    torch.testing.assert_close(layer(x, offs), want)
    bound = 8 ** -0.5  # nn.Linear's init range
    assert layer.weight.abs().max() <= bound and layer.weight.abs().max() > 0.5 * bound


@pytest.mark.parametrize("transposed", [False, True])
def test_moe_experts_module(transposed):
    torch.manual_seed(0)
    mod = cm.MoEExperts(4, 16, 8, activation="gpt_oss", gate_up_layout="interleaved", bias=True,
                        weights_transposed=transposed, dtype=torch.float64)
    names = {n for n, _ in mod.named_parameters()}
    assert names == {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
    w1, w2 = mod.gate_up_proj, mod.down_proj
    if transposed:
        assert tuple(w1.shape) == (4, 16, 16) and tuple(w2.shape) == (4, 8, 16)
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    hidden = torch.randn(9, 16, dtype=torch.float64)
    ids = torch.randint(0, 4, (9, 2))
    weights = torch.rand(9, 2, dtype=torch.float64)
    want = loop_moe_experts(hidden, ids, weights, w1, w2, "gpt_oss", "interleaved",
                            mod.gate_up_proj_bias, mod.down_proj_bias)
    torch.testing.assert_close(mod(hidden, ids, weights), want)
    # A state dict round-trips into a fresh module.
    other = cm.MoEExperts(4, 16, 8, activation="gpt_oss", gate_up_layout="interleaved", bias=True,
                          weights_transposed=transposed, dtype=torch.float64)
    other.load_state_dict(mod.state_dict())
    torch.testing.assert_close(other(hidden, ids, weights), want)
