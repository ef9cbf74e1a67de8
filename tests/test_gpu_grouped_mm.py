"""GPU tier of the grouped GEMM ops (marker gpu): real sizes on the H200, no host sync,
CUDA-graph replay, torch.compile, opcheck."""

from __future__ import annotations

import pytest
import torch

import compiled_moe as cm
from helpers import (CORRUPT_OFFSETS, CORRUPT_OFFSETS_SHAPE, assert_matches_oracle, corrupt_offsets_problem,
                     loop_grouped_mm, loop_grouped_sum, loop_wgrad, no_sync, poison_allocator)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def skewed_offsets(num_rows, num_groups, seed, empty_groups=0, tail=0, multiple=1):
    """Group sizes drawn from softmax(N(0,1)) expert probabilities (the benchmark's skew), in
    multiples of `multiple` rows."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(num_groups, generator=gen), 0)
    probs[:empty_groups] = 0
    draws = torch.multinomial(probs, (num_rows - tail) // multiple, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=num_groups) * multiple
    return torch.cumsum(counts, 0).to(torch.int32).to(DEV)


SHAPES = [  # (M, K, N, G)
    (4096, 2048, 1536, 32),     # large experts
    (2048, 512, 768, 64),       # fine-grained experts, many groups
    (777, 136, 200, 5),         # odd sizes, TMA-alignable K
    (300, 37, 53, 4),           # odd K: pointer loads
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_grouped_mm_gpu(shape, dtype, layout):
    M, K, N, G = shape
    torch.manual_seed(0)
    a = torch.randn(M, K, device=DEV, dtype=dtype)
    w = torch.randn(G, N, K, device=DEV, dtype=dtype) / K ** 0.5
    b = w.transpose(1, 2) if layout == "nk" else w.transpose(1, 2).contiguous()
    bias = torch.randn(G, N, device=DEV, dtype=dtype)
    offs = skewed_offsets(M, G, seed=M, empty_groups=1, tail=7)
    cm.grouped_mm(a, b, offs, bias=bias)  # compile outside the sync check
    poison_allocator(M * N * 4)
    with no_sync():
        out = cm.grouped_mm(a, b, offs, bias=bias)
    assert_matches_oracle(out, loop_grouped_mm(a, b, offs, bias),
                          loop_grouped_mm(a, b, offs, bias, dtype=dtype), atol=1e-3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wgrad_gpu(shape, dtype):
    M, K, N, G = shape
    torch.manual_seed(1)
    a = torch.randn(M, K, device=DEV, dtype=dtype)
    d = torch.randn(M, N, device=DEV, dtype=dtype)
    offs = skewed_offsets(M, G, seed=M + 1, empty_groups=1, tail=5)
    cm.grouped_mm_wgrad(a, d, offs)
    poison_allocator(G * K * N * 4)
    main = torch.randn(G, N, K, device=DEV)
    start = main.clone()
    mask = torch.arange(G, device=DEV) % 3 != 0
    with no_sync():
        wg = cm.grouped_mm_wgrad(a, d, offs)
        sums = cm.grouped_sum(d, offs)
        cm.grouped_mm_wgrad_accumulate_(main.transpose(1, 2), a, d, offs, accumulate_mask=mask)
    oracle = loop_wgrad(a, d, offs)
    assert_matches_oracle(wg, oracle, loop_wgrad(a, d, offs, dtype=dtype), atol=1e-3)
    assert_matches_oracle(sums, loop_grouped_sum(d, offs),
                          loop_grouped_sum(d, offs, dtype=dtype), atol=1e-3)
    expect = oracle + start.transpose(1, 2).double() * mask[:, None, None]
    assert_matches_oracle(main.transpose(1, 2), expect,
                          loop_wgrad(a, d, offs, dtype=dtype).double()
                          + start.transpose(1, 2).double() * mask[:, None, None], atol=1e-3)


def test_autograd_gpu_matches_reference():
    M, K, N, G = 1024, 256, 384, 8
    torch.manual_seed(2)
    a = torch.randn(M, K, device=DEV, requires_grad=True)
    w = torch.randn(G, N, K, device=DEV, requires_grad=True)
    bias = torch.randn(G, N, device=DEV, requires_grad=True)
    offs = skewed_offsets(M, G, seed=3, empty_groups=2, tail=11)
    grad = torch.randn(M, N, device=DEV)
    # fp32 at the default "highest" matmul precision: IEEE fp32 dots, no TF32.
    with no_sync():
        out = cm.grouped_mm(a, w.transpose(1, 2), offs, bias=bias)
        out.backward(grad)
    got = [out.detach()] + [t.grad.clone() for t in (a, w, bias)]
    for t in (a, w, bias):
        t.grad = None
    from compiled_moe import reference

    ref = reference.grouped_mm(a, w.transpose(1, 2), offs, bias)
    ref.backward(grad)
    want = [ref.detach()] + [t.grad for t in (a, w, bias)]
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-3)


def test_cuda_graph_replay_with_new_offsets():
    M, K, N, G = 2048, 512, 640, 16
    torch.manual_seed(4)
    a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16)
    offs = skewed_offsets(M, G, seed=5)
    d = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles) on a side stream, as capture requires
        cm.grouped_mm(a, w.transpose(1, 2), offs)
        cm.grouped_mm_wgrad(d, a, offs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cm.grouped_mm(a, w.transpose(1, 2), offs)
        wg = cm.grouped_mm_wgrad(d, a, offs)
    for seed in (6, 7, 8):
        offs.copy_(skewed_offsets(M, G, seed=seed, empty_groups=seed % 3, tail=seed * 10))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, cm.grouped_mm(a, w.transpose(1, 2), offs))
        assert torch.equal(wg, cm.grouped_mm_wgrad(d, a, offs))


def test_compile_gpu_dynamic():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    K, N, G = 256, 512, 8
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)

    def step(x, offs):
        return torch.nn.functional.silu(cm.grouped_mm(x, w.transpose(1, 2), offs)).float().sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for M in (500, 1024, 1999):
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        offs = skewed_offsets(M, G, seed=M, empty_groups=1, tail=3)
        got = compiled(x, offs)
        got.backward()
        gx, gw = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        want = step(x, offs)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-1)
        torch.testing.assert_close(gx, x.grad, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(gw, w.grad, rtol=1e-2, atol=1e-1)
        w.grad = None
    assert counter.frame_count == 1


def test_opcheck_gpu():
    M, K, N, G = 256, 64, 96, 4
    a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(G, N, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    d = torch.randn(M, N, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    offs = skewed_offsets(M, G, seed=9, empty_groups=1)
    ops = torch.ops.compiled_moe
    torch.library.opcheck(ops.grouped_mm.default, (a, w.transpose(1, 2), offs, bias, None))
    torch.library.opcheck(ops.grouped_mm_wgrad.default, (a, d, offs, None))
    torch.library.opcheck(ops.grouped_sum.default, (d, offs, torch.float32))
    torch.library.opcheck(ops.grouped_mm_wgrad_accumulate_.default,
                          (torch.zeros(G, K, N, device=DEV), a.detach(), d.detach(), offs, None))


# ------------------------------------------------------------- the Hopper CUDA kernels directly

CUDA_SHAPES = [  # (M, K, N, G, tail)
    (4096, 2048, 1536, 32, 32),  # large experts, rows past the last group
    (2048, 768, 2048, 128, 0),   # many groups of one tile or less
    (1000, 200, 328, 6, 8),      # K and N not multiples of the tiles
    (300, 64, 64, 1, 0),         # one group
    (3, 1440, 2880, 9, 0),       # fewer rows than a tile: most groups empty
    (8192, 512, 768, 64, 0),     # skewed groups of 12 weight-gradient tiles: claimed at run time
    (6000, 256, 640, 3, 5),      # a group of 37 row tiles, walked in bands of 16 (sm90.cuh, locate)
]


@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_match_oracle_and_triton(shape, dtype, monkeypatch):
    """csrc/grouped_mm.cu (what the ops run on Hopper): forward in both weight layouts with a
    bias, dgrad, the weight gradient (new output, and fp32 main_grad accumulation with a mask in
    both layouts) against the float64 loop and the Triton kernels, no host sync."""
    from compiled_moe.kernels import grouped_mm_sm90 as sm90
    M, K, N, G, tail = shape
    torch.manual_seed(M + K)
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    w = torch.randn(G, N, K, device=DEV, dtype=dtype) / K ** 0.5
    dy = torch.randn(M, N, device=DEV, dtype=dtype)
    bias = torch.randn(G, N, device=DEV, dtype=torch.float32)
    offs = skewed_offsets(M, G, seed=M, empty_groups=min(1, G - 1), tail=tail)
    end = int(offs[-1])
    x[end:] = float("nan")  # rows past the last group must not reach any output
    dy[end:] = float("nan")
    mask = torch.arange(G, device=DEV) % 2 == 0
    main = torch.randn(G, N, K, device=DEV)
    main_t = torch.randn(G, K, N, device=DEV).transpose(1, 2)  # a (G, K, N) buffer as (G, N, K)
    assert sm90.supported(x, w.mT, bias, dtype) and sm90.supported(dy, w, None, dtype)
    assert sm90.wgrad_supported(dy, x, dtype) and sm90.wgrad_supported(dy, x, torch.float32, main_t)

    def run():
        m, mt = main.clone(), main_t.clone()
        cm.grouped_mm_wgrad_accumulate_(m, dy, x, offs, accumulate_mask=mask)
        cm.grouped_mm_wgrad_accumulate_(mt, dy, x, offs, accumulate_mask=mask)
        return (cm.grouped_mm(x, w.mT, offs, bias=bias), cm.grouped_mm(x, w.mT.contiguous(), offs),
                cm.grouped_mm(dy, w, offs), cm.grouped_mm_wgrad(dy, x, offs), m, mt)

    run()
    poison_allocator(4 * G * N * K)
    with no_sync():
        got = run()
    monkeypatch.setenv("COMPILED_MOE_GEMM", "triton")
    triton_out = run()
    monkeypatch.delenv("COMPILED_MOE_GEMM")
    xs, dys = x[:end], dy[:end]
    wgrad = loop_wgrad(dys, xs, offs)
    oracles = [loop_grouped_mm(x, w.mT, offs, bias), loop_grouped_mm(x, w.mT, offs),
               loop_grouped_mm(dy, w, offs), wgrad,
               wgrad + main.double() * mask[:, None, None],
               wgrad + main_t.double() * mask[:, None, None]]
    for name, g, t, o in zip(["forward+bias", "forward (K, N)", "dgrad", "wgrad", "main_grad",
                              "main_grad^T"], got, triton_out, oracles):
        o = o.to(g.device)
        scale = o.abs().max().item()
        tol = 1e-5 if g.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(g.double(), o, rtol=tol, atol=tol * scale, msg=name)
        torch.testing.assert_close(g.double(), t.double(), rtol=tol, atol=tol * scale, msg=name)
        if name.startswith(("forward", "dgrad")):
            assert (g[end:] == 0).all(), name


@pytest.mark.parametrize("shape", [CUDA_SHAPES[0], CUDA_SHAPES[2]])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_forward_bias_layouts(shape, bias_dtype):
    """The CUDA forward copies each thread's two bias columns into shared memory as one 4- or
    8-byte piece: a bias whose rows start at odd element offsets (an odd row stride, a view one
    element in) must give the bits of the contiguous bias, and every layout the oracle's sum."""
    from compiled_moe.kernels import grouped_mm_sm90 as sm90
    M, K, N, G, tail = shape
    torch.manual_seed(N)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
    bias = torch.randn(G, N, device=DEV).to(bias_dtype)
    offs = skewed_offsets(M, G, seed=M, empty_groups=min(1, G - 1), tail=tail)
    wide = torch.zeros(G, N + 1, device=DEV, dtype=bias_dtype)
    wide[:, :N] = bias
    shifted = torch.zeros(G * N + 1, device=DEV, dtype=bias_dtype)[1:].view(G, N)
    shifted.copy_(bias)
    layouts = [bias, wide[:, :N], shifted]
    assert all(sm90.supported(x, w.mT, b, torch.bfloat16) for b in layouts)
    cm.grouped_mm(x, w.mT, offs, bias=bias)  # compile outside the sync check
    with no_sync():
        outs = [cm.grouped_mm(x, w.mT, offs, bias=b) for b in layouts]
    for name, out in zip(["odd row stride", "odd offset"], outs[1:]):
        assert torch.equal(out, outs[0]), name
    assert_matches_oracle(outs[0], loop_grouped_mm(x, w.mT, offs, bias),
                          loop_grouped_mm(x, w.mT, offs, bias, dtype=torch.bfloat16), atol=1e-3)


@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_forward_kernels_skip_past_rows_bitwise(shape):
    """The forward/dgrad kernel has two instantiations, chosen by rows per group
    (configs.grouped_mm_sm90_config): the one whose second consumer skips a group's last tile
    when none of its 64 rows are the group's must give the same bits as the one that computes
    and drops them, in both weight layouts, with a bias, on poisoned outputs."""
    from compiled_moe.kernels import grouped_mm_sm90 as sm90
    M, K, N, G, tail = shape
    torch.manual_seed(M + 1)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(G, N, device=DEV, dtype=torch.bfloat16)
    offs = skewed_offsets(M, G, seed=M + 1, empty_groups=min(1, G - 1), tail=tail)
    for a, b, bias_ in ((x, w.mT, bias), (dy, w, None)):
        outs = []
        for skip in (False, True):
            out = torch.full((M, b.shape[2]), float("nan"), device=DEV, dtype=torch.bfloat16)
            with no_sync():
                sm90.grouped_mm(a, b, offs, bias_, out, skip_past_rows=skip)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[1].double(), loop_grouped_mm(a, b, offs, bias_).to(DEV),
                                   rtol=1e-2, atol=1e-2 * outs[1].abs().max().item())


SPLIT_SHAPES = [  # (M, K, N, G, offs or None): a few tokens' rows, as when a model decodes
    (3, 14336, 4096, 8, [0, 0, 1, 1, 1, 2, 2, 2]),  # Mixtral's FC2 at T = 1, and a row past the end
    (8, 2048, 1536, 128, None),                      # Qwen3's FC1 at T = 1
    (37, 1000, 328, 6, None),                        # K and N not multiples of the tile
]


@pytest.mark.parametrize("shape", SPLIT_SHAPES)
def test_cuda_forward_split_k(shape):
    """Where the tiles leave SMs idle, the forward/dgrad kernel cuts each tile's k steps into
    ranges whose fp32 partial products a second kernel sums (configs.grouped_mm_sm90_split_k).
    Every forced split count, more ranges than k steps included, and the kernel's own choice
    give the oracle's result in both weight layouts, with a bf16 or fp32 bias, and zeros past
    the last group, on poisoned outputs."""
    from compiled_moe.kernels import configs, grouped_mm_sm90 as sm90
    M, K, N, G, offs = shape
    torch.manual_seed(M)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    offs = (torch.tensor(offs, dtype=torch.int32, device=DEV) if offs is not None
            else skewed_offsets(M, G, seed=M, tail=1))
    if K >= 2048:
        assert configs.grouped_mm_sm90_split_k(M, N, K, G) > 1
    for a, b, bias in ((x, w.mT, torch.randn(G, N, device=DEV)), (dy, w, None),
                       (x, w.mT.contiguous(), torch.randn(G, N, device=DEV, dtype=torch.bfloat16))):
        want = loop_grouped_mm(a, b, offs, bias).to(DEV)
        for splits in (1, 2, 3, 8):
            out = torch.full((M, b.shape[2]), float("nan"), device=DEV, dtype=torch.bfloat16)
            with no_sync():
                sm90.grouped_mm(a, b, offs, bias, out, splits=splits)
            torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item(),
                                       msg=f"{splits} k ranges")
        torch.testing.assert_close(cm.grouped_mm(a, b, offs, bias=bias).double(), want, rtol=1e-2,
                                   atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("offs", CORRUPT_OFFSETS)
def test_cuda_kernels_corrupt_offsets(offs):
    """Every CUDA kernel takes group bounds as the reference does: forward in both weight
    layouts with a bias, one and several k ranges, dgrad, the weight gradient and its
    accumulation, on poisoned outputs, against the float64 loop."""
    from compiled_moe.kernels import grouped_mm_sm90 as sm90
    M, K, N = CORRUPT_OFFSETS_SHAPE
    offs, x, w, dy = corrupt_offsets_problem(offs, seed=11)
    G = offs.shape[0]
    bias = torch.randn(G, N, device=DEV)
    tol = dict(rtol=1e-2, atol=1e-2 * 4)
    for a, b, bias_ in ((x, w.mT, bias), (x, w.mT.contiguous(), None), (dy, w, None)):
        want = loop_grouped_mm(a, b, offs, bias_).to(DEV)
        # the default, the plain and the skipping kernels, and two k ranges
        for splits, skip in ((None, None), (1, False), (1, True), (2, None)):
            out = torch.full((M, b.shape[2]), float("nan"), device=DEV, dtype=torch.bfloat16)
            with no_sync():
                sm90.grouped_mm(a, b, offs, bias_, out, skip_past_rows=skip, splits=splits)
            torch.testing.assert_close(out.double(), want, **tol, msg=f"{splits} k ranges, skip {skip}")
    main = torch.randn(G, K, N, device=DEV)
    mask = torch.tensor([True, False, True, False], device=DEV)
    wgrad = loop_wgrad(x, dy, offs).to(DEV)
    assert sm90.wgrad_supported(x, dy, torch.bfloat16)
    with no_sync():
        got = cm.grouped_mm_wgrad(x, dy, offs)
        acc = main.clone()
        cm.grouped_mm_wgrad_accumulate_(acc, x, dy, offs, accumulate_mask=mask)
    scale = wgrad.abs().max().item()
    torch.testing.assert_close(got.double(), wgrad, rtol=1e-2, atol=1e-2 * scale)
    torch.testing.assert_close(acc.double(), wgrad + main.double() * mask[:, None, None], rtol=1e-4,
                               atol=1e-4 * scale)


def test_cuda_graph_replay_split_k_with_new_offsets():
    """Split K's range count is chosen on the device from offs, and the sum kernel reads it
    back: a captured graph replayed with other offsets (16 groups of one row: 128 tiles, one
    range; one group: 8 tiles, 8 ranges; rows past the end) gives the eager result bitwise."""
    from compiled_moe.kernels import configs
    M, K, N, G = 16, 4096, 2048, 64  # a few tokens' rows
    assert configs.grouped_mm_sm90_split_k(M, N, K, G) > 1
    torch.manual_seed(6)
    a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
    offs = skewed_offsets(M, G, seed=7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cm.grouped_mm(a, w.mT, offs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cm.grouped_mm(a, w.mT, offs)
    one_row_each = torch.cumsum((torch.arange(G) % 4 == 0).int(), 0).clamp(max=M).to(torch.int32)
    all_in_one = torch.full((G,), M, dtype=torch.int32)
    all_in_one[:9] = 0
    for new in (one_row_each.to(DEV), all_in_one.to(DEV), skewed_offsets(M, G, seed=8, tail=5)):
        offs.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = cm.grouped_mm(a, w.mT, offs)
        assert torch.equal(out, want)
        torch.testing.assert_close(out.double(), loop_grouped_mm(a, w.mT, offs).to(DEV), rtol=1e-2,
                                   atol=1e-2 * want.abs().max().item())


def test_cuda_kernels_fall_back():
    """Operands the CUDA kernels cannot take run the Triton kernels, with the same result: an
    unaligned address, N not a multiple of 8, an fp32 output."""
    M, K, N, G = 512, 256, 200, 4
    torch.manual_seed(3)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5
    offs = skewed_offsets(M, G, seed=4)
    shifted = torch.empty(M * K + 4, device=DEV, dtype=torch.bfloat16)[4:].view(M, K)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    want = loop_grouped_mm(x, w.mT, offs)
    for got in (cm.grouped_mm(shifted, w.mT, offs),
                cm.grouped_mm(x, w.mT, offs, out_dtype=torch.float32)):
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    w_odd = w[:, :197]  # N = 197
    torch.testing.assert_close(cm.grouped_mm(x, w_odd.mT, offs).double(),
                               loop_grouped_mm(x, w_odd.mT, offs), rtol=1e-2, atol=1e-2)
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    torch.testing.assert_close(cm.grouped_mm_wgrad(shifted, dy, offs).double(),
                               loop_wgrad(x, dy, offs), rtol=1e-2, atol=1e-1)


def test_cuda_ops_opcheck():
    M, K, N, G = 256, 64, 96, 4
    a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=DEV, dtype=torch.bfloat16)
    d = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(G, N, device=DEV, dtype=torch.bfloat16)
    offs = skewed_offsets(M, G, seed=9, empty_groups=1)
    ops = torch.ops.compiled_moe
    torch.library.opcheck(ops.grouped_mm_sm90.default, (a, w.transpose(1, 2), offs, bias, None))
    torch.library.opcheck(ops.grouped_mm_wgrad_sm90.default, (a, d, offs, None))
    torch.library.opcheck(ops.grouped_mm_wgrad_accumulate_sm90_.default,
                          (torch.zeros(G, K, N, device=DEV), a, d, offs,
                           torch.ones(G, dtype=torch.bool, device=DEV)))


# ----------------------------------- the weight gradients' tile order (TileQueue, csrc/sm90.cuh)

def claims_tiles(counts, tiles_per_group, rows_per_step, claim_steps, grid, percent=6):
    """The fixed order's loads summed tile by tile: CTA b takes tiles b, b + grid, ...; a tile
    costs its group's steps plus one. Claimed where the most loaded CTA is `percent` % past the
    mean, or where the mean tile has claim_steps steps or more (claim_steps > 0)."""
    loads = [0] * grid
    for g, rows in enumerate(counts):
        for j in range(tiles_per_group):
            loads[(g * tiles_per_group + j) % grid] += -(-rows // rows_per_step) + 1
    long_tiles = claim_steps > 0 and sum(loads) >= (claim_steps + 1) * len(counts) * tiles_per_group
    return long_tiles or max(loads) * grid * 100 > sum(loads) * (100 + percent)


def test_wgrad_tile_order():
    """wgrad_tile_order (csrc/grouped_mm.cu) chooses tiles claimed at run time where the fixed
    order would leave a CTA 6% past the mean (a circular difference array over the CTAs), or
    where tiles are long (claim_steps: the FP8 weight gradient's): its choice against the loads
    summed tile by tile, and the claims' counter zeroed."""
    from compiled_moe import host, native
    from compiled_moe.kernels.configs import FP8_WGRAD_CLAIM_STEPS
    dev = torch.cuda.current_device()
    kernel = native.function_handle(native.kernel("grouped_mm", "wgrad_tile_order", dev), dev)
    seen = set()
    for M, G, seed, tiles_per_group, rows_per_step, grid in [
        (32768, 128, 0, 48, 64, 132),     # Qwen3 fc2's bf16 weight gradient, skewed
        (32768, 128, 0, 96, 64, 132),     # Qwen3 fc1
        (32768, 128, 0, 192, 128, 132),   # the FP8 kernel's tiles of the same
        (32768, 32, 0, 448, 64, 132),     # DeepSeek-V3 fc2: many tiles a group
        (16384, 128, 0, 276, 64, 132),    # GPT-OSS fc2
        (8192, 8, 0, 3584, 64, 132),      # Mixtral fc1
        (32768, 128, -1, 48, 64, 132),    # uniform
        (8192, 64, 8192, 12, 64, 132),    # test_cuda_kernels_match_oracle_and_triton's shape
        (8192, 64, 8192, 24, 128, 132),   # ... and test_fp8_cuda_wgrad's (groups of 16-row multiples)
        (1000, 7, 3, 5, 64, 30),          # a grid that divides nothing
        (300, 3, 5, 2, 16, 6),
    ]:
        if seed < 0:
            offs = torch.arange(1, G + 1, dtype=torch.int32, device=DEV) * (M // G)
        else:  # (the FP8 kernel's groups: multiples of 16 rows, as test_gpu_fp8's)
            offs = skewed_offsets(M, G, seed=seed, empty_groups=1, multiple=16 if rows_per_step == 128 else 1)
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
        for claim_steps in (0, 4, FP8_WGRAD_CLAIM_STEPS):
            order = torch.full((2,), -1, dtype=torch.int32, device=DEV)
            host.cuda_module().launch_wgrad_tile_order(kernel, offs, M, tiles_per_group, rows_per_step,
                                                       claim_steps, grid, order)
            want = claims_tiles(counts, tiles_per_group, rows_per_step, claim_steps, grid)
            assert order.tolist() == [int(want), 0], (M, G, seed, tiles_per_group, claim_steps, grid)
            seen.add((claim_steps > 0, want))
            if seed == 8192:  # the tests' shapes do claim at run time
                assert want
    assert seen == {(False, True), (False, False), (True, True), (True, False)}


def test_cuda_wgrad_claimed_tiles_deterministic():
    """Claimed at run time, a tile lands on whichever CTA is free, but one CTA reduces it in a
    fixed order: repeated runs give the same bits, equal to the oracle's sum."""
    M, K, N, G = 8192, 512, 768, 64
    torch.manual_seed(7)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    offs = skewed_offsets(M, G, seed=M, empty_groups=1)
    first = cm.grouped_mm_wgrad(dy, x, offs)
    for _ in range(3):
        assert torch.equal(cm.grouped_mm_wgrad(dy, x, offs), first)
    want = loop_wgrad(dy, x, offs).to(DEV)
    torch.testing.assert_close(first.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
