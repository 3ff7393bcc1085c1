"""Benchmark of the CPU Metal device itself: thread synchronisations per second, per core and
across cores.

    python benchmarks/bench_cpu_device.py [--iterations N]

A thread-sync is one GPU thread passing one barrier or SIMD collective. The kernel alternates
threadgroup_barrier and simd_sum in a loop on 1024-thread threadgroups. One threadgroup keeps one
core busy; a grid of several threadgroups per core shows the scaling. Target: at least 20 million
thread-syncs per second per core. Writes benchmarks/results/cpu_device.csv.
"""
from __future__ import annotations

import argparse
import csv
import os
import struct
import time

import torch

from flashattn_mps.metal_cpu import compile_library

SOURCE = """
#include <metal_stdlib>
using namespace metal;
kernel void sync_loop(device float *out [[buffer(0)]], constant uint &iterations [[buffer(1)]],
                      uint tid [[thread_index_in_threadgroup]], uint group [[threadgroup_position_in_grid]]) {
  float v = float(tid);
  for (uint i = 0; i < iterations; ++i) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = simd_sum(v) * 0.5f;
  }
  out[group * 1024 + tid] = v;
}
"""


def measure(lib, groups: int, iterations: int) -> float:
    out = torch.zeros(groups * 1024)
    args = [out, struct.pack("I", iterations)]
    lib.dispatch("sync_loop", (groups,), (1024,), args)  # warm-up
    start = time.perf_counter()
    lib.dispatch("sync_loop", (groups,), (1024,), args)
    seconds = time.perf_counter() - start
    return groups * 1024 * iterations * 2 / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    lib = compile_library(SOURCE, name="bench_sync.metal")
    cores = os.cpu_count() or 1
    rows = []
    for groups in sorted({1, cores, 4 * cores}):
        rate = measure(lib, groups, args.iterations)
        busy = min(groups, cores)
        rows.append(dict(threadgroups=groups, cores_busy=busy, syncs_per_s=rate, syncs_per_s_per_core=rate / busy))
        print(f"{groups:>4} threadgroups on {busy} core(s): {rate / 1e6:8.1f} M thread-syncs/s "
              f"({rate / busy / 1e6:.1f} M/s per core; target >= 20)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cpu_device.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
