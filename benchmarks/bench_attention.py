"""Attention benchmark: flash_attention's kernels against torch SDPA (and MLX's fused SDPA and
mtlattn's SDPA on a Mac, when installed).

    python benchmarks/bench_attention.py [--quick] [--out benchmarks/results] [--fractions]

On a Mac with MPS it sweeps L = 512..32768, D = 64 and 128, causal and not, fp16/bf16/fp32, and
reports ms, TFLOPS and peak memory per implementation (kernel="tensor", the tensor-path prefill, in
the rows it takes: fp16/bf16 where the GPU has Metal 4 tensor operations); then decode (L = 1 against a KV cache of
S = 512..32768, 32 query heads on 4 kv heads, GQA 8), reporting ms and the bandwidth of reading K
and V once (the decode kernel's goal: >= 85 % of the chip's bandwidth); then forward+backward steps
(gradients of q, k and v) against SDPA's autograd and MLX's value_and_grad of its fused SDPA (goal:
>= 65 % of the chip's FP16 peak at L >= 4096). Elsewhere it runs the CPU Metal device on small
shapes: those timings are NOT GPU timings; they show the benchmark works and how the kernels
compare on the CPU device. Writes CSVs and, when matplotlib is installed, a plot.

Every forward and decode row also carries the plan's cost (flashattn_mps.explain_plan, summed over
its dispatches): useful_flops (SDPA's 2 (E + Ev) per visible pair) and min_bytes (each input element
read once, the outputs written) for every implementation, so useful_tflops and min_gb_per_s compare
them on the same work; for this project's kernels also kernel_flops (issued, padding included) with
issued_tflops, threadgroup_bytes and registers (per thread) of the largest dispatch.

--fractions then turns the run's timings into fractions of the chip's peak and bandwidth beside
explain_plan's estimate for the chip's GPU family (benchmarks/peak_fractions.py, which also runs on
saved CSVs).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from _timing import sync, timed, write_csv  # beside this script

from flashattn_mps import explain_plan, flash_attention, mps_probe

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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


KERNEL_OF = {
    "flash_attention": "forward",
    "simple_kernel": "simple",
    "tensor_kernel": "tensor",
}  # decode rows: "decode"


def cost_columns(q, k, v, causal, kernel, seconds):
    """The plan's cost for a row (see the module docstring); kernel None: another implementation,
    measured against the work of this project's default plan."""
    dispatches = explain_plan(q, k, v, causal, kernel=kernel or "auto")["dispatches"]
    costs = [d["cost"] for d in dispatches]
    useful = sum(c["useful_flops"] for c in costs)
    moved = costs[0]["min_bytes_read"] + costs[-1]["min_bytes_written"]  # inputs and outputs, once each
    ours = kernel is not None
    issued = sum(c["flops"] for c in costs)
    return dict(
        useful_flops=useful,
        min_bytes=moved,
        useful_tflops=useful / seconds / 1e12,
        min_gb_per_s=moved / seconds / 1e9,
        kernel_flops=issued if ours else "",
        issued_tflops=issued / seconds / 1e12 if ours else "",
        threadgroup_bytes=max(c["threadgroup_bytes"] for c in costs) if ours else "",
        registers=max(c["registers"] for c in costs) if ours else "",
    )


def tensor_kernel(q, k, v, c):
    """The tensor-path prefill (Metal 4 tensor operations), where the device has them and the call
    is one it takes (fp16/bf16, D <= 128); None otherwise."""
    try:
        explain_plan(q, k, v, c, kernel="tensor")
    except ValueError:
        return None
    return lambda: flash_attention(q, k, v, causal=c, kernel="tensor")


def implementations(device):
    """name -> make(q, k, v, causal) returning the call to time (inputs prepared outside it), or None
    where the implementation does not take the row."""
    impls = {
        "flash_attention": lambda q, k, v, c: lambda: flash_attention(q, k, v, causal=c, kernel="forward"),
        "tensor_kernel": tensor_kernel,
        "simple_kernel": lambda q, k, v, c: lambda: flash_attention(q, k, v, causal=c, kernel="simple"),
        "torch_sdpa": lambda q, k, v, c: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c),
    }
    mlx_sdpa = mlx_implementation(device)
    if mlx_sdpa is not None:
        impls["mlx_fused_sdpa"] = mlx_sdpa
    mtlattn_sdpa = mtlattn_implementation(device)
    if mtlattn_sdpa is not None:
        impls["mtlattn_sdpa"] = mtlattn_sdpa
    return impls


def mtlattn_implementation(device):
    """mtlattn's SDPA drop-in (MPS only; its M5 path runs on Metal 4 tensor operations), when the
    package is installed."""
    if device.type != "mps":
        return None
    try:
        import mtlattn
    except ImportError:
        return None
    sdpa = getattr(mtlattn, "scaled_dot_product_attention", None)
    if sdpa is None:
        print("mtlattn has no scaled_dot_product_attention: not timed")
        return None
    return lambda q, k, v, c: lambda: sdpa(q, k, v, is_causal=c)


def mlx_implementation(device):
    """MLX's fused SDPA as make(q, k, v, causal) (GQA included), or None without MPS or MLX."""
    if device.type != "mps":
        return None
    try:
        import mlx.core as mx
    except ImportError:
        return None
    mlx_dtypes = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}

    def mlx_sdpa(q, k, v, c):
        a = [mx.array(t.cpu().float().numpy()).astype(mlx_dtypes[t.dtype]) for t in (q, k, v)]
        mx.eval(*a)
        scale = q.shape[-1] ** -0.5
        return lambda: mx.eval(mx.fast.scaled_dot_product_attention(*a, scale=scale, mask="causal" if c else None))

    return mlx_sdpa


def decode_implementations(device):
    """name -> make(q, k, v) for one decode step (L = 1, GQA, no mask)."""
    impls = {
        "flash_attention": lambda q, k, v: lambda: flash_attention(q, k, v, kernel="decode"),
        "torch_sdpa": lambda q, k, v: lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    mlx_sdpa = mlx_implementation(device)
    if mlx_sdpa is not None:
        impls["mlx_fused_sdpa"] = lambda q, k, v: mlx_sdpa(q, k, v, False)
    return impls


def decode_sweep(quick: bool, device):
    """(batch, q heads, kv heads, kv length, head dim, dtype) of L = 1 decode steps, GQA 8."""
    if device.type == "mps":
        lengths = [1024, 4096, 16384] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
        return [(1, 32, 4, s, d, "float16") for s in lengths for d in (64, 128)]
    lengths = [512, 4096] if quick else [512, 4096, 16384]
    return [(1, 8, 1, s, 64, "float16") for s in lengths]


def run_decode(quick: bool, device, where: str, repeats: int):
    rows = []
    print("\ndecode, L = 1: K and V read once at the bandwidth shown")
    print(f"{'impl':>16} {'B':>2} {'Hq':>3} {'Hkv':>3} {'S':>6} {'D':>4} {'dtype':>9} {'ms':>10} {'GB/s':>8}")
    for b, hq, hkv, s, d, dtype_name in decode_sweep(quick, device):
        gen = torch.Generator().manual_seed(0)
        dtype = DTYPES[dtype_name]
        q = torch.randn(b, hq, 1, d, generator=gen).to(device, dtype)
        k, v = (torch.randn(b, hkv, s, d, generator=gen).to(device, dtype) for _ in range(2))
        kv_bytes = k.nbytes + v.nbytes
        for name, make in decode_implementations(device).items():
            seconds = timed(make(q, k, v), device, repeats)
            row = dict(
                device=where,
                impl=name,
                batch=b,
                q_heads=hq,
                kv_heads=hkv,
                kv_len=s,
                head_dim=d,
                dtype=dtype_name,
                ms=seconds * 1e3,
                kv_gb_per_s=kv_bytes / seconds / 1e9,
                **cost_columns(q, k, v, False, "decode" if name == "flash_attention" else None, seconds),
            )
            rows.append(row)
            print(
                f"{name:>16} {b:>2} {hq:>3} {hkv:>3} {s:>6} {d:>4} {dtype_name:>9} {row['ms']:>10.3f} "
                f"{row['kv_gb_per_s']:>8.2f}"
            )
    return rows


def training_implementations(device):
    """name -> make(q, k, v, dout, causal) returning one forward+backward step (gradients of q, k, v)."""

    def torch_step(attention):
        def make(q, k, v, dout, c):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def step():
                for t in leaves:
                    t.grad = None
                attention(*leaves, c).backward(dout)

            return step

        return make

    impls = {
        "flash_attention": torch_step(lambda q, k, v, c: flash_attention(q, k, v, causal=c)),
        "torch_sdpa": torch_step(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)),
    }
    mtlattn_sdpa = mtlattn_implementation(device)  # its backward runs on MPP too
    if mtlattn_sdpa is not None:
        impls["mtlattn_sdpa"] = torch_step(lambda q, k, v, c: mtlattn_sdpa(q, k, v, c)())
    if device.type == "mps":
        try:
            import mlx.core as mx
        except ImportError:
            return impls
        mlx_dtypes = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}

        def mlx_value_and_grad(q, k, v, dout, c):
            a = [mx.array(t.cpu().float().numpy()).astype(mlx_dtypes[t.dtype]) for t in (q, k, v, dout)]
            mx.eval(*a)
            scale = q.shape[-1] ** -0.5

            def loss(q, k, v):
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if c else None)
                return (out * a[3]).sum()

            step = mx.value_and_grad(loss, argnums=(0, 1, 2))
            return lambda: mx.eval(step(*a[:3]))

        impls["mlx_value_and_grad"] = mlx_value_and_grad
    return impls


def training_sweep(quick: bool, device):
    """(batch, heads, length, head dim, causal, dtype) of forward+backward steps."""
    if device.type == "mps":
        lengths = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
        return [(1, 16, n, d, c, "float16") for n in lengths for d in (64, 128) for c in (False, True)]
    lengths = [128] if quick else [128, 256]
    return [(1, 4, n, 64, c, "float16") for n in lengths for c in (False, True)]


def run_training(quick: bool, device, where: str, repeats: int):
    rows = []
    print("\nforward+backward: TFLOPS counted as 3.5x the forward's FLOPs (FlashAttention-2's convention)")
    print(
        f"{'impl':>18} {'B':>2} {'H':>3} {'L':>6} {'D':>4} {'causal':>6} {'dtype':>9} {'ms':>10} {'TFLOPS':>8} {'peak MiB':>9}"
    )
    for b, h, n, d, causal, dtype_name in training_sweep(quick, device):
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(b, h, n, d, generator=gen).to(device, DTYPES[dtype_name]) for _ in range(4))
        flops = 3.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        for name, make in training_implementations(device).items():
            step = make(q, k, v, dout, causal)
            seconds = timed(step, device, repeats)
            row = dict(
                device=where,
                impl=name,
                batch=b,
                heads=h,
                seq=n,
                head_dim=d,
                causal=causal,
                dtype=dtype_name,
                ms=seconds * 1e3,
                tflops=flops / seconds / 1e12,
                peak_mib=peak_memory(step, device) / 2**20,
            )
            rows.append(row)
            print(
                f"{name:>18} {b:>2} {h:>3} {n:>6} {d:>4} {str(causal):>6} {dtype_name:>9} "
                f"{row['ms']:>10.2f} {row['tflops']:>8.4f} {row['peak_mib']:>9.1f}"
            )
    return rows


def sweep(quick: bool, device):
    if device.type == "mps":
        lengths = [512, 1024, 2048, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
        return [
            (1, 16, n, d, c, dt)
            for n in lengths
            for d in (64, 128)
            for c in (False, True)
            for dt in (("float16",) if quick else DTYPES)
        ]
    lengths = [128, 256] if quick else [128, 256, 512]
    return [(1, 4, n, d, c, "float16") for n in lengths for d in (64, 128) for c in (False, True)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--fractions", action="store_true", help="then benchmarks/peak_fractions.py on the results")
    args = parser.parse_args(argv)
    device = torch.device("mps" if mps_probe.usable() else "cpu")
    where = "MPS" if device.type == "mps" else "cpu-metal-device (NOT GPU timings)"
    repeats = 5 if device.type == "mps" else 2
    rows = []
    print(f"device: {where}")
    print(
        f"{'impl':>16} {'B':>2} {'H':>3} {'L':>6} {'D':>4} {'causal':>6} {'dtype':>9} {'ms':>10} {'TFLOPS':>8} {'peak MiB':>9}"
    )
    for b, h, n, d, causal, dtype_name in sweep(args.quick, device):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, DTYPES[dtype_name]) for _ in range(3))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        for name, make in implementations(device).items():
            call = make(q, k, v, causal)
            if call is None:
                continue
            seconds = timed(call, device, repeats)
            peak = peak_memory(call, device)
            row = dict(
                device=where,
                impl=name,
                batch=b,
                heads=h,
                seq=n,
                head_dim=d,
                causal=causal,
                dtype=dtype_name,
                ms=seconds * 1e3,
                tflops=flops / seconds / 1e12,
                peak_mib=peak / 2**20,
                **cost_columns(q, k, v, causal, KERNEL_OF.get(name), seconds),
            )
            rows.append(row)
            print(
                f"{name:>16} {b:>2} {h:>3} {n:>6} {d:>4} {str(causal):>6} {dtype_name:>9} "
                f"{row['ms']:>10.2f} {row['tflops']:>8.4f} {row['peak_mib']:>9.1f}"
            )
    decode_rows = run_decode(args.quick, device, where, repeats)
    training_rows = run_training(args.quick, device, where, repeats)
    os.makedirs(args.out, exist_ok=True)
    tag = "mps" if device.type == "mps" else "cpu_device"
    write_csv(os.path.join(args.out, f"attention_{tag}.csv"), rows)
    write_csv(os.path.join(args.out, f"decode_{tag}.csv"), decode_rows)
    write_csv(os.path.join(args.out, f"training_{tag}.csv"), training_rows)
    plot(rows, os.path.join(args.out, f"attention_{tag}.png"), where)
    if args.fractions:
        import peak_fractions  # beside this script

        peak_fractions.main(["--results", args.out, "--tag", tag] + ([] if device.type == "mps" else ["--chip", "M1"]))


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
                pts = [
                    (r["seq"], r["tflops"])
                    for r in rows
                    if r["impl"] == impl
                    and r["head_dim"] == d
                    and r["causal"] == causal
                    and r["dtype"] == rows[0]["dtype"]
                ]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=f"{impl} D={d}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # the implementations differ by orders of magnitude on the CPU device
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
