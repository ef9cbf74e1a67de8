"""Pure-torch reference of every compiled_moe op.

These functions are the CPU implementation of the ops and the oracle the GPU
kernels are tested against. They read no tensor values on the host, so they
trace under ``torch.compile(fullgraph=True, dynamic=True)``; they trade speed
for that (a one-hot matmul costs G times the FLOPs of the grouped product).
Half-precision inputs are computed in float32, float64 stays float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_bounds(offs: Tensor, num_rows) -> tuple[Tensor, Tensor]:
    """Start and end row of every group, as every kernel of the package reads them.

    ``offs`` holds cumulative end rows. Values are clamped to [0, num_rows] and made
    non-decreasing (a running maximum), so that corrupt offsets can never address a
    row outside the tensor: group g owns rows [starts[g], ends[g]).
    """
    ends = offs.to(torch.int64).clamp(0, num_rows)
    ends = torch.cummax(ends, 0).values if ends.numel() else ends
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, ends


def row_group_ids(offs: Tensor, num_rows) -> Tensor:
    """Group index of every row (int64, shape (num_rows,)); rows past the last group get G."""
    _, ends = group_bounds(offs, num_rows)
    rows = torch.arange(num_rows, device=offs.device, dtype=torch.int64)
    return torch.searchsorted(ends, rows, right=True)


def _group_one_hot(offs: Tensor, num_rows, dtype: torch.dtype) -> Tensor:
    """(num_rows, G) matrix with a 1 where a row belongs to a group; rows past the end are 0."""
    num_groups = offs.shape[0]
    gid = row_group_ids(offs, num_rows)
    groups = torch.arange(num_groups, device=offs.device, dtype=torch.int64)
    return (gid[:, None] == groups[None, :]).to(dtype)


def counts_to_offsets(counts: Tensor) -> Tensor:
    """Group sizes (G,) -> cumulative end offsets (G,), int32."""
    return torch.cumsum(counts, 0, dtype=torch.int32)


def offsets_to_counts(offs: Tensor) -> Tensor:
    """Cumulative end offsets (G,) -> group sizes (G,), int32 (offsets taken as they are)."""
    return torch.diff(offs.to(torch.int32), prepend=offs.new_zeros(1, dtype=torch.int32))


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """out[r] = a[r] @ b[g(r)] (+ bias[g(r)]) for every row r of group g(r); other rows 0."""
    cdt = _compute_dtype(a.dtype)
    num_rows, k = a.shape
    num_groups, _, n = b.shape
    one_hot = _group_one_hot(offs, num_rows, cdt)  # (M, G)
    # Spread each row of a into its group's K-slot, then one (M, G*K) @ (G*K, N) product.
    a_spread = (one_hot[:, :, None] * a.to(cdt)[:, None, :]).reshape(num_rows, num_groups * k)
    out = a_spread @ b.to(cdt).reshape(num_groups * k, n)
    if bias is not None:
        out = out + one_hot @ bias.to(cdt)
    return out.to(out_dtype or a.dtype)


def grouped_mm_wgrad(a: Tensor, grad_out: Tensor, offs: Tensor,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    """out[g] = a_g^T @ grad_out_g, shape (G, K, N); empty groups give zeros."""
    cdt = _compute_dtype(a.dtype)
    one_hot = _group_one_hot(offs, a.shape[0], cdt)
    # Two operands: given three, torch.einsum asks opt_einsum (where installed) for a
    # contraction order, which reads concrete sizes and pinned a dynamic compile's token count.
    masked = one_hot[:, :, None] * a.to(cdt)[:, None, :]  # (M, G, K)
    out = torch.einsum("mgk,mn->gkn", masked, grad_out.to(cdt))
    return out.to(out_dtype or a.dtype)


def grouped_mm_wgrad_accumulate_(main_grad: Tensor, a: Tensor, grad_out: Tensor, offs: Tensor,
                                 accumulate_mask: Tensor | None = None) -> None:
    """main_grad[g] = (main_grad[g] if accumulate_mask[g] else 0) + a_g^T @ grad_out_g, in place."""
    wgrad = grouped_mm_wgrad(a, grad_out, offs, out_dtype=main_grad.dtype)
    if accumulate_mask is None:
        main_grad.add_(wgrad)
    else:
        keep = accumulate_mask.to(main_grad.dtype)[:, None, None]
        main_grad.copy_(main_grad * keep + wgrad)


def grouped_sum(x: Tensor, offs: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """out[g] = sum of x's rows in group g, shape (G, N) (the bias gradient of grouped_mm)."""
    cdt = _compute_dtype(x.dtype)
    one_hot = _group_one_hot(offs, x.shape[0], cdt)
    return (one_hot.t() @ x.to(cdt)).to(out_dtype or x.dtype)


def expand_groups(x: Tensor, offs: Tensor, num_rows) -> Tensor:
    """out[r] = x[g(r)] for rows inside a group, 0 past the last group: the adjoint of grouped_sum."""
    gid = row_group_ids(offs, num_rows)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return padded[gid]


# ---------------------------------------------------------------------------------------------
# Routing, permute and combine
# ---------------------------------------------------------------------------------------------

def routing_capacity(num_entries, num_experts, pad_multiple: int = 1):
    """Rows of the expert-sorted buffer: T*k, plus room to pad every expert to ``pad_multiple``."""
    return num_entries + num_experts * (pad_multiple - 1)


def moe_route(topk_ids: Tensor, num_experts: int, pad_multiple: int = 1
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Expert-sorted layout of the routed (token, slot) pairs.

    Returns ``(offs, row_of, source)``:
      offs   int32 (E,): cumulative end row of each expert's group (padded to ``pad_multiple``).
      row_of int32 (T, k): the sorted row of each (token, slot); -1 where the id is outside
             [0, E) (such pairs are dropped: the expert-parallel case of non-local experts).
      source int32 (capacity,): for each sorted row its flat pair index t*k + s; -1 on
             padding rows and rows past offs[-1].
    Inside an expert, pairs keep ascending flat order (stable), so the layout is deterministic.
    """
    num_tokens, k = topk_ids.shape
    n = num_tokens * k
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, num_experts)  # dropped pairs sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(key, stable=True).indices  # flat pair index of each sorted position
    sorted_key = key[order]
    # Rank of each sorted position inside its expert = position - (unpadded start of its expert).
    unpadded_starts = torch.cumsum(counts, 0) - counts
    ext_starts = torch.cat([starts, starts.new_zeros(1)])
    ext_unpadded = torch.cat([unpadded_starts, unpadded_starts.new_zeros(1)])
    pos = torch.arange(n, device=dev, dtype=torch.int64)
    rows_sorted = ext_starts[sorted_key] + pos - ext_unpadded[sorted_key]
    rows_sorted = torch.where(sorted_key < num_experts, rows_sorted, -1)
    row_of = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, order, rows_sorted)
    capacity = routing_capacity(n, num_experts, pad_multiple)
    # Scatter pair indices to their rows; dropped pairs go to a spare slot past the end.
    source = torch.full((capacity + 1,), -1, dtype=torch.int64, device=dev)
    source.scatter_(0, torch.where(row_of >= 0, row_of, capacity), pos)
    return (ends.to(torch.int32), row_of.view(num_tokens, k).to(torch.int32),
            source[:capacity].to(torch.int32))


def moe_permute(hidden: Tensor, source: Tensor, top_k: int, scale: Tensor | None = None) -> Tensor:
    """x[r] = hidden[source[r] // top_k] (times scale.flatten()[source[r]]); 0 where source[r] is
    not a pair index in [0, T * top_k) (moe_route marks padding rows -1)."""
    if hidden.shape[0] == 0 or top_k == 0:  # no pairs: every row is padding
        return hidden.new_zeros((source.shape[0], hidden.shape[1]))
    valid = (source >= 0) & (source < hidden.shape[0] * top_k)
    src = torch.where(valid, source.to(torch.int64), 0)
    x = hidden[src // top_k]
    if scale is not None:
        x = (x.to(_compute_dtype(x.dtype)) * scale.reshape(-1)[src].to(_compute_dtype(x.dtype))[:, None])
    return torch.where(valid[:, None], x, 0).to(hidden.dtype)


def _rows_of_y(y: Tensor, row_of: Tensor) -> tuple[Tensor, Tensor]:
    """(valid, rows): the entries of row_of that name a row of y (moe_route marks dropped pairs
    -1), and the indices with the others set to 0."""
    valid = (row_of >= 0) & (row_of < y.shape[0])
    return valid, torch.where(valid, row_of.to(torch.int64), 0)


def moe_unpermute(y: Tensor, row_of: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = sum_s weights[t, s] * y[row_of[t, s]] (weights 1 when None); entries that name no
    row of y (dropped pairs: -1) count 0."""
    if y.shape[0] == 0:
        return y.new_zeros((row_of.shape[0], y.shape[1]))
    cdt = _compute_dtype(y.dtype)
    valid, rows = _rows_of_y(y, row_of)
    picked = y[rows].to(cdt)  # (T, k, H)
    w = valid.to(cdt) if weights is None else torch.where(valid, weights.to(cdt), 0)
    return (picked * w[..., None]).sum(1).to(y.dtype)


# ---------------------------------------------------------------------------------------------
# Activations and the experts block
# ---------------------------------------------------------------------------------------------

ACTIVATIONS = ("swiglu", "geglu", "gpt_oss", "relu2", "gelu", "silu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "gpt_oss")
# The kernels' activation codes (Triton and CUDA: csrc/activation.cuh); the gated ones first.
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}
GATE_UP_LAYOUTS = ("stacked", "interleaved")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def split_gate_up(h: Tensor, gate_up_layout: str) -> tuple[Tensor, Tensor]:
    """FC1 output -> (gate, up): stacked halves [gate | up] or interleaved columns g0 u0 g1 u1 ..."""
    if gate_up_layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def activation(h: Tensor, name: str, gate_up_layout: str = "stacked",
               alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> Tensor:
    """The activation between FC1 and FC2 (DESIGN.md section 3), computed in fp32 or fp64."""
    x = h.to(_compute_dtype(h.dtype))
    if name in GATED_ACTIVATIONS:
        g, u = split_gate_up(x, gate_up_layout)
        if name == "swiglu":
            out = torch.nn.functional.silu(g) * u
        elif name == "geglu":
            out = torch.nn.functional.gelu(g, approximate="tanh") * u
        else:  # gpt_oss
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
            out = g * torch.sigmoid(alpha * g) * (u + 1)
    elif name == "relu2":
        out = torch.relu(x).square()
    elif name == "gelu":
        out = torch.nn.functional.gelu(x)
    elif name == "silu":
        out = torch.nn.functional.silu(x)
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return out.to(h.dtype)


def moe_unpermute_dot(grad_out: Tensor, y: Tensor, row_of: Tensor) -> Tensor:
    """dot[t, s] = <grad_out[t], y[row_of[t, s]]> (0 where row_of[t, s] names no row of y):
    d out / d weights."""
    cdt = _compute_dtype(y.dtype)
    if y.shape[0] == 0:
        return torch.zeros(row_of.shape, dtype=cdt, device=y.device)
    valid, rows = _rows_of_y(y, row_of)
    dot = (y[rows].to(cdt) * grad_out.to(cdt)[:, None, :]).sum(-1)
    return torch.where(valid, dot, 0)


def activation_backward(grad: Tensor, h: Tensor, name: str, gate_up_layout: str = "stacked",
                        alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> Tensor:
    """Gradient of :func:`activation` at h given grad (rows, I): (rows, N1), in h's dtype."""
    cdt = _compute_dtype(h.dtype)
    x, da = h.to(cdt), grad.to(cdt)
    if name in GATED_ACTIVATIONS:
        g, u = split_gate_up(x, gate_up_layout)
        if name == "swiglu":
            s = torch.sigmoid(g)
            dg, du = da * u * s * (1 + g * (1 - s)), da * g * s
        elif name == "geglu":
            c = 0.7978845608028654
            t = torch.tanh(c * (g + 0.044715 * g ** 3))
            dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)
            dg, du = da * u * dgelu, da * 0.5 * g * (1 + t)
        else:  # gpt_oss; clamp passes the gradient where the value is inside [min, max]
            gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
            s = torch.sigmoid(alpha * gc)
            dg = torch.where(g <= limit, da * (uc + 1) * s * (1 + alpha * gc * (1 - s)), 0)
            du = torch.where((u >= -limit) & (u <= limit), da * gc * s, 0)
        if gate_up_layout == "interleaved":
            out = torch.stack([dg, du], dim=-1).flatten(-2)
        else:
            out = torch.cat([dg, du], dim=-1)
    elif name == "relu2":
        out = 2 * torch.relu(x) * da
    elif name == "gelu":
        cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
        out = da * (cdf + x * torch.exp(-0.5 * x * x) * 0.3989422804014327)
    elif name == "silu":
        s = torch.sigmoid(x)
        out = da * s * (1 + x * (1 - s))
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return out.to(h.dtype)


def scaled_activation_backward(grad: Tensor, h: Tensor, probs: Tensor, name: str,
                               gate_up_layout: str = "stacked", alpha: float = GPT_OSS_ALPHA,
                               limit: float = GPT_OSS_LIMIT) -> tuple[Tensor, Tensor]:
    """Backward of :func:`scaled_activation` with probs: (dh in h's dtype, dprobs fp32 (or fp64)
    = <grad, act(h)> per row)."""
    cdt = _compute_dtype(h.dtype)
    dprobs = (grad.to(cdt) * activation(h, name, gate_up_layout, alpha, limit).to(cdt)).sum(1)
    dh = activation_backward(grad.to(cdt) * probs.to(cdt)[:, None], h, name, gate_up_layout,
                             alpha, limit)
    return dh, dprobs


def moe_mlp(x: Tensor, offs: Tensor, w1: Tensor, w2: Tensor, name: str,
            gate_up_layout: str = "stacked", probs: Tensor | None = None,
            b1: Tensor | None = None, b2: Tensor | None = None, source: Tensor | None = None,
            top_k: int = 1, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT
            ) -> tuple[Tensor, Tensor]:
    """The expert MLP on expert-sorted rows: ``(y, h)``.

    h = x_s @ w1[g]^T (+ b1[g]) with x_s = x, or x[source // top_k] (zero where source < 0);
    y = (act(h) * probs) @ w2[g]^T (+ b2[g]). w1 (G, N1, K), w2 (G, H, I): nn.Linear layout.
    """
    xs = x if source is None else moe_permute(x, source, top_k)
    h = grouped_mm(xs, w1.transpose(-2, -1), offs, b1)
    a = scaled_activation(h, name, gate_up_layout, probs, alpha, limit)
    return grouped_mm(a, w2.transpose(-2, -1), offs, b2), h


def scaled_activation(h: Tensor, name: str, gate_up_layout: str = "stacked",
                      probs: Tensor | None = None, alpha: float = GPT_OSS_ALPHA,
                      limit: float = GPT_OSS_LIMIT) -> Tensor:
    """FC2's input: act(h) in h's dtype, then times probs (M,) (see scale_rows)."""
    return scale_rows(activation(h, name, gate_up_layout, alpha, limit), probs)


def scale_rows(a: Tensor, probs: Tensor | None) -> Tensor:
    """a * probs[:, None] computed in fp32 (fp64 for fp64 a) and rounded to a's dtype."""
    if probs is None:
        return a
    cdt = _compute_dtype(a.dtype)
    return (a.to(cdt) * probs.to(cdt)[:, None]).to(a.dtype)


def moe_mlp_fc2_dgrad(dy: Tensor, w2: Tensor, h: Tensor, offs: Tensor, probs: Tensor | None,
                      name: str, gate_up_layout: str = "stacked", alpha: float = GPT_OSS_ALPHA,
                      limit: float = GPT_OSS_LIMIT) -> tuple[Tensor, Tensor, Tensor | None]:
    """Backward of :func:`moe_mlp` from dy to h: ``(dh, a, dprobs)``.

    da = dy @ w2[g], rounded to dy's dtype as the unfused path rounds it; dprobs = <da, act(h)>
    per row (None without probs); dh is the activation's gradient at h times da * probs;
    a = act(h) * probs, FC2's input (for its weight gradient), recomputed from h.
    """
    cdt = _compute_dtype(h.dtype)
    da = grouped_mm(dy, w2, offs).to(cdt)
    a = activation(h.to(cdt), name, gate_up_layout, alpha, limit)
    dprobs = None
    if probs is not None:
        dprobs = (da * a).sum(1)
        p = probs.to(cdt)[:, None]
        da, a = da * p, a * p
    return activation_backward(da, h, name, gate_up_layout, alpha, limit), a.to(h.dtype), dprobs


# ---------------------------------------------------------------------------------------------
# FP8: grouped quantize and scaled grouped GEMMs
# ---------------------------------------------------------------------------------------------
# Scale conventions (every scale is a dequantization multiplier: x ~ data * scale):
#   fp8_rowwise    one fp32 scale per row (per group and column for columnwise data)
#   fp8_blockwise  fp32 scales of 1x128 blocks (2-D activations), 128x128 blocks (3-D weights)
#   mxfp8          E8M0 (uint8, 2^(byte-127)) scales of 1x32 blocks, power-of-two
# fp32 scales are amax / 448; E8M0 exponents round up (the smallest power of two with
# amax <= 448 * 2^e), so no value saturates. A block of zeros gets scale 1.0 (fp32) or byte 0
# (2^-127); a block holding Inf or NaN gets scale +Inf (fp32) or byte 255 (E8M0 NaN), its
# non-finite elements NaN data and its finite ones 0 (with their sign), so dequantizing shows
# the bad block.

FP8_RECIPES = ("fp8_rowwise", "fp8_blockwise", "mxfp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
E8M0_NAN = 255
_E8M0_SUBNORMAL_MIN_BITS = 0x00400000  # 2^-127 as fp32 bits


def check_recipe(recipe: str) -> None:
    if recipe not in FP8_RECIPES:
        raise ValueError(f"recipe must be one of {FP8_RECIPES}, got {recipe!r}")


def fp8_block(recipe: str, weight: bool = False) -> tuple[int, int]:
    """(rows, columns) of x sharing one scale; 0 columns means the whole row."""
    if recipe == "fp8_blockwise":
        return (128, 128) if weight else (1, 128)
    if recipe == "mxfp8":
        return 1, 32
    return 1, 0


def fp8_column_block(recipe: str) -> int:
    """Rows per columnwise block of 2-D data (0: the whole group)."""
    return {"fp8_blockwise": 128, "mxfp8": 32, "fp8_rowwise": 0}[recipe]


def fp8_column_slots(num_rows, num_groups: int, recipe: str):
    """Columnwise scale slots of 2-D data: every group's blocks, plus the rows past the last
    group as one more group; blocks never cross a group boundary."""
    rows = fp8_column_block(recipe)
    if rows == 0:
        return num_groups + 1
    return (num_rows + rows - 1) // rows + num_groups


def _amax_nonfinite_as_inf(x: Tensor) -> Tensor:
    return torch.where(torch.isnan(x), float("inf"), x.abs())


def fp8_scale_from_amax(amax: Tensor, recipe: str) -> Tensor:
    """Scale of each block from its amax (fp32): fp32 amax/448, or the E8M0 byte for mxfp8."""
    amax = amax.to(torch.float32)
    if recipe == "mxfp8":
        bits = amax.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127
        exp = exp - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
        byte = (exp.clamp(-127, 127) + 127).to(torch.uint8)
        return torch.where(torch.isfinite(amax), byte, E8M0_NAN).to(torch.uint8)
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal,
    # which is not the correctly rounded quotient the kernels compute.
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(amax == 0, 1.0, scale)


def e8m0_to_float(byte: Tensor) -> Tensor:
    """E8M0 bytes -> fp32 powers of two (byte 0 is 2^-127, 255 NaN)."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, _E8M0_SUBNORMAL_MIN_BITS, b << 23)
    return torch.where(b == E8M0_NAN, float("nan"), bits.view(torch.float32))


def scale_to_float(scale: Tensor) -> Tensor:
    return e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.to(torch.float32)


def fp8_quantize_values(x: Tensor, scale: Tensor) -> Tensor:
    """e4m3 data of x (fp32) under its block's scale (broadcast to x), saturating."""
    if scale.dtype == torch.uint8:
        exp = scale.to(torch.int32) - 127
        inv = ((127 - exp).clamp(1, 254) << 23).view(torch.float32)  # 2^-e, exact
        q = x * torch.where(scale == E8M0_NAN, 0.0, inv)  # a NaN block's finite values: +-0
    else:
        q = x / scale
    q = torch.where(torch.isfinite(x), q.clamp(-FP8_MAX, FP8_MAX), float("nan"))
    return q.to(FP8_DTYPE)


def _quantize_tiles(x: Tensor, block_rows: int, block_cols: int, recipe: str
                    ) -> tuple[Tensor, Tensor]:
    """Quantize (G, R, C) in blocks of block_rows x block_cols (block_cols 0: whole rows).

    Returns data (G, R, C) e4m3 and scale (G, ceil(R/block_rows), ceil(C/block_cols)).
    """
    num_groups, rows, cols = x.shape
    bc = max(cols, 1) if block_cols == 0 else block_cols
    nr, nc = -(-rows // block_rows), max(1, -(-cols // bc))
    xf = x.to(torch.float32)
    padded = xf.new_zeros(num_groups, nr * block_rows, nc * bc)
    padded[:, :rows, :cols] = xf
    blocks = _amax_nonfinite_as_inf(padded).view(num_groups, nr, block_rows, nc, bc)
    scale = fp8_scale_from_amax(blocks.amax(dim=(2, 4)), recipe)  # (G, nr, nc)
    full = scale.repeat_interleave(block_rows, 1).repeat_interleave(bc, 2)[:, :rows, :cols]
    return fp8_quantize_values(xf, full).contiguous(), scale


def grouped_quantize(x: Tensor, offs: Tensor | None, recipe: str, rowwise: bool = True,
                     columnwise: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 quantization of every group at once: (data, scale, col_data, col_scale).

    2-D x (M, K) with offs (G,): groups of rows.
      data (M, K); scale (M, ceil(K/b)) for 1 x b blocks (fp8_rowwise: (M, 1)).
      col_data (K, M), the transpose; col_scale (K, S), S = fp8_column_slots(M, G): block j of
      group g (b rows, never crossing the group's end) has slot sum_{h<g} ceil(m_h/b) + j,
      the rows past the last group count as group G, unused slots are zero blocks.
      fp8_rowwise: one block per group, slot g. (The op, compiled_moe.grouped_quantize, stores
      fp8_blockwise's col_scale K-contiguous, strides (1, K); these references are contiguous.)
    3-D x (G, N, K), a stacked weight (offs unused): data (G, N, K) with scale
      (G, ceil(N/br), ceil(K/bc)) (blockwise 128x128, mxfp8 1x32, fp8_rowwise (G, N, 1));
      col_data (G, K, N) and col_scale, the same quantization of x.mT.
    Directions not asked for come back as empty tensors.
    """
    check_recipe(recipe)
    dev = x.device
    empty8 = torch.empty(0, dtype=FP8_DTYPE, device=dev)
    empty_s = torch.empty(0, dtype=torch.uint8 if recipe == "mxfp8" else torch.float32,
                          device=dev)
    data = scale = col_data = col_scale = None
    if x.dim() == 3:
        br, bc = fp8_block(recipe, weight=True)
        if rowwise:
            data, scale = _quantize_tiles(x, br, bc, recipe)
        if columnwise:
            col_data, col_scale = _quantize_tiles(x.mT, br, bc, recipe)
    else:
        _, bc = fp8_block(recipe)
        if rowwise:
            data, scale = _quantize_tiles(x[None], 1, bc, recipe)
            data, scale = data[0], scale[0]
        if columnwise:
            col_data, col_scale = _quantize_group_columns(x, offs, recipe)
    return (empty8 if data is None else data, empty_s if scale is None else scale,
            empty8 if col_data is None else col_data, empty_s if col_scale is None else col_scale)


def activation_quantize(h: Tensor, offs: Tensor, name: str, gate_up_layout: str, recipe: str,
                        probs: Tensor | None = None, rowwise: bool = True,
                        columnwise: bool = False, alpha: float = GPT_OSS_ALPHA,
                        limit: float = GPT_OSS_LIMIT) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FC2's FP8 input from FC1's output: grouped_quantize of scaled_activation(h)."""
    return grouped_quantize(scaled_activation(h, name, gate_up_layout, probs, alpha, limit), offs,
                            recipe, rowwise, columnwise)


def fp8_column_slot_of_rows(offs: Tensor, num_rows, recipe: str) -> Tensor:
    """Columnwise scale slot (int64) of every row of 2-D data (see grouped_quantize)."""
    starts, ends = group_bounds(offs, num_rows)
    gid = row_group_ids(offs, num_rows)  # rows past the end: group G
    block = fp8_column_block(recipe)
    if block == 0:
        return gid
    tail_start = ends[-1:]
    starts = torch.cat([starts, tail_start])
    sizes = torch.cat([ends, ends.new_full((1,), num_rows)]) - starts
    blocks = (sizes + block - 1) // block
    first = torch.cumsum(blocks, 0) - blocks
    rows = torch.arange(num_rows, device=offs.device, dtype=torch.int64)
    return first[gid] + (rows - starts[gid]) // block


def _quantize_group_columns(x: Tensor, offs: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    num_rows, cols = x.shape
    slots = fp8_column_slots(num_rows, offs.shape[0], recipe)
    slot = fp8_column_slot_of_rows(offs, num_rows, recipe)
    xf = x.to(torch.float32)
    amax = xf.new_zeros(slots, cols).scatter_reduce(
        0, slot[:, None].expand(num_rows, cols), _amax_nonfinite_as_inf(xf), "amax")
    scale = fp8_scale_from_amax(amax, recipe)  # (S, K)
    data = fp8_quantize_values(xf, scale[slot])
    return data.t().contiguous(), scale.t().contiguous()


def _expand_scale(scale: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    """(…, nr, nc) block scales -> (…, rows, cols) fp32 multipliers."""
    s = scale_to_float(scale)
    bc = max(cols, 1) if block_cols == 0 else block_cols
    return s.repeat_interleave(block_rows, -2).repeat_interleave(bc, -1)[..., :rows, :cols]


def dequantize_rows(data: Tensor, scale: Tensor, recipe: str, weight: bool = False) -> Tensor:
    """fp32 values of rowwise-quantized data: 2-D (M, K) activations or 3-D (G, N, K) weights."""
    br, bc = fp8_block(recipe, weight)
    return data.to(torch.float32) * _expand_scale(scale, data.shape[-2], data.shape[-1], br, bc)


def dequantize_columns(col_data: Tensor, col_scale: Tensor, offs: Tensor, recipe: str) -> Tensor:
    """fp32 (M, K) values of 2-D columnwise data (col_data (K, M), col_scale (K, S))."""
    slot = fp8_column_slot_of_rows(offs, col_data.shape[1], recipe)
    return col_data.t().to(torch.float32) * scale_to_float(col_scale).t()[slot]


def scaled_grouped_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
                      recipe: str, out_dtype: torch.dtype | None = None,
                      bias: Tensor | None = None) -> Tensor:
    """out[r] = dequant(a)[r] @ dequant(b)[g(r)] (+ bias[g(r)]), fp32 math, rounded once;
    rows past offs[-1] are 0.

    a (M, K) e4m3 with its rowwise scale; b (G, K, N) e4m3, the transposed view of a (G, N, K)
    rowwise-quantized weight, with that weight's scale; bias (G, N) in any float dtype.
    """
    a_deq = dequantize_rows(a, a_scale, recipe)
    b_deq = dequantize_rows(b.mT, b_scale, recipe, weight=True).mT
    return grouped_mm(a_deq, b_deq, offs, bias, out_dtype=out_dtype or torch.bfloat16)


def scaled_grouped_mm_wgrad(a_t: Tensor, d_t: Tensor, a_scale: Tensor, d_scale: Tensor,
                            offs: Tensor, recipe: str, out_dtype: torch.dtype | None = None
                            ) -> Tensor:
    """out[g] (K, N) = dequant(a)_g^T @ dequant(d)_g from columnwise data a_t (K, M), d_t (N, M)."""
    a_deq = dequantize_columns(a_t, a_scale, offs, recipe)
    d_deq = dequantize_columns(d_t, d_scale, offs, recipe)
    return grouped_mm_wgrad(a_deq, d_deq, offs, out_dtype=out_dtype or torch.bfloat16)
