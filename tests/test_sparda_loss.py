"""gvr.sparda.forecast_kl_loss against a direct float64 NumPy implementation of paper 004's eq. 12-14
(max-pool to the inference grid, the target's top-k + a rest bucket, KL(target || forecast)), edge cases
(k >= blocks, ties, masked blocks, ineligible blocks, an all-zero target), torch.autograd.gradcheck in
float64, and bad inputs."""
import math

import numpy as np
import pytest

import gvr
from harness import torch_or_none

torch = torch_or_none()
pytestmark = pytest.mark.skipif(torch is None, reason="forecast_kl_loss is PyTorch only")


def direct(qf, fs, k, kernel, stride, tau, eligible=None):
    """float64, row by row, the paper's definition written out."""
    qf, fs = np.asarray(qf, np.float64), np.asarray(fs, np.float64)
    lead = fs.shape[:-1]
    qf2, fs2 = qf.reshape(-1, qf.shape[-1]), fs.reshape(-1, fs.shape[-1])
    el2 = None if eligible is None else np.broadcast_to(np.asarray(eligible), fs.shape).reshape(-1, fs.shape[-1])
    nb, nf = fs2.shape[1], qf2.shape[1]
    out = []
    for r in range(fs2.shape[0]):
        t = np.array([max([qf2[r, i] for i in range(j * stride, min(j * stride + kernel, nf))], default=0.0)
                      for j in range(nb)])
        cand = [j for j in range(nb) if el2 is None or el2[r, j]]
        cand.sort(key=lambda j: (-t[j], j))
        S = set(cand[:k])
        T = t.sum()
        z = fs2[r] / tau
        m = np.max(z)
        lse = m + math.log(np.sum(np.exp(z - m))) if np.isfinite(m) else -np.inf
        p = np.exp(z - lse)
        if T <= 0:
            out.append(0.0)
            continue
        ts = [t[j] / T for j in sorted(S)]
        ps = [p[j] for j in sorted(S)]
        tr = sum(t[j] for j in range(nb) if j not in S) / T
        pr = sum(p[j] for j in range(nb) if j not in S)
        kl = 0.0
        for a, b in list(zip(ts, ps)) + [(tr, pr)]:
            if a > 0:
                kl += a * (math.log(a) - (math.log(b) if b > 0 else -np.inf))
        out.append(kl)
    return np.array(out).reshape(lead)


def case(seed, lead=(3, 2), nb=12, kernel=4, stride=2, dtype=None):
    rng = np.random.default_rng(seed)
    nf = (nb - 1) * stride + kernel - 1  # the last window cut short
    qf = rng.random(lead + (nf,)) ** 3
    fs = rng.standard_normal(lead + (nb,)) * 2
    dt = dtype or torch.float64
    return torch.tensor(qf, dtype=dt), torch.tensor(fs, dtype=dt), kernel, stride


@pytest.mark.parametrize("k", [1, 3, 11, 12, 40])
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_against_direct(k, tau):
    qf, fs, kernel, stride = case(k)
    got = gvr.sparda.forecast_kl_loss(qf, fs, k, pool_kernel=kernel, pool_stride=stride, tau=tau, reduction="none")
    want = direct(qf.numpy(), fs.numpy(), k, kernel, stride, tau)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    mean = gvr.sparda.forecast_kl_loss(qf, fs, k, pool_kernel=kernel, pool_stride=stride, tau=tau)
    total = gvr.sparda.forecast_kl_loss(qf, fs, k, pool_kernel=kernel, pool_stride=stride, tau=tau, reduction="sum")
    assert math.isclose(float(mean), want.mean(), rel_tol=1e-12) and math.isclose(float(total), want.sum(), rel_tol=1e-12)


def test_edge_cases():
    qf, fs, kernel, stride = case(7, lead=(4,))
    qf[0, :] = 0.5  # ties everywhere: the lower block numbers win
    qf[1, :] = 0.0  # no target mass: 0
    fs[2, 5:] = -float("inf")  # masked blocks in the forecast
    qf[2, 5 * stride:] = 0.0  # ... and in the target
    eligible = torch.ones(4, fs.shape[-1], dtype=torch.bool)
    eligible[3, :2] = False  # the initial blocks always kept: into the rest bucket
    eligible[3, -1] = False
    got = gvr.sparda.forecast_kl_loss(qf, fs, 3, pool_kernel=kernel, pool_stride=stride, eligible=eligible,
                                      reduction="none")
    want = direct(qf.numpy(), fs.numpy(), 3, kernel, stride, 1.0, eligible.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    assert got[1] == 0.0 and torch.isfinite(got).all()
    # target mass on a block the forecast rules out: KL is +inf
    qf2, fs2 = qf[2:3].clone(), fs[2:3].clone()
    qf2[0, -1] = 5.0
    assert math.isinf(float(gvr.sparda.forecast_kl_loss(qf2, fs2, 2, pool_kernel=kernel, pool_stride=stride)))
    # a perfect forecast of the restricted distribution gives 0
    t = torch.tensor([[4.0, 3.0, 2.0, 1.0]], dtype=torch.float64)
    f = torch.log(t / t.sum())
    assert abs(float(gvr.sparda.forecast_kl_loss(t, f, 2, pool_kernel=1, pool_stride=1))) < 1e-15


def test_gradcheck_and_gradient_reaches_every_block():
    qf, fs, kernel, stride = case(3, lead=(2,), nb=8)
    fs.requires_grad_(True)
    qf.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: gvr.sparda.forecast_kl_loss(a, b, 3, pool_kernel=kernel, pool_stride=stride, tau=0.7), (qf, fs))
    loss = gvr.sparda.forecast_kl_loss(qf, fs, 3, pool_kernel=kernel, pool_stride=stride)
    (g,) = torch.autograd.grad(loss, fs)
    assert torch.isfinite(g).all() and (g != 0).all()  # non-selected blocks too, through the rest bucket
    # no NaN gradient when the rest bucket is empty (k >= blocks) or a block is masked
    fs2 = fs.detach().clone()
    fs2[:, -1] = -float("inf")
    fs2.requires_grad_(True)
    qf2 = qf.detach().clone()
    qf2[:, (fs.shape[-1] - 1) * stride:] = 0
    for k in (3, 8):
        (g2,) = torch.autograd.grad(gvr.sparda.forecast_kl_loss(qf2, fs2, k, pool_kernel=kernel, pool_stride=stride),
                                    fs2)
        assert torch.isfinite(g2).all()


def test_float32_matches_float64():
    q64, f64, kernel, stride = case(11)
    a = gvr.sparda.forecast_kl_loss(q64.float(), f64.float(), 4, pool_kernel=kernel, pool_stride=stride,
                                    reduction="none")
    b = gvr.sparda.forecast_kl_loss(q64, f64, 4, pool_kernel=kernel, pool_stride=stride, reduction="none")
    assert a.dtype == torch.float32
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)  # float32 rounding of ~20 terms


def test_bad_inputs():
    qf, fs, kernel, stride = case(1)
    L = gvr.sparda.forecast_kl_loss
    with pytest.raises(ValueError, match="'k'"):
        L(qf, fs, 0)
    with pytest.raises(TypeError, match="'k'"):
        L(qf, fs, 2.0)
    with pytest.raises(ValueError, match="'pool_stride'"):
        L(qf, fs, 2, pool_stride=0)
    with pytest.raises(ValueError, match="'tau'"):
        L(qf, fs, 2, tau=0.0)
    with pytest.raises(ValueError, match="'reduction'"):
        L(qf, fs, 2, reduction="max")
    with pytest.raises(TypeError, match="'q_scores_fine'"):
        L(qf.numpy(), fs, 2)
    with pytest.raises(TypeError, match="'f_scores'"):
        L(qf, fs.long(), 2)
    with pytest.raises(ValueError, match="leading"):
        L(qf[:1], fs, 2)
    with pytest.raises(TypeError, match="'eligible'"):
        L(qf, fs, 2, eligible=torch.ones(fs.shape))
    with pytest.raises(ValueError, match="'eligible'"):
        L(qf, fs, 2, eligible=torch.ones(5, dtype=torch.bool))
    q0, f0 = qf.clone(), fs.clone()
    L(qf, fs, 2)
    assert torch.equal(qf, q0) and torch.equal(fs, f0)  # nothing passed in is modified
