"""The strict MSL check: every planner specialisation passes; each MSL rule it enforces refuses a
small invalid kernel (naming the file, the line and the rule) while its corrected twin passes; the
CPU Metal device refuses the same argument-table indices and over-budget threadgroup memory.

The probes of all rules go into three sources (prepass rules, type rules, corrected twins), so the
whole set costs three clang runs."""

from __future__ import annotations

import re

import pytest
import torch

from flashattn_mps import _C, _metal_cpu, _sources, strict_check
from flashattn_mps.metal_cpu import MetalCompileError, compile_library

PRELUDE = "#include <metal_stdlib>\nusing namespace metal;\n"

# rule -> (invalid MSL, its corrected twin); each a few lines with distinct names.
PREPASS_RULES = {
    "buffer-index": (
        "kernel void bi(device float *x [[buffer(31)]], device float *y [[buffer(4294967296)]]) { x[0] = y[0]; }",
        "kernel void bi(device float *x [[buffer(30)]], device float *y [[buffer(0)]]) { x[0] = y[0]; }",
    ),
    "buffer-index-reused": (
        "kernel void br(device float *x [[buffer(1)]], device float *y [[buffer(1)]]) { x[0] = y[0]; }",
        "kernel void br(device float *x [[buffer(1)]], device float *y [[buffer(2)]]) { x[0] = y[0]; }",
    ),
    "buffer-count": (
        "kernel void bc(" + ", ".join(f"device float *b{i}" for i in range(32)) + ") { b0[0] = 1; }",
        "kernel void bc(" + ", ".join(f"device float *b{i}" for i in range(31)) + ") { b0[0] = 1; }",
    ),
    "threadgroup-index": (
        "kernel void ti(threadgroup float *t [[threadgroup(31)]], device float *x [[buffer(0)]]) { x[0] = t[0]; }",
        "kernel void ti(threadgroup float *t [[threadgroup(0)]], device float *x [[buffer(0)]]) { x[0] = t[0]; }",
    ),
    "pointer-address-space": (
        "kernel void pa(float *x [[buffer(0)]]) { x[0] = 1; }",
        "kernel void pa(device float *x [[buffer(0)]]) { x[0] = 1; }",
    ),
    "kernel-main": (
        "kernel void main(device float *x [[buffer(0)]]) { x[0] = 1; }",
        "kernel void main_kernel(device float *x [[buffer(0)]]) { x[0] = 1; }",
    ),
    "threadgroup-scope": (
        "inline float ts(uint i) { threadgroup float tile[32]; tile[i] = 1; return tile[0]; }",
        "inline float ts(threadgroup float *tile, uint i) { tile[i] = 1; return tile[0]; }",
    ),
    "double": (
        "inline float db(float x) { double d = x; return float(d * 2); }",
        "inline float db(float x) { float d = x; return d * 2; }",
    ),
    "goto": (
        "inline void gt(device float *x) { int i = 0; again: x[i] = 0; if (++i < 4) goto again; }",
        "inline void gt(device float *x) { for (int i = 0; i < 4; i++) x[i] = 0; }",
    ),
    "virtual": ("struct vb { virtual float f() const { return 0; } };", "struct vb { float f() const { return 0; } };"),
    "new-delete": (
        "inline float nd() { thread float *p = new float; float v = *p; delete p; return v; }",
        "inline float nd() { float p = 0; return p; }",
    ),
    "exceptions": (
        "inline float ex(float x) { try { if (x < 0) throw 1; } catch (int) { return 0; } return x; }",
        "inline float ex(float x) { return x < 0 ? 0 : x; }",
    ),
    "dynamic-cast": (
        "struct da { int x; }; struct dd : da {}; "
        "inline int dc(thread da *a) { return dynamic_cast<thread dd *>(a)->x; }",
        "struct da { int x; }; struct dd : da {}; "
        "inline int dc(thread da *a) { return static_cast<thread dd *>(a)->x; }",
    ),
    "typeid": (
        "inline bool tid_same() { return typeid(int) == typeid(uint); }",
        "inline bool tid_same() { return is_same_v<int, uint>; }",
    ),
    "storage-class": (
        "inline int sc() { thread_local int a = 0; register int b = 1; return a + b; }",
        "inline int sc() { int a = 0; int b = 1; return a + b; }",
    ),
    "static-local": (
        "inline int sl() { static int calls = 0; return ++calls; }",
        "inline int sl() { constexpr int calls = 1; return calls; }",
    ),
    "std-library": (
        "inline float sd(float a, float b) { return std::max(a, b); }",
        "inline float sd(float a, float b) { return metal::max(a, b); }",
    ),
    "function-pointer": (
        "inline float fp(float (*f)(float), float v) { return f(v); }",
        "template <class F> inline float fp(F f, float v) { return f(v); }",
    ),
    "recursion": (
        "inline int fact(int n) { return n <= 1 ? 1 : n * fact(n - 1); }",
        "inline int fact(int n) { int r = 1; for (int i = 2; i <= n; i++) r *= i; return r; }",
    ),
}

TYPE_RULES = {
    "address-space": (
        "inline float first(threadgroup float *tile) { return tile[0]; }\n"
        "kernel void as(device float *x [[buffer(0)]]) { x[0] = first(x); }",
        "inline float first(device float *tile) { return tile[0]; }\n"
        "kernel void as(device float *x [[buffer(0)]]) { x[0] = first(x); }",
    ),
    "address-space-cast": (
        "kernel void ac(constant float *c [[buffer(0)]], device float *d [[buffer(1)]]) "
        "{ device float *p = (device float *)c; d[0] = p[0]; }",
        "kernel void ac(constant float *c [[buffer(0)]], device float *d [[buffer(1)]]) "
        "{ device float4 *p = (device float4 *)d; d[0] = c[0] + p[0].x; }",
    ),
    "vla": (
        "kernel void vl(device float *x [[buffer(0)]], constant int &n [[buffer(1)]]) "
        "{ float a[n]; a[0] = 1; x[0] = a[0]; }",
        "kernel void vl(device float *x [[buffer(0)]], constant int &n [[buffer(1)]]) "
        "{ float a[4]; a[0] = float(n); x[0] = a[0]; }",
    ),
    "bfloat-conversion": (
        "kernel void bf(device bfloat *x [[buffer(0)]]) { float f = 1.5f * x[1]; x[0] = f; }",
        "kernel void bf(device bfloat *x [[buffer(0)]]) { float f = 1.5f * x[1]; x[0] = bfloat(f); }",
    ),
    "builtin-argument-types": (
        "kernel void mm(device long *x [[buffer(0)]], constant int &n [[buffer(1)]]) "
        "{ long a = x[0]; x[0] = min(a, n); }",
        "kernel void mm(device long *x [[buffer(0)]], constant int &n [[buffer(1)]]) "
        "{ long a = x[0]; x[0] = min(a, long(n)); }",
    ),
    "simdgroup-matrix-memory": (
        "kernel void sg(device half *x [[buffer(0)]], constant float *c [[buffer(1)]]) "
        "{ simdgroup_float8x8 m; simdgroup_load(m, x); simdgroup_load(m, c); }",
        "kernel void sg(device half *x [[buffer(0)]], device float *c [[buffer(1)]]) "
        "{ simdgroup_half8x8 m; simdgroup_load(m, x); simdgroup_store(m, x); "
        "simdgroup_float8x8 f; simdgroup_load(f, c); }",
    ),
    # the fragment helpers once passed a const operand, which the specification's signature (non-const
    # `thread` references) does not take
    "simdgroup-matrix-operands": (
        "inline void mo(thread simdgroup_float8x8 &acc, const thread simdgroup_float8x8 *a, "
        "thread simdgroup_float8x8 &b) { simdgroup_multiply_accumulate(acc, a[0], b, acc); }",
        "inline void mo(thread simdgroup_float8x8 &acc, thread simdgroup_float8x8 *a, "
        "thread simdgroup_float8x8 &b) { simdgroup_multiply_accumulate(acc, a[0], b, acc); }",
    ),
    "simd-function-types": (
        "struct two { float a, b; };\n"
        "kernel void sh(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) "
        "{ two p = {x[i], 1}; two q = simd_shuffle_xor(p, ushort(1)); x[i] = q.a; }",
        "struct two { float a, b; };\n"
        "kernel void sh(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) "
        "{ two p = {x[i], 1}; x[i] = simd_shuffle_xor(p.a, ushort(1)); }",
    ),
    "threadgroup-memory": (
        "kernel void tm(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) "
        "{ threadgroup float a[4096]; threadgroup float b[4097]; a[i] = b[i] = 1; x[i] = a[0]; }",
        "kernel void tm(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) "
        "{ threadgroup float a[4096]; threadgroup float b[4096]; a[i] = b[i] = 1; x[i] = a[0]; }",
    ),
}

_VIOLATION = re.compile(r"^(?P<file>.*?):(?P<line>\d+):\d+: error: .*\[rule: (?P<rule>[\w-]+)\]")


def probe_source(pieces: list[str]) -> tuple[str, list[range]]:
    """The pieces after the prelude, and the lines each occupies."""
    text, spans, line = PRELUDE, [], PRELUDE.count("\n") + 1
    for piece in pieces:
        n = piece.count("\n") + 1
        spans.append(range(line, line + n))
        text += piece + "\n"
        line += n
    return text, spans


def check(name: str, text: str) -> strict_check.Result:
    return strict_check.check_one(strict_check.find_clang(), _metal_cpu.shim_dir(), name, text)


@pytest.fixture(scope="module")
def invalid():
    """rule -> (source, lines of its probe, violations found, whole message), from two checks."""
    found = {}
    for name, rules in (("prepass.metal", PREPASS_RULES), ("types.metal", TYPE_RULES)):
        text, spans = probe_source([bad for bad, _ in rules.values()])
        result = check(name, text)
        assert not result.ok
        for rule, span in zip(rules, spans):
            found[rule] = (name, span, result.violations, result.message)
    return found


@pytest.fixture(scope="module")
def twins():
    text, _ = probe_source([good for _, good in {**PREPASS_RULES, **TYPE_RULES}.values()])
    return check("twins.metal", text)


@pytest.mark.parametrize("rule", list(PREPASS_RULES) + list(TYPE_RULES))
def test_rule_refuses_the_invalid_kernel(invalid, rule):
    name, span, violations, _ = invalid[rule]
    hits = [m for m in map(_VIOLATION.match, violations) if m and m["rule"] == rule]
    assert hits, f"no [rule: {rule}] among:\n" + "\n".join(violations)
    assert any(m["file"] == name and int(m["line"]) in span for m in hits), "\n".join(m.string for m in hits)


def test_corrected_twins_pass(twins):
    assert twins.ok, twins.message


def test_standard_library_header_is_refused():
    result = check("stdlib.metal", "#include <vector>\n" + PRELUDE)
    assert not result.ok
    assert any("[rule: std-library]" in v and v.startswith("stdlib.metal:1:") for v in result.violations), (
        result.message
    )


def test_threadgroup_memory_message_names_kernel_and_bytes(invalid):
    message = invalid["threadgroup-memory"][3]
    assert "32772" in message and "__msl_kernel_tm" in message, message


def test_command_line_checks_given_files_under_macros(tmp_path, capsys):
    source = tmp_path / "mine.metal"
    source.write_text(
        PRELUDE + "#if BROKEN\ninline double twice(double x) { return 2 * x; }\n#endif\n" + TYPE_RULES["vla"][1] + "\n"
    )
    assert strict_check.main([str(source)]) == 0
    assert strict_check.main([str(source), "-D", "BROKEN=1"]) == 1
    err = capsys.readouterr().err
    assert f"{source}:4:" in err and "[rule: double]" in err


def test_a_function_constant_the_planner_never_sets_is_refused():
    planner = strict_check.planner_constant_set()
    assert {0, 1, 2, 3, 7, 11, 12, 13} <= planner and 99 not in planner  # band ... paged; 99 is free
    text = (
        PRELUDE
        + "constant bool fc_band [[function_constant(0)]];\n"
        + "constant int fc_new [[function_constant(90 + 9)]];\n"  # used below, set by no dispatch
        + "constant bool fc_idle [[function_constant(98)]];\n"  # declared, never used: Metal does not mind
        + "kernel void fc(device int *o [[buffer(0)]]) { o[0] = fc_band ? fc_new : 0; }\n"
    )
    result = strict_check.check_one(
        strict_check.find_clang(), _metal_cpu.shim_dir(), "fc.metal", text, planner_sets=planner
    )
    assert not result.ok
    assert [re.sub(r" \(Metal.*", "", v) for v in result.violations] == [
        "fc.metal:4:1: error: function constant 'fc_new' (index 99) is used, but the planner sets it in no dispatch"
    ], result.violations
    assert all("[rule: function-constant-unset]" in v for v in result.violations)
    assert check("fc.metal", text).ok  # without the planner's set, only the MSL rules apply


@pytest.mark.slow
def test_every_planner_specialisation_passes():
    results = strict_check.run()
    assert len(results) == len(_C.specialisations())  # no source needed an unspecialised extra run
    assert {r.source for r in results} == set(_sources.kernel_sources())
    failed = [f"{r.label}: {r.message}" for r in results if not r.ok]
    assert not failed, "\n".join(failed[:3])


# ---- the CPU Metal device refuses the same (one implementation: the prepass and msl_kernel.h) ----


def test_cpu_device_refuses_argument_indices_beyond_the_table():
    # 2^32 used to wrap to buffer 0 and bind silently
    for index in ("31", "4294967296"):
        with pytest.raises(MetalCompileError, match=rf"buffer\({index}\).*\[rule: buffer-index\]"):
            compile_library(PRELUDE + f"kernel void k(device float *x [[buffer({index})]]) {{ x[0] = 1; }}")


def test_cpu_device_refuses_kernel_scope_threadgroup_memory_over_32_kib():
    # where Metal's pipeline creation refuses it: at the kernel's dispatch, naming the bytes
    bad, good = TYPE_RULES["threadgroup-memory"]
    lib = compile_library(PRELUDE + bad, name="over.metal")
    with pytest.raises(ValueError, match=r"kernel 'tm': threadgroup memory exceeds 32768 bytes: .* 32772 bytes"):
        lib.dispatch("tm", (1,), (1,), [torch.zeros(1)])
    compile_library(
        PRELUDE + good + "\n" + PREPASS_RULES["buffer-index"][1] + "\n" + CONVERSIONS_FIXED, name="fits.metal"
    )


CONVERSIONS_FIXED = (
    "kernel void cv(device bfloat *x [[buffer(0)]], device half *h [[buffer(1)]]) {\n"
    "  float f = 1.5f * x[1]; x[0] = bfloat(f);\n"
    "  h[0] = half(float(x[2]));\n"
    "  simdgroup_half8x8 m; simdgroup_load(m, h);\n"
    "  long a = 1; int n = 2; h[1] = half(float(min(a, long(n)))); }"
)


def test_cpu_device_shim_has_msl_conversions_and_simdgroup_types():
    # float -> bfloat, bfloat -> half, a float matrix loaded from half memory, min(long, int):
    # accepted by the old shim, refused by Apple's compiler (the corrected twin, CONVERSIONS_FIXED, compiles above)
    bad = (
        "kernel void cv(device bfloat *x [[buffer(0)]], device half *h [[buffer(1)]]) {\n"
        "  float f = 1.5f * x[1]; x[0] = f;\n"
        "  h[0] = x[2];\n"
        "  simdgroup_float8x8 m; simdgroup_load(m, h);\n"
        "  long a = 1; int n = 2; h[1] = half(float(min(a, n))); }"
    )
    with pytest.raises(MetalCompileError) as err:
        compile_library(PRELUDE + bad, name="conversions.metal")
    message = str(err.value)
    for line in (4, 5, 6, 7):
        assert f"conversions.metal:{line}:" in message, message
