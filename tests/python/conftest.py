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


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and a CUDA build (skipped elsewhere)")
