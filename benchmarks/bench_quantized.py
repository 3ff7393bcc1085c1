"""Decode over quantized KV caches: bytes read and time for 16-bit, 8-bit and 4-bit K/V.

    python benchmarks/bench_quantized.py [--device cpu|mps] [--quick] [--out benchmarks/results]

One decode step (L = 1, causal over the whole cache) of 32 query heads on 8 kv heads, head dim 128,
float16, against caches of S = 4K, 8K, 16K and 32K keys: unquantized, and quantize_kv'd to 8 and 4
bits in groups of 64, read in place by the decode kernel. Each row reports the plan's bytes read
(explain_plan's min_bytes_read: K/V data, their scales and biases, and q), the median time, the
bandwidth those bytes imply, and the error against float64 attention on the dequantized K/V (the
kernel's own error, not the quantization's: docs/quantization.md has that). On a Mac with MPS the
times are GPU times and the bandwidth is the figure to compare with the chip's; on the CPU Metal
device (elsewhere) they are NOT GPU timings, and --quick (the default there) takes 8 query heads
on 2 kv heads and fewer repeats.
"""

from __future__ import annotations

import argparse
import os

import torch
from _timing import timed, write_csv  # beside this script

from flashattn_mps import explain_plan, flash_attention, quantize_kv


def golden(q, k, v):
    """float64 attention of one query row per head over every key (GQA by repetition)."""
    k, v = (t.double().repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="mps" if torch.backends.mps.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer heads and repeats (the default off a Mac)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    quick = args.quick or device.type != "mps"
    q_heads, kv_heads, head_dim, repeats = (8, 2, 128, 3) if quick else (32, 8, 128, 20)
    where = "mps" if device.type == "mps" else "cpu-metal-device (NOT GPU timings)"
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"decode over quantized KV caches on {where}: Hq {q_heads}, Hkv {kv_heads}, D {head_dim}, float16")
    print(f"{'S':>6} {'bits':>4} {'MB read':>9} {'ms':>9} {'GB/s':>8} {'error':>9}")
    for s in (4096, 8192, 16384, 32768):
        q = torch.randn(1, q_heads, 1, head_dim, generator=gen).half().to(device)
        k = torch.randn(1, kv_heads, s, head_dim, generator=gen).half().to(device)
        v = torch.randn(1, kv_heads, s, head_dim, generator=gen).half().to(device)
        for bits in (16, 8, 4):
            kk, vv = (k, v) if bits == 16 else (quantize_kv(t, bits=bits, group_size=64) for t in (k, v))
            plan = explain_plan(q, kk, vv, causal="bottom_right")
            read = sum(d["cost"]["min_bytes_read"] for d in plan["dispatches"])
            out = flash_attention(q, kk, vv, causal="bottom_right")
            dense = [t if bits == 16 else t.dequantize() for t in (kk, vv)]
            error = (out.double().cpu() - golden(q.cpu(), dense[0].cpu(), dense[1].cpu())).abs().max().item()
            seconds = timed(lambda: flash_attention(q, kk, vv, causal="bottom_right"), device, repeats)
            row = dict(
                device=where,
                kv_len=s,
                bits=bits,
                group_size=0 if bits == 16 else 64,
                q_heads=q_heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                bytes_read=read,
                split_count=plan["split_count"],
                ms=seconds * 1e3,
                gb_per_s=read / seconds / 1e9,
                max_error=error,
            )
            rows.append(row)
            print(
                f"{s:>6} {bits:>4} {read / 1e6:>9.2f} {seconds * 1e3:>9.2f} {read / seconds / 1e9:>8.3f} {error:>9.2e}"
            )
    write_csv(os.path.join(args.out, f"quantized_decode_{'mps' if device.type == 'mps' else 'cpu_device'}.csv"), rows)


if __name__ == "__main__":
    main()
