"""exact_max's second stage, priced on the device (issue 44): on the topic workload at 8K and 32K, the index time of
rule row_max at candidate_alpha (exact_max's first stage alone) and of exact_max (alpha 0.05) over those candidates,
for candidate_alpha from 0.3 to 0 (every visible block a candidate), the dense rule off, beside sp.attention. The
difference over the candidates' density, against attention's time, is c: the exact stage's cost per candidate block
relative to a dense block. Every time a CUDA-graph replay median (bench/_common.time_graph_ms).

    python3 bench/lab/exact_cost_slope.py OUT.json     (run from the repository root, the package installed)

(Session 18 ran this body inline from the device call; bench/lab/results/exact_cost_slope_h100_e309ba9.json.)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/

import torch  # noqa: E402

import sparse_prefill as sp  # noqa: E402
from _common import time_graph_ms, topic, workspace  # noqa: E402


def main():
    rows = []
    for L in (8192, 32768):
        q, k, v = topic(L)
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        args = (q, k, v, cu, cu, L, L)
        o = torch.empty_like(q)
        aw = workspace(sp.attention_workspace_bytes(128))
        attn = time_graph_ms(lambda: sp.attention(*args, out=o, workspace=aw))
        for ca in (0.3, 0.03, 0.003, 0.0003, 0.0):
            for rule in ("row_max", "exact_max"):
                kw = dict(rule=rule, alpha=0.05 if rule == "exact_max" else ca, dense_fraction=1.0)
                if rule == "exact_max":
                    kw["candidate_alpha"] = ca
                iw = workspace(sp.index_workspace_bytes(*args, **kw))
                ms = time_graph_ms(lambda: sp.build_index(*args, workspace=iw, **kw))
                d = sp.build_index(*args, **kw).density
                r = dict(L=L, rule=rule, candidate_alpha=ca, index_ms=ms, density=d, attention_ms=attn)
                rows.append(r)
                print(json.dumps(r), flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
