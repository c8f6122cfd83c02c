#!/usr/bin/env bash
# The GPU machine's one script: build gvr for the chip present, check it, time it. Logs and JSON go to
# $OUT (default /tmp/gvr_out). Usage: bash scripts/gpu_check.sh MODE [MODE ...], run from the repo root.
#   check    GPU tests (pytest -m gpu: kernels against the C path, opcheck and torch.compile on CUDA),
#            compute-sanitizer memcheck + racecheck on small cases of every kernel path, the demo
#   attn     the attention operators only: their GPU tests, sanitizer on their cases, their benchmark
#   prr      issue 13's pieces (Quest selection, EMA predictor, runtime): their GPU tests, sanitizer, CUDA demo
#   attntests  the attention GPU tests only
#   attnquick  the attention sanitizer cases and the quick attention benchmark
#   prrbench benchmarks/bench_prr.py --cuda (PRR step timing, calibration on CUDA)
#   prrprof  Nsight Compute kernel durations of one serial and one PRR step (CSV)
#   prrlayers  bench_prr's multi-layer table: PRR (join=False) across 4 layers vs serial, per layer-step
#   budget   gvr.prr.Budget.profile on this GPU -> $OUT/budget.json
#   topkpt   topk_decode's page-table transform: GPU tests, top-k sanitizer cases, benchmarks/bench_page_table.py
#   sparda   issue 14's pieces (compressed keys, forecast_select, prefetch, host cache): GPU tests, sanitizer
#   spardabench  benchmarks/bench_sparda.py -> $OUT/results_sparda_cuda.json, bench_sparda.log
#   prefetcher  the persistent gvr.sparda.Prefetcher's GPU tests and eager timing (apart, short timeouts)
#   prrfused  GPU tests of the fused PRR step (repair extras, scores_out, update_predict, runtime, attention)
#   gputests  every GPU test (check's first part); sanall: compute-sanitizer on every sanitize_case part
#   topkragged  bench_page_table --only-ragged (row_starts vs per-row calls vs padding)
#   spardashapes  bench_sparda --only shapes (gather CTA shapes: GB/s, matmul slowdown, idle Prefetcher)
#   spardacarveout  bench_sparda --only shapes --sm-carveout 0,1,2,4,8 (the matmul under the gathers with cuBLAS
#              kept off that many SMs: issue 14's matmul-slowdown bar)
#   spardapartscarve  bench_sparda --only pipeparts --sm-carveout $CARVE (default 0,2; KV $CARVE_KV, default fp8) (each light pipeline again on cuBLASLt
#              without and with its GEMVs kept off 2 SMs, fp8 KV: issue 14's hidden share)
#   spardapipecarve  bench_sparda --only pipefp8 --sm-carveout $CARVE (default 4): both layer pipelines with the
#              matmuls kept off SMs (gvr.sparda.matmul_carveout)
#   spardahidden  bench_sparda --only pipefp8 --rounds ${ROUNDS:-7} --priorities 0 --kv bfloat16 fp8 --sm-carveout ${CARVE:-4}:
#              each pipeline's async3 hidden share over interleaved rounds (median, min, max), with and without
#              the carveout (issue 14's ">= 90% hidden" bar)
#   spardafp8  bench_sparda --only fp8 (prefetch from an fp8 host cache vs a bfloat16 one)
#   spardapipe  bench_sparda --only pipeline (layer pipelines: stream-ordered schedules and the Prefetcher)
#   spardapipefp8  bench_sparda --only pipefp8 (the pipelines over fp8 host caches beside bfloat16 ones)
#   spardaparts  bench_sparda --only pipeparts (the light layer's pipeline with each half of the transfer alone)
#   spardaselect  bench_sparda --only select (forecast_select alone and beside a GEMV: gvr, counts first, torch)
#   topkedges  bench_topk_edges on CUDA: constant, masked, NaN, few-valued and tied rows, small k (gvr vs torch.topk)
#   topkedgesab  bench_topk_edges for the installed library and each carried build/ab_NAME.so.xz, interleaved
#   topkquick  the topk GPU tests, then scripts/quick_gpu_bench.py over N 32K-256K, B 1/8/64 -> $OUT/quick_topk.json
#   profile  scripts/profile_phases.py with -DGVR_PROFILE libraries built elsewhere and carried as
#            build/prof_NAME.so.gz or build/libprof.so.gz (PP_CASES="N B,N B" picks the cases; PP_ARGS: more
#            arguments, e.g. "--rows iid": i.i.d. rows, one below the streamed threshold first; "--reps 9": per
#            stamp the median of 9 more calls; PP_TAIL: the log lines shown, default 30)
#   attnsan  compute-sanitizer memcheck + racecheck on the attention cases
#   fp8      fp8 (e4m3fn) caches: their GPU tests (tests/test_attention_fp8_gpu.py), all failures listed
#   fp8bench bench_attention.py --quick (with its fp8 section) -> $OUT/results_attention_quick.json
#   fp8all   every fp8 GPU test: attention, PRR selection and runtime, SparDA prefetch and compressed keys
#   attnab   A/B of attention kernels: scripts/attn_ab.py for the installed library and each carried build/ab_NAME.so.xz
#   attnprofile  scripts/profile_attention_phases.py with -DGVR_PROFILE libraries carried as build/prof_NAME.so.xz
#   topktests / topksan  the topk GPU tests / compute-sanitizer on the topk cases (prrsan, spardasan: on theirs)
#   topkrace racecheck alone on the topk cases, within $SAN_TIMEOUT (default 540 s)
#   calib    the EMA calibration on CUDA: its GPU tests and its time (T 4096 x Nb 2048, k 64)
#   attncpu  the attention benchmark's CPU section on the host CPU (C path vs NumPy)
#   topkabq  an A/B of whole libraries (installed + carried build/ab_*.so.xz): the quick table's gvr column, rows
#            of N and N + 1, traces generated once; build/prebuilt.so.xz, when carried, is installed instead of a build
#   testsan  every GPU test over pytest-xdist workers (wheels carried in .whl) beside the sanitizer on $SAN_CASES
#   topkab   an A/B of topk variants on one machine (GVR_TOPK_PF values, libraries carried as build/ab_*.so.gz)
#   hintsweep  issue 15's hint-quality sweep: bench_topk over overlaps 2..95%, B 1/8/64, N 32K..256K
#   topkpool  bench_topk with $POOL (default 64) distinct rows per cell: trace45 and iid, N 64K-256K, B 1/8/64 (~190 s)
#   topkpoolab  an A/B of whole libraries (installed + carried build/ab_*.so.xz) on topkpool's batches, a new seed per round
#   topkvar  variants of the streamed gvr kernel (TOPK_VARIANTS="name:-DMACRO=v ...[|patch.diff];..."), built here and
#            A/B'd (topkab) against the installed library
#   topkprof  phase stamps (profile) from a -DGVR_PROFILE library built here first; PP_CASES as profile's
#   topkncu  Nsight Compute (full set, SASS stall samples, warm L2) on the GVR Top-K kernel: NCU_CELLS="N B,..." (default 131072 64)
#   topkfloor  scripts/topk_floor.py: minimal kernels of the B=1 / B=64 128K Top-K grids (read, exchange, output) vs gvr
#   ncu      Nsight Compute on the B=1 attention cells (1K, 4K, 8K tokens); planncu: on the prefetch's plan kernel
#   floor    scripts/latency_floor.py: minimal kernels of the B=1 cells' grids and memory chains vs gvr (CuPy)
#   bench    the full benchmarks: benchmarks/bench_topk.py --device cuda -> $OUT/bench_cuda.json, .md;
#            benchmarks/bench_attention.py -> $OUT/results_attention_cuda.json, RESULTS_attention_cuda.md, .log
# The build runs once per machine and source state (a stamp in /tmp); GVR_CUDA_ARCHS defaults to 90a.
set -u -o pipefail
OUT=${OUT:-/tmp/gvr_out}; mkdir -p "$OUT"
ROOT=$(pwd -P)
export PYTHONUNBUFFERED=1 GVR_CUDA_ARCHS=${GVR_CUDA_ARCHS:-90a} GVR_REQUIRE_CUDA=1
PY=python3
t0=$SECONDS
say() { printf '\n=== %s (%ds)\n' "$*" $((SECONDS - t0)); }

build() {
  local digest
  # (a carried build/prebuilt.so.xz counts too: a warm machine given another library installs it)
  digest=$(cat setup.py csrc/*.[ch] csrc/*/*.[ch] $(find kernels -name '*.cu' -o -name '*.cuh' -o -name '*.h' | sort) gvr/*.py \
    build/prebuilt.so.xz 2>/dev/null | sha256sum | cut -c1-16)
  if [ "$(cat /tmp/gvr_built 2>/dev/null)" = "$digest" ]; then echo "build: up to date ($digest)"; return 0; fi
  say "build (GVR_CUDA_ARCHS=$GVR_CUDA_ARCHS)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
  local tb=$SECONDS rc lib skip=""
  # a libgvr_cuda.so built on the development machine and carried (scripts/variant_lib.sh's way: same C ABI, sm_90a):
  # only the C extension is built here (seconds, not the CUDA build's minutes of device time)
  [ -e build/prebuilt.so.xz ] && skip="GVR_SKIP_CUDA=1 GVR_REQUIRE_CUDA=0"
  env $skip $PY -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; rc=$?
  if [ $rc = 0 ] && [ -n "$skip" ]; then
    lib=$(installed_lib); mkdir -p "$(dirname "$lib")"
    unpack build/prebuilt.so.xz "$lib" && echo "gvr build: ✓ prebuilt build/prebuilt.so.xz -> $lib" | tee -a "$OUT/build.log" || rc=1
  fi
  grep -E "gvr build" "$OUT/build.log" | sed 's/^ *//' | tail -20
  echo "pip install: exit $rc in $((SECONDS - tb)) s"
  [ $rc = 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
  (cd /tmp && $PY -c "import gvr; print(gvr.__file__, gvr.build_info())") || exit 1
  (cd /tmp && timeout 120 $PY "$ROOT/scripts/smoke_gpu.py") 2>&1 | tee "$OUT/smoke.log" | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "smoke test failed"; exit 1; }
  echo "$digest" > /tmp/gvr_built
}

check() {
  say "GPU tests"
  # from tests/ (not the root, whose ./gvr is the unbuilt source tree): the installed gvr
  (cd tests && timeout 420 $PY -m pytest -q -p no:cacheprovider -m gpu -rs .) 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
  say "compute-sanitizer"
  for tool in memcheck racecheck; do
    (cd /tmp && timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $PY "$ROOT/scripts/sanitize_case.py") > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -cE '(ERROR|RACECHECK) SUMMARY: 0' "$OUT/sanitizer_$tool.log") clean summaries)"; tail -2 "$OUT/sanitizer_$tool.log"
  done
  say "demo"
  (cd /tmp && timeout 120 $PY -m gvr) 2>&1 | tee "$OUT/demo.log" | tail -6
}

attn() {  # the attention operators only: their GPU tests, sanitizer on their cases, their benchmark
  say "GPU tests (attention)"
  (cd tests && timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu -rs -x test_attention_gpu.py test_attention_bad_input.py test_readme.py) 2>&1 | tee "$OUT/pytest_attention_gpu.log" | tail -15
  say "compute-sanitizer (attention)"
  for tool in memcheck racecheck; do
    SAN_TIMEOUT=200 san_one attention $tool
  done
  say "attention benchmark"
  (cd /tmp && timeout 300 $PY "$ROOT/benchmarks/bench_attention.py" --json "$OUT/results_attention_cuda.json" \
    --append-results "$OUT/RESULTS_attention_cuda.md") > "$OUT/bench_attention.log" 2>&1
  echo "bench_attention exit $?"; tail -75 "$OUT/bench_attention.log"
}

prr() {  # issue 13's pieces: their GPU tests, sanitizer, the demo on CUDA (their CUDA paths are gated until these pass)
  say "GPU tests (prr)"
  (cd tests && timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=30 test_prr_select_gpu.py test_prr_ema_gpu.py test_prr_runtime_gpu.py) 2>&1 | tee "$OUT/pytest_prr_gpu.log" | tail -40
  sanitize prr
  say "prr demo on CUDA"
  (cd /tmp && timeout 120 $PY -m gvr prr --device cuda) 2>&1 | tee "$OUT/demo_prr_cuda.log" | tail -12
}

sanitize() {  # $1: sanitize_case.py --only value; extra environment from the caller
  say "compute-sanitizer ($1)"
  for tool in memcheck racecheck; do
    SAN_TIMEOUT=${SAN_TIMEOUT:-420} san_one $1 $tool
  done
}

san_one() {  # compute-sanitizer --tool $2 on sanitize_case.py --only $1, within $SAN_TIMEOUT (default 400 s)
  (cd /tmp && timeout ${SAN_TIMEOUT:-400} compute-sanitizer --tool $2 --error-exitcode 9 $PY "$ROOT/scripts/sanitize_case.py" --only $1) > "$OUT/sanitizer_$1_$2.log" 2>&1
  echo "compute-sanitizer $1 $2: exit $? ($(grep -cE '(ERROR|RACECHECK) SUMMARY: 0' "$OUT/sanitizer_$1_$2.log") clean summaries)"; tail -2 "$OUT/sanitizer_$1_$2.log"
}

topkrace() {  # compute-sanitizer racecheck alone on the topk cases, within $SAN_TIMEOUT (default 540 s): testsan's, after
  # the tests, did not finish in 330 s (H200, session 32); session 28's took 269 s
  say "compute-sanitizer racecheck (topk)"
  SAN_TIMEOUT=${SAN_TIMEOUT:-540} san_one topk racecheck
}

prrfused() {  # issue 13's fused step pieces: repair(exclude, counts, cast_out), select_blocks(scores_out),
  # EMAPredictor.update_predict, the runtime, attention partials; GPU tests, all failures listed
  say "GPU tests (fused PRR step)"
  (cd tests && timeout 420 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=40 test_prr_repair_fused_gpu.py \
    test_attention_gpu.py test_prr_select_gpu.py test_prr_ema_gpu.py test_prr_runtime_gpu.py) 2>&1 \
    | tee "$OUT/pytest_prrfused_gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -40
}

fp8() {  # fp8 (e4m3fn) caches with k_scale / v_scale: their GPU tests, all failures listed
  say "GPU tests (fp8 caches)"
  (cd tests && timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=40 -o faulthandler_timeout=60 \
    test_attention_fp8_gpu.py) 2>&1 | tee "$OUT/pytest_fp8_gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -40
}

fp8all() {  # every fp8 (e4m3fn) GPU test across the operators
  say "GPU tests (fp8 everywhere)"
  (cd tests && timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=40 -o faulthandler_timeout=60 \
    test_attention_fp8_gpu.py test_prr_select_gpu.py test_prr_runtime_gpu.py test_sparda_prefetch.py \
    test_sparda_ckeys.py -k "fp8 or float8 or e4m3") 2>&1 | tee "$OUT/pytest_fp8all_gpu.log" \
    | grep -E "passed|failed|FAILED|Error" | tail -40
}

fp8bench() {  # the quick attention benchmark (B=1 table, B=64, fp8 section, repair, merge)
  say "attention benchmark --quick (fp8 section included)"
  (cd /tmp && timeout 300 $PY "$ROOT/benchmarks/bench_attention.py" --quick --json "$OUT/results_attention_quick.json") \
    > "$OUT/bench_attention_quick.log" 2>&1
  echo "bench_attention exit $?"; sed -n '/^## sparse_attention (c:/,/^## merge_states, two/p' "$OUT/bench_attention_quick.log" | head -40
}

gputests() {  # every GPU test (check's first part), failures listed
  say "GPU tests (all)"
  (cd tests && timeout 480 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=40 .) 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
}

calib() {  # the EMA calibration on CUDA: its GPU tests, then its time at T 4096 x Nb 2048, k 64 (bench_prr's)
  say "calibration (GPU tests, time)"
  (cd tests && timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu -rs test_prr_ema_gpu.py) 2>&1 | tee "$OUT/pytest_calib.log" | tail -3
  local installed g; installed=$(installed_lib)
  cp "$installed" /tmp/lib_main.so
  for g in main build/ab_*.so.xz main; do  # this build, then each carried library, then this build again
    [ "$g" = main ] || [ -e "$g" ] || continue
    [ "$g" = main ] && cp /tmp/lib_main.so "$installed" || unpack "$g" "$installed"
    (cd /tmp && timeout 120 $PY -c "import sys; sys.path.insert(0, '$ROOT/benchmarks'); import bench_prr, gvr, torch
ms, g, c = bench_prr.cuda_calibration(gvr, torch); print(f'$(basename $g): calibration on CUDA {ms:.2f} ms (median of 5, host wall), choice {g}, equal to the CPU: {g == c}')") 2>&1 | tail -2
  done
  cp /tmp/lib_main.so "$installed"
}

attncpu() {  # the attention benchmark's CPU section on this machine's host CPU (C path vs NumPy, one core)
  say "bench_attention --cpu-only (host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2))"
  (cd /tmp && OPENBLAS_NUM_THREADS=1 timeout 300 $PY "$ROOT/benchmarks/bench_attention.py" --cpu-only --json "$OUT/results_attention_cpu_host.json") > "$OUT/bench_attention_cpu.log" 2>&1
  echo "exit $? (cpu_isa $(cd /tmp && $PY -c 'import gvr._C as c; print(c.cpu_isa())'))"; tail -12 "$OUT/bench_attention_cpu.log"
}

attntests() {  # the attention GPU tests, all failures listed
  say "GPU tests (attention)"
  (cd tests && timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=40 test_attention_gpu.py test_attention_bad_input.py test_readme.py) 2>&1 | tee "$OUT/pytest_attention_gpu.log" | tail -40
}

attnquick() {  # the attention kernels' sanitizer cases and the quick benchmark (B=1 table, B=64 at 2K, repair, merge)
  sanitize attention
  say "attention benchmark --quick"
  (cd /tmp && timeout 250 $PY "$ROOT/benchmarks/bench_attention.py" --quick --json "$OUT/results_attention_quick.json") \
    > "$OUT/bench_attention_quick.log" 2>&1
  echo "bench_attention exit $?"; sed -n '/^## sparse_attention:/,/^## CPU/p' "$OUT/bench_attention_quick.log" | head -40
}

prrbench() {  # issue 13's benchmark with its GPU sections (step timing, calibration on CUDA)
  say "bench_prr --cuda"
  (cd /tmp && timeout 400 $PY "$ROOT/benchmarks/bench_prr.py" --cuda --json "$OUT/results_prr_cuda.json") \
    > "$OUT/bench_prr_cuda.log" 2>&1
  echo "bench_prr exit $?"; tail -30 "$OUT/bench_prr_cuda.log"
}

prrlayers() {  # bench_prr's multi-layer table (PRR steps with join=False across 4 layers vs serial)
  say "bench_prr --cuda --only-layers"
  (cd /tmp && timeout 400 $PY "$ROOT/benchmarks/bench_prr.py" --cuda --only-layers --json "$OUT/results_prr_layers.json") \
    2>&1 | tee "$OUT/bench_prr_layers.log" | tail -14
}

prrprof() {  # the kernels of one serial step and one PRR step (Nsight Compute durations, CSV)
  for pm in "ema exact" "last superset"; do
    set -- $pm
    say "ncu: kernels of a serial and a PRR step ($1, $2)"
    (cd /tmp && timeout 200 ncu --nvtx --nvtx-include "step/" --metrics gpu__time_duration.sum --csv \
      $PY "$ROOT/scripts/prr_step_profile.py" --predictor $1 --mode $2) > "$OUT/ncu_prr_step_$1_$2.csv" 2> "$OUT/ncu_prr_step_$1_$2.err"
    echo "exit $?"; tail -3 "$OUT/ncu_prr_step_$1_$2.err"
  done
}

budget() {  # gvr.prr.Budget.profile on this GPU -> $OUT/budget.json (the shipped default is made from it)
  say "Budget.profile"
  (cd /tmp && timeout 300 $PY -c "import gvr, json; b = gvr.prr.Budget.profile(path='$OUT/budget.json'); print(b)
for c, r in b.table['contexts'].items(): print(c, {k: (round(v, 1) if isinstance(v, float) else {kk: round(vv, 2) for kk, vv in v.items()}) for k, v in r.items()})") 2>&1 | tee "$OUT/budget.log" | tail -8
}

topktests() {  # topk_decode's GPU tests (every method, rows, half scores, page table)
  say "GPU tests (topk)"
  (cd tests && timeout 360 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --maxfail=20 test_topk_gpu.py test_topk_rows.py test_topk_half.py) 2>&1 | tee "$OUT/pytest_topk.log" | tail -8
}

topkpt() {  # issue 15's page-table transform: its GPU tests, the top-k sanitizer cases, its benchmark
  topktests
  sanitize topk
  say "bench_page_table"
  (cd /tmp && timeout 200 $PY "$ROOT/benchmarks/bench_page_table.py") 2>&1 | tee "$OUT/bench_page_table.log" | tail -14
}

sparda() {  # issue 14's pieces: their GPU tests, sanitizer (compressed keys are gated until these pass)
  say "GPU tests (sparda)"
  (cd tests && timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu -rs test_sparda_ckeys.py test_sparda_select.py test_sparda_prefetch.py) 2>&1 | tee "$OUT/pytest_sparda_gpu.log" | tail -30
  sanitize sparda
}

prefetcher() {  # the persistent Prefetcher: its GPU tests alone, short timeouts (a
  # persistent kernel that never stops hangs the process: timeout kills it; faulthandler shows where), with
  # CUDA's default lazy loading first, then with eager loading if that failed; then its benchmark section
  local rc=0 loading
  for loading in LAZY EAGER; do
    say "GPU tests (Prefetcher, CUDA_MODULE_LOADING=$loading)"
    (cd tests && CUDA_MODULE_LOADING=$loading GVR_TEST_PREFETCHER=1 timeout -k 5 75 $PY -X faulthandler \
      -m pytest -v -p no:cacheprovider -o faulthandler_timeout=30 -m gpu -x -rs test_sparda_prefetcher.py) 2>&1 \
      | tee "$OUT/pytest_prefetcher_gpu_$loading.log" | tail -40
    rc=${PIPESTATUS[0]}; echo "exit $rc"
    [ "$rc" = 0 ] && break
  done
  say "bench_sparda --only prefetcher (CUDA_MODULE_LOADING=$loading)"
  (cd /tmp && CUDA_MODULE_LOADING=$loading timeout -k 5 90 $PY -X faulthandler \
    "$ROOT/benchmarks/bench_sparda.py" --only prefetcher --json "$OUT/results_prefetcher_cuda.json") 2>&1 | tee "$OUT/bench_prefetcher.log" | tail -12
}

topkragged() {  # bench_page_table --only-ragged: row_starts against per-row calls and padding
  say "bench_page_table --only-ragged"
  (cd /tmp && timeout -k 5 200 $PY "$ROOT/benchmarks/bench_page_table.py" --only-ragged \
    --json "$OUT/results_topk_ragged.json") 2>&1 | tee "$OUT/bench_topk_ragged.log" | tail -8
  say "bench_page_table --only-half"
  (cd /tmp && timeout -k 5 200 $PY "$ROOT/benchmarks/bench_page_table.py" --only-half \
    --json "$OUT/results_topk_half.json") 2>&1 | tee "$OUT/bench_topk_half.log" | tail -10
}

spardashapes() {  # bench_sparda --only shapes: the gather CTA shapes (bandwidth, matmul slowdown, idle Prefetcher)
  say "bench_sparda --only shapes"
  (cd /tmp && timeout -k 5 300 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only shapes \
    --json "$OUT/results_sparda_shapes.json") 2>&1 | tee "$OUT/bench_sparda_shapes.log" | tail -16
}

spardacarveout() {  # bench_sparda --only shapes with cuBLAS SM carveouts
  say "bench_sparda --only shapes --sm-carveout 0,1,2,4,8"
  (cd /tmp && timeout -k 5 300 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only shapes \
    --sm-carveout 0,1,2,4,8 --json "$OUT/results_sparda_carveout.json") 2>&1 | tee "$OUT/bench_sparda_carveout.log" \
    | grep -E "carveout|matmul|shape" | tail -48
}

spardafp8() {  # bench_sparda --only fp8: prefetch from an fp8 host cache vs a bfloat16 one
  say "bench_sparda --only fp8"
  (cd /tmp && timeout -k 5 300 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only fp8 \
    --json "$OUT/results_sparda_fp8.json") 2>&1 | tee "$OUT/bench_sparda_fp8.log" | tail -12
}

spardapipefp8() {  # bench_sparda --only pipefp8: the pipelines over fp8 host caches beside bfloat16 ones
  say "bench_sparda --only pipefp8"
  (cd /tmp && timeout -k 5 400 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only pipefp8 \
    --json "$OUT/results_sparda_pipefp8.json") 2>&1 | tee "$OUT/bench_sparda_pipefp8.log" | tail -16
}

spardaparts() {  # bench_sparda --only pipeparts: the light layer's pipeline with each half of the transfer alone
  say "bench_sparda --only pipeparts"
  (cd /tmp && timeout -k 5 400 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only pipeparts \
    --json "$OUT/results_sparda_pipeparts.json" --timeline "$OUT/timeline") 2>&1 | tee "$OUT/bench_sparda_pipeparts.log" | tail -12
}

spardapartscarve() {  # pipeparts, each pipeline also with cuBLASLt (carveout 0: the backend alone) and its GEMVs kept
  # off $CARVE SMs (default 0,2), KV $CARVE_KV (default fp8)
  say "bench_sparda --only pipeparts --sm-carveout ${CARVE:-0,2} --kv ${CARVE_KV:-fp8}"
  (cd /tmp && timeout -k 5 590 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only pipeparts \
    --sm-carveout ${CARVE:-0,2} --kv ${CARVE_KV:-fp8} --json "$OUT/results_sparda_pipeparts_carveout.json") 2>&1 \
    | tee "$OUT/bench_sparda_pipeparts_carveout.log" | grep -E "^--|pipeline|only" | tail -24
}

spardapipecarve() {  # pipefp8 (the 8B-like and light pipelines, side-stream priorities 0 / -1) without and with the
  # matmuls kept off $CARVE SMs (default 4), KV $CARVE_KV (default bfloat16)
  say "bench_sparda --only pipefp8 --sm-carveout ${CARVE:-4} --kv ${CARVE_KV:-bfloat16}"
  (cd /tmp && timeout -k 5 590 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only pipefp8 \
    --sm-carveout ${CARVE:-4} --kv ${CARVE_KV:-bfloat16} --json "$OUT/results_sparda_pipe_carveout.json") 2>&1 \
    | tee "$OUT/bench_sparda_pipe_carveout.log" | grep -E "^--|pipeline|only" | tail -24
}

spardahidden() {  # the pipelines' hidden shares over $ROUNDS interleaved rounds, without and with the carveout
  say "bench_sparda --only pipefp8 --rounds ${ROUNDS:-7} --sm-carveout ${CARVE:-4}"
  (cd /tmp && timeout -k 5 590 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only pipefp8 --rounds ${ROUNDS:-7} \
    --priorities 0 --kv bfloat16 fp8 --sm-carveout ${CARVE:-4} --json "$OUT/results_sparda_hidden.json") 2>&1 \
    | tee "$OUT/bench_sparda_hidden.log" | grep -E "^--|interleaved|only" | tail -24
}

spardaselect() {  # bench_sparda --only select: forecast_select alone and beside a GEMV (gvr, counts first, torch)
  say "bench_sparda --only select"
  (cd /tmp && timeout -k 5 200 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only select \
    --json "$OUT/results_sparda_select.json") 2>&1 | tee "$OUT/bench_sparda_select.log" | tail -12
}

spardapipe() {  # bench_sparda --only pipeline: both layer stand-ins, every schedule, the Prefetcher's graph
  say "bench_sparda --only pipeline"
  (cd /tmp && timeout -k 5 300 $PY -X faulthandler "$ROOT/benchmarks/bench_sparda.py" --only pipeline \
    --json "$OUT/results_sparda_pipeline.json") 2>&1 | tee "$OUT/bench_sparda_pipeline.log" | tail -16
}

spardabench() {  # benchmarks/bench_sparda.py: gathers per method, matmul slowdown, resident bytes, the layer pipeline
  say "bench_sparda"
  (cd /tmp && timeout -k 5 540 $PY "$ROOT/benchmarks/bench_sparda.py" --json "$OUT/results_sparda_cuda.json") 2>&1 | tee "$OUT/bench_sparda.log" | tail -40
}

topkquick() {  # the topk GPU tests, then the quick timing table (gvr with / without the hint, radix)
  topktests
  say "quick_gpu_bench"
  (cd /tmp && timeout 300 $PY "$ROOT/scripts/quick_gpu_bench.py" --n 32768 65536 131072 262144 --json "$OUT/quick_topk.json") 2>&1 | tee "$OUT/quick_topk.log" | tail -30
}

topkedges() {  # topk_decode on constant / masked / NaN / few-valued / tied rows and small k (gvr vs torch.topk)
  say "bench_topk_edges (cuda)"
  (cd /tmp && timeout -k 5 300 $PY "$ROOT/benchmarks/bench_topk_edges.py" --device cuda --n 32768 131072 \
    --k 1 8 64 2048 --batch 1 64 --json "$OUT/results_topk_edges_cuda.json") 2>&1 | tee "$OUT/topk_edges.log" | tail -70
}

with_each_lib() {  # "$1 NAME I" for the installed library (NAME main), then for each carried build/ab_NAME.so.gz
  # or .so.xz in its place (same C ABI; restored after), interleaved, for I in 1..$AB_REPEAT (default 2)
  local installed g name i; installed=$(installed_lib)
  cp "$installed" /tmp/lib_main.so
  for i in $(seq 1 ${AB_REPEAT:-2}); do
    "$1" main "$i"
    echo "main: exit $?"
    for g in build/ab_*.so.gz build/ab_*.so.xz; do
      [ -e "$g" ] || continue
      name=$(basename "$g"); name=${name%.so.*}; name=${name#ab_}
      unpack "$g" "$installed" && "$1" "$name" "$i"
      echo "ab_$name: exit $?"; cp /tmp/lib_main.so "$installed"
    done
  done
}

topkedgesab() {  # bench_topk_edges for the installed library and each carried build/ab_NAME.so.xz (same C ABI;
  # restored after), interleaved, $AB_REPEAT times (default 2), N $AB_N (default 4096 32768 131072), k 1 64 2048,
  # B 1 64 -> $OUT/edgesab.log, edgesab_compare.log (per cell: each build's median over the repeats)
  say "bench_topk_edges A/B"
  rm -f /tmp/edgesab_*.json  # (a warm machine keeps an earlier run's)
  edges_run() {
    (cd /tmp && timeout 200 $PY "$ROOT/benchmarks/bench_topk_edges.py" --device cuda --n ${AB_N:-4096 32768 131072} \
      --k 1 64 2048 --batch 1 64 --label "$1" --json "/tmp/edgesab_$1_$2.json") >> "$OUT/edgesab.log" 2>&1
  }
  with_each_lib edges_run
  $PY - <<'PYEOF' 2>&1 | tee "$OUT/edgesab_compare.log"
import collections, glob, json, statistics
t = collections.defaultdict(lambda: collections.defaultdict(list))
labels = []
for path in sorted(glob.glob("/tmp/edgesab_*.json")):
    r = json.load(open(path))
    labels += [r["label"]] if r["label"] not in labels else []
    for c in r["cells"]:
        t[(c["kind"], c["N"], c["k"], c["B"])][r["label"]].append(c["gvr_us"])
        t[(c["kind"], c["N"], c["k"], c["B"])]["torch"].append(c["torch.topk_us"])
labels = ["main"] + [x for x in labels if x != "main"] + ["torch"]
print(f"{'kind':20s} {'N':>7s} {'k':>5s} {'B':>3s} " + " ".join(f"{x:>9s}" for x in labels) + "  (us, medians)")
for key, d in t.items():
    print(f"{key[0]:20s} {key[1]:7d} {key[2]:5d} {key[3]:3d} " + " ".join(f"{statistics.median(d[x]):9.1f}" if d[x] else f"{'-':>9s}" for x in labels))
PYEOF
}

profile() {  # per-phase clock stamps from debug libraries carried as build/prof_NAME.so.gz (or build/libprof.so.gz)
  local g name
  for g in build/prof_*.so.gz build/prof_*.so.xz build/libprof.so.gz; do
    [ -e "$g" ] || continue
    name=$(basename "$g"); name=${name%.so.*}
    say "profile_phases ($name)"
    unpack "$g" /tmp/libprof.so || continue
    (cd /tmp && timeout 120 $PY "$ROOT/scripts/profile_phases.py" /tmp/libprof.so ${PP_CASES:+--cases "$PP_CASES"} ${PP_ARGS:-}) 2>&1 | tee "$OUT/profile_$name.log" | tail -${PP_TAIL:-30}
  done
}

attnprofile() {  # per-phase stamps of the attention kernel from debug libraries carried as build/prof_NAME.so.xz
  local g name
  for g in build/prof_*.so.xz; do
    [ -e "$g" ] || continue
    name=$(basename "$g"); name=${name%.so.*}
    say "profile_attention_phases ($name)"
    unpack "$g" /tmp/libprof.so || continue
    (cd /tmp && timeout 180 $PY "$ROOT/scripts/profile_attention_phases.py" /tmp/libprof.so) 2>&1 | tee "$OUT/attnprofile_$name.log" | tail -${PP_TAIL:-30}
  done
}

attnab() {  # A/B of attention kernels on one machine, interleaved: scripts/attn_ab.py for the installed library
  # and for each carried build/ab_NAME.so.xz (same C ABI; restored after), $AB_REPEAT times (default 2);
  # AB_SCRIPT=select_ab.py: the selection kernels' cells instead (forecast_select, Quest select_blocks)
  say "attention A/B"
  attn_run() {
    (cd /tmp && timeout 200 $PY "$ROOT/scripts/${AB_SCRIPT:-attn_ab.py}" ${AB_ONLY:+--only $AB_ONLY} \
      --json "$OUT/attnab_$1_$2.json") >> "$OUT/attnab.log" 2>&1
  }
  with_each_lib attn_run
  $PY - "$OUT" <<'PYEOF' 2>&1 | tee "$OUT/attnab_compare.log"
import glob, json, os, sys
runs = sorted(glob.glob(os.path.join(sys.argv[1], "attnab_*.json")), key=os.path.getmtime)
for mode in ("cold_g", "warm"):
    print(mode)
    for path in runs:
        cells = json.load(open(path))["cells"]
        print(f"  {os.path.basename(path)[7:-5]:14s} " + " ".join(f"{k} {v[mode]:.2f}" for k, v in cells.items()))
PYEOF
}

installed_lib() {  # the installed gvr's libgvr_cuda.so, found without importing gvr (which would load it)
  (cd /tmp && $PY -c "import importlib.util, os; s = importlib.util.find_spec('gvr'); print(os.path.join(s.submodule_search_locations[0], '_lib', 'libgvr_cuda.so'))")
}

unpack() {  # $1 (.gz or .xz) -> $2, with Python's gzip / lzma (no xz tool needed)
  $PY -c "import gzip, lzma, shutil, sys; o = (lzma.open if sys.argv[1].endswith('.xz') else gzip.open)(sys.argv[1]); shutil.copyfileobj(o, open(sys.argv[2], 'wb'))" "$1" "$2"
}

topkab() {  # A/B of topk variants on one machine, interleaved: the quick table (B=64, N 64K-256K) for each
  # variant of $AB_VARIANTS ("name:VAR=v,VAR=v ..."; default "pf4:GVR_TOPK_PF=4 pf0:GVR_TOPK_PF=0") and for
  # each library carried as build/ab_NAME.so.gz or .so.xz in place of the installed one (same C ABI; restored after),
  # the whole list $AB_REPEAT times (default 2) -> $OUT/ab_*.json, ab.log, ab_compare.log; $AB_ARGS: more
  # quick_gpu_bench.py arguments (e.g. "--rows iid": B distinct rows)
  say "topk A/B"
  local q="$ROOT/scripts/quick_gpu_bench.py --n ${AB_N:-65536 131072 262144} --batch ${AB_B:-64} --overlap 0.45 ${AB_ARGS:-}"
  quick_run() {  # the installed library: once per variant of $AB_VARIANTS; a carried one: as it is
    local v vname envs
    if [ "$1" != main ]; then
      (cd /tmp && timeout 120 $PY $q --json "$OUT/ab_$1_$2.json") >> "$OUT/ab.log" 2>&1
      return
    fi
    for v in ${AB_VARIANTS:-pf4:GVR_TOPK_PF=4 pf0:GVR_TOPK_PF=0}; do
      vname=${v%%:*}; envs=${v#*:}
      (cd /tmp && env ${envs//,/ } timeout 120 $PY $q --json "$OUT/ab_${vname}_$2.json") >> "$OUT/ab.log" 2>&1
      echo "$vname ($envs): exit $?"
    done
  }
  with_each_lib quick_run
  # one line per run: the gvr column (µs) per (N, B), in the order the runs ran
  $PY - "$OUT" <<'PYEOF' 2>&1 | tee "$OUT/ab_compare.log"
import glob, json, os, sys
runs = sorted(glob.glob(os.path.join(sys.argv[1], "ab_*.json")), key=os.path.getmtime)
for path in runs:
    rows = json.load(open(path))["rows"]
    cells = " ".join(f"{r['n'] // 1024}K/B{r['b']}: {r['gvr']:.2f}" for r in sorted(rows, key=lambda r: (r["b"], r["n"])))
    print(f"{os.path.basename(path)[:-5]:24s} {cells}")
PYEOF
}

topkabq() {  # A/B of whole libraries, interleaved: the installed one (main) and each carried build/ab_NAME.so.xz, the
  # quick table's gvr column at N $AB_N (default 64K-256K) + each of $AB_EXTRA (default "0 1": aligned rows, then rows
  # of N + 1 at every phase), B $AB_B (default 8 64), $AB_REPEAT rounds (default 2), the rows generated once
  # (--cache) -> $OUT/abq.log, abq_compare.log (JSON under /tmp/abq: few files come back from a run). AB_ARGS="--rows iid":
  # B distinct N(0, 1) rows; AB_ARGS="--rows traces": B distinct decode-trace rows (64 rows at 64K-256K take ~2.5 min to
  # generate on the H200's host: done first, by quick_gpu_bench.py --generate-only, within $AB_GEN_TIMEOUT, default 400 s)
  say "topk A/B (cached traces)"
  rm -rf /tmp/abq; mkdir -p /tmp/abq
  local q="$ROOT/scripts/quick_gpu_bench.py --n ${AB_N:-65536 131072 262144} --extra ${AB_EXTRA:-0 1} --batch ${AB_B:-8 64} --overlap 0.45 --cols gvr --cache /tmp/abq/cache ${AB_ARGS:-}"
  (cd /tmp && timeout ${AB_GEN_TIMEOUT:-400} $PY $q --generate-only) >> "$OUT/abq.log" 2>&1 || echo "generating the rows: exit $?"
  abq_run() { (cd /tmp && timeout 150 $PY $q --json "/tmp/abq/$1_$2.json") >> "$OUT/abq.log" 2>&1; }
  AB_REPEAT=${AB_REPEAT:-2} with_each_lib abq_run
  $PY - <<'PYEOF' 2>&1 | tee "$OUT/abq_compare.log"
import collections, glob, json, os
t, names = collections.defaultdict(lambda: collections.defaultdict(list)), []
for path in sorted(glob.glob("/tmp/abq/*.json"), key=os.path.getmtime):
    name = os.path.basename(path)[:-5].rsplit("_", 1)[0]
    names += [name] if name not in names else []
    for r in json.load(open(path))["rows"]:
        t[(r["b"], r["n"])][name].append(r["gvr"])
print("gvr column, us (min-max over the rounds); cells: B, N")
print(f"{'B':>3s} {'N':>7s} " + " ".join(f"{x:>13s}" for x in names))
for (b, n), d in sorted(t.items()):
    print(f"{b:3d} {n:7d} " + " ".join(f"{min(d[x]):6.2f}-{max(d[x]):6.2f}" if d[x] else f"{'-':>13s}" for x in names))
PYEOF
}

testsan() {  # every GPU test over $TEST_WORKERS pytest-xdist workers (default 6; the wheels carried in .whl) beside
  # compute-sanitizer memcheck on the $SAN_CASES cases (default topk), then racecheck on them alone (beside 8
  # workers the topk racecheck did not finish in 330 s, H200, session 27; alone it took 269 s, session 28: keep
  # SAN_TIMEOUT >= 300) -> $OUT/pytest_gpu.log, sanitizer_*.log.
  # Without xdist: one pytest process. Not for timings (the GPU is shared).
  local xd=""
  if ls .whl/pytest_xdist-*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site \
      && xd="-n ${TEST_WORKERS:-6} --dist load"
  fi
  say "GPU tests (all, ${xd:-one process}) beside compute-sanitizer memcheck (${SAN_CASES:-topk})"
  (cd tests && timeout ${TEST_TIMEOUT:-420} $PY -m pytest -q -p no:cacheprovider -m gpu -rfEs --maxfail=40 $xd .) > "$OUT/pytest_gpu.log" 2>&1 &
  local pt=$! c
  (for c in ${SAN_CASES:-topk}; do san_one $c memcheck; done) &
  local sm=$!
  wait $pt; echo "pytest: exit $?"; tail -25 "$OUT/pytest_gpu.log"
  wait $sm
  say "compute-sanitizer racecheck (${SAN_CASES:-topk})"
  for c in ${SAN_CASES:-topk}; do san_one $c racecheck; done
}

topkvar() {  # variants of the streamed gvr kernel built on this machine from the installed build's objects
  # (TOPK_VARIANTS="name:-DMACRO=v -DMACRO=v;name2:...", the kernel's A/B macros; optional |PATCH.diff after
  # the flags; $TOPK_ONLY: the objects rebuilt, default the streamed ones 'topk/gvr_stream_*.cu'), then topkab against
  # the installed library: B $AB_B (default 8 64), N $AB_N (default 64K-256K), $AB_REPEAT (default 3) runs
  say "build the variants"
  local v name rest flags patch
  rm -f build/ab_*
  IFS=';' read -ra vs <<< "${TOPK_VARIANTS:?TOPK_VARIANTS=name:flags;...}"
  for v in "${vs[@]}"; do
    name=${v%%:*}; rest=${v#*:}; flags=${rest%%|*}; patch=""
    [ "$rest" != "$flags" ] && patch="--patch ${rest#*|}"
    NVCC_EXTRA="$flags" bash scripts/variant_lib.sh "$name" $patch --only "${TOPK_ONLY:-topk/gvr_stream_*.cu}" > "$OUT/variant_$name.log" 2>&1 &
  done
  wait
  tail -qn 1 "$OUT"/variant_*.log
  AB_VARIANTS="head:X=1" AB_REPEAT=${AB_REPEAT:-3} AB_B="${AB_B:-8 64}" AB_N="${AB_N:-65536 131072 262144}" topkab
}

topkprof() {  # phase stamps of the Top-K kernels: a -DGVR_PROFILE library built on this machine from the installed
  # build's objects (all of topk/), then profile (PP_CASES, default the issue-15 goal cells and B=8 256K)
  say "build the profile library"
  rm -f build/prof_*
  bash scripts/variant_lib.sh here --profile > "$OUT/variant_prof.log" 2>&1; tail -n 1 "$OUT/variant_prof.log"
  PP_CASES=${PP_CASES:-131072 64,131072 1,65536 64,262144 8} profile
}

hintsweep() {  # issue 15's hint-quality sweep on the GPU: with and without prev_topk over overlaps 2-95%
  say "bench_topk hint sweep"
  (cd /tmp && timeout 500 $PY "$ROOT/benchmarks/bench_topk.py" --device cuda --workloads trace02 trace20 trace45 trace70 \
    trace95 --n 32768 65536 131072 262144 --batch 1 8 64 --out "$OUT/bench_hint_sweep_cuda.json") > "$OUT/bench_hint_sweep.log" 2>&1
  echo "exit $?"; tail -70 "$OUT/bench_hint_sweep.log"
}

topkpool() {  # bench_topk on CUDA with $POOL (default 64) independent trace rows per (workload, N): every row of a
  # B=64 batch distinct, as a serving batch has them (the default grid tiles 4, the quick table 1; a batch waits for
  # its slowest row). trace45 and iid, N 64K-256K, B 1/8/64 -> $OUT/bench_pool_cuda.json, bench_pool.log
  say "bench_topk, pool ${POOL:-64}"
  (cd /tmp && timeout 560 $PY "$ROOT/benchmarks/bench_topk.py" --device cuda --pool ${POOL:-64} --workloads trace45 iid \
    --n 65536 131072 262144 --batch 1 8 64 --out "$OUT/bench_pool_cuda.json") > "$OUT/bench_pool.log" 2>&1
  echo "exit $?"; tail -40 "$OUT/bench_pool.log"
}

topkpoolab() {  # a whole-library A/B on topkpool's realistic batches: bench_topk --pool $POOL (default 64) for the
  # installed library and each carried build/ab_NAME.so.xz, interleaved, round i with seed i - 1 (the same rows for every
  # library within a round, other rows in the next: more distinct batches than one grid), $AB_REPEAT rounds (default 2),
  # workloads $POOL_WL (default trace45), N $AB_N (default 131072), B $AB_B (default 64); ~70 s per run at 128K
  # (generation 55 s) -> $OUT/poolab.log, poolab_compare.log (per cell: each library's warm gvr µs, every round)
  say "bench_topk --pool A/B"
  rm -f /tmp/poolab_*.json
  pool_run() {
    (cd /tmp && timeout ${POOL_TIMEOUT:-300} $PY "$ROOT/benchmarks/bench_topk.py" --device cuda --pool ${POOL:-64} \
      --workloads ${POOL_WL:-trace45} --n ${AB_N:-131072} --batch ${AB_B:-64} --seed $(($2 - 1)) --cold-reps 10 \
      --out "/tmp/poolab_$1_$2.json") >> "$OUT/poolab.log" 2>&1
  }
  with_each_lib pool_run
  $PY - <<'PYEOF' 2>&1 | tee "$OUT/poolab_compare.log"
import collections, glob, json, os
t, names = collections.defaultdict(lambda: collections.defaultdict(list)), []
for path in sorted(glob.glob("/tmp/poolab_*.json"), key=os.path.getmtime):
    name = os.path.basename(path)[len("poolab_"):-5].rsplit("_", 1)[0]
    names += [name] if name not in names else []
    for c in json.load(open(path))["cells"]:
        t[(c["workload"], c["b"], c["n"])][name].append(f"{c['methods']['gvr']['warm']['median_us']:.2f}")
print("gvr warm µs per round (round i: seed i - 1); cells: workload, B, N")
print(f"{'workload':9s} {'B':>3s} {'N':>7s}  " + "  ".join(f"{x:>20s}" for x in names))
for (w, b, n), d in sorted(t.items()):
    print(f"{w:9s} {b:3d} {n:7d}  " + "  ".join(f"{' '.join(d[x]):>20s}" for x in names))
PYEOF
}

ncu_b1() {  # Nsight Compute on the B=1 cells of 1K, 4K and 8K tokens (NCU_TOKENS overrides)
  for tok in ${NCU_TOKENS:-1024 4096 8192}; do
    say "ncu B=1 $tok tokens"
    (cd /tmp && timeout 120 ncu -k regex:gvr_attention --launch-skip 2 --launch-count 1 --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis $PY "$ROOT/scripts/profile_attention.py" --tokens $tok) > "$OUT/ncu_b1_$tok.log" 2>&1
    echo "exit $?"; grep -E "Duration|Registers|Achieved Occupancy|Stall|Grid Size|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issued Warp|No Eligible" "$OUT/ncu_b1_$tok.log" | head -30
  done
}

planncu() {  # Nsight Compute on the prefetch's plan kernel (scripts/plan_ncu.py: the pipeline's shape)
  say "ncu plan kernel"
  (cd /tmp && timeout 150 ncu -k regex:plan_kernel --launch-skip 3 --launch-count 1 --set full --import-source yes \
    -o "$OUT/plan" $PY "$ROOT/scripts/plan_ncu.py") > "$OUT/ncu_plan.log" 2>&1
  echo "exit $?"
  ncu -i "$OUT/plan.ncu-rep" --page details > "$OUT/ncu_plan_details.txt" 2>&1
  grep -E "Duration|Elapsed Cycles|Registers|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Executed Ipc|DRAM Throughput" "$OUT/ncu_plan_details.txt" | head -30
  ncu -i "$OUT/plan.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_plan_sass.csv" 2>&1
  sass_top "$OUT/ncu_plan_sass.csv"
}

topkncu() {  # Nsight Compute on the GVR Top-K kernel, warm L2 (cache control none), per cell of NCU_CELLS ("N B,...").
  # Caveat (RESULTS.md, session 24): under the profiler the B=64 128K kernel ran 3x its graph time, and its stall
  # samples spread thin over 15K SASS lines
  local cell n b
  for cell in $(echo "${NCU_CELLS:-131072 64}" | tr ',' '\n' | tr ' ' 'x'); do
    n=${cell%x*}; b=${cell#*x}
    say "ncu topk gvr kernel N=$n B=$b"
    (cd /tmp && timeout 200 ncu -k regex:gvr_topk_gvr_kernel --launch-skip 3 --launch-count 1 --set full --import-source yes \
      --cache-control none -o "$OUT/topk_${n}_$b" $PY "$ROOT/scripts/topk_ncu.py" --n "$n" --b "$b") > "$OUT/ncu_topk_${n}_$b.log" 2>&1
    echo "exit $?"
    ncu -i "$OUT/topk_${n}_$b.ncu-rep" --page details > "$OUT/ncu_topk_${n}_${b}_details.txt" 2>&1
    grep -E "Duration|Elapsed Cycles|Registers|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Executed Ipc|L2 Cache Throughput|DRAM Throughput|Memory Throughput" "$OUT/ncu_topk_${n}_${b}_details.txt" | head -30
    ncu -i "$OUT/topk_${n}_$b.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_topk_${n}_${b}_sass.csv" 2>&1
    sass_top "$OUT/ncu_topk_${n}_${b}_sass.csv"
  done
}

sass_top() {  # the 40 SASS lines with the most warp-stall samples of an ncu source CSV, with their share
  $PY - "$1" <<'PYEOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((i for i, r in enumerate(rows) if "Source" in r), None)
if hdr is None:
    print("no source table"); sys.exit()
h = rows[hdr]
col = lambda name: next((i for i, c in enumerate(h) if c.startswith(name)), None)
src, samp, addr = col("Source"), col("Warp Stall Sampling (All"), col("Address")
if samp is None:
    print("columns:", h[:30]); sys.exit()
print("columns:", [c for c in h if "Stall" in c or "stall" in c][:12])
body = [r for r in rows[hdr + 1:] if len(r) > max(src, samp)]
tot = sum(float(r[samp] or 0) for r in body) or 1
print(f"{len(body)} SASS lines, {tot:.0f} samples")
for r in sorted(body, key=lambda r: -float(r[samp] or 0))[:40]:
    print(f"{100 * float(r[samp] or 0) / tot:5.1f}%  {r[addr] if addr is not None else ''}  {r[src][:120]}")
PYEOF
}

floor() {  # the B=1 attention cells' floors: empty / load-chain / chain + merge kernels beside gvr
  say "latency floor (B=1 cells)"
  (cd /tmp && timeout 400 $PY "$ROOT/scripts/latency_floor.py" --json "$OUT/latency_floor.json") 2>&1 | tee "$OUT/latency_floor.log" | tail -10
}

topkfloor() {  # issue 15's goal cells: empty / read / read + exchange / + output kernels of gvr's grids beside gvr
  say "top-k floor (B=1 and B=64 at 128K)"
  (cd /tmp && timeout 300 $PY "$ROOT/scripts/topk_floor.py" --json "$OUT/topk_floor.json") 2>&1 | tee "$OUT/topk_floor.log" | tail -10
}

build
for mode in "${@:-check}"; do
  case $mode in
    check) check ;;
    bench) bench ;;
    attn) attn ;;
    prr) prr ;;
    attntests) attntests ;;
    attnquick) attnquick ;;
    ncu) ncu_b1 ;;
    planncu) planncu ;;
    floor) floor ;;
    topkfloor) topkfloor ;;
    topkncu) topkncu ;;
    topkvar) topkvar ;;
    topkprof) topkprof ;;
    prrbench) prrbench ;;
    prrprof) prrprof ;;
    prrlayers) prrlayers ;;
    budget) budget ;;
    topkpt) topkpt ;;
    sparda) sparda ;;
    spardabench) spardabench ;;
    spardashapes) spardashapes ;;
    spardacarveout) spardacarveout ;;
    topkedges) topkedges ;;
    topkedgesab) topkedgesab ;;
    spardapartscarve) spardapartscarve ;;
    spardapipecarve) spardapipecarve ;;
    spardahidden) spardahidden ;;
    topkragged) topkragged ;;
    gputests) gputests ;;
    prrfused) prrfused ;;
    sanall) for c in topk attention prr sparda; do sanitize $c; done ;;
    spardapipe) spardapipe ;;
    spardafp8) spardafp8 ;;
    spardapipefp8) spardapipefp8 ;;
    spardaparts) spardaparts ;;
    spardaselect) spardaselect ;;
    prefetcher) prefetcher ;;
    hintsweep) hintsweep ;;
    topkpool) topkpool ;;
    topkpoolab) topkpoolab ;;
    topkquick) topkquick ;;
    profile) profile ;;
    attnprofile) attnprofile ;;
    attnab) attnab ;;
    attnsan) sanitize attention ;;
    prrsan) sanitize prr ;;
    spardasan) sanitize sparda ;;
    fp8) fp8 ;;
    fp8bench) fp8bench ;;
    fp8all) fp8all ;;
    topkab) topkab ;;
    topkabq) topkabq ;;
    testsan) testsan ;;
    attncpu) attncpu ;;
    calib) calib ;;
    topktests) topktests ;;
    topksan) sanitize topk ;;
    topkrace) topkrace ;;
    build) ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
say "done"
