"""`python -m gvr` (the README's demo) runs, and reports every step exact."""
import os
import re
import subprocess
import sys

import gvr

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_cpu_small():
    steps = 3
    env = dict(os.environ)
    # The child must import the same gvr as this test session: the installed package, or the
    # in-place build when gvr is not installed (conftest.py). `python -m` puts the working
    # directory first on sys.path, which would shadow an installed gvr with the unbuilt source
    # tree; PYTHONSAFEPATH=1 (Python >= 3.11) drops that entry, and PYTHONPATH names gvr's home.
    gvr_home = os.path.dirname(os.path.dirname(os.path.abspath(gvr.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (gvr_home, env.get("PYTHONPATH")) if p)
    env["PYTHONSAFEPATH"] = "1"
    env["OPENBLAS_NUM_THREADS"] = "1"  # gvr.data's matmuls: no oversubscription on small CI machines
    proc = subprocess.run(
        [sys.executable, "-m", "gvr", "--n", "4096", "--k", "256", "--steps", str(steps), "--device", "cpu"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit status {proc.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{proc.stderr}"
    rows = re.findall(r"^\s*(\d+)\s+\d+\s.*exact: (yes|no)\s*$", out, re.M)
    assert [int(t) for t, _ in rows] == list(range(steps)), out
    assert all(ok == "yes" for _, ok in rows), out
    assert "exact: no" not in out, out
    assert "all exact: yes" in out, out
