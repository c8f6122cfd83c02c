"""GPU tests for gvr.prr.repair's fused extras (exclude, counts, cast_out): the CUDA kernel against the
C CPU path run on the same bfloat16 / float16 inputs (torch CPU tensors), both held to the float64 NumPy
reference with harness.assert_close as test_attention_gpu.py holds repair (factor 2 x the naive error
in the input precision + one ulp); counts exactly equal to the CPU's and to a NumPy count; cast_out
exactly the GPU's float32 out converted by torch (round to nearest even); heads left unchanged bit for
bit; deterministic; replayed identically from a CUDA graph.

Every test is collected; each is skipped, with the reason, where torch with a CUDA device or gvr's
CUDA library is missing (conftest.py, harness.gpu_skip_reason).
"""
import numpy as np
import pytest

import gvr
from attention_reference import make_case, merge_naive, merge_ref, missed_ref, to_numpy
from harness import assert_close, torch_or_none
from test_prr_repair_fused import count_ref, make_exclude, ragged_lengths

torch = torch_or_none()  # None without torch: every test here is then skipped before it runs

pytestmark = pytest.mark.gpu
NEG_INF = -np.inf
SENTINEL = 7.0
DTYPES = ("bfloat16", "float16")


def _t(a, device="cuda"):
    """A fresh tensor on ``device`` (never a view of ``a``: on the CPU, repair writes in place)."""
    return torch.from_numpy(np.array(a, copy=True, order="C")).to(device)


def _bits(x):
    x = x.detach().contiguous()
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a).cpu(), _bits(b).cpu())


def _prior(rng, B, Hq, D, empty_frac=0.2):
    o = rng.standard_normal((B, Hq, D)).astype(np.float32)
    l = (rng.standard_normal((B, Hq)) * 3 + 4).astype(np.float32)
    m = rng.random((B, Hq)) < empty_frac
    o[m] = 0
    l[m] = NEG_INF
    return o, l


def _case(rng, *, B, Hq, Hkv, D, mode, n, Hsel, dtype):
    kind, P, G = mode
    if kind == "bt":
        seq_len = max(2 * n * G, 4 * P, 256)
        max_pages = -(-seq_len // P)
        return make_case(rng, B=B, Hq=Hq, Hkv=Hkv, D=D, P=P, block_size=G, n=n, Hsel=Hsel, dtype=dtype,
                         seq_len=seq_len, lengths=ragged_lengths(B, max_pages * P, G), pad=0.1, oob=0.05, dup=0.05,
                         bad_pages=P >= 16)
    return make_case(rng, B=B, Hq=Hq, Hkv=Hkv, D=D, P=P, paged=False, n=n, Hsel=Hsel, dtype=dtype,
                     extra_pages=n // P + 8, pad=0.1, oob=0.05, dup=0.05)


def fused_both(c, X, prior, *, ncounts, cast_dtype, what):
    """repair(exclude=X, counts, cast_out) on CUDA and on the CPU from the same prior state: both against
    the float64 reference, counts exact, cast_out exact, unchanged heads bit for bit. -> CUDA results."""
    po, pl = prior
    dtype = c.dtype
    start = [3, 4, 100, 200][:ncounts]
    res = {}
    for device in ("cuda", "cpu"):
        q, k, v, idx, kw = c.args("torch", device)
        out, lse = _t(po, device), _t(pl, device)
        counts = torch.tensor(start, dtype=torch.int64, device=device)
        cast = torch.full(tuple(q.shape), SENTINEL, dtype=getattr(torch, cast_dtype), device=device)
        r = gvr.prr.repair(out, lse, q, k, v, idx, exclude=_t(X, device), counts=counts, cast_out=cast, **kw)
        assert r[0] is out and r[1] is lse
        res[device] = (out, lse, counts, cast)
    torch.cuda.synchronize()
    go, gl, gc, gcast = res["cuda"]
    co, cl, cc, ccast = res["cpu"]
    h, n = count_ref(c.indices, X)
    want = [start[0] + h, start[1] + n] + ([start[2] + h, start[3] + n] if ncounts == 4 else [])
    assert cc.tolist() == want, f"{what}: CPU counts"
    assert gc.tolist() == cc.tolist(), f"{what}: CUDA counts {gc.tolist()} != CPU counts {cc.tolist()}"
    assert _same_bits(gcast, go.to(gcast.dtype)), f"{what}: CUDA cast_out != out.to({cast_dtype})"
    assert _same_bits(ccast, co.to(ccast.dtype)), f"{what}: CPU cast_out != out.to({cast_dtype})"
    miss = missed_ref(c.indices, X)
    mo, ml = c.ref(miss)
    ro, rl = merge_ref(po, pl, mo, ml)
    nmo, nml = c.naive(miss)
    no, nl = merge_naive(po, pl, nmo, nml)
    for dev, (o, l) in (("cuda", (go, gl)), ("cpu", (co, cl))):
        assert_close(to_numpy(o), ro, no, dtype, what=f"{what} {dev} out")
        assert_close(to_numpy(l), rl, nl, dtype, what=f"{what} {dev} lse")
        assert not torch.isnan(o).any() and not torch.isnan(l).any()
    untouched = torch.from_numpy(ml == NEG_INF)  # nothing valid to add: the prior bit for bit
    assert _same_bits(go.cpu()[untouched], torch.from_numpy(po)[untouched]), f"{what}: unchanged heads' out"
    assert _same_bits(gl.cpu()[untouched], torch.from_numpy(pl)[untouched]), f"{what}: unchanged heads' lse"
    assert torch.equal(gl.cpu() == float("-inf"), cl == float("-inf")), f"{what}: CUDA and CPU disagree on empty heads"
    return res["cuda"]


# --------------------------------------------------------------------------------------------------
# the coverage grid
# --------------------------------------------------------------------------------------------------

# (B, Hq, Hkv, mode (kind, P, G), n, Hsel, Hx, nx, exclusion hits only past position 64)
CONFIGS = [
    (1, 16, 2, ("bt", 64, 64), 8, 2, 2, 0, False),
    (3, 16, 2, ("bt", 64, 64), 64, 2, 1, 8, False),
    (8, 8, 2, ("bt", 16, 64), 64, 1, 1, 64, False),
    (3, 8, 2, ("bt", 64, 64), 32, 2, 2, 100, True),
    (3, 4, 4, ("bt", 64, 16), 40, 4, 4, 100, False),
    (8, 16, 1, ("bt", 64, 1), 2048, 1, 1, 100, True),
    (3, 16, 2, ("slots", 64, 1), 2048, 2, 2, 64, False),
    (1, 8, 2, ("slots", 16, 1), 512, 2, 1, 1, False),
    (8, 8, 2, ("bt", 16, 1), 1024, 2, 2, 8, False),
]
CONFIG_IDS = [f"B{B}-Hq{Hq}-Hkv{Hkv}-{m[0]}-P{m[1]}-G{m[2]}-n{n}-Hsel{hs}-Hx{hx}-nx{nx}{'-tail' if tl else ''}"
              for B, Hq, Hkv, m, n, hs, hx, nx, tl in CONFIGS]


# each configuration with one (dtype, D) pairing, rotating, so that the grid covers bf16 / fp16 and
# D 64 / 128 / 256 without the 6x cost (the float64 reference of the large cases takes seconds each)
PAIRS = [(DTYPES[i % 2], (64, 128, 256)[i % 3]) for i in range(len(CONFIGS))]


@pytest.mark.parametrize("config,dtype,D", [(c, *PAIRS[i]) for i, c in enumerate(CONFIGS)],
                         ids=[f"{cid}-{d}-{D}" for cid, (d, D) in zip(CONFIG_IDS, PAIRS)])
def test_fused_repair_against_cpu_and_reference(config, dtype, D):
    B, Hq, Hkv, mode, n, Hsel, Hx, nx, tail = config
    rng = np.random.default_rng(CONFIGS.index(config) * 10 + D + (dtype == "float16"))
    c = _case(rng, B=B, Hq=Hq, Hkv=Hkv, D=D, mode=mode, n=n, Hsel=Hsel, dtype=dtype)
    X = make_exclude(rng, c.indices, Hx, nx, c.n_entries_valid(), hit=0.6, tail_from=64 if tail else 0)
    if nx:
        assert count_ref(c.indices, X)[0] > 0, "the test wants hits"
    prior = _prior(rng, B, Hq, D)
    what = f"{CONFIG_IDS[CONFIGS.index(config)]} {dtype} D={D}"
    fused_both(c, X, prior, ncounts=4 if D == 128 else 2, cast_dtype=dtype if D != 64 else "float32", what=what)


@pytest.mark.parametrize("nx", [0, 1, 8, 64, 100])
@pytest.mark.parametrize("G", [64, 16, 1])
def test_exclude_widths(G, nx):
    """Each width with each entry grain (G 64: a warp's lanes share one entry; 16 and 1: they don't);
    hits both inside and past the first 64 exclusion values."""
    rng = np.random.default_rng(300 + G + nx)
    n = 2048 if G == 1 else 48
    for Hsel, Hx in ((2, 2), (2, 1), (1, 1)):
        c = _case(rng, B=3, Hq=8, Hkv=2, D=128, mode=("bt", 64, G), n=n, Hsel=Hsel, dtype="bfloat16")
        for tail in ((False, True) if nx > 64 else (False,)):
            X = make_exclude(rng, c.indices, Hx, nx, c.n_entries_valid(), hit=0.7, tail_from=64 if tail else 0)
            fused_both(c, X, _prior(rng, 3, 8, 128), ncounts=4, cast_dtype="bfloat16",
                       what=f"G={G} nx={nx} Hsel={Hsel} Hx={Hx} tail={tail}")


@pytest.mark.parametrize("gqa", [1, 4, 8, 16])
def test_gqa_and_counts_once_per_row(gqa):
    rng = np.random.default_rng(400 + gqa)
    Hkv = 2
    for Hsel, Hx in ((1, 1), (2, 2), (2, 1)):
        for mode, n in ((("bt", 64, 64), 16), (("slots", 64, 1), 600)):
            c = _case(rng, B=3, Hq=gqa * Hkv, Hkv=Hkv, D=128, mode=mode, n=n, Hsel=Hsel, dtype="float16")
            X = make_exclude(rng, c.indices, Hx, 24, c.n_entries_valid())
            fused_both(c, X, _prior(rng, 3, gqa * Hkv, 128), ncounts=2, cast_dtype="float16",
                       what=f"gqa={gqa} Hsel={Hsel} Hx={Hx} {mode}")


def test_exclude_equals_repair_of_missed_on_the_gpu():
    """On the device the two agree within tolerance (not necessarily bit for bit: different tiles)."""
    rng = np.random.default_rng(5)
    for mode, n in ((("bt", 64, 64), 32), (("slots", 64, 1), 1024)):
        c = _case(rng, B=4, Hq=16, Hkv=2, D=128, mode=mode, n=n, Hsel=2, dtype="bfloat16")
        X = make_exclude(rng, c.indices, 2, 32, c.n_entries_valid(), hit=0.6)
        po, pl = _prior(rng, 4, 16, 128)
        q, k, v, idx, kw = c.args("torch", "cuda")
        o1, l1 = _t(po), _t(pl)
        gvr.prr.repair(o1, l1, q, k, v, idx, exclude=_t(X), **kw)
        miss = gvr.prr.missed(idx, _t(X))
        assert np.array_equal(miss.cpu().numpy(), missed_ref(c.indices, X))
        o2, l2 = _t(po), _t(pl)
        gvr.prr.repair(o2, l2, q, k, v, miss, **kw)
        mo, ml = c.ref(missed_ref(c.indices, X))
        ro, rl = merge_ref(po, pl, mo, ml)
        nmo, nml = c.naive(missed_ref(c.indices, X))
        no, nl = merge_naive(po, pl, nmo, nml)
        for name, (o, l) in (("exclude", (o1, l1)), ("missed", (o2, l2))):
            assert_close(to_numpy(o), ro, no, "bfloat16", what=f"{mode} {name} out")
            assert_close(to_numpy(l), rl, nl, "bfloat16", what=f"{mode} {name} lse")


# --------------------------------------------------------------------------------------------------
# nothing to add, counts without exclude, strided arguments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_nothing_added_keeps_the_state_and_fills_cast_out(dtype):
    rng = np.random.default_rng(6)
    c = _case(rng, B=3, Hq=8, Hkv=2, D=128, mode=("bt", 16, 16), n=12, Hsel=2, dtype=dtype)
    po, pl = _prior(rng, 3, 8, 128, empty_frac=0.3)
    po[0, 1] = -0.0
    for name, idx, X in (("n=0", np.zeros((3, 2, 0), np.int32), np.zeros((3, 2, 0), np.int32)),
                         ("all -1", np.full((3, 2, 5), -1, np.int32), np.full((3, 1, 3), -1, np.int32)),
                         ("every entry excluded", c.indices, np.concatenate([c.indices, c.indices], axis=2)),
                         ("out of range only", np.array([[[2**31 - 1, 10**6, -3]] * 2] * 3, np.int32),
                          np.zeros((3, 2, 0), np.int32))):
        cc = c.with_indices(idx)
        q, k, v, i_, kw = cc.args("torch", "cuda")
        for cast_dtype in (dtype, "float32"):
            out, lse = _t(po), _t(pl)
            counts = torch.zeros(4, dtype=torch.int64, device="cuda")
            cast = torch.full((3, 8, 128), SENTINEL, dtype=getattr(torch, cast_dtype), device="cuda")
            gvr.prr.repair(out, lse, q, k, v, i_, exclude=_t(X), counts=counts, cast_out=cast, **kw)
            torch.cuda.synchronize()
            assert _same_bits(out.cpu(), torch.from_numpy(po)) and _same_bits(lse.cpu(), torch.from_numpy(pl)), name
            assert _same_bits(cast, out.to(cast.dtype)), f"{name}: cast_out ({cast_dtype})"
            h, n = count_ref(idx, X)
            assert counts.tolist() == [h, n, h, n], name


def test_counts_without_exclude_and_strided_arguments():
    rng = np.random.default_rng(7)
    c = _case(rng, B=4, Hq=16, Hkv=2, D=128, mode=("bt", 64, 64), n=24, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    po, pl = _prior(rng, 4, 16, 128)
    # counts alone: hits 0
    out, lse = _t(po), _t(pl)
    counts = torch.tensor([5, 6], dtype=torch.int64, device="cuda")
    gvr.prr.repair(out, lse, q, k, v, idx, counts=counts, **kw)
    n = int(np.count_nonzero(c.indices >= 0))
    assert counts.tolist() == [5, 6 + n]
    want_o, want_l = out.clone(), lse.clone()
    # the same with an empty exclude, given strided, and a strided cast_out: same state
    out, lse = _t(po), _t(pl)
    xbuf = torch.full((4, 3, 9), int(c.indices[c.indices >= 0][0]), dtype=torch.int32, device="cuda")
    X = xbuf[:, 1:2, 4:4]
    cbuf = torch.full((4, 18, 144), SENTINEL, dtype=torch.bfloat16, device="cuda")
    cast = cbuf[:, 1:17, 8:136]
    gvr.prr.repair(out, lse, q, k, v, idx, exclude=X, counts=counts, cast_out=cast, **kw)
    torch.cuda.synchronize()
    assert counts.tolist() == [5, 6 + 2 * n]
    assert _same_bits(cast, out.to(torch.bfloat16))
    mo, ml = c.ref()
    ro, rl = merge_ref(po, pl, mo, ml)
    nmo, nml = c.naive()
    no, nl = merge_naive(po, pl, nmo, nml)
    for name, (o, l) in (("no exclude", (want_o, want_l)), ("empty strided exclude", (out, lse))):
        assert_close(to_numpy(o), ro, no, "bfloat16", what=f"{name} out")
        assert_close(to_numpy(l), rl, nl, "bfloat16", what=f"{name} lse")
    # a real strided exclusion: margins hold a selected entry that must not be excluded
    Xn = make_exclude(rng, c.indices, 2, 6, c.n_entries_valid())
    margin = next(int(e) for e in c.indices.reshape(-1) if 0 <= e < c.n_entries_valid() and e not in set(Xn.reshape(-1)))
    xbuf = torch.full((4, 3, 10), margin, dtype=torch.int32, device="cuda")
    xbuf[:, 1:, 2:8] = _t(Xn)
    Xs = xbuf[:, 1:, 2:8]
    out, lse = _t(po), _t(pl)
    gvr.prr.repair(out, lse, q, k, v, idx, exclude=Xs, cast_out=cast, **kw)
    o2, l2 = _t(po), _t(pl)
    gvr.prr.repair(o2, l2, q, k, v, idx, exclude=_t(Xn), **kw)
    torch.cuda.synchronize()
    assert _same_bits(out, o2) and _same_bits(lse, l2), "a strided exclusion differs from the compact one"
    assert _same_bits(cast, out.to(torch.bfloat16))
    assert torch.all(cbuf[:, 0] == SENTINEL) and torch.all(cbuf[:, 17] == SENTINEL)
    assert torch.all(cbuf[:, :, :8] == SENTINEL) and torch.all(cbuf[:, :, 136:] == SENTINEL)
    # cast_out misaligned with odd strides (no vector stores), bfloat16 and float32; exclude broadcast over B
    X1 = _t(make_exclude(rng, c.indices[:1], 2, 6, c.n_entries_valid()))
    for cast_dtype in (torch.bfloat16, torch.float32):
        cbuf = torch.full((4, 16, 131), SENTINEL, dtype=cast_dtype, device="cuda")
        cast = cbuf[:, :, 1:129]
        out, lse = _t(po), _t(pl)
        counts = torch.zeros(2, dtype=torch.int64, device="cuda")
        gvr.prr.repair(out, lse, q, k, v, idx, exclude=X1.expand(4, 2, 6), counts=counts, cast_out=cast, **kw)
        o2, l2 = _t(po), _t(pl)
        gvr.prr.repair(o2, l2, q, k, v, idx, exclude=X1.repeat(4, 1, 1), **kw)
        torch.cuda.synchronize()
        assert _same_bits(out, o2) and _same_bits(lse, l2), "a broadcast exclusion differs from the repeated one"
        assert _same_bits(cast, out.to(cast_dtype)), f"misaligned cast_out ({cast_dtype})"
        assert torch.all(cbuf[:, :, 0] == SENTINEL) and torch.all(cbuf[:, :, 129:] == SENTINEL)
        assert counts.tolist() == list(count_ref(c.indices, X1.repeat(4, 1, 1).cpu()))


# --------------------------------------------------------------------------------------------------
# determinism, CUDA graphs
# --------------------------------------------------------------------------------------------------


def test_determinism():
    rng = np.random.default_rng(8)
    c = _case(rng, B=8, Hq=16, Hkv=2, D=128, mode=("slots", 64, 1), n=2048, Hsel=2, dtype="bfloat16")
    X = make_exclude(rng, c.indices, 2, 100, c.n_entries_valid(), hit=0.7)
    q, k, v, idx, kw = c.args("torch", "cuda")
    po, pl = _prior(rng, 8, 16, 128)
    first = None
    for _ in range(20):
        out, lse = _t(po), _t(pl)
        counts = torch.zeros(4, dtype=torch.int64, device="cuda")
        cast = torch.empty(8, 16, 128, dtype=torch.bfloat16, device="cuda")
        gvr.prr.repair(out, lse, q, k, v, idx, exclude=_t(X), counts=counts, cast_out=cast, **kw)
        r = (_bits(out).clone(), _bits(lse).clone(), _bits(cast).clone(), counts.clone())
        if first is None:
            first = r
        else:
            assert all(torch.equal(a, b) for a, b in zip(r, first))


@pytest.mark.parametrize("mode,n", [(("bt", 16, 16), 32), (("bt", 64, 1), 2048)], ids=["blocks", "tokens"])
def test_cuda_graph_capture_replays_the_eager_result(mode, n):
    rng = np.random.default_rng(9)
    B, Hq, D = 8, 16, 128
    c = _case(rng, B=B, Hq=Hq, Hkv=2, D=D, mode=mode, n=n, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    X = _t(make_exclude(rng, c.indices, 2, 64, c.n_entries_valid(), hit=0.6))
    po, pl = _prior(rng, B, Hq, D)
    prior_o, prior_l = _t(po), _t(pl)
    static_q = q.clone()
    out, lse = prior_o.clone(), prior_l.clone()
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    cast = torch.full((B, Hq, D), SENTINEL, dtype=torch.bfloat16, device="cuda")

    def step():
        gvr.prr.repair(out, lse, static_q, k, v, idx, exclude=X, counts=counts, cast_out=cast, **kw)

    def reset():
        out.copy_(prior_o), lse.copy_(prior_l), counts.zero_(), cast.fill_(SENTINEL)

    step()  # eager (also creates the workspace outside the capture)
    torch.cuda.synchronize()
    eo, el, ec, ecast = out.clone(), lse.clone(), counts.clone(), cast.clone()
    h, nv = count_ref(c.indices, X.cpu())
    assert ec.tolist() == [h, nv, h, nv]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        reset()
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        reset()
        g.replay()
        torch.cuda.synchronize()
        assert _same_bits(out, eo) and _same_bits(lse, el) and _same_bits(cast, ecast)
        assert torch.equal(counts, ec)
    # replays accumulate counts like eager calls do
    reset()
    g.replay()
    out.copy_(prior_o), lse.copy_(prior_l)
    g.replay()
    torch.cuda.synchronize()
    assert counts.tolist() == [2 * h, 2 * nv, 2 * h, 2 * nv]
    assert _same_bits(out, eo) and _same_bits(cast, ecast)
    # new inputs in the static buffers: the replay follows them
    q2 = make_case(np.random.default_rng(10), B=B, Hq=Hq, Hkv=2, D=D, dtype="bfloat16").args("torch", "cuda")[0]
    static_q.copy_(q2)
    X.copy_(_t(make_exclude(rng, c.indices, 2, 64, c.n_entries_valid(), hit=0.3)))
    reset()
    g.replay()
    torch.cuda.synchronize()
    go, gl, gc, gcast = out.clone(), lse.clone(), counts.clone(), cast.clone()
    reset()
    step()
    torch.cuda.synchronize()
    assert _same_bits(go, out) and _same_bits(gl, lse) and _same_bits(gcast, cast) and torch.equal(gc, counts)


# --------------------------------------------------------------------------------------------------
# errors on the device: mixed devices, dtypes
# --------------------------------------------------------------------------------------------------


def _expect(exc, name, *args, **kw):
    snaps = [(v, v.detach().clone()) for v in list(args) + list(kw.values()) if isinstance(v, torch.Tensor)]
    with pytest.raises(exc, match=rf"\b{name}\b"):
        gvr.prr.repair(*args, **kw)
    torch.cuda.synchronize()
    for v, copy in snaps:
        assert _same_bits(v, copy), f"an argument was modified by a failed call ({name})"


def test_mixed_devices_and_dtypes():
    rng = np.random.default_rng(11)
    c = _case(rng, B=2, Hq=8, Hkv=2, D=64, mode=("bt", 16, 16), n=6, Hsel=2, dtype="bfloat16")
    q, k, v, idx, kw = c.args("torch", "cuda")
    po, pl = _prior(rng, 2, 8, 64)
    out, lse = _t(po), _t(pl)
    X = _t(make_exclude(rng, c.indices, 2, 4, c.n_entries_valid()))
    counts = torch.tensor([1, 2, 3, 4], dtype=torch.int64, device="cuda")
    cast = torch.full((2, 8, 64), SENTINEL, dtype=torch.bfloat16, device="cuda")
    ok = dict(exclude=X, counts=counts, cast_out=cast)
    args = (out, lse, q, k, v, idx)
    _expect(ValueError, "exclude", *args, **kw, **dict(ok, exclude=X.cpu()))
    _expect(ValueError, "counts", *args, **kw, **dict(ok, counts=counts.cpu()))
    _expect(ValueError, "cast_out", *args, **kw, **dict(ok, cast_out=cast.cpu()))
    _expect(ValueError, "cast_out", *args, **kw, **dict(ok, cast_out=cast.to(torch.float16)))
    _expect(ValueError, "cast_out", *args, **kw, **dict(ok, cast_out=cast[:, :4]))
    _expect(TypeError, "counts", *args, **kw, **dict(ok, counts=counts.to(torch.int32)))
    _expect(ValueError, "counts", *args, **kw, **dict(ok, counts=counts[:3]))
    c1 = c.with_indices(c.indices[:, :1].copy())
    q, k, v, idx1, kw = c1.args("torch", "cuda")
    _expect(ValueError, "exclude", out, lse, q, k, v, idx1, **kw, **ok)  # Hsel 1, Hx 2
    # and the valid call afterwards works
    gvr.prr.repair(*args, **kw, **ok)
    torch.cuda.synchronize()
    assert _same_bits(cast, out.to(torch.bfloat16))
