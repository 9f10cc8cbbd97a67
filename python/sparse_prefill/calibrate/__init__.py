"""`python -m sparse_prefill.calibrate MODEL`: what sparse prefill costs your model in accuracy, and the settings the
engine adapters load.

    python -m sparse_prefill.calibrate /models/my-llama --lengths 8192,32768 --text my_docs.txt --out calib/
    SPARSE_PREFILL_CONFIG=calib/sparse_prefill.json vllm serve ...      # or register(config_file=...) in transformers

It loads a transformers model from a local folder or GGUF file (nothing is downloaded), routes its attention through
the library (dense `sp.attention` as the reference, `sp.sparse_prefill` for each candidate setting; on the CPU the
library's exact CPU reference), and measures on generated prompts (key-value recall in several layouts and copying,
with your text as filler when given, and next-token NLL over your text):
  - per layer, on one prompt at the longest length, the time of each candidate's index stage (sp.build_index) and
    of dense attention on the same inputs: a setting's cost is its density plus its index share (index time over
    dense attention's), its time relative to dense attention;
  - each candidate selection (default: the per-key rule 'key_max' at alpha 0.3, 0.1, 0.03, 0.01, 0.003, then row max at
    alpha 0.01, the library default 0.003, 0.001; one selection per query head) in every layer, and the exact oracle
    at a few mass fractions (the density a selection that knew the attention would need);
  - per layer, each candidate's output error and density against dense attention on the same inputs;
  - per-layer plans (each layer its cheapest candidate within an error budget, by density plus its index share in
    that layer; dense where none is or each costs more than the layer's dense attention), searched for
    the cheapest that passes; skipped, with the oracle measured at its highest fraction only, when no plan of the
    candidates could prune more than 5 % (each layer's sparsest candidate, averaged over layers).
A setting that costs as much as dense attention or more (its index stage costs more than its pruning saves) is never
the recommendation: the all-dense setting is exact and no slower.
Every accuracy is a difference to dense on the same tokens with a paired bootstrap 95 % interval. The cheapest setting
whose top-1 accuracy stays within --max-drop points and NLL within --max-nll % of dense on every task and length is
written as DIR/sparse_prefill.json (a `layers` entry per layer that differs, {"dense": true} where a layer needs
dense attention), with DIR/report.md, DIR/calibration.json and DIR/calibration.png (when matplotlib is installed;
else the log and the report say why it is missing). The choice is safe:
  - ties: costs (density plus index share at the longest length) within 2 % of the cheapest are equal (search.COST_TIE); of those the
    most accurate wins: the smallest worst top-1 drop against dense, then the smallest NLL increase;
  - nothing pruned: when no setting dropped more than 5 % of the key blocks at any length (search.NO_PRUNING; short
    prompts are covered by the always-kept blocks), the lengths cannot tell settings apart: the log and the report
    say so and the file holds the library's default selection (over --base), not the fastest candidate;
  - confirmed on other prompts: the search compares many settings on the same few prompts and keeps the cheapest
    that passed, which favours settings whose measured drop was luckily small (the winner's curse). So the choice is
    measured again on a second prompt set, the confirmation split (same --lengths, tasks and sizes; other prompt
    seeds and, without --text, another built-in text: disjoint from the calibration's prompts and from any
    `--check --seed N`'s), under the same tolerance. When it fails there, the next safer passing setting (denser) is
    measured instead, until one passes both sets; at most --max-confirm settings (default 3, the last the densest
    passing one; each costs one measurement, plus dense attention's on those prompts once). When none holds (the
    densest passing setting included), the file runs every layer dense, as when nothing passes, and the log and the
    report say why. Both sets' numbers are
    in the log, report.md and calibration.json (`confirmation`);
  - the file records `validated_lengths` (--lengths); the adapters warn once when a sparse call's prompt is more than
    2x the longest (integrations.core.LONG_PROMPT_FACTOR).
It needs torch and transformers (the hf extra: pip install 'sparse-prefill[hf]', in a clone '.[hf]'); without them it
stops with one line saying so, before looking at MODEL.

`--check FILE` measures an existing configuration instead, both as the calibration runs it and through the
transformers adapter (the round trip): the user's held-out check, a third prompt set when given another --seed (and
--formats / --layouts) than the calibration's; with the defaults (seed 0, the code format) its prompts are a default
calibration's own.
"""

from .cli import build_parser, main, run

__all__ = ["main", "run", "build_parser"]
