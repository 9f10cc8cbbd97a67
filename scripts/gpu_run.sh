#!/usr/bin/env bash
# One-shot GPU session for the dense CUDA kernel: build (unless a prebuilt build-cuda/libsp_cuda_test.so is present
# and SP_REBUILD is unset), SASS summary, GPU tests, benchmarks. Everything goes to the output folder $1.
# A/B builds found as build-cuda/libsp_cuda_test_<variant>.so (tests/gpu/build.sh with SP_VARIANT/SP_VARIANT_FLAGS)
# get the quick test suite and a 3-length benchmark each, in their own processes.
# Device time: ~3 min machine start + ~2 min for everything here (with 3 variants).
#   scripts/gpu_run.sh OUT [--no-bench] [--lengths 4096,...] [--flex]
# CUTLASS headers: $SP_CUTLASS_ROOT, or .deps/cutlass (copied by the developer: include/ and tools/util/include/),
# or the nvidia-cutlass wheel.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:?usage: gpu_run.sh OUT_DIR [--no-bench] [--lengths L,...] [--flex]}"
shift
BENCH=1; LENGTHS="4096,8192,16384,32768,65536,131072"; FLEX=""
while (( $# )); do
  case "$1" in
    --no-bench) BENCH=0 ;;
    --lengths) LENGTHS="$2"; shift ;;
    --flex) FLEX="--flex" ;;
  esac
  shift
done
mkdir -p "$OUT"
cd "$ROOT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [[ ! -f build-cuda/libsp_cuda_test.so || -n "${SP_REBUILD:-}" ]]; then
  rm -f build-cuda/*.o
  tests/gpu/build.sh "$ROOT/build-cuda" "$(nproc)" > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -50 "$OUT/build.log"; exit 1; }
fi
if command -v cuobjdump > /dev/null; then
  for o in build-gpu/CMakeFiles/sparse_prefill.dir/src/cuda/fwd_*.cu.o; do
    cuobjdump --dump-sass "$o" > "$OUT/$(basename "$o").sass" 2>&1
    echo "$o: HGMMA=$(grep -c HGMMA "$OUT/$(basename "$o").sass") local-mem=$(grep -c 'LDL\|STL' "$OUT/$(basename "$o").sass")"
  done > "$OUT/sass_summary.txt"
  cat "$OUT/sass_summary.txt"
fi
build-cuda/test_block_iterator > "$OUT/test_block_iterator.log" 2>&1; tail -1 "$OUT/test_block_iterator.log"
# Smoke first, under a timeout: a deadlocked pipeline must not eat the session.
timeout 90 python3 tests/gpu/test_dense.py --smoke > "$OUT/smoke.log" 2>&1
SMOKE_RC=$?
cat "$OUT/smoke.log" | tail -5
if (( SMOKE_RC != 0 )); then echo "smoke failed rc=$SMOKE_RC"; exit 2; fi
timeout 300 python3 tests/gpu/test_dense.py --out "$OUT/test_dense.json" 2>&1 | tee "$OUT/test_dense.log" | tail -30
TEST_RC=${PIPESTATUS[0]}
if (( BENCH )); then
  # Also writes $OUT/dense_h200_paged_varlen.json (varlen vs separate calls, paged 64/128 vs contiguous).
  timeout 400 python3 bench/bench_dense.py --out "$OUT/dense_h200.json" --lengths "$LENGTHS" $FLEX 2>&1 \
    | tee "$OUT/bench_dense.log"
  # A/B builds (tests/gpu/build.sh with SP_VARIANT=name): each in its own process, three lengths.
  for so in build-cuda/libsp_cuda_test_*.so; do
    [[ -f "$so" ]] || continue
    n="${so##*libsp_cuda_test_}"; n="${n%.so}"
    SP_CUDA_LIB="$ROOT/$so" timeout 90 python3 tests/gpu/test_dense.py --quick --out "$OUT/test_dense_ab_$n.json" \
      > "$OUT/test_dense_ab_$n.log" 2>&1 || echo "variant $n: tests FAILED (see test_dense_ab_$n.log)"
    tail -1 "$OUT/test_dense_ab_$n.log"
    SP_CUDA_LIB="$ROOT/$so" timeout 200 python3 bench/bench_dense.py --out "$OUT/dense_h200_ab_$n.json" \
      --lengths 8192,32768,131072 --label "variant $n" --no-extra 2>&1 | tee "$OUT/bench_dense_ab_$n.log"
  done
fi
echo "tests rc=$TEST_RC"
exit "$TEST_RC"
