#!/usr/bin/env bash
# Session 12, a short call: build with the index stage A/B against .deps/base.tar (carried; built beside this tree's
# build, quick sizes, key_max and row_max), then the whole GPU suite (~180 s on the H100) until R4_END s.
set -u
OUT=$1
END=${R4_END:-400}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
SP_AB_QUICK=1 SP_AB_NAME=${R4_AB_NAME:-index} SP_AB_WHAT="${R4_AB_WHAT:-this tree against .deps/base.tar}" \
  SP_AB_KINDS=index_key_max,index_row_max bash scripts/gpu.sh "$OUT" build abbase > "$OUT/gpu_build.log" 2>&1
grep -E "ours/base|rc=" "$OUT/gpu_build.log" | tail -8
SP_TEST_INSTALLED=1 timeout $(( END - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE tests/python \
  > "$OUT/gpu_suite.log" 2>&1; tail -6 "$OUT/gpu_suite.log"
