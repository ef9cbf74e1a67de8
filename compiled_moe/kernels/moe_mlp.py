"""Triton kernels of the fused MoE MLP: the two GEMMs that carry the activation in their epilogues.

mlp_fc1:        h = x[rows] @ w1[g]^T (+ b1[g]);  out = act(h) (* probs)      forward
                x rows are read through the routing map (no permuted copy of the input), and
                the gate and up columns of one output index come out of the same program, so
                the activation runs on the accumulators before anything is written.
mlp_fc2_dgrad:  da = dy @ w2[g];  dh = act'(h) * (da * probs);  a = act(h) * probs;
                dprobs = <da, act(h)>                                          backward
                FC2's input gradient with the activation backward in its epilogue; the
                activation is recomputed from FC1's saved pre-activation h, not stored.

Both use the persistent, device-side tile schedule of the grouped GEMM (kernels/grouped_mm.py)
and, like every kernel of the package, write zeros in rows past offs[-1].
h holds FC1's output rounded to the input dtype, and the activation is computed from those
rounded values: the forward and the recomputation in backward see the same numbers, and the
results match the unfused path (grouped_mm, then moe_activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from compiled_moe.kernels.activations import (CODES, GATED, gated_backward, gated_forward,
                                              plain_backward, plain_forward)
from compiled_moe.kernels.configs import mlp_fc1_config, mlp_fc2_dgrad_config, size_hint
from compiled_moe.kernels.grouped_mm import (_device_index, _input_precision, _num_sms,
                                             _pad_groups, _row_tile, _row_tile_schedule,
                                             _store_rows, _use_tma)


@triton.jit
def _load_gate_up(h_ptr, h_desc, row0, rm, row_ok, col0, I, stride_hm, TMA: tl.constexpr,
                  GATED: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr,
                  W_COLS: tl.constexpr):
    """Gate and up values (fp32) of output columns col0 + [0, BLOCK_N) from an FC1 output h.

    Interleaved: one load of the 2 * BLOCK_N contiguous columns, then split. By TMA when
    allowed: a load in the accumulator's register layout from global memory is uncoalesced.
    """
    wn0 = 2 * col0 if (GATED and INTERLEAVED) else col0
    if TMA:
        hw = h_desc.load([row0, wn0])
        hu = hw
        if GATED and not INTERLEAVED:
            hu = h_desc.load([row0, I + col0])
    else:
        rows = rm[:, None].to(tl.int64) * stride_hm
        cols = wn0 + tl.arange(0, W_COLS)
        limit = 2 * I if (GATED and INTERLEAVED) else I
        mask = row_ok[:, None] & (cols[None, :] < limit)
        hw = tl.load(h_ptr + rows + cols[None, :], mask=mask, other=0.0)
        hu = hw
        if GATED and not INTERLEAVED:
            hu = tl.load(h_ptr + I + rows + cols[None, :], mask=mask, other=0.0)
    g = hw.to(tl.float32)
    u = hu.to(tl.float32)
    if GATED and INTERLEAVED:
        g, u = tl.split(g.reshape(g.shape[0], BLOCK_N, 2))
    return g, u


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
    x_ptr, source_ptr, w_ptr, bias_ptr, probs_ptr, h_ptr, out_ptr, offs_ptr,
    M, I, K, G, top_k, alpha, limit,
    stride_xm, stride_xk,
    stride_wg, stride_wn, stride_wk,
    stride_hm, stride_om, stride_bias_g,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, W_COLS: tl.constexpr,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr, STORE_H: tl.constexpr,
    TMA_X: tl.constexpr, TMA_W: tl.constexpr, W_K_CONTIGUOUS: tl.constexpr,
    TMA_OUT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """out (M, I) = act(x[rows] @ w[g]^T + bias[g]) (* probs); h (M, N1) the pre-activation.

    w is FC1's weight (G, N1, K), any strides. GATHER: sorted row r reads x[source[r] // top_k]
    (zeros where source[r] < 0); else row r reads x[r]. Programs own BLOCK_N output columns
    and compute the gate and the up columns that feed them: W_COLS = 2 * BLOCK_N contiguous
    weight rows for interleaved gate/up, BLOCK_N rows at col0 and at I + col0 for stacked.
    """
    pid = tl.program_id(0)
    N1 = 2 * I if GATED else I
    g_vec, starts, ends, m_tiles, tiles, tile_ends, num_n, group_tiles, rows_end = \
        _row_tile_schedule(offs_ptr, G, M, I, G_PAD, BLOCK_M, BLOCK_N)
    x_desc = x_ptr  # placeholders where TMA is off: the helpers then use the pointers
    w_desc = w_ptr
    if TMA_X:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if TMA_W:
        if W_K_CONTIGUOUS:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, N1, K],
                                               strides=[stride_wg, stride_wn, 1],
                                               block_shape=[1, W_COLS, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, K, N1],
                                               strides=[stride_wg, stride_wk, 1],
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
            row_ok = src >= 0
            x_rows = tl.maximum(src, 0) // top_k
        else:
            x_rows = rm
        acc_g = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        for k0 in range(0, K, BLOCK_K):
            a = _rows_tile(x_desc, x_ptr, row0, x_rows, row_ok, k0, K, stride_xm, stride_xk,
                           TMA_X, BLOCK_K)
            wg = _weight_tile(w_desc, w_base, g, wn0, k0, N1, K, stride_wn, stride_wk, TMA_W,
                              W_K_CONTIGUOUS, W_COLS, BLOCK_K)
            acc_g = tl.dot(a, wg, acc_g, input_precision=INPUT_PRECISION)
            if GATED and not INTERLEAVED:
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


@triton.jit
def _mlp_fc2_dgrad_kernel(
    dy_ptr, w_ptr, h_ptr, probs_ptr, dh_ptr, a_ptr, dprobs_ptr, offs_ptr,
    M, I, K, G, alpha, limit,
    stride_dym, stride_dyk,
    stride_wg, stride_wk, stride_wn,
    stride_hm, stride_dhm, stride_am, stride_pm,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_PROBS: tl.constexpr,
    W_COLS: tl.constexpr, TMA_DY: tl.constexpr, TMA_W: tl.constexpr,
    W_K_CONTIGUOUS: tl.constexpr, TMA_H: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """da = dy (M, K) @ w[g] (K, I) per group, then in the epilogue, from h (M, N1):
    dh = act'(h) * da * probs, a = act(h) * probs (FC2's weight-gradient operand) and the
    partial dot <da, act(h)> of every row over this program's columns (dprobs[r, pid_n]).

    w is FC2's weight seen as (G, K=H, N=I): the (G, H, I) nn.Linear tensor itself.
    """
    pid = tl.program_id(0)
    g_vec, starts, ends, m_tiles, tiles, tile_ends, num_n, group_tiles, rows_end = \
        _row_tile_schedule(offs_ptr, G, M, I, G_PAD, BLOCK_M, BLOCK_N)
    dy_desc = dy_ptr
    w_desc = w_ptr
    if TMA_DY:
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, K], strides=[stride_dym, 1],
                                            block_shape=[BLOCK_M, BLOCK_K])
    if TMA_W:
        if W_K_CONTIGUOUS:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, I, K],
                                               strides=[stride_wg, stride_wn, 1],
                                               block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, K, I],
                                               strides=[stride_wg, stride_wk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])

    N1 = 2 * I if GATED else I
    h_desc = h_ptr
    dh_desc = dh_ptr
    a_desc = a_ptr
    if TMA_H:
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N1], strides=[stride_hm, 1],
                                           block_shape=[BLOCK_M, W_COLS])
        dh_desc = tl.make_tensor_descriptor(dh_ptr, shape=[M, N1], strides=[stride_dhm, 1],
                                            block_shape=[BLOCK_M, W_COLS])
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, I], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])

    for tile in tl.range(pid, group_tiles, NUM_SMS, warp_specialize=WARP_SPECIALIZE == 2):
        g, row0, m_end, pid_n = _row_tile(tile, g_vec, starts, ends, m_tiles, tiles, tile_ends,
                                          num_n, BLOCK_M, GROUP_M)
        col0 = pid_n * BLOCK_N
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = col0 + tl.arange(0, BLOCK_N)
        row_ok = rm < m_end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        for k0 in range(0, K, BLOCK_K):
            d = _rows_tile(dy_desc, dy_ptr, row0, rm, row_ok, k0, K, stride_dym, stride_dyk,
                           TMA_DY, BLOCK_K)
            w = _weight_tile(w_desc, w_base, g, col0, k0, I, K, stride_wn, stride_wk, TMA_W,
                             W_K_CONTIGUOUS, BLOCK_N, BLOCK_K)
            acc = tl.dot(d, w, acc, input_precision=INPUT_PRECISION)

        hg, hu = _load_gate_up(h_ptr, h_desc, row0, rm, row_ok, col0, I, stride_hm, TMA_H, GATED,
                               INTERLEAVED, BLOCK_N, W_COLS)
        if GATED:
            act = gated_forward(hg, hu, ACT, alpha, limit)
        else:
            act = plain_forward(hg, ACT)
        if HAS_PROBS:
            p = tl.load(probs_ptr + rm, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(dprobs_ptr + rm.to(tl.int64) * stride_pm + pid_n, tl.sum(acc * act, 1),
                     mask=row_ok)
            acc = acc * p[:, None]
            act = act * p[:, None]
        if GATED:
            dg, du = gated_backward(hg, hu, acc, ACT, alpha, limit)
        else:
            dg = plain_backward(hg, acc, ACT)
            du = dg
        dtype = dh_ptr.dtype.element_ty
        if GATED and INTERLEAVED:
            dg = tl.join(dg, du).reshape(BLOCK_M, W_COLS)
        full = row0 + BLOCK_M <= m_end
        _store_wide(dh_ptr, dh_desc, full, row0, rm, m_end, col0, I, stride_dhm, dg.to(dtype),
                    du.to(dtype), TMA_H, GATED, INTERLEAVED, W_COLS)
        _store_tile(a_ptr, a_desc, full, row0, rm, m_end, col0, I, stride_am, act.to(dtype),
                    TMA_H, BLOCK_N)

    tail_tiles = tl.cdiv(M - rows_end, BLOCK_M) * num_n
    zeros_h = tl.zeros((BLOCK_M, W_COLS), dtype=dh_ptr.dtype.element_ty)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=a_ptr.dtype.element_ty)
    for local in range(pid, tail_tiles, NUM_SMS):
        rm = rows_end + (local // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        pid_n = local % num_n
        col0 = pid_n * BLOCK_N
        _store_wide(dh_ptr, dh_desc, False, 0, rm, M, col0, I, stride_dhm, zeros_h, zeros_h,
                    False, GATED, INTERLEAVED, W_COLS)
        _store_rows(a_ptr, rm, col0 + tl.arange(0, BLOCK_N), M, I, stride_am, 1, zeros)
        if HAS_PROBS:
            tl.store(dprobs_ptr + rm.to(tl.int64) * stride_pm + pid_n,
                     tl.zeros((BLOCK_M,), dtype=tl.float32), mask=rm < M)


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
            alpha: float, limit: float) -> None:
    """out (M, I) = act(x[rows] @ w1[g]^T (+ bias[g])) (* probs); h (M, N1) when given.

    w1: (G, N1, K), any strides. source: (M,) with rows read from x[source // top_k], or None
    (x is already sorted, M rows)."""
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
    cfg = mlp_fc1_config(size_hint(inter), size_hint(K), gated, x.dtype, x.device.type)
    w_cols = 2 * cfg.block_n if interleaved else cfg.block_n
    k_contig = _weight_k_contiguous(w1)
    w_inner = w1 if k_contig else w1.transpose(1, 2)
    tma_x = K > 0 and source is None and _use_tma(x)
    tma_w = K > 0 and _use_tma(w_inner)
    tma_out = _epilogue_tma(cfg, inter, interleaved or not gated, out,
                            *([h] if h is not None else []))
    num_programs = _num_sms(_device_index(x)) * cfg.ctas_per_sm
    wrap_triton(_mlp_fc1_kernel)[(num_programs,)](
        x, source if source is not None else offs, w1, bias if bias is not None else out,
        probs if probs is not None else out, h if h is not None else out, out, offs,
        M, inter, K, G, top_k, float(alpha), float(limit),
        x.stride(0), x.stride(1),
        w1.stride(0), w1.stride(1), w1.stride(2),
        h.stride(0) if h is not None else 0, out.stride(0),
        bias.stride(0) if bias is not None else 0,
        G_PAD=_pad_groups(G),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, ACT=act, GATED=gated, INTERLEAVED=interleaved, W_COLS=w_cols,
        GATHER=source is not None, HAS_BIAS=bias is not None, HAS_PROBS=probs is not None,
        STORE_H=h is not None, TMA_X=tma_x, TMA_W=tma_w, W_K_CONTIGUOUS=k_contig,
        TMA_OUT=tma_out, WARP_SPECIALIZE=cfg.warp_specialize,
        INPUT_PRECISION=_input_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def mlp_fc2_dgrad_columns(inter: int, dtype: torch.dtype, device_type: str) -> int:
    """Column tiles of mlp_fc2_dgrad: the width of its partial dprobs (M, tiles)."""
    return triton.cdiv(inter, mlp_fc2_dgrad_config(size_hint(inter), dtype, device_type).block_n)


def mlp_fc2_dgrad(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, offs: torch.Tensor,
                  probs: torch.Tensor | None, dh: torch.Tensor, a: torch.Tensor,
                  dprobs_partial: torch.Tensor | None, activation: str, gate_up_layout: str,
                  alpha: float, limit: float) -> None:
    """dh (M, N1), a (M, I) and dprobs_partial (M, tiles) from dy (M, H), w2 (G, H, I), h."""
    M, inter = a.shape
    K = dy.shape[1]
    G = int(w2.shape[0])
    if M == 0 or inter == 0:
        return
    act = CODES[activation]
    gated = act in GATED
    offs = offs.contiguous()
    cfg = mlp_fc2_dgrad_config(size_hint(inter), dy.dtype, dy.device.type)
    # w2 (G, H, I) is B = (G, K, N); its inner dimension is I for an nn.Linear tensor.
    k_contig = w2.stride(1) == 1 and w2.stride(2) != 1
    w_inner = w2.transpose(1, 2) if k_contig else w2
    tma_dy = K > 0 and _use_tma(dy)
    tma_w = K > 0 and _use_tma(w_inner)
    interleaved = gated and gate_up_layout == "interleaved"
    tma_h = _epilogue_tma(cfg, inter, interleaved or not gated, h, dh, a)
    num_programs = _num_sms(_device_index(dy)) * cfg.ctas_per_sm
    has_probs = probs is not None
    wrap_triton(_mlp_fc2_dgrad_kernel)[(num_programs,)](
        dy, w2, h, probs if has_probs else dy, dh, a,
        dprobs_partial if has_probs else dy, offs,
        M, inter, K, G, float(alpha), float(limit),
        dy.stride(0), dy.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        h.stride(0), dh.stride(0), a.stride(0),
        dprobs_partial.stride(0) if has_probs else 0,
        G_PAD=_pad_groups(G),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, ACT=act, GATED=gated, INTERLEAVED=interleaved,
        HAS_PROBS=has_probs, W_COLS=2 * cfg.block_n if interleaved else cfg.block_n,
        TMA_DY=tma_dy, TMA_W=tma_w, W_K_CONTIGUOUS=k_contig, TMA_H=tma_h,
        WARP_SPECIALIZE=cfg.warp_specialize, INPUT_PRECISION=_input_precision(dy.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
