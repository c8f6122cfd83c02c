"""Synthetic score generators for testing and benchmarking exact Top-K.

Pure NumPy; every generator is deterministic for a given ``seed`` and returns
``float32`` arrays.

Public API
----------
Decode traces (DSA-indexer-like, temporally correlated rows)::

    decode_trace(n=65536, steps=8, *, k=2048, overlap=0.45, rho=None,
                 heads=64, dim=64, seed=0) -> Iterator[np.ndarray]
        yields 1-D rows of length n, n+1, ..., n+steps-1

    decode_trace_batch(batch, n=65536, steps=8, *, k=2048, overlap=0.45,
                       rho=None, heads=64, dim=64, seed=0) -> list[np.ndarray]
        ``steps`` arrays; array t has shape [batch, n+t]. Row b is an
        independent trace (own keys, weights, queries; calibrated on its
        own); row 0 equals ``decode_trace(..., seed=seed)``.

    rho_for_overlap(overlap, n, *, k=2048, heads=64, dim=64, seed=0, row=0)
        -> float: the calibrated query correlation rho for a target overlap.

    topk_overlap(prev_idx, cur_idx) -> float
    trace_overlaps(rows, k) -> np.ndarray       (per-step overlaps of a trace)
    yarn_inv_freq(dim=64, ...) -> np.ndarray    (YaRN-scaled RoPE frequencies)

Block-score traces (PRR: per-block importance over steps)::

    block_score_trace(steps, num_blocks, *, persistence=0.9, drift=0.05,
                      noise=0.35, seed=0, layers=None)
        -> float32 [steps, num_blocks] (or [L, steps, num_blocks])
    block_trace_persistence(layers, persistence) -> per-layer persistence
    WEAK_PERSISTENCE                              (weak layers' persistence)

Other rows::

    iid_scores(batch, n, *, dist="normal", seed=0) -> float32 [batch, n]
    adversarial(kind, n, *, k=2048, seed=0)       -> float32 [n]
    ADVERSARIAL_KINDS                             (tuple of the kinds)
    ragged_lengths(batch, n, *, k=2048, seed=0)   -> int32 [batch]

Decode-trace model
------------------
For decode step t (t = 0..steps-1) the query sits at position ``p = n + t``
and the row holds scores for key positions ``j = 0 .. n+t-1``::

    s_t[j] = sum_h w_h * relu(c * <R(p) q_{t,h}, R(j) k_j>)

* ``R(.)`` is RoPE (rotate-half layout) with YaRN-scaled frequencies
  (theta 10000, factor 40, original max position 4096, beta_fast 32,
  beta_slow 1); ``c = mscale^2 / sqrt(dim)`` with the YaRN temperature
  ``mscale = 0.1 ln(40) + 1``. ``c`` is a positive constant, so it changes
  magnitudes only, never the ranking.
* Keys are shared by all heads (MQA, as in DeepSeek's indexer). The content
  ``k_j`` is fixed per position for the whole trace: a LayerNorm-like vector of
  norm sqrt(dim), made of a shared direction (25% of the energy: it gives the
  rows the Toeplitz / RoPE positional structure) plus a per-position random
  direction. The fixed norm keeps "loud" keys from winning at every step.
* Queries (content space, before rotation) follow an AR(1) process
  ``q_t = rho q_{t-1} + sqrt(1 - rho^2) eps_t`` with stationary zero-mean
  Gaussian marginals; within a step, heads share 50% of their variance (heads
  come from one hidden state in a real model), and the content energy of
  RoPE pair i is tilted by 1 / (1 + (w_i / 0.25)^2), w_i its rotation per
  step in radians (little content in the fastest-rotating pairs, as in
  trained models; without it frozen queries cap the overlap near 0.72).
* ``w_h`` are fixed positive head weights (log-normal, seeded).

Overlap knob: ``overlap`` is the target mean fraction of step t-1's Top-k
indices that are also in step t's Top-k. It is mapped to ``rho`` per trace
row by a root search (Illinois regula falsi on sigma^1.5, sigma =
sqrt(1 - rho^2), where the overlap is close to linear) over a pilot made of the row's own
first ``PILOT_STEPS`` (16) steps: same keys, same query noise, same code, so
the pilot rows are bit-identical to the trace's, at the requested ``n`` and
``k``. Results are cached per (n, k, heads, dim, seed, row, overlap); about
1.5 s per row at n=65536 on 2 cores. An explicit ``rho`` skips calibration.
Reachable range: with rho = 0 consecutive queries are independent and the
overlap falls to chance level, about k / n (~0.03 at n=65536, k=2048; the
queries have zero mean, so no static positional prior is left); lower
targets (e.g. the paper's ~0.02 for layers 0-1) are clamped to rho = 0,
which is within 0.02 of them. With rho = 1 the query content is frozen and
only RoPE moves (one position per step): the maximum, about 0.85 at
k/n = 1/32; higher targets are clamped to rho = 1. Over 8 steps the measured
mean overlap is typically within +-0.03 of the target; rows scatter a bit
more after the pilot steps.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterator, List, Optional, Sequence

import numpy as np

from ._interop import check_int

__all__ = [
    "ADVERSARIAL_KINDS",
    "PILOT_STEPS",
    "WEAK_PERSISTENCE",
    "adversarial",
    "block_score_trace",
    "block_trace_persistence",
    "decode_trace",
    "decode_trace_batch",
    "iid_scores",
    "ragged_lengths",
    "rho_for_overlap",
    "topk_overlap",
    "trace_overlaps",
    "yarn_inv_freq",
]

# --------------------------------------------------------------------------
# RoPE / YaRN
# --------------------------------------------------------------------------
ROPE_THETA = 10000.0
YARN_FACTOR = 40.0
YARN_ORIGINAL_MAX_POSITION = 4096
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0

_KEY_SHARED_FRAC = 0.25  # energy fraction of the shared key direction
_HEAD_CORR = 0.5  # variance fraction shared by all heads of one query
_Q_LOWPASS = 0.25  # rad/step; query-content spectral tilt (see _TraceModel)
# Fixed-point grids (fractional bits) of the rotated q, k and of w. Products
# and all partial sums of the score are then integer multiples of
# 2^-(2*_QK_FRAC + _W_FRAC) far below 2^53 of them (bound: sum_h w_h |q_h| |k|
# ~ 150 at the defaults vs 2^13 allowed), so the float64 GEMM/GEMV is exact
# whatever the BLAS, its thread count or its summation order: rows are
# bit-reproducible across machines (up to the ~1e-12-probability case of a
# 1-ulp libm difference landing on a rounding tie before quantisation).
_QK_FRAC = 13
_W_FRAC = 14
_CHUNK = 1024  # key positions per GEMM block in _TraceModel.scores
PILOT_STEPS = 16  # decode steps used to calibrate rho for an overlap target
_CAL_TOL = 0.005  # stop calibration once |overlap - target| <= this
_CAL_MAX_ITERS = 14
_RHO_CACHE: dict = {}
_RHO_CACHE_MAX = 256


def yarn_inv_freq(
    dim: int = 64,
    *,
    theta: float = ROPE_THETA,
    factor: float = YARN_FACTOR,
    original_max_position: int = YARN_ORIGINAL_MAX_POSITION,
    beta_fast: float = YARN_BETA_FAST,
    beta_slow: float = YARN_BETA_SLOW,
) -> np.ndarray:
    """YaRN-scaled RoPE inverse frequencies (float64, ``dim // 2`` entries).

    Reading implemented: the DeepSeek-V3 / HF "yarn" one. Pair i has the
    original frequency ``f_i = theta^(-2i/dim)``. A pair index ``d(r)`` that
    completes ``r`` full rotations over the original context is
    ``dim * ln(L / (2 pi r)) / (2 ln theta)``. With ``lo = floor(d(beta_fast))``
    and ``hi = ceil(d(beta_slow))`` (clamped to [0, dim-1]) the ramp
    ``g_i = clip((i - lo) / (hi - lo), 0, 1)`` is linear in the *pair index*
    (not in the rotation count r, as the YaRN paper's gamma(r) is), and
    ``inv_freq_i = (1 - g_i) f_i + g_i f_i / factor``: high-frequency pairs
    (i <= lo) keep their frequency, low-frequency pairs (i >= hi) are
    interpolated by ``factor``.
    """
    if dim <= 0 or dim % 2:
        raise ValueError("dim must be a positive even number")
    half = dim // 2
    freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / dim)

    def pair_for_rotations(r: float) -> float:
        return dim * math.log(original_max_position / (r * 2.0 * math.pi)) / (
            2.0 * math.log(theta)
        )

    lo = max(math.floor(pair_for_rotations(beta_fast)), 0)
    hi = min(math.ceil(pair_for_rotations(beta_slow)), dim - 1)
    if hi == lo:
        hi += 0.001
    ramp = np.clip((np.arange(half, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    return (1.0 - ramp) * freq + ramp * (freq / factor)


def _yarn_mscale(factor: float = YARN_FACTOR) -> float:
    """YaRN attention temperature factor 0.1 ln(s) + 1 (1 for s <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def _rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of ``x`` [..., dim] at positions ``pos`` (broadcast
    against x's leading axes). Angles in float64; returns float64."""
    half = inv_freq.shape[0]
    ang = np.asarray(pos, dtype=np.float64)[..., None] * inv_freq
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# --------------------------------------------------------------------------
# Decode traces
# --------------------------------------------------------------------------
def _quantize(x: np.ndarray, frac_bits: int) -> np.ndarray:
    """Round float64 ``x`` to the grid 2^-frac_bits (clipped to |x| < 2^16)."""
    scale = float(1 << frac_bits)
    return np.clip(np.round(x * scale), -(2.0**16) * scale + 1, (2.0**16) * scale - 1) / scale


def _row_seedseq(seed: int, row: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(row)])


class _TraceModel:
    """Keys, head weights and the query-noise stream of one trace row."""

    def __init__(self, n: int, n_keys: int, heads: int, dim: int, ss: np.random.SeedSequence):
        if heads <= 0:
            raise ValueError("heads must be positive")
        self.n, self.heads, self.dim = n, heads, dim
        self.inv_freq = yarn_inv_freq(dim)
        ms = _yarn_mscale()
        self.scale = ms * ms / math.sqrt(dim)
        ss_w, ss_k, ss_q = ss.spawn(3)

        rw = np.random.default_rng(ss_w)
        self.w = _quantize(np.exp(0.5 * rw.standard_normal(heads)) / math.sqrt(heads), _W_FRAC)

        rk = np.random.default_rng(ss_k)
        shared = rk.standard_normal(dim)
        shared /= np.linalg.norm(shared)
        # Key contents are drawn sequentially, so the first positions do not
        # depend on how many keys are precomputed (traces are prefixes).
        z = rk.standard_normal((n_keys, dim))
        z /= np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-30)
        c = math.sqrt(_KEY_SHARED_FRAC) * shared + math.sqrt(1.0 - _KEY_SHARED_FRAC) * z
        c *= math.sqrt(dim) / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-30)
        # [n_keys, dim] float64 on the fixed-point grid, RoPE-rotated to
        # their own positions
        self.keys = np.ascontiguousarray(_quantize(_rope(c, np.arange(n_keys), self.inv_freq), _QK_FRAC))
        self.q_ss = ss_q
        # Low-pass spectral tilt of the query content: pair i keeps energy
        # 1 / (1 + (w_i / _Q_LOWPASS)^2), w_i = its rotation per decode step
        # (renormalised to mean 1). Trained models put little content energy
        # in the fastest-rotating pairs; without the tilt, the ~1 rad/step
        # pairs cap the reachable overlap near 0.72 (at k/n = 1/32).
        amp = 1.0 / np.sqrt(1.0 + (self.inv_freq / _Q_LOWPASS) ** 2)
        amp /= np.sqrt(np.mean(amp * amp))
        self.q_amp = np.concatenate([amp, amp])

    def query_noise(self) -> Iterator[np.ndarray]:
        """Stationary N(0, I) content innovations [heads, dim], heads sharing
        ``_HEAD_CORR`` of their variance. The first draw is q_0 itself."""
        rq = np.random.default_rng(self.q_ss)
        a, b = math.sqrt(_HEAD_CORR), math.sqrt(1.0 - _HEAD_CORR)
        amp = self.q_amp
        while True:
            g = rq.standard_normal((1, self.dim))
            e = rq.standard_normal((self.heads, self.dim))
            yield (a * g + b * e) * amp

    def queries(self, rho: float) -> Iterator[np.ndarray]:
        """Content-space queries q_t (float64 [heads, dim]) for t = 0, 1, ..."""
        noise = self.query_noise()
        q = next(noise)
        s = math.sqrt(max(0.0, 1.0 - rho * rho))
        while True:
            yield q
            q = rho * q + s * next(noise)

    def scores(self, q: np.ndarray, t: int) -> np.ndarray:
        """Score row (float32, length n+t) for content query q at step t."""
        qr = _quantize(_rope(q, np.float64(self.n + t), self.inv_freq) * self.scale, _QK_FRAC)
        qt = np.ascontiguousarray(qr.T)
        m = self.n + t
        out = np.empty(m, dtype=np.float32)
        buf = np.empty((min(m, _CHUNK), self.heads))  # stays in cache
        for i in range(0, m, _CHUNK):
            j = min(m, i + _CHUNK)
            b = buf[: j - i]
            np.matmul(self.keys[i:j], qt, out=b)  # exact (see _QK_FRAC)
            np.maximum(b, 0.0, out=b)
            out[i:j] = b @ self.w  # exact sum, then one rounding to float32
        return out


def _topk_idx(row: np.ndarray, k: int) -> np.ndarray:
    """Top-k indices of a NaN-free row; ties at the k-th value go to the
    lowest indices (deterministic, unlike argpartition's tie-breaking)."""
    m = row.shape[0]
    if k >= m:
        return np.arange(m)
    v = np.partition(row, m - k)[m - k]  # the k-th largest value
    above = np.flatnonzero(row > v)
    ties = np.flatnonzero(row == v)[: k - above.size]
    return np.concatenate([above, ties])


def topk_overlap(prev_idx, cur_idx) -> float:
    """Fraction of ``prev_idx``'s valid (>= 0) indices that appear in
    ``cur_idx`` (negative entries of either are padding and ignored;
    duplicates count once). Returns 0.0 when prev has no valid index."""
    prev = np.unique(np.asarray(prev_idx).ravel())
    prev = prev[prev >= 0]
    if prev.size == 0:
        return 0.0
    cur = np.asarray(cur_idx).ravel()
    cur = cur[cur >= 0]
    return float(np.count_nonzero(np.isin(prev, cur)) / prev.size)


def trace_overlaps(rows: Sequence[np.ndarray], k: int) -> np.ndarray:
    """Per-step overlaps (length ``len(rows) - 1``) of the exact Top-k sets of
    consecutive NaN-free 1-D rows (ties at the k-th value: lowest indices)."""
    k = check_int("k", k, 1)
    idx = [_topk_idx(np.asarray(r), k) for r in rows]
    return np.array([topk_overlap(a, b) for a, b in zip(idx[:-1], idx[1:])], dtype=np.float64)


def _pilot_overlap(model: _TraceModel, rho: float, k: int, P: int, idx0: np.ndarray) -> float:
    """Mean overlap over the first P steps of ``model``'s trace at ``rho``
    (rows computed exactly as the trace computes them; step 0's Top-k
    ``idx0`` does not depend on rho)."""
    qs = model.queries(rho)
    next(qs)
    prev, acc = idx0, 0.0
    for t in range(1, P):
        cur = _topk_idx(model.scores(next(qs), t), k)
        acc += topk_overlap(prev, cur)
        prev = cur
    return acc / (P - 1)


def _calibrate(model: _TraceModel, overlap: float, k: int) -> float:
    """Solve pilot_overlap(rho) = overlap for rho in [0, 1].

    The pilot reuses the trace's own keys and query noise (common random
    numbers), so it is a deterministic, nearly monotone function of rho. It
    is close to linear in x = sigma^1.5, sigma = sqrt(1 - rho^2) the
    innovation scale, so an Illinois regula falsi runs on x in [0, 1]
    (x = 1: independent queries, x = 0: frozen query content)."""
    P = PILOT_STEPS
    idx0 = _topk_idx(model.scores(next(model.queries(0.0)), 0), k)

    def rho_of(x: float) -> float:
        sig = x ** (2.0 / 3.0)
        return math.sqrt(max(0.0, 1.0 - sig * sig))

    def f(x: float) -> float:
        return _pilot_overlap(model, rho_of(x), k, P, idx0)

    a, fa = 1.0, f(1.0) - overlap  # rho = 0: lowest overlap
    if fa >= 0.0:
        return 0.0
    b, fb = 0.0, f(0.0) - overlap  # rho = 1: highest overlap
    if fb <= 0.0:
        return 1.0
    best = (a, -fa) if -fa < fb else (b, fb)
    side = 0
    for _ in range(_CAL_MAX_ITERS):
        if abs(a - b) < 1e-6 or best[1] <= _CAL_TOL:
            break
        c = b - fb * (b - a) / (fb - fa)
        if not (min(a, b) < c < max(a, b)):
            c = 0.5 * (a + b)
        fc = f(c) - overlap
        if abs(fc) < best[1]:
            best = (c, abs(fc))
        if fc > 0.0:  # too much overlap: need a larger sigma, like a
            b, fb = c, fc
            if side == 1:
                fa *= 0.5
            side = 1
        else:
            a, fa = c, fc
            if side == -1:
                fb *= 0.5
            side = -1
    return rho_of(best[0])


def _check_trace_args(n: int, steps: int, k: int, heads: int, dim: int) -> None:
    for name, v, lo in (("n", n, 0), ("steps", steps, 0), ("k", k, 1), ("heads", heads, 1), ("dim", dim, 2)):
        check_int(name, v, lo)
    if dim % 2:
        raise ValueError(f"'dim' must be even, got {dim}")


def rho_for_overlap(
    overlap: float,
    n: int,
    *,
    k: int = 2048,
    heads: int = 64,
    dim: int = 64,
    seed: int = 0,
    row: int = 0,
) -> float:
    """Query AR(1) coefficient rho in [0, 1] for which trace row ``row`` of
    ``seed`` has a mean step-to-step Top-k overlap closest to ``overlap``
    over its first ``PILOT_STEPS`` steps (within 0.005 unless the target is
    out of reach, in which case rho is clamped to 0 or 1). Cached per
    (n, k, heads, dim, seed, row, overlap). If ``k >= n`` every index is
    always selected (overlap 1 whatever rho), no pilot runs and ``overlap``
    itself is returned as rho."""
    _check_trace_args(n, 1, k, heads, dim)
    overlap = float(overlap)
    if not 0.0 <= overlap <= 1.0:
        raise ValueError("overlap must be in [0, 1]")
    key = (int(n), int(k), int(heads), int(dim), int(seed), int(row), overlap)
    rho = _RHO_CACHE.get(key)
    if rho is None:
        if k >= n:
            rho = overlap
        else:
            model = _TraceModel(n, n + PILOT_STEPS - 1, heads, dim, _row_seedseq(seed, row))
            rho = _calibrate(model, overlap, k)
        if len(_RHO_CACHE) >= _RHO_CACHE_MAX:
            _RHO_CACHE.clear()
        _RHO_CACHE[key] = rho
    return rho


def _resolve_rho(rho, overlap, n, k, heads, dim, seed, row) -> float:
    if rho is not None:
        rho = float(rho)
        if not 0.0 <= rho <= 1.0:
            raise ValueError("rho must be in [0, 1]")
        return rho
    if overlap is None:
        raise ValueError("give overlap or rho")
    return rho_for_overlap(overlap, n, k=k, heads=heads, dim=dim, seed=seed, row=row)


def _row_trace(n, steps, heads, dim, seed, row, rho) -> Iterator[np.ndarray]:
    model = _TraceModel(n, n + max(steps, 1) - 1, heads, dim, _row_seedseq(seed, row))
    qs = model.queries(rho)
    for t in range(steps):
        yield model.scores(next(qs), t)


def decode_trace(
    n: int = 65536,
    steps: int = 8,
    *,
    k: int = 2048,
    overlap: Optional[float] = 0.45,
    rho: Optional[float] = None,
    heads: int = 64,
    dim: int = 64,
    seed: int = 0,
) -> Iterator[np.ndarray]:
    """Yield ``steps`` float32 score rows of length n, n+1, ..., n+steps-1 of
    one DSA-indexer-like decode trace (see the module docstring). ``overlap``
    is the target step-to-step Top-``k`` overlap (calibrated to a query
    correlation rho, eagerly, at call time); an explicit ``rho`` in [0, 1]
    overrides it. A shorter trace is a prefix of a longer one with the same
    arguments."""
    _check_trace_args(n, steps, k, heads, dim)
    r = _resolve_rho(rho, overlap, n, k, heads, dim, seed, 0) if steps else 0.0
    return _row_trace(n, steps, heads, dim, seed, 0, r)


def decode_trace_batch(
    batch: int,
    n: int = 65536,
    steps: int = 8,
    *,
    k: int = 2048,
    overlap: Optional[float] = 0.45,
    rho: Optional[float] = None,
    heads: int = 64,
    dim: int = 64,
    seed: int = 0,
) -> List[np.ndarray]:
    """``batch`` independent decode traces (own keys, head weights and query
    stream per row; each row calibrated to ``overlap`` on its own, or all
    using the explicit ``rho``), returned per step: a list of ``steps``
    float32 arrays, array t of shape [batch, n+t]. Row 0 equals
    ``decode_trace(n, steps, ..., seed=seed)``; rows b > 0 come from their
    own seed streams (seed, b)."""
    check_int("batch", batch, 0)
    _check_trace_args(n, steps, k, heads, dim)
    out = [np.empty((batch, n + t), dtype=np.float32) for t in range(steps)]
    for b in range(batch):
        r = _resolve_rho(rho, overlap, n, k, heads, dim, seed, b)
        for t, row in enumerate(_row_trace(n, steps, heads, dim, seed, b, r)):
            out[t][b] = row
    return out


# --------------------------------------------------------------------------
# i.i.d. rows
# --------------------------------------------------------------------------
def _seed(seed):
    """an int seed masked to 64 bits (any int, as the other generators take it); anything else
    default_rng takes (None, a SeedSequence, a Generator, a sequence of ints) as it is"""
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed


def iid_scores(batch: int, n: int, *, dist: str = "normal", seed: int = 0) -> np.ndarray:
    """float32 [batch, n] of i.i.d. draws; ``dist`` in {"normal", "uniform",
    "exponential"} (standard forms: N(0,1), U[0,1), Exp(1))."""
    shape = (check_int("batch", batch, 0), check_int("n", n, 0))
    rng = np.random.default_rng(_seed(seed))  # any int seed, as the other generators
    if dist == "normal":
        return rng.standard_normal(shape, dtype=np.float32)
    if dist == "uniform":
        return rng.random(shape, dtype=np.float32)
    if dist == "exponential":
        return rng.standard_exponential(shape, dtype=np.float32)
    raise ValueError(f"unknown dist {dist!r}; use 'normal', 'uniform' or 'exponential'")


# --------------------------------------------------------------------------
# Adversarial rows
# --------------------------------------------------------------------------
ADVERSARIAL_KINDS = (
    "all_equal",
    "ties_at_kth",
    "few_distinct",
    "neg_inf_mask",
    "all_neg_inf",
    "nan",
    "nan_heavy",
    "signed_zeros",
    "inf",
    "denormals_and_extremes",
    "sorted_ascending",
    "sorted_descending",
)

_F32 = np.finfo(np.float32)
_NEG_NAN = np.float32(np.copysign(np.float32(np.nan), np.float32(-1.0)))


def _put_nans(x: np.ndarray, idx: np.ndarray, rng: np.random.Generator) -> None:
    """Write NaN at ``idx``: mostly +NaN, about one in eight with the sign bit
    set (-NaN; it sorts below -inf if bits are compared as ordered ints)."""
    x[idx] = np.float32(np.nan)
    neg = idx[rng.random(idx.size) < 0.125]
    x[neg] = _NEG_NAN


def adversarial(kind: str, n: int, *, k: int = 2048, seed: int = 0) -> np.ndarray:
    """float32 row of length ``n`` (any n >= 0) stressing exact Top-``k``.

    kinds (``ADVERSARIAL_KINDS``):
      all_equal               every value 0.5
      ties_at_kth             the k-th largest value (0.5) is repeated
                              min(1024, ~n/4) times, straddling rank k (about
                              half the copies inside the top k, half outside,
                              as far as n and k allow); one-ulp neighbours of
                              0.5 are present too; the rest are distinct
      few_distinct            values from {-1, 0, 0.5, 2}
      neg_inf_mask            normal values; half at random plus the last
                              quarter (>= 1 when n >= 2; a masked tail) -inf
      all_neg_inf             every value -inf
      nan                     normal values; ~3% random NaNs plus a run of
                              ~n/64 (>= 1) NaNs; some NaNs have the sign bit
      nan_heavy               NaN count = max(n-k, 0) + max(1, min(n,k)//2)
                              (> n - k, so NaNs must be selected); signed too
      signed_zeros            ~min(n,k)/2 positives, n/8 negatives, the rest
                              a -0.0 / +0.0 mix (the k-th value is a zero)
      inf                     normal values; ~min(n,k)/2 +inf, n/8 -inf
      denormals_and_extremes  +-subnormals (incl. +-smallest), +-FLT_MAX,
                              +-FLT_MIN, +-0.0, +-1e-30 and normal values
      sorted_ascending        sorted normal values, ascending
      sorted_descending       the same values, descending
    """
    if kind not in ADVERSARIAL_KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {ADVERSARIAL_KINDS}")
    n = int(n)
    if n < 0:
        raise ValueError("n must be >= 0")
    stream = ADVERSARIAL_KINDS.index("sorted_ascending" if kind.startswith("sorted") else kind)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, stream]))
    kk = max(1, min(int(k), n))  # rank of "the k-th value" inside this row

    if kind == "all_equal":
        return np.full(n, 0.5, dtype=np.float32)
    if kind == "all_neg_inf":
        return np.full(n, -np.inf, dtype=np.float32)
    if kind == "few_distinct":
        vals = np.array([-1.0, 0.0, 0.5, 2.0], dtype=np.float32)
        return vals[rng.integers(0, vals.size, n)]
    if kind in ("sorted_ascending", "sorted_descending"):
        x = np.sort(rng.standard_normal(n, dtype=np.float32))
        return x if kind == "sorted_ascending" else np.ascontiguousarray(x[::-1])
    if n == 0:
        return np.empty(0, dtype=np.float32)

    if kind == "ties_at_kth":
        v = np.float32(0.5)
        n_eq = min(n, max(4, min(1024, n // 4)))
        n_gt = min(max(kk - (n_eq + 1) // 2, 0), n - n_eq)  # n_gt < kk <= n_gt + n_eq
        n_lt = n - n_eq - n_gt
        gt = (0.75 + 0.25 * rng.random(n_gt)).astype(np.float32)
        lt = (0.25 * rng.random(n_lt)).astype(np.float32)
        up, down = np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))
        gt[: min(8, n_gt)] = up  # one-ulp neighbours of the tie value
        lt[: min(8, n_lt)] = down
        x = np.concatenate([gt, np.full(n_eq, v, dtype=np.float32), lt])
        return x[rng.permutation(n)]

    x = rng.standard_normal(n, dtype=np.float32)
    if kind == "neg_inf_mask":
        x[rng.random(n) < 0.5] = -np.inf
        if n >= 2:
            x[n - max(1, n // 4):] = -np.inf
    elif kind == "nan":
        idx = np.flatnonzero(rng.random(n) < 0.03)
        run = max(1, n // 64)
        start = int(rng.integers(0, n - run + 1))
        _put_nans(x, np.union1d(idx, np.arange(start, start + run)), rng)
    elif kind == "nan_heavy":
        n_nan = min(n, max(n - int(k), 0) + max(1, kk // 2))
        _put_nans(x, rng.choice(n, n_nan, replace=False), rng)
    elif kind == "signed_zeros":
        x = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        perm = rng.permutation(n)
        n_pos = min(n, kk // 2)
        n_neg = min(n - n_pos, n // 8)
        x[perm[:n_pos]] = rng.choice(np.array([1.0, 0.25, 1e-3, 7.0], np.float32), n_pos)
        x[perm[n_pos : n_pos + n_neg]] = rng.choice(np.array([-1.0, -1e-3], np.float32), n_neg)
    elif kind == "inf":
        perm = rng.permutation(n)
        n_pos = min(n, max(1, kk // 2))
        n_neg = min(n - n_pos, n // 8)
        x[perm[:n_pos]] = np.inf
        x[perm[n_pos : n_pos + n_neg]] = -np.inf
    elif kind == "denormals_and_extremes":
        tiny = _F32.smallest_subnormal
        special = np.array(
            [_F32.max, -_F32.max, _F32.tiny, -_F32.tiny, tiny, -tiny, 0.0, -0.0, 1e-30, -1e-30],
            dtype=np.float32,
        )
        # random subnormals: integer bit patterns 1 .. 2^23-1, random sign
        bits = rng.integers(1, 1 << 23, n, dtype=np.uint32)
        bits |= (rng.random(n) < 0.5).astype(np.uint32) << np.uint32(31)
        sub = bits.view(np.float32)
        cat = rng.integers(0, 3, n)  # 0: normal value, 1: subnormal, 2: special
        x = np.where(cat == 1, sub, x)
        x = np.where(cat == 2, special[rng.integers(0, special.size, n)], x).astype(np.float32)
        x[: min(n, special.size)] = special[: min(n, special.size)]  # each present
        x = x[rng.permutation(n)]
    return x


def ragged_lengths(batch: int, n: int, *, k: int = 2048, seed: int = 0) -> np.ndarray:
    """int32 [batch] of row lengths in [0, n]: the edge values 0, n, 1, 2,
    k-1, k, k+1, n-1 (those in range, deduplicated, in that priority while
    ``batch`` allows) plus uniform draws, shuffled."""
    batch, n = check_int("batch", batch, 0), check_int("n", n, 0)
    rng = np.random.default_rng(_seed(seed))  # any int seed, as the other generators
    edges = []
    for v in (0, n, 1, 2, k - 1, k, k + 1, n - 1, max(k // 2, 0)):
        if 0 <= v <= n and v not in edges:
            edges.append(v)
    out = np.array(edges[:batch], dtype=np.int64)
    out = np.concatenate([out, rng.integers(0, n + 1, batch - out.size)])
    return out[rng.permutation(batch)].astype(np.int32)


# --------------------------------------------------------------------------
# Block-score traces (PRR: temporal structure of per-block importance)
# --------------------------------------------------------------------------
#: persistence of the weakly persistent layers of ``block_score_trace(..., layers=L)``
WEAK_PERSISTENCE = 0.3
_BT_MAX_NOISE = 1e6  # largest noise / |drift| of block_score_trace (beyond: float32 scores of pure jitter, or inf)
_BT_MAX_DRIFT = 1e6
_BT_DIM = 32  # query / key dimension of the block-trace model
_BT_KEY_SMOOTH = 0.8  # correlation of neighbouring blocks' key contents (locality)
_BT_SINK = 4.0  # score bonus of block 0 (attention sink)
_BT_RECENT = 3.0  # score bonus of the last block, decaying over _BT_RECENT_W blocks
_BT_RECENT_W = 4.0


def block_trace_persistence(layers, persistence: float = 0.9) -> tuple:
    """The per-layer persistence values ``block_score_trace`` uses for ``layers``: an int L gives
    ``ceil(L / 4)`` weakly persistent layers first (``WEAK_PERSISTENCE``) and ``persistence`` for the
    rest (one layer: ``(persistence,)``); a sequence is taken as the per-layer values."""
    if isinstance(layers, bool):
        raise TypeError("'layers' must be an int or a sequence of floats, got bool")
    if isinstance(layers, (int, np.integer)):
        L = int(layers)
        if L < 1:
            raise ValueError(f"'layers' must be >= 1, got {L}")
        if L == 1:
            return (float(persistence),)
        weak = -(-L // 4)
        return (WEAK_PERSISTENCE,) * weak + (float(persistence),) * (L - weak)
    try:
        vals = tuple(float(v) for v in layers)
    except TypeError as e:  # not iterable (a float), or items that are not numbers
        raise TypeError(f"'layers' must be an int or a sequence of floats, got {type(layers).__name__}") from e
    if not vals:
        raise ValueError("'layers' must not be empty")
    return vals


def block_score_trace(steps: int, num_blocks: int, *, persistence: float = 0.9, drift: float = 0.05,
                      noise: float = 0.35, seed: int = 0, layers=None) -> np.ndarray:
    """Per-block importance scores over decode (or prefill) steps with realistic temporal structure:
    float32 ``[steps, num_blocks]`` (``layers=None``) or ``[L, steps, num_blocks]``.

    Model (per layer, own random stream from ``(seed, layer)``; deterministic): block j has a key
    ``k_j`` in R^32 whose content is smooth along j (neighbouring blocks correlate at 0.8: blocks of
    one passage look alike) plus positional structure (block 0 an attention sink, +4; the most recent
    blocks +3 exp(-(Nb-1-j)/4)). The query at step t is::

        q_t = a_t + m_t + e_t,   a_t = rho a_{t-1} + sqrt(1 - rho^2) z_t   (AR(1), unit variance)
        m_t = M (cos(drift t), sin(drift t))                                (a drifting focus)

    with ``rho = persistence`` (step-to-step correlation of the query's slow part: the knob of how
    long Top-K selections persist; 1 keeps the query, 0 redraws it every step), ``drift`` radians per
    step of a steady rotation of the query's mean in a random plane (scores trend up and down: what a
    damped-trend predictor follows) and ``e_t`` i.i.d. per-step jitter of standard deviation
    ``noise`` (what smoothing averages out). Score ``s_tj = <q_t, k_j> / sqrt(32) + pos_j``.
    The dot products are evaluated one dimension at a time in float64 (no BLAS: the same bits on
    every machine), then rounded once to float32.

    layers: None (one layer at ``persistence``, 2-D result), an int L (``ceil(L/4)`` weakly
    persistent layers at ``WEAK_PERSISTENCE`` first, then ``persistence``:
    ``block_trace_persistence``), or a sequence of per-layer persistence values in [0, 1].
    ``noise`` lies in [0, 1e6] and ``|drift|`` is at most 1e6 (beyond, the float32 scores would be
    the jitter alone, or inf).
    """
    for name, v in (("steps", steps), ("num_blocks", num_blocks)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"'{name}' must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"'{name}' must be >= 0, got {v}")
    steps, num_blocks = int(steps), int(num_blocks)
    for name, v in (("persistence", persistence), ("drift", drift), ("noise", noise)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v):
            raise TypeError(f"'{name}' must be a finite float, got {v!r}")
    if not 0.0 <= persistence <= 1.0:
        raise ValueError(f"'persistence' must lie in [0, 1], got {persistence}")
    if not 0 <= noise <= _BT_MAX_NOISE:
        raise ValueError(f"'noise' must lie in [0, {_BT_MAX_NOISE:g}], got {noise}")
    if abs(drift) > _BT_MAX_DRIFT:
        raise ValueError(f"'drift' must lie in [-{_BT_MAX_DRIFT:g}, {_BT_MAX_DRIFT:g}], got {drift}")
    rhos = block_trace_persistence(1 if layers is None else layers, persistence)
    for r in rhos:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"'layers': per-layer persistence values must lie in [0, 1], got {r}")
    out = np.empty((len(rhos), steps, num_blocks), np.float32)
    for li, rho in enumerate(rhos):
        out[li] = _block_layer(steps, num_blocks, rho, float(drift), float(noise), seed, li)
    return out[0] if layers is None else out


def _block_layer(steps, nb, rho, drift, noise, seed, layer):
    d = _BT_DIM
    ss_k, ss_q = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, 0xB10C, int(layer)]).spawn(2)
    rk = np.random.default_rng(ss_k)
    # key contents: AR(1) along the blocks (unit variance per dimension)
    z = rk.standard_normal((nb, d))
    keys = np.empty((nb, d))
    c = math.sqrt(1.0 - _BT_KEY_SMOOTH**2)
    if nb:
        keys[0] = z[0]
    for j in range(1, nb):
        keys[j] = _BT_KEY_SMOOTH * keys[j - 1] + c * z[j]
    plane = rk.standard_normal((d, 2)) * 0.7
    j = np.arange(nb, dtype=np.float64)
    pos = _BT_RECENT * np.exp(-(nb - 1 - j) / _BT_RECENT_W)
    if nb:
        pos[0] += _BT_SINK
    # queries: the innovations are drawn in the same order for every rho (coupled traces)
    rq = np.random.default_rng(ss_q)
    zq = rq.standard_normal((steps, d))
    jit = rq.standard_normal((steps, d)) * noise
    q = np.empty((steps, d))
    s = math.sqrt(max(0.0, 1.0 - rho * rho))
    a = zq[0] if steps else None
    for t in range(steps):
        if t:
            a = rho * a + s * zq[t]
        m = plane[:, 0] * math.cos(drift * t) + plane[:, 1] * math.sin(drift * t)
        q[t] = a + m + jit[t]
    acc = np.zeros((steps, nb))
    for i in range(d):  # one dimension at a time: elementwise float64, no BLAS
        acc += q[:, i : i + 1] * keys[None, :, i]
    acc *= 1.0 / math.sqrt(d)
    acc += pos[None, :]
    return acc.astype(np.float32)
