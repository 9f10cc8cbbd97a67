#!/usr/bin/env bash
# Session 13 (not run: no H200 came), a warm call: bench_selection's key_max rows at this tree, then issue
# 46's baselines on this card (dense bf16 at 8K / 32K / 128K beside cuDNN, FP8 dense and sparse) until R5_END s.
# The device returns at most 8 files: the logs go to /tmp/r5 and come back as OUT/r5.tgz.
set -u
OUT=$1
END=${R5_END:-330}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r5; mkdir -p $W
bash scripts/gpu.sh $W build > $W/gpu_build.log 2>&1; tail -3 $W/gpu_build.log
G=$(cat $W/card.txt)  # gpu.sh names the card
timeout $(( (END - SECONDS) / 2 )) python3 bench/bench_selection.py --lengths 32768,131072 \
  --configs "default,sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.1" --dense-lengths "" --gate-lengths "" \
  --chunk "131072:1024" --chunk-configs "sp:rule=key_max;alpha=0.03" \
  --out "$OUT/selection_keymax_${G}.json" > $W/bench_selection.log 2>&1
tail -12 $W/bench_selection.log
timeout $(( (END - SECONDS) / 2 )) python3 bench/bench_dense.py --lengths 8192,32768,131072 --no-extra --paged-lengths "" \
  --no-varlen --out "$OUT/dense_${G}.json" > $W/bench_dense.log 2>&1
tail -12 $W/bench_dense.log
timeout $(( END - SECONDS )) python3 bench/bench_fp8.py --lengths 16384,131072 --error-max-len 16384 --sparse-lengths 131072 \
  --out "$OUT/fp8_${G}.json" > $W/bench_fp8.log 2>&1
tail -12 $W/bench_fp8.log
tar czf "$OUT/r5.tgz" -C $W .
