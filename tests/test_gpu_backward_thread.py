"""GPU tier: the csrc/ kernels as the first GPU work of autograd's backward thread.

Autograd runs backward on a thread of its own. A thread that has only reused torch's cached
memory may have no current CUDA context, and every driver-API call (a descriptor encode, an
occupancy query, a module load, a launch) needs one: a one-row backward in a fresh process
once failed with CUDA_ERROR_INVALID_CONTEXT at its first descriptor encode. Each case runs in
a fresh interpreter so that the backward thread has done nothing before, and checks its
gradients against the reference on the CPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

_PRELUDE = """
import torch, compiled_moe as cm
from compiled_moe import reference as ref
torch.manual_seed(0)
dev = "cuda"
"""

CASES = {
    # a decode-sized batch through backward: one row, 16 experts, the row in expert 5
    "grouped_mm": """
a = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(16, 1536, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
offs = torch.tensor([0] * 5 + [1] * 11, device=dev, dtype=torch.int32)
dy = torch.randn(1, 1536, device=dev, dtype=torch.bfloat16)
cm.grouped_mm(a, w.mT, offs).backward(dy)
a64, w64 = a.detach().double().cpu(), w.detach().double().cpu()
want_da = dy.double().cpu() @ w64[5]
want_dw = (dy.double().cpu().mT @ a64)
torch.testing.assert_close(a.grad.double().cpu(), want_da, rtol=2e-2, atol=2e-1)
torch.testing.assert_close(w.grad[5].double().cpu(), want_dw, rtol=2e-2, atol=5e-2)
assert not w.grad[:5].any() and not w.grad[6:].any()
""",
    "fp8_grouped_mm": """
a = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(16, 1536, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
offs = torch.tensor([0] * 5 + [16] * 11, device=dev, dtype=torch.int32)
dy = torch.randn(16, 1536, device=dev, dtype=torch.bfloat16)
cm.fp8_grouped_mm(a, w.mT, offs, recipe="fp8_blockwise").backward(dy)
a64, w64, dy64 = a.detach().double().cpu(), w.detach().double().cpu(), dy.double().cpu()
# FP8 operands: compare relative Frobenius errors
def rel(x, y):
    return ((x.double().cpu() - y).norm() / y.norm()).item()
assert rel(a.grad, dy64 @ w64[5]) < 0.1, rel(a.grad, dy64 @ w64[5])
assert rel(w.grad[5], dy64.mT @ a64) < 0.1, rel(w.grad[5], dy64.mT @ a64)
""",
    # the route's CUDA kernels (more than 1024 pairs) first on the backward thread
    "moe_route": """
ids = torch.randint(0, 64, (2048, 4), device=dev, dtype=torch.int32)
class RouteInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        RouteInBackward.routed = torch.ops.compiled_moe.moe_route(ids, 64, 1)
        return g * 2
x = torch.randn(8, device=dev, requires_grad=True)
RouteInBackward.apply(x).sum().backward()
offs, row_of, source = (t.cpu() for t in RouteInBackward.routed)
want = ref.moe_route(ids.cpu(), 64, 1)
for got, expected in zip((offs, row_of, source), want):
    assert torch.equal(got, expected)
""",
    # the experts block's one-call backward (C++ autograd function) at one token
    "moe_experts": """
hidden = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
ids = torch.tensor([[3, 9]], device=dev)
weights = torch.tensor([[0.6, 0.4]], device=dev, requires_grad=True)
w1 = (torch.randn(16, 768, 1024, device=dev) / 32).bfloat16().requires_grad_()
w2 = (torch.randn(16, 1024, 384, device=dev) / 20).bfloat16().requires_grad_()
dy = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
out = cm.moe_experts(hidden, ids, weights, w1, w2)
from compiled_moe import host
if host.cuda_module() is not None:  # (COMPILED_MOE_HOST=0: the Python composition's backward)
    assert "ExpertsBlockFunction" in out.grad_fn.name()
out.backward(dy)
leaves = [t.detach().double().cpu().requires_grad_() for t in (hidden, weights, w1, w2)]
cm.moe_experts(leaves[0], ids.cpu(), *leaves[1:], fused=False).backward(dy.double().cpu())
def rel(x, y):
    return ((x.double().cpu() - y).norm() / y.norm()).item()
for got, want in zip((hidden.grad, weights.grad, w1.grad, w2.grad), leaves):
    assert rel(got, want.grad) < 2e-2, rel(got, want.grad)
""",
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_first_gpu_work_of_the_backward_thread(case):
    script = textwrap.dedent(_PRELUDE) + textwrap.dedent(CASES[case]) + "\nprint('ok')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
