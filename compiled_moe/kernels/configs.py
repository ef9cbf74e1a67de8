"""Tile configurations of the Triton kernels, apart from the kernels.

Set ``COMPILED_MOE_LOG_CONFIG=1`` to print every choice the first time it is made.
Numbers in comments were measured on an H200 (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import torch


def size_hint(x) -> int:
    """A concrete value of a size that may be symbolic under torch.compile, read without a guard:
    tile choice never changes results, so a compiled graph may keep one tile for all sizes."""
    if isinstance(x, int):
        return x
    hint = getattr(getattr(x, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # Producer/consumer warps (tl.range(warp_specialize=True)): 0 none, 1 on the K loop, 2 on the
    # tile loop. On Triton 3.6 for sm_90 it is a no-op: the grouped GEMM, FP8 and fused FC1
    # kernels compile to the same PTX with 0, 1 or 2, and the weight-gradient kernel fails to
    # compile with 1 or 2 (NVGPUWarpSpecialization). Kept for newer Triton versions.
    warp_specialize: int = 0
    ctas_per_sm: int = 1  # persistent programs per SM: 2 lets one's epilogue overlap the other
    epilogue_tma: int = 0  # fused FC1: epilogue tiles (h, out) by TMA instead of pointers
    cluster: int = 1  # CUDA kernels: CTAs of a cluster that share an operand tile by TMA multicast
    skip_past_rows: int = 0  # CUDA bf16 forward/dgrad: 1 runs the kernel whose idle consumer skips

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
                f"GROUP_M={self.group_m} warps={self.num_warps} stages={self.num_stages} "
                f"warp_specialize={self.warp_specialize} ctas_per_sm={self.ctas_per_sm} "
                f"epilogue_tma={self.epilogue_tma} cluster={self.cluster} "
                f"skip_past_rows={self.skip_past_rows}")


def _log(kind: str, key: tuple, cfg: object) -> None:
    """Print a heuristic's choice (a tile, or a path) under COMPILED_MOE_LOG_CONFIG=1."""
    if os.environ.get("COMPILED_MOE_LOG_CONFIG", "0") not in ("", "0"):
        print(f"compiled_moe: {kind} {key} -> {cfg}", file=sys.stderr)


# The Triton interpreter (CPU tier) runs every program in Python: small tiles keep it quick
# while still crossing group boundaries and K/N tails.
_INTERPRETER_TILE = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


def _env_override() -> TileConfig | None:
    """COMPILED_MOE_TILE="BM,BN,BK,GROUP_M,warps,stages[,warp_specialize[,ctas_per_sm[,epilogue_tma[,cluster[,skip_past_rows]]]]]" forces
    one tile (benchmark sweeps)."""
    spec = os.environ.get("COMPILED_MOE_TILE")
    if not spec:
        return None
    return TileConfig(*(int(v) for v in spec.split(",")))


def _choose(kind: str, key: tuple, device_type: str, heuristic) -> TileConfig:
    """The interpreter tile on CPU, else COMPILED_MOE_TILE if set, else the heuristic's tile."""
    if device_type != "cuda":
        cfg = _INTERPRETER_TILE
    else:
        cfg = _env_override() or heuristic()
    _log(kind, key, cfg)
    return cfg


@functools.lru_cache(maxsize=None)
def grouped_mm_config(n: int, k: int, dtype: torch.dtype, device_type: str) -> TileConfig:
    """Tile of the forward/dgrad kernel: out (M, N) = a (M, K) @ b[g] (K, N).

    Independent of M (the token count), so a compiled graph keeps one tile for every step.
    """
    def heuristic():
        if dtype == torch.float32:
            return TileConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
        # 128x256x64, 8 warps, 3 stages was the fastest or within 3% of it on every bf16
        # shape of the benchmark (H200 sweep; 4 stages no longer fit beside the TMA-store
        # buffer). A sweep also timed warp_specialize=2 at +7% to -3% per shape: the same PTX
        # (see TileConfig.warp_specialize), so that is the spread between runs.
        return TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)

    return _choose("grouped_mm", (n, k, str(dtype)), device_type, heuristic)


@functools.lru_cache(maxsize=None)
def grouped_mm_wgrad_config(rows_per_group: int, k: int, n: int, dtype: torch.dtype,
                            device_type: str) -> TileConfig:
    """Tile of the weight-gradient kernel: out[g] (K, N) = a_g^T (K, m_g) @ grad_g (m_g, N).

    BLOCK_M is the reduction chunk over a group's rows, BLOCK_K x BLOCK_N the output tile.
    ``rows_per_group`` is M / G, the mean group size.
    """
    def heuristic():
        if dtype == torch.float32:
            return TileConfig(block_m=32, block_n=128, block_k=128, num_warps=8, num_stages=3)
        if rows_per_group < 512:
            # Few rows per group: a tile is two to eight short chunks and then a large output
            # store, so latency, not the MMAs, sets the pace. Two programs per SM overlap one's
            # epilogue with the other's loads: GPT-OSS fc1 wgrad 0.80x -> 0.96x of
            # torch._grouped_mm, Qwen3 fc1 0.81x -> 0.88x (H200 sweep).
            return TileConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3,
                              ctas_per_sm=2)
        return TileConfig(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3)

    return _choose("grouped_mm_wgrad", (rows_per_group, k, n, str(dtype)), device_type,
                   heuristic)


@functools.lru_cache(maxsize=None)
def mlp_fc1_config(inter: int, k: int, gated: bool, interleaved: bool, dtype: torch.dtype,
                   device_type: str) -> TileConfig:
    """Tile of the fused FC1 (kernels/moe_mlp.py): BLOCK_M rows x BLOCK_N activation columns.

    Gated activations compute BLOCK_N gate and BLOCK_N up columns per program, so BLOCK_N is
    half the grouped GEMM's 256-column tile: the same accumulator size.
    H200 sweeps (skewed routing, microseconds, the unfused grouped_mm + moe_activation in the
    same run in brackets). Qwen3 T = 8192 (M = 65536, H = 2048, I = 768, stacked), 128x128x64,
    8 warps: 3 stages 847 (860), with the TMA epilogue 837, warp_specialize=2 829 (the same
    PTX: run-to-run spread, see TileConfig.warp_specialize), 4 stages with the TMA epilogue
    764; an earlier run: 2 CTAs/SM 882, 128x64 997-1086, 64x128 1068. GPT-OSS (interleaved,
    M = 16384): 3 stages 1646 (1815); the TMA epilogue's 128x256 h tile does not fit in shared
    memory beside 3 stages.
    """
    def heuristic():
        if dtype == torch.float32:
            return TileConfig(block_m=128, block_n=64 if gated else 128, block_k=32,
                              num_warps=8, num_stages=3)
        if gated and not interleaved:
            return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                              epilogue_tma=1)
        return TileConfig(block_m=128, block_n=128 if gated else 256, block_k=64, num_warps=8,
                          num_stages=3)

    return _choose("mlp_fc1", (inter, k, gated, interleaved, str(dtype)), device_type,
                   heuristic)


def mlp_gathers_input(inter: int) -> bool:
    """Whether the fused experts block lets FC1 read hidden rows through the routing map
    (pointer loads) instead of permuting them first (one copy, then TMA loads).

    The gather saves a copy of M x H but slows every K step of FC1, whose work grows with I.
    H200, fused vs unfused block, compiled, GPU time from torch.profiler: Qwen3 (I = 768)
    forward 1.05x; DeepSeek-V3 (I = 2048) and GPT-OSS (I = 2880) level; Mixtral (I = 14336)
    fused FC1 3.36 ms against 2.81 ms for the grouped GEMM plus 0.06 ms of permute.
    """
    return inter <= 4096  # no _log: moe_experts calls this where dynamo traces (guards)


# A grouped GEMM's multiply-adds from which the fused expert MLP runs it on the CUDA kernel:
# about 50 us of GPU time on an H200.
FUSED_MLP_CUDA_GEMM_MACS = 2 ** 34
# The intermediate size from which the fused MLP's FC1 is the CUDA GEMM plus the activation
# kernel instead of the fused Triton FC1 (see fused_mlp_fc1_on_cuda).
FUSED_MLP_FC1_CUDA_MIN_INTER = 2048


# Weight bytes (of the experts a GEMM can touch) from which the fused MLP runs a GEMM with a few
# rows a group on the CUDA kernel, for its split K: about 35 us of streaming on an H200.
FUSED_MLP_CUDA_STREAM_BYTES = 2 ** 27


def _streams_weights_on_cuda(rows: int, n: int, k: int, groups: int) -> bool:
    """A few rows a group (a model decoding): the CUDA kernel cuts the tiles' k steps into
    ranges (grouped_mm_sm90_split_k) where the Triton kernels leave SMs idle. Mixtral at T = 1
    (H200, bench_decode.py, CUDA-graph replay): FC2 80 us against 169-172 on Triton. Only where the
    weights take longer to stream than the host time of a call back into Python."""
    return (rows > 0 and min(groups, rows) * n * k * 2 >= FUSED_MLP_CUDA_STREAM_BYTES
            and grouped_mm_sm90_split_k(rows, n, k, groups) > 1)


def fused_mlp_fc2_on_cuda(rows: int, n: int, k: int, groups: int) -> bool:
    """Whether moe_mlp runs FC2's grouped GEMMs (forward and input gradient) on the Hopper CUDA
    kernel (csrc/grouped_mm.cu) rather than the Triton one; either way only where the CUDA
    kernel applies. FC2's forward: rows x k -> n in `groups` experts.

    In a compiled graph the CUDA kernel is an opaque op: each call goes back into Python, about
    20-80 us of host time under cpp_wrapper (RESULTS.md, host time), where inductor launches the
    Triton kernel itself. So small problems, whose graphs wait on the host, keep Triton. Large
    ones take the CUDA kernel: compiled fused experts block, H200, skewed routing, CUDA over
    Triton, forward 1.00-1.05x (Qwen3 T = 8192: 1.05x), forward+backward 1.00-1.01x, outputs
    bitwise equal (RESULTS.md, fused MLP). With a few rows a group, FC2 runs there too where
    its weights are large (_streams_weights_on_cuda)."""
    on_cuda = (rows * n * k >= FUSED_MLP_CUDA_GEMM_MACS
               or _streams_weights_on_cuda(rows, n, k, groups))
    _log("fused_mlp_fc2_on_cuda", (rows, n, k, groups), on_cuda)
    return on_cuda


def fused_mlp_fc1_on_cuda(inter: int, rows: int, n: int, k: int, groups: int) -> bool:
    """Whether moe_mlp's forward runs FC1 as the CUDA grouped GEMM (rows gathered first when
    the op gathers them, into a buffer freed after FC1), then the activation kernel, instead
    of the fused Triton FC1. Backward and the memory it keeps are the same either way.

    H200, skewed routing, us (benchmarks/bench_moe_mlp.py --kernels: the fused Triton FC1
    against grouped_mm + moe_activation on sorted rows): DeepSeek-V3 (I = 2048) 3237 against
    3149, Mixtral (I = 14336) 3261 against 3206, GPT-OSS (I = 2880) 1690 against 1537; Qwen3
    (I = 768) 815 against 854, so it keeps the fused kernel. Small problems keep it for the
    host time (fused_mlp_fc2_on_cuda); with a few rows a group and large weights FC1 (rows x k
    -> n in `groups` experts) takes the CUDA kernel at any I, for its split K
    (_streams_weights_on_cuda)."""
    on_cuda = ((rows * n * k >= FUSED_MLP_CUDA_GEMM_MACS and inter >= FUSED_MLP_FC1_CUDA_MIN_INTER)
               or _streams_weights_on_cuda(rows, n, k, groups))
    _log("fused_mlp_fc1_on_cuda", (inter, rows, n, k, groups), on_cuda)
    return on_cuda


def fp8_group_rows(num_experts: int) -> int:
    """The row multiple the FP8 experts block rounds each expert's group up to (moe_route's
    pad_multiple; at least 16, so the FP8 weight-gradient kernel reads groups by TMA).

    32 where experts are few, so groups are large and the padding cheap: a group that starts
    on a 32-row boundary gives the columnwise quantizer whole 32-byte sectors of col_q (K, M)
    to write; starting 16 rows off, the sectors it shares with the next group are written
    half at a time. H200, grouped_quantize fp8_blockwise rows and columns, GPU time, groups
    on 16 rows against 32 (col_q's row stride padded to 128 bytes): 447.6 against 337.7 us at
    DeepSeek-V3 EP8's 33008 x 7168 (0.50 against 0.67 of copy bandwidth), Qwen3 215.3 /
    179.5, Mixtral 54.1 / 47.7, GPT-OSS 85.3 / 85.8. The FP8 block's
    forward+backward (same process, bitwise equal gradients), 16 against 32 rows: DeepSeek-V3
    EP8 (32 experts) 1.033x faster, Mixtral (8) 1.012x; with 128 experts the extra rows cost
    more than the stores save: Qwen3 0.987x, GPT-OSS 0.997x. (With the quantizer's 16-byte row
    stores the quantizer alone runs at about the same speed on both; the block's figures above
    predate them: benchmarks/JOURNAL.md.)
    """
    return 32 if num_experts <= 32 else 16


@functools.lru_cache(maxsize=None)
def grouped_sum_config(n: int, device_type: str) -> TileConfig:
    """Tile of the grouped row sum (bias gradient): one program per (group, BLOCK_N columns)."""
    if device_type != "cuda":
        return _INTERPRETER_TILE
    return TileConfig(block_m=64, block_n=128, block_k=1, num_warps=4, num_stages=1)


# moe_route runs as one Triton program (kernels.routing.route_one_program) up to this many
# (token, slot) pairs and with a token count known when the graph is built; larger or symbolic
# routings run the two NVRTC kernels of csrc/moe_route.cu. GPU time on the H200, one program
# against the NVRTC kernels, 8-256 experts (`python benchmarks/bench_experts.py
# --small-routes`, 4 warps): 4.8-5.5 / 8.8-9.8 us at 16 pairs, 7.5-7.8 / 9.7-10.3 us at 512,
# 13.2-13.9 / 10.1-11.6 us at 1024, 72-77 / 10-12 us at 4096 (the sort grows as n log^2 n on
# one SM). With 8 warps (a sweep of 4-32 warps, same process): 6.8-7.8 us at 512 pairs,
# 10.0-10.8 at 1024 against 10.2-11.4 for the NVRTC kernels, 22-24 at 2048 against 10.4-12.2.
ROUTE_ONE_PROGRAM_PAIRS = 1024

# Eager calls of up to this many (token, slot) pairs run the experts block as one call of the
# C++ host layer forward and one backward (host.py; local_experts.py's host_block_applies): route,
# gather, the CUDA GEMMs, activation, combine and their gradients. Below it a step's host time
# exceeds its GPU time (a decoding model or a small batch: T = 1-512 tokens at k = 8); above
# it the fused path's Triton FC1, which gathers rows and applies the activation in its
# epilogue, is the faster GPU work at I < 2048.
HOST_BLOCK_MAX_PAIRS = 4096


@functools.lru_cache(maxsize=None)
def route_one_program_config(pairs: int, num_experts: int, device_type: str) -> TileConfig:
    """One-program route: BLOCK_M = the sort's length (pairs, a power of two), BLOCK_N = the
    histogram's bins (experts, a power of two). Both must cover the whole problem, in the
    interpreter too."""
    block_pairs = max(16, 1 << (max(pairs, 1) - 1).bit_length())
    block_experts = max(16, 1 << (num_experts - 1).bit_length())
    warps = 4 if block_pairs < 512 else 8  # see ROUTE_ONE_PROGRAM_PAIRS
    cfg = TileConfig(block_m=block_pairs, block_n=block_experts, block_k=1, num_warps=warps,
                     num_stages=1)
    _log("route_one_program", (pairs, num_experts, device_type), cfg)
    return cfg


@functools.lru_cache(maxsize=None)
def activation_config(inter: int, device_type: str) -> TileConfig:
    """Pointwise activation tile: BLOCK_M rows x BLOCK_N output columns (gate and up both read)."""
    if device_type != "cuda":
        return _INTERPRETER_TILE
    return TileConfig(block_m=16, block_n=256, block_k=1, num_warps=4, num_stages=1)


@functools.lru_cache(maxsize=None)
def quantize_config(kind: str, device_type: str, cols: int = 0) -> TileConfig:
    """Tiles of the FP8 quantize kernels (kernels/quantize.py), by kernel kind; ``cols`` is the
    length of the rows being quantized (a size hint: tiles never change results).

    The kernels are memory-bound when a program moves about 8K elements (16 KB of bf16) in
    16-byte accesses and its registers leave room for two or more programs per SM; fewer
    elements per thread repeat the per-block scale math and the group lookup more often.
      rows                    fp8_rowwise: BLOCK_M rows x BLOCK_N columns, whole rows of up
                              to 8192 columns in registers (read once)
      tiles_1x128, tiles_1x32 rowwise blocks: BLOCK_M rows x BLOCK_N columns (2 KB per row)
      tiles_128x128           weights (quantized once per step)
      group_columns_<rows>[_rowwise]  columnwise blocks of 128 (fp8_blockwise) or 32 (mxfp8)
                              rows, BLOCK_N columns per program, BLOCK_M rows of the block in
                              registers at a time; _rowwise also writes the rowwise blocks.
                              The fused 128 x 128 tile in one step took 169-196 registers a
                              thread (one program per SM), in two steps of 64 rows 127.
      group_columns_whole     fp8_rowwise columnwise: BLOCK_M-row steps through a group
    Chosen from sm_90 instruction counts and registers; H200 figures with these tiles (fraction
    of copy bandwidth, benchmarks/bench_quantize.py): rowwise-only 0.75-0.92, row+col 0.32-0.42
    (the tiles before: 0.38-0.50 and 0.09-0.21). Alternatives: bench_quantize.py --tiles.
    group_columns_128 alone (column launch, fraction of copy, DeepSeek-V3 / Qwen3): 128 x 64 at
    4 warps 0.47 / 0.45 (128 registers); 128 x 32 at 2 warps 0.48 / 0.45, at 4 warps 0.41 /
    0.38; 128 x 64 at 8 warps 0.35 / 0.32; 128 x 128 at 8 warps 0.40 / 0.36; 64-row steps
    0.37-0.39 / 0.35-0.37.
    """
    if device_type != "cuda":
        return _INTERPRETER_TILE
    row_cols = min(8192, max(128, 1 << (max(cols, 1) - 1).bit_length()))
    tiles = {
        "rows": TileConfig(block_m=max(1, 8192 // row_cols), block_n=row_cols, block_k=1,
                           num_warps=8),
        "tiles_1x128": TileConfig(block_m=8, block_n=1024, block_k=1, num_warps=8),
        "tiles_1x32": TileConfig(block_m=8, block_n=1024, block_k=1, num_warps=8),
        "tiles_128x128": TileConfig(block_m=128, block_n=128, block_k=1, num_warps=8),
        "group_columns_128": TileConfig(block_m=128, block_n=64, block_k=1, num_warps=4),
        "group_columns_128_rowwise": TileConfig(block_m=64, block_n=128, block_k=1,
                                                num_warps=8),
        "group_columns_32": TileConfig(block_m=32, block_n=256, block_k=1, num_warps=4),
        "group_columns_32_rowwise": TileConfig(block_m=32, block_n=256, block_k=1,
                                               num_warps=4),
        "group_columns_whole": TileConfig(block_m=32, block_n=128, block_k=1, num_warps=4),
    }
    cfg = tiles[kind]
    _log(f"quantize {kind}", (cols,), cfg)
    return cfg


@functools.lru_cache(maxsize=None)
def quantize_columns_cuda_config(stage_bytes: int, other_bytes: int, rowwise: bool
                                 ) -> TileConfig:
    """Ring stages and item order of the persistent CUDA columnwise quantize kernels
    (csrc/grouped_quantize.cu: one CTA per SM, a fixed 128 x 128 tile). stage_bytes: one stage;
    other_bytes: the rest of a CTA's shared memory. H200, bf16 row+col, the FC1 inputs of the four
    model shapes (benchmarks/RESULTS.md):
      num_stages  4 where they fit: 1.00-1.11x the speed of 6 in three runs (the consumers, not
                  the loads, set the pace).
      group_m     slots per band of the item order: 16 with the rowwise blocks, else one band of
                  all slots. Bands of 1, 2, 4, 8 and 64 slots ran 0.93-1.05x the speed of 16
                  (the extremes: DeepSeek-V3 with one slot, Mixtral with 64)."""
    def heuristic():
        stages = max(2, min(4, (_HOPPER_SHARED_PER_SM - 1024 - other_bytes) // (stage_bytes + 40)))
        return TileConfig(block_m=0, block_n=0, block_k=0, group_m=16 if rowwise else 2**30,
                          num_warps=0, num_stages=stages, ctas_per_sm=1)

    return _choose("quantize_columns_cuda", (stage_bytes, other_bytes, rowwise), "cuda", heuristic)


@functools.lru_cache(maxsize=None)
def scaled_grouped_mm_config(n: int, k: int, recipe: str, device_type: str) -> TileConfig:
    """Tile of the FP8 forward/dgrad kernel. BLOCK_K is 128 for fp8_blockwise (one scale block
    per dot) and a multiple of 32 for mxfp8."""
    if device_type != "cuda":
        return TileConfig(block_m=16, block_n=16, block_k=128 if recipe == "fp8_blockwise" else 32,
                          group_m=2, num_warps=1, num_stages=1)

    def heuristic():
        if recipe == "mxfp8":  # bf16 dots on dequantized chunks: the bf16 kernel's shape
            return TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
        # H200 sweep, uniform fc1 of DeepSeek-V3 / Qwen3 (TFLOP/s, blockwise and rowwise):
        # 128x128, 4 stages 687/577 and 1009/706 (timed with warp_specialize=2, the same PTX);
        # 128x256 492/430 and 921/707; 128x128 at 2 CTAs/SM 678/567 and 816/612; 64x256 at
        # 2 CTAs/SM 349/336. Blockwise waits for every 128-deep dot before scaling it (one
        # wgmma.wait_group 0 per dot in the PTX): the reason it trails rowwise.
        return TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)

    return _choose("scaled_grouped_mm", (n, k, recipe), device_type, heuristic)


@functools.lru_cache(maxsize=None)
def scaled_grouped_mm_wgrad_config(rows_per_group: int, k: int, n: int, recipe: str,
                                   device_type: str) -> TileConfig:
    """Tile of the FP8 weight-gradient kernel: BLOCK_M is the reduction chunk over a group's
    rows and must be whole columnwise scale blocks (128 for fp8_blockwise, 32s for mxfp8)."""
    if device_type != "cuda":
        return TileConfig(block_m={"fp8_blockwise": 128, "mxfp8": 32}.get(recipe, 16),
                          block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)

    def heuristic():
        # H200 sweep, uniform fc1 wgrad of Qwen3 / DeepSeek-V3 (TFLOP/s, blockwise): a 64x128
        # output tile at 2 CTAs/SM 259/489; 128x128 (8 warps) 180/344; 128x256 238/416;
        # 128x128 at 2 CTAs/SM 86/158.
        return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3,
                          ctas_per_sm=2)

    return _choose("scaled_grouped_mm_wgrad", (rows_per_group, k, n, recipe), device_type,
                   heuristic)


_HOPPER_L2_BYTES = 50 * 2**20  # H100 and H200
_HOPPER_SHARED_PER_SM = 228 * 1024  # shared memory of an SM (a block: at most 227 KB)


@functools.lru_cache(maxsize=None)
def fp8_blockwise_sm90_config(m: int, n: int, k: int, groups: int) -> TileConfig:
    """Tile of the CUDA FP8 blockwise kernel (csrc/fp8_grouped_mm.cu): BLOCK_M and BLOCK_K are
    fixed at 128 (two consumer warpgroups of 64 rows, one scale block per k step). m is the
    token-count hint.

    BLOCK_N 256 where the groups average 128 rows or more (training shapes): the consumers read
    a from registers and run two 128-column products a step with one buffer of partial
    products. On the H200, same process against 128 x 128 (`tools/ab_variants.py fp8-forward 1,5
    1,3,256`, outputs bitwise equal): 1.07-1.12x on DeepSeek-V3, Qwen3 (T = 4096) and Mixtral,
    0.99-1.05x on GPT-OSS, geometric mean 1.081x. With fewer rows a group (serving) it loses
    (`--serving`, T = 1-512: 0.68-1.03x below 128 rows a group, where half as many tiles stream
    the weights; at 128 rows a group, DeepSeek-V3 and Mixtral at T = 512, 1.01-1.05x). Its ring
    holds 3 stages of 48 KB beside 64 KB of output staging (fit_stages); fp32 outputs run
    128 x 128.

    5 stages for 128 x 128, not 6: with the output staging beside the ring, 6 stages leave the
    least L1 for the scale loads; 5 ran 1.00-1.06x the speed of 6 on all 16 bench_fp8 shapes.

    cluster 2 (pairs of CTAs sharing the a tile by TMA multicast; 128 x 128 only) is no longer
    chosen: on Mixtral, where it had run 1.02-1.07x the one-CTA kernel, the one-CTA 128 x 128
    kernel ran 1.01-1.04x it and the 128 x 256 one 1.00-1.05x (with an ordering of the two
    consumers since dropped) in one run; at serving shapes it was only taken with two row tiles
    a group or more. It stays for COMPILED_MOE_TILE and the tests."""
    def heuristic():
        return TileConfig(block_m=128, block_n=256 if m >= 128 * groups else 128, block_k=128,
                          num_warps=12, num_stages=5, cluster=1)

    return _choose("fp8_blockwise_sm90", (m, n, k, groups), "cuda", heuristic)


@functools.lru_cache(maxsize=None)
def grouped_mm_wgrad_sm90_config() -> TileConfig:
    """Tile of the CUDA bf16/fp16 weight-gradient kernel (csrc/grouped_mm.cu): 128 x 256 output
    tiles (two consumer warpgroups of 64 x 256 fp32, a thread's registers) reduced 64 rows per
    step; a stage is 48 KB, so 3 stages fit beside the 64 KB that stages the output for TMA."""
    def heuristic():
        return TileConfig(block_m=128, block_n=256, block_k=64, num_warps=12, num_stages=3)

    return _choose("grouped_mm_wgrad_sm90", (), "cuda", heuristic)


# Average rows a group at or below which the bf16 forward/dgrad runs its skipping kernel.
SKIP_PAST_ROWS_PER_GROUP = 256


def grouped_mm_sm90_config(rows: int = 0, groups: int = 1) -> TileConfig:
    """Tile of the CUDA bf16/fp16 forward/dgrad kernel (csrc/grouped_mm.cu) for `rows` rows
    in `groups` groups: 128 x 256 x 64, the Triton kernel's best tile too (see
    grouped_mm_config); 3 stages of 48 KB beside the 64 KB output staging and the tile list.
    Making room for a fourth (box-by-box staging, or one staging buffer the consumers take in
    turns) measured no faster (RESULTS.md).

    skip_past_rows: the instantiation whose second consumer skips a group's last tile when
    none of its 64 rows are the group's, where groups average 256 rows or fewer. H200, same
    process against the other instantiation (benchmarks/tools/ab_variants.py bf16-forward / bf16-dgrad
    3,0 3,1; two runs): Qwen3 and GPT-OSS skewed (T = 4096: 256 and 128 rows a group)
    1.00-1.08x forward and 1.01-1.08x dgrad, about 1.035x on average; their uniform cases
    (no tile to skip) 0.99-1.02x. Not above 256: DeepSeek-V3 and Mixtral skewed (1024 rows a
    group) ran 0.93-0.99x with it, although it skips few of their tiles. Our reading, not
    measured: blocks that skip run ahead of the others, so the blocks running at once share
    fewer of the weight's column blocks in L2 (a 4096 x 7168 expert is 59 MB). A tile-end
    barrier that kept the two consumers in step did not help (0.93-0.98x). Qwen3 at T = 8192
    (512 rows a group) was 0.96-1.01x skewed. The same instantiation keeps its k loop rolled
    (csrc/grouped_mm.cu: Qwen3 uniform 1.010-1.025x, elsewhere level)."""
    return _grouped_mm_sm90_config(rows <= SKIP_PAST_ROWS_PER_GROUP * groups)


@functools.lru_cache(maxsize=None)
def _grouped_mm_sm90_config(fine_grained: bool) -> TileConfig:
    def heuristic():
        return TileConfig(block_m=128, block_n=256, block_k=64, num_warps=12, num_stages=3,
                          skip_past_rows=int(fine_grained))

    return _choose("grouped_mm_sm90", (fine_grained,), "cuda", heuristic)


# Split K of the CUDA forward/dgrad: each k range keeps at least this many 64-deep steps (the
# ring's 3 stages fill and drain once a range), and a tile is cut into at most MAX ranges.
SPLIT_K_MIN_STEPS = 4
SPLIT_K_MAX = 8


@functools.lru_cache(maxsize=None)
def grouped_mm_sm90_split_k(rows: int, n: int, k: int, groups: int) -> int:
    """The most k ranges a tile of the CUDA bf16/fp16 forward/dgrad (csrc/grouped_mm.cu) may be
    cut into; 1: none. With a few tokens (a model decoding) the 128 x 256 tiles leave SMs idle,
    and a GEMM that should stream its experts' weights at DRAM speed runs on some of them:
    Mixtral's FC2 at T = 1 (2 experts, 16 tiles each) took 185 us against 96 for
    torch._grouped_mm (H200, benchmarks/bench_decode.py). The kernel picks the count itself
    from the tile count, which depends on offs (csrc/grouped_mm.cu: split_count, the fewest
    ranges that cut the waves of tiles by 10%). Here the bound: the fp32 partial products,
    written and read back, must stay under 1/16 of the weight bytes the GEMM streams (at most
    min(groups, rows) experts), so only shapes with a few rows a group split."""
    if rows == 0:
        return 1
    by_traffic = min(groups, rows) * k // (64 * rows)
    splits = max(1, min(by_traffic, -(-k // 64) // SPLIT_K_MIN_STEPS, SPLIT_K_MAX))
    _log("grouped_mm_sm90_split_k", (rows, n, k, groups), splits)
    return splits


# The FP8 weight gradient claims its tiles at run time (csrc/sm90.cuh, wgrad_tile_order) where
# its tiles average this many 128-row steps or more, balanced or not. H200, claimed against the
# fixed order, paired medians of 4 rounds (benchmarks/tools/ab_csrc.py), two runs: DeepSeek-V3 EP8
# (1024 rows a group: 8 steps) 1.00-1.07x, Mixtral (2048: 16 steps) 1.00-1.04x; Qwen3 (256
# rows) 0.96x and GPT-OSS (128) 0.99-1.02x, which keep the fixed order. The bf16 weight
# gradient claimed lost at every length (0.93-0.97x), so it claims only where unbalanced.
FP8_WGRAD_CLAIM_STEPS = 8


@functools.lru_cache(maxsize=None)
def fp8_wgrad_sm90_config(rows_per_group: int) -> TileConfig:
    """Tile of the CUDA FP8 weight-gradient kernel (csrc/fp8_grouped_mm.cu): 128 x 128 output
    tiles reduced 128 rows (one fp8_blockwise columnwise scale block) per 32 KB stage.
    rows_per_group: the token-count hint over the number of groups.

    4 stages (what fits beside the fp32 output staging, too): with bf16 output, 4 ran 0.99-1.07x
    the speed of 3 (geometric mean 1.02x) and 5 ran 0.88-0.98x (0.93x) on the 16 bench_fp8
    shapes (H200, same run). The deeper ring leaves less L1 for the per-chunk scale loads.

    (One buffer of partial products a consumer thread, fixed in the kernel: csrc/fp8_grouped_mm.cu
    says why.)"""
    def heuristic():
        return TileConfig(block_m=128, block_n=128, block_k=128, num_warps=12, num_stages=4)

    return _choose("fp8_wgrad_sm90", (rows_per_group,), "cuda", heuristic)
