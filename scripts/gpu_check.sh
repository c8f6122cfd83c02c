#!/usr/bin/env bash
# One call on the GPU machine: build for the chip present, GPU tests, compute-sanitizer, benchmark.
# Logs and JSON go to $OUT. Usage: bash scripts/gpu_check.sh [quick|check|bench|full|profile|probe|diag|qb]
# GVR_CARRIED=1: install build/librel.so (built here with nvcc) instead of compiling on the device
#   quick: tests + quick bench; check: tests + sanitizer + demo + ncu probe; bench: the full benchmark;
#   full: check + bench (over 10 minutes on an H100 now: run check and bench as two calls)
set -u -o pipefail
OUT=${OUT:-/tmp/gvr_out}; mkdir -p "$OUT"
mode=${1:-full}
export PYTHONUNBUFFERED=1 GVR_CUDA_ARCHS=${GVR_CUDA_ARCHS:-90a} GVR_REQUIRE_CUDA=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
if { [ "$mode" = "profile" ] && [ -f build/libprof.so ]; } || { [ -n "${GVR_CARRIED:-}" ] && [ -f build/librel.so ]; }; then
  # a -DGVR_PROFILE library built on the workstation (carried in build/): skip nvcc here
  GVR_SKIP_CUDA=1 python3 -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; echo "pip exit $?"
  # GVR_CARRIED=1: a release library built on the workstation (build/librel.so, same sources)
  lib=build/libprof.so; [ "$mode" = "profile" ] || lib=build/librel.so
  D=$(cd /tmp && python3 -c "import gvr, os; print(os.path.dirname(gvr.__file__))"); mkdir -p "$D/_lib"; cp $lib "$D/_lib/libgvr_cuda.so"
else
  python3 -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; echo "pip exit $?"
fi
grep -E "gvr build: [✓✗]|rror" "$OUT/build.log" | head -20
(cd /tmp && python3 -c "import gvr; print(gvr.__file__, gvr.build_info())") | tee -a "$OUT/build.log" || exit 1
(cd /tmp && timeout 60 python3 "$OLDPWD/scripts/smoke_gpu.py") 2>&1 | tee "$OUT/smoke.log" | tail -8
[ "${PIPESTATUS[0]}" = "0" ] || [ "$mode" = "profile" ] || { echo "smoke test failed"; exit 1; }
if [ "$mode" = "probe" ]; then
  nvcc -O2 -std=c++17 -arch=sm_${GVR_CUDA_ARCHS} -o /tmp/micro_cluster scripts/micro_cluster.cu && /tmp/micro_cluster | tee "$OUT/micro_cluster.log"
  (cd /tmp && python3 "$OLDPWD/scripts/floor_probe.py") 2>&1 | tee "$OUT/floor_probe.log"
  exit 0
fi
if [ "$mode" = "qb" ]; then
  # only the quick table (QB_NS, QB_BS, QB_EXTRA select cells: scripts/quick_gpu_bench.py)
  (cd /tmp && timeout 300 python3 "$OLDPWD/scripts/quick_gpu_bench.py") 2>&1 | tee -a "$OUT/quick_bench.log"
  exit 0
fi
if [ "$mode" = "diag" ]; then
  # where the GVR kernel's cycles go: Nsight Compute warp-state sampling per source line and SASS
  # instruction (build the carried library with -lineinfo) for the "N B" cases in DIAG_CASES
  IFS=, read -ra cases <<< "${DIAG_CASES:-131072 64,131072 1}"
  for case in "${cases[@]}"; do
    tag=$(echo $case | tr ' ' _)
    (cd /tmp && timeout 200 ncu --cache-control none --kernel-name regex:xkernel --launch-skip 2 --launch-count 1 \
      --set full --warp-sampling-interval 0 --import-source yes -o "$OUT/ncu_$tag" python3 "$OLDPWD/scripts/ncu_case.py" $case) > "$OUT/ncu_$tag.log" 2>&1
    ncu -i "$OUT/ncu_$tag.ncu-rep" --print-details all > "$OUT/ncu_${tag}_details.txt" 2>&1
    ncu -i "$OUT/ncu_$tag.ncu-rep" --page source --csv --print-source cuda,sass > "$OUT/ncu_${tag}_source.csv" 2>&1
    rm -f "$OUT/ncu_$tag.ncu-rep" "$OUT/ncu_$tag.log"
    echo "ncu $case: $(grep -m1 -E 'Duration' "$OUT/ncu_${tag}_details.txt")"
  done
  exit 0
fi
if [ "$mode" != "profile" ] && [ "$mode" != "bench" ]; then
cd tests
timeout 400 python3 -m pytest -x -q -p no:cacheprovider test_topk_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
cd ..
if [ "$mode" = "full" ] || [ "$mode" = "check" ]; then
  for tool in memcheck racecheck; do
    (cd /tmp && timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 python3 "$OLDPWD/scripts/sanitize_case.py") > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer_$tool.log") clean summaries)"; tail -2 "$OUT/sanitizer_$tool.log"
  done
fi
if [ "$mode" = "full" ] || [ "$mode" = "check" ]; then
  (cd /tmp && timeout 120 python3 -m gvr) 2>&1 | tee "$OUT/demo.log" | tail -6
  # warm-L2 memory counters of one streamed call (B=64, N=128K): where the streamed passes stand
  (cd /tmp && timeout 120 ncu --cache-control none --kernel-name regex:xkernel --launch-skip 2 --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum \
    python3 "$OLDPWD/scripts/ncu_case.py" 131072 64) > "$OUT/ncu_b64.log" 2>&1; grep -E "duration|dram__|lts__" "$OUT/ncu_b64.log"
fi
fi
if [ "$mode" = "full" ] || [ "$mode" = "bench" ]; then
  (cd /tmp && timeout 280 python3 "$OLDPWD/benchmarks/bench_topk.py" --device cuda --out "$OUT/bench_cuda.json" --append-results "$OUT/RESULTS_cuda.md" --pool 2 --reps 40 --cold-reps 30) > "$OUT/bench_cuda.log" 2>&1; echo "bench exit $?"; tail -75 "$OUT/bench_cuda.log"
elif [ "$mode" = "quick" ]; then
  (cd /tmp && timeout 300 python3 "$OLDPWD/scripts/quick_gpu_bench.py") 2>&1 | tee "$OUT/quick_bench.log"
  # quick mode: variants built on the workstation (build/libcmp*.so, e.g. other tuning defines) timed the same way
  D=$(cd /tmp && python3 -c "import gvr, os; print(os.path.dirname(gvr.__file__))")
  for lib in build/libcmp*.so; do
    [ -f "$lib" ] || continue
    echo "== $lib" | tee -a "$OUT/quick_bench.log"; cp "$lib" "$D/_lib/libgvr_cuda.so"
    (cd /tmp && timeout 200 python3 "$OLDPWD/scripts/quick_gpu_bench.py") 2>&1 | tee -a "$OUT/quick_bench.log"
  done
fi
if [ "$mode" = "profile" ] && [ -f build/libprof.so ]; then
  for lib in build/libprof*.so; do
    echo "== $lib"; cp "$lib" "$D/_lib/libgvr_cuda.so"
    (cd /tmp && python3 "$OLDPWD/scripts/profile_phases.py" 2>&1 | tee -a "$OUT/profile.log")
  done
elif [ "$mode" = "profile" ]; then
  LIB=$(cd /tmp && python3 -c "import gvr; print(gvr.build_info()['cuda_library'])")
  cp "$LIB" /tmp/libgvr_cuda.release.so
  nvcc -O3 -std=c++17 -DGVR_PROFILE -gencode=arch=compute_${GVR_CUDA_ARCHS},code=sm_${GVR_CUDA_ARCHS} -Xcompiler -fPIC -shared --cudart=static -o "$LIB" kernels/topk.cu \
    && (cd /tmp && python3 "$OLDPWD/scripts/profile_phases.py" 2>&1 | tee "$OUT/profile.log")
  cp /tmp/libgvr_cuda.release.so "$LIB"
fi
