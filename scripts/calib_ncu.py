import sys, numpy as np, torch, gvr
x = gvr.data.block_score_trace(4096, 2048, seed=0)
xc = torch.from_numpy(np.ascontiguousarray(x)).cuda()
for _ in range(2):
    gvr.prr.calibrate(xc, 64)
torch.cuda.synchronize()
