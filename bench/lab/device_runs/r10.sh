#!/usr/bin/env bash
# Session 15, call 1 of 2: the row-max scorer's pass 2 starting on pass 1's last S (one GEMM fewer per tile) against
# .deps/base.tar. Build (and the SmolLM2 wheel's first half, .deps/smollm2.part.aa carried), the index A/B (row max and
# tile energy, quick sizes), the index stage's GPU tests, then the default index kernel by kernel at 8K / 32K for base
# and ours, alternating, until R10_END s. Logs come back as OUT/r10.tgz. Session 16 (the persistent scorer's call):
# R10_PHASES="build abbase" (no model) and R10_DENSE_RULE=1 (the dense rule's rows of base and ours, profile_dense_rule.py).
set -u
OUT=$1
END=${R10_END:-420}
W=/tmp/r10; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
SP_AB_QUICK=1 SP_AB_NAME=index_rowmax SP_AB_WHAT="${R10_AB_WHAT:-this tree against .deps/base.tar}" \
  SP_AB_KINDS=index_row_max,index_tile_energy bash scripts/gpu.sh $W ${R10_PHASES:-build model abbase} > $W/gpu_build.log 2>&1
grep -E "ours/base|rc=" $W/gpu_build.log | tail -8
G=$(cat $W/card.txt)  # gpu.sh names the card
cp $W/ab_*_${G}.json "$OUT/" 2>/dev/null
SP_TEST_INSTALLED=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/python/test_cuda.py \
  tests/python/test_key_max_cuda.py tests/python/test_fp8_sparse.py > $W/index_tests.log 2>&1; tail -4 $W/index_tests.log
for r in 1 2; do
  for who in base ours; do
    [[ $who == base ]] && PP=/tmp/ab-base-site || PP=
    echo "== $who round $r"; PYTHONPATH=$PP python3 -c "import sparse_prefill as s; print(s.__file__)"
    PYTHONPATH=$PP timeout $(( (END - SECONDS) / 2 )) python3 bench/lab/profile_index.py 8192 32768 --config default \
      --repeats 20 2>&1 | grep -E "^L |score_select|total|__init__"
  done
done > $W/profile_index_ab.log; cat $W/profile_index_ab.log
if [[ -n "${R10_DENSE_RULE:-}" ]]; then  # the density-1.0 rows (issue 44's "never slower than dense")
  for who in base ours; do
    [[ $who == base ]] && PP=/tmp/ab-base-site || PP=
    echo "== $who"; PYTHONPATH=$PP timeout $(( (END - SECONDS) / 2 )) python3 bench/lab/profile_dense_rule.py 8192 32768 --repeats 10
  done > $W/profile_dense_rule_ab.log 2>&1; grep -E "^==|^L |graph replay" $W/profile_dense_rule_ab.log
fi
tar czf "$OUT/r10.tgz" -C $W --exclude='*.whl' .
