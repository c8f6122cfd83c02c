"""gvr.sparda: SparDA (paper 004) -- block selection one layer ahead by a Forecast head per GQA group,
and prefetch of the selected KV blocks from pinned host memory.

Built so far: the Forecast's training objective, ``forecast_kl_loss`` (section 4.4; PyTorch only, as
training is), the Forecast indexer's selection, ``forecast_select`` (section 4.3), and the compressed
keys it scores, ``compressed_keys`` / ``update_compressed_keys`` (eq. 5); the KV cache in pinned host
memory, ``HostKVCache``, ``prefetch`` of the selected blocks into a GPU staging cache, and the persistent
``Prefetcher`` (built, gated until its GPU tests pass).
"""
from __future__ import annotations

import contextlib
import math
import numbers

import numpy as np

from . import _C
from ._interop import (
    _host_view, _torch_module, check_int, compiling, define_op, framework, is_cuda, prepare, stream_handle,
    torch_if_loaded, traced_out,
)
from .attention import _check_traced_stream, _new, _stream_for, cached_workspace

__all__ = ["forecast_kl_loss", "forecast_select", "compressed_keys", "update_compressed_keys", "HostKVCache", "prefetch",
           "Prefetcher", "matmul_carveout"]


def _torch(what="this gvr.sparda call"):
    t = torch_if_loaded()  # (not sys.modules: traced code, torch.compile of the loss, must not read it)
    if t is None:
        try:
            import torch as t
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError(f"{what} needs torch") from e
    return t


_I32_MAX = 2**31 - 1

# forecast_select runs select_blocks' intake on a stride-0 metadata view of ktilde: its messages, in
# forecast_select's own names
_FORECAST_NAMES = (("[B, Hkv, Nb, 2, D]", "[B, Hkv, Nc, D]"), ("window - 1 + Nb * block_size", "kernel - 1 + Nc * stride"),
                   ("'meta'", "'ktilde'"), ("'q'", "'F'"), ("'window'", "'kernel'"), ("'block_size'", "'stride'"),
                   ("prr.block_scores", "sparda.forecast_select"), ("prr.select_blocks", "sparda.forecast_select"))


def _forecast_error(e):
    msg = str(e)
    for a, b in _FORECAST_NAMES:
        msg = msg.replace(a, b)
    if msg == str(e):
        return e
    try:
        new = type(e)(msg)
    except Exception:  # an exception class whose constructor takes other arguments: the original
        return e
    new.__cause__ = e.__cause__
    return new


def forecast_kl_loss(q_scores_fine, f_scores, k, *, pool_kernel=32, pool_stride=16, tau=1.0, eligible=None,
                     reduction="mean"):
    """SparDA's Forecast objective (paper 004, eq. 12-14): KL(target || forecast) over the target's
    top-k blocks plus one "rest" bucket.

    q_scores_fine: float ``[..., N_fine]``, the query-derived target on the fine compression grid
        (eq. 12: per position the sum over the GQA group's heads of softmax(Q K_fine^T / tau)),
        non-negative; 0 where a position is masked (causally).
    f_scores: float ``[..., N_b]``, the Forecast's logits on the inference grid (F K~^T, eq. 11/13,
        before the temperature); -inf where a block is masked. ``forecast = softmax(f_scores / tau)``.
    k: int >= 1, blocks kept individually.
    pool_kernel, pool_stride: the target is max-pooled to the inference grid: block j takes the
        maximum of ``q_scores_fine[..., j*pool_stride : j*pool_stride + pool_kernel]`` (windows cut at
        N_fine; a window past the end gives 0). Defaults: the fine grid of kernel 2, stride 1 against
        InfLLM-V2's inference grid of kernel 32, stride 16 (block j covers tokens [16j, 16j + 32),
        fine position i covers [i, i + 2)); with fine stride 1, pass the inference grid's stride and
        its kernel.
    eligible: None, or bool ``[..., N_b]`` (broadcastable): the blocks that may enter the top-k set
        (False for the always-kept initial and local blocks, which then count in the rest bucket).
    reduction: "mean" (over the leading rows), "sum" (eq. 14's sum) or "none" (``[...]``).

    Per row: S = the k eligible blocks of largest pooled target (ties to the lower block number; fewer
    when fewer are eligible); both distributions are restricted to (S, rest) and renormalized: target
    ``t_S / T``, ``sum_{not S} t / T`` with T the pooled target's total; forecast ``p_S``,
    ``sum_{not S} p`` (computed in log space). KL = sum t (log t - log p) with 0 log 0 = 0 (a row whose target total is 0
    contributes 0). Differentiable in both inputs (S is a constant of the step). Gradient flows to the
    Forecast's logits through every block, the non-selected ones via the rest bucket.
    """
    torch = _torch("gvr.sparda.forecast_kl_loss")
    k = check_int("k", k, 1)
    pool_kernel = check_int("pool_kernel", pool_kernel, 1)
    pool_stride = check_int("pool_stride", pool_stride, 1)
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):  # Python and NumPy numbers
        raise TypeError(f"'tau' must be a float > 0, got {type(tau).__name__}")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"'tau' must be a finite float > 0, got {tau!r}")
    tau = float(tau)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"'reduction' must be 'mean', 'sum' or 'none', got {reduction!r}")
    for name, x in (("q_scores_fine", q_scores_fine), ("f_scores", f_scores)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"'{name}' must be a torch tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"'{name}' must be a floating-point tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] < 1:
            raise ValueError(f"'{name}' must have a non-empty last dimension, got shape {list(x.shape)}")
    if q_scores_fine.shape[:-1] != f_scores.shape[:-1]:
        raise ValueError(f"'q_scores_fine' and 'f_scores' must share their leading dimensions, got "
                         f"{list(q_scores_fine.shape)} and {list(f_scores.shape)}")
    if q_scores_fine.device != f_scores.device:
        raise ValueError(f"'q_scores_fine' and 'f_scores' must be on one device, got {q_scores_fine.device} and "
                         f"{f_scores.device}")
    nb, nf = f_scores.shape[-1], q_scores_fine.shape[-1]
    dt = torch.promote_types(q_scores_fine.dtype, f_scores.dtype)
    tgt_f = q_scores_fine.to(dt)
    # max-pool to the inference grid (windows cut at N_fine, empty windows 0): only the windows that start
    # inside the row are pooled (a kernel past N_fine covers what one of N_fine does), the rest are 0
    kern = min(pool_kernel, nf)
    inside = min(nb, -(-nf // pool_stride))
    need = (inside - 1) * pool_stride + kern
    if need > nf:
        tgt_f = torch.nn.functional.pad(tgt_f, (0, need - nf))
    tgt = tgt_f.unfold(-1, kern, pool_stride)[..., :inside, :].amax(-1)
    if inside < nb:
        tgt = torch.nn.functional.pad(tgt, (0, nb - inside))
    logits = f_scores.to(dt) / tau
    # the top-k set of the target among eligible blocks: stable descending sort (ties to the lower index)
    key = tgt.detach()
    elig = None
    if eligible is not None:
        if not isinstance(eligible, torch.Tensor) or eligible.dtype != torch.bool:
            raise TypeError(f"'eligible' must be a bool tensor [..., N_b] or None, got "
                            f"{getattr(eligible, 'dtype', type(eligible).__name__)}")
        try:
            elig = torch.broadcast_to(eligible.to(key.device), key.shape)
        except RuntimeError as e:
            raise ValueError(f"'eligible' must broadcast to {list(key.shape)}, got {list(eligible.shape)}") from e
        key = torch.where(elig, key, torch.full_like(key, -float("inf")))
    kk = min(k, nb)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :kk]
    in_s = torch.zeros(key.shape, dtype=torch.bool, device=key.device).scatter_(-1, order, True)
    if elig is not None:
        in_s &= elig  # fewer than k eligible: the ineligible ones sorted last never count
    # target restricted: (t_S, T - sum t_S) / T
    total = tgt.sum(-1, keepdim=True)
    t_s = torch.where(in_s, tgt, torch.zeros_like(tgt))
    t_rest = torch.where(in_s, torch.zeros_like(tgt), tgt).sum(-1, keepdim=True)  # exactly 0 when S is all
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    t_s, t_rest = t_s / safe_total, t_rest / safe_total
    # forecast restricted, log space: log p_S = logits_S - lse(all); log p_rest = lse(not S) - lse(all)
    lse_all = torch.logsumexp(logits, -1, keepdim=True)
    rest_logits = torch.where(in_s, torch.full_like(logits, -float("inf")), logits)
    rest_has = torch.isfinite(rest_logits).any(-1, keepdim=True)
    rest_logits = torch.where(rest_has, rest_logits, torch.zeros_like(rest_logits))  # finite where unused
    log_p_rest = torch.where(rest_has, torch.logsumexp(rest_logits, -1, keepdim=True) - lse_all,
                             torch.full_like(lse_all, -float("inf")))
    log_p_s = logits - lse_all

    def term(t, log_p):
        pos = t > 0
        t_safe = torch.where(pos, t, torch.ones_like(t))
        lp_safe = torch.where(pos, log_p, torch.zeros_like(log_p))
        return torch.where(pos, t * (torch.log(t_safe) - lp_safe), torch.zeros_like(t))

    kl = term(t_s, log_p_s).sum(-1) + term(t_rest, log_p_rest).squeeze(-1)
    # a target with NaN or +inf has no distribution: its row's loss is NaN (never a finite number that
    # training would follow)
    kl = torch.where(torch.isfinite(total.squeeze(-1)), kl, torch.full_like(kl, float("nan")))
    if reduction == "none":
        return kl
    return kl.sum() if reduction == "sum" else kl.mean()


def _host_array(x, name):
    """x as a NumPy array: NumPy arrays and lists as np.asarray takes them, other DLPack producers in host
    memory by np.from_dlpack (no copy); a producer on a device is a TypeError naming x"""
    if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        return np.asarray(x)
    try:
        return np.from_dlpack(x)
    except Exception as e:
        raise TypeError(f"'{name}' must be a torch tensor, a NumPy array or a DLPack producer in host memory, got "
                        f"{type(x).__name__} ({type(e).__name__}: {e})") from None


def _num_windows(lengths, kernel, stride):
    """complete compression windows per row: len >= kernel ? (len - kernel) // stride + 1 : 0 (int32, same
    framework and device as lengths; no host round trip for device tensors)."""
    if type(lengths).__module__.startswith("torch"):
        t = _torch()
        n = t.div(lengths.to(t.int64) - kernel, stride, rounding_mode="floor") + 1
        return n.clamp_min(0).to(t.int32)
    ln = _host_array(lengths, "lengths")
    if ln.dtype != np.int32:
        raise TypeError(f"'lengths' must be int32 [B], got {ln.dtype}"
                        + ("" if hasattr(lengths, "dtype") else f" (from a {type(lengths).__name__})"))
    return np.maximum((ln.astype(np.int64) - kernel) // stride + 1, 0).astype(np.int32)


def forecast_select(F, ktilde, k, *, lengths, kernel=32, stride=16, init_blocks=1, local_blocks=2, out=None,
                    stream=None):
    """SparDA's Forecast indexer (paper 004, section 4.3): the next layer's blocks from one Forecast head per
    GQA group -> int32 ``[B, Hkv, k]`` (block ids, -1 padded).

    F: ``[B, Hkv, D]`` (the Forecast, one head per KV head / GQA group); ktilde: ``[B, Hkv, Nc, D]`` the
    next layer's compressed keys in F's dtype (window j = tokens ``[j*stride, j*stride + kernel)``, mean
    pooled); lengths: int32 ``[B]`` tokens per row -- window j is valid when ``j*stride + kernel <=
    lengths[b]`` (Nc must cover every valid window). Score of window j: ``F[b, h] . ktilde[b, h, j]``
    (float32 accumulation, the order of ``gvr.prr.block_scores``); then the Top-k (``gvr.topk_decode``:
    ties to the lower id) with the first ``init_blocks`` and the last ``local_blocks`` valid windows always
    among them (when k allows), -1 padding -- one kernel chain, no host round trip (on CUDA two kernels: the
    scores, which count each row's windows from ``lengths`` themselves, then the Top-K; host lengths must
    be >= 0, device ones are clamped). With ``kernel ==
    stride == G`` the ids are the ``G``-token blocks that ``gvr.sparse_attention(..., block_table=,
    block_size=G)`` takes. NumPy / torch CPU (C) and CUDA (float16 / bfloat16, D 64/128/256).

    Built on ``gvr.prr.select_blocks`` with ktilde as a Quest metadata whose minimum and maximum are the
    same tensor (a stride-0 view: no copy), over blocks of one "token" per window.
    """
    from ._prr_select import _run_select, select_blocks
    kernel = check_int("kernel", kernel, 1, _I32_MAX)
    stride = check_int("stride", stride, 1, _I32_MAX)
    if hasattr(ktilde, "__dlpack__") and not isinstance(ktilde, np.ndarray) and \
            not type(ktilde).__module__.startswith("torch"):  # another DLPack producer: viewed in NumPy
        ktilde = _host_array(ktilde, "ktilde")
    shape = getattr(ktilde, "shape", None)
    if shape is None:
        raise TypeError(f"'ktilde' must be an array [B, Hkv, Nc, D], got {type(ktilde).__name__}")
    if len(shape) != 4:
        raise ValueError(f"'ktilde' must be [B, Hkv, Nc, D], got {list(shape)}")
    B, H, Nc, D = (int(v) for v in shape)
    fshape = getattr(F, "shape", None)
    if fshape is None:
        raise TypeError(f"'F' must be an array [B, Hkv, D], got {type(F).__name__}")
    if tuple(int(v) for v in fshape) != (B, H, D):
        raise ValueError(f"'F' must have shape [B, Hkv, D] = [{B}, {H}, {D}] (from 'ktilde' [B, Hkv, Nc, D]), got "
                         f"{list(fshape)}")
    if type(ktilde).__module__.startswith("torch"):
        meta = ktilde.unsqueeze(3).expand(B, H, Nc, 2, D)
    else:
        kt = _host_array(ktilde, "ktilde")
        meta = np.lib.stride_tricks.as_strided(kt, (B, H, Nc, 2, D), kt.strides[:3] + (0,) + kt.strides[3:],
                                               writeable=False)
    if compiling():  # the window counts by torch ops (inductor fuses them), then select_blocks' ops
        return select_blocks(F, meta, k, _num_windows(lengths, kernel, stride), block_size=1,
                             init_blocks=init_blocks, local_blocks=local_blocks, out=out, stream=stream)
    k = check_int("k", k, 0, _I32_MAX)  # before select_blocks allocates [B, Hkv, k]
    on_device = type(lengths).__module__.startswith("torch") and lengths.is_cuda
    if not on_device:  # host counts are checked here (device ones are clamped by the kernels)
        nwin = _num_windows(lengths, kernel, stride)
        n_host = nwin.numpy() if type(nwin).__module__.startswith("torch") else nwin
        most = int(n_host.max()) if n_host.size else 0
        if most > Nc:
            raise ValueError(f"'lengths' implies {most} complete windows of {kernel} tokens every {stride}, more than "
                             f"'ktilde' holds (Nc = {Nc})")
    # the scores kernel counts the windows from the token counts itself (window = kernel, block_size =
    # stride): two kernels on the device (scores, Top-K), none before them
    try:
        return _run_select(F, meta, k, lengths, stride, "max", init_blocks, local_blocks, out, stream,
                           window=kernel, name="sparda.forecast_select")
    except (ValueError, TypeError) as e:
        new = _forecast_error(e)
        if new is e:
            raise
        raise new from e.__cause__


def _ckeys_shape(k_cache, block_table, kernel, stride):
    """[B, Hkv, Nc, D], or None when the shapes can't be read (gvr._C then names the problem)."""
    ks, bs = getattr(k_cache, "shape", None), getattr(block_table, "shape", None)
    if ks is None or bs is None or len(ks) != 4 or len(bs) != 2:
        return None
    cap = int(bs[1]) * int(ks[1])
    return (int(bs[0]), int(ks[2]), (cap - kernel) // stride + 1 if cap >= kernel else 0, int(ks[3]))


def _run_ckeys(k_cache, block_table, end, start, out, kernel, stride, stream):
    """gvr._C.sparda_compressed_keys: build (start None) into out (allocated when None) or update out."""
    kernel = check_int("kernel", kernel, 1, _I32_MAX)
    stride = check_int("stride", stride, 1, _I32_MAX)
    fw = framework(k_cache)
    if out is None:  # in k_cache's dtype; an fp8 cache's: bfloat16
        shape = _ckeys_shape(k_cache, block_table, kernel, stride)
        if shape is not None and max(shape) > _I32_MAX:
            raise ValueError(f"sparda.compressed_keys: 'k_cache' and 'block_table' imply ktilde {list(shape)}, a dimension "
                             f"past int32 (max_pages * P = {int(block_table.shape[1]) * int(k_cache.shape[1])} tokens)")
        out = _new(k_cache, fw, shape, _ckeys_dtype(k_cache))
    # gvr._C's spec order (k_cache, block_table, end, start, ktilde): nosync's bits follow it
    (k, bt, e, s, o), stream, nosync = prepare(fw, k_cache, (k_cache, block_table, end, start, out), stream)
    _C.sparda_compressed_keys(k, bt, e, o, kernel, stride, s, stream, nosync)
    return out


def _ckeys_impl(k_cache, block_table, lengths, kernel, stride):
    return _run_ckeys(k_cache, block_table, lengths, None, None, kernel, stride, None)


def _is_e4m3(x):
    """whether x holds fp8 e4m3fn values: torch.float8_e4m3fn, or NumPy's ml_dtypes.float8_e4m3fn"""
    t = torch_if_loaded()
    if t is not None and isinstance(x, t.Tensor):
        return x.dtype == getattr(t, "float8_e4m3fn", None)
    return getattr(getattr(x, "dtype", None), "name", None) == "float8_e4m3fn"


def _ckeys_dtype(k_cache):
    """ktilde's dtype name for _new: None (k_cache's); an fp8 cache's: bfloat16 (torch) or float32 (NumPy,
    which has no bfloat16 of its own)"""
    if not _is_e4m3(k_cache):
        return None
    return "float32" if type(k_cache).__module__.startswith("numpy") else "bfloat16"


def _ckeys_fake(k_cache, block_table, lengths, kernel, stride):
    dt = _ckeys_dtype(k_cache)
    shape = _ckeys_shape(k_cache, block_table, kernel, stride)
    return k_cache.new_empty(shape) if dt is None else k_cache.new_empty(shape, dtype=getattr(_torch_module(), dt))


def _ckeys_update_impl(ktilde, k_cache, block_table, start, end, kernel, stride):
    _run_ckeys(k_cache, block_table, end, start, ktilde, kernel, stride, None)


def _ckeys_update_fake(ktilde, k_cache, block_table, start, end, kernel, stride):
    return None


_ckeys_op = define_op("sparda_compressed_keys", "(Tensor k_cache, Tensor block_table, Tensor? lengths, int kernel, "
                      "int stride) -> Tensor", impl=_ckeys_impl, fake=_ckeys_fake)
_ckeys_update_op = define_op("sparda_update_compressed_keys", "(Tensor(a!) ktilde, Tensor k_cache, Tensor block_table, "
                             "Tensor start, Tensor end, int kernel, int stride) -> ()", impl=_ckeys_update_impl,
                             fake=_ckeys_update_fake, mutates_args=("ktilde",))


def compressed_keys(k_cache, block_table, lengths=None, *, kernel=32, stride=16, out=None, stream=None):
    """Mean-pooled keys of a paged K cache (InfLLM-V2 / SparDA, paper 004 eq. 5) -> ``ktilde [B, Hkv, Nc,
    D]`` in k_cache's dtype (an fp8 e4m3fn cache's: bfloat16, or ``out``'s float16 / float32; the fp8 values
    decoded exactly, unscaled: a positive per-tensor k_scale scales every Forecast score alike), Nc = the
    windows of ``kernel`` tokens every ``stride`` in max_pages * P tokens.

    Window j of row b = tokens ``[j*stride, j*stride + kernel)`` (token t at page ``block_table[b, t // P]``,
    slot ``t % P``; a page < 0 or >= num_pages counts as zeros): its float32 sum in token order divided by
    ``kernel``, rounded to the cache's dtype, for every window complete within ``lengths[b]`` (default
    max_pages * P); the row's other windows are zero. Deterministic; the CPU (C) and CUDA (float16 /
    bfloat16) give the same bits. ``update_compressed_keys`` keeps it current as tokens arrive. Under
    torch.compile: the op ``torch.ops.gvr.sparda_compressed_keys``.
    """
    if compiling():
        _check_traced_stream(stream, "sparda.compressed_keys")
        kernel = check_int("kernel", kernel, 1, _I32_MAX)
        stride = check_int("stride", stride, 1, _I32_MAX)
        if k_cache.dim() != 4 or block_table.dim() != 2:
            raise ValueError(f"sparda.compressed_keys: 'k_cache' must be [num_pages, P, Hkv, D] and 'block_table' "
                             f"[B, max_pages], got {list(k_cache.shape)} and {list(block_table.shape)}")
        r = _ckeys_op.call(k_cache, block_table, lengths, kernel, stride)
        t = _torch_module()
        fp8 = k_cache.dtype == getattr(t, "float8_e4m3fn", None)  # eager writes any float ktilde of an fp8 cache
        return traced_out(out, r, "out", "sparda.compressed_keys", (t.float16, t.bfloat16, t.float32) if fp8 else None)
    return _run_ckeys(k_cache, block_table, lengths, None, out, kernel, stride, stream)


def update_compressed_keys(ktilde, k_cache, block_table, start, end, *, kernel=32, stride=16, stream=None):
    """Fold the tokens ``[start[b], end[b])`` appended to each row into ``ktilde`` in place -> ``ktilde``:
    the windows those tokens complete (window end in ``(start[b], end[b]]``) are written as
    ``compressed_keys`` defines them; nothing else changes. start, end: int32 ``[B]``. Under
    torch.compile: the op ``torch.ops.gvr.sparda_update_compressed_keys``."""
    if start is None or end is None:
        raise TypeError("sparda.update_compressed_keys: 'start' and 'end' must be given (int32 [B])")
    if compiling():
        _check_traced_stream(stream, "sparda.update_compressed_keys")
        _ckeys_update_op.call(ktilde, k_cache, block_table, start, end, kernel, stride)
        return ktilde
    return _run_ckeys(k_cache, block_table, end, start, ktilde, kernel, stride, stream)


# --------------------------------------------------------------------------------------------------
# the KV cache in pinned host memory, and prefetch of selected blocks into a GPU staging cache
# --------------------------------------------------------------------------------------------------
_METHODS = {"auto": 0, "kernel": 1, "memcpy": 2, "tma": 3}


@contextlib.contextmanager
def matmul_carveout(sms):
    """Keep torch's matmuls off ``sms`` SMs inside the ``with`` block, so that ``prefetch``'s gather
    CTAs (``"tma"``: ``max_ctas``, default 2, each holding most of an SM's shared memory) do not push a
    concurrent matmul into a longer tail. torch's cuBLASLt backend sizes its grid for the SMs left
    (``torch._C._set_sm_carveout_experimental``, which torch marks experimental); the block selects
    that backend and restores the previous backend and carveout on exit. Measured (H100, bf16 matmul
    8192 x 8192 x 8192 beside gathers of 512 64-token blocks, ``benchmarks/RESULTS.md``): ``"tma"`` with 2 CTAs slows
    it by 6.6-9.0% without a carveout and 2.7-2.8% with 4 SMs kept free; 1 CTA by 0.3-0.7% with 1-2 SMs. Process-wide:
    every matmul of every thread in the block is carved. ``sms`` 0 keeps them all.

        with gvr.sparda.matmul_carveout(4):
            graph.replay()   # layers' matmuls beside the next layer's prefetch
    """
    sms = check_int("sms", sms, 0)
    t = _torch("gvr.sparda.matmul_carveout")
    setter = getattr(t._C, "_set_sm_carveout_experimental", None)
    getter = getattr(t._C, "_get_sm_carveout_experimental", None)
    if setter is None or getter is None:
        raise RuntimeError(f"gvr.sparda.matmul_carveout: torch {t.__version__} has no SM carveout for matmuls "
                           "(torch._C._set_sm_carveout_experimental)")
    if t.cuda.is_available():
        total = t.cuda.get_device_properties(t.cuda.current_device()).multi_processor_count
        if sms >= total:
            raise ValueError(f"'sms' must be below this GPU's {total} SMs, got {sms}")
    before, blas = getter(), t.backends.cuda.preferred_blas_library()
    try:
        t.backends.cuda.preferred_blas_library("cublaslt")
        setter(sms)
        yield sms
    finally:
        setter(before)
        t.backends.cuda.preferred_blas_library(blas)


def _torch_dtype(dtype):
    t = torch_if_loaded()
    return t is not None and isinstance(dtype, t.dtype)


class HostKVCache:
    """K and V of ``num_layers`` layers in paged host memory -- pinned and device-mapped (cudaHostAlloc,
    portable) on ``device="cuda"``, plain host memory on ``device="cpu"`` -- for SparDA (paper 004): the
    GPU reads selected blocks from it with :func:`prefetch` and writes new tokens with :meth:`append`.

    ``k(layer)`` / ``v(layer)``: ``[num_pages, P, Hkv, D]`` views (layout "NHD"; "HND" stores each page as
    ``[Hkv, P, D]`` and returns permuted views), zero-filled at creation; NumPy arrays for a NumPy dtype,
    torch CPU tensors for a torch dtype (bfloat16 and float8_e4m3fn included: an fp8 cache prefetched to an
    fp8 staging cache is what ``gvr.sparse_attention(..., k_scale=, v_scale=)`` reads). A block of
    :func:`prefetch` is one page.
    ``close()`` frees the memory now (BufferError while views of it are alive, as ``mmap``); also a context
    manager. Memory: ``2 * num_layers * num_pages * P * Hkv * D * itemsize`` bytes (``nbytes``).
    """

    def __init__(self, num_layers, num_pages, P, Hkv, D, dtype, *, device="cuda", layout="NHD"):
        import numpy as np
        num_layers, num_pages, P, Hkv, D = (check_int(name, v, 1, _I32_MAX) for name, v in (
            ("num_layers", num_layers), ("num_pages", num_pages), ("P", P), ("Hkv", Hkv), ("D", D)))
        if layout not in ("NHD", "HND"):
            raise ValueError(f"'layout' must be 'NHD' or 'HND', got {layout!r}")
        dev = str(device)
        if dev != "cpu" and not dev.startswith("cuda"):
            raise ValueError(f"'device' must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
        if dtype is None:
            raise TypeError("'dtype' must be a NumPy or torch dtype, got None")
        self._torch = _torch_dtype(dtype)
        if self._torch:
            t = _torch()
            itemsize = t.empty((), dtype=dtype).element_size()
            fp8 = getattr(t, "float8_e4m3fn", None)
            if dtype not in (t.float16, t.bfloat16, t.float32, t.uint8) and (fp8 is None or dtype != fp8):
                raise TypeError(f"'dtype' must be float16, bfloat16, float32, float8_e4m3fn or uint8, got {dtype}")
        else:
            try:
                npd = np.dtype(dtype)
            except TypeError as e:
                raise TypeError(f"'dtype' must be a NumPy or torch dtype, got {dtype!r}") from e
            if npd not in (np.float16, np.float32, np.uint8):
                raise TypeError(f"'dtype' must be float16, float32 or uint8 (bfloat16: a torch dtype), got {npd}")
            itemsize = npd.itemsize
        self.num_layers, self.num_pages, self.P, self.Hkv, self.D = num_layers, num_pages, P, Hkv, D
        self.dtype, self.layout, self.device = dtype, layout, dev
        per = num_pages * P * Hkv * D * itemsize
        if 2 * num_layers * per > 2**62:
            raise ValueError(f"HostKVCache: 2 x num_layers x num_pages x P x Hkv x D x {itemsize} bytes = "
                             f"{2 * num_layers * per} bytes is past what any host can hold")
        self._per = per
        if dev.startswith("cuda") and ":" in dev:
            self._set_device(int(dev.split(":")[1]))
        try:
            self._buf = _C.HostBuffer(2 * num_layers * per, pinned=dev != "cpu")
        except MemoryError as e:
            raise MemoryError(f"HostKVCache: {2 * num_layers * per} bytes of {'pinned ' if dev != 'cpu' else ''}host "
                              f"memory could not be allocated" + (f" ({e})" if str(e) else "")) from None
        self.nbytes = 2 * num_layers * per
        self._views = [self._make(i) for i in range(2 * num_layers)]

    @staticmethod
    def _set_device(i):
        t = torch_if_loaded()
        if t is not None and t.cuda.is_available():
            t.cuda.set_device(i)

    def _make(self, i):
        import numpy as np
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=self._per, offset=i * self._per)
        N, P, H, D = self.num_pages, self.P, self.Hkv, self.D
        shape = (N, P, H, D) if self.layout == "NHD" else (N, H, P, D)
        if self._torch:
            t = _torch()
            x = t.from_numpy(raw).view(self.dtype).view(shape)
        else:
            x = raw.view(np.dtype(self.dtype)).reshape(shape)
        if self.layout == "HND":
            x = x.permute(0, 2, 1, 3) if self._torch else x.transpose(0, 2, 1, 3)
        return x

    @property
    def pinned(self):
        return bool(self._buf.pinned)

    @property
    def closed(self):
        return self._views is None

    def _check(self, layer):
        if self._views is None:
            raise ValueError("this HostKVCache is closed")
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < self.num_layers:
            raise ValueError(f"'layer' must be an int in [0, {self.num_layers}), got {layer!r}")

    def k(self, layer):
        """layer's K: ``[num_pages, P, Hkv, D]`` (a view of the host memory)."""
        self._check(layer)
        return self._views[2 * layer]

    def v(self, layer):
        """layer's V: ``[num_pages, P, Hkv, D]`` (a view of the host memory)."""
        self._check(layer)
        return self._views[2 * layer + 1]

    def append(self, layer, k, v, slots, stream=None):
        """Write T new tokens of ``layer``: ``k``, ``v`` ``[T, Hkv, D]`` (the cache's dtype; CUDA tensors for a
        pinned cache, written through its device mapping, asynchronously on ``stream`` -- default: the
        current stream; or host arrays, written now), ``slots`` int64 ``[T]`` (int32 accepted) token slots
        ``page * P + offset`` as vLLM's slot_mapping; < 0 skipped. Later tokens win when two name one slot.
        Host slots >= num_pages * P raise ValueError; device ones are skipped."""
        self._check(layer)
        fw = framework(k)
        if fw == "torch" and getattr(slots, "dtype", None) is not None and str(slots.dtype) == "torch.int32":
            slots = slots.long()
        elif fw == "numpy" and getattr(slots, "dtype", None) is not None and str(slots.dtype) == "int32":
            slots = slots.astype("int64")
        (ak, av, asl), st, nosync = prepare(fw, k, (k, v, slots), stream)
        _C.sparda_kv_store(ak, av, asl, self._views[2 * layer], self._views[2 * layer + 1], st, nosync)

    def close(self):
        """Free the memory now. BufferError while views of it (arrays from k()/v() or derived from them)
        are alive; closing twice does nothing."""
        if self._views is None:
            return
        views, self._views = self._views, None
        try:
            del views
            if self._buf.exports:  # views caught in reference cycles
                import gc
                gc.collect()
            self._buf.close()
        except BufferError:
            self._views = [self._make(i) for i in range(2 * self.num_layers)] if not self._buf.closed else None
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self._views is None else ("pinned" if self.pinned else "host")
        return (f"HostKVCache(num_layers={self.num_layers}, num_pages={self.num_pages}, P={self.P}, Hkv={self.Hkv}, "
                f"D={self.D}, dtype={self.dtype}, layout={self.layout!r}, {state}, {self.nbytes} bytes)")


_PF_WS: dict = {}  # prefetch's CUDA workspaces (any content on entry)


def _max_pages(block_table, host_k):
    """max_pages of a prefetch call, or None when the shapes can't be read (gvr._C then names the problem)"""
    s = getattr(block_table if block_table is not None else host_k, "shape", None)
    if s is None or len(s) != (2 if block_table is not None else 4):
        return None
    return int(s[1] if block_table is not None else s[0])


def _prefetch_workspace(like, fw, stream, S, indices, block_table, host_k):
    ix = getattr(indices, "shape", None)
    maxp = _max_pages(block_table, host_k)
    if ix is None or len(ix) != 3 or maxp is None:
        return None
    dev = like.device.index if fw == "torch" else like.device.id
    need = _C.prefetch_workspace_size(dev, S, int(ix[0]), int(ix[1]), int(ix[2]), maxp)
    return cached_workspace(_PF_WS, like, fw, dev, stream, need)


def _gather_shape(cta_warps, lane_loads):
    if cta_warps is not None:
        check_int("cta_warps", cta_warps, 1)
        if cta_warps > 8:
            raise ValueError(f"'cta_warps' must be 1..8, got {cta_warps}")
    if lane_loads is not None:
        check_int("lane_loads", lane_loads, 1)
        if lane_loads not in (4, 8, 16):
            raise ValueError(f"'lane_loads' must be 4, 8 or 16, got {lane_loads}")
    return cta_warps or 0, lane_loads or 0


def _run_prefetch(host_k, host_v, indices, dst_k, dst_v, block_table, resident, slot_map_out, counts, stream, method,
                  max_ctas, prefetcher=None, ticket=None, cta_warps=None, lane_loads=None):
    if not isinstance(method, str) or method not in _METHODS:
        raise ValueError(f"'method' must be 'auto', 'kernel', 'tma' or 'memcpy', got {method!r}")
    if max_ctas is not None:
        check_int("max_ctas", max_ctas, 1)
    warps, loads = _gather_shape(cta_warps, lane_loads)
    fw = framework(dst_k)
    ds = getattr(dst_k, "shape", None)
    if slot_map_out is None and fw in ("torch", "cupy"):
        ix = getattr(indices, "shape", None)
        maxp = _max_pages(block_table, host_k)
        if ix is not None and len(ix) == 3 and maxp is not None:
            slot_map_out = _new(dst_k, fw, (int(ix[0]), maxp), "int32")
    ws = None
    if fw in ("torch", "cupy") and is_cuda(dst_k, fw):
        stream = _stream_for(dst_k, fw, stream)
        on_device = framework(indices) in ("torch", "cupy") and is_cuda(indices, framework(indices))
        if method != "memcpy" and on_device and ds is not None and len(ds) == 4 and prefetcher is None:
            ws = _prefetch_workspace(dst_k, fw, stream, int(ds[0]), indices, block_table, host_k)
    arrays = (host_k, host_v, indices, block_table, resident, dst_k, dst_v, slot_map_out, counts, ws)
    (hk, hv, ix, bt, rs, dk, dv, sm, ct, aws), stream, nosync = prepare(fw, dst_k, arrays, stream)
    r = _C.sparda_prefetch(_host_side(hk), _host_side(hv), ix, bt, rs, dk, dv, sm, ct, aws, _METHODS[method],
                           max_ctas or 0, stream, nosync, prefetcher, 0 if ticket is None else ticket.data_ptr(),
                           warps, loads)
    return r if slot_map_out is None else slot_map_out


def _host_side(x):
    """torch CPU tensors (pinned or not) as NumPy views where NumPy has the dtype: the host intake
    then needs no DLPack export."""
    return _host_view(x) if type(x).__module__.startswith("torch") and not x.is_cuda else x


def _prefetch_impl(host_k, host_v, indices, dst_k, dst_v, block_table, resident, max_ctas):
    return _run_prefetch(host_k, host_v, indices, dst_k, dst_v, block_table, resident, None, None, None, "kernel",
                         max_ctas)


def _prefetch_fake(host_k, host_v, indices, dst_k, dst_v, block_table, resident, max_ctas):
    maxp = _max_pages(block_table, host_k)
    return dst_k.new_empty((indices.shape[0], maxp), dtype=_torch().int32)


_prefetch_op = define_op("sparda_prefetch", "(Tensor host_k, Tensor host_v, Tensor indices, Tensor(a!) dst_k, "
                         "Tensor(b!) dst_v, Tensor? block_table, Tensor? resident, int? max_ctas) -> Tensor",
                         impl=_prefetch_impl, fake=_prefetch_fake, mutates_args=("dst_k", "dst_v"))


def prefetch(host_k, host_v, indices, dst_k, dst_v, *, block_table=None, resident=None, slot_map_out=None, counts=None,
             stream=None, method="auto", max_ctas=None, cta_warps=None, lane_loads=None):
    """Gather the KV blocks named by ``indices`` from a paged cache in host memory into a staging cache,
    moving only blocks that are not already there (SparDA, paper 004) -> ``slot_map`` int32
    ``[B, max_pages]``: the staging page of each logical block (-1 none), the block table that
    ``gvr.sparse_attention(q, dst_k, dst_v, indices, lengths=..., block_table=slot_map, block_size=P)``
    takes -- the same indices and lengths as attention over the host cache, so prefetch -> attention
    needs no translation.

    host_k, host_v: ``[num_pages, P, Hkv, D]`` (:class:`HostKVCache` layers, or torch tensors made with
    ``pin_memory=True``; for a CUDA staging cache they must be pinned and device-mapped: ValueError
    otherwise). Every page is one run of bytes (NHD, or HND as a permuted view) laid out as in dst.
    indices: int32 ``[B, Hsel, n]``, logical blocks of P tokens of row b (-1 / out of range: skipped).
    dst_k, dst_v: ``[S, P, Hkv, D]`` staging pages, ``S >= min(B*Hsel*n, B*max_pages)``.
    block_table: int32 ``[B, max_pages]``, the host page of each logical block (< 0: none); None: block j
    of every row is host page j (max_pages = num_pages).
    resident: the previous call's slot map (the staging cache's content; keep it true: a block rewritten
    after it was staged must be set to -1 there). Needed blocks it names keep their slots and are not
    moved; blocks it names that are not needed stay while their slots are not taken (set -1 otherwise).
    The policy, deterministic: kernels/gvr_kernels.h, "SparDA host KV cache".
    slot_map_out: where to write (allocated when None; must not be ``resident``: alternate two).
    counts: int64 ``[2]`` output, {blocks moved, blocks needed}.
    method: "kernel" -- a plan kernel and a gather kernel reading host memory through UVA (``max_ctas``
    CTAs, default 16): selections on the device, graph-capturable, no host sync; "tma" -- the plan
    kernel, then bulk copies (cp.async.bulk, host -> shared -> device memory) driven by one thread in
    each of ``max_ctas`` CTAs (default 2): selections on the device, graph-capturable, sm_90 and later;
    "memcpy" -- the plan on the CPU and the copy engines (cudaMemcpyBatchAsync, adjacent blocks joined):
    selections in host memory; "auto" -- "tma" for device selections on sm_90 and later ("kernel"
    before), "memcpy" for host ones. Measured on the H100 (benchmarks/RESULTS.md): "tma" moves as fast
    as "kernel" or faster and slows a concurrent matmul less (+6.7% against +11%); "memcpy" slows it
    least (+1.2%) but needs the selection on the host. On the CPU (host staging
    arrays) every method runs the C implementation. Under torch.compile: ``torch.ops.gvr.sparda_prefetch``
    (method "kernel").
    cta_warps, lane_loads: the gather kernel's CTA shape -- warps per CTA (1..8, default 8) and 16-byte
    loads in flight per lane (4, 8 or 16, default 16); with max_ctas they trade PCIe bandwidth against the
    SMs (registers) taken from concurrent kernels (benchmarks/RESULTS.md, issue 14).
    """
    if compiling():
        _check_traced_stream(stream, "sparda.prefetch")
        if slot_map_out is not None or counts is not None or method not in ("auto", "kernel"):
            raise ValueError("gvr.sparda.prefetch under torch.compile takes neither 'slot_map_out', 'counts' nor "
                             "method 'memcpy'")
        if indices.dim() != 3 or (block_table is not None and block_table.dim() != 2):
            raise ValueError(f"sparda.prefetch: 'indices' must be [B, Hsel, n] and 'block_table' [B, max_pages], got "
                             f"{list(indices.shape)} and {None if block_table is None else list(block_table.shape)}")
        return _prefetch_op.call(host_k, host_v, indices, dst_k, dst_v, block_table, resident, max_ctas)
    return _run_prefetch(host_k, host_v, indices, dst_k, dst_v, block_table, resident, slot_map_out, counts, stream,
                         method, max_ctas, cta_warps=cta_warps, lane_loads=lane_loads)


class Prefetcher:
    """SparDA's persistent prefetcher (paper 004): ``ctas`` CTAs of the gather kernel started once on a CUDA
    stream of their own, fed through a device-side queue of ``depth`` requests. ``submit`` runs the slot
    policy of :func:`prefetch` (one CTA on the caller's stream: no allocation, no host sync, graph-safe)
    and queues the moves; ``wait`` makes a stream wait for a request (a one-thread kernel). Requests land
    in submission order. Same arguments and result as ``prefetch(..., method="kernel")``, plus a ticket.

    Sized at creation for the calls it will take: ``staging_pages`` (S of the largest staging cache),
    ``batch`` (B), ``max_pages`` and ``entries`` (Hsel * n per row) -- a larger call is refused.
    Watchdog: a submit that finds no free queue slot, or a wait whose request does not complete, within
    ``timeout_s`` gives up and sets the error that :meth:`check` (and every later call) raises.

    **While it runs, anything that synchronizes the device waits for it, and may deadlock**: a
    device-wide synchronization (``torch.cuda.synchronize()``, ``torch.cuda.graph``'s capture), the
    implicit synchronization of a device or pinned-memory allocation or release (``cudaMalloc`` by
    torch's caching allocator when it grows, ``cudaFree``, ``cudaHostAlloc``), and CUDA's lazy loading of a
    kernel at its first launch (run every kernel of the step once before starting it, or set
    ``CUDA_MODULE_LOADING=EAGER``; its own submit and wait kernels are loaded at creation): commands issued
    after one wait for the persistent kernel, which waits for them. Allocate everything first (``slot_map_out`` is
    required; tickets come from a ring allocated here, each valid for ``4 * depth`` submits), synchronize
    on streams or events, and ``close()`` it first (a context manager; closed at interpreter exit too).

    CUDA graphs: ``torch.cuda.graph`` synchronizes the device, so capture the submits and waits before the
    kernel starts -- ``Prefetcher(..., start=False)``, capture, then :meth:`start`; the graph then replays
    while it runs (tickets are fixed ring entries: one per submit captured).
    ``cta_warps``, ``lane_loads``: its CTAs' shape, as :func:`prefetch`'s (they hold their registers while
    it runs).
    """

    def __init__(self, device=None, *, staging_pages, batch, max_pages, entries, ctas=16, depth=8, timeout_s=1.0,
                 cta_warps=None, lane_loads=None, start=True):
        self._h = None
        t = _torch()
        for name, v, lo in (("staging_pages", staging_pages, 1), ("batch", batch, 1), ("max_pages", max_pages, 1),
                            ("entries", entries, 1), ("ctas", ctas, 1), ("depth", depth, 1)):
            check_int(name, v, lo)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"'timeout_s' must be a number > 0, got {timeout_s!r}")
        warps, loads = _gather_shape(cta_warps, lane_loads)
        self.device = t.device("cuda", t.cuda.current_device()) if device is None else t.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"'device' must be a CUDA device, got {device!r}")
        dev = self.device.index if self.device.index is not None else t.cuda.current_device()
        self._dev = dev
        need = _C.prefetch_workspace_size(dev, staging_pages, batch, 1, entries, max_pages)
        self._slot_bytes = (need + 255) // 256 * 256
        self._ws = t.zeros(depth * self._slot_bytes, dtype=t.uint8, device=self.device)
        self._tickets = t.zeros(4 * depth, dtype=t.int64, device=self.device)  # no allocation per submit
        self._next = 0
        t.cuda.synchronize(self.device)  # the buffers are written before the kernel starts
        self._h = _C.prefetcher_create(dev, ctas, depth, int(timeout_s * 1e9), self._ws.data_ptr(), self._slot_bytes,
                                       warps, loads, bool(start))
        self.ctas, self.depth, self.timeout_s = ctas, depth, timeout_s
        self.started = bool(start)
        self._streams = set()
        import atexit
        import weakref
        ref = weakref.ref(self)
        self._atexit = lambda: ref() is not None and ref().close()
        atexit.register(self._atexit)

    @property
    def closed(self):
        return self._h is None

    def start(self):
        """Start the persistent kernel (created with ``start=False``); starting twice does nothing."""
        if self._h is None:
            raise ValueError("this Prefetcher is closed")
        _C.prefetcher_start(self._h, self._dev)
        self.started = True

    def _live(self):
        if self._h is None:
            raise ValueError("this Prefetcher is closed")
        self.check()

    def check(self):
        """Raise RuntimeError when the watchdog fired (a request not completed, or no free queue slot, within
        timeout_s)."""
        if self._h is None:
            return
        err, _ = _C.prefetcher_status(self._h)
        if err:
            what = {1: "a submit found no free queue slot", 2: "a request did not complete"}.get(err, f"error {err}")
            raise RuntimeError(f"gvr.sparda.Prefetcher: {what} within {self.timeout_s} s (watchdog); the staged data "
                               "are not valid. close() it and start a new one")

    def submit(self, host_k, host_v, indices, dst_k, dst_v, *, slot_map_out, block_table=None, resident=None,
               counts=None, stream=None):
        """Queue a prefetch -> ``(slot_map_out, ticket)``. Arguments as :func:`prefetch` (CUDA selections;
        ``slot_map_out`` given: nothing is allocated while the prefetcher runs). The slot map is written on
        ``stream`` at once; the blocks arrive later: ``wait(ticket)`` before reading them."""
        self._live()
        if slot_map_out is None:
            raise TypeError("Prefetcher.submit: 'slot_map_out' must be given (no allocation while the prefetcher runs)")
        ticket = self._tickets[self._next % self._tickets.shape[0]:][:1]
        self._next += 1
        fw = framework(dst_k)
        st = _stream_for(dst_k, fw, stream)
        self._streams.add(st)
        m = _run_prefetch(host_k, host_v, indices, dst_k, dst_v, block_table, resident, slot_map_out, counts, st,
                          "kernel", None, self._h, ticket)
        return m, ticket

    def wait(self, ticket, stream=None):
        """Make ``stream`` (default: the current one) wait until the request of ``ticket`` has landed. The
        ticket must have been written before (submitted on this stream, or ordered by an event)."""
        self._live()
        t = _torch()
        if not isinstance(ticket, t.Tensor) or ticket.dtype != t.int64 or not ticket.is_cuda or ticket.numel() != 1:
            raise TypeError("'ticket' must be the int64 CUDA tensor that submit() returned")
        if ticket.device != self.device:
            raise ValueError(f"'ticket' is on {ticket.device}, the prefetcher on {self.device}")
        st = stream_handle(stream)
        if st is None:
            st = t.cuda.current_stream(self.device).cuda_stream
        self._streams.add(st)
        _C.prefetcher_wait(self._h, self._dev, ticket.data_ptr(), st)

    def close(self, timeout_s=5.0):
        """Drain the queue, stop the kernel and free its memory (abort after ``timeout_s``); waits for the
        streams that submitted or waited first (their events, not the device). Closing twice does nothing."""
        if getattr(self, "_h", None) is None:
            return
        t = _torch()
        for st in list(self._streams):
            ev = t.cuda.Event()
            ev.record(t.cuda.default_stream(self.device) if st == 0 else t.cuda.ExternalStream(st, device=self.device))
            ev.synchronize()
        h, self._h = self._h, None
        try:
            _C.prefetcher_close(h, self._dev, int(timeout_s * 1000))
        finally:
            import atexit
            atexit.unregister(self._atexit)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
