"""The prompts of a calibration: key-value recall in several layouts, copying, and next-token NLL.

Every prompt is a dict: ids (token ids, length L), pos (scored positions, ascending: the prediction of ids[p] is read
from the logits at p - 1), tgt (ids at pos), kind ('top1': 1 when the argmax is the target, or 'nll': -log p(target)),
clusters (the bootstrap unit of each scored token) and variant (its task's name, e.g. 'kv/spread').

Nothing is scored in the last tail(L) positions (512 from L = 2048 on): the library keeps the last query tiles dense,
so a token scored there would measure dense attention under every setting.

  kv/<layout>  facts ' The secret code of <name> is <6 digits>.' in filler text, later one question per fact that
               repeats its key; scored: the value's tokens that hold a digit (the recalled part). Layouts:
                 together  facts at 10-70 % of the filler, then all questions in one block
                 spread    facts over the first ~80 %, questions spread over the stretch before the tail
                 depth     facts at every depth, each question a random distance (> the always-kept window) later
               format 'record' instead: '{"key": "<word>-<word>", "value": "<word>-<4 digits>"}' pieces.
  copy         a run of H = (L - tail) / 2 tokens (random snippets of the filler), the same run again; scored: the
               second run.
  nll          L tokens of the text; scored: up to the last 4096 positions before the tail.

The filler is the user's text (--text) when given, else a built-in neutral text (seeded sentences from small word
lists: no license boilerplate the model may know by heart). A fact and its question are the same token pieces, so
the value the model must recall is token for token the one it saw.

Splits: the calibration's prompts come from --seed (prompt seeds seed * 1000 + j, an integer); its confirmation
prompts (CONFIRM) from the same --seed in another namespace ('confirm <seed * 1000 + j>', which no integer --seed
gives, so they differ from the calibration's and from any `--check --seed N`'s), with the built-in filler drawn from
another seed of its generator (CONFIRM_TEXT_SEED; `--check` always uses seed 0). With --text both splits cut the
same text, at other offsets with other facts.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

LAYOUTS = ("together", "spread", "depth")
FORMATS = ("code", "record")
TASKS = ("kv", "copy", "nll")
CLUSTER = 128          # copy / nll: bootstrap clusters of 128 consecutive scored positions
NLL_MAX = 4096         # scored NLL positions per prompt, at most
CONFIRM = "confirm"    # the confirmation split's prompt-seed namespace (prompt_set's split)
CONFIRM_TEXT_SEED = "confirm"   # its built-in filler's seed (the calibration and --check use 0)


class UsageError(ValueError):
    """A bad command-line value or input file; the message starts with the argument's name."""


def tail(L: int) -> int:
    """Positions at the end of a prompt that are never scored (the library's dense last tiles)."""
    return min(512, L // 4)


# -- tokenizers and filler --------------------------------------------------------------------------------------------

class ByteTokenizer:
    """Bytes + 3 as token ids (0-2 left for special tokens): for random-weight models saved without a tokenizer
    (`--tokenizer bytes`); needs a vocabulary of at least 259 tokens."""

    vocab_size = 259

    def encode(self, text: str) -> List[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(max(0, int(i) - 3) for i in ids).decode("utf-8", errors="replace")


def encode(tok, text: str) -> List[int]:
    """Token ids of `text` without special tokens (a transformers tokenizer or ByteTokenizer)."""
    if isinstance(tok, ByteTokenizer):
        return tok.encode(text)
    return list(tok(text, add_special_tokens=False)["input_ids"])


_SUBJECTS = ["the farmer", "a young teacher", "the old sailor", "my neighbour", "the baker", "a quiet student",
             "the doctor", "her brother", "the gardener", "a tired traveller", "the captain", "our guide"]
_VERBS = ["carried", "painted", "repaired", "described", "noticed", "borrowed", "cleaned", "measured", "followed",
          "remembered", "opened", "visited"]
_OBJECTS = ["a wooden boat", "the long road", "an empty basket", "the stone bridge", "a small garden", "the red door",
            "a heavy box", "the narrow path", "an old map", "the kitchen table", "a broken clock", "the north window"]
_TAILS = ["before the rain started", "near the river", "after a long morning", "in the village square",
          "without saying a word", "while the bells rang", "at the edge of the forest", "during the market day",
          "under a grey sky", "when the lamps were lit"]
_LINKS = ["Later", "Meanwhile", "Afterwards", "That evening", "In the end", "Soon", "Even so", "For a while"]


def builtin_text(n_chars: int, seed: Union[int, str] = 0) -> str:
    """A neutral English filler of about n_chars characters: seeded sentences from small word lists."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        if rng.random() < 0.3:
            s = f"{rng.choice(_LINKS)}, {s}"
        s = s[0].upper() + s[1:]
        if rng.random() < 0.15:
            s += "\n\n"
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts)


class Filler:
    """The token stream prompts are cut from: the user's text files, or the built-in text (at least min_tokens;
    text_seed: builtin_text's seed, 0 but for the confirmation split)."""

    def __init__(self, tok, texts: Optional[Sequence[str]] = None, min_tokens: int = 0,
                 text_seed: Union[int, str] = 0):
        if texts:
            self.ids = np.asarray(sum((encode(tok, t) for t in texts), []), dtype=np.int64)
            self.source = "user text"
        else:
            n_chars = 6 * max(min_tokens, 1024)
            while True:
                self.ids = np.asarray(encode(tok, builtin_text(n_chars, text_seed)), dtype=np.int64)
                if len(self.ids) >= min_tokens:
                    break
                n_chars *= 2
            self.source = "built-in text"

    def window(self, n: int, rng: random.Random) -> List[int]:
        """n consecutive tokens from a random offset."""
        if n > len(self.ids):
            raise UsageError(f"--text: the text holds {len(self.ids)} tokens, fewer than the {n} a prompt needs "
                             "(give more text or shorter --lengths)")
        start = rng.randrange(0, len(self.ids) - n + 1)
        return self.ids[start:start + n].tolist()


# -- tasks ------------------------------------------------------------------------------------------------------------

def _prompt(ids, pos, kind, clusters, variant):
    pos = np.asarray(pos, dtype=np.int64)
    order = np.argsort(pos, kind="stable")
    pos = pos[order]
    assert len(pos) and pos[0] >= 1 and pos[-1] < len(ids) - tail(len(ids)), "scored position in the tail"
    return dict(ids=list(ids), pos=pos, tgt=np.asarray(ids, dtype=np.int64)[pos], kind=kind,
                clusters=np.asarray(clusters, dtype=np.int64)[order], variant=variant)


_NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jamal", "Katya",
          "Lorenzo", "Marta", "Nikolai", "Olga", "Pedro", "Quentin", "Rosa", "Stefan", "Tomas", "Ursula", "Viktor",
          "Wanda", "Xavier", "Yusuf", "Zofia", "Anders", "Beatriz", "Cyrus", "Dagny", "Emeka", "Fiona", "Gustavo",
          "Helga", "Isidro", "Jana", "Kwame", "Leila", "Matteo", "Nadia", "Oskar", "Priya", "Rafael", "Sanna",
          "Tariq", "Ulla", "Valentin", "Yara", "Zoltan", "Agnes"]
_WORDS = ["maple", "otter", "cobalt", "harbor", "quartz", "willow", "falcon", "ember", "glacier", "meadow", "copper",
          "lantern", "saffron", "thistle", "canyon", "velvet", "raven", "juniper", "orbit", "pebble"]


def _facts(tok, rng, fmt, n):
    """n facts as (prefix, value, suffix) token pieces."""
    if fmt == "code":
        return [(encode(tok, f" The secret code of {name} is"),
                 encode(tok, " " + "".join(str(rng.randrange(10)) for _ in range(6))), encode(tok, "."))
                for name in rng.sample(_NAMES, n)]
    keys = rng.sample([f"{a}-{b}" for a in _WORDS for b in _WORDS if a != b], n)
    return [(encode(tok, '\n{"key": "' + key + '", "value": "'),
             encode(tok, f"{rng.choice(_WORDS)}-{rng.randrange(1000, 10000)}"), encode(tok, '"}')) for key in keys]


def _offsets(layout, F, T, n, rng):
    """Filler offsets (facts, questions) of n facts in F filler tokens, or None when they do not fit. A question
    at filler offset <= F - T ends before the tail (only the pieces, P = L - F tokens, precede it)."""
    last_q = F - T
    gap = min(640, last_q // 3)        # depth: a question this far after its fact (> the library's 512 window)
    u = lambda a, b: int(a + (b - a) * rng.random())  # noqa: E731
    if layout == "together":
        q_at = int(min(0.7 * F, last_q))
        if q_at < 0.1 * F + n:
            return None
        return sorted(u(0.1 * F, q_at) for _ in range(n)), [q_at] * n
    if layout == "spread":
        q_lo = int(min(0.85 * F, last_q - max(0.1 * F, 12 * n)))
        f_hi = min(0.8 * F, q_lo)
        if f_hi < 0.02 * F + n:
            return None
        slots = [int(q_lo + (j + rng.random()) / n * (last_q - q_lo)) for j in range(n)]
        rng.shuffle(slots)
        return sorted(u(0.02 * F, f_hi) for _ in range(n)), slots
    f_hi = min(0.9 * F, last_q - gap)
    if f_hi < 0.05 * F + n:
        return None
    facts = [int(0.05 * F + (j + rng.random()) / n * (f_hi - 0.05 * F)) for j in range(n)]
    return facts, [u(f + gap, last_q) for f in facts]


def kv_prompt(tok, filler: Filler, L: int, seed: Union[int, str], layout: str = "together",
              fmt: str = "code") -> dict:
    rng = random.Random(f"kv {seed} {L} {layout} {fmt}")
    T = tail(L)
    facts = _facts(tok, rng, fmt, max(2, min(48, (L - T) // 128)))
    for n in range(len(facts), 0, -1):
        pieces = [p + v + s for p, v, s in facts[:n]]
        F = L - 2 * sum(len(x) for x in pieces)
        placed = _offsets(layout, F, T, n, rng) if F - T >= 0.2 * F else None
        if placed:
            break
    else:
        raise UsageError(f"--lengths: L={L} leaves no room for the kv {layout} layout before its {T}-token tail")
    f_off, q_off = placed
    rank = rng.sample(range(n), n)            # the order of questions that share an offset (together)
    events = sorted([(f_off[i], 0, 0, i) for i in range(n)] + [(q_off[i], 1, rank[i], i) for i in range(n)])
    text = filler.window(F, rng)
    ids, cur, pos, clusters = [], 0, [], []
    for off, is_question, _, i in events:
        ids += text[cur:off]
        cur = off
        prefix, value, suffix = facts[i]
        if is_question:
            base = len(ids) + len(prefix)
            for j, t in enumerate(value):
                if any(c.isalnum() for c in _decode(tok, t)):
                    pos.append(base + j)
                    clusters.append(i)
        ids += prefix + value + suffix
    ids += text[cur:]
    return _prompt(ids, pos, "top1", clusters, f"kv/{layout}" + ("" if fmt == "code" else f"/{fmt}"))


def _decode(tok, t):
    return tok.decode([int(t)])


def copy_prompt(tok, filler: Filler, L: int, seed: Union[int, str]) -> dict:
    rng = random.Random(f"copy {seed} {L}")
    half = (L - tail(L)) // 2
    run: List[int] = []
    while len(run) < half:                    # snippets from random places: not predictable from the text itself
        run += filler.window(rng.randrange(16, 49), rng)
    run = run[:half]
    ids = run + run + filler.window(L - 2 * half, rng)
    pos = np.arange(half, 2 * half)
    return _prompt(ids, pos, "top1", (pos - half) // CLUSTER, "copy")


def nll_prompt(tok, filler: Filler, L: int, seed: Union[int, str]) -> dict:
    rng = random.Random(f"nll {seed} {L}")
    end = L - tail(L)
    pos = np.arange(max(L // 4, end - NLL_MAX), end)
    return _prompt(filler.window(L, rng), pos, "nll", (pos - pos[0]) // CLUSTER, "nll")


def variants(tasks: Sequence[str], layouts: Sequence[str], formats: Sequence[str]) -> List[tuple]:
    """(task, layout, format) of every prompt set: each kv layout x format, then copy and nll."""
    out = []
    for t in tasks:
        out += [("kv", lay, fmt) for fmt in formats for lay in layouts] if t == "kv" else [(t, None, None)]
    return out


def prompt_set(tok, filler: Filler, L: int, variant: tuple, seed: int, min_scored: int,
               max_prompts: int = 64, split: str = "") -> List[dict]:
    """Prompts of one variant (seeds seed * 1000 + j; with a split, '<split> <seed * 1000 + j>') until they score
    >= min_scored tokens."""
    task, layout, fmt = variant
    out: List[dict] = []
    while len(out) < max_prompts and sum(len(p["pos"]) for p in out) < max(min_scored, 1):
        s = seed * 1000 + len(out)
        if split:          # a string seed: no integer --seed (the calibration's, --check's) draws these prompts
            s = f"{split} {s}"
        if task == "kv":
            out.append(kv_prompt(tok, filler, L, s, layout, fmt))
        elif task == "copy":
            out.append(copy_prompt(tok, filler, L, s))
        else:
            out.append(nll_prompt(tok, filler, L, s))
    return out


def prompt_sets(tok, filler: Filler, lengths: Sequence[int], variants_: Sequence[tuple], seed: int, min_scored: int,
                split: str = "") -> Tuple[Dict[int, Dict[str, List[dict]]], Dict[str, dict]]:
    """({L: {variant name: prompts}}, {str(L): {variant name: {prompts, tokens}}}) of one split (prompt_set)."""
    sets: Dict[int, Dict[str, List[dict]]] = {}
    counts: Dict[str, dict] = {}
    for L in lengths:
        sets[L] = {}
        for v in variants_:
            ps = prompt_set(tok, filler, L, v, seed, min_scored, split=split)
            sets[L][ps[0]["variant"]] = ps
        counts[str(L)] = {v: dict(prompts=len(ps), tokens=int(sum(len(p["pos"]) for p in ps)))
                          for v, ps in sets[L].items()}
    return sets, counts


def confirmation_sets(tok, texts: Sequence[str], lengths: Sequence[int], variants_: Sequence[tuple], seed: int,
                      min_scored: int) -> Tuple[Dict[int, Dict[str, List[dict]]], Dict[str, dict], str]:
    """prompt_sets of the confirmation split (the module docstring's Splits) and where their filler comes from: the
    same lengths, variants and sizes as the calibration's (texts, --seed), other prompts."""
    filler = Filler(tok, texts, min_tokens=2 * max(lengths), text_seed=CONFIRM_TEXT_SEED)
    sets, counts = prompt_sets(tok, filler, lengths, variants_, seed, min_scored, split=CONFIRM)
    source = ("the built-in text from another seed" if filler.source == "built-in text" else
              "your text, other offsets")
    return sets, counts, source
