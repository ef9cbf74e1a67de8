"""CPU tier: the benchmark scripts' calls run (the GPU runs time them; here the CPU reference
serves every op, so no figure means anything): a script that rots would first show on the
device, where time is scarce."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_eager_op_table_calls_every_op():
    pytest.importorskip("transformers")  # bench_eager imports the HF experts module helper
    import bench_eager

    rows = bench_eager.op_rows(device="cpu", calls=1, rounds=1)
    names = [r["op"] for r in rows]
    for op in ("grouped_mm", "grouped_mm_wgrad", "grouped_mm_wgrad_accumulate_", "grouped_sum", "moe_route",
               "moe_permute", "moe_unpermute", "moe_activation", "moe_activation_backward",
               "grouped_quantize rowwise", "grouped_quantize both ways", "scaled_grouped_mm",
               "fp8_grouped_mm (weight cached)", "fp8_grouped_mm fwd+bwd (weight cached)"):
        assert op in names
    assert all(r["host_us"] > 0 for r in rows)


def test_rows_benchmark_routings():
    """benchmarks/bench_rows.py's routings: k distinct experts a token; Zipf's hottest expert
    takes many times the uniform share, uniform routing none."""
    import torch

    import bench_rows

    for kind, least_ratio in (("uniform", 0.8), ("zipf", 5.0)):
        ids, weights = bench_rows.routing(4096, 128, 8, kind, device="cpu")
        assert ids.shape == weights.shape == (4096, 8)
        assert all(len(set(row)) == 8 for row in ids.tolist())
        counts = torch.bincount(ids.reshape(-1), minlength=128).float()
        ratio = counts.max() / counts.mean()
        assert ratio >= least_ratio and (kind == "zipf" or ratio < 1.5), (kind, ratio)
        torch.testing.assert_close(weights.sum(-1), torch.ones(4096))


def test_wgrad_unaligned_problems():
    """benchmarks/tools/bench_wgrad_unaligned.py's cases: groups off 16-row starts and the same
    counts rounded up to 16 rows, each a valid weight-gradient call."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks", "tools"))
    import bench_wgrad_unaligned
    from common import ModelShape

    model = ModelShape("tiny", 0, 2, 6, 256, 64)
    problems = bench_wgrad_unaligned.problems(model, 300, device="cpu")
    starts = {name: p[4][:-1] for name, p in problems.items()}
    assert (starts["unaligned"] % 16 != 0).any() and (starts["aligned"] % 16 == 0).all()
    for args in problems.values():  # the op's checks pass, and the output is the gradient's shape
        assert torch.ops.compiled_moe.scaled_grouped_mm_wgrad(*args, torch.float32).shape == (6, 256, 128)


def test_torchtitan_benchmark_builds_the_layer_at_a_shape():
    """benchmarks/bench_torchtitan.py's layer: torchtitan's MoE with the sizes replaced (here
    small, on CPU), shared experts included, runs forward at those sizes."""
    import torch

    pytest = __import__("pytest")
    pytest.importorskip("torchtitan")
    try:
        import torchtitan.models.deepseek_v3  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torchtitan does not import with torch {torch.__version__}: {e}")
    import bench_torchtitan

    moe = bench_torchtitan.torchtitan_moe(64, 8, 2, 32, 48, device="cpu")
    assert tuple(moe.routed_experts.inner_experts.w1_EFD.shape) == (8, 32, 64)
    assert tuple(moe.router.gate.weight.shape) == (8, 64)
    assert moe.router.top_k == 2 and tuple(moe.shared_experts.w1.weight.shape) == (48, 64)
    out = moe(torch.randn(1, 5, 64, dtype=torch.bfloat16))
    assert out.shape == (1, 5, 64) and torch.isfinite(out.float()).all()
