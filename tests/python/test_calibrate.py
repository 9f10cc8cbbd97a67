"""`python -m sparse_prefill.calibrate` on the CPU: the command end to end on a tiny random-weight Llama saved with
save_pretrained (L = 1024, the CPU reference), the files it writes (sparse_prefill.json in the adapters' format,
calibration.json, report.md, the figure), the adapters loading what it wrote, the check mode (the file measured as
the calibration runs it and through the transformers adapter, on other prompts), errors naming the argument, the safe
choice (ties to the most accurate; the library's default when nothing was pruned), the confirmation on a disjoint
prompt set (a choice that fails there replaced by the next safer passing setting; the default when none holds),
validated_lengths in the file, the missing hf extra and matplotlib, and the pieces: prompts, the chunked oracle, the
paired bootstrap, per-layer plans, the search and the confirmation order."""

import json
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import sparse_prefill as sp  # noqa: E402
from sparse_prefill.calibrate import main  # noqa: E402
from sparse_prefill.calibrate import report  # noqa: E402
from sparse_prefill.calibrate import search as S  # noqa: E402
from sparse_prefill.calibrate import tasks as T  # noqa: E402
from sparse_prefill.calibrate.oracle import oracle_attention  # noqa: E402
from sparse_prefill.calibrate.stats import paired_bootstrap  # noqa: E402
from sparse_prefill.integrations import SparsePrefillConfig  # noqa: E402

BASE = "block_size=64;sink=64;window=64;last_n=1"
BASE_SETTINGS = dict(block_size=64, sink=64, window=64, last_n=1)


def tiny_llama(path, D=64):
    """3 layers; layers 0 and 2 attend to the digit tokens (queries a constant bias, keys a digit detector, in the
    RoPE dimensions that barely rotate), so their selections keep few blocks; layer 1 keeps random weights (diffuse:
    the library keeps every block there)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=D, attention_bias=True,
                                   rope_theta=1e12, max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM(cfg)
    tok = T.ByteTokenizer()
    digits = torch.tensor([tok.encode(str(d))[0] for d in range(10)])
    with torch.no_grad():
        e = model.model.embed_tokens.weight[digits].mean(0)
        e /= e.norm()
        u = torch.zeros(D)
        u[D // 4:D // 2] = 1.0
        u[3 * D // 4:] = 1.0
        for i in (0, 2):
            a = model.model.layers[i].self_attn
            a.q_proj.weight.zero_()
            a.q_proj.bias.copy_(u.repeat(4) * 3.0)
            a.k_proj.weight.copy_(torch.outer(u.repeat(2), e) * 3.0)
            a.k_proj.bias.zero_()
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


# The tiny model's command line. --max-drop 20: a random-weight model recalls a handful of its 36 scored kv tokens by
# luck (intervals +-8 points), so on the confirmation prompts the choice drops 14 points where dense had 5 lucky
# hits; 20 lets it hold there (the tests that need it to fail there make it fail).
TINY = ["--lengths", "1024", "--tokenizer", "bytes", "--device", "cpu", "--base", BASE,
        "--candidates", "alpha=0.9,alpha=0.01;head_subgroups=1", "--oracle", "0.5", "--min-scored", "30",
        "--layouts", "spread,depth", "--max-evals", "2", "--n-boot", "200", "--max-drop", "20"]
FIRST = "alpha=0.01;head_subgroups=1"      # the tiny model's choice on the calibration prompts (density 0.67)
SAFER = "alpha=0.9"                        # the other passing setting, denser (0.74)


def fixed_index_time(self, candidates):
    """Calibration.time_index with every index stage at 1 % of dense attention's time in every layer: the choices of
    the tests below then do not follow this machine's timing noise (the real timing: test_index_cost_*)."""
    self.timing = {layer: {"attention": 1.0, "index": {n: 0.01 for n, _ in candidates}}
                   for layer in range(self.n_layers)}
    return self.timing


@pytest.fixture(scope="module")
def calibrated(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("calib"))
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S.Calibration, "time_index", fixed_index_time)
        doc = main([model_dir, *TINY, "--out", out], log=lines.append)
    return doc, out, lines


def test_end_to_end_files_and_rows(calibrated):
    doc, out, lines = calibrated
    for name in ("sparse_prefill.json", "calibration.json", "report.md"):
        assert os.path.isfile(os.path.join(out, name)), name
    try:
        import matplotlib  # noqa: F401
        assert os.path.isfile(os.path.join(out, "calibration.png"))
    except ImportError:
        pass
    saved = json.load(open(os.path.join(out, "calibration.json")))
    assert saved["recommended"] == doc["recommended"] and saved["config"] == doc["config"]
    text = "\n".join(lines)
    for what in ("loading", "L=1024", "dense attention", "alpha=0.9 in every layer",
                 "alpha=0.01;head_subgroups=1 in every layer", "oracle at F=0.5", "probe", "recommended"):
        assert what in text, what
    kinds = [r["kind"] for r in doc["results"]]
    assert kinds[:3] == ["uniform", "uniform", "oracle"] and 1 <= kinds.count("per-layer") <= 2
    variants = {"kv/spread", "kv/depth", "copy", "nll"}
    for r in doc["results"]:
        row = r["lengths"][1024]
        assert set(row["tasks"]) == variants
        for t in row["tasks"].values():
            assert t["low"] - 1e-9 <= t["diff"] <= t["high"] + 1e-9 and t["n_tokens"] >= 30
            assert t["unit"] == ("%" if t is row["tasks"]["nll"] else "points")
        ld = row["layer_density"]
        assert len(ld) == 3 and all(0 < d <= 1 for d in ld) and row["density"] == pytest.approx(np.mean(ld))
        # the cost: the density plus the index stage's share of dense attention's time (none for the oracle)
        assert r["cost"] == pytest.approx(row["density"] + r["index_share"])
        sparse_layers = 3 if r["kind"] != "per-layer" else sum(n != "dense" for n in r["plan"].values())
        assert r["index_share"] == pytest.approx(0.0 if r["kind"] == "oracle" else 0.01 * sparse_layers / 3)
        if r["kind"] == "uniform":
            assert ld[1] == 1.0 and min(ld[0], ld[2]) < 0.8      # the diffuse layer dense, the others sparse
        if r["kind"] == "per-layer":
            for layer, name in r["plan"].items():
                assert name == "dense" or name in doc["candidates"]
                if name == "dense":
                    assert ld[int(layer)] == 1.0
    # the recommendation: the cheapest setting within the tolerance
    ok = [r for r in doc["results"] if r["passes"] and r["kind"] != "oracle"]
    rec = next(r for r in doc["results"] if r["name"] == doc["recommended"])
    assert rec["passes"] and rec["cost"] <= min(r["cost"] for r in ok) * (1 + S.COST_TIE)   # ties: most accurate
    report = open(os.path.join(out, "report.md")).read()
    assert "## Recommendation" in report and doc["recommended"] in report and "## Per layer" in report
    assert not doc["no_pruning"] and doc["lowest_density"] < 0.8 and "nothing was pruned" not in text


def test_end_to_end_records_the_confirmation(calibrated):
    """The choice measured again on the confirmation prompts (same lengths and tasks, other prompts), where it held:
    recorded in calibration.json (both sets' numbers), the log and report.md; the file is the choice's."""
    doc, out, lines = calibrated
    c = doc["confirmation"]
    assert c["outcome"] == "confirmed" and c["first"] == c["confirmed"] == doc["recommended"] == FIRST
    assert c["split"] == T.CONFIRM and c["max_confirm"] == S.CONFIRM_MAX and c["order"] == [FIRST, SAFER]
    assert [r["name"] for r in c["results"]] == [FIRST]              # it held: nothing safer measured
    held = c["results"][0]
    assert held["passes"] and held["worst_drop"]["diff"] >= -20 and held["worst_nll"]["diff"] <= 0.5
    rec = next(r for r in doc["results"] if r["name"] == FIRST)
    assert c["calibration"][FIRST] == dict(worst_drop=rec["worst_drop"], worst_nll=rec["worst_nll"], cost=rec["cost"])
    assert held["lengths"][1024]["tasks"].keys() == rec["lengths"][1024]["tasks"].keys()   # the same task mix
    assert c["prompts"]["1024"].keys() == doc["prompts"]["1024"].keys()
    assert held["lengths"][1024]["tasks"] != rec["lengths"][1024]["tasks"]                # other prompts
    assert json.load(open(os.path.join(out, "calibration.json")))["confirmation"]["confirmed"] == FIRST
    assert json.load(open(os.path.join(out, "sparse_prefill.json"))) == doc["config"] == \
        {**BASE_SETTINGS, "alpha": 0.01, "head_subgroups": 1, "validated_lengths": [1024]}
    text = "\n".join(lines)
    assert f"confirmation 1/2: {FIRST}" in text and f"confirmed on {c['n_prompts']} other prompts" in text
    md = open(os.path.join(out, "report.md")).read()
    assert "## Confirmation" in md and f"Confirmation: confirmed on {c['n_prompts']} other prompts: worst" in md
    assert f"| {FIRST} | " in md.split("## Confirmation")[1].split("## Settings measured")[0]


def _failing_on_confirmation(monkeypatch, names):
    """Settings in `names` fail on the confirmation prompts (whatever they measure there): wraps the confirmation
    split's prompt sets and Calibration.evaluate on them."""
    made, evaluate = [], S.Calibration.evaluate

    def sets(*a, **k):
        out = T_confirmation_sets(*a, **k)
        made.append(out[0])
        return out

    def forced(self, name, *a, **k):
        r = evaluate(self, name, *a, **k)
        if any(self.sets is m for m in made) and name in names:
            r["passes"] = False
        return r
    T_confirmation_sets = T.confirmation_sets
    monkeypatch.setattr(T, "confirmation_sets", sets)
    monkeypatch.setattr(S.Calibration, "evaluate", forced)
    monkeypatch.setattr(S.Calibration, "time_index", fixed_index_time)    # the choices of `calibrated`
    return made


def test_a_choice_that_fails_confirmation_is_replaced_by_the_next_safer(model_dir, tmp_path, monkeypatch):
    made = _failing_on_confirmation(monkeypatch, {FIRST})
    lines = []
    doc = main([model_dir, *TINY, "--out", str(tmp_path)], log=lines.append)
    assert len(made) == 1
    c = doc["confirmation"]
    assert c["outcome"] == "replaced" and c["first"] == FIRST and c["confirmed"] == doc["recommended"] == SAFER
    assert [(r["name"], r["passes"]) for r in c["results"]] == [(FIRST, False), (SAFER, True)]
    assert json.load(open(tmp_path / "sparse_prefill.json")) == doc["config"] == \
        {**BASE_SETTINGS, "alpha": 0.9, "validated_lengths": [1024]}
    assert doc["plan"] == {str(i): SAFER for i in range(3)}
    text = "\n".join(lines)
    assert f"{FIRST} fails on the confirmation prompts: the next safer" in text
    assert f"recommended: {SAFER}" in text
    md = (tmp_path / "report.md").read_text()
    assert f"**{SAFER}** (uniform)" in md and f"{FIRST} fails (" in md and f"{SAFER}, safer, is confirmed" in md


def test_nothing_confirmed_runs_dense_and_says_why(model_dir, tmp_path, monkeypatch):
    # every setting confirmed (the densest passing one last) fails on the other prompts: as when nothing passes at
    # all, every layer runs dense (the default is no safer answer: it did not pass the confirmation either)
    _failing_on_confirmation(monkeypatch, {FIRST, SAFER})
    lines = []
    doc = main([model_dir, *TINY, "--out", str(tmp_path)], log=lines.append)
    c = doc["confirmation"]
    assert c["outcome"] == "none" and c["confirmed"] is None and [r["name"] for r in c["results"]] == [FIRST, SAFER]
    assert doc["recommended"] is None and set(doc["plan"].values()) == {"dense"} and not doc["no_pruning"]
    written = json.load(open(tmp_path / "sparse_prefill.json"))
    assert written == doc["config"]
    cfg = SparsePrefillConfig.load(config_file=str(tmp_path / "sparse_prefill.json"), environ={})
    assert cfg.dense_layers == 3  # the tiny model's every layer
    why = "no setting held on the confirmation prompts"
    assert why in doc["note"] and FIRST in doc["note"] and SAFER in doc["note"] and "every layer dense" in doc["note"]
    text = "\n".join(lines)
    assert why in text and "runs every layer dense" in text
    md = (tmp_path / "report.md").read_text()
    assert f"**Every layer dense**: {why}" in md and "## Confirmation" in md


def test_confirmation_prompts_are_disjoint_from_calibration_and_check():
    """The confirmation split: the same lengths, tasks and sizes as the calibration's, none of its prompts, and none
    of --check's (its defaults, seed 0 and the code format, are the calibration's; the documented held-out check
    takes --seed 1 and the record format), with the built-in text or the user's."""
    tok = T.ByteTokenizer()
    L, lengths = 1024, [1024]
    every = T.variants(T.TASKS, T.LAYOUTS, T.FORMATS)
    for texts in ([], [T.builtin_text(40000, seed=7)]):
        filler = T.Filler(tok, texts, min_tokens=2 * L)        # as cli.run builds the calibration's and --check's
        conf, counts, _ = T.confirmation_sets(tok, texts, lengths, every, 0, 30)
        others = [T.prompt_sets(tok, filler, lengths, every, seed, 30)[0] for seed in (0, 1, 2)]
        assert conf[L].keys() == others[0][L].keys()          # the same task mix
        for v in conf[L]:
            assert len(conf[L][v]) == len(others[0][L][v]) and all(len(p["ids"]) == L for p in conf[L][v])
        seen = {tuple(p["ids"]) for sets in others for ps in sets[L].values() for p in ps}
        mine = [tuple(p["ids"]) for ps in conf[L].values() for p in ps]
        assert len(set(mine)) == len(mine) and not seen & set(mine)
        for v in ("kv/depth", "kv/spread/record"):            # other facts, not only other filler
            assert conf[L][v][0]["tgt"].tolist() != others[0][L][v][0]["tgt"].tolist()
        # the NLL text: with the built-in text another text (no 64 tokens of it in the calibration's filler); with
        # the user's, the same text at another offset
        piece = bytes(np.asarray(conf[L]["nll"][0]["ids"][:64], np.uint8))
        assert (piece in bytes(filler.ids.astype(np.uint8))) == bool(texts)


def test_written_file_is_what_the_adapters_load(calibrated):
    doc, out, _ = calibrated
    path = os.path.join(out, "sparse_prefill.json")
    cfg = SparsePrefillConfig.load(config_file=path, environ={})
    assert json.load(open(path)) == cfg.file_dict() == doc["config"]
    assert cfg.validated_lengths == doc["validated_lengths"] == [1024]          # the lengths it was measured at
    for layer, name in doc["plan"].items():
        layer = int(layer)
        if name == "dense":
            assert cfg.layer_dense(layer)
        else:
            want = SparsePrefillConfig(**{**BASE_SETTINGS, **doc["candidates"][name]}).selection()
            assert not cfg.layer_dense(layer) and cfg.selection(layer) == want


def test_plan_config_writes_layers_that_round_trip(tmp_path):
    cands = {"alpha=0.9": {"alpha": 0.9}, "alpha=0.01;head_subgroups=1": {"alpha": 0.01, "head_subgroups": 1}}
    plan = {0: "alpha=0.9", 1: None, 2: "alpha=0.01;head_subgroups=1", 3: "alpha=0.9"}
    cfg = S.plan_config(plan, cands, BASE_SETTINGS)
    assert cfg.file_dict() == {**BASE_SETTINGS, "alpha": 0.9, "layers": {
        "1": {"dense": True}, "2": {"alpha": 0.01, "head_subgroups": 1}}}
    cfg.save(str(tmp_path / "c.json"))
    back = SparsePrefillConfig.load(config_file=str(tmp_path / "c.json"), environ={})
    for layer, name in plan.items():
        assert back.layer_dense(layer) == (name is None)
        if name:
            assert back.selection(layer) == SparsePrefillConfig(**{**BASE_SETTINGS, **cands[name]}).selection()


def test_check_mode_reproduces_through_the_transformers_adapter(model_dir, tmp_path):
    """A per-layer file measured on prompts it was not calibrated on (another seed and layout): as the calibration
    runs it and through the transformers adapter, with the same outcomes; the adapter ran the dense layer dense."""
    path = tmp_path / "sparse_prefill.json"
    path.write_text(json.dumps({**BASE_SETTINGS, "alpha": 0.9, "layers": {"1": {"dense": True},
                                                                      "2": {"alpha": 0.01, "head_subgroups": 1}}}))
    doc = main([model_dir, "--check", str(path), "--lengths", "1024", "--tokenizer", "bytes", "--out",
                str(tmp_path / "out"), "--device", "cpu", "--seed", "1", "--layouts", "together", "--tasks", "kv,nll",
                "--min-scored", "30", "--n-boot", "200"], log=lambda *a: None)
    assert doc["mode"] == "check" and doc["config"] is None and not os.path.exists(tmp_path / "out" /
                                                                                     "sparse_prefill.json")
    file_row, adapter_row = doc["results"]
    assert file_row["kind"] == "file" and adapter_row["kind"] == "adapter"
    # its cost counts the file's index stages, as the calibration's does (the dense layer has none)
    assert file_row["index_share"] > 0 and file_row["cost"] == pytest.approx(
        file_row["lengths"][1024]["density"] + file_row["index_share"])
    ld = file_row["lengths"][1024]["layer_density"]
    assert ld[1] == 1.0 and ld[0] < 1.0 and ld[2] < 1.0
    prompts = sum(c["prompts"] for c in doc["prompts"]["1024"].values())
    assert adapter_row["lengths"][1024]["adapter_calls"] == {"sparse": 2 * prompts, "dense": prompts}
    for v, t in file_row["lengths"][1024]["tasks"].items():
        assert adapter_row["lengths"][1024]["tasks"][v]["metric"] == pytest.approx(t["metric"], rel=1e-6, abs=1e-9)
    assert "## Check" in open(tmp_path / "out" / "report.md").read()


@pytest.mark.parametrize("argv,name", [
    (["--lengths", "100"], "--lengths"), (["--lengths", "4k"], "--lengths"), (["--max-drop", "-1"], "--max-drop"),
    (["--max-nll", "x"], "--max-nll"), (["--candidates", "alpah=0.1"], "--candidates"),
    (["--candidates", "alpha=0.1;block_size=256"], "--candidates"), (["--candidates", "rule=best"], "--candidates"),
    (["--base", "sink=-1"], "--base"), (["--oracle", "1.5"], "--oracle"), (["--tasks", "kv,qa"], "--tasks"),
    (["--layouts", "zigzag"], "--layouts"), (["--min-scored", "0"], "--min-scored"), (["--device", "tpu"], "--device"),
    (["--max-confirm", "-1"], "--max-confirm"),
    (["--text", "/nonexistent/notes.txt"], "--text"), (["--check", "/nonexistent/sp.json"], "--check"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer"),
])
def test_bad_values_name_the_argument(model_dir, argv, name, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main([model_dir, "--out", str(tmp_path), "--device", "cpu", *argv] if "--device" not in argv else
             [model_dir, "--out", str(tmp_path), *argv], log=lambda *a: None)
    assert e.value.code == 2
    assert name in capsys.readouterr().err


def test_bad_model_and_short_text_name_the_argument(tmp_path, capsys, model_dir):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), "--device", "cpu", "--out", str(tmp_path)], log=lambda *a: None)
    assert "MODEL" in capsys.readouterr().err
    text = tmp_path / "short.txt"
    text.write_text("Only a few words here.")
    with pytest.raises(SystemExit):
        main([model_dir, "--device", "cpu", "--tokenizer", "bytes", "--lengths", "1024", "--text", str(text),
              "--out", str(tmp_path)], log=lambda *a: None)
    assert "--text" in capsys.readouterr().err
    if not (torch.cuda.is_available() and sp.with_cuda):
        with pytest.raises(SystemExit):
            main([model_dir, "--device", "cuda", "--out", str(tmp_path)], log=lambda *a: None)
        assert "--device" in capsys.readouterr().err


# -- the pieces ---------------------------------------------------------------------------------------------------

def test_prompts_recall_what_they_stated_and_score_nothing_in_the_tail():
    tok = T.ByteTokenizer()
    filler = T.Filler(tok, None, min_tokens=8192)
    for layout in T.LAYOUTS:
        for fmt in T.FORMATS:
            p = T.kv_prompt(tok, filler, 2048, 0, layout, fmt)
            ids, pos = np.asarray(p["ids"]), p["pos"]
            assert len(ids) == 2048 and pos.max() < 2048 - T.tail(2048) and pos.min() >= 1
            for c in np.unique(p["clusters"]):                 # each answer appeared earlier, token for token
                scored = pos[p["clusters"] == c]                # (its span: unscored '-' of a record value inside)
                first = scored[0]
                answer = ids[first:scored[-1] + 1]
                seen = ids[:first]
                assert any((seen[i:i + len(answer)] == answer).all() for i in range(first - len(answer)))
            assert p["ids"] == T.kv_prompt(tok, filler, 2048, 0, layout, fmt)["ids"]      # deterministic
            assert p["ids"] != T.kv_prompt(tok, filler, 2048, 1, layout, fmt)["ids"]
    c = T.copy_prompt(tok, filler, 2048, 0)
    half = (2048 - T.tail(2048)) // 2
    assert c["ids"][:half] == c["ids"][half:2 * half] and c["pos"][0] == half
    n = T.nll_prompt(tok, filler, 2048, 0)
    assert n["kind"] == "nll" and n["pos"][-1] == 2048 - T.tail(2048) - 1


def test_user_text_is_the_filler():
    tok = T.ByteTokenizer()
    text = "zqx " * 3000
    f = T.Filler(tok, [text])
    p = T.kv_prompt(tok, f, 2048, 0, "spread")
    assert T.encode(tok, "zqx ")[0] in p["ids"] and f.source == "user text"
    n = T.nll_prompt(tok, f, 2048, 0)
    assert set(n["ids"]) <= set(T.encode(tok, "zqx "))
    with pytest.raises(T.UsageError, match="--text"):
        T.Filler(tok, ["tiny"]).window(100, __import__("random").Random(0))


def test_oracle_chunks_and_full_mass():
    q, k, v = (torch.from_numpy(x) for x in sp.workload.topic(1500, 4, 2, 64, seed=1, block=64))
    geo = dict(block_size=64, sink=64, window=128, last_n=1)
    big, kept, vis = oracle_attention(q, k, v, 0.125, 0.5, mem_bytes=2 << 30, **geo)
    small, kept2, vis2 = oracle_attention(q, k, v, 0.125, 0.5, mem_bytes=256 * 1600 * 16, **geo)   # 256-row chunks
    assert (kept, vis) == (kept2, vis2) and kept < vis
    torch.testing.assert_close(big, small, atol=1e-5, rtol=1e-5)
    _, kept9, _ = oracle_attention(q, k, v, 0.125, 0.9, **geo)
    assert kept < kept9                                        # more mass, more blocks
    full, kept1, vis1 = oracle_attention(q, k, v, 0.125, 1.0, **geo)
    cu = torch.tensor([0, 1500], dtype=torch.int32)
    dense = sp.attention(q, k, v, cu, cu, 1500, 1500, softmax_scale=0.125, return_lse=False)
    assert kept1 <= vis1
    torch.testing.assert_close(full, dense, atol=2e-5, rtol=1e-4)


def naive_oracle(q, k, v, scale, frac, block_size, sink, window, last_n):
    """The oracle as its docstring states it, on whole [L, L] matrices in float64: the chunked one's reference."""
    L, Hq, D = q.shape
    g = Hq // k.shape[1]
    nb = -(-L // block_size)
    tiles = -(-L // 128)
    out = torch.zeros(L, Hq, v.shape[2], dtype=torch.float64)
    kept = visible = 0
    blk = torch.arange(L) // block_size
    for h in range(Hq):
        s = (q[:, h].double() @ k[:, h // g].double().T) * scale
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
        p = torch.softmax(s, 1)
        mass = torch.zeros(L, nb, dtype=torch.float64).index_add_(1, blk, p)
        for t in range(tiles):
            r0, r1 = t * 128, min(L, t * 128 + 128)
            vis = [j for j in range(nb) if j * block_size <= r1 - 1]
            always = {j for j in vis if j * block_size < sink or min(L, (j + 1) * block_size) - 1 > r0 - 1
                      or t >= tiles - last_n or (window > 0 and min(L, (j + 1) * block_size) - 1 >= r0 - window + 1)}
            keep = set(always)
            for r in range(r0, r1):
                got = sum(float(mass[r, j]) for j in always)
                for j in sorted((j for j in vis if j not in always), key=lambda j: -float(mass[r, j])):
                    if got >= frac or mass[r, j] <= 0:
                        break
                    keep.add(j)
                    got += float(mass[r, j])
            cols = torch.zeros(L, dtype=torch.bool)
            for j in keep:
                cols[j * block_size:(j + 1) * block_size] = True
            pk = p[r0:r1] * cols[None]
            out[r0:r1, h] = (pk @ v[:, h // g].double()) / pk.sum(1, keepdim=True)
            kept += len(keep)
            visible += len(vis)
    return out, kept, visible


@pytest.mark.parametrize("L,frac", [(389, 0.5), (1001, 0.8)])
def test_oracle_matches_the_naive_statement(L, frac):
    """Fresh inputs (the topic workload, whose tiles agree on few blocks, at a seed of its own), odd lengths, GQA:
    the chunked oracle keeps what the naive statement keeps and computes the same attention."""
    q, k, v = (torch.from_numpy(x) for x in sp.workload.topic(L, 4, 2, 32, seed=L, block=32))
    geo = dict(block_size=32, sink=32, window=64, last_n=1)
    got, kept, vis = oracle_attention(q, k, v, 0.3, frac, mem_bytes=128 * (L + 128) * 16, **geo)   # 128-row chunks
    want, kept_n, vis_n = naive_oracle(q, k, v, 0.3, frac, **geo)
    assert (kept, vis) == (kept_n, vis_n) and kept < vis
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_paired_bootstrap():
    rng = np.random.default_rng(0)
    dense = [rng.integers(0, 2, 300).astype(float) for _ in range(3)]
    clusters = [np.arange(300) // 6 for _ in range(3)]
    assert paired_bootstrap(dense, dense, clusters) == (0.0, 0.0, 0.0)
    worse = [d.copy() for d in dense]
    for w in worse:
        w[:60] = 0.0                                            # ten answers lost in each prompt
    diff, lo, hi = paired_bootstrap(dense, worse, clusters, n_boot=500)
    lost = sum(d[:60].sum() for d in dense) / 900
    assert diff == pytest.approx(-lost) and lo < diff < hi < 0
    assert paired_bootstrap(dense, worse, clusters, n_boot=500) == (diff, lo, hi)    # seeded


def test_plans_search_and_choice():
    probe = {0: {"a": dict(err=0.1, density=0.6), "b": dict(err=0.5, density=0.3)},
             1: {"a": dict(err=0.9, density=0.7), "b": dict(err=0.95, density=0.4)}}
    levels = S.plans(probe, ["a", "b"], 2)
    assert levels == [{0: "a", 1: None}, {0: "b", 1: None}, {0: "b", 1: "a"}, {0: "b", 1: "b"}]
    # with index shares: a layer takes its cheapest candidate by density plus share, and dense where every candidate
    # within the budget costs dense attention's or more
    shares = {0: {"a": 0.1, "b": 0.5}, 1: {"a": 0.35, "b": 0.65}}
    assert S.plans(probe, ["a", "b"], 2, layer_share=shares) == [{0: "a", 1: None}]
    measured = []

    def measure(plan, i):
        measured.append(i)
        return dict(passes=i <= 1, kind="per-layer", cost=1.0 - 0.1 * i, name=f"p{i}")

    results = S.search(levels, measure, max_evals=5, log=lambda *a: None)
    assert measured == [3, 1, 2]                                # the cheapest first, then bisection
    assert S.choose(results)["name"] == "p1"
    assert S.search(levels, measure, max_evals=1, log=lambda *a: None)[0]["name"] == "p3"
    uniform = dict(passes=True, kind="uniform", cost=0.9, name="u")
    assert S.choose(results + [uniform])["name"] == "u"        # cost 0.9 = p1's: the uniform setting wins the tie
    assert S.choose([dict(passes=False, kind="uniform", cost=0.2, name="x")]) is None
    assert S.choose([dict(passes=True, kind="oracle", cost=0.1, name="o")]) is None     # the oracle is no setting


def _res(name, cost, drop=0.0, kind="uniform", passes=True, config=None):
    return dict(name=name, kind=kind, passes=passes, cost=cost, config=config or {"name": name},
                worst_drop=dict(diff=-drop, low=-drop, high=-drop), worst_nll=dict(diff=0.0, low=0.0, high=0.0))


def test_confirmation_order_and_replacement():
    """Synthetic measurements: the choice first, then the passing settings denser than it (uniform or per-layer),
    the cheapest first; the cap keeps the densest last; a failing choice is replaced by the first safer one that
    holds."""
    results = [_res("u.1", 0.40, 5.0, passes=False), _res("p11", 0.50, 0.3, "per-layer"),
               _res("tie", 0.505, 0.9, "per-layer"), _res("p10", 0.55, 0.8, "per-layer"),
               _res("p8", 0.60, 0.2, "per-layer"), _res("p16 (= u.001)", 0.90, 0.1, "per-layer", config={"a": 1}),
               _res("u.001", 0.90, 0.1, config={"a": 1}), _res("oracle F=0.9", 0.70, 0.1, "oracle"),
               _res("default", 0.85, 1.1, passes=False)]
    chosen = S.choose(results)
    assert chosen["name"] == "p11"
    names = lambda rs: [r["name"] for r in rs]  # noqa: E731
    # 'tie' is within COST_TIE but less accurate (not safer); the plan equal to u.001 once; no oracle, no failing
    assert names(S.confirmation_order(results, chosen, 10)) == ["p11", "p10", "p8", "u.001"]
    assert names(S.confirmation_order(results, chosen, 3)) == ["p11", "p10", "u.001"]       # the densest last
    assert names(S.confirmation_order(results, chosen, 2)) == ["p11", "u.001"]
    assert names(S.confirmation_order(results, chosen, 1)) == ["p11"]
    assert S.confirmation_order(results, chosen, 0) == [] and S.confirmation_order(results, None, 3) == []
    measured = []

    def measure(holds):
        def m(r):
            measured.append(r["name"])
            return dict(name=r["name"], passes=r["name"] in holds)
        return m
    order = S.confirmation_order(results, chosen, 3)
    got, done = S.confirm(order, measure({"p10", "u.001"}), log=lambda *a: None)
    assert got["name"] == "p10" and got is results[3] and measured == ["p11", "p10"]            # stops there
    assert [(d["name"], d["passes"]) for d in done] == [("p11", False), ("p10", True)]
    measured.clear()
    got, done = S.confirm(order, measure({"p11"}), log=lambda *a: None)
    assert got is chosen and measured == ["p11"]
    measured.clear()
    got, done = S.confirm(order, measure(set()), log=lambda *a: None)
    assert got is None and measured == ["p11", "p10", "u.001"] and not any(d["passes"] for d in done)


def test_choice_ties_keep_the_most_accurate():
    def r(name, cost, drop, nll=0.0, kind="uniform"):
        return dict(name=name, kind=kind, passes=True, cost=cost, worst_drop=dict(diff=-drop, low=-drop, high=-drop),
                    worst_nll=dict(diff=nll, low=nll, high=nll))
    # equal cost: the smallest worst top-1 drop, not the first measured
    assert S.choose([r("alpha=0.1", 0.9, 3.0), r("default", 0.9, 0.5), r("alpha=0.001", 0.9, 0.0)])["name"] == \
        "alpha=0.001"
    # a setting that costs dense attention's time or more (density plus index share >= 1) is never the choice: the
    # all-dense setting is exact and no slower
    assert S.choose([r("slow", 1.0, 0.0), r("slower", 1.3, 0.0)]) is None
    assert S.choose([r("slow", 1.02, 0.0), r("cheap", 0.95, 0.9)])["name"] == "cheap"
    # within COST_TIE of the cheapest counts as equal; a real cost difference goes to the cheaper passing setting
    assert S.choose([r("a", 0.50, 0.8), r("b", 0.50 * (1 + S.COST_TIE / 2), 0.1)])["name"] == "b"
    assert S.choose([r("a", 0.50, 0.8), r("b", 0.60, 0.1)])["name"] == "a"
    # equal drops: the smaller NLL increase; a top-1 gain counts as no drop
    assert S.choose([r("a", 0.5, 0.0, nll=0.4), r("b", 0.5, 0.0, nll=0.1)])["name"] == "b"
    assert S.choose([r("a", 0.5, -2.0, nll=0.3), r("b", 0.5, 0.0, nll=0.1)])["name"] == "b"
    # equal accuracy: uniform before per-layer, whatever the order
    assert S.choose([r("p", 0.5, 0.0, kind="per-layer"), r("u", 0.5, 0.0)])["name"] == "u"


def test_no_pruning_writes_the_default_and_says_so(model_dir, tmp_path, monkeypatch):
    """The library's default geometry at L = 1024 keeps every block (sink, window and last tiles cover the prompt):
    the candidates cannot be told apart, so the file holds the default selection (not alpha=0.1, measured first);
    without matplotlib the log and the report say why there is no figure."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    lines = []
    doc = main([model_dir, "--lengths", "1024", "--tokenizer", "bytes", "--out", str(out), "--device", "cpu",
                "--candidates", "alpha=0.1,default,alpha=0.001", "--oracle", "0.5,0.9", "--max-evals", "2",
                "--layouts", "spread", "--tasks", "kv,nll", "--min-scored", "30", "--n-boot", "200"],
               log=lines.append)
    uniform = [r for r in doc["results"] if r["kind"] == "uniform"]
    assert len(uniform) == 3 and all(r["lengths"][1024]["density"] == 1.0 for r in uniform)   # every block kept
    assert all(r["cost"] > 1.0 for r in uniform)                        # dense attention plus an index stage
    # nothing any plan of them could prune: no probe, no plans, one oracle fraction (the highest) for the report
    assert [r["name"] for r in doc["results"] if r["kind"] != "uniform"] == ["oracle F=0.9"]
    assert doc["probe"] is None and "no per-layer plan of these candidates can prune" in "\n".join(lines)
    assert doc["recommended"] == "default" and set(doc["plan"].values()) == {"default"}
    assert doc["no_pruning"] and doc["lowest_density"] == 1.0
    written = json.load(open(out / "sparse_prefill.json"))
    assert written == doc["config"] == {"validated_lengths": [1024]}
    cfg = SparsePrefillConfig.load(config_file=str(out / "sparse_prefill.json"), environ={})
    assert cfg.selection() == SparsePrefillConfig().selection()
    assert cfg.selection()["alpha"] == sp.SELECTION_DEFAULTS["alpha"]
    text = "\n".join(lines)
    assert "nothing was pruned" in text and "default selection" in text
    md = (out / "report.md").read_text()
    assert "nothing was pruned" in md and "default selection" in md
    assert report.NO_FIGURE in text and report.NO_FIGURE in md and not (out / "calibration.png").exists()
    assert "matplotlib" in report.NO_FIGURE


def test_index_cost_counts_and_can_make_dense_the_choice(model_dir, tmp_path, monkeypatch):
    """A setting's cost is its density plus its index stage's time over dense attention's: with index stages
    timed at half of dense attention's in every layer, no candidate of the tiny model (densities 0.67-0.74) is
    cheaper than dense attention, so the file runs every layer dense and the log says why; a plan's share counts
    only its sparse layers."""
    def time_index(self, candidates):
        self.timing = {layer: {"attention": 2.0, "index": {n: 1.0 for n, _ in candidates}} for layer in range(3)}
        return self.timing
    monkeypatch.setattr(S.Calibration, "time_index", time_index)
    lines = []
    doc = main([model_dir, *TINY, "--out", str(tmp_path / "out"), "--oracle", "", "--max-evals", "0"],
               log=lines.append)
    uniform = [r for r in doc["results"] if r["kind"] == "uniform"]
    assert uniform and all(r["index_share"] == pytest.approx(0.5) for r in uniform)
    assert all(r["cost"] == pytest.approx(r["lengths"][1024]["density"] + 0.5) for r in uniform)
    assert all(r["cost"] > 1.0 for r in uniform)
    assert any(r["passes"] for r in uniform) and doc["recommended"] is None
    assert doc["config"]["dense_layers"] == 3 and not doc["no_pruning"]
    assert "cheaper than dense attention" in "\n".join(lines)
    cal = S.Calibration.__new__(S.Calibration)
    time_index(cal, [("a", None)])
    assert cal.index_share({"0": "a", "1": "dense", "2": "a"}) == pytest.approx(1 / 3)
    assert cal.index_share(None) == 0.0


def test_cost_text():
    assert S.cost_text(dict(cost=0.704, index_share=0.0)) == "density 0.704"
    assert S.cost_text(dict(cost=0.8, index_share=0.1)) == \
        "cost 0.800 = density 0.700 + index 0.100 (~1.25x dense attention's speed)"


def test_plans_can_prune():
    def r(layers, kind="uniform"):
        return dict(kind=kind, lengths={1024: dict(layer_density=layers)})
    # each candidate prunes a different layer: a plan taking the sparsest per layer prunes 1/3 on average
    assert S.plans_can_prune([r([1.0, 1.0, 0.0]), r([0.0, 1.0, 1.0])])
    assert not S.plans_can_prune([r([1.0, 1.0, 0.9]), r([0.95, 1.0, 1.0])])     # 0.95 on average: NO_PRUNING
    assert not S.plans_can_prune([r([0.1, 0.1, 0.1], kind="oracle")])            # the oracle is no candidate


def test_pruned_nothing_margin():
    def r(densities, kind="uniform"):
        return dict(kind=kind, lengths={L: dict(density=d) for L, d in densities.items()})
    assert S.pruned_nothing([r({4096: 1.0, 8192: 1.0 - S.NO_PRUNING / 2})])
    assert not S.pruned_nothing([r({4096: 1.0, 8192: 1.0}), r({4096: 0.99, 8192: 0.9})])
    assert not S.pruned_nothing([r({4096: 0.5}, kind="oracle")])        # the oracle is no setting: nothing known
    assert S.lowest_density([r({4096: 0.97}), r({4096: 0.5}, kind="oracle")]) == 0.97


@pytest.mark.parametrize("module", ["transformers", "torch"])
def test_missing_hf_extra_is_one_line(module, monkeypatch, capsys, tmp_path):
    """Without transformers (pip install '.[torch]') or torch: one line naming the extra, before the missing MODEL."""
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")], log=lambda *a: None)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sparse-prefill[hf]" in err[0] and module in err[0], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:                                # --help needs neither
        main(["--help"])
    assert e.value.code == 0 and "--lengths" in capsys.readouterr().out


def test_missing_matplotlib_report_says_why(calibrated, tmp_path, monkeypatch):
    doc, _, _ = calibrated
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = report.write(doc, str(tmp_path), None)
    assert "figure" not in paths and paths["figure_note"] == report.NO_FIGURE
    assert report.NO_FIGURE in open(paths["report"]).read() and not (tmp_path / "calibration.png").exists()
