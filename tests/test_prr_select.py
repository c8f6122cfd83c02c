"""gvr.prr's selection stage on the CPU (block_metadata, update_block_metadata, block_scores,
select_blocks), against the independent NumPy references of prr_select_reference.py.

Metadata is exact (min / max of stored values): compared bit for bit. Scores are held to the float64
reference within fp32 rounding (a bound of D ulps of the terms' magnitude), and bit for bit to a
float32 NumPy emulation of the documented summation order. Selections are compared as sets with an
argsort-based Top-K (ties to the lower block number).

float32 and float16 run through NumPy; bfloat16 through torch CPU tensors.

fp8 (e4m3fn) K caches (torch float8_e4m3fn CPU tensors; skipped without torch): metadata compared
byte for byte with the reference's totalOrder fold over the codes (NaN codes 0x7F / 0xFF, signed zeros,
subnormals, +-448 included; an empty block is (0x7F, 0xFF)); scores over fp8 metadata (bfloat16 /
float16 / float32 q) held to the reference on the values e4m3_decode gives (the reference's own
decoder) as above, and bit for bit to the scores of the same metadata decoded into q's dtype. NaN
scores (a NaN code in a block's metadata) are compared as NaN where the reference is NaN: their sign
and payload are not specified.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
from gvr import _prr_select as prr
from harness import torch_or_none
from prr_select_reference import (
    E4M3_BY_RANK, E4M3_EMPTY_MAX, E4M3_EMPTY_MIN, E4M3_RANK, FP8, as_f64, e4m3_decode, empty_ref, fp8_codes,
    make_case, metadata_ref, random_fp8_codes, scores_abs, scores_order_f32, scores_ref, select_ref, to_numpy,
    valid_blocks,
)

torch = torch_or_none()
needs_torch = pytest.mark.skipif(torch is None, reason="bfloat16 CPU inputs and torch ops need torch")
needs_fp8 = pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"),
                               reason="fp8 K caches are torch float8_e4m3fn tensors: needs torch")
DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=needs_torch)]
PG = [(16, 16), (16, 64), (64, 16), (8, 32), (32, 8), (1, 4), (4, 1), (16, 48)]


def meta_of(c, fw="auto", **kw):
    k, bt, ln, _ = c.args(fw)
    return prr.block_metadata(k, bt, ln, block_size=c.block_size, **kw)


def bits(x):
    """the raw bits of a float array (NumPy or torch), as unsigned ints"""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16)
        if x.element_size() == 1:  # float8_e4m3fn: its codes
            return x.view(torch.uint8).numpy()
        x = x.numpy()
    x = np.ascontiguousarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


def nan_bits(x):
    """bits() of a float32 array with every NaN as 0x7FC00000 (the sign and payload of a NaN score are
    not specified)."""
    x = np.array(to_numpy(x), dtype=np.float32)
    x[np.isnan(x)] = np.float32(np.nan)
    return x.view(np.uint32)


def check_scores(got, q, meta, lengths, G, **kw):
    ref = scores_ref(q, meta, lengths, G, **kw)
    got = to_numpy(got).astype(np.float64)
    assert got.shape == ref.shape
    inf, nan = np.isinf(ref), np.isnan(ref)
    assert np.array_equal(got[inf], ref[inf]), "masked / kept blocks differ"
    assert np.array_equal(np.isnan(got), nan), f"NaN scores differ at {np.argwhere(np.isnan(got) != nan)[:5]}"
    D = to_numpy(q).shape[-1]
    with np.errstate(invalid="ignore"):
        bound = scores_abs(q, meta) * (D + 4) * 2.0**-24 + 1e-30
        err = np.abs(got - ref)
    bad = ~inf & ~nan & ~(err <= bound)
    assert not bad.any(), f"scores off at {np.argwhere(bad)[:5]}: got {got[bad][:5]}, ref {ref[bad][:5]}"
    # the documented order, bit for bit (NaN as NaN)
    want = scores_order_f32(q, meta, lengths, G, **kw)
    assert np.array_equal(nan_bits(got), nan_bits(want)), "not the documented summation order"


# --------------------------------------------------------------------------------------------------
# block_metadata
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,G", PG, ids=[f"P{p}-G{g}" for p, g in PG])
def test_metadata_against_reference(P, G, dtype):
    if G % P and P % G:
        G = P * 2
    rng = np.random.default_rng(P * 100 + G)
    c = make_case(rng, B=5, Hkv=2, D=12, P=P, G=G, max_pages=max(2, 96 // P), dtype=dtype, bad_pages=0.1)
    m = meta_of(c)
    assert m.shape == (5, 2, c.shape["Nb"], 2, 12) and m.dtype == c.k_cache.dtype
    ref = metadata_ref(c.k_cache, c.block_table, c.lengths, G)
    assert np.array_equal(as_f64(m), ref)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_metadata_layouts_and_head_dims(layout, dtype):
    rng = np.random.default_rng(3)
    for D in (1, 7, 64, 128):
        c = make_case(rng, B=3, Hkv=3, D=D, P=16, G=32, max_pages=5, dtype=dtype, layout=layout)
        ref = metadata_ref(c.k_cache, c.block_table, c.lengths, 32)
        assert np.array_equal(as_f64(meta_of(c)), ref)


def test_metadata_empty_blocks_and_lengths_default():
    rng = np.random.default_rng(4)
    c = make_case(rng, B=3, D=8, P=4, G=8, max_pages=6, lengths=[0, 24, 5])
    c.block_table[1, 2:4] = -1  # block 1 of row 1: both its pages out of range
    m = as_f64(meta_of(c))
    assert np.all(m[0, :, :, 0] == np.inf) and np.all(m[0, :, :, 1] == -np.inf)
    assert np.all(m[1, :, 1, 0] == np.inf) and np.all(m[1, :, 1, 1] == -np.inf)
    assert np.all(np.isfinite(m[1, :, 0])) and np.all(np.isfinite(m[1, :, 2]))
    assert np.all(m[2, :, 1:, 0] == np.inf)
    full = prr.block_metadata(c.k_cache, c.block_table, block_size=8)
    assert np.array_equal(as_f64(full), metadata_ref(c.k_cache, c.block_table, None, 8))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_metadata_signed_zero_and_nan_are_total_order(dtype):
    k = np.zeros((2, 4, 1, 4), dtype)
    k[0, :, 0, 0] = [0.0, -0.0, 0.0, 0.0]    # channel 0: -0 is the min, +0 the max
    k[0, :, 0, 1] = [-0.0, -0.0, -0.0, -0.0]  # all -0
    k[0, :, 0, 2] = [1.0, np.nan, -2.0, 3.0]  # positive NaN: above +inf (the max)
    k[0, :, 0, 3] = [1.0, -np.nan, -2.0, 3.0]  # negative NaN: below -inf (the min)
    bt = np.array([[0]], np.int32)
    m = prr.block_metadata(k, bt, block_size=4)[0, 0, 0]
    assert np.signbit(m[0, 0]) and not np.signbit(m[1, 0]) and m[0, 0] == 0 and m[1, 0] == 0
    assert np.signbit(m[0, 1]) and np.signbit(m[1, 1])
    assert m[0, 2] == -2 and np.isnan(m[1, 2])
    assert np.isnan(m[0, 3]) and m[1, 3] == 3
    # NaN payloads are kept: bits of the stored value
    assert bits(m[1, 2:3])[0] == bits(k[0, 1, 0, 2:3])[0]


def test_metadata_out_argument_and_strides():
    rng = np.random.default_rng(5)
    c = make_case(rng, B=2, D=8, P=8, G=8, max_pages=4)
    Nb = c.shape["Nb"]
    big = np.full((2, 2, Nb, 3, 16), 7.0, np.float32)
    out = big[:, :, :, 1:, :8]  # strided view
    r = prr.block_metadata(c.k_cache, c.block_table, c.lengths, block_size=8, out=out)
    assert r is out
    assert np.array_equal(as_f64(out), metadata_ref(c.k_cache, c.block_table, c.lengths, 8))
    assert np.all(big[:, :, :, 0] == 7.0) and np.all(big[..., 8:] == 7.0)


# --------------------------------------------------------------------------------------------------
# update_block_metadata
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,G", [(16, 16), (4, 16), (16, 4), (8, 24)], ids=["P16-G16", "P4-G16", "P16-G4", "P8-G24"])
def test_update_equals_rebuild(P, G, dtype):
    rng = np.random.default_rng(P + G)
    c = make_case(rng, B=4, D=10, P=P, G=G, max_pages=max(3, 64 // P), dtype=dtype, bad_pages=0.1, lengths="full")
    k, bt, _, _ = c.args()
    cap = c.shape["max_pages"] * P
    cur = np.array([0, 3, G, cap // 2], np.int32)
    meta = prr.block_metadata(k, bt, cur.copy(), block_size=G)
    steps = [1, 1, G - 1, 2, 0, G + 3, 1, 5 * G, cap]
    for step in steps:
        new = np.minimum(cur + np.array([step, step, 1, 2 * step]), cap).astype(np.int32)
        r = prr.update_block_metadata(meta, k, bt, cur, new, block_size=G)
        assert r is meta
        want = prr.block_metadata(k, bt, new, block_size=G)
        assert np.array_equal(bits(meta), bits(want)), f"step {step}: update != rebuild"
        cur = new


def test_update_touches_only_its_blocks():
    rng = np.random.default_rng(8)
    G = 8
    c = make_case(rng, B=3, D=8, P=4, G=G, max_pages=10, lengths="full")
    Nb = c.shape["Nb"]
    meta = np.full((3, 2, Nb, 2, 8), 5.0, np.float32)
    meta[..., 0, :] = -5.0  # a non-empty content: merged into the partial block
    start = np.array([3, 8, 20], np.int32)
    end = np.array([3, 17, 21], np.int32)  # row 0: nothing; row 1: blocks 1, 2; row 2: block 2 only
    prr.update_block_metadata(meta, c.k_cache, c.block_table, start, end, block_size=G)
    assert np.all(meta[0] == np.where(np.arange(2)[:, None] == 0, -5.0, 5.0)[None, None])
    untouched = {1: [0] + list(range(3, Nb)), 2: [0, 1] + list(range(3, Nb))}
    for b, blocks in untouched.items():
        assert np.all(meta[b, :, blocks, 0] == -5.0) and np.all(meta[b, :, blocks, 1] == 5.0)
    # row 1, block 1 rebuilt from tokens 8..15; block 2 from token 16 alone
    ref = metadata_ref(c.k_cache, c.block_table, np.array([0, 17, 0]), G)
    assert np.array_equal(meta[1, :, 1:3], ref[1, :, 1:3])
    # row 2, block 2 (tokens 16..23) holds start 20: merged with its content (-5, 5) and token 20
    tok = metadata_ref(c.k_cache, c.block_table, np.array([0, 0, 21]), G)  # tokens 16..20 of block 2
    assert np.all(meta[2, :, 2, 0] == -5.0) and np.all(meta[2, :, 2, 1] == 5.0)
    assert np.all(tok[2, :, 2, 0] > -5.0)


def test_update_of_an_empty_partial_block_takes_the_new_tokens():
    rng = np.random.default_rng(9)
    c = make_case(rng, B=1, D=8, P=4, G=8, max_pages=4, lengths="full")
    meta = prr.block_metadata(c.k_cache, c.block_table, np.array([0], np.int32), block_size=8)
    prr.update_block_metadata(meta, c.k_cache, c.block_table, np.array([5], np.int32), np.array([7], np.int32),
                              block_size=8)
    k = as_f64(c.k_cache)
    rows = np.stack([k[c.block_table[0, t // 4], t % 4] for t in (5, 6)])
    assert np.array_equal(meta[0, :, 0, 0], rows.min(0)) and np.array_equal(meta[0, :, 0, 1], rows.max(0))


# --------------------------------------------------------------------------------------------------
# block_scores
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 8, 13, 64, 200])
@pytest.mark.parametrize("GQ", [1, 4])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_scores_against_reference(D, GQ, reduce, dtype):
    rng = np.random.default_rng(D * 10 + GQ)
    c = make_case(rng, B=4, Hkv=2, GQ=GQ, D=D, P=8, G=16, max_pages=8, dtype=dtype, bad_pages=0.1)
    _, _, ln, q = c.args()
    meta = meta_of(c)
    s = prr.block_scores(q, meta, ln, block_size=16, group_reduce=reduce)
    assert s.shape == (4, 2, c.shape["Nb"])
    check_scores(s, q, meta, ln, 16, group_reduce=reduce)


@pytest.mark.parametrize("kf,kl", [(0, 0), (1, 2), (3, 0), (0, 5), (100, 100)])
def test_scores_keep_first_and_last(kf, kl):
    rng = np.random.default_rng(11)
    c = make_case(rng, B=6, GQ=2, D=16, P=4, G=8, max_pages=12, bad_pages=0.15)
    meta = meta_of(c)
    s = prr.block_scores(c.q, meta, c.lengths, block_size=8, keep_first=kf, keep_last=kl)
    check_scores(s, c.q, meta, c.lengths, 8, keep_first=kf, keep_last=kl)
    nb = valid_blocks(c.lengths, 6, c.shape["Nb"], 8)
    empty = as_f64(meta)[..., 0, 0] > as_f64(meta)[..., 1, 0]
    for b in range(6):
        for j in range(c.shape["Nb"]):
            want_inf = j < nb[b] and (j < kf or j >= nb[b] - kl)
            for h in range(2):
                if j >= nb[b] or empty[b, h, j]:
                    assert s[b, h, j] == -np.inf
                else:
                    assert (s[b, h, j] == np.inf) == want_inf


def test_scores_lengths_default_and_out():
    rng = np.random.default_rng(12)
    c = make_case(rng, B=2, GQ=3, D=16, P=8, G=8, max_pages=4, lengths="full")
    meta = meta_of(c)
    out = np.full((2, 2, c.shape["Nb"] + 3), 9.0, np.float32)[:, :, 1:-2]
    r = prr.block_scores(c.q, meta, block_size=8, out=out)
    assert r is out
    check_scores(out, c.q, meta, None, 8)


def test_scores_nan_and_zero_queries():
    rng = np.random.default_rng(13)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=4, max_pages=4, lengths="full")
    meta = meta_of(c)
    q = np.array(c.q)
    q[0] = 0.0
    q[1, 0, 3] = np.nan
    s = prr.block_scores(q, meta, block_size=4, group_reduce="max")
    assert np.all(s[0] == 0.0)
    assert np.all(np.isnan(s[1, 0]))  # NaN propagates through max over the group
    s = prr.block_scores(q, meta, block_size=4, group_reduce="max", keep_first=1)
    assert np.all(s[1, 0, 0] == np.inf) and np.all(np.isnan(s[1, 0, 1:]))


# --------------------------------------------------------------------------------------------------
# select_blocks
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 1, 3, 8, 40])
def test_select_blocks_is_topk_of_the_scores(k, dtype):
    rng = np.random.default_rng(20 + k)
    c = make_case(rng, B=5, Hkv=2, GQ=4, D=16, P=8, G=8, max_pages=8, dtype=dtype, bad_pages=0.05)
    _, _, ln, q = c.args()
    meta = meta_of(c)
    for init, local, reduce in ((1, 2, "max"), (0, 0, "sum"), (3, 1, "max")):
        sel = prr.select_blocks(q, meta, k, ln, block_size=8, init_blocks=init, local_blocks=local,
                                group_reduce=reduce)
        assert sel.shape == (5, 2, k) and to_numpy(sel).dtype == np.int32
        s = prr.block_scores(q, meta, ln, block_size=8, keep_first=init, keep_last=local, group_reduce=reduce)
        want = select_ref(to_numpy(s), valid_blocks(c.lengths, 5, c.shape["Nb"], 8), k)
        got = np.sort(np.where(to_numpy(sel) < 0, np.iinfo(np.int32).max, to_numpy(sel)), axis=-1)
        got = np.where(got == np.iinfo(np.int32).max, -1, got)
        assert np.array_equal(got, want)


def test_select_blocks_ties_go_to_the_lower_block():
    rng = np.random.default_rng(21)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=4, max_pages=10, lengths=[40, 23])
    meta = meta_of(c)
    q = np.zeros_like(c.q)  # every score 0: a tie everywhere
    sel = prr.select_blocks(q, meta, 4, c.lengths, block_size=4, init_blocks=0, local_blocks=1)
    assert [sorted(r) for r in sel[0]] == [[0, 1, 2, 9]] * 2
    assert [sorted(r) for r in sel[1]] == [[0, 1, 2, 5]] * 2


def test_select_blocks_always_keeps_first_and_local_blocks():
    rng = np.random.default_rng(22)
    c = make_case(rng, B=4, GQ=2, D=16, P=8, G=8, max_pages=16, lengths=[128, 77, 9, 64])
    meta = meta_of(c)
    sel = prr.select_blocks(c.q, meta, 6, c.lengths, block_size=8, init_blocks=1, local_blocks=2)
    nb = valid_blocks(c.lengths, 4, c.shape["Nb"], 8)
    for b in range(4):
        for h in range(2):
            row = set(int(x) for x in sel[b, h] if x >= 0)
            assert len(row) == min(6, nb[b])
            assert {0, nb[b] - 1, nb[b] - 2} & set(range(nb[b])) <= row


def test_select_blocks_feed_sparse_attention():
    from attention_reference import sparse_attention_ref

    rng = np.random.default_rng(23)
    c = make_case(rng, B=3, Hkv=2, GQ=2, D=16, P=8, G=16, max_pages=8, lengths=[64, 37, 1])
    meta = meta_of(c)
    v = rng.standard_normal(c.k_cache.shape).astype(np.float32)
    sel = prr.select_blocks(c.q, meta, 3, c.lengths, block_size=16)
    kw = dict(block_table=c.block_table, lengths=c.lengths, block_size=16)
    o, l = gvr.sparse_attention(c.q, c.k_cache, v, sel, **kw)
    ro, rl = sparse_attention_ref(c.q, c.k_cache, v, sel, **kw)
    assert np.allclose(o, ro, rtol=1e-5, atol=1e-5) and np.allclose(l, rl, rtol=1e-5, atol=1e-5)
    # every valid block selected: attention over the whole row
    allb = prr.select_blocks(c.q, meta, c.shape["Nb"], c.lengths, block_size=16)
    o2, l2 = gvr.sparse_attention(c.q, c.k_cache, v, allb, **kw)
    dense = np.broadcast_to(np.arange(c.shape["Nb"], dtype=np.int32), (3, 2, c.shape["Nb"])).copy()
    o3, l3 = gvr.sparse_attention(c.q, c.k_cache, v, dense, **kw)
    assert np.allclose(o2, o3, rtol=1e-5, atol=1e-6) and np.allclose(l2, l3, rtol=1e-5, atol=1e-6)


def test_select_blocks_out_argument():
    rng = np.random.default_rng(24)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=4, max_pages=6)
    meta = meta_of(c)
    want = prr.select_blocks(c.q, meta, 3, c.lengths, block_size=4)
    out = np.full((2, 2, 3), 99, np.int32)
    assert prr.select_blocks(c.q, meta, 3, c.lengths, block_size=4, out=out) is out
    assert np.array_equal(out, want)
    big = np.full((2, 2, 6), 99, np.int32)
    strided = big[:, :, ::2]  # not contiguous: written through a copy
    assert prr.select_blocks(c.q, meta, 3, c.lengths, block_size=4, out=strided) is strided
    assert np.array_equal(strided, want) and np.all(big[:, :, 1::2] == 99)


def _scores_out_like(q, shape, fill=7.0):
    """a float32 buffer in q's framework, filled with a sentinel"""
    if torch is not None and isinstance(q, torch.Tensor):
        return torch.full(shape, fill, dtype=torch.float32, device=q.device)
    return np.full(shape, fill, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("lengths", ["ragged", None])
@pytest.mark.parametrize("sort", [False, True])
def test_select_blocks_scores_out_is_block_scores_without_keeps(dtype, reduce, lengths, sort):
    rng = np.random.default_rng(25 + len(dtype) + (reduce == "sum") + 2 * sort)
    c = make_case(rng, B=6, Hkv=2, GQ=3, D=24, P=4, G=8, max_pages=10, dtype=dtype, bad_pages=0.1)
    _, _, ln, q = c.args()
    if lengths is None:
        ln = None
    meta = meta_of(c)
    B, Nb = 6, c.shape["Nb"]
    for k, init, local in ((4, 1, 2), (0, 1, 2), (Nb, 3, 1), (2, 0, 0)):
        want_sel = prr.select_blocks(q, meta, k, ln, block_size=8, group_reduce=reduce, init_blocks=init,
                                     local_blocks=local, sorted=sort)
        so = _scores_out_like(q, (B, 2, Nb))
        sel = prr.select_blocks(q, meta, k, ln, block_size=8, group_reduce=reduce, init_blocks=init,
                                local_blocks=local, sorted=sort, scores_out=so)
        want = prr.block_scores(q, meta, ln, block_size=8, group_reduce=reduce, keep_first=0, keep_last=0)
        assert np.array_equal(bits(so), bits(want)), f"k={k} init={init} local={local}"
        assert np.array_equal(to_numpy(sel), to_numpy(want_sel)), "the selection changed with scores_out"
        if init or local:
            # the kept blocks were ranked at +inf but are handed back finite
            kept = prr.block_scores(q, meta, ln, block_size=8, group_reduce=reduce, keep_first=init,
                                    keep_last=local)
            forced = (to_numpy(kept) == np.inf) & np.isfinite(to_numpy(so))
            assert forced.any()


def test_select_blocks_scores_out_strided_with_out_and_nan():
    rng = np.random.default_rng(26)
    c = make_case(rng, B=3, Hkv=2, GQ=2, D=16, P=8, G=8, max_pages=6, lengths=[48, 20, 0], bad_pages=0.1)
    meta = meta_of(c)
    Nb = c.shape["Nb"]
    q = np.array(c.q)
    q[1, 0, 5] = np.nan  # row 1, KV head 0: NaN scores, +inf in the keep ranges, NaN in scores_out
    big = np.full((3, 3, Nb + 4), 5.0, np.float32)
    so = big[:, ::2, 2:-2]  # strided along B, Hkv and with an offset; unit stride along Nb
    out = np.full((3, 2, 3), 99, np.int32)
    r = prr.select_blocks(q, meta, 3, c.lengths, block_size=8, out=out, scores_out=so)
    assert r is out
    assert np.array_equal(out, prr.select_blocks(q, meta, 3, c.lengths, block_size=8))
    want = prr.block_scores(q, meta, c.lengths, block_size=8)
    assert np.array_equal(bits(so), bits(want))
    assert np.isnan(so[1, 0, :3]).all() and np.all(so[2] == -np.inf)
    assert np.all(big[:, 1] == 5.0) and np.all(big[..., :2] == 5.0) and np.all(big[..., -2:] == 5.0)


# --------------------------------------------------------------------------------------------------
# frameworks, threads, ops
# --------------------------------------------------------------------------------------------------
@needs_torch
def test_torch_in_torch_out_numpy_in_numpy_out():
    rng = np.random.default_rng(30)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=8, max_pages=4)
    m_np = meta_of(c, "numpy")
    assert isinstance(m_np, np.ndarray)
    k, bt, ln, q = c.args("torch")
    m_t = prr.block_metadata(k, bt, ln, block_size=8)
    assert isinstance(m_t, torch.Tensor) and m_t.dtype == torch.float32
    assert np.array_equal(m_t.numpy(), m_np)
    s_np = prr.block_scores(c.q, m_np, c.lengths, block_size=8)
    s_t = prr.block_scores(q, m_t, ln, block_size=8)
    assert isinstance(s_np, np.ndarray) and isinstance(s_t, torch.Tensor) and s_t.dtype == torch.float32
    assert np.array_equal(s_t.numpy(), s_np)
    sel_np = prr.select_blocks(c.q, m_np, 2, c.lengths, block_size=8)
    sel_t = prr.select_blocks(q, m_t, 2, ln, block_size=8)
    assert isinstance(sel_np, np.ndarray) and isinstance(sel_t, torch.Tensor) and sel_t.dtype == torch.int32
    assert np.array_equal(sel_t.numpy(), sel_np)
    r = prr.update_block_metadata(m_t, k, bt, ln, torch.full_like(ln, 16), block_size=8)
    assert r is m_t


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(31)
    c = make_case(rng, B=4, Hkv=8, GQ=2, D=64, P=16, G=16, max_pages=64, lengths="full")
    n0 = gvr._C.get_num_threads()
    try:
        res = []
        for n in (1, 3):
            gvr._C.set_num_threads(n)
            m = meta_of(c)
            res.append((m, prr.block_scores(c.q, m, block_size=16)))
    finally:
        gvr._C.set_num_threads(0 if n0 is None else n0)
    assert np.array_equal(bits(res[0][0]), bits(res[1][0])) and np.array_equal(bits(res[0][1]), bits(res[1][1]))


def test_determinism():
    rng = np.random.default_rng(32)
    c = make_case(rng, B=3, GQ=4, D=24, P=8, G=16, max_pages=8, dtype="float16")
    first = None
    for _ in range(5):
        m = meta_of(c)
        s = prr.block_scores(c.q, m, c.lengths, block_size=16, group_reduce="sum")
        sel = prr.select_blocks(c.q, m, 4, c.lengths, block_size=16)
        now = (bits(m), bits(s), sel)
        if first is None:
            first = now
        assert all(np.array_equal(a, b) for a, b in zip(first, now))


OPS = ["prr_block_metadata", "prr_update_block_metadata", "prr_block_scores", "prr_select_scores"]


@needs_torch
def test_opcheck_cpu():
    rng = np.random.default_rng(33)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=8, max_pages=4)
    k, bt, ln, q = c.args("torch")
    for name in OPS:
        assert hasattr(torch.ops.gvr, name), name
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    torch.library.opcheck(torch.ops.gvr.prr_block_metadata.default, (k, bt, ln, 8))
    torch.library.opcheck(torch.ops.gvr.prr_block_metadata.default, (k, bt, None, 4))
    torch.library.opcheck(torch.ops.gvr.prr_update_block_metadata.default,
                          (meta.clone(), k, bt, ln // 2, ln, 8))
    torch.library.opcheck(torch.ops.gvr.prr_block_scores.default, (q, meta, ln, 8, "max", 1, 2))
    torch.library.opcheck(torch.ops.gvr.prr_block_scores.default, (q, meta, None, 8, "sum", 0, 0))
    s, n = torch.ops.gvr.prr_block_scores(q, meta, ln, 8, "max", 1, 2)
    assert torch.equal(s, prr.block_scores(q, meta, ln, block_size=8, keep_first=1, keep_last=2))
    assert n.tolist() == [[(int(x) + 7) // 8] * 2 for x in ln]
    torch.library.opcheck(torch.ops.gvr.prr_select_scores.default, (q, meta, ln, 8, "max", 1, 2))
    torch.library.opcheck(torch.ops.gvr.prr_select_scores.default, (q, meta, None, 8, "sum", 0, 0))
    s3, n3, raw = torch.ops.gvr.prr_select_scores(q, meta, ln, 8, "sum", 1, 2)
    assert torch.equal(s3, prr.block_scores(q, meta, ln, block_size=8, group_reduce="sum", keep_first=1, keep_last=2))
    assert torch.equal(n3, n)
    assert torch.equal(raw, prr.block_scores(q, meta, ln, block_size=8, group_reduce="sum"))


def _select_step(k, bt, start, end, q, meta):
    prr.update_block_metadata(meta, k, bt, start, end, block_size=8)
    return prr.select_blocks(q * 1.0, meta, 3, end, block_size=8), prr.block_scores(q, meta, end, block_size=8)


def _select_with_scores_out(q, meta, end, so):
    return prr.select_blocks(q, meta, 3, end, block_size=8, group_reduce="sum", init_blocks=1, local_blocks=1,
                             scores_out=so)


@needs_torch
def test_compile_select_blocks_scores_out_matches_eager():
    torch._dynamo.reset()
    rng = np.random.default_rng(35)
    c = make_case(rng, B=3, GQ=2, D=8, P=4, G=8, max_pages=6, bad_pages=0.1)
    k, bt, ln, q = c.args("torch")
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    Nb = c.shape["Nb"]
    so_e, so_c = torch.full((3, 2, Nb), 7.0), torch.full((3, 2, Nb), 7.0)
    want = _select_with_scores_out(q, meta, ln, so_e)
    got = torch.compile(_select_with_scores_out, fullgraph=True, backend="aot_eager")(q, meta, ln, so_c)
    assert torch.equal(got, want)
    assert torch.equal(so_c, so_e)
    assert torch.equal(so_c, prr.block_scores(q, meta, ln, block_size=8, group_reduce="sum"))
    for bad, exc in ((torch.zeros((3, 2, Nb), dtype=torch.float64), TypeError),
                     (torch.zeros((3, 2, Nb + 1)), ValueError), (torch.zeros((3, 1, Nb)), ValueError)):
        torch._dynamo.reset()
        snap = bad.clone()
        with pytest.raises(exc, match=r"\bscores_out\b"):
            torch.compile(_select_with_scores_out, backend="aot_eager")(q, meta, ln, bad)
        assert torch.equal(bad, snap)


@needs_torch
def test_compile_aot_eager_matches_eager():
    torch._dynamo.reset()
    rng = np.random.default_rng(34)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=8, max_pages=6, lengths="full")
    k, bt, _, q = c.args("torch")
    start, end = torch.tensor([3, 9], dtype=torch.int32), torch.tensor([17, 24], dtype=torch.int32)
    m0 = prr.block_metadata(k, bt, start, block_size=8)
    m1 = m0.clone()
    want = _select_step(k, bt, start, end, q, m0)
    got = torch.compile(_select_step, fullgraph=True, backend="aot_eager")(k, bt, start, end, q, m1)
    assert torch.equal(m0, m1)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------
def _raises(exc, name, fn, *args, **kw):
    with pytest.raises(exc, match=rf"\b{re.escape(name)}\b"):
        fn(*args, **kw)


def test_bad_inputs_are_named_and_nothing_is_modified():
    rng = np.random.default_rng(40)
    c = make_case(rng, B=2, GQ=2, D=8, P=4, G=8, max_pages=4)
    k, bt, ln, q = c.k_cache, c.block_table, c.lengths, c.q
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    snap = [x.copy() for x in (k, bt, ln, q, meta)]
    bm, up, bs, sb = prr.block_metadata, prr.update_block_metadata, prr.block_scores, prr.select_blocks
    # block_metadata
    _raises(TypeError, "block_size", bm, k, bt, ln, block_size=None)
    _raises(ValueError, "block_size", bm, k, bt, ln, block_size=0)
    _raises(ValueError, "block_size", bm, k, bt, ln, block_size=6)
    _raises(TypeError, "block_table", bm, k, bt.astype(np.int64), ln, block_size=8)
    _raises(TypeError, "k_cache", bm, k.astype(np.float64), bt, ln, block_size=8)
    _raises(ValueError, "k_cache", bm, k[..., 0], bt, ln, block_size=8)
    _raises(ValueError, "lengths", bm, k, bt, np.array([1, 17], np.int32), block_size=8)
    _raises(ValueError, "lengths", bm, k, bt, np.array([1, -1], np.int32), block_size=8)
    _raises(ValueError, "lengths", bm, k, bt, np.array([1, 2, 3], np.int32), block_size=8)
    _raises(ValueError, "out", bm, k, bt, ln, block_size=8, out=np.empty((2, 2, 3, 2, 8), np.float32))
    _raises(TypeError, "out", bm, k, bt, ln, block_size=8, out=np.empty((2, 2, 2, 2, 8), np.float16))
    # update_block_metadata
    _raises(ValueError, "start", up, meta, k, bt, np.array([0, 17], np.int32), ln, block_size=8)
    _raises(ValueError, "end", up, meta, k, bt, ln, np.array([0, 99], np.int32), block_size=8)
    _raises(ValueError, "meta", up, meta[:, :, :1], k, bt, ln, ln, block_size=8)
    _raises(TypeError, "meta", up, meta.astype(np.float16), k, bt, ln, ln, block_size=8)
    _raises(ValueError, "meta", up, np.zeros_like(meta)[..., ::2], k, bt, ln, ln, block_size=8)
    _raises(TypeError, "start", up, meta, k, bt, None, ln, block_size=8)
    # block_scores / select_blocks
    _raises(ValueError, "group_reduce", bs, q, meta, ln, block_size=8, group_reduce="mean")
    _raises(TypeError, "group_reduce", bs, q, meta, ln, block_size=8, group_reduce=1)
    _raises(ValueError, "keep_first", bs, q, meta, ln, block_size=8, keep_first=-1)
    _raises(TypeError, "keep_last", bs, q, meta, ln, block_size=8, keep_last=1.5)
    _raises(TypeError, "meta", bs, q.astype(np.float16), meta, ln, block_size=8)
    _raises(ValueError, "Hq", bs, q[:, :3], meta, ln, block_size=8)
    _raises(ValueError, "D", bs, q[..., :4], meta, ln, block_size=8)
    _raises(ValueError, "lengths", bs, q, meta, np.array([0, 17], np.int32), block_size=8)
    _raises(TypeError, "out", bs, q, meta, ln, block_size=8, out=np.empty((2, 2, 2), np.float64))
    _raises(ValueError, "k", sb, q, meta, -1, ln, block_size=8)
    _raises(TypeError, "k", sb, q, meta, 1.5, ln, block_size=8)
    _raises(ValueError, "init_blocks", sb, q, meta, 2, ln, block_size=8, init_blocks=-2)
    _raises(TypeError, "local_blocks", sb, q, meta, 2, ln, block_size=8, local_blocks="2")
    so = np.full((2, 2, c.shape["Nb"]), 7, np.float32)
    for o in (np.zeros((2, 2, 3), np.int32), np.zeros((2, 4), np.int32), np.zeros((1, 2, 2), np.int32)):
        _raises(ValueError, "out", sb, q, meta, 2, ln, block_size=8, out=o, scores_out=so)
    _raises(TypeError, "out", sb, q, meta, 2, ln, block_size=8, out=[[0, 1]], scores_out=so)
    assert np.all(so == 7)
    if torch is not None:  # out in another framework than q's: written directly if contiguous, else named
        so = np.full((2, 2, c.shape["Nb"]), 7, np.float32)
        _raises(TypeError, "out", sb, q, meta, 2, ln, block_size=8,
                out=torch.zeros((2, 2, 4), dtype=torch.int32)[..., ::2], scores_out=so)
        assert np.all(so == 7)  # (named before anything is written)
        want = sb(q, meta, 2, ln, block_size=8)
        o = np.full((2, 2, 2), -9, np.int32)
        assert sb(torch.from_numpy(q), torch.from_numpy(meta), 2, torch.from_numpy(ln), block_size=8, out=o) is o
        assert np.array_equal(o, want)
        o = torch.full((2, 2, 2), -9, dtype=torch.int32)
        assert sb(q, meta, 2, ln, block_size=8, out=o) is o and np.array_equal(o.numpy(), want)
    for a, b in zip(snap, (k, bt, ln, q, meta)):
        assert np.array_equal(bits(a), bits(b))


def test_bad_scores_out_is_named_and_nothing_is_modified():
    rng = np.random.default_rng(41)
    c = make_case(rng, B=3, GQ=2, D=8, P=4, G=8, max_pages=4)
    k, bt, ln, q = c.k_cache, c.block_table, c.lengths, c.q
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    Nb = c.shape["Nb"]
    out = np.full((3, 2, 2), 99, np.int32)
    sb = prr.select_blocks
    ro = np.zeros((3, 2, Nb), np.float32)
    ro.flags.writeable = False
    bad = [
        (TypeError, np.zeros((3, 2, Nb), np.float64)),
        (TypeError, np.zeros((3, 2, Nb), np.float16)),
        (TypeError, np.zeros((3, 2, Nb), np.int32)),
        (ValueError, np.zeros((3, 2, Nb + 1), np.float32)),
        (ValueError, np.zeros((2, 2, Nb), np.float32)),
        (ValueError, np.zeros((3, 1, Nb), np.float32)),
        (ValueError, np.zeros((3, 2 * Nb), np.float32)),
        (ValueError, np.zeros((3, 2, 2 * Nb), np.float32)[..., ::2]),  # not unit stride along Nb
        (ValueError, ro),
    ]
    snap = [x.copy() for x in (k, bt, ln, q, meta, out)]
    for exc, so in bad:
        so_snap = so.copy()
        _raises(exc, "scores_out", sb, q, meta, 2, ln, block_size=8, out=out, scores_out=so)
        _raises(exc, "scores_out", sb, q, meta, 2, None, block_size=8, scores_out=so)
        assert np.array_equal(bits(so), bits(so_snap)), "a rejected scores_out was written"
    for a, b in zip(snap, (k, bt, ln, q, meta, out)):
        assert np.array_equal(bits(a), bits(b))
    if torch is not None:
        tq, tm = torch.from_numpy(q), torch.from_numpy(meta)
        _raises(TypeError, "scores_out", sb, tq, tm, 2, block_size=8, scores_out=torch.zeros((3, 2, Nb),
                                                                                            dtype=torch.float64))
        _raises(ValueError, "scores_out", sb, tq, tm, 2, block_size=8, scores_out=torch.zeros((3, 2, Nb - 1)))


# --------------------------------------------------------------------------------------------------
# fp8 (e4m3fn) K caches and metadata
# --------------------------------------------------------------------------------------------------
FP8_PG = [(16, 16), (16, 64), (64, 16), (8, 32), (4, 1), (16, 48)]
FP8_Q = ["bfloat16", "float16"]


def fp8_case(rng, dtype="bfloat16", **kw):
    return make_case(rng, dtype=dtype, kv_dtype=FP8, **kw)


def fp8(codes):
    """a torch float8_e4m3fn tensor over (a copy of) uint8 codes"""
    return torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)).view(torch.float8_e4m3fn)


def fp8_meta_of(c, lengths="case", **kw):
    k, bt, ln, _ = c.args("torch")
    return prr.block_metadata(k, bt, ln if lengths == "case" else lengths, block_size=c.block_size, **kw)


def snapshot(*xs):
    return [(x, bits(x).copy()) for x in xs if x is not None]


def assert_unchanged(snaps, what=""):
    for x, b in snaps:
        assert np.array_equal(bits(x), b), f"{what}: an input was modified"


def fold_codes(rows):
    """(min, max) codes per channel of uint8 code rows [n, D] in totalOrder (n >= 1)"""
    r = E4M3_RANK[np.asarray(rows, np.uint8)]
    return E4M3_BY_RANK[r.min(axis=0)], E4M3_BY_RANK[r.max(axis=0)]


@needs_fp8
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("P,G", FP8_PG, ids=[f"P{p}-G{g}" for p, g in FP8_PG])
def test_fp8_metadata_against_reference(P, G, layout):
    rng = np.random.default_rng(500 + P * 100 + G)
    c = fp8_case(rng, B=5, Hkv=2, D=12, P=P, G=G, max_pages=max(2, 96 // P), bad_pages=0.1, layout=layout,
                 specials=0.15, nans=40)
    k, bt, ln, _ = c.args("torch")
    snaps = snapshot(k, bt, ln)
    m = prr.block_metadata(k, bt, ln, block_size=G)
    assert m.dtype == torch.float8_e4m3fn and tuple(m.shape) == (5, 2, c.shape["Nb"], 2, 12)
    ref = metadata_ref(k, bt, ln, G)
    assert ref.dtype == np.uint8
    assert np.array_equal(bits(m), ref)
    assert_unchanged(snaps, "block_metadata")


@needs_fp8
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_metadata_head_dims(layout):
    rng = np.random.default_rng(501)
    for D in (1, 7, 16, 64, 128, 256):
        c = fp8_case(rng, B=3, Hkv=3, D=D, P=16, G=32, max_pages=4, layout=layout, nans=D // 4)
        m = fp8_meta_of(c)
        assert np.array_equal(bits(m), metadata_ref(c.k_cache, c.block_table, c.lengths, 32)), f"D={D}"


@needs_fp8
def test_fp8_metadata_total_order_by_hand():
    # 10 channels, 1 head, P = G = 4; block 0 = page 0 (4 tokens), block 1 = tokens 4, 5 of page 1
    # (slots 2, 3 past the length hold NaN codes, never read), block 2 = a page out of range: empty
    blk0 = np.array([
        [0x00, 0x80, 0x00, 0x00],  # +0 / -0: min -0, max +0
        [0x80, 0x80, 0x80, 0x80],  # all -0
        [0x08, 0x7F, 0xF0, 0x30],  # +NaN is the max
        [0x08, 0xFF, 0xF0, 0x30],  # -NaN is the min
        [0x7F, 0xFF, 0x00, 0x80],  # both NaNs
        [0x7E, 0xFE, 0x01, 0x81],  # +-448 and the smallest subnormals
        [0x01, 0x81, 0x00, 0x02],  # subnormals and +0
        [0x87, 0x88, 0x07, 0x08],  # the largest subnormals, the smallest normals
        [0x7F, 0x7F, 0x7F, 0x7F],  # all +NaN
        [0xFF, 0xFF, 0xFF, 0xFF],  # all -NaN
    ], np.uint8).T  # [4 tokens, 10 channels]
    want0 = (np.array([0x80, 0x80, 0xF0, 0xFF, 0xFF, 0xFE, 0x81, 0x88, 0x7F, 0xFF], np.uint8),
             np.array([0x00, 0x80, 0x7F, 0x30, 0x7F, 0x7E, 0x02, 0x08, 0x7F, 0xFF], np.uint8))
    page1 = np.array([[0x81] * 10, [0x01] * 10, [0x7F] * 10, [0xFF] * 10], np.uint8)
    page1[1, 3] = 0x80
    want1 = (np.array([0x81] * 10, np.uint8), np.array([0x01] * 3 + [0x80] + [0x01] * 6, np.uint8))
    codes = np.stack([blk0, page1])[:, :, None, :]  # [2, 4, 1, 10]
    k = fp8(codes)
    bt = torch.tensor([[0, 1, -1]], dtype=torch.int32)
    m = prr.block_metadata(k, bt, torch.tensor([6], dtype=torch.int32), block_size=4)
    got = bits(m)[0, 0]  # [3, 2, 10]
    assert np.array_equal(got[0, 0], want0[0]) and np.array_equal(got[0, 1], want0[1])
    assert np.array_equal(got[1, 0], want1[0]) and np.array_equal(got[1, 1], want1[1])
    assert np.all(got[2, 0] == E4M3_EMPTY_MIN) and np.all(got[2, 1] == E4M3_EMPTY_MAX)
    assert np.array_equal(bits(m), metadata_ref(k, bt, np.array([6]), 4))
    assert np.array_equal(got[0, 0], fold_codes(blk0)[0]) and np.array_equal(got[0, 1], fold_codes(blk0)[1])


@needs_fp8
def test_fp8_metadata_empty_blocks_lengths_default_and_out():
    rng = np.random.default_rng(502)
    c = fp8_case(rng, B=3, D=16, P=4, G=8, max_pages=6, lengths=[0, 24, 5], nans=6)
    c.block_table[1, 2:4] = -1  # block 1 of row 1: both its pages out of range
    m = bits(fp8_meta_of(c))
    assert np.all(m[0, :, :, 0] == 0x7F) and np.all(m[0, :, :, 1] == 0xFF)
    assert np.all(m[1, :, 1, 0] == 0x7F) and np.all(m[1, :, 1, 1] == 0xFF)
    assert np.all(m[2, :, 1:, 0] == 0x7F) and np.all(m[2, :, 1:, 1] == 0xFF)
    assert np.array_equal(empty_ref(fp8(m)), (m[..., 0, 0] == 0x7F) & (m[..., 1, 0] == 0xFF))
    assert np.array_equal(m, metadata_ref(c.k_cache, c.block_table, c.lengths, 8))
    k, bt, _, _ = c.args("torch")
    full = prr.block_metadata(k, bt, block_size=8)
    assert np.array_equal(bits(full), metadata_ref(k, bt, None, 8))
    # out: a strided fp8 view, written where it is, nothing else
    Nb = c.shape["Nb"]
    big = torch.full((3, 2, Nb, 3, 40), 0x5A, dtype=torch.uint8)
    out = big.view(torch.float8_e4m3fn)[:, :, :, 1:, 3:19]
    r = prr.block_metadata(k, bt, torch.from_numpy(c.lengths), block_size=8, out=out)
    assert r is out
    assert np.array_equal(bits(out), m)
    assert torch.all(big[:, :, :, 0] == 0x5A) and torch.all(big[..., :3] == 0x5A) and torch.all(big[..., 19:] == 0x5A)


@needs_fp8
@pytest.mark.parametrize("P,G", [(16, 16), (4, 16), (16, 4), (8, 24)], ids=["P16-G16", "P4-G16", "P16-G4", "P8-G24"])
def test_fp8_update_equals_rebuild(P, G):
    rng = np.random.default_rng(503 + P + G)
    c = fp8_case(rng, B=4, D=24, P=P, G=G, max_pages=max(3, 64 // P), bad_pages=0.1, lengths="full", nans=30)
    k, bt, _, _ = c.args("torch")
    snaps = snapshot(k, bt)
    cap = c.shape["max_pages"] * P
    cur = torch.tensor([0, 3, G, cap // 2], dtype=torch.int32)
    meta = prr.block_metadata(k, bt, cur.clone(), block_size=G)
    for step in [1, 1, G - 1, 2, 0, G + 3, 1, 5 * G, cap]:
        new = torch.clamp(cur + torch.tensor([step, step, 1, 2 * step], dtype=torch.int32), max=cap).to(torch.int32)
        r = prr.update_block_metadata(meta, k, bt, cur, new, block_size=G)
        assert r is meta and meta.dtype == torch.float8_e4m3fn
        want = prr.block_metadata(k, bt, new, block_size=G)
        assert np.array_equal(bits(meta), bits(want)), f"step {step}: update != rebuild"
        cur = new
    assert np.array_equal(bits(meta), metadata_ref(k, bt, cur, G))
    assert_unchanged(snaps, "update_block_metadata")


@needs_fp8
def test_fp8_update_merges_in_total_order_and_touches_only_its_blocks():
    rng = np.random.default_rng(504)
    G, D = 8, 16
    c = fp8_case(rng, B=2, D=D, P=4, G=G, max_pages=8, lengths="full", nans=12, specials=0.3)
    k, bt, _, _ = c.args("torch")
    Nb = c.shape["Nb"]
    # a non-empty content: per channel two codes ordered by rank
    pair = np.sort(E4M3_RANK[random_fp8_codes(rng, (2, 2, Nb, 2, D), specials=0.3, nans=20)], axis=3)
    content = E4M3_BY_RANK[pair]
    content[0, :, 0, :, 0] = [0x80, 0x00]  # row 0, block 0, channel 0: (-0, +0), not empty
    content[1, :, 1, :, 0] = [0x00, 0x80]  # row 1, block 1, channel 0: (+0, -0): empty in totalOrder
    content[1, :, 1, 0, 1:] = 0xFE  # ... so its other channels (-448, 448) are not merged
    content[1, :, 1, 1, 1:] = 0x7E
    meta = fp8(content)
    start = torch.tensor([3, 12], dtype=torch.int32)
    end = torch.tensor([13, 21], dtype=torch.int32)
    prr.update_block_metadata(meta, k, bt, start, end, block_size=G)
    got = bits(meta)

    def tok_rows(b, lo, hi):  # codes [n, Hkv, D] of row b's tokens lo..hi-1
        return np.stack([c.codes[c.block_table[b, t // 4], t % 4] for t in range(lo, hi)])

    changed = {(0, 0), (0, 1), (1, 1), (1, 2)}
    merged_matters = []
    for b in range(2):
        for j in range(Nb):
            if (b, j) not in changed:
                assert np.array_equal(got[b, :, j], content[b, :, j]), f"row {b} block {j} touched"
    for h in range(2):
        # row 0, block 0: merged with its content (tokens 3..7)
        mn, mx = fold_codes(np.concatenate([tok_rows(0, 3, 8)[:, h], content[0, h, 0]]))
        assert np.array_equal(got[0, h, 0, 0], mn) and np.array_equal(got[0, h, 0, 1], mx)
        assert E4M3_RANK[got[0, h, 0, 0, 0]] <= E4M3_RANK[0x80]  # the content's -0 took part
        alone = fold_codes(tok_rows(0, 3, 8)[:, h])
        merged_matters.append(not (np.array_equal(mn, alone[0]) and np.array_equal(mx, alone[1])))
        # row 0, block 1: rebuilt from tokens 8..12
        mn, mx = fold_codes(tok_rows(0, 8, 13)[:, h])
        assert np.array_equal(got[0, h, 1, 0], mn) and np.array_equal(got[0, h, 1, 1], mx)
        # row 1, block 1: its content is empty (channel 0): the new tokens 12..15 only
        mn, mx = fold_codes(tok_rows(1, 12, 16)[:, h])
        assert np.array_equal(got[1, h, 1, 0], mn) and np.array_equal(got[1, h, 1, 1], mx)
        # row 1, block 2: rebuilt from tokens 16..20
        mn, mx = fold_codes(tok_rows(1, 16, 21)[:, h])
        assert np.array_equal(got[1, h, 2, 0], mn) and np.array_equal(got[1, h, 2, 1], mx)
    assert any(merged_matters), "the case does not tell a merge from a rebuild"


@needs_fp8
@pytest.mark.parametrize("dtype", FP8_Q)
@pytest.mark.parametrize("D", [1, 8, 13, 64, 200])
@pytest.mark.parametrize("GQ", [1, 4])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_fp8_scores_against_reference(D, GQ, reduce, dtype):
    rng = np.random.default_rng(505 + D * 10 + GQ)
    c = fp8_case(rng, dtype, B=4, Hkv=2, GQ=GQ, D=D, P=8, G=16, max_pages=8, bad_pages=0.1, nans=3)
    k, bt, ln, q = c.args("torch")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    snaps = snapshot(q, meta, ln)
    kw = dict(group_reduce=reduce, keep_first=1, keep_last=2) if reduce == "sum" else dict(group_reduce=reduce)
    s = prr.block_scores(q, meta, ln, block_size=16, **kw)
    assert s.dtype == torch.float32 and tuple(s.shape) == (4, 2, c.shape["Nb"])
    check_scores(s, q, meta, ln, 16, **kw)
    assert_unchanged(snaps, "block_scores")


@needs_fp8
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_scores_are_those_of_the_decoded_metadata(dtype):
    """fp8 metadata scores bit for bit as the same values held in q's dtype (exact there), empty
    blocks as (+inf, -inf)."""
    rng = np.random.default_rng(506)
    c = fp8_case(rng, dtype, B=5, Hkv=2, GQ=3, D=40, P=4, G=8, max_pages=10, bad_pages=0.1, nans=4)
    k, bt, ln, q = c.args("torch")
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    vals = e4m3_decode(fp8_codes(meta))
    emp = empty_ref(meta)
    vals[emp] = np.array([np.inf, -np.inf])[:, None]
    dec = torch.from_numpy(vals).to(q.dtype)
    assert np.array_equal(to_numpy(dec).astype(np.float64)[~emp], vals[~emp], equal_nan=True)  # exact in q's dtype
    for kw in (dict(), dict(group_reduce="sum", keep_first=2, keep_last=1), dict(keep_first=100)):
        s8 = prr.block_scores(q, meta, ln, block_size=8, **kw)
        sd = prr.block_scores(q, dec, ln, block_size=8, **kw)
        assert np.array_equal(nan_bits(s8), nan_bits(sd)), kw
        check_scores(s8, q, meta, ln, 8, **kw)


@needs_fp8
def test_fp8_scores_empty_rule_and_nan_by_hand():
    # channel 0's (min, max) per block; the other channels finite and ordered
    ch0 = [(0x7F, 0xFF), (0x00, 0x80), (0x80, 0x00), (0x01, 0x00), (0x7F, 0x7F), (0xFF, 0xFF), (0xFF, 0x7F),
           (0xFE, 0x7E)]
    kind = ["empty", "empty", "finite", "empty", "nan", "nan", "nan", "finite"]
    rng = np.random.default_rng(507)
    codes = np.sort(E4M3_RANK[random_fp8_codes(rng, (1, 1, 8, 2, 8), specials=0.2)], axis=3)
    codes = E4M3_BY_RANK[codes]
    codes[0, 0, :, :, 0] = ch0
    meta = fp8(codes)
    q = torch.from_numpy(rng.standard_normal((1, 2, 8)).astype(np.float32) + 0.1).to(torch.bfloat16)
    for kw in (dict(), dict(group_reduce="sum")):
        s = prr.block_scores(q, meta, block_size=8, **kw)[0, 0].numpy()
        for j, kd in enumerate(kind):
            if kd == "empty":
                assert s[j] == -np.inf, j
            elif kd == "nan":
                assert np.isnan(s[j]), j
            else:
                assert np.isfinite(s[j]), j
        check_scores(s[None, None], q, meta, None, 8, **kw)
    s = prr.block_scores(q, meta, block_size=8, keep_first=8)[0, 0].numpy()
    assert s.tolist() == [-np.inf if kd == "empty" else np.inf for kd in kind]
    sel = prr.select_blocks(q, meta, 8, block_size=8, init_blocks=0, local_blocks=0, sorted=True)[0, 0].tolist()
    # descending: the finite blocks (2, 7 in score order), the empty ones (-inf, by number), then NaN
    fin = sorted([2, 7], key=lambda j: (-float(prr.block_scores(q, meta, block_size=8)[0, 0, j]), j))
    assert sel == fin + [0, 1, 3] + [4, 5, 6]


@needs_fp8
@pytest.mark.parametrize("dtype", FP8_Q)
@pytest.mark.parametrize("k", [0, 1, 3, 8, 40])
def test_fp8_select_blocks_is_topk_of_the_scores(k, dtype):
    rng = np.random.default_rng(508 + k)
    c = fp8_case(rng, dtype, B=5, Hkv=2, GQ=4, D=16, P=8, G=8, max_pages=8, bad_pages=0.05, nans=2)
    _, _, ln, q = c.args("torch")
    meta = fp8_meta_of(c)
    snaps = snapshot(q, meta, ln)
    Nb = c.shape["Nb"]
    for init, local, reduce in ((1, 2, "max"), (0, 0, "sum"), (3, 1, "max")):
        so = torch.full((5, 2, Nb), 7.0)
        sel = prr.select_blocks(q, meta, k, ln, block_size=8, init_blocks=init, local_blocks=local,
                                group_reduce=reduce, scores_out=so)
        assert sel.shape == (5, 2, k) and sel.dtype == torch.int32
        s = prr.block_scores(q, meta, ln, block_size=8, keep_first=init, keep_last=local, group_reduce=reduce)
        check_scores(s, q, meta, ln, 8, keep_first=init, keep_last=local, group_reduce=reduce)
        raw = prr.block_scores(q, meta, ln, block_size=8, group_reduce=reduce)
        assert np.array_equal(bits(so), bits(raw)), "scores_out is not block_scores without keeps"
        want = select_ref(to_numpy(s), valid_blocks(c.lengths, 5, Nb, 8), k)
        got = np.sort(np.where(to_numpy(sel) < 0, np.iinfo(np.int32).max, to_numpy(sel)), axis=-1)
        got = np.where(got == np.iinfo(np.int32).max, -1, got)
        assert np.array_equal(got, want)
    assert_unchanged(snaps, "select_blocks")


@needs_fp8
@pytest.mark.parametrize("dtype", FP8_Q)
def test_fp8_select_blocks_feed_sparse_attention(dtype):
    from attention_reference import sparse_attention_naive, sparse_attention_ref
    from harness import assert_close

    rng = np.random.default_rng(509 + len(dtype))
    c = fp8_case(rng, dtype, B=3, Hkv=2, GQ=2, D=16, P=8, G=16, max_pages=8, lengths=[64, 37, 1], specials=0.02)
    k, bt, ln, q = c.args("torch")
    v = fp8(random_fp8_codes(rng, tuple(k.shape), specials=0.02))
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    kw = dict(block_table=bt, lengths=ln, block_size=16, k_scale=0.37, v_scale=2.5)
    snaps = snapshot(q, k, v, bt, ln, meta)
    Nb = c.shape["Nb"]
    dense = torch.arange(Nb, dtype=torch.int32).expand(3, 2, Nb).contiguous()
    for sel in (prr.select_blocks(q, meta, 3, ln, block_size=16),
                prr.select_blocks(q, meta, Nb, ln, block_size=16), dense):  # all valid blocks: the whole row
        o, l = gvr.sparse_attention(q, k, v, sel, **kw)
        ro, rl = sparse_attention_ref(q, k, v, sel, **kw)
        no, nl = sparse_attention_naive(q, k, v, sel, **kw, dtype=dtype)
        assert_close(to_numpy(o), ro, no, dtype, what="out")
        assert_close(to_numpy(l), rl, nl, dtype, what="lse")
    assert_unchanged(snaps, "select_blocks / sparse_attention")


@needs_fp8
def test_fp8_results_do_not_depend_on_the_thread_count_and_are_deterministic():
    rng = np.random.default_rng(510)
    c = fp8_case(rng, B=4, Hkv=8, GQ=2, D=64, P=16, G=16, max_pages=32, lengths="full", nans=8)
    k, bt, _, q = c.args("torch")
    n0 = gvr._C.get_num_threads()
    try:
        res = []
        for n in (1, 3, 3):
            gvr._C.set_num_threads(n)
            m = prr.block_metadata(k, bt, block_size=16)
            res.append((bits(m), nan_bits(prr.block_scores(q, m, block_size=16)),
                        prr.select_blocks(q, m, 5, block_size=16, sorted=True).numpy()))
    finally:
        gvr._C.set_num_threads(0 if n0 is None else n0)
    for r in res[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(res[0], r))


@needs_fp8
def test_fp8_opcheck_and_compile():
    rng = np.random.default_rng(511)
    c = fp8_case(rng, B=2, GQ=2, D=8, P=4, G=8, max_pages=4, lengths="full")
    k, bt, ln, q = c.args("torch")
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    # opcheck's test_schema does arithmetic on the inputs, which torch's CPU fp8 lacks ("mul" not
    # implemented for Float8_e4m3fn): the other checks; what the ops mutate is checked by hand below
    tu = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.gvr.prr_block_metadata.default, (k, bt, ln, 8), test_utils=tu)
    torch.library.opcheck(torch.ops.gvr.prr_update_block_metadata.default, (meta.clone(), k, bt, ln // 2, ln, 8),
                          test_utils=tu)
    torch.library.opcheck(torch.ops.gvr.prr_block_scores.default, (q, meta, ln, 8, "max", 1, 2), test_utils=tu)
    torch.library.opcheck(torch.ops.gvr.prr_select_scores.default, (q, meta, ln, 8, "sum", 0, 1), test_utils=tu)
    snaps = snapshot(k, bt, ln, q, meta)
    m2 = meta.clone()
    torch.ops.gvr.prr_update_block_metadata(m2, k, bt, ln // 2, ln, 8)
    torch.ops.gvr.prr_block_scores(q, meta, ln, 8, "max", 1, 2)
    torch.ops.gvr.prr_select_scores(q, meta, ln, 8, "sum", 0, 1)
    assert_unchanged(snaps, "the ops")
    assert np.array_equal(bits(torch.ops.gvr.prr_block_metadata(k, bt, ln, 8)), bits(meta))
    assert np.array_equal(bits(m2), bits(meta))  # meta of lengths ln, updated from ln // 2 to ln: unchanged
    torch._dynamo.reset()
    start, end = torch.tensor([3, 9], dtype=torch.int32), torch.tensor([11, 16], dtype=torch.int32)
    m0 = prr.block_metadata(k, bt, start, block_size=8)
    m1 = m0.clone()
    want = _select_step(k, bt, start, end, q, m0)
    got = torch.compile(_select_step, fullgraph=True, backend="aot_eager")(k, bt, start, end, q, m1)
    assert np.array_equal(bits(m0), bits(m1))
    for g, w in zip(got, want):
        assert np.array_equal(bits(g), bits(w))


@needs_fp8
def test_fp8_bad_inputs_are_named_and_nothing_is_modified():
    rng = np.random.default_rng(512)
    c = fp8_case(rng, B=2, GQ=2, D=8, P=4, G=8, max_pages=4)
    k, bt, ln, q = c.args("torch")
    meta = prr.block_metadata(k, bt, ln, block_size=8)
    Nb = meta.shape[2]
    out = torch.full((2, 2, 2), 99, dtype=torch.int32)
    so = torch.full((2, 2, Nb), 7.0)
    snaps = snapshot(k, bt, ln, q, meta, out, so)
    bm, up, bs, sb = prr.block_metadata, prr.update_block_metadata, prr.block_scores, prr.select_blocks
    m16 = torch.zeros(tuple(meta.shape), dtype=torch.float16)  # neither q's dtype (bfloat16) nor fp8
    m_bf = torch.zeros(tuple(meta.shape), dtype=torch.bfloat16)
    for bad in (m16, meta.view(torch.float8_e5m2), meta.view(torch.uint8), meta.view(torch.int8)):
        _raises(TypeError, "meta", bs, q, bad, ln, block_size=8)
        _raises(TypeError, "meta", bs, q.float(), bad, ln, block_size=8)
        _raises(TypeError, "meta", sb, q, bad, 2, ln, block_size=8, out=out)
        _raises(TypeError, "meta", sb, q, bad, 2, ln, block_size=8, scores_out=so)
    _raises(TypeError, "meta", bs, q.half(), m_bf, ln, block_size=8)  # bfloat16 meta under float16 q
    # the metadata of an fp8 cache is fp8: update / out in another dtype are refused
    _raises(TypeError, "meta", up, m_bf.clone(), k, bt, ln, ln, block_size=8)
    _raises(TypeError, "meta", up, meta.clone(), k.view(torch.uint8).to(torch.bfloat16), bt, ln, ln, block_size=8)
    _raises(TypeError, "out", bm, k, bt, ln, block_size=8, out=m_bf.clone())
    _raises(TypeError, "k_cache", bm, k.view(torch.float8_e5m2), bt, ln, block_size=8)
    _raises(TypeError, "q", bs, q.to(torch.float8_e4m3fn), meta, ln, block_size=8)
    _raises(ValueError, "meta", up, meta[:, :, :1].clone(), k, bt, ln, ln, block_size=8)
    assert_unchanged(snaps, "rejected calls")
