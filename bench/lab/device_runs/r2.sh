#!/usr/bin/env bash
# Session 10, call 2: model half 2; SmolLM2 8K then 4K (emulated share test / ratio on the queries' basis, oracles)
# beside the retrieval seeds' remaining rows. SMOL_ARGS: more accuracy.run arguments (e.g. --dtype float32).
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh "$OUT" build model > "$OUT/gpu_model.log" 2>&1; tail -4 "$OUT/gpu_model.log"
G=$(cat "$OUT/card.txt")  # gpu.sh names the card
mkdir -p /tmp/smol
(cd bench && export PYTHONPATH=/tmp/acc-site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 &&
 timeout $(( ${SMOL_END:-560} - SECONDS )) python3 -m accuracy.run --backend sp --device cuda --lengths "${SMOL_LENGTHS:-8192,4096}" \
   --configs "${SMOL_CONFIGS:?}" ${SMOL_ARGS:-} --index-cost --budget-s $(( ${SMOL_END:-560} - 60 - SECONDS )) --out /tmp/smol/accuracy_smollm2_${G}.json) > "$OUT/smollm2.log" 2>&1 &
SMOL=$!
[[ -n "${R2_CONFIGS:-}" ]] && . bench/lab/device_runs/reval.sh "$OUT" "$R2_CONFIGS" ${SMOL_END:-560}
wait $SMOL
grep -E "^plan|^\[|budget|Error|error" "$OUT/smollm2.log" | tail -60
cp /tmp/smol/accuracy_smollm2_${G}.json "$OUT/"
(cd bench && timeout 30 python3 -m accuracy.report "$OUT/accuracy_smollm2_${G}.json" --summary "$OUT/smollm2_summary.md" --summary-json "" >/dev/null 2>&1; cat "$OUT/smollm2_summary.md" 2>/dev/null | head -60)
