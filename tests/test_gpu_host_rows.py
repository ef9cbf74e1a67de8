"""GPU tier of the C++ host layer's row ops (csrc/host/rows.cpp, csrc/moe_rows.cu): moe_permute,
moe_unpermute and its backward, moe_activation and its backward, grouped_sum, each against
compiled_moe.reference (the float64 oracle under DESIGN.md's tolerance rule; copies exactly),
with no host sync; float64 through the Python kernel; opcheck. tests/test_gpu_activations.py and
the experts-block tests run them too (the layer is on by default with a CUDA build of torch)."""

from __future__ import annotations

import pytest
import torch

from compiled_moe import host, reference
from helpers import assert_matches_oracle, no_sync, random_offsets

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                                 reason="needs a GPU of sm_80 or later"),
              pytest.mark.skipif(host.cuda_module() is None, reason="the C++ host layer has no CUDA kernels here")]

ops = torch.ops.compiled_moe
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_registered_in_cpp():
    for op in ("moe_permute", "moe_unpermute", "moe_unpermute_backward", "moe_activation",
               "moe_activation_backward", "grouped_sum"):
        line = torch._C._dispatch_dump(f"compiled_moe::{op}").split("CUDA:")[1].splitlines()[0]
        assert "csrc/host/rows.cpp" in line, (op, line)


def _routing(tokens, k, E, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (tokens, k), generator=g)
    if tokens:
        ids[0, 0] = -1  # an expert elsewhere: dropped
    return ops.moe_route(ids.cuda(), E, pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [128, 100])  # whole rows as 16-byte pieces; element by element
@pytest.mark.parametrize("scaled", [None, "fp32", "same"])
def test_permute_unpermute_match_reference(dtype, H, scaled):
    tokens, k = 300, 4
    offs, row_of, source = _routing(tokens, k, 16, pad=8)
    g = torch.Generator().manual_seed(H)
    hidden = torch.randn(tokens, H, generator=g).to(dtype).cuda()
    scale = None if scaled is None else \
        torch.rand(tokens, k, generator=g).to(torch.float32 if scaled == "fp32" else dtype).cuda()
    y = torch.randn(source.shape[0], H, generator=g).to(dtype).cuda()
    grad = torch.randn(tokens, H, generator=g).to(dtype).cuda()
    with no_sync():
        x = ops.moe_permute(hidden, row_of, source, scale)
        out = ops.moe_unpermute(y, row_of, source, scale)
        grad_y, grad_w = ops.moe_unpermute_backward(grad, y, row_of, source, scale) if scale is not None \
            else (None, None)
    want_x = reference.moe_permute(hidden, source, k, scale)
    if scale is None:
        assert torch.equal(x, want_x)  # a copy
    else:
        assert_matches_oracle(x, reference.moe_permute(hidden.double(), source, k, scale.double()), want_x)
    assert_matches_oracle(out, reference.moe_unpermute(y.double(), row_of, None if scale is None else scale.double()),
                          reference.moe_unpermute(y, row_of, scale))
    if scale is not None:
        assert grad_y.dtype == y.dtype and grad_w.dtype == scale.dtype
        assert_matches_oracle(grad_y, reference.moe_permute(grad.double(), source, k, scale.double()),
                              reference.moe_permute(grad, source, k, scale))
        assert_matches_oracle(grad_w, reference.moe_unpermute_dot(grad.double(), y.double(), row_of),
                              reference.moe_unpermute_dot(grad, y, row_of).to(scale.dtype), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_maps_that_disagree(dtype):
    """row_of and source that name each other only in part (and entries outside the tensors):
    the kernels read from the token side where the maps agree and from the row side elsewhere,
    so every row is written once and equals the reference's x[source[r] // k]; memory first
    filled with NaN must not show through."""
    from test_routing import _corrupt

    tokens, k, H = 200, 4, 256
    offs, row_of, source = _routing(tokens, k, 16, pad=8, seed=3)
    row_of, source = (t.cuda() for t in _corrupt(row_of.cpu(), source.cpu()))
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(tokens, H, generator=g).to(dtype).cuda()
    w = torch.rand(tokens, k, generator=g).to(dtype).cuda()
    y = torch.randn(source.shape[0], H, generator=g).to(dtype).cuda()
    torch.full((4 * source.shape[0], H), float("nan"), device="cuda", dtype=dtype)  # freed: reused
    x = ops.moe_permute(hidden, row_of, source)
    xs = ops.moe_permute(hidden, row_of, source, w)
    grad_y, grad_w = ops.moe_unpermute_backward(hidden, y, row_of, source, w)
    assert torch.equal(x, reference.moe_permute(hidden, source, k))
    torch.testing.assert_close(xs.float(), reference.moe_permute(hidden, source, k, w).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_y, xs, rtol=0, atol=0)
    assert torch.isfinite(grad_w).all()


def test_permute_strided_and_empty():
    offs, row_of, source = _routing(64, 2, 8, pad=1)
    wide = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    hidden = wide[:, 64:192]  # rows of a wider buffer
    with no_sync():
        x = ops.moe_permute(hidden, row_of, source)
        x_cols = ops.moe_permute(wide.t().contiguous().t(), row_of, source)  # column-major: copied first
    assert torch.equal(x, reference.moe_permute(hidden, source, 2))
    assert torch.equal(x_cols, reference.moe_permute(wide, source, 2))
    _, row_of0, source0 = _routing(0, 2, 8, pad=4)
    assert torch.equal(ops.moe_permute(torch.empty(0, 128, device="cuda"), row_of0, source0),
                       torch.zeros(source0.shape[0], 128, device="cuda"))
    y0 = torch.empty(source0.shape[0], 128, device="cuda")
    assert ops.moe_unpermute(y0, row_of0, source0).shape == (0, 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,layout", [(a, "stacked") for a in reference.ACTIVATIONS] +
                         [(a, "interleaved") for a in reference.GATED_ACTIVATIONS])
def test_activation_matches_reference(dtype, name, layout):
    """Forward and backward, h as a column slice of a wider buffer, grad in fp32 (autograd hands
    the backward whatever dtype came back)."""
    torch.manual_seed(0)
    buffer = (torch.randn(257, 640, device="cuda") * 4).to(dtype)
    h = buffer[:, 64:576]
    inter = 256 if name in reference.GATED_ACTIVATIONS else 512
    grad = torch.randn(257, inter, device="cuda")
    with no_sync():
        out = ops.moe_activation(h, name, layout)
        dh = ops.moe_activation_backward(grad, h, name, layout)
    assert out.dtype == dtype and dh.dtype == dtype and dh.is_contiguous()
    assert_matches_oracle(out, reference.activation(h.double(), name, layout),
                          reference.activation(h, name, layout), atol=1e-3)
    assert_matches_oracle(dh, reference.activation_backward(grad.double(), h.double(), name, layout),
                          reference.activation_backward(grad.to(dtype), h, name, layout), atol=1e-3)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float16, None),
                                             (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("M,N,G", [(1000, 200, 16), (4, 1536, 128), (8192, 96, 1)])
def test_grouped_sum_matches_reference(dtype, out_dtype, M, N, G):
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, N, generator=g).to(dtype).cuda()
    offs = random_offsets(M, G, generator=g, empty_groups=min(3, G - 1), tail=min(5, M)).cuda()
    with no_sync():
        out = ops.grouped_sum(x, offs, out_dtype)
    assert out.dtype == (out_dtype or dtype)
    assert_matches_oracle(out, reference.grouped_sum(x.double(), offs),
                          reference.grouped_sum(x, offs, out_dtype), atol=1e-3)
    # Offsets past M and out of order are clamped and made monotone, as the Triton kernel reads them.
    offs_bad = torch.tensor([M + 5, 2, M], dtype=torch.int32, device="cuda") if G >= 3 else None
    if offs_bad is not None:
        x3 = x[:, :min(N, 64)]
        got = ops.grouped_sum(x3, offs_bad)
        want = torch.stack([x3.float().sum(0), torch.zeros_like(x3[0]).float(), torch.zeros_like(x3[0]).float()])
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_float64_takes_the_python_kernel():
    offs, row_of, source = _routing(32, 2, 4, pad=1)
    hidden = torch.randn(32, 16, device="cuda", dtype=torch.float64)
    assert torch.equal(ops.moe_permute(hidden, row_of, source), reference.moe_permute(hidden, source, 2))
    h = torch.randn(8, 16, device="cuda", dtype=torch.float64)
    assert torch.equal(ops.moe_activation(h, "swiglu"), reference.activation(h, "swiglu"))
    x = torch.randn(40, 16, device="cuda", dtype=torch.float64)
    o = torch.tensor([10, 40], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(ops.grouped_sum(x, o), reference.grouped_sum(x, o), rtol=1e-12, atol=1e-12)


def test_opcheck():
    offs, row_of, source = _routing(24, 2, 4, pad=1)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(24, 64, **bf, requires_grad=True)
    w = torch.rand(24, 2, device="cuda", requires_grad=True)
    y = torch.randn(source.shape[0], 64, **bf, requires_grad=True)
    h = torch.randn(24, 128, **bf, requires_grad=True)
    torch.library.opcheck(ops.moe_permute.default, (hidden, row_of, source, w))
    torch.library.opcheck(ops.moe_unpermute.default, (y, row_of, source, w))
    torch.library.opcheck(ops.moe_activation.default, (h, "swiglu", "interleaved"))
    torch.library.opcheck(ops.grouped_sum.default, (hidden, offs, torch.float32))
