#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs the demo. On a machine with an NVIDIA GPU and a CUDA build
# it runs the GPU path; otherwise the CPU reference backend on a small structured input.
# Extra arguments go to the demo (e.g. --seqlen 8192).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh > build.log 2>&1 || { tail -40 build.log; echo "build failed (full log: build.log)"; exit 1; }
exec ./build/sparse_prefill_demo "$@"
