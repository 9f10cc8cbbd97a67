#!/usr/bin/env bash
# Session 22, for the next: issue 44's offline estimator study on the second subject. exact_max at alpha 0.05 keeps
# 1.12-1.48x the oracle F 0.5's density on the four retrieval models trained so far (the bar 1.2x), where SmolLM2
# holds at 0.97x; estimators.py has only ever scored SmolLM2. This call trains both retrieval seeds (as r21.sh,
# 3.5 min side by side), captures one evaluation prompt of each at 16K and 32K (estimators.py capture --retrieval),
# and scores the `retrieval` set on the GPU over all four layers (density, missed mass, answer rows' missed mass
# per estimator, against the oracle's curve). One call on a fresh machine, no carry beyond the CUTLASS headers
# (the score needs no build, the training imports the package). ~450 s. Files: OUT/estimators_retrieval_seed{1,2}_{16k,32k}.txt, OUT/r24.tgz.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r24; mkdir -p $W
bash scripts/gpu.sh $W build > $W/gpu_build.log 2>&1; tail -2 $W/gpu_build.log
for s in 1 2; do
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/train_seed$s.log 2>&1 &
done
wait
for s in 1 2; do grep '"step"' $W/train_seed$s.log | tail -1 | cut -c1-200; done
cd bench
for L in 16384 32768; do
  for s in 1 2; do
    f=$OUT/estimators_retrieval_seed${s}_$((L / 1024))k.txt
    timeout 60 python3 -m accuracy.estimators capture --retrieval /tmp/retrieval_seed$s.pt --device cuda --L $L \
      --out /tmp/cap_r${s}_$L.pt > $f 2>&1
    timeout 150 python3 -m accuracy.estimators score /tmp/cap_r${s}_$L.pt --layers '' --set retrieval --device cuda \
      >> $f 2>&1
    cat $f
  done
done
tar czf "$OUT/r24.tgz" -C $W .
