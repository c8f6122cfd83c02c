#!/usr/bin/env python3
"""Benchmark of gvr.sparse_attention, gvr.prr.repair and gvr.merge_states (issue 12).

    python benchmarks/bench_attention.py [--quick] [--cpu-only] [--json PATH] [--append-results PATH]

Workloads and cells only: timing, GB/s, the memory floor, the header and JSON come from the one
harness (gvr/_harness.py, through benchmarks/_harness.py); the acceptance bars from
benchmarks/bars.json ("attention").

CUDA (torch CUDA tensors), PRR's kernel table setup: Hq 32, Hkv 8, D 128, bf16, a 128K-token context
per row in a paged cache (page size P = 64, NHD layout [num_pages, P, Hkv, D], every row's pages
shuffled over the pool: block_table rows are a random permutation of all pages), B = 1, 8, 64:
  blocks64  selected tokens 1K / 4K / 8K (and 2K at B = 64) in 64-token blocks (= pages), block_table
            mode, block_size 64, a random selection per KV head (Hsel = Hkv);
  blocks16  8K tokens in 16-token blocks: block_size 16 over the same 64-token pages (4 blocks a page;
            no second cache), block_table mode, Hsel = Hkv;
  tokens    DSA: 2048 single tokens of the row's context, as physical slots (no block_table, G = 1),
            Hsel = 1 shared by all heads.
Columns: gvr; torch = the gather from the paged cache (index_select of rows; the block-to-slot
translation precomputed outside the timed region, a favour to torch) + scaled_dot_product_attention,
the fastest (warm) of three forms: "fold" (the Hq/Hkv query heads of a KV head as query positions: no
copy, no mask needed at decode), "gqa" (enable_gqa=True), "repeat" (repeat_interleave of K/V);
floor = selected K+V bytes / the device's measured copy bandwidth (CudaTimer.copy_bandwidth);
GB/s = selected K+V bytes / time. Warm L2 = CUDA graph replay, cold L2 = a buffer larger than L2
written before each eager call (CUDA events around it, a 0.5 ms GPU sleep queued ahead so that no launch
gap falls inside); cold_g = cold L2 without the events' fixed cost: a graph of 10 x [flush, call] minus a
graph of 10 x [flush], per call (the header prints what both give for a 4-byte fill). Each gvr cell is checked once against torch (max |out difference|
printed) and its lse against a float32 reference; beyond bf16 tolerance the cell is FAIL.
PRR repair: B = 1, predicted = 64 blocks of 64 tokens per KV head; m = 0..64 missed blocks:
prr.repair with the m entries (compact), prr.repair with prr.missed's output (padded with -1 to 64),
against recomputing sparse_attention over predicted ∪ missed (float32 state, as repair keeps).
merge_states of two [32 x 128] states (float32 and bf16) against the eager torch formula.

CPU (NumPy arrays, one core: gvr.set_num_threads(1), NumPy's BLAS limited to one thread before NumPy
loads): float32, B = 1, Hq 32, Hkv 8, D 128, a 32K-token paged context (--cpu-context), 8K tokens in
64-token blocks and 2048 single tokens: gvr's C path against NumPy (gather + einsum / matmul +
softmax; the faster of the two is "numpy"), with their ratio.

On a machine without CUDA (or with --cpu-only) only the CPU section runs. An exception in one cell is
printed and recorded, and the run goes on.
"""
from __future__ import annotations

import os

# The CPU section compares one core with one core: NumPy's BLAS gets one thread (before NumPy loads).
for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _harness as H  # noqa: E402

HQ, HKV, D, P = 32, 8, 128, 64
CONTEXT = 131072
WORKLOADS = {
    "blocks64": {"G": 64, "table": True, "shared": False,
                 "desc": "64-token blocks (= the 64-token pages), block_table mode, block_size 64, a random "
                         "selection per KV head (Hsel = Hkv)"},
    "blocks16": {"G": 16, "table": True, "shared": False,
                 "desc": "16-token blocks: block_size 16 over the 64-token pages (4 blocks a page), block_table "
                         "mode, a random selection per KV head (Hsel = Hkv)"},
    "tokens": {"G": 1, "table": False, "shared": True,
               "desc": "DSA token selection: single tokens of the row's context as physical slots (no "
                       "block_table), Hsel = 1 shared by all heads"},
}
# (workload, selected tokens) per B
GRID_CELLS = [("blocks64", 1024), ("blocks64", 4096), ("blocks64", 8192), ("blocks16", 8192), ("tokens", 2048)]
GRID = {"full": {1: GRID_CELLS, 8: GRID_CELLS, 64: [("blocks64", 2048)] + GRID_CELLS},
        "quick": {1: GRID_CELLS, 64: [("blocks64", 2048), ("tokens", 2048)]}}
# fp8 (e4m3fn) caches: (B, workload, selected tokens); per-tensor scales as a serving stack keeps them
FP8_GRID = {"full": [(1, "blocks64", 1024), (1, "blocks64", 8192), (1, "tokens", 2048), (8, "blocks64", 4096),
                     (64, "blocks64", 2048), (64, "tokens", 2048)],
            "quick": [(1, "blocks64", 1024), (1, "blocks64", 8192), (1, "tokens", 2048), (64, "blocks64", 2048)]}
FP8_SCALE = 4.0 / 448.0  # K, V ~ N(0, 1): |x| < 4 maps onto e4m3's range
REPAIR_MISSED = (0, 1, 2, 4, 8, 16, 32, 64)
REPAIR_PRED_BLOCKS = 64
CPU_CELLS = [("blocks64", 8192), ("tokens", 2048)]
TORCH_FORMS = ("fold", "gqa", "repeat")
# --simulate-on-cpu: the CUDA sections' code on torch CPU tensors, small sizes (times meaningless)
SIM = {"context": 4096, "grid": {1: [("blocks64", 256), ("blocks64", 1024), ("blocks16", 1024), ("tokens", 256)],
                                 2: [("blocks64", 512), ("tokens", 256)]},
       "pred_blocks": 16, "missed": (0, 1, 2, 8)}
OUT_RTOL = 2e-2   # |gvr out - torch out| <= OUT_RTOL * max|reference out| (bf16: ~5 ulps at the max)
LSE_ATOL = 1e-3   # |gvr lse - float32 reference lse| (one missed block of 512 moves lse by 2e-3)
F32_RTOL = 1e-4   # float32 paths (CPU, merge_states in float32, repair states)


def import_gvr():
    return H.import_gvr(ROOT)


def import_torch():
    try:
        import torch

        return torch
    except Exception:
        return None


def kv_bytes(b, n, esize):
    """Selected K+V bytes of one call: every row reads n tokens x Hkv heads x D of K and of V (the same
    with Hsel = 1 and Hsel = Hkv)."""
    return 2 * b * n * HKV * D * esize


def value(c, m, mode=None):
    """Median µs of method m (mode warm/cold on CUDA, None on the CPU); m = "floor": the memory floor."""
    if m == "floor":
        return c.get("floor_us")
    t = (c.get("methods") or {}).get(m)
    if not isinstance(t, dict):
        return None
    if mode is not None:
        t = t.get(mode)
        if not isinstance(t, dict):
            return None
    return t.get("median_us")


def _merge_errors(cell, errors):
    if errors:
        cell["errors"] = errors


def _err(e):
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------------
# selections (shared by the torch and NumPy paths: xp = torch or numpy)
# --------------------------------------------------------------------------------------------------


class Selection:
    """One cell's indices for gvr and the row ids of the baselines' gather.

    idx    int32 [B, Hsel, n_entries]: logical blocks (block_table mode) or physical slots (tokens);
    rows   int64 [B, Hkv, n] (Hsel = Hkv) or [B, n] (shared): rows of the cache viewed as
           [num_slots * Hkv, D] (per head) or [num_slots, Hkv * D] (shared), gathered by index_select."""

    def __init__(self, idx, rows, shared, n, G):
        self.idx, self.rows, self.shared, self.n, self.G = idx, rows, shared, n, G


def torch_selection(torch, dev, gen, block_table, wl, B, n, context, blocks=None):
    """Random distinct blocks per (row, KV head) or random distinct tokens per row; blocks: given
    logical block ids int64 [B, Hkv, nb] (repair)."""
    spec = WORKLOADS[wl]
    G, bt = spec["G"], block_table[:B].long()
    if spec["shared"]:
        tok = torch.rand(B, context, generator=gen, device=dev).argsort(-1)[:, :n]
        slot = bt.gather(1, tok // P) * P + tok % P  # [B, n] physical slots
        return Selection(slot.view(B, 1, n).to(torch.int32).contiguous(), slot.contiguous(), True, n, 1)
    if blocks is None:
        nb = n // G
        blocks = torch.rand(B, HKV, context // G, generator=gen, device=dev).argsort(-1)[..., :nb]
    nb = blocks.shape[-1]
    tok = (blocks * G).unsqueeze(-1) + torch.arange(G, device=dev)  # [B, Hkv, nb, G] logical tokens
    slot = bt.gather(1, (tok // P).view(B, -1)).view(tok.shape) * P + tok % P
    rows = (slot * HKV + torch.arange(HKV, device=dev).view(1, HKV, 1, 1)).view(B, HKV, nb * G)
    return Selection(blocks.to(torch.int32).contiguous(), rows.contiguous(), False, nb * G, G)


def numpy_selection(rng, block_table, wl, B, n, context):
    spec = WORKLOADS[wl]
    G, bt = spec["G"], block_table[:B].astype(np.int64)
    if spec["shared"]:
        tok = np.stack([rng.permutation(context)[:n] for _ in range(B)])
        slot = np.take_along_axis(bt, tok // P, 1) * P + tok % P
        return Selection(np.ascontiguousarray(slot.reshape(B, 1, n).astype(np.int32)), slot, True, n, 1)
    nb = n // G
    blocks = np.stack([np.stack([rng.permutation(context // G)[:nb] for _ in range(HKV)]) for _ in range(B)])
    tok = (blocks * G)[..., None] + np.arange(G)
    slot = np.take_along_axis(bt, (tok // P).reshape(B, -1), 1).reshape(tok.shape) * P + tok % P
    rows = (slot * HKV + np.arange(HKV).reshape(1, HKV, 1, 1)).reshape(B, HKV, nb * G)
    return Selection(np.ascontiguousarray(blocks.astype(np.int32)), rows, False, nb * G, G)


# --------------------------------------------------------------------------------------------------
# CUDA (torch) section
# --------------------------------------------------------------------------------------------------


class HostTimer:
    """CudaTimer's interface on the host (--simulate-on-cpu): time_cpu around eager calls."""

    def __init__(self, torch):
        self.torch, self.device, self.flush_bytes = torch, torch.device("cpu"), 0

    def graph(self, fn, calls=10, replays=20):
        return H.time_cpu(fn, budget_s=0.01, min_runs=3, max_runs=max(3, replays))

    def events(self, fn, reps=50, *, cold=False, warmup=2):
        return H.time_cpu(fn, budget_s=0.01, min_runs=3, max_runs=max(3, reps), warmup=warmup)

    def copy_bandwidth(self, nbytes=None, reps=10):
        if not hasattr(self, "_bw"):
            self._bw = H.cpu_copy_bandwidth(64 << 20)
        return self._bw


class Cache:
    """K and V [num_pages, P, Hkv, D] (bf16, N(0,1)) of `rows` rows of `context` tokens; block_table
    int32 [rows, context / P] = a random permutation of all pages (every row's pages shuffled)."""

    def __init__(self, torch, dev, gen, rows, context, dtype):
        self.context, self.rows = context, rows
        pages = context // P
        self.num_pages = rows * pages
        self.k = torch.empty(self.num_pages, P, HKV, D, dtype=dtype, device=dev)
        self.v = torch.empty_like(self.k)
        step = max(1, (256 << 20) // (P * HKV * D))  # fill in chunks of 256M elements
        for t in (self.k, self.v):
            for i in range(0, self.num_pages, step):
                t[i:i + step].normal_(generator=gen)
        self.block_table = torch.rand(self.num_pages, generator=gen, device=dev).argsort().to(torch.int32).view(rows, pages)
        self.k_rows = self.k.view(-1, D)            # [num_slots * Hkv, D]: per-head gather
        self.v_rows = self.v.view(-1, D)
        self.k_slots = self.k.view(-1, HKV * D)     # [num_slots, Hkv * D]: shared (DSA) gather
        self.v_slots = self.v.view(-1, HKV * D)
        self.nbytes = 2 * self.k.numel() * self.k.element_size()


def torch_gather(cache, sel, B):
    """The plain-torch gather from the paged cache: [B, Hkv, n, D] K and V."""
    if sel.shared:
        flat = sel.rows.view(-1)
        k = cache.k_slots.index_select(0, flat).view(B, sel.n, HKV, D).transpose(1, 2)
        v = cache.v_slots.index_select(0, flat).view(B, sel.n, HKV, D).transpose(1, 2)
    else:
        flat = sel.rows.view(-1)
        k = cache.k_rows.index_select(0, flat).view(B, HKV, sel.n, D)
        v = cache.v_rows.index_select(0, flat).view(B, HKV, sel.n, D)
    return k, v


def torch_attention_fn(torch, cache, sel, q, scale, form):
    """gather + scaled_dot_product_attention, one of TORCH_FORMS; returns a callable -> out [B, Hq, D]."""
    F = torch.nn.functional
    B, Hq, _ = q.shape
    g = Hq // HKV
    q_fold = q.view(B, HKV, g, D)   # query heads of a KV head as query positions (no mask at decode)
    q_head = q.view(B, Hq, 1, D)

    if form == "fold":
        def fn():
            k, v = torch_gather(cache, sel, B)
            return F.scaled_dot_product_attention(q_fold, k, v, scale=scale).view(B, Hq, D)
    elif form == "gqa":
        def fn():
            k, v = torch_gather(cache, sel, B)
            return F.scaled_dot_product_attention(q_head, k, v, scale=scale, enable_gqa=True).view(B, Hq, D)
    else:
        def fn():
            k, v = torch_gather(cache, sel, B)
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return F.scaled_dot_product_attention(q_head, k, v, scale=scale).view(B, Hq, D)
    return fn


def torch_reference(torch, cache, sel, q, scale):
    """float32 out and lse from the gathered K/V (the correctness reference)."""
    B, Hq, _ = q.shape
    k, v = torch_gather(cache, sel, B)
    qf = q.view(B, HKV, Hq // HKV, D).float()
    s = torch.einsum("bhgd,bhnd->bhgn", qf, k.float()) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), v.float())
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def _time_methods(cell, errors, fns, timer, args, torch, dev):
    """cell["methods"][name] = the timing of each (name, fn); a failure goes to errors[name]."""
    for name, fn in fns:
        try:
            cell["methods"][name], mode = _timed(timer, fn, args)
            if mode != "graph":
                cell.setdefault("warm_mode", {})[name] = mode
        except Exception as e:
            errors[name] = _err(e)
            _sync(torch, dev)


def _timed(timer, fn, args, warm=True, cold=True):
    """{"warm": .., "cold": ..} and the warm mode ("graph" or why eager)."""
    r, mode = {}, "graph"
    if warm:
        try:
            r["warm"] = timer.graph(fn, args.graph_calls, args.reps)
        except H.GraphCaptureError as e:
            mode = f"eager (graph capture failed: {e})"
            r["warm"] = timer.events(fn, args.reps)
    if cold:
        r["cold"] = timer.events(fn, args.cold_reps, cold=True)
        if mode == "graph" and hasattr(timer, "capture"):
            cg = cold_graph(timer, fn, args)
            if cg is not None:
                r["cold_g"] = cg
    return r, mode


_FLUSH_GRAPH = {}


def cold_graph(timer, fn, args):
    """Cold L2 without the events' fixed cost (a 4-byte fill measures ~4 µs cold with events, ~1.3 µs in a
    graph on H100): per call = (replay of a graph of `calls` x [L2 flush, fn] - replay of a graph of
    `calls` x [L2 flush]) / calls, medians over replays. None if capture fails."""
    calls = args.graph_calls
    timer.flush_l2()  # allocate the flush buffer outside the capture
    try:
        if timer not in _FLUSH_GRAPH:
            g0 = timer.capture(timer.flush_l2, calls)
            _FLUSH_GRAPH[timer] = (g0, timer.replay(g0, calls, 3 * args.reps)["median_us"])
        flush_us = _FLUSH_GRAPH[timer][1]

        def both():
            timer.flush_l2()
            fn()

        g = timer.capture(both, calls)
        t = timer.replay(g, calls, args.reps)
        del g
    except H.GraphCaptureError:
        return None
    return {"median_us": t["median_us"] - flush_us, "p10_us": t["p10_us"] - flush_us, "p90_us": t["p90_us"] - flush_us,
            "min_us": t["min_us"] - flush_us, "runs": t["runs"], "flush_us": flush_us}


def _sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def attention_cell(gvr, torch, timer, cache, gen, wl, B, n, args, bw):
    dev = timer.device
    spec = WORKLOADS[wl]
    scale = 1.0 / math.sqrt(D)
    sel = torch_selection(torch, dev, gen, cache.block_table, wl, B, n, cache.context)
    q = torch.randn(B, HQ, D, generator=gen, device=dev).to(cache.k.dtype)
    nbytes = kv_bytes(B, sel.n, cache.k.element_size())
    cell = {"section": "attention", "workload": wl, "n": sel.n, "b": B, "G": spec["G"],
            "hsel": 1 if spec["shared"] else HKV, "entries": int(sel.idx.shape[-1]), "bytes": nbytes,
            "floor_us": H.floor_us(nbytes, bw), "methods": {}, "correct": {}, "diff": {}}
    errors = {}
    out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, HQ, dtype=torch.float32, device=dev)
    kw = {"block_table": cache.block_table[:B], "block_size": spec["G"]} if spec["table"] else {}

    def gvr_fn():
        return gvr.sparse_attention(q, cache.k, cache.v, sel.idx, scale=scale, out=out, lse=lse, **kw)

    ref_out, ref_lse = torch_reference(torch, cache, sel, q, scale)
    tol = OUT_RTOL * float(ref_out.abs().max()) + 1e-6
    cell["tolerance"] = {"out_abs": tol, "lse_abs": LSE_ATOL}
    # torch forms: eager result, then warm timing; the fastest warm form is "torch"
    forms, torch_out = {}, None
    for form in TORCH_FORMS:
        fn = torch_attention_fn(torch, cache, sel, q, scale, form)
        try:
            o = fn()
            _sync(torch, dev)
            d = float((o.float() - ref_out).abs().max())
            cell["diff"][f"torch_{form}_vs_ref"] = d
            r, mode = _timed(timer, fn, args, cold=False)
            forms[form] = (r, fn, mode)
            if torch_out is None or r["warm"]["median_us"] < forms[cell["torch_form"]][0]["warm"]["median_us"]:
                cell["torch_form"], torch_out = form, o
            cell["methods"][f"torch_{form}"] = r
        except Exception as e:  # a torch form that does not run is noted, not a failure of the cell
            cell.setdefault("baseline_errors", {})[f"torch_{form}"] = _err(e)
            print(f"  (torch form {form!r} skipped: {_err(e)[:120]})", flush=True)
            _sync(torch, dev)
        del fn
    if forms:
        r, fn, mode = forms[cell["torch_form"]]
        r = dict(r)
        r.update(_timed(timer, fn, args, warm=False)[0])
        cell["methods"]["torch"] = r
        cell["torch_warm_mode"] = mode
    forms.clear()
    # gvr: correctness once (eager), then warm (graph) and cold
    try:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        gvr_fn()
        _sync(torch, dev)
        eager = out.clone()
        d_ref = float((out.float() - ref_out).abs().max())
        d_lse = float((lse - ref_lse).abs().max())
        d_torch = float((out.float() - torch_out.float()).abs().max()) if torch_out is not None else None
        cell["diff"].update({"gvr_vs_torch": d_torch, "gvr_vs_ref": d_ref, "lse_vs_ref": d_lse})
        ok = math.isfinite(d_ref) and d_ref <= tol and math.isfinite(d_lse) and d_lse <= LSE_ATOL
        if d_torch is not None:
            ok = ok and d_torch <= tol
        cell["correct"]["gvr"] = bool(ok)
        if not ok:
            print(f"  !! {wl} n={sel.n} B={B}: gvr differs: |out - torch| {d_torch}, |out - ref| {d_ref:.3g}, "
                  f"|lse - ref| {d_lse:.3g} (tolerance {tol:.3g}, {LSE_ATOL})", flush=True)
        r, mode = _timed(timer, gvr_fn, args, cold=False)
        _sync(torch, dev)
        same = bool(torch.equal(out, eager))  # the warm timing's last call (graph replay) vs the eager call
        cell["replay_bitwise_equal"] = same
        if not same:
            d = float((out.float() - eager.float()).abs().max())
            cell["correct"]["gvr_replay"] = d <= tol
            print(f"  !! {wl} n={sel.n} B={B}: gvr result after graph replay differs from the eager one by {d:.3g}",
                  flush=True)
        r.update(_timed(timer, gvr_fn, args, warm=False)[0])
        cell["methods"]["gvr"] = r
        cell["warm_mode"] = mode
    except Exception as e:
        traceback.print_exc()
        errors["gvr"] = _err(e)
        cell["correct"]["gvr"] = False
        _sync(torch, dev)
    for m, r in cell["methods"].items():
        for mode in ("warm", "cold", "cold_g"):
            if mode in r:
                r[mode]["gbps"] = H.gbps(nbytes, r[mode]["median_us"])
    sp = {}
    for mode in ("warm", "cold"):
        sp[f"torch_over_gvr_{mode}"] = H.ratio(value(cell, "torch", mode), value(cell, "gvr", mode))
        sp[f"floor_over_gvr_{mode}"] = H.ratio(cell["floor_us"], value(cell, "gvr", mode))
    cell["speedup"] = sp
    _merge_errors(cell, errors)
    if not cell["methods"]:
        cell["error"] = "; ".join(f"{m}: {e}" for m, e in errors.items())
    return cell


class Fp8Cache:
    """The bf16 cache quantized to fp8 e4m3fn with one scale per tensor (x / FP8_SCALE rounded), the
    views torch_gather reads."""

    def __init__(self, torch, cache):
        self.k = torch.empty(cache.k.shape, dtype=torch.float8_e4m3fn, device=cache.k.device)
        self.v = torch.empty_like(self.k)
        step = max(1, (256 << 20) // (P * HKV * D))
        for dst, src in ((self.k, cache.k), (self.v, cache.v)):
            for i in range(0, dst.shape[0], step):
                # clamped to e4m3's range first: torch converts values past +-448 to NaN, not to +-448
                dst[i:i + step] = (src[i:i + step].float() / FP8_SCALE).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        self.block_table, self.context = cache.block_table, cache.context
        self.k_rows, self.v_rows = self.k.view(-1, D), self.v.view(-1, D)
        self.k_slots, self.v_slots = self.k.view(-1, HKV * D), self.v.view(-1, HKV * D)


def fp8_cells(gvr, torch, timer, cache, gen, args, bw, grid):
    """gvr over the fp8 cache (k_scale, v_scale) vs gvr over the bf16 cache and vs torch: gather the fp8 rows,
    dequantize to bf16, SDPA (what a caller without an fp8 kernel runs). Floor = the selected fp8 bytes."""
    dev = timer.device
    c8 = Fp8Cache(torch, cache)
    _sync(torch, dev)
    F = torch.nn.functional
    cells = []
    for B, wl, n in grid:
        spec = WORKLOADS[wl]
        scale = 1.0 / math.sqrt(D)
        sel = torch_selection(torch, dev, gen, cache.block_table, wl, B, n, cache.context)
        q = torch.randn(B, HQ, D, generator=gen, device=dev).to(torch.bfloat16)
        nbytes = kv_bytes(B, sel.n, 1)
        cell = {"section": "fp8", "workload": wl, "n": sel.n, "b": B, "bytes": nbytes, "floor_us": H.floor_us(nbytes, bw),
                "methods": {}, "correct": {}, "diff": {}}
        errors = {}
        out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev)
        lse = torch.empty(B, HQ, dtype=torch.float32, device=dev)
        kw = {"block_table": cache.block_table[:B], "block_size": spec["G"]} if spec["table"] else {}
        g = HQ // HKV

        def gvr_fp8():
            return gvr.sparse_attention(q, c8.k, c8.v, sel.idx, scale=scale, out=out, lse=lse, k_scale=FP8_SCALE,
                                        v_scale=FP8_SCALE, **kw)

        def gvr_bf16():
            return gvr.sparse_attention(q, cache.k, cache.v, sel.idx, scale=scale, out=out, lse=lse, **kw)

        def torch_fp8():
            k, v = torch_gather(c8, sel, B)
            k = k.to(torch.bfloat16) * FP8_SCALE
            v = v.to(torch.bfloat16) * FP8_SCALE
            return F.scaled_dot_product_attention(q.view(B, HKV, g, D), k, v, scale=scale).view(B, HQ, D)

        # the reference: float32 attention over the dequantized rows
        k, v = torch_gather(c8, sel, B)
        qf = q.view(B, HKV, g, D).float()
        sc = torch.einsum("bhgd,bhnd->bhgn", qf, k.float() * FP8_SCALE) * scale
        ref_lse = torch.logsumexp(sc, -1).reshape(B, HQ)
        ref_out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(sc, -1), v.float() * FP8_SCALE).reshape(B, HQ, D)
        del k, v, sc
        tol = OUT_RTOL * float(ref_out.abs().max()) + 1e-6
        try:
            gvr_fp8()
            _sync(torch, dev)
            d_ref = float((out.float() - ref_out).abs().max())
            d_lse = float((lse - ref_lse).abs().max())
            cell["diff"].update({"gvr_fp8_vs_ref": d_ref, "lse_vs_ref": d_lse})
            cell["correct"]["gvr_fp8"] = bool(math.isfinite(d_ref) and d_ref <= tol and d_lse <= LSE_ATOL)
            to = torch_fp8()
            _sync(torch, dev)
            cell["diff"]["torch_fp8_vs_ref"] = float((to.float() - ref_out).abs().max())
        except Exception as e:
            traceback.print_exc()
            errors["gvr_fp8"] = _err(e)
            cell["correct"]["gvr_fp8"] = False
            _sync(torch, dev)
        _time_methods(cell, errors, (("gvr_fp8", gvr_fp8), ("gvr_bf16", gvr_bf16), ("torch_fp8", torch_fp8)), timer,
                      args, torch, dev)
        for m, r in cell["methods"].items():
            for mode in ("warm", "cold", "cold_g"):
                if mode in r:
                    r[mode]["gbps"] = H.gbps(nbytes * (2 if m == "gvr_bf16" else 1), r[mode]["median_us"])
        sp = {}
        for mode in ("warm", "cold"):
            sp[f"bf16_over_fp8_{mode}"] = H.ratio(value(cell, "gvr_bf16", mode), value(cell, "gvr_fp8", mode))
            sp[f"torch_over_fp8_{mode}"] = H.ratio(value(cell, "torch_fp8", mode), value(cell, "gvr_fp8", mode))
        cell["speedup"] = sp
        _merge_errors(cell, errors)
        cells.append(cell)
        _print_row(FP8_HEADERS, fp8_row(cell), not cells[:-1])
    del c8
    return cells


def repair_cells(gvr, torch, timer, cache, gen, args, bw, pred_blocks, missed_list):
    """prr.repair of m missed 64-token blocks (B = 1, Hsel = Hkv) against recomputing over
    predicted ∪ missed; one cell per m."""
    dev, B, G = timer.device, 1, 64
    scale = 1.0 / math.sqrt(D)
    mmax = max(missed_list)
    perm = torch.rand(B, HKV, cache.context // G, generator=gen, device=dev).argsort(-1)
    pred_b = perm[..., :pred_blocks]
    extra_b = perm[..., pred_blocks:pred_blocks + mmax]
    q = torch.randn(B, HQ, D, generator=gen, device=dev).to(cache.k.dtype)
    bt = cache.block_table[:B]
    kw = {"block_table": bt, "block_size": G}
    pred = pred_b.to(torch.int32).contiguous()
    base_out = torch.empty(B, HQ, D, dtype=torch.float32, device=dev)
    base_lse = torch.empty(B, HQ, dtype=torch.float32, device=dev)
    cells = []
    try:
        gvr.sparse_attention(q, cache.k, cache.v, pred, scale=scale, out=base_out, lse=base_lse, **kw)
        _sync(torch, dev)
    except Exception as e:
        traceback.print_exc()
        return [{"section": "repair", "workload": "repair", "missed": m, "n": m * G, "b": B,
                 "error": f"predicted state: {_err(e)}"} for m in missed_list]
    for m in missed_list:
        cell = {"section": "repair", "workload": "repair", "missed": m, "n": m * G, "b": B,
                "predicted_blocks": pred_blocks, "methods": {}, "correct": {}, "diff": {}}
        errors = {}
        try:
            miss_b = extra_b[..., :m]
            compact = (miss_b.to(torch.int32) if m else torch.full((B, HKV, 1), -1, dtype=torch.int32, device=dev)).contiguous()
            selected = torch.cat([pred_b[..., m:], miss_b], -1).to(torch.int32).contiguous()  # 64 - m hits + m misses
            union = torch.cat([pred_b, miss_b], -1).to(torch.int32).contiguous()
            o_rep, l_rep = base_out.clone(), base_lse.clone()
            o_pad, l_pad = base_out.clone(), base_lse.clone()
            o_re = torch.empty_like(base_out)
            l_re = torch.empty_like(base_lse)
            padded = torch.empty_like(selected)
            # correctness once: repair(predicted state, missed) == sparse_attention(predicted ∪ missed)
            gvr.sparse_attention(q, cache.k, cache.v, union, scale=scale, out=o_re, lse=l_re, **kw)
            gvr.prr.missed(selected, pred, out=padded)
            gvr.prr.repair(o_rep, l_rep, q, cache.k, cache.v, compact, scale=scale, **kw)
            gvr.prr.repair(o_pad, l_pad, q, cache.k, cache.v, padded, scale=scale, **kw)
            _sync(torch, dev)
            exp_pad = torch.full_like(selected, -1)
            exp_pad[..., :m] = miss_b.to(torch.int32)
            ok_missed = bool(torch.equal(padded, exp_pad))
            tol = F32_RTOL * float(o_re.abs().max()) + 1e-6
            for name, (o, l) in {"repair": (o_rep, l_rep), "repair_padded": (o_pad, l_pad)}.items():
                d, dl = float((o - o_re).abs().max()), float((l - l_re).abs().max())
                cell["diff"][name] = d
                cell["diff"][name + "_lse"] = dl
                cell["correct"][name] = math.isfinite(d) and d <= tol and math.isfinite(dl) and dl <= 1e-4
            cell["correct"]["missed"] = ok_missed
            cell["tolerance"] = {"out_abs": tol, "lse_abs": 1e-4}
            if not all(cell["correct"].values()):
                print(f"  !! repair m={m}: {cell['correct']} diffs {cell['diff']}", flush=True)
            fns = {
                "repair": lambda: gvr.prr.repair(o_rep, l_rep, q, cache.k, cache.v, compact, scale=scale, **kw),
                "repair_padded": lambda: gvr.prr.repair(o_pad, l_pad, q, cache.k, cache.v, padded, scale=scale, **kw),
                "recompute": lambda: gvr.sparse_attention(q, cache.k, cache.v, union, scale=scale, out=o_re, lse=l_re, **kw),
                "missed": lambda: gvr.prr.missed(selected, pred, out=padded),
            }
            _time_methods(cell, errors, fns.items(), timer, args, torch, dev)
        except Exception as e:
            traceback.print_exc()
            errors["setup"] = _err(e)
            cell["correct"]["repair"] = False
            _sync(torch, dev)
        cell["speedup"] = {f"recompute_over_repair_{mode}": H.ratio(value(cell, "recompute", mode), value(cell, "repair", mode))
                           for mode in ("warm", "cold")}
        _merge_errors(cell, errors)
        if not cell["methods"]:
            cell["error"] = "; ".join(f"{k}: {e}" for k, e in errors.items())
        cells.append(cell)
        print(H.format_table(REPAIR_HEADERS, [repair_row(cell)]).splitlines()[-1], flush=True)
    return cells


def merge_cells(gvr, torch, timer, gen, args):
    dev, Hm = timer.device, 32
    cells = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        cell = {"section": "merge", "workload": "merge", "dtype": dtype_name, "n": Hm * D, "b": 1, "shape": [Hm, D],
                "methods": {}, "correct": {}, "diff": {}}
        errors = {}
        try:
            va = torch.randn(Hm, D, generator=gen, device=dev).to(dtype)
            vb = torch.randn(Hm, D, generator=gen, device=dev).to(dtype)
            la = (torch.randn(Hm, generator=gen, device=dev) * 2 + 8).float()
            lb = (torch.randn(Hm, generator=gen, device=dev) * 2 + 8).float()
            vo, lo = torch.empty_like(va), torch.empty_like(la)

            def torch_merge():  # the eager formula in torch ops (float32 arithmetic, out in the states' dtype)
                m = torch.maximum(la, lb)
                wa, wb = torch.exp(la - m), torch.exp(lb - m)
                s = wa + wb
                o = (va.float() * wa[:, None] + vb.float() * wb[:, None]) / s[:, None]
                return o.to(dtype), m + torch.log(s)

            def gvr_merge():
                return gvr.merge_states(va, la, vb, lb, out=vo, lse=lo)

            to, tl = torch_merge()
            gvr_merge()
            _sync(torch, dev)
            d, dl = float((vo.float() - to.float()).abs().max()), float((lo - tl).abs().max())
            tol = (F32_RTOL if dtype_name == "float32" else 2 ** -7) * float(to.float().abs().max()) + 1e-6
            cell["diff"] = {"gvr_vs_torch": d, "lse": dl}
            cell["tolerance"] = {"out_abs": tol, "lse_abs": 1e-5}
            cell["correct"]["gvr"] = math.isfinite(d) and d <= tol and dl <= 1e-5 * max(1.0, float(tl.abs().max()))
            _time_methods(cell, errors, (("gvr", gvr_merge), ("torch", torch_merge)), timer, args, torch, dev)
        except Exception as e:
            traceback.print_exc()
            errors["gvr"] = _err(e)
            cell["correct"]["gvr"] = False
            _sync(torch, dev)
        cell["speedup"] = {f"torch_over_gvr_{mode}": H.ratio(value(cell, "torch", mode), value(cell, "gvr", mode))
                           for mode in ("warm", "cold")}
        _merge_errors(cell, errors)
        if not cell["methods"]:
            cell["error"] = "; ".join(f"{k}: {e}" for k, e in errors.items())
        cells.append(cell)
    return cells


ATTN_HEADERS = ["sel", "tokens", "B", "c:gvr", "cg:gvr", "c:torch", "c:torch/gvr", "c:GB/s", "floor", "c:floor/gvr",
                "w:gvr", "w:torch", "w:torch/gvr", "w:GB/s", "torch form", "max diff", "check"]
REPAIR_HEADERS = ["missed", "c:repair", "cg:repair", "c:repair(pad)", "c:recompute", "c:recomp/repair", "w:repair",
                  "w:repair(pad)", "w:recompute", "w:recomp/repair", "c:missed", "max diff", "check"]
MERGE_HEADERS = ["dtype", "states", "c:gvr", "cg:gvr", "c:torch", "c:torch/gvr", "w:gvr", "w:torch", "w:torch/gvr", "max diff", "check"]
CPU_HEADERS = ["sel", "tokens", "B", "gvr (C)", "np einsum", "np matmul", "numpy/gvr", "gvr GB/s", "max diff", "check"]


def _check(c):
    if c.get("errors"):
        s = "ERR:" + ",".join(c["errors"])
    elif c.get("correct") and all(c["correct"].values()):
        s = "ok"
    else:
        s = "FAIL:" + ",".join(m for m, ok in (c.get("correct") or {}).items() if not ok)
    wm = c.get("warm_mode", "graph")
    if wm != "graph":
        s += " (warm eager)"
    return s


def _gb(c, m, mode):
    g = ((c.get("methods") or {}).get(m) or {}).get(mode, {}).get("gbps")
    return "-" if g is None else f"{g:.0f}"


def _d(v):
    return "-" if v is None else f"{v:.1e}"


def attention_row(c):
    head = [c["workload"], H.fmt_n(c["n"]), c["b"]]
    if c.get("error") and not c.get("methods"):
        return head + ["ERROR: " + c["error"].splitlines()[-1][:90]]
    v = lambda m, mode: H.fmt_us(value(c, m, mode))  # noqa: E731
    s = c.get("speedup", {})
    return head + [v("gvr", "cold"), v("gvr", "cold_g"), v("torch", "cold"), H.fmt_x(s.get("torch_over_gvr_cold")),
                   _gb(c, "gvr", "cold"),
                   H.fmt_us(c.get("floor_us")), H.fmt_x(s.get("floor_over_gvr_cold")),
                   v("gvr", "warm"), v("torch", "warm"), H.fmt_x(s.get("torch_over_gvr_warm")), _gb(c, "gvr", "warm"),
                   c.get("torch_form", "-"), _d(c.get("diff", {}).get("gvr_vs_torch")), _check(c)]


FP8_HEADERS = ["sel", "tokens", "B", "cg:fp8", "cg:bf16", "cg:bf16/fp8", "c:torch(fp8)", "c:torch/fp8", "cg:GB/s",
               "floor", "w:fp8", "w:bf16", "w:bf16/fp8", "max diff", "check"]


def fp8_row(c):
    head = [c["workload"], H.fmt_n(c["n"]), c["b"]]
    if c.get("error") and not c.get("methods"):
        return head + ["ERROR: " + c["error"].splitlines()[-1][:90]]
    v = lambda m, mode: H.fmt_us(value(c, m, mode))  # noqa: E731
    r = lambda a, b, mode: H.fmt_x(H.ratio(value(c, a, mode), value(c, b, mode)))  # noqa: E731
    return head + [v("gvr_fp8", "cold_g"), v("gvr_bf16", "cold_g"), r("gvr_bf16", "gvr_fp8", "cold_g"),
                   v("torch_fp8", "cold"), r("torch_fp8", "gvr_fp8", "cold"), _gb(c, "gvr_fp8", "cold_g"),
                   H.fmt_us(c.get("floor_us")), v("gvr_fp8", "warm"), v("gvr_bf16", "warm"),
                   r("gvr_bf16", "gvr_fp8", "warm"), _d(c.get("diff", {}).get("gvr_fp8_vs_ref")),
                   "ok" if c.get("correct", {}).get("gvr_fp8") else "FAIL"]


def repair_row(c):
    head = [c["missed"]]
    if c.get("error") and not c.get("methods"):
        return head + ["ERROR: " + c["error"].splitlines()[-1][:90]]
    v = lambda m, mode: H.fmt_us(value(c, m, mode))  # noqa: E731
    s = c.get("speedup", {})
    d = c.get("diff", {})
    dd = max([x for x in (d.get("repair"), d.get("repair_padded")) if x is not None], default=None)
    return head + [v("repair", "cold"), v("repair", "cold_g"), v("repair_padded", "cold"), v("recompute", "cold"),
                   H.fmt_x(s.get("recompute_over_repair_cold")), v("repair", "warm"), v("repair_padded", "warm"),
                   v("recompute", "warm"), H.fmt_x(s.get("recompute_over_repair_warm")), v("missed", "cold"), _d(dd), _check(c)]


def merge_row(c):
    head = [c["dtype"], "x".join(map(str, c.get("shape", [])))]
    if c.get("error") and not c.get("methods"):
        return head + ["ERROR: " + c["error"].splitlines()[-1][:90]]
    v = lambda m, mode: H.fmt_us(value(c, m, mode))  # noqa: E731
    s = c.get("speedup", {})
    return head + [v("gvr", "cold"), v("gvr", "cold_g"), v("torch", "cold"), H.fmt_x(s.get("torch_over_gvr_cold")), v("gvr", "warm"),
                   v("torch", "warm"), H.fmt_x(s.get("torch_over_gvr_warm")), _d(c.get("diff", {}).get("gvr_vs_torch")), _check(c)]


def _print_row(headers, row, first):
    if first:
        print(H.format_table(headers, []).split("\n")[0], flush=True)
    print(H.format_table(headers, [row]).splitlines()[-1], flush=True)


def run_cuda(gvr, torch, args, meta, simulate=False):
    """The CUDA sections (attention table, repair, merge); simulate: on torch CPU tensors, small."""
    if simulate:
        timer, dev = HostTimer(torch), torch.device("cpu")
        grid, context = SIM["grid"], SIM["context"]
        pred_blocks, missed_list = SIM["pred_blocks"], SIM["missed"]
        meta.update(H.header(torch, ROOT))
        meta["simulated"] = "CUDA sections run on torch CPU tensors at small sizes: times are not meaningful"
    else:
        timer, dev = H.CudaTimer(torch), torch.device("cuda", torch.cuda.current_device())
        # the GPU sleep queued ahead of each eager timed call must outlast the host time of launching it
        # (gvr's wrappers export 7-9 tensors; torch's eager merge launches ~8 kernels): the harness's 50 µs
        # default left launch gaps inside the cold spans (measured on H100: 25 µs cold vs 3 µs warm)
        timer.SLEEP_CYCLES = args.sleep_cycles
        grid, context = GRID["quick" if args.quick else "full"], args.context
        pred_blocks, missed_list = REPAIR_PRED_BLOCKS, REPAIR_MISSED
        meta.update(H.header(torch, ROOT, cuda=True))
    bw = timer.copy_bandwidth()
    meta["copy_bandwidth_gbps"] = bw / 1e9
    meta["warm_timing"] = (f"CUDA graph of {args.graph_calls} back-to-back calls captured on a side stream, replayed "
                           f"{args.reps} times; per call = replay time / {args.graph_calls}; median over replays")
    meta["cold_timing"] = (f"eager, CUDA events around each call ({args.cold_reps} calls), "
                           f"{timer.flush_bytes >> 20} MB written before each call, a GPU sleep of "
                           f"{getattr(timer, 'SLEEP_CYCLES', 0)} cycles queued ahead (no launch gap in the span)")
    if hasattr(timer, "capture"):  # what the methods measure for a trivial kernel (a 4-byte fill)
        tiny = torch.zeros(1, device=dev)
        f = lambda: tiny.zero_()  # noqa: E731
        meta["timing_floor_us"] = {"warm": timer.graph(f, args.graph_calls, args.reps)["median_us"],
                                   "cold": timer.events(f, args.cold_reps, cold=True)["median_us"],
                                   "cold_g": (cold_graph(timer, f, args) or {}).get("median_us")}
        del tiny
    meta["cold_g_timing"] = (f"per call = (replay of a CUDA graph of {args.graph_calls} x [L2 flush, call] - replay of a "
                             f"graph of {args.graph_calls} x [L2 flush]) / {args.graph_calls}, medians over {args.reps} replays")
    rows_needed = max(grid)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    t0 = time.perf_counter()
    cache = Cache(torch, dev, gen, rows_needed, context, torch.bfloat16)
    _sync(torch, dev)
    meta["cache"] = (f"K, V [{cache.num_pages}, {P}, {HKV}, {D}] bf16 N(0,1) each ({cache.nbytes / 2**30:.1f} GiB "
                     f"K+V), {rows_needed} rows of {context} tokens, block_table rows = a random permutation of all "
                     f"pages; built in {time.perf_counter() - t0:.1f} s")
    meta["setup"] = {"Hq": HQ, "Hkv": HKV, "D": D, "P": P, "dtype": "bfloat16", "context": context}
    print(H.header_line(meta))
    if simulate:
        print("# SIMULATED on the CPU (--simulate-on-cpu): times are not meaningful")
    print(f"# Hq {HQ}, Hkv {HKV}, D {D}, bf16; {meta['cache']}")
    print(f"# warm L2: {meta['warm_timing']}\n# cold L2: {meta['cold_timing']}")
    print(f"# cold_g (cg:): per call = (graph of {args.graph_calls} x [L2 flush, call] - graph of {args.graph_calls} x "
          f"[L2 flush]) / {args.graph_calls}: cold L2 without the events' fixed cost")
    if meta.get("timing_floor_us"):
        tf = meta["timing_floor_us"]
        print("# timing floor (a 4-byte torch fill measured the same ways): "
              + ", ".join(f"{k} {H.fmt_us(v)} us" for k, v in tf.items()))
    print(f"# device copy bandwidth {bw / 1e9:.0f} GB/s (read + write): floor = selected K+V bytes / that", flush=True)
    cells = []
    print("\n## sparse_attention: gvr vs torch gather + scaled_dot_product_attention (median us per call)", flush=True)
    first = True
    for B, sels in grid.items():
        for wl, n in sels:
            try:
                c = attention_cell(gvr, torch, timer, cache, gen, wl, B, n, args, bw)
            except Exception as e:
                traceback.print_exc()
                c = {"section": "attention", "workload": wl, "n": n, "b": B, "error": _err(e)}
                _sync(torch, dev)
            cells.append(c)
            _print_row(ATTN_HEADERS, attention_row(c), first)
            first = False
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if not args.no_fp8 and hasattr(torch, "float8_e4m3fn"):
        print(f"\n## fp8 (e4m3fn) caches, k_scale = v_scale = {FP8_SCALE:.4g}: gvr fp8 vs gvr bf16 vs torch (gather fp8, "
              "dequantize, SDPA) (median us per call)", flush=True)
        fgrid = FP8_GRID["quick" if args.quick else "full"] if not simulate else [(1, "blocks64", 256), (2, "tokens", 256)]
        try:
            cells += fp8_cells(gvr, torch, timer, cache, gen, args, bw, fgrid)
        except Exception as e:
            traceback.print_exc()
            cells.append({"section": "fp8", "workload": "fp8", "n": None, "b": None, "error": _err(e)})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n## prr.repair (B=1, predicted {pred_blocks} blocks of 64 tokens per KV head) vs recompute over "
          f"predicted ∪ missed (median us per call)", flush=True)
    print(H.format_table(REPAIR_HEADERS, []).split("\n")[0], flush=True)
    try:
        cells += repair_cells(gvr, torch, timer, cache, gen, args, bw, pred_blocks, missed_list)
    except Exception as e:
        traceback.print_exc()
        cells.append({"section": "repair", "workload": "repair", "missed": None, "n": None, "b": 1, "error": _err(e)})
    del cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print("\n## merge_states of two [32 x 128] states vs the eager torch formula (median us per call)", flush=True)
    mc = merge_cells(gvr, torch, timer, gen, args)
    print(H.format_table(MERGE_HEADERS, [merge_row(c) for c in mc]), flush=True)
    cells += mc
    meta["cuda_elapsed_s"] = time.perf_counter() - t0
    return cells


# --------------------------------------------------------------------------------------------------
# CPU section
# --------------------------------------------------------------------------------------------------


def numpy_gather(k, v, sel, B):
    """[B, Hkv, n, D] K and V gathered from the NumPy paged cache (np.take of rows)."""
    if sel.shared:
        ks, vs = k.reshape(-1, HKV * D), v.reshape(-1, HKV * D)
        kg = np.take(ks, sel.rows.reshape(-1), axis=0).reshape(B, sel.n, HKV, D).transpose(0, 2, 1, 3)
        vg = np.take(vs, sel.rows.reshape(-1), axis=0).reshape(B, sel.n, HKV, D).transpose(0, 2, 1, 3)
    else:
        kr, vr = k.reshape(-1, D), v.reshape(-1, D)
        kg = np.take(kr, sel.rows.reshape(-1), axis=0).reshape(B, HKV, sel.n, D)
        vg = np.take(vr, sel.rows.reshape(-1), axis=0).reshape(B, HKV, sel.n, D)
    return kg, vg


def numpy_attention(q, k, v, sel, scale, form):
    """NumPy sparse attention: gather + einsum (or matmul) + softmax -> (out [B, Hq, D], lse [B, Hq])."""
    B = q.shape[0]
    kg, vg = numpy_gather(k, v, sel, B)
    qg = q.reshape(B, HKV, HQ // HKV, D)
    if form == "einsum":
        s = np.einsum("bhgd,bhnd->bhgn", qg, kg)
    else:
        s = np.matmul(qg, kg.swapaxes(-1, -2))
    s *= scale
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    o = np.einsum("bhgn,bhnd->bhgd", p, vg) if form == "einsum" else np.matmul(p, vg)
    o /= denom
    return o.reshape(B, HQ, D), (m + np.log(denom)).reshape(B, HQ)


def run_cpu(gvr, args, meta):
    context = args.cpu_context
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    pages = context // P
    k = rng.standard_normal((pages, P, HKV, D), dtype=np.float32)
    v = rng.standard_normal((pages, P, HKV, D), dtype=np.float32)
    bt = rng.permutation(pages).astype(np.int32).reshape(1, pages)
    meta["cpu_cache"] = (f"K, V [{pages}, {P}, {HKV}, {D}] float32 N(0,1) ({2 * k.nbytes / 2**20:.0f} MiB K+V), one row of "
                         f"{context} tokens, shuffled pages; built in {time.perf_counter() - t0:.1f} s")
    meta["cpu_timing"] = (f"time.perf_counter around each call, one input repeated, {args.budget:.2f} s a method "
                          "(at least 5 calls); gvr.set_num_threads(1); NumPy BLAS threads: "
                          + ", ".join(f"{x}={os.environ.get(x)}" for x in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")))
    print(f"\n## CPU: gvr's C path vs NumPy (gather + einsum/matmul + softmax), one core, float32, B=1, Hq {HQ}, "
          f"Hkv {HKV}, D {D} (median us per call)")
    print(f"# {meta['cpu_cache']}\n# {meta['cpu_timing']}", flush=True)
    scale = 1.0 / math.sqrt(D)
    cells = []
    prev_threads = gvr.get_num_threads() if hasattr(gvr, "get_num_threads") else None
    gvr.set_num_threads(1)
    try:
        for i, (wl, n) in enumerate(CPU_CELLS):
            spec = WORKLOADS[wl]
            cell = {"section": "cpu", "device": "cpu", "workload": wl, "n": n, "b": 1, "G": spec["G"], "threads": 1,
                    "hsel": 1 if spec["shared"] else HKV, "methods": {}, "correct": {}, "diff": {}}
            errors = {}
            try:
                sel = numpy_selection(rng, bt, wl, 1, n, context)
                q = rng.standard_normal((1, HQ, D), dtype=np.float32)
                kw = {"block_table": bt, "block_size": spec["G"]} if spec["table"] else {}
                nbytes = kv_bytes(1, sel.n, 4)
                cell["bytes"] = nbytes
                ref = {}
                for form in ("einsum", "matmul"):
                    ref[form] = numpy_attention(q, k, v, sel, scale, form)
                    cell["methods"][f"numpy_{form}"] = H.time_cpu(lambda f=form: numpy_attention(q, k, v, sel, scale, f),
                                                                  budget_s=args.budget, min_runs=5, max_runs=2000)
                best = min(("einsum", "matmul"), key=lambda f: cell["methods"][f"numpy_{f}"]["median_us"])
                cell["methods"]["numpy"] = dict(cell["methods"][f"numpy_{best}"], form=best)
                try:
                    o, lse = gvr.sparse_attention(q, k, v, sel.idx, scale=scale, **kw)
                    o, lse = np.asarray(o), np.asarray(lse)
                    ro, rl = ref["matmul"]
                    d, dl = float(np.abs(o - ro).max()), float(np.abs(lse - rl).max())
                    tol = F32_RTOL * float(np.abs(ro).max()) + 1e-6
                    cell["diff"] = {"gvr_vs_numpy": d, "lse": dl,
                                    "einsum_vs_matmul": float(np.abs(ref["einsum"][0] - ro).max())}
                    cell["tolerance"] = {"out_abs": tol, "lse_abs": 1e-4}
                    cell["correct"]["gvr"] = math.isfinite(d) and d <= tol and math.isfinite(dl) and dl <= 1e-4
                    if not cell["correct"]["gvr"]:
                        print(f"  !! CPU {wl} n={n}: gvr differs from NumPy: out {d:.3g}, lse {dl:.3g}", flush=True)
                    cell["methods"]["gvr"] = H.time_cpu(lambda: gvr.sparse_attention(q, k, v, sel.idx, scale=scale, **kw),
                                                        budget_s=args.budget, min_runs=5, max_runs=20000)
                except Exception as e:
                    traceback.print_exc()
                    errors["gvr"] = _err(e)
                    cell["correct"]["gvr"] = False
                for m, t in cell["methods"].items():
                    t["gbps"] = H.gbps(nbytes, t["median_us"])
                cell["speedup"] = {"numpy_over_gvr": H.ratio(value(cell, "numpy"), value(cell, "gvr"))}
            except Exception as e:
                traceback.print_exc()
                errors["setup"] = _err(e)
            _merge_errors(cell, errors)
            if not cell["methods"]:
                cell["error"] = "; ".join(f"{x}: {e}" for x, e in errors.items())
            cells.append(cell)
            _print_row(CPU_HEADERS, cpu_row(cell), i == 0)
    finally:
        gvr.set_num_threads(prev_threads or 0)
    return cells


def cpu_row(c):
    head = [c["workload"], H.fmt_n(c["n"]), c["b"]]
    if c.get("error") and not c.get("methods"):
        return head + ["ERROR: " + c["error"].splitlines()[-1][:90]]
    v = lambda m: H.fmt_us(value(c, m))  # noqa: E731
    g = (c["methods"].get("gvr") or {}).get("gbps")
    return head + [v("gvr"), v("numpy_einsum"), v("numpy_matmul"), H.fmt_x((c.get("speedup") or {}).get("numpy_over_gvr")),
                   "-" if g is None else f"{g:.1f}", _d(c.get("diff", {}).get("gvr_vs_numpy")), _check(c)]


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few cells (B=1 table, B=64 at 2K tokens, repair, merge) for the device check")
    p.add_argument("--cpu-only", action="store_true", help="the CPU section only (also what runs without CUDA)")
    p.add_argument("--no-fp8", action="store_true", help="CUDA: skip the fp8-cache section")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="JSON output (default benchmarks/results_attention_<cuda|cpu>.json)")
    p.add_argument("--append-results", default=None, metavar="PATH", help="append a markdown section to PATH")
    p.add_argument("--bars", default=os.path.join(HERE, "bars.json"), help="acceptance bars (default benchmarks/bars.json)")
    p.add_argument("--context", type=int, default=CONTEXT, help="CUDA: tokens per row of the paged cache (default 128K)")
    p.add_argument("--cpu-context", type=int, default=32768, help="CPU: tokens of the paged cache (default 32K)")
    p.add_argument("--reps", type=int, default=20, help="CUDA warm: timed graph replays per method and cell")
    p.add_argument("--cold-reps", type=int, default=30, help="CUDA cold: timed eager calls per method and cell")
    p.add_argument("--sleep-cycles", type=int, default=1_000_000,
                   help="CUDA cold: GPU sleep queued ahead of each timed eager call (default 1e6 cycles, ~0.5 ms)")
    p.add_argument("--graph-calls", type=int, default=10, help="CUDA warm: calls captured in one graph")
    p.add_argument("--budget", type=float, default=None, help="CPU: seconds of timing per method and cell (default 0.3, --quick 0.15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-on-cpu", action="store_true",
                   help="run the CUDA sections' code on torch CPU tensors at small sizes (checks the script without "
                        "a GPU; the times mean nothing)")
    p.add_argument("--force-cuda", action="store_true",
                   help="run the CUDA sections even when gvr's CUDA library does not load (the torch columns are "
                        "timed; gvr's cells record the error)")
    a = p.parse_args(argv)
    if a.budget is None:
        a.budget = 0.15 if a.quick else 0.3
    if a.context % P or a.cpu_context % P:
        p.error(f"contexts must be multiples of the page size {P}")
    return a


def write_markdown(path, meta, tables, lines):
    md = [f"\n## ATTENTION: {meta.get('device_name', '?')} ({meta['date']})\n",
          f"commit `{meta.get('commit')}` (sources sha256 `{meta.get('source_digest')}`), gvr {meta.get('gvr_version')}, "
          f"numpy {meta.get('numpy')}, torch {meta.get('torch')}, quick={meta['args']['quick']}.", ""]
    if meta.get("cache"):
        md += [f"Cache: {meta['cache']}. Warm L2: {meta.get('warm_timing')}. Cold L2: {meta.get('cold_timing')}. "
               f"Copy bandwidth {meta.get('copy_bandwidth_gbps', 0):.0f} GB/s. Times in µs (medians).", ""]
    for title, headers, rows in tables:
        md += [f"**{title}**", "", H.markdown_table(headers, rows), ""]
    md += ["```"] + lines + ["```", ""]
    with open(path, "a") as f:
        f.write("\n".join(md))


def main(argv=None):
    args = parse_args(argv)
    gvr = import_gvr()
    t0 = time.perf_counter()
    meta = {"args": vars(args), "workloads": {w: s["desc"] for w, s in WORKLOADS.items()}}
    try:
        meta["build_info"] = dict(gvr.build_info())
    except Exception as e:
        meta["build_info"] = _err(e)
    torch = None if args.cpu_only else import_torch()
    cuda_reason = None
    if args.cpu_only:
        cuda_reason = "--cpu-only"
    elif args.simulate_on_cpu:
        if torch is None:
            raise SystemExit("--simulate-on-cpu needs PyTorch")
    elif torch is None:
        cuda_reason = "PyTorch does not import"
    elif not torch.cuda.is_available():
        cuda_reason = "no CUDA device"
    elif not gvr.cuda_available() and not args.force_cuda:
        cuda_reason = f"gvr has no working CUDA library: {gvr.build_info().get('cuda_error')}"
    cuda = cuda_reason is None
    meta["mode"] = ("simulated" if args.simulate_on_cpu else "cuda") if cuda else "cpu"
    cells = []
    if cuda:
        cells += run_cuda(gvr, torch, args, meta, simulate=args.simulate_on_cpu)
    else:
        meta.update(H.header(torch, ROOT))
        meta["cuda_skipped"] = cuda_reason
        print(H.header_line(meta))
        print(f"# CUDA sections skipped: {cuda_reason}", flush=True)
    cells += run_cpu(gvr, args, meta)

    with open(args.bars) as f:
        spec = json.load(f)["attention"]
    bar_specs = (spec["cuda"] if cuda else []) + spec["cpu"]
    bars = H.evaluate_bars(bar_specs, cells, value)
    lines = [b["line"] for b in bars]
    sec = lambda s: [c for c in cells if c.get("section") == s]  # noqa: E731
    tables = [(t, hd, [fn(c) for c in sec(s)]) for t, s, hd, fn in (
        ("sparse_attention (c: cold L2, w: warm L2; torch = gather + SDPA)", "attention", ATTN_HEADERS, attention_row),
        ("fp8 (e4m3fn) caches: gvr fp8 vs gvr bf16 vs torch gather + dequantize + SDPA", "fp8", FP8_HEADERS, fp8_row),
        ("prr.repair vs recompute over predicted ∪ missed", "repair", REPAIR_HEADERS, repair_row),
        ("merge_states, two [32 x 128] states", "merge", MERGE_HEADERS, merge_row),
        ("CPU, one core, float32", "cpu", CPU_HEADERS, cpu_row)) if sec(s)]
    print()
    for title, hd, rows in tables:
        print(f"## {title}\n{H.format_table(hd, rows)}\n")
    if cuda:
        print("columns: c: = cold L2 (events), cg: = cold L2 (graph difference), w: = warm L2 (median us per call); GB/s = selected K+V bytes / time; floor = "
              "those bytes / the copy bandwidth (us); floor/gvr = the fraction of the copy bandwidth gvr reaches; torch "
              "form = the fastest torch variant (fold: query heads as query positions; gqa: enable_gqa; repeat: "
              "repeat_interleave); max diff = max |gvr out - baseline out|; repair(pad) = repair with prr.missed's "
              "output (padded with -1); a/b = time(a) / time(b)")
    else:
        print("columns: gvr (C) = gvr.sparse_attention on NumPy arrays, one thread; np einsum / np matmul = NumPy "
              "gather + einsum or matmul + softmax; numpy/gvr = the faster NumPy form's time / gvr's; GB/s = selected "
              "K+V bytes / gvr's time; max diff = max |gvr out - NumPy out|")
    print()
    print("\n".join(lines))
    meta["elapsed_s"] = time.perf_counter() - t0
    print(f"# total {meta['elapsed_s']:.0f} s")
    if args.json:
        out = args.json
    elif meta["mode"] == "simulated":  # not a measurement: kept out of benchmarks/ (the notebook reads that)
        out = "/tmp/results_attention_simulated.json"
    else:
        out = os.path.join(HERE, f"results_attention_{meta['mode']}.json")
    result = {"meta": meta, "cells": cells, "bars": bars, "bar_lines": lines}
    H.write_json(out, result)
    print(f"# wrote {out}")
    if args.append_results:
        write_markdown(args.append_results, meta, tables, lines)
        print(f"# appended a section to {args.append_results}")
    return result


if __name__ == "__main__":
    main()
