#!/bin/sh
# The Makefile's choice and checks of the interpreter, in POSIX sh so they run before any Python is
# known to work, and say what to install instead of letting pip fail.
#
#   tools/python_check.sh pick           the interpreter for .venv: python3 when it is 3.11 to 3.14
#                                        (what the test set-up's pins need), else the newest
#                                        python3.14 ... python3.11 on PATH, else python3
#   tools/python_check.sh demo PYTHON    exit 1 with a message if `make demo` cannot set up with it
#   tools/python_check.sh test PYTHON TORCH
#                                        the same for the test set-up's exact pins with that torch
#
# The facts behind the limits (PyPI's wheels; README.md's set-up table says what each Mac gets):
# flashattn-mps admits torch 2.4 to 2.15; torch's last Intel macOS wheel is 2.2.2; torch for
# Python 3.9 stops at 2.8.0; torch 2.13.0 (the tested version) has macOS wheels for macOS 14 and
# newer only, for Python 3.10 to 3.14; transformers 5.24.0 and diffusers 0.42.1 need Python 3.11.

version_of() {  # 311 for Python 3.11; nothing if $1 is not a working Python
    "$1" -c 'import sys; print(sys.version_info[0] * 100 + sys.version_info[1])' 2>/dev/null
}

dotted() { echo "$(($1 / 100)).$(($1 % 100))"; }

testable() {  # $1 runs and is Python 3.11 to 3.14
    v=$(version_of "$1") && [ "$v" -ge 311 ] && [ "$v" -le 314 ]
}

mac_requirements() {  # Apple silicon, as the Python itself sees it (not a Rosetta one)
    [ "$(uname)" = Darwin ] || return 0
    machine=$("$1" -c 'import platform; print(platform.machine())')
    if [ "$machine" != arm64 ]; then
        echo "$1 is an $machine Python: flashattn-mps needs Apple silicon and an arm64 Python (torch has no" >&2
        echo "Intel macOS wheels since 2.2.2, and flashattn-mps needs torch >= 2.4)." >&2
        exit 1
    fi
}

case "$1" in
pick)
    for candidate in python3 python3.14 python3.13 python3.12 python3.11; do
        if testable "$candidate"; then
            echo "$candidate"
            exit 0
        fi
    done
    echo python3
    ;;
demo)
    v=$(version_of "$2") || {
        echo "no working Python at '$2': install Python 3.9 or newer, or run make PYTHON=/path/to/python3" >&2
        exit 1
    }
    if [ "$v" -lt 309 ]; then
        echo "$2 is Python $(dotted "$v"); flashattn-mps needs Python 3.9 or newer (python.org, or Homebrew's python@3.12)." >&2
        exit 1
    fi
    mac_requirements "$2"
    ;;
test)
    v=$(version_of "$2") || {
        echo "no working Python at '$2'" >&2
        exit 1
    }
    if [ "$v" -lt 311 ] || [ "$v" -gt 314 ]; then
        echo "$2 is Python $(dotted "$v"): the test set-up pins torch $3, transformers 5.24.0 and diffusers 0.42.1," >&2
        echo "which need Python 3.11 to 3.14 (make demo runs on Python 3.9 and newer)." >&2
        echo "Install one (python.org, or Homebrew: brew install python@3.12), then: make clean && make test" >&2
        echo "(make picks python3 when it is 3.11 to 3.14, else the newest python3.1x on PATH; PYTHON=... overrides)." >&2
        exit 1
    fi
    mac_requirements "$2"
    torch_minor=${3#2.}
    torch_minor=${torch_minor%%.*}
    if [ "$(uname)" = Darwin ] && [ "$torch_minor" -ge 12 ]; then
        macos=$(sw_vers -productVersion)
        if [ "${macos%%.*}" -lt 14 ]; then
            echo "macOS $macos: torch $3 has macOS wheels for macOS 14 and newer only (from torch 2.12 on)." >&2
            echo "make test-torch TORCH=2.11.0 runs the suite with the newest torch for macOS $macos." >&2
            exit 1
        fi
    fi
    ;;
*)
    echo "usage: tools/python_check.sh pick | demo PYTHON | test PYTHON TORCH" >&2
    exit 2
    ;;
esac
