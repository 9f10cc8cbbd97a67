#!/usr/bin/env bash
# Configures and builds SparsePrefill in place: the CMake tree ./build (or $SP_BUILD_DIR), the CUDA backend included
# when nvcc is found (CUTLASS headers: scripts/install_deps.sh unpacks them into .deps/cutlass), the extension written
# into python/sparse_prefill (then `PYTHONPATH=python` imports it; needs nanobind in python3).
# The package route is `pip install .` / `pip install -e .` (pyproject.toml); scripts/test.sh uses that one.
# Extra arguments go to cmake's configure step, e.g. -DSPARSE_PREFILL_CUDA=OFF. Parallel jobs: $SP_JOBS (default:
# the number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${SP_BUILD_DIR:-build}
PY=$(command -v "${PYTHON:-python3}")
# The extension needs nanobind in that Python (pip install . brings its own; this plain build does not install any)
if [[ " $* " != *" -DSPARSE_PREFILL_PYTHON=OFF "* ]] && ! "$PY" -c "import nanobind" 2>/dev/null; then
  echo "[build.sh] nanobind is not importable by $PY: \`$PY -m pip install nanobind\` (or pass" \
       "-DSPARSE_PREFILL_PYTHON=OFF to build without the Python extension; \`pip install .\` needs neither)" >&2
  exit 1
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
[ -f "$dir/CMakeCache.txt" ] && gen=()   # keep the generator of an existing build tree
cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY" \
      "$@"
cmake --build "$dir" -j"${SP_JOBS:-$(nproc)}"
