"""GPU tests for gvr.prr's EMA predictor and calibration (kernels/prr/ema.cu) against the C CPU path
(which test_prr_ema.py checks against NumPy): the state bit for bit (every float32 operation is
__fmul_rn / __fadd_rn / __fsub_rn, in the C path's order), the predicted selections exactly, the
calibration's hit rates bit for bit (canonical float64 sums) and so its choice, CUDA-graph capture of
predict + update, bad inputs. The fused update_predict (token counts, keep ranges) against the CPU's bit
for bit, against update then predict on CUDA and the NumPy reference of test_prr_ema.py where the
device clamps (scores narrower than a row's block count, token counts out of range), its CUDA-graph
capture and torch.compile. (The calibration time belongs to the benchmark, not to a test.)

Every test is collected; each is skipped, with the reason, where torch with a CUDA device or gvr's
CUDA library is missing (conftest.py, harness.gpu_skip_reason).
"""

import numpy as np
import pytest

from gvr import data
from gvr._prr_ema import EMAPredictor, calibrate, calibration_hit_rates
from harness import torch_or_none
from test_prr_ema import RefEMA, blocks_of

torch = torch_or_none()

pytestmark = pytest.mark.gpu
F = np.float32


def _bits(x):
    x = x.cpu().numpy() if torch is not None and isinstance(x, torch.Tensor) else np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x


def _same(a, b):
    a, b = _bits(a), _bits(b)
    return a.shape == b.shape and np.array_equal(a, b)


def _sets(x):
    x = x.cpu().numpy() if isinstance(x, torch.Tensor) else x
    return np.sort(x, axis=-1)


@pytest.mark.parametrize("N", [37, 2048, 9000])
@pytest.mark.parametrize("params", [(0.5, 0.5, 0.5), (1 / 6, 5 / 6, 1.0), (0.9, 0.3, 0.0)])
def test_state_and_predictions_equal_the_cpu(N, params):
    rng = np.random.default_rng(N)
    max_batch, H, k = 3, 4, 16
    gpu = EMAPredictor(max_batch, H, N, alpha=params[0], beta=params[1], phi=params[2], device="cuda")
    cpu = EMAPredictor(max_batch, H, N, alpha=params[0], beta=params[1], phi=params[2])
    nb = np.array([0, N // 3, N - 5 if N > 5 else N], np.int32)[:2]  # B = 2 < max_batch
    for step in range(12):
        nbt = torch.from_numpy(nb).cuda()
        g = gpu.predict(k, nbt)
        c = cpu.predict(k, nb)
        assert g.is_cuda and g.dtype == torch.int32 and g.shape == (2, H, k)
        assert np.array_equal(_sets(g), _sets(c)), step
        gp, gl = gpu.predicted_scores(nbt)
        cp, cl = cpu.predicted_scores(nb)
        assert _same(gp, cp) and _same(gl, cl)
        s = (rng.standard_normal((2, H, N)) * 2).astype(F)
        s[rng.random(s.shape) < 0.03] = -np.inf
        s[rng.random(s.shape) < 0.01] = np.nan
        gpu.update(torch.from_numpy(s).cuda(), nbt)
        cpu.update(s, nb)
        torch.cuda.synchronize()
        assert _same(gpu.level[:2], cpu.level[:2]) and _same(gpu.trend[:2], cpu.trend[:2])
        assert _same(gpu.known[:2], cpu.known[:2])
        nb = np.minimum(nb + rng.integers(0, 4, nb.size), N).astype(np.int32)
    gpu.reset([1])
    cpu.reset([1])
    assert _same(gpu.known, cpu.known)


def test_device_nblocks_out_of_range_are_clamped():
    gpu = EMAPredictor(2, 1, 8, device="cuda")
    cpu = EMAPredictor(2, 1, 8)
    s = np.arange(16, dtype=F).reshape(2, 1, 8)
    gpu.update(torch.from_numpy(s).cuda(), torch.tensor([99, -3], dtype=torch.int32, device="cuda"))
    cpu.update(s, np.array([8, 0], np.int32))
    torch.cuda.synchronize()
    assert _same(gpu.level, cpu.level) and _same(gpu.known, cpu.known)


@pytest.mark.parametrize("case", [
    ("trace", 64, 300, 16), ("trace", 200, 2048, 64), ("trace", 50, 5000, 100), ("trace", 20, 8192, 8),
    ("integers", 40, 64, 7), ("masked", 40, 100, 9), ("k>N", 10, 6, 9), ("constant", 30, 50, 5),
    # many chunks: the window select with its adapted bins, pass 2, misses; N % 4 != 0 (scalar phase A)
    ("trace", 400, 2048, 64), ("trace", 300, 2047, 64), ("trace", 120, 8192, 300),
    ("integers", 120, 2048, 64),  # ties beyond the window's pass 2: warp_select, the back-off
    ("specials", 80, 1000, 50),   # +inf (NaN states), -0.0, -inf, NaN: phase A's exact path
    ("huge", 60, 256, 30),        # overflow to inf in the state
])
def test_calibration_equals_the_cpu(case):
    kind, T, N, k = case
    rng = np.random.default_rng(T + N)
    if kind in ("trace", "k>N"):
        x = data.block_score_trace(T, N, seed=T)
    elif kind == "integers":
        x = rng.integers(0, 4, (T, N)).astype(F)
    elif kind == "masked":
        x = rng.standard_normal((T, N)).astype(F)
        x[rng.random(x.shape) < 0.3] = -np.inf
        x[2, :5] = np.nan
        x[4] = -np.inf
    elif kind == "specials":
        x = rng.standard_normal((T, N)).astype(F)
        for v, frac in ((np.inf, 0.03), (-0.0, 0.05), (0.0, 0.05), (-np.inf, 0.05), (np.nan, 0.02)):
            x[rng.random(x.shape) < frac] = v
    elif kind == "huge":
        x = (rng.standard_normal((T, N)) * 3e38).astype(F)
    else:
        x = rng.standard_normal((T, N)).astype(F)
        x[::3] = 1.5
    pts_c, hc = calibration_hit_rates(x, k)
    pts_g, hg = calibration_hit_rates(torch.from_numpy(x).cuda(), k)
    assert pts_c == pts_g
    assert np.array_equal(hc.view(np.uint64), hg.view(np.uint64)), np.flatnonzero(hc != hg)[:10]
    assert calibrate(torch.from_numpy(x).cuda(), k) == calibrate(x, k)


def test_calibration_misaligned_rows():
    # N % 4 == 0 but the rows not 16-byte aligned: the scalar phase A of the E = 4 kernel
    x = data.block_score_trace(150, 2048, seed=11)
    big = torch.zeros(150, 2049, device="cuda")
    big[:, 1:] = torch.from_numpy(x).cuda()
    hg = calibration_hit_rates(big[:, 1:], 64)[1]
    assert np.array_equal(hg.view(np.uint64), calibration_hit_rates(x, 64)[1].view(np.uint64))


def test_calibration_strided_rows_and_repeatability():
    x = data.block_score_trace(64, 512, seed=9)
    big = torch.zeros(64, 600, device="cuda")
    big[:, 7:519] = torch.from_numpy(x).cuda()
    view = big[:, 7:519]
    a = calibration_hit_rates(view, 32)[1]
    b = calibration_hit_rates(view, 32)[1]
    assert np.array_equal(a, b) and np.array_equal(a, calibration_hit_rates(x, 32)[1])


def _hits_equal(x, k, grid=None):
    hc = calibration_hit_rates(x if isinstance(x, np.ndarray) else x.cpu().numpy(), k, grid=grid)[1]
    xg = x if isinstance(x, torch.Tensor) else torch.from_numpy(x).cuda()
    hg = calibration_hit_rates(xg, k, grid=grid)[1]
    assert np.array_equal(hc.view(np.uint64), hg.view(np.uint64)), np.flatnonzero(hc != hg)[:10]


@pytest.mark.parametrize("T,N,k", [
    (2, 2048, 64), (3, 2048, 64), (5, 64, 8),  # one or a few steps
    (11, 2048, 64),                             # one chunk of fewer steps than S
    (16 * 5 + 6, 1024, 32),                     # a last partial chunk; E = 2
    (90, 1500, 40),                             # N % 4 != 0 (the scalar loads)
    (60, 4096, 64),                             # E = 8, fewer steps per chunk (shared memory)
])
def test_calibration_shapes(T, N, k):
    # short trajectories, partial chunks, blocks per thread 1-8
    _hits_equal(data.block_score_trace(T, N, seed=T + N), k)


@pytest.mark.parametrize("grid", [
    ((0.5,), (0.5,), (0.0,)),                    # G = 1
    ((0.2, 0.5, 0.8), (0.5,), (1.0,)),           # G = 3
    ((0.1, 0.3, 0.5, 0.7, 0.9), (0.2, 0.6), (0.0, 0.5, 1.0)),  # G = 30
    ((0.1, 0.3, 0.5, 0.7, 0.9), (0.2, 0.4, 0.6, 0.8), (0.0, 0.25, 0.5, 0.75, 1.0, 0.9, 0.1)),  # G = 140
])
def test_calibration_grid_sizes(grid):
    # grid sizes below and above the number of SMs (one CTA per grid point, several per CTA past it)
    _hits_equal(data.block_score_trace(70, 2048, seed=3), 64, grid=grid)


def test_calibration_strided_aligned_rows():
    # a row stride beyond N, 16-byte aligned (the 16-byte loads): only the view's elements are read
    x = data.block_score_trace(100, 2048, seed=5)
    big = torch.zeros(100, 2056, device="cuda")
    big[:, :2048] = torch.from_numpy(x).cuda()
    big[:, 2048:] = float("nan")  # outside the view: must never be read
    _hits_equal(big[:, :2048], 64)


def test_cuda_graph_capture_of_predict_and_update_replays_the_eager_steps():
    rng = np.random.default_rng(3)
    B, H, N, k = 2, 4, 300, 12
    steps = [torch.from_numpy((rng.standard_normal((B, H, N))).astype(F)).cuda() for _ in range(6)]
    nbs = [torch.tensor([100 + 10 * t, 50 + 20 * t], dtype=torch.int32, device="cuda") for t in range(6)]
    eager = EMAPredictor(B, H, N, alpha=0.4, beta=0.3, phi=0.75, device="cuda")
    want = []
    for s, nb in zip(steps, nbs):
        want.append(eager.predict(k, nb).clone())
        eager.update(s, nb)

    pr = EMAPredictor(B, H, N, alpha=0.4, beta=0.3, phi=0.75, device="cuda")
    s_buf, nb_buf = torch.zeros_like(steps[0]), torch.zeros_like(nbs[0])
    out = torch.empty(B, H, k, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (loads the library, the Top-K kernels' attributes)
        pr.predict(k, nb_buf, out=out)
        pr.update(s_buf, nb_buf)
    torch.cuda.current_stream().wait_stream(side)
    pr.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pr.predict(k, nb_buf, out=out)
        pr.update(s_buf, nb_buf)
    pr.reset()  # the capture ran nothing; start from an empty state
    addrs = (pr.level.data_ptr(), pr.trend.data_ptr(), pr.known.data_ptr())
    for t, (s, nb) in enumerate(zip(steps, nbs)):
        s_buf.copy_(s)
        nb_buf.copy_(nb)
        g.replay()
        torch.cuda.synchronize()
        assert np.array_equal(_sets(out), _sets(want[t])), t
    assert addrs == (pr.level.data_ptr(), pr.trend.data_ptr(), pr.known.data_ptr())
    assert _same(pr.level, eager.level) and _same(pr.trend, eager.trend)


def test_torch_compile_of_a_decode_step():
    pr = EMAPredictor(1, 2, 64, device="cuda")
    ref = EMAPredictor(1, 2, 64, device="cuda")
    nb = torch.tensor([64], dtype=torch.int32, device="cuda")
    out = torch.empty(1, 2, 8, dtype=torch.int32, device="cuda")

    def step(s):
        pr.predict(8, nb, out=out)
        pr.update(s, nb)
        return out

    f = torch.compile(step, fullgraph=True, backend="eager")
    for i in range(3):
        s = torch.randn(1, 2, 64, device="cuda")
        got = f(s).clone()
        want = ref.predict(8, nb)
        ref.update(s, nb)
        assert np.array_equal(_sets(got), _sets(want)), i
    assert _same(pr.level, ref.level)


# --------------------------------------------------------------------------------------------------
# update_predict (one kernel), token counts, keep ranges
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [37, 2048, 9000])
@pytest.mark.parametrize("G, keep", [(1, (0, 0)), (16, (1, 2)), (5, (40, 3))])
def test_update_predict_equals_the_cpu(N, G, keep):
    rng = np.random.default_rng(N + G)
    max_batch, H, k = 4, 4, 16
    kf, kl = keep
    gpu = EMAPredictor(max_batch, H, N, alpha=0.3, beta=0.6, phi=0.75, device="cuda")
    cpu = EMAPredictor(max_batch, H, N, alpha=0.3, beta=0.6, phi=0.75)
    B = 3  # < max_batch
    tokens = np.array([0, (N // 3) * G + 1, N * G - G // 2], np.int32)
    out_g = torch.full((B, H, k), 7, dtype=torch.int32, device="cuda")
    out_c = np.full((B, H, k), 7, np.int32)
    for step in range(10):
        s = (rng.standard_normal((B, H, N)) * 2).astype(F)
        s[rng.random(s.shape) < 0.03] = -np.inf
        s[rng.random(s.shape) < 0.01] = np.nan
        tg = torch.from_numpy(tokens).cuda()
        g = gpu.update_predict(torch.from_numpy(s).cuda(), tg, k, out_g, block_size=G, keep_first=kf, keep_last=kl)
        c = cpu.update_predict(s, tokens, k, out_c, block_size=G, keep_first=kf, keep_last=kl)
        torch.cuda.synchronize()
        assert g is out_g and c is out_c
        assert np.array_equal(_sets(g), _sets(c)), step
        assert _same(gpu._pred[:B], cpu._pred[:B]) and _same(gpu._row_len[:B], cpu._row_len[:B]), step
        assert _same(gpu.level[:B], cpu.level[:B]) and _same(gpu.trend[:B], cpu.trend[:B])
        assert _same(gpu.known[:B], cpu.known[:B])
        # the predict kernel with the same keywords gives the fused kernel's scores
        gp, gl = gpu.predicted_scores(tg, block_size=G, keep_first=kf, keep_last=kl)
        torch.cuda.synchronize()
        assert _same(gp, cpu._pred[:B]) and _same(gl, cpu._row_len[:B]), step
        tokens = np.minimum(tokens + rng.integers(0, 3 * G, B), N * G).astype(np.int32)


@pytest.mark.parametrize("G, keep", [(1, (0, 0)), (4, (1, 2)), (3, (5, 5))])
def test_update_predict_equals_update_then_predict_where_the_device_clamps(G, keep):
    # scores narrower than a row's block count (Ns < nb: the blocks beyond Ns stay new, +inf), token
    # counts below 0 and beyond max_blocks * G (clamped on the device, rejected on the CPU)
    rng = np.random.default_rng(G)
    B, H, N, k = 4, 3, 64, 10
    kf, kl = keep
    fused = EMAPredictor(B, H, N, alpha=0.45, beta=0.35, phi=0.9, device="cuda")
    split = EMAPredictor(B, H, N, alpha=0.45, beta=0.35, phi=0.9, device="cuda")
    ref = RefEMA(B, H, N, 0.45, 0.35, 0.9)
    tokens = np.array([-5, 0, 7, 40 * G + 1], np.int32)
    out = torch.empty(B, H, k, dtype=torch.int32, device="cuda")
    for step in range(12):
        Ns = 20 + 3 * step
        s = (rng.standard_normal((B, H, Ns)) * 2).astype(F)
        s[rng.random(s.shape) < 0.05] = -np.inf
        s[rng.random(s.shape) < 0.03] = np.nan
        sg, tg = torch.from_numpy(s).cuda(), torch.from_numpy(tokens).cuda()
        got = fused.update_predict(sg, tg, k, out, block_size=G, keep_first=kf, keep_last=kl)
        split.update(sg, tg, block_size=G)
        want = split.predict(k, tg, block_size=G, keep_first=kf, keep_last=kl)
        torch.cuda.synchronize()
        assert torch.equal(got, want), step  # the same scores: the same Top-K, in the same order
        for a, b in ((fused.level, split.level), (fused.trend, split.trend), (fused.known, split.known),
                     (fused._pred, split._pred), (fused._row_len, split._row_len)):
            assert _same(a, b), step
        nb = blocks_of(tokens, G, N)
        ref.update(s, nb)
        assert _same(fused.level, ref.L) and _same(fused.trend, ref.T) and _same(fused.known, ref.known), step
        assert _same(fused._pred, ref.scores(nb, kf, kl)), step
        tokens = (tokens + rng.integers(0, 6 * G, B)).astype(np.int32)
        tokens[0] = -5 if step % 2 else 0
        tokens[3] = max(tokens[3], N * G + 10)  # beyond max_blocks: clamped to N


def test_cuda_graph_capture_of_update_predict_replays_the_eager_steps():
    rng = np.random.default_rng(5)
    B, H, N, k, G = 2, 4, 300, 12, 16
    kw = dict(block_size=G, keep_first=1, keep_last=2)
    steps = [torch.from_numpy((rng.standard_normal((B, H, N))).astype(F)).cuda() for _ in range(6)]
    lens = [torch.tensor([1600 + 170 * t, 800 + 330 * t], dtype=torch.int32, device="cuda") for t in range(6)]
    eager = EMAPredictor(B, H, N, alpha=0.4, beta=0.3, phi=0.75, device="cuda")
    want = []
    for s, ln in zip(steps, lens):
        want.append(eager.update_predict(s, ln, k, torch.empty(B, H, k, dtype=torch.int32, device="cuda"), **kw))

    pr = EMAPredictor(B, H, N, alpha=0.4, beta=0.3, phi=0.75, device="cuda")
    s_buf, ln_buf = torch.zeros_like(steps[0]), torch.zeros_like(lens[0])
    out = torch.empty(B, H, k, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (loads the library, the Top-K kernels' attributes)
        pr.update_predict(s_buf, ln_buf, k, out, **kw)
    torch.cuda.current_stream().wait_stream(side)
    pr.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pr.update_predict(s_buf, ln_buf, k, out, **kw)
    pr.reset()  # the capture ran nothing; start from an empty state
    addrs = (pr.level.data_ptr(), pr.trend.data_ptr(), pr.known.data_ptr(), pr._pred.data_ptr(), out.data_ptr())
    for t, (s, ln) in enumerate(zip(steps, lens)):
        s_buf.copy_(s)
        ln_buf.copy_(ln)
        g.replay()
        torch.cuda.synchronize()
        assert np.array_equal(_sets(out), _sets(want[t])), t
    assert addrs == (pr.level.data_ptr(), pr.trend.data_ptr(), pr.known.data_ptr(), pr._pred.data_ptr(),
                     out.data_ptr())
    assert _same(pr.level, eager.level) and _same(pr.trend, eager.trend) and _same(pr.known, eager.known)
    assert _same(pr._pred, eager._pred) and _same(pr._row_len, eager._row_len)


def test_torch_compile_of_update_predict():
    pr = EMAPredictor(1, 2, 64, device="cuda")
    ref = EMAPredictor(1, 2, 64, device="cuda")
    ln = torch.tensor([1000], dtype=torch.int32, device="cuda")  # 63 blocks of 16 tokens
    out = torch.empty(1, 2, 8, dtype=torch.int32, device="cuda")
    kw = dict(block_size=16, keep_first=1, keep_last=1)

    def step(s):
        pr.update_predict(s, ln, 8, out, **kw)
        return out

    f = torch.compile(step, fullgraph=True, backend="eager")
    for i in range(3):
        s = torch.randn(1, 2, 64, device="cuda")
        got = f(s).clone()
        want = ref.update_predict(s, ln, 8, torch.empty_like(out), **kw)
        assert np.array_equal(_sets(got), _sets(want)), i
    assert _same(pr.level, ref.level) and _same(pr._pred, ref._pred)


def test_bad_update_predict_inputs_on_cuda_change_nothing():
    pr = EMAPredictor(2, 2, 8, device="cuda")
    nb = torch.tensor([8, 4], dtype=torch.int32, device="cuda")
    s = torch.ones(2, 2, 8, device="cuda")
    out = torch.zeros(2, 2, 3, dtype=torch.int32, device="cuda")
    pr.update_predict(s, nb, 3, out)
    torch.cuda.synchronize()
    before = [a.clone() for a in (pr.level, pr.trend, pr.known, pr._pred, pr._row_len, out)]
    for args, exc, name in [
        ((s, nb, 3, torch.zeros(2, 2, 3, dtype=torch.int32)), ValueError, "out"),  # a CPU out
        ((s, nb, 3, np.zeros((2, 2, 3), np.int32)), ValueError, "out"),
        ((s, nb, 3, torch.zeros(2, 2, 3, dtype=torch.int64, device="cuda")), TypeError, "out"),
        ((s.cpu(), nb, 3, out), ValueError, "scores"),  # CPU scores for CUDA state
        ((s, nb.cpu(), 3, out), ValueError, "nblocks"),
    ]:
        with pytest.raises(exc, match=name):
            pr.update_predict(*args)
    torch.cuda.synchronize()
    after = (pr.level, pr.trend, pr.known, pr._pred, pr._row_len, out)
    assert all(_same(a, b) for a, b in zip(before, after))


def test_bad_inputs_on_cuda():
    pr = EMAPredictor(2, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, np.array([8, 8], np.int32))  # host nblocks on a CUDA predictor
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, torch.tensor([8, 8], dtype=torch.int32))
    nb = torch.tensor([8, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="scores"):
        pr.update(torch.zeros(2, 2, 8), nb)  # CPU scores for CUDA state
    with pytest.raises(ValueError, match="prefill_scores"):
        calibrate(torch.zeros(4, 9000, device="cuda"), 4)
    with pytest.raises(TypeError, match="prefill_scores"):
        calibrate(torch.zeros(4, 10, device="cuda", dtype=torch.float16), 4)
