"""variant_lib.sh --patch (session 22, not yet run on a GPU): the streamed top-k instances' output pass
writes its candidates (pushed to rank 0, which waits for them) before its selected indices; the
register-held instances keep the order. Session 22 measured the reorder in every instance together
with other changes only (B=64 128K -0.5 us, B=1 128K +0.24 us: RESULTS.md); this is its A/B alone:
  bash scripts/variant_lib.sh candsfirst --patch scripts/patches/topk_stream_cands_first.py \\
      --only 'topk/gvr_stream_*.cu' --from FULL_BUILD
then `gpu_check.sh topkab` with build/ab_candsfirst.so.xz carried."""
p = "kernels/topk/gvr.cuh"
s = open(p).read()
a = s.index("            if (ma) {\n                int pa = pos_above")
b = s.index("            if (mc) {\n                int pc = pos_cand")
c = s.index("            PROF(33);")
ma, mc = s[a:b], s[b:c]
assert a < b < c and ma.count("if (ma) {") == 1
# the candidates' block, then the selected indices' block, in the streamed instances; as before otherwise
new = ("            auto put_above = [&]() {\n" + ma + "            };\n"
       "            if constexpr (STREAM) {\n" + mc + "                put_above();\n"
       "            } else {\n                put_above();\n" + mc + "            }\n")
s = s[:a] + new + s[c:]
open(p, "w").write(s)
