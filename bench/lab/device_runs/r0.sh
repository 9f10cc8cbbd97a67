#!/usr/bin/env bash
# Sessions 10-13, the short call: build, key_max's CUDA tests against the CPU reference, then
# the index stage kernel by kernel and bench_selection's key_max rows with what time is left, until R0_END s.
# R0_TESTS=tests/python: the whole GPU suite instead (~190 s on the H100). R0_PHASES='build model' with
# .deps/smollm2.part.aa carried also leaves the model's first half for r2.sh (the next call, while warm).
set -u
OUT=$1
END=${R0_END:-330}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh "$OUT" ${R0_PHASES:-build} > "$OUT/gpu_build.log" 2>&1; tail -3 "$OUT/gpu_build.log"
SP_TEST_INSTALLED=1 timeout $(( END - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE ${R0_TESTS:-tests/python/test_key_max_cuda.py} \
  > "$OUT/key_max_cuda.log" 2>&1; tail -6 "$OUT/key_max_cuda.log"
G=$(cat "$OUT/card.txt")  # gpu.sh names the card
timeout $(( (END - SECONDS) / 3 )) python3 bench/lab/profile_index.py 32768 131072 --repeats 5 > "$OUT/profile_index_keymax_${G}.log" 2>&1
grep -E "key_|Self CUDA time|^L|ms" "$OUT/profile_index_keymax_${G}.log" | head -30
timeout $(( END - SECONDS )) python3 bench/bench_selection.py --lengths 32768,131072 --configs "default,sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.1" \
  --dense-lengths "" --gate-lengths "" --chunk "131072:1024" --chunk-configs "sp:rule=key_max;alpha=0.03" \
  --out "$OUT/selection_keymax_${G}.json" > "$OUT/bench_selection.log" 2>&1
tail -25 "$OUT/bench_selection.log"
