"""The Metal kernel sources: found, made self-contained, and registered with the C core.

Metal compiles one source string at a time, so every project header a `.metal` file includes with
`#include "..."` is inlined here, with `#line` directives so compiler messages and runtime
diagnostics name the original file and line. `#include <...>` (Metal's own headers) is kept.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from . import _C

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_lock = threading.Lock()
registered = False  # read without the lock on the hot path; set once


def metal_dir() -> Path:
    """The directory holding the `.metal` sources: inside an installed wheel, else the repo's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_metal", here.parent / "metal"):
        if candidate.is_dir() and any(candidate.glob("*.metal")):
            return candidate
    raise FileNotFoundError(f"no Metal kernel sources found next to {here}")


def inline_includes(path: Path, root: Path, active: tuple[Path, ...] = ()) -> str:
    """Text of `path` with project includes inlined (recursively) and #line directives."""
    if path in active:
        raise ValueError(f"include cycle: {' -> '.join(p.name for p in active + (path,))}")
    name = path.relative_to(root).as_posix()
    out = [f'#line 1 "{name}"']
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _INCLUDE.match(line)
        if match is None:
            out.append(line)
            continue
        included = (path.parent / match.group(1)).resolve()
        if not included.is_file():
            raise FileNotFoundError(f"{name}:{number}: included file {match.group(1)!r} not found")
        out.append(inline_includes(included, root, active + (path,)))
        out.append(f'#line {number + 1} "{name}"')
    return "\n".join(out) + "\n"


def kernel_sources() -> dict[str, str]:
    """Every `.metal` file, self-contained, by file name."""
    root = metal_dir()
    return {path.name: inline_includes(path, root) for path in sorted(root.glob("*.metal"))}


def ensure_registered() -> None:
    """Hand the sources to the C core once per process."""
    global registered
    with _lock:
        if not registered:
            for name, text in kernel_sources().items():
                _C.register_source(name, text)
            registered = True
