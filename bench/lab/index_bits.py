"""The selection of one build, saved bit for bit, to compare two builds (an A/B whose change claims the same bits):
sp.build_index on the topic workload (bench/_common.py, fixed seeds) for each config and length, on the GPU, as the
kept block ids of every segment (in segment order) and their counts in one .npz; --compare A B says whether two such files are equal.
Usage: python3 bench/lab/index_bits.py --out ours.npz [--lengths 8192,32768] [--configs 'sp:rule=key_max;alpha=0.03']
       PYTHONPATH=/tmp/ab-base-site python3 bench/lab/index_bits.py --out base.npz
       python3 bench/lab/index_bits.py --compare ours.npz base.npz"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, the benchmarks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--configs", default="sp:rule=key_max;alpha=0.03,sp:rule=key_max;alpha=0.3;key_rank=32")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the reference: to try the script)")
    a = ap.parse_args(argv)
    if a.compare:
        x, y = (np.load(f) for f in a.compare)
        diff = sorted(k for k in set(x.files) | set(y.files)
                      if k not in x.files or k not in y.files or not np.array_equal(x[k], y[k]))
        print(f"{len(x.files)} / {len(y.files)} arrays, {len(diff)} differ" + (f": {diff[:8]}" if diff else ""))
        return 1 if diff else 0
    import torch
    from _common import require_cuda, topic
    from bench_selection import config
    if a.device == "cuda":
        sp = require_cuda()
    else:
        import sparse_prefill as sp
    arrays = {}
    for L in (int(x) for x in a.lengths.split(",")):
        q, k, v = topic(L, dev=a.device)
        cu = torch.tensor([0, L], dtype=torch.int32, device=a.device)
        for name in a.configs.split(","):
            h = sp.build_index(q, k, v, cu, cu, L, L, **config(name)).to_host().host
            start, end = np.asarray(h["segment_start"]), np.asarray(h["segment_end"])
            # canonical: each segment's kept ids in segment order (a device index's id offsets are its own business)
            arrays[f"{name}@{L}:lengths"] = end - start
            arrays[f"{name}@{L}:ids"] = np.concatenate([np.asarray(h["block_ids"])[lo:hi] for lo, hi in zip(start, end)])
    np.savez(a.out, **arrays)
    print(f"{len(arrays)} arrays -> {a.out} ({sp.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
