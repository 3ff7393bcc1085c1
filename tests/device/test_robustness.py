"""Never trust, crash or hang: the kernel cache under planted, damaged and read-only
files, compiles and dispatches that hang or are interrupted, kernels that fault, many threads,
awkward tools and names.

Probes that would kill or hang the interpreter on a regression run in a subprocess, so a
regression is a failed test, not a dead test run. Tests that damage or plant caches use their own
temporary cache directories."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from flashattn_mps import metal_cpu
from flashattn_mps.metal_cpu import MetalCompileError, compile_library
from flashattn_mps.strict_check import find_clang

CLANG = find_clang()  # a clang for the tests that wrap the CPU device's compiler

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"
COPY = (
    HEADER
    + """
kernel void copy(device float *out [[buffer(0)]], device const float *in [[buffer(1)]],
                 uint tid [[thread_position_in_grid]]) { out[tid] = in[tid] + 1.0f; }
"""
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534


def unique(source: str) -> str:
    """The source under a fresh cache key (a comment), so no process has it loaded yet."""
    return f"// {uuid.uuid4().hex}\n" + source


def run_python(code: str, cache, timeout=240, env=None, **popen):
    """Runs code in a fresh interpreter with its own kernel cache; returns the CompletedProcess."""
    environment = dict(os.environ, FLASHATTN_MPS_CACHE=str(cache), PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def check_copy(lib):
    x = torch.arange(32, dtype=torch.float32)
    out = torch.zeros(32)
    lib.dispatch("copy", (1,), (32,), [out, x])
    assert torch.equal(out, x + 1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private kernel cache for this test (the C side reads the variable at every call)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("FLASHATTN_MPS_CACHE", str(path))
    return path


def replace_file(path, data: bytes):
    """Gives path new contents as a new file: this process has the old one mapped (loaded)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cache_entries(cache):
    return sorted(p for p in os.listdir(cache) if p.endswith(".so"))


# --- 1. cache security -----------------------------------------------------------------------


def test_cache_is_created_private_and_foreign_or_shared_folders_are_refused(cache, tmp_path):
    check_copy(compile_library(unique(COPY)))
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    for so in cache_entries(cache):
        assert stat.S_IMODE(os.stat(cache / so).st_mode) & 0o077 == 0
    os.chmod(cache, 0o770)
    with pytest.raises(MetalCompileError, match=rf"{cache}.*group-writable \(mode 770\)"):
        compile_library(unique(COPY))
    os.chmod(cache, 0o700)
    link = tmp_path / "link"
    os.symlink(cache, link)
    os.environ["FLASHATTN_MPS_CACHE"] = str(link)
    with pytest.raises(MetalCompileError, match=rf"{link}.*symbolic link"):
        compile_library(unique(COPY))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, NOBODY, NOBODY)
    else:
        foreign = "/"  # root's
    os.environ["FLASHATTN_MPS_CACHE"] = str(foreign)
    with pytest.raises(MetalCompileError, match=r"owned by uid \d+, not by the current user"):
        compile_library(unique(COPY))


@pytest.mark.slow
def test_planted_or_swapped_cache_entries_are_never_loaded(cache):
    source_a, source_b = unique(COPY), unique(COPY.replace("+ 1.0f", "+ 2.0f"))
    check_copy(compile_library(source_a))
    first = set(cache_entries(cache))
    compile_library(source_b)
    (key_b,) = set(cache_entries(cache)) - first
    (key_a,) = first
    key_a, key_b = key_a[:-3], key_b[:-3]
    # a library (and its manifest) copied under another key: rebuilt, never used
    for ext in (".so", ".sum"):
        if (cache / f"{key_b}{ext}").exists():
            replace_file(cache / f"{key_a}{ext}", (cache / f"{key_b}{ext}").read_bytes())
    code = f"""
    import torch
    from flashattn_mps.metal_cpu import compile_library
    lib = compile_library(open({str(cache / "a.metal")!r}).read())
    x = torch.arange(32, dtype=torch.float32); out = torch.zeros(32)
    lib.dispatch("copy", (1,), (32,), [out, x])
    print(torch.equal(out, x + 1))
    """
    (cache / "a.metal").write_text(source_a)
    result = run_python(code, cache)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    # a symbolic link, or a file others may write, in place of a library: refused, never followed
    so = cache / f"{key_a}.so"
    so.unlink()
    os.symlink(cache / f"{key_b}.so", so)
    result = run_python(code, cache)
    assert result.returncode == 1 and "symbolic link" in result.stderr and str(so) in result.stderr
    so.unlink()
    so.write_bytes((cache / f"{key_b}.so").read_bytes())
    os.chmod(so, 0o777)
    result = run_python(code, cache)
    assert result.returncode == 1 and "world-writable (mode 777)" in result.stderr, result.stderr


def test_planted_shim_headers_are_replaced(cache):
    check_copy(compile_library(unique(COPY)))
    (shim,) = [d for d in os.listdir(cache) if d.startswith("shim-")]
    header = cache / shim / "msl_shim.h"
    text = header.read_text()
    header.write_text(text + '\n#error "planted header"\n')
    check_copy(compile_library(unique(COPY)))
    assert header.read_text() == text
    extra = cache / shim / "include" / "planted"
    extra.write_text("")
    check_copy(compile_library(unique(COPY)))
    assert not extra.exists()


# --- 2. a damaged library is rebuilt ---------------------------------------------------------


@pytest.mark.slow
def test_truncated_library_is_rebuilt_not_loaded(cache):
    source = unique(COPY)
    compile_library(source)
    (so,) = cache_entries(cache)
    data = (cache / so).read_bytes()
    size = len(data)
    replace_file(cache / so, data[: size // 3])  # dlopen of this dies of SIGBUS
    (cache / "k.metal").write_text(source)
    result = run_python(
        f"""
    import torch
    from flashattn_mps.metal_cpu import compile_library
    lib = compile_library(open({str(cache / "k.metal")!r}).read())
    x = torch.arange(32, dtype=torch.float32); out = torch.zeros(32)
    lib.dispatch("copy", (1,), (32,), [out, x])
    print(torch.equal(out, x + 1))
    """,
        cache,
    )
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    assert os.path.getsize(cache / so) == size


# --- 3. a read-only but complete cache -------------------------------------------------------


@pytest.mark.slow
def test_read_only_cache_is_usable(cache):
    cached, fresh = unique(COPY), unique(COPY)
    compile_library(cached)
    (cache / "cached.metal").write_text(cached)
    (cache / "fresh.metal").write_text(fresh)
    code = f"""
    import torch
    from flashattn_mps.metal_cpu import compile_library
    for name in ("cached", "fresh"):  # in the cache; not in it (built in a private temporary directory)
        lib = compile_library(open({str(cache)!r} + "/" + name + ".metal").read())
        x = torch.arange(32, dtype=torch.float32); out = torch.zeros(32)
        lib.dispatch("copy", (1,), (32,), [out, x])
        print(name, torch.equal(out, x + 1))
    """
    before = sorted(os.listdir(cache))
    for base, _, _ in os.walk(cache):
        os.chmod(base, 0o500)
    try:
        if os.geteuid() == 0:  # root writes through permissions: a read-only bind mount instead
            mount = f"mount --bind -o ro '{cache}' '{cache}' && exec \"$0\" \"$@\""
            environment = dict(os.environ, FLASHATTN_MPS_CACHE=str(cache), PYTHONPATH=ROOT)
            result = subprocess.run(
                ["unshare", "-m", "sh", "-c", mount, sys.executable, "-c", textwrap.dedent(code)],
                env=environment,
                capture_output=True,
                text=True,
                timeout=240,
            )
        else:
            result = run_python(code, cache)
    finally:
        for base, _, _ in os.walk(cache):
            os.chmod(base, 0o700)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cached", "True", "fresh", "True"]
    assert sorted(os.listdir(cache)) == before


# --- 4. compile timeout, Ctrl-C, the watchdog --------------------------------------------------


def hanging_compiler(tmp_path, seconds=613):
    """A compiler that answers --version and then hangs (in a grandchild, as cc1plus would)."""
    script = tmp_path / "hanging c++"  # a space: the command is quoted
    script.write_text(f'#!/bin/sh\ncase " $* " in *" --version "*) exec {CLANG} --version;; esac\nsleep {seconds}\n')
    script.chmod(0o755)
    return f"'{script}'"


def sleepers(seconds):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", str(seconds).encode()]:
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_compile_times_out_and_kills_the_compiler(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHATTN_MPS_CXX", hanging_compiler(tmp_path, 611))
    monkeypatch.setenv("FLASHATTN_MPS_COMPILE_TIMEOUT", "1.5")
    result = run_python(
        f"""
    from flashattn_mps.metal_cpu import compile_library, MetalCompileError
    try:
        compile_library({unique(COPY)!r})
    except MetalCompileError as e:
        print(e)
    """,
        cache,
        timeout=60,
    )
    assert "ran longer than 1.5 s (FLASHATTN_MPS_COMPILE_TIMEOUT)" in result.stdout, result.stderr
    time.sleep(0.5)
    assert sleepers(611) == []


# Python's own Ctrl-C handler first: a shell that starts this suite in the background (no job
# control) passes SIGINT on as ignored, and Python then installs no handler of its own.
INTERRUPTED = """
import signal, sys, torch
signal.signal(signal.SIGINT, signal.default_int_handler)
from flashattn_mps.metal_cpu import compile_library
{setup}
print("ready", flush=True)
try:
    {call}
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""

SPIN = (
    HEADER
    + """
kernel void spin(device int *flag [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  volatile device int *f = flag;
  while (f[0] == 0) {}
}
kernel void spin_at_barrier(device int *flag [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  volatile device int *f = flag;
  while (f[0] == 0) { threadgroup_barrier(mem_flags::mem_none); }
}
"""
)


def interrupt(cache, setup, call, env=None):
    """Starts the script, sends SIGINT once it is busy in `call`, returns (stdout, seconds to exit)."""
    code = INTERRUPTED.format(setup=setup, call=call)
    environment = dict(os.environ, FLASHATTN_MPS_CACHE=str(cache), PYTHONPATH=ROOT, **(env or {}))
    p = subprocess.Popen(
        [sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, err = p.communicate(timeout=30)
        return out + err, time.monotonic() - start
    finally:
        p.kill()
        p.wait()


@pytest.mark.slow
def test_ctrl_c_interrupts_a_compile(cache, tmp_path):
    out, seconds = interrupt(
        cache, "", f"compile_library({unique(COPY)!r})", env={"FLASHATTN_MPS_CXX": hanging_compiler(tmp_path, 612)}
    )
    assert "KeyboardInterrupt" in out and seconds < 10, out
    time.sleep(0.5)
    assert sleepers(612) == []


@pytest.mark.parametrize("kernel,grid", [("spin", 1), ("spin_at_barrier", 4)])
@pytest.mark.slow
def test_ctrl_c_interrupts_a_dispatch(cache, kernel, grid):
    setup = f"lib = compile_library({SPIN!r}); flag = torch.zeros(1, dtype=torch.int32)"
    out, seconds = interrupt(cache, setup, f"lib.dispatch({kernel!r}, ({grid},), (64,), [flag])")
    assert "KeyboardInterrupt" in out and seconds < 10, out


@pytest.mark.slow
def test_watchdog_stops_a_dispatch_naming_the_kernel(cache):
    result = run_python(
        f"""
    import time, torch
    from flashattn_mps import metal_cpu
    lib = metal_cpu.compile_library({SPIN!r})
    flag = torch.zeros(1, dtype=torch.int32)
    assert metal_cpu.watchdog() == 0
    metal_cpu.set_watchdog(0.5)
    for kernel, grid in (("spin", 1), ("spin_at_barrier", 6)):
        start = time.monotonic()
        try:
            lib.dispatch(kernel, (grid,), (64,), [flag])
        except metal_cpu.MetalDispatchError as e:
            print(time.monotonic() - start < 5, e)
    flag[0] = 1
    metal_cpu.set_watchdog(0)
    lib.dispatch("spin", (8,), (64,), [flag])  # the device still works
    print("after", metal_cpu.watchdog())
    """,
        cache,
        timeout=120,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stderr
    for line, kernel in zip(lines, ("spin", "spin_at_barrier")):
        assert line.startswith(f"True kernel '{kernel}': stopped by the CPU Metal device's watchdog after"), line
        assert "set_watchdog" in line
    assert lines[2] == "after 0.0"
    with pytest.raises(ValueError, match="watchdog: seconds must be a number"):
        metal_cpu.set_watchdog(-1)
    result = run_python(
        "import torch\nfrom flashattn_mps import metal_cpu\nmetal_cpu.compile_library("
        f"{COPY!r}).dispatch('copy', (1,), (32,), [torch.zeros(32), torch.zeros(32)])",
        cache,
        env={"FLASHATTN_MPS_CPU_WATCHDOG": "soon"},
    )
    assert "FLASHATTN_MPS_CPU_WATCHDOG='soon': expected seconds >= 0" in result.stderr


# --- 5. kernel faults become errors ----------------------------------------------------------

FAULTS = (
    HEADER
    + """
int deep(int n, device int *out, thread int *caller) {
  int pad[32];
  pad[1] = n;
  if (caller) caller[1] += n;
  if (n == 0) return out[0];
  int r = deep(n - 1, out, pad);
  return r + pad[1];
}
kernel void out_of_bounds(device int *out [[buffer(0)]], constant long &index [[buffer(1)]],
                          uint group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (group == 5 && tid == 3) out[index] = 1;
}
kernel void recursion(device int *out [[buffer(0)]], constant int &depth [[buffer(1)]],
                      uint tid [[thread_position_in_grid]]) {
  out[tid] = deep(depth, out, nullptr);
}
kernel void large_frame(device float *out [[buffer(0)]], constant int &i [[buffer(1)]],
                        uint tid [[thread_position_in_grid]]) {
  volatile float big[1 << 20];  // 4 MiB on a 256 KiB fiber stack
  big[i] = 1.0f;
  out[tid] = big[i];
}
kernel void divide(device int *out [[buffer(0)]], device const int *in [[buffer(1)]],
                   uint tid [[thread_position_in_grid]]) {
  out[tid] = in[2 * tid] / in[2 * tid + 1];
  out[tid + 4] = in[2 * tid] % in[2 * tid + 1];
}
kernel void barrier_sum(device float *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                        uint group [[threadgroup_position_in_grid]]) {
  threadgroup float shared[64];
  shared[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[group * 64 + tid] = shared[63 - tid];
}
"""
)


@pytest.mark.slow
def test_kernel_faults_raise_and_the_device_survives(cache):
    result = run_python(
        f"""
    import struct, torch
    from flashattn_mps.metal_cpu import compile_library, MetalDispatchError
    lib = compile_library({FAULTS!r}, name="faults.metal")
    out = torch.zeros(256, dtype=torch.int32)
    def check():
        o = torch.zeros(8 * 64)
        lib.dispatch("barrier_sum", (8,), (64,), [o])
        assert torch.equal(o.view(8, 64), torch.arange(63, -1, -1.0).repeat(8, 1))
    for kernel, grid, arg in (("out_of_bounds", 8, struct.pack("q", 1 << 36)),
                              ("recursion", 1, struct.pack("i", 1 << 20)),
                              ("large_frame", 1, struct.pack("i", 0))):
        try:
            lib.dispatch(kernel, (grid,), (32,), [out, arg])
            print("no error")
        except MetalDispatchError as e:
            print(e)
        check()
    pairs = torch.tensor([7, 0, -2**31, -1, 9, 3, -8, 2], dtype=torch.int32)
    res = torch.zeros(8, dtype=torch.int32)
    lib.dispatch("divide", (1,), (4,), [res, pairs])
    print(res[1:4].tolist(), res[5:8].tolist())
    check()
    """,
        cache,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kernel 'out_of_bounds': invalid memory access (SIGSEGV) at address 0x"), lines[0]
    assert "in threadgroup (5,0,0), thread (3,0,0)" in lines[0]
    assert "after its sync point at faults.metal:14 (threadgroup_barrier)" in lines[0]
    for line, kernel in zip(lines[1:3], ("recursion", "large_frame")):
        assert line.startswith(f"kernel '{kernel}': stack overflow: the thread's 256 KiB fiber stack is exhausted"), (
            line
        )
    # as on a GPU: INT_MIN / -1 wraps, x / 0 is an unspecified value, no trap
    assert lines[3] == "[-2147483648, 3, -4] [0, 0, 0]"


# --- 6. bounded, released resources ----------------------------------------------------------

BUSY = (
    HEADER
    + """
kernel void touch_stack(device float *out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  volatile float a[24576];  // 96 KiB of each fiber's stack
  for (uint i = 0; i < 24576; i += 1024) a[i] = float(tid);
  out[tid] = a[(tid * 1024) % 24576];
}
"""
)


@pytest.mark.slow
def test_many_threads_share_a_bounded_set_of_fiber_stacks(cache):
    result = run_python(
        f"""
    import json, threading, torch
    from flashattn_mps.metal_cpu import compile_library
    lib = compile_library({BUSY!r})
    n, errors, dispatched, done = 48, [], threading.Semaphore(0), threading.Event()
    def body():
        try:
            lib.dispatch("touch_stack", (1,), (1024,), [torch.zeros(1024)])
        except Exception as e:
            errors.append(str(e))
        dispatched.release()
        done.wait()  # stays alive, as a server's threads do
    threads = [threading.Thread(target=body) for _ in range(n)]
    for t in threads: t.start()
    for _ in range(n): dispatched.acquire()
    maps = sum(1 for _ in open("/proc/self/maps"))
    done.set()
    for t in threads: t.join()
    print(json.dumps(dict(errors=errors[:2], maps=maps)))
    """,
        cache,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)
    assert measured["errors"] == [] and measured["maps"] < 40000, measured


@pytest.mark.slow
def test_touched_stack_pages_are_returned(cache):
    result = run_python(
        f"""
    import time, torch
    from flashattn_mps.metal_cpu import compile_library
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) // 1024
    lib = compile_library({BUSY!r})
    lib.dispatch("touch_stack", (1,), (1024,), [torch.zeros(1024)])
    busy = rss()
    time.sleep(3)
    print(busy, rss())
    """,
        cache,
    )
    assert result.returncode == 0, result.stderr
    busy, idle = map(int, result.stdout.split())
    assert busy - idle > 60, (busy, idle)  # about 96 MiB of stack pages go back


@pytest.mark.slow
def test_threadgroup_size_overflow_is_refused(cache):
    result = run_python(
        f"""
    import torch
    from flashattn_mps.metal_cpu import compile_library
    lib = compile_library({COPY!r})
    try:  # past the Python checks, straight to the C device
        lib._handle.dispatch("copy", (1, 1, 1), (1 << 22, 1 << 21, 1 << 21), [0, 0], [], [])
    except ValueError as e:
        print(e)
    """,
        cache,
    )
    assert result.returncode == 0, result.stderr
    assert "threadgroup 4194304 x 2097152 x 2097152 overflows 64 bits; at most 1024 threads" in result.stdout


# --- 7. tooling ----------------------------------------------------------------------------


def test_compiler_command_with_arguments(cache, monkeypatch):
    monkeypatch.setenv("FLASHATTN_MPS_CXX", f"env LC_ALL=C {CLANG}")  # like "ccache clang++"
    check_copy(compile_library(unique(COPY)))
    monkeypatch.setenv("FLASHATTN_MPS_CXX", "'c++")
    with pytest.raises(ValueError, match=r"compiler command ''c\+\+' \(FLASHATTN_MPS_CXX\) has an unterminated '"):
        compile_library(unique(COPY))


@pytest.mark.parametrize("name", ["stderr.txt", "preprocessed.ii"])
def test_source_names_never_collide_with_build_files(cache, name):
    lib = compile_library(unique(COPY), name=name)
    check_copy(lib)


# --- 8. messages -----------------------------------------------------------------------------


def test_full_disk_reports_the_compilers_own_message(cache, tmp_path, monkeypatch):
    # The compiler's files can no longer grow (as on a full disk); its messages must still arrive.
    script = tmp_path / "full-disk-c++"
    script.write_text(
        '#!/bin/sh\ncase " $* " in *" -shared "*) ulimit -f 0; trap "" XFSZ;; esac\nexec ' + CLANG + ' "$@"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("FLASHATTN_MPS_CXX", str(script))
    with pytest.raises(MetalCompileError) as info:
        compile_library(unique(COPY))
    # the write fails (EFBIG), or clang's driver reports its job stopped by SIGXFSZ
    assert "File too large" in str(info.value) or "File size limit exceeded" in str(info.value), str(info.value)


def test_messages_name_the_kernel_once(cache):
    lib = compile_library(
        unique(
            HEADER
            + """
kernel void needs_two(device float *a [[buffer(0)]], device float *b [[buffer(1)]],
                      uint tid [[thread_position_in_grid]]) { b[tid] = a[tid]; }
"""
        )
    )
    with pytest.raises(ValueError) as info:
        lib.dispatch("needs_two", (1,), (32,), [torch.zeros(32)])
    message = str(info.value)
    assert message.count("needs_two") == 1 and "[[buffer(1)]] is not bound (1 buffers given)" in message, message


@pytest.mark.parametrize("pad", ["", "a"])
def test_a_message_cut_to_fit_stays_valid_utf8(pad):
    # The 8 KiB status message is cut wherever the text reaches it; a cut inside a multi-byte
    # character (compiler quotes, non-ASCII file names) must not make the message undecodable.
    name = pad + "é" * 4200 + ".metal"
    with pytest.raises(MetalCompileError) as caught:
        metal_cpu.compile_library("kernel void k(device float *o [[buffer(0)]]) { o[0] = nope; }", name=name)
    message = str(caught.value)
    assert message.startswith(pad + "éé") and message.endswith("é")
