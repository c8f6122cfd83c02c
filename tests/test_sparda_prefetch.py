"""gvr.sparda.prefetch and gvr.sparda.HostKVCache (SparDA's host KV cache): the staging policy and the block
copies bit for bit against an independent NumPy reference (tests/sparda_prefetch_reference.py, itself
checked on hand-worked cases), over page sizes, NHD / HND layouts, combined K/V views, block tables or
none, padding / out-of-range / duplicate entries, resident maps fed back (honest and garbage); the
attention round trip (attention over the staging cache through the slot map equals attention over the
host cache through the block table, bit for bit); determinism; bad inputs named and nothing modified on
error; HostKVCache's views, append (against the reference store), close / BufferError / context manager.

GPU tests (marked gpu; the ``cuda`` fixture) hold the CUDA paths (methods "kernel", "tma", "memcpy") to the C
CPU path byte for byte, chains of resident maps, pageable memory refused, graph capture of
forecast_select -> prefetch -> sparse_attention, determinism, max_ctas and the gather CTAs' shape."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import gvr
from harness import torch_or_none
from sparda_prefetch_reference import as_int_numpy, bits, prefetch_plan, prefetch_reference, store_reference

torch = torch_or_none()

ITEMSIZE = {"uint8": 1, "float8_e4m3fn": 1, "float16": 2, "bfloat16": 2, "float32": 4}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_SINT = {1: np.uint8, 2: np.int16, 4: np.int32}  # torch.from_numpy takes these


def sparda():
    """gvr.sparda (prefetch / HostKVCache may not exist yet: the tests then fail with AttributeError)."""
    return gvr.sparda


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def to_np(x):
    """NumPy copy of an integer result (NumPy or torch on any device)."""
    return as_int_numpy(x)


def same_bits(a, b) -> bool:
    a, b = bits(a), bits(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def random_bits(rng, shape, itemsize):
    return rng.integers(0, 2 ** (8 * itemsize), shape, dtype=_UINT[itemsize])


def paged(raw, dtype, layout, combined, fw="numpy", device=None):
    """(k, v) ``[N, P, Hkv, D]`` views of ``raw`` (unsigned bits shaped ``[N, 2, *inner]`` when combined,
    ``[2, N, *inner]`` otherwise; inner = (P, Hkv, D) for NHD, (Hkv, P, D) for HND) in ``dtype``."""
    if fw == "numpy":
        arr = raw.view(np.dtype(dtype))
    else:
        arr = torch.from_numpy(raw.view(_SINT[raw.itemsize])).view(getattr(torch, dtype))
        if device is not None:
            arr = arr.to(device)
    k, v = (arr[:, 0], arr[:, 1]) if combined else (arr[0], arr[1])
    if layout == "HND":
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    return k, v


def kv_pair(rng, N, P, Hkv, D, dtype, layout="NHD", combined=False, fw="numpy", device=None):
    """Random-bit K and V ``[N, P, Hkv, D]`` (NaN payloads included: compared as bits)."""
    inner = (P, Hkv, D) if layout == "NHD" else (Hkv, P, D)
    shape = ((N, 2) if combined else (2, N)) + inner
    return paged(random_bits(rng, shape, ITEMSIZE[dtype]), dtype, layout, combined, fw, device)


def selection(rng, B, Hsel, n, num_pages, max_pages=None, *, bad=True):
    """(indices int32 [B, Hsel, n], block_table int32 [B, max_pages] or None, max_pages): random logical
    blocks with duplicates; with ``bad``: -1 padding, entries >= max_pages, pages < 0 / >= num_pages."""
    if max_pages is None:
        bt, max_pages = None, num_pages
    else:
        bt = rng.integers(0, num_pages, (B, max_pages)).astype(np.int32)  # rows may share pages
        if bad and max_pages >= 3:
            bt[0, 1] = -1
            bt[-1, max_pages - 1] = num_pages
            bt[rng.integers(0, B), rng.integers(0, max_pages)] = num_pages + 7
    ix = rng.integers(0, max_pages, (B, Hsel, n)).astype(np.int32)
    if n >= 2:
        ix[:, :, 1] = ix[:, :, 0]  # a duplicate in every row and head
    if bad and n >= 4:
        ix[0, 0, -1] = -1
        ix[-1, -1, 2] = max_pages
        ix[rng.integers(0, B), rng.integers(0, Hsel), 3] = max_pages + 3
        ix[0, -1, 3] = -7
    return ix, bt, max_pages


def s_min(B, Hsel, n, max_pages):
    return min(B * Hsel * n, B * max_pages)


def check_against_reference(hk, hv, ix, dk, dv, bt=None, res=None, *, what="", **kw):
    """Run gvr.sparda.prefetch on dk / dv (in place) and compare everything with the reference computed
    from the inputs as they were; returns the reference's result."""
    want = prefetch_reference(hk, hv, ix, dk, dv, block_table=bt, resident=res)
    counts = np.full(2, -5, np.int64)
    if type(dk).__module__.startswith("torch"):
        counts = torch.from_numpy(counts)  # the outputs in dst's framework
    got = sparda().prefetch(hk, hv, ix, dk, dv, block_table=bt, resident=res, counts=counts, **kw)
    assert np.array_equal(to_np(got), want["slot_map"]), f"{what}: slot_map\n{to_np(got)}\n{want['slot_map']}"
    assert np.array_equal(to_np(counts), want["counts"]), f"{what}: counts {counts} != {want['counts']}"
    assert same_bits(dk, want["dst_k"]), f"{what}: dst_k content"
    assert same_bits(dv, want["dst_v"]), f"{what}: dst_v content"
    return want


def snapshot(*arrays):
    return [None if a is None else np.array(bits(a), copy=True) for a in arrays]


def assert_unchanged(before, *arrays, what=""):
    for i, (b, a) in enumerate(zip(before, arrays)):
        if a is not None:
            assert np.array_equal(bits(a), b), f"{what}: argument {i} was modified by a failed call"


# --------------------------------------------------------------------------------------------------
# the reference itself, on hand-worked cases
# --------------------------------------------------------------------------------------------------
# num_pages 6, S 6, B 2, max_pages 4, Hsel 1, n 3.
HAND_BT = np.array([[5, 2, -1, 0],
                    [1, 7, 3, 4]], np.int32)          # (0, 2): page -1, (1, 1): page 7 >= 6: invalid
HAND_IX = np.array([[[3, -1, 1]],                     # needed (0, 1) page 2, (0, 3) page 0
                    [[2, 1, 2]]], np.int32)           # needed (1, 2) page 3 (twice); (1, 1) invalid page
HAND_RES = np.array([[4, 2, 0, 2],                    # (0,0) owns 4; (0,1) owns 2; (0,2) invalid page: no
                     [9, 1, 4, -1]], np.int32)        # claim; (0,3) 2 taken; (1,0) 9 >= S; (1,1) invalid;
#                                                       (1,2) 4 taken
# owners {2: (0,1), 4: (0,0)}; kept (0,1) -> 2; free: unowned 0, 1, 3, 5 then 4 (owner (0,0) not needed);
# moved in row-major order: (0,3) -> 0, (1,2) -> 1; retained: (0,0) keeps 4 (not handed out).
HAND_MAP = np.array([[4, 2, -1, 0],
                     [-1, -1, 1, -1]], np.int32)
HAND_COUNTS = np.array([2, 3], np.int64)
HAND_MOVES = [(0, 3, 0, 0), (1, 2, 3, 1)]  # (b, j, host page, slot)

# identity table, num_pages 4, S 2, B 1: resident (0,0) -> 1, (0,1) -> 0; needed (0,0) kept in 1, (0,3)
# moved into 0 (owner (0,1) not needed: evicted, -1).
HAND2_IX = np.array([[[0, 3]]], np.int32)
HAND2_RES = np.array([[1, 0, -1, -1]], np.int32)
HAND2_MAP = np.array([[1, -1, -1, 0]], np.int32)
HAND2_COUNTS = np.array([1, 2], np.int64)


def test_reference_hand_worked():
    sm, counts, moves = prefetch_plan(HAND_IX, 6, 6, HAND_BT, HAND_RES)
    assert np.array_equal(sm, HAND_MAP), sm
    assert np.array_equal(counts, HAND_COUNTS) and moves == HAND_MOVES
    # without resident: nothing owned, (0,1) -> 0, (0,3) -> 1, (1,2) -> 2
    sm, counts, moves = prefetch_plan(HAND_IX, 6, 6, HAND_BT, None)
    assert np.array_equal(sm, np.array([[-1, 0, -1, 1], [-1, -1, 2, -1]], np.int32)), sm
    assert np.array_equal(counts, [3, 3]) and [m[2:] for m in moves] == [(2, 0), (0, 1), (3, 2)]
    sm, counts, moves = prefetch_plan(HAND2_IX, 4, 2, None, HAND2_RES)
    assert np.array_equal(sm, HAND2_MAP) and np.array_equal(counts, HAND2_COUNTS) and moves == [(0, 3, 3, 0)]
    # the same, S 5: free = unowned 2, 3, 4 first: (0,3) -> 2 and (0,1) is retained in 0
    sm, counts, _ = prefetch_plan(HAND2_IX, 4, 5, None, HAND2_RES)
    assert np.array_equal(sm, [[1, 0, -1, 2]]) and np.array_equal(counts, [1, 2])
    # the copies: only the moved slots change, byte for byte
    rng = np.random.default_rng(1)
    hk, hv = kv_pair(rng, 6, 16, 2, 16, "float16")
    dk, dv = kv_pair(rng, 6, 16, 2, 16, "float16")
    r = prefetch_reference(hk, hv, HAND_IX, dk, dv, block_table=HAND_BT, resident=HAND_RES)
    assert np.array_equal(r["dst_k"][0], bits(hk)[0]) and np.array_equal(r["dst_v"][1], bits(hv)[3])
    for s in (2, 3, 4, 5):
        assert np.array_equal(r["dst_k"][s], bits(dk)[s]) and np.array_equal(r["dst_v"][s], bits(dv)[s])


def test_reference_store_hand_worked():
    dk = np.zeros((2, 4, 1, 2), np.float32)
    k = np.arange(10, dtype=np.float32).reshape(5, 1, 2)
    outk, outv = store_reference(dk, dk, k, -k, np.array([5, -1, 0, 5, 7], np.int64), 4)
    want = np.zeros((2, 4, 1, 2), np.float32)
    want[0, 0, 0] = [4, 5]
    want[1, 1, 0] = [6, 7]  # token 3 wins over token 0 on slot 5
    want[1, 3, 0] = [8, 9]
    assert np.array_equal(outk.view(np.float32), want) and np.array_equal(outv.view(np.float32), -want)
    assert not dk.any()  # the reference works on copies


# --------------------------------------------------------------------------------------------------
# CPU: prefetch against the reference
# --------------------------------------------------------------------------------------------------
def test_hand_worked_through_the_api():
    rng = np.random.default_rng(2)
    hk, hv = kv_pair(rng, 6, 16, 2, 16, "float16")
    dk, dv = kv_pair(rng, 6, 16, 2, 16, "float16")
    dk0, dv0 = dk.copy(), dv.copy()
    counts = np.zeros(2, np.int64)
    out = np.full((2, 4), 77, np.int32)
    r = sparda().prefetch(hk, hv, HAND_IX, dk, dv, block_table=HAND_BT, resident=HAND_RES, slot_map_out=out,
                          counts=counts)
    assert r is out
    assert np.array_equal(out, HAND_MAP) and np.array_equal(counts, HAND_COUNTS)
    assert same_bits(dk[0], hk[0]) and same_bits(dv[0], hv[0]) and same_bits(dk[1], hk[3]) and same_bits(dv[1], hv[3])
    assert same_bits(dk[2:], dk0[2:]) and same_bits(dv[2:], dv0[2:])  # pages not moved are untouched
    # identity table, eviction
    hk, hv = kv_pair(rng, 4, 16, 2, 16, "float16")
    dk, dv = kv_pair(rng, 2, 16, 2, 16, "float16")
    dk0, dv0 = dk.copy(), dv.copy()
    r = sparda().prefetch(hk, hv, HAND2_IX, dk, dv, resident=HAND2_RES, counts=counts)
    assert isinstance(r, np.ndarray) and r.dtype == np.int32 and r.shape == (1, 4)
    assert np.array_equal(r, HAND2_MAP) and np.array_equal(counts, HAND2_COUNTS)
    assert same_bits(dk[0], hk[3]) and same_bits(dv[0], hv[3]) and same_bits(dk[1], dk0[1]) and same_bits(dv[1], dv0[1])


CONFIGS = [  # B, Hsel, n, table (max_pages or None: identity), dtype
    (1, 1, 5, None, "float16"),
    (3, 2, 4, 9, "float16"),
    (3, 1, 7, 11, "float32"),
    (2, 2, 3, None, "uint8"),
    (3, 2, 6, 5, "float16"),  # B * max_pages < B * Hsel * n: S bound by the table
]


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("P", [16, 64, 256])
def test_matches_reference(P, layout, combined):
    rng = np.random.default_rng(P + 7 * (layout == "HND") + 3 * combined)
    Hkv = 2
    D = 16 if P == 256 else 64
    for B, Hsel, n, maxp, dtype in CONFIGS:
        num_pages = 12 if maxp is None else 20
        what = f"P={P} {layout} combined={combined} B={B} Hsel={Hsel} n={n} table={maxp} {dtype}"
        hk, hv = kv_pair(rng, num_pages, P, Hkv, D, dtype, layout, combined)
        ix, bt, max_pages = selection(rng, B, Hsel, n, num_pages, maxp)
        S = s_min(B, Hsel, n, max_pages) + int(rng.integers(0, 4))
        dk, dv = kv_pair(rng, S, P, Hkv, D, dtype, layout)  # combined staging: test_combined_staging_views
        want = check_against_reference(hk, hv, ix, dk, dv, bt, what=what + " (fresh)")
        # the next step: the map fed back, a new selection sharing some blocks
        ix2, _, _ = selection(rng, B, Hsel, n, num_pages, maxp)
        ix2[:, :, : n // 2] = ix[:, :, : n // 2]
        check_against_reference(hk, hv, ix2, dk, dv, bt, want["slot_map"], what=what + " (resident)")
        # a garbage resident map: out of range values, duplicated claims
        res = rng.integers(-3, S + 3, (B, max_pages)).astype(np.int32)
        res[:, -1] = res[:, 0]
        check_against_reference(hk, hv, ix2, dk, dv, bt, res, what=what + " (garbage resident)")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_combined_staging_views_are_refused(layout):
    """dst_k / dst_v as views of one combined staging array [S, 2, ...]: the intake checks outputs for
    overlap by the bytes they span, so the staging cache must be two arrays (the host caches may be
    views of one: they are read only). A ValueError naming them, nothing written."""
    rng = np.random.default_rng(40)
    hk, hv = kv_pair(rng, 16, 16, 2, 16, "float16", layout, combined=True)
    ix, bt, max_pages = selection(rng, 2, 2, 4, 16, 8)
    dk, dv = kv_pair(rng, s_min(2, 2, 4, max_pages), 16, 2, 16, "float16", layout, combined=True)
    before = bits(dk).copy()
    with pytest.raises(ValueError, match="'dst_k' must not overlap 'dst_v'"):
        gvr.sparda.prefetch(hk, hv, ix, dk, dv, block_table=bt)
    assert np.array_equal(bits(dk), before)


def test_methods_and_max_ctas_same_on_cpu():
    rng = np.random.default_rng(11)
    hk, hv = kv_pair(rng, 20, 16, 2, 16, "float16")
    ix, bt, max_pages = selection(rng, 3, 2, 5, 20, 8)
    S = s_min(3, 2, 5, max_pages)
    d0 = kv_pair(rng, S, 16, 2, 16, "float16")
    results = []
    for kw in ({}, dict(method="auto"), dict(method="kernel"), dict(method="memcpy"), dict(max_ctas=1),
               dict(max_ctas=64, method="kernel"), dict(cta_warps=1, lane_loads=4), dict(method="tma"),
               dict(method="tma", max_ctas=3)):
        dk, dv = d0[0].copy(), d0[1].copy()
        check_against_reference(hk, hv, ix, dk, dv, bt, what=str(kw), **kw)
        results.append((bits(dk).copy(), bits(dv).copy()))
    assert all(np.array_equal(a[0], results[0][0]) and np.array_equal(a[1], results[0][1]) for a in results)


def test_empty_selection_and_all_padding():
    rng = np.random.default_rng(12)
    hk, hv = kv_pair(rng, 10, 16, 2, 16, "float16")
    dk, dv = kv_pair(rng, 4, 16, 2, 16, "float16")
    dk0, dv0 = dk.copy(), dv.copy()
    counts = np.full(2, 9, np.int64)
    ix = np.zeros((2, 1, 0), np.int32)
    r = sparda().prefetch(hk, hv, ix, dk, dv, counts=counts)
    assert np.array_equal(r, np.full((2, 10), -1, np.int32)) and np.array_equal(counts, [0, 0])
    assert same_bits(dk, dk0) and same_bits(dv, dv0)
    # n = 0 with a resident map: nothing needed, the owners are retained (first claim wins)
    res = np.full((2, 10), -1, np.int32)
    res[0, 4], res[1, 4], res[1, 9] = 2, 2, 0
    r = sparda().prefetch(hk, hv, ix, dk, dv, resident=res, counts=counts)
    want = np.full((2, 10), -1, np.int32)
    want[0, 4], want[1, 9] = 2, 0
    assert np.array_equal(r, want) and np.array_equal(counts, [0, 0])
    assert same_bits(dk, dk0) and same_bits(dv, dv0)
    # only padding and out-of-range entries
    ix = np.array([[[-1, 10]], [[-5, 11]]], np.int32)  # S = 4 >= min(B * Hsel * n, B * max_pages) = 4
    r = sparda().prefetch(hk, hv, ix, dk, dv, counts=counts)
    assert np.array_equal(r, np.full((2, 10), -1, np.int32)) and np.array_equal(counts, [0, 0])
    assert same_bits(dk, dk0) and same_bits(dv, dv0)


@pytest.mark.parametrize("tight", [True, False], ids=["S-tight", "S-large"])
@pytest.mark.parametrize("table", [None, 16])
def test_resident_chain(table, tight):
    """Five steps, each fed the previous map: only non-resident blocks move, kept blocks keep their slot,
    and every block in the map (needed or retained) has its host page's bytes in its staging page."""
    rng = np.random.default_rng(13 + (table or 0) + tight)
    num_pages, P, Hkv, D, B, Hsel, n = 24, 16, 2, 16, 3, 2, 4
    hk, hv = kv_pair(rng, num_pages, P, Hkv, D, "float16", "HND")
    ix, bt, max_pages = selection(rng, B, Hsel, n, num_pages, table)
    S = s_min(B, Hsel, n, max_pages) + (0 if tight else 20)
    dk, dv = kv_pair(rng, S, P, Hkv, D, "float16", "HND")
    prev = None
    retained_seen = 0
    for step in range(5):
        if step:
            new, _, _ = selection(rng, B, Hsel, n, num_pages, table, bad=step % 2 == 0)
            keep = rng.random((B, Hsel, n)) < 0.6
            ix = np.where(keep, ix, new).astype(np.int32)
        want = check_against_reference(hk, hv, ix, dk, dv, bt, prev, what=f"step {step}")
        sm, counts = want["slot_map"], want["counts"]
        needed = {(b, int(j)) for b in range(B) for j in ix[b].ravel() if 0 <= j < max_pages
                  and 0 <= (j if bt is None else bt[b, j]) < num_pages}
        kept = {(b, j) for (b, j) in needed if prev is not None and prev[b, j] == sm[b, j]}
        assert counts[1] == len(needed) and counts[0] == len(needed) - len(kept), (step, counts, len(kept))
        if prev is not None:
            # an honest map: every needed block that was resident is kept where it was
            for (b, j) in needed:
                if prev[b, j] >= 0:
                    assert sm[b, j] == prev[b, j], (step, b, j)
        for b in range(B):
            for j in range(max_pages):
                s = sm[b, j]
                if s >= 0:
                    pg = j if bt is None else bt[b, j]
                    assert same_bits(dk[s], hk[pg]) and same_bits(dv[s], hv[pg]), (step, b, j)
                    retained_seen += (b, j) not in needed
        assert len({int(s) for s in sm.ravel() if s >= 0}) == int((sm >= 0).sum())  # no slot twice
        prev = sm
    if not tight:
        assert retained_seen > 0  # a large S keeps blocks that are no longer needed


@pytest.mark.parametrize("S_extra", [0, 20])
def test_sixty_percent_resident(S_extra):
    rng = np.random.default_rng(14)
    num_pages, P = 64, 16
    hk, hv = kv_pair(rng, num_pages, P, 2, 16, "float16")
    bt = rng.permutation(num_pages)[:50][None].astype(np.int32)
    first = rng.permutation(50)[:20]
    ix1 = first[None, None].astype(np.int32)
    others = np.setdiff1d(np.arange(50), first)
    ix2 = np.concatenate([first[:12], rng.permutation(others)[:8]])[None, None].astype(np.int32)
    S = 20 + S_extra
    dk, dv = kv_pair(rng, S, P, 2, 16, "float16")
    counts = np.zeros(2, np.int64)
    sm1 = sparda().prefetch(hk, hv, ix1, dk, dv, block_table=bt, counts=counts)
    assert np.array_equal(counts, [20, 20])
    sm2 = check_against_reference(hk, hv, ix2, dk, dv, bt, sm1)["slot_map"]
    r = sparda().prefetch(hk, hv, ix2, dk.copy(), dv.copy(), block_table=bt, resident=sm1, counts=counts)
    assert np.array_equal(r, sm2)
    assert np.array_equal(counts, [8, 20])  # moved == needed - kept = 20 - 12
    assert np.array_equal(sm2[0, first[:12]], sm1[0, first[:12]])  # kept in place
    dropped = first[12:]
    if S_extra >= 8:  # the 8 new blocks take unowned slots: the 8 dropped blocks are retained
        assert np.array_equal(sm2[0, dropped], sm1[0, dropped])
        assert set(sm2[0, ix2[0, 0, 12:]]) == set(range(20, 28))
    else:  # S tight: the new blocks take the dropped blocks' slots, in ascending slot order
        assert np.all(sm2[0, dropped] == -1)
        assert np.array_equal(sm2[0, np.sort(ix2[0, 0, 12:])], np.sort(sm1[0, dropped]))


def test_garbage_resident_matches_reference():
    rng = np.random.default_rng(15)
    num_pages, P, B, Hsel, n = 16, 16, 3, 2, 5
    hk, hv = kv_pair(rng, num_pages, P, 2, 16, "float16", combined=True)
    for trial in range(6):
        ix, bt, max_pages = selection(rng, B, Hsel, n, num_pages, 10 if trial % 2 else None)
        S = s_min(B, Hsel, n, max_pages) + trial
        dk, dv = kv_pair(rng, S, P, 2, 16, "float16")
        res = rng.integers(-2, S + 2, (B, max_pages)).astype(np.int32)
        res[rng.random((B, max_pages)) < 0.3] = 1  # slot 1 claimed many times
        res[0, :] = np.int32(2**31 - 1) if trial == 3 else res[0, :]
        res[-1, 0] = np.int32(-2**31)
        r0 = res.copy()
        check_against_reference(hk, hv, ix, dk, dv, bt, res, what=f"trial {trial}")
        assert np.array_equal(res, r0)  # resident is an input


def test_shared_pages_are_separate_blocks():
    """Two rows naming one host page are two blocks: each gets its own staging page."""
    rng = np.random.default_rng(16)
    hk, hv = kv_pair(rng, 4, 16, 2, 16, "float16")
    bt = np.array([[2, 3], [2, 2]], np.int32)
    ix = np.array([[[0, 1]], [[0, 1]]], np.int32)
    dk, dv = kv_pair(rng, 4, 16, 2, 16, "float16")
    want = check_against_reference(hk, hv, ix, dk, dv, bt)
    assert np.array_equal(want["slot_map"], [[0, 1], [2, 3]]) and np.array_equal(want["counts"], [4, 4])


@pytest.mark.skipif(torch is None, reason="bfloat16 caches come as torch tensors")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_torch_cpu_tensors(dtype):
    rng = np.random.default_rng(17)
    hk, hv = kv_pair(rng, 20, 64, 2, 64, dtype, "HND", combined=True, fw="torch")
    ix, bt, max_pages = selection(rng, 2, 2, 6, 20, 12)
    S = s_min(2, 2, 6, max_pages)
    dk, dv = kv_pair(rng, S, 64, 2, 64, dtype, "HND", fw="torch")
    ixt, btt = torch.from_numpy(ix), torch.from_numpy(bt)
    want = check_against_reference(hk, hv, ixt, dk, dv, btt)
    res = torch.from_numpy(want["slot_map"])
    ix2 = torch.from_numpy(np.roll(ix, 1, axis=2))
    check_against_reference(hk, hv, ix2, dk, dv, btt, res)


# --------------------------------------------------------------------------------------------------
# the attention round trip
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("P,table", [(16, 12), (64, None), (16, None), (64, 7)])
def test_attention_round_trip(P, table, Hsel, layout):
    rng = np.random.default_rng(P + (table or 0) + Hsel)
    num_pages, Hkv, D, Hq, B, n = 14, 2, 16, 4, 3, 5
    inner = (P, Hkv, D) if layout == "NHD" else (Hkv, P, D)
    host = rng.standard_normal((num_pages, 2) + inner).astype(np.float32)
    hk, hv = host[:, 0], host[:, 1]
    if layout == "HND":
        hk, hv = hk.swapaxes(1, 2), hv.swapaxes(1, 2)
    ix, bt, max_pages = selection(rng, B, Hsel, n, num_pages, table)
    bt_host = np.tile(np.arange(num_pages, dtype=np.int32), (B, 1)) if bt is None else bt
    lengths = rng.integers(1, max_pages * P + 1, B).astype(np.int32)
    lengths[0] = max_pages * P
    S = s_min(B, Hsel, n, max_pages) + 2
    stage = np.full((2, S) + inner, np.nan, np.float32)  # NaN in every page not moved: never read
    dk, dv = stage[0], stage[1]
    if layout == "HND":
        dk, dv = dk.swapaxes(1, 2), dv.swapaxes(1, 2)
    resident = None
    for step in range(3):
        if step:
            new, _, _ = selection(rng, B, Hsel, n, num_pages, table)
            ix = np.where(rng.random(ix.shape) < 0.5, ix, new).astype(np.int32)
        sm = sparda().prefetch(hk, hv, ix, dk, dv, block_table=bt, resident=resident)
        q = rng.standard_normal((B, Hq, D)).astype(np.float32)
        o1, l1 = gvr.sparse_attention(q, dk, dv, ix, lengths=lengths, block_table=sm, block_size=P)
        o2, l2 = gvr.sparse_attention(q, hk, hv, ix, lengths=lengths, block_table=bt_host, block_size=P)
        assert np.isfinite(l2).any() and not np.isnan(o1).any()
        assert same_bits(o1, o2) and same_bits(l1, l2), f"step {step}"
        resident = sm


@pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"), reason="fp8 caches come as torch tensors")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_round_trip_fp8(layout):
    """An fp8 (e4m3fn) host cache: prefetch to an fp8 staging cache, then sparse_attention over it with the
    slot map and k_scale / v_scale = bit for bit the attention over the host cache itself"""
    rng = np.random.default_rng(41 + len(layout))
    num_pages, P, Hkv, D, Hq, B, n = 14, 16, 2, 16, 4, 3, 5
    inner = (P, Hkv, D) if layout == "NHD" else (Hkv, P, D)
    codes = rng.integers(0, 256, (num_pages, 2) + inner).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes: the comparison below wants finite results
    host = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    hk, hv = host[:, 0], host[:, 1]
    if layout == "HND":
        hk, hv = hk.transpose(1, 2), hv.transpose(1, 2)
    ix, bt, max_pages = selection(rng, B, Hkv, n, num_pages, 12)
    lengths = torch.from_numpy(rng.integers(1, max_pages * P + 1, B).astype(np.int32))
    S = s_min(B, Hkv, n, max_pages) + 2
    stage = torch.full((2, S) + inner, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN: never read
    dk, dv = stage[0], stage[1]
    if layout == "HND":
        dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
    ixt, btt = torch.from_numpy(ix), torch.from_numpy(bt)
    resident = None
    for step in range(3):
        if step:
            ixt = torch.from_numpy(np.where(rng.random(ix.shape) < 0.5, ix, selection(rng, B, Hkv, n, num_pages, 12)[0])
                                   .astype(np.int32))
        sm = sparda().prefetch(hk, hv, ixt, dk, dv, block_table=btt, resident=resident)
        q = torch.from_numpy(rng.standard_normal((B, Hq, D)).astype(np.float32)).bfloat16()
        kw = dict(lengths=lengths, block_size=P, k_scale=0.02, v_scale=0.5)
        o1, l1 = gvr.sparse_attention(q, dk, dv, ixt, block_table=sm, **kw)
        o2, l2 = gvr.sparse_attention(q, hk, hv, ixt, block_table=btt, **kw)
        assert torch.isfinite(l2).any() and not torch.isnan(o1.float()).any()
        assert same_bits(o1, o2) and same_bits(l1, l2), f"step {step}"
        resident = sm


# --------------------------------------------------------------------------------------------------
# determinism, outputs, bad inputs
# --------------------------------------------------------------------------------------------------
def test_deterministic():
    rng = np.random.default_rng(18)
    hk, hv = kv_pair(rng, 30, 64, 2, 16, "float16", "HND")
    ix, bt, max_pages = selection(rng, 3, 2, 8, 30, 20)
    S = s_min(3, 2, 8, max_pages) + 5
    d0 = kv_pair(rng, S, 64, 2, 16, "float16", "HND")
    res = rng.integers(-1, S, (3, max_pages)).astype(np.int32)
    outs = []
    for _ in range(3):
        dk, dv = d0[0].copy(order="K"), d0[1].copy(order="K")  # HND kept
        c = np.zeros(2, np.int64)
        sm = sparda().prefetch(hk, hv, ix, dk, dv, block_table=bt, resident=res, counts=c)
        outs.append((sm.copy(), c.copy(), bits(dk).copy(), bits(dv).copy()))
    for o in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(o, outs[0]))


def test_outputs_allocated_and_given():
    rng = np.random.default_rng(19)
    hk, hv = kv_pair(rng, 10, 16, 2, 16, "float16")
    ix, bt, max_pages = selection(rng, 2, 1, 4, 10, 6)
    dk, dv = kv_pair(rng, 8, 16, 2, 16, "float16")
    sm = sparda().prefetch(hk, hv, ix, dk.copy(), dv.copy(), block_table=bt)
    assert isinstance(sm, np.ndarray) and sm.dtype == np.int32 and sm.shape == (2, 6)
    out = np.full((2, 6), 123, np.int32)  # written entirely, -1 included
    r = sparda().prefetch(hk, hv, ix, dk, dv, block_table=bt, slot_map_out=out)
    assert r is out and np.array_equal(out, sm)
    assert np.array_equal(out, prefetch_plan(ix, 10, 8, bt)[0])


def test_bad_inputs_named_and_nothing_modified():
    rng = np.random.default_rng(20)
    N, P, Hkv, D, B, Hsel, n = 10, 16, 2, 16, 2, 2, 3
    hk, hv = kv_pair(rng, N, P, Hkv, D, "float16")
    ix, bt, max_pages = selection(rng, B, Hsel, n, N, 6)
    S = s_min(B, Hsel, n, max_pages)
    dk, dv = kv_pair(rng, S, P, Hkv, D, "float16")
    res = np.full((B, max_pages), -1, np.int32)
    out = np.full((B, max_pages), 55, np.int32)
    counts = np.full(2, 66, np.int64)
    base = dict(block_table=bt, resident=res, slot_map_out=out, counts=counts)
    args = (hk, hv, ix, dk, dv)
    everything = (hk, hv, ix, dk, dv, bt, res, out, counts)
    before = snapshot(*everything)

    def bad(exc, match, *a, **kw):
        a = a or args
        full = dict(base)
        full.update(kw)
        with pytest.raises(exc, match=match or None):
            sparda().prefetch(*a, **full)
        assert_unchanged(before, *everything, what=f"{getattr(exc, '__name__', exc)} {match}")

    hk_D, hv_D = kv_pair(rng, N, P, Hkv, 2 * D, "float16")
    hk_P, hv_P = kv_pair(rng, N, 2 * P, Hkv, D, "float16")
    hk_H, hv_H = kv_pair(rng, N, P, 1, D, "float16")
    dk_hnd, dv_hnd = kv_pair(rng, S, P, Hkv, D, "float16", "HND")
    bad(TypeError, "indices", hk, hv, ix.astype(np.int64), dk, dv)
    bad(ValueError, "indices", hk, hv, ix[:, 0], dk, dv)
    bad(ValueError, "indices|block_table|resident|slot_map", hk, hv, ix[:1], dk, dv)  # B differs from the table's
    bad(TypeError, "block_table", block_table=bt.astype(np.int64))
    bad(ValueError, "block_table", block_table=bt[0])
    bad(ValueError, "resident", resident=res[:, :-1])
    bad(ValueError, "resident", resident=np.full((B, N), -1, np.int32))  # [B, num_pages], not [B, max_pages]
    bad(TypeError, "resident", resident=res.astype(np.int64))
    bad(ValueError, "slot_map", slot_map_out=np.zeros((B, max_pages + 1), np.int32))
    bad(TypeError, "slot_map", slot_map_out=np.zeros((B, max_pages), np.int64))
    bad(ValueError, "counts", counts=np.zeros(3, np.int64))
    bad(TypeError, "counts", counts=np.zeros(2, np.int32))
    bad(ValueError, "dst_k", hk, hv, ix, dk[:-1], dv[:-1])  # S too small
    bad(ValueError, "", hk_D, hv_D, ix, dk, dv)  # D mismatch host vs dst
    bad(ValueError, "", hk_P, hv_P, ix, dk, dv)  # P mismatch
    bad(ValueError, "", hk_H, hv_H, ix, dk, dv)  # Hkv mismatch
    bad(ValueError, "", hk, hv, ix, dk, dv[:, :, :1])  # dst_v shape differs from dst_k
    bad(ValueError, "", hk, hv[:-1], ix, dk, dv)  # host_v pages differ from host_k
    bad(ValueError, "", hk, hv, ix, dk_hnd, dv_hnd)  # inner layout differs (HND staging, NHD host)
    bad(ValueError, "", hk_D[..., :D], hv_D[..., :D], ix, dk, dv)  # a page is not one run of bytes
    bad(TypeError, "", hk.view(np.int16).astype(np.float32), hv.view(np.int16).astype(np.float32), ix, dk, dv)
    bad(TypeError, "", hk.astype(np.float64), hv.astype(np.float64), ix, dk.astype(np.float64),
        dv.astype(np.float64))  # 8-byte elements
    bad(ValueError, "method", method="fast")
    bad(ValueError, "max_ctas", max_ctas=0)
    bad((TypeError, ValueError), "max_ctas", max_ctas=2.5)
    bad(ValueError, "cta_warps", cta_warps=0)
    bad(ValueError, "cta_warps", cta_warps=9)
    bad(ValueError, "lane_loads", lane_loads=6)
    bad((TypeError, ValueError), "lane_loads", lane_loads=4.0)
    bad(ValueError, "", hk, hv, ix, dk.reshape(S, P, Hkv * D), dv.reshape(S, P, Hkv * D))  # wrong ndim


# --------------------------------------------------------------------------------------------------
# HostKVCache on the CPU
# --------------------------------------------------------------------------------------------------
def HostKVCache(*a, **kw):
    return sparda().HostKVCache(*a, **kw)


def page_size(c):
    return getattr(c, "P", None) if hasattr(c, "P") else c.page_size


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [np.float16, "float32"])
def test_host_cache_views(layout, dtype):
    L, N, P, Hkv, D = 3, 5, 16, 2, 8
    c = HostKVCache(L, N, P, Hkv, D, dtype, device="cpu", layout=layout)
    try:
        assert (c.num_layers, c.num_pages, page_size(c), c.Hkv, c.D) == (L, N, P, Hkv, D)
        assert np.dtype(c.dtype) == np.dtype(dtype) and c.pinned is False
        assert c.nbytes >= 2 * L * N * P * Hkv * D * np.dtype(dtype).itemsize
        for layer in range(L):
            for kv in (c.k(layer), c.v(layer)):
                assert isinstance(kv, np.ndarray) and kv.shape == (N, P, Hkv, D) and kv.dtype == np.dtype(dtype)
                assert not kv.any()
                if layout == "NHD":
                    assert kv.flags.c_contiguous
                else:
                    assert kv.swapaxes(1, 2).flags.c_contiguous  # a [N, Hkv, P, D] storage
        # every (layer, K/V) is its own memory, views are live
        c.k(1)[2, 3, 1] = 1
        assert c.k(1)[2, 3, 1].all() and not c.v(1).any() and not c.k(0).any() and not c.k(2).any()
        c.v(2)[...] = 2
        assert np.all(c.v(2) == 2) and int(np.count_nonzero(c.k(1))) == D
    finally:
        kv = None  # the last view must not outlive the cache: close() would refuse (BufferError)
        gc.collect()
        c.close()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("slot_dtype", [np.int64, np.int32])
def test_host_cache_append_vs_reference(layout, slot_dtype):
    rng = np.random.default_rng(21)
    L, N, P, Hkv, D = 2, 6, 16, 2, 16
    with HostKVCache(L, N, P, Hkv, D, np.float16, device="cpu", layout=layout) as c:
        want = {l: (np.zeros((N, P, Hkv, D), np.uint16), np.zeros((N, P, Hkv, D), np.uint16)) for l in range(L)}
        for step in range(4):
            T = int(rng.integers(1, 40))
            k = random_bits(rng, (T, Hkv, D), 2).view(np.float16)
            v = random_bits(rng, (T, Hkv, D), 2).view(np.float16)
            slots = rng.integers(-2, N * P, T).astype(slot_dtype)
            if T >= 3:
                slots[T - 1] = slots[0]  # the later token wins
                slots[1] = -1
            layer = step % L
            want[layer] = store_reference(*want[layer], k, v, slots, P)
            s0 = slots.copy()
            c.append(layer, k, v, slots)
            assert np.array_equal(slots, s0)
            for l in range(L):
                assert same_bits(c.k(l), want[l][0]) and same_bits(c.v(l), want[l][1]), (step, l)
        # a strided token batch (k a view) and a T = 0 append
        big = random_bits(rng, (8, Hkv, 2 * D), 2).view(np.float16)
        slots = np.arange(8, dtype=slot_dtype) * 3
        want[0] = store_reference(*want[0], big[..., :D], big[..., D:], slots, P)
        c.append(0, big[..., :D], big[..., D:], slots)
        c.append(1, big[:0, :, :D], big[:0, :, :D], slots[:0])
        assert same_bits(c.k(0), want[0][0]) and same_bits(c.v(0), want[0][1])
        assert same_bits(c.k(1), want[1][0]) and same_bits(c.v(1), want[1][1])
        gc.collect()


def test_host_cache_append_bad_inputs():
    rng = np.random.default_rng(22)
    N, P, Hkv, D = 4, 16, 2, 8
    with HostKVCache(2, N, P, Hkv, D, np.float32, device="cpu") as c:
        k = rng.standard_normal((5, Hkv, D)).astype(np.float32)
        c.append(0, k, k, np.arange(5, dtype=np.int64))
        before = (c.k(0).copy(), c.v(0).copy(), c.k(1).copy())
        with pytest.raises(ValueError):
            c.append(0, k, k, np.array([0, 1, N * P, 2, 3], np.int64))  # slot past the cache
        with pytest.raises(TypeError):
            c.append(0, k.astype(np.float16), k.astype(np.float16), np.arange(5, dtype=np.int64))
        with pytest.raises(ValueError):
            c.append(0, k[:, :1], k[:, :1], np.arange(5, dtype=np.int64))  # Hkv mismatch
        with pytest.raises(ValueError):
            c.append(0, k, k, np.arange(4, dtype=np.int64))  # T mismatch
        with pytest.raises((TypeError, ValueError)):
            c.append(0, k, k, np.arange(5, dtype=np.float32))
        with pytest.raises((ValueError, IndexError)):
            c.append(2, k, k, np.arange(5, dtype=np.int64))  # layer out of range
        assert np.array_equal(c.k(0), before[0]) and np.array_equal(c.v(0), before[1])
        assert np.array_equal(c.k(1), before[2])
        del before
        gc.collect()


def _hold_and_close(c, make_view):
    view = make_view(c)
    with pytest.raises(BufferError):
        c.close()
    assert view.shape[-1] == c.D  # the cache is still open and the view still usable after the refusal
    view[...] = 0
    del view
    gc.collect()


def test_host_cache_close():
    c = HostKVCache(2, 4, 16, 2, 8, np.float16, device="cpu")
    _hold_and_close(c, lambda c: c.k(0))
    _hold_and_close(c, lambda c: c.v(1)[2:, 3])  # a view of a view holds the memory too
    assert not c.k(1).any()
    gc.collect()
    c.close()
    c.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        c.k(0)
    with pytest.raises(ValueError, match="closed"):
        c.v(0)
    z = np.zeros((1, 2, 8), np.float16)
    with pytest.raises(ValueError, match="closed"):
        c.append(0, z, z, np.zeros(1, np.int64))


def test_host_cache_context_manager():
    with HostKVCache(1, 3, 16, 2, 8, "float32", device="cpu", layout="HND") as c:
        k = c.k(0)
        k[1, 2, 1, :] = 3
        assert c.k(0)[1, 2, 1, 5] == 3
        del k
        gc.collect()
    with pytest.raises(ValueError, match="closed"):
        c.k(0)
    c.close()


@pytest.mark.skipif(torch is None, reason="a torch dtype gives torch tensors")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_host_cache_torch_dtype(layout, dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    rng = np.random.default_rng(23)
    N, P, Hkv, D = 5, 16, 2, 16
    tdt, isz = getattr(torch, dtype), ITEMSIZE[dtype]
    ints = {1: torch.uint8, 2: torch.int16}[isz]
    c = HostKVCache(2, N, P, Hkv, D, tdt, device="cpu", layout=layout)
    assert c.dtype == tdt and not c.pinned
    k0 = c.k(0)
    assert isinstance(k0, torch.Tensor) and k0.dtype == tdt and k0.device.type == "cpu"
    assert tuple(k0.shape) == (N, P, Hkv, D) and not k0.view(ints).any()
    assert (k0.is_contiguous() if layout == "NHD" else k0.transpose(1, 2).is_contiguous())
    del k0
    want = (np.zeros((N, P, Hkv, D), _UINT[isz]),) * 2
    for _ in range(3):
        T = 20
        k, v = kv_pair(rng, T, Hkv, 1, D, dtype, fw="torch")  # [T, Hkv, 1, D] -> [T, Hkv, D]
        k, v = k[:, :, 0], v[:, :, 0]
        slots = torch.from_numpy(rng.integers(-1, N * P, T))
        slots[5] = slots[2]
        want = store_reference(*want, k, v, slots, P)
        c.append(1, k, v, slots)
    assert same_bits(c.k(1), want[0]) and same_bits(c.v(1), want[1])
    assert not c.k(0).view(ints).any()
    t = c.v(1)
    with pytest.raises(BufferError):
        c.close()
    del t
    gc.collect()
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.v(1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefetch_from_host_cache_cpu(layout):
    rng = np.random.default_rng(24)
    L, N, P, Hkv, D = 2, 12, 16, 2, 16
    with HostKVCache(L, N, P, Hkv, D, np.float16, device="cpu", layout=layout) as c:
        for layer in range(L):
            k, v = kv_pair(rng, N * P, Hkv, 1, D, "float16")
            c.append(layer, k[:, :, 0], v[:, :, 0], np.arange(N * P, dtype=np.int64))
        ix, bt, max_pages = selection(rng, 2, Hkv, 4, N, 8)
        S = s_min(2, Hkv, 4, max_pages)
        res = None
        for layer in range(L):
            dk, dv = kv_pair(rng, S, P, Hkv, D, "float16", layout)
            want = check_against_reference(c.k(layer), c.v(layer), ix, dk, dv, bt, res, what=f"layer {layer}")
            res = want["slot_map"]
        del dk, dv, want
        gc.collect()


# --------------------------------------------------------------------------------------------------
# GPU: the CUDA paths against the C CPU path
# --------------------------------------------------------------------------------------------------
def _pinned_pair(torch_, rng, N, P, Hkv, D, dtype, layout, combined=True):
    """Pinned (page-locked, mapped) torch CPU tensors of random bits, K and V as views."""
    inner = (P, Hkv, D) if layout == "NHD" else (Hkv, P, D)
    shape = ((N, 2) if combined else (2, N)) + inner
    raw = torch_.from_numpy(random_bits(rng, shape, ITEMSIZE[dtype]).view(_SINT[ITEMSIZE[dtype]]))
    arr = raw.view(getattr(torch_, dtype)).pin_memory()
    k, v = (arr[:, 0], arr[:, 1]) if combined else (arr[0], arr[1])
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _fill_cache_layer(torch_, rng, cache, layer, dtype):
    for x in (cache.k(layer), cache.v(layer)):
        r = torch_.from_numpy(random_bits(rng, tuple(x.shape), ITEMSIZE[dtype]).view(_SINT[ITEMSIZE[dtype]]))
        x.view(getattr(torch_, {1: "uint8", 2: "int16", 4: "int32"}[ITEMSIZE[dtype]])).copy_(r)


def _staging(torch_, rng, S, P, Hkv, D, dtype, layout):
    """(cpu_k, cpu_v, cuda_k, cuda_v): the same random initial staging bits on the host and the device,
    in ``layout`` (the device copy built from a device storage, so the strides are the layout's)."""
    ck, cv = kv_pair(rng, S, P, Hkv, D, dtype, layout, fw="torch")
    storage_k = ck.transpose(1, 2) if layout == "HND" else ck
    storage_v = cv.transpose(1, 2) if layout == "HND" else cv
    gk, gv = storage_k.contiguous().cuda(), storage_v.contiguous().cuda()
    if layout == "HND":
        gk, gv = gk.transpose(1, 2), gv.transpose(1, 2)
    return ck, cv, gk, gv


def _cuda_call(torch_, hk, hv, ix, gk, gv, bt, res, method, **kw):
    """One CUDA prefetch: indices / table / resident on the device (kernel, auto) or the host (memcpy)."""
    def place(x):
        if x is None:
            return None
        t = x if isinstance(x, torch_.Tensor) else torch_.from_numpy(np.ascontiguousarray(x))
        return t.cpu() if method == "memcpy" else t.cuda()
    return gvr.sparda.prefetch(hk, hv, place(ix), gk, gv, block_table=place(bt), resident=place(res), method=method,
                               **kw)


@pytest.fixture
def gpu(cuda):
    return cuda


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kernel", "memcpy", "tma"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("P", [16, 64, 256])
def test_cuda_prefetch_equals_cpu(gpu, P, dtype, layout, method):
    torch_ = gpu
    rng = np.random.default_rng(P * 3 + len(dtype) + len(layout) + len(method))
    N, Hkv, D, B, n = 40, 2, 64, 3, 6
    cache = HostKVCache(1, N, P, Hkv, D, getattr(torch_, dtype), device="cuda", layout=layout)
    assert cache.pinned
    _fill_cache_layer(torch_, rng, cache, 0, dtype)
    sources = [("cache", cache.k(0), cache.v(0)), ("pin_memory", *_pinned_pair(torch_, rng, N, P, Hkv, D, dtype, layout))]
    for name, hk, hv in sources:
        assert hk.is_pinned() and hv.is_pinned()
        for Hsel, maxp in ((Hkv, 16), (1, None)):
            what = f"{name} Hsel={Hsel} table={maxp}"
            ix, bt, max_pages = selection(rng, B, Hsel, n, N, maxp)
            S = s_min(B, Hsel, n, max_pages) + 3
            ck, cv, gk, gv = _staging(torch_, rng, S, P, Hkv, D, dtype, layout)
            cc = torch_.zeros(2, dtype=torch_.int64)
            want_sm = gvr.sparda.prefetch(hk, hv, torch_.from_numpy(ix), ck, cv,
                                          block_table=None if bt is None else torch_.from_numpy(bt), counts=cc)
            gc_ = torch_.full((2,), -1, dtype=torch_.int64, device="cuda") if method != "memcpy" else None
            sm = _cuda_call(torch_, hk, hv, ix, gk, gv, bt, None, method, **({"counts": gc_} if gc_ is not None else {}))
            torch_.cuda.synchronize()
            assert sm.is_cuda and sm.dtype == torch_.int32, what
            assert np.array_equal(to_np(sm), to_np(want_sm)), what
            if gc_ is not None:
                assert np.array_equal(to_np(gc_), to_np(cc)), what
            assert same_bits(gk, ck) and same_bits(gv, cv), what + ": staging bytes"
            # the next step with the map fed back (device map for the kernel, host map for memcpy)
            ix2 = np.where(rng.random(ix.shape) < 0.6, ix, selection(rng, B, Hsel, n, N, maxp)[0]).astype(np.int32)
            want2 = gvr.sparda.prefetch(hk, hv, torch_.from_numpy(ix2), ck, cv,
                                        block_table=None if bt is None else torch_.from_numpy(bt),
                                        resident=want_sm)
            res = sm if method != "memcpy" else sm.cpu()
            sm2 = _cuda_call(torch_, hk, hv, ix2, gk, gv, bt, res, method)
            torch_.cuda.synchronize()
            assert np.array_equal(to_np(sm2), to_np(want2)), what + " (resident)"
            assert same_bits(gk, ck) and same_bits(gv, cv), what + ": staging bytes (resident)"
    del sources, hk, hv
    gc.collect()


@pytest.mark.gpu
def test_cuda_numpy_host_cache_and_auto(gpu):
    """A NumPy-dtype pinned cache (NumPy views) feeding CUDA staging tensors; method "auto"."""
    torch_ = gpu
    rng = np.random.default_rng(31)
    N, P, Hkv, D = 24, 64, 2, 64
    cache = HostKVCache(2, N, P, Hkv, D, np.float16, device="cuda")
    assert cache.pinned
    for layer in range(2):
        for x in (cache.k(layer), cache.v(layer)):
            x.view(np.uint16)[...] = random_bits(rng, x.shape, 2)
    ix, bt, max_pages = selection(rng, 2, Hkv, 5, N, 12)
    S = s_min(2, Hkv, 5, max_pages)
    for layer in range(2):
        hk, hv = cache.k(layer), cache.v(layer)
        dk, dv = kv_pair(rng, S, P, Hkv, D, "float16")
        want = prefetch_reference(hk, hv, ix, dk, dv, block_table=bt)
        gk = torch_.from_numpy(dk).cuda()
        gv = torch_.from_numpy(dv).cuda()
        sm = gvr.sparda.prefetch(hk, hv, torch_.from_numpy(ix).cuda(), gk, gv,
                                 block_table=torch_.from_numpy(bt).cuda(), method="auto")
        torch_.cuda.synchronize()
        assert np.array_equal(to_np(sm), want["slot_map"])
        assert same_bits(gk, want["dst_k"]) and same_bits(gv, want["dst_v"])
    del hk, hv
    gc.collect()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_append_from_device_tensors(gpu, layout, dtype):
    torch_ = gpu
    ints = {1: torch_.uint8, 2: torch_.int16}[ITEMSIZE[dtype]]
    rng = np.random.default_rng(32)
    N, P, Hkv, D = 8, 64, 2, 64
    cache = HostKVCache(2, N, P, Hkv, D, getattr(torch_, dtype), device="cuda", layout=layout)
    assert cache.pinned and cache.k(0).is_pinned()
    want = (np.zeros((N, P, Hkv, D), _UINT[ITEMSIZE[dtype]]),) * 2
    for step in range(3):
        T = 300
        k, v = kv_pair(rng, T, Hkv, 1, D, dtype, fw="torch")
        k, v = k[:, :, 0], v[:, :, 0]
        slots = rng.integers(-1, N * P, T)
        slots[7] = slots[3]
        dslots = torch_.from_numpy(slots).cuda()
        if step == 2:
            dslots[11] = N * P + 5  # a device slot past the cache: skipped (no error, no write)
            slots[11] = -1
        want = store_reference(*want, k, v, slots, P)
        cache.append(1, k.cuda(), v.cuda(), dslots)
        torch_.cuda.synchronize()
        assert same_bits(cache.k(1), want[0]) and same_bits(cache.v(1), want[1]), step
    assert not cache.k(0).view(ints).any()
    # host tensors into a cuda cache
    k, v = kv_pair(rng, 10, Hkv, 1, D, dtype, fw="torch")
    slots = np.arange(10) * 7
    want = store_reference(*want, k[:, :, 0], v[:, :, 0], slots, P)
    cache.append(1, k[:, :, 0], v[:, :, 0], torch_.from_numpy(slots))
    torch_.cuda.synchronize()
    assert same_bits(cache.k(1), want[0]) and same_bits(cache.v(1), want[1])
    gc.collect()
    cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kernel", "memcpy", "tma"])
def test_cuda_resident_chain(gpu, method):
    torch_ = gpu
    rng = np.random.default_rng(33 + len(method))
    N, P, Hkv, D, B, n, maxp = 64, 64, 2, 64, 3, 8, 32
    hk, hv = _pinned_pair(torch_, rng, N, P, Hkv, D, "bfloat16", "HND")
    ix, bt, max_pages = selection(rng, B, Hkv, n, N, maxp)
    S = s_min(B, Hkv, n, max_pages) + 10
    ck, cv, gk, gv = _staging(torch_, rng, S, P, Hkv, D, "bfloat16", "HND")
    btt = torch_.from_numpy(bt)
    res_c = res_g = None
    for step in range(5):
        if step:
            ix = np.where(rng.random(ix.shape) < 0.6, ix, selection(rng, B, Hkv, n, N, maxp)[0]).astype(np.int32)
        cc = torch_.zeros(2, dtype=torch_.int64)
        res_c = gvr.sparda.prefetch(hk, hv, torch_.from_numpy(ix), ck, cv, block_table=btt, resident=res_c, counts=cc)
        sm = _cuda_call(torch_, hk, hv, ix, gk, gv, bt, res_g, method)
        torch_.cuda.synchronize()
        assert np.array_equal(to_np(sm), to_np(res_c)), step
        assert same_bits(gk, ck) and same_bits(gv, cv), step
        if step:
            assert to_np(cc)[0] < to_np(cc)[1], step  # something was resident
        res_g = sm if method != "memcpy" else sm.cpu()


@pytest.mark.gpu
def test_cuda_pageable_host_memory_refused(gpu):
    torch_ = gpu
    rng = np.random.default_rng(34)
    N, P, Hkv, D = 8, 16, 2, 64
    hk, hv = kv_pair(rng, N, P, Hkv, D, "bfloat16", fw="torch")  # plain pageable memory
    assert not hk.is_pinned()
    ix = np.array([[[0, 3, 5]]], np.int32)
    _, _, gk, gv = _staging(torch_, rng, 3, P, Hkv, D, "bfloat16", "NHD")
    g0 = (gk.clone(), gv.clone())
    for method in ("kernel", "auto", "memcpy"):
        with pytest.raises(ValueError, match="pinned"):
            _cuda_call(torch_, hk, hv, ix, gk, gv, None, None, method)
    torch_.cuda.synchronize()
    assert torch_.equal(gk.view(torch_.int16), g0[0].view(torch_.int16))
    assert torch_.equal(gv.view(torch_.int16), g0[1].view(torch_.int16))
    pk, pv = _pinned_pair(torch_, rng, N, P, Hkv, D, "bfloat16", "NHD")
    with pytest.raises(ValueError, match="method"):
        _cuda_call(torch_, pk, pv, ix, gk, gv, None, None, "dma")


@pytest.mark.gpu
def test_cuda_deterministic_and_max_ctas(gpu):
    torch_ = gpu
    rng = np.random.default_rng(35)
    N, P, Hkv, D, B, n, maxp = 96, 64, 2, 64, 4, 16, 48
    hk, hv = _pinned_pair(torch_, rng, N, P, Hkv, D, "float16", "NHD")
    ix, bt, max_pages = selection(rng, B, Hkv, n, N, maxp)
    S = s_min(B, Hkv, n, max_pages) + 7
    res = rng.integers(-2, S + 2, (B, max_pages)).astype(np.int32)  # garbage: many duplicated claims
    res[:, ::3] = 5
    ck, cv, gk0, gv0 = _staging(torch_, rng, S, P, Hkv, D, "float16", "NHD")
    want = gvr.sparda.prefetch(hk, hv, torch_.from_numpy(ix), ck, cv, block_table=torch_.from_numpy(bt),
                               resident=torch_.from_numpy(res))
    runs = [dict(method="kernel")] * 20 + [dict(method="kernel", max_ctas=1), dict(method="kernel", max_ctas=64),
                                           dict(method="memcpy")]
    runs += [dict(method="kernel", max_ctas=c, cta_warps=w, lane_loads=ll)
             for c, w, ll in ((1, 1, 4), (64, 1, 4), (8, 2, 8), (3, 5, 16), (16, 8, 4))]
    runs += [dict(method="tma", max_ctas=c) for c in (None, 1, 3, 64)]
    for kw in runs:
        gk, gv = gk0.clone(), gv0.clone()
        counts = torch_.zeros(2, dtype=torch_.int64, device="cuda") if kw["method"] != "memcpy" else None
        extra = {"counts": counts} if counts is not None else {}
        sm = _cuda_call(torch_, hk, hv, ix, gk, gv, bt, res, **kw, **extra)
        torch_.cuda.synchronize()
        assert np.array_equal(to_np(sm), to_np(want)), kw
        assert same_bits(gk, ck) and same_bits(gv, cv), kw


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kernel", "tma"])
def test_cuda_graph_select_prefetch_attend(gpu, method):
    """forecast_select -> prefetch(method="kernel" / "tma") -> sparse_attention captured in one CUDA graph: three
    replays (new Forecast and queries each step, the slot map fed back) equal the eager chain bit for bit,
    and the eager attention equals attention over the whole cache on the device through the block table."""
    torch_ = gpu
    rng = np.random.default_rng(36)
    P, Hkv, D, Hq, B, maxp, k = 64, 2, 64, 4, 2, 24, 6
    N = B * maxp + 4
    td = torch_.bfloat16
    cache = HostKVCache(1, N, P, Hkv, D, td, device="cuda")
    hk, hv = cache.k(0), cache.v(0)
    gen = torch_.Generator().manual_seed(36)
    hk.copy_(torch_.randn(tuple(hk.shape), generator=gen).to(td))
    hv.copy_(torch_.randn(tuple(hv.shape), generator=gen).to(td))
    bt = torch_.from_numpy(np.stack([rng.permutation(N)[:maxp] for _ in range(B)]).astype(np.int32)).cuda()
    lengths = torch_.tensor([maxp * P, maxp * P - 100], dtype=torch_.int32, device="cuda")
    kt = torch_.randn(B, Hkv, maxp, D, generator=gen).to(td).cuda()
    S = min(B * Hkv * k, B * maxp)
    steps = 3
    Fs = [torch_.randn(B, Hkv, D, generator=gen).to(td).cuda() for _ in range(steps)]
    qs = [torch_.randn(B, Hq, D, generator=gen).to(td).cuda() for _ in range(steps)]

    def buffers():
        return dict(idx=torch_.empty(B, Hkv, k, dtype=torch_.int32, device="cuda"),
                    res=torch_.full((B, maxp), -1, dtype=torch_.int32, device="cuda"),
                    sm=torch_.empty(B, maxp, dtype=torch_.int32, device="cuda"),
                    counts=torch_.zeros(2, dtype=torch_.int64, device="cuda"),
                    dk=torch_.zeros(S, P, Hkv, D, dtype=td, device="cuda"),
                    dv=torch_.zeros(S, P, Hkv, D, dtype=td, device="cuda"),
                    out=torch_.empty(B, Hq, D, dtype=td, device="cuda"),
                    lse=torch_.empty(B, Hq, dtype=torch_.float32, device="cuda"),
                    F=torch_.empty(B, Hkv, D, dtype=td, device="cuda"),
                    q=torch_.empty(B, Hq, D, dtype=td, device="cuda"))

    def step(bf):
        gvr.sparda.forecast_select(bf["F"], kt, k, lengths=lengths, kernel=P, stride=P, out=bf["idx"])
        gvr.sparda.prefetch(hk, hv, bf["idx"], bf["dk"], bf["dv"], block_table=bt, resident=bf["res"],
                            slot_map_out=bf["sm"], counts=bf["counts"], method=method)
        gvr.sparse_attention(bf["q"], bf["dk"], bf["dv"], bf["idx"], lengths=lengths, block_table=bf["sm"],
                             block_size=P, out=bf["out"], lse=bf["lse"])

    keys = ("idx", "sm", "counts", "dk", "dv", "out", "lse")
    eager, e = [], buffers()
    hk_dev, hv_dev = hk.cuda(), hv.cuda()
    for t in range(steps):
        e["F"].copy_(Fs[t])
        e["q"].copy_(qs[t])
        step(e)
        torch_.cuda.synchronize()
        eager.append({kk: e[kk].clone() for kk in keys})
        o2, l2 = gvr.sparse_attention(qs[t], hk_dev, hv_dev, e["idx"], lengths=lengths, block_table=bt, block_size=P)
        torch_.cuda.synchronize()
        assert same_bits(e["out"], o2) and same_bits(e["lse"], l2), f"eager step {t} vs the whole cache"
        if t:
            assert to_np(e["counts"])[0] <= to_np(e["counts"])[1]
        e["res"].copy_(e["sm"])

    g_bf = buffers()
    g_bf["F"].copy_(Fs[0])
    g_bf["q"].copy_(qs[0])
    s = torch_.cuda.Stream()
    s.wait_stream(torch_.cuda.current_stream())
    graph = torch_.cuda.CUDAGraph()
    with torch_.cuda.stream(s):
        step(g_bf)  # warm-up (allocations, lazy loading) outside the capture
        with torch_.cuda.graph(graph, stream=s):
            step(g_bf)
    torch_.cuda.current_stream().wait_stream(s)
    torch_.cuda.synchronize()
    for kk in ("dk", "dv"):  # back to the initial state
        g_bf[kk].zero_()
    g_bf["res"].fill_(-1)
    for t in range(steps):
        g_bf["F"].copy_(Fs[t])
        g_bf["q"].copy_(qs[t])
        for kk in ("sm", "counts", "out", "lse", "idx"):
            g_bf[kk].fill_(-3) if kk != "out" else g_bf[kk].zero_()
        graph.replay()
        torch_.cuda.synchronize()
        for kk in ("idx", "sm", "counts", "dk", "dv"):
            got, want = g_bf[kk], eager[t][kk]
            if kk == "idx":  # the same set (the order is topk's)
                got, want = torch_.sort(got, -1).values, torch_.sort(want, -1).values
            assert same_bits(got, want), f"replay {t}: {kk}"
        # attention in the replay's entry order over the whole cache (bits depend on the order)
        o2, l2 = gvr.sparse_attention(qs[t], hk_dev, hv_dev, g_bf["idx"], lengths=lengths, block_table=bt,
                                      block_size=P)
        torch_.cuda.synchronize()
        assert same_bits(g_bf["out"], o2) and same_bits(g_bf["lse"], l2), f"replay {t}: out / lse"
        if torch_.equal(g_bf["idx"], eager[t]["idx"]):
            assert same_bits(g_bf["out"], eager[t]["out"]) and same_bits(g_bf["lse"], eager[t]["lse"])
        g_bf["res"].copy_(g_bf["sm"])
    del hk, hv, hk_dev, hv_dev
    gc.collect()


# --------------------------------------------------------------------------------------------------
# torch.library: the op's fake implementation and a compiled step (CPU)
# --------------------------------------------------------------------------------------------------
def _torch_case():
    g = torch.Generator().manual_seed(3)
    hk = torch.randn(12, 16, 2, 32, generator=g).to(torch.bfloat16)
    hv = torch.randn(12, 16, 2, 32, generator=g).to(torch.bfloat16)
    ix = torch.tensor([[[3, 7, -1, 3]], [[0, 11, 5, 2]]], dtype=torch.int32)
    bt = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(2)]).int()
    return hk, hv, ix, bt


def test_opcheck_cpu():
    if torch is None or not hasattr(torch, "library") or not hasattr(torch.library, "opcheck"):
        pytest.skip("needs torch with torch.library.opcheck")
    hk, hv, ix, bt = _torch_case()
    ix = ix.clamp(max=5)
    dk, dv = torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16), torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16)
    res = torch.full((2, 6), -1, dtype=torch.int32)
    res[0, 3] = 4
    torch.library.opcheck(torch.ops.gvr.sparda_prefetch.default, (hk, hv, ix, dk, dv, bt, res, None))


def test_compile_aot_eager_matches_eager():
    if torch is None or not hasattr(torch, "compile"):
        pytest.skip("needs torch.compile")
    hk, hv, ix, bt = _torch_case()
    ix = ix.clamp(max=5)
    q = torch.randn(2, 4, 32).to(torch.bfloat16)
    lengths = torch.tensor([90, 60], dtype=torch.int32)

    def step(dk, dv, resident):
        m = gvr.sparda.prefetch(hk, hv, ix, dk, dv, block_table=bt, resident=resident)
        out, lse = gvr.sparse_attention(q, dk, dv, ix, lengths=lengths, block_table=m, block_size=16)
        return m, out, lse

    d0 = [torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    d1 = [x.clone() for x in d0]
    res = torch.full((2, 6), -1, dtype=torch.int32)
    want = step(d0[0], d0[1], res)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(d1[0], d1[1], res)
    assert torch.equal(got[0], want[0]) and torch.equal(d1[0], d0[0]) and torch.equal(d1[1], d0[1])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    ref, _ = gvr.sparse_attention(q, hk, hv, ix, lengths=lengths, block_table=bt, block_size=16)
    assert torch.equal(want[1], ref)


# ---- matmul_carveout ----------------------------------------------------------------------------------

def _carveout_state():
    return torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()


@pytest.mark.skipif(torch is None or not hasattr(torch._C, "_set_sm_carveout_experimental"),
                    reason="torch with an SM carveout for matmuls")
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns that both knobs are experimental
def test_matmul_carveout_sets_and_restores():
    before = _carveout_state()
    with gvr.sparda.matmul_carveout(3) as n:
        assert n == 3
        assert _carveout_state() == (3, torch._C._BlasBackend.Cublaslt)
        with gvr.sparda.matmul_carveout(np.int64(1)):  # nested: the inner one's exit restores the outer's
            assert _carveout_state()[0] == 1
        assert _carveout_state() == (3, torch._C._BlasBackend.Cublaslt)
    assert _carveout_state() == before
    with pytest.raises(KeyError):  # restored on an exception too
        with gvr.sparda.matmul_carveout(0):
            assert _carveout_state()[0] == 0
            raise KeyError("x")
    assert _carveout_state() == before


@pytest.mark.skipif(torch is None, reason="torch")
@pytest.mark.parametrize("bad,exc,msg", [(True, TypeError, "'sms' must be an int, got bool"),
                                         (2.0, TypeError, "'sms' must be an int, got float"),
                                         ("4", TypeError, "'sms' must be an int, got str"),
                                         (-1, ValueError, "'sms' must be >= 0, got -1")])
def test_matmul_carveout_bad_sms(bad, exc, msg):
    before = _carveout_state() if hasattr(torch._C, "_get_sm_carveout_experimental") else None
    with pytest.raises(exc, match=msg):
        with gvr.sparda.matmul_carveout(bad):
            pass
    if before is not None:
        assert _carveout_state() == before


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cuda_matmul_carveout_bounds_and_results(gpu):
    # sms must leave the GPU an SM; a carved matmul computes the same product (cuBLASLt, fp32 inputs
    # exactly representable: integers, sums below 2^24)
    t = gpu
    if not hasattr(t._C, "_set_sm_carveout_experimental"):
        pytest.skip("this torch has no SM carveout for matmuls")
    total = t.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match=f"below this GPU's {total} SMs, got {total}"):
        with gvr.sparda.matmul_carveout(total):
            pass
    g = t.Generator().manual_seed(1)
    a = t.randint(-8, 8, (512, 256), generator=g).float().cuda()
    b = t.randint(-8, 8, (256, 384), generator=g).float().cuda()
    want = (a.double().cpu() @ b.double().cpu()).float()
    with gvr.sparda.matmul_carveout(4):
        got = a @ b
    assert t.equal(got.cpu(), want)
