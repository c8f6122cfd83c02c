"""Host (CPU) cost per eager call of gvr.topk_decode on torch CUDA tensors, and of its parts.
Launches are asynchronous, so wall time per call over many calls is the host overhead (as long as
the GPU keeps up: the kernels here take ~10 us)."""
import time

import torch

import gvr

N, B, k = 65536, 1, 2048
x = torch.randn(B, N, device="cuda")
prev = torch.topk(x, k).indices.int()
out = torch.empty(B, k, dtype=torch.int32, device="cuda")
s = torch.cuda.current_stream().cuda_stream
s_dl = s if s else 1  # DLPack: the legacy default stream is 1


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


cases = {
    "torch.topk(x, k, sorted=False)": lambda: torch.topk(x, k, sorted=False),
    "gvr.topk_decode(x, k)": lambda: gvr.topk_decode(x, k),
    "gvr.topk_decode(x, k, out=out)": lambda: gvr.topk_decode(x, k, out=out),
    "gvr.topk_decode(x, k, prev_topk=prev)": lambda: gvr.topk_decode(x, k, prev_topk=prev),
    "gvr.topk_decode(x, k, prev_topk=prev, out=out)": lambda: gvr.topk_decode(x, k, prev_topk=prev, out=out),
    "gvr.topk_decode(..., prev, out, stream=s)": lambda: gvr.topk_decode(x, k, prev_topk=prev, out=out, stream=s),
    "x.__dlpack__(stream=s)": lambda: x.__dlpack__(stream=s_dl),
    "x.__dlpack__(stream=s, max_version=(1, 0))": lambda: x.__dlpack__(stream=s_dl, max_version=(1, 0)),
    "x.__dlpack__(stream=-1)": lambda: x.__dlpack__(stream=-1),
    "x.__dlpack__()": lambda: x.__dlpack__(),
    "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream(x.device).cuda_stream,
    "torch.empty(B, k, int32, cuda)": lambda: torch.empty((B, k), dtype=torch.int32, device=x.device),
    "x.data_ptr(), x.shape, x.stride(), x.dtype, x.device": lambda: (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device),
}
print(torch.cuda.get_device_name(), torch.__version__)
for name, fn in cases.items():
    print(f"{name:50s} {per_call_us(fn):8.2f} us/call (host)", flush=True)
