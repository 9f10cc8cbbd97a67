#!/usr/bin/env bash
# Both retrieval seeds evaluated concurrently at 32K (or the lengths $4) on configs $2 until $3 s into the call; rows
# kept in /tmp/ret across calls (the file merges) and copied to OUT. Sourced by r1.sh / r2.sh: their SECONDS and card
# suffix G.
OUT=$1; CF=$2; END=$3; LENS=${4:-32768}
mkdir -p /tmp/ret
left=$(( END - SECONDS ))
echo "reval: $left s for $CF"
EVALS=()  # its own two jobs only: r2.sh waits for its SmolLM2 job itself
for s in 1 2; do
  (cd bench && timeout $left python3 accuracy/retrieval.py eval --ckpt /tmp/retrieval_seed$s.pt --device cuda \
     --lengths "$LENS" --configs "$CF" --n-seq 16 --budget-s $(( left - 45 )) \
     --out /tmp/ret/accuracy_retrieval_seed${s}_${G}.json) > "$OUT/retrieval_eval_seed$s.log" 2>&1 &
  EVALS+=($!)
done
wait "${EVALS[@]}"
for s in 1 2; do grep -E '^\[|budget|Error|refused' "$OUT/retrieval_eval_seed$s.log" | tail -12; cp /tmp/ret/accuracy_retrieval_seed${s}_${G}.json "$OUT/" 2>/dev/null; done
