"""gvr.sparda.compressed_keys / update_compressed_keys (SparDA / InfLLM-V2 mean-pooled keys): bit for bit
against a NumPy reference that sums in token order in float32 (float32 caches; float16 and bfloat16
through torch CPU tensors, the mean rounded to the cache's dtype), incremental updates equal rebuilds,
pages out of range count as zeros, bad inputs named; fp8 (e4m3fn) caches give the float32 mean of their
exactly decoded values rounded to bfloat16 (or out's float16 / float32). GPU tests (the CUDA kernel against the C path,
graph capture) are marked gpu."""

import numpy as np
import pytest

import gvr
from harness import torch_or_none

torch = torch_or_none()


def reference(K, bt, lengths, kernel, stride):
    """float32 [B, Hkv, Nc, D]: the definition, summing in token order in float32."""
    K = np.asarray(K, np.float32)
    num_pages, P, H, D = K.shape
    B, maxp = bt.shape
    cap = maxp * P
    Nc = (cap - kernel) // stride + 1 if cap >= kernel else 0
    out = np.zeros((B, H, Nc, D), np.float32)
    for b in range(B):
        n = (int(lengths[b]) - kernel) // stride + 1 if lengths[b] >= kernel else 0
        for j in range(min(n, Nc)):
            acc = np.zeros((H, D), np.float32)
            for t in range(j * stride, j * stride + kernel):
                pg = int(bt[b, t // P])
                if 0 <= pg < num_pages:
                    acc = (acc + K[pg, t % P]).astype(np.float32)
            out[b, :, j] = acc / np.float32(kernel)
    return out


def case(seed, num_pages=24, P=16, H=2, D=8, B=2, maxp=10):
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((num_pages, P, H, D)).astype(np.float32)
    bt = np.stack([rng.permutation(num_pages)[:maxp] for _ in range(B)]).astype(np.int32)
    return K, bt


@pytest.mark.parametrize("kernel,stride", [(32, 16), (16, 16), (5, 3), (1, 1)])
def test_float32_bit_exact(kernel, stride):
    K, bt = case(kernel * 7 + stride)
    bt[1, 2] = -1  # a page out of range: zeros
    bt[0, 4] = 99
    lengths = np.array([160, 70], np.int32)
    got = gvr.sparda.compressed_keys(K, bt, lengths, kernel=kernel, stride=stride)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), reference(K, bt, lengths, kernel, stride).view(np.uint32))


@pytest.mark.skipif(torch is None, reason="float16/bfloat16 caches come as torch tensors")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_caches_round_the_float32_mean(dtype):
    K, bt = case(3)
    td = getattr(torch, dtype)
    Kt = torch.from_numpy(K).to(td)
    lengths = np.array([150, 33], np.int32)
    got = gvr.sparda.compressed_keys(Kt, torch.from_numpy(bt), torch.from_numpy(lengths))
    want = torch.from_numpy(reference(Kt.float().numpy(), bt, lengths, 32, 16)).to(td)
    assert got.dtype == td and torch.equal(got.view(torch.int16), want.view(torch.int16))


def _fp8(K, scale=1.0 / 40):
    """K quantized to fp8 e4m3fn (torch CPU), |K| / scale clamped to e4m3's 448; a NaN-free cache"""
    return (torch.from_numpy(K) / scale).clamp_(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"), reason="fp8 caches come as torch tensors")
@pytest.mark.parametrize("out_dtype", [None, "float16", "float32"])
def test_fp8_cache_means_in_a_wider_dtype(out_dtype):
    """an fp8 cache's compressed keys: the float32 mean of the exactly decoded values, rounded to bfloat16
    (default) or out's float16 / float32; updates equal rebuilds"""
    K, bt = case(5)
    bt[0, 3] = -1
    k8 = _fp8(K)
    lengths = np.array([150, 47], np.int32)
    bt_t, ln_t = torch.from_numpy(bt), torch.from_numpy(lengths)
    want32 = torch.from_numpy(reference(k8.float().numpy(), bt, lengths, 32, 16))
    if out_dtype is None:
        got = gvr.sparda.compressed_keys(k8, bt_t, ln_t)
        td = torch.bfloat16
    else:
        td = getattr(torch, out_dtype)
        got = gvr.sparda.compressed_keys(k8, bt_t, ln_t, out=torch.full(want32.shape, 7.0, dtype=td))
    assert got.dtype == td
    want = want32.to(td)
    ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got.view(ints), want.view(ints))
    part = gvr.sparda.compressed_keys(k8, bt_t, torch.tensor([40, 0], dtype=torch.int32), out=torch.empty_like(got))
    gvr.sparda.update_compressed_keys(part, k8, bt_t, torch.tensor([40, 0], dtype=torch.int32), ln_t)
    assert torch.equal(part.view(ints), want.view(ints))


@pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"), reason="fp8 caches come as torch tensors")
def test_fp8_numpy_cache_gives_float32():
    """NumPy callers (no bfloat16 of their own): an ml_dtypes fp8 cache's compressed keys are float32"""
    ml = pytest.importorskip("ml_dtypes")
    K, bt = case(5)
    k8 = _fp8(K)
    lengths = np.array([150, 47], np.int32)
    want32 = reference(k8.float().numpy(), bt, lengths, 32, 16)
    kn = k8.view(torch.uint8).numpy().view(ml.float8_e4m3fn)
    gn = gvr.sparda.compressed_keys(kn, bt, lengths)
    assert gn.dtype == np.float32 and np.array_equal(gn.view(np.uint32), want32.view(np.uint32))


@pytest.mark.skipif(torch is None or not hasattr(torch, "float8_e4m3fn"), reason="fp8 caches come as torch tensors")
def test_fp8_cache_bad_out_dtype():
    K, bt = case(6)
    k8 = _fp8(K)
    with pytest.raises(TypeError, match="ktilde"):  # a float32 cache's ktilde must be float32
        gvr.sparda.compressed_keys(torch.from_numpy(K), torch.from_numpy(bt), out=torch.empty(2, 2, 9, 8,
                                                                                               dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="ktilde"):  # an fp8 ktilde: not a dtype it can be written in
        gvr.sparda.compressed_keys(k8, torch.from_numpy(bt), out=torch.empty(2, 2, 9, 8, dtype=torch.float8_e4m3fn))


def test_updates_equal_rebuilds():
    K, bt = case(5)
    ln = np.array([10, 40], np.int32)
    kt = gvr.sparda.compressed_keys(K, bt, ln)
    for step in (1, 7, 16, 31, 60):
        new = np.minimum(ln + step, 160).astype(np.int32)
        r = gvr.sparda.update_compressed_keys(kt, K, bt, ln, new)
        assert r is kt
        assert np.array_equal(kt, gvr.sparda.compressed_keys(K, bt, new)), step
        ln = new


def test_bad_inputs():
    K, bt = case(6)
    ln = np.array([100, 100], np.int32)
    kt = gvr.sparda.compressed_keys(K, bt, ln)
    with pytest.raises(ValueError, match="'ktilde'"):
        gvr.sparda.compressed_keys(K, bt, ln, out=np.zeros((2, 2, 3, 8), np.float32))
    with pytest.raises(ValueError, match="'kernel'"):
        gvr.sparda.compressed_keys(K, bt, ln, kernel=0)
    with pytest.raises(TypeError, match="'stride'"):
        gvr.sparda.compressed_keys(K, bt, ln, stride=1.5)
    with pytest.raises(ValueError, match="lengths"):
        gvr.sparda.compressed_keys(K, bt, np.array([100, 1000], np.int32))  # > max_pages * P = 160
    with pytest.raises(TypeError, match="'start'"):
        gvr.sparda.update_compressed_keys(kt, K, bt, None, ln)
    with pytest.raises(TypeError, match="'k_cache'"):
        gvr.sparda.compressed_keys(K.astype(np.float64), bt, ln)
    with pytest.raises(TypeError, match="'ktilde'"):
        gvr.sparda.update_compressed_keys(kt.astype(np.float64), K, bt, ln, ln)
    K0, kt0 = K.copy(), kt.copy()
    with pytest.raises(ValueError):
        gvr.sparda.update_compressed_keys(kt, K, bt, ln, np.array([100, 999], np.int32))
    assert np.array_equal(K, K0) and np.array_equal(kt, kt0)  # a failed call writes nothing


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_equals_cpu_updates_and_replays(cuda, dtype):
    K, bt = case(8, num_pages=300, P=64, H=8, D=128, B=3, maxp=96)
    bt[2, 5] = -1
    td = getattr(torch, dtype)
    Kc = torch.from_numpy(K).to(td)
    Kg, btg = Kc.cuda(), torch.from_numpy(bt).cuda()
    ln = np.array([96 * 64, 1000, 31], np.int32)
    want = gvr.sparda.compressed_keys(Kc, torch.from_numpy(bt), torch.from_numpy(ln))
    got = gvr.sparda.compressed_keys(Kg, btg, torch.from_numpy(ln).cuda())
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    start, end = torch.tensor([100, 1000, 31], dtype=torch.int32), torch.tensor([200, 1777, 64], dtype=torch.int32)
    gvr.sparda.update_compressed_keys(want, Kc, torch.from_numpy(bt), start, end)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    kt = got.clone()
    start_g, end_g = start.cuda(), end.cuda()  # host-to-device copies are not capturable
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            gvr.sparda.update_compressed_keys(kt, Kg, btg, start_g, end_g)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(kt.cpu().view(torch.int16), want.view(torch.int16))



def _same_or_both_nan(got, want):
    """equal bit for bit where the reference is a number, NaN exactly where it is NaN (a NaN's payload and
    sign after rounding to half precision are not specified: CUDA's conversions give the canonical NaN)"""
    g, w = got.cpu(), want.cpu()
    nan = torch.isnan(w.float())
    if not torch.equal(torch.isnan(g.float()), nan):
        return False
    return torch.equal(g.view(torch.int16)[~nan], w.view(torch.int16)[~nan])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_fp8_cache_equals_cpu(cuda, dtype):
    K, bt = case(9, num_pages=300, P=64, H=8, D=128, B=3, maxp=96)
    bt[1, 7] = -1
    k8 = _fp8(K)
    k8.view(torch.uint8)[5, 3, 0, :4] = 0x7F  # NaN codes: NaN means, the same on both paths
    td = getattr(torch, dtype)
    ln = torch.tensor([96 * 64, 1500, 40], dtype=torch.int32)
    btt = torch.from_numpy(bt)
    want = gvr.sparda.compressed_keys(k8, btt, ln, out=torch.empty(3, 8, (96 * 64 - 32) // 16 + 1, 128, dtype=td))
    got = gvr.sparda.compressed_keys(k8.cuda(), btt.cuda(), ln.cuda(), out=torch.empty(want.shape, dtype=td,
                                                                                         device="cuda"))
    assert _same_or_both_nan(got, want)
    dflt = gvr.sparda.compressed_keys(k8.cuda(), btt.cuda(), ln.cuda())
    assert dflt.dtype == torch.bfloat16
    start, end = torch.tensor([100, 1000, 31], dtype=torch.int32), torch.tensor([300, 1777, 64], dtype=torch.int32)
    gvr.sparda.update_compressed_keys(want, k8, btt, start, end)
    gvr.sparda.update_compressed_keys(got, k8.cuda(), btt.cuda(), start.cuda(), end.cuda())
    torch.cuda.synchronize()
    assert _same_or_both_nan(got, want)
    with pytest.raises(ValueError, match="ktilde"):  # float32 ktilde: the CPU path only
        gvr.sparda.compressed_keys(k8.cuda(), btt.cuda(), ln.cuda(), out=torch.empty(want.shape, device="cuda"))


@pytest.mark.skipif(torch is None, reason="torch.compile needs torch")
def test_torch_compile_fullgraph_matches_eager():
    """compressed_keys / update_compressed_keys are torch.library ops (fake implementations): a compiled
    step holds them without a graph break and gives the eager bits; forecast_select composes ops."""
    K, bt = case(9, D=64)
    Kt, btt = torch.from_numpy(K), torch.from_numpy(bt)
    start, end = torch.tensor([40, 70], dtype=torch.int32), torch.tensor([100, 150], dtype=torch.int32)

    def step(k, table, s, e, F):
        kt = gvr.sparda.compressed_keys(k, table, s)
        gvr.sparda.update_compressed_keys(kt, k, table, s, e)
        return kt, gvr.sparda.forecast_select(F, kt, 4, lengths=e)

    F = torch.randn(2, 2, 64)
    want = step(Kt, btt, start, end, F)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(Kt, btt, start, end, F)
    assert torch.equal(got[0], want[0]) and torch.equal(got[0], gvr.sparda.compressed_keys(Kt, btt, end))
    assert torch.equal(torch.sort(got[1], -1).values, torch.sort(want[1], -1).values)
