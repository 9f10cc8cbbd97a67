"""bench/accuracy/retrieval.py end to end on the CPU with a tiny config: the task generator's invariants, a few
training steps (no learning asserted), evaluation through the library's CPU reference (dense, default selection,
alpha=0) and the emulator, the sparse path with alpha=0 against dense, and the library's density against the
emulator's on a model whose attention is sharp enough to drop blocks."""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sp = pytest.importorskip("sparse_prefill")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import retrieval as R  # noqa: E402

TINY = dict(vocab=1024, layers=2, d_model=64, n_q_heads=4, n_kv_heads=2, head_dim=64)


def test_task_invariants():
    g = torch.Generator().manual_seed(0)
    B, L, n, nq, kl, vl = 3, 1024, 12, 10, 2, 2
    ids, labels, info = R.make_batch(B, L, n, nq, key_len=kl, val_len=vl, tail=200, gap=100, key_lo=64, vocab=1024,
                                     generator=g)
    P = kl + vl
    q0 = info["q0"]
    assert ids.shape == labels.shape == (B, L) and q0 == L - 200 - nq * P
    assert int(ids.min()) >= R.NSPECIAL and int(ids.max()) < 1024
    for b in range(B):
        seq = ids[b].tolist()
        kvtok = [t for t in seq[:q0] if t >= 512]
        assert len(kvtok) == n * P == len(set(kvtok))  # the pairs' tokens, all distinct, no filler among them
        slots = info["slots"][b].tolist()
        assert min(slots) >= 64 and max(slots) + P <= q0 - 100
        scored = (labels[b] != -100).nonzero().flatten().tolist()
        assert len(scored) == nq * vl
        for t in scored:
            assert labels[b, t] == ids[b, t + 1] >= 512  # the label is the next token, a value token
            assert q0 <= t + 1 < q0 + nq * P and (t + 1 - q0) % P >= kl  # only value tokens of the query region
            assert t + 1 < L - 200  # nothing scored in the tail
        for j in range(nq):
            query = seq[q0 + j * P: q0 + (j + 1) * P]
            # the query's key and value appear together before the query region (the answer is in the context)
            starts = [s for s in range(q0 - P + 1) if seq[s:s + P] == query]
            assert len(starts) == 1 and starts[0] in slots
    # the training batches: queries up to the end, labels only on values
    ids, labels, info = R.make_batch(2, 256, 16, 16, generator=g, vocab=1024)
    assert info["q0"] == 256 - 64 and int((labels != -100).sum()) == 2 * 16 * 2
    pos = R.pose_positions(256, 2048, __import__("numpy").random.default_rng(0), "cpu")
    assert pos.shape == (256,) and bool((pos[1:] > pos[:-1]).all()) and int(pos[-1]) < 2048


def _train_tiny(tmp_path):
    ck = str(tmp_path / "tiny.pt")
    argv = ["train", "--out", ck, "--device", "cpu", "--steps", "5", "--max-len", "512", "--max-pos", "2048",
            "--tokens-per-step", "1024", "--log-every", "1"]
    for k, v in TINY.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    R.main(argv)
    return ck


def test_train_and_eval_end_to_end(tmp_path):
    ck = _train_tiny(tmp_path)
    model, meta = R.load(ck, "cpu")
    assert meta["steps"] == 5 and meta["config"]["d_model"] == 64 and len(meta["log"]) == 5
    assert all(v.dtype in (torch.bfloat16, torch.int64) for v in meta["state_dict"].values())
    out = str(tmp_path / "acc.json")
    json.dump({"rows": [{"model": "other", "task": "copy", "L": 1, "config": "dense"}]}, open(out, "w"))
    R.main(["eval", "--ckpt", ck, "--device", "cpu", "--lengths", "512", "--n-seq", "1", "--out", out,
            "--configs", "dense_sp,default,sp:alpha=0,emu:default,emu:alpha=0,oracle_0.5,dense_torch", "--n-boot",
            "200", "--min-dense-metric", "0"])  # 5 steps: chance-level, let through on purpose
    R.main(["eval", "--ckpt", ck, "--device", "cpu", "--lengths", "512", "--n-seq", "1", "--out", out,
            "--configs", "default", "--index-cost", "--index-L", "512", "--min-dense-metric", "0"])  # merged: same key replaced, others kept
    doc = json.load(open(out))
    rows = doc["rows"]
    keys = [(r["model"], r["task"], r["L"], r["config"]) for r in rows]
    assert len(keys) == len(set(keys)) and ("other", "copy", 1, "dense") in keys
    assert R.model_label(meta) == "retrieval-seed0"  # the training seed names the subject (issue 37)
    mine = {r["config"]: r for r in rows if r["model"] == R.model_label(meta)}
    assert set(mine) == {"dense", "dense_sp", "default", "sp:alpha=0", "emu:default", "emu:alpha=0", "oracle_0.5",
                         "dense_torch"}
    assert mine["oracle_0.5"]["backend"] == "oracle" and mine["oracle_0.5"]["index_ms_128k"] is None
    assert mine["default"]["index_ms_128k"] > 0 and doc["dense_ms_128k"] > 0 and doc["index_cost"]["L"] == 512
    assert abs(mine["dense_torch"]["diff"]) < 0.02 and mine["dense_torch"]["density"] == 1.0
    nq = R.eval_task(512)["n_queries"]
    assert mine["dense"]["n_units"] == nq and mine["dense"]["n_tokens"] == 2 * nq  # one unit per query
    assert (mine["dense"]["layout"], mine["dense"]["format"]) == ("mqar", "tokens")
    for r in mine.values():
        assert r["task"] == "kv_recall" and r["L"] == 512 and 0.0 <= r["metric"] <= 1.0 and 0 < r["density"] <= 1
        assert r["dense_metric"] == mine["dense"]["metric"] and r["commit"] and r["date"]
        assert r["model_arch"] == model.name and r["ci_low"] <= r["diff"] <= r["ci_high"]
    assert mine["sp:alpha=0"]["density"] == 1.0
    assert meta["learned"] is False  # 5 steps at chance: the checkpoint says so ...
    before = json.load(open(out))["rows"]
    with pytest.raises(SystemExit, match="min-dense-metric"):  # ... and the default eval refuses it, writing nothing
        R.main(["eval", "--ckpt", ck, "--device", "cpu", "--lengths", "512", "--n-seq", "1", "--out", out,
                "--configs", "oracle_0.7"])
    assert json.load(open(out))["rows"] == before


def test_estimators_capture_a_retrieval_model(tmp_path):
    """estimators.py's capture of a retrieval checkpoint (issue 44's offline study on the second subject): every
    layer's q, k, v at the prompt's length, the answer rows the evaluation scores, and a score over all its layers
    where the oracle misses at most its mass target's complement and keeps no more than dense."""
    from accuracy import estimators as E
    ck = _train_tiny(tmp_path)
    cap = str(tmp_path / "cap.pt")
    with pytest.raises(SystemExit, match="--L: a positive multiple of 128"):
        E.main(["capture", "--retrieval", ck, "--L", "1000", "--out", cap])
    L = 1024
    E.main(["capture", "--retrieval", ck, "--L", str(L), "--seed", "3", "--out", cap])
    d = torch.load(cap)
    assert sorted(d["layers"]) == list(range(TINY["layers"])) and d["L"] == L
    q, k, v = d["layers"][0]
    assert q.shape == (L, TINY["n_q_heads"], TINY["head_dim"]) and k.shape == v.shape == (L, TINY["n_kv_heads"],
                                                                                          TINY["head_dim"])
    g = torch.Generator().manual_seed(3 * 1000003 + L)  # retrieval.evaluate's first prompt for --seed 3
    _, labels, _ = R.make_batch(1, L, vocab=TINY["vocab"], generator=g, **R.eval_task(L))
    assert d["answer_rows"] == (labels[0] != -100).nonzero().flatten().tolist() and len(d["answer_rows"]) > 0
    acc = E.main(["score", cap, "--layers", "", "--set", "oracle_0.5,oracle_0.9,exact_a0.1,maxcum_0.9",
                  "--device", "cpu"])
    for name, a in acc.items():
        assert 0 < a["kept"] <= a["visible"] and a["ans_n"] == len(d["answer_rows"]) * TINY["n_q_heads"] * 2, name
    for F in (0.5, 0.9):
        assert acc[f"oracle_{F}"]["miss"] / acc[f"oracle_{F}"]["n"] <= 1 - F + 1e-6
    assert acc["oracle_0.5"]["kept"] <= acc["oracle_0.9"]["kept"]


def test_training_stage_advance():
    """The curriculum's rule: a stage moves on at 0.9 running accuracy or at its deadline, but the first one only
    once its plateau is broken (>= LEARNED) or at 60 % of the budget; the last never moves on."""
    dl = [0.25, 0.6, float("inf")]
    adv = lambda stage, acc, prog, steps=100: R.advance(stage, 3, steps, acc, prog, dl)  # noqa: E731
    assert adv(0, 0.95, 0.1) and not adv(0, 0.95, 0.1, steps=10)
    assert not adv(0, 0.0, 0.3) and not adv(0, 0.4, 0.59)       # past the deadline at chance: wait
    assert adv(0, 0.6, 0.3) and adv(0, 0.0, 0.6)                # broken plateau, or out of time
    assert not adv(1, 0.0, 0.5) and adv(1, 0.0, 0.61)           # later stages: the deadline alone
    assert not adv(2, 1.0, 0.99)


def _sharp_model(seed=0):
    """A random tiny model whose q.k logits are large and depend mostly on the relative position (all token
    embeddings near one vector, RoPE does the rest), so that selections drop blocks."""
    torch.manual_seed(seed)
    m = R.RetrievalLM(**TINY).eval()
    with torch.no_grad():
        m.emb.weight.add_(torch.randn(1, TINY["d_model"]))  # init std 0.02 around one vector
        for b in m.blocks:
            b.wq.weight.mul_(40.0)
            b.wk.weight.mul_(40.0)
    return m


def test_sparse_alpha0_equals_dense_and_library_matches_emulator():
    m = _sharp_model()
    L = 1024
    ids, labels, _ = R.make_batch(1, L, vocab=1024, generator=torch.Generator().manual_seed(1), **R.eval_task(L))
    pos = torch.arange(L)
    with torch.no_grad():
        h = {}
        for name, be in [("dense", R.Backend("dense")), ("dense_sp", R.Backend("dense_sp")),
                         ("sp0", R.Backend("sp", dict(alpha=0.0))), ("emu0", R.Backend("emulate", dict(alpha=0.0)))]:
            h[name] = m.hidden(ids, pos, be)
            if be.kind in ("sp", "emulate"):
                assert be.density() == 1.0
        for name in ("dense_sp", "sp0", "emu0"):
            torch.testing.assert_close(h[name], h["dense"], atol=2e-4, rtol=2e-4)
        # a selection that drops blocks: the library's CPU reference and the emulator keep the same blocks
        lib = R.Backend("sp", dict(alpha=0.1, block_size=64, sink=0, window=0, last_n=2, head_subgroups=1,
                                   dense_fraction=1.0))
        emu = R.Backend("emulate", dict(alpha=0.1, block=64, sink=0, window=0, last_n=2, subgroups=1,
                                        dense_fraction=1.0))
        hl, he = m.hidden(ids, pos, lib), m.hidden(ids, pos, emu)
    assert lib.density() < 0.8, lib.density()
    assert (lib.kept, lib.visible) == (emu.kept, emu.visible)
    torch.testing.assert_close(hl, he, atol=2e-3, rtol=2e-3)
    logits, tgt = m.scored_logits(ids, labels, attn=R.Backend("dense"))
    assert logits.shape == (tgt.numel(), 1024) and tgt.numel() == R.eval_task(L)["n_queries"] * 2


def test_configs_parse():
    assert R.parse_config("default")[1].kind == "sp" and R.parse_config("default")[1].args == {}
    assert R.parse_config("sp:alpha=0.01;head_subgroups=2")[1].args == dict(alpha=0.01, head_subgroups=2)
    assert R.parse_config("emu:agg=rowcum;gamma=0.8")[1].args == dict(agg="rowcum", gamma=0.8)
    assert R.parse_config("s3_a001")[1].args["head_subgroups"] == 3
    with pytest.raises(ValueError):
        R.parse_config("nonsense")
