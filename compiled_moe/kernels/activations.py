"""Triton kernels of the MoE activations (DESIGN.md section 3), forward and backward.

One program reads a tile of FC1's output (gate and up columns of the same output index
together, for either gate/up layout), computes in fp32 and writes the activation; the backward
reads the same tile and the incoming gradient once and writes both halves of the gradient.
The per-activation math lives in @triton.jit functions so that GEMM epilogues can reuse it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from compiled_moe.kernels.configs import activation_config, size_hint

# Activation codes (constexpr in the kernels).
CODES = {"swiglu": 0, "geglu": 1, "gpt_oss": 2, "relu2": 3, "gelu": 4, "silu": 5}
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
def _activation_kernel(h_ptr, grad_ptr, out_ptr, M, I, stride_h, stride_grad, stride_out,
                       alpha, limit, ACT: tl.constexpr, GATED: tl.constexpr,
                       INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Forward: out (M, I) = act(h). Backward: out (M, N1) = d act / d h * grad (M, I)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < I)
    rows = rm[:, None].to(tl.int64)
    if GATED:
        if INTERLEAVED:
            g_col = 2 * rn[None, :]
            u_col = g_col + 1
        else:
            g_col = rn[None, :]
            u_col = g_col + I
        g = tl.load(h_ptr + rows * stride_h + g_col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + rows * stride_h + u_col, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            da = tl.load(grad_ptr + rows * stride_grad + rn[None, :], mask=mask, other=0.0)
            dg, du = gated_backward(g, u, da.to(tl.float32), ACT, alpha, limit)
            tl.store(out_ptr + rows * stride_out + g_col, dg.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out_ptr + rows * stride_out + u_col, du.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            a = gated_forward(g, u, ACT, alpha, limit)
            tl.store(out_ptr + rows * stride_out + rn[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(h_ptr + rows * stride_h + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            da = tl.load(grad_ptr + rows * stride_grad + rn[None, :], mask=mask, other=0.0)
            dx = plain_backward(x, da.to(tl.float32), ACT)
            tl.store(out_ptr + rows * stride_out + rn[None, :], dx.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            a = plain_forward(x, ACT)
            tl.store(out_ptr + rows * stride_out + rn[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(h, grad, out, activation, gate_up_layout, alpha, limit, backward):
    act = CODES[activation]
    M = h.shape[0]
    inter = out.shape[1] if not backward else (grad.shape[1])
    if M == 0 or inter == 0:
        return
    if h.stride(-1) != 1:
        h = h.contiguous()
    if grad is not None and grad.stride(-1) != 1:
        grad = grad.contiguous()
    cfg = activation_config(size_hint(inter), h.device.type)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(inter, cfg.block_n))
    wrap_triton(_activation_kernel)[grid](
        h, grad, out, M, inter, h.stride(0), grad.stride(0) if grad is not None else 0,
        out.stride(0), float(alpha), float(limit),
        ACT=act, GATED=act in GATED, INTERLEAVED=gate_up_layout == "interleaved",
        BACKWARD=backward, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )


def activation_forward(h: torch.Tensor, out: torch.Tensor, activation: str, gate_up_layout: str,
                       alpha: float, limit: float) -> None:
    """out (M, I) = act(h (M, N1))."""
    _launch(h, None, out, activation, gate_up_layout, alpha, limit, backward=False)


def activation_backward(grad: torch.Tensor, h: torch.Tensor, out: torch.Tensor, activation: str,
                        gate_up_layout: str, alpha: float, limit: float) -> None:
    """out (M, N1) = gradient of act at h, times grad (M, I)."""
    _launch(h, grad, out, activation, gate_up_layout, alpha, limit, backward=True)
