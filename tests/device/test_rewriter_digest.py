"""The CPU Metal device's cache key covers its own rewriting code: the build embeds a digest of
prepass.c and build.c (tools/embed_shim.py), so a library built by an older rewrite is not loaded."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def embed_shim():
    spec = importlib.util.spec_from_file_location("embed_shim", ROOT / "tools" / "embed_shim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digest(module, rewriters):
    text = module.render(
        ROOT / "csrc" / "cpu_device" / "shim", ROOT / "csrc" / "cpu_device" / "compilers.txt", rewriters
    )
    return re.search(r'mcpu_rewriter_digest\[\] = "([0-9a-f]{64})";', text).group(1)


def test_a_change_to_a_rewriting_source_changes_the_digest(tmp_path):
    module = embed_shim()
    prepass, build = tmp_path / "prepass.c", tmp_path / "build.c"
    prepass.write_text("/* one rewrite */\n")
    build.write_text("/* the IR's */\n")
    before = digest(module, [prepass, build])
    assert digest(module, [prepass, build]) == before
    prepass.write_text("/* another rewrite */\n")
    assert digest(module, [prepass, build]) != before
