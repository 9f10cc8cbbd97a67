#!/usr/bin/env bash
# The test command (CI: .ci/run). Every step runs against what a user gets from `pip install .`:
#   1. dependencies (scripts/install_deps.sh);
#   2. a fresh virtual environment build/venv, and `pip install .` into it from this tree. pip's CMake tree is kept
#      in build/ci (scikit-build-core build-dir) and configured with the C++ tests and the demo, so that one compile
#      serves both the wheel and ctest: the library with every CUDA source when nvcc is found (CUDA ON, so a
#      missing CUTLASS fails instead of quietly building CPU only), the extension, the C++ tests, the demo;
#   3. ctest in that tree (GoogleTest suites, the host-side block-iterator check, the demo's command line);
#   4. the C++ package: `cmake --install build/ci --component dev` into build/ci-prefix, then the consumer project
#      tests/cmake_consumer (find_package(SparsePrefill)) is configured against it, built and run;
#   5. pytest tests/python with the venv's python against the INSTALLED package (SP_TEST_INSTALLED=1 makes the
#      conftest assert that sparse_prefill does not resolve to python/ of this tree).
# GPU tests skip themselves where there is no GPU. The venv sees the system site-packages only where the system
# Python has torch (to run the torch and CUDA tests). Parallel jobs: $SP_JOBS (default: the number of cores).
# SPARSE_PREFILL_CUDA=OFF bash scripts/test.sh: a quick CPU-only run for development (CI compiles CUDA where nvcc is).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
JOBS=${SP_JOBS:-$(nproc)}
BUILD=build/ci
VENV=build/venv
t_start=$SECONDS
say() { echo "[test] $*"; }
step() { say "$1 ($((SECONDS - t_start)) s so far)"; }

step "dependencies"
bash scripts/install_deps.sh

# -- 2. venv + pip install . ------------------------------------------------------------------------------------------
mkdir -p build
cs=--config-settings
pip_args=($cs "build-dir=$BUILD" $cs cmake.define.SPARSE_PREFILL_TESTS=ON $cs cmake.define.SPARSE_PREFILL_EXAMPLES=ON)
with_cuda=0
if [ "${SPARSE_PREFILL_CUDA:-AUTO}" != OFF ] && command -v nvcc >/dev/null; then
  with_cuda=1
  cutlass=$("$PY" -c "import cutlass_library as c, os; print(os.path.join(os.path.dirname(c.__file__), 'source'))")
  pip_args+=($cs cmake.define.SPARSE_PREFILL_CUDA=ON $cs "cmake.define.SP_CUTLASS_ROOT=$cutlass")
  say "nvcc found ($(nvcc --version | tail -1)): the CUDA backend is compiled (CUTLASS at $cutlass)"
else
  pip_args+=($cs cmake.define.SPARSE_PREFILL_CUDA=OFF)
  say "CPU backend only ($(command -v nvcc >/dev/null && echo "SPARSE_PREFILL_CUDA=OFF" || echo "no nvcc"))"
fi
venv_args=()
if "$PY" -c "import torch" 2>/dev/null; then
  venv_args=(--system-site-packages)   # torch is not reinstalled into the venv: use the system's
fi
step "fresh virtual environment $VENV ${venv_args[*]}"
rm -rf "$VENV"
"$PY" -m venv "${venv_args[@]}" "$VENV"
VPY=$ROOT/$VENV/bin/python
log=build/ci-pip-install.log
# Build isolation (pip's default: the build requirements of pyproject.toml in a throw-away environment) on CI, where
# the clone is new anyway. Elsewhere the venv gets those requirements itself and pip builds with
# --no-build-isolation: scikit-build-core clears the CMake tree whenever the isolated environment changes (every run),
# which would recompile the CUDA kernels on every run of this script. SP_BUILD_ISOLATION=1/0 overrides.
if [ "${SP_BUILD_ISOLATION:-$([ "${CI:-}" = true ] && echo 1 || echo 0)}" = 0 ]; then
  mapfile -t build_reqs < <("$VPY" - <<'PYEOF'
import re
text = open("pyproject.toml").read()
print("\n".join(re.findall(r'"([^"]+)"', re.search(r"^requires = \[(.*?)\]", text, re.M).group(1))))
PYEOF
  )
  step "build requirements into $VENV: ${build_reqs[*]} (pip builds with --no-build-isolation)"
  "$VPY" -m pip install -q "${build_reqs[@]}"
  pip_args+=(--no-build-isolation)
fi
step "pip install '.[test]' into $VENV (builds $BUILD; first time with CUDA: about 11 minutes on 2 cores; log: $log)"
if ! CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$VPY" -m pip install -v ".[test]" "${pip_args[@]}" > "$log" 2>&1; then
  tail -60 "$log"; say "pip install failed (full log: $log)"; exit 1
fi
grep -E "CUDA backend (ON|OFF)" "$log" | sed 's/^/[test]   /' || true
if [ "$with_cuda" = 1 ]; then   # every CUDA translation unit was compiled into the library
  n_src=$(find src/cuda -name '*.cu' | wc -l)
  n_obj=$(find "$BUILD" -name '*.cu.o' -path '*sparse_prefill.dir*' | wc -l)
  say "CUDA objects in $BUILD: $n_obj of $n_src sources"
  [ "$n_obj" -eq "$n_src" ] || { say "expected one object per src/cuda/*.cu"; exit 1; }
fi

# -- 3. ctest -------------------------------------------------------------------------------------------------------
step "ctest ($BUILD)"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS"

# -- 4. the installed C++ package, used by a consumer project -------------------------------------------------------
step "C++ package: install to build/ci-prefix, build tests/cmake_consumer against it"
rm -rf build/ci-prefix build/ci-consumer
cmake --install "$BUILD" --prefix build/ci-prefix --component dev > build/ci-consumer.log
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if ! { cmake -S tests/cmake_consumer -B build/ci-consumer "${gen[@]}" -DCMAKE_PREFIX_PATH="$ROOT/build/ci-prefix" &&
       cmake --build build/ci-consumer; } >> build/ci-consumer.log 2>&1; then
  cat build/ci-consumer.log; say "the consumer project failed to configure or build"; exit 1
fi
grep "SparsePrefill .* from" build/ci-consumer.log | sed 's/^/[test]   /'
build/ci-consumer/consumer

# -- 5. pytest against the installed package --------------------------------------------------------------------------
step "pytest tests/python with $VENV/bin/python"
"$VPY" -c "import sparse_prefill as sp; print('[test]   sparse_prefill', sp.__version__, 'from', sp.__file__)"
# two runs: each folder has its own conftest module (one pytest process would import only one of them as `conftest`)
SP_TEST_INSTALLED=1 "$VPY" -m pytest -q -p no:cacheprovider tests/python
SP_TEST_INSTALLED=1 "$VPY" -m pytest -q -p no:cacheprovider tests/fuzz
step "done"
