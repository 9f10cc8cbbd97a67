"""Block-sparse attention over an index: sparse_attention(), sparse_prefill(), the pooled-means cache (MeanCache,
mean_cache()), chunked_prefill() (conventions: sparse_prefill._api)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _C
from ._arrays import ArrayLib, library_of, to_numpy
from ._call import LaunchOptions, _Call, _as_bool, _as_int, _kv_arrays, _mean_cache_arrays
from ._index import Index, build_index
from ._selection import Selection, _selection, selection_keywords


def sparse_attention_workspace_bytes(q, k, v, index: Index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                     max_seqlen_k: int, block_table=None, seqused_k=None, causal: bool = True,
                                     softmax_scale: Optional[float] = None,
                                     options: Optional[LaunchOptions] = None, qkv_dtype=None) -> int:
    """Bytes of the `workspace` of sparse_attention() over a host index with CUDA arrays (0 for a device index, which
    carries its own, and for CPU arrays).

    Args:
        q, k, v, index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, causal,
            softmax_scale, options, qkv_dtype: as in sparse_attention() (shapes are read, not values).
    """
    _check_index(index)
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k), qkv_dtype=qkv_dtype)
    if index.on_device or not call.lib.cuda:
        return 0
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), 0, options)
    return int(_C.sparse_attention_workspace_bytes(inputs, index._arrays(call.lib)))


def _check_index(index: Any) -> None:
    if not isinstance(index, Index):
        raise TypeError(f"index: expected a sparse_prefill.Index (from build_index or union_index), got "
                        f"{type(index).__name__}")


def sparse_attention(q, k, v, index: Index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = True, softmax_scale: Optional[float] = None, out=None, return_lse: bool = False,
                     block_table=None, seqused_k=None, stream=None, workspace=None, reuse_index: bool = False,
                     options: Optional[LaunchOptions] = None, q_descale=None, k_descale=None, v_descale=None,
                     qkv_dtype=None):
    """Attention over the blocks listed in `index` (token-level causal masking still applies), plus the mean
    correction for the dropped, fully visible blocks when index.correction is set.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out, return_lse,
            block_table, seqused_k, stream, options, q_descale, k_descale, v_descale, qkv_dtype: as in attention()
            (no sliding-window mask here).
        index: an Index from build_index() or union_index() on these very arrays: its binding is checked (a
            different mask, scale, shape, length bound or array raises an error naming the argument). A device
            index is read in place; a host index with CUDA arrays is copied to the device once (cached).
        workspace: CUDA arrays with a host index: at least sparse_attention_workspace_bytes(...) bytes on q's device,
            where the host index is prepared (default: a stream-ordered temporary). A device index carries its own:
            passing one then is an error.
        reuse_index: True applies the index to other arrays of the same problem (e.g. another layer's K/V): the
            arrays' addresses are then not checked; the problem (mask, scale, head geometry, lengths, dtype) still
            must match (docs/engine.md).

    Returns:
        out, or (out, lse) when return_lse is True.
    """
    _check_index(index)
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), out, qkv_dtype=qkv_dtype)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
    return_lse = _as_bool("return_lse", return_lse)
    reuse_index = _as_bool("reuse_index", reuse_index)
    out_c, lse, out_ret = call.outputs(out, return_lse)
    if index.on_device:
        if workspace is not None:
            raise ValueError("workspace: a device index carries its own workspace; pass workspace= to build_index()")
        lib_ws = library_of(index.workspace)
        if lib_ws != call.lib.compute or not call.lib.cuda:
            raise TypeError(f"index: lives on the device in a {lib_ws} array; pass {lib_ws} CUDA arrays (or use "
                            "index.to_host())")
        _C.sparse_attention_device(inputs, index._dev, call.c_out(out_c), call.c(lse), reuse_index=reuse_index)
    else:
        _C.sparse_attention(inputs, index._arrays(call.lib), call.c_out(out_c), call.c(lse),
                            workspace=call.c(call.workspace(workspace)), reuse_index=reuse_index)
    return call.result(out_c, lse, out_ret, return_lse)


@selection_keywords
def sparse_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                   softmax_scale: Optional[float] = None, out=None, return_lse: bool = False,
                   return_index: bool = False, block_table=None, seqused_k=None, stream=None, mean_cache=None,
                   workspace=None, options: Optional[LaunchOptions] = None, q_descale=None, k_descale=None,
                   v_descale=None, qkv_dtype=None, selection: Optional[Selection] = None, **selection_keywords):
    """Block-sparse prefill in one call: build_index() + sparse_attention(). On CUDA the index never leaves the
    device and no host synchronisation happens.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out, return_lse,
            block_table, seqused_k, stream, options, q_descale, k_descale, v_descale, qkv_dtype: as in attention()
            (no sliding-window mask here).
        selection: a Selection (sp.Selection(...)), the selection as one value; default: the one the keywords below
            build.
        the selection keywords (one per field of sp.Selection; the signature lists them): default: the library
            default (shown as <library default>); see build_index(), "Selection arguments" (with a max_kept_blocks
            budget, pass the same value to sparse_prefill_workspace_bytes()). Pass the selection either as
            `selection=` or as the selection keywords (a keyword left out is the library default,
            sp.SELECTION_DEFAULTS), never both: any selection keyword passed together with `selection=` is a
            ValueError naming the keyword, whatever its value (the default's value too).
        mean_cache: the pooled-means cache of a paged KV cache (mean_cache(); see chunked_prefill()), read for the
            blocks before each chunk and written for the blocks the chunk completes.
        workspace: CUDA: at least sparse_prefill_workspace_bytes(...) bytes, 256-byte aligned, holding the index and
            its launch state (the call then allocates nothing and can be captured in a CUDA graph); default: a
            stream-ordered temporary.
        return_index: also return the index (runs build_index() + sparse_attention(); on CUDA a device index).

    Returns:
        out; (out, lse) with return_lse; (out, index) with return_index; (out, lse, index) with both.
    """
    sel = _selection(selection, selection_keywords)
    if not _as_bool("return_index", return_index):
        call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                                (q_descale, k_descale, v_descale)), out, qkv_dtype=qkv_dtype)
        mean_k, mean_v, mean_bs = _mean_cache_arrays(mean_cache, call)
        inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
        return_lse = _as_bool("return_lse", return_lse)
        out_c, lse, out_ret = call.outputs(out, return_lse)
        _C.sparse_prefill(inputs, sel._params, call.c_out(out_c), call.c(lse), mean_k=call.c(mean_k),
                          mean_v=call.c(mean_v), workspace=call.c(call.workspace(workspace)), mean_block_size=mean_bs)
        return call.result(out_c, lse, out_ret, return_lse)
    if mean_cache is not None and library_of(q) is not None and not _Call(
            _kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                       (q_descale, k_descale, v_descale)), qkv_dtype=qkv_dtype).lib.cuda:
        raise ValueError("mean_cache: not supported with return_index=True on the CPU (that path builds the index "
                         "with the reference, which pools every block)")
    index = build_index(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                        softmax_scale=softmax_scale, block_table=block_table, seqused_k=seqused_k, stream=stream,
                        workspace=workspace, mean_cache=mean_cache, options=options, q_descale=q_descale,
                        k_descale=k_descale, v_descale=v_descale, qkv_dtype=qkv_dtype, selection=sel)
    res = sparse_attention(q, k, v, index, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                           softmax_scale=softmax_scale, out=out, return_lse=return_lse, block_table=block_table,
                           seqused_k=seqused_k, stream=stream, options=options, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, qkv_dtype=qkv_dtype)
    return (res + (index,)) if isinstance(res, tuple) else (res, index)


class MeanCache(tuple):
    """The pair (k_mean, v_mean) that mean_cache() returns, which remembers the block size it was made for (a step
    with another block size raises a ValueError naming mean_cache, also when the slot counts coincide)."""

    block_size: int

    def __new__(cls, k_mean, v_mean, block_size: int):
        self = super().__new__(cls, (k_mean, v_mean))
        self.block_size = int(block_size)
        return self

    def __getnewargs__(self):
        return (self[0], self[1], self.block_size)



def mean_cache(k_cache, block_size: int = 128):
    """A pooled-means cache for a paged KV cache: the pair (k_mean, v_mean) of zeroed float32 arrays
    [mean_cache_slots, Hkv, D] in k_cache's library, on its device (a MeanCache).

    Args:
        k_cache: the paged key cache [num_pages, page_size, Hkv, D] (torch, cupy or numpy; not jax: the cache is
            written in place).
        block_size: the selection's block size (default 128); page_size and block_size must divide one another.

    Pass it to every chunked_prefill() step of the prompts that use these pages (from their first chunk on): each
    step then reads the means of the blocks earlier chunks completed and pools only the blocks its own chunk completes
    plus each sequence's tail block, instead of re-pooling the whole cache. A complete block's means live in the slot
    of the page holding its last key (page * (page_size // block_size) + offset when pages hold whole blocks), so
    pages shared between sequences (prefix caching) share their slots, and a page reused for new tokens has its slot
    rewritten by the step that completes its block. page_size and block_size must divide one another. The cache
    holds the real KV heads (Hkv), whatever head_subgroups the steps use.
    """
    if library_of(k_cache) is None:
        raise TypeError(f"k_cache: expected an array, got {type(k_cache).__name__}")
    if library_of(k_cache) == "jax":
        raise TypeError("k_cache: jax arrays are immutable; the mean cache is written in place (use torch or cupy)")
    shape = tuple(int(s) for s in k_cache.shape)
    if len(shape) != 4:
        raise ValueError(f"k_cache: expected a paged cache [num_pages, page_size, Hkv, D], got shape {shape}")
    block_size = _as_int("block_size", block_size)
    num_pages, page_size, hkv, d = shape
    if block_size <= 0 or block_size % 64 != 0:
        raise ValueError(f"block_size: must be a positive multiple of 64, got {block_size}")
    if page_size % block_size != 0 and block_size % page_size != 0:
        raise ValueError(f"block_size: page_size ({page_size}) and block_size ({block_size}) must divide one another")
    lib = ArrayLib(library_of(k_cache), k_cache)
    slots = int(_C.mean_cache_slots(num_pages, page_size, block_size))
    return MeanCache(lib.zeros((slots, hkv, d), "float32"), lib.zeros((slots, hkv, d), "float32"), block_size)


@selection_keywords
def chunked_prefill(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int, max_seqlen_k: int,
                    *, final_chunk: bool, softmax_scale: Optional[float] = None, out=None, return_lse: bool = False,
                    stream=None, mean_cache=None, workspace=None, options: Optional[LaunchOptions] = None,
                    q_descale=None, k_descale=None, v_descale=None, qkv_dtype=None,
                    selection: Optional[Selection] = None, **selection_keywords):
    """One chunked-prefill step over a paged KV cache: for each sequence b, its chunk of queries
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] (the last positions of what the cache holds: the chunk's own K/V must already
    be appended) against its whole cache of seqused_k[b] tokens, causal bottom-right, block-sparse.

    Args:
        q: [total_q, Hq, D] the chunks' queries.
        k_cache, v_cache: the paged cache [num_pages, page_size, Hkv, D].
        cu_seqlens_q: [B+1] int32 offsets of the chunks in q.
        block_table, seqused_k: [B, max_pages] page ids and [B] cache lengths (the chunk included), as in attention().
        max_seqlen_q, max_seqlen_k: bounds on the chunk and cache lengths.
        final_chunk (required): whether these chunks end their prompts. Only then do the last `last_n` query tiles
            run dense (they serve the prompt's final queries); mid-prompt chunks skip that tail. It overrides the
            final_chunk of a `selection`.
        union: one block list per (sequence, KV head), the union of its tiles' lists (CompactAttention), else
            per-tile lists (FlashPrefill V2; faster on all 36 measured steps of bench/results/chunked_h200.json,
            hence the default).
        selection: a Selection (sp.Selection(...)), the selection as one value; default: the one the keywords build.
        the selection keywords (one per field of sp.Selection but final_chunk, a parameter here): default: the
            library default (shown as <library default>); see build_index(), "Selection arguments"; as in
            sparse_prefill(), any of them passed together with `selection=` is a ValueError naming it. With
            head_subgroups > 1 the union is per (sequence, sub-group) (CompactAttention's option for large groups;
            on the topic workload at 128K it lowered the union density by a few % only,
            bench/results/chunked_subgroups_h200.json).
        mean_cache: the pair from mean_cache(k_cache, block_size), passed to every step of the prompt from its first
            chunk on: the step reads the means of the blocks before its chunk from it and writes the blocks its chunk
            completes, so selection costs O(chunk + cache / block_size) instead of re-pooling the whole cache.
        workspace: CUDA: at least chunked_prefill_workspace_bytes(...) bytes, allocated once and passed to every
            step on one stream: the step then allocates nothing, never synchronises and can be captured in a CUDA
            graph.
        softmax_scale, out, return_lse, stream, options, q_descale, k_descale, v_descale, qkv_dtype: as in
            attention().

    Checks beyond attention()'s: for host arrays, every chunk fits in its cache (chunk length <= seqused_k[b]) and
    max_seqlen_k bounds the cache lengths. Device arrays are trusted, as cu_seqlens are (reading them would
    synchronise).

    Returns:
        out, or (out, lse) when return_lse is True.
    """
    # final_chunk is the step's, whatever a Selection says (a parameter here, not a selection keyword)
    sel = _selection(selection, selection_keywords)._with_final_chunk(_as_bool("final_chunk", final_chunk))
    if block_table is None or seqused_k is None:
        raise ValueError("block_table: chunked_prefill runs over a paged KV cache; pass block_table and seqused_k")
    call = _Call(_kv_arrays(q, k_cache, v_cache, cu_seqlens_q, None, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), out, qkv_dtype=qkv_dtype)
    if not call.lib.cuda:
        cu = to_numpy(cu_seqlens_q).astype(np.int64).reshape(-1)
        used = to_numpy(seqused_k).astype(np.int64).reshape(-1)
        if cu.shape[0] == used.shape[0] + 1:
            chunk = np.diff(cu)
            short = np.nonzero(chunk > used)[0]
            if short.size:
                b = int(short[0])
                raise ValueError(f"seqused_k: sequence {b} holds {int(used[b])} tokens, fewer than its chunk of "
                                 f"{int(chunk[b])} queries (append the chunk's K/V to the cache first)")
            if used.size and int(used.max()) > _as_int("max_seqlen_k", max_seqlen_k):
                raise ValueError(f"max_seqlen_k: {int(max_seqlen_k)} is below the longest cache "
                                 f"(seqused_k has {int(used.max())})")
    return sparse_prefill(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, causal=True,
                          softmax_scale=softmax_scale, out=out, return_lse=return_lse, block_table=block_table,
                          seqused_k=seqused_k, stream=stream, mean_cache=mean_cache, workspace=workspace,
                          options=options, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          qkv_dtype=qkv_dtype, selection=sel)
