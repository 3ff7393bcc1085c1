"""Builds two extension modules: flashattn_mps._metal_cpu, the CPU Metal device (csrc/cpu_device/: its
runtime and its Python API), and flashattn_mps._C, the attention library (the C core, its pybind11
layer and, on macOS, the Metal backend), which reaches the device only through the table
_metal_cpu exports as a capsule. No torch headers or libraries are used, so one build serves every
supported torch."""

import os
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
IS_MACOS = sys.platform == "darwin"

C_SOURCES = [
    "csrc/fa_core.c",
    "csrc/fa_validate.c",
    "csrc/fa_gpu_family.c",
    "csrc/fa_plan_build.c",
    "csrc/fa_plan_sequences.c",
    "csrc/fa_plan_forward.c",
    "csrc/fa_plan_backward.c",
    "csrc/fa_plan_cache.c",
    "csrc/fa_execute.c",
    "csrc/fa_forward.c",
    "csrc/fa_backward.c",
    "csrc/fa_cache.c",
    "csrc/cpu_backend.c",
    "csrc/metal_backend/torch_symbols.c",
]
# The CPU Metal device: every C file of csrc/cpu_device/ and its pybind11 module.
DEVICE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu_device").glob("*.c")) + [
    "csrc/cpu_device/python_module.cpp"
]
BACKEND_SOURCES = ["csrc/metal_backend/metal_backend.m"] if IS_MACOS else ["csrc/metal_backend/unavailable.c"]

# Per-language flags: one extension mixes C, C++ and (on macOS) Objective-C.
LANGUAGE_FLAGS = {
    ".c": ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    ".cpp": ["-std=c++17"],
    ".m": ["-fobjc-arc", "-Wall"],
}


class BuildExt(build_ext):
    """Embeds the shim headers and the compiler list (csrc/cpu_device/compilers.txt) into the
    device (it writes the headers next to its compiled kernels) and compiles each source with its
    own language's flags."""

    def build_extension(self, ext):
        if ext.name == DEVICE_MODULE:
            generated = Path(self.build_temp) / "shim_files.c"
            generated.parent.mkdir(parents=True, exist_ok=True)
            subprocess.check_call([sys.executable, str(ROOT / "tools" / "embed_shim.py"), str(generated)])
            if str(generated) not in ext.sources:
                ext.sources.append(str(generated))

        original_compile = self.compiler._compile

        def compile_with_language_flags(obj, src, ext_name, cc_args, extra_postargs, pp_opts):
            flags = LANGUAGE_FLAGS.get(os.path.splitext(src)[1], [])
            postargs = [a for a in extra_postargs if not a.startswith("-std=")] + flags
            original_compile(obj, src, ext_name, cc_args, postargs, pp_opts)

        self.compiler._compile = compile_with_language_flags
        super().build_extension(ext)


SHIM_PTH = "flashattn_mps/_shim/flashattn_mps_flash_attn_shim.pth"


class BuildPyWithShimHook(build_py):
    """Also puts the flash_attn shim's .pth line at the top of the build, so an installed wheel
    has it in site-packages (it does nothing unless FLASHATTN_MPS_FLASH_ATTN_SHIM=1; pip removes
    it with the package)."""

    def run(self):
        super().run()
        self.copy_file(str(ROOT / SHIM_PTH), os.path.join(self.build_lib, Path(SHIM_PTH).name))


# CoreGraphics: without it MTLCreateSystemDefaultDevice() returns nil in a command-line process
# (Apple's documentation of that function); it is the backend's last resort for a device.
MACOS_FRAMEWORKS = ["-framework", "Metal", "-framework", "Foundation", "-framework", "CoreGraphics"]

DEVICE_MODULE = "flashattn_mps._metal_cpu"

device = Pybind11Extension(
    DEVICE_MODULE,
    sources=DEVICE_SOURCES,
    include_dirs=["csrc/cpu_device"],
    extra_compile_args=["-O2"],
    extra_link_args=["-ldl", "-lpthread"],
    cxx_std=17,
)

library = Pybind11Extension(
    "flashattn_mps._C",
    sources=["csrc/bindings/module.cpp", "csrc/bindings/metal_bindings.cpp"] + C_SOURCES + BACKEND_SOURCES,
    include_dirs=["csrc", "metal"],
    extra_compile_args=["-O2"],
    extra_link_args=MACOS_FRAMEWORKS if IS_MACOS else ["-ldl", "-lpthread"],
    cxx_std=17,
)

setup(
    ext_modules=[device, library],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPyWithShimHook},
    # Every package under flashattn_mps/, and the kernel sources (metal/) as flashattn_mps._metal.
    packages=find_packages(include=["flashattn_mps", "flashattn_mps.*"]) + ["flashattn_mps._metal"],
    package_dir={"flashattn_mps": "flashattn_mps", "flashattn_mps._metal": "metal"},
    package_data={"flashattn_mps._metal": ["*.metal", "*.h"], "flashattn_mps._shim": ["*.pth"]},
)
