"""A small case of every CUDA kernel path (radix, GVR in registers, GVR streamed, sorted output, row
offsets; then sparse attention in both addressing modes with partials, prr.repair, merge_states,
prr.missed and prr.finalize at D = 64, 128, 256) for compute-sanitizer. Usage: compute-sanitizer --tool memcheck python scripts/sanitize_case.py"""
import argparse

import numpy as np
import torch

import gvr
from gvr import data

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--only", choices=("topk", "attention", "prr", "sparda"), help="run one operator's cases")
only = ap.parse_args().only

rng = np.random.default_rng(0)
if only in (None, "topk"):
    cases = []
    for N in (3000, 70001):  # 1-CTA rows, 16-CTA clusters
        x = rng.standard_normal((2, N)).astype(np.float32)
        x[1, ::3] = 0.25  # ties at the k-th value
        cases.append(x)
    cases.append(np.stack([data.adversarial("nan_heavy", 5000, k=64), data.adversarial("all_equal", 5000, k=64)]))
    cases.append(np.stack([data.adversarial("all_equal", 20001, k=64), data.adversarial("nan_heavy", 20001, k=64)]))
    # streamed GVR kernel: one CTA per row (300 rows), and 3-CTA clusters re-reading 200K rows in chunks
    cases.append(rng.standard_normal((300, 3000)).astype(np.float32))
    # streamed, the k-th below the verify pass's threshold (half of each row tied at 5.0 under a
    # bimodal sample whose normal-quantile estimate lands above every element): rounds from the row
    tied = rng.standard_normal((300, 3000)).astype(np.float32)
    tied[:, ::2] = 5.0
    cases.append(tied)
    cases.append(rng.standard_normal((40, 200001)).astype(np.float32))
    for x in cases:
        xg = torch.from_numpy(x).cuda()
        want = gvr.topk_decode(x, 64)
        n = x.shape[1]
        # full rows, a third, short rows (candidates only), rows of exactly k and fewer (every element)
        all_lengths = ([n, n // 3], [200, 0], [64, 50])
        for method in ("gvr", "radix"):
            for prev in (None, torch.from_numpy(want).cuda()):
                got = gvr.topk_decode(xg, 64, prev_topk=prev, method=method).cpu().numpy()
                assert (np.sort(got, 1) == np.sort(want, 1)).all(), (x.shape, method)
                for ln in all_lengths:
                    ln = np.resize(np.array(ln, dtype=np.int32), x.shape[0])  # one length per row
                    lengths = torch.from_numpy(ln).cuda()
                    got = gvr.topk_decode(xg, 64, prev_topk=prev, lengths=lengths, method=method, sorted=True).cpu().numpy()
                    exp = gvr.topk_decode(x, 64, lengths=ln, sorted=True)
                    assert (got == exp).all(), (x.shape, method, ln)
    # the streamed kernel's passes over its collected pairs in tiles of 256 and 512 per warp (k large
    # enough that the fullest warp of a 3-CTA cluster holds more than 128 / 256 pairs; at 16384 some
    # rows overflow a warp's segment of 512 and read the row again: replayed in NumPy)
    xl = rng.standard_normal((40, 200001)).astype(np.float32)
    xl[:, ::4] = np.round(xl[:, ::4] * 4) / 4
    for k in (8192, 16384):
        got = gvr.topk_decode(torch.from_numpy(xl).cuda(), k, method="gvr").cpu().numpy()
        assert (np.sort(got, 1) == np.sort(gvr.topk_decode(xl, k), 1)).all(), k
    # the streamed kernel's second collection pass (fewer than k at or above its threshold: N(0, 1) rows at
    # k = 2048), one that leaves fewer than k too (gap) and one that overflows the segments (lump), as in
    # tests/test_topk_gpu.py::test_streamed_collection_fallbacks (rows drawn alike, replayed in NumPy: 13, 40 and 25
    # of 40 rows take those paths)
    xs = rng.standard_normal((40, 200001)).astype(np.float32)
    smp = np.zeros(200001, bool)
    smp[(np.arange(256) * 200001) // 256] = True  # the kernel's strided sample
    gap = xs.copy()
    gap[(gap > 1.0) & (gap < 2.6) & ~smp] -= 3.0
    lump = xs.copy()
    lump[(lump > 0.9) & ~smp] = 2.25
    for x in (xs, gap, lump):
        got = gvr.topk_decode(torch.from_numpy(x).cuda(), 2048, method="gvr").cpu().numpy()
        assert (np.sort(got, 1) == np.sort(gvr.topk_decode(x, 2048), 1)).all()
    # rows starting 1..3 floats past a 16-byte boundary (aligned-coordinate loads: the first and last
    # float4 of a row are partial), one CTA and a cluster per row, every method
    for N in (3001, 40003):
        flat = rng.standard_normal(2 * (N + 1) + 3).astype(np.float32)
        fg = torch.from_numpy(flat).cuda()
        for s in (1, 2, 3):
            view = fg.as_strided((2, N), (N + 1, 1), s)
            x = view.cpu().numpy()
            want = gvr.topk_decode(x, 64)
            for method in ("auto", "gvr", "radix"):
                got = gvr.topk_decode(view, 64, method=method).cpu().numpy()
                assert (np.sort(got, 1) == np.sort(want, 1)).all(), (N, s, method)
    # the fused page-table transform (positions too), unsorted and sorted, every method
    bt = torch.randperm(2 * 70001 // 16 + 4, device="cuda")[: 70001 // 16 + 1].int()[None].repeat(2, 1)
    xs = torch.from_numpy(rng.standard_normal((2, 70001)).astype(np.float32)).cuda()
    for s in (False, True):
        for method in ("gvr", "radix"):
            pos = torch.empty(2, 300, dtype=torch.int32, device="cuda")
            slots = gvr.topk_decode(xs, 300, block_table=bt, page_size=16, out_positions=pos, sorted=s, method=method)
            want = bt.long().gather(1, pos.long() // 16) * 16 + pos.long() % 16
            assert torch.equal(slots.long(), want), (s, method)
    # ragged rows (row_starts, starts past the end clamped) and next_n = 2 per-request lengths and hint
    st = torch.tensor([0, 3, 69000, 80000], dtype=torch.int32, device="cuda")
    ln = torch.tensor([70001, 5000, 2000, 10], dtype=torch.int32, device="cuda")
    xr = torch.from_numpy(rng.standard_normal((4, 70001)).astype(np.float32)).cuda()
    prev2 = torch.randint(0, 70001, (2, 300), dtype=torch.int32, device="cuda")
    for s in (False, True):
        for method in ("gvr", "radix"):
            got = gvr.topk_decode(xr, 300, row_starts=st, lengths=ln, sorted=s, method=method).cpu().numpy()
            exp = gvr.topk_decode(xr.cpu().numpy(), 300, row_starts=np.array([0, 3, 69000, 70001], np.int32),
                                  lengths=np.array([70001, 5000, 1001, 0], np.int32), sorted=s)
            assert (np.array_equal(got, exp) if s else
                    all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got, exp))), (s, method)
            got = gvr.topk_decode(xr, 300, lengths=ln[:2], next_n=2, prev_topk=prev2, sorted=s, method=method)
    # half-precision scores read directly, rows starting at every offset from an 8-byte boundary
    for dt in (torch.float16, torch.bfloat16):
        xh = xr[:3].to(dt)
        for method in ("gvr", "radix"):
            got = gvr.topk_decode(xh, 300, row_starts=st[:3].clone(), lengths=ln[:3].clone(), sorted=True,
                                  method=method)
            exp = gvr.topk_decode(xh.float(), 300, row_starts=st[:3].clone(), lengths=ln[:3].clone(), sorted=True,
                                  method=method)
            assert torch.equal(got, exp), (dt, method)
    # the streamed kernel's staged first pass (asynchronous copies into shared memory) on half and float
    # rows at every phase of a 16-byte boundary (an odd stride), ragged lengths: 64 rows of 70001
    for dt in (torch.float16, torch.float32):
        flat = torch.from_numpy(rng.standard_normal(64 * 70003 + 8).astype(np.float32)).to(dt).cuda()
        view = flat.as_strided((64, 70001), (70003, 1), 1)
        ln = np.resize(np.array([70001, 70000, 8193, 8191, 300, 4], np.int32), 64)
        got = gvr.topk_decode(view, 64, lengths=torch.from_numpy(ln).cuda(), method="gvr").cpu().numpy()
        exp = gvr.topk_decode(view.float().cpu().numpy(), 64, lengths=ln)
        assert (np.sort(got, 1) == np.sort(exp, 1)).all(), dt
    torch.cuda.synchronize()
    print("sanitize case: top-k ok")

# ---- sparse attention, attention states, PRR repair ------------------------------------------------
if only in (None, "attention"):
    # small problems: block-table mode (G = 32 over P = 16 pages, a partial last block, -1 padding, entries
    # and table pages out of range) and slot mode (entries past the cache), partials, repair (one empty
    # selection), merge (in place, base 2), missed and finalize; each checked against the CPU path.
    dev = "cuda"
    for D, (P, G) in zip((64, 128, 256), ((16, 32), (64, 16), (1, 1))):
        B, Hkv, Hq, n = 3, 2, 8, 12
        cache = torch.randn(12, 2, P, Hkv, D, dtype=torch.bfloat16, device=dev)  # K and V views of one tensor
        k, v = cache[:, 0], cache[:, 1]
        q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
        max_pages = max(1, 96 // P)
        bt = torch.randint(0, 12, (B, max_pages), dtype=torch.int32, device=dev)
        bt[0, -1] = 12  # a page out of range (skipped)
        lengths = torch.tensor([max_pages * P - 3, 1, max_pages * P], dtype=torch.int32, device=dev)
        nblk = -(-max_pages * P // G)
        idx = torch.randint(0, nblk, (B, Hkv, n), dtype=torch.int32, device=dev)
        idx[:, :, ::5] = -1
        idx[0, 0, 1] = nblk + 3
        idx[1, 1, 2] = 2**31 - 1
        for paged in (True, False):
            if paged:
                kw = dict(block_table=bt, lengths=lengths, block_size=G)
                sel = idx
            else:
                kw = {}
                sel = torch.randint(0, 12 * P + 5, (B, 1, n), dtype=torch.int32, device=dev)  # some past the cache
            Hsel = sel.shape[1]
            po = torch.empty(B, Hq, n, D, device=dev)
            pl = torch.empty(B, Hq, n, device=dev)
            out, lse = gvr.sparse_attention(q, k, v, sel, partials=(po, pl), out=torch.empty(B, Hq, D, device=dev), **kw)
            cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
            ckw = {name: cpu(t) if isinstance(t, torch.Tensor) else t for name, t in kw.items()}
            c_out, c_lse = gvr.sparse_attention(q.cpu(), k.cpu(), v.cpu(), sel.cpu(), out=torch.empty(B, Hq, D), **ckw)
            assert torch.allclose(out.cpu(), c_out, atol=2e-2, rtol=2e-2), (D, paged)
            assert torch.equal(lse.cpu() == float("-inf"), c_lse == float("-inf")), (D, paged)
            assert torch.allclose(lse.cpu()[c_lse > float("-inf")], c_lse[c_lse > float("-inf")], atol=2e-2), (D, paged)
            missed_sel = torch.flip(sel, dims=(2,)).contiguous()
            miss = gvr.prr.missed(missed_sel, sel)
            assert torch.equal(miss.cpu(), gvr.prr.missed(missed_sel.cpu(), sel.cpu())), (D, paged)
            f_out, f_lse = gvr.prr.finalize((po, pl), sel, missed_sel)
            gvr.prr.repair(f_out, f_lse, q, k, v, miss, **kw)
            gvr.prr.repair(f_out, f_lse, q, k, v, torch.full((B, Hsel, 4), -1, dtype=torch.int32, device=dev), **kw)
            # the fused repair: exclusion rows of 5 and of 70 entries (past the 64 held in registers), counts,
            # the result cast; equal to the repair over missed() above up to rounding, counts exact
            for nx in (5, 70):
                excl = torch.randint(-1, nblk + 2 if paged else 12 * P, (B, Hsel, nx), dtype=torch.int32, device=dev)
                a_out, a_lse = f_out.clone(), f_lse.clone()
                b_out, b_lse = f_out.clone(), f_lse.clone()
                cnt = torch.zeros(4, dtype=torch.int64, device=dev)
                cast = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev)
                gvr.prr.repair(a_out, a_lse, q, k, v, gvr.prr.missed(missed_sel, excl), **kw)
                gvr.prr.repair(b_out, b_lse, q, k, v, missed_sel, exclude=excl, counts=cnt, cast_out=cast, **kw)
                assert torch.allclose(a_out, b_out, atol=1e-5, rtol=1e-5), (D, paged, nx)
                assert torch.equal(cast, b_out.to(torch.bfloat16)), (D, paged, nx)
                ref = torch.zeros(4, dtype=torch.int64)
                gvr.prr.missed(missed_sel.cpu(), excl.cpu(), counts=ref)
                assert cnt.cpu().tolist() == ref[:2].tolist() * 2, (D, paged, nx, cnt, ref)
            m_out, m_lse = gvr.merge_states(out, lse, f_out, f_lse)
            gvr.merge_states_in_place(m_out, m_lse, out, lse, lse_base="2")
            o0, l0 = out[0], lse[0]
            gvr.merge_states(o0, l0, f_out[0], f_lse[0], out=o0, lse=l0)  # [H, D], aliased
    # fp8 (e4m3fn) caches with k_scale / v_scale: K and V views of one fp8 tensor (NaN codes in a few
    # tokens), long enough to split (and merge in a cluster) at B = 1, partials, the fused repair
    for D in (64, 128, 256):
        P, G, Hkv, Hq = 16, 16, 2, 8
        cache8 = (torch.randn(40, 2, P, Hkv, D, device=dev) * 4).to(torch.float8_e4m3fn)
        cache8.view(torch.uint8)[3, :, 5, 0, :4] = 0x7F  # NaN codes
        k8, v8 = cache8[:, 0], cache8[:, 1]
        for B, n in ((1, 40), (3, 6)):
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
            bt = torch.randint(0, 40, (B, 40), dtype=torch.int32, device=dev)
            lengths = torch.full((B,), 40 * P - 7, dtype=torch.int32, device=dev)
            sel = torch.randint(-1, 40, (B, Hkv, n), dtype=torch.int32, device=dev)
            kw = dict(block_table=bt, lengths=lengths, block_size=G, k_scale=0.7, v_scale=1.3)
            ckw = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in kw.items()}
            out, lse = gvr.sparse_attention(q, k8, v8, sel, out=torch.empty(B, Hq, D, device=dev), **kw)
            c_out, c_lse = gvr.sparse_attention(q.cpu(), k8.cpu(), v8.cpu(), sel.cpu(), out=torch.empty(B, Hq, D), **ckw)
            assert torch.allclose(out.cpu(), c_out, atol=2e-2, rtol=2e-2, equal_nan=True), (D, B, "fp8")
            po = torch.empty(B, Hq, n, D, device=dev)
            pl = torch.empty(B, Hq, n, device=dev)
            gvr.sparse_attention(q, k8, v8, sel, partials=(po, pl), out=torch.empty(B, Hq, D, device=dev), **kw)
            so, sl = out.clone(), lse.clone()
            cnt = torch.zeros(2, dtype=torch.int64, device=dev)
            gvr.prr.repair(so, sl, q, k8, v8, torch.flip(sel, dims=(2,)).contiguous(), exclude=sel[:, :, :3].contiguous(),
                           counts=cnt, cast_out=torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev), **kw)
    torch.cuda.synchronize()
    print("sanitize case: attention ok")

# ---- PRR runtime pieces: Quest metadata / update / scores / selection, EMA predictor, calibration, a step ----
if only in (None, "prr"):
    from gvr import _prr_runtime as R
    dev = "cuda"
    Hq, Hkv, D, P, G = 8, 2, 64, 16, 32
    B, max_pages = 2, 24
    num_pages = B * max_pages + 1
    K = torch.randn(num_pages, P, Hkv, D, dtype=torch.bfloat16, device=dev)
    V = torch.randn(num_pages, P, Hkv, D, dtype=torch.bfloat16, device=dev)
    bt = torch.randperm(num_pages, device=dev)[: B * max_pages].int().reshape(B, max_pages)
    lengths = torch.tensor([max_pages * P - 5, 40], dtype=torch.int32, device=dev)
    meta = gvr.prr.block_metadata(K, bt, lengths, block_size=G)
    cmeta = gvr.prr.block_metadata(K.cpu(), bt.cpu(), lengths.cpu(), block_size=G)
    assert torch.equal(meta.cpu(), cmeta), "block_metadata"
    old = lengths.clone()
    lengths += 3
    gvr.prr.update_block_metadata(meta, K, bt, old, lengths, block_size=G)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)
    for reduce in ("max", "sum"):
        sc = gvr.prr.block_scores(q, meta, lengths, block_size=G, group_reduce=reduce, keep_first=1, keep_last=1)
        sel = gvr.prr.select_blocks(q, meta, 5, lengths, block_size=G, group_reduce=reduce)
        csel = gvr.prr.select_blocks(q.cpu(), meta.cpu(), 5, lengths.cpu(), block_size=G, group_reduce=reduce)
        assert torch.equal(torch.sort(sel.cpu(), -1).values, torch.sort(csel, -1).values), ("select_blocks", reduce)
    # fp8 (e4m3fn) K: metadata (build, update) and scores / selection over it, against the CPU
    K8 = (K.float() * 20).clamp_(-448, 448).to(torch.float8_e4m3fn)
    K8.view(torch.uint8)[3, 2, 0, :5] = 0x7F  # NaN codes
    m8 = gvr.prr.block_metadata(K8, bt, old, block_size=G)
    gvr.prr.update_block_metadata(m8, K8, bt, old, lengths, block_size=G)
    cm8 = gvr.prr.block_metadata(K8.cpu(), bt.cpu(), lengths.cpu(), block_size=G)
    assert torch.equal(m8.view(torch.uint8).cpu(), cm8.view(torch.uint8)), "block_metadata fp8"
    s8 = gvr.prr.block_scores(q, m8, lengths, block_size=G, keep_first=1, keep_last=1)
    cs8 = gvr.prr.block_scores(q.cpu(), cm8, lengths.cpu(), block_size=G, keep_first=1, keep_last=1)
    assert torch.equal(s8.cpu().nan_to_num(nan=7.0), cs8.nan_to_num(nan=7.0)), "block_scores fp8"
    Nb = meta.shape[2]
    ema = gvr.prr.EMAPredictor(B, Hkv, Nb, device=dev)
    nblk = (lengths + G - 1) // G
    for _ in range(3):
        scores = torch.randn(B, Hkv, Nb, device=dev)
        pred = ema.predict(4, nblk)
        ema.update(scores, nblk)
    tr = torch.randn(40, 300, device=dev)  # [T, Nb] calibration trace
    assert gvr.prr.calibrate(tr, 16) == gvr.prr.calibrate(tr.cpu(), 16), "calibrate"
    c_max_blocks = max_pages * P // G
    for mode in ("exact", "superset"):
        sa = R.SpeculativeAttention(B, Hq, Hkv, D, c_max_blocks, block_size=G, k=4, mode=mode, device=dev,
                                    dtype="bfloat16")
        select = R.quest_select(meta, 4, lengths, block_size=G)
        for _ in range(3):
            out, lse = sa.step(q, K, V, bt, lengths, select)
    torch.cuda.synchronize()
    print("sanitize case: prr ok")

# ---- SparDA: compressed keys (build, update; a page out of range), forecast_select ----
if only in (None, "sparda"):
    dev = "cuda"
    K = torch.randn(40, 64, 2, 128, dtype=torch.bfloat16, device=dev)
    bt = torch.randperm(40, device=dev)[:30].int().view(2, 15)
    bt[1, 3] = 77
    ln = torch.tensor([15 * 64, 500], dtype=torch.int32, device=dev)
    kt = gvr.sparda.compressed_keys(K, bt, ln)
    want = gvr.sparda.compressed_keys(K.cpu(), bt.cpu(), ln.cpu())
    assert torch.equal(kt.cpu(), want), "compressed_keys"
    gvr.sparda.update_compressed_keys(kt, K, bt, ln - 100, ln)
    F = torch.randn(2, 2, 128, dtype=torch.bfloat16, device=dev)
    gvr.sparda.forecast_select(F, kt, 8, lengths=ln)
    torch.cuda.synchronize()
    # prefetch (plan + UVA gather kernels, copy engines) and the KV store, against the C path
    cache = gvr.sparda.HostKVCache(1, 50, 16, 2, 64, torch.bfloat16, device="cuda")
    hk, hv = cache.k(0), cache.v(0)
    tok = torch.randn(100, 2, 64, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(800, device=dev)[:100]
    slots[7] = slots[3]  # a duplicate: the later token wins
    slots[9] = -1
    cache.append(0, tok, tok * 2, slots)
    torch.cuda.synchronize()
    ix = torch.tensor([[[3, 9, -1, 3, 40], [1, 2, 3, 4, 60]], [[0, 5, 7, 7, 7], [8, 9, 10, 11, 12]]],
                      dtype=torch.int32)
    bt = torch.randperm(50)[:40].int().view(2, 20)
    bt[0, 9] = -1
    S = 24
    dk, dv = (torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16, device=dev) for _ in range(2))
    hdk, hdv = (torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    m = gvr.sparda.prefetch(hk, hv, ix.to(dev), dk, dv, block_table=bt.to(dev), method="kernel", max_ctas=3)
    want = gvr.sparda.prefetch(hk, hv, ix, hdk, hdv, block_table=bt)
    m2 = gvr.sparda.prefetch(hk, hv, (ix + 1).to(dev), dk, dv, block_table=bt.to(dev), resident=m)
    gvr.sparda.prefetch(hk, hv, ix + 1, dk, dv, block_table=bt, resident=m.cpu(), method="memcpy")
    for warps, loads in ((1, 4), (3, 8)):  # slim gather CTAs
        m3 = gvr.sparda.prefetch(hk, hv, ix.to(dev), dk, dv, block_table=bt.to(dev), max_ctas=5, cta_warps=warps,
                                 lane_loads=loads)
    m4 = gvr.sparda.prefetch(hk, hv, ix.to(dev), dk, dv, block_table=bt.to(dev), method="tma", max_ctas=3)
    torch.cuda.synchronize()
    assert torch.equal(m3.cpu(), want), "prefetch slot map (slim CTAs)"
    assert torch.equal(m4.cpu(), want), "prefetch slot map (bulk copies)"
    assert torch.equal(m.cpu(), want), "prefetch slot map"
    del hk, hv
    print("sanitize case: prefetch ran")
    del cache  # freed with its last reference (close() is tested in tests/test_sparda_prefetch.py)
    print("sanitize case: sparda ok")
print("sanitize case ok")
