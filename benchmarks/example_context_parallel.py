"""Context-parallel attention across processes or Macs, under torchrun:

    torchrun --nproc-per-node=2 benchmarks/example_context_parallel.py            # one machine
    # two Macs (docs/distributed.md): the same script on each, --node-rank 0 and 1

Every rank draws the same full q, k, v (seeded), keeps its shard, runs forward and backward with
each method, and rank 0 prints the time and the largest difference from one process computing the
whole sequence. MPS tensors when the machine has MPS, else CPU tensors (the CPU Metal device).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import flashattn_mps as fa
from flashattn_mps import distributed as fad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    device = "mps" if torch.backends.mps.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = (args.heads, args.kv_heads, args.kv_heads)
    full = [torch.randn(1, h, args.tokens, args.head_dim, generator=gen).to(device, dtype) for h in shapes]
    whole = fa.flash_attention(*full, causal=True)
    for method in ("allgather", "ring", "ulysses"):
        if method == "ulysses" and (args.heads % dist.get_world_size() or args.kv_heads % dist.get_world_size()):
            continue
        local = [fad.shard(t, 2).requires_grad_() for t in full]
        fad.attention(*local, causal=True, method=method).sum().backward()  # compiles the kernels
        dist.barrier()
        start = time.perf_counter()
        out = fad.attention(*local, causal=True, method=method)
        out.sum().backward()
        dist.barrier()
        elapsed = time.perf_counter() - start
        difference = (out.detach().float() - fad.shard(whole, 2).float()).abs().max().item()
        if dist.get_rank() == 0:
            print(
                f"{method}: {dist.get_world_size()} ranks, {args.tokens} tokens on {device}: forward + backward "
                f"{elapsed:.3f} s, max |out - one process| {difference:.2e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
