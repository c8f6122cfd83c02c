"""variant_lib.sh --patch: applies topk_shared_ranking.diff (beside this file) to the copy of kernels/."""
import os
import subprocess

diff = os.path.join(os.path.dirname(os.path.abspath(__file__)), "topk_shared_ranking.diff")
subprocess.run(["patch", "-p1", "-s", "-i", diff], check=True)
