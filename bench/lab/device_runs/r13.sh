#!/usr/bin/env bash
# Session 16: r12.sh's ncu step with the sparse kernel picked by its demangled name (regex fwd_device_kernel matched
# the one-shot call's gated dense launch, which returns at once). Needs r12.sh's build on the warm machine.
set -u
OUT=$1
W=/tmp/r13; mkdir -p $W
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT} PYTHONUNBUFFERED=1
for v in bf16 fp8; do
  [[ $v == fp8 ]] && F=--fp8 || F=
  timeout 200 ncu --clock-control none --set full --import-source yes --kernel-name-base demangled \
    -k regex:"CsrBlocks" --launch-skip 2 --launch-count 1 \
    -o $W/sparse128k_$v python3 bench/lab/profile_sparse.py 131072 $F > $W/ncu_$v.log 2>&1
  tail -3 $W/ncu_$v.log
  ncu -i $W/sparse128k_$v.ncu-rep --page details > $W/ncu_sparse128k_${v}_details.txt 2>&1
  ncu -i $W/sparse128k_$v.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $W/ncu_sparse128k_${v}_source.csv.gz
  grep -E "Duration|SM Frequency|Issue Slots Busy|Eligible Warps|Tensor|Registers" $W/ncu_sparse128k_${v}_details.txt | head -14
done
rm -f $W/*.ncu-rep
tar czf "$OUT/r13.tgz" -C $W .
