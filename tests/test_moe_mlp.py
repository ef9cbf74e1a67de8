"""CPU tier of the fused expert MLP (moe_mlp, moe_mlp_fc2_dgrad, moe_experts(fused=True)):
reference vs a float64 loop over groups, Triton kernels in the interpreter (forward and
backward, both FC1 epilogue variants), gradients, opcheck, compile, the training features
(main_grad with a mask, delayed weight gradients) and bad inputs."""

import contextlib

import pytest
import torch

import compiled_moe as cm
from compiled_moe import reference
from compiled_moe.kernels import configs
from compiled_moe.mlp import WeightGradStore
from compiled_moe.ops._dispatch import kernels_on_cpu
from helpers import (assert_matches_oracle, assert_one_dynamic_compile, loop_bounds,
                     loop_moe_experts, loop_route, random_offsets)

CASES = [  # activation, gate_up_layout, biases, probs
    ("swiglu", "stacked", False, False),
    ("swiglu", "interleaved", True, True),
    ("geglu", "stacked", True, False),
    ("gpt_oss", "interleaved", True, True),
    ("gpt_oss", "stacked", False, True),
    ("relu2", "stacked", False, True),
    ("gelu", "stacked", True, False),
    ("silu", "stacked", False, False),
]
NAMES = ("x_sorted", "w1", "w2", "probs", "b1", "b2")


def _inputs(activation, biases, probs, rows=37, hidden=24, inter=16, groups=4,
            dtype=torch.float64, seed=0, requires_grad=False, empty_groups=1, tail=5):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if activation in reference.GATED_ACTIVATIONS else inter
    mk = lambda *s, scale=0.5: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    inp = dict(x_sorted=mk(rows, hidden, scale=1.0),
               offs=random_offsets(rows, groups, generator=g, empty_groups=empty_groups,
                                   tail=tail),
               w1=mk(groups, n1, hidden), w2=mk(groups, hidden, inter),
               probs=torch.rand(rows, generator=g).to(dtype) if probs else None,
               b1=mk(groups, n1) if biases else None, b2=mk(groups, hidden) if biases else None)
    for n in NAMES:
        if requires_grad and inp[n] is not None:
            inp[n].requires_grad_(True)
    return inp


def _loop_mlp(inp, activation, layout):
    """The MLP by a loop over groups in float64; rows past the last group are 0."""
    x, w1, w2 = (inp[n].double() for n in ("x_sorted", "w1", "w2"))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for gi, (s, e) in enumerate(loop_bounds(inp["offs"], x.shape[0])):
        if e == s:
            continue
        h = x[s:e] @ w1[gi].T
        if inp["b1"] is not None:
            h = h + inp["b1"][gi].double()
        a = reference.activation(h, activation, layout)
        if inp["probs"] is not None:
            a = a * inp["probs"][s:e].double()[:, None]
        y = a @ w2[gi].T
        if inp["b2"] is not None:
            y = y + inp["b2"][gi].double()
        out[s:e] = y
    return out


def _kw(activation, layout):
    return dict(activation=activation, gate_up_layout=layout)


@pytest.mark.parametrize("activation,layout,biases,probs", CASES)
def test_reference_matches_loop(activation, layout, biases, probs):
    inp = _inputs(activation, biases, probs)
    got = cm.moe_mlp(**inp, **_kw(activation, layout))
    torch.testing.assert_close(got, _loop_mlp(inp, activation, layout))


@pytest.mark.parametrize("activation,layout,biases,probs", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_interpreter(activation, layout, biases, probs, dtype):
    inp = _inputs(activation, biases, probs, dtype=dtype, requires_grad=True)
    present = [n for n in NAMES if inp[n] is not None]
    grad = torch.randn(inp["x_sorted"].shape).to(dtype)
    with kernels_on_cpu():
        got = cm.moe_mlp(**inp, **_kw(activation, layout))
        got_grads = torch.autograd.grad(got, [inp[n] for n in present], grad)
    same = cm.moe_mlp(**inp, **_kw(activation, layout))  # the reference in the same dtype
    same_grads = torch.autograd.grad(same, [inp[n] for n in present], grad)
    f64 = {n: (v.detach().double().requires_grad_(True) if isinstance(v, torch.Tensor)
               and v.is_floating_point() else v) for n, v in inp.items()}
    want = cm.moe_mlp(**f64, **_kw(activation, layout))
    want_grads = torch.autograd.grad(want, [f64[n] for n in present], grad.double())
    assert_matches_oracle(got, want.detach(), same, atol=1e-3)
    for g, w, s in zip(got_grads, want_grads, same_grads):
        assert_matches_oracle(g, w, s, atol=1e-3)


@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_kernels_interpreter_tma_epilogue(monkeypatch, layout):
    """FC1's TMA epilogue stores (a tile flag) give the pointer epilogue's result."""
    from compiled_moe.kernels import moe_mlp as kernels

    inp = _inputs("swiglu", True, True, dtype=torch.float32, requires_grad=True, inter=32)
    tma_tile = configs.TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1,
                                  num_stages=1, epilogue_tma=1)
    present = [n for n in NAMES if inp[n] is not None]
    results = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(kernels, "mlp_fc1_config", lambda *a: tma_tile)
        with kernels_on_cpu():
            out = cm.moe_mlp(**inp, **_kw("swiglu", layout))
            results.append((out, *torch.autograd.grad(out, [inp[n] for n in present],
                                                      torch.ones_like(out))))
    for plain, tma in zip(*results):
        torch.testing.assert_close(tma, plain, rtol=1e-5, atol=1e-5)


def test_kernels_write_every_element_interpreter():
    """Rows past offs[-1] and empty groups: every output element is written, zeros past the end."""
    inp = _inputs("swiglu", True, True, dtype=torch.float32, empty_groups=2, tail=9)
    with kernels_on_cpu(), torch.no_grad():
        y, h = torch.ops.compiled_moe.moe_mlp(inp["x_sorted"], inp["offs"], inp["w1"], inp["w2"],
                                              "swiglu", "stacked", inp["probs"], inp["b1"],
                                              inp["b2"])
        dh, a, dprobs = torch.ops.compiled_moe.moe_mlp_fc2_dgrad(
            torch.randn(y.shape), inp["w2"], h, inp["offs"], inp["probs"], "swiglu", "stacked",
            reference.GPT_OSS_ALPHA, reference.GPT_OSS_LIMIT)
    end = int(inp["offs"][-1])
    for t in (y, h, dh, a, dprobs):
        assert torch.isfinite(t).all()
        assert (t[end:] == 0).all()


def test_gradcheck():
    inp = _inputs("gpt_oss", True, True, rows=11, hidden=4, inter=3, groups=3, tail=2,
                  requires_grad=True)

    def f(*tensors):
        kw = dict(inp, **dict(zip(NAMES, tensors)))
        return cm.moe_mlp(**kw, **_kw("gpt_oss", "interleaved"))

    torch.autograd.gradcheck(f, tuple(inp[n] for n in NAMES))


def test_transposed_weight_views():
    inp = _inputs("swiglu", False, True, dtype=torch.float32)
    views = dict(inp, w1=inp["w1"].mT.contiguous().mT, w2=inp["w2"].mT.contiguous().mT)
    for n in ("w1", "w2"):
        views[n].requires_grad_(True)
        inp[n].requires_grad_(True)
    with kernels_on_cpu():
        got = cm.moe_mlp(**views)
        got_grads = torch.autograd.grad(got, [views["w1"], views["w2"]], torch.ones_like(got))
        want = cm.moe_mlp(**inp)
        want_grads = torch.autograd.grad(want, [inp["w1"], inp["w2"]], torch.ones_like(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert g.stride() == g.mT.contiguous().mT.stride()  # written in the view's storage order
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the fused experts block


def _experts(activation, biases, tokens=19, hidden=16, inter=8, experts=5, k=2,
             dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if activation in reference.GATED_ACTIVATIONS else inter
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(dtype).requires_grad_(True)  # noqa: E731
    ids = torch.randint(0, experts, (tokens, k), generator=g)
    ids[::5, 0] = -1  # a pair of an expert on another rank: skipped
    return dict(hidden=mk(tokens, hidden), topk_ids=ids,
                topk_weights=torch.rand(tokens, k, generator=g).to(dtype).requires_grad_(True),
                w1=mk(experts, n1, hidden), w2=mk(experts, hidden, inter),
                b1=mk(experts, n1) if biases else None, b2=mk(experts, hidden) if biases else None)


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("activation,layout,biases", [
    ("swiglu", "stacked", True), ("gpt_oss", "interleaved", True), ("relu2", "stacked", False)])
def test_fused_experts_interpreter(monkeypatch, activation, layout, biases, gather):
    """gather: FC1 reads hidden rows through the routing map; else the block permutes first
    (the choice for wide experts)."""
    from compiled_moe import local_experts as experts

    monkeypatch.setattr(experts, "mlp_gathers_input", lambda inter: gather)
    inp = _experts(activation, biases)
    names = [n for n in ("hidden", "topk_weights", "w1", "w2", "b1", "b2") if inp[n] is not None]
    kw = _kw(activation, layout)
    grad = torch.randn(inp["hidden"].shape)
    with kernels_on_cpu():
        got = cm.moe_experts(**inp, **kw, fused=True)
        got_grads = torch.autograd.grad(got, [inp[n] for n in names], grad)
        unfused = cm.moe_experts(**inp, **kw, fused=False)
        unfused_grads = torch.autograd.grad(unfused, [inp[n] for n in names], grad)
    f64 = {n: (v.detach().double().requires_grad_(True) if isinstance(v, torch.Tensor)
               and v.is_floating_point() else v) for n, v in inp.items()}
    want = loop_moe_experts(f64["hidden"], f64["topk_ids"], f64["topk_weights"], f64["w1"],
                            f64["w2"], activation, layout, f64["b1"], f64["b2"])
    want_grads = torch.autograd.grad(want, [f64[n] for n in names], grad.double())
    assert_matches_oracle(got, want.detach(), unfused, atol=1e-4)
    for g, w, u in zip(got_grads, want_grads, unfused_grads):
        assert_matches_oracle(g, w, u, atol=1e-4)


def test_fused_experts_one_token_and_empty_experts():
    inp = _experts("swiglu", False, tokens=1, experts=6, k=2)
    inp["topk_ids"] = torch.tensor([[4, 1]])
    with kernels_on_cpu():
        got = cm.moe_experts(**inp, fused=True)
    f64 = {n: inp[n].detach().double() for n in ("hidden", "topk_weights", "w1", "w2")}
    want = loop_moe_experts(f64["hidden"], inp["topk_ids"], f64["topk_weights"], f64["w1"],
                            f64["w2"])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_fused_experts_gradcheck_with_gather():
    inp = _experts("gpt_oss", True, tokens=6, hidden=4, inter=3, experts=3, dtype=torch.float64)
    names = ["hidden", "topk_weights", "w1", "w2", "b1", "b2"]

    def f(*tensors):
        kw = dict(inp, **dict(zip(names, tensors)))
        return cm.moe_experts(**kw, activation="gpt_oss", gate_up_layout="interleaved", fused=True)

    torch.autograd.gradcheck(f, tuple(inp[n] for n in names))


@pytest.mark.parametrize("corrupt", [False, True])
def test_moe_mlp_gather_matches_sorted_input(corrupt):
    """The op's gather (source, row_of) equals running it on moe_permute's sorted copy, also
    where source holds entries that name no pair (zero rows: the gather must not read outside
    hidden)."""
    inp = _experts("swiglu", True)
    offs, row_of, source = loop_route(inp["topk_ids"], 5)
    if corrupt:
        source = source.clone()
        source[::3] += row_of.numel()
        source[1::4] = -5
    x_sorted = cm.moe_permute(inp["hidden"], row_of, source)
    with kernels_on_cpu(), torch.no_grad():
        gathered, _ = torch.ops.compiled_moe.moe_mlp(inp["hidden"], offs, inp["w1"], inp["w2"],
                                                     "swiglu", b1=inp["b1"], b2=inp["b2"],
                                                     source=source, row_of=row_of)
        on_sorted, _ = torch.ops.compiled_moe.moe_mlp(x_sorted, offs, inp["w1"], inp["w2"],
                                                      "swiglu", b1=inp["b1"], b2=inp["b2"])
    torch.testing.assert_close(gathered, on_sorted, rtol=0, atol=0)


# ------------------------------------------------------------------ gate and up as two weights


def _split_up(inp):
    """(gate, up, stacked): leaves holding the halves of inp's stacked w1, and the whole."""
    inter = inp["w1"].shape[1] // 2
    w1 = inp["w1"].detach()
    gate, up = (w1[:, :inter].clone().requires_grad_(True),
                w1[:, inter:].clone().requires_grad_(True))
    stacked = w1.clone().requires_grad_(True)
    return gate, up, stacked


@pytest.mark.parametrize("kernels,dtype", [(False, torch.float32), (True, torch.float32),
                                           (True, torch.float16)])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("storage", ["same", "transposed_up"])
def test_separate_up_weight_matches_stacked(kernels, dtype, gather, storage):
    """moe_mlp with w1 = gate (G, I, H) and w3 = up, two tensors, against the same op on the
    stacked cat([w1, w3], 1): output, h and every gradient (w1's and w3's are the halves of
    the stacked gradient). Also with w3 stored transposed (the kernel then reads a copy in
    w1's order). The same tiles in the same order: equal but for dx, two GEMMs summed against
    one over the stacked K (rounding apart in fp16)."""
    if gather:
        ex = _experts("swiglu", True, dtype=dtype)
        offs, row_of, source = loop_route(ex["topk_ids"], 5)
        x, w2, b1 = ex["hidden"], ex["w2"], ex["b1"]
        extra = dict(source=source, row_of=row_of)
        inp = dict(w1=ex["w1"])
    else:
        inp = _inputs("swiglu", True, True, dtype=dtype, requires_grad=True)
        x, offs, w2, b1 = inp["x_sorted"], inp["offs"], inp["w2"], inp["b1"]
        extra = dict(probs=inp["probs"])
    gate, up, stacked = _split_up(inp)
    if storage == "transposed_up":
        up = up.detach().mT.contiguous().mT.requires_grad_(True)
    op = torch.ops.compiled_moe.moe_mlp
    with kernels_on_cpu() if kernels else contextlib.nullcontext():
        y, h = op(x, offs, gate, w2, "swiglu", b1=b1, w3=up, **extra)
        got = torch.autograd.grad(y, [x, gate, up, w2, b1], torch.ones_like(y))
        y_s, h_s = op(x, offs, stacked, w2, "swiglu", b1=b1, **extra)
        want = torch.autograd.grad(y_s, [x, stacked, w2, b1], torch.ones_like(y_s))
    torch.testing.assert_close(y, y_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_s, rtol=1e-5, atol=1e-5)
    inter = gate.shape[1]
    pairs = [(got[1], want[1][:, :inter]), (got[2], want[1][:, inter:]), (got[3], want[2]),
             (got[4], want[3])]
    for g, w in pairs:
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # dx: fp16 rounds each half's GEMM, then their sum (about 1e-2 of a value of 1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    assert got[2].stride() == up.stride()  # w3's gradient in w3's own storage order


@pytest.mark.parametrize("change,match", [
    (dict(activation="gelu"), "needs a gated activation"),
    (dict(gate_up_layout="interleaved"), "gate_up_layout='stacked'"),
    (dict(w3_shape=(4, 16, 23)), "w3 must be shaped like w1"),
])
def test_separate_up_weight_bad_inputs(change, match):
    inp = _inputs("swiglu", False, False, dtype=torch.float32)
    gate = inp["w1"][:, :16]
    w3 = torch.zeros(change.get("w3_shape", tuple(gate.shape)))
    kw = dict(activation="swiglu", gate_up_layout="stacked")
    kw.update({k: v for k, v in change.items() if k != "w3_shape"})
    w2 = inp["w2"] if kw["activation"] == "swiglu" else torch.zeros(4, 24, 32)
    with pytest.raises(ValueError, match=match):
        torch.ops.compiled_moe.moe_mlp(inp["x_sorted"], inp["offs"], gate, w2, kw["activation"],
                                       kw["gate_up_layout"], w3=w3)


# ------------------------------------------------------------------ opcheck, compile


def _opcheck_samples():
    inp = _inputs("swiglu", True, True, dtype=torch.float32)
    ex = _experts("gpt_oss", False)
    offs, row_of, source = loop_route(ex["topk_ids"], 5)
    h = torch.randn(inp["x_sorted"].shape[0], inp["w1"].shape[1])
    dy = torch.randn(inp["x_sorted"].shape)
    mlp, dgrad = torch.ops.compiled_moe.moe_mlp, torch.ops.compiled_moe.moe_mlp_fc2_dgrad
    args = (inp["x_sorted"], inp["offs"], inp["w1"], inp["w2"], "swiglu", "stacked")
    return {
        "mlp": (mlp, args + (inp["probs"], inp["b1"], inp["b2"])),
        "mlp_plain": (mlp, args),
        "mlp_gather": (mlp, (ex["hidden"], offs, ex["w1"], ex["w2"], "gpt_oss", "interleaved",
                             None, None, None, source, row_of, 1.5, 6.0)),
        "mlp_separate_up": (mlp, (inp["x_sorted"], inp["offs"], inp["w1"][:, :16].contiguous(),
                                  inp["w2"], "swiglu", "stacked", inp["probs"], inp["b1"], None,
                                  None, None, 1.702, 7.0, True,
                                  inp["w1"][:, 16:].contiguous())),
        "dgrad": (dgrad, (dy, inp["w2"], h, inp["offs"], inp["probs"], "swiglu", "stacked",
                          1.702, 7.0)),
        "dgrad_no_probs": (dgrad, (dy, inp["w2"], h, inp["offs"], None, "geglu", "interleaved",
                                   1.702, 7.0)),
    }


@pytest.mark.parametrize("sample", list(_opcheck_samples()))
def test_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


def test_compile_dynamic_one_compile():
    base = _inputs("swiglu", True, True, dtype=torch.float32, requires_grad=True)
    params = [base[n] for n in ("w1", "w2", "b1", "b2")]

    def step(x, offs, probs):
        return cm.moe_mlp(x, offs, params[0], params[1], probs=probs, b1=params[2],
                          b2=params[3]).sum()

    sizes = [_inputs("swiglu", True, True, rows=rows, dtype=torch.float32, seed=rows,
                     requires_grad=True) for rows in (13, 30, 41)]
    assert_one_dynamic_compile(step, [(i["x_sorted"], i["offs"], i["probs"]) for i in sizes],
                               lambda args: [args[0], args[2], *params])


# ------------------------------------------------------------------ training features


def test_delayed_weight_gradients_match_immediate():
    """Backward with a WeightGradStore, then compute(): the gradients of a plain backward,
    bitwise, whichever order the two steps' weight gradients run in."""
    inp = _inputs("swiglu", True, True, dtype=torch.float32, requires_grad=True)
    grads = [torch.randn(inp["x_sorted"].shape) for _ in range(2)]
    leaves = [inp[n] for n in NAMES]

    def run(store):
        for t in leaves:
            t.grad = None
        with kernels_on_cpu():
            for grad in grads:
                cm.moe_mlp(**inp, wgrad_store=store).backward(grad)
            if store is not None:
                assert len(store) == 2 and inp["w1"].grad is None
                store.compute()
        return [t.grad.clone() for t in leaves]

    immediate, delayed = run(None), run(WeightGradStore())
    for a, b in zip(immediate, delayed):
        assert torch.equal(a, b)


def test_main_grad_accumulation_with_mask():
    inp = _inputs("swiglu", False, False, dtype=torch.float32, requires_grad=True)
    w1, w2 = inp["w1"], inp["w2"]
    grad = torch.randn(inp["x_sorted"].shape)
    with kernels_on_cpu():
        cm.moe_mlp(**inp).backward(grad)
    want1, want2, want_x = w1.grad.clone(), w2.grad.clone(), inp["x_sorted"].grad.clone()
    w1.grad = w2.grad = inp["x_sorted"].grad = None
    w1.main_grad = torch.randn(w1.shape)
    w2.main_grad = torch.randn(w2.shape).mT.contiguous().mT  # any strides
    old1, old2 = w1.main_grad.clone(), w2.main_grad.clone()
    mask = torch.tensor([True, False, True, False])
    store = WeightGradStore()
    with kernels_on_cpu():
        cm.moe_mlp(**inp, fuse_wgrad_accumulation=True, accumulate_mask=mask,
                   wgrad_store=store).backward(grad)
        assert torch.equal(w1.main_grad, old1)  # nothing before compute()
        store.compute()
    keep = mask[:, None, None]
    torch.testing.assert_close(w1.main_grad, torch.where(keep, old1, 0) + want1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.main_grad, torch.where(keep, old2, 0) + want2, rtol=1e-5, atol=1e-5)
    assert w1.grad is None and w2.grad is None
    torch.testing.assert_close(inp["x_sorted"].grad, want_x)


def test_fc2_dgrad_checks_probs():
    """The backward op checks probs as moe_mlp does."""
    inp = _inputs("swiglu", False, True, dtype=torch.float32)
    dy = torch.randn(inp["x_sorted"].shape)
    h = torch.randn(dy.shape[0], 2 * inp["w2"].shape[2])
    args = (dy, inp["w2"], h, inp["offs"])
    with pytest.raises(TypeError, match="probs must be a floating"):
        torch.ops.compiled_moe.moe_mlp_fc2_dgrad(*args, torch.ones(dy.shape[0], dtype=torch.int32),
                                                 "swiglu", "stacked", 1.702, 7.0)
    with pytest.raises(ValueError, match="probs must be"):
        torch.ops.compiled_moe.moe_mlp_fc2_dgrad(*args, torch.rand(3), "swiglu", "stacked", 1.702, 7.0)


def test_training_features_bad_inputs():
    inp = _inputs("swiglu", False, False, dtype=torch.float32, requires_grad=True)
    with pytest.raises(ValueError, match="w1.main_grad"):
        cm.moe_mlp(**inp, fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match="accumulate_mask needs"):
        cm.moe_mlp(**inp, accumulate_mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="leaf"):
        cm.moe_mlp(**dict(inp, w1=inp["w1"] * 1), wgrad_store=WeightGradStore())
    # main_grad and the mask are checked in the call, not when backward first writes main_grad.
    for w in (inp["w1"], inp["w2"]):
        w.main_grad = torch.zeros(w.shape)
    mask = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"accumulate_mask must have shape \(4,\)"):
        cm.moe_mlp(**inp, fuse_wgrad_accumulation=True, accumulate_mask=mask[:3])
    with pytest.raises(TypeError, match="accumulate_mask must have dtype"):
        cm.moe_mlp(**inp, fuse_wgrad_accumulation=True, accumulate_mask=mask.int())
    inp["w2"].main_grad = torch.zeros(inp["w2"].shape, dtype=torch.int32)
    with pytest.raises(TypeError, match="w2.main_grad must have dtype"):
        cm.moe_mlp(**inp, fuse_wgrad_accumulation=True, accumulate_mask=mask)


# ------------------------------------------------------------------ bad inputs


def _bad(change):
    inp = _inputs("swiglu", False, False, dtype=torch.float32)
    change(inp)
    return inp


@pytest.mark.parametrize("change,exc,match", [
    (lambda d: d.update(x_sorted=d["x_sorted"][0]), ValueError, "x must be 2-D"),
    (lambda d: d.update(w1=d["w1"].double()), TypeError, "w1 has dtype"),
    (lambda d: d.update(offs=d["offs"].long()), TypeError, "offs must be int32"),
    (lambda d: d.update(offs=d["offs"][:2]), ValueError, "offs must have shape"),
    (lambda d: d.update(w1=d["w1"][:, :, :5]), ValueError, "w1 must be"),
    (lambda d: d.update(w1=d["w1"][:, :31]), ValueError, "must be even"),
    (lambda d: d.update(w2=d["w2"][:, :, :3]), ValueError, "w2 must be"),
    (lambda d: d.update(probs=torch.rand(3)), ValueError, "probs must be"),
    (lambda d: d.update(probs=torch.ones(37, dtype=torch.int32)), TypeError, "probs must be a floating"),
    (lambda d: d.update(b1=torch.zeros(4, 7)), ValueError, "b1 must be"),
    (lambda d: d.update(b2=torch.zeros(4, 7)), ValueError, "b2 must be"),
    (lambda d: d.update(activation="tanh"), ValueError, "activation must be one of"),
    (lambda d: d.update(gate_up_layout="split"), ValueError, "gate_up_layout must be one of"),
])
def test_bad_inputs(change, exc, match):
    inp = _bad(change)
    with pytest.raises(exc, match=match):
        cm.moe_mlp(**inp)


def test_gather_needs_source_and_row_of():
    inp = _inputs("swiglu", False, False, dtype=torch.float32)
    with pytest.raises(ValueError, match="source and row_of"):
        torch.ops.compiled_moe.moe_mlp(inp["x_sorted"], inp["offs"], inp["w1"], inp["w2"],
                                       "swiglu", source=torch.zeros(3, dtype=torch.int32))
