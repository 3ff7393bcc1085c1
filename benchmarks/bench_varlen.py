"""Packed sequences and KV-cache decoding against what one would do without them.

  varlen:  flash_attn_varlen_func over a mix of lengths vs flash_attn_func on the same sequences
           padded to the longest (the padded rows and keys cost work; only the timing is compared).
  paged:   flash_attn_varlen_func(block_table=...) over the same mix with its keys in shuffled
           pages vs the same call on the packed keys, both in the prefill kernel: what reading
           each key row through the block table costs (pages that divide the key tiles and pages
           that straddle them).
  kvcache: flash_attn_with_kvcache appending one token per step to a preallocated cache vs the
           current decode path (flash_attn_func on the cache sliced to each row's length, one call
           per batch row since the lengths differ).

    python benchmarks/bench_varlen.py [--device cpu|mps] [--repeat N]

Writes benchmarks/results/varlen_<device>.csv and prints a table (median milliseconds). On the CPU
Metal device the figures measure the kernels' work, not a GPU; the Mac rows come from running it there.
Not a timed test.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

import flashattn_mps
from flashattn_mps import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, mps_probe

# (name, sequence lengths, heads, kv heads, head dim)
VARLEN_CASES = [("mixed", [200, 13, 64, 7, 128], 4, 2, 64), ("one long", [256, 8, 8, 8], 4, 4, 64)]
# (name, sequence lengths, heads, kv heads, head dim, page size)
PAGED_CASES = [
    ("mixed, pages of 64", [200, 13, 64, 7, 128], 4, 2, 64, 64),
    ("mixed, pages of 3", [200, 13, 64, 7, 128], 4, 2, 64, 3),
]
# (name, batch, cache lengths, heads, kv heads, head dim)
DECODE_CASES = [("decode", 4, [300, 40, 700, 120], 8, 2, 64)]


def timed(fn, device, repeat):
    fn()  # compile and warm up
    samples = []
    for _ in range(repeat):
        if device == "mps":
            torch.mps.synchronize()
        start = time.perf_counter()
        fn()
        if device == "mps":
            torch.mps.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def varlen_rows(device, repeat):
    rows = []
    for name, lengths, hq, hkv, d in VARLEN_CASES:
        total, longest = sum(lengths), max(lengths)
        q, k, v = (torch.randn(total, h, d, device=device, dtype=torch.float16) for h in (hq, hkv, hkv))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
        padded = [torch.zeros(len(lengths), longest, h, d, device=device, dtype=torch.float16) for h in (hq, hkv, hkv)]
        for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
            for t, src in zip(padded, (q, k, v)):
                t[b, :n] = src[start : start + n]
        varlen = timed(lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True), device, repeat)
        pad = timed(lambda: flash_attn_func(*padded, causal=True), device, repeat)
        rows.append(dict(case=f"varlen {name}", ours_ms=varlen, baseline="padded to the longest", baseline_ms=pad))
    return rows


def paged_rows(device, repeat):
    rows = []
    generator = torch.Generator().manual_seed(0)
    for name, lengths, hq, hkv, d, page in PAGED_CASES:
        total, longest = sum(lengths), max(lengths)
        q, k, v = (torch.randn(total, h, d, device=device, dtype=torch.float16) for h in (hq, hkv, hkv))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
        columns = -(-longest // page)
        table = torch.randperm(len(lengths) * columns, generator=generator).reshape(len(lengths), columns)
        pools = [torch.zeros(len(lengths) * columns, page, hkv, d, device=device, dtype=torch.float16) for _ in "kv"]
        for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
            positions = torch.arange(n)
            for pool, src in zip(pools, (k, v)):
                pool[table[b][positions // page].to(device), (positions % page).to(device)] = src[start : start + n]
        table = table.to(torch.int32).to(device)
        paged = timed(
            lambda: flash_attn_varlen_func(q, *pools, cu, cu, longest, longest, causal=True, block_table=table),
            device,
            repeat,
        )
        packed = timed(lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True), device, repeat)
        rows.append(dict(case=f"paged {name}", ours_ms=paged, baseline="packed keys, same kernel", baseline_ms=packed))
    return rows


def decode_rows(device, repeat):
    rows = []
    for name, batch, lengths, hq, hkv, d in DECODE_CASES:
        capacity = max(lengths) + 8
        k_cache = torch.randn(batch, capacity, hkv, d, device=device, dtype=torch.float16)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch, 1, hq, d, device=device, dtype=torch.float16)
        new_k, new_v = (torch.randn(batch, 1, hkv, d, device=device, dtype=torch.float16) for _ in range(2))
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        cached = timed(
            lambda: flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=seqlens, causal=True),
            device,
            repeat,
        )
        sliced = timed(
            lambda: [
                flash_attn_func(q[b : b + 1], k_cache[b : b + 1, : n + 1], v_cache[b : b + 1, : n + 1], causal=True)
                for b, n in enumerate(lengths)
            ],
            device,
            repeat,
        )
        rows.append(
            dict(case=f"kvcache {name}", ours_ms=cached, baseline="flash_attn_func per row", baseline_ms=sliced)
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="mps" if mps_probe.usable() else "cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = (
        varlen_rows(args.device, args.repeat)
        + paged_rows(args.device, args.repeat)
        + decode_rows(args.device, args.repeat)
    )
    out = (
        Path(__file__).resolve().parent
        / "results"
        / f"varlen_{'cpu_device' if args.device == 'cpu' else args.device}.csv"
    )
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "ours_ms", "baseline", "baseline_ms"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"{'case':<30}{'ours ms':>10}  {'baseline':<26}{'baseline ms':>12}")
    for r in rows:
        print(f"{r['case']:<30}{r['ours_ms']:>10.2f}  {r['baseline']:<26}{r['baseline_ms']:>12.2f}")
    print(f"wrote {out} (flashattn_mps {flashattn_mps.__version__}, {args.device})")


if __name__ == "__main__":
    main()
