"""pytest setup for the Python package tests: import sparse_prefill from <repo>/python when it is not installed."""

import importlib.util
import os
import sys

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "python")
# SP_TEST_INSTALLED=1 (scripts/test.sh): the tests run against the pip-installed package, never <repo>/python.
# Otherwise the in-tree build (scripts/build.sh) comes first, as before; an editable install still answers first.
if os.environ.get("SP_TEST_INSTALLED") == "1":
    _spec = importlib.util.find_spec("sparse_prefill")
    assert _spec is not None, "SP_TEST_INSTALLED=1 but sparse_prefill is not installed (pip install .)"
    _found = os.path.realpath(_spec.origin)
    assert not _found.startswith(os.path.realpath(_PKG) + os.sep), (
        f"SP_TEST_INSTALLED=1 but sparse_prefill resolves to the source tree ({_found}), not the installed package")
elif _PKG not in sys.path:
    sys.path.insert(0, _PKG)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


# The selection's mechanics as the tests below were written for them: one selection per KV group (the library's
# default is one per query head, head_subgroups 0) and the dense rule off (dense_fraction 1: random inputs keep
# most blocks, and the rule would turn their selections into full lists). The defaults have tests of their own
# (test_dense_rule.py).
MECHANICS = dict(head_subgroups=1, dense_fraction=1.0)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make_varlen(rng, q_lens, k_lens, hq=4, hkv=2, d=64, dtype=np.float32):
    """Random q [sum q_lens, hq, d], k, v [sum k_lens, hkv, d] and int32 cu_seqlens."""
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    return q, k, v, cu_q, cu_k


def to_paged(rng, k, v, cu_k, page_size, extra_pages=3, fill=None):
    """A paged copy of contiguous k, v: shuffled pages, spare pages of garbage (random * 100, or `fill`, e.g. an FP8
    NaN code for uint8 bit arrays), padded block_table."""
    lens = np.diff(cu_k)
    pages_per_seq = [(int(n) + page_size - 1) // page_size for n in lens]
    num_pages = sum(pages_per_seq) + extra_pages
    perm = rng.permutation(num_pages)
    hkv, d = k.shape[1:]
    if fill is None:
        k_cache = rng.standard_normal((num_pages, page_size, hkv, d)).astype(k.dtype) * 100
        v_cache = rng.standard_normal((num_pages, page_size, hkv, d)).astype(v.dtype) * 100
    else:
        k_cache = np.full((num_pages, page_size, hkv, d), fill, k.dtype)
        v_cache = np.full((num_pages, page_size, hkv, d), fill, v.dtype)
    max_pages = max(pages_per_seq) + 1
    block_table = np.full((len(lens), max_pages), -1, np.int32)  # unused slots hold garbage ids
    nxt = 0
    for b, n in enumerate(lens):
        for p in range(pages_per_seq[b]):
            page = perm[nxt]
            nxt += 1
            block_table[b, p] = page
            lo = cu_k[b] + p * page_size
            hi = min(lo + page_size, cu_k[b + 1])
            k_cache[page, : hi - lo] = k[lo:hi]
            v_cache[page, : hi - lo] = v[lo:hi]
    return k_cache, v_cache, block_table, lens.astype(np.int32)


def topic_batch(q_lens, k_lens, hq=4, hkv=2, d=64, seed=0, block=64):
    """Topic sequences (selective attention: sparse_prefill.workload.topic with topic blocks of `block` keys) packed
    as a varlen batch; sequence b keeps its last q_lens[b] queries (a chunk at the end of its KV)."""
    import sparse_prefill as sp
    qs, ks, vs = [], [], []
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        q, k, v = sp.workload.topic(lk, hq, hkv, d, seed=seed + b, block=block)
        qs.append(q[lk - lq:])
        ks.append(k)
        vs.append(v)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    return np.concatenate(qs), np.concatenate(ks), np.concatenate(vs), cu_q, cu_k


# exact_max_spec.md step 2's constructed case (test_selection.py on the CPU, test_exact_max_cuda.py on the kernel): one
# head, D 64, every query e_0; key 300 (block 2) has logit 5 and key spike_key logit 10 (x scale 1/8), every other 0.
# Tile 6 (positions 768-895) sees the window band's blocks 4-6 (window 256) and the sink block 0; at alpha 0.05 (ln -3)
# block 2 is kept iff the spike sets no row's maximum, i.e. iff its block is not scored.
BAND_CASE_SELECTION = dict(rule="exact_max", alpha=0.05, candidate_alpha=0.0, block_size=128, sink=128, window=256,
                           last_n=0, dense_fraction=1.0, softmax_scale=0.125)


def band_case(spike_key, dtype=np.float32):
    """q, k, cu, L of the constructed case (numpy; bf16 holds every value exactly)."""
    L, D = 1024, 64
    q = np.zeros((L, 1, D), dtype)
    k = np.zeros((L, 1, D), dtype)
    q[:, 0, 0] = 1.0
    k[spike_key, 0, 0], k[300, 0, 0] = 80.0, 40.0
    return q, k, np.array([0, L], np.int32), L


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and a CUDA build (skipped elsewhere)")
