"""gvr._interop and the torch.library ops of topk_decode: opcheck, torch.compile, import orders,
outputs in the caller's framework, and the wrapper's small contracts (k = 0, sorted, stream, method).

torch.compile on the CPU uses backend="aot_eager" for the argument matrix (dynamo, functionalization
and the fake implementations, in well under a second per graph; inductor's C++ compile takes ~15 s
per graph on a 2-core machine) plus one inductor test; the GPU tests compile with inductor.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gvr
from harness import cpu_result, gpu_skip_reason

torch = pytest.importorskip("torch", reason="torch.library / torch.compile tests need torch")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GVR_HOME = os.path.dirname(os.path.dirname(os.path.abspath(gvr.__file__)))


def _scores(B, N, seed=0, device="cpu"):
    x = torch.randn(B, N, generator=torch.Generator().manual_seed(seed))
    x[:, ::7] = torch.round(x[:, ::7])  # ties
    return x.to(device)


def _argument_mixes(device):
    """(name, args of gvr::topk_decode) covering prev 2-D / 1-D / None, lengths, sorted, 1-D scores,
    k = 0 and an empty batch."""
    x = _scores(3, 1000, device=device)
    prev2 = gvr.topk_decode(x, 16)
    prev1 = prev2[0].contiguous()
    lengths = torch.tensor([1000, 5, 0], dtype=torch.int32, device=device)
    return [
        ("plain", (x, 16, None, None, False, "auto")),
        ("prev_2d", (x, 16, prev2, None, False, "auto")),
        ("prev_1d_shared", (x, 16, prev1, None, False, "gvr")),
        ("lengths_sorted", (x, 16, prev2, lengths, True, "auto")),
        ("radix_sorted", (x, 16, None, lengths, True, "radix")),
        ("one_d_scores", (x[0].contiguous(), 16, prev1, None, True, "auto")),
        ("k_zero", (x, 0, None, None, False, "auto")),
        ("k_above_n", (x[:, :10].contiguous(), 16, None, None, True, "auto")),
        ("empty_batch", (x[:0], 16, None, None, False, "auto")),
    ]


def _with_out(args):
    x, k, prev, lengths, sorted_, method = args
    shape = (k,) if x.dim() == 1 else (x.shape[0], k)
    out = torch.full(shape, -7, dtype=torch.int32, device=x.device)
    return (x, k, prev, lengths, out, sorted_, method)


def _opcheck_all(device):
    for name, args in _argument_mixes(device):
        torch.library.opcheck(torch.ops.gvr.topk_decode.default, args)
        torch.library.opcheck(torch.ops.gvr.topk_decode_out.default, _with_out(args))
        # the op computes what the wrapper computes
        x, k, prev, lengths, sorted_, method = args
        want = gvr.topk_decode(x, k, prev_topk=prev, lengths=lengths, sorted=sorted_, method=method)
        got = torch.ops.gvr.topk_decode(*args)
        assert got.dtype == torch.int32 and got.device == x.device and got.shape == want.shape, name
        assert torch.equal(got.cpu(), want.cpu()), name
        full = _with_out(args)
        assert torch.ops.gvr.topk_decode_out(*full) is None
        assert torch.equal(full[4].cpu(), want.cpu()), name


def test_opcheck_cpu():
    _opcheck_all("cpu")


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 300)
        r = torch.ops.gvr.topk_decode(x, 7, None, None, False, "auto")
        assert r.shape == (5, 7) and r.dtype == torch.int32
        r1 = torch.ops.gvr.topk_decode(torch.empty(300), 9, None, None, False, "auto")
        assert r1.shape == (9,) and r1.dtype == torch.int32
        r0 = torch.ops.gvr.topk_decode(torch.empty(0, 300), 0, None, None, False, "auto")
        assert r0.shape == (0, 0)


def _decode_step(s, prev, lengths):
    """A decode step as a model writes it: scores from a small computation, Top-K with the previous
    step's result as the prediction, then the indices used."""
    y = s * 2.0 + 1.0
    idx = gvr.topk_decode(y, 32, prev_topk=prev, lengths=lengths)
    return idx, torch.gather(y, 1, idx.clamp(min=0).long())  # exact ops only: compiled == eager bit for bit


def _decode_step_out(s, prev, out):
    y = s - 0.5
    gvr.topk_decode(y, 32, prev_topk=prev, out=out, sorted=True)
    return out + 0


def _compare_compiled(device, backend):
    torch._dynamo.reset()
    x0, x1 = _scores(4, 3000, seed=1, device=device), _scores(4, 3000, seed=2, device=device)
    lengths = torch.tensor([3000, 2999, 40, 0], dtype=torch.int32, device=device)
    prev = gvr.topk_decode(x0 * 2.0 + 1.0, 32)
    step = torch.compile(_decode_step, fullgraph=True, backend=backend)
    got = step(x1, prev, lengths)
    want = _decode_step(x1, prev, lengths)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = step(x1, None, None)  # without a prediction (a second graph)
    want = _decode_step(x1, None, None)
    assert torch.equal(got[0], want[0])
    step_out = torch.compile(_decode_step_out, fullgraph=True, backend=backend)
    o1 = torch.empty(4, 32, dtype=torch.int32, device=device)
    o2 = torch.empty(4, 32, dtype=torch.int32, device=device)
    got = step_out(x1, prev, o1)
    want = _decode_step_out(x1, prev, o2)
    assert torch.equal(got, want) and torch.equal(o1, o2)
    # the ops are in the graph, not around it
    assert want.dtype == torch.int32


def test_compile_cpu_aot_eager():
    _compare_compiled("cpu", "aot_eager")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_compile_cpu_inductor():
    _compare_compiled("cpu", "inductor")


def test_stream_under_compile_is_a_clear_error():
    torch._dynamo.reset()
    f = torch.compile(lambda s: gvr.topk_decode(s, 4, stream=0), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="stream"):
        f(torch.randn(2, 50))


def _run(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (GVR_HOME, os.environ.get("PYTHONPATH")) if p))
    env["PYTHONSAFEPATH"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-4000:]}"
    return proc.stdout


_COMPILE_FIRST = """
x = torch.randn(3, 500)
f = torch.compile(lambda s: gvr.topk_decode(s, 10, sorted=True), fullgraph=True, backend="aot_eager")
got = f(x)  # the first gvr call of the process is a traced one
assert torch.equal(got, gvr.topk_decode(x, 10, sorted=True))
print("ok")
"""


@pytest.mark.parametrize("order", ["import torch\nimport gvr", "import gvr\nimport torch"])
def test_import_orders_compile(order):
    assert "ok" in _run(order + "\n" + _COMPILE_FIRST)


def test_numpy_use_never_imports_torch():
    out = _run("import sys, numpy as np, gvr\n"
               "r = gvr.topk_decode(np.arange(10, dtype=np.float32), 3, sorted=True)\n"
               "assert r.tolist() == [9, 8, 7], r\n"
               "print('torch' in sys.modules)")
    assert out.strip() == "False"


# --------------------------------------------------------------------------------------------------
# outputs in the caller's framework, and the wrapper's contracts
# --------------------------------------------------------------------------------------------------
def test_torch_cpu_outputs_and_grad():
    x = _scores(2, 500).requires_grad_()
    r = gvr.topk_decode(x, 5)
    assert isinstance(r, torch.Tensor) and r.dtype == torch.int32 and r.shape == (2, 5)
    assert np.array_equal(r.numpy(), cpu_result(x.detach().numpy(), 5))
    out = torch.empty(2, 5, dtype=torch.int32)
    assert gvr.topk_decode(x, 5, out=out, prev_topk=r) is out
    assert torch.equal(out, r)


def test_k_zero_is_an_empty_result():
    x = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    assert gvr.topk_decode(x, 0).shape == (3, 0)
    assert gvr.topk_decode(x[0], 0).shape == (0,)
    assert tuple(gvr.topk_decode(torch.from_numpy(x), 0).shape) == (3, 0)


def test_sorted_must_be_a_bool():
    x = np.ones((2, 10), np.float32)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="sorted"):
            gvr.topk_decode(x, 3, sorted=bad)


def test_stream_with_cpu_inputs_is_accepted_and_ignored():
    x = np.random.default_rng(1).standard_normal((2, 100)).astype(np.float32)
    want = gvr.topk_decode(x, 7)
    for s in (0, 12345):
        assert np.array_equal(gvr.topk_decode(x, 7, stream=s), want)
    assert torch.equal(gvr.topk_decode(torch.from_numpy(x), 7, stream=5), torch.from_numpy(want))
    with pytest.raises(TypeError, match="stream"):
        gvr.topk_decode(x, 7, stream="fast")


def test_every_method_on_the_cpu_gives_the_same_result():
    x = np.random.default_rng(2).standard_normal((3, 4000)).astype(np.float32)
    want = gvr.topk_decode(x, 100, sorted=True)
    for m in ("auto", "gvr", "radix"):
        assert np.array_equal(gvr.topk_decode(x, 100, sorted=True, method=m), want), m


def test_framework_detection():
    from gvr import _interop

    class Producer:
        def __dlpack__(self):  # pragma: no cover - never called
            raise AssertionError

    assert _interop.framework(np.zeros(1)) == "numpy"
    assert _interop.framework(torch.zeros(1)) == "torch"
    assert _interop.framework(Producer()) == "dlpack"
    assert _interop.framework([1.0]) == "other"
    assert _interop.stream_handle(None) is None and _interop.stream_handle(7) == 7
    with pytest.raises(TypeError, match="stream"):
        _interop.stream_handle(True)


# --------------------------------------------------------------------------------------------------
# CUDA (each skipped with the reason where GPU tests cannot run)
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_opcheck_cuda():
    _opcheck_all("cuda")


@pytest.mark.gpu
def test_compile_cuda_inductor():
    _compare_compiled("cuda", "inductor")


@pytest.mark.gpu
def test_compile_cuda_inside_a_stream():
    torch._dynamo.reset()
    x = _scores(2, 70001, device="cuda")
    f = torch.compile(lambda s: gvr.topk_decode(s, 2048), fullgraph=True)
    want = gvr.topk_decode(x, 2048)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = f(x)
    s.synchronize()
    assert torch.equal(got, want)


def test_gpu_reason_is_stated():
    why = gpu_skip_reason()
    assert why is None or why.startswith("needs a CUDA device: ")


def test_traced_calls_survive_imports_on_another_thread():
    """Traced gvr code must not read sys.modules: dynamo wraps that dict as a variable and iterates it, and an
    import on another thread meanwhile (inductor's compile workers import) raised "dictionary changed size
    during iteration" (the GPU suite, 2026-11-24). A thread adds and removes modules while the traces run."""
    import threading
    import types

    from gvr import prr

    rng = np.random.default_rng(5)
    B, Hq, Hkv, D, P, pages = 2, 4, 2, 16, 8, 6
    q = torch.from_numpy(rng.standard_normal((B, Hq, D)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((pages, P, Hkv, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((pages, P, Hkv, D)).astype(np.float32))
    idx = torch.from_numpy(rng.integers(0, pages * P, (B, 1, 5)).astype(np.int32))
    bt = torch.arange(pages, dtype=torch.int32).view(1, pages).repeat(B, 1)
    ln = torch.tensor([pages * P, pages * P - 3], dtype=torch.int32)
    meta = prr.block_metadata(k, bt, ln, block_size=P)

    def attend(q, k, v, idx, out):  # out given, lse not: the traced path makes lse itself
        return gvr.sparse_attention(q, k, v, idx, out=out)

    def select(q, meta, ln, so):  # scores_out: checked in the traced code
        return prr.select_blocks(q, meta, 2, ln, block_size=P, scores_out=so)

    want_a = gvr.sparse_attention(q, k, v, idx, out=torch.empty(B, Hq, D))
    so_e = torch.empty(B, Hkv, pages)
    want_s = prr.select_blocks(q, meta, 2, ln, block_size=P, scores_out=so_e)
    stop = threading.Event()

    def churn():  # the number of modules keeps changing: grows to 500 extra, shrinks back, again
        names = [f"_gvr_test_churn_{i}" for i in range(500)]
        while not stop.is_set():
            for name in names:
                sys.modules[name] = types.ModuleType(name)
            for name in names:
                sys.modules.pop(name, None)

    th = threading.Thread(target=churn, daemon=True)
    th.start()
    try:
        for _ in range(3):
            torch._dynamo.reset()
            got_a = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v, idx, torch.empty(B, Hq, D))
            torch._dynamo.reset()
            so_c = torch.empty(B, Hkv, pages)
            got_s = torch.compile(select, fullgraph=True, backend="eager")(q, meta, ln, so_c)
            assert torch.equal(got_a[0], want_a[0]) and torch.equal(got_a[1], want_a[1])
            assert torch.equal(got_s, want_s) and torch.equal(so_c, so_e)
    finally:
        stop.set()
        th.join()


@pytest.mark.parametrize("v, lo, hi, err, msg", [
    (True, 0, None, TypeError, "'n' must be an int, got bool"),
    (2.0, 0, None, TypeError, "'n' must be an int, got float"),
    (np.float32(2), 0, None, TypeError, "'n' must be an int, got float32"),
    (-1, 0, None, ValueError, "'n' must be >= 0, got -1"),
    (2**31, 1, 2**31 - 1, ValueError, "'n' must be in [1, 2147483647], got 2147483648"),
])
def test_check_int_names_the_argument(v, lo, hi, err, msg):
    from gvr._interop import check_int
    with pytest.raises(err) as e:
        check_int("n", v, lo, hi)
    assert str(e.value) == msg


def test_check_int_takes_numpy_ints_and_gives_python_ints():
    from gvr._interop import check_int
    for v in (np.int64(7), np.int32(7), np.uint8(7), 7):
        r = check_int("n", v, 0, 7)
        assert r == 7 and type(r) is int
