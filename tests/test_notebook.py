"""The quickstart notebook executes top to bottom (with a shortened training)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICKSTART_STEPS", "10")
    monkeypatch.setenv("QUICKSTART_DIR", str(tmp_path))
    notebook = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    resources = {"metadata": {"path": str(REPO / "notebooks")}}
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources=resources).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3, "data grid, retrieval results and scalar plots must render"
    text = "".join(o.get("text", "") for o in outputs)
    assert "val/r1_t2i" in text and "test images" in text
