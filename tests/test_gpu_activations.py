"""GPU tier of the activation op (marker gpu): every activation and layout in bf16/fp16 on
real sizes against float64, no host sync."""

import pytest
import torch

from compiled_moe import reference
from helpers import assert_matches_oracle, no_sync

pytestmark = pytest.mark.gpu
CASES = [(a, "stacked") for a in reference.ACTIVATIONS] + [
    (a, "interleaved") for a in reference.GATED_ACTIVATIONS]


@pytest.mark.parametrize("name,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_gpu(name, layout, dtype):
    torch.manual_seed(0)
    h = (torch.randn(4099, 1536, device="cuda") * 4).to(dtype)
    inter = 768 if name in reference.GATED_ACTIVATIONS else 1536
    grad = torch.randn(4099, inter, device="cuda").to(dtype)
    with no_sync():
        out = torch.ops.compiled_moe.moe_activation(h, name, layout)
        dh = torch.ops.compiled_moe.moe_activation_backward(grad, h, name, layout, 1.702, 7.0)
    assert_matches_oracle(out, reference.activation(h.double(), name, layout),
                          reference.activation(h, name, layout), atol=1e-3)
    assert_matches_oracle(dh, reference.activation_backward(grad.double(), h.double(), name, layout),
                          reference.activation_backward(grad, h, name, layout), atol=1e-3)
