"""Demo: a small MoE expert MLP built from compiled_moe.grouped_mm, eager and compiled.

    python -m compiled_moe.demo

Routes tokens to experts (top-k), runs FC1 -> SwiGLU -> FC2 -> weighted combine with the
grouped GEMM op, eager and under torch.compile(fullgraph=True), checks output and gradients
against a float64 per-expert loop, and prints a table. With a GPU it also times the block
against the same block built on torch._grouped_mm.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import compiled_moe as cm


def route(topk_ids: torch.Tensor, num_experts: int):
    """Expert-sorted order of the (token, slot) pairs and the group offsets, on the device."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)  # rows of the sorted input, by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, cm.counts_to_offsets(counts)


def experts_mlp(hidden, topk_ids, topk_weights, w1, w2, matmul):
    """hidden (T, H); w1 (E, 2I, H) gate/up stacked; w2 (E, H, I) -> (T, H)."""
    T, k = topk_ids.shape
    order, offs = route(topk_ids, w1.shape[0])
    x = hidden[order // k]                                 # gather, expert-sorted
    gate, up = matmul(x, w1.transpose(1, 2), offs).chunk(2, dim=-1)
    y = matmul(F.silu(gate) * up, w2.transpose(1, 2), offs)
    out_rows = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return (out_rows.view(T, k, -1) * topk_weights[..., None].to(y.dtype)).sum(1)


def ours(a, b, offs):
    return cm.grouped_mm(a, b, offs)


def per_expert_loop_mm(a, b, offs):
    """The independent check: one matmul per expert, read off the offsets on the host."""
    out, start = a.new_zeros(a.shape[0], b.shape[2]), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def torch_grouped_mm(a, b, offs):
    return torch._grouped_mm(a, b, offs)


def make_inputs(T, H, I, E, k, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(device, dtype)
    logits = torch.randn(T, E, generator=g)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(device, dtype)
    return hidden, topk_ids.to(device), topk_weights.to(device), w1, w2


def forward_backward(fn, hidden, topk_ids, topk_weights, w1, w2):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, w1, w2)]
    out = fn(leaves[0], topk_ids, topk_weights, leaves[1], leaves[2])
    out.float().square().mean().backward()
    return out.detach(), [t.grad for t in leaves]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    # GPU: the Qwen3-30B-A3B expert shapes at 8192 tokens, large enough for the GPU, not the
    # host, to set the time. CPU: small enough to finish in seconds.
    T, H, I, E, k = (8192, 2048, 768, 128, 8) if cuda else (256, 64, 96, 8, 2)
    inputs = make_inputs(T, H, I, E, k, device, dtype)

    def block(matmul):
        return lambda h, ids, w, w1, w2: experts_mlp(h, ids, w, w1, w2, matmul)

    compiled = torch.compile(block(ours), fullgraph=True)
    # Reference: the same block in float64 with a per-expert loop of matmuls.
    ref_inputs = [t.double() if t.is_floating_point() else t for t in inputs]
    ref_out, ref_grads = forward_backward(block(per_expert_loop_mm), *ref_inputs)
    rows = []
    for name, fn in (("compiled_moe eager", block(ours)), ("compiled_moe compiled", compiled)):
        t0 = time.perf_counter()
        out, grads = forward_backward(fn, *inputs)
        first_call = time.perf_counter() - t0
        errs = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
        rows.append((name, errs, first_call))

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"MoE expert MLP: T={T} H={H} I={I} experts={E} top-{k} {str(dtype)[6:]} on {device}")
    print(f"{'path':24s} {'out':>9s} {'d hidden':>9s} {'d w1':>9s} {'d w2':>9s} {'1st call':>9s}")
    ok = True
    for name, errs, first in rows:
        ok &= all(e < tol for e in errs)
        print(f"{name:24s} " + " ".join(f"{e:9.2e}" for e in errs) + f" {first:8.2f}s")
    print(f"relative errors vs a float64 per-expert loop (tolerance {tol:g}): "
          f"{'OK' if ok else 'FAILED'}")

    if cuda:
        import triton

        print(f"\n{'forward+backward':28s} {'ms':>8s}")
        timings = {}
        for name, fn in (("torch._grouped_mm eager", block(torch_grouped_mm)),
                         ("torch._grouped_mm compiled",
                          torch.compile(block(torch_grouped_mm), fullgraph=True)),
                         ("compiled_moe eager", block(ours)),
                         ("compiled_moe compiled", compiled)):
            timings[name] = triton.testing.do_bench(
                lambda: forward_backward(fn, *inputs), return_mode="median")
            print(f"{name:28s} {timings[name]:8.3f}")
        base = timings["torch._grouped_mm compiled"]
        print(f"speedup of compiled_moe compiled over torch._grouped_mm compiled: "
              f"{base / timings['compiled_moe compiled']:.2f}x")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
