"""gvr.sparda.Prefetcher, SparDA's persistent prefetcher: requests land in submission order and equal the
stream-ordered prefetch's C path (slot maps and staged bytes) over a chain of resident maps; close() with
requests in flight drains them; the watchdog turns a request that never completes into an error; bad use
is named; a CUDA graph captured before the kernel starts replays while it runs; slim CTA shapes. GPU
tests allocate everything before the prefetcher starts and synchronize on streams only (an allocation or
a device-wide synchronization waits for the persistent kernel: documented), and close it in a finally.
They run in `scripts/gpu_check.sh prefetcher` (GVR_TEST_PREFETCHER=1), apart, with a short timeout: a
persistent kernel that hangs must not stall a whole GPU test run."""
import os

import pytest

import gvr
from harness import gpu_skip_reason, torch_or_none

torch = torch_or_none()


@pytest.fixture
def gpu_run():
    """the GPU tests run only where asked (scripts/gpu_check.sh prefetcher sets GVR_TEST_PREFETCHER=1): a hang
    of an unverified persistent kernel must not stall a whole GPU test run"""
    if os.environ.get("GVR_TEST_PREFETCHER") != "1":
        pytest.skip("the Prefetcher's GPU tests run in `scripts/gpu_check.sh prefetcher` (GVR_TEST_PREFETCHER=1)")


def test_needs_cuda_cleanly():
    if torch is None:
        pytest.skip("needs torch")
    if gpu_skip_reason() is None:
        pytest.skip("this machine has a GPU: the GPU tests cover it")
    with pytest.raises((RuntimeError, ValueError)):
        gvr.sparda.Prefetcher(staging_pages=4, batch=1, max_pages=4, entries=4)


def test_argument_checks():
    if torch is None:
        pytest.skip("needs torch")
    with pytest.raises(ValueError, match="'depth'"):
        gvr.sparda.Prefetcher("cuda", staging_pages=4, batch=1, max_pages=4, entries=4, depth=0)
    with pytest.raises(TypeError, match="'ctas'"):
        gvr.sparda.Prefetcher("cuda", staging_pages=4, batch=1, max_pages=4, entries=4, ctas=2.0)
    with pytest.raises(ValueError, match="'cta_warps' must be 1..8"):
        gvr.sparda.Prefetcher("cuda", staging_pages=4, batch=1, max_pages=4, entries=4, cta_warps=9)
    with pytest.raises(ValueError, match="'lane_loads' must be 4, 8 or 16"):
        gvr.sparda.Prefetcher("cuda", staging_pages=4, batch=1, max_pages=4, entries=4, lane_loads=5)


def _case(seed, P=16, Hkv=2, D=64, pages=96, B=2, maxp=40):
    g = torch.Generator().manual_seed(seed)
    cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, torch.bfloat16, device="cuda")
    cache.k(0).copy_(torch.randn(cache.k(0).shape, generator=g).to(torch.bfloat16))
    cache.v(0).copy_(torch.randn(cache.v(0).shape, generator=g).to(torch.bfloat16))
    bt = torch.stack([torch.randperm(pages, generator=g)[:maxp] for _ in range(B)]).int()
    bt[1, 7] = -1
    return cache, bt, g


def _selection(g, B, n, maxp):
    ix = torch.stack([torch.randperm(maxp, generator=g)[:n] for _ in range(B)]).int().view(B, 1, n)
    ix[0, 0, -1] = -1
    return ix


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(None, None), (1, 4), (2, 8)])
def test_requests_land_in_order_and_equal_the_c_path(gpu_run, shape):
    cache, bt, g = _case(1)
    B, n, maxp, S, steps = 2, 12, 40, 32, 40
    hk, hv = cache.k(0), cache.v(0)
    dk = torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    dv = torch.zeros_like(dk)
    ck, cv = torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16)
    sels = []
    for step in range(steps):
        ix = _selection(g, B, n, maxp)
        if step % 3:
            ix[:, :, : n // 2] = sels[-1][:, :, : n // 2]
        sels.append(ix)
    # everything on the device before the prefetcher starts (an allocation while it runs would wait for it)
    sels_d = [ix.cuda() for ix in sels]
    maps = [torch.empty(B, maxp, dtype=torch.int32, device="cuda") for _ in range(steps)]
    btd = bt.cuda()
    torch.cuda.synchronize()
    pf = gvr.sparda.Prefetcher(staging_pages=S, batch=B, max_pages=maxp, entries=n, ctas=8, depth=4,
                               cta_warps=shape[0], lane_loads=shape[1])
    try:
        res, tickets = None, []
        for step in range(steps):  # 10x the queue's depth: submits wait for free slots
            m, tk = pf.submit(hk, hv, sels_d[step], dk, dv, block_table=btd, resident=res, slot_map_out=maps[step])
            tickets.append(tk)
            res = m
        pf.wait(tickets[-1])
        torch.cuda.current_stream().synchronize()
        pf.check()
    finally:
        pf.close()
    cres = None
    for step in range(steps):
        want = gvr.sparda.prefetch(hk, hv, sels[step], ck, cv, block_table=bt, resident=cres)
        assert torch.equal(maps[step].cpu(), want), f"slot map of request {step}"
        cres = want
    live = cres[cres >= 0].long()
    assert torch.equal(dk.cpu()[live].view(torch.int16), ck[live].view(torch.int16))
    assert torch.equal(dv.cpu()[live].view(torch.int16), cv[live].view(torch.int16))
    del hk, hv
    cache.close()


@pytest.mark.gpu
def test_close_with_requests_in_flight_drains_them(gpu_run):
    cache, bt, g = _case(2)
    B, n, maxp, S = 2, 12, 40, 24
    hk, hv = cache.k(0), cache.v(0)
    stages = [(torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16, device="cuda"),
               torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16, device="cuda")) for _ in range(6)]
    sels = [_selection(g, B, n, maxp) for _ in range(6)]
    sels_d = [ix.cuda() for ix in sels]
    maps = [torch.empty(B, maxp, dtype=torch.int32, device="cuda") for _ in range(6)]
    btd = bt.cuda()
    torch.cuda.synchronize()
    pf = gvr.sparda.Prefetcher(staging_pages=S, batch=B, max_pages=maxp, entries=n, ctas=4, depth=8)
    try:
        for (dk, dv), ix, m in zip(stages, sels_d, maps):  # six requests, nobody waits for them
            pf.submit(hk, hv, ix, dk, dv, block_table=btd, slot_map_out=m)
    finally:
        pf.close()  # drains the queue before it stops
    assert pf.closed
    for (dk, dv), ix, m in zip(stages, sels, maps):
        ck, cv = torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16)
        want = gvr.sparda.prefetch(hk, hv, ix, ck, cv, block_table=bt)
        assert torch.equal(m.cpu(), want)
        live = want[want >= 0].long()
        assert torch.equal(dk.cpu()[live].view(torch.int16), ck[live].view(torch.int16))
    with pytest.raises(ValueError, match="closed"):
        pf.submit(hk, hv, sels_d[0], *stages[0], block_table=btd, slot_map_out=maps[0])
    pf.close()  # twice: nothing
    del hk, hv
    cache.close()


@pytest.mark.gpu
def test_watchdog_turns_a_stuck_request_into_an_error(gpu_run):
    never = torch.tensor([10 ** 6], dtype=torch.int64, device="cuda")  # a ticket no request will reach
    torch.cuda.synchronize()
    pf = gvr.sparda.Prefetcher(staging_pages=4, batch=1, max_pages=4, entries=4, ctas=2, depth=2, timeout_s=0.2)
    try:
        pf.wait(never)
        torch.cuda.current_stream().synchronize()  # the wait kernel gives up after 0.2 s
        with pytest.raises(RuntimeError, match="did not complete"):
            pf.check()
        with pytest.raises(RuntimeError, match="watchdog"):
            pf.wait(never)
    finally:
        pf.close()


@pytest.mark.gpu
def test_many_prefetchers_open_and_close(gpu_run):
    for ctas in (1, 16, 64):
        with gvr.sparda.Prefetcher(staging_pages=8, batch=1, max_pages=8, entries=8, ctas=ctas) as pf:
            assert not pf.closed
        assert pf.closed
    torch.cuda.synchronize()  # nothing left running


@pytest.mark.gpu
def test_graph_captured_before_start_replays_while_it_runs(gpu_run):
    """two (submit, wait) pairs captured before the kernel starts (torch.cuda.graph synchronizes the
    device), replayed three times while it runs with new selections copied in: every replay's slot maps
    and staged bytes equal the C path's chain"""
    cache, bt, g = _case(3)
    B, n, maxp, S, R = 2, 12, 40, 32, 3
    hk, hv = cache.k(0), cache.v(0)
    dk = torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    dv = torch.zeros_like(dk)
    btd = bt.cuda()
    ix = [torch.zeros(B, 1, n, dtype=torch.int32, device="cuda") for _ in range(2)]
    maps = [torch.full((B, maxp), -1, dtype=torch.int32, device="cuda") for _ in range(2)]
    sels = [[_selection(g, B, n, maxp) for _ in range(2)] for _ in range(R)]
    sels_d = [[x.cuda() for x in row] for row in sels]
    got_maps = [[torch.empty(B, maxp, dtype=torch.int32, device="cuda") for _ in range(2)] for _ in range(R)]
    got_k = [torch.empty_like(dk) for _ in range(R)]
    got_v = [torch.empty_like(dk) for _ in range(R)]
    torch.cuda.synchronize()
    pf = gvr.sparda.Prefetcher(staging_pages=S, batch=B, max_pages=maxp, entries=n, ctas=4, depth=4, start=False)
    try:
        assert not pf.started
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=side):
            for i in range(2):
                _, tk = pf.submit(hk, hv, ix[i], dk, dv, block_table=btd, resident=maps[1 - i], slot_map_out=maps[i])
                pf.wait(tk)
        for x in maps:  # the captured calls did not run: the chain starts from empty staging
            x.fill_(-1)
        torch.cuda.synchronize()
        pf.start()
        assert pf.started
        main = torch.cuda.current_stream()
        for r in range(R):  # device-to-device copies and a replay: nothing allocated, nothing loaded
            for i in range(2):
                ix[i].copy_(sels_d[r][i])
            graph.replay()
            for i in range(2):
                got_maps[r][i].copy_(maps[i])
            got_k[r].copy_(dk)
            got_v[r].copy_(dv)
        main.synchronize()
        pf.check()
    finally:
        pf.close()
    cres = None
    ck, cv = torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(S, 16, 2, 64, dtype=torch.bfloat16)
    for r in range(R):
        for i in range(2):
            want = gvr.sparda.prefetch(hk, hv, sels[r][i], ck, cv, block_table=bt, resident=cres)
            assert torch.equal(got_maps[r][i].cpu(), want), f"replay {r}, call {i}"
            cres = want
        live = cres[cres >= 0].long()
        assert torch.equal(got_k[r].cpu()[live].view(torch.int16), ck[live].view(torch.int16))
        assert torch.equal(got_v[r].cpu()[live].view(torch.int16), cv[live].view(torch.int16))
    del hk, hv
    cache.close()
