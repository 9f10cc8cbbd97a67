#!/usr/bin/env bash
# Session 15: issue 44's density-1.0 rows. Build, the two tests mended this session (three rounds each), the default
# index kernel by kernel at 8K / 32K (torch.profiler), and bench_selection's dense-rule rows (Gaussian q, k: the
# default keeps every block) at 8K / 32K / 128K with the gate row at 8K, until R9_END s. Logs come back as OUT/r9.tgz.
set -u
OUT=$1
END=${R9_END:-300}
W=/tmp/r9; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash scripts/gpu.sh $W build > $W/gpu_build.log 2>&1; tail -2 $W/gpu_build.log
G=$(cat $W/card.txt)  # gpu.sh names the card
for r in 1 2 3; do
  SP_TEST_INSTALLED=1 timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/python/test_key_max_cuda.py \
    "tests/python/test_cuda.py::test_head_subgroups_sparse_attention_matches_cpu_reference" 2>&1 | tail -3
done > $W/mended_tests.log; cat $W/mended_tests.log
timeout 90 python3 bench/lab/profile_index.py 8192 32768 --config default --repeats 20 > $W/profile_index.log 2>&1
cat $W/profile_index.log
timeout $(( END - SECONDS )) python3 bench/bench_selection.py --lengths "" --dense-lengths 8192,32768,131072 \
  --gate-lengths 8192 --chunk "" --out "$OUT/selection_dense_rule_${G}.json" > $W/bench_selection.log 2>&1
tail -6 $W/bench_selection.log
tar czf "$OUT/r9.tgz" -C $W --exclude='*.whl' .
