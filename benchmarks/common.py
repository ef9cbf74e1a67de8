"""Model shapes and routing of DESIGN.md section 6, shared by the benchmarks."""

from __future__ import annotations

import dataclasses
import json
import platform
import time

import torch


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    tokens: int
    top_k: int
    experts: int  # local experts
    hidden: int
    inter: int


MODELS = [
    ModelShape("DeepSeek-V3 EP8", 4096, 8, 32, 7168, 2048),
    ModelShape("Qwen3-30B-A3B", 4096, 8, 128, 2048, 768),
    ModelShape("Mixtral-8x7B", 4096, 2, 8, 4096, 14336),
    ModelShape("GPT-OSS-120B", 4096, 4, 128, 2880, 2880),
]


def group_counts(rows: int, groups: int, routing: str, seed: int = 0) -> torch.Tensor:
    """Rows per group: "uniform" (as even as possible) or "skewed" (softmax(N(0,1)) expert
    probabilities, rows drawn multinomially, seeded)."""
    if routing == "uniform":
        counts = torch.full((groups,), rows // groups, dtype=torch.int64)
        counts[: rows % groups] += 1
        return counts
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(groups, generator=gen), 0)
    draws = torch.multinomial(probs, rows, replacement=True, generator=gen)
    return torch.bincount(draws, minlength=groups)


def offsets(rows: int, groups: int, routing: str, device="cuda", seed: int = 0) -> torch.Tensor:
    return torch.cumsum(group_counts(rows, groups, routing, seed), 0).to(torch.int32).to(device)


def bench(fn) -> float:
    """Median time in ms (CUDA events, triton.testing.do_bench)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
