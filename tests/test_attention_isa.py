"""The instruction-set variants of the CPU attention loops (csrc/cpu/attention_cpu_chunk.h): generic C, and
AVX2 + FMA on x86-64 CPUs that have them, picked once per process (gvr._C.cpu_isa() names it);
GVR_CPU_ISA=generic in the environment forces the generic loops.

Both variants are held to the float64 reference: this process runs the one its CPU picks, and
test_generic_loops_pass_the_attention_tests reruns test_attention.py and this file in a child process
with GVR_CPU_ISA=generic (when this process runs another variant). The shapes here take the loops'
edge paths: D not a multiple of 16 (the dot products' last lanes, the weighted-V tail), GQA groups
of 3 and 5 query heads (tiles of 2 heads, and 4 plus a remainder), chunks that end mid-tile. Results
must not depend on the thread count, which decides how KV heads are grouped into units."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gvr
from attention_reference import check_state, make_case
from reference import same_bits

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


def child_env(**extra):
    """The environment of a child interpreter that imports the same gvr as this session (the
    installed package, or the in-place build: conftest.py); PYTHONSAFEPATH=1 keeps `-m` from putting
    the working directory, where the source tree could shadow an installed gvr, first on sys.path."""
    env = dict(os.environ, PYTHONSAFEPATH="1", OPENBLAS_NUM_THREADS="1", **extra)
    gvr_home = os.path.dirname(os.path.dirname(os.path.abspath(gvr.__file__)))
    if os.path.samefile(gvr_home, REPO_ROOT):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def test_cpu_isa_names_the_variant_and_the_override_forces_generic():
    assert gvr._C.cpu_isa() in ("avx2", "generic")
    proc = subprocess.run([sys.executable, "-c", "import gvr; print(gvr._C.cpu_isa())"], cwd=REPO_ROOT,
                          env=child_env(GVR_CPU_ISA="generic"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "generic"


def test_unknown_cpu_isa_value_warns_and_is_ignored():
    code = ("import warnings; warnings.simplefilter('always'); import gvr, sys; "
            "sys.stdout.write(gvr._C.cpu_isa())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=child_env(GVR_CPU_ISA="avx512"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "GVR_CPU_ISA='avx512'" in proc.stderr and "RuntimeWarning" in proc.stderr, proc.stderr
    auto = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=child_env(GVR_CPU_ISA="auto"),
                          capture_output=True, text=True, timeout=120)
    assert auto.returncode == 0 and "GVR_CPU_ISA" not in auto.stderr, auto.stderr
    assert proc.stdout == auto.stdout  # ignored: the best the CPU runs


@pytest.mark.parametrize("D", [19, 97])
@pytest.mark.parametrize("gqa", [3, 5])
@pytest.mark.parametrize("Hsel", ["1", "Hkv"])
def test_edge_shapes_against_the_reference(D, gqa, Hsel):
    rng = np.random.default_rng(D * 10 + gqa)
    Hkv = 3
    for paged in (True, False):
        c = make_case(rng, B=2, Hq=gqa * Hkv, Hkv=Hkv, D=D, P=16, block_size=4 if paged else 1, paged=paged,
                      n=29 if paged else 211, Hsel=1 if Hsel == "1" else Hkv)
        q, k, v, idx, kw = c.args("numpy")
        out, lse = gvr.sparse_attention(q, k, v, idx, **kw)
        check_state(c, out, lse, what=f"D={D} gqa={gqa} Hsel={Hsel} paged={paged} [{gvr._C.cpu_isa()}]")


def test_bits_do_not_depend_on_the_thread_count():
    """B = 1, Hkv = 4: 1, 2 and 4 threads put 4, 2 and 1 KV heads in a unit; a shared selection
    (Hsel = 1) computes a unit's heads together."""
    rng = np.random.default_rng(7)
    old = gvr.get_num_threads()
    try:
        for Hsel, D in ((1, 97), (4, 97), (1, 128)):
            c = make_case(rng, B=1, Hq=12, Hkv=4, D=D, P=16, paged=False, n=1500, Hsel=Hsel, extra_pages=120)
            q, k, v, idx, kw = c.args("numpy")
            results = []
            for nt in (1, 2, 4):
                gvr.set_num_threads(nt)
                out, lse = gvr.sparse_attention(q, k, v, idx, **kw)
                po, pl = np.empty((1, 12, 1500, D), np.float32), np.empty((1, 12, 1500), np.float32)
                gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
                results.append((out, lse, po, pl))
            for nt, r in zip((2, 4), results[1:]):
                for a, b, name in zip(results[0], r, ("out", "lse", "partial out", "partial lse")):
                    assert same_bits(a, b), f"Hsel={Hsel} D={D}: {name} with {nt} threads differs from 1 thread"
    finally:
        gvr.set_num_threads(0 if old == os.cpu_count() else old)


def test_generic_loops_pass_the_attention_tests():
    if gvr._C.cpu_isa() == "generic":
        pytest.skip("this process runs the generic loops already")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           os.path.join(TESTS_DIR, "test_attention.py"), os.path.join(TESTS_DIR, "test_attention_isa.py"),
           "-k", "not generic_loops_pass"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(GVR_CPU_ISA="generic"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
