"""SGLang adapter: an extend (prefill) attention backend named "sparse_prefill".

    SGLANG_PLUGINS=sparse_prefill python -m sglang.launch_server --model-path M \\
        --prefill-attention-backend sparse_prefill --decode-attention-backend fa3 --page-size 128

The `sglang.srt.plugins` entry point `sparse_prefill` calls `register()` in every SGLang process: it registers the
backend factory in `ATTENTION_BACKENDS` and adds the name to the CLI choices once (idempotent). Settings:
`SPARSE_PREFILL_*` variables or a JSON file named by `SPARSE_PREFILL_CONFIG` (plugins cannot add CLI flags).

`SparsePrefillAttnBackend` keeps an internal FA3 backend for everything it does not run itself: decode and idle
batches, CUDA-graph hooks, sliding-window layers, softcap, attention sinks and other extras. For an extend batch
`init_forward_metadata` builds, once per step and from host metadata (`extend_seq_lens_cpu`, `seq_lens_cpu`):
`cu_seqlens_q` from `extend_seq_lens`, `seqused_k = seq_lens`, and the page table from `req_to_token` (every
page_size-th token slot // page_size); `forward_extend` writes the layer's K/V (`set_kv_buffer`), views the pool as
`[pages, page_size, Hkv, D]` and runs `VarlenDispatch` into its output buffer. Mixed chunks (decode rows of length 1
in an extend batch) are short varlen rows.

FP8 KV caches (`--kv-cache-dtype fp8_e4m3`), as SGLang's FA3 backend hands them over: the pool's float8 views, q cast
to e4m3 with no q scale (FA3 passes no q_descale; saturated at +-448 here), `layer.k_scale / v_scale` expanded to
`[B, Hkv]` as the descales (stride-0 views, read per call; None without checkpoint scales = 1). FP8 extends make the
16-bit pool's sparse / dense choice (on CUDA the block-sparse FP8 kernels: head dim 128, pages of a multiple of 64),
and FP8 layers with no CUDA FP8 kernel at all (head dim 64, pages not a multiple of 64) go to the FA3 delegate.
fp8_e5m2, fp4_e2m1 and e4m3fnuz pools raise NotImplementedError naming kv_cache_dtype. docs/integrations.md, "FP8 KV caches".

The mean cache: the backend wraps the pool's `set_kv_buffer` so that every write, including the decode backend's
(HybridAttnBackend routes decode to FA3, which writes through the same pool), updates the running means
(MeanCacheTracker). That needs `--page-size` a multiple of block_size (128 by default); with `--page-size 64` the
mean cache is off and each chunk re-pools its cache (correct, slower). HiCache / PD transfers restore pages without
`set_kv_buffer`: run them with `SPARSE_PREFILL_MEAN_CACHE=off`.

`make_backend_class(base, fa3_factory)` builds the class over any base with SGLang's interface: the contract tests
use faithful fakes of ForwardBatch, ReqToTokenPool and MHATokenToKVPool (not run inside an SGLang server).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import HEAD_DIMS
from .core import (SparsePrefillConfig, VarlenDispatch, check_kv_cache_dtype, fp8_descale,
                   fp8_kernel_reason, quantize_query, warn_once)
from .mean_cache import MeanCacheTracker

__all__ = ["register", "make_backend_class", "NAME", "ExtendMetadata", "extend_metadata"]

NAME = "sparse_prefill"

# SGLang's --kv-cache-dtype values the backend takes (fp8_e4m3 = torch.float8_e4m3fn on CUDA); fp8_e5m2, fp4_e2m1 and
# ROCm's e4m3fnuz pools are refused by name.
KV_CACHE_DTYPES_16BIT = ("auto", "bfloat16", "bf16", "float16", "fp16")
KV_CACHE_DTYPES_FP8 = ("fp8_e4m3",)


def _create(runner):
    return _sglang_class()(runner)


def register() -> None:
    """The `sglang.srt.plugins` entry point. Idempotent."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    if ATTENTION_BACKENDS.get(NAME) is not _create:
        register_attention_backend(NAME)(_create)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])


@dataclasses.dataclass
class ExtendMetadata:
    cu_seqlens_q: Any
    seqused_k: Any
    page_table: Any
    max_seqlen_q: int
    max_seqlen_k: int


def extend_metadata(forward_batch, req_to_token, page_size: int) -> ExtendMetadata:
    """The varlen arguments of an extend batch (host lists for the bounds, device ops for the tensors)."""
    import torch
    fb = forward_batch
    max_q = max(fb.extend_seq_lens_cpu)
    max_k = int(max(fb.seq_lens_cpu.tolist())) if hasattr(fb.seq_lens_cpu, "tolist") else int(max(fb.seq_lens_cpu))
    cu = torch.zeros(fb.batch_size + 1, dtype=torch.int32, device=fb.seq_lens.device)
    torch.cumsum(fb.extend_seq_lens.to(torch.int32), 0, out=cu[1:])
    pages = (max_k + page_size - 1) // page_size
    table = req_to_token[fb.req_pool_indices, : pages * page_size]
    if page_size > 1:
        table = table[:, ::page_size] // page_size
    return ExtendMetadata(cu_seqlens_q=cu, seqused_k=fb.seq_lens.to(torch.int32),
                          page_table=table.to(torch.int32).contiguous(), max_seqlen_q=int(max_q), max_seqlen_k=max_k)


_DELEGATED = ("init_cuda_graph_state", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
              "init_forward_metadata_capture_cuda_graph", "init_forward_metadata_replay_cuda_graph",
              "get_cuda_graph_seq_len_fill_value", "on_after_cuda_graph_warmup", "forward_decode")


def make_backend_class(base, fa3_factory):
    """SparsePrefillAttnBackend over `base` (SGLang's AttentionBackend or a fake); fa3_factory(runner) -> delegate."""

    class SparsePrefillAttnBackend(base):

        def __init__(self, model_runner, config: Optional[SparsePrefillConfig] = None):
            import torch
            dtype = str(getattr(model_runner, "kv_cache_dtype_str", None) or
                        getattr(getattr(model_runner, "server_args", None), "kv_cache_dtype", "auto"))
            hint = "Run with --kv-cache-dtype auto or fp8_e4m3, or with another prefill attention backend"
            self.fp8 = check_kv_cache_dtype(dtype, KV_CACHE_DTYPES_16BIT, KV_CACHE_DTYPES_FP8, hint)
            self.kv_cache_dtype_str = dtype
            pool_dtype = getattr(model_runner, "kv_cache_dtype", None)   # the torch dtype SGLang resolved
            if self.fp8 and isinstance(pool_dtype, torch.dtype) and pool_dtype != torch.float8_e4m3fn:
                raise NotImplementedError(f"sparse_prefill: kv_cache_dtype={dtype!r} resolves to a {pool_dtype} pool "
                                          "(ROCm's e4m3fnuz?); SparsePrefill reads float8_e4m3fn only. " + hint)
            self.model_runner = model_runner
            self.page_size = int(model_runner.page_size)
            self.req_to_token = model_runner.req_to_token_pool.req_to_token
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self.config = config if config is not None else SparsePrefillConfig.load()
            self.dispatch = VarlenDispatch(self.config)
            self.tracker = MeanCacheTracker(self.config.block_size, enabled=self.config.mean_cache == "auto")
            self.delegate = fa3_factory(model_runner)
            self.meta: Optional[ExtendMetadata] = None
            if self.tracker.compatible(self.page_size):
                self._wrap_pool_writes(self.token_to_kv_pool)

        # every KV write (ours, the decode backend's) goes through the pool: keep the mean caches valid
        def _wrap_pool_writes(self, pool):
            if getattr(pool, "_sparse_prefill_tracker", None) is not None:
                self.tracker = pool._sparse_prefill_tracker   # one tracker per pool (several backends, one pool)
                return
            original = pool.set_kv_buffer
            tracker, ps, fp8 = self.tracker, self.page_size, self.fp8

            def set_kv_buffer(layer, loc, cache_k, cache_v, *args, **kwargs):
                lid = kwargs.get("layer_id_override")
                lid = layer.layer_id if lid is None else lid
                k_buf, v_buf = _fp8_view(pool.get_kv_buffer(lid), fp8)
                hkv, d = k_buf.shape[-2], k_buf.shape[-1]
                loc_t = getattr(loc, "loc", loc)     # KVWriteLoc or a bare tensor
                result = []

                def write():   # the pool's own write (FP8: cache_k.div_(k_scale), then the cast)
                    result.append(original(layer, loc, cache_k, cache_v, *args, **kwargs))

                scales = {}
                if fp8:        # dequantise what the cache holds with the scales this write used
                    scales = dict(k_descale=args[0] if len(args) > 0 else kwargs.get("k_scale"),
                                  v_descale=args[1] if len(args) > 1 else kwargs.get("v_scale"))
                tracker.on_write(lid, k_buf.view(-1, ps, hkv, d), v_buf.view(-1, ps, hkv, v_buf.shape[-1]), loc_t,
                                 cache_k.view(-1, hkv, d), cache_v.view(-1, hkv, v_buf.shape[-1]), write=write,
                                 **scales)
                return result[0]

            pool.set_kv_buffer = set_kv_buffer
            pool._sparse_prefill_tracker = tracker

        def init_forward_metadata(self, forward_batch):
            self.delegate.init_forward_metadata(forward_batch)
            mode = forward_batch.forward_mode
            if mode.is_decode() or mode.is_idle() or not mode.is_extend():
                self.meta = None
                return
            self.meta = extend_metadata(forward_batch, self.req_to_token, self.page_size)

        def _unsupported(self, layer, kwargs, q=None) -> Optional[str]:
            if getattr(layer, "sliding_window_size", -1) not in (None, -1):
                return "sliding window"
            if getattr(layer, "logit_cap", 0):
                return "softcap"
            if getattr(layer, "is_cross_attention", False):
                return "cross attention"
            if layer.head_dim not in HEAD_DIMS or getattr(layer, "v_head_dim", layer.head_dim) != layer.head_dim:
                return "head dim"
            if any(kwargs.get(k) is not None for k in ("sinks", "q_rope", "k_rope", "score_mod", "rel_bias")):
                return "extra inputs"
            if self.fp8 and q is not None:
                why = fp8_kernel_reason(q, layer.head_dim, self.page_size)
                if why is not None:   # no SparsePrefill FP8 kernel for this layer: the FA3 delegate serves it
                    warn_once("sglang-fp8-fa3", f"sparse_prefill: kv_cache_dtype={self.kv_cache_dtype_str!r}: {why}; "
                              "these layers run SGLang's FA3 backend (docs/integrations.md, 'FP8 KV caches')")
                    return why
            return None

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
            if self.meta is None or self._unsupported(layer, kwargs, q) is not None:
                return self.delegate.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            if save_kv_cache and k is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale,
                                                    layer.v_scale)
            k_buf, v_buf = _fp8_view(self.token_to_kv_pool.get_kv_buffer(layer.layer_id), self.fp8)
            hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
            k_cache = k_buf.view(-1, self.page_size, hkv, d)
            v_cache = v_buf.view(-1, self.page_size, hkv, d)
            tokens = q.shape[0]
            out = q.new_empty(tokens, hq * d)
            m = self.meta
            q3 = q.reshape(tokens, hq, d)
            fp8 = {}
            if self.fp8:
                # as SGLang's FA3 backend: q cast to e4m3 without a q scale (q_descale = 1; saturated here, where a
                # bare cast can overflow), k/v descales = layer.k_scale / v_scale expanded to [B, Hkv] (stride-0
                # views; None without checkpoint scales = 1, as the pool then stores k / v unscaled)
                q3 = quantize_query(q3, None)
                b = int(m.cu_seqlens_q.shape[0]) - 1
                fp8 = dict(k_descale=fp8_descale(layer.k_scale, b, hkv, "layer.k_scale"),
                           v_descale=fp8_descale(layer.v_scale, b, hkv, "layer.v_scale"))
            self.dispatch(q3, k_cache, v_cache, m.cu_seqlens_q, None, m.max_seqlen_q,
                          m.max_seqlen_k, out=out.view(tokens, hq, d), layer_idx=layer.layer_id,
                          softmax_scale=layer.scaling, block_table=m.page_table, seqused_k=m.seqused_k,
                          mean_cache=self.tracker.get(layer.layer_id, k_cache), **fp8)
            return out

    for name in _DELEGATED:
        def make(n):
            def method(self, *args, **kwargs):
                return getattr(self.delegate, n)(*args, **kwargs)
            method.__name__ = n
            return method
        setattr(SparsePrefillAttnBackend, name, make(name))
    return SparsePrefillAttnBackend


def _fp8_view(buffers, fp8: bool):
    """The pool's (K, V) buffers as float8_e4m3fn for an FP8 cache (SGLang's get_kv_buffer already returns float8 views
    of its uint8 storage; a bare uint8 buffer is viewed here)."""
    k_buf, v_buf = buffers
    if fp8:
        import torch
        if k_buf.dtype != torch.float8_e4m3fn:
            k_buf, v_buf = k_buf.view(torch.float8_e4m3fn), v_buf.view(torch.float8_e4m3fn)
    return k_buf, v_buf


_CLASS = None


def _sglang_class():
    global _CLASS
    if _CLASS is None:
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
        from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend
        _CLASS = make_backend_class(AttentionBackend, FlashAttentionBackend)
    return _CLASS


def __getattr__(name: str):
    if name == "SparsePrefillAttnBackend":
        return _sglang_class()
    raise AttributeError(name)
