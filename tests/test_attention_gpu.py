"""GPU tests for gvr.sparse_attention, gvr.merge_states and gvr.prr: the CUDA kernels against the C CPU
path run on the same bfloat16 / float16 inputs (torch CPU tensors) and against the float64 NumPy
reference (attention_reference.py), both with harness.assert_close (factor 2 x the naive error in the
input precision + one ulp). Integer results (prr.missed) and empty states are exact; the CUDA path is
deterministic bit for bit and replays identically from a CUDA graph.

Every test is collected; each is skipped, with the reason, where torch with a CUDA device or gvr's
CUDA library is missing (conftest.py, harness.gpu_skip_reason).
"""
import numpy as np
import pytest

import gvr
from attention_reference import (
    check_state, finalize_naive, finalize_ref, make_case, merge_naive, merge_ref, missed_ref, random_indices,
    to_numpy,
)
from harness import assert_close, round_to, torch_or_none

torch = torch_or_none()  # None without torch: every test here is then skipped before it runs

pytestmark = pytest.mark.gpu
NEG_INF = -np.inf
DTYPES = ("bfloat16", "float16")


def _bits(x):
    x = x.detach().contiguous()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).cpu()


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _t(a, device="cuda"):
    """A fresh tensor on ``device`` (never a view of ``a``)."""
    return torch.from_numpy(np.array(a, copy=True, order="C")).to(device)


def both(case, *, out_f32=False, what="", **kw):
    """(CUDA (out, lse), CPU (out, lse)) of the same call; both checked against the reference, the
    same empty heads and NaN pattern; the caches unmodified. (test_attention_fp8_gpu.py uses it too.)"""
    res = []
    for device in ("cuda", "cpu"):
        q, k, v, idx, akw = case.args("torch", device)
        akw.update(kw)
        if out_f32:
            akw["out"] = torch.empty(tuple(q.shape), device=device)
        k0, v0 = _bits(k), _bits(v)
        o, l = gvr.sparse_attention(q, k, v, idx, **akw)
        assert o.device.type == device and l.device.type == device and l.dtype == torch.float32
        assert o.dtype == (torch.float32 if out_f32 else q.dtype)
        assert torch.equal(_bits(k), k0) and torch.equal(_bits(v), v0), f"{what}: the cache was modified"
        res.append((o, l))
    (go, gl), (co, cl) = res
    torch.cuda.synchronize()
    check_state(case, go, gl, what=f"{what} cuda")
    check_state(case, co, cl, what=f"{what} cpu")
    assert torch.equal(gl.cpu() == float("-inf"), cl == float("-inf")), f"{what}: CUDA and CPU disagree on empty heads"
    assert torch.equal(torch.isnan(go.cpu()), torch.isnan(co)) and torch.equal(torch.isnan(gl.cpu()), torch.isnan(cl))
    return res


# --------------------------------------------------------------------------------------------------
# the coverage grid
# --------------------------------------------------------------------------------------------------
PAGE_BLOCK = [(P, G, True) for P in (1, 16, 64, 128) for G in (1, 16, 64, 128)] + \
             [(P, 1, False) for P in (1, 16, 64, 128)] + \
             [(48, 24, True), (24, 48, True), (12, 36, True), (48, 1, False)]  # sizes that are not powers of two


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,G,paged", PAGE_BLOCK,
                         ids=[f"{'bt' if p else 'slots'}-P{P}-G{G}" for P, G, p in PAGE_BLOCK])
def test_page_and_block_sizes(P, G, paged, dtype):
    rng = np.random.default_rng(P * 1000 + G + paged)
    n = 8 if G >= 64 else 64
    for Hsel in (1, 2):
        c = make_case(rng, B=3, Hq=16, Hkv=2, D=128, P=P, block_size=G, paged=paged, n=n, Hsel=Hsel, dup=0.1,
                      bad_pages=paged and P >= 16, dtype=dtype, seq_len=max(8 * G, 4 * P, 256))
        both(c)


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_head_dims_and_layouts(D, layout, combined):
    rng = np.random.default_rng(D)
    for dtype in DTYPES:
        c = make_case(rng, B=3, Hq=8, Hkv=2, D=D, P=16, block_size=16, n=12, Hsel=2, layout=layout,
                      combined=combined, dtype=dtype, q_padded=True)
        both(c)
        c = make_case(rng, B=3, Hq=8, Hkv=2, D=D, P=64, paged=False, n=300, layout=layout, combined=combined,
                      dtype=dtype, extra_pages=10)
        both(c, out_f32=True)


@pytest.mark.parametrize("Hsel", ["1", "Hkv"])
@pytest.mark.parametrize("gqa", [1, 4, 8, 16])
def test_gqa_and_selection_heads(gqa, Hsel):
    rng = np.random.default_rng(gqa)
    Hkv = 2 if gqa >= 8 else 4
    for paged in (True, False):
        c = make_case(rng, B=3, Hq=gqa * Hkv, Hkv=Hkv, D=128, P=64, block_size=64 if paged else 1, paged=paged,
                      n=10 if paged else 400, Hsel=1 if Hsel == "1" else Hkv, dtype="bfloat16", extra_pages=8)
        both(c)


@pytest.mark.parametrize("gqa", [3, 5, 12])
def test_odd_gqa_groups(gqa):
    # GQA groups that are not powers of two: the tensor-core kernel's padding rows (GQ..15) never written
    rng = np.random.default_rng(100 + gqa)
    for D in (64, 128):
        c = make_case(rng, B=2, Hq=gqa * 2, Hkv=2, D=D, P=16, block_size=16, n=20, Hsel=2, dtype="bfloat16",
                      q_padded=True)
        both(c)
        c = make_case(rng, B=2, Hq=gqa * 2, Hkv=2, D=D, P=64, paged=False, n=400, Hsel=1, dtype="float16",
                      extra_pages=8)
        both(c, out_f32=True)


@pytest.mark.parametrize("B", [1, 3, 64])
def test_batch_sizes(B):
    rng = np.random.default_rng(B)
    c = make_case(rng, B=B, Hq=8, Hkv=1, D=128, P=16, block_size=16, n=40, seq_len=1024, dtype="bfloat16")
    both(c)
    c = make_case(rng, B=B, Hq=16, Hkv=1, D=64, P=1, paged=False, n=2048, extra_pages=4000, dtype="float16")
    both(c, out_f32=True)


@pytest.mark.parametrize("n", [0, 1, 2048, 8192])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_selection_sizes(n, paged):
    rng = np.random.default_rng(n + 5)
    if paged:
        c = make_case(rng, B=3, Hq=8, Hkv=1, D=128, P=64, block_size=1, n=n, seq_len=max(2 * n, 64),
                      pad=0.02 if n else 0, oob=0.02 if n else 0, dtype="bfloat16")
    else:
        c = make_case(rng, B=3, Hq=8, Hkv=1, D=128, P=64, paged=False, n=n, extra_pages=n // 32 + 8,
                      pad=0.02 if n else 0, oob=0.02 if n else 0, dtype="bfloat16")
    (go, gl), _ = both(c)
    if n == 0:
        assert torch.all(go == 0) and torch.all(gl == float("-inf"))


def test_lse_strides_and_strided_out():
    rng = np.random.default_rng(3)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=128, P=16, block_size=32, n=10, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    lse = torch.full((8, 3), 5.0, device="cuda").t()
    big = torch.full((3, 9, 136), 5.0, device="cuda")
    out = big[:, 1:, 8:]
    r = gvr.sparse_attention(q, k, v, idx, out=out, lse=lse, **kw)
    assert r[0] is out and r[1] is lse
    check_state(c, out, lse, what="strided out, transposed lse")
    assert torch.all(big[:, 0] == 5.0) and torch.all(big[:, :, :8] == 5.0)


def test_empty_rows_and_out_of_range():
    rng = np.random.default_rng(4)
    c = make_case(rng, B=4, Hq=8, Hkv=2, D=64, P=16, block_size=128, n=4, Hsel=2, seq_len=512,
                  lengths=np.array([0, 300, 512, 512]), pad=0, oob=0, dtype="bfloat16")
    idx = c.indices.copy()
    idx[1] = -1
    idx[2, 0] = [2**31 - 1, 2**24 + 1, 4, -(2**31)]  # x * G overflows int32: skipped, never read
    idx[3, 1, :2] = idx[3, 1, 2]  # duplicates count twice
    c = c.with_indices(idx)
    (go, gl), _ = both(c)
    assert torch.all(gl[0] == float("-inf")) and torch.all(go[0] == 0)
    assert torch.all(gl[1] == float("-inf")) and torch.all(gl[2, :4] == float("-inf"))


# --------------------------------------------------------------------------------------------------
# repair, partials, exact mode, missed, merge
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_repair_twice_equals_attention_over_the_union(paged):
    rng = np.random.default_rng(6)
    c = make_case(rng, B=3, Hq=16, Hkv=2, D=128, P=16, block_size=16 if paged else 1, paged=paged,
                  n=40 if paged else 600, Hsel=2, dtype="bfloat16", extra_pages=40)
    m = rng.random(c.indices.shape[2]) < 0.5
    A, Bs = np.ascontiguousarray(c.indices[:, :, m]), np.ascontiguousarray(c.indices[:, :, ~m])
    union = np.concatenate([A, Bs], axis=2)
    q, k, v, _, kw = c.args("torch", "cuda")
    out, lse = gvr.sparse_attention(q, k, v, _t(A), out=torch.empty(3, 16, 128, device="cuda"), **kw)
    r = gvr.prr.repair(out, lse, q, k, v, _t(Bs), **kw)
    assert r[0] is out and r[1] is lse
    na, nb = c.naive(A), c.naive(Bs)
    no, nl = merge_naive(na[0], na[1], nb[0], nb[1])
    ro, rl = c.ref(union)
    assert_close(to_numpy(out), ro, no, "bfloat16", what="repair out")
    assert_close(to_numpy(lse), rl, nl, "bfloat16", what="repair lse")
    # from the empty state
    out = torch.zeros(3, 16, 128, device="cuda")
    lse = torch.full((3, 16), float("-inf"), device="cuda")
    gvr.prr.repair(out, lse, q, k, v, _t(A), **kw)
    gvr.prr.repair(out, lse, q, k, v, _t(Bs), **kw)
    assert_close(to_numpy(out), ro, no, "bfloat16", what="repair from empty out")
    assert_close(to_numpy(lse), rl, nl, "bfloat16", what="repair from empty lse")


def test_repair_with_an_empty_selection_is_bit_identical():
    rng = np.random.default_rng(7)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=128, P=16, block_size=16, n=4, dtype="bfloat16")
    q, k, v, _, kw = c.args("torch", "cuda")
    out = torch.randn(3, 8, 128, device="cuda")
    lse = torch.randn(3, 8, device="cuda")
    lse[0, 1] = float("-inf")
    out[0, 1] = 0
    o0, l0 = out.clone(), lse.clone()
    for sel in (np.zeros((3, 1, 0), np.int32), np.full((3, 2, 7), -1, np.int32),
                np.array([[[10**6, 2**31 - 1, -9]]] * 3, np.int32)):
        gvr.prr.repair(out, lse, q, k, v, _t(sel), **kw)
        assert torch.equal(out.view(torch.int32), o0.view(torch.int32))
        assert torch.equal(lse.view(torch.int32), l0.view(torch.int32))


@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_partials_are_each_entry_alone(paged, Hsel):
    rng = np.random.default_rng(8 + Hsel)
    c = make_case(rng, B=2, Hq=8, Hkv=2, D=128, P=16, block_size=32 if paged else 1, paged=paged, n=24, Hsel=Hsel,
                  dup=0.1, dtype="bfloat16")
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


@pytest.mark.parametrize("Hsel", [1, 2])
@pytest.mark.parametrize("paged", [True, False], ids=["block_table", "slots"])
def test_finalize_then_repair_missed_equals_attention(paged, Hsel):
    rng = np.random.default_rng(10 + Hsel + 2 * paged)
    B, Hq, D = 3, 16, 128
    c = make_case(rng, B=B, Hq=Hq, Hkv=2, D=D, P=16, block_size=16 if paged else 1, paged=paged, n=1, Hsel=Hsel,
                  seq_len=2048, dtype="bfloat16")
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
    assert out.dtype == torch.float32 and out.is_cuda
    fo_ref, fl_ref = finalize_ref(po.cpu(), pl.cpu(), pred, sel)
    fo_nv, fl_nv = finalize_naive(po.cpu(), pl.cpu(), pred, sel)
    assert_close(to_numpy(out), fo_ref, fo_nv, "float32", what="finalize out (same partials)")
    assert_close(to_numpy(lse), fl_ref, fl_nv, "float32", what="finalize lse (same partials)")
    miss = gvr.prr.missed(_t(sel), _t(pred))
    assert np.array_equal(miss.cpu().numpy(), missed_ref(sel, pred))
    gvr.prr.repair(out, lse, q, k, v, miss, **kw)
    npo, npl = c.partials_naive(pred)
    fo, fl = finalize_naive(npo, npl, pred, sel)
    mo, ml = c.naive(missed_ref(sel, pred))
    no, nl = merge_naive(fo, fl, mo, ml)
    ro, rl = c.ref(sel)
    assert_close(to_numpy(out), ro, no, "bfloat16", what="exact mode out")
    assert_close(to_numpy(lse), rl, nl, "bfloat16", what="exact mode lse")


def test_missed_random_and_edge_cases():
    rng = np.random.default_rng(12)
    for B, H, n_sel, Hp, n_pred in ((4, 3, 50, 1, 40), (4, 3, 50, 3, 40), (64, 8, 2048, 8, 2048), (2, 2, 300, 1, 0),
                                    (2, 2, 0, 2, 5), (1, 1, 4096, 1, 8192)):
        sel = random_indices(rng, B, H, n_sel, 5000, pad=0.1, oob=0.05, dup=0.02)
        pred = random_indices(rng, B, Hp, n_pred, 5000, pad=0.1, dup=0.02)
        if n_pred:
            pred[0, 0, : min(n_pred, n_sel)] = sel[0, 0, : min(n_pred, n_sel)]  # overlap
        got = gvr.prr.missed(_t(sel), _t(pred))
        assert got.is_cuda and got.dtype == torch.int32
        want = missed_ref(sel, pred)
        assert np.array_equal(got.cpu().numpy(), want), (B, H, n_sel, Hp, n_pred)
        assert np.array_equal(gvr.prr.missed(sel, pred), want)
        cg = torch.tensor([5, 5, 10, 20], dtype=torch.int64, device="cuda")
        cc = np.array([5, 5, 10, 20], np.int64)
        gvr.prr.missed(_t(sel), _t(pred), counts=cg)
        gvr.prr.missed(sel, pred, counts=cc)
        n_valid = int(np.count_nonzero(sel >= 0))
        hits = n_valid - int(np.count_nonzero(want >= 0))
        assert cg.tolist() == cc.tolist() == [hits, n_valid, 10 + hits, 20 + n_valid], (B, H, n_sel, Hp, n_pred)
    sel = np.array([[[5, -1, 3, 7]]], np.int32)
    assert gvr.prr.missed(_t(sel), _t(np.array([[[3, 5, 7]]], np.int32))).tolist() == [[[-1] * 4]]
    assert gvr.prr.missed(_t(sel), _t(np.array([[[-1]]], np.int32))).tolist() == [[[5, 3, 7, -1]]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(64, 16, 128), (8, 256)], ids=["BHD", "HD"])
def test_merge_against_cpu_and_reference(shape, dtype):
    rng = np.random.default_rng(13)
    td = getattr(torch, dtype)
    oa, ob = round_to(rng.standard_normal(shape), dtype), round_to(rng.standard_normal(shape), dtype)
    la, lb = (rng.standard_normal(shape[:-1]) * 4).astype(np.float32), (rng.standard_normal(shape[:-1]) * 4).astype(np.float32)
    la.reshape(-1)[::7] = NEG_INF
    lb.reshape(-1)[::5] = NEG_INF
    oa.reshape(-1, shape[-1])[::7] = 0
    ro, rl = merge_ref(oa, la, ob, lb)
    no, nl = merge_naive(oa, la, ob, lb)
    if dtype != "float32":
        no = round_to(no, dtype)
    for device in ("cuda", "cpu"):
        args = (_t(oa, device).to(td), _t(la, device), _t(ob, device).to(td), _t(lb, device))
        out, lse = gvr.merge_states(*args)
        assert out.dtype == td and out.device.type == device
        assert_close(to_numpy(out), ro, no, dtype, what=f"{device} merge out")
        assert_close(to_numpy(lse), rl, nl, "float32", what=f"{device} merge lse")
        both_empty = (la == NEG_INF) & (lb == NEG_INF)
        assert np.all(to_numpy(out)[both_empty] == 0) and not np.isnan(to_numpy(out)).any()
        only_a = (lb == NEG_INF) & (la > NEG_INF)
        assert np.array_equal(to_numpy(out)[only_a], round_to(oa, dtype)[only_a])  # the other side exactly
        # in place and aliasing
        a, al = args[0].clone(), args[1].clone()
        gvr.merge_states_in_place(a, al, args[2], args[3])
        assert torch.equal(a, out) and torch.equal(al, lse)
        a, al = args[0].clone(), args[1].clone()
        gvr.merge_states(a, al, args[2], args[3], out=a, lse=al)
        assert torch.equal(a, out) and torch.equal(al, lse)
        # base 2
        l2a, l2b = _t(la / np.log(2), device).float(), _t(lb / np.log(2), device).float()
        o2, ll2 = gvr.merge_states(args[0], l2a, args[2], l2b, lse_base="2")
        ro2, rl2 = merge_ref(oa, l2a.cpu(), ob, l2b.cpu(), lse_base="2")
        no2, nl2 = merge_naive(oa, l2a.cpu(), ob, l2b.cpu(), lse_base="2")
        if dtype != "float32":
            no2 = round_to(no2, dtype)
        assert_close(to_numpy(o2), ro2, no2, dtype, what=f"{device} base-2 merge out")
        assert_close(to_numpy(ll2), rl2, nl2, "float32", what=f"{device} base-2 merge lse")


# --------------------------------------------------------------------------------------------------
# determinism, graphs, streams, compile
# --------------------------------------------------------------------------------------------------


def test_determinism_100_calls():
    rng = np.random.default_rng(14)
    c = make_case(rng, B=64, Hq=16, Hkv=2, D=128, P=64, paged=False, n=2048, Hsel=2, extra_pages=300,
                  dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    o0, l0 = gvr.sparse_attention(q, k, v, idx, **kw)
    s0 = torch.randn(64, 16, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    sl0 = torch.randn(64, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    r0 = [s0.clone(), sl0.clone()]
    gvr.prr.repair(r0[0], r0[1], q, k, v, idx, **kw)
    for _ in range(100):
        o, l = gvr.sparse_attention(q, k, v, idx, **kw)
        assert torch.equal(o, o0) and torch.equal(l, l0)
        r = [s0.clone(), sl0.clone()]
        gvr.prr.repair(r[0], r[1], q, k, v, idx, **kw)
        assert torch.equal(r[0], r0[0]) and torch.equal(r[1], r0[1])
    check_state(c, o0, l0, what="determinism case")


def test_cuda_graph_capture_of_attention_and_repair_replays_identically():
    rng = np.random.default_rng(15)
    c = make_case(rng, B=8, Hq=16, Hkv=2, D=128, P=16, block_size=16, n=32, Hsel=2, dtype="bfloat16", seq_len=2048)
    q, k, v, idx, kw = c.args("torch", "cuda")
    miss = _t(random_indices(rng, 8, 2, 16, c.n_entries_valid(), pad=0.2))
    static_q = q.clone()

    def step(out, lse):
        gvr.sparse_attention(static_q, k, v, idx, out=out, lse=lse, **kw)
        gvr.prr.repair(out, lse, static_q, k, v, miss, **kw)

    eo, el = torch.empty(8, 16, 128, device="cuda"), torch.empty(8, 16, device="cuda")
    step(eo, el)  # eager (also creates the workspace outside the capture)
    go, gl = torch.empty_like(eo), torch.empty_like(el)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(go, gl)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    go.fill_(7), gl.fill_(7)
    with torch.cuda.graph(g):
        step(go, gl)
    for _ in range(3):
        go.fill_(7), gl.fill_(7)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, eo) and torch.equal(gl, el)
    # new inputs in the static buffer: the replay follows them
    q2 = make_case(np.random.default_rng(16), B=8, Hq=16, Hkv=2, D=128, dtype="bfloat16").args("torch", "cuda")[0]
    static_q.copy_(q2)
    g.replay()
    step(eo, el)
    torch.cuda.synchronize()
    assert torch.equal(go, eo) and torch.equal(gl, el)


def test_non_default_stream_and_stream_argument():
    rng = np.random.default_rng(17)
    c = make_case(rng, B=4, Hq=8, Hkv=2, D=128, P=16, block_size=16, n=16, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    want = gvr.sparse_attention(q, k, v, idx, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q2 = q * 1.0  # producer work pending on s
        got = gvr.sparse_attention(q2, k, v, idx, **kw)
    s.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = gvr.sparse_attention(q, k, v, idx, stream=s, **kw)
    s.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _step(q, k, v, idx, bt, ln, so, sl):
    out, lse = gvr.sparse_attention(q * 1.0, k, v, idx, block_table=bt, lengths=ln, block_size=16)
    o2, l2 = gvr.merge_states(out.float(), lse, so, sl)
    miss = gvr.prr.missed(idx, idx[:, :, :2])
    gvr.prr.repair(o2, l2, q, k, v, miss, block_table=bt, lengths=ln, block_size=16)
    return out, lse, o2 + 0, l2 + 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_matches_eager(backend):
    torch._dynamo.reset()
    rng = np.random.default_rng(18)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=128, P=16, block_size=16, n=8, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    so, sl = torch.randn(3, 8, 128, device="cuda"), torch.randn(3, 8, device="cuda")
    want = _step(q, k, v, idx, kw["block_table"], kw["lengths"], so, sl)
    got = torch.compile(_step, fullgraph=True, backend=backend)(q, k, v, idx, kw["block_table"], kw["lengths"], so, sl)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)


def test_opcheck_cuda():
    rng = np.random.default_rng(19)
    c = make_case(rng, B=2, Hq=4, Hkv=2, D=64, P=16, block_size=16, n=3, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    att = (q, k, v, idx, kw["lengths"], kw["block_table"], 16, None, None, None)
    torch.library.opcheck(torch.ops.gvr.sparse_attention.default, att)
    st = (torch.randn(2, 4, 64, device="cuda"), torch.randn(2, 4, device="cuda"))
    torch.library.opcheck(torch.ops.gvr.prr_repair.default, st + att + (None, None, None))
    ex, cnt = idx[:, :, :1].contiguous(), torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.gvr.prr_repair.default, st + att + (ex, cnt, torch.empty_like(q)))
    torch.library.opcheck(torch.ops.gvr.merge_states.default, st + st + (False,))
    torch.library.opcheck(torch.ops.gvr.prr_missed.default, (idx, idx[:, :, :1].contiguous()))


def test_lengths_out_of_range_are_clamped_on_the_gpu():
    # the CPU path raises (it reads lengths on the host); the GPU clamps to [0, max_pages * P] without a sync
    rng = np.random.default_rng(20)
    c = make_case(rng, B=3, Hq=8, Hkv=2, D=128, P=16, block_size=16, n=8, Hsel=2, dtype="bfloat16", seq_len=128,
                  lengths="full")
    cap = c.block_table.shape[1] * 16
    c.lengths = np.array([-5, cap + 100, 2**31 - 1], np.int32)
    q, k, v, idx, kw = c.args("torch", "cuda")
    out, lse = gvr.sparse_attention(q, k, v, idx, **kw)
    check_state(c, out, lse, what="clamped lengths")
    assert torch.all(lse[0] == float("-inf"))
