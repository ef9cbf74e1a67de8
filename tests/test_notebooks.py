"""The notebooks run: each one's code cells, in order, in one namespace (CPU here; the cells
pick CUDA when it is there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code cells"
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name} cell {i}", "exec"), namespace)
    assert capsys.readouterr().out  # the cells print what they show
