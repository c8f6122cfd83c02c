# the attention kernel without the tensor-core path (every instance on the per-lane path): the A/B baseline
p = 'kernels/attention/decode.cuh'
s = open(p).read()
a = "#define GVR_DECODE_MMA 1"
assert a in s
open(p, 'w').write(s.replace(a, "#define GVR_DECODE_MMA 0", 1))
