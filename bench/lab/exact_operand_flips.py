"""Which blocks the exact stage's operand rounding flips (issue 44's e4m3 question): per (tile, query head) the kept
sets of the ratio rule on exact block maxima in float32 against the same on rounded operands, `e4m3` (q per row, k
per 64-key unit: accuracy/estimators.py's e8u) or `bf16` (what exact_max.cu multiplies today), on some layers of a
SmolLM2 capture (`python -m accuracy.estimators capture ...`). Prints the differing blocks as a share of the kept.

Usage (from bench/): python3 lab/exact_operand_flips.py /tmp/cap.pt 3,10,17,24 e4m3|bf16 [--alphas 0.03,0.05]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from accuracy import estimators as E  # noqa: E402


def rounded_logits(q, k, scale, mode):
    if mode == "e4m3":
        return E.e4m3_logits(q, k, scale, "e8u")
    return (q.bfloat16().float() @ k.bfloat16().float().T) * scale


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("layers")
    ap.add_argument("mode", choices=("e4m3", "bf16"))
    ap.add_argument("--alphas", default="0.03,0.05")
    args = ap.parse_args()
    torch.set_num_threads(2)
    d = torch.load(args.capture)
    cap, L = d["layers"], d["L"]
    nb, T = (L + E.B - 1) // E.B, (L + E.TILE - 1) // E.TILE
    al, vis = E.always_kept(L)
    sees = (torch.arange(nb) * E.B)[None, :] <= torch.arange(L)[:, None]
    causal = torch.ones(L, L, dtype=torch.bool).tril_()

    def kept(lgm, a):
        return (E.tile_any(E.row_max(E.block_max(lgm), sees, a) & sees, T) & vis) | al

    for a in (float(x) for x in args.alphas.split(",")):
        total = differ = 0
        for layer in (int(x) for x in args.layers.split(",")):
            q, k, _ = (t.float() for t in cap[layer])
            g, scale = q.shape[1] // k.shape[1], 1 / math.sqrt(q.shape[2])
            for h in range(q.shape[1]):
                exact = ((q[:, h] @ k[:, h // g].T) * scale).masked_fill(~causal, -math.inf)
                rounded = rounded_logits(q[:, h], k[:, h // g], scale, args.mode).masked_fill(~causal, -math.inf)
                k1, k2 = kept(exact, a), kept(rounded, a)
                total += int(k1.sum())
                differ += int((k1 ^ k2).sum())
        print(f"{args.mode} alpha {a}: kept {total}, differing {differ} ({differ / total:.4f} of the kept)", flush=True)


if __name__ == "__main__":
    main()
