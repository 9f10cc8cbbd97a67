#!/usr/bin/env bash
# Session 17, prepared in session 16 (not run): the two-stage rule's open rows in one call on a machine that ran
# r14.sh (build + the SmolLM2 wheel's first half) just before, carrying .deps/smollm2.part.ab and the gguf wheel as
# r2.sh's calls do: SmolLM2 8K + 4K with the one pass (the kernel's form) and its e4m3 operands at alpha 0.05 and
# 0.03, beside the retrieval seeds trained in the background (r15.sh's training and evaluation, alpha 0.05 / 0.03 /
# 0.1) once SmolLM2 is done. Until ~580 s; files: OUT/accuracy_smollm2_<card>.json, the retrieval JSONs, r16.tgz.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r16; mkdir -p $W
for s in 1 2; do  # the retrieval model: 22M parameters, a fraction of the GPU beside SmolLM2's rows
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/train_seed$s.log 2>&1 &
done
ONE="emu:score=kmax;cand_mean=0.003;onepass=2;sinkref=1;subgroups=g"
SMOL_END=330 SMOL_CONFIGS="$ONE;alpha=0.05,$ONE;alpha=0.05;qk=e4m3,$ONE;alpha=0.03,oracle_0.9" \
  bash bench/lab/device_runs/r2.sh $W > $W/r2.log 2>&1
tail -14 $W/r2.log
cp $W/accuracy_smollm2_*.json "$OUT/" 2>/dev/null
wait  # the trainings
G=$(cat $W/card.txt)
CF="dense_sp,default,emu:score=kmax;alpha=0.05;cand_mean=0.003;subgroups=g,$ONE;alpha=0.05,oracle_0.5"
for s in 1 2; do grep '"step"' $W/train_seed$s.log | tail -1; done
. bench/lab/device_runs/reval.sh "$OUT" "$CF" 580  # both seeds at 32K -> OUT/accuracy_retrieval_seed{1,2}_<card>.json
tar czf $OUT/r16.tgz -C $W --exclude='*.json' .
