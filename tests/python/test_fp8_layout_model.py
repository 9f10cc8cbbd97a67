"""A model of the FP8 kernel's register and shared-memory index maps (no GPU, no library): the V transpose of
src/cuda/attention/kv_tma_vt.h (ldmatrix.trans / stmatrix lane addresses, byte permutes, the paged-tail zeros aside) and
convert_p of mainloop_sm90.h, against CuTe's SM90 GMMA fragment layouts (CLayout_64xN for the f32 accumulator,
ALayout_64x32 for the 8-bit A operand, cute/atom/mma_traits_sm90_gmma.hpp) and the 128-byte swizzle.

It checks what the kernel relies on: every smem_vt byte written once with V[vt_key_of(k), d]; the A fragment holding
P[m, vt_key_of(k)] at (m, k), so sum_k A[m, k] V^T[n, k] = (P V)[m, n]; and the bank conflicts of the transpose
(every ldmatrix / stmatrix matrix one wavefront). Written from the C++ by hand: change it with kv_tma_vt.h / convert_p / vt_key_of.
"""
import numpy as np


def vt_key_of(k):  # FwdConfigFp8::vt_key_of
    h, t, j = (k >> 4) & 1, (k >> 2) & 3, k & 3
    return (k & ~31) + 16 * h + 8 * (j >> 1) + 2 * t + (j & 1)


def byte_perm(x, y, s):  # CUDA __byte_perm: bytes 0-3 of x, 4-7 of y
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * n)) & 7] << (8 * n) for n in range(4))


def ldsm_x4_trans(smem_bytes, row_addr):
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane L gives the address of row L % 8 of matrix L // 8 (16
    bytes = 8 b16); lane T receives in register m the b16 elements (row 2 (T % 4), col T // 4) and (row 2 (T % 4) + 1,
    col T // 4) of matrix m (PTX ISA, "Matrix fragments for ldmatrix", .trans)."""
    regs = np.zeros((32, 4), dtype=np.int64)
    for T in range(32):
        c, r = T % 4, T // 4
        for m in range(4):
            lo_row, hi_row = row_addr[8 * m + 2 * c], row_addr[8 * m + 2 * c + 1]
            b = [smem_bytes[lo_row + 2 * r], smem_bytes[lo_row + 2 * r + 1],
                 smem_bytes[hi_row + 2 * r], smem_bytes[hi_row + 2 * r + 1]]
            regs[T, m] = sum(int(x) << (8 * i) for i, x in enumerate(b))
    return regs


def stsm_x4(smem_bytes, row_addr, regs, written):
    """stmatrix.sync.aligned.m8n8.x4.shared.b16: lane L gives the address of row L % 8 of matrix L // 8; lane T's
    register m holds bytes 4 (T % 4) .. + 3 of row T // 4 of matrix m."""
    for T in range(32):
        c, r = T % 4, T // 4
        for m in range(4):
            addr = row_addr[8 * m + r] + 4 * c
            for i in range(4):
                assert not written[addr + i], "a byte written twice"
                written[addr + i] = True
                smem_bytes[addr + i] = (int(regs[T, m]) >> (8 * i)) & 0xFF


def sw128(row, col):  # byte offset of (row, byte col) in a K-major SW128 tile of 128-byte rows
    return row * 128 + (((col >> 4) ^ row) & 7) * 16 + (col & 15)


def bank_degree(row_addr):
    """Wavefronts of one 8-row matrix phase of ldmatrix / stmatrix (16-byte rows): 1 when the 8 rows hit 8 distinct
    16-byte bank groups."""
    groups = [(a // 16) % 8 for a in row_addr]
    return max(groups.count(g) for g in set(groups))


def test_v_transpose_covers_the_tile_in_vt_key_order_without_bank_conflicts():
    """The LDSM.T / STSM transpose of kv_tma_vt.h: group g (key block kb = g % 8 of 16 keys, dims 32 (g // 8) ..
    + 31), lane constants as in the C++."""
    rng = np.random.default_rng(0)
    V = rng.integers(0, 256, (128, 128))  # smem_v of one stage: [key, d]
    smem_v = np.zeros(128 * 128, dtype=np.int64)
    for key in range(128):
        for d in range(128):
            smem_v[sw128(key, d)] = V[key, d]
    smem_vt = np.zeros(128 * 128, dtype=np.int64)
    written = np.zeros(128 * 128, dtype=bool)
    worst = 0
    for g in range(32):
        kb, dpair = g % 8, g // 8
        ld_rows, st_rows = [], []
        for L in range(32):
            m, i = L // 8, L % 8
            key = 16 * kb + i + 8 * (m & 1)
            ld_rows.append(sw128(key, 32 * dpair + 16 * (m >> 1)))
            dim = 32 * dpair + 16 * (m >> 1) + 2 * i + ((m & 1) ^ (i >= 4))
            st_rows.append(sw128(dim, 16 * kb))
        for m in range(4):
            worst = max(worst, bank_degree(ld_rows[8 * m:8 * m + 8]), bank_degree(st_rows[8 * m:8 * m + 8]))
        x = ldsm_x4_trans(smem_v, ld_rows)
        out = np.zeros((32, 4), dtype=np.int64)
        for T in range(32):
            r = T // 4
            sel_a, sel_b = (0x6420, 0x7531) if r < 4 else (0x7531, 0x6420)
            out[T] = [byte_perm(x[T, 0], x[T, 1], sel_a), byte_perm(x[T, 0], x[T, 1], sel_b),
                      byte_perm(x[T, 2], x[T, 3], sel_a), byte_perm(x[T, 2], x[T, 3], sel_b)]
        stsm_x4(smem_vt, st_rows, out, written)
    assert written.all(), "smem_vt not fully written"
    got = np.array([[smem_vt[sw128(d, k)] for k in range(128)] for d in range(128)])
    want = np.array([[V[vt_key_of(k), d] for k in range(128)] for d in range(128)])
    np.testing.assert_array_equal(got, want)
    assert worst == 1


def test_p_fragment_is_p_in_vt_key_order():
    rng = np.random.default_rng(1)
    P = rng.integers(0, 256, (64, 128))  # one warpgroup's 64 rows x 128 keys (e4m3 bytes)
    A = -np.ones((64, 128), dtype=np.int64)
    for warp in range(4):
        for lane in range(32):
            def acc(e):  # CLayout_64xN: e = e0 + 2 e1 + 4 e2 -> (row, col)
                e0, e1, e2 = e & 1, (e >> 1) & 1, e >> 2
                return P[16 * warp + lane // 4 + 8 * e1, 8 * e2 + 2 * (lane % 4) + e0]
            regs = []
            for kk in range(4):  # convert_p: register 4 kk + q = bytes {base, base+1, base+4, base+5}
                for q in range(4):
                    base = 16 * kk + 8 * (q >> 1) + 2 * (q & 1)
                    regs.append(sum(int(acc(base + o)) << (8 * i) for i, o in enumerate((0, 1, 4, 5))))
            for kk in range(4):  # ALayout_64x32: value v0 + 4 v1 + 8 v2 -> (m, k); register v1 + 2 v2, byte v0
                for v2 in range(2):
                    for v1 in range(2):
                        for v0 in range(4):
                            m = 16 * warp + lane // 4 + 8 * v1
                            k = 32 * kk + 4 * (lane % 4) + v0 + 16 * v2
                            assert A[m, k] == -1
                            A[m, k] = (regs[4 * kk + v1 + 2 * v2] >> (8 * v0)) & 0xFF
    want = np.array([[P[m, vt_key_of(k)] for k in range(128)] for m in range(64)])
    np.testing.assert_array_equal(A, want)
