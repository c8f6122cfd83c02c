"""PRR's EMA block predictor and its calibration (paper 002, sections 4.1-4.2): ``EMAPredictor``,
``calibrate``, ``calibration_hit_rates``, ``DEFAULT_GRID``. Exposed as ``gvr.prr.*``.

The predictor is Holt's damped-trend exponential smoothing of each block's importance score, per
(row b, KV head h, block j): a level ``L`` and a trend ``T`` (float32), and per (b, h) the number
``known`` of blocks that have state. With hyper-parameters alpha, beta in (0, 1) and phi in [0, 1]:

- **predict** (before this step's selection): ``pred[j] = L + phi*T`` for the blocks that have
  state; ``+inf`` for blocks ``known <= j < nblocks[b]`` (new since the last update, no score yet: the
  most recent block is always predicted); blocks ``j >= nblocks[b]`` do not exist. The predicted
  selection is the Top-K of ``pred`` (``gvr.topk_decode``'s order: ties to the lower index), int32
  ``[B, Hkv, K]``, -1 padded when a row has fewer than K blocks.
- **update** (after the selection, with this step's true scores ``s``): for a block with state,
  ``f = L + phi*T``, ``L' = alpha*s + (1 - alpha)*f``, ``T' = beta*(L' - L) + (1 - beta)*phi*T``; a new
  block starts at ``L = s``, ``T = 0``; then ``known = nblocks[b]``.
- **unobserved scores**: a score of ``-inf`` (masked) or NaN leaves a block's state unchanged; a new
  block whose first score is unobserved gets ``L = -inf`` (predicted ``-inf``: ranked last, as the
  selection ranks it) until its first observed score, which starts it as a new block (``L = s``,
  ``T = 0``). ``+inf`` follows IEEE arithmetic.

Every float32 expression rounds after each operation in one fixed order (kernels/gvr_kernels.h):
``t = phi*T; f = L + t; L' = alpha*s + (1 - alpha)*f; T' = beta*(L' - L) + (1 - beta)*t`` with
``1 - alpha`` and ``1 - beta`` rounded once — the C path equals NumPy float32 arithmetic of the same
expressions bit for bit, and the CUDA path (``__fmul_rn``/``__fadd_rn``, no FMA) equals the C path.

**Calibration** simulates the predictor over a prefill trajectory ``scores [T, Nb]`` for every grid
point (every block exists from step 0; the state starts from step 0's scores) and, for each step
``t >= 1``, scores the predicted Top-K ``P_t`` against the true Top-K ``S_t`` of ``scores[t]`` by the
score-weighted hit rate (eq. 4): ``hit_t = sum_{j in P_t & S_t} x_tj / sum_{j in S_t} x_tj`` with
weights ``x_tj = s_tj - min_j s_tj`` (the row's minimum over its finite scores; non-finite scores
weigh 0), in float64 — shifted so that negative scores (e.g. logits) weigh correctly. When the
denominator is 0 (the row's top-k scores all equal its minimum, e.g. a constant row) the hit rate is
the plain overlap ``|P_t & S_t| / k``. The grid point with the best mean hit rate wins; ties go to the
first point in (alpha, beta, phi) lexicographic order. The sums are taken in one canonical order, so
the C and CUDA paths give the same bits.
"""
from __future__ import annotations

import itertools
import sys
from numbers import Real

import numpy as np

from . import _C
from ._interop import compiling, define_op, framework, prepare
from .topk import topk_decode

__all__ = ["EMAPredictor", "calibrate", "calibration_hit_rates", "DEFAULT_GRID"]

#: alpha, beta in {1/6, ..., 5/6}, phi in {0, 0.25, 0.5, 0.75, 1}: 125 points
DEFAULT_GRID = (tuple(i / 6 for i in range(1, 6)), tuple(i / 6 for i in range(1, 6)),
                (0.0, 0.25, 0.5, 0.75, 1.0))


def _check_int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"'{name}' must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"'{name}' must be >= {lo}, got {v}")
    return int(v)


def _check_param(name, v, open_):
    if isinstance(v, bool) or not isinstance(v, Real):
        raise TypeError(f"'{name}' must be a float, got {type(v).__name__}")
    v = float(v)
    ok = (0.0 < v < 1.0) if open_ else (0.0 <= v <= 1.0)
    # the float32 value is what the kernels use: it must lie in the range too
    f = float(np.float32(v))
    ok = ok and ((0.0 < f < 1.0) if open_ else (0.0 <= f <= 1.0))
    if not ok:
        raise ValueError(f"'{name}' must lie in {'(0, 1)' if open_ else '[0, 1]'}, got {v!r}")
    return v


def _is_torch(x):
    return type(x).__module__.startswith("torch")


# --------------------------------------------------------------------------------------------------
# torch.library ops (traced code only; eager calls go to gvr._C directly)
# --------------------------------------------------------------------------------------------------
def _scores_impl(level, trend, known, nblocks, pred, row_len, phi):
    (l, t, k, n, p, r), stream, nosync = prepare(framework(level), level, (level, trend, known, nblocks, pred,
                                                                           row_len), None)
    _C.prr_ema_predict(l, t, k, n, p, r, phi, stream, nosync)


def _update_impl(level, trend, known, nblocks, scores, alpha, beta, phi):
    (l, t, k, n, s), stream, nosync = prepare(framework(level), level, (level, trend, known, nblocks, scores), None)
    _C.prr_ema_update(l, t, k, n, s, alpha, beta, phi, stream, nosync)


def _none(*args):
    return None


_scores_op = define_op(
    "prr_ema_scores",
    "(Tensor level, Tensor trend, Tensor known, Tensor nblocks, Tensor(a!) pred, Tensor(b!) row_len, float phi) -> ()",
    impl=_scores_impl, fake=_none, mutates_args=("pred", "row_len"))
_update_op = define_op(
    "prr_ema_update",
    "(Tensor(a!) level, Tensor(b!) trend, Tensor(c!) known, Tensor nblocks, Tensor scores, float alpha, float beta, "
    "float phi) -> ()",
    impl=_update_impl, fake=_none, mutates_args=("level", "trend", "known"))


# --------------------------------------------------------------------------------------------------
# EMAPredictor
# --------------------------------------------------------------------------------------------------
class EMAPredictor:
    """PRR's EMA block predictor (paper 002, section 4.1): per (row, KV head, block) a level and a
    trend, at fixed addresses, on the CPU (NumPy buffers) or a CUDA device (torch buffers).

    ``EMAPredictor(max_batch, Hkv, max_blocks, *, alpha=0.5, beta=0.5, phi=0.5, device="cpu")``
    holds ``level``, ``trend`` (float32 ``[max_batch, Hkv, max_blocks]``), ``known`` (int32
    ``[max_batch, Hkv]``: blocks with state per row) and a predicted-score buffer, allocated once.
    A decode step, for a batch of B <= max_batch rows whose sequences hold ``nblocks[b]`` blocks::

        predicted = predictor.predict(k, nblocks)        # int32 [B, Hkv, k], before selection
        ...  # attend predicted blocks while the selection runs; selected = Top-K of `scores`
        predictor.update(scores, nblocks)                # float32 [B, Hkv, Nb] block scores

    Semantics (module docstring of gvr._prr_ema, kernels/gvr_kernels.h):

    - ``predict``: ``level + phi*trend`` for blocks with state, ``+inf`` for blocks new since the
      last update (always predicted), nothing for ``j >= nblocks[b]``; Top-K per (b, h) as
      ``gvr.topk_decode`` (ties to the lower index, -1 padding). One C call / kernel for the
      predicted scores, then one ``topk_decode`` over the ``B * Hkv`` rows — no Python loop.
    - ``update``: Holt's damped trend, ``f = L + phi*T; L' = alpha*s + (1-alpha)*f;
      T' = beta*(L'-L) + (1-beta)*phi*T``; new blocks start at ``L = s, T = 0``; a ``-inf`` or NaN
      score leaves the block unchanged (a new block's first unobserved score gives ``L = -inf``:
      predicted last until observed); then ``known = nblocks[b]``.
    - ``reset(rows)``: forget rows (a new sequence in those batch slots): ``known = 0``.

    nblocks: int32 ``[B]`` (NumPy / torch CPU on "cpu", where each must lie in [0, max_blocks]; a
    CUDA tensor on a CUDA device, where values are clamped to that range — no host read).
    Graph-safe on CUDA: ``predict(..., out=)`` and ``update`` allocate nothing and read nothing back,
    and their buffers keep their addresses, so a decode step can be captured in a CUDA graph and
    replayed (alpha, beta, phi are captured as values: ``set_params`` after a capture does not change
    the graph). ``calibrate(prefill_scores, k)`` gives hyper-parameters for ``set_params``.
    """

    def __init__(self, max_batch: int, Hkv: int, max_blocks: int, *, alpha: float = 0.5, beta: float = 0.5,
                 phi: float = 0.5, device="cpu"):
        self.max_batch = _check_int("max_batch", max_batch)
        self.Hkv = _check_int("Hkv", Hkv)
        self.max_blocks = _check_int("max_blocks", max_blocks)
        if self.max_blocks > 2**31 - 1:
            raise ValueError(f"'max_blocks' must be < 2^31, got {max_blocks}")
        self.set_params(alpha, beta, phi)
        shape = (self.max_batch, self.Hkv, self.max_blocks)
        dev = str(device)
        if dev == "cpu":
            self.device = "cpu"
            self.level = np.zeros(shape, np.float32)
            self.trend = np.zeros(shape, np.float32)
            self.known = np.zeros(shape[:2], np.int32)
            self._pred = np.zeros(shape, np.float32)
            self._row_len = np.zeros(shape[:2], np.int32)
        elif not dev.startswith("cuda"):
            raise ValueError(f"'device' must be 'cpu' or a CUDA device, got {device!r}")
        else:
            try:
                import torch
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise RuntimeError("EMAPredictor on a CUDA device needs torch") from e
            tdev = torch.device(device)
            if tdev.type != "cuda":
                raise ValueError(f"'device' must be 'cpu' or a CUDA device, got {device!r}")
            if tdev.index is None:
                tdev = torch.device("cuda", torch.cuda.current_device())
            self.device = tdev
            self.level = torch.zeros(shape, dtype=torch.float32, device=tdev)
            self.trend = torch.zeros(shape, dtype=torch.float32, device=tdev)
            self.known = torch.zeros(shape[:2], dtype=torch.int32, device=tdev)
            self._pred = torch.zeros(shape, dtype=torch.float32, device=tdev)
            self._row_len = torch.zeros(shape[:2], dtype=torch.int32, device=tdev)

    # -- hyper-parameters -------------------------------------------------------------------------
    def set_params(self, alpha=None, beta=None, phi=None) -> None:
        """Set any of alpha, beta in (0, 1) and phi in [0, 1] (e.g. ``set_params(*calibrate(...))``)."""
        a = _check_param("alpha", alpha, True) if alpha is not None else None
        b = _check_param("beta", beta, True) if beta is not None else None
        p = _check_param("phi", phi, False) if phi is not None else None
        if a is not None:
            self.alpha = a
        if b is not None:
            self.beta = b
        if p is not None:
            self.phi = p

    @property
    def params(self):
        """(alpha, beta, phi)"""
        return self.alpha, self.beta, self.phi

    # -- helpers ----------------------------------------------------------------------------------
    def _nblocks(self, nblocks):
        """nblocks as the C call takes it, and B."""
        if self.device == "cpu":
            if not (_is_torch(nblocks) or isinstance(nblocks, np.ndarray)):
                if isinstance(nblocks, (list, tuple)):
                    nblocks = np.asarray(nblocks, dtype=np.int32)
                else:
                    raise TypeError(f"'nblocks' must be an int32 array [B], got {type(nblocks).__name__}")
            if _is_torch(nblocks) and nblocks.is_cuda:
                raise ValueError("'nblocks' must be on the CPU for a CPU predictor, got a CUDA tensor")
        else:
            if not _is_torch(nblocks) or not nblocks.is_cuda:
                raise ValueError(f"'nblocks' must be an int32 CUDA tensor [B] on {self.device} for a CUDA predictor "
                                 f"(graph-safe: no host data), got {type(nblocks).__name__}"
                                 + (" on the CPU" if _is_torch(nblocks) else ""))
        shape = getattr(nblocks, "shape", None)
        if shape is None or len(shape) != 1:
            raise ValueError(f"'nblocks' must have shape [B], got {None if shape is None else tuple(shape)}")
        B = int(shape[0])
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"'nblocks' has B = {B} rows; this predictor holds 1..{self.max_batch}")
        return nblocks, B

    def _framework(self, lv, *args):
        """prepare()'s framework and reference array: torch on a CUDA predictor; on the CPU, torch
        when a torch CPU tensor is passed (every torch CPU tensor then goes as a NumPy view)."""
        if self.device != "cpu":
            return "torch", lv
        for a in args:
            if _is_torch(a):
                return "torch", a
        return "numpy", lv

    # -- the step ---------------------------------------------------------------------------------
    def predicted_scores(self, nblocks, *, stream=None):
        """The predicted scores and row lengths -> (pred float32 [B, Hkv, max_blocks], row_len int32
        [B, Hkv]): views of the predictor's buffers (overwritten by the next call). ``predict`` is the
        Top-K of ``pred[b, h, :row_len[b, h]]``."""
        nblocks, B = self._nblocks(nblocks)
        lv, tr, kn, pr, rl = self.level[:B], self.trend[:B], self.known[:B], self._pred[:B], self._row_len[:B]
        if compiling():
            if stream is not None:
                raise ValueError("'stream' is not supported under torch.compile: use `with torch.cuda.stream(s):`")
            _scores_op.call(lv, tr, kn, nblocks, pr, rl, self.phi)
            return pr, rl
        fw, like = self._framework(lv, nblocks)
        (l, t, k, n, p, r), stream, nosync = prepare(fw, like, (lv, tr, kn, nblocks, pr, rl), stream)
        _C.prr_ema_predict(l, t, k, n, p, r, self.phi, stream, nosync)
        return pr, rl

    def predict(self, num_blocks: int, nblocks, out=None, *, stream=None):
        """The predicted selection -> int32 ``[B, Hkv, num_blocks]`` (B = ``nblocks.shape[0]``).

        Per (b, h): the Top-K (``gvr.topk_decode``'s order, ties to the lower index) of the predicted
        scores of the row's ``nblocks[b]`` blocks — ``level + phi*trend``, ``+inf`` for blocks new
        since the last update — then -1 padding. out: a C-contiguous int32 ``[B, Hkv, num_blocks]``
        to write into (required for allocation-free, graph-safe calls); allocated otherwise (NumPy, or
        torch in nblocks' framework and device)."""
        k = _check_int("num_blocks", num_blocks, lo=0)
        nblocks, B = self._nblocks(nblocks)
        H = self.Hkv
        if out is None:
            if _is_torch(nblocks):
                out = sys.modules["torch"].empty((B, H, k), dtype=sys.modules["torch"].int32, device=nblocks.device)
            else:
                out = np.empty((B, H, k), np.int32)
        else:
            shape = tuple(int(d) for d in getattr(out, "shape", ()))
            if shape != (B, H, k):
                raise ValueError(f"'out' must have shape [B, Hkv, num_blocks] = [{B}, {H}, {k}], got {list(shape)}")
            contiguous = out.is_contiguous() if _is_torch(out) else bool(getattr(out, "flags", None) is not None
                                                                           and out.flags.c_contiguous)
            if not contiguous:
                raise ValueError("'out' must be C-contiguous (its rows are written as one [B*Hkv, num_blocks] block)")
        pred, row_len = self.predicted_scores(nblocks, stream=stream)
        rows = B * H
        if _is_torch(pred):
            p2, r1 = pred.view(rows, self.max_blocks), row_len.view(rows)
        else:
            p2, r1 = pred.reshape(rows, self.max_blocks), row_len.reshape(rows)
        o2 = out.view(rows, k) if _is_torch(out) else out.reshape(rows, k)
        topk_decode(p2, k, lengths=r1, out=o2, stream=stream)
        return out

    def update(self, scores, nblocks, *, stream=None) -> None:
        """Fold this step's block scores float32 ``[B, Hkv, Nb]`` (unit stride along Nb; Nb >= every
        ``nblocks[b]``) into the state, in place (see the class docstring)."""
        nblocks, B = self._nblocks(nblocks)
        lv, tr, kn = self.level[:B], self.trend[:B], self.known[:B]
        if compiling():
            if stream is not None:
                raise ValueError("'stream' is not supported under torch.compile: use `with torch.cuda.stream(s):`")
            _update_op.call(lv, tr, kn, nblocks, scores, self.alpha, self.beta, self.phi)
            return
        fw, like = self._framework(lv, nblocks, scores)
        (l, t, k, n, s), stream, nosync = prepare(fw, like, (lv, tr, kn, nblocks, scores), stream)
        _C.prr_ema_update(l, t, k, n, s, self.alpha, self.beta, self.phi, stream, nosync)

    def reset(self, rows=None) -> None:
        """Forget the state of batch rows (all KV heads): ``known[rows] = 0``. rows: None (every
        row), an int, a sequence of ints, or an integer array / tensor of row indices."""
        if rows is None:
            self.known[:] = 0
            return
        if isinstance(rows, bool):
            raise TypeError("'rows' must be None, an int, or a sequence of ints, got bool")
        if isinstance(rows, (int, np.integer)):
            idx = [int(rows)]
        elif _is_torch(rows) or isinstance(rows, np.ndarray):
            arr = rows.detach().cpu().numpy() if _is_torch(rows) else rows
            if arr.dtype.kind not in "iu":
                raise TypeError(f"'rows' must hold integers, got dtype {arr.dtype}")
            idx = [int(v) for v in arr.reshape(-1)]
        else:
            try:
                idx = list(rows)
            except TypeError:
                raise TypeError(f"'rows' must be None, an int, or a sequence of ints, got {type(rows).__name__}") \
                    from None
            for v in idx:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"'rows' must hold ints, got {type(v).__name__}")
        for v in idx:
            if not 0 <= v < self.max_batch:
                raise ValueError(f"'rows' must lie in [0, {self.max_batch}), got {v}")
        for v in idx:
            self.known[int(v)] = 0

    def __repr__(self):
        return (f"EMAPredictor(max_batch={self.max_batch}, Hkv={self.Hkv}, max_blocks={self.max_blocks}, "
                f"alpha={self.alpha}, beta={self.beta}, phi={self.phi}, device={str(self.device)!r})")


# --------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------
def _grid_points(grid):
    if grid is None:
        grid = DEFAULT_GRID
    if not isinstance(grid, (tuple, list)) or len(grid) != 3:
        raise TypeError("'grid' must be a triple of sequences (alphas, betas, phis), got "
                        f"{type(grid).__name__}" + (f" of length {len(grid)}" if isinstance(grid, (tuple, list)) else ""))
    axes = []
    for name, seq, open_ in zip(("alpha", "beta", "phi"), grid, (True, True, False)):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
            raise TypeError(f"'grid': the {name} values must be a sequence, got {type(seq).__name__}")
        vals = [_check_param(f"grid ({name})", v, open_) for v in seq]
        if not vals:
            raise ValueError(f"'grid': the {name} values must not be empty")
        axes.append(vals)
    return list(itertools.product(*axes))


def calibration_hit_rates(prefill_scores, k: int, *, grid=None, stream=None):
    """The mean score-weighted hit rate of every grid point -> (points, hits): points a list of
    (alpha, beta, phi) in lexicographic order, hits float64 NumPy ``[G]`` (see ``calibrate``)."""
    k = _check_int("k", k)
    points = _grid_points(grid)
    G = len(points)
    shape = getattr(prefill_scores, "shape", None)
    if shape is None:
        raise TypeError(f"'prefill_scores' must be a float32 array [T, Nb], got {type(prefill_scores).__name__}")
    if _is_torch(prefill_scores) and prefill_scores.is_cuda:
        t = sys.modules["torch"]
        dev = prefill_scores.device
        grid_t = t.tensor(points, dtype=t.float32, device=dev)
        hit = t.empty(G, dtype=t.float64, device=dev)
        need = 0
        if len(shape) == 2:
            need = _C.prr_ema_calibrate_workspace_size(dev.index if dev.index is not None else t.cuda.current_device(),
                                                       int(shape[0]), int(shape[1]), min(k, 2**31 - 1), G)
        ws = t.empty(max(need, 1), dtype=t.uint8, device=dev)
        (s, g, h, w), stream, nosync = prepare("torch", prefill_scores, (prefill_scores, grid_t, hit.view(t.int64), ws),
                                               stream)
        _C.prr_ema_calibrate(s, g, h, k, w, stream, nosync)
        return points, hit.cpu().numpy()
    grid_a = np.asarray(points, dtype=np.float32).reshape(G, 3)
    hit = np.empty(G, np.float64)
    (s,), _, _ = prepare(framework(prefill_scores), prefill_scores, (prefill_scores,), None)
    _C.prr_ema_calibrate(s, grid_a, hit.view(np.int64), k)
    return points, hit


def calibrate(prefill_scores, k: int, *, grid=None, stream=None):
    """Per-prompt hyper-parameters of the EMA predictor (paper 002, section 4.2) -> (alpha, beta, phi).

    prefill_scores: float32 ``[T, Nb]`` (T >= 2 steps of block scores, e.g. the prefill's block
    importance per token; NumPy, torch CPU or CUDA), unit stride along Nb; k: the selection's Top-K
    (>= 1; min(k, Nb) is used); grid: None (``DEFAULT_GRID``: 5 x 5 x 5) or a triple of sequences
    (alphas in (0, 1), betas in (0, 1), phis in [0, 1]) whose product is searched.

    For each grid point the predictor runs over the trajectory: every block exists from step 0, whose
    scores initialise the state (``L = s, T = 0``); at each step t >= 1 it predicts the Top-K ``P_t``,
    which is scored against the true Top-K ``S_t`` of ``scores[t]`` by the score-weighted hit rate
    ``sum_{P_t & S_t} x / sum_{S_t} x`` with ``x = s - min(finite s of row t)`` (non-finite scores
    weigh 0; when the denominator is 0, the overlap ``|P_t & S_t| / k``), and then updates with
    ``scores[t]``. Returns the point with the best mean hit rate over the T - 1 steps, ties to the
    first in (alpha, beta, phi) lexicographic order, as the values given in ``grid``.
    CPU: C, threads over grid points (deterministic). CUDA: one CTA per grid point in one launch
    (after one pass over the steps for the true Top-K); the same bits as the CPU (N <= 8192 blocks).
    """
    points, hit = calibration_hit_rates(prefill_scores, k, grid=grid, stream=stream)
    best = int(np.argmax(hit))  # the first maximum
    return tuple(float(v) for v in points[best])

