#!/usr/bin/env bash
# Session 22, for the next: issue 44's offline estimator study on the second subject. exact_max at alpha 0.05 keeps
# 1.12-1.48x the oracle F 0.5's density on the four retrieval models trained so far (the bar 1.2x), where SmolLM2
# holds at 0.97x; estimators.py had only ever scored SmolLM2 (there lbcum_0.9 sits where exact_a0.05 does:
# bench/lab/results/estimators_mass_caps_smollm2_cpu.md). This call trains both retrieval seeds (as r21.sh, 3.5 min
# side by side), captures one evaluation prompt of each at 16K and 32K (estimators.py capture --retrieval), scores
# the `retrieval` set on the GPU over all four layers (density, missed mass, the answer rows' missed mass, against
# the oracle's curve), then, with R24_EVAL set (configs, e.g. the emulator's maxcum and lbcum
# "oracle_0.5,sp:rule=exact_max;alpha=0.05,emu:score=kmax;agg=rowcum;gamma=0.9;cummass=lb;subgroups=g,emu:score=kmax;agg=share1p;alpha=0.02;subgroups=g";
# share1p is the one-pass share rule a kernel would compute, estimators.py's lbk1p), evaluates them end to
# end on both models at 16K until ~570 s. One call on a fresh machine, no carry beyond the CUTLASS headers. ~420 s
# without R24_EVAL. Files: OUT/estimators_retrieval.txt, OUT/r24.tgz (+ reval.sh's four with R24_EVAL).
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r24; mkdir -p $W
bash scripts/gpu.sh $W build > $W/gpu_build.log 2>&1; tail -2 $W/gpu_build.log
G=$(cat $W/card.txt)  # gpu.sh names the card (reval.sh's file suffix)
for s in 1 2; do
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/train_seed$s.log 2>&1 &
done
wait
for s in 1 2; do grep '"step"' $W/train_seed$s.log | tail -1 | cut -c1-200; done
F=$OUT/estimators_retrieval.txt
for L in 16384 32768; do
  for s in 1 2; do
    echo "== retrieval seed $s, L $L" >> $F
    (cd bench && timeout 60 python3 -m accuracy.estimators capture --retrieval /tmp/retrieval_seed$s.pt --device cuda \
       --L $L --out /tmp/cap_r${s}_$L.pt && \
     timeout 150 python3 -m accuracy.estimators score /tmp/cap_r${s}_$L.pt --layers '' --set retrieval --device cuda) \
      >> $F 2>&1
  done
done
cat $F
[[ -n "${R24_EVAL:-}" ]] && . bench/lab/device_runs/reval.sh "$OUT" "$R24_EVAL" 570 16384
tar czf "$OUT/r24.tgz" -C $W .
