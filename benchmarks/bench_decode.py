"""Decode benchmark: the decode kernel's bandwidth by GQA ratio, head dim and KV length, with the
planner's split-K against one share, beside explain_plan's estimate.

    python benchmarks/bench_decode.py [--device mps|cpu] [--quick] [--out benchmarks/results]

A step is L = 1 through flash_attn_with_kvcache on a (B, S, Hkv, D) cache, timed as the median of 5
calls after a warm-up. Per row: ms, kv_gb_per_s (K and V read once), the plan's split_count and
explain_plan's fraction_of_bandwidth for this device's GPU family; "one_share" rows force
num_splits=1, so the split's gain (or its overhead at short S) shows directly. Writes
decode_sweep_<tag>.csv. Off a Mac the CPU Metal device runs small shapes: NOT GPU timings.
"""

from __future__ import annotations

import argparse
import os

import torch
from _timing import timed, write_csv  # beside this script

from flashattn_mps import explain_kvcache_plan, flash_attn_with_kvcache


def sweep(device, quick):
    """(q heads, kv heads, head dim, kv length)."""
    if device.type == "mps":
        lengths = [1024, 4096, 16384] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
        return [(32, hkv, d, s) for hkv in (32, 8, 4) for d in (64, 128) for s in lengths]
    lengths = [512] if quick else [512, 2048]
    return [(8, hkv, 64, s) for hkv in (8, 1) for s in lengths]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=["mps", "cpu"], default="mps" if torch.backends.mps.is_available() else "cpu"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = 5 if device.type == "mps" else 2
    rows = []
    print(f"{'Hq':>3} {'Hkv':>3} {'D':>4} {'S':>6} {'splits':>7} {'ms':>9} {'GB/s':>8} {'est':>5}  one share: ms")
    for hq, hkv, d, s in sweep(device, args.quick):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 1, hq, d, generator=gen).to(device, torch.float16)
        k, v = (torch.randn(1, s, hkv, d, generator=gen).to(device, torch.float16) for _ in range(2))
        plan = explain_kvcache_plan(q, k, v)
        decode = next(p for p in plan["dispatches"] if p["function"].startswith("fa_decode_"))
        estimate = decode["estimate"]["fraction_of_bandwidth"]
        seconds = timed(lambda: flash_attn_with_kvcache(q, k, v), device, repeats)
        one_share = timed(lambda: flash_attn_with_kvcache(q, k, v, num_splits=1), device, repeats)
        gb_per_s = (k.nbytes + v.nbytes) / seconds / 1e9
        rows.append(
            dict(
                device="mps" if device.type == "mps" else "cpu_device (NOT GPU timings)",
                q_heads=hq,
                kv_heads=hkv,
                head_dim=d,
                kv_len=s,
                split_count=plan["split_count"],
                ms=seconds * 1e3,
                kv_gb_per_s=gb_per_s,
                one_share_ms=one_share * 1e3,
                estimated_fraction_of_bandwidth=estimate,
                gpu_family=decode["estimate"]["gpu_family"],
            )
        )
        print(
            f"{hq:>3} {hkv:>3} {d:>4} {s:>6} {plan['split_count']:>7} {seconds * 1e3:>9.3f} {gb_per_s:>8.2f} "
            f"{estimate:>5.2f}  {one_share * 1e3:.3f}"
        )
    write_csv(os.path.join(args.out, f"decode_sweep_{'mps' if device.type == 'mps' else 'cpu_device'}.csv"), rows)


if __name__ == "__main__":
    main()
