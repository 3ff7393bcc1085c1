"""Builds flashattn_mps._C: the C core, the CPU Metal device, the pybind11 layer and, on macOS, the
Metal backend. No torch headers or libraries are used, so one build serves every supported torch."""
import os
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
IS_MACOS = sys.platform == "darwin"

C_SOURCES = [
    "csrc/fa_core.c",
    "csrc/fa_validate.c",
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
    "csrc/cpu_device/compile.c",
    "csrc/cpu_device/prepass.c",
    "csrc/cpu_device/runtime.c",
    "csrc/cpu_device/fiber.c",
    "csrc/metal_backend/torch_symbols.c",
]
BACKEND_SOURCES = ["csrc/metal_backend/metal_backend.m"] if IS_MACOS else ["csrc/metal_backend/unavailable.c"]

# Per-language flags: one extension mixes C, C++ and (on macOS) Objective-C.
LANGUAGE_FLAGS = {
    ".c": ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    ".cpp": ["-std=c++17"],
    ".m": ["-fobjc-arc", "-Wall"],
}


class BuildExt(build_ext):
    """Embeds the shim headers into the C core (the CPU device writes them next to its compiled
    kernels) and compiles each source with its own language's flags."""

    def build_extension(self, ext):
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


# CoreGraphics: without it MTLCreateSystemDefaultDevice() returns nil in a command-line process
# (Apple's documentation of that function); it is the backend's last resort for a device.
MACOS_FRAMEWORKS = ["-framework", "Metal", "-framework", "Foundation", "-framework", "CoreGraphics"]

extension = Pybind11Extension(
    "flashattn_mps._C",
    sources=["csrc/bindings/module.cpp", "csrc/bindings/metal_bindings.cpp"] + C_SOURCES + BACKEND_SOURCES,
    include_dirs=["csrc", "metal"],
    extra_compile_args=["-O2"],
    extra_link_args=MACOS_FRAMEWORKS if IS_MACOS else ["-ldl", "-lpthread"],
    cxx_std=17,
)

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExt},
    packages=["flashattn_mps", "flashattn_mps._metal"],
    package_dir={"flashattn_mps": "flashattn_mps", "flashattn_mps._metal": "metal"},
    package_data={"flashattn_mps._metal": ["*.metal", "*.h"]},
)
