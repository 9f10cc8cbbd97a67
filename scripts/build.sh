#!/usr/bin/env bash
# Configures and builds SparsePrefill into ./build (CUDA backend included when nvcc is found).
# Extra arguments are passed to cmake's configure step, e.g. -DSPARSE_PREFILL_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
[ -f build/CMakeCache.txt ] && gen=()   # keep the generator of an existing build tree
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" "$@"
cmake --build build -j"$(nproc)"
