"""The quickstart notebook is one of the documented ways in: it must run top to bottom on CPU."""

import pathlib

import pytest

from tests.helpers.process import checkout_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch):
    # The kernel is a fresh process: let it import this checkout even when it is not pip-installed.
    monkeypatch.setenv("PYTHONPATH", checkout_env()["PYTHONPATH"])
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "->" in printed and "iterations=" in printed
    assert "KV pages in use=0/" in printed  # everything freed once the requests finished
