"""gvr.sparse_attention and gvr.merge_states: attention over a selected subset of a paged KV cache,
giving an attention state (out, lse), and the exact merge of states. The wrappers (defaults, outputs
in the caller's framework, the caller's stream, the CUDA workspace) and their torch.library ops;
validation and computation happen in gvr._C (csrc/attention.c, csrc/cpu/attention_cpu.c,
kernels/attention/)."""
from __future__ import annotations

import math

from . import _C
from ._interop import _torch_module, compiling, define_op, framework, is_cuda, prepare, stream_handle, traced_out

__all__ = ["sparse_attention", "merge_states", "merge_states_in_place"]


# --------------------------------------------------------------------------------------------------
# outputs and the CUDA workspace
# --------------------------------------------------------------------------------------------------
def _shape(x):
    s = getattr(x, "shape", None)
    return tuple(int(d) for d in s) if s is not None else None


def _new(like, fw, shape, dtype):
    """An uninitialised array of ``shape`` in like's framework and device; dtype None: like's dtype,
    else a name ("float32", "int32"). None when it can't be made (gvr._C then names the problem)."""
    if shape is None:
        return None
    if fw == "torch":
        t = _torch_module()
        return t.empty(shape, dtype=like.dtype if dtype is None else getattr(t, dtype), device=like.device)
    if fw == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)
    if fw == "numpy":
        import numpy as np

        return np.empty(shape, dtype=like.dtype if dtype is None else dtype)
    return None


# One zero-filled workspace per (device, stream): every call leaves it zero-filled, so calls ordered on
# one stream share it (kernels/gvr_kernels.h). Buffers made while a CUDA graph is being captured are the
# graph's own (kept alive here) and never reused outside it.
_WORKSPACES: dict = {}
_CAPTURED: list = []


def _capturing(fw):
    if fw == "torch":
        return _torch_module().cuda.is_current_stream_capturing()
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


def _zeros(like, fw, nbytes):
    if fw == "torch":
        t = _torch_module()
        return t.zeros(nbytes, dtype=t.uint8, device=like.device)
    import cupy

    with like.device:
        return cupy.zeros(nbytes, dtype="uint8")


def _workspace(q, fw, stream, k_cache, indices, block_table, block_size, partials, accumulate):
    qs, ks, ix = _shape(q), _shape(k_cache), _shape(indices)
    if not (qs and ks and ix and len(qs) == 3 and len(ks) == 4 and len(ix) == 3):
        return None
    dev = q.device.index if fw == "torch" else q.device.id
    try:
        bs = int(block_size)
    except (TypeError, ValueError):
        return None
    need = _C.attention_workspace_size(dev, qs[0], qs[1], ks[2], qs[2], ix[1], ix[2], ks[1], ks[0], bs,
                                       block_table is not None, partials is not None, bool(accumulate))
    return cached_workspace(_WORKSPACES, q, fw, dev, stream, need)


def cached_workspace(cache, like, fw, dev, stream, need):
    """A zero-filled uint8 buffer of at least ``need`` bytes on like's device, one per (framework, device,
    stream) in ``cache`` (an operator's own dict: operators leave their workspaces in different states),
    grown by doubling; made fresh, and kept alive in _CAPTURED, while a CUDA graph is captured. None when
    need is 0."""
    if need == 0:
        return None
    key = (fw, dev, stream)
    ws = cache.get(key)
    if ws is not None and ws.shape[0] >= need:
        return ws
    ws = _zeros(like, fw, max(need, 2 * ws.shape[0] if ws is not None else 0))
    if _capturing(fw):
        _CAPTURED.append(ws)
    else:
        cache[key] = ws
    return ws


def _stream_for(q, fw, stream):
    stream = stream_handle(stream)
    if stream is None and fw == "torch":
        return _torch_module().cuda.current_stream(q.device).cuda_stream
    if stream is None and fw == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return stream


def _run_attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, out, lse, partials,
                   accumulate, stream, exclude=None, counts=None, cast_out=None, k_scale=None, v_scale=None):
    fw = framework(q)
    qs = _shape(q)
    if partials is not None:
        if not isinstance(partials, (tuple, list)) or len(partials) != 2:
            raise TypeError("'partials' must be a pair (part_out, part_lse) or None, got "
                            f"{type(partials).__name__}")
    po, pl = partials if partials is not None else (None, None)
    if qs is not None and len(qs) == 3:
        if out is None:
            out = _new(q, fw, qs, None)
        if lse is None:
            lse = _new(q, fw, qs[:2], "float32")
    ws = None
    if fw in ("torch", "cupy") and is_cuda(q, fw):
        stream = _stream_for(q, fw, stream)
        ws = _workspace(q, fw, stream, k_cache, indices, block_table, block_size, partials, accumulate)
    arrays = (q, k_cache, v_cache, indices, block_table, lengths, out, lse, po, pl, ws, exclude, counts, cast_out)
    (aq, ak, av, ai, abt, aln, ao, al, apo, apl, aws, ax, ac, aco), stream, nosync = prepare(fw, q, arrays, stream)
    _C.sparse_attention(aq, ak, av, ai, abt, aln, block_size, scale, ao, al, apo, apl, accumulate, aws, stream,
                        nosync, ax, ac, aco, k_scale, v_scale)
    return out, lse


# --------------------------------------------------------------------------------------------------
# torch.library ops (traced code only; eager calls run the functions above directly)
# --------------------------------------------------------------------------------------------------
_ATT = "Tensor q, Tensor k_cache, Tensor v_cache, Tensor indices, Tensor? lengths, Tensor? block_table, " \
       "int block_size, float? scale, float? k_scale, float? v_scale"


def _att_impl(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale, v_scale):
    return _run_attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, None, None, None,
                          False, None, k_scale=k_scale, v_scale=v_scale)


def _att_fake(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale, v_scale):
    t = _torch_module()
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=t.float32)


def _att_out_impl(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale, v_scale, out, lse,
                  part_out, part_lse, accumulate, exclude=None, counts=None, cast_out=None):
    partials = None if part_out is None and part_lse is None else (part_out, part_lse)
    _run_attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, out, lse, partials,
                   accumulate, None, exclude, counts, cast_out, k_scale, v_scale)


def _none(*args):
    return None


_att_op = define_op("sparse_attention", f"({_ATT}) -> (Tensor, Tensor)", impl=_att_impl, fake=_att_fake)
_att_out_op = define_op(
    "sparse_attention_out",
    f"({_ATT}, Tensor(a!) out, Tensor(b!) lse, Tensor(c!)? part_out, Tensor(d!)? part_lse, bool accumulate, "
    "Tensor? exclude, Tensor(e!)? counts, Tensor(f!)? cast_out) -> ()",
    impl=_att_out_impl, fake=_none, mutates_args=("out", "lse", "part_out", "part_lse", "counts", "cast_out"))


def _check_traced_stream(stream, name):
    if stream is not None:
        raise ValueError(f"'stream' is not supported under torch.compile: call gvr.{name} inside "
                         "`with torch.cuda.stream(s):` instead")


def _attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, out, lse, partials,
               accumulate, stream, name, exclude=None, counts=None, cast_out=None, k_scale=None, v_scale=None):
    if compiling():
        _check_traced_stream(stream, name)
        if partials is not None and (not isinstance(partials, (tuple, list)) or len(partials) != 2):
            n = f" of {len(partials)}" if isinstance(partials, (tuple, list)) else ""
            raise TypeError(f"'partials' must be a pair (part_out, part_lse) or None, got {type(partials).__name__}{n}")
        if isinstance(block_size, bool):
            raise TypeError("'block_size' must be an int, got bool")
        if out is None and lse is None and partials is None and not accumulate:
            return _att_op.call(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale,
                                v_scale)
        if out is None:
            out = q.new_empty(q.shape)
        if lse is None:
            lse = q.new_empty(q.shape[:2], dtype=_torch_module().float32)
        po, pl = partials if partials is not None else (None, None)
        _att_out_op.call(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, k_scale, v_scale,
                         out, lse, po, pl, accumulate, exclude, counts, cast_out)
        return out, lse
    return _run_attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, out, lse,
                          partials, accumulate, stream, exclude, counts, cast_out, k_scale, v_scale)


def sparse_attention(q, k_cache, v_cache, indices, *, lengths=None, block_table=None, block_size=1, scale=None,
                     out=None, lse=None, partials=None, stream=None, k_scale=None, v_scale=None):
    """Decode attention over the selected entries of a paged KV cache -> ``(out, lse)``.

    q:         ``[B, Hq, D]`` float16 or bfloat16 (float32 too on the CPU), unit stride along D.
    k_cache, v_cache: paged ``[num_pages, P, Hkv, D]`` in q's dtype or fp8 (``torch.float8_e4m3fn``,
               NumPy ``ml_dtypes.float8_e4m3fn``; both caches the same), any strides with unit stride
               along D: vLLM/FlashInfer NHD caches as they are, HND caches ``[num_pages, Hkv, P, D]``
               as ``.transpose(1, 2)``, K and V as separate tensors or views of one combined cache.
               GQA: Hq a multiple of Hkv (query head h reads KV head h // (Hq // Hkv)).
    indices:   int32 ``[B, Hsel, n]``, Hsel = 1 (one selection for every head, as DSA) or Hkv (one per
               KV head, as Quest/NSA/SparDA); -1 is an empty slot.
               With ``block_table`` (int32 ``[B, max_pages]``): logical block numbers of
               ``block_size`` tokens of row b; tokens at or past ``lengths[b]`` (default
               max_pages * P) are masked; ``block_size`` divides or is a multiple of P.
               Without it: physical token slots of the flattened cache (page = slot // P), block_size 1.
               Entries out of range name nothing (skipped like -1). An entry listed twice counts twice.
    scale:     softmax scale, default 1 / sqrt(D).
    k_scale, v_scale: per-tensor cache scales (floats, default 1; any cache dtype, as vLLM's and
               FlashInfer's fp8 caches carry them): attention over ``k_scale * K`` and ``v_scale * V``.
               fp8 values are decoded exactly (e4m3fn: no infinities, S.1111.111 is NaN).
    out, lse:  where to write: out ``[B, Hq, D]`` in q's dtype or float32, lse float32 ``[B, Hq]`` (any
               strides); allocated in q's framework and device when None.
    partials:  ``(part_out, part_lse)`` float32 ``[B, Hq, n, D]`` and ``[B, Hq, n]``: also the state of
               each entry alone (for ``gvr.prr.finalize``, exact mode).
    stream:    CUDA stream (handle, torch or CuPy stream); default: the current stream.

    Returns ``(out, lse)``: softmax attention of each query head over exactly the named positions,
    ``lse`` the natural log of the softmax denominator (scale included). A head that attends nothing
    gets out 0 and lse -inf. Deterministic bit for bit; CPU (C, threads over rows) for NumPy arrays
    and CPU tensors, CUDA for torch CUDA tensors and CuPy arrays.
    """
    return _attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, out, lse, partials,
                      False, stream, "sparse_attention", k_scale=k_scale, v_scale=v_scale)


def repair(out, lse, q, k_cache, v_cache, indices, *, lengths=None, block_table=None, block_size=1, scale=None,
           exclude=None, counts=None, cast_out=None, stream=None, k_scale=None, v_scale=None):
    """See gvr.prr.repair."""
    if out is None or lse is None:
        raise TypeError("prr.repair: 'out' and 'lse' (the state to repair, out float32) must be given")
    return _attention(q, k_cache, v_cache, indices, lengths, block_table, block_size, scale, out, lse, None, True,
                      stream, "prr.repair", exclude, counts, cast_out, k_scale, v_scale)


# --------------------------------------------------------------------------------------------------
# merge_states
# --------------------------------------------------------------------------------------------------
def _address(x):
    """(data pointer, shape, strides, dtype) of an array, or None: two arrays with equal addresses are
    the same memory in the same layout (an exact alias: merging into it is in place)."""
    try:
        mod = type(x).__module__
        if mod.startswith("torch"):
            return (x.device, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)
        if mod.startswith("numpy"):
            return ("cpu", x.__array_interface__["data"][0], x.shape, x.strides, x.dtype)
        if mod.startswith("cupy"):
            return (x.device.id, x.data.ptr, x.shape, x.strides, x.dtype)
    except Exception:
        return None
    return None


def _aliases(a, b):
    if a is b:
        return True
    if compiling():  # no data pointers in traced code: only the same objects merge in place there
        return False
    ra = _address(a)
    return ra is not None and ra == _address(b)


def _base2(lse_base):
    if lse_base == "e":
        return False
    if lse_base == "2":
        return True
    if not isinstance(lse_base, str):
        raise TypeError(f"'lse_base' must be 'e' or '2', got {type(lse_base).__name__}")
    raise ValueError(f"'lse_base' must be 'e' or '2', got {lse_base!r}")


def _run_merge(out_a, lse_a, out_b, lse_b, out, lse, base2, stream):
    fw = framework(out_a)
    if out is None and lse is None:
        out, lse = _new(out_a, fw, _shape(out_a), None), _new(out_a, fw, _shape(lse_a), "float32")
    (a, la, b, lb, o, lo), stream, nosync = prepare(fw, out_a, (out_a, lse_a, out_b, lse_b, out, lse), stream)
    _C.merge_states(a, la, b, lb, o, lo, base2, stream, nosync)
    return out, lse


def _run_merge_in_place(out, lse, out_b, lse_b, base2, stream):
    fw = framework(out)
    (a, la, b, lb), stream, nosync = prepare(fw, out, (out, lse, out_b, lse_b), stream)
    _C.merge_states(a, la, b, lb, None, None, base2, stream, nosync)
    return out, lse


def _merge_impl(out_a, lse_a, out_b, lse_b, base2):
    return _run_merge(out_a, lse_a, out_b, lse_b, None, None, base2, None)


def _merge_fake(out_a, lse_a, out_b, lse_b, base2):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _merge_ip_impl(out, lse, out_b, lse_b, base2):
    _run_merge_in_place(out, lse, out_b, lse_b, base2, None)


_MERGE = "Tensor lse_a, Tensor out_b, Tensor lse_b, bool base2"
_merge_op = define_op("merge_states", f"(Tensor out_a, {_MERGE}) -> (Tensor, Tensor)", impl=_merge_impl,
                      fake=_merge_fake)
_merge_ip_op = define_op("merge_states_in_place",
                         "(Tensor(a!) out, Tensor(b!) lse, Tensor out_b, Tensor lse_b, bool base2) -> ()",
                         impl=_merge_ip_impl, fake=_none, mutates_args=("out", "lse"))


def merge_states_in_place(out, lse, out_b, lse_b, *, lse_base="e", stream=None):
    """Merge the state ``(out_b, lse_b)`` into ``(out, lse)`` in place; returns ``(out, lse)``.
    See ``merge_states``."""
    base2 = _base2(lse_base)
    if compiling():
        _check_traced_stream(stream, "merge_states_in_place")
        _merge_ip_op.call(out, lse, out_b, lse_b, base2)
        return out, lse
    return _run_merge_in_place(out, lse, out_b, lse_b, base2, stream)


def merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None, lse_base="e", stream=None):
    """The exact combination of two attention states over disjoint sets of positions -> ``(out, lse)``.

    out_a, out_b: ``[B, H, D]`` or ``[H, D]`` (float32, float16 or bfloat16; unit stride along D);
    lse_a, lse_b: float32 ``[B, H]`` or ``[H]``, any strides (vLLM's ``[H, B]`` layout as a transposed
    view). ``lse_base``: "e" (natural log: vLLM, SGLang, FlashAttention, gvr) or "2" (FlashInfer).
    out/lse: where to write (out in out_a's dtype by default); ``out=out_a, lse=lse_a`` (or the b
    pair; the same objects or views of the same memory in the same layout) merges in place.

    With m = max(lse_a, lse_b): out = (e^(lse_a-m) out_a + e^(lse_b-m) out_b) / (e^(lse_a-m) + e^(lse_b-m)),
    lse = m + log(e^(lse_a-m) + e^(lse_b-m)). A side with lse = -inf contributes nothing (the other
    side is returned as it is); two empty states give the empty state (out 0, lse -inf), never NaN.
    """
    base2 = _base2(lse_base)
    if out is not None and lse is not None and _aliases(out, out_a) and _aliases(lse, lse_a):
        merge_states_in_place(out, lse, out_b, lse_b, lse_base=lse_base, stream=stream)
        return out, lse
    if out is not None and lse is not None and _aliases(out, out_b) and _aliases(lse, lse_b):
        merge_states_in_place(out, lse, out_a, lse_a, lse_base=lse_base, stream=stream)
        return out, lse
    if compiling():
        _check_traced_stream(stream, "merge_states")
        o, l = _merge_op.call(out_a, lse_a, out_b, lse_b, base2)
        if out is None and lse is None:
            return o, l
        t = _torch_module()
        out = traced_out(out, o, "out", "merge_states", (t.float32, t.float16, t.bfloat16))
        lse = traced_out(lse, l, "lse", "merge_states")
        return out, lse
    if (out is None) != (lse is None):
        fw = framework(out_a)
        if out is None:
            out = _new(out_a, fw, _shape(out_a), None)
        else:
            lse = _new(out_a, fw, _shape(lse_a), "float32")
    return _run_merge(out_a, lse_a, out_b, lse_b, out, lse, base2, stream)
