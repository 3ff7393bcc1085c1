"""The import hook that serves the flash_attn shim (standard library only: the .pth line loads this
file at interpreter start without importing flashattn_mps or torch).

A meta-path finder at the front of sys.meta_path answers for the top-level names `flash_attn` and
`flash_attn_interface` only. Each time one of them is imported it first asks the other finders:
when a real module of that name exists on sys.path (installed before or after the hook), it steps
aside (returns None, so the real one is imported) and says so once. Submodules (flash_attn.cute,
flash_attn.bert_padding, ...) are found through the shim package's own __path__."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import warnings

ENVIRONMENT_SWITCH = "FLASHATTN_MPS_FLASH_ATTN_SHIM"
_HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (the file that serves it, whether it is a package)
_MODULES = {
    "flash_attn": (os.path.join(_HERE, "flash_attn", "__init__.py"), True),
    "flash_attn_interface": (os.path.join(_HERE, "flash_attn_interface.py"), False),
}
_stepped_aside = set()  # names whose real module was found: said once each


class FlashAttnShimFinder(importlib.abc.MetaPathFinder):
    """Serves the shim's modules unless a real one of the same name exists."""

    is_flashattn_mps_shim = True  # (uninstall finds instances by this, whichever copy loaded them)

    def find_spec(self, name, path=None, target=None):
        if name not in _MODULES:
            return None
        real = _real_spec(name)
        if real is not None:
            if name not in _stepped_aside:
                _stepped_aside.add(name)
                warnings.warn(
                    f"flashattn_mps: a real {name} is installed ({real.origin}); the flash_attn shim steps aside "
                    "and that one is imported",
                    stacklevel=2,
                )
            return None
        origin, package = _MODULES[name]
        return importlib.util.spec_from_file_location(
            name, origin, submodule_search_locations=[os.path.dirname(origin)] if package else None
        )


def _real_spec(name):
    """The spec another finder (the regular path finder, an editable install's) gives `name`."""
    for finder in list(sys.meta_path):
        if getattr(finder, "is_flashattn_mps_shim", False):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(name, None, None)
        if spec is not None:
            return spec
    return None


def installed() -> bool:
    return any(getattr(finder, "is_flashattn_mps_shim", False) for finder in sys.meta_path)


def install() -> None:
    """Puts the finder first on sys.meta_path (once)."""
    if not installed():
        sys.meta_path.insert(0, FlashAttnShimFinder())


def uninstall() -> None:
    """Removes the finder and forgets the shim's modules already imported (a real flash_attn
    imported meanwhile is left alone)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "is_flashattn_mps_shim", False)]
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        origin = getattr(module, "__file__", None) or ""
        if top in _MODULES and os.path.abspath(origin).startswith(_HERE + os.sep):
            del sys.modules[name]


def install_from_environment() -> None:
    """What the .pth line calls: installs the finder when FLASHATTN_MPS_FLASH_ATTN_SHIM=1."""
    if os.environ.get(ENVIRONMENT_SWITCH) == "1":
        install()
