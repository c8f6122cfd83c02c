"""gvr.sparse_attention, gvr.merge_states(_in_place) and gvr.prr.repair / missed / finalize on the CPU,
against the independent float64 NumPy reference of attention_reference.py.

Every float result is held to harness.assert_close (flash-attention's rule: factor 2 x the error of
the same math run naively in the input precision, plus one ulp of that precision at the reference's
scale; float32 inputs: float32 naive math; bfloat16: float32 math on bfloat16 values). lse is compared
the same way (float64 reference lse). Empty states are exact: out 0, lse -inf.

bfloat16 / float16 run through torch CPU tensors (NumPy has no bfloat16); float32 through NumPy.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import gvr
from attention_reference import (
    check_state, dense_bruteforce, finalize_naive, finalize_ref, make_case, merge_naive, merge_ref, missed_ref,
    random_indices, to_numpy,
)
from harness import assert_close, round_to, torch_or_none
from reference import same_bits

torch = torch_or_none()
needs_torch = pytest.mark.skipif(torch is None, reason="bfloat16 / float16 CPU inputs and torch ops need torch")
NEG_INF = -np.inf


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def fw_of(dtype):
    """NumPy for float32 (and float16), torch for bfloat16."""
    return "torch" if dtype == "bfloat16" else "numpy"


def attend(case, fw=None, **kw):
    q, k, v, idx, akw = case.args(fw or fw_of(case.dtype))
    return gvr.sparse_attention(q, k, v, idx, **akw, **kw)


def float32_state(B, Hq, D, fw="numpy", empty=True, rng=None):
    """An attention state (out float32 [B, Hq, D], lse float32 [B, Hq]): empty or random."""
    if empty:
        o, l = np.zeros((B, Hq, D), np.float32), np.full((B, Hq), NEG_INF, np.float32)
    else:
        o = rng.standard_normal((B, Hq, D)).astype(np.float32)
        l = (rng.standard_normal((B, Hq)) * 3).astype(np.float32)
    if fw == "torch":
        return torch.from_numpy(o), torch.from_numpy(l)
    return o, l


# --------------------------------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_matches_dense_bruteforce(paged, layout):
    rng = np.random.default_rng(7)
    for P, G in ((1, 1), (16, 1), (16, 64), (64, 16), (128, 128)) if paged else ((1, 1), (16, 1), (64, 1)):
        c = make_case(rng, B=3, Hq=4, Hkv=2, D=8, P=P, block_size=G, paged=paged, n=6, Hsel=2, layout=layout,
                      combined=P == 16, dup=0.2, bad_pages=paged, oob=0.2, pad=0.2)
        o, l = c.ref()
        o2, l2 = dense_bruteforce(c.q, c.k, c.v, c.indices, c.lengths, c.block_table, c.block_size)
        assert np.array_equal(l == NEG_INF, l2 == NEG_INF)
        assert np.allclose(o, o2, rtol=0, atol=1e-12)
        assert np.allclose(l[l > NEG_INF], l2[l2 > NEG_INF], rtol=0, atol=1e-12)


def test_reference_duplicates_count_twice():
    rng = np.random.default_rng(3)
    c = make_case(rng, B=1, Hq=2, Hkv=1, D=8, paged=False, n=1, pad=0, oob=0)
    x = int(c.indices[0, 0, 0])
    o1, l1 = c.ref(np.array([[[x]]], np.int32))
    o2, l2 = c.ref(np.array([[[x, x]]], np.int32))
    assert np.allclose(o1, o2) and np.allclose(l2, l1 + math.log(2.0))


# --------------------------------------------------------------------------------------------------
# sparse_attention: the coverage grid
# --------------------------------------------------------------------------------------------------

PAGE_BLOCK = [(P, G, True) for P in (1, 16, 64, 128) for G in (1, 16, 64, 128)] + \
             [(P, 1, False) for P in (1, 16, 64, 128)] + \
             [(48, 24, True), (24, 48, True), (12, 36, True), (48, 1, False)]  # sizes that are not powers of two


@pytest.mark.parametrize("P,G,paged", PAGE_BLOCK,
                         ids=[f"{'bt' if p else 'slots'}-P{P}-G{G}" for P, G, p in PAGE_BLOCK])
def test_page_and_block_sizes(P, G, paged):
    rng = np.random.default_rng(P * 1000 + G + paged)
    n = 6 if G >= 64 else 24
    for Hsel in (1, 2):
        c = make_case(rng, B=3, Hq=8, Hkv=2, D=64, P=P, block_size=G, paged=paged, n=n, Hsel=Hsel, dup=0.1,
                      bad_pages=paged and P >= 16)
        out, lse = attend(c)
        assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (3, 8, 64)
        assert lse.dtype == np.float32 and lse.shape == (3, 8)
        check_state(c, out, lse, what=f"P={P} G={G} paged={paged} Hsel={Hsel}")


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_torch)])
@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_head_dims_and_layouts(D, layout, combined, dtype):
    rng = np.random.default_rng(D)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=D, P=16, block_size=16, n=5, Hsel=2, layout=layout, combined=combined,
                  dtype=dtype, q_padded=True)
    out, lse = attend(c)
    check_state(c, out, lse, what=f"D={D} {layout} combined={combined} {dtype}")
    c2 = make_case(rng, B=2, Hq=4, Hkv=2, D=D, P=16, paged=False, n=40, Hsel=1, layout=layout, combined=combined,
                   dtype=dtype)
    out, lse = attend(c2)
    check_state(c2, out, lse, what=f"slots D={D} {layout} combined={combined} {dtype}")


@pytest.mark.parametrize("Hsel", ["1", "Hkv"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_gqa_and_selection_heads(gqa, Hsel):
    rng = np.random.default_rng(gqa)
    Hkv = 2 if gqa == 8 else 3
    for paged in (True, False):
        c = make_case(rng, B=3, Hq=gqa * Hkv, Hkv=Hkv, D=64, P=16, block_size=1 if not paged else 4,
                      paged=paged, n=20, Hsel=1 if Hsel == "1" else Hkv)
        out, lse = attend(c)
        check_state(c, out, lse, what=f"gqa={gqa} Hsel={Hsel} paged={paged}")


@pytest.mark.parametrize("B", [1, 3, 64])
def test_batch_sizes(B):
    rng = np.random.default_rng(B)
    c = make_case(rng, B=B, Hq=4, Hkv=1, D=64, P=16, block_size=16, n=4, seq_len=128)
    out, lse = attend(c)
    check_state(c, out, lse, what=f"B={B}")


@pytest.mark.parametrize("n", [0, 1, 4096])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_selection_sizes(n, paged):
    rng = np.random.default_rng(n + 1)
    if paged:
        G = 1 if n == 4096 else 16
        c = make_case(rng, B=2, Hq=4, Hkv=1, D=64, P=64, block_size=G, n=n, seq_len=5000 if n == 4096 else 256,
                      pad=0.02 if n else 0, oob=0.02 if n else 0)
    else:
        c = make_case(rng, B=2, Hq=4, Hkv=1, D=64, P=64, paged=False, n=n, extra_pages=70,
                      pad=0.02 if n else 0, oob=0.02 if n else 0)
    out, lse = attend(c)
    assert out.shape == (2, 4, 64) and lse.shape == (2, 4)
    check_state(c, out, lse, what=f"n={n}")
    if n == 0:
        assert np.all(out == 0) and np.all(lse == NEG_INF)


@needs_torch
@pytest.mark.parametrize("out_dtype", ["q", "float32"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_dtypes_and_out_dtype(fw, dtype, out_dtype):
    if fw == "numpy" and dtype == "bfloat16":
        pytest.skip("NumPy has no bfloat16")
    rng = np.random.default_rng(11)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=128, P=16, block_size=32, n=8, Hsel=2, dtype=dtype, q_scale=2.0)
    q, k, v, idx, kw = c.args(fw)
    if out_dtype == "q":
        out, lse = gvr.sparse_attention(q, k, v, idx, **kw)
        want = dtype
    else:
        o = np.empty((3, 8, 128), np.float32) if fw == "numpy" else torch.empty(3, 8, 128)
        out, lse = gvr.sparse_attention(q, k, v, idx, out=o, **kw)
        assert out is o
        want = "float32"
    if fw == "numpy":
        assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
        assert out.dtype == np.dtype(want) and lse.dtype == np.float32
    else:
        assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor) and out.device.type == "cpu"
        assert out.dtype == getattr(torch, want) and lse.dtype == torch.float32
    check_state(c, out, lse, what=f"{fw} {dtype} out={want}")


def test_out_and_lse_strides():
    rng = np.random.default_rng(5)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=6)
    q, k, v, idx, kw = c.args("numpy")
    lse_t = np.full((8, 3), 7.0, np.float32)
    lse_v = lse_t.T
    out_big = np.full((3, 9, 80), 7.0, np.float32)
    out = out_big[:, 1:, 8:72]
    r_out, r_lse = gvr.sparse_attention(q, k, v, idx, out=out, lse=lse_v, **kw)
    assert r_out is out and r_lse is lse_v
    check_state(c, out, lse_t.T, what="strided out, transposed lse")
    assert np.all(out_big[:, 0] == 7.0) and np.all(out_big[:, :, :8] == 7.0) and np.all(out_big[:, :, 72:] == 7.0)


@needs_torch
def test_torch_lse_transposed_and_outputs_in_torch():
    rng = np.random.default_rng(6)
    c = make_case(rng, B=3, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=6, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch")
    lse = torch.full((4, 3), 5.0).t()
    out, r_lse = gvr.sparse_attention(q, k, v, idx, lse=lse, **kw)
    assert r_lse is lse and isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    check_state(c, out, lse, what="torch transposed lse")


def test_empty_rows_and_heads():
    rng = np.random.default_rng(8)
    c = make_case(rng, B=4, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=4, Hsel=2, lengths=np.array([0, 40, 64, 64]),
                  seq_len=64, pad=0, oob=0)
    idx = c.indices.copy()
    idx[1, :] = -1  # row 1: all padding
    idx[2, 0] = [2**31 - 1, 4, 1000, -5]  # row 2, KV head 0: only out-of-range / negative entries
    c = c.with_indices(idx)
    out, lse = attend(c)
    check_state(c, out, lse, what="empty rows")
    assert np.all(lse[0] == NEG_INF) and np.all(out[0] == 0)  # length 0
    assert np.all(lse[1] == NEG_INF) and np.all(out[1] == 0)
    assert np.all(lse[2, :2] == NEG_INF) and np.all(out[2, :2] == 0) and np.all(np.isfinite(lse[2, 2:]))


def test_padding_anywhere_and_out_of_range_entries():
    rng = np.random.default_rng(9)
    for G in (1, 128):  # x * G past INT32_MAX for huge x: no overflow, no read
        c = make_case(rng, B=2, Hq=4, Hkv=1, D=64, P=64, block_size=G, n=6, seq_len=4 * max(G, 64), pad=0, oob=0)
        nblocks = c.n_entries_valid()
        base = c.indices[:, 0, :3]
        rows = []
        for b in range(2):
            e = list(base[b])
            rows.append([-1, e[0], -1, 2**31 - 1, e[1], nblocks, 2**24, -(2**31), e[2], -1, 16777216 + 3, -1])
        idx = np.array(rows, np.int32)[:, None, :]
        cc = c.with_indices(idx)
        out, lse = attend(cc)
        check_state(cc, out, lse, what=f"padding/out of range G={G}")
        compact = c.with_indices(base[:, None, :])
        o2, l2 = attend(compact)
        check_state(compact, o2, l2, what="compact")
        # both equal the same reference; the values agree to rounding
        assert np.allclose(out, o2, rtol=1e-5, atol=1e-6)


def test_pages_out_of_range_in_the_table_are_skipped():
    rng = np.random.default_rng(10)
    c = make_case(rng, B=3, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=8, bad_pages=True, lengths="full", pad=0, oob=0)
    bt = c.block_table.copy()
    bt[:, 0] = -1
    bt[:, 1] = c.num_pages
    bt[0, 2] = 2**31 - 1
    c.block_table = bt
    out, lse = attend(c)
    check_state(c, out, lse, what="bad pages")


def test_duplicated_entries_count_twice():
    rng = np.random.default_rng(12)
    for paged in (True, False):
        c = make_case(rng, B=2, Hq=4, Hkv=1, D=64, P=16, block_size=16 if paged else 1, paged=paged, n=3, pad=0,
                      oob=0, lengths="full")
        idx = c.indices
        dup = np.concatenate([idx, idx[:, :, :1]], axis=2)  # the first entry twice
        cd = c.with_indices(dup)
        out, lse = attend(cd)
        check_state(cd, out, lse, what="duplicates")
        o1, l1 = attend(c)
        assert not np.allclose(l1, lse), "a duplicated entry must count twice"
        single = c.with_indices(idx[:, :, :1])
        _, ls = single.ref()
        both = np.logaddexp(c.ref()[1], ls)
        assert np.allclose(lse, both, rtol=0, atol=1e-5)


def test_scale_argument():
    rng = np.random.default_rng(13)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=6, scale=0.37)
    out, lse = attend(c)
    check_state(c, out, lse, what="scale=0.37")
    d = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=6)
    o1, l1 = attend(d)
    o2, l2 = attend(d, scale=1.0 / math.sqrt(64))
    assert same_bits(o1, o2) and same_bits(l1, l2)


def test_lengths_default_is_the_whole_table():
    rng = np.random.default_rng(14)
    c = make_case(rng, B=3, Hq=4, Hkv=1, D=64, P=16, block_size=8, n=10, lengths="none")
    out, lse = attend(c)
    check_state(c, out, lse, what="lengths=None")
    full = make_case(np.random.default_rng(14), B=3, Hq=4, Hkv=1, D=64, P=16, block_size=8, n=10, lengths="none")
    full.lengths = np.full(3, full.block_table.shape[1] * 16, np.int32)
    o2, l2 = attend(full)
    assert same_bits(out, o2) and same_bits(lse, l2)


@needs_torch
def test_float16_numpy_and_torch_agree_bit_for_bit():
    rng = np.random.default_rng(15)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=6, dtype="float16")
    o1, l1 = attend(c, fw="numpy")
    o2, l2 = attend(c, fw="torch")
    assert isinstance(o1, np.ndarray) and isinstance(o2, torch.Tensor)
    assert same_bits(o1, o2.numpy()) and same_bits(l1, l2.numpy())


# --------------------------------------------------------------------------------------------------
# repair (accumulate) and partials
# --------------------------------------------------------------------------------------------------


def _split_disjoint(rng, idx):
    """Two selections A, B with disjoint entries whose union (concatenated) is idx's entries."""
    n = idx.shape[2]
    m = rng.random(n) < 0.5
    return np.ascontiguousarray(idx[:, :, m]), np.ascontiguousarray(idx[:, :, ~m])


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_torch)])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_repair_twice_equals_attention_over_the_union(paged, dtype):
    rng = np.random.default_rng(16)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16 if paged else 1, paged=paged, n=16, Hsel=2,
                  dtype=dtype, pad=0.1, oob=0.05)
    A, Bsel = _split_disjoint(rng, c.indices)
    union = np.concatenate([A, Bsel], axis=2)
    fw = fw_of(dtype)
    for start in ("empty", "attention(A)"):
        q, k, v, _, kw = c.args(fw)
        conv = (lambda a: a) if fw == "numpy" else torch.from_numpy
        if start == "empty":
            out, lse = float32_state(3, 8, 64, fw)
            r = gvr.prr.repair(out, lse, q, k, v, conv(A), **kw)
            assert r[0] is out and r[1] is lse
        else:
            o = np.empty((3, 8, 64), np.float32) if fw == "numpy" else torch.empty(3, 8, 64)
            out, lse = gvr.sparse_attention(q, k, v, conv(A), out=o, **kw)
        gvr.prr.repair(out, lse, q, k, v, conv(Bsel), **kw)
        # naive: the same two-step math in the input precision
        na = c.naive(A)
        nb = c.naive(Bsel)
        no, nl = merge_naive(na[0], na[1], nb[0], nb[1])
        ro, rl = c.ref(union)
        assert_close(to_numpy(out), ro, no, dtype, what=f"repair {start} out")
        assert_close(to_numpy(lse), rl, nl, dtype, what=f"repair {start} lse")


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_repair_with_an_empty_selection_is_bit_identical(paged):
    rng = np.random.default_rng(17)
    c = make_case(rng, B=3, Hq=4, Hkv=2, D=64, P=16, block_size=16 if paged else 1, paged=paged, n=4)
    q, k, v, _, kw = c.args("numpy")
    out, lse = float32_state(3, 4, 64, rng=rng, empty=False)
    lse[0, 1] = NEG_INF
    out[0, 1] = 0
    out[1, 2] = -0.0
    o0, l0 = out.copy(), lse.copy()
    big = 10 ** 6
    for sel in (np.zeros((3, 1, 0), np.int32), np.full((3, 2, 5), -1, np.int32),
                np.array([[[big, 2**31 - 1, -7]]] * 3, np.int32)):
        gvr.prr.repair(out, lse, q, k, v, sel, **kw)
        assert same_bits(out, o0) and same_bits(lse, l0), sel.shape


@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_partials_are_each_entry_alone(paged, Hsel):
    rng = np.random.default_rng(18 + Hsel)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=8 if paged else 1, paged=paged, n=10, Hsel=Hsel,
                  dup=0.1)
    q, k, v, idx, kw = c.args("numpy")
    po = np.full((2, 4, 10, 64), 9.0, np.float32)
    pl = np.full((2, 4, 10), 9.0, np.float32)
    out, lse = gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
    check_state(c, out, lse, what="with partials")
    rpo, rpl = c.partials_ref()
    npo, npl = c.partials_naive()
    assert_close(po, rpo, npo, "float32", what="part_out")
    assert_close(pl, rpl, npl, "float32", what="part_lse")
    assert np.all(po[rpl == NEG_INF] == 0)


@needs_torch
def test_partials_bfloat16_strided():
    rng = np.random.default_rng(19)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=6, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch")
    rpo, rpl = c.partials_ref()
    npo, npl = c.partials_naive()
    po = torch.zeros(2, 4, 7, 64)[:, :, 1:]  # strided entries of part_out
    pl = torch.zeros(2, 4, 6)
    gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
    assert_close(po.numpy(), rpo, npo, "bfloat16", what="part_out")
    assert_close(pl.numpy(), rpl, npl, "bfloat16", what="part_lse")
    # part_lse with a non-unit stride along n: honoured, or a ValueError naming it (never wrong values)
    po = torch.zeros(2, 4, 6, 64)
    pl = torch.full((6, 2, 4), 7.0).permute(1, 2, 0)
    try:
        gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
    except ValueError as e:
        assert "part_lse" in str(e), e
        assert torch.all(pl == 7.0) and torch.all(po == 0)
    else:
        assert_close(po.numpy(), rpo, npo, "bfloat16", what="part_out (permuted part_lse)")
        assert_close(pl.numpy(), rpl, npl, "bfloat16", what="part_lse permuted")


# --------------------------------------------------------------------------------------------------
# missed, finalize, exact mode
# --------------------------------------------------------------------------------------------------


def _missed(sel, pred, **kw):
    return gvr.prr.missed(np.asarray(sel, np.int32), np.asarray(pred, np.int32), **kw)


def test_missed_random_against_reference():
    rng = np.random.default_rng(20)
    for Hp in (1, 3):
        sel = random_indices(rng, 4, 3, 50, 80, pad=0.1, oob=0.05, dup=0.05, distinct=False)
        pred = random_indices(rng, 4, Hp, 40, 80, pad=0.1, dup=0.05, distinct=False)
        got = _missed(sel, pred)
        assert isinstance(got, np.ndarray) and got.dtype == np.int32 and got.shape == sel.shape
        assert np.array_equal(got, missed_ref(sel, pred))


def test_missed_counts():
    """counts: [hits, selected entries >= 0] of the call (overwritten), then += into [2:4]; hits =
    selected entries >= 0 minus the missed ones (an entry listed twice counts twice)."""
    rng = np.random.default_rng(22)
    counts = np.array([7, 7, 100, 200], np.int64)
    total = [100, 200]
    for Hp in (1, 3, 3):
        sel = random_indices(rng, 4, 3, 50, 80, pad=0.1, oob=0.05, dup=0.05, distinct=False)
        pred = random_indices(rng, 4, Hp, 40, 80, pad=0.1, dup=0.05, distinct=False)
        want = missed_ref(sel, pred)
        got = _missed(sel, pred, counts=counts)
        assert np.array_equal(got, want)
        n_sel = int(np.count_nonzero(sel >= 0))
        hits = n_sel - int(np.count_nonzero(want >= 0))
        total[0] += hits
        total[1] += n_sel
        assert counts.tolist() == [hits, n_sel] + total
    _missed(np.zeros((2, 3, 0), np.int32), [[[1]], [[2]]], counts=counts)  # an empty selection: 0 of 0
    assert counts.tolist() == [0, 0] + total


def test_missed_edge_cases():
    sel = np.array([[[5, -1, 3, 7, -1, 2]]], np.int32)
    assert _missed(sel, np.zeros((1, 1, 0), np.int32)).tolist() == [[[5, 3, 7, 2, -1, -1]]]  # n_pred 0
    assert _missed(sel, [[[2, 3, 5, 7]]]).tolist() == [[[-1] * 6]]  # all predicted
    assert _missed(sel, [[[-1, -1]]]).tolist() == [[[5, 3, 7, 2, -1, -1]]]  # -1 in both: -1 never "missed"
    assert _missed(np.zeros((2, 3, 0), np.int32), [[[1]], [[2]]]).shape == (2, 3, 0)  # empty selection
    # Hp = 1 broadcast over H = 2
    sel2 = np.array([[[1, 2, 3], [4, 5, 6]]], np.int32)
    assert _missed(sel2, [[[2, 5]]]).tolist() == [[[1, 3, -1], [4, 6, -1]]]
    assert _missed(sel2, [[[2], [5]]]).tolist() == [[[1, 3, -1], [4, 6, -1]]]
    assert _missed(sel2, [[[5], [2]]]).tolist() == [[[1, 2, 3], [4, 5, 6]]]
    # out=
    out = np.full((1, 2, 3), 99, np.int32)
    r = _missed(sel2, [[[1, 6]]], out=out)
    assert r is out and out.tolist() == [[[2, 3, -1], [4, 5, -1]]]


def test_finalize_edge_cases():
    rng = np.random.default_rng(21)
    B, Hq, n, D = 1, 2, 5, 8
    po = rng.standard_normal((B, Hq, n, D)).astype(np.float32)
    pl = rng.standard_normal((B, Hq, n)).astype(np.float32)
    pred = np.array([[[4, 9, 4, -1, 7]]], np.int32)
    for sel, what in ((np.array([[[1, 2]]], np.int32), "none predicted"),
                      (np.zeros((1, 1, 0), np.int32), "empty selection"),
                      (np.array([[[4, 7, 9]]], np.int32), "all"),
                      (np.array([[[4, -1]]], np.int32), "duplicate 4: first occurrence only")):
        out, lse = gvr.prr.finalize((po, pl), pred, sel)
        assert out.dtype == np.float32 and out.shape == (B, Hq, D) and lse.shape == (B, Hq)
        ro, rl = finalize_ref(po, pl, pred, sel)
        no, nl = finalize_naive(po, pl, pred, sel)
        assert_close(out, ro, no, "float32", what=what)
        assert_close(lse, rl, nl, "float32", what=what)
    out, lse = gvr.prr.finalize((po, pl), pred, np.array([[[4]]], np.int32))
    assert same_bits(out[0], po[0, :, 0]) and same_bits(lse[0], pl[0, :, 0])  # one partial: exactly it
    out, lse = gvr.prr.finalize((po, pl), pred, np.array([[[1]]], np.int32))
    assert np.all(out == 0) and np.all(lse == NEG_INF)


@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_finalize_then_repair_missed_equals_attention(paged, Hsel):
    rng = np.random.default_rng(22 + Hsel + 2 * paged)
    for trial in range(3):
        c = make_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=8 if paged else 1, paged=paged, n=1, Hsel=Hsel,
                      seq_len=256)
        valid = c.n_entries_valid()
        n_pred, n_sel = 12, 10
        pred = random_indices(rng, 3, Hsel, n_pred, valid, pad=0.15, oob=0.05, dup=0.1)  # duplicates: first counts
        sel = np.empty((3, Hsel, n_sel), np.int32)
        for b in range(3):
            for s in range(Hsel):  # distinct entries, about half of them predicted
                p = sorted({int(x) for x in pred[b, s] if 0 <= x < valid})
                pick = list(rng.choice(p, size=min(len(p), n_sel // 2), replace=False)) if trial < 2 else []
                fresh = [x for x in rng.permutation(valid) if x not in p][:n_sel - len(pick)]
                row = pick + fresh
                assert len(row) == n_sel
                rng.shuffle(row)
                sel[b, s] = row
        if trial == 1:
            sel[0, 0, :3] = -1
        q, k, v, _, kw = c.args("numpy")
        po = np.empty((3, 8, n_pred, 64), np.float32)
        pl = np.empty((3, 8, n_pred), np.float32)
        gvr.sparse_attention(q, k, v, pred, partials=(po, pl), **kw)
        out, lse = gvr.prr.finalize((po, pl), pred, sel)
        miss = gvr.prr.missed(sel, pred)
        assert np.array_equal(miss, missed_ref(sel, pred))
        gvr.prr.repair(out, lse, q, k, v, miss, **kw)
        # naive: the same chain in float32
        npo, npl = c.partials_naive(pred)
        fo, fl = finalize_naive(npo, npl, pred, sel)
        mo, ml = c.naive(miss)
        no, nl = merge_naive(fo, fl, mo, ml)
        ro, rl = c.ref(sel)
        assert_close(out, ro, no, "float32", what=f"exact mode trial {trial} out")
        assert_close(lse, rl, nl, "float32", what=f"exact mode trial {trial} lse")


# --------------------------------------------------------------------------------------------------
# merge_states
# --------------------------------------------------------------------------------------------------


def _states(rng, shape, dtype="float32", empty_frac=0.0):
    o = round_to(rng.standard_normal(shape), dtype)
    l = (rng.standard_normal(shape[:-1]) * 4).astype(np.float32)
    if empty_frac:
        m = rng.random(shape[:-1]) < empty_frac
        l[m] = NEG_INF
        o[m] = 0
    return o, l


def _as(fw, a, dtype):
    if fw == "numpy":
        return a.astype(dtype)
    return torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float16", pytest.param("bfloat16", marks=needs_torch)])
@pytest.mark.parametrize("shape", [(5, 6, 64), (6, 128)], ids=["BHD", "HD"])
def test_merge_random(shape, dtype):
    rng = np.random.default_rng(23)
    fw = fw_of(dtype)
    oa, la = _states(rng, shape, dtype, 0.2)
    ob, lb = _states(rng, shape, dtype, 0.2)
    out, lse = gvr.merge_states(_as(fw, oa, dtype), la, _as(fw, ob, dtype), lb) if fw == "numpy" else \
        gvr.merge_states(_as(fw, oa, dtype), torch.from_numpy(la), _as(fw, ob, dtype), torch.from_numpy(lb))
    assert tuple(out.shape) == shape and tuple(lse.shape) == shape[:-1]
    ro, rl = merge_ref(oa, la, ob, lb)
    no, nl = merge_naive(oa, la, ob, lb)
    if dtype != "float32":  # the naive result in the values' precision
        no = round_to(no, dtype)
    assert_close(to_numpy(out), ro, no, dtype, what="merge out")
    assert_close(to_numpy(lse), rl, nl, "float32", what="merge lse")


def test_merge_both_sides_empty():
    B, H, D = 2, 3, 16
    z, ninf = np.zeros((B, H, D), np.float32), np.full((B, H), NEG_INF, np.float32)
    junk = np.full((B, H, D), 5.0, np.float32)
    for va, vb in ((z, z), (junk, junk)):
        out, lse = gvr.merge_states(va, ninf, vb, ninf)
        assert np.all(out == 0) and np.all(lse == NEG_INF) and not np.isnan(out).any()
    for base in ("e", "2"):
        out, lse = gvr.merge_states(z, ninf, z, ninf, lse_base=base)
        assert np.all(out == 0) and np.all(lse == NEG_INF)


@pytest.mark.parametrize("base", ["e", "2"])
def test_merge_one_side_empty_is_the_other_exactly(base):
    rng = np.random.default_rng(24)
    oa, la = _states(rng, (3, 4, 64))
    oa, la = oa.astype(np.float32), la
    ninf = np.full((3, 4), NEG_INF, np.float32)
    junk = rng.standard_normal((3, 4, 64)).astype(np.float32)  # an empty side's values are ignored
    for o, l in (gvr.merge_states(oa, la, junk, ninf, lse_base=base),):
        assert same_bits(o, oa) and same_bits(l, la)
    o, l = gvr.merge_states(junk, ninf, oa, la, lse_base=base)
    assert same_bits(o, oa) and same_bits(l, la)


def test_merge_nan_and_inf_lse_propagate_as_nan():
    o = np.ones((1, 3, 4), np.float32)
    la = np.array([[np.inf, np.nan, 0.0]], np.float32)
    lb = np.array([[0.0, 0.0, np.nan]], np.float32)
    out, lse = gvr.merge_states(o, la, o, lb)
    assert np.isnan(lse).all()


def test_merge_aliasing_and_in_place():
    rng = np.random.default_rng(25)
    oa, la = _states(rng, (4, 3, 64))
    ob, lb = _states(rng, (4, 3, 64), empty_frac=0.3)
    oa, ob = oa.astype(np.float32), ob.astype(np.float32)
    want_o, want_l = gvr.merge_states(oa, la, ob, lb)
    # out = out_a
    a, al = oa.copy(), la.copy()
    r = gvr.merge_states(a, al, ob, lb, out=a, lse=al)
    assert r[0] is a and r[1] is al and same_bits(a, want_o) and same_bits(al, want_l)
    # out = out_b
    b, bl = ob.copy(), lb.copy()
    r = gvr.merge_states(oa, la, b, bl, out=b, lse=bl)
    assert same_bits(b, want_o) and same_bits(bl, want_l)
    # out = out_a given as another view object of the same memory (same pointer and strides: the C
    # contract's exact in-place case), e.g. merge_states(o[i], l[i], ..., out=o[i], lse=l[i])
    a, al = oa[None].copy(), la[None].copy()
    gvr.merge_states(a[0], al[0], ob, lb, out=a[0], lse=al[0])
    assert same_bits(a[0], want_o) and same_bits(al[0], want_l)
    # merge_states_in_place
    a, al = oa.copy(), la.copy()
    r = gvr.merge_states_in_place(a, al, ob, lb)
    assert r[0] is a and r[1] is al and same_bits(a, want_o) and same_bits(al, want_l)
    ro, rl = merge_ref(oa, la, ob, lb)
    no, nl = merge_naive(oa, la, ob, lb)
    assert_close(want_o, ro, no, "float32", what="merge")
    assert_close(want_l, rl, nl, "float32", what="merge lse")


def test_merge_base2_matches_base_e():
    rng = np.random.default_rng(26)
    oa, la = _states(rng, (4, 8, 64), empty_frac=0.1)
    ob, lb = _states(rng, (4, 8, 64), empty_frac=0.1)
    oa, ob = oa.astype(np.float32), ob.astype(np.float32)
    eo, el = gvr.merge_states(oa, la, ob, lb, lse_base="e")
    la2 = (la.astype(np.float64) / math.log(2)).astype(np.float32)
    lb2 = (lb.astype(np.float64) / math.log(2)).astype(np.float32)
    to, tl = gvr.merge_states(oa, la2, ob, lb2, lse_base="2")
    ro, rl = merge_ref(oa, la2, ob, lb2, lse_base="2")
    no, nl = merge_naive(oa, la2, ob, lb2, lse_base="2")
    assert_close(to, ro, no, "float32", what="base-2 out")
    assert_close(tl, rl, nl, "float32", what="base-2 lse")
    # base-2 states of the same attention give the same merged state
    ro_e, rl_e = merge_ref(oa, la2.astype(np.float64) * math.log(2), ob, lb2.astype(np.float64) * math.log(2))
    assert_close(to, ro_e, no, "float32", what="base-2 vs base-e out")
    assert np.array_equal(np.isinf(tl), np.isinf(el))
    fin = np.isfinite(el)
    assert np.allclose(tl[fin] * math.log(2), el[fin], rtol=1e-5, atol=1e-5)
    assert np.allclose(to, eo, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# determinism, frameworks, torch ops
# --------------------------------------------------------------------------------------------------


def test_determinism_100_calls():
    rng = np.random.default_rng(27)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, paged=False, n=1500, Hsel=2, extra_pages=200)
    q, k, v, idx, kw = c.args("numpy")
    po = np.empty((3, 8, 1500, 64), np.float32)
    pl = np.empty((3, 8, 1500), np.float32)
    o0, l0 = gvr.sparse_attention(q, k, v, idx, **kw)
    gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
    po0, pl0 = po.copy(), pl.copy()
    s0, sl0 = float32_state(3, 8, 64, rng=np.random.default_rng(1), empty=False)
    gvr.prr.repair(s0, sl0, q, k, v, idx, **kw)
    for _ in range(100):
        o, l = gvr.sparse_attention(q, k, v, idx, **kw)
        assert same_bits(o, o0) and same_bits(l, l0)
    for _ in range(5):
        gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
        assert same_bits(po, po0) and same_bits(pl, pl0)
        s, sl = float32_state(3, 8, 64, rng=np.random.default_rng(1), empty=False)
        gvr.prr.repair(s, sl, q, k, v, idx, **kw)
        assert same_bits(s, s0) and same_bits(sl, sl0)


@needs_torch
def test_torch_in_torch_out_numpy_in_numpy_out():
    rng = np.random.default_rng(28)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=4, Hsel=2)
    q, k, v, idx, kw = c.args("numpy")
    o, l = gvr.sparse_attention(q, k, v, idx, **kw)
    assert type(o) is np.ndarray and type(l) is np.ndarray
    tq, tk, tv, tidx, tkw = c.args("torch")
    to, tl = gvr.sparse_attention(tq, tk, tv, tidx, **tkw)
    assert isinstance(to, torch.Tensor) and isinstance(tl, torch.Tensor)
    assert same_bits(o, to.numpy()) and same_bits(l, tl.numpy())
    m = gvr.prr.missed(tidx, tidx[:, :, :2])
    assert isinstance(m, torch.Tensor) and m.dtype == torch.int32
    mo, ml = gvr.merge_states(to, tl, to, tl)
    assert isinstance(mo, torch.Tensor)
    po, pl = torch.empty(2, 4, 4, 64), torch.empty(2, 4, 4)
    gvr.sparse_attention(tq, tk, tv, tidx, partials=(po, pl), **tkw)
    fo, fl = gvr.prr.finalize((po, pl), tidx, tidx)
    assert isinstance(fo, torch.Tensor) and fo.dtype == torch.float32
    # requires_grad inputs are read (values only)
    tq2 = tq.clone().requires_grad_()
    to2, _ = gvr.sparse_attention(tq2, tk, tv, tidx, **tkw)
    assert same_bits(to2.detach().numpy(), o)


OPS = ("sparse_attention", "sparse_attention_out", "merge_states", "merge_states_in_place", "prr_repair",
       "prr_missed", "prr_finalize")


@needs_torch
def test_torch_library_ops_exist():
    for name in OPS:
        assert hasattr(torch.ops.gvr, name), name


def _small_torch_case():
    rng = np.random.default_rng(29)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=16, P=4, block_size=4, n=3, Hsel=2, seq_len=16)
    return c, c.args("torch")


@needs_torch
def test_opcheck_cpu():
    c, (q, k, v, idx, kw) = _small_torch_case()
    bt, ln = kw["block_table"], kw["lengths"]
    att = (q, k, v, idx, ln, bt, 4, None, None, None)  # scale, k_scale, v_scale
    g = torch.Generator().manual_seed(0)
    st = lambda: (torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, generator=g))  # noqa: E731
    po, pl = torch.empty(2, 4, 3, 16), torch.empty(2, 4, 3)
    gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
    cases = {
        "sparse_attention": [att, (q, k, v, idx, None, None, 1, 0.5, 0.75, 1.5)],
        "sparse_attention_out": [att + (torch.empty(2, 4, 16), torch.empty(2, 4), torch.empty(2, 4, 3, 16),
                                        torch.empty(2, 4, 3), False, None, None, None),
                                 att + (torch.empty(2, 4, 16, dtype=q.dtype), torch.empty(2, 4), None, None, False,
                                        None, None, None),
                                 att + (*st(), None, None, True, None, None, None)],
        "merge_states": [(*st(), *st(), False), (*st(), *st(), True)],
        "merge_states_in_place": [(*st(), *st(), False)],
        "prr_repair": [(*st(), *att, None, None, None),
                       (*st(), *att, idx[:, :, :2].contiguous(), torch.zeros(4, dtype=torch.int64),
                        torch.empty(2, 4, 16, dtype=q.dtype))],
        "prr_missed": [(idx, idx[:, :, :2].contiguous()), (idx, idx[:, :1, :2].contiguous())],
        "prr_finalize": [(po, pl, idx, idx[:, :, 1:].contiguous())],
    }
    for name, arg_sets in cases.items():
        for args in arg_sets:
            torch.library.opcheck(getattr(torch.ops.gvr, name).default, args)
    # the ops compute what the wrappers compute
    o1, l1 = torch.ops.gvr.sparse_attention(*att)
    o2, l2 = gvr.sparse_attention(q, k, v, idx, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    m = torch.ops.gvr.prr_missed(idx, idx[:, :, :2].contiguous())
    assert torch.equal(m, gvr.prr.missed(idx, idx[:, :, :2].contiguous()))


def _attention_step(q, k, v, idx, bt, ln, state_o, state_l):
    y = q * 1.0
    out, lse = gvr.sparse_attention(y, k, v, idx, block_table=bt, lengths=ln, block_size=4)
    o2, l2 = gvr.merge_states(out.float(), lse, state_o, state_l)
    miss = gvr.prr.missed(idx, idx[:, :, :1])
    gvr.prr.repair(o2, l2, y, k, v, miss, block_table=bt, lengths=ln, block_size=4)
    return out, lse, o2 + 0, l2 + 0


@needs_torch
def test_compile_aot_eager_matches_eager():
    torch._dynamo.reset()
    c, (q, k, v, idx, kw) = _small_torch_case()
    so, sl = torch.randn(2, 4, 16), torch.randn(2, 4)
    sl[0, 1] = NEG_INF
    want = _attention_step(q, k, v, idx, kw["block_table"], kw["lengths"], so, sl)
    f = torch.compile(_attention_step, fullgraph=True, backend="aot_eager")
    got = f(q, k, v, idx, kw["block_table"], kw["lengths"], so, sl)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # the eager result is the reference's
    check_state(c, want[0], want[1], what="compiled step")
