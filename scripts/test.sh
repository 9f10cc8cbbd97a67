#!/usr/bin/env bash
# The test command (CI: .ci/run). Every step runs against what a user gets from `pip install .`:
#   1. dependencies (scripts/install_deps.sh; it says what it installs, and where, before it does);
#   2. the virtual environment build/venv with the test tools: pytest, and torch + transformers (the lower bounds of
#      pyproject.toml's hf extra, below) so that the torch-dependent tests run on the CPU: torch.ops.sparse_prefill.*,
#      the transformers / vLLM / SGLang adapters' contract tests, the integration layer, the FP8 paths that take torch
#      tensors. PyPI's torch for Linux x86_64 is the CUDA build: 4.9 GB on disk with its nvidia-* wheels, ~2 min to
#      fetch and unpack here; the tests take torch without those wheels, on the machine's CUDA toolkit (1.9 GB; below,
#      with what happens where that does not import). The environment is made once and kept while its Python and
#      pins stay the same (a clean clone, as in CI, makes it anew); SP_TEST_TORCH=0 makes one without torch;
#   3. `pip install '.[test]'` into it from this tree. pip's CMake tree is kept in build/ci (scikit-build-core
#      build-dir) and configured with the C++ tests and the demo, so that one compile serves both the wheel and ctest:
#      the library with every CUDA source when nvcc is found (CUDA ON, so a missing CUTLASS fails instead of quietly
#      building CPU only), the extension, the C++ tests, the demo. Progress: the compile steps as they go;
#   4. ctest in that tree (GoogleTest suites, the host-side block-iterator check, the demo's command line);
#   5. the C++ package: `cmake --install build/ci --component dev` into build/ci-prefix, then the consumer project
#      tests/cmake_consumer (find_package(SparsePrefill)) is configured against it, built and run;
#   6. pytest tests/python and tests/fuzz with the venv's python against the INSTALLED package (SP_TEST_INSTALLED=1
#      makes the conftest assert that sparse_prefill does not resolve to python/ of this tree); the run fails if a
#      test skipped because torch or transformers could not be imported (unless the environment has no torch: above).
# GPU tests skip themselves where there is no GPU. Parallel jobs: $SP_JOBS (default: the number of cores).
# SPARSE_PREFILL_CUDA=OFF bash scripts/test.sh: a quick CPU-only run for development (CI compiles CUDA where nvcc is).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
JOBS=${SP_JOBS:-$(nproc)}
BUILD=build/ci
VENV=build/venv
WITH_TORCH=${SP_TEST_TORCH:-1}
# torch and transformers at the lower bounds of pyproject.toml's hf extra (the range the package states, which the
# torch extra shares), read from there rather than restated, so that CI tests the oldest versions a user can get and
# the pins cannot drift from the ranges (tests/python/test_packaging.py). They are the GPU machine's versions too
# (bench/results/e2e_h200.json: torch 2.11.0+cu130, transformers 5.17.0): the CPU and GPU runs test the same code.
pins=$("$PY" scripts/extra_pins.py hf)
TORCH_REQS=($pins)
t_start=$SECONDS
say() { echo "[test] $*"; }
step() { say "$1 ($((SECONDS - t_start)) s so far)"; }
# pip's own lines that tell what it fetches and installs (its download bars are not printed into a pipe)
pip_progress() { { grep --line-buffered -E '^ *(Collecting|Downloading|Installing collected|Successfully installed)' || true; } |
                 sed -u -E 's/^ */[test]   /; s/(.{160}).*/\1 .../'; }

step "dependencies"
bash scripts/install_deps.sh | sed -u 's/^/[test]   /'

# -- 2. the virtual environment and the test tools --------------------------------------------------------------------
mkdir -p build
stamp="$("$PY" -c 'import sys; print(sys.version.split()[0])') pytest ${TORCH_REQS[*]} torch=$WITH_TORCH"
VPY=$ROOT/$VENV/bin/python
# the stamp's first line: what was asked; its second: the torch the environment got (1, light or 0: below)
if [ -x "$VPY" ] && [ "$(head -1 "$VENV/.sp-test-reqs" 2>/dev/null)" = "$stamp" ]; then
  WITH_TORCH=$(sed -n 2p "$VENV/.sp-test-reqs")
  step "reusing $VENV (Python and test requirements unchanged; torch: $WITH_TORCH)"
  "$VPY" -m pip uninstall -q -y sparse-prefill 2>/dev/null || true   # the package is installed anew below
else
  step "fresh virtual environment $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  reqs=(pytest)
  [ "$WITH_TORCH" = 1 ] && reqs+=("${TORCH_REQS[@]}")
  pip_in() { "$VPY" -m pip install -v --disable-pip-version-check --no-cache-dir "$@" 2>&1 | pip_progress; }
  # --no-cache-dir: nothing of the download stays outside this folder (the environment itself is kept instead)
  if [ "$WITH_TORCH" = 1 ]; then
    # PyPI's torch brings 3.2 GB of CUDA libraries (nvidia-*, triton) that the CPU tests never load (CI machines
    # have had 4 GB free): torch comes without them, its loader taking the machine's CUDA toolkit (nvcc's, in
    # ldconfig: cudart, cuBLAS, cuFFT, cuDNN, NCCL, ...) plus, as wheels, the three libraries a toolkit lacks
    # (cuSPARSELt, NVSHMEM, cuFile): 1.9 GB, 45 s. Where that torch does not import (no such toolkit), the whole
    # CUDA build of torch (4.9 GB) if the disk has 8 GB free, else no torch (its tests skip, said).
    WITH_TORCH=light
    step "installing ${reqs[*]} into $VENV (torch without its nvidia-* wheels, on this machine's CUDA toolkit)"
    torch_pin=$(printf '%s\n' "${reqs[@]}" | grep '^torch==')
    pip_in --no-deps "$torch_pin"
    # torch's own requirements but the CUDA wheels, and of those only the three named above (versions from torch)
    mapfile -t torch_deps < <("$VPY" - <<'PYEOF'
import importlib.metadata as md, re
for req in md.requires("torch"):
    spec, _, marker = req.partition(";")
    name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
    if "extra ==" in marker or name == "triton" or name == "cuda-bindings":
        continue
    if name == "cuda-toolkit":
        print("cuda-toolkit[cufile]" + spec.split("]", 1)[1].strip())
    elif not name.startswith("nvidia-") or re.match(r"nvidia-(cusparselt|nvshmem)-", name):
        print(spec.strip())
PYEOF
    )
    pip_in "${torch_deps[@]}" $(printf '%s\n' "${reqs[@]}" | grep -v '^torch==')
    if ! "$VPY" -c "import torch" 2> build/torch-import.log; then
      tail -1 build/torch-import.log | sed 's/^/[test]   /'
      "$VPY" -m pip uninstall -q -y torch
      free_gb=$(df -Pk build | awk 'NR == 2 {print int($4 / 1048576)}')
      if [ "$free_gb" -ge 8 ]; then
        WITH_TORCH=1
        step "torch does not import without its nvidia-* wheels here: installing PyPI's whole CUDA build (~5 GB)"
        pip_in "$torch_pin"
      else
        WITH_TORCH=0
        say "torch does not import without its nvidia-* wheels here, and $free_gb GB are free for them (8 needed):"
        say "no torch, the torch-dependent tests skip"
      fi
    fi
  else
    step "installing ${reqs[*]} into $VENV (SP_TEST_TORCH=0: no torch, the torch-dependent tests skip)"
    pip_in "${reqs[@]}"
  fi
  printf '%s\n%s\n' "$stamp" "$WITH_TORCH" > "$VENV/.sp-test-reqs"
  du -sh "$VENV" | awk '{print "[test]   " $2 ": " $1 " on disk"}'
fi

# -- 3. pip install . -------------------------------------------------------------------------------------------------
cs=--config-settings
pip_args=($cs "build-dir=$BUILD" $cs cmake.define.SPARSE_PREFILL_TESTS=ON $cs cmake.define.SPARSE_PREFILL_EXAMPLES=ON)
with_cuda=0
if [ "${SPARSE_PREFILL_CUDA:-AUTO}" != OFF ] && command -v nvcc >/dev/null; then
  with_cuda=1
  pip_args+=($cs cmake.define.SPARSE_PREFILL_CUDA=ON)
  say "nvcc found ($(nvcc --version | tail -1)): the CUDA backend is compiled"
else
  pip_args+=($cs cmake.define.SPARSE_PREFILL_CUDA=OFF)
  say "CPU backend only ($(command -v nvcc >/dev/null && echo "SPARSE_PREFILL_CUDA=OFF" || echo "no nvcc"))"
fi
log=build/ci-pip-install.log
# Build isolation (pip's default: the build requirements in a throw-away environment, CUTLASS included where CUDA is
# compiled, exactly as a user's `pip install .`) on CI, where the clone is new anyway. Elsewhere the venv gets the
# build requirements itself and pip builds with --no-build-isolation and the CUTLASS headers of .deps/cutlass:
# scikit-build-core clears the CMake tree whenever the isolated environment changes (every run), which would recompile
# the CUDA kernels on every run of this script. SP_BUILD_ISOLATION=1/0 overrides.
if [ "${SP_BUILD_ISOLATION:-$([ "${CI:-}" = true ] && echo 1 || echo 0)}" = 0 ]; then
  mapfile -t build_reqs < <("$VPY" - <<'PYEOF'
import re
text = open("pyproject.toml").read()
print("\n".join(re.findall(r'"([^"]+)"', re.search(r"^requires = \[(.*?)\]", text, re.M).group(1))))
PYEOF
  )
  step "build requirements into $VENV: ${build_reqs[*]} (pip builds with --no-build-isolation)"
  "$VPY" -m pip install -q --disable-pip-version-check "${build_reqs[@]}"
  pip_args+=(--no-build-isolation)
  [ "$with_cuda" = 1 ] && pip_args+=($cs "cmake.define.SP_CUTLASS_ROOT=$ROOT/.deps/cutlass")
else
  say "pip builds with build isolation (its own environment with the build requirements, as a user's pip install .)"
fi
step "pip install '.[test]' into $VENV (builds $BUILD; first time with CUDA: about 11 minutes on 2 cores; log: $log)"
# the compile steps as they go ([12/60] Building CUDA object ...), the build requirements pip fetches, the CMake
# backend line; everything (ptxas reports included) goes to the log
if ! CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$VPY" -m pip install -v --disable-pip-version-check ".[test]" "${pip_args[@]}" \
      2>&1 | tee "$log" |
      { grep --line-buffered -E '^ *(\[ *[0-9]+/[0-9]+\] |-- CUDA backend|Installing build dependencies|Collecting|Successfully installed)' ||
        true; } | sed -u -E 's/^ *(-- )?/[test]   /; s/(.{160}).*/\1 .../'; then
  tail -60 "$log"; say "pip install failed (full log: $log)"; exit 1
fi
if [ "$with_cuda" = 1 ]; then   # every CUDA translation unit was compiled into the library
  n_src=$(find src/cuda -name '*.cu' | wc -l)
  n_obj=$(find "$BUILD" -name '*.cu.o' -path '*sparse_prefill.dir*' | wc -l)
  say "CUDA objects in $BUILD: $n_obj of $n_src sources"
  [ "$n_obj" -eq "$n_src" ] || { say "expected one object per src/cuda/*.cu"; exit 1; }
fi

# -- 4. ctest -------------------------------------------------------------------------------------------------------
step "ctest ($BUILD)"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS"

# -- 5. the installed C++ package, used by a consumer project -------------------------------------------------------
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

# -- 6. pytest against the installed package --------------------------------------------------------------------------
step "pytest tests/python with $VENV/bin/python"
"$VPY" - <<'PYEOF'
import importlib.util
import sparse_prefill as sp
print(f"[test]   sparse_prefill {sp.__version__} from {sp.__file__} (CUDA backend: {sp.with_cuda})")
for name in ("torch", "transformers"):
    found = importlib.util.find_spec(name) is not None
    version = __import__(name).__version__ if found else "not installed: its tests skip"
    print(f"[test]   {name} {version}")
PYEOF
# two runs: each folder has its own conftest module (one pytest process would import only one of them as `conftest`);
# -rs lists why tests skipped (no GPU here, cupy / jax / vLLM / SGLang not installed)
SP_TEST_INSTALLED=1 "$VPY" -m pytest -q -rs -p no:cacheprovider tests/python 2>&1 | tee build/ci-pytest.log
SP_TEST_INSTALLED=1 "$VPY" -m pytest -q -rs -p no:cacheprovider tests/fuzz 2>&1 | tee -a build/ci-pytest.log
if [ "$WITH_TORCH" != 0 ] && grep -E "could not import '(torch|transformers)" build/ci-pytest.log; then
  say "tests skipped for want of torch or transformers, which $VENV should hold"; exit 1
fi
step "done"
