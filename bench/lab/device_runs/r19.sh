#!/usr/bin/env bash
# Session 18, on the machine r17.sh built (package installed): ncu of one exact_max_kernel launch on the topic workload
# at 32K (why its stage 2 costs ~0.8 of attention per candidate block), then SmolLM2 8K through the library with
# exact_max at alpha 0.05 and the default's candidates (dense rule off), carrying .deps/smollm2.part.ab and the gguf
# wheel. Files: OUT/ncu_exact_max_32k.txt, OUT/accuracy_smollm2_<card>.json, OUT/r19.tgz.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
W=/tmp/r19; mkdir -p $W
timeout 150 ncu --clock-control none --set full --launch-skip 1 --launch-count 1 -k regex:exact_max_kernel \
  -o $W/exact32k python3 bench/lab/device_runs/exact_index_once.py > $W/ncu.log 2>&1
tail -3 $W/ncu.log
ncu -i $W/exact32k.ncu-rep --page details > $OUT/ncu_exact_max_32k.txt 2>&1
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|L2 Hit|DRAM Throughput|Executed Ipc" $OUT/ncu_exact_max_32k.txt | head -20
SMOL_END=${R19_SMOL_S:-280} SMOL_LENGTHS=8192 SMOL_CONFIGS="sp:rule=exact_max;alpha=0.05,sp:dense_fraction=1.0" \
  bash bench/lab/device_runs/r2.sh $W > $W/r2.log 2>&1
tail -14 $W/r2.log
cp $W/accuracy_smollm2_*.json "$OUT/" 2>/dev/null
tar czf $OUT/r19.tgz -C $W --exclude='*.ncu-rep' --exclude='*.json' .
