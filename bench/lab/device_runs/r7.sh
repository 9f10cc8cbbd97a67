#!/usr/bin/env bash
# Session 13, call 3: bench_selection's key_max rows, both retrieval trainings (3.5 min side by side) and both seeds
# at 32K on R7_RET_CONFIGS, then SmolLM2 at 8K / 4K on R7_SMOL_CONFIGS, until R7_END s. The device returns at most
# 8 files: everything goes to /tmp/r7 and comes back as OUT/r7.tgz beside the result JSONs.
set -u
OUT=$1
END=${R7_END:-540}
W=/tmp/r7; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh $W build model > $W/gpu_build.log 2>&1; tail -2 $W/gpu_build.log
G=$(cat $W/card.txt)
timeout 150 python3 bench/bench_selection.py --lengths 32768,131072 \
  --configs "default,sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.1" --dense-lengths "" --gate-lengths "" \
  --chunk "131072:1024" --chunk-configs "sp:rule=key_max;alpha=0.03" \
  --out "$OUT/selection_keymax_${G}.json" > $W/bench_selection.log 2>&1
grep -E '"config"' $W/bench_selection.log | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(r['kind'], r['L'], r['config'], 'index %.3f ms' % r['index_ms'], 'density %.4f' % r['density'], 'x cuDNN %s' % r.get('speedup_vs_cudnn'))"
for s in 1 2; do
  timeout 300 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes 3.5 \
    --seed $s > $W/retrieval_train_seed$s.log 2>&1 &
done
wait
for s in 1 2; do grep '"step"' $W/retrieval_train_seed$s.log | tail -1; done
R7_OUT=$OUT R7_END=$END  # reval.sh (sourced) sets OUT, CF and END to its arguments
. bench/lab/device_runs/reval.sh $W "${R7_RET_CONFIGS:?}" $(( END - 130 ))  # both seeds at 32K, into $W
OUT=$R7_OUT END=$R7_END
cp $W/accuracy_retrieval_seed*_${G}.json "$OUT/"
(cd bench && export PYTHONPATH=/tmp/acc-site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 &&
 timeout $(( END - 15 - SECONDS )) python3 -m accuracy.run --backend sp --device cuda --lengths 8192,4096 \
   --configs "${R7_SMOL_CONFIGS:?}" --index-cost --budget-s $(( END - 45 - SECONDS )) \
   --out $OUT/accuracy_smollm2_${G}.json) > $W/smollm2.log 2>&1
grep -E "^plan|budget|Error" $W/smollm2.log | tail -5
(cd bench && timeout 20 python3 -m accuracy.report $OUT/accuracy_smollm2_${G}.json --summary $W/smollm2_summary.md \
   --summary-json "" > /dev/null 2>&1; sed -n '/| model | config/,/^$/p' $W/smollm2_summary.md)
tar czf $OUT/r7.tgz -C $W .
