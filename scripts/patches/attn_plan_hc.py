# planner variant for an A/B: small-batch plans with >= GVR_AB_TOKMIN selected tokens split the GQA group
# into chunks of at most GVR_AB_HC heads (more, lighter CTAs: fewer registers, more warps per SM)
import os
hc = int(os.environ.get("GVR_AB_HC", "2"))
tokmin = int(os.environ.get("GVR_AB_TOKMIN", "2048"))
p = 'kernels/attention/decode.cu'
s = open(p).read()
a = "    g.units = (long long)p->B * p->Hkv * g.nch;\n"
assert a in s
b = ("    {\n"
     "        const long long Gx = p->block_table ? p->block_size : 1;\n"
     f"        if (g.HC > {hc} && (long long)p->n * Gx >= {tokmin} && (long long)p->B * p->Hkv * ((GQ + {hc} - 1) / {hc}) * 2 <= (long long)resident_ctas({hc}) * (sms > 0 ? sms : 1)) {{\n"
     f"            g.nch = (GQ + {hc} - 1) / {hc};\n"
     f"            g.HC = {hc};\n"
     "        }\n"
     "    }\n") + a
s = s.replace(a, b, 1)
open(p, 'w').write(s)
