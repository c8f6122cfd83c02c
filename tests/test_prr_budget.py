"""gvr.prr.Budget: the speculation-budget table (profile on the CPU at toy sizes, ratio lookup, JSON round
trip, the shipped H100 table, bad inputs). Times are not checked (they are measurements); the structure
and the choice rule are: the chosen rho has the fastest measured step, 0 when no rho beats serial."""
import json

import pytest

import gvr
from harness import torch_or_none

torch = torch_or_none()
Budget = gvr.prr.Budget
TOY = dict(contexts=(256, 1024), ratios=(0.5, 1.0), Hq=4, Hkv=2, D=16, block_size=16, k=4, steps=2, replays=1,
           device="cpu")


@pytest.fixture(scope="module")
def toy():
    if torch is None:
        pytest.skip("Budget.profile needs torch")
    return Budget.profile(**TOY)


def test_profile_table_and_choice(toy, tmp_path):
    t = toy.table
    assert t["device"] == "cpu" and t["ratios"] == [0.5, 1.0] and toy.contexts == [256, 1024]
    for ctx, row in t["contexts"].items():
        assert set(row) == {"select_us", "serial_us", "spec_us", "prr_us", "hit_rate", "best"}
        assert row["select_us"] > 0 and row["serial_us"] > 0
        assert set(row["prr_us"]) == set(row["spec_us"]) == set(row["hit_rate"]) == {"0.5", "1.0"}
        assert all(0.0 <= h <= 1.0 for h in row["hit_rate"].values())
        faster = {float(r): us for r, us in row["prr_us"].items() if us < row["serial_us"]}
        assert row["best"] == (min(faster, key=lambda r: (faster[r], r)) if faster else 0.0)
        assert toy.ratio(int(ctx)) == row["best"]
    p = tmp_path / "budget.json"
    toy.save(p)
    again = Budget.load(p)
    assert again.table == json.loads(p.read_text()) and again.contexts == toy.contexts
    assert all(again.ratio(c) == toy.ratio(c) for c in (1, 200, 256, 500, 513, 1024, 10**9))


def test_ratio_picks_the_nearest_context_on_a_log_scale():
    b = Budget({"contexts": {"1024": {"best": 0.25}, "4096": {"best": 1.0}, "65536": {"best": 0.0}}})
    assert b.ratio(1) == 0.25 and b.ratio(1024) == 0.25 and b.ratio(2047) == 0.25
    assert b.ratio(2048) == 0.25  # equidistant (log): the smaller context
    assert b.ratio(2049) == 1.0 and b.ratio(16384) == 1.0 and b.ratio(16385) == 0.0 and b.ratio(10**9) == 0.0


def test_default_is_a_measured_table():
    b = Budget.default()
    assert b.table["device"].startswith("NVIDIA H")
    assert b.contexts == sorted(b.contexts) and len(b.contexts) >= 3
    for row in b.table["contexts"].values():
        assert row["best"] == 0.0 or row["prr_us"][str(row["best"])] < row["serial_us"]


def test_bad_inputs():
    with pytest.raises(ValueError, match="'table'"):
        Budget({})
    with pytest.raises(ValueError, match="'table'"):
        Budget({"contexts": {"x": {"best": 1}}})
    with pytest.raises(ValueError, match="'table'"):
        Budget({"contexts": {"1024": {"best": -1.0}}})
    b = Budget({"contexts": {"1024": {"best": 0.5}}})
    with pytest.raises(TypeError, match="'context_len'"):
        b.ratio(1.5)
    with pytest.raises(ValueError, match="'context_len'"):
        b.ratio(0)
    with pytest.raises(ValueError, match="'ratios'"):
        Budget.profile(**{**TOY, "ratios": (0.0,)})
    with pytest.raises(ValueError, match="'contexts'"):
        Budget.profile(**{**TOY, "contexts": (16,)})
    with pytest.raises(ValueError, match="'Hq'"):
        Budget.profile(**{**TOY, "Hq": 3})
    with pytest.raises(ValueError, match="'steps'"):
        Budget.profile(**{**TOY, "steps": 0})
