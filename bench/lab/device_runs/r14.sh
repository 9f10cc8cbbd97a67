#!/usr/bin/env bash
# Session 16, call 1 of 2 (the SmolLM2 wheel's first half carried, .deps/smollm2.part.aa): build + model, then the
# two-stage rule's densities on the topic workload (accuracy.topic_density: exact block maxima over the pooled
# stage's candidates, emulated; its exact stage's FP8 cost at each L) at 8K / 16K / 32K. Logs come back as OUT/r14.tgz.
set -u
OUT=$1
W=/tmp/r14; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh $W build model > $W/gpu_build.log 2>&1; tail -3 $W/gpu_build.log
G=$(cat $W/card.txt)
(cd bench && timeout $(( ${R14_END:-300} - SECONDS )) python3 -m accuracy.topic_density --lengths 8192,16384,32768 \
  --configs "emu:default,emu:score=kmax;alpha=0.1;subgroups=g,emu:score=kmax;alpha=0.1;cand_mean=0.003;subgroups=g,emu:score=kmax;alpha=0.03;cand_mean=0.003;subgroups=g,emu:score=kmax;alpha=0.01;cand_mean=0.003;subgroups=g" \
  --out "$OUT/topic_density_two_stage_${G}.json") > $W/topic_density.log 2>&1
cat $W/topic_density.log
tar czf "$OUT/r14.tgz" -C $W --exclude='*.whl' .
