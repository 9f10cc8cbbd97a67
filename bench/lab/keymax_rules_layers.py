"""Why the queries' basis lost SmolLM2's recall end to end (issue 44, twelfth session) where the offline study had put
it on the oracle's curve: the library's whole rule, layer by layer, on a capture of SmolLM2's post-RoPE q, k, v.

The offline study (accuracy/estimators.py score) scored four layers (3, 10, 17, 24) with the two-pass row max per
query head; the library runs one pass from the diagonal down, started from the pooled means' bound (onepass 2), on
every layer, with head sub-groups, the always-kept blocks and the dense rule. This script selects with
emulate.select (the library's rule as the emulator states it, test_accuracy_emulator.py) for each named rule on
every captured layer and measures against each row's exact softmax: density (kept / visible blocks), the mean mass
the answer rows keep (ans_mass), the answer rows keeping under half their mass (ans_low50), and the same over all
scored rows (mass, low50).

--sink instead: where each row's top block score lies (blocks 0-1, the attention sink, or the last four blocks before
the diagonal) on the keys' basis, the queries' basis and exact maxima, rows every 37th from 1023: the one pass from the
diagonal reaches the sink last, so where the top lies decides whether it prunes as the two-pass rule does.

Usage (from bench/, a capture from `python -m accuracy.estimators capture --task kv --layout spread --L 8192`):
    python3 lab/keymax_rules_layers.py /tmp/cap.pt [--layers 0,1,2] [--rules NAME=emu-rule;...] [--sink]
A rule is `name=k=v,k=v` (emulate.py's parameters; ',' between parameters, ';' between rules)."""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: accuracy

from accuracy import emulate  # noqa: E402

RULES = ("keys_a0.03=score=resid,rank=16,subgroups=g,alpha=0.03,onepass=2;"
         "query_a0.03=score=resid,rank=16,subgroups=g,alpha=0.03,onepass=2,basis=query;"
         "query_a0.03_2pass=score=resid,rank=16,subgroups=g,alpha=0.03,basis=query;"
         "keys_a0.03_2pass=score=resid,rank=16,subgroups=g,alpha=0.03;"
         "exact_a0.03=score=kmax,subgroups=g,alpha=0.03,onepass=2;"
         "oracle_0.9=score=exact,agg=rowcum,gamma=0.9,subgroups=g")


def parse_rules(text, g):
    out = {}
    for item in text.split(";"):
        name, _, body = item.partition("=")
        rule = {}
        for kv in body.split(","):
            k, _, v = kv.partition("=")
            if v == "g":
                rule[k] = g
            else:
                try:
                    rule[k] = int(v)
                except ValueError:
                    try:
                        rule[k] = float(v)
                    except ValueError:
                        rule[k] = v
        out[name] = rule
    return out


def sink(cap, L, layers, B=128):
    rows = torch.arange(1023, L, 37)
    diag = (rows // B)[:, None]
    for layer in layers:
        q, k, _ = (t.float() for t in cap[layer])
        scale = 1.0 / math.sqrt(q.shape[2])
        scores = {b: emulate.key_max_scores(q, k, scale, B, 16, rows, basis=b)[rows] for b in ("lib", "query")}
        scores["exact"] = emulate.block_max(q, k, scale, B, rows)[rows]
        cells = []
        for name, s in scores.items():
            top = s.argmax(-1)  # [rows, Hq]
            near = float((top >= diag - 3).float().mean())
            cells.append(f"{name} {float((top <= 1).float().mean()):.3f} / {near:.3f}")
        print(f"layer {layer:2d} (top in blocks 0-1 / in the last 4): " + ", ".join(cells), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("--layers", default="", help="comma separated (default: every captured layer)")
    ap.add_argument("--rules", default=RULES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sink", action="store_true", help="where the rows' top block scores lie (see above)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    d = torch.load(args.capture)
    cap, L = d["layers"], d["L"]
    ans = torch.as_tensor(d["answer_rows"]) if d.get("answer_rows") is not None else None
    layers = [int(x) for x in args.layers.split(",")] if args.layers else sorted(cap)
    if args.sink:
        return sink(cap, L, layers)
    q0, k0, _ = cap[layers[0]]
    g = q0.shape[1] // k0.shape[1]
    rules = parse_rules(args.rules, g)
    B, TILE, last_n = 128, 128, 2
    nb, T = (L + B - 1) // B, (L + TILE - 1) // TILE
    scored = torch.arange(L) < (T - last_n) * TILE
    causal = torch.ones(L, L, dtype=torch.bool).tril_()
    tot = {n: dict(kept=0, vis=0, mass=0.0, low=0, n=0, amass=0.0, alow=0, an=0) for n in rules}
    print(f"{'layer':>5s} " + " ".join(f"{n:>22s}" for n in rules) + "   (density / answer rows' mass kept)")
    for layer in layers:
        q, k, v = (t.float() for t in cap[layer])
        Hq, D = q.shape[1], q.shape[2]
        scale = 1.0 / math.sqrt(D)
        pm = torch.empty(Hq, L, nb)  # each row's exact softmax mass per key block
        for h in range(Hq):
            lg = ((q[:, h] @ k[:, h // g].T) * scale).masked_fill(~causal, -math.inf)
            p = torch.softmax(lg, -1)
            pm[h] = torch.nn.functional.pad(p, (0, nb * B - L)).view(L, nb, B).sum(-1)
        cells = []
        for n, rule in rules.items():
            sel = emulate.select(q, k, v, rule, scale)
            keep = sel.per_row(sel.keep)  # [Hq, L, nb]
            cov = (pm * keep).sum(-1)     # [Hq, L]
            t = tot[n]
            t["kept"] += sel.kept_blocks
            t["vis"] += sel.visible_blocks
            t["mass"] += float(cov[:, scored].sum())
            t["low"] += int((cov[:, scored] < 0.5).sum())
            t["n"] += int(scored.sum()) * Hq
            am = float("nan")
            if ans is not None:
                a = cov[:, ans]
                am = float(a.mean())
                t["amass"] += float(a.sum())
                t["alow"] += int((a < 0.5).sum())
                t["an"] += a.numel()
            cells.append(f"{sel.density:10.3f} / {am:9.3f}")
        print(f"{layer:5d} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    print(f"\n{'rule':22s} {'density':>7s} {'mass':>6s} {'low50':>6s} {'ans_mass':>8s} {'ans_low50':>9s}")
    for n, t in tot.items():
        am = f"{t['amass'] / t['an']:.3f}" if t["an"] else "-"
        al = f"{t['alow'] / t['an']:.3f}" if t["an"] else "-"
        print(f"{n:22s} {t['kept'] / t['vis']:7.3f} {t['mass'] / t['n']:6.3f} {t['low'] / t['n']:6.3f} "
              f"{am:>8s} {al:>9s}")


if __name__ == "__main__":
    main()
