"""gvr.topk_decode on float16 / bfloat16 scores (issue 15), read directly: a half-precision score ranks
as its exact float32 value, so the result equals the float32 call on the converted scores (NumPy's
float16 -> float32 and torch's bfloat16 -> float32 conversions are exact). CPU against NumPy (every
float16 bit pattern at once: NaN payloads, infinities, signed zeros, subnormals); CUDA against the C
path for every method, sorted and not, ragged and misaligned rows, a hint, the page-table transform."""
import numpy as np
import pytest

import gvr
from harness import assert_same_sets, torch_or_none
from reference import expected_result

torch = torch_or_none()
I32 = np.int32


def _half_rows(rng, B, N, dtype, ties=True):
    x = rng.standard_normal((B, N)).astype(np.float32)
    if ties:
        x = np.round(x * 4) / 4  # many exact ties
        x[:, ::13] = -np.inf
        x[:, 5::17] = np.nan
        x[:, 7::19] = -0.0
    if dtype == "float16":
        return x.astype(np.float16)
    t = torch.from_numpy(x).to(torch.bfloat16)
    return t


def _as_f32(x):
    return x.astype(np.float32) if isinstance(x, np.ndarray) else x.float().numpy()


def test_every_float16_bit_pattern():
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)  # NaNs, +-inf, +-0, subnormals, normals
    got = gvr.topk_decode(h, 1 << 16, sorted=True)
    want = gvr.topk_decode(h.astype(np.float32), 1 << 16, sorted=True)
    assert np.array_equal(got, want)
    assert np.array_equal(got[:1000], expected_result(h.astype(np.float32)[None], 1000)[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N,k", [(1, 1), (97, 10), (4099, 300), (70001, 2048)])
def test_cpu_equals_float32_of_the_same_values(dtype, N, k):
    if dtype == "bfloat16" and torch is None:
        pytest.skip("bfloat16 arrays need torch")
    rng = np.random.default_rng(N)
    x = _half_rows(rng, 3, N, dtype)
    lengths = np.array([N, N // 2, 0], I32)
    ln = lengths if isinstance(x, np.ndarray) else torch.from_numpy(lengths)
    got = gvr.topk_decode(x, k, lengths=ln, sorted=True)
    got = got if isinstance(got, np.ndarray) else got.numpy()
    assert np.array_equal(got, expected_result(_as_f32(x), k, lengths))


def test_bfloat16_every_exponent_and_signs():
    if torch is None:
        pytest.skip("needs torch")
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)  # a spread of bfloat16 bit patterns
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    got = gvr.topk_decode(x, 500, sorted=True).numpy()
    assert np.array_equal(got, expected_result(x.float().numpy()[None], 500)[0])


def test_half_rows_with_row_starts_and_strided_view():
    rng = np.random.default_rng(3)
    x = _half_rows(rng, 4, 1000, "float16")
    starts = np.array([0, 1, 2, 3], I32)  # every misalignment of a half row
    got = gvr.topk_decode(x, 40, row_starts=starts, lengths=np.array([999, 998, 997, 996], I32), sorted=True)
    f = x.astype(np.float32)
    for b, s in enumerate(starts):
        assert np.array_equal(got[b], expected_result(f[b:b + 1, s:s + 999 - b], 40)[0])
    view = x[:, 1::1][:, :900]
    assert np.array_equal(gvr.topk_decode(view, 30, sorted=True), expected_result(view.astype(np.float32), 30))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "gvr", "radix"])
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N", [1, 97, 4099, 65537, 300001])
def test_cuda_half_equals_cpu(cuda, N, dtype, sorted_, method):
    if method == "radix" and N > 300000:
        pytest.skip("beyond the radix path")
    rng = np.random.default_rng(N)
    B, k = 5, 2048
    x = _half_rows(rng, B, N, dtype, ties=N < 70000)
    xt = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    lengths = np.array([N, max(1, N // 3), 0, N - 1 if N > 1 else 1, N // 2], I32)
    starts = np.array([0, 1, 2, 0, 3], I32) if N > 4 else None
    if starts is not None:
        lengths = np.minimum(lengths, N - starts)
    prev = gvr.topk_decode(xt.float(), k // 2)
    kw_h = dict(lengths=torch.from_numpy(lengths), sorted=sorted_)
    if starts is not None:
        kw_h["row_starts"] = torch.from_numpy(starts)
    want = gvr.topk_decode(xt, k, **kw_h).numpy()
    kw_d = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in kw_h.items()}
    for hint in (None, prev.cuda()):
        got = gvr.topk_decode(xt.cuda(), k, method=method, prev_topk=hint, **kw_d).cpu().numpy()
        if sorted_:
            assert np.array_equal(got, want), (N, dtype, method)
        else:
            assert_same_sets(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_half_page_table_and_graph(cuda, dtype):
    rng = np.random.default_rng(41)
    B, N, k, P = 4, 131072, 2048, 64
    x = _half_rows(rng, B, N, dtype, ties=False)
    xt = (torch.from_numpy(x) if isinstance(x, np.ndarray) else x).cuda()
    bt = torch.from_numpy(np.stack([rng.permutation(4096)[:N // P] for _ in range(B)]).astype(I32)).cuda()
    pos = torch.empty(B, k, dtype=torch.int32, device="cuda")
    slots = gvr.topk_decode(xt, k, block_table=bt, page_size=P, out_positions=pos, sorted=True)
    want_pos = gvr.topk_decode(xt.float(), k, sorted=True)
    assert torch.equal(pos, want_pos)
    assert torch.equal(slots.long(), bt.long().gather(1, pos.long() // P) * P + pos.long() % P)
    out = torch.empty(B, k, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        gvr.topk_decode(xt, k, out=out, sorted=True)
        with torch.cuda.graph(g, stream=s):
            gvr.topk_decode(xt, k, out=out, sorted=True)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(-3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_pos)


def test_half_rows_longer_than_the_kept_buffer():
    # the C path converts half rows into a per-thread buffer kept up to 2^20 elements; longer rows
    # take a buffer of their own: both, in either order, give the float32 results
    rng = np.random.default_rng(5)
    long_row = rng.standard_normal((1, (1 << 20) + 3)).astype(np.float16)
    short = rng.standard_normal((2, 5000)).astype(np.float16)
    for x in (short, long_row, short, long_row[:, : 1 << 20]):
        got = gvr.topk_decode(x, 100, sorted=True)
        assert np.array_equal(got, expected_result(x.astype(np.float32), 100))


def test_float16_subnormals_under_flush_denormal():
    # torch.set_flush_denormal(True) sets the CPU's denormals-are-zero mode; the C path's float16
    # conversion must not depend on it (subnormal halves are normal floats once converted)
    if torch is None or not torch.set_flush_denormal(True):
        pytest.skip("needs torch on a CPU with a flush-denormal mode")
    try:
        h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
        got = gvr.topk_decode(h, 1 << 16, sorted=True)
    finally:
        torch.set_flush_denormal(False)
    assert np.array_equal(got, gvr.topk_decode(h.astype(np.float32), 1 << 16, sorted=True))
