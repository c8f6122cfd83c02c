"""fp8 (e4m3fn) KV caches and per-tensor K/V scales (``k_scale``, ``v_scale``) for gvr.sparse_attention
and gvr.prr.repair on the CPU, against the independent float64 NumPy reference (attention_reference.py).

The contract held here: with K' = k_scale * decode(K) and V' = v_scale * decode(V), the result is the
dense softmax attention over the selected tokens (scores = scale * q.K'; lse the natural log of the
softmax denominator, scale and k_scale included); everything else (indices, -1, block tables,
lengths, masking, empty selections, duplicates) as for q-dtype caches. decode() is the reference's own
e4m3fn decoder, written from the bit layout (checked here against torch's conversion on all 256 codes).

Tolerances: harness.assert_close (factor 2 x the error of the naive math in q's precision on the
exactly decoded values, + one ulp of q's precision at the reference's scale), never loosened. NaN
codes follow IEEE (a NaN K row: the heads reading it NaN; a NaN V[t, d]: out[..., d] NaN) and leave
everything else alone (NaN in tokens not attended changes nothing); as a cross-check each fp8 result
has the same non-finite pattern as, and is held to the same reference as, the same call with the
caches decoded to float32 and float32 q. Nothing passed in is modified; results are deterministic bit
for bit; the torch.library ops compute what the wrappers compute.

fp8 caches are torch CPU float8_e4m3fn tensors (views of the uint8 codes); NumPy caches of
ml_dtypes.float8_e4m3fn in one test (skipped without ml_dtypes).
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import gvr
from attention_reference import (
    E4M3_MAX, E4M3_NAN, E4M3_VALUES, check_state, dense_bruteforce, e4m3_decode, e4m3_encode, finalize_naive,
    make_case, merge_naive, merge_ref, missed_ref, random_e4m3, random_indices, to_numpy,
)
from harness import assert_close, torch_or_none
from reference import same_bits

torch = torch_or_none()
pytestmark = pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"),
                                reason="fp8 caches are torch float8_e4m3fn tensors: needs torch")
NEG_INF = -np.inf
SENTINEL = 7.0
FP8 = "float8_e4m3fn"


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def fp8_case(rng, dtype="bfloat16", **kw):
    return make_case(rng, dtype=dtype, kv_dtype=FP8, **kw)


def bits(x):
    """Raw bits of a NumPy array or torch tensor (any dtype, fp8 included) as a NumPy array."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])
    x = x.detach().cpu().contiguous()
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(it).numpy()


def same(a, b):
    ba, bb = bits(a), bits(b)
    return ba.shape == bb.shape and np.array_equal(ba, bb)


def _owner(x):
    if isinstance(x, np.ndarray):
        while isinstance(getattr(x, "base", None), np.ndarray):
            x = x.base
        return x
    return x


def snapshot(values):
    """[(object, copy of its bits)] of every array / tensor among ``values`` (tuples flattened)."""
    out = []
    for v in values:
        if isinstance(v, (tuple, list)):
            out += snapshot(v)
        elif isinstance(v, np.ndarray):
            o = _owner(v)
            out.append((o, bits(o).copy()))
        elif torch is not None and isinstance(v, torch.Tensor):
            base = v if v._base is None else v._base
            out.append((base, bits(base).copy()))
    return out


def assert_unchanged(snaps, what=""):
    for obj, b in snaps:
        assert np.array_equal(bits(obj), b), f"{what}: an input was modified"


def attend(case, fw="torch", *, check_inputs=True, **kw):
    """gvr.sparse_attention on the case's inputs (+ kw); the inputs are checked unmodified."""
    q, k, v, idx, akw = case.args(fw)
    akw.update(kw)
    snaps = snapshot([q, k, v, idx, akw.get("block_table"), akw.get("lengths")]) if check_inputs else []
    out, lse = gvr.sparse_attention(q, k, v, idx, **akw)
    assert_unchanged(snaps, "sparse_attention")
    return out, lse


def check_fp8(case, out, lse, *, indices=None, what=""):
    """(out, lse) of an fp8 call: against the reference (check_state), and against the same call with
    the caches decoded to float32 and float32 q: the same non-finite pattern, the same reference."""
    check_state(case, out, lse, indices=indices, what=what)
    d = case.decoded("float32") if indices is None else case.decoded("float32").with_indices(indices)
    q, k, v, idx, kw = d.args("numpy")
    do, dl = gvr.sparse_attention(q, k, v, idx, **kw)
    check_state(d, do, dl, what=f"{what} (decoded to float32)")
    go, gl = to_numpy(out).astype(np.float64), to_numpy(lse).astype(np.float64)
    for g, f, name in ((go, do, "out"), (gl, dl, "lse")):
        assert np.array_equal(np.isnan(g), np.isnan(f)), f"{what}: {name} NaN pattern differs from the float32 call"
        assert np.array_equal(np.isneginf(g), np.isneginf(f)), f"{what}: {name} -inf pattern differs"


def float32_state(rng, B, Hq, D, empty_frac=0.25):
    o = rng.standard_normal((B, Hq, D)).astype(np.float32)
    l = (rng.standard_normal((B, Hq)) * 3).astype(np.float32)
    m = rng.random((B, Hq)) < empty_frac
    o[m] = 0
    l[m] = NEG_INF
    return o, l


def T(a):
    """A fresh torch CPU tensor of a NumPy array."""
    return torch.from_numpy(np.array(a, copy=True, order="C"))


def attended_anywhere(case):
    """bool [num_pages * P, Hkv]: the (slot, KV head) pairs some selection row attends."""
    Hkv = case.k.shape[2]
    Hsel = case.indices.shape[1]
    used = np.zeros((case.num_pages * case.P, Hkv), bool)
    for b in range(case.B):
        for s in range(Hsel):
            sl = case.slots(b, s)
            heads = range(Hkv) if Hsel == 1 else [s]
            for g in heads:
                used[sl, g] = True
    return used


# --------------------------------------------------------------------------------------------------
# the e4m3fn decoder / encoder of the reference
# --------------------------------------------------------------------------------------------------


def test_e4m3_decoder_spot_values():
    want = {0x00: 0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x30: 0.5, 0x38: 1.0, 0x39: 1.125,
            0x3F: 1.875, 0x40: 2.0, 0x77: 240.0, 0x78: 256.0, 0x7E: 448.0, 0x81: -(2.0**-9), 0xB8: -1.0,
            0xFE: -448.0}
    for code, val in want.items():
        assert E4M3_VALUES[code] == val, hex(code)
    assert E4M3_VALUES[0x80] == 0.0 and math.copysign(1.0, E4M3_VALUES[0x80]) == -1.0
    nan = np.isnan(E4M3_VALUES)
    assert np.nonzero(nan)[0].tolist() == [0x7F, 0xFF]
    assert np.nanmax(np.abs(E4M3_VALUES)) == E4M3_MAX and not np.isinf(E4M3_VALUES).any()
    assert np.array_equal(E4M3_VALUES[0x80:][~nan[0x80:]], -E4M3_VALUES[:0x80][~nan[:0x80]])


def test_e4m3_decoder_matches_torch_on_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    t = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float32).numpy().astype(np.float64)
    mine = e4m3_decode(codes)
    assert np.array_equal(np.isnan(t), np.isnan(mine))
    ok = ~np.isnan(mine)
    assert np.array_equal(t[ok], mine[ok]) and np.array_equal(np.signbit(t[ok]), np.signbit(mine[ok]))
    # to_numpy decodes torch fp8 tensors (CPU, strided views) with the same table
    v = torch.from_numpy(codes.reshape(16, 16)).view(torch.float8_e4m3fn).t()
    got = to_numpy(v)
    assert np.array_equal(np.isnan(got), np.isnan(mine.reshape(16, 16).T))
    assert np.array_equal(np.nan_to_num(got), np.nan_to_num(mine.reshape(16, 16).T))


def test_e4m3_encoder_rounds_to_nearest_even_like_torch():
    codes = np.arange(256, dtype=np.uint8)
    ok = ~np.isnan(E4M3_VALUES)
    assert np.array_equal(e4m3_encode(E4M3_VALUES[ok]), codes[ok])  # exact values: their codes (-0 too)
    pos = E4M3_VALUES[:0x7F]
    mids = (pos[:-1] + pos[1:]) / 2  # ties: to the even code
    assert np.all(e4m3_encode(mids) % 2 == 0)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * s for s in (0.01, 1.0, 30.0, 300.0)] +
                       [mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [460.0, 1e6, -1e6]])
    x = x.astype(np.float32).astype(np.float64)
    tc = torch.from_numpy(x.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_encode(x), tc)
    assert e4m3_encode(np.array([np.nan]))[0] == E4M3_NAN and e4m3_encode(np.array([np.inf]))[0] == 0x7E
    r = random_e4m3(rng, (1000,), 200.0)  # saturated values present, never NaN
    assert r.dtype == np.uint8 and not np.isnan(e4m3_decode(r)).any() and (r & 0x7F).max() == 0x7E


# --------------------------------------------------------------------------------------------------
# the reference with fp8 caches and scales
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_reference_with_scales_matches_dense_bruteforce(paged):
    rng = np.random.default_rng(1)
    for ks, vs, layout in ((0.37, 2.5, "NHD"), (2.5, -0.75, "HND"), (0.0, 1.0, "NHD")):
        c = fp8_case(rng, B=3, Hq=4, Hkv=2, D=8, P=16, block_size=16 if paged else 1, paged=paged, n=6, Hsel=2,
                     layout=layout, dup=0.2, oob=0.2, pad=0.2, fp8_amp=4.0, k_scale=ks, v_scale=vs)
        o, l = c.ref()
        o2, l2 = dense_bruteforce(c.q, c.k, c.v, c.indices, c.lengths, c.block_table, c.block_size,
                                  k_scale=ks, v_scale=vs)
        assert np.array_equal(l == NEG_INF, l2 == NEG_INF)
        fin = l > NEG_INF
        assert np.allclose(o, o2, rtol=1e-12, atol=1e-12) and np.allclose(l[fin], l2[fin], rtol=1e-12, atol=1e-12)


def test_reference_nan_semantics():
    rng = np.random.default_rng(2)
    c = fp8_case(rng, B=2, Hq=4, Hkv=2, D=8, P=16, paged=False, n=4, Hsel=2, pad=0, oob=0)
    o0, l0 = c.ref()
    t = int(c.slots(0, 1)[0])
    codes0 = c.codes.copy()
    ck = c.with_indices(c.indices).inject_nan("k", [t], 1, dims=[3])
    assert np.array_equal(c.codes, codes0) and not np.shares_memory(ck.codes, c.codes)  # c itself unchanged
    assert (ck.codes != codes0).sum() == 1 and np.isnan(ck.k[t // 16, t % 16, 1, 3])
    o, l = ck.ref()
    assert np.isnan(l[0, 2:]).all() and np.isnan(o[0, 2:]).all()  # KV head 1 of row 0: query heads 2, 3
    assert same_bits(o[0, :2], o0[0, :2]) and same_bits(o[1], o0[1]) and same_bits(l[1], l0[1])
    cv = c.with_indices(c.indices).inject_nan("v", [t], 1, dims=[3, 5], code=0xFF)
    o, l = cv.ref()
    assert same_bits(l, l0) and np.isnan(o[0, 2:, [3, 5]]).all()
    m = np.ones_like(o, bool)
    m[0, 2:, [3, 5]] = False
    assert same_bits(o[m], o0[m])
    # NaN where nothing is attended: nothing changes
    unused = np.nonzero(~attended_anywhere(c)[:, 0])[0]
    cu = c.with_indices(c.indices).inject_nan("k", unused, 0).inject_nan("v", unused, 0)
    o, l = cu.ref()
    assert same_bits(o, o0) and same_bits(l, l0)


# --------------------------------------------------------------------------------------------------
# sparse_attention: the coverage grid
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hsel", ["1", "Hkv"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128, 256, 72])
def test_head_dims_gqa_and_selection_heads(D, gqa, Hsel):
    rng = np.random.default_rng(D * 100 + gqa * 10 + (Hsel == "1"))
    Hkv = 2 if gqa == 8 else 3
    for paged in (True, False):
        c = fp8_case(rng, B=2, Hq=gqa * Hkv, Hkv=Hkv, D=D, P=16, block_size=4 if paged else 1, paged=paged, n=12,
                     Hsel=1 if Hsel == "1" else Hkv, dup=0.1, fp8_amp=2.0)
        out, lse = attend(c)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, gqa * Hkv, D)
        assert lse.dtype == torch.float32 and lse.shape == (2, gqa * Hkv)
        check_fp8(c, out, lse, what=f"D={D} gqa={gqa} Hsel={Hsel} paged={paged}")


PAGE_BLOCK = [(P, G, True) for P in (16, 64) for G in (1, 16, 64)] + [(P, 1, False) for P in (16, 64)]


@pytest.mark.parametrize("P,G,paged", PAGE_BLOCK,
                         ids=[f"{'bt' if p else 'slots'}-P{P}-G{G}" for P, G, p in PAGE_BLOCK])
def test_page_and_block_sizes(P, G, paged):
    rng = np.random.default_rng(P * 1000 + G + paged)
    n = 5 if G >= 64 else 20
    for Hsel, dtype in ((1, "bfloat16"), (2, "float16")):
        c = fp8_case(rng, dtype=dtype, B=3, Hq=8, Hkv=2, D=64, P=P, block_size=G, paged=paged, n=n, Hsel=Hsel,
                     dup=0.1, bad_pages=paged, lengths="partial" if paged else "none")
        out, lse = attend(c)
        assert out.dtype == getattr(torch, dtype)
        check_fp8(c, out, lse, what=f"P={P} G={G} paged={paged} Hsel={Hsel} {dtype}")


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_layouts(layout, combined):
    rng = np.random.default_rng(3 + combined)
    c = fp8_case(rng, B=2, Hq=8, Hkv=2, D=128, P=16, block_size=16, n=6, Hsel=2, layout=layout, combined=combined,
                 q_padded=True, k_scale=0.37, v_scale=2.5)
    q, k, v, idx, kw = c.args("torch")
    if layout == "HND":
        assert not k.is_contiguous() and k.dtype == torch.float8_e4m3fn
    out, lse = attend(c)
    check_fp8(c, out, lse, what=f"{layout} combined={combined}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_q_dtypes_and_out_dtype(dtype):
    rng = np.random.default_rng(4)
    c = fp8_case(rng, dtype=dtype, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=8, n=10, Hsel=2, k_scale=0.5,
                 v_scale=3.0, fp8_amp=3.0)
    out, lse = attend(c)
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    check_fp8(c, out, lse, what=f"q {dtype}")
    o32 = torch.full((3, 8, 64), SENTINEL)
    r, lse2 = attend(c, out=o32)
    assert r is o32
    check_state(c, o32, lse2, what=f"q {dtype}, float32 out")
    assert same(lse2, lse), "lse depends on out's dtype"


def test_selection_sizes_and_empty_selections():
    rng = np.random.default_rng(5)
    for n in (0, 1, 600):
        c = fp8_case(rng, B=2, Hq=4, Hkv=1, D=64, P=16, paged=False, n=n, extra_pages=40, pad=0.05 if n else 0,
                     oob=0.05 if n else 0)
        out, lse = attend(c)
        check_fp8(c, out, lse, what=f"n={n}")
        if n == 0:
            assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_empty_rows_padding_out_of_range_and_masking():
    rng = np.random.default_rng(6)
    c = fp8_case(rng, B=4, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=4, Hsel=2, lengths=np.array([0, 40, 64, 64]),
                 seq_len=64, pad=0, oob=0)
    idx = c.indices.copy()
    idx[1, :] = -1  # row 1: all padding
    idx[2, 0] = [2**31 - 1, 4, 1000, -5]  # row 2, KV head 0: only out-of-range / negative entries
    idx[3, 1] = [idx[3, 1, 0], -1, idx[3, 1, 0], 2**24]  # a duplicate, padding, out of range
    c = c.with_indices(idx)
    out, lse = attend(c)
    check_fp8(c, out, lse, what="empty rows")
    assert torch.all(lse[0] == float("-inf")) and torch.all(out[0] == 0)
    assert torch.all(lse[1] == float("-inf")) and torch.all(out[1] == 0)
    assert torch.all(lse[2, :2] == float("-inf")) and torch.all(out[2, :2] == 0)
    assert torch.isfinite(lse[2, 2:]).all() and torch.isfinite(lse[3]).all()


def test_duplicated_entries_count_twice():
    rng = np.random.default_rng(7)
    for paged in (True, False):
        c = fp8_case(rng, B=2, Hq=4, Hkv=1, D=64, P=16, block_size=16 if paged else 1, paged=paged, n=3, pad=0,
                     oob=0, lengths="full", k_scale=1.5)
        dup = c.with_indices(np.concatenate([c.indices, c.indices[:, :, :1]], axis=2))
        out, lse = attend(dup)
        check_fp8(dup, out, lse, what="duplicates")
        _, l1 = c.ref()
        _, ls = c.ref(c.indices[:, :, :1])
        assert np.allclose(lse.numpy(), np.logaddexp(l1, ls), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# NaN codes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_nan_codes_in_attended_tokens(paged, which):
    rng = np.random.default_rng(8 + paged)
    c = fp8_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=4 if paged else 1, paged=paged, n=8, Hsel=2,
                 pad=0, oob=0, k_scale=0.37, v_scale=2.5)
    # row 0 head 1: one token, some dims (code 0x7F); row 2 head 0: one token, every dim (0xFF)
    c.inject_nan(which, c.slots(0, 1)[:1], 1, dims=[0, 17, 63])
    c.inject_nan(which, c.slots(2, 0)[-1:], 0, code=0xFF)
    out, lse = attend(c)
    check_fp8(c, out, lse, what=f"NaN in {which}")
    ro, rl = c.ref()
    assert np.isnan(ro).any() and not np.isnan(ro).all()  # the test is about something
    # the same NaN in a bfloat16 cache and in a float32 cache: the same result pattern, same reference
    b = c.decoded("bfloat16")
    q, k, v, idx, kw = b.args("torch")
    bo, bl = gvr.sparse_attention(q, k, v, idx, **kw)
    check_state(b, bo, bl, what=f"NaN in {which}, bfloat16 cache")
    assert torch.equal(torch.isnan(bo), torch.isnan(out)) and torch.equal(torch.isnan(bl), torch.isnan(lse))


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_nan_codes_in_tokens_not_attended_change_nothing(paged):
    """Every (slot, KV head) no row attends -- neighbours in the same pages, tokens past the rows'
    lengths, other heads' tokens -- holds NaN in K and V: the result is bit for bit the clean one."""
    rng = np.random.default_rng(9 + paged)
    c = fp8_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16 if paged else 1, paged=paged, n=6, Hsel=2,
                 dup=0.1, k_scale=2.5, v_scale=0.37)
    clean = attend(c)
    parts = (torch.empty(3, 8, 6, 64), torch.empty(3, 8, 6))
    attend(c, partials=parts)
    unused = ~attended_anywhere(c)
    assert unused.any() and (~unused).any()
    dirty = c.with_indices(c.indices)
    for g in range(2):
        sl = np.nonzero(unused[:, g])[0]
        dirty.inject_nan("k", sl, g, code=(0x7F, 0xFF)[g]).inject_nan("v", sl, g)
    got = attend(dirty)
    assert same(got[0], clean[0]) and same(got[1], clean[1])
    check_fp8(dirty, *got, what="NaN outside the selection")
    parts2 = (torch.empty(3, 8, 6, 64), torch.empty(3, 8, 6))
    attend(dirty, partials=parts2)
    assert same(parts2[0], parts[0]) and same(parts2[1], parts[1])
    o, l = float32_state(np.random.default_rng(1), 3, 8, 64)
    o2, l2 = o.copy(), l.copy()
    q, k, v, idx, kw = c.args("torch")
    gvr.prr.repair(T(o), T(l), q, k, v, idx, **kw)
    q, k, v, idx, kw = dirty.args("torch")
    r = gvr.prr.repair(T(o2), T(l2), q, k, v, idx, **kw)
    assert not torch.isnan(r[0]).any() and not torch.isnan(r[1]).any()


# --------------------------------------------------------------------------------------------------
# k_scale / v_scale
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ks,vs", [(0.37, 2.5), (2.5, 0.37), (-1.25, 1.0), (1.0, -3.0), (0.0, 0.5), (1e-3, 1e3)])
@pytest.mark.parametrize("cache", ["fp8", "bfloat16", "float32"])
def test_scales(cache, ks, vs):
    rng = np.random.default_rng(10)
    kw = dict(B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=6, Hsel=2, k_scale=ks, v_scale=vs)
    if cache == "fp8":
        c = fp8_case(rng, fp8_amp=2.0, **kw)
    else:
        c = make_case(rng, dtype=cache, **kw)
    out, lse = attend(c)
    (check_fp8 if cache == "fp8" else check_state)(c, out, lse, what=f"{cache} k_scale={ks} v_scale={vs}")


@pytest.mark.parametrize("cache", ["fp8", "bfloat16"])
def test_scale_identities(cache):
    """k_scale / v_scale 1.0 (float or int) equal leaving them out, bit for bit; an int scale equals the
    float; v_scale leaves lse alone (bit for bit) and scales out; k_scale acts like scale * k_scale."""
    rng = np.random.default_rng(11)
    kw = dict(B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=6, Hsel=2)
    c = fp8_case(rng, **kw) if cache == "fp8" else make_case(rng, dtype=cache, **kw)
    o0, l0 = attend(c)
    for extra in (dict(k_scale=1.0), dict(v_scale=1.0), dict(k_scale=1.0, v_scale=1.0), dict(k_scale=1, v_scale=1),
                  dict(k_scale=np.float64(1.0))):
        o, l = attend(c, **extra)
        assert same(o, o0) and same(l, l0), extra
    o2, l2 = attend(c, k_scale=2, v_scale=3)
    o3, l3 = attend(c, k_scale=2.0, v_scale=3.0)
    assert same(o2, o3) and same(l2, l3)
    ov, lv = attend(c, v_scale=2.5)
    assert same(lv, l0), "v_scale changed lse"
    c.v_scale = 2.5
    check_state(c, ov, lv, what="v_scale 2.5")
    c.v_scale, c.k_scale = None, 0.37
    ok, lk = attend(c)
    check_state(c, ok, lk, what="k_scale 0.37")
    c.k_scale, c.scale = None, 0.37 / 8.0  # scale * k_scale with the default scale 1/sqrt(64)
    os_, ls_ = attend(c)
    check_state(c, os_, ls_, what="scale 0.37/8")
    assert np.allclose(lk.numpy(), ls_.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("amp,ks,vs", [(150.0, 0.004, 0.01), (0.004, 300.0, 200.0)], ids=["saturated", "subnormal"])
def test_large_and_subnormal_codes(amp, ks, vs):
    """Codes over the whole range (amplitude 150: +-448 saturated ones, large scores) or mostly
    subnormal (amplitude 0.004: |x| < 2^-6), with scales that bring the products back to O(1)."""
    rng = np.random.default_rng(12)
    c = fp8_case(rng, B=2, Hq=8, Hkv=2, D=128, P=16, paged=False, n=300, Hsel=2, extra_pages=20, fp8_amp=amp,
                 k_scale=ks, v_scale=vs)
    if amp > 1:
        assert (np.abs(c.base) == E4M3_MAX).any()
    else:
        assert np.mean((c.codes & 0x78) == 0) > 0.9  # exponent field 0
    out, lse = attend(c)
    check_fp8(c, out, lse, what=f"amplitude {amp}")


# --------------------------------------------------------------------------------------------------
# strides, partials, repair
# --------------------------------------------------------------------------------------------------


def test_unaligned_and_strided_fp8_views_on_the_cpu():
    """The CPU path takes any strides (unit stride along D): caches that start at an odd byte and have
    odd row strides give the compact caches' result."""
    rng = np.random.default_rng(13)
    c = fp8_case(rng, B=2, Hq=4, Hkv=2, D=72, P=16, block_size=16, n=5, Hsel=2, k_scale=0.37)
    q, k, v, idx, kw = c.args("torch")
    want = gvr.sparse_attention(q, k, v, idx, **kw)
    np_, P, Hkv, D = k.shape
    wide = torch.zeros(2, np_, P, Hkv, D + 3, dtype=torch.uint8)
    wide[0, ..., 1:1 + D] = k.view(torch.uint8)
    wide[1, ..., 1:1 + D] = v.view(torch.uint8)
    wf = wide.view(torch.float8_e4m3fn)
    k2, v2 = wf[0, ..., 1:1 + D], wf[1, ..., 1:1 + D]
    assert k2.data_ptr() % 8 == 1 and k2.stride(2) == D + 3
    got = gvr.sparse_attention(q, k2, v2, idx, **kw)
    check_fp8(c, *got, what="odd offset and strides")
    assert same(got[0], want[0]) and same(got[1], want[1])


@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_partials_are_each_entry_alone(paged, Hsel):
    rng = np.random.default_rng(14 + Hsel + 2 * paged)
    c = fp8_case(rng, B=2, Hq=8, Hkv=2, D=64, P=16, block_size=8 if paged else 1, paged=paged, n=10, Hsel=Hsel,
                 dup=0.1, k_scale=0.37, v_scale=2.5)
    po, pl = torch.full((2, 8, 10, 64), 9.0), torch.full((2, 8, 10), 9.0)
    out, lse = attend(c, partials=(po, pl))
    check_fp8(c, out, lse, what="with partials")
    rpo, rpl = c.partials_ref()
    npo, npl = c.partials_naive()
    assert_close(po.numpy(), rpo, npo, "bfloat16", what="part_out")
    assert_close(pl.numpy(), rpl, npl, "bfloat16", what="part_lse")
    assert torch.all(po[torch.from_numpy(rpl == NEG_INF)] == 0)


def _split(rng, idx):
    m = rng.random(idx.shape[2]) < 0.5
    return np.ascontiguousarray(idx[:, :, m]), np.ascontiguousarray(idx[:, :, ~m])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_repair_twice_equals_attention_over_the_union(paged, dtype):
    rng = np.random.default_rng(15 + paged)
    c = fp8_case(rng, dtype=dtype, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16 if paged else 1, paged=paged,
                 n=16, Hsel=2, k_scale=2.5, v_scale=0.37)
    A, Bs = _split(rng, c.indices)
    q, k, v, _, kw = c.args("torch")
    out, lse = attend(c.with_indices(A), out=torch.empty(3, 8, 64))
    snaps = snapshot([q, k, v, kw.get("block_table"), kw.get("lengths")])
    r = gvr.prr.repair(out, lse, q, k, v, T(Bs), **kw)
    assert r[0] is out and r[1] is lse
    assert_unchanged(snaps, "repair")
    na, nb = c.naive(A), c.naive(Bs)
    no, nl = merge_naive(na[0], na[1], nb[0], nb[1])
    ro, rl = c.ref(np.concatenate([A, Bs], axis=2))
    assert_close(out.numpy(), ro, no, dtype, what="repair out")
    assert_close(lse.numpy(), rl, nl, dtype, what="repair lse")


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_repair_fused_extras_from_a_random_state(paged):
    """repair(exclude=X, counts, cast_out) with fp8 caches into a random float32 state: the same bits
    as repair(missed(indices, X)); the reference merge of the state with the non-excluded entries;
    counts exact; cast_out the repaired out converted."""
    from test_prr_repair_fused import count_ref, make_exclude

    rng = np.random.default_rng(16 + paged)
    for Hsel, Hx, dtype in ((2, 2, "bfloat16"), (2, 1, "float16"), (1, 1, "bfloat16")):
        c = fp8_case(rng, dtype=dtype, B=4, Hq=8, Hkv=2, D=64, P=16, block_size=16 if paged else 1, paged=paged,
                     n=12, Hsel=Hsel, dup=0.15, k_scale=0.37, v_scale=2.5)
        X = make_exclude(rng, c.indices, Hx, 8, c.n_entries_valid())
        po, pl = float32_state(rng, 4, 8, 64)
        q, k, v, idx, kw = c.args("torch")
        for cast in (dtype, "float32"):
            o1, l1 = T(po), T(pl)
            counts = torch.tensor([3, 5, 100, 200], dtype=torch.int64)
            co = torch.full((4, 8, 64), SENTINEL, dtype=getattr(torch, cast))
            Xt = T(X)
            snaps = snapshot([q, k, v, idx, Xt, kw.get("block_table"), kw.get("lengths")])
            gvr.prr.repair(o1, l1, q, k, v, idx, exclude=Xt, counts=counts, cast_out=co, **kw)
            assert_unchanged(snaps, "repair with extras")
            miss = gvr.prr.missed(idx, Xt)
            assert np.array_equal(miss.numpy(), missed_ref(c.indices, X))
            o2, l2 = T(po), T(pl)
            gvr.prr.repair(o2, l2, q, k, v, miss, **kw)
            assert same(o1, o2) and same(l1, l2), f"Hsel={Hsel} Hx={Hx}: exclude vs missed"
            h, n = count_ref(c.indices, X)
            assert counts.tolist() == [3 + h, 5 + n, 100 + h, 200 + n]
            assert same(co, o1.to(co.dtype)), "cast_out"
            mr = missed_ref(c.indices, X)
            mo, ml = c.ref(mr)
            nmo, nml = c.naive(mr)
            ro, rl = merge_ref(po, pl, mo, ml)
            no, nl = merge_naive(po, pl, nmo, nml)
            assert_close(o1.numpy(), ro, no, dtype, what=f"Hsel={Hsel} Hx={Hx} {dtype} out")
            assert_close(l1.numpy(), rl, nl, dtype, what=f"Hsel={Hsel} Hx={Hx} {dtype} lse")
            untouched = torch.from_numpy(ml == NEG_INF)
            assert same(o1[untouched], T(po)[untouched]) and same(l1[untouched], T(pl)[untouched])


def test_finalize_then_repair_missed_equals_attention():
    """Exact mode with fp8 caches: partials of the predicted entries, finalize, repair the missed."""
    rng = np.random.default_rng(17)
    c = fp8_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=8, n=1, Hsel=2, seq_len=256, k_scale=0.37,
                 v_scale=2.5)
    valid = c.n_entries_valid()
    pred = random_indices(rng, 3, 2, 12, valid, pad=0.15, oob=0.05, dup=0.1)
    sel = np.empty((3, 2, 10), np.int32)
    for b in range(3):
        for s in range(2):
            p = sorted({int(x) for x in pred[b, s] if 0 <= x < valid})
            pick = list(rng.choice(p, size=min(len(p), 5), replace=False))
            fresh = [x for x in rng.permutation(valid) if x not in p][:10 - len(pick)]
            row = pick + fresh
            rng.shuffle(row)
            sel[b, s] = row
    q, k, v, _, kw = c.args("torch")
    po, pl = torch.empty(3, 8, 12, 64), torch.empty(3, 8, 12)
    gvr.sparse_attention(q, k, v, T(pred), partials=(po, pl), **kw)
    out, lse = gvr.prr.finalize((po, pl), T(pred), T(sel))
    miss = gvr.prr.missed(T(sel), T(pred))
    gvr.prr.repair(out, lse, q, k, v, miss, **kw)
    npo, npl = c.partials_naive(pred)
    fo, fl = finalize_naive(npo, npl, pred, sel)
    mo, ml = c.naive(missed_ref(sel, pred))
    no, nl = merge_naive(fo, fl, mo, ml)
    ro, rl = c.ref(sel)
    assert_close(out.numpy(), ro, no, "bfloat16", what="exact mode out")
    assert_close(lse.numpy(), rl, nl, "bfloat16", what="exact mode lse")


def test_determinism():
    rng = np.random.default_rng(18)
    c = fp8_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, paged=False, n=400, Hsel=2, extra_pages=40, k_scale=0.37,
                 v_scale=2.5)
    q, k, v, idx, kw = c.args("torch")
    o0, l0 = gvr.sparse_attention(q, k, v, idx, **kw)
    po0, pl0 = torch.empty(3, 8, 400, 64), torch.empty(3, 8, 400)
    gvr.sparse_attention(q, k, v, idx, partials=(po0, pl0), **kw)
    s0, sl0 = float32_state(np.random.default_rng(1), 3, 8, 64)
    r0 = gvr.prr.repair(T(s0), T(sl0), q, k, v, idx, **kw)
    for _ in range(10):
        o, l = gvr.sparse_attention(q, k, v, idx, **kw)
        assert same(o, o0) and same(l, l0)
    for _ in range(3):
        po, pl = torch.empty(3, 8, 400, 64), torch.empty(3, 8, 400)
        gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
        assert same(po, po0) and same(pl, pl0)
        r = gvr.prr.repair(T(s0), T(sl0), q, k, v, idx, **kw)
        assert same(r[0], r0[0]) and same(r[1], r0[1])
    check_fp8(c, o0, l0, what="determinism case")


def test_numpy_ml_dtypes_caches():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(19)
    for dtype in ("float32", "float16"):
        c = fp8_case(rng, dtype=dtype, B=2, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=6, Hsel=2, k_scale=0.37,
                     v_scale=2.5, layout="HND")
        q, k, v, idx, kw = c.args("numpy")
        assert isinstance(k, np.ndarray) and k.dtype == ml_dtypes.float8_e4m3fn
        snaps = snapshot([q, k, v, idx, kw["block_table"], kw["lengths"]])
        out, lse = gvr.sparse_attention(q, k, v, idx, **kw)
        assert_unchanged(snaps, "numpy fp8")
        assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype)
        check_fp8(c, out, lse, what=f"NumPy ml_dtypes fp8, q {dtype}")
        to, tl = attend(c)  # the same values through torch
        assert same(to.numpy(), out) and same(tl.numpy(), lse)
        o, l = float32_state(rng, 2, 8, 64)
        o2, l2 = T(o), T(l)
        gvr.prr.repair(o, l, q, k, v, idx, **kw)
        tq, tk, tv, tidx, tkw = c.args("torch")
        gvr.prr.repair(o2, l2, tq, tk, tv, tidx, **tkw)
        assert same(o, o2.numpy()) and same(l, l2.numpy())


# --------------------------------------------------------------------------------------------------
# torch.library ops
# --------------------------------------------------------------------------------------------------


def _op_case():
    rng = np.random.default_rng(20)
    c = fp8_case(rng, B=2, Hq=4, Hkv=2, D=16, P=4, block_size=4, n=3, Hsel=2, seq_len=16)
    return c, c.args("torch")


def test_torch_ops_compute_what_the_wrappers_compute():
    c, (q, k, v, idx, kw) = _op_case()
    bt, ln = kw["block_table"], kw["lengths"]
    for ks, vs in ((None, None), (0.37, 2.5), (1.0, None)):
        o1, l1 = torch.ops.gvr.sparse_attention(q, k, v, idx, ln, bt, 4, None, ks, vs)
        extra = {n: s for n, s in (("k_scale", ks), ("v_scale", vs)) if s is not None}
        o2, l2 = gvr.sparse_attention(q, k, v, idx, **kw, **extra)
        assert same(o1, o2) and same(l1, l2), (ks, vs)
        out, lse = torch.empty(2, 4, 16), torch.empty(2, 4)
        po, pl = torch.empty(2, 4, 3, 16), torch.empty(2, 4, 3)
        torch.ops.gvr.sparse_attention_out(q, k, v, idx, ln, bt, 4, 0.5, ks, vs, out, lse, po, pl, False, None, None,
                                           None)
        wo, wl = torch.empty(2, 4, 16), torch.empty(2, 4)
        wpo, wpl = torch.empty(2, 4, 3, 16), torch.empty(2, 4, 3)
        gvr.sparse_attention(q, k, v, idx, **kw, scale=0.5, out=wo, lse=wl, partials=(wpo, wpl), **extra)
        assert same(out, wo) and same(lse, wl) and same(po, wpo) and same(pl, wpl)
        s = float32_state(np.random.default_rng(2), 2, 4, 16)
        a, al = T(s[0]), T(s[1])
        b, bl = T(s[0]), T(s[1])
        counts, cast = torch.zeros(4, dtype=torch.int64), torch.empty(2, 4, 16, dtype=torch.bfloat16)
        ex = idx[:, :, :1].contiguous()
        torch.ops.gvr.prr_repair(a, al, q, k, v, idx, ln, bt, 4, None, ks, vs, ex, counts, cast)
        c2, cast2 = torch.zeros(4, dtype=torch.int64), torch.empty(2, 4, 16, dtype=torch.bfloat16)
        gvr.prr.repair(b, bl, q, k, v, idx, **kw, exclude=ex, counts=c2, cast_out=cast2, **extra)
        assert same(a, b) and same(al, bl) and torch.equal(counts, c2) and same(cast, cast2)


# torch's schema check (SchemaCheckMode) compares tensors with torch.allclose, which torch does not
# implement for float8 on the CPU: fp8 caches get opcheck's other checks (the inputs-unmodified check
# is test_torch_ops_compute_what_the_wrappers_compute's); bfloat16 caches with scales get all of them.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("cache", ["fp8", "bfloat16"])
def test_opcheck_with_scales(cache):
    c, (q, k, v, idx, kw) = _op_case()
    if cache == "bfloat16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    utils = FP8_OPCHECK_UTILS if cache == "fp8" else "ALL"
    bt, ln = kw["block_table"], kw["lengths"]
    att = (q, k, v, idx, ln, bt, 4, None, 0.37, 2.5)
    g = torch.Generator().manual_seed(0)
    st = lambda: (torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, generator=g))  # noqa: E731
    cases = {
        "sparse_attention": [att, (q, k, v, idx, None, None, 1, 0.5, None, None)],
        "sparse_attention_out": [att + (torch.empty(2, 4, 16), torch.empty(2, 4), torch.empty(2, 4, 3, 16),
                                        torch.empty(2, 4, 3), False, None, None, None),
                                 att + (*st(), None, None, True, None, None, None)],
        "prr_repair": [(*st(), *att, None, None, None),
                       (*st(), *att, idx[:, :, :2].contiguous(), torch.zeros(4, dtype=torch.int64),
                        torch.empty(2, 4, 16, dtype=q.dtype))],
    }
    for name, arg_sets in cases.items():
        for args in arg_sets:
            torch.library.opcheck(getattr(torch.ops.gvr, name).default, args, test_utils=utils)


def _step(q, k, v, idx, bt, ln, so, sl):
    out, lse = gvr.sparse_attention(q * 1.0, k, v, idx, block_table=bt, lengths=ln, block_size=4, k_scale=0.37,
                                    v_scale=2.5)
    o2, l2 = gvr.merge_states(out.float(), lse, so, sl)
    miss = gvr.prr.missed(idx, idx[:, :, :1])
    gvr.prr.repair(o2, l2, q, k, v, miss, block_table=bt, lengths=ln, block_size=4, k_scale=0.37, v_scale=2.5)
    return out, lse, o2 + 0, l2 + 0


def test_compile_aot_eager_matches_eager():
    torch._dynamo.reset()
    c, (q, k, v, idx, kw) = _op_case()
    so, sl = torch.randn(2, 4, 16), torch.randn(2, 4)
    want = _step(q, k, v, idx, kw["block_table"], kw["lengths"], so, sl)
    got = torch.compile(_step, fullgraph=True, backend="aot_eager")(q, k, v, idx, kw["block_table"], kw["lengths"],
                                                                     so, sl)
    for g_, w in zip(got, want):
        assert same(g_, w)
    c.k_scale, c.v_scale = 0.37, 2.5
    check_state(c, want[0], want[1], what="compiled step")


# --------------------------------------------------------------------------------------------------
# bad inputs: the named error, nothing passed in modified
# --------------------------------------------------------------------------------------------------


def _name_re(*names):
    return "|".join(rf"\b{re.escape(n)}\b" for n in names)


def expect_error(exc, names, fn, *args, **kw):
    names = (names,) if isinstance(names, str) else names
    snaps = snapshot(list(args) + list(kw.values()))
    with pytest.raises(exc, match=_name_re(*names)) as ei:
        fn(*args, **kw)
    assert_unchanged(snaps, f"failed call ({exc} naming {names})")
    return ei


def bad_problem(dtype="bfloat16"):
    rng = np.random.default_rng(21)
    c = fp8_case(rng, dtype=dtype, B=2, Hq=4, Hkv=2, D=16, P=4, block_size=4, n=3, Hsel=2, seq_len=16,
                 lengths="full")
    q, k, v, idx, kw = c.args("torch")
    out = torch.full((2, 4, 16), SENTINEL, dtype=q.dtype)
    lse = torch.full((2, 4), SENTINEL)
    return q, k, v, idx, kw, out, lse


def _state():
    return torch.full((2, 4, 16), SENTINEL), torch.full((2, 4), SENTINEL)


def test_valid_bad_problem_runs():
    q, k, v, idx, kw, out, lse = bad_problem()
    gvr.sparse_attention(q, k, v, idx, out=out, lse=lse, k_scale=0.5, v_scale=2.0, **kw)
    assert torch.isfinite(lse).all()
    o, l = _state()
    gvr.prr.repair(o, l, q, k, v, idx, k_scale=0.5, v_scale=2.0, **kw)


@pytest.mark.parametrize("fn", ["attention", "repair"])
def test_k_and_v_of_different_dtypes(fn):
    q, k, v, idx, kw, out, lse = bad_problem()
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    call = (lambda *a, **x: gvr.sparse_attention(*a, out=out, lse=lse, **x)) if fn == "attention" else \
        (lambda *a, **x: gvr.prr.repair(*_state(), *a, **x))
    for kk, vv in ((k, vb), (kb, v)):
        expect_error(TypeError, ("k_cache", "v_cache"), call, q, kk, vv, idx, **kw)  # dtypes: TypeError, as for q
    if hasattr(torch, "float8_e5m2"):
        expect_error(TypeError, ("k_cache", "v_cache"), call, q, k, v.view(torch.float8_e5m2), idx, **kw)
        # both of an fp8 type other than e4m3fn: neither q's dtype nor float8_e4m3fn
        expect_error(TypeError, ("k_cache", "v_cache"), call, q, k.view(torch.float8_e5m2),
                     v.view(torch.float8_e5m2), idx, **kw)
    # both of a float dtype that is neither q's nor fp8
    expect_error(TypeError, ("k_cache", "v_cache"), call, q, k.to(torch.float16), v.to(torch.float16),
                 idx, **kw)
    expect_error(TypeError, ("k_cache", "v_cache"), call, q, k.view(torch.uint8), v.view(torch.uint8),
                 idx, **kw)
    assert torch.all(out == SENTINEL) and torch.all(lse == SENTINEL)


def test_fp8_q():
    q, k, v, idx, kw, out, lse = bad_problem()
    q8 = q.to(torch.float8_e4m3fn)
    expect_error(TypeError, "q", gvr.sparse_attention, q8, k, v, idx, **kw)
    expect_error(TypeError, "q", gvr.prr.repair, *_state(), q8, k, v, idx, **kw)
    # q fp8 with bfloat16 caches too
    expect_error(TypeError, "q", gvr.sparse_attention, q8, k.to(torch.bfloat16), v.to(torch.bfloat16),
                 idx, **kw)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("cache", ["fp8", "bfloat16"])
def test_scale_not_a_finite_number(name, cache):
    q, k, v, idx, kw, out, lse = bad_problem()
    if cache == "bfloat16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    for bad in ("0.5", True, False, [1.0], b"1"):
        expect_error(TypeError, name, gvr.sparse_attention, q, k, v, idx, out=out, lse=lse, **kw, **{name: bad})
        expect_error(TypeError, name, gvr.prr.repair, *_state(), q, k, v, idx, **kw, **{name: bad})
    for bad in (float("nan"), float("inf"), float("-inf")):
        expect_error(ValueError, name, gvr.sparse_attention, q, k, v, idx, out=out, lse=lse, **kw, **{name: bad})
        expect_error(ValueError, name, gvr.prr.repair, *_state(), q, k, v, idx, **kw, **{name: bad})
    assert torch.all(out == SENTINEL) and torch.all(lse == SENTINEL)


def test_late_errors_with_fp8_caches_leave_outputs_untouched():
    q, k, v, idx, kw, out, lse = bad_problem()
    po, pl = torch.full((2, 4, 3, 16), SENTINEL), torch.full((2, 4, 3), SENTINEL)
    bad = dict(kw, lengths=torch.tensor([1, 99], dtype=torch.int32))
    expect_error(ValueError, "lengths", gvr.sparse_attention, q, k, v, idx, out=out, lse=lse, partials=(po, pl),
                 k_scale=0.5, **bad)
    expect_error(ValueError, "lengths", gvr.prr.repair, *_state(), q, k, v, idx, v_scale=2.0, **bad)
    expect_error(ValueError, "k_cache", gvr.sparse_attention, q, k[..., :8], v, idx, out=out, lse=lse, **kw)
    expect_error(ValueError, "v_cache", gvr.sparse_attention, q, k, v[:, :2], idx, out=out, lse=lse, **kw)
    assert torch.all(out == SENTINEL) and torch.all(po == SENTINEL) and torch.all(pl == SENTINEL)
