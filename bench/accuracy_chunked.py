"""Chunked prefill accuracy on the GPU machine (issue 5 "Check"): a whole L-token structured prompt (docs/workload.md, the
accuracy workload) run chunk by chunk over a paged cache (page 64) with the pooled-means cache, against one-shot
dense attention of the same prompt:
  alpha=0           every visible block kept: must equal dense (max abs diff, rel err);
  default params    per-tile selection with correction, final_chunk only on the last chunk: rel err vs dense,
                    beside the one-shot sparse_prefill error on the same prompt.
rel err = ||out - dense||_F / ||dense||_F over the whole prompt. Writes bench/results/chunked_accuracy_h200.json.
Usage: python3 bench/accuracy_chunked.py [--length 32768] [--chunks 1024,4096]"""
import argparse
import datetime
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "python"))
import sparse_prefill as sp  # noqa: E402
from bench_dense import commit  # noqa: E402
from bench_sparse import HQ, HKV, D, SEL, rel_err  # noqa: E402

PAGE = 64


def run_chunks(q, kc, vc, bt, L, C, means, **sel):
    outs = []
    for c0 in range(0, L, C):
        c1 = min(L, c0 + C)
        cu_q = torch.tensor([0, c1 - c0], dtype=torch.int32, device="cuda")
        used = torch.tensor([c1], dtype=torch.int32, device="cuda")
        outs.append(sp.chunked_prefill(q[c0:c1], kc, vc, cu_q, bt, used, c1 - c0, c1, final_chunk=c1 == L,
                                       mean_cache=means, **sel))
    return torch.cat(outs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "chunked_accuracy_h200.json"))
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--chunks", default="1024,4096")
    args = ap.parse_args()
    L = args.length
    q, k, v = sp.workload.structured(L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, seed=1)
    bf = torch.bfloat16
    q, k, v = (torch.from_numpy(a).cuda().to(bf) for a in (q, k, v))
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    dense = sp.attention(q, k, v, cu, cu, L, L)
    sel = {key: val for key, val in SEL.items()}
    one_shot = sp.sparse_prefill(q, k, v, cu, cu, L, L, **sel)
    pages = (L + PAGE - 1) // PAGE
    perm = torch.randperm(pages, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    kc = torch.zeros(pages, PAGE, HKV, D, dtype=bf, device="cuda")
    vc = torch.zeros_like(kc)
    kp = torch.zeros(pages * PAGE, HKV, D, dtype=bf, device="cuda")
    vp = torch.zeros_like(kp)
    kp[:L], vp[:L] = k, v
    kc[perm], vc[perm] = kp.view(pages, PAGE, HKV, D), vp.view(pages, PAGE, HKV, D)
    bt = perm.view(1, pages).to(torch.int32).contiguous()
    rows = []
    for C in [int(x) for x in args.chunks.split(",") if x]:
        exact = run_chunks(q, kc, vc, bt, L, C, sp.mean_cache(kc), **dict(sel, alpha=0.0))
        sparse = run_chunks(q, kc, vc, bt, L, C, sp.mean_cache(kc), **sel)
        torch.cuda.synchronize()
        assert not torch.isnan(exact).any() and not torch.isnan(sparse).any()
        row = dict(L=L, chunk=C, alpha0_max_abs_diff_vs_dense=(exact.float() - dense.float()).abs().max().item(),
                   alpha0_rel_err_vs_dense=rel_err(exact, dense), chunked_rel_err_vs_dense=rel_err(sparse, dense),
                   one_shot_rel_err_vs_dense=rel_err(one_shot, dense))
        print(json.dumps(row), flush=True)
        rows.append(row)
    res = dict(device=torch.cuda.get_device_name(), commit=commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               workload=f"structured (docs/workload.md), seed 1, Hq={HQ} Hkv={HKV} D={D} bf16, paged KV page {PAGE}, "
                        "pooled-means cache, final_chunk on the last chunk only",
               selection=SEL, torch=torch.__version__, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    np.random.seed(0)
    main()
