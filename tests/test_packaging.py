"""The package as a user installs it, not as the tree holds it.

An sdist is made from a copy of the checkout (only the files git knows, so nothing built or left
over in the tree can stand in for a missing manifest entry), a wheel is built from that sdist (what
`pip install flashattn_mps-*.tar.gz` does, so one compile serves both checks), and the wheel goes
into a fresh venv that sees nothing of this tree. There every module of the package must import
from the venv, and one attention call must run on the kernel sources the wheel carries.

The fresh venv reuses the torch, numpy, transformers and diffusers the running interpreter has (a
path file naming its site directories) and installs the wheel with --no-deps: nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from helpers import TORCH_VERSION

pytestmark = pytest.mark.slow  # one compile of both extensions: about 50 s of CPU on x86-64

ROOT = Path(__file__).resolve().parent.parent

# Every source an sdist must carry to build on any OS (the Metal backend's Objective-C too, when
# the sdist is made on Linux), beside the Python package itself.
BUILD_INPUTS = ("csrc/", "metal/", "tools/embed_shim.py", "setup.py", "pyproject.toml")


def _checkout_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail("the packaging test copies the checkout with `git ls-files`: run it in a git checkout with git")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return result.stdout


def _isolated_env() -> dict[str, str]:
    """The environment without anything that would put this tree on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(checkout files, sdist path, wheel path): the sdist from a clean copy, the wheel from the sdist."""
    work = tmp_path_factory.mktemp("release")
    source = work / "checkout"
    files = _checkout_files()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = work / "dist"
    dist.mkdir()
    # setuptools' own PEP 517 hook: what `python -m build --sdist --no-isolation` calls.
    sdist_name = _run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))",
            dist,
        ],
        cwd=source,
        env=_isolated_env(),
    ).split()[-1]
    sdist = dist / sdist_name
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            dist,
            sdist,
        ],
        cwd=work,
        env=_isolated_env(),
    )
    (wheel,) = dist.glob("*.whl")
    return files, sdist, wheel


@pytest.fixture(scope="module")
def installed(release, tmp_path_factory):
    """The python of a fresh venv holding only the wheel, plus a path file to the running
    interpreter's site directories for torch and the integrations' libraries."""
    _, _, wheel = release
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site_dir = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=_isolated_env()).strip()
    )
    outer_sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    # Plain directory lines: their own .pth files (an editable install of this tree) are not run.
    (site_dir / "outer_site_packages.pth").write_text("\n".join(outer_sites) + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        env=_isolated_env(),
    )
    return python, site_dir


def _module_names(wheel: Path) -> list[str]:
    """Every Python module the wheel carries, as import names."""
    with zipfile.ZipFile(wheel) as archive:
        paths = [Path(name) for name in archive.namelist() if name.endswith(".py") and ".dist-info/" not in name]
    return sorted(
        ".".join(p.with_suffix("").parts[:-1] if p.stem == "__init__" else p.with_suffix("").parts) for p in paths
    )


def test_sdist_carries_every_build_input(release):
    files, sdist, _ = release
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        carried = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = {
        name
        for name in files
        if (name.startswith(BUILD_INPUTS) or name.startswith("flashattn_mps/")) and not Path(name).name.startswith(".")
    }
    assert "csrc/metal_backend/metal_backend.m" in needed and "tools/embed_shim.py" in needed
    missing = sorted(needed - carried)
    assert not missing, f"{top}: the sdist lacks {missing}"


def test_wheel_carries_every_package_and_kernel_source(release):
    files, _, wheel = release
    with zipfile.ZipFile(wheel) as archive:
        carried = set(archive.namelist())
    expected = {name for name in files if name.startswith("flashattn_mps/") and name.endswith(".py")}
    expected |= {
        "flashattn_mps/_metal/" + name[len("metal/") :]
        for name in files
        if name.startswith("metal/") and name.endswith((".metal", ".h"))
    }
    missing = sorted(expected - carried)
    assert not missing, f"{wheel.name} lacks {missing}"
    assert not [n for n in carried if n.endswith(".clang-format")]


def test_installed_wheel_imports_every_module_and_runs(release, installed):
    _, _, wheel = release
    python, site_dir = installed
    modules = _module_names(wheel)
    assert {
        "flashattn_mps.integrations.transformers",
        "flashattn_mps.integrations.diffusers",
        "flashattn_mps.doctor",
    } <= set(modules)
    if TORCH_VERSION < (2, 6):  # carried, but the tested transformers and diffusers need torch >= 2.6
        modules = [
            m
            for m in modules
            if m not in ("flashattn_mps.integrations.transformers", "flashattn_mps.integrations.diffusers")
        ]
    script = textwrap.dedent(
        """
        import importlib, sys
        from pathlib import Path
        site_dir = Path(sys.argv[1]).resolve()
        for name in sys.argv[2:]:
            module = importlib.import_module(name)
            where = Path(module.__file__).resolve()
            assert site_dir in where.parents, f"{name} imported from {where}, not from the venv"
        import torch, torch.nn.functional as F, flashattn_mps
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
        out = flashattn_mps.flash_attention(q, k, v, causal=True)
        error = (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item()
        assert error < 1e-5, error
        print("ok", len(sys.argv) - 2)
        """
    )
    output = _run([python, "-c", script, site_dir, *modules], cwd=site_dir.parent, env=_isolated_env())
    assert output.split() == ["ok", str(len(modules))]
