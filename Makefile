# The README's commands. Each sets up what it needs in .venv (reusing a torch already installed
# system-wide), rebuilds the extension when C, C++ or Metal sources change, then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc metal tools -type f) setup.py pyproject.toml
# What the tests need besides torch (both venvs install it).
TEST_DEPS := numpy pytest hypothesis "transformers==5.24.0" "diffusers==0.42.1" pybind11 "setuptools>=64" wheel

.PHONY: demo test test-fast test-torch bench strict-check metal-offline-check doctor format clean

demo: $(VENV)/.built
	$(PY) -m flashattn_mps.demo

# The whole suite (CI runs this). Tests are by subject under tests/ (kernels, api, integrations,
# device, mac); pytest tests/device runs the CPU Metal device's own tests alone.
test: $(VENV)/.built
	$(PY) -m pytest -q tests

# Everything but the tests marked slow (fuzzing, peak memory, other projects' kernels, the strict
# check of every specialisation, ...): about 3 minutes on 2 cores, for the edit-test loop.
test-fast: $(VENV)/.built
	$(PY) -m pytest -q -m "not slow" tests

# The suite against another torch: make test-torch TORCH=2.14.1. A separate venv (.venv-torch-X)
# gets that torch and the test dependencies; the extension is the tree's own build, since it uses
# no torch headers or libraries and one build serves every torch.
TORCH ?=
TORCH_VENV := .venv-torch-$(TORCH)
test-torch: $(VENV)/.built
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.14.1"; exit 2; }
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH)" $(TEST_DEPS)
	$(TORCH_VENV)/bin/python -c "import torch, flashattn_mps; print('torch', torch.__version__, 'flashattn_mps from', flashattn_mps.__file__)"
	$(TORCH_VENV)/bin/python -m pytest -q tests

bench: $(VENV)/.built
	$(PY) -m pip install -q matplotlib
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_cpu_device.py

strict-check: $(VENV)/.built
	$(PY) -m flashattn_mps.strict_check

# Apple's offline Metal compiler on every specialisation (macOS with Xcode only).
metal-offline-check: $(VENV)/.built
	$(PY) -m flashattn_mps.metal_offline_check

doctor: $(VENV)/.built
	$(PY) -m flashattn_mps.doctor

# Off macOS the CPU Metal device compiles kernels with clang >= 16: installed from Debian/Ubuntu's
# packages when none is on PATH (as root), else the message says what to install.
# The list is the device's (csrc/cpu_device/compilers.txt).
CLANGS := $(shell sed -e 's/\#.*//' csrc/cpu_device/compilers.txt)

$(VENV)/.deps:
	@if [ "$$(uname)" != Darwin ] && ! for c in $(CLANGS); do command -v $$c; done | grep -q .; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing clang-16 (the CPU Metal device compiles kernels with it)"; \
	    apt-get update -qq && apt-get install -y -qq clang-16 >/dev/null; \
	  else \
	    echo "the CPU Metal device needs clang >= 16 on PATH (Debian/Ubuntu: apt-get install clang-16)"; exit 1; \
	  fi; \
	fi
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" $(TEST_DEPS)
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
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
