"""Triton kernels of grouped FP8 quantization (see ``reference.grouped_quantize`` for layouts).

Kernels, each one launch for every group:
  _quantize_row_blocks_kernel     1 x SCALE_C blocks (fp8_blockwise 1x128, mxfp8 1x32) of the
                                  rows of a (G, R, C) tensor
  _quantize_rows_kernel           one scale per whole row (fp8_rowwise), read once when the row
                                  fits in registers
  _quantize_tiles_kernel          128x128 blocks of 3-D weights (fp8_blockwise)
  _quantize_group_columns_kernel  columnwise blocks that stop at group ends, stored transposed,
                                  optionally the rowwise blocks of the same rows too (x read
                                  once from memory for both)
  _quantize_group_columns_whole_kernel  fp8_rowwise columnwise: one scale per (group, column)
The math (scale from amax, saturating cast) is in the jit helpers so that a GEMM epilogue can
reuse it. The kernels are memory-bound only while the work per element stays a few
instructions, so on the GPU the helpers use the hardware e4m3 conversion and a division by fma
steps (quantize_values, _divide), both bit-identical to the reference; under the Triton
interpreter (CPU tests) they fall back to exact emulations.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from compiled_moe.kernels import traceable

from compiled_moe import reference
from compiled_moe.kernels.configs import quantize_config, size_hint
from compiled_moe.kernels.grouped_mm import _max_combine, _pad_groups, _pick

FP8_MAX = tl.constexpr(448.0)
FMA_DIVISION_MIN_SCALE = tl.constexpr(2.0 ** -90)  # see _divide


@triton.jit
def abs_nan_as_inf(x):
    """|x| with NaN counted as +Inf, so a block's amax shows any non-finite value."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(x, axis: tl.constexpr, NAN_MAX: tl.constexpr = False):
    """max |x| along axis, +Inf where the block holds Inf or NaN.

    NAN_MAX (GPU): a max that keeps NaN is one instruction per element (|x| is an operand
    modifier), and the NaN becomes Inf once per block; else NaN becomes Inf per element first
    (abs_nan_as_inf). The Triton interpreter runs a reduction with its own combine function
    element by element in Python, far too slowly for the tests.
    """
    if NAN_MAX:
        amax = tl.reduce(tl.abs(x), axis, _max_keep_nan)
        return tl.where(amax == amax, amax, float("inf"))
    else:
        return tl.max(abs_nan_as_inf(x), axis)


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
def quantize_values(x, scale, E8M0: tl.constexpr, NATIVE_CAST: tl.constexpr = False,
                    FMA_DIVISION: tl.constexpr = False):
    """e4m3 of x (fp32) under its block's scale (broadcast to x), as the reference: x / scale
    (an exact IEEE division) or x * 2^-e (exact) for E8M0, saturating at +-448, NaN where x
    is Inf or NaN (such a block's scale is Inf, or the E8M0 NaN byte with its finite values 0).

    The quotient is already NaN exactly where the result must be: x / Inf is NaN for x = Inf
    or NaN and +-0 for finite x, and so is x * 0 for the E8M0 NaN byte. NATIVE_CAST (GPU): the
    hardware fp32 -> e4m3 conversion (cvt.rn.satfinite) rounds to nearest even, saturates
    finite values to +-448 and turns any NaN into 0x7F: the reference's clamp and cast, one
    instruction per two values. The Triton interpreter's cast rounds ties away (and can lose a
    binade), so without NATIVE_CAST the value is clamped and rounded in fp32 first and NaN
    written as 0x7F. FMA_DIVISION: see _divide.

    Signed zeros: -0 must quantize to 0x80 as in the reference. No step here adds a zero
    constant or negates an fma's result: on the GPU, an earlier form (an fma adding a select
    of +-0, a negated remainder fma) returned +0 for x = -0.
    """
    if E8M0:
        exp = scale.to(tl.int32) - 127
        inv = (tl.minimum(tl.maximum(127 - exp, 1), 254) << 23).to(tl.float32, bitcast=True)
        q = x * tl.where(scale == 255, 0.0, inv)
    else:
        q = _divide(x, scale, FMA_DIVISION)
    if NATIVE_CAST:
        return q.to(tl.float8e4nv)
    rounded = _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)).to(tl.float8e4nv)
    bits = tl.where(q == q, rounded.to(tl.uint8, bitcast=True), 0x7F)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _divide(x, scale, FMA_DIVISION: tl.constexpr):
    """x / scale (fp32; scale > 0, one value per block, broadcast to x) rounded once, exactly
    as an IEEE division.

    FMA_DIVISION: a GPU division is about ten instructions per element with a branch (a
    reciprocal, its refinement, a range check), the largest part of a quantize kernel's work.
    Instead: y = 1/s once per block, q = x * y, then twice q = q - (q * s - x) * y, the
    remainder q * s - x exact in an fma. By Markstein's theorem a correction with a correctly
    rounded y turns a q within an ulp into the correctly rounded quotient; the first one
    brings q there. The remainders are exact while no intermediate is subnormal, which holds
    for 2^-90 <= s < Inf (bit-for-bit check against RN(x / s): scripts/verify_fma_division.py);
    a tile with any other scale (a tiny block, or one holding Inf or NaN) divides. Needs an fma
    rounded once: the GPU's, not the interpreter's of Triton < 3.9.
    """
    if FMA_DIVISION:
        regular = (scale >= FMA_DIVISION_MIN_SCALE) & (scale < float("inf"))
        if tl.min(tl.min(regular.to(tl.int32), 1), 0) == 1:  # scale is 2-D, per block
            y = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            neg_y = -y  # per block; the remainder itself is never negated (signed zeros)
            q = x * y
            q = tl.math.fma(tl.math.fma(q, scale, -x), neg_y, q)
            q = tl.math.fma(tl.math.fma(q, scale, -x), neg_y, q)
        else:
            q = tl.math.div_rn(x, scale)
    else:
        q = tl.math.div_rn(x, scale)
    return q


@triton.jit
def _round_to_e4m3(q):
    """q (finite, |q| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32.

    The cast that follows is then exact everywhere: the Triton interpreter's own fp32 -> e4m3
    cast rounds ties away and can lose a binade when rounding carries into the exponent.
    The magnitude is rounded and q's sign bit put back, so -0 stays -0 (as in the reference).
    """
    bits = q.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -0x100000).to(tl.float32,
                                                                              bitcast=True)
    mag = tl.abs(q)
    sub = (mag + 24576.0) - 24576.0  # 1.5 * 2^14: fp32 spacing 2^-9, e4m3's subnormal step
    mag = tl.where(mag < 0.015625, sub, normal)  # 2^-6: smallest e4m3 normal
    return (mag.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_row_blocks_kernel(
    x_ptr, q_ptr, s_ptr, R, C,
    stride_xg, stride_xr, stride_xc,
    stride_qg, stride_qr, stride_qc,
    stride_sg, stride_sr, stride_sc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCALE_C: tl.constexpr,
    E8M0: tl.constexpr, NATIVE: tl.constexpr, FMA_DIVISION: tl.constexpr,
):
    """1 x SCALE_C blocks of x[g] (R, C); a program quantizes BLOCK_R rows x BLOCK_C columns.

    The tile is held as (blocks, SCALE_C), one scale block per tile row, so a block's amax is
    a plain reduction along the tile's rows (no reshape) and its scale broadcasts along them.
    Consecutive tile rows are neighbouring blocks of a row of x: loads and stores stay
    contiguous 16-byte accesses.
    """
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    num_c = tl.cdiv(C, BLOCK_C)
    NB: tl.constexpr = BLOCK_C // SCALE_C  # blocks per row of the tile
    b = tl.arange(0, BLOCK_R * NB)
    row = (pid // num_c) * BLOCK_R + b // NB
    col0 = (pid % num_c) * BLOCK_C + (b % NB) * SCALE_C  # first column of each block
    rc = col0[:, None] + tl.arange(0, SCALE_C)[None, :]
    inside = (row[:, None] < R) & (rc < C)
    rows64 = row[:, None].to(tl.int64)
    x = tl.load(x_ptr + g * stride_xg + rows64 * stride_xr + rc * stride_xc,
                mask=inside, other=0.0).to(tl.float32)
    scale = scale_from_amax(block_amax(x, 1, NATIVE), E8M0)  # (blocks,)
    tl.store(q_ptr + g * stride_qg + rows64 * stride_qr + rc * stride_qc,
             quantize_values(x, scale[:, None], E8M0, NATIVE, FMA_DIVISION), mask=inside)
    tl.store(s_ptr + g * stride_sg + row * stride_sr + (col0 // SCALE_C) * stride_sc, scale,
             mask=(row < R) & (col0 < C))


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, R, C,
    stride_xg, stride_xr, stride_xc,
    stride_qg, stride_qr, stride_qc,
    stride_sg, stride_sr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NATIVE: tl.constexpr,
    FMA_DIVISION: tl.constexpr,
):
    """One fp32 scale per row of x[g] (R, C). The first BLOCK_C columns stay in registers from
    the amax to the quantization, so rows of C <= BLOCK_C are read once; the columns past
    BLOCK_C of longer rows are read twice (a pass for the amax, a pass to quantize)."""
    g = tl.program_id(1).to(tl.int64)
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rr[:, None] < R
    x_rows = x_ptr + g * stride_xg + rr[:, None].to(tl.int64) * stride_xr
    q_rows = q_ptr + g * stride_qg + rr[:, None].to(tl.int64) * stride_qr
    rc = tl.arange(0, BLOCK_C)[None, :]
    first = row_ok & (rc < C)
    x0 = tl.load(x_rows + rc * stride_xc, mask=first, other=0.0).to(tl.float32)
    amax = block_amax(x0, 1, NATIVE)
    for c0 in range(BLOCK_C, C, BLOCK_C):
        x = tl.load(x_rows + (c0 + rc) * stride_xc, mask=row_ok & (c0 + rc < C), other=0.0)
        amax = tl.maximum(amax, block_amax(x.to(tl.float32), 1, NATIVE))
    scale = scale_from_amax(amax, False)
    tl.store(q_rows + rc * stride_qc,
             quantize_values(x0, scale[:, None], False, NATIVE, FMA_DIVISION), mask=first)
    for c0 in range(BLOCK_C, C, BLOCK_C):
        inside = row_ok & (c0 + rc < C)
        x = tl.load(x_rows + (c0 + rc) * stride_xc, mask=inside, other=0.0)
        q = quantize_values(x.to(tl.float32), scale[:, None], False, NATIVE, FMA_DIVISION)
        tl.store(q_rows + (c0 + rc) * stride_qc, q, mask=inside)
    tl.store(s_ptr + g * stride_sg + rr * stride_sr, scale, mask=rr < R)


@triton.jit
def _quantize_tiles_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C,
    stride_xg, stride_xr, stride_xc,
    stride_qg, stride_qr, stride_qc,
    stride_sg, stride_sr, stride_sc,
    stride_qtg, stride_qtr, stride_qtc,
    stride_stg, stride_str, stride_stc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, E8M0: tl.constexpr,
    TRANSPOSED: tl.constexpr, NATIVE: tl.constexpr, FMA_DIVISION: tl.constexpr,
):
    """Blocks of SCALE_R x SCALE_C of x[g] (R, C); a program quantizes one BLOCK_R x BLOCK_C tile.
    Used for the 128x128 blocks of weights. TRANSPOSED (square blocks): also the quantization of
    x[g].mT into qt (C, R) and st, which is the same data and scales transposed (a block of x.mT
    is a block of x, transposed: same amax, same scale, same quotients), so x is read once for
    both directions, as a training step needs (forward reads the rowwise weight, dgrad the
    columnwise one)."""
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    num_c = tl.cdiv(C, BLOCK_C)
    pr = pid // num_c
    pc = pid % num_c
    rr = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rr[:, None] < R) & (rc[None, :] < C)
    x = tl.load(x_ptr + g * stride_xg + rr[:, None].to(tl.int64) * stride_xr
                + rc[None, :] * stride_xc, mask=inside, other=0.0).to(tl.float32)
    NR: tl.constexpr = BLOCK_R // SCALE_R
    NC: tl.constexpr = BLOCK_C // SCALE_C
    blocks = abs_nan_as_inf(x).reshape(NR, SCALE_R, NC, SCALE_C)
    scale = scale_from_amax(tl.max(tl.max(blocks, 3), 1), E8M0)  # (NR, NC)
    full = tl.broadcast_to(scale[:, None, :, None], (NR, SCALE_R, NC, SCALE_C))
    q = quantize_values(x, full.reshape(BLOCK_R, BLOCK_C), E8M0, NATIVE, FMA_DIVISION)
    tl.store(q_ptr + g * stride_qg + rr[:, None].to(tl.int64) * stride_qr + rc[None, :] * stride_qc,
             q, mask=inside)
    sr = pr * NR + tl.arange(0, NR)
    sc = pc * NC + tl.arange(0, NC)
    scale_inside = (sr[:, None] < tl.cdiv(R, SCALE_R)) & (sc[None, :] < tl.cdiv(C, SCALE_C))
    tl.store(s_ptr + g * stride_sg + sr[:, None] * stride_sr + sc[None, :] * stride_sc, scale,
             mask=scale_inside)
    if TRANSPOSED:
        tl.store(qt_ptr + g * stride_qtg + rc[None, :].to(tl.int64) * stride_qtr
                 + rr[:, None] * stride_qtc, q, mask=inside)
        tl.store(st_ptr + g * stride_stg + sc[None, :] * stride_str + sr[:, None] * stride_stc,
                 scale, mask=scale_inside)


@triton.jit
def _column_groups(ends, prev, M, G, BLOCK_ROWS: tl.constexpr, G_PAD: tl.constexpr):
    """Groups 0..G-1 and the rows past the last group as group G: their first row, end row and
    first columnwise slot (blocks of BLOCK_ROWS rows; BLOCK_ROWS 0: one slot per group).
    ends, prev: offs[g] and offs[g - 1], loaded in the kernel's body (grouped_mm._group_bounds
    says why)."""
    g = tl.arange(0, G_PAD)
    ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), M), 0, _max_combine)
    ends = tl.where(g >= G, M, ends)
    starts = tl.associative_scan(tl.minimum(tl.maximum(prev, 0), M), 0, _max_combine)
    starts = tl.where(g > G, M, starts)
    if BLOCK_ROWS == 0:
        blocks = (g <= G).to(tl.int32)
    else:
        blocks = (ends - starts + BLOCK_ROWS - 1) // BLOCK_ROWS
    return g, starts, ends, tl.cumsum(blocks, 0) - blocks, blocks


@triton.jit
def _slot_rows(ends, prev, M, G, slot, BLOCK_ROWS: tl.constexpr, G_PAD: tl.constexpr):
    """(used slots, first row, end row) of columnwise slot `slot` (rows 0, 0 if unused): the
    group holding the slot is the one whose slots cover it, so no group index is needed."""
    _, starts, ends, first, blocks = _column_groups(ends, prev, M, G, BLOCK_ROWS, G_PAD)
    mine = (first <= slot) & (slot < first + blocks)
    row0 = tl.sum(tl.where(mine, starts + (slot - first) * BLOCK_ROWS, 0), 0)
    return tl.sum(blocks, 0), row0, tl.sum(tl.where(mine, ends, 0), 0)


@triton.jit
def _store_transposed(ptr, q, row0, row_end, rk, K, stride_k, stride_m,
                      BLOCK_ROWS: tl.constexpr):
    """q (BLOCK_ROWS, BLOCK_K), rows row0 + i of x, into ptr[k, m] for the rows < row_end."""
    rm = row0 + tl.arange(0, BLOCK_ROWS)
    tl.store(ptr + rk[None, :].to(tl.int64) * stride_k + rm[:, None] * stride_m, q,
             mask=(rm[:, None] < row_end) & (rk[None, :] < K))


@triton.jit
def _store_columns(ptr, q, row0, row_end, rk, K, stride_k, stride_m,
                   BLOCK_ROWS: tl.constexpr):
    """The transposed store of a columnwise tile. Its rows are contiguous in memory, so Triton
    moves the tile through shared memory to store along M; 16-byte stores need row0 and
    row_end to be multiples of 16, which Triton cannot know: when they are (routing padded to
    16 rows), the same values rebuilt as multiples of 16 let it prove so."""
    if (row0 % 16 == 0) & (row_end % 16 == 0):
        _store_transposed(ptr, q, row0 // 16 * 16, row_end // 16 * 16, rk, K, stride_k,
                          stride_m, BLOCK_ROWS)
    else:
        _store_transposed(ptr, q, row0, row_end, rk, K, stride_k, stride_m, BLOCK_ROWS)


@triton.jit
def _quantize_group_columns_kernel(
    x_ptr, offs_ptr, cq_ptr, cs_ptr, rq_ptr, rs_ptr,
    M, K, G,
    stride_xm, stride_xk,
    stride_cqk, stride_cqm, stride_csk, stride_css,
    stride_rqm, stride_rqk, stride_rsm, stride_rsk,
    G_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, STEP_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, ROWWISE: tl.constexpr,
    E8M0: tl.constexpr, NATIVE: tl.constexpr, FMA_DIVISION: tl.constexpr,
):
    """Columnwise blocks of BLOCK_ROWS rows of x (M, K) that never cross a group's end, stored
    transposed (col data (K, M), col scale (K, slots)); with ROWWISE, also the 1 x ROW_BLOCK
    rowwise blocks of the same rows. One program per (slot, BLOCK_K columns), the column tiles
    of a slot side by side in launch order (programs running together read whole rows of x);
    slots past the last block are zero blocks.

    The block is read STEP_ROWS rows at a time. With STEP_ROWS < BLOCK_ROWS only that many
    rows are in registers at once (a 128 x 128 fused tile would take one program per SM):
    the rows are read a second time for the column quantization, from L1/L2, not memory.
    """
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    slot = pid // num_k
    col0 = (pid % num_k) * BLOCK_K
    rk = col0 + tl.arange(0, BLOCK_K)
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    used, row0, row_end = _slot_rows(ends, prev, M, G, slot, BLOCK_ROWS, G_PAD)
    if slot >= used:
        unused = scale_from_amax(tl.zeros((BLOCK_K,), dtype=tl.float32), E8M0)
        tl.store(cs_ptr + rk * stride_csk + slot * stride_css, unused, mask=rk < K)
    else:
        STEPS: tl.constexpr = BLOCK_ROWS // STEP_ROWS
        col_amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for step in tl.static_range(STEPS):
            x = _load_rows(x_ptr, row0 + step * STEP_ROWS, row_end, rk, K, stride_xm, stride_xk,
                           STEP_ROWS)
            col_amax = tl.maximum(col_amax, block_amax(x, 0, NATIVE))
            if ROWWISE:
                _quantize_row_blocks(x, rq_ptr, rs_ptr, row0 + step * STEP_ROWS, row_end, col0,
                                     K, stride_rqm, stride_rqk, stride_rsm, stride_rsk,
                                     STEP_ROWS, BLOCK_K, ROW_BLOCK, E8M0, NATIVE,
                                     FMA_DIVISION)
        scale = scale_from_amax(col_amax, E8M0)  # (BLOCK_K,)
        for step in tl.static_range(STEPS):
            if STEPS > 1:
                x = _load_rows(x_ptr, row0 + step * STEP_ROWS, row_end, rk, K, stride_xm,
                               stride_xk, STEP_ROWS)
            q = quantize_values(x, scale[None, :], E8M0, NATIVE, FMA_DIVISION)
            _store_columns(cq_ptr, q, row0 + step * STEP_ROWS, row_end, rk, K, stride_cqk,
                           stride_cqm, STEP_ROWS)
        tl.store(cs_ptr + rk * stride_csk + slot * stride_css, scale, mask=rk < K)


@triton.jit
def _load_rows(x_ptr, row0, row_end, rk, K, stride_xm, stride_xk, ROWS: tl.constexpr):
    """x[row0 : row0 + ROWS, rk] in fp32, rows from row_end on read as 0."""
    rm = row0 + tl.arange(0, ROWS)
    return tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk,
                   mask=(rm[:, None] < row_end) & (rk[None, :] < K), other=0.0).to(tl.float32)


@triton.jit
def _quantize_row_blocks(x, q_ptr, s_ptr, row0, row_end, col0, K,
                         stride_qm, stride_qk, stride_sm, stride_sk,
                         ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
                         E8M0: tl.constexpr, NATIVE: tl.constexpr,
                         FMA_DIVISION: tl.constexpr):
    """The 1 x ROW_BLOCK rowwise blocks of x (ROWS, BLOCK_K): rows row0 + i, columns col0 + j."""
    NB: tl.constexpr = BLOCK_K // ROW_BLOCK
    rm = row0 + tl.arange(0, ROWS)
    rk = col0 + tl.arange(0, BLOCK_K)
    row_scale = scale_from_amax(block_amax(x.reshape(ROWS, NB, ROW_BLOCK), 2, NATIVE), E8M0)
    full = tl.broadcast_to(row_scale[:, :, None], (ROWS, NB, ROW_BLOCK)).reshape(ROWS, BLOCK_K)
    tl.store(q_ptr + rm[:, None].to(tl.int64) * stride_qm + rk[None, :] * stride_qk,
             quantize_values(x, full, E8M0, NATIVE, FMA_DIVISION),
             mask=(rm[:, None] < row_end) & (rk[None, :] < K))
    sb = col0 // ROW_BLOCK + tl.arange(0, NB)  # rowwise scale column of each block
    tl.store(s_ptr + rm[:, None].to(tl.int64) * stride_sm + sb[None, :] * stride_sk, row_scale,
             mask=(rm[:, None] < row_end) & (sb[None, :] * ROW_BLOCK < K))


@triton.jit
def _quantize_group_columns_whole_kernel(
    x_ptr, offs_ptr, cq_ptr, cs_ptr,
    M, K, G,
    stride_xm, stride_xk, stride_cqk, stride_cqm, stride_csk, stride_css,
    G_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr, FMA_DIVISION: tl.constexpr,
):
    """fp8_rowwise columnwise: one fp32 scale per (group, column), group G being the rows past
    the last group; a pass over the group's rows for the amax, a pass to quantize."""
    g = tl.program_id(0)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    _, starts, ends, _, _ = _column_groups(ends, prev, M, G, 0, G_PAD)
    m_start = _pick(g_vec, g, starts)
    m_end = _pick(g_vec, g, ends)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_ROWS):
        x = _load_rows(x_ptr, m0, m_end, rk, K, stride_xm, stride_xk, BLOCK_ROWS)
        amax = tl.maximum(amax, block_amax(x, 0, NATIVE))
    scale = scale_from_amax(amax, False)
    for m0 in range(m_start, m_end, BLOCK_ROWS):
        x = _load_rows(x_ptr, m0, m_end, rk, K, stride_xm, stride_xk, BLOCK_ROWS)
        q = quantize_values(x, scale[None, :], False, NATIVE, FMA_DIVISION)
        _store_columns(cq_ptr, q, m0, m_end, rk, K, stride_cqk, stride_cqm, BLOCK_ROWS)
    tl.store(cs_ptr + rk * stride_csk + g * stride_css, scale, mask=rk < K)


# ----------------------------------------------------------------------------------------
# Launchers: outputs are allocated by the op (compiled_moe.ops.fp8) and filled here.


def _compiled() -> bool:
    """True where the kernels compile for the GPU, False under the Triton interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(_quantize_rows_kernel, InterpretedFunction)


# GPU-only arithmetic (module attributes, read at every launch). NATIVE: the hardware e4m3
# conversion and the NaN-keeping max (quantize_values, block_amax). FMA_DIVISION: the division
# by fma steps (_divide); it needs an fma rounded once, which the interpreter has from Triton
# 3.9 on (the tests switch it on there).
NATIVE = _compiled()
FMA_DIVISION = _compiled()


def _math():
    return dict(NATIVE=NATIVE, FMA_DIVISION=FMA_DIVISION)


def quantize_tiles(x, q, s, recipe: str, weight: bool, col=None) -> None:
    """Rowwise blocks of x (R, C) or (G, R, C) into q (same shape) and s (block grid). col:
    (qt, st), 3-D weights with square blocks only: x.mT's quantization too, from the same read."""
    x3, q3, s3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (x, q, s))
    num_groups, rows, cols = x3.shape
    if rows == 0 or cols == 0:
        return
    scale_r, scale_c = reference.fp8_block(recipe, weight)
    if scale_c == 0:
        cfg = quantize_config("rows", x.device.type, size_hint(cols))
        grid = (triton.cdiv(rows, cfg.block_m), num_groups)
        traceable(_quantize_rows_kernel)[grid](
            x3, q3, s3, rows, cols, *x3.stride(), *q3.stride(), s3.stride(0), s3.stride(1),
            BLOCK_R=cfg.block_m, BLOCK_C=cfg.block_n, num_warps=cfg.num_warps, **_math())
        return
    cfg = quantize_config(f"tiles_{scale_r}x{scale_c}", x.device.type, size_hint(cols))
    block_r = max(cfg.block_m, scale_r)
    block_c = max(cfg.block_n, scale_c)
    grid = (triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c), num_groups)
    common = dict(E8M0=recipe == "mxfp8", num_warps=cfg.num_warps, **_math())
    if scale_r == 1:
        traceable(_quantize_row_blocks_kernel)[grid](
            x3, q3, s3, rows, cols, *x3.stride(), *q3.stride(), *s3.stride(),
            BLOCK_R=block_r, BLOCK_C=block_c, SCALE_C=scale_c, **common)
        return
    transposed = col is not None
    qt3, st3 = col if transposed else (q3, s3)  # unused pointers when not transposed
    traceable(_quantize_tiles_kernel)[grid](
        x3, q3, s3, qt3, st3, rows, cols, *x3.stride(), *q3.stride(), *s3.stride(),
        *qt3.stride(), *st3.stride(),
        BLOCK_R=block_r, BLOCK_C=block_c, SCALE_R=scale_r, SCALE_C=scale_c,
        TRANSPOSED=transposed, **common)


def quantize_group_columns(x, offs, col_q, col_s, row_q, row_s, recipe: str) -> None:
    """Columnwise blocks of 2-D x inside groups; with row_q/row_s also the rowwise blocks."""
    M, K = x.shape
    G = int(offs.shape[0])  # specialised under torch.compile: G_PAD is a constexpr
    if K == 0:
        return
    offs = offs.contiguous()
    block_rows = reference.fp8_column_block(recipe)
    if block_rows == 0:
        cfg = quantize_config("group_columns_whole", x.device.type, size_hint(K))
        grid = (G + 1, triton.cdiv(K, cfg.block_n))
        traceable(_quantize_group_columns_whole_kernel)[grid](
            x, offs, col_q, col_s, M, K, G, x.stride(0), x.stride(1),
            col_q.stride(0), col_q.stride(1), col_s.stride(0), col_s.stride(1),
            G_PAD=_pad_groups(G + 1), BLOCK_ROWS=cfg.block_m, BLOCK_K=cfg.block_n,
            num_warps=cfg.num_warps, **_math())
        return
    rowwise = row_q is not None
    _, row_block = reference.fp8_block(recipe)
    kind = f"group_columns_{block_rows}" + ("_rowwise" if rowwise else "")
    cfg = quantize_config(kind, x.device.type, size_hint(K))
    # Rowwise blocks need whole 1 x row_block blocks in a tile; columnwise blocks alone do not
    # (a 128 x 128 tile there took 254 registers a thread, 2 programs per SM).
    block_k = max(cfg.block_n, row_block) if rowwise else cfg.block_n
    step_rows = math.gcd(max(cfg.block_m, 1), block_rows)  # rows per step: divides the block
    grid = (col_s.shape[1] * triton.cdiv(K, block_k),)
    rq, rs = (row_q, row_s) if rowwise else (col_q, col_s)
    traceable(_quantize_group_columns_kernel)[grid](
        x, offs, col_q, col_s, rq, rs, M, K, G,
        x.stride(0), x.stride(1), col_q.stride(0), col_q.stride(1),
        col_s.stride(0), col_s.stride(1),
        rq.stride(0), rq.stride(1), rs.stride(0), rs.stride(1),
        G_PAD=_pad_groups(G + 1), BLOCK_ROWS=block_rows, STEP_ROWS=step_rows, BLOCK_K=block_k,
        ROW_BLOCK=row_block,
        ROWWISE=rowwise, E8M0=recipe == "mxfp8", num_warps=cfg.num_warps, **_math())
