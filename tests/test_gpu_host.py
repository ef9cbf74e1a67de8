"""GPU tier of the C++ host layer (csrc/host): eager grouped_mm from the dispatcher to the
driver. tests/test_gpu_grouped_mm.py runs the op's numerics through it (the layer is on by
default with a CUDA build of torch); here: its registration, the same bits eager and
compiled, the error without the layer (in a fresh process), CUDA-graph replay under changing
routing, no host sync, opcheck."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import compiled_moe as cm
from compiled_moe import host
from helpers import loop_grouped_mm, no_sync, random_offsets

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs a Hopper GPU")]

# (M, K, N, G, with bias, dgrad): decode (split K), fine-grained (skipping kernel), large.
CASES = [(4, 2048, 1536, 128, False, False), (4, 768, 2048, 128, False, True),
         (2048, 512, 768, 64, True, False), (4096, 2048, 1536, 32, True, True)]


def test_cuda_kernel_registered():
    assert host.cuda_module() is not None, "the C++ host layer did not build on this GPU machine"
    assert "csrc/host/ops.cpp" in torch._C._dispatch_dump("compiled_moe::grouped_mm").split("CUDA:")[1].splitlines()[0]


def _case(M, K, N, G, with_bias, dgrad):
    g = torch.Generator().manual_seed(M + K)
    a = torch.randn(M, K, generator=g).bfloat16().cuda()
    # forward: the transposed view of a (G, N, K) weight; dgrad: a contiguous (G, K, N) one
    b = (torch.randn(G, K, N, generator=g) / K ** 0.5).bfloat16().cuda() if dgrad else \
        (torch.randn(G, N, K, generator=g) / K ** 0.5).bfloat16().cuda().mT
    bias = torch.randn(G, b.shape[2], generator=g).bfloat16().cuda() if with_bias else None
    offs = random_offsets(M, G, generator=g, empty_groups=1).cuda()
    dy = torch.randn(M, b.shape[2], generator=g).bfloat16().cuda()
    return a, b, bias, offs, dy


@pytest.mark.parametrize("case", CASES)
def test_eager_and_compiled_launch_the_same_kernels(case):
    """grouped_mm forward and backward eager (the op's C++ kernel) and compiled (the opaque
    Hopper ops the graph calls, launched by the same C++ code): the same bits."""
    a, b, bias, offs, dy = _case(*case)

    def step(a, b, bias):
        return cm.grouped_mm(a, b, offs, bias=bias)

    results = []
    torch._dynamo.reset()
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (a, b, bias)]
        out = fn(*leaves)
        out.backward(dy)
        results.append([out] + [t.grad for t in leaves if t is not None])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_without_the_layer_a_gemm_call_says_what_to_install():
    """COMPILED_MOE_HOST=0 on a Hopper GPU: the first grouped GEMM raises one clear error (the
    C++ layer is these kernels' only launcher; no slower second launcher)."""
    script = textwrap.dedent("""
        import torch, compiled_moe as cm
        a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)
        try:
            cm.grouped_mm(a, w.mT, offs)
        except RuntimeError as e:
            print("ERROR:", e)
    """)
    run = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, COMPILED_MOE_HOST="0"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ERROR:" in run.stdout and "COMPILED_MOE_HOST=0 turned it off" in run.stdout
    assert "pip install" in run.stdout


@pytest.mark.parametrize("M,P,Q,G", [(4, 2048, 1536, 128), (0, 256, 512, 8), (300, 128, 256, 4),
                                     (96, 36, 24, 3)])  # decode, no rows, tail rows, Triton fallback
def test_wgrad_matches_reference(M, P, Q, G):
    """grouped_mm_wgrad through the C++ kernel against the float64 reference: empty groups,
    rows past the last group, no rows at all (zeros), sizes the Hopper kernel does not take
    (rows of 72 bytes: the Triton fallback); the layer's registration is asserted."""
    from compiled_moe import reference

    assert "csrc/host/ops.cpp" in torch._C._dispatch_dump("compiled_moe::grouped_mm_wgrad").split("CUDA:")[1].splitlines()[0]
    g = torch.Generator().manual_seed(M + P)
    a = torch.randn(M, P, generator=g).bfloat16().cuda()
    dy = torch.randn(M, Q, generator=g).bfloat16().cuda()
    offs = random_offsets(M, G, generator=g, empty_groups=1, tail=min(M, 3)).cuda()
    out = torch.ops.compiled_moe.grouped_mm_wgrad(a, dy, offs, None)
    want = reference.grouped_mm_wgrad(a.double().cpu(), dy.double().cpu(), offs.cpu(), None)
    assert out.shape == (G, P, Q) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2 * max(1, M) ** 0.5)
    with no_sync():
        torch.ops.compiled_moe.grouped_mm_wgrad(a, dy, offs, torch.float32)


def test_float64_takes_the_reference():
    """float64 on CUDA: the C++ kernels' fallbacks run the reference, as the Python kernels do
    (the Triton kernels accumulate in fp32); forward and both gradients to float64 precision."""
    from compiled_moe import reference

    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, 24, generator=g, dtype=torch.float64)
    w = torch.randn(3, 16, 24, generator=g, dtype=torch.float64)
    offs = random_offsets(40, 3, generator=g, empty_groups=1, tail=2)
    dy = torch.randn(40, 16, generator=g, dtype=torch.float64)
    leaves = [t.cuda().requires_grad_() for t in (a, w)]
    out = cm.grouped_mm(leaves[0], leaves[1].mT, offs.cuda())
    out.backward(dy.cuda())
    want = reference.grouped_mm(a, w.mT, offs)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaves[1].grad.cpu(), reference.grouped_mm_wgrad(dy, a, offs),
                               rtol=1e-12, atol=1e-12)  # (G, N, K): dy_g^T @ a_g


@pytest.mark.parametrize("tokens,k,E,pad,dtype", [
    (0, 8, 128, 1, torch.int64), (1, 8, 128, 1, torch.int64), (4, 8, 128, 16, torch.int32),
    (8192, 8, 128, 1, torch.int32), (4096, 2, 8, 128, torch.int64), (3000, 4, 4096, 1, torch.int64)])
def test_route_matches_reference(tokens, k, E, pad, dtype):
    """moe_route through the C++ kernel: the reference's three outputs exactly (the layout is
    deterministic: expert, then token, then slot), ids outside [0, E) dropped, no host sync."""
    from compiled_moe import reference

    assert "csrc/host/ops.cpp" in torch._C._dispatch_dump("compiled_moe::moe_route").split("CUDA:")[1].splitlines()[0]
    g = torch.Generator().manual_seed(tokens + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(dtype) if tokens else \
        torch.zeros(0, k, dtype=dtype)
    if tokens:
        ids[0, 0], ids[-1, -1] = -1, E  # an expert elsewhere, dropped
    want = reference.moe_route(ids, E, pad)
    ids = ids.cuda()  # (a copy from pageable memory syncs)
    with no_sync():
        got = torch.ops.compiled_moe.moe_route(ids, E, pad)
    for name, a, b in zip(("offs", "row_of", "source"), got, want):
        assert torch.equal(a.cpu(), b), name


def test_graph_replay_under_changing_routing_and_no_sync():
    torch.manual_seed(0)
    M, K, N, G = 64, 2048, 1536, 128
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    offs = random_offsets(M, G, empty_groups=3).cuda()
    cm.grouped_mm(a, w.mT, offs)  # plan and tensor maps outside capture
    with no_sync():
        torch.ops.compiled_moe.grouped_mm(a, w.mT, offs, None, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.compiled_moe.grouped_mm(a, w.mT, offs, None, None)
    for seed in range(3):
        offs.copy_(random_offsets(M, G, generator=torch.Generator().manual_seed(seed), empty_groups=seed).cuda())
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.testing.assert_close(out.double(), loop_grouped_mm(a, w.mT, offs), rtol=2e-2, atol=2e-2)
        assert torch.equal(out, torch.ops.compiled_moe.grouped_mm(a, w.mT, offs, None, None))


def test_opcheck():
    torch.manual_seed(0)
    a = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = random_offsets(96, 4, empty_groups=1, tail=3).cuda()
    torch.library.opcheck(torch.ops.compiled_moe.grouped_mm.default, (a, w.mT, offs, bias, None))


# ---------------------------------------------------------------------------- the experts block

from compiled_moe.local_experts import host_block_applies  # noqa: E402
from helpers import capture_graph, loop_moe_experts  # noqa: E402

BLOCK_CASES = [  # (activation, layout, biases, tokens, id dtype, weight dtype)
    ("swiglu", "stacked", False, 1, torch.int64, torch.bfloat16),
    ("swiglu", "stacked", False, 64, torch.int32, torch.float32),
    ("gpt_oss", "interleaved", True, 16, torch.int64, torch.bfloat16),
    ("relu2", "stacked", False, 4, torch.int64, torch.float32),
    ("geglu", "interleaved", False, 512, torch.int32, torch.bfloat16),
]


def _block_inputs(activation, biases, tokens, id_dtype, weight_dtype, E=32, H=256, inter=128, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if activation in ("swiglu", "geglu", "gpt_oss") else inter
    hidden = torch.randn(tokens, H, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(id_dtype)
    ids[0, -1] = -1  # a pair for an expert elsewhere (expert parallelism): dropped
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(weight_dtype)
    w1 = (torch.randn(E, n1, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).bfloat16()
    b1 = torch.randn(E, n1, generator=g).bfloat16() if biases else None
    b2 = torch.randn(E, H, generator=g).bfloat16() if biases else None
    return [t.cuda() if t is not None else None for t in (hidden, ids.cuda(), weights, w1, w2, b1, b2)]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-T{c[3]}")
def test_experts_block_in_one_call(case):
    """moe_experts' one-call forward (no grad) against the float64 loop over experts, within
    the design's tolerance rule (twice the error of the same loop in bf16), and against the
    package's fused path; no host sync."""
    activation, layout, biases, tokens, id_dtype, weight_dtype = case
    hidden, ids, weights, w1, w2, b1, b2 = _block_inputs(activation, biases, tokens, id_dtype, weight_dtype)
    kwargs = dict(activation=activation, gate_up_layout=layout, b1=b1, b2=b2)
    with torch.no_grad():
        assert host_block_applies(hidden, ids, w1)
        cm.moe_experts(hidden, ids, weights, w1, w2, **kwargs)  # plans and kernels outside the check
        with no_sync():
            out = cm.moe_experts(hidden, ids, weights, w1, w2, **kwargs)
        fused = cm.moe_experts(hidden, ids, weights, w1, w2, fused=True, **kwargs)
    oracle = loop_moe_experts(hidden, ids, weights, w1, w2, activation, layout, b1, b2)
    same_dtype = loop_moe_experts(hidden, ids, weights, w1, w2, activation, layout, b1, b2, dtype=torch.bfloat16)
    err = (out.double() - oracle).abs().max().item()
    torch_err = (same_dtype.double() - oracle).abs().max().item()
    assert err <= 2 * torch_err + 1e-2, (err, torch_err)
    assert (out.double() - fused.double()).abs().max().item() <= 2 * torch_err + 1e-2
    assert torch.equal(out, cm.moe_experts(hidden, ids, weights, w1, w2, **kwargs))  # deterministic


def _grads(fn, leaves, grad):
    return torch.autograd.grad(fn(), leaves, grad)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-T{c[3]}")
def test_experts_block_backward_in_one_call(case):
    """moe_experts' training step through the C++ autograd function (one host call forward,
    one backward): every gradient against the float64 loop's within the tolerance rule (twice
    the bf16 loop's error), and against the fused path's; forward and backward without a host
    sync."""
    activation, layout, biases, tokens, id_dtype, weight_dtype = case
    hidden, ids, weights, w1, w2, b1, b2 = _block_inputs(activation, biases, tokens, id_dtype, weight_dtype)
    leaves = [t.requires_grad_() for t in (hidden, weights, w1, w2, b1, b2) if t is not None]
    kwargs = dict(activation=activation, gate_up_layout=layout, b1=b1, b2=b2)
    grad = torch.randn(hidden.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()

    def ours():
        return cm.moe_experts(hidden, ids, weights, w1, w2, **kwargs)

    out = ours()
    assert "ExpertsBlockFunction" in out.grad_fn.name()
    out.backward(grad)  # plans and kernels outside the check
    with no_sync():
        got = _grads(ours, leaves, grad)
    fused = _grads(lambda: cm.moe_experts(hidden, ids, weights, w1, w2, fused=True, **kwargs), leaves, grad)
    oracle = _grads(lambda: loop_moe_experts(hidden, ids, weights, w1, w2, activation, layout, b1, b2), leaves,
                    grad.double())
    same_dtype = _grads(lambda: loop_moe_experts(hidden, ids, weights, w1, w2, activation, layout, b1, b2,
                                                 dtype=torch.bfloat16), leaves, grad)
    for name, g, f, o, s in zip(("hidden", "weights", "w1", "w2", "b1", "b2"), got, fused, oracle, same_dtype):
        scale = o.abs().max().item()
        torch_err = (s.double() - o).abs().max().item()
        assert (g.double() - o).abs().max().item() <= 2 * torch_err + 1e-3 * scale, name
        assert (g.double() - f.double()).abs().max().item() <= 2 * torch_err + 1e-3 * scale, name
    assert all(torch.equal(a, b) for a, b in zip(got, _grads(ours, leaves, grad)))  # deterministic


def test_experts_block_in_one_call_graph_replay():
    """The one-call forward captured in a CUDA graph replays new routings as eager runs them."""
    hidden, ids, weights, w1, w2, _, _ = _block_inputs("swiglu", False, 8, torch.int64, torch.bfloat16)
    with torch.no_grad():
        graph, out = capture_graph(lambda: cm.moe_experts(hidden, ids, weights, w1, w2))
        for seed in range(1, 4):
            new = _block_inputs("swiglu", False, 8, torch.int64, torch.bfloat16, seed=seed)
            for dst, src in zip((hidden, ids, weights), new[:3]):
                dst.copy_(src)
            graph.replay()
            assert torch.equal(out, cm.moe_experts(hidden, ids, weights, w1, w2))


# ---------------------------------------------------------------------------- grouped_quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("M,K,G", [(300, 256, 4), (4096, 2048, 128), (5, 136, 3), (7, 100, 2)])
def test_quantize_same_bits_as_the_python_kernel(dtype, rowwise, columnwise, M, K, G):
    """grouped_quantize (2-D, fp8_blockwise) through the C++ kernels, columnwise (with or
    without rowwise) and rowwise only: the Python kernel's outputs bit for bit, in its layouts
    (padded columnwise rows, K-contiguous column scales), with NaN, Inf, zero and tiny blocks;
    no host sync. An unaligned x, and K not a multiple of 8, take the Python kernel
    columnwise."""
    from compiled_moe.ops import fp8

    assert "csrc/host/fp8.cpp" in \
        torch._C._dispatch_dump("compiled_moe::grouped_quantize").split("CUDA:")[1].splitlines()[0]
    g = torch.Generator().manual_seed(M + K)
    buffer = torch.randn(M, K + 8, generator=g) * 3
    buffer[0, 3], buffer[-1, 5], buffer[M // 2, 7] = float("nan"), float("inf"), -float("inf")
    buffer[1, :] = 0  # zero blocks: scale 1
    buffer[2, :] *= 1e-30 if dtype == torch.float32 else 1e-4  # tiny scales
    buffer = buffer.to(dtype).cuda()
    offs = random_offsets(M, G, generator=g, empty_groups=1, tail=min(3, M - 1)).cuda()
    for x in (buffer[:, :K], buffer[:, 4:4 + K]):  # 16-byte aligned; 8 bytes off for 2-byte dtypes
        torch.ops.compiled_moe.grouped_quantize(x, offs, "fp8_blockwise", rowwise, columnwise)  # the plan, outside
        with no_sync():
            got = torch.ops.compiled_moe.grouped_quantize(x, offs, "fp8_blockwise", rowwise, columnwise)
        want = fp8._grouped_quantize._kernel(x, offs, "fp8_blockwise", rowwise, columnwise)
        for name, a, b in zip(("data", "scale", "col_data", "col_scale"), got, want):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, name
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


# ---------------------------------------------------------------------------- scaled_grouped_mm


@pytest.mark.parametrize("M,K,N,G", [(1000, 512, 384, 8), (64, 256, 256, 4), (2048, 1024, 512, 4)])
def test_scaled_mm_same_bits_as_the_ctypes_launch(M, K, N, G, monkeypatch):
    """scaled_grouped_mm (fp8_blockwise) through csrc/host/fp8.cpp: the registered CUDA kernel
    is the layer's; its outputs equal, bit for bit, the same kernel launched by the Python
    launcher's ctypes path (the layer's launch switched off), with and without a bias (rows at
    odd offsets too), in every output dtype and tile variant; no host sync. An unaligned a
    takes the Python kernel."""
    from compiled_moe.kernels import scaled_grouped_mm_sm90 as sm90

    assert "csrc/host/fp8.cpp" in \
        torch._C._dispatch_dump("compiled_moe::scaled_grouped_mm").split("CUDA:")[1].splitlines()[0]
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w = (torch.randn(G, N, K, generator=g) / K ** 0.5).bfloat16().cuda()
    offs = random_offsets(M, G, generator=g, empty_groups=1, tail=3).cuda()
    xq = cm.grouped_quantize(x, offs, "fp8_blockwise")
    wq = cm.grouped_quantize(w, None, "fp8_blockwise")
    args = (xq[0], wq[0].mT, xq[1], wq[1], offs)
    wide_bias = torch.randn(G, N + 1, generator=g).cuda()
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bias in (None, wide_bias[:, :N].bfloat16(), wide_bias[:, 1:]):
            op = lambda: torch.ops.compiled_moe.scaled_grouped_mm(*args, "fp8_blockwise", out_dtype, bias)  # noqa: E731
            op()  # the plan, outside the check
            with no_sync():
                got = op()
            with monkeypatch.context() as m:
                m.setattr(sm90.host_layer, "cuda_module", lambda: None)
                want = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
                sm90.scaled_grouped_mm(*args, want, bias)
            assert torch.equal(got, want), (out_dtype, bias is not None)
            for cluster, block_n in ((2, 128), (1, 256)):  # the launcher's variants, from C++
                variant = torch.full((M, N), float("nan"), device="cuda", dtype=out_dtype)
                sm90.scaled_grouped_mm(*args, variant, bias, cluster=cluster, block_n=block_n)
                assert torch.equal(variant, want), (out_dtype, cluster, block_n)
    unaligned = torch.empty(M * K + 8, device="cuda", dtype=torch.float8_e4m3fn)[8:].view(M, K)
    unaligned.copy_(xq[0])
    from compiled_moe.ops import fp8

    got = torch.ops.compiled_moe.scaled_grouped_mm(unaligned, *args[1:], "fp8_blockwise")
    assert torch.equal(got, fp8._scaled_grouped_mm._kernel(unaligned, *args[1:], "fp8_blockwise"))


# ---------------------------------------------------------------------------- moe_activation_quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation,layout", [("swiglu", "stacked"), ("gpt_oss", "interleaved"), ("relu2", "stacked")])
def test_activation_quantize_same_bits_as_the_python_kernel(dtype, activation, layout):
    """moe_activation_quantize (fp8_blockwise, both ways) through csrc/host/fp8.cpp's launch of
    the one-pass kernel: the Python kernel's outputs bit for bit, in its layouts, with and
    without probs; no host sync. An unaligned h takes the Python kernel."""
    from compiled_moe.ops import fp8

    assert "csrc/host/fp8.cpp" in \
        torch._C._dispatch_dump("compiled_moe::moe_activation_quantize").split("CUDA:")[1].splitlines()[0]
    M, inter, G = 700, 384, 6
    n1 = inter if activation == "relu2" else 2 * inter
    g = torch.Generator().manual_seed(M + n1)
    buffer = (torch.randn(M, n1 + 8, generator=g) * 2).to(dtype).cuda()
    offs = random_offsets(M, G, generator=g, empty_groups=1, tail=5).cuda()
    probs = torch.rand(M, generator=g).cuda()
    for h in (buffer[:, :n1], buffer[:, 4:4 + n1]):  # 16-byte aligned; 8 bytes off
        for p in (None, probs):
            args = (h, offs, activation, layout, "fp8_blockwise", p, True, True, 1.6, 6.5)
            torch.ops.compiled_moe.moe_activation_quantize(*args)  # the plan, outside the check
            with no_sync():
                got = torch.ops.compiled_moe.moe_activation_quantize(*args)
            want = fp8._moe_activation_quantize._kernel(*args)
            for name, a, b in zip(("data", "scale", "col_data", "col_scale"), got, want):
                assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, name
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


# ---------------------------------------------------------------------------- scaled_grouped_mm_wgrad


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("multiple", [16, 1])
def test_scaled_wgrad_same_bits_as_the_python_kernel(recipe, multiple, monkeypatch):
    """scaled_grouped_mm_wgrad through csrc/host/fp8.cpp: the registered CUDA kernel is the
    layer's; with groups on 16-row starts and off them, every output dtype, its outputs equal
    the op's Python kernel's bit for bit, and the Python launcher's ctypes launch of the same
    Hopper kernel's; no host sync."""
    from compiled_moe.kernels import scaled_grouped_mm_sm90 as sm90
    from compiled_moe.ops import fp8

    assert "csrc/host/fp8.cpp" in \
        torch._C._dispatch_dump("compiled_moe::scaled_grouped_mm_wgrad").split("CUDA:")[1].splitlines()[0]
    M, P, Q, G = 1024, 384, 256, 6
    g = torch.Generator().manual_seed(M + multiple)
    a, d = torch.randn(M, P, generator=g).bfloat16().cuda(), torch.randn(M, Q, generator=g).bfloat16().cuda()
    offs = (random_offsets(M // multiple, G, generator=g, empty_groups=1, tail=2) * multiple).cuda()
    _, _, a_t, a_s = cm.grouped_quantize(a, offs, recipe, rowwise=False, columnwise=True)
    _, _, d_t, d_s = cm.grouped_quantize(d, offs, recipe, rowwise=False, columnwise=True)
    args = (a_t, d_t, a_s, d_s, offs, recipe)
    for out_dtype in (torch.bfloat16, torch.float32):
        torch.ops.compiled_moe.scaled_grouped_mm_wgrad(*args, out_dtype)  # the plan, outside the check
        with no_sync():
            got = torch.ops.compiled_moe.scaled_grouped_mm_wgrad(*args, out_dtype)
        assert torch.equal(got, fp8._scaled_grouped_mm_wgrad._kernel(*args, out_dtype)), out_dtype
        with monkeypatch.context() as m:  # the Hopper kernel's ctypes launch
            m.setattr(sm90.host_layer, "cuda_module", lambda: None)
            want = torch.full(got.shape, float("nan"), device="cuda", dtype=out_dtype)
            sm90.scaled_grouped_mm_wgrad(a_t, d_t, a_s, d_s, offs, recipe, want)
        assert torch.equal(got, want), out_dtype
