"""`python -m sparse_prefill.calibrate MODEL`: what sparse prefill costs your model in accuracy, and the settings the
engine adapters load.

    python -m sparse_prefill.calibrate /models/my-llama --lengths 8192,32768 --text my_docs.txt --out calib/
    SPARSE_PREFILL_CONFIG=calib/sparse_prefill.json vllm serve ...      # or register(config_file=...) in transformers

It loads a transformers model from a local folder or GGUF file (nothing is downloaded), routes its attention through
the library (dense `sp.attention` as the reference, `sp.sparse_prefill` for each candidate setting; on the CPU the
library's exact CPU reference), and measures on generated prompts (key-value recall in several layouts and copying,
with your text as filler when given, and next-token NLL over your text):
  - each candidate selection (default: row max at alpha 0.1, 0.03, 0.01, the library default 0.003, 0.001; one
    selection per query head) in every layer, and the exact oracle at a few mass fractions (the density a selection
    that knew the attention would need);
  - per layer, each candidate's output error and density against dense attention on the same inputs;
  - per-layer plans (each layer its cheapest candidate within an error budget, dense where none is), searched for
    the cheapest that passes.
Every accuracy is a difference to dense on the same tokens with a paired bootstrap 95 % interval. The cheapest setting
whose top-1 accuracy stays within --max-drop points and NLL within --max-nll % of dense on every task and length is
written as DIR/sparse_prefill.json (a `layers` entry per layer that differs, {"dense": true} where a layer needs
dense attention), with DIR/report.md, DIR/calibration.json and DIR/calibration.png.

`--check FILE` measures an existing configuration instead (e.g. on another --seed and --layouts than it was
calibrated on), both as the calibration runs it and through the transformers adapter (the round trip).
"""

from .cli import build_parser, main, run

__all__ = ["main", "run", "build_parser"]
