#!/usr/bin/env bash
# A libgvr_cuda.so for an A/B on the GPU machine, built here (where nvcc is and device time is not spent):
# the objects of a previous full build, except those matching ONLY, recompiled from a copy of kernels/
# (optionally patched), linked, and compressed to build/ab_NAME.so.xz (or build/prof_NAME.so.xz with
# --profile: -DGVR_PROFILE, for scripts/profile_phases.py). On the device: `gpu_check.sh topkab` /
# `profile` with the file carried (run's carry=["build/ab_NAME.so.xz"]; 64 MiB in all, ~17 MB each).
#
#   bash scripts/variant_lib.sh NAME [--patch PATCH.py|PATCH.diff] [--profile] [--only 'topk/gvr_*.cu'] [--from DIR]
#
# --from: a tree holding a finished build (default: this checkout; build it once with
#   GVR_CUDA_ARCHS=90a python setup.py build_ext --inplace, in a copy if the in-place library must not
#   shadow the CPU-only one); PATCH.py runs in the copy's root (edit kernels/ there); PATCH.diff is applied there with patch -p1.
# --only: kernels/ paths (glob) to recompile; default topk/gvr_*.cu (all of topk/*.cu with --profile).
# NVCC_EXTRA: more nvcc flags (e.g. -DGVR_PROF_CTA=1: the profile stamps of rank 1 of row 0's cluster).
# Objects of other folders must not depend on what the patch changes (headers are not tracked here).
set -euo pipefail
name=$1; shift
patch=""; profile=0; only=""; from=$(pwd -P)
while [ $# -gt 0 ]; do
  case $1 in
    --patch) patch=$(realpath "$2"); shift 2 ;;
    --profile) profile=1; shift ;;
    --only) only=$2; shift 2 ;;
    --from) from=$(realpath "$2"); shift 2 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
[ -n "$only" ] || { [ $profile = 1 ] && only='topk/*.cu' || only='topk/gvr_*.cu'; }
out=$(pwd -P)/build; mkdir -p "$out"
objdir=$(ls -d "$from"/build/temp*/gvr_cuda 2>/dev/null | head -1)
[ -n "$objdir" ] || { echo "no build objects under $from/build (build it once first)"; exit 1; }
work=$(mktemp -d /tmp/gvr_variant_XXXX); cp -r "$(pwd -P)/kernels" "$work/"
case $patch in  # a unified diff of kernels/ (a/kernels/..., as git diff writes it), or a script run in the copy
  "") ;;
  *.diff) (cd "$work" && patch -p1 -s -i "$patch") ;;
  *) (cd "$work" && python3 "$patch") ;;
esac
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
GENCODE="-gencode=arch=compute_90a,code=sm_90a"
FLAGS="-O3 -std=c++17 -Xcompiler -fPIC,-Wall -Xcompiler -fvisibility=hidden -lineinfo -w -I kernels $GENCODE"
[ $profile = 1 ] && FLAGS="$FLAGS -DGVR_PROFILE"
FLAGS="$FLAGS ${NVCC_EXTRA:-}"
cd "$work"; mkdir obj
srcs=$(cd kernels && ls $only)
keep=""
for o in "$objdir"/*.o; do  # setup.py names objects FOLDER_STEM.HASH.o
  stem=$(basename "$o"); stem=${stem%%.*}; skip=0
  for s in $srcs; do [ "$stem" = "$(dirname "$s")_$(basename "$s" .cu)" ] && skip=1; done
  [ $skip = 1 ] || keep="$keep $o"
done
echo "recompiling: $srcs"
printf '%s\n' $srcs | xargs -P "$(nproc)" -I{} sh -c "$NVCC $FLAGS -c kernels/{} -o obj/\$(echo {} | tr / _ | sed 's/\.cu\$/.o/')"
$NVCC -shared --cudart=static $GENCODE -o lib.so $keep obj/*.o
prefix=ab; [ $profile = 1 ] && prefix=prof
xz -T0 -6 -c lib.so > "$out/${prefix}_$name.so.xz"
ls -la "$out/${prefix}_$name.so.xz"; rm -rf "$work"
