"""variant_lib.sh --patch: applies topk_edge_table.diff (beside this file) to the copy of kernels/."""
import os
import subprocess

diff = os.path.join(os.path.dirname(os.path.abspath(__file__)), "topk_edge_table.diff")
subprocess.run(["patch", "-p1", "-s", "-i", diff], check=True)
