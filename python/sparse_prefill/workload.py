"""Seeded synthetic Q/K/V generators (float32 numpy arrays, one sequence, row-major).

    q [seqlen, num_q_heads, head_dim], k and v [seqlen, num_kv_heads, head_dim]

topic       the speed reference workload of docs/workload.md: every speed figure uses it, so numbers compare across runs.
structured  the accuracy workload (RoPE-rotated heads, attention sinks, local recency, semantic recall, retrieval
            needles, vertical stripes); needle_positions() tells where its needles are.

Both are deterministic for a given seed. Convert with e.g. torch.from_numpy(q).to("cuda", torch.bfloat16).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from . import _C
from ._api import _as_float, _as_int

__all__ = ["topic", "structured", "structured_defaults", "needle_positions"]


def _seed(seed) -> int:
    seed = _as_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed: must be >= 0, got {seed}")
    return seed


def topic(seqlen: int, num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, seed: int = 0,
          block: int = 128, targets: int = 4) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The "topic" workload: per KV head h and key block J a topic t[h, J] ~ N(0, I); K[i, h] = t[h, i // block] +
    N(0, I); V ~ N(0, I); query group p (block consecutive positions) of KV head h draws `targets` target blocks
    uniformly from [0, max(p, 1)) and Q[i, h*g + j] = sum of the targets' topics + N(0, I) for each head j of the
    group. The selected density falls with length (bench/results/sparse_h200.json records it per length, with the
    selection it was measured at).

    Args:
        seqlen: sequence length L (a multiple of `block` keeps every topic block whole).
        num_q_heads, num_kv_heads, head_dim: Hq, Hkv (dividing Hq), D.
        seed: >= 0; the same seed gives the same arrays.
        block: tokens per topic block (and per query group).
        targets: target blocks drawn per query group.

    Returns:
        (q, k, v) as float32 numpy arrays: q [L, Hq, D], k and v [L, Hkv, D].
    """
    seed = _seed(seed)
    return _C.workload_topic(_as_int("seqlen", seqlen), _as_int("num_q_heads", num_q_heads),
                             _as_int("num_kv_heads", num_kv_heads), _as_int("head_dim", head_dim), seed,
                             _as_int("block", block), _as_int("targets", targets))


def _knobs(knobs: dict) -> dict:
    defaults = _C.workload_structured_defaults()
    out = {}
    for name, value in knobs.items():
        if name not in defaults:
            raise TypeError(f"{name}: unknown knob of the structured workload (known: {', '.join(defaults)})")
        out[name] = _as_float(name, value) if isinstance(defaults[name], float) else _as_int(name, value)
    return out


def structured_defaults() -> dict:
    """The default knobs of the structured workload (StructuredParams in include/sparse_prefill/workload.h).

    Returns:
        a dict knob name -> default value.
    """
    return dict(_C.workload_structured_defaults())


def structured(seqlen: int, num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, seed: int = 0,
               **knobs) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The structured accuracy workload: RoPE-rotated content with local recency, attention sinks, semantic recall of
    earlier blocks, retrieval needles and vertical stripes (see StructuredParams in include/sparse_prefill/workload.h
    and docs/workload.md). Keyword arguments override its knobs by name (structured_defaults() lists them), e.g.
    structured(8192, needles=4, needle_logit=12.0).

    Args:
        seqlen, num_q_heads, num_kv_heads, head_dim, seed: as in topic().
        **knobs: the workload's knobs by name (structured_defaults() lists them; an unknown name is a TypeError).

    Returns:
        (q, k, v) as float32 numpy arrays: q [L, Hq, D], k and v [L, Hkv, D].
    """
    seed = _seed(seed)
    return _C.workload_structured(_as_int("seqlen", seqlen), _as_int("num_q_heads", num_q_heads),
                                  _as_int("num_kv_heads", num_kv_heads), _as_int("head_dim", head_dim), seed,
                                  _knobs(knobs))


def needle_positions(seqlen: int, num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, seed: int = 0,
                     **knobs) -> List[dict]:
    """The retrieval needles structured(...) plants for the same arguments (cheap: no tensors are generated).

    Args:
        seqlen, num_q_heads, num_kv_heads, head_dim, seed, **knobs: as in structured().

    Each needle is a dict: kv_head, key_begin, key_end, query_begin, query_end (positions, key_end <= query_begin)
    and value (float32 [head_dim]): the queries [query_begin, query_end) of the query heads of kv_head match the keys
    [key_begin, key_end), whose values all equal `value`.
    """
    seed = _seed(seed)
    return list(_C.workload_needles(_as_int("seqlen", seqlen), _as_int("num_q_heads", num_q_heads),
                                    _as_int("num_kv_heads", num_kv_heads), _as_int("head_dim", head_dim), seed,
                                    _knobs(knobs)))
