"""gvr.prr: PRR's exact incremental repair of attention states (paper 002, section 4.3).

PRR attends the *predicted* KV blocks while block selection runs, then repairs the state with the
blocks the selection chose that the prediction missed. Two modes:

- **superset** (the paper's default): ``repair(out, lse, q, K, V, missed(selected, predicted))`` after
  ``sparse_attention(q, K, V, predicted)`` gives attention over predicted ∪ selected.
- **exact** (DSA semantics: attention over exactly the selected set): run the speculative attention
  with ``partials=(part_out, part_lse)``, then ``finalize(partials, predicted, selected)`` keeps the
  states of the predicted entries that were selected, and ``repair`` with ``missed(selected,
  predicted)`` adds the rest: equal to ``sparse_attention(q, K, V, selected)`` (selected entries
  distinct, as a Top-K gives them).

The selection stage (Quest, paper 002's evaluation): ``block_metadata`` / ``update_block_metadata``
keep per-block, per-channel key minima and maxima; ``block_scores`` gives Quest's upper bound per
(row, KV head, block); ``select_blocks`` takes their Top-K (``gvr.topk_decode``) with the first and most
recent blocks always kept. The predictor (section 4.1): ``EMAPredictor`` (Holt's damped trend per
block, state at fixed addresses) and ``calibrate`` (section 4.2: the grid point with the best
score-weighted hit rate over the prefill trajectory).

The runtime (section 4.3): ``SpeculativeAttention`` runs a layer's step — attention over the
predicted blocks (on a side stream on CUDA) while the caller's selection runs, then finalize (exact
mode) and one fused repair (``repair(..., exclude=predicted, counts=, cast_out=)``) — in exact or
superset mode, with the EMA or last-step predictor and hit rates;
``quest_select`` builds a selection stage for it; ``Budget`` (section 4.4) measures, per context,
the speculation ratio that makes the step fastest (0 where speculation does not pay).
``python -m gvr prr`` is its demo.

States to be repaired are kept in float32 (``out`` float32), so repeated repairs round once, at the
end. Every function runs on the CPU (C) for NumPy arrays / CPU tensors and on CUDA for device
tensors, on the caller's stream, in one launch, graph-safe.
"""
from __future__ import annotations


from . import _C
from ._interop import _torch_module, compiling, define_op, framework, prepare, traced_out
from .attention import _ATT, _check_traced_stream, _new, _none, _shape
from .attention import repair as _repair
from ._prr_ema import DEFAULT_GRID, EMAPredictor, calibrate, calibration_hit_rates  # noqa: F401
from ._prr_select import block_metadata, block_scores, select_blocks, update_block_metadata  # noqa: F401
from ._prr_runtime import SpeculativeAttention, quest_select  # noqa: F401
from ._prr_budget import Budget  # noqa: F401

__all__ = ["repair", "missed", "finalize", "block_metadata", "update_block_metadata", "block_scores",
           "select_blocks", "EMAPredictor", "calibrate", "calibration_hit_rates", "DEFAULT_GRID",
           "SpeculativeAttention", "quest_select", "Budget"]


def repair(out, lse, q, k_cache, v_cache, indices, *, lengths=None, block_table=None, block_size=1, scale=None,
           exclude=None, counts=None, cast_out=None, stream=None, k_scale=None, v_scale=None):
    """Fold attention over ``indices`` into the state ``(out, lse)`` in place -> ``(out, lse)``.

    out: float32 ``[B, Hq, D]``, lse: float32 ``[B, Hq]`` — a state from ``gvr.sparse_attention(...,
    out=<float32>)``, a previous repair, ``finalize`` or ``merge_states`` (natural-log lse). The
    other arguments are ``gvr.sparse_attention``'s (fp8 caches and ``k_scale`` / ``v_scale`` included). Afterwards ``(out, lse)`` is the state over the
    union (as multisets) of what it held and the entries of ``indices``; entries that are -1 or
    masked cost nothing, and an all-empty ``indices`` leaves the state bit for bit as it was. One
    kernel on CUDA (attention and merge fused), work proportional to the valid entries.

    PRR's step after the selection, fused into the same launch (all optional):

    exclude:   int32 ``[B, Hx, nx]`` (Hx = 1 or indices' Hsel), e.g. the speculated ``predicted``:
               an entry x >= 0 of ``indices[b, s]`` that occurs anywhere in ``exclude[b, s]`` (row 0
               when Hx = 1) is skipped -- the same state as ``repair(..., missed(indices, exclude))``
               without the ``missed`` pass and its buffer.
    counts:    contiguous int64 ``[2]`` or ``[4]`` on q's device: ``counts[0] +=`` the entries >= 0 of
               ``indices`` found in ``exclude`` (hits), ``counts[1] +=`` the entries >= 0 of
               ``indices`` (per selection row, not per query head); with 4 elements ``counts[2:4]``
               get the same additions (e.g. [this step, running total]: zero ``counts[:2]`` before).
    cast_out:  ``[B, Hq, D]`` in q's dtype or float32: also receives the repaired ``out`` converted
               (round to nearest even), every head, so the float32 state needs no second pass to
               become the layer's output.
    """
    if compiling():
        _check_traced_stream(stream, "prr.repair")
        if out is None or lse is None:
            raise TypeError("prr.repair: 'out' and 'lse' (the state to repair, out float32) must be given")
        _repair_op.call(out, lse, q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale,
                        v_scale, exclude, counts, cast_out)
        return out, lse
    return _repair(out, lse, q, k_cache, v_cache, indices, lengths=lengths, block_table=block_table,
                   block_size=block_size, scale=scale, exclude=exclude, counts=counts, cast_out=cast_out,
                   stream=stream, k_scale=k_scale, v_scale=v_scale)


def _run_missed(selected, predicted, out, stream, counts=None):
    fw = framework(selected)
    if out is None:
        out = _new(selected, fw, _shape(selected), "int32")
    (s, p, o, c), stream, nosync = prepare(fw, selected, (selected, predicted, out, counts), stream)
    r = _C.prr_missed(s, p, o, stream, nosync, c)
    return r if out is None else out


def missed(selected, predicted, *, out=None, counts=None, stream=None):
    """The entries of ``selected`` that ``predicted`` lacks -> int32 ``[B, H, n_sel]``.

    selected: int32 ``[B, H, n_sel]`` (e.g. this step's Top-K blocks, per KV head or shared, H = 1);
    predicted: int32 ``[B, Hp, n_pred]`` with Hp = 1 (shared by every head) or H. Row (b, h) of the
    result lists the entries x >= 0 of ``selected[b, h]`` absent from ``predicted[b, h]``, in
    ``selected``'s order, then -1: exactly what ``repair`` needs after a speculative pass over
    ``predicted``. On the device, no host round trip.

    counts: None, or a contiguous int64 ``[4]`` on selected's device, the hit statistics of the same
    pass: ``counts[0]`` = entries >= 0 of ``selected`` found in ``predicted`` (hits), ``counts[1]`` =
    entries >= 0 of ``selected``, both of this call (overwritten), and ``counts[2:4] += counts[0:2]``
    (running totals). Hit rate = counts[0] / counts[1].
    """
    if compiling():
        _check_traced_stream(stream, "prr.missed")
        if counts is not None:
            raise ValueError("prr.missed: 'counts' is not supported under torch.compile (eager calls only)")
        return traced_out(out, _missed_op.call(selected, predicted), "out", "prr.missed")
    return _run_missed(selected, predicted, out, stream, counts)


def _run_finalize(partials, predicted, selected, out, lse, stream):
    if not isinstance(partials, (tuple, list)) or len(partials) != 2:
        raise TypeError(f"'partials' must be a pair (part_out, part_lse), got {type(partials).__name__}")
    po, pl = partials
    fw = framework(po)
    ps = _shape(po)
    if ps is not None and len(ps) == 4:
        if out is None:
            out = _new(po, fw, (ps[0], ps[1], ps[3]), "float32")
        if lse is None:
            lse = _new(po, fw, ps[:2], "float32")
    (a, b, c, d, o, lo), stream, nosync = prepare(fw, po, (po, pl, predicted, selected, out, lse), stream)
    _C.prr_finalize(a, b, c, d, o, lo, stream, nosync)
    return out, lse


def finalize(partials, predicted, selected, *, out=None, lse=None, stream=None):
    """Exact mode: the state over the predicted entries that were selected -> ``(out, lse)``.

    partials: ``(part_out [B, Hq, n_pred, D], part_lse [B, Hq, n_pred])`` float32, written by
    ``gvr.sparse_attention(q, K, V, predicted, partials=...)``; predicted: int32 ``[B, Hsel, n_pred]``
    (the same indices), selected: int32 ``[B, Hsel, n_sel]``. For each row and query head h (selection
    head h // (Hq // Hsel)), merges in entry order the partial states of the entries whose value is
    >= 0, occurs in ``selected``, and is its first occurrence in ``predicted``. out: float32
    ``[B, Hq, D]`` by default (keep it float32 to repair it next), lse float32 ``[B, Hq]``.
    Then ``repair(out, lse, ..., missed(selected, predicted))`` completes attention over exactly
    ``selected``.
    """
    if compiling():
        _check_traced_stream(stream, "prr.finalize")
        if not isinstance(partials, (tuple, list)) or len(partials) != 2:
            raise TypeError("prr.finalize: 'partials' must be a pair (part_out, part_lse)")
        if partials[0].dim() != 4 or partials[1].dim() != 3:
            raise ValueError(f"prr.finalize: 'partials' must be ([B, Hq, n_pred, D], [B, Hq, n_pred]), got "
                             f"{list(partials[0].shape)} and {list(partials[1].shape)}")
        o, l = _finalize_op.call(partials[0], partials[1], predicted, selected)
        if out is None and lse is None:
            return o, l
        t = _torch_module()
        out = traced_out(out, o, "out", "prr.finalize", (t.float32, t.float16, t.bfloat16))
        lse = traced_out(lse, l, "lse", "prr.finalize")
        return out, lse
    return _run_finalize(partials, predicted, selected, out, lse, stream)


# -- torch.library ops ------------------------------------------------------------------------------
def _repair_impl(out, lse, q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale, v_scale,
                 exclude=None, counts=None, cast_out=None):
    _repair(out, lse, q, k_cache, v_cache, indices, lengths=lengths, block_table=block_table,
            block_size=block_size, scale=scale, exclude=exclude, counts=counts, cast_out=cast_out,
            k_scale=k_scale, v_scale=v_scale)


def _missed_impl(selected, predicted):
    return _run_missed(selected, predicted, None, None)


def _missed_fake(selected, predicted):
    return selected.new_empty(selected.shape)


def _finalize_impl(part_out, part_lse, predicted, selected):
    return _run_finalize((part_out, part_lse), predicted, selected, None, None, None)


def _finalize_fake(part_out, part_lse, predicted, selected):
    t = _torch_module()
    B, Hq, _, D = part_out.shape
    return part_out.new_empty((B, Hq, D), dtype=t.float32), part_out.new_empty((B, Hq), dtype=t.float32)


_REPAIR_ARGS = _ATT.replace("Tensor q,", "Tensor(a!) out, Tensor(b!) lse, Tensor q,") + \
    ", Tensor? exclude, Tensor(c!)? counts, Tensor(d!)? cast_out"
_repair_op = define_op("prr_repair", f"({_REPAIR_ARGS}) -> ()", impl=_repair_impl, fake=_none,
                       mutates_args=("out", "lse", "counts", "cast_out"))
_missed_op = define_op("prr_missed", "(Tensor selected, Tensor predicted) -> Tensor", impl=_missed_impl,
                       fake=_missed_fake)
_finalize_op = define_op("prr_finalize",
                         "(Tensor part_out, Tensor part_lse, Tensor predicted, Tensor selected) -> (Tensor, Tensor)",
                         impl=_finalize_impl, fake=_finalize_fake)
