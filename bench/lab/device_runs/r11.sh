#!/usr/bin/env bash
# Session 16: the persistent scorer (the lab patch) against .deps/base.tar: build, the index A/B,
# the index stage's GPU tests, the default index kernel by kernel at 8K / 32K for base and ours, alternating, and the
# dense rule's rows (profile_dense_rule.py) for each, until R11_END s. Logs come back as OUT/r11.tgz.
set -u
OUT=$1
END=${R11_END:-420}
W=/tmp/r11; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
SP_AB_QUICK=1 SP_AB_NAME=index_rowmax SP_AB_WHAT="${R11_AB_WHAT:-this tree against .deps/base.tar}" \
  SP_AB_KINDS=index_row_max,index_tile_energy bash scripts/gpu.sh $W build abbase > $W/gpu_build.log 2>&1
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
for who in base ours; do  # the density-1.0 rows (issue 44's "never slower than dense")
  [[ $who == base ]] && PP=/tmp/ab-base-site || PP=
  echo "== $who"; PYTHONPATH=$PP timeout $(( (END - SECONDS) / 2 )) python3 bench/lab/profile_dense_rule.py 8192 32768 --repeats 10
done > $W/profile_dense_rule_ab.log 2>&1; grep -E "^==|^L |graph replay" $W/profile_dense_rule_ab.log
tar czf "$OUT/r11.tgz" -C $W --exclude='*.whl' .
