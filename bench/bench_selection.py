"""The selection's price (the library's default selection against the earlier default and FlashPrefill V2's rule) and
the dense rule's promise (a call that keeps nearly every block runs at dense speed), on the H200 through the package.

Rows (bench/results/selection_h200.json), every time a CUDA-graph replay median, cuDNN in the same process:
  kind 'topic'  the speed workload (docs/workload.md, Llama-3.1-8B heads) at each L: per selection config
                (`default` = the library's defaults, `previous` = row max alpha 0.1 per KV group, the default before
                issue 37, `fpv2` = FlashPrefill V2's tile energy without correction): index_ms (sp.build_index into a
                preallocated workspace), total_ms (one-call sp.sparse_prefill), density, index_pct_of_dense,
                speedup_vs_cudnn; dense_ms (our sp.attention) and cudnn_ms.
  kind 'dense_selection'  Gaussian q, k (every block scores alike: the default selection keeps ~all of them, and the
                dense rule fires): sparse_prefill with the defaults against sp.attention (ratio, the target <= 1.02)
                and with dense_fraction=1 (the rule off: the sparse kernel over every block) for what the rule saves.
  kind 'gate'   the topic workload with the defaults against dense_fraction=1 (no dense launch), alternating calls:
                what the gated-off dense kernel and the rule's kernel cost a call that stays sparse.
  kind 'chunk'  one 1024-query chunk step at the end of an L-token prompt over a paged cache (page 64) with the
                pooled-means cache: the default selection's index_ms (sp.build_index, final_chunk=False) and the
                chunked_prefill step, against the dense step (sp.attention on the same cache).

    python bench/bench_selection.py --lengths 8192,32768,131072
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (HKV, HQ, D, RESULTS, emit, ints, require_cuda, sdpa_layout, time_graph_ms,  # noqa: E402
                     time_sdpa_peers, topic, workspace, write_results)

CONFIGS = {
    "default": {},
    "previous": dict(rule="row_max", alpha=0.1, head_subgroups=1, dense_fraction=1.0),
    "fpv2": dict(rule="tile_energy", alpha=0.1, head_subgroups=1, correction=False, dense_fraction=1.0),
}


def one_shot_rows(sp, L, configs, rows, out, peers):
    q, k, v = topic(L)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, L, L)
    aw = workspace(sp.attention_workspace_bytes(D))
    o = torch.empty_like(q)
    dense = time_graph_ms(lambda: sp.attention(*args, out=o, workspace=aw))
    base = dict(kind="topic", L=L, dense_ms=dense)
    if peers:
        time_sdpa_peers(base, *sdpa_layout(q, k, v, HQ // HKV), is_causal=True, graph=False, keys=("cudnn",))
    for name in configs:
        kw = CONFIGS[name]
        iw = workspace(sp.index_workspace_bytes(*args, **kw))
        pw = workspace(sp.sparse_prefill_workspace_bytes(*args, **kw))
        index_ms = time_graph_ms(lambda: sp.build_index(*args, workspace=iw, **kw))
        total_ms = time_graph_ms(lambda: sp.sparse_prefill(*args, out=o, workspace=pw, **kw))
        density = sp.build_index(*args, **kw).density
        row = dict(base, config=name, selection=kw, index_ms=index_ms, total_ms=total_ms, density=density,
                   index_pct_of_dense=100 * index_ms / dense if index_ms and dense else None)
        if base.get("cudnn_ms") and total_ms:
            row["speedup_vs_cudnn"] = base["cudnn_ms"] / total_ms
        rows.append(row)
        emit(row)
        write_results(out, rows)
    del q, k, v
    torch.cuda.empty_cache()


def dense_selection_rows(sp, L, rows, out):
    g = torch.Generator(device="cuda").manual_seed(L)
    q = torch.randn(L, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(L, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(L, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, L, L)
    o = torch.empty_like(q)
    aw = workspace(sp.attention_workspace_bytes(D))
    attn = time_graph_ms(lambda: sp.attention(*args, out=o, workspace=aw))
    row = dict(kind="dense_selection", L=L, attention_ms=attn)
    for name, kw in (("default", {}), ("rule_off", dict(dense_fraction=1.0))):
        pw = workspace(sp.sparse_prefill_workspace_bytes(*args, **kw))
        row[name + "_ms"] = time_graph_ms(lambda: sp.sparse_prefill(*args, out=o, workspace=pw, **kw))
        row[name + "_density"] = sp.build_index(*args, **kw).density
    row["default_over_attention"] = row["default_ms"] / attn
    row["rule_off_over_attention"] = row["rule_off_ms"] / attn
    rows.append(row)
    emit(row)
    write_results(out, rows)


def gate_rows(sp, L, rows, out, rounds=5):
    q, k, v = topic(L)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, cu, L, L)
    o = torch.empty_like(q)
    times = {"rule_on": [], "rule_off": []}
    for _ in range(rounds):  # alternating: the two variants see the same machine state
        for name, kw in (("rule_on", {}), ("rule_off", dict(dense_fraction=1.0))):
            pw = workspace(sp.sparse_prefill_workspace_bytes(*args, **kw))
            times[name].append(time_graph_ms(lambda: sp.sparse_prefill(*args, out=o, workspace=pw, **kw), rounds=3))
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    row = dict(kind="gate", L=L, rule_on_ms=med["rule_on"], rule_off_ms=med["rule_off"],
               gate_cost_ms=med["rule_on"] - med["rule_off"], ratio=med["rule_on"] / med["rule_off"], rounds=times)
    rows.append(row)
    emit(row)
    write_results(out, rows)


def chunk_rows(sp, L, C, rows, out, page=64):
    q, k, v = topic(L)
    pages = L // page
    kc, vc = k.reshape(pages, page, HKV, D).contiguous(), v.reshape(pages, page, HKV, D).contiguous()
    bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    means = sp.mean_cache(kc)
    used = torch.tensor([L], dtype=torch.int32, device="cuda")
    # the prompt's earlier chunks wrote the cache's complete blocks: one whole-prompt step fills it
    sp.chunked_prefill(q, kc, vc, torch.tensor([0, L], dtype=torch.int32, device="cuda"), bt, used, L, L,
                       final_chunk=False, mean_cache=means)
    qc = q[L - C:].contiguous()
    cu_q = torch.tensor([0, C], dtype=torch.int32, device="cuda")
    step = (qc, kc, vc, cu_q, bt, used, C, L)
    o = torch.empty_like(qc)
    iw = workspace(sp.index_workspace_bytes(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used))
    index_ms = time_graph_ms(lambda: sp.build_index(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used,
                                                    final_chunk=False, mean_cache=means, workspace=iw))
    cw = workspace(sp.chunked_prefill_workspace_bytes(*step))
    step_ms = time_graph_ms(lambda: sp.chunked_prefill(*step, final_chunk=False, mean_cache=means, out=o,
                                                       workspace=cw))
    aw = workspace(sp.attention_workspace_bytes(D))
    dense_ms = time_graph_ms(lambda: sp.attention(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used,
                                                  out=o, workspace=aw))
    density = sp.build_index(qc, kc, vc, cu_q, None, C, L, block_table=bt, seqused_k=used, final_chunk=False,
                             mean_cache=means).density
    row = dict(kind="chunk", L=L, chunk=C, config="default", index_ms=index_ms, step_ms=step_ms, dense_step_ms=dense_ms,
               density=density, speedup_vs_dense_step=dense_ms / step_ms if step_ms else None)
    rows.append(row)
    emit(row)
    write_results(out, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--configs", default="default,previous,fpv2")
    ap.add_argument("--dense-lengths", default="8192,32768,131072")
    ap.add_argument("--gate-lengths", default="8192,131072")
    ap.add_argument("--chunk", default="131072:1024", help="L:C of the chunk-step rows ('' to skip)")
    ap.add_argument("--no-peers", dest="peers", action="store_false")
    ap.add_argument("--out", default=os.path.join(RESULTS, "selection_h200.json"))
    args = ap.parse_args()
    sp = require_cuda()
    rows = []
    configs = [c for c in args.configs.split(",") if c]
    for L in ints(args.lengths):
        one_shot_rows(sp, L, configs, rows, args.out, args.peers)
    for L in ints(args.dense_lengths):
        dense_selection_rows(sp, L, rows, args.out)
    for L in ints(args.gate_lengths):
        gate_rows(sp, L, rows, args.out)
    for item in [x for x in args.chunk.split(",") if x]:
        L, C = (int(x) for x in item.split(":"))
        chunk_rows(sp, L, C, rows, args.out)
    write_results(args.out, rows, selection_defaults=dict(sp.SELECTION_DEFAULTS))


if __name__ == "__main__":
    main()
