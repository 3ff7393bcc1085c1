"""Other projects' Metal 4 tensor kernels, unmodified, on the CPU Metal device against float64
attention: MLX's NAX attention (`steel_attention_nax.h` of the `mlx-metal` wheel) and torch 2.14.1's
MPP prefill (`MppAttention.h` of the macOS arm64 torch wheel). Nothing of theirs is in this
repository: the wheels are downloaded from PyPI when the tests run (about 150 MB; a directory
holding them already can be named by $FLASHATTN_MPS_PEER_WHEELS), so the module runs only when
selected: `python -m pytest tests/device/test_peer_tensor_kernels.py -m network`.

Checked by hand beyond these (mlx-metal 0.32.4, torch 2.14.1; L = 100 queries, 77 or 100 keys, two
heads, errors against float64 beside a same-dtype computation's): MLX NAX, BQ 64, BK 32, fp16 and
bf16, D 64 and 128, causal or not: 2.4e-4 to 6.1e-3 (references 6.7e-4 to 1.3e-2); torch's
`prefill_attention_mpp_a10_*`, D 64, 96, 128 and 256, fp16 and bf16, causal or not: 2.4e-4 to
7.5e-3 (references 7.1e-4 to 1.5e-2), all 222 kernels of the header built in 101 s on 2 cores;
`_a9_*` under gpu_family="apple9" the same figures; MLX NAX under the scrambled layout: error 1.05.
"""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from flashattn_mps import _metal_cpu, strict_check
from flashattn_mps.metal_cpu import compile_library

pytestmark = [pytest.mark.slow, pytest.mark.network]

WHEELS = {
    "mlx": (["mlx-metal==0.32.4", "--platform", "macosx_26_0_arm64"], "mlx/include/"),
    "torch": (["torch==2.14.1", "--platform", "macosx_14_0_arm64"], "torch/include/"),
}
INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^">]+)[">]')


@pytest.fixture(scope="module", autouse=True)
def _selected(request):
    if "network" not in (request.config.option.markexpr or ""):
        pytest.skip("downloads other projects' wheels from PyPI: select with -m network")


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    """name -> the include directory unpacked from its wheel."""
    given = os.environ.get("FLASHATTN_MPS_PEER_WHEELS")
    wheels = Path(given) if given else tmp_path_factory.mktemp("wheels")
    out = {}
    for name, (spec, prefix) in WHEELS.items():
        package = spec[0].split("==")[0].replace("-", "_")
        found = sorted(wheels.glob(f"{package}-*.whl"))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels)]
                + spec,
                check=True,
            )
            found = sorted(wheels.glob(f"{package}-*.whl"))
        root = tmp_path_factory.mktemp(name)
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(root, [m for m in wheel.namelist() if m.startswith(prefix) and m.endswith(".h")])
        out[name] = root / prefix
    return out


def inline(path: Path, root: Path, seen: set) -> str:
    """The header with the other headers it includes from `root` inlined once each (#pragma once)."""
    out = [f'#line 1 "{path.name}"']
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = INCLUDE.match(line)
        target = (
            next((p.resolve() for p in (path.parent / match.group(1), root / match.group(1)) if p.is_file()), None)
            if match
            else None
        )
        if target is None:
            out.append("" if line.strip() == "#pragma once" else line)
            continue
        if target not in seen:
            seen.add(target)
            out.append(inline(target, root, seen))
        out.append(f'#line {number + 1} "{path.name}"')
    return "\n".join(out)


def attention(q, k, v, scale, causal, dtype=torch.float64):
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if causal:
        keep = torch.arange(s.shape[-1])[None, :] <= torch.arange(s.shape[-2])[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.float() if dtype != torch.float64 else s, -1).to(dtype)
    return p @ v.to(dtype)


def check(out, q, k, v, scale, causal):
    want = attention(q, k, v, scale, causal)
    same_dtype = (attention(q, k, v, scale, causal, q.dtype).double() - want).abs().max().item()
    error = (out.double() - want).abs().max().item()
    assert error <= max(1e-5, 5 * same_dtype), (error, same_dtype)
    return error


def qkv(dtype, heads, queries, keys, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, queries, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, heads, keys, head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def strides(t):
    return struct.pack("3q", *t.stride()[:3])


def mlx_nax_source(root: Path) -> str:
    seen: set = set()
    return (
        inline(root / "mlx/backend/metal/kernels/utils.h", root, seen)
        + "\n"
        + inline(root / "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention_nax.h", root, seen)
        + '\ninstantiate_kernel("nax_half_64", attention_nax, half, 64, 32, 64, 64, 4, 1, half, float)\n'
        + 'instantiate_kernel("nax_bfloat_128", attention_nax, bfloat, 64, 32, 128, 128, 4, 1, bfloat, float)\n'
    )


def torch_mpp_source(root: Path) -> str:
    seen: set = set()
    return (
        "#include <metal_stdlib>\n#include <metal_simdgroup_matrix>\nusing namespace metal;\n"
        + inline(root / "c10/metal/utils.h", root, seen)
        + "\n"
        + inline(root / "ATen/native/mps/kernels/MppAttention.h", root, seen)
    )


@pytest.fixture(scope="module", params=["family", "scrambled"])
def mlx_nax(request, headers):
    source = mlx_nax_source(headers["mlx"])
    return request.param, compile_library(source, name="steel_attention_nax.metal", tensor_layout=request.param)


@pytest.mark.parametrize(
    "kernel, dtype, head_dim, causal",
    [("nax_half_64", torch.float16, 64, True), ("nax_bfloat_128", torch.bfloat16, 128, False)],
)
def test_mlx_nax_attention(mlx_nax, kernel, dtype, head_dim, causal):
    layout, lib = mlx_nax
    length, heads, bq, bk = 100, 2, 64, 32
    q, k, v = qkv(dtype, heads, length, length, head_dim, head_dim)
    out = torch.zeros_like(q)
    scale = 1 / math.sqrt(head_dim)
    blocks_q, blocks_k = -(-length // bq), -(-length // bk)
    params = (
        struct.pack(
            "6if7i",
            1,
            heads,
            head_dim,
            length,
            length,
            1,
            scale,
            blocks_q,
            blocks_k,
            length // bq,
            length // bk,
            length % bq,
            length % bk,
            0,
        )
        + strides(q) * 4
    )
    constants = {200: length % bq == 0, 201: length % bk == 0, 300: False, 301: causal, 302: False, 303: False}
    lib.dispatch(kernel, (blocks_q, heads, 1), (32, 4, 1), [q, k, v, out, params], constants=constants)
    if layout == "family":
        check(out, q, k, v, scale, causal)
    else:  # MLX copies fragments into the slots by Apple10's layout
        assert (out.double() - attention(q, k, v, scale, causal)).abs().max() > 0.1


@pytest.mark.parametrize("family", ["apple10", "apple9"])
def test_torch_mpp_prefill_attention(headers, family):
    lib = compile_library(torch_mpp_source(headers["torch"]), name="Attention.metal", gpu_family=family)
    arch = "a10" if family == "apple10" else "a9"
    for dtype, name, head_dim, causal in ((torch.float16, "float16", 96, 1), (torch.bfloat16, "bfloat16", 64, 0)):
        q, k, v = qkv(dtype, 2, 100, 77, head_dim, head_dim)
        out = torch.zeros_like(q)
        scale = 1 / math.sqrt(head_dim)
        params = struct.pack("6iff", 1, 2, head_dim, 100, 77, 1, scale, 0.0) + b"".join(map(strides, (q, k, v, out)))
        kernel = f"prefill_attention_mpp_{arch}_{name}_bq64_bk32_bd{head_dim}_wm4_wn1_hm0_dc{causal}_mask{name}"
        no_mask = [struct.pack("4q", 0, 0, 0, 0), torch.zeros(1, dtype=dtype)]
        lib.dispatch(kernel, (2, 2, 1), (32, 4, 1), [q, k, v, out, params] + no_mask)
        check(out, q, k, v, scale, bool(causal))


def test_the_strict_check_finds_no_tensor_misuse_in_the_peers_kernels(headers):
    """torch's MPP attention passes the check whole; MLX's NAX attention breaks no tensor rule (its
    one violation is complex.h's constant bfloat expression, which the check cannot evaluate)."""
    clang, shim = strict_check.find_clang(), _metal_cpu.shim_dir()
    torch_result = strict_check.check_one(clang, shim, "Attention.metal", torch_mpp_source(headers["torch"]))
    assert torch_result.ok, torch_result.message
    mlx_result = strict_check.check_one(clang, shim, "steel_attention_nax.metal", mlx_nax_source(headers["mlx"]))
    assert mlx_result.violations and all("complex.h:" in v for v in mlx_result.violations), mlx_result.message
