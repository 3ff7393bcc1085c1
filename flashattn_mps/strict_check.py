"""The strict MSL check: a conformance check that refuses what Apple's Metal compiler refuses.

    python -m flashattn_mps.strict_check [FILE.metal ...] [-D NAME=VALUE ...] [-I DIR ...] [--clang PATH]
                                         [--jobs N] [--std metal3.1|metal4.0]

With files, checks each under the -D macros (`#include "..."` searches the file's directory, then
each -I DIR);
with none, checks every (source, macros) the planner can emit. Exits non-zero on any violation;
each is printed as `file:line:col: error: ... [rule: NAME]`.

A source is checked as Metal 4 (`__METAL_VERSION__` 400, C++20, as `-std=metal4.0`) when it
includes <metal_tensor>, <metal_cooperative_tensor> or <MetalPerformancePrimitives/...>, or when
--std metal4.0 says so; otherwise as Metal 3.1, the language of the project's simdgroup kernels.

The CPU Metal device compiles MSL as ordinary C++, which accepts much that Metal does not. This
check runs clang's front end (`clang++ -fsyntax-only`) on the source after the prepass in strict
mode, against the shim in strict mode:
- the prepass refuses the C++ MSL lacks (MSL specification 1.5.4 and 2.1): double, goto, virtual,
  new/delete, exceptions, dynamic_cast, typeid, thread_local, register, static locals other than
  constants, std::, function pointers, direct recursion, a kernel named main; and, as the CPU
  device also does, argument-table indices beyond 30 or used twice, more than 31 buffers, pointer
  or reference kernel parameters without an address space, threadgroup variables outside kernel
  scope;
- clang sees `device`, `constant` and `threadgroup` as distinct address spaces, including in
  C-style casts; min/max/clamp/fmin/fmax exist per type (as in Metal: min(long, int) is
  ambiguous); SIMD-group functions take scalars and vectors of MSL's arithmetic types only;
  simdgroup_load/store take the matrix's element type in device or threadgroup memory only;
  simdgroup_multiply(_accumulate) take every operand as a non-const `thread` reference, as the
  specification declares them (a const fragment is refused);
  float-to-bfloat and half-to-bfloat conversions must be explicit (the CPU device also refuses
  bfloat-to-half); variable-length arrays are refused;
- a kernel whose kernel-scope threadgroup variables exceed 32 KiB is refused at compile time
  (msl_kernel.h), as by the CPU device;
- for the planner's specialisations, a function constant a source declares and uses that the
  planner sets in none of its dispatches: Metal refuses to build a pipeline whose function
  references it, while the CPU device fails only a dispatch that reads it. Whether each function
  gets every constant it references is per function, which only Apple's compiler settles:
  `python -m flashattn_mps.doctor --pipelines` builds each one with the planner's constants.
- Metal 4 tensor code meets the API Apple's headers declare (msl_tensor.h, `[rule: tensor-*]`):
  matmul2d's descriptor as Apple orders its fields, its scope (execution_simdgroups<N> or
  execution_thread: there is no threadgroup scope),
  the (left, right, destination) element types the macOS 26 SDK lists for matmul2d, operands that
  are rank-2 tensors or cooperative tensors bound as lvalues, none in constant memory, the
  cooperative tensors' getters (element types for the inputs, operand types for the
  destination), cooperative operands of the operation that made them, reductions between
  cooperative tensors of one element type (docs/cpu-device.md, "What the check knows of the
  tensor API").
It cannot see numerics, register pressure, races, nor anything only Apple's back end checks.
"""

from __future__ import annotations

import argparse
import ast
import operator
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import _C, _metal_cpu, _sources

# The CPU Metal device's compiler list (csrc/cpu_device/compilers.txt): clang 16 or newer.
CLANG_CANDIDATES = list(_metal_cpu.COMPILERS)

# clang's diagnostics (in the strict shim) that break an MSL rule, by a pattern of their text.
CLANG_RULES = [
    (re.compile(r"address_space_cast"), "address-space-cast"),
    (re.compile(r"variable length array"), "vla"),
    (re.compile(r"'(simdgroup_load|simdgroup_store)'"), "simdgroup-matrix-memory"),
    (re.compile(r"'(simdgroup_multiply|simdgroup_multiply_accumulate)'"), "simdgroup-matrix-operands"),
    (re.compile(r"'(min|max|clamp|fmin|fmax)'"), "builtin-argument-types"),
    (re.compile(r"'simd_\w+'"), "simd-function-types"),
    (re.compile(r"to 'bfloat'"), "bfloat-conversion"),
    (re.compile(r"address space"), "address-space"),
    (re.compile(r"file not found"), "std-library"),
    # its fields in Apple's order: m, n, k, transpose_left, transpose_right, relaxed_precision, mode
    (re.compile(r"'(mpp::tensor_ops::)?matmul2d_descriptor'"), "tensor-descriptor"),
]
_FUNCTION_CONSTANT = re.compile(r"::msl_rt::function_constant<[^;{]*?,\s*([^;{]+?)>\s+(\w+)\{[^}]*\}")
_LINE_DIRECTIVE = re.compile(r'#\s*(?:line\s+)?(\d+)\s+"([^"]*)"')
# Headers only Metal 4 sources include: a source including one is checked as Metal 4.
_METAL4_INCLUDE = re.compile(
    r"^\s*#\s*include\s*<(metal_tensor|metal_cooperative_tensor|MetalPerformancePrimitives/[\w.]+)>", re.M
)
STANDARDS = {"metal3.1": ("310", "-std=gnu++17"), "metal4.0": ("400", "-std=gnu++20")}
_DIAG = re.compile(r"^(?P<loc>[^\s:][^:]*:\d+:\d+): (?:fatal )?(?P<kind>error|warning|note): (?P<text>.*)$")


@dataclass
class Result:
    source: str
    macros: tuple
    ok: bool
    message: str  # every violation, one line each, then the compiler's own output
    violations: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        spec = " ".join(f"{k}={v}" for k, v in self.macros)
        return f"{self.source} [{spec}]" if spec else self.source


def find_clang(explicit: str | None = None) -> str:
    """clang++ to use: --clang, $FLASHATTN_MPS_CLANG, or the first of the CPU Metal device's
    compilers on PATH (CLANG_CANDIDATES: clang 16 or newer, as the device needs)."""
    for candidate in [explicit, os.environ.get("FLASHATTN_MPS_CLANG")] + CLANG_CANDIDATES:
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise FileNotFoundError(
        "the strict MSL check needs clang++ >= 16, and PATH holds none of "
        + ", ".join(CLANG_CANDIDATES)
        + " (Debian/Ubuntu: apt-get install clang-16); "
        "set FLASHATTN_MPS_CLANG to its path"
    )


def violations_of(output: str, shim_dir: str) -> list[str]:
    """One `file:line:col: error: ... [rule: NAME]` line per error in clang's output (and per
    bfloat conversion warning). The rule comes from the error's text, else from its notes; an
    error inside the shim is placed at the first source location its notes name."""
    diags = []  # [error or warning match, its notes]
    for line in output.splitlines():
        m = _DIAG.match(line)
        if m and m["kind"] == "note" and diags:
            diags[-1][1].append(m)
        elif m and m["kind"] != "note":
            diags.append((m, []))
    found = []
    for m, notes in diags:
        tagged = re.search(r"\[rule: [\w-]+\]", m["text"])
        rule = next((r for pattern, r in CLANG_RULES if pattern.search(m["text"])), None)
        if rule is None:
            rule = next((r for pattern, r in CLANG_RULES for n in notes if pattern.search(n["text"])), None)
        if m["kind"] == "warning" and rule != "bfloat-conversion":
            continue
        text = m["text"] if tagged else f"{m['text']} [rule: {rule or 'type-check'}]"
        loc = m["loc"]
        if loc.startswith(shim_dir):
            loc = next((n["loc"] for n in notes if not n["loc"].startswith(shim_dir)), loc)
        found.append(f"{loc}: error: {text}")
    return found


def language_of(text: str, given: str | None = None, macros: tuple = ()) -> str:
    """The language a source is checked as: `given` (a key of STANDARDS), else Metal 4.0 for a
    source that includes Metal 4's tensor headers or is given __METAL_VERSION__ (or the planner's
    FA_LANGUAGE_VERSION) >= 400, else Metal 3.1."""
    if given is not None:
        if given not in STANDARDS:
            raise ValueError(f"--std must be one of {', '.join(STANDARDS)}, got {given!r}")
        return given
    # the planner marks a Metal 4 library with FA_LANGUAGE_VERSION (csrc/fa_gpu_family.h)
    version = dict(macros).get("__METAL_VERSION__") or dict(macros).get("FA_LANGUAGE_VERSION") or ""
    metal4 = _METAL4_INCLUDE.search(text) or (version.isdigit() and int(version) >= 400)
    return "metal4.0" if metal4 else "metal3.1"


def _index_value(text: str) -> int | None:
    """A function constant's index expression (integer literals, + - * << | and parentheses), or
    None when it is anything else."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift}
    ops[ast.BitOr] = operator.or_

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(text)

    try:
        return value(ast.parse(re.sub(r"(?<=\d)[uUlL]+\b", "", text.strip()), mode="eval").body)
    except (SyntaxError, ValueError):
        return None


def _place(rewritten: str, offset: int) -> str:
    """file:line of an offset in rewritten source, by its #line directives."""
    place, line = "<source>", 1
    for text in rewritten[:offset].split("\n")[:-1]:
        m = _LINE_DIRECTIVE.match(text.strip())
        if m:
            place, line = m[2], int(m[1])
        else:
            line += 1
    return f"{place}:{line}"


def unset_function_constants(rewritten: str, planner_sets: frozenset) -> list[str]:
    """One violation per function constant declared in the rewritten source and used in it (its
    name outside its declaration) whose index is not in planner_sets (the indices the planner
    sets in some dispatch)."""
    declarations = list(_FUNCTION_CONSTANT.finditer(rewritten))
    elsewhere = _FUNCTION_CONSTANT.sub(" ", rewritten)
    found = []
    for m in declarations:
        index, name = _index_value(m[1]), m[2]
        if index is None or index in planner_sets or not re.search(rf"\b{name}\b", elsewhere):
            continue
        found.append(
            f"{_place(rewritten, m.start())}:1: error: function constant '{name}' (index {index}) is used, but "
            "the planner sets it in no dispatch (Metal refuses a pipeline whose function references it) "
            "[rule: function-constant-unset]"
        )
    return found


def _language_flags(flags, language: str) -> list[str]:
    """The CPU device's preprocessing flags with the language version and C++ dialect of `language`,
    and __METAL__ as Apple's compiler predefines it."""
    version, dialect = STANDARDS[language]

    def one(flag: str) -> str:
        if flag.startswith("-std="):
            return dialect
        return f"-D__METAL_VERSION__={version}" if flag.startswith("-D__METAL_VERSION__=") else flag

    return [one(f) for f in flags] + ["-D__METAL__=1"]


def _rewritten(
    clang: str, shim_dir: str, name: str, text: str, macros: tuple, include_dirs: tuple, language: str = "metal3.1"
) -> str | Result:
    """The source preprocessed and rewritten by the prepass in strict mode, or the failed Result."""
    if not text.startswith("#line"):
        text = f'#line 1 "{name}"\n' + text  # name the file in clang's messages
    defines = [f"-D{k}={v}" for k, v in macros]
    includes = [a for d in include_dirs for a in ("-I", d)]
    # The CPU device's own preprocessing flags; only Metal's headers (the shim's stand-ins) are
    # found: no C++ standard library.
    flags = _language_flags(_metal_cpu.preprocessor_flags(), language)
    expanded = subprocess.run(
        [clang, *flags, "-nostdinc++", "-I", os.path.join(shim_dir, "include")] + includes + defines + ["-"],
        input=text,
        capture_output=True,
        text=True,
    )
    if expanded.returncode != 0:
        found = violations_of(expanded.stderr, shim_dir)
        return Result(name, macros, False, "\n".join(found + [expanded.stderr]), found)
    try:
        return _metal_cpu.preprocess(expanded.stdout, name, True)
    except Exception as exc:  # the prepass's violations (or a source it cannot parse)
        found = [line for line in str(exc).splitlines() if ": error: " in line]
        return Result(name, macros, False, str(exc), found)


def _syntax_check(clang: str, shim_dir: str, rewritten: str, language: str = "metal3.1") -> tuple[bool, str, list[str]]:
    """clang's front end on rewritten source against the strict shim: (ok, output, violations)."""
    version, dialect = STANDARDS[language]
    checked = subprocess.run(
        [
            clang,
            "-x",
            "c++",
            dialect,
            f"-D__METAL_VERSION__={version}",
            "-fsyntax-only",
            "-ferror-limit=0",  # every violation, not clang's first 20 errors
            "-DMSL_STRICT",
            "-Wno-unknown-attributes",
            "-Wfloat-conversion",
            "-Werror=vla-extension",
            # bfloat is char16_t here, whose arithmetic gives int: {a * b} is no narrowing in MSL
            "-Wno-c++11-narrowing",
            "-include",
            os.path.join(shim_dir, "msl_shim.h"),
            "-",
        ],
        input=rewritten,
        capture_output=True,
        text=True,
    )
    found = violations_of(checked.stderr, shim_dir)
    return checked.returncode == 0 and not found, checked.stderr, found


def check_one(
    clang: str,
    shim_dir: str,
    name: str,
    text: str,
    macros: tuple = (),
    include_dirs: tuple = (),
    planner_sets: frozenset | None = None,
    language: str | None = None,
) -> Result:
    """Checks one source under one set of macros; with planner_sets (the function-constant
    indices the planner sets), also that it uses no other function constant. language: a key
    of STANDARDS, else language_of(text, macros=macros)."""
    language = language_of(text, language, macros)
    macros = tuple((k, v) for k, v in macros if k != "__METAL_VERSION__")  # set by the language
    rewritten = _rewritten(clang, shim_dir, name, text, macros, include_dirs, language)
    if isinstance(rewritten, Result):
        return rewritten
    ok, output, found = _syntax_check(clang, shim_dir, rewritten, language)
    if planner_sets is not None:
        found = found + unset_function_constants(rewritten, planner_sets)
    ok = ok and not found
    return Result(name, macros, ok, "\n".join(found + [output]) if not ok else output, found)


def check_batch(clang: str, shim_dir: str, work: list[tuple], planner_sets: frozenset | None = None) -> list[Result]:
    """check_one for each (name, text, macros), with one clang front-end run for all of them: each
    rewritten source in a namespace of its own (parsing the shim costs most of a run). A batch
    that fails is checked again one by one, so each Result carries its own violations.
    planner_sets: as for check_one. Every source of a batch is of one language (language_of)."""
    results: list[Result | None] = []
    unset: list[list[str]] = []
    parts = []
    languages = {language_of(text, macros=macros) for _, text, macros in work}
    if len(languages) > 1:
        raise ValueError(f"check_batch: one language per batch, got {sorted(languages)}")
    language = languages.pop() if languages else "metal3.1"
    for k, (name, text, macros) in enumerate(work):
        rewritten = _rewritten(clang, shim_dir, name, text, macros, (), language)
        if isinstance(rewritten, Result):
            results.append(rewritten)
            unset.append([])
            continue
        results.append(None)
        unset.append(unset_function_constants(rewritten, planner_sets) if planner_sets is not None else [])
        parts.append(f"namespace __msl_specialisation_{k} {{\n{rewritten}\n}}\n")
    if parts:
        ok, output, _ = _syntax_check(clang, shim_dir, "".join(parts), language)
        for k, (name, text, macros) in enumerate(work):
            if results[k] is None and ok:
                results[k] = Result(name, macros, not unset[k], "\n".join(unset[k] + [output]), unset[k])
            elif results[k] is None:
                results[k] = check_one(clang, shim_dir, name, text, macros, planner_sets=planner_sets)
    return results


def planner_constant_set() -> frozenset:
    """The indices of the function constants the planner sets in some dispatch."""
    from .metal_offline_check import planner_dispatches

    return frozenset(i for constants in planner_dispatches().values() for i in constants)


def run(clang: str | None = None, jobs: int | None = None, batch: int = 24) -> list[Result]:
    """Check every (source, macros) the planner can emit; returns one Result each."""
    compiler = find_clang(clang)
    sources = _sources.kernel_sources()
    shim_dir = _metal_cpu.shim_dir()
    work = [(name, sources[name], tuple(macros)) for name, _function, macros in _C.specialisations()]
    missing = sorted(set(sources) - {w[0] for w in work})
    # A .metal file the planner never emits would go unchecked: check it unspecialised too.
    work += [(name, sources[name], ()) for name in missing]
    batches = []
    for language in STANDARDS:
        alike = [w for w in work if language_of(w[1], macros=w[2]) == language]
        batches += [alike[i : i + batch] for i in range(0, len(alike), batch)]
    planner_sets = planner_constant_set()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return [
            r
            for results in pool.map(lambda b: check_batch(compiler, shim_dir, b, planner_sets), batches)
            for r in results
        ]


def run_files(
    paths: list[str],
    macros: tuple = (),
    clang: str | None = None,
    jobs: int | None = None,
    include_dirs: tuple = (),
    language: str | None = None,
) -> list[Result]:
    """Check the given MSL sources under the given macros, as `language` (a key of STANDARDS) or
    each as language_of finds it."""
    compiler = find_clang(clang)
    shim_dir = _metal_cpu.shim_dir()

    def one(path: str) -> Result:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        directory = os.path.dirname(os.path.abspath(path))
        try:  # the language from what the file includes, through its project headers
            whole = _sources.inline_includes(Path(path).resolve(), Path(directory).resolve())
        except (OSError, ValueError):  # a header only -I finds: the file's own text decides
            whole = text
        return check_one(
            compiler,
            shim_dir,
            path,
            text,
            macros,
            (directory,) + tuple(include_dirs),
            language=language_of(whole, language, macros),
        )

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, paths))


def _macro(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise argparse.ArgumentTypeError(f"-D expects NAME or NAME=VALUE, got {text!r}")
    return name, value if _ else "1"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="FILE.metal", help="sources to check (default: the planner's)")
    parser.add_argument(
        "-D",
        dest="macros",
        action="append",
        type=_macro,
        default=[],
        metavar="NAME=VALUE",
        help="a macro for the given files",
    )
    parser.add_argument(
        "-I",
        dest="include_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help='a directory for the given files\' #include "..."',
    )
    parser.add_argument("--clang", help="clang++ to use")
    parser.add_argument(
        "--std",
        choices=sorted(STANDARDS),
        help="the given files' language (default: Metal 4.0 for those that include its tensor headers, else 3.1)",
    )
    parser.add_argument("--jobs", type=int, help="parallel clang processes (default: all cores)")
    args = parser.parse_args(argv)
    if (args.macros or args.include_dirs or args.std) and not args.files:
        parser.error("-D, -I and --std apply to given files; the planner's specialisations bring their own")
    if args.files:
        results = run_files(args.files, tuple(args.macros), args.clang, args.jobs, tuple(args.include_dirs), args.std)
    else:
        results = run(args.clang, args.jobs)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED {r.label}\n{r.message}", file=sys.stderr)
    what = "sources" if args.files else "specialisations"
    print(f"strict MSL check: {len(results) - len(failed)} of {len(results)} {what} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
