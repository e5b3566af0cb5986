"""The quickstart notebook is one of the documented ways in: it must run top to bottom on CPU, with the
command the README gives (`make notebook-run`: `jupyter execute examples/quickstart.ipynb`)."""

import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers.process import checkout_env

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")  # `jupyter execute` is nbclient's

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"
JUPYTER = os.path.join(os.path.dirname(sys.executable), "jupyter")


def _execute(tmp_path: pathlib.Path, model: str | None = None) -> str:
    """Run a copy of the notebook (its model swapped for `model`) with `jupyter execute`; what it printed."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    if model is not None:
        for cell in nb.cells:
            cell.source = cell.source.replace('"smollm2-135m"', f'"{model}"')
    nbformat.write(nb, tmp_path / "quickstart.ipynb")
    # The kernel is a fresh process: let it import this checkout even when it is not pip-installed.
    result = subprocess.run([JUPYTER, "execute", "--output=executed", str(tmp_path / "quickstart.ipynb")],
                            cwd=tmp_path, env=checkout_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    executed = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    return "".join(o.get("text", "") for o in outputs)


def test_quickstart_notebook_runs_to_the_end_with_jupyter_execute(tmp_path):
    """The notebook as written, on tiny-llama (random weights: the cells, not the words, are checked)."""
    printed = _execute(tmp_path, model="tiny-llama")
    assert "->" in printed and "iterations=" in printed
    assert "KV pages in use=0/" in printed  # everything freed once the requests finished
    assert "IProgress not found" not in printed  # tqdm's widget bars (ipywidgets), not its warning


@pytest.mark.slow
def test_quickstart_notebook_runs_with_the_real_model(tmp_path):
    printed = _execute(tmp_path)
    assert "->" in printed and "iterations=" in printed
    assert "KV pages in use=0/" in printed
