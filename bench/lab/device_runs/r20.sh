#!/usr/bin/env bash
# Issue 44, exact_max's stage-2 speed: one change against its base in one call. Before the call:
#   git archive HEAD > .deps/base.tar && git apply bench/lab/patches/<patch> && git commit -am "..."
# then carry .deps/cutlass.tar.xz .deps/base.tar. Builds this tree (and the base in the background), runs the
# exact_max GPU cases, the exact stage's cost slope (bench/lab/exact_cost_slope.py) and the A/B of the index rows
# (index_exact_max, index_row_max at 32K / 128K, index_exact_max_all at 32K: every block a candidate; graph replays, alternating processes). ~250 s on a fresh machine.
# Files: OUT/ab_exact_stage_<card>.json, OUT/exact_cost_slope_<card>.json, OUT/r20.tgz.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
export SP_TEST_INSTALLED=1
W=/tmp/r20; mkdir -p $W
SP_AB_NAME=exact_stage SP_AB_WHAT="${R20_WHAT:-exact_max stage 2}" SP_AB_KINDS=index_exact_max,index_exact_max_all,index_row_max \
  bash scripts/gpu.sh $W build abbase > $W/gpu.log 2>&1
tail -12 $W/gpu.log
G=$(cat $W/card.txt)
cp $W/ab_exact_stage_*.json "$OUT/" 2>/dev/null
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/python/test_exact_max_cuda.py tests/python/test_key_max_cuda.py \
  -k exact_max > $W/test_exact.log 2>&1
tail -4 $W/test_exact.log
timeout 90 python3 bench/lab/exact_cost_slope.py "$OUT/exact_cost_slope_${G}.json" > $W/slope.log 2>&1
cut -c1-160 $W/slope.log
tar czf "$OUT/r20.tgz" -C $W --exclude='*.json' .
