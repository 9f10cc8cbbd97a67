#!/usr/bin/env bash
# The test command: installs dependencies, builds everything (every CUDA source is compiled when nvcc is present),
# runs the C++ tests (ctest) and the Python tests (pytest). GPU tests skip themselves where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install_deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q tests/python
