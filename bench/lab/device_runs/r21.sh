#!/usr/bin/env bash
# Session 19: exact_max through the library (its CUDA index stage) on the retrieval subject, never measured there
# before (r18.sh never ran). One call on a fresh machine, no carry beyond the CUTLASS headers: both retrieval seeds
# trained side by side (3.5 min) after the package builds, then both evaluated concurrently at 32K (then 16K) on the
# dense path, the default, exact_max at alpha 0.05 / 0.1 / 0.2, the oracle at half / 70 % of each row's mass and the
# default with the dense rule off (its candidate density) until ~570 s. Files: OUT/accuracy_retrieval_seed{1,2}_<card>.json,
# the eval logs, r21.tgz. R21_CONFIGS replaces the configs (session 21: exact_max after the band change).
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r21; mkdir -p $W
bash scripts/gpu.sh $W build > $W/gpu_build.log 2>&1; tail -2 $W/gpu_build.log  # the trainer imports the package
for s in 1 2; do
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/train_seed$s.log 2>&1 &
done
wait  # the trainings
G=$(cat $W/card.txt)
for s in 1 2; do grep '"step"' $W/train_seed$s.log | tail -1 | cut -c1-200; done
EX="sp:rule=exact_max"
. bench/lab/device_runs/reval.sh "$OUT" \
  "${R21_CONFIGS:-dense_sp,default,$EX;alpha=0.05,$EX;alpha=0.1,$EX;alpha=0.2,oracle_0.5,oracle_0.7,sp:dense_fraction=1.0}" \
  575 32768,16384
tar czf "$OUT/r21.tgz" -C $W --exclude='*.json' .
