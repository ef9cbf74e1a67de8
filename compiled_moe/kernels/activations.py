"""Triton kernels of the MoE activations (DESIGN.md section 3), forward and backward.

One program reads a tile of FC1's output (gate and up columns of the same output index
together, for either gate/up layout), computes in fp32 and writes the activation; the backward
reads the same tile and the incoming gradient once and writes both halves of the gradient, and
for the fused MLP also the recomputed activation and the gradient of the routing probabilities.
The per-activation math lives in @triton.jit functions so that GEMM epilogues can reuse it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compiled_moe.kernels import traceable

from compiled_moe.kernels.configs import activation_config, size_hint
from compiled_moe.reference import ACTIVATION_CODES

# Activation codes (constexpr in the kernels).
CODES = ACTIVATION_CODES
GATED = (0, 1, 2)



@triton.jit
def _gelu_tanh_and_grad(x):
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = 2.0 * tl.sigmoid(2.0 * z) - 1.0  # tanh(z)
    value = 0.5 * x * (1.0 + t)
    grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    return value, grad


@triton.jit
def gated_forward(g, u, ACT: tl.constexpr, alpha, limit):
    """act(g, u) for the gated activations, fp32 in and out."""
    if ACT == 0:  # swiglu
        out = g * tl.sigmoid(g) * u
    elif ACT == 1:  # geglu
        v, _ = _gelu_tanh_and_grad(g)
        out = v * u
    else:  # gpt_oss
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        out = gc * tl.sigmoid(alpha * gc) * (uc + 1.0)
    return out


@triton.jit
def gated_backward(g, u, da, ACT: tl.constexpr, alpha, limit):
    """(d g, d u) of the gated activations given d act, fp32."""
    if ACT == 0:  # swiglu
        s = tl.sigmoid(g)
        silu = g * s
        dg = da * u * s * (1.0 + g * (1.0 - s))
        du = da * silu
    elif ACT == 1:  # geglu
        v, dv = _gelu_tanh_and_grad(g)
        dg = da * u * dv
        du = da * v
    else:  # gpt_oss; clamp passes the gradient where the value is inside [min, max]
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        dg = tl.where(g <= limit, da * (uc + 1.0) * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * gc * s, 0.0)
    return dg, du


@triton.jit
def plain_forward(x, ACT: tl.constexpr):
    if ACT == 3:  # relu2
        r = tl.maximum(x, 0.0)
        out = r * r
    elif ACT == 4:  # gelu (erf)
        out = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:  # silu
        out = x * tl.sigmoid(x)
    return out


@triton.jit
def plain_backward(x, da, ACT: tl.constexpr):
    if ACT == 3:  # relu2
        dx = 2.0 * tl.maximum(x, 0.0) * da
    elif ACT == 4:  # gelu (erf)
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        dx = da * (cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327)
    else:  # silu
        s = tl.sigmoid(x)
        dx = da * s * (1.0 + x * (1.0 - s))
    return dx


@triton.jit
def _load_gate_up(h_rows, row_ok, n0, I, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 gate and up values of output columns n0 + [0, BLOCK_N) of FC1 output rows
    (``h_rows``: a (BLOCK_M, 1) block of row pointers).

    Interleaved: one load of the 2 * BLOCK_N contiguous columns, split in registers (two
    stride-2 loads would each fetch every sector twice)."""
    if INTERLEAVED:
        cols = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
        hw = tl.load(h_rows + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < 2 * I),
                     other=0.0).to(tl.float32)
        g, u = tl.split(hw.reshape(hw.shape[0], BLOCK_N, 2))
    else:
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols[None, :] < I)
        g = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_rows + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _activation_kernel(h_ptr, grad_ptr, out_ptr, act_ptr, probs_ptr, dprobs_ptr, M, I,
                       stride_h, stride_grad, stride_out, stride_act, alpha, limit,
                       ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                       BACKWARD: tl.constexpr, RECOMPUTE: tl.constexpr, HAS_PROBS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Forward: out (M, I) = act(h) (* probs). Backward: out (M, N1) = d act / d h * grad (M, I), with
    grad scaled by probs (M,) when given, and optionally in the same pass (h read once):
    act (M, I) = act(h) (* probs) and dprobs (M,) = <grad, act(h)> per row (fp32).

    Programs own BLOCK_M rows and BLOCK_N output columns; in backward with probs, every column
    of their rows (the grid has one column program), so dprobs is a whole row's sum in a fixed
    order.
    """
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    rm64 = rm[:, None].to(tl.int64)
    h_rows = h_ptr + rm64 * stride_h
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(tl.program_id(1) * BLOCK_N, I, tl.num_programs(1) * BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (rn[None, :] < I)
        if GATED:
            g, u = _load_gate_up(h_rows, row_ok, n0, I, INTERLEAVED, BLOCK_N)
        else:
            g = tl.load(h_rows + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            u = g
        if BACKWARD and not RECOMPUTE and not HAS_PROBS:
            a = g  # unused
        elif GATED:
            a = gated_forward(g, u, ACT, alpha, limit)
        else:
            a = plain_forward(g, ACT)
        if BACKWARD:
            da = tl.load(grad_ptr + rm64 * stride_grad + rn[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            if HAS_PROBS:
                p = tl.load(probs_ptr + rm, mask=row_ok, other=0.0).to(tl.float32)[:, None]
                dot += tl.sum(da * a, 1)
                da = da * p
                a = a * p
            if RECOMPUTE:
                tl.store(act_ptr + rm64 * stride_act + rn[None, :],
                         a.to(act_ptr.dtype.element_ty), mask=mask)
            out_rows = out_ptr + rm64 * stride_out
            if GATED:
                dg, du = gated_backward(g, u, da, ACT, alpha, limit)
                dtype = out_ptr.dtype.element_ty
                if INTERLEAVED:
                    cols = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
                    tl.store(out_rows + cols[None, :],
                             tl.join(dg, du).reshape(BLOCK_M, 2 * BLOCK_N).to(dtype),
                             mask=row_ok[:, None] & (cols[None, :] < 2 * I))
                else:
                    tl.store(out_rows + rn[None, :], dg.to(dtype), mask=mask)
                    tl.store(out_rows + I + rn[None, :], du.to(dtype), mask=mask)
            else:
                tl.store(out_rows + rn[None, :],
                         plain_backward(g, da, ACT).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            if HAS_PROBS:
                a = a * tl.load(probs_ptr + rm, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rm64 * stride_out + rn[None, :], a.to(out_ptr.dtype.element_ty),
                     mask=mask)
    if BACKWARD and HAS_PROBS:
        tl.store(dprobs_ptr + rm, dot, mask=row_ok)


def _launch(h, grad, out, activation, gate_up_layout, alpha, limit, backward, act_out=None,
            probs=None, dprobs=None):
    act = CODES[activation]
    M = h.shape[0]
    inter = grad.shape[1] if backward else out.shape[1]
    if M == 0 or inter == 0:
        return
    if h.stride(-1) != 1:
        h = h.contiguous()
    if grad is not None and grad.stride(-1) != 1:
        grad = grad.contiguous()
    cfg = activation_config(size_hint(inter), h.device.type)
    has_probs = probs is not None
    # Backward with probs: one column program a row block, so dprobs sums in a fixed order.
    grid = (triton.cdiv(M, cfg.block_m),
            1 if has_probs and backward else triton.cdiv(inter, cfg.block_n))
    traceable(_activation_kernel)[grid](
        h, grad if backward else h, out, act_out if act_out is not None else out,
        probs.contiguous() if has_probs else h, dprobs if has_probs else h, M, inter,
        h.stride(0), grad.stride(0) if backward else 0, out.stride(0),
        act_out.stride(0) if act_out is not None else 0, float(alpha), float(limit),
        ACT=act, GATED=act in GATED, INTERLEAVED=gate_up_layout == "interleaved",
        BACKWARD=backward, RECOMPUTE=act_out is not None, HAS_PROBS=has_probs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )


def activation_forward(h: torch.Tensor, out: torch.Tensor, activation: str, gate_up_layout: str,
                       alpha: float, limit: float, probs: torch.Tensor | None = None) -> None:
    """out (M, I) = act(h (M, N1)) (* probs (M,))."""
    _launch(h, None, out, activation, gate_up_layout, alpha, limit, backward=False, probs=probs)


def activation_backward(grad: torch.Tensor, h: torch.Tensor, out: torch.Tensor, activation: str,
                        gate_up_layout: str, alpha: float, limit: float,
                        act_out: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                        dprobs: torch.Tensor | None = None) -> None:
    """out (M, N1) = gradient of act at h, times grad (M, I) (* probs (M,)).

    act_out (M, I), when given, receives act(h) (* probs), and dprobs (M,) fp32, with probs,
    <grad, act(h)> per row: the FC2 backward of the fused MLP in one pass over h."""
    _launch(h, grad, out, activation, gate_up_layout, alpha, limit, backward=True,
            act_out=act_out, probs=probs, dprobs=dprobs)
