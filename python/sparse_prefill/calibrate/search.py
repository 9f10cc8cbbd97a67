"""Measuring settings on the prompts, and the search for the cheapest one within tolerance.

A setting is a SparsePrefillConfig (what the adapters load): a uniform candidate (the same selection in every
layer), a per-layer plan (a selection or dense per layer), or the all-dense fallback. Its cost is its time relative to
dense attention at the longest length: its density (the mean over layers of kept / visible key blocks, a dense layer
counting 1: what the sparse kernels' time follows) plus its index share (the time of its index stage, summed over its
sparse layers, over dense attention's summed over all layers; each timed once per layer on the same inputs, the
first prompt at the longest length: Calibration.time_index). A selection whose index costs more than its pruning
saves costs more than 1, dense attention's cost: the per-key rule ('key_max') prunes like the oracle but its index
stage is 5-40x the pooled rule's, so density alone would rank it too cheap (bench/results/selection_keymax_v5_h100.json).

The search:
  1. every uniform candidate and every oracle fraction is measured on all prompts (accuracy, NLL, density per layer);
  2. a probe pass (dense forwards on one prompt per task and length) runs every candidate beside dense attention in
     every layer on the same inputs and records each layer's relative output error and density per candidate;
  3. plans: for a per-layer error budget e, each layer takes its cheapest candidate whose error is <= e, or dense
     when none is; a larger e gives a cheaper plan. A binary search over the budgets (at most --max-evals
     measurements, the cheapest plan first) finds the cheapest plan that passes;
  4. the recommendation is the cheapest passing setting, uniform or per-layer (all dense if none passes). Costs
     within COST_TIE (2 %, relative) of the cheapest count as equal; of those the most accurate wins: the smallest
     worst top-1 drop against dense (any task, any length), then the smallest NLL increase;
  5. unless nothing was pruned: when no setting dropped more than NO_PRUNING (5 %) of the key blocks at any length,
     the measurements cannot tell the settings apart, and the library's default selection is written instead (the
     log and the report say so; calibrate at longer --lengths, where the selections prune);
  6. confirmation: steps 1-4 compare many settings on the same few prompts and keep the cheapest that passed, so the
     one kept is biased towards settings whose measured drop was luckily small (the winner's curse). The
     recommendation is therefore measured again on a second, disjoint prompt set (the confirmation split: same
     lengths and tasks, other prompts; tasks.CONFIRM) under the same tolerance. When it fails there, the next safer
     passing setting is confirmed instead (confirmation_order: each denser than the last, the densest passing one
     last; at most --max-confirm, default CONFIRM_MAX = 3) until one passes both sets; when none does, the library's
     default selection is written (as in 5; the log and the report say so). No margin on per-layer plans: see
     CONFIRM_MAX.
Pass: on every length, every recall task's top-1 accuracy within --max-drop points of dense and the NLL within
--max-nll % of dense (point estimates; --strict: the 95 % intervals' far ends).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..integrations.core import SELECTION_FIELDS, SparsePrefillConfig, _check_selection_value, _coerce
from . import route as R
from .stats import paired_bootstrap
from .tasks import UsageError


def parse_settings(text: str, arg: str) -> dict:
    """'k=v;k=v' (selection keywords of sp.sparse_prefill) or 'default' -> dict; errors name `arg`."""
    out: dict = {}
    if text.strip() in ("", "default"):
        return out
    for item in text.split(";"):
        if not item.strip():
            continue
        if "=" not in item:
            raise UsageError(f"{arg}: {item!r} is not key=value")
        key, value = (x.strip() for x in item.split("=", 1))
        if key not in SELECTION_FIELDS:
            raise UsageError(f"{arg}: unknown selection setting {key!r} (known: {', '.join(SELECTION_FIELDS)})")
        try:
            out[key] = _coerce(key, value, key)
            _check_selection_value(key, key, out[key])
        except ValueError as e:
            raise UsageError(f"{arg}: {e}") from None
    return out


def settings_name(settings: dict) -> str:
    return ";".join(f"{k}={v}" for k, v in settings.items()) or "default"


def outcomes(prompt: dict, logits) -> np.ndarray:
    """Per scored token: 1.0 / 0.0 (top-1 hit) or the NLL, from the logits at pos - 1."""
    import torch
    tgt = torch.as_tensor(prompt["tgt"], device=logits.device)
    if prompt["kind"] == "nll":
        out = -torch.log_softmax(logits, -1).gather(1, tgt[:, None])[:, 0]
    else:
        out = (logits.argmax(-1) == tgt).float()
    return out.double().cpu().numpy()


class Calibration:
    """The model, its prompts per length and variant, and dense attention's outcomes on them."""

    def __init__(self, model, sets: Dict[int, Dict[str, List[dict]]], n_boot: int = 1000, seed: int = 0,
                 max_drop: float = 1.0, max_nll: float = 0.5, strict: bool = False, log=print):
        self.model, self.sets, self.log = model, sets, log
        self.n_boot, self.seed, self.max_drop, self.max_nll, self.strict = n_boot, seed, max_drop, max_nll, strict
        self.lengths = sorted(sets)
        self.n_layers = int(model.config.num_hidden_layers)
        self.dense = None
        self.dense_seconds = 0.0
        self.timing: Dict[int, dict] = {}    # Route.timing of time_index: seconds per layer

    # -- forwards ---------------------------------------------------------------------------------------------------
    def _run(self, route, L: int, prompts_of=None):
        R.ROUTE = route
        route.blocks = {}
        if route.dispatch is not None:
            route.dispatch.calls = {"sparse": 0, "dense": 0}
        outs = {}
        for variant, prompts in self.sets[L].items():
            chosen = prompts if prompts_of is None else prompts[:prompts_of]
            outs[variant] = [outcomes(p, R.logits_at(self.model, p["ids"], p["pos"] - 1)) for p in chosen]
        return outs, route.layer_density()

    def measure_dense(self) -> dict:
        t0 = time.time()
        self.dense = {}
        for L in self.lengths:
            t1 = time.time()
            self.dense[L], _ = self._run(R.Route("dense"), L)
            parts = ", ".join(f"{v} {np.concatenate(o).mean():.4f}" for v, o in self.dense[L].items())
            self.log(f"  dense L={L}: {parts} ({time.time() - t1:.1f} s)")
        self.dense_seconds = time.time() - t0
        return self.dense

    def time_index(self, candidates: Sequence[tuple]) -> Dict[int, dict]:
        """Per layer, the seconds of dense attention and of each candidate's index stage on the same inputs (the
        first prompt of the first variant at the longest length, dense attention in every layer): index_share's
        table."""
        L = self.lengths[-1]
        route = R.Route("time", candidates=list(candidates))
        R.ROUTE = route
        p = next(iter(self.sets[L].values()))[0]
        R.logits_at(self.model, p["ids"], p["pos"] - 1)
        self.timing = route.timing
        return self.timing

    def index_share(self, plan: Optional[Dict[str, str]]) -> float:
        """The index stages' time of a plan {layer: candidate or 'dense'} over dense attention's, all layers summed
        (0 without a plan or timings: the oracle and the all-dense setting have no index stage)."""
        if not plan or not self.timing:
            return 0.0
        dense = sum(c["attention"] for c in self.timing.values())
        index = sum(self.timing[int(layer)]["index"].get(name, 0.0) for layer, name in plan.items()
                    if int(layer) in self.timing)
        return index / dense if dense > 0 else 0.0

    def layer_shares(self) -> Dict[int, Dict[str, float]]:
        """{layer: {candidate: its index time over dense attention's in that layer}} (empty without timings)."""
        return {layer: {n: t / c["attention"] for n, t in c["index"].items()}
                for layer, c in self.timing.items() if c["attention"] > 0}

    def evaluate(self, name: str, kind: str, route, config: Optional[SparsePrefillConfig] = None,
                 plan: Optional[Dict[str, str]] = None) -> dict:
        """Accuracy, NLL (with paired bootstrap intervals) and density per layer of `route` on every prompt; its
        cost adds the index share of `plan` ({layer: candidate or 'dense'}: what the route runs)."""
        t0 = time.time()
        res = dict(name=name, kind=kind, lengths={}, index_share=self.index_share(plan))
        if config is not None:
            res["config"] = config.file_dict()
        for L in self.lengths:
            t1 = time.time()
            outs, dens = self._run(route, L)
            tasks = {}
            for variant, o in outs.items():
                clusters = [p["clusters"] for p in self.sets[L][variant]]
                diff, lo, hi = paired_bootstrap(self.dense[L][variant], o, clusters, self.n_boot, self.seed)
                ref = float(np.concatenate(self.dense[L][variant]).mean())
                nll = self.sets[L][variant][0]["kind"] == "nll"
                scale = 100.0 / ref if nll else 100.0      # NLL: % of dense; top-1: points
                tasks[variant] = dict(metric=float(np.concatenate(o).mean()), dense=ref, diff=scale * diff,
                                      low=scale * lo, high=scale * hi, unit="%" if nll else "points",
                                      n_tokens=int(sum(len(x) for x in o)))
            layer_density = [dens.get(i, 1.0) for i in range(self.n_layers)] if dens else None
            res["lengths"][L] = dict(tasks=tasks, layer_density=layer_density,
                                     density=float(np.mean(layer_density)) if layer_density else None)
            if route.dispatch is not None:
                res["lengths"][L]["adapter_calls"] = dict(route.dispatch.calls)
            self.log(f"  {name} L={L}: {summary_line(res['lengths'][L])} ({time.time() - t1:.1f} s)")
        self._verdict(res)
        res["seconds"] = round(time.time() - t0, 2)
        self.log(f"  -> {name}: {verdict_line(res, self.max_drop, self.max_nll)}")
        return res

    def _verdict(self, res: dict) -> None:
        drop = nll = None
        ok = ok_ci = True
        for L, r in res["lengths"].items():
            for variant, t in r["tasks"].items():
                if t["unit"] == "points":
                    if drop is None or t["diff"] < drop["diff"]:
                        drop = dict(t, L=L, task=variant)
                    ok &= t["diff"] >= -self.max_drop
                    ok_ci &= t["low"] >= -self.max_drop
                else:
                    if nll is None or t["diff"] > nll["diff"]:
                        nll = dict(t, L=L, task=variant)
                    ok &= t["diff"] <= self.max_nll
                    ok_ci &= t["high"] <= self.max_nll
        longest = res["lengths"][max(res["lengths"])]
        res.update(worst_drop=drop, worst_nll=nll, passes_point=bool(ok), passes_ci=bool(ok_ci),
                   passes=bool(ok_ci if self.strict else ok),
                   cost=None if longest["density"] is None else longest["density"] + res.get("index_share", 0.0))

    # -- the probe pass ---------------------------------------------------------------------------------------------
    def probe(self, candidates: Sequence[tuple]) -> Dict[int, Dict[str, dict]]:
        """{layer: {candidate: {err, density}}}: each candidate beside dense attention on the same inputs, on the first
        prompt of every variant; err = max over lengths of ||o - o_dense|| / ||o_dense||, density at the longest."""
        table: Dict[int, Dict[str, dict]] = {}
        for L in self.lengths:
            t1 = time.time()
            route = R.Route("probe", candidates=list(candidates))
            self._run(route, L, prompts_of=1)
            for layer, per in route.probe.items():
                for name, (e2, r2, kept, vis) in per.items():
                    cell = table.setdefault(layer, {}).setdefault(name, dict(err=0.0, density=1.0))
                    cell["err"] = max(cell["err"], float(np.sqrt(e2 / r2)) if r2 > 0 else 0.0)
                    cell["density"] = kept / vis if vis else 1.0    # the longest length's, as lengths ascend
            self.log(f"  probe L={L}: {len(candidates)} candidates x {len(route.probe)} layers "
                     f"({time.time() - t1:.1f} s)")
        return table


def summary_line(r: dict) -> str:
    parts = [f"{v} {t['diff']:+.2f} {'pt' if t['unit'] == 'points' else '%'}" for v, t in r["tasks"].items()]
    dens = f"density {r['density']:.3f}" if r.get("density") is not None else ""
    return ", ".join(parts) + (f"; {dens}" if dens else "")


def verdict_line(res: dict, max_drop: float, max_nll: float) -> str:
    out = []
    d, n = res.get("worst_drop"), res.get("worst_nll")
    if d:
        out.append(f"worst top-1 {d['diff']:+.2f} pt [{d['low']:+.2f}, {d['high']:+.2f}] ({d['task']} L={d['L']})")
    if n:
        out.append(f"NLL {n['diff']:+.2f} % [{n['low']:+.2f}, {n['high']:+.2f}] (L={n['L']})")
    if res.get("cost") is not None:
        out.append(cost_text(res))
    out.append("PASS" if res["passes"] else f"fails (--max-drop {max_drop}, --max-nll {max_nll})")
    return "; ".join(out)


def cost_text(res: dict) -> str:
    """'density 0.704' or, with an index stage, 'cost 0.812 = density 0.704 + index 0.108 (~1.23x dense attention's
    speed)': the cost is the attention's time over dense attention's (the sparse kernels' time follows density)."""
    share = res.get("index_share") or 0.0
    if not share:
        return f"density {res['cost']:.3f}"
    return (f"cost {res['cost']:.3f} = density {res['cost'] - share:.3f} + index {share:.3f} "
            f"(~{1.0 / res['cost']:.2f}x dense attention's speed)")


# -- plans ------------------------------------------------------------------------------------------------------------

def plans(probe: Dict[int, Dict[str, dict]], names: Sequence[str], n_layers: int, max_levels: int = 16,
          layer_share: Optional[Dict[int, Dict[str, float]]] = None) -> List[dict]:
    """Per-layer plans {layer: candidate name or None (dense)} for increasing error budgets, cheapest last; a
    layer takes its cheapest candidate within the budget (cost: probe density plus the candidate's index share in
    that layer, `layer_share[layer][name]`, 0 when not given; the earlier name on ties), and runs dense where none
    is within the budget or every one costs more than dense attention (1: exact, and no slower)."""
    errors = sorted({c["err"] for per in probe.values() for c in per.values()})
    if len(errors) > max_levels:
        errors = [errors[int(round(i * (len(errors) - 1) / (max_levels - 1)))] for i in range(max_levels)]
    out: List[dict] = []
    for budget in errors:
        plan = {}
        for layer in range(n_layers):
            per = probe.get(layer, {})
            share = (layer_share or {}).get(layer, {})
            ok = [(per[n]["density"] + share.get(n, 0.0), i, n) for i, n in enumerate(names)
                  if n in per and per[n]["err"] <= budget]
            ok = [c for c in ok if c[0] <= 1.0]        # over 1: slower than the layer's dense attention
            plan[layer] = min(ok)[2] if ok else None
        if not out or plan != out[-1]:
            out.append(plan)
    return [p for p in out if any(v is not None for v in p.values())]


def plan_config(plan: Dict[int, Optional[str]], candidates: Dict[str, dict], base: dict) -> SparsePrefillConfig:
    """The configuration of a per-layer plan: the most common candidate at the top level (over `base`), the other
    layers' differences from it in `layers`, dense layers as {"dense": true}."""
    used = Counter(n for n in plan.values() if n is not None)
    top = SparsePrefillConfig(**{**base, **(candidates[used.most_common(1)[0][0]] if used else {})})
    top_sel = top.selection()
    layers = {}
    for layer, name in sorted(plan.items()):
        if name is None:
            layers[layer] = {"dense": True}
            continue
        sel = SparsePrefillConfig(**{**base, **candidates[name]}).selection()
        diff = {k: v for k, v in sel.items() if v != top_sel[k]}
        if diff:
            layers[layer] = diff
    fields = {k: v for k, v in top.file_dict().items() if k != "layers"}
    return SparsePrefillConfig(**fields, layers=layers)


def search(levels: List[dict], measure, max_evals: int, log=print) -> List[dict]:
    """Binary search for the cheapest passing plan (levels: cheapest last): measure(plan) -> result with 'passes';
    the cheapest level first, at most max_evals measurements. Returns the results in the order measured."""
    lo, hi, done = -1, len(levels), []
    i = len(levels) - 1
    while levels and len(done) < max_evals and hi - lo > 1:
        log(f"per-layer plan {i + 1}/{len(levels)}: {sum(v is None for v in levels[i].values())} dense layers")
        r = measure(levels[i], i)
        done.append(r)
        lo, hi = (i, hi) if r["passes"] else (lo, i)
        i = (lo + hi + 1) // 2 if hi - lo > 1 else i
    return done


# Two costs within this relative distance are equal: 2 % is below what the benchmarks resolve between runs (the A/B
# gate of bench/ is 2 %), so the more accurate setting is worth it.
COST_TIE = 0.02
# A calibration prunes nothing when no setting drops more than this share of the visible key blocks at any length
# (short prompts: the always-kept sink, window and last tiles cover most of them). Below 5 % pruned, the accuracy
# measured is that of attention over >= 95 % of the blocks, which cannot rank settings that differ only where they
# prune (longer prompts), and the time it would save (time follows density) is under 5 %.
NO_PRUNING = 0.05


def accuracy_key(r: dict) -> tuple:
    """Smaller is more accurate: the worst top-1 drop against dense over tasks and lengths (points; 0 when no
    setting lost anything or no recall task ran), then the worst NLL increase (% of dense)."""
    drop = max(0.0, -r["worst_drop"]["diff"]) if r.get("worst_drop") else 0.0
    nll = r["worst_nll"]["diff"] if r.get("worst_nll") else 0.0
    return (drop, nll)


def worth_it(results: Sequence[dict]) -> List[dict]:
    """The settings a recommendation can be: uniform or per-layer, passing, and cheaper than dense attention (cost
    < 1; one whose index stage costs more than its pruning saves is slower than the all-dense setting, which is
    exact)."""
    return [r for r in results if r["passes"] and r["kind"] in ("uniform", "per-layer") and r["cost"] < 1.0]


def choose(results: Sequence[dict]) -> Optional[dict]:
    """The cheapest passing setting cheaper than dense attention (worth_it), or None. Passing settings whose cost
    is within COST_TIE (relative) of the cheapest are equal in cost: of those the most accurate wins (accuracy_key),
    then uniform before per-layer, then the cheaper, then the order measured."""
    ok = worth_it(results)
    if not ok:
        return None
    cheapest = min(r["cost"] for r in ok)
    tied = [r for r in ok if r["cost"] <= cheapest * (1 + COST_TIE) + 1e-9]
    return min(tied, key=lambda r: (accuracy_key(r), r["kind"] != "uniform", r["cost"]))


def lowest_density(results: Sequence[dict]) -> Optional[float]:
    """The lowest density any setting (uniform or per-layer) ran at, over every length; None when none was measured."""
    dens = [row["density"] for r in results if r["kind"] in ("uniform", "per-layer")
            for row in r["lengths"].values() if row.get("density") is not None]
    return min(dens) if dens else None


def plans_can_prune(results: Sequence[dict]) -> bool:
    """Whether a per-layer plan of the uniform candidates could prune more than NO_PRUNING at some length: the
    mean over layers of the sparsest candidate's density per layer (the densest-case plan's density, as measured
    with each candidate in every layer) below 1 - NO_PRUNING. When not, the probe and the plans are not measured:
    they could only write the library's default (pruned_nothing)."""
    uniform = [r for r in results if r["kind"] == "uniform"]
    for L in (uniform[0]["lengths"] if uniform else {}):
        per_layer = [r["lengths"][L]["layer_density"] for r in uniform if r["lengths"][L].get("layer_density")]
        if per_layer and float(np.mean(np.min(per_layer, axis=0))) < 1.0 - NO_PRUNING:
            return True
    return False


def pruned_nothing(results: Sequence[dict]) -> bool:
    """Whether no setting pruned more than NO_PRUNING of the blocks at any length (see NO_PRUNING)."""
    low = lowest_density(results)
    return low is not None and low >= 1.0 - NO_PRUNING


# -- confirmation -----------------------------------------------------------------------------------------------------

# Settings measured on the confirmation prompts, at most (--max-confirm): each costs one measurement of every prompt
# (as a calibration setting does), on top of dense attention's on those prompts once. Three: the recommendation, one
# step safer, and the safest passing setting.
CONFIRM_MAX = 3
# No margin on per-layer plans (e.g. a plan's worst drop required within max_drop minus a fraction): in the SmolLM2
# case this answers (issue 43) the chosen plan measured -0.30 pt on its calibration prompts (interval [-0.99, +0.30])
# and -1.28 pt on held-out ones; the gap is about the interval's half-width (the prompts' noise), which no fixed
# margin tracks. A margin that rejected that plan would have to exceed 0.7 of --max-drop, which at these sample sizes
# rejects nearly every plan; the interval's far end (--strict) keeps it too (-0.99 >= -1.0). The independent prompt
# set measures the chosen setting's bias directly, for one measurement when it holds.


def _same_setting(r: dict) -> str:
    """A result's configuration as text: a per-layer plan equal to a uniform candidate is the same setting."""
    return json.dumps(r["config"], sort_keys=True) if r.get("config") is not None else r["name"]


def confirmation_order(results: Sequence[dict], chosen: dict, cap: int = CONFIRM_MAX) -> List[dict]:
    """The settings to measure on the confirmation prompts, in order of safety: `chosen` (choose()'s) first, then
    the other passing settings (uniform or per-layer) denser than it, the cheapest first. Denser is safer: under one
    rule a smaller alpha keeps a superset of a larger one's blocks (a threshold against the top block), and a
    per-layer plan of a smaller error budget gives every layer a candidate of lower probe error. The settings
    choose() counted as costing the same as `chosen` (within COST_TIE) are not safer (it ranked them below `chosen`
    on accuracy) and are left out; a setting equal to one already in the list (a plan that is a uniform candidate)
    once, the uniform name kept. Longer than `cap`: the first cap - 1, then the densest (the safest passing setting
    is tried before the library's default is written; cap 1: `chosen` alone)."""
    if cap <= 0 or chosen is None:
        return []
    seen = {_same_setting(chosen)}
    order = [chosen]
    ok = worth_it(results)
    tied = min(r["cost"] for r in ok) * (1 + COST_TIE) + 1e-9 if ok else chosen["cost"]   # choose()'s equal costs
    rest = sorted((r for r in ok if r["cost"] > max(tied, chosen["cost"])),
                  key=lambda r: (r["cost"], accuracy_key(r), r["kind"] != "uniform"))
    for r in rest:
        key = _same_setting(r)
        if key not in seen:
            seen.add(key)
            order.append(r)
    if len(order) > cap:
        order = order[:cap - 1] + [order[-1]] if cap > 1 else order[:1]
    return order


def confirm(order: Sequence[dict], measure, log=print) -> Tuple[Optional[dict], List[dict]]:
    """Measure the settings of `order` (confirmation_order) on the confirmation prompts until one passes there:
    measure(result) -> its result on those prompts ('passes' under the calibration's tolerance). Returns (the
    calibration result of the first that passed, or None when none did; the confirmation results as measured)."""
    done: List[dict] = []
    for i, r in enumerate(order):
        log(f"confirmation {i + 1}/{len(order)}: {r['name']}, {cost_text(r)}, on the confirmation prompts")
        c = measure(r)
        done.append(c)
        if c["passes"]:
            return r, done
        log(f"  {r['name']} fails on the confirmation prompts" +
            (": the next safer passing setting" if i + 1 < len(order) else ""))
    return None, done
