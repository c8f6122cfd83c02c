# the attention kernel without prr.repair's fused extras (exclusion, counts, cast): the A/B baseline
p = 'kernels/attention/decode.cuh'
s = open(p).read()
rep = [
    ("const int32_t *xrow = a.xidx ? a.xidx + (long long)b * a.x_sb + (long long)kvh * a.x_sh : nullptr;",
     "const int32_t *xrow = nullptr;"),
    ("const bool counting = a.counts != nullptr && chunk == 0 && (a.count_all || kvh == 0);",
     "const bool counting = false;"),
    ("        if (a.counts) { /* this warp's counts", "        if (false) { /* this warp's counts"),
]
for a, b in rep:
    assert a in s, a
    s = s.replace(a, b, 1)
i = s.index("        char *cp = a.cast ?")
j = s.index(";", s.index(": nullptr", i)) + 1
s = s[:i] + "        char *cp = nullptr;" + s[j:]
open(p, 'w').write(s)
