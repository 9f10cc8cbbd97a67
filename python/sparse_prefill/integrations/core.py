"""The engine-agnostic core of the adapters: one configuration and one varlen dispatch (the mean cache: mean_cache.py).

Everything here needs torch (imported lazily, on first use); nothing imports an engine. The three adapters
(`transformers.py`, `vllm.py`, `sglang.py`) translate their engine's metadata into the arguments of
`VarlenDispatch.__call__` and route their engine's KV-cache writes through `MeanCacheTracker.on_write`
(`mean_cache.py`). For FP8 KV caches, `check_kv_cache_dtype`, `fp8_descale`, `quantize_query` and
`fp8_kernel_reason` are the shared pieces (docs/integrations.md, "FP8 KV caches").

Configuration sources, strongest first: keyword arguments, `SPARSE_PREFILL_<FIELD>` environment variables (e.g.
`SPARSE_PREFILL_ALPHA=0.05`), the JSON file named by `config_file=` or `SPARSE_PREFILL_CONFIG`, and the library's own
defaults. The selection defaults (SELECTION_FIELDS: the library's fields but final_chunk and max_kept_blocks) are the
library's (library_selection_defaults(): sp.SELECTION_DEFAULTS), so the adapters follow the library when its defaults
change; nothing here keeps a second copy of them. Per-layer settings (`layers`: a layer index -> selection overrides,
or dense) come from the file or keyword arguments only; `python -m sparse_prefill.calibrate` writes them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Any, Optional

import sparse_prefill as sp

__all__ = ["SparsePrefillConfig", "library_selection_defaults", "VarlenDispatch", "layer_index",
           "check_kv_cache_dtype", "fp8_descale", "quantize_query", "fp8_kernel_reason", "FP8_MAX"]

# The selection parameters the adapters pass through to the library: the library's fields (sp.Selection's, read
# from the C++ list), but final_chunk (the engine's own setting below: engines do not say whether a chunk ends
# its prompt) and max_kept_blocks (the adapters size their workspaces by the causal bound). SparsePrefillConfig's
# dataclass fields for them are generated from this list (_with_selection_fields), typed by their library defaults.
SELECTION_FIELDS = tuple(n for n in sp.Selection().as_dict() if n not in ("final_chunk", "max_kept_blocks"))
# The adapters warn (once) when a sparse call's keys exceed this many times the longest length a calibrated file was
# validated at (`validated_lengths`): the selections keep a smaller share of the blocks as prompts grow, so accuracy
# measured at L says less the further past L a prompt goes; 2x is the next length a calibration would measure (lengths
# usually double: 8K, 16K, 32K), beyond it nothing was measured.
LONG_PROMPT_FACTOR = 2.0
# What one entry of `layers` may set: the selection, except block_size (one per model: the mean cache and the
# workspaces are sized by it), and `dense` (the layer always runs dense attention).
LAYER_FIELDS = tuple(f for f in SELECTION_FIELDS if f != "block_size") + ("dense",)


def library_selection_defaults() -> dict:
    """The library's default selection: sp.SELECTION_DEFAULTS (from the C++ SelectionParams{}), and sp.Selection()'s
    fields for the per-call one that table does not hold (union). Not sp.sparse_prefill's signature: its selection
    keywords default to a sentinel, <library default>, so that a keyword passed beside selection= is told from one
    left out."""
    sel = sp.Selection()
    return {name: sp.SELECTION_DEFAULTS.get(name, getattr(sel, name)) for name in SELECTION_FIELDS}


def _env_name(field: str) -> str:
    return "SPARSE_PREFILL_" + field.upper()


_FINAL_CHUNK = ("always", "never")
_MEAN_CACHE = ("auto", "off")
_FALLBACK = ("sdpa", "raise")


def _with_selection_fields(cls):
    """cls as a dataclass whose first fields are SELECTION_FIELDS, each None by default (__post_init__: the library's
    default), before the fields cls declares: the selection's fields are declared once, in the library."""
    cls.__annotations__ = {**{name: f"Optional[{type(default).__name__}]"
                              for name, default in library_selection_defaults().items()}, **cls.__annotations__}
    for name in SELECTION_FIELDS:
        setattr(cls, name, None)
    return dataclasses.dataclass(cls)


@_with_selection_fields
class SparsePrefillConfig:
    """What the adapters run. The selection fields (SELECTION_FIELDS: sp.Selection's, but final_chunk and
    max_kept_blocks; generated from the library's list) mean what sparse_prefill.build_index()'s "Selection arguments"
    say and default to the library's defaults (library_selection_defaults(): sp.SELECTION_DEFAULTS); the engine
    fields:

    dense_layers: the first N layers always run dense attention (accuracy: early layers attend broadly).
    min_sparse_q_len: a call runs sparse only when its longest query row (chunk) has at least this many tokens;
        shorter calls (decode, short chunks) run dense.
    min_sparse_kv_len: ... and when its longest key row has at least this many tokens (below ~8K dense is as fast:
        bench/results/sparse_h200.json, topic workload 8K = 1.0x cuDNN).
    final_chunk: engines do not say whether a prefill chunk ends its prompt. 'always' treats every chunk as final
        (its last `last_n` query tiles run dense: FlashPrefill V2's behaviour, the safe choice for the prompt's last
        tokens); 'never' treats every chunk as mid-prompt (cheaper, but the prompt's final queries are then selected
        sparsely too).
    mean_cache: 'auto' keeps a pooled-means cache per layer beside a paged KV cache whose page size is a multiple of
        block_size (MeanCacheTracker: valid through decode writes, prefix hits and rewrites); 'off' re-pools the whole
        cache at every chunk (always correct, O(cache) per step).
    fallback: what the transformers adapter does with calls the kernels do not support (head dim other than 64/128,
        float32 on CUDA, dropout, softcap, attention sinks): 'sdpa' runs transformers' sdpa with a one-time warning,
        'raise' raises NotImplementedError.
    layers: per-layer settings, {layer index: {selection field: value, ...}} (JSON: {"3": {"alpha": 0.01}}), or
        {layer index: {"dense": true}} for a layer that always runs dense attention. An entry overrides the top-level
        selection for that layer (LAYER_FIELDS: the selection fields but block_size, one value for the whole model);
        layers without an entry use the top level. Layers below dense_layers run dense whatever their entry says. A call
        whose layer index the engine does not give runs dense when `layers` is set. Written by `python -m
        sparse_prefill.calibrate`; not read from SPARSE_PREFILL_* variables.
    validated_lengths: the prompt lengths the settings were measured at (JSON [8192, 32768]; written by
        `python -m sparse_prefill.calibrate`, file or keyword only). A sparse call whose keys exceed
        LONG_PROMPT_FACTOR (2) times the longest of them warns once (RuntimeWarning): the settings were not validated
        there. None (files written before the field): no warning.
    """

    dense_layers: int = 0
    min_sparse_q_len: int = 128
    min_sparse_kv_len: int = 8192
    final_chunk: str = "always"
    mean_cache: str = "auto"
    fallback: str = "sdpa"
    layers: Optional[dict] = None
    validated_lengths: Optional[list] = None

    def __post_init__(self):
        for name, default in library_selection_defaults().items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.layers = _layer_settings(self.layers)
        self.validated_lengths = _validated_lengths(self.validated_lengths)
        self._check()

    # -- loading ------------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, config_file: Optional[str] = None, environ: Optional[dict] = None, **kwargs) -> "SparsePrefillConfig":
        """The adapters' settings, each from the first place that sets it: kwargs > SPARSE_PREFILL_<FIELD> variables
        > JSON file (config_file or $SPARSE_PREFILL_CONFIG) > library defaults. Engines start the adapters in their
        own processes, so their settings travel as variables or a file (docs/integrations.md).

        Args:
            config_file: a JSON object of settings (field -> value); default $SPARSE_PREFILL_CONFIG, if set.
            environ: the variables to read (default os.environ).
            **kwargs: settings by field name (the fields of SparsePrefillConfig); an unknown name is a TypeError.
        """
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        path = config_file if config_file is not None else env.get("SPARSE_PREFILL_CONFIG")
        if path:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError(f"SPARSE_PREFILL_CONFIG: {path} must hold a JSON object, got {type(data).__name__}")
            for key, value in data.items():
                if key not in fields:
                    raise ValueError(f"{key}: unknown sparse_prefill setting in {path} (known: {', '.join(fields)})")
                values[key] = value if key in _NOT_SCALAR else _coerce(key, value, key)
        for name, f in fields.items():
            if name in _NOT_SCALAR:
                continue          # a mapping or a list: from the file or keyword arguments only
            raw = env.get(_env_name(name))
            if raw is not None and raw != "":
                values[name] = _coerce(_env_name(name), raw, name)
        for key, value in kwargs.items():
            if key not in fields:
                raise TypeError(f"{key}: unknown sparse_prefill setting (known: {', '.join(fields)})")
            values[key] = value
        return cls(**values)

    def _check(self):
        if self.final_chunk not in _FINAL_CHUNK:
            raise ValueError(f"final_chunk: expected one of {_FINAL_CHUNK}, got {self.final_chunk!r}")
        if self.mean_cache not in _MEAN_CACHE:
            raise ValueError(f"mean_cache: expected one of {_MEAN_CACHE}, got {self.mean_cache!r}")
        if self.fallback not in _FALLBACK:
            raise ValueError(f"fallback: expected one of {_FALLBACK}, got {self.fallback!r}")
        for name in ("dense_layers", "min_sparse_q_len", "min_sparse_kv_len"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in SELECTION_FIELDS:
            _check_selection_value(name, name, getattr(self, name))

    def layer_dense(self, layer_idx: Optional[int]) -> bool:
        """Whether layer `layer_idx` always runs dense attention (below dense_layers, or `"dense": true` in layers)."""
        if layer_idx is None:
            return False
        return layer_idx < self.dense_layers or bool(self.layers.get(layer_idx, {}).get("dense", False))

    def selection(self, layer_idx: Optional[int] = None) -> dict:
        """The selection keywords of a sparse call (sp.sparse_prefill's / sp.chunked_prefill's, which the torch
        operators' wrappers the dispatch calls take too): the top level, with the entry of `layers` for layer_idx
        applied (None: the top level alone)."""
        sel = {name: getattr(self, name) for name in SELECTION_FIELDS}
        if layer_idx is not None:
            sel.update((k, v) for k, v in self.layers.get(layer_idx, {}).items() if k != "dense")
        return sel

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def file_dict(self) -> dict:
        """The settings that differ from a default configuration, as the JSON object `SPARSE_PREFILL_CONFIG` reads
        (layer indices as strings)."""
        default = type(self)()
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "layers":
                if value:
                    out["layers"] = {str(i): dict(value[i]) for i in sorted(value)}
            elif value != getattr(default, f.name):
                out[f.name] = value
        return out

    def save(self, path: str) -> None:
        """Write file_dict() as JSON to `path` (what `config_file=` / SPARSE_PREFILL_CONFIG load)."""
        with open(path, "w") as f:
            json.dump(self.file_dict(), f, indent=1)
            f.write("\n")


_NOT_SCALAR = ("layers", "validated_lengths")
# A setting's type: the selection fields' from their library defaults, the engine fields' here (int when absent).
_KINDS = {**{name: type(default) for name, default in library_selection_defaults().items()},
          "dense": bool, "final_chunk": str, "mean_cache": str, "fallback": str}


def _coerce(name: str, value: Any, field: str) -> Any:
    """`value` as the type of setting `field`; errors name `name` (the setting, its variable or its place in
    layers)."""
    kind = _KINDS.get(field, int)
    if kind is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean (1/0/true/false), got {value!r}")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from None


def _check_selection_value(name: str, field: str, value: Any) -> None:
    """A selection setting's range, as the library checks it (sp.Selection with that one field: its shape-free checks
    are the C++ check_selection_params'), so that a bad setting fails when the configuration loads, not at the first
    sparse call; the ValueError names the setting as the configuration does (`name`, e.g. layers.3.alpha). Fields
    that are not the selection's (a layer's `dense`) pass."""
    if field not in SELECTION_FIELDS:
        return
    try:
        sp.Selection(**{field: value})
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ValueError(name + msg[len(field):] if msg.startswith(field + ":") else f"{name}: {msg}") from None


def _layer_settings(layers: Any) -> dict:
    """`layers` as {int layer index: {field: value}}, validated; errors name the entry (layers.3.alpha)."""
    if layers is None:
        return {}
    if not isinstance(layers, dict):
        raise ValueError(f"layers: expected a mapping from layer index to settings, got {type(layers).__name__}")
    out = {}
    for key, entry in layers.items():
        i = int(key) if isinstance(key, int) or (isinstance(key, str) and key.strip().isdigit()) else None
        if i is None or isinstance(key, bool) or i < 0:
            raise ValueError(f"layers: key {key!r} is not a layer index (an integer >= 0)")
        if i in out:
            raise ValueError(f"layers: layer {i} is given twice")
        if not isinstance(entry, dict):
            raise ValueError(f"layers.{i}: expected an object of selection settings or {{\"dense\": true}}, got "
                             f"{entry!r}")
        settings = {}
        for field, value in entry.items():
            name = f"layers.{i}.{field}"
            if field == "block_size":
                raise ValueError(f"{name}: block_size is one value for the whole model (the mean cache and the "
                                 "workspaces are sized by it); set it at the top level")
            if field not in LAYER_FIELDS:
                raise ValueError(f"{name}: unknown per-layer setting (known: {', '.join(LAYER_FIELDS)})")
            settings[field] = _coerce(name, value, field)
            _check_selection_value(name, field, settings[field])
        out[i] = settings
    return out


def _validated_lengths(lengths: Any) -> Optional[list]:
    """`validated_lengths` as an ascending list of ints, validated; None stays None (a file without the field)."""
    if lengths is None:
        return None
    if (not isinstance(lengths, (list, tuple)) or not lengths
            or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lengths)):
        raise ValueError(f"validated_lengths: expected a non-empty list of prompt lengths (integers > 0), got "
                         f"{lengths!r}")
    return sorted(set(lengths))


def layer_index(name: Any) -> Optional[int]:
    """The layer number in an engine's layer name ('model.layers.3.self_attn.attn' -> 3), or an int passed through."""
    if isinstance(name, int):
        return name
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", str(name))
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------------------------------
# FP8 KV caches
# ---------------------------------------------------------------------------------------------------------------------

FP8_MAX = 448.0   # largest finite float8_e4m3fn


def _on_cuda(t) -> bool:
    """Whether `t` lives on a CUDA device: the one place the adapters ask it for kernel choices (the contract tests
    replace it to replay the CUDA decisions on the CPU, where the library computes every configuration)."""
    return bool(t.is_cuda)


def check_kv_cache_dtype(kv_cache_dtype, accepted_16bit, accepted_fp8, hint: str = "") -> bool:
    """The engine's KV cache dtype string: False for a 16-bit cache, True for an FP8 e4m3 one; anything else (fp8_e5m2,
    other quantised caches) raises NotImplementedError naming kv_cache_dtype and what is supported."""
    value = str(kv_cache_dtype)
    if value in accepted_16bit:
        return False
    if value in accepted_fp8:
        return True
    why = ""
    if "e5m2" in value:
        why = " (SparsePrefill's FP8 path reads float8_e4m3fn only: e5m2 caches have no kernel and no CPU reference)"
    raise NotImplementedError(
        f"sparse_prefill: kv_cache_dtype={value!r} is not supported{why}; supported: "
        f"{', '.join(map(repr, tuple(accepted_16bit) + tuple(accepted_fp8)))}" + (f". {hint}" if hint else ""))


def fp8_descale(scale, batch: int, num_kv_heads: int, name: str = "scale"):
    """An engine's per-layer scale as the library's [B, Hkv] descale: a float32 tensor of one element (vLLM's
    `layer._k_scale`, SGLang's `layer.k_scale`: 0-d) or of Hkv elements (vLLM's per-head scales) becomes
    `scale.reshape(-1).expand(batch, num_kv_heads)`, a stride-0 view of the engine's own tensor: no copy, no
    allocation, no host synchronisation, and the value the engine holds at call time (scales loaded or updated in
    place after the backend was built are seen). None (SGLang without checkpoint scales) stays None, i.e. 1."""
    if scale is None:
        return None
    import torch
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: expected a float32 tensor (the engine's per-layer scale) or None, got "
                        f"{type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32, got {scale.dtype}")
    if scale.numel() not in (1, num_kv_heads):
        raise ValueError(f"{name}: expected one scale per layer or one per KV head ({num_kv_heads}), got shape "
                         f"{tuple(scale.shape)}")
    return scale.reshape(-1).expand(int(batch), int(num_kv_heads))


def quantize_query(q, q_scale=None):
    """q [T, Hq, D] as float8_e4m3fn for an FP8 KV cache, the way the engines' FA3 paths hand it to the kernel:
    q already float8_e4m3fn (vLLM's Attention layer quantised it with QuantFP8 and `_q_scale`) passes through;
    otherwise `clamp(q / q_scale, -448, 448)` in float32, cast (round to nearest even). q_scale: a float32 tensor of
    one element or one per KV head (query head h uses element h // (Hq / n)), or None = 1 (SGLang's FA3 casts q with
    no scale). The clamp makes out-of-range queries saturate instead of becoming NaN."""
    import torch
    if q.dtype == torch.float8_e4m3fn:
        return q
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q: expected float8_e4m3fn, bfloat16, float16 or float32 for an FP8 KV cache, got {q.dtype}")
    if q_scale is None:
        return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    t, hq, d = q.shape
    s = q_scale.reshape(-1)
    n = s.numel()
    if n == 1:
        x = q.float() / s
    elif hq % n == 0:
        x = (q.float().reshape(t, n, hq // n, d) / s.view(1, n, 1, 1)).reshape(t, hq, d)
    else:
        raise ValueError(f"q_scale: expected one scale or one per KV head, got {n} for {hq} query heads")
    return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_kernel_reason(q, head_dim: int, page_size: Optional[int] = None) -> Optional[str]:
    """None when the library has an FP8 attention kernel for a call on q's device (the CPU backend computes every
    configuration), else why not: on CUDA the backend's own answer (sp.fp8_attention_support, src/cuda/support.cpp:
    today head dim 128, contiguous KV or pages of a multiple of 64 tokens). The adapters hand such calls to the
    engine's own FlashAttention, which serves every FP8 configuration."""
    if not _on_cuda(q):
        return None
    return sp.fp8_attention_support(head_dim, page_size)


# ---------------------------------------------------------------------------------------------------------------------
# The varlen dispatch
# ---------------------------------------------------------------------------------------------------------------------

spt = None  # sparse_prefill.torch_ops once _ops() imported it (the contract tests replace it with a spy)


def _ops():
    """sparse_prefill.torch_ops, the adapters' one path into the library's compute: the torch operators (imported on
    first use: it imports torch and registers torch.ops.sparse_prefill.*, which building a configuration needs not)."""
    global spt
    if spt is None:
        from .. import torch_ops
        spt = torch_ops
    return spt


def _padded_head_dim(d: int) -> int:
    """The head dim a CUDA sparse call of head dim d runs at: d where the sparse kernels take it, else the smallest
    larger one they take (the adapters zero-pad to it), else d (the library's answer then says why not)."""
    dims = sp.CUDA_LIMITS.sparse_head_dims
    return d if d in dims else min((h for h in dims if h > d), default=d)


class VarlenDispatch:
    """One attention call of an engine: picks sparse or dense, writes `out` in place, allocates only from torch's
    caching allocator, never synchronises the host (the lengths it needs come as host ints: max_seqlen_q /
    max_seqlen_k).

    Sparse runs when: the layer is not dense (layer_idx >= dense_layers and no `"dense": true` in `layers`),
    max_seqlen_q >= min_sparse_q_len, max_seqlen_k >= min_sparse_kv_len, causal, no sliding window and no softcap
    (`sparse_reason`), and (CUDA) the library's kernels take the call: `sp.sparse_support` on the arrays it would get
    (today head dim 128, bf16/fp16/float8_e4m3fn, block_size % 128 == 0, pages of a multiple of 64 tokens:
    sp.CUDA_LIMITS; contiguous 16-bit inputs of another head dim are zero-padded to the next sparse head dim first: the
    transformers adapter's calls). The reason, either kind, is `last_reason`. Everything else runs dense attention (any
    page size, windows, decode rows). A sparse call's selection is `config.selection(layer_idx)`: the top level with the
    layer's entry of `layers` applied. A sparse call whose max_seqlen_k exceeds LONG_PROMPT_FACTOR times the longest of
    `config.validated_lengths` warns once per process (dense calls run no calibrated setting, so they never warn).

    FP8 (an e4m3 KV cache): q, k, v float8_e4m3fn with the [B, Hkv] descales (`fp8_descale`, `quantize_query`),
    passed to whichever function runs; the output is bfloat16 (into `out` directly when it is bfloat16, else through
    one bfloat16 temporary copied into it). FP8 makes the same sparse / dense choice as a 16-bit cache, on the CPU
    and on CUDA (the block-sparse FP8 kernels: head dim 128, pages of a multiple of 64, as for 16 bits).
    FP8 configurations without any CUDA kernel (head dim 64, pages of other sizes) never reach the dispatch: the
    adapters give them to the engine's FlashAttention (`fp8_kernel_reason`).

    The calls run through the torch operators (sparse_prefill.torch_ops: torch.ops.sparse_prefill.attention_out,
    sparse_prefill_out, chunked_prefill_out, into `out`), so an adapter's step is what an engine capturing or compiling
    it sees, and its scratch memory follows the operators' workspace rule: a torch.empty from torch's caching allocator
    per call, sized by the shape-only *_workspace_bytes functions (sizes cached per shape in torch_ops), which a
    torch.cuda.CUDAGraph capture takes from the graph's pool; the dispatch keeps no buffer of its own.
    """

    def __init__(self, config: Optional[SparsePrefillConfig] = None):
        self.config = config if config is not None else SparsePrefillConfig.load()
        self._support: dict = {}
        self.calls = {"sparse": 0, "dense": 0}
        self.last_path: Optional[str] = None
        self.last_reason: Optional[str] = None

    # -- the decision ------------------------------------------------------------------------------------------------
    def sparse_reason(self, q, k, max_seqlen_q: int, max_seqlen_k: int, *, layer_idx: Optional[int] = 0,
                      paged: bool = False, window=(-1, -1), softcap: float = 0.0, causal: bool = True) -> Optional[str]:
        """None when the configuration sends the call to sparse, else why it runs dense (for logs and tests; reads
        shapes only): the layer, the lengths, causal, the window, the softcap. What the device's kernels take is the
        library's question (sp.sparse_support, asked by __call__ on the arrays it would pass): not restated here."""
        c = self.config
        if not causal:
            return "not causal"
        if layer_idx is None:
            if c.dense_layers:
                return "unknown layer index with dense_layers set"
            if c.layers:
                return "unknown layer index with per-layer settings (layers)"
        elif layer_idx < c.dense_layers:
            return f"layer {layer_idx} < dense_layers {c.dense_layers}"
        elif c.layer_dense(layer_idx):
            return f"layer {layer_idx} is dense in layers"
        if max_seqlen_q < max(c.min_sparse_q_len, 1):
            return f"max_seqlen_q {max_seqlen_q} < min_sparse_q_len {c.min_sparse_q_len}"
        if max_seqlen_k < c.min_sparse_kv_len:
            return f"max_seqlen_k {max_seqlen_k} < min_sparse_kv_len {c.min_sparse_kv_len}"
        if tuple(window) != (-1, -1):
            return "sliding window"
        if softcap:
            return "softcap"
        return None

    def _backend_reason(self, q, k, v, cu_q, cu_k, max_q, max_k, block_table, seqused_k, softmax_scale, descales,
                        sel) -> Optional[str]:
        """sp.sparse_support on the arrays the sparse call would get, cached per shapes, strides, dtypes, 16-byte
        alignment and selection (an engine's layers repeat them; a call costs a few microseconds)."""
        key = (q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.stride(), cu_q.shape,
               (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15, block_table is None, tuple(sorted(sel.items())))
        if key in self._support:
            return self._support[key]
        why = sp.sparse_support(q, k, v, cu_q, cu_k, max_q, max_k, block_table=block_table, seqused_k=seqused_k,
                                softmax_scale=softmax_scale, **descales, **sel)
        if len(self._support) > 256:
            self._support.clear()
        self._support[key] = why
        return why

    # -- the call ----------------------------------------------------------------------------------------------------
    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *, out,
                 layer_idx: Optional[int] = 0, softmax_scale: Optional[float] = None, block_table=None,
                 seqused_k=None, window=(-1, -1), softcap: float = 0.0, mean_cache=None,
                 final_chunk: Optional[bool] = None, causal: bool = True, force_dense: bool = False,
                 q_descale=None, k_descale=None, v_descale=None):
        """Attention of q [total_q, Hq, D] over k/v (contiguous with cu_seqlens_k, or paged with block_table and
        seqused_k), written into `out` [total_q, Hq, D]; returns `out`. max_seqlen_q/k are host ints (bounds).
        FP8: q, k, v float8_e4m3fn and q/k/v_descale [B, Hkv] (any strides; None = 1)."""
        import torch
        max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
        paged = block_table is not None
        reason = "forced dense" if force_dense else self.sparse_reason(
            q, k, max_q, max_k, layer_idx=layer_idx, paged=paged, window=window, softcap=softcap, causal=causal)
        fp8 = q.dtype == torch.float8_e4m3fn
        descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale) if fp8 else {}
        d, c, on_cuda = q.shape[-1], self.config, _on_cuda(q)
        if reason is None:
            sel = c.selection(layer_idx)
            sq, sk, sv, scale = q, k, v, softmax_scale
            padded = _padded_head_dim(d) if on_cuda and not paged and q.dtype.itemsize == 2 else d
            if padded != d:
                # the adapters' own step for contiguous 16-bit inputs of a head dim the sparse kernels are not built
                # for (never an engine's paged cache): zero-padded to the next one they take (CUDA_LIMITS), which
                # adds 0 to every q.k and to the pooled means (the same selection, exact outputs), at the cost of
                # padded copies of q, k, v; the scale stays the model's
                pad = (0, padded - d)
                sq, sk, sv = (torch.nn.functional.pad(x, pad) for x in (q, k, v))
                scale = d ** -0.5 if softmax_scale is None else softmax_scale
            if on_cuda:  # what the device's kernels take: the library's answer, on the arrays the call gets
                reason = self._backend_reason(sq, sk, sv, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table,
                                              seqused_k, scale, descales, sel)
        self.last_reason = reason
        target = out
        if fp8 and out.dtype != torch.bfloat16:      # FP8 attention writes bfloat16 (an fp16/fp32 model's buffer)
            out = torch.empty(out.shape, dtype=torch.bfloat16, device=out.device)
        if reason is not None:
            self.last_path = "dense"
            self.calls["dense"] += 1
            _ops().attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal=causal,
                             softmax_scale=softmax_scale, window=tuple(window), out=out, block_table=block_table,
                             seqused_k=seqused_k, **descales)
        else:
            self.last_path = "sparse"
            self.calls["sparse"] += 1
            if c.validated_lengths and max_k > LONG_PROMPT_FACTOR * c.validated_lengths[-1]:
                warn_once(f"validated_lengths {c.validated_lengths[-1]}",
                          f"sparse_prefill: a prompt of {max_k} tokens runs settings validated at lengths up to "
                          f"{c.validated_lengths[-1]} (validated_lengths in the configuration): more than "
                          f"{LONG_PROMPT_FACTOR:g}x longer, where the selection keeps fewer blocks and its accuracy "
                          "was not measured; calibrate at this length (python -m sparse_prefill.calibrate --lengths)")
            if final_chunk is None:
                final_chunk = c.final_chunk == "always"
            if sq.shape[-1] != d:
                out = torch.empty(sq.shape, dtype=out.dtype, device=out.device)
            if paged:
                _ops().chunked_prefill(sq, sk, sv, cu_seqlens_q, block_table, seqused_k, max_q, max_k,
                                       final_chunk=final_chunk, softmax_scale=scale, out=out, mean_cache=mean_cache,
                                       **sel, **descales)
            else:
                _ops().sparse_prefill(sq, sk, sv, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale,
                                      out=out, final_chunk=final_chunk, **sel, **descales)
            if out.shape[-1] != d:
                out = out[..., :d]
        if target is not out:
            target.copy_(out)
        return target


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
