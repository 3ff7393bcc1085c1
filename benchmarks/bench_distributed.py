"""Context parallelism across Macs: communication against compute, estimated for 2-4 Macs at 128k
tokens, and measured on loopback here.

    python benchmarks/bench_distributed.py [--tokens 131072] [--tflops 10] [--skip-measure]

Estimate (printed, and written to benchmarks/results/distributed_estimate.csv), per attention
layer, forward + backward, for each method and group size P in 2..4. Assumptions, all options:
- the layer: Llama-3-8B's attention (Hq 32, Hkv 8, head dim 128), batch 1, bfloat16 tensors,
  causal, `--tokens` tokens in total;
- each Mac's GPU sustains `--tflops` TFLOP/s in the attention kernels (default 10: about two
  thirds of an M3 Max's half-precision peak; measure yours with benchmarks/bench_attention.py);
- links carry 1.1 GB/s per direction (10 GbE after TCP) or 3 GB/s (Thunderbolt IP bridge, as
  commonly measured with iperf3 between two Macs); collectives run as rings, so every rank sends
  and receives the same number of bytes per step;
- FLOPs: forward 4 * S^2 * Hq * E / 2 (causal), backward 2.5 x forward, split evenly over P
  (zigzag balances the causal work);
- bytes per rank, as this implementation moves them: allgather gathers K and V twice (forward,
  backward) and reduce-scatters float32 dK, dV of the whole sequence; ring moves K, V (P - 1 steps)
  twice and float32 dK, dV (P steps); ulysses all-to-alls q, k, v, out and lse forward, and
  q, k, v, out, lse, dout, dq, dk, dv backward, (P - 1) / P of each local tensor.
- ring overlaps each step's transfer with its compute: its time is the sum over steps of the
  larger of the two; allgather and ulysses wait for their transfers.

Measurement (written to benchmarks/results/distributed_loopback.csv): 2 gloo processes on this
machine's loopback: the collectives' bandwidth, and each method's forward + backward at a small
shape (1024 tokens, Hq 4, Hkv 2, E 64, float32, causal) on CPU tensors (the CPU Metal device)
against one process over the whole sequence. Loopback
has no wire: the figures show the overheads of the implementation (copies, Python, gloo), not a
network.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LINKS = {"10GbE": 1.1e9, "Thunderbolt-IP": 3.0e9}
HQ, HKV, E, HALF, FLOAT = 32, 8, 128, 2, 4


def estimate(tokens: int, tflops: float) -> list:
    rows = []
    forward_flops = 4 * tokens * tokens * HQ * E / 2
    kv_bytes = tokens * HKV * E * HALF * 2  # K and V of the whole sequence
    q_bytes = tokens * HQ * E * HALF
    for size in (2, 3, 4):
        share = (size - 1) / size
        compute = forward_flops * 3.5 / size / (tflops * 1e12)
        sent = {
            "allgather": 2 * share * kv_bytes + share * kv_bytes * FLOAT / HALF,
            "ring": 2 * share * kv_bytes + kv_bytes * FLOAT / HALF,
            # forward: q, k, v, out (+ lse); backward: q, k, v, out, dout, dq, dk, dv (+ lse)
            "ulysses": share / size * (q_bytes * 6 + kv_bytes * 3),
        }
        for link, bandwidth in LINKS.items():
            for method, nbytes in sent.items():
                transfer = nbytes / bandwidth
                if method == "ring":
                    total = size * max(compute / size, transfer / size)
                else:
                    total = compute + transfer
                rows.append(
                    dict(
                        macs=size,
                        link=link,
                        method=method,
                        compute_s=round(compute, 3),
                        bytes_per_rank_GB=round(nbytes / 1e9, 3),
                        transfer_s=round(transfer, 3),
                        layer_s=round(total, 3),
                        compute_share=round(compute / total, 2),
                    )
                )
    return rows


SHAPE = dict(tokens=1024, hq=4, hkv=2, e=64)


def _inputs() -> list:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(1, h, SHAPE["tokens"], SHAPE["e"], generator=gen) for h in (SHAPE["hq"], SHAPE["hkv"], SHAPE["hkv"])
    ]


def _one_process() -> dict:
    import flashattn_mps as fa

    leaves = [t.requires_grad_() for t in _inputs()]
    fa.flash_attention(*leaves, causal=True).sum().backward()  # compiles the kernels
    start = time.perf_counter()
    fa.flash_attention(*leaves, causal=True).sum().backward()
    return dict(what=f"one process, {SHAPE['tokens']} tokens, fwd+bwd", seconds=round(time.perf_counter() - start, 3))


def _measure(rank: int, size: int, store: str, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=900)
    )
    from flashattn_mps import distributed as fad

    results = []
    for megabytes in (8, 64):
        t = torch.zeros(megabytes * 2**20 // 4)
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t)
        start = time.perf_counter()
        for _ in range(3):
            dist.all_gather(parts, t)
        elapsed = (time.perf_counter() - start) / 3
        results.append(
            dict(
                what=f"all_gather {megabytes} MB/rank",
                seconds=round(elapsed, 4),
                GB_per_s=round(megabytes * 2**20 * (size - 1) / elapsed / 1e9, 2),
            )
        )
    q, k, v = _inputs()
    local = [fad.shard(t, 2) for t in (q, k, v)]
    dist.barrier()
    for method in ("allgather", "ring", "ulysses"):
        leaves = [t.clone().requires_grad_() for t in local]
        fad.attention(*leaves, causal=True, method=method).sum().backward()  # compile, warm
        dist.barrier()
        start = time.perf_counter()
        fad.attention(*leaves, causal=True, method=method).sum().backward()
        dist.barrier()
        results.append(
            dict(
                what=f"{method}, {size} ranks, {SHAPE['tokens']} tokens, fwd+bwd",
                seconds=round(time.perf_counter() - start, 3),
            )
        )
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure() -> list:
    single = _one_process()
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        processes = [context.Process(target=_measure, args=(r, 2, store, queue)) for r in range(2)]
        for p in processes:
            p.start()
        results = queue.get(timeout=1800)
        for p in processes:
            p.join()
    return [single, *results]


def write(name: str, rows: list) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--tflops", type=float, default=10.0)
    parser.add_argument("--skip-measure", action="store_true")
    args = parser.parse_args()
    rows = estimate(args.tokens, args.tflops)
    print(f"Estimate per attention layer, forward + backward, {args.tokens} tokens, {args.tflops} TFLOP/s per Mac:")
    for row in rows:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    write("distributed_estimate.csv", rows)
    if args.skip_measure:
        return
    results = measure()
    print("Loopback, 2 gloo processes on this machine (CPU tensors, the CPU Metal device):")
    for row in results:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    write(
        "distributed_loopback.csv",
        [dict(what=r["what"], seconds=r["seconds"], GB_per_s=r.get("GB_per_s", "")) for r in results],
    )


if __name__ == "__main__":
    main()
