"""Demo: a small MoE transformer block (norm, router, experts, residual), eager and compiled.

    python -m compiled_moe.demo

The block routes every token to its top-k experts and runs them with compiled_moe.MoEExperts
(routing, gather, FC1 -> SwiGLU -> FC2, weighted combine: no host sync). It runs eager and under
torch.compile(fullgraph=True), checks output and gradients against the same block in float64
with a per-expert loop, and prints a table. With a GPU it also times forward+backward against
the same block whose experts are built from stock torch ops on torch._grouped_mm (argsort,
histc, index ops: how Hugging Face's grouped_mm backend does it).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import compiled_moe as cm


def experts_loop(hidden, topk_ids, topk_weights, w1, w2):
    """The independent check: one pair of matmuls per expert, routing read on the host."""
    out = torch.zeros_like(hidden)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = (hidden[tok] @ w1[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out = out.index_add(0, tok, y * topk_weights[tok, slot, None])
    return out


def experts_torch_grouped_mm(hidden, topk_ids, topk_weights, w1, w2):
    """The experts from stock torch ops on torch._grouped_mm (the timing baseline)."""
    T, k = topk_ids.shape
    ids_sorted, order = torch.sort(topk_ids.flatten(), stable=True)
    counts = torch.histc(ids_sorted.int(), bins=w1.shape[0], min=0, max=w1.shape[0] - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hidden[order // k]
    gate, up = torch._grouped_mm(x, w1.transpose(1, 2), offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs)
    y = y * topk_weights.flatten()[order, None]
    out_rows = torch.empty_like(y).index_copy(0, order, y)  # back to (token, slot) order
    return out_rows.view(T, k, -1).sum(1)


class MoEBlock(nn.Module):
    """x + experts(norm(x)), with a softmax top-k router whose weights are renormalised."""

    def __init__(self, hidden, inter, experts, top_k, experts_impl="compiled_moe"):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = cm.MoEExperts(experts, hidden, inter)
        self.top_k, self.experts_impl = top_k, experts_impl

    def forward(self, x, topk_ids=None):
        h = self.norm(x)
        probs = torch.softmax(self.router(h).float(), dim=-1)
        if topk_ids is None:
            topk_ids = probs.topk(self.top_k, dim=-1).indices
        weights = probs.gather(1, topk_ids)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if self.experts_impl == "compiled_moe":
            y = self.experts(h, topk_ids, weights)
        else:
            fn = experts_loop if self.experts_impl == "loop" else experts_torch_grouped_mm
            y = fn(h, topk_ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        return x + y, topk_ids


def forward_backward(block, x, topk_ids=None):
    x = x.detach().clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out, ids = block(x, topk_ids)
    out.float().square().mean().backward()
    grads = [x.grad] + [p.grad for p in (block.router.weight, block.experts.gate_up_proj,
                                         block.experts.down_proj)]
    return out.detach(), ids, grads


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    # GPU: the Qwen3-30B-A3B MoE shape at 8192 tokens, large enough for the GPU, not the host,
    # to set the time. CPU: small enough to finish in seconds.
    T, H, I, E, k = (8192, 2048, 768, 128, 8) if cuda else (256, 64, 96, 8, 2)
    torch.manual_seed(0)
    block = MoEBlock(H, I, E, k).to(device, dtype)
    x = torch.randn(T, H, device=device, dtype=dtype)
    compiled = torch.compile(block, fullgraph=True)
    # Reference: the same block in float64, experts by a per-expert loop, fed the routing
    # decision of the run it checks (near-ties could flip a top-k choice between dtypes).
    ref_block = MoEBlock(H, I, E, k, experts_impl="loop").to(device, torch.float64)
    ref_block.load_state_dict(block.state_dict())
    rows = []
    for name, fn in (("compiled_moe eager", block), ("compiled_moe compiled", compiled)):
        t0 = time.perf_counter()
        out, ids, grads = forward_backward(fn, x)
        first_call = time.perf_counter() - t0
        ref_out, _, ref_grads = forward_backward(ref_block, x.double(), ids)
        errs = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
        rows.append((name, errs, first_call))

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"MoE block: T={T} H={H} I={I} experts={E} top-{k} {str(dtype)[6:]} on {device}")
    print(f"{'path':24s} {'out':>9s} {'d x':>9s} {'d router':>9s} {'d w1':>9s} {'d w2':>9s} "
          f"{'1st call':>9s}")
    ok = True
    for name, errs, first in rows:
        ok &= all(e < tol for e in errs)
        print(f"{name:24s} " + " ".join(f"{e:9.2e}" for e in errs) + f" {first:8.2f}s")
    print(f"relative errors vs the float64 block with per-expert loops (tolerance {tol:g}): "
          f"{'OK' if ok else 'FAILED'}")

    if cuda:
        import triton

        stock = MoEBlock(H, I, E, k, experts_impl="torch_grouped_mm").to(device, dtype)
        stock.load_state_dict(block.state_dict())
        print(f"\n{'forward+backward':32s} {'ms':>8s}")
        timings = {}
        for name, fn in (("torch._grouped_mm block eager", stock),
                         ("torch._grouped_mm block compiled", torch.compile(stock, fullgraph=True)),
                         ("compiled_moe eager", block),
                         ("compiled_moe compiled", compiled)):
            timings[name] = triton.testing.do_bench(lambda: forward_backward(fn, x),
                                                    return_mode="median")
            print(f"{name:32s} {timings[name]:8.3f}")
        base = timings["torch._grouped_mm block compiled"]
        print(f"speedup of compiled_moe compiled over the torch._grouped_mm block compiled: "
              f"{base / timings['compiled_moe compiled']:.2f}x")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
