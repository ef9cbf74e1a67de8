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
