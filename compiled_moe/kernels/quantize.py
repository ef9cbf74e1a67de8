"""Triton kernels of grouped FP8 quantization (see ``reference.grouped_quantize`` for layouts).

Three kernels, each one launch for every group:
  _quantize_tiles_kernel          fixed blocks (1x128, 128x128, 1x32) of a (G, R, C) tensor
  _quantize_rows_kernel           one scale per whole row (fp8_rowwise), two passes over the row
  _quantize_group_columns_kernel  2-D columnwise blocks that stop at group ends, optionally the
                                  rowwise blocks of the same tile too (x is read once for both)
The math (scale from amax, saturating cast) is in the jit helpers so that a GEMM epilogue can
reuse it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch.library import wrap_triton

from compiled_moe import reference
from compiled_moe.kernels.configs import quantize_config
from compiled_moe.kernels.grouped_mm import _max_combine, _pad_groups, _pick

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def abs_nan_as_inf(x):
    """|x| with NaN counted as +Inf, so a block's amax shows any non-finite value."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def scale_from_amax(amax, E8M0: tl.constexpr):
    """fp32 amax/448 (1 for a zero block), or the round-up E8M0 byte (255 if amax is Inf)."""
    if E8M0:
        bits = amax.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        exp = exp - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        exp = tl.minimum(tl.maximum(exp, -127), 127)
        return tl.where(amax < float("inf"), exp + 127, 255).to(tl.uint8)
    else:
        return tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, FP8_MAX))


@triton.jit
def e8m0_to_float(byte):
    """E8M0 bytes -> fp32 2^(byte-127); byte 0 is 2^-127 (a subnormal), 255 NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    return tl.where(b == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def quantize_values(x, scale, E8M0: tl.constexpr):
    """e4m3 of x (fp32) under scale (broadcast to x): x / scale, or x * 2^-e exactly for E8M0."""
    if E8M0:
        exp = scale.to(tl.int32) - 127
        inv = (tl.minimum(tl.maximum(127 - exp, 1), 254) << 23).to(tl.float32, bitcast=True)
        q = tl.where(scale == 255, 0.0, x * inv)
    else:
        q = tl.math.div_rn(x, scale)
    q = _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)).to(tl.float8e4nv)
    # Non-finite inputs give the e4m3 NaN byte (the interpreter's cast does not make NaN).
    bits = tl.where(tl.abs(x) < float("inf"), q.to(tl.uint8, bitcast=True), 0x7F)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _round_to_e4m3(q):
    """q (finite, |q| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32.

    The cast that follows is then exact everywhere: the Triton interpreter's own fp32 -> e4m3
    cast rounds ties away and can lose a binade when rounding carries into the exponent.
    """
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    sub = (q + 24576.0) - 24576.0  # 1.5 * 2^14: fp32 spacing 2^-9, e4m3's subnormal step
    sub = tl.where(q < 0, -tl.abs(sub), tl.abs(sub))  # keep the sign of a zero
    return tl.where(tl.abs(q) < 0.015625, sub, normal)  # 2^-6: smallest e4m3 normal


@triton.jit
def _quantize_tiles_kernel(
    x_ptr, q_ptr, s_ptr, R, C,
    stride_xg, stride_xr, stride_xc,
    stride_qg, stride_qr, stride_qc,
    stride_sg, stride_sr, stride_sc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, E8M0: tl.constexpr,
):
    """Blocks of SCALE_R x SCALE_C of x[g] (R, C); a program quantizes one BLOCK_R x BLOCK_C tile."""
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    num_c = tl.cdiv(C, BLOCK_C)
    pr = pid // num_c
    pc = pid % num_c
    rr = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rr[:, None] < R) & (rc[None, :] < C)
    x = tl.load(x_ptr + g * stride_xg + rr[:, None].to(tl.int64) * stride_xr + rc[None, :] * stride_xc,
                mask=inside, other=0.0).to(tl.float32)
    NR: tl.constexpr = BLOCK_R // SCALE_R
    NC: tl.constexpr = BLOCK_C // SCALE_C
    blocks = abs_nan_as_inf(x).reshape(NR, SCALE_R, NC, SCALE_C)
    scale = scale_from_amax(tl.max(tl.max(blocks, 3), 1), E8M0)  # (NR, NC)
    full = tl.broadcast_to(scale[:, None, :, None], (NR, SCALE_R, NC, SCALE_C))
    q = quantize_values(x, full.reshape(BLOCK_R, BLOCK_C), E8M0)
    tl.store(q_ptr + g * stride_qg + rr[:, None].to(tl.int64) * stride_qr + rc[None, :] * stride_qc,
             q, mask=inside)
    sr = pr * NR + tl.arange(0, NR)
    sc = pc * NC + tl.arange(0, NC)
    tl.store(s_ptr + g * stride_sg + sr[:, None] * stride_sr + sc[None, :] * stride_sc, scale,
             mask=(sr[:, None] < tl.cdiv(R, SCALE_R)) & (sc[None, :] < tl.cdiv(C, SCALE_C)))


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, R, C,
    stride_xg, stride_xr, stride_xc,
    stride_qg, stride_qr, stride_qc,
    stride_sg, stride_sr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One fp32 scale per row of x[g] (R, C): a pass for the amax, a pass to quantize."""
    g = tl.program_id(1).to(tl.int64)
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rr[:, None] < R
    x_rows = x_ptr + g * stride_xg + rr[:, None].to(tl.int64) * stride_xr
    q_rows = q_ptr + g * stride_qg + rr[:, None].to(tl.int64) * stride_qr
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        rc = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(x_rows + rc[None, :] * stride_xc, mask=row_ok & (rc[None, :] < C), other=0.0)
        amax = tl.maximum(amax, tl.max(abs_nan_as_inf(x.to(tl.float32)), 1))
    scale = scale_from_amax(amax, False)
    for c0 in range(0, C, BLOCK_C):
        rc = c0 + tl.arange(0, BLOCK_C)
        inside = row_ok & (rc[None, :] < C)
        x = tl.load(x_rows + rc[None, :] * stride_xc, mask=inside, other=0.0)
        tl.store(q_rows + rc[None, :] * stride_qc,
                 quantize_values(x.to(tl.float32), scale[:, None], False), mask=inside)
    tl.store(s_ptr + g * stride_sg + rr * stride_sr, scale, mask=rr < R)


@triton.jit
def _column_groups(offs_ptr, M, G, BLOCK_ROWS: tl.constexpr, G_PAD: tl.constexpr):
    """Groups 0..G-1 and the rows past the last group as group G: their first row, end row and
    first columnwise slot (blocks of BLOCK_ROWS rows; BLOCK_ROWS 0: one slot per group)."""
    g = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g, mask=g < G, other=0)
    ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), M), 0, _max_combine)
    ends = tl.where(g >= G, M, ends)
    prev = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= G), other=0)
    starts = tl.associative_scan(tl.minimum(tl.maximum(prev, 0), M), 0, _max_combine)
    starts = tl.where(g > G, M, starts)
    if BLOCK_ROWS == 0:
        blocks = (g <= G).to(tl.int32)
    else:
        blocks = (ends - starts + BLOCK_ROWS - 1) // BLOCK_ROWS
    return g, starts, ends, tl.cumsum(blocks, 0) - blocks, blocks


@triton.jit
def _quantize_group_columns_kernel(
    x_ptr, offs_ptr, cq_ptr, cs_ptr, rq_ptr, rs_ptr,
    M, K, G,
    stride_xm, stride_xk,
    stride_cqk, stride_cqm, stride_csk, stride_css,
    stride_rqm, stride_rqk, stride_rsm, stride_rsk,
    G_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr, ROWWISE: tl.constexpr, E8M0: tl.constexpr,
):
    """Columnwise blocks of BLOCK_ROWS rows of x (M, K) that never cross a group's end, stored
    transposed (col data (K, M), col scale (K, slots)); with ROWWISE, also the 1 x ROW_BLOCK
    rowwise blocks of the same tile. One program per (slot, BLOCK_K columns); slots past the
    last block are zero blocks."""
    slot = tl.program_id(0)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    g_vec, starts, ends, first, blocks = _column_groups(offs_ptr, M, G, BLOCK_ROWS, G_PAD)
    used = tl.sum(blocks, 0)
    if slot >= used:
        unused = scale_from_amax(tl.zeros((BLOCK_K,), dtype=tl.float32), E8M0)
        tl.store(cs_ptr + rk * stride_csk + slot * stride_css, unused, mask=rk < K)
    else:
        g = tl.sum((first + blocks <= slot).to(tl.int32), 0)
        row0 = _pick(g_vec, g, starts) + (slot - _pick(g_vec, g, first)) * BLOCK_ROWS
        row_end = _pick(g_vec, g, ends)
        rm = row0 + tl.arange(0, BLOCK_ROWS)
        inside = (rm[:, None] < row_end) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk,
                    mask=inside, other=0.0).to(tl.float32)
        scale = scale_from_amax(tl.max(abs_nan_as_inf(x), 0), E8M0)  # (BLOCK_K,)
        tl.store(cq_ptr + rk[None, :].to(tl.int64) * stride_cqk + rm[:, None] * stride_cqm,
                 quantize_values(x, scale[None, :], E8M0), mask=inside)
        tl.store(cs_ptr + rk * stride_csk + slot * stride_css, scale, mask=rk < K)
        if ROWWISE:
            NB: tl.constexpr = BLOCK_K // ROW_BLOCK
            blk = abs_nan_as_inf(x).reshape(BLOCK_ROWS, NB, ROW_BLOCK)
            row_scale = scale_from_amax(tl.max(blk, 2), E8M0)  # (BLOCK_ROWS, NB)
            full = tl.broadcast_to(row_scale[:, :, None], (BLOCK_ROWS, NB, ROW_BLOCK))
            q = quantize_values(x, full.reshape(BLOCK_ROWS, BLOCK_K), E8M0)
            tl.store(rq_ptr + rm[:, None].to(tl.int64) * stride_rqm + rk[None, :] * stride_rqk,
                     q, mask=inside)
            sb = tl.program_id(1) * NB + tl.arange(0, NB)
            tl.store(rs_ptr + rm[:, None].to(tl.int64) * stride_rsm + sb[None, :] * stride_rsk,
                     row_scale,
                     mask=(rm[:, None] < row_end) & (sb[None, :] < tl.cdiv(K, ROW_BLOCK)))


@triton.jit
def _quantize_group_columns_whole_kernel(
    x_ptr, offs_ptr, cq_ptr, cs_ptr,
    M, K, G,
    stride_xm, stride_xk, stride_cqk, stride_cqm, stride_csk, stride_css,
    G_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp8_rowwise columnwise: one fp32 scale per (group, column), group G being the rows past
    the last group; a pass over the group's rows for the amax, a pass to quantize."""
    g = tl.program_id(0)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    g_vec, starts, ends, _, _ = _column_groups(offs_ptr, M, G, 0, G_PAD)
    m_start = _pick(g_vec, g, starts)
    m_end = _pick(g_vec, g, ends)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_ROWS):
        rm = m0 + tl.arange(0, BLOCK_ROWS)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk,
                    mask=(rm[:, None] < m_end) & (rk[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(abs_nan_as_inf(x.to(tl.float32)), 0))
    scale = scale_from_amax(amax, False)
    for m0 in range(m_start, m_end, BLOCK_ROWS):
        rm = m0 + tl.arange(0, BLOCK_ROWS)
        inside = (rm[:, None] < m_end) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk,
                    mask=inside, other=0.0)
        tl.store(cq_ptr + rk[None, :].to(tl.int64) * stride_cqk + rm[:, None] * stride_cqm,
                 quantize_values(x.to(tl.float32), scale[None, :], False), mask=inside)
    tl.store(cs_ptr + rk * stride_csk + g * stride_css, scale, mask=rk < K)


# ----------------------------------------------------------------------------------------
# Launchers: outputs are allocated by the op (compiled_moe.ops.fp8) and filled here.


def quantize_tiles(x, q, s, recipe: str, weight: bool) -> None:
    """Rowwise blocks of x (R, C) or (G, R, C) into q (same shape) and s (block grid)."""
    x3, q3, s3 = (t if t.dim() == 3 else t[None] for t in (x, q, s))
    num_groups, rows, cols = x3.shape
    if rows == 0 or cols == 0:
        return
    scale_r, scale_c = reference.fp8_block(recipe, weight)
    if scale_c == 0:
        cfg = quantize_config("rows", x.device.type)
        grid = (triton.cdiv(rows, cfg.block_m), num_groups)
        wrap_triton(_quantize_rows_kernel)[grid](
            x3, q3, s3, rows, cols, *x3.stride(), *q3.stride(), s3.stride(0), s3.stride(1),
            BLOCK_R=cfg.block_m, BLOCK_C=cfg.block_n, num_warps=cfg.num_warps)
        return
    cfg = quantize_config(f"tiles_{scale_r}x{scale_c}", x.device.type)
    block_r = max(cfg.block_m, scale_r)
    block_c = max(cfg.block_n, scale_c)
    grid = (triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c), num_groups)
    wrap_triton(_quantize_tiles_kernel)[grid](
        x3, q3, s3, rows, cols, *x3.stride(), *q3.stride(), *s3.stride(),
        BLOCK_R=block_r, BLOCK_C=block_c, SCALE_R=scale_r, SCALE_C=scale_c,
        E8M0=recipe == "mxfp8", num_warps=cfg.num_warps)


def quantize_group_columns(x, offs, col_q, col_s, row_q, row_s, recipe: str) -> None:
    """Columnwise blocks of 2-D x inside groups; with row_q/row_s also the rowwise blocks."""
    M, K = x.shape
    G = int(offs.shape[0])  # specialised under torch.compile: G_PAD is a constexpr
    if K == 0:
        return
    offs = offs.contiguous()
    block_rows = reference.fp8_column_block(recipe)
    if block_rows == 0:
        cfg = quantize_config("group_columns_whole", x.device.type)
        grid = (G + 1, triton.cdiv(K, cfg.block_n))
        wrap_triton(_quantize_group_columns_whole_kernel)[grid](
            x, offs, col_q, col_s, M, K, G, x.stride(0), x.stride(1),
            col_q.stride(0), col_q.stride(1), col_s.stride(0), col_s.stride(1),
            G_PAD=_pad_groups(G + 1), BLOCK_ROWS=cfg.block_m, BLOCK_K=cfg.block_n,
            num_warps=cfg.num_warps)
        return
    rowwise = row_q is not None
    _, row_block = reference.fp8_block(recipe)
    cfg = quantize_config(f"group_columns_{block_rows}", x.device.type)
    block_k = max(cfg.block_n, row_block)
    grid = (col_s.shape[1], triton.cdiv(K, block_k))
    rq, rs = (row_q, row_s) if rowwise else (col_q, col_s)
    wrap_triton(_quantize_group_columns_kernel)[grid](
        x, offs, col_q, col_s, rq, rs, M, K, G,
        x.stride(0), x.stride(1), col_q.stride(0), col_q.stride(1),
        col_s.stride(0), col_s.stride(1),
        rq.stride(0), rq.stride(1), rs.stride(0), rs.stride(1),
        G_PAD=_pad_groups(G + 1), BLOCK_ROWS=block_rows, BLOCK_K=block_k, ROW_BLOCK=row_block,
        ROWWISE=rowwise, E8M0=recipe == "mxfp8", num_warps=cfg.num_warps)
