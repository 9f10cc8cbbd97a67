"""Dense causal prefill benchmark on the GPU machine: ours (src/cuda via tests/gpu/sp_cuda.py) vs torch SDPA cuDNN,
torch SDPA flash (FA2) and optionally FlexAttention, measured in the same process.
Llama-3.1-8B head shape: Hq=32, Hkv=8, D=128, bf16, batch 1, causal. FLOPs = 4*L*L*D*Hq/2.
Writes a JSON with keys device, commit, date, command, rows[{L, ours_ms, cudnn_ms, fa2_ms, ours_tflops, ...}].
Usage: python3 bench/bench_dense.py --out bench/results/dense_h200.json [--lengths 4096,8192] [--flex] [--no-extra]
Extra rows (on by default, --no-extra to skip; written to bench/results/dense_h200_paged_varlen.json or --extra-out):
  * varlen: one causal varlen call over 8 sequences of fixed mixed lengths (VARLEN_MIX, 1K..8K, sum 32K) vs the same
    sequences run one call each (sum of their medians). Target: varlen within 5 % of the separate calls.
  * paged: causal L = PAGED_LENGTHS, KV scattered into randomly permuted pages of PAGE_SIZES tokens vs the same
    tokens contiguous, same process, timed in PAGED_ROUNDS interleaved rounds (median of the round medians).
    Target: paged within 5 % of contiguous.
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


def time_graph_ms(fn, reps=None, rounds=7):
    """GPU time of one fn() call without the host's enqueue time: `reps` calls captured into one CUDA graph, replayed
    between events, divided by reps (median of `rounds`). Per-call event timing (time_ms) also counts the host's launch
    gaps when a call's GPU work is shorter than its Python + launch overhead (a ~0.1 ms index stage at chunk 1024 x
    batch 1); an engine enqueues ahead of the GPU, so this is the time the step costs it. Returns None when fn cannot
    be captured (a host sync or allocation inside)."""
    one = time_ms(fn, total_ms_budget=50.0, max_iters=5)
    reps = reps or max(1, min(50, int(20.0 / max(one, 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print("graph timing unavailable:", repr(e)[:200], flush=True)
        torch.cuda.synchronize()
        return None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / reps)
    del graph
    times.sort()
    return times[len(times) // 2]


VARLEN_MIX = [1024, 8192, 2048, 6144, 3072, 5120, 4096, 3072]  # sum 32768; fixed so runs compare
PAGED_LENGTHS = [32768, 131072]
PAGE_SIZES = [64, 128]
PAGED_ROUNDS = 3


def extra_rows(hq, hkv, d, dev, paged_lengths, varlen=True):
    """Varlen-vs-separate and paged-vs-contiguous rows (see the module docstring)."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    if varlen:
        rows += varlen_rows(hq, hkv, d, dev, g)
    rows += paged_rows(hq, hkv, d, dev, g, paged_lengths)
    return rows


def varlen_rows(hq, hkv, d, dev, g):
    """One causal varlen call over VARLEN_MIX vs one call per sequence."""
    rows = []
    tot = sum(VARLEN_MIX)
    q = torch.randn(tot, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(tot, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(tot, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    cu_list = [0]
    for L in VARLEN_MIX:
        cu_list.append(cu_list[-1] + L)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    lse = torch.empty(hq, tot, dtype=torch.float32, device=dev)
    varlen_ms = time_ms(lambda: sp_cuda.attention(q, k, v, cu, cu, max(VARLEN_MIX), max(VARLEN_MIX), causal=True,
                                                  out=out, lse=lse))
    sep = []
    for b, L in enumerate(VARLEN_MIX):
        a, e = cu_list[b], cu_list[b + 1]
        qb, kb, vb = q[a:e].contiguous(), k[a:e].contiguous(), v[a:e].contiguous()
        cub = torch.tensor([0, L], dtype=torch.int32, device=dev)
        ob = torch.empty_like(qb)
        lb = torch.empty(hq, L, dtype=torch.float32, device=dev)
        sep.append(time_ms(lambda: sp_cuda.attention(qb, kb, vb, cub, cub, L, L, causal=True, out=ob, lse=lb)))
    flops = sum(4 * L * L * d * hq / 2 for L in VARLEN_MIX)
    row = dict(kind="varlen_vs_separate", lengths=VARLEN_MIX, total_tokens=tot, varlen_ms=varlen_ms,
               separate_ms_sum=sum(sep), separate_ms=sep, varlen_over_separate=varlen_ms / sum(sep),
               varlen_tflops=flops / (varlen_ms * 1e-3) / 1e12)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del q, k, v, out, lse
    torch.cuda.empty_cache()
    return rows


def paged_rows(hq, hkv, d, dev, g, paged_lengths):
    """Causal single sequence, KV in randomly permuted pages of PAGE_SIZES tokens vs contiguous."""
    rows = []
    for L in paged_lengths:
        q = torch.randn(L, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(L, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        lse = torch.empty(hq, L, dtype=torch.float32, device=dev)
        fns = {0: lambda: sp_cuda.attention(q, k, v, cu, cu, L, L, causal=True, out=out, lse=lse)}
        fns[0]()
        ref = out.clone()
        flops = 4 * L * L * d * hq / 2
        caches = {}
        for ps in PAGE_SIZES:
            n_pages = (L + ps - 1) // ps
            perm = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32)  # random page placement
            kc = torch.empty(n_pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
            vc = torch.empty_like(kc)
            kc[perm.long()] = k.view(n_pages, ps, hkv, d)
            vc[perm.long()] = v.view(n_pages, ps, hkv, d)
            bt = perm.view(1, n_pages).contiguous()
            su = torch.tensor([L], dtype=torch.int32, device=dev)
            caches[ps] = (kc, vc, bt, su)
            fns[ps] = (lambda c=caches[ps]: sp_cuda.attention(q, c[0], c[1], cu, None, L, L, causal=True, out=out,
                                                              lse=lse, block_table=c[2], seqused_k=c[3]))
        # Interleaved rounds (contiguous, page 64, page 128, contiguous, ...): long back-to-back runs drift with the
        # GPU's power/clock state (one 128K run measured page 128 at 1.006x, the next at 1.093x contiguous when
        # timed after it), so each variant is timed in every round and the median over rounds is reported.
        per = {key: [] for key in fns}
        for _ in range(PAGED_ROUNDS):
            for key, fn in fns.items():
                per[key].append(time_ms(fn, total_ms_budget=500.0))
        med = {key: sorted(v_)[len(v_) // 2] for key, v_ in per.items()}
        for ps in PAGE_SIZES:
            fns[ps]()
            torch.cuda.synchronize()
            row = dict(kind="paged_vs_contiguous", L=L, page_size=ps, paged_ms=med[ps], contiguous_ms=med[0],
                       paged_over_contiguous=med[ps] / med[0], paged_tflops=flops / (med[ps] * 1e-3) / 1e12,
                       paged_ms_rounds=per[ps], contiguous_ms_rounds=per[0],
                       max_abs_diff_vs_contiguous=(out.float() - ref.float()).abs().max().item())
            print(json.dumps(row), flush=True)
            rows.append(row)
        del q, k, v, out, lse, ref, caches, fns
        torch.cuda.empty_cache()
    return rows


def commit():
    """SP_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("SP_COMMIT"):
        return os.environ["SP_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dense_h200.json"))
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. the build switch of an A/B run)")
    ap.add_argument("--no-extra", dest="extra", action="store_false",
                    help="skip the varlen-vs-separate and paged-vs-contiguous rows")
    ap.add_argument("--paged-lengths", default=",".join(str(x) for x in PAGED_LENGTHS),
                    help="lengths of the paged-vs-contiguous rows")
    ap.add_argument("--no-varlen", dest="varlen", action="store_false", help="skip the varlen-vs-separate row")
    ap.add_argument("--page-sizes", default=",".join(str(x) for x in PAGE_SIZES),
                    help="page sizes of the paged-vs-contiguous rows")
    ap.add_argument("--extra-out", default=None,
                    help="JSON for the extra rows (default: dense_h200_paged_varlen.json beside --out)")
    args = ap.parse_args()
    PAGE_SIZES[:] = [int(x) for x in args.page_sizes.split(",") if x]
    hq, hkv, d = args.hq, args.hkv, 128
    g = hq // hkv
    dev = "cuda"
    rows = []
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
    for L in [int(x) for x in args.lengths.split(",") if x]:
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
    try:
        plot(res, os.path.splitext(args.out)[0] + ".png")
    except Exception as e:  # noqa: BLE001
        print("plot skipped:", repr(e))
    if args.extra:
        paged_lengths = [int(x) for x in args.paged_lengths.split(",") if x]
        ex = dict(res, shape=dict(hq=hq, hkv=hkv, d=d, dtype="bfloat16", causal=True),
                  varlen_mix=VARLEN_MIX if args.varlen else None, paged_lengths=paged_lengths,
                  page_sizes=PAGE_SIZES, paged_rounds=PAGED_ROUNDS,
                  rows=extra_rows(hq, hkv, d, dev, paged_lengths, args.varlen))
        path = args.extra_out or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                              "dense_h200_paged_varlen.json")
        with open(path, "w") as f:
            json.dump(ex, f, indent=1)


def plot(res, path):
    """TFLOP/s against length for every peer of a dense_h200.json (also: python3 bench/bench_dense.py --plot FILE)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = res["rows"]
    for key, label in (("ours", "ours (sm90a)"), ("cudnn", "torch SDPA cuDNN"), ("fa2", "torch SDPA flash (FA2)"),
                       ("flex", "FlexAttention")):
        pts = [(r["L"], r[f"{key}_tflops"]) for r in rows if r.get(f"{key}_tflops")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length L (causal, batch 1, Hq 32, Hkv 8, D 128, bf16)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"dense prefill on the {res.get('device', 'GPU')} ({res.get('commit', '')[:7]})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":
        with open(sys.argv[2]) as f:
            plot(json.load(f), os.path.splitext(sys.argv[2])[0] + ".png")
    else:
        main()
