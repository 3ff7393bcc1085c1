"""What each kernel library holds: only the planned element type's kernels (FA_DTYPE), each carrying
[[max_total_threads_per_threadgroup(N)]] with N the threads the planner dispatches, and the strict
check's enumeration of specialisations equal to what the planner can emit."""

from __future__ import annotations

import re

import pytest
import torch

from flashattn_mps import _C, _sources, explain_plan, metal_cpu
from helpers import DEFINITION, preprocessed

KERNEL_TYPES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
PADDED_HEAD_DIMS = [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
BACKWARD_DELTA_THREADS = 32 * 4  # FA_BACKWARD_DELTA_ROWS SIMD-groups (fa_plan_backward.c)

# The kernels each source instantiates, by host name without the "_<type>" suffix (every library
# also holds the sequence-table kernel of metal/fa_sequence.h).
SOURCE_KERNELS = {
    "fa_simple.metal": {"fa_simple", "fa_sequence_table"},
    "fa_forward.metal": {"fa_forward", "fa_forward_mask_blocks", "fa_sequence_table"},
    "fa_forward_tensor.metal": {"fa_forward_tensor", "fa_sequence_table"},
    "fa_decode.metal": {"fa_decode", "fa_decode_merge", "fa_sequence_table"},
    "fa_backward.metal": {
        "fa_backward_delta",
        "fa_backward_mask_blocks",
        "fa_backward_dkdv",
        "fa_backward_dq",
        "fa_sequence_table",
    },
    "fa_backward_tensor.metal": {"fa_backward_tensor_dkdv", "fa_backward_tensor_dq"},
}


def plan(dtype, hq=4, hkv=2, lq=1, lk=64, e=64, ev=None, kernel="auto", gpu=None, backward=False):
    ev = e if ev is None else ev
    q = torch.empty(1, hq, lq, e, dtype=dtype)
    k = torch.empty(1, 1, 1, e, dtype=dtype).expand(1, hkv, lk, e)  # planning reads no element
    v = torch.empty(1, 1, 1, ev, dtype=dtype).expand(1, hkv, lk, ev)
    return explain_plan(q, k, v, kernel=kernel, gpu=gpu, backward=backward)


def tensor_backward_dispatches(dtype, **kwargs):
    """The tensor backward's dispatches (its delta pre-pass is the simdgroup library's)."""
    p = plan(dtype, kernel="tensor", backward=True, **kwargs)
    return [d for d in p["dispatches"] if d["source"] == "fa_backward_tensor.metal"]


# One plan per kernel family and dtype: 128 and 256 in 2-byte types are where float kernels would
# pass 32 KiB of threadgroup memory; lk = 4096 splits the decode (a merge dispatch).
CASES = [
    (dtype, kwargs)
    for dtype in KERNEL_TYPES
    for kwargs in (
        dict(lq=40, e=128, kernel="forward"),
        dict(lq=40, e=256, ev=160, kernel="forward"),
        dict(lq=3, e=80, lk=4096, kernel="decode"),
        dict(lq=5, e=24, kernel="simple"),
    )
]
# The tensor path (fp16 and bf16 only): its forward and its backward.
TENSOR_CASES = [
    (torch.float16, dict(lq=40, e=128, kernel="tensor")),
    (torch.bfloat16, dict(lq=40, e=80, kernel="tensor")),
]


def libraries(dtype, kwargs):
    """(source, macros, {function: threads}) of every library the plan compiles, the backward's with
    the forward's specialisation included."""
    result = []
    for d in plan(dtype, **kwargs)["dispatches"]:
        source = d["source"]
        threads = {d["function"]: d["threadgroup"][0]}
        entry = next((r for r in result if r[0] == source), None)
        if entry is None:
            result.append((source, d["macros"], threads))
        else:
            entry[2].update(threads)
        if source == "fa_forward.metal":
            t = KERNEL_TYPES[dtype]
            result.append(
                (
                    "fa_backward.metal",
                    d["macros"],
                    {
                        f"fa_backward_delta_{t}": BACKWARD_DELTA_THREADS,
                        f"fa_backward_dkdv_{t}": d["threadgroup"][0],
                        f"fa_backward_dq_{t}": d["threadgroup"][0],
                    },
                )
            )
    if kwargs.get("kernel") == "tensor":
        backward = tensor_backward_dispatches(dtype, **{k: v for k, v in kwargs.items() if k != "kernel"})
        result.append(
            (backward[0]["source"], backward[0]["macros"], {d["function"]: d["threadgroup"][0] for d in backward})
        )
    return result


@pytest.mark.parametrize("dtype,kwargs", CASES + TENSOR_CASES)
def test_a_library_holds_only_the_planned_dtypes_kernels(dtype, kwargs):
    sources = _sources.kernel_sources()
    for source, macros, threads in libraries(dtype, kwargs):
        lib = metal_cpu.compile_library(sources[source], macros, name=source)
        expected = {f"{kernel}_{KERNEL_TYPES[dtype]}" for kernel in SOURCE_KERNELS[source]}
        assert set(lib.kernels) == expected, source
        assert set(threads) <= expected


INSTANTIATION = re.compile(
    r'template\s*\[\[host_name\(((?:\s*"[^"]*")+)\s*\)\]\]\s*\[\[kernel\]\]\s*'
    r"decltype\((\w+)<([^>]*)>\)"
)


def declared_threads(text: str) -> dict:
    """{host name: N of its kernel template's max_total_threads_per_threadgroup(N)}, N evaluated with
    the instantiation's template arguments."""
    templates = {name: (params, expr) for params, expr, name in DEFINITION.findall(text)}
    declared = {}
    for literals, function, args in INSTANTIATION.findall(text):
        host = "".join(re.findall(r'"([^"]*)"', literals))
        params, expr = templates[function]
        names = [p.split()[-1] for p in params.split(",")]
        values = [a.strip() for a in args.split(",")]
        env = {n: int(v) for n, v in zip(names, values) if re.fullmatch(r"-?\d+", v)}
        declared[host] = eval(expr, {"__builtins__": {}}, env)
    return declared


@pytest.mark.parametrize("dtype,kwargs", CASES[:4] + CASES[-2:] + TENSOR_CASES)
def test_every_kernel_declares_the_threads_it_is_dispatched_with(dtype, kwargs):
    for source, macros, threads in libraries(dtype, kwargs):
        declared = declared_threads(preprocessed(source, macros))
        assert set(declared) == {f"{k}_{KERNEL_TYPES[dtype]}" for k in SOURCE_KERNELS[source]}, source
        for function, n in threads.items():
            assert declared[function] == n, f"{function}: declares {declared[function]}, dispatched with {n}"


def reachable_specialisations():
    """(source, macros) of every library a sampled set of calls reaching each table entry plans."""
    keys = set()

    def add(p):
        for d in p["dispatches"]:
            keys.add((d["source"], tuple(sorted(d["macros"].items()))))
            if d["source"] == "fa_forward.metal":
                keys.add(("fa_backward.metal", tuple(sorted(d["macros"].items()))))

    for dtype in KERNEL_TYPES:
        add(plan(dtype, lq=9, kernel="simple"))
        for gpu in ("apple7", "apple9"):  # Apple8 and Apple10 take the same tiles (csrc/fa_gpu_family.c)
            for e in PADDED_HEAD_DIMS:
                for ev in PADDED_HEAD_DIMS:
                    add(plan(dtype, lq=9, e=e, ev=ev, kernel="forward", gpu=gpu))
        if dtype != torch.float32:  # the tensor path's widths (fp16 and bf16 only)
            for e in (64, 96, 128):
                add(plan(dtype, lq=9, e=e, kernel="tensor"))
                add({"dispatches": tensor_backward_dispatches(dtype, lq=9, e=e)})
        for e in range(32, 577, 32):  # head dims to 576: 12, 16 and 20 columns per lane
            for rows in (1, 2, 4, 8, 16):  # rows sharing a kv head: the GQA factor times L
                add(plan(dtype, hq=rows, hkv=1, lq=1, e=e, kernel="decode"))
    return keys


def test_the_enumeration_is_exactly_what_the_planner_emits():
    enumerated = [(source, tuple(sorted(macros))) for source, _, macros in _C.specialisations()]
    assert len(set(enumerated)) == len(enumerated), "a specialisation is visited twice"
    assert set(enumerated) == reachable_specialisations()
    for source, function, macros in _C.specialisations():
        dtype = dict(macros)["FA_DTYPE"]
        assert function.endswith("_" + dtype) and function.rsplit("_", 1)[0] in SOURCE_KERNELS[source]
