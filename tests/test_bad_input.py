"""Every documented error of gvr.topk_decode: exception type, the argument named in the message,
and no input (nor ``out``) modified by the failed call.

Fake device tensors (CUDA / ROCm / Vulkan DLPack producers with NULL or bogus data pointers) run
in a child interpreter (conftest.run_isolated): if the library dereferences such a pointer the
child dies and the test fails with the signal, instead of the whole session crashing."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
from conftest import FakeDLPack, kDLCUDA, kDLROCM, kDLVulkan, may_have_gpu, run_isolated
from reference import same_bits

topk = gvr.topk_decode
F32, I32 = np.float32, np.int32
B, N, K = 3, 50, 5
SENTINEL = -7777


def _scores(b=B, n=N, seed=0):
    return np.random.default_rng(seed).standard_normal((b, n), dtype=F32)


def _name_re(name):
    return r"\bk\b" if name == "k" else rf"\b{re.escape(name)}\b"


def _snapshot(obj):
    """(object, a copy of what must stay unchanged); for a view, the whole base buffer."""
    if isinstance(obj, np.ndarray):
        owner = obj
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        return (obj, owner, owner.copy())
    return None


def expect_error(exc, name, scores, k, **kw):
    """Call topk_decode, expect ``exc`` whose message names ``name``; nothing is modified."""
    snaps = [_snapshot(scores)] + [_snapshot(v) for v in kw.values()]
    with pytest.raises(exc, match=_name_re(name)) as ei:
        topk(scores, k, **kw)
    for s in snaps:
        if s is not None:
            _, owner, copy = s
            assert same_bits(owner, copy), f"an input was modified by a failed call ({exc.__name__} {name})"
    if isinstance(kw.get("out"), np.ndarray) and kw["out"].dtype == I32:
        assert np.all(kw["out"] == SENTINEL), "out was written by a failed call"
    return ei


def _out(shape=(B, K), dtype=I32):
    return np.full(shape, SENTINEL, dtype=dtype)


NON_BUFFERS = [
    pytest.param(lambda: [[1.0] * N] * B, id="list"),
    pytest.param(lambda: {"a": 1}, id="dict"),
    pytest.param(lambda: object(), id="object"),
    pytest.param(lambda: "scores", id="str"),
]

# --------------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.uint32, np.int16])
def test_scores_dtype(dtype):
    x = _scores().astype(dtype)
    ei = expect_error(TypeError, "scores", x, K, prev_topk=np.zeros((B, K), I32), out=_out())
    msg = str(ei.value)
    assert "float32, float16 or bfloat16" in msg, msg


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _scores().reshape(B, 5, 10), id="3d"),
        pytest.param(lambda: np.array(1.0, F32), id="0d"),
        pytest.param(lambda: np.zeros((B, 2 * N), F32)[:, ::2], id="inner_stride_2"),
        pytest.param(lambda: np.zeros((2 * N,), F32)[::2], id="inner_stride_1d"),
        pytest.param(lambda: np.asfortranarray(_scores(4, 6)), id="fortran"),
        pytest.param(lambda: _scores()[:, ::-1], id="inner_stride_neg"),
    ],
)
def test_scores_shape_and_stride(make):
    x = make()
    expect_error(ValueError, "scores", x, K)


@pytest.mark.parametrize("make", NON_BUFFERS + [pytest.param(lambda: None, id="None"),
                                                pytest.param(lambda: 3.0, id="float")])
def test_scores_not_a_buffer(make):
    expect_error(TypeError, "scores", make(), K, out=_out())


# --------------------------------------------------------------------------------------------
# k
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [-1, -2048, np.int64(-1), np.int32(-5)], ids=repr)
def test_k_negative(k):
    x = _scores()
    expect_error(ValueError, "k", x, k, out=_out())


@pytest.mark.parametrize("k", [1.5, 2.0, "3", None, True, False, np.True_, np.float32(2.0), np.float64(3.0), [3]],
                         ids=repr)
def test_k_wrong_type(k):
    x = _scores()
    expect_error(TypeError, "k", x, k, out=_out())


# --------------------------------------------------------------------------------------------
# prev_topk
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.int16, np.uint32])
def test_prev_topk_dtype(dtype):
    expect_error(TypeError, "prev_topk", _scores(), K, prev_topk=np.zeros((B, K), dtype), out=_out())


@pytest.mark.parametrize(
    "shape", [(B + 1, K), (B - 1, K), (1, K), (B, 1, K), (1, 1, K)], ids=lambda s: "x".join(map(str, s))
)
def test_prev_topk_shape(shape):
    expect_error(ValueError, "prev_topk", _scores(), K, prev_topk=np.zeros(shape, I32), out=_out())


@pytest.mark.parametrize("make", NON_BUFFERS)
def test_prev_topk_not_a_buffer(make):
    expect_error(TypeError, "prev_topk", _scores(), K, prev_topk=make(), out=_out())


# --------------------------------------------------------------------------------------------
# lengths
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.uint32, np.int16])
def test_lengths_dtype(dtype):
    expect_error(TypeError, "lengths", _scores(), K, lengths=np.full(B, 3, dtype), out=_out())


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.full(B + 1, 3, I32), id="B+1"),
        pytest.param(lambda: np.full(B - 1, 3, I32), id="B-1"),
        pytest.param(lambda: np.full((B, 1), 3, I32), id="2d"),
        pytest.param(lambda: np.full((1, B), 3, I32), id="2d_row"),
        pytest.param(lambda: np.array(3, I32), id="0d"),
    ],
)
def test_lengths_shape(make):
    expect_error(ValueError, "lengths", _scores(), K, lengths=make(), out=_out())


@pytest.mark.parametrize("bad", [-1, N + 1, np.iinfo(I32).min, np.iinfo(I32).max])
def test_lengths_values(bad):
    lengths = np.array([N, bad, 0], I32)
    expect_error(ValueError, "lengths", _scores(), K, lengths=lengths, out=_out(),
                 prev_topk=np.zeros((B, K), I32))


@pytest.mark.parametrize("make", NON_BUFFERS)
def test_lengths_not_a_buffer(make):
    expect_error(TypeError, "lengths", _scores(), K, lengths=make(), out=_out())


# --------------------------------------------------------------------------------------------
# out
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.uint32, np.int16])
def test_out_dtype(dtype):
    out = np.full((B, K), 3, dtype)
    keep = out.copy()
    expect_error(TypeError, "out", _scores(), K, out=out)
    assert same_bits(out, keep)


@pytest.mark.parametrize("shape", [(B, K + 1), (B, K - 1), (B + 1, K), (K,), (B, K, 1), (B * K,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_out_shape(shape):
    expect_error(ValueError, "out", _scores(), K, out=_out(shape))


def test_out_shape_one_d_scores():
    x = _scores()[0].copy()
    expect_error(ValueError, "out", x, K, out=_out((1, K)))
    expect_error(ValueError, "out", x, K, out=_out((K + 1,)))


def test_out_read_only():
    out = _out()
    out.setflags(write=False)
    expect_error(ValueError, "out", _scores(), K, out=out)
    assert np.all(out == SENTINEL)


def test_out_inner_stride():
    big = np.full((B, 2 * K), SENTINEL, I32)
    out = big[:, ::2]
    expect_error(ValueError, "out", _scores(), K, out=out)
    assert np.all(big == SENTINEL)
    fortran = np.asfortranarray(np.full((4, 6), SENTINEL, I32))
    expect_error(ValueError, "out", _scores(4, N), 6, out=fortran)


@pytest.mark.parametrize("make", NON_BUFFERS)
def test_out_not_a_buffer(make):
    expect_error(TypeError, "out", _scores(), K, out=make())


def test_error_does_not_touch_other_arguments():
    """A late error (the last argument is bad) leaves out, prev_topk and lengths untouched."""
    x = _scores()
    prev = np.arange(B * K, dtype=I32).reshape(B, K)
    lengths = np.array([N, 1, 0], I32)
    out = _out()
    expect_error(ValueError, "out", x, K, prev_topk=prev, lengths=lengths, out=_out((B, K + 2)))
    expect_error(ValueError, "lengths", x, K, prev_topk=prev, lengths=np.array([N, N + 1, 0], I32), out=out)
    assert np.all(out == SENTINEL)


# --------------------------------------------------------------------------------------------
# devices (fake DLPack producers; run isolated)
# --------------------------------------------------------------------------------------------


def _cuda_fake(shape, dtype, data=None, device=(kDLCUDA, 0)):
    # NULL deleter: these tests are about device checks; ownership is covered in test_dlpack.py
    return FakeDLPack(shape=shape, dtype=dtype, data=data, device=device, null_deleter=True)


_BOGUS = 0xDEAD0000


def _expect_device_error(excs, name, call):
    with pytest.raises(excs) as ei:
        call()
    msg = str(ei.value)
    if name is not None:
        assert re.search(_name_re(name), msg), f"message does not name {name!r}: {msg!r}"
    return msg


def _iso_mixed_out_cuda():
    x = _scores()
    x0 = x.copy()
    for data in (None, _BOGUS):
        fake = _cuda_fake((B, K), I32, data)
        msg = _expect_device_error(ValueError, "out", lambda: topk(x, K, out=fake))
        assert re.search("device", msg, re.I), msg
        fake.assert_ownership_ok()
    assert same_bits(x, x0)


def _iso_mixed_scores_cuda():
    for data in (None, _BOGUS):
        fake = _cuda_fake((B, N), F32, data)
        out = _out()
        msg = _expect_device_error(ValueError, None, lambda: topk(fake, K, out=out))
        assert re.search("device", msg, re.I), msg
        assert np.all(out == SENTINEL)
        fake.assert_ownership_ok()
        # everything on the (fake) GPU except lengths; out given (a foreign CUDA producer has no
        # framework to allocate an output in)
        lengths = np.full(B, N, I32)
        fo = _cuda_fake((B, K), I32, data)
        msg = _expect_device_error(ValueError, "lengths", lambda: topk(fake, K, lengths=lengths, out=fo))
        assert re.search("device", msg, re.I), msg
        prev = np.zeros((B, K), I32)
        msg = _expect_device_error(ValueError, "prev_topk", lambda: topk(fake, K, prev_topk=prev, out=fo))
        assert re.search("device", msg, re.I), msg


def _iso_mixed_prev_and_lengths_cuda():
    x = _scores()
    for data in (None, _BOGUS):
        fp = _cuda_fake((B, K), I32, data)
        msg = _expect_device_error(ValueError, "prev_topk", lambda: topk(x, K, prev_topk=fp))
        assert re.search("device", msg, re.I), msg
        fl = _cuda_fake((B,), I32, data)
        msg = _expect_device_error(ValueError, "lengths", lambda: topk(x, K, lengths=fl))
        assert re.search("device", msg, re.I), msg
        fp.assert_ownership_ok()
        fl.assert_ownership_ok()


def _iso_cuda_only():
    for data in (None, _BOGUS):
        fake = _cuda_fake((B, N), F32, data)
        fo = _cuda_fake((B, K), I32, data)
        fl = _cuda_fake((B,), I32, data)
        fp = _cuda_fake((B, K), I32, data)
        _expect_device_error((RuntimeError, ValueError), None, lambda: topk(fake, K, out=fo))
        _expect_device_error((RuntimeError, ValueError), None,
                             lambda: topk(fake, K, out=fo, lengths=fl, prev_topk=fp, sorted=True))
        fake.assert_ownership_ok()


def _iso_unsupported_devices():
    x = _scores()
    for dev in (kDLROCM, kDLVulkan):
        fake = _cuda_fake((B, N), F32, None, device=(dev, 0))
        _expect_device_error((ValueError, TypeError), "scores", lambda: topk(fake, K))
        fake.assert_ownership_ok()
        fo = _cuda_fake((B, K), I32, None, device=(dev, 0))
        _expect_device_error((ValueError, TypeError), "out", lambda: topk(x, K, out=fo))
        fo.assert_ownership_ok()
        fp = _cuda_fake((B, K), I32, None, device=(dev, 0))
        _expect_device_error((ValueError, TypeError), "prev_topk", lambda: topk(x, K, prev_topk=fp))
        fl = _cuda_fake((B,), I32, None, device=(dev, 0))
        _expect_device_error((ValueError, TypeError), "lengths", lambda: topk(x, K, lengths=fl))


def test_mixed_devices_out_on_cuda():
    run_isolated("test_bad_input", "_iso_mixed_out_cuda")


def test_mixed_devices_scores_on_cuda():
    run_isolated("test_bad_input", "_iso_mixed_scores_cuda")


def test_mixed_devices_prev_topk_and_lengths_on_cuda():
    run_isolated("test_bad_input", "_iso_mixed_prev_and_lengths_cuda")


def test_cuda_only_call_without_gpu():
    if may_have_gpu():
        pytest.skip("a real GPU may be present: a fake CUDA pointer could be launched on")
    run_isolated("test_bad_input", "_iso_cuda_only")


def test_unsupported_device_types():
    run_isolated("test_bad_input", "_iso_unsupported_devices")


def _iso_cuda_stream_handshake():
    # the DLPack stream each CUDA producer is handed: the consumer stream (the legacy default stream
    # 0 as 1), or -1 (no synchronization) for arguments whose producer runs on that stream (the
    # `nosync` bits gvr.topk_decode sets for torch tensors on torch's current stream). float64
    # scores are rejected after the hand-shake, before anything runs on a device.
    from gvr import _C

    for nosync, stream, want in ((0, 123, 123), (1, 123, -1), (0, 0, 1), (2, 77, 77)):
        fake = _cuda_fake((B, N), np.float64)
        with pytest.raises(TypeError, match="scores"):
            _C.topk_decode(fake, K, None, None, None, False, stream, "auto", nosync)
        assert [c["stream"] for c in fake.calls] == [want], (nosync, stream, fake.calls)
        fake.assert_ownership_ok()
    for bad in (-1, 128, 1 << 70, "1", 1.0, True):  # 7 arguments: bits 0..6
        fake = _cuda_fake((B, N), np.float32)
        with pytest.raises(ValueError, match="nosync"):
            _C.topk_decode(fake, K, None, None, None, False, 5, "auto", bad)
        assert fake.calls == [], "rejected before any buffer is taken"


def test_cuda_stream_handshake():
    run_isolated("test_bad_input", "_iso_cuda_stream_handshake")


def test_bad_method_and_stream_named_and_nothing_written():
    x = np.random.default_rng(1).standard_normal((2, 50)).astype(np.float32)
    x0 = x.copy()
    out = np.full((2, 4), -7, np.int32)
    with pytest.raises(ValueError, match="method"):
        gvr.topk_decode(x, 4, out=out, method="fastest")
    with pytest.raises(TypeError, match="method"):
        gvr.topk_decode(x, 4, out=out, method=3)
    with pytest.raises(TypeError, match="stream"):
        gvr.topk_decode(x, 4, out=out, stream="default")
    for bad in (-1, -2):
        with pytest.raises(ValueError, match="stream"):
            gvr.topk_decode(x, 4, out=out, stream=bad)
    assert np.array_equal(x, x0) and (out == -7).all()


# --------------------------------------------------------------------------------------------
# messages: what was expected and what was got; scalars' types; limits from gvr_kernels.h
# --------------------------------------------------------------------------------------------


def test_out_shape_message_says_what_it_got():
    with pytest.raises(ValueError) as ei:
        topk(_scores(), K, out=_out((B, K + 1)))
    assert f"'out' must have shape [{B}, {K}], got [{B}, {K + 1}]" in str(ei.value), str(ei.value)
    with pytest.raises(ValueError) as ei:
        topk(_scores()[0].copy(), K, out=_out((1, K)))
    assert f"'out' must have shape [{K}]" in str(ei.value) and f"got [1, {K}]" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("bad", ["yes", "", 1, 0, None, 1.0, [True]], ids=repr)
def test_sorted_must_be_a_bool(bad):
    """sorted="yes" used to be silently truthy: gvr._C takes a Python bool or numpy.bool_."""
    from gvr import _C

    x = _scores()
    out = _out()
    with pytest.raises(TypeError, match=r"'sorted' must be a bool, got " + type(bad).__name__):
        _C.topk_decode(x, K, None, None, out, bad)
    if bad is not None:  # the wrapper's default stands for None
        expect_error(TypeError, "sorted", x, K, out=out, sorted=bad)
    assert np.all(out == SENTINEL)
    for ok in (True, False, np.True_, np.False_):
        _C.topk_decode(x, K, None, None, out, ok)


def test_host_inputs_ignore_stream():
    """stream= is the CUDA stream of a call on CUDA buffers; a host call accepts it and ignores it."""
    x = _scores()
    assert np.array_equal(topk(x, K, stream=12345), topk(x, K))


def _iso_cuda_limits_from_the_abi_header():
    # checked before the CUDA library loads (or anything launches): no GPU needed
    from gvr import _C

    lim = gvr.build_info()["limits"]
    big_k = lim["topk_sorted_max_k"] + 1
    fake = _cuda_fake((1, 2 * big_k), F32, _BOGUS)
    fo = _cuda_fake((1, big_k), I32, _BOGUS + (1 << 32))
    with pytest.raises(ValueError, match=rf"'sorted=True' on CUDA supports k <= {lim['topk_sorted_max_k']}\b"):
        _C.topk_decode(fake, big_k, None, None, fo, True)
    n = lim["radix_max_positions"] + 1
    fake = _cuda_fake((1, n), F32, _BOGUS)
    fo = _cuda_fake((1, 8), I32, _BOGUS + (1 << 32))
    with pytest.raises(ValueError, match="exceed the radix path") as ei:
        _C.topk_decode(fake, 8, None, None, fo, False, 0, "radix")
    msg = str(ei.value)
    assert str(lim["radix_max_positions"]) in msg and str(lim["radix_max_positions"] - 3) in msg, msg
    n = lim["topk_max_n"] + 1
    fake = _cuda_fake((1, n), F32, _BOGUS)
    fo = _cuda_fake((1, 8), I32, _BOGUS + (1 << 40))  # past the 4 GiB of scores
    with pytest.raises(ValueError, match=rf"at most {lim['topk_max_n']} scores"):
        _C.topk_decode(fake, 8, None, None, fo, False)


def test_cuda_limits_from_the_abi_header():
    run_isolated("test_bad_input", "_iso_cuda_limits_from_the_abi_header")


def test_page_table_arguments():
    x = _scores()
    bt = np.zeros((B, 4), I32)
    expect_error(ValueError, "page_size", x, K, block_table=bt)  # missing
    expect_error(ValueError, "page_size", x, K, block_table=bt, page_size=0)
    expect_error(TypeError, "page_size", x, K, block_table=bt, page_size=16.0)
    expect_error(ValueError, "page_size", x, K, page_size=16)  # without a table
    expect_error(ValueError, "out_positions", x, K, out_positions=_out())  # without a table
    expect_error(ValueError, "block_table", x, K, block_table=bt, page_size=12)  # 4 * 12 < N = 50
    expect_error(TypeError, "block_table", x, K, block_table=bt.astype(np.int64), page_size=16)
    expect_error(ValueError, "block_table", x, K, block_table=np.zeros((B + 1, 4), I32), page_size=16)
    expect_error(ValueError, "block_table", x, K, block_table=np.zeros(4, I32), page_size=16)  # 1-D for 2-D
    expect_error(ValueError, "out_positions", x, K, block_table=bt, page_size=16, out_positions=_out((B, K + 1)))
    expect_error(TypeError, "out_positions", x, K, block_table=bt, page_size=16, out_positions=_out(dtype=np.int64))
