"""DLPack intake and output of gvr.topk_decode on CPU: versioned / legacy capsules, ownership
(deleter exactly once, no leak), read-only flag, byte_offset / NULL strides, torch and cupy."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import gvr
from conftest import (
    DLPACK_FLAG_BITMASK_READ_ONLY,
    FakeDLPack,
    LegacyFakeDLPack,
    LegacyNumpyProducer,
    NumpyProducer,
    capsule_name,
    has_cuda,
    kDLFloat,
)
from reference import check_result, expected_result, same_bits

topk = gvr.topk_decode
F32 = np.float32


def _scores(B=3, n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal((B, n), dtype=F32)


def _max_version_ok(mv):
    return mv is not None and tuple(mv) >= (1, 0)


# --------------------------------------------------------------------------------------------
# a NumPy-backed producer (versioned)
# --------------------------------------------------------------------------------------------


def test_versioned_producer_scores():
    x = _scores()
    k = 37
    p = NumpyProducer(x)
    res = topk(p, k)
    assert isinstance(res, np.ndarray) and res.dtype == np.int32 and res.shape == (3, k)
    assert np.array_equal(res, topk(x, k))
    check_result(res, x, k)
    assert len(p.calls) == 1, f"__dlpack__ called {len(p.calls)} times: {p.calls}"
    kw = p.calls[0]
    assert _max_version_ok(kw.get("max_version")), kw
    assert kw.get("stream") is None, kw
    assert len(p.capsules) == 1
    assert capsule_name(p.capsules[0]) == b"used_dltensor_versioned"


def test_versioned_producer_every_argument():
    B, n, k = 4, 2000, 50
    x = _scores(B, n, 1)
    prev = topk(x, k)
    lengths = np.array([n, 3, 0, 1500], np.int32)
    out = np.full((B, k), -9, np.int32)
    ps = NumpyProducer(x)
    pp = NumpyProducer(prev)
    pl = NumpyProducer(lengths)
    po = NumpyProducer(out)
    r = topk(ps, k, prev_topk=pp, lengths=pl, out=po, sorted=True)
    assert r is po, "out= must be returned as the same object"
    assert np.array_equal(out, expected_result(x, k, lengths))
    for name, p in (("scores", ps), ("prev_topk", pp), ("lengths", pl), ("out", po)):
        assert len(p.calls) == 1, f"{name}: __dlpack__ called {len(p.calls)} times: {p.calls}"
        assert _max_version_ok(p.calls[0].get("max_version")), (name, p.calls[0])
        assert p.calls[0].get("stream") is None, (name, p.calls[0])
        assert p.calls[0].get("copy") is not True, (name, p.calls[0])
        assert [capsule_name(c) for c in p.capsules] == [b"used_dltensor_versioned"], name


def test_producer_one_d_and_strided():
    big = _scores(6, 1200, 2)
    x = big[::2, 5:1005]  # row-strided, misaligned start
    k = 64
    r = topk(NumpyProducer(x), k)
    check_result(r, x, k)
    assert np.array_equal(topk(NumpyProducer(x), k, sorted=True), expected_result(x, k))
    r1 = topk(NumpyProducer(np.ascontiguousarray(x[0])), k)
    assert r1.shape == (k,)
    check_result(r1, x[0], k)


def test_read_only_versioned_capsule():
    x = _scores(2, 500, 3)
    x.setflags(write=False)
    p = NumpyProducer(x)
    r = topk(p, 10)  # read-only scores are fine
    check_result(r, x, 10)
    out = np.full((2, 10), -3, np.int32)
    out.setflags(write=False)
    po = NumpyProducer(out)
    with pytest.raises(ValueError, match="out"):
        topk(_scores(2, 500, 3), 10, out=po)
    assert np.all(out == -3)


def test_read_only_flag_hand_built_out():
    x = _scores(2, 300, 4)
    backing = np.full((2, 8), -4, np.int32)
    fake = FakeDLPack(backing, flags=DLPACK_FLAG_BITMASK_READ_ONLY, legacy=False)
    with pytest.raises(ValueError, match="out"):
        topk(x, 8, out=fake)
    assert np.all(backing == -4)
    fake.assert_ownership_ok()


# --------------------------------------------------------------------------------------------
# a legacy-only producer
# --------------------------------------------------------------------------------------------


def test_legacy_producer_fallback():
    x = _scores(3, 800, 5)
    p = LegacyNumpyProducer(x)
    r = topk(p, 21)
    assert np.array_equal(r, topk(x, 21))
    assert [capsule_name(c) for c in p.capsules] == [b"used_dltensor"]
    assert len(p.calls) == 1


def test_legacy_producer_every_argument():
    B, n, k = 3, 900, 30
    x = _scores(B, n, 6)
    lengths = np.array([900, 0, 29], np.int32)
    prev = np.random.default_rng(0).integers(-5, n + 5, size=(B, k)).astype(np.int32)
    out = np.full((B, k), 7, np.int32)
    po = LegacyNumpyProducer(out)
    r = topk(LegacyNumpyProducer(x), k, prev_topk=LegacyNumpyProducer(prev),
             lengths=LegacyNumpyProducer(lengths), out=po, sorted=True)
    assert r is po
    assert np.array_equal(out, expected_result(x, k, lengths))


# --------------------------------------------------------------------------------------------
# ownership: the deleter runs exactly once, no leak
# --------------------------------------------------------------------------------------------


def _refcount_stable(arr, fn, reps=200):
    fn()  # warm-up (lazy imports, caches)
    gc.collect()
    base = sys.getrefcount(arr)
    for _ in range(reps):
        fn()
    gc.collect()
    return base, sys.getrefcount(arr)


@pytest.mark.parametrize("producer", [NumpyProducer, LegacyNumpyProducer])
def test_no_leak_scores(producer):
    x = _scores(2, 700, 7)
    base, after = _refcount_stable(x, lambda: topk(producer(x, keep_capsules=False), 9))
    assert after == base, f"refcount of the exported array went {base} -> {after} (deleter not called once)"


@pytest.mark.parametrize("producer", [NumpyProducer, LegacyNumpyProducer])
def test_no_leak_every_argument(producer):
    B, n, k = 2, 600, 9
    x = _scores(B, n, 8)
    prev = np.zeros((B, k), np.int32)
    lengths = np.array([600, 5], np.int32)
    out = np.empty((B, k), np.int32)

    def call():
        topk(producer(x, keep_capsules=False), k, prev_topk=producer(prev, keep_capsules=False),
             lengths=producer(lengths, keep_capsules=False), out=producer(out, keep_capsules=False))

    for arr in (x, prev, lengths, out):
        base, after = _refcount_stable(arr, call, reps=100)
        assert after == base, f"refcount {base} -> {after}"


def test_no_leak_on_error_after_intake():
    x64 = _scores(2, 300, 9).astype(np.float64)

    def call():
        with pytest.raises(TypeError, match="scores"):
            topk(NumpyProducer(x64, keep_capsules=False), 4)

    base, after = _refcount_stable(x64, call)
    assert after == base, f"refcount {base} -> {after}"

    x = _scores(2, 300, 9)
    bad_len = np.array([1, 2, 3], np.int32)  # wrong shape

    def call2():
        with pytest.raises(ValueError, match="lengths"):
            topk(NumpyProducer(x, keep_capsules=False), 4, lengths=NumpyProducer(bad_len, keep_capsules=False))

    for arr in (x, bad_len):
        base, after = _refcount_stable(arr, call2, reps=100)
        assert after == base, f"refcount {base} -> {after}"


@pytest.mark.parametrize("kind", ["versioned", "legacy", "legacy_signature"])
def test_hand_built_capsule_deleter_once(kind):
    x = _scores(3, 500, 10)
    if kind == "versioned":
        fake = FakeDLPack(x, legacy=False)
    elif kind == "legacy":
        fake = FakeDLPack(x, versioned=False)
    else:
        fake = LegacyFakeDLPack(x)
    r = topk(fake, 12)
    assert np.array_equal(r, topk(x, 12))
    gc.collect()
    expected_name = b"used_dltensor_versioned" if kind == "versioned" else b"used_dltensor"
    assert fake.names() == [expected_name], fake.names()
    fake.assert_ownership_ok(must_consume=True)
    del r
    gc.collect()
    fake.assert_ownership_ok(must_consume=True)


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize(
    "bad",
    [
        ("scores", "dtype", TypeError),
        ("scores", "ndim3", ValueError),
        ("scores", "inner_stride", ValueError),
        ("prev_topk", "dtype", TypeError),
        ("lengths", "dtype", TypeError),
        ("out", "dtype", TypeError),
        ("out", "shape", ValueError),
    ],
    ids=lambda b: "-".join(b[:2]) if isinstance(b, tuple) else str(b),
)
def test_hand_built_capsule_deleter_once_on_error(bad, versioned):
    """An error raised after the capsule was taken: deleter still exactly once (or the capsule
    is left unconsumed and its deleter never called), never twice."""
    arg, what, exc = bad
    B, n, k = 2, 100, 5
    x = _scores(B, n, 11)
    args = dict(scores=x, prev_topk=None, lengths=None, out=None)
    if arg == "scores":
        arr = {"dtype": x.astype(np.float64), "ndim3": x.reshape(B, 2, n // 2).copy(),
               "inner_stride": _scores(B, 2 * n, 12)[:, ::2]}[what]
    elif arg == "prev_topk":
        arr = np.zeros((B, k), np.int64)
    elif arg == "lengths":
        arr = np.full(B, n, np.int64)
    else:
        arr = {"dtype": np.zeros((B, k), np.int64), "shape": np.zeros((B, k + 1), np.int32)}[what]
    keep = arr.copy()
    fake = FakeDLPack(arr, versioned=versioned, legacy=not versioned)
    args[arg] = fake
    with pytest.raises(exc, match=arg):
        topk(args["scores"], k, prev_topk=args["prev_topk"], lengths=args["lengths"], out=args["out"])
    gc.collect()
    fake.assert_ownership_ok()
    assert same_bits(arr, keep)


def test_deleter_runs_without_a_pending_exception():
    """A deleter may run Python code (ctypes/cffi callbacks, Py_DECREF of arbitrary objects): the
    library must not call it while an exception is set (save/restore the error around it, or
    release before raising). Symptom otherwise: SystemError 'returned NULL without setting an
    exception' instead of the intended TypeError."""
    fake = FakeDLPack(np.zeros((2, 8), np.float64), versioned=False)
    with pytest.raises(TypeError, match="scores"):
        topk(fake, 3)
    gc.collect()
    fake.assert_ownership_ok()


def test_hand_built_null_strides_and_byte_offset():
    """DLTensor.strides == NULL means compact row-major; byte_offset must be honoured."""
    big = _scores(4, 640, 13)
    x = np.ascontiguousarray(big)
    k = 31
    fake = FakeDLPack(x, strides=None)
    assert np.array_equal(topk(fake, k, sorted=True), expected_result(x, k))
    fake.assert_ownership_ok(must_consume=True)
    # a view starting 5 rows + 3 columns into a buffer, described as base pointer + byte_offset
    buf = _scores(10, 700, 14)
    view = buf[5:8, 3:603]
    for versioned in (True, False):
        fake = FakeDLPack(view, byte_offset=(5 * 700 + 3) * 4, versioned=versioned, legacy=not versioned)
        assert np.array_equal(topk(fake, k, sorted=True), expected_result(view, k))
        fake.assert_ownership_ok(must_consume=True)


def test_hand_built_dtype_code_checked():
    """A capsule claiming 32-bit *int* data for scores is rejected even though the bits are 32 wide."""
    x = _scores(2, 100, 15)
    fake = FakeDLPack(x, dl_dtype=(0, 32, 1))
    with pytest.raises(TypeError, match="scores"):
        topk(fake, 3)
    fake.assert_ownership_ok()
    fake = FakeDLPack(x, dl_dtype=(kDLFloat, 32, 2))  # 2 lanes
    with pytest.raises((TypeError, ValueError), match="scores"):
        topk(fake, 3)
    fake.assert_ownership_ok()


def test_output_is_numpy_for_foreign_producer():
    x = _scores(2, 100, 16)
    r = topk(FakeDLPack(x), 3)
    assert type(r) is np.ndarray and r.dtype == np.int32
    r = topk(NumpyProducer(x[0].copy()), 3)
    assert type(r) is np.ndarray and r.shape == (3,)


# --------------------------------------------------------------------------------------------
# torch / cupy
# --------------------------------------------------------------------------------------------


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    xn = x.numpy()
    k = 40
    r = topk(x, k)
    assert isinstance(r, torch.Tensor), type(r)
    assert r.dtype == torch.int32 and tuple(r.shape) == (3, k) and r.device.type == "cpu"
    assert np.array_equal(r.numpy(), topk(xn, k))
    assert np.array_equal(topk(x, k, sorted=True).numpy(), expected_result(xn, k))
    out = torch.full((3, k), -2, dtype=torch.int32)
    r2 = topk(x, k, out=out, prev_topk=r, lengths=torch.tensor([1000, 5, 0], dtype=torch.int32))
    assert r2 is out
    assert np.array_equal(out.numpy(), topk(xn, k, lengths=np.array([1000, 5, 0], np.int32)))
    # row-strided torch view
    big = torch.randn(6, 1100, dtype=torch.float32)
    v = big[::2, :1000]
    check_result(topk(v, k).numpy(), v.numpy(), k)


@pytest.mark.gpu
def test_cupy_inputs():
    cupy = pytest.importorskip("cupy")
    if not has_cuda():
        pytest.skip("no CUDA device")
    x = np.random.default_rng(0).standard_normal((3, 5000), dtype=F32)
    xd = cupy.asarray(x)
    k = 100
    r = topk(xd, k, sorted=True)
    assert isinstance(r, cupy.ndarray) and r.dtype == cupy.int32
    assert np.array_equal(cupy.asnumpy(r), expected_result(x, k))


# --------------------------------------------------------------------------------------------
# torch.Tensor's direct export (gvr._C._set_dlpack_export): taken for arguments whose nosync bit is
# set (on the stream they are used on; CUDA tensors in the wrappers), the protocol otherwise
# --------------------------------------------------------------------------------------------
def _c_topk(x, k, out, nosync, prev=None):
    return gvr._C.topk_decode(x, k, prev, None, out, False, None, "auto", nosync, None, None, None, None, None, None)


def test_torch_direct_export_equals_the_protocol():
    torch = pytest.importorskip("torch")
    from gvr import _interop

    _interop._torch_fast_paths(torch)
    g = torch.Generator().manual_seed(3)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(3, 900, generator=g).to(dt)
        x[1, ::7] = float("nan")
        prev = torch.randint(0, 900, (3, 20), generator=g, dtype=torch.int32)
        want = torch.full((3, 20), -3, dtype=torch.int32)
        got = torch.full((3, 20), -3, dtype=torch.int32)
        _c_topk(x, 20, want, 0, prev)  # __dlpack__ for every argument
        before = (x.clone(), prev.clone())
        _c_topk(x, 20, got, 0b1011, prev)  # scores, prev_topk and out exported directly
        assert torch.equal(want, got), dt
        # nothing passed in is modified (bit for bit: the rows hold NaN)
        assert torch.equal(before[0].view(torch.uint8), x.view(torch.uint8)) and torch.equal(before[1], prev)
        xn = x.float().numpy()
        assert np.array_equal(np.sort(got.numpy(), axis=1), np.sort(expected_result(xn, 20), axis=1))


def test_torch_direct_export_is_used_only_with_the_nosync_bit():
    torch = pytest.importorskip("torch")
    from gvr import _interop

    export = getattr(torch._C, "_to_dlpack_versioned", None)
    if export is None:
        pytest.skip("this torch has no torch._C._to_dlpack_versioned")
    seen = []

    def spy(t):
        seen.append(t.shape)
        return export(t)

    x = torch.randn(2, 500, dtype=torch.bfloat16)
    out = torch.empty(2, 8, dtype=torch.int32)
    try:
        gvr._C._set_dlpack_export(spy, torch.Tensor)
        _c_topk(x, 8, out, 0)
        assert seen == []
        _c_topk(x, 8, out, 0b1000)  # out only
        assert seen == [torch.Size([2, 8])]
        # a subclass is not the registered type: the protocol
        _c_topk(torch.nn.Parameter(x.float(), requires_grad=False), 8, out, 0b0001)
        assert len(seen) == 1
        # the export's own error names the argument
        with pytest.raises(TypeError, match="'scores' cannot be exported"):
            _c_topk(x.to_sparse(), 8, out, 0b0001)
        with pytest.raises(TypeError, match="_set_dlpack_export"):
            gvr._C._set_dlpack_export(1, torch.Tensor)
    finally:
        _interop._torch_fast_paths(torch)
    # the capsule holds the tensor's C++ reference, not the Python object's: its use count
    if hasattr(x, "_use_count"):
        for t in (x, out):
            base = t._use_count()
            for _ in range(50):
                _c_topk(x, 8, out, 0b1001)
            gc.collect()
            assert t._use_count() == base, f"use count {base} -> {t._use_count()} (capsule deleter not run)"


def test_torch_fast_paths_register_torchs_export(monkeypatch):
    torch = pytest.importorskip("torch")
    from gvr import _interop

    export = getattr(torch._C, "_to_dlpack_versioned", None)
    if export is None:
        pytest.skip("this torch has no torch._C._to_dlpack_versioned")
    calls = []

    def counting(t, *a, **kw):
        calls.append(1)
        return export(t, *a, **kw)

    x = torch.randn(2, 500, dtype=torch.bfloat16)
    out = torch.empty(2, 8, dtype=torch.int32)
    try:
        monkeypatch.setattr(torch._C, "_to_dlpack_versioned", counting)
        _interop._torch_fast_paths(torch)  # probes it once, then registers it
        n = len(calls)
        assert n >= 1
        _c_topk(x, 8, out, 0b1001)
        assert len(calls) == n + 2
        # an export that does not give a versioned capsule is not registered: the protocol serves
        monkeypatch.setattr(torch._C, "_to_dlpack_versioned", lambda t: "not a capsule")
        _interop._torch_fast_paths(torch)
        want = torch.empty_like(out)
        _c_topk(x, 8, out, 0b1001)
        _c_topk(x, 8, want, 0)
        assert torch.equal(out, want)
    finally:
        monkeypatch.undo()
        _interop._torch_fast_paths(torch)
