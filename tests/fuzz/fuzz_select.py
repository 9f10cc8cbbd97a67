"""Selective data and the selection oracle of the fuzzer (tests/fuzz/test_fuzz.py).

Gaussian q, k keep every block at alpha > 0 (no block stands out), so the selection, the pruning, the mean correction
and the rules go unexercised; `selective_qkv` draws data where they matter: per (sequence, KV head, key block) a
random direction u_J with a random strength in the keys, and per span of 128 queries 1-2 target blocks among those the
span sees, whose directions the span's queries (every head of the group, each with its own weights) carry. Target
blocks score high, the others near zero, with a continuum of strengths in between (some blocks near the threshold).

`select_bands` is the contract's selection (docs/semantics.md, "Selection"; every rule, sink, window band, last_n,
final_chunk, head sub-groups, union) in float64 numpy, one segment at a time, with a band: per segment the blocks
that must be listed (always kept, or above the threshold by more than `delta` in the log domain) and those that may be
(within `delta` of it). `check_index` holds an index to it; `sparse_reference` is the block-sparse attention (with the
mean correction) over a given index, in float64.
"""

import numpy as np

TILE = 128
SPAN = 128            # queries sharing their target blocks
PROBE_STRIDE = 8      # kProbeStride: probe rows are queries i % 8 == 7 and the last one


def selective_qkv(rng, q_lens, k_lens, hq, hkv, D, block):
    """float32 (q, k, v) of a varlen batch (query i of sequence b is key position i + Lk - Lq) with selective keys."""
    g = hq // hkv
    qs, ks, vs = [], [], []
    for lq, lk in zip(q_lens, k_lens):
        lq, lk = int(lq), int(lk)
        nb = max(1, -(-lk // block))
        u = rng.standard_normal((nb, hkv, D))                   # |u| ~ sqrt(D): a target's logit ~ w * amp * sqrt(D)
        amp = rng.uniform(0.4, 1.2, (nb, hkv))
        k = rng.standard_normal((lk, hkv, D)) + (amp[..., None] * u)[np.arange(lk) // block]
        q = 0.5 * rng.standard_normal((lq, hq, D))
        for c0 in range(0, lq, SPAN):
            seen = (c0 + lk - lq) // block + 1                 # blocks the span's first query sees
            if seen <= 0:
                continue
            for h in range(hkv):
                tgt = rng.choice(min(seen, nb), size=min(int(rng.integers(1, 3)), seen, nb), replace=False)
                w = rng.uniform(0.8, 1.5, (len(tgt), g))
                q[c0:c0 + SPAN, h * g:(h + 1) * g] += np.einsum("tg,td->gd", w, u[tgt, h])[None]
        qs.append(q)
        ks.append(k)
        vs.append(rng.standard_normal((lk, hkv, D)))
    cat = lambda xs, h: (np.concatenate(xs) if xs else np.zeros((0, h, D))).astype(np.float32)  # noqa: E731
    return cat(qs, hq), cat(ks, hkv), cat(vs, hkv)


def _pool(x, lo, hi, block):
    """float64 means [nb, H, D] of x[lo:hi] per block (a tail block averages its valid keys)."""
    n = hi - lo
    nb = -(-n // block)
    return np.stack([x[lo + J * block:lo + min(n, (J + 1) * block)].mean(0) for J in range(nb)]) if nb else \
        np.zeros((0,) + x.shape[1:])


def _mm(a, b):
    """[..., D] @ [D, N] as one 2-D product (numpy loops a BLAS call per leading index of a 3-D operand)."""
    return (np.ascontiguousarray(a).reshape(-1, a.shape[-1]) @ np.ascontiguousarray(b)).reshape(a.shape[:-1] + (-1,))


def _segments(q_lens, hkv, S, gs):
    """(b, virtual head, tile, tiles) of every segment in contract order."""
    for b, lq in enumerate(q_lens):
        tiles = -(-int(lq) * gs // TILE)
        for v in range(hkv * S):
            for t in range(tiles):
                yield b, v, t, tiles


def _row_closeness(w, mass=False):
    """C_J = max over rows (that see J) of w_rJ - max_J' w_rJ' (mass: - log sum_J' exp(w_rJ'), the row's whole mass;
    -inf where no row sees J)."""
    m = w.max(1, keepdims=True)
    ok = np.isfinite(m[:, 0])
    if not ok.any():
        return np.full(w.shape[1], -np.inf)
    ref = m[ok]
    if mass:
        ref = ref + np.log(np.exp(w[ok] - ref).sum(1, keepdims=True))
    return (w[ok] - ref).max(0)


def _group_scores(q, k, q_lens, k_lens, means, B, hkv, probe_rule):
    """Per (sequence, KV head): scale * q . kmean_J [Lq, g, nb] of the group's query heads and, for the probe rules, the
    exact block log-masses [Lq, g, nb] of the probe queries (-inf elsewhere and where a query sees none of the
    block). One matrix product per (sequence, KV head): many small ones are slow."""
    hq, D = q.shape[1], q.shape[2]
    g, scale = hq // hkv, 1.0 / np.sqrt(D)
    cq, ck = np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(k_lens)])
    out = {}
    for b in range(len(q_lens)):
        lq, lk = int(q_lens[b]), int(k_lens[b])
        nb = -(-lk // B)
        diag = np.arange(lq) + lk - lq
        sees = (diag[:, None] >= 0) & (np.arange(nb)[None, :] * B <= diag[:, None])       # [Lq, nb]
        for h in range(hkv):
            qb = q[int(cq[b]):int(cq[b + 1]), h * g:(h + 1) * g]                              # [Lq, g, D]
            s = np.where(sees[:, None, :], scale * _mm(qb, means[b][:, h].T), -np.inf)
            w = None
            if probe_rule:
                w = np.full((lq, g, nb), -np.inf)
                pi = np.nonzero((np.arange(lq) % PROBE_STRIDE == PROBE_STRIDE - 1) | (np.arange(lq) == lq - 1))[0]
                if len(pi) and lk:
                    lg = scale * _mm(qb[pi], k[int(ck[b]):int(ck[b + 1]), h].T)                  # [P, g, lk]
                    lg = np.where((np.arange(lk)[None, :] <= diag[pi][:, None])[:, None, :], lg, -np.inf)
                    for J in range(nb):
                        blk = lg[..., J * B:(J + 1) * B]
                        top = blk.max(-1)
                        fin = np.isfinite(top)
                        wJ = np.full(top.shape, -np.inf)
                        wJ[fin] = top[fin] + np.log(np.exp(blk[fin] - top[fin][:, None]).sum(-1))
                        w[pi, :, J] = wJ
            out[b, h] = (s, w)
    return out


def _bands(seg, q_lens, k_lens, scores, qnorm, knorm, gs, S, sel, delta):
    """select_bands' sets of one segment (b, virtual head v, tile t)."""
    b, v, t, tiles = seg
    B = sel["block_size"]
    alpha, rule = sel["alpha"], sel["rule"]
    log_alpha = np.log(alpha) if alpha > 0 else -np.inf
    last_n = sel["last_n"] if sel["final_chunk"] else 0
    lq, lk, kvh = int(q_lens[b]), int(k_lens[b]), v // S
    nb = -(-lk // B)
    r = np.arange(t * TILE, min(t * TILE + TILE, lq * gs))
    pos, jh = r // gs, (v % S) * gs + r % gs                          # position, head within the KV head's group
    diag = pos + lk - lq
    s_all, w_all = scores[b, kvh]
    s = s_all[pos, jh]                                                # [rows, nb]
    visible = np.isfinite(s).any(0)
    if rule == "tile_energy":
        e = np.exp(s - s.max(initial=-np.inf)).sum(0) if visible.any() else np.zeros(nb)
        crit = np.log(e) - np.log(alpha * e.max()) if alpha > 0 else np.full(nb, np.inf)
    else:
        crit = _row_closeness(s) - log_alpha
        if rule in ("probe_row_max", "probe_row_mass"):
            mean_alpha = sel["mean_alpha"]  # the pooled-means row-max term
            log_mean_alpha = np.log(mean_alpha) if mean_alpha > 0 else -np.inf
            crit = np.maximum(_row_closeness(w_all[pos, jh], rule == "probe_row_mass") - log_alpha,
                              _row_closeness(s) - log_mean_alpha)
    d = delta(qnorm[b][pos, kvh * gs * S + jh].max(initial=0.0) * knorm[b][:, kvh].max(initial=0.0) /
              np.sqrt(sel["head_dim"]))
    lo = np.arange(nb) * B
    hi = np.minimum(lo + B, lk) - 1
    dmin = diag.min() if len(diag) else -1
    forced = (t >= tiles - last_n) | (lo < sel["sink"]) | (hi > dmin)
    if sel["window"] > 0:
        dg = diag[diag >= 0][:, None]
        forced |= ((lo[None, :] <= dg) & (hi[None, :] >= dg - sel["window"] + 1)).any(0)
    ids = lambda m: set(np.nonzero(visible & (forced | m))[0].tolist())  # noqa: E731
    return [ids(crit > d), ids(crit >= -d), ids(crit >= 0), set(np.nonzero(visible)[0].tolist())]


def select_bands(q, k, q_lens, k_lens, hq, hkv, sel, delta):
    """Per segment [must, may, exact, visible] block-id sets: must = always kept, or past the threshold by more than
    delta(bound of the tile's |s_rJ|) in the log domain; may = must plus the blocks within it; exact = the
    float64 decision (in union mode all three are the unions over the tiles). q [total_q, Hq, D]
    and k [total_k, Hkv, D] float64 contiguous (k: each sequence's Lk keys), causal, bottom-right."""
    B, S = sel["block_size"], sel["head_subgroups"] or hq // hkv  # 0: one selection per query head
    gs = hq // hkv // S
    cq, ck = np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(k_lens)])
    means = [_pool(k, int(ck[b]), int(ck[b + 1]), B) for b in range(len(k_lens))]
    qnorm = [np.linalg.norm(q[int(cq[b]):int(cq[b + 1])], axis=-1) for b in range(len(q_lens))]   # [Lq, Hq]
    knorm = [np.linalg.norm(m, axis=-1) for m in means]                                           # [nb, Hkv]
    sel = dict(sel, head_dim=q.shape[-1])
    out = []
    with np.errstate(divide="ignore", invalid="ignore"):  # -inf scores of blocks a row does not see
        scores = _group_scores(q, k, q_lens, k_lens, means, B, hkv, sel["rule"] in ("probe_row_max", "probe_row_mass"))
        for seg in _segments(q_lens, hkv, S, gs):
            out.append(_bands(seg, q_lens, k_lens, scores, qnorm, knorm, gs, S, sel, delta))
    if sel["union"]:  # one list per (sequence, virtual head): the union of its tiles' lists
        i = 0
        for b, lq in enumerate(q_lens):
            tiles = -(-int(lq) * gs // TILE)
            for v in range(hkv * S):
                seg = out[i:i + tiles]
                lists = [set().union(*(x[n] for x in seg)) for n in range(3)]
                for x in seg:
                    x[:3] = lists
                i += tiles
    return out


def _keeps_all(kept, visible, dense_fraction):
    """The dense rule (sparse.h keeps_all): the fraction a float32, the comparison in double."""
    f = float(np.float32(dense_fraction))
    return f < 1.0 and visible > 0 and kept >= f * visible


def check_index(index, bands, c, dense_fraction=1.0):
    """Every segment of the host `index` lists its `must` blocks and nothing outside `may`, ascending and distinct;
    visible_blocks and kept_blocks (hence density) follow the contract. With the dense rule (dense_fraction < 1) an
    index whose `must` blocks already reach the fraction must list every visible block, one whose `may` blocks cannot
    must not, and between the two either is right. Returns the number of listed blocks that differ from the float64
    decision (near-threshold flips)."""
    h = index.host
    starts, ends, ids = h["segment_start"], h["segment_end"], h["block_ids"]
    assert len(starts) == len(bands), (len(starts), len(bands), c)
    vis = sum(len(b[3]) for b in bands)
    low = _keeps_all(sum(len(b[0] & b[3]) for b in bands), vis, dense_fraction)
    high = _keeps_all(sum(len(b[1] & b[3]) for b in bands), vis, dense_fraction)
    full = all(set(ids[int(starts[s]):int(ends[s])].tolist()) == b[3] for s, b in enumerate(bands))
    if low or (high and full):  # the rule fired: every segment its visible blocks
        assert full, ("dense rule", dense_fraction, c)
        assert (index.visible_blocks, index.kept_blocks) == (vis, vis), (index.visible_blocks, index.kept_blocks, c)
        return 0
    flipped = kept = vis = 0
    for s, (must, may, exact, visible) in enumerate(bands):
        listed = ids[int(starts[s]):int(ends[s])].tolist()
        assert listed == sorted(set(listed)), (s, listed, c)
        got = set(listed)
        assert must <= got, ("must", s, sorted(must - got), c)
        assert got <= may, ("may", s, sorted(got - may), c)
        flipped += len(got ^ exact)
        kept += len(got & visible)
        vis += len(visible)
    assert (index.visible_blocks, index.kept_blocks) == (vis, kept), (index.visible_blocks, vis, index.kept_blocks,
                                                                      kept, c)
    return flipped


def check_means(index, k, v, k_lens, rtol):
    """The index's pooled means [total_blocks, Hkv * S, D] against float64 ones (row v: K/V head v // S); V means
    only with the correction (None without it)."""
    S, B = index.num_subgroups, index.block_size
    ck = np.concatenate([[0], np.cumsum(k_lens)])
    if not index.correction:
        assert index.host["v_mean"] is None
    for name, x in (("k_mean", k), ("v_mean", v)) if index.correction else (("k_mean", k),):
        want = [_pool(x, int(ck[b]), int(ck[b + 1]), B) for b in range(len(k_lens))]
        want = np.repeat(np.concatenate(want), S, axis=1) if want else np.zeros((0,) + x.shape[1:])
        got = index.host[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max(initial=1.0)),
                                   err_msg=name)


def sparse_reference(q, k, v, q_lens, k_lens, hq, hkv, index, correction):
    """float64 (out [total_q, Hq, D], lse [Hq, total_q]) of attention over the blocks `index` lists (token-level causal
    mask), plus, with correction, one virtual key (kmean_J, logit + log|B_J|, value vmean_J) per unlisted block fully
    visible to the whole tile. Pooled means: the index's own (float32 on the CPU, rounded on CUDA). The segments'
    lists become masks over a (sequence, KV head)'s [Lq, g, Lk] logits: two matrix products per (sequence, KV head)."""
    h = index.host
    B, S = index.block_size, index.num_subgroups
    g = hq // hkv
    gs = g // S
    scale = 1.0 / np.sqrt(q.shape[-1])
    cq, ck = np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(k_lens)])
    cb = h["cu_blocks"]
    km_all = h["k_mean"].astype(np.float64)
    vm_all = h["v_mean"].astype(np.float64) if correction else None  # None without the correction
    out = np.zeros(q.shape)
    lse = np.full((hq, q.shape[0]), -np.inf)
    listed, corr = {}, {}  # (b, kvh) -> [Lq, g, nb] bool: listed blocks, corrected blocks of each row
    for s, (b, vh, t, tiles) in enumerate(_segments(q_lens, hkv, S, gs)):
        lq, lk, kvh = int(q_lens[b]), int(k_lens[b]), vh // S
        nb = -(-lk // B)
        if (b, kvh) not in listed:
            listed[b, kvh], corr[b, kvh] = np.zeros((lq, g, nb), bool), np.zeros((lq, g, nb), bool)
        r = np.arange(t * TILE, min(t * TILE + TILE, lq * gs))
        pos, jh = r // gs, (vh % S) * gs + r % gs
        seg = np.zeros(nb, bool)
        seg[h["block_ids"][int(h["segment_start"][s]):int(h["segment_end"][s])]] = True
        listed[b, kvh][pos, jh] = seg
        if correction:  # unlisted blocks every row of the tile sees whole
            hi = np.minimum(np.arange(nb) * B + B, lk)
            corr[b, kvh][pos, jh] = ~seg & (hi - 1 <= (pos.min() + lk - lq if len(pos) else -1))
    for (b, kvh), lst in listed.items():
        lq, lk = int(q_lens[b]), int(k_lens[b])
        nb = lst.shape[-1]
        rows = slice(int(cq[b]), int(cq[b + 1]))
        qb = q[rows, kvh * g:(kvh + 1) * g]                                            # [Lq, g, D]
        kk, vv = (np.ascontiguousarray(x[int(ck[b]):int(ck[b + 1]), kvh]) for x in (k, v))
        j = np.arange(lk)
        lg = _mm(qb, kk.T)  # [Lq, g, Lk]; large: the element-wise steps below work in place
        lg *= scale
        hide = lst[:, :, j // B]
        np.logical_not(hide, out=hide)
        hide |= (j[None, :] > (np.arange(lq) + lk - lq)[:, None])[:, None, :]
        lg[hide] = -np.inf
        sizes = np.minimum(np.arange(nb) * B + B, lk) - np.arange(nb) * B
        # the means of K/V head kvh (rows kvh * S .. of the virtual heads all hold them)
        km = km_all[cb[b]:cb[b] + nb, kvh * S]
        vm = vm_all[cb[b]:cb[b] + nb, kvh * S] if correction else np.zeros((nb, vv.shape[-1]))  # pc is 0 then
        lc = np.where(corr[b, kvh], scale * _mm(qb, km.T) + np.log(sizes), -np.inf)
        m = np.maximum(lg.max(-1, initial=-np.inf), lc.max(-1, initial=-np.inf))       # [Lq, g]
        ok = np.isfinite(m)
        ms = np.where(ok, m, 0.0)[..., None]
        lg -= ms
        pk, pc = np.exp(lg, out=lg), np.exp(lc - ms)
        den = pk.sum(-1) + pc.sum(-1)
        o = (pk.reshape(-1, lk) @ vv + pc.reshape(-1, nb) @ vm).reshape(lq, g, -1)
        out[rows, kvh * g:(kvh + 1) * g] = np.where(ok[..., None], o / np.where(ok, den, 1.0)[..., None], 0.0)
        lse[kvh * g:(kvh + 1) * g, rows] = np.where(ok, np.log(np.where(ok, den, 1.0)) + ms[..., 0], -np.inf).T
    return out, lse
