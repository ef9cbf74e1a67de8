"""CPU tier: every Triton kernel, at the tiles the heuristics pick for the benchmarks' model
shapes, compiles for Hopper (sm_90) within its shared memory, so the GPU cannot refuse a launch
with OutOfResources. Runs scripts/kernel_report.py, which compiles without a GPU, in a process
of its own: this one imports the kernels for the Triton interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# DeepSeek-V3: groups of 1024 rows, where the weight gradient takes its 64 x 256 x 128 tile (an
# fp32 main_grad staged by TMA beside it asked for 272 KB, found on the H200).
@pytest.mark.parametrize("model", ["qwen3", "gpt-oss", "deepseek"])
def test_kernels_compile_for_sm90(model):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "COMPILED_MOE_TILE")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernel_report.py"),
                          "--model", model, "--check"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    for kernel in ("_grouped_mm_kernel", "_grouped_mm_wgrad_kernel", "_mlp_fc1_kernel",
                   "_scaled_grouped_mm_kernel", "_quantize_group_columns_kernel",
                   "_route_one_program_kernel"):
        assert kernel in run.stdout, run.stdout
    assert ", 0 failing" in run.stdout
