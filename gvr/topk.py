"""gvr.topk_decode: the Python wrapper (defaults, outputs in the caller's framework, the caller's
stream) and its torch.library ops ``gvr::topk_decode`` and ``gvr::topk_decode_out``.
Validation and computation happen in gvr._C."""
from __future__ import annotations


from . import _C
from ._interop import _torch_module, compiling, define_op, empty, framework, prepare, traced_out

__all__ = ["topk_decode"]


def _out_shape(scores, k):
    """[B, k] or [k], or None when it can't be read (gvr._C then reports the problem)."""
    shape = getattr(scores, "shape", None)
    if shape is None or len(shape) not in (1, 2) or isinstance(k, bool):
        return None
    try:
        k = int(k.__index__())
    except (AttributeError, TypeError):
        return None
    if k < 0:
        return None
    return (k,) if len(shape) == 1 else (int(shape[0]), k)


def _flat_rows(scores, fw, row_starts):
    """A flat scores buffer (``[N]`` with ``row_starts`` of any B rows, or ``[1, N]`` with B > 1): the
    ``[B, N]`` view of stride 0 over it (no copy), so every row reads the one buffer from its start."""
    if fw not in ("numpy", "torch", "cupy"):  # another DLPack producer: as given (gvr._C names a shape problem)
        return scores
    rs = getattr(row_starts, "shape", None)
    sh = getattr(scores, "shape", None)
    if rs is None or sh is None or len(rs) != 1 or not (len(sh) == 1 or (len(sh) == 2 and sh[0] == 1 and int(rs[0]) > 1)):
        return scores
    B, N = int(rs[0]), int(sh[-1])
    row = scores.reshape(1, N)
    if fw == "torch":
        return row.expand(B, N)
    if fw in ("numpy", "cupy"):
        return __import__(fw).broadcast_to(row, (B, N))
    return scores


def _eager(scores, k, prev_topk, lengths, out, sorted, stream, method, block_table=None, page_size=None,
           out_positions=None, row_starts=None, next_n=None, max_length=None):
    fw = framework(scores)
    if row_starts is not None:
        scores = _flat_rows(scores, fw, row_starts)
    if out is None:
        out = empty(scores, fw, _out_shape(scores, k), "int32")
    (s, p, n, o, bt, op, rs), stream, nosync = prepare(fw, scores, (scores, prev_topk, lengths, out, block_table,
                                                                    out_positions, row_starts), stream)
    r = _C.topk_decode(s, k, p, n, o, sorted, stream, method, nosync, bt, page_size, op, rs, next_n, max_length)
    return r if out is None else out


# -- torch.library ops (used while torch.compile traces; eager calls run _eager directly) ----------
def _impl(scores, k, prev_topk, lengths, sorted, method, row_starts=None, next_n=1, max_length=None):
    return _eager(scores, k, prev_topk, lengths, None, sorted, None, method, row_starts=row_starts, next_n=next_n,
                  max_length=max_length)


def _fake(scores, k, prev_topk, lengths, sorted, method, row_starts=None, next_n=1, max_length=None):
    if row_starts is not None and (row_starts.shape[0] > 1 or scores.dim() == 1):  # as _flat_rows
        shape = (row_starts.shape[0], k)
    else:
        shape = (k,) if scores.dim() == 1 else (scores.shape[0], k)
    return scores.new_empty(shape, dtype=_torch_module().int32)


def _impl_out(scores, k, prev_topk, lengths, out, sorted, method, row_starts=None, next_n=1, max_length=None):
    _eager(scores, k, prev_topk, lengths, out, sorted, None, method, row_starts=row_starts, next_n=next_n,
           max_length=max_length)


def _fake_out(scores, k, prev_topk, lengths, out, sorted, method, row_starts=None, next_n=1, max_length=None):
    return None


_ARGS = "Tensor scores, SymInt k, Tensor? prev_topk, Tensor? lengths"
_ROWS = "Tensor? row_starts=None, int next_n=1, int? max_length=None"
_op = define_op("topk_decode", f"({_ARGS}, bool sorted, str method, {_ROWS}) -> Tensor", impl=_impl, fake=_fake)
_op_out = define_op("topk_decode_out", f"({_ARGS}, Tensor(a!) out, bool sorted, str method, {_ROWS}) -> ()",
                    impl=_impl_out, fake=_fake_out, mutates_args=("out",))


def _impl_pt(scores, k, prev_topk, lengths, block_table, page_size, sorted, method, row_starts=None, next_n=1,
             max_length=None):
    pos = _fake(scores, k, prev_topk, lengths, sorted, method, row_starts, next_n)
    pos = _torch_module().empty_like(pos)
    slots = _eager(scores, k, prev_topk, lengths, None, sorted, None, method, block_table, page_size, pos,
                   row_starts, next_n, max_length)
    return slots, pos


def _fake_pt(scores, k, prev_topk, lengths, block_table, page_size, sorted, method, row_starts=None, next_n=1,
             max_length=None):
    return (_fake(scores, k, prev_topk, lengths, sorted, method, row_starts, next_n),
            _fake(scores, k, prev_topk, lengths, sorted, method, row_starts, next_n))


_op_pt = define_op("topk_decode_page_table",
                   f"({_ARGS}, Tensor block_table, int page_size, bool sorted, str method, {_ROWS}) -> "
                   "(Tensor, Tensor)", impl=_impl_pt, fake=_fake_pt)


def _traced(scores, k, prev_topk, lengths, out, sorted, stream, method, block_table=None, page_size=None,
            out_positions=None, row_starts=None, next_n=None, max_length=None):
    if stream is not None:
        raise ValueError("'stream' is not supported under torch.compile: call gvr.topk_decode inside "
                         "`with torch.cuda.stream(s):` instead")
    # the scalar checks gvr._C makes in eager calls (the fake implementations run before any)
    if not isinstance(sorted, bool):
        raise TypeError(f"'sorted' must be a bool, got {type(sorted).__name__}")
    for nm, v in (("k", k), ("page_size", page_size), ("next_n", next_n), ("max_length", max_length)):
        if isinstance(v, bool):
            raise TypeError(f"'{nm}' must be an int, got bool")
    if isinstance(k, int) and k < 0:
        raise ValueError(f"'k' must be an int >= 0, got {k}")
    nn = 1 if next_n is None else next_n
    if block_table is not None:
        if page_size is None:
            raise ValueError("'page_size' is required with 'block_table' (tokens per page, >= 1)")
        slots, pos = _op_pt.call(scores, k, prev_topk, lengths, block_table, page_size, sorted, method, row_starts,
                                 nn, max_length)
        traced_out(out_positions, pos, "out_positions", "topk_decode")
        return traced_out(out, slots, "out", "topk_decode")
    if out_positions is not None:
        raise ValueError("'out_positions' applies only with 'block_table' (without it, 'out' holds the positions)")
    if out is None:
        return _op.call(scores, k, prev_topk, lengths, sorted, method, row_starts, nn, max_length)
    _op_out.call(scores, k, prev_topk, lengths, out, sorted, method, row_starts, nn, max_length)
    return out


def topk_decode(scores, k, *, prev_topk=None, lengths=None, out=None, sorted=False, stream=None, method="auto",
                block_table=None, page_size=None, out_positions=None, row_starts=None, next_n=None,
                max_length=None):
    """Exact Top-K of each row of ``scores``, warm-started by the previous decode step's Top-K.

    scores:    float32, float16 or bfloat16 ``[B, N]`` (or ``[N]``); unit stride along N, any row
               stride. NumPy arrays, torch tensors (CPU or CUDA), CuPy arrays or any DLPack producer.
               Half-precision scores are read directly (no conversion pass) and rank as their exact
               float32 values: the result is that of the float32 call on the converted scores.
    k:         int >= 0 (k = 0 gives an empty ``[B, 0]`` result).
    prev_topk: int32 ``[B, Kp]`` or ``[Kp]`` (shared by every row), or None: a hint only — any
               content (wrong, empty, -1, out of range, duplicated) gives the same result.
    lengths:   int32 ``[B]`` or None: row b uses ``scores[b, :lengths[b]]``.
    out:       int32 ``[B, k]`` (``[k]``) to write into; allocated otherwise in the caller's framework,
               on the scores' device (NumPy in -> NumPy out, torch in -> torch out, CuPy likewise).
    sorted:    a bool: order each row by descending value, ties by ascending index (other types are
               a TypeError).
    stream:    CUDA stream for CUDA inputs (an int handle, a torch.cuda.Stream or a CuPy stream);
               defaults to torch's current stream on the scores' device, or CuPy's current stream.
               Accepted and ignored for CPU inputs (NumPy, CPU tensors). Not supported under
               torch.compile: use ``with torch.cuda.stream(s):`` there.
    method:    "auto" (the fastest exact path measured for the shape; it leaves ``prev_topk`` out,
               which measured never faster, on the CPU or on CUDA: passing a hint never costs time),
               "gvr" (uses the hint for rows held in registers; streamed rows of large batches
               ignore it) or "radix" — a CUDA choice. Every method gives the same result;
               on the CPU all three run its one implementation (with the hint for "gvr" and
               "radix"), so code written for the GPU runs unchanged there.
    block_table, page_size: DSA's page-table transform, fused into the Top-K: with an int32
               ``[B, max_pages]`` (``[max_pages]`` for 1-D scores) block table of pages of
               ``page_size`` tokens (max_pages * page_size >= N), ``out`` receives the physical KV
               slots ``block_table[b, p // page_size] * page_size + p % page_size`` of the selected
               positions p (-1 stays -1; a page < 0 gives -1; slots must fit in int32: a host
               table whose pages overflow it is a ValueError, a CUDA table is not read by the
               host and is the caller's contract, as page numbers past the cache are) -- what
               ``gvr.sparse_attention`` and FlashMLA take as token indices without a block table.
    out_positions: int32 like ``out``, with ``block_table`` only: receives the positions too (the
               next step's ``prev_topk``).
    row_starts: int32 ``[B]`` or None: ragged rows (vLLM's prefill / MTP Top-K, FlashInfer's and
               SGLang's ``row_starts``): row b is ``scores[b, row_starts[b] : row_starts[b] + lengths[b]]``
               (to the end of the row without lengths), and its results are positions relative to
               ``row_starts[b]`` (add it back for indices into the buffer: FlashInfer's ragged
               transform). Scores of one row -- ``[N]`` with any number B of starts, or ``[1, N]``
               with B > 1 -- give B rows over that one flat buffer, no copy (result ``[B, k]``). Host values must lie in [0, N] with start + length <= N
               (ValueError); device values are clamped.
    next_n:    rows per request (MTP / speculative decoding: the next_n query rows of one request are
               consecutive), B a multiple of it. Then ``lengths``, ``prev_topk`` and ``block_table``
               may have one row per request (B / next_n rows) instead of one per row: the request's
               hint and block table serve its rows, and row b's length is ``lengths[b // next_n] -
               (next_n - 1 - b % next_n)`` (the causal rule of vLLM's decode Top-K), clamped at 0.

    Returns int32 indices: per row, the min(k, length) first elements of the order (value
    descending, -inf valid, NaN below -inf, -0.0 == +0.0, ties to the lower index), then -1.

    Under torch.compile the call is the custom op ``torch.ops.gvr.topk_decode`` (``topk_decode_out``
    with ``out=``), with fake implementations, so compiled graphs hold it without a graph break.
    """
    if compiling():
        return _traced(scores, k, prev_topk, lengths, out, sorted, stream, method, block_table, page_size,
                       out_positions, row_starts, next_n, max_length)
    return _eager(scores, k, prev_topk, lengths, out, sorted, stream, method, block_table, page_size, out_positions,
                  row_starts, next_n, max_length)
