"""GPU tier of expert parallelism (tests/ep_gpu_cases.py).

One GPU: NCCL with a group of one rank, in this process (a FileStore, world size 1): the
exchanges are real NCCL all_to_all_single calls over one rank. Two GPUs: the same cases on
two spawned NCCL ranks (skipped with fewer GPUs).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_available()
                                 or not dist.is_nccl_available(), reason="needs CUDA and NCCL")]


@pytest.fixture(scope="module")
def one_rank():
    """The default process group: NCCL over this process alone."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    fd, path = tempfile.mkstemp(prefix="ep_store_")
    os.close(fd)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    import ep_gpu_cases

    yield ep_gpu_cases
    dist.destroy_process_group()
    os.unlink(path)


@pytest.fixture(scope="module")
def two_ranks():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from ep_pool import RankPool

    pool = RankPool(2, backend="nccl", cases="ep_gpu_cases")
    yield pool
    pool.close()


CASES = [("matches_plain", dict(capacity_factor=2.0, num_chunks=1)),
         ("matches_plain", dict(capacity_factor=2.0, num_chunks=2)),
         ("matches_plain", dict(capacity_factor=None, num_chunks=1)),
         ("exact_mode_matches_plain", dict(num_chunks=2)),
         ("overflow_matches_masked_plain", dict()),
         ("no_host_sync", dict(num_chunks=1)),
         ("no_host_sync", dict(num_chunks=2)),
         ("bitwise_deterministic", dict(num_chunks=1)),
         ("bitwise_deterministic", dict(num_chunks=3)),
         ("cuda_graph_replays", dict(num_chunks=1)),
         ("cuda_graph_replays", dict(num_chunks=2)),
         ("compiled_matches_eager", dict(num_chunks=2))]
IDS = [f"{name}-" + "-".join(f"{k}{v}" for k, v in kw.items()) for name, kw in CASES]


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_one_rank(one_rank, name, kwargs):
    getattr(one_rank, name)(**kwargs)


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_two_ranks(two_ranks, name, kwargs):
    two_ranks.run(name, **kwargs)
