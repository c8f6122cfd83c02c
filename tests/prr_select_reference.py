"""Independent NumPy references for gvr.prr's selection stage (block_metadata, update_block_metadata,
block_scores, select_blocks), written from the documented semantics (kernels/gvr_kernels.h, section
"PRR selection stage"), token by token, in float64, plus a float32 emulation of the documented
summation order of block_scores (to hold the C code to it bit for bit) and the case generator that
the CPU and GPU tests share.

Values: float32, float16 (NumPy) and bfloat16 (torch CPU tensors; ``to_numpy`` widens them to float32
exactly)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention_reference import to_numpy  # noqa: F401  (re-exported for the tests)
from harness import round_to

NEG_INF, POS_INF = -np.inf, np.inf


# --------------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------------
def _tokens(bt_row, length, P, num_pages, lo, hi):
    """(page, slot) of the tokens t in [lo, min(hi, length)) whose page is in range."""
    out = []
    for t in range(lo, min(hi, length)):
        page = int(bt_row[t // P])
        if 0 <= page < num_pages:
            out.append((page, t % P))
    return out


def metadata_ref(k_cache, block_table, lengths, G):
    """float64 [B, Hkv, Nb, 2, D]: per-channel min / max of the keys of each block's valid tokens;
    +inf / -inf for a block without tokens. Keys without NaN (the NaN and signed-zero rules have their
    own tests)."""
    k = to_numpy(k_cache).astype(np.float64)
    bt = to_numpy(block_table)
    num_pages, P, Hkv, D = k.shape
    B, maxp = bt.shape
    cap = maxp * P
    Nb = -(-cap // G)
    ln = np.full(B, cap) if lengths is None else to_numpy(lengths)
    meta = np.empty((B, Hkv, Nb, 2, D))
    meta[..., 0, :] = POS_INF
    meta[..., 1, :] = NEG_INF
    for b in range(B):
        for j in range(Nb):
            toks = _tokens(bt[b], int(ln[b]), P, num_pages, j * G, (j + 1) * G)
            if not toks:
                continue
            rows = np.stack([k[pg, sl] for pg, sl in toks])  # [n, Hkv, D]
            meta[b, :, j, 0] = rows.min(axis=0)
            meta[b, :, j, 1] = rows.max(axis=0)
    return meta


# --------------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------------
def _masks(Nb, G, lengths, B, keep_first, keep_last, meta64):
    """(nb [B], empty [B, Hkv, Nb], keep [B, Nb])"""
    cap = Nb * G
    ln = np.full(B, cap) if lengths is None else np.clip(to_numpy(lengths).astype(np.int64), 0, cap)
    nb = -(-ln // G)
    j = np.arange(Nb)
    empty = meta64[..., 0, 0] > meta64[..., 1, 0]
    keep = (j[None, :] < keep_first) | (j[None, :] >= nb[:, None] - keep_last)
    return nb, empty, keep


def scores_ref(q, meta, lengths, G, group_reduce="max", keep_first=0, keep_last=0):
    """float64 [B, Hkv, Nb]: Quest's upper bound per query head, combined over the group."""
    q64 = to_numpy(q).astype(np.float64)
    m64 = to_numpy(meta).astype(np.float64)
    B, Hq, D = q64.shape
    _, Hkv, Nb, _, _ = m64.shape
    GQ = Hq // Hkv
    qg = q64.reshape(B, Hkv, GQ, 1, D)
    mn, mx = m64[:, :, None, :, 0, :], m64[:, :, None, :, 1, :]  # [B, Hkv, 1, Nb, D]
    with np.errstate(invalid="ignore"):
        s = np.maximum(qg * mx, qg * mn).sum(axis=-1)  # [B, Hkv, GQ, Nb]
    r = s.max(axis=2) if group_reduce == "max" else s.sum(axis=2)
    nb, empty, keep = _masks(Nb, G, lengths, B, keep_first, keep_last, m64)
    j = np.arange(Nb)
    r = np.where(keep[:, None, :], POS_INF, r)
    r = np.where(empty | (j[None, None, :] >= nb[:, None, None]), NEG_INF, r)
    return r


def scores_abs(q, meta):
    """float64 [B, Hkv, Nb]: the largest over the group of sum_d |t_d| (the scale of the rounding error)."""
    q64 = to_numpy(q).astype(np.float64)
    m64 = to_numpy(meta).astype(np.float64)
    B, Hq, D = q64.shape
    Hkv = m64.shape[1]
    qg = q64.reshape(B, Hkv, Hq // Hkv, 1, D)
    mn, mx = m64[:, :, None, :, 0, :], m64[:, :, None, :, 1, :]
    with np.errstate(invalid="ignore"):
        t = np.abs(np.maximum(qg * mx, qg * mn))
    return (t.sum(axis=-1) * (Hq // Hkv)).max(axis=2)


def scores_order_f32(q, meta, lengths, G, group_reduce="max", keep_first=0, keep_last=0):
    """float32 [B, Hkv, Nb]: the documented order (8-channel chunks left to right, the tree over the
    chunks, the heads in order), emulated in float32 NumPy: block_scores' exact bits."""
    q32 = to_numpy(q).astype(np.float32)
    m32 = to_numpy(meta).astype(np.float32)
    B, Hq, D = q32.shape
    _, Hkv, Nb, _, _ = m32.shape
    GQ = Hq // Hkv
    qg = q32.reshape(B, Hkv, GQ, 1, D)
    mn, mx = m32[:, :, None, :, 0, :], m32[:, :, None, :, 1, :]
    with np.errstate(invalid="ignore", over="ignore"):
        a, z = qg * mx, qg * mn
        t = np.where((a > z) | np.isnan(a), a, z).astype(np.float32)  # [B, Hkv, GQ, Nb, D]
        L = -(-D // 8)
        v = []
        for c in range(L):
            acc = t[..., 8 * c]
            for d in range(8 * c + 1, min(8 * c + 8, D)):
                acc = (acc + t[..., d]).astype(np.float32)
            v.append(acc)
        o = 1
        while o * 2 < L:
            o *= 2
        while o >= 1 and L > 1:
            for c in range(o):
                if c + o < L:
                    v[c] = (v[c] + v[c + o]).astype(np.float32)
            o //= 2
        s = v[0]  # [B, Hkv, GQ, Nb]
        r = s[:, :, 0]
        for g in range(1, GQ):
            if group_reduce == "sum":
                r = (r + s[:, :, g]).astype(np.float32)
            else:
                r = np.where((s[:, :, g] > r) | np.isnan(s[:, :, g]), s[:, :, g], r)
    nb, empty, keep = _masks(Nb, G, lengths, B, keep_first, keep_last, m32.astype(np.float64))
    j = np.arange(Nb)
    r = np.where(keep[:, None, :], np.float32(POS_INF), r)
    r = np.where(empty | (j[None, None, :] >= nb[:, None, None]), np.float32(NEG_INF), r)
    return r.astype(np.float32)


def valid_blocks(lengths, B, Nb, G):
    cap = Nb * G
    ln = np.full(B, cap) if lengths is None else np.clip(to_numpy(lengths).astype(np.int64), 0, cap)
    return -(-ln // G)


def select_ref(scores, nb, k):
    """int32 [B, Hkv, k] as sets: per row the min(k, nb) first blocks of (score descending, NaN below
    -inf, block number ascending), sorted ascending, then -1."""
    s = np.asarray(scores, dtype=np.float64)
    B, Hkv, Nb = s.shape
    out = np.full((B, Hkv, k), -1, np.int32)
    for b in range(B):
        n = int(nb[b])
        for h in range(Hkv):
            row = s[b, h, :n]
            idx = np.arange(n)
            order = np.lexsort((idx, -np.where(np.isnan(row), NEG_INF, row), np.isnan(row)))
            top = np.sort(order[:min(k, n)])
            out[b, h, :top.size] = top
    return out


# --------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------
@dataclass
class SelectCase:
    k_cache: object       # [num_pages, P, Hkv, D] (a transposed view for HND)
    block_table: np.ndarray
    lengths: np.ndarray
    q: object            # [B, Hq, D]
    block_size: int
    dtype: str

    @property
    def shape(self):
        num_pages, P, Hkv, D = self.k_cache.shape
        B, maxp = self.block_table.shape
        return dict(B=B, Hkv=Hkv, D=D, P=P, num_pages=num_pages, max_pages=maxp, Nb=-(-maxp * P // self.block_size),
                    Hq=self.q.shape[1])

    def args(self, fw="auto", device="cpu"):
        """(k_cache, block_table, lengths, q) in the framework: NumPy for float32 / float16, torch for
        bfloat16 (fw 'auto'), or 'torch' / 'numpy'."""
        if fw == "auto":
            fw = "torch" if self.dtype == "bfloat16" or device != "cpu" else "numpy"
        k, q = self.k_cache, self.q
        bt, ln = self.block_table, self.lengths
        if fw == "numpy":
            assert self.dtype != "bfloat16"
            return k, bt, ln, q
        import torch

        def t(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)  # keeps the strides of a dense view (HND)
            return torch.from_numpy(x).to(device)

        return t(k), t(bt), t(ln), t(q)


def _cast(x32, dtype, layout=None):
    """float32 NumPy -> the dtype (NumPy, or torch for bfloat16); layout 'HND': stored [pages, Hkv, P,
    D] and returned as the [pages, P, Hkv, D] view."""
    if layout == "HND":
        x32 = np.ascontiguousarray(x32.transpose(0, 2, 1, 3))
    if dtype == "bfloat16":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x32)).to(torch.bfloat16)
        return t.transpose(1, 2) if layout == "HND" else t
    x = x32.astype(dtype)
    return x.transpose(0, 2, 1, 3) if layout == "HND" else x


def make_case(rng, *, B=3, Hkv=2, GQ=2, D=16, P=16, G=16, max_pages=6, num_pages=None, dtype="float32",
              layout="NHD", lengths="ragged", bad_pages=0.0, shuffle=True, extra_pages=3):
    """A paged K cache with shuffled pages, some table entries out of range (bad_pages: their
    fraction), lengths 'ragged' (0, full, partial blocks...), 'full', or an array."""
    num_pages = num_pages or B * max_pages + extra_pages
    k32 = rng.standard_normal((num_pages, P, Hkv, D)).astype(np.float32)
    k = _cast(k32, dtype, layout)
    pages = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    bt = np.resize(pages, B * max_pages).reshape(B, max_pages).astype(np.int32)
    if bad_pages:
        bad = rng.random(bt.shape) < bad_pages
        bt[bad] = rng.choice([-1, -7, num_pages, num_pages + 5], size=int(bad.sum()))
    cap = max_pages * P
    if isinstance(lengths, str):
        if lengths == "full":
            ln = np.full(B, cap, np.int32)
        else:
            choices = [0, cap, 1, G, G + 1, cap - 1, max(cap - G, 0), cap // 2 + 3]
            ln = np.array([choices[i] if i < len(choices) and B > 2 else rng.integers(0, cap + 1)
                           for i in range(B)], np.int32)
            ln = np.clip(ln, 0, cap).astype(np.int32)
            rng.shuffle(ln)
    else:
        ln = np.asarray(lengths, np.int32)
    q32 = rng.standard_normal((B, Hkv * GQ, D)).astype(np.float32)
    q = _cast(q32, dtype)
    return SelectCase(k, bt, ln, q, G, dtype)


def as_f64(x):
    return to_numpy(x).astype(np.float64)


__all__ = ["metadata_ref", "scores_ref", "scores_abs", "scores_order_f32", "select_ref", "valid_blocks",
           "make_case", "SelectCase", "as_f64", "to_numpy", "round_to"]
