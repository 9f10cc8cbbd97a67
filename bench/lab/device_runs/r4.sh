#!/usr/bin/env bash
# Session 12, a short call: build, the whole GPU suite, then the index stage A/B against .deps/base.tar (carried) with
# the time left until R4_END s.
set -u
OUT=$1
END=${R4_END:-400}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh "$OUT" build > "$OUT/gpu_build.log" 2>&1; tail -3 "$OUT/gpu_build.log"
SP_TEST_INSTALLED=1 timeout $(( END - 60 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE tests/python \
  > "$OUT/gpu_suite.log" 2>&1; tail -6 "$OUT/gpu_suite.log"
[[ -f .deps/base.tar ]] && SP_AB_QUICK=1 SP_AB_NAME=${R4_AB_NAME:-index} SP_AB_WHAT="${R4_AB_WHAT:-this tree against .deps/base.tar}" \
  SP_AB_KINDS=index_key_max,index_row_max timeout $(( END - SECONDS )) bash scripts/gpu.sh "$OUT" abbase \
  > "$OUT/gpu_ab.log" 2>&1
grep -E "ours/base|rc=" "$OUT/gpu_ab.log" | tail -8
