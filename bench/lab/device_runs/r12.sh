#!/usr/bin/env bash
# Session 16: the measurements both open issues' targets are stated in, on whatever card comes (the files carry its
# name): bench_selection at its default lengths (issue 44's speed rows), dense bf16 8K / 16K / 32K / 128K beside cuDNN
# and FP8 dense + block-sparse (issue 46's baselines), then ncu of the block-sparse kernel at 128K on the topic
# workload, bf16 and FP8 (why FP8 sparse runs at bf16 speed), each step bounded so that the call ends by R12_END s.
# The device returns at most 8 files: the logs and ncu pages come back as OUT/r12.tgz.
set -u
OUT=$1
END=${R12_END:-560}
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r12; mkdir -p $W
left() { echo $(( END - SECONDS )); }
bash scripts/gpu.sh $W build > $W/gpu_build.log 2>&1; tail -2 $W/gpu_build.log
G=$(cat $W/card.txt)  # gpu.sh names the card
echo "card $G"
timeout $(( $(left) * 30 / 100 )) python3 bench/bench_selection.py --out "$OUT/selection_${G}.json" > $W/bench_selection.log 2>&1
tail -30 $W/bench_selection.log
timeout $(( $(left) * 25 / 100 )) python3 bench/bench_dense.py --lengths 8192,16384,32768,131072 --no-extra \
  --out "$OUT/dense_${G}.json" > $W/bench_dense.log 2>&1
tail -8 $W/bench_dense.log
timeout $(( $(left) * 40 / 100 )) python3 bench/bench_fp8.py --lengths 16384,131072 --error-max-len 16384 \
  --sparse-lengths 131072 --out "$OUT/fp8_${G}.json" > $W/bench_fp8.log 2>&1
tail -12 $W/bench_fp8.log
for v in bf16 fp8; do  # one launch each, after two warm-ups
  [[ $v == fp8 ]] && F=--fp8 || F=
  # regex CsrBlocks: the sparse kernel itself (session 22: fwd_device_kernel with --launch-skip 2 caught the launch of
  # the dense rows' kernel, DenseRange, 54 us with no rows to do)
  timeout $(( $(left) / 2 - 5 )) ncu --clock-control none --set full --import-source yes --launch-skip 2 --launch-count 1 \
    --kernel-name-base demangled -k regex:CsrBlocks -o $W/sparse128k_$v python3 bench/lab/profile_sparse.py 131072 $F > $W/ncu_$v.log 2>&1
  ncu -i $W/sparse128k_$v.ncu-rep --page details > $W/ncu_sparse128k_${v}_details.txt 2>&1
  ncu -i $W/sparse128k_$v.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $W/ncu_sparse128k_${v}_source.csv.gz
  grep -E "Duration|SM Frequency|Issue Slots Busy|Eligible Warps|Tensor" $W/ncu_sparse128k_${v}_details.txt | head -12
done
rm -f $W/*.ncu-rep
tar czf "$OUT/r12.tgz" -C $W --exclude='*.whl' .
