"""Triton kernels of the grouped GEMM family: forward/dgrad, weight gradient, grouped row sum.

Every kernel reads the group offsets on the device and derives its own tile schedule from
them, so no launch depends on group sizes known on the host (no sync, CUDA-graph safe).

Group bounds: offsets are clamped to [0, M] and made non-decreasing by a running maximum
(``reference.group_bounds`` is the same rule in torch), so corrupt offsets can never make a
kernel touch a row outside its tensor.

The launchers below take already validated tensors (see ``compiled_moe.ops``) and launch
through ``torch.library.wrap_triton`` so that inductor can see and inline the kernels.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
import triton.language as tl
from torch._guards import TracingContext
from compiled_moe.kernels import traceable

from compiled_moe.kernels.configs import (
    size_hint,
    grouped_mm_config,
    grouped_mm_wgrad_config,
    grouped_sum_config,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _max_combine(x, y):
    return tl.maximum(x, y)


# Every kernel reads offs in its own body (offs[g] and offs[g - 1] for g < G_PAD, as
# `ends, prev = tl.load(...)`) and hands the values to the helpers below, never offs_ptr
# itself. torch's mutation analysis of a traced Triton kernel counts every argument of a helper
# call whose results reach a store's address as written; with offs_ptr among them, a compiled
# graph copied offs before each launch whenever offs was used afterwards (one more kernel).
# tests/kernel_writes.py checks every kernel.


@triton.jit
def _group_bounds(ends, prev, M):
    """Each group's first row and end row from offs[g] (ends) and offs[g - 1] (prev), loaded
    as (G_PAD,) vectors with 0 past the groups: padding groups are empty."""
    ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), M), 0, _max_combine)
    starts = tl.associative_scan(tl.minimum(tl.maximum(prev, 0), M), 0, _max_combine)
    return starts, ends


@triton.jit
def _pick(g_vec, g, values):
    """values[g] as a scalar (a masked reduction: Triton has no dynamic vector indexing)."""
    return tl.sum(tl.where(g_vec == g, values, 0), 0)


@triton.jit
def _row_tile_schedule(ends, prev, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The flat tile list of a grouped product over row groups: every group's (m, n) tiles in
    group order. Returns what :func:`_row_tile` needs, plus the number of tiles and the first
    row past the last group. ends, prev: offs[g] and offs[g - 1] (see _group_bounds)."""
    starts, ends = _group_bounds(ends, prev, M)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = m_tiles * num_n
    tile_ends = tl.cumsum(tiles, 0)
    return starts, ends, m_tiles, tiles, tile_ends, num_n, tl.sum(tiles, 0), tl.max(ends, 0)


@triton.jit
def _row_tile(tile, g_vec, starts, ends, m_tiles, tiles, tile_ends, num_n,
              BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """(group, first row, group's end row, column tile) of one entry of the flat tile list."""
    g = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    local = tile - _pick(g_vec, g, tile_ends - tiles)
    group_m_tiles = _pick(g_vec, g, m_tiles)
    # Bands of GROUP_M row tiles share their b columns in L2.
    band_tiles = GROUP_M * num_n
    first_m = (local // band_tiles) * GROUP_M
    band_m = tl.minimum(group_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (local % band_tiles) % band_m
    pid_n = (local % band_tiles) // band_m
    row0 = _pick(g_vec, g, starts) + pid_m * BLOCK_M
    return g, row0, _pick(g_vec, g, ends), pid_n


@triton.jit
def _store_rows(out_ptr, rm, rn, row_end, N, stride_om, stride_on, c):
    """Masked store of a tile: rows below row_end, columns below N."""
    ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    tl.store(ptrs, c, mask=(rm[:, None] < row_end) & (rn[None, :] < N))


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, offs_ptr,
    M, N, K, G,
    stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_om, stride_on,
    stride_bias_g, stride_bias_n,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
    B_K_CONTIGUOUS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """out[r] = a[r] @ b[g] (+ bias[g]) for rows r of group g; rows past the last group get 0.

    Persistent: NUM_SMS programs walk one flat list of tiles, first every group's
    (m, n) tiles in group order, then the tiles that zero the rows past the last group.
    Every program derives the list from ``offs`` itself, so work is spread evenly over the
    SMs whatever the group sizes (skewed routing costs only the one partial M tile per group).
    """
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
        if B_K_CONTIGUOUS:  # b[g] is the transposed view of an (N, K) nn.Linear weight
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, N, K],
                                               strides=[stride_bg, stride_bn, 1],
                                               block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, K, N],
                                               strides=[stride_bg, stride_bk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_om, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])

    # WARP_SPECIALIZE 1 asks for producer and consumer warps on the K loop, 2 on this loop (no
    # effect on Triton 3.6 for sm_90: configs.TileConfig). Triton 3.6 fails to compile this
    # loop with flatten=True.
    for tile in tl.range(pid, group_tiles, NUM_SMS, warp_specialize=WARP_SPECIALIZE == 2):
        g, row0, m_end, pid_n = _row_tile(tile, g_vec, starts, ends, m_tiles, tiles, tile_ends,
                                          num_n, BLOCK_M, GROUP_M)
        col0 = pid_n * BLOCK_N
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = col0 + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            # Rows of the next group ride along in the last M tile; they are not stored.
            for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE == 1):
                a = a_desc.load([row0, k0])
                if B_K_CONTIGUOUS:
                    b = b_desc.load([g, col0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = b_desc.load([g, k0, col0]).reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:
            a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
            b_ptrs = (b_ptr + g.to(tl.int64) * stride_bg + rk[:, None] * stride_bk
                      + rn[None, :] * stride_bn)
            for k0 in range(0, K, BLOCK_K):
                k_ok = rk + k0 < K
                a = tl.load(a_ptrs, mask=(rm[:, None] < m_end) & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn[None, :] < N), other=0.0)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + g * stride_bias_g + rn * stride_bias_n, mask=rn < N,
                           other=0.0)
            acc += bias.to(tl.float32)[None, :]
        c = acc.to(out_ptr.dtype.element_ty)
        if TMA_STORE:
            # A tile inside its group goes out by TMA (asynchronous: it overlaps the next
            # tile's loads); the group's last tile must not write the next group's rows.
            if row0 + BLOCK_M <= m_end:
                out_desc.store([row0, col0], c)
            else:
                _store_rows(out_ptr, rm, rn, m_end, N, stride_om, stride_on, c)
        else:
            _store_rows(out_ptr, rm, rn, m_end, N, stride_om, stride_on, c)

    # Rows past the last group are zeros.
    for local in range(pid, tail_tiles, NUM_SMS):
        rm = rows_end + (local // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (local % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        _store_rows(out_ptr, rm, rn, M, N, stride_om, stride_on, zeros)


@triton.jit
def _grouped_mm_wgrad_kernel(
    a_ptr, d_ptr, out_ptr, mask_ptr, offs_ptr,
    M, K, N, G,
    stride_am, stride_ak,
    stride_dm, stride_dn,
    stride_og, stride_ok, stride_on,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """out[g] (K, N) = a_g^T @ d_g, reduced over the rows of group g in BLOCK_M chunks.

    With ACCUMULATE, out[g] += ... (out is an fp32 main_grad); with HAS_MASK, only groups
    whose mask entry is true accumulate, the others are overwritten. Empty groups give 0.
    Persistent over the G * (K/BLOCK_K) * (N/BLOCK_N) output tiles, group-major so that
    tiles running together read the same rows of a and d from L2.
    """
    pid = tl.program_id(0)
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    starts, ends = _group_bounds(ends, prev, M)
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = num_k * num_n
    total_tiles = G * per_group
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        d_desc = tl.make_tensor_descriptor(d_ptr, shape=[M, N], strides=[stride_dm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    if TMA_STORE:
        # Output tiles never cross a group (the descriptor has a G dimension): every tile can
        # go out asynchronously. Writing (G, K, N) is most of GPT-OSS's wgrad time.
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[G, K, N],
                                             strides=[stride_og, stride_ok, 1],
                                             block_shape=[1, BLOCK_K, BLOCK_N])

    for tile in tl.range(pid, total_tiles, NUM_SMS, warp_specialize=WARP_SPECIALIZE == 2):
        g = tile // per_group
        local = tile % per_group
        band_tiles = GROUP_M * num_n
        first_k = (local // band_tiles) * GROUP_M
        band_k = tl.minimum(num_k - first_k, GROUP_M)
        pid_k = first_k + (local % band_tiles) % band_k
        pid_n = (local % band_tiles) // band_k
        m_start = _pick(g_vec, g, starts)
        m_end = _pick(g_vec, g, ends)
        rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        full_end = m_start + ((m_end - m_start) // BLOCK_M) * BLOCK_M
        if USE_TMA:
            # Whole chunks by TMA; the one partial chunk below masks the next group's rows
            # (zeroing TMA-loaded data in registers would cost a shared-memory round trip).
            for m0 in tl.range(m_start, full_end, BLOCK_M, warp_specialize=WARP_SPECIALIZE == 1):
                a = a_desc.load([m0, pid_k * BLOCK_K])
                d = d_desc.load([m0, pid_n * BLOCK_N])
                acc = tl.dot(a.T, d, acc, input_precision=INPUT_PRECISION)
            tail_start = full_end
        else:
            tail_start = m_start
        for m0 in range(tail_start, m_end, BLOCK_M):
            rows = m0 + rm
            row_ok = rows < m_end
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak,
                        mask=row_ok[:, None] & (rk[None, :] < K), other=0.0)
            d = tl.load(d_ptr + rows[:, None].to(tl.int64) * stride_dm + rn[None, :] * stride_dn,
                        mask=row_ok[:, None] & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a.T, d, acc, input_precision=INPUT_PRECISION)

        out_ptrs = (out_ptr + g.to(tl.int64) * stride_og + rk[:, None].to(tl.int64) * stride_ok
                    + rn[None, :] * stride_on)
        out_mask = (rk[:, None] < K) & (rn[None, :] < N)
        if ACCUMULATE:
            keep = True
            if HAS_MASK:
                keep = tl.load(mask_ptr + g) != 0
            if keep:
                if TMA_STORE:
                    old = out_desc.load([g, pid_k * BLOCK_K, pid_n * BLOCK_N])
                    old = old.reshape(BLOCK_K, BLOCK_N)
                else:
                    old = tl.load(out_ptrs, mask=out_mask, other=0.0)
                acc += old.to(tl.float32)
        c = acc.to(out_ptr.dtype.element_ty)
        if TMA_STORE:
            out_desc.store([g, pid_k * BLOCK_K, pid_n * BLOCK_N], c.reshape(1, BLOCK_K, BLOCK_N))
        else:
            tl.store(out_ptrs, c, mask=out_mask)


@triton.jit
def _grouped_sum_kernel(
    x_ptr, out_ptr, offs_ptr,
    M, N, G,
    stride_xm, stride_xn, stride_og, stride_on,
    G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[g, n] = sum of x[r, n] over the rows r of group g; fp32 accumulation, fixed order."""
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    g_vec = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + g_vec, mask=g_vec < G, other=0)
    prev = tl.load(offs_ptr + g_vec - 1, mask=(g_vec >= 1) & (g_vec <= G), other=0)
    starts, ends = _group_bounds(ends, prev, M)
    m_start = _pick(g_vec, g, starts)
    m_end = _pick(g_vec, g, ends)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows = m0 + rm
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + rn[None, :] * stride_xn,
                    mask=(rows[:, None] < m_end) & (rn[None, :] < N), other=0.0)
        acc += x.to(tl.float32)
    total = tl.sum(acc, 0)
    tl.store(out_ptr + g * stride_og + rn * stride_on, total.to(out_ptr.dtype.element_ty),
             mask=rn < N)


# ----------------------------------------------------------------------------------------
# Launchers


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if _INTERPRET or device_index is None:
        return 4  # a few programs so that the interpreter exercises the persistent loop
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(t: torch.Tensor) -> int | None:
    return t.device.index if t.device.type == "cuda" else None


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_tma_scratch() -> None:
    """Device-side tensor descriptors need a small global scratch buffer per launch.

    Triton keeps the allocator in a ContextVar, so it is set on every launch: autograd runs
    backward in threads of its own, which would otherwise see no allocator.
    """
    triton.set_allocator(_tma_scratch)


@functools.lru_cache(maxsize=None)
def cpp_wrapper_scratch_covers_grid() -> bool:
    """Whether inductor's C++ wrapper gives a Triton launch global scratch for every program.

    Device-side tensor descriptors live in that scratch, one slot per program at pid * size.
    Triton's own launcher allocates size x grid; the C++ wrapper of cpp_wrapper and
    AOTInductor allocated one program's size until torch fixed it (torch 2.13 scales by the
    grid; the torch 2.11 of the GPU image does not), so every other program wrote its
    descriptors past the buffer. The fix shows in the generated allocation, so this looks
    for the grid there rather than guessing the release.
    """
    try:
        import inspect

        from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides

        return "grid_0" in inspect.getsource(CUDADeviceOpOverrides.cpp_scratch)
    except Exception:  # the internals moved: assume the old allocation
        return False


def _traced(tensors) -> bool:
    """Whether these are tensors of a trace rather than data. torch 2.11 reports
    torch.compiler.is_compiling() False while AOTAutograd traces an op's body (whose
    tensors are FunctionalTensors there), so the tensors' types and dynamo's tracing context
    are asked too. An eager launch pays about 1.5 us here (CPU host)."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return True
    return TracingContext.try_get() is not None


def device_descriptors_ok(*tensors: torch.Tensor) -> bool:
    """False while inductor traces a graph for a C++ wrapper whose scratch is one program's
    (cpp_wrapper, AOTInductor; see cpp_wrapper_scratch_covers_grid): the kernels then take
    pointer loads and stores. The static-shape MoE block of tests/test_gpu_lowering.py gave
    wrong rows (values of 1e37, or NaN) on its first cpp_wrapper call on the H200 with torch
    2.11 before this, and the right ones after it."""
    if not _traced(tensors):
        return True
    config = sys.modules.get("torch._inductor.config")  # read only in a trace: 2-4 us
    return config is None or not config.cpp_wrapper or cpp_wrapper_scratch_covers_grid()


def _use_tma(*tensors: torch.Tensor) -> bool:
    """TMA loads when the strides allow them, COMPILED_MOE_TMA is not 0 and the launch gets
    the descriptors' scratch (device_descriptors_ok).

    The interpreter runs the TMA path too (it emulates descriptors), so the CPU tier tests it.
    """
    if (os.environ.get("COMPILED_MOE_TMA", "1") == "0" or not _tma_ok(*tensors)
            or not device_descriptors_ok(*tensors)):
        return False
    if tensors[0].device.type == "cuda":
        _ensure_tma_scratch()
    return True


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit inner stride and 16-byte aligned base and outer strides.

    The base is checked through the storage offset (allocations are 256-byte aligned), not
    data_ptr(), which fake tensors under torch.compile do not have.
    """
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or (t.storage_offset() * es) % 16:
            return False
        if any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _pad_groups(num_groups: int) -> int:
    return max(16, triton.next_power_of_2(num_groups))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor) -> None:
    """out (M, N) = grouped a (M, K) @ b (G, K, N) (+ bias (G, N)), written everywhere."""
    M, K = a.shape
    G, _, N = b.shape
    G = int(G)  # the number of groups is specialised under torch.compile: G_PAD is a constexpr
    if M == 0 or N == 0:
        return
    offs = offs.contiguous()  # the kernels read offs[g] at offs_ptr + g
    b_k_contiguous = b.stride(1) == 1 and b.stride(2) != 1
    cfg = grouped_mm_config(size_hint(N), size_hint(K), a.dtype, a.device.type)
    b_inner = b.transpose(1, 2) if b_k_contiguous else b
    use_tma = K > 0 and _use_tma(a, b_inner)  # no descriptor over an empty K dimension
    # The TMA store stages a whole output tile in shared memory: the bf16 tile's stages leave
    # room for a 2-byte one only (a bf16 -> fp32 call asked for 272 KB, the limit is 227 KB).
    tma_store = use_tma and _tma_ok(out) and out.element_size() <= a.element_size()
    num_programs = _num_sms(_device_index(a)) * cfg.ctas_per_sm
    has_bias = bias is not None
    traceable(_grouped_mm_kernel)[(num_programs,)](
        a, b, out, bias if has_bias else out, offs,
        M, N, K, G,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        bias.stride(0) if has_bias else 0, bias.stride(1) if has_bias else 0,
        G_PAD=_pad_groups(G),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, HAS_BIAS=has_bias, USE_TMA=use_tma, TMA_STORE=tma_store,
        B_K_CONTIGUOUS=b_k_contiguous, WARP_SPECIALIZE=cfg.warp_specialize,
        INPUT_PRECISION=_input_precision(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def grouped_mm_wgrad(a: torch.Tensor, grad_out: torch.Tensor, offs: torch.Tensor,
                     out: torch.Tensor, accumulate: bool,
                     accumulate_mask: torch.Tensor | None) -> None:
    """out[g] (K, N) (+)= a_g^T @ grad_out_g; out may have any strides."""
    M, K = a.shape
    N = grad_out.shape[1]
    G = int(out.shape[0])  # specialised under torch.compile: G_PAD is a constexpr
    if K == 0 or N == 0:
        return
    offs = offs.contiguous()
    if accumulate_mask is not None:
        accumulate_mask = accumulate_mask.contiguous()
    cfg = grouped_mm_wgrad_config(max(1, size_hint(M) // G), size_hint(K), size_hint(N),
                                  a.dtype, a.device.type)
    use_tma = M > 0 and _use_tma(a, grad_out)
    # As in the forward: the stages leave room for a staged output tile of the inputs' element
    # size only (bf16 inputs into an fp32 main_grad at 512 rows a group or more, 64 x 256 x 128
    # tiles: 272 KB asked for, 227 KB there).
    tma_store = use_tma and _tma_ok(out) and out.element_size() <= a.element_size()
    num_programs = _num_sms(_device_index(a)) * cfg.ctas_per_sm
    has_mask = accumulate_mask is not None
    traceable(_grouped_mm_wgrad_kernel)[(num_programs,)](
        a, grad_out, out, accumulate_mask if has_mask else offs, offs,
        M, K, N, G,
        a.stride(0), a.stride(1),
        grad_out.stride(0), grad_out.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        G_PAD=_pad_groups(G),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        NUM_SMS=num_programs, ACCUMULATE=accumulate, HAS_MASK=has_mask, USE_TMA=use_tma,
        TMA_STORE=tma_store, WARP_SPECIALIZE=cfg.warp_specialize,
        INPUT_PRECISION=_input_precision(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def grouped_sum(x: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
    """out (G, N) = per-group sums of x's rows (M, N)."""
    M, N = x.shape
    G = int(out.shape[0])  # specialised under torch.compile: G_PAD is a constexpr
    if N == 0:
        return
    offs = offs.contiguous()
    cfg = grouped_sum_config(size_hint(N), x.device.type)
    grid = (G, triton.cdiv(N, cfg.block_n))
    traceable(_grouped_sum_kernel)[grid](
        x, out, offs, M, N, G,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        G_PAD=_pad_groups(G), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
