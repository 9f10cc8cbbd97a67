"""Shared plumbing of the benchmark and profiling scripts in bench/: commit lookup, CUDA-event and CUDA-graph timing,
the results-file writer (the header keys the design brief asks for), workspaces and the torch SDPA peers.

Every script runs the kernels through the installed package (`import sparse_prefill as sp`, `pip install .`); none
reaches into tests/ or build trees. Importing this module needs torch but no GPU, so `--help` and argument checks
work anywhere; require_cuda() is what a script calls before touching the device."""
import datetime
import json
import os
import shlex
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# The Llama-3.1-8B head shape of every speed figure (docs/workload.md) and the benchmarks' selection: FlashPrefill
# V2's rule (tile energy), the reference of the issues' speed targets and of every earlier measurement. The library's
# default (sp.SELECTION_DEFAULTS: row max, no correction since issue 13) is measured with --rule row_max; the
# correction is on here as it was in every earlier run (benchmarks that measure both pass it explicitly).
HQ, HKV, D, BLOCK = 32, 8, 128, 128
SEL = dict(alpha=0.1, block_size=128, sink=256, window=512, last_n=2, rule="tile_energy", correction=True)


# ---------------------------------------------------------------------------------------------------------------------
# Arguments and environment
# ---------------------------------------------------------------------------------------------------------------------

def ints(s):
    """'1,2,3' -> [1, 2, 3] ('' -> [])."""
    return [int(x) for x in str(s).split(",") if x.strip()]


def floats(s):
    return [float(x) for x in str(s).split(",") if x.strip()]


def apply_profile(args, quick, full):
    """Fill the options left at None from the quick or the full profile (explicit flags always win)."""
    profile = quick if getattr(args, "quick", False) else full
    for key, value in profile.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def require_cuda():
    """Exit with a message unless torch sees a GPU and the installed package has its CUDA backend."""
    import sparse_prefill as sp
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    if not sp.with_cuda:
        sys.exit(f"the installed sparse_prefill ({sp.__file__}) has no CUDA backend: rebuild it with nvcc on PATH "
                 "(pip install .)")
    return sp


def commit():
    """SP_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("SP_COMMIT"):
        return os.environ["SP_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def command():
    """The exact command line of this process."""
    return shlex.join([os.path.basename(sys.executable)] + sys.argv)


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------------------
# Results files
# ---------------------------------------------------------------------------------------------------------------------

def header():
    """The keys every results file starts with (the design brief, "Benchmarks and results files")."""
    import sparse_prefill as sp
    return dict(through_package=True, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                commit=commit(), date=utc_now(), command=command(),
                package=dict(version=sp.__version__, file=sp.__file__, with_cuda=bool(sp.with_cuda)),
                torch=torch.__version__)


def write_results(path, rows, **extra):
    """Write {header, **extra, rows} to `path` (directories created) and return the dict. Called after every row by
    the long scripts, so a run cut short by the device's time limit still leaves what it measured."""
    res = header()
    res.update(extra)
    res["rows"] = rows
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)
    return res


def try_plot(plot, res, path):
    """plot(res, path) when matplotlib is there; a failed plot never loses the JSON."""
    try:
        plot(res, path)
    except Exception as e:  # noqa: BLE001
        print("plot skipped:", repr(e)[:200], flush=True)


def add_plot_only(ap):
    """The --plot-only RESULTS_JSON option every benchmark has: redraw the plot of a results file (committed
    measurements included) without running anything; see plot_only()."""
    ap.add_argument("--plot-only", metavar="RESULTS_JSON", default=None,
                    help="read RESULTS_JSON (a results file this script wrote) and write its plot beside it "
                         "(same name, .png), then exit: no measurement, no GPU")


def plot_only(plot, path):
    """plot(res, path's .png) for the results file at `path`; touches neither the GPU nor the package. Unlike
    try_plot, a failure raises: the plot is all this call is for. Returns the PNG's path."""
    with open(path) as f:
        res = json.load(f)
    png = os.path.splitext(path)[0] + ".png"
    plot(res, png)
    print("wrote", png, flush=True)
    return png


def emit(row):
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------------

def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def event_times_ms(fn, n):
    """Times of n calls (ms), each between CUDA events and synchronised."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return times


def time_ms(fn, total_ms_budget=1500.0, max_iters=50):
    """Median per-call time (ms) between CUDA events, one synchronised call at a time: one warm-up call, one probe
    call to size the run, then max(3, min(max_iters, budget / probe)) timed calls. Counts the host's launch gaps
    when a call's GPU work is shorter than its Python + launch overhead (see time_graph_ms)."""
    fn()
    torch.cuda.synchronize()
    one = event_times_ms(fn, 1)[0]
    return median(event_times_ms(fn, max(3, min(max_iters, int(total_ms_budget / max(one, 1e-3))))))


def time_few_ms(fn, repeats, warmup=True):
    """Median of `repeats` timed calls after one untimed call when warmup: for calls of seconds, where time_ms's
    probe and minimum of 3 calls would not fit the device's time limit."""
    if warmup:
        fn()
        torch.cuda.synchronize()
    return median(event_times_ms(fn, repeats))


def time_graph_ms(fn, reps=None, rounds=7):
    """GPU time of one fn() call without the host's enqueue time: `reps` calls captured into one CUDA graph, replayed
    between events, divided by reps (median of `rounds`). Per-call event timing (time_ms) also counts the host's
    launch gaps when a call's GPU work is shorter than its Python + launch overhead (a ~0.1 ms index stage at chunk
    1024 x batch 1); an engine enqueues ahead of the GPU, so this is the time the step costs it. fn must be
    capturable: pass the package's workspace= arguments (no allocation, no host synchronisation). Returns None when
    the capture fails (the reason is printed)."""
    one = time_ms(fn, total_ms_budget=50.0, max_iters=5)
    reps = reps or max(1, min(50, int(20.0 / max(one, 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print("graph timing unavailable:", repr(e)[:200], flush=True)
        torch.cuda.synchronize()
        return None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / reps)
    del graph
    return median(times)


# ---------------------------------------------------------------------------------------------------------------------
# Package helpers
# ---------------------------------------------------------------------------------------------------------------------

def workspace(nbytes, device="cuda"):
    """A buffer of at least nbytes (and at least 4) for the package's workspace= arguments (torch allocations are
    256-byte aligned). int32 elements: the extension's array conversion takes int32 but (at the time of writing)
    not uint8, and a workspace may have any dtype it accepts."""
    return torch.empty(max((int(nbytes) + 3) // 4, 1), dtype=torch.int32, device=device)


def attention_workspace(head_dim=D, device="cuda"):
    import sparse_prefill as sp
    return workspace(sp.attention_workspace_bytes(head_dim), device)


def index_workspace(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    """A workspace for sp.build_index(..., **kw) on these arrays (kw: block_table, seqused_k, union, head_subgroups,
    selection parameters; the ones that do not change the size are accepted and ignored)."""
    import sparse_prefill as sp
    return workspace(sp.index_workspace_bytes(q, k, v, cu_q, cu_k, max_q, max_k, **kw), q.device)


def topic(L, hq=HQ, hkv=HKV, d=D, seed=0, dev="cuda", dtype=torch.bfloat16):
    """The speed reference workload (docs/workload.md), generated on `dev` (same definition as
    sparse_prefill.workload.topic, another random stream; kept so that densities compare with the earlier results
    files). Returns q [L, hq, d], k, v [L, hkv, d] in `dtype`."""
    g = torch.Generator(device=dev).manual_seed(seed)
    nb = (L + BLOCK - 1) // BLOCK
    t = torch.randn(hkv, nb, d, device=dev, generator=g)                     # topic per (KV head, block)
    k = t.transpose(0, 1).repeat_interleave(BLOCK, 0)[:L] + torch.randn(L, hkv, d, device=dev, generator=g)
    v = torch.randn(L, hkv, d, device=dev, generator=g)
    p = torch.arange(nb, device=dev)
    hi = torch.clamp(p, min=1).float()                                        # group p draws from [0, max(p, 1))
    targets = (torch.rand(hkv, nb, 4, device=dev, generator=g) * hi[None, :, None]).long()   # [hkv, nb, 4]
    tq = torch.gather(t, 1, targets.reshape(hkv, nb * 4)[..., None].expand(hkv, nb * 4, d)).reshape(hkv, nb, 4, d)
    tq = tq.sum(2)                                                            # [hkv, nb, d]
    qg = tq.transpose(0, 1).repeat_interleave(BLOCK, 0)[:L]                   # [L, hkv, d]
    q = qg.repeat_interleave(hq // hkv, 1) + torch.randn(L, hq, d, device=dev, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def package_topic(L, seed=0, hq=HQ, hkv=HKV, d=D, dev="cuda", dtype=torch.bfloat16):
    """sp.workload.topic (docs/workload.md's speed workload, generated by the package on the CPU) as CUDA tensors."""
    import sparse_prefill as sp
    q, k, v = sp.workload.topic(L, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, seed=seed)
    return tuple(torch.from_numpy(a).to(dev).to(dtype) for a in (q, k, v))


def sdpa_layout(q, k, v, g):
    """[L, H, D] tensors as torch SDPA's [1, H, L, D] (BSHD strides), KV heads repeated to the query heads."""
    qt = q.unsqueeze(0).transpose(1, 2)
    kt = k.repeat_interleave(g, dim=1).unsqueeze(0).transpose(1, 2)
    vt = v.repeat_interleave(g, dim=1).unsqueeze(0).transpose(1, 2)
    return qt, kt, vt


def time_sdpa_peers(row, qt, kt, vt, is_causal, graph=False, keys=("cudnn", "fa2"), timer=None):
    """row['cudnn_ms'] / row['fa2_ms'] (and *_graph_ms with graph=True): torch SDPA with the cuDNN and the flash
    (FA2) backend, timed by timer (default time_ms); a backend that refuses the shapes records None and *_error."""
    timer = timer or time_ms
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
    for key in keys:
        try:
            with sdpa_kernel(backends[key]):
                fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal)  # noqa: E731
                row[key + "_ms"] = timer(fn)
                if graph:
                    row[key + "_graph_ms"] = time_graph_ms(fn)
        except Exception as e:  # noqa: BLE001
            row[key + "_ms"] = None
            row[key + "_error"] = repr(e)[:200]
    return row


def rel_err(a, b):
    """||a - b||_F / ||b||_F in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
