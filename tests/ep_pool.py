"""A pool of gloo processes for the distributed CPU tier: one process group per pool, reused by
every case of a test module (spawning a group per case would cost seconds each).

``RankPool(world_size).run("case", **kwargs)`` runs ``ep_cases.case(**kwargs)`` on every rank
and returns the ranks' results; a failure on any rank raises with every rank's traceback, and
the pool starts afresh for the next case (a failed collective may leave the group unusable).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
import traceback

CASE_TIMEOUT_S = 120


def _worker(rank, world_size, init_file, backend, cases, commands, results):
    import torch

    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    import torch.distributed as dist

    kw = {}
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60), **kw)
    import importlib

    ep_cases = importlib.import_module(cases)

    while (command := commands.get()) is not None:
        name, kwargs = command
        try:
            results.put((rank, True, getattr(ep_cases, name)(**kwargs)))
        except BaseException:  # noqa: BLE001 (reported to the test, which raises)
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``backend`` gloo (CPU) or nccl (rank r on GPU r); ``cases``: the module of case functions."""

    def __init__(self, world_size: int, backend: str = "gloo", cases: str = "ep_cases"):
        self.world_size, self.backend, self.cases = world_size, backend, cases
        self._procs = []

    def _start(self):
        ctx = multiprocessing.get_context("spawn")
        fd, init_file = tempfile.mkstemp(prefix="ep_pool_")
        os.close(fd)
        os.unlink(init_file)  # the file store creates it
        self._commands = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, init_file, self.backend,
                                         self.cases, self._commands[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, case_name: str, **kwargs) -> list:
        if not self._procs:
            self._start()
        for q in self._commands:
            q.put((case_name, kwargs))
        got = {}
        try:
            while len(got) < self.world_size:
                rank, ok, payload = self._results.get(timeout=CASE_TIMEOUT_S)
                got[rank] = (ok, payload)
        except queue.Empty:
            self.close(kill=True)
            raise AssertionError(f"{case_name}: ranks {sorted(set(range(self.world_size)) - set(got))} "
                                 f"did not finish in {CASE_TIMEOUT_S} s; finished: "
                                 f"{ {r: p for r, (ok, p) in got.items() if not ok} }")
        failed = {r: p for r, (ok, p) in got.items() if not ok}
        if failed:
            self.close(kill=True)
            raise AssertionError(f"{case_name} failed on ranks {sorted(failed)}:\n" +
                                 "\n".join(f"--- rank {r}\n{tb}" for r, tb in sorted(failed.items())))
        return [got[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False):
        for p, q in zip(self._procs, self._commands if self._procs else []):
            if kill:
                p.kill()
            else:
                q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._procs = []
