"""Apple's offline Metal compiler on every kernel source under every specialisation the planner can
emit: the check that Metal itself accepts the kernels, without a GPU (macOS with Xcode, or Xcode's
command-line tools plus the Metal toolchain).

    python -m flashattn_mps.metal_offline_check [--xcrun PATH] [--jobs N] [--sources NAME ...] [--keep DIR]
                                                [--metal4] [--files FILE.metal ... [--expect-refused]]
                                                [--dry-run]

Each (source, macros) from the C core's specialisation list (`_C.specialisations()`, the list the
strict check uses) is compiled as the backend compiles it at run time (the same self-contained
text, macros with an empty value defined as 1, no fast math) with

    xcrun -sdk macosx metal -std=metal3.1 -fno-fast-math -Wall -D... -c SRC -o X.air
    xcrun -sdk macosx metallib X.air -o X.metallib

and again with -std=metal3.0 (macOS 13, no bfloat: the sources must compile without
__HAVE_BFLOAT__) unless the specialisation is a bfloat one; with --metal4 (Xcode 26 with the Metal
toolchain) also with -std=metal4.0 -mmacosx-version-min=26.2. A source that includes Metal 4's
tensor headers (strict_check.language_of) is compiled at Metal 4.0 only, so only with --metal4.
Any error fails the check (exit 1); warnings are listed once each.

--files compiles standalone sources instead (the tensor test kernels), each at its language;
with --expect-refused each must be refused (the strict check's misuse examples: Apple's compiler
agrees with it). --dry-run prints the command lines and compiles nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import _C, _sources
from .strict_check import language_of

STANDARDS = ("metal3.1", "metal3.0")  # macOS 14+ (bfloat), macOS 13
METAL4 = "metal4.0"  # macOS 26.2+: tensors and MetalPerformancePrimitives
COMPILE_FLAGS = ("-fno-fast-math", "-Wall")
# MPP's matmul2d exists from macOS 26.2 (its availability macro reads the deployment target)
STANDARD_FLAGS = {METAL4: ("-mmacosx-version-min=26.2",)}


@dataclass(frozen=True)
class Work:
    source: str
    macros: tuple  # ((name, value), ...)
    standard: str

    @property
    def label(self) -> str:
        spec = " ".join(f"{k}={v}" for k, v in self.macros)
        return f"{self.source} -std={self.standard}" + (f" [{spec}]" if spec else "")


@dataclass
class Result:
    work: Work
    ok: bool
    output: str  # the compiler's and linker's messages


def needs_bfloat(function: str, macros) -> bool:
    """A specialisation that instantiates bfloat only (its function or a macro names the type)."""
    return "bfloat" in function.split("_") or any(value == "bfloat" for _, value in macros)


def standards_of(text: str, bfloat: bool, metal4: bool) -> list[str]:
    """The standards one source is compiled at: Metal 4.0 only for a tensor source (none without
    metal4: an older Xcode has no Metal 4), else 3.1, 3.0 unless it is a bfloat specialisation, and
    4.0 with metal4."""
    if language_of(text) == METAL4:
        return [METAL4] if metal4 else []
    return [std for std in STANDARDS if not (bfloat and std == "metal3.0")] + ([METAL4] if metal4 else [])


def work_items(sources=None, metal4: bool = False) -> list[Work]:
    """Every (source, macros, standard) to compile, from the planner's specialisation list, plus
    each kernel source the planner never emits, unspecialised."""
    texts = _sources.kernel_sources()
    names = set(texts)
    bfloat_only: dict[tuple, bool] = {}
    for source, function, macros in _C.specialisations():
        key = (source, tuple(tuple(m) for m in macros))
        bfloat_only[key] = bfloat_only.get(key, True) and needs_bfloat(function, macros)
    for name in names - {source for source, _ in bfloat_only}:
        bfloat_only[(name, ())] = False
    items = []
    for (source, macros), bfloat in sorted(bfloat_only.items()):
        if sources is not None and source not in sources:
            continue
        items += [Work(source, macros, std) for std in standards_of(texts[source], bfloat, metal4)]
    return items


@dataclass(frozen=True)
class Pipeline:
    """One pipeline the planner can emit: a function of a specialisation's library, with the
    function constants the planner sets for it (by index: (kind, value), kind "bool", "int" or
    "float")."""

    source: str
    function: str
    macros: tuple  # ((name, value), ...)
    constants: tuple  # ((index, kind, value), ...)

    @property
    def label(self) -> str:
        spec = " ".join(f"{k}={v}" for k, v in self.macros)
        return f"{self.source} {self.function}" + (f" [{spec}]" if spec else "")


def tensor_sequences_plan() -> dict:
    """The plan of the tensor-path prefill over packed sequences (its kernel and its library's table
    kernel), on the CPU device, which has Metal 4 tensor operations."""
    import torch

    from . import _C
    from ._core import plan_run, sequence_args
    from ._options import AttentionOptions

    x = torch.zeros(1, 2, 16, 32, dtype=torch.float16)
    table = torch.tensor([[0, 0, 5, 0, 0, 5], [0, 5, 11, 0, 5, 11]], dtype=torch.int32)
    options = AttentionOptions(0.25, False, (1, -1, -1), kernel=_C.KERNEL_TENSOR)
    return plan_run(x, x, x, x.clone(), None, options, sequence_args(table, 11, 11))


def planner_dispatches() -> dict:
    """{(source, kernel): {index: (kind, value)}}: every kernel the planner dispatches from each
    source (its name without the element type, e.g. "fa_backward_dkdv") and the function constants
    it sets, read from the plans of calls that reach each kernel (prefill, decode, split-K decode
    and its merge, the simple kernel, the backward and its tensor path, an additive mask's block-class
    passes, packed and paged sequences with their table kernel, the probabilities' pass). Constants
    are set by kind of call, not by value, so each kernel's set is complete; the values are those
    of a plain call."""
    import torch

    from . import explain_plan, explain_varlen_plan

    def t(*shape):
        return torch.zeros(*shape)

    q, kv = t(1, 2, 16, 32), t(1, 2, 24, 32)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    plans = [
        explain_plan(q, kv, kv),
        explain_plan(q[:, :, :1], kv, kv),
        explain_plan(q[:, :, :1], t(1, 2, 8192, 32), t(1, 2, 8192, 32)),  # split-K and its merge
        explain_plan(q, kv, kv, kernel="simple"),
        tensor_sequences_plan(),
        explain_plan(q, kv, kv, backward=True),
        explain_plan(q, kv, kv, attn_mask=t(16, 24)),  # an additive mask's block-class passes
        explain_plan(q, kv, kv, attn_mask=t(16, 24), backward=True),
        explain_plan(q.half(), kv.half(), kv.half(), backward=True, kernel="tensor"),  # the tensor backward
        explain_varlen_plan(t(16, 2, 32), t(16, 2, 32), t(16, 2, 32), cu, cu, 11, 11),
        explain_varlen_plan(t(16, 2, 32), t(16, 2, 32), t(16, 2, 32), cu, cu, 11, 11, backward=True),
        explain_varlen_plan(t(16, 2, 32), t(16, 2, 32), t(16, 2, 32), cu, cu, 11, 11, return_attn_probs=True),
        explain_varlen_plan(
            t(2, 2, 32),
            t(4, 16, 2, 32),
            t(4, 16, 2, 32),
            torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([0, 20, 30], dtype=torch.int32),
            1,
            20,
            block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        ),
    ]
    found: dict = {}
    for plan in plans:
        for d in plan["dispatches"]:
            kernel = d["function"].rsplit("_", 1)[0]
            constants = {i: (d["constant_kinds"][i], v) for i, v in d["constants"].items()}
            found.setdefault((d["source"], kernel), constants)
    return found


def pipeline_items(sources=None) -> list[Pipeline]:
    """Every pipeline the planner can emit: for each specialisation of the offline check's list
    (`_C.specialisations()`: a source, its first function and the macros), each kernel the planner
    dispatches from that source, in the specialisation's element type, with its constants."""
    kernels = planner_dispatches()
    items, seen = [], set()
    for source, function, macros in _C.specialisations():
        if sources is not None and source not in sources:
            continue
        element = function.rsplit("_", 1)[1]
        for (kernel_source, kernel), constants in sorted(kernels.items()):
            item = Pipeline(
                source,
                f"{kernel}_{element}",
                tuple(tuple(m) for m in macros),
                tuple((i, kind, value) for i, (kind, value) in sorted(constants.items())),
            )
            if kernel_source == source and item not in seen:
                seen.add(item)
                items.append(item)
    return items


def compile_command(xcrun: str, work: Work, src: str, air: str) -> list[str]:
    defines = [f"-D{name}={value or '1'}" for name, value in work.macros]
    standard = [f"-std={work.standard}", *STANDARD_FLAGS.get(work.standard, ())]
    return [xcrun, "-sdk", "macosx", "metal", *standard, *COMPILE_FLAGS, *defines, "-c", src, "-o", air]


def check_one(xcrun: str, work: Work, src: str, out_dir: str, index: int, name: str | None = None) -> Result:
    name = name or work.source.replace(".metal", "")
    stem = os.path.join(out_dir, f"{index:05d}_{name}_{work.standard}")
    compiled = subprocess.run(compile_command(xcrun, work, src, stem + ".air"), capture_output=True, text=True)
    output = compiled.stdout + compiled.stderr
    if compiled.returncode != 0:
        return Result(work, False, output)
    linked = subprocess.run(
        [xcrun, "-sdk", "macosx", "metallib", stem + ".air", "-o", stem + ".metallib"], capture_output=True, text=True
    )
    return Result(work, linked.returncode == 0, output + linked.stdout + linked.stderr)


def find_xcrun(explicit: str | None = None) -> str:
    found = shutil.which(explicit or "xcrun")
    if found is None:
        raise FileNotFoundError(
            "the offline Metal check needs Apple's xcrun and Metal compiler (macOS with Xcode; on Xcode 26 "
            "also `xcodebuild -downloadComponent MetalToolchain`); pass --xcrun PATH"
        )
    return found


def file_items(paths) -> list[Work]:
    """Standalone sources (by path), each at the standard of its language."""
    items = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            language = language_of(f.read())
        items.append(Work(path, (), language if language == METAL4 else STANDARDS[0]))
    return items


def dry_run(items: list[Work], xcrun: str = "xcrun") -> list[str]:
    """The compile and link command lines of each item, run nowhere."""
    lines = []
    for index, work in enumerate(items):
        src = work.source if os.path.isfile(work.source) else os.path.join("OUT", work.source)
        stem = os.path.join("OUT", f"{index:05d}_{os.path.basename(work.source).replace('.metal', '')}_{work.standard}")
        lines.append(" ".join(compile_command(xcrun, work, src, stem + ".air")))
        lines.append(" ".join([xcrun, "-sdk", "macosx", "metallib", stem + ".air", "-o", stem + ".metallib"]))
    return lines


def run_files(items: list[Work], xcrun: str | None = None, jobs: int | None = None, keep: str | None = None):
    tool = find_xcrun(xcrun)
    with tempfile.TemporaryDirectory(prefix="fa-metal-") as tmp:
        out_dir = keep or tmp
        os.makedirs(out_dir, exist_ok=True)
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            return list(
                pool.map(
                    lambda iw: check_one(
                        tool, iw[1], iw[1].source, out_dir, iw[0], os.path.basename(iw[1].source).replace(".metal", "")
                    ),
                    enumerate(items),
                )
            )


def run(
    xcrun: str | None = None,
    jobs: int | None = None,
    sources=None,
    keep: str | None = None,
    metal4: bool = False,
) -> list[Result]:
    tool = find_xcrun(xcrun)
    texts = _sources.kernel_sources()
    unknown = set(sources or ()) - set(texts)
    if unknown:
        raise ValueError(f"unknown kernel sources {sorted(unknown)}; known: {sorted(texts)}")
    items = work_items(sources, metal4)
    with tempfile.TemporaryDirectory(prefix="fa-metal-") as tmp:
        out_dir = keep or tmp
        os.makedirs(out_dir, exist_ok=True)
        paths = {}
        for name in {w.source for w in items}:
            paths[name] = os.path.join(out_dir, name)
            with open(paths[name], "w") as f:
                f.write(texts[name])
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            return list(
                pool.map(lambda iw: check_one(tool, iw[1], paths[iw[1].source], out_dir, iw[0]), enumerate(items))
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--xcrun", help="xcrun to use (default: xcrun on PATH)")
    parser.add_argument("--jobs", type=int, help="parallel compiles (default: all cores)")
    parser.add_argument("--sources", nargs="+", help="check only these .metal files")
    parser.add_argument("--keep", help="write sources, .air and .metallib files here and keep them")
    parser.add_argument("--metal4", action="store_true", help="also compile every source with -std=metal4.0")
    parser.add_argument("--files", nargs="+", metavar="FILE.metal", help="compile these standalone sources instead")
    parser.add_argument("--expect-refused", action="store_true", help="each of --files must fail to compile")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines, compile nothing")
    args = parser.parse_args(argv)
    if args.expect_refused and args.files is None:
        parser.error("--expect-refused applies to --files")
    try:
        if args.dry_run:
            items = file_items(args.files) if args.files else work_items(args.sources, args.metal4)
            print("\n".join(dry_run(items, args.xcrun or "xcrun")))
            return 0
        if args.files:
            results = run_files(file_items(args.files), args.xcrun, args.jobs, args.keep)
        else:
            results = run(args.xcrun, args.jobs, args.sources, args.keep, args.metal4)
    except (FileNotFoundError, ValueError) as e:
        print(f"metal offline check: {e}", file=sys.stderr)
        return 2
    if args.expect_refused:
        accepted = [r for r in results if r.ok]
        for r in accepted:
            print(f"ACCEPTED, expected refused: {r.work.label}", file=sys.stderr)
        print(f"metal offline check: {len(results) - len(accepted)} of {len(results)} misuses refused")
        return 1 if accepted else 0
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED {r.work.label}\n{r.output}", file=sys.stderr)
    warnings = sorted({line for r in results if r.ok for line in r.output.splitlines() if "warning:" in line})
    for line in warnings:
        print(f"warning (once): {line}", file=sys.stderr)
    print(
        f"metal offline check: {len(results) - len(failed)} of {len(results)} compiles passed, "
        f"{len(warnings)} distinct warnings"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
