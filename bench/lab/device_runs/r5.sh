#!/usr/bin/env bash
# Session 13, the third call (warm, after r1.sh and r2.sh): bench_selection's key_max rows at this tree, then issue
# 46's baselines on this card (dense bf16 at 8K / 32K / 128K beside cuDNN, FP8 dense and sparse) until R5_END s.
set -u
OUT=$1
END=${R5_END:-330}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh "$OUT" build > "$OUT/gpu_build.log" 2>&1; tail -3 "$OUT/gpu_build.log"
G=$(cat "$OUT/card.txt")  # gpu.sh names the card
timeout $(( (END - SECONDS) / 2 )) python3 bench/bench_selection.py --lengths 32768,131072 \
  --configs "default,sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.1" --dense-lengths "" --gate-lengths "" \
  --chunk "131072:1024" --chunk-configs "sp:rule=key_max;alpha=0.03" \
  --out "$OUT/selection_keymax_${G}.json" > "$OUT/bench_selection.log" 2>&1
tail -12 "$OUT/bench_selection.log"
timeout $(( (END - SECONDS) / 2 )) python3 bench/bench_dense.py --lengths 8192,32768,131072 --no-extra --paged-lengths "" \
  --no-varlen --out "$OUT/dense_${G}.json" > "$OUT/bench_dense.log" 2>&1
tail -12 "$OUT/bench_dense.log"
timeout $(( END - SECONDS )) python3 bench/bench_fp8.py --lengths 16384,131072 --error-max-len 16384 --sparse-lengths 131072 --out "$OUT/fp8_${G}.json" > "$OUT/bench_fp8.log" 2>&1
tail -12 "$OUT/bench_fp8.log"
