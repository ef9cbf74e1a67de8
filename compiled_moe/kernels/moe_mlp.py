"""Triton kernel of the fused MoE MLP: FC1 with the activation in its epilogue.

mlp_fc1:        h = x[rows] @ w1[g]^T (+ b1[g]);  out = act(h) (* probs)      forward
                x rows are read through the routing map (no permuted copy of the input), and
                the gate and up columns of one output index come out of the same program, so
                the activation runs on the accumulators before anything is written.

It uses the persistent, device-side tile schedule of the grouped GEMM (kernels/grouped_mm.py)
and, like every kernel of the package, writes zeros in rows past offs[-1]. Backward needs no
kernel of its own: FC2's input gradient is the grouped GEMM and the activation backward runs in
kernels/activations.py (see ops/moe_mlp.py for why it is not in the GEMM's epilogue).
h holds FC1's output rounded to the input dtype, and the activation is computed from those
rounded values: the forward and the recomputation in backward see the same numbers, and the
results match the unfused path (grouped_mm, then moe_activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compiled_moe.kernels import traceable

from compiled_moe.kernels.activations import CODES, GATED, gated_forward, plain_forward
from compiled_moe.kernels.configs import mlp_fc1_config, size_hint
from compiled_moe.kernels.grouped_mm import (_device_index, _input_precision, _num_sms,
                                             _pad_groups, _row_tile, _row_tile_schedule,
                                             _store_rows, _use_tma)


@triton.jit
def _store_wide(out_ptr, out_desc, full, row0, rm, row_end, col0, I, stride_om, wide, up,
                TMA: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                W_COLS: tl.constexpr):
    """Write an FC1-shaped tile to its columns of an (M, N1) tensor: ``wide`` holds W_COLS
    columns from col0 (interleaved: gate and up together), ``up`` the up columns (stacked).
    A tile whole inside its group goes out by TMA (asynchronous); the group's last tile must
    not write the next group's rows and is stored with a row mask."""
    wn0 = 2 * col0 if (GATED and INTERLEAVED) else col0
    if TMA and full:
        out_desc.store([row0, wn0], wide)
        if GATED and not INTERLEAVED:
            out_desc.store([row0, I + col0], up)
    else:
        limit = 2 * I if (GATED and INTERLEAVED) else I
        _store_rows(out_ptr, rm, wn0 + tl.arange(0, W_COLS), row_end, limit, stride_om, 1, wide)
        if GATED and not INTERLEAVED:
            _store_rows(out_ptr + I, rm, col0 + tl.arange(0, W_COLS), row_end, I, stride_om, 1, up)


@triton.jit
def _store_tile(out_ptr, out_desc, full, row0, rm, row_end, col0, N, stride_om, c,
                TMA: tl.constexpr, BLOCK_N: tl.constexpr):
    if TMA and full:
        out_desc.store([row0, col0], c)
    else:
        _store_rows(out_ptr, rm, col0 + tl.arange(0, BLOCK_N), row_end, N, stride_om, 1, c)


@triton.jit
def _rows_tile(desc, ptr, row0, rows, row_ok, k0, K, stride_m, stride_k, TMA: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """(BLOCK_M, BLOCK_K) tile of the row operand: by TMA from row0, or the given rows (masked
    by row_ok) by pointers."""
    if TMA:
        # Rows of the next group ride along in the last M tile; they are not stored.
        return desc.load([row0, k0])
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride_m + rk[None, :] * stride_k,
                   mask=row_ok[:, None] & (rk[None, :] < K), other=0.0)


@triton.jit
def _weight_tile(desc, base, g, n0, k0, N, K, stride_n, stride_k, TMA: tl.constexpr,
                 K_CONTIGUOUS: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_K, COLS) tile of a group's weight seen as (K, N), columns from n0: by TMA over
    (G, N, K) (K_CONTIGUOUS) or (G, K, N), else by pointers from the group's base."""
    if TMA:
        if K_CONTIGUOUS:
            return desc.load([g, n0, k0]).reshape(COLS, BLOCK_K).T
        return desc.load([g, k0, n0]).reshape(BLOCK_K, COLS)
    rn = n0 + tl.arange(0, COLS)
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(base + rn[None, :] * stride_n + rk[:, None] * stride_k,
                   mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)


@triton.jit
def _mlp_fc1_kernel(
    x_ptr, source_ptr, w_ptr, up_ptr, bias_ptr, probs_ptr, h_ptr, out_ptr, offs_ptr,
    M, I, K, G, top_k, num_pairs, alpha, limit,
    stride_xm, stride_xk,
    stride_wg, stride_wn, stride_wk,
    stride_ug, stride_un, stride_uk,
    stride_hm, stride_om, stride_bias_g,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, W_COLS: tl.constexpr,
    SEPARATE_UP: tl.constexpr,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, STORE_H: tl.constexpr,
    TMA_X: tl.constexpr, TMA_W: tl.constexpr, W_K_CONTIGUOUS: tl.constexpr,
    TMA_OUT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """out (M, I) = act(x[rows] @ w[g]^T + bias[g]) (* probs); h (M, N1) the pre-activation.

    w is FC1's weight (G, N1, K), any strides. SEPARATE_UP: w holds the gate rows alone
    (G, I, K) and up_ptr the up rows (G, I, K), with their own strides (w1 and w3 as two
    tensors); else up_ptr is unused. GATHER: sorted row r reads x[source[r] // top_k]
    (zeros where source[r] is not a pair index in [0, num_pairs): padding rows hold -1); else row
    r reads x[r]. Programs own BLOCK_N output columns and compute the gate and the up columns
    that feed them: W_COLS = 2 * BLOCK_N contiguous weight rows for interleaved gate/up, BLOCK_N
    rows at col0 and at I + col0 for stacked (or at col0 of the up tensor).
    """
    pid = tl.program_id(0)
    N1 = 2 * I if GATED else I
    NW = I if SEPARATE_UP else N1  # rows of w
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    starts, ends, m_tiles, tiles, tile_ends, num_n, group_tiles, rows_end = \
        _row_tile_schedule(ends, prev, M, I, BLOCK_M, BLOCK_N)
    x_desc = x_ptr  # placeholders where TMA is off: the helpers then use the pointers
    w_desc = w_ptr
    u_desc = up_ptr
    if TMA_X:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if TMA_W:
        if W_K_CONTIGUOUS:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, NW, K],
                                               strides=[stride_wg, stride_wn, 1],
                                               block_shape=[1, W_COLS, BLOCK_K])
            if SEPARATE_UP:
                u_desc = tl.make_tensor_descriptor(up_ptr, shape=[G, I, K],
                                                   strides=[stride_ug, stride_un, 1],
                                                   block_shape=[1, W_COLS, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, K, NW],
                                               strides=[stride_wg, stride_wk, 1],
                                               block_shape=[1, BLOCK_K, W_COLS])
            if SEPARATE_UP:
                u_desc = tl.make_tensor_descriptor(up_ptr, shape=[G, K, I],
                                                   strides=[stride_ug, stride_uk, 1],
                                                   block_shape=[1, BLOCK_K, W_COLS])

    h_desc = h_ptr
    out_desc = out_ptr
    if TMA_OUT:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, I], strides=[stride_om, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
        if STORE_H:
            h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N1], strides=[stride_hm, 1],
                                               block_shape=[BLOCK_M, W_COLS])

    for tile in tl.range(pid, group_tiles, NUM_SMS, warp_specialize=WARP_SPECIALIZE == 2):
        g, row0, m_end, pid_n = _row_tile(tile, g_vec, starts, ends, m_tiles, tiles, tile_ends,
                                          num_n, BLOCK_M, GROUP_M)
        col0 = pid_n * BLOCK_N
        wn0 = 2 * col0 if (GATED and INTERLEAVED) else col0
        rm = row0 + tl.arange(0, BLOCK_M)
        rw = tl.arange(0, W_COLS)
        row_ok = rm < m_end
        if GATHER:
            src = tl.load(source_ptr + rm, mask=row_ok, other=-1)
            row_ok = (src >= 0) & (src < num_pairs)
            x_rows = tl.where(row_ok, src, 0) // top_k
        else:
            x_rows = rm
        acc_g = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        for k0 in range(0, K, BLOCK_K):
            a = _rows_tile(x_desc, x_ptr, row0, x_rows, row_ok, k0, K, stride_xm, stride_xk,
                           TMA_X, BLOCK_K)
            wg = _weight_tile(w_desc, w_base, g, wn0, k0, NW, K, stride_wn, stride_wk, TMA_W,
                              W_K_CONTIGUOUS, W_COLS, BLOCK_K)
            acc_g = tl.dot(a, wg, acc_g, input_precision=INPUT_PRECISION)
            if SEPARATE_UP:
                wu = _weight_tile(u_desc, up_ptr + g.to(tl.int64) * stride_ug, g, col0, k0, I, K,
                                  stride_un, stride_uk, TMA_W, W_K_CONTIGUOUS, W_COLS, BLOCK_K)
                acc_u = tl.dot(a, wu, acc_u, input_precision=INPUT_PRECISION)
            elif GATED and not INTERLEAVED:
                wu = _weight_tile(w_desc, w_base, g, I + col0, k0, N1, K, stride_wn, stride_wk,
                                  TMA_W, W_K_CONTIGUOUS, W_COLS, BLOCK_K)
                acc_u = tl.dot(a, wu, acc_u, input_precision=INPUT_PRECISION)

        if HAS_BIAS:
            bias_row = bias_ptr + g.to(tl.int64) * stride_bias_g
            acc_g += tl.load(bias_row + wn0 + rw, mask=wn0 + rw < N1, other=0.0).to(tl.float32)[None, :]
            if GATED and not INTERLEAVED:
                acc_u += tl.load(bias_row + I + col0 + rw, mask=I + col0 + rw < N1,
                                 other=0.0).to(tl.float32)[None, :]
        # Round to the input dtype first: the activation sees what h holds (see module doc).
        hw = acc_g.to(h_ptr.dtype.element_ty)
        hw_u = acc_u.to(h_ptr.dtype.element_ty)
        full = row0 + BLOCK_M <= m_end
        if STORE_H:
            _store_wide(h_ptr, h_desc, full, row0, rm, m_end, col0, I, stride_hm, hw, hw_u,
                        TMA_OUT, GATED, INTERLEAVED, W_COLS)
        hg = hw.to(tl.float32)
        hu = hw_u.to(tl.float32)
        if GATED and INTERLEAVED:
            hg, hu = tl.split(hg.reshape(BLOCK_M, BLOCK_N, 2))
        if GATED:
            act = gated_forward(hg, hu, ACT, alpha, limit)
        else:
            act = plain_forward(hg, ACT)
        if HAS_PROBS:
            p = tl.load(probs_ptr + rm, mask=rm < m_end, other=0.0).to(tl.float32)
            act = act * p[:, None]
        _store_tile(out_ptr, out_desc, full, row0, rm, m_end, col0, I, stride_om,
                    act.to(out_ptr.dtype.element_ty), TMA_OUT, BLOCK_N)

    # Rows past the last group are zeros.
    tail_tiles = tl.cdiv(M - rows_end, BLOCK_M) * num_n
    zeros_h = tl.zeros((BLOCK_M, W_COLS), dtype=h_ptr.dtype.element_ty)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for local in range(pid, tail_tiles, NUM_SMS):
        rm = rows_end + (local // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        col0 = (local % num_n) * BLOCK_N
        if STORE_H:
            _store_wide(h_ptr, h_desc, False, 0, rm, M, col0, I, stride_hm, zeros_h, zeros_h,
                        False, GATED, INTERLEAVED, W_COLS)
        _store_rows(out_ptr, rm, col0 + tl.arange(0, BLOCK_N), M, I, stride_om, 1, zeros)


# ----------------------------------------------------------------------------------------
# Launchers


def _weight_k_contiguous(w: torch.Tensor) -> bool:
    """w (G, N, K): True for an nn.Linear-style tensor (K innermost), False for a transposed view."""
    return w.stride(2) == 1 and w.stride(1) != 1


def _epilogue_tma(cfg, inter: int, contiguous_gate_up: bool, *tensors) -> bool:
    """TMA loads and stores of the epilogue's tiles when the tile config asks for them and the
    tensors allow them; stacked gate tiles must not reach into the up half, so I must then be
    a multiple of BLOCK_N."""
    return (bool(cfg.epilogue_tma) and (contiguous_gate_up or inter % cfg.block_n == 0)
            and _use_tma(*tensors))


def mlp_fc1(x: torch.Tensor, source: torch.Tensor | None, top_k: int, w1: torch.Tensor,
            offs: torch.Tensor, bias: torch.Tensor | None, probs: torch.Tensor | None,
            h: torch.Tensor | None, out: torch.Tensor, activation: str, gate_up_layout: str,
            alpha: float, limit: float, w3: torch.Tensor | None = None) -> None:
    """out (M, I) = act(x[rows] @ w1[g]^T (+ bias[g])) (* probs); h (M, N1) when given.

    w1: (G, N1, K), any strides; or, with w3, w1 the gate rows (G, I, K) and w3 the up rows
    (stacked gate/up). source: (M,) with rows read from x[source // top_k], or None (x is
    already sorted, M rows)."""
    M, inter = out.shape
    K = x.shape[1]
    G, n1, _ = w1.shape
    G = int(G)  # specialised under torch.compile: G_PAD is a constexpr
    if M == 0 or inter == 0:
        return
    act = CODES[activation]
    gated = act in GATED
    interleaved = gated and gate_up_layout == "interleaved"
    offs = offs.contiguous()
    cfg = mlp_fc1_config(size_hint(inter), size_hint(K), gated, interleaved, x.dtype,
                         x.device.type)
    w_cols = 2 * cfg.block_n if interleaved else cfg.block_n
    k_contig = _weight_k_contiguous(w1)
    if w3 is not None and _weight_k_contiguous(w3) != k_contig:
        # One storage order for both weights (the tile loads share it); a copy, for callers
        # whose two weights are laid out differently.
        w3 = w3.contiguous() if k_contig else w3.transpose(1, 2).contiguous().transpose(1, 2)
    inner = [w if k_contig else w.transpose(1, 2) for w in (w1, w3) if w is not None]
    tma_x = K > 0 and source is None and _use_tma(x)
    tma_w = K > 0 and _use_tma(*inner)
    tma_out = _epilogue_tma(cfg, inter, interleaved or not gated, out,
                            *([h] if h is not None else []))
    num_programs = _num_sms(_device_index(x)) * cfg.ctas_per_sm
    traceable(_mlp_fc1_kernel)[(num_programs,)](
        x, source if source is not None else offs, w1, w3 if w3 is not None else w1,
        bias if bias is not None else out,
        probs if probs is not None else out, h if h is not None else out, out, offs,
        M, inter, K, G, max(top_k, 1), x.shape[0] * top_k, float(alpha), float(limit),
        x.stride(0), x.stride(1),
        w1.stride(0), w1.stride(1), w1.stride(2),
        *(w3 if w3 is not None else w1).stride(),
        h.stride(0) if h is not None else 0, out.stride(0),
        bias.stride(0) if bias is not None else 0,
        G_PAD=_pad_groups(G),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, ACT=act, GATED=gated, INTERLEAVED=interleaved, W_COLS=w_cols,
        SEPARATE_UP=w3 is not None,
        GATHER=source is not None, HAS_BIAS=bias is not None, HAS_PROBS=probs is not None,
        STORE_H=h is not None, TMA_X=tma_x, TMA_W=tma_w, W_K_CONTIGUOUS=k_contig,
        TMA_OUT=tma_out, WARP_SPECIALIZE=cfg.warp_specialize,
        INPUT_PRECISION=_input_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
