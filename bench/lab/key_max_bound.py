"""How much of the key_max scorer's work its bound leaves (docs/design/selection.md, "The per-key estimator"),
emulated in float32 torch on the CPU on the topic workload: per query head, the fraction of visible (row group,
block) pairs that are candidates against the starting bound b_r (what the scorer loads; CTA = 128 rows), against a
running bound over the pooled passes' chunks from the diagonal down (a single pooled pass), against the running
row maximum (what a warpgroup of 64 rows scores), and kept.
A block is a candidate for row r iff pooled_rJ + |Q'_r| radius_J >= m_r + log2(alpha), radius_J = max_j |K'_j|.
A tighter bound, for comparison (--split c): the first c coordinates of Q' against each block's per-coordinate key
range (a box), the rest against the radius of the keys' other coordinates.
--bound-chunks k,..: candidates against b_r taken over chunk 0 and the tile's last k chunks of 32 blocks only (pass 1
shortened: a lower bound, so a superset of the candidates).
--perp c: the perp column (emulate.py's perp): each key's term plus c |q_perp| |x_perp_j|, bounded apart from the
rank-r part: |Q'_r| radius_J + c |q_perp_r| max_j |x_perp_j| (the two Cauchy-Schwarz terms summed, not one over both).
--basis query: key_max on the queries' basis (emulate.py's basis 'query') instead of the keys' residuals'.
--sinkref n: the library's start since the sink reference (docs/design/key_max_spec.md step 4): b_r also takes the
row's exact maximum over the first n keys (the sink blocks' keys; the library's default sink 256 is n = 256).
--groups g,..: the candidates from pass 1's scores kept per (group of 128 / g rows, block) as one number, the group's
largest pooled + |Q'_r| radius_J (rounded up to fp16), against the group's smallest b_r: a superset of the candidates
without pass 2's GEMM (what the list would hold if pass 1 wrote these into shared memory).
Usage: python3 bench/lab/key_max_bound.py [L] [alpha] [heads] [--split c] [--rank r] [--bound-chunks k,..] [--perp c]
       [--basis query] [--groups g,..] [--sinkref n]
(default 16384 0.03 0, rank 16; seconds at 16K)"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: _common, accuracy
from _common import topic  # noqa: E402
from accuracy import emulate  # noqa: E402

B, RANK, HQ, HKV = 128, 16, 8, 2


def pop_flag(argv, name, convert, default):
    """Removes `name value` from argv and returns convert(value), or default when absent."""
    if name not in argv:
        return default
    i = argv.index(name)
    value = convert(argv[i + 1])
    del argv[i:i + 2]
    return value


def main():
    argv = sys.argv[1:]
    basis = pop_flag(argv, "--basis", str, "lib")
    perp = pop_flag(argv, "--perp", float, 0.0)
    split = pop_flag(argv, "--split", int, 0)
    # pass 1 over chunk 0 and the tile's last k chunks only (a lower bound b_r)
    bound_chunks = pop_flag(argv, "--bound-chunks", lambda v: [int(x) for x in v.split(",")], [])
    groups = pop_flag(argv, "--groups", lambda v: [int(x) for x in v.split(",")], [])
    rank = pop_flag(argv, "--rank", int, RANK)
    sink_keys = pop_flag(argv, "--sinkref", int, 0)
    L = int(argv[0]) if len(argv) > 0 else 16384
    alpha = float(argv[1]) if len(argv) > 1 else 0.03
    heads = [int(x) for x in argv[2].split(",")] if len(argv) > 2 else [0]
    q, k, _ = topic(L, hq=HQ, hkv=HKV, dev="cpu", dtype=torch.bfloat16)
    q, k = q.float(), k.float()
    scale = math.log2(math.e) / math.sqrt(q.shape[-1])
    nb, la, inf = (L + B - 1) // B, math.log2(alpha), torch.tensor(-float("inf"))
    # [Hkv, D, r]: the library's basis, or the queries'
    P = (emulate.query_basis(q, HKV, rank, B) if basis == "query" else emulate.key_basis(k, rank, B)).float()
    kbar = emulate.library_means(k, B).float()  # [nb, Hkv, D]
    pos = torch.arange(L)
    last = pos // B
    vis = torch.arange(nb)[None, :] <= last[:, None]
    whole = (torch.arange(nb)[None, :] + 1) * B - 1 <= pos[:, None]
    for hq in heads:
        h = hq // (HQ // HKV)
        km = kbar[:, h]
        x = k[:, h] - km.repeat_interleave(B, 0)[:L]
        kp = x @ P[h]                                             # K' [L, r]
        qp = (q[:, hq] @ P[h]) * scale                            # Q' [L, r], log2 units
        x_perp = (x - kp @ P[h].T).norm(dim=1)                    # |x_perp_j|
        q_perp = (q[:, hq] * scale - qp @ P[h].T).norm(dim=1)     # |q_perp_r|, log2 units
        pooled = (q[:, hq] @ km.T) * scale                        # [L, nb]
        kb = kp.reshape(nb, B, -1)
        bound = pooled + qp[:, split:].norm(dim=1)[:, None] * kb[:, :, split:].norm(dim=2).amax(1)[None, :]
        bound = bound + perp * q_perp[:, None] * x_perp.reshape(nb, B).amax(1)[None, :]
        for c in range(split):  # the box on the first coordinates: q_c * (the block's max or min of k_c)
            bound = bound + torch.maximum(qp[:, c:c + 1] * kb[:, :, c].amax(1)[None, :],
                                          qp[:, c:c + 1] * kb[:, :, c].amin(1)[None, :])
        res = torch.full((L, nb), -float("inf"))
        for J in range(nb):                                       # exact residual maxima over the visible keys
            s = qp @ kp[J * B:(J + 1) * B].T + perp * q_perp[:, None] * x_perp[None, J * B:(J + 1) * B]
            res[:, J] = torch.where(torch.arange(J * B, J * B + B)[None, :] <= pos[:, None], s, inf).amax(1)
        m0 = torch.where(whole, pooled, inf).amax(1)
        if sink_keys > 0:  # the sink keys' exact maximum (the keys each row sees)
            ex = (q[:, hq] @ k[:sink_keys, h].T) * scale
            m0 = torch.maximum(m0, torch.where(torch.arange(ex.shape[1])[None, :] <= pos[:, None], ex, inf).amax(1))
        static = vis & (bound >= (m0 + la)[:, None])
        partial = {}
        tile_last = last[torch.clamp((pos // 128 + 1) * 128 - 1, max=L - 1)] // 32   # the tile's last chunk
        chunk = torch.arange(nb) // 32
        for kc in bound_chunks:  # b_r over chunk 0 and the tile's last kc chunks: a lower bound, a superset
            use = whole & ((chunk[None, :] == 0) | (chunk[None, :] > (tile_last - kc)[:, None]))
            mk = torch.where(use, pooled, inf).amax(1)
            partial[kc] = vis & (bound >= (mk + la)[:, None])
        grouped = {}
        for g in groups:  # per (tile, group of 128 / g rows, block): the group's largest bound vs its smallest b_r
            rows = 128 // g
            Lp = (L + rows - 1) // rows * rows
            bv = torch.full((Lp, nb), -float("inf"))
            bv[:L] = torch.where(vis, bound, inf).to(torch.float16).float()
            exact = torch.full((Lp, nb), -float("inf"))
            exact[:L] = torch.where(vis, bound, inf)
            bv = torch.where(bv < exact, torch.nextafter(bv.half(), torch.tensor(float("inf")).half()).float(), bv)
            mg = torch.full((Lp,), float("inf"))
            mg[:L] = m0
            U = bv.reshape(Lp // rows, rows, nb).amax(1)              # [groups, nb]
            mmin = mg.reshape(Lp // rows, rows).amin(1)               # [groups]
            cand = (U >= (mmin + la)[:, None]).repeat_interleave(rows, 0)[:L] & vis
            grouped[g] = cand
        single = torch.zeros(L, nb, dtype=torch.bool)
        run = torch.full((L,), -float("inf"))
        for c in range((nb + 31) // 32 - 1, -1, -1):
            Js = slice(32 * c, min(nb, 32 * c + 32))
            run = torch.maximum(run, torch.where(whole[:, Js], pooled[:, Js], inf).amax(1))
            single[:, Js] = vis[:, Js] & (bound[:, Js] >= (run + la)[:, None])
        m = m0.clone()
        scored = torch.zeros(L, nb, dtype=torch.bool)
        kept = torch.zeros(L, nb, dtype=torch.bool)
        for J in range(nb - 1, -1, -1):                           # one pass from the diagonal down
            c = (last >= J) & (bound[:, J] >= m + la)
            sh = pooled[:, J] + res[:, J]
            m = torch.where(c, torch.maximum(m, sh), m)
            scored[:, J] = c
            kept[:, J] = c & (sh >= m + la)

        def frac(x, g):
            return x.reshape(L // g, g, nb).any(1).sum().item() / vis.reshape(L // g, g, nb).any(1).sum().item()
        print(f"L {L} alpha {alpha} basis {basis} split {split} perp {perp} sinkref {sink_keys} query head {hq}: "
              f"candidates (CTA, b_r) {frac(static, 128):.3f}, "
              f"single pooled pass {frac(single, 128):.3f}, scored (warpgroup) {frac(scored, 64):.3f}, "
              f"kept (CTA) {frac(kept, 128):.3f}" + "".join(
                  f", b_r from chunk 0 + the last {kc} {frac(c, 128):.3f}" for kc, c in partial.items()) + "".join(
                  f", {g} groups a tile {frac(c, 128):.3f}" for g, c in grouped.items()))


if __name__ == "__main__":
    main()
