"""What each install gives: the library alone (no serving packages) runs `LLM`; `serve` brings what
serving imports, and no torch."""

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers.process import checkout_env

REPO = Path(__file__).resolve().parents[2]
SERVING = ("fastapi", "uvicorn", "httptools", "pydantic", "prometheus_client", "httpx", "starlette")

WITHOUT_SERVING = f"""
import importlib.abc, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {SERVING + ("torch", "transformers", "matplotlib", "aiohttp")!r}:
            raise ImportError("not installed: " + name)

sys.meta_path.insert(0, Missing())
import orca_jax
from orca_jax import LLM, SamplingParams
out = LLM("tiny-llama", max_model_len=32).generate(["Hi"], SamplingParams(max_tokens=2))
print(len(out[0].token_ids))
"""


def test_the_library_runs_without_the_serving_packages(tmp_path):
    env = checkout_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path))  # see test_generate_cli.py
    result = subprocess.run([sys.executable, "-c", WITHOUT_SERVING], cwd=REPO, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "2", result.stderr


def test_serve_extra_has_what_serving_imports_and_no_torch():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda specs: {spec.split(">")[0].split("=")[0].split("[")[0].lower() for spec in specs}  # noqa: E731
    core, extras = names(project["dependencies"]), project["optional-dependencies"]
    serve = names(extras["serve"])
    assert {"fastapi", "uvicorn", "httptools", "pydantic", "prometheus-client", "httpx", "pyyaml"} <= serve
    assert not serve & {"torch", "transformers"} and not core & serve and "torch" not in core
    assert "orca_jax[serve]" in extras["test"] and "orca_jax[serve]" in extras["bench"]
    makefile = (REPO / "Makefile").read_text()
    assert '-e ".[serve]"' in makefile and '-e ".[test,bench,serve]"' in makefile


def test_make_test_runs_every_test_folder_once():
    """`make test`'s two pytest processes (TESTS_1, TESTS_2) cover every folder of tests/ that holds tests."""
    makefile = (REPO / "Makefile").read_text()
    groups = [line.split(":=", 1)[1].split() for line in makefile.splitlines() if line.startswith("TESTS_")]
    named = [path for group in groups for path in group]
    folders = sorted(f"tests/{p.parent.name}" for p in (REPO / "tests").glob("*/test_*.py"))
    assert len(groups) == 2 and len(named) == len(set(named))
    assert set(named) == set(folders) | {"tests/test_*.py"}
