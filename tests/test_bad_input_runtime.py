"""Findings of a second fuzz round (session 19): the PRR runtime's out=, the Forecast loss on a target
that is not a distribution, and torch.compile calls that skipped the checks eager calls make (or failed
where eager works). Each case names the argument, modifies nothing, and compiled equals eager."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
import gvr.prr
import gvr.sparda

F32, I32 = np.float32, np.int32


def _runtime_case():
    rng = np.random.default_rng(2)
    K = rng.standard_normal((8, 8, 2, 16), dtype=F32)
    V = 5 * K
    bt = np.arange(8, dtype=I32)[None]
    ln = np.array([64], I32)
    sel = gvr.prr.quest_select(gvr.prr.block_metadata(K, bt, ln, block_size=8), 4, ln, block_size=8)
    q = rng.standard_normal((1, 4, 16), dtype=F32)
    return q, K, V, bt, ln, sel


def test_speculative_attention_out_must_be_float_and_apart_from_q():
    q, K, V, bt, ln, sel = _runtime_case()
    sa = gvr.prr.SpeculativeAttention(1, 4, 2, 16, 8, block_size=8, k=4)
    for dt in (I32, np.bool_, np.uint8):
        out = np.zeros((1, 4, 16), dt)
        with pytest.raises(TypeError, match="'out'"):
            sa.step(q, K, V, bt, ln, sel, out=out)
        assert not out.any()
    q0 = q.copy()
    with pytest.raises(ValueError, match="'out' must not overlap 'q'"):
        sa.step(q, K, V, bt, ln, sel, out=q)
    assert np.array_equal(q, q0)


def test_speculative_attention_strided_out():
    """an out without unit stride along D takes the converted copy (it named 'cast_out' in an error)"""
    q, K, V, bt, ln, sel = _runtime_case()
    want, _ = gvr.prr.SpeculativeAttention(1, 4, 2, 16, 8, block_size=8, k=4).step(q, K, V, bt, ln, sel)
    want = want.copy()
    out = np.zeros((1, 16, 4), F32).transpose(0, 2, 1)
    got, _ = gvr.prr.SpeculativeAttention(1, 4, 2, 16, 8, block_size=8, k=4).step(q, K, V, bt, ln, sel, out=out)
    assert got is out and np.array_equal(out, want)


def test_speculative_attention_arguments():
    sa = gvr.prr.SpeculativeAttention(2, 4, 2, 16, 8, block_size=8, k=4, budget=1e308)  # budget * k overflows
    assert sa.n_pred == 8
    with pytest.raises(ValueError, match="'B'"):
        sa.prediction(-1)
    with pytest.raises(ValueError, match="'B'"):
        sa.prediction(3)
    assert sa.prediction(1).shape == (1, 2, 8)
    sa.reset(np.array([0, 1]))
    with pytest.raises(TypeError, match="'rows'"):
        sa.reset(np.array([0.5]))
    with pytest.raises(TypeError, match="'rows'"):
        sa.reset([True])


# ---- the Forecast loss -------------------------------------------------------------------------------
def _loss_case(torch):
    g = torch.Generator().manual_seed(3)
    return torch.rand(3, 64, dtype=torch.float64, generator=g), torch.randn(3, 5, dtype=torch.float64, generator=g)


def test_forecast_loss_target_with_nan_or_inf_is_nan():
    torch = pytest.importorskip("torch")
    q, f = _loss_case(torch)
    clean = gvr.sparda.forecast_kl_loss(q, f, 2, reduction="none")
    for bad in (float("nan"), float("inf")):
        q2 = q.clone()
        q2[1, 3] = bad
        got = gvr.sparda.forecast_kl_loss(q2, f, 2, reduction="none")
        assert torch.isnan(got[1]) and torch.equal(got[[0, 2]], clean[[0, 2]])  # (was finite: 12x the clean loss)


def test_forecast_loss_pooling_past_the_row_and_tau_types():
    torch = pytest.importorskip("torch")
    q, f = _loss_case(torch)
    L = gvr.sparda.forecast_kl_loss
    # a kernel past N_fine covers what one of N_fine does; a stride past it leaves one window (no huge pad)
    assert torch.equal(L(q, f, 2, pool_kernel=2**40, reduction="none"), L(q, f, 2, pool_kernel=64, reduction="none"))
    assert torch.equal(L(q, f, 2, pool_stride=2**40, reduction="none"), L(q, f, 2, pool_stride=64, reduction="none"))
    assert torch.equal(L(q, f, 2, tau=np.float32(0.5)), L(q, f, 2, tau=0.5))
    with pytest.raises(TypeError, match="'tau'"):
        L(q, f, 2, tau=torch.tensor(0.5))
    with pytest.raises(ValueError, match="'tau'"):
        L(q, f, 2, tau=float("nan"))


# ---- torch.compile: the checks of eager calls, and what failed to compile ------------------------------
def _compiled_error(torch, fn, *args):
    torch._dynamo.reset()
    with pytest.raises(Exception) as ei:
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    e = ei.value
    while e.__cause__ is not None:  # dynamo wraps what the traced code raised
        e = e.__cause__
    return e


@pytest.mark.parametrize("case", ["out int64", "out_positions alone", "k -1", "sorted 1", "repair None",
                                  "partials of 1", "block_size 0", "metadata out float16", "k_cache 3-D",
                                  "compressed stride 0"])
def test_compiled_calls_make_eager_checks(case):
    torch = pytest.importorskip("torch")
    sc = torch.randn(3, 100)
    bt = torch.zeros(3, 13, dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    K = torch.randn(16, 8, 2, 16)
    idx = torch.zeros(2, 1, 3, dtype=torch.int32)
    bt2 = torch.arange(16, dtype=torch.int32).view(2, 8)
    ln = torch.tensor([30, 20], dtype=torch.int32)
    cases = {
        "out int64": (TypeError, "out", lambda s, o: gvr.topk_decode(s, 3, block_table=bt, page_size=8, out=o),
                      (sc, torch.zeros(3, 3, dtype=torch.int64))),
        "out_positions alone": (ValueError, "out_positions", lambda s, o: gvr.topk_decode(s, 3, out_positions=o),
                                (sc, torch.zeros(3, 3, dtype=torch.int32))),
        "k -1": (ValueError, "k", lambda s: gvr.topk_decode(s, -1), (sc,)),
        "sorted 1": (TypeError, "sorted", lambda s: gvr.topk_decode(s, 3, sorted=1), (sc,)),
        "repair None": (TypeError, "out", lambda q: gvr.prr.repair(None, None, q, K, K, idx), (q,)),
        "partials of 1": (TypeError, "partials", lambda q: gvr.sparse_attention(q, K, K, idx, partials=(q,)), (q,)),
        "block_size 0": (ValueError, "block_size", lambda k: gvr.prr.block_metadata(k, bt2, ln, block_size=0), (K,)),
        "metadata out float16": (TypeError, "out", lambda k, o: gvr.prr.block_metadata(k, bt2, ln, block_size=8, out=o),
                                 (K, torch.zeros(2, 2, 4, 2, 16, dtype=torch.float16))),
        "k_cache 3-D": (ValueError, "k_cache", lambda k: gvr.prr.block_metadata(k[0], bt2, ln, block_size=8), (K,)),
        "compressed stride 0": (ValueError, "stride",
                                lambda k: gvr.sparda.compressed_keys(k, bt2, ln, kernel=4, stride=0), (K,)),
    }
    exc, name, fn, args = cases[case]
    before = [a.clone() for a in args]
    e = _compiled_error(torch, fn, *args)
    # with fullgraph=True dynamo reports the traced code's exception as an "observed" one: its message
    # holds the original's type and message (without fullgraph the call falls back and raises it as is)
    assert isinstance(e, exc) or f"{exc.__name__}(" in str(e), f"{type(e).__name__}: {e}"
    assert re.search(rf"'{name}'", str(e)), f"{type(e).__name__}: {e}"
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_compiled_merge_with_out_and_lse_equals_eager():
    """out= / lse= (one or both) compile (they failed: a data-pointer comparison, None.copy_)"""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    la, lb = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    eo, el = gvr.merge_states(a, la, b, lb)
    torch._dynamo.reset()
    o, l = torch.empty(2, 4, 8), torch.empty(2, 4)
    torch.compile(lambda o, l: gvr.merge_states(a, la, b, lb, out=o, lse=l), fullgraph=True, backend="aot_eager")(o, l)
    assert torch.equal(o, eo) and torch.equal(l, el)
    o2 = torch.empty(2, 4, 8)
    r = torch.compile(lambda o: gvr.merge_states(a, la, b, lb, out=o), fullgraph=True, backend="aot_eager")(o2)
    assert torch.equal(o2, eo) and torch.equal(r[1], el)


def test_compiled_calls_on_inputs_that_require_grad_and_missed_out():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 16, generator=g, requires_grad=True)
    K = torch.randn(16, 8, 2, 16, generator=g)
    idx = torch.tensor([[[0, 5, 9]], [[3, -1, 12]]], dtype=torch.int32)
    want = gvr.sparse_attention(q, K, K, idx)  # eager: reads the values (the ops have no gradient)
    torch._dynamo.reset()
    got = torch.compile(lambda q: gvr.sparse_attention(q, K, K, idx), fullgraph=True, backend="aot_eager")(q)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    sel = torch.tensor([[[1, 2, 3]], [[4, 5, -1]]], dtype=torch.int32)
    pred = torch.tensor([[[2]], [[9]]], dtype=torch.int32)
    out = torch.full((2, 1, 3), 7, dtype=torch.int32)
    torch.compile(lambda s, p, o: gvr.prr.missed(s, p, out=o), fullgraph=True, backend="aot_eager")(sel, pred, out)
    assert torch.equal(out, gvr.prr.missed(sel, pred))  # (out= was ignored under compile)
