"""Accuracy tasks built from text Debian installs anyway (license texts, package copyright files, changelogs).

All tasks are deterministic (seeded) and return a dict: ids (list of token ids, length L), and a scorer that maps
the model's logits [L, vocab] (float) to the task metric.
  copy  a natural-text segment of L/2 tokens (distinct corpus lines in seeded random order) followed by itself;
        top-1 accuracy of the next-token prediction over every token of the second copy.
  ppl   natural text of L tokens; mean NLL per token over the last 3/4 of the positions.
  kv    key-value retrieval: natural filler with N facts "The secret code of <name> is <6 digits>." at depths
        10-70 %, then the N questions (shuffled) from 70 % as "The secret code of <name> is <digits>." and filler
        again to the end, so that neither facts nor questions sit in the dense final tiles; teacher-forced top-1 on
        the answer digits' tokens.
"""
import glob
import gzip
import hashlib
import os
import random

import torch

_CORPUS = None


def corpus_text():
    """The deduplicated concatenation (sorted paths) of Debian's license texts, copyright files and changelogs."""
    global _CORPUS
    if _CORPUS is not None:
        return _CORPUS
    paths = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright")) + \
        sorted(glob.glob("/usr/share/doc/*/changelog*"))
    seen, parts = set(), []
    for p in paths:
        if not os.path.isfile(p):
            continue
        try:
            raw = open(p, "rb").read()
            if p.endswith(".gz"):
                raw = gzip.decompress(raw)
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        h = hashlib.sha1(text.encode()).hexdigest()
        if h in seen or len(text) < 200:
            continue
        seen.add(h)
        parts.append(text)
    _CORPUS = parts
    return parts


_TOKENS = {}


def corpus_tokens(tok, which):
    """Token ids of one of two disjoint halves of the corpus documents: 'a' (even docs) or 'b' (odd docs)."""
    key = (id(tok), which)
    if key not in _TOKENS:
        docs = corpus_text()[0 if which == "a" else 1::2]
        ids = []
        for d in docs:
            ids.extend(tok(d, add_special_tokens=False)["input_ids"])
            if len(ids) > 400_000:
                break
        _TOKENS[key] = ids
    return _TOKENS[key]


def natural(tok, n, seed, which="a"):
    ids = corpus_tokens(tok, which)
    rng = random.Random(seed)
    start = rng.randrange(0, len(ids) - n - 1)
    return ids[start:start + n]


def corpus_lines(tok):
    """Distinct natural-text lines (>= 40 characters) of the corpus, in corpus order."""
    seen, out = set(), []
    for d in corpus_text():
        for line in d.splitlines():
            line = line.strip()
            if len(line) >= 40 and line not in seen:
                seen.add(line)
                out.append(line)
    return out


def copy_task(tok, L, seed=0):
    """A segment of L/2 tokens made of distinct corpus lines drawn at random (seeded) - natural text whose next line
    cannot be recalled from the model's memory of license boilerplate - followed by itself."""
    half = L // 2
    lines = corpus_lines(tok)
    rng = random.Random(seed * 7919 + L)
    seg = []
    while len(seg) < half:
        seg.extend(tok(" " + lines[rng.randrange(len(lines))] + "\n", add_special_tokens=False)["input_ids"])
    seg = seg[:half]
    ids = seg + seg
    tgt = torch.tensor(ids[half:])

    def score(logits):
        pred = logits[half - 1:L - 1].argmax(-1)
        return float((pred == tgt).float().mean())
    return dict(ids=ids, score=score, metric="top1")


def ppl_task(tok, L, seed=0):
    ids = natural(tok, L, seed * 104729 + L, "b")
    t = torch.tensor(ids)
    lo = L // 4

    def score(logits):
        lp = torch.log_softmax(logits[lo - 1:L - 1].float(), -1)
        return float(-lp.gather(1, t[lo:, None]).mean())
    return dict(ids=ids, score=score, metric="nll")


NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jamal", "Katya",
         "Lorenzo", "Marta", "Nikolai", "Olga", "Pedro", "Quentin", "Rosa", "Stefan", "Tomas"]


def kv_task(tok, L, seed=0, n_facts=10):
    rng = random.Random(1000 + seed * 31 + L)
    names = rng.sample(NAMES, n_facts)
    codes = ["".join(str(rng.randrange(10)) for _ in range(6)) for _ in names]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    facts = [enc(f" The secret code of {n} is {c}. ") for n, c in zip(names, codes)]
    order = list(range(n_facts))
    rng.shuffle(order)
    q_prefix = [enc(f" The secret code of {names[i]} is") for i in order]
    q_answer = [enc(f" {codes[i]}.") for i in order]
    filler = natural(tok, L, 7 + seed * 13 + L, "b")
    depths = sorted(rng.uniform(0.10, 0.70) for _ in range(n_facts))
    ids, cur, spans = [], 0, []
    for d, f in zip(depths, facts):
        nxt = int(d * L)
        ids.extend(filler[cur:nxt])
        cur = nxt
        ids.extend(f)
    q_at = int(0.70 * L)
    ids.extend(filler[cur:q_at])
    cur = q_at
    ids.extend(enc(" Now recall the secret codes."))
    for p, a in zip(q_prefix, q_answer):
        ids.extend(p)
        spans.append((len(ids) + 1, len(ids) + len(a) - 1))  # score the digits: not the leading space, not the '.'
        ids.extend(a)
    rest = L - len(ids)
    assert rest >= 280, "kv task: too many facts for L (the questions must end before the dense last tiles)"
    ids.extend(filler[cur:cur + rest])
    ids = ids[:L]
    pos = torch.tensor([j for lo, hi in spans for j in range(lo, hi)])
    tgt = torch.tensor(ids)[pos]

    def score(logits):
        pred = logits[pos - 1].argmax(-1)
        return float((pred == tgt).float().mean())
    return dict(ids=ids, score=score, metric="top1")


TASKS = {"copy": copy_task, "ppl": ppl_task, "kv": kv_task}


def make(name, tok, L, seed=0):
    return TASKS[name](tok, L, seed)


def make_set(name, tok, L, seed=0, prompts=1):
    """`prompts` instances of a task (seeds seed, seed + 1, ...), scored as the mean of their metrics: kv scores ~60
    digit tokens per prompt (1.7 points each), too few for a 1-point target on one prompt."""
    return [make(name, tok, L, seed + i) for i in range(prompts)]
