"""The same kernels through two bindings, interleaved in one run (issue 14, "Measure": before deleting the shim,
measure both paths in one run once): (a) the OLD ctypes shim of commit a07fdec (tests/gpu/sp_cuda.py +
libsp_cuda_test.so, built by the lead from that commit) and (b) the installed package (`import sparse_prefill`).

Cases (Hq 32, Hkv 8, D 128, bf16, batch 1 unless said):
  dense    L in --lengths: causal, contiguous, torch.randn inputs (seed 0); out into a caller buffer, no lse.
           part attn.
  sparse   L in --lengths: the topic workload (sp.workload.topic, seed 0), one shot, default selection with the
           correction: part index (build into a caller workspace), attn (over that index), total (build + attn
           back to back, the headline), one_call (package: sp.sparse_prefill with its workspace; shim: build + attn).
  chunked  the last chunk of a --chunk-context prompt, chunk --chunk x batch --chunk-batch, paged KV (page 64),
           pooled-means cache holding the blocks before the chunk, final chunk, per-tile selection with the
           correction: parts index, attn, step (build + attn, the headline) and one_call (package:
           sp.chunked_prefill with its workspace), each also timed as CUDA-graph replays (timer "graph").
Both paths get the same inputs; the shim reads no environment switch (SP_DENSE_SPLIT, SP_SPARSE_SPLIT,
SP_SPARSE_PERSISTENT, SP_SPLIT_UNITS_PER_SM are removed from this process's environment before it loads).

Timing: --rounds rounds; in each, every part is timed once through each path (CUDA-event median over a
--budget-ms run, _common.time_ms), the paths' order alternating between rounds (A B, B A, ...: a drift of the clocks
during the run weighs on both alike). Reported per (case, part, timer): shim_ms and package_ms (medians over the
rounds), ratio = package_ms / shim_ms, the per-round values, and a fingerprint check of the two paths' outputs
(max abs difference on a fixed sample of the output, density).

Isolation: by default both bindings live in this one process (--isolate auto: if loading the shim or a first small
call through it fails, e.g. two CUDA runtimes in one process, the run falls back to one worker process per binding,
still driven round by round from this process; the JSON records which). --isolate yes forces the workers.
--quick: 3 rounds of 200 ms per measurement instead of 5 of 400 ms.
Writes --out (default bench/results/ab_binding_paths_h200.json) with the header of bench/_common.py.
Usage: python3 bench/ab_binding_paths.py --shim-lib /path/libsp_cuda_test.so --shim-py /path/dir_of_sp_cuda.py \\
         [--lengths 8192,32768,131072] [--cases dense,sparse,chunked] [--quick] [--out FILE]"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import traceback

import torch

from _common import (D, HKV, HQ, RESULTS, SEL, apply_profile, attention_workspace, emit, index_workspace, ints,
                     median, package_topic, require_cuda, time_graph_ms, time_ms, workspace, write_results)

OLD_ENV = ("SP_DENSE_SPLIT", "SP_SPARSE_SPLIT", "SP_SPARSE_PERSISTENT", "SP_SPLIT_UNITS_PER_SM")
CASE_KINDS = ("dense", "sparse", "chunked")
HEADLINE = {"dense": "attn", "sparse": "total", "chunked": "step"}
PAGE = 64
SAMPLE = 65536  # output elements compared between the paths
DEVICE = "cuda"

FULL = dict(rounds=5, budget_ms=400.0)
QUICK = dict(rounds=3, budget_ms=200.0)


# ---------------------------------------------------------------------------------------------------------------------
# Cases and their inputs (identical for both paths; made once per process)
# ---------------------------------------------------------------------------------------------------------------------

def case_list(args):
    kinds = [c for c in args.cases.split(",") if c]
    cases = []
    for kind in kinds:
        if kind == "chunked":
            cases.append(dict(kind="chunked", L=args.chunk_context, chunk=args.chunk, batch=args.chunk_batch,
                              page=PAGE))
        else:
            cases += [dict(kind=kind, L=L) for L in ints(args.lengths)]
    return cases


def case_name(case):
    if case["kind"] == "chunked":
        return f"chunked L={case['L']} chunk={case['chunk']} batch={case['batch']} page={case['page']}"
    return f"{case['kind']} L={case['L']}"


class Inputs:
    """The arrays of one case: args = the positional (q, k, v, cu_q, cu_k, max_q, max_k), kw = paged KV keywords,
    means = the pooled-means cache (chunked; each path writes its own clone)."""

    def __init__(self, case, dev=None):
        dev = dev or DEVICE
        L = case["L"]
        self.kw, self.means, self.cache = {}, None, None
        if case["kind"] == "dense":
            torch.manual_seed(0)
            q = torch.randn(L, HQ, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(L, HKV, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(L, HKV, D, device=dev, dtype=torch.bfloat16)
            cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
            self.args = (q, k, v, cu, cu, L, L)
        elif case["kind"] == "sparse":
            q, k, v = package_topic(L, seed=0, dev=dev)
            cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
            self.args = (q, k, v, cu, cu, L, L)
        else:
            from bench_chunked import Cache
            assert case["page"] == PAGE
            C, B = case["chunk"], case["batch"]
            cache = Cache(L, B, dev=dev, make=lambda n, seed: package_topic(n, seed=seed, dev=dev))
            q, cu_q, used, C, Lk = cache.step(L - C, L)
            cache.q = None  # the prompts' other queries are not needed
            self.cache = cache
            self.args = (q, cache.k, cache.v, cu_q, None, C, Lk)
            self.kw = dict(block_table=cache.block_table, seqused_k=used)
            self.means = cache.mean_cache(L - C)


# ---------------------------------------------------------------------------------------------------------------------
# The two bindings behind one small interface
# ---------------------------------------------------------------------------------------------------------------------

def load_shim(lib_path, py_path):
    """The old sp_cuda module (a07fdec) bound to the library at lib_path."""
    py = py_path if py_path.endswith(".py") else os.path.join(py_path, "sp_cuda.py")
    if not os.path.isfile(py):
        raise FileNotFoundError(f"--shim-py: no sp_cuda.py at {py}")
    if not os.path.isfile(lib_path):
        raise FileNotFoundError(f"--shim-lib: no library at {lib_path}")
    os.environ["SP_CUDA_LIB"] = os.path.abspath(lib_path)  # the module resolves its library from this on every call
    spec = importlib.util.spec_from_file_location("sp_cuda_shim_a07fdec", py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.lib()  # load now: a missing symbol or a broken library fails here
    return mod


class ShimAPI:
    name = "shim"

    def __init__(self, lib_path, py_path):
        self.m = load_shim(lib_path, py_path)

    def attention(self, args, out, kw):
        m = self.m
        return lambda: m.attention(*args, causal=True, out=out, return_lse=False, **kw)

    def index_stage(self, args, kw, sel, means):
        m = self.m
        ws = m.index_workspace(*args, block_size=sel["block_size"], head_subgroups=sel.get("head_subgroups", 1),
                               **kw)
        return lambda: m.build_index(*args, ws, **sel, **kw, mean_cache=means)

    def attend(self, args, holder, out, kw):
        m = self.m
        q, k, v, rest = args[0], args[1], args[2], args[3:]
        return lambda: m.sparse_attention(q, k, v, holder[0], *rest, out=out, **kw)

    @staticmethod
    def density(idx):
        return idx.density()

    def one_call(self, case, args, kw, sel, out, means):
        return None  # the shim has no one-call entry point: its build + attn stands in


class PackageAPI:
    name = "package"

    def __init__(self):
        self.sp = require_cuda()
        self.wsd = attention_workspace(D, DEVICE)

    def attention(self, args, out, kw):
        sp, ws = self.sp, self.wsd
        return lambda: sp.attention(*args, causal=True, out=out, workspace=ws, **kw)

    def index_stage(self, args, kw, sel, means):
        sp = self.sp
        ws = index_workspace(*args, **kw, **sel)
        return lambda: sp.build_index(*args, **kw, **sel, workspace=ws, mean_cache=means)

    def attend(self, args, holder, out, kw):
        sp = self.sp
        q, k, v, rest = args[0], args[1], args[2], args[3:]
        return lambda: sp.sparse_attention(q, k, v, holder[0], *rest, out=out, **kw)

    @staticmethod
    def density(idx):
        return idx.density

    def one_call(self, case, args, kw, sel, out, means):
        sp = self.sp
        if case["kind"] == "chunked":
            q, kc, vc, cu_q, _, C, Lk = args
            bt, used = kw["block_table"], kw["seqused_k"]
            ws = workspace(sp.chunked_prefill_workspace_bytes(q, kc, vc, cu_q, bt, used, C, Lk, **sel), q.device)
            rest = {k_: v_ for k_, v_ in sel.items() if k_ != "final_chunk"}
            return lambda: sp.chunked_prefill(q, kc, vc, cu_q, bt, used, C, Lk, final_chunk=sel["final_chunk"],
                                              mean_cache=means, out=out, workspace=ws, **rest)
        ws = workspace(sp.sparse_prefill_workspace_bytes(*args, **sel), args[0].device)
        return lambda: sp.sparse_prefill(*args, **sel, out=out, workspace=ws)


def fingerprint(out):
    """A fixed sample of the output (float32 list) and its float64 sums, to compare the paths' results."""
    flat = out.reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    sample = flat[::step][:SAMPLE].float()
    return dict(sample=sample.cpu().tolist(), sum=float(out.sum(dtype=torch.float64)),
                abs_sum=float(out.abs().sum(dtype=torch.float64)), nan=bool(torch.isnan(out).any()))


class Runner:
    """One binding's parts for the current case: name -> callable; times them on request."""

    def __init__(self, api):
        self.api, self.parts, self.keep = api, {}, None

    def setup(self, case, inp):
        api = self.api
        args, kw = inp.args, inp.kw
        out = torch.empty_like(args[0])
        if case["kind"] == "dense":
            self.parts = {"attn": api.attention(args, out, kw)}
            self.parts["attn"]()
            density = None
        else:
            sel = dict(SEL, correction=True)
            if case["kind"] == "chunked":
                sel["final_chunk"] = True
            means = tuple(m.clone() for m in inp.means) if inp.means is not None else None
            build = api.index_stage(args, kw, sel, means)
            holder = [build()]
            attn = api.attend(args, holder, out, kw)

            def total():
                holder[0] = build()
                attn()
            headline = HEADLINE[case["kind"]]
            self.parts = {"index": build, "attn": attn, headline: total}
            self.parts["one_call"] = api.one_call(case, args, kw, sel, out, means) or total
            total()
            density = api.density(holder[0])
            self.keep = (holder, means)
        torch.cuda.synchronize()
        check = fingerprint(out)
        check["density"] = density
        self.out = out
        return dict(parts=list(self.parts), check=check)

    def time(self, part, timer, budget_ms):
        fn = self.parts[part]
        if timer == "graph":
            return time_graph_ms(fn)
        return time_ms(fn, total_ms_budget=budget_ms)

    def teardown(self):
        self.parts, self.keep, self.out = {}, None, None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------------
# In-process and worker-process paths (same interface for the driver)
# ---------------------------------------------------------------------------------------------------------------------

class LocalPath:
    def __init__(self, api):
        self.name, self.runner = api.name, Runner(api)

    def setup(self, case, inp):
        return self.runner.setup(case, inp)

    def time(self, part, timer, budget_ms):
        return self.runner.time(part, timer, budget_ms)

    def teardown(self):
        self.runner.teardown()

    def close(self):
        pass


class RemotePath:
    """A worker process (this script with --worker NAME) answering one JSON line per request."""

    def __init__(self, name, args):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name]
        if name == "shim":
            cmd += ["--shim-lib", args.shim_lib, "--shim-py", args.shim_py]
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._call(dict(op="hello"))

    def _call(self, req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (rc {self.proc.poll()})")
        rep = json.loads(line)
        if "error" in rep:
            raise RuntimeError(f"{self.name} worker: {rep['error']}")
        return rep

    def setup(self, case, inp=None):
        return self._call(dict(op="setup", case=case))

    def time(self, part, timer, budget_ms):
        return self._call(dict(op="time", part=part, timer=timer, budget_ms=budget_ms))["ms"]

    def teardown(self):
        self._call(dict(op="teardown"))

    def close(self):
        try:
            self._call(dict(op="quit"))
        except Exception:  # noqa: BLE001
            pass
        self.proc.wait(timeout=60)


def worker_main(args):
    """--worker NAME: serve requests on stdin/stdout; everything else this process prints goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol keeps the real stdout ...
    os.dup2(2, 1)                                   # ... and anything else written to fd 1 (C++, CUDA) goes to stderr
    sys.stdout = sys.stderr
    runner = None

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            op = req["op"]
            if op == "quit":
                reply(dict(ok=True))
                return
            if runner is None:
                api = ShimAPI(args.shim_lib, args.shim_py) if args.worker == "shim" else PackageAPI()
                runner = Runner(api)
            if op == "hello":
                reply(dict(ok=True, name=args.worker))
            elif op == "setup":
                reply(runner.setup(req["case"], Inputs(req["case"])))
            elif op == "time":
                reply(dict(ms=runner.time(req["part"], req["timer"], req["budget_ms"])))
            elif op == "teardown":
                runner.teardown()
                reply(dict(ok=True))
            else:
                reply(dict(error=f"unknown op {op!r}"))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            reply(dict(error=repr(e)[:500]))


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------

def compare_checks(a, b):
    """max |a - b| over the sampled outputs, and whether densities and NaN flags agree."""
    sa, sb = a["sample"], b["sample"]
    diff = max((abs(x - y) for x, y in zip(sa, sb)), default=0.0) if len(sa) == len(sb) else None
    return dict(max_abs_diff_sample=diff, sum_shim=a["sum"], sum_package=b["sum"],
                density_shim=a["density"], density_package=b["density"],
                density_equal=a["density"] == b["density"], nan=a["nan"] or b["nan"])


def open_paths(args):
    """(shim path, package path, isolation note)."""
    if args.isolate != "yes":
        shim = None
        try:
            pkg = LocalPath(PackageAPI())
            shim = LocalPath(ShimAPI(args.shim_lib, args.shim_py))
            probe = dict(kind="dense", L=1024)
            inp = Inputs(probe)
            c = compare_checks(shim.setup(probe, inp)["check"], pkg.setup(probe, inp)["check"])
            shim.teardown()
            pkg.teardown()
            if c["max_abs_diff_sample"] is None or c["max_abs_diff_sample"] > 0.05 or c["nan"]:
                raise RuntimeError(f"probe outputs disagree: {c['max_abs_diff_sample']}")
            return shim, pkg, "one process"
        except Exception as e:  # noqa: BLE001
            if args.isolate == "no":
                raise
            note = f"worker processes (in-process shim failed: {repr(e)[:300]})"
            print(note, flush=True)
            traceback.print_exc()
    else:
        note = "worker processes (--isolate yes)"
    return RemotePath("shim", args), RemotePath("package", args), note


def run_case(case, paths, args, rows):
    local = isinstance(paths[0], LocalPath)
    inp = Inputs(case) if local else None
    info = {p.name: p.setup(case, inp) for p in paths}
    check = compare_checks(info["shim"]["check"], info["package"]["check"])
    parts = [p for p in info["package"]["parts"] if p in info["shim"]["parts"]]
    timers = ["events", "graph"] if case["kind"] == "chunked" else ["events"]
    per = {(part, timer, p.name): [] for part in parts for timer in timers for p in paths}
    for r in range(args.rounds):
        order = paths if r % 2 == 0 else paths[::-1]
        for part in parts:
            for timer in timers:
                for p in order:
                    per[(part, timer, p.name)].append(p.time(part, timer, args.budget_ms))
    for part in parts:
        for timer in timers:
            s, k = per[(part, timer, "shim")], per[(part, timer, "package")]
            s_ok, k_ok = [x for x in s if x is not None], [x for x in k if x is not None]
            sm, km = median(s_ok), median(k_ok)
            row = dict(case=case["kind"], shape=case_name(case), **{k_: v_ for k_, v_ in case.items() if k_ != "kind"},
                       part=part, timer=timer, headline=part == HEADLINE[case["kind"]],
                       shim_ms=sm, package_ms=km, ratio=(km / sm) if sm and km else None,
                       shim_rounds=s, package_rounds=k)
            if part == parts[0] and timer == timers[0]:
                row["check"] = check
            emit(row)
            rows.append(row)
    for p in paths:
        p.teardown()
    del inp
    if local:
        torch.cuda.empty_cache()


def summary(rows):
    out = []
    for r in rows:
        if r["headline"]:
            out.append(dict(shape=r["shape"], part=r["part"], timer=r["timer"], shim_ms=r["shim_ms"],
                            package_ms=r["package_ms"], ratio=r["ratio"],
                            within_3pct=(r["ratio"] is not None and r["ratio"] <= 1.03)))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim-lib", default=None, help="libsp_cuda_test.so built from a07fdec (required)")
    ap.add_argument("--shim-py", default=None, help="directory holding a07fdec's tests/gpu/sp_cuda.py, or the file "
                                                    "(required)")
    ap.add_argument("--shim-commit", default="a07fdec", help="commit the shim was built from (recorded)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "ab_binding_paths_h200.json"))
    ap.add_argument("--cases", default="dense,sparse,chunked", help="comma list of dense, sparse, chunked")
    ap.add_argument("--lengths", default="8192,32768,131072", help="L of the dense and sparse cases")
    ap.add_argument("--chunk-context", type=int, default=131072, help="prompt length of the chunked case")
    ap.add_argument("--chunk", type=int, default=1024, help="chunk of the chunked case")
    ap.add_argument("--chunk-batch", type=int, default=1, help="batch of the chunked case")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 3)")
    ap.add_argument("--budget-ms", type=float, default=None,
                    help="event-timing budget per measurement (default 400; --quick 200)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 200 ms: about 1.5 minutes on the H200")
    ap.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                    help="auto (default): one process, worker processes if the shim fails in-process; yes: workers")
    ap.add_argument("--worker", choices=("shim", "package"), default=None, help=argparse.SUPPRESS)
    args = apply_profile(ap.parse_args(argv), QUICK, FULL)
    if args.worker:
        return args
    if not args.shim_lib or not args.shim_py:
        ap.error("--shim-lib and --shim-py are required (the shim of a07fdec: see bench/README.md)")
    bad = [c for c in args.cases.split(",") if c and c not in CASE_KINDS]
    if bad:
        ap.error(f"--cases: unknown {bad} (known: {', '.join(CASE_KINDS)})")
    ints(args.lengths)
    for L in ints(args.lengths) + [args.chunk_context]:
        if L <= 0 or L % 128:
            ap.error(f"lengths must be positive multiples of 128, got {L}")
    if not 0 < args.chunk <= args.chunk_context or args.chunk_batch <= 0 or args.rounds <= 0:
        ap.error("--chunk must be in [1, --chunk-context]; --chunk-batch and --rounds positive")
    return args


def main(argv=None):
    cleared = {v: os.environ.pop(v) for v in OLD_ENV if v in os.environ}
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    require_cuda()
    shim, pkg, isolation = open_paths(args)
    paths = (shim, pkg)
    rows = []
    meta = dict(shim=dict(commit=args.shim_commit, lib=os.path.abspath(args.shim_lib),
                          py=os.path.abspath(args.shim_py)),
                isolation=isolation, rounds=args.rounds, budget_ms=args.budget_ms,
                order="paths alternate A B / B A between rounds", cleared_env=cleared,
                shape=dict(hq=HQ, hkv=HKV, d=D, dtype="bfloat16"), selection=SEL,
                note="ratio = package_ms / shim_ms; headline rows: dense attn, sparse total (build + attn), "
                     "chunked step (build + attn)")
    try:
        for case in case_list(args):
            print("case", case_name(case), flush=True)
            run_case(case, paths, args, rows)
            write_results(args.out, rows, summary=summary(rows), **meta)
    finally:
        for p in paths:
            p.close()
    res = write_results(args.out, rows, summary=summary(rows), **meta)
    fmt = lambda x, spec: format(x, spec) if x is not None else "n/a"  # noqa: E731
    for s in res["summary"]:
        print(f"{s['shape']:<48} {s['part']:<6} {s['timer']:<6} shim {fmt(s['shim_ms'], '.4f')} ms  package "
              f"{fmt(s['package_ms'], '.4f')} ms  ratio {fmt(s['ratio'], '.3f')}", flush=True)


if __name__ == "__main__":
    main()
