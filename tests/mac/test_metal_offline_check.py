"""The offline Metal compile driver, run against a fake xcrun that records its arguments: which
compiles and links it asks Apple's tools for, with which flags, and that a compiler error fails it.
(Apple's compiler itself runs in the macOS workflow.)"""

from __future__ import annotations

import os
import stat

import pytest

from flashattn_mps import _C, _sources, metal_offline_check
from flashattn_mps.strict_check import language_of

FAKE_XCRUN = """#!/bin/sh
echo "$*" >> "$FAKE_XCRUN_LOG"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
if [ -n "$FAKE_XCRUN_FAIL" ]; then
  case "$*" in *"$FAKE_XCRUN_FAIL"*) echo "x.metal:1:1: error: planted failure" >&2; exit 1;; esac
fi
echo "x.metal:2:2: warning: planted warning" >&2
: > "$out"
"""


@pytest.fixture
def fake_xcrun(tmp_path, monkeypatch):
    tool = tmp_path / "bin" / "xcrun"
    tool.parent.mkdir()
    tool.write_text(FAKE_XCRUN)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    monkeypatch.delenv("FAKE_XCRUN_FAIL", raising=False)
    return log


def test_work_covers_every_specialisation_the_planner_emits_with_both_standards():
    items = metal_offline_check.work_items()
    planned = {(source, tuple(tuple(m) for m in macros)) for source, _, macros in _C.specialisations()}
    tensor = {name for name, text in _sources.kernel_sources().items() if language_of(text) == "metal4.0"}
    planned = {p for p in planned if p[0] not in tensor}  # Metal 4 only: with --metal4
    assert {(w.source, w.macros) for w in items} == planned
    assert {w.source for w in items} == set(_sources.kernel_sources()) - tensor
    by_standard = {std: {(w.source, w.macros) for w in items if w.standard == std} for std in ("metal3.1", "metal3.0")}
    assert by_standard["metal3.1"] == planned
    bfloat = {
        (s, tuple(tuple(m) for m in macros))
        for s, f, macros in _C.specialisations()
        if metal_offline_check.needs_bfloat(f, macros)
    }
    assert by_standard["metal3.0"] == planned - bfloat


def test_needs_bfloat():
    assert metal_offline_check.needs_bfloat("fa_forward_bfloat", [])
    assert metal_offline_check.needs_bfloat("fa_forward", [("FA_T", "bfloat")])
    assert not metal_offline_check.needs_bfloat("fa_forward_float", [("FA_BD", "64")])


def test_compiles_and_links_each_specialisation_with_apples_flags(fake_xcrun, capsys):
    assert metal_offline_check.main(["--sources", "fa_simple.metal", "fa_decode.metal", "--jobs", "2"]) == 0
    calls = [line.split() for line in fake_xcrun.read_text().splitlines()]
    compiles = [c for c in calls if c[2] == "metal"]
    links = [c for c in calls if c[2] == "metallib"]
    expected = [w for w in metal_offline_check.work_items() if w.source in ("fa_simple.metal", "fa_decode.metal")]
    assert len(compiles) == len(links) == len(expected) > 2
    for c in compiles:
        assert c[:2] == ["-sdk", "macosx"] and c[3] in ("-std=metal3.1", "-std=metal3.0")
        assert "-fno-fast-math" in c and "-Wall" in c and "-c" in c
        assert c[c.index("-c") + 1].endswith((".metal",)) and c[-1].endswith(".air")
    decode = {tuple(sorted(a for a in c if a.startswith("-D"))) for c in compiles if c[-1].find("fa_decode") >= 0}
    planned = {
        tuple(sorted(f"-D{k}={v}" for k, v in macros))
        for s, _, macros in _C.specialisations()
        if s == "fa_decode.metal"
    }
    assert decode == planned
    assert {c[-1].replace(".metallib", ".air") for c in links} == {c[-1] for c in compiles}
    out = capsys.readouterr()
    assert f"{len(expected)} of {len(expected)} compiles passed, 1 distinct warnings" in out.out
    assert out.err.count("planted warning") == 1


def test_a_compile_error_fails_the_check_and_names_the_specialisation(fake_xcrun, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_XCRUN_FAIL", "-DFA_DECODE_COLS=2 -DFA_DECODE_ROWS=4")
    assert metal_offline_check.main(["--sources", "fa_decode.metal"]) == 1
    err = capsys.readouterr().err
    assert "FAILED fa_decode.metal -std=metal3.1 [FA_DTYPE=half FA_DECODE_COLS=2 FA_DECODE_ROWS=4]" in err
    assert "planted failure" in err


def test_missing_xcrun_or_unknown_source_is_a_clear_error(monkeypatch, tmp_path, fake_xcrun, capsys):
    assert metal_offline_check.main(["--sources", "nope.metal"]) == 2
    assert "unknown kernel sources ['nope.metal']" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert metal_offline_check.main([]) == 2
    assert "needs Apple's xcrun" in capsys.readouterr().err


TENSOR_SOURCE = "#include <metal_stdlib>\n#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"


def test_metal4_compiles_every_source_at_metal_4_and_tensor_sources_only_there(fake_xcrun, monkeypatch, capsys):
    sources = {"fa_simple.metal": _sources.kernel_sources()["fa_simple.metal"], "fa_tensor_x.metal": TENSOR_SOURCE}
    monkeypatch.setattr(metal_offline_check._sources, "kernel_sources", lambda: sources)
    plain = metal_offline_check.work_items(["fa_simple.metal", "fa_tensor_x.metal"])
    assert {w.standard for w in plain} == {"metal3.1", "metal3.0"} and "fa_tensor_x.metal" not in {
        w.source for w in plain
    }
    assert metal_offline_check.main(["--sources", "fa_simple.metal", "fa_tensor_x.metal", "--metal4"]) == 0
    compiles = [c.split() for c in fake_xcrun.read_text().splitlines() if c.split()[2] == "metal"]
    metal4 = [c for c in compiles if "-std=metal4.0" in c]
    assert all("-mmacosx-version-min=26.2" in c for c in metal4)
    assert {os.path.basename(c[-1]).rsplit("_", 1)[0].split("_", 1)[1] for c in metal4} == {"fa_simple", "fa_tensor_x"}
    assert [c for c in compiles if "fa_tensor_x" in c[-1]] == [c for c in metal4 if "fa_tensor_x" in c[-1]]
    assert len(metal4) == len([c for c in compiles if "-std=metal3.1" in c]) + 1
    capsys.readouterr()


def test_given_files_compile_or_must_be_refused(fake_xcrun, monkeypatch, tmp_path, capsys):
    good, bad = tmp_path / "good.metal", tmp_path / "bad_misuse.metal"
    good.write_text(TENSOR_SOURCE)
    bad.write_text(TENSOR_SOURCE + "// misuse\n")
    assert metal_offline_check.main(["--dry-run", "--files", str(good), str(bad)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and not fake_xcrun.exists()
    assert lines[0].startswith("xcrun -sdk macosx metal -std=metal4.0 -mmacosx-version-min=26.2 ")
    monkeypatch.setenv("FAKE_XCRUN_FAIL", "bad_misuse.metal")
    assert metal_offline_check.main(["--files", str(good), str(bad)]) == 1
    capsys.readouterr()
    assert metal_offline_check.main(["--expect-refused", "--files", str(bad)]) == 0
    assert "1 of 1 misuses refused" in capsys.readouterr().out
    assert metal_offline_check.main(["--expect-refused", "--files", str(good), str(bad)]) == 1
    assert f"ACCEPTED, expected refused: {good}" in capsys.readouterr().err
