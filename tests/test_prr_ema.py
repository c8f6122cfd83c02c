"""gvr.prr's EMA predictor and calibration on the CPU (gvr/_prr_ema.py, csrc/prr_ema.c,
csrc/cpu/prr_ema_cpu.c): update / predict bit-exact against a NumPy float32 implementation of the same
expressions, new blocks, reset, -inf / NaN scores, the predicted Top-K against the reference order
(ties to the lower index), calibration against a brute-force NumPy search (the same canonical sums:
bit-exact hit rates), EMA vs last-step reuse on gvr.data.block_score_trace, NumPy and torch CPU, the
torch.library ops, bad inputs named. Token counts (block_size > 1) against the block counts NumPy
derives, the forced keep ranges against NumPy, update_predict against update then predict bit for bit."""
import numpy as np
import pytest

import gvr
from gvr import data
from gvr._prr_ema import DEFAULT_GRID, EMAPredictor, calibrate, calibration_hit_rates
from reference import topk_reference

F = np.float32
NEG_INF, POS_INF = F(-np.inf), F(np.inf)


# --------------------------------------------------------------------------------------------------
# the NumPy reference: the same float32 expressions, one rounding per operation
# --------------------------------------------------------------------------------------------------
class RefEMA:
    def __init__(self, max_batch, H, N, alpha, beta, phi):
        self.L = np.zeros((max_batch, H, N), F)
        self.T = np.zeros((max_batch, H, N), F)
        self.known = np.zeros((max_batch, H), np.int32)
        self.a, self.b, self.p = F(alpha), F(beta), F(phi)
        self.N = N

    def scores(self, nblocks, keep_first=0, keep_last=0):
        B, H, N = len(nblocks), self.L.shape[1], self.N
        pred = np.full((B, H, N), NEG_INF, F)
        j = np.arange(N)
        for b in range(B):
            nb = int(nblocks[b])
            forced = (j < nb) & ((j < keep_first) | (j >= nb - keep_last))
            for h in range(H):
                kn = min(int(self.known[b, h]), nb)
                t = self.p * self.T[b, h, :kn]
                pred[b, h, :kn] = self.L[b, h, :kn] + t
                pred[b, h, kn:nb] = POS_INF
                pred[b, h, forced] = POS_INF
        return pred

    def predict(self, k, nblocks, keep_first=0, keep_last=0):
        pred = self.scores(nblocks, keep_first, keep_last)
        B, H = pred.shape[:2]
        out = np.full((B, H, k), -1, np.int32)
        for b in range(B):
            for h in range(H):
                r = topk_reference(pred[b, h], k, int(nblocks[b]))
                out[b, h, : r.size] = r
        return out

    def update(self, s, nblocks):
        a, bt, p = self.a, self.b, self.p
        om, ob = F(1) - a, F(1) - bt
        with np.errstate(invalid="ignore", over="ignore"):
            for b in range(len(nblocks)):
                nu = min(int(nblocks[b]), s.shape[2])
                for h in range(self.L.shape[1]):
                    kn = min(int(self.known[b, h]), nu)
                    L, T, x = self.L[b, h, :kn], self.T[b, h, :kn], s[b, h, :kn].astype(F)
                    obs = x > NEG_INF
                    fresh = obs & (L == NEG_INF)
                    t = p * T
                    f = L + t
                    Ln = a * x + om * f
                    Tn = bt * (Ln - L) + ob * t
                    upd = obs & ~fresh
                    newL = np.where(upd, Ln, np.where(fresh, x, L))
                    newT = np.where(upd, Tn, np.where(fresh, F(0), T))
                    self.L[b, h, :kn], self.T[b, h, :kn] = newL, newT
                    xn = s[b, h, kn:nu].astype(F)
                    self.L[b, h, kn:nu] = np.where(xn > NEG_INF, xn, NEG_INF)
                    self.T[b, h, kn:nu] = 0
                    self.known[b, h] = nu


def blocks_of(tokens, G, N):
    """the block counts of token counts: ceil(tokens / G), negative counts 0, clamped to N"""
    t = np.asarray(tokens, np.int64)
    return np.clip(np.where(t > 0, (t + G - 1) // G, 0), 0, N).astype(np.int32)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_state(pr, ref, B):
    assert same_bits(pr.level[:B], ref.L[:B]), np.argwhere(pr.level[:B].view(np.uint32) != ref.L[:B].view(np.uint32))[:5]
    assert same_bits(pr.trend[:B], ref.T[:B])
    assert np.array_equal(pr.known[:B], ref.known[:B])


def assert_same_sets(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert np.array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))


# --------------------------------------------------------------------------------------------------
# update / predict
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [(0.5, 0.5, 0.5), (1 / 6, 5 / 6, 1.0), (0.9, 0.1, 0.0), (0.3, 0.7, 0.25)])
def test_update_and_predict_bit_exact_with_growing_sequences(params):
    rng = np.random.default_rng(7)
    max_batch, H, N, k = 4, 3, 40, 6
    pr = EMAPredictor(max_batch, H, N, alpha=params[0], beta=params[1], phi=params[2])
    ref = RefEMA(max_batch, H, N, *params)
    nb = np.array([0, 5, 12], np.int32)  # B = 3 < max_batch
    for step in range(25):
        got = pr.predict(k, nb)
        want = ref.predict(k, nb)
        assert got.dtype == np.int32 and got.shape == (3, H, k)
        assert_same_sets(got, want)
        pred, row_len = pr.predicted_scores(nb)
        assert same_bits(pred[:, :, :N], ref.scores(nb))
        assert np.array_equal(row_len, np.broadcast_to(nb[:, None], (3, H)))
        s = (rng.standard_normal((3, H, N)) * 3).astype(F)
        s[rng.random(s.shape) < 0.05] = NEG_INF
        s[rng.random(s.shape) < 0.02] = np.nan
        pr.update(s, nb)
        ref.update(s, nb)
        assert_state(pr, ref, 3)
        nb = np.minimum(nb + rng.integers(0, 3, 3).astype(np.int32), N).astype(np.int32)


def test_new_blocks_predicted_first_then_start_at_their_score():
    pr = EMAPredictor(1, 2, 10, alpha=0.5, beta=0.5, phi=0.5)
    nb = np.array([3], np.int32)
    pr.update(np.array([[[1, 2, 3] + [0] * 7, [3, 2, 1] + [0] * 7]], F), nb)
    assert np.array_equal(pr.level[0, :, :3], [[1, 2, 3], [3, 2, 1]])
    assert not pr.trend[0, :, :3].any()
    nb2 = np.array([5], np.int32)
    pred, row_len = pr.predicted_scores(nb2)
    assert np.array_equal(pred[0, 0, :5], [1, 2, 3, np.inf, np.inf]) and np.all(pred[0, :, 5:] == -np.inf)
    assert np.array_equal(pr.predict(2, nb2)[0], [[3, 4], [3, 4]])  # the two new blocks
    assert np.array_equal(np.sort(pr.predict(3, nb2)[0], axis=-1), [[2, 3, 4], [0, 3, 4]])
    # more blocks wanted than exist: -1 padding
    got = pr.predict(7, nb2)[0, 1]
    assert np.array_equal(np.sort(got[:5]), [0, 1, 2, 3, 4]) and np.array_equal(got[5:], [-1, -1])
    pr.update(np.full((1, 2, 10), 10, F), nb2)
    assert np.array_equal(pr.level[0, 0, 3:5], [10, 10]) and np.array_equal(pr.known, [[5, 5]])
    # the EMA expressions for the old blocks (exact in float32 here)
    assert pr.level[0, 0, 0] == F(0.5) * 10 + F(0.5) * 1 and pr.trend[0, 0, 0] == F(0.5) * (F(5.5) - 1)


def test_predict_topk_ties_to_the_lower_index():
    # integer scores with many ties; new blocks start at L = s, T = 0, so pred = s exactly
    rng = np.random.default_rng(3)
    B, H, N = 3, 2, 50
    pr = EMAPredictor(B, H, N, phi=1.0)
    s = rng.integers(0, 4, (B, H, N)).astype(F)
    nb = np.array([50, 17, 3], np.int32)
    pr.update(s, nb)
    for k in (0, 1, 5, 16, 17, 20, 50):
        got = pr.predict(k, nb)
        for b in range(B):
            for h in range(H):
                want = topk_reference(s[b, h], k, int(nb[b]))
                assert np.array_equal(np.sort(got[b, h, : want.size]), np.sort(want)), (k, b, h)
                assert np.all(got[b, h, want.size:] == -1)


def test_unobserved_scores_leave_no_trace():
    pr = EMAPredictor(1, 1, 4, alpha=0.5, beta=0.5, phi=1.0)
    nb = np.array([4], np.int32)
    pr.update(np.array([[[1, 2, -np.inf, np.nan]]], F), nb)
    assert np.array_equal(pr.level[0, 0], [1, 2, -np.inf, -np.inf])
    pred, _ = pr.predicted_scores(nb)
    assert np.array_equal(pred[0, 0], [1, 2, -np.inf, -np.inf])  # never observed: ranked last
    before = (pr.level.copy(), pr.trend.copy())
    pr.update(np.array([[[-np.inf, np.nan, -np.inf, np.nan]]], F), nb)
    assert same_bits(pr.level, before[0]) and same_bits(pr.trend, before[1])
    pr.update(np.array([[[3, 4, 5, 6]]], F), nb)  # first observation: starts as a new block
    assert np.array_equal(pr.level[0, 0, 2:], [5, 6]) and np.array_equal(pr.trend[0, 0, 2:], [0, 0])
    assert pr.level[0, 0, 0] == 2.0 and pr.trend[0, 0, 0] == 0.5


def test_reset_rows_and_shrinking_sequences():
    rng = np.random.default_rng(1)
    pr = EMAPredictor(4, 2, 8, alpha=0.4, beta=0.3, phi=0.5)
    ref = RefEMA(4, 2, 8, 0.4, 0.3, 0.5)
    nb = np.array([8, 6, 4, 2], np.int32)
    for _ in range(3):
        s = rng.standard_normal((4, 2, 8)).astype(F)
        pr.update(s, nb)
        ref.update(s, nb)
    pr.reset([1, 3])
    ref.known[[1, 3]] = 0
    assert np.array_equal(pr.known, [[8, 8], [0, 0], [4, 4], [0, 0]])
    pr.reset(np.array([2]))
    ref.known[2] = 0
    nb = np.array([8, 3, 2, 2], np.int32)  # row 0 shrinks nothing, row 1 starts over
    assert_same_sets(pr.predict(4, nb), ref.predict(4, nb))
    s = rng.standard_normal((4, 2, 8)).astype(F)
    pr.update(s, nb)
    ref.update(s, nb)
    assert_state(pr, ref, 4)
    nb_small = np.array([5, 3, 2, 2], np.int32)  # row 0 shrinks: blocks 5.. forgotten
    s = rng.standard_normal((4, 2, 8)).astype(F)
    pr.update(s, nb_small)
    ref.update(s, nb_small)
    assert_state(pr, ref, 4)
    pr.reset()
    assert not pr.known.any()


def test_scores_narrower_than_the_state_and_strided_views():
    rng = np.random.default_rng(5)
    pr = EMAPredictor(2, 2, 16)
    ref = RefEMA(2, 2, 16, 0.5, 0.5, 0.5)
    nb = np.array([9, 4], np.int32)
    big = rng.standard_normal((2, 4, 20)).astype(F)
    s = big[:, ::2, 3:12]  # non-contiguous heads, width 9
    pr.update(s, nb)
    ref.update(np.ascontiguousarray(s), nb)
    assert_state(pr, ref, 2)


def test_torch_cpu_inputs_and_outputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    a = EMAPredictor(2, 2, 12, alpha=0.3, beta=0.6, phi=0.75)
    b = EMAPredictor(2, 2, 12, alpha=0.3, beta=0.6, phi=0.75)
    nb = np.array([12, 7], np.int32)
    for _ in range(4):
        s = rng.standard_normal((2, 2, 12)).astype(F)
        pa = a.predict(5, nb)
        pb = b.predict(5, torch.from_numpy(nb))
        assert isinstance(pb, torch.Tensor) and pb.dtype == torch.int32
        assert np.array_equal(pa, pb.numpy())
        a.update(s, nb)
        b.update(torch.from_numpy(s), torch.from_numpy(nb))
    assert same_bits(a.level, b.level) and same_bits(a.trend, b.trend)
    out = torch.full((2, 2, 5), 7, dtype=torch.int32)
    assert b.predict(5, torch.from_numpy(nb), out=out) is out
    assert np.array_equal(out.numpy(), a.predict(5, nb))


def test_out_is_written_in_place():
    pr = EMAPredictor(2, 3, 10)
    nb = np.array([10, 10], np.int32)
    pr.update(np.arange(60, dtype=F).reshape(2, 3, 10), nb)
    out = np.full((2, 3, 4), 9, np.int32)
    assert pr.predict(4, nb, out=out) is out
    assert np.array_equal(np.sort(out, axis=-1), np.broadcast_to([6, 7, 8, 9], (2, 3, 4)))


def test_torch_library_ops_match_the_eager_path():
    torch = pytest.importorskip("torch")
    from gvr._interop import register_torch_ops

    register_torch_ops()
    rng = np.random.default_rng(4)
    B, H, N = 2, 2, 9
    L, T = torch.zeros(B, H, N), torch.zeros(B, H, N)
    known = torch.zeros(B, H, dtype=torch.int32)
    nb = torch.tensor([9, 5], dtype=torch.int32)
    ref = EMAPredictor(B, H, N, alpha=0.25, beta=0.75, phi=0.5)
    for _ in range(3):
        s = torch.from_numpy(rng.standard_normal((B, H, N)).astype(F))
        torch.ops.gvr.prr_ema_update(L, T, known, nb, s, 0.25, 0.75, 0.5)
        ref.update(s.numpy(), nb.numpy())
    assert same_bits(L.numpy(), ref.level) and same_bits(T.numpy(), ref.trend)
    pred, rl = torch.empty(B, H, N), torch.empty(B, H, dtype=torch.int32)
    torch.ops.gvr.prr_ema_scores(L, T, known, nb, pred, rl, 0.5)
    want, wrl = ref.predicted_scores(nb.numpy())
    assert same_bits(pred.numpy(), want) and np.array_equal(rl.numpy(), wrl)

    def step(L, T, known, nb, s, pred, rl):
        torch.ops.gvr.prr_ema_scores(L, T, known, nb, pred, rl, 0.5)
        torch.ops.gvr.prr_ema_update(L, T, known, nb, s, 0.25, 0.75, 0.5)
        return pred.sum()

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    s = torch.from_numpy(rng.standard_normal((B, H, N)).astype(F))
    compiled(L, T, known, nb, s, pred, rl)
    ref.update(s.numpy(), nb.numpy())
    assert same_bits(L.numpy(), ref.level)


# --------------------------------------------------------------------------------------------------
# token counts (block_size), the keep ranges, update_predict
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("G", [2, 3, 16])
def test_token_counts_equal_their_block_counts(G):
    rng = np.random.default_rng(G)
    B, H, N, k = 4, 2, 24, 5
    by_tokens = EMAPredictor(B, H, N, alpha=0.3, beta=0.6, phi=0.75)
    by_blocks = EMAPredictor(B, H, N, alpha=0.3, beta=0.6, phi=0.75)
    ref = RefEMA(B, H, N, 0.3, 0.6, 0.75)
    tokens = np.array([0, 1, G, 2 * G + 1], np.int32)  # empty, one token, a full block, ragged
    for step in range(8):
        nb = blocks_of(tokens, G, N)
        assert nb[0] == 0 and (step > 0 or list(nb) == [0, 1, 1, 3])
        pt, lt = by_tokens.predicted_scores(tokens, block_size=G)
        pt, lt = pt.copy(), lt.copy()
        pb, lb = by_blocks.predicted_scores(nb)
        assert same_bits(pt, pb) and np.array_equal(lt, lb)
        assert same_bits(pt, ref.scores(nb)) and np.array_equal(lt, np.broadcast_to(nb[:, None], (B, H)))
        assert np.array_equal(by_tokens.predict(k, tokens, block_size=G), by_blocks.predict(k, nb))
        s = rng.standard_normal((B, H, N)).astype(F)
        s[rng.random(s.shape) < 0.1] = NEG_INF
        by_tokens.update(s, tokens, block_size=G)
        by_blocks.update(s, nb)
        ref.update(s, nb)
        assert_state(by_tokens, ref, B)
        assert same_bits(by_tokens.level, by_blocks.level) and same_bits(by_tokens.trend, by_blocks.trend)
        grow = rng.integers(0, G + 2, B) * (np.arange(B) > 0)  # row 0 stays empty
        tokens = np.minimum(tokens + grow, N * G - rng.integers(0, G, B)).astype(np.int32)
    # block_size 1 is the block counts themselves
    nb = np.array([3, 0, 24, 7], np.int32)
    assert same_bits(by_blocks.predicted_scores(nb, block_size=1)[0].copy(), by_blocks.predicted_scores(nb)[0])


def test_token_counts_at_the_limits():
    pr = EMAPredictor(3, 1, 4)
    # ceil(16 / 4) = 4 blocks: the limit; 2^31 - 1 tokens never overflow the ceil
    pr.update(np.zeros((3, 1, 4), F), np.array([16, 13, 0], np.int32), block_size=4)
    assert np.array_equal(pr.known[:, 0], [4, 4, 0])
    big = EMAPredictor(1, 1, 4)
    big.update(np.ones((1, 1, 4), F), np.array([2**31 - 1], np.int32), block_size=2**30)
    assert np.array_equal(big.known, [[2]])
    with pytest.raises(ValueError, match="block counts"):
        pr.predict(2, np.array([17, 0, 0], np.int32), block_size=4)  # 5 blocks > max_blocks 4
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, np.array([-1, 0, 0], np.int32), block_size=4)  # a negative token count
    with pytest.raises(ValueError, match="block counts"):
        pr.update(np.zeros((3, 1, 2), F), np.array([9, 0, 0], np.int32), block_size=4)  # 3 blocks > Ns = 2
    assert np.array_equal(pr.known[:, 0], [4, 4, 0])


@pytest.mark.parametrize("keep", [(0, 0), (1, 0), (0, 1), (1, 2), (3, 3), (2, 40), (40, 0), (40, 40)])
def test_keep_ranges_are_always_predicted(keep):
    kf, kl = keep
    rng = np.random.default_rng(kf * 100 + kl)
    B, H, N = 6, 2, 12
    pr = EMAPredictor(B, H, N, alpha=0.4, beta=0.2, phi=0.5)
    ref = RefEMA(B, H, N, 0.4, 0.2, 0.5)
    # nb = 0 (nothing forced), 1, 2, 4 (ranges overlapping when kf + kl > nb), 9 with 3 new blocks, N
    s = rng.standard_normal((B, H, N)).astype(F)
    s[rng.random(s.shape) < 0.15] = NEG_INF  # blocks never observed: -inf unless forced
    old = np.array([0, 1, 2, 4, 6, 12], np.int32)
    pr.update(s, old)
    ref.update(s, old)
    nb = np.array([0, 1, 2, 4, 9, 12], np.int32)
    pred, row_len = pr.predicted_scores(nb, keep_first=kf, keep_last=kl)
    want = ref.scores(nb, kf, kl)
    assert same_bits(pred, want)
    assert np.array_equal(row_len, np.broadcast_to(nb[:, None], (B, H)))
    # the forcing itself, spelled out for one row: nb = 4
    j = np.arange(N)
    forced = (j < 4) & ((j < kf) | (j >= 4 - kl))
    assert np.all(pred[3][:, forced] == POS_INF) and np.all(pred[3][:, 4:] == NEG_INF)
    assert np.all(pred[:, :, N:] == NEG_INF) and np.all(pred[0] == NEG_INF)
    for k in (0, 1, 3, 12):
        assert_same_sets(pr.predict(k, nb, keep_first=kf, keep_last=kl), ref.predict(k, nb, kf, kl))


@pytest.mark.parametrize("G, keep, narrow", [(1, (0, 0), False), (1, (1, 2), True), (4, (1, 1), False),
                                             (5, (2, 3), True), (7, (30, 30), False)])
@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_update_predict_equals_update_then_predict(G, keep, narrow, fw):
    if fw == "torch":
        torch = pytest.importorskip("torch")
        conv = torch.from_numpy
    else:
        conv = np.asarray
    rng = np.random.default_rng(G * 10 + keep[0])
    max_batch, H, N, k = 5, 3, 30, 7
    kf, kl = keep
    fused = EMAPredictor(max_batch, H, N, alpha=0.35, beta=0.55, phi=0.8)
    split = EMAPredictor(max_batch, H, N, alpha=0.35, beta=0.55, phi=0.8)
    ref = RefEMA(max_batch, H, N, 0.35, 0.55, 0.8)
    B = 4
    tokens = np.array([0, 3, 2 * G, 5 * G - 1], np.int32)
    out = conv(np.full((B, H, k), 99, np.int32))
    for step in range(14):
        nb = blocks_of(tokens, G, N)
        Ns = max(int(nb.max()), 1) + 2 if narrow else N  # scores narrower than the state (>= every nb)
        s = (rng.standard_normal((B, H, Ns)) * 2).astype(F)
        s[rng.random(s.shape) < 0.08] = NEG_INF
        s[rng.random(s.shape) < 0.04] = np.nan
        s[rng.random(s.shape) < 0.01] = POS_INF
        got = fused.update_predict(conv(s), conv(tokens), k, out, block_size=G, keep_first=kf, keep_last=kl)
        assert got is out
        split.update(conv(s), conv(tokens), block_size=G)
        want = split.predict(k, conv(tokens), block_size=G, keep_first=kf, keep_last=kl)
        assert np.array_equal(np.asarray(got), np.asarray(want)), step  # the same bits: the same Top-K order
        ref.update(s, nb)
        assert_state(fused, ref, B)
        assert same_bits(fused.level, split.level) and same_bits(fused.trend, split.trend)
        assert np.array_equal(fused.known, split.known)
        # the fused call's scores are the ones predict computes (and the NumPy reference's)
        assert same_bits(fused._pred[:B], split._pred[:B]) and np.array_equal(fused._row_len[:B], split._row_len[:B])
        assert same_bits(fused._pred[:B], ref.scores(nb, kf, kl))
        assert_same_sets(got, ref.predict(k, nb, kf, kl))
        if step == 6:  # a new sequence in slot 1
            fused.reset(1)
            split.reset(1)
            ref.known[1] = 0
            tokens[1] = 1
        tokens = np.minimum(tokens + rng.integers(0, 2 * G, B), N * G).astype(np.int32)


def test_update_predict_with_zero_blocks_wanted_and_empty_rows():
    pr = EMAPredictor(2, 1, 6)
    out = np.zeros((2, 1, 0), np.int32)
    s = np.arange(12, dtype=F).reshape(2, 1, 6)
    assert pr.update_predict(s, np.array([6, 0], np.int32), 0, out).shape == (2, 1, 0)
    assert np.array_equal(pr.known, [[6], [0]])
    out = np.zeros((2, 1, 3), np.int32)
    pr.update_predict(s, np.array([6, 0], np.int32), 3, out, keep_first=1, keep_last=1)
    assert np.array_equal(np.sort(out[0, 0]), [0, 4, 5]) and np.array_equal(out[1, 0], [-1, -1, -1])


def _snapshot(pr):
    return tuple(np.array(a, copy=True) for a in (pr.level, pr.trend, pr.known, pr._pred, pr._row_len))


def test_bad_update_predict_arguments_change_nothing():
    torch = pytest.importorskip("torch")
    pr = EMAPredictor(2, 2, 8)
    nb = np.array([8, 4], np.int32)
    s = np.ones((2, 2, 8), F)
    out = np.zeros((2, 2, 3), np.int32)
    pr.update_predict(s, nb, 3, out)
    before = _snapshot(pr)
    out_before = out.copy()
    cases = [
        ((s, nb, -1, out), {}, ValueError, "num_blocks"),
        ((s, nb, 2.5, out), {}, TypeError, "num_blocks"),
        ((s, nb, 3, out), {"block_size": 0}, ValueError, "block_size"),
        ((s, nb, 3, out), {"block_size": True}, TypeError, "block_size"),
        ((s, nb, 3, out), {"block_size": 2**31}, ValueError, "block_size"),
        ((s, nb, 3, out), {"keep_first": -1}, ValueError, "keep_first"),
        ((s, nb, 3, out), {"keep_last": 1.5}, TypeError, "keep_last"),
        ((s, nb, 3, None), {}, TypeError, "out"),
        ((s, nb, 3, [[1]]), {}, TypeError, "out"),
        ((s, nb, 3, np.zeros((2, 2, 4), np.int32)), {}, ValueError, "out"),
        ((s, nb, 3, np.zeros((2, 2, 3), np.int64)), {}, TypeError, "out"),
        ((s, nb, 3, np.zeros((2, 2, 6), np.int32)[:, :, ::2]), {}, ValueError, "out"),
        ((s, nb, 3, torch.zeros(2, 2, 3, dtype=torch.int64)), {}, TypeError, "out"),
        ((np.ones((2, 3, 8), F), nb, 3, out), {}, ValueError, "scores"),
        ((np.ones((2, 2, 8)), nb, 3, out), {}, TypeError, "scores"),
        ((s[:, :, :6], nb, 3, out), {}, ValueError, "nblocks"),  # 8 blocks > the scores' width 6
        ((s, np.array([9, 1], np.int32), 3, out), {}, ValueError, "nblocks"),
        ((s, np.array([33, 1], np.int32), 3, out), {"block_size": 4}, ValueError, "block counts"),
        ((s, np.array([-1, 1], np.int32), 3, out), {"block_size": 4}, ValueError, "nblocks"),
        ((s, np.array([1, 1], np.int64), 3, out), {}, TypeError, "nblocks"),
        ((s, np.zeros(3, np.int32), 3, np.zeros((3, 2, 3), np.int32)), {}, ValueError, "nblocks"),
    ]
    for args, kw, exc, name in cases:
        with pytest.raises(exc, match=name):
            pr.update_predict(*args, **kw)
        after = _snapshot(pr)
        assert all(same_bits(a, b) for a, b in zip(before, after)), (name, kw)
        assert np.array_equal(out, out_before)
    for kw, exc, name in [({"block_size": 0}, ValueError, "block_size"), ({"keep_first": -2}, ValueError,
                                                                           "keep_first"),
                          ({"keep_last": "1"}, TypeError, "keep_last")]:
        with pytest.raises(exc, match=name):
            pr.predict(2, nb, **kw)
        with pytest.raises(exc, match=name):
            pr.predicted_scores(nb, **kw)
    with pytest.raises(ValueError, match="block_size"):
        pr.update(s, nb, block_size=-1)
    with pytest.raises(ValueError, match="out"):
        pr.predict(2, nb, out=np.zeros((2, 2, 3), np.int32))
    assert all(same_bits(a, b) for a, b in zip(before[:3], _snapshot(pr)[:3]))


def test_torch_library_ops_with_token_counts_keep_ranges_and_the_fused_op():
    torch = pytest.importorskip("torch")
    from gvr._interop import register_torch_ops

    register_torch_ops()
    rng = np.random.default_rng(8)
    B, H, N, G = 2, 2, 9, 4
    L, T = torch.zeros(B, H, N), torch.zeros(B, H, N)
    known = torch.zeros(B, H, dtype=torch.int32)
    pred, rl = torch.empty(B, H, N), torch.empty(B, H, dtype=torch.int32)
    tok = torch.tensor([33, 13], dtype=torch.int32)  # 9 and 4 blocks
    ref = EMAPredictor(B, H, N, alpha=0.25, beta=0.75, phi=0.5)
    for step in range(3):
        s = torch.from_numpy(rng.standard_normal((B, H, N)).astype(F))
        if step == 0:
            torch.ops.gvr.prr_ema_update(L, T, known, tok, s, 0.25, 0.75, 0.5, G)
        else:
            torch.ops.gvr.prr_ema_update_predict(L, T, known, tok, s, pred, rl, 0.25, 0.75, 0.5, G, 1, 2)
        ref.update(s.numpy(), tok.numpy(), block_size=G)
        assert same_bits(L.numpy(), ref.level) and same_bits(T.numpy(), ref.trend)
    want, wrl = ref.predicted_scores(tok.numpy(), block_size=G, keep_first=1, keep_last=2)
    assert same_bits(pred.numpy(), want) and np.array_equal(rl.numpy(), wrl)
    pred2 = torch.empty(B, H, N)
    torch.ops.gvr.prr_ema_scores(L, T, known, tok, pred2, rl, 0.5, G, 1, 2)
    assert same_bits(pred2.numpy(), want)

    def step(L, T, known, tok, s, pred, rl):
        torch.ops.gvr.prr_ema_update_predict(L, T, known, tok, s, pred, rl, 0.25, 0.75, 0.5, G, 1, 2)
        return pred.sum()

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    s = torch.from_numpy(rng.standard_normal((B, H, N)).astype(F))
    compiled(L, T, known, tok, s, pred, rl)
    ref.update(s.numpy(), tok.numpy(), block_size=G)
    assert same_bits(L.numpy(), ref.level)
    assert same_bits(pred.numpy(), ref.predicted_scores(tok.numpy(), block_size=G, keep_first=1, keep_last=2)[0])


# --------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------
def _topk_mask(row, k):
    m = np.zeros(row.size, bool)
    m[topk_reference(row, k)] = True
    return m


def _tree32(lane):
    lane = lane.copy()
    while lane.size > 1:
        lane = lane[0::2] + lane[1::2]
    return float(lane[0])


def ref_hit_rates(x, k, points):
    """Brute force: the predictor in NumPy float32 for every grid point, the canonical float64 sums."""
    T, N = x.shape
    kk = min(k, N)
    hits = []
    for a, b, p in points:
        ref = RefEMA(1, 1, N, a, b, p)
        nb = np.array([N], np.int32)
        ref.update(x[None, None, 0], nb)
        acc = 0.0
        for t in range(1, T):
            pred = ref.scores(nb)[0, 0]
            P = _topk_mask(pred, kk)
            S = np.sort(topk_reference(x[t], kk))
            fin = np.isfinite(x[t])
            m = x[t][fin].min() if fin.any() else F(0)
            lane_n, lane_d, cnt = np.zeros(32), np.zeros(32), 0
            for e, j in enumerate(S):
                w = float(x[t, j]) - float(m) if np.isfinite(x[t, j]) else 0.0
                lane_d[e % 32] += w
                if P[j]:
                    lane_n[e % 32] += w
                    cnt += 1
            num, den = _tree32(lane_n), _tree32(lane_d)
            acc += num / den if den > 0 else cnt / kk
            ref.update(x[None, None, t], nb)
        hits.append(acc / (T - 1))
    return np.array(hits)


SMALL_GRID = ((0.25, 0.5, 0.75), (0.2, 0.8), (0.0, 0.5, 1.0))


@pytest.mark.parametrize("case", ["trace", "trace-k-large", "integers", "masked", "constant-rows", "k>N"])
def test_calibrate_equals_brute_force(case):
    rng = np.random.default_rng(11)
    k = 5
    if case.startswith("trace"):
        x = data.block_score_trace(24, 40, persistence=0.8, seed=3)
        if case == "trace-k-large":
            k = 37
    elif case == "integers":  # ties everywhere, and grid points with identical hit rates
        x = rng.integers(0, 5, (20, 30)).astype(F)
    elif case == "masked":
        x = rng.standard_normal((20, 30)).astype(F)
        x[rng.random(x.shape) < 0.3] = -np.inf
        x[3] = -np.inf
        x[5, :3] = np.nan
    elif case == "constant-rows":
        x = rng.standard_normal((20, 30)).astype(F)
        x[4] = 2.5
        x[7] = -1.0
    else:
        x = rng.standard_normal((10, 4)).astype(F)
        k = 9
    points, hits = calibration_hit_rates(x, k, grid=SMALL_GRID)
    want = ref_hit_rates(x, k, points)
    assert same_bits(hits, want), np.flatnonzero(hits != want)
    best = calibrate(x, k, grid=SMALL_GRID)
    assert best == points[int(np.argmax(want))]
    assert best == tuple(float(v) for v in points[int(np.flatnonzero(want == want.max())[0])])


def test_calibrate_default_grid_ties_and_torch():
    torch = pytest.importorskip("torch")
    x = data.block_score_trace(16, 24, seed=1)
    points, hits = calibration_hit_rates(x, 4)
    assert len(points) == 125 and points[0] == (1 / 6, 1 / 6, 0.0) and points[-1] == (5 / 6, 5 / 6, 1.0)
    assert points == [(a, b, p) for a in DEFAULT_GRID[0] for b in DEFAULT_GRID[1] for p in DEFAULT_GRID[2]]
    assert calibrate(torch.from_numpy(x), 4) == calibrate(x, 4)
    # a trajectory every point predicts perfectly: all tie, the first point wins
    flat = np.tile(np.arange(24, dtype=F), (6, 1))
    assert calibrate(flat, 4) == (1 / 6, 1 / 6, 0.0)
    assert np.all(calibration_hit_rates(flat, 4)[1] == 1.0)


def test_calibrate_is_deterministic_across_thread_counts():
    x = data.block_score_trace(40, 300, seed=2)
    gvr.set_num_threads(1)
    try:
        _, one = calibration_hit_rates(x, 16)
    finally:
        gvr.set_num_threads(0)
    _, many = calibration_hit_rates(x, 16)
    assert same_bits(one, many)


def _reuse_and_ema(x, k, params, warm):
    """hit rates on steps warm.. of last-step reuse and of an EMAPredictor warmed on steps < warm"""
    T, N = x.shape
    pr = EMAPredictor(1, 1, N, alpha=params[0], beta=params[1], phi=params[2])
    nb = np.array([N], np.int32)
    for t in range(warm):
        pr.update(x[None, None, t], nb)

    def hit(P, t):
        S = topk_reference(x[t], k)
        w = x[t, S].astype(np.float64) - x[t].min()
        return w[np.isin(S, P)].sum() / w.sum()

    ema, reuse = [], []
    for t in range(warm, T):
        ema.append(hit(pr.predict(k, nb)[0, 0], t))
        reuse.append(hit(topk_reference(x[t - 1], k), t))
        pr.update(x[None, None, t], nb)
    return float(np.mean(ema)), float(np.mean(reuse))


@pytest.mark.parametrize("seed", [0, 1])
def test_ema_beats_last_step_reuse_on_persistent_layers(seed):
    layers = data.block_score_trace(192, 192, persistence=0.95, seed=seed, layers=4)
    rhos = data.block_trace_persistence(4, 0.95)
    k = 12
    for li, rho in enumerate(rhos):
        x = layers[li]
        params = calibrate(x[:96], k)  # the "prefill"
        ema, reuse = _reuse_and_ema(x, k, params, 96)  # the "decode"
        if rho >= 0.9:
            assert ema >= reuse, (li, params, ema, reuse)


# --------------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, kw, exc, name", [
    ((0, 2, 4), {}, ValueError, "max_batch"),
    ((2, 0, 4), {}, ValueError, "Hkv"),
    ((2, 2, 0), {}, ValueError, "max_blocks"),
    ((2.0, 2, 4), {}, TypeError, "max_batch"),
    ((2, 2, True), {}, TypeError, "max_blocks"),
    ((2, 2, 4), {"alpha": 0.0}, ValueError, "alpha"),
    ((2, 2, 4), {"alpha": 1.0}, ValueError, "alpha"),
    ((2, 2, 4), {"beta": 1.5}, ValueError, "beta"),
    ((2, 2, 4), {"phi": -0.1}, ValueError, "phi"),
    ((2, 2, 4), {"phi": "x"}, TypeError, "phi"),
    ((2, 2, 4), {"device": "tpu"}, ValueError, "device"),
])
def test_bad_constructor_arguments(args, kw, exc, name):
    with pytest.raises(exc, match=name):
        EMAPredictor(*args, **kw)


def test_bad_step_arguments():
    pr = EMAPredictor(2, 2, 8)
    nb = np.array([8, 4], np.int32)
    s = np.zeros((2, 2, 8), F)
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, np.array([9, 1], np.int32))
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, np.array([-1, 1], np.int32))
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, np.zeros(3, np.int32))  # B > max_batch
    with pytest.raises(ValueError, match="nblocks"):
        pr.predict(2, np.zeros((2, 1), np.int32))
    with pytest.raises(TypeError, match="nblocks"):
        pr.predict(2, np.array([1, 1], np.int64))
    with pytest.raises(TypeError, match="nblocks"):
        pr.predict(2, 3)
    with pytest.raises(ValueError, match="num_blocks"):
        pr.predict(-1, nb)
    with pytest.raises(TypeError, match="num_blocks"):
        pr.predict(2.5, nb)
    with pytest.raises(ValueError, match="out"):
        pr.predict(2, nb, out=np.zeros((2, 2, 3), np.int32))
    with pytest.raises(ValueError, match="out"):
        pr.predict(2, nb, out=np.zeros((2, 2, 4), np.int32)[:, :, ::2])
    with pytest.raises(ValueError, match="scores"):
        pr.update(np.zeros((2, 3, 8), F), nb)
    with pytest.raises(TypeError, match="scores"):
        pr.update(np.zeros((2, 2, 8), np.float64), nb)
    with pytest.raises(ValueError, match="nblocks"):
        pr.update(np.zeros((2, 2, 6), F), nb)  # nblocks 8 > the scores' width 6
    with pytest.raises(ValueError, match="alpha"):
        pr.set_params(alpha=2)
    with pytest.raises(ValueError, match="rows"):
        pr.reset(2)
    with pytest.raises(TypeError, match="rows"):
        pr.reset("a")
    with pytest.raises(TypeError, match="rows"):
        pr.reset([0.5])
    pr.update(s, nb)  # still usable
    assert np.array_equal(pr.known, [[8, 8], [4, 4]])


def test_bad_calibrate_arguments():
    x = np.zeros((5, 6), F)
    with pytest.raises(ValueError, match="k"):
        calibrate(x, 0)
    with pytest.raises(TypeError, match="k"):
        calibrate(x, 1.5)
    with pytest.raises(ValueError, match="prefill_scores"):
        calibrate(x[:1], 2)
    with pytest.raises(ValueError, match="prefill_scores"):
        calibrate(np.zeros((5, 6, 1), F), 2)
    with pytest.raises(TypeError, match="prefill_scores"):
        calibrate(np.zeros((5, 6)), 2)  # float64
    with pytest.raises(TypeError, match="prefill_scores"):
        calibrate([[1.0, 2.0]], 2)
    with pytest.raises(TypeError, match="grid"):
        calibrate(x, 2, grid=(0.5, 0.5, 0.5))
    with pytest.raises(TypeError, match="grid"):
        calibrate(x, 2, grid=([0.5], [0.5]))
    with pytest.raises(ValueError, match="grid"):
        calibrate(x, 2, grid=([0.5], [], [0.5]))
    with pytest.raises(ValueError, match="alpha"):
        calibrate(x, 2, grid=([1.0], [0.5], [0.5]))
    with pytest.raises(ValueError, match="phi"):
        calibrate(x, 2, grid=([0.5], [0.5], [1.5]))
