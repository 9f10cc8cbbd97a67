#!/usr/bin/env bash
# Builds build_dir/libsp_cuda_test[_<variant>].so: the library with its CUDA backend + the ctypes shim of the GPU
# tests and benchmarks (tests/gpu/sp_cuda.py), through the project's CMake (target sp_cuda_test).
# Usage: tests/gpu/build.sh [build_dir (default build-cuda)] [jobs]
# A/B variants: SP_VARIANT=pingpong SP_VARIANT_FLAGS="-DSP_PINGPONG" builds build_dir/libsp_cuda_test_pingpong.so
# in its own CMake tree (build-gpu-<variant>) with the flags added to every nvcc call.
# (Until 2026-11-29 this compiled fwd_*.cu + cuda_backend.cpp + the shim straight with nvcc; since the index stage and
# the split-KV kernels the backend needs the whole library, so that library no longer loaded.)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${1:-$ROOT/build-cuda}"
JOBS="${2:-2}"
if [[ -n "${SP_CUTLASS_ROOT:-}" ]]; then CUT="$SP_CUTLASS_ROOT"
elif [[ -d "$ROOT/.deps/cutlass/include/cute" ]]; then CUT="$ROOT/.deps/cutlass"
else CUT="$(python3 -c 'import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),"source"))')"
fi
WORK="$ROOT/build-gpu${SP_VARIANT:+-$SP_VARIANT}"
cmake -S "$ROOT" -B "$WORK" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSE_PREFILL_TESTS=OFF -DSP_CUTLASS_ROOT="$CUT" \
  -DCMAKE_CUDA_FLAGS="${SP_VARIANT_FLAGS:-}" -DPython_EXECUTABLE="$(command -v python3)" > /dev/null
cmake --build "$WORK" -j"$JOBS" --target sp_cuda_test
mkdir -p "$BUILD"
cp "$WORK/libsp_cuda_test.so" "$BUILD/libsp_cuda_test${SP_VARIANT:+_$SP_VARIANT}.so"
# Host-only exhaustive check of the block iterator (the producer/consumer seam); no GPU needed.
g++ -std=c++17 -O2 -I"$ROOT/src" "$ROOT/tests/gpu/test_block_iterator.cpp" -o "$BUILD/test_block_iterator"
echo "built $BUILD/libsp_cuda_test${SP_VARIANT:+_$SP_VARIANT}.so"
