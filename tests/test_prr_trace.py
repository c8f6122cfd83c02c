"""gvr.data.block_score_trace: PRR's per-block importance traces (pure NumPy): shapes, determinism,
layers, the persistence knob's monotone effect on the step-to-step Top-K overlap, bad arguments."""
import numpy as np
import pytest

from gvr import data


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_shape_dtype_determinism():
    x = data.block_score_trace(30, 50, seed=4)
    assert x.shape == (30, 50) and x.dtype == np.float32 and np.all(np.isfinite(x))
    assert _same_bits(x, data.block_score_trace(30, 50, seed=4))
    assert not np.array_equal(x, data.block_score_trace(30, 50, seed=5))
    # a longer trace extends a shorter one (the streams are drawn in step order per dimension)
    y = data.block_score_trace(30, 50, seed=4, persistence=0.5, drift=0.1, noise=0.2)
    assert _same_bits(y, data.block_score_trace(30, 50, seed=4, persistence=0.5, drift=0.1, noise=0.2))


def test_layers():
    x = data.block_score_trace(12, 20, seed=1, layers=4)
    assert x.shape == (4, 12, 20) and x.dtype == np.float32
    assert data.block_trace_persistence(4, 0.9) == (data.WEAK_PERSISTENCE, 0.9, 0.9, 0.9)
    assert data.block_trace_persistence(1, 0.8) == (0.8,)
    assert data.block_trace_persistence(8, 0.9)[:3] == (data.WEAK_PERSISTENCE,) * 2 + (0.9,)
    assert not np.array_equal(x[1], x[2])  # every layer its own stream
    y = data.block_score_trace(12, 20, seed=1, layers=[0.3, 0.9])
    assert _same_bits(y[0], x[0]) and _same_bits(y[1], x[1])
    assert _same_bits(data.block_score_trace(12, 20, seed=1, layers=1)[0], data.block_score_trace(12, 20, seed=1))
    assert data.block_score_trace(0, 5).shape == (0, 5) and data.block_score_trace(3, 0).shape == (3, 0)


def test_positional_structure_sink_and_recent_blocks():
    x = data.block_score_trace(200, 128, seed=0)
    k = 8
    top = np.argsort(-x, axis=1, kind="stable")[:, :k]
    frac = np.mean([np.isin([0, 127], r).mean() for r in top])
    assert frac > 0.8  # the sink and the most recent block are nearly always selected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_persistence_knob_is_monotone(seed):
    k = 16
    ov = [data.trace_overlaps(list(data.block_score_trace(128, 256, persistence=p, seed=seed)), k).mean()
          for p in (0.0, 0.4, 0.7, 0.9, 1.0)]
    assert all(a + 0.05 < b for a, b in zip(ov[:-2], ov[1:-1])), ov  # steps of ~0.1 in expectation
    assert ov[0] < 0.35 and ov[-2] > 0.6 and ov[-1] > ov[-3], ov


def test_weak_layers_persist_less():
    x = data.block_score_trace(96, 256, seed=3, layers=4)
    ov = [data.trace_overlaps(list(x[i]), 16).mean() for i in range(4)]
    assert ov[0] < min(ov[1:]) - 0.15, ov


@pytest.mark.parametrize("kw, exc", [
    (dict(steps=-1), ValueError), (dict(num_blocks=2.0), TypeError), (dict(persistence=1.5), ValueError),
    (dict(persistence=float("nan")), TypeError), (dict(noise=-1.0), ValueError), (dict(layers=0), ValueError),
    (dict(layers=[]), ValueError), (dict(layers=[0.5, 2.0]), ValueError), (dict(layers=True), TypeError),
])
def test_bad_arguments(kw, exc):
    args = dict(steps=4, num_blocks=8)
    args.update(kw)
    steps, nb = args.pop("steps"), args.pop("num_blocks")
    with pytest.raises(exc):
        data.block_score_trace(steps, nb, **args)
