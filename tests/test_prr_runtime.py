"""gvr.prr.SpeculativeAttention (gvr/_prr_runtime.py) on the CPU: a synthetic decode (random paged
caches, a drifting query, the Quest selection stage of ``quest_select``) checked step by step against
the float64 reference of attention_reference.py (harness.assert_close: 2 x the naive float32 error
plus an ulp):

- exact mode equals attention over exactly the selected set (and is close to gvr's serial
  ``sparse_attention`` over it);
- superset mode equals attention over the multiset ``predicted`` (as listed: duplicates count twice,
  out-of-range entries nothing, as sparse_attention counts them) + ``missed(selected, predicted)``;

for empty predictions (step 0, budget 0), partial (budget < 1) and full / over-full predictions,
predictions with -1, out-of-range and duplicated entries (``set_prediction``), both predictors; hit
rates against NumPy; bad inputs named; determinism; the CUDA gate.
"""
from __future__ import annotations

import numpy as np
import pytest

import gvr
from gvr import _prr_runtime as R
from attention_reference import missed_ref, sparse_attention_naive, sparse_attention_ref
from harness import assert_close, torch_or_none

torch = torch_or_none()

Hq, Hkv, D, P, G = 4, 2, 32, 16, 16


class Decode:
    """A paged cache of B rows (shuffled pages), growing by one token per step; Quest metadata kept
    up to date with update_block_metadata; a query drifting step to step."""

    def __init__(self, seed, B=2, max_pages=24, k=6, start=None):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.B, self.k = B, k
        num_pages = B * max_pages + 3
        self.K = rng.standard_normal((num_pages, P, Hkv, D)).astype(np.float32)
        self.V = rng.standard_normal((num_pages, P, Hkv, D)).astype(np.float32)
        self.bt = rng.permutation(num_pages)[: B * max_pages].astype(np.int32).reshape(B, max_pages)
        cap = max_pages * P
        self.max_blocks = cap // G
        st = np.array(start if start is not None else [cap - 3 * P - 5, cap // 2 + 3][:B], np.int32)
        self.lengths = st.copy()
        self.meta = gvr.prr.block_metadata(self.K, self.bt, self.lengths, block_size=G)
        self.select = R.quest_select(self.meta, k, self.lengths, block_size=G)
        self.q = rng.standard_normal((B, Hq, D)).astype(np.float32)

    def advance(self):
        """one more token per row and a new query"""
        old = self.lengths.copy()
        self.lengths += 1  # in place: quest_select reads it
        gvr.prr.update_block_metadata(self.meta, self.K, self.bt, old, self.lengths, block_size=G)
        self.q = (0.9 * self.q + 0.45 * self.rng.standard_normal(self.q.shape)).astype(np.float32)
        return self.q

    def runtime(self, **kw):
        kw.setdefault("block_size", G)
        kw.setdefault("k", self.k)
        return R.SpeculativeAttention(self.B, Hq, Hkv, D, self.max_blocks, **kw)

    def ref(self, idx):
        args = (self.q, self.K, self.V, idx, self.lengths, self.bt, G)
        return sparse_attention_ref(*args), sparse_attention_naive(*args, dtype="float32")


def expected_indices(mode, pred, sel):
    if mode == "exact":
        return sel
    return np.concatenate([pred, missed_ref(sel, pred)], axis=2)


def hit_counts(pred, sel):
    """NumPy: (entries of selected >= 0 found in the row's prediction, entries of selected >= 0)"""
    hits = n = 0
    for b in range(sel.shape[0]):
        for h in range(sel.shape[1]):
            p = set(int(x) for x in pred[b, h])
            for x in sel[b, h]:
                if x >= 0:
                    n += 1
                    hits += int(x) in p
    return hits, n


def check_step(dec, sa, mode, what):
    pred = sa.prediction(dec.B).copy()
    out, lse = sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select)
    sel = dec.select.selected[: dec.B].copy()
    (ro, rl), (no, nl) = dec.ref(expected_indices(mode, pred, sel))
    assert_close(out, ro, no, "float32", what=f"{what} out")
    assert_close(lse, rl, nl, "float32", what=f"{what} lse")
    if mode == "exact":  # close to gvr's serial attention over the selected set
        so, sl = gvr.sparse_attention(dec.q, dec.K, dec.V, sel, block_table=dec.bt, lengths=dec.lengths,
                                      block_size=G)
        assert_close(out, ro, so.astype(np.float64), "float32", factor=4.0, what=f"{what} vs serial")
        np.testing.assert_allclose(out, so, rtol=0, atol=1e-5)
    return pred, sel


@pytest.mark.parametrize("predictor", ["ema", "last"])
@pytest.mark.parametrize("mode", ["exact", "superset"])
@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0, 1.5])
def test_decode_matches_reference(mode, predictor, budget):
    dec = Decode(seed=int(budget * 10) + 3 * (mode == "exact") + (predictor == "ema"))
    sa = dec.runtime(mode=mode, predictor=predictor, budget=budget)
    assert sa.n_pred == round(budget * dec.k)
    total = [0, 0]
    for t in range(5):
        if t:
            dec.advance()
        pred, sel = check_step(dec, sa, mode, f"{mode} {predictor} budget {budget} step {t}")
        if t == 0 or budget == 0:
            assert np.all(pred == -1)
        h, n = hit_counts(pred, sel) if budget > 0 else (0, 0)  # no speculation: nothing counted, rate 0
        total[0] += h
        total[1] += n
        assert sa.last_hit_rate == pytest.approx((h / n if n else 1.0) if budget > 0 else 0.0, abs=0)
        assert sa.mean_hit_rate == pytest.approx(total[0] / total[1] if budget > 0 else 0.0, abs=0)
        assert 0.0 <= sa.last_hit_rate <= 1.0 and 0.0 <= sa.mean_hit_rate <= 1.0
        assert list(sa.hit_counts) == [h, n, total[0], total[1]]
    if budget >= 1.0:  # a persistent query: speculation pays
        assert sa.mean_hit_rate > 0.3


def test_last_predictor_reuses_the_selection():
    dec = Decode(seed=5)
    sa = dec.runtime(predictor="last", budget=0.5)
    sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select)
    assert np.array_equal(sa.prediction(dec.B), dec.select.selected[: dec.B, :, :3])
    sa = dec.runtime(predictor="last", budget=1.5)
    sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select)
    p = sa.prediction(dec.B)
    assert np.array_equal(p[:, :, :6], dec.select.selected[: dec.B]) and np.all(p[:, :, 6:] == -1)


@pytest.mark.parametrize("keep", [(0, 0), (1, 2), (2, 1)])
def test_ema_prediction_is_the_predictors_with_the_kept_blocks(keep):
    """keep (0, 0): exactly EMAPredictor.predict; else the same Top-K with the first keep[0] and the
    keep[1] most recent blocks of each row scored +inf (the blocks the selection always keeps)."""
    dec = Decode(seed=6)
    sa = dec.runtime(predictor="ema", budget=1.0, alpha=0.3, beta=0.6, phi=0.25, keep_first=keep[0],
                     keep_last=keep[1])
    ema = gvr.prr.EMAPredictor(dec.B, Hkv, dec.max_blocks, alpha=0.3, beta=0.6, phi=0.25)
    for t in range(3):
        if t:
            dec.advance()
        sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select)
        nb = ((dec.lengths + G - 1) // G).astype(np.int32)
        ema.update(dec.select.scores[: dec.B], nb)
        if keep == (0, 0):
            assert np.array_equal(sa.prediction(dec.B), ema.predict(dec.k, nb))
            continue
        pr, rl = ema.predicted_scores(nb)
        pr = np.array(pr, dtype=np.float64)
        want = np.full((dec.B, Hkv, dec.k), -1, np.int32)
        for b in range(dec.B):
            for h in range(Hkv):
                n = int(rl[b, h])
                row = pr[b, h, :n].copy()
                row[: keep[0]] = np.inf
                row[max(0, n - keep[1]): n] = np.inf
                order = np.lexsort((np.arange(n), -row))[: dec.k]  # value descending, ties to the lower index
                want[b, h, : len(order)] = order
        got = sa.prediction(dec.B)
        assert np.array_equal(np.sort(got, axis=2), np.sort(want, axis=2)), t


@pytest.mark.parametrize("mode", ["exact", "superset"])
def test_predictions_with_padding_out_of_range_and_duplicates(mode):
    dec = Decode(seed=11)
    sa = dec.runtime(mode=mode, predictor="last", budget=1.5)  # n_pred 9
    nb = (dec.lengths + G - 1) // G
    for t in range(4):
        if t:
            dec.advance()
        rng = dec.rng
        pred = rng.integers(0, nb.min(), size=(dec.B, Hkv, sa.n_pred)).astype(np.int32)
        pred[:, :, 0] = pred[:, :, 1]               # duplicates
        pred[0, 0, 2] = -1                           # padding
        pred[0, 1, 3] = dec.max_blocks + 5           # past the table
        pred[1, 0, 4] = nb[1] + 1                    # past the row's length (masked)
        pred[1, 1, 5] = -7                           # negative: names nothing
        if t == 3:
            pred[:] = -1                             # empty
        sa.set_prediction(pred)
        got, sel = check_step(dec, sa, mode, f"{mode} step {t}")
        assert np.array_equal(got, pred)
        assert sa.last_hit_rate == pytest.approx(hit_counts(pred, sel)[0] / max(1, hit_counts(pred, sel)[1]), abs=0)


def test_join_false_on_the_cpu_is_the_same_step():
    """On the CPU join changes nothing: join=False steps equal join=True steps bit for bit; join() is a no-op."""
    a, b = Decode(seed=21), Decode(seed=21)
    sa_a, sa_b = a.runtime(predictor="ema", budget=1.0), b.runtime(predictor="ema", budget=1.0)
    for t in range(4):
        if t:
            a.advance()
            b.advance()
        oa, la = sa_a.step(a.q, a.K, a.V, a.bt, a.lengths, a.select)
        ob, lb = sa_b.step(b.q, b.K, b.V, b.bt, b.lengths, b.select, join=False)
        sa_b.join()
        assert np.array_equal(oa, ob) and np.array_equal(la, lb), t
        assert np.array_equal(sa_a.prediction(a.B), sa_b.prediction(b.B)), t
        assert list(sa_a.hit_counts) == list(sa_b.hit_counts), t
    before = (sa_b.state[0].copy(), sa_b.state[1].copy(), sa_b.prediction(b.B).copy())
    with pytest.raises(TypeError, match="'join'"):
        sa_b.step(b.q, b.K, b.V, b.bt, b.lengths, b.select, join="yes")
    after = (sa_b.state[0], sa_b.state[1], sa_b.prediction(b.B))
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("mode", ["exact", "superset"])
def test_full_prediction_repairs_nothing(mode):
    """predicted == selected: the hit rate is 1 and the result is the reference's."""
    dec = Decode(seed=12)
    sa = dec.runtime(mode=mode, predictor="last", budget=1.0)
    sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select)
    sa.set_prediction(dec.select.selected[: dec.B].copy())  # the same query again: the same selection
    check_step(dec, sa, mode, f"{mode} full")
    assert sa.last_hit_rate == 1.0
    hits, sel = (int(v) for v in sa.hit_counts[:2])
    assert hits == sel == int((dec.select.selected[: dec.B] >= 0).sum())  # every selected entry was predicted


def test_batch_smaller_than_max_batch_and_reset():
    dec = Decode(seed=13, B=1, start=[200])
    sa = R.SpeculativeAttention(3, Hq, Hkv, D, dec.max_blocks, block_size=G, k=dec.k, predictor="last")
    for t in range(3):
        if t:
            dec.advance()
        check_step(dec, sa, "exact", f"B=1 step {t}")
    assert np.all(sa.prediction()[1:] == -1) and np.any(sa.prediction(1) >= 0)
    sa.reset(0)
    assert np.all(sa.prediction() == -1)
    sa.reset_hit_rates()
    assert list(sa.hit_counts) == [0, 0, 0, 0] and sa.mean_hit_rate == 1.0


def test_deterministic():
    runs = []
    for _ in range(2):
        dec = Decode(seed=21)
        sa = dec.runtime(predictor="ema", budget=0.5, mode="exact")
        res = []
        for t in range(4):
            if t:
                dec.advance()
            o, l = sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select)
            res.append((o.copy(), l.copy(), sa.prediction(dec.B).copy()))
        runs.append(res)
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            assert np.array_equal(x.view(np.uint32) if x.dtype == np.float32 else x,
                                  y.view(np.uint32) if y.dtype == np.float32 else y)


def test_budget_zero_is_one_sparse_attention_into_out():
    """budget 0: the step is sparse_attention over the selection, written straight into out (the float32
    state's out untouched); where out's dtype is neither q's nor float32, through the state and converted."""
    dec = Decode(seed=23)
    sa = dec.runtime(budget=0.0)
    sentinel = sa.state[0].copy()
    for t in range(3):
        if t:
            dec.advance()
        sel = dec.select(dec.q)[0].copy()
        ro, rl = gvr.sparse_attention(dec.q, dec.K, dec.V, sel, lengths=dec.lengths, block_table=dec.bt,
                                      block_size=G)
        out = np.full((dec.B, Hq, D), np.nan, np.float32)
        o, l = sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select, out=out)
        assert o is out
        assert np.array_equal(out.view(np.uint32), ro.view(np.uint32)), t
        assert np.array_equal(l.view(np.uint32), rl.view(np.uint32)), t
        assert np.array_equal(sa.state[0].view(np.uint32), sentinel.view(np.uint32)), t
        assert sa.last_hit_rate == 0.0
    # float16 out for float32 q: through the float32 state, then converted
    out16 = np.full((dec.B, Hq, D), np.nan, np.float16)
    o, l = sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select, out=out16)
    sel = dec.select(dec.q)[0]
    ro, _ = gvr.sparse_attention(dec.q, dec.K, dec.V, sel, lengths=dec.lengths, block_table=dec.bt, block_size=G)
    assert o is out16 and np.array_equal(out16, ro.astype(np.float16))
    assert np.array_equal(sa.state[0][: dec.B].view(np.uint32), ro.view(np.uint32))


def test_out_argument_and_dtypes():
    dec = Decode(seed=22)
    sa = dec.runtime()
    out = np.full((dec.B, Hq, D), np.nan, np.float32)
    o, l = sa.step(dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select, out=out)
    assert o is out and np.array_equal(out, sa.state[0][: dec.B])
    assert l.dtype == np.float32 and l.shape == (dec.B, Hq)


@pytest.mark.skipif(torch is None, reason="bfloat16 CPU inputs need torch")
def test_torch_bfloat16_cpu_inputs():
    dec = Decode(seed=23)
    tq = torch.from_numpy(dec.q).bfloat16()
    tk, tv = torch.from_numpy(dec.K).bfloat16(), torch.from_numpy(dec.V).bfloat16()
    bt, ln = torch.from_numpy(dec.bt), torch.from_numpy(dec.lengths)
    meta = gvr.prr.block_metadata(tk, bt, ln, block_size=G)
    select = R.quest_select(meta, dec.k, ln, block_size=G)
    sa = R.SpeculativeAttention(dec.B, Hq, Hkv, D, dec.max_blocks, block_size=G, k=dec.k, dtype="bfloat16")
    for t in range(3):
        pred = sa.prediction(dec.B).copy()
        o, l = sa.step(tq, tk, tv, bt, ln, select)
        assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and l.dtype == torch.float32
        sel = select.selected[: dec.B].numpy().copy()
        args = (tq, tk, tv, sel, ln, bt, G)
        ro, rl = sparse_attention_ref(*args)
        no, nl = sparse_attention_naive(*args, dtype="bfloat16")
        assert_close(sa.state[0][: dec.B], ro, no, "bfloat16", what=f"bf16 step {t} out")
        assert_close(l.numpy(), rl, nl, "bfloat16", what=f"bf16 step {t} lse")
        ref_bf = torch.from_numpy(sa.state[0][: dec.B]).bfloat16()
        assert torch.equal(o, ref_bf)
        del pred
        tq = (0.9 * tq.float() + 0.3 * torch.randn(tq.shape, generator=torch.Generator().manual_seed(t))).bfloat16()


@pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"), reason="fp8 caches need torch")
@pytest.mark.parametrize("mode", ["exact", "superset"])
def test_fp8_caches_with_scales(mode):
    """step() over fp8 e4m3fn caches with k_scale / v_scale (bf16 q): the state equals the float64
    reference over the dequantized caches (k_scale * K, v_scale * V), both modes, three steps"""
    dec = Decode(seed=29)
    ks, vs = 3.0 / 448, 2.5 / 448
    k8 = torch.from_numpy(dec.K / ks).to(torch.float8_e4m3fn)
    v8 = torch.from_numpy(dec.V / vs).to(torch.float8_e4m3fn)
    kd, vd = (k8.float() * ks).numpy(), (v8.float() * vs).numpy()
    tq = torch.from_numpy(dec.q).bfloat16()
    bt, ln = torch.from_numpy(dec.bt), torch.from_numpy(dec.lengths)
    meta = gvr.prr.block_metadata(torch.from_numpy(kd).bfloat16(), bt, ln, block_size=G)  # q's dtype
    select = R.quest_select(meta, dec.k, ln, block_size=G)
    a = R.SpeculativeAttention(dec.B, Hq, Hkv, D, dec.max_blocks, block_size=G, k=dec.k, dtype="float32", mode=mode)
    for t in range(3):
        pred = a.prediction(dec.B).copy()
        o, l = a.step(tq, k8, v8, bt, ln, select, k_scale=ks, v_scale=vs)
        sel = select.selected[: dec.B].numpy().copy()
        idx = expected_indices(mode, pred, sel)
        args = (tq.float().numpy(), kd, vd, idx, dec.lengths, dec.bt, G)
        ro, rl = sparse_attention_ref(*args)
        no, nl = sparse_attention_naive(*args, dtype="float32")
        assert_close(a.state[0][: dec.B], ro, no, "float32", factor=4.0, what=f"fp8 step {t} out")
        assert_close(l.numpy(), rl, nl, "float32", factor=4.0, what=f"fp8 step {t} lse")
        tq = (0.9 * tq.float() + 0.3 * torch.randn(tq.shape, generator=torch.Generator().manual_seed(t))).bfloat16()


# --------------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------------
def make(**kw):
    args = dict(max_batch=2, Hq=Hq, Hkv=Hkv, D=D, max_blocks=24, block_size=G, k=6)
    pos = [args.pop(n) for n in ("max_batch", "Hq", "Hkv", "D", "max_blocks")]
    for n in list(kw):
        if n in ("max_batch", "Hq", "Hkv", "D", "max_blocks"):
            pos[["max_batch", "Hq", "Hkv", "D", "max_blocks"].index(n)] = kw.pop(n)
    args.update(kw)
    return R.SpeculativeAttention(*pos, **args)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(max_batch=0), ValueError, "max_batch"), (dict(Hq=2.0), TypeError, "Hq"), (dict(Hq=5), ValueError, "Hq"),
    (dict(D=True), TypeError, "'D'"), (dict(max_blocks=0), ValueError, "max_blocks"),
    (dict(block_size=0), ValueError, "block_size"), (dict(k=None), TypeError, "'k'"),
    (dict(budget=-0.5), ValueError, "budget"), (dict(budget=float("nan")), ValueError, "budget"),
    (dict(budget="1"), TypeError, "budget"), (dict(mode="both"), ValueError, "mode"), (dict(mode=1), TypeError, "mode"),
    (dict(predictor="lru"), ValueError, "predictor"), (dict(alpha=1.0), ValueError, "alpha"),
    (dict(phi=-0.1), ValueError, "phi"), (dict(device="tpu"), ValueError, "device"),
    (dict(dtype="int8"), ValueError, "dtype"),
])
def test_bad_construction(kw, exc, name):
    with pytest.raises(exc, match=name):
        make(**kw)


def test_bad_step_inputs():
    dec = Decode(seed=31)
    sa = dec.runtime()
    q, K, V, bt, ln, sel = dec.q, dec.K, dec.V, dec.bt, dec.lengths, dec.select
    with pytest.raises(TypeError, match="'q'"):
        sa.step([1, 2], K, V, bt, ln, sel)
    with pytest.raises(ValueError, match="'q'"):
        sa.step(q[:, :2], K, V, bt, ln, sel)
    with pytest.raises(ValueError, match="'q'"):
        sa.step(np.zeros((3, Hq, D), np.float32), K, V, bt, ln, sel)
    with pytest.raises(ValueError, match="'block_table'"):
        sa.step(q, K, V, bt[:1], ln, sel)
    with pytest.raises(TypeError, match="'block_table'"):
        sa.step(q, K, V, None, ln, sel)
    with pytest.raises(ValueError, match="'lengths'"):
        sa.step(q, K, V, bt, ln[:1], sel)
    with pytest.raises(TypeError, match="'select'"):
        sa.step(q, K, V, bt, ln, None)
    with pytest.raises(ValueError, match="'out'"):
        sa.step(q, K, V, bt, ln, sel, out=np.zeros((2, Hq, D + 1), np.float32))
    with pytest.raises(TypeError, match="'select' must return \\(selected, scores\\)"):
        sa.step(q, K, V, bt, ln, lambda q: sel(q)[0])
    with pytest.raises(ValueError, match="'select' returned selected of shape"):
        sa.step(q, K, V, bt, ln, lambda q: (sel(q)[0][:, :, :2], sel(q)[1]))
    with pytest.raises(TypeError, match="'select' must return int32"):
        sa.step(q, K, V, bt, ln, lambda q: (sel(q)[0].astype(np.int64), sel(q)[1]))
    with pytest.raises(ValueError, match="'select' returned scores"):
        sa.step(q, K, V, bt, ln, lambda q: (sel(q)[0], sel(q)[1][0]))
    with pytest.raises(TypeError, match="'select' must return float32 scores"):
        sa.step(q, K, V, bt, ln, lambda q: (sel(q)[0], sel(q)[1].astype(np.float64)))
    with pytest.raises(ValueError, match="'lengths'"):
        small = R.SpeculativeAttention(2, Hq, Hkv, D, 4, block_size=G, k=dec.k)
        small.step(q, K, V, bt, ln, sel)
    # "last" needs no scores
    last = dec.runtime(predictor="last")
    last.step(q, K, V, bt, ln, lambda q: sel(q)[0])
    with pytest.raises(ValueError, match="'predicted'"):
        sa.set_prediction(np.zeros((2, Hkv, 5), np.int32))
    with pytest.raises(TypeError, match="'predicted'"):
        sa.set_prediction(np.zeros((2, Hkv, 6), np.int64))
    with pytest.raises(ValueError, match="'rows'"):
        sa.reset(5)


def test_quest_select_sorted_orders_best_first_and_must_be_a_bool():
    dec = Decode(seed=31)
    q = dec.q
    plain = R.quest_select(dec.meta, dec.k, dec.lengths, block_size=G)(q)[0].copy()
    best_first = R.quest_select(dec.meta, dec.k, dec.lengths, block_size=G, sorted=True)(q)[0]
    assert np.array_equal(np.sort(plain, -1), np.sort(best_first, -1))
    scores = gvr.prr.block_scores(q, dec.meta, dec.lengths, block_size=G, keep_first=1, keep_last=2)
    for b in range(dec.B):
        for h in range(Hkv):
            s = [scores[b, h, x] for x in best_first[b, h] if x >= 0]
            assert all(s[i] >= s[i + 1] for i in range(len(s) - 1))
    with pytest.raises(TypeError, match="sorted"):
        R.quest_select(dec.meta, dec.k, dec.lengths, block_size=G, sorted="yes")(q)
