"""CPU tier of the grouped GEMM ops: reference, kernels under the Triton interpreter, autograd,
opcheck, torch.compile, bad inputs."""

from __future__ import annotations

import pytest
import torch

import compiled_moe as cm
from compiled_moe.ops._dispatch import kernels_on_cpu
from helpers import (
    assert_matches_oracle,
    loop_grouped_mm,
    loop_grouped_sum,
    loop_wgrad,
    random_offsets,
)

# (M, K, N, G, empty_groups, tail_rows): group boundaries, empty groups, tails past offs[-1].
CASES = [
    (37, 24, 40, 4, 1, 3),
    (50, 13, 7, 3, 0, 0),       # odd K and N
    (33, 32, 48, 1, 0, 5),      # G = 1
    (0, 16, 16, 3, 0, 0),       # M = 0
    (45, 40, 24, 5, 4, 0),      # one group holds every row
    (64, 16, 32, 6, 2, 17),
    (20, 0, 16, 3, 0, 2),       # K = 0: bias alone (or zeros)
]


def _weights(G, K, N, dtype, layout, gen):
    """b as (G, K, N): contiguous ("kn") or the transposed view of a (G, N, K) weight ("nk")."""
    if layout == "nk":
        return torch.randn(G, N, K, generator=gen, dtype=torch.float32).to(dtype).transpose(1, 2)
    return torch.randn(G, K, N, generator=gen, dtype=torch.float32).to(dtype)


def _inputs(case, dtype, layout="kn", bias=False, seed=0, noncontig_a=False):
    M, K, N, G, empty, tail = case
    gen = torch.Generator().manual_seed(seed)
    if noncontig_a:
        a = torch.randn(K + 3, M, generator=gen).to(dtype)[:K].t()  # (M, K), strides (1, M)
    else:
        a = torch.randn(M, K, generator=gen).to(dtype)
    b = _weights(G, K, N, dtype, layout, gen)
    offs = random_offsets(M, G, generator=gen, empty_groups=empty, tail=min(tail, M))
    bias_t = torch.randn(G, N, generator=gen).to(dtype) if bias else None
    return a, b, offs, bias_t


# ------------------------------------------------------------------ reference path (CPU ops)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm_matches_loop(case, dtype, layout, bias):
    a, b, offs, bias_t = _inputs(case, dtype, layout, bias, noncontig_a=case[0] % 2 == 1)
    out = cm.grouped_mm(a, b, offs, bias=bias_t)
    assert out.dtype == dtype
    assert_matches_oracle(out, loop_grouped_mm(a, b, offs, bias_t),
                          loop_grouped_mm(a, b, offs, bias_t, dtype=dtype))


def test_grouped_mm_out_dtype():
    a, b, offs, _ = _inputs(CASES[0], torch.float32)
    out = cm.grouped_mm(a, b, offs, out_dtype=torch.float64)
    assert out.dtype == torch.float64
    assert_matches_oracle(out, loop_grouped_mm(a, b, offs), loop_grouped_mm(a, b, offs,
                                                                            dtype=torch.float32))


@pytest.mark.parametrize("case", CASES)
def test_wgrad_and_grouped_sum_match_loop(case):
    M, K, N, G, empty, tail = case
    a, _, offs, _ = _inputs(case, torch.float32)
    d = torch.randn(M, N)
    assert_matches_oracle(cm.grouped_mm_wgrad(a, d, offs), loop_wgrad(a, d, offs),
                          loop_wgrad(a, d, offs, dtype=torch.float32))
    assert_matches_oracle(cm.grouped_sum(d, offs), loop_grouped_sum(d, offs),
                          loop_grouped_sum(d, offs, dtype=torch.float32))


@pytest.mark.parametrize("main_layout", ["kn", "nk"])
def test_wgrad_accumulate_with_mask(main_layout):
    M, K, N, G = 40, 24, 16, 4
    a, d = torch.randn(M, K), torch.randn(M, N)
    offs = random_offsets(M, G, empty_groups=1)
    start = torch.randn(G, K, N)
    main = start.clone() if main_layout == "kn" else start.transpose(1, 2).contiguous()
    view = main if main_layout == "kn" else main.transpose(1, 2)
    mask = torch.tensor([True, False, True, False])
    ret = cm.grouped_mm_wgrad_accumulate_(view, a, d, offs, accumulate_mask=mask)
    assert ret is view
    expect = loop_wgrad(a, d, offs) + start.double() * mask.double()[:, None, None]
    assert_matches_oracle(view, expect, expect.float())
    cm.grouped_mm_wgrad_accumulate_(view, a, d, offs)  # no mask: every group accumulates
    expect = expect + loop_wgrad(a, d, offs)
    assert_matches_oracle(view, expect, expect.float(), atol=1e-5)


def test_corrupt_offsets_are_clamped():
    """Non-monotonic offsets and offsets past M follow the clamping rule, never fault."""
    M, K, N = 30, 16, 8
    a, b = torch.randn(M, K), torch.randn(4, K, N)
    for offs in ([5, 3, 40, 12], [-4, 10, 10, 29], [31, 31, 31, 31]):
        offs = torch.tensor(offs, dtype=torch.int32)
        assert_matches_oracle(cm.grouped_mm(a, b, offs), loop_grouped_mm(a, b, offs),
                              loop_grouped_mm(a, b, offs, dtype=torch.float32))


def test_counts_offsets_roundtrip():
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    offs = cm.counts_to_offsets(counts)
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 3, 8, 9]
    assert cm.offsets_to_counts(offs).tolist() == counts.tolist()


# ------------------------------------------------------------------ autograd


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_grouped_mm_gradcheck(layout):
    a, b, offs, bias = _inputs((14, 5, 6, 3, 1, 2), torch.float64, layout, bias=True)
    a.requires_grad_(True)
    bias.requires_grad_(True)
    b = b.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, bias: cm.grouped_mm(a, b, offs, bias=bias),
                                    (a, b, bias))
    assert torch.autograd.gradgradcheck(lambda a, b: cm.grouped_mm(a, b, offs), (a, b))


def test_wgrad_and_grouped_sum_gradcheck():
    a = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    d = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, d: cm.grouped_mm_wgrad(a, d, offs), (a, d))
    assert torch.autograd.gradcheck(lambda d: cm.grouped_sum(d, offs), (d,))


def test_weight_grad_keeps_weight_layout():
    """The gradient of an nn.Linear-style (G, N, K) weight comes back as a contiguous (G, N, K)."""
    w = torch.randn(3, 8, 5, requires_grad=True)
    a = torch.randn(10, 5)
    cm.grouped_mm(a, w.transpose(1, 2), torch.tensor([3, 7, 10], dtype=torch.int32)).sum().backward()
    assert w.grad.shape == (3, 8, 5) and w.grad.is_contiguous()


# ------------------------------------------------------------------ opcheck


def _opcheck_samples():
    a, b, offs, bias = _inputs(CASES[0], torch.float32, "nk", bias=True)
    d = torch.randn(a.shape[0], b.shape[2])
    a_rg = a.clone().requires_grad_(True)
    return [
        (torch.ops.compiled_moe.grouped_mm.default, (a_rg, b.detach().requires_grad_(True), offs,
                                                     bias.requires_grad_(True), None)),
        (torch.ops.compiled_moe.grouped_mm.default, (a, b.contiguous(), offs, None, torch.float64)),
        (torch.ops.compiled_moe.grouped_mm_wgrad.default, (a_rg, d.requires_grad_(True), offs, None)),
        (torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_.default,
         (torch.randn(offs.shape[0], a.shape[1], d.shape[1]), a, d.detach(), offs,
          torch.tensor([True, False, True, True]))),
        (torch.ops.compiled_moe.grouped_sum.default, (d.detach().requires_grad_(True), offs, None)),
    ]


@pytest.mark.parametrize("sample", range(5))
def test_opcheck(sample):
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


# ------------------------------------------------------------------ torch.compile


def test_compile_dynamic_one_compile_forward_backward():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    K, N, G = 16, 24, 4
    w = torch.randn(G, N, K, requires_grad=True)
    bias = torch.randn(G, N, requires_grad=True)

    def step(x, offs):
        y = cm.grouped_mm(x, w.transpose(1, 2), offs, bias=bias)
        return torch.relu(y).sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for M in (23, 40, 57):
        x = torch.randn(M, K, requires_grad=True)
        offs = random_offsets(M, G, empty_groups=1, tail=2)
        got = compiled(x, offs)
        got.backward()
        grads = [t.grad.clone() for t in (x, w, bias)]
        for t in (x, w, bias):
            t.grad = None
        want = step(x, offs)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for g, t in zip(grads, (x, w, bias)):
            torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4)
        for t in (x, w, bias):
            t.grad = None
    assert counter.frame_count == 1


# ------------------------------------------------------------------ Triton kernels, interpreter


def _require_interpreter():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton interpreter tests run in the CPU tier")
    pytest.importorskip("triton")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("tma", ["1", "0"])
def test_kernel_grouped_mm_interpreter(case, dtype, layout, tma, monkeypatch):
    _require_interpreter()
    from compiled_moe.kernels import grouped_mm as kernels

    monkeypatch.setenv("COMPILED_MOE_TMA", tma)
    a, b, offs, bias = _inputs(case, dtype, layout, bias=case[3] % 2 == 0,
                               noncontig_a=tma == "0" and case[0] % 2 == 1)
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=dtype)  # poison
    kernels.grouped_mm(a, b, offs, bias, out)
    assert_matches_oracle(out, loop_grouped_mm(a, b, offs, bias),
                          loop_grouped_mm(a, b, offs, bias, dtype=dtype), atol=1e-3)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tma", ["1", "0"])
def test_kernel_wgrad_interpreter(case, dtype, tma, monkeypatch):
    _require_interpreter()
    from compiled_moe.kernels import grouped_mm as kernels

    monkeypatch.setenv("COMPILED_MOE_TMA", tma)
    M, K, N, G, _, _ = case
    a, _, offs, _ = _inputs(case, dtype)
    d = torch.randn(M, N).to(dtype)
    out = torch.full((G, K, N), float("nan"), dtype=dtype)
    kernels.grouped_mm_wgrad(a, d, offs, out, accumulate=False, accumulate_mask=None)
    assert_matches_oracle(out, loop_wgrad(a, d, offs), loop_wgrad(a, d, offs, dtype=dtype),
                          atol=1e-3)

    # In-place accumulation with a mask into an fp32 buffer: (G, K, N) itself (TMA store when
    # enabled) and a (G, N, K) buffer seen as (G, K, N) (strided stores).
    mask = torch.arange(G) % 2 == 0
    for main in (torch.randn(G, K, N), torch.randn(G, N, K).transpose(1, 2)):
        start = main.clone()
        kernels.grouped_mm_wgrad(a, d, offs, main, accumulate=True, accumulate_mask=mask)
        expect = loop_wgrad(a, d, offs) + start.double() * mask[:, None, None]
        assert_matches_oracle(main, expect, expect.float(), atol=1e-3)

    sums = torch.full((G, N), float("nan"), dtype=dtype)
    kernels.grouped_sum(d, offs, sums)
    assert_matches_oracle(sums, loop_grouped_sum(d, offs), loop_grouped_sum(d, offs, dtype=dtype),
                          atol=1e-3)


def test_kernel_corrupt_offsets_interpreter():
    _require_interpreter()
    M, K, N = 30, 16, 16
    a, b = torch.randn(M, K), torch.randn(4, K, N)
    d = torch.randn(M, N)
    for offs in ([5, 3, 40, 12], [-4, 10, 10, 29]):
        offs = torch.tensor(offs, dtype=torch.int32)
        with kernels_on_cpu():
            out = cm.grouped_mm(a, b, offs)
            wg = cm.grouped_mm_wgrad(a, d, offs)
        assert_matches_oracle(out, loop_grouped_mm(a, b, offs),
                              loop_grouped_mm(a, b, offs, dtype=torch.float32))
        assert_matches_oracle(wg, loop_wgrad(a, d, offs), loop_wgrad(a, d, offs, torch.float32))


def test_kernel_strided_offsets_and_mask_interpreter():
    """Offsets and masks that are strided views are read correctly."""
    _require_interpreter()
    M, K, N, G = 40, 16, 16, 3
    a, b, d = torch.randn(M, K), torch.randn(G, K, N), torch.randn(M, N)
    offs = torch.tensor([[5, 0], [22, 0], [37, 0]], dtype=torch.int32)[:, 0]  # stride 2
    mask = torch.tensor([[True, False], [False, False], [True, False]])[:, 0]
    main = torch.randn(G, K, N)
    start = main.clone()
    with kernels_on_cpu():
        out = cm.grouped_mm(a, b, offs)
        sums = cm.grouped_sum(d, offs)
        cm.grouped_mm_wgrad_accumulate_(main, a, d, offs, accumulate_mask=mask)
    assert_matches_oracle(out, loop_grouped_mm(a, b, offs),
                          loop_grouped_mm(a, b, offs, dtype=torch.float32))
    assert_matches_oracle(sums, loop_grouped_sum(d, offs),
                          loop_grouped_sum(d, offs, dtype=torch.float32))
    expect = loop_wgrad(a, d, offs) + start.double() * mask.double()[:, None, None]
    assert_matches_oracle(main, expect, expect.float())


def test_kernel_autograd_interpreter():
    """Forward and backward through the op, every kernel on the interpreter, vs the reference."""
    _require_interpreter()
    a, b, offs, bias = _inputs((40, 24, 32, 3, 1, 4), torch.float32, "nk", bias=True)
    leaves = [t.detach().clone().requires_grad_(True) for t in (a, b, bias)]
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (a, b, bias)]
    grad = torch.randn(a.shape[0], b.shape[2])
    with kernels_on_cpu():
        out = cm.grouped_mm(leaves[0], leaves[1], offs, bias=leaves[2])
        out.backward(grad)
    ref = cm.grouped_mm(ref_leaves[0], ref_leaves[1], offs, bias=ref_leaves[2])
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ bad inputs


def _good():
    return (torch.randn(10, 8), torch.randn(3, 8, 5), torch.tensor([2, 5, 10], dtype=torch.int32))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a, b, o: (a.to(torch.int32), b, o), TypeError, "a must have dtype"),
    (lambda a, b, o: (a, b.double(), o), TypeError, "b has dtype"),
    (lambda a, b, o: (a[None], b, o), ValueError, "a must be 2-D"),
    (lambda a, b, o: (a, b[0], o), ValueError, "b must be 3-D"),
    (lambda a, b, o: (a[:, :7], b, o), ValueError, "K must match"),
    (lambda a, b, o: (a, b, o.long()), TypeError, "offs must be int32"),
    (lambda a, b, o: (a, b, o[:2]), ValueError, r"offs must have shape \(3,\)"),
    (lambda a, b, o: (a, b, o.to("meta")), ValueError, "offs is on meta"),
    (lambda a, b, o: (a, b, [2, 5, 10]), RuntimeError, "argument .offs."),  # schema check
])
def test_grouped_mm_bad_inputs(mutate, exc, match):
    with pytest.raises(exc, match=match):
        cm.grouped_mm(*mutate(*_good()))


def test_bad_bias_and_out_dtype():
    a, b, offs = _good()
    with pytest.raises(ValueError, match="bias must have shape"):
        cm.grouped_mm(a, b, offs, bias=torch.randn(3, 4))
    with pytest.raises(TypeError, match="out_dtype"):
        cm.grouped_mm(a, b, offs, out_dtype=torch.int8)


def test_wgrad_bad_inputs():
    a, _, offs = _good()
    with pytest.raises(ValueError, match="rows"):
        cm.grouped_mm_wgrad(a, torch.randn(9, 5), offs)
    with pytest.raises(ValueError, match="main_grad must have shape"):
        cm.grouped_mm_wgrad_accumulate_(torch.zeros(3, 5, 8), a, torch.randn(10, 5), offs)
    with pytest.raises(ValueError, match="main_grad must not have elements that share memory"):
        cm.grouped_mm_wgrad_accumulate_(torch.zeros(3, 8, 1).expand(3, 8, 5), a,
                                        torch.randn(10, 5), offs)
    with pytest.raises(TypeError, match="accumulate_mask"):
        cm.grouped_mm_wgrad_accumulate_(torch.zeros(3, 8, 5), a, torch.randn(10, 5), offs,
                                        accumulate_mask=torch.ones(3))
    with pytest.raises(ValueError, match="accumulate_mask must have shape"):
        cm.grouped_mm_wgrad_accumulate_(torch.zeros(3, 8, 5), a, torch.randn(10, 5), offs,
                                        accumulate_mask=torch.ones(2, dtype=torch.bool))


def test_cuda_kernel_ops_check_their_inputs():
    """The Hopper kernels' custom ops are reachable through torch.ops, so they check their
    inputs like the ops that call them (their fakes run the checks here, on meta tensors)."""
    ops = torch.ops.compiled_moe
    a, b, offs = (t.to("meta") for t in _good())
    d = torch.empty(10, 5, device="meta")
    assert ops.grouped_mm_sm90(a, b, offs).shape == (10, 5)
    assert ops.grouped_mm_wgrad_sm90(a, d, offs).shape == (3, 8, 5)
    with pytest.raises(ValueError, match="K must match"):
        ops.grouped_mm_sm90(a[:, :7], b, offs)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.grouped_mm_sm90(a, b, offs, torch.empty(3, 4, device="meta"))
    with pytest.raises(TypeError, match="b has dtype"):
        ops.grouped_mm_sm90(a, b.double(), offs)
    with pytest.raises(ValueError, match="rows"):
        ops.grouped_mm_wgrad_sm90(a, d[:9], offs)
    with pytest.raises(TypeError, match="offs must be int32"):
        ops.grouped_mm_wgrad_sm90(a, d, offs.long())
    with pytest.raises(ValueError, match="main_grad must have shape"):
        ops.grouped_mm_wgrad_accumulate_sm90_(torch.empty(3, 5, 8, device="meta"), a, d, offs)
    with pytest.raises(ValueError, match="accumulate_mask must have shape"):
        ops.grouped_mm_wgrad_accumulate_sm90_(torch.empty(3, 8, 5, device="meta"), a, d, offs,
                                              torch.empty(2, dtype=torch.bool, device="meta"))


def test_every_op_body_runs_on_its_tensors_device():
    """Python-registered ops get no device guard from the dispatcher, so every op body of
    compiled_moe/ops is wrapped in on_tensor_device (its behaviour on two GPUs:
    tests/test_gpu_multi_device.py)."""
    import ast
    import pathlib

    import compiled_moe.ops

    unguarded, ops = [], 0
    for path in pathlib.Path(compiled_moe.ops.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            if any(n in ("torch.library.triton_op", "torch.library.custom_op", "kernel_op") for n in names):
                ops += 1
                if names[1:2] != ["on_tensor_device"]:
                    unguarded.append(f"{path.name}:{node.name}")
    assert ops >= 21
    assert not unguarded, f"op bodies without on_tensor_device: {unguarded}"


# Ops without an autograd kernel (kernel_op's autograd="none"): the route (integer inputs) and
# the CUDA kernels' ops, which the public ops' bodies call below autograd and compiled graphs
# call as opaque nodes, where the layer would cost host time.
NO_AUTOGRAD_OPS = {"moe_route", "grouped_mm_sm90", "grouped_mm_wgrad_sm90",
                   "fp8_blockwise_grouped_mm_sm90", "fp8_grouped_mm_wgrad_sm90",
                   "grouped_quantize_columns_cuda"}


def test_every_public_op_has_an_autograd_kernel():
    """Every other op has an autograd kernel: its formula, or one that raises on a backward
    through it (kernel_op's autograd="raise"). torch's fallback for ops without one only warns,
    and the gradient through the op is lost."""
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("compiled_moe::") and not n.startswith("compiled_moe::test_only")}
    assert len(names) >= 20 and NO_AUTOGRAD_OPS <= names
    has = {n for n in names
           if torch._C._dispatch_has_kernel_for_dispatch_key(f"compiled_moe::{n}", "Autograd")}
    assert names - has == NO_AUTOGRAD_OPS


def test_backward_through_an_op_without_a_formula_raises():
    """A non-differentiable op fed a tensor that requires grad computes its outputs (as for
    inference), and a backward through them raises, naming the op."""
    x = torch.randn(16, 128, requires_grad=True)
    offs = torch.tensor([16], dtype=torch.int32)
    data, scale, _, _ = torch.ops.compiled_moe.grouped_quantize(x, offs, "fp8_blockwise")
    assert torch.equal(data.view(torch.uint8), torch.ops.compiled_moe.grouped_quantize(
        x.detach(), offs, "fp8_blockwise")[0].view(torch.uint8))
    with pytest.raises(RuntimeError, match="compiled_moe.grouped_quantize is not differentiable"):
        scale.sum().backward()


# ------------------------------------------------------------------ split K's bound (no GPU)

# (hidden, inter, experts, top_k) of DeepSeek-V3 EP8, Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-120B
MODEL_SHAPES = [(7168, 2048, 32, 8), (2048, 768, 128, 8), (4096, 14336, 8, 2), (2880, 2880, 128, 4)]


def test_split_k_bound():
    """configs.grouped_mm_sm90_split_k bounds the k ranges of the CUDA forward so that the fp32
    partial products, written and read back, stay under 1/16 of the weight bytes the GEMM can
    touch, and each range keeps at least 4 k steps: the model shapes may split at a few tokens
    a step and never at training sizes. The fused MLP moves such GEMMs to the CUDA kernel only
    from 128 MB of weights."""
    from compiled_moe.kernels import configs
    for hidden, inter, experts, top_k in MODEL_SHAPES:
        for proj_k, proj_n in ((hidden, 2 * inter), (inter, hidden)):
            for tokens in (1, 2, 8, 32, 128, 512, 4096, 8192):
                rows = tokens * top_k
                splits = configs.grouped_mm_sm90_split_k(rows, proj_n, proj_k, experts)
                weight_bytes = min(experts, rows) * proj_n * proj_k * 2
                assert 1 <= splits <= configs.SPLIT_K_MAX
                if splits > 1:
                    assert 2 * splits * rows * proj_n * 4 <= weight_bytes / 16
                    assert -(-proj_k // 64) // splits >= configs.SPLIT_K_MIN_STEPS
                if tokens >= 4096:
                    assert splits == 1, (hidden, inter, tokens)
                on_cuda = configs.fused_mlp_fc2_on_cuda(rows, proj_n, proj_k, experts)
                assert on_cuda == (rows * proj_n * proj_k >= configs.FUSED_MLP_CUDA_GEMM_MACS
                                   or (splits > 1
                                       and weight_bytes >= configs.FUSED_MLP_CUDA_STREAM_BYTES))
        # one token: every model's FC2 may split
        assert configs.grouped_mm_sm90_split_k(top_k, hidden, inter, experts) > 1
