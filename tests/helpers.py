"""Independent oracles and input makers shared by the tests."""

from __future__ import annotations

import torch


def random_offsets(num_rows: int, num_groups: int, *, generator=None, empty_groups: int = 0,
                   tail: int = 0, device="cpu") -> torch.Tensor:
    """int32 cumulative ends of num_groups random groups covering num_rows - tail rows.

    ``empty_groups`` groups are forced empty; ``tail`` rows are left past the last group.
    """
    used = num_rows - tail
    cuts = torch.randint(0, used + 1, (num_groups - 1,), generator=generator).sort().values
    ends = torch.cat([cuts, torch.tensor([used])])
    if empty_groups:
        idx = torch.randperm(num_groups, generator=generator)[:empty_groups]
        starts = torch.cat([torch.tensor([0]), ends[:-1]])
        sizes = ends - starts
        moved = sizes[idx].sum()
        sizes[idx] = 0
        keep = [g for g in range(num_groups) if g not in set(idx.tolist())]
        sizes[keep[0]] += moved
        ends = sizes.cumsum(0)
    return ends.to(torch.int32).to(device)


def loop_bounds(offs: torch.Tensor, num_rows: int):
    """(start, end) of each group by the documented clamping rule, computed with a host loop."""
    start = 0
    for o in offs.tolist():
        end = max(start, min(max(o, 0), num_rows))
        yield start, end
        start = end


def loop_grouped_mm(a, b, offs, bias=None, dtype=torch.float64):
    """out rows of group g = a_g @ b[g] (+ bias[g]) by a loop over groups in `dtype`."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=dtype, device=a.device)
    for g, (s, e) in enumerate(loop_bounds(offs.cpu(), a.shape[0])):
        if e > s:
            blk = a[s:e].to(dtype) @ b[g].to(dtype)
            if bias is not None:
                blk = blk + bias[g].to(dtype)
            out[s:e] = blk
    return out


def loop_wgrad(a, d, offs, dtype=torch.float64):
    out = torch.zeros(offs.shape[0], a.shape[1], d.shape[1], dtype=dtype, device=a.device)
    for g, (s, e) in enumerate(loop_bounds(offs.cpu(), a.shape[0])):
        out[g] = a[s:e].to(dtype).T @ d[s:e].to(dtype)
    return out


def loop_grouped_sum(x, offs, dtype=torch.float64):
    out = torch.zeros(offs.shape[0], x.shape[1], dtype=dtype, device=x.device)
    for g, (s, e) in enumerate(loop_bounds(offs.cpu(), x.shape[0])):
        out[g] = x[s:e].to(dtype).sum(0)
    return out


def assert_matches_oracle(out, oracle64, same_dtype_torch, atol=1e-5):
    """DESIGN.md tolerance rule: error vs float64 at most 2x torch's own same-dtype error + atol."""
    out = out.detach().cpu().double()
    oracle64 = oracle64.cpu().double()
    assert out.shape == oracle64.shape, (out.shape, oracle64.shape)
    assert torch.isfinite(out).all(), "non-finite values in output"
    err = (out - oracle64).abs().max().item() if out.numel() else 0.0
    torch_err = (same_dtype_torch.detach().cpu().double() - oracle64).abs().max().item() \
        if out.numel() else 0.0
    scale = oracle64.abs().max().item() if out.numel() else 0.0
    bound = 2 * torch_err + atol * max(1.0, scale)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e} (torch same-dtype {torch_err:.3e})"
