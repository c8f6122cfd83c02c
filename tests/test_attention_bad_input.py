"""Every documented error of gvr.sparse_attention, gvr.merge_states(_in_place) and gvr.prr.repair /
missed / finalize: the exception type, the argument named in the message, and nothing passed in
(outputs included) modified by the failed call. The CUDA-only limits (D, GQA, float32 q, mixed
devices) are GPU tests, skipped one by one where they cannot run."""
from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
from harness import torch_or_none
from reference import same_bits

torch = torch_or_none()
F32, F16, I32 = np.float32, np.float16, np.int32
B, HQ, HKV, D, P, NP, MAXP, N = 2, 4, 2, 16, 4, 6, 3, 3
SENTINEL = 7.0


def _name_re(name):
    return rf"\b{re.escape(name)}\b"


def _owner(a):
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return a


def _snapshot(obj):
    if isinstance(obj, np.ndarray):
        owner = _owner(obj)
        return owner, owner.copy()
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj, obj.detach().cpu().clone()
    return None


def _same(a, b):
    if isinstance(a, np.ndarray):
        return same_bits(a, b)
    return bool(torch.equal(a.detach().cpu(), b))  # (no NaN in these tests' inputs)


def _flatten(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _flatten(v)
        else:
            yield v


def expect_error(exc, name, fn, *args, **kw):
    """Call fn, expect ``exc`` whose message names ``name``; nothing passed in is modified."""
    snaps = [s for s in (_snapshot(v) for v in _flatten(list(args) + list(kw.values()))) if s is not None]
    with pytest.raises(exc, match=_name_re(name)) as ei:
        fn(*args, **kw)
    for obj, copy in snaps:
        assert _same(obj, copy), f"an argument was modified by a failed call ({exc.__name__} naming {name})"
    return ei


def problem(dtype=F32, paged=True):
    """(q, k, v, indices, kwargs) of a small valid call."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, HQ, D)).astype(dtype)
    kv = rng.standard_normal((2, NP, P, HKV, D)).astype(dtype)
    idx = np.array([[[0, 2, -1]], [[1, 5, 2]]], I32)
    kw = {}
    if paged:
        kw = dict(block_table=np.array([[3, 1, 0], [5, 2, 4]], I32), lengths=np.array([9, 12], I32), block_size=4)
    return q, kv[0], kv[1], idx, kw


def outputs(dtype=F32):
    return np.full((B, HQ, D), SENTINEL, dtype), np.full((B, HQ), SENTINEL, F32)


def attn(*args, **kw):
    return gvr.sparse_attention(*args, **kw)


def test_valid_problem_runs():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    gvr.sparse_attention(q, k, v, idx, out=out, lse=lse, **kw)
    assert np.isfinite(lse).all()
    q, k, v, idx, kw = problem(paged=False)
    gvr.sparse_attention(q, k, v, idx)


# --------------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8])
def test_q_dtype(dtype):
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(TypeError, "q", attn, q.astype(dtype), k, v, idx, out=out, lse=lse, **kw)


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_cache_dtype_mixed_with_q(which):
    q, k, v, idx, kw = problem()
    if which == "k_cache":
        k = k.astype(F16)
    else:
        v = v.astype(np.float64)
    out, lse = outputs()
    expect_error(TypeError, which, attn, q, k, v, idx, out=out, lse=lse, **kw)


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.float32, np.int16])
def test_indices_dtype(dtype):
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(TypeError, "indices", attn, q, k, v, idx.astype(dtype), out=out, lse=lse, **kw)


@pytest.mark.parametrize("name", ["block_table", "lengths"])
def test_table_and_lengths_dtype(name):
    q, k, v, idx, kw = problem()
    kw[name] = kw[name].astype(np.int64)
    out, lse = outputs()
    expect_error(TypeError, name, attn, q, k, v, idx, out=out, lse=lse, **kw)


def test_out_and_lse_dtype():
    q, k, v, idx, kw = problem(F16)
    out, lse = outputs()
    with pytest.raises((TypeError, ValueError), match=_name_re("out")):
        attn(q, k, v, idx, out=np.zeros((B, HQ, D), np.float64), lse=lse, **kw)
    with pytest.raises((TypeError, ValueError), match=_name_re("lse")):
        attn(q, k, v, idx, out=out, lse=np.zeros((B, HQ), np.float64), **kw)
    assert np.all(lse == SENTINEL) and np.all(out == SENTINEL)


@pytest.mark.skipif(torch is None, reason="needs torch (bfloat16)")
def test_out_neither_q_dtype_nor_float32():
    q, k, v, idx, kw = problem()
    tq, tk, tv = (torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v))
    tkw = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out = torch.full((B, HQ, D), SENTINEL, dtype=torch.float16)
    lse = torch.full((B, HQ), SENTINEL)
    expect_error(ValueError, "out", attn, tq, tk, tv, torch.from_numpy(idx), out=out, lse=lse, **tkw)


# --------------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------------


def test_q_not_3d():
    q, k, v, idx, kw = problem()
    expect_error(ValueError, "q", attn, q[:, 0], k, v, idx, **kw)
    expect_error(ValueError, "q", attn, q[None], k, v, idx, **kw)


def test_cache_head_dim_mismatch():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(ValueError, "k_cache", attn, q, k[..., :8], v, idx, out=out, lse=lse, **kw)
    expect_error(ValueError, "v_cache", attn, q, k, v[..., :8], idx, out=out, lse=lse, **kw)


def test_cache_not_4d_or_k_v_shapes_differ():
    q, k, v, idx, kw = problem()
    expect_error(ValueError, "k_cache", attn, q, k[0], v, idx, **kw)
    expect_error(ValueError, "v_cache", attn, q, k, v[:, :2], idx, **kw)
    expect_error(ValueError, "v_cache", attn, q, k, v[:3], idx, **kw)


def test_hq_not_a_multiple_of_hkv():
    q, k, v, idx, kw = problem()
    kv = np.zeros((2, NP, P, 3, D), F32)
    out, lse = outputs()
    ei = expect_error(ValueError, "k_cache", attn, q, kv[0], kv[1], idx, out=out, lse=lse, **kw)
    assert "Hq" in str(ei.value) and re.search(_name_re("q"), str(ei.value))


def test_hsel_not_one_or_hkv():
    q, k, v, idx, kw = problem()
    kv = np.zeros((2, NP, P, 4, D), F32)  # Hkv = 4 (GQA 1), Hsel = 2
    out, lse = outputs()
    expect_error(ValueError, "indices", attn, q, kv[0], kv[1], np.zeros((B, 2, N), I32), out=out, lse=lse, **kw)
    expect_error(ValueError, "indices", attn, q, k, v, np.zeros((B, 3, N), I32), out=out, lse=lse, **kw)


def test_indices_shape():
    q, k, v, idx, kw = problem()
    expect_error(ValueError, "indices", attn, q, k, v, idx[:, 0], **kw)
    expect_error(ValueError, "indices", attn, q, k, v, idx[:1], **kw)  # B mismatch


def test_block_table_rows_and_lengths_length():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    bad = dict(kw, block_table=kw["block_table"][:1])
    expect_error(ValueError, "block_table", attn, q, k, v, idx, out=out, lse=lse, **bad)
    bad = dict(kw, block_table=kw["block_table"][:, 0])
    expect_error(ValueError, "block_table", attn, q, k, v, idx, out=out, lse=lse, **bad)
    bad = dict(kw, lengths=np.array([3, 4, 5], I32))
    expect_error(ValueError, "lengths", attn, q, k, v, idx, out=out, lse=lse, **bad)
    bad = dict(kw, lengths=np.array([[3, 4]], I32))
    expect_error(ValueError, "lengths", attn, q, k, v, idx, out=out, lse=lse, **bad)


def test_out_lse_shapes():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(ValueError, "out", attn, q, k, v, idx, out=out[:, :2], lse=lse, **kw)
    expect_error(ValueError, "lse", attn, q, k, v, idx, out=out, lse=lse[:1], **kw)
    expect_error(ValueError, "lse", attn, q, k, v, idx, out=out, lse=lse.T.copy(), **kw)


def test_partials_shapes_and_pair():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    po, pl = np.full((B, HQ, N, D), SENTINEL, F32), np.full((B, HQ, N), SENTINEL, F32)
    expect_error(ValueError, "part_out", attn, q, k, v, idx, out=out, lse=lse, partials=(po[:, :, :2], pl), **kw)
    expect_error(ValueError, "part_lse", attn, q, k, v, idx, out=out, lse=lse, partials=(po, pl[:, :, :2]), **kw)
    expect_error((TypeError, ValueError), "part_out", attn, q, k, v, idx, out=out, lse=lse,
                 partials=(po.astype(F16), pl), **kw)
    expect_error(TypeError, "partials", attn, q, k, v, idx, out=out, lse=lse, partials=po, **kw)
    expect_error(TypeError, "partials", attn, q, k, v, idx, out=out, lse=lse, partials=(po, pl, pl), **kw)


# --------------------------------------------------------------------------------------------------
# block_size, block_table, lengths
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [3, 6, 10, 5])
def test_block_size_not_a_divisor_or_multiple_of_p(G):
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(ValueError, "block_size", attn, q, k, v, idx, out=out, lse=lse, **dict(kw, block_size=G))


@pytest.mark.parametrize("G", [0, -1, -4])
def test_block_size_not_positive(G):
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(ValueError, "block_size", attn, q, k, v, idx, out=out, lse=lse, **dict(kw, block_size=G))


@pytest.mark.parametrize("G", [1.0, "4", True])
def test_block_size_type(G):
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(TypeError, "block_size", attn, q, k, v, idx, out=out, lse=lse, **dict(kw, block_size=G))


def test_block_size_without_block_table():
    q, k, v, idx, _ = problem(paged=False)
    out, lse = outputs()
    expect_error(ValueError, "block_size", attn, q, k, v, idx, out=out, lse=lse, block_size=4)


def test_lengths_without_block_table():
    q, k, v, idx, _ = problem(paged=False)
    out, lse = outputs()
    expect_error(ValueError, "lengths", attn, q, k, v, idx, out=out, lse=lse, lengths=np.array([1, 2], I32))


@pytest.mark.parametrize("bad", [[-1, 4], [4, 13], [2**31 - 1, 0], [-(2**31), 0]])
def test_lengths_out_of_range_on_cpu(bad):
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    ei = expect_error(ValueError, "lengths", attn, q, k, v, idx, out=out, lse=lse, **dict(kw, lengths=np.array(bad, I32)))
    assert "12" in str(ei.value)  # the bound max_pages * P


# --------------------------------------------------------------------------------------------------
# strides
# --------------------------------------------------------------------------------------------------


def test_non_unit_stride_along_d():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    q2 = np.repeat(q, 2, axis=2)[:, :, ::2]
    k2 = np.repeat(k, 2, axis=3)[..., ::2]
    v2 = np.repeat(v, 2, axis=3)[..., ::2]
    expect_error(ValueError, "q", attn, q2, k, v, idx, out=out, lse=lse, **kw)
    expect_error(ValueError, "k_cache", attn, q, k2, v, idx, out=out, lse=lse, **kw)
    expect_error(ValueError, "v_cache", attn, q, k, v2, idx, out=out, lse=lse, **kw)
    out2 = np.full((B, HQ, 2 * D), SENTINEL, F32)[:, :, ::2]
    expect_error(ValueError, "out", attn, q, k, v, idx, out=out2, lse=lse, **kw)
    idx2 = np.repeat(idx, 2, axis=2)[:, :, ::2]
    expect_error(ValueError, "indices", attn, q, k, v, idx2, out=out, lse=lse, **kw)


def test_scale_not_a_finite_number():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(ValueError, "scale", attn, q, k, v, idx, out=out, lse=lse, scale=float("nan"), **kw)
    expect_error(ValueError, "scale", attn, q, k, v, idx, out=out, lse=lse, scale=float("inf"), **kw)
    expect_error(TypeError, "scale", attn, q, k, v, idx, out=out, lse=lse, scale="0.5", **kw)


# --------------------------------------------------------------------------------------------------
# repair, merge, missed, finalize
# --------------------------------------------------------------------------------------------------


def test_repair_out_not_float32():
    q, k, v, idx, kw = problem(F16)
    out = np.full((B, HQ, D), SENTINEL, F16)
    lse = np.full((B, HQ), SENTINEL, F32)
    ei = expect_error(ValueError, "out", gvr.prr.repair, out, lse, q, k, v, idx, **kw)
    assert "float32" in str(ei.value)
    expect_error(TypeError, "out", gvr.prr.repair, None, lse, q, k, v, idx, **kw)


def test_repair_shapes():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    expect_error(ValueError, "out", gvr.prr.repair, out[:1], lse, q, k, v, idx, **kw)
    expect_error(ValueError, "lse", gvr.prr.repair, out, lse[:, :2], q, k, v, idx, **kw)
    expect_error(ValueError, "block_size", gvr.prr.repair, out, lse, q, k, v, idx, **dict(kw, block_size=3))


def _state(shape=(B, HQ, D), dtype=F32, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape[:-1]).astype(F32)


def test_merge_mismatched_shapes():
    oa, la = _state()
    ob, lb = _state((B, HQ, 8))
    expect_error(ValueError, "out_b", gvr.merge_states, oa, la, ob, lb[:, :HQ])
    ob, lb = _state((B, HQ + 1, D))
    with pytest.raises(ValueError, match=r"\bout_b\b|\blse_b\b"):
        gvr.merge_states(oa, la, ob, lb)
    ob, lb = _state()
    expect_error(ValueError, "lse_a", gvr.merge_states, oa, la[:, :2], ob, lb)
    expect_error(ValueError, "lse_b", gvr.merge_states, oa, la, ob, lb[:1])
    out, lse = np.full((B, HQ, D), SENTINEL, F32), np.full((B, HQ), SENTINEL, F32)
    expect_error(ValueError, "out", gvr.merge_states, oa, la, ob, lb, out=out[:, :1], lse=lse)
    expect_error(ValueError, "lse", gvr.merge_states, oa, la, ob, lb, out=out, lse=lse[:1])
    expect_error(ValueError, "out_b", gvr.merge_states_in_place, oa, la, ob[:1], lb[:1])


def test_merge_dtypes():
    oa, la = _state()
    ob, lb = _state()
    expect_error(TypeError, "lse_a", gvr.merge_states, oa, la.astype(np.float64), ob, lb)
    expect_error(TypeError, "out_a", gvr.merge_states, oa.astype(np.float64), la, ob, lb)
    expect_error(TypeError, "out_b", gvr.merge_states, oa, la, ob.astype(np.int32), lb)


@pytest.mark.parametrize("base", ["10", "E", "", "two", 2, None, 2.0])
def test_merge_lse_base(base):
    oa, la = _state()
    ob, lb = _state()
    exc = ValueError if isinstance(base, str) else TypeError
    expect_error(exc, "lse_base", gvr.merge_states, oa, la, ob, lb, lse_base=base)
    expect_error(exc, "lse_base", gvr.merge_states_in_place, oa, la, ob, lb, lse_base=base)


def test_missed_errors():
    sel = np.array([[[1, 2, 3], [4, 5, 6]]], I32)
    pred = np.array([[[1], [2], [3]]], I32)  # Hp = 3: neither 1 nor H = 2
    expect_error(ValueError, "predicted", gvr.prr.missed, sel, pred)
    expect_error(TypeError, "selected", gvr.prr.missed, sel.astype(np.int64), pred[:, :1])
    expect_error(TypeError, "predicted", gvr.prr.missed, sel, pred[:, :1].astype(np.int64))
    expect_error(ValueError, "predicted", gvr.prr.missed, sel, np.zeros((2, 1, 3), I32))  # B mismatch
    out = np.full((1, 2, 2), 9, I32)
    expect_error(ValueError, "out", gvr.prr.missed, sel, pred[:, :1], out=out)
    expect_error(ValueError, "selected", gvr.prr.missed, sel[0], pred[:, :1])
    expect_error(TypeError, "counts", gvr.prr.missed, sel, pred[:, :1], counts=np.zeros(4, I32))
    expect_error(ValueError, "counts", gvr.prr.missed, sel, pred[:, :1], counts=np.zeros(3, np.int64))
    c = np.zeros(4, np.int64)
    expect_error(ValueError, "counts", gvr.prr.missed, sel, pred[:, :1], counts=c.reshape(2, 2))


def test_finalize_errors():
    po = np.zeros((B, HQ, N, D), F32)
    pl = np.zeros((B, HQ, N), F32)
    pred = np.zeros((B, 2, N), I32)
    sel = np.zeros((B, 2, 5), I32)
    expect_error(ValueError, "part_lse", gvr.prr.finalize, (po, pl[:, :, :2]), pred, sel)
    expect_error(ValueError, "predicted", gvr.prr.finalize, (po, pl), pred[:, :, :2], sel)
    expect_error(ValueError, "predicted", gvr.prr.finalize, (po, pl), np.zeros((B, 3, N), I32), np.zeros((B, 3, 5), I32))
    expect_error(ValueError, "selected", gvr.prr.finalize, (po, pl), pred, np.zeros((B, 1, 5), I32))
    expect_error(TypeError, "part_out", gvr.prr.finalize, (po.astype(F16), pl), pred, sel)
    expect_error(TypeError, "partials", gvr.prr.finalize, po, pred, sel)


def test_finalize_part_lse_strided_is_honoured_or_refused():
    # part_lse with a non-unit stride along n_pred: correct values, or a ValueError naming it
    rng = np.random.default_rng(3)
    po = rng.standard_normal((1, 2, 4, D)).astype(F32)
    pl_c = rng.standard_normal((1, 2, 4)).astype(F32)
    pl = np.ascontiguousarray(pl_c.transpose(2, 0, 1)).transpose(1, 2, 0)  # strides (2, 1, 2)
    pred = np.array([[[0, 1, 2, 3]]], I32)
    sel = np.array([[[1, 3]]], I32)
    want = gvr.prr.finalize((po, pl_c), pred, sel)
    try:
        got = gvr.prr.finalize((po, pl), pred, sel)
    except ValueError as e:
        assert "part_lse" in str(e)
        return
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_error_leaves_every_argument_untouched():
    q, k, v, idx, kw = problem()
    out, lse = outputs()
    po, pl = np.full((B, HQ, N, D), SENTINEL, F32), np.full((B, HQ, N), SENTINEL, F32)
    # an error found late (lengths' values are read last on the CPU)
    bad = dict(kw, lengths=np.array([1, 99], I32))
    expect_error(ValueError, "lengths", attn, q, k, v, idx, out=out, lse=lse, partials=(po, pl), **bad)
    assert np.all(out == SENTINEL) and np.all(lse == SENTINEL) and np.all(po == SENTINEL) and np.all(pl == SENTINEL)
    expect_error(ValueError, "lengths", gvr.prr.repair, out, lse, q, k, v, idx, **bad)
    assert np.all(out == SENTINEL) and np.all(lse == SENTINEL)


# --------------------------------------------------------------------------------------------------
# CUDA-only limits and mixed devices (GPU tests)
# --------------------------------------------------------------------------------------------------


def _cuda_problem(Dh=64, Hq=4, Hkv=2, dtype=None):
    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, Dh, generator=g).to("cuda", dtype)
    kv = torch.randn(2, NP, P, Hkv, Dh, generator=g).to("cuda", dtype)
    idx = torch.tensor([[[0, 2, -1]], [[1, 5, 2]]], dtype=torch.int32, device="cuda")
    return q, kv[0], kv[1], idx


@pytest.mark.gpu
def test_cuda_head_dim_96():
    q, k, v, idx = _cuda_problem(Dh=96)
    ei = expect_error(ValueError, "q", attn, q, k, v, idx)
    assert "96" in str(ei.value)


@pytest.mark.gpu
def test_cuda_gqa_32():
    q, k, v, idx = _cuda_problem(Hq=32, Hkv=1)
    ei = expect_error(ValueError, "Hq", attn, q, k, v, idx)
    assert "16" in str(ei.value)


@pytest.mark.gpu
def test_cuda_float32_q():
    q, k, v, idx = _cuda_problem(dtype=torch.float32)
    expect_error(ValueError, "q", attn, q, k, v, idx)


@pytest.mark.gpu
def test_mixed_devices():
    q, k, v, idx = _cuda_problem()
    expect_error(ValueError, "k_cache", attn, q, k.cpu(), v, idx)
    expect_error(ValueError, "v_cache", attn, q, k, v.cpu(), idx)
    expect_error(ValueError, "indices", attn, q, k, v, idx.cpu())
    bt = torch.zeros(B, 2, dtype=torch.int32)
    expect_error(ValueError, "block_table", attn, q, k, v, idx, block_table=bt)
    expect_error(ValueError, "lengths", attn, q, k, v, idx, block_table=bt.cuda(),
                 lengths=torch.tensor([1, 2], dtype=torch.int32))
    out = torch.zeros(B, 4, 64)
    expect_error(ValueError, "out", attn, q, k, v, idx, out=out)
    lse = torch.zeros(B, 4)
    expect_error(ValueError, "lse", attn, q, k, v, idx, lse=lse)
    expect_error(ValueError, "out", gvr.prr.repair, out, lse.cuda(), q, k, v, idx)
    oa, la = torch.zeros(B, 4, 64, device="cuda"), torch.zeros(B, 4, device="cuda")
    expect_error(ValueError, "out_b", gvr.merge_states, oa, la, oa.cpu(), la)
    expect_error(ValueError, "predicted", gvr.prr.missed, idx, idx.cpu())
    expect_error(ValueError, "k_cache", attn, q.cpu(), k, v, idx.cpu())
