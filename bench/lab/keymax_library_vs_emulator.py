"""Does the library's rule='key_max' (its CPU reference, through the package) select exactly what the emulator's rule
of the GPU accuracy runs selects (emulate.py score 'resid', rank 16, onepass 2, sinkref 1, one selection per query
head), on a model's real queries and keys: every layer of a capture (python -m accuracy.estimators capture ...)?
The tests assert it on random and spiky inputs (test_accuracy_emulator.py); this is the check on SmolLM2's.
Usage: python3 bench/lab/keymax_library_vs_emulator.py CAPTURE.pt [alpha] [layers]   (from bench/; ~10 s a layer)"""
import math
import sys

import numpy as np
import torch

sys.path.insert(0, ".")
from accuracy import emulate  # noqa: E402

import sparse_prefill as sp  # noqa: E402


def main():
    cap = torch.load(sys.argv[1])["layers"]
    alpha = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    layers = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else sorted(cap)
    print(f"key_max alpha {alpha}, rank 16, sink 256, one selection per query head: library (CPU reference) against "
          f"the emulator")
    for layer in layers:
        q, k, v = (t.float() for t in cap[layer])
        L, hq, D = q.shape
        g = hq // k.shape[1]
        scale = 1.0 / math.sqrt(D)
        rule = dict(score="resid", rank=16, subgroups=g, alpha=alpha, onepass=2, sinkref=1)
        sel = emulate.select(q, k, v, rule, scale)
        cu = np.array([0, L], dtype=np.int32)
        qn, kn, vn = (x.numpy().astype(np.float32) for x in (q, k, v))
        idx = sp.build_index(qn, kn, vn, cu, cu, L, L, softmax_scale=scale, rule="key_max", alpha=alpha,
                             head_subgroups=g)
        V, T, _ = sel.keep.shape
        diff = sum(len(set(np.nonzero(sel.keep[h, t].numpy() & sel.visible[t].numpy())[0].tolist()) ^
                       set(idx.segment(0, h, t).tolist())) for h in range(V) for t in range(T))
        print(f"layer {layer:2d}: density emulator {sel.density:.4f}, library {idx.density:.4f}; blocks differing "
              f"{diff} of {idx.kept_blocks} kept", flush=True)


if __name__ == "__main__":
    main()
