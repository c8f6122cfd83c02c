"""The notebooks run: every code cell of notebooks/*.ipynb, in order, in a fresh interpreter, through
scripts/run_notebook.py (matplotlib's Agg backend), from the notebooks directory, as a reader running
them top to bottom would. Skipped without matplotlib or torch (the notebooks' own dependencies, pip
install .[notebook]: the runner's matplotlib stand-in does not get through every plotting cell)."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_notebook.py"), str(path), "--cwd", str(path.parent)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{path.name}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
