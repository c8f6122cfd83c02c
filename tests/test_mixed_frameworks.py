"""Every public operator given arguments from both frameworks at once (NumPy arrays and torch CPU
tensors mixed: gvr reads any array through DLPack), or arguments of the wrong kind: each call either
runs -- and then equals the same call in one framework -- or raises a TypeError / ValueError naming
the argument; never another exception (session 17 found `prr.select_blocks` raising AttributeError
for an `out` of the other framework). Inputs are never modified by a failing call."""
import numpy as np
import pytest

import gvr
from gvr import prr, sparda

torch = pytest.importorskip("torch", reason="mixed-framework calls need torch")

B, Hq, Hkv, D, P, pages, G = 2, 4, 2, 16, 8, 16, 8


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    c = dict(
        k=rng.standard_normal((pages, P, Hkv, D), dtype=np.float32),
        v=rng.standard_normal((pages, P, Hkv, D), dtype=np.float32),
        bt=rng.permutation(pages)[: B * 8].astype(np.int32).reshape(B, 8),
        ln=np.array([50, 60], np.int32),
        q=rng.standard_normal((B, Hq, D), dtype=np.float32),
        idx=rng.integers(0, 6, (B, Hkv, 4)).astype(np.int32),
        sc=rng.standard_normal((B, 100), dtype=np.float32),
    )
    c["meta"] = prr.block_metadata(c["k"], c["bt"], c["ln"], block_size=G)
    return c


def T(a):
    return torch.from_numpy(np.array(a, copy=True))


def same(a, b):
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def runs_like(fn, ref):
    """fn() runs and its result (an array or a tuple of arrays) equals ref()'s bit for bit"""
    got, want = fn(), ref()
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))


def named(fn, exc, name):
    with pytest.raises(exc, match=rf"\b{name}\b"):
        fn()


def test_sparse_attention_and_repair_mixed(case):
    c = case
    kw = dict(lengths=c["ln"], block_table=c["bt"], block_size=G)
    ref = lambda: gvr.sparse_attention(c["q"], c["k"], c["v"], c["idx"], **kw)  # noqa: E731
    runs_like(lambda: gvr.sparse_attention(c["q"], T(c["k"]), c["v"], c["idx"], **kw), ref)
    runs_like(lambda: gvr.sparse_attention(T(c["q"]), T(c["k"]), T(c["v"]), T(c["idx"]), lengths=T(c["ln"]),
                                           block_table=T(c["bt"]), block_size=G, out=np.zeros_like(c["q"])), ref)
    runs_like(lambda: gvr.sparse_attention(c["q"], c["k"], c["v"], c["idx"], out=torch.zeros(B, Hq, D),
                                           lse=torch.zeros(B, Hq), **kw), ref)
    o, l = ref()
    want = prr.repair(o.copy(), l.copy(), c["q"], c["k"], c["v"], c["idx"], **kw)
    runs_like(lambda: prr.repair(T(o), T(l), c["q"], c["k"], c["v"], c["idx"], **kw), lambda: want)
    runs_like(lambda: prr.repair(o.copy(), l.copy(), c["q"], c["k"], c["v"], c["idx"], exclude=T(c["idx"]), **kw),
              lambda: prr.repair(o.copy(), l.copy(), c["q"], c["k"], c["v"], c["idx"], exclude=c["idx"], **kw))
    runs_like(lambda: gvr.merge_states(o, l, T(o), T(l)), lambda: gvr.merge_states(o, l, o, l))
    runs_like(lambda: prr.missed(c["idx"], T(c["idx"])), lambda: prr.missed(c["idx"], c["idx"]))
    snap = [x.copy() for x in (c["q"], c["k"], c["idx"])]
    named(lambda: gvr.sparse_attention(c["q"].tolist(), c["k"], c["v"], c["idx"], **kw), TypeError, "q")
    named(lambda: gvr.sparse_attention(c["q"], c["k"], c["v"], c["idx"], partials=[1, 2, 3], **kw), TypeError,
          "partials")
    named(lambda: gvr.merge_states(o, l, o, l, lse_base=2), TypeError, "lse_base")
    named(lambda: prr.missed(c["idx"], c["idx"], counts=torch.zeros(2, dtype=torch.int64)), ValueError, "counts")
    assert all(same(a, b) for a, b in zip(snap, (c["q"], c["k"], c["idx"])))


def test_selection_and_topk_mixed(case):
    c = case
    ref = lambda: prr.select_blocks(c["q"], c["meta"], 2, c["ln"], block_size=G)  # noqa: E731
    runs_like(lambda: prr.select_blocks(T(c["q"]), c["meta"], 2, c["ln"], block_size=G), ref)
    runs_like(lambda: prr.select_blocks(c["q"], c["meta"], 2, c["ln"], block_size=G,
                                        out=torch.full((B, Hkv, 2), -9, dtype=torch.int32)), ref)
    runs_like(lambda: prr.block_scores(c["q"], T(c["meta"]), c["ln"], block_size=G),
              lambda: prr.block_scores(c["q"], c["meta"], c["ln"], block_size=G))
    so = np.full((B, Hkv, c["meta"].shape[2]), 7, np.float32)
    named(lambda: prr.select_blocks(c["q"], c["meta"], 2, c["ln"], block_size=G, scores_out=so,
                                    out=torch.zeros((B, Hkv, 4), dtype=torch.int32)[..., ::2]), TypeError, "out")
    named(lambda: prr.select_blocks(c["q"], c["meta"], 2, c["ln"], block_size=G, scores_out=so,
                                    out=np.zeros((B, Hkv, 5), np.int32)), ValueError, "out")
    assert np.all(so == 7)
    sc = c["sc"]
    ref = lambda: gvr.topk_decode(sc, 5)  # noqa: E731
    runs_like(lambda: gvr.topk_decode(sc, 5, out=torch.zeros(B, 5, dtype=torch.int32)), ref)
    runs_like(lambda: gvr.topk_decode(sc, 5, lengths=torch.full((B,), 100, dtype=torch.int32)), ref)
    named(lambda: gvr.topk_decode(sc, "5"), TypeError, "k")
    named(lambda: gvr.topk_decode(sc.tolist(), 5), TypeError, "scores")


def test_sparda_mixed(case):
    c = case
    cache = sparda.HostKVCache(1, pages, P, Hkv, D, np.float32, device="cpu")
    try:
        cache.append(0, torch.from_numpy(c["k"][:3, 0]), c["v"][:3, 0], np.arange(3))
        sel = np.array([[[0, 3, 5]]], np.int32)

        def gather(dk_torch):
            dk = torch.zeros(6, P, Hkv, D) if dk_torch else np.zeros((6, P, Hkv, D), np.float32)
            dv = np.zeros((6, P, Hkv, D), np.float32)
            m = sparda.prefetch(cache.k(0), cache.v(0), T(sel) if dk_torch else sel, dk, dv, block_table=c["bt"][:1])
            return m, dk, dv
        runs_like(lambda: gather(True), lambda: gather(False))
        named(lambda: sparda.prefetch(cache.k(0), cache.v(0), sel, np.zeros((6, P, Hkv, D), np.float32),
                                      np.zeros((6, P, Hkv, D), np.float32), block_table=c["bt"][:1], method="fast"),
              ValueError, "method")
    finally:
        cache.close()
    kt = sparda.compressed_keys(c["k"], c["bt"], c["ln"])
    runs_like(lambda: sparda.compressed_keys(c["k"], T(c["bt"]), c["ln"]), lambda: kt)
    F = np.random.default_rng(1).standard_normal((B, Hkv, D), dtype=np.float32)
    ln = np.array([3, 3], np.int32)
    runs_like(lambda: sparda.forecast_select(F, T(kt), 2, lengths=ln), lambda: sparda.forecast_select(F, kt, 2, lengths=ln))
