#!/usr/bin/env bash
# Session 21, call 2 on the machine r22.sh built (the e4m3 lab patch installed): compute-sanitizer memcheck on
# exact_max's GPU cases that reach every path of the new stage (varlen and chunk shapes, the sink / window / padded
# rows, D 64 fp16, block 256, the poisoned workspace, a NaN key, paged KV at pages 64 and 16, FP8), while the first
# SmolLM2 half (carried: .deps/smollm2.part.aa) goes to ~/ for the next call (gpu.sh's model phase). ~4 min.
# Files: OUT/memcheck_exact_max.log.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
export SP_TEST_INSTALLED=1
[[ -f .deps/smollm2.part.aa ]] && cp .deps/smollm2.part.aa ~/ && ls -la ~/smollm2.part.aa
sel="exact_max and not topic and not 3000 and not 0.5-0.0"
timeout 280 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/python/test_exact_max_cuda.py tests/python/test_key_max_cuda.py -k "$sel" > "$OUT/memcheck_exact_max.log" 2>&1
echo "memcheck rc=$?"
grep -E "ERROR SUMMARY|passed|failed|Error" "$OUT/memcheck_exact_max.log" | tail -8
