#!/usr/bin/env bash
# The GPU machine's one script: build gvr for the chip present, check it, time it. Logs and JSON go to
# $OUT (default /tmp/gvr_out). Usage: bash scripts/gpu_check.sh MODE [MODE ...], run from the repo root.
#   check    GPU tests (pytest -m gpu: kernels against the C path, opcheck and torch.compile on CUDA),
#            compute-sanitizer memcheck + racecheck on small cases of every kernel path, the demo
#   compare  before/after quick table: this build, then an older one carried in .old/ (its source tree in
#            .old/src, its libgvr_cuda.so built for the chip at .old/libgvr_cuda_old.so), then this one
#            again (run-to-run spread); JSON per run under $OUT
#   attn     the attention operators only: their GPU tests, sanitizer on their cases, their benchmark
#   prr      issue 13's pieces (Quest selection, EMA predictor, runtime): their GPU tests
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
  digest=$(cat setup.py csrc/*.[ch] csrc/*/*.[ch] $(find kernels -name '*.cu' -o -name '*.cuh' -o -name '*.h' | sort) gvr/*.py 2>/dev/null | sha256sum | cut -c1-16)
  if [ "$(cat /tmp/gvr_built 2>/dev/null)" = "$digest" ]; then echo "build: up to date ($digest)"; return 0; fi
  say "build (GVR_CUDA_ARCHS=$GVR_CUDA_ARCHS)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
  local tb=$SECONDS
  $PY -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; local rc=$?
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
    echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer_$tool.log") clean summaries)"; tail -2 "$OUT/sanitizer_$tool.log"
  done
  say "demo"
  (cd /tmp && timeout 120 $PY -m gvr) 2>&1 | tee "$OUT/demo.log" | tail -6
}

attn() {  # the attention operators only: their GPU tests, sanitizer on their cases, their benchmark
  say "GPU tests (attention)"
  (cd tests && timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu -rs -x test_attention_gpu.py test_attention_bad_input.py test_readme.py) 2>&1 | tee "$OUT/pytest_attention_gpu.log" | tail -15
  say "compute-sanitizer (attention)"
  for tool in memcheck racecheck; do
    (cd /tmp && timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $PY "$ROOT/scripts/sanitize_case.py" --only attention) > "$OUT/sanitizer_attention_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer_attention_$tool.log") clean summaries)"; tail -2 "$OUT/sanitizer_attention_$tool.log"
  done
  say "attention benchmark"
  (cd /tmp && timeout 300 $PY "$ROOT/benchmarks/bench_attention.py" --json "$OUT/results_attention_cuda.json" \
    --append-results "$OUT/RESULTS_attention_cuda.md") > "$OUT/bench_attention.log" 2>&1
  echo "bench_attention exit $?"; tail -75 "$OUT/bench_attention.log"
}

prr() {  # issue 13's pieces: their GPU tests (their CUDA paths are gated until these pass: csrc/dispatch.h)
  say "GPU tests (prr)"
  (cd tests && timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu -rs test_prr_select_gpu.py test_prr_ema_gpu.py $(ls test_prr_runtime_gpu.py 2>/dev/null)) 2>&1 | tee "$OUT/pytest_prr_gpu.log" | tail -15
}

quick() {  # $1: label; PYTHONPATH selects the build
  (cd /tmp && timeout 200 $PY "$ROOT/scripts/quick_gpu_bench.py" --json "$OUT/qb_$1.json") 2>&1 | tee "$OUT/qb_$1.log" | tail -45
}

compare() {
  [ -f .old/libgvr_cuda_old.so ] && [ -d .old/src ] || { echo "compare: .old/ missing"; return 1; }
  if [ ! -f /tmp/oldsite/gvr/_lib/libgvr_cuda.so ]; then
    say "old build (C extension only; its CUDA library was built on the workstation)"
    (cd .old/src && GVR_SKIP_CUDA=1 $PY -m pip install -q --no-build-isolation --no-deps --target /tmp/oldsite . > "$OUT/build_old.log" 2>&1) || { tail "$OUT/build_old.log"; return 1; }
    mkdir -p /tmp/oldsite/gvr/_lib && cp .old/libgvr_cuda_old.so /tmp/oldsite/gvr/_lib/libgvr_cuda.so
  fi
  say "quick table: new";   quick new
  say "quick table: old";   PYTHONPATH=/tmp/oldsite quick old
  say "quick table: new again"; quick new2
}

bench() {
  say "full benchmark"
  (cd /tmp && timeout 400 $PY "$ROOT/benchmarks/bench_topk.py" --device cuda --out "$OUT/bench_cuda.json" \
    --append-results "$OUT/RESULTS_cuda.md" --pool 2 --reps 40 --cold-reps 30) > "$OUT/bench_cuda.log" 2>&1
  echo "bench exit $?"; tail -40 "$OUT/bench_cuda.log"
  say "attention benchmark"
  (cd /tmp && timeout 300 $PY "$ROOT/benchmarks/bench_attention.py" --json "$OUT/results_attention_cuda.json" \
    --append-results "$OUT/RESULTS_attention_cuda.md") > "$OUT/bench_attention.log" 2>&1
  echo "bench_attention exit $?"; tail -75 "$OUT/bench_attention.log"
}

build
for mode in "${@:-check}"; do
  case $mode in
    check) check ;;
    compare) compare ;;
    bench) bench ;;
    attn) attn ;;
    prr) prr ;;
    build) ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
say "done"
