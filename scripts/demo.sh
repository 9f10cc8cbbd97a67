#!/usr/bin/env bash
# The main job: installs dependencies, builds the demo, runs it. With an NVIDIA GPU (nvidia-smi -L lists one) it builds
# the CUDA backend and runs the GPU path (dense attention, the GPU index stage, sparse attention at L=32768), then the
# CPU reference backend on a small input; without one it builds the CPU backend only (no CUDA compile) and runs that.
# Extra arguments go to the demo (bash scripts/demo.sh --help lists them, e.g. --seqlen 8192).
# Build trees: ./build (with a GPU, shared with scripts/build.sh) or ./build-demo (CPU only, demo target only).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[demo.sh] $*"; }

say "checking dependencies (scripts/install_deps.sh)..."
bash scripts/install_deps.sh | sed -u 's/^/[demo.sh]   /'

if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  say "GPU found: $(nvidia-smi -L | head -1); building with the CUDA backend"
  dir=build
  cfg=(-DSPARSE_PREFILL_CUDA=AUTO)
  first="first time: several minutes, the CUDA kernels"
else
  say "no GPU found (nvidia-smi -L lists none): building the CPU reference backend only (CUDA is not compiled)"
  dir=build-demo
  cfg=(-DSPARSE_PREFILL_CUDA=OFF -DSPARSE_PREFILL_PYTHON=OFF -DSPARSE_PREFILL_TESTS=OFF)
  first="first time: about a minute"
fi
mkdir -p "$dir"
log=$dir/demo-build.log
gen=()
command -v ninja >/dev/null && [ ! -f "$dir/CMakeCache.txt" ] && gen=(-G Ninja)
say "configuring $dir (log: $log)..."
if ! cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSPARSE_PREFILL_EXAMPLES=ON \
      -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" "${cfg[@]}" > "$log" 2>&1; then
  tail -30 "$log"; say "configure failed (full log: $log)"; exit 1
fi
say "building ($first)..."
t0=$SECONDS
# Ninja/make progress lines only ([12/40] Building ...); everything else (ptxas register reports) goes to the log.
if ! cmake --build "$dir" --target sparse_prefill_demo -j"${SP_JOBS:-$(nproc)}" 2>&1 | tee -a "$log" |
      { grep --line-buffered -E '^\[ *[0-9]+(/[0-9]+\]|%\])' || true; } | sed -u 's/^/[demo.sh]   /'; then
  tail -40 "$log"; say "build failed (full log: $log)"; exit 1
fi
say "built in $((SECONDS - t0)) s; running ./$dir/sparse_prefill_demo $*"
exec "./$dir/sparse_prefill_demo" "$@"
