"""GPU tests for fp8 (e4m3fn) KV caches and per-tensor K/V scales in gvr.sparse_attention and
gvr.prr.repair: the CUDA kernels against the C CPU path run on the same inputs (torch CPU tensors) and
against the float64 NumPy reference (attention_reference.py: K' = k_scale * decode(K), V' = v_scale *
decode(V), decode() written from the e4m3fn bit layout), both with harness.assert_close (factor 2 x the
naive error in q's precision on the exactly decoded values + one ulp). Empty states are exact; NaN codes
give NaN exactly where the reference has it, and NaN in tokens not attended changes nothing (bit for
bit); the CUDA path is deterministic and replays identically from a CUDA graph; a misaligned fp8 cache
(start not 8-byte aligned, strides not multiples of 8 elements) is a ValueError naming it.

Every test is collected; each is skipped, with the reason, where torch with a CUDA device or gvr's
CUDA library is missing (conftest.py, harness.gpu_skip_reason).
"""
import re

import numpy as np
import pytest

import gvr
from attention_reference import (
    check_state, finalize_naive, finalize_ref, make_case, merge_naive, missed_ref, random_indices,
    to_numpy,
)
from harness import assert_close, torch_or_none
from test_attention_gpu import _bits, _t, both, same

torch = torch_or_none()  # None without torch: every test here is then skipped before it runs

pytestmark = pytest.mark.gpu
NEG_INF = -np.inf
SENTINEL = 7.0
FP8 = "float8_e4m3fn"
DTYPES = ("bfloat16", "float16")


def fp8_case(rng, dtype="bfloat16", **kw):
    return make_case(rng, dtype=dtype, kv_dtype=FP8, **kw)


# --------------------------------------------------------------------------------------------------
# the coverage grid
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hsel", ["1", "Hkv"])
@pytest.mark.parametrize("gqa", [1, 4, 8, 16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_head_dims_gqa_and_selection_heads(D, gqa, Hsel):
    rng = np.random.default_rng(D * 100 + gqa * 10 + (Hsel == "1"))
    Hkv = 2 if gqa >= 8 else 4
    dtype = DTYPES[(D // 64 + gqa) % 2]
    scales = [dict(), dict(k_scale=0.37, v_scale=2.5)][gqa % 3 == 1]
    for paged in (True, False):
        c = fp8_case(rng, dtype=dtype, B=3, Hq=gqa * Hkv, Hkv=Hkv, D=D, P=64, block_size=16 if paged else 1,
                     paged=paged, n=12 if paged else 200, Hsel=1 if Hsel == "1" else Hkv, dup=0.05, extra_pages=8,
                     fp8_amp=2.0, **scales)
        both(c, what=f"D={D} gqa={gqa} Hsel={Hsel} paged={paged} {dtype}")


PAGE_BLOCK = [(P, G, True) for P in (16, 64) for G in (1, 16, 64)] + [(P, 1, False) for P in (16, 64)]


@pytest.mark.parametrize("P,G,paged", PAGE_BLOCK,
                         ids=[f"{'bt' if p else 'slots'}-P{P}-G{G}" for P, G, p in PAGE_BLOCK])
def test_page_and_block_sizes(P, G, paged):
    rng = np.random.default_rng(P * 1000 + G + paged)
    n = 8 if G >= 64 else 64
    for Hsel, dtype in ((1, "bfloat16"), (2, "float16")):
        c = fp8_case(rng, dtype=dtype, B=3, Hq=16, Hkv=2, D=128, P=P, block_size=G, paged=paged, n=n, Hsel=Hsel,
                     dup=0.1, bad_pages=paged, seq_len=max(8 * G, 4 * P, 256), k_scale=0.37, v_scale=2.5)
        both(c, what=f"P={P} G={G} paged={paged} Hsel={Hsel}")


# (B, n): small selections, and long ones at B = 1 that the planner splits over many CTAs (merged)
SIZES = [(1, 1), (3, 8), (8, 5), (1, 1024), (1, 4096), (1, 8192)]


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
@pytest.mark.parametrize("B,n", SIZES, ids=[f"B{B}-n{n}" for B, n in SIZES])
def test_batch_and_selection_sizes(B, n, paged):
    rng = np.random.default_rng(B * 10000 + n + paged)
    dtype = DTYPES[n % 2]
    Hkv, D = (1, 128) if n > 8 else (2, 64)
    if paged:
        c = fp8_case(rng, dtype=dtype, B=B, Hq=8 * Hkv, Hkv=Hkv, D=D, P=64, block_size=1, n=n,
                     seq_len=max(2 * n, 256), pad=0.02, oob=0.02, k_scale=1.5, v_scale=0.37)
    else:
        c = fp8_case(rng, dtype=dtype, B=B, Hq=8 * Hkv, Hkv=Hkv, D=D, P=64, paged=False, n=n, extra_pages=n // 32 + 8,
                     pad=0.02, oob=0.02, k_scale=1.5, v_scale=0.37)
    both(c, what=f"B={B} n={n}")
    if n >= 1024:
        both(c, out_f32=True, what=f"B={B} n={n} float32 out")


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_layouts(layout, combined):
    rng = np.random.default_rng(3 + combined)
    for D in (64, 256):
        c = fp8_case(rng, B=3, Hq=8, Hkv=2, D=D, P=16, block_size=16, n=12, Hsel=2, layout=layout, combined=combined,
                     q_padded=True, k_scale=2.5, v_scale=0.37)
        both(c, what=f"{layout} combined={combined} D={D}")


@pytest.mark.parametrize("gqa", [3, 12])
def test_odd_gqa_groups(gqa):
    rng = np.random.default_rng(100 + gqa)
    c = fp8_case(rng, B=2, Hq=gqa * 2, Hkv=2, D=128, P=16, block_size=16, n=20, Hsel=2, q_padded=True)
    both(c, what=f"gqa={gqa}")
    c = fp8_case(rng, dtype="float16", B=2, Hq=gqa * 2, Hkv=2, D=64, P=64, paged=False, n=400, extra_pages=8,
                 k_scale=0.5)
    both(c, out_f32=True, what=f"gqa={gqa} slots")


def test_empty_rows_and_out_of_range():
    rng = np.random.default_rng(4)
    c = fp8_case(rng, B=4, Hq=8, Hkv=2, D=64, P=16, block_size=128, n=4, Hsel=2, seq_len=512,
                 lengths=np.array([0, 300, 512, 512]), pad=0, oob=0)
    idx = c.indices.copy()
    idx[1] = -1
    idx[2, 0] = [2**31 - 1, 2**24 + 1, 4, -(2**31)]
    idx[3, 1, :2] = idx[3, 1, 2]  # duplicates count twice
    c = c.with_indices(idx)
    (go, gl), _ = both(c, what="empty rows")
    assert torch.all(gl[0] == float("-inf")) and torch.all(go[0] == 0)
    assert torch.all(gl[1] == float("-inf")) and torch.all(gl[2, :4] == float("-inf"))
    c0 = c.with_indices(np.zeros((4, 2, 0), np.int32))
    (go, gl), _ = both(c0, what="n=0")
    assert torch.all(go == 0) and torch.all(gl == float("-inf"))


@pytest.mark.parametrize("cache", ["fp8", "bfloat16"])
@pytest.mark.parametrize("ks,vs", [(0.37, 2.5), (-1.25, 0.0), (1e-3, 1e3)])
def test_scales(ks, vs, cache):
    rng = np.random.default_rng(5)
    kw = dict(B=3, Hq=16, Hkv=2, D=128, P=64, paged=False, n=700, Hsel=2, extra_pages=20, k_scale=ks, v_scale=vs)
    c = fp8_case(rng, **kw) if cache == "fp8" else make_case(rng, dtype="bfloat16", **kw)
    both(c, what=f"{cache} k_scale={ks} v_scale={vs}")


@pytest.mark.parametrize("amp,ks,vs", [(150.0, 0.004, 0.01), (0.004, 300.0, 200.0)], ids=["saturated", "subnormal"])
def test_large_and_subnormal_codes(amp, ks, vs):
    rng = np.random.default_rng(6)
    c = fp8_case(rng, B=2, Hq=16, Hkv=2, D=128, P=64, paged=False, n=600, Hsel=2, extra_pages=20, fp8_amp=amp,
                 k_scale=ks, v_scale=vs)
    both(c, what=f"amplitude {amp}")


# --------------------------------------------------------------------------------------------------
# NaN codes
# --------------------------------------------------------------------------------------------------


def attended_anywhere(case):
    """bool [num_pages * P, Hkv]: the (slot, KV head) pairs some selection row attends."""
    Hkv, Hsel = case.k.shape[2], case.indices.shape[1]
    used = np.zeros((case.num_pages * case.P, Hkv), bool)
    for b in range(case.B):
        for s in range(Hsel):
            sl = case.slots(b, s)
            for g in (range(Hkv) if Hsel == 1 else [s]):
                used[sl, g] = True
    return used


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_nan_codes_in_attended_tokens(paged, which):
    rng = np.random.default_rng(7 + paged)
    c = fp8_case(rng, B=3, Hq=16, Hkv=2, D=128, P=16, block_size=16 if paged else 1, paged=paged,
                 n=12 if paged else 300, Hsel=2, pad=0, oob=0, extra_pages=20, seq_len=256, k_scale=0.37, v_scale=2.5)
    c.inject_nan(which, c.slots(0, 1)[:1], 1, dims=[0, 17, 127])
    c.inject_nan(which, c.slots(2, 0)[-1:], 0, code=0xFF)
    assert np.isnan(c.ref()[0]).any()
    both(c, what=f"NaN in {which}")


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_nan_codes_in_tokens_not_attended_change_nothing(paged):
    """Every (slot, KV head) no row attends -- neighbours in the same pages and tiles, tokens past the
    rows' lengths -- holds NaN in K and V: the CUDA result is bit for bit the clean one (tiles never
    multiply a masked NaN by 0)."""
    rng = np.random.default_rng(9 + paged)
    c = fp8_case(rng, B=3, Hq=16, Hkv=2, D=128, P=16, block_size=16 if paged else 1, paged=paged,
                 n=8 if paged else 300, Hsel=2, dup=0.05, extra_pages=20, seq_len=256, k_scale=2.5, v_scale=0.37)
    n = c.indices.shape[2]
    q, k, v, idx, kw = c.args("torch", "cuda")
    clean = gvr.sparse_attention(q, k, v, idx, **kw)
    cparts = (torch.empty(3, 16, n, 128, device="cuda"), torch.empty(3, 16, n, device="cuda"))
    gvr.sparse_attention(q, k, v, idx, partials=cparts, **kw)
    st = (torch.randn(3, 16, 128, device="cuda"), torch.randn(3, 16, device="cuda"))
    crep = (st[0].clone(), st[1].clone())
    gvr.prr.repair(*crep, q, k, v, idx, **kw)
    unused = ~attended_anywhere(c)
    dirty = c.with_indices(c.indices)
    for g in range(2):
        sl = np.nonzero(unused[:, g])[0]
        dirty.inject_nan("k", sl, g, code=(0x7F, 0xFF)[g]).inject_nan("v", sl, g)
    q, k, v, idx, kw = dirty.args("torch", "cuda")
    got = gvr.sparse_attention(q, k, v, idx, **kw)
    parts = (torch.empty(3, 16, n, 128, device="cuda"), torch.empty(3, 16, n, device="cuda"))
    gvr.sparse_attention(q, k, v, idx, partials=parts, **kw)
    rep = (st[0].clone(), st[1].clone())
    gvr.prr.repair(*rep, q, k, v, idx, **kw)
    torch.cuda.synchronize()
    assert same(got[0], clean[0]) and same(got[1], clean[1]), "attention"
    assert same(parts[0], cparts[0]) and same(parts[1], cparts[1]), "partials"
    assert same(rep[0], crep[0]) and same(rep[1], crep[1]), "repair"
    check_state(dirty, *got, what="NaN outside the selection")


# --------------------------------------------------------------------------------------------------
# partials, exact mode, repair
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_partials_are_each_entry_alone(paged, Hsel):
    rng = np.random.default_rng(10 + Hsel + 2 * paged)
    c = fp8_case(rng, B=2, Hq=8, Hkv=2, D=128, P=16, block_size=32 if paged else 1, paged=paged, n=24, Hsel=Hsel,
                 dup=0.1, k_scale=0.37, v_scale=2.5)
    rpo, rpl = c.partials_ref()
    npo, npl = c.partials_naive()
    for device in ("cuda", "cpu"):
        q, k, v, idx, kw = c.args("torch", device)
        po = torch.full((2, 8, 24, 128), 9.0, device=device)
        pl = torch.full((2, 8, 24), 9.0, device=device)
        out, lse = gvr.sparse_attention(q, k, v, idx, partials=(po, pl), **kw)
        check_state(c, out, lse, what=f"{device} with partials")
        assert_close(to_numpy(po), rpo, npo, "bfloat16", what=f"{device} part_out")
        assert_close(to_numpy(pl), rpl, npl, "bfloat16", what=f"{device} part_lse")
        assert torch.all(po.cpu()[torch.from_numpy(rpl == NEG_INF)] == 0)


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_finalize_then_repair_missed_equals_attention(paged):
    rng = np.random.default_rng(12 + paged)
    B, Hq, D, Hsel = 3, 16, 128, 2
    c = fp8_case(rng, B=B, Hq=Hq, Hkv=2, D=D, P=16, block_size=16 if paged else 1, paged=paged, n=1, Hsel=Hsel,
                 seq_len=2048, k_scale=0.37, v_scale=2.5)
    valid = c.n_entries_valid()
    n_pred, n_sel = 48, 40
    pred = random_indices(rng, B, Hsel, n_pred, valid, pad=0.1, oob=0.05, dup=0.05)
    sel = np.empty((B, Hsel, n_sel), np.int32)
    for b in range(B):
        for s in range(Hsel):
            p = sorted({int(x) for x in pred[b, s] if 0 <= x < valid})
            pick = list(rng.choice(p, size=min(len(p), n_sel // 2), replace=False))
            fresh = [x for x in rng.permutation(valid) if x not in p][:n_sel - len(pick)]
            row = pick + fresh
            rng.shuffle(row)
            sel[b, s] = row
    q, k, v, _, kw = c.args("torch", "cuda")
    po = torch.empty(B, Hq, n_pred, D, device="cuda")
    pl = torch.empty(B, Hq, n_pred, device="cuda")
    gvr.sparse_attention(q, k, v, _t(pred), partials=(po, pl), **kw)
    out, lse = gvr.prr.finalize((po, pl), _t(pred), _t(sel))
    fo_ref, fl_ref = finalize_ref(po.cpu(), pl.cpu(), pred, sel)
    fo_nv, fl_nv = finalize_naive(po.cpu(), pl.cpu(), pred, sel)
    assert_close(to_numpy(out), fo_ref, fo_nv, "float32", what="finalize out (same partials)")
    assert_close(to_numpy(lse), fl_ref, fl_nv, "float32", what="finalize lse (same partials)")
    miss = gvr.prr.missed(_t(sel), _t(pred))
    gvr.prr.repair(out, lse, q, k, v, miss, **kw)
    npo, npl = c.partials_naive(pred)
    fo, fl = finalize_naive(npo, npl, pred, sel)
    mo, ml = c.naive(missed_ref(sel, pred))
    no, nl = merge_naive(fo, fl, mo, ml)
    ro, rl = c.ref(sel)
    assert_close(to_numpy(out), ro, no, "bfloat16", what="exact mode out")
    assert_close(to_numpy(lse), rl, nl, "bfloat16", what="exact mode lse")


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_repair_twice_equals_attention_over_the_union(paged):
    rng = np.random.default_rng(14 + paged)
    c = fp8_case(rng, B=3, Hq=16, Hkv=2, D=128, P=16, block_size=16 if paged else 1, paged=paged,
                 n=40 if paged else 600, Hsel=2, extra_pages=40, k_scale=2.5, v_scale=0.37)
    m = rng.random(c.indices.shape[2]) < 0.5
    A, Bs = np.ascontiguousarray(c.indices[:, :, m]), np.ascontiguousarray(c.indices[:, :, ~m])
    q, k, v, _, kw = c.args("torch", "cuda")
    out, lse = gvr.sparse_attention(q, k, v, _t(A), out=torch.empty(3, 16, 128, device="cuda"), **kw)
    r = gvr.prr.repair(out, lse, q, k, v, _t(Bs), **kw)
    assert r[0] is out and r[1] is lse
    na, nb = c.naive(A), c.naive(Bs)
    no, nl = merge_naive(na[0], na[1], nb[0], nb[1])
    ro, rl = c.ref(np.concatenate([A, Bs], axis=2))
    assert_close(to_numpy(out), ro, no, "bfloat16", what="repair out")
    assert_close(to_numpy(lse), rl, nl, "bfloat16", what="repair lse")


# (B, Hq, Hkv, mode, n, Hsel, Hx, nx, dtype, D)
FUSED = [
    (3, 16, 2, ("bt", 64, 64), 32, 2, 2, 8, "bfloat16", 128),
    (8, 8, 2, ("bt", 16, 16), 64, 1, 1, 64, "float16", 64),
    (2, 16, 1, ("bt", 64, 1), 4096, 1, 1, 100, "bfloat16", 256),  # ragged_lengths: row 0 of length 0
    (3, 16, 2, ("slots", 64, 1), 2048, 2, 1, 24, "float16", 128),
]


@pytest.mark.parametrize("config", FUSED, ids=[f"B{f[0]}-Hq{f[1]}-{f[3][0]}-G{f[3][2]}-n{f[4]}-{f[8]}-D{f[9]}"
                                               for f in FUSED])
def test_fused_repair_extras_against_cpu_and_reference(config):
    from test_prr_repair_fused import make_exclude, ragged_lengths
    from test_prr_repair_fused_gpu import _prior, fused_both

    B, Hq, Hkv, (kind, P, G), n, Hsel, Hx, nx, dtype, D = config
    rng = np.random.default_rng(16 + FUSED.index(config))
    sc = dict(k_scale=0.37, v_scale=2.5)
    if kind == "bt":
        seq_len = max(2 * n * G, 4 * P, 256)
        c = fp8_case(rng, dtype=dtype, B=B, Hq=Hq, Hkv=Hkv, D=D, P=P, block_size=G, n=n, Hsel=Hsel, seq_len=seq_len,
                     lengths=ragged_lengths(B, -(-seq_len // P) * P, G), pad=0.1, oob=0.05, dup=0.05,
                     bad_pages=True, **sc)
    else:
        c = fp8_case(rng, dtype=dtype, B=B, Hq=Hq, Hkv=Hkv, D=D, P=P, paged=False, n=n, Hsel=Hsel,
                     extra_pages=n // P + 8, pad=0.1, oob=0.05, dup=0.05, **sc)
    X = make_exclude(rng, c.indices, Hx, nx, c.n_entries_valid(), hit=0.6)
    fused_both(c, X, _prior(rng, B, Hq, D), ncounts=4, cast_dtype=dtype if D != 64 else "float32",
               what=f"fp8 {config}")


# --------------------------------------------------------------------------------------------------
# determinism, graphs, ops
# --------------------------------------------------------------------------------------------------


def test_determinism():
    rng = np.random.default_rng(20)
    c = fp8_case(rng, B=1, Hq=16, Hkv=1, D=128, P=64, paged=False, n=8192, extra_pages=300, k_scale=0.37,
                 v_scale=2.5)
    c2 = fp8_case(rng, B=8, Hq=16, Hkv=2, D=128, P=64, paged=False, n=1024, Hsel=2, extra_pages=300, k_scale=0.37,
                  v_scale=2.5)
    for case in (c, c2):
        q, k, v, idx, kw = case.args("torch", "cuda")
        o0, l0 = gvr.sparse_attention(q, k, v, idx, **kw)
        s0 = torch.randn(case.B, 16, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        sl0 = torch.randn(case.B, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        r0 = [s0.clone(), sl0.clone()]
        gvr.prr.repair(r0[0], r0[1], q, k, v, idx, **kw)
        for _ in range(20):
            o, l = gvr.sparse_attention(q, k, v, idx, **kw)
            assert same(o, o0) and same(l, l0)
            r = [s0.clone(), sl0.clone()]
            gvr.prr.repair(r[0], r[1], q, k, v, idx, **kw)
            assert same(r[0], r0[0]) and same(r[1], r0[1])
        check_state(case, o0, l0, what=f"determinism B={case.B}")


@pytest.mark.parametrize("n", [32, 4096])
def test_cuda_graph_capture_replays_identically(n):
    rng = np.random.default_rng(21 + n)
    B = 8 if n == 32 else 1
    c = fp8_case(rng, B=B, Hq=16, Hkv=2, D=128, P=16, block_size=16 if n == 32 else 1, n=n, Hsel=2,
                 seq_len=2048 if n == 32 else 2 * n, k_scale=0.37, v_scale=2.5)
    q, k, v, idx, kw = c.args("torch", "cuda")
    miss = _t(random_indices(rng, B, 2, 16, c.n_entries_valid(), pad=0.2))
    X = idx[:, :, :3].contiguous()
    static_q = q.clone()
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")

    def step(out, lse, cast):
        gvr.sparse_attention(static_q, k, v, idx, out=out, lse=lse, **kw)
        gvr.prr.repair(out, lse, static_q, k, v, miss, exclude=X, counts=counts, cast_out=cast, **kw)

    eo, el = torch.empty(B, 16, 128, device="cuda"), torch.empty(B, 16, device="cuda")
    ec = torch.empty(B, 16, 128, dtype=torch.bfloat16, device="cuda")
    step(eo, el, ec)  # eager (also creates the workspace outside the capture)
    go, gl, gc = torch.empty_like(eo), torch.empty_like(el), torch.empty_like(ec)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(go, gl, gc)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(go, gl, gc)
    for _ in range(3):
        go.fill_(7), gl.fill_(7), gc.fill_(7)
        g.replay()
        torch.cuda.synchronize()
        assert same(go, eo) and same(gl, el) and same(gc, ec)
    static_q.copy_(fp8_case(np.random.default_rng(99), B=B, Hq=16, Hkv=2, D=128).args("torch", "cuda")[0])
    g.replay()
    step(eo, el, ec)
    torch.cuda.synchronize()
    assert same(go, eo) and same(gl, el) and same(gc, ec)


def test_non_default_stream():
    rng = np.random.default_rng(22)
    c = fp8_case(rng, B=4, Hq=8, Hkv=2, D=128, P=16, block_size=16, n=16, Hsel=2, k_scale=0.37)
    q, k, v, idx, kw = c.args("torch", "cuda")
    want = gvr.sparse_attention(q, k, v, idx, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q2 = q * 1.0
        got = gvr.sparse_attention(q2, k, v, idx, **kw)
    s.synchronize()
    assert same(got[0], want[0]) and same(got[1], want[1])


def test_opcheck_and_compile_cuda():
    rng = np.random.default_rng(23)
    c = fp8_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=3, Hsel=2)
    q, k, v, idx, kw = c.args("torch", "cuda")
    att = (q, k, v, idx, kw["lengths"], kw["block_table"], 16, None, 0.37, 2.5)
    # torch's schema check compares with torch.allclose, which float8 lacks: the other checks
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.gvr.sparse_attention.default, att, test_utils=utils)
    st = (torch.randn(2, 4, 64, device="cuda"), torch.randn(2, 4, device="cuda"))
    ex, cnt = idx[:, :, :1].contiguous(), torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.gvr.prr_repair.default, st + att + (ex, cnt, torch.empty_like(q)),
                          test_utils=utils)
    o1, l1 = torch.ops.gvr.sparse_attention(*att)
    o2, l2 = gvr.sparse_attention(q, k, v, idx, **kw, k_scale=0.37, v_scale=2.5)
    assert same(o1, o2) and same(l1, l2)

    def f(q, k, v, idx, bt, ln):
        return gvr.sparse_attention(q * 1.0, k, v, idx, block_table=bt, lengths=ln, block_size=16, k_scale=0.37,
                                    v_scale=2.5)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, idx, kw["block_table"], kw["lengths"])
    assert same(got[0], o2) and same(got[1], l2)


# --------------------------------------------------------------------------------------------------
# misaligned fp8 caches
# --------------------------------------------------------------------------------------------------


def _name_re(name):
    return rf"\b{re.escape(name)}\b"


def test_misaligned_fp8_cache_is_a_value_error_naming_it():
    rng = np.random.default_rng(24)
    c = fp8_case(rng, B=2, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=4, Hsel=2, combined=False)
    q, k, v, idx, kw = c.args("torch", "cuda")
    npg, P, Hkv, D = k.shape
    out = torch.full((2, 8, 64), SENTINEL, dtype=q.dtype, device="cuda")
    lse = torch.full((2, 8), SENTINEL, device="cuda")
    st = (torch.full((2, 8, 64), SENTINEL, device="cuda"), torch.full((2, 8), SENTINEL, device="cuda"))
    # start not 8-byte aligned (strides fine)
    buf = torch.zeros(npg * P * Hkv * D + 8, dtype=torch.uint8, device="cuda")
    odd = buf[1:1 + npg * P * Hkv * D].view(torch.float8_e4m3fn).view(npg, P, Hkv, D)
    odd.view(torch.uint8).copy_(k.view(torch.uint8))
    assert odd.data_ptr() % 8 == 1
    # strides not multiples of 8 elements (rows of D + 4)
    wide = torch.zeros(npg, P, Hkv, D + 4, dtype=torch.uint8, device="cuda")
    wide[..., :D] = k.view(torch.uint8)
    strided = wide.view(torch.float8_e4m3fn)[..., :D]
    assert strided.stride(2) == D + 4
    for bad in (odd, strided):
        for name, kk, vv in (("k_cache", bad, v), ("v_cache", k, bad)):
            with pytest.raises(ValueError, match=_name_re(name)):
                gvr.sparse_attention(q, kk, vv, idx, out=out, lse=lse, **kw)
            with pytest.raises(ValueError, match=_name_re(name)):
                gvr.prr.repair(*st, q, kk, vv, idx, **kw)
    torch.cuda.synchronize()
    assert torch.all(out == SENTINEL) and torch.all(lse == SENTINEL)
    assert torch.all(st[0] == SENTINEL) and torch.all(st[1] == SENTINEL)
    # the same values aligned: accepted, the reference result
    (go, gl), _ = both(c, what="aligned")


def test_bad_inputs_on_cuda():
    rng = np.random.default_rng(25)
    c = fp8_case(rng, B=2, Hq=8, Hkv=2, D=64, P=16, block_size=16, n=4, Hsel=2)
    q, k, v, idx, kw = c.args("torch", "cuda")
    with pytest.raises(TypeError, match=r"\bk_cache\b|\bv_cache\b"):  # a dtype mismatch: TypeError
        gvr.sparse_attention(q, k, v.to(torch.bfloat16), idx, **kw)
    with pytest.raises((TypeError, ValueError), match=_name_re("q")):
        gvr.sparse_attention(q.to(torch.float8_e4m3fn), k, v, idx, **kw)
    with pytest.raises((TypeError, ValueError), match=_name_re("q")):
        gvr.sparse_attention(q.float(), k, v, idx, **kw)  # float32 q: CPU only
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=_name_re(name)):
            gvr.sparse_attention(q, k, v, idx, **kw, **{name: float("nan")})
        with pytest.raises(TypeError, match=_name_re(name)):
            gvr.sparse_attention(q, k, v, idx, **kw, **{name: "1.0"})
    with pytest.raises(ValueError, match=_name_re("k_cache")):
        gvr.sparse_attention(q, k.cpu(), v, idx, **kw)
