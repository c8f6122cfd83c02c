"""GPU tests for gvr.topk_decode: the CUDA kernels against the C CPU implementation.

Every result is compared with the CPU path of gvr (itself checked against NumPy in
test_topk_cpu.py): identical index sets per row; identical order when sorted=True. Every test is
collected; each is skipped, with the reason, when torch with a CUDA device or gvr's CUDA library is
missing (conftest.py, harness.gpu_skip_reason).
"""
import numpy as np
import pytest

import gvr
from gvr import data
from harness import assert_same_sets, cpu_result, torch_or_none

torch = torch_or_none()  # None without torch: every test here is then skipped before it runs

pytestmark = pytest.mark.gpu
METHODS = ("auto", "gvr", "radix")


def gpu(x):
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def rows(gen, B, N, seed):
    if gen == "normal":
        return data.iid_scores(B, N, dist="normal", seed=seed)
    if gen == "uniform":
        return data.iid_scores(B, N, dist="uniform", seed=seed)
    return np.stack([data.adversarial(gen, N, k=min(2048, max(N - 1, 1)), seed=seed + b) for b in range(B)])


GENS = ("normal", "uniform") + tuple(data.ADVERSARIAL_KINDS)
SIZES = (1, 2, 19, 97, 1025, 4097, 65537, 131071)


@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("gen", GENS)
def test_generators_sizes(gen, N):
    x = rows(gen, 3, N, seed=N)
    xg = gpu(x)
    for k in sorted({0, 1, 7, 2048, max(N - 1, 0), N, N + 5}):
        want = cpu_result(x, k)
        for m in METHODS:
            got = gvr.topk_decode(xg, k, method=m)
            assert got.dtype == torch.int32 and got.is_cuda
            assert_same_sets(got.cpu().numpy(), want, f"{gen} N={N} k={k} {m}")


@pytest.mark.parametrize("B", (1, 3, 64, 257))
@pytest.mark.parametrize("N", (4097, 65537, 131072, 262144))
def test_batches_ragged_strided(B, N):
    rng = np.random.default_rng(B * 7 + N)
    big = rng.standard_normal((B, N + 64)).astype(np.float32)
    big[:, :: 97] = -np.inf
    lengths = data.ragged_lengths(B, N, seed=B).astype(np.int32)
    xg_big = gpu(big)
    xg = xg_big[:, 3 : N + 3]  # row-strided, unaligned rows: no copy
    x = big[:, 3 : N + 3]
    for k in (1, 2048):
        want = cpu_result(x, k, lengths=lengths)
        for m in METHODS:
            got = gvr.topk_decode(xg, k, lengths=gpu(lengths), method=m)
            assert_same_sets(got.cpu().numpy(), want, f"B={B} N={N} k={k} {m}")
        prev = gpu(want)
        got = gvr.topk_decode(xg, k, lengths=gpu(lengths), prev_topk=prev)
        assert_same_sets(got.cpu().numpy(), want, f"B={B} N={N} k={k} exact prev")


@pytest.mark.parametrize("N", (4093, 8192, 32767, 131072, 262143))
def test_rows_at_every_offset_from_a_16_byte_boundary(N):
    # rows are read in 16-byte aligned coordinates: each start offset (0..3 floats past a boundary),
    # one shared by every row (B=1, or a stride that is a multiple of 4 floats) or mixed (other
    # strides), with the largest scores at both ends of each row, where a shifted layout would drop
    # or double them
    rng = np.random.default_rng(N)
    W4 = (N + 3) // 4 * 4
    for B, W in ((1, N), (5, W4), (5, W4 + 1), (5, W4 + 2), (5, W4 + 3)):
        flat = rng.standard_normal(B * W + 4).astype(np.float32)
        for s in range(4):
            f = flat.copy()
            for b in range(B):
                f[s + b * W : s + b * W + 3] = 50.0 + np.arange(3)
                f[s + b * W + N - 2 : s + b * W + N] = 60.0
            view = gpu(f).as_strided((B, N), (W, 1), s)
            x = view.cpu().numpy()
            for k in (7, 2048):
                want = cpu_result(x, k)
                what = f"N={N} B={B} stride={W} offset={s} k={k}"
                for m in METHODS:
                    assert_same_sets(gvr.topk_decode(view, k, method=m).cpu().numpy(), want, f"{what} {m}")
                got = gvr.topk_decode(view, k, prev_topk=gpu(want), method="gvr")
                assert_same_sets(got.cpu().numpy(), want, f"{what} gvr exact prev")


def test_radix_limit_counts_the_row_offset():
    # the radix path holds 524288 positions per row: a row of 524288 starting on a 16-byte boundary
    # fits, one starting a float past it does not (a ValueError naming the limit), GVR serves both
    N = 524288
    x = data.iid_scores(1, N + 1, dist="normal", seed=5)
    xg = gpu(x)
    aligned, shifted = xg[:, :N], xg[:, 1:]
    assert_same_sets(gvr.topk_decode(aligned, 2048, method="radix").cpu().numpy(), cpu_result(x[:, :N], 2048), "aligned")
    with pytest.raises(ValueError, match="524285"):
        gvr.topk_decode(shifted, 2048, method="radix")
    assert_same_sets(gvr.topk_decode(shifted, 2048).cpu().numpy(), cpu_result(x[:, 1:], 2048), "shifted auto")


@pytest.mark.parametrize("overlap", (0.45, 0.02))
@pytest.mark.parametrize("N", (32768, 131072))
def test_decode_trace_prev_kinds(N, overlap):
    k = 2048
    steps = list(data.decode_trace(N, 3, k=k, overlap=overlap, seed=1))
    prev_cpu = None
    rng = np.random.default_rng(0)
    for t, row in enumerate(steps):
        want = cpu_result(row, k)
        kinds = {
            "none": None,
            "empty": np.zeros(0, np.int32),
            "all_minus1": np.full(k, -1, np.int32),
            "out_of_range": rng.integers(-(2**31), 2**31 - 1, k).astype(np.int32),
            "duplicated": np.full(k, int(want[0]), np.int32),
            "random": rng.integers(0, len(row), k).astype(np.int32),
            "exact": want.copy(),
        }
        if prev_cpu is not None:
            kinds["previous_step"] = prev_cpu
        xg = gpu(row)
        for name, p in kinds.items():
            pg = None if p is None else gpu(p)
            for m in METHODS:
                got = gvr.topk_decode(xg, k, prev_topk=pg, method=m)
                assert_same_sets(got.cpu().numpy()[None], want[None], f"step {t} prev={name} {m}")
        prev_cpu = want


def test_sorted_matches_cpu_order():
    for gen in ("normal", "few_distinct", "ties_at_kth", "nan_heavy", "signed_zeros", "all_equal"):
        x = rows(gen, 4, 70001, seed=3)
        lengths = np.array([70001, 5, 0, 40000], np.int32)
        for k in (1, 7, 2048, 4096):
            want = cpu_result(x, k, lengths=lengths, sorted=True)
            for m in METHODS:
                got = gvr.topk_decode(gpu(x), k, lengths=gpu(lengths), sorted=True, method=m).cpu().numpy()
                assert np.array_equal(got, want), (gen, k, m)


def test_one_d_out_and_streams():
    x = data.iid_scores(1, 50000, seed=5)[0]
    want = cpu_result(x, 100)
    xg = gpu(x)
    out = torch.full((100,), 7, dtype=torch.int32, device="cuda")
    r = gvr.topk_decode(xg, 100, out=out)
    assert r is out and r.shape == (100,)
    assert_same_sets(r.cpu().numpy()[None], want[None])
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        big = torch.from_numpy(x).to("cuda", non_blocking=False)
        r2 = gvr.topk_decode(big * 1.0, 100)  # producer work pending on s
    s.synchronize()
    assert_same_sets(r2.cpu().numpy()[None], want[None], "non-default stream")
    r3 = gvr.topk_decode(xg, 100, stream=s)
    s.synchronize()
    assert_same_sets(r3.cpu().numpy()[None], want[None], "stream=")


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    x = data.iid_scores(3, 30000, seed=9)
    want = cpu_result(x, 500)
    got = gvr.topk_decode(cupy.asarray(x), 500)
    assert isinstance(got, cupy.ndarray)
    assert_same_sets(cupy.asnumpy(got), want, "cupy")


def test_determinism_100_calls():
    x = gpu(np.stack([data.adversarial("ties_at_kth", 131072, k=2048, seed=1), data.iid_scores(1, 131072)[0]]))
    prev = gvr.topk_decode(x, 2048)
    for m in METHODS:
        first = gvr.topk_decode(x, 2048, prev_topk=prev, method=m).cpu()
        for _ in range(100):
            assert torch.equal(gvr.topk_decode(x, 2048, prev_topk=prev, method=m).cpu(), first)


def test_mixed_devices_and_cuda_errors():
    x = gpu(np.ones((2, 100), np.float32))
    with pytest.raises(ValueError, match="out"):
        gvr.topk_decode(x, 3, out=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="prev_topk"):
        gvr.topk_decode(x, 3, prev_topk=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="sorted"):
        gvr.topk_decode(x, 5000, sorted=True)


def test_lengths_checked_with_gvr_check(monkeypatch):
    x = gpu(np.ones((2, 100), np.float32))
    bad = gpu(np.array([5, 101], np.int32))
    r = gvr.topk_decode(x, 3, lengths=bad)  # clamped on the GPU, no sync
    assert r.shape == (2, 3)
    monkeypatch.setenv("GVR_CHECK", "1")
    with pytest.raises(ValueError, match="lengths"):
        gvr.topk_decode(x, 3, lengths=bad)


def test_decoder_cuda_graph_replay_matches_eager():
    layers, B, N, k, steps = 2, 3, 32768, 256, 100
    trace = data.decode_trace_batch(B, N, 4, k=k, overlap=0.45, seed=2)
    xs = [gpu(t[:, :N]) for t in trace]  # fixed shape for the graph
    static_x = torch.empty_like(xs[0])

    eager = gvr.TopKDecoder(layers, B, k, device="cuda")
    eager_out = []
    for s in range(steps):
        static_x.copy_(xs[s % len(xs)])
        eager_out.append([eager(layer, static_x).clone() for layer in range(layers)])

    dec = gvr.TopKDecoder(layers, B, k, device="cuda")
    static_x.copy_(xs[0])
    for layer in range(layers):  # step 0 eagerly (no prediction yet)
        dec(layer, static_x)
    g = torch.cuda.CUDAGraph()
    captured = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g, stream=stream):
            for s in range(1, steps):
                static_x.copy_(xs[s % len(xs)])
                captured.append([dec(layer, static_x) for layer in range(layers)])
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    # the last two steps' buffers hold the replayed results of steps 98 and 99
    for s in (steps - 2, steps - 1):
        for layer in range(layers):
            assert_same_sets(captured[s - 1][layer].cpu().numpy(), eager_out[s][layer].cpu().numpy(), f"step {s}")
    last = eager_out[-1][0].cpu().numpy()
    want = cpu_result(xs[(steps - 1) % len(xs)].cpu().numpy(), k)
    assert_same_sets(last, want, "eager decoder vs CPU")


@pytest.mark.parametrize("B,N", ((300, 3000), (40, 200001), (64, 131072)))
def test_streamed_geometries(B, N):
    # more rows than fit on the GPU at once with the row held in registers: the streamed GVR kernel
    # (one CTA per row at B=300, clusters re-reading the row in chunks at B=40 and B=64)
    x = data.iid_scores(B, N, dist="normal", seed=N)
    x[:, ::5] = np.round(x[:, ::5])  # ties
    lengths = data.ragged_lengths(B, N, seed=3).astype(np.int32)
    xg = gpu(x)
    for k in (64, 2048):
        want = cpu_result(x, k, lengths=lengths)
        for prev in (None, gpu(want)):
            for m in ("auto", "gvr"):
                got = gvr.topk_decode(xg, k, lengths=gpu(lengths), prev_topk=prev, method=m)
                assert_same_sets(got.cpu().numpy(), want, f"B={B} N={N} k={k} {m} prev={prev is not None}")


def test_streamed_collection_fallbacks():
    # The streamed kernel collects the elements at or above a threshold tc (the normal estimate of the
    # 1.15 k-th value from a strided sample of 512, raised by its skewness) during its first pass and
    # reads them instead of the row afterwards.
    # Its other paths must give the same sets (scripts/topk_pairs_replay.py replays which rows take which):
    # (1) a warp's segment overflows (k = 60000 of 262144 at B=64: ~35K collected per CTA, whose
    #     warps hold 1024 pairs each): the rounds re-read the row;
    # (2) a constant sample (every strided entry tied at 5.0, the k-th value too): no threshold, the
    #     rounds read the row;
    # (3) the pairs' first bins (256 over [threshold, threshold + 3 sample sd), counted before the
    #     exchange) put the k-th in the top bin: 4096 scores per row in [50, 60] in steps of 0.5
    #     (tied) above a threshold of 14-43 (raised by the sample's skewness), so that the rounds go on
    #     from the pairs (the top bin in 49 of the 64 rows, inside the band in the others);
    # (4) fewer than k at or above tc: a second pass collects [tlo, tc) (k = 2048 of N(0, 1) rows: a third
    #     of them); "gap": the unsampled scores of (1.0, 2.6) moved 3.0 down, so that the second pass
    #     too leaves fewer than k (the search goes on below tlo from the row, its band empty at first);
    #     "lump": the unsampled scores above 0.9 tied at 2.25 under a tc near 2.5, so that the second
    #     pass overflows the segments (a few rows' tc lies under 2.25: the first pass overflows).
    B, N = 64, 262144
    x = data.iid_scores(B, N, dist="normal", seed=11)
    tied = x.copy()
    tied[:, ::2] = 5.0
    heavy = x.copy()
    rng = np.random.default_rng(5)
    for r in range(B):
        heavy[r, rng.choice(N, 4096, replace=False)] = np.round(rng.uniform(50, 60, 4096) * 2) / 2
    sampled = np.zeros(N, bool)
    sampled[(np.arange(512) * N) // 512] = True  # the streamed kernel's strided sample
    gap = x.copy()
    gap[(gap > 1.0) & (gap < 2.6) & ~sampled] -= 3.0
    lump = x.copy()
    lump[(lump > 0.9) & ~sampled] = 2.25
    for scores, k in ((x, 60000), (tied, 2048), (heavy, 2048), (x, 2048), (gap, 2048), (lump, 2048)):
        want = cpu_result(scores, k)
        xg = gpu(scores)
        for prev in (None, gpu(want)):
            got = gvr.topk_decode(xg, k, prev_topk=prev, method="gvr")
            assert_same_sets(got.cpu().numpy(), want, f"k={k} prev={prev is not None}")
    # (4) with ragged lengths and half-precision scores: tc, tlo and the counts per row length
    lengths = data.ragged_lengths(B, N, seed=4).astype(np.int32)
    for dtype in ("float16", "bfloat16"):
        for scores in (x, gap):
            xg = gpu(scores).to(getattr(torch, dtype))
            want = cpu_result(xg.float().cpu().numpy(), 2048, lengths=lengths)
            got = gvr.topk_decode(xg, 2048, lengths=gpu(lengths), method="gvr")
            assert_same_sets(got.cpu().numpy(), want, f"{dtype} ragged")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_pair_tiles(dtype):
    # After its first pass the streamed kernel reads the collected pairs in tiles of 128, 256 or 512
    # per warp, the smallest that holds the CTA's fullest warp, and several tiles of 512 past that.
    # Replayed in NumPy (the sample's threshold, each warp's positions), these rows take: at B=64 128K
    # (two CTAs of 16 warps per row, segments of 512 pairs per warp) k=512 and 2048 tiles of 128,
    # 4096 of 256, 8192 of 512, 16384 an overflowed segment (the row again); at B=64 256K (segments
    # of 1024) k=16384 two tiles of 512. A few rows of each hold fewer than k above the threshold
    # (the search below it). A tied quarter of each row puts runs of equal keys into the pairs.
    for N, ks in ((131072, (512, 2048, 4096, 8192, 16384)), (262144, (16384,))):
        x = data.iid_scores(64, N, dist="normal", seed=21)
        x[:, ::4] = np.round(x[:, ::4] * 4) / 4
        xg = gpu(x).to(getattr(torch, dtype))
        xc = xg.float().cpu().numpy()
        for k in ks:
            want = cpu_result(xc, k)
            got = gvr.topk_decode(xg, k, method="gvr")
            assert_same_sets(got.cpu().numpy(), want, f"{dtype} N={N} k={k}")


def check_strided_rows(flat, B, N, W, dtype, lengths, label):
    """Rows b = flat[b W : b W + N] (W odd: rows at every phase of a 16-byte vector) as `dtype` on the GPU,
    k = 64 and 2048, methods auto and gvr, against the C path on the same values."""
    full = torch.from_numpy(flat).to(getattr(torch, dtype))
    view = full.cuda().as_strided((B, N), (W, 1), 0)
    ref = np.lib.stride_tricks.as_strided(full.float().numpy(), (B, N), (4 * W, 4)).copy()
    for k in (64, 2048):
        want = cpu_result(ref, k, lengths=lengths)
        for m in ("auto", "gvr"):
            got = gvr.topk_decode(view, k, lengths=gpu(lengths), method=m)
            assert_same_sets(got.cpu().numpy(), want, f"{label} k={k} {m}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("B", (64, 40, 16))
def test_streamed_segment_edges(B, dtype):
    # A streamed row's positions (aligned coordinates: element i at position i + its start's phase s
    # in a 16-byte vector) are split over the row's C CTAs: CTA r owns [r S, r S + S), S = nch chunks
    # of 8192 positions (nch = ceil(chunks / C), chunks of the launch's longest row plus 3 for an odd
    # stride), or, in scripts/patches/topk_even_split.diff, S = 4 ceil(ceil((L + s) / C) / 4) with loads
    # bounded by the next CTA's first element, or, in scripts/patches/topk_chunk_deal.diff, at any chunk
    # boundary (the chunks dealt unevenly). C is 2 at B=64, 3 at B=40 and 8 at B=16 on a 132-SM
    # H100 (other GPUs: other C). The largest scores and runs of ties sit on both sides of every split
    # point of these kinds for each C of 1-8 and of every chunk boundary, in rows of lengths just past and
    # before chunk and cluster multiples, at every phase (an odd row stride): an element read by two
    # CTAs or by none changes the set.
    N = 262144 + 9
    W = N + 2  # odd: rows at every phase
    P = 8192
    rng = np.random.default_rng(B)
    flat = rng.standard_normal(B * W + 8).astype(np.float32)
    flat[::5] = np.round(flat[::5], 1)
    lengths = data.ragged_lengths(B, N, seed=B).astype(np.int32)
    picks = (N, N - 9, 262145, 262143, 131073, 131071, 131075, 100000, 196609, 8192 * 24 + 1, 65537, 16385 * 2)
    lengths[: len(picks)] = picks
    chunks = -(-(N + 3) // P)
    for b in range(B):
        st, n = b * W, int(lengths[b])
        s = st % 4  # the row's phase (the buffer starts on a vector boundary)
        for C in range(1, 9):
            q = -(-(n + s) // C)
            for S in (-(-chunks // C) * P, -(-q // 4) * 4):
                for r in range(1, C):
                    i = r * S - s  # the first element of CTA r
                    if 1 <= i < n - 1:
                        flat[st + i - 1 : st + i + 1] = 40.0 + (b % 3) if C % 2 else 30.0 + r
        for m in range(1, chunks):
            i = m * P - s  # the first element of chunk m
            if 1 <= i < n - 1:
                flat[st + i - 1 : st + i + 1] = 35.0 + m % 4
    check_strided_rows(flat, B, N, W, dtype, lengths, f"{dtype} B={B}")


def test_rows_beyond_the_radix_limit():
    # the GVR kernel streams rows of any length; the radix path holds at most 16 * 32768 per row
    N = 600001
    x = data.iid_scores(2, N, dist="normal", seed=9)
    xg = gpu(x)
    for k in (1, 2048):
        want = cpu_result(x, k)
        for m in ("auto", "gvr"):
            assert_same_sets(gvr.topk_decode(xg, k, method=m).cpu().numpy(), want, f"N={N} k={k} {m}")
    with pytest.raises(ValueError, match="exceed the radix path"):
        gvr.topk_decode(xg, 2048, method="radix")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("N", [1, 97, 4097, 65537, 300001])
def test_page_table_transform_matches_cpu(N, sorted_, method):
    """The fused page-table transform: slots and positions equal the CPU path's (sets per row, the
    same order when sorted; the slots of the CPU's positions), with lengths, unmapped pages, -1 padding,
    with and without a previous Top-K."""
    from reference import page_table_slots
    rng = np.random.default_rng(N)
    B, k, P = 3, 64, 64
    x = rows("normal", B, N, seed=N)
    pages = -(-N // P)
    bt = np.stack([rng.permutation(2 * pages + 5)[:pages] for _ in range(B)]).astype(np.int32)
    bt[1, pages // 2] = -1
    lengths = np.array([N, max(1, N // 3), 0], np.int32)
    for prev in (None, gvr.topk_decode(x, k // 2)):
        pos_c = np.empty((B, k), np.int32)
        slots_c = gvr.topk_decode(x, k, lengths=lengths, block_table=bt, page_size=P, out_positions=pos_c,
                                  sorted=sorted_, prev_topk=prev)
        pos_g = torch.full((B, k), 7, dtype=torch.int32, device="cuda")
        slots_g = gvr.topk_decode(gpu(x), k, lengths=gpu(lengths), block_table=gpu(bt), page_size=P,
                                  out_positions=pos_g, sorted=sorted_, method=method,
                                  prev_topk=None if prev is None else gpu(prev))
        pg, sg = pos_g.cpu().numpy(), slots_g.cpu().numpy()
        assert np.array_equal(sg, page_table_slots(pg, bt, P)), (N, sorted_, method)
        if sorted_:
            assert np.array_equal(pg, pos_c) and np.array_equal(sg, slots_c)
        else:
            assert_same_sets(pg, pos_c)


def test_page_table_transform_graph_replay_and_compile():
    from reference import page_table_slots
    B, N, k, P = 4, 65536, 256, 64
    x = gpu(rows("normal", B, N, seed=5))
    bt = gpu(np.stack([np.random.default_rng(b).permutation(N // P) for b in range(B)]).astype(np.int32))
    out = torch.empty(B, k, dtype=torch.int32, device="cuda")
    pos = torch.empty(B, k, dtype=torch.int32, device="cuda")
    gvr.topk_decode(x, k, block_table=bt, page_size=P, out=out, out_positions=pos)
    want_pos, want = pos.clone(), out.clone()
    assert np.array_equal(want.cpu().numpy(), page_table_slots(want_pos.cpu().numpy(), bt.cpu().numpy(), P))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        gvr.topk_decode(x, k, block_table=bt, page_size=P, out=out, out_positions=pos)
        with torch.cuda.graph(g, stream=s):
            gvr.topk_decode(x, k, block_table=bt, page_size=P, out=out, out_positions=pos)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(-5)
    pos.fill_(-5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(pos, want_pos)

    @torch.compile(fullgraph=True)
    def f(scores, table):
        return gvr.topk_decode(scores, k, block_table=table, page_size=P, sorted=True)
    got = f(x, bt)
    ref = gvr.topk_decode(x, k, block_table=bt, page_size=P, sorted=True)
    assert torch.equal(got, ref)


def equal_runs(rng, B, N, run):
    """rows made of runs of `run` equal values: warps whose 32 lanes all hold one key and warps that
    straddle two runs (the kernels' histogram adds take one atomic per warp for the former)"""
    vals = rng.standard_normal((B, -(-N // run))).astype(np.float32)
    vals[:, ::7] = -np.inf
    vals[:, 3::11] = np.nan
    return np.repeat(vals, run, axis=1)[:, :N].copy()


@pytest.mark.parametrize("B,N", ((1, 4096), (64, 4096), (1, 32768), (1, 131072), (64, 131072)))
def test_runs_of_equal_keys(B, N):
    # constant, all -inf, masked and NaN rows and runs of equal values, in every geometry: register-held
    # clusters (B=1), the streamed kernel (B=64 at 128K) and the radix path (4096), with and without
    # the previous Top-K, against the C path (ties to the lower index, NaN last)
    rng = np.random.default_rng(N + B)
    masked = np.full((B, N), -np.inf, np.float32)
    for b in range(B):
        masked[b, rng.permutation(N)[:1024]] = rng.standard_normal(1024)
    cases = {
        "constant": np.full((B, N), 0.25, np.float32),
        "all -inf": np.full((B, N), -np.inf, np.float32),
        "masked": masked,
        "nan": np.where(np.isinf(masked), np.float32(np.nan), masked),
        "runs of 32": equal_runs(rng, B, N, 32),
        "runs of 48": equal_runs(rng, B, N, 48),
    }
    # the k-th a NaN behind 1024 numbers and 512 -inf; numbers everywhere but where the strided sample
    # looks (it sees only -inf and expects fewer than k numbers)
    mixed = np.where(np.isinf(masked), np.float32(np.nan), masked)
    for b in range(B):
        mixed[b, rng.permutation(np.flatnonzero(np.isnan(mixed[b])))[:512]] = -np.inf
    hidden = rng.standard_normal((B, N)).astype(np.float32)
    hidden[:, (np.arange(256) * N) // 256] = -np.inf
    cases["nan, -inf and numbers"] = mixed
    cases["numbers hidden from the sample"] = hidden
    methods = METHODS if N <= 4096 else ("auto", "gvr")
    for name, x in cases.items():
        xg = gpu(x)
        for k in (1, 64, 2048):
            want = cpu_result(x, k)
            for prev in (None, gpu(want)):
                for m in methods:
                    got = gvr.topk_decode(xg, k, prev_topk=prev, method=m)
                    assert_same_sets(got.cpu().numpy(), want, f"{name} B={B} N={N} k={k} {m} prev={prev is not None}")


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
def test_masked_rows_ragged_and_half(dtype):
    # rows that are -inf (or NaN) but for a few numbers, ragged lengths, rows starting 12 bytes past an
    # alignment boundary (a strided view), in the three score types, streamed (B=64 at 128K) and
    # register-held (B=1); the reference is the C path on the same values in float32 (exact conversions)
    N = 131072
    for B in (1, 64):
        rng = np.random.default_rng(B)
        x = np.full((B, N + 3), -np.inf, np.float32)
        for b in range(B):
            x[b, rng.permutation(N + 3)[:700]] = np.round(rng.standard_normal(700), 1)
        x[1::2, ::3] = np.where(np.isinf(x[1::2, ::3]), np.float32(np.nan), x[1::2, ::3])
        full = torch.from_numpy(x).to(getattr(torch, dtype))
        ref = np.ascontiguousarray(full.float().numpy()[:, 3:])
        xg = full.cuda()[:, 3:]
        lengths = data.ragged_lengths(B, N, seed=5).astype(np.int32)
        for k in (64, 2048, 5000):
            want = cpu_result(ref, k, lengths=lengths)
            got = gvr.topk_decode(xg, k, lengths=gpu(lengths))
            assert_same_sets(got.cpu().numpy(), want, f"{dtype} B={B} k={k}")


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
def test_streamed_rows_at_every_16_byte_phase(dtype):
    # The streamed kernel's first pass reads the row's chunks (8192 positions) from a shared-memory
    # ring that each thread fills with asynchronous copies of its vectors wholly inside the row (16
    # bytes of float32, 8 of a half type), the row's ends directly: rows that start at every phase of
    # a 16-byte boundary (an odd stride), lengths that end anywhere in a chunk (just past and before
    # chunk and vector boundaries, short rows without a search, empty rows), the largest scores at
    # both ends of each row, ties; the reference is the C path on the
    # same values in float32 (exact conversions)
    B, N = 64, 131072 + 37
    W = N + 6  # odd: rows at every phase
    rng = np.random.default_rng(17)
    flat = rng.standard_normal(B * W + 8).astype(np.float32)
    flat[::7] = np.round(flat[::7], 1)
    lengths = data.ragged_lengths(B, N, seed=8).astype(np.int32)
    lengths[:18] = (N, N - 1, 4096 * 16, 4096 * 16 + 1, 4096 * 16 - 1, 4096 * 17 + 5, 4096 * 3 + 2, 4096 * 3 - 3,
                    65536, 65537, 65535, 65539, 300, 256, 3000, 1, 0, 4100)
    for b in range(B):
        s, n = b * W, int(lengths[b])
        flat[s : s + min(3, n)] = 50.0 + np.arange(min(3, n))
        if n > 5:
            flat[s + n - 2 : s + n] = 60.0
    check_strided_rows(flat, B, N, W, dtype, lengths, dtype)
