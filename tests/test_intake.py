"""The declarative argument intake of gvr._C (csrc/intake.c), through its private test hook
``gvr._C._intake_check(spec_name, **buffers)``: the specs of the operators ("topk_decode") and two
fixed test specs shaped like the coming operators:

  "attention": q [B, Hq, D] float32|float16|bfloat16; k_cache, v_cache [num_pages, P, Hkv, D] and
               kv_cache [num_pages, 2, P, Hkv, D] (optional, the dtype of q); indices int32
               [B, Hsel, n]; block_table int32 [B, max_pages] and lengths int32 [B] (optional;
               lengths contiguous on a device); outputs out float32 [B, Hq, D], lse float32 [B, Hq]
               (optional). Host or CUDA, never pinned host memory.
  "prefetch":  host_cache [num_pages, P, Hkv, D] uint8|float16|bfloat16 in pinned host memory; dst
               [slots, P, Hkv, D] (output, the dtype of host_cache) on the device; ids int64
               [B, Hkv, n] on the device or in pinned host memory; slots_out int32 [B, Hkv, n]
               (optional output, device).

Int keywords bind dimensions before the buffers (K=5). Fake device buffers (hand-built DLPack
producers with bogus pointers) run in a child interpreter (conftest.run_isolated)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gvr
from conftest import FakeDLPack, kDLBfloat, kDLCPU, kDLCUDA, kDLCUDAHost, kDLFloat, run_isolated

check = gvr._C._intake_check
F32, F16, I32, I64, U8 = np.float32, np.float16, np.int32, np.int64, np.uint8
B, HQ, D, NP, P, HKV, N_SEL = 2, 8, 128, 10, 16, 2, 7
_BOGUS = 0xDEAD0000


def _attn(dtype=F32, **over):
    kw = dict(
        q=np.zeros((B, HQ, D), dtype),
        k_cache=np.zeros((NP, P, HKV, D), dtype),
        v_cache=np.zeros((NP, P, HKV, D), dtype),
        indices=np.zeros((B, 1, N_SEL), I32),
    )
    kw.update(over)
    return {k: v for k, v in kw.items() if v is not None}


def _raises(exc, text, fn, *a, **kw):
    """fn raises exc and its message contains text (a literal string)."""
    with pytest.raises(exc) as ei:
        fn(*a, **kw)
    assert text in str(ei.value), f"{text!r} not in {str(ei.value)!r}"
    return str(ei.value)


def _bf16(array_u16, device=(kDLCPU, 0), data=None):
    """A bfloat16 buffer via DLPack (code 4, 16 bits), backed by a uint16 array (or a fake pointer)."""
    if data is not None:
        return FakeDLPack(shape=array_u16, dtype=np.uint16, data=data, device=device, dl_dtype=(kDLBfloat, 16, 1),
                          null_deleter=True)
    return FakeDLPack(array_u16, device=device, dl_dtype=(kDLBfloat, 16, 1))


_next_fake = [0]


def _fake(shape, dtype, device=(kDLCUDA, 0), strides="auto", dl_dtype=None):
    """A device buffer that is never touched, at its own (bogus) address: fakes do not overlap."""
    _next_fake[0] += 1
    return FakeDLPack(shape=shape, dtype=dtype, data=_BOGUS + (_next_fake[0] << 32), device=device, strides=strides,
                      dl_dtype=dl_dtype, null_deleter=True)


# --------------------------------------------------------------------------------------------
# dimensions: bound by the first argument that has them, tied across the others
# --------------------------------------------------------------------------------------------


def test_attention_dims_resolved():
    r = check("attention", **_attn(block_table=np.zeros((B, 33), I32), lengths=np.zeros(B, I32)))
    assert r["device"] == "cpu"
    assert r["dims"] == dict(B=B, Hq=HQ, D=D, num_pages=NP, P=P, Hkv=HKV, Hsel=1, n=N_SEL, max_pages=33)
    a = r["args"]
    assert set(a) == {"q", "k_cache", "v_cache", "indices", "block_table", "lengths"}
    assert a["k_cache"]["shape"] == (NP, P, HKV, D) and a["k_cache"]["strides"] == (P * HKV * D, HKV * D, D, 1)
    assert a["q"]["dtype"] == "float32" and a["q"]["device"] == "cpu"
    assert r["allocated"] == {}


def test_dimension_mismatch_names_the_dimension_and_its_source():
    msg = _raises(ValueError, "'k_cache' must have shape [num_pages, P, Hkv, D] with D = 128 (from 'q'), got "
                  "[10, 16, 2, 64]", check, "attention", **_attn(k_cache=np.zeros((NP, P, HKV, 64), F32)))
    # v_cache must match what k_cache bound
    msg = _raises(ValueError, "'v_cache' must have shape [10, 16, 2, 128], got [10, 16, 3, 128]", check,
                  "attention", **_attn(v_cache=np.zeros((NP, P, 3, D), F32)))
    assert "Hkv = 2 (from 'k_cache')" in msg, msg
    msg = _raises(ValueError, "'indices' must have shape [B, Hsel, n] with B = 2 (from 'q'), got [3, 1, 7]", check,
                  "attention", **_attn(indices=np.zeros((3, 1, N_SEL), I32)))
    _raises(ValueError, "'lengths' must have shape [2], got [5]: B = 2 (from 'q')", check, "attention",
            **_attn(lengths=np.zeros(5, I32)))
    _raises(ValueError, "'lse' must have shape [2, 8], got [2, 9]", check, "attention",
            **_attn(lse=np.zeros((B, HQ + 1), F32)))


def test_wrong_number_of_dimensions():
    _raises(ValueError, "'q' must have shape [B, Hq, D], got [2, 1024]", check, "attention",
            **_attn(q=np.zeros((B, 1024), F32)))
    _raises(ValueError, "'indices' must have shape [B, Hsel, n] with B = 2 (from 'q'), got [2, 7]", check,
            "attention", **_attn(indices=np.zeros((B, N_SEL), I32)))


def test_int_keyword_binds_a_dimension_first():
    msg = _raises(ValueError, "'q' must have shape [B, Hq, D] with D = 64 (from 'D'), got [2, 8, 128]", check,
                  "attention", D=64, **_attn())
    r = check("attention", D=D, Hq=HQ, **_attn())
    assert r["dims"]["D"] == D
    del msg


def test_five_dimensional_view():
    kv = np.zeros((NP, 2, P, HKV, D), F16)
    r = check("attention", q=np.zeros((B, HQ, D), F16), kv_cache=kv, indices=np.zeros((B, HKV, 3), I32))
    assert r["args"]["kv_cache"]["shape"] == (NP, 2, P, HKV, D)
    assert r["args"]["kv_cache"]["strides"] == (2 * P * HKV * D, P * HKV * D, HKV * D, D, 1)
    assert r["dims"]["Hsel"] == HKV and r["dims"]["num_pages"] == NP
    # a literal entry of the form (the 2 of K and V) is checked like a bound dimension
    _raises(ValueError, "'kv_cache' must have shape [num_pages, 2, P, Hkv, D], got [10, 3, 16, 2, 128]", check, "attention", q=np.zeros((B, HQ, D), F16),
            kv_cache=np.zeros((NP, 3, P, HKV, D), F16), indices=np.zeros((B, 1, 3), I32))
    # six dimensions are more than a view holds: an error, not a crash
    _raises(ValueError, "got 6 dimensions", check, "attention", q=np.zeros((B, HQ, D), F32),
            kv_cache=np.zeros((NP, 2, P, HKV, 1, D), F32), indices=np.zeros((B, 1, 3), I32))


def test_required_and_unknown_arguments():
    _raises(TypeError, "'indices' is required", check, "attention", **_attn(indices=None))
    _raises(TypeError, "spec 'attention' has no argument 'keys'", check, "attention", keys=np.zeros(3), **_attn())
    _raises(ValueError, "no spec named 'nope'", check, "nope")


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, "bf16"])
def test_attention_float_dtypes(dtype):
    if dtype == "bf16":
        q = _bf16(np.zeros((B, HQ, D), np.uint16))
        kc = _bf16(np.zeros((NP, P, HKV, D), np.uint16))
        want = "bfloat16"
    else:
        q, kc = np.zeros((B, HQ, D), dtype), np.zeros((NP, P, HKV, D), dtype)
        want = np.dtype(dtype).name
    r = check("attention", q=q, k_cache=kc, indices=np.zeros((B, 1, 1), I32))
    assert r["args"]["q"]["dtype"] == want and r["args"]["k_cache"]["dtype"] == want


def test_dtype_messages():
    _raises(TypeError, "'q' must be float32, float16 or bfloat16, got float64", check, "attention",
            **_attn(q=np.zeros((B, HQ, D), np.float64)))
    _raises(TypeError, "'k_cache' must be float16 like 'q', got bfloat16", check, "attention",
            **_attn(F16, k_cache=_bf16(np.zeros((NP, P, HKV, D), np.uint16))))
    _raises(TypeError, "'v_cache' must be float32 like 'q', got float16", check, "attention",
            **_attn(v_cache=np.zeros((NP, P, HKV, D), F16)))
    _raises(TypeError, "'indices' must be int32, got int64", check, "attention",
            **_attn(indices=np.zeros((B, 1, N_SEL), I64)))
    # DLPack dtypes gvr does not read: named by their DLPack code and bits
    _raises(TypeError, "'q' must be float32, float16 or bfloat16, got float64", check, "attention",
            **_attn(q=FakeDLPack(np.zeros((B, HQ, D), np.float64))))
    _raises(TypeError, "got float32x2", check, "attention",
            **_attn(q=FakeDLPack(np.zeros((B, HQ, D), F32), dl_dtype=(kDLFloat, 32, 2))))


@pytest.mark.parametrize("via", ["numpy", "dlpack"])
def test_each_dtype_is_read_from_numpy_and_dlpack(via):
    """The six dtypes of a view: accepted where the spec takes them, named where it does not."""
    for dtype, name in ((F32, "float32"), (F16, "float16"), ("bf16", "bfloat16"), (I32, "int32"), (I64, "int64"),
                        (U8, "uint8")):
        if dtype == "bf16":
            if via == "numpy":
                continue  # NumPy has no bfloat16
            q = _bf16(np.zeros((B, HQ, D), np.uint16))
        else:
            q = np.zeros((B, HQ, D), dtype)
            q = FakeDLPack(q) if via == "dlpack" else q
        if name in ("float32", "float16", "bfloat16"):
            assert check("attention", q=q, indices=np.zeros((B, 1, 1), I32))["args"]["q"]["dtype"] == name
        else:
            _raises(TypeError, f"'q' must be float32, float16 or bfloat16, got {name}", check, "attention", q=q,
                    indices=np.zeros((B, 1, 1), I32))
    r = check("topk_decode", scores=np.zeros((3, 9), F32), prev_topk=FakeDLPack(np.zeros((3, 2), I32)), K=4)
    assert r["args"]["prev_topk"]["dtype"] == "int32" and r["dims"] == dict(B=3, N=9, Kp=2, K=4, Bp=3)
    _raises(TypeError, "'prev_topk' must be int32, got int64", check, "topk_decode", scores=np.zeros((3, 9), F32),
            prev_topk=FakeDLPack(np.zeros((3, 2), I64)), K=4)


# --------------------------------------------------------------------------------------------
# topk_decode's spec: alternatives, implicit B of a 1-D row, allocation of out
# --------------------------------------------------------------------------------------------


def test_topk_spec_forms_and_allocation():
    r = check("topk_decode", scores=np.zeros((4, 50), F32), K=5)
    assert r["dims"] == dict(B=4, N=50, K=5)
    out = r["allocated"]["out"]
    assert isinstance(out, np.ndarray) and out.shape == (4, 5) and out.dtype == np.int32
    r = check("topk_decode", scores=np.zeros(50, F32), prev_topk=np.zeros(7, I32), lengths=np.zeros(1, I32), K=3)
    assert r["dims"] == dict(B=1, N=50, Kp=7, K=3, Bl=1)  # a 1-D row is a batch of one
    assert r["args"]["scores"]["form"] == 1 and r["allocated"]["out"].shape == (3,)
    # lengths' rows (one per row, or per request with next_n) are checked after the intake
    _raises(ValueError, "'lengths' must have 1 rows (one per row), got 2", gvr.topk_decode, np.zeros(50, F32), 3,
            lengths=np.zeros(2, I32))
    _raises(ValueError, "'out' must have shape [3] (as 'scores' has shape [N]), got [1, 3]", check, "topk_decode",
            scores=np.zeros(50, F32), out=np.zeros((1, 3), I32), K=3)


# --------------------------------------------------------------------------------------------
# strides
# --------------------------------------------------------------------------------------------


def test_strides():
    q = np.zeros((B, HQ, 2 * D), F32)[:, :, ::2]
    _raises(ValueError, "'q' must have unit stride along its last dimension, got stride 2", check, "attention",
            **_attn(q=q))
    # an HND cache passed as a permuted view: any strides with unit stride along D
    hnd = np.zeros((NP, HKV, P, D), F32).transpose(0, 2, 1, 3)
    r = check("attention", **_attn(k_cache=hnd, v_cache=hnd))
    assert r["args"]["k_cache"]["strides"] == (HKV * P * D, D, P * D, 1)
    # host lengths may be strided (they are read, not handed to a kernel)
    r = check("attention", **_attn(lengths=np.zeros(2 * B, I32)[::2]))
    assert r["args"]["lengths"]["strides"] == (2,)
    # a size-1 last dimension has no stride to speak of
    r = check("attention", **_attn(indices=np.zeros((B, 1, 2), I32)[:, :, :1]))
    assert r["dims"]["n"] == 1


def _iso_device_strides():
    q = _fake((B, HQ, D), F32)
    kc = _fake((NP, P, HKV, D), F32)
    idx = _fake((B, 1, N_SEL), I32)
    r = check("attention", q=q, k_cache=kc, indices=idx, lengths=_fake((B,), I32))
    assert r["device"] == "cuda:0"
    _raises(ValueError, "'lengths' on a CUDA device must be contiguous", check, "attention", q=q, k_cache=kc,
            indices=idx, lengths=_fake((B,), I32, strides=(2,)))


def test_device_strides():
    run_isolated("test_intake", "_iso_device_strides")


# --------------------------------------------------------------------------------------------
# device roles: host, CUDA device, pinned host memory
# --------------------------------------------------------------------------------------------


def _iso_prefetch_roles():
    hc = np.zeros((NP, P, HKV, D), U8)
    pinned = FakeDLPack(hc, device=(kDLCUDAHost, 0))
    dst = _fake((4, P, HKV, D), U8)
    ids = _fake((B, HKV, 3), I64)
    r = check("prefetch", host_cache=pinned, dst=dst, ids=ids)
    assert r["device"] == "cuda:0"
    assert r["args"]["host_cache"]["device"] == "cuda_host" and r["args"]["dst"]["device"] == "cuda"
    assert r["dims"] == dict(num_pages=NP, P=P, Hkv=HKV, D=D, slots=4, B=B, n=3)
    pinned.assert_ownership_ok(must_consume=True)
    # bfloat16 cache, ids in pinned host memory too (the spec lets ids be read from the device)
    r = check("prefetch", host_cache=_bf16((NP, P, HKV, D), device=(kDLCUDAHost, 0), data=_BOGUS),
              dst=_fake((4, P, HKV, D), np.uint16, dl_dtype=(kDLBfloat, 16, 1)),
              ids=FakeDLPack(np.zeros((B, HKV, 3), I64), device=(kDLCUDAHost, 0)))
    assert r["args"]["host_cache"]["dtype"] == "bfloat16" and r["args"]["ids"]["device"] == "cuda_host"
    # the cache must be pinned: plain host memory (and device memory) is named as what it is
    _raises(ValueError, "'host_cache' must be in pinned host memory (DLPack kDLCUDAHost, read by the device), got cpu",
            check, "prefetch", host_cache=hc, dst=dst, ids=ids)
    _raises(ValueError, "'host_cache' must be in pinned host memory (DLPack kDLCUDAHost, read by the device), got "
            "cuda:0", check, "prefetch", host_cache=_fake((NP, P, HKV, D), U8), dst=dst, ids=ids)
    # dst must be on the device
    _raises(ValueError, "'dst' must be on a CUDA device, got cpu", check, "prefetch", host_cache=pinned,
            dst=np.zeros((4, P, HKV, D), U8), ids=np.zeros((B, HKV, 3), I64))
    # ids in plain host memory next to device buffers: mixed devices, naming the roles
    _raises(ValueError, "mixed devices: 'dst' is on cuda:0 but 'ids' is on cpu; 'ids' takes cuda:0 memory or pinned "
            "host memory", check, "prefetch", host_cache=pinned, dst=dst, ids=np.zeros((B, HKV, 3), I64))
    _raises(ValueError, "mixed devices: 'dst' is on cuda:0 but 'ids' is on cuda:1", check, "prefetch",
            host_cache=pinned, dst=dst, ids=_fake((B, HKV, 3), I64, device=(kDLCUDA, 1)))
    _raises(TypeError, "'dst' must be uint8 like 'host_cache', got float16", check, "prefetch", host_cache=pinned,
            dst=_fake((4, P, HKV, D), F16), ids=ids)


def test_prefetch_pinned_host_next_to_device_buffers():
    run_isolated("test_intake", "_iso_prefetch_roles")


def _iso_pinned_rejected_where_not_allowed():
    q = _fake((B, HQ, D), F16)
    kc = _fake((NP, P, HKV, D), F16)
    pinned_idx = FakeDLPack(np.zeros((B, 1, N_SEL), I32), device=(kDLCUDAHost, 0))
    _raises(ValueError, "mixed devices: 'q' is on cuda:0 but 'indices' is in pinned host memory (cuda_host); "
            "'indices' takes cuda:0 memory", check, "attention", q=q, k_cache=kc, indices=pinned_idx)
    # topk_decode on CUDA buffers: pinned lengths are not silently read as host memory either
    scores = _fake((B, 100), F32)
    out = _fake((B, 5), I32)
    pinned_len = FakeDLPack(np.full(B, 100, I32), device=(kDLCUDAHost, 0))
    _raises(ValueError, "mixed devices: 'scores' is on cuda:0 but 'lengths' is in pinned host memory (cuda_host)",
            gvr._C.topk_decode, scores, 5, None, pinned_len, out)


def test_pinned_host_rejected_where_the_spec_does_not_take_it():
    run_isolated("test_intake", "_iso_pinned_rejected_where_not_allowed")


def test_pinned_host_buffers_of_a_host_call():
    """For topk_decode, pinned host memory is host memory of a CPU call (no device involved)."""
    x = np.random.default_rng(0).standard_normal((3, 200), dtype=F32)
    lengths = np.array([200, 50, 0], I32)
    r = check("topk_decode", scores=FakeDLPack(x, device=(kDLCUDAHost, 0)), K=7)
    assert r["device"] == "cpu" and r["args"]["scores"]["device"] == "cuda_host"
    got = gvr.topk_decode(FakeDLPack(x, device=(kDLCUDAHost, 0)), 7, lengths=FakeDLPack(lengths,
                          device=(kDLCUDAHost, 0)), sorted=True)
    assert np.array_equal(got, gvr.topk_decode(x, 7, lengths=lengths, sorted=True))


def _iso_mixed_messages():
    q = _fake((B, HQ, D), F32)
    _raises(ValueError, "mixed devices: 'q' is on cuda:0 but 'k_cache' is on cpu", check, "attention", q=q,
            k_cache=np.zeros((NP, P, HKV, D), F32), indices=_fake((B, 1, 3), I32))
    # the call's device is that of the first CUDA buffer, whichever argument it is
    _raises(ValueError, "mixed devices: 'k_cache' is on cuda:0 but 'q' is on cpu", check, "attention",
            q=np.zeros((B, HQ, D), F32), k_cache=_fake((NP, P, HKV, D), F32), indices=np.zeros((B, 1, 3), I32))


def test_mixed_device_messages():
    run_isolated("test_intake", "_iso_mixed_messages")


# --------------------------------------------------------------------------------------------
# outputs: writable, no overlap with any other argument
# --------------------------------------------------------------------------------------------


def test_outputs_must_not_overlap():
    buf = np.zeros((2, B, HQ, D), F32)
    q = buf[0]
    _raises(ValueError, "'out' must not overlap 'q'", check, "attention", **_attn(q=q, out=buf[0]))
    r = check("attention", **_attn(q=q, out=buf[1]))  # the other half: fine
    assert r["args"]["out"]["shape"] == (B, HQ, D)
    # interleaved views of one buffer overlap in their byte ranges: rejected conservatively
    inter = np.zeros((B, HQ, 2 * D), F32)
    _raises(ValueError, "'out' must not overlap 'q'", check, "attention",
            **_attn(q=inter[:, :, :D], out=inter[:, :, D:]))
    # two outputs
    flat = np.zeros(B * HQ * D + B * HQ, F32)
    out = flat[: B * HQ * D].reshape(B, HQ, D)
    _raises(ValueError, "'out' must not overlap 'lse'", check, "attention",
            **_attn(out=out, lse=flat[B * HQ * D - 1: B * HQ * D - 1 + B * HQ].reshape(B, HQ)))
    r = check("attention", **_attn(out=out, lse=flat[B * HQ * D:].reshape(B, HQ)))
    assert set(r["args"]) >= {"out", "lse"}
    # an empty output overlaps nothing
    r = check("topk_decode", scores=np.zeros((3, 9), F32), out=np.zeros((3, 0), I32), K=0)
    assert r["dims"]["K"] == 0


def test_outputs_must_be_writable():
    out = np.zeros((B, HQ, D), F32)
    out.setflags(write=False)
    _raises(ValueError, "'out' is read-only", check, "attention", **_attn(out=out))
    q = np.zeros((B, HQ, D), F32)
    q.setflags(write=False)
    assert check("attention", **_attn(q=q))["args"]["q"]["shape"] == (B, HQ, D)  # inputs may be read-only


def test_errors_name_the_argument_for_every_topk_buffer():
    x = np.zeros((4, 50), F32)
    for kw, name in ((dict(prev_topk=np.zeros((4, 2, 1), I32)), "prev_topk"), (dict(lengths=np.zeros((5, 1), I32)),
                     "lengths"), (dict(out=np.zeros((4, 6), I32)), "out")):
        with pytest.raises(ValueError, match=rf"^'{name}' must have shape"):
            check("topk_decode", scores=x, K=5, **kw)
    # a row count that is neither B nor B / next_n: after the intake, named
    for kw, name in ((dict(prev_topk=np.zeros((3, 2), I32)), "prev_topk"), (dict(lengths=np.zeros(5, I32)), "lengths"),
                     (dict(block_table=np.zeros((3, 50), I32), page_size=1), "block_table")):
        with pytest.raises(ValueError, match=rf"^'{name}' must have 4 rows \(one per row\) or B / next_n"):
            gvr.topk_decode(x, 5, next_n=2, **kw)
    assert re.search(r"got \[4, 6\]", _raises(ValueError, "'out' must have shape [4, 5], got [4, 6]: K = 5 (from 'K')",
                                             check, "topk_decode", scores=x, K=5, out=np.zeros((4, 6), I32)))
