"""Shared fixtures and helpers for the gvr test suite.

Contents:
  * the ``gpu`` marker (``gpu: needs a CUDA device``): every gpu-marked test is collected and, where
    GPU tests cannot run, skipped one by one with the reason (harness.gpu_skip_reason), so a CPU
    run's skip count is the number of GPU tests it did not run; the ``cuda`` fixture (torch, on a
    machine where they can run);
  * seeded RNG fixtures;
  * :func:`has_cuda` / :func:`may_have_gpu`;
  * DLPack test doubles:
      - :class:`NumpyProducer`: a non-NumPy object that exports a NumPy array through NumPy's own
        ``__dlpack__`` (versioned capsules when asked for ``max_version >= (1, 0)``), recording how
        it was called and every capsule it handed out;
      - :class:`LegacyNumpyProducer`: same, but ``__dlpack__(self, stream=None)`` only;
      - :class:`FakeDLPack`: a producer built by hand with ctypes (DLManagedTensor and
        DLManagedTensorVersioned), with a counting deleter, an arbitrary device, data pointer,
        dtype, strides, byte_offset and flags;
  * :func:`capsule_name` (``PyCapsule_GetName``);
  * :func:`run_isolated`: run a function of a test module in a fresh interpreter, so that a
    crash (e.g. a dereferenced fake device pointer) becomes a test failure instead of killing
    the whole session.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# `pytest tests/` (not `python -m pytest`) does not put the repository on sys.path: use the
# in-place build when gvr is not installed.
import importlib.util as _ilu  # noqa: E402

if _ilu.find_spec("gvr") is None:
    sys.path.insert(0, REPO_ROOT)

# --------------------------------------------------------------------------------------------
# pytest configuration
# --------------------------------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from harness import gpu_skip_reason

    why = gpu_skip_reason()
    if why is not None:
        skip = pytest.mark.skip(reason=why)
        for it in gpu_items:
            it.add_marker(skip)


@pytest.fixture
def cuda():
    """torch, for a test that needs a CUDA device (skipped with the reason otherwise)."""
    from harness import gpu_skip_reason

    why = gpu_skip_reason()
    if why is not None:
        pytest.skip(why)
    import torch

    return torch


_HAS_CUDA = None


def has_cuda() -> bool:
    """True only when torch or cupy is importable AND reports at least one CUDA device."""
    global _HAS_CUDA
    if _HAS_CUDA is not None:
        return _HAS_CUDA
    found = False
    try:
        import torch  # noqa: F401

        found = bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:
        found = False
    if not found:
        try:
            import cupy  # noqa: F401

            found = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            found = False
    _HAS_CUDA = found
    return found


def may_have_gpu() -> bool:
    """Conservative: True when an NVIDIA GPU might be present even without torch/cupy.

    Tests that hand the library a *fake* CUDA tensor with a bogus pointer for an all-CUDA call
    must not run where a real driver could actually launch a kernel on that pointer."""
    return (
        has_cuda()
        or os.path.exists("/dev/nvidiactl")
        or os.path.exists("/dev/nvidia0")
        or shutil.which("nvidia-smi") is not None
    )


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------

BASE_SEED = 20240611


@pytest.fixture
def seed():
    return BASE_SEED


@pytest.fixture
def rng():
    return np.random.default_rng(BASE_SEED)


# --------------------------------------------------------------------------------------------
# Python C-API prototypes (private prototypes: never mutate ctypes.pythonapi.<fn>.argtypes,
# the library's own Python code may use those function objects with other signatures)
# --------------------------------------------------------------------------------------------

_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_PyCapsule_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))


def capsule_name(capsule) -> bytes:
    """The current name of a PyCapsule (bytes), e.g. b'used_dltensor_versioned'."""
    return _PyCapsule_GetName(capsule)


# --------------------------------------------------------------------------------------------
# DLPack structures
# --------------------------------------------------------------------------------------------

kDLCPU, kDLCUDA, kDLCUDAHost, kDLOpenCL, kDLVulkan, kDLMetal, kDLVPI, kDLROCM = 1, 2, 3, 4, 7, 8, 9, 10
kDLInt, kDLUInt, kDLFloat, kDLBfloat = 0, 1, 2, 4
DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# The deleter receives a DLManagedTensor* / DLManagedTensorVersioned*; declared as void* here.
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_NAME_LEGACY = ctypes.create_string_buffer(b"dltensor")
_NAME_VERSIONED = ctypes.create_string_buffer(b"dltensor_versioned")

# Everything a hand-built capsule points at stays alive until the interpreter exits, so that a
# late (or wrong) deleter call from the library can never touch freed memory.
_KEEPALIVE: list = []

_NP_TO_DL = {
    np.dtype(np.float32): (kDLFloat, 32),
    np.dtype(np.float64): (kDLFloat, 64),
    np.dtype(np.float16): (kDLFloat, 16),
    np.dtype(np.int32): (kDLInt, 32),
    np.dtype(np.int64): (kDLInt, 64),
    np.dtype(np.int16): (kDLInt, 16),
    np.dtype(np.uint32): (kDLUInt, 32),
    np.dtype(np.uint8): (kDLUInt, 8),
}


class FakeDLPack:
    """A DLPack producer built by hand with ctypes.

    ``array``: a NumPy array providing memory, shape, dtype and strides (in elements).  Or no array
    and then ``shape`` + ``dtype`` + ``data`` (an int address, or None for NULL): used for fake
    device tensors whose memory must never be touched.
    ``strides``: "auto" (from the array), None (NULL strides pointer: compact row-major), or a tuple.
    ``device``: (device_type, device_id) reported by ``__dlpack_device__`` and in the DLTensor.
    ``byte_offset``: DLTensor.byte_offset (``data`` is moved back by that many bytes so that the
    described tensor is still ``array``).
    ``versioned``: hand out a DLManagedTensorVersioned ("dltensor_versioned") when the consumer asks
    for max_version >= (1, 0); ``legacy``: hand out a DLManagedTensor ("dltensor") otherwise (when
    False, a request without max_version raises BufferError).
    ``flags``: DLManagedTensorVersioned.flags.
    ``null_deleter``: export with ``deleter == NULL`` (allowed by dlpack.h). The counting deleter is
    a Python (ctypes) callback; a consumer that calls it while a Python exception is pending breaks
    (the callback's return raises SystemError, which swallows the pending exception), so tests
    whose subject is not ownership (fake devices) use a NULL deleter.

    Each ``__dlpack__`` call builds a fresh managed tensor + capsule. The capsules have no
    destructor: ownership passes to the consumer only if it renames the capsule ("used_..."), and
    then the consumer must call the deleter exactly once; see :meth:`assert_ownership_ok`.
    """

    def __init__(
        self,
        array=None,
        *,
        shape=None,
        dtype=None,
        data=None,
        strides="auto",
        device=(kDLCPU, 0),
        byte_offset=0,
        versioned=True,
        legacy=True,
        flags=0,
        version=(1, 0),
        dl_dtype=None,
        null_deleter=False,
    ):
        self.array = array
        if array is not None:
            self.shape = tuple(array.shape)
            self.dtype = array.dtype
            self.data = array.ctypes.data if array.size else array.__array_interface__["data"][0]
            if strides == "auto":
                self.strides = tuple(s // array.itemsize for s in array.strides)
            else:
                self.strides = strides
        else:
            self.shape = tuple(shape)
            self.dtype = np.dtype(dtype)
            self.data = data
            self.strides = None if strides == "auto" else strides
        self.dl_dtype = dl_dtype if dl_dtype is not None else _NP_TO_DL[np.dtype(self.dtype)] + (1,)
        self.device = tuple(device)
        self.byte_offset = byte_offset
        self.versioned = versioned
        self.legacy = legacy
        self.flags = flags
        self.version = version
        self.calls = []  # kwargs of each __dlpack__ call
        self.device_calls = 0
        self.capsules = []  # (capsule, kind, address of the managed struct)
        self.deleter_calls = {}  # address -> count
        self.null_deleter = null_deleter
        self._keep = []
        self._deleter = DELETER(self._on_delete)
        _KEEPALIVE.append(self)

    # -- the DLPack protocol -----------------------------------------------------------------
    def __dlpack_device__(self):
        self.device_calls += 1
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append(dict(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy))
        want_versioned = max_version is not None and tuple(max_version)[0] >= 1
        if want_versioned and self.versioned:
            return self._export(versioned=True)
        if self.legacy:
            return self._export(versioned=False)
        raise BufferError("FakeDLPack: only versioned capsules are available")

    # -- internals -----------------------------------------------------------------------------
    def _on_delete(self, address):
        self.deleter_calls[address] = self.deleter_calls.get(address, 0) + 1

    def _fill_tensor(self, t: DLTensor):
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        self._keep.append(shape)
        t.ndim = ndim
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is None:
            t.strides = ctypes.POINTER(ctypes.c_int64)()
        else:
            st = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
            self._keep.append(st)
            t.strides = ctypes.cast(st, ctypes.POINTER(ctypes.c_int64))
        data = self.data
        if data is not None and self.byte_offset:
            data = data - self.byte_offset
        t.data = data
        t.byte_offset = self.byte_offset
        t.device = DLDevice(self.device[0], self.device[1])
        t.dtype = DLDataType(*self.dl_dtype)

    def _export(self, versioned: bool):
        if versioned:
            m = DLManagedTensorVersioned()
            m.version = DLPackVersion(*self.version)
            m.flags = self.flags
        else:
            m = DLManagedTensor()
        self._fill_tensor(m.dl_tensor)
        m.manager_ctx = None
        m.deleter = DELETER() if self.null_deleter else self._deleter
        self._keep.append(m)
        address = ctypes.addressof(m)
        name = _NAME_VERSIONED if versioned else _NAME_LEGACY
        cap = _PyCapsule_New(address, ctypes.addressof(name), None)
        self.capsules.append((cap, "versioned" if versioned else "legacy", address))
        return cap

    # -- checks --------------------------------------------------------------------------------
    def names(self):
        return [capsule_name(c) for c, _, _ in self.capsules]

    def assert_ownership_ok(self, *, must_consume=False):
        """Each capsule handed out is either consumed (renamed "used_...") and then deleted
        exactly once, or left alone and never deleted. Unknown deleter addresses fail."""
        known = {a for _, _, a in self.capsules}
        assert set(self.deleter_calls) <= known, f"deleter called on unknown pointers {self.deleter_calls}"
        for cap, kind, address in self.capsules:
            name = capsule_name(cap)
            calls = self.deleter_calls.get(address, 0)
            if self.null_deleter:
                assert calls == 0
                assert not must_consume or name.startswith(b"used_"), f"{kind} capsule not consumed ({name!r})"
            elif name.startswith(b"used_"):
                assert calls == 1, f"{kind} capsule consumed ({name!r}) but deleter called {calls} times"
            else:
                assert not must_consume, f"{kind} capsule not consumed (name {name!r})"
                assert calls == 0, f"{kind} capsule not consumed ({name!r}) but deleter called {calls} times"


class LegacyFakeDLPack(FakeDLPack):
    """A hand-built producer with the pre-2023 signature ``__dlpack__(self, stream=None)``."""

    def __dlpack__(self, stream=None):  # noqa: D401  (no max_version keyword: TypeError on it)
        self.calls.append(dict(stream=stream))
        return self._export(versioned=False)


_UNSET = object()


class NumpyProducer:
    """A non-NumPy DLPack producer delegating to a NumPy array's own ``__dlpack__``.

    Records the keyword arguments of each call (only those actually passed) and keeps a reference
    to every capsule it returned (so the test can read its name afterwards)."""

    def __init__(self, array, *, keep_capsules=True):
        self.array = array
        self.keep_capsules = keep_capsules
        self.calls = []
        self.device_calls = 0
        self.capsules = []

    def __dlpack__(self, *, stream=_UNSET, max_version=_UNSET, dl_device=_UNSET, copy=_UNSET):
        passed = {
            k: v
            for k, v in dict(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy).items()
            if v is not _UNSET
        }
        self.calls.append(passed)
        kw = {k: (None if v is _UNSET else v) for k, v in
              dict(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy).items()}
        cap = self.array.__dlpack__(**kw)
        if self.keep_capsules:
            self.capsules.append(cap)
        return cap

    def __dlpack_device__(self):
        self.device_calls += 1
        return self.array.__dlpack_device__()


class LegacyNumpyProducer:
    """Only ``__dlpack__(self, stream=None)``: passing max_version raises TypeError naturally."""

    def __init__(self, array, *, keep_capsules=True):
        self.array = array
        self.keep_capsules = keep_capsules
        self.calls = []
        self.capsules = []

    def __dlpack__(self, stream=None):
        self.calls.append(dict(stream=stream))
        cap = self.array.__dlpack__(stream=stream)
        if self.keep_capsules:
            self.capsules.append(cap)
        return cap

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


# --------------------------------------------------------------------------------------------
# crash isolation
# --------------------------------------------------------------------------------------------


def run_isolated(module: str, func: str, timeout: float = 120.0):
    """Run ``module.func()`` (a module of tests/) in a fresh interpreter.

    Fails the calling test with the child's output if the child crashed (signal), raised, or hung.
    """
    import gvr as _gvr  # the child must import the same gvr as this session (installed or in place)

    gvr_parent = os.path.dirname(os.path.dirname(os.path.abspath(_gvr.__file__)))
    code = (
        "import sys; sys.path[:0] = [{root!r}, {tests!r}]\n"
        "import importlib\n"
        "m = importlib.import_module({module!r})\n"
        "getattr(m, {func!r})()\n"
        "print('ISOLATED-OK')\n"
    ).format(tests=TESTS_DIR, root=gvr_parent, module=module, func=func)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=TESTS_DIR, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:  # pragma: no cover
        pytest.fail(f"{module}.{func} hung for {timeout}s\n{e.stdout}\n{e.stderr}")
    if proc.returncode != 0 or "ISOLATED-OK" not in proc.stdout:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        pytest.fail(
            f"{module}.{func} failed in a child interpreter ({how})\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
