# The attention kernel (kernels/attention/decode*.cu, decode.cuh) as of an earlier commit, built against
# this checkout's headers (gvr_kernels.h: fields are read by name, so a kernel from before an ABI
# addition still builds), for a same-machine A/B of kernel versions with one _C:
#   GVR_AB_REPO=/path/to/repo GVR_AB_COMMIT=<rev> [GVR_AB_NOEXTRA=1] bash scripts/variant_lib.sh NAME \
#       --patch scripts/patches/attn_at_commit.py --only 'attention/decode*.cu' --from <full build>
# Instance files that the old kernel lacks (decode_d*_e4m3.cu) are emptied. GVR_AB_NOEXTRA=1 then
# applies attn_noextra.py (prr.repair's extras removed: the baseline of the extras' cost).
import glob
import os
import subprocess

repo, rev = os.environ["GVR_AB_REPO"], os.environ.get("GVR_AB_COMMIT", "HEAD")
old = subprocess.run(["git", "-C", repo, "ls-tree", "--name-only", rev, "kernels/attention/"], check=True,
                     capture_output=True, text=True).stdout.split()
for path in glob.glob("kernels/attention/decode*.cu") + ["kernels/attention/decode.cuh"]:
    if path in old:
        text = subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    else:
        text = f"/* {os.path.basename(path)}: not in {rev} */\n"
    open(path, "w").write(text)
if os.environ.get("GVR_AB_NOEXTRA") == "1":
    exec(open(os.path.join(repo, "scripts/patches/attn_noextra.py")).read())
