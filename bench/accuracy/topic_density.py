"""Issue 44's speed side of an estimator, before a kernel exists: the density each emulated selection keeps on the
speed workload ("topic", docs/workload.md: Hq 32, Hkv 8, D 128; bench/_common.topic on the GPU), beside the library's
own index on the same tensors (sp.build_index: the emulator's 'default' row must match it), and the index cost each
estimator would have at 128K from its pairs, FLOPs and passes (an estimate from rates, not a measurement).

    python -m accuracy.topic_density --configs 'emu:default,emu:score=resid;rank=16;alpha=0.1' --lengths 8192,32768 \\
        --out topic_density.json          (run from bench/; GPU: ~1 min at 32K)

Densities are raw (the dense rule off, dense_fraction 1) and after the rule (the config's own dense_fraction), so a
selection that would run dense shows as such.

The cost model (`est_*`, H200, per call at 128K, Hq 32, causal): the block-max scores cost one GEMM over every
scored (row, key) pair at K = max(16, rank) (bf16 wgmma's smallest K step) at 0.7 of the 990 TFLOP/s peak, and one
max per pair in packed half precision (two pairs per HMNMX2, 64 per clock per SM on 132 SMs at 1.755 GHz); the two
overlap (tensor pipe and ALU), so the estimate is the larger plus the pooled-means pass the rule needs (today's row
max index at 128K, 2.78 ms, bench/results/selection_h200.json) when the score or the threshold reads pooled means.
A two-stage rule (cand_mean: exact maxima over the pooled stage's candidates) also gets cand_density_raw (the
candidates' share of the visible blocks at this L) and est_exact_fp8_ms_at_L: its exact stage at this L alone, the
candidate pairs at K = D on FP8 wgmma (twice the bf16 peak, same efficiency) against one max instruction a pair
(f32 -> packed f16 pairs, then HMNMX2 over two), the larger of the two; compare it with dense attention at L.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))  # bench/: `accuracy` as a package, `_common`

from accuracy import configs as C  # noqa: E402
from accuracy import emulate as E  # noqa: E402

HQ, HKV, D = 32, 8, 128
PEAK_TFLOPS, MMA_EFF = 990.0, 0.7
SMS, CLOCK_GHZ, MAX_PER_CLK = 132, 1.755, 64
POOLED_INDEX_MS_128K = 2.78   # the row-max index at 128K (selection_h200.json, 4b19935)


def est_cost_ms(rule, L=131072, hq=HQ):
    """(est_index_ms, pairs) of an emulated rule at length L (see the module doc); None for pooled-means rules."""
    r = E.full_rule(rule)
    if r["score"] not in E.BLOCK_MAX_SCORES or r["cand_mean"] is not None:  # two stages: est_exact_fp8_ms instead
        return None, 0
    pairs = hq * L * (L + 1) / 2 / r["rstride"]
    k = D if r["score"] == "kmax" else max(16, r["rank"]) + (16 if r["perp"] else 0)  # perp: one more K chunk
    mma = 2 * pairs * k / (PEAK_TFLOPS * 1e12 * MMA_EFF) * 1e3
    mx = pairs / 2 / (SMS * CLOCK_GHZ * 1e9 * MAX_PER_CLK) * 1e3
    pooled = POOLED_INDEX_MS_128K if (r["score"] == "resid" or r["onepass"] == 2) else 0.0
    return max(mma, mx) + pooled, pairs


def est_exact_fp8_ms(L, cand_density, hq=HQ):
    """The exact stage of a two-stage rule at length L (module doc): candidate pairs on FP8 wgmma vs one max each."""
    pairs = hq * L * (L + 1) / 2 * cand_density
    mma = 2 * pairs * D / (2 * PEAK_TFLOPS * 1e12 * MMA_EFF) * 1e3
    mx = pairs / (SMS * CLOCK_GHZ * 1e9 * MAX_PER_CLK) * 1e3
    return max(mma, mx)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", required=True, help="comma separated emulator configs (configs.py names)")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new row after this many seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from _common import commit, topic
    t0 = time.time()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    routes = [C.parse(c, "emulate") for c in args.configs.split(",") if c]
    doc = dict(kind="topic_density", commit=commit(), date=time.strftime("%Y-%m-%d"), device=args.device,
               command="python -m accuracy.topic_density " + " ".join(argv if argv is not None else sys.argv[1:]),
               through_package=False, workload=f"topic Hq {HQ} Hkv {HKV} D {D}",
               cost_model=dict(peak_tflops=PEAK_TFLOPS, mma_eff=MMA_EFF, sms=SMS, clock_ghz=CLOCK_GHZ,
                               max_per_clk=MAX_PER_CLK, pooled_index_ms_128k=POOLED_INDEX_MS_128K), rows=[])
    if torch.device(args.device).type == "cuda":
        doc["device"] = torch.cuda.get_device_name()
    scale = 1.0 / math.sqrt(D)
    for L in lengths:
        q, k, v = topic(L, HQ, HKV, D, dev=args.device)
        lib = None
        try:
            import sparse_prefill as sp
            cu = torch.tensor([0, L], dtype=torch.int32, device=q.device)
            lib = float(sp.build_index(q, k, v, cu, cu, L, L, dense_fraction=1.0).density)
        except Exception as e:  # noqa: BLE001 (a package without CUDA here: the row says so)
            lib = f"{type(e).__name__}: {e}"[:200]
        print(f"L={L}: library default (dense rule off) density {lib}", flush=True)
        qf, kf, vf = q.float(), k.float(), v.float()
        for route in routes:
            if args.budget_s and time.time() - t0 > args.budget_s:
                print(f"budget reached: {route.name} at L={L} not run", flush=True)
                continue
            rule = C.resolve_g(route.args, HQ // HKV)
            t1 = time.time()
            raw = E.select(qf, kf, vf, dict(rule, dense_fraction=1.0), scale).density
            frac = E.full_rule(rule)["dense_fraction"]
            ruled = 1.0 if frac < 1 and raw >= frac else raw
            est, pairs = est_cost_ms(rule)
            row = dict(L=L, config=route.name, rule=E.full_rule(rule), density_raw=raw, density=ruled,
                       library_default_density_raw=lib, est_index_ms_128k=est, pairs_128k=pairs,
                       seconds=round(time.time() - t1, 2))
            cm = E.full_rule(rule)["cand_mean"]
            if cm is not None:  # the pooled stage alone: the candidates' density (the exact stage's share of the pairs)
                pooled_stage = dict(rule, score="mean", alpha=cm, cand_mean=None, onepass=0, sinkref=0, qk="f32",
                                    dense_fraction=1.0)
                cand = E.select(qf, kf, vf, pooled_stage, scale).density
                row.update(cand_density_raw=cand, est_exact_fp8_ms_at_L=est_exact_fp8_ms(L, cand))
            doc["rows"].append(row)
            extra = (f", candidates {row['cand_density_raw']:.4f}, exact FP8 stage at L ~"
                     f"{row['est_exact_fp8_ms_at_L']:.3f} ms" if cm > 0 else "")
            print(f"L={L} {route.name}: density raw {raw:.4f} (dense rule: {ruled:.4f}), est index 128K "
                  f"{est if est is None else round(est, 2)} ms{extra}, {row['seconds']} s", flush=True)
            if args.out:
                json.dump(doc, open(args.out, "w"), indent=1)
        del q, k, v, qf, kf, vf
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    return doc


if __name__ == "__main__":
    main()
