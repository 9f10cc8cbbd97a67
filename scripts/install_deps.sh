#!/usr/bin/env bash
# Installs everything SparsePrefill needs to build and test on a fresh Debian machine:
#   Debian: cmake, ninja, g++, GoogleTest, python3-venv;  PyPI: nanobind, numpy, pytest, CUTLASS/CuTe headers
#   (nvidia-cutlass). pip install . fetches its own build requirements (pyproject.toml: scikit-build-core, nanobind).
# Idempotent: each step is skipped when already satisfied. The CUDA toolkit (nvcc) is optional and not installed
# here; when present, the CUDA backend is compiled too.
set -euo pipefail
PY=${PYTHON:-python3}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
# scripts/test.sh installs the package into a fresh virtual environment (Debian's python3 needs python3-venv for that)
$PY -c "import ensurepip, venv" 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[deps] apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "[deps] missing system packages: ${need_apt[*]} (install them with your package manager)" >&2
    exit 1
  fi
fi

pip_need=()
$PY -c "import nanobind" 2>/dev/null || pip_need+=("nanobind>=2.4")
$PY -c "import numpy" 2>/dev/null || pip_need+=(numpy)
$PY -c "import pytest" 2>/dev/null || pip_need+=(pytest)
if [ ${#pip_need[@]} -gt 0 ]; then
  echo "[deps] pip install ${pip_need[*]}"
  $PY -m pip install -q "${pip_need[@]}"
fi
# CUTLASS/CuTe headers only (the wheel's Python parts are not used): --no-deps keeps it small.
if ! $PY -c "import cutlass_library, os, sys; sys.exit(0 if os.path.isdir(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include', 'cute')) else 1)" 2>/dev/null; then
  echo "[deps] pip install nvidia-cutlass==4.2.0.0 (headers)"
  $PY -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
fi
echo "[deps] ok"
