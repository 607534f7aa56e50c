"""docs/profiling.ipynb runs: every cell executes without an error in a fresh kernel, scaled down
through MINIGPT_ARGS, and shows the trace summary, the report and the comparison."""

from __future__ import annotations

import os

import pytest
from conftest import ROOT, TINY

NOTEBOOK = ROOT / "docs" / "profiling.ipynb"


@pytest.mark.slow
@pytest.mark.ci
def test_profiling_notebook_runs(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment: this checkout's minigpt, a tiny model, runs in tmp.
    monkeypatch.setenv("MINIGPT_ARGS", " ".join([*TINY, "--num-steps", "8"]))
    monkeypatch.setenv("MINIGPT_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "top host operators by self time" in text and "aten::" in text  # the trace summary
    assert "B/A is B over A" in text and "activation_checkpoint" in text  # the comparison
    assert "Consider using IPython.display.IFrame" not in text  # the report's frame shown without a warning
    frames = [o for o in outputs if "text/html" in o.get("data", {})]
    assert frames and "srcdoc=" in frames[0]["data"]["text/html"]  # the report, inline
    assert (tmp_path / "runs" / "base" / "report.html").exists()
