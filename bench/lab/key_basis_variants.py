"""How much of the key_max basis's cost its accuracy needs (issue 44: the basis and moment kernels are ~0.47 ms at every
length, 61 % of the index stage at 8K): the estimators' offline scoring (bench/accuracy/estimators.py score, on a
capture of SmolLM2's post-RoPE q, k, v) of the key_max rule with the basis built from fewer sampled blocks
(kKeyBasisSampleBlocks, 64) and fewer subspace iterations (kKeyBasisIters, 10), against the library's. The selection
the kernels compute changes with either (the spec's constants), so a variant that holds here is still to be measured
end to end before the constants move.
Usage (from bench/): python3 ../bench/lab/key_basis_variants.py /tmp/cap_kv.pt [--layers 3,10,17,24]
       [--variants 64x10,16x10,8x10,64x5,64x3] [--set keymax_ratio]"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: accuracy

from accuracy import emulate, estimators  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("--layers", default="3,10,17,24")
    ap.add_argument("--variants", default="64x10,16x10,8x10,64x5,64x3")
    ap.add_argument("--names", default="kmx16_a0.03,kmx16_a0.1,kmx16_a0.3")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    estimators.SETS["_variants"] = a.names.split(",")
    lib = (emulate.KEY_BASIS_SAMPLE_BLOCKS, emulate.KEY_BASIS_ITERS)
    for v in a.variants.split(","):
        blocks, iters = (int(x) for x in v.split("x"))
        emulate.KEY_BASIS_SAMPLE_BLOCKS, emulate.KEY_BASIS_ITERS = blocks, iters
        tag = " (the library's)" if (blocks, iters) == lib else ""
        print(f"== basis from {blocks} sampled blocks, {iters} iterations{tag}", flush=True)
        estimators.score(argparse.Namespace(capture=a.capture, layers=a.layers, set="_variants", threads=a.threads))
    emulate.KEY_BASIS_SAMPLE_BLOCKS, emulate.KEY_BASIS_ITERS = lib


if __name__ == "__main__":
    main()
