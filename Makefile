# The README's commands. Each sets up what it needs in .venv (reusing a torch already installed
# system-wide), rebuilds the extension when C, C++ or Metal sources change, then runs.
# The interpreter: python3 when it is 3.11 to 3.14, else the newest python3.1x on PATH, else python3
# (tools/python_check.sh; PYTHON=... overrides). The demo runs on Python 3.9 and newer, the tests
# need 3.11 to 3.14; each set-up checks first and says what to install.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell sh tools/python_check.sh pick)
endif
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc metal tools -type f) setup.py pyproject.toml
# The tests' exact versions: the torch they were run with, and what they need besides torch.
TESTED_TORCH := 2.13.0
TEST_DEPS := numpy pytest hypothesis "transformers==5.24.0" "diffusers==0.42.1" pybind11 "setuptools>=64" wheel

.PHONY: demo test test-fast test-torch cpu-device-compiler bench strict-check metal-offline-check doctor format clean check-test-python

demo: $(VENV)/.built
	$(PY) -m flashattn_mps.demo

# The whole suite (CI runs this). Tests are by subject under tests/ (kernels, api, integrations,
# device, mac); pytest tests/device runs the CPU Metal device's own tests alone.
test: check-test-python $(VENV)/.test-deps $(VENV)/.built
	$(PY) -m pytest -q tests

# Everything but the tests marked slow (fuzzing, peak memory, other projects' kernels, the strict
# check of every specialisation, ...): 2 minutes on 2 cores with the kernels cached, for the edit-test loop.
test-fast: check-test-python $(VENV)/.test-deps $(VENV)/.built
	$(PY) -m pytest -q -m "not slow" tests

# The suite against another torch: make test-torch TORCH=2.4.0 (CI runs the oldest and the newest
# admitted torch, 2.4.0 and 2.15.0). A separate venv (.venv-torch-X) gets that torch and the test
# dependencies, and builds the extension in the tree with them: it uses no torch headers or
# libraries, so one build serves every torch. TESTS narrows the run (pytest's arguments), e.g.
# TESTS='-m "not slow" tests/api'. On torch < 2.6 the transformers and diffusers tests skip, saying
# why: the tested releases do not import there.
TORCH ?=
TESTS ?= tests
TORCH_VENV := .venv-torch-$(TORCH)
test-torch: cpu-device-compiler
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.4.0"; exit 2; }
	@sh tools/python_check.sh test $(PYTHON) $(TORCH)
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH)" $(TEST_DEPS)
	$(TORCH_VENV)/bin/python setup.py -q build_ext --inplace
	$(TORCH_VENV)/bin/python -c "import torch, flashattn_mps; print('torch', torch.__version__, 'flashattn_mps from', flashattn_mps.__file__)"
	$(TORCH_VENV)/bin/python -m pytest -q $(TESTS)

bench: $(VENV)/.built
	$(PY) -m pip install -q matplotlib
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_cpu_device.py

strict-check: $(VENV)/.built
	$(PY) -m flashattn_mps.strict_check

# Apple's offline Metal compiler on every specialisation (macOS with Xcode only);
# METAL_OFFLINE_FLAGS=--metal4 adds -std=metal4.0 (Xcode 26 with the Metal toolchain).
metal-offline-check: $(VENV)/.built
	$(PY) -m flashattn_mps.metal_offline_check $(METAL_OFFLINE_FLAGS)

doctor: $(VENV)/.built
	$(PY) -m flashattn_mps.doctor

# Off macOS the CPU Metal device compiles kernels with clang >= 16: installed from Debian/Ubuntu's
# packages when none is on PATH (as root), else the message says what to install.
# The list is the device's (csrc/cpu_device/compilers.txt).
CLANGS := $(shell sed -e 's/\#.*//' csrc/cpu_device/compilers.txt)
cpu-device-compiler:
	@if [ "$$(uname)" != Darwin ] && ! for c in $(CLANGS); do command -v $$c; done | grep -q .; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing clang-16 (the CPU Metal device compiles kernels with it)"; \
	    apt-get update -qq && apt-get install -y -qq clang-16 >/dev/null; \
	  else \
	    echo "the CPU Metal device needs clang >= 16 on PATH (Debian/Ubuntu: apt-get install clang-16)"; exit 1; \
	  fi; \
	fi

# The demo's set-up: the tested torch where it has a wheel for this OS and Python, else the newest
# torch flashattn-mps admits (pyproject.toml's range, resolved by the editable install below).
$(VENV)/.deps: | cpu-device-compiler
	@sh tools/python_check.sh demo $(PYTHON)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q "pip>=21.3" numpy pybind11 "setuptools>=64" wheel
	$(PY) -m pip install -q "torch==$(TESTED_TORCH)" 2>/dev/null || \
	  echo "torch $(TESTED_TORCH) has no wheel for this OS and Python: taking the newest torch flashattn-mps admits"
	touch $@

# The tests' set-up: exact pins. check-test-python stops first, saying what to install, where they
# cannot install (with .venv's Python once it exists).
check-test-python:
	@sh tools/python_check.sh test $(firstword $(wildcard $(PY)) $(PYTHON)) $(TESTED_TORCH)

$(VENV)/.test-deps: $(VENV)/.deps
	$(PY) -m pip install -q "torch==$(TESTED_TORCH)" $(TEST_DEPS)
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# The formatters, with the repository's configurations (.clang-format, pyproject's [tool.ruff]):
# clang-format 16 (Debian's clang-format-16) for csrc/ and metal/, ruff for the Python.
CLANG_FORMAT ?= clang-format-16
format: $(VENV)/.deps
	$(PY) -m pip install -q ruff
	$(CLANG_FORMAT) -i $$(git ls-files 'csrc/*.c' 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.m' 'metal/*.h' 'metal/*.metal')
	$(PY) -m ruff check --fix -q .
	$(PY) -m ruff format -q .

clean:
	rm -rf build $(VENV) .venv-torch-* flashattn_mps/*.so *.egg-info
