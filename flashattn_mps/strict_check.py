"""The strict MSL check: every kernel source under every specialisation the planner can emit,
type-checked by clang with Metal's address spaces kept apart.

    python -m flashattn_mps.strict_check [--clang PATH] [--jobs N]

The CPU Metal device compiles MSL as ordinary C++, where `device`, `constant` and `threadgroup` are
empty words, so a kernel passing a device pointer where a threadgroup pointer is expected would
compile here and fail on a Mac. This check maps them to distinct clang address spaces (1, 2, 3) and
runs `clang++ -fsyntax-only` on the pre-passed source, so such code fails here first.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import _C, _sources

CLANG_CANDIDATES = ["clang++-19", "clang++-18", "clang++-17", "clang++-16", "clang++-15", "clang++"]


@dataclass
class Result:
    source: str
    macros: tuple
    ok: bool
    message: str

    @property
    def label(self) -> str:
        spec = " ".join(f"{k}={v}" for k, v in self.macros)
        return f"{self.source} [{spec}]" if spec else self.source


def find_clang(explicit: str | None = None) -> str:
    """clang++ to use: --clang, $FLASHATTN_MPS_CLANG, or the newest clang++ on PATH (>= 15 for
    _Float16 on x86-64)."""
    for candidate in [explicit, os.environ.get("FLASHATTN_MPS_CLANG")] + CLANG_CANDIDATES:
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise FileNotFoundError(
        "the strict MSL check needs clang++ >= 15 (Debian: apt-get install clang-16); "
        "set FLASHATTN_MPS_CLANG to its path"
    )


def check_one(clang: str, shim_dir: str, name: str, text: str, macros: tuple) -> Result:
    if not text.startswith("#line"):
        text = f'#line 1 "{name}"\n' + text  # name the file in clang's messages
    defines = [f"-D{k}={v}" for k, v in macros]
    base = [clang, "-x", "c++", "-std=gnu++17"]
    expanded = subprocess.run(
        base + ["-E", "-D__METAL_VERSION__=310", "-D__HAVE_BFLOAT__=1", "-I", os.path.join(shim_dir, "include")]
        + defines + ["-"],
        input=text, capture_output=True, text=True,
    )
    if expanded.returncode != 0:
        return Result(name, macros, False, expanded.stderr)
    rewritten = _C.preprocess(expanded.stdout, name, True)
    checked = subprocess.run(
        base + ["-fsyntax-only", "-DMSL_STRICT", "-Wno-unknown-attributes", "-include",
                os.path.join(shim_dir, "msl_shim.h"), "-"],
        input=rewritten, capture_output=True, text=True,
    )
    return Result(name, macros, checked.returncode == 0, checked.stderr)


def run(clang: str | None = None, jobs: int | None = None) -> list[Result]:
    """Check every (source, macros) the planner can emit; returns one Result each."""
    compiler = find_clang(clang)
    sources = _sources.kernel_sources()
    shim_dir = _C.shim_dir()
    work = []
    for source_name, _function, macros in _C.specialisations():
        work.append((source_name, sources[source_name], tuple(macros)))
    missing = sorted(set(sources) - {w[0] for w in work})
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda w: check_one(compiler, shim_dir, *w), work))
    # A .metal file the planner never emits would go unchecked: check it unspecialised too.
    results += [check_one(compiler, shim_dir, name, sources[name], ()) for name in missing]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clang", help="clang++ to use")
    parser.add_argument("--jobs", type=int, help="parallel clang processes (default: all cores)")
    args = parser.parse_args(argv)
    results = run(args.clang, args.jobs)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED {r.label}\n{r.message}", file=sys.stderr)
    print(f"strict MSL check: {len(results) - len(failed)} of {len(results)} specialisations passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
