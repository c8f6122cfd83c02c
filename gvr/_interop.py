"""What every gvr operator's Python wrapper shares: frameworks, streams, outputs, torch.library ops.

A wrapper is a few lines on top of this module (gvr/topk.py is the example):

    _op = define_op("topk_decode", "(Tensor scores, SymInt k, ...) -> Tensor", impl=_impl, fake=_fake)

    def topk_decode(scores, k, *, out=None, stream=None, ...):
        if compiling():                                   # torch.compile / torch.export tracing
            return _op.call(scores, k, ...)               # -> torch.ops.gvr.topk_decode (a graph node)
        fw = framework(scores)
        if out is None:
            out = empty(scores, fw, (B, k), "int32")      # the caller's framework and device
        args, stream, nosync = prepare(fw, scores, (scores, prev, lengths, out), stream)
        return _C.topk_decode(*args, ..., stream, method, nosync)

Eager calls go straight to gvr._C (no dispatcher round trip: a torch.ops call costs microseconds of
host time); only code that torch.compile traces goes through torch.ops.gvr.*, whose fake
implementations give the outputs' shapes, dtypes and devices.

torch is never imported here unless the caller already did. The ops are registered as soon as both
gvr and torch are imported, in either order: at ``import gvr`` when torch is already loaded, else by
a one-shot import hook that runs right after ``import torch`` finishes (and, as a fallback, on the
first eager call with a torch tensor). ``register_torch_ops()`` does it explicitly.
"""
from __future__ import annotations

import importlib.abc
import numbers
import sys
from dataclasses import dataclass, field
from typing import Callable

__all__ = [
    "framework", "prepare", "empty", "stream_handle", "compiling",
    "define_op", "OpSpec", "register_torch_ops", "torch_ops_error", "check_int",
]

NAMESPACE = "gvr"

# --------------------------------------------------------------------------------------------------
# frameworks
# --------------------------------------------------------------------------------------------------


def check_int(name: str, v, lo: int = 1, hi: int | None = None) -> int:
    """``v`` as a Python int (NumPy integers too; a bool is not an int here), checked in [lo, hi]: the
    wrappers' one check of integer arguments, with the argument named in the error."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"'{name}' must be an int, got {type(v).__name__}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"'{name}' must be " + (f">= {lo}" if hi is None else f"in [{lo}, {hi}]") + f", got {v}")
    return v


def framework(x) -> str:
    """'numpy', 'torch', 'cupy', 'dlpack' (any other __dlpack__ producer) or 'other'."""
    mod = type(x).__module__
    if mod.startswith("numpy"):
        return "numpy"
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    return "dlpack" if hasattr(x, "__dlpack__") else "other"


def _detach(x):
    """torch tensors that require grad cannot be exported through DLPack; gvr's ops are not
    differentiable (their outputs are indices), so they read the values only."""
    return x.detach() if getattr(x, "requires_grad", False) else x


def traced_out(out, value, name: str, func: str, dtypes=None):
    """``out.copy_(value)`` for a traced call's ``out=`` (value: the op's result), with the checks eager
    calls get from gvr._C's intake: a torch tensor of value's shape and device, and of value's dtype
    (or one of ``dtypes``) -- copy_ would convert dtypes and broadcast shapes silently. None: value."""
    if out is None:
        return value
    t = _torch_module()
    if not isinstance(out, t.Tensor):
        raise TypeError(f"{func}: '{name}' must be a torch tensor under torch.compile, got {type(out).__name__}")
    ok = (value.dtype,) if dtypes is None else dtypes
    if out.dtype not in ok:
        raise TypeError(f"{func}: '{name}' must be {' or '.join(str(d).replace('torch.', '') for d in ok)}, got "
                        f"{str(out.dtype).replace('torch.', '')}")
    if out.dim() != value.dim() or any(a != b for a, b in zip(out.shape, value.shape)):
        raise ValueError(f"{func}: '{name}' must have shape {list(value.shape)}, got {list(out.shape)}")
    if out.device != value.device:
        raise ValueError(f"{func}: '{name}' must be on {value.device}, got {out.device}")
    out.copy_(value)
    return out


def is_cuda(x, fw: str) -> bool:
    return (fw == "torch" and x.is_cuda) or fw == "cupy"


def empty(like, fw: str, shape, dtype: str):
    """An uninitialised array of ``shape`` and ``dtype`` (a NumPy dtype name) in ``like``'s
    framework and on its device; None for NumPy and other producers (gvr._C allocates NumPy
    outputs for host inputs and names the missing argument otherwise) or when ``shape`` is None."""
    if shape is None:
        return None
    if fw == "torch":
        t = _torch_module()
        return t.empty(shape, dtype=getattr(t, dtype), device=like.device)
    if fw == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=dtype)
    return None


# --------------------------------------------------------------------------------------------------
# streams
# --------------------------------------------------------------------------------------------------


def stream_handle(stream):
    """None, an int (a cudaStream_t), a torch.cuda.Stream, a CuPy stream or any object with
    ``__cuda_stream__`` -> None or an int handle."""
    if stream is None or (isinstance(stream, int) and not isinstance(stream, bool)):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    raise TypeError(
        f"'stream' must be an int handle, a torch.cuda.Stream or a cupy Stream, got {type(stream).__name__}")


def _host_view(a):
    """A torch CPU tensor as a NumPy view of the same memory (~1 us, against ~6 us for the DLPack
    export and device query of a torch tensor); other objects, and tensors NumPy cannot view
    (bfloat16, CUDA), unchanged."""
    if a is None or not type(a).__module__.startswith("torch"):
        return a
    a = _detach(a)
    if a.is_cuda or a.dtype not in _numpy_dtypes():  # bfloat16: .numpy() would raise (~25 us)
        return a
    try:
        return a.numpy()
    except (TypeError, RuntimeError):
        return a


_NP_DTYPES = None


def _numpy_dtypes():
    """the torch dtypes NumPy can view"""
    global _NP_DTYPES
    if _NP_DTYPES is None:
        t = _torch_module()
        _NP_DTYPES = frozenset((t.float32, t.float16, t.float64, t.int32, t.int64, t.int16, t.int8, t.uint8, t.bool))
    return _NP_DTYPES


def prepare(fw: str, like, arrays: tuple, stream):
    """The arrays of one gvr._C call (in the C signature's order; None for absent ones), ready for
    it; the stream to run on; and the ``nosync`` bitmask.

    torch tensors that require grad are detached. torch CPU tensors go as NumPy views of their
    memory (the cheapest export); the caller returns its own ``out``, not gvr._C's result.
    CUDA inputs run on ``stream``, by default torch's current stream on ``like``'s device (torch) or
    CuPy's current stream. Bit i of ``nosync`` says that arrays[i] is a torch tensor whose producer's
    current stream is that stream: gvr._C then asks for no DLPack stream hand-shake (torch's
    equal-stream check costs ~13 us of host time per tensor). With CPU inputs ``stream`` is checked
    and ignored."""
    stream = stream_handle(stream)
    nosync = 0
    if fw == "torch":
        if not like.is_cuda:
            return tuple(_host_view(a) for a in arrays), stream, 0
        arrays = tuple(_detach(a) for a in arrays)
        t = _torch_module()
        current = _raw_stream(like.get_device()) if _raw_stream else t.cuda.current_stream(like.device).cuda_stream
        if stream is None:
            stream = current
        if stream == current:
            for bit, a in enumerate(arrays):
                if a is not None and type(a).__module__.startswith("torch"):
                    nosync |= 1 << bit
    elif fw == "cupy" and stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
    return arrays, stream, nosync


# --------------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------------
_torch = None  # the torch module once gvr has seen it imported (never imported by gvr itself)


def _torch_module():
    """torch, from gvr's own reference once set (always, before anything is traced: compiling() is False until
    then), so that traced code never looks into sys.modules -- dynamo would wrap that dict and iterate it, and a
    lazy import meanwhile raises "dictionary changed size during iteration" (seen under torch.compile)"""
    global _torch
    if _torch is None:
        _torch = sys.modules["torch"]
        try:  # the import hook did not run (torch imported by unusual means): register now
            register_torch_ops()
        except Exception:  # eager calls do not need the ops; traced calls report the error
            pass
    return _torch


def torch_if_loaded():
    """torch if it is imported, else None -- gvr's own reference first (traced code never reads sys.modules)"""
    return _torch if _torch is not None else sys.modules.get("torch")


def compiling() -> bool:
    """True while torch.compile (or torch.export) traces the caller; False without torch (~90 ns
    with torch loaded)."""
    t = _torch
    return t is not None and t.compiler.is_compiling()


@dataclass
class OpSpec:
    """One operator as a torch.library custom op ``gvr::<name>``.

    schema: the arguments and results in torch's schema language, e.g.
        "(Tensor scores, SymInt k, Tensor? prev_topk, bool sorted, str method) -> Tensor";
        an argument the op writes is ``Tensor(a!) out`` and is listed in ``mutates_args``.
    impl:   the real computation on tensors (the same function eager calls use).
    fake:   shapes, dtypes and devices only: new tensors for the results (``x.new_empty``), None
            for an op that only mutates its arguments.
    """

    name: str
    schema: str
    impl: Callable
    fake: Callable
    mutates_args: tuple = ()
    op: object = field(default=None, repr=False)  # torch.ops.gvr.<name> once registered

    def call(self, *args):
        """Call through torch.ops.gvr.<name> (for traced code; eager code calls ``impl``). Tensors that
        require grad are detached, as eager calls read them (the ops have no autograd formula: without
        this, torch.compile of a model run outside no_grad fails where the eager call works)."""
        if self.op is None:
            raise RuntimeError(_not_registered(self.name))
        return self.op(*(_detach(a) for a in args))


_SPECS: dict[str, OpSpec] = {}
_error: BaseException | None = None


def define_op(name: str, schema: str, *, impl: Callable, fake: Callable, mutates_args=()) -> OpSpec:
    """Declare ``gvr::<name>``; it is registered now if torch is loaded, else when torch is imported."""
    spec = OpSpec(name, schema, impl, fake, tuple(mutates_args))
    _SPECS[name] = spec
    if "torch" in sys.modules and getattr(sys.modules["torch"], "library", None) is not None:
        register_torch_ops()
    return spec


_raw_stream = None  # torch._C._cuda_getCurrentRawStream once torch is loaded (and has it)
_fast_paths_set = False  # _torch_fast_paths ran (once per process: register_torch_ops runs per declared op)


def _torch_fast_paths(torch) -> None:
    """Host time per eager call (measured, H200 host, 2026-11-25: 48 us for topk_decode with prev_topk and out,
    of which ~6 us per torch tensor went to torch's __dlpack_device__ + __dlpack__ and 5 us to
    torch.cuda.current_stream): the current stream's handle from torch's C function, and torch.Tensor's
    DLPack export by torch._C._to_dlpack_versioned when no stream synchronization is needed (gvr._C
    calls it in place of the two protocol methods). Either missing (another torch version): the
    protocol, as before."""
    global _raw_stream, _fast_paths_set
    from . import _C

    _fast_paths_set = True

    tc = getattr(torch, "_C", None)
    _raw_stream = getattr(tc, "_cuda_getCurrentRawStream", None)
    export = getattr(tc, "_to_dlpack_versioned", None)
    try:  # registered only if it takes a tensor alone and returns an unused versioned capsule
        ok = export is not None and '"dltensor_versioned"' in repr(export(torch.empty(1)))
    except Exception:
        ok = False
    _C._set_dlpack_export(export if ok else None, torch.Tensor if ok else None)


def register_torch_ops() -> None:
    """Register every declared operator with torch.library (idempotent; imports torch)."""
    global _torch, _error
    import torch

    _torch = torch
    if not _fast_paths_set:
        _torch_fast_paths(torch)
    for spec in _SPECS.values():
        if spec.op is not None:
            continue
        try:
            op = torch.library.custom_op(f"{NAMESPACE}::{spec.name}", spec.impl, mutates_args=spec.mutates_args,
                                         schema=spec.schema)
            op.register_fake(spec.fake)
            spec.op = getattr(getattr(torch.ops, NAMESPACE), spec.name)
        except Exception as e:  # reported by torch_ops_error() and at the first traced call
            _error = e
            raise


def torch_ops_error():
    """The exception that stopped the registration, or None."""
    return _error


def _not_registered(name):
    why = f" (registration failed: {type(_error).__name__}: {_error})" if _error is not None else ""
    return (f"torch.ops.{NAMESPACE}.{name} is not registered{why}: call gvr._interop.register_torch_ops() "
            f"after importing torch and before torch.compile traces a gvr call")


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Registers gvr's ops right after ``import torch`` completes, when gvr was imported first.
    One shot: it leaves sys.meta_path at torch's first lookup."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisterAfter(spec.loader)
        return spec


class _RegisterAfter(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        spec = module.__spec__
        try:
            self.inner.exec_module(module)
        finally:
            # torch keeps its own loader
            module.__loader__ = self.inner
            if spec is not None:
                spec.loader = self.inner
        try:
            register_torch_ops()
        except Exception:  # never break `import torch`; the error is reported at first use
            pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _install_hook():
    if "torch" in sys.modules:
        return
    if not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())


_install_hook()
