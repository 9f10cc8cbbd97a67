#!/usr/bin/env bash
# Session 19: exact_max through the library (its CUDA index stage) on the retrieval subject, never measured there
# before (r18.sh never ran). One call on a fresh machine, no carry beyond the CUTLASS headers: both retrieval seeds
# trained side by side (3.5 min) after the package builds, then both evaluated concurrently at 32K (then 16K) on the
# dense path, the default, exact_max at alpha 0.05 / 0.1 / 0.2, the oracle at half / 70 % of each row's mass and the
# default with the dense rule off (its candidate density) until ~570 s. Files: OUT/accuracy_retrieval_seed{1,2}_<card>.json,
# the eval logs, r21.tgz.
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
mkdir -p /tmp/ret
left=$(( 575 - SECONDS ))
for s in 1 2; do
  (cd bench && timeout $left python3 accuracy/retrieval.py eval --ckpt /tmp/retrieval_seed$s.pt --device cuda \
     --lengths 32768,16384 --n-seq 16 --budget-s $(( left - 50 )) \
     --configs "dense_sp,default,$EX;alpha=0.05,$EX;alpha=0.1,$EX;alpha=0.2,oracle_0.5,oracle_0.7,sp:dense_fraction=1.0" \
     --out /tmp/ret/accuracy_retrieval_seed${s}_${G}.json) > "$OUT/retrieval_eval_seed$s.log" 2>&1 &
done
wait
for s in 1 2; do grep -E '^\[|budget|Error' "$OUT/retrieval_eval_seed$s.log" | tail -20 | cut -c1-220; cp /tmp/ret/accuracy_retrieval_seed${s}_${G}.json "$OUT/" 2>/dev/null; done
tar czf "$OUT/r21.tgz" -C $W --exclude='*.json' .
