"""What every op shares: argument checks (host metadata only) and the kernel/reference choice."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# float64 runs on the reference path only (gradcheck on CPU).
OP_DTYPES = KERNEL_DTYPES + (torch.float64,)

_interpret_on_cpu = False


@contextlib.contextmanager
def kernels_on_cpu():
    """Run the Triton kernels on CPU tensors (needs TRITON_INTERPRET=1): the CPU test tier."""
    global _interpret_on_cpu
    old, _interpret_on_cpu = _interpret_on_cpu, True
    try:
        yield
    finally:
        _interpret_on_cpu = old


def use_kernel(*tensors: Tensor) -> bool:
    """True when the Triton kernels serve these tensors; the reference serves the rest."""
    t = tensors[0]
    if any(x.dtype == torch.float64 for x in tensors):
        return False
    if t.device.type == "cuda":
        return True
    return _interpret_on_cpu and t.device.type == "cpu"


def check_tensor(name: str, t, ndim: int, dtypes=OP_DTYPES) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_same_device(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_same_dtype(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
                            f"they must match")


def check_offs(offs, num_groups=None) -> None:
    """offs: int32 (G,) cumulative end rows (G = num_groups when given).

    Values are not read (that would sync): kernels clamp them on the device.
    """
    if not isinstance(offs, Tensor):
        raise TypeError(f"offs must be a torch.Tensor, got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32 (cumulative end row of each group), got {offs.dtype}")
    if num_groups is None and offs.dim() == 1:
        num_groups = offs.shape[0]
    if offs.dim() != 1 or offs.shape[0] != num_groups:
        want = "(G,)" if num_groups is None else f"({num_groups},)"
        raise ValueError(f"offs must have shape {want}, one entry per group, "
                         f"got {tuple(offs.shape)}")
    if num_groups < 1:
        raise ValueError("need at least one group")


def check_out_dtype(out_dtype) -> None:
    if out_dtype is not None and out_dtype not in OP_DTYPES:
        raise TypeError(f"out_dtype must be one of {OP_DTYPES} or None, got {out_dtype}")
