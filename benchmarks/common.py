"""Model shapes and routing of DESIGN.md section 6, shared by the benchmarks."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import time
import types

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


_warmed_up = False


def warm_up(seconds: float = 5.0) -> None:
    """Keep the GPU busy with bf16 matmuls for a few seconds. An idle H200 runs its first
    tenth of a second or so of work at higher clocks than it sustains at its power limit: the
    first timing of a run measured 706-765 TFLOP/s on the DeepSeek-V3 fc1 forward where the same
    kernel sustains 661-684 (and 1091-1099 against 912-971 for the FP8 forward), so the first
    case of every table read fast."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def bench(fn) -> float:
    """Median time in ms (CUDA events, triton.testing.do_bench), after a warm-up of the GPU on
    the first call (see warm_up)."""
    import triton

    global _warmed_up
    if not _warmed_up:
        warm_up()
        # The first timing right after the warm-up still read fast in some runs: the contender
        # timed first read 632-647 TFLOP/s where the others, on the same problem, read 578-607;
        # with the order swapped the other one read fast (RESULTS.md, 2026-11-26). Not used.
        triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        _warmed_up = True
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn, rep: int = 100) -> float:
    """Median GPU time in ms of fn replayed from a CUDA graph (triton.testing.do_bench_cudagraph,
    after one call outside it): no host time."""
    import triton

    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after one call outside it): its replays time the GPU alone."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timed_rounds(fns: dict, rounds: int = 3, timer=None) -> dict:
    """{name: [ms of each round]}: the functions timed in turn in each round (a slow spell of
    the GPU then hits every contender alike), in reverse order every other round (the place in
    a round can favour a contender). timer: bench (the default) or bench_graph."""
    timer = timer or bench
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in (reversed(fns.items()) if r % 2 else fns.items()):
            times[name].append(timer(fn))
    return times


def interleaved(fns: dict, rounds: int = 3) -> dict:
    """{name: ms}, the best of `rounds` medians of each function (timed_rounds)."""
    return {name: min(t) for name, t in timed_rounds(fns, rounds).items()}


def paired_ratio(times: dict, a: str, b: str) -> tuple[float, float, float]:
    """Median, min and max over the rounds of timed_rounds of b's time over a's (> 1: a is
    faster). For two builds a few % apart: on the H200, ratios of the best times of the same
    two builds swung between runs (one FP8 case read 1.19x and 0.88x); the rounds' ratios show
    the spread, and their median moves less."""
    ratios = sorted(tb / ta for ta, tb in zip(times[a], times[b]))
    return statistics.median(ratios), ratios[0], ratios[-1]


def gmean(values) -> float:
    """Geometric mean (of speed ratios)."""
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": props.name if props else None,
        "sms": props.multi_processor_count if props else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


# Host time per eager call (CPU timer, no synchronisation): bench_eager, bench_lowering and
# tools/host_overhead.py. wall: the clock stops after a synchronisation instead (host and GPU
# time as a decode loop sees them).
def host_us(fn, calls=300, wall=False, warmup=20):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if wall:
        sync()
    t = (time.perf_counter() - t0) / calls * 1e6
    sync()
    return t


def gpu_us(fn, calls=10) -> float:
    """GPU kernel time per call: the sum of the device time of every kernel fn launches
    (torch.profiler), whatever the host does between them. Beside a wall time it tells whether
    the host or the GPU holds a step back."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / calls


def interleaved_us(fns: dict, rounds=15, calls=100) -> dict:
    """Host us per call of each function: (median, min, max) over interleaved rounds, so drifts
    of the host (tens of percent between processes and over minutes) hit every variant alike.

    Short rounds: a variant whose GPU time exceeded its host time could otherwise fill the
    driver's queue of pending launches and run at the GPU's pace, timing the GPU instead."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(host_us(fn, calls))
    return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}


def own_code(fn, tag: str):
    """A copy of fn with its own code object. Dynamo keeps compiled code per code object, so
    variants compiled from copies keep their graphs side by side without torch._dynamo.reset()
    (which drops every compiled graph: the next call would recompile)."""
    return types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{tag}"), fn.__globals__,
                              fn.__name__, fn.__defaults__, fn.__closure__)
