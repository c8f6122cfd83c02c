#!/usr/bin/env python3
"""Whether the bulk-copy gather (method "tma") can share SMs with a concurrent matmul: bench_sparda's "shapes"
measurement (GB/s of 32 and 512 64-token blocks, Hkv 8, D 128, bf16; the slowdown of an 8192^3 bf16 matmul
while 40 gathers of 512 blocks run on a second stream) for 2, 4, 8 and 16 tma CTAs, without the idle
Prefetcher rows -- for libraries whose gather CTA is small enough (shared-memory ring, registers) to be
resident beside a matmul CTA, carried for `AB_SCRIPT=tma_coresident.py gpu_check.sh attnab`. JSON cells:
cN -> {"warm": matmul slowdown %, "cold_g": GB/s at 512 blocks}, cN_32 -> {"warm": GB/s at 32 blocks,
"cold_g": the same} (the names attnab compares).

    python scripts/tma_coresident.py [--json PATH]"""
import sys

import _ab  # scripts/_ab.py: the A/B scripts' command line and JSON


def main():
    a = _ab.parser(__doc__).parse_args()
    import torch
    import gvr
    import gvr.sparda  # noqa: F401
    import _harness as H
    import bench_sparda as BS
    rows = BS.shapes(gvr, torch, H.CudaTimer(torch, flush_bytes=0), [("tma", c) for c in (2, 4, 8, 16)],
                     idle_prefetcher=False)
    cells = {}
    for r in rows:
        cells[f"c{r['ctas']}"] = {"warm": 100 * r["matmul_slowdown"], "cold_g": r["gbps_512"]}
        cells[f"c{r['ctas']}_32"] = {"warm": r["gbps_32"], "cold_g": r["gbps_32"]}
    _ab.write(a.json, torch, cells)


if __name__ == "__main__":
    sys.exit(main())
