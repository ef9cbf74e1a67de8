"""The all-to-all exchange of rows between the ranks of an expert-parallel group.

One differentiable op over torch.distributed's functional collectives
(``torch.ops._c10d_functional``): its backward is the reverse exchange, and torch.compile
puts both in the graph. In eager CUDA runs the chunk pipeline of
:mod:`compiled_moe.distributed.experts` issues exchanges from a side stream; this op then
keeps the caching allocator safe across the two streams (see ``_use_on_current_stream``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _use_on_current_stream(t: Tensor) -> None:
    """Tell the caching allocator that ``t``, allocated on another stream maybe, is read or
    written by work queued on the current stream (NCCL's internal stream waits on it).

    Without it, when the last Python reference to ``t`` goes, its block returns to the pool
    of the stream it was allocated on and may be handed out there while this stream's
    collective still reads or writes it (TransformerEngine #3049 is this bug). Same-stream
    tensors: a no-op for the allocator. Traced graphs run on one stream and skip it.
    """
    if t.is_cuda and not torch.compiler.is_compiling():
        t.record_stream(torch.cuda.current_stream(t.device))


def _all_to_all(x: Tensor, output_splits: list | None, input_splits: list | None,
                group_name: str, group_size: int) -> Tensor:
    _use_on_current_stream(x)
    if output_splits is None:
        # Equal splits, from x's own size: a traced graph then derives them from the shape
        # (passing them in as symbolic ints would make them inputs of the traced function).
        output_splits = input_splits = [x.shape[0] // group_size] * group_size
    out = torch.ops._c10d_functional.all_to_all_single(x, output_splits, input_splits, group_name)
    # Waiting orders the current stream after the exchange (CUDA) or blocks (gloo); it does not
    # block the host on CUDA, so later work still queues while the exchange runs.
    return torch.ops._c10d_functional.wait_tensor(out)


class _Exchange(torch.autograd.Function):
    """``out = all_to_all(x)`` with the given splits; backward sends gradients back (splits
    swapped). Rows of x: ``input_splits[d]`` rows for rank d, in rank order."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group_name, group_size, input_stream):
        ctx.splits = (output_splits, input_splits)
        ctx.group = (group_name, group_size)
        # The stream x was made on (None: the current one), where x's producer's backward
        # will read the gradient this backward makes.
        ctx.input_stream = input_stream
        return _all_to_all(x.contiguous(), output_splits, input_splits, group_name, group_size)

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        grad_x = _all_to_all(grad_out.contiguous(), input_splits, output_splits, *ctx.group)
        if ctx.input_stream is not None:
            grad_x.record_stream(ctx.input_stream)
        return grad_x, None, None, None, None, None


def group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def exchange(x: Tensor, group: dist.ProcessGroup, output_splits: list | None = None,
             input_splits: list | None = None, *, input_stream=None) -> Tensor:
    """All-to-all of the rows of x (R, ...) over ``group``, differentiable in x.

    With splits None every rank sends R / group size rows to each rank (the fixed-size exchange
    of the sync-free mode) and receives as many; otherwise ``input_splits[d]`` rows go to rank d
    and ``output_splits[s]`` rows come from rank s (host ints: the exact mode).
    ``input_stream``: the CUDA stream x was made on when the exchange is issued from another
    one (the pipeline's side stream); backward marks x's gradient as used there.
    """
    size, name = group.size(), group_name(group)
    if x.requires_grad and torch.is_grad_enabled():
        return _Exchange.apply(x, output_splits, input_splits, name, size, input_stream)
    return _all_to_all(x.contiguous(), output_splits, input_splits, name, size)
