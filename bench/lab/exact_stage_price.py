"""What exact_max's second stage costs and buys on a real model, offline on the CPU reference (issue 44): per layer of
a capture of SmolLM2's post-RoPE q, k, v, and per (tile, query head) segment, the candidates (rule row_max at the
default alpha = exact_max's candidate_alpha: the default's index, the dense rule off) and what exact_max keeps of them.

A cost model then prices a call relative to dense attention: the sparse kernel's time is its density (the dense rule
at dense_fraction 0.85 makes it 1), the exact stage costs c per candidate block (S = Q K^T over the block's keys, no
softmax or P V: ~0.45 in bf16 by FLOPs, ~0.25 with e4m3 operands; exact_max.cu as built measured 0.80-0.89 on an
H100, bench/lab/exact_cost_slope.py). It prints, for tile gates g (a tile whose candidates reach g of its visible
blocks skips the exact stage and keeps them all; g > 1: no gate) and the same g per call (a call whose candidates reach
g of its visible blocks skips it), the mean density and the modelled total of exact_max beside the default's.

Usage (from bench/, with a capture from `python -m accuracy.estimators capture --task kv --layout spread --L 8192`):
    python3 lab/exact_stage_price.py /tmp/cap.pt [--alpha 0.05] [--c 0.25,0.45,0.8] [--gates 0.8,0.9,1.0,2.0]
"""
import argparse

import numpy as np
import torch

import sparse_prefill as sp


def segment_counts(ix):
    """Kept blocks per segment of a one-sequence host index, in segment order (query head, then tile)."""
    return np.asarray(ix.segment_end, dtype=np.int64) - np.asarray(ix.segment_start, dtype=np.int64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--c", default="0.25,0.45,0.8")
    ap.add_argument("--gates", default="0.8,0.9,0.95,1.0,2.0")
    ap.add_argument("--dense-fraction", type=float, default=0.85)
    args = ap.parse_args()
    cap = torch.load(args.capture)
    L = cap["L"]
    cu = torch.tensor([0, L], dtype=torch.int32)
    per_layer = []
    for li in sorted(cap["layers"]):
        q, k, v = (t.to(torch.bfloat16).contiguous() for t in cap["layers"][li])
        cand = sp.build_index(q, k, v, cu, cu, L, L, rule="row_max", dense_fraction=1.0)
        exact = sp.build_index(q, k, v, cu, cu, L, L, rule="exact_max", alpha=args.alpha, dense_fraction=1.0)
        tiles, B = int(cand.tiles[0]), cand.block_size
        rows_per_tile = 128 // cand.group_size
        nvis = np.array([min(L - 1, (t + 1) * rows_per_tile - 1) // B + 1 for t in range(tiles)] * cand.num_kv_heads)
        per_layer.append((segment_counts(cand), segment_counts(exact), nvis))
        print(f"layer {li:2d}: candidates {cand.density:.3f}, exact_max {exact.density:.3f}", flush=True)
    def attention_time(d):  # the sparse kernel over dense at density d (the dense rule: 1 from its fraction)
        return 1 if d >= args.dense_fraction else d

    for c in (float(x) for x in args.c.split(",")):
        print(f"c = {c}: the exact stage per candidate block, relative to a dense block")
        for g in (float(x) for x in args.gates.split(",")):
            dens, t_exact, t_default = [], [], []
            for cand, fin, nvis in per_layer:
                skip = cand >= g * nvis
                kept = np.where(skip, cand, fin).sum() / nvis.sum()
                d_cand = cand.sum() / nvis.sum()
                dens.append(kept)
                t_exact.append(c * np.where(skip, 0, cand).sum() / nvis.sum() + attention_time(kept))
                t_default.append(attention_time(d_cand))
            # the same g as a call gate: a call whose candidates reach g of its visible blocks skips the exact stage
            call = [(cand.sum() / nvis.sum(), fin.sum() / nvis.sum()) for cand, fin, nvis in per_layer]
            call_dens = [dc if dc >= g else df for dc, df in call]
            call_t = [attention_time(dc) if dc >= g else c * dc + attention_time(df) for dc, df in call]
            print(f"  gate {g:4}: tile gate: density {np.mean(dens):.3f}, time / dense {np.mean(t_exact):.3f}; "
                  f"call gate: density {np.mean(call_dens):.3f}, time / dense {np.mean(call_t):.3f}; "
                  f"the default {np.mean(t_default):.3f}")


if __name__ == "__main__":
    main()
