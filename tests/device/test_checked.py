"""Checked mode of the CPU Metal device (docs/cpu-device.md, "Checked mode"): threadgroup-memory races,
uninitialised threadgroup reads and out-of-bounds accesses, each reported as MetalDispatchError
with both source lines and threads (the project's own kernels under it: kernels/test_checked_kernels.py)."""

import re
import shutil
import struct

import pytest
import torch

from flashattn_mps import metal_cpu as mc

SOURCE = r"""#include <metal_stdlib>
using namespace metal;
constant int ORDER [[function_constant(0)]];   // 1: simdgroup_barrier, 2: simd_sum, else nothing
constant uint PARTNER [[function_constant(1)]];
constant bool BARRIER [[function_constant(2)]];
kernel void neighbours(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                       uint n [[threads_per_threadgroup]]) {
    threadgroup float tile[128];
    tile[tid] = float(tid);  // @neighbours-write
    if (BARRIER) threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = tile[(tid + 1) % n];  // @neighbours-read
}
kernel void overwrite(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float cell[1];
    if (tid == 0) cell[0] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = cell[0];  // @overwrite-read
    if (tid == 40) cell[0] = 2.0f;  // @overwrite-write
}
kernel void uninitialised(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                          uint group [[threadgroup_position_in_grid]]) {
    threadgroup float tile[64];
    if (tid < 32 || group == 0) tile[tid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[group * 64 + tid] = tile[tid];  // @uninitialised-read
}
kernel void shifted(device float *out [[buffer(0)]], device const float *in [[buffer(1)]],
                    constant int &shift [[buffer(2)]], uint tid [[thread_position_in_grid]]) {
    out[int(tid) + shift] = 2.0f * in[tid];  // @shifted
}
kernel void gather(device float *out [[buffer(0)]], device const float *in [[buffer(1)]],
                   constant int &shift [[buffer(2)]], uint tid [[thread_position_in_grid]]) {
    float x = in[int(tid) + shift];  // @gather
    out[tid] = x;
}
kernel void lanes(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float tile[64];
    tile[tid] = float(tid);  // @lanes-write
    if (ORDER == 1) simdgroup_barrier(mem_flags::mem_threadgroup);
    if (ORDER == 2) out[tid] = simd_sum(1.0f);
    out[tid] = tile[tid ^ PARTNER];  // @lanes-read
}
kernel void argument(device float *out [[buffer(0)]], threadgroup float *scratch [[threadgroup(0)]],
                     uint tid [[thread_index_in_threadgroup]]) {
    scratch[tid] = 1.0f;  // @argument-write
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = scratch[tid];
}
kernel void count(device uint *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup atomic_uint counter[1];
    if (tid == 0) atomic_store_explicit(&counter[0], 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&counter[0], 1u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) out[0] = atomic_load_explicit(&counter[0], memory_order_relaxed);
}
"""


def at(tag):
    """checked.metal:N, the line of SOURCE marked `// @tag`."""
    line = next(i for i, text in enumerate(SOURCE.splitlines(), 1) if text.endswith(f"// @{tag}"))
    return re.escape(f"checked.metal:{line}")


def lib(checked=True):
    return mc.compile_library(SOURCE, name="checked.metal", checked=checked)


def run(kernel, grid, group, buffers, checked=True, order=0, partner=1, barrier=False, **options):
    lib(checked).dispatch(kernel, grid, group, buffers, constants={0: order, 1: partner, 2: barrier}, **options)


def int_bytes(value):
    return struct.pack("i", value)


def test_planted_race_reports_both_lines_and_threads():
    with pytest.raises(mc.MetalDispatchError) as info:
        run("neighbours", 1, 64, [torch.zeros(64)])  # no barrier between the write and the neighbour's read
    message = str(info.value)
    # Thread 0 runs first: its read of tile[1] comes before thread 1 writes it, a read-then-write race.
    assert re.search(
        r"kernel 'neighbours': threadgroup memory data race in threadgroup \(0,0,0\): thread 1 \(1,0,0\) "
        r"writes 4 bytes at byte 4 of kernel-scope threadgroup array #1 at "
        + at("neighbours-write")
        + r"; thread 0 \(0,0,0\) read them at "
        + at("neighbours-read"),
        message,
    ), message


def test_the_barrier_fixes_the_race_and_results_come_back():
    out = torch.zeros(64)
    run("neighbours", 1, 64, [out], barrier=True)
    assert torch.equal(out, (torch.arange(64) + 1.0) % 64)
    assert lib().checked and not lib(checked=False).checked


def test_unchecked_library_does_not_look():
    run("neighbours", 1, 64, [torch.zeros(64)], checked=False)  # racy, yet nothing says so


def test_write_after_another_threads_read():
    with pytest.raises(mc.MetalDispatchError) as info:
        run("overwrite", 1, 64, [torch.zeros(64)])
    assert re.search(
        r"thread 40 \(40,0,0\) writes 4 bytes at byte 0 of kernel-scope threadgroup array #1 at "
        + at("overwrite-write")
        + r"; thread \d+ \(\d+,0,0\) read them at "
        + at("overwrite-read"),
        str(info.value),
    ), str(info.value)


@pytest.mark.parametrize(
    "order, partner, racy",
    [
        (1, 1, False),  # simdgroup_barrier orders the lanes of one SIMD-group
        (1, 32, True),  # ... not lanes of different SIMD-groups
        (2, 1, True),  # a SIMD collective exchanges values, not memory: it orders nothing
        (0, 1, True),
    ],
)
def test_simdgroup_ordering(order, partner, racy):
    if not racy:
        run("lanes", 1, 64, [torch.zeros(64)], order=order, partner=partner)
        return
    with pytest.raises(mc.MetalDispatchError) as info:
        run("lanes", 1, 64, [torch.zeros(64)], order=order, partner=partner)
    assert re.search(
        "data race.*"
        + at("lanes-write")
        + ".*"
        + at("lanes-read")
        + "|data race.*"
        + at("lanes-read")
        + ".*"
        + at("lanes-write"),
        str(info.value),
    ), str(info.value)


def test_uninitialised_read_names_threadgroup_thread_and_line():
    with pytest.raises(mc.MetalDispatchError) as info:
        run("uninitialised", 2, 64, [torch.zeros(128)])  # threadgroup 0 writes all of tile, threadgroup 1 half
    message = str(info.value)
    found = re.search(
        r"never written in this threadgroup: thread (\d+) \((\d+),0,0\) of threadgroup \(1,0,0\) "
        r"reads 4 bytes at byte (\d+) of kernel-scope threadgroup array #1 \(256 bytes\) at "
        + at("uninitialised-read"),
        message,
    )
    assert found, message
    thread, x, byte = map(int, found.groups())
    assert thread == x and 32 <= thread < 64 and byte == 4 * thread


@pytest.mark.parametrize("shift", [1, -1])
def test_out_of_bounds_write(shift):
    base = torch.zeros(80)
    out = torch.zeros(64) if shift > 0 else base[8:72]  # the view is bound from element 8 on: 288 bytes
    with pytest.raises(mc.MetalDispatchError) as info:
        run("shifted", 1, 64, [out, torch.arange(64.0), int_bytes(shift)])
    thread, offset, bound = (63, 256, 256) if shift > 0 else (0, -4, 288)
    assert re.search(
        rf"out-of-bounds access: thread {thread} \({thread},0,0\) of threadgroup \(0,0,0\) writes 4 "
        rf"bytes at byte offset {offset} of \[\[buffer\(0\)\]\], which has {bound} bytes, at " + at("shifted"),
        str(info.value),
    ), str(info.value)
    assert base.eq(0).all()  # base[7] was never written


@pytest.mark.parametrize(
    "symbolizer",
    [
        pytest.param(name, marks=pytest.mark.skipif(shutil.which(name) is None, reason=f"no {name} here"))
        for name in ("addr2line", "llvm-symbolizer", "atos")
    ],
)
def test_each_symbolizer_names_the_line(monkeypatch, symbolizer):
    # macOS has no addr2line by default: llvm-symbolizer where installed, else atos, read the line tables
    monkeypatch.setenv("FLASHATTN_MPS_SYMBOLIZER", symbolizer)
    with pytest.raises(mc.MetalDispatchError, match=at("shifted")):
        run("shifted", 1, 64, [torch.zeros(64), torch.arange(64.0), int_bytes(1)])


def test_without_a_symbolizer_the_report_says_so(monkeypatch):
    monkeypatch.setenv("FLASHATTN_MPS_SYMBOLIZER", "no-such-symbolizer")
    with pytest.raises(mc.MetalDispatchError, match=r"no line: no symbolizer could tell; tried no-such-symbolizer"):
        run("shifted", 1, 64, [torch.zeros(64), torch.arange(64.0), int_bytes(1)])


def test_in_bounds_writes_land_in_the_bound_view():
    base = torch.zeros(80)
    run("shifted", 1, 64, [base[8:72], torch.arange(64.0), int_bytes(1)])
    assert torch.equal(base[9:73], 2.0 * torch.arange(64.0)) and base[:9].eq(0).all() and base[73:].eq(0).all()


def test_out_of_bounds_read_far_away():
    with pytest.raises(mc.MetalDispatchError) as info:
        run("gather", 1, 64, [torch.zeros(64), torch.zeros(64), int_bytes(1000000)])
    assert re.search(
        r"thread 0 \(0,0,0\) of threadgroup \(0,0,0\) reads 4 bytes at byte offset 4000000 of "
        r"\[\[buffer\(1\)\]\], which has 256 bytes, at " + at("gather"),
        str(info.value),
    ), str(info.value)


def test_out_of_bounds_of_set_bytes():
    # buffer(1) holds 4 bytes (setBytes); reading it from index 1 on runs past them
    with pytest.raises(
        mc.MetalDispatchError,
        match=r"reads 4 bytes at byte offset 4 of \[\[buffer\(1\)\]\], which "
        r"has 4 bytes",
    ):
        run("gather", 1, 2, [torch.zeros(2), int_bytes(7), int_bytes(0)])


def test_threadgroup_argument_bounds():
    run("argument", 1, 16, [torch.zeros(16)], threadgroup_memory=[64])
    with pytest.raises(mc.MetalDispatchError) as info:
        run("argument", 1, 16, [torch.zeros(16)], threadgroup_memory=[32])
    assert re.search(
        r"thread 8 \(8,0,0\) of threadgroup \(0,0,0\) writes 4 bytes at byte offset 32 of "
        r"\[\[threadgroup\(0\)\]\], which has 32 bytes, at " + at("argument-write"),
        str(info.value),
    ), str(info.value)


def test_threadgroup_atomics_do_not_race():
    out = torch.zeros(1, dtype=torch.int32)
    run("count", 1, 96, [out])
    assert out.item() == 96


def test_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv("FLASHATTN_MPS_CPU_CHECKED", "1")
    mc.set_checked(None)  # read the environment again
    assert mc.checked()
    assert mc.compile_library(SOURCE, name="checked.metal").checked
    monkeypatch.setenv("FLASHATTN_MPS_CPU_CHECKED", "0")
    mc.set_checked(None)
    assert not mc.checked()
    mc.set_checked(True)  # a setting wins over the environment
    assert mc.checked()
    monkeypatch.setenv("FLASHATTN_MPS_CPU_CHECKED", "yes")
    mc.set_checked(None)
    with pytest.raises(ValueError, match="FLASHATTN_MPS_CPU_CHECKED='yes': expected 0 or 1"):
        mc.checked()
    with pytest.raises(ValueError, match="FLASHATTN_MPS_CPU_CHECKED='yes'"):
        mc.compile_library("kernel void k() {}")
    monkeypatch.delenv("FLASHATTN_MPS_CPU_CHECKED")
    mc.set_checked(None)
