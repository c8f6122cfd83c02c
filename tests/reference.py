"""An independent NumPy reference for gvr.topk_decode, and result checkers.

The total order (the one the library must reproduce):
  1. non-NaN values before NaN;
  2. among non-NaN: descending value (-inf is an ordinary, smallest value; -0.0 == +0.0);
  3. ties (including all NaNs among themselves, and -0.0 vs +0.0): ascending index.

``np.lexsort`` sorts by its LAST key first, so the keys are passed as (index, -value, isnan).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "total_order",
    "topk_reference",
    "expected_result",
    "check_row",
    "check_result",
    "same_bits",
]


def total_order(row) -> np.ndarray:
    """All indices of a 1-D float32 row, in the total order (int32)."""
    row = np.asarray(row)
    assert row.ndim == 1, row.shape
    row = row.astype(np.float32, copy=False)
    n = row.shape[0]
    isnan = np.isnan(row)
    # float32 negation is exact; -(+0.0) == -(-0.0) compare equal, so signed zeros tie.
    neg = -np.where(isnan, np.float32(0.0), row)
    idx = np.arange(n, dtype=np.int64)
    return np.lexsort((idx, neg, isnan)).astype(np.int32)


def topk_reference(row, k: int, length: int | None = None, *, order: np.ndarray | None = None) -> np.ndarray:
    """Exactly ``min(k, length)`` int32 indices: the first entries of the total order of
    ``row[:length]``. ``order`` may pass a precomputed ``total_order(row[:length])``."""
    row = np.asarray(row)
    if length is None:
        length = row.shape[0]
    if order is None:
        order = total_order(row[:length])
    return order[: min(int(k), int(length))]


def expected_result(scores, k: int, lengths=None) -> np.ndarray:
    """The exact result of ``topk_decode(scores, k, lengths=lengths, sorted=True)``:
    int32 [B, k] (or [k] for 1-D scores), reference order then -1 padding."""
    scores = np.asarray(scores)
    one_d = scores.ndim == 1
    s2 = scores[None, :] if one_d else scores
    B, N = s2.shape
    out = np.full((B, int(k)), -1, dtype=np.int32)
    for b in range(B):
        length = N if lengths is None else int(lengths[b])
        ref = topk_reference(s2[b], k, length)
        out[b, : ref.shape[0]] = ref
    return out[0] if one_d else out


def _describe(row, idxs):
    idxs = np.asarray(idxs)[:8]
    return ", ".join(f"{int(i)}:{row[int(i)]!r}" if 0 <= int(i) < len(row) else f"{int(i)}:<out of range>" for i in idxs)


def check_row(result_row, scores_row, k: int, length: int | None = None, *, sorted: bool = False,
              order: np.ndarray | None = None, where: str = "") -> None:
    """Assert that one result row is an exact Top-K of ``scores_row[:length]``.

    Unsorted results are compared as a SET (sorted indices equal); with ``sorted=True`` the first
    min(k, length) entries must equal the reference order exactly. In both cases the remaining
    ``k - min(k, length)`` slots must be -1."""
    result_row = np.asarray(result_row)
    scores_row = np.asarray(scores_row)
    if length is None:
        length = scores_row.shape[0]
    k = int(k)
    assert result_row.shape == (k,), f"{where}: result row shape {result_row.shape}, expected {(k,)}"
    assert result_row.dtype == np.int32, f"{where}: result dtype {result_row.dtype}"
    m = min(k, int(length))
    ref = topk_reference(scores_row, k, length, order=order)
    pad = result_row[m:]
    assert np.all(pad == -1), (
        f"{where}: padding slots [{m}:{k}] are not all -1: first bad "
        f"{pad[pad != -1][:8].tolist()} (k={k}, length={length})"
    )
    got = result_row[:m]
    if sorted:
        if not np.array_equal(got, ref):
            bad = np.flatnonzero(got != ref)
            first = int(bad[0])
            raise AssertionError(
                f"{where}: sorted result differs from the reference order at {bad.size} of {m} "
                f"positions, first at {first}: got {got[first:first + 6].tolist()} expected "
                f"{ref[first:first + 6].tolist()} (k={k}, length={length})"
            )
        return
    gs = np.sort(got)
    rs = np.sort(ref)
    if not np.array_equal(gs, rs):
        dup = gs[1:][gs[1:] == gs[:-1]]
        missing = np.setdiff1d(rs, gs)
        extra = np.setdiff1d(gs, rs)
        raise AssertionError(
            f"{where}: not the exact Top-K set (k={k}, length={length}, m={m}): "
            f"{missing.size} missing [{_describe(scores_row, missing)}], "
            f"{extra.size} unexpected [{_describe(scores_row, extra)}], duplicates {dup[:8].tolist()}; "
            f"k-th reference value {scores_row[ref[-1]]!r}" if m else f"{where}: expected no indices"
        )


def check_result(result, scores, k: int, lengths=None, *, sorted: bool = False, where: str = "") -> None:
    """Assert every row of a [B, k] (or [k] for 1-D scores) result, with the -1 padding."""
    scores = np.asarray(scores)
    result = np.asarray(result)
    if scores.ndim == 1:
        assert result.shape == (int(k),), f"{where}: result shape {result.shape}, expected {(int(k),)}"
        check_row(result, scores, k, None, sorted=sorted, where=where)
        return
    B, N = scores.shape
    assert result.shape == (B, int(k)), f"{where}: result shape {result.shape}, expected {(B, int(k))}"
    for b in range(B):
        length = N if lengths is None else int(lengths[b])
        check_row(result[b], scores[b], k, length, sorted=sorted, where=f"{where} row {b}")


def same_bits(a, b) -> bool:
    """Bitwise equality of two arrays (NaN payloads and signed zeros included)."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def page_table_slots(positions, block_table, page_size) -> np.ndarray:
    """DSA's page-table transform, NumPy: position p of row b -> block_table[b, p // page_size] *
    page_size + p % page_size; -1 stays -1, and so does a position whose page is < 0."""
    pos = np.asarray(positions, dtype=np.int64)
    bt = np.asarray(block_table, dtype=np.int64)
    one_d = pos.ndim == 1
    pos2, bt2 = (pos[None], bt[None]) if one_d else (pos, bt)
    safe = np.maximum(pos2, 0)
    page = np.take_along_axis(bt2, safe // page_size, axis=1)
    out = np.where((pos2 >= 0) & (page >= 0), page * page_size + safe % page_size, -1).astype(np.int32)
    return out[0] if one_d else out
