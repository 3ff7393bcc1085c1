"""What an additive mask costs: causal=True against transformers' float causal mask, a bool causal
mask and a float key-padding mask, forward and forward+backward.

    python benchmarks/bench_mask_blocks.py [--lengths 1024 4096] [--dtype float16] [--repeats 5]

The float masks' -inf blocks are skipped through the block-class pre-pass (docs/kernels.md,
"Additive mask blocks"); the goal is a float causal mask within about 10 % of causal=True at
L >= 4096 on a Mac (its threadgroups still walk the key tiles past the diagonal that the band never
visits). Elsewhere it runs the CPU Metal device on small shapes: relative figures only.
"""

from __future__ import annotations

import argparse

import torch
from _timing import timed  # beside this script

from flashattn_mps import flash_attention, mps_probe

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def masks(length, dtype, device):
    above = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    padding = torch.zeros(2, 1, length, length, dtype=dtype, device=device)
    padding[1, :, :, length // 2 :] = float("-inf")  # the second sequence is half padding
    return {
        "causal=True": None,
        "float causal": torch.zeros(length, length, dtype=dtype, device=device).masked_fill(above, float("-inf")),
        "bool causal": ~above,
        "float padding": padding,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--dtype", choices=DTYPES, default="float16")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    on_mps = mps_probe.usable()
    device = torch.device("mps" if on_mps else "cpu")
    lengths = args.lengths or ([1024, 4096, 8192] if on_mps else [256])
    dtype = DTYPES[args.dtype]
    print(f"device {device}, {args.dtype}, B = 2, H = {args.heads}, D = {args.head_dim}")
    print(f"{'L':>6} {'mask':>14} {'forward ms':>11} {'fwd+bwd ms':>11}")
    for length in lengths:
        q, k, v = (
            torch.randn(2, args.heads, length, args.head_dim, dtype=dtype, device=device, requires_grad=True)
            for _ in range(3)
        )
        for name, mask in masks(length, dtype, device).items():
            call = dict(causal=True) if mask is None else dict(attn_mask=mask)

            def forward(call=call):
                with torch.no_grad():
                    flash_attention(q, k, v, **call)

            def training(call=call):
                flash_attention(q, k, v, **call).sum().backward()

            ms = [1e3 * timed(fn, device, args.repeats) for fn in (forward, training)]
            print(f"{length:>6} {name:>14} {ms[0]:>11.2f} {ms[1]:>11.2f}")


if __name__ == "__main__":
    main()
