"""The tour notebook runs top to bottom (outputs are not committed, so it is executed here)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a dev extra: without it (a bare GPU image) this test skips, not the run
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "memguard_tour.ipynb"


@pytest.mark.slow
def test_tour_notebook_runs_top_to_bottom(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # committed clean
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    assert "Memory estimate for one training step" in outputs
    assert "settled peak" in outputs
    images = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the matplotlib figure and the report PNG
