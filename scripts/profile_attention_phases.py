#!/usr/bin/env python3
"""Phase timing of the sparse decode-attention kernel (head dim 128): clock64 stamps of CTA 0, thread 0,
and every CTA's start and end on the global timer, read from a debug library built with -DGVR_PROFILE
(kernels/common/profile.cuh). Debugging aid, not a benchmark.

    python scripts/profile_attention_phases.py PROFILE_LIB

Build the library here (bash scripts/variant_lib.sh NAME --profile --only 'attention/*.cu' --from DIR),
carry build/prof_NAME.so.xz, and run `bash scripts/gpu_check.sh attnprofile` on the device.

Cells: the benchmark's B=1 table set-up (Hq 32, Hkv 8, D 128, bf16, a 128K-token paged cache of 64-token
pages, shuffled; random 64-token blocks per KV head, or 2048 physical token slots shared by every head),
and prr.repair of 1 and 8 blocks into a float32 state. Each cell warm (the third of three calls) and cold
(after a write of 512 MiB evicts L2), median stamps of 7 trials.

Tags (decode.cuh's PROF calls): 0 start, 2 first tile's entries and pages resolved (after the barrier),
3 each step of U tokens done, 4 the tile loop done, 5 CTA reductions done, 9 end (one split: out
written); split runs: 6 split state written and counted, 7 merge weights (last CTA), 8 end (last CTA)."""
import ctypes
import os
import shutil
import sys

import numpy as np

SPANS = 1024


def main():
    lib_path = sys.argv[1]
    import importlib.util
    spec = importlib.util.find_spec("gvr")
    installed = os.path.join(spec.submodule_search_locations[0], "_lib", "libgvr_cuda.so")
    backup = installed + ".release"
    shutil.copyfile(installed, backup)
    shutil.copyfile(lib_path, installed + ".tmp")
    os.replace(installed + ".tmp", installed)
    try:
        run()
    finally:
        os.replace(backup, installed)


def run():
    import torch
    import gvr
    lib = ctypes.CDLL(gvr.build_info()["cuda_library"])
    HQ, HKV, D, P = 32, 8, 128, 64
    ctx = 131072
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = ctx // P
    k = torch.randn(pages, P, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pages, P, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(pages, generator=g, device="cuda").int().view(1, pages)
    q = torch.randn(1, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    perm = torch.rand(1, HKV, ctx // 64, generator=g, device="cuda").argsort(-1).int()

    def blocks(n):
        return perm[..., :n].contiguous()

    out = torch.empty(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, HQ, device="cuda")
    st_out = torch.empty(1, HQ, D, device="cuda", dtype=torch.float32)
    st_lse = torch.empty(1, HQ, device="cuda")
    base = blocks(16)
    slots = (torch.randperm(ctx, generator=g, device="cuda")[:2048].int().view(1, 1, 2048)).contiguous()

    def attn(idx):
        return lambda: gvr.sparse_attention(q, k, v, idx, block_table=bt, block_size=64, out=out, lse=lse)

    def repair(m):
        miss = perm[..., 16:16 + m].contiguous()

        def prep():
            gvr.sparse_attention(q, k, v, base, block_table=bt, block_size=64, out=st_out, lse=st_lse)

        def fn():
            gvr.prr.repair(st_out, st_lse, q, k, v, miss, block_table=bt, block_size=64)
        return fn, prep

    cells = [("1K blocks64", attn(blocks(16)), None), ("4K blocks64", attn(blocks(64)), None),
             ("8K blocks64", attn(blocks(128)), None),
             ("DSA 2K tokens", lambda: gvr.sparse_attention(q, k, v, slots, out=out, lse=lse), None)]
    for m in (1, 8):
        fn, prep = repair(m)
        cells.append((f"repair {m} blocks", fn, prep))
    buf = (ctypes.c_longlong * (64 + 2 * SPANS))()
    for name, fn, prep in cells:
        for mode in ("warm", "cold"):
            stamps, spans_all = [], []
            for trial in range(7):
                if prep is not None:
                    prep()
                fn()  # the data into L2 (warm); the state prepared again for a repair
                if prep is not None:
                    prep()
                if mode == "cold":
                    flush.add_(1)
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
                lib.gvr_debug_attn_clocks(buf)
                n = buf[63]
                t0 = buf[0] // 100
                stamps.append([(buf[i] % 100, buf[i] // 100 - t0) for i in range(n)])
                gsz = min(int(buf[62]), SPANS)
                sp = np.array(buf[64:64 + 2 * gsz], dtype=np.int64).reshape(gsz, 2)
                spans_all.append(sp - sp[:, 0].min())
            # the median over trials, stamp by stamp (same tag sequence each trial)
            L = min(len(s) for s in stamps)
            med = [(stamps[0][i][0], int(np.median([s[i][1] for s in stamps]))) for i in range(L)]
            ends = np.array([sp[:, 1].max() for sp in spans_all])
            starts = np.array([np.percentile(sp[:, 0], 100) for sp in spans_all])
            dur = np.array([np.median(sp[:, 1] - sp[:, 0]) for sp in spans_all])
            gsz = spans_all[0].shape[0]
            print(f"{name:16s} {mode}: grid {gsz}, last end {int(np.median(ends))} ns (min {int(ends.min())}), "
                  f"last start {int(np.median(starts))} ns, per-CTA median {int(np.median(dur))} ns | "
                  + " ".join(f"{t}:{c}" for t, c in med), flush=True)


if __name__ == "__main__":
    sys.exit(main())
