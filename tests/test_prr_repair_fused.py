"""gvr.prr.repair's fused extras on the CPU: ``exclude`` (entries of ``indices`` found in an exclusion row
skipped), ``counts`` (hits / entries >= 0 added into an int64 [2] or [4]) and ``cast_out`` (the repaired
float32 state also written converted, round to nearest even).

The contract held here:
  * repair(..., indices, exclude=X) equals repair(..., indices=gvr.prr.missed(indices, X)) bit for bit
    (the C path gathers the same token stream), and both equal, within harness.assert_close, the float64
    reference of attention over the union of the prior state's set and the non-excluded entries;
  * counts[0] += entries x >= 0 of indices found in their exclusion row, counts[1] += entries x >= 0 of
    indices, once per selection row (b, s) (Hsel = 1: once, not Hkv times); [2:4] get the same additions;
  * cast_out = the float32 state after the repair converted to q's dtype (or float32: exactly it), every
    head included (a head the repair leaves as it was gets its unchanged out converted);
  * a call that raises changes nothing passed in (out, lse, counts, cast_out);
  * deterministic bit for bit.

NumPy arrays for float32 / float16 q, torch CPU tensors for bfloat16 / float16 (skipped without torch).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
from attention_reference import make_case, merge_naive, merge_ref, missed_ref, random_indices, to_numpy
from harness import assert_close, round_to, torch_or_none
from reference import same_bits

torch = torch_or_none()
needs_torch = pytest.mark.skipif(torch is None, reason="bfloat16 / float16 CPU tensors need torch")
NEG_INF = -np.inf
SENTINEL = 7.0

# (framework, q dtype): the inputs the CPU path takes
FW_DTYPES = [("numpy", "float32"), ("numpy", "float16")] + (
    [("torch", "bfloat16"), ("torch", "float16"), ("torch", "float32")] if torch is not None else [])


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def conv(fw, a, dtype=None):
    """A fresh copy of the NumPy array ``a`` as a NumPy array or a torch CPU tensor (dtype: a name)."""
    a = np.array(a, copy=True)
    if fw == "numpy":
        return a if dtype is None else a.astype(dtype)
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.to(getattr(torch, dtype))


def clone(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def bits(x):
    """The raw bits of a NumPy array or torch tensor as a NumPy unsigned-integer array."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])
    x = x.detach().contiguous()
    it = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(it).numpy().view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.element_size()])


def assert_bits(a, b, what):
    ba, bb = bits(a), bits(b)
    assert ba.shape == bb.shape, f"{what}: shapes {ba.shape} vs {bb.shape}"
    bad = np.argwhere(ba != bb)
    if bad.size:
        i = tuple(int(v) for v in bad[0])
        fa, fb = to_numpy(a)[i], to_numpy(b)[i]
        raise AssertionError(f"{what}: {bad.shape[0]} of {ba.size} elements differ; first at {i}: {fa!r} vs {fb!r}")


def converted(out, fw, dtype):
    """The float32 state ``out`` converted to ``dtype`` by the framework (round to nearest even)."""
    if fw == "numpy":
        return out.astype(dtype)
    return out.to(getattr(torch, dtype))


def prior_state(rng, B, Hq, D, fw="numpy", empty_frac=0.25):
    """A random float32 attention state (out [B, Hq, D], lse [B, Hq]); some heads empty (0, -inf)."""
    o = rng.standard_normal((B, Hq, D)).astype(np.float32)
    l = (rng.standard_normal((B, Hq)) * 3).astype(np.float32)
    m = rng.random((B, Hq)) < empty_frac
    o[m] = 0
    l[m] = NEG_INF
    return conv(fw, o), conv(fw, l)


def make_exclude(rng, indices, Hx, nx, valid, *, hit=0.5, tail_from=0):
    """int32 [B, Hx, nx]: about ``hit`` of the values taken from the selection row(s) they serve (so
    they exclude something; duplicates, -1 and out-of-range entries of the selection included), the rest
    random in-range values, -1, negatives, out-of-range values and duplicates of earlier values.
    ``tail_from``: positions before it never hold a value of the rows (hits only from there on)."""
    idx = to_numpy(indices)
    B, Hsel, _ = idx.shape
    x = np.full((B, Hx, nx), -1, np.int64)
    junk = np.array([-1, -1, -7, -(2**31), valid + 5, 2**31 - 1], np.int64)
    for b in range(B):
        for h in range(Hx):
            rows = idx[b] if Hx == 1 else idx[b, h:h + 1]
            pool = [int(v) for v in rows.reshape(-1) if v >= 0]
            members = set(pool)
            for j in range(nx):
                r = rng.random()
                if j >= tail_from and pool and r < hit:
                    x[b, h, j] = pool[rng.integers(0, len(pool))]
                elif r < hit + 0.25 and valid > 0:
                    y = int(rng.integers(0, valid))
                    x[b, h, j] = -1 if (j < tail_from and y in members) else y
                elif r < hit + 0.4:
                    x[b, h, j] = junk[rng.integers(0, len(junk))]
                elif j:
                    x[b, h, j] = x[b, h, j - 1]
    return x.astype(np.int32)


def strided_exclude(fw, X, margin):
    """X as a view of a wider buffer (row and head strides not compact) whose margins hold ``margin``
    (a value of the selection that X does not exclude: reading past X would wrongly skip it)."""
    B, Hx, nx = X.shape
    buf = np.full((B, Hx + 1, nx + 3), margin, np.int32)
    buf[:, 1:, 2:2 + nx] = X
    if fw == "numpy":
        return buf[:, 1:, 2:2 + nx]
    return torch.from_numpy(buf)[:, 1:, 2:2 + nx]


def count_ref(indices, exclude):
    """(hits, entries >= 0) of indices against exclude, one count per selection row (b, s)."""
    idx = to_numpy(indices)
    X = None if exclude is None else to_numpy(exclude)
    B, Hsel, _ = idx.shape
    hits = valid = 0
    for b in range(B):
        for s in range(Hsel):
            row = [int(v) for v in idx[b, s] if v >= 0]
            valid += len(row)
            if X is not None:
                xs = {int(v) for v in X[b, 0 if X.shape[1] == 1 else s]}
                hits += sum(1 for v in row if v in xs)
    return hits, valid


def ragged_lengths(B, cap, G):
    """Row lengths: one 0, one full, one ending inside a block, the rest random."""
    rng = np.random.default_rng(B * 31 + cap)
    lens = rng.integers(1, cap + 1, size=B)
    lens[0] = 0
    if B > 1:
        lens[1] = cap
    if B > 2:
        lens[2] = max(1, cap - max(1, G // 2))
    return lens.astype(np.int32)


def case_for(rng, mode, *, B=4, Hq=8, Hkv=2, D=64, Hsel=2, dtype="float32", n=None, **kw):
    kind, P, G = mode
    if kind == "bt":
        seq_len = max(16 * G, 4 * P)
        max_pages = -(-seq_len // P)
        n = n if n is not None else (12 if G >= 64 else 24)
        return make_case(rng, B=B, Hq=Hq, Hkv=Hkv, D=D, P=P, block_size=G, n=n, Hsel=Hsel, dtype=dtype,
                         seq_len=seq_len, lengths=ragged_lengths(B, max_pages * P, G), pad=0.15, oob=0.1, dup=0.15,
                         **kw)
    return make_case(rng, B=B, Hq=Hq, Hkv=Hkv, D=D, P=P, paged=False, n=n if n is not None else 40, Hsel=Hsel,
                     dtype=dtype, pad=0.15, oob=0.1, dup=0.15, **kw)


MODES = [("bt", 16, 16), ("bt", 64, 64), ("bt", 16, 64), ("bt", 64, 16), ("slots", 16, 1)]
MODE_IDS = [f"{k}-P{P}-G{G}" for k, P, G in MODES]
HEADS = [("Hkv", "Hkv"), ("Hkv", "1"), ("1", "1")]
HEAD_IDS = ["Hsel=Hkv-Hx=Hkv", "Hsel=Hkv-Hx=1", "Hsel=1-Hx=1"]


def exclusion_variants(rng, c, Hx):
    """(name, exclude) pairs: random, wide, empty, all -1, covering every entry, junk only."""
    idx = c.indices
    B = idx.shape[0]
    valid = c.n_entries_valid()
    cover = idx.reshape(B, 1, -1) if Hx == 1 else idx
    cover = np.concatenate([cover, cover[:, :, :3]], axis=2)  # with duplicates
    return [
        ("random nx=8", make_exclude(rng, idx, Hx, 8, valid)),
        ("wide nx=100", make_exclude(rng, idx, Hx, 100, valid, hit=0.3)),
        ("nx=0", np.zeros((B, Hx, 0), np.int32)),
        ("all -1", np.full((B, Hx, 5), -1, np.int32)),
        ("covers every entry", np.ascontiguousarray(cover, np.int32)),
        ("junk only", np.array([[[-1, -7, 2**31 - 1, valid + 5, -(2**31)]] * Hx] * B, np.int32)),
    ]


def repair_pair(c, fw, prior, X, what, *, counts_len=None, cast_dtype=None, strided=False, args=None):
    """repair with exclude=X vs repair with indices=missed(indices, X): out and lse bit for bit.
    With counts_len / cast_dtype the exclude call also takes counts / cast_out, checked exactly.
    args: c.args(fw) when already made. Returns (out, lse) of the exclude call."""
    q, k, v, idx, kw = args if args is not None else c.args(fw)
    X_in = conv(fw, X)
    if strided:
        row = [int(e) for e in c.indices.reshape(-1) if 0 <= e < c.n_entries_valid()]
        forbidden = {int(e) for e in X.reshape(-1)}
        margins = [e for e in row if e not in forbidden]
        if margins:
            X_in = strided_exclude(fw, X, margins[0])
    o1, l1 = clone(prior[0]), clone(prior[1])
    extra = {}
    start = [3, 5, 1000, 2000][:counts_len] if counts_len else None
    if counts_len:
        extra["counts"] = conv(fw, np.array(start, np.int64))
    if cast_dtype:
        extra["cast_out"] = conv(fw, np.full(tuple(c.q.shape), SENTINEL, np.float32), cast_dtype)
    r = gvr.prr.repair(o1, l1, q, k, v, idx, exclude=X_in, **kw, **extra)
    assert r[0] is o1 and r[1] is l1, f"{what}: repair must return (out, lse)"
    miss = gvr.prr.missed(idx, conv(fw, X))
    assert np.array_equal(to_numpy(miss), missed_ref(c.indices, X)), f"{what}: prr.missed"
    o2, l2 = clone(prior[0]), clone(prior[1])
    gvr.prr.repair(o2, l2, q, k, v, miss, **kw)
    assert_bits(o1, o2, f"{what}: out (exclude vs missed)")
    assert_bits(l1, l2, f"{what}: lse (exclude vs missed)")
    if counts_len:
        h, n = count_ref(c.indices, X)
        want = [start[0] + h, start[1] + n] + ([start[2] + h, start[3] + n] if counts_len == 4 else [])
        assert to_numpy(extra["counts"]).tolist() == want, f"{what}: counts"
    if cast_dtype:
        assert_bits(extra["cast_out"], converted(o1, fw, cast_dtype), f"{what}: cast_out vs out converted")
    return o1, l1


# --------------------------------------------------------------------------------------------------
# exclude: equal to repairing missed(indices, exclude), bit for bit
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_exclude_equals_repair_of_missed(mode, heads, gqa):
    rng = np.random.default_rng(1000 + 100 * MODES.index(mode) + 10 * HEADS.index(heads) + gqa)
    Hkv = 2
    Hsel = 1 if heads[0] == "1" else Hkv
    Hx = 1 if heads[1] == "1" else Hkv
    for i, (fw, dtype) in enumerate(FW_DTYPES):
        D = (64, 128)[(i + gqa) % 2]
        c = case_for(rng, mode, B=4, Hq=gqa * Hkv, Hkv=Hkv, D=D, Hsel=Hsel, dtype=dtype)
        args = c.args(fw)
        for start in ("random", "empty"):
            prior = prior_state(rng, 4, gqa * Hkv, D, fw, empty_frac=1.0 if start == "empty" else 0.25)
            for j, (name, X) in enumerate(exclusion_variants(rng, c, Hx)):
                what = f"{fw} {dtype} D={D} {start} prior, {name}"
                repair_pair(c, fw, prior, X, what, args=args)
                # the same call with every extra: the state is the same bits
                cast = dtype if (i + j) % 2 == 0 else "float32"
                repair_pair(c, fw, prior, X, what + f" (+counts +cast_out {cast}, strided exclude)",
                            counts_len=2 + 2 * (j % 2), cast_dtype=cast, strided=True, args=args)


def test_exclude_covering_every_entry_leaves_the_state_bit_identical():
    rng = np.random.default_rng(1)
    for mode in MODES:
        for Hsel, Hx in ((2, 2), (2, 1), (1, 1)):
            c = case_for(rng, mode, B=3, Hq=8, Hkv=2, D=64, Hsel=Hsel)
            out, lse = prior_state(rng, 3, 8, 64)
            out[0, 1] = -0.0  # signed zeros kept
            o0, l0 = out.copy(), lse.copy()
            idx = c.indices
            X = idx.reshape(3, 1, -1) if Hx == 1 else idx
            X = np.ascontiguousarray(X[:, :, ::-1])  # any order
            q, k, v, i_, kw = c.args("numpy")
            counts = np.zeros(4, np.int64)
            cast = np.full((3, 8, 64), SENTINEL, np.float32)
            gvr.prr.repair(out, lse, q, k, v, i_, exclude=X, counts=counts, cast_out=cast, **kw)
            assert same_bits(out, o0) and same_bits(lse, l0), (mode, Hsel, Hx)
            assert same_bits(cast, o0)
            n = int(np.count_nonzero(idx >= 0))
            assert counts.tolist() == [n, n, n, n]


def test_exclude_one_entry_at_a_time():
    """Every single entry excluded in turn: each result equals the repair of the row without it."""
    rng = np.random.default_rng(2)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=5, Hsel=2, pad=0, oob=0, lengths="full")
    prior = prior_state(rng, 2, 4, 64)
    for b in range(2):
        for s in range(2):
            for e in range(5):
                X = np.full((2, 2, 1), -1, np.int32)
                X[b, s, 0] = c.indices[b, s, e]
                repair_pair(c, "numpy", prior, X, f"exclude indices[{b}, {s}, {e}]", counts_len=2)


def test_duplicates_in_indices_each_tested_and_counted():
    """An entry listed twice and not excluded counts twice; listed twice and excluded: both skipped,
    two hits. Duplicates and junk in exclude change nothing."""
    rng = np.random.default_rng(3)
    c = make_case(rng, B=1, Hq=4, Hkv=1, D=64, P=16, block_size=16, n=4, pad=0, oob=0, lengths="full")
    a, b_, c2, d = (int(x) for x in c.indices[0, 0])
    idx = np.array([[[a, a, b_, -1, b_, c2, 2**31 - 1, d]]], np.int32)
    cc = c.with_indices(idx)
    prior = prior_state(rng, 1, 4, 64, empty_frac=0.0)
    for X, hits in (([[[b_]]], 2), ([[[b_, b_, b_, -1, 10**6]]], 2), ([[[a, 2**31 - 1]]], 3), ([[[-1, -1]]], 0),
                    ([[[c2, d, a, b_]]], 6)):
        X = np.array(X, np.int32)
        repair_pair(cc, "numpy", prior, X, f"duplicates, exclude {X.tolist()}", counts_len=2)
        counts = np.zeros(2, np.int64)
        q, k, v, i_, kw = cc.args("numpy")
        gvr.prr.repair(prior[0].copy(), prior[1].copy(), q, k, v, i_, exclude=X, counts=counts, **kw)
        assert counts.tolist() == [hits, 7], X.tolist()
    # not excluded: a listed twice counts twice (differs from listing it once)
    o2, l2 = repair_pair(cc, "numpy", prior, np.array([[[b_]]], np.int32), "a twice")
    once = c.with_indices(np.array([[[a, c2, d]]], np.int32))
    o3, l3 = repair_pair(once, "numpy", prior, np.zeros((1, 1, 0), np.int32), "a once")
    assert not np.allclose(l2, l3)


# --------------------------------------------------------------------------------------------------
# exclude: against the float64 reference
# --------------------------------------------------------------------------------------------------


def _split_selection(rng, pred, valid, n_sel, H):
    """selected [B, H, n_sel]: about half of them predicted entries, the rest fresh ones, shuffled."""
    B = pred.shape[0]
    sel = np.empty((B, H, n_sel), np.int32)
    for b in range(B):
        for s in range(H):
            p = sorted({int(x) for x in pred[b, min(s, pred.shape[1] - 1)] if 0 <= x < valid})
            pick = list(rng.choice(p, size=min(len(p), n_sel // 2), replace=False)) if p else []
            fresh = [x for x in rng.permutation(valid) if x not in p][:n_sel - len(pick)]
            row = (pick + fresh + [-1] * n_sel)[:n_sel]
            rng.shuffle(row)
            sel[b, s] = row
    return sel


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_torch)])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_superset_mode_against_reference(mode, dtype):
    """PRR's superset mode in one call: attention over predicted, then repair(selected,
    exclude=predicted) = attention over predicted ∪ selected (within assert_close)."""
    rng = np.random.default_rng(2000 + 10 * MODES.index(mode) + (dtype == "bfloat16"))
    fw = "torch" if dtype == "bfloat16" else "numpy"
    for Hsel, Hx, D in ((2, 2, 64), (2, 1, 128), (1, 1, 64)):
        c = case_for(rng, mode, B=3, Hq=8, Hkv=2, D=D, Hsel=Hsel, dtype=dtype, n=1)
        valid = c.n_entries_valid()
        n_pred, n_sel = (6, 8) if mode[2] >= 64 else (12, 16)
        pred = random_indices(rng, 3, Hx, n_pred, valid, pad=0.1, oob=0.05, dup=0.1)
        sel = _split_selection(rng, pred, valid, n_sel, Hsel)
        sel[0, 0, 0] = 2**31 - 1  # out of range: counted, names nothing
        q, k, v, _, kw = c.args(fw)
        o = np.empty((3, 8, D), np.float32) if fw == "numpy" else torch.empty(3, 8, D)
        out, lse = gvr.sparse_attention(q, k, v, conv(fw, pred), out=o, **kw)
        counts = conv(fw, np.zeros(2, np.int64))
        gvr.prr.repair(out, lse, q, k, v, conv(fw, sel), exclude=conv(fw, pred), counts=counts, **kw)
        miss = missed_ref(sel, pred)
        pred_h = np.repeat(pred, 2 // Hx, axis=1) if Hsel == 2 else pred
        union = np.concatenate([pred_h, miss], axis=2)
        na, nb = c.naive(pred), c.naive(miss)
        no, nl = merge_naive(na[0], na[1], nb[0], nb[1])
        ro, rl = c.ref(union)
        what = f"{mode} {dtype} Hsel={Hsel} Hx={Hx} D={D}"
        assert_close(to_numpy(out), ro, no, dtype, what=f"{what} out")
        assert_close(to_numpy(lse), rl, nl, dtype, what=f"{what} lse")
        assert np.all(to_numpy(out)[rl == NEG_INF] == 0) and not np.isnan(to_numpy(out)).any()
        assert to_numpy(counts).tolist() == list(count_ref(sel, pred))


@pytest.mark.parametrize("dtype", ["float32", "float16", pytest.param("bfloat16", marks=needs_torch)])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_random_prior_and_exclusion_against_reference(gqa, dtype):
    rng = np.random.default_rng(40 + gqa)
    fw = "torch" if dtype == "bfloat16" else "numpy"
    for mode, D in ((("bt", 16, 16), 64), (("slots", 16, 1), 128), (("bt", 64, 64), 128)):
        for Hsel, Hx in ((2, 2), (2, 1), (1, 1)):
            c = case_for(rng, mode, B=3, Hq=gqa * 2, Hkv=2, D=D, Hsel=Hsel, dtype=dtype)
            X = make_exclude(rng, c.indices, Hx, 10, c.n_entries_valid())
            po, pl = prior_state(rng, 3, gqa * 2, D)
            out, lse = repair_pair(c, fw, (conv(fw, po), conv(fw, pl)), X, f"{mode} {dtype} D={D}")
            miss = missed_ref(c.indices, X)
            mo, ml = c.ref(miss)
            ro, rl = merge_ref(po, pl, mo, ml)
            nmo, nml = c.naive(miss)
            no, nl = merge_naive(po, pl, nmo, nml)
            what = f"{mode} {dtype} gqa={gqa} Hsel={Hsel} Hx={Hx}"
            assert_close(to_numpy(out), ro, no, dtype, what=f"{what} out")
            assert_close(to_numpy(lse), rl, nl, dtype, what=f"{what} lse")
            untouched = ml == NEG_INF  # nothing valid to add: the prior exactly
            assert same_bits(to_numpy(out)[untouched], po[untouched])
            assert same_bits(to_numpy(lse)[untouched], pl[untouched])


def test_layouts_and_strided_q():
    rng = np.random.default_rng(5)
    for layout, combined in (("HND", False), ("NHD", True), ("HND", True)):
        c = make_case(rng, B=3, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=10, Hsel=2, layout=layout,
                      combined=combined, q_padded=True, dup=0.1)
        X = make_exclude(rng, c.indices, 2, 6, c.n_entries_valid())
        prior = prior_state(rng, 3, 8, 64)
        repair_pair(c, "numpy", prior, X, f"{layout} combined={combined}", counts_len=4, cast_dtype="float32",
                    strided=True)


@pytest.mark.parametrize("fw", ["numpy", pytest.param("torch", marks=needs_torch)])
def test_exclude_any_strides(fw):
    """exclude as a broadcast (stride 0 along B), a transposed buffer, a reversed (negative-stride) view:
    the same bits as the compact array."""
    rng = np.random.default_rng(14)
    c = case_for(rng, ("bt", 16, 16), B=3, Hq=8, Hkv=2, D=64, Hsel=2)
    args = c.args(fw)
    prior = prior_state(rng, 3, 8, 64, fw)
    X1 = make_exclude(rng, c.indices[:1], 2, 6, c.n_entries_valid())
    X = make_exclude(rng, c.indices, 2, 6, c.n_entries_valid())
    views = {"broadcast over B": (np.broadcast_to(X1, (3, 2, 6)), np.repeat(X1, 3, axis=0))}
    if fw == "numpy":
        views["transposed buffer"] = (np.ascontiguousarray(X.transpose(1, 0, 2)).transpose(1, 0, 2), X)
        views["reversed rows"] = (np.ascontiguousarray(X[::-1])[::-1], X)
    else:
        views["broadcast over B"] = (torch.from_numpy(X1).expand(3, 2, 6), np.repeat(X1, 3, axis=0))
        views["transposed buffer"] = (torch.from_numpy(np.ascontiguousarray(X.transpose(1, 0, 2))).transpose(0, 1), X)
    for name, (Xv, Xc) in views.items():
        q, k, v, idx, kw = args
        o1, l1 = clone(prior[0]), clone(prior[1])
        counts = conv(fw, np.zeros(2, np.int64))
        gvr.prr.repair(o1, l1, q, k, v, idx, exclude=Xv, counts=counts, **kw)
        o2, l2 = repair_pair(c, fw, prior, np.ascontiguousarray(Xc), name, args=args)
        assert_bits(o1, o2, f"{name}: out")
        assert_bits(l1, l2, f"{name}: lse")
        assert to_numpy(counts).tolist() == list(count_ref(c.indices, Xc)), name


def test_empty_selection_and_empty_rows():
    rng = np.random.default_rng(6)
    c = case_for(rng, ("bt", 16, 16), B=3, Hq=4, Hkv=2, D=64, Hsel=2)
    prior = prior_state(rng, 3, 4, 64)
    for n in (0, 3):
        cc = c.with_indices(np.full((3, 2, n), -1, np.int32))
        for X in (np.zeros((3, 2, 0), np.int32), np.array([[[1, 2]] * 2] * 3, np.int32)):
            o, l = repair_pair(cc, "numpy", prior, X, f"n={n} nx={X.shape[2]}", counts_len=4, cast_dtype="float32")
            assert same_bits(o, prior[0]) and same_bits(l, prior[1])


# --------------------------------------------------------------------------------------------------
# counts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fw", ["numpy", pytest.param("torch", marks=needs_torch)])
@pytest.mark.parametrize("ncounts", [2, 4])
@pytest.mark.parametrize("Hsel", [1, 2])
def test_counts_accumulate_over_calls(Hsel, ncounts, fw):
    rng = np.random.default_rng(7 + Hsel + ncounts)
    start = [11, 22, 333, 444][:ncounts]
    counts = conv(fw, np.array(start, np.int64))
    total = list(start)
    for call, (mode, gqa, with_x) in enumerate(((("bt", 16, 16), 4, True), (("slots", 16, 1), 8, True),
                                                (("bt", 64, 64), 1, False), (("bt", 16, 64), 4, True))):
        Hx = 1 if (Hsel == 1 or call % 2) else 2
        c = case_for(rng, mode, B=4, Hq=gqa * 2, Hkv=2, D=64, Hsel=Hsel)
        X = make_exclude(rng, c.indices, Hx, 12, c.n_entries_valid()) if with_x else None
        q, k, v, idx, kw = c.args(fw)
        out, lse = prior_state(rng, 4, gqa * 2, 64, fw)
        kwx = {} if X is None else {"exclude": conv(fw, X)}
        gvr.prr.repair(out, lse, q, k, v, idx, counts=counts, **kwx, **kw)
        h, n = count_ref(c.indices, X)
        assert n == int(np.count_nonzero(c.indices >= 0)) and (X is not None or h == 0)
        if X is not None:  # independently: hits = entries >= 0 minus the missed ones
            assert h == n - int(np.count_nonzero(missed_ref(c.indices, X) >= 0))
            assert h > 0, "the test wants hits"
        total[0] += h
        total[1] += n
        if ncounts == 4:
            total[2] += h
            total[3] += n
        assert to_numpy(counts).tolist() == total, f"call {call}"
    assert to_numpy(counts).dtype == np.int64


def test_counts_once_per_selection_row_not_per_head():
    """Hsel = 1 rows are counted once whatever Hkv and Hq; Hsel = Hkv rows once each."""
    rng = np.random.default_rng(8)
    for Hkv, gqa in ((1, 1), (2, 4), (4, 1), (4, 2)):
        c = make_case(rng, B=3, Hq=gqa * Hkv, Hkv=Hkv, D=64, P=16, block_size=16, n=9, Hsel=1, dup=0.2)
        X = make_exclude(rng, c.indices, 1, 6, c.n_entries_valid())
        q, k, v, idx, kw = c.args("numpy")
        counts = np.zeros(4, np.int64)
        out, lse = prior_state(rng, 3, gqa * Hkv, 64)
        gvr.prr.repair(out, lse, q, k, v, idx, exclude=X, counts=counts, **kw)
        h, n = count_ref(c.indices, X)
        assert counts.tolist() == [h, n, h, n], (Hkv, gqa)
        # the same rows given per KV head (Hsel = Hkv): Hkv times as many
        cc = c.with_indices(np.repeat(c.indices, Hkv, axis=1))
        q, k, v, idx, kw = cc.args("numpy")
        counts = np.zeros(2, np.int64)
        gvr.prr.repair(out, lse, q, k, v, idx, exclude=X, counts=counts, **kw)
        assert counts.tolist() == [Hkv * h, Hkv * n], (Hkv, gqa)


def test_counts_count_masked_and_out_of_range_entries():
    """counts are about the entries' values: an entry >= 0 counts whether or not it names tokens (past
    the row's length, out of range, in a row of length 0)."""
    rng = np.random.default_rng(9)
    c = make_case(rng, B=2, Hq=4, Hkv=1, D=64, P=16, block_size=16, n=4, pad=0, oob=0, seq_len=128,
                  lengths=np.array([0, 40]))
    nb = c.n_entries_valid()  # 8 blocks; row 1 has 3 (40 tokens)
    idx = np.array([[[0, 1, 2**31 - 1, -1, -5]], [[0, 5, nb, 2**31 - 1, 7]]], np.int32)
    X = np.array([[[1, 2**31 - 1, -1]], [[5, 7, nb + 1]]], np.int32)
    cc = c.with_indices(idx)
    o, l = repair_pair(cc, "numpy", prior_state(rng, 2, 4, 64), X, "masked entries", counts_len=4)
    counts = np.zeros(2, np.int64)
    q, k, v, i_, kw = cc.args("numpy")
    gvr.prr.repair(o, l, q, k, v, i_, exclude=X, counts=counts, **kw)
    assert counts.tolist() == [4, 8]
    counts = np.zeros(2, np.int64)
    gvr.prr.repair(o, l, q, k, v, i_, counts=counts, **kw)
    assert counts.tolist() == [0, 8]


# --------------------------------------------------------------------------------------------------
# cast_out
# --------------------------------------------------------------------------------------------------

# float32 values halfway between two float16 / bfloat16 values, and other rounding cases
TIES = {
    "float16": [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), -(1 + 3 * 2**-11), 2**-25, 3 * 2**-25, 2**-24 * 1.5,
                65504.0, 1 + 2**-11 + 2**-20, -0.0, 1e-9, 2048 + 1],
    "bfloat16": [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8), 1 + 2**-8 + 2**-20, 256 + 1, 3.0e38,
                 -0.0, 1e-40, 2**-133, 1.00390625, 1.01171875],
    "float32": [1 + 2**-23, -0.0, 1e-40],
}


@pytest.mark.parametrize("fw,dtype,cast", [
    ("numpy", "float32", "float32"), ("numpy", "float16", "float16"), ("numpy", "float16", "float32"),
    pytest.param("torch", "bfloat16", "bfloat16", marks=needs_torch),
    pytest.param("torch", "bfloat16", "float32", marks=needs_torch),
    pytest.param("torch", "float16", "float16", marks=needs_torch),
    pytest.param("torch", "float32", "float32", marks=needs_torch)])
def test_cast_out_is_the_repaired_state_converted(fw, dtype, cast):
    rng = np.random.default_rng(10)
    B, Hq, Hkv, D = 3, 8, 2, 64
    c = make_case(rng, B=B, Hq=Hq, Hkv=Hkv, D=D, P=16, block_size=16, n=8, Hsel=2, dtype=dtype, pad=0.1, oob=0,
                  lengths=np.array([64, 0, 48]), seq_len=64)
    idx = c.indices.copy()
    idx[0, 1] = -1  # row 0, KV head 1: nothing (query heads 4..7 untouched); row 1: length 0
    c = c.with_indices(idx)
    X = make_exclude(rng, idx, Hkv, 6, c.n_entries_valid())
    Xw = np.concatenate([X, np.full((B, Hkv, idx.shape[2]), -1, np.int32)], axis=2)
    Xw[2, 0, 6:6 + idx.shape[2]] = idx[2, 0]  # row 2, KV head 0: every entry excluded (untouched)
    po, pl = prior_state(rng, B, Hq, D, empty_frac=0.2)
    ties = np.array(TIES[cast], np.float32)
    po[0, 4, :len(ties)] = ties  # untouched heads: their (prior) out converted
    po[0, 5, :len(ties)] = ties[::-1]
    po[0, 6] = 0
    pl[0, 6] = NEG_INF
    pl[0, 4:6] = 0.5
    if cast == "float16":
        po[1] = np.clip(po[1], -60000, 60000)
    buf = conv(fw, np.full((B, Hq + 2, D + 24), SENTINEL, np.float32), cast)
    cast_out = buf[:, 1:Hq + 1, 8:8 + D]  # strided: padded rows and heads
    prior = (conv(fw, po), conv(fw, pl))
    out, lse = repair_pair(c, fw, prior, Xw, f"{fw} {dtype} -> {cast}")
    o1, l1 = clone(prior[0]), clone(prior[1])
    q, k, v, i_, kw = c.args(fw)
    gvr.prr.repair(o1, l1, q, k, v, i_, exclude=conv(fw, Xw), cast_out=cast_out, **kw)
    assert_bits(o1, out, "out with cast_out vs without")
    assert_bits(l1, lse, "lse with cast_out vs without")
    assert_bits(cast_out, converted(o1, fw, cast), "cast_out vs out converted by the framework")
    if cast != "float32":  # round to nearest even, independently of the framework's conversion
        assert np.array_equal(to_numpy(cast_out).astype(np.float64), round_to(to_numpy(o1), cast))
    else:
        assert_bits(cast_out, o1, "float32 cast_out = out exactly")
    # untouched heads: out as it was, cast_out its conversion
    for b, h in ((0, 4), (0, 5), (0, 6), (0, 7), (1, 0), (1, 3), (1, 7), (2, 0), (2, 3)):
        assert same_bits(to_numpy(o1)[b, h], po[b, h]) and same_bits(to_numpy(l1)[b, h], pl[b, h]), (b, h)
    # the padding around cast_out is untouched
    full = to_numpy(buf.float() if fw == "torch" else buf.astype(np.float32))
    assert np.all(full[:, 0] == SENTINEL) and np.all(full[:, Hq + 1] == SENTINEL)
    assert np.all(full[:, :, :8] == SENTINEL) and np.all(full[:, :, 8 + D:] == SENTINEL)


@pytest.mark.parametrize("fw,dtype", [("numpy", "float16"), pytest.param("torch", "bfloat16", marks=needs_torch)])
def test_cast_out_when_nothing_is_added(fw, dtype):
    """indices all empty, n = 0, or every entry excluded: the state stays, cast_out = it converted."""
    rng = np.random.default_rng(11)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=4, Hsel=2, dtype=dtype)
    po, pl = prior_state(rng, 2, 4, 64, empty_frac=0.3)
    for name, idx, X in (("n=0", np.zeros((2, 2, 0), np.int32), None),
                         ("all -1", np.full((2, 2, 3), -1, np.int32), None),
                         ("all excluded", c.indices, c.indices),
                         ("all excluded, no exclude width", np.zeros((2, 2, 0), np.int32), np.zeros((2, 1, 0), np.int32))):
        cc = c.with_indices(idx)
        q, k, v, i_, kw = cc.args(fw)
        for cast in (dtype, "float32"):
            o, l = conv(fw, po), conv(fw, pl)
            co = conv(fw, np.full((2, 4, 64), SENTINEL, np.float32), cast)
            kwx = {} if X is None else {"exclude": conv(fw, X)}
            gvr.prr.repair(o, l, q, k, v, i_, cast_out=co, **kwx, **kw)
            assert same_bits(to_numpy(o), po) and same_bits(to_numpy(l), pl), name
            assert_bits(co, converted(o, fw, cast), f"{name}: cast_out ({cast})")


# --------------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fw,dtype", [("numpy", "float32"), pytest.param("torch", "bfloat16", marks=needs_torch)])
def test_determinism(fw, dtype):
    rng = np.random.default_rng(12)
    c = make_case(rng, B=4, Hq=8, Hkv=2, D=128, P=16, paged=False, n=600, Hsel=2, extra_pages=60, dtype=dtype,
                  dup=0.05)
    X = make_exclude(rng, c.indices, 2, 64, c.n_entries_valid())
    q, k, v, idx, kw = c.args(fw)
    po, pl = prior_state(rng, 4, 8, 128, fw)
    results = []
    for _ in range(3):
        o, l = clone(po), clone(pl)
        counts = conv(fw, np.zeros(4, np.int64))
        co = conv(fw, np.zeros((4, 8, 128), np.float32), dtype)
        gvr.prr.repair(o, l, q, k, v, idx, exclude=conv(fw, X), counts=counts, cast_out=co, **kw)
        results.append((bits(o), bits(l), bits(co), to_numpy(counts).tolist()))
    for r in results[1:]:
        for a, b_ in zip(r, results[0]):
            assert np.array_equal(a, b_)


# --------------------------------------------------------------------------------------------------
# bad inputs: the named error, nothing passed in modified
# --------------------------------------------------------------------------------------------------


def _name_re(name):
    return rf"\b{re.escape(name)}\b"


def _snapshot(x):
    if isinstance(x, np.ndarray):
        owner = x
        while isinstance(getattr(owner, "base", None), np.ndarray):
            owner = owner.base
        return owner, owner.copy()
    if torch is not None and isinstance(x, torch.Tensor):
        return x, x.detach().clone()
    return None


def expect_error(exc, name, *args, **kw):
    """gvr.prr.repair(*args, **kw) raises ``exc`` naming ``name``; nothing passed in is modified."""
    snaps = [s for s in (_snapshot(v) for v in list(args) + list(kw.values())) if s is not None]
    with pytest.raises(exc, match=_name_re(name)) as ei:
        gvr.prr.repair(*args, **kw)
    for obj, copy in snaps:
        if isinstance(obj, np.ndarray):
            assert same_bits(obj, copy), f"an argument was modified by a failed call ({name})"
        else:
            assert np.array_equal(bits(obj), bits(copy)), f"an argument was modified by a failed call ({name})"
    return ei


def bad_problem(fw="numpy", dtype="float32", Hsel=2):
    rng = np.random.default_rng(13)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=16, P=4, block_size=4, n=3, Hsel=Hsel, dtype=dtype, seq_len=16,
                  lengths="full")
    q, k, v, idx, kw = c.args(fw)
    out = conv(fw, np.full((2, 4, 16), SENTINEL, np.float32))
    lse = conv(fw, np.full((2, 4), SENTINEL, np.float32))
    X = conv(fw, np.array([[[0, 1]] * Hsel] * 2, np.int32))
    extras = dict(exclude=X, counts=conv(fw, np.array([1, 2, 3, 4], np.int64)),
                  cast_out=conv(fw, np.full((2, 4, 16), SENTINEL, np.float32), dtype))
    return (out, lse, q, k, v, idx), kw, extras


def test_valid_bad_problem_runs():
    args, kw, extras = bad_problem()
    gvr.prr.repair(*args, **kw, **extras)
    h, n = count_ref(args[5], extras["exclude"])
    assert np.isfinite(args[1]).all() and extras["counts"].tolist() == [1 + h, 2 + n, 3 + h, 4 + n]
    assert same_bits(extras["cast_out"], args[0])


def test_exclude_heads_with_a_shared_selection():
    args, kw, extras = bad_problem(Hsel=1)
    X2 = np.array([[[0], [1]]] * 2, np.int32)  # Hx = 2 = Hkv but Hsel = 1
    expect_error(ValueError, "exclude", *args, **kw, **dict(extras, exclude=X2))


def test_exclude_shape_and_dtype():
    args, kw, extras = bad_problem()
    X = extras["exclude"]
    expect_error(ValueError, "exclude", *args, **kw, **dict(extras, exclude=np.zeros((2, 3, 2), np.int32)))  # Hx 3
    expect_error(ValueError, "exclude", *args, **kw, **dict(extras, exclude=np.zeros((3, 2, 2), np.int32)))  # B
    expect_error(ValueError, "exclude", *args, **kw, **dict(extras, exclude=X[:, 0]))  # 2-D
    expect_error(ValueError, "exclude", *args, **kw, **dict(extras, exclude=X[None]))  # 4-D
    expect_error((TypeError, ValueError), "exclude", *args, **kw, **dict(extras, exclude=X.astype(np.int64)))
    expect_error((TypeError, ValueError), "exclude", *args, **kw, **dict(extras, exclude=X.astype(np.float32)))
    wide = np.repeat(X, 2, axis=2)[:, :, ::2]  # non-unit stride along nx
    expect_error(ValueError, "exclude", *args, **kw, **dict(extras, exclude=wide))


def test_counts_dtype_and_size():
    args, kw, extras = bad_problem()
    for dt in (np.int32, np.float64, np.uint64, np.int16):
        expect_error(TypeError, "counts", *args, **kw, **dict(extras, counts=np.zeros(4, dt)))
    for n in (0, 1, 3, 5, 8):
        expect_error(ValueError, "counts", *args, **kw, **dict(extras, counts=np.zeros(n, np.int64)))
    expect_error(ValueError, "counts", *args, **kw, **dict(extras, counts=np.zeros((2, 2), np.int64)))
    expect_error(ValueError, "counts", *args, **kw, **dict(extras, counts=np.zeros((1, 4), np.int64)))
    expect_error(ValueError, "counts", *args, **kw, **dict(extras, counts=np.zeros(8, np.int64)[::2]))
    # without exclude too
    expect_error(TypeError, "counts", *args, **kw, counts=np.zeros(2, np.int32))
    expect_error(ValueError, "counts", *args, **kw, counts=np.zeros(3, np.int64))


def test_cast_out_dtype_and_shape():
    args, kw, extras = bad_problem()  # float32 q: cast_out float32 only
    for dt in (np.float16, np.float64, np.int32):
        exc = ValueError if dt == np.float16 else (TypeError, ValueError)
        expect_error(exc, "cast_out", *args, **kw, **dict(extras, cast_out=np.zeros((2, 4, 16), dt)))
    for shape in ((2, 4, 8), (2, 3, 16), (1, 4, 16), (3, 4, 16), (2, 4, 16, 1), (4, 16), (2, 4, 32)):
        expect_error(ValueError, "cast_out", *args, **kw, **dict(extras, cast_out=np.zeros(shape, np.float32)))
    strided = np.zeros((2, 4, 32), np.float32)[:, :, ::2]
    expect_error(ValueError, "cast_out", *args, **kw, **dict(extras, cast_out=strided))
    expect_error(ValueError, "cast_out", *args, **kw, cast_out=np.zeros((2, 4, 8), np.float32))  # alone


@needs_torch
def test_cast_out_dtype_with_half_precision_q():
    args, kw, extras = bad_problem("torch", "bfloat16")
    for dt in (torch.float16, torch.float64):
        exc = ValueError if dt == torch.float16 else (TypeError, ValueError)
        expect_error(exc, "cast_out", *args, **kw, **dict(extras, cast_out=torch.zeros(2, 4, 16, dtype=dt)))
    args, kw, extras = bad_problem("torch", "float16")
    expect_error(ValueError, "cast_out", *args, **kw,
                 **dict(extras, cast_out=torch.zeros(2, 4, 16, dtype=torch.bfloat16)))
    expect_error(ValueError, "cast_out", *args, **kw,
                 **dict(extras, cast_out=torch.zeros(2, 4, 15, dtype=torch.float16)))
    # the accepted ones
    for dt in (torch.float16, torch.float32):
        gvr.prr.repair(*args, **kw, **dict(extras, cast_out=torch.zeros(2, 4, 16, dtype=dt)))


def test_out_not_float32_with_the_extras():
    args, kw, extras = bad_problem(dtype="float16")
    out16 = np.full((2, 4, 16), SENTINEL, np.float16)
    expect_error(ValueError, "out", out16, *args[1:], **kw, **extras)


def test_late_errors_leave_counts_and_cast_out_untouched():
    """An error found after the extras were accepted (lengths' values are read last on the CPU)."""
    args, kw, extras = bad_problem()
    bad = dict(kw, lengths=np.array([1, 99], np.int32))
    expect_error(ValueError, "lengths", *args, **bad, **extras)
    expect_error(ValueError, "block_size", *args, **dict(kw, block_size=3), **extras)
    expect_error(ValueError, "lse", *args[:1], args[1][:, :2], *args[2:], **kw, **extras)
