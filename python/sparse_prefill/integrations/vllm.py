"""vLLM (V1) adapter: an attention backend that sends prefill rows to SparsePrefill and decode rows to FlashAttention.

Install the package, then run `vllm serve MODEL --attention-backend CUSTOM --block-size 128` (prefix caching and
chunked prefill on, as by default). The `vllm.general_plugins` entry point `sparse_prefill` calls `register()` in
every vLLM process; `register()` maps `AttentionBackendEnum.CUSTOM` to `SparsePrefillBackend` (idempotent).
Settings: `SPARSE_PREFILL_*` variables or a JSON file named by `SPARSE_PREFILL_CONFIG` (vLLM gives plugins no CLI
flags and no backend config).

The classes subclass vLLM's FlashAttention ones and are built when first accessed (importing this module does not
import vLLM):
- `SparsePrefillBackend(FlashAttentionBackend)`: name "CUSTOM", FA's NHD cache `(2, num_blocks, block_size, Hkv, D)`,
  kernel block sizes multiple of 64, head sizes 64/128, KV cache dtypes auto/bfloat16/float16/fp8/fp8_e4m3 (fp8_e5m2
  and the others raise NotImplementedError naming kv_cache_dtype), no attention sinks, no KV connectors (the mean
  cache must see every KV write), compute capability 9.0.
- `SparsePrefillMetadataBuilder(FlashAttentionMetadataBuilder)`: decodes first (`reorder_batch_threshold = 1`), no
  cascade attention, full CUDA graphs only for pure-decode batches (which go to FA unchanged); `build()` adds a
  `sparse_plan` (the prefill rows' rebased `cu_seqlens_q`, `seqused_k`, block table and the host bounds) computed once
  per step from host metadata (`query_start_loc_cpu`, `max_seq_len`): no device read.
- `SparsePrefillImpl(FlashAttentionImpl)`: `do_kv_cache_update` runs FA's write inside the mean-cache tracker;
  `forward` runs FA on the decode rows and `VarlenDispatch` (sparse or dense) on the prefill rows, into `output`.

FP8 KV caches (`--kv-cache-dtype fp8` / `fp8_e4m3`), as FA hands them to flash_attn_varlen_func: the uint8 cache
viewed as float8_e4m3fn, q e4m3 with `layer._q_scale` (quantised by vLLM's Attention layer when the impl
supports_quant_query_input(), else here: clamp(q / _q_scale, +-448), cast), and `layer._q_scale / _k_scale /
_v_scale` expanded to `[num_prefills, Hkv]` as the descales (stride-0 views: no copy, no host sync, read per call).
FP8 prefill makes the 16-bit cache's sparse / dense choice (on CUDA the block-sparse FP8 kernels: head dim 128, pages
of a multiple of 64), and FP8 layers with no CUDA FP8 kernel at all (head dim 64) go to FlashAttention:
docs/integrations.md, "FP8 KV caches".

The engine-facing logic is in `plan_step` and the mixins, which `make_classes()` combines with any base classes that
have FlashAttention's interface: the contract tests combine them with faithful fakes (not run inside a vLLM server).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import CUDA_LIMITS, HEAD_DIMS
from .core import (SparsePrefillConfig, VarlenDispatch, check_kv_cache_dtype, fp8_descale,
                   fp8_kernel_reason, layer_index, quantize_query, warn_once)
from .mean_cache import MeanCacheTracker

__all__ = ["register", "plan_step", "SparseStepPlan", "make_classes", "engine_state", "BACKEND_PATH"]

BACKEND_PATH = "sparse_prefill.integrations.vllm.SparsePrefillBackend"

# vLLM's --kv-cache-dtype values the backend takes. "fp8" is e4m3 on CUDA (FlashAttentionBackend.
# get_fp8_dtype_for_flashattn maps "fp8" and "fp8_e4m3" to torch.float8_e4m3fn); fp8_e5m2 and the other quantised
# caches are refused by name.
KV_CACHE_DTYPES_16BIT = ("auto", "bfloat16", "float16")
KV_CACHE_DTYPES_FP8 = ("fp8", "fp8_e4m3")


def register() -> None:
    """The `vllm.general_plugins` entry point: AttentionBackendEnum.CUSTOM -> SparsePrefillBackend. Idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


class _EngineState:
    """One per process: the configuration, the dispatch and the mean caches of every layer."""

    def __init__(self, config: Optional[SparsePrefillConfig] = None):
        self.config = config if config is not None else SparsePrefillConfig.load()
        self.dispatch = VarlenDispatch(self.config)
        self.tracker = MeanCacheTracker(self.config.block_size, enabled=self.config.mean_cache == "auto")


_STATE: Optional[_EngineState] = None


def engine_state(reset: bool = False, config: Optional[SparsePrefillConfig] = None) -> _EngineState:
    global _STATE
    if _STATE is None or reset:
        _STATE = _EngineState(config)
    return _STATE


# ---------------------------------------------------------------------------------------------------------------------
# Per-step plan (metadata builder) and the per-layer calls (impl)
# ---------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SparseStepPlan:
    num_reqs: int
    num_actual_tokens: int
    num_decodes: int              # leading rows with query length <= decode_threshold (vLLM puts decodes first)
    num_decode_tokens: int
    num_prefills: int
    cu_seqlens_q: Any = None      # [num_prefills + 1] int32, rebased to the first prefill token
    seqused_k: Any = None         # [num_prefills] int32
    block_table: Any = None       # [num_prefills, max_blocks] int32
    max_seqlen_q: int = 0         # host bounds
    max_seqlen_k: int = 0
    decode_metadata: Any = None   # FA's metadata restricted to the decode rows (set by the builder)


def plan_step(query_start_loc, query_start_loc_cpu, seq_lens, block_table, num_reqs: int, num_actual_tokens: int,
              max_seq_len: int, decode_threshold: int = 1) -> SparseStepPlan:
    """Split a vLLM step into its decode rows (first) and prefill rows, from host metadata only."""
    import torch
    qsl = query_start_loc_cpu[: num_reqs + 1].tolist()   # a CPU tensor: no device synchronisation
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    nd = 0
    while nd < num_reqs and q_lens[nd] <= decode_threshold:
        nd += 1
    plan = SparseStepPlan(num_reqs=num_reqs, num_actual_tokens=int(num_actual_tokens), num_decodes=nd,
                          num_decode_tokens=int(qsl[nd]), num_prefills=num_reqs - nd)
    if plan.num_prefills:
        plan.cu_seqlens_q = (query_start_loc[nd: num_reqs + 1] - qsl[nd]).to(torch.int32)
        plan.seqused_k = seq_lens[nd:num_reqs].to(torch.int32)
        plan.block_table = block_table[nd:num_reqs]
        plan.max_seqlen_q = max(q_lens[nd:])
        plan.max_seqlen_k = int(max_seq_len)
    return plan


def _restrict(md, fields: dict):
    """A copy of the dataclass `md` with the given fields replaced (those it has)."""
    names = {f.name for f in dataclasses.fields(md)}
    return dataclasses.replace(md, **{k: v for k, v in fields.items() if k in names})


def decode_view(md, plan: SparseStepPlan, max_seq_len: int):
    """FlashAttention's metadata for the decode rows alone (the rows FA serves)."""
    nd, nt = plan.num_decodes, plan.num_decode_tokens
    return _restrict(md, dict(num_actual_tokens=nt, max_query_len=max(1, nt // max(nd, 1)),
                              query_start_loc=md.query_start_loc[: nd + 1], seq_lens=md.seq_lens[:nd],
                              block_table=md.block_table[:nd], slot_mapping=md.slot_mapping[:nt],
                              max_seq_len=max_seq_len, use_cascade=False, common_prefix_len=0,
                              cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None,
                              scheduler_metadata=None, prefix_scheduler_metadata=None, max_num_splits=0))


class BuilderMixin:
    """build() = FA's build (no cascade) + the sparse plan."""

    reorder_batch_threshold: int = 1

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        md = super().build(0, cm, fast_build)       # cascade attention off: the prefill rows are ours
        plan = plan_step(cm.query_start_loc, cm.query_start_loc_cpu, cm.seq_lens, cm.block_table_tensor, cm.num_reqs,
                         cm.num_actual_tokens, cm.max_seq_len, self.reorder_batch_threshold or 1)
        if plan.num_decodes and plan.num_prefills:
            plan.decode_metadata = decode_view(md, plan, cm.max_seq_len)
        md.sparse_plan = plan
        return md

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class ImplMixin:
    """FA for decode rows, VarlenDispatch for prefill rows; the mean-cache tracker on every KV write."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sp_fp8 = check_kv_cache_dtype(
            getattr(self, "kv_cache_dtype", "auto"), KV_CACHE_DTYPES_16BIT, KV_CACHE_DTYPES_FP8,
            hint="Run with --kv-cache-dtype auto or fp8_e4m3, or with another attention backend")
        self._sp = engine_state()

    def _sp_unsupported(self, query=None, kv_cache=None) -> Optional[str]:
        if getattr(self, "alibi_slopes", None) is not None:
            return "alibi"
        sw = getattr(self, "sliding_window", None)
        if sw is not None and tuple(sw) != (-1, -1):
            return "sliding window"
        if getattr(self, "logits_soft_cap", None):
            return "softcap"
        if getattr(self, "sinks", None) is not None:
            return "sinks"
        if getattr(self, "head_size", 128) not in HEAD_DIMS:
            return "head size"
        if self._sp_fp8 and query is not None:
            why = fp8_kernel_reason(query, int(query.shape[-1]), int(kv_cache.shape[2]))
            if why is not None:   # no SparsePrefill FP8 kernel for this layer: FlashAttention serves it
                warn_once("vllm-fp8-fa", f"sparse_prefill: kv_cache_dtype={self.kv_cache_dtype!r}: {why}; these "
                          "layers run vLLM's FlashAttention (docs/integrations.md, 'FP8 KV caches')")
                return why
        return None

    def _sp_fp8_caches(self, kv_cache):
        """K and V of the layer's cache as the library reads them: FP8 caches (uint8 storage in vLLM) as
        float8_e4m3fn views, as FlashAttention views them."""
        k_cache, v_cache = kv_cache.unbind(0)
        if self._sp_fp8:
            import torch
            k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        return k_cache, v_cache

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        # the tracker reads the old values, FA's write (reshape_and_cache_flash: for FP8, x / layer._k_scale,
        # cast) runs, and the tracker reads back what the cache now holds, dequantised with the same scales
        k_cache, v_cache = self._sp_fp8_caches(kv_cache)
        result = []

        def write():
            result.append(super(ImplMixin, self).do_kv_cache_update(layer, key, value, kv_cache, slot_mapping))

        scales = dict(k_descale=layer._k_scale, v_descale=layer._v_scale) if self._sp_fp8 else {}
        self._sp.tracker.on_write(kv_cache.data_ptr(), k_cache, v_cache, slot_mapping, key, value, write=write,
                                  **scales)
        return result[0]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None, **kwargs):
        plan = getattr(attn_metadata, "sparse_plan", None)
        if (plan is None or plan.num_prefills == 0 or output_scale is not None or output_block_scale is not None
                or self._sp_unsupported(query, kv_cache) is not None):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale, **kwargs)
        nt, na = plan.num_decode_tokens, plan.num_actual_tokens
        if plan.num_decodes:
            super().forward(layer, query[:nt], key[:nt] if key is not None else None,
                            value[:nt] if value is not None else None, kv_cache, plan.decode_metadata, output[:nt])
        k_cache, v_cache = self._sp_fp8_caches(kv_cache)
        hq, d = query.shape[-2], query.shape[-1]
        out = output[nt:na].view(na - nt, hq, d)
        q = query[nt:na]
        fp8 = {}
        if self._sp_fp8:
            # FA3's contract: q e4m3 with layer._q_scale (vLLM's Attention layer has quantised it when the impl
            # supports_quant_query_input, else this does, as FA's own forward did), descales = the layer's scales
            # expanded to [num_prefills, Hkv] (stride-0 views of the layer's tensors)
            q = quantize_query(q, layer._q_scale)
            b, hkv = plan.num_prefills, int(k_cache.shape[-2])
            fp8 = dict(q_descale=fp8_descale(layer._q_scale, b, hkv, "layer._q_scale"),
                       k_descale=fp8_descale(layer._k_scale, b, hkv, "layer._k_scale"),
                       v_descale=fp8_descale(layer._v_scale, b, hkv, "layer._v_scale"))
        self._sp.dispatch(q, k_cache, v_cache, plan.cu_seqlens_q, None, plan.max_seqlen_q,
                          plan.max_seqlen_k, out=out, layer_idx=layer_index(getattr(layer, "layer_name", None)),
                          softmax_scale=self.scale, block_table=plan.block_table, seqused_k=plan.seqused_k,
                          mean_cache=self._sp.tracker.get(kv_cache.data_ptr(), k_cache), **fp8)
        return output


def make_classes(fa_backend, fa_impl, fa_builder, cg_support=None, multiple_of=None):
    """(Backend, Impl, Builder) over FlashAttention-like base classes (vLLM's, or the tests' fakes)."""

    class SparsePrefillMetadataBuilder(BuilderMixin, fa_builder):
        pass

    if cg_support is not None:
        SparsePrefillMetadataBuilder._cudagraph_support = cg_support
        SparsePrefillMetadataBuilder.cudagraph_support = cg_support

    class SparsePrefillImpl(ImplMixin, fa_impl):
        pass

    class SparsePrefillBackend(fa_backend):
        supported_kv_cache_dtypes = list(KV_CACHE_DTYPES_16BIT + KV_CACHE_DTYPES_FP8)
        forward_includes_kv_cache_update = False
        accept_output_buffer = True

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"     # registered as AttentionBackendEnum.CUSTOM

        @staticmethod
        def get_impl_cls():
            return SparsePrefillImpl

        @staticmethod
        def get_builder_cls():
            return SparsePrefillMetadataBuilder

        @staticmethod
        def get_supported_kernel_block_sizes():
            m = CUDA_LIMITS.page_multiple   # the sparse kernels' page rule (sp.CUDA_LIMITS)
            return [multiple_of(m)] if multiple_of is not None else [m, 2 * m, 4 * m]

        @classmethod
        def get_supported_head_sizes(cls):
            return list(HEAD_DIMS)

        @classmethod
        def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
            if kv_cache_dtype is None:
                return True
            if kv_cache_dtype not in cls.supported_kv_cache_dtypes:
                return False                  # fp8_e5m2, fp8_inc, nvfp4, ...: refused by name
            base = getattr(super(), "supports_kv_cache_dtype", None)   # FA's: FP8 only where FA has it
            return True if base is None else bool(base(kv_cache_dtype))

        @classmethod
        def supports_sink(cls) -> bool:
            return False

        @classmethod
        def supports_kv_connector(cls) -> bool:
            return False     # the mean cache must see every KV write (docs/integrations.md)

        @classmethod
        def supports_compute_capability(cls, capability) -> bool:
            major = getattr(capability, "major", None)
            if major is None:
                major = capability[0]
            return major == 9

    return SparsePrefillBackend, SparsePrefillImpl, SparsePrefillMetadataBuilder


_CLASSES = None


def _vllm_classes():
    global _CLASSES
    if _CLASSES is None:
        from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                           FlashAttentionMetadataBuilder)
        cg = multiple_of = None
        try:
            from vllm.v1.attention.backend import AttentionCGSupport, MultipleOf
            cg, multiple_of = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, MultipleOf
        except ImportError:
            try:
                from vllm.v1.attention.backends.utils import AttentionCGSupport
                cg = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
            except ImportError:
                pass
        _CLASSES = make_classes(FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder, cg,
                                multiple_of)
    return _CLASSES


def __getattr__(name: str):
    index = {"SparsePrefillBackend": 0, "SparsePrefillImpl": 1, "SparsePrefillMetadataBuilder": 2}
    if name in index:
        return _vllm_classes()[index[name]]
    raise AttributeError(name)
