"""The block-sparse kernel's two work orders (LaunchOptions.sparse_order: 'heads_fastest', the default, and 'banded')
against each other in one process, in alternating rounds, through the installed package: the topic workload
(Hq=32 Hkv=8 D=128 bf16, causal) with FlashPrefill V2's rule (tile_energy, alpha 0.1) and with the library's default
selection, correction off. Rows per (selection, L): attn_*_ms (sp.sparse_attention over one device index) and
prefill_*_ms (the one-call sp.sparse_prefill), per round and their medians, and banded / heads_fastest ratios.
bench_sparse.py times the orders once each per row; across sessions its 128K ratio read 0.93-1.04, so this settles
which order is faster on the headline selection before either becomes a default.
Usage: python3 bench/ab_order.py [--lengths 8192,32768,65536,131072] [--rounds 7] [--out ab_order_h200.json]"""
import argparse
import os

import torch

from _common import (RESULTS, SEL, emit, ints, median, require_cuda, time_ms, topic, workspace, write_results,
                     index_workspace)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(RESULTS, "ab_order_h200.json"))
    args = ap.parse_args(argv)
    sp = require_cuda()
    orders = {o: sp.LaunchOptions(sparse_order=o) for o in ("heads_fastest", "banded")}
    selections = {"fpv2": dict(SEL, correction=False), "default": dict(correction=False)}
    rows = []
    for L in ints(args.lengths):
        q, k, v = topic(L)
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        for name, sel in selections.items():
            ws = index_workspace(q, k, v, cu, cu, L, L, **sel)
            idx = sp.build_index(q, k, v, cu, cu, L, L, workspace=ws, **sel)
            ws_pf = workspace(sp.sparse_prefill_workspace_bytes(q, k, v, cu, cu, L, L, **sel), "cuda")
            ref = sp.sparse_attention(q, k, v, idx, cu, cu, L, L, options=orders["heads_fastest"])
            same = bool(torch.equal(ref, sp.sparse_attention(q, k, v, idx, cu, cu, L, L, options=orders["banded"])))
            row = dict(L=L, selection=name, density=idx.density, bit_identical=same,
                       **{f"{m}_{o}_rounds": [] for m in ("attn", "prefill") for o in orders})
            for r in range(args.rounds):
                seq = list(orders.items()) if r % 2 == 0 else list(orders.items())[::-1]
                for o, opt in seq:
                    row[f"attn_{o}_rounds"].append(time_ms(
                        lambda: sp.sparse_attention(q, k, v, idx, cu, cu, L, L, out=out, options=opt),
                        total_ms_budget=400.0))
                    row[f"prefill_{o}_rounds"].append(time_ms(
                        lambda: sp.sparse_prefill(q, k, v, cu, cu, L, L, **sel, out=out, workspace=ws_pf, options=opt),
                        total_ms_budget=400.0))
            for m in ("attn", "prefill"):
                for o in orders:
                    row[f"{m}_{o}_ms"] = median(row[f"{m}_{o}_rounds"])
                row[f"{m}_banded_vs_heads_fastest"] = row[f"{m}_banded_ms"] / row[f"{m}_heads_fastest_ms"]
                row[f"{m}_rounds_banded_faster"] = sum(b < h for b, h in zip(row[f"{m}_banded_rounds"],
                                                                             row[f"{m}_heads_fastest_rounds"]))
            emit({k: v for k, v in row.items() if not k.endswith("_rounds")})
            rows.append(row)
            write_results(args.out, rows, what="sparse work order A/B, alternating rounds", rounds=args.rounds)
            del ws, idx, ws_pf, ref
        del q, k, v, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
