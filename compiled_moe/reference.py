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
    out = torch.einsum("mg,mk,mn->gkn", one_hot, a.to(cdt), grad_out.to(cdt))
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
    """x[r] = hidden[source[r] // top_k] (times scale.flatten()[source[r]]); 0 where source < 0."""
    valid = source >= 0
    src = source.to(torch.int64).clamp(min=0)
    x = hidden[src // top_k]
    if scale is not None:
        x = (x.to(_compute_dtype(x.dtype)) * scale.reshape(-1)[src].to(_compute_dtype(x.dtype))[:, None])
    return torch.where(valid[:, None], x, 0).to(hidden.dtype)


def moe_unpermute(y: Tensor, row_of: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = sum_s weights[t, s] * y[row_of[t, s]] (weights 1 when None); rows -1 count 0."""
    cdt = _compute_dtype(y.dtype)
    valid = row_of >= 0
    picked = y[row_of.to(torch.int64).clamp(min=0)].to(cdt)  # (T, k, H)
    w = valid.to(cdt) if weights is None else torch.where(valid, weights.to(cdt), 0)
    return (picked * w[..., None]).sum(1).to(y.dtype)


# ---------------------------------------------------------------------------------------------
# Activations and the experts block
# ---------------------------------------------------------------------------------------------

ACTIVATIONS = ("swiglu", "geglu", "gpt_oss", "relu2", "gelu", "silu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "gpt_oss")
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
    """dot[t, s] = <grad_out[t], y[row_of[t, s]]> (0 where row_of < 0): d out / d weights."""
    cdt = _compute_dtype(y.dtype)
    picked = y[row_of.to(torch.int64).clamp(min=0)].to(cdt)
    dot = (picked * grad_out.to(cdt)[:, None, :]).sum(-1)
    return torch.where(row_of >= 0, dot, 0)


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
