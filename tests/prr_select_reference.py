"""Independent NumPy references for gvr.prr's selection stage (block_metadata, update_block_metadata,
block_scores, select_blocks), written from the documented semantics (kernels/gvr_kernels.h, section
"PRR selection stage"), token by token, in float64, plus a float32 emulation of the documented
summation order of block_scores (to hold the C code to it bit for bit) and the case generator that
the CPU and GPU tests share.

Values: float32, float16 (NumPy) and bfloat16 (torch CPU tensors; ``to_numpy`` widens them to float32
exactly); fp8 (e4m3fn) K caches and metadata as torch float8_e4m3fn tensors, read through their uint8
codes: metadata picks codes by IEEE totalOrder on the sign-magnitude bytes (``E4M3_RANK``, built here by
sorting the 256 decoded values, and checked against the byte-key formula), an empty block is
(min 0x7F = +NaN, max 0xFF = -NaN); scores decode fp8 metadata with attention_reference.e4m3_decode
(from the bit definition, never torch's conversion). A block is empty when its channel-0 min is above
its max in totalOrder, for every dtype (``empty_ref``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention_reference import E4M3_VALUES, e4m3_decode, e4m3_encode, to_numpy  # noqa: F401  (re-exported)
from harness import round_to

NEG_INF, POS_INF = -np.inf, np.inf
FP8 = "float8_e4m3fn"


# --------------------------------------------------------------------------------------------------
# fp8 (e4m3fn) codes and IEEE totalOrder
# --------------------------------------------------------------------------------------------------
def _e4m3_order_key(code):
    """totalOrder of one code from its decoded value: -NaN < -448 < ... < -0 < +0 < ... < 448 < +NaN."""
    v, neg = E4M3_VALUES[code], bool(code & 0x80)
    if np.isnan(v):
        return (-1 if neg else 1, 0.0, 0)
    return (0, float(v), 0 if neg else 1)  # -0 below +0


E4M3_RANK = np.empty(256, np.int64)  # code -> its position in totalOrder (0 = -NaN 0xFF, 255 = +NaN 0x7F)
E4M3_RANK[sorted(range(256), key=_e4m3_order_key)] = np.arange(256)
E4M3_BY_RANK = np.argsort(E4M3_RANK).astype(np.uint8)  # position -> code
# the byte-key formula of the spec (b ^ 0xFF with the sign bit, else b ^ 0x80) is that order
_c = np.arange(256)
assert np.array_equal(E4M3_RANK, np.where(_c & 0x80, _c ^ 0xFF, _c ^ 0x80))
assert E4M3_BY_RANK[0] == 0xFF and E4M3_BY_RANK[127] == 0x80 and E4M3_BY_RANK[128] == 0x00 and E4M3_BY_RANK[255] == 0x7F
del _c
E4M3_EMPTY_MIN, E4M3_EMPTY_MAX = 0x7F, 0xFF  # an empty block's (min, max): +NaN, -NaN
E4M3_SPECIAL = np.array([0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x88, 0x7E, 0xFE, 0x77, 0xF7], np.uint8)
# +-0, the smallest and largest subnormals, the smallest normals, +-448, +-240


def is_fp8(x):
    """x is a float8_e4m3fn tensor / array (torch, or NumPy with ml_dtypes)."""
    return str(getattr(x, "dtype", "")).endswith("float8_e4m3fn")


def fp8_codes(x):
    """uint8 NumPy codes (same shape) of a float8_e4m3fn tensor / array (any strides, any device)."""
    assert is_fp8(x), getattr(x, "dtype", None)
    if isinstance(x, np.ndarray):
        return x.view(np.uint8)
    import torch

    return x.detach().cpu().view(torch.uint8).numpy()


def random_fp8_codes(rng, shape, *, specials=0.1, nans=0):
    """uint8 e4m3fn codes: a mix of N(0, 1) scaled by 2^-8 (subnormals), 1 and 200 (saturating at +-448)
    rounded to e4m3fn, a fraction ``specials`` replaced by E4M3_SPECIAL codes (signed zeros, subnormal
    and normal edges, +-448), and ``nans`` entries (a count) replaced by NaN codes 0x7F / 0xFF."""
    n = int(np.prod(shape))
    m = min(n, 1 << 14)  # large caches: drawn from a pool of encoded values (e4m3_encode is slow)
    amp = rng.choice(np.array([2.0**-8, 1.0, 200.0]), size=m, p=[0.15, 0.7, 0.15])
    pool = e4m3_encode(amp * rng.standard_normal(m))
    codes = (pool[rng.integers(0, m, size=n)] if n > m else pool).reshape(shape)
    sp = rng.random(shape) < specials
    codes[sp] = rng.choice(E4M3_SPECIAL, size=int(sp.sum()))
    if nans:
        flat = codes.reshape(-1)
        where = rng.choice(flat.size, size=min(nans, flat.size), replace=False)
        flat[where] = rng.choice(np.array([0x7F, 0xFF], np.uint8), size=where.size)
    return codes


def _native_bits(x):
    """(unsigned NumPy bits, width in bits) of a float array / tensor in its own dtype."""
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x)
        return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize]), 8 * x.itemsize
    import torch

    x = x.detach().cpu()
    n = x.element_size()
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[n]
    u = x.contiguous().view(it).numpy()
    return u.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[n]), 8 * n


def total_order_key(x):
    """int64 (uint64 for 8-byte floats) keys whose order is IEEE totalOrder of x's values in its own
    dtype (sign-magnitude: with the sign bit all bits flipped, else the sign bit set)."""
    if is_fp8(x):
        return E4M3_RANK[fp8_codes(x)]
    u, w = _native_bits(x)
    u = u.astype(np.uint64)
    sign, ones = np.uint64(1 << (w - 1)), np.uint64((1 << w) - 1)
    return np.where(u & sign, u ^ ones, u ^ sign)


def empty_ref(meta):
    """bool [B, Hkv, Nb]: the blocks whose channel-0 min is above their max in totalOrder."""
    k = total_order_key(meta)
    return k[..., 0, 0] > k[..., 1, 0]


def meta_values(meta):
    """float64 values of a metadata array / tensor (fp8: e4m3_decode of the codes)."""
    if is_fp8(meta):
        return e4m3_decode(fp8_codes(meta))
    return to_numpy(meta).astype(np.float64)


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
    own tests). An fp8 k_cache (torch float8_e4m3fn): ``metadata_ref_fp8``'s uint8 codes."""
    if is_fp8(k_cache):
        return metadata_ref_fp8(fp8_codes(k_cache), block_table, lengths, G)
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


def metadata_ref_fp8(codes, block_table, lengths, G):
    """uint8 [B, Hkv, Nb, 2, D]: the codes of the per-channel totalOrder min / max (E4M3_RANK) of the
    fp8 keys (uint8 codes [num_pages, P, Hkv, D]) of each block's valid tokens, folded token by token;
    (0x7F, 0xFF) for a block without tokens. NaN codes and signed zeros included."""
    codes = np.asarray(codes)
    assert codes.dtype == np.uint8
    bt = to_numpy(block_table)
    num_pages, P, Hkv, D = codes.shape
    B, maxp = bt.shape
    cap = maxp * P
    Nb = -(-cap // G)
    ln = np.full(B, cap) if lengths is None else to_numpy(lengths)
    lo_r = np.full((B, Hkv, Nb, D), 256)  # ranks; 256 / -1: no token yet
    hi_r = np.full((B, Hkv, Nb, D), -1)
    for b in range(B):
        for j in range(Nb):
            for pg, sl in _tokens(bt[b], int(ln[b]), P, num_pages, j * G, (j + 1) * G):
                r = E4M3_RANK[codes[pg, sl]]  # [Hkv, D]
                lo_r[b, :, j] = np.minimum(lo_r[b, :, j], r)
                hi_r[b, :, j] = np.maximum(hi_r[b, :, j], r)
    meta = np.empty((B, Hkv, Nb, 2, D), np.uint8)
    empty = hi_r < 0
    meta[..., 0, :] = np.where(empty, E4M3_EMPTY_MIN, E4M3_BY_RANK[np.minimum(lo_r, 255)])
    meta[..., 1, :] = np.where(empty, E4M3_EMPTY_MAX, E4M3_BY_RANK[np.maximum(hi_r, 0)])
    return meta


# --------------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------------
def _masks(Nb, G, lengths, B, keep_first, keep_last, meta):
    """(nb [B], empty [B, Hkv, Nb], keep [B, Nb])"""
    cap = Nb * G
    ln = np.full(B, cap) if lengths is None else np.clip(to_numpy(lengths).astype(np.int64), 0, cap)
    nb = -(-ln // G)
    j = np.arange(Nb)
    empty = empty_ref(meta)
    keep = (j[None, :] < keep_first) | (j[None, :] >= nb[:, None] - keep_last)
    return nb, empty, keep


def scores_ref(q, meta, lengths, G, group_reduce="max", keep_first=0, keep_last=0):
    """float64 [B, Hkv, Nb]: Quest's upper bound per query head, combined over the group (fp8 meta:
    its decoded values)."""
    q64 = to_numpy(q).astype(np.float64)
    m64 = meta_values(meta)
    B, Hq, D = q64.shape
    _, Hkv, Nb, _, _ = m64.shape
    GQ = Hq // Hkv
    qg = q64.reshape(B, Hkv, GQ, 1, D)
    mn, mx = m64[:, :, None, :, 0, :], m64[:, :, None, :, 1, :]  # [B, Hkv, 1, Nb, D]
    with np.errstate(invalid="ignore"):
        s = np.maximum(qg * mx, qg * mn).sum(axis=-1)  # [B, Hkv, GQ, Nb]
    r = s.max(axis=2) if group_reduce == "max" else s.sum(axis=2)
    nb, empty, keep = _masks(Nb, G, lengths, B, keep_first, keep_last, meta)
    j = np.arange(Nb)
    r = np.where(keep[:, None, :], POS_INF, r)
    r = np.where(empty | (j[None, None, :] >= nb[:, None, None]), NEG_INF, r)
    return r


def scores_abs(q, meta):
    """float64 [B, Hkv, Nb]: the largest over the group of sum_d |t_d| (the scale of the rounding error)."""
    q64 = to_numpy(q).astype(np.float64)
    m64 = meta_values(meta)
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
    m32 = meta_values(meta).astype(np.float32)  # exact (fp8 and the q dtypes are float32 subsets)
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
    nb, empty, keep = _masks(Nb, G, lengths, B, keep_first, keep_last, meta)
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
    dtype: str            # q's (and, unless kv_dtype is set, k_cache's)
    kv_dtype: str | None = None  # "float8_e4m3fn": k_cache is a torch float8_e4m3fn tensor
    codes: np.ndarray | None = None  # fp8: k_cache's uint8 codes (the same view)

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
            fw = "torch" if self.dtype == "bfloat16" or device != "cpu" or self.kv_dtype else "numpy"
        k, q = self.k_cache, self.q
        bt, ln = self.block_table, self.lengths
        if fw == "numpy":
            assert self.dtype != "bfloat16" and not self.kv_dtype
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


def _fp8_cache(codes, layout=None):
    """(torch float8_e4m3fn [pages, P, Hkv, D], its uint8 codes, the same view) of uint8 codes; layout
    'HND': stored [pages, Hkv, P, D]."""
    import torch

    if layout == "HND":
        store = np.ascontiguousarray(codes.transpose(0, 2, 1, 3))
        return torch.from_numpy(store).view(torch.float8_e4m3fn).transpose(1, 2), store.transpose(0, 2, 1, 3)
    codes = np.ascontiguousarray(codes)
    return torch.from_numpy(codes).view(torch.float8_e4m3fn), codes


def make_case(rng, *, B=3, Hkv=2, GQ=2, D=16, P=16, G=16, max_pages=6, num_pages=None, dtype="float32",
              layout="NHD", lengths="ragged", bad_pages=0.0, shuffle=True, extra_pages=3, kv_dtype=None,
              specials=0.1, nans=0):
    """A paged K cache with shuffled pages, some table entries out of range (bad_pages: their
    fraction), lengths 'ragged' (0, full, partial blocks...), 'full', or an array. kv_dtype
    "float8_e4m3fn": the cache is a torch fp8 tensor of ``random_fp8_codes(specials=, nans=)`` and q
    (in ``dtype``) a torch tensor."""
    num_pages = num_pages or B * max_pages + extra_pages
    codes = None
    if kv_dtype is None:
        k32 = rng.standard_normal((num_pages, P, Hkv, D)).astype(np.float32)
        k = _cast(k32, dtype, layout)
    else:
        assert kv_dtype == FP8, kv_dtype
        k, codes = _fp8_cache(random_fp8_codes(rng, (num_pages, P, Hkv, D), specials=specials, nans=nans), layout)
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
    if kv_dtype is not None and isinstance(q, np.ndarray):  # fp8 caches are torch tensors: q too
        import torch

        q = torch.from_numpy(np.ascontiguousarray(q))
    return SelectCase(k, bt, ln, q, G, dtype, kv_dtype, codes)


def as_f64(x):
    return to_numpy(x).astype(np.float64)


__all__ = ["metadata_ref", "metadata_ref_fp8", "scores_ref", "scores_abs", "scores_order_f32", "select_ref",
           "valid_blocks", "make_case", "SelectCase", "as_f64", "to_numpy", "round_to", "FP8", "E4M3_RANK",
           "E4M3_BY_RANK", "E4M3_EMPTY_MIN", "E4M3_EMPTY_MAX", "E4M3_SPECIAL", "is_fp8", "fp8_codes",
           "random_fp8_codes", "total_order_key", "empty_ref", "meta_values", "e4m3_decode", "e4m3_encode"]
