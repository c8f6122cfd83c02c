"""gvr.sparda.prefetch (issue 14): host -> device gathers of selected KV blocks from pinned host memory.

Sections (CUDA events around each eager call, end to end: plan + moves, the wrapper's host time included
when the GPU would wait for it; median us; GB/s = K + V bytes moved / time):
  gather    blocks of 64 tokens x Hkv 8 x D 128 x bf16 (128 KiB per page of K, as much of V) and of 16
            tokens, 1..2048 blocks at random host pages, per method: kernel (UVA gather, 16 CTAs, eager),
            kernel_graph (the same in a CUDA graph: device time, no host work), tma_graph (the bulk-copy
            gather, 2 CTAs, in a graph), kernel64 (64 CTAs), memcpy
            (host plan, cudaMemcpyBatchAsync), torch (one copy_ per block: what a torch user writes),
            against contiguous (one copy_ of the same bytes from a pinned tensor: the ceiling)
  matmul    the slowdown of a concurrent bf16 matmul (8192^3) while each method gathers 512 64-token
            blocks in a loop on a second stream
  resident  bytes moved with 60% of the selected blocks resident (resident= the previous slot map)
  shapes    the gather kernel's CTA shapes (CTAs x warps x 16-byte loads in flight per lane): GB/s of 32 and
            512 blocks (graph) and the slowdown of the concurrent matmul; an idle persistent Prefetcher's
            slowdown of it (its CTAs hold their registers while they spin); with --sm-carveout LIST, the
            matmul under each shape's gathers with cuBLAS(Lt) kept off that many SMs (torch's experimental
            carveout): slowdown against the default matmul alone
  pipeline  a 4-layer decode at 128K tokens (B 1, Hq 32, Hkv 8, D 128, P 64): per layer, forecast_select of
            the next layer's 32 blocks, their prefetch, sparse_attention over the staged blocks + the
            layer's matmuls -- "light": one 4096x28672 matmul (235 MB), "8b": a Llama-3-8B layer's QKV,
            O, gate+up and down projections (436 MB). Schedules: sync (one stream); async (at the start
            of layer l, select(l + 1) on the main stream and its prefetch on a second stream); async3
            (select(l + 1) on a third stream alongside layer l, the prefetch after it on the second);
            Prefetcher (async3 with the persistent Prefetcher's submit instead of the prefetch; a graph
            captured before it starts). Hidden = (sync - schedule) / transfer, transfer = select +
            prefetch alone of all layers; async4 (tma): async3 with the layer's matmuls after the next
            layer's selection; "ahead": of layers 1..L-1, those with a layer to hide behind
            (layer 0 has none: SparDA selects it in the same layer, paper 004 section 4.6)
  prefetcher  the persistent Prefetcher (16 CTAs, started once) against the stream-ordered prefetch,
            eager, 64-token blocks: submit + wait vs prefetch, timed with events
  fp8       the same gathers from an fp8 (e4m3fn) host cache against a bfloat16 one (64-token blocks,
            8..512 blocks; tma and kernel in a graph, memcpy eager): half the bytes, how much of the time
  pipefp8   the pipeline (no Prefetcher) over fp8 (e4m3fn) host and staging caches, attention with k_scale /
            v_scale, beside the same run with bfloat16 caches; each with the side streams at the default
            and at high priority
  pipeparts the light layer's pipeline (fp8 and bfloat16) with each half of the transfer alone -- the
            selections without the prefetches, the prefetches without new selections -- in sync, async3
            and transfer-only schedules (tma): which half stays exposed
  select    forecast_select on the device, graph-replayed (warm), µs per call: gvr (the window counts
            inside the scores kernel: scores + Top-K, two kernels), "counts first" (the window counts by
            torch ops before select_blocks: the chain before session 18, eight kernels), torch (a bf16
            matmul, the keep ranges, torch.topk); alone, and beside a 4096x28672 bf16 GEMV (235 MB) on
            the main stream, the selection enqueued first on a side stream (as the pipelines' async3):
            exposed = that graph's time - the GEMV's alone
Every gather is checked byte for byte against the host pages. While a Prefetcher runs nothing allocates
and nothing synchronizes the device. Usage: python benchmarks/bench_sparda.py [--json PATH] [--quick]
[--only prefetcher|shapes|pipeline|fp8|pipefp8|pipeparts|select] [--sm-carveout 0,2,4] [--timeline PREFIX]
[--kv fp8 bfloat16] [--rounds R] [--priorities 0 -1] (pipefp8 with --rounds R: each pipeline's hidden share
over R interleaved rounds, median and range; single graph timings scatter by 10 points and more)
"""
import argparse
import contextlib
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _harness as H  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer block counts, no pipeline")
    ap.add_argument("--only", choices=("prefetcher", "shapes", "pipeline", "fp8", "pipefp8", "pipeparts", "select"),
                    default=None, help="one section: the eager Prefetcher timing, the gather CTA shapes, the "
                    "pipelines, fp8 vs bfloat16 gathers, the pipelines over fp8 host caches, the light layer's "
                    "transfer halves, or forecast_select's timing")
    ap.add_argument("--timeline", default=None, metavar="PREFIX",
                    help="pipeparts: also one replay of each light pipeline's async3 (tma) graph under torch.profiler "
                         "-> PREFIX_light_KV.txt (kernels in time order, per stream) and .json (Chrome trace)")
    ap.add_argument("--sm-carveout", default="", metavar="LIST",
                    type=lambda v: tuple(int(x) for x in v.split(",") if x.strip()),
                    help="shapes: also the matmul under each shape's gathers with cuBLAS kept off this many SMs "
                         "(comma-separated, e.g. 0,2,4; torch's experimental SM carveout with cuBLASLt); pipeparts, "
                         "pipefp8: each pipeline again with each carveout (the layers' GEMVs off those SMs)")
    ap.add_argument("--kv", nargs="+", choices=("fp8", "bfloat16"), default=("fp8", "bfloat16"),
                    help="pipeparts, pipefp8: the KV caches' dtypes to run (default both)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="pipefp8: also each pipeline's async3 hidden share over R interleaved rounds (median, "
                         "min, max)")
    ap.add_argument("--priorities", nargs="+", type=int, default=(0, -1), metavar="P",
                    help="pipefp8: the side streams' priorities to run (default 0 -1)")
    args = ap.parse_args()
    gvr = H.import_gvr(ROOT)
    import gvr.sparda  # noqa: F401
    import torch
    timer = H.CudaTimer(torch, flush_bytes=0)
    meta = H.header(torch, ROOT, cuda=True)
    print(H.header_line(meta))
    dev = torch.device("cuda")
    if args.only:
        if args.only == "prefetcher":
            r = {"header": meta, "prefetcher": persistent(gvr, torch)}
        elif args.only == "shapes":
            r = {"header": meta, "shapes": shapes(gvr, torch, timer, carveouts=args.sm_carveout)}
        elif args.only == "fp8":
            r = {"header": meta, "fp8": fp8_gathers(gvr, torch, timer)}
        elif args.only == "select":
            r = {"header": meta, "select": selections(gvr, torch, timer)}
        elif args.only == "pipeparts":
            r = {"header": meta, "pipelines": [
                _carved(torch, c, lambda: pipeline(gvr, torch, timer, "light", prefetcher=False, kv=kv, parts=True,
                                                   timeline=args.timeline and c is None and f"{args.timeline}_light_{kv}"))
                for kv in args.kv for c in (None,) + args.sm_carveout]}
            r["pipelines"] = [p for p in r["pipelines"] if p is not None]  # (None: no carveout in this torch)
        elif args.only == "pipefp8":
            r = {"header": meta, "pipelines": [
                _carved(torch, c, lambda: pipeline(gvr, torch, timer, lay, prefetcher=False, kv=kv, priority=pr,
                                                   rounds=args.rounds))
                for lay in ("8b", "light") for kv in args.kv for pr in args.priorities
                for c in (None,) + args.sm_carveout]}
            r["pipelines"] = [p for p in r["pipelines"] if p is not None]
        else:
            r = {"header": meta, "pipelines": [pipeline(gvr, torch, timer, lay) for lay in ("8b", "light")]}
        if args.json:
            H.write_json(args.json, r)
        return
    result = {"header": meta, "gather": [], "matmul": [], "resident": [], "pipeline": {}}
    bf = torch.bfloat16
    Hkv, D = 8, 128

    # every section on a stream of its own: cudaMemcpyBatchAsync refuses the legacy default stream
    bench_stream = torch.cuda.Stream()
    torch.cuda.set_stream(bench_stream)

    # ---- gather ------------------------------------------------------------------------------------
    counts_all = (1, 8, 32, 128, 512, 2048) if not args.quick else (1, 32, 512)
    names = ("contiguous", "kernel", "kernel_graph", "tma_graph", "kernel64", "memcpy", "torch")
    headers = (["P", "blocks", "MiB"] + list(names) + [f"GB/s {k}" for k in names] + ["check"])
    rows = []
    for P, pages in ((64, 4096), (16, 8192)):
        cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, bf, device="cuda")
        hk, hv = cache.k(0), cache.v(0)
        g = torch.Generator().manual_seed(P)
        torch.manual_seed(P)
        hk.copy_(torch.randn(hk.shape, device=dev, dtype=bf))
        hv.copy_(torch.randn(hv.shape, device=dev, dtype=bf))
        page_bytes = P * Hkv * D * 2
        for n in counts_all:
            sel = torch.randperm(pages, generator=g)[:n].int()
            ix_h = sel.view(1, 1, n).contiguous()
            ix_d = ix_h.to(dev)
            dk = torch.empty((n, P, Hkv, D), dtype=bf, device=dev)
            dv = torch.empty_like(dk)
            nbytes = 2 * n * page_bytes
            src_k = torch.empty((n, P, Hkv, D), dtype=bf).pin_memory()
            src_v = torch.empty_like(src_k).pin_memory()
            t = {}
            t["contiguous"] = timer.events(lambda: (dk.copy_(src_k, non_blocking=True), dv.copy_(src_v, non_blocking=True)),
                                           20)["median_us"]
            t["kernel"] = timer.events(lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="kernel"), 20)["median_us"]
            sm_out = torch.empty((1, pages), dtype=torch.int32, device=dev)
            t["kernel_graph"] = timer.graph(lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="kernel",
                                                                        slot_map_out=sm_out), 5, 5)["median_us"]
            m = gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="kernel")
            torch.cuda.synchronize()
            ok = _check(torch, hk, hv, dk, dv, sel, m)
            dk.zero_()
            dv.zero_()
            t["tma_graph"] = timer.graph(lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="tma",
                                                                     slot_map_out=sm_out), 5, 5)["median_us"]
            torch.cuda.synchronize()
            ok = ok and _check(torch, hk, hv, dk, dv, sel, sm_out)
            t["kernel64"] = timer.events(lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="kernel", max_ctas=64),
                                         20)["median_us"]
            dk.zero_()
            t["memcpy"] = timer.events(lambda: gvr.sparda.prefetch(hk, hv, ix_h, dk, dv, method="memcpy"), 20)["median_us"]
            m2 = gvr.sparda.prefetch(hk, hv, ix_h, dk, dv, method="memcpy")
            torch.cuda.synchronize()
            ok = ok and _check(torch, hk, hv, dk, dv, sel, m2) and torch.equal(m.cpu(), m2.cpu())
            if n <= 128:
                sl = sel.tolist()

                def per_block():
                    for i, p in enumerate(sl):
                        dk[i].copy_(hk[p], non_blocking=True)
                        dv[i].copy_(hv[p], non_blocking=True)
                t["torch"] = timer.events(per_block, 10)["median_us"]
            else:
                t["torch"] = None
            gb = {k: (nbytes / (v * 1e-6) / 1e9 if v else None) for k, v in t.items()}
            rows.append([P, n, f"{nbytes / 2**20:.2f}"] + [H.fmt_us(t[k]) for k in names]
                        + [f"{gb[k]:.1f}" if gb[k] else "-" for k in names] + ["ok" if ok else "MISMATCH"])
            result["gather"].append({"P": P, "blocks": n, "bytes": nbytes, "us": t, "gbps": gb, "ok": ok})
            print(H.format_table(headers, rows[-1:]) if len(rows) == 1 else H.format_table(headers, rows[-1:]).split("\n")[-1],
                  flush=True)
            del dk, dv, src_k, src_v
        del hk, hv
        cache.close()

    # ---- matmul slowdown ---------------------------------------------------------------------------
    P, pages, n = 64, 2048, 512
    cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, bf, device="cuda")
    hk, hv = cache.k(0), cache.v(0)
    sel = torch.randperm(pages)[:n].int().view(1, 1, n)
    ix_d, ix_h = sel.to(dev), sel.clone()
    dk = torch.empty((n, P, Hkv, D), dtype=bf, device=dev)
    dv = torch.empty_like(dk)
    a = torch.randn(8192, 8192, dtype=bf, device=dev)
    b = torch.randn(8192, 8192, dtype=bf, device=dev)
    c = torch.empty_like(a)
    side = torch.cuda.Stream()

    side.wait_stream(torch.cuda.current_stream())

    def mm_time(reps=10):
        # events on this stream only: no device-wide synchronization until the end (the gathers queued
        # on the side stream keep running under these matmuls)
        torch.matmul(a, b, out=c)
        st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            st[i].record()
            torch.matmul(a, b, out=c)
            en[i].record()
        torch.cuda.synchronize()
        return H.median([s_.elapsed_time(e_) * 1e3 for s_, e_ in zip(st, en)])

    alone = mm_time()
    for name, fn in (("kernel", lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="kernel", stream=side)),
                     ("kernel4", lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="kernel", max_ctas=4,
                                                             stream=side)),
                     ("tma", lambda: gvr.sparda.prefetch(hk, hv, ix_d, dk, dv, method="tma", stream=side)),
                     ("memcpy", lambda: gvr.sparda.prefetch(hk, hv, ix_h, dk, dv, method="memcpy", stream=side))):
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(60):  # ~60 x 5 ms of gathers queued: the matmuls below run under them
                fn()
        with_g = mm_time()
        torch.cuda.synchronize()
        slow = with_g / alone - 1.0
        result["matmul"].append({"method": name, "alone_us": alone, "with_us": with_g, "slowdown": slow})
        print(f"matmul 8192^3 bf16: alone {alone:.0f} us, with {name} gathers {with_g:.0f} us: slowdown {100 * slow:.1f}%",
              flush=True)
    del a, b, c

    # ---- resident ------------------------------------------------------------------------------------
    n = 32
    g = torch.Generator().manual_seed(5)
    first = torch.randperm(pages, generator=g)[:n]
    keep = first[: int(0.6 * n)]
    rest = torch.tensor([p for p in torch.randperm(pages, generator=g).tolist() if p not in set(first.tolist())][: n - len(keep)])
    second = torch.cat([keep, rest])
    dk = torch.empty((2 * n, P, Hkv, D), dtype=bf, device=dev)
    dv = torch.empty_like(dk)
    cnt = torch.zeros(2, dtype=torch.int64, device=dev)
    m1 = gvr.sparda.prefetch(hk, hv, first.int().view(1, 1, n).to(dev), dk, dv, counts=cnt)
    s1 = cnt.clone()
    ix2 = second.int().view(1, 1, n).to(dev)
    m2 = gvr.sparda.prefetch(hk, hv, ix2, dk, dv, resident=m1, counts=cnt)
    torch.cuda.synchronize()
    ok = _check(torch, hk, hv, dk, dv, second.int(), m2)
    full = gvr.sparda.prefetch(hk, hv, ix2, dk, dv, counts=cnt.clone())
    t_res = timer.events(lambda: gvr.sparda.prefetch(hk, hv, ix2, dk, dv, resident=m1, slot_map_out=m2), 20)["median_us"]
    t_full = timer.events(lambda: gvr.sparda.prefetch(hk, hv, ix2, dk, dv), 20)["median_us"]
    del full
    moved = int(cnt[0])
    result["resident"].append({"blocks": n, "resident_fraction": 0.6, "first_moved": int(s1[0]), "moved": moved,
                               "needed": int(cnt[1]), "bytes_moved": moved * 2 * P * Hkv * D * 2,
                               "bytes_without": n * 2 * P * Hkv * D * 2, "us_resident": t_res, "us_full": t_full,
                               "ok": ok})
    print(f"resident: {n} blocks, 60% resident -> moved {moved} of {int(cnt[1])} needed ({n / max(moved, 1):.2f}x fewer "
          f"bytes); {t_res:.1f} us vs {t_full:.1f} us moving all; {'ok' if ok else 'MISMATCH'}", flush=True)
    del hk, hv, dk, dv
    cache.close()

    if not args.quick:
        result["shapes"] = shapes(gvr, torch, timer)
        result["pipelines"] = [pipeline(gvr, torch, timer, lay) for lay in ("light", "8b")]
        result["prefetcher"] = persistent(gvr, torch)
    if args.json:
        H.write_json(args.json, result)
        print(f"# wrote {args.json}")


SHAPES = ((16, 8, 16), (32, 2, 4), (64, 1, 4), ("tma", 1), ("tma", 2), ("tma", 4), ("tma", 8))


@contextlib.contextmanager
def _carveout(torch, c):
    """torch's matmuls kept off c SMs inside the block (gvr.sparda.matmul_carveout: cuBLASLt sized for the SMs
    left), then as before. Yields False (and changes nothing) where this torch has no carveout."""
    import gvr

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(gvr.sparda.matmul_carveout(c))
        except RuntimeError as e:  # this torch has no carveout
            print(f"carveout: {e}; skipped", flush=True)
            yield False
            return
        yield True


def _carved(torch, c, fn):
    """fn() with cuBLAS kept off c SMs (None: as is); its result dict records the carveout (None: no carveout
    in this torch)"""
    if c is None:
        return fn()
    with _carveout(torch, c) as ok:
        if not ok:
            return None
        print(f"-- cuBLAS(Lt) kept off {c} SMs:", flush=True)
        r = fn()
        r["sm_carveout"] = c
        return r


def _shape_kw(shape):
    """prefetch's keyword arguments for one of SHAPES, and its name"""
    if shape[0] == "tma":
        return dict(max_ctas=shape[1], method="tma"), f"tma {shape[1]} CTAs"
    ctas, warps, loads = shape
    return (dict(max_ctas=ctas, cta_warps=warps, lane_loads=loads, method="kernel"),
            f"kernel {ctas} CTAs x {warps} warps x {loads} loads")


def shapes(gvr, torch, timer, shape_list=SHAPES, idle_prefetcher=True, carveouts=()):
    """the gather kernel's CTA shapes (CTAs, warps per CTA, 16-byte loads in flight per lane; ("tma", CTAs)
    for the bulk-copy gather): gather time (graph) of 32 and 512 64-token blocks, and the slowdown of a
    concurrent 8192^3 bf16 matmul while 512-block gathers run on a second stream; then (idle_prefetcher) an
    idle persistent Prefetcher of each shape (its CTAs spinning, holding their registers) under the same
    matmul. carveouts: SM counts kept off the matmul (cuBLASLt's SM_COUNT_TARGET through torch's
    experimental carveout), each measured after the default: the matmul alone with the carveout, and
    under each shape's gathers -- its slowdown against the default matmul alone (what the user pays) and
    against the carved matmul alone"""
    P, Hkv, D, pages = 64, 8, 128, 2048
    bf = torch.bfloat16
    dev = torch.device("cuda")
    cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, bf, device="cuda")
    hk, hv = cache.k(0), cache.v(0)
    hk.copy_(torch.randn(hk.shape, device=dev, dtype=bf))
    hv.copy_(torch.randn(hv.shape, device=dev, dtype=bf))
    g = torch.Generator().manual_seed(3)
    a = torch.randn(8192, 8192, dtype=bf, device=dev)
    b = torch.randn(8192, 8192, dtype=bf, device=dev)
    c = torch.empty_like(a)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    st = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(10)]

    def mm_time():  # events on this stream, synchronized by an event (never the device: see the Prefetcher)
        torch.matmul(a, b, out=c)
        for i in range(10):
            st[i].record()
            torch.matmul(a, b, out=c)
            en[i].record()
        en[-1].synchronize()
        return H.median([s_.elapsed_time(e_) * 1e3 for s_, e_ in zip(st, en)])

    sels = {n: torch.randperm(pages, generator=g)[:n].int().view(1, 1, n).to(dev) for n in (32, 512)}
    dst = {n: (torch.empty((n, P, Hkv, D), dtype=bf, device=dev), torch.empty((n, P, Hkv, D), dtype=bf, device=dev))
           for n in (32, 512)}
    sm = torch.empty((1, pages), dtype=torch.int32, device=dev)

    def mm_under_gathers(kw):  # the matmul while 40 gathers of 512 blocks run on the side stream
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(40):
                gvr.sparda.prefetch(hk, hv, sels[512], *dst[512], slot_map_out=sm, stream=side, **kw)
        t = mm_time()
        torch.cuda.synchronize()
        return t

    alone = mm_time()
    out = []
    for shape in shape_list:
        kw, what = _shape_kw(shape)
        if shape[0] == "tma":  # the bulk-copy gather: one thread per CTA, 176 KiB of loads in flight each
            row = {"method": "tma", "ctas": shape[1], "bytes_in_flight": shape[1] * 11 * 16384}
        else:
            ctas, warps, loads = shape
            row = {"method": "kernel", "ctas": ctas, "warps": warps, "lane_loads": loads,
                   "bytes_in_flight": ctas * warps * 32 * loads * 16}
        for n in (32, 512):
            ix = sels[n]
            dk, dv = dst[n]
            t = timer.graph(lambda: gvr.sparda.prefetch(hk, hv, ix, dk, dv, slot_map_out=sm, **kw), 3, 5)["median_us"]
            row[f"us_{n}"] = t
            row[f"gbps_{n}"] = 2 * n * P * Hkv * D * 2 / t / 1e3
        ok = bool(torch.equal(dst[512][0][sm[0, sels[512][0, 0].long()].long()].cpu(), hk[sels[512][0, 0].long().cpu()]))
        row["matmul_slowdown"] = mm_under_gathers(kw) / alone - 1.0
        row["ok"] = ok
        out.append(row)
        print(f"shape {what} ({row['bytes_in_flight'] >> 10} KiB in flight): "
              f"32 blocks {row['us_32']:.1f} us ({row['gbps_32']:.1f} GB/s), 512 blocks {row['us_512']:.0f} us "
              f"({row['gbps_512']:.1f} GB/s); matmul {alone:.0f} us alone, +{100 * row['matmul_slowdown']:.1f}% "
              f"under the gathers{'' if ok else ' MISMATCH'}", flush=True)
    for sms in carveouts:
        with _carveout(torch, sms) as have:
            if not have:
                break
            torch.cuda.synchronize()
            alone_c = mm_time()
            print(f"carveout {sms} SMs (cuBLASLt): matmul alone {alone_c:.0f} us ({100 * (alone_c / alone - 1):+.1f}% "
                  f"against the default's {alone:.0f})", flush=True)
            for shape in shape_list:
                kw, what = _shape_kw(shape)
                with_g = mm_under_gathers(kw)
                out.append({"carveout": sms, "method": kw["method"], "ctas": kw["max_ctas"], "shape": list(shape),
                            "matmul_alone_us": alone_c, "matmul_us": with_g, "matmul_slowdown": with_g / alone - 1.0,
                            "matmul_slowdown_vs_carved": with_g / alone_c - 1.0})
                print(f"carveout {sms}: {what}: matmul {100 * (with_g / alone - 1):+.1f}% (against the carved matmul "
                      f"alone {100 * (with_g / alone_c - 1):+.1f}%)", flush=True)
    for ctas, warps, loads in ((16, 8, 16), (4, 1, 4)) if idle_prefetcher else ():
        torch.cuda.synchronize()
        pf = gvr.sparda.Prefetcher(staging_pages=32, batch=1, max_pages=pages, entries=32, ctas=ctas, cta_warps=warps,
                                   lane_loads=loads)
        try:
            idle = mm_time()
        finally:
            pf.close()
        out.append({"idle_prefetcher": True, "ctas": ctas, "warps": warps, "lane_loads": loads,
                    "matmul_slowdown": idle / alone - 1.0})
        print(f"idle Prefetcher {ctas} CTAs x {warps} warps x {loads} loads: matmul +{100 * (idle / alone - 1):.1f}%",
              flush=True)
    del hk, hv, a, b, c
    cache.close()
    return out


def _check(torch, hk, hv, dk, dv, sel, slot_map):
    sm = slot_map.cpu()[0]
    slots = sm[sel.long()]
    if (slots < 0).any():
        return False

    def raw(x):  # bytes (torch.equal has no fp8 kernels; NaN payloads compare as bytes)
        return x.view(torch.uint8)
    return bool(torch.equal(raw(dk.cpu()[slots.long()]), raw(hk[sel.long()]))
                and torch.equal(raw(dv.cpu()[slots.long()]), raw(hv[sel.long()])))


def selections(gvr, torch, timer):
    """forecast_select's device time (module docstring, "select"): per cell gvr, counts first, torch; alone
    and beside a GEMV."""
    from gvr.sparda import _num_windows
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(5)
    W = torch.randn(4096, 28672, dtype=bf, device=dev)
    x = torch.randn(1, 4096, dtype=bf, device=dev)
    y = torch.empty(1, 28672, dtype=bf, device=dev)
    side = torch.cuda.Stream()
    rows, out = [], []
    # (B, Hkv, windows, kernel, stride, k): the pipelines' cell (one GQA group, 64-token pages), every KV head,
    # and SparDA's windows (32 tokens every 16) at 128K tokens
    for B, Hkv, Nc, kw, st, k in ((1, 1, 2048, 64, 64, 32), (1, 8, 2048, 64, 64, 32), (1, 8, 8191, 32, 16, 128),
                                  (8, 8, 8191, 32, 16, 128)):
        T = (Nc - 1) * st + kw
        F = torch.randn(B, Hkv, 128, generator=g).to(bf).to(dev)
        kt = torch.randn(B, Hkv, Nc, 128, generator=g).to(bf).to(dev)
        lengths = torch.full((B,), T, dtype=torch.int32, device=dev)
        sel = torch.empty(B, Hkv, k, dtype=torch.int32, device=dev)
        meta = kt.unsqueeze(3).expand(B, Hkv, Nc, 2, 128)

        def ours():
            gvr.sparda.forecast_select(F, kt, k, lengths=lengths, kernel=kw, stride=st, out=sel)

        def counts_first():  # the chain before: the window counts by torch ops, then select_blocks
            gvr.prr.select_blocks(F, meta, k, _num_windows(lengths, kw, st), block_size=1, out=sel)

        def reference():  # what a torch user writes: scores, the valid and kept windows, torch.topk
            s = torch.matmul(kt, F.unsqueeze(-1)).squeeze(-1).float()
            n = _num_windows(lengths, kw, st).view(B, 1, 1)
            j = torch.arange(Nc, device=dev).view(1, 1, Nc)
            s = torch.where(j < n, s, -torch.inf)
            s = torch.where((j < 1) | ((j >= n - 2) & (j < n)), torch.inf, s)
            sel.copy_(torch.topk(s, k, dim=-1).indices)

        ours()
        torch.cuda.synchronize()
        want = sel.clone()
        counts_first()
        torch.cuda.synchronize()
        if not torch.equal(sel, want):
            raise SystemExit("forecast_select: the counts-first chain selects differently")

        def beside(fn):
            def run():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    fn()
                torch.matmul(x, W, out=y)
                main.wait_stream(side)
            return run

        gemv = timer.graph(lambda: torch.matmul(x, W, out=y), 10, 10)["median_us"]
        r = {"B": B, "Hkv": Hkv, "windows": Nc, "kernel": kw, "stride": st, "k": k, "gemv_us": gemv}
        names = ("gvr", "counts_first", "torch", "one_kernel")
        for name, fn in zip(names, (ours, counts_first, reference, lambda: sel.zero_())):
            r[name] = timer.graph(fn, 10, 10)["median_us"]
            r[f"{name}_beside_gemv"] = timer.graph(beside(fn), 10, 10)["median_us"]
            r[f"{name}_exposed"] = r[f"{name}_beside_gemv"] - gemv
        out.append(r)
        rows.append([B, Hkv, Nc, f"{kw}/{st}", k] + [f"{r[n]:.1f}" for n in names[:3]] +
                    [f"{gemv:.1f}"] + [f"{r[n + '_exposed']:.1f}" for n in names])
    print("\nforecast_select, CUDA graphs (warm), µs per call; beside a 4096x28672 bf16 GEMV: exposed = "
          "[selection on a side stream || GEMV] - GEMV alone; one kernel: a 128-byte zero_() in the selection's "
          "place (what the fork and join cost)")
    print(H.format_table(["B", "Hkv", "windows", "kernel/stride", "k", "gvr", "counts first", "torch", "GEMV",
                          "exposed: gvr", "counts first", "torch", "one kernel"], rows), flush=True)
    return out


def fp8_gathers(gvr, torch, timer):
    """64-token blocks (Hkv 8, D 128) from an fp8 (e4m3fn) and a bfloat16 host cache: µs and GB/s per method"""
    dev = torch.device("cuda")
    bench_stream = torch.cuda.Stream()  # cudaMemcpyBatchAsync refuses the legacy default stream
    torch.cuda.set_stream(bench_stream)
    P, pages, Hkv, D = 64, 4096, 8, 128
    methods = ("tma_graph", "kernel_graph", "memcpy")
    caches = {}
    for name, dt in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, dt, device="cuda")
        torch.manual_seed(1)
        for x in (cache.k(0), cache.v(0)):  # random bytes: every e4m3fn code (NaNs too), or bf16 values
            x.view(torch.uint8).copy_(torch.randint(0, 256, x.view(torch.uint8).shape, dtype=torch.uint8))
        caches[name] = (cache, dt)
    rows, out = [], []
    g = torch.Generator().manual_seed(3)
    headers = ["blocks", "MiB bf16"] + [f"{m} {c}" for m in methods for c in ("bf16", "fp8")] + \
              [f"bf16/fp8 {m}" for m in methods] + ["check"]
    for n in (8, 32, 128, 512):
        sel = torch.randperm(pages, generator=g)[:n].int()
        ix_h = sel.view(1, 1, n).contiguous()
        ix_d = ix_h.to(dev)
        t, ok = {}, True
        for name, (cache, dt) in caches.items():
            hk, hv = cache.k(0), cache.v(0)
            dk = torch.empty((n, P, Hkv, D), dtype=dt, device=dev)
            dv = torch.empty_like(dk)
            sm_out = torch.empty((1, pages), dtype=torch.int32, device=dev)
            for method in ("tma", "kernel"):
                t[(f"{method}_graph", name)] = timer.graph(lambda: gvr.sparda.prefetch(
                    hk, hv, ix_d, dk, dv, method=method, slot_map_out=sm_out), 5, 5)["median_us"]
                torch.cuda.synchronize()
                ok = ok and _check(torch, hk, hv, dk, dv, sel, sm_out)
                dk.view(torch.uint8).zero_()
                dv.view(torch.uint8).zero_()
            t[("memcpy", name)] = timer.events(lambda: gvr.sparda.prefetch(hk, hv, ix_h, dk, dv, method="memcpy"),
                                               20)["median_us"]
            m = gvr.sparda.prefetch(hk, hv, ix_h, dk, dv, method="memcpy")
            torch.cuda.synchronize()
            ok = ok and _check(torch, hk, hv, dk, dv, sel, m)
            del dk, dv
        nb16 = 2 * n * P * Hkv * D * 2
        rows.append([n, f"{nb16 / 2**20:.1f}"] + [H.fmt_us(t[(m, c)]) for m in methods for c in ("bfloat16", "fp8")]
                    + [f"{t[(m, 'bfloat16')] / t[(m, 'fp8')]:.2f}x" for m in methods] + ["ok" if ok else "MISMATCH"])
        out.append({"blocks": n, "bytes_bf16": nb16, "bytes_fp8": nb16 // 2, "ok": ok,
                    "us": {f"{m}/{c}": t[(m, c)] for m in methods for c in ("bfloat16", "fp8")},
                    "gbps": {f"{m}/{c}": (nb16 // (2 if c == "fp8" else 1)) / (t[(m, c)] * 1e-6) / 1e9
                             for m in methods for c in ("bfloat16", "fp8")}})
    print("\n## fp8 (e4m3fn) host cache vs bfloat16: prefetch of 64-token blocks, µs")
    print(H.format_table(headers, rows), flush=True)
    del hk, hv, x  # the last views of the host buffers: close() refuses while any is alive
    for cache, _ in caches.values():
        cache.close()
    return out


def pipeline(gvr, torch, timer, layer="light", prefetcher=True, kv="bfloat16", priority=0, parts=False,
             timeline=None, rounds=1):
    """4 layers, 128K tokens, B 1: sync vs async prefetch one layer ahead (module docstring); kv: the host
    cache's and the staging cache's dtype, "bfloat16" or "fp8" (e4m3fn, attention with k_scale / v_scale);
    priority: the side streams' (torch's: lower is higher; 0 the default, -1 high: the gathers' CTAs take
    the SMs that the layer's kernels free before the layer's next CTAs do); parts: also each half of the
    transfer alone in the schedules (the selections only, the prefetches only: the other left out);
    timeline: a path prefix -- one replay of the async3 (tma) graph under torch.profiler: its kernels in
    time order, per stream, written to PREFIX.txt (and the Chrome trace to PREFIX.json); rounds > 1: also
    the hidden shares of async3 (both gathers) that many times, interleaved (sync, async3, transfer alone
    timed back to back in each round): their median, min and max in r["rounds"] (one round's share is a
    small difference of two step times over a transfer time, so single rounds scatter)."""
    L, P, Hq, Hkv, D, k, T = 4, 64, 32, 8, 128, 32, 131072
    pages = T // P
    bf = torch.bfloat16
    cdt = torch.float8_e4m3fn if kv == "fp8" else bf
    ks, vs = (0.02, 0.02) if kv == "fp8" else (None, None)  # fp8 values of N(0, 1) / 0.02: the e4m3 range
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    cache = gvr.sparda.HostKVCache(L, pages, P, Hkv, D, cdt, device="cuda")
    ktil = []
    for l in range(L):
        kd = torch.randn(cache.k(l).shape, device=dev, dtype=bf)
        cache.k(l).copy_(kd if kv != "fp8" else (kd.float() / ks).clamp_(-448, 448).to(cdt))
        vd = torch.randn(cache.v(l).shape, device=dev, dtype=bf)
        cache.v(l).copy_(vd if kv != "fp8" else (vd.float() / vs).clamp_(-448, 448).to(cdt))
        del vd
        # the layer's compressed keys per page, one GQA group (Hsel 1: one selection for every head)
        ktil.append(kd.float().mean(dim=(1, 2)).to(bf).view(1, 1, pages, D))
        del kd
    lengths = torch.tensor([T], dtype=torch.int32, device=dev)
    nwin = torch.tensor([pages], dtype=torch.int32, device=dev)  # windows of one page each
    block_table = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
    S = 2 * k
    stage = [(torch.empty((S, P, Hkv, D), dtype=cdt, device=dev), torch.empty((S, P, Hkv, D), dtype=cdt, device=dev))
             for _ in range(L)]
    maps = [[torch.full((1, pages), -1, dtype=torch.int32, device=dev) for _ in range(2)] for _ in range(L)]
    sel = [torch.empty((1, 1, k), dtype=torch.int32, device=dev) for _ in range(L)]
    F = [torch.randn(1, 1, D, generator=g).to(bf).to(dev) for _ in range(L)]
    noise = torch.empty(L, 1, 1, D, dtype=bf, device=dev)
    q = torch.randn(1, Hq, D, dtype=bf, device=dev)
    if layer == "light":  # the FFN stand-in of session 8: one 4096 x 28672 bf16 matmul (235 MB read per layer)
        shapes = [(4096, 28672)]
    else:  # a Llama-3-8B layer at B 1: QKV, O, gate+up, down projections (436 MB of weights read per layer)
        shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    Ws = [torch.randn(a, b, dtype=bf, device=dev) for a, b in shapes]
    xs = [torch.randn(1, a, dtype=bf, device=dev) for a, _ in shapes]
    ys = [torch.empty(1, b, dtype=bf, device=dev) for _, b in shapes]
    side, side2 = torch.cuda.Stream(priority=priority), torch.cuda.Stream(priority=priority)
    step_box = [0]

    skip = set()  # "select" / "fetch": left out of every schedule (parts)
    pool = [[] for _ in range(L)]  # recorded selections that stand in for forecast_select when "select" is left out

    def select(l):
        if "select" in skip:  # a recorded selection (one small copy): the prefetches move what they would
            sel[l].copy_(pool[l][step_box[0] % len(pool[l])])
            return
        # the Forecast drifts step to step (0.9 F + N(0, 0.45^2)): one kernel, as the Forecast head's GEMV
        # of a model (this was four elementwise kernels before session 18)
        F[l].lerp_(noise[l], 0.1)
        gvr.sparda.forecast_select(F[l], ktil[l], k, lengths=nwin, kernel=1, stride=1,
                                   init_blocks=1, local_blocks=2, out=sel[l])

    method = ["kernel"]

    def fetch(l, stream=None):
        if "fetch" in skip:
            return
        cur, prev = maps[l][step_box[0] % 2], maps[l][(step_box[0] + 1) % 2]
        gvr.sparda.prefetch(cache.k(l), cache.v(l), sel[l], stage[l][0], stage[l][1], block_table=block_table,
                            resident=prev, slot_map_out=cur, stream=stream, method=method[0])

    def attention(l):
        cur = maps[l][step_box[0] % 2]
        gvr.sparse_attention(q, stage[l][0], stage[l][1], sel[l], lengths=lengths, block_table=cur, block_size=P,
                             k_scale=ks, v_scale=vs)

    def matmuls():
        for W, x, y in zip(Ws, xs, ys):
            torch.matmul(x, W, out=y)

    def attend(l):
        attention(l)
        matmuls()

    def new_token():  # the step's new input: the noise the Forecasts drift by (one kernel)
        step_box[0] += 1
        noise.normal_(0.0, 4.5)

    def step_sync():
        new_token()
        for l in range(L):
            select(l)
            fetch(l)
            attend(l)

    ev = [torch.cuda.Event() for _ in range(L)]
    started = [torch.cuda.Event() for _ in range(L)]
    selected = [torch.cuda.Event() for _ in range(L)]

    def step_async():
        # one layer ahead: at the start of layer l the main stream runs select(l + 1) (the Forecast of layer
        # l + 1 reads layer l's input), the side stream prefetches its blocks while layer l computes, and
        # layer l + 1 waits for them
        new_token()
        main = torch.cuda.current_stream()
        select(0)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fetch(0, side)
        ev[0].record(side)
        for l in range(L):
            if l + 1 < L:
                select(l + 1)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    fetch(l + 1, side)
                ev[l + 1].record(side)
            main.wait_event(ev[l])
            attend(l)
        main.wait_stream(side)

    def step_async3(matmuls_after_next_select=False):
        # the same with select(l + 1) on a stream of its own, started with layer l (alongside its attention
        # and FFN), and the prefetch on the side stream after it. matmuls_after_next_select (async4): the
        # layer's matmuls wait for select(l + 1), so that its short kernels run before the layer's long GEMV
        # takes the SMs and the prefetch that follows keeps its CTAs through it
        new_token()
        main = torch.cuda.current_stream()
        select(0)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fetch(0, side)
        ev[0].record(side)
        for l in range(L):
            if l + 1 < L:
                started[l].record(main)
                side2.wait_event(started[l])
                with torch.cuda.stream(side2):
                    select(l + 1)
                selected[l + 1].record(side2)
                side.wait_event(selected[l + 1])
                with torch.cuda.stream(side):
                    fetch(l + 1, side)
                ev[l + 1].record(side)
            main.wait_event(ev[l])
            attention(l)
            if matmuls_after_next_select and l + 1 < L:
                main.wait_event(selected[l + 1])
            matmuls()
        main.wait_stream(side)
        main.wait_stream(side2)

    def step_async4():
        step_async3(matmuls_after_next_select=True)

    def transfer_only(first=0):
        new_token()
        for l in range(first, L):
            select(l)
            fetch(l)

    def compute_only():
        for l in range(L):
            attend(l)

    for fn in (step_sync, step_async, step_async3, step_async4):
        fn()
    torch.cuda.synchronize()
    cnt = torch.zeros(2, dtype=torch.int64, device=dev)
    # overlap of consecutive selections (what resident saves)
    moved = []
    for _ in range(4):
        new_token()
        for l in range(L):
            select(l)
            cur, prev = maps[l][step_box[0] % 2], maps[l][(step_box[0] + 1) % 2]
            gvr.sparda.prefetch(cache.k(l), cache.v(l), sel[l], stage[l][0], stage[l][1], block_table=block_table,
                                resident=prev, slot_map_out=cur, counts=cnt)
            moved.append(int(cnt[0]))
    r = {"layer": layer, "kv": kv, "priority": priority, "weights_mb": sum(a * b for a, b in shapes) * 2 / 1e6}
    # each variant as a CUDA graph of 2 steps (forecast_select -> prefetch -> attention are graph-safe; the
    # side streams join the capture): device time, no host work in it
    for name, fn in (("sync", step_sync), ("async", step_async), ("async3", step_async3), ("transfer", transfer_only),
                     ("transfer_ahead", lambda: transfer_only(1)), ("compute", compute_only)):
        r[name] = timer.graph(fn, 2, 10)["median_us"]
    method[0] = "tma"  # the same schedules with the bulk-copy gather
    for name, fn in (("sync_tma", step_sync), ("async3_tma", step_async3), ("async4_tma", step_async4),
                     ("transfer_tma", transfer_only),
                     ("transfer_ahead_tma", lambda: transfer_only(1))):
        r[name] = timer.graph(fn, 2, 10)["median_us"]
    if timeline:
        _timeline(torch, timer, step_async3, timeline, f"{layer} {kv}, async3 (tma)")
    if parts:  # which half of the transfer stays exposed: each alone (tma), the other left out
        for _ in range(6):
            new_token()
            for l in range(L):
                select(l)
                pool[l].append(sel[l].clone())
        method[0] = "tma"
        for keep, leave in (("select", "fetch"), ("fetch", "select")):
            skip.add(leave)
            t = {n: timer.graph(fn, 2, 10)["median_us"] for n, fn in (("sync", step_sync), ("async3", step_async3),
                                                                        ("transfer", transfer_only),
                                                                        ("transfer_ahead", lambda: transfer_only(1)))}
            t["hidden_ahead_async3"] = (t["sync"] - t["async3"]) / t["transfer_ahead"]
            r[f"only_{keep}"] = t
            skip.clear()
            print(f"  {layer} {kv}, {keep} only (tma): sync {t['sync']:.0f} us, async3 {t['async3']:.0f} us, transfer "
                  f"{t['transfer']:.0f} us (layers 1-{L - 1}: {t['transfer_ahead']:.0f}) -> hidden "
                  f"{100 * t['hidden_ahead_async3']:.0f}% of layers 1-{L - 1}'s", flush=True)
    if rounds > 1:
        per = {f"{m}_{w}": [] for m in ("kernel", "tma") for w in ("all", "ahead")}
        for _ in range(rounds):
            for m in ("kernel", "tma"):
                method[0] = m
                t = {n: timer.graph(fn, 2, 10)["median_us"] for n, fn in
                     (("sync", step_sync), ("async3", step_async3), ("transfer", transfer_only),
                      ("transfer_ahead", lambda: transfer_only(1)))}
                per[f"{m}_all"].append((t["sync"] - t["async3"]) / t["transfer"])
                per[f"{m}_ahead"].append((t["sync"] - t["async3"]) / t["transfer_ahead"])
        r["rounds"] = {key: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
                       for key, v in per.items()}
        print(f"  {layer} {kv}, priority {priority}: async3 hidden over {rounds} interleaved rounds, median "
              f"[min, max], of all transfer / of layers 1-{L - 1}'s: "
              + "; ".join(f"{m} " + " / ".join(f"{100 * r['rounds'][f'{m}_{w}']['median']:.0f}% "
                                              f"[{100 * r['rounds'][f'{m}_{w}']['min']:.0f}, "
                                              f"{100 * r['rounds'][f'{m}_{w}']['max']:.0f}]" for w in ("all", "ahead"))
                          for m in ("kernel", "tma")), flush=True)
    method[0] = "kernel"
    for name in ("async", "async3"):
        r[f"hidden_{name}"] = (r["sync"] - r[name]) / r["transfer"]
        r[f"hidden_ahead_{name}"] = (r["sync"] - r[name]) / r["transfer_ahead"]
    r["hidden_async3_tma"] = (r["sync_tma"] - r["async3_tma"]) / r["transfer_tma"]
    r["hidden_ahead_async3_tma"] = (r["sync_tma"] - r["async3_tma"]) / r["transfer_ahead_tma"]
    r["hidden_async4_tma"] = (r["sync_tma"] - r["async4_tma"]) / r["transfer_tma"]
    r["hidden_ahead_async4_tma"] = (r["sync_tma"] - r["async4_tma"]) / r["transfer_ahead_tma"]
    r["mean_blocks_moved_per_layer"] = sum(moved) / len(moved)
    r["blocks_per_layer"] = k
    if prefetcher:
        r.update(_pipeline_prefetcher(gvr, torch, L, select, attend, cache, sel, stage, maps, block_table, step_box,
                                      side2, pages, k, S, r, new_token))
    print(f"pipeline 128K x {L} layers ({layer} layer: {r['weights_mb']:.0f} MB of weights; {kv} KV; side streams' priority {priority}), CUDA graphs, per step "
          f"(B 1, {k} blocks of {P} tokens per layer, {r['mean_blocks_moved_per_layer']:.1f} moved per layer with "
          f"resident=): sync {r['sync']:.0f} us, async {r['async']:.0f} us, async3 (select alongside) "
          f"{r['async3']:.0f} us" + (f", Prefetcher {r['prefetcher']:.0f} us" if r.get("prefetcher") else "") +
          f"; transfer alone {r['transfer']:.0f} us (layers 1-{L - 1}: {r['transfer_ahead']:.0f}), compute alone "
          f"{r['compute']:.0f} us -> hidden: async {100 * r['hidden_async']:.0f}% of all transfer / "
          f"{100 * r['hidden_ahead_async']:.0f}% of layers 1-{L - 1}'s; async3 {100 * r['hidden_async3']:.0f}% / "
          f"{100 * r['hidden_ahead_async3']:.0f}%; with method tma: sync {r['sync_tma']:.0f} us, async3 "
          f"{r['async3_tma']:.0f} us, transfer {r['transfer_tma']:.0f} us -> {100 * r['hidden_async3_tma']:.0f}% / "
          f"{100 * r['hidden_ahead_async3_tma']:.0f}%; async4 (matmuls after the next selection) "
          f"{r['async4_tma']:.0f} us -> {100 * r['hidden_async4_tma']:.0f}% / {100 * r['hidden_ahead_async4_tma']:.0f}%"
          + (f"; Prefetcher {100 * r['hidden_prefetcher']:.0f}% / "
                                                       f"{100 * r['hidden_ahead_prefetcher']:.0f}%"
                                                       if r.get("prefetcher") else ""), flush=True)
    del stage, Ws
    cache.close()
    return r


def _timeline(torch, timer, step, prefix, what):
    """one replay of a graph of 2 steps under torch.profiler (CUPTI): the kernels in time order with their
    stream, start and end (µs from the first kernel's start) -> PREFIX.txt, the Chrome trace -> PREFIX.json"""
    from torch.profiler import ProfilerActivity, profile
    g = timer.capture(step, 2)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(prefix + ".json")
    ks = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    ks.sort(key=lambda e: e.time_range.start)
    t0 = ks[0].time_range.start if ks else 0
    with open(prefix + ".txt", "w") as f:
        f.write(f"# {what}: one replay of a graph of 2 steps, kernels in time order (us from the first start)\n")
        for e in ks:
            f.write(f"{(e.time_range.start - t0):9.1f} {(e.time_range.end - t0):9.1f} {e.time_range.end - e.time_range.start:8.1f}"
                    f"  stream {getattr(e, 'device_resource_id', '?')!s:>4}  {e.name[:110]}\n")
    del g
    print(f"  timeline of {what}: {len(ks)} kernels -> {prefix}.txt", flush=True)


def _pipeline_prefetcher(gvr, torch, L, select, attend, cache, sel, stage, maps, block_table, step_box, side2, pages,
                         k, S, r, new_token):
    """the async3 schedule with the persistent Prefetcher instead of the side stream's prefetch: a graph of
    2 steps captured before its kernel starts (torch.cuda.graph synchronizes the device), replayed while
    it runs, timed with events and stream synchronization only"""
    main = torch.cuda.current_stream()
    submitted = [torch.cuda.Event() for _ in range(L)]
    started = [torch.cuda.Event() for _ in range(L)]
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(24)]
    pf = gvr.sparda.Prefetcher(staging_pages=S, batch=1, max_pages=pages, entries=k, ctas=16, depth=8, start=False)
    out = {}
    try:
        def submit(l):
            cur, prev = maps[l][step_box[0] % 2], maps[l][(step_box[0] + 1) % 2]
            return pf.submit(cache.k(l), cache.v(l), sel[l], stage[l][0], stage[l][1], block_table=block_table,
                             resident=prev, slot_map_out=cur)[1]

        def step():
            main = torch.cuda.current_stream()  # the capturing stream
            new_token()
            tk = [None] * L
            select(0)
            tk[0] = submit(0)
            for l in range(L):
                if l + 1 < L:
                    started[l].record(main)
                    side2.wait_event(started[l])
                    with torch.cuda.stream(side2):
                        select(l + 1)
                        tk[l + 1] = submit(l + 1)
                    submitted[l + 1].record(side2)
                if l > 0:
                    main.wait_event(submitted[l])
                pf.wait(tk[l])
                attend(l)
            main.wait_stream(side2)

        graph, cap = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        cap.wait_stream(main)
        with torch.cuda.graph(graph, stream=cap):
            step()
            step()
        for l in range(L):  # the captured submits did not run: the staging caches start empty
            for m in maps[l]:
                m.fill_(-1)
        torch.cuda.synchronize()
        pf.start()
        graph.replay()  # warm
        ts = []
        for i in range(0, len(evs), 2):
            evs[i].record(main)
            graph.replay()
            evs[i + 1].record(main)
            evs[i + 1].synchronize()
            ts.append(evs[i].elapsed_time(evs[i + 1]) * 1e3 / 2)
        pf.check()
        out["prefetcher"] = sorted(ts)[len(ts) // 2]
        out["hidden_prefetcher"] = (r["sync"] - out["prefetcher"]) / r["transfer"]
        out["hidden_ahead_prefetcher"] = (r["sync"] - out["prefetcher"]) / r["transfer_ahead"]
    except Exception as e:  # noqa: BLE001 -- reported, the rest of the benchmark goes on
        out["prefetcher_error"] = f"{type(e).__name__}: {e}"
        print(f"pipeline with the Prefetcher: {out['prefetcher_error']}", flush=True)
    finally:
        pf.close()
    return out


def persistent(gvr, torch):
    """the persistent prefetcher vs the stream-ordered prefetch (eager calls, CUDA events on this stream)"""
    P, Hkv, D, pages = 64, 8, 128, 2048
    bf = torch.bfloat16
    dev = torch.device("cuda")
    cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, bf, device="cuda")
    hk, hv = cache.k(0), cache.v(0)
    hk.copy_(torch.randn(hk.shape, device=dev, dtype=bf))
    hv.copy_(torch.randn(hv.shape, device=dev, dtype=bf))
    out = []
    main = torch.cuda.current_stream()

    def events(fn, reps=18, evs=None):
        for _ in range(3):
            fn()
        main.synchronize()
        evs = evs or [torch.cuda.Event(enable_timing=True) for _ in range(2 * reps)]
        ts = []
        for i in range(reps):
            a, b = evs[2 * i], evs[2 * i + 1]
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return H.median(ts)

    for n in (8, 32, 128):
        ix = torch.randperm(pages)[:n].int().view(1, 1, n).to(dev)
        dk = torch.empty((n, P, Hkv, D), dtype=bf, device=dev)
        dv = torch.empty_like(dk)
        sm = torch.empty((1, pages), dtype=torch.int32, device=dev)
        t_stream = events(lambda: gvr.sparda.prefetch(hk, hv, ix, dk, dv, slot_map_out=sm))
        a_ev = [torch.cuda.Event(enable_timing=True) for _ in range(40)]  # no allocation once it runs
        torch.cuda.synchronize()
        pf = gvr.sparda.Prefetcher(staging_pages=n, batch=1, max_pages=pages, entries=n, ctas=16, depth=8)
        try:
            def via_pf():
                _, tk = pf.submit(hk, hv, ix, dk, dv, slot_map_out=sm)
                pf.wait(tk)
            t_pf = events(via_pf, 18, a_ev)
            main.synchronize()
            pf.check()
        finally:
            pf.close()
        ok = bool(torch.equal(dk[sm[0, ix[0, 0].long()].long()].cpu(), hk[ix[0, 0].long().cpu()]))
        nbytes = 2 * n * P * Hkv * D * 2
        out.append({"blocks": n, "bytes": nbytes, "stream_ordered_us": t_stream, "prefetcher_us": t_pf, "ok": ok})
        print(f"prefetcher: {n} blocks of {P} tokens ({nbytes / 2**20:.0f} MiB): stream-ordered prefetch {t_stream:.1f} us "
              f"({nbytes / t_stream / 1e3:.1f} GB/s), persistent submit + wait {t_pf:.1f} us ({nbytes / t_pf / 1e3:.1f} GB/s)"
              f"{'' if ok else ' MISMATCH'}", flush=True)
    del hk, hv
    cache.close()
    return out


if __name__ == "__main__":
    main()
