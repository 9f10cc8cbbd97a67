#!/usr/bin/env bash
# Session 14, the sink reference's first GPU run with little device time left (~150 s of command): build, key_max's
# CUDA tests against the CPU reference, then bench_selection's key_max rows at 32K (alpha 0.01 and 0.03) until R8_END s.
set -u
OUT=$1
END=${R8_END:-140}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh "$OUT" build > "$OUT/gpu_build.log" 2>&1; tail -2 "$OUT/gpu_build.log"
G=$(cat "$OUT/card.txt")  # gpu.sh names the card
SP_TEST_INSTALLED=1 timeout 70 python3 -m pytest -q -p no:cacheprovider -rfE tests/python/test_key_max_cuda.py \
  > "$OUT/key_max_cuda.log" 2>&1; tail -6 "$OUT/key_max_cuda.log"
timeout $(( END - SECONDS )) python3 bench/bench_selection.py --lengths 32768 \
  --configs "sp:rule=key_max;alpha=0.01,sp:rule=key_max;alpha=0.03" --dense-lengths "" --gate-lengths "" --chunk "" \
  --out "$OUT/selection_keymax_sink_${G}.json" > "$OUT/bench_selection.log" 2>&1
tail -8 "$OUT/bench_selection.log"
