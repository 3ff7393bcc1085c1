"""The offline Metal compile driver, run against a fake xcrun that records its arguments: which
compiles and links it asks Apple's tools for, with which flags, and that a compiler error fails it.
(Apple's compiler itself runs in the macOS workflow.)"""

from __future__ import annotations

import os
import stat

import pytest

from flashattn_mps import _C, _sources, metal_offline_check

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
    assert {(w.source, w.macros) for w in items} == planned
    assert {w.source for w in items} == set(_sources.kernel_sources())
    by_standard = {
        std: {(w.source, w.macros) for w in items if w.standard == std} for std in ("metal4.0", "metal3.1", "metal3.0")
    }
    metal4 = {(s, m) for s, m in planned if dict(m).get("FA_LANGUAGE_VERSION") == "400"}  # the tensor path's
    assert metal4 and by_standard["metal4.0"] == metal4
    assert by_standard["metal3.1"] == planned - metal4
    bfloat = {
        (s, tuple(tuple(m) for m in macros))
        for s, f, macros in _C.specialisations()
        if metal_offline_check.needs_bfloat(f, macros)
    }
    assert by_standard["metal3.0"] == planned - bfloat - metal4


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
