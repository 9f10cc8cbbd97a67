"""The pooled-means cache of an engine's paged KV cache, kept valid by every write to the cache (`MeanCacheTracker`).

Split from `core.py` (the configuration and the varlen dispatch); the adapters route their engine's KV-cache writes
through `MeanCacheTracker.on_write` and pass `MeanCacheTracker.get` to `VarlenDispatch` (docs/integrations.md).
"""

from __future__ import annotations

import sparse_prefill as sp

__all__ = ["MeanCacheTracker"]


class MeanCacheTracker:
    """Per-layer pooled-means caches (`sp.mean_cache` layout) of an engine's paged KV cache, kept valid by every
    write to the cache, whoever makes it.

    The hazard: `sp.chunked_prefill(mean_cache=...)` reads the means of the blocks that end before its chunk from the
    cache and pools only the blocks its chunk completes. Blocks completed by decode steps, pages restored by prefix
    caching after another request's decode, and tokens an engine writes twice (vLLM recomputes the last token of a
    fully cached prompt; rejected speculative tokens are overwritten) would otherwise leave stale means there.

    The fix: every KV write updates a running mean. For each block slot the tracker keeps the sum of its written keys
    and values divided by block_size and the count n of positions written so far in the block's current use. A token
    written at position p of its block (p = slot % block_size; pages hold whole blocks) starts a new use when p == 0
    (sum and count reset), adds its key when p >= n, and replaces its old key (read from the cache before the write)
    when p < n. A complete block's entry is therefore the exact mean of what the cache holds, the value the library
    would pool, written or not by the library itself. All of it is a few fixed-shape device ops per write (O(tokens)),
    no host synchronisation, so it works inside CUDA graphs (padded slots < 0 go to a spare row).

    Requires page_size % block_size == 0 (then the mean slot of a token is slot // block_size, which needs no block
    table); with other page sizes `get()` returns None and the library re-pools every chunk. Writes that bypass the
    engine's KV write (KV connectors, host offload: LMCache, HiCache, PD transfer) are not seen: disable the mean
    cache there (`mean_cache='off'`).
    """

    def __init__(self, block_size: int, enabled: bool = True):
        self.block_size = int(block_size)
        self.enabled = bool(enabled)
        self._caches: dict = {}

    def compatible(self, page_size: int) -> bool:
        return self.enabled and page_size % self.block_size == 0

    def _state(self, key, k_cache):
        st = self._caches.get(key)
        if st is None:
            import torch
            num_pages, page_size, hkv, d = (int(s) for s in k_cache.shape)
            slots = int(sp._C.mean_cache_slots(num_pages, page_size, self.block_size))
            assert slots == num_pages * page_size // self.block_size
            z = dict(dtype=torch.float32, device=k_cache.device)
            st = {"k": torch.zeros(slots + 1, hkv, d, **z), "v": torch.zeros(slots + 1, hkv, d, **z),
                  "n": torch.zeros(slots + 1, dtype=torch.int32, device=k_cache.device), "slots": slots}
            self._caches[key] = st
        return st

    def get(self, key, k_cache):
        """(k_mean, v_mean) for `sp.chunked_prefill(mean_cache=...)` of the layer `key`, or None (disabled, or pages
        that do not hold whole blocks). Allocated on first use: 2 x float32 [slots, Hkv, D] = 1/(2 block_size/4) of a
        bf16 KV cache's bytes (1/64 at block 128)."""
        if not self.compatible(int(k_cache.shape[1])):
            return None
        st = self._state(key, k_cache)
        s = st["slots"]
        return st["k"][:s], st["v"][:s]

    def on_write(self, key, k_cache, v_cache, loc, new_k, new_v, *, write=None, k_descale=None,
                 v_descale=None) -> None:
        """Account for the engine writing new_k/new_v [T, Hkv, D] at token slots `loc` [T] (< 0: padding) of the layer
        `key` whose paged caches are k_cache/v_cache [num_pages, page_size, Hkv, D].

        Without `write`: call it BEFORE the engine's write; the new values are new_k/new_v (16-bit caches store them
        as given). With `write` (a callable doing the engine's write): it reads the old values, calls write(), then
        takes the new values from what the cache holds at `loc` — what an FP8 cache stores is the engine's own
        quantisation of new_k/new_v (vLLM: reshape_and_cache_flash; SGLang: an in-place divide and a cast), which
        this reads instead of re-deriving. k_descale/v_descale (None = 1; a number, or a float32 tensor of one
        element or one per KV head: the engine's k/v scale) turn stored values into the dequantised values the
        library pools (stored x descale, docs/semantics.md "FP8 inputs"), so the means of an FP8 cache are those of
        its dequantised contents. The scales must stay fixed once a block is written (checkpoint scales, or vLLM's
        calculate_kv_scales, which fixes them at the first forward)."""
        if not self.compatible(int(k_cache.shape[1])):
            if write is not None:
                write()
            return
        import torch
        st = self._state(key, k_cache)
        bs, trash = self.block_size, st["slots"]
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        t = min(int(loc.numel()), int(new_k.shape[0]))   # shapes only: engines pad one or the other
        loc = loc.reshape(-1)[:t].long()
        valid = loc >= 0
        locc = loc.clamp(min=0)
        p = locc % bs
        ms = torch.where(valid, locc // bs, torch.full_like(locc, trash))
        kflat = k_cache.view(-1, hkv, d)
        vflat = v_cache.view(-1, hkv, d)
        old_k = _dequantised(kflat.index_select(0, locc), k_descale)
        old_v = _dequantised(vflat.index_select(0, locc), v_descale)
        if write is None:
            new_k = _dequantised(new_k[:t].reshape(-1, hkv, d), k_descale)
            new_v = _dequantised(new_v[:t].reshape(-1, hkv, d), v_descale)
        else:
            write()
            new_k = _dequantised(kflat.index_select(0, locc), k_descale)
            new_v = _dequantised(vflat.index_select(0, locc), v_descale)
        n_old = st["n"].index_select(0, ms)
        start = valid & (p == 0)
        zero_idx = torch.where(start, ms, torch.full_like(ms, trash))
        reset = torch.zeros(trash + 1, dtype=torch.bool, device=loc.device)
        reset.index_fill_(0, zero_idx, True)
        replaced = valid & (p < n_old) & ~reset.index_select(0, ms)
        for name in ("k", "v", "n"):
            st[name].index_fill_(0, zero_idx, 0)
        w = replaced[:, None, None]
        inv = 1.0 / bs
        st["k"].index_add_(0, ms, (new_k - torch.where(w, old_k, 0.0)) * inv)
        st["v"].index_add_(0, ms, (new_v - torch.where(w, old_v, 0.0)) * inv)
        st["n"].scatter_reduce_(0, ms, (p + 1).to(torch.int32), reduce="amax")
        # the spare row collects padding and resets: keep it harmless
        st["n"][trash] = 0


def _dequantised(x, descale):
    """float32 values of cache rows x [T, Hkv, D] times the engine's scale (None = 1; a number; a float32 tensor of
    one element or one per KV head), as the library dequantises FP8 values (one float32 product per value)."""
    x = x.float()
    if descale is None:
        return x
    if isinstance(descale, (int, float)):
        return x * float(descale)
    return x * descale.reshape(-1, 1)
