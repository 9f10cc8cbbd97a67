#!/usr/bin/env bash
# Session 17, call 2 of 2, on the machine that ran r17.sh (build + the SmolLM2 wheel's first half) just before,
# carrying .deps/smollm2.part.ab and the gguf wheel: exact_max through the library (its CUDA index stage) on both
# subjects. SmolLM2 8K + 4K: the default, exact_max at alpha 0.05 / 0.03 and the oracle F 0.9; the retrieval seeds,
# trained in the background meanwhile, at 32K: the library's dense and default, exact_max at alpha 0.05 / 0.1 and the
# oracle F 0.5; on both the default with the dense rule off (sp:dense_fraction=1.0: exact_max's candidate density,
# for a gate on its second stage). Until ~580 s; files: OUT/accuracy_smollm2_<card>.json, the retrieval JSONs, r18.tgz.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r18; mkdir -p $W
for s in 1 2; do  # the retrieval model: 22M parameters, a fraction of the GPU beside SmolLM2's rows
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/train_seed$s.log 2>&1 &
done
EX="sp:rule=exact_max"
SMOL_END=330 SMOL_CONFIGS="default,$EX;alpha=0.05,$EX;alpha=0.03,oracle_0.9,sp:dense_fraction=1.0" \
  bash bench/lab/device_runs/r2.sh $W > $W/r2.log 2>&1
tail -14 $W/r2.log
cp $W/accuracy_smollm2_*.json "$OUT/" 2>/dev/null
wait  # the trainings
G=$(cat $W/card.txt)
for s in 1 2; do grep '"step"' $W/train_seed$s.log | tail -1; done
. bench/lab/device_runs/reval.sh "$OUT" "dense_sp,default,$EX;alpha=0.05,$EX;alpha=0.1,oracle_0.5,sp:dense_fraction=1.0" 580
tar czf $OUT/r18.tgz -C $W --exclude='*.json' .
