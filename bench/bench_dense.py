"""Dense causal prefill benchmark on the GPU machine: ours (src/cuda via tests/gpu/sp_cuda.py) vs torch SDPA cuDNN,
torch SDPA flash (FA2) and optionally FlexAttention, measured in the same process.
Llama-3.1-8B head shape: Hq=32, Hkv=8, D=128, bf16, batch 1, causal. FLOPs = 4*L*L*D*Hq/2.
Writes a JSON with keys device, commit, date, command, rows[{L, ours_ms, cudnn_ms, fa2_ms, ours_tflops, ...}].
Usage: python3 bench/bench_dense.py --out bench/results/dense_h200.json [--lengths 4096,8192] [--flex]
A/B of a build switch: SP_CUDA_LIB=build-cuda/libsp_cuda_test_<variant>.so in a separate process (two copies of the
statically linked CUDA runtime in one process fail to launch: "invalid argument")."""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
import sp_cuda  # noqa: E402


def time_ms(fn, total_ms_budget=1500.0, max_iters=50):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    one = s.elapsed_time(e)
    iters = max(3, min(max_iters, int(total_ms_budget / max(one, 1e-3))))
    times = []
    for _ in range(iters):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]  # median


def commit():
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return os.environ.get("SP_COMMIT", "unknown")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dense_h200.json"))
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. the build switch of an A/B run)")
    args = ap.parse_args()
    hq, hkv, d = args.hq, args.hkv, 128
    g = hq // hkv
    dev = "cuda"
    rows = []
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
    for L in [int(x) for x in args.lengths.split(",")]:
        torch.manual_seed(0)
        q = torch.randn(L, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        lse = torch.empty(hq, L, dtype=torch.float32, device=dev)
        flops = 4 * L * L * d * hq / 2
        row = dict(L=L)

        def ours():
            sp_cuda.attention(q, k, v, cu, cu, L, L, causal=True, out=out, lse=lse)

        row["ours_ms"] = time_ms(ours)
        qt = q.unsqueeze(0).transpose(1, 2)                                   # [1, Hq, L, D] (BSHD strides)
        kt = k.repeat_interleave(g, dim=1).unsqueeze(0).transpose(1, 2)
        vt = v.repeat_interleave(g, dim=1).unsqueeze(0).transpose(1, 2)
        for key, backend in (("cudnn_ms", SDPBackend.CUDNN_ATTENTION), ("fa2_ms", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                    row[key] = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
                if key == "cudnn_ms":  # sanity: ours vs cuDNN output
                    row["max_abs_diff_vs_cudnn"] = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
                del ref
            except Exception as e:  # noqa: BLE001
                row[key] = None
                row[key + "_error"] = repr(e)[:200]
        if flex is not None:
            try:
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=dev)
                row["flex_ms"] = time_ms(lambda: flex(qt, kt, vt, block_mask=bm))
            except Exception as e:  # noqa: BLE001
                row["flex_ms"] = None
                row["flex_error"] = repr(e)[:200]
        for key in ("ours", "cudnn", "fa2", "flex"):
            if row.get(key + "_ms"):
                row[key + "_tflops"] = flops / (row[key + "_ms"] * 1e-3) / 1e12
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, qt, kt, vt, out, lse
        torch.cuda.empty_cache()
    res = dict(device=torch.cuda.get_device_name(), commit=commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               shape=dict(hq=hq, hkv=hkv, d=d, dtype="bfloat16", batch=1, causal=True),
               torch=torch.__version__, library=sp_cuda.lib_path(), label=args.label, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
