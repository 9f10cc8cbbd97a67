"""Accuracy tasks built from text Debian installs anyway (license texts, package copyright files, changelogs).

Every task is deterministic for (tokenizer, corpus, L, seed, layout, format) and returns a dict:
  ids       token ids, length L
  pos       the scored positions (np.int64, ascending); the prediction of ids[p] is read from the logits at p - 1
  tgt       ids at pos (np.int64)
  kind      'top1' (outcome 1.0 iff argmax == target) or 'nll' (outcome = -log p(target))
  clusters  bootstrap cluster of each scored token (np.int64, local to the prompt; see CLUSTERS)
  metric    metric name ('top1' or 'nll'); score(logits) the prompt's mean outcome from full logits [L, vocab]
  info      what was generated (layout, format, positions of facts and questions, ...)
outcomes(task, logits_at) maps the logits at pos - 1 to the per-token outcomes (what the paired bootstrap resamples).

Nothing is scored in the last TAIL = 512 positions: the library keeps the last `last_n` = 2 query tiles of 128 packed
rows dense (2 * 128 / g positions for one selection per KV group, 256 for one per query head), so a token scored there
would measure dense attention under every configuration and dilute the differences.

  copy  a segment of H = (L - 512) / 2 tokens made of distinct corpus lines in seeded random order, the same segment
        again, then natural filler to L; top-1 over the second copy.
  ppl   natural text of L tokens; NLL per token over positions [L / 4, L - 512).
  kv    key-value recall: natural filler with n facts and, later, one question per fact that repeats the fact's key;
        teacher-forced top-1 on the tokens of the answer value that hold a letter or digit (not the leading space or
        punctuation, which any model predicts without recall). Layouts (LAYOUTS), in filler coordinates (offsets into
        the F = L - (tokens of all facts and questions) filler tokens, so that what is placed later only pushes a piece
        further back):
          together  facts at 10-70 %, then a header and the n questions (shuffled) in one block from 70 % (today's
                    task; the block starts earlier when it would reach the tail)
          spread    facts spread over the first ~80 % (2 % to where the questions start), the questions (shuffled)
                    spread over the last stretch before the tail, interleaved with filler (stratified offsets): at 8K
                    from ~77 % to 94 % of the prompt, at 4K from ~69 % to 87.5 %, where the 512-position tail guard
                    leaves less room
          depth     facts at every depth (stratified offsets from 5 % to min(90 %, the last depth that leaves room for a
                    question >= GAP tokens later)), each question a random distance >= GAP after its fact (GAP = 640 >
                    the 512-token local window the library always keeps, so every answer comes from a selected block),
                    questions scattered among the facts
        Formats (FORMATS):
          code    ' The secret code of <name> is <6 digits>.' (today's; 6 scored digit tokens)
          record  '\\n{"key": "<word>-<word>", "value": "<word>-<4 digits>"}' (JSON-like, multi-token value: ~7 scored
                  tokens with SmolLM2's tokenizer)
        A fact and its question are the same token pieces (prefix, value, suffix encoded separately), so the value the
        model must recall is token for token the one it saw.
"""
import glob
import gzip
import hashlib
import os
import random

import numpy as np
import torch

TAIL = 512          # no scored position in the last TAIL positions of a prompt
CLUSTER = 128       # copy / ppl: bootstrap clusters of 128 consecutive scored positions (one query tile's worth)
GAP = 640           # depth layout: a question's filler offset is >= GAP after its fact's
LAYOUTS = ("together", "spread", "depth")
FORMATS = ("code", "record")
CLUSTERS = {"kv": "one question: the scored tokens of its answer (a fact is found or missed as a whole)",
            "copy": f"{CLUSTER} consecutive scored positions (a missed source block fails a run of copied tokens)",
            "ppl": f"{CLUSTER} consecutive scored positions"}

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


def corpus_digest():
    """A short hash of the corpus documents: the tasks depend on the machine's /usr/share/doc, so results files record
    which corpus their prompts came from."""
    h = hashlib.sha1()
    for d in corpus_text():
        h.update(hashlib.sha1(d.encode()).digest())
    return h.hexdigest()[:12]


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
    if len(ids) < n + 2:
        raise ValueError(f"corpus half {which!r} has {len(ids)} tokens, fewer than the {n} asked for")
    rng = random.Random(seed)
    start = rng.randrange(0, len(ids) - n - 1)
    return ids[start:start + n]


_LINES = None


def corpus_lines():
    """Distinct natural-text lines (>= 40 characters) of the corpus, in corpus order."""
    global _LINES
    if _LINES is None:
        seen, out = set(), []
        for d in corpus_text():
            for line in d.splitlines():
                line = line.strip()
                if len(line) >= 40 and line not in seen:
                    seen.add(line)
                    out.append(line)
        _LINES = out
    return _LINES


def _enc(tok, s):
    return list(tok(s, add_special_tokens=False)["input_ids"])


def _task(ids, pos, kind, clusters, info):
    pos = np.asarray(pos, dtype=np.int64)
    L = len(ids)
    assert len(pos) and pos.min() >= 1 and pos.max() < L - TAIL, "a scored position outside [1, L - TAIL)"
    tgt = np.asarray(ids, dtype=np.int64)[pos]
    t = dict(ids=list(ids), pos=pos, tgt=tgt, kind=kind, metric=kind, clusters=np.asarray(clusters, np.int64),
             info=info)

    def score(logits):  # the mean outcome from full logits [L, vocab] (the old interface)
        return float(outcomes(t, logits[torch.as_tensor(pos - 1)]).mean())
    t["score"] = score
    return t


def outcomes(task, logits_at):
    """Per scored token: 1.0 / 0.0 (top-1 hit) or the NLL, from the logits at pos - 1 ([n_scored, vocab]); float64
    numpy."""
    lg = logits_at.float()
    tgt = torch.as_tensor(task["tgt"], device=lg.device)
    if task["kind"] == "nll":
        out = -torch.log_softmax(lg, -1).gather(1, tgt[:, None])[:, 0]
    else:
        out = (lg.argmax(-1) == tgt).float()
    return out.double().cpu().numpy()


def _tile_clusters(pos):
    pos = np.asarray(pos)
    return (pos - pos[0]) // CLUSTER


def copy_task(tok, L, seed=0):
    """Distinct corpus lines drawn at random (seeded) - natural text whose next line cannot be recalled from the
    model's memory of license boilerplate - H = (L - TAIL) // 2 tokens, the same H tokens again, filler to L."""
    half = (L - TAIL) // 2
    assert half >= 64, f"copy: L={L} leaves no room before the {TAIL}-position tail"
    lines = corpus_lines()
    rng = random.Random(seed * 7919 + L)
    seg = []
    while len(seg) < half:
        seg.extend(_enc(tok, " " + lines[rng.randrange(len(lines))] + "\n"))
    seg = seg[:half]
    ids = seg + seg + natural(tok, L - 2 * half, seed * 15485863 + L, "b")
    pos = np.arange(half, 2 * half)
    return _task(ids, pos, "top1", _tile_clusters(pos), dict(task="copy", half=half))


def ppl_task(tok, L, seed=0):
    ids = natural(tok, L, seed * 104729 + L, "b")
    pos = np.arange(L // 4, L - TAIL)
    return _task(ids, pos, "nll", _tile_clusters(pos), dict(task="ppl"))


NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jamal", "Katya",
         "Lorenzo", "Marta", "Nikolai", "Olga", "Pedro", "Quentin", "Rosa", "Stefan", "Tomas", "Ursula", "Viktor",
         "Wanda", "Xavier", "Yusuf", "Zofia", "Anders", "Beatriz", "Cyrus", "Dagny", "Emeka", "Fiona", "Gustavo",
         "Helga", "Isidro", "Jana", "Kwame", "Leila", "Matteo", "Nadia", "Oskar", "Priya", "Rafael", "Sanna",
         "Tariq", "Ulla", "Valentin", "Wilhelmina", "Yara", "Zoltan", "Agnes", "Bernard", "Camille", "Desmond",
         "Esther", "Felix", "Gianna", "Hector", "Imogen", "Joaquin", "Keiko", "Ludwig", "Mireille", "Nils"]
KEY_WORDS = ["maple", "otter", "cobalt", "harbor", "quartz", "willow", "falcon", "ember", "glacier", "meadow",
             "copper", "lantern", "saffron", "thistle", "canyon", "velvet", "raven", "juniper", "orbit", "pebble",
             "summit", "tundra", "walnut", "zephyr"]
VALUE_WORDS = ["crimson", "amber", "indigo", "silver", "olive", "scarlet", "violet", "ivory", "teal", "umber",
               "coral", "azure", "ochre", "jade", "sable", "russet"]


def _kv_items(tok, rng, fmt, n):
    """n facts as (prefix, value, suffix) token pieces; the question of a fact is the same pieces."""
    items = []
    if fmt == "code":
        for name in rng.sample(NAMES, n):
            code = "".join(str(rng.randrange(10)) for _ in range(6))
            items.append((_enc(tok, f" The secret code of {name} is"), _enc(tok, f" {code}"), _enc(tok, ".")))
    elif fmt == "record":
        keys = rng.sample([f"{a}-{b}" for a in KEY_WORDS for b in KEY_WORDS if a != b], n)
        for key in keys:
            val = f"{rng.choice(VALUE_WORDS)}-{rng.randrange(1000, 10000)}"
            items.append((_enc(tok, '\n{"key": "' + key + '", "value": "'), _enc(tok, val), _enc(tok, '"}')))
    else:
        raise ValueError(f"kv format {fmt!r}: one of {FORMATS}")
    return items


def _scored(tok, value):
    """Indices of the value's tokens that hold a letter or digit (the recalled part)."""
    return [j for j, t in enumerate(value) if any(c.isalnum() for c in tok.decode([t]))]


def default_facts(L):
    """Facts per kv prompt: ~one per 128 positions before the tail, 2 to 48."""
    return max(2, min(48, (L - TAIL) // 128))


def _room(layout, F, n):
    """Whether n facts (filler F) fit the layout; the filler offsets the layout draws from (see kv_task)."""
    last_q = F - TAIL
    if last_q < 0.2 * F:
        return False
    if layout == "spread":
        return min(0.85 * F, last_q - max(0.10 * F, 12 * n)) > 0.05 * F + n
    if layout == "depth":
        return min(0.90 * F, last_q - GAP) > 0.05 * F + n
    return True


def kv_task(tok, L, seed=0, layout="together", fmt="code", n_facts=None):
    """n_facts (default default_facts(L)) is lowered until the facts and questions fit the layout with the tail
    guard (short prompts, long tokens)."""
    if layout not in LAYOUTS:
        raise ValueError(f"kv layout {layout!r}: one of {LAYOUTS}")
    rng = random.Random(1000 + seed * 31 + L * 7 + LAYOUTS.index(layout) * 1_000_003 + FORMATS.index(fmt) * 7919)
    all_items = _kv_items(tok, rng, fmt, n_facts or default_facts(L))
    header = _enc(tok, " Now recall the secret codes." if fmt == "code" else "\nNow recall the records:") \
        if layout == "together" else []
    for n in range(len(all_items), 0, -1):
        items = all_items[:n]
        pieces = [p + v + s for p, v, s in items]  # a fact and its question are the same tokens
        P = 2 * sum(len(x) for x in pieces) + len(header)
        F = L - P
        if _room(layout, F, n):
            break
    else:
        raise ValueError(f"kv {layout}: not even one fact fits L={L} with a {TAIL}-position tail")
    last_q = F - TAIL  # a question at filler offset <= F - TAIL ends before L - TAIL (only pieces precede it)
    u = lambda a, b: a + (b - a) * rng.random()  # noqa: E731
    order = list(range(n))
    rng.shuffle(order)
    if layout == "together":
        q_at = int(min(0.70 * F, last_q))
        f_off = sorted(int(u(0.10 * F, q_at)) for _ in range(n))
        q_off = [q_at] * n  # one block: the header, then the questions back to back
    elif layout == "spread":
        q_lo = int(min(0.85 * F, last_q - max(0.10 * F, 12 * n)))
        f_off = sorted(int(u(0.02 * F, min(0.80 * F, q_lo))) for _ in range(n))
        slots = [int(q_lo + (j + rng.random()) / n * (last_q - q_lo)) for j in range(n)]  # stratified, interleaved
        q_off = [0] * n
        for j, i in enumerate(order):
            q_off[i] = slots[j]
    else:  # depth
        f_hi = min(0.90 * F, last_q - GAP)
        f_off = [int(0.05 * F + (j + rng.random()) / n * (f_hi - 0.05 * F)) for j in range(n)]
        q_off = [int(u(f + GAP, last_q)) for f in f_off]
    # events: (filler offset, rank, ...): at equal offsets facts come first, then the header, then questions in order
    events = [(f_off[i], 0, i, "fact") for i in range(n)]
    if header:
        events.append((q_off[0], 1, -1, "header"))
    rank = {i: j for j, i in enumerate(order)}
    events += [(q_off[i], 2 + rank[i], i, "question") for i in range(n)]
    events.sort()
    filler = natural(tok, F, 7 + seed * 13 + L + LAYOUTS.index(layout) * 104729, "b")
    ids, cur, pos, clusters = [], 0, [], []
    fact_at, q_pos = [0] * n, [0] * n
    for off, _, i, what in events:
        ids.extend(filler[cur:off])
        cur = off
        if what == "header":
            ids.extend(header)
            continue
        p, v, s = items[i]
        if what == "fact":
            fact_at[i] = len(ids)
        else:
            q_pos[i] = len(ids)
            base = len(ids) + len(p)
            for j in _scored(tok, v):
                pos.append(base + j)
                clusters.append(i)
        ids.extend(p + v + s)
    ids.extend(filler[cur:])
    assert len(ids) == L, (len(ids), L)
    srt = np.argsort(pos, kind="stable")
    info = dict(task="kv", layout=layout, format=fmt, n_facts=n, fact_pos=fact_at, question_pos=q_pos,
                piece_len=[len(x) for x in pieces])
    return _task(ids, np.asarray(pos)[srt], "top1", np.asarray(clusters)[srt], info)


TASKS = {"copy": copy_task, "ppl": ppl_task, "kv": kv_task}


def make(name, tok, L, seed=0, layout=None, fmt=None):
    if name == "kv":
        return kv_task(tok, L, seed, layout or "together", fmt or "code")
    return TASKS[name](tok, L, seed)


def variants(tasks, layouts=LAYOUTS, formats=FORMATS):
    """(task, layout, format) triples: every layout x format for kv, (task, None, None) for the others."""
    out = []
    for t in tasks:
        if t == "kv":
            out += [("kv", lay, fmt) for lay in layouts for fmt in formats]
        else:
            out.append((t, None, None))
    return out


def make_set(name, tok, L, seed=0, layout=None, fmt=None, min_scored=1000, min_prompts=1, max_prompts=64):
    """Prompts of one task variant (seeds seed, seed + 1, ...) until they score >= min_scored tokens and number
    >= min_prompts. A kv prompt scores ~(L - 512) / 128 * 6 tokens (~170 at 4K): one prompt is too few for a
    1-point target, and the bootstrap needs many clusters."""
    parts = []
    while len(parts) < max_prompts and (len(parts) < min_prompts or sum(len(p["pos"]) for p in parts) < min_scored):
        parts.append(make(name, tok, L, seed + len(parts), layout, fmt))
    return parts
