"""One GVR-kernel call for Nsight Compute (N, B from argv; trace at ~45% overlap, with prediction)."""
import sys

import numpy as np
import torch

import gvr
from gvr import data

N, B = int(sys.argv[1]), int(sys.argv[2])
k = 2048
tr = list(data.decode_trace(N, 2, k=k, overlap=0.45, seed=1))
prev = torch.from_numpy(gvr.topk_decode(tr[0], k)).cuda().expand(B, k).contiguous()
x = torch.from_numpy(np.tile(tr[1][:N], (B, 1))).cuda()
for _ in range(3):
    out = gvr.topk_decode(x, k, prev_topk=prev, method="gvr")
torch.cuda.synchronize()
print("ok", out.shape)
