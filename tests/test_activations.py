"""CPU tier of the activation op: reference formulas vs autograd, Triton kernels in the
interpreter, gradcheck, opcheck, bad inputs."""

import pytest
import torch

from compiled_moe import reference
from compiled_moe.ops._dispatch import kernels_on_cpu
from helpers import assert_matches_oracle

act = torch.ops.compiled_moe.moe_activation
act_bwd = torch.ops.compiled_moe.moe_activation_backward
scaled_bwd = torch.ops.compiled_moe.moe_scaled_activation_backward

CASES = [(a, "stacked") for a in reference.ACTIVATIONS] + [
    (a, "interleaved") for a in reference.GATED_ACTIVATIONS]


def _h(rows, cols, dtype=torch.float64, seed=0):
    # Wide values, so that gpt_oss's clamps at +-7 and relu's kink are crossed.
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("name,layout", CASES)
def test_reference_backward_matches_autograd(name, layout):
    h = _h(13, 10).requires_grad_(True)
    grad = torch.randn(13, 5 if name in reference.GATED_ACTIVATIONS else 10, dtype=torch.float64)
    (want,) = torch.autograd.grad(reference.activation(h, name, layout), h, grad)
    torch.testing.assert_close(reference.activation_backward(grad, h.detach(), name, layout), want)


@pytest.mark.parametrize("name,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_interpreter(name, layout, dtype):
    h = _h(21, 38, dtype)
    inter = 19 if name in reference.GATED_ACTIVATIONS else 38
    grad = torch.randn(21, inter).to(dtype)
    with kernels_on_cpu():
        out = act(h, name, layout)
        dh = act_bwd(grad, h, name, layout, reference.GPT_OSS_ALPHA, reference.GPT_OSS_LIMIT)
    assert_matches_oracle(out, reference.activation(h.double(), name, layout),
                          reference.activation(h, name, layout))
    assert_matches_oracle(dh, reference.activation_backward(grad.double(), h.double(), name, layout),
                          reference.activation_backward(grad, h, name, layout))


@pytest.mark.parametrize("name,layout", [("swiglu", "stacked"), ("gpt_oss", "interleaved"),
                                         ("relu2", "stacked")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_forward_with_probs_interpreter(name, layout, dtype):
    """The forward kernel scales each row by its probability (the fused MLP's FC1 on the
    Hopper GEMM path), in fp32 before the cast, as the fused FC1 does."""
    from compiled_moe.kernels.activations import activation_forward

    h = _h(21, 38, dtype)
    probs = torch.rand(21, generator=torch.Generator().manual_seed(1))
    inter = 19 if name in reference.GATED_ACTIVATIONS else 38
    out = torch.empty(21, inter, dtype=dtype)
    with kernels_on_cpu():
        activation_forward(h, out, name, layout, reference.GPT_OSS_ALPHA,
                           reference.GPT_OSS_LIMIT, probs=probs)
    want = reference.activation(h.double(), name, layout) * probs.double()[:, None]
    same_dtype = reference.activation(h, name, layout) * probs.to(dtype)[:, None]
    assert_matches_oracle(out, want, same_dtype)


@pytest.mark.parametrize("name,layout", CASES)
def test_scaled_backward_reference_matches_autograd(name, layout):
    """(dh, dprobs) of a = act(h) * probs against autograd of the float64 composition."""
    h = _h(13, 10).requires_grad_(True)
    probs = torch.rand(13, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(13, 5 if name in reference.GATED_ACTIVATIONS else 10, dtype=torch.float64)
    want = torch.autograd.grad(reference.scaled_activation(h, name, layout, probs), (h, probs), grad)
    dh, dprobs = scaled_bwd(grad, h.detach(), probs.detach(), name, layout)
    torch.testing.assert_close(dh, want[0])
    torch.testing.assert_close(dprobs, want[1].float())  # dprobs is fp32 in every dtype


@pytest.mark.parametrize("name,layout", [("swiglu", "stacked"), ("gpt_oss", "interleaved"),
                                         ("silu", "stacked")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scaled_backward_kernel_interpreter(name, layout, dtype):
    h = _h(21, 38, dtype)
    inter = 19 if name in reference.GATED_ACTIVATIONS else 38
    grad = torch.randn(21, inter).to(dtype)
    probs = torch.rand(21, generator=torch.Generator().manual_seed(2))
    with kernels_on_cpu():
        dh, dprobs = scaled_bwd(grad, h, probs, name, layout)
    want = reference.scaled_activation_backward(grad.double(), h.double(), probs.double(), name,
                                                layout)
    same_dtype = reference.scaled_activation_backward(grad, h, probs, name, layout)
    assert_matches_oracle(dh, want[0], same_dtype[0])
    assert dprobs.dtype == torch.float32
    assert_matches_oracle(dprobs, want[1], same_dtype[1])


def test_kernel_strided_rows_interpreter():
    """A row-strided view (FC1 output inside a wider buffer) reads correctly."""
    base = _h(9, 40, torch.float32)
    h = base[:, 4:36]
    with kernels_on_cpu():
        out = act(h, "swiglu", "stacked")
    torch.testing.assert_close(out, reference.activation(h, "swiglu", "stacked"))


@pytest.mark.parametrize("name,layout", [("gpt_oss", "interleaved"), ("geglu", "stacked"),
                                         ("gelu", "stacked")])
def test_gradcheck(name, layout):
    h = (torch.randn(5, 6, dtype=torch.float64) * 3).requires_grad_(True)
    torch.autograd.gradcheck(lambda x: act(x, name, layout), (h,))


@pytest.mark.parametrize("name,layout", [("swiglu", "stacked"), ("relu2", "stacked")])
def test_opcheck(name, layout):
    h = _h(7, 8, torch.float32)
    torch.library.opcheck(act, (h, name, layout))
    inter = 4 if name in reference.GATED_ACTIVATIONS else 8
    torch.library.opcheck(act_bwd, (torch.randn(7, inter), h, name, layout, 1.702, 7.0))
    torch.library.opcheck(scaled_bwd, (torch.randn(7, inter), h, torch.rand(7), name, layout))


def test_bad_inputs():
    with pytest.raises(ValueError, match="activation"):
        act(_h(3, 4), "tanh")
    with pytest.raises(ValueError, match="gate_up_layout"):
        act(_h(3, 4), "swiglu", "split")
    with pytest.raises(ValueError, match="even"):
        act(_h(3, 5), "swiglu")
    with pytest.raises(ValueError, match="grad"):
        act_bwd(torch.randn(3, 3, dtype=torch.float64), _h(3, 4), "swiglu", "stacked", 1.702, 7.0)
    with pytest.raises(ValueError, match="probs must be"):
        scaled_bwd(torch.randn(3, 2, dtype=torch.float64), _h(3, 4), torch.rand(4), "swiglu")
    with pytest.raises(TypeError, match="probs must be a tensor"):
        scaled_bwd(torch.randn(3, 2, dtype=torch.float64), _h(3, 4), None, "swiglu")
