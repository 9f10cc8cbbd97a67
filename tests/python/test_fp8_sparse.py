"""Block-sparse FP8 (float8_e4m3fn) on CUDA with per-(sequence, KV head) descales (docs/semantics.md, "FP8 inputs"),
against the CPU reference on the same FP8 arrays. The index stage: the selection (bf16 scoring on the GPU:
near-threshold ties may flip), the real-unit float32 pooled means, the mean cache over paged FP8 KV, and the errors.
The block-sparse FP8 kernel (SparseFp8Fwd; SparseSplitKvFp8Fwd for chunk shapes): over GPU and CPU indexes (its
correction reads e4m3 means in k's / v's raw units: `_e4m3_means` gives the CPU reference the same values), the full
list against the dense FP8 kernel, paged against contiguous, chunked prefill with the mean cache."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import sparse_prefill as sp  # noqa: E402
from conftest import to_paged  # noqa: E402

F8 = torch.float8_e4m3fn
pytestmark = pytest.mark.skipif(not (sp.with_cuda and torch.cuda.is_available()),
                                reason="needs the CUDA backend and a GPU")


def _scales(rng, x, cu, hkv, mode):
    """float32 descales [B, Hkv] for x [tokens, H, D] (H = Hkv * g): amax / 448 of each (sequence, KV head) times a
    factor in [1, 3] (so the scales are not a function of the amax alone); 'head' shares one per KV head over the
    batch, 'tensor' one for everything."""
    B, g = len(cu) - 1, x.shape[1] // hkv
    amax = np.ones((B, hkv), np.float32)
    for b in range(B):
        for h in range(hkv):
            part = np.abs(x[cu[b]:cu[b + 1], h * g:(h + 1) * g])
            if part.size:
                amax[b, h] = max(float(part.max()), 1e-3)
    if mode == "head":
        amax[:] = amax.max(axis=0, keepdims=True)
    elif mode == "tensor":
        amax[:] = amax.max()
    return (amax / 448 * rng.uniform(1, 3, (1, 1) if mode == "tensor" else (1, hkv) if mode == "head" else (B, hkv))
            ).astype(np.float32)


def _quantize(x, cu, d, hkv):
    """x / descale of its (sequence, KV head), saturated and cast to e4m3 (round to nearest even)."""
    g = x.shape[1] // hkv
    seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    per_row = d[seq][:, np.repeat(np.arange(hkv), g), None]
    return torch.from_numpy(x / per_row).clamp(-448, 448).to(F8)


def _descale_views(d, mode, device):
    """The descale array as the caller would pass it: materialised (q), transposed storage (k), broadcast views."""
    t = torch.from_numpy(d).to(device)
    if mode == "head":
        return t[:1].expand(d.shape)                    # stride 0 along the batch
    if mode == "tensor":
        return t[:1, :1].expand(d.shape)                # stride 0, 0
    if mode == "transposed":
        return t.t().contiguous().t()                   # strides (1, B)
    return t


def _fp8_case(rng, q_lens, k_lens, hq, hkv, modes=("seq", "transposed", "head"), magnitude=True):
    """Structured-workload sequences (a chunk when Lq < Lk: the last Lq queries of the prompt), each (sequence, KV head)
    scaled by its own factor in [0.5, 3], quantised to FP8 with its own descale. Returns the CPU and GPU argument lists
    and the descale keyword arguments for both."""
    qs, ks, vs = [], [], []
    for lq, lk in zip(q_lens, k_lens):
        q, k, v = sp.workload.structured(lk, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                         seed=int(rng.integers(1 << 30)))
        f = rng.uniform(0.5, 3, hkv).astype(np.float32) if magnitude else np.ones(hkv, np.float32)
        qs.append(q[lk - lq:] * np.repeat(f, hq // hkv)[None, :, None])
        ks.append(k * f[None, :, None])
        vs.append(v * rng.uniform(0.5, 3, hkv).astype(np.float32)[None, :, None])
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    arrays, ds = [], {}
    for name, xs, cu, mode in (("q", qs, cu_q, modes[0]), ("k", ks, cu_k, modes[1]), ("v", vs, cu_k, modes[2])):
        x = np.concatenate(xs)
        d = _scales(rng, x, cu, hkv, "head" if mode == "head" else "tensor" if mode == "tensor" else "seq")
        arrays.append(_quantize(x, cu, d, hkv))
        ds[name] = (d, mode)
    cpu = arrays + [torch.from_numpy(cu_q), torch.from_numpy(cu_k)]
    gpu = [a.cuda() for a in cpu]
    kw = lambda dev: {f"{n}_descale": _descale_views(d, m, dev) for n, (d, m) in ds.items()}  # noqa: E731
    return cpu, gpu, kw("cpu"), kw("cuda"), max(q_lens), max(k_lens)


def _segments(index, batch, heads):
    return [list(index.segment(b, h, t))
            for b in range(batch) for h in range(heads) for t in range(int(index.tiles[b]))]


def _check_selection(ref, got, batch, heads):
    """The GPU index keeps the reference's blocks up to near-threshold ties (bf16 scores vs double on the CPU)."""
    assert got.num_segments == ref.num_segments and got.visible_blocks == ref.visible_blocks
    a, b = _segments(ref, batch, heads), _segments(got, batch, heads)
    seg_differ = sum(x != y for x, y in zip(a, b))
    blk_differ = sum(len(set(x) ^ set(y)) for x, y in zip(a, b))
    # FP8 adds q's rounding to bf16 (after the descale) to the 16-bit path's bf16 scoring: more near-threshold flips
    # than test_cuda.py's bound (H200 at 52a5222: 4 of 84 segments differed in the paged, sub-group case)
    assert seg_differ <= max(4, len(a) // 20), (seg_differ, len(a))
    assert blk_differ <= max(4, ref.kept_blocks // 50), (blk_differ, ref.kept_blocks)
    assert abs(got.density - ref.density) <= 0.01
    assert 0 < ref.density < 1  # the workload selects: a real test of the scores


def _check_means(ref, got):
    """Real-unit float32 means (x * descale): the GPU sums in float32, the CPU in double. V means only with the
    correction (none on either side without it)."""
    assert got.correction == ref.correction
    if not ref.correction:
        assert ref.host["v_mean"] is None and got.host["v_mean"] is None
    for name in ("k_mean", "v_mean") if ref.correction else ("k_mean",):
        r, g = ref.host[name], got.host[name]
        assert r.shape == g.shape
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


@pytest.mark.parametrize("q_lens,k_lens,hkv", [
    ([1, 129, 1763], [1, 129, 1763], 2),       # odd lengths, GQA 4
    ([11, 300, 1000], [1000, 4100, 5000], 1),  # chunks (Lq < Lk), GQA 8
])
@pytest.mark.parametrize("rule,alpha", [("row_max", 0.1), ("tile_energy", 0.1), ("probe_row_max", 0.3),
                                        ("probe_row_mass", 0.05)])
def test_fp8_index_on_gpu_matches_cpu(q_lens, k_lens, hkv, rule, alpha):
    rng = np.random.default_rng(len(q_lens) * 100 + len(rule))
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, q_lens, k_lens, 8, hkv)
    corr = rule in ("row_max", "probe_row_max")  # V means (descaled) with the correction only
    ref = sp.build_index(*cpu, mq, mk, alpha=alpha, rule=rule, correction=corr, **ds_cpu, dense_fraction=1.0)
    dev = sp.build_index(*gpu, mq, mk, alpha=alpha, rule=rule, correction=corr, **ds_gpu, dense_fraction=1.0)
    assert dev.on_device
    got = dev.to_host()
    _check_selection(ref, got, len(q_lens), hkv)
    _check_means(ref, got)


@pytest.mark.parametrize("modes", [("tensor", "head", "tensor"), ("seq", "seq", "seq")])
def test_fp8_index_on_gpu_broadcast_descales_paged_and_subgroups(modes):
    # per-tensor / per-head descales as stride-0 views, a paged cache of 16-token pages (the index stage takes any
    # page size), head sub-groups (the tile's descale is that of K/V head v / S)
    rng = np.random.default_rng(7)
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, [1000, 301], [3001, 3000], 8, 2, modes=modes)
    q8, k8, v8, cu_q, cu_k = cpu
    kc, vc, bt, used = to_paged(rng, k8.float().numpy(), v8.float().numpy(), cu_k.numpy(), 16)
    kc8, vc8 = (torch.from_numpy(x).clamp(-448, 448).to(F8) for x in (kc, vc))  # exact: the values are e4m3
    bt, used = torch.from_numpy(bt), torch.from_numpy(used)
    for S in (1, 2):
        kw = dict(alpha=0.1, head_subgroups=S, correction=S == 2, dense_fraction=1.0)  # V means: correction only
        ref = sp.build_index(*cpu, mq, mk, **kw, **ds_cpu)
        got = sp.build_index(q8.cuda(), kc8.cuda(), vc8.cuda(), cu_q.cuda(), None, mq, mk, block_table=bt.cuda(),
                             seqused_k=used.cuda(), **kw, **ds_gpu).to_host()
        _check_selection(ref, got, 2, 2 * S)
        _check_means(ref, got)


def test_fp8_index_q_without_16_byte_alignment_equals_aligned():
    # q at an odd byte offset: the scorer's byte-load path gives the same index as its 16-byte loads
    rng = np.random.default_rng(11)
    cpu, gpu, _, ds_gpu, mq, mk = _fp8_case(rng, [700, 129], [2000, 129], 8, 2)
    q8 = gpu[0]
    wide = torch.zeros(q8.shape[0], q8.shape[1], 129 + 16, dtype=torch.uint8, device="cuda")
    wide[:, :, 1:129] = q8.view(torch.uint8)
    q_odd = wide.view(F8)[:, :, 1:129]
    assert q_odd.data_ptr() % 16 == 1 and torch.equal(q_odd.view(torch.uint8), q8.view(torch.uint8))
    for rule in ("row_max", "tile_energy"):
        a = sp.build_index(*gpu, mq, mk, alpha=0.1, rule=rule, **ds_gpu, dense_fraction=1.0).to_host()
        b = sp.build_index(q_odd, *gpu[1:], mq, mk, alpha=0.1, rule=rule, **ds_gpu, dense_fraction=1.0).to_host()
        for name in ("segment_start", "segment_end", "block_ids", "k_mean", "v_mean"):
            np.testing.assert_array_equal(a.host[name], b.host[name])


def _paged_fp8_prompts(rng, lens, hq=8, hkv=2, ps=64):
    """Structured prompts of `lens` tokens in one paged FP8 cache (shuffled pages) with per-(sequence, KV head)
    descales: q, the cache, block table, the descale keyword arguments (CPU tensors)."""
    cpu, _, ds, _, _, _ = _fp8_case(rng, lens, lens, hq, hkv, modes=("seq", "seq", "seq"))
    q8, k8, v8, cu_q, cu_k = cpu
    kc, vc, bt, _ = to_paged(rng, k8.float().numpy(), v8.float().numpy(), cu_k.numpy(), ps)
    kc8, vc8 = (torch.from_numpy(x).clamp(-448, 448).to(F8) for x in (kc, vc))
    return q8, kc8, vc8, torch.from_numpy(bt), ds


def _step(q8, lens, c0, C):
    """The chunk [c0, min(L, c0 + C)) of every prompt: its queries, cu_seqlens_q, seqused_k, max lengths."""
    starts = np.concatenate([[0], np.cumsum(lens)])
    ends = [min(L, c0 + C) for L in lens]
    q = torch.cat([q8[starts[b] + c0:starts[b] + ends[b]] for b in range(len(lens))])
    cu = torch.tensor(np.concatenate([[0], np.cumsum([e - c0 for e in ends])]), dtype=torch.int32)
    return q, cu, torch.tensor(ends, dtype=torch.int32), max(e - c0 for e in ends), max(ends)


def test_fp8_chunked_mean_cache_on_gpu_equals_repooling():
    """Chunks of 1024 of two FP8 prompts over a paged cache: with the mean cache each step's index equals the one
    that re-pools the whole cache (bit for bit: the cached real-unit means are those the pooling computes), and
    the CPU reference's up to ties; afterwards every complete block's slot holds the reference's real-unit means."""
    rng = np.random.default_rng(5)
    lens, C, ps, hkv = [4000, 3100], 1024, 64, 2  # ps < block_size: one slot per page
    q8, kc8, vc8, bt, ds_cpu = _paged_fp8_prompts(rng, lens, hkv=hkv, ps=ps)
    kcg, vcg, btg = kc8.cuda(), vc8.cuda(), bt.cuda()
    ds_gpu = {n: d.cuda() for n, d in ds_cpu.items()}
    means = sp.mean_cache(kcg)
    for c0 in range(0, max(lens), C):
        q, cu, used, mq, mk = _step(q8, lens, c0, C)
        last = all(c0 + C >= L for L in lens)
        kw = dict(alpha=0.1, final_chunk=last, dense_fraction=1.0, head_subgroups=1)  # means per KV head
        gpu = (q.cuda(), kcg, vcg, cu.cuda(), None, mq, mk)
        cached = sp.build_index(*gpu, block_table=btg, seqused_k=used.cuda(), mean_cache=means, **kw, **ds_gpu)
        plain = sp.build_index(*gpu, block_table=btg, seqused_k=used.cuda(), **kw, **ds_gpu)
        a, b = cached.to_host(), plain.to_host()
        for name in ("segment_start", "segment_end", "block_ids", "k_mean", "v_mean"):
            np.testing.assert_array_equal(a.host[name], b.host[name])
        ref = sp.build_index(q, kc8, vc8, cu, None, mq, mk, block_table=bt, seqused_k=used, **kw, **ds_cpu)
        _check_means(ref, a)
        differ = sum(len(set(x) ^ set(y)) for x, y in zip(_segments(ref, 2, hkv), _segments(a, 2, hkv)))
        assert differ <= max(4, ref.kept_blocks // 100), differ
    # the slot of complete block J of prompt b (the page of its last key) holds the reference's means of that block
    # (the steps ran without the correction, so their indexes have no V means; the cache has them)
    full = sp.build_index(q8, kc8, vc8, torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32), None,
                          max(lens), max(lens), block_table=bt, seqused_k=torch.tensor(lens, dtype=torch.int32),
                          correction=True, **ds_cpu, dense_fraction=1.0, head_subgroups=1)
    km, vm, table = means[0].cpu().numpy(), means[1].cpu().numpy(), bt.numpy()
    for b, L in enumerate(lens):
        for J in range(L // 128):
            slot = table[b, (J * 128 + 127) // ps]  # pages smaller than a block: the slot is the page
            row = int(full.cu_blocks[b]) + J
            for got_c, ref_c in ((km, full.host["k_mean"]), (vm, full.host["v_mean"])):
                np.testing.assert_allclose(got_c[slot], ref_c[row], rtol=1e-5, atol=1e-5 * float(np.abs(ref_c).max()))


def test_fp8_index_errors_on_gpu():
    rng = np.random.default_rng(3)
    q8 = torch.zeros(40, 4, 64, dtype=F8, device="cuda")
    k8 = torch.zeros(40, 2, 64, dtype=F8, device="cuda")
    cu = torch.tensor([0, 20, 40], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="head dim 64"):
        sp.build_index(q8, k8, k8, cu, cu, 20, 20, dense_fraction=1.0)
    _, gpu, _, ds_gpu, mq, mk = _fp8_case(rng, [20, 30], [20, 30], 4, 2)
    with pytest.raises(ValueError, match=r"^k_descale: expected shape \[2, 2\]"):
        sp.build_index(*gpu, mq, mk, **dict(ds_gpu, k_descale=torch.ones(2, 3, device="cuda")), dense_fraction=1.0)
    with pytest.raises(ValueError, match=r"^q_descale: expected shape \[2, 2\]"):
        sp.build_index(*gpu, mq, mk, **dict(ds_gpu, q_descale=torch.ones(1, 2, device="cuda")), dense_fraction=1.0)
    # bf16 / fp16 keep both head dims
    qb = torch.zeros(40, 4, 64, dtype=torch.bfloat16, device="cuda")
    kb = torch.zeros(40, 2, 64, dtype=torch.bfloat16, device="cuda")
    assert sp.build_index(qb, kb, kb, cu, cu, 20, 20, dense_fraction=1.0).on_device


# --- the block-sparse FP8 attention kernel ---------------------------------------------------------------------

def _e4m3_means(index, k_descale, v_descale):
    """The host index's real-unit means replaced by the values the sparse kernel's correction uses: e4m3 in raw units
    of the call's descales (round to nearest even, saturated), times the descale; 0 where the descale is 0."""
    assert not index.on_device and not index._cache
    cu = np.asarray(index.host["cu_blocks"])
    seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    S = index.num_subgroups
    for name, ds in (("k_mean", k_descale), ("v_mean", v_descale)):
        a = index.host[name]
        if a is None:  # no V means without the correction
            continue
        ds = ds.contiguous().numpy()
        d = ds[seq][:, np.repeat(np.arange(ds.shape[1]), S), None].astype(np.float32)
        raw = torch.from_numpy(np.divide(a, d, out=np.zeros_like(a), where=d != 0)).clamp(-448, 448).to(F8)
        a[...] = raw.float().numpy() * d
    return index


@pytest.mark.parametrize("correction", [False, True])
def test_fp8_sparse_attention_on_gpu_matches_cpu(correction):
    rng = np.random.default_rng(21)
    # the GPU index (downloaded) on the CPU reference, with the correction's e4m3-rounded means: the same selection
    # and virtual keys, so only the kernel's arithmetic (P in e4m3) differs
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, [1, 129, 1763], [1, 1000, 1763], 8, 2)
    dev = sp.build_index(*gpu, mq, mk, alpha=0.1, correction=correction, **ds_gpu, dense_fraction=1.0)
    got = sp.sparse_attention(*gpu[:3], dev, *gpu[3:], mq, mk, **ds_gpu)
    host = dev.to_host()
    if correction:
        _e4m3_means(host, ds_cpu["k_descale"], ds_cpu["v_descale"])
    want = sp.sparse_attention(*cpu[:3], host, *cpu[3:], mq, mk, reuse_index=True, **ds_cpu)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    v_deq = cpu[2].float().abs().max().item() * ds_cpu["v_descale"].max().item()
    atol = 2 ** -4 * v_deq + 2 ** -8 * want.float().abs().max().item() + 1e-3  # P in e4m3, as for dense FP8
    assert (got.float().cpu() - want.float()).abs().max().item() <= atol


def test_fp8_chunked_prefill_mean_cache_on_gpu():
    # the sparse kernel over the cached means (the correction's e4m3 copies derived from them with this call's
    # descales) equals the steps that re-pool, bit for bit
    rng = np.random.default_rng(9)
    lens, C = [3000, 2100], 1024
    q8, kc8, vc8, bt, ds_cpu = _paged_fp8_prompts(rng, lens)
    kcg, vcg, btg = kc8.cuda(), vc8.cuda(), bt.cuda()
    ds_gpu = {n: d.cuda() for n, d in ds_cpu.items()}
    means = sp.mean_cache(kcg)
    for c0 in range(0, max(lens), C):
        q, cu, used, mq, mk = _step(q8, lens, c0, C)
        step = (q.cuda(), kcg, vcg, cu.cuda(), btg, used.cuda(), mq, mk)
        last = all(c0 + C >= L for L in lens)
        for corr in (False, True):
            got = sp.chunked_prefill(*step, final_chunk=last, mean_cache=means, alpha=0.1, correction=corr,
                                     **ds_gpu, dense_fraction=1.0)
            want = sp.chunked_prefill(*step, final_chunk=last, alpha=0.1, correction=corr, **ds_gpu, dense_fraction=1.0)
            torch.cuda.synchronize()
            assert not torch.isnan(got).any() and torch.equal(got, want)


def _poisoned(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def _p8_atol(want, cpu, ds_cpu):
    """P in e4m3 (relative rounding <= 2^-4 per weight, the largest weight of a step exact): 2^-4 max|v| (dequantised),
    plus bf16's rounding of the output (as for dense FP8, test_fp8.py)."""
    v_deq = cpu[2].float().abs().max().item() * ds_cpu["v_descale"].max().item()
    return 2 ** -4 * v_deq + 2 ** -8 * want.float().abs().max().item() + 1e-3


@pytest.mark.parametrize("q_lens, k_lens, hq, hkv", [
    ([1763, 129], [1763, 129], 8, 2),       # odd lengths, GQA 4, two sequences
    ([11, 300, 1], [1000, 4100, 1], 8, 1),  # chunk shapes (the split-KV plan), GQA 8, a 1-token sequence
    ([2000], [2000], 4, 4),                 # GQA 1
])
@pytest.mark.parametrize("correction", [False, True])
def test_fp8_sparse_over_a_cpu_index_matches_the_cpu_reference(q_lens, k_lens, hq, hkv, correction):
    # an index the CPU reference built (its float32 means go to the kernel through prepare_index_view, as e4m3)
    rng = np.random.default_rng()
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, q_lens, k_lens, hq, hkv)
    index = sp.build_index(*cpu, mq, mk, correction=correction, alpha=0.2, **ds_cpu, dense_fraction=1.0)
    assert 0 < index.density < 1
    _e4m3_means(index, ds_cpu["k_descale"], ds_cpu["v_descale"])
    want, want_lse = sp.sparse_attention(*cpu[:3], index, *cpu[3:], mq, mk, return_lse=True, **ds_cpu)
    out = _poisoned(cpu[0].shape)
    got, lse = sp.sparse_attention(*gpu[:3], index, *gpu[3:], mq, mk, out=out, return_lse=True, reuse_index=True,
                                   **ds_gpu)
    torch.cuda.synchronize()
    assert got is out and got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    assert (got.float().cpu() - want.float()).abs().max().item() <= _p8_atol(want, cpu, ds_cpu)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse.cpu()))
    # The LSE carries S = Q K^T, which FP8 wgmma accumulates with a reduced-precision adder: ~1e-3 relative (H200 at
    # 52a5222: at most 0.128 at an LSE of 145, 8.8e-4 relative, over these six cases)
    err = (lse.cpu()[fin] - want_lse[fin]).abs()
    assert (err <= 2e-2 + 2e-3 * want_lse[fin].abs()).all(), err.max().item()


def test_fp8_sparse_full_list_equals_the_dense_fp8_kernel():
    # alpha 0 keeps every visible block: the sparse kernel (PackGQA tiles, CSR steps) against DenseFp8Fwd (one head
    # per tile), both on the GPU: the same per-row math; two bf16 ulps of the output's scale for the tile shapes'
    # accumulation order (an element's own ulp is too tight where its terms cancel: H200 at 4e90c8d, 1 element of
    # 2.25M off by 0.0117 at 0.084, against a fixed 1e-2)
    rng = np.random.default_rng()
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, [1500, 700], [1500, 900], 8, 2)
    dense = sp.attention(*gpu, mq, mk, **ds_gpu)
    index = sp.build_index(*gpu, mq, mk, alpha=0.0, correction=False, **ds_gpu)
    got = sp.sparse_attention(*gpu[:3], index, *gpu[3:], mq, mk, out=_poisoned(cpu[0].shape), **ds_gpu)
    assert index.density == 1
    scale = dense.float().abs().max().item()
    torch.testing.assert_close(got.float(), dense.float(), atol=2 ** -7 * scale, rtol=2 ** -7)


@pytest.mark.parametrize("page_size", [64, 128])
def test_fp8_sparse_paged_equals_contiguous(page_size):
    rng = np.random.default_rng()
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, [300, 1100], [1500, 2100], 8, 2)
    index = _e4m3_means(sp.build_index(*cpu, mq, mk, alpha=0.2, **ds_cpu,
                                       dense_fraction=1.0), ds_cpu["k_descale"], ds_cpu["v_descale"])
    contiguous = sp.sparse_attention(*gpu[:3], index, *gpu[3:], mq, mk, reuse_index=True, **ds_gpu)
    # the e4m3 codes paged as floats; the garbage rows wrap to arbitrary codes (NaN bit patterns included)
    k_codes, v_codes = (x.view(torch.uint8).numpy().astype(np.float32) for x in cpu[1:3])
    kc, vc, bt, used = to_paged(rng, k_codes, v_codes, cpu[4].numpy(), page_size)
    kc8, vc8 = (torch.from_numpy(np.mod(np.rint(x), 256).astype(np.uint8)).view(F8) for x in (kc, vc))
    paged_index = sp.build_index(cpu[0], kc8, vc8, cpu[3], None, mq, mk, alpha=0.2, block_table=torch.from_numpy(bt),
                                 seqused_k=torch.from_numpy(used), **ds_cpu, dense_fraction=1.0)
    for name in ("segment_start", "segment_end", "block_ids"):  # the same selection, paged or not
        np.testing.assert_array_equal(paged_index.host[name], index.host[name])
    _e4m3_means(paged_index, ds_cpu["k_descale"], ds_cpu["v_descale"])
    paged = sp.sparse_attention(gpu[0], kc8.cuda(), vc8.cuda(), paged_index, gpu[3], None, mq, mk,
                                block_table=torch.from_numpy(bt).cuda(), seqused_k=torch.from_numpy(used).cuda(),
                                reuse_index=True, out=_poisoned(cpu[0].shape), **ds_gpu)
    assert not torch.isnan(paged).any() and torch.equal(paged, contiguous)


def test_fp8_sparse_reusing_a_bf16_device_index():
    # A device index built on bf16 arrays applies to FP8 arrays of the same problem (reuse_index=True) without the
    # correction; with it, its bf16 means cannot serve the FP8 kernel: an error naming the index.
    rng = np.random.default_rng()
    cpu, gpu, ds_cpu, ds_gpu, mq, mk = _fp8_case(rng, [600], [600], 8, 2, modes=("seq", "seq", "seq"))
    deq = [x.float() * d[0].repeat_interleave(x.shape[1] // 2).view(1, -1, 1)
           for x, d in zip(gpu[:3], (ds_gpu["q_descale"], ds_gpu["k_descale"], ds_gpu["v_descale"]))]
    bf = [x.to(torch.bfloat16) for x in deq]
    for correction in (False, True):
        index = sp.build_index(*bf, *gpu[3:], mq, mk, alpha=0.2, correction=correction, dense_fraction=1.0)
        call = lambda: sp.sparse_attention(*gpu[:3], index, *gpu[3:], mq, mk, reuse_index=True, **ds_gpu)  # noqa: E731
        if correction:
            with pytest.raises(ValueError, match="index.*bfloat16.*float8_e4m3fn"):
                call()
        else:
            got, want = call().float(), sp.sparse_attention(*bf, index, *gpu[3:], mq, mk).float()
            assert not torch.isnan(got).any()
            assert (got - want).abs().max().item() <= _p8_atol(want, cpu, ds_cpu)
