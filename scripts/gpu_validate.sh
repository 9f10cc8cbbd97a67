#!/usr/bin/env bash
# Everything the GPU machine checks and measures. Logs and JSON go to the folder given as $1.
#   SP_COMMIT=<commit> scripts/gpu_validate.sh OUT [main|sanitize]     (CUTLASS headers: .deps/cutlass or SP_CUTLASS_ROOT)
# main (default): CMake build of the whole project (library, Python extension, GPU checks, demo), ptxas/SASS summary,
#   the dense kernel's GPU tests and benchmark (scripts/gpu_run.sh on this build), index-stage checks + timings, the
#   demo's GPU path, the Python suite (its CUDA cases run here).
# sanitize: compute-sanitizer memcheck and racecheck on small cases (needs the build of a previous `main` run).
# The two phases are separate calls because one device command may run 10 minutes at most.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:?usage: gpu_validate.sh OUT_DIR [main|sanitize]}"
PHASE="${2:-main}"
mkdir -p "$OUT"
cd "$ROOT"
export SP_COMMIT="${SP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
CUT="${SP_CUTLASS_ROOT:-$ROOT/.deps/cutlass}"
step() { echo "== $* ($(date +%T))"; }

if [[ "$PHASE" == sanitize ]]; then
  step memcheck, index stage
  timeout 150 compute-sanitizer --tool memcheck build-gpu/check_index_stage --checks-only > "$OUT/memcheck_index.log" 2>&1
  tail -2 "$OUT/memcheck_index.log"
  step racecheck, index stage
  timeout 150 compute-sanitizer --tool racecheck build-gpu/check_index_stage --checks-only > "$OUT/racecheck_index.log" 2>&1
  tail -2 "$OUT/racecheck_index.log"
  step memcheck, dense kernel smoke
  timeout 200 compute-sanitizer --tool memcheck --kernel-name kns=fwd python3 tests/gpu/test_dense.py --smoke \
    > "$OUT/memcheck_dense.log" 2>&1
  tail -3 "$OUT/memcheck_dense.log"
  step racecheck, dense kernel smoke
  timeout 200 compute-sanitizer --tool racecheck --kernel-name kns=fwd python3 tests/gpu/test_dense.py --smoke \
    > "$OUT/racecheck_dense.log" 2>&1
  tail -3 "$OUT/racecheck_dense.log"
  exit 0
fi

step build
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSE_PREFILL_TESTS=OFF -DSP_CUTLASS_ROOT="$CUT" \
  -DPython_EXECUTABLE="$(command -v python3)" > "$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j"$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -12 > "$OUT/ptxas_summary.txt"
for o in build-gpu/CMakeFiles/sparse_prefill.dir/src/cuda/*.cu.o; do
  n=$(basename "$o")
  s=$(cuobjdump --dump-sass "$o" 2>&1)
  echo "$n: HGMMA=$(grep -c HGMMA <<< "$s") HMMA=$(grep -c 'HMMA\.' <<< "$s") LDL/STL=$(grep -cE 'LDL|STL' <<< "$s")"
done | tee "$OUT/sass_summary.txt"

step dense tests and benchmark
mkdir -p build-cuda && cp build-gpu/libsp_cuda_test.so build-cuda/libsp_cuda_test.so
bash scripts/gpu_run.sh "$OUT/dense" 2>&1 | tail -25
step index stage checks and timings
timeout 200 build-gpu/check_index_stage "$OUT/index_stage_h200.json" 2>&1 | tee "$OUT/index_stage.log" | tail -9
step demo
timeout 120 build-gpu/sparse_prefill_demo 2>&1 | tee "$OUT/demo.log"
step python suite
PYTHONPATH="$ROOT/python" timeout 200 python3 -m pytest -q -x tests/python > "$OUT/pytest.log" 2>&1; tail -3 "$OUT/pytest.log"
step done
