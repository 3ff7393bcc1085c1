"""The CPU Metal device, for tests and experiments: compile MSL source, dispatch its kernels on CPU
tensors with Metal's execution model. The same runtime the C core uses for CPU tensors.

    lib = compile_library(source, macros={"N": 64})
    lib.dispatch("my_kernel", grid=(4, 1, 1), threadgroup=(128, 1, 1), buffers=[x, y, struct.pack("I", n)])

`grid` counts threadgroups (as `dispatchThreadgroups`); `buffers[i]` binds `[[buffer(i)]]` and is a
CPU tensor (device memory, written in place, its storage offset honoured) or bytes (`setBytes`);
`threadgroup_memory[i]` is the byte length of `[[threadgroup(i)]]`; `constants` maps
function-constant indices (0..65535, as in Metal) to bool, int or float values.

Checked mode (`compile_library(..., checked=True)`, or for every library including the project's own
kernels `set_checked(True)` / FLASHATTN_MPS_CPU_CHECKED=1) runs kernels instrumented: a dispatch
raises MetalDispatchError naming the kernel, both source lines and both threads for a
threadgroup-memory data race, a read of threadgroup memory never written in the threadgroup, or an
access outside the bound buffers or the threadgroup memory (docs/cpu-device.md, "Checked mode").

Lockstep (`compile_library(..., lockstep=True)`) runs the lanes of each SIMD-group through their
threadgroup-memory accesses in step, as an Apple GPU issues each instruction for all active lanes
at once: for kernels that rely on that without a simdgroup_barrier between one lane's write and
another lane's read (llama.cpp's do), which otherwise see the other lane's value too early or too
late. Metal does not promise lockstep: a checked library without it reports such code as a race;
with both, only races between SIMD-groups are reported (docs/cpu-device.md, "Lockstep").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Optional, Union

import torch

from . import _metal_cpu as _device

MetalCompileError = _device.MetalCompileError
MetalDispatchError = _device.MetalDispatchError
MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_MEMORY = _device.MAX_THREADGROUP_MEMORY


def _size3(name: str, value) -> tuple:
    """An MTLSize: 1 to 3 positive ints (missing dims are 1)."""
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"{name} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 1 or d >= 2**32 for d in dims):
        raise ValueError(f"{name} dimensions must be in 1..2^32-1, got {value!r}")
    return dims + (1,) * (3 - len(dims))


def _constant(index, value) -> tuple:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise TypeError(f"constants: keys are function-constant indices (ints >= 0), got {index!r}")
    if isinstance(value, bool):
        return (index, _device.CONSTANT_BOOL, int(value), 0.0)
    if isinstance(value, int):
        return (index, _device.CONSTANT_INT, value, 0.0)
    if isinstance(value, float):
        return (index, _device.CONSTANT_FLOAT, 0, value)
    raise TypeError(f"constants[{index}] must be a bool, int or float, got {type(value).__name__}")


_UNKNOWN_LENGTH = 2**64 - 1


def _buffer(index: int, value) -> tuple:
    """What binds buffers[index]: (address or bytes, the bytes bound from there on)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return data, len(data)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"buffers[{index}] must be a CPU torch.Tensor or bytes, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"buffers[{index}] is on {value.device}; the CPU Metal device takes CPU tensors")
    # Address of element 0 (the storage offset applied, as setBuffer:offset:) and what the storage
    # holds from there, which checked mode bounds the kernel's accesses by.
    storage = value.untyped_storage()
    return value.data_ptr(), storage.data_ptr() + storage.nbytes() - value.data_ptr()


class Library:
    """A compiled MSL library (like MTLLibrary). Create with `compile_library`."""

    def __init__(self, handle, source_name: str, checked: bool, lockstep: bool):
        self._handle = handle
        self.source_name = source_name
        self.checked = checked
        self.lockstep = lockstep
        self.kernels = tuple(handle.kernels())

    def dispatch(
        self,
        kernel: str,
        grid,
        threadgroup,
        buffers: Sequence[Union[torch.Tensor, bytes]],
        threadgroup_memory: Sequence[int] = (),
        constants: Optional[Mapping[int, Union[bool, int, float]]] = None,
    ) -> None:
        """Run `kernel` on grid x threadgroup threads and wait for it (like dispatchThreadgroups
        followed by waitUntilCompleted). SIMD-group functions in divergent control flow act on the
        active lanes, as in MSL. Raises MetalDispatchError on a divergent threadgroup barrier or
        simdgroup_barrier, a deadlock or a kernel failure (an invalid memory access, a stack overflow),
        or when the watchdog (`set_watchdog`) stops it, naming the kernel, source line and threads.
        A checked library's dispatch also raises it for what checked mode finds (module docstring).
        Ctrl-C stops it with KeyboardInterrupt."""
        if kernel not in self.kernels:
            raise ValueError(f"kernel {kernel!r} is not in this library; it has {list(self.kernels)}")
        grid3 = _size3("grid", grid)
        group3 = _size3("threadgroup", threadgroup)
        threads = group3[0] * group3[1] * group3[2]
        if threads > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"threadgroup {group3} has {threads} threads; at most {MAX_THREADS_PER_THREADGROUP} are allowed"
            )
        bound, bound_lengths = zip(*[_buffer(i, b) for i, b in enumerate(buffers)]) if buffers else ((), ())
        lengths = []
        for i, n in enumerate(threadgroup_memory):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise TypeError(f"threadgroup_memory[{i}] must be a byte count (int >= 0), got {n!r}")
            lengths.append(n)
        if sum(lengths) > MAX_THREADGROUP_MEMORY:
            raise ValueError(
                f"threadgroup_memory {tuple(lengths)} totals {sum(lengths)} bytes; Apple GPUs allow "
                f"{MAX_THREADGROUP_MEMORY}"
            )
        values = [_constant(i, v) for i, v in (constants or {}).items()]
        self._handle.dispatch(kernel, grid3, group3, list(bound), lengths, values, list(bound_lengths))


LANGUAGE_VERSIONS = ("2.4", "3.0", "3.1", "3.2", "4.0")
GPU_FAMILIES = ("apple9", "apple10")
TENSOR_LAYOUTS = ("family", "scrambled")


def _choice(what: str, value, choices, variable: str, default: str) -> str:
    if value is None:
        value = os.environ.get(variable) or default
        what = f"{what} (from {variable})" if os.environ.get(variable) else what
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return value


def compile_library(
    source: str,
    macros: Optional[Mapping[str, object]] = None,
    name: str = "library.metal",
    checked: Optional[bool] = None,
    lockstep: bool = False,
    language_version: str = "4.0",
    gpu_family: Optional[str] = None,
    tensor_layout: Optional[str] = None,
) -> Library:
    """Compile MSL source (like newLibraryWithSource:options: with preprocessorMacros).

    checked=True builds the library for checked mode (module docstring), False not; None (the
    default) follows `checked()`. lockstep=True runs its SIMD-groups in lockstep (module
    docstring). Either is an instrumented build with its own cache entry (shared by the two), and
    slower to run than a plain one.

    Macro values are converted with str() (None and True define the macro as 1, False as 0). Compiled libraries
    are cached in memory and on disk (see `cache_dir()`). Raises MetalCompileError carrying the
    compiler's message with the MSL file and line: the first error first, then as much of the
    output as the message holds (about 8 KiB). The whole output is the exception's `log`, kept in
    the file `log_path` of the cache directory (None when the cache is read-only: then `log` is the
    message).

    language_version ("4.0", the default, as Apple's compiler for a macOS 26 target, or an older
    one of LANGUAGE_VERSIONS) sets __METAL_VERSION__; from 4.0 on, <metal_tensor> and
    MetalPerformancePrimitives are there. gpu_family ("apple10" by default, or
    $FLASHATTN_MPS_CPU_GPU_FAMILY) is the GPU family emulated, which lays out cooperative tensors;
    tensor_layout "scrambled" (or $FLASHATTN_MPS_CPU_TENSOR_LAYOUT) lays them out by a rule of no
    GPU that changes per process instead of the family's ("family", the default), so a kernel that
    assumes a layout fails here (docs/cpu-device.md, "Metal 4 tensors")."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    if checked is not None and not isinstance(checked, bool):
        raise TypeError(f"checked must be True, False or None, got {checked!r}")
    if not isinstance(lockstep, bool):
        raise TypeError(f"lockstep must be True or False, got {lockstep!r}")
    pairs = []
    for key, value in (macros or {}).items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"macros: {key!r} is not a valid macro name")
        pairs.append((key, "1" if value is None or value is True else "0" if value is False else str(value)))
    if language_version not in LANGUAGE_VERSIONS:
        raise ValueError(f"language_version must be one of {', '.join(LANGUAGE_VERSIONS)}, got {language_version!r}")
    family = _choice("gpu_family", gpu_family, GPU_FAMILIES, "FLASHATTN_MPS_CPU_GPU_FAMILY", "apple10")
    layout = _choice("tensor_layout", tensor_layout, TENSOR_LAYOUTS, "FLASHATTN_MPS_CPU_TENSOR_LAYOUT", "family")
    reserved = [key for key, _ in pairs if key == "__METAL_VERSION__" or key.startswith("__MSL_CPU_")]
    if reserved:
        raise ValueError(f"macros: {reserved[0]} is set by compile_library's options")
    major, minor = language_version.split(".")
    pairs.append(("__METAL_VERSION__", str(int(major) * 100 + int(minor) * 10)))
    if "__METAL__" not in dict(pairs):  # as Apple's compiler predefines it
        pairs.append(("__METAL__", "1"))
    if int(major) >= 4:
        pairs.append(("__MSL_CPU_GPU_FAMILY__", family[len("apple") :]))
        pairs.append(("__MSL_CPU_TENSOR_LAYOUT__", str(TENSOR_LAYOUTS.index(layout))))
    mode = _device.checked() if checked is None else checked
    try:
        return Library(_device.compile_library(source, name, pairs, int(mode), lockstep), name, mode, lockstep)
    except MetalCompileError as error:
        _attach_log(error)
        raise


_LOG_LINE = re.compile(r"^the whole compiler output \(\d+ errors, \d+ bytes\): (.+)$", re.MULTILINE)


def _attach_log(error: Exception) -> None:
    """error.log_path and error.log: the file the C layer named in the message, and its text."""
    message = str(error)
    found = _LOG_LINE.search(message)
    error.log_path = found.group(1) if found else None
    error.log = message
    if error.log_path:
        try:
            with open(error.log_path, encoding="utf-8", errors="replace") as f:
                error.log = f.read()
        except OSError:  # removed since (a concurrent rebuild, a cleaned cache): the message is what remains
            error.log_path = None


def cache_dir() -> str:
    """Where compiled libraries are cached ($FLASHATTN_MPS_CACHE overrides). Created private (0700);
    refused (MetalCompileError naming the path and the reason) if it, or an entry in it, is a
    symbolic link, someone else's, or group- or world-writable."""
    return _device.cache_dir()


def set_watchdog(seconds: float) -> None:
    """Limit every CPU-device dispatch (of `Library.dispatch` and of `flash_attention` on CPU
    tensors) to `seconds`: a longer one is stopped and raises MetalDispatchError naming the kernel.
    0 (the default, or $FLASHATTN_MPS_CPU_WATCHDOG) means no limit. Ctrl-C stops a dispatch either
    way (KeyboardInterrupt)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"seconds must be a number (0 for no limit), got {type(seconds).__name__}")
    _device.set_watchdog(float(seconds))


def watchdog() -> float:
    """The CPU-device dispatch time limit in seconds (0: none); see `set_watchdog`."""
    return _device.watchdog()


def set_checked(checked: Optional[bool]) -> None:
    """Build every library compiled from now on for checked mode (True) or not (False): those of
    `compile_library(checked=None)` and the project's own kernels on CPU tensors (a separate set of
    libraries; those built before keep their mode). None (the initial state) follows
    $FLASHATTN_MPS_CPU_CHECKED (0 or 1, unset: 0), read when next needed."""
    if checked is not None and not isinstance(checked, bool):
        raise TypeError(f"checked must be True, False or None, got {checked!r}")
    _device.set_checked(-1 if checked is None else int(checked))


def checked() -> bool:
    """Whether libraries are built for checked mode unless said otherwise; see `set_checked`.
    Raises ValueError when $FLASHATTN_MPS_CPU_CHECKED is neither 0 nor 1."""
    return _device.checked()
