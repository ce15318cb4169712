"""The example notebooks run from top to bottom, as stored: without outputs and installing nothing."""

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ipynb"))

# what each notebook must print: the claims its text makes
EXPECTED = {
    "quickstart.ipynb": [
        "merged model reproduces the delta row exactly: True",
        re.compile(r"8-bit: ratio +\d+\.\d\dx, gain kept +\d+\.\d%"),
        re.compile(r"2-bit, 97% pruned: ratio +\d+\.\d\dx, gain kept +\d+\.\d%"),
    ],
    "serving.ipynb": [
        re.compile(r"one by one +\d+\.\d\d s"),
        re.compile(r"together, mixed deltas +\d+\.\d\d s"),
        "every answer matches generate(): True",
    ],
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs_and_installs_nothing(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs before committing"
        assert not re.search(r"^\s*[!%]\s*(pip|conda|uv)\b|pip install", cell.source, re.M), cell.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits it: figures are drawn, never shown
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' tempfile.mkdtemp work folders go with tmp_path
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Traceback" not in outputs
    assert "Loading weights" not in outputs  # transformers' own progress bars stay off
    for claim in EXPECTED.get(path.name, []):
        found = claim.search(outputs) if isinstance(claim, re.Pattern) else claim in outputs
        assert found, f"{path.name} did not print {claim!r}:\n{outputs[-3000:]}"


def test_every_notebook_states_what_it_prints():
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED), "add the new notebook's claims to EXPECTED"
