"""What works on this machine, in one report to paste into a bug report.

    python -m flashattn_mps.doctor [--json]
    python -m flashattn_mps.doctor --pipelines [--sources NAME ...] [--json]    # macOS

Lists the system (macOS, chip), torch's and this package's versions, the Metal device the backend
chose and torch's (same registryID?), its GPU families (simdgroup_matrix needs Apple7+), which torch
symbols were found and the stream mode in effect, the class of an MPS tensor's buffer and the buffer
check's verdict, and the compile options in effect. Then a parity check of every kernel family
(forward, decode with and without split-K, backward, masks) against
torch.nn.functional.scaled_dot_product_attention with its error and tolerance (PyTorch's rule:
error vs a float64 golden <= max(1e-5, 5 x the error of torch's SDPA in the same dtype on the same
device)), and a short timing against that SDPA. On MPS the checks run on Metal; without MPS they
run on the CPU Metal device (same kernel sources) and the report says the Metal path was not
checked. Whether MPS is there is decided by a probe that computes on it (flashattn_mps.mps_probe),
not by torch.backends.mps.is_available(), which a virtual machine's paravirtual GPU also passes.
Each line is ok, failed or skipped, with why; the exit code is 1 if anything failed.

--pipelines (macOS): builds every pipeline the planner can emit (each kernel of each specialisation
the offline compiler check compiles, with the function constants the planner sets for it) on the
Metal device, and prints each one's maxTotalThreadsPerThreadgroup, staticThreadgroupMemoryLength
and threadExecutionWidth, or Metal's error (a missing function constant, a failed compile or
pipeline). Minutes: every library compiles once. Exit code 1 if any failed, 2 off macOS.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _C, _core, _metal_mode, explain_plan, flash_attention, metal_offline_check, mps_probe

OK, FAILED, SKIPPED = "ok", "failed", "skipped"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)


def _run(name: str, probe: Callable[[], Check]) -> Check:
    """A probe's result, or a failed line with the exception: the doctor itself never crashes."""
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - anything a probe raises is a finding
        return Check(name, FAILED, f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()})


# --- system, versions, Metal --------------------------------------------------------------------


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("flashattn-mps")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown (not installed as a distribution)"


def _chip() -> str:
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return platform.processor() or platform.machine()


def _mps_check() -> Check:
    """ok when MPS computes; skipped without MPS, or in a virtual machine whose MPS cannot compute
    (GitHub's macOS runners); failed when torch reports MPS on bare metal and it cannot compute."""
    probe = mps_probe.probe()
    data = asdict(probe)
    if probe.usable:
        return Check("torch MPS", OK, probe.describe(), data)
    if probe.available and probe.virtual_machine is not True:
        return Check("torch MPS", FAILED, probe.describe(), data)
    return Check("torch MPS", SKIPPED, probe.describe() + ": no Apple GPU for torch", data)


def metal_usable() -> bool:
    """Whether the kernel checks run on Metal: MPS computes here and this build has the backend."""
    return _C.HAS_METAL_BACKEND and mps_probe.usable()


def system_checks() -> list[Check]:
    mac = platform.mac_ver()[0]
    return [
        Check("macOS", OK, mac) if mac else Check("macOS", SKIPPED, f"not macOS: {platform.platform()}"),
        Check("chip", OK, _chip()),
        Check(
            "versions",
            OK,
            f"python {platform.python_version()}, torch {torch.__version__}, flashattn_mps {_package_version()}",
            {"python": platform.python_version(), "torch": torch.__version__, "flashattn_mps": _package_version()},
        ),
        _run("torch MPS", _mps_check),
        Check(
            "Metal backend",
            OK if _C.HAS_METAL_BACKEND else SKIPPED,
            "built into this extension" if _C.HAS_METAL_BACKEND else "not in this build (only macOS builds have it)",
        ),
    ]


def _describe_language(info: dict) -> str:
    version = info["language_version"]
    language = f"MSL {version // 100}.{version % 100 // 10}" if version else "MSL left to Metal's default"
    if info["math_mode"] >= 0:
        modes = {0: "safe", 1: "relaxed", 2: "fast"}
        functions = {0: "fast", 1: "precise"}
        math = (
            f"mathMode {modes.get(info['math_mode'], info['math_mode'])}, FP32 functions "
            f"{functions.get(info['math_fp32_functions'], info['math_fp32_functions'])}"
        )
    else:
        math = f"fastMathEnabled {'YES' if info['fast_math'] else 'NO'}"
    return f"{language}, {math}"


def metal_checks() -> list[Check]:
    """The Metal facts; only where MPS computes and this build has the backend."""
    if not metal_usable():
        return [
            Check(
                "Metal path",
                SKIPPED,
                "not checked: needs a usable torch MPS and a macOS build; the parity checks below ran on the "
                "CPU Metal device",
            )
        ]
    checks = []
    decision = _metal_mode.current()

    def stream() -> Check:
        ok = decision.mode == decision.requested
        return Check("stream mode", OK if ok else FAILED, decision.describe(), asdict(decision))

    def symbols() -> Check:
        found = _C.metal_torch_symbols()
        missing = [name for name, ok in found.items() if not ok]
        return Check(
            "torch symbols",
            OK if not missing else SKIPPED,
            f"all {len(found)} found" if not missing else f"not found: {', '.join(missing)}",
            found,
        )

    def device() -> Check:
        info = _C.metal_device_info()
        same = info["torch_registry_id"] is None or info["torch_registry_id"] == info["registry_id"]
        torch_side = (
            "torch's device unknown (its command buffer was not reachable)"
            if info["torch_registry_id"] is None
            else f"torch's registryID {info['torch_registry_id']:#x} ({'same' if same else 'DIFFERENT'})"
        )
        return Check(
            "Metal device",
            OK if same else FAILED,
            f"{info['name']}, registryID {info['registry_id']:#x}, chosen by {info['chosen_by']}; {torch_side}",
            info,
        )

    def families() -> Check:
        info = _C.metal_device_info()
        supported = [name for name, ok in info["families"].items() if ok]
        apple7 = info["families"]["Apple7"]
        return Check(
            "GPU families",
            OK if apple7 else FAILED,
            f"{', '.join(supported) or 'none'}; max threadgroup memory {info['max_threadgroup_memory']} bytes"
            + ("" if apple7 else "; simdgroup_matrix needs Apple7 (M1) or newer"),
            info["families"],
        )

    def options() -> Check:
        info = _C.metal_device_info()
        unsafe = info["fast_math"] or info["math_mode"] > 0
        return Check(
            "compile options",
            FAILED if unsafe else OK,
            _describe_language(info) + ("; fast math breaks -inf masking and NaN propagation" if unsafe else ""),
        )

    def buffer() -> Check:
        t = torch.zeros(16, device="mps")
        handle = t.untyped_storage().data_ptr()
        cls = _C.metal_object_class(handle) or "(not an Objective-C object)"
        try:
            _C.metal_check_buffer(handle, t.untyped_storage().nbytes())
        except TypeError as e:
            return Check("MPS buffer", FAILED, f"class {cls}; the buffer check rejects it: {e}", {"class": cls})
        return Check(
            "MPS buffer",
            OK,
            f"class {cls}; the buffer check accepts it"
            + ("" if decision.check_buffers else " (identity test off: FLASHATTN_MPS_NO_BUFFER_CHECK)"),
            {"class": cls},
        )

    for name, probe in (
        ("stream mode", stream),
        ("torch symbols", symbols),
        ("Metal device", device),
        ("GPU families", families),
        ("compile options", options),
        ("MPS buffer", buffer),
    ):
        checks.append(_run(name, probe))
    return checks


# --- parity --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    shape: tuple  # (B, Hq, Hkv, L, S, E)
    causal: bool = False
    mask: Optional[str] = None  # None, "bool" or "float"
    backward: bool = False
    family: str = "fa_forward"  # the planner's first function must start with this
    split: Optional[bool] = None  # the plan must (not) split the keys


PARITY_CASES = [
    Case("forward float32", torch.float32, (1, 2, 2, 48, 40, 64)),
    Case("forward float16 causal", torch.float16, (1, 2, 2, 48, 48, 64), causal=True),
    Case("forward bfloat16", torch.bfloat16, (1, 2, 2, 48, 40, 64)),
    Case("decode (GQA, no split)", torch.float16, (1, 4, 2, 1, 64, 64), family="fa_decode", split=False),
    Case("decode split-K", torch.float32, (1, 4, 2, 1, 600, 64), family="fa_decode", split=True),
    Case("mask bool", torch.float32, (1, 2, 2, 24, 40, 64), mask="bool"),
    Case("mask float", torch.float16, (1, 2, 2, 24, 40, 64), mask="float"),
    Case("backward float32 causal", torch.float32, (1, 2, 2, 40, 40, 64), causal=True, backward=True),
]


def _inputs(case: Case, device: str):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, lq, lk, e = case.shape

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype)

    q, k, v = randn(b, hq, lq, e), randn(b, hkv, lk, e), randn(b, hkv, lk, e)
    mask = None
    if case.mask == "bool":
        mask = torch.rand(b, 1, lq, lk, generator=gen) > 0.3
    elif case.mask == "float":
        mask = randn(b, 1, lq, lk)
    return [t if t is None else t.to(device) for t in (q, k, v, mask)]


def _sdpa(q, k, v, mask, causal):
    """torch's SDPA with the kv heads repeated for GQA (torch 2.4 has no enable_gqa); the math
    backend on the CPU (as PyTorch's own tests take references), torch's choice elsewhere."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    if q.device.type == "cpu":
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _outputs(fn, q, k, v, mask, causal, backward, dout_seed=1):
    """fn's output, or its gradients (dq, dk, dv) for a fixed random dout."""
    if not backward:
        return [fn(q, k, v, mask, causal)]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, mask, causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed)).to(out.dtype).to(out.device)
    return list(torch.autograd.grad(out, leaves, dout))


def _max_error(actual: torch.Tensor, golden: torch.Tensor) -> float:
    a = actual.detach().double().cpu()
    if a.shape != golden.shape:
        raise ValueError(f"shape {tuple(a.shape)} != {tuple(golden.shape)}")
    if not torch.equal(a.isnan(), golden.isnan()):
        return float("inf")
    finite = golden.isfinite()
    return (a[finite] - golden[finite]).abs().max().item() if finite.any() else 0.0


def _flash(q, k, v, mask, causal):
    return flash_attention(q, k, v, causal=causal, attn_mask=mask)


def _dtype_unsupported(dtype: torch.dtype, device: str) -> Optional[str]:
    """Why torch cannot hold this dtype on the device (bfloat16 on MPS needs macOS 14), or None."""
    try:
        torch.zeros(1, dtype=dtype, device=device)
    except (RuntimeError, TypeError) as e:
        return f"torch has no {dtype} on {device} here ({e})"
    return None


def parity_check(case: Case, device: str) -> Check:
    unsupported = _dtype_unsupported(case.dtype, device)
    if unsupported:
        return Check(f"parity {case.name}", SKIPPED, unsupported)
    q, k, v, mask = _inputs(case, device)
    if not case.backward:
        plan = explain_plan(q, k, v, causal=case.causal, attn_mask=mask)
        function = plan["dispatches"][0]["function"]
        if not function.startswith(case.family):
            return Check(f"parity {case.name}", FAILED, f"the plan runs {function}, not {case.family}")
        if case.split is not None and (plan["split_count"] > 1) != case.split:
            return Check(f"parity {case.name}", FAILED, f"the plan's split_count is {plan['split_count']}")
    golden_mask = None if mask is None else mask.cpu() if mask.dtype == torch.bool else mask.cpu().double()
    golden_inputs = [t.detach().cpu().double() for t in (q, k, v)] + [golden_mask]
    golden = _outputs(_sdpa, *golden_inputs, case.causal, case.backward)
    ours = _outputs(_flash, q, k, v, mask, case.causal, case.backward)
    reference = _outputs(_sdpa, q, k, v, mask, case.causal, case.backward)
    worst = None
    for index, (o, r, g) in enumerate(zip(ours, reference, golden)):
        error, tolerance = _max_error(o, g), max(1e-5, 5.0 * _max_error(r, g))
        if worst is None or error / tolerance > worst[0] / worst[1]:
            worst = (error, tolerance, ("dq", "dk", "dv")[index] if case.backward else "out")
    error, tolerance, which = worst
    status = OK if error <= tolerance else FAILED
    return Check(
        f"parity {case.name}",
        status,
        f"{which}: error {error:.2e} {'<=' if status == OK else '>'} tolerance {tolerance:.2e} on {device}",
        {"error": error, "tolerance": tolerance, "tensor": which, "device": device},
    )


# --- dropout's generator -------------------------------------------------------------------------


def dropout_generator_check(device: str) -> Check:
    """Dropout's generator words (torch.randint over the full int32 range on the device): draws
    differ, are not all zero, reach both signs and high bits, and follow torch.manual_seed. The
    caller's random state is restored."""
    mps = device == "mps"
    saved = torch.get_rng_state(), torch.mps.get_rng_state() if mps else None
    try:
        draws = [_core.dropout_rng_state(torch.device(device)).cpu() for _ in range(16)]
        torch.manual_seed(1234)
        first = _core.dropout_rng_state(torch.device(device)).cpu()
        torch.manual_seed(1234)
        again = _core.dropout_rng_state(torch.device(device)).cpu()
    finally:
        torch.set_rng_state(saved[0])
        if mps:
            torch.mps.set_rng_state(saved[1])
    words = torch.cat(draws).long()
    problems = []
    if len({tuple(d.tolist()) for d in draws}) < len(draws):
        problems.append("two draws were equal")
    if not words.any():
        problems.append("every word was 0")
    if not (words.min() < 0 < words.max() and words.abs().max() >= 2**24):
        problems.append(f"the words span only [{words.min().item()}, {words.max().item()}]")
    if not torch.equal(first, again):
        problems.append("torch.manual_seed does not repeat a draw")
    detail = f"{len(draws)} draws of 4 int32 words on {device}"
    if problems:
        return Check("dropout generator", FAILED, f"{detail}: {'; '.join(problems)}")
    return Check("dropout generator", OK, f"{detail}: distinct, full range, repeatable under torch.manual_seed")


# --- every pipeline (macOS) ----------------------------------------------------------------------


def pipeline_checks(sources=None) -> list[Check]:
    """Builds every pipeline the planner can emit on the Metal device, one line each."""
    checks = []
    for item in metal_offline_check.pipeline_items(sources):
        constants = [(index, kind, float(value)) for index, kind, value in item.constants]
        if "FA_LANGUAGE_VERSION" in dict(item.macros) and not _C.device_tensor_family(_C.DEVICE_MPS):
            checks.append(
                Check(
                    f"pipeline {item.label}",
                    SKIPPED,
                    "Metal 4 tensor operations need macOS 26.2+ on an Apple9 or Apple10 GPU (and an SDK 26 build)",
                )
            )
            continue

        def build(item=item, constants=constants) -> Check:
            info = _C.metal_pipeline_info(item.source, item.function, list(item.macros), constants)
            return Check(
                f"pipeline {item.label}",
                OK,
                f"maxTotalThreadsPerThreadgroup {info['max_total_threads_per_threadgroup']}, "
                f"staticThreadgroupMemoryLength {info['static_threadgroup_memory_length']} bytes, "
                f"threadExecutionWidth {info['thread_execution_width']}",
                info,
            )

        checks.append(_run(f"pipeline {item.label}", build))
    return checks


# --- timing --------------------------------------------------------------------------------------


def timing_check(device: str) -> Check:
    if device != "mps":
        return Check(
            "timing", SKIPPED, "only on MPS (CPU Metal device timings say nothing about a Mac; see benchmarks/)"
        )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2048, 64, generator=gen).to(torch.float16).to("mps") for _ in range(3))

    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            torch.mps.synchronize()
            start = time.perf_counter()
            fn()
            torch.mps.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    ours = median_ms(lambda: flash_attention(q, k, v, causal=True))
    theirs = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return Check(
        "timing",
        OK,
        f"(1, 16, 2048, 64) float16 causal: flashattn_mps {ours:.2f} ms, "
        f"torch SDPA {theirs:.2f} ms ({theirs / ours:.2f}x)",
        {"flashattn_mps_ms": ours, "sdpa_ms": theirs},
    )


# --- report --------------------------------------------------------------------------------------


def collect() -> tuple[str, list[Check]]:
    """(device the kernel checks ran on, every check)."""
    device = "mps" if metal_usable() else "cpu"
    checks = system_checks() + metal_checks()
    checks += [_run(f"parity {case.name}", lambda case=case: parity_check(case, device)) for case in PARITY_CASES]
    checks.append(_run("dropout generator", lambda: dropout_generator_check(device)))
    checks.append(_run("timing", lambda: timing_check(device)))
    return device, checks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--pipelines", action="store_true", help="build every pipeline the planner can emit (macOS)")
    parser.add_argument("--sources", nargs="+", help="with --pipelines: only these .metal files")
    args = parser.parse_args(argv)
    if args.sources and not args.pipelines:
        parser.error("--sources goes with --pipelines")
    if args.pipelines:
        return pipelines_main(args.json, args.sources)
    device, checks = collect()
    failed = [c for c in checks if c.status == FAILED]
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not failed,
                    "metal_checked": device == "mps",
                    "kernel_device": device,
                    "checks": [asdict(c) for c in checks],
                },
                indent=2,
                default=str,
            )
        )
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<7} {c.name:<{width}}  {c.detail}")
        if device != "mps":
            print("\nThe Metal path was not checked: the kernel checks above ran on the CPU Metal device.")
        print(f"\n{len(failed)} failed" if failed else "\nall checks passed or were skipped")
    return 1 if failed else 0


def pipelines_main(as_json: bool, sources=None) -> int:
    if not _C.HAS_METAL_BACKEND:
        print(
            "doctor --pipelines builds Metal pipelines, which needs macOS: this build of flashattn_mps has no Metal "
            "backend (the CPU Metal device runs the same kernels: python -m flashattn_mps.doctor)",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    checks = pipeline_checks(sources)
    failed = [c for c in checks if c.status == FAILED]
    if as_json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2, default=str))
    else:
        for c in checks:
            print(f"{c.status:<7} {c.name}  {c.detail}")
        print(f"\n{len(checks) - len(failed)} of {len(checks)} pipelines built in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
