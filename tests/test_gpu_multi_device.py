"""GPU tier, two GPUs: ops on tensors that live on a GPU other than the current one (Hugging
Face's device_map="auto" places layers on several GPUs of one process). Every op must launch
on its tensors' GPU and give the same bits as on the current GPU, and leave the current
device as it was."""

from __future__ import annotations

import pytest
import torch

import compiled_moe as cm
from helpers import random_offsets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _on(device, tensors: dict) -> dict:
    return {k: (v.detach().to(device).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
            for k, v in tensors.items()}


def _results_on(device, make_inputs, step):
    """step(**inputs on device): outputs and input gradients, on the CPU for comparison."""
    inputs = _on(device, make_inputs())
    outs = step(**inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    grads = []
    if any(o.requires_grad for o in outs):
        sum(o.float().sum() for o in outs if o.requires_grad).backward()
        grads = [v.grad for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    torch.cuda.synchronize(device)
    # bits compared: FP8 data as bytes (torch.equal has no float8 kernel on the CPU)
    return [t.cpu().view(torch.uint8) if t.element_size() == 1 else t.cpu() for t in (*outs, *grads)]


def _assert_same_on_both_gpus(make_inputs, step):
    torch.cuda.set_device(0)
    want = _results_on("cuda:0", make_inputs, step)
    got = _results_on("cuda:1", make_inputs, step)
    assert torch.cuda.current_device() == 0, "an op changed the current device"
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w), "results on the non-current GPU differ from the current GPU's"


def _grouped_inputs(dtype, M=1024, K=512, N=384, G=8):
    def make():
        gen = torch.Generator().manual_seed(0)
        return dict(
            a=torch.randn(M, K, generator=gen, dtype=dtype).requires_grad_(),
            b=(torch.randn(G, N, K, generator=gen, dtype=dtype) / K ** 0.5).mT.requires_grad_(),
            offs=random_offsets(M, G, generator=gen, empty_groups=1, tail=5))
    return make


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # Hopper CUDA / Triton kernels
def test_grouped_mm_on_other_gpu(dtype):
    _assert_same_on_both_gpus(_grouped_inputs(dtype), lambda a, b, offs: cm.grouped_mm(a, b, offs))


def test_wgrad_accumulate_on_other_gpu():
    make = _grouped_inputs(torch.bfloat16)

    def step(a, b, offs):
        d = cm.grouped_mm(a, b, offs).detach()
        main_grad = torch.ones(b.shape[0], b.shape[1], d.shape[1], device=a.device)
        mask = torch.arange(b.shape[0], device=a.device) % 2 == 0
        cm.grouped_mm_wgrad_accumulate_(main_grad, a.detach(), d, offs, accumulate_mask=mask)
        return main_grad, cm.grouped_sum(d, offs)

    _assert_same_on_both_gpus(make, step)


@pytest.mark.parametrize("fused", [None, True, False])  # None: 2048 pairs, the one-call C++ block
def test_moe_experts_on_other_gpu(fused):
    T, H, I, E, k = 512, 512, 256, 16, 4

    def make():
        gen = torch.Generator().manual_seed(1)
        logits = torch.randn(T, E, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), k)
        return dict(
            hidden=torch.randn(T, H, generator=gen, dtype=torch.bfloat16).requires_grad_(),
            topk_ids=ids, topk_weights=weights.requires_grad_(),
            w1=(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16().requires_grad_(),
            w2=(torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16().requires_grad_())

    _assert_same_on_both_gpus(make, lambda **kw: cm.moe_experts(**kw, fused=fused))


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_fp8_grouped_mm_on_other_gpu(recipe):
    # forward, dgrad and wgrad in FP8: grouped_quantize (both directions) and the FP8 GEMMs
    _assert_same_on_both_gpus(_grouped_inputs(torch.bfloat16),
                              lambda a, b, offs: cm.fp8_grouped_mm(a, b, offs, recipe=recipe))


def test_mxfp8_quantize_on_other_gpu():
    def make():
        gen = torch.Generator().manual_seed(2)
        return dict(x=torch.randn(1000, 256, generator=gen, dtype=torch.bfloat16),
                    offs=random_offsets(1000, 4, generator=gen))

    _assert_same_on_both_gpus(
        make, lambda x, offs: cm.grouped_quantize(x, offs, "mxfp8", rowwise=True, columnwise=True))


def test_compiled_block_on_other_gpu():
    T, H, I, E, k = 256, 256, 128, 8, 2

    def make():
        gen = torch.Generator().manual_seed(3)
        weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=gen), -1), k)
        return dict(
            hidden=torch.randn(T, H, generator=gen, dtype=torch.bfloat16), topk_ids=ids,
            topk_weights=weights, w1=(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16(),
            w2=(torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16())

    block = torch.compile(cm.moe_experts, fullgraph=True)
    _assert_same_on_both_gpus(make, lambda **kw: block(**kw))
