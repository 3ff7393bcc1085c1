"""What every benchmark here shares: waiting for the device, the median of timed calls, a CSV.

Imported from beside the scripts (`python benchmarks/bench_*.py` puts this folder on sys.path)."""

from __future__ import annotations

import csv
import os
import statistics
import time

import torch


def sync(device) -> None:
    """Waits for the device's queued work: MPS runs asynchronously, the CPU Metal device does not."""
    if torch.device(device).type == "mps":
        torch.mps.synchronize()


def timed(fn, device, repeats: int) -> float:
    """The median wall time of fn() in seconds over `repeats` calls, after one warm-up call (which
    compiles or loads the kernels), each call synchronised before the clock stops."""
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def write_csv(path, rows) -> None:
    """rows (dicts with the same keys) as a CSV at path, its folder made if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
