"""bench/accuracy/run.py end to end on the CPU with a tiny random Llama (transformers) and a byte tokenizer: the rows
of issue 37's results file (model, task, layout, format, L, config, density, metric, dense_metric, ci_low, ci_high,
index_ms_128k; top-level dense_ms_128k, commit, date, device, command, through_package), the oracle and emulator
routes, the library route through the CPU reference (when sparse_prefill is built), configs.py's names."""
import importlib.util
import json
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import configs as C  # noqa: E402
from accuracy import model as M  # noqa: E402
from accuracy import run as RUN  # noqa: E402

HAVE_SP = importlib.util.find_spec("sparse_prefill") is not None


class ByteTok:
    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [b + 3 for b in s.encode()]}

    def decode(self, ids):
        return bytes(max(0, i - 3) for i in ids).decode(errors="replace")


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    M.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    cfg._attn_implementation = "sp_route"
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharp attention, so that selections differ from dense
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    return M.Model(hf_model=hf, tok=ByteTok(), name="tiny-llama")


REQUIRED = ("model", "task", "layout", "format", "L", "config", "density", "metric", "dense_metric", "ci_low",
            "ci_high", "index_ms_128k")


def _run(tmp_path, backend, configs, extra=()):
    out = str(tmp_path / f"acc_{backend}.json")
    args = RUN.build_args(["--backend", backend, "--lengths", "1536", "--tasks", "copy,ppl,kv", "--layouts", "depth",
                           "--formats", "code", "--min-scored", "60", "--min-prompts", "1", "--n-boot", "300",
                           "--configs", configs, "--out", out, *extra])
    RUN.run(args, tiny_model(), log=lambda *a: None)
    return json.load(open(out))


def test_emulator_and_oracle_rows(tmp_path):
    doc = _run(tmp_path, "emulate", "default,oracle_0.5,oracle_tile_0.7,dense_torch,emu:agg=rowmax;alpha=0.5;"
                                    "subgroups=g")
    for key in ("commit", "date", "device", "command", "through_package", "dense_ms_128k", "bootstrap", "corpus"):
        assert key in doc
    assert doc["through_package"] is False and doc["device"] == "cpu"
    rows = doc["rows"]
    assert len(rows) == 3 * 6  # (copy, ppl, kv depth/code) x (dense + 5 configurations)
    for r in rows:
        for k in REQUIRED:
            assert k in r, k
        assert r["L"] == 1536 and r["index_ms_128k"] is None  # nothing timed on the emulator
        assert r["ci_low"] <= r["diff"] + 1e-12 and r["diff"] <= r["ci_high"] + 1e-12
        assert r["diff"] == pytest.approx(r["metric"] - r["dense_metric"])
        assert 0 < r["density"] <= 1 and r["n_tokens"] >= 60
        if r["task"] == "kv":
            assert (r["layout"], r["format"]) == ("depth", "code") and r["n_units"] >= 10
        else:
            assert r["layout"] is None and r["format"] is None
        if r["metric_name"] == "nll":
            assert r["rel_pct"] == pytest.approx(100 * r["diff"] / r["dense_metric"])
    by = {(r["task"], r["config"]): r for r in rows}
    for t in ("copy", "ppl", "kv"):
        assert by[(t, "dense")]["ci_low"] == by[(t, "dense")]["ci_high"] == 0.0
        # the oracle's keep-all path is dense attention in float32: the same outcomes up to rounding
        assert abs(by[(t, "dense_torch")]["diff"]) < 1e-3 and by[(t, "dense_torch")]["density"] == 1.0
        assert by[(t, "oracle_0.5")]["route"] == "oracle" and by[(t, "oracle_0.5")]["args"]["subgroups"] is None
        assert by[(t, "oracle_tile_0.7")]["args"] == dict(frac=0.7, subgroups=1)
    # a re-run replaces rows of the same key instead of appending
    doc2 = _run(tmp_path, "emulate", "default")
    assert len(doc2["rows"]) == len(rows)


@pytest.mark.skipif(not HAVE_SP, reason="needs the sparse_prefill package (CPU reference)")
def test_library_rows_and_index_cost(tmp_path):
    doc = _run(tmp_path, "sp", "default,sp:alpha=0.5;head_subgroups=g,oracle_0.5",
               ["--tasks", "kv", "--min-scored", "30", "--index-cost", "--index-L", "512"])
    assert doc["through_package"] is True and doc["dense_ms_128k"] > 0
    assert doc["index_cost"]["L"] == 512
    assert doc["selection_defaults"]["block_size"] == 128
    by = {r["config"]: r for r in doc["rows"]}
    assert set(by) == {"dense", "default", "sp:alpha=0.5;head_subgroups=g", "oracle_0.5"}
    assert by["default"]["args"] == {} and by["default"]["route"] == "sp"  # no selection keyword at all
    for c in ("default", "sp:alpha=0.5;head_subgroups=g"):
        assert by[c]["index_ms_128k"] > 0 and 0 < by[c]["topic_density_128k"] <= 1
    # 'g' resolved per subject: SmolLM2-like model g = 3 in the forward, the topic workload's 4 in the timing
    assert doc["index_cost"]["rows"]["sp:alpha=0.5;head_subgroups=g"]["args"]["head_subgroups"] == 4
    assert by["oracle_0.5"]["index_ms_128k"] is None


def test_configs_parse():
    assert C.parse("default", "sp").kind == "sp" and C.parse("default", "sp").args == {}
    assert C.parse("default", "emulate").kind == "emulate"
    o = C.parse("oracle_0.7")
    assert (o.kind, o.args) == ("oracle", dict(frac=0.7, subgroups=None)) and o.library_args is None
    assert C.parse("oracle_tile_0.5").args == dict(frac=0.5, subgroups=1)
    assert C.parse("dense_torch").args == dict(frac=None, subgroups=1)
    r = C.parse("sp:rule=row_max;alpha=0.03;head_subgroups=g")
    assert r.library_args == dict(rule="row_max", alpha=0.03, head_subgroups="g")
    assert C.resolve_g(r.args, 3)["head_subgroups"] == 3 and C.resolve_g({"subgroups": "g"}, 4) == {"subgroups": 4}
    assert C.parse("emu:agg=rowcum;gamma=0.8").args == dict(agg="rowcum", gamma=0.8)
    assert C.parse("agg=rowmax;alpha=0.2").kind == "emulate"
    assert C.parse("probe8", "sp").kind == "emulate"  # emulator-only names run in the emulator
    assert C.parse("rowmax_a003_head", "emulate").args["subgroups"] == "g"
    for bad in ("nonsense", "oracle_1.5"):
        with pytest.raises(ValueError):
            C.parse(bad)
    assert math.isclose(C.parse("oracle_.9").args["frac"], 0.9)


def test_block_mass_lower_bound_and_estimators():
    """estimators.py's block-mass lower bound (the lbcum / klbcum rules) is below every block's true log mass on random
    logits, equal for a block of alike keys, and the union syntax selects at least each part's blocks."""
    from accuracy import estimators as E
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n = E.B
    for spread in (0.1, 1.0, 4.0):
        s = torch.randn(64, n, generator=g, dtype=torch.float64) * spread
        s[::3, 7] += 9.0  # spikes
        lb = E.lower_bound_log_mass(s.amax(-1), s.mean(-1), n)
        true = torch.logsumexp(s, -1)
        assert bool((lb <= true + 1e-9).all()), float((lb - true).max())
    same = torch.full((5, n), 0.25, dtype=torch.float64)
    assert torch.allclose(E.lower_bound_log_mass(same.amax(-1), same.mean(-1), n), torch.logsumexp(same, -1))
    spike = torch.zeros(1, n, dtype=torch.float64)
    spike[0, 3] = 20.0  # the spike carries the block: the bound is within the others' share of it
    assert float(torch.logsumexp(spike, -1) - E.lower_bound_log_mass(spike.amax(-1), spike.mean(-1), n)) < 1e-6
    L = 3 * E.TILE + 17
    nb = (L + E.B - 1) // E.B
    pos = torch.arange(L)
    sees = (torch.arange(nb) * E.B)[None, :] <= pos[:, None]
    al, _ = E.always_kept(L)
    lgm = torch.randn(L, nb * E.B, generator=g).masked_fill(torch.arange(nb * E.B)[None, :] > pos[:, None], -math.inf)
    x = dict(L=L, lg=torch.randn(L, nb * E.B, generator=g), lgm=lgm, sees=sees, al_rows=al[pos // E.TILE],
             kms={16: torch.randn(L, nb, generator=g)})
    c = E.candidates(["kmx16_a0.3", "klbcum16_0.5", "kmx16_a0.3+klbcum16_0.5", "lbcum_0.9", "meancum_0.7",
                      "kmx16_a0.3&klbcum16_0.5", "lbcum_0.9+kmx16_a0.3&klbcum16_0.5"])
    a, b, u, i = (c[k](x) for k in ("kmx16_a0.3", "klbcum16_0.5", "kmx16_a0.3+klbcum16_0.5", "kmx16_a0.3&klbcum16_0.5"))
    assert torch.equal(u, a | b) and bool(u.any()) and not bool(u.all())
    assert torch.equal(i, a & b) and not torch.equal(i, u)  # & intersects, and binds tighter than +
    assert torch.equal(c["lbcum_0.9+kmx16_a0.3&klbcum16_0.5"](x), c["lbcum_0.9"](x) | i)
    sh = E.candidates(["lbshare_0.05", "lbshare_0.3", "lbsharep_0.3"])
    keep = {k: f(x) & sees for k, f in sh.items()}
    # a larger share keeps fewer; normalised by the pooled means' total (<= the bounds', Jensen) it keeps more
    assert bool((keep["lbshare_0.3"] & ~keep["lbshare_0.05"]).sum() == 0)
    assert bool((keep["lbshare_0.3"] & ~keep["lbsharep_0.3"]).sum() == 0)
    assert int(keep["lbshare_0.05"].sum()) > int(keep["lbshare_0.3"].sum())
    # the one-pass forms decide against a running total below the final one: a superset of lbshare's blocks
    one = E.candidates(["lbs1p_0.3", "lbk1p_0.3", "lbk1p_1e-9"])
    lbs1p = one["lbs1p_0.3"](x) & sees
    assert bool((keep["lbshare_0.3"] & ~lbs1p).sum() == 0) and bool(lbs1p.any())
    k1 = one["lbk1p_0.3"](x) & sees
    assert bool(k1.any()) and not bool(k1.all())
    assert torch.equal(one["lbk1p_1e-9"](x) & sees, sees)  # a vanishing share keeps every visible block
    for k in ("lbcum_0.9", "meancum_0.7"):
        kept = c[k](x) & sees
        assert bool(kept.any(-1).all()), k  # every row keeps something it sees


def _topic_tiles(L, Hq, D=64):
    """One KV head of L = 128 n keys in n topics (a block each) and Hq query heads whose tile t attends to two of the
    topics 0..t (fresh seed): tiles that keep a few earlier blocks and drop the rest."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    nb = L // 128
    t = torch.randn(nb, 1, D, generator=g)
    k = t.repeat_interleave(128, 0) + torch.randn(L, 1, D, generator=g)
    tgt = (torch.rand(nb, 2, generator=g) * torch.arange(nb).clamp(min=1)[:, None]).long()
    q = t[tgt.reshape(-1), 0].reshape(nb, 2, D).sum(1).repeat_interleave(128, 0)[:, None, :].repeat(1, Hq, 1) * 1.5
    return q + torch.randn(L, Hq, D, generator=g), k, torch.randn(L, 1, D, generator=g)


@pytest.mark.parametrize("beta", [0.01, 0.1])
def test_emulated_share1p_equals_the_offline_lbk1p(beta):
    """emulate.select's agg 'share1p' (the one-pass share of the bound mass, end to end) keeps per query head exactly
    the blocks estimators.py's lbk1p keeps offline (same geometry: 128-key blocks, sink 256, window 512, last 2 tiles),
    on inputs whose tiles attend to a few earlier topics; and refuses a score without exact maxima."""
    from accuracy import emulate as EM
    from accuracy import estimators as E
    L, Hq, nb = 3072, 2, 3072 // 128
    q, k, v = _topic_tiles(L, Hq)
    sel = EM.select(q, k, v, dict(score="kmax", agg="share1p", alpha=beta, subgroups=0, dense_fraction=1.0), 0.125)
    assert sel.density < 0.8, "the data must make the rule prune"
    al, vis = E.always_kept(L)
    pos = torch.arange(L)
    sees = (torch.arange(nb) * E.B)[None, :] <= pos[:, None]
    causal = torch.ones(L, L, dtype=torch.bool).tril_()
    f = E.candidates([f"lbk1p_{beta}"])[f"lbk1p_{beta}"]
    for h in range(Hq):
        lg = (q[:, h] @ k[:, 0].T) * 0.125
        x = dict(L=L, lg=lg, lgm=lg.masked_fill(~causal, -math.inf), sees=sees, al_rows=al[pos // E.TILE])
        want = (E.tile_any(f(x) & sees, L // E.TILE) & vis) | al
        assert torch.equal(sel.keep[h] & sel.visible, want), h
    with pytest.raises(ValueError, match="share1p"):
        EM.select(q, k, v, dict(score="mean", agg="share1p"), 0.125)


@pytest.mark.parametrize("beta", [0.01, 0.1])
def test_emulated_share1p_within_candidates_follows_the_share_spec(beta):
    """agg 'share1p' with cand_mean (exact_max_spec.md, "A share test") against the text written out row by row in
    float64: candidates the pooled row max at cand_mean (union over the tile) less the always-kept blocks plus the
    diagonal's; per row the total starts at |B| exp(pooled logit) over the blocks it sees whole; the sink blocks, then
    the blocks from the diagonal down, each scored one (sink or candidate) swapping |B| exp(its exact mean logit) (a
    whole block) for its bound mass and kept iff a candidate with bound >= beta x the total; union over the tile."""
    from accuracy import emulate as EM
    from accuracy import estimators as E
    L, Hq, nb, ca = 2944, 2, 23, 0.003
    q, k, v = _topic_tiles(L, Hq)
    rule = dict(score="kmax", agg="share1p", alpha=beta, cand_mean=ca, subgroups=0, dense_fraction=1.0)
    sel = EM.select(q, k, v, rule, 0.125)
    al, vis = E.always_kept(L)
    T, pos, jb = L // 128, torch.arange(L), torch.arange(nb)
    kmean = EM.library_means(k, 128)[:, 0]  # [nb, D] float64, as the library pools
    causal = torch.ones(L, L, dtype=torch.bool).tril_()
    n = (pos[:, None] - jb[None, :] * 128 + 1).clamp(min=0, max=128)  # keys of J row r sees
    whole, seen = n == 128, n > 0
    order = torch.cat([jb[jb * 128 < E.SINK], jb.flip(0)[jb.flip(0) * 128 >= E.SINK]])
    for h in range(Hq):
        qh = q[:, h].double()
        lg = (qh @ k[:, 0].double().T * 0.125).masked_fill(~causal, -math.inf).view(L, nb, 128)
        m = lg.amax(-1)
        u = torch.where(torch.isfinite(lg), lg, torch.zeros((), dtype=torch.float64)).sum(-1) / n.clamp(min=1)
        w = torch.where(n > 1, torch.logaddexp(m, torch.log((n - 1).clamp(min=1).double()) +
                                               (n * u - m) / (n - 1).clamp(min=1)), m)
        s = qh @ kmean.T * 0.125  # pooled logits [L, nb]
        sm = s.masked_fill(~seen, -math.inf)
        prop = E.tile_any(torch.exp(sm - sm.amax(-1, keepdim=True)) >= ca, T) & vis  # [T, nb]
        diag = jb[None, :] == torch.arange(T)[:, None]
        assert bool((vis & ~al & ~prop).any()), "the candidates must leave blocks out"
        scored = ((prop & ~al) | diag)[pos // 128]  # [L, nb] per row its tile's
        swapped = scored | (jb * 128 < E.SINK)[None, :]
        z = torch.where(whole, 128 * torch.exp(s), torch.zeros((), dtype=torch.float64)).sum(-1)
        keep = torch.zeros(L, nb, dtype=torch.bool)
        for J in order.tolist():
            on = swapped[:, J] & seen[:, J]
            z = torch.where(on, z + torch.exp(w[:, J]) - torch.where(whole[:, J], 128 * torch.exp(u[:, J]), 0.0), z)
            keep[:, J] = on & scored[:, J] & (torch.exp(w[:, J]) >= beta * z)
        want = (E.tile_any(keep, T) & vis) | al
        assert sel.density < 0.8, "the data must make the rule prune"
        assert torch.equal(sel.keep[h] & sel.visible, want), (h, int((sel.keep[h] & sel.visible ^ want).sum()))
