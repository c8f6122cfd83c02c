"""PRR's per-layer runtime (paper 002, sections 4.3-4.4): ``SpeculativeAttention`` and the Quest
selection helper ``quest_select``. Exposed as ``gvr.prr.*``.

One decode step of one layer (``SpeculativeAttention.step``):

1. ``predicted`` = the prediction made at the end of the previous step (``round(budget * k)`` blocks per
   (row, KV head); empty, all -1, at the first step and after ``reset``);
2. speculative attention over ``predicted`` (``gvr.sparse_attention``; in exact mode with
   ``partials=``) -- on CUDA on a side stream owned by the object, while
3. the caller's selection stage ``select(q)`` runs on the caller's current stream;
4. (events join) exact mode: ``gvr.prr.finalize(partials, predicted, selected)``; then one
   ``gvr.prr.repair(..., selected, exclude=predicted, counts=, cast_out=)``: the entries of
   ``selected`` that ``predicted`` lacks (``missed(selected, predicted)``, found inside the repair
   kernel), the hit counts, and the result in the output's dtype, in one launch. Exact mode: attention
   over exactly ``selected``; superset mode: over ``predicted`` (as listed: an entry listed twice
   counts twice, out-of-range entries count nothing) plus the entries of ``selected`` it lacks;
5. the predictor, on CUDA on the side stream concurrently with the repair: "ema" folds the step's block
   scores into ``gvr.prr.EMAPredictor`` and predicts the next step's Top-``round(budget*k)`` blocks
   (``EMAPredictor.update_predict``: one pass over its state, the always-kept blocks forced in, then
   one Top-K); "last" takes this step's selection (its first ``round(budget*k)`` entries, -1 padded)
   -- with ``quest_select(..., sorted=True)`` the best-scored blocks, on every device. With
   ``step(..., join=True)`` (the default) the step ends by waiting for it; ``join=False`` leaves it
   running into whatever the caller does next (a model's other layers), joined by the next step or
   ``join()``.

``budget = 0`` turns speculation off: the step is plain serial attention over ``selected`` -- the same one
launch as calling ``sparse_attention`` (into ``out`` directly, no float32 state in between).
The state is kept in float32 (out ``[B, Hq, D]``, lse ``[B, Hq]``) and converted once to q's dtype.
"""
from __future__ import annotations

import math
import sys
from numbers import Real

import numpy as np

from .attention import repair as _repair
from .attention import sparse_attention
from ._interop import check_int
from ._prr_ema import EMAPredictor
from ._prr_select import _overlap, select_blocks

__all__ = ["SpeculativeAttention", "quest_select"]

_NAME = "gvr.prr.SpeculativeAttention"


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _shape(x):
    s = getattr(x, "shape", None)
    return None if s is None else tuple(int(d) for d in s)


def _dtype_name(dt):
    """'float32' / 'float16' / 'bfloat16' of a NumPy or torch dtype or a name; None if not one."""
    if dt is None:
        return None
    s = str(dt).replace("torch.", "")
    if s in ("float32", "float16", "bfloat16"):
        return s
    try:
        s = np.dtype(dt).name
    except TypeError:
        return None
    return s if s in ("float32", "float16") else None


def _import_torch():
    """torch (imported here when the caller has not: bfloat16 buffers on the CPU are torch tensors)"""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TypeError("bfloat16 on the CPU needs torch (NumPy has no bfloat16): install torch or use float32 / "
                        "float16") from e
    return torch


def _unit_last(x):
    """unit stride along the last dimension (what the kernels write), or a last dimension of 1"""
    if x.shape[-1] <= 1:
        return True
    if _is_torch(x):
        return x.stride(-1) == 1
    return x.strides[-1] == x.itemsize


def _is_cuda(x):
    return _is_torch(x) and x.is_cuda or type(x).__module__.startswith("cupy")


class SpeculativeAttention:
    """PRR's speculate-select-repair step for one layer, with every buffer at a fixed address.

    ``SpeculativeAttention(max_batch, Hq, Hkv, D, max_blocks, *, block_size, k, budget=1.0,
    mode="exact", predictor="ema", alpha=0.5, beta=0.5, phi=0.5, device="cpu", dtype=None)``

    max_blocks:  blocks of ``block_size`` tokens a row can hold (>= ceil(lengths / block_size)).
    k:           the selection's Top-K (blocks per (row, KV head)).
    budget:      speculation budget rho >= 0: ``n_pred = round(budget * k)`` predicted blocks per (row,
                 KV head) (at most max_blocks); 0 = no speculation (serial attention over the selection).
    mode:        "exact" (attention over exactly the selected set: DSA semantics; keeps partial states
                 ``[max_batch, Hq, n_pred, D]`` float32) or "superset" (the paper's default: attention
                 over predicted plus the selected blocks it missed).
    predictor:   "ema" (``gvr.prr.EMAPredictor`` with alpha, beta, phi; ``self.predictor``; needs the
                 block scores from ``select``) or "last" (last-step reuse).
    keep_first, keep_last: the blocks the selection always keeps (``select_blocks``' init_blocks and
                 local_blocks): the "ema" prediction always includes them too.
    device:      "cpu" (NumPy buffers; NumPy or torch CPU inputs) or a CUDA device (torch buffers).
    dtype:       the dtype of the returned ``out`` buffer ("float32", "float16", "bfloat16"); None: q's,
                 made at the first step in that dtype (give it to capture the first step in a graph).

    ``step(q, k_cache, v_cache, block_table, lengths, select, *, scale=None, out=None, join=True,
    k_scale=None, v_scale=None) -> (out, lse)``: q ``[B, Hq, D]`` (B <= max_batch), the paged caches
    (q's dtype or fp8 e4m3fn with ``k_scale`` / ``v_scale``), ``block_table`` int32 ``[B, max_pages]``
    and ``lengths`` int32 ``[B]`` (or None) as ``gvr.sparse_attention`` takes them with
    ``block_size=block_size``.

    ``select(q)`` is the caller's selection stage. It returns ``selected`` -- int32 ``[B, Hkv, k]``
    logical block numbers, -1 padded, distinct per row (a Top-K) -- or the pair ``(selected,
    scores)`` with ``scores`` float32 ``[B, Hkv, Nb]`` (unit stride along Nb, Nb >= every row's block
    count): the block scores the selection ranked, which the "ema" predictor needs (and "last"
    ignores). Feed the EMA *finite* importance scores -- e.g. ``gvr.prr.block_scores(...,
    keep_first=0, keep_last=0)``; a block scored +inf (a keep range) carries an infinite level from
    then on. ``quest_select`` builds such a callable. On CUDA ``select`` runs on the caller's current
    stream, concurrently with the speculative attention, and must not synchronize with the host if
    the step is to be captured.

    Returns ``(out, lse)``: out ``[B, Hq, D]`` in q's dtype (or written into the given ``out``), lse
    float32 ``[B, Hq]`` (natural log) -- views of the object's buffers, overwritten by the next step.
    ``state`` is the float32 ``(out, lse)`` state (budget 0: the step is one ``sparse_attention``
    launch straight into ``out`` where that takes out's dtype -- q's or float32, q's device -- and
    ``state``'s out is then left as it was; lse is always the state's). Exact mode: attention over
    exactly ``selected``;
    superset mode: over the multiset ``predicted`` (entries as listed) + ``missed(selected,
    predicted)``.

    The prediction of a step is made at the end of the step before it (with that step's block
    counts ``ceil(lengths / block_size)``); ``set_prediction(predicted)`` overrides it (any int32
    ``[B, Hkv, n_pred]``: -1, out-of-range and duplicated entries allowed), ``prediction(B)`` reads
    the buffer, ``reset(rows)`` forgets rows (a new sequence in those batch slots).

    Hit rates: ``last_hit_rate`` = |predicted ∩ selected| / |selected entries >= 0|, pooled over the
    step's rows and KV heads (entries of ``selected`` found in the same row's ``predicted``);
    ``mean_hit_rate``: the same pooled over every step since construction (or ``reset_hit_rates``).
    1.0 when no entry was selected. Counted by the ``missed`` pass itself (``gvr.prr.missed(...,
    counts=)``: no extra kernel) into a small int64 array ``hit_counts`` = [last hits, last selected,
    total hits, total selected]; reading the properties synchronizes. A runtime without speculation
    (budget 0) counts nothing and reports 0.

    On CUDA the
    speculative attention and the predictor run on ``self.side_stream``, joined by events; the step
    allocates nothing and reads nothing back after a first eager step (gvr's per-stream workspaces are
    then made), so a step -- both streams -- can be captured in one CUDA graph and replayed.

    ``step(..., join=False)`` (CUDA): the step returns once the repair is enqueued, the predictor still
    running on the side stream; it reads ``lengths`` and the selection's ``selected`` / ``scores``, so
    those must not change before the next step of this object (which waits for it before its
    selection) or ``join()``. Call ``join()`` before ending a graph capture whose last step used
    ``join=False``. On the CPU ``join`` changes nothing.
    """

    def __init__(self, max_batch, Hq, Hkv, D, max_blocks, *, block_size, k, budget=1.0, mode="exact",
                 predictor="ema", alpha=0.5, beta=0.5, phi=0.5, keep_first=1, keep_last=2, device="cpu",
                 dtype=None):
        self.max_batch = check_int("max_batch", max_batch)
        self.keep_first = check_int("keep_first", keep_first, lo=0)
        self.keep_last = check_int("keep_last", keep_last, lo=0)
        self.Hq = check_int("Hq", Hq)
        self.Hkv = check_int("Hkv", Hkv)
        if self.Hq % self.Hkv:
            raise ValueError(f"'Hq' must be a multiple of 'Hkv', got Hq={self.Hq}, Hkv={self.Hkv}")
        self.D = check_int("D", D)
        self.max_blocks = check_int("max_blocks", max_blocks, 1, 2**31 - 1)
        self.block_size = check_int("block_size", block_size)
        self.k = check_int("k", k)
        if isinstance(budget, bool) or not isinstance(budget, Real):
            raise TypeError(f"'budget' must be a float, got {type(budget).__name__}")
        if not (math.isfinite(float(budget)) and float(budget) >= 0):
            raise ValueError(f"'budget' must be a finite float >= 0, got {budget!r}")
        self.budget = float(budget)
        # (min first: budget * k may overflow to inf, which floor cannot take)
        self.n_pred = min(int(math.floor(min(self.budget * self.k, self.max_blocks) + 0.5)), self.max_blocks)
        if not isinstance(mode, str):
            raise TypeError(f"'mode' must be 'exact' or 'superset', got {type(mode).__name__}")
        if mode not in ("exact", "superset"):
            raise ValueError(f"'mode' must be 'exact' or 'superset', got {mode!r}")
        self.mode = mode
        if not isinstance(predictor, str):
            raise TypeError(f"'predictor' must be 'ema' or 'last', got {type(predictor).__name__}")
        if predictor not in ("ema", "last"):
            raise ValueError(f"'predictor' must be 'ema' or 'last', got {predictor!r}")
        self.predictor_kind = predictor
        if dtype is not None and _dtype_name(dtype) is None:
            raise ValueError(f"'dtype' must be float32, float16 or bfloat16 (or None), got {dtype!r}")
        dev = str(device)
        if dev == "cpu":
            self.device = "cpu"
            self._torch = None
        elif not dev.startswith("cuda"):
            raise ValueError(f"'device' must be 'cpu' or a CUDA device, got {device!r}")
        else:
            try:
                import torch
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise RuntimeError(f"{_NAME} on a CUDA device needs torch") from e
            tdev = torch.device(device)
            if tdev.index is None:
                tdev = torch.device("cuda", torch.cuda.current_device())
            self.device = tdev
            self._torch = torch
        # the EMA predictor validates alpha, beta, phi (its own buffers: level, trend, known)
        self.predictor = EMAPredictor(self.max_batch, self.Hkv, self.max_blocks, alpha=alpha, beta=beta, phi=phi,
                                      device=device) if predictor == "ema" else None
        B, Hq_, Hkv_, D_, n = self.max_batch, self.Hq, self.Hkv, self.D, self.n_pred
        self._pred = self._full((B, Hkv_, n), -1, "int32")           # this step's prediction
        # CUDA: the next step's prediction, made on the side stream while the repair reads _pred
        self._pred_next = self._full((B, Hkv_, n), -1, "int32") if self._torch is not None else None
        self._fresh = False  # _pred_next holds a prediction not yet copied into _pred (step(join=False))
        self._state_out = self._full((B, Hq_, D_), 0, "float32")
        self._state_lse = self._full((B, Hq_), -np.inf, "float32")
        if mode == "exact" and n > 0:
            self._part_out = self._full((B, Hq_, n, D_), 0, "float32")
            self._part_lse = self._full((B, Hq_, n), -np.inf, "float32")
        else:
            self._part_out = self._part_lse = None
        self._nblocks = self._full((B,), 0, "int32")
        self._counts = self._full((4,), 0, "int64")  # last hits, last selected, total hits, total selected
        self._outs = {}  # (framework, dtype name) -> returned-out buffer [max_batch, Hq, D]
        if self._torch is not None:
            t = self._torch
            self.side_stream = t.cuda.Stream(device=self.device)
            self._ev_start = t.cuda.Event()
            self._ev_spec = t.cuda.Event()
            self._ev_sel = t.cuda.Event()
            self._ev_pred = t.cuda.Event()
            if dtype is not None:
                self._out_buffer("torch", _dtype_name(dtype))
        else:
            self.side_stream = None
            if dtype is not None:
                self._out_buffer("torch" if _dtype_name(dtype) == "bfloat16" else "numpy", _dtype_name(dtype))

    # -- buffers ----------------------------------------------------------------------------------
    def _full(self, shape, value, dtype):
        if self._torch is None:
            return np.full(shape, value, dtype=dtype)
        t = self._torch
        return t.full(shape, value, dtype=getattr(t, dtype), device=self.device)

    def _out_buffer(self, fw, name):
        key = (fw, name)
        buf = self._outs.get(key)
        if buf is None:
            shape = (self.max_batch, self.Hq, self.D)
            if fw == "torch":
                t = self._torch or _import_torch()
                dev = self.device if self._torch is not None else "cpu"
                buf = t.zeros(shape, dtype=getattr(t, name), device=dev)
            else:
                buf = np.zeros(shape, dtype=name)
            self._outs[key] = buf
        return buf

    def _view(self, a, like_torch):
        """a NumPy buffer as a torch CPU tensor when the caller works in torch (shared memory)."""
        if like_torch and isinstance(a, np.ndarray):
            return _import_torch().from_numpy(a)
        return a

    @property
    def state(self):
        """The float32 state (out [max_batch, Hq, D], lse [max_batch, Hq]) of the last step (rows < B); with
        budget 0 out is written only when the step's out could not take the attention directly."""
        return self._state_out, self._state_lse

    @property
    def hit_counts(self):
        """int64 [4]: hits and selected entries of the last step, then of every step so far."""
        return self._counts

    # -- prediction hooks ---------------------------------------------------------------------------
    def prediction(self, B=None):
        """The prediction buffer (int32 [B, Hkv, n_pred]) the next step will speculate on (joins a pending
        ``step(join=False)`` first)."""
        if B is not None:
            B = check_int("B", B)
            if B > self.max_batch:
                raise ValueError(f"'B' must lie in [1, {self.max_batch}], got {B}")
        self.join()
        return self._pred[: self.max_batch if B is None else B]

    def set_prediction(self, predicted):
        """Override the next step's prediction: int32 ``[B, Hkv, n_pred]`` (B <= max_batch; rows >= B
        are left as they are). Any entries: -1, out of range and duplicated ones included."""
        s = _shape(predicted)
        if s is None:
            raise TypeError(f"'predicted' must be an int32 array [B, Hkv, n_pred], got {type(predicted).__name__}")
        if len(s) != 3 or not 1 <= s[0] <= self.max_batch or s[1:] != (self.Hkv, self.n_pred):
            raise ValueError(f"'predicted' must have shape [B <= {self.max_batch}, {self.Hkv}, {self.n_pred}], "
                             f"got {list(s)}")
        if str(predicted.dtype).replace("torch.", "") != "int32":
            raise TypeError(f"'predicted' must be int32, got {predicted.dtype}")
        self.join()
        if self._torch is None:
            if _is_cuda(predicted):
                raise ValueError("'predicted' must be on the CPU for a CPU runtime")
            p = predicted.numpy() if _is_torch(predicted) else np.asarray(predicted)
            self._pred[: s[0]] = p
        else:
            self._pred[: s[0]].copy_(predicted)

    def reset(self, rows=None):
        """Forget rows (None: all): their prediction becomes empty and the EMA state forgets them."""
        self.join()
        if rows is None:
            idx = slice(None)
        elif isinstance(rows, bool) or not isinstance(rows, (int, np.integer, list, tuple, np.ndarray)):
            raise TypeError(f"'rows' must be None, an int or a sequence of ints, got {type(rows).__name__}")
        else:
            if isinstance(rows, np.ndarray):
                if rows.ndim > 1 or not (rows.size == 0 or np.issubdtype(rows.dtype, np.integer)):
                    raise TypeError(f"'rows' must be ints, got an array of {rows.dtype} with shape {rows.shape}")
                rows = [int(r) for r in rows.reshape(-1)]
            elif not isinstance(rows, (int, np.integer)) and any(isinstance(r, bool) or not isinstance(r, (int, np.integer))
                                                                 for r in rows):
                raise TypeError("'rows' must be ints")
            idx = [int(rows)] if isinstance(rows, (int, np.integer)) else [int(r) for r in rows]
            for r in idx:
                if not 0 <= r < self.max_batch:
                    raise ValueError(f"'rows' must lie in [0, {self.max_batch}), got {r}")
        if self.predictor is not None:
            self.predictor.reset(rows)
        if self._torch is None:
            self._pred[idx] = -1
        else:
            if isinstance(idx, slice):
                self._pred.fill_(-1)
            else:
                for r in idx:
                    self._pred[r].fill_(-1)

    # -- hit rates ----------------------------------------------------------------------------------
    def _rate(self, hits, sel):
        hits, sel = int(hits), int(sel)
        if self.n_pred == 0:
            return 0.0
        return 1.0 if sel == 0 else hits / sel

    @property
    def last_hit_rate(self) -> float:
        """|predicted ∩ selected| / |selected >= 0| of the last step, over its rows and KV heads (syncs)."""
        c = self._counts.tolist() if self._torch is not None else self._counts
        return self._rate(c[0], c[1])

    @property
    def mean_hit_rate(self) -> float:
        """The hit rate pooled over every step so far (syncs)."""
        c = self._counts.tolist() if self._torch is not None else self._counts
        return self._rate(c[2], c[3])

    def reset_hit_rates(self):
        if self._torch is None:
            self._counts[:] = 0
        else:
            self._counts.zero_()

    # -- the step -----------------------------------------------------------------------------------
    def _check_inputs(self, q, block_table, lengths, select, out):
        s = _shape(q)
        if s is None:
            raise TypeError(f"'q' must be an array [B, Hq, D], got {type(q).__name__}")
        if len(s) != 3 or s[1:] != (self.Hq, self.D) or not 1 <= s[0] <= self.max_batch:
            raise ValueError(f"'q' must have shape [B <= {self.max_batch}, {self.Hq}, {self.D}], got {list(s)}")
        cuda = _is_cuda(q)
        if cuda:
            if self._torch is None:
                raise ValueError(f"'q' is on a CUDA device but this runtime was made for the CPU (device='cpu')")
            if not _is_torch(q) or q.device != self.device:
                raise ValueError(f"'q' must be a torch tensor on {self.device}, got "
                                 f"{getattr(q, 'device', type(q).__name__)}")
        elif self._torch is not None:
            raise ValueError(f"'q' must be a CUDA tensor on {self.device} for this runtime, got a CPU array")
        B = s[0]
        bt = _shape(block_table)
        if bt is None:
            raise TypeError(f"'block_table' must be an int32 array [B, max_pages], got {type(block_table).__name__}")
        if len(bt) != 2 or bt[0] != B:
            raise ValueError(f"'block_table' must have shape [B={B}, max_pages], got {list(bt)}")
        if lengths is not None:
            ls = _shape(lengths)
            if ls is None:
                raise TypeError(f"'lengths' must be an int32 array [B] or None, got {type(lengths).__name__}")
            if ls != (B,):
                raise ValueError(f"'lengths' must have shape [B={B}], got {list(ls)}")
        if not callable(select):
            raise TypeError(f"'select' must be a callable select(q) -> selected or (selected, scores), got "
                            f"{type(select).__name__}")
        if out is not None:
            os_ = _shape(out)
            if os_ is None:
                raise TypeError(f"'out' must be an array [B, Hq, D], got {type(out).__name__}")
            if os_ != (B, self.Hq, self.D):
                raise ValueError(f"'out' must have shape [{B}, {self.Hq}, {self.D}], got {list(os_)}")
            if _dtype_name(getattr(out, "dtype", None)) is None:  # (an int buffer would truncate silently)
                raise TypeError(f"'out' must be float32, float16 or bfloat16, got {getattr(out, 'dtype', None)}")
            if getattr(out, "flags", None) is not None and not out.flags.writeable:
                raise ValueError("'out' is read-only")
            if _overlap(out, q):
                raise ValueError("'out' must not overlap 'q'")
        return B

    def _selection(self, q, select, B):
        res = select(q)
        scores = None
        if isinstance(res, tuple):
            if len(res) != 2:
                raise TypeError(f"'select' must return selected or (selected, scores), got a tuple of {len(res)}")
            res, scores = res
        s = _shape(res)
        if s is None:
            raise TypeError(f"'select' must return int32 selected [B, Hkv, k], got {type(res).__name__}")
        if s != (B, self.Hkv, self.k):
            raise ValueError(f"'select' returned selected of shape {list(s)}; expected [B, Hkv, k] = "
                             f"[{B}, {self.Hkv}, {self.k}]")
        if str(res.dtype).replace("torch.", "") != "int32":
            raise TypeError(f"'select' must return int32 selected, got {res.dtype}")
        if _is_cuda(res) != (self._torch is not None):
            raise ValueError(f"'select' returned selected on the wrong device (this runtime: {self.device})")
        if self.predictor_kind == "ema" and self.n_pred > 0:
            if scores is None:
                raise TypeError("'select' must return (selected, scores) for predictor='ema' (the block scores "
                                "float32 [B, Hkv, Nb] that the EMA predictor folds in)")
            ss = _shape(scores)
            if ss is None or len(ss) != 3 or ss[:2] != (B, self.Hkv):
                raise ValueError(f"'select' returned scores of shape {ss and list(ss)}; expected [B={B}, "
                                 f"Hkv={self.Hkv}, Nb]")
            if str(scores.dtype).replace("torch.", "") != "float32":
                raise TypeError(f"'select' must return float32 scores, got {scores.dtype}")
            if _is_cuda(scores) != (self._torch is not None):
                raise ValueError(f"'select' returned scores on the wrong device (this runtime: {self.device})")
        return res, scores

    def _block_counts(self, lengths, block_table, k_cache, B):
        """nblocks[b] = ceil(lengths[b] / block_size) into the fixed buffer (no host read on CUDA)."""
        G = self.block_size
        nb = self._nblocks[:B]
        if lengths is None:
            ks = _shape(k_cache)
            cap = _shape(block_table)[1] * ks[1] if ks and len(ks) == 4 else 0
            v = -(-cap // G)
            if self._torch is None:
                nb[:] = v
            else:
                nb.fill_(v)
        elif self._torch is None:
            ln = lengths.numpy() if _is_torch(lengths) else np.asarray(lengths)
            np.floor_divide(ln.astype(np.int64) + (G - 1), G, out=nb, casting="unsafe")
        else:
            t = self._torch
            t.add(lengths, G - 1, out=nb)
            t.floor_divide(nb, G, out=nb)
        if self._torch is None and self.predictor is not None and B and int(nb.max()) > self.max_blocks:
            raise ValueError(f"'lengths' holds a row of {int(nb.max())} blocks of {G} tokens; this runtime holds "
                             f"max_blocks={self.max_blocks}")
        return nb

    def _update_prediction(self, selected, scores, lengths, nblocks, B, dst):
        """The next step's prediction into dst (int32 [B, Hkv, n_pred]): "ema" folds the step's scores into the
        predictor and takes its Top-n_pred in one pass over the state (the always-kept blocks forced in) plus
        one Top-K; "last" copies the selection's first n_pred entries."""
        n = self.n_pred
        if self.predictor_kind == "ema":
            sc = scores
            if self._torch is None and _is_torch(sc):
                sc = sc.numpy()
            if nblocks is None:  # CUDA with lengths: the token counts themselves, blocks counted in the kernel
                nb, G = lengths, self.block_size
            else:
                nb, G = nblocks, 1
            try:
                self.predictor.update_predict(sc, nb, n, dst, block_size=G, keep_first=self.keep_first,
                                              keep_last=self.keep_last)
            except ValueError as e:  # in the words of step's caller: the scores come from its select
                if "width of 'scores'" in str(e):
                    raise ValueError(f"'select' returned scores of shape {list(_shape(scores))}: narrower than a "
                                     f"row's blocks (the EMA predictor needs every block's score: {e})") from None
                raise
            return
        m = min(n, self.k)
        if self._torch is None:
            sel = selected.numpy() if _is_torch(selected) else np.asarray(selected)
            dst[:, :, :m] = sel[:, :, :m]
            dst[:, :, m:] = -1
        else:
            dst[:, :, :m].copy_(selected[:, :, :m])
            if m < n:
                dst[:, :, m:].fill_(-1)

    def join(self):
        """Make the current stream wait for this runtime's side stream (the prediction made by a
        ``step(..., join=False)``) and bring that prediction into place. Needed before ending a CUDA-graph
        capture whose last step ran with ``join=False``; a no-op otherwise (and on the CPU)."""
        if self._torch is None or not self._fresh:
            return
        t = self._torch
        t.cuda.current_stream(self.device).wait_event(self._ev_pred)
        self._pred.copy_(self._pred_next)
        self._fresh = False

    def step(self, q, k_cache, v_cache, block_table, lengths, select, *, scale=None, out=None, join=True, k_scale=None,
             v_scale=None):
        """One decode step of this layer -> ``(out, lse)`` (see the class docstring)."""
        if not isinstance(join, (bool, np.bool_)):
            raise TypeError(f"'join' must be a bool, got {type(join).__name__}")
        B = self._check_inputs(q, block_table, lengths, select, out)
        torch_io = _is_torch(q)
        cpu = self._torch is None
        so, sl = self._state_out[:B], self._state_lse[:B]
        pred = self._pred[:B]
        if cpu and torch_io:  # torch CPU callers: torch views of the NumPy buffers (gvr takes both)
            so, sl = self._view(so, True), self._view(sl, True)
        akw = dict(block_table=block_table, lengths=lengths, block_size=self.block_size, scale=scale, k_scale=k_scale,
                   v_scale=v_scale)
        speculate = self.n_pred > 0
        ema = speculate and self.predictor is not None
        name = _dtype_name(q.dtype)
        if out is None:
            fw = "torch" if torch_io or name == "bfloat16" else "numpy"
            out = self._out_buffer(fw, name)[:B]
        # the repair writes the result in out's dtype too when it is q's or float32 (no conversion pass)
        cast = (out if _dtype_name(out.dtype) in (name, "float32") and _is_cuda(out) == (not cpu) and _unit_last(out)
                else None)
        if cast is not None and cpu and _is_torch(cast) != torch_io:
            cast = None
        partials = None
        if speculate and self.mode == "exact":
            partials = (self._part_out[:B], self._part_lse[:B])

        if not speculate:  # serial: attention over the selection, one launch straight into out where it can
            selected, scores = self._selection(q, select, B)
            sparse_attention(q, k_cache, v_cache, selected, out=so if cast is None else out, lse=sl, **akw)
            if cast is None:
                self._convert(out, so)
            return out, sl

        from .prr import finalize  # gvr.prr imports this module: late import
        if cpu:
            # block counts for the EMA: first (they are validated)
            nblocks = self._block_counts(lengths, block_table, k_cache, B) if ema else None
            self._counts[:2] = 0
            sparse_attention(q, k_cache, v_cache, pred, out=so, lse=sl, partials=partials, **akw)
            selected, scores = self._selection(q, select, B)
            if self.mode == "exact":
                finalize(partials, pred, selected, out=so, lse=sl)
            _repair(so, sl, q, k_cache, v_cache, selected, exclude=pred, counts=self._counts, cast_out=cast, **akw)
            self._update_prediction(selected, scores, None, nblocks, B, pred)
        else:
            # side stream: [the previous step's prediction into place], the hit counts of this step zeroed,
            # the speculative attention over the prediction -- while the caller's selection runs on main
            t = self._torch
            main = t.cuda.current_stream(self.device)
            side = self.side_stream
            fresh, self._fresh = self._fresh, False
            self._ev_start.record(main)
            side.wait_event(self._ev_start)
            with t.cuda.stream(side):
                if fresh:
                    self._pred.copy_(self._pred_next)
                self._counts[:2].zero_()
                sparse_attention(q, k_cache, v_cache, pred, out=so, lse=sl, partials=partials, **akw)
                self._ev_spec.record(side)
            if fresh:  # the previous step's predictor has read the selection's buffers before they change
                main.wait_event(self._ev_pred)
            selected, scores = self._selection(q, select, B)
            nblocks = None
            if ema and lengths is None:  # every row holds the block table's capacity
                nblocks = self._block_counts(None, block_table, k_cache, B)
            self._ev_sel.record(main)
            # the next step's prediction on the side stream, concurrent with the repair below (into
            # _pred_next: the repair reads _pred)
            side.wait_event(self._ev_sel)
            with t.cuda.stream(side):
                self._update_prediction(selected, scores, lengths, nblocks, B, self._pred_next[:B])
                self._ev_pred.record(side)
            # main: the join, then (exact) the speculated states that were selected, and the repair with the
            # missed entries (the hits skipped in the kernel, counted there)
            main.wait_event(self._ev_spec)
            if self.mode == "exact":
                finalize(partials, pred, selected, out=so, lse=sl)
            _repair(so, sl, q, k_cache, v_cache, selected, exclude=pred, counts=self._counts, cast_out=cast, **akw)
            self._fresh = True
            if join:
                self.join()
        if cast is None:
            self._convert(out, so)
        return out, sl

    def _convert(self, dst, src):
        """dst[...] = src (float32 state -> the output's dtype)."""
        if _is_torch(dst):
            if isinstance(src, np.ndarray):
                src = sys.modules["torch"].from_numpy(src)
            if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
                dst.copy_(src)
        else:
            s = src.numpy() if _is_torch(src) else src
            if not np.shares_memory(dst, s) or dst.dtype != s.dtype:
                np.copyto(dst, s, casting="unsafe")

    def __repr__(self):
        return (f"SpeculativeAttention(max_batch={self.max_batch}, Hq={self.Hq}, Hkv={self.Hkv}, D={self.D}, "
                f"max_blocks={self.max_blocks}, block_size={self.block_size}, k={self.k}, budget={self.budget}, "
                f"mode={self.mode!r}, predictor={self.predictor_kind!r}, device={str(self.device)!r})")


def quest_select(meta, k, lengths=None, *, block_size, init_blocks=1, local_blocks=2, group_reduce="max",
                 max_batch=None, sorted=False):
    """A selection stage for ``SpeculativeAttention.step``: ``select(q) -> (selected, scores)``.

    ``selected = gvr.prr.select_blocks(q, meta, k, lengths, block_size=..., init_blocks=...,
    local_blocks=..., sorted=sorted, scores_out=scores)`` (int32 ``[B, Hkv, k]``; sorted: best first,
    what the "last" predictor wants when its budget is below 1 -- it keeps the first entries -- at the
    price of a sort, ~18 us at k = 64 on the H100) and, from the same pass over the metadata,
    ``scores`` = ``gvr.prr.block_scores(q, meta, lengths, block_size=..., keep_first=0, keep_last=0)``
    (float32 ``[B, Hkv, Nb]``: the finite Quest scores the EMA predictor folds in), both written into
    buffers made here (fixed addresses: graph-safe).
    ``meta`` and ``lengths`` are read at each call: update them in place (``update_block_metadata``)
    between steps. B = q.shape[0] <= meta.shape[0] (or max_batch).
    """
    ms = _shape(meta)
    if ms is None or len(ms) != 5:
        raise ValueError(f"'meta' must be [B, Hkv, Nb, 2, D] (from gvr.prr.block_metadata), got {ms and list(ms)}")
    kk = check_int("k", k)
    Bm, Hkv, Nb = ms[:3]
    Bmax = Bm if max_batch is None else check_int("max_batch", max_batch)
    if _is_torch(meta):
        t = sys.modules["torch"]
        sel_buf = t.full((Bmax, Hkv, kk), -1, dtype=t.int32, device=meta.device)
        sc_buf = t.zeros((Bmax, Hkv, Nb), dtype=t.float32, device=meta.device)
    else:
        sel_buf = np.full((Bmax, Hkv, kk), -1, np.int32)
        sc_buf = np.zeros((Bmax, Hkv, Nb), np.float32)

    def select(q):
        B = int(q.shape[0])
        sel, sc = sel_buf[:B], sc_buf[:B]
        m = meta[:B]
        ln = lengths
        select_blocks(q, m, kk, ln, block_size=block_size, group_reduce=group_reduce, init_blocks=init_blocks,
                      local_blocks=local_blocks, out=sel, sorted=sorted, scores_out=sc)
        return sel, sc

    select.selected, select.scores = sel_buf, sc_buf
    return select
