#!/usr/bin/env bash
# Session 16, call 6 (run as an inline command then; kept here): build, both retrieval seeds trained side by side
# (3.5 min), then both evaluated at 32K on R15_CONFIGS (default: the two-stage rule at alpha 0.03 / 0.01 / 0.1 beside
# the default and the oracles) until ~575 s, through reval.sh (session 16's inline call wrote the same rows as
# accuracy_retrieval_two_stage_seed{1,2}_<card>.json). Results: OUT/accuracy_retrieval_seed{1,2}_<card>.json.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r15; mkdir -p $W
bash scripts/gpu.sh $W build > $W/b.log 2>&1; tail -1 $W/b.log
G=$(cat $W/card.txt)
for s in 1 2; do
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/train_seed$s.log 2>&1 &
done
wait
CF=${R15_CONFIGS:-"dense_sp,default,emu:score=kmax;alpha=0.03;cand_mean=0.003;subgroups=g,emu:score=kmax;alpha=0.01;cand_mean=0.003;subgroups=g,oracle_0.5,oracle_0.9,emu:score=kmax;alpha=0.1;cand_mean=0.003;subgroups=g"}
for s in 1 2; do grep '"step"' $W/train_seed$s.log | tail -1; done
. bench/lab/device_runs/reval.sh "$OUT" "$CF" 575  # both seeds at 32K -> OUT/accuracy_retrieval_seed{1,2}_<card>.json
tar czf $OUT/r15.tgz -C $W .
