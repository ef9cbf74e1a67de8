"""Independent oracles and input makers shared by the tests."""

from __future__ import annotations

import contextlib

import torch


def random_offsets(num_rows: int, num_groups: int, *, generator=None, empty_groups: int = 0,
                   tail: int = 0, device="cpu") -> torch.Tensor:
    """int32 cumulative ends of num_groups random groups covering num_rows - tail rows.

    ``empty_groups`` groups are forced empty; ``tail`` rows are left past the last group.
    """
    used = num_rows - tail
    cuts = torch.randint(0, used + 1, (num_groups - 1,), generator=generator).sort().values
    ends = torch.cat([cuts, torch.tensor([used])])
    if empty_groups:
        idx = torch.randperm(num_groups, generator=generator)[:empty_groups]
        starts = torch.cat([torch.tensor([0]), ends[:-1]])
        sizes = ends - starts
        moved = sizes[idx].sum()
        sizes[idx] = 0
        keep = [g for g in range(num_groups) if g not in set(idx.tolist())]
        sizes[keep[0]] += moved
        ends = sizes.cumsum(0)
    return ends.to(torch.int32).to(device)


def loop_bounds(offs: torch.Tensor, num_rows: int):
    """(start, end) of each group by the documented clamping rule, computed with a host loop."""
    start = 0
    for o in offs.tolist():
        end = max(start, min(max(o, 0), num_rows))
        yield start, end
        start = end


def loop_grouped_mm(a, b, offs, bias=None, dtype=torch.float64):
    """out rows of group g = a_g @ b[g] (+ bias[g]) by a loop over groups in `dtype`."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=dtype, device=a.device)
    for g, (s, e) in enumerate(loop_bounds(offs.cpu(), a.shape[0])):
        if e > s:
            blk = a[s:e].to(dtype) @ b[g].to(dtype)
            if bias is not None:
                blk = blk + bias[g].to(dtype)
            out[s:e] = blk
    return out


def loop_wgrad(a, d, offs, dtype=torch.float64):
    out = torch.zeros(offs.shape[0], a.shape[1], d.shape[1], dtype=dtype, device=a.device)
    for g, (s, e) in enumerate(loop_bounds(offs.cpu(), a.shape[0])):
        out[g] = a[s:e].to(dtype).T @ d[s:e].to(dtype)
    return out


def loop_grouped_sum(x, offs, dtype=torch.float64):
    out = torch.zeros(offs.shape[0], x.shape[1], dtype=dtype, device=x.device)
    for g, (s, e) in enumerate(loop_bounds(offs.cpu(), x.shape[0])):
        out[g] = x[s:e].to(dtype).sum(0)
    return out


def assert_matches_oracle(out, oracle64, same_dtype_torch, atol=1e-5):
    """DESIGN.md tolerance rule: error vs float64 at most 2x torch's own same-dtype error + atol."""
    out = out.detach().cpu().double()
    oracle64 = oracle64.cpu().double()
    assert out.shape == oracle64.shape, (out.shape, oracle64.shape)
    assert torch.isfinite(out).all(), "non-finite values in output"
    err = (out - oracle64).abs().max().item() if out.numel() else 0.0
    torch_err = (same_dtype_torch.detach().cpu().double() - oracle64).abs().max().item() \
        if out.numel() else 0.0
    scale = oracle64.abs().max().item() if out.numel() else 0.0
    bound = 2 * torch_err + atol * max(1.0, scale)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e} (torch same-dtype {torch_err:.3e})"


def loop_moe_experts(hidden, topk_ids, topk_weights, w1, w2, activation="swiglu",
                     gate_up_layout="stacked", b1=None, b2=None, dtype=torch.float64):
    """The experts block by a loop over experts in `dtype` (reads routing on the host)."""
    from compiled_moe.reference import activation as act

    out = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = hidden[tok].to(dtype) @ w1[e].to(dtype).t()
        if b1 is not None:
            h = h + b1[e].to(dtype)
        y = act(h, activation, gate_up_layout) @ w2[e].to(dtype).t()
        if b2 is not None:
            y = y + b2[e].to(dtype)
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(dtype)[:, None])
    return out


def loop_route(topk_ids, num_experts, pad_multiple=1):
    """(offs, row_of, source) of the stable expert-sorted layout, built with host loops."""
    ids = topk_ids.cpu().tolist()
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    flat = [e for row in ids for e in row]
    row_of = [-1] * len(flat)
    source, offs = [], []
    for e in range(num_experts):
        pairs = [i for i, x in enumerate(flat) if x == e]  # ascending flat order
        for i in pairs:
            row_of[i] = len(source)
            source.append(i)
        while len(source) % pad_multiple:
            source.append(-1)
        offs.append(len(source))
    capacity = len(flat) + num_experts * (pad_multiple - 1)
    source += [-1] * (capacity - len(source))
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_t(offs), as_t(row_of).view(len(ids), k), as_t(source)


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def capture_graph(fn):
    """fn run once, then once on a side stream (warm-up, as capture needs), then captured in a
    CUDA graph: (graph, what fn returned during the capture: the graph's output tensors)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def poison_allocator(nbytes):
    """Fill freed caching-allocator blocks with NaN so an unwritten output element shows."""
    torch.empty(nbytes // 4 + 1024, device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


def assert_one_dynamic_compile(step, arg_sets, grad_inputs, rtol=1e-4, atol=1e-4):
    """step (returning a scalar) compiled once, fullgraph and dynamic, over every args tuple of
    arg_sets: its value and its gradients with respect to grad_inputs(args) equal eager's, and
    inductor compiled one frame for all the sizes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for args in arg_sets:
        wrt = grad_inputs(args)
        got, want = compiled(*args), step(*args)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        for g, w in zip(torch.autograd.grad(got, wrt), torch.autograd.grad(want, wrt)):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    assert counter.frame_count == 1


def special_values(M, K, gen):
    """(M, K) fp32 values over six decades with NaN, +-Inf, a zero row, -0 and a row whose
    blocks' scales are under 2^-90 (where the quantizers' fma division hands over to a plain
    division): the quantizer tests' and benchmarks/bench_quantize.py's special input."""
    x = torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, M)[:, None]
    x[3, 5] = float("nan")
    x[3, 6] = -float("nan")  # sign bit set: the e4m3 NaN is 0x7F all the same
    x[4, 9] = float("-inf")
    x[8, K - 1] = float("inf")
    x[6] = 0.0
    x[7, : K // 2] = -0.0
    x[10] *= 1e-32
    return x


# Decreasing offsets and offsets past M (M = 512): group g owns rows [running max of the
# clamped ends before g, max(that, its own clamped end)), as reference.group_bounds says.
# [160, 96, 600, 320]: groups 0..159, empty, 160..511, empty; [-32, 128, 64, 256]: empty,
# 0..127, empty, 128..255, rows 256.. past the end. Starts are multiples of 16 (the FP8
# weight-gradient kernel's condition), so every CUDA kernel runs them.
CORRUPT_OFFSETS = [[160, 96, 600, 320], [-32, 128, 64, 256]]
CORRUPT_OFFSETS_SHAPE = (512, 1024, 768)  # M, K, N of the problems they are tried on


def corrupt_offsets_problem(offs, seed: int, device="cuda"):
    """(offs as int32, x (M, K), w (G, N, K) scaled by K^-1/2, dy (M, N)), bf16, for one of
    CORRUPT_OFFSETS, with (M, K, N) = CORRUPT_OFFSETS_SHAPE."""
    M, K, N = CORRUPT_OFFSETS_SHAPE
    torch.manual_seed(seed)
    offs = torch.tensor(offs, dtype=torch.int32, device=device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(offs.shape[0], N, K, device=device, dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    return offs, x, w, dy


class RewriteCapture:
    """A torch.compile backend: apply compiled_moe.lowering's rewrites to dynamo's graph, keep
    the graph and the rewrite counts, run it as FX (no inductor)."""

    def __init__(self):
        self.graphs, self.counts = [], []

    def __call__(self, gm, example_inputs):
        from compiled_moe import lowering

        self.counts.append(lowering.rewrite(gm.graph))
        gm.recompile()
        self.graphs.append(gm.graph)
        return gm

    def targets(self, i=-1):
        return [n.target for n in self.graphs[i].nodes if n.op == "call_function"]
