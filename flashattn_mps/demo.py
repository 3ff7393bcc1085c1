"""The main job: attention on the best device present, checked against SDPA.

    python -m flashattn_mps.demo [--batch B --heads H --kv-heads HKV --seq L --head-dim E --dtype float16]

Runs on MPS (Metal) on a Mac with Apple silicon, else on the CPU Metal device, which executes the
very same Metal kernels on the CPU (its timings are not GPU timings).
"""

from __future__ import annotations

import argparse
import time

import torch

from . import flash_attention, mps_probe
from ._sdpa import torch_sdpa

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2, help="GQA: key/value heads (divides --heads)")
    parser.add_argument("--seq", type=int, default=1024, help="query and key length")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float16")
    parser.add_argument("--no-causal", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device("mps" if mps_probe.usable() else "cpu")
    where = "Metal (MPS)" if device.type == "mps" else "the CPU Metal device (Metal kernels run on the CPU)"
    dtype = _DTYPES[args.dtype]
    causal = not args.no_causal
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, n, e = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    q = torch.randn(b, h, n, e, generator=gen).to(device, dtype)
    k = torch.randn(b, hkv, n, e, generator=gen).to(device, dtype)
    v = torch.randn(b, hkv, n, e, generator=gen).to(device, dtype)
    print(f"flash_attention on {where}")
    print(f"shape: q ({b}, {h}, {n}, {e}), k/v ({b}, {hkv}, {n}, {e}), {args.dtype}, causal={causal}")

    flash_attention(q, k, v, causal=causal)  # first call compiles (or loads) the kernel
    if device.type == "mps":
        torch.mps.synchronize()
    start = time.perf_counter()
    out = flash_attention(q, k, v, causal=causal)
    if device.type == "mps":
        torch.mps.synchronize()
    elapsed = time.perf_counter() - start

    # torch's SDPA (torch_sdpa: also on torch 2.4, which has no enable_gqa)
    golden = torch_sdpa(q.cpu().double(), k.cpu().double(), v.cpu().double(), is_causal=causal, enable_gqa=True)
    reference = torch_sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    error = (out.cpu().double() - golden).abs().max().item()
    reference_error = (reference.cpu().double() - golden).abs().max().item()
    tolerance = max(1e-5, 5 * reference_error)
    print(
        f"max |error| vs float64 SDPA: {error:.3e} (SDPA in {args.dtype}: {reference_error:.3e}; "
        f"tolerance {tolerance:.3e}) -> {'OK' if error <= tolerance else 'FAIL'}"
    )
    print(f"time: {elapsed * 1e3:.1f} ms" + ("" if device.type == "mps" else " (CPU Metal device, not a GPU timing)"))
    scores = b * h * n * n * 4
    print(
        f"memory: an L x S float32 score matrix would need {_mib(scores)}; "
        f"flash_attention allocated only its output, {_mib(out.numel() * out.element_size())}"
    )
    return 0 if error <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
