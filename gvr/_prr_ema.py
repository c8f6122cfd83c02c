"""PRR's EMA block predictor and its calibration (paper 002, sections 4.1-4.2): ``EMAPredictor``,
``calibrate``, ``calibration_hit_rates``, ``DEFAULT_GRID``. Exposed as ``gvr.prr.*``.

The predictor is Holt's damped-trend exponential smoothing of each block's importance score, per
(row b, KV head h, block j): a level ``L`` and a trend ``T`` (float32), and per (b, h) the number
``known`` of blocks that have state. With hyper-parameters alpha, beta in (0, 1) and phi in [0, 1]:

- **predict** (before this step's selection): ``pred[j] = L + phi*T`` for the blocks that have
  state; ``+inf`` for blocks ``known <= j < nblocks[b]`` (new since the last update, no score yet: the
  most recent block is always predicted); blocks ``j >= nblocks[b]`` do not exist. Optionally the
  blocks a selection always keeps are always predicted: ``+inf`` for ``j < keep_first`` and for
  ``j >= nblocks[b] - keep_last`` (``j < nblocks[b]``). The predicted selection is the Top-K of
  ``pred`` (``gvr.topk_decode``'s order: ties to the lower index), int32 ``[B, Hkv, K]``, -1 padded
  when a row has fewer than K blocks.
- **update** (after the selection, with this step's true scores ``s``): for a block with state,
  ``f = L + phi*T``, ``L' = alpha*s + (1 - alpha)*f``, ``T' = beta*(L' - L) + (1 - beta)*phi*T``; a new
  block starts at ``L = s``, ``T = 0``; then ``known = nblocks[b]``.
- **unobserved scores**: a score of ``-inf`` (masked) or NaN leaves a block's state unchanged; a new
  block whose first score is unobserved gets ``L = -inf`` (predicted ``-inf``: ranked last, as the
  selection ranks it) until its first observed score, which starts it as a new block (``L = s``,
  ``T = 0``). ``+inf`` follows IEEE arithmetic.
- **block counts**: ``nblocks[b]`` is the row's block count, or with ``block_size = G > 1`` its token
  count (e.g. the sequence lengths), the block count then being ``ceil(nblocks[b] / G)``.
- **update_predict**: the update, then the prediction of the updated state, in one pass over the state
  (one C call / one CUDA kernel) and one ``topk_decode``: the same bits as ``update`` then ``predict``.

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
import numbers
from numbers import Real

import numpy as np

from . import _C
from ._interop import _torch_module, check_int, compiling, define_op, framework, prepare
from .topk import topk_decode

_I32_MAX = 2**31 - 1  # the kernels' int32

__all__ = ["EMAPredictor", "calibrate", "calibration_hit_rates", "DEFAULT_GRID"]

#: alpha, beta in {1/6, ..., 5/6}, phi in {0, 0.25, 0.5, 0.75, 1}: 125 points
DEFAULT_GRID = (tuple(i / 6 for i in range(1, 6)), tuple(i / 6 for i in range(1, 6)),
                (0.0, 0.25, 0.5, 0.75, 1.0))


def _int32_list(name, v):
    """a list or tuple of ints as an int32 array: non-integers and values past int32 named (np.asarray
    would truncate 4.9 to 4, or raise an OverflowError naming nothing)"""
    a = np.asarray(v)
    if a.dtype == object and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in a.ravel()):
        raise ValueError(f"'{name}' values must fit in int32, got {min(a.ravel())}..{max(a.ravel())}")  # past int64
    if a.dtype == bool or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"'{name}' must hold ints, got {a.dtype} values")
    if a.size and (a.min() < -2**31 or a.max() > 2**31 - 1):
        raise ValueError(f"'{name}' values must fit in int32, got {a.min()}..{a.max()}")
    return a.astype(np.int32)


def _check_counts(block_size, keep_first=0, keep_last=0):
    return check_int("block_size", block_size, 1, _I32_MAX), check_int("keep_first", keep_first, 0, _I32_MAX), \
        check_int("keep_last", keep_last, 0, _I32_MAX)


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
def _scores_impl(level, trend, known, nblocks, pred, row_len, phi, block_size=1, keep_first=0, keep_last=0):
    (l, t, k, n, p, r), stream, nosync = prepare(framework(level), level, (level, trend, known, nblocks, pred,
                                                                           row_len), None)
    _C.prr_ema_predict(l, t, k, n, p, r, phi, stream, nosync, block_size=block_size, keep_first=keep_first,
                       keep_last=keep_last)


def _update_impl(level, trend, known, nblocks, scores, alpha, beta, phi, block_size=1):
    (l, t, k, n, s), stream, nosync = prepare(framework(level), level, (level, trend, known, nblocks, scores), None)
    _C.prr_ema_update(l, t, k, n, s, alpha, beta, phi, stream, nosync, block_size=block_size)


def _update_predict_impl(level, trend, known, nblocks, scores, pred, row_len, alpha, beta, phi, block_size=1,
                         keep_first=0, keep_last=0):
    (l, t, k, n, s, p, r), stream, nosync = prepare(framework(level), level, (level, trend, known, nblocks, scores,
                                                                              pred, row_len), None)
    _C.prr_ema_update(l, t, k, n, s, alpha, beta, phi, stream, nosync, block_size=block_size, pred=p, row_len=r,
                      keep_first=keep_first, keep_last=keep_last)


def _none(*args):
    return None


_scores_op = define_op(
    "prr_ema_scores",
    "(Tensor level, Tensor trend, Tensor known, Tensor nblocks, Tensor(a!) pred, Tensor(b!) row_len, float phi, "
    "int block_size=1, int keep_first=0, int keep_last=0) -> ()",
    impl=_scores_impl, fake=_none, mutates_args=("pred", "row_len"))
_update_op = define_op(
    "prr_ema_update",
    "(Tensor(a!) level, Tensor(b!) trend, Tensor(c!) known, Tensor nblocks, Tensor scores, float alpha, float beta, "
    "float phi, int block_size=1) -> ()",
    impl=_update_impl, fake=_none, mutates_args=("level", "trend", "known"))
_update_predict_op = define_op(
    "prr_ema_update_predict",
    "(Tensor(a!) level, Tensor(b!) trend, Tensor(c!) known, Tensor nblocks, Tensor scores, Tensor(d!) pred, "
    "Tensor(e!) row_len, float alpha, float beta, float phi, int block_size=1, int keep_first=0, int keep_last=0) "
    "-> ()",
    impl=_update_predict_impl, fake=_none, mutates_args=("level", "trend", "known", "pred", "row_len"))


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

    or, predicting the next step right after the update (one pass over the state, one Top-K)::

        predictor.update_predict(scores, lengths, k, out, block_size=G, keep_first=1, keep_last=2)

    Semantics (module docstring of gvr._prr_ema, kernels/gvr_kernels.h):

    - ``predict``: ``level + phi*trend`` for blocks with state, ``+inf`` for blocks new since the
      last update (always predicted) and for the ``keep_first`` first and ``keep_last`` last blocks
      of the row (the blocks a selection always keeps; 0 by default), nothing for ``j >= nb``; Top-K
      per (b, h) as ``gvr.topk_decode`` (ties to the lower index, -1 padding). One C call / kernel
      for the predicted scores, then one ``topk_decode`` over the ``B * Hkv`` rows — no Python loop.
    - ``update``: Holt's damped trend, ``f = L + phi*T; L' = alpha*s + (1-alpha)*f;
      T' = beta*(L'-L) + (1-beta)*phi*T``; new blocks start at ``L = s, T = 0``; a ``-inf`` or NaN
      score leaves the block unchanged (a new block's first unobserved score gives ``L = -inf``:
      predicted last until observed); then ``known = nb``.
    - ``update_predict``: ``update`` then ``predict`` (the same arguments, the same bits) with one
      C call / one kernel for both (each row's update and prediction in one pass) and one
      ``topk_decode``.
    - ``reset(rows)``: forget rows (a new sequence in those batch slots): ``known = 0``.

    nblocks: int32 ``[B]`` (NumPy / torch CPU on "cpu", where each row's block count must lie in
    [0, max_blocks]; a CUDA tensor on a CUDA device, where block counts are clamped to that range —
    no host read). block_size (int >= 1, default 1): 1, ``nblocks`` are block counts ``nb``; G > 1,
    they are token counts (e.g. sequence lengths) and ``nb = ceil(nblocks[b] / G)`` (negative
    token counts: 0 on CUDA, a ValueError on the CPU).
    Graph-safe on CUDA: ``predict(..., out=)``, ``update`` and ``update_predict`` allocate nothing and
    read nothing back, and their buffers keep their addresses, so a decode step can be captured in a
    CUDA graph and replayed (alpha, beta, phi are captured as values: ``set_params`` after a capture
    does not change the graph). ``calibrate(prefill_scores, k)`` gives hyper-parameters for ``set_params``.
    """

    def __init__(self, max_batch: int, Hkv: int, max_blocks: int, *, alpha: float = 0.5, beta: float = 0.5,
                 phi: float = 0.5, device="cpu"):
        self.max_batch = check_int("max_batch", max_batch)
        self.Hkv = check_int("Hkv", Hkv)
        self.max_blocks = check_int("max_blocks", max_blocks, 1, 2**31 - 1)
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
                    nblocks = _int32_list("nblocks", nblocks)
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

    def _check_out(self, out, B, k):
        """out: int32 [B, Hkv, k], C-contiguous, on this predictor's device."""
        H = self.Hkv
        shape = getattr(out, "shape", None)
        if shape is None:
            raise TypeError(f"'out' must be an int32 array [B, Hkv, num_blocks], got {type(out).__name__}")
        shape = tuple(int(d) for d in shape)
        if shape != (B, H, k):
            raise ValueError(f"'out' must have shape [B, Hkv, num_blocks] = [{B}, {H}, {k}], got {list(shape)}")
        if str(out.dtype).replace("torch.", "") != "int32":
            raise TypeError(f"'out' must be int32, got {out.dtype}")
        contiguous = out.is_contiguous() if _is_torch(out) else bool(getattr(out, "flags", None) is not None
                                                                       and out.flags.c_contiguous)
        if not contiguous:
            raise ValueError("'out' must be C-contiguous (its rows are written as one [B*Hkv, num_blocks] block)")
        on_cuda = _is_torch(out) and out.is_cuda
        if self.device == "cpu":
            if on_cuda:
                raise ValueError("'out' must be on the CPU for a CPU predictor, got a CUDA tensor")
        elif not on_cuda or out.device != self.device:
            raise ValueError(f"'out' must be an int32 CUDA tensor on {self.device} for a CUDA predictor, got "
                             + (f"one on {out.device}" if _is_torch(out) else type(out).__name__))

    def _topk(self, pred, row_len, k, out, B, stream):
        """the Top-k of pred[b, h, :row_len[b, h]] into out, one topk_decode over the B * Hkv rows"""
        rows = B * self.Hkv
        if _is_torch(pred):
            p2, r1 = pred.view(rows, self.max_blocks), row_len.view(rows)
        else:
            p2, r1 = pred.reshape(rows, self.max_blocks), row_len.reshape(rows)
        o2 = out.view(rows, k) if _is_torch(out) else out.reshape(rows, k)
        topk_decode(p2, k, lengths=r1, out=o2, stream=stream)
        return out

    # -- the step ---------------------------------------------------------------------------------
    def predicted_scores(self, nblocks, *, block_size=1, keep_first=0, keep_last=0, stream=None):
        """The predicted scores and row lengths -> (pred float32 [B, Hkv, max_blocks], row_len int32
        [B, Hkv]): views of the predictor's buffers (overwritten by the next call). ``predict`` is the
        Top-K of ``pred[b, h, :row_len[b, h]]``. block_size (>= 1): > 1, nblocks holds token counts;
        keep_first, keep_last (>= 0): the first / last blocks of each row predicted ``+inf``."""
        G, kf, kl = _check_counts(block_size, keep_first, keep_last)
        nblocks, B = self._nblocks(nblocks)
        lv, tr, kn, pr, rl = self.level[:B], self.trend[:B], self.known[:B], self._pred[:B], self._row_len[:B]
        if compiling():
            if stream is not None:
                raise ValueError("'stream' is not supported under torch.compile: use `with torch.cuda.stream(s):`")
            _scores_op.call(lv, tr, kn, nblocks, pr, rl, self.phi, G, kf, kl)
            return pr, rl
        fw, like = self._framework(lv, nblocks)
        (l, t, k, n, p, r), stream, nosync = prepare(fw, like, (lv, tr, kn, nblocks, pr, rl), stream)
        _C.prr_ema_predict(l, t, k, n, p, r, self.phi, stream, nosync, block_size=G, keep_first=kf, keep_last=kl)
        return pr, rl

    def predict(self, num_blocks: int, nblocks, out=None, *, block_size=1, keep_first=0, keep_last=0, stream=None):
        """The predicted selection -> int32 ``[B, Hkv, num_blocks]`` (B = ``nblocks.shape[0]``).

        Per (b, h): the Top-K (``gvr.topk_decode``'s order, ties to the lower index) of the predicted
        scores of the row's nb blocks — ``level + phi*trend``, ``+inf`` for blocks new since the last
        update and for the ``keep_first`` first and ``keep_last`` last blocks (>= 0, default 0) —
        then -1 padding. nb = ``nblocks[b]``, or ``ceil(nblocks[b] / block_size)`` when block_size > 1
        (nblocks then holds token counts). out: a C-contiguous int32 ``[B, Hkv, num_blocks]`` to write
        into (required for allocation-free, graph-safe calls); allocated otherwise (NumPy, or torch in
        nblocks' framework and device)."""
        k = check_int("num_blocks", num_blocks, 0, _I32_MAX)  # before anything is allocated
        _check_counts(block_size, keep_first, keep_last)
        nblocks, B = self._nblocks(nblocks)
        H = self.Hkv
        if out is None:
            if _is_torch(nblocks):
                out = _torch_module().empty((B, H, k), dtype=_torch_module().int32, device=nblocks.device)
            else:
                out = np.empty((B, H, k), np.int32)
        else:
            self._check_out(out, B, k)
        pred, row_len = self.predicted_scores(nblocks, block_size=block_size, keep_first=keep_first,
                                              keep_last=keep_last, stream=stream)
        return self._topk(pred, row_len, k, out, B, stream)

    def update(self, scores, nblocks, *, block_size=1, stream=None) -> None:
        """Fold this step's block scores float32 ``[B, Hkv, Nb]`` (unit stride along Nb; on the CPU
        Nb >= every row's block count nb, on CUDA a row's blocks from Nb on are left out: ``known =
        min(nb, Nb)``) into the state, in place (see the class docstring). block_size (>= 1): > 1,
        nblocks holds token counts (nb = ceil(nblocks[b] / block_size))."""
        G = check_int("block_size", block_size, 1, _I32_MAX)
        nblocks, B = self._nblocks(nblocks)
        lv, tr, kn = self.level[:B], self.trend[:B], self.known[:B]
        if compiling():
            if stream is not None:
                raise ValueError("'stream' is not supported under torch.compile: use `with torch.cuda.stream(s):`")
            _update_op.call(lv, tr, kn, nblocks, scores, self.alpha, self.beta, self.phi, G)
            return
        fw, like = self._framework(lv, nblocks, scores)
        (l, t, k, n, s), stream, nosync = prepare(fw, like, (lv, tr, kn, nblocks, scores), stream)
        _C.prr_ema_update(l, t, k, n, s, self.alpha, self.beta, self.phi, stream, nosync, block_size=G)

    def update_predict(self, scores, nblocks, num_blocks: int, out, *, block_size=1, keep_first=0, keep_last=0,
                       stream=None):
        """``update(scores, nblocks)`` then ``predict(num_blocks, nblocks, out)`` (the same keywords) ->
        out, bit for bit, in one C call / one CUDA kernel (each row's update and the prediction of the
        updated row in one pass over the state, into the predictor's own score buffers) and one
        ``topk_decode`` over the ``B * Hkv`` rows.

        out: int32 ``[B, Hkv, num_blocks]``, C-contiguous, on the predictor's device (required:
        allocation-free and graph-safe). The arguments are checked before anything is written: a
        ValueError / TypeError (naming the argument) leaves the state as it was."""
        k = check_int("num_blocks", num_blocks, lo=0)
        G, kf, kl = _check_counts(block_size, keep_first, keep_last)
        nblocks, B = self._nblocks(nblocks)
        if out is None:
            raise TypeError("'out' is required: an int32 [B, Hkv, num_blocks] array (update_predict allocates "
                            "nothing)")
        self._check_out(out, B, k)
        lv, tr, kn, pr, rl = self.level[:B], self.trend[:B], self.known[:B], self._pred[:B], self._row_len[:B]
        if compiling():
            if stream is not None:
                raise ValueError("'stream' is not supported under torch.compile: use `with torch.cuda.stream(s):`")
            _update_predict_op.call(lv, tr, kn, nblocks, scores, pr, rl, self.alpha, self.beta, self.phi, G, kf, kl)
            return self._topk(pr, rl, k, out, B, None)
        fw, like = self._framework(lv, nblocks, scores)
        (l, t, k_, n, s, p, r), cstream, nosync = prepare(fw, like, (lv, tr, kn, nblocks, scores, pr, rl), stream)
        _C.prr_ema_update(l, t, k_, n, s, self.alpha, self.beta, self.phi, cstream, nosync, block_size=G, pred=p,
                          row_len=r, keep_first=kf, keep_last=kl)
        return self._topk(pr, rl, k, out, B, stream)

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
    k = check_int("k", k)
    points = _grid_points(grid)
    G = len(points)
    shape = getattr(prefill_scores, "shape", None)
    if shape is None:
        raise TypeError(f"'prefill_scores' must be a float32 array [T, Nb], got {type(prefill_scores).__name__}")
    if _is_torch(prefill_scores) and prefill_scores.is_cuda:
        t = _torch_module()
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

