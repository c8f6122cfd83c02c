"""An independent float64 NumPy reference for gvr's sparse attention, attention states and PRR repair,
and a random paged-KV-cache generator.

Semantics implemented from scratch (kernels/gvr_kernels.h, "sparse attention, attention states, PRR
repair"):

  * Cache: K/V ``[num_pages, P, Hkv, D]`` (any strides; an HND cache is a swapaxes(1, 2) view).
  * Selection ``indices [B, Hsel, n]``; KV head ``g`` reads row ``indices[b, 0 if Hsel == 1 else g]``;
    query head ``h`` reads KV head ``h // (Hq // Hkv)``.
  * With ``block_table``: entry x (>= 0) names tokens t = x*G + i (i < G) of row b, those with
    t >= len_b skipped (len_b = lengths[b] clamped to [0, max_pages*P], default max_pages*P); token t
    is slot t % P of page block_table[b, t // P]; pages < 0 or >= num_pages are skipped.
  * Without: x is a physical slot of the flattened cache (page x // P, slot x % P), skipped when
    x >= num_pages*P.
  * Entries < 0 are empty. Duplicated entries count as listed (twice).
  * The state of an empty selection is (out 0, lse -inf). lse is natural-log and includes ``scale``.

Everything is computed as "gather the token list, then a dense softmax" in float64
(``sparse_attention_ref``). ``sparse_attention_naive`` runs the same math in the input precision
(``harness.naive_inputs``: float32 for bfloat16 inputs) for ``harness.assert_close``.
``dense_bruteforce`` is a second, structurally different formulation (a multiplicity per cache slot,
softmax over the whole cache) used to validate the reference itself.

fp8 (e4m3fn) caches and per-tensor K/V scales: the result is dense softmax attention with
K' = k_scale * decode(K), V' = v_scale * decode(V) (scores = scale * q.K', lse includes scale and
k_scale). ``e4m3_decode`` is written from the bit definition (sign, 4 exponent bits with bias 7, 3
mantissa bits; exponent 0: subnormal m * 2^-9; S.1111.111 NaN; no infinities; max 448), never through
torch's or ml_dtypes' conversion; ``e4m3_encode`` rounds to nearest (ties to even), saturating at 448.
A Case with ``kv_dtype="float8_e4m3fn"`` keeps the caches as uint8 codes (``codes``) and their exact
float64 values (``base``); every reference function reads those values. NaN follows IEEE: a NaN in a
selected K row makes the heads reading it NaN (out and lse), a NaN in V[t, d] makes out[..., d] NaN for
the heads reading t; NaN in tokens not attended changes nothing. The naive math for fp8 caches is the
q precision's (float32 for bfloat16 q), on the exactly decoded values (fp8 values are exact in
bfloat16 and float16): the same as a q-dtype cache holding the decoded values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from harness import assert_close, naive_inputs, round_to

__all__ = [
    "token_slots", "sparse_attention_ref", "sparse_attention_naive", "partials_ref", "partials_naive",
    "merge_ref", "merge_naive", "missed_ref", "finalize_ref", "finalize_naive", "dense_bruteforce",
    "empty_state", "check_state", "Case", "make_case", "random_indices", "to_numpy", "compute_dtype",
    "E4M3_VALUES", "E4M3_NAN", "E4M3_MAX", "e4m3_decode", "e4m3_encode", "random_e4m3",
]

NEG_INF = -np.inf


def to_numpy(x) -> np.ndarray:
    """A NumPy view/copy of a NumPy array or a torch tensor (bfloat16 -> float32, CUDA -> host,
    float8_e4m3fn -> float64 through e4m3_decode)."""
    if isinstance(x, np.ndarray):
        if x.dtype.name == "float8_e4m3fn":  # ml_dtypes: decoded from the bits
            return e4m3_decode(x.view(np.uint8))
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        if x.dtype == getattr(torch, "float8_e4m3fn", None):  # decoded from the bits, not by torch
            return e4m3_decode(x.cpu().view(torch.uint8).numpy())
        return x.cpu().numpy()
    if mod.startswith("cupy"):
        import cupy

        return cupy.asnumpy(x)
    return np.asarray(x)


def compute_dtype(dtype_name: str):
    """The NumPy type the naive math runs in for an input precision (bfloat16 -> float32)."""
    return {"bfloat16": np.float32, "float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype_name]


# --------------------------------------------------------------------------------------------------
# float8 e4m3fn, from the bit definition
# --------------------------------------------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    """The value of one e4m3fn code: S.EEEE.MMM, bias 7; E = 0: subnormal M * 2^-9; S.1111.111: NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0**-9
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3_VALUES = np.array([_e4m3_value(c) for c in range(256)], np.float64)  # code -> value
E4M3_NAN = 0x7F  # (0xFF too)
E4M3_MAX = 448.0
# the non-negative finite codes 0x00..0x7E in increasing value (code order is value order there)
_E4M3_POS = E4M3_VALUES[:0x7F]
assert np.all(np.diff(_E4M3_POS) > 0) and _E4M3_POS[-1] == E4M3_MAX


def e4m3_decode(codes) -> np.ndarray:
    """float64 values of uint8 e4m3fn codes (any shape and strides)."""
    codes = np.asarray(codes)
    assert codes.dtype == np.uint8, codes.dtype
    return E4M3_VALUES[codes]


def e4m3_encode(x) -> np.ndarray:
    """uint8 e4m3fn codes of ``x`` rounded to nearest, ties to the even code (mantissa bit 0 clear),
    saturating to +-448 (inf too); NaN -> 0x7F. -0.0 keeps its sign."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    finite = np.isfinite(a)
    a = np.where(finite, np.minimum(a, E4M3_MAX), E4M3_MAX)
    hi = np.clip(np.searchsorted(_E4M3_POS, a, side="left"), 0, 0x7E)  # first value >= a
    lo = np.maximum(hi - 1, 0)
    dl, dh = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
    code = np.where(dl < dh, lo, np.where(dh < dl, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == _E4M3_POS[hi], hi, code).astype(np.uint8)
    code = code | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
    return np.where(np.isnan(x), np.uint8(E4M3_NAN), code).astype(np.uint8)


def random_e4m3(rng, shape, amplitude=1.0) -> np.ndarray:
    """uint8 codes of amplitude * N(0, 1) rounded to e4m3fn (subnormals and, for large amplitudes,
    saturated +-448 included; no NaN)."""
    return e4m3_encode(amplitude * rng.standard_normal(shape))


# --------------------------------------------------------------------------------------------------
# token lists
# --------------------------------------------------------------------------------------------------


def token_slots(entries, *, P, num_pages, block_table_row=None, length=None, block_size=1):
    """The flattened cache slots (page * P + slot, int64) that ``entries`` (1-D) attend, in entry
    order, duplicates kept. ``block_table_row`` None: physical-slot mode (block_size must be 1)."""
    e = np.asarray(entries, dtype=np.int64).reshape(-1)
    e = e[e >= 0]
    if block_table_row is None:
        assert block_size == 1
        return e[e < num_pages * P]
    bt = np.asarray(block_table_row, dtype=np.int64)
    max_pages = bt.shape[0]
    L = max_pages * P if length is None else min(max(int(length), 0), max_pages * P)
    G = int(block_size)
    e = e[e * G < L]  # entries past the row's length name nothing (kept small: no x*G overflow here)
    t = (e[:, None] * G + np.arange(G, dtype=np.int64)[None, :]).reshape(-1)
    t = t[t < L]
    page = bt[t // P]
    ok = (page >= 0) & (page < num_pages)
    return page[ok] * P + t[ok] % P


def _row_slots(indices, b, s, P, num_pages, block_table, lengths, block_size):
    return token_slots(indices[b, s], P=P, num_pages=num_pages,
                       block_table_row=None if block_table is None else block_table[b],
                       length=None if lengths is None else lengths[b], block_size=block_size)


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


def empty_state(shape_out, dtype=np.float64):
    """(out 0, lse -inf) of shape ``shape_out`` ([..., D]) and ``shape_out[:-1]``."""
    return np.zeros(shape_out, dtype), np.full(shape_out[:-1], NEG_INF, dtype)


def _attend(qg, K, V, scale, ct):
    """Dense softmax attention of the query heads ``qg [g, D]`` over ``K, V [T, D]`` computed in
    NumPy type ``ct``: (out [g, D], lse [g]) as float64."""
    g, D = qg.shape
    if K.shape[0] == 0:
        return np.zeros((g, D)), np.full(g, NEG_INF)
    with np.errstate(invalid="ignore"):
        s = (qg @ K.T) * ct(scale)
        s = np.where(np.isnan(K).any(axis=1)[None, :], ct(np.nan), s)  # NaN * anything (BLAS-independent)
        m = s.max(axis=1, keepdims=True)  # NaN when a score is NaN
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True, dtype=ct)
        out = (p @ V) / l
        out = np.where(np.isnan(V).any(axis=0)[None, :], ct(np.nan), out)  # 0 * NaN too
        lse = m[:, 0] + np.log(l[:, 0])
    return out.astype(np.float64), lse.astype(np.float64)


def _attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, ct, k_scale=1.0, v_scale=1.0):
    q = to_numpy(q)
    k_cache, v_cache = to_numpy(k_cache), to_numpy(v_cache)
    indices = to_numpy(indices)
    block_table = None if block_table is None else to_numpy(block_table)
    lengths = None if lengths is None else to_numpy(lengths)
    B, Hq, D = q.shape
    num_pages, P, Hkv, _ = k_cache.shape
    Hsel = indices.shape[1]
    assert Hq % Hkv == 0 and Hsel in (1, Hkv), (Hq, Hkv, Hsel)
    gqa = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k_scale, v_scale = _scales(k_scale, v_scale)
    out = np.zeros((B, Hq, D))
    lse = np.full((B, Hq), NEG_INF)
    for b in range(B):
        for g in range(Hkv):
            slots = _row_slots(indices, b, 0 if Hsel == 1 else g, P, num_pages, block_table, lengths, block_size)
            K = k_cache[slots // P, slots % P, g].astype(ct)
            V = v_cache[slots // P, slots % P, g].astype(ct)
            if k_scale != 1.0:  # K' = k_scale * K, V' = v_scale * V (in ct)
                K = K * ct(k_scale)
            if v_scale != 1.0:
                V = V * ct(v_scale)
            hs = slice(g * gqa, (g + 1) * gqa)
            out[b, hs], lse[b, hs] = _attend(q[b, hs].astype(ct), K, V, scale, ct)
    return out, lse


def _scales(k_scale, v_scale):
    return (1.0 if k_scale is None else float(k_scale)), (1.0 if v_scale is None else float(v_scale))


def sparse_attention_ref(q, k_cache, v_cache, indices, lengths=None, block_table=None, block_size=1, scale=None,
                         k_scale=None, v_scale=None):
    """float64 (out [B, Hq, D], lse [B, Hq]) of gvr.sparse_attention (arrays: NumPy or torch; fp8
    caches decoded by e4m3_decode); k_scale / v_scale None: 1."""
    return _attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, np.float64,
                      *_scales(k_scale, v_scale))


def _naive_caches(dtype, k_cache, v_cache):
    """The caches as the naive math reads them: rounded to ``dtype`` (fp8 values are exact there)."""
    return naive_inputs(dtype, to_numpy(k_cache), to_numpy(v_cache))


def sparse_attention_naive(q, k_cache, v_cache, indices, lengths=None, block_table=None, block_size=1, scale=None,
                           k_scale=None, v_scale=None, *, dtype):
    """The same math in the input precision ``dtype`` ("float32", "float16", "bfloat16"; bfloat16:
    float32 math on bfloat16 values; fp8 caches: decoded exactly, then the same), returned as float64:
    ``naive`` for harness.assert_close. K' = k_scale * K and V' = v_scale * V are rounded in it too."""
    qn = naive_inputs(dtype, to_numpy(q))
    kn, vn = _naive_caches(dtype, k_cache, v_cache)
    return _attention(qn, kn, vn, indices, lengths, block_table, block_size, scale, compute_dtype(dtype),
                      *_scales(k_scale, v_scale))


def _partials(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, ct, k_scale=1.0, v_scale=1.0):
    q = to_numpy(q)
    k_cache, v_cache = to_numpy(k_cache), to_numpy(v_cache)
    indices = to_numpy(indices)
    B, Hq, D = q.shape
    n = indices.shape[2]
    po = np.zeros((B, Hq, n, D))
    pl = np.full((B, Hq, n), NEG_INF)
    for e in range(n):
        o, l = _attention(q, k_cache, v_cache, indices[:, :, e:e + 1], lengths, block_table, block_size, scale, ct,
                          k_scale, v_scale)
        po[:, :, e], pl[:, :, e] = o, l
    return po, pl


def partials_ref(q, k_cache, v_cache, indices, lengths=None, block_table=None, block_size=1, scale=None,
                 k_scale=None, v_scale=None):
    """float64 (part_out [B, Hq, n, D], part_lse [B, Hq, n]): the state of each entry alone."""
    return _partials(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, np.float64,
                     *_scales(k_scale, v_scale))


def partials_naive(q, k_cache, v_cache, indices, lengths=None, block_table=None, block_size=1, scale=None,
                   k_scale=None, v_scale=None, *, dtype):
    qn = naive_inputs(dtype, to_numpy(q))
    kn, vn = _naive_caches(dtype, k_cache, v_cache)
    return _partials(qn, kn, vn, indices, lengths, block_table, block_size, scale, compute_dtype(dtype),
                     *_scales(k_scale, v_scale))


# --------------------------------------------------------------------------------------------------
# merge, missed, finalize
# --------------------------------------------------------------------------------------------------


def _merge(va, la, vb, lb, base, ct):
    va, vb = np.asarray(va, ct), np.asarray(vb, ct)
    la, lb = np.asarray(la, ct), np.asarray(lb, ct)
    exp, log = (np.exp2, np.log2) if base == "2" else (np.exp, np.log)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.maximum(la, lb)
        m = np.where(np.isnan(la) | np.isnan(lb), ct(np.nan), m)
        empty = m == NEG_INF
        msafe = np.where(empty, ct(0), m)
        wa = np.where(la == NEG_INF, ct(0), exp(la - msafe))
        wb = np.where(lb == NEG_INF, ct(0), exp(lb - msafe))
        wsum = np.where(empty, ct(1), wa + wb)
        out = (wa[..., None] * va + wb[..., None] * vb) / wsum[..., None]
        lse = m + log(wsum)
    out = np.where(empty[..., None], ct(0), out)
    lse = np.where(empty, ct(NEG_INF), lse)
    # a side with lse -inf contributes nothing: the other side exactly
    a_only = (lb == NEG_INF) & ~empty
    b_only = (la == NEG_INF) & ~empty
    out = np.where(a_only[..., None], va, np.where(b_only[..., None], vb, out))
    lse = np.where(a_only, la, np.where(b_only, lb, lse))
    return out.astype(np.float64), lse.astype(np.float64)


def merge_ref(out_a, lse_a, out_b, lse_b, lse_base="e"):
    """float64 merge of two attention states (gvr_merge_params' formula; lse_base "e" or "2")."""
    return _merge(to_numpy(out_a), to_numpy(lse_a), to_numpy(out_b), to_numpy(lse_b), lse_base, np.float64)


def merge_naive(out_a, lse_a, out_b, lse_b, lse_base="e", *, dtype="float32"):
    """The merge in ``dtype`` (values) with float32 lse math (states' lse are float32)."""
    return _merge(to_numpy(out_a), to_numpy(lse_a), to_numpy(out_b), to_numpy(lse_b), lse_base, np.float32)


def missed_ref(selected, predicted):
    """int32 [B, H, n_sel]: entries x >= 0 of selected[b, h] absent from predicted[b, hp] (hp = 0 when
    Hp == 1), in selected's order (duplicates kept), then -1."""
    sel, pred = to_numpy(selected), to_numpy(predicted)
    B, H, n_sel = sel.shape
    Hp = pred.shape[1]
    out = np.full((B, H, n_sel), -1, np.int32)
    for b in range(B):
        for h in range(H):
            have = set(int(x) for x in pred[b, 0 if Hp == 1 else h])
            keep = [int(x) for x in sel[b, h] if x >= 0 and int(x) not in have]
            out[b, h, :len(keep)] = keep
    return out


def _finalize(part_out, part_lse, predicted, selected, ct):
    po, pl = to_numpy(part_out), to_numpy(part_lse)
    pred, sel = to_numpy(predicted), to_numpy(selected)
    B, Hq, n_pred, D = po.shape
    Hsel = pred.shape[1]
    grp = Hq // Hsel
    out = np.zeros((B, Hq, D))
    lse = np.full((B, Hq), NEG_INF)
    for b in range(B):
        for h in range(Hq):
            s = h // grp
            chosen = set(int(x) for x in sel[b, s] if x >= 0)
            seen = set()
            o, l = np.zeros(D, ct), ct(NEG_INF)
            for e in range(n_pred):
                x = int(pred[b, s, e])
                if x < 0 or x in seen:
                    continue
                seen.add(x)
                if x not in chosen:
                    continue
                o, l = _merge(o, l, po[b, h, e], pl[b, h, e], "e", ct)
            out[b, h], lse[b, h] = o, l
    return out, lse


def finalize_ref(part_out, part_lse, predicted, selected):
    """float64 gvr.prr.finalize: merge, in entry order, the partials of first occurrences of predicted
    entries that occur in selected (per row and selection head)."""
    return _finalize(part_out, part_lse, predicted, selected, np.float64)


def finalize_naive(part_out, part_lse, predicted, selected):
    return _finalize(part_out, part_lse, predicted, selected, np.float32)


# --------------------------------------------------------------------------------------------------
# a second formulation, to validate the reference
# --------------------------------------------------------------------------------------------------


def dense_bruteforce(q, k_cache, v_cache, indices, lengths=None, block_table=None, block_size=1, scale=None,
                     k_scale=None, v_scale=None):
    """Softmax over every slot of the cache, each weighted by how many times the selection names it
    (token by token, pure Python loops): float64 (out, lse). Scales: k_scale folded into the logits'
    factor, v_scale applied to the result (a different order than the reference's); no NaN support."""
    q, kc, vc, idx = to_numpy(q), to_numpy(k_cache), to_numpy(v_cache), to_numpy(indices)
    bt = None if block_table is None else to_numpy(block_table)
    ln = None if lengths is None else to_numpy(lengths)
    B, Hq, D = q.shape
    num_pages, P, Hkv, _ = kc.shape
    Hsel = idx.shape[1]
    gqa = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k_scale, v_scale = _scales(k_scale, v_scale)
    Kf = kc.astype(np.float64).reshape(num_pages * P, Hkv, D) if kc.flags.c_contiguous else \
        np.stack([kc[p, t] for p in range(num_pages) for t in range(P)]).astype(np.float64)
    Vf = vc.astype(np.float64).reshape(num_pages * P, Hkv, D) if vc.flags.c_contiguous else \
        np.stack([vc[p, t] for p in range(num_pages) for t in range(P)]).astype(np.float64)
    out = np.zeros((B, Hq, D))
    lse = np.full((B, Hq), NEG_INF)
    for b in range(B):
        for h in range(Hq):
            g = h // gqa
            count = np.zeros(num_pages * P)
            for x in idx[b, 0 if Hsel == 1 else g]:
                x = int(x)
                if x < 0:
                    continue
                if bt is None:
                    if x < num_pages * P:
                        count[x] += 1
                    continue
                max_pages = bt.shape[1]
                L = max_pages * P if ln is None else min(max(int(ln[b]), 0), max_pages * P)
                for i in range(block_size):
                    t = x * block_size + i
                    if t >= L:
                        break
                    page = int(bt[b, t // P])
                    if 0 <= page < num_pages:
                        count[page * P + t % P] += 1
            if not count.any():
                continue
            logits = (scale * k_scale) * (Kf[:, g] @ q[b, h].astype(np.float64))
            with np.errstate(divide="ignore"):
                logits = logits + np.log(count)
            m = logits.max()
            w = np.exp(logits - m)
            out[b, h] = v_scale * (w @ Vf[:, g]) / w.sum()
            lse[b, h] = m + np.log(w.sum())
    return out, lse


# --------------------------------------------------------------------------------------------------
# random paged caches and selections
# --------------------------------------------------------------------------------------------------


def random_indices(rng, B, Hsel, n, valid, *, out_of_range_from=None, pad=0.0, oob=0.0, dup=0.0, distinct=True):
    """int32 [B, Hsel, n] of entries in [0, valid), distinct per (b, s) when ``distinct`` and n <= valid;
    then a fraction ``pad`` set to -1 (anywhere), ``oob`` replaced by out-of-range values
    (>= out_of_range_from, INT32_MAX, or negatives other than -1), ``dup`` overwritten by copies of
    other entries of the row."""
    out = np.empty((B, Hsel, n), np.int64)
    for b in range(B):
        for s in range(Hsel):
            if distinct and n <= valid:
                out[b, s] = rng.choice(valid, size=n, replace=False)
            else:
                out[b, s] = rng.integers(0, max(valid, 1), size=n)
    hi = valid if out_of_range_from is None else out_of_range_from
    if n:
        flat = out.reshape(-1, n)
        for r in range(flat.shape[0]):
            if oob:
                m = rng.random(n) < oob
                choices = np.array([hi, hi + 1, hi + 1000, 2**31 - 1, 2**30, -2, -(2**31)], np.int64)
                flat[r, m] = rng.choice(choices, size=int(m.sum()))
            if dup and n > 1:
                m = np.nonzero(rng.random(n) < dup)[0]
                for i in m:
                    flat[r, i] = flat[r, rng.integers(0, n)]
            if pad:
                m = rng.random(n) < pad
                flat[r, m] = -1
    return out.astype(np.int32)


_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


@dataclass
class Case:
    """A random sparse-attention problem. Values are float64 already rounded to ``dtype``; ``args``
    turns them into NumPy arrays or torch tensors (views of one cache base tensor as asked)."""

    dtype: str
    q: np.ndarray  # [B, Hq, D] float64
    base: np.ndarray  # the cache's base buffer, float64
    layout: str  # "NHD" or "HND"
    combined: bool  # K and V views of one [num_pages, 2, ...] tensor
    indices: np.ndarray  # int32 [B, Hsel, n]
    block_table: np.ndarray | None
    lengths: np.ndarray | None
    block_size: int
    scale: float | None = None
    q_padded: bool = False  # q a view of a wider buffer (row and head strides > D)
    extra: dict = field(default_factory=dict)
    kv_dtype: str | None = None  # None: the caches in ``dtype``; "float8_e4m3fn": ``codes`` (values in base)
    codes: np.ndarray | None = None  # uint8 e4m3fn codes, base's shape (base = e4m3_decode(codes))
    k_scale: float | None = None  # passed to gvr when not None
    v_scale: float | None = None

    # -- shapes ------------------------------------------------------------------------------
    @property
    def B(self):
        return self.q.shape[0]

    @property
    def Hq(self):
        return self.q.shape[1]

    @property
    def D(self):
        return self.q.shape[2]

    def kv_views(self, base):
        """(k, v) views [num_pages, P, Hkv, D] of ``base`` (NumPy array or torch tensor)."""
        if self.combined:
            k, v = base[:, 0], base[:, 1]
        else:
            k, v = base[0], base[1]
        if self.layout == "HND":
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
        return k, v

    @property
    def k(self):
        return self.kv_views(self.base)[0]

    @property
    def v(self):
        return self.kv_views(self.base)[1]

    @property
    def fp8(self):
        return self.kv_dtype == "float8_e4m3fn"

    @property
    def num_pages(self):
        return self.k.shape[0]

    @property
    def P(self):
        return self.k.shape[1]

    # -- inputs ------------------------------------------------------------------------------
    def _q_view(self, conv):
        if not self.q_padded:
            return conv(np.ascontiguousarray(self.q))
        B, Hq, D = self.q.shape
        wide = np.zeros((B, Hq + 1, D + 8))
        wide[:, 1:, 3:3 + D] = self.q
        return conv(wide)[:, 1:, 3:3 + D]

    def args(self, fw="numpy", device="cpu", *, index_fw=None):
        """(q, k, v, indices, kwargs) for gvr.sparse_attention in ``fw`` ("numpy" or "torch")."""
        index_fw = index_fw or fw
        if fw == "numpy":
            assert self.dtype != "bfloat16", "NumPy has no bfloat16: use fw='torch'"
            conv = lambda a: np.ascontiguousarray(a).astype(self.dtype)  # noqa: E731
        else:
            import torch

            td = getattr(torch, _TORCH_DTYPES[self.dtype])
            conv = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=td)  # noqa: E731
        if index_fw == "numpy":
            iconv = lambda a: None if a is None else np.ascontiguousarray(a, np.int32)  # noqa: E731
        else:
            import torch

            iconv = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(device)  # noqa: E731
        q = self._q_view(conv)
        k, v = self.kv_views(self._cache_base(fw, device) if self.fp8 else conv(self.base))
        kw = dict(block_size=self.block_size)
        if self.block_table is not None:
            kw["block_table"] = iconv(self.block_table)
        if self.lengths is not None:
            kw["lengths"] = iconv(self.lengths)
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.k_scale is not None:
            kw["k_scale"] = self.k_scale
        if self.v_scale is not None:
            kw["v_scale"] = self.v_scale
        return q, k, v, iconv(self.indices), kw

    def _cache_base(self, fw, device):
        """The fp8 cache base: torch float8_e4m3fn (a view of the uint8 codes) or NumPy ml_dtypes."""
        codes = np.ascontiguousarray(self.codes)
        if fw == "numpy":
            import ml_dtypes

            return codes.view(ml_dtypes.float8_e4m3fn)
        import torch

        return torch.from_numpy(codes).view(torch.float8_e4m3fn).to(device)

    def decoded(self, dtype="float32"):
        """The same problem with the caches decoded to ``dtype`` (fp8 values are exact in float32,
        bfloat16 and float16) and q in it (float32: exact), the scales kept: a q-dtype cache case."""
        return Case(**{**self.__dict__, "dtype": dtype, "kv_dtype": None, "codes": None,
                       "q": round_to(self.q, dtype), "base": round_to(self.base, dtype)})

    def slots(self, b, s, indices=None):
        """The flattened cache slots (page * P + slot) that selection row (b, s) attends, duplicates kept."""
        idx = self.indices if indices is None else np.asarray(indices)
        return _row_slots(idx, b, s, self.P, self.num_pages, self.block_table, self.lengths, self.block_size)

    def inject_nan(self, which, slots, head, dims=None, code=E4M3_NAN):
        """Set K (which "k") or V ("v") of the flattened cache ``slots`` at KV head ``head`` (dims: all
        or a list) to NaN: the code ``code`` (0x7F or 0xFF) for an fp8 case, NaN in ``base`` always.
        The arrays are copied first (cases made by with_indices share them). Returns self."""
        dsel = slice(None) if dims is None else np.asarray(dims)
        slots = np.asarray(slots, np.int64).reshape(-1)
        self.base = self.base.copy()
        views = [self.kv_views(self.base)]
        if self.codes is not None:
            self.codes = self.codes.copy()
            views.append(self.kv_views(self.codes))
        i = {"k": 0, "v": 1}[which]
        for kv, val in zip(views, (np.nan, code)):
            t = kv[i]
            for x in slots:
                t[x // self.P, x % self.P, head, dsel] = val
        return self

    def with_indices(self, indices):
        c = Case(**{**self.__dict__, "indices": np.asarray(indices, np.int32)})
        return c

    # -- expected results --------------------------------------------------------------------
    def _ref_args(self, indices=None):
        return (self.q, self.k, self.v, self.indices if indices is None else indices, self.lengths, self.block_table,
                self.block_size, self.scale, self.k_scale, self.v_scale)

    def ref(self, indices=None):
        return sparse_attention_ref(*self._ref_args(indices))

    def naive(self, indices=None):
        return sparse_attention_naive(*self._ref_args(indices), dtype=self.dtype)

    def partials_ref(self, indices=None):
        return partials_ref(*self._ref_args(indices))

    def partials_naive(self, indices=None):
        return partials_naive(*self._ref_args(indices), dtype=self.dtype)

    def n_entries_valid(self):
        """Entries that can name tokens: logical blocks (block-table mode) or slots."""
        if self.block_table is None:
            return self.num_pages * self.P
        return -(-self.block_table.shape[1] * self.P // self.block_size)


def make_case(rng, *, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=1, paged=True, n=16, Hsel=1, layout="NHD",
              combined=False, dtype="float32", seq_len=None, lengths="partial", pad=0.15, oob=0.1, dup=0.0,
              distinct=True, extra_pages=3, bad_pages=False, q_scale=1.0, scale=None, q_padded=False,
              indices=None, kv_dtype=None, fp8_amp=1.0, k_scale=None, v_scale=None):
    """A random problem.

    paged=True: ``block_table`` [B, max_pages] of shuffled pages (rows may share pages; unused pages
    exist; table slots past a row's length hold junk: -1, out-of-range pages, other rows' pages),
    ``lengths`` "partial" (last block partial, one row shorter still), "full", "none" (None: default
    max_pages*P) or an array; entries are logical blocks of ``block_size`` tokens.
    paged=False: entries are physical slots of the flattened cache (block_size 1, no table).
    ``bad_pages``: a few table entries inside the rows' lengths are -1 or out of range (skipped).
    kv_dtype "float8_e4m3fn": the caches are e4m3fn codes of fp8_amp * N(0, 1) (random_e4m3), q in
    ``dtype``; k_scale / v_scale: passed to gvr (and used by the reference) when not None."""
    G = block_size
    if seq_len is None:
        seq_len = max(4 * G, 3 * P, 64)
    max_pages = max(1, -(-seq_len // P))
    used = min(B * max_pages, max(max_pages, 48 if P <= 16 else 12))
    num_pages = used + extra_pages
    if layout == "NHD":
        shape = (num_pages, P, Hkv, D)
    else:
        shape = (num_pages, Hkv, P, D)
    if combined:
        shape = (shape[0], 2) + shape[1:]
    else:
        shape = (2,) + shape
    codes = None
    if kv_dtype is None:
        base = round_to(rng.standard_normal(shape), dtype)
    else:
        assert kv_dtype == "float8_e4m3fn", kv_dtype
        codes = random_e4m3(rng, shape, fp8_amp)
        base = e4m3_decode(codes)
    q = round_to(q_scale * rng.standard_normal((B, Hq, D)), dtype)
    block_table = lens = None
    if paged:
        perm = rng.permutation(num_pages)[:used]  # shuffled, unused pages left over
        block_table = np.empty((B, max_pages), np.int64)
        for b in range(B):
            block_table[b] = rng.choice(perm, size=max_pages, replace=max_pages > used)
        cap = max_pages * P
        if isinstance(lengths, str):
            if lengths == "partial":
                lens = rng.integers(max(1, cap // 2), cap + 1, size=B)
                lens[0] = cap - max(1, min(G, P) // 2) if cap > 1 else cap  # partial last block
                if B > 2:
                    lens[2] = max(1, cap // 3) + 1
                if B > 1:
                    lens[1] = cap
            elif lengths == "full":
                lens = np.full(B, cap)
            elif lengths == "none":
                lens = None
            else:
                raise ValueError(lengths)
        else:
            lens = np.asarray(lengths)
        if lens is not None:
            for b in range(B):  # junk past the length: never read
                first_unused = -(-int(max(min(lens[b], cap), 0)) // P)
                for j in range(first_unused, max_pages):
                    block_table[b, j] = rng.choice([-1, num_pages, num_pages + 7, 2**31 - 1, int(perm[0])])
            lens = lens.astype(np.int32)
        if bad_pages:
            for b in range(B):
                j = rng.integers(0, max_pages)
                block_table[b, j] = rng.choice([-1, num_pages, 2**31 - 1])
        block_table = block_table.astype(np.int32)
        valid = -(-max_pages * P // G)
    else:
        assert G == 1
        valid = num_pages * P
    if indices is None:
        indices = random_indices(rng, B, Hsel, n, valid, pad=pad, oob=oob, dup=dup, distinct=distinct)
    return Case(dtype=dtype, q=q, base=base, layout=layout, combined=combined, indices=np.asarray(indices, np.int32),
                block_table=block_table, lengths=lens, block_size=G, scale=scale, q_padded=q_padded,
                kv_dtype=kv_dtype, codes=codes, k_scale=k_scale, v_scale=v_scale)


def check_state(case, out, lse, *, indices=None, what=""):
    """(out, lse) of a gvr call against the float64 reference attention of ``case`` (over ``indices``
    if given) with harness.assert_close (naive: the same math in the case's input precision); an
    empty state's out must be exactly 0; NaN exactly where the reference has NaN (nowhere unless
    the case holds NaN)."""
    ro, rl = case.ref(indices)
    no, nl = case.naive(indices)
    go, gl = to_numpy(out).astype(np.float64), to_numpy(lse).astype(np.float64)
    assert_close(go, ro, no, case.dtype, what=f"{what} out")
    assert_close(gl, rl, nl, case.dtype, what=f"{what} lse")
    empty = rl == NEG_INF
    assert np.all(go[empty] == 0.0), f"{what}: empty state's out is not 0"
    assert np.array_equal(np.isnan(go), np.isnan(ro)) and np.array_equal(np.isnan(gl), np.isnan(rl)), \
        f"{what}: NaN where the reference has none, or none where it has NaN"
