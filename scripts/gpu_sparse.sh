#!/usr/bin/env bash
# Block-sparse checks and benchmark on the GPU machine. Logs and JSON go to the folder given as $1.
#   SP_COMMIT=<commit> scripts/gpu_sparse.sh OUT [check|final|ab|bench|chunked|ncu|sanitize|decode|paged] [args...]
# check (default): build (CMake, the shim and the Python extension only), dense smoke, the Python CUDA suite
#   (sparse kernel vs the CPU reference, alpha=0 vs dense, paged, block 256), a quick sparse benchmark.
# final: the Python CUDA suite, both benchmarks and the sanitizers (one call).
# ab: quick benchmark with SP_SPARSE_PERSISTENT=1 and =0.
# bench: the full sparse benchmark (bench/bench_sparse.py, extra args passed on).
# chunked: the chunked-prefill benchmark (bench/bench_chunked.py, extra args passed on).
# ncu: hardware counters of one 128K sparse launch.
# sanitize: compute-sanitizer memcheck and racecheck of the sparse kernel on the Python CUDA cases.
# decode: dense GPU tests (split-KV shapes included), the dense Python CUDA cases, bench/bench_decode.py, memcheck.
# paged: dense GPU tests, the dense/paged Python CUDA cases, sanitizers on small pages, paged-vs-contiguous bench.
# CUTLASS headers: $SP_CUTLASS_ROOT or .deps/cutlass (carried).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:?usage: gpu_sparse.sh OUT_DIR [check|final|ab|bench|chunked|ncu|sanitize] [args...]}"
PHASE="${2:-check}"
shift; shift || true
mkdir -p "$OUT"
cd "$ROOT"
export SP_COMMIT="${SP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
CUT="${SP_CUTLASS_ROOT:-$ROOT/.deps/cutlass}"
step() { echo "== $* ($(date +%T))"; }

step build
if [[ ! -f build-gpu/libsp_cuda_test.so ]]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSE_PREFILL_TESTS=OFF -DSP_CUTLASS_ROOT="$CUT" \
    -DPython_EXECUTABLE="$(command -v python3)" > "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" --target sp_cuda_test _C >> "$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log"; exit 1; }
fi
mkdir -p build-cuda && cp build-gpu/libsp_cuda_test.so build-cuda/libsp_cuda_test.so
g++ -std=c++17 -O2 -Isrc tests/gpu/test_block_iterator.cpp -o build-gpu/test_block_iterator && build-gpu/test_block_iterator | tail -2
export PYTHONPATH="$ROOT/python"

case "$PHASE" in
  check)
    step dense smoke
    timeout 90 python3 tests/gpu/test_dense.py --smoke > "$OUT/smoke.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/smoke.log"
    step python CUDA suite
    timeout 240 python3 -m pytest -q tests/python/test_cuda.py > "$OUT/pytest_cuda.log" 2>&1; echo "rc=$?"
    tail -25 "$OUT/pytest_cuda.log"
    step "python CUDA suite, sparse cases, one CTA per tile"
    SP_SPARSE_PERSISTENT=0 timeout 120 python3 -m pytest -q tests/python/test_cuda.py -k sparse \
      > "$OUT/pytest_cuda_nonpersistent.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/pytest_cuda_nonpersistent.log"
    step "python CUDA suite, sparse cases, no split-KV"
    SP_SPARSE_SPLIT=0 timeout 120 python3 -m pytest -q tests/python/test_cuda.py -k "sparse or union or chunked" \
      > "$OUT/pytest_cuda_nosplit.log" 2>&1; echo "rc=$?"; tail -3 "$OUT/pytest_cuda_nosplit.log"
    step quick sparse benchmark
    timeout 200 python3 bench/bench_sparse.py --out "$OUT/sparse_quick.json" --lengths 8192,32768,131072 --no-sweep \
      --no-accuracy --no-flex "$@" 2>&1 | tail -8
    ;;
  final)
    step python CUDA suite
    timeout 200 python3 -m pytest -q tests/python/test_cuda.py > "$OUT/pytest_cuda.log" 2>&1; echo "rc=$?"
    tail -n 3 "$OUT/pytest_cuda.log"
    step sparse benchmark
    timeout 150 python3 bench/bench_sparse.py --out "$OUT/sparse_h200.json" > "$OUT/bench.log" 2>&1; echo "rc=$?"
    step chunked-prefill benchmark
    timeout 280 python3 bench/bench_chunked.py --out "$OUT/chunked_h200.json" > "$OUT/chunked.log" 2>&1; echo "rc=$?"
    for tool in memcheck; do
      step "$tool"
      timeout 60 compute-sanitizer --tool "$tool" --kernel-name kns=fwd_kernel python3 -m pytest -q -x \
        tests/python/test_cuda.py -k "sparse and not paged" > "$OUT/${tool}_sparse.log" 2>&1
      tail -n 2 "$OUT/${tool}_sparse.log"
    done
    ;;
  ab)
    step "A/B: sparse persistent (default) vs one CTA per tile"
    for v in 1 0; do
      SP_SPARSE_PERSISTENT=$v timeout 150 python3 bench/bench_sparse.py --out "$OUT/ab_persistent$v.json" \
        --no-sweep --no-accuracy --no-flex --no-peers "$@" 2>&1 | tail -6
    done
    ;;
  chunked)
    step chunked-prefill benchmark
    timeout 560 python3 bench/bench_chunked.py --out "$OUT/chunked_h200.json" "$@" 2>&1 | tee "$OUT/chunked.log" | tail -30
    ;;
  bench)
    step sparse benchmark
    timeout 560 python3 bench/bench_sparse.py --out "$OUT/sparse_h200.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -30
    ;;
  ncu)
    step "ncu: sparse kernel at 128K (correction off, then on)"
    for c in nocorr corr; do
      timeout 200 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:fwd_kernel \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 bench/profile_sparse.py 131072 $c > "$OUT/ncu_$c.log" 2>&1
      grep -E "gpu__time|dram__|lts__|sm__" "$OUT/ncu_$c.log"
    done
    ;;
  decode)
    step "dense GPU tests (tests/gpu/test_dense.py, incl. the PackGQA + split-KV shapes)"
    timeout 200 python3 tests/gpu/test_dense.py --out "$OUT/dense_gpu_tests.json" > "$OUT/test_dense.log" 2>&1
    echo "rc=$?"; grep -v '"ok": true' "$OUT/test_dense.log" | tail -8
    step "python CUDA suite (dense)"
    timeout 150 python3 -m pytest -q tests/python/test_cuda.py -k dense > "$OUT/pytest_cuda_dense.log" 2>&1
    echo "rc=$?"; tail -3 "$OUT/pytest_cuda_dense.log"
    step "short queries against long keys benchmark"
    timeout 200 python3 bench/bench_decode.py --out "$OUT/dense_decode_h200.json" "$@" 2>&1 | tee "$OUT/decode.log" |
      cut -c1-400 | tail -12
    step "memcheck, dense split shapes"
    timeout 120 compute-sanitizer --tool memcheck python3 -m pytest -q -x tests/python/test_cuda.py \
      -k short_queries > "$OUT/memcheck_dense_split.log" 2>&1
    tail -3 "$OUT/memcheck_dense_split.log"
    ;;
  paged)
    step "dense GPU tests (tests/gpu/test_dense.py, incl. the cp.async gather for page sizes 1 / 16 / 32 / 48)"
    timeout 240 python3 tests/gpu/test_dense.py --out "$OUT/dense_gpu_tests.json" > "$OUT/test_dense.log" 2>&1
    echo "rc=$?"; grep -v '"ok": true' "$OUT/test_dense.log" | tail -8
    step "python CUDA suite (dense, paged)"
    timeout 150 python3 -m pytest -q tests/python/test_cuda.py -k "dense or paged" > "$OUT/pytest_cuda_dense.log" 2>&1
    echo "rc=$?"; tail -3 "$OUT/pytest_cuda_dense.log"
    for tool in memcheck racecheck; do
      step "$tool, small pages"
      timeout 150 compute-sanitizer --tool "$tool" python3 -m pytest -q -x tests/python/test_cuda.py \
        -k small_pages > "$OUT/${tool}_small_pages.log" 2>&1
      tail -3 "$OUT/${tool}_small_pages.log"
    done
    step "paged vs contiguous, page sizes 1 / 16 / 64 / 128"
    timeout 300 python3 bench/bench_dense.py --out "$OUT/dense_main.json" --lengths 8192 --no-varlen \
      --page-sizes 1,16,64,128 --extra-out "$OUT/dense_paged.json" "$@" 2>&1 | tail -4
    python3 - "$OUT/dense_paged.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(json.dumps(r)[:300])
PY
    ;;
  sanitize)
    for tool in memcheck racecheck; do
      step "$tool"
      timeout 200 compute-sanitizer --tool "$tool" --kernel-name kns=fwd_kernel python3 -m pytest -q -x \
        tests/python/test_cuda.py -k "sparse and not paged" > "$OUT/${tool}_sparse.log" 2>&1
      tail -4 "$OUT/${tool}_sparse.log"
    done
    ;;
esac
step done
