"""The shared test harness: the reference chain, a tolerance derived from precision, GPU availability.

Reference chain (one link checked against the next, never skipped):
  NumPy (reference.py: total_order, topk_reference, expected_result, check_result)
    -> gvr's C CPU implementation (``cpu_result``: checked against NumPy in test_topk_cpu.py)
    -> the CUDA kernels (test_topk_gpu.py compares them with ``cpu_result``, ``assert_same_sets``).

Floating-point operators: ``assert_close(got, ref, naive)`` holds a kernel's error against a float64
reference to at most ``factor`` (2) times the error of the same math done naively in the input
precision, plus a floor of one unit in the last place of the input precision at the reference's
scale (flash-attention's rule); ``naive_inputs`` rounds inputs to that precision (bfloat16 included,
without torch). A failure names the worst element, its index and the got / reference / naive values.

GPU tests carry ``@pytest.mark.gpu`` (or ``pytestmark``); conftest.py skips each of them, one by
one, with ``gpu_skip_reason()`` ("needs a CUDA device: <why>") when torch, a CUDA device or gvr's
CUDA library is missing, so a CPU run counts every GPU test it did not run.
"""
from __future__ import annotations

import numpy as np

from reference import check_result, check_row, expected_result, same_bits, topk_reference, total_order  # noqa: F401

__all__ = [
    "total_order", "topk_reference", "expected_result", "check_row", "check_result", "same_bits",
    "cpu_result", "assert_same_sets",
    "round_to", "naive_inputs", "assert_close", "tolerance",
    "gpu_skip_reason", "torch_or_none",
]

# --------------------------------------------------------------------------------------------------
# reference chain
# --------------------------------------------------------------------------------------------------


def cpu_result(x, k, lengths=None, sorted=False):
    """gvr's C CPU implementation: the reference GPU results are compared with."""
    import gvr

    return gvr.topk_decode(np.ascontiguousarray(x), k, lengths=lengths, sorted=sorted)


def assert_same_sets(got, want, what=""):
    """Row-wise equality of index sets (integers: exact), -1 padding included."""
    got = np.asarray(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.size == 0:
        return
    g = np.sort(got.reshape(-1, got.shape[-1]), axis=1)
    w = np.sort(want.reshape(-1, want.shape[-1]), axis=1)
    bad = np.nonzero((g != w).any(axis=1))[0]
    if bad.size:
        r = bad[0]
        diff = np.setxor1d(g[r], w[r])
        raise AssertionError(f"{what}: rows {bad[:10]} differ; row {r}: symmetric difference {diff[:20]}")


# --------------------------------------------------------------------------------------------------
# tolerance from precision
# --------------------------------------------------------------------------------------------------
_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _EPS:
        raise ValueError(f"unknown precision {dtype!r}: one of {sorted(_EPS)}")
    return name


def round_to(x, dtype) -> np.ndarray:
    """``x`` rounded to ``dtype`` ("float32", "float16", "bfloat16"; a torch dtype works too) and
    returned as float64: the values a kernel reading that precision sees. bfloat16 rounds to
    nearest even on the float32 bits (no torch needed)."""
    name = _dtype_name(dtype)
    x = np.asarray(x, dtype=np.float64)
    if name == "float64":
        return x.copy()
    if name in ("float32", "float16"):
        return x.astype(name).astype(np.float64)
    b = np.ascontiguousarray(x.astype(np.float32)).view(np.uint32)
    finite = np.isfinite(x)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    r = np.where(finite, r, b & np.uint32(0xFFFF0000) | np.where(np.isnan(x), np.uint32(0x400000), 0))
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def naive_inputs(dtype, *arrays):
    """The arrays rounded to ``dtype`` and kept in it: feed them to a plain NumPy version of the
    operator to get the naive low-precision result. (NumPy has no bfloat16: bfloat16 inputs come
    back as float32 holding bfloat16 values, and the math then runs in float32.)"""
    name = _dtype_name(dtype)
    store = {"bfloat16": np.float32}.get(name, name)
    out = tuple(round_to(a, name).astype(store) for a in arrays)
    return out[0] if len(out) == 1 else out


def tolerance(ref, naive, dtype, *, factor=2.0, atol=None):
    """The allowed max |got - ref|: factor x max |naive - ref| + atol, atol defaulting to one unit in
    the last place of ``dtype`` at the reference's largest magnitude."""
    ref = np.asarray(ref, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    finite = np.isfinite(ref)
    scale = float(np.abs(ref[finite]).max()) if finite.any() else 1.0
    if atol is None:
        atol = _EPS[_dtype_name(dtype)] * max(scale, 1e-30)
    err_naive = np.abs(naive[finite] - ref[finite])
    return factor * (float(err_naive.max()) if err_naive.size else 0.0) + atol


def assert_close(got, ref, naive, dtype, *, factor=2.0, atol=None, what=""):
    """Assert that ``got`` (the kernel's result) is within ``tolerance(ref, naive, dtype)`` of the
    float64 reference ``ref``. Non-finite reference values must be matched exactly (same inf, NaN
    where NaN). The message names the worst element: index, got, reference, naive."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    assert got.shape == ref.shape == naive.shape, f"{what}: shapes got {got.shape}, ref {ref.shape}, naive {naive.shape}"
    finite = np.isfinite(ref)
    special = ~finite & ~((got == ref) | (np.isnan(got) & np.isnan(ref)))
    if special.any():
        i = tuple(int(v) for v in np.argwhere(special)[0])
        raise AssertionError(f"{what}: {int(special.sum())} non-finite reference values not matched; first at "
                             f"index {i}: got {got[i]!r}, reference {ref[i]!r}")
    if not finite.any():
        return
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(got - ref), 0.0)
        nerr = np.where(finite, np.abs(naive - ref), 0.0)
    err = np.where(np.isnan(err), np.inf, err)  # a NaN where the reference is finite is the worst
    tol = tolerance(ref, naive, dtype, factor=factor, atol=atol)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    if err[worst] > tol:
        nworst = np.unravel_index(int(np.argmax(nerr)), nerr.shape)
        raise AssertionError(
            f"{what}: max |got - ref| = {err[worst]:.3e} > tolerance {tol:.3e} "
            f"({factor:g} x naive {dtype} error {nerr[nworst]:.3e} + floor); {int((err > tol).sum())} of {err.size} "
            f"elements over; worst at index {tuple(int(v) for v in worst)}: got {got[worst]!r}, "
            f"reference {ref[worst]!r}, naive {naive[worst]!r} (naive's worst at {tuple(int(v) for v in nworst)})")


# --------------------------------------------------------------------------------------------------
# GPU availability
# --------------------------------------------------------------------------------------------------
_REASON = ...


def torch_or_none():
    try:
        import torch
    except Exception:
        return None
    return torch


def gpu_skip_reason():
    """None when GPU tests can run here (torch sees a CUDA device and gvr's CUDA library loads),
    else why not."""
    global _REASON
    if _REASON is not ...:
        return _REASON
    why = None
    torch = torch_or_none()
    if torch is None:
        why = "torch is not installed"
    else:
        try:
            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                why = f"torch {torch.__version__} sees no CUDA device"
        except Exception as e:  # pragma: no cover - depends on the driver
            why = f"torch.cuda failed: {type(e).__name__}: {e}"
    if why is None:
        import gvr

        if not gvr.cuda_available():
            why = f"gvr's CUDA library is not available: {gvr.build_info()['cuda_error']}"
    _REASON = None if why is None else f"needs a CUDA device: {why}"
    return _REASON
