"""GPU tier of the fused expert MLP: kernels against float64 and the same-dtype reference, no
host sync, every element written, weight layouts, compile, and the memory the fusion saves."""

import pytest
import torch

import compiled_moe as cm
from compiled_moe import reference
from helpers import assert_matches_oracle, no_sync, poison_allocator, random_offsets

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _mlp_inputs(rows, hidden, inter, groups, activation, dtype, biases, probs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if activation in reference.GATED_ACTIVATIONS else inter
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV, dtype)  # noqa: E731
    return dict(
        x_sorted=mk(rows, hidden),
        offs=random_offsets(rows, groups, generator=gen, empty_groups=2, tail=rows // 16,
                            device=DEV),
        w1=mk(groups, n1, hidden, scale=hidden ** -0.5),
        w2=mk(groups, hidden, inter, scale=inter ** -0.5),
        probs=torch.rand(rows, generator=gen).to(DEV, torch.float32) if probs else None,
        b1=mk(groups, n1, scale=0.1) if biases else None,
        b2=mk(groups, hidden, scale=0.1) if biases else None)


@pytest.mark.parametrize("activation,layout", [
    ("swiglu", "stacked"), ("swiglu", "interleaved"), ("geglu", "stacked"),
    ("gpt_oss", "interleaved"), ("relu2", "stacked"), ("gelu", "stacked"), ("silu", "stacked")])
@pytest.mark.parametrize("biases,probs", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_mlp_gpu_forward_backward(activation, layout, biases, probs, dtype):
    inp = _mlp_inputs(2000, 384, 320, 12, activation, dtype, biases, probs)
    names = [n for n in ("x_sorted", "w1", "w2", "probs", "b1", "b2") if inp[n] is not None]
    for n in names:
        inp[n].requires_grad_(True)
    kw = dict(activation=activation, gate_up_layout=layout)
    grad = torch.randn_like(inp["x_sorted"])
    poison_allocator(64 << 20)
    with no_sync():
        out = cm.moe_mlp(**inp, **kw)
        grads = torch.autograd.grad(out, [inp[n] for n in names], grad)

    def leaves(dtype=None):
        out = {n: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for n, v in inp.items()}
        for n in names:
            out[n] = out[n].to(dtype or out[n].dtype).requires_grad_(True)
        return out

    f64, same_dtype = leaves(torch.float64), leaves()
    want = cm.moe_mlp(**f64, **kw)  # the reference path on CPU
    want_grads = torch.autograd.grad(want, [f64[n] for n in names], grad.cpu().double())
    same = cm.moe_mlp(**same_dtype, **kw)
    same_grads = torch.autograd.grad(same, [same_dtype[n] for n in names], grad.cpu())
    assert_matches_oracle(out, want.detach(), same, atol=1e-2)
    for n, g, w, s in zip(names, grads, want_grads, same_grads):
        assert_matches_oracle(g, w, s, atol=1e-2)


def _moe_mlp_op(inp, activation, layout, source=None, row_of=None):
    """The op itself, which also reads rows through a routing map (moe_experts' path)."""
    return torch.ops.compiled_moe.moe_mlp(inp["x_sorted"], inp["offs"], inp["w1"], inp["w2"],
                                          activation, layout, inp["probs"], inp["b1"], inp["b2"],
                                          source, row_of)[0]


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("activation,layout", [("swiglu", "stacked"), ("gpt_oss", "interleaved")])
def test_moe_mlp_gemms_on_cuda_kernel(monkeypatch, activation, layout, gather):
    """FC1 (the CUDA GEMM, then the activation kernel) and FC2's forward and input-gradient
    GEMMs on the CUDA kernel, what large problems run, give the Triton kernels' results,
    forward and backward, and the oracle's; with rows read through a routing map too."""
    from compiled_moe.kernels import configs, grouped_mm_sm90

    rows, hidden, inter = 3000, 512, 384
    inp = _mlp_inputs(rows, hidden, inter, 12, activation, torch.bfloat16, True, True)
    route = {}
    if gather:  # 1500 tokens, 2 slots each, in a shuffled order; every 97th sorted row dropped
        gen = torch.Generator().manual_seed(1)
        source = torch.randperm(rows, generator=gen).to(torch.int32)
        source[::97] = -1
        row_of = torch.full((rows // 2, 2), -1, dtype=torch.int32)
        kept = source >= 0
        row_of.view(-1)[source[kept].long()] = torch.arange(rows, dtype=torch.int32)[kept]
        route = dict(source=source.to(DEV), row_of=row_of.to(DEV))
        inp["x_sorted"] = inp["x_sorted"][: rows // 2].clone()
    names = [n for n in ("x_sorted", "w1", "w2", "probs", "b1", "b2") if inp[n] is not None]
    for n in names:
        inp[n].requires_grad_(True)
    grad = torch.randn(rows, hidden, device=DEV, dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    assert grouped_mm_sm90.supported(grad.new_empty(rows, inter), inp["w2"].mT, inp["b2"], bf16)
    assert grouped_mm_sm90.supported(grad, inp["w2"], None, bf16)
    assert grouped_mm_sm90.supported(grad, inp["w1"].mT, inp["b1"], bf16)
    monkeypatch.setattr(configs, "FUSED_MLP_FC1_CUDA_MIN_INTER", 0)
    results = {}
    for macs in (0, 2 ** 62):  # the CUDA kernel, then Triton
        monkeypatch.setattr(configs, "FUSED_MLP_CUDA_GEMM_MACS", macs)
        with no_sync():
            out = _moe_mlp_op(inp, activation, layout, **route)
            results[macs] = (out, *torch.autograd.grad(out, [inp[n] for n in names], grad))
    for cuda, triton in zip(results[0], results[2 ** 62]):
        torch.testing.assert_close(cuda, triton, rtol=0, atol=0)
    oracles = []
    for dtype in (torch.float64, None):  # the reference on CPU: float64, then bf16
        leaves = {n: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for n, v in inp.items()}
        for n in names:
            leaves[n] = leaves[n].to(dtype or leaves[n].dtype).requires_grad_(True)
        ref = _moe_mlp_op(leaves, activation, layout, **{n: t.cpu() for n, t in route.items()})
        ref_grads = torch.autograd.grad(ref, [leaves[n] for n in names], grad.cpu().to(ref.dtype))
        oracles.append((ref.detach(), *ref_grads))
    for got, want, same in zip(results[0], *oracles):
        assert_matches_oracle(got, want, same, atol=1e-2)


def test_moe_mlp_weight_views_and_fp32():
    """Transposed weight views (no TMA on them) and fp32 give the contiguous weights' result."""
    inp = _mlp_inputs(700, 128, 96, 5, "swiglu", torch.float32, True, True)
    base = cm.moe_mlp(**inp)
    views = dict(inp, w1=inp["w1"].mT.contiguous().mT, w2=inp["w2"].mT.contiguous().mT)
    torch.testing.assert_close(cm.moe_mlp(**views), base, rtol=1e-4, atol=1e-4)
    f64 = {n: (v.double() if v.is_floating_point() else v) for n, v in inp.items()}
    want = cm.moe_mlp(**f64)  # float64 runs the reference
    torch.testing.assert_close(base.double(), want, rtol=1e-2, atol=1e-2)


def _experts(tokens, hidden, inter, experts, k, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=gen) * scale).to(torch.bfloat16)  # noqa: E731
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, device=DEV,
                                                        generator=gen), -1), k)
    return (mk(tokens, hidden).requires_grad_(True), ids, weights.to(torch.bfloat16),
            mk(experts, 2 * inter, hidden, scale=hidden ** -0.5).requires_grad_(True),
            mk(experts, hidden, inter, scale=inter ** -0.5).requires_grad_(True))


def _saved_and_grads(fused, args, grad):
    """Memory held between forward and backward (the output included), and the gradients."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = cm.moe_experts(*args, fused=fused)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base
    grads = torch.autograd.grad(out, [args[0], args[3], args[4]], grad)
    return out, grads, saved


def test_fused_experts_match_unfused_with_less_memory():
    args = _experts(4096, 1024, 384, 32, 8)
    grad = torch.randn_like(args[0])
    _saved_and_grads(True, args, grad)  # compile and load the kernels first
    _saved_and_grads(False, args, grad)
    out_f, grads_f, saved_f = _saved_and_grads(True, args, grad)
    out_u, grads_u, saved_u = _saved_and_grads(False, args, grad)
    torch.testing.assert_close(out_f, out_u, rtol=2e-2, atol=2e-2)
    # Both paths round FC2's input gradient to bf16 before the activation backward, but the
    # forward's FC1 output and activation differ in fused epilogue rounding: compare in norm.
    for f, u in zip(grads_f, grads_u):
        assert (f.float() - u.float()).norm() <= 1e-2 * u.float().norm()
    # Kept for backward: unfused, the permuted input, FC1's output, the activation and FC2's
    # output (M x (2H + 3I) values); fused, FC1's and FC2's outputs (M x (H + 2I)).
    assert saved_f < 0.7 * saved_u, (saved_f / 2**20, saved_u / 2**20)


def test_moe_mlp_compile_dynamic_one_compile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    base = _mlp_inputs(64, 128, 96, 6, "swiglu", torch.bfloat16, False, True)
    w1, w2 = base["w1"].requires_grad_(True), base["w2"].requires_grad_(True)

    def mlp(x, offs, probs):
        return cm.moe_mlp(x, offs, w1, w2, probs=probs)

    compiled = torch.compile(mlp, backend=counter, fullgraph=True, dynamic=True)
    for rows in (300, 1024, 1777):
        inp = _mlp_inputs(rows, 128, 96, 6, "swiglu", torch.bfloat16, False, True, seed=rows)
        args = (inp["x_sorted"].requires_grad_(True), inp["offs"], inp["probs"])
        got = compiled(*args)
        got.float().square().sum().backward()
        torch.testing.assert_close(got, mlp(*args), rtol=2e-2, atol=2e-2)
    assert counter.frame_count == 1


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("rows,hidden,inter", [(2000, 384, 320), (4096, 2048, 768)])
def test_separate_up_weight_matches_stacked_gpu(gather, rows, hidden, inter):
    """moe_mlp with gate and up as two weights (w1, w3) against the same op on their stacked
    copy: the fused FC1 reads both tensors; output, h and every gradient (w1's and w3's are
    the halves of the stacked one), bf16, no host sync."""
    groups, top_k = 16, 4
    gen = torch.Generator().manual_seed(3)
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV, torch.bfloat16)  # noqa: E731
    w13 = mk(groups, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = mk(groups, hidden, inter, scale=inter ** -0.5)
    extra = {}
    if gather:
        ids = torch.randint(0, groups, (rows // top_k, top_k), generator=gen).to(DEV)
        offs, row_of, source = torch.ops.compiled_moe.moe_route(ids, groups, 1)
        x = mk(rows // top_k, hidden)
        extra = dict(source=source, row_of=row_of)
    else:
        x = mk(rows, hidden)
        offs = random_offsets(rows, groups, generator=gen, empty_groups=2, tail=rows // 16,
                              device=DEV)
    leaves = lambda *ts: [t.detach().clone().requires_grad_(True) for t in ts]  # noqa: E731
    x_a, gate, up, w2_a = leaves(x, w13[:, :inter], w13[:, inter:], w2)
    x_b, stacked, w2_b = leaves(x, w13, w2)
    op = torch.ops.compiled_moe.moe_mlp
    with no_sync():
        y, h = op(x_a, offs, gate, w2_a, "swiglu", w3=up, **extra)
    y_s, h_s = op(x_b, offs, stacked, w2_b, "swiglu", **extra)
    cot = torch.randn(y.shape, generator=gen).to(DEV, torch.bfloat16)
    y.backward(cot)
    y_s.backward(cot)
    torch.testing.assert_close(y, y_s, rtol=0, atol=0)  # the same tiles, the same sums
    torch.testing.assert_close(h, h_s, rtol=0, atol=0)
    torch.testing.assert_close(w2_a.grad, w2_b.grad, rtol=0, atol=0)
    # The weight gradients' GEMMs see other shapes (a tile plan may differ), and dx is two
    # GEMMs summed against one over the stacked K: bf16 rounding apart.
    for got, want in ((gate.grad, stacked.grad[:, :inter]), (up.grad, stacked.grad[:, inter:]),
                      (x_a.grad, x_b.grad)):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2 * scale)
