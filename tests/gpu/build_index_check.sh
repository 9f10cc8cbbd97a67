#!/usr/bin/env bash
# Builds tests/gpu/check_index_stage without CMake (CPU reference + index stage only; no CUTLASS needed), into $1.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
B="${1:-/tmp/sp_index_check}"
mkdir -p "$B"
srcs=("$ROOT"/src/core/*.cpp "$ROOT"/src/api/*.cpp "$ROOT"/src/reference/*.cpp "$ROOT"/src/workload/*.cpp)
for f in "${srcs[@]}"; do
  g++ -O2 -std=c++20 -I"$ROOT/include" -I"$ROOT/src" -c "$f" -o "$B/$(basename "$f").o" &
done
nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a -O3 -I"$ROOT/include" -I"$ROOT/src" \
  -c "$ROOT/src/cuda/index_stage.cu" -o "$B/index_stage.o" &
nvcc -std=c++20 -x cu -gencode=arch=compute_90a,code=sm_90a -O2 -I"$ROOT/include" -I"$ROOT/src" \
  -c "$ROOT/tests/gpu/check_index_stage.cpp" -o "$B/check_index_stage.o" &
wait
nvcc -gencode=arch=compute_90a,code=sm_90a "$B"/*.o -o "$B/check_index_stage" -lpthread
