"""variant_lib.sh --patch (session 22, compiled here, NOT yet run on a GPU): topk_edge_table.diff, then the
round's bin pick scanned by cub's BLOCK_SCAN_WARP_SCANS (a warp scan per warp and one pass over the warp
totals) instead of the default raking scan (two barriers and a raking warp), with GvrShared padded to the
raking storage's size so that every field and the dynamic buffer keep their offsets (the layout mattered,
session 22). For `gpu_check.sh topkab` beside the edge table alone:
  bash scripts/variant_lib.sh warpscan --patch scripts/patches/topk_warpscan.py --only 'topk/gvr_*.cu' --from FULL_BUILD"""
import os
import subprocess

here = os.path.dirname(os.path.abspath(__file__))
subprocess.run(["patch", "-p1", "-s", "-i", os.path.join(here, "topk_edge_table.diff")], check=True)
p = "kernels/topk/gvr.cuh"
s = open(p).read()
o = "    typename cub::BlockScan<int, THREADS>::TempStorage scan;\n"
n = ("    using PickScan = cub::BlockScan<int, THREADS, cub::BLOCK_SCAN_WARP_SCANS>;\n"
     "    typename PickScan::TempStorage scan;\n"
     "    /* the raking scan's storage size: the fields behind keep their offsets */\n"
     "    unsigned char scan_pad[sizeof(typename cub::BlockScan<int, THREADS>::TempStorage) -\n"
     "                           sizeof(typename PickScan::TempStorage)];\n")
assert s.count(o) == 1
s = s.replace(o, n)
o = "cub::BlockScan<int, THREADS>(s.scan).InclusiveSum(cnt, incl, total);"
assert s.count(o) == 1
s = s.replace(o, "typename GvrShared<STREAM>::PickScan(s.scan).InclusiveSum(cnt, incl, total);")
open(p, "w").write(s)
