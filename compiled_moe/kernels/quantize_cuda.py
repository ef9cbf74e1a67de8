"""Launcher of the CUDA columnwise quantize kernels in ``csrc/grouped_quantize.cu``.

``grouped_quantize`` of 2-D x with columnwise output and recipe fp8_blockwise runs them on GPUs
with the e4m3 conversion instruction (sm_89 and later), when x's rows are 16-byte aligned
8-column chunks (``supported``); with rowwise output too, the same launch writes the rowwise
blocks (x is read once). Everything else runs the Triton kernels of ``kernels/quantize.py``.
Both give the reference's bits.
"""

from __future__ import annotations

import functools
import os

import torch

from compiled_moe import native, reference
from compiled_moe.kernels.configs import quantize_columns_cuda_config
from compiled_moe.kernels.grouped_mm import _num_sms

RECIPES = ("fp8_blockwise",)  # mxfp8: see csrc/grouped_quantize.cu
_THREADS = 256
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def enabled() -> bool:
    """COMPILED_MOE_QUANTIZE=triton turns the CUDA kernels off (for comparisons)."""
    return os.environ.get("COMPILED_MOE_QUANTIZE", "cuda") != "triton"


def supported(x, recipe: str) -> bool:
    """Static conditions (known while tracing): recipe, device, dtype and x's layout. The
    address is checked at launch, where the Triton kernels take over if it is unaligned."""
    if recipe not in RECIPES or not enabled() or x.dim() != 2 or x.dtype not in _SUFFIX:
        return False
    if x.device.type != "cuda" or not _has_e4m3_conversion(x.device.index or 0):
        return False
    return (x.shape[1] % 8 == 0 and x.stride(1) == 1
            and (x.stride(0) * x.element_size()) % native.TMA_ALIGN == 0)


@functools.lru_cache(maxsize=None)
def _has_e4m3_conversion(device_index: int) -> bool:
    """sm_89 and later convert fp32 to e4m3 in one instruction; NVRTC must be there too."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9) and native.available()


def aligned(x) -> bool:
    return x.data_ptr() % native.TMA_ALIGN == 0


_SHARED_LIMIT = 227 * 1024


def _tile(recipe: str) -> tuple[int, int]:
    """(rows, columns) of the kernel's item tile: a column block's rows x 16 K elements."""
    rows = reference.fp8_column_block(recipe)
    return rows, 16 * 1024 // rows


def shared_bytes(dtype: torch.dtype, recipe: str, slots: int) -> int:
    """A block's shared memory (csrc/grouped_quantize.cu, Layout): two stages of the x tile, the
    transposing buffer, the column amax partials and scales, 32 scan ints, the slot table."""
    rows, cols = _tile(recipe)
    esize = 4 if dtype == torch.float32 else 2
    return (2 * rows * cols * esize + cols * rows + (rows // 8) * cols * 4 + 2 * cols * 4
            + 32 * 4 + (slots + 1) * 4)


def fits(x, recipe: str, slots: int) -> bool:
    """The slot table fits in shared memory beside the tiles (up to about 35 K slots for 16-bit x,
    M of about 4.4 M rows; 19 K for fp32); larger inputs run the Triton kernels."""
    return shared_bytes(x.dtype, recipe, slots) <= _SHARED_LIMIT


def quantize_group_columns(x, offs, col_q, col_s, row_q, row_s, recipe: str,
                           slot_group=None) -> None:
    """Columnwise blocks of x (M, K) inside the groups of offs into col_q (K, M) / col_s (K, S)
    and, when row_q is not None, the rowwise blocks into row_q (M, K) / row_s. The caller checked
    ``supported``, ``aligned`` and ``fits``; outputs as ``ops.fp8._quantize_outputs`` makes them.
    slot_group (default: the config's): slots per band of the kernel's item order."""
    M, K = x.shape
    if K == 0:
        return
    G, S = offs.shape[0], col_s.shape[1]
    num_tiles = -(-K // _tile(recipe)[1])
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    shared = shared_bytes(x.dtype, recipe, S)
    rowwise = row_q is not None
    cfg = quantize_columns_cuda_config(shared, rowwise)
    grid = max(1, min(cfg.ctas_per_sm * _num_sms(dev), S * num_tiles))
    rq, rs = (row_q, row_s) if rowwise else (col_q, col_s)  # unused pointers when not rowwise
    name = f"quantize_{'rows_columns' if rowwise else 'columns'}_{recipe}_{_SUFFIX[x.dtype]}"
    i32, i64 = native.int32, native.int64
    native.launch_driver(native.kernel("grouped_quantize", name, dev), grid, _THREADS, shared,
                         x, i64(x.stride(0)), offs.contiguous(), i32(M), i32(K), i32(G), i32(S),
                         i32(max(1, slot_group or cfg.group_m)),
                         col_q, i64(col_q.stride(0)), col_s, i64(col_s.stride(0)),
                         rq, i64(rq.stride(0)), rs, i64(rs.stride(0)))
