"""A model of the FP8 kernel's register and shared-memory index maps (no GPU, no library): the V transpose of
src/cuda/attention/kv_tma_vt.h (lane mapping, byte permutes, the store stagger, the paged-tail zeros aside) and
convert_p of mainloop_sm90.h, against CuTe's SM90 GMMA fragment layouts (CLayout_64xN for the f32 accumulator,
ALayout_64x32 for the 8-bit A operand, cute/atom/mma_traits_sm90_gmma.hpp) and the 128-byte swizzle.

It checks what the kernel relies on: every smem_vt byte written once with V[vt_key_of(k), d]; the A fragment holding
P[m, vt_key_of(k)] at (m, k), so sum_k A[m, k] V^T[n, k] = (P V)[m, n]; and the bank conflicts of the transpose
(reads and stores conflict-free). Written from the C++ by hand: change it with kv_tma_vt.h / convert_p / vt_key_of.
"""
import numpy as np


def vt_key_of(k):  # FwdConfigFp8::vt_key_of
    h, t, j = (k >> 4) & 1, (k >> 2) & 3, k & 3
    return (k & ~31) + 16 * h + 8 * (j >> 1) + 2 * t + (j & 1)


def byte_perm(x, y, s):  # CUDA __byte_perm: bytes 0-3 of x, 4-7 of y
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * n)) & 7] << (8 * n) for n in range(4))


def sw128_word(row, col):
    """32-bit word of byte (row, col) in a K-major SW128 tile of 128-byte rows (Swizzle<3, 4, 3> on byte offsets)."""
    return (row * 128 + ((col // 16) ^ (row % 8)) * 16 + col % 16) // 4


def conflict_degree(words):
    words = np.array(sorted(set(words)))
    return int(np.bincount(words % 32, minlength=32).max())


def test_v_transpose_covers_the_tile_in_vt_key_order_without_bank_conflicts():
    rng = np.random.default_rng(0)
    V = rng.integers(0, 256, (128, 128))  # smem_v of one stage: [key, d]
    Vt = -np.ones((128, 128), dtype=np.int64)  # smem_vt: [d, column]
    worst_read = worst_store = 0
    for warp in range(3):  # the transpose warps (producer warps 1-3)
        for it in range(warp, 32, 3):
            reads, stores = [[] for _ in range(4)], [[] for _ in range(4)]
            for lane in range(32):
                d_lane = (lane & 3) | ((lane >> 4) << 2)
                t = (lane >> 2) & 3
                stagger = 2 * ((lane >> 1) & 1) + (lane >> 4)
                d0 = 4 * (d_lane | ((it & 3) << 3))
                col = 32 * (it >> 3) + 16 * ((it >> 2) & 1) + 4 * t
                key0 = vt_key_of(col)
                words = []
                for j in range(4):
                    key = key0 + (j & 1) + 8 * (j >> 1)
                    words.append(sum(int(V[key, d0 + b]) << (8 * b) for b in range(4)))
                    reads[j].append(sw128_word(key, d0))
                t0, t1 = byte_perm(words[0], words[1], 0x5140), byte_perm(words[0], words[1], 0x7362)
                t2, t3 = byte_perm(words[2], words[3], 0x5140), byte_perm(words[2], words[3], 0x7362)
                for s in range(4):
                    x = (s + stagger) & 3
                    hi = x >= 2
                    row = byte_perm(t1 if hi else t0, t3 if hi else t2, 0x7632 if x & 1 else 0x5410)
                    for b in range(4):
                        assert Vt[d0 + x, col + b] == -1, "a byte written twice"
                        Vt[d0 + x, col + b] = (row >> (8 * b)) & 0xFF
                    stores[s].append(sw128_word(d0 + x, col))
            worst_read = max([worst_read] + [conflict_degree(r) for r in reads])
            worst_store = max([worst_store] + [conflict_degree(s) for s in stores])
    assert (Vt >= 0).all(), "smem_vt not fully written"
    want = np.array([[V[vt_key_of(k), d] for k in range(128)] for d in range(128)])
    np.testing.assert_array_equal(Vt, want)
    assert (worst_read, worst_store) == (1, 1)


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
