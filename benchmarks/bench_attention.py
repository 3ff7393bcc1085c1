"""Attention benchmark: flash_attention's kernels against torch SDPA (and MLX's fused SDPA on a Mac).

    python benchmarks/bench_attention.py [--quick] [--out benchmarks/results]

On a Mac with MPS it sweeps L = 512..32768, D = 64 and 128, causal and not, fp16/bf16/fp32, and
reports ms, TFLOPS and peak memory per implementation. Elsewhere it runs the CPU Metal device on
small shapes: those timings are NOT GPU timings; they show the benchmark works and how the kernels
compare on the CPU device. Writes a CSV and, when matplotlib is installed, a plot.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch
import torch.nn.functional as F

from flashattn_mps import flash_attention

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def sync(device):
    if device.type == "mps":
        torch.mps.synchronize()


def timed(fn, device, repeats):
    fn()  # warm-up: compiles / loads the kernel
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def peak_memory(fn, device):
    """Bytes allocated at the peak of one call (MPS: driver memory delta; CPU: not measured)."""
    if device.type != "mps":
        return float("nan")
    sync(device)
    torch.mps.empty_cache()
    before = torch.mps.driver_allocated_memory()
    fn()
    sync(device)
    return torch.mps.driver_allocated_memory() - before


def implementations(device):
    """name -> make(q, k, v, causal) returning the call to time (inputs prepared outside it)."""
    impls = {
        "flash_attention": lambda q, k, v, c: lambda: flash_attention(q, k, v, causal=c, kernel="forward"),
        "simple_kernel": lambda q, k, v, c: lambda: flash_attention(q, k, v, causal=c, kernel="simple"),
        "torch_sdpa": lambda q, k, v, c: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c),
    }
    if device.type == "mps":
        try:
            import mlx.core as mx
        except ImportError:
            return impls
        mlx_dtypes = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}

        def mlx_sdpa(q, k, v, c):
            a = [mx.array(t.cpu().float().numpy()).astype(mlx_dtypes[t.dtype]) for t in (q, k, v)]
            mx.eval(*a)
            scale = q.shape[-1] ** -0.5
            return lambda: mx.eval(mx.fast.scaled_dot_product_attention(*a, scale=scale, mask="causal" if c else None))

        impls["mlx_fused_sdpa"] = mlx_sdpa
    return impls


def sweep(quick: bool, device):
    if device.type == "mps":
        lengths = [512, 1024, 2048, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
        return [(1, 16, n, d, c, dt) for n in lengths for d in (64, 128) for c in (False, True)
                for dt in (("float16",) if quick else DTYPES)]
    lengths = [128, 256] if quick else [128, 256, 512]
    return [(1, 4, n, d, c, "float16") for n in lengths for d in (64, 128) for c in (False, True)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    where = "MPS" if device.type == "mps" else "cpu-metal-device (NOT GPU timings)"
    repeats = 5 if device.type == "mps" else 2
    rows = []
    print(f"device: {where}")
    print(f"{'impl':>16} {'B':>2} {'H':>3} {'L':>6} {'D':>4} {'causal':>6} {'dtype':>9} {'ms':>10} {'TFLOPS':>8} {'peak MiB':>9}")
    for b, h, n, d, causal, dtype_name in sweep(args.quick, device):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, DTYPES[dtype_name]) for _ in range(3))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        for name, make in implementations(device).items():
            call = make(q, k, v, causal)
            seconds = timed(call, device, repeats)
            peak = peak_memory(call, device)
            row = dict(device=where, impl=name, batch=b, heads=h, seq=n, head_dim=d, causal=causal,
                       dtype=dtype_name, ms=seconds * 1e3, tflops=flops / seconds / 1e12, peak_mib=peak / 2**20)
            rows.append(row)
            print(f"{name:>16} {b:>2} {h:>3} {n:>6} {d:>4} {str(causal):>6} {dtype_name:>9} "
                  f"{row['ms']:>10.2f} {row['tflops']:>8.4f} {row['peak_mib']:>9.1f}")
    os.makedirs(args.out, exist_ok=True)
    tag = "mps" if device.type == "mps" else "cpu_device"
    path = os.path.join(args.out, f"attention_{tag}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    plot(rows, os.path.join(args.out, f"attention_{tag}.png"), where)


def plot(rows, path, where):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        for impl in sorted({r["impl"] for r in rows}):
            for d in sorted({r["head_dim"] for r in rows}):
                pts = [(r["seq"], r["tflops"]) for r in rows if r["impl"] == impl and r["head_dim"] == d
                       and r["causal"] == causal and r["dtype"] == rows[0]["dtype"]]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=f"{impl} D={d}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(f"causal={causal}")
    axes[0].set_ylabel("TFLOPS")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"attention forward on {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
