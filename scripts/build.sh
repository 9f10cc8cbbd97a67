#!/usr/bin/env bash
# Configures and builds SparsePrefill in place: the CMake tree ./build (or $SP_BUILD_DIR), the CUDA backend included
# when nvcc is found, the extension written into python/sparse_prefill (then `PYTHONPATH=python` imports it).
# The package route is `pip install .` / `pip install -e .` (pyproject.toml); scripts/test.sh uses that one.
# Extra arguments go to cmake's configure step, e.g. -DSPARSE_PREFILL_CUDA=OFF. Parallel jobs: $SP_JOBS (default:
# the number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${SP_BUILD_DIR:-build}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
[ -f "$dir/CMakeCache.txt" ] && gen=()   # keep the generator of an existing build tree
cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" \
      "$@"
cmake --build "$dir" -j"${SP_JOBS:-$(nproc)}"
