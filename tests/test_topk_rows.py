"""gvr.topk_decode's row geometry for DSA serving stacks (issue 15): ragged rows (``row_starts``, a
flat buffer read by many rows) and ``next_n`` rows per request (lengths, prev_topk and block_table
given per request). CPU results against NumPy (tests/reference.py); CUDA results against the C CPU
path (the same index sets, the same order when sorted); bad inputs named; CUDA graph replay and
torch.compile of the new arguments."""
import numpy as np
import pytest

import gvr
from harness import assert_same_sets, torch_or_none
from reference import check_row, page_table_slots, topk_reference

torch = torch_or_none()
I32 = np.int32


def _scores(rng, B, N, ties=False):
    x = rng.standard_normal((B, N)).astype(np.float32)
    if ties:  # ties everywhere, -inf and NaN: the total order decides
        x = np.round(x * 2).astype(np.float32)
        x[:, ::7] = -np.inf
        x[:, 3::11] = np.nan
    return x


def _expected_rows(x, k, starts, lens):
    """per row: the Top-K of x[b, s : s + L] as positions relative to s, -1 padded"""
    out = np.full((len(starts), k), -1, I32)
    for b, (s, L) in enumerate(zip(starts, lens)):
        r = topk_reference(x[b if x.shape[0] > 1 else 0, s:s + L], k)
        out[b, :len(r)] = r
    return out


def _check_rows(got, x, k, starts, lens, *, sorted_=False):
    for b, (s, L) in enumerate(zip(starts, lens)):
        check_row(got[b], x[b if x.shape[0] > 1 else 0, s:s + L], k, L, sorted=sorted_)


# --------------------------------------------------------------------------------------------
# CPU against NumPy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("N,k", [(1, 1), (50, 7), (1000, 64), (4099, 300)])
def test_row_starts_with_lengths(N, k, ties):
    rng = np.random.default_rng(N + k)
    B = 6
    x = _scores(rng, B, N, ties)
    starts = rng.integers(0, N + 1, B).astype(I32)
    starts[0], starts[-1] = 0, N  # a row at the start, an empty row at the end
    lens = np.array([rng.integers(0, N - s + 1) for s in starts], I32)
    got = gvr.topk_decode(x, k, row_starts=starts, lengths=lens)
    _check_rows(got, x, k, starts, lens)
    got_sorted = gvr.topk_decode(x, k, row_starts=starts, lengths=lens, sorted=True)
    assert np.array_equal(got_sorted, _expected_rows(x, k, starts, lens))


def test_row_starts_without_lengths_read_to_the_end():
    rng = np.random.default_rng(3)
    x = _scores(rng, 4, 300)
    starts = np.array([0, 1, 299, 300], I32)
    got = gvr.topk_decode(x, 20, row_starts=starts, sorted=True)
    assert np.array_equal(got, _expected_rows(x, 20, starts, 300 - starts))
    assert (got[3] == -1).all() and got[2, 0] == 0 and (got[2, 1:] == -1).all()


@pytest.mark.parametrize("shape", ["1d", "one_row"])
def test_flat_buffer_many_rows(shape):
    """vLLM's prefill form: one flat buffer of logits, each query's row a window of it"""
    rng = np.random.default_rng(5)
    T = 5000
    flat = _scores(rng, 1, T)
    buf = flat[0] if shape == "1d" else flat
    starts = np.array([0, 100, 1000, 1000, 4990], I32)
    lens = np.array([100, 900, 0, 4000, 10], I32)
    got = gvr.topk_decode(buf, 64, row_starts=starts, lengths=lens, sorted=True)
    assert got.shape == (5, 64)
    assert np.array_equal(got, _expected_rows(flat, 64, starts, lens))
    assert np.array_equal(buf if shape == "1d" else buf[0], flat[0])  # read only


def test_row_starts_page_table_positions_relative():
    """with a block table, slots are those of the row-relative positions (the request's own tokens)"""
    rng = np.random.default_rng(7)
    B, N, k, P = 3, 640, 32, 16
    x = _scores(rng, B, N)
    starts = np.array([0, 64, 600], I32)
    lens = np.array([640, 500, 40], I32)
    bt = np.stack([rng.permutation(200)[:N // P] for _ in range(B)]).astype(I32)
    pos = np.empty((B, k), I32)
    slots = gvr.topk_decode(x, k, row_starts=starts, lengths=lens, block_table=bt, page_size=P, out_positions=pos,
                            sorted=True)
    want = _expected_rows(x, k, starts, lens)
    assert np.array_equal(pos, want)
    assert np.array_equal(slots, page_table_slots(want, bt, P))


@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_next_n_per_request_lengths_hint_and_table(next_n):
    """lengths, prev_topk and block_table with one row per request: row b's length is
    lengths[b // next_n] - (next_n - 1 - b % next_n) (vLLM's causal rule), clamped at 0; the request's
    hint and table serve its rows; the result equals the per-row call"""
    rng = np.random.default_rng(11 + next_n)
    R, N, k, P = 4, 512, 40, 32
    B = R * next_n
    x = _scores(rng, B, N)
    req_len = np.array([512, 300, 1, 0], I32)
    row_len = np.array([max(0, req_len[b // next_n] - (next_n - 1 - b % next_n)) for b in range(B)], I32)
    prev_req = np.stack([rng.permutation(N)[:k] for _ in range(R)]).astype(I32)
    bt_req = np.stack([rng.permutation(64)[:N // P] for _ in range(R)]).astype(I32)
    pos = np.empty((B, k), I32)
    slots = gvr.topk_decode(x, k, lengths=req_len if next_n > 1 else row_len, next_n=next_n,
                            prev_topk=prev_req if next_n > 1 else np.repeat(prev_req, next_n, 0),
                            block_table=bt_req if next_n > 1 else np.repeat(bt_req, next_n, 0), page_size=P,
                            out_positions=pos, sorted=True)
    want = _expected_rows(x, k, np.zeros(B, I32), row_len)
    assert np.array_equal(pos, want)
    assert np.array_equal(slots, page_table_slots(want, np.repeat(bt_req, next_n, 0), P))
    # per-row arguments with next_n give the same
    per_row = gvr.topk_decode(x, k, lengths=row_len, next_n=next_n, prev_topk=np.repeat(prev_req, next_n, 0),
                              sorted=True)
    assert np.array_equal(per_row, want)


def test_next_n_with_row_starts():
    rng = np.random.default_rng(13)
    next_n, R, N, k = 2, 3, 400, 16
    B = R * next_n
    x = _scores(rng, B, N)
    starts = rng.integers(0, 100, B).astype(I32)
    req_len = np.array([300, 5, 250], I32)
    row_len = np.array([min(max(0, req_len[b // next_n] - (next_n - 1 - b % next_n)), N - starts[b]) for b in range(B)],
                       I32)
    got = gvr.topk_decode(x, k, row_starts=starts, lengths=req_len, next_n=next_n, sorted=True)
    assert np.array_equal(got, _expected_rows(x, k, starts, row_len))


@pytest.mark.parametrize("max_length", [1, 37, 300, 10 ** 6])
def test_max_length_cuts_rows(max_length):
    """max_length: every row cut to its first max_length elements (with lengths, row_starts, next_n)"""
    rng = np.random.default_rng(max_length)
    B, N, k = 4, 500, 50
    x = _scores(rng, B, N, ties=True)
    starts = np.array([0, 10, 400, 500], I32)
    lens = np.array([500, 200, 100, 0], I32)
    cut = np.minimum(lens, max_length)
    got = gvr.topk_decode(x, k, row_starts=starts, lengths=lens, max_length=max_length, sorted=True)
    assert np.array_equal(got, _expected_rows(x, k, starts, cut))
    got = gvr.topk_decode(x, k, max_length=max_length, sorted=True)
    assert np.array_equal(got, _expected_rows(x, k, np.zeros(B, I32), np.full(B, min(N, max_length))))


def test_bad_row_arguments_named_and_nothing_modified():
    x = np.zeros((4, 50), np.float32)
    x0 = x.copy()
    out = np.full((4, 5), 9, I32)
    cases = [
        (dict(row_starts=np.array([0, 51, 0, 0], I32)), ValueError, r"'row_starts' must lie in \[0, 50\]"),
        (dict(row_starts=np.array([0, -1, 0, 0], I32)), ValueError, r"'row_starts' must lie in \[0, 50\]"),
        (dict(row_starts=np.array([0, 40, 0, 0], I32), lengths=np.array([5, 11, 5, 5], I32)), ValueError,
         r"row 1: row_starts \+ lengths = 40 \+ 11 exceeds the row of 50 scores"),
        (dict(row_starts=np.array([0, 1, 2], I32)), ValueError, r"'row_starts' must have shape \[4\]"),
        (dict(row_starts=np.zeros(4, np.int64)), TypeError, r"'row_starts' must be int32"),
        (dict(next_n=3), ValueError, r"'next_n' = 3 must divide the number of rows B = 4"),
        (dict(next_n=0), ValueError, r"'next_n' must be an int >= 1"),
        (dict(next_n=2.0), TypeError, r"'next_n'"),
        (dict(next_n=2, lengths=np.array([60, 5], I32)), ValueError, r"'lengths' must lie in \[0, 50\]"),
        (dict(next_n=2, prev_topk=np.zeros((3, 2), I32)), ValueError, r"'prev_topk' must have 4 rows"),
        (dict(max_length=0), ValueError, r"'max_length' must be an int >= 1"),
        (dict(max_length=3.5), TypeError, r"'max_length'"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            gvr.topk_decode(x, 5, out=out, **kw)
        assert np.array_equal(x, x0) and (out == 9).all(), kw


# --------------------------------------------------------------------------------------------
# CUDA against the C path
# --------------------------------------------------------------------------------------------


def _gpu(x):
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "gvr", "radix"])
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("N", [97, 4099, 65537, 300001])
def test_cuda_row_starts_equals_cpu(cuda, N, sorted_, method):
    if method == "radix" and N > 300000:
        pytest.skip("beyond the radix path")
    rng = np.random.default_rng(N)
    B, k = 5, 256
    x = _scores(rng, B, N, ties=N < 5000)
    starts = rng.integers(0, N + 1, B).astype(I32)
    starts[0] = 0
    starts[1] = min(3, N)  # 3 floats past a 16-byte boundary
    lens = np.array([rng.integers(0, N - s + 1) for s in starts], I32)
    lens[0] = N
    for kw_h, kw_d in ((dict(lengths=lens), dict(lengths=_gpu(lens))), ({}, {})):
        want = gvr.topk_decode(x, k, row_starts=starts, sorted=sorted_, **kw_h)
        got = gvr.topk_decode(_gpu(x), k, row_starts=_gpu(starts), sorted=sorted_, method=method, **kw_d).cpu().numpy()
        if sorted_:
            assert np.array_equal(got, want), (N, method)
        else:
            assert_same_sets(got, want)


@pytest.mark.gpu
def test_cuda_flat_buffer_and_next_n(cuda):
    rng = np.random.default_rng(17)
    T, k = 200000, 2048
    flat = _scores(rng, 1, T)
    starts = np.array([0, 5, 1001, 70000, 199000, 3], I32)
    lens = np.array([200000, 1000, 50000, 130000, 1000, 7], I32)
    want = gvr.topk_decode(flat, k, row_starts=starts, lengths=lens, sorted=True)
    got = gvr.topk_decode(_gpu(flat), k, row_starts=_gpu(starts), lengths=_gpu(lens), sorted=True).cpu().numpy()
    assert np.array_equal(got, want)
    # next_n = 2 rows per request: per-request lengths, hint, block table
    next_n, R, N, P = 2, 3, 65536, 64
    x = _scores(rng, R * next_n, N)
    req_len = np.array([65536, 40000, 1], I32)
    prev = np.stack([rng.permutation(N)[:k] for _ in range(R)]).astype(I32)
    bt = np.stack([rng.permutation(2048)[:N // P] for _ in range(R)]).astype(I32)
    pos_c = np.empty((R * next_n, k), I32)
    slots_c = gvr.topk_decode(x, k, lengths=req_len, next_n=next_n, prev_topk=prev, block_table=bt, page_size=P,
                              out_positions=pos_c, sorted=True)
    for method in ("auto", "gvr", "radix"):
        pos_g = torch.empty(R * next_n, k, dtype=torch.int32, device="cuda")
        slots_g = gvr.topk_decode(_gpu(x), k, lengths=_gpu(req_len), next_n=next_n, prev_topk=_gpu(prev),
                                  block_table=_gpu(bt), page_size=P, out_positions=pos_g, sorted=True, method=method)
        assert np.array_equal(pos_g.cpu().numpy(), pos_c), method
        assert np.array_equal(slots_g.cpu().numpy(), slots_c), method


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "gvr", "radix"])
def test_cuda_max_length_equals_cpu(cuda, method):
    """a [B, 2^20] buffer of short rows with max_length (launches sized for it), and a flat buffer"""
    rng = np.random.default_rng(31)
    B, N, k = 6, 1 << 20, 2048
    x = _scores(rng, B, N)
    lens = np.array([70000, 65536, 3000, 1, 0, 69999], I32)
    for ml in (70000, 4096, 100):
        want = gvr.topk_decode(x, k, lengths=lens, max_length=ml, sorted=True)
        got = gvr.topk_decode(_gpu(x), k, lengths=_gpu(lens), max_length=ml, sorted=True, method=method)
        assert np.array_equal(got.cpu().numpy(), want), (ml, method)
    starts = np.array([0, 100000, 200000, 900000, 1048576, 5], I32)
    want = gvr.topk_decode(x[:1], k, row_starts=starts, lengths=np.minimum(lens, N - starts), max_length=70000,
                           sorted=True)
    got = gvr.topk_decode(_gpu(x[:1]), k, row_starts=_gpu(starts), lengths=_gpu(lens), max_length=70000, sorted=True,
                          method=method)
    assert np.array_equal(got.cpu().numpy(), want), method


@pytest.mark.gpu
def test_cuda_device_values_clamped(cuda):
    """device row_starts / lengths outside the row are clamped (not checked on the host): the same as
    the clamped values on the CPU"""
    rng = np.random.default_rng(19)
    x = _scores(rng, 3, 1000)
    starts, lens = np.array([-5, 990, 2000], I32), np.array([50, 100, 10], I32)
    got = gvr.topk_decode(_gpu(x), 30, row_starts=_gpu(starts), lengths=_gpu(lens), sorted=True).cpu().numpy()
    want = gvr.topk_decode(x, 30, row_starts=np.array([0, 990, 1000], I32), lengths=np.array([50, 10, 0], I32),
                           sorted=True)
    assert np.array_equal(got, want)


@pytest.mark.gpu
def test_cuda_graph_and_compile_with_row_starts(cuda):
    rng = np.random.default_rng(23)
    B, N, k = 4, 65536, 512
    x = _gpu(_scores(rng, B, N))
    starts = _gpu(np.array([0, 1, 1000, 30000], I32))
    lens = _gpu(np.array([65536, 60000, 100, 35536], I32))
    want = gvr.topk_decode(x, k, row_starts=starts, lengths=lens, sorted=True)
    out = torch.empty(B, k, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        gvr.topk_decode(x, k, row_starts=starts, lengths=lens, sorted=True, out=out)
        with torch.cuda.graph(g, stream=s):
            gvr.topk_decode(x, k, row_starts=starts, lengths=lens, sorted=True, out=out)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)

    @torch.compile(fullgraph=True)
    def f(x, starts, lens):
        return gvr.topk_decode(x, k, row_starts=starts, lengths=lens, sorted=True, next_n=2)

    assert torch.equal(f(x, starts, lens), gvr.topk_decode(x, k, row_starts=starts, lengths=lens, sorted=True,
                                                           next_n=2))


def test_compile_cpu_with_row_starts_and_next_n():
    if torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(29)
    x = torch.from_numpy(_scores(rng, 4, 300))
    starts = torch.tensor([0, 10, 20, 300], dtype=torch.int32)
    lens = torch.tensor([200, 150], dtype=torch.int32)  # per request, next_n = 2

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, starts, lens):
        return gvr.topk_decode(x, 16, row_starts=starts, lengths=lens, next_n=2, sorted=True)

    want = gvr.topk_decode(x, 16, row_starts=starts, lengths=lens, next_n=2, sorted=True)
    assert torch.equal(f(x, starts, lens), want)
    flat = torch.from_numpy(_scores(rng, 1, 500))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def g(flat, starts):
        return gvr.topk_decode(flat, 8, row_starts=starts)

    st = torch.tensor([0, 100, 250], dtype=torch.int32)
    assert g(flat, st).shape == (3, 8)
    assert_same_sets(g(flat, st).numpy(), gvr.topk_decode(flat, 8, row_starts=st).numpy())
