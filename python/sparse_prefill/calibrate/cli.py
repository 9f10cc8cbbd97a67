"""The command line of `python -m sparse_prefill.calibrate` (see the package docstring) and `run()`, its body."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import os
import sys
import time
from typing import List, Optional

from ..integrations.core import LONG_PROMPT_FACTOR
from . import report
from . import route as R
from . import search as S
from . import tasks as T
from .tasks import UsageError

# The default candidates: the per-key rule at five ratios (on SmolLM2 at 8K the calibration chose key_max alpha 0.03,
# density 0.70, held on other prompts, where every row-max setting that pruned failed there:
# bench/results/calibrate_keymax_h100.json; on the retrieval subject alpha 0.3 keeps dense accuracy at
# 0.47 / 0.57 of the blocks, the oracle's density: bench/results/accuracy_retrieval_keymax_seed*_h100.json), then
# the pooled row-max rule from the library's default to denser (cheap index stages, for models where the per-key
# index does not pay). Since the rule starts each row from the sink keys' exact maximum a ratio keeps fewer blocks
# than it did: on SmolLM2 through the library on the GPU alpha 0.01 keeps 0.644 at 8K but loses 1.2 points on one
# recall layout, alpha 0.003 0.756 within 0.4 (bench/lab/results/accuracy_keymax_library_smollm2_h100.md,
# accuracy_keymax_library_alpha_smollm2_h100.json): 0.003 is the per-key rule's safer step before row max.
CANDIDATES = ("rule=key_max;alpha=0.3,rule=key_max;alpha=0.1,rule=key_max;alpha=0.03,rule=key_max;alpha=0.01,"
              "rule=key_max;alpha=0.003,alpha=0.01,default,alpha=0.001")
EXTRA = "pip install 'sparse-prefill[hf]' (in a clone: pip install '.[hf]')"     # pyproject.toml's extra hf


class MissingExtra(ImportError):
    """torch or transformers does not import; the message is one line naming the extra to install."""


def require_extras() -> None:
    """The command's own dependencies, checked before anything that needs them (MODEL is checked after: without
    them no MODEL could run)."""
    missing = []
    for name in ("torch", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        raise MissingExtra(f"needs torch and transformers; {' and '.join(missing)} did not import: {EXTRA}")


def _arg(name, convert):
    """An argparse type: convert(text), whose errors name the argument."""
    def parse(text):
        try:
            return convert(text)
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise argparse.ArgumentTypeError(msg if msg.startswith(name) else f"{name}: {msg}") from None
    parse.__name__ = name
    return parse


def _lengths(text):
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 512:
        raise ValueError(f"expected comma-separated prompt lengths >= 512, got {text!r}")
    return sorted(set(out))


def _fractions(text):
    out = [float(x) for x in text.split(",") if x.strip()]
    if any(not 0.0 < f <= 1.0 for f in out):
        raise ValueError(f"mass fractions must be in (0, 1], got {text!r}")
    return out


def _at_least(lo, kind=float):
    def convert(text):
        x = kind(text)
        if x < lo:
            raise ValueError(f"must be >= {lo}, got {text}")
        return x
    return convert


def _choices(allowed):
    def convert(text):
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if bad or not out:
            raise ValueError(f"expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
        return out
    return convert


def _candidates(text):
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        settings = S.parse_settings(item, "--candidates")
        if "block_size" in settings:
            raise ValueError("--candidates: block_size is one value for the whole model; give it in --base")
        out[S.settings_name(settings)] = settings
    if not out:
        raise ValueError("--candidates: no setting given")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sparse_prefill.calibrate", description=(
        "Measure what sparse prefill costs a model in accuracy and density, and write the settings the engine "
        "adapters load (DIR/sparse_prefill.json) with a report (DIR/report.md). Needs torch and transformers: "
        f"{EXTRA}."), epilog=(
        f"The choice: the cheapest setting within --max-drop and --max-nll; costs within {S.COST_TIE:.0%} of the "
        "cheapest count as equal, and of those the most accurate wins (smallest worst top-1 drop, then NLL). When "
        f"no setting prunes more than {S.NO_PRUNING:.0%} of the key blocks at --lengths, nothing can be told apart: "
        "the file holds the library's default selection, and the log and the report say so. The choice is then "
        "confirmed on a second prompt set (same --lengths and tasks, other prompts and built-in text, disjoint from "
        "the calibration's and from any --check --seed's) under the same tolerance: when it fails there, the next "
        "safer (denser) passing setting is confirmed instead, at most --max-confirm settings (the last the densest "
        "passing one); when none holds, the file runs every layer dense. The file records "
        "validated_lengths (--lengths); the adapters warn once when a prompt runs sparse at more than "
        f"{LONG_PROMPT_FACTOR:g}x the longest of them."))
    ap.add_argument("model", metavar="MODEL", help="a local transformers model folder or GGUF file (no downloads)")
    ap.add_argument("--lengths", type=_arg("--lengths", _lengths), default=[8192, 32768],
                    help="prompt lengths, comma-separated (default 8192,32768)")
    ap.add_argument("--text", nargs="+", action="extend", metavar="FILE", default=[],
                    help="your text: filler of the recall prompts and the NLL task (default: a built-in text)")
    ap.add_argument("--out", default="sparse_prefill_calibration", metavar="DIR", help="output folder")
    ap.add_argument("--max-drop", type=_arg("--max-drop", _at_least(0.0)), default=1.0,
                    help="largest top-1 accuracy drop allowed on any task and length, in points (default 1.0)")
    ap.add_argument("--max-nll", type=_arg("--max-nll", _at_least(0.0)), default=0.5,
                    help="largest NLL increase allowed, in %% of dense (default 0.5)")
    ap.add_argument("--strict", action="store_true",
                    help="require the 95 %% intervals, not just the estimates, to stay within the tolerance")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda where torch sees a GPU and the library has its CUDA backend, else cpu")
    ap.add_argument("--candidates", type=_arg("--candidates", _candidates), default=_candidates(CANDIDATES),
                    help=f"selection settings to try, comma-separated, each 'k=v;k=v' or 'default' "
                         f"(default {CANDIDATES})")
    ap.add_argument("--base", type=_arg("--base", lambda t: S.parse_settings(t, "--base")), default={},
                    help="selection settings common to every candidate, 'k=v;k=v' (e.g. block_size=256)")
    ap.add_argument("--oracle", type=_arg("--oracle", _fractions), default=[0.5, 0.7, 0.9],
                    help="mass fractions of the exact oracle's curve (default 0.5,0.7,0.9; '' for none)")
    ap.add_argument("--oracle-mem-gb", type=_arg("--oracle-mem-gb", _at_least(0.01)), default=2.0,
                    help="working memory of the oracle's chunks, GB (default 2)")
    ap.add_argument("--tasks", type=_arg("--tasks", _choices(T.TASKS)), default=list(T.TASKS))
    ap.add_argument("--layouts", type=_arg("--layouts", _choices(T.LAYOUTS)), default=list(T.LAYOUTS))
    ap.add_argument("--formats", type=_arg("--formats", _choices(T.FORMATS)), default=["code"])
    ap.add_argument("--min-scored", type=_arg("--min-scored", _at_least(1, int)), default=1000,
                    help="scored tokens per task and length, at least (default 1000)")
    ap.add_argument("--seed", type=_arg("--seed", _at_least(0, int)), default=0, help="prompt seed")
    ap.add_argument("--n-boot", type=_arg("--n-boot", _at_least(100, int)), default=1000, help="bootstrap replicates")
    ap.add_argument("--max-evals", type=_arg("--max-evals", _at_least(0, int)), default=6,
                    help="measurements of per-layer plans, at most (default 6; 0: uniform settings only)")
    ap.add_argument("--max-confirm", type=_arg("--max-confirm", _at_least(0, int)), default=S.CONFIRM_MAX,
                    help="settings measured on the confirmation prompts (a second, disjoint prompt set) until one "
                         f"passes there, at most (default {S.CONFIRM_MAX}; 0: the choice is not confirmed)")
    ap.add_argument("--tokenizer", default=None, metavar="PATH|bytes",
                    help="default: MODEL's; 'bytes' for a random-weight model saved without a tokenizer")
    ap.add_argument("--check", default=None, metavar="FILE",
                    help="measure this sparse_prefill.json instead of searching (and through the transformers "
                         "adapter); its prompts are --seed's and --formats': with the defaults (0, code) they are a "
                         "default calibration's own, so pass another --seed (and --formats) for a held-out check")
    ap.add_argument("--threads", type=_arg("--threads", _at_least(1, int)), default=None, help="CPU threads of torch")
    return ap


def _validate(args) -> None:
    import torch
    import sparse_prefill as sp
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and sp.with_cuda else "cpu"
    if args.device == "cuda" and not (torch.cuda.is_available() and sp.with_cuda):
        raise UsageError("--device: cuda needs a GPU visible to torch and sparse_prefill built with its CUDA backend "
                         f"(torch sees {torch.cuda.device_count()} GPUs, sp.with_cuda={sp.with_cuda})")
    for f in args.text:
        if not os.path.isfile(f):
            raise UsageError(f"--text: {f} is not a file")
    if args.check and not os.path.isfile(args.check):
        raise UsageError(f"--check: {args.check} is not a file")
    if "kv" not in args.tasks and "copy" not in args.tasks and "nll" not in args.tasks:
        raise UsageError("--tasks: nothing to measure")


def run(args, log=print) -> dict:
    """The calibration (or, with args.check, the check) described by parsed arguments; returns the results
    document that is also written to DIR/calibration.json."""
    require_extras()
    import torch
    import sparse_prefill as sp
    from ..integrations.core import SparsePrefillConfig, VarlenDispatch
    _validate(args)
    t0 = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        base_config = SparsePrefillConfig(**args.base)
    except ValueError as e:
        raise UsageError(f"--base: {e}") from None
    model, tok = R.load(args.model, args.device, args.tokenizer, log)
    n_layers = int(model.config.num_hidden_layers)
    log(f"loaded in {time.time() - t0:.1f} s: {n_layers} layers, {model.config.num_attention_heads} query heads, "
        f"{getattr(model.config, 'num_key_value_heads', None)} KV heads")
    texts = [open(f, encoding="utf-8", errors="replace").read() for f in args.text]
    filler = T.Filler(tok, texts, min_tokens=2 * max(args.lengths))
    variants = T.variants(args.tasks, args.layouts, args.formats)
    sets, counts = T.prompt_sets(tok, filler, args.lengths, variants, args.seed, args.min_scored)
    for L in args.lengths:
        log(f"L={L}: " + ", ".join(f"{v} {c['prompts']} prompts / {c['tokens']} tokens" for v, c in counts[str(L)].items()))
    cal = S.Calibration(model, sets, n_boot=args.n_boot, seed=args.seed, max_drop=args.max_drop,
                        max_nll=args.max_nll, strict=args.strict, log=log)
    evals = 1 + (2 if args.check else len(args.candidates) + len(args.oracle) + 1 + args.max_evals
                 + (1 + args.max_confirm if args.max_confirm else 0))      # confirmation: dense + the settings
    log(f"dense attention (sp.attention), the reference [1/{evals} measurements, at most]")
    cal.measure_dense()
    log(f"  {cal.dense_seconds:.1f} s per measurement of every prompt; ~{cal.dense_seconds * evals * 1.3:.0f} s "
        "in all, guessed")
    results: List[dict] = []
    configs = {}
    no_pruning, note = False, None
    confirmation = None
    plan_of = {}
    probe = None
    if args.check:
        cfg = SparsePrefillConfig.load(config_file=args.check, environ={})
        # its cost as the calibration counts it: the file's index stages (each layer's own selection; its dense
        # layers have none) timed beside dense attention
        cal.time_index([("file", cfg)])
        plan = {str(i): "file" for i in range(n_layers)}
        log(f"checking {args.check}: as measured by the calibration (index / dense time {cal.index_share(plan):.3f})")
        results.append(cal.evaluate("file", "file", R.Route("config", config=cfg), cfg, plan=plan))
        via = SparsePrefillConfig.load(config_file=args.check, environ={}, min_sparse_q_len=1, min_sparse_kv_len=0)
        log("... and through the transformers adapter (min_sparse_q_len 1, min_sparse_kv_len 0: sparse at every "
            "length measured)")
        results.append(cal.evaluate("file via the transformers adapter", "adapter",
                                    R.Route("adapter", dispatch=VarlenDispatch(via))))
        chosen, out_config = None, None
    else:
        geometry = {k: getattr(base_config, k) for k in ("block_size", "sink", "window", "last_n")}
        for name, settings in args.candidates.items():
            configs[name] = SparsePrefillConfig(**{**args.base, **settings})
            plan_of[name] = {str(i): name for i in range(n_layers)}
        t1 = time.time()
        cal.time_index(list(configs.items()))
        log(f"index stages timed beside dense attention, every layer, one prompt at L={max(args.lengths)} "
            f"({time.time() - t1:.1f} s): index / dense time " +
            ", ".join(f"{n} {cal.index_share(plan_of[n]):.3f}" for n in configs))
        for i, (name, cfg) in enumerate(configs.items()):
            log(f"{name} in every layer [{2 + i}/{evals}]")
            results.append(cal.evaluate(name, "uniform", R.Route("config", config=cfg), cfg, plan=plan_of[name]))
        search_plans = bool(args.max_evals) and S.plans_can_prune(results)
        oracle = args.oracle if search_plans or not args.oracle else [max(args.oracle)]
        if not search_plans and args.max_evals:
            log(f"no per-layer plan of these candidates can prune more than {S.NO_PRUNING:.0%} of the key blocks "
                "(each layer's sparsest candidate, averaged over layers): no probe or plans; "
                + (f"the oracle at F={oracle[0]} only (is anything prunable at these lengths?)" if oracle else ""))
        for frac in oracle:
            log(f"the exact oracle at F={frac} (per query head, in chunks)")
            results.append(cal.evaluate(f"oracle F={frac}", "oracle", R.Route(
                "oracle", frac=frac, oracle_geometry=geometry, mem_bytes=args.oracle_mem_gb * 2**30)))
        if search_plans:
            log("probe: every candidate beside dense attention in every layer, on one prompt per task and length")
            probe = cal.probe([(n, configs[n]) for n in args.candidates])
            levels = S.plans(probe, list(args.candidates), n_layers, layer_share=cal.layer_shares())

            def measure(plan, i):
                name = f"per-layer plan {i + 1}"
                same = set(plan.values())
                if len(same) == 1 and None not in same:       # one candidate everywhere: measured above
                    uniform = next(r for r in results if r["name"] == next(iter(same)))
                    log(f"  = {uniform['name']} in every layer, measured above")
                    configs[f"{name} (= {uniform['name']})"] = configs[uniform["name"]]
                    plan_of[f"{name} (= {uniform['name']})"] = plan_of[uniform["name"]]
                    return dict(uniform, name=f"{name} (= {uniform['name']})", kind="per-layer", seconds=0.0,
                                plan=plan_of[uniform["name"]])
                cfg = S.plan_config(plan, args.candidates, args.base)
                configs[name] = cfg
                plan_of[name] = {str(layer): n or "dense" for layer, n in plan.items()}
                r = cal.evaluate(name, "per-layer", R.Route("config", config=cfg), cfg, plan=plan_of[name])
                r["plan"] = plan_of[name]
                return r

            log(f"{len(levels)} per-layer plans (error budgets); binary search, at most {args.max_evals} measured")
            results += S.search(levels, measure, args.max_evals, log)
        chosen = S.choose(results)
        # nothing pruned: the measurements rank no setting, so the library's default selection (over --base), when
        # some setting kept the tolerance (at density ~1 each costs dense attention plus its index stage: > 1)
        no_pruning = S.pruned_nothing(results) and any(
            r["passes"] for r in results if r["kind"] in ("uniform", "per-layer"))
        if no_pruning:
            note = (f"nothing was pruned: no setting dropped more than {S.NO_PRUNING:.0%} of the key blocks at "
                    f"--lengths {','.join(map(str, args.lengths))} (lowest density "
                    f"{S.lowest_density(results):.3f}), so these lengths cannot tell the settings apart; "
                    "sparse_prefill.json holds the library's default selection, not the fastest setting. Calibrate "
                    "at longer --lengths (where the selections prune) to choose among them")
            log(note)
            chosen = next((r for r in results if r["kind"] == "uniform" and r["name"] == "default"), None)
            out_config = SparsePrefillConfig(**args.base)
            confirmation = dict(outcome="skipped", reason="nothing was pruned: the library's default selection")
        elif chosen is None:
            out_config = SparsePrefillConfig(**args.base, dense_layers=n_layers)
            passed = [r for r in results if r["passes"] and r["kind"] in ("uniform", "per-layer")]
            note = ("no setting within the tolerance on the calibration prompts: every layer dense" if not passed else
                    "no setting within the tolerance is cheaper than dense attention (its density plus its index "
                    f"stage's share: cheapest {min(r['cost'] for r in passed):.3f}): every layer dense")
            log(note)
            confirmation = dict(outcome="skipped", reason=note)
        elif not args.max_confirm:
            out_config = configs[chosen["name"]]
            confirmation = dict(outcome="skipped", reason="--max-confirm 0, measured only on the prompts it was "
                                "chosen on")
            log(f"not confirmed on other prompts (--max-confirm 0): {chosen['name']} was chosen on the same prompts "
                "it was compared on")
        else:
            confirmation, confirmed = _confirm(args, model, tok, texts, variants, results, chosen, configs, plan_of,
                                               cal.timing, log)
            if confirmed is None:
                # nothing holds on independent prompts, the densest passing setting included (the last one
                # confirmed): as when nothing passes at all, every layer runs dense. The library's default is no
                # safer answer: on SmolLM2 at 4K + 8K it measured -1.04 points on the calibration prompts itself
                # (bench/results/calibrate_h100.json), outside a 1-point tolerance.
                note = confirmation["reason"]         # logged by _confirm
                chosen = None
                out_config = SparsePrefillConfig(**args.base, dense_layers=n_layers)
            else:
                chosen = confirmed
                out_config = configs[chosen["name"]]
        out_config = dataclasses.replace(out_config, validated_lengths=list(args.lengths))
    recommended, plan = None, None
    if no_pruning:
        recommended, plan = "default", {str(i): "default" for i in range(n_layers)}
    elif chosen:
        recommended, plan = chosen["name"], plan_of.get(chosen["name"])
    elif not args.check:
        plan = {str(i): "dense" for i in range(n_layers)}
    doc = dict(mode="check" if args.check else "calibrate", model=args.model, version=sp.__version__,
               device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               date=datetime.datetime.now().isoformat(timespec="seconds"),
               command=" ".join(["python -m sparse_prefill.calibrate"] + sys.argv[1:]) if args.argv is None else
               " ".join(["python -m sparse_prefill.calibrate"] + list(args.argv)),
               lengths=list(args.lengths), filler=filler.source, prompts=counts, seed=args.seed,
               tolerance=dict(max_drop=args.max_drop, max_nll=args.max_nll, strict=args.strict),
               selection_defaults=dict(sp.SELECTION_DEFAULTS), base=args.base,
               candidates={n: s for n, s in args.candidates.items()}, results=results,
               recommended=recommended, plan=plan,
               config=out_config.file_dict() if out_config else None, probe=probe, check=args.check,
               validated_lengths=out_config.validated_lengths if out_config else None,
               lowest_density=S.lowest_density(results), no_pruning=no_pruning, note=note,
               confirmation=confirmation)
    doc["seconds"] = round(time.time() - t0, 1)
    if args.device == "cuda":
        doc["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        log(f"peak GPU memory {doc['peak_gpu_gb']} GB")
    paths = report.write(doc, args.out, out_config)
    if "figure_note" in paths:
        log(paths["figure_note"])
    if args.check:
        log(f"check done in {doc['seconds']:.0f} s: {paths['report']}")
    elif no_pruning:
        log(f"recommended: the library's default selection (nothing pruned) -> {paths['config']}; report "
            f"{paths['report']} ({doc['seconds']:.0f} s)")
    elif confirmation and confirmation["outcome"] == "none":
        log(f"no setting held on the confirmation prompts: {paths['config']} runs every layer dense; report "
            f"{paths['report']} ({doc['seconds']:.0f} s)")
    elif chosen:
        log(f"recommended: {chosen['name']} ({S.cost_text(chosen)} at L={max(args.lengths)}; "
            f"{report.worst_short(chosen)} on the calibration prompts; {report.confirmation_summary(confirmation)}) "
            f"-> {paths['config']}; report {paths['report']} ({doc['seconds']:.0f} s)")
    else:
        log(f"{note or 'no setting within the tolerance'}: {paths['config']} runs every layer dense; report "
            f"{paths['report']}")
    return doc


def _confirm(args, model, tok, texts, variants, results, chosen, configs, plan_of, timing, log):
    """(the confirmation record of calibration.json, the calibration result of the setting that held or None): the
    passing settings in S.confirmation_order measured on the confirmation split (tasks.CONFIRM) until one passes."""
    t0 = time.time()
    order = S.confirmation_order(results, chosen, args.max_confirm)
    sets, counts, source = T.confirmation_sets(tok, texts, args.lengths, variants, args.seed, args.min_scored)
    n_prompts = sum(c["prompts"] for per in counts.values() for c in per.values())
    log(f"confirmation: {chosen['name']} again on {n_prompts} other prompts (prompt seeds '{T.CONFIRM} "
        f"<{args.seed} * 1000 + j>', {source}), the same tolerance; where it fails, the next safer passing setting "
        f"({len(order)} settings at most: {', '.join(r['name'] for r in order)})")
    for L in args.lengths:
        log(f"  L={L}: " + ", ".join(f"{v} {c['prompts']} prompts / {c['tokens']} tokens"
                                     for v, c in counts[str(L)].items()))
    cal = S.Calibration(model, sets, n_boot=args.n_boot, seed=args.seed, max_drop=args.max_drop,
                        max_nll=args.max_nll, strict=args.strict, log=log)
    cal.measure_dense()
    cal.timing = timing                          # the calibration's timings: the same settings, the same layers
    confirmed, done = S.confirm(
        order, lambda r: cal.evaluate(r["name"], r["kind"], R.Route("config", config=configs[r["name"]]),
                                      configs[r["name"]], plan=plan_of.get(r["name"])), log)
    rec = dict(split=T.CONFIRM, seed=args.seed, filler=source, prompts=counts, n_prompts=n_prompts,
               max_confirm=args.max_confirm, first=chosen["name"], order=[r["name"] for r in order],
               calibration={r["name"]: dict(worst_drop=r.get("worst_drop"), worst_nll=r.get("worst_nll"),
                                            cost=r["cost"]) for r in order},
               results=done, confirmed=confirmed["name"] if confirmed else None,
               seconds=round(time.time() - t0, 1))
    if confirmed is None:
        rec.update(outcome="none", reason=(
            f"no setting held on the confirmation prompts: the {len(done)} measured there (of those that passed on "
            f"the calibration prompts) fell outside the tolerance on {n_prompts} other prompts (" + ", ".join(
                f"{c['name']} {report.worst_short(c)}" for c in done) + f"; --max-confirm {args.max_confirm}), so "
            "sparse_prefill.json runs every layer dense, not a setting other prompts contradict; more scored "
            "tokens (--min-scored) narrow the intervals"))
    else:
        rec.update(outcome="confirmed" if confirmed is chosen else "replaced", reason=None)
    log(f"confirmation ({rec['seconds']:.0f} s): {report.confirmation_summary(rec)}")
    return rec, confirmed


def main(argv: Optional[List[str]] = None, log=None) -> dict:
    """Parse argv (default sys.argv[1:]) and run; bad values exit with status 2 and a message naming the argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    log = log or (lambda *a: print(*a, flush=True))
    try:
        return run(args, log)
    except UsageError as e:
        parser.error(str(e))
    except MissingExtra as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
