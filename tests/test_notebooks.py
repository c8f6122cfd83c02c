"""The notebooks run: every code cell of notebooks/*.ipynb executed in order in a fresh interpreter
(matplotlib's Agg backend, from the notebooks directory), as a reader running them top to bottom would.
Skipped where matplotlib or torch (which the notebooks use) is missing."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

RUNNER = """
import json, sys
nb = json.load(open(sys.argv[1]))
g = {"__name__": "__main__"}
for i, c in enumerate(nb["cells"]):
    if c["cell_type"] == "code":
        exec(compile("".join(c["source"]), f"{sys.argv[1]} cell {i}", "exec"), g)
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")
    env = dict(os.environ, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path)], cwd=path.parent, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{path.name}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert json.loads(path.read_text())["cells"], path
