"""Host overhead per call: the time from Python to the encoded dispatch, kernels excluded.

Runs with FLASHATTN_MPS_SKIP_EXECUTION=1 (set here before flashattn_mps is imported): every call
does all of its host work (validation, plan, pipeline lookup, binding) and skips only running the
kernels. Per-call microseconds are the median over batches of calls, for a tiny, a decode-sized and
a prefill-sized call, plain, with requires_grad (the forward and its autograd record), under
torch.inference_mode and through the SDPA drop-in, beside torch's own SDPA on the tiny shape in the
same run (its compute is negligible there, so it is torch's host overhead). Goal: a plain
call at most 10 us and at most torch's tiny SDPA; the autograd path at most 3x that.

    python benchmarks/bench_host_overhead.py [--calls N] [--device cpu|mps]

Writes benchmarks/results/host_overhead_<device>.csv and prints a table. Not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("FLASHATTN_MPS_SKIP_EXECUTION", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashattn_mps  # noqa: E402

# (B, Hq, Hkv, L, S, E): torch's tiny call, one decode step of a GQA model, a prefill.
SHAPES = {
    "tiny": (1, 1, 1, 1, 16, 8),
    "decode": (1, 32, 8, 1, 4096, 128),
    "prefill": (1, 32, 8, 1024, 1024, 128),
}
BATCH = 20  # calls per timed batch: the clock's own cost stays under 1% of a call
GOAL_US = 10.0


def per_call_us(call, calls: int) -> float:
    """Median over batches of BATCH calls of the mean time per call, in microseconds."""
    for _ in range(max(20, calls // 20)):
        call()
    samples = []
    for _ in range(max(1, calls // BATCH)):
        start = time.perf_counter_ns()
        for _ in range(BATCH):
            call()
        samples.append((time.perf_counter_ns() - start) / BATCH / 1000.0)
    return statistics.median(samples)


def tensors(shape, device, dtype, requires_grad=False):
    b, hq, hkv, lq, lk, e = shape
    made = (torch.randn(b, hq, lq, e), torch.randn(b, hkv, lk, e), torch.randn(b, hkv, lk, e))
    return [t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in made]


def measure(name, shape, mode, device, dtype, calls):
    q, k, v = tensors(shape, device, dtype, requires_grad=mode == "requires_grad")
    context = torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
    if mode == "dropin":

        def call():
            flashattn_mps.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:

        def call():
            flashattn_mps.flash_attention(q, k, v)

    with context:
        return per_call_us(call, calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000, help="timed calls per row")
    parser.add_argument("--device", default="cpu", choices=["cpu", "mps"])
    args = parser.parse_args()
    if os.environ.get("FLASHATTN_MPS_SKIP_EXECUTION") != "1":
        print("note: FLASHATTN_MPS_SKIP_EXECUTION is not 1, so kernel execution is included", file=sys.stderr)
    dtype = torch.float16

    tiny_q, tiny_k, tiny_v = tensors(SHAPES["tiny"], "cpu", torch.float32)
    torch_sdpa = per_call_us(lambda: F.scaled_dot_product_attention(tiny_q, tiny_k, tiny_v), args.calls)
    tiny_g = [t.detach().requires_grad_() for t in (tiny_q, tiny_k, tiny_v)]
    torch_sdpa_grad = per_call_us(lambda: F.scaled_dot_product_attention(*tiny_g), args.calls)

    rows = []
    for name, shape in SHAPES.items():
        for mode in ("plain", "requires_grad", "inference_mode", "dropin"):
            us = measure(name, shape, mode, args.device, dtype, args.calls)
            factor = 3 if mode == "requires_grad" else 1  # the autograd path may cost 3x
            rows.append(
                {
                    "shape": name,
                    "mode": mode,
                    "us_per_call": round(us, 2),
                    "goal_us": factor * GOAL_US,
                    "within_goal": us <= factor * GOAL_US,
                    "torch_tiny_sdpa_us": round(torch_sdpa, 2),
                    "within_torch": us <= factor * torch_sdpa,  # at most torch's tiny call (3x with grad)
                }
            )

    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"host_overhead_{args.device}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    print(f"host overhead per call, kernels skipped, {args.device}, {dtype}, median of {args.calls} calls")
    print(f"torch SDPA on tiny CPU tensors: {torch_sdpa:.2f} us plain, {torch_sdpa_grad:.2f} us with requires_grad")
    print(f"{'shape':8s} {'mode':15s} {'us/call':>8s} {'goal':>6s} {'met':>4s} {'<= torch (3x w/ grad)':>22s}")
    for r in rows:
        print(
            f"{r['shape']:8s} {r['mode']:15s} {r['us_per_call']:8.2f} {r['goal_us']:6.0f} "
            f"{'yes' if r['within_goal'] else 'no':>4s} {'yes' if r['within_torch'] else 'no':>22s}"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
