"""Bad inputs found by a fuzz campaign over the CPU API (session 19): each was a silent wrong result, a
modified input, an exception of the wrong type or a message naming an internal argument. Every case:
the exception type, the argument named, and nothing passed in modified."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
import gvr.prr
import gvr.sparda
from harness import torch_or_none

F32, I32 = np.float32, np.int32
I32_MAX = 2**31 - 1


def _raises(exc, names, fn):
    """fn() raises exc (not a subclass elsewhere in the hierarchy: MemoryError is no ValueError) whose
    message names every one of names"""
    with pytest.raises(exc) as ei:
        fn()
    assert type(ei.value) is exc, f"{type(ei.value).__name__}: {ei.value}"
    for n in names:
        assert re.search(rf"'{re.escape(n)}'", str(ei.value)), f"{n!r} not named in: {ei.value}"
    return str(ei.value)


# ---- topk_decode: the page-table transform's int32 slots -------------------------------------------
def test_topk_page_table_slots_past_int32_raise():
    x = np.random.default_rng(0).standard_normal((2, 40)).astype(F32)
    x0 = x.copy()
    bt = np.full((2, 3), 2**27, I32)  # 2^27 * 16 = 2^31: the first slot already overflows
    bt0 = bt.copy()
    msg = _raises(ValueError, ["block_table"], lambda: gvr.topk_decode(x, 3, block_table=bt, page_size=16))
    assert "int32" in msg
    _raises(ValueError, ["block_table"], lambda: gvr.topk_decode(x, 3, block_table=np.full((2, 1), 3, I32),
                                                                    page_size=2**30))
    assert np.array_equal(x, x0) and np.array_equal(bt, bt0)


def test_topk_page_table_slots_up_to_int32_max():
    """the largest page whose slots fit is accepted (exactly INT32_MAX at the row's last position); a
    larger page that only positions past the row's length would reach is never read"""
    P = 16
    top = (I32_MAX - (P - 1)) // P
    x = np.arange(48, dtype=F32)[None]
    got = gvr.topk_decode(x, 2, block_table=np.array([[0, 1, top]], I32), page_size=P)
    assert got.tolist() == [[top * P + 15, top * P + 14]] and top * P + 15 == I32_MAX
    bt = np.array([[0, 1, top + 1]], I32)
    got = gvr.topk_decode(x, 2, block_table=bt, page_size=P, lengths=np.array([32], I32))
    assert got.tolist() == [[P + 15, P + 14]]
    _raises(ValueError, ["block_table"], lambda: gvr.topk_decode(x, 2, block_table=bt, page_size=P))


# ---- topk_decode: flat buffers and allocations -----------------------------------------------------
@pytest.mark.parametrize("starts", [[10], []])
def test_topk_one_d_scores_with_one_or_no_row_start(starts):
    x = np.random.default_rng(1).standard_normal(100).astype(F32)
    rs = np.array(starts, I32)
    got = gvr.topk_decode(x, 5, row_starts=rs, sorted=True)
    assert got.shape == (len(starts), 5)
    for b, s in enumerate(starts):
        assert got[b].tolist() == np.argsort(-x[s:], kind="stable")[:5].tolist()
    t = torch_or_none()
    if t is not None:
        gt = gvr.topk_decode(t.from_numpy(x), 5, row_starts=t.from_numpy(rs), sorted=True)
        assert gt.shape == (len(starts), 5) and np.array_equal(gt.numpy(), got)


def test_topk_output_too_large_for_int32_rows_is_refused_before_allocation():
    # B = 2^33 rows of no scores: out [B, 1] would be 32 GiB; refused by name, not a MemoryError
    _raises(ValueError, ["out"], lambda: gvr.topk_decode(np.empty((2**33, 0), F32), 1))


def test_outputs_with_overlapping_elements_are_refused():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 100)).astype(F32)
    base = np.full(8, -7, I32)
    out = np.lib.stride_tricks.as_strided(base, (4, 5), (0, 4))  # every row the same 5 ints
    _raises(ValueError, ["out"], lambda: gvr.topk_decode(x, 5, out=out))
    assert (base == -7).all()
    # sparse_attention's lse with a stride 0 over the heads
    q = rng.standard_normal((1, 4, 8)).astype(F32)
    kc = rng.standard_normal((4, 4, 1, 8)).astype(F32)
    ix = np.array([[[0, 1, 2]]], I32)
    lse_base = np.full(4, 5.0, F32)
    lse = np.lib.stride_tricks.as_strided(lse_base, (1, 4), (16, 0))
    _raises(ValueError, ["lse"], lambda: gvr.sparse_attention(q, kc, kc, ix, lse=lse))
    assert (lse_base == 5.0).all()
    # a dense and a transposed-then-sliced output still work
    o = np.zeros((4, 5), I32)
    assert np.array_equal(gvr.topk_decode(x, 5, out=o), gvr.topk_decode(x, 5))


def test_torch_tensors_that_dlpack_cannot_export_are_named():
    t = torch_or_none()
    if t is None:
        pytest.skip("torch")
    msg = _raises(TypeError, ["scores"], lambda: gvr.topk_decode(t.randn(3, 100).to_sparse(), 5))
    assert "strided" in msg
    _raises(ValueError, ["scores"], lambda: gvr.topk_decode(t.randn(3, 100, device="meta"), 5))
    q = t.randn(1, 4, 8)
    kc = t.randn(4, 4, 1, 8)
    ix = t.tensor([[[0, 1, 2]]], dtype=t.int32).to_sparse()
    _raises(TypeError, ["indices"], lambda: gvr.sparse_attention(q, kc, kc, ix))


# ---- sparda: what a call writes against what it reads ---------------------------------------------
def test_append_source_inside_the_cache_is_refused():
    c = gvr.sparda.HostKVCache(1, 8, 4, 2, 8, F32, device="cpu")
    try:
        K = c.k(0).reshape(-1, 2, 8)
        K[:5] = np.random.default_rng(3).standard_normal((5, 2, 8))
        before = K.copy()
        _raises(ValueError, ["k"], lambda: c.append(0, K[:5], np.zeros((5, 2, 8), F32), np.arange(5) + 2))
        _raises(ValueError, ["v"], lambda: c.append(0, np.zeros((5, 2, 8), F32), c.v(0).reshape(-1, 2, 8)[:5],
                                                    np.arange(5) + 2))
        assert np.array_equal(K, before)
        c.append(0, K[:5].copy(), np.zeros((5, 2, 8), F32), np.arange(5) + 2)  # a copy: fine
        assert np.array_equal(K[2:7], before[:5])
        del K
    finally:
        c.close()


def test_prefetch_staging_inside_the_host_cache_is_refused():
    rng = np.random.default_rng(4)
    hk = rng.standard_normal((16, 4, 2, 8)).astype(F32)
    hv = hk.copy()
    h0 = hk.copy()
    ix = np.array([[[5, 3, 9, 1]]], I32)
    _raises(ValueError, ["dst_k", "host_k"],
            lambda: gvr.sparda.prefetch(hk, hv, ix, hk[:8], np.zeros((8, 4, 2, 8), F32)))
    _raises(ValueError, ["dst_v", "host_v"],
            lambda: gvr.sparda.prefetch(hk, hv, ix, np.zeros((8, 4, 2, 8), F32), hv[8:]))
    buf = np.zeros(16, I32)  # the slot map over the selection
    buf[:4] = ix.ravel()
    _raises(ValueError, ["slot_map_out", "indices"],
            lambda: gvr.sparda.prefetch(hk, hv, buf[:4].reshape(1, 1, 4), np.zeros((8, 4, 2, 8), F32),
                                        np.zeros((8, 4, 2, 8), F32), slot_map_out=buf.reshape(1, 16)))
    assert np.array_equal(hk, h0) and np.array_equal(hv, h0) and buf[:4].tolist() == [5, 3, 9, 1] and not buf[4:].any()


def test_host_cache_sizes_and_arguments():
    _raises(ValueError, ["num_pages"], lambda: gvr.sparda.HostKVCache(1, 2**40, 1, 1, 1, F32, device="cpu"))
    with pytest.raises(ValueError, match="bytes"):
        gvr.sparda.HostKVCache(2**20, 2**20, 2**20, 2, 8, F32, device="cpu")
    _raises(TypeError, ["dtype"], lambda: gvr.sparda.HostKVCache(1, 4, 2, 2, 8, None, device="cpu"))
    with gvr.sparda.HostKVCache(2, 4, 2, 2, 8, F32, device="cpu") as c:  # NumPy ints as the layer
        c.append(np.int64(1), np.ones((1, 2, 8), F32), np.ones((1, 2, 8), F32), np.array([3]))
        assert (c.k(np.int64(1))[1, 1] == 1).all()


# ---- k before allocation ----------------------------------------------------------------------------
def _quest(seed=5):
    rng = np.random.default_rng(seed)
    kc = rng.standard_normal((16, 4, 2, 8)).astype(F32)
    bt = np.arange(16, dtype=I32).reshape(2, 8)
    lengths = np.array([30, 20], I32)
    meta = gvr.prr.block_metadata(kc, bt, lengths, block_size=4)
    q = rng.standard_normal((2, 4, 8)).astype(F32)
    return q, meta, lengths


def test_huge_k_is_a_value_error_not_an_allocation():
    q, meta, lengths = _quest()
    _raises(ValueError, ["k"], lambda: gvr.prr.select_blocks(q, meta, 2**31, lengths, block_size=4))
    ema = gvr.prr.EMAPredictor(3, 2, 10)
    _raises(ValueError, ["num_blocks"], lambda: ema.predict(2**31, np.array([10, 4, 0], I32)))
    rng = np.random.default_rng(6)
    F = rng.standard_normal((2, 2, 8)).astype(F32)
    kt = rng.standard_normal((2, 2, 10, 8)).astype(F32)
    _raises(ValueError, ["k"], lambda: gvr.sparda.forecast_select(F, kt, 2**31, lengths=np.array([90, 60], I32),
                                                                  kernel=16, stride=8))
    _raises(ValueError, ["k_cache"], lambda: gvr.sparda.compressed_keys(np.empty((0, 2**31, 2, 8), F32),
                                                                        np.zeros((1, 4), I32), kernel=4, stride=4))


def test_select_blocks_out_must_not_overlap_what_it_reads():
    q, meta, lengths = _quest()
    out = np.full((2, 2, 8), -5, I32)
    _raises(ValueError, ["out", "scores_out"],
            lambda: gvr.prr.select_blocks(q, meta, 8, lengths, block_size=4, out=out, scores_out=out.view(F32)))
    assert (out == -5).all()
    qq = np.zeros(2 * 4 * 8, F32)  # out: int32 [2, 2, 8] over the first half of q's buffer
    qv = qq.reshape(2, 4, 8)
    qv[...] = q
    q0 = qq.copy()
    _raises(ValueError, ["out", "q"],
            lambda: gvr.prr.select_blocks(qv, meta, 8, lengths, block_size=4, out=qq[:32].view(I32).reshape(2, 2, 8)))
    assert np.array_equal(qq.view(I32), q0.view(I32))
    t = torch_or_none()
    if t is not None:
        ot = t.full((2, 2, 8), -5, dtype=t.int32)
        _raises(ValueError, ["out", "scores_out"],
                lambda: gvr.prr.select_blocks(t.from_numpy(q), t.from_numpy(meta), 8, t.from_numpy(lengths),
                                              block_size=4, out=ot, scores_out=ot.view(t.float32)))
        assert (ot == -5).all()


def test_ema_nblocks_lists():
    ema = gvr.prr.EMAPredictor(3, 2, 10)
    _raises(ValueError, ["nblocks"], lambda: ema.predict(2, [8, 2**40]))
    _raises(TypeError, ["nblocks"], lambda: ema.predict(2, [8, 4.9]))
    assert ema.predict(2, [8, 4]).shape == (2, 2, 2)


# ---- forecast_select names its own arguments -------------------------------------------------------
def test_forecast_select_messages_name_its_arguments():
    rng = np.random.default_rng(7)
    F = rng.standard_normal((2, 2, 8)).astype(F32)
    kt = rng.standard_normal((2, 2, 10, 8)).astype(F32)
    L = np.array([90, 60], I32)

    def call(**kw):
        a = dict(F=F, ktilde=kt, k=4, lengths=L, kernel=16, stride=8)
        a.update(kw)
        return lambda: gvr.sparda.forecast_select(a.pop("F"), a.pop("ktilde"), a.pop("k"), **a)

    internal = ("'meta'", "'q'", "'window'", "'block_size'", "Nb", "prr.")
    cases = [
        (ValueError, ["F"], call(ktilde=rng.standard_normal((2, 2, 10, 4)).astype(F32))),
        (TypeError, ["ktilde"], call(ktilde=kt.astype(np.float64))),
        (ValueError, ["ktilde"], call(ktilde=rng.standard_normal((2, 2, 10, 16)).astype(F32)[..., ::2])),
        (ValueError, ["lengths", "F"], call(lengths=np.array([90], I32))),
        (ValueError, ["kernel"], call(kernel=2**40)),
        (ValueError, ["stride"], call(stride=2**40)),
        (ValueError, ["lengths"], call(lengths=np.array([-5, 10], I32))),
        (TypeError, ["ktilde"], call(ktilde=kt.tolist())),
        (TypeError, ["F"], call(F=F.astype(np.float64))),
        (ValueError, ["F"], call(F=F[:, :1])),
        (ValueError, ["out"], call(out=np.zeros((2, 2, 3), I32))),
    ]
    for exc, names, fn in cases:
        msg = _raises(exc, names, fn)
        assert not any(w in msg for w in internal), msg
    assert gvr.sparda.forecast_select(F, kt, 4, lengths=L, kernel=np.int64(16), stride=np.int32(8)).shape == (2, 2, 4)


# ---- other DLPack producers (a third fuzz round: fake CUDA tensors everywhere found no crash) -----
def test_select_blocks_and_forecast_select_take_host_dlpack_producers():
    from conftest import FakeDLPack, NumpyProducer
    rng = np.random.default_rng(8)
    q = rng.random((2, 4, 16), dtype=F32)
    meta = rng.random((2, 2, 4, 2, 16), dtype=F32)
    sco = np.full((2, 2, 4), -7, F32)
    got = gvr.prr.select_blocks(NumpyProducer(q), meta, 2, block_size=4, scores_out=sco)
    assert np.array_equal(got, gvr.prr.select_blocks(q, meta, 2, block_size=4))  # (was an AttributeError)
    sco[...] = -7
    fake_q = FakeDLPack(shape=(2, 4, 16), dtype=F32, data=None, device=(2, 0), null_deleter=True)
    _raises(TypeError, ["q"], lambda: gvr.prr.select_blocks(fake_q, meta, 2, block_size=4, scores_out=sco))
    assert (sco == -7).all()  # named before anything is written
    F = rng.random((2, 2, 16), dtype=F32)
    kt = rng.random((2, 2, 4, 16), dtype=F32)
    L = np.full(2, 16, I32)
    want = gvr.sparda.forecast_select(F, kt, 2, lengths=L, kernel=4, stride=4)
    assert np.array_equal(gvr.sparda.forecast_select(F, NumpyProducer(kt), 2, lengths=NumpyProducer(L), kernel=4,
                                                     stride=4), want)
    fake = FakeDLPack(shape=(2, 2, 4, 16), dtype=F32, data=None, device=(2, 0), null_deleter=True)
    _raises(TypeError, ["ktilde"], lambda: gvr.sparda.forecast_select(F, fake, 2, lengths=L, kernel=4, stride=4))
    fake_l = FakeDLPack(shape=(2,), dtype=I32, data=None, device=(2, 0), null_deleter=True)
    _raises(TypeError, ["lengths"], lambda: gvr.sparda.forecast_select(F, kt, 2, lengths=fake_l, kernel=4, stride=4))
