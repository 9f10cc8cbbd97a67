"""Short queries against long keys (decode and small chunks) on the GPU machine: our attention() as it dispatches
(PackGQA tiles + split-KV for these shapes, cuda::dense_uses_full_list) against our dense kernel alone
(SP_DENSE_SPLIT=0, same process) and torch SDPA cuDNN / flash (FA2), measured in the same process.
Llama-3.1-8B heads (Hq=32, Hkv=8, D=128), bf16. Ours runs causal bottom-right; the peers run non-causal (torch's
is_causal is top-left aligned): for Lq <= 128 against Lk >= 32K the two differ in < 0.4 % of the scores.
Every row reports per-call event time and CUDA-graph replay time (bench_dense.time_graph_ms), and the KV bytes read
per second (K and V once: 2 * B * Lk * Hkv * D * 2 bytes), the bound of these memory-bound shapes (H200: 4.8 TB/s).
Usage: python3 bench/bench_decode.py --out bench/results/dense_decode_h200.json"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import sp_cuda  # noqa: E402
from bench_dense import commit, time_graph_ms, time_ms  # noqa: E402

# (Lq, Lk, batch)
SHAPES = [(1, 131072, 1), (1, 32768, 8), (1, 8192, 32), (16, 131072, 1), (64, 65536, 4), (128, 131072, 1),
          (256, 131072, 1), (512, 131072, 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dense_decode_h200.json"))
    ap.add_argument("--shapes", default=None, help="Lq:Lk:B,... (default: SHAPES)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    hq, hkv, d, g = 32, 8, 128, 4
    dev = "cuda"
    rows = []
    for lq, lk, b in shapes:
        torch.manual_seed(0)
        q = torch.randn(b * lq, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b * lk, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b * lk, hkv, d, device=dev, dtype=torch.bfloat16)
        cu_q = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * lq
        cu_k = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * lk
        out = torch.empty_like(q)
        lse = torch.empty(hq, b * lq, dtype=torch.float32, device=dev)
        row = dict(Lq=lq, Lk=lk, batch=b, path=sp_cuda.dense_path(q, k, v, cu_q, cu_k, lq, lk))

        def ours():
            sp_cuda.attention(q, k, v, cu_q, cu_k, lq, lk, causal=True, out=out, lse=lse)

        os.environ.pop("SP_DENSE_SPLIT", None)
        row["ours_ms"] = time_ms(ours)
        row["ours_graph_ms"] = time_graph_ms(ours)
        split_out = out.clone()
        os.environ["SP_DENSE_SPLIT"] = "0"
        row["dense_kernel_ms"] = time_ms(ours)
        row["dense_kernel_graph_ms"] = time_graph_ms(ours)
        torch.cuda.synchronize()
        row["max_abs_diff_split_vs_dense_kernel"] = (split_out.float() - out.float()).abs().max().item()
        os.environ.pop("SP_DENSE_SPLIT", None)
        qt = q.view(b, lq, hq, d).transpose(1, 2)
        kt = k.view(b, lk, hkv, d).repeat_interleave(g, dim=2).transpose(1, 2)
        vt = v.view(b, lk, hkv, d).repeat_interleave(g, dim=2).transpose(1, 2)
        for key, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
                    row[key + "_ms"] = time_ms(fn)
                    row[key + "_graph_ms"] = time_graph_ms(fn)
            except Exception as e:  # noqa: BLE001
                row[key + "_ms"] = None
                row[key + "_error"] = repr(e)[:200]
        kv_bytes = 2 * b * lk * hkv * d * 2
        for key in ("ours", "dense_kernel", "cudnn", "fa2"):
            t = row.get(key + "_graph_ms") or row.get(key + "_ms")
            if t:
                row[key + "_kv_tb_per_s"] = kv_bytes / (t * 1e-3) / 1e12
        for key in ("dense_kernel", "cudnn", "fa2"):
            a, o = row.get(key + "_graph_ms") or row.get(key + "_ms"), row.get("ours_graph_ms") or row["ours_ms"]
            if a and o:
                row["speedup_vs_" + key] = a / o
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, qt, kt, vt, out, lse, split_out
        torch.cuda.empty_cache()
    res = dict(device=torch.cuda.get_device_name(), commit=commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               shape=dict(hq=hq, hkv=hkv, d=d, dtype="bfloat16", ours="causal bottom-right", peers="non-causal"),
               torch=torch.__version__, library=sp_cuda.lib_path(), rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
