"""Bad input to the command-line demos (usage error, exit status 2, never a traceback), gvr.prr.Budget (checked
before anything is measured; the table copied and validated), gvr.data's generators and gvr.TopKDecoder (named
TypeError / ValueError; NumPy integers accepted where ints are)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gvr
import gvr.__main__ as demo
from gvr import _prr_demo as prr_demo
from gvr import data

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE = str(10**20)


# --------------------------------------------------------------------------------------------------------------
# python -m gvr / python -m gvr prr
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, option", [
    (["--seed", "-1"], "--seed"), (["--seed", str(2**64)], "--seed"),
    (["--threads", HUGE], "--threads"), (["--n", HUGE], "--n"), (["--k", HUGE], "--k"), (["--steps", HUGE], "--steps"),
    (["--n", str(2**31 - 1), "--steps", "2"], "--n"),
])
def test_demo_bad_arguments_are_usage_errors(args, option, capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(args)
    assert e.value.code == 2
    assert f"error: {option}" in capsys.readouterr().err


@pytest.mark.parametrize("args, option", [
    (["--budget", "nan"], "--budget"), (["--budget", "inf"], "--budget"), (["--seed", "-1"], "--seed"),
    (["--threads", HUGE], "--threads"), (["--context", HUGE], "--context"), (["--batch", HUGE], "--batch"),
    (["--dim", HUGE], "--dim"), (["--k", HUGE], "--k"), (["--heads", HUGE, "1"], "--heads"),
    (["--heads", "4", HUGE], "--heads"), (["--layers", HUGE], "--layers"), (["--block-size", HUGE], "--block-size"),
    (["--steps", HUGE], "--steps"), (["--context", str(2**31 - 1), "--steps", "2"], "--context"),
    (["--batch", str(2**31 - 1)], "--context, --batch"),  # caches far beyond any machine's memory
])
def test_prr_demo_bad_arguments_are_usage_errors(args, option, capsys):
    with pytest.raises(SystemExit) as e:
        prr_demo.parse_args(args + ["--device", "cpu"])
    assert e.value.code == 2
    assert f"error: {option}" in capsys.readouterr().err


def test_prr_demo_k_past_the_cache_is_clamped():
    """more blocks than the cache holds select nothing more: k is the cache's blocks (main prints a note)"""
    a = prr_demo.parse_args(["--k", "2000", "--context", "1024", "--block-size", "16", "--device", "cpu"])
    assert a.k == prr_demo._geometry(a)[2] < 2000 and a.k_asked == 2000
    assert prr_demo.parse_args(["--context", "256", "--device", "cpu"]).k == prr_demo._geometry(
        prr_demo.parse_args(["--context", "256", "--device", "cpu"]))[2]  # default k 32 over 9 blocks


def test_seed_forms_default_rng_takes_still_work():
    for seed in (None, np.random.SeedSequence(5), [1, 2]):
        assert data.iid_scores(2, 8, seed=seed).shape == (2, 8)
        assert data.ragged_lengths(2, 100, seed=seed).shape == (2,)
    assert np.array_equal(data.iid_scores(2, 8, seed=-1), data.iid_scores(2, 8, seed=2**64 - 1))


def test_demo_defaults_still_parse():
    assert demo.parse_args([]).seed == 0
    a = prr_demo.parse_args(["--budget", "1e308", "--device", "cpu"])  # capped at the cache's blocks by the runtime
    assert a.budget == 1e308


@pytest.mark.parametrize("args", [["prr", "--budget", "nan"], ["prr", "--seed", "-1"], ["--n", HUGE]])
def test_cli_exits_2_without_traceback(args):
    env = dict(os.environ, PYTHONSAFEPATH="1")  # import the gvr this session imports (see test_demo.py)
    gvr_home = os.path.dirname(os.path.dirname(os.path.abspath(gvr.__file__)))
    if os.path.samefile(gvr_home, REPO_ROOT):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "gvr", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"error: {args[-2]}" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------------------------------------------
# gvr.prr.Budget
# --------------------------------------------------------------------------------------------------------------
Budget = gvr.prr.Budget
TOY = dict(contexts=(256,), ratios=(1.0,), Hq=4, Hkv=2, D=16, block_size=16, k=4, steps=1, replays=1, device="cpu")


@pytest.fixture
def no_measuring(monkeypatch):
    """Budget.profile must reject its arguments before it times anything."""
    from gvr import _harness

    def measured(*a, **kw):
        raise AssertionError("Budget.profile measured before checking its arguments")
    monkeypatch.setattr(_harness, "time_cpu", measured)
    monkeypatch.setattr(_harness, "CudaTimer", measured)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(contexts=(264,)), ValueError, "'contexts' must be multiples of 'block_size'"),  # 264 = 16 * 16.5
    (dict(contexts=(264,), batch=3), ValueError, "'contexts' must be multiples of 'block_size'"),
    (dict(contexts=(256.7,)), TypeError, "'contexts'"),
    (dict(contexts=(True,)), TypeError, "'contexts'"),
    (dict(contexts=256), TypeError, "'contexts'"),
    (dict(persistence=float("nan")), ValueError, "'persistence'"),
    (dict(persistence=2.0), ValueError, "'persistence'"),
    (dict(persistence="0.5"), TypeError, "'persistence'"),
    (dict(predictor="foo"), ValueError, "'predictor'"),
    (dict(mode="foo"), ValueError, "'mode'"),
    (dict(mode=None), TypeError, "'mode'"),
    (dict(Hq=2.0), TypeError, "'Hq'"),
    (dict(seed=1.5), TypeError, "'seed'"),
])
def test_profile_checks_arguments_first(kw, exc, match, no_measuring):
    with pytest.raises(exc, match=match):
        Budget.profile(**{**TOY, **kw})


def test_profile_checks_path_first(tmp_path, no_measuring):
    with pytest.raises(ValueError, match="'path'"):
        Budget.profile(**TOY, path=tmp_path)  # a directory
    with pytest.raises(ValueError, match="'path'"):
        Budget.profile(**TOY, path=tmp_path / "missing" / "b.json")
    with pytest.raises(TypeError, match="'path'"):
        Budget.profile(**TOY, path=3.5)
    # a writable path passes the check without leaving a file behind (the next check then fails)
    with pytest.raises(AssertionError, match="measured"):
        Budget.profile(**TOY, path=tmp_path / "b.json")
    assert not (tmp_path / "b.json").exists()
    (tmp_path / "old.json").write_text("keep\n")
    with pytest.raises(AssertionError, match="measured"):
        Budget.profile(**TOY, path=tmp_path / "old.json")
    assert (tmp_path / "old.json").read_text() == "keep\n"


def test_profile_takes_numpy_ints_and_any_int_seed(tmp_path):
    pytest.importorskip("torch")
    p = tmp_path / "b.json"
    b = Budget.profile(**{**TOY, "Hq": np.int64(4), "k": np.int32(4), "contexts": (np.int64(256),)}, seed=2**70,
                       path=p)
    setup = json.loads(p.read_text())["setup"]
    assert setup["Hq"] == 4 and setup["k"] == 4 and b.contexts == [256]


@pytest.mark.parametrize("contexts", [
    {"1024": {"best": True}},
    {"1024": {"best": 10**400}},
    {"1024": {"best": "0.5"}},
    {1024.5: {"best": 0.5}},
])
def test_table_bad_best_or_key(contexts):
    with pytest.raises(ValueError, match="'table': context"):
        Budget({"contexts": contexts})


def test_table_duplicate_contexts_after_normalisation():
    with pytest.raises(ValueError, match="'table': context '01024'"):
        Budget({"contexts": {"1024": {"best": 0.5}, "01024": {"best": 1.0}}})


def test_table_is_copied(tmp_path):
    t = {"device": "x", "contexts": {"1024": {"best": 0.5}}}
    b = Budget(t)
    t["contexts"]["1024"]["best"] = 9.0
    t["device"] = "y"
    assert b.table == {"device": "x", "contexts": {"1024": {"best": 0.5}}} and b.ratio(1024) == 0.5
    p = tmp_path / "b.json"
    b.save(p)
    assert json.loads(p.read_text())["contexts"]["1024"]["best"] == 0.5
    assert t["contexts"]["1024"]["best"] == 9.0  # the caller's dict is not touched


def test_save_does_not_truncate_on_a_bad_value(tmp_path):
    b = Budget({"contexts": {"1024": {"best": 0.5}}, "setup": {"bad": object()}})
    p = tmp_path / "b.json"
    p.write_text("previous\n")
    with pytest.raises(TypeError):
        b.save(p)
    assert p.read_text() == "previous\n"


# --------------------------------------------------------------------------------------------------------------
# gvr.data
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, exc, match", [
    (lambda: data.decode_trace(100.5), TypeError, "'n'"),
    (lambda: data.decode_trace("100"), TypeError, "'n'"),
    (lambda: data.decode_trace(100, 2.0, rho=0.5), TypeError, "'steps'"),
    (lambda: data.decode_trace(100, 2, k=8.0, rho=0.5), TypeError, "'k'"),
    (lambda: data.decode_trace(-1, 2, rho=0.5), ValueError, "'n'"),
    (lambda: data.decode_trace_batch(-1, 100, 2, rho=0.5), ValueError, "'batch'"),
    (lambda: data.iid_scores(-1, 10), ValueError, "'batch'"),
    (lambda: data.iid_scores(2, -10), ValueError, "'n'"),
    (lambda: data.iid_scores(2.5, 10), TypeError, "'batch'"),
    (lambda: data.ragged_lengths(-1, 10), ValueError, "'batch'"),
    (lambda: data.trace_overlaps([np.arange(10.0)] * 2, 0), ValueError, "'k'"),
    (lambda: data.trace_overlaps([np.arange(10.0)] * 2, 2.0), TypeError, "'k'"),
    (lambda: data.block_score_trace(4, 8, noise=1e308), ValueError, "'noise'"),
    (lambda: data.block_score_trace(4, 8, drift=1e308), ValueError, "'drift'"),
    (lambda: data.block_score_trace(4, 8, layers=2.0), TypeError, "'layers'"),
])
def test_data_bad_arguments_are_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_data_seeds_are_masked_like_the_other_generators():
    assert np.array_equal(data.iid_scores(2, 50, seed=-1), data.iid_scores(2, 50, seed=2**64 - 1))
    assert np.array_equal(data.ragged_lengths(8, 100, seed=-3), data.ragged_lengths(8, 100, seed=2**64 - 3))
    assert np.array_equal(data.iid_scores(2, 50, seed=5), np.random.default_rng(5).standard_normal((2, 50), np.float32))


def test_data_takes_numpy_ints():
    rows = list(data.decode_trace(np.int64(100), np.int32(2), k=np.int64(8), rho=0.5, heads=np.int64(2),
                                  dim=np.int64(4)))
    assert [r.size for r in rows] == [100, 101]
    assert data.iid_scores(np.int64(2), np.int32(3)).shape == (2, 3)
    assert data.trace_overlaps(rows, np.int64(8)).shape == (1,)
    assert data.block_score_trace(3, 4, noise=1e6).shape == (3, 4)  # the documented maximum


# --------------------------------------------------------------------------------------------------------------
# gvr.TopKDecoder
# --------------------------------------------------------------------------------------------------------------
def test_decoder_takes_numpy_ints():
    dec = gvr.TopKDecoder(np.int64(2), np.int32(2), np.int64(4), device="cpu")
    assert (dec.num_layers, dec.max_batch, dec.k) == (2, 2, 4) and type(dec.k) is int
    x = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
    got = dec(np.int64(1), x)
    assert got.shape == (2, 4)
    assert np.array_equal(dec.prediction(np.int64(1)), got) and dec.prediction(0) is None


def test_decoder_list_scores_is_a_type_error():
    dec = gvr.TopKDecoder(1, 2, 4, device="cpu")
    x = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
    with pytest.raises(TypeError, match="'scores' must be a float32.*array.*got list"):
        dec(0, x.tolist())
    assert dec.prediction(0) is None
