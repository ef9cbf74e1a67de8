"""Triton kernels of the FP8 grouped GEMMs: forward/dgrad and weight gradient.

Operands come from ``grouped_quantize`` (layouts in ``reference.grouped_quantize``). Hopper's
FP8 tensor cores read both operands K-major, so the forward/dgrad kernel takes b as the
transposed view of a rowwise-quantized (G, N, K) weight, and the weight-gradient kernel takes
the columnwise (transposed) data of both operands.

Scale modes (SCALE_MODE):
  0 fp8_rowwise    products accumulate per BLOCK_K chunk in fp32, scales applied in the epilogue
  1 fp8_blockwise  every 128-deep chunk is one fp32 dot, scaled and added to the accumulator
                   (the promotion DeepSeek-V3 uses: Hopper's FP8 accumulation alone keeps
                   about 14 mantissa bits)
  2 mxfp8          the 1x32 E8M0 scales are applied by dequantizing each chunk to bf16 (exact:
                   e4m3 times a power of two fits bf16), then a bf16 dot: the numbers a
                   Blackwell MX GEMM gives, at bf16 speed
"""

from __future__ import annotations

import triton
import triton.language as tl
from compiled_moe.kernels import traceable

from compiled_moe import reference
from compiled_moe.kernels.configs import (
    scaled_grouped_mm_config,
    scaled_grouped_mm_wgrad_config,
    size_hint,
)
from compiled_moe.kernels.grouped_mm import (
    _INTERPRET,
    _device_index,
    _num_sms,
    _pad_groups,
    _pick,
    _row_tile,
    _row_tile_schedule,
    _store_rows,
    _use_tma,
)
from compiled_moe.kernels.quantize import _column_groups, e8m0_to_float

SCALE_MODES = {"fp8_rowwise": 0, "fp8_blockwise": 1, "mxfp8": 2}


@triton.jit
def _dequantize_mx(q, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr):
    """(ROWS, COLS) e4m3 times its (ROWS, COLS/32) E8M0 scales, in DTYPE (exact)."""
    s = e8m0_to_float(scale_bytes)
    v = q.to(tl.float32).reshape(ROWS, COLS // 32, 32) * s[:, :, None]
    return v.reshape(ROWS, COLS).to(DTYPE)


@triton.jit
def _scaled_grouped_mm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, bias_ptr, offs_ptr,
    M, N, K, G,
    stride_am, stride_bg, stride_bn,
    stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk,
    stride_om, stride_on, stride_bias_g, stride_bias_n,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, SCALE_MODE: tl.constexpr, USE_TMA: tl.constexpr,
    DEQUANT_DTYPE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """out[r] = a[r] @ b[g] (+ bias[g]) for rows r of group g, a (M, K) and b (G, K, N) both
    K-major; rows past the last group get 0. Persistent tile schedule of _grouped_mm_kernel."""
    pid = tl.program_id(0)
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    starts, ends, m_tiles, tiles, tile_ends, num_n, group_tiles, rows_end = \
        _row_tile_schedule(ends, prev, M, N, BLOCK_M, BLOCK_N)
    tail_tiles = tl.cdiv(M - rows_end, BLOCK_M) * num_n
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, N, K], strides=[stride_bg, stride_bn, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])

    for tile in tl.range(pid, group_tiles, NUM_SMS, warp_specialize=WARP_SPECIALIZE == 2):
        g, row0, m_end, pid_n = _row_tile(tile, g_vec, starts, ends, m_tiles, tiles, tile_ends,
                                          num_n, BLOCK_M, GROUP_M)
        col0 = pid_n * BLOCK_N
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = col0 + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE == 1):
            if USE_TMA:
                a = a_desc.load([row0, k0])
                bt = b_desc.load([g, col0, k0]).reshape(BLOCK_N, BLOCK_K)
            else:
                k_ok = rk[None, :] + k0 < K
                a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + (k0 + rk[None, :]),
                            mask=(rm[:, None] < m_end) & k_ok, other=0.0)
                bt = tl.load(b_ptr + g.to(tl.int64) * stride_bg + rn[:, None] * stride_bn
                             + (k0 + rk[None, :]), mask=(rn[:, None] < N) & k_ok, other=0.0)
            if SCALE_MODE == 0:
                acc += tl.dot(a, bt.T)
            elif SCALE_MODE == 1:
                kb = k0 // 128
                sa = tl.load(as_ptr + rm * stride_asm + kb * stride_ask, mask=rm < M, other=0.0)
                sb = tl.load(bs_ptr + g * stride_bsg + (rn // 128) * stride_bsn + kb * stride_bsk,
                             mask=rn < N, other=0.0)
                acc += tl.dot(a, bt.T) * (sa[:, None] * sb[None, :])
            else:
                kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                kb_ok = kb[None, :] < tl.cdiv(K, 32)
                sa = tl.load(as_ptr + rm[:, None] * stride_asm + kb[None, :] * stride_ask,
                             mask=(rm[:, None] < M) & kb_ok, other=127)
                sb = tl.load(bs_ptr + g * stride_bsg + rn[:, None] * stride_bsn
                             + kb[None, :] * stride_bsk, mask=(rn[:, None] < N) & kb_ok, other=127)
                a_v = _dequantize_mx(a, sa, BLOCK_M, BLOCK_K, DEQUANT_DTYPE)
                b_v = _dequantize_mx(bt, sb, BLOCK_N, BLOCK_K, DEQUANT_DTYPE)
                acc = tl.dot(a_v, b_v.T, acc)
        if SCALE_MODE == 0:
            sa = tl.load(as_ptr + rm * stride_asm, mask=rm < M, other=0.0)
            sb = tl.load(bs_ptr + g * stride_bsg + rn * stride_bsn, mask=rn < N, other=0.0)
            acc = acc * (sa[:, None] * sb[None, :])
        if HAS_BIAS:
            bias = tl.load(bias_ptr + g * stride_bias_g + rn * stride_bias_n, mask=rn < N,
                           other=0.0)
            acc += bias.to(tl.float32)[None, :]
        _store_rows(out_ptr, rm, rn, m_end, N, stride_om, stride_on,
                    acc.to(out_ptr.dtype.element_ty))

    for local in range(pid, tail_tiles, NUM_SMS):
        rm = rows_end + (local // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (local % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        _store_rows(out_ptr, rm, rn, M, N, stride_om, stride_on, zeros)


@triton.jit
def _wgrad_chunk(acc, a, d, as_ptr, ds_ptr, rk, rn, K, N, slot, slot_end,
                 stride_ask, stride_ass, stride_dsn, stride_dss,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 SCALE_MODE: tl.constexpr, DEQUANT_DTYPE: tl.constexpr):
    """acc (BLOCK_K, BLOCK_N) += a (BLOCK_K, BLOCK_M) @ d (BLOCK_N, BLOCK_M)^T, scaled; slot is
    the chunk's first columnwise scale slot, slot_end the group's end slot."""
    if SCALE_MODE == 0:
        acc += tl.dot(a, d.T)
    elif SCALE_MODE == 1:
        sa = tl.load(as_ptr + rk * stride_ask + slot * stride_ass, mask=rk < K, other=0.0)
        sd = tl.load(ds_ptr + rn * stride_dsn + slot * stride_dss, mask=rn < N, other=0.0)
        acc += tl.dot(a, d.T) * (sa[:, None] * sd[None, :])
    else:
        slots = slot + tl.arange(0, BLOCK_M // 32)
        s_ok = slots[None, :] < slot_end
        sa = tl.load(as_ptr + rk[:, None] * stride_ask + slots[None, :] * stride_ass,
                     mask=(rk[:, None] < K) & s_ok, other=127)
        sd = tl.load(ds_ptr + rn[:, None] * stride_dsn + slots[None, :] * stride_dss,
                     mask=(rn[:, None] < N) & s_ok, other=127)
        a_v = _dequantize_mx(a, sa, BLOCK_K, BLOCK_M, DEQUANT_DTYPE)
        d_v = _dequantize_mx(d, sd, BLOCK_N, BLOCK_M, DEQUANT_DTYPE)
        acc = tl.dot(a_v, d_v.T, acc)
    return acc


@triton.jit
def _wgrad_chunk_unaligned(acc, a, d, a_tail, d_tail, as_ptr, ds_ptr, rk, rn, K, N, slot,
                           stride_ask, stride_ass, stride_dsn, stride_dss,
                           SCALE_MODE: tl.constexpr):
    """_wgrad_chunk (fp8_rowwise, fp8_blockwise) of a chunk read as two boxes that start on
    16-row boundaries, (a, d) and (a_tail, d_tail), zero outside the chunk."""
    part = tl.dot(a, d.T) + tl.dot(a_tail, d_tail.T)
    if SCALE_MODE == 1:  # the chunk is one 128-row block
        sa = tl.load(as_ptr + rk * stride_ask + slot * stride_ass, mask=rk < K, other=0.0)
        sd = tl.load(ds_ptr + rn * stride_dsn + slot * stride_dss, mask=rn < N, other=0.0)
        part = part * (sa[:, None] * sd[None, :])
    return acc + part


@triton.jit
def _scaled_grouped_mm_wgrad_kernel(
    a_ptr, d_ptr, as_ptr, ds_ptr, out_ptr, offs_ptr,
    M, K, N, G,
    stride_ak, stride_dn,
    stride_ask, stride_ass, stride_dsn, stride_dss,
    stride_og, stride_ok, stride_on,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, SCALE_MODE: tl.constexpr, SCALE_ROWS: tl.constexpr,
    USE_TMA: tl.constexpr, DEQUANT_DTYPE: tl.constexpr,
):
    """out[g] (K, N) = a_g^T @ d_g from columnwise data a_t (K, M) and d_t (N, M).

    A group's rows are reduced in BLOCK_M chunks that start at the group's first row, so each
    chunk is whole columnwise scale blocks (BLOCK_M = 128 = the blockwise block, four 1x32
    MX blocks). Persistent over the G * (K/BLOCK_K) * (N/BLOCK_N) output tiles.
    """
    pid = tl.program_id(0)
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    _, starts, ends, first, blocks = _column_groups(ends, prev, M, G, SCALE_ROWS, G_PAD)
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = num_k * num_n
    TAIL: tl.constexpr = 32  # rows of the second box of an unaligned chunk (an fp8 dot's K)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
        d_desc = tl.make_tensor_descriptor(d_ptr, shape=[N, M], strides=[stride_dn, 1],
                                           block_shape=[BLOCK_N, BLOCK_M])
        if SCALE_MODE != 2:
            a_tail_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_ak, 1],
                                                    block_shape=[BLOCK_K, TAIL])
            d_tail_desc = tl.make_tensor_descriptor(d_ptr, shape=[N, M], strides=[stride_dn, 1],
                                                    block_shape=[BLOCK_N, TAIL])
    CHUNK_SLOTS: tl.constexpr = BLOCK_M // 32 if SCALE_MODE == 2 else 1
    num_tiles = G * per_group
    for tile in range(pid, num_tiles, NUM_SMS):
        g = tile // per_group
        local = tile % per_group
        band_tiles = GROUP_M * num_n
        first_k = (local // band_tiles) * GROUP_M
        band_k = tl.minimum(num_k - first_k, GROUP_M)
        pid_k = first_k + (local % band_tiles) % band_k
        pid_n = (local % band_tiles) // band_k
        m_start = _pick(g_vec, g, starts)
        m_end = _pick(g_vec, g, ends)
        slot0 = _pick(g_vec, g, first)
        slot_end = slot0 + _pick(g_vec, g, blocks)
        rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        # TMA boxes start 16-byte aligned along M, the inner dimension here.
        if USE_TMA and m_start % 16 == 0:
            for m0 in range(m_start, m_end, BLOCK_M):
                a = a_desc.load([pid_k * BLOCK_K, m0])
                d = d_desc.load([pid_n * BLOCK_N, m0])
                if m0 + BLOCK_M > m_end:  # the last, partial chunk: drop the next group's rows
                    keep = (m0 + rm)[None, :] < m_end
                    a = tl.where(keep, a, tl.zeros_like(a))
                    d = tl.where(keep, d, tl.zeros_like(d))
                slot = slot0 + ((m0 - m_start) // BLOCK_M) * CHUNK_SLOTS
                acc = _wgrad_chunk(acc, a, d, as_ptr, ds_ptr, rk, rn, K, N, slot, slot_end,
                                   stride_ask, stride_ass, stride_dsn, stride_dss,
                                   BLOCK_M, BLOCK_K, BLOCK_N, SCALE_MODE, DEQUANT_DTYPE)
        elif USE_TMA and SCALE_MODE != 2:
            # A group that starts off a 16-row boundary (routing without padding): chunk
            # [m0, m0 + BLOCK_M) is read as the box at the 16-row boundary before m0 and the
            # TAIL rows after that box, each cut to the chunk and the group's end; two dots
            # under the chunk's scales, 1 + TAIL / BLOCK_M of the tensor work. H200, skewed
            # groups of the four model shapes, fp8_blockwise: 6.1-7.0x the pointer path below
            # (masked fp8 loads along M). mxfp8 stays there: gathering each row's 1x32 scale
            # for the shifted boxes ran 0.39-0.63x its speed.
            shift = m_start % 16
            rt = tl.arange(0, TAIL)
            for m0 in range(m_start, m_end, BLOCK_M):
                lo = m0 - shift
                hi = tl.minimum(m0 + BLOCK_M, m_end)
                rows = lo + rm
                rows_tail = lo + BLOCK_M + rt
                keep = ((rows >= m0) & (rows < hi))[None, :]
                keep_tail = (rows_tail < hi)[None, :]
                a = a_desc.load([pid_k * BLOCK_K, lo])
                d = d_desc.load([pid_n * BLOCK_N, lo])
                a_tail = a_tail_desc.load([pid_k * BLOCK_K, lo + BLOCK_M])
                d_tail = d_tail_desc.load([pid_n * BLOCK_N, lo + BLOCK_M])
                a = tl.where(keep, a, tl.zeros_like(a))
                d = tl.where(keep, d, tl.zeros_like(d))
                a_tail = tl.where(keep_tail, a_tail, tl.zeros_like(a_tail))
                d_tail = tl.where(keep_tail, d_tail, tl.zeros_like(d_tail))
                slot = slot0 + ((m0 - m_start) // BLOCK_M) * CHUNK_SLOTS
                acc = _wgrad_chunk_unaligned(acc, a, d, a_tail, d_tail, as_ptr, ds_ptr, rk, rn,
                                             K, N, slot, stride_ask, stride_ass, stride_dsn,
                                             stride_dss, SCALE_MODE)
        else:
            for m0 in range(m_start, m_end, BLOCK_M):
                cols = m0 + rm
                col_ok = cols[None, :] < m_end
                a = tl.load(a_ptr + rk[:, None].to(tl.int64) * stride_ak + cols[None, :],
                            mask=(rk[:, None] < K) & col_ok, other=0.0)
                d = tl.load(d_ptr + rn[:, None].to(tl.int64) * stride_dn + cols[None, :],
                            mask=(rn[:, None] < N) & col_ok, other=0.0)
                slot = slot0 + ((m0 - m_start) // BLOCK_M) * CHUNK_SLOTS
                acc = _wgrad_chunk(acc, a, d, as_ptr, ds_ptr, rk, rn, K, N, slot, slot_end,
                                   stride_ask, stride_ass, stride_dsn, stride_dss,
                                   BLOCK_M, BLOCK_K, BLOCK_N, SCALE_MODE, DEQUANT_DTYPE)
        if SCALE_MODE == 0:
            sa = tl.load(as_ptr + rk * stride_ask + g * stride_ass, mask=rk < K, other=0.0)
            sd = tl.load(ds_ptr + rn * stride_dsn + g * stride_dss, mask=rn < N, other=0.0)
            acc = acc * (sa[:, None] * sd[None, :])
        out_ptrs = (out_ptr + g.to(tl.int64) * stride_og + rk[:, None].to(tl.int64) * stride_ok
                    + rn[None, :] * stride_on)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=(rk[:, None] < K) & (rn[None, :] < N))


# ----------------------------------------------------------------------------------------
# Launchers (tensors validated by compiled_moe.ops.fp8)


def _dequant_dtype():
    # The interpreter's bf16 dot is wrong (DESIGN.md section 7); fp32 holds the values exactly.
    return tl.float32 if _INTERPRET else tl.bfloat16


def scaled_grouped_mm(a, b, a_scale, b_scale, offs, recipe: str, out, bias=None) -> None:
    """out (M, N) = a (M, K) @ b (G, K, N) (+ bias (G, N)), both e4m3 and K-major, with their
    scales."""
    M, K = a.shape
    G, _, N = b.shape
    G = int(G)
    if M == 0 or N == 0:
        return
    offs = offs.contiguous()
    cfg = scaled_grouped_mm_config(size_hint(N), size_hint(K), recipe, a.device.type)
    use_tma = K > 0 and _use_tma(a, b.transpose(1, 2))
    num_programs = _num_sms(_device_index(a)) * cfg.ctas_per_sm
    traceable(_scaled_grouped_mm_kernel)[(num_programs,)](
        a, b, a_scale, b_scale, out, bias if bias is not None else out, offs,
        M, N, K, G,
        a.stride(0), b.stride(0), b.stride(2),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        G_PAD=_pad_groups(G),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, SCALE_MODE=SCALE_MODES[recipe], USE_TMA=use_tma,
        DEQUANT_DTYPE=_dequant_dtype(), WARP_SPECIALIZE=cfg.warp_specialize,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def scaled_grouped_mm_wgrad(a_t, d_t, a_scale, d_scale, offs, recipe: str, out) -> None:
    """out[g] (K, N) = a_g^T @ d_g from columnwise e4m3 data a_t (K, M), d_t (N, M)."""
    K, M = a_t.shape
    N = d_t.shape[0]
    G = int(out.shape[0])
    if K == 0 or N == 0:
        return
    offs = offs.contiguous()
    cfg = scaled_grouped_mm_wgrad_config(max(1, size_hint(M) // G), size_hint(K), size_hint(N),
                                         recipe, a_t.device.type)
    use_tma = M > 0 and _use_tma(a_t, d_t)
    num_programs = _num_sms(_device_index(a_t)) * cfg.ctas_per_sm
    traceable(_scaled_grouped_mm_wgrad_kernel)[(num_programs,)](
        a_t, d_t, a_scale, d_scale, out, offs,
        M, K, N, G,
        a_t.stride(0), d_t.stride(0),
        a_scale.stride(0), a_scale.stride(1), d_scale.stride(0), d_scale.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        G_PAD=_pad_groups(G + 1),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, SCALE_MODE=SCALE_MODES[recipe],
        SCALE_ROWS=reference.fp8_column_block(recipe), USE_TMA=use_tma,
        DEQUANT_DTYPE=_dequant_dtype(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
