"""gvr.sparda: SparDA (paper 004) -- block selection one layer ahead by a Forecast head per GQA group,
and prefetch of the selected KV blocks from pinned host memory.

Built so far: the Forecast's training objective, ``forecast_kl_loss`` (section 4.4; PyTorch only, as
training is), the Forecast indexer's selection, ``forecast_select`` (section 4.3), and the compressed
keys it scores, ``compressed_keys`` / ``update_compressed_keys`` (eq. 5; their CUDA kernel is compiled
but has not yet run on a GPU: NotImplementedError on CUDA inputs unless GVR_UNVERIFIED_CUDA=1). Still
to come (issue 14): ``HostKVCache``, ``prefetch``, ``Prefetcher``.
"""
from __future__ import annotations

import os
import sys

from . import _C
from ._interop import compiling, define_op, framework, prepare
from .attention import _check_traced_stream, _new

__all__ = ["forecast_kl_loss", "forecast_select", "compressed_keys", "update_compressed_keys"]


def _torch():
    t = sys.modules.get("torch")
    if t is None:
        try:
            import torch as t
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError("gvr.sparda.forecast_kl_loss needs torch") from e
    return t


def _check_int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"'{name}' must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"'{name}' must be >= {lo}, got {v}")
    return v


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
    torch = _torch()
    k = _check_int("k", k, 1)
    pool_kernel = _check_int("pool_kernel", pool_kernel, 1)
    pool_stride = _check_int("pool_stride", pool_stride, 1)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"'tau' must be a float > 0, got {tau!r}")
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
    # max-pool to the inference grid (windows cut at N_fine, empty windows 0)
    need = (nb - 1) * pool_stride + pool_kernel
    if need > nf:
        tgt_f = torch.nn.functional.pad(tgt_f, (0, need - nf))
    tgt = tgt_f.unfold(-1, pool_kernel, pool_stride)[..., :nb, :].amax(-1)
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
    if reduction == "none":
        return kl
    return kl.sum() if reduction == "sum" else kl.mean()


def _num_windows(lengths, kernel, stride):
    """complete compression windows per row: len >= kernel ? (len - kernel) // stride + 1 : 0 (int32, same
    framework and device as lengths; no host round trip for device tensors)."""
    if type(lengths).__module__.startswith("torch"):
        t = _torch()
        n = t.div(lengths.to(t.int64) - kernel, stride, rounding_mode="floor") + 1
        return n.clamp_min(0).to(t.int32)
    import numpy as np
    ln = np.asarray(lengths)
    if ln.dtype != np.int32:
        raise TypeError(f"'lengths' must be int32 [B], got {ln.dtype}")
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
    among them (when k allows), -1 padding -- one kernel chain, no host round trip. With ``kernel ==
    stride == G`` the ids are the ``G``-token blocks that ``gvr.sparse_attention(..., block_table=,
    block_size=G)`` takes. NumPy / torch CPU (C) and CUDA (float16 / bfloat16, D 64/128/256).

    Built on ``gvr.prr.select_blocks`` with ktilde as a Quest metadata whose minimum and maximum are the
    same tensor (a stride-0 view: no copy), over blocks of one "token" per window.
    """
    from ._prr_select import select_blocks
    kernel = _check_int("kernel", kernel, 1)
    stride = _check_int("stride", stride, 1)
    shape = getattr(ktilde, "shape", None)
    if shape is None or len(shape) != 4:
        raise ValueError(f"'ktilde' must be [B, Hkv, Nc, D], got {None if shape is None else list(shape)}")
    B, H, Nc, D = (int(v) for v in shape)
    if type(ktilde).__module__.startswith("torch"):
        meta = ktilde.unsqueeze(3).expand(B, H, Nc, 2, D)
    else:
        import numpy as np
        kt = np.asarray(ktilde)
        meta = np.lib.stride_tricks.as_strided(kt, (B, H, Nc, 2, D), kt.strides[:3] + (0,) + kt.strides[3:],
                                               writeable=False)
    nwin = _num_windows(lengths, kernel, stride)
    is_torch = type(nwin).__module__.startswith("torch")
    if not compiling() and not (is_torch and nwin.is_cuda):  # host counts are checked here (device ones are clamped by the kernels)
        n_host = nwin.numpy() if is_torch else nwin
        most = int(n_host.max()) if n_host.size else 0
        if most > Nc:
            raise ValueError(f"'lengths' implies {most} complete windows of {kernel} tokens every {stride}, more than "
                             f"'ktilde' holds (Nc = {Nc})")
    return select_blocks(F, meta, k, nwin, block_size=1, init_blocks=init_blocks, local_blocks=local_blocks,
                         out=out, stream=stream)


def _is_cuda(x):
    return bool(getattr(x, "is_cuda", False)) or type(x).__module__.startswith("cupy")


def _gate(x, op):
    if _is_cuda(x) and os.environ.get("GVR_UNVERIFIED_CUDA") != "1":
        raise NotImplementedError(
            f"the CUDA path of gvr.sparda.{op} is compiled but has not yet run on a GPU (its GPU tests are owed): use "
            "CPU inputs, or set GVR_UNVERIFIED_CUDA=1 to run it anyway")


def _ckeys_shape(k_cache, block_table, kernel, stride):
    """[B, Hkv, Nc, D], or None when the shapes can't be read (gvr._C then names the problem)."""
    ks, bs = getattr(k_cache, "shape", None), getattr(block_table, "shape", None)
    if ks is None or bs is None or len(ks) != 4 or len(bs) != 2:
        return None
    cap = int(bs[1]) * int(ks[1])
    return (int(bs[0]), int(ks[2]), (cap - kernel) // stride + 1 if cap >= kernel else 0, int(ks[3]))


def _run_ckeys(k_cache, block_table, end, start, out, kernel, stride, stream):
    """gvr._C.sparda_compressed_keys: build (start None) into out (allocated when None) or update out."""
    _gate(k_cache, "update_compressed_keys" if start is not None else "compressed_keys")
    kernel = _check_int("kernel", kernel, 1)
    stride = _check_int("stride", stride, 1)
    fw = framework(k_cache)
    if out is None:
        out = _new(k_cache, fw, _ckeys_shape(k_cache, block_table, kernel, stride), None)
    # gvr._C's spec order (k_cache, block_table, end, start, ktilde): nosync's bits follow it
    (k, bt, e, s, o), stream, nosync = prepare(fw, k_cache, (k_cache, block_table, end, start, out), stream)
    _C.sparda_compressed_keys(k, bt, e, o, kernel, stride, s, stream, nosync)
    return out


def _ckeys_impl(k_cache, block_table, lengths, kernel, stride):
    return _run_ckeys(k_cache, block_table, lengths, None, None, kernel, stride, None)


def _ckeys_fake(k_cache, block_table, lengths, kernel, stride):
    return k_cache.new_empty(_ckeys_shape(k_cache, block_table, kernel, stride))


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
    D]`` in k_cache's dtype, Nc = the windows of ``kernel`` tokens every ``stride`` in max_pages * P tokens.

    Window j of row b = tokens ``[j*stride, j*stride + kernel)`` (token t at page ``block_table[b, t // P]``,
    slot ``t % P``; a page < 0 or >= num_pages counts as zeros): its float32 sum in token order divided by
    ``kernel``, rounded to the cache's dtype, for every window complete within ``lengths[b]`` (default
    max_pages * P); the row's other windows are zero. Deterministic; the CPU (C) and CUDA (float16 /
    bfloat16) give the same bits. ``update_compressed_keys`` keeps it current as tokens arrive. Under
    torch.compile: the op ``torch.ops.gvr.sparda_compressed_keys``.
    """
    if compiling():
        _check_traced_stream(stream, "sparda.compressed_keys")
        r = _ckeys_op.call(k_cache, block_table, lengths, kernel, stride)
        return r if out is None else out.copy_(r)
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
