"""GPU tests for gvr.prr's selection stage: the CUDA kernels against the C CPU path run on the same
float16 / bfloat16 inputs (torch CPU tensors). Metadata is exact (min / max of stored values), so
CUDA and CPU agree bit for bit; block scores follow the documented summation order on both, so they
agree bit for bit too (and within fp32 rounding of the float64 reference); selections are equal as
sets. The CUDA path is deterministic, runs on the caller's stream and replays from a CUDA graph.

fp8 (e4m3fn) K caches: the metadata (bytes picked in totalOrder, NaN codes, signed zeros, subnormals and
+-448 included) and the scores over it (bfloat16 / float16 q) equal the CPU path's bit for bit (NaN
scores as NaN: their sign and payload are not specified), the metadata the reference's too; update
and select replay from a CUDA graph; fp8 K / metadata need 16-byte aligned starts and strides in
multiples of 16 bytes (a ValueError naming the tensor).

Every test is collected; each is skipped, with the reason, where torch with a CUDA device or gvr's
CUDA library is missing (conftest.py, harness.gpu_skip_reason).
"""

import numpy as np
import pytest

from gvr import _prr_select as prr
from harness import torch_or_none
from prr_select_reference import (
    E4M3_EMPTY_MAX, E4M3_EMPTY_MIN, FP8, empty_ref, make_case, metadata_ref, scores_abs, scores_ref, select_ref,
    to_numpy, valid_blocks,
)

torch = torch_or_none()

pytestmark = pytest.mark.gpu
DTYPES = ("bfloat16", "float16")
PG = [(16, 16), (16, 64), (64, 16), (1, 16), (16, 1), (32, 128), (128, 32), (16, 48)]


def bits(x):
    x = x.detach().cpu().contiguous()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def same_scores(a, b):
    """float32 scores equal bit for bit, every NaN counted as the same NaN (sign and payload unspecified)"""
    a, b = a.detach().cpu(), b.detach().cpu()
    nan = torch.tensor(float("nan"))
    return torch.equal(torch.isnan(a), torch.isnan(b)) and same_bits(torch.where(torch.isnan(a), nan, a),
                                                                     torch.where(torch.isnan(b), nan, b))


def both_meta(c, **kw):
    """(CUDA meta, CPU meta) of the same case"""
    res = []
    for device in ("cuda", "cpu"):
        k, bt, ln, _ = c.args("torch", device)
        res.append(prr.block_metadata(k, bt, ln, block_size=c.block_size, **kw))
    torch.cuda.synchronize()
    assert res[0].device.type == "cuda" and res[0].dtype == res[1].dtype
    return res


def check_scores_pair(g, c_, q, meta, lengths, G, **kw):
    """CUDA scores g against CPU scores c_ (bit for bit) and the float64 reference (fp32 rounding)"""
    g, c_ = g.cpu(), c_.cpu()
    ref = scores_ref(q, meta, lengths, G, **kw)
    got = g.double().numpy()
    inf, nan = np.isinf(ref), np.isnan(ref)
    assert np.array_equal(got[inf], ref[inf])
    assert np.array_equal(np.isnan(got), nan), "CUDA NaN scores differ from the reference's"
    D = q.shape[-1]
    with np.errstate(invalid="ignore"):
        bound = scores_abs(q, meta) * (D + 4) * 2.0**-24 + 1e-30
        ok = inf | nan | (np.abs(got - ref) <= bound)
    assert ok.all(), f"CUDA scores off the reference at {np.argwhere(~ok)[:5]}"
    assert same_scores(g, c_), "CUDA and CPU scores differ in bits (the documented summation order)"


# --------------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("P,G", PG, ids=[f"P{p}-G{g}" for p, g in PG])
@pytest.mark.parametrize("dtype", DTYPES)
def test_metadata_matches_cpu_bit_for_bit(dtype, P, G, D, layout):
    rng = np.random.default_rng(P * 7 + G + D)
    c = make_case(rng, B=5, Hkv=2, D=D, P=P, G=G, max_pages=max(2, 512 // P), dtype=dtype, layout=layout,
                  bad_pages=0.05)
    g, cpu = both_meta(c)
    assert same_bits(g, cpu)


def test_metadata_large_context():
    rng = np.random.default_rng(1)
    c = make_case(rng, B=2, Hkv=8, D=128, P=16, G=64, max_pages=8192, dtype="bfloat16", lengths=[131072, 100001])
    g, cpu = both_meta(c)
    assert same_bits(g, cpu)


def test_metadata_signed_zero_and_nan():
    k = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    k[0, :, 0, 0] = torch.tensor([0.0, -0.0] * 8)
    k[0, 3, 0, 1] = float("nan")
    k[0, 5, 0, 2] = -float("nan")
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    g = prr.block_metadata(k.cuda(), bt.cuda(), block_size=16)
    c = prr.block_metadata(k, bt, block_size=16)
    assert same_bits(g, c)
    assert torch.signbit(c[0, 0, 0, 0, 0]) and not torch.signbit(c[0, 0, 0, 1, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,G", [(16, 16), (16, 64), (64, 16), (8, 24)], ids=["P16-G16", "P16-G64", "P64-G16", "P8-G24"])
def test_update_matches_rebuild_and_cpu(dtype, P, G):
    rng = np.random.default_rng(P + G)
    c = make_case(rng, B=4, Hkv=4, D=128, P=P, G=G, max_pages=max(4, 1024 // P), dtype=dtype, bad_pages=0.05,
                  lengths="full")
    k, bt, _, _ = c.args("torch", "cuda")
    kc, btc, _, _ = c.args("torch", "cpu")
    cap = bt.shape[1] * P
    cur = torch.tensor([0, 3, G, cap // 2], dtype=torch.int32)
    meta = prr.block_metadata(k, bt, cur.cuda(), block_size=G)
    meta_c = prr.block_metadata(kc, btc, cur, block_size=G)
    for step in [1, 1, 1, G - 1, 2, 0, G + 3, 1, 5 * G, 300, cap]:
        new = torch.clamp(cur + torch.tensor([step, step, 1, 2 * step], dtype=torch.int32), max=cap).to(torch.int32)
        prr.update_block_metadata(meta, k, bt, cur.cuda(), new.cuda(), block_size=G)
        prr.update_block_metadata(meta_c, kc, btc, cur, new, block_size=G)
        want = prr.block_metadata(k, bt, new.cuda(), block_size=G)
        torch.cuda.synchronize()
        assert same_bits(meta, want), f"step {step}: CUDA update != CUDA rebuild"
        assert same_bits(meta, meta_c), f"step {step}: CUDA update != CPU update"
        cur = new


def test_lengths_out_of_range_are_clamped_on_the_gpu():
    rng = np.random.default_rng(2)
    c = make_case(rng, B=2, Hkv=2, D=64, P=16, G=16, max_pages=4, dtype="bfloat16", lengths="full")
    k, bt, ln, q = c.args("torch", "cuda")
    m = prr.block_metadata(k, bt, torch.tensor([-5, 999], dtype=torch.int32, device="cuda"), block_size=16)
    want = prr.block_metadata(k, bt, torch.tensor([0, 64], dtype=torch.int32, device="cuda"), block_size=16)
    assert same_bits(m, want)
    s = prr.block_scores(q, want, torch.tensor([-5, 999], dtype=torch.int32, device="cuda"), block_size=16)
    s2 = prr.block_scores(q, want, torch.tensor([0, 64], dtype=torch.int32, device="cuda"), block_size=16)
    assert same_bits(s, s2)


# --------------------------------------------------------------------------------------------------
# scores and selection
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("GQ", [1, 4, 8, 32])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_match_cpu(dtype, D, GQ, reduce):
    rng = np.random.default_rng(D + GQ)
    c = make_case(rng, B=3, Hkv=2, GQ=GQ, D=D, P=16, G=16, max_pages=40, dtype=dtype, bad_pages=0.05)
    res = []
    for device in ("cuda", "cpu"):
        k, bt, ln, q = c.args("torch", device)
        meta = prr.block_metadata(k, bt, ln, block_size=16)
        res.append(prr.block_scores(q, meta, ln, block_size=16, group_reduce=reduce, keep_first=1, keep_last=2))
    torch.cuda.synchronize()
    _, _, ln, q = c.args("torch", "cpu")
    check_scores_pair(res[0], res[1], q, meta, ln, 16, group_reduce=reduce, keep_first=1, keep_last=2)


@pytest.mark.parametrize("kf,kl", [(0, 0), (1, 2), (4, 0), (100, 100)])
def test_scores_masks_match_cpu(kf, kl):
    rng = np.random.default_rng(kf * 10 + kl)
    c = make_case(rng, B=8, Hkv=2, GQ=4, D=128, P=16, G=64, max_pages=64, dtype="bfloat16", bad_pages=0.2)
    out = []
    for device in ("cuda", "cpu"):
        k, bt, ln, q = c.args("torch", device)
        meta = prr.block_metadata(k, bt, ln, block_size=64)
        out.append(prr.block_scores(q, meta, ln, block_size=64, keep_first=kf, keep_last=kl).cpu())
    assert same_bits(out[0], out[1])


@pytest.mark.parametrize("k", [0, 1, 16, 64, 3000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_blocks_matches_cpu(dtype, k):
    rng = np.random.default_rng(k + 5)
    c = make_case(rng, B=4, Hkv=4, GQ=4, D=128, P=16, G=64, max_pages=1024, dtype=dtype,
                  lengths=[16384, 16384 - 63, 4096, 0])
    res, scores = [], None
    for device in ("cuda", "cpu"):
        kk, bt, ln, q = c.args("torch", device)
        meta = prr.block_metadata(kk, bt, ln, block_size=64)
        res.append(prr.select_blocks(q, meta, k, ln, block_size=64).cpu())
        scores = prr.block_scores(q, meta, ln, block_size=64, keep_first=1, keep_last=2).cpu()
    g, c_ = (torch.sort(torch.where(x < 0, 1 << 30, x), dim=-1).values for x in res)
    assert torch.equal(g, c_)
    want = select_ref(scores.numpy(), valid_blocks(c.lengths, 4, scores.shape[-1], 64), k)
    got = torch.where(g == 1 << 30, -1, g).numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("lengths", ["ragged", None])
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_blocks_scores_out_is_block_scores_without_keeps(dtype, D, reduce, lengths):
    rng = np.random.default_rng(D + 3 * (reduce == "sum") + (lengths is None))
    c = make_case(rng, B=8, Hkv=4, GQ=4, D=D, P=16, G=32, max_pages=80, dtype=dtype, bad_pages=0.05)
    Nb = -(-80 * 16 // 32)
    res = {}
    for device in ("cuda", "cpu"):
        kk, bt, ln, q = c.args("torch", device)
        if lengths is None:
            ln = None
        meta = prr.block_metadata(kk, bt, ln, block_size=32)
        for k, init, local in ((8, 1, 2), (0, 1, 2), (Nb, 2, 3), (5, 0, 0)):
            want_sel = prr.select_blocks(q, meta, k, ln, block_size=32, group_reduce=reduce, init_blocks=init,
                                         local_blocks=local, sorted=k == 8)
            big = torch.full((8, 5, Nb + 8), 7.0, device=device)
            so = big[:, 1:, 8:]  # an offset view, unit stride along Nb
            sel = prr.select_blocks(q, meta, k, ln, block_size=32, group_reduce=reduce, init_blocks=init,
                                    local_blocks=local, sorted=k == 8, scores_out=so)
            want = prr.block_scores(q, meta, ln, block_size=32, group_reduce=reduce)
            if device == "cuda":
                torch.cuda.synchronize()
            assert same_bits(so, want), f"{device}: k={k} init={init} local={local}"
            assert torch.equal(sel, want_sel), f"{device}: the selection changed with scores_out"
            assert torch.all(big[:, 0] == 7.0) and torch.all(big[..., :8] == 7.0)
            if init or local:
                kept = prr.block_scores(q, meta, ln, block_size=32, group_reduce=reduce, keep_first=init,
                                        keep_last=local)
                assert ((kept == float("inf")) & torch.isfinite(so)).any()
            res[device, k] = (so.cpu(), sel.cpu())
    for k in (8, 0, Nb, 5):
        assert same_bits(res["cuda", k][0], res["cpu", k][0]), "CUDA and CPU scores_out differ in bits"
        # as sets (the order within a row is unspecified unless sorted)
        g, c_ = (torch.sort(torch.where(x < 0, 1 << 30, x), dim=-1).values
                 for x in (res["cuda", k][1], res["cpu", k][1]))
        assert torch.equal(g, c_)


# --------------------------------------------------------------------------------------------------
# determinism, graphs, streams, compile
# --------------------------------------------------------------------------------------------------
def test_determinism_100_calls():
    rng = np.random.default_rng(7)
    c = make_case(rng, B=4, Hkv=8, GQ=4, D=128, P=16, G=64, max_pages=512, dtype="bfloat16")
    k, bt, ln, q = c.args("torch", "cuda")
    m0 = prr.block_metadata(k, bt, ln, block_size=64)
    s0 = prr.block_scores(q, m0, ln, block_size=64, group_reduce="sum")
    sel0 = prr.select_blocks(q, m0, 32, ln, block_size=64)
    for _ in range(100):
        m = prr.block_metadata(k, bt, ln, block_size=64)
        assert same_bits(m, m0)
        assert same_bits(prr.block_scores(q, m, ln, block_size=64, group_reduce="sum"), s0)
        assert torch.equal(prr.select_blocks(q, m, 32, ln, block_size=64), sel0)


def test_cuda_graph_capture_of_update_and_select_replays_identically():
    rng = np.random.default_rng(8)
    c = make_case(rng, B=4, Hkv=8, GQ=4, D=128, P=16, G=64, max_pages=256, dtype="bfloat16", lengths="full")
    k, bt, _, q = c.args("torch", "cuda")
    start = torch.tensor([100, 2000, 4095, 63], dtype=torch.int32, device="cuda")
    end = start + 1
    meta0 = prr.block_metadata(k, bt, start, block_size=64)
    static_q = q.clone()
    meta = meta0.clone()
    out = torch.empty(4, 8, 16, dtype=torch.int32, device="cuda")

    def step():
        prr.update_block_metadata(meta, k, bt, start, end, block_size=64)
        prr.select_blocks(static_q, meta, 16, end, block_size=64, out=out)

    step()  # eager
    want_meta, want = meta.clone(), out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        meta.copy_(meta0)
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        meta.copy_(meta0)
        out.fill_(7)
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(meta, want_meta) and torch.equal(out, want)
    # new inputs in the static buffers: the replay follows them
    static_q.copy_(torch.randn_like(static_q))
    end.add_(5)
    meta.copy_(meta0)
    g.replay()
    torch.cuda.synchronize()
    got_meta, got = meta.clone(), out.clone()
    meta.copy_(meta0)
    step()
    torch.cuda.synchronize()
    assert same_bits(got_meta, meta) and torch.equal(got, out)


def test_cuda_graph_capture_of_select_with_scores_out():
    rng = np.random.default_rng(13)
    c = make_case(rng, B=4, Hkv=8, GQ=4, D=128, P=16, G=64, max_pages=64, dtype="bfloat16")
    k, bt, ln, q = c.args("torch", "cuda")
    meta = prr.block_metadata(k, bt, ln, block_size=64)
    static_q = q.clone()
    out = torch.empty(4, 8, 16, dtype=torch.int32, device="cuda")
    so = torch.empty(4, 8, meta.shape[2], dtype=torch.float32, device="cuda")

    def step():
        prr.select_blocks(static_q, meta, 16, ln, block_size=64, out=out, scores_out=so)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(2):
        static_q.copy_(torch.randn_like(static_q))
        out.fill_(7)
        so.fill_(7.0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, prr.select_blocks(static_q, meta, 16, ln, block_size=64))
        assert same_bits(so, prr.block_scores(static_q, meta, ln, block_size=64))


def test_non_default_stream_and_stream_argument():
    rng = np.random.default_rng(9)
    c = make_case(rng, B=2, Hkv=2, GQ=4, D=64, P=16, G=16, max_pages=32, dtype="float16")
    k, bt, ln, q = c.args("torch", "cuda")
    want_m = prr.block_metadata(k, bt, ln, block_size=16)
    want = prr.select_blocks(q, want_m, 8, ln, block_size=16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k2 = k * 1  # producer work pending on s
        m = prr.block_metadata(k2, bt, ln, block_size=16)
        got = prr.select_blocks(q, m, 8, ln, block_size=16)
    s.synchronize()
    assert same_bits(m, want_m) and torch.equal(got, want)
    m = prr.block_metadata(k, bt, ln, block_size=16, stream=s)
    got = prr.select_blocks(q, m, 8, ln, block_size=16, stream=s)
    s.synchronize()
    assert same_bits(m, want_m) and torch.equal(got, want)


def _step(k, bt, start, end, q, meta):
    prr.update_block_metadata(meta, k, bt, start, end, block_size=16)
    return prr.select_blocks(q * 1.0, meta, 4, end, block_size=16), prr.block_scores(q, meta, end, block_size=16)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_matches_eager(backend):
    torch._dynamo.reset()
    rng = np.random.default_rng(10)
    c = make_case(rng, B=3, Hkv=2, GQ=4, D=128, P=16, G=16, max_pages=16, dtype="bfloat16", lengths="full")
    k, bt, _, q = c.args("torch", "cuda")
    start = torch.tensor([5, 100, 200], dtype=torch.int32, device="cuda")
    end = start + torch.tensor([1, 20, 56], dtype=torch.int32, device="cuda")
    m0 = prr.block_metadata(k, bt, start, block_size=16)
    m1 = m0.clone()
    want = _step(k, bt, start, end, q, m0)
    got = torch.compile(_step, fullgraph=True, backend=backend)(k, bt, start, end, q, m1)
    assert same_bits(m0, m1)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)


def _select_scores_out(q, meta, end, so):
    return prr.select_blocks(q, meta, 4, end, block_size=16, group_reduce="sum", scores_out=so)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_select_blocks_scores_out_matches_eager(backend):
    torch._dynamo.reset()
    rng = np.random.default_rng(14)
    c = make_case(rng, B=3, Hkv=2, GQ=4, D=128, P=16, G=16, max_pages=16, dtype="bfloat16", bad_pages=0.05)
    k, bt, ln, q = c.args("torch", "cuda")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    so_e = torch.full((3, 2, meta.shape[2]), 7.0, device="cuda")
    so_c = so_e.clone()
    want = _select_scores_out(q, meta, ln, so_e)
    got = torch.compile(_select_scores_out, fullgraph=True, backend=backend)(q, meta, ln, so_c)
    assert torch.equal(got, want)
    assert same_bits(so_c, so_e)
    assert same_bits(so_c, prr.block_scores(q, meta, ln, block_size=16, group_reduce="sum"))


def test_opcheck_cuda():
    rng = np.random.default_rng(11)
    c = make_case(rng, B=2, Hkv=2, GQ=2, D=64, P=16, G=16, max_pages=4, dtype="bfloat16")
    k, bt, ln, q = c.args("torch", "cuda")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    torch.library.opcheck(torch.ops.gvr.prr_block_metadata.default, (k, bt, ln, 16))
    torch.library.opcheck(torch.ops.gvr.prr_update_block_metadata.default, (meta.clone(), k, bt, ln // 2, ln, 16))
    torch.library.opcheck(torch.ops.gvr.prr_block_scores.default, (q, meta, ln, 16, "max", 1, 2))
    torch.library.opcheck(torch.ops.gvr.prr_select_scores.default, (q, meta, ln, 16, "max", 1, 2))


# --------------------------------------------------------------------------------------------------
# the CUDA path's limits, named
# --------------------------------------------------------------------------------------------------
def test_cuda_limits_are_named():
    rng = np.random.default_rng(12)
    c = make_case(rng, B=2, Hkv=2, GQ=2, D=64, P=16, G=16, max_pages=4, dtype="bfloat16")
    k, bt, ln, q = c.args("torch", "cuda")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    with pytest.raises(ValueError, match="k_cache"):
        prr.block_metadata(k.float(), bt, ln, block_size=16)
    with pytest.raises(ValueError, match="k_cache"):
        prr.block_metadata(k[..., :48], bt, ln, block_size=16)  # D = 48
    with pytest.raises(ValueError, match="k_cache"):
        prr.block_metadata(torch.empty(9 * 16 * 2 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(9, 16, 2, 64),
                           bt, ln, block_size=16)  # misaligned
    bad = torch.empty(2, 2, meta.shape[2], 2, 65, dtype=meta.dtype, device="cuda")[..., 1:]
    with pytest.raises(ValueError, match="out"):
        prr.block_metadata(k, bt, ln, block_size=16, out=bad)
    with pytest.raises(ValueError, match="meta"):
        prr.update_block_metadata(bad, k, bt, ln, ln, block_size=16)
    with pytest.raises(ValueError, match="meta"):
        prr.block_scores(q, bad, ln, block_size=16)
    with pytest.raises(ValueError, match="GQA"):
        prr.block_scores(torch.zeros(2, 66, 64, dtype=q.dtype, device="cuda"), meta, ln, block_size=16)
    with pytest.raises(ValueError, match="q"):
        prr.block_scores(q.float(), meta.float(), ln, block_size=16)
    with pytest.raises((ValueError, TypeError), match="lengths"):
        prr.block_metadata(k, bt, ln.cpu(), block_size=16)  # mixed devices


def test_bad_scores_out_on_cuda_is_named_and_nothing_is_modified():
    rng = np.random.default_rng(15)
    c = make_case(rng, B=2, Hkv=2, GQ=2, D=64, P=16, G=16, max_pages=4, dtype="bfloat16")
    k, bt, ln, q = c.args("torch", "cuda")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    Nb = meta.shape[2]
    out = torch.full((2, 2, 3), 99, dtype=torch.int32, device="cuda")
    snap = [x.clone() for x in (ln, q, meta, out)]
    bad = [
        (TypeError, torch.zeros(2, 2, Nb, dtype=torch.float64, device="cuda")),
        (TypeError, torch.zeros(2, 2, Nb, dtype=torch.bfloat16, device="cuda")),
        (ValueError, torch.zeros(2, 2, Nb + 1, device="cuda")),
        (ValueError, torch.zeros(2, 1, Nb, device="cuda")),
        (ValueError, torch.zeros(3, 2, Nb, device="cuda")),
        (ValueError, torch.zeros(2, 2, 2 * Nb, device="cuda")[..., ::2]),  # not unit stride along Nb
        ((ValueError, TypeError), torch.zeros(2, 2, Nb)),  # on the CPU while q is on CUDA
    ]
    for exc, so in bad:
        so_snap = so.clone()
        with pytest.raises(exc, match=r"\bscores_out\b"):
            prr.select_blocks(q, meta, 3, ln, block_size=16, out=out, scores_out=so)
        torch.cuda.synchronize()
        assert torch.equal(bits(so), bits(so_snap)), "a rejected scores_out was written"
    for a, b in zip(snap, (ln, q, meta, out)):
        assert torch.equal(bits(a), bits(b)) if a.is_floating_point() else torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# fp8 (e4m3fn) K caches and metadata
# --------------------------------------------------------------------------------------------------
FP8_PG = [(16, 16), (16, 64), (64, 16), (1, 16), (16, 1), (16, 48)]


def fp8_case(rng, dtype="bfloat16", **kw):
    return make_case(rng, dtype=dtype, kv_dtype=FP8, **kw)


def fp8_both_meta(c, lengths="case"):
    """(CUDA meta, CPU meta) of an fp8 case (lengths: the case's, or None / a CPU tensor), checked to be
    fp8 on their devices"""
    res = []
    for device in ("cuda", "cpu"):
        k, bt, ln, _ = c.args("torch", device)
        if lengths != "case":
            ln = None if lengths is None else lengths.to(device)
        res.append(prr.block_metadata(k, bt, ln, block_size=c.block_size))
    torch.cuda.synchronize()
    g, cpu = res
    assert g.dtype == cpu.dtype == torch.float8_e4m3fn and g.device.type == "cuda"
    return g, cpu


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("P,G", FP8_PG, ids=[f"P{p}-G{g}" for p, g in FP8_PG])
def test_fp8_metadata_matches_cpu_and_reference_bit_for_bit(P, G, D, layout):
    rng = np.random.default_rng(600 + P * 7 + G + D)
    c = fp8_case(rng, B=4, Hkv=2, D=D, P=P, G=G, max_pages=max(2, 256 // P), layout=layout, bad_pages=0.05,
                 specials=0.15, nans=64)
    g, cpu = fp8_both_meta(c)
    assert same_bits(g, cpu)
    assert np.array_equal(bits(g).numpy(), metadata_ref(c.k_cache, c.block_table, c.lengths, G))


def test_fp8_metadata_special_codes_and_empty_blocks():
    rng = np.random.default_rng(601)
    # mostly special codes (signed zeros, subnormals, +-448) and many NaN codes; an empty row, a short
    # row, pages out of range
    c = fp8_case(rng, B=4, Hkv=2, D=128, P=16, G=32, max_pages=16, specials=0.6, nans=3000,
                 lengths=[0, 256, 5, 200])
    c.block_table[1, 4:6] = -1  # row 1, block 2: both its pages out of range
    g, cpu = fp8_both_meta(c)
    assert same_bits(g, cpu)
    m = bits(g).numpy()
    assert np.array_equal(m, metadata_ref(c.k_cache, c.block_table, c.lengths, 32))
    for b, j in ((0, slice(None)), (1, 2), (2, slice(1, None)), (3, slice(7, None))):
        assert np.all(m[b, :, j, 0] == E4M3_EMPTY_MIN) and np.all(m[b, :, j, 1] == E4M3_EMPTY_MAX)
    assert np.isin(m[1, :, 0], [0x7F, 0xFF]).any()  # NaN codes reach the metadata of a non-empty block
    g2, cpu2 = fp8_both_meta(c, lengths=None)
    assert same_bits(g2, cpu2)


@pytest.mark.parametrize("P,G", [(16, 16), (16, 64), (64, 16), (8, 24)], ids=["P16-G16", "P16-G64", "P64-G16", "P8-G24"])
def test_fp8_update_matches_rebuild_and_cpu(P, G):
    rng = np.random.default_rng(602 + P + G)
    c = fp8_case(rng, B=4, Hkv=4, D=128, P=P, G=G, max_pages=max(4, 512 // P), bad_pages=0.05, lengths="full",
                 nans=200)
    k, bt, _, _ = c.args("torch", "cuda")
    kc, btc, _, _ = c.args("torch", "cpu")
    cap = bt.shape[1] * P
    cur = torch.tensor([0, 3, G, cap // 2], dtype=torch.int32)
    meta = prr.block_metadata(k, bt, cur.cuda(), block_size=G)
    meta_c = prr.block_metadata(kc, btc, cur, block_size=G)
    for step in [1, 1, G - 1, 2, 0, G + 3, 1, 5 * G, 300, cap]:
        new = torch.clamp(cur + torch.tensor([step, step, 1, 2 * step], dtype=torch.int32), max=cap).to(torch.int32)
        prr.update_block_metadata(meta, k, bt, cur.cuda(), new.cuda(), block_size=G)
        prr.update_block_metadata(meta_c, kc, btc, cur, new, block_size=G)
        want = prr.block_metadata(k, bt, new.cuda(), block_size=G)
        torch.cuda.synchronize()
        assert same_bits(meta, want), f"step {step}: CUDA update != CUDA rebuild"
        assert same_bits(meta, meta_c), f"step {step}: CUDA update != CPU update"
        cur = new


@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("GQ", [1, 4, 32])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_scores_match_cpu(dtype, D, GQ, reduce):
    rng = np.random.default_rng(603 + D + GQ)
    c = fp8_case(rng, dtype, B=3, Hkv=2, GQ=GQ, D=D, P=16, G=16, max_pages=40, bad_pages=0.05, nans=3)
    res, raw = [], []
    for device in ("cuda", "cpu"):
        k, bt, ln, q = c.args("torch", device)
        meta = prr.block_metadata(k, bt, ln, block_size=16)
        assert meta.dtype == torch.float8_e4m3fn
        res.append(prr.block_scores(q, meta, ln, block_size=16, group_reduce=reduce, keep_first=1, keep_last=2))
        raw.append(prr.block_scores(q, meta, ln, block_size=16, group_reduce=reduce))
    torch.cuda.synchronize()
    _, _, ln, q = c.args("torch", "cpu")
    check_scores_pair(res[0], res[1], q, meta, ln, 16, group_reduce=reduce, keep_first=1, keep_last=2)
    check_scores_pair(raw[0], raw[1], q, meta, ln, 16, group_reduce=reduce)


def test_fp8_scores_empty_rule_on_cuda():
    """channel 0 in totalOrder decides emptiness: (+NaN, -NaN) and (+0, -0) are empty, (-0, +0) is not"""
    rng = np.random.default_rng(604)
    c = fp8_case(rng, B=2, Hkv=2, GQ=4, D=64, P=16, G=16, max_pages=8, lengths="full", nans=4)
    k, bt, ln, q = c.args("torch", "cpu")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    u = meta.view(torch.uint8)
    u[0, :, 1, :, 0] = torch.tensor([0x00, 0x80], dtype=torch.uint8)  # (+0, -0): empty in totalOrder
    u[0, :, 2, :, 0] = torch.tensor([0x80, 0x00], dtype=torch.uint8)  # (-0, +0): not empty
    u[1, :, 3, :, 0] = torch.tensor([0x7F, 0x7F], dtype=torch.uint8)  # (+NaN, +NaN): not empty, NaN scores
    u[1, :, 4, :, 0] = torch.tensor([0x01, 0x00], dtype=torch.uint8)  # empty
    emp = empty_ref(meta)
    assert emp[0, :, 1].all() and not emp[0, :, 2].any() and not emp[1, :, 3].any() and emp[1, :, 4].all()
    for kw in (dict(), dict(group_reduce="sum", keep_first=2, keep_last=1)):
        sg = prr.block_scores(q.cuda(), meta.cuda(), ln.cuda(), block_size=16, **kw)
        sc = prr.block_scores(q, meta, ln, block_size=16, **kw)
        torch.cuda.synchronize()
        check_scores_pair(sg, sc, q, meta, ln, 16, **kw)
        assert torch.all(sc[0, :, 1] == -float("inf")) and torch.all(sc[1, :, 4] == -float("inf"))
        assert torch.isfinite(sc[0, :, 2]).all() and torch.isnan(sc[1, :, 3]).all()


@pytest.mark.parametrize("k", [0, 16, 3000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_select_blocks_matches_cpu(dtype, k):
    rng = np.random.default_rng(605 + k)
    c = fp8_case(rng, dtype, B=4, Hkv=4, GQ=4, D=128, P=16, G=64, max_pages=256, lengths=[4096, 4096 - 63, 1000, 0],
                 nans=2)
    res, so, scores = [], [], None
    for device in ("cuda", "cpu"):
        kk, bt, ln, q = c.args("torch", device)
        meta = prr.block_metadata(kk, bt, ln, block_size=64)
        out = torch.full((4, 4, meta.shape[2]), 7.0, device=device)
        res.append(prr.select_blocks(q, meta, k, ln, block_size=64, scores_out=out).cpu())
        so.append(out.cpu())
        scores = prr.block_scores(q, meta, ln, block_size=64, keep_first=1, keep_last=2).cpu()
        assert same_scores(out, prr.block_scores(q, meta, ln, block_size=64))
    assert same_scores(so[0], so[1])
    g, c_ = (torch.sort(torch.where(x < 0, 1 << 30, x), dim=-1).values for x in res)
    assert torch.equal(g, c_)
    want = select_ref(scores.numpy(), valid_blocks(c.lengths, 4, scores.shape[-1], 64), k)
    got = torch.where(g == 1 << 30, -1, g).numpy()
    assert np.array_equal(got, want)


def test_fp8_cuda_graph_capture_of_update_and_select_replays_identically():
    rng = np.random.default_rng(606)
    c = fp8_case(rng, B=4, Hkv=8, GQ=4, D=128, P=16, G=64, max_pages=256, lengths="full", nans=16)
    k, bt, _, q = c.args("torch", "cuda")
    start = torch.tensor([100, 2000, 4089, 63], dtype=torch.int32, device="cuda")  # end + 5 stays <= 4096
    end = start + 1
    meta0 = prr.block_metadata(k, bt, start, block_size=64)
    assert meta0.dtype == torch.float8_e4m3fn
    static_q = q.clone()
    meta = meta0.clone()
    out = torch.empty(4, 8, 16, dtype=torch.int32, device="cuda")
    so = torch.empty(4, 8, meta.shape[2], dtype=torch.float32, device="cuda")

    def step():
        prr.update_block_metadata(meta, k, bt, start, end, block_size=64)
        prr.select_blocks(static_q, meta, 16, end, block_size=64, out=out, scores_out=so)

    step()  # eager
    want_meta, want, want_so = meta.clone(), out.clone(), so.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        meta.copy_(meta0)
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        meta.copy_(meta0)
        out.fill_(7)
        so.fill_(7.0)
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(meta, want_meta) and torch.equal(out, want) and same_bits(so, want_so)
    # new inputs in the static buffers: the replay follows them
    static_q.copy_(torch.randn_like(static_q))
    end.add_(5)
    meta.copy_(meta0)
    g.replay()
    torch.cuda.synchronize()
    got_meta, got, got_so = meta.clone(), out.clone(), so.clone()
    meta.copy_(meta0)
    step()
    torch.cuda.synchronize()
    assert same_bits(got_meta, meta) and torch.equal(got, out) and same_bits(got_so, so)
    # and the CPU path agrees with the replay
    kc, btc, _, _ = c.args("torch", "cpu")
    mc = prr.block_metadata(kc, btc, start.cpu(), block_size=64)
    prr.update_block_metadata(mc, kc, btc, start.cpu(), end.cpu(), block_size=64)
    assert same_bits(got_meta, mc)
    assert same_scores(got_so, prr.block_scores(static_q.cpu(), mc, end.cpu(), block_size=64))


def _fp8_view(shape, last, offset=0):
    """a CUDA float8_e4m3fn view of ``shape`` over a buffer whose last dim is ``last`` (>= shape[-1]),
    starting ``offset`` bytes into it"""
    n = int(np.prod(shape[:-1])) * last
    buf = torch.zeros(n + 64, dtype=torch.uint8, device="cuda")[offset:offset + n]
    return buf.view(*shape[:-1], last)[..., :shape[-1]].view(torch.float8_e4m3fn)


def test_fp8_alignment_and_dtypes_on_cuda_are_named():
    rng = np.random.default_rng(607)
    c = fp8_case(rng, B=2, Hkv=2, GQ=2, D=64, P=16, G=16, max_pages=4)
    k, bt, ln, q = c.args("torch", "cuda")
    meta = prr.block_metadata(k, bt, ln, block_size=16)
    kshape, mshape = tuple(k.shape), tuple(meta.shape)
    snaps = [(x, x.clone()) for x in (k, bt, ln, q, meta)]
    # positive controls: a 16-byte multiple row pitch (80) and a 16-byte offset are fine
    k80 = _fp8_view(kshape, 80, 16)
    k80.copy_(k)
    assert same_bits(prr.block_metadata(k80, bt, ln, block_size=16), meta)
    m80 = _fp8_view(mshape, 80, 32)
    assert prr.block_metadata(k, bt, ln, block_size=16, out=m80) is m80 and same_bits(m80, meta)
    assert same_bits(prr.block_scores(q, m80, ln, block_size=16), prr.block_scores(q, meta, ln, block_size=16))
    # bfloat16 needs multiples of 8 elements only: a 72-element pitch is fine there
    kb = torch.zeros(*kshape[:-1], 72, dtype=torch.bfloat16, device="cuda")[..., :64]
    kb.copy_(k.float())
    prr.block_metadata(kb, bt, ln, block_size=16)
    torch.cuda.synchronize()
    # fp8: a 72-byte pitch, an 8-byte or 1-byte offset -> ValueError naming the tensor
    for last, off in ((72, 0), (64, 8), (64, 1), (80, 8)):
        kk = _fp8_view(kshape, last, off)
        kk.copy_(k)
        with pytest.raises(ValueError, match=r"\bk_cache\b"):
            prr.block_metadata(kk, bt, ln, block_size=16)
        with pytest.raises(ValueError, match=r"\bk_cache\b"):
            prr.update_block_metadata(meta.clone(), kk, bt, ln // 2, ln, block_size=16)
        bad = _fp8_view(mshape, last, off)
        bad.copy_(meta)
        snap = bits(bad)
        with pytest.raises(ValueError, match=r"\bout\b"):
            prr.block_metadata(k, bt, ln, block_size=16, out=bad)
        with pytest.raises(ValueError, match=r"\bmeta\b"):
            prr.update_block_metadata(bad, k, bt, ln // 2, ln, block_size=16)
        with pytest.raises(ValueError, match=r"\bmeta\b"):
            prr.block_scores(q, bad, ln, block_size=16)
        with pytest.raises(ValueError, match=r"\bmeta\b"):
            prr.select_blocks(q, bad, 2, ln, block_size=16)
        torch.cuda.synchronize()
        assert torch.equal(bits(bad), snap), f"a rejected fp8 view was written ({last}, {off})"
    # dtypes: meta neither q's nor fp8, fp8 cache with a bfloat16 meta / out
    m16 = torch.zeros(mshape, dtype=torch.float16, device="cuda")
    with pytest.raises(TypeError, match=r"\bmeta\b"):
        prr.block_scores(q, m16, ln, block_size=16)
    with pytest.raises(TypeError, match=r"\bmeta\b"):
        prr.select_blocks(q, meta.view(torch.float8_e5m2), 2, ln, block_size=16)
    with pytest.raises(TypeError, match=r"\bmeta\b"):
        prr.update_block_metadata(torch.zeros(mshape, dtype=torch.bfloat16, device="cuda"), k, bt, ln, ln,
                                  block_size=16)
    with pytest.raises(TypeError, match=r"\bout\b"):
        prr.block_metadata(k, bt, ln, block_size=16, out=torch.zeros(mshape, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="k_cache"):
        prr.block_metadata(k[..., :48], bt, ln, block_size=16)  # D = 48
    torch.cuda.synchronize()
    for x, snap in snaps:
        assert torch.equal(bits(x), bits(snap)) if x.is_floating_point() else torch.equal(x, snap)
