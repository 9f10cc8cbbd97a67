#!/usr/bin/env bash
# Session 17, call 1 of 2 (the SmolLM2 wheel's first half carried, .deps/smollm2.part.aa): build + model, the exact_max
# CUDA stage's GPU tests against the CPU reference, then its price on the topic workload through the package:
# bench_selection's one-call and index rows for the default and exact_max at alpha 0.05 / 0.03 at 32K / 128K (R17_LENGTHS) and
# a 1024-token chunk step at 128K, the index's kernel table, and in the time left key_max's and test_cuda.py's GPU
# tests, all by R17_END s (default 570; less when the session's device time is short). Logs: OUT/r17.tgz.
set -u
OUT=$1
END=${R17_END:-570}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
export SP_TEST_INSTALLED=1  # pytest against the package gpu.sh installed (tests/conftest.py: else the source tree)
W=/tmp/r17; mkdir -p $W
left() { echo $(( END - SECONDS )); }
bash scripts/gpu.sh $W build model > $W/gpu_build.log 2>&1; tail -3 $W/gpu_build.log
G=$(cat $W/card.txt)
echo "card $G"
timeout $(( $(left) < 160 ? $(left) - 10 : 150 )) python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 -rfE tests/python/test_exact_max_cuda.py \
  tests/python/test_key_max_cuda.py -k exact_max > $W/test_exact_max.log 2>&1
tail -25 $W/test_exact_max.log
EX="sp:rule=exact_max;alpha=0.05,sp:rule=exact_max;alpha=0.03"
timeout $(( $(left) * 45 / 100 )) python3 bench/bench_selection.py --lengths "${R17_LENGTHS:-32768,131072}" --configs "default,$EX" --dense-lengths "${R17_DENSE_LENGTHS:-8192,32768}" \
  --dense-configs "default,sp:rule=exact_max;alpha=0.05" --gate-lengths "" \
  --chunk-configs "default,sp:rule=exact_max;alpha=0.05" --out "$OUT/selection_exact_max_${G}.json" > $W/bench_selection.log 2>&1
tail -30 $W/bench_selection.log
timeout 45 python3 bench/lab/profile_index.py 32768 131072 --config "sp:rule=exact_max;alpha=0.05" \
  > $W/profile_index.log 2>&1
head -40 $W/profile_index.log
# the index stage's other GPU tests (score_select's routing and fmax_nan moved; key_max's limit check moved) in the rest
timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 -rfE \
  tests/python/test_key_max_cuda.py tests/python/test_cuda.py -k "not exact_max" > $W/test_index.log 2>&1
tail -8 $W/test_index.log
tar czf "$OUT/r17.tgz" -C $W --exclude='*.whl' --exclude='*.part.*' .
