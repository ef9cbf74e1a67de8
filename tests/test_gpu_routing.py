"""GPU tier of routing and the experts block (marker gpu): the NVRTC routing kernel against
the reference, no host sync, CUDA-graph replay under changing routing, torch.compile."""

from __future__ import annotations

import pytest
import torch

import compiled_moe as cm
from compiled_moe import reference
from helpers import assert_matches_oracle, loop_moe_experts, loop_route, no_sync, poison_allocator

pytestmark = pytest.mark.gpu
DEV = "cuda"

ROUTE_SHAPES = [  # tokens, top_k, experts, pad_multiple, id range
    (0, 8, 128, 1, (0, 128)),         # one-program route (at most ROUTE_ONE_PROGRAM_PAIRS pairs)
    (1, 8, 128, 1, (0, 128)),
    (64, 8, 256, 128, (-1, 260)),     # one program: dropped pairs, padding
    (100, 5, 4096, 4, (0, 4096)),     # one program, the most experts
    (128, 8, 128, 1, (-1, 130)),      # one program at its limit (1024 pairs), dropped pairs
    (129, 8, 128, 16, (-1, 130)),     # just past it: the NVRTC kernels
    (8192, 8, 128, 1, (0, 128)),      # Qwen3-30B-A3B, T = 8192
    (4096, 8, 256, 128, (0, 256)),    # DeepSeek-V3 router, padded to 128 (FP8 blockwise)
    (4096, 2, 8, 1, (0, 8)),          # Mixtral
    (3000, 4, 128, 16, (-1, 140)),    # dropped pairs (expert parallelism) and padding
    (65537, 8, 64, 1, (0, 64)),       # several items per lane, ragged last chunk
    (1000, 6, 2048, 1, (0, 2048)),    # many experts: fewer warps per block
    (513, 3, 4096, 4, (0, 4096)),     # the most experts supported
]


def _skewed_ids(tokens, k, lo_hi, seed):
    """Skewed routing: expert probabilities softmax(N(0,1)), k draws per token."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = lo_hi
    probs = torch.softmax(torch.randn(hi - lo, generator=gen), 0)
    if tokens == 0:
        return torch.empty(0, k, dtype=torch.int64)
    return torch.multinomial(probs.expand(tokens, -1), k, generator=gen) + lo


@pytest.mark.parametrize("shape", ROUTE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_kernel_matches_reference(shape, dtype):
    tokens, k, experts, pad, lo_hi = shape
    ids = _skewed_ids(tokens, k, lo_hi, seed=tokens + experts).to(dtype)
    want = reference.moe_route(ids, experts, pad)
    poison_allocator(64 << 20)
    ids_gpu = ids.to(DEV)
    with no_sync():
        got = torch.ops.compiled_moe.moe_route(ids_gpu, experts, pad)
    for name, g, w in zip(("offs", "row_of", "source"), got, want):
        assert torch.equal(g.cpu(), w), name
    if tokens * k <= 4096:
        for name, g, w in zip(("offs", "row_of", "source"), got, loop_route(ids, experts, pad)):
            assert torch.equal(g.cpu(), w), name


@pytest.mark.parametrize("tokens", [64, 128, 4096])
@pytest.mark.parametrize("options", [{}, {"cpp_wrapper": True}])
def test_route_compiled(tokens, options):
    """A static-shape graph launches the one-program route itself when it is small (no call
    back into the opaque op) and keeps the op otherwise; both give eager's layout."""
    from torch._inductor.utils import run_and_get_code

    from compiled_moe.kernels.configs import ROUTE_ONE_PROGRAM_PAIRS

    ids = _skewed_ids(tokens, 8, (-1, 130), seed=tokens).to(DEV)
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: torch.ops.compiled_moe.moe_route(i, 128, 4),
                             fullgraph=True, options=options)
    got, code = run_and_get_code(compiled, ids)
    one_program = tokens * 8 <= ROUTE_ONE_PROGRAM_PAIRS
    assert ("_route_one_program_kernel" in "".join(code)) == one_program
    for name, g, w in zip(("offs", "row_of", "source"), got, reference.moe_route(ids.cpu(), 128, 4)):
        assert torch.equal(g.cpu(), w), name


def test_route_kernel_is_deterministic():
    ids = torch.randint(0, 128, (8192, 8), device=DEV)
    first = torch.ops.compiled_moe.moe_route(ids, 128, 1)
    for _ in range(3):
        again = torch.ops.compiled_moe.moe_route(ids, 128, 1)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def _experts_inputs(tokens, hidden, inter, experts, k, activation, dtype, biases, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n1 = 2 * inter if activation in reference.GATED_ACTIVATIONS else inter
    mk = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=gen) * scale).to(dtype)  # noqa: E731
    logits = torch.randn(tokens, experts, device=DEV, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), k)
    return dict(hidden=mk(tokens, hidden), topk_ids=ids, topk_weights=weights.to(dtype),
                w1=mk(experts, n1, hidden, scale=hidden ** -0.5),
                w2=mk(experts, hidden, inter, scale=inter ** -0.5),
                b1=mk(experts, n1, scale=0.1) if biases else None,
                b2=mk(experts, hidden, scale=0.1) if biases else None)


@pytest.mark.parametrize("activation,layout,biases", [
    ("swiglu", "stacked", False), ("gpt_oss", "interleaved", True), ("geglu", "stacked", True),
    ("relu2", "stacked", False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_experts_gpu_forward_backward(activation, layout, biases, dtype):
    inp = _experts_inputs(1024, 256, 128, 16, 4, activation, dtype, biases)
    names = [n for n in ("hidden", "topk_weights", "w1", "w2", "b1", "b2") if inp[n] is not None]
    for n in names:
        inp[n].requires_grad_(True)
    kw = dict(activation=activation, gate_up_layout=layout)
    grad = torch.randn_like(inp["hidden"])
    with no_sync():
        out = cm.moe_experts(**inp, **kw)
        grads = torch.autograd.grad(out, [inp[n] for n in names], grad)
    # Oracle: a float64 loop. "Torch's own error": the same block in the same dtype on the
    # reference path (CPU), whose intermediates round like ours.
    def leaves(dtype=None):
        out = {n: (v.cpu() if isinstance(v, torch.Tensor) else v) for n, v in inp.items()}
        for n in names:
            out[n] = out[n].detach().to(dtype or out[n].dtype).requires_grad_(True)
        return out

    f64, cpu = leaves(torch.float64), leaves()
    want = loop_moe_experts(f64["hidden"], f64["topk_ids"], f64["topk_weights"], f64["w1"],
                            f64["w2"], activation, layout, f64["b1"], f64["b2"])
    want_grads = torch.autograd.grad(want, [f64[n] for n in names], grad.cpu().double())
    same = cm.moe_experts(**cpu, **kw)
    same_grads = torch.autograd.grad(same, [cpu[n] for n in names], grad.cpu())
    assert_matches_oracle(out, want.detach(), same, atol=1e-2)
    for g, w, s in zip(grads, want_grads, same_grads):
        assert_matches_oracle(g, w, s, atol=1e-2)


def test_experts_cuda_graph_replay_under_changing_routing():
    inp = _experts_inputs(2048, 512, 256, 32, 4, "swiglu", torch.bfloat16, True)
    static = {n: inp[n].clone() for n in ("hidden", "topk_ids", "topk_weights")}
    params = {n: inp[n] for n in ("w1", "w2", "b1", "b2")}
    cm.moe_experts(**static, **params)  # warm up: compile and load kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cm.moe_experts(**static, **params)
    for seed in (1, 2, 3):
        new = _experts_inputs(2048, 512, 256, 32, 4, "swiglu", torch.bfloat16, False, seed=seed)
        # Skew the routing hard for one round: half the experts get nothing.
        if seed == 2:
            new["topk_ids"] = new["topk_ids"] % 16
        for n in static:
            static[n].copy_(new[n])
        graph.replay()
        eager = cm.moe_experts(**static, **params)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), seed


def test_experts_compile_gpu_dynamic():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    base = _experts_inputs(64, 256, 128, 16, 4, "swiglu", torch.bfloat16, False)
    w1, w2 = base["w1"].requires_grad_(True), base["w2"].requires_grad_(True)

    def block(hidden, ids, weights):
        return cm.moe_experts(hidden, ids, weights, w1, w2)

    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    for tokens in (300, 1024, 1777):
        inp = _experts_inputs(tokens, 256, 128, 16, 4, "swiglu", torch.bfloat16, False, seed=tokens)
        args = (inp["hidden"].requires_grad_(True), inp["topk_ids"], inp["topk_weights"])
        got = compiled(*args)
        got.float().square().sum().backward()
        want = block(*args)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert counter.frame_count == 1


def test_opcheck_gpu():
    ids = torch.randint(-1, 9, (100, 3), device=DEV)
    offs, row_of, source = torch.ops.compiled_moe.moe_route(ids, 8, 4)
    hidden = torch.randn(100, 64, device=DEV)
    w = torch.rand(100, 3, device=DEV)
    y = torch.randn(source.shape[0], 64, device=DEV)
    torch.library.opcheck(torch.ops.compiled_moe.moe_route, (ids, 8, 4))
    torch.library.opcheck(torch.ops.compiled_moe.moe_permute, (hidden, row_of, source, w))
    torch.library.opcheck(torch.ops.compiled_moe.moe_unpermute, (y, row_of, source, w))
    torch.library.opcheck(torch.ops.compiled_moe.moe_unpermute_backward, (hidden, y, row_of, source, w))
