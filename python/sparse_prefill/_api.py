"""The public functions of sparse_prefill: dense attention, block-sparse prefill, block union, KV pooling.

Vocabulary and argument names follow flash_attn_varlen_func so that adopting SparsePrefill is a one-line change.
Every array argument may come from numpy, torch, cupy or jax (any DLPack producer); all arrays of one call must come
from one array library, and outputs are allocated in it, on the device of `q`.

Shapes (B sequences, Hq query heads, Hkv KV heads, head dim D in {64, 128}; Hq % Hkv == 0):
    q                   [total_q, Hq, D]           float32 / float16 / bfloat16 / float8_e4m3fn (or uint8 bit
                                                   patterns with qkv_dtype='float8_e4m3fn', as k and v)
    k, v (contiguous)   [total_k, Hkv, D]          with cu_seqlens_k [B+1] int32
    k, v (paged)        [num_pages, page_size, Hkv, D]  with block_table [B, max_pages] int32, seqused_k [B] int32,
                                                        and cu_seqlens_k=None
    cu_seqlens_q        [B+1] int32, monotone, cu_seqlens_q[-1] == total_q
    out                 [total_q, Hq, D]           q's dtype; bfloat16 for FP8 (uint16 bits with qkv_dtype)
    lse                 [Hq, total_q]              float32, natural log; -inf for rows that see no key

Masking: causal is aligned bottom-right (query i of a sequence with Lq queries and Lk keys sees key j iff
j <= i + Lk - Lq); `window=(left, right)` bounds the keys to [diag - left, diag + right] (-1 = unbounded).
A row that sees no key outputs zeros and lse = -inf.

Errors: bad arguments raise ValueError (values, shapes) or TypeError (types, dtypes, devices, array libraries);
the message starts with the argument's name and the exception carries it as `.argument` when raised by the library.
A valid call that a backend does not implement (e.g. a CUDA path not built yet) raises NotImplementedError.

The package's internal namespace. The code lives in modules by role, and every name that other code uses
(sparse_prefill/__init__.py, torch_ops.py, workload.py, the tests and benchmarks) is imported here, so
`sparse_prefill._api.<name>` and `from ._api import ...` keep working:
    _call.py    argument coercion (_as_int, _as_int32, _as_bool, _as_float, _as_window), LaunchOptions, make_inputs,
                check_errors, _Call (one call's arrays and its _C.Inputs), _kv_arrays, _mean_cache_arrays
    _selection.py  Selection, SELECTION_DEFAULTS, and _selection._selection (a call's selection= or its keywords
                as one Selection)
    _dense.py   attention, attention_path, attention_workspace_bytes, fp8_attention_support
    _index.py   Index, build_index, the index workspace sizes, sparse_support, union_index, pool_kv
    _sparse.py  sparse_attention, sparse_attention_workspace_bytes, sparse_prefill, MeanCache / mean_cache,
                chunked_prefill
Each module looks the extension up as its own global `_C`: code that replaces `_C` (bench/bench_host_overhead.py
--python-only) replaces it in every module of _MODULES.
"""

from __future__ import annotations

from . import _call, _dense, _index, _selection, _sparse
from ._call import (_DESCALES, _FP8, LaunchOptions, _Call, _as_bool, _as_float, _as_int, _as_int32, _as_window,
                    _kv_arrays, _launch_options, _mean_cache_arrays, check_errors)
from ._dense import attention, attention_path, attention_workspace_bytes, fp8_attention_support
from ._index import (Index, build_index, chunked_prefill_workspace_bytes, index_workspace_bytes, pool_kv,
                     sparse_prefill_workspace_bytes, sparse_support, union_index)
from ._selection import (_D, _RULE_NAMES, _RULES, SELECTION_DEFAULTS, Selection, _as_head_subgroups, _as_rule)
from ._sparse import (MeanCache, _check_index, chunked_prefill, mean_cache, sparse_attention,
                      sparse_attention_workspace_bytes, sparse_prefill)

_MODULES = (_call, _dense, _index, _selection, _sparse)
"""The modules whose functions call the extension (each through its own global `_C`)."""

__all__ = ["attention", "build_index", "sparse_attention", "sparse_prefill", "chunked_prefill", "mean_cache",
           "MeanCache", "Selection", "SELECTION_DEFAULTS", "check_errors",
           "union_index", "pool_kv", "Index", "LaunchOptions", "attention_path", "attention_workspace_bytes",
           "index_workspace_bytes", "sparse_attention_workspace_bytes", "sparse_prefill_workspace_bytes",
           "chunked_prefill_workspace_bytes", "sparse_support", "fp8_attention_support"]

