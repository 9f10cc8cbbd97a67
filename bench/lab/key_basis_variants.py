"""How much of the key_max basis's cost its accuracy needs (issue 44: the basis and moment kernels are ~0.47 ms at every
length, 61 % of the index stage at 8K): the estimators' offline scoring (bench/accuracy/estimators.py score, on a
capture of SmolLM2's post-RoPE q, k, v) of the key_max rule with the basis built from fewer sampled blocks
(kKeyBasisSampleBlocks, 64) and fewer subspace iterations (kKeyBasisIters, 10), against the library's. The selection
the kernels compute changes with either (the spec's constants), so a variant that holds here is still to be measured
end to end before the constants move.
A variant "pNxI" builds the basis from the prompt's first N blocks only (every key of them), I iterations: what a
chunked prefill would get if the basis were fixed at its first chunk (N = chunk / block_size) so that later chunks
could cache their projected keys K' beside the pooled means instead of projecting the whole cache at every step.
A variant "c<capture>" takes each layer's basis from another capture's keys (the library's basis of that prompt, the
same layer): a basis calibrated once per layer offline, which would remove the moment and basis kernels (~0.47 ms)
and make K' cacheable by page for every sequence.
Usage (from bench/): python3 ../bench/lab/key_basis_variants.py /tmp/cap_kv.pt [--layers 3,10,17,24]
       [--variants 64x10,16x10,8x10,64x5,64x3,p8x10] [--set keymax_ratio]"""
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
    lib_basis = emulate.key_basis
    layers = [int(x) for x in a.layers.split(",")]
    for v in a.variants.split(","):
        if v.startswith("c"):  # estimators.score calls key_basis once per layer, in --layers order (one rank)
            import torch
            other = torch.load(v[1:])["layers"]
            order = iter(layers)
            emulate.key_basis = lambda k, rank, block: lib_basis(other[next(order)][1].float(), rank, block)
            print(f"== basis from {v[1:]}'s keys of the same layer, the library's sampling", flush=True)
            estimators.score(argparse.Namespace(capture=a.capture, layers=a.layers, set="_variants",
                                                threads=a.threads))
            emulate.key_basis = lib_basis
            continue
        prefix = v.startswith("p")
        blocks, iters = (int(x) for x in v.lstrip("p").split("x"))
        emulate.KEY_BASIS_ITERS = iters
        if prefix:  # every key of the first `blocks` blocks: the library's sampling over that prefix with stride 1
            emulate.KEY_BASIS_SAMPLE_BLOCKS = blocks
            emulate.key_basis = lambda k, rank, block, n=blocks: lib_basis(k[: n * block], rank, block)
            what = f"the first {blocks} blocks"
        else:
            emulate.KEY_BASIS_SAMPLE_BLOCKS, emulate.key_basis = blocks, lib_basis
            what = f"{blocks} sampled blocks"
        tag = " (the library's)" if (blocks, iters) == lib and not prefix else ""
        print(f"== basis from {what}, {iters} iterations{tag}", flush=True)
        estimators.score(argparse.Namespace(capture=a.capture, layers=a.layers, set="_variants", threads=a.threads))
    emulate.KEY_BASIS_SAMPLE_BLOCKS, emulate.KEY_BASIS_ITERS = lib
    emulate.key_basis = lib_basis


if __name__ == "__main__":
    main()
