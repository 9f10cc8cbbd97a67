"""Chunked-prefill benchmark on the GPU machine (issue 5): one step = C new queries per sequence (the last C positions
of an L-token prompt, their K/V already in a paged cache, page 64) against the sequence's whole cache, causal.

Per (L, chunk, batch) row, the prompt's last chunk (final_chunk=True) on the topic workload (DESIGN.md):
  dense_attn_ms     our dense paged kernel on the step;
  tile_*            per-tile CSR (FlashPrefill V2 selection, correction on): select_ms (GPU index stage, pooling of
                    the whole cache included), select_cached_ms (with the pooled-means cache holding the blocks before
                    the chunk, as earlier steps left it: only the chunk's blocks are pooled), attn_ms, density;
  union_*           union lists per (sequence, KV head) (CompactAttention, correction off): select_ms (index stage +
                    union kernel), attn_ms, density (after the union; union_tile_density before it);
  union_s{S}_*      with --union-subgroups: union mode with head_subgroups = S (one list per sub-group of g / S
                    query heads of each KV head), same keys as union_*;
  mid_*             the same step when the chunk does not end the prompt (final_chunk=False: no dense tail), both
                    modes;
  speedup_*         dense_attn_ms / (select_ms + attn_ms); speedup_*_cached with select_cached_ms.
  *_graph_ms        the same work timed as CUDA-graph replays (bench_dense.time_graph_ms): GPU time without the
                    host's enqueue gaps, which per-call events count when a call's GPU work is shorter than its Python
                    and launch overhead (a ~0.1 ms selection at chunk 1024 x batch 1); dense step, per-tile selection
                    with the cache and per-tile attention; speedup_tile_cached_graph and
                    tile_select_cached_graph_share_of_dense from them.
Whole-prompt rows (--prompt): every chunk of an L-token prompt, batch 1, summed: dense vs union vs per-tile.
Writes bench/results/chunked_h200.json and, with matplotlib, chunked_h200.png.
Usage: python3 bench/bench_chunked.py [--contexts 32768,131072] [--chunks 1024,8192] [--batches 1,8]"""
import argparse
import datetime
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import sp_cuda  # noqa: E402
from bench_dense import commit, time_graph_ms, time_ms  # noqa: E402
from bench_sparse import HQ, HKV, D, SEL, topic  # noqa: E402

PAGE = 64


class Cache:
    """`batch` topic prompts of L tokens in a paged cache (pages of 64 tokens, randomly permuted)."""

    def __init__(self, L, batch, dev="cuda"):
        self.L, self.batch = L, batch
        pages = L // PAGE
        self.q, ks, vs = [], [], []
        for b in range(batch):
            q, k, v = topic(L, seed=b)
            self.q.append(q)
            ks.append(k.view(pages, PAGE, HKV, D))
            vs.append(v.view(pages, PAGE, HKV, D))
        perm = torch.randperm(batch * pages, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        self.k = torch.empty(batch * pages, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
        self.v = torch.empty_like(self.k)
        self.k[perm] = torch.cat(ks)
        self.v[perm] = torch.cat(vs)
        self.block_table = perm.view(batch, pages).to(torch.int32).contiguous()
        del ks, vs

    def mean_cache(self, upto):
        """A pooled-means cache (sparse_prefill.mean_cache layout) holding the complete blocks of positions [0, upto)
        of every prompt, as the steps of the earlier chunks leave it (computed here with torch: float32 means)."""
        bs = SEL["block_size"]
        slots = self.k.shape[0] * max(1, PAGE // bs)
        km = torch.zeros(slots, HKV, D, dtype=torch.float32, device=self.k.device)
        vm = torch.zeros_like(km)
        nb = upto // bs
        if nb == 0:
            return km, vm
        for b in range(self.batch):
            pages = self.block_table[b, :nb * bs // PAGE].long()
            kb = self.k[pages].float().reshape(nb, bs, HKV, D).mean(1)
            vb = self.v[pages].float().reshape(nb, bs, HKV, D).mean(1)
            last = torch.arange(nb, device=self.k.device) * bs + bs - 1          # each block's last key
            page = self.block_table[b, last // PAGE].long()
            slot = page * (PAGE // bs) + (last % PAGE) // bs if PAGE >= bs else page
            km[slot] = kb
            vm[slot] = vb
        return km, vm

    def step(self, c0, c1):
        """Inputs of the step whose queries are positions [c0, c1) of every prompt (cache filled up to c1)."""
        dev = self.k.device
        q = torch.cat([qb[c0:c1] for qb in self.q]).contiguous()
        C = c1 - c0
        cu_q = torch.arange(0, (self.batch + 1) * C, C, dtype=torch.int32, device=dev)
        used = torch.full((self.batch,), c1, dtype=torch.int32, device=dev)
        return q, cu_q, used, C, c1


def measure_step(cache, c0, c1, final, modes=("tile", "union"), means=None, graph=False, subgroups=()):
    """One step; `means`: the pooled-means cache as the earlier steps left it (cache.mean_cache(c0)), or None.
    graph: also the CUDA-graph timings (*_graph_ms) of the dense step and the per-tile mode with the cache."""
    q, cu_q, used, C, Lk = cache.step(c0, c1)
    kw = dict(block_table=cache.block_table, seqused_k=used)
    out = torch.empty_like(q)
    dense = lambda: sp_cuda.attention(q, cache.k, cache.v, cu_q, None, C, Lk, out=out, return_lse=False, **kw)  # noqa
    row = dict(dense_attn_ms=time_ms(dense))
    if graph:
        row["dense_attn_graph_ms"] = time_graph_ms(dense)
    ws = sp_cuda.index_workspace(q, cache.k, cache.v, cu_q, None, C, Lk, **kw)
    modes = list(modes) + [f"union_s{S}" for S in subgroups]
    for mode in modes:
        union = mode.startswith("union")
        S = int(mode[len("union_s"):]) if mode.startswith("union_s") else 1
        sel = dict(SEL, correction=not union, final_chunk=final, union=union)
        if S > 1:
            sel["head_subgroups"] = S
        if S > 1:  # more (smaller) tiles: its own workspace
            ws = sp_cuda.index_workspace(q, cache.k, cache.v, cu_q, None, C, Lk, **kw, head_subgroups=S)
        idx = sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, Lk, ws, **sel, **kw)
        torch.cuda.synchronize()
        row[f"{mode}_density"] = idx.density()
        if union:
            row[f"{mode}_tile_density"] = idx.tile_density()
        row[f"{mode}_select_ms"] = time_ms(lambda: sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, Lk, ws,
                                                                         **sel, **kw))
        row[f"{mode}_attn_ms"] = time_ms(lambda: sp_cuda.sparse_attention(q, cache.k, cache.v, idx, cu_q, None, C,
                                                                            Lk, out=out, **kw))
        row[f"{mode}_total_ms"] = row[f"{mode}_select_ms"] + row[f"{mode}_attn_ms"]
        row[f"speedup_{mode}"] = row["dense_attn_ms"] / row[f"{mode}_total_ms"]
        row[f"{mode}_select_share_of_dense"] = row[f"{mode}_select_ms"] / row["dense_attn_ms"]
        if means is not None:
            idx_c = sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, Lk, ws, **sel, **kw, mean_cache=means)
            torch.cuda.synchronize()
            row[f"{mode}_density_cached"] = idx_c.density()   # equal up to float32 rounding of the means
            row[f"{mode}_select_cached_ms"] = time_ms(lambda: sp_cuda.build_index(
                q, cache.k, cache.v, cu_q, None, C, Lk, ws, **sel, **kw, mean_cache=means))
            row[f"{mode}_total_cached_ms"] = row[f"{mode}_select_cached_ms"] + row[f"{mode}_attn_ms"]
            row[f"speedup_{mode}_cached"] = row["dense_attn_ms"] / row[f"{mode}_total_cached_ms"]
            row[f"{mode}_select_cached_share_of_dense"] = row[f"{mode}_select_cached_ms"] / row["dense_attn_ms"]
            if graph and mode == "tile" and row.get("dense_attn_graph_ms"):
                sel_g = time_graph_ms(lambda: sp_cuda.build_index(q, cache.k, cache.v, cu_q, None, C, Lk, ws, **sel,
                                                                  **kw, mean_cache=means))
                attn_g = time_graph_ms(lambda: sp_cuda.sparse_attention(q, cache.k, cache.v, idx, cu_q, None, C, Lk,
                                                                        out=out, **kw))
                if sel_g and attn_g:
                    dense_g = row["dense_attn_graph_ms"]
                    row.update(tile_select_cached_graph_ms=sel_g, tile_attn_graph_ms=attn_g,
                               speedup_tile_cached_graph=dense_g / (sel_g + attn_g),
                               tile_select_cached_graph_share_of_dense=sel_g / dense_g)
    del ws
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "chunked_h200.json"))
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--chunks", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", default="131072:8192", help="L:chunk of the whole-prompt rows ('' to skip)")
    ap.add_argument("--union-subgroups", default="", help="head_subgroups values S > 1: union rows union_s{S}_*")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    rows, prompts = [], []

    def save():  # after every row: a run cut short by the 10-minute limit still leaves its rows
        res = dict(device=torch.cuda.get_device_name(), commit=commit(),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                   workload=f"topic (DESIGN.md), Hq={HQ} Hkv={HKV} D={D} bf16, paged KV page {PAGE}, causal",
                   selection=SEL, torch=torch.__version__, rows=rows, prompts=prompts)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return res
    for batch in ints(args.batches):
        for L in ints(args.contexts):
            cache = Cache(L, batch)
            for C in ints(args.chunks):
                row = dict(L=L, chunk=C, batch=batch, mode="last chunk", final_chunk=True)
                means = cache.mean_cache(L - C)
                sub = ints(args.union_subgroups)
                row.update(measure_step(cache, L - C, L, True, means=means, graph=True, subgroups=sub))
                mid = measure_step(cache, L - C, L, False, means=means, graph=True, subgroups=sub)
                del means
                row.update({f"mid_{k}": v for k, v in mid.items() if k.startswith(("union", "tile", "speedup"))})
                if "dense_attn_graph_ms" in mid:
                    row["mid_dense_attn_graph_ms"] = mid["dense_attn_graph_ms"]
                row["dense_attn_total_ms"] = row["dense_attn_ms"]  # per step; prompt totals are in `prompts`
                print(json.dumps(row), flush=True)
                rows.append(row)
                save()
            del cache
            torch.cuda.empty_cache()
    if args.prompt:
        L, C = (int(x) for x in args.prompt.split(":"))
        cache = Cache(L, 1)
        keys = ("dense_attn_ms", "union_total_ms", "union_attn_ms", "tile_total_ms", "tile_attn_ms",
                "union_total_cached_ms", "tile_total_cached_ms")
        tot = dict(L=L, chunk=C, batch=1, mode="whole prompt", steps=0, **{k: 0.0 for k in keys})
        # One pooled-means cache through the whole prompt, from its first chunk (as an engine would run it): each
        # step's untimed first build_index call writes the blocks its chunk completes.
        means = cache.mean_cache(0)
        for c0 in range(0, L, C):
            c1 = min(L, c0 + C)
            r = measure_step(cache, c0, c1, c1 == L, means=means)
            for key in keys:
                tot[key] += r[key]
            tot["steps"] += 1
        tot["attn_reduction_union"] = tot["dense_attn_ms"] / tot["union_attn_ms"]
        tot["attn_reduction_tile"] = tot["dense_attn_ms"] / tot["tile_attn_ms"]
        tot["total_reduction_union"] = tot["dense_attn_ms"] / tot["union_total_ms"]
        tot["total_reduction_tile"] = tot["dense_attn_ms"] / tot["tile_total_ms"]
        tot["total_reduction_union_cached"] = tot["dense_attn_ms"] / tot["union_total_cached_ms"]
        tot["total_reduction_tile_cached"] = tot["dense_attn_ms"] / tot["tile_total_cached_ms"]
        print(json.dumps(tot), flush=True)
        prompts.append(tot)
    res = save()
    try:
        plot(res, os.path.splitext(args.out)[0] + ".png")
    except Exception as e:  # noqa: BLE001
        print("plot skipped:", repr(e))


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for batch in sorted({r["batch"] for r in res["rows"]}):
        for mode in ("tile", "union"):
            for C in sorted({r["chunk"] for r in res["rows"]}):
                rs = [r for r in res["rows"] if r["batch"] == batch and r["chunk"] == C]
                ax.plot([r["L"] for r in rs], [r.get(f"speedup_{mode}_cached", r[f"speedup_{mode}"]) for r in rs],
                        marker="o",
                        ls="-" if mode == "union" else "--", label=f"{mode}, chunk {C}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context L")
    ax.set_ylabel("dense paged step / (select with mean cache + sparse attn)")
    ax.set_title("last chunk of an L-token prompt, topic workload")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
