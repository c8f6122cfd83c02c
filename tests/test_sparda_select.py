"""gvr.sparda.forecast_select (SparDA's Forecast indexer): the selection equals a NumPy reference (dot
products of integer-valued inputs, exact in float32 and bfloat16, so the ranking is exact too; ties to
the lower id; the first init_blocks and last local_blocks valid windows kept), on NumPy, torch CPU and
(GPU tests) CUDA against the CPU path; window counts from lengths; bad inputs."""
import numpy as np
import pytest

import gvr
from harness import torch_or_none

torch = torch_or_none()


def reference(F, kt, k, lengths, kernel, stride, init_blocks, local_blocks):
    F, kt = np.asarray(F, np.float64), np.asarray(kt, np.float64)
    B, H, Nc, _ = kt.shape
    out = np.full((B, H, k), -1, np.int32)
    for b in range(B):
        n = max(0, (int(lengths[b]) - kernel) // stride + 1) if lengths[b] >= kernel else 0
        n = min(n, Nc)
        for h in range(H):
            s = kt[b, h, :n] @ F[b, h]
            keep = set(range(min(init_blocks, n))) | set(range(max(0, n - local_blocks), n))
            key = [(-np.inf if j in keep else -s[j], j) for j in range(n)]
            sel = [j for _, j in sorted(key)][: min(k, n)]
            out[b, h, : len(sel)] = sel
    return out


def case(seed, B=3, H=2, Nc=70, D=64):
    rng = np.random.default_rng(seed)
    kt = rng.integers(-3, 4, (B, H, Nc, D)).astype(np.float32)
    F = rng.integers(-3, 4, (B, H, D)).astype(np.float32)
    return F, kt


@pytest.mark.parametrize("kernel,stride", [(32, 16), (64, 64), (1, 1)])
@pytest.mark.parametrize("k", [1, 8, 100])
def test_against_reference_numpy_and_torch(k, kernel, stride):
    F, kt = case(k + kernel)
    Nc = kt.shape[2]
    lengths = np.array([(Nc - 1) * stride + kernel, kernel + 3 * stride, kernel - 1], np.int32)
    for init, local in ((1, 2), (0, 0), (4, 1)):
        want = reference(F, kt, k, lengths, kernel, stride, init, local)
        got = gvr.sparda.forecast_select(F, kt, k, lengths=lengths, kernel=kernel, stride=stride, init_blocks=init,
                                         local_blocks=local)
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1)), (k, kernel, stride, init, local)
        if torch is not None:
            gt = gvr.sparda.forecast_select(torch.from_numpy(F), torch.from_numpy(kt), k,
                                            lengths=torch.from_numpy(lengths), kernel=kernel, stride=stride,
                                            init_blocks=init, local_blocks=local)
            assert isinstance(gt, torch.Tensor) and np.array_equal(np.sort(gt.numpy(), -1), np.sort(want, -1))


def test_out_and_inputs_unchanged():
    F, kt = case(3)
    lengths = np.array([1100, 500, 0], np.int32)
    with pytest.raises(ValueError, match="'ktilde'"):
        gvr.sparda.forecast_select(F, kt, 5, lengths=np.array([2000, 500, 0], np.int32))  # 124 windows > 70
    out = np.full((3, 2, 5), 9, np.int32)
    F0, kt0 = F.copy(), kt.copy()
    r = gvr.sparda.forecast_select(F, kt, 5, lengths=lengths, out=out)
    assert r is out and np.all(out[2] == -1)
    assert np.array_equal(F, F0) and np.array_equal(kt, kt0)


def test_bad_inputs():
    F, kt = case(4)
    ln = np.array([500, 500, 500], np.int32)
    with pytest.raises(ValueError, match="'ktilde'"):
        gvr.sparda.forecast_select(F, kt[0], 4, lengths=ln)
    with pytest.raises(TypeError, match="'lengths'"):
        gvr.sparda.forecast_select(F, kt, 4, lengths=ln.astype(np.int64))
    with pytest.raises(ValueError, match="'stride'"):
        gvr.sparda.forecast_select(F, kt, 4, lengths=ln, stride=0)
    with pytest.raises(ValueError):
        gvr.sparda.forecast_select(F[:, :1], kt, 4, lengths=ln)  # Hkv mismatch, named by select_blocks
    with pytest.raises(ValueError, match="'k'"):
        gvr.sparda.forecast_select(F, kt, -1, lengths=ln)
    with pytest.raises(ValueError, match="'lengths' must lie in"):  # token counts are >= 0 (device ones: clamped)
        gvr.sparda.forecast_select(F, kt, 4, lengths=np.array([500, -1, 500], np.int32))
    out = np.full((3, 2, 5), 9, np.int32)
    with pytest.raises(ValueError, match=r"sparda\.forecast_select: 'out' must have shape"):  # named as called
        gvr.sparda.forecast_select(F, kt, 4, lengths=ln, out=out)
    assert np.all(out == 9)


@pytest.mark.parametrize("kernel,stride", [(32, 16), (64, 64), (5, 3), (1, 7)])
def test_block_scores_window_counts(kernel, stride):
    """gvr._C.block_scores with window=W: the row's blocks are the complete windows of W tokens every
    block_size in lengths[b] tokens, counted by the kernel, equal to giving it those counts with block_size 1;
    the host bound on lengths is the longest row of at most Nb windows."""
    from gvr import _C
    F, kt = case(6, Nc=40)
    B, H, Nc, D = kt.shape
    meta = np.ascontiguousarray(np.broadcast_to(kt[:, :, :, None, :], (B, H, Nc, 2, D)))
    cap = kernel - 1 + Nc * stride
    for lengths in ([0, kernel - 1, kernel], [kernel + stride - 1, kernel + stride, cap], [cap - 1, 3 * stride, 1]):
        ln = np.array(lengths, np.int32)
        nwin = np.where(ln >= kernel, (ln.astype(np.int64) - kernel) // stride + 1, 0).astype(np.int32)
        assert nwin.max() <= Nc
        for kf, kl in ((0, 0), (1, 2)):
            s_w, c_w = np.zeros((B, H, Nc), np.float32), np.zeros((B, H), np.int32)
            s_1, c_1 = np.zeros((B, H, Nc), np.float32), np.zeros((B, H), np.int32)
            _C.block_scores(F, meta, ln, s_w, c_w, stride, "max", kf, kl, None, None, None, kernel)
            _C.block_scores(F, meta, nwin, s_1, c_1, 1, "max", kf, kl, None, None, None)
            assert np.array_equal(c_w, np.broadcast_to(nwin[:, None], (B, H))) and np.array_equal(c_w, c_1)
            assert np.array_equal(s_w.view(np.int32), s_1.view(np.int32))
    s_w, c_w = np.zeros((B, H, Nc), np.float32), np.zeros((B, H), np.int32)
    with pytest.raises(ValueError, match=rf"'lengths' must lie in \[0, (window - 1 \+ )?Nb \* block_size\] = \[0, {cap}\]"):
        _C.block_scores(F, meta, np.array([cap + 1, 0, 0], np.int32), s_w, c_w, stride, "max", 0, 0, None, None,
                        None, kernel)
    with pytest.raises(ValueError, match="'window'"):
        _C.block_scores(F, meta, None, s_w, c_w, stride, "max", 0, 0, None, None, None, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_equals_cpu_and_replays(cuda, dtype):
    F, kt = case(5, D=128)
    lengths = np.array([(kt.shape[2] - 1) * 16 + 32, 200, 10], np.int32)
    want = gvr.sparda.forecast_select(F, kt, 12, lengths=lengths)
    # device lengths past the last window and below zero: clamped by the kernel (Nc windows, none)
    for far, gone in (((kt.shape[2] + 5) * 16 + 32, -9), (2 ** 31 - 1, -2 ** 31)):
        lx = np.array([far, 200, gone], np.int32)
        wx = gvr.sparda.forecast_select(F, kt, 12, lengths=np.array([lengths[0], 200, 0], np.int32))
        gx = gvr.sparda.forecast_select(torch.from_numpy(F).to("cuda", getattr(torch, dtype)),
                                        torch.from_numpy(kt).to("cuda", getattr(torch, dtype)), 12,
                                        lengths=torch.from_numpy(lx).cuda())
        assert np.array_equal(np.sort(gx.cpu().numpy(), -1), np.sort(wx, -1))
    td = getattr(torch, dtype)
    Fg, ktg, lg = (torch.from_numpy(F).to("cuda", td), torch.from_numpy(kt).to("cuda", td),
                   torch.from_numpy(lengths).cuda())
    got = gvr.sparda.forecast_select(Fg, ktg, 12, lengths=lg)
    assert got.is_cuda and np.array_equal(np.sort(got.cpu().numpy(), -1), np.sort(want, -1))
    out = torch.empty(3, 2, 12, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        gvr.sparda.forecast_select(Fg, ktg, 12, lengths=lg, out=out)
        with torch.cuda.graph(g, stream=s):
            gvr.sparda.forecast_select(Fg, ktg, 12, lengths=lg, out=out)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    assert np.array_equal(np.sort(out.cpu().numpy(), -1), np.sort(want, -1))
