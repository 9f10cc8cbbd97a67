"""The model under calibration and where its attention goes.

The model is loaded with `attn_implementation="sparse_prefill_calibrate"`, an attention function registered with
transformers that sends every layer's attention where the current Route says:
  dense    the library's dense attention, sp.attention (the reference every setting is compared with)
  config   a SparsePrefillConfig, layer by layer as the adapters apply it: sp.attention for its dense layers,
           sp.sparse_prefill(**config.selection(layer)) for the others (kept / visible blocks counted per layer)
  oracle   the exact oracle at mass fraction F (oracle.py), blocks counted per layer
  probe    dense attention, and on the same inputs each candidate setting's sparse attention: its relative error
           against dense and its density, per layer (what the per-layer search ranks layers by)
  time     dense attention, and on the same inputs the time of dense attention (sp.attention) and of each
           candidate's index stage (sp.build_index), per layer: what a setting's cost adds to its density
  adapter  the transformers adapter itself (sparse_prefill.integrations.transformers) with a configuration: the
           round trip of a written file
Head dims the kernels do not take are zero-padded (64 on the CPU reference when D < 64, else 128; 128 on CUDA, where
the sparse kernels take 128): zero columns add nothing to q.k or to the pooled means, so outputs and selections are
those of the model's own head dim (softmax scale kept).
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import sparse_prefill as sp

from .tasks import UsageError

NAME = "sparse_prefill_calibrate"


class Route:
    """What the attention function does for the next forwards (see the module docstring) and what it counted:
    `blocks[layer] = [kept, visible]`, `probe[layer][candidate] = [err^2, ref^2, kept, visible]`,
    `timing[layer] = {"attention": seconds of dense attention, "index": {candidate: seconds of its index stage}}`."""

    def __init__(self, kind: str = "dense", config=None, frac: Optional[float] = None, candidates=None,
                 oracle_geometry=None, mem_bytes: float = 2 << 30, dispatch=None):
        self.kind, self.config, self.frac = kind, config, frac
        self.candidates = candidates or []               # [(name, SparsePrefillConfig)]
        self.oracle_geometry = oracle_geometry or {}     # block_size, sink, window, last_n
        self.mem_bytes = mem_bytes
        self.dispatch = dispatch                         # kind 'adapter': the adapter's VarlenDispatch
        self.adapter = None
        if dispatch is not None:
            from ..integrations.transformers import make_attention_forward
            self.adapter = make_attention_forward(dispatch)
        self.blocks: Dict[int, List[int]] = {}
        self.probe: Dict[int, Dict[str, List[float]]] = {}
        self.timing: Dict[int, dict] = {}

    def count(self, layer: int, kept: int, visible: int) -> None:
        c = self.blocks.setdefault(layer, [0, 0])
        c[0] += kept
        c[1] += visible

    def layer_density(self) -> Dict[int, float]:
        return {layer: (k / v if v else 1.0) for layer, (k, v) in sorted(self.blocks.items())}


ROUTE = Route()


def _padded(x, d: int):
    import torch
    return x.contiguous() if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1])).contiguous()


def _lib_dim(D: int, cuda: bool) -> int:
    if D > 128:
        raise UsageError(f"MODEL: head dim {D} (the library takes head dims up to 128)")
    return 128 if cuda or D > 64 else 64


def _dense(q, k, v, scale):
    L = q.shape[0]
    cu = _cu(L, q.device)
    out = sp.attention(q, k, v, cu, cu, L, L, causal=True, softmax_scale=scale, return_lse=False)
    return out[0] if isinstance(out, tuple) else out


def _sparse(q, k, v, scale, selection):
    """(out, kept, visible) of sp.sparse_prefill with this selection (one-shot prefill: final_chunk)."""
    L = q.shape[0]
    cu = _cu(L, q.device)
    out, index = sp.sparse_prefill(q, k, v, cu, cu, L, L, softmax_scale=scale, return_index=True, **selection)
    return out, index.kept_blocks, index.visible_blocks


def _index(q, k, v, scale, selection):
    L = q.shape[0]
    cu = _cu(L, q.device)
    return sp.build_index(q, k, v, cu, cu, L, L, softmax_scale=scale, **selection)


# Runs of each timed call (after one warm-up), their median taken: at 32K a dense layer of an 8B model is ~15 ms and
# its index stage 0.4-7 ms on an H100, so three runs cost ~0.1 s per layer and resolve the few-% shares that decide.
TIME_RUNS = 3


def _seconds(fn, cuda: bool) -> float:
    """Median wall time of fn() over TIME_RUNS runs after a warm-up (synchronized on CUDA: the kernels' time)."""
    import time
    import torch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    times = []
    for _ in range(TIME_RUNS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _cu(L, device):
    import torch
    return torch.tensor([0, L], dtype=torch.int32, device=device)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function (query [1, Hq, L, D], key/value [1, Hkv, L, D]) -> ([1, L, Hq, D], None)."""
    import torch
    R = ROUTE
    if R.kind == "adapter":
        return R.adapter(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise NotImplementedError("calibration runs one prompt at a time, as a whole (batch 1, no cache)")
    layer = int(getattr(module, "layer_idx", 0))
    D = query.shape[-1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(D)
    dl = _lib_dim(D, query.is_cuda)
    q, k, v = (_padded(x[0].transpose(0, 1), dl) for x in (query, key, value))   # [L, H, dl]
    if R.kind == "dense" or (R.kind == "config" and R.config.layer_dense(layer)):
        out = _dense(q, k, v, scale)
        if R.kind == "config":
            R.count(layer, 1, 1)                    # a dense layer: density 1
    elif R.kind == "config":
        out, kept, vis = _sparse(q, k, v, scale, R.config.selection(layer))
        R.count(layer, kept, vis)
    elif R.kind == "oracle":
        from .oracle import oracle_attention
        out, kept, vis = oracle_attention(q, k, v, scale, R.frac, mem_bytes=R.mem_bytes, **R.oracle_geometry)
        R.count(layer, kept, vis)
    elif R.kind == "probe":
        out = _dense(q, k, v, scale)
        ref = float(out.float().pow(2).sum())
        stats = R.probe.setdefault(layer, {})
        for name, cfg in R.candidates:
            o, kept, vis = _sparse(q, k, v, scale, cfg.selection(layer))
            s = stats.setdefault(name, [0.0, 0.0, 0, 0])
            s[0] += float((o.float() - out.float()).pow(2).sum())
            s[1] += ref
            s[2] += kept
            s[3] += vis
    elif R.kind == "time":
        out = _dense(q, k, v, scale)
        cell = R.timing.setdefault(layer, {"attention": 0.0, "index": {}})
        cell["attention"] = _seconds(lambda: _dense(q, k, v, scale), q.is_cuda)
        for name, cfg in R.candidates:
            if not cfg.layer_dense(layer):
                sel = cfg.selection(layer)
                cell["index"][name] = _seconds(lambda: _index(q, k, v, scale, sel), q.is_cuda)
    else:
        raise ValueError(f"route kind {R.kind!r}")
    return out[..., :D].to(query.dtype).unsqueeze(0), None


_REGISTERED = False


def register() -> None:
    """Register the attention function (and the flash-style mask function, as the adapter does) once."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, flash_attention_mask)
        _REGISTERED = True


def load(model_path: str, device: str, tokenizer: Optional[str] = None, log=print):
    """(model, tokenizer) from a local folder or a GGUF file (no downloads). tokenizer: a folder or GGUF file,
    'bytes' (ByteTokenizer, for random-weight models saved without one) or None (the model's own)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from .tasks import ByteTokenizer
    register()

    def where(path, arg):
        if os.path.isfile(path):
            if not path.endswith(".gguf"):
                raise UsageError(f"{arg}: {path} is a file but not a .gguf; give a model folder or a GGUF file")
            return os.path.dirname(os.path.abspath(path)), dict(gguf_file=os.path.basename(path))
        if os.path.isdir(path):
            return path, {}
        raise UsageError(f"{arg}: {path} does not exist (a local model folder or GGUF file; nothing is downloaded)")

    folder, extra = where(model_path, "MODEL")
    tfolder, textra = where(tokenizer, "--tokenizer") if tokenizer not in (None, "bytes") else (folder, extra)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    log(f"loading {model_path} ({dtype}, {device}) ...")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=NAME, dtype=dtype,
                                                 local_files_only=True, **extra)
    model.to(device).eval()
    if tokenizer == "bytes":
        tok = ByteTokenizer()
        if model.config.vocab_size < tok.vocab_size:
            raise UsageError(f"--tokenizer: bytes needs a vocabulary of >= {tok.vocab_size} tokens, the model has "
                             f"{model.config.vocab_size}")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(tfolder, local_files_only=True, **textra)
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--tokenizer: no tokenizer loads from {tokenizer or model_path} ({e}); give "
                             "--tokenizer PATH, or --tokenizer bytes for a random-weight model") from None
    return model, tok


def logits_at(model, ids, at):
    """float32 logits [len(at), vocab] at positions `at` of one prompt (the LM head on those positions only)."""
    import torch
    dev = next(model.parameters()).device
    x = torch.tensor([ids], device=dev)
    with torch.no_grad():
        out = model(input_ids=x, use_cache=False, logits_to_keep=torch.as_tensor(at, device=dev))
    return out.logits[0].float()
