#!/usr/bin/env bash
# Session 19, for the next: an exact_max stage-2 change against its base (r20.sh: build of both, the exact_max GPU
# cases, the cost slope, the index A/B), then ncu of the changed kernel at 32K with its stall samples per SASS
# instruction (bench/lab/ncu_source_top.py), so that the next change (TMA for the units, mbarrier-paced slots, e4m3
# operands) is picked by where the warps wait. Before the call, as r20.sh's header says:
#   git archive HEAD > .deps/base.tar && git apply bench/lab/patches/<patch> && git commit -am "..."
# carry .deps/cutlass.tar.xz .deps/base.tar. ~350 s on a fresh machine. Files: r20.sh's three, OUT/ncu_exact_max_32k.txt,
# OUT/ncu_exact_max_32k_top.txt, OUT/r22.tgz.
set -u
OUT=$1
export SP_COMMIT=${SP_COMMIT:?pass SP_COMMIT=<the full hash of the tree this call carries>} PYTHONUNBUFFERED=1
bash bench/lab/device_runs/r20.sh "$OUT"
W=/tmp/r22; mkdir -p $W
timeout 200 ncu --clock-control none --set full --import-source yes --launch-skip 1 --launch-count 1 \
  -k regex:exact_max_kernel -o $W/exact32k python3 bench/lab/device_runs/exact_index_once.py > $W/ncu.log 2>&1
tail -3 $W/ncu.log
ncu -i $W/exact32k.ncu-rep --page details > "$OUT/ncu_exact_max_32k.txt" 2>&1
ncu -i $W/exact32k.ncu-rep --page source --csv --print-source sass > $W/source.csv 2>/dev/null
python3 bench/lab/ncu_source_top.py $W/source.csv --top 50 > "$OUT/ncu_exact_max_32k_top.txt" 2>&1
grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|L2 Cache Throughput|Registers Per" \
  "$OUT/ncu_exact_max_32k.txt" | head -8
head -30 "$OUT/ncu_exact_max_32k_top.txt" | cut -c1-180
gzip -f $W/source.csv; rm -f $W/*.ncu-rep
tar czf "$OUT/r22.tgz" -C $W .
