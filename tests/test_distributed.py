"""Expert parallelism on CPU: 2 and 4 gloo processes (one process group per world size for the
whole module, tests/ep_pool.py), each case in tests/ep_cases.py. The EP block is checked
against the single-process block on the same global weights: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ep_pool import RankPool

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ranks{n}")
def pool(request):
    p = RankPool(request.param)
    yield p
    p.close()


# Sync-free with capacity factor P (T*k rows per rank pair: nothing can drop) and exact mode;
# one chunk and several (the pipeline's layout; 3 chunks split rows unevenly in exact mode).
@pytest.mark.parametrize("capacity_factor,num_chunks", [("P", 1), ("P", 2), (None, 1), (None, 3)])
def test_block_matches_single_process(pool, capacity_factor, num_chunks):
    sums = pool.run("block_matches_single", capacity_factor=capacity_factor, num_chunks=num_chunks)
    assert len(set(sums)) == pool.world_size  # each rank has its own tokens


def test_ep_moe_experts_no_bias_top2(pool):
    pool.run("block_matches_single", capacity_factor=None, num_chunks=2, fn="ep_moe_experts",
             bias=False, top_k=2, experts_per_rank=3)


@pytest.mark.parametrize("case", ["nothing", "one_rank"])
@pytest.mark.parametrize("capacity_factor", ["P", None])
def test_skewed_routing(pool, capacity_factor, case):
    pool.run("skewed_routing", capacity_factor=capacity_factor, case=case)


@pytest.mark.parametrize("capacity_factor,num_chunks,invalid_ids",
                         [(0.5, 1, False), (0.75, 2, False), (1.0, 1, True)])
def test_overflow_dropped_and_counted(pool, capacity_factor, num_chunks, invalid_ids):
    totals = pool.run("overflow", capacity_factor=capacity_factor, num_chunks=num_chunks,
                      invalid_ids=invalid_ids)
    assert totals[0] > 0, "the case should overflow"


# Different token counts on every rank, one rank with none: sync-free (its exchange sizes come
# from ep_max_tokens, never from T) and exact, one chunk and several, through moe_experts and
# ep_moe_experts.
@pytest.mark.parametrize("capacity_factor,num_chunks,fn", [
    ("P", 1, "moe_experts"), ("P", 2, "ep_moe_experts"), (None, 1, "moe_experts"),
    (None, 2, "ep_moe_experts")])
def test_ragged_tokens(pool, capacity_factor, num_chunks, fn):
    pool.run("ragged_tokens", capacity_factor=capacity_factor, num_chunks=num_chunks, fn=fn)


@pytest.mark.parametrize("capacity_factor,num_chunks", [(0.5, 1), (0.75, 2)])
def test_ragged_tokens_overflow(pool, capacity_factor, num_chunks):
    tokens = [3 + 4 * r for r in range(pool.world_size)]
    totals = pool.run("overflow", capacity_factor=capacity_factor, num_chunks=num_chunks,
                      tokens=tokens)
    assert totals[0] > 0, "the case should overflow"


def test_ranks_past_the_bound(pool):
    totals = pool.run("past_the_bound")
    assert totals[0] > 0, "the ranks past the bound should drop pairs"


@pytest.mark.parametrize("what", ["width", "dtype", "experts"])
def test_exact_mode_rejects_mismatch_on_every_rank(pool, what):
    pool.run("exact_mode_rejects_mismatch", what=what)


def test_exact_mode_rejects_bad_ids_on_every_rank(pool):
    pool.run("exact_mode_rejects_bad_ids")


def test_bad_arguments(pool):
    pool.run("bad_arguments")


@pytest.mark.parametrize("capacity_factor", [4.0, None])
def test_dispatch_combine(pool, capacity_factor):
    pool.run("dispatch_combine", capacity_factor=capacity_factor)


def test_module(pool):
    pool.run("module_ep")


@pytest.mark.parametrize("capacity_factor", [1.25, None])
def test_group_of_one(pool, capacity_factor):
    pool.run("group_of_one", capacity_factor=capacity_factor)


def test_compiled_one_graph(pool):
    if pool.world_size > 2:
        pytest.skip("compiled once, on 2 ranks (time)")
    pool.run("compiled_one_graph")


@pytest.mark.parametrize("ranks", [1, 2])
def test_benchmark_script_runs(ranks, tmp_path):
    """benchmarks/bench_ep.py, the script the GPU runs use (one process, torchrun over two),
    runs end to end over gloo at small shapes: its peer composition agrees with the EP block
    (the script checks it first) and it writes every row of its table."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench_ep.json"
    script = [os.path.join(root, "benchmarks", "bench_ep.py"), "--device", "cpu", "--tokens", "32",
              "--reps", "1", "--chunks", "1,2", "--out", str(out)]
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, *launcher, *script], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    names = {r["name"] for r in rows}
    if ranks == 1:
        assert {r["part"] for r in rows} == {"a"} and "plain block (moe_experts)" in names
    else:
        assert {r["shape"] for r in rows} == {"Qwen3-30B-A3B", "DeepSeek-V3"}
        assert {"torchtitan-style (splits to host, _grouped_mm)", "EP sync-free f=1.25 N=2",
                "NCCL all_to_all_single x4, same bytes"} <= names
