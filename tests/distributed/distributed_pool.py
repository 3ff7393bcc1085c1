"""One pool of gloo processes per test module: spawning one costs 10-14 s here, so a module starts
its pool once and sends every case to all of its ranks. Traffic stays on loopback
(GLOO_SOCKET_IFNAME=lo, a file store); every collective times out after 60 s, so a case that
would hang fails instead."""

from __future__ import annotations

import datetime
import os
import queue
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

TIMEOUT_SECONDS = 60


def _worker(rank: int, size: int, store: str, tasks, results) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS),
    )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import distributed_cases as cases

    while True:
        task = tasks.get()
        if task is None:
            break
        name, kwargs = task
        try:
            getattr(cases, name)(**kwargs)
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 (reported to the test, whatever it was)
            results.put((rank, traceback.format_exc()))
    os._exit(0)  # nothing to flush; an orderly interpreter exit takes seconds here


class Pool:
    """size processes in one gloo group, each running distributed_cases.<name>(**kwargs) on request."""

    def __init__(self, size: int):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        context = mp.get_context("spawn")
        self.size = size
        self._dir = tempfile.TemporaryDirectory()
        store = os.path.join(self._dir.name, "store")
        self._tasks = [context.Queue() for _ in range(size)]
        self._results = context.Queue()
        self._processes = [
            context.Process(target=_worker, args=(rank, size, store, self._tasks[rank], self._results), daemon=True)
            for rank in range(size)
        ]
        for process in self._processes:
            process.start()
        self.broken = False

    def run(self, name: str, **kwargs) -> None:
        """Runs the case on every rank; raises AssertionError with each failing rank's traceback."""
        assert not self.broken, "an earlier case left the pool hanging"
        for tasks in self._tasks:
            tasks.put((name, kwargs))
        failures = {}
        for _ in range(self.size):
            try:
                rank, failure = self._results.get(timeout=TIMEOUT_SECONDS + 30)
            except queue.Empty:
                self.broken = True
                raise AssertionError(
                    f"case {name} {kwargs}: a rank did not answer within {TIMEOUT_SECONDS + 30} s"
                ) from None
            if failure is not None:
                failures[rank] = failure
        if failures:
            raise AssertionError(
                f"case {name} {kwargs}:\n" + "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(failures.items()))
            )

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self._dir.cleanup()
