"""Turn bench_attention.py's timings into fractions of the chip's peak and bandwidth, per generation.

    python benchmarks/peak_fractions.py [--results benchmarks/results] [--tag mps] [--chip "M1 Max"]
                                   [--gpu-cores N] [--peak-tflops T] [--bandwidth-gbs B]
    python benchmarks/bench_attention.py --fractions      # the same right after a run

Reads attention_<tag>.csv, training_<tag>.csv and decode_<tag>.csv and writes fractions_<tag>.csv
(and fractions_<tag>.png when matplotlib is installed): for every row, of every implementation
(this project's kernels, torch's SDPA, MLX's fused SDPA when it was installed), the measured
fraction of the chip's FP16 simdgroup-matrix peak (forward: SDPA's useful FLOPs; training: the
3.5x-forward convention of the training CSV) or of its DRAM bandwidth (decode: K and V read once),
beside what explain_plan estimates for this project's kernels on the chip's GPU family
(fraction_of_peak of the forward dispatch; for a training step the useful FLOPs over the sum of
each dispatch's issued FLOPs at its occupancy; for decode the decode dispatch's
fraction_of_bandwidth, reading against issuing), so a Mac's
measurement and the plan's model sit in one table.

The chip is read from macOS (sysctl machdep.cpu.brand_string, system_profiler's GPU core count)
unless --chip names it. CHIPS below holds each chip's family, GPU clock and bandwidth as public
figures (metal-benchmarks for the clocks of M1 and M2, Apple's specifications for the bandwidths;
the M3, M4 and M5 clocks are approximate): peak = cores x 256 FLOPs per clock (128 FP16/FP32 FMA
lanes per core) x clock. --peak-tflops and --bandwidth-gbs override them with a chip's own figures.
Off a Mac the CSVs are the CPU device's, which are NOT GPU timings: the fractions then only show the
tool works (pass --chip to choose the generation to compare against).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess

import torch

from flashattn_mps import explain_plan

# chip: (GPU family, GPU clock in GHz, DRAM bandwidth in GB/s, GPU cores of the base configuration)
CHIPS = {
    "M1": ("apple7", 1.278, 68.25, 8),
    "M1 Pro": ("apple7", 1.296, 200.0, 16),
    "M1 Max": ("apple7", 1.296, 400.0, 32),
    "M1 Ultra": ("apple7", 1.296, 800.0, 64),
    "M2": ("apple8", 1.398, 100.0, 10),
    "M2 Pro": ("apple8", 1.398, 200.0, 19),
    "M2 Max": ("apple8", 1.398, 400.0, 38),
    "M2 Ultra": ("apple8", 1.398, 800.0, 76),
    "M3": ("apple9", 1.38, 100.0, 10),
    "M3 Pro": ("apple9", 1.38, 150.0, 18),
    "M3 Max": ("apple9", 1.38, 400.0, 40),
    "M3 Ultra": ("apple9", 1.38, 819.0, 80),
    "M4": ("apple9", 1.58, 120.0, 10),
    "M4 Pro": ("apple9", 1.58, 273.0, 20),
    "M4 Max": ("apple9", 1.58, 546.0, 40),
    "M5": ("apple10", 1.58, 153.0, 10),
}
FLOPS_PER_CORE_CLOCK = 256.0
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def detect_chip() -> tuple:
    """(chip name, GPU cores) of this Mac; (None, None) elsewhere."""
    if platform.system() != "Darwin":
        return None, None
    brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout
    name = brand.strip().removeprefix("Apple ").strip()
    cores = None
    gpu = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True, text=True).stdout
    for line in gpu.splitlines():
        if "Total Number of Cores" in line:
            cores = int(line.split(":")[1])
    return name, cores


def chip_figures(chip, cores, peak_tflops, bandwidth_gbs) -> dict:
    if chip not in CHIPS:
        raise SystemExit(f"unknown chip {chip!r}: pass --chip one of {', '.join(CHIPS)}")
    family, clock, bandwidth, base_cores = CHIPS[chip]
    cores = cores or base_cores
    return dict(
        chip=chip,
        family=family,
        gpu_cores=cores,
        peak_tflops=peak_tflops or cores * FLOPS_PER_CORE_CLOCK * clock / 1e3,
        bandwidth_gbs=bandwidth_gbs or bandwidth,
    )


def read_csv(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def empty(shape, dtype):
    return torch.empty(*shape, dtype=DTYPES[dtype])  # planning reads shapes only


def forward_estimate(row, family):
    q = empty((int(row["batch"]), int(row["heads"]), int(row["seq"]), int(row["head_dim"])), row["dtype"])
    [d] = explain_plan(q, q, q, row["causal"] == "True", kernel="forward", gpu=family)["dispatches"]
    return d["estimate"]["fraction_of_peak"]


def training_estimate(row, family):
    q = empty((int(row["batch"]), int(row["heads"]), int(row["seq"]), int(row["head_dim"])), row["dtype"])
    causal = row["causal"] == "True"
    dispatches = explain_plan(q, q, q, causal, gpu=family)["dispatches"]
    dispatches += explain_plan(q, q, q, causal, gpu=family, backward=True)["dispatches"]
    useful = sum(d["cost"]["useful_flops"] for d in dispatches)
    at_occupancy = sum(d["cost"]["flops"] / d["estimate"]["occupancy"] for d in dispatches if d["cost"]["flops"])
    return useful / at_occupancy


def decode_estimate(row, family):
    b, hq, hkv = int(row["batch"]), int(row["q_heads"]), int(row["kv_heads"])
    q = empty((b, hq, 1, int(row["head_dim"])), row["dtype"])
    kv = empty((b, hkv, int(row["kv_len"]), int(row["head_dim"])), row["dtype"])
    return explain_plan(q, kv, kv, gpu=family)["dispatches"][0]["estimate"]["fraction_of_bandwidth"]


def fractions(results: str, tag: str, chip: dict) -> list:
    rows = []
    for kind, measured, estimate in (
        ("forward", lambda r: float(r["useful_tflops"]) / chip["peak_tflops"], forward_estimate),
        ("training", lambda r: float(r["tflops"]) / chip["peak_tflops"], training_estimate),
        ("decode", lambda r: float(r["kv_gb_per_s"]) / chip["bandwidth_gbs"], decode_estimate),
    ):
        name = {"forward": "attention", "training": "training", "decode": "decode"}[kind]
        for r in read_csv(os.path.join(results, f"{name}_{tag}.csv")):
            ours = r["impl"] == "flash_attention"
            rows.append(
                dict(
                    kind=kind,
                    impl=r["impl"],
                    device=r["device"],
                    chip=chip["chip"],
                    gpu_family=chip["family"],
                    dtype=r["dtype"],
                    head_dim=r["head_dim"],
                    length=r.get("seq") or r.get("kv_len"),
                    causal=r.get("causal", ""),
                    ms=r["ms"],
                    measured_fraction=measured(r),
                    of="bandwidth" if kind == "decode" else "peak",
                    estimated_fraction=estimate(r, chip["family"]) if ours else "",
                )
            )
    return rows


def plot(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    kinds = [k for k in ("forward", "training", "decode") if any(r["kind"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        mine = [r for r in rows if r["kind"] == kind]
        dtype = mine[0]["dtype"]
        for impl in sorted({r["impl"] for r in mine}):
            for d in sorted({r["head_dim"] for r in mine}):
                pick = [r for r in mine if r["impl"] == impl and r["head_dim"] == d and r["dtype"] == dtype]
                pick = [r for r in pick if r["causal"] in ("", "False")]
                if pick:
                    xs = [int(r["length"]) for r in pick]
                    ax.plot(xs, [r["measured_fraction"] for r in pick], marker="o", label=f"{impl} D={d}")
                    if impl == "flash_attention":
                        ests = [r["estimated_fraction"] for r in pick]
                        ax.plot(xs, ests, linestyle="--", label=f"estimate D={d}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length" if kind != "decode" else "KV length")
        ax.set_ylabel("fraction of " + ("bandwidth" if kind == "decode" else "FP16 peak"))
        ax.set_title(f"{kind} ({dtype}, not causal)")
        ax.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default=None, help="mps, or cpu_device (default: mps on a Mac)")
    parser.add_argument("--chip", default=None, help="e.g. 'M1', 'M3 Max' (default: this Mac's)")
    parser.add_argument("--gpu-cores", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--bandwidth-gbs", type=float, default=None)
    args = parser.parse_args(argv)
    detected, cores = detect_chip()
    chip = chip_figures(
        args.chip or detected,
        args.gpu_cores or (cores if not args.chip else None),
        args.peak_tflops,
        args.bandwidth_gbs,
    )
    tag = args.tag or ("mps" if detected else "cpu_device")
    rows = fractions(args.results, tag, chip)
    if not rows:
        raise SystemExit(f"no attention_{tag}.csv, training_{tag}.csv or decode_{tag}.csv in {args.results}")
    print(
        f"{chip['chip']} ({chip['family']}, {chip['gpu_cores']} GPU cores): "
        f"{chip['peak_tflops']:.2f} TFLOPS FP16 peak, {chip['bandwidth_gbs']:.0f} GB/s"
    )
    print(f"{'kind':>8} {'impl':>16} {'dtype':>9} {'D':>4} {'length':>6} {'causal':>6} {'measured':>9} {'estimate':>9}")
    for r in rows:
        est = "" if r["estimated_fraction"] == "" else f"{r['estimated_fraction']:.3f}"
        print(
            f"{r['kind']:>8} {r['impl']:>16} {r['dtype']:>9} {r['head_dim']:>4} {r['length']:>6} {r['causal']:>6} "
            f"{r['measured_fraction']:>9.4f} {est:>9}"
        )
    path = os.path.join(args.results, f"fractions_{tag}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    plot(rows, os.path.join(args.results, f"fractions_{tag}.png"), f"{chip['chip']}: measured vs estimated")


if __name__ == "__main__":
    main()
