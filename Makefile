# The two commands of the README. Each sets up what it needs in .venv (reusing a torch already
# installed system-wide), rebuilds the extension when C, C++ or Metal sources change, then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc metal tools -type f) setup.py pyproject.toml

.PHONY: demo test bench strict-check clean

demo: $(VENV)/.built
	$(PY) -m flashattn_mps.demo

test: $(VENV)/.built
	$(PY) -m pytest -q tests

bench: $(VENV)/.built
	$(PY) -m pip install -q matplotlib
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_cpu_device.py

strict-check: $(VENV)/.built
	$(PY) -m flashattn_mps.strict_check

$(VENV)/.deps:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" numpy pytest hypothesis transformers diffusers pybind11 "setuptools>=64" wheel
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build $(VENV) flashattn_mps/*.so *.egg-info
