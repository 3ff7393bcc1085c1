"""Lockstep on the CPU Metal device (docs/cpu-device.md, "Lockstep"): the lanes of a SIMD-group take their
threadgroup-memory accesses in step, as kernels need that exchange values through threadgroup
memory between lanes with no simdgroup_barrier, relying on the GPU running a SIMD-group's lanes
together (llama.cpp's flash-attention kernels do)."""

import re
import time

import pytest
import torch

from flashattn_mps import metal_cpu as mc

SOURCE = r"""#include <metal_stdlib>
using namespace metal;
kernel void last_lane_writes(device float *out [[buffer(0)]], threadgroup float *cell [[threadgroup(0)]],
                             uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                             uint tid [[thread_index_in_threadgroup]]) {
    if (lane == 31) cell[sg] = 42.0f + sg;  // @last-write
    out[tid] = cell[sg];  // @last-read
}
kernel void read_then_write(device float *out [[buffer(0)]], threadgroup float *row [[threadgroup(0)]],
                            uint lane [[thread_index_in_simdgroup]]) {
    row[lane] = lane;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    float right = row[(lane + 1) % 32];
    row[lane] = 2.0f * right;  // every lane's read comes first
    simdgroup_barrier(mem_flags::mem_threadgroup);
    out[lane] = row[lane];
}
kernel void rotate(device float *out [[buffer(0)]], threadgroup float *row [[threadgroup(0)]],
                   uint lane [[thread_index_in_simdgroup]]) {
    row[lane] = lane;
    for (uint k = 0; k < lane / 64 + 9; k++) {  // in step: every lane reads, then every lane writes, 9 times
        float right = row[(lane + 1) % 32];
        row[lane] = right;
    }
    out[lane] = row[lane];
}
kernel void uneven_loops(device float *out [[buffer(0)]], threadgroup float *row [[threadgroup(0)]],
                         uint lane [[thread_index_in_simdgroup]]) {
    row[lane] = 0.0f;
    for (uint k = 0; k < lane % 4 + 1; k++) row[lane] += 1.0f;
    out[lane] = row[(lane + 1) % 32];  // after the neighbour's last iteration
}
// Between SIMD-groups only a threadgroup barrier orders: lockstep is per SIMD-group.
kernel void across_simdgroups(device float *out [[buffer(0)]], threadgroup float *cell [[threadgroup(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
    if (tid == 32) cell[0] = 1.0f;  // @across-write
    if (tid == 0) out[0] = cell[0];  // @across-read
}
// Lockstep around collectives in divergent flow and barriers: each SIMD-group's lanes 0 and 16
// publish their half's reduction, which its lanes read back, then the groups combine after a
// threadgroup barrier. (A collective in divergent flow releases its lanes before the other
// branch's reach theirs, so the simdgroup_barrier is needed even in lockstep: README.)
kernel void reduce(device float *out [[buffer(0)]], device const float *in [[buffer(1)]],
                   threadgroup float *partial [[threadgroup(0)]], uint lane [[thread_index_in_simdgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint tid [[thread_index_in_threadgroup]],
                   uint groups [[simdgroups_per_threadgroup]]) {
    float x = in[tid];
    if (lane < 16) x = simd_sum(x);  // the low half's sum, on the low half
    else x = simd_max(x);
    if (lane == 0) partial[2 * sg] = x;
    if (lane == 16) partial[2 * sg + 1] = x;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    float low = partial[2 * sg], high = partial[2 * sg + 1];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint g = 0; g < groups; g++) total += partial[2 * g] + partial[2 * g + 1];
    out[tid] = low + 10.0f * high + 100.0f * total;
}
kernel void spin(device float *out [[buffer(0)]], threadgroup float *row [[threadgroup(0)]],
                 device const int *stop [[buffer(1)]], uint lane [[thread_index_in_simdgroup]]) {
    volatile device const int *flag = stop;
    row[lane] = 0.0f;
    while (flag[0] == 0) row[lane] += 1.0f;
    out[lane] = row[lane];
}
"""


def at(tag):
    line = next(i for i, text in enumerate(SOURCE.splitlines(), 1) if text.endswith(f"// @{tag}"))
    return re.escape(f"lockstep.metal:{line}")


def lib(checked=False, lockstep=True):
    return mc.compile_library(SOURCE, name="lockstep.metal", checked=checked, lockstep=lockstep)


def run(kernel, threads, checked=False, lockstep=True, inputs=()):
    out = torch.zeros(threads)
    lib(checked, lockstep).dispatch(kernel, 1, threads, [out, *inputs], threadgroup_memory=[256])
    return out


LANE = torch.arange(32)
EXPECTED = {
    "last_lane_writes": (64, torch.tensor([42.0] * 32 + [43.0] * 32)),
    "read_then_write": (32, 2.0 * ((LANE + 1) % 32)),
    "rotate": (32, ((LANE + 9) % 32).float()),
    "uneven_loops": (32, (((LANE + 1) % 32) % 4 + 1).float()),
}


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("kernel", sorted(EXPECTED))
def test_lanes_run_in_step(kernel, checked):
    threads, expected = EXPECTED[kernel]
    out = run(kernel, threads, checked=checked)
    assert torch.equal(out, expected), out
    assert lib(checked).lockstep and lib(checked).checked == checked


@pytest.mark.parametrize("kernel", sorted(EXPECTED))
def test_without_lockstep_lanes_run_one_after_another(kernel):
    # The same kernels without lockstep: each lane runs up to its next sync point alone, so these
    # exchanges see a value too early or too late (and checked mode calls them races).
    threads, expected = EXPECTED[kernel]
    assert not torch.equal(run(kernel, threads, lockstep=False), expected)
    with pytest.raises(mc.MetalDispatchError, match="threadgroup memory data race"):
        run(kernel, threads, checked=True, lockstep=False)


def test_checked_lockstep_still_reports_races_between_simdgroups():
    with pytest.raises(mc.MetalDispatchError) as info:
        run("across_simdgroups", 64, checked=True)
    assert re.search(
        r"thread 32 \(32,0,0\) writes 4 bytes .* at " + at("across-write") + r"; thread 0 \(0,0,0\) read "
        r"them at " + at("across-read"),
        str(info.value),
    ), str(info.value)


def test_collectives_and_barriers_in_lockstep():
    x = torch.randn(96, generator=torch.Generator().manual_seed(1)).round()
    out = run("reduce", 96, checked=True, inputs=[x])
    groups = x.view(3, 32)
    low, high = groups[:, :16].sum(1), groups[:, 16:].amax(1)
    total = (low + high).sum()
    expected = (low + 10 * high + 100 * total).repeat_interleave(32)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-3)


def test_lockstep_argument_is_checked():
    with pytest.raises(TypeError, match="lockstep must be True or False"):
        mc.compile_library(SOURCE, name="lockstep.metal", lockstep=1)
    assert not mc.compile_library(SOURCE, name="lockstep.metal", checked=False).lockstep


def test_watchdog_stops_lanes_in_lockstep():
    stop = torch.zeros(1, dtype=torch.int32)
    mc.set_watchdog(0.5)
    try:
        start = time.monotonic()
        with pytest.raises(mc.MetalDispatchError, match="kernel 'spin'"):
            run("spin", 64, inputs=[stop])
        assert time.monotonic() - start < 10
    finally:
        mc.set_watchdog(0)
    stop[0] = 1
    assert torch.equal(run("spin", 64, inputs=[stop]), torch.zeros(64))  # the device still works
