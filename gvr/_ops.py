"""Python wrappers: defaults, output allocation in the caller's framework, the caller's stream.
Validation and computation happen in gvr._C."""
from __future__ import annotations

from . import _C

__all__ = ["topk_decode"]


def _framework(x):
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    return None


def _stream_handle(stream):
    if stream is None or isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(f"'stream' must be an int handle, a torch.cuda.Stream or a cupy Stream, got {type(stream).__name__}")


def _row_shape(scores, k):
    """Output shape for scores, or None when it can't be read (gvr._C then reports the problem)."""
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


def _prepare(x, fw):
    """torch tensors that require grad cannot be exported through DLPack; the op is not differentiable."""
    if fw == "torch" and getattr(x, "requires_grad", False):
        return x.detach()
    return x


def topk_decode(scores, k, *, prev_topk=None, lengths=None, out=None, sorted=False, stream=None, method="auto"):
    """Exact Top-K of each row of ``scores``, warm-started by the previous decode step's Top-K.

    scores:    float32 ``[B, N]`` (or ``[N]``); unit stride along N, any row stride.
    k:         int >= 0.
    prev_topk: int32 ``[B, Kp]`` or ``[Kp]`` (shared by every row), or None: a hint only — any
               content (wrong, empty, -1, out of range, duplicated) gives the same result.
    lengths:   int32 ``[B]`` or None: row b uses ``scores[b, :lengths[b]]``.
    out:       int32 ``[B, k]`` (``[k]``) to write into; allocated in the caller's framework otherwise.
    sorted:    order each row by descending value, ties by ascending index.
    stream:    CUDA stream for CUDA inputs (int handle or a torch/CuPy stream); defaults to torch's or
               CuPy's current stream.
    method:    CUDA path: "auto" (fastest exact path for the shape and hint), "gvr" or "radix".
               Every method gives the same result; the CPU has one implementation.

    Returns int32 indices: per row, the min(k, length) first elements of the order (value
    descending, -inf valid, NaN below -inf, -0.0 == +0.0, ties to the lower index), then -1.
    """
    fw = _framework(scores)
    stream = _stream_handle(stream)
    nosync = 0  # bit i: argument i's producer runs on `stream` (see gvr._C.topk_decode)
    if fw is not None:
        scores = _prepare(scores, fw)
        if prev_topk is not None:
            prev_topk = _prepare(prev_topk, _framework(prev_topk))
        cuda = fw == "torch" and scores.is_cuda or fw == "cupy"
        if out is None:
            shape = _row_shape(scores, k)
            if shape is not None:
                if fw == "torch":
                    import torch

                    out = torch.empty(shape, dtype=torch.int32, device=scores.device)
                else:
                    import cupy

                    with scores.device:
                        out = cupy.empty(shape, dtype=cupy.int32)
        if cuda and fw == "torch":
            import torch

            current = torch.cuda.current_stream(scores.device).cuda_stream
            if stream is None:
                stream = current
            if stream == current:
                # torch tensors on their current stream need no DLPack stream hand-shake: ask for
                # none (torch's equal-stream check costs ~13 us of host time per tensor)
                for bit, a in enumerate((scores, prev_topk, lengths, out)):
                    if a is not None and _framework(a) == "torch":
                        nosync |= 1 << bit
        elif cuda and stream is None:
            import cupy

            stream = cupy.cuda.get_current_stream().ptr
    return _C.topk_decode(scores, k, prev_topk, lengths, out, bool(sorted), stream, method, nosync)
