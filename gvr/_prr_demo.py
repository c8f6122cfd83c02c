"""python -m gvr prr: a synthetic multi-layer decode through gvr.prr.SpeculativeAttention.

Per layer a random paged KV cache (``--context`` tokens per row at the first step, one more per step),
Quest block metadata kept up to date with ``update_block_metadata``, and a query that drifts step to
step (AR(1), persistence per layer: the first layer weakly persistent). Each step of each layer runs

- serial: ``select_blocks`` then ``sparse_attention`` over the selected blocks;
- PRR, exact mode, with last-step reuse and with the EMA predictor (``SpeculativeAttention``, the
  Quest selection stage of ``gvr.prr.quest_select``);

and prints per step (summed over layers) the serial and PRR (EMA) times, the hit rates of both
predictors (pooled over layers) and "exact: yes" when both PRR outputs equal the serial attention over
the selected set within tolerance (float32 states: |PRR - serial| <= 1e-4 * max(1, max |serial|) for
out, 1e-4 * max(1, |lse|) for lse; a missed or wasted block moves them by orders of magnitude more).

On the CPU the speculation cannot overlap the selection (one stream), so PRR times show the overhead
of the partial states and the repair; on CUDA the speculative attention overlaps the selection on a side stream.
Exit status: 0 when every step is exact, 1 otherwise, 2 for bad arguments, a missing device or caches that do
not fit in memory.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import gvr
from . import _prr_runtime as R

INT32_MAX = 2**31 - 1
MAX_THREADS = 1024  # the demo's cap on --threads (gvr itself caps at 2**20 and at the number of rows)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m gvr prr",
                                description="PRR demo: speculative sparse attention with repair over a synthetic "
                                            "multi-layer decode, checked against serial attention. Sizes are at most "
                                            "2**31 - 1 and the caches must fit in this machine's memory.")
    p.add_argument("--context", type=int, default=32768, help="tokens per row at the first step (default 32768)")
    p.add_argument("--layers", type=int, default=4, help="layers (default 4; the first is weakly persistent)")
    p.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    p.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    p.add_argument("--heads", type=int, nargs=2, default=(4, 2), metavar=("HQ", "HKV"),
                   help="query and KV heads (default 4 2)")
    p.add_argument("--dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per block (default 32)")
    p.add_argument("--k", type=int, default=32, help="selected blocks per row and KV head (default 32; at most the cache's blocks)")
    p.add_argument("--budget", type=float, default=1.0, help="speculation budget rho (default 1.0)")
    p.add_argument("--persistence", type=float, default=0.95,
                   help="step-to-step correlation of the query (default 0.95; the first layer 0.5)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1, help=f"CPU threads for gvr (default 1, at most {MAX_THREADS})")
    p.add_argument("--seed", type=int, default=0, help="seed in [0, 2**64 - 1] (default 0)")
    a = p.parse_args(argv)
    # sizes are int32 in the kernels (lengths, block ids): bounded before anything is allocated
    for name in ("context", "layers", "steps", "batch", "dim", "block_size", "k", "threads", "seed"):
        lo, hi = {"threads": (1, MAX_THREADS), "seed": (0, 2**64 - 1)}.get(name, (1, INT32_MAX))
        if not lo <= getattr(a, name) <= hi:
            p.error(f"--{name.replace('_', '-')} must lie in [{lo}, {hi}], got {getattr(a, name)}")
    if a.context + a.steps - 1 > INT32_MAX:
        p.error(f"--context + --steps - 1 (the last step's length) must be at most {INT32_MAX}")
    if not (1 <= a.heads[1] <= a.heads[0] <= INT32_MAX and a.heads[0] % a.heads[1] == 0):
        p.error(f"--heads: HQ must be a multiple of HKV, both in [1, {INT32_MAX}]")
    if a.dim not in (64, 128, 256) and a.device == "cuda":
        p.error("--dim must be 64, 128 or 256 on CUDA")
    if not 0.0 <= a.persistence <= 1.0:
        p.error("--persistence must lie in [0, 1]")
    if not (math.isfinite(a.budget) and a.budget >= 0):
        p.error(f"--budget must be a finite number >= 0, got {a.budget}")
    blocks = _geometry(a)[2]
    a.k_asked = a.k
    a.k = min(a.k, blocks)  # more than the cache's blocks selects nothing more (main says so), but sizes buffers by k
    mem = _host_memory()
    if _host_bytes(a) > mem:  # (every layer's float32 caches are made on the host; on CUDA one layer at a time)
        p.error(f"--context, --batch, --heads, --dim and --layers ask for about {_host_bytes(a) / 2**30:.3g} GiB of "
                f"caches and buffers; this machine has {mem / 2**30:.3g} GiB")
    return a


def _geometry(a):
    """(P tokens per page, pages per row, blocks per row) of the caches (room for every step)"""
    G = a.block_size
    P = 16 if G % 16 == 0 else G
    max_pages = -(-(a.context + a.steps) // P)
    return P, max_pages, -(-max_pages * P // G)


def _host_memory():
    """bytes of physical memory (1 TiB where the OS does not say)"""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 2**40


def _host_bytes(a):
    """Rough host size of the demo's largest arrays: float32 K and V, the block table and metadata (2 vectors of
    D per block and KV head), the selections and the predictors' per-block states -- every layer's (--device
    cuda: one layer's, made on the host and moved to the device before the next)."""
    P, pages, blocks = _geometry(a)
    (Hq, Hkv), B, D = a.heads, a.batch, a.dim
    per_layer = 4 * B * (2 * pages * P * Hkv * D + pages + 2 * blocks * Hkv * D + 8 * blocks * Hkv + 4 * Hkv * a.k)
    return per_layer if a.device == "cuda" else a.layers * per_layer


def _pick_device(a):
    """('cpu' | 'cuda', torch or None, why CUDA is not used or None)"""
    if a.device == "cpu":
        return "cpu", None, None
    try:
        import torch
        ok = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        torch, ok = None, False
    why = None
    if not ok:
        why = "torch with a CUDA device is not available"
    elif not gvr.cuda_available():
        why = gvr.build_info()["cuda_error"]
    return ("cpu", torch, why) if why else ("cuda", torch, None)


def main(argv=None) -> int:
    a = parse_args(argv)
    device, torch, why = _pick_device(a)
    if a.device == "cuda" and why is not None:
        print(f"python -m gvr prr: --device cuda: {why}", file=sys.stderr)
        return 2
    gvr.set_num_threads(a.threads)
    cuda = device == "cuda"
    B, (Hq, Hkv), D, G, k = a.batch, a.heads, a.dim, a.block_size, a.k
    if a.k_asked > k:
        print(f"note: --k {a.k_asked} is more than the cache's {k} blocks per row: k = {k}")
    P, max_pages, max_blocks = _geometry(a)
    rng = np.random.default_rng(a.seed)

    print(f"gvr {gvr.__version__}: PRR (speculate, select, repair), exact mode, {a.layers} layers")
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if cuda else f" ({a.threads} thread(s) for gvr)")
          + (f"  (CUDA not used: {why})" if why and a.device == "auto" and torch is not None else ""))
    print(f"B={B} Hq={Hq} Hkv={Hkv} D={D}, context {a.context} tokens, blocks of {G}, top-k {k} blocks, budget "
          f"{a.budget}, query persistence {a.persistence} (layer 0: 0.5)")

    def dev(x):
        if not cuda:
            return x
        t = torch.from_numpy(x).cuda()
        return t.bfloat16() if t.is_floating_point() else t

    t0 = time.perf_counter()
    layers = []
    lengths_h = np.full(B, a.context, np.int32)
    lengths = dev(lengths_h.copy())
    # sizes within the bounds of parse_args can still exceed this machine's memory: exit 2, no traceback
    oom = (MemoryError, torch.cuda.OutOfMemoryError) if cuda else MemoryError
    try:
        for li in range(a.layers):
            num_pages = B * max_pages
            K = dev(rng.standard_normal((num_pages, P, Hkv, D), dtype=np.float32))
            V = dev(rng.standard_normal((num_pages, P, Hkv, D), dtype=np.float32))
            bt = dev(rng.permutation(num_pages).astype(np.int32).reshape(B, max_pages))
            meta = gvr.prr.block_metadata(K, bt, lengths, block_size=G)
            kw = dict(block_size=G, k=k, budget=a.budget, mode="exact", device="cuda" if cuda else "cpu",
                      dtype="bfloat16" if cuda else "float32")
            L = dict(K=K, V=V, bt=bt, meta=meta,
                     select=R.quest_select(meta, k, lengths, block_size=G),
                     select_last=R.quest_select(meta, k, lengths, block_size=G),
                     ema=R.SpeculativeAttention(B, Hq, Hkv, D, max_blocks, predictor="ema", **kw),
                     last=R.SpeculativeAttention(B, Hq, Hkv, D, max_blocks, predictor="last", **kw),
                     sel=(torch.empty((B, Hkv, k), dtype=torch.int32, device="cuda") if cuda
                          else np.empty((B, Hkv, k), np.int32)),
                     s_out=(torch.empty((B, Hq, D), dtype=torch.float32, device="cuda") if cuda
                            else np.empty((B, Hq, D), np.float32)),
                     # the PRR steps' results in float32 too (the state's values: the comparison's tolerance is
                     # float32's; with budget 0 the step writes only out)
                     outs={n: (torch.empty((B, Hq, D), dtype=torch.float32, device="cuda") if cuda
                               else np.empty((B, Hq, D), np.float32)) for n in ("ema", "last")},
                     rho=0.5 if li == 0 else a.persistence,
                     qh=rng.standard_normal((B, Hq, D)).astype(np.float32))
            layers.append(L)
    except oom as e:
        print(f"python -m gvr prr: the caches do not fit in memory ({e}); use a smaller --context, --batch, "
              f"--heads, --dim, --k or --layers", file=sys.stderr)
        return 2
    print(f"caches and metadata: {time.perf_counter() - t0:.1f} s")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def host(x):
        return x.float().cpu().numpy() if cuda else np.asarray(x)

    print("times: ms per step, summed over layers (serial: select + attend; PRR: SpeculativeAttention.step with "
          "EMA);\n  hit rates pooled over layers; exact: both PRR runs vs serial attention over the selected set")
    print(f"{'step':>4} {'tokens':>8} {'serial':>9} {'PRR':>9} {'hit last':>9} {'hit EMA':>9}  exact")
    all_exact = True
    for step in range(a.steps):
        if step:
            old = lengths_h.copy()
            lengths_h += 1
            new = dev(lengths_h.copy())
            for L in layers:
                gvr.prr.update_block_metadata(L["meta"], L["K"], L["bt"], dev(old), new, block_size=G)
            if cuda:
                lengths.copy_(new)
            else:
                lengths[:] = lengths_h
        t_ser = t_prr = 0.0
        hits = {"last": [0, 0], "ema": [0, 0]}
        exact = True
        for L in layers:
            rho = L["rho"]
            L["qh"] = (rho * L["qh"] + np.sqrt(1 - rho * rho) * rng.standard_normal(L["qh"].shape)).astype(np.float32)
            q = dev(L["qh"])
            K, V, bt = L["K"], L["V"], L["bt"]
            sync()
            t1 = time.perf_counter()
            gvr.prr.select_blocks(q, L["meta"], k, lengths, block_size=G, out=L["sel"])
            ref_o, ref_l = gvr.sparse_attention(q, K, V, L["sel"], block_table=bt, lengths=lengths, block_size=G,
                                                out=L["s_out"])
            sync()
            t2 = time.perf_counter()
            res = {"ema": L["ema"].step(q, K, V, bt, lengths, L["select"], out=L["outs"]["ema"])}
            sync()
            t3 = time.perf_counter()
            res["last"] = L["last"].step(q, K, V, bt, lengths, L["select_last"], out=L["outs"]["last"])
            t_ser += t2 - t1
            t_prr += t3 - t2
            ro, rl = host(ref_o), host(ref_l)
            for name in ("ema", "last"):
                sa = L[name]
                c = [int(v) for v in (sa.hit_counts.tolist() if cuda else sa.hit_counts)]
                hits[name][0] += c[0]
                hits[name][1] += c[1]
                so, sl = res[name]
                go, gl = host(so[:B]), host(sl[:B])
                tol_o = 1e-4 * max(1.0, float(np.abs(ro).max()))
                fin = np.isfinite(rl)
                ok = (np.abs(go - ro).max() <= tol_o
                      and np.array_equal(np.isfinite(gl), fin)
                      and bool(np.all(np.abs(gl[fin] - rl[fin]) <= 1e-4 * np.maximum(1.0, np.abs(rl[fin])))))
                exact &= ok
        all_exact &= exact

        def rate(h):
            return h[0] / h[1] if h[1] else 1.0

        print(f"{step:>4} {int(lengths_h.max()):>8} {1e3 * t_ser:>9.2f} {1e3 * t_prr:>9.2f} {rate(hits['last']):>9.2f} "
              f"{rate(hits['ema']):>9.2f}  exact: {'yes' if exact else 'no'}", flush=True)

    ml = np.mean([L["last"].mean_hit_rate for L in layers])
    me = np.mean([L["ema"].mean_hit_rate for L in layers])
    print(f"summary: mean hit rate last-step reuse {ml:.2f}, EMA {me:.2f} (step 0 has no prediction); "
          f"all exact: {'yes' if all_exact else 'no'}")
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())
