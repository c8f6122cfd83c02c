"""Tests for gvr.data (synthetic score generators). Pure NumPy, ~10 s."""

import numpy as np
import pytest

from gvr import data

F32 = np.finfo(np.float32)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _true_topk(row, k):
    """Indices of the k largest values (test's own reference)."""
    row = np.asarray(row)
    if k >= row.size:
        return np.arange(row.size)
    return np.argsort(row, kind="stable")[row.size - k:]


def _mean_overlap(rows, k):
    idx = [set(_true_topk(r, k).tolist()) for r in rows]
    return float(np.mean([len(a & b) / len(a) for a, b in zip(idx[:-1], idx[1:])]))


# --------------------------------------------------------------------------
# i.i.d. scores
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dist", ["normal", "uniform", "exponential"])
def test_iid_scores_shape_dtype_determinism(dist):
    a = data.iid_scores(3, 1000, dist=dist, seed=5)
    assert a.shape == (3, 1000) and a.dtype == np.float32
    assert np.all(np.isfinite(a))
    assert _same_bits(a, data.iid_scores(3, 1000, dist=dist, seed=5))
    assert not np.array_equal(a, data.iid_scores(3, 1000, dist=dist, seed=6))
    assert not np.array_equal(a[0], a[1])  # rows differ
    if dist == "uniform":
        assert a.min() >= 0.0 and a.max() < 1.0
    if dist == "exponential":
        assert a.min() >= 0.0
    if dist == "normal":
        assert a.min() < 0.0 < a.max()


def test_iid_scores_edge_shapes_and_bad_dist():
    assert data.iid_scores(0, 10).shape == (0, 10)
    assert data.iid_scores(2, 0).shape == (2, 0)
    with pytest.raises(ValueError):
        data.iid_scores(1, 10, dist="cauchy")


# --------------------------------------------------------------------------
# Adversarial rows
# --------------------------------------------------------------------------
SIZES = [0, 1, 2, 3, 17, 511, 2047, 2048, 2049, 2050, 10000]


def test_adversarial_kinds_tuple():
    expected = {
        "all_equal", "ties_at_kth", "few_distinct", "neg_inf_mask", "all_neg_inf", "nan",
        "nan_heavy", "signed_zeros", "inf", "denormals_and_extremes", "sorted_ascending",
        "sorted_descending",
    }
    assert isinstance(data.ADVERSARIAL_KINDS, tuple)
    assert set(data.ADVERSARIAL_KINDS) == expected
    with pytest.raises(ValueError):
        data.adversarial("bogus", 10)


@pytest.mark.parametrize("kind", data.ADVERSARIAL_KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_adversarial_shape_dtype_determinism(kind, n):
    x = data.adversarial(kind, n, k=2048, seed=1)
    assert x.dtype == np.float32 and x.shape == (n,)
    assert _same_bits(x, data.adversarial(kind, n, k=2048, seed=1))


@pytest.mark.parametrize(
    "kind", [kd for kd in data.ADVERSARIAL_KINDS if kd not in ("all_equal", "all_neg_inf")]
)
def test_adversarial_seeds_differ(kind):
    a = data.adversarial(kind, 10000, seed=1)
    b = data.adversarial(kind, 10000, seed=2)
    assert not _same_bits(a, b)


@pytest.mark.parametrize("n", [1, 5, 3000])
def test_all_equal_and_all_neg_inf(n):
    x = data.adversarial("all_equal", n)
    assert np.all(x == x[0]) and np.isfinite(x[0])
    assert np.all(np.isneginf(data.adversarial("all_neg_inf", n)))


@pytest.mark.parametrize("n,k", [(10000, 2048), (65536, 2048), (2050, 2048), (600, 100), (40, 7)])
def test_ties_at_kth_straddle_boundary(n, k):
    x = data.adversarial("ties_at_kth", n, k=k, seed=3)
    s = np.sort(x)[::-1]
    v = s[k - 1]  # the k-th largest value
    inside = np.count_nonzero(s[:k] == v)
    outside = np.count_nonzero(s[k:] == v)
    assert inside >= 2 and outside >= 2
    if n >= 4096:
        assert inside + outside >= 256
    assert np.unique(x).size > 2  # not just a constant row


def test_ties_at_kth_small_n_still_ties():
    x = data.adversarial("ties_at_kth", 5, k=2048)
    v = np.sort(x)[0]  # k > n: the n-th largest is the "k-th" value
    assert np.count_nonzero(x == v) >= 2


def test_few_distinct():
    x = data.adversarial("few_distinct", 10000)
    u = np.unique(x)
    assert 2 <= u.size <= 4 and np.all(np.isfinite(u))


@pytest.mark.parametrize("n", [2, 17, 10000])
def test_neg_inf_mask(n):
    x = data.adversarial("neg_inf_mask", n)
    assert np.any(np.isneginf(x))
    assert not np.any(np.isnan(x)) and not np.any(np.isposinf(x))
    assert np.isneginf(x[-1])  # masked tail
    if n >= 1000:
        frac = np.mean(np.isneginf(x))
        assert 0.5 <= frac < 0.9 and np.any(np.isfinite(x))


@pytest.mark.parametrize("n", [1, 2, 100, 10000])
def test_nan(n):
    x = data.adversarial("nan", n)
    assert np.any(np.isnan(x))
    if n >= 100:
        assert np.mean(np.isnan(x)) < 0.5 and np.any(np.isfinite(x))


@pytest.mark.parametrize("n,k", [(1, 2048), (100, 2048), (2048, 2048), (3000, 2048), (65536, 2048), (1000, 10)])
def test_nan_heavy_more_nans_than_n_minus_k(n, k):
    x = data.adversarial("nan_heavy", n, k=k)
    nn = np.count_nonzero(np.isnan(x))
    assert nn > n - k and nn >= 1
    if n >= 100:
        assert np.any(np.isfinite(x))


def test_signed_zeros():
    x = data.adversarial("signed_zeros", 10000, k=2048)
    zeros = x == 0.0
    assert np.any(zeros & np.signbit(x)) and np.any(zeros & ~np.signbit(x))
    assert np.any(x > 0) and np.any(x < 0)
    assert np.sort(x)[::-1][2047] == 0.0  # the k-th largest is a (signed) zero
    assert np.mean(zeros) > 0.5


def test_inf():
    x = data.adversarial("inf", 10000, k=2048)
    assert np.any(np.isposinf(x)) and np.any(np.isneginf(x)) and np.any(np.isfinite(x))
    assert np.count_nonzero(np.isposinf(x)) < 2048
    assert not np.any(np.isnan(x))


def test_denormals_and_extremes():
    x = data.adversarial("denormals_and_extremes", 10000)
    ax = np.abs(x)
    assert np.any((ax > 0) & (ax < F32.tiny))  # subnormals
    assert np.any(x == F32.max) and np.any(x == -F32.max)
    assert np.any(x == F32.smallest_subnormal)
    assert np.all(np.isfinite(x))


def test_sorted_kinds():
    a = data.adversarial("sorted_ascending", 5000)
    d = data.adversarial("sorted_descending", 5000)
    assert np.all(np.diff(a) >= 0) and np.all(np.diff(d) <= 0)
    assert np.array_equal(a, d[::-1])
    assert np.unique(a).size > 4000


# --------------------------------------------------------------------------
# ragged_lengths / topk_overlap / YaRN
# --------------------------------------------------------------------------
def test_ragged_lengths():
    n, k = 65536, 2048
    r = data.ragged_lengths(16, n, k=k, seed=0)
    assert r.dtype == np.int32 and r.shape == (16,)
    assert r.min() >= 0 and r.max() <= n
    assert 0 in r and n in r and np.any((r > 0) & (r < k))
    assert _same_bits(r, data.ragged_lengths(16, n, k=k, seed=0))
    assert not np.array_equal(r, data.ragged_lengths(16, n, k=k, seed=1))
    small = data.ragged_lengths(4, 3, seed=0)
    assert small.min() >= 0 and small.max() <= 3
    assert np.all(data.ragged_lengths(3, 0) == 0)
    assert data.ragged_lengths(0, 10).shape == (0,)


def test_topk_overlap():
    assert data.topk_overlap([1, 2, 3, 4], [4, 3, 9, 8]) == pytest.approx(0.5)
    assert data.topk_overlap([1, 2, -1, -1], [2, 1, 7, -1]) == pytest.approx(1.0)
    assert data.topk_overlap([-1, 5], [-1, 6]) == pytest.approx(0.0)
    assert data.topk_overlap([-1, -1], [1, 2]) == 0.0
    assert data.topk_overlap(np.array([3, 3, 4]), np.array([3])) == pytest.approx(0.5)


def test_yarn_inv_freq():
    f = data.yarn_inv_freq(64)
    base = 10000.0 ** (-np.arange(32) * 2.0 / 64)
    assert f.shape == (32,)
    assert np.all(np.diff(f) < 0)
    np.testing.assert_allclose(f[:10], base[:10])  # high frequencies untouched
    np.testing.assert_allclose(f[23:], base[23:] / 40.0)  # low ones interpolated
    assert np.all(f <= base + 1e-15) and np.all(f >= base / 40.0 - 1e-15)


# --------------------------------------------------------------------------
# Decode traces
# --------------------------------------------------------------------------
def test_decode_trace_shapes_and_determinism():
    kw = dict(k=64, rho=0.8, heads=8, dim=32)
    rows = list(data.decode_trace(1000, 5, seed=11, **kw))
    assert [r.shape for r in rows] == [(1000 + t,) for t in range(5)]
    assert all(r.dtype == np.float32 and np.all(np.isfinite(r)) for r in rows)
    again = list(data.decode_trace(1000, 5, seed=11, **kw))
    assert all(_same_bits(a, b) for a, b in zip(rows, again))
    other = list(data.decode_trace(1000, 5, seed=12, **kw))
    assert not any(np.array_equal(a, b) for a, b in zip(rows, other))
    # a shorter trace is a prefix of a longer one
    short = list(data.decode_trace(1000, 3, seed=11, **kw))
    assert all(_same_bits(a, b) for a, b in zip(short, rows))
    # consecutive rows are not copies of each other
    assert not np.array_equal(rows[0], rows[1][:1000])


def test_decode_trace_default_dims_small_n():
    rows = list(data.decode_trace(4096, 3, k=128, rho=0.5, seed=0))
    assert [r.size for r in rows] == [4096, 4097, 4098]
    assert all(r.dtype == np.float32 for r in rows)
    assert np.unique(rows[0]).size > 3000  # a real score landscape, not constant


def test_decode_trace_batch():
    kw = dict(k=64, rho=0.7, heads=8, dim=32)
    steps = data.decode_trace_batch(3, 800, 4, seed=2, **kw)
    assert len(steps) == 4
    assert [s.shape for s in steps] == [(3, 800 + t) for t in range(4)]
    assert all(s.dtype == np.float32 for s in steps)
    single = list(data.decode_trace(800, 4, seed=2, **kw))
    assert all(_same_bits(s[0], r) for s, r in zip(steps, single))
    assert not np.array_equal(steps[0][0], steps[0][1])  # independent rows
    again = data.decode_trace_batch(3, 800, 4, seed=2, **kw)
    assert all(_same_bits(a, b) for a, b in zip(steps, again))
    assert data.decode_trace_batch(0, 800, 2, **kw)[1].shape == (0, 801)


def test_decode_trace_tiny_and_k_ge_n():
    rows = list(data.decode_trace(0, 3, k=4, overlap=0.45, heads=2, dim=4))
    assert [r.size for r in rows] == [0, 1, 2]
    rows = list(data.decode_trace(10, 2, k=64, overlap=0.3, heads=2, dim=4))
    assert [r.size for r in rows] == [10, 11]
    assert list(data.decode_trace(100, 0, k=8, rho=0.5)) == []


def test_decode_trace_bad_args():
    with pytest.raises(ValueError):
        data.decode_trace(100, 2, k=8, rho=1.5)
    with pytest.raises(ValueError):
        data.decode_trace(100, 2, k=8, overlap=1.2)
    with pytest.raises(ValueError):
        data.decode_trace(100, 2, k=0, rho=0.5)
    with pytest.raises(ValueError):
        data.decode_trace(100, 2, k=8, rho=0.5, dim=7)


def test_rho_controls_overlap():
    n, k = 16384, 512
    lo = _mean_overlap(list(data.decode_trace(n, 6, k=k, rho=0.0, seed=4)), k)
    mid = _mean_overlap(list(data.decode_trace(n, 6, k=k, rho=0.8, seed=4)), k)
    hi = _mean_overlap(list(data.decode_trace(n, 6, k=k, rho=1.0, seed=4)), k)
    assert lo < mid < hi
    assert lo < 0.1 and hi > 0.7


@pytest.mark.parametrize("target,tol", [(0.45, 0.08), (0.02, 0.08), (0.7, 0.1)])
def test_overlap_knob_calibrated(target, tol):
    n, k = 16384, 512
    rows = list(data.decode_trace(n, 8, k=k, overlap=target, seed=0))
    assert [r.size for r in rows] == [n + t for t in range(8)]
    measured = _mean_overlap(rows, k)
    assert abs(measured - target) <= tol, (target, measured)
    # the module's own helper agrees with the test's reference
    assert np.mean(data.trace_overlaps(rows, k)) == pytest.approx(measured, abs=1e-3)
    # explicit rho reproduces the calibrated trace bit-for-bit
    rho = data.rho_for_overlap(target, n, k=k, seed=0)
    assert 0.0 <= rho <= 1.0
    again = list(data.decode_trace(n, 8, k=k, rho=rho, seed=0))
    assert all(_same_bits(a, b) for a, b in zip(rows, again))


def test_overlap_knob_batch_rows():
    n, k, target = 16384, 512, 0.45
    steps = data.decode_trace_batch(2, n, 8, k=k, overlap=target, seed=7)
    for b in range(2):
        measured = _mean_overlap([s[b] for s in steps], k)
        assert abs(measured - target) <= 0.08, (b, measured)
