"""The fused expert MLP on expert-sorted tokens (TransformerEngine's grouped MLP contract),
with the weight-gradient features of training frameworks: fp32 main_grad accumulation with a
per-expert mask, and weight gradients delayed to a later call (pipeline schedules)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, is_grad_enabled

from compiled_moe.fp8 import fp8_activation_grouped_mm, fp8_grouped_mm
from compiled_moe.ops import moe_mlp as mlp_ops
from compiled_moe.ops._dispatch import check_same_device, check_tensor
from compiled_moe.ops.activations import activation_constants
from compiled_moe.ops.grouped_mm import check_accumulate_mask
from compiled_moe.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_recipe


def _needs_grad(*tensors: Tensor | None) -> bool:
    # is_grad_enabled by name: a traced frame that reaches `torch` through two modules' globals
    # (this one's and local_experts.py's) gets a Python-level guard that they are the same object.
    return is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def apply_activation(h: Tensor, activation: str, gate_up_layout: str, alpha: float,
                     limit: float) -> Tensor:
    """The moe_activation op, constants passed only where they differ from its defaults."""
    return torch.ops.compiled_moe.moe_activation(h, activation, gate_up_layout,
                                                 **activation_constants(activation, alpha, limit))


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor, bias: Tensor | None,
                   fp8_recipe: str | None, weight_fp8: tuple | None = None) -> Tensor:
    """x @ w[g].T (+ bias[g]) for a (G, N, K) weight, in x's dtype or in FP8 (weight_fp8: w's
    quantize_weight, computed beforehand)."""
    if fp8_recipe is None:
        return torch.ops.compiled_moe.grouped_mm(x, w.transpose(-2, -1), offs, bias)
    return fp8_grouped_mm(x, w.transpose(-2, -1), offs, recipe=fp8_recipe, bias=bias,
                          weight_fp8=weight_fp8)


def check_fp8_weights(fp8_weights, fp8_recipe) -> tuple:
    """(w1's, w2's) quantize_weight results, or (None, None)."""
    if fp8_weights is None:
        return None, None
    if fp8_recipe is None:
        raise ValueError("fp8_weights needs fp8_recipe (the recipe they were quantized with)")
    if (not isinstance(fp8_weights, (tuple, list)) or len(fp8_weights) != 2
            or any(q is None for q in fp8_weights)):
        raise TypeError("fp8_weights must be (quantize_weight(w1, recipe), "
                        "quantize_weight(w2, recipe)), or None")
    return tuple(fp8_weights)


class WeightGradStore:
    """Weight gradients of :func:`moe_mlp` backward passes, computed when :meth:`compute` runs.

    Pass one as ``wgrad_store``: backward then computes the input gradients only and queues
    the weight-gradient GEMMs, which a pipeline schedule runs later to fill a bubble.
    """

    def __init__(self) -> None:
        self._queue: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, step: Callable[[], None]) -> None:
        self._queue.append(step)

    def compute(self) -> None:
        """Run the queued weight gradients in the order their backward passes ran."""
        queue, self._queue = self._queue, []
        for step in queue:
            step()


def _accumulate_grad(w: Tensor, grad: Tensor) -> None:
    w.grad = grad if w.grad is None else w.grad + grad


class _MoEMLPTraining(torch.autograd.Function):
    """moe_mlp whose backward leaves the weight gradients to main_grad and/or a store.

    Eager only: its backward has side effects (main_grad, the store) that a compiled graph
    would not replay."""

    @staticmethod
    def forward(ctx, x, offs, w1, w2, probs, b1, b2, activation, gate_up_layout, alpha, limit,
                fuse_wgrad_accumulation, accumulate_mask, wgrad_store):
        y, h = torch.ops.compiled_moe.moe_mlp(x, offs, w1, w2, activation, gate_up_layout, probs,
                                              b1, b2, alpha=alpha, limit=limit)
        ctx.save_for_backward(x, offs, w1, w2, probs, h, accumulate_mask)
        ctx.args = (activation, gate_up_layout, alpha, limit)
        ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        ctx.fuse = fuse_wgrad_accumulation
        ctx.store = wgrad_store
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, offs, w1, w2, probs, h, mask = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy = grad_y.to(x.dtype)
        grad_x, dh, a, dprobs = mlp_ops.input_grads(dy, x, offs, w1, w2, probs, None, None, h,
                                                    ctx.args, need[0])
        grad_b1, grad_b2 = mlp_ops.bias_grads(dy, dh, offs, ctx.bias_dtypes, need[5], need[6])
        grad_probs = dprobs.to(probs.dtype) if probs is not None and need[4] else None
        if ctx.store is None and not ctx.fuse:
            grad_w1, grad_w2 = mlp_ops.weight_grads(dy, dh, a, x, offs, w1, w2, None, None,
                                                    need[2], need[3])
            return (grad_x, None, grad_w1, grad_w2, grad_probs, grad_b1, grad_b2) + (None,) * 7

        def weight_step(fuse=ctx.fuse, need_w1=need[2], need_w2=need[3]):
            if fuse:
                if need_w1:
                    torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_(w1.main_grad, dh, x, offs,
                                                                        mask)
                if need_w2:
                    torch.ops.compiled_moe.grouped_mm_wgrad_accumulate_(w2.main_grad, dy, a, offs,
                                                                        mask)
                return
            grad_w1, grad_w2 = mlp_ops.weight_grads(dy, dh, a, x, offs, w1, w2, None, None,
                                                    need_w1, need_w2)
            for w, g in ((w1, grad_w1), (w2, grad_w2)):
                if g is not None:
                    _accumulate_grad(w, g)

        if ctx.store is not None:
            ctx.store.put(weight_step)
        else:
            weight_step()
        return (grad_x, None, None, None, grad_probs, grad_b1, grad_b2) + (None,) * 7


def _check_training_args(w1, w2, fuse_wgrad_accumulation, accumulate_mask, wgrad_store):
    if torch.compiler.is_compiling():
        raise RuntimeError("fuse_wgrad_accumulation, accumulate_mask and wgrad_store run in "
                           "eager mode only: their backward has side effects a compiled graph "
                           "would not replay")
    if accumulate_mask is not None and not fuse_wgrad_accumulation:
        raise ValueError("accumulate_mask needs fuse_wgrad_accumulation=True")
    # Checked here, not when backward (or wgrad_store.compute()) first writes main_grad.
    check_accumulate_mask(accumulate_mask, w1.shape[0])
    check_same_device("w1", w1, accumulate_mask=accumulate_mask)
    for name, w in (("w1", w1), ("w2", w2)):
        if fuse_wgrad_accumulation:
            main_grad = getattr(w, "main_grad", None)
            if not isinstance(main_grad, Tensor) or main_grad.shape != w.shape:
                raise ValueError(f"fuse_wgrad_accumulation=True needs {name}.main_grad, a tensor "
                                 f"shaped like {name} {tuple(w.shape)}")
            check_tensor(f"{name}.main_grad", main_grad, 3)
            check_same_device(name, w, **{f"{name}.main_grad": main_grad})
        elif wgrad_store is not None and w.requires_grad and not w.is_leaf:
            raise ValueError(f"wgrad_store adds the delayed gradients to {name}.grad, so {name} "
                             f"must be a leaf tensor (a parameter), not a view of one")


def moe_mlp(x_sorted: Tensor, offs: Tensor, w1: Tensor, w2: Tensor, *, activation: str = "swiglu",
            gate_up_layout: str = "stacked", probs: Tensor | None = None,
            b1: Tensor | None = None, b2: Tensor | None = None, alpha: float = GPT_OSS_ALPHA,
            limit: float = GPT_OSS_LIMIT, fuse_wgrad_accumulation: bool = False,
            accumulate_mask: Tensor | None = None,
            wgrad_store: WeightGradStore | None = None,
            fp8_recipe: str | None = None, fp8_weights: tuple | None = None) -> Tensor:
    """FC1 -> activation (* probs) -> FC2 per expert, on rows already sorted by expert.

    ``y[r] = (act(x[r] @ w1[g]^T + b1[g]) * probs[r]) @ w2[g]^T + b2[g]`` for the rows r of
    group g (``offs``: int32 (G,) cumulative end rows); rows past offs[-1] are zero.

    Two kernels forward: FC1 computes the gate and up columns of an output index in one
    program and applies bias, activation and probs to its accumulators; FC2 is the grouped
    GEMM. (Large problems with I >= 2048 run FC1 as the Hopper grouped GEMM, then the
    activation kernel, which is faster there: ``kernels.configs.fused_mlp_fc1_on_cuda``.)
    For backward only FC1's pre-activation (M, N1) is kept: the activation is recomputed in
    one pass after FC2's input-gradient GEMM, which also applies the activation backward.

    Args:
        x_sorted: (M, H) bf16/fp16/fp32, expert-sorted rows (as after an expert-parallel
            all-to-all, or :func:`compiled_moe.moe_permute`).
        offs: int32 (G,), cumulative end row of each expert's group.
        w1: (G, N1, H), nn.Linear layout (N1 = 2I for gated activations), any strides.
        w2: (G, H, I), nn.Linear layout, any strides.
        activation: ``swiglu, geglu, gpt_oss, relu2, gelu, silu``.
        gate_up_layout: ``stacked`` ([gate | up]) or ``interleaved`` (g0 u0 g1 u1 ...).
        probs: optional (M,) routing probability of each row, applied to the activation
            before FC2 (TransformerEngine's scaled activation).
        b1: optional (G, N1); b2: optional (G, H).
        alpha, limit: the ``gpt_oss`` activation's constants.
        fuse_wgrad_accumulation: backward adds the weight gradients into ``w1.main_grad`` and
            ``w2.main_grad`` (usually fp32, shaped like the weights) in place, and leaves
            ``.grad`` of the weights untouched (TransformerEngine's fuse_wgrad_accumulation).
        accumulate_mask: optional bool (G,) on the device, with fuse_wgrad_accumulation:
            experts whose entry is False overwrite their main_grad instead of adding to it.
        wgrad_store: a :class:`WeightGradStore`: backward computes the input, probs and bias
            gradients only; ``wgrad_store.compute()`` later computes the weight gradients
            (into main_grad, or added to the weights' ``.grad``).
        The last three run in eager mode only.
        fp8_recipe: None, or an FP8 recipe (``fp8_blockwise``, ``fp8_rowwise``, ``mxfp8``):
            both GEMMs of forward and backward run in FP8 (:func:`compiled_moe.fp8_grouped_mm`;
            H and I multiples of 16 let the Hopper CUDA kernels run). FC2's FP8 input is
            quantized straight from FC1's output (:func:`compiled_moe.fp8_activation_grouped_mm`:
            the activation (* probs) in x's dtype, rounded as without a recipe, never written);
            backward keeps h and the activation's columnwise FP8 data.
            Not combined with the three training options above yet.
        fp8_weights: with fp8_recipe, ``(quantize_weight(w1, recipe), quantize_weight(w2,
            recipe))`` computed beforehand, e.g. once per optimizer step for several
            micro-batches (see :func:`compiled_moe.fp8_grouped_mm`); None quantizes the weights
            in the call.

    Returns:
        (M, H) in x's dtype. Differentiable in x_sorted, w1, w2, probs, b1 and b2.
    """
    w1_fp8, w2_fp8 = check_fp8_weights(fp8_weights, fp8_recipe)
    if fp8_recipe is not None:
        return _fp8_mlp(x_sorted, offs, w1, w2, activation, gate_up_layout, probs, b1, b2, alpha,
                        limit, fuse_wgrad_accumulation or accumulate_mask is not None
                        or wgrad_store is not None, fp8_recipe, w1_fp8, w2_fp8)
    if fuse_wgrad_accumulation or accumulate_mask is not None or wgrad_store is not None:
        _check_training_args(w1, w2, fuse_wgrad_accumulation, accumulate_mask, wgrad_store)
        return _MoEMLPTraining.apply(x_sorted, offs, w1, w2, probs, b1, b2, activation,
                                     gate_up_layout, alpha, limit, fuse_wgrad_accumulation,
                                     accumulate_mask, wgrad_store)
    y, _ = torch.ops.compiled_moe.moe_mlp(x_sorted, offs, w1, w2, activation, gate_up_layout,
                                          probs, b1, b2,
                                          save_h=_needs_grad(x_sorted, w1, w2, probs, b1, b2),
                                          **activation_constants(activation, alpha, limit))
    return y


def _fp8_mlp(x, offs, w1, w2, activation, gate_up_layout, probs, b1, b2, alpha, limit,
             training_options, fp8_recipe, w1_fp8, w2_fp8):
    """moe_mlp with FP8 GEMMs: FC1, then FC2 on the activation (* probs) of FC1's output,
    quantized in one pass over it (fp8_activation_grouped_mm)."""
    check_recipe(fp8_recipe)
    if training_options:
        raise ValueError("fp8_recipe does not combine with fuse_wgrad_accumulation, "
                         "accumulate_mask or wgrad_store yet")
    mlp_ops.check_inputs(x, offs, w1, w2, activation, gate_up_layout, probs, b1, b2)
    h = grouped_linear(x, w1, offs, b1, fp8_recipe, w1_fp8)
    return fp8_activation_grouped_mm(h, w2.transpose(-2, -1), offs, activation=activation,
                                     gate_up_layout=gate_up_layout, probs=probs,
                                     recipe=fp8_recipe, bias=b2, weight_fp8=w2_fp8, alpha=alpha,
                                     limit=limit)
