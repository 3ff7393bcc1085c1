"""The strict check knows Metal 4's tensor API as Apple's headers declare it: each misuse below is
refused with the rule it breaks, the same kernels written correctly pass, and so do the kernels
of tests/device/test_tensor.py. The misuses are also refused by the CPU Metal device (one shown
here). On a Mac, `write_examples` gives the CI job the same kernels as files, which Apple's
compiler must accept (accepted.metal) and refuse (refused_*.metal): see .github/workflows/macos.yml."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from flashattn_mps import _metal_cpu, strict_check
from flashattn_mps.metal_cpu import MetalCompileError, compile_library

PRELUDE = textwrap.dedent("""
    #include <metal_stdlib>
    #include <metal_tensor>
    #include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
    using namespace metal;
    using namespace mpp::tensor_ops;
    """)


def kernel(
    body: str, params: str = "device half *a [[buffer(0)]], device half *b [[buffer(1)]], device float *c [[buffer(2)]]"
) -> str:
    """A kernel `k` (the PRELUDE goes before it)."""
    return f"kernel void k({params}) {{\n" + textwrap.indent(textwrap.dedent(body), "  ") + "}\n"


# 16 x 32 x 16 products of A (16 x 16) and B (16 x 32) into C (16 x 32), each tensor's extents
# innermost first.
TENSORS = """
    auto ta = tensor(a, extents<int, 16, 16>());
    auto tb = tensor(b, extents<int, 32, 16>());
    auto tc = tensor(c, extents<int, 32, 16>());
    constexpr auto desc = matmul2d_descriptor(16, 32, 16);
    """

# name -> (the rule, a kernel breaking it); each has a correct twin in ACCEPTED.
MISUSES = {
    "threadgroup_scope": (
        "tensor-scope",
        kernel(TENSORS + "matmul2d<desc, execution_threadgroup> op;\nop.run(ta, tb, tc);\n"),
    ),
    "float_operands_into_half": (
        "tensor-operand-types",
        kernel(
            TENSORS.replace("tensor(c,", "tensor(h,")
            .replace("tensor(a,", "tensor(fa,")
            .replace("tensor(b,", "tensor(fb,")
            + "matmul2d<desc, execution_simdgroup> op;\nop.run(ta, tb, tc);\n",
            "device float *fa [[buffer(0)]], device float *fb [[buffer(1)]], device half *h [[buffer(2)]]",
        ),
    ),
    "int8_operands_into_float": (  # a macOS 27.3 deployment target's
        "tensor-operand-types",
        kernel(
            TENSORS.replace("tensor(a,", "tensor(ia,").replace("tensor(b,", "tensor(ib,")
            + "matmul2d<desc, execution_simdgroup> op;\nop.run(ta, tb, tc);\n",
            "device int8_t *ia [[buffer(0)]], device int8_t *ib [[buffer(1)]], device float *c [[buffer(2)]]",
        ),
    ),
    "half_inputs_into_bfloat": (
        "tensor-operand-types",
        kernel(
            TENSORS + "matmul2d<desc, execution_simdgroup> op;\n"
            "auto ca = op.get_left_input_cooperative_tensor<half, half, bfloat>();\n"
        ),
    ),
    "destination_getter_given_element_types": (
        "tensor-cooperative-getter",
        kernel(
            TENSORS + "matmul2d<desc, execution_simdgroup> op;\n"
            "auto cc = op.get_destination_cooperative_tensor<half, half, float>();\n"
        ),
    ),
    "destination_of_const_operands": (
        "tensor-operand-types",
        kernel(
            TENSORS.replace("tensor(a,", "tensor(ca_,").replace("tensor(b,", "tensor(cb_,")
            + "matmul2d<desc, execution_simdgroup> op;\n"
            "auto cc = op.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();\n",
            "const device half *ca_ [[buffer(0)]], const device half *cb_ [[buffer(1)]], device float *c [[buffer(2)]]",
        ),
    ),
    "mode_in_relaxed_precisions_place": (
        "tensor-descriptor",
        kernel(
            TENSORS.replace(
                "matmul2d_descriptor(16, 32, 16)",
                "matmul2d_descriptor(16, 32, 16, false, false, matmul2d_descriptor::mode::multiply_accumulate)",
            )
            + "matmul2d<desc, execution_simdgroup> op;\nop.run(ta, tb, tc);\n"
        ),
    ),
    "temporary_slice": (
        "tensor-operand-lvalue",
        kernel(TENSORS + "matmul2d<desc, execution_simdgroup> op;\nop.run(ta.slice(0, 0), tb, tc);\n"),
    ),
    "rank_3_operand": (
        "tensor-rank",
        kernel(
            TENSORS + "auto t3 = tensor(a, extents<int, 16, 16, 1>());\n"
            "matmul2d<desc, execution_simdgroup> op;\nop.run(t3, tb, tc);\n"
        ),
    ),
    "input_in_constant_memory": (
        "tensor-storage",
        kernel(
            TENSORS.replace("tensor(a,", "tensor(k_,")
            + "matmul2d<desc, execution_simdgroup> op;\nop.run(ta, tb, tc);\n",
            "constant half *k_ [[buffer(0)]], device half *b [[buffer(1)]], device float *c [[buffer(2)]]",
        ),
    ),
    "pointer_operand": (
        "tensor-operand-kind",
        kernel(TENSORS + "matmul2d<desc, execution_simdgroup> op;\nop.run(a, tb, tc);\n"),
    ),
    "another_operations_destination": (
        "tensor-cooperative-operand",
        kernel(
            TENSORS + "matmul2d<desc, execution_simdgroup> op;\n"
            "matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroup> other;\n"
            "auto cc = other.get_destination_cooperative_tensor<decltype(ta), decltype(ta), float>();\n"
            "op.run(ta, tb, cc);\n"
        ),
    ),
    "reduction_identity_of_another_type": (
        "tensor-reduction-types",
        kernel(
            TENSORS + "matmul2d<desc, execution_simdgroup> op;\n"
            "auto cc = op.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();\n"
            "op.run(ta, tb, cc);\n"
            "auto high = op.get_row_reduction_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();\n"
            "reduce_rows(cc, high, reduction_operation::max, 0);\n"
        ),
    ),
}

# The same operations as Apple declares them: scopes, types, lvalues, getters, reductions.
ACCEPTED = kernel(
    TENSORS
    + """
    matmul2d<desc, execution_simdgroup> op;
    auto whole = ta.slice(0, 0);
    op.run(whole, tb, tc);
    auto ca = op.get_left_input_cooperative_tensor<half, half, float>();
    auto cb = op.get_right_input_cooperative_tensor<half, half, float>();
    auto cc = op.get_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
    ca.load(ta);
    cb.load(tb);
    op.run(ca, cb, cc);
    auto high = op.get_row_reduction_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
    reduce_rows(cc, high, reduction_operation::max, reduction_operation_identity<float>::max_identity);
    cc.store(tc);
    matmul2d<matmul2d_descriptor(64, 32, 16), execution_simdgroups<4>> wide;
    auto ba = tensor((device bfloat *)a, extents<int, 16, 64>());
    auto bc = tensor(c, extents<int, 32, 64>());
    auto bb = tensor((device bfloat *)b, extents<int, 32, 16>());
    wide.run(ba, bb, bc);
    matmul2d<desc, execution_thread> alone;
    alone.run(ta, tb, tc);
    """
)


def write_examples(directory: str) -> None:
    """accepted.metal and one refused_<name>.metal per misuse, for Apple's compiler."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accepted.metal").write_text(PRELUDE + ACCEPTED)
    for name, (_, source) in MISUSES.items():
        (out / f"refused_{name}.metal").write_text(PRELUDE + source)


@pytest.fixture(scope="module")
def check():
    clang, shim = strict_check.find_clang(), _metal_cpu.shim_dir()
    return lambda name, source: strict_check.check_one(clang, shim, name, source)


@pytest.fixture(scope="module")
def misuse_violations(check):
    """name -> the violations placed in that misuse: all of them checked in one run, each kernel
    named after its misuse and its lines after name.metal."""
    parts = [PRELUDE]
    for name, (_, source) in MISUSES.items():
        parts.append(f'#line 1 "{name}.metal"\n' + source.replace("kernel void k(", f"kernel void {name}(", 1))
    result = check("misuses.metal", "\n".join(parts))
    return {name: [v for v in result.violations if v.startswith(f"{name}.metal:")] for name in MISUSES}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_a_misuse_of_the_tensor_api_is_refused_naming_its_rule(misuse_violations, name):
    rule = MISUSES[name][0]
    found = misuse_violations[name]
    assert any(f"[rule: {rule}]" in v for v in found), found


def test_the_same_operations_as_declared_pass(check):
    result = check("accepted.metal", PRELUDE + ACCEPTED)
    assert result.ok, result.message


def test_one_misuse_checked_alone_is_refused_with_its_place(check):
    result = check("alone.metal", PRELUDE + MISUSES["temporary_slice"][1])
    assert not result.ok
    assert [v for v in result.violations if v.startswith("alone.metal:") and "[rule: tensor-operand-lvalue]" in v]


def test_the_tensor_tests_kernels_pass():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_tensor import SOURCE

    [result] = strict_check.run_files([_write(SOURCE)])
    assert result.ok, result.message


def _write(source: str) -> str:
    import tempfile

    f = tempfile.NamedTemporaryFile("w", suffix=".metal", delete=False)
    f.write(source)
    f.close()
    return f.name


def test_the_device_refuses_a_misuse_too():
    with pytest.raises(MetalCompileError, match=r"rule: tensor-scope"):
        compile_library(PRELUDE + MISUSES["threadgroup_scope"][1], name="misuse.metal")


def test_matmul2d_at_thread_scope_runs_on_the_device():
    """execution_thread, which the check accepts, also runs here: each thread its own product."""
    import torch

    source = PRELUDE + kernel(
        TENSORS.replace("tensor(c,", "tensor(c + 512 * tid,")
        + "matmul2d<desc, execution_thread> alone;\nalone.run(ta, tb, tc);\n",
        "device half *a [[buffer(0)]], device half *b [[buffer(1)]], device float *c [[buffer(2)]], "
        "uint tid [[thread_index_in_threadgroup]]",
    )
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 16, generator=g).half(), torch.randn(16, 32, generator=g).half()
    c = torch.zeros(2, 16, 32)
    compile_library(source, name="alone.metal").dispatch("k", 1, 2, [a, b, c])
    want = a.double() @ b.double()
    assert (c.double() - want).abs().max() <= 1e-5


def test_a_file_is_checked_as_metal_4_through_the_headers_it_includes(tmp_path):
    (tmp_path / "tensor_helpers.h").write_text(PRELUDE)
    (tmp_path / "uses_them.metal").write_text('#include "tensor_helpers.h"\n' + ACCEPTED)
    [result] = strict_check.run_files([str(tmp_path / "uses_them.metal")])
    assert result.ok, result.message


def test_tensor_sources_are_checked_as_metal_4():
    assert strict_check.language_of(PRELUDE + ACCEPTED) == "metal4.0"
    assert strict_check.language_of("#include <metal_stdlib>\n") == "metal3.1"
    assert strict_check.language_of("", macros=(("__METAL_VERSION__", "400"),)) == "metal4.0"
    assert strict_check.language_of(PRELUDE + ACCEPTED, "metal3.1") == "metal3.1"
    with pytest.raises(ValueError, match="--std"):
        strict_check.language_of("", "metal5")
