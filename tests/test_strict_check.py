"""The strict MSL check runs over every specialisation, and catches address-space mistakes that the
CPU shim alone would let through."""
from __future__ import annotations

import textwrap

from flashattn_mps import _C, _sources, strict_check

MISUSE = textwrap.dedent("""
    #include <metal_stdlib>
    using namespace metal;
    inline float first(threadgroup float *tile) { return tile[0]; }
    kernel void k(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
      x[i] = first(x);  // a device pointer where a threadgroup pointer is expected
    }
""")


def test_every_planner_specialisation_passes():
    results = strict_check.run()
    assert len(results) == len(_C.specialisations())  # no source needed an unspecialised extra run
    assert {r.source for r in results} == set(_sources.kernel_sources())
    failed = [f"{r.label}: {r.message}" for r in results if not r.ok]
    assert not failed, "\n".join(failed[:3])


def test_address_space_misuse_is_caught():
    clang = strict_check.find_clang()
    result = strict_check.check_one(clang, _C.shim_dir(), "misuse.metal", MISUSE, ())
    assert not result.ok
    assert "address space" in result.message and "misuse.metal:6" in result.message


def test_correct_use_passes():
    clang = strict_check.find_clang()
    fixed = MISUSE.replace("threadgroup float *tile", "device float *tile")
    result = strict_check.check_one(clang, _C.shim_dir(), "fixed.metal", fixed, ())
    assert result.ok, result.message
