"""`python -m gvr` (the README's demo) runs, and reports every step exact; k = 0 works; an
unreachable overlap target is reported with the measured value."""
import os
import re
import subprocess
import sys

import gvr

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_demo(*args):
    env = dict(os.environ)
    # The child must import the same gvr as this test session: the installed package, or the
    # in-place build when gvr is not installed (conftest.py). `python -m` puts the working
    # directory (the repo root) first on sys.path, where the source tree would shadow an
    # installed gvr; PYTHONSAFEPATH=1 (Python >= 3.11) drops that entry.
    env["PYTHONSAFEPATH"] = "1"
    gvr_home = os.path.dirname(os.path.dirname(os.path.abspath(gvr.__file__)))
    if os.path.samefile(gvr_home, REPO_ROOT):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env["OPENBLAS_NUM_THREADS"] = "1"  # gvr.data's matmuls: no oversubscription on small CI machines
    proc = subprocess.run([sys.executable, "-m", "gvr", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"exit status {proc.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{proc.stderr}"
    return out


def assert_all_exact(out, steps):
    rows = re.findall(r"^\s*(\d+)\s+\d+\s.*exact: (yes|no)\s*$", out, re.M)
    assert [int(t) for t, _ in rows] == list(range(steps)), out
    assert all(ok == "yes" for _, ok in rows), out
    assert "exact: no" not in out, out
    assert "all exact: yes" in out, out


def test_demo_cpu_small():
    out = run_demo("--n", "4096", "--k", "256", "--steps", "3", "--device", "cpu")
    assert_all_exact(out, 3)


def test_demo_k_zero():
    out = run_demo("--n", "3000", "--k", "0", "--steps", "2", "--device", "cpu")
    assert_all_exact(out, 2)


def test_demo_says_when_the_overlap_cannot_be_reached():
    out = run_demo("--n", "4096", "--k", "256", "--steps", "3", "--overlap", "0", "--device", "cpu")
    m = re.search(r"requested overlap 0\.00 cannot be reached: below chance level .*; measured (\d\.\d\d)", out)
    assert m and float(m.group(1)) > 0.0, out
    assert_all_exact(out, 3)


def test_prr_demo_cpu_small():
    """`python -m gvr prr`: PRR's exact mode equals serial attention over the selected set at every step."""
    out = run_demo("prr", "--context", "2048", "--layers", "2", "--steps", "3", "--k", "8", "--block-size", "16",
                   "--device", "cpu")
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+exact: (yes|no)\s*$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2], out
    assert [int(r[1]) for r in rows] == [2048, 2049, 2050], out
    assert all(r[4] == "yes" for r in rows) and "all exact: yes" in out, out
    assert all(0.0 <= float(r[j]) <= 1.0 for r in rows for j in (2, 3)), out
    assert float(rows[0][2]) == 0.0 and float(rows[0][3]) == 0.0, out  # step 0: no prediction


def test_prr_demo_budget_zero():
    out = run_demo("prr", "--context", "1000", "--layers", "1", "--steps", "2", "--k", "4", "--block-size", "16",
                   "--budget", "0", "--device", "cpu")
    assert "all exact: yes" in out, out
