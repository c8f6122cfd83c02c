"""PRR's selection stage (paper 002): Quest-style block criticality over a paged KV cache.

``block_metadata`` keeps, per row, KV head and block of ``block_size`` tokens, the per-channel min and
max of the keys; ``update_block_metadata`` folds appended tokens in, in place; ``block_scores`` gives
Quest's upper bound of q.k per (row, KV head, block), combined over the GQA group; ``select_blocks``
is the selection: block scores with the first and most recent blocks always kept, then
``gvr.topk_decode`` over the blocks of each (row, KV head), giving the ``indices`` that
``gvr.sparse_attention(..., block_table=..., block_size=G)`` takes with Hsel = Hkv.

The wrappers (defaults, outputs in the caller's framework, the caller's stream) and their
torch.library ops; validation and computation happen in gvr._C (csrc/prr_select.c,
csrc/cpu/prr_select_cpu.c, kernels/prr/select.cu). Semantics in full: kernels/gvr_kernels.h, section
"PRR selection stage".
"""
from __future__ import annotations


from . import _C
from ._interop import _torch_module, compiling, define_op, framework, prepare, traced_out
from .attention import _check_traced_stream, _new, _shape
from .topk import topk_decode

__all__ = ["block_metadata", "update_block_metadata", "block_scores", "select_blocks"]


def _int(x):
    """x as an int when it is one (not a bool), else None (gvr._C then names the problem)."""
    if isinstance(x, bool):
        return None
    try:
        return int(x.__index__())
    except (AttributeError, TypeError):
        return None


def _meta_shape(k_cache, block_table, block_size):
    ks, bs, G = _shape(k_cache), _shape(block_table), _int(block_size)
    if not (ks and bs and len(ks) == 4 and len(bs) == 2 and G and G > 0):
        return None
    return (bs[0], ks[2], -(-(bs[1] * ks[1]) // G), 2, ks[3])


# --------------------------------------------------------------------------------------------------
# eager paths
# --------------------------------------------------------------------------------------------------
def _run_metadata(k_cache, block_table, lengths, block_size, out, stream):
    fw = framework(k_cache)
    if out is None:
        out = _new(k_cache, fw, _meta_shape(k_cache, block_table, block_size), None)
    # in gvr._C's spec order (k_cache, block_table, lengths, start, out): nosync's bits follow it
    (k, bt, ln, _, o), stream, nosync = prepare(fw, k_cache, (k_cache, block_table, lengths, None, out), stream)
    _C.block_metadata(k, bt, ln, o, block_size, None, stream, nosync)
    return out


def _run_update(meta, k_cache, block_table, start, end, block_size, stream):
    if start is None or end is None:
        raise TypeError("prr.update_block_metadata: 'start' and 'end' must be given (int32 [B])")
    fw = framework(k_cache)
    # in gvr._C's spec order (k_cache, block_table, end, start, meta): nosync's bits follow it
    (k, bt, e, s, m), stream, nosync = prepare(fw, k_cache, (k_cache, block_table, end, start, meta), stream)
    _C.block_metadata(k, bt, e, m, block_size, s, stream, nosync)
    return meta


def _run_scores(q, meta, lengths, block_size, group_reduce, keep_first, keep_last, out, counts, stream,
                raw=None, window=1):
    fw = framework(q)
    ms = _shape(meta)
    if out is None and ms is not None and len(ms) == 5:
        out = _new(q, fw, ms[:3], "float32")
    # in gvr._C's spec order (q, meta, lengths, out, counts, scores_out): nosync's bits follow it
    (aq, am, al, ao, ac, ar), stream, nosync = prepare(fw, q, (q, meta, lengths, out, counts, raw), stream)
    r = _C.block_scores(aq, am, al, ao, ac, block_size, group_reduce, keep_first, keep_last, stream, nosync, ar,
                        window)
    return r if out is None else out


def _check_blocks(n, name):
    """init_blocks / local_blocks: named here (gvr._C knows them as keep_first / keep_last)."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"'{name}' must be an int, got {type(n).__name__}")
    if n.__index__() < 0:
        raise ValueError(f"'{name}' must not be negative, got {n.__index__()}")


def _run_select(q, meta, k, lengths, block_size, group_reduce, init_blocks, local_blocks, out, stream, sorted=False,
                scores_out=None, window=1, name="prr.select_blocks"):
    """select_blocks' eager path; window > 1 (forecast_select): lengths are token counts and the blocks
    windows of that many tokens every block_size, counted inside the scores kernel (gvr_kernels.h);
    name: the public function that errors raised here name."""
    _check_blocks(init_blocks, "init_blocks")
    _check_blocks(local_blocks, "local_blocks")
    fw = _scratch_framework(q, framework(q), name)  # (before anything is written)
    ofw = fw if out is None else framework(out)
    if ofw != fw and not _contiguous(out, ofw):  # (a contiguous one is written directly, as topk_decode takes it)
        raise TypeError(f"{name}: a non-contiguous 'out' must be in q's framework ({fw}), got "
                        f"{type(out).__name__}")
    ms = _shape(meta)
    kk = _int(k)
    if ms is None or len(ms) != 5 or kk is None or kk < 0:
        # gvr._C / topk_decode name the problem
        _run_scores(q, meta, lengths, block_size, group_reduce, init_blocks, local_blocks, None, None, stream,
                    scores_out, window)
        topk_decode(_new(q, fw, (1, 1), "float32"), k)
        raise TypeError(f"{name}: 'meta' must be [B, Hkv, Nb, 2, D] and 'k' an int >= 0")
    B, Hkv, Nb = ms[:3]
    if kk > 2**31 - 1:  # before [B, Hkv, k] is allocated
        raise ValueError(f"{name}: 'k' must be at most 2147483647, got {kk}")
    if out is not None:  # named before anything is written (scores_out included)
        for other, arr in (("scores_out", scores_out), ("q", q), ("meta", meta), ("lengths", lengths)):
            if arr is not None and _overlap(out, arr):  # (scores_out vs the inputs: the scores intake)
                raise ValueError(f"{name}: 'out' must not overlap '{other}'")
        osh = _shape(out)
        if osh is None:
            raise TypeError(f"{name}: 'out' must be an int32 array [B, Hkv, k], got {type(out).__name__}")
        if tuple(osh) != (B, Hkv, kk):
            raise ValueError(f"{name}: 'out' must have shape [B, Hkv, k] = [{B}, {Hkv}, {kk}], got "
                             f"{list(osh)}")
    scores = _new(q, fw, (B, Hkv, Nb), "float32")
    counts = _new(q, fw, (B, Hkv), "int32")
    _run_scores(q, meta, lengths, block_size, group_reduce, init_blocks, local_blocks, scores, counts, stream,
                scores_out, window)
    res = out
    if res is None or not _contiguous(res, ofw):
        res = _new(q, fw, (B, Hkv, kk), "int32")
    topk_decode(scores.reshape(B * Hkv, Nb), kk, lengths=counts.reshape(B * Hkv), out=res.reshape(B * Hkv, kk),
                sorted=sorted, stream=stream)
    if out is not None and res is not out:
        _copy_into(out, res, fw)
        return out
    return res


def _scratch_framework(q, fw, name):
    """the framework of select_blocks' scratch buffers and result: q's, or NumPy for another DLPack
    producer in host memory"""
    if fw in ("numpy", "torch", "cupy"):
        return fw
    try:
        host = q.__dlpack_device__()[0] in (1, 3)  # kDLCPU, kDLCUDAHost
    except Exception:
        host = False
    if host:
        return "numpy"
    raise TypeError(f"{name}: 'q' must be a NumPy array, a torch tensor, a CuPy array or a DLPack producer in host "
                    f"memory, got {type(q).__name__}")


def _overlap(a, b):
    """whether two arrays' byte ranges meet: torch tensors on one device, or NumPy arrays (others:
    False; gvr._C checks devices)"""
    if hasattr(a, "data_ptr") and hasattr(b, "data_ptr"):
        if a.device != b.device or a.numel() == 0 or b.numel() == 0:
            return False
        (alo, ahi), (blo, bhi) = _torch_range(a), _torch_range(b)
        return alo < bhi and blo < ahi
    if hasattr(a, "__array_interface__") and hasattr(b, "__array_interface__"):
        import numpy as np
        return bool(np.may_share_memory(a, b))
    return False


def _torch_range(x):
    lo = hi = x.data_ptr()
    for n, st in zip(x.shape, x.stride()):
        span = (n - 1) * st * x.element_size()
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return lo, hi + x.element_size()


def _check_traced_geometry(cache, ndim, name, dims, block_table, block_size, func):
    """what gvr._C's intake says first in eager calls, before a traced call's fake implementation
    would fail on it with torch's own error (a negative size, a division by zero, an unpacking)"""
    if cache.dim() != ndim:
        raise ValueError(f"{func}: '{name}' must be {dims}, got {list(cache.shape)}")
    if block_table is not None and block_table.dim() != 2:
        raise ValueError(f"{func}: 'block_table' must be int32 [B, max_pages], got {list(block_table.shape)}")
    if isinstance(block_size, bool) or (isinstance(block_size, int) and block_size < 1):
        raise ValueError(f"{func}: 'block_size' must be an int >= 1, got {block_size!r}")


def _contiguous(x, fw):
    if fw == "torch":
        return x.is_contiguous()
    flags = getattr(x, "flags", None)
    return bool(flags is not None and flags.c_contiguous)


def _copy_into(dst, src, fw):
    if fw == "torch":
        dst.copy_(src)
    else:
        dst[...] = src


# --------------------------------------------------------------------------------------------------
# torch.library ops (traced code only; eager calls run the functions above directly)
# --------------------------------------------------------------------------------------------------
def _metadata_impl(k_cache, block_table, lengths, block_size):
    return _run_metadata(k_cache, block_table, lengths, block_size, None, None)


def _metadata_fake(k_cache, block_table, lengths, block_size):
    B, maxp = block_table.shape
    _, P, Hkv, D = k_cache.shape
    return k_cache.new_empty((B, Hkv, (maxp * P + block_size - 1) // block_size, 2, D))


def _update_impl(meta, k_cache, block_table, start, end, block_size):
    _run_update(meta, k_cache, block_table, start, end, block_size, None)


def _update_fake(meta, k_cache, block_table, start, end, block_size):
    return None


def _scores_impl(q, meta, lengths, block_size, group_reduce, keep_first, keep_last):
    t = _torch_module()
    B, Hkv, Nb = meta.shape[:3]
    scores = t.empty((B, Hkv, Nb), dtype=t.float32, device=q.device)
    counts = t.empty((B, Hkv), dtype=t.int32, device=q.device)
    _run_scores(q, meta, lengths, block_size, group_reduce, keep_first, keep_last, scores, counts, None)
    return scores, counts


def _scores_fake(q, meta, lengths, block_size, group_reduce, keep_first, keep_last):
    t = _torch_module()
    B, Hkv, Nb = meta.shape[:3]
    return q.new_empty((B, Hkv, Nb), dtype=t.float32), q.new_empty((B, Hkv), dtype=t.int32)


def _select_scores_impl(q, meta, lengths, block_size, group_reduce, keep_first, keep_last):
    """select_blocks' scores with scores_out: (scores, counts, the scores before the keep ranges), one pass."""
    t = _torch_module()
    B, Hkv, Nb = meta.shape[:3]
    scores = t.empty((B, Hkv, Nb), dtype=t.float32, device=q.device)
    counts = t.empty((B, Hkv), dtype=t.int32, device=q.device)
    raw = t.empty((B, Hkv, Nb), dtype=t.float32, device=q.device)
    _run_scores(q, meta, lengths, block_size, group_reduce, keep_first, keep_last, scores, counts, None, raw)
    return scores, counts, raw


def _select_scores_fake(q, meta, lengths, block_size, group_reduce, keep_first, keep_last):
    t = _torch_module()
    B, Hkv, Nb = meta.shape[:3]
    return (q.new_empty((B, Hkv, Nb), dtype=t.float32), q.new_empty((B, Hkv), dtype=t.int32),
            q.new_empty((B, Hkv, Nb), dtype=t.float32))


_metadata_op = define_op("prr_block_metadata", "(Tensor k_cache, Tensor block_table, Tensor? lengths, int block_size)"
                         " -> Tensor", impl=_metadata_impl, fake=_metadata_fake)
_update_op = define_op("prr_update_block_metadata", "(Tensor(a!) meta, Tensor k_cache, Tensor block_table, "
                       "Tensor start, Tensor end, int block_size) -> ()", impl=_update_impl, fake=_update_fake,
                       mutates_args=("meta",))
_scores_op = define_op("prr_block_scores", "(Tensor q, Tensor meta, Tensor? lengths, int block_size, "
                       "str group_reduce, int keep_first, int keep_last) -> (Tensor, Tensor)", impl=_scores_impl,
                       fake=_scores_fake)
_select_scores_op = define_op("prr_select_scores", "(Tensor q, Tensor meta, Tensor? lengths, int block_size, "
                              "str group_reduce, int keep_first, int keep_last) -> (Tensor, Tensor, Tensor)",
                              impl=_select_scores_impl, fake=_select_scores_fake)


# --------------------------------------------------------------------------------------------------
# the public functions
# --------------------------------------------------------------------------------------------------
def block_metadata(k_cache, block_table, lengths=None, *, block_size, out=None, stream=None):
    """Quest block metadata of a paged K cache -> ``meta [B, Hkv, Nb, 2, D]`` in k_cache's dtype.

    k_cache:     paged ``[num_pages, P, Hkv, D]`` (float32, float16, bfloat16 or float8_e4m3fn on the CPU;
                 float16, bfloat16 or float8_e4m3fn with D = 64, 128 or 256 on CUDA), any strides with unit
                 stride along D (as ``gvr.sparse_attention`` takes it; on CUDA 16-byte aligned with strides
                 in multiples of 16 bytes).
    block_table: int32 ``[B, max_pages]``: token t of row b is at page ``block_table[b, t // P]``, slot
                 ``t % P``; pages < 0 or >= num_pages hold no token (skipped, as sparse_attention does).
    lengths:     int32 ``[B]`` tokens per row (default max_pages * P), each in [0, max_pages * P].
    block_size:  G tokens per metadata block, a divisor or a multiple of P; Nb = ceil(max_pages * P / G).
    out:         ``[B, Hkv, Nb, 2, D]`` in k_cache's dtype to write into (any strides, unit along D).

    ``meta[b, h, j, 0, :]`` is the per-channel minimum and ``meta[b, h, j, 1, :]`` the maximum of the
    keys of head h over block j's tokens ``[j*G, min((j+1)*G, lengths[b]))`` — stored values exactly
    (compared in IEEE totalOrder: -0 < +0; NaN keys reach the max when positive, the min when
    negative; fp8 bytes in the same order, -NaN < -448 < ... < 448 < +NaN). A block with no token has
    min +inf and max -inf (fp8, which has no infinities: min +NaN, max -NaN). Deterministic, bit for
    bit, and the same bits on the CPU and on CUDA.
    """
    if compiling():
        _check_traced_stream(stream, "prr.block_metadata")
        _check_traced_geometry(k_cache, 4, "k_cache", "[num_pages, P, Hkv, D]", block_table, block_size,
                               "prr.block_metadata")
        m = _metadata_op.call(k_cache, block_table, lengths, block_size)
        return traced_out(out, m, "out", "prr.block_metadata")
    return _run_metadata(k_cache, block_table, lengths, block_size, out, stream)


def update_block_metadata(meta, k_cache, block_table, start, end, *, block_size, stream=None):
    """Fold the tokens ``[start[b], end[b])`` of each row into ``meta`` in place -> ``meta``.

    meta: from ``block_metadata`` (same k_cache dtype, block table width and block_size); start,
    end: int32 ``[B]`` in [0, max_pages * P] (a row with end <= start is left as it is). The blocks
    j in [start // G, ceil(end / G)) take the new tokens: a block starting at or after start is
    rebuilt from its tokens below end; the block containing start (when start % G != 0) is merged
    (min/max) with what it holds. Blocks wholly before start, or at or after ceil(end / G), are not
    touched. So after ``meta = block_metadata(..., lengths=start)``, this call makes meta equal to
    ``block_metadata(..., lengths=end)`` bit for bit, at the cost of the new tokens only: call it once
    per decode step with start = the old lengths, end = the new ones. On the device, no host round trip.
    """
    if compiling():
        _check_traced_stream(stream, "prr.update_block_metadata")
        _update_op.call(meta, k_cache, block_table, start, end, block_size)
        return meta
    return _run_update(meta, k_cache, block_table, start, end, block_size, stream)


def block_scores(q, meta, lengths=None, *, block_size, group_reduce="max", keep_first=0, keep_last=0, out=None,
                 stream=None):
    """Quest block scores -> float32 ``[B, Hkv, Nb]``.

    q:            ``[B, Hq, D]`` in meta's dtype, or float16 / bfloat16 over fp8 metadata (unit stride along
                  D); Hq a multiple of Hkv; query head g belongs to KV head g // (Hq // Hkv).
    meta:         ``[B, Hkv, Nb, 2, D]`` from ``block_metadata`` (of an fp8 cache: float8_e4m3fn, decoded
                  exactly; the scores are those of the stored values -- a positive per-tensor k_scale
                  scales them all alike and selects the same blocks).
    lengths:      int32 ``[B]`` tokens per row (default Nb * block_size), in [0, Nb * block_size].
    group_reduce: "max" (default) or "sum": how the scores of a KV head's query heads combine.
    keep_first, keep_last: the first ``keep_first`` and the last ``keep_last`` valid blocks of each row
                  score +inf (always selected).

    Per query head g: ``s_g = sum_d max(q[g, d] * max_d, q[g, d] * min_d)`` (Quest's upper bound of q.k
    over the block's keys) in float32 — each product rounded, no FMA, summed over chunks of 8 channels
    left to right and then over the chunks by a pairwise tree (the exact order: kernels/gvr_kernels.h),
    identical on the CPU and on CUDA. Blocks at or past ceil(lengths[b] / block_size), and blocks
    with no token, score -inf (also inside the keep ranges); then the keep ranges score +inf.
    """
    if compiling():
        _check_traced_stream(stream, "prr.block_scores")
        s, _ = _scores_op.call(q, meta, lengths, block_size, group_reduce, keep_first, keep_last)
        return traced_out(out, s, "out", "prr.block_scores")
    return _run_scores(q, meta, lengths, block_size, group_reduce, keep_first, keep_last, out, None, stream)


def select_blocks(q, meta, k, lengths=None, *, block_size, group_reduce="max", init_blocks=1, local_blocks=2,
                  out=None, sorted=False, scores_out=None, stream=None):
    """Quest block selection -> int32 ``[B, Hkv, k]``: per (row, KV head) the k best blocks, -1 padded.

    ``block_scores(q, meta, lengths, block_size=..., group_reduce=..., keep_first=init_blocks,
    keep_last=local_blocks)``, then ``gvr.topk_decode`` over the [B * Hkv, Nb] scores with the row
    lengths ceil(lengths[b] / block_size) (one kernel chain on the device, no host round trip):
    min(k, valid blocks) distinct block numbers (the first ``init_blocks`` and the last
    ``local_blocks`` valid blocks always among them when k allows; ties, the +inf ones included, go to
    the lower block number), then -1. The order within a row is unspecified (a set) unless
    ``sorted=True``: then by descending score, ties to the lower block number (``gvr.topk_decode``'s
    sorted order, the same on every device; k <= 4096). The result is
    the ``indices`` that ``gvr.sparse_attention(q, K, V, indices, block_table=..., lengths=...,
    block_size=block_size)`` takes (Hsel = Hkv). Blocks with no token (pages out of range) score
    -inf and come last.

    scores_out: float32 ``[B, Hkv, Nb]`` (unit stride along Nb, on q's device) to also receive the
    scores the selection ranked *before* the keep ranges were forced to +inf, from the same pass over
    the metadata: bit for bit ``block_scores(q, meta, lengths, block_size=..., group_reduce=...,
    keep_first=0, keep_last=0)`` (-inf for blocks at or past the row's length and for blocks with no
    token), for a caller that needs both (PRR's EMA predictor) without a second read of the metadata.
    The selection is the same with or without it. Under torch.compile it is filled by a copy of the
    op's third result (still one scores pass).
    """
    if compiling():
        _check_traced_stream(stream, "prr.select_blocks")
        _check_blocks(init_blocks, "init_blocks")
        _check_blocks(local_blocks, "local_blocks")
        if isinstance(k, bool):
            raise TypeError("prr.select_blocks: 'k' must be an int >= 0, got bool")
        if isinstance(k, int) and k < 0:
            raise ValueError(f"prr.select_blocks: 'k' must be an int >= 0, got {k}")
        if meta.dim() != 5:
            raise ValueError(f"prr.select_blocks: 'meta' must be [B, Hkv, Nb, 2, D], got {list(meta.shape)}")
        B, Hkv, Nb = meta.shape[:3]
        if scores_out is None:
            s, c = _scores_op.call(q, meta, lengths, block_size, group_reduce, init_blocks, local_blocks)
        else:
            s, c, raw = _select_scores_op.call(q, meta, lengths, block_size, group_reduce, init_blocks, local_blocks)
            traced_out(scores_out, raw, "scores_out", "prr.select_blocks")  # (checked as eager calls check it)
        r = topk_decode(s.reshape(B * Hkv, Nb), k, lengths=c.reshape(B * Hkv), sorted=sorted).reshape(B, Hkv, k)
        return traced_out(out, r, "out", "prr.select_blocks")
    return _run_select(q, meta, k, lengths, block_size, group_reduce, init_blocks, local_blocks, out, stream, sorted,
                       scores_out)
