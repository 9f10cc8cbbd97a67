"""A small long-context retrieval transformer, trained here, as a second accuracy subject (issue 13).

Task (MQAR-style key-value recall in a long context, `make_batch`): vocabulary of `vocab` tokens; ids [0, 4) are
reserved, [4, vocab // 2) are filler, [vocab // 2, vocab) are key/value tokens. A sequence of L tokens is random filler
with `n_pairs` key-value pairs (a key of `key_len` tokens followed by its value of `val_len` tokens; all key/value
tokens of a sequence distinct) at random non-overlapping places in [key_lo, q0 - gap); then the query region
[q0, q0 + n_queries * (key_len + val_len)): `n_queries` of the pairs again (shuffled), and `tail` filler tokens to the
end. Only the value tokens of the query region are scored (teacher-forced next-token prediction: the label of
position t is ids[t + 1] where ids[t + 1] is a query value token, -100 elsewhere). At evaluation the tail is 320
tokens (the library keeps the last `last_n` query tiles dense: with g = 4 these are the last 64 positions, so no
scored position sits there), keys start after the 256-token sink and end >= 640 tokens before the query region
(outside the always-kept local window): every answer must come from a block the selection chose.

Model (`RetrievalLM`): pre-norm decoder, RMSNorm, GQA attention with RoPE (theta 5e5), GELU MLP (4 d), untied head.
Keys are "smeared" with the previous token's key before RoPE (Olsson et al. 2022, the smeared-key induction head):
k'_t = k_t + sigmoid(w_h) * (k_{t-1} - k_t), one learned w per KV head, so a single layer can match "the token after
an earlier occurrence of my token" and the loss leaves its plateau early. The smearing is part of the model's k: every
attention backend sees the same q/k/v.

Attention backends (`Backend`; q/k/v [B, L, H, D] -> out [B, L, Hq, D], one causal sequence per batch row):
  dense      torch sdpa (the reference: `dense_metric`)
  dense_sp   the library: sp.attention, q/k/v [L, H, D] contiguous (bf16 on CUDA, float32 on the CPU reference)
  sp         the library: sp.sparse_prefill(q, k, v, cu, cu, L, L, softmax_scale=..., return_index=True, **kwargs);
             kwargs {} is the library default selection (sp.SELECTION_DEFAULTS); density = kept / visible blocks
             summed over layers and sequences (Index.kept_blocks / visible_blocks)
  emulate    bench/accuracy/emulate.py (emulate.select + emulate.sparse_attention, float32/float64 torch), a rule dict
Training: AdamW, length curriculum 256 -> max_len (a stage advances when the running accuracy on the scored tokens
reaches 0.9, at the latest at its deadline: 25 % of the budget for the first stage, then evenly until 60 %; the last
stage, max_len, keeps >= 40 % of the budget), PoSE-style
position skipping (two chunks; the second one's position ids start after a random skip so that ids up to max_pos are
seen while training at <= max_len tokens), `--minutes` budget and `--steps` cap; checkpoint (bf16 weights + config).

  python bench/accuracy/retrieval.py train --out /tmp/retrieval.pt --minutes 4 --device cuda --seed 1
  python bench/accuracy/retrieval.py eval --ckpt /tmp/retrieval.pt --device cuda --lengths 16384,32768 \\
      --configs dense_sp,default,oracle_0.5,oracle_0.7,oracle_0.9,oracle_tile_0.5 --index-cost \\
      --out bench/results/accuracy_retrieval_h200.json
Configurations (--configs, comma separated; 'dense' (sdpa) always runs first and gives dense_metric):
  dense_sp                       the library's dense attention
  default                        the library's default selection (no selection keyword)
  oracle_F, oracle_tile_F        the exact oracle (configs.py, emulate.oracle_attention), dense_torch its keep-all path
  <registered name>              configs.CONFIGS (e.g. s3_a001, rowmax_a003_head, fpv2)
  sp:alpha=0.01;head_subgroups=g  library keyword arguments ('g': one selection per query head, 4 here)
  emu:default | emu:<name> | emu:agg=rowcum;gamma=0.8   emulator rules (CPU or CUDA, exact torch)
Rows (issue 37's format, as accuracy/run.py): model 'retrieval-seed<k>' (k: the training seed), task 'kv_recall',
layout 'mqar', format 'tokens', L, config, density, metric (exact match per value token), dense_metric, diff, ci_low,
ci_high (paired bootstrap over queries: the resampling unit is one query's value tokens, stats.py), index_ms_128k (the
config's index at 128K on the topic workload, this run, --index-cost), n_tokens, n_units, seconds.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))  # bench/: `accuracy` as a package, `_common`

from accuracy import configs as C  # noqa: E402
from accuracy import emulate  # noqa: E402
from accuracy import stats  # noqa: E402

NSPECIAL = 4
MODEL_DEFAULTS = dict(vocab=8192, layers=4, d_model=512, n_q_heads=8, n_kv_heads=2, head_dim=128, mlp_mult=4,
                      rope_theta=500000.0, smear=True)
EVAL_TASK = dict(n_pairs=64, n_queries=64, key_len=2, val_len=2, tail=320, gap=640, key_lo=256)


# ---------------------------------------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------------------------------------

def make_batch(B, L, n_pairs, n_queries, key_len=2, val_len=2, tail=0, gap=0, key_lo=0, vocab=8192,
               generator=None, device="cpu"):
    """-> ids [B, L] int64, labels [B, L] int64 (-100 except at the positions before each query value token), and
    info dict (q0: start of the query region; pairs [B, n_pairs, P] tokens; slots [B, n_pairs] start positions;
    order [B, n_queries] which pair each query repeats). Random numbers from `generator` (its device is used)."""
    g = generator
    dev = g.device if g is not None else torch.device(device)
    P = key_len + val_len
    qlen = n_queries * P
    q0 = L - tail - qlen
    hi = q0 - gap
    nslots = (hi - key_lo) // P
    assert n_queries <= n_pairs <= nslots, f"L={L}: {n_pairs} pairs do not fit in {nslots} slots"
    nkv = vocab - vocab // 2
    assert n_pairs * P <= nkv
    ids = torch.randint(NSPECIAL, vocab // 2, (B, L), generator=g, device=dev)
    # distinct key/value tokens per sequence
    kv = torch.rand(B, nkv, generator=g, device=dev).argsort(-1)[:, :n_pairs * P] + vocab // 2
    pairs = kv.view(B, n_pairs, P)
    # non-overlapping slots on a grid of stride P, with a random offset per pair inside the free room
    slot_idx = torch.rand(B, nslots, generator=g, device=dev).argsort(-1)[:, :n_pairs].sort(-1).values
    slots = key_lo + slot_idx * P
    ar = torch.arange(P, device=dev)
    pos = (slots[:, :, None] + ar).view(B, -1)
    ids.scatter_(1, pos, pairs.reshape(B, -1))
    order = torch.rand(B, n_pairs, generator=g, device=dev).argsort(-1)[:, :n_queries]
    qtok = torch.gather(pairs, 1, order[:, :, None].expand(B, n_queries, P)).reshape(B, qlen)
    ids[:, q0:q0 + qlen] = qtok
    labels = torch.full_like(ids, -100)
    vpos = (q0 + torch.arange(n_queries, device=dev)[:, None] * P + key_len +
            torch.arange(val_len, device=dev)[None]).reshape(-1)  # positions of the query value tokens
    labels[:, vpos - 1] = ids[:, vpos]
    return ids, labels, dict(q0=q0, qlen=qlen, pairs=pairs, slots=slots, order=order, vpos=vpos)


def train_task(L, rng_py):
    """The task parameters of a training batch at length L (pairs scale with L, up to the evaluation's 64)."""
    n = min(EVAL_TASK["n_pairs"], max(4, L // 16))
    n_pairs = int(rng_py.integers(max(1, n // 2), n + 1))
    return dict(n_pairs=n_pairs, n_queries=n_pairs, key_len=EVAL_TASK["key_len"], val_len=EVAL_TASK["val_len"],
                tail=0, gap=0, key_lo=0)


def eval_task(L):
    t = dict(EVAL_TASK)
    if L < 4096:  # small lengths (CPU smoke tests): fewer pairs, shorter gaps
        t.update(n_pairs=min(16, L // 32), n_queries=min(16, L // 32), tail=min(320, L // 8), gap=min(640, L // 8),
                 key_lo=min(256, L // 8))
    return t


def pose_positions(L, max_pos, rng_py, device):
    """PoSE: two chunks of the L training tokens; the second chunk's ids start after a random skip (ids < max_pos)."""
    if max_pos <= L:
        return torch.arange(L, device=device)
    split = int(rng_py.integers(1, L))
    skip = int(rng_py.integers(0, max_pos - L + 1))
    pos = torch.arange(L, device=device)
    pos[split:] += skip
    return pos


# ---------------------------------------------------------------------------------------------------------------------
# Attention backends
# ---------------------------------------------------------------------------------------------------------------------

class Backend:
    """kind in dense | dense_sp | sp | emulate | oracle; args: library kwargs (sp), a rule dict (emulate) or the
    oracle's frac / subgroups (configs.Route); 'g' in head_subgroups / subgroups is the model's Hq / Hkv."""

    def __init__(self, kind="dense", args=None):
        self.kind, self.args = kind, dict(args or {})
        self.kept = 0
        self.visible = 0

    def reset(self):
        self.kept = self.visible = 0

    def density(self):
        return self.kept / self.visible if self.visible else 1.0

    def __call__(self, q, k, v, scale, layer):
        B, L, Hq, D = q.shape
        if self.kind == "dense":
            g = Hq // k.shape[2]
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale).transpose(1, 2)
        outs = []
        args = C.resolve_g(self.args, Hq // k.shape[2])
        for b in range(B):
            qb, kb, vb = q[b], k[b], v[b]  # [L, H, D]
            if self.kind == "oracle":
                o, kept, vis = emulate.oracle_attention(qb, kb, vb, scale, args.get("frac"), args.get("subgroups"),
                                                        mem_bytes=float(os.environ.get("SP_ORACLE_MEM_GB", "2")) * 2**30)
                self.kept += kept
                self.visible += vis
                outs.append(o.to(q.dtype))
                continue
            if self.kind == "emulate":
                rule = emulate.full_rule(args)
                qf, kf, vf = qb.float(), kb.float(), vb.float()
                sel = emulate.select(qf, kf, vf, rule, scale)
                self.kept += sel.kept_blocks
                self.visible += sel.visible_blocks
                outs.append(emulate.sparse_attention(qf, kf, vf, sel, scale, rule["block"]).to(q.dtype))
                continue
            import sparse_prefill as sp
            qb, kb, vb = (x.contiguous() for x in (qb, kb, vb))
            cu = torch.tensor([0, L], dtype=torch.int32, device=q.device)
            if self.kind == "dense_sp":
                o = sp.attention(qb, kb, vb, cu, cu, L, L, causal=True, softmax_scale=scale)
            elif self.kind == "sp":
                o, idx = sp.sparse_prefill(qb, kb, vb, cu, cu, L, L, softmax_scale=scale, return_index=True,
                                           **args)
                self.kept += int(idx.kept_blocks)
                self.visible += int(idx.visible_blocks)
            else:
                raise ValueError(self.kind)
            outs.append(o)
        return torch.stack(outs)


def parse_config(name):
    """-> (label, Backend): 'dense' (sdpa), 'dense_sp' (sp.attention), or any configs.parse name."""
    if name == "dense":
        return name, Backend("dense")
    if name == "dense_sp":
        return name, Backend("dense_sp")
    r = C.parse(name, "sp")
    if r is None:
        raise ValueError(f"configuration {name!r} has nothing to run here")
    return name, Backend(r.kind if r.kind != "dense" else "dense", r.args)


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.w.to(x.dtype)


def rope(x, cos, sin):
    """x [B, L, H, D]; cos/sin [L, D/2] float32 (rotate-half layout)."""
    h = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :h], xf[..., h:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c, layer):
        super().__init__()
        d, Hq, Hkv, D = c["d_model"], c["n_q_heads"], c["n_kv_heads"], c["head_dim"]
        self.layer, self.Hq, self.Hkv, self.D, self.smear = layer, Hq, Hkv, D, c["smear"]
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.wq = nn.Linear(d, Hq * D, bias=False)
        self.wk = nn.Linear(d, Hkv * D, bias=False)
        self.wv = nn.Linear(d, Hkv * D, bias=False)
        self.wo = nn.Linear(Hq * D, d, bias=False)
        self.smear_w = nn.Parameter(torch.zeros(Hkv))
        self.up = nn.Linear(d, c["mlp_mult"] * d, bias=False)
        self.down = nn.Linear(c["mlp_mult"] * d, d, bias=False)

    def forward(self, x, cos, sin, attn):
        B, L, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(B, L, self.Hq, self.D)
        k = self.wk(h).view(B, L, self.Hkv, self.D)
        v = self.wv(h).view(B, L, self.Hkv, self.D)
        if self.smear:
            kp = torch.cat([k[:, :1], k[:, :-1]], 1)  # previous token's key (the first token keeps its own)
            k = k + torch.sigmoid(self.smear_w).to(k.dtype)[None, None, :, None] * (kp - k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = attn(q, k, v, 1.0 / math.sqrt(self.D), self.layer)
        x = x + self.wo(o.reshape(B, L, self.Hq * self.D).to(x.dtype))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class RetrievalLM(nn.Module):
    def __init__(self, **cfg):
        super().__init__()
        c = dict(MODEL_DEFAULTS)
        c.update(cfg)
        self.cfg = c
        self.emb = nn.Embedding(c["vocab"], c["d_model"])
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c["layers"]))
        self.norm = RMSNorm(c["d_model"])
        self.head = nn.Linear(c["d_model"], c["vocab"], bias=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * c["layers"]) if n.endswith(("wo.weight", "down.weight"))
                                               else 1.0))

    @property
    def name(self):
        c = self.cfg
        return (f"kv-retrieval-{c['layers']}L-d{c['d_model']}-h{c['n_q_heads']}x{c['n_kv_heads']}x{c['head_dim']}"
                f"-v{c['vocab']}")

    def hidden(self, ids, pos, attn):
        D = self.cfg["head_dim"]  # float32 angles whatever the model's dtype (a bf16 buffer would shift RoPE at 32K)
        inv_freq = (1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, D, 2, device=pos.device).double() / D))).float()
        ang = pos.float()[:, None] * inv_freq[None]
        cos, sin = ang.cos(), ang.sin()
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, cos, sin, attn)
        return self.norm(x)

    def scored_logits(self, ids, labels, pos=None, attn=None):
        """logits [N, vocab] float32 at the scored positions (labels != -100) and their targets [N]."""
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.hidden(ids, pos, attn or Backend("dense"))
        m = labels != -100
        return self.head(h[m]).float(), labels[m]


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------

def curriculum_lengths(max_len, min_len=256):
    out, L = [], min_len
    while L < max_len:
        out.append(L)
        L *= 2
    return out + [max_len]


LEARNED = 0.5   # running accuracy that says the model has found the lookup (chance is ~1 / vocab)


def advance(stage, n_stages, stage_steps, acc_ema, prog, deadline):
    """Whether training moves on from `stage` to the next (longer) prompt length: once the running accuracy reaches
    0.9 (after 30 steps of the stage), at the latest at the stage's deadline (fractions of the budget). The first
    stage, where the loss leaves its plateau, moves on at its deadline only once the plateau is broken (accuracy >=
    LEARNED), or at 60 % of the budget: on 2026-12-06 two H100 trainings moved on at chance and never learned (loss
    8.32 after 1341 and 2325 steps; seeds 1 and 2, 3.5 and 2.8 min), where seed 2 at 3.5 min had learned by then."""
    if stage >= n_stages - 1:
        return False
    if acc_ema >= 0.9 and stage_steps >= 30:
        return True
    if prog < deadline[stage]:
        return False
    return stage > 0 or acc_ema >= LEARNED or prog >= 0.6


def train(args):
    import numpy as np
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    cfg = dict(MODEL_DEFAULTS)
    for k in MODEL_DEFAULTS:
        a = getattr(args, k, None)
        if a is not None:
            cfg[k] = type(MODEL_DEFAULTS[k])(a)
    model = RetrievalLM(**cfg).to(dev)
    cuda = dev.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if cuda else {}))
    stages = curriculum_lengths(args.max_len, min(args.min_len, args.max_len))
    ns = len(stages)
    # A stage advances once the running accuracy reaches 0.9, at the latest at its deadline (budget fractions): the
    # first (shortest) stage, where the loss leaves its plateau, by 0.25; the others evenly until 0.6; the last one,
    # max_len, keeps >= 40 % of the budget.
    # The first stage's deadline waits for the plateau to break (see advance()).
    deadline = [0.25 + 0.35 * i / max(1, ns - 2) for i in range(ns - 1)] + [math.inf]
    budget = args.minutes * 60.0
    t0 = time.time()
    stage, stage_steps, acc_ema, step = 0, 0, 0.0, 0
    log = []
    print(f"model {model.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params; stages {stages}; "
          f"budget {budget:.0f} s, steps <= {args.steps}", flush=True)
    while True:
        el = time.time() - t0
        prog = max(el / budget, step / args.steps if args.steps else 0.0)
        if prog >= 1.0:
            break
        if advance(stage, ns, stage_steps, acc_ema, prog, deadline):
            stage, stage_steps, acc_ema = stage + 1, 0, 0.0
        L = stages[stage]
        B = max(1, args.tokens_per_step // L)
        t = train_task(L, rng)
        ids, labels, _ = make_batch(B, L, vocab=cfg["vocab"], generator=gen, **t)
        pos = pose_positions(L, args.max_pos, rng, dev)
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))
        for gp in opt.param_groups:
            gp["lr"] = lr
        with amp:
            logits, tgt = model.scored_logits(ids, labels, pos)
        loss = F.cross_entropy(logits, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        stage_steps += 1
        if step % args.log_every == 0 or step == 1:
            acc = float((logits.argmax(-1) == tgt).float().mean())
            acc_ema = acc if stage_steps <= args.log_every else 0.5 * acc_ema + 0.5 * acc
            row = dict(step=step, t=round(time.time() - t0, 1), L=L, B=B, loss=round(float(loss.detach()), 4),
                       acc=round(acc, 4), lr=round(lr, 6), max_pos=int(pos[-1]),
                       smear=[round(float(torch.sigmoid(b.smear_w.detach()).mean()), 3) for b in model.blocks])
            log.append(row)
            print(json.dumps(row), flush=True)
    learned = stage == ns - 1 and acc_ema >= LEARNED
    if not learned:
        print(f"NOT LEARNED: running accuracy {acc_ema:.3f} at L={stages[stage]} (stage {stage + 1} of {ns}) after "
              f"{step} steps; evaluating this checkpoint compares chance with chance (eval refuses it): train "
              "longer (--minutes) or with another --seed", flush=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype)
          for k, v in model.state_dict().items()}
    ck = dict(config=cfg, state_dict=sd, log=log, steps=step, learned=learned, seconds=round(time.time() - t0, 1), stages=stages,
              max_pos=args.max_pos, seed=args.seed, commit=_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.save(ck, args.out)
    print(f"saved {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB) after {step} steps, "
          f"{time.time() - t0:.0f} s", flush=True)
    return model, ck


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------------

def load(path, device="cpu"):
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model = RetrievalLM(**ck["config"])
    model.load_state_dict({k: v.float() for k, v in ck["state_dict"].items()}, strict=True)
    dt = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return model.to(device=device, dtype=dt).eval(), ck


@torch.no_grad()
def evaluate(model, backend, L, n_seq, seed=0, device="cpu", detail=False):
    """Exact-match accuracy per scored value token over n_seq sequences of length L (seeded per (seed, L), CPU RNG),
    and the backend's density (1.0 for dense backends). detail: also the per-sequence outcome arrays (1.0 / 0.0 per
    scored token, in position order) and their clusters (the query each token answers)."""
    backend.reset()
    g = torch.Generator().manual_seed(seed * 1000003 + L)
    t = eval_task(L)
    hits = n = 0
    outs, clusters = [], []
    for _ in range(n_seq):
        ids, labels, _ = make_batch(1, L, vocab=model.cfg["vocab"], generator=g, **t)
        logits, tgt = model.scored_logits(ids.to(device), labels.to(device), attn=backend)
        hit = (logits.argmax(-1) == tgt)
        hits += int(hit.sum())
        n += tgt.numel()
        outs.append(hit.double().cpu().numpy())
        clusters.append(torch.arange(tgt.numel()).numpy() // t["val_len"])  # labels in position order: query-major
    if detail:
        return hits / n, backend.density(), n, outs, clusters
    return hits / n, backend.density(), n


def _commit():
    try:
        from _common import commit
        return commit()
    except Exception:  # noqa: BLE001
        return os.environ.get("SP_COMMIT", "unknown")


def model_label(ck, override=None):
    """'retrieval-seed<k>' from the checkpoint's training seed (issue 37 reports each training separately)."""
    if override:
        return override
    return f"retrieval-seed{ck['seed']}" if ck.get("seed") is not None else "retrieval"


def run_eval(args, model=None):
    t_start = time.time()  # --budget-s counts from here (loading and the index timing included)
    dev = args.device
    if model is None:
        model, ck = load(args.ckpt, dev)
    else:
        ck = {}
    cuda = torch.device(dev).type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's float32 probabilities
    label = model_label(ck, getattr(args, "model_name", None))
    lengths = [int(x) for x in str(args.lengths).split(",") if x]
    configs = ["dense"] + [c for c in args.configs.split(",") if c and c != "dense"]
    old = {}
    if args.out and os.path.exists(args.out):
        old = json.load(open(args.out))
    doc = dict(kind="trained retrieval model (bench/accuracy/retrieval.py), attention through the configured backend",
               through_package=True, device=torch.cuda.get_device_name() if cuda else "cpu",
               model=label, model_arch=model.name, commit=_commit(),
               date=datetime.datetime.now().isoformat(timespec="seconds"),
               command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               checkpoint=dict(path=args.ckpt, steps=ck.get("steps"), seconds=ck.get("seconds"),
                               commit=ck.get("commit"), seed=ck.get("seed"),
                               final=ck.get("log", [{}])[-1] if ck.get("log") else None),
               task=dict(EVAL_TASK, n_seq=args.n_seq, seed=args.seed),
               bootstrap=dict(unit=args.unit, n_boot=args.n_boot, level=0.95,
                              clusters="one query: its value tokens (stats.py)"),
               dense_ms_128k=old.get("dense_ms_128k"), index_cost=old.get("index_cost"), rows=old.get("rows", []))

    def put(row):
        key = lambda r: (r.get("model"), r.get("task"), r.get("layout"), r.get("L"), r.get("config"))  # noqa: E731
        doc["rows"] = [r for r in doc["rows"] if key(r) != key(row)] + [row]
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            json.dump(doc, open(args.out, "w"), indent=1)

    cost = {}
    if getattr(args, "index_cost", False):
        routes = [C.parse(c, "sp") for c in configs if c not in ("dense", "dense_sp")]
        routes = [r for r in routes if r is not None and r.library_args is not None]
        if routes and (cuda or args.index_L <= 4096):
            from accuracy import index_cost
            ic = index_cost.for_routes(routes, L=args.index_L, device=dev)
            doc["dense_ms_128k"], doc["index_cost"], cost = ic.get("dense_ms"), ic, ic["rows"]

    results, refused = [], []
    todo, done = len(lengths) * len(configs), 0
    for L in lengths:
        dense = None
        for c in configs:
            if args.budget_s and time.time() - t_start > args.budget_s:
                print(f"eval budget {args.budget_s} s spent: L={L} {c} and later skipped", flush=True)
                return results
            name, be = parse_config(c)
            t0 = time.time()
            try:
                acc, dens, n, outs, clus = evaluate(model, be, L, args.n_seq, args.seed, dev, detail=True)
            except (TypeError, ValueError, NotImplementedError) as e:
                print(f"L={L} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            if cuda:
                torch.cuda.synchronize()
            done += 1
            if name == "dense":
                dense = outs
                if acc < args.min_dense_metric:
                    print(f"L={L}: dense accuracy {acc:.4f} < --min-dense-metric {args.min_dense_metric}: the "
                          f"checkpoint has not learned the task (training's final row: "
                          f"{doc['checkpoint']['final']}); no rows written at this length", flush=True)
                    refused.append(L)
                    break
            cmp = stats.compare(dense, outs, clus, unit=args.unit, n_boot=args.n_boot, seed=args.seed)
            ic = cost.get(name) if be.kind == "sp" else None
            row = dict(model=label, task="kv_recall", layout="mqar", format="tokens", L=L, config=name,
                       density=dens, metric=acc, dense_metric=cmp["dense_metric"], diff=cmp["diff"],
                       ci_low=cmp["ci_low"], ci_high=cmp["ci_high"], metric_name="top1",
                       index_ms_128k=ic.get("index_ms") if ic else None,
                       index_graph_ms_128k=ic.get("index_graph_ms") if ic else None,
                       topic_density_128k=ic.get("density") if ic else None,
                       n_tokens=n, n_units=cmp["n_units"], prompts=len(outs), backend=be.kind,
                       route="dense" if name == "dense" else be.kind, args=be.args, model_arch=model.name,
                       commit=doc["commit"], date=doc["date"], seconds=round(time.time() - t0, 2))
            results.append(row)
            put(row)
            el = time.time() - t_start
            print(f"[{done}/{todo}] L={L} {name}: acc={acc:.4f} diff {100 * row['diff']:+.2f} pt "
                  f"[{100 * row['ci_low']:+.2f}, {100 * row['ci_high']:+.2f}] density={dens:.3f} "
                  f"({row['seconds']:.1f} s; ~{el / done * (todo - done):.0f} s left)", flush=True)
    if refused:
        raise SystemExit(f"refused: dense accuracy below --min-dense-metric at L={refused} (an unlearned subject)")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--out", required=True, help="checkpoint path")
    tr.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    tr.add_argument("--minutes", type=float, default=5.0)
    tr.add_argument("--steps", type=int, default=0, help="step cap (0: none)")
    tr.add_argument("--min-len", type=int, default=256)
    tr.add_argument("--max-len", type=int, default=8192)
    tr.add_argument("--max-pos", type=int, default=32768, help="PoSE: position ids up to this")
    tr.add_argument("--tokens-per-step", type=int, default=65536)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--warmup", type=int, default=100)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--log-every", type=int, default=25)
    for k, v in MODEL_DEFAULTS.items():
        tr.add_argument("--" + k.replace("_", "-"), type=(int if isinstance(v, (bool, int)) else float),
                        default=None)
    ev = sub.add_parser("eval")
    ev.add_argument("--ckpt", required=True)
    ev.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ev.add_argument("--lengths", default="8192,16384,32768")
    ev.add_argument("--configs", default="dense_sp,default")
    ev.add_argument("--n-seq", type=int, default=16, help="sequences per length (each scores n_queries * val_len)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--budget-s", type=float, default=0, help="stop starting new rows after this many seconds")
    ev.add_argument("--min-dense-metric", type=float, default=LEARNED,
                    help="refuse a length whose dense accuracy is below this (an unlearned checkpoint: its rows "
                         "would compare chance with chance)")
    ev.add_argument("--unit", default="cluster", choices=["cluster", "prompt", "token"], help="bootstrap unit")
    ev.add_argument("--n-boot", type=int, default=2000)
    ev.add_argument("--index-cost", action="store_true", help="time each library config's index at --index-L")
    ev.add_argument("--index-L", type=int, default=131072)
    ev.add_argument("--model-name", default=None, help="the rows' model (default retrieval-seed<training seed>)")
    ev.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), int(os.environ.get("SP_THREADS", "64")))))
    if args.cmd == "train":
        _, ck = train(args)
        return 0 if ck["learned"] else 3
    run_eval(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
