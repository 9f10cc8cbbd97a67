"""Where an exact_max chunk step's selection time goes (issue 44's <= 0.5 ms bar; 0.53 ms on the H100 at c9e5205):
the 1024-token chunk at 128K of bench_selection.py's chunk rows (topic workload, paged cache, pooled-means cache),
its index built 20 times under torch.profiler, the CUDA time per kernel name (the e4m3 pre-pass exact_keys_kernel,
the scorer exact_max_kernel, score_select's merge, the pooling). Run from the repository root on a GPU:
    python3 bench/lab/device_runs/chunk_step_kernels.py [rule ...]   (default: exact_max; e.g. exact_share)"""
import sys

sys.path.insert(0, "bench")
import torch  # noqa: E402

import sparse_prefill as sp  # noqa: E402
from _common import topic  # noqa: E402

L, C, PAGE, D, HKV = 131072, 1024, 64, 128, 8
q, k, v = topic(L)
pages = L // PAGE
kc, vc = k.reshape(pages, PAGE, HKV, D).contiguous(), v.reshape(pages, PAGE, HKV, D).contiguous()
bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
used = torch.tensor([L], dtype=torch.int32, device="cuda")
means = sp.mean_cache(kc)
sp.chunked_prefill(q, kc, vc, torch.tensor([0, L], dtype=torch.int32, device="cuda"), bt, used, L, L,
                   final_chunk=False, mean_cache=means)
qc = q[L - C:].contiguous()
cu_q = torch.tensor([0, C], dtype=torch.int32, device="cuda")
for rule in sys.argv[1:] or ["exact_max"]:
    kw = dict(rule=rule, alpha=0.05 if rule == "exact_max" else 0.01)
    args = (qc, kc, vc, cu_q, None, C, L)
    extra = dict(block_table=bt, seqused_k=used, final_chunk=False, mean_cache=means, **kw)
    for _ in range(3):
        sp.build_index(*args, **extra)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            sp.build_index(*args, **extra)
        torch.cuda.synchronize()
    print(f"== {rule}: CUDA time per build_index call, by kernel (20 calls)")
    rows = [(e.key, getattr(e, "device_time_total", 0) / 20, e.count // 20) for e in prof.key_averages()]
    rows = [r for r in rows if r[1] > 0]
    for name, us, n in sorted(rows, key=lambda r: -r[1]):
        print(f"{us / 1000:8.3f} ms  x{n:<3d} {name[:110]}")
