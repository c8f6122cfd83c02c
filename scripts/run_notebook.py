#!/usr/bin/env python3
"""Run a notebook's code cells top to bottom in one namespace, without Jupyter (a CI check that the
notebook still runs): python scripts/run_notebook.py notebooks/topk.ipynb [--cwd notebooks]

Plots go to the non-interactive Agg backend; where matplotlib is not installed, a stub that accepts
every call stands in for it (the cells' data handling still runs) and the script says so.
Exits 1 with the failing cell's number and source on an exception."""
import argparse
import json
import os
import sys
import traceback
import types


class _Anything:
    """Accepts any attribute, call, index or iteration (a stand-in for matplotlib objects)."""

    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *a, **k):
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __iter__(self):
        return iter([_Anything() for _ in range(64)])


def _stub_matplotlib():
    mpl = types.ModuleType("matplotlib")
    plt = types.ModuleType("matplotlib.pyplot")

    def subplots(nrows=1, ncols=1, **kw):
        import numpy as np

        axes = np.empty((nrows, ncols), dtype=object)
        for idx in np.ndindex(axes.shape):
            axes[idx] = _Anything()
        return _Anything(), axes

    plt.subplots = subplots
    plt.__getattr__ = lambda name: _Anything()
    mpl.pyplot = plt
    mpl.use = lambda *a, **k: None
    sys.modules["matplotlib"], sys.modules["matplotlib.pyplot"] = mpl, plt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebook")
    p.add_argument("--cwd", default=None, help="working directory of the cells (default: the notebook's folder)")
    a = p.parse_args(argv)
    with open(a.notebook) as f:
        nb = json.load(f)
    os.chdir(a.cwd or os.path.dirname(os.path.abspath(a.notebook)))
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("run_notebook: matplotlib is not installed: plots are stubbed out", flush=True)
        _stub_matplotlib()
    ns = {"__name__": "__main__"}
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(cells, 1):
        src = "".join(cell["source"])
        try:
            exec(compile(src, f"<cell {i}>", "exec"), ns)
        except Exception:
            traceback.print_exc()
            print(f"run_notebook: code cell {i} of {len(cells)} failed:\n{src}", file=sys.stderr)
            return 1
    print(f"run_notebook: {len(cells)} code cells ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
