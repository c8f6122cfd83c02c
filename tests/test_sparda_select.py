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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_equals_cpu_and_replays(cuda, dtype):
    F, kt = case(5, D=128)
    lengths = np.array([(kt.shape[2] - 1) * 16 + 32, 200, 10], np.int32)
    want = gvr.sparda.forecast_select(F, kt, 12, lengths=lengths)
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
