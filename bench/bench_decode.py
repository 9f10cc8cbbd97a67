"""Short queries against long keys (decode and small chunks) on the GPU machine through the installed package:
sp.attention as it dispatches (PackGQA tiles + split-KV for these shapes; sp.attention_path says which) against our
dense kernel alone (options=sp.LaunchOptions(dense_path='dense'), same process) and torch SDPA cuDNN / flash (FA2).
Llama-3.1-8B heads (Hq=32, Hkv=8, D=128), bf16. Ours runs causal bottom-right; the peers run non-causal (torch's
is_causal is top-left aligned): for Lq <= 128 against Lk >= 32K the two differ in < 0.4 % of the scores.
Every row reports per-call event time and CUDA-graph replay time (_common.time_graph_ms; ours with a caller
workspace), and the KV bytes read per second (K and V once: 2 * B * Lk * Hkv * D * 2 bytes), the bound of these
memory-bound shapes (H200: 4.8 TB/s).
Writes --out and, with matplotlib, its plot beside it (.png): per shape the CUDA-graph times of the four and the
speed-up over the dense kernel, and the KV bytes per second against the H200's 4.8 TB/s.
--quick: shapes 1:131072:1, 16:131072:1, 128:131072:1, 512:131072:1.
Usage: python3 bench/bench_decode.py --out bench/results/dense_decode_h200.json [--shapes Lq:Lk:B,...] [--quick]
       python3 bench/bench_decode.py --plot-only bench/results/dense_decode_h200.json   (redraw its PNG, no GPU)"""
import argparse
import os

import torch

from _common import (D, HKV, HQ, RESULTS, add_plot_only, attention_workspace, emit, plot_only, require_cuda,
                     time_graph_ms, time_ms, time_sdpa_peers, try_plot, write_results)

HBM_TB_S = 4.8  # the H200's memory bandwidth, the bound of these shapes

# (Lq, Lk, batch)
SHAPES = [(1, 131072, 1), (1, 32768, 8), (1, 8192, 32), (16, 131072, 1), (64, 65536, 4), (128, 131072, 1),
          (256, 131072, 1), (512, 131072, 1)]
QUICK_SHAPES = [(1, 131072, 1), (16, 131072, 1), (128, 131072, 1), (512, 131072, 1)]


def parse_shapes(s):
    shapes = []
    for item in s.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected Lq:Lk:B with positive ints, got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(RESULTS, "dense_decode_h200.json"))
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="Lq:Lk:B,... (default: " + ",".join(":".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--quick", action="store_true", help="four 128K shapes: about 30 s on the H200")
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.shapes is None:
        args.shapes = QUICK_SHAPES if args.quick else SHAPES
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(plot, args.plot_only)
    sp = require_cuda()
    hq, hkv, d = HQ, HKV, D
    g = hq // hkv
    dev = "cuda"
    ws = attention_workspace(d)
    dense_kernel = sp.LaunchOptions(dense_path="dense")
    rows = []
    meta = dict(shape=dict(hq=hq, hkv=hkv, d=d, dtype="bfloat16", ours="causal bottom-right", peers="non-causal"),
                call="sp.attention(out=, return_lse=True, workspace=); dense_kernel: options=LaunchOptions("
                     "dense_path='dense')")
    for lq, lk, b in args.shapes:
        torch.manual_seed(0)
        q = torch.randn(b * lq, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b * lk, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b * lk, hkv, d, device=dev, dtype=torch.bfloat16)
        cu_q = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * lq
        cu_k = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * lk
        out = torch.empty_like(q)
        row = dict(Lq=lq, Lk=lk, batch=b, path=sp.attention_path(q, k, v, cu_q, cu_k, lq, lk),
                   dense_kernel_path=sp.attention_path(q, k, v, cu_q, cu_k, lq, lk, options=dense_kernel))

        def ours(options=None):
            sp.attention(q, k, v, cu_q, cu_k, lq, lk, causal=True, out=out, return_lse=True, workspace=ws,
                         options=options)

        row["ours_ms"] = time_ms(ours)
        row["ours_graph_ms"] = time_graph_ms(ours)
        ours()
        split_out = out.clone()
        row["dense_kernel_ms"] = time_ms(lambda: ours(dense_kernel))
        row["dense_kernel_graph_ms"] = time_graph_ms(lambda: ours(dense_kernel))
        ours(dense_kernel)
        torch.cuda.synchronize()
        row["max_abs_diff_split_vs_dense_kernel"] = (split_out.float() - out.float()).abs().max().item()
        qt = q.view(b, lq, hq, d).transpose(1, 2)
        kt = k.view(b, lk, hkv, d).repeat_interleave(g, dim=2).transpose(1, 2)
        vt = v.view(b, lk, hkv, d).repeat_interleave(g, dim=2).transpose(1, 2)
        time_sdpa_peers(row, qt, kt, vt, is_causal=False, graph=True)
        kv_bytes = 2 * b * lk * hkv * d * 2
        for key in ("ours", "dense_kernel", "cudnn", "fa2"):
            t = row.get(key + "_graph_ms") or row.get(key + "_ms")
            if t:
                row[key + "_kv_tb_per_s"] = kv_bytes / (t * 1e-3) / 1e12
        for key in ("dense_kernel", "cudnn", "fa2"):
            a, o = row.get(key + "_graph_ms") or row.get(key + "_ms"), row.get("ours_graph_ms") or row["ours_ms"]
            if a and o:
                row["speedup_vs_" + key] = a / o
        emit(row)
        rows.append(row)
        write_results(args.out, rows, **meta)
        del q, k, v, qt, kt, vt, out, split_out
        torch.cuda.empty_cache()
    res = write_results(args.out, rows, **meta)
    try_plot(plot, res, os.path.splitext(args.out)[0] + ".png")


PEERS = (("ours", "ours (sp.attention as dispatched)"), ("dense_kernel", "our dense kernel (dense_path='dense')"),
         ("cudnn", "torch SDPA cuDNN"), ("fa2", "torch SDPA flash (FA2)"))


def plot(res, path):
    """Per shape (Lq:Lk:B, ours' path): left, the time of ours, our dense kernel, cuDNN and FA2 (CUDA-graph replay,
    per-call event time where a graph time is missing), with ours' speed-up over the dense kernel (the row's
    speedup_vs_dense_kernel) above each group; right, the KV bytes read per second against the H200's bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    labels = [f"Lq {r['Lq']}\nLk {r['Lk'] // 1024}K, B {r['batch']}\n{r.get('path', '')}" for r in rows]
    x = range(len(rows))
    w = 0.8 / len(PEERS)
    fig, (a, b) = plt.subplots(1, 2, figsize=(min(20, max(12, 3 * len(rows))), 4.8))
    for i, (key, label) in enumerate(PEERS):
        ts = [r.get(key + "_graph_ms") or r.get(key + "_ms") or 0 for r in rows]
        a.bar([j + (i - 1.5) * w for j in x], ts, w, label=label, color=f"C{i}")
        tb = [r.get(key + "_kv_tb_per_s") or 0 for r in rows]
        b.bar([j + (i - 1.5) * w for j in x], tb, w, label=label, color=f"C{i}")
    top = max((r.get(k + "_graph_ms") or r.get(k + "_ms") or 0) for r in rows for k, _ in PEERS)
    for j, r in zip(x, rows):
        if r.get("speedup_vs_dense_kernel"):
            a.annotate(f"{r['speedup_vs_dense_kernel']:.2f}x\nvs dense kernel", (j, top * 1.04), ha="center",
                       va="bottom", fontsize=7)
    a.set_ylim(0, top * 1.3)
    a.set_ylabel("ms per call (CUDA-graph replay)")
    a.set_title(f"short queries against long keys, Hq 32 Hkv 8 D 128 bf16 ({res.get('commit', '')[:7]})",
                fontsize=10)
    b.axhline(HBM_TB_S, color="grey", ls="--", label=f"H200 HBM {HBM_TB_S} TB/s")
    b.set_ylabel("KV bytes read per second (TB/s)")
    b.set_title("K and V read once: 2 B Lk Hkv D 2 bytes / time", fontsize=10)
    for ax in (a, b):
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
