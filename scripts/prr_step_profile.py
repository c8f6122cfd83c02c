"""The kernels of one decode step, serial and through gvr.prr.SpeculativeAttention (B=1, Hq 32, Hkv 8,
D 128, bf16, 64-token blocks, top-k 64, --context tokens), each step inside an NVTX range, for Nsight
Compute's per-kernel durations:
ncu --nvtx --nvtx-include "step/" --metrics gpu__time_duration.sum --csv python scripts/prr_step_profile.py"""
import argparse

import torch

import gvr
from gvr import _prr_runtime as R
from gvr._prr_budget import paged_decode_case

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--context", type=int, default=131072)
ap.add_argument("--mode", default="exact", choices=("exact", "superset"))
ap.add_argument("--predictor", default="ema", choices=("ema", "last"))
a = ap.parse_args()
HQ, HKV, D, P, G, KB = 32, 8, 128, 64, 64, 64
B, ctx = 1, a.context
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
case = paged_decode_case(torch, B, ctx, HQ, HKV, D, P, 4, persistence=0.95, generator=gen, device=dev,
                         dtype=torch.bfloat16)
K, V, bt, lengths, meta = case.K, case.V, case.block_table, case.lengths, case.meta
sel = torch.full((B, HKV, KB), -1, dtype=torch.int32, device=dev)
out = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=dev)
sa = R.SpeculativeAttention(B, HQ, HKV, D, ctx // G, block_size=G, k=KB, mode=a.mode, predictor=a.predictor,
                            device=dev, dtype="bfloat16")
fn = R.quest_select(meta, KB, lengths, block_size=G) if a.predictor == "ema" else (
    lambda q: gvr.prr.select_blocks(q, meta, KB, lengths, block_size=G, out=sel))
for i, q in enumerate(case.queries):
    torch.cuda.synchronize()
    if i == 3:
        torch.cuda.nvtx.range_push("step")
    gvr.prr.select_blocks(q, meta, KB, lengths, block_size=G, out=sel)
    gvr.sparse_attention(q, K, V, sel, block_table=bt, lengths=lengths, block_size=G, out=out)
    torch.cuda.synchronize()
    sa.step(q, K, V, bt, lengths, fn, out=out)
    torch.cuda.synchronize()
    if i == 3:
        torch.cuda.nvtx.range_pop()
print("prr_step_profile: ok, hit rate", sa.last_hit_rate)
