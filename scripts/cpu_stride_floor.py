"""One core's read bandwidth for the access pattern of bench_attention's CPU cell "8K tokens in 64-token
blocks" (per-KV-head selections over an NHD float32 cache, Hkv 8, D 128: one head's 512-byte row of each
4 KB token), against a contiguous read of the same 64 MB -- the floor of any implementation that reads
those rows (gvr's C path, NumPy's gather). NumPy sums (vectorized, no gather copy), median of 7.
    python scripts/cpu_stride_floor.py"""
import time

import numpy as np

a = np.ones((131072, 8, 128), np.float32)  # 512 MiB: 4 KB per token (8 heads x 128 floats)


def t(f, n=7):
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


mb = 64 * 2**20
full = t(lambda: a[:16384].sum())  # 64 MiB contiguous
one = t(lambda: a[:, 0, :].sum())  # 512 B of every 4 KB: 64 MiB useful
print(f"contiguous 64 MiB: {full * 1e3:.1f} ms ({mb / full / 1e9:.1f} GB/s); one head's 512 B of every 4 KB "
      f"(64 MiB useful): {one * 1e3:.1f} ms ({mb / one / 1e9:.1f} GB/s useful)")
