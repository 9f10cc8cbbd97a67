"""Why the mean correction changes nothing: per layer, for rows that drop blocks under a rule, the true dense
softmax mass of the dropped keys vs the mass the correction's virtual keys take, and the output error against
dense without / with the correction. Usage (from bench/): python -m accuracy.diag_correction [--L 2048]"""
import argparse
import json

import torch

from accuracy import emulate, tasks
from accuracy import model as M


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--task", default="copy")
    ap.add_argument("--layers", default="2,8,14,20,26")
    ap.add_argument("--rule", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = M.Model()
    t = tasks.make(args.task, m.tok, args.L)
    layers = [int(x) for x in args.layers.split(",")]
    cap = {}
    M.ROUTER.hook = lambda layer, q, k, v: cap.__setitem__(layer, (q.float(), k.float(), v.float())) \
        if layer in layers else None
    m.set_backend("dense")
    m.logits(t["ids"])
    M.ROUTER.hook = None
    rule = dict(kv.split("=") for kv in args.rule.split(";")) if args.rule else {}
    rule = {k: (float(v) if k in ("alpha", "gamma") else int(v) if k == "subgroups" else v) for k, v in rule.items()}
    out = []
    for layer in layers:
        q, k, v = cap[layer]
        sel = emulate.select(q, k, v, dict(rule, correction=True), 1 / 8)
        res = emulate.pruned_mass(q, k, v, sel, 1 / 8, 128)
        for r in res:
            r["layer"] = layer
        agg = {key: sum(r[key] for r in res) / len(res) for key in ("true_dropped", "virtual_mass", "rel_err_nc",
                                                                    "rel_err_c")}
        print(f"layer {layer} density {sel.density:.3f} " + " ".join(f"{a}={b:.4f}" for a, b in agg.items()),
              flush=True)
        out.append(dict(layer=layer, density=sel.density, heads=res, **agg))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
