import sys, os, torch, json
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "bench")
import sp_cuda
from bench_dense import time_ms
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
for L in (8192, 32768):
    for d in (64, 128):
        q = torch.randn(L, 32, d, dtype=torch.bfloat16, device="cuda"); k = torch.randn(L, 8, d, dtype=torch.bfloat16, device="cuda"); v = torch.randn_like(k)
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        ours = time_ms(lambda: sp_cuda.attention(q, k, v, cu, cu, L, L, return_lse=False))
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cud = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
        fl = 4 * L * L / 2 * 32 * d / 1e9
        print(json.dumps(dict(L=L, d=d, ours_ms=round(ours, 3), cudnn_ms=round(cud, 3), ours_tflops=round(fl / ours, 1), cudnn_tflops=round(fl / cud, 1))))
