"""One sparse-attention cell of the benchmark's B=1 table (random 64-token blocks per KV head over a
shuffled paged cache; Hq 32, Hkv 8, D 128, bf16), called --calls times, for Nsight Compute:
ncu -k regex:gvr_attention --launch-skip 2 --launch-count 1 python scripts/profile_attention.py --tokens 1024
(--fp8: the cache in float8_e4m3fn with k_scale / v_scale, as bench_attention.py's fp8 section)"""
import argparse

import torch

import gvr

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--tokens", type=int, default=1024, help="selected tokens per (row, KV head)")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--context", type=int, default=131072)
ap.add_argument("--calls", type=int, default=4)
ap.add_argument("--fp8", action="store_true", help="fp8 (e4m3fn) K and V, scale 4/448")
a = ap.parse_args()
HQ, HKV, D, P, G = 32, 8, 128, 64, 64
B, ctx = a.batch, a.context
pages = B * ctx // P
g = torch.Generator(device="cuda").manual_seed(0)
k = torch.randn(pages, P, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
v = torch.randn(pages, P, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
bt = torch.randperm(pages, generator=g, device="cuda").int().view(B, ctx // P)
idx = torch.rand(B, HKV, ctx // G, generator=g, device="cuda").argsort(-1)[..., : a.tokens // G].int().contiguous()
q = torch.randn(B, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
kw = {}
if a.fp8:
    s8 = 4.0 / 448
    k, v = ((x.float() / s8).clamp_(-448, 448).to(torch.float8_e4m3fn) for x in (k, v))
    kw = dict(k_scale=s8, v_scale=s8)
out = torch.empty(B, HQ, D, device="cuda", dtype=torch.bfloat16)
lse = torch.empty(B, HQ, device="cuda")
for _ in range(a.calls):
    gvr.sparse_attention(q, k, v, idx, block_table=bt, block_size=G, out=out, lse=lse, **kw)
torch.cuda.synchronize()
print("profile_attention: ok", float(out.float().abs().sum()))
