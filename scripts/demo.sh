#!/usr/bin/env bash
# The main job: installs dependencies, builds the demo, runs it. With an NVIDIA GPU (nvidia-smi -L lists one) it builds
# the CUDA backend (where nvcc is found) and runs the GPU path (dense attention, the GPU index stage, sparse attention at
# L=32768), then the CPU reference backend on a small input (the topic workload at 8K tokens, ~10 s on 2 cores);
# without one it builds the CPU backend only (no CUDA compile, even where nvcc is installed: nothing could run it) and
# runs that. The demo prints why it was built the way it was (no GPU found / no nvcc / switched off), and what the
# selection kept and why (density, whether the dense rule fired).
# Extra arguments go to the demo (bash scripts/demo.sh --help lists them and the defaults, e.g. --seqlen 16384).
# Build tree: ./build-demo (the library and the demo only: no Python extension, no tests).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[demo.sh] $*"; }

say "checking dependencies (scripts/install_deps.sh)..."
bash scripts/install_deps.sh | sed -u 's/^/[demo.sh]   /'

dir=build-demo
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  say "GPU found: $(nvidia-smi -L | head -1); building with the CUDA backend where nvcc is found"
  cfg=(-DSPARSE_PREFILL_CUDA=AUTO -DSP_CUDA_OFF_REASON=)
  first="first time: several minutes with CUDA (the kernels; ~11 min on 2 cores), about a minute without"
else
  nvcc_note=""
  command -v nvcc >/dev/null && nvcc_note=", nvcc not used"
  say "no GPU found (nvidia-smi -L lists none): building the CPU reference backend only$( [ -n "$nvcc_note" ] &&
      echo " (nvcc is at $(command -v nvcc), but nothing here could run CUDA code)")"
  cfg=(-DSPARSE_PREFILL_CUDA=OFF "-DSP_CUDA_OFF_REASON=no GPU found by scripts/demo.sh$nvcc_note")
  first="first time: about a minute"
fi
cfg+=(-DSPARSE_PREFILL_PYTHON=OFF -DSPARSE_PREFILL_TESTS=OFF)
mkdir -p "$dir"
log=$dir/demo-build.log
gen=()
command -v ninja >/dev/null && [ ! -f "$dir/CMakeCache.txt" ] && gen=(-G Ninja)
say "configuring $dir (log: $log)..."
if ! cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSPARSE_PREFILL_EXAMPLES=ON \
      -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" "${cfg[@]}" > "$log" 2>&1; then
  tail -30 "$log"; say "configure failed (full log: $log)"; exit 1
fi
grep -E "CUDA backend (ON|OFF)" "$log" | sed 's/^-- /[demo.sh]   /' || true
say "building ($first)..."
t0=$SECONDS
# Ninja/make progress lines only ([12/40] Building ...); everything else (ptxas register reports) goes to the log.
if ! cmake --build "$dir" --target sparse_prefill_demo -j"${SP_JOBS:-$(nproc)}" 2>&1 | tee -a "$log" |
      { grep --line-buffered -E '^\[ *[0-9]+(/[0-9]+\]|%\])' || true; } | sed -u 's/^/[demo.sh]   /'; then
  tail -40 "$log"; say "build failed (full log: $log)"; exit 1
fi
say "built in $((SECONDS - t0)) s; running ./$dir/sparse_prefill_demo $*"
exec "./$dir/sparse_prefill_demo" "$@"
