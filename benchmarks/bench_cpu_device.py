"""Benchmark of the CPU Metal device itself: thread synchronisations per second, per core and
across cores, and the project's forward and decode kernels on it.

    python benchmarks/bench_cpu_device.py [--iterations N] [--repeats N]

A thread-sync is one GPU thread passing one barrier or SIMD collective. The kernel alternates
threadgroup_barrier and simd_sum in a loop on 1024-thread threadgroups. One threadgroup keeps one
core busy; a grid of several threadgroups per core shows the scaling. Target: at least 20 million
thread-syncs per second per core.

Each figure is the best of --repeats runs, by wall clock and by CPU time (time.process_time: every
thread of the process). On a machine shared with other work the CPU-time figures are the ones to
compare: a busy neighbour stretches wall time, much less the CPU time a dispatch needs. Writes
benchmarks/results/cpu_device.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import struct
import time

import torch

import flashattn_mps
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

# (name, L, S): float16, batch 1, 4 heads, head dim 64
ATTENTION_CASES = (("forward", 256, 256), ("decode", 1, 1024))


def best_times(call, repeats: int) -> tuple[float, float]:
    """The shortest wall and CPU seconds of `repeats` calls, after a warm-up call."""
    call()
    wall = cpu = float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        call()
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the device has its own threads; torch's would add their spinning to the CPU time
    lib = compile_library(SOURCE, name="bench_sync.metal")
    cores = os.cpu_count() or 1
    rows = []
    for groups in sorted({1, cores, 4 * cores}):
        out = torch.zeros(groups * 1024)
        buffers = [out, struct.pack("I", args.iterations)]
        wall, cpu = best_times(lambda: lib.dispatch("sync_loop", (groups,), (1024,), buffers), args.repeats)
        syncs = groups * 1024 * args.iterations * 2
        busy = min(groups, cores)
        rows.append(
            dict(
                case="sync",
                threadgroups=groups,
                cores_busy=busy,
                syncs_per_s=syncs / wall,
                syncs_per_s_per_core=syncs / wall / busy,
                syncs_per_cpu_s=syncs / cpu,
            )
        )
        print(
            f"{groups:>4} threadgroups on {busy} core(s): {syncs / wall / 1e6:8.1f} M thread-syncs/s "
            f"({syncs / wall / busy / 1e6:.1f} M/s per core; target >= 20), "
            f"{syncs / cpu / 1e6:.1f} M per CPU-second"
        )
    g = torch.Generator().manual_seed(0)
    for name, L, S in ATTENTION_CASES:
        q, k, v = (torch.randn(1, 4, n, 64, generator=g).half() for n in (L, S, S))
        wall, cpu = best_times(lambda: flashattn_mps.flash_attention(q, k, v), args.repeats)
        rows.append(dict(case=f"{name} f16 L={L} S={S} H=4 E=64", ms_per_call=wall * 1e3, cpu_ms_per_call=cpu * 1e3))
        print(f"{name} (float16, L={L}, S={S}, 4 heads, E=64): {wall * 1e3:.1f} ms, {cpu * 1e3:.1f} ms of CPU")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cpu_device.csv")
    fields = [
        "case",
        "threadgroups",
        "cores_busy",
        "syncs_per_s",
        "syncs_per_s_per_core",
        "syncs_per_cpu_s",
        "ms_per_call",
        "cpu_ms_per_call",
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
