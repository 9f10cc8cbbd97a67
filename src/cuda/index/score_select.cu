// Index stage, step 3: score and select. One CTA per (tile, virtual KV head) scores the tile's packed Q rows against
// the pooled keys on tensor cores and applies the keep rules (tile energy: SelectionRule::kTileEnergy; per-row max:
// kRowMax, and the pooled-means half of kProbeRowMax / kProbeRowMass), bump-allocating the kept ids into the CSR.
// FP8 inputs are scored in bf16: the pooled keys' bf16 copy (real units) and Q dequantised on its way into shared
// memory.
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/attention/config.h"  // CuTe / CUTLASS: GMMA atoms, swizzled K-major smem atoms, proxy fence
#include "cuda/index/device_args.cuh"
#include "cuda/index/q_gather.cuh"
#include "cuda/attention/softmax.h"  // acc_rowcol, fast_exp2
#include "cuda/common/wgmma.h"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kScoreChunk = 128;     // pooled blocks scored per step: S chunk is 128 rows x 128 blocks
constexpr int kScoreThreads = 256;   // 2 warpgroups x 64 packed rows
constexpr int kScoreWarps = kScoreThreads / 32;
static_assert(kTileRows == 2 * 64, "the scorer's tile is two warpgroups' m64 GEMM rows (kScoreThreads, the 2 x 1 MMA)");

// The scorer's tensor-core GEMM between the tile's packed Q rows and 128 pooled keys: the attention kernel's S GEMM
// shapes (two warpgroups of 64 rows, SS wgmma 64 x 128 x 16 atoms, 128-byte-swizzled K-major tiles), with 128 pooled
// blocks per step in place of 128 keys. The per-row rule computes S = Q K_mean^T (rows = query rows), the tile
// energy its transpose S^T = K_mean Q^T (rows = blocks: a block's sum over the query rows stays within a quad of
// lanes). Q (32 KiB at D = 128) and two stages of pooled keys (2 x 32 KiB) in shared memory: ~100 KiB per CTA, so 2
// CTAs (16 warps) share an SM and one CTA's exp2 epilogue runs under the other's wgmma.
template <typename T, int D>
struct ScoreConfig {
  // the operands' type: fp16 for fp16 inputs, bf16 for bf16 and FP8 (lowp_t) inputs
  using Element = std::conditional_t<std::is_same_v<T, __half>, cutlass::half_t, cutlass::bfloat16_t>;
  static constexpr int kN = kScoreChunk;
  using TileShape = cute::Shape<cute::Int<kTileRows>, cute::Int<kN>, cute::Int<D>>;
  using TiledMma = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<Element, Element, float, TileShape>(),
                                                 cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  template <int kRows>
  using Atom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element,
                                                                            cute::Int<kRows>, cute::Int<D>>());
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(Atom<kTileRows>{}, cute::Shape<cute::Int<kTileRows>, cute::Int<D>>{}));
  using SmemLayoutK =
      decltype(cute::tile_to_shape(Atom<kN>{}, cute::Shape<cute::Int<kN>, cute::Int<D>, cute::_2>{}));
  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;  // double buffer: chunk c+1 loads under c
    float partial[kScoreWarps][kN];  // per-row rule: each warp's column maxima of a chunk
    float red[kScoreWarps];
    int nan_flag;  // a NaN score in the tile: keep every visible block
    int64_t base;  // the segment's first block_ids slot (kOverflowStart: no room)
  };
  // Dynamic shared memory: Smem, then energy[nb_max rounded up to 4] and the keep bits (one word per 32 blocks: the
  // count pass's ballots, read by the write pass).
  static size_t smem_bytes(int64_t nb_max) {
    return sizeof(Smem) + size_t((nb_max + 3) & ~int64_t(3)) * sizeof(float) +
           size_t(keep_words(nb_max)) * sizeof(uint32_t);
  }
  static int64_t keep_words(int64_t nb_max) { return (nb_max + kScoreThreads - 1) / kScoreThreads * kScoreWarps; }
};

// One step of the column butterfly: lanes that differ in lane bit kBit (rows 8 apart for kBit = 4 ... 32 apart for
// 16, all with the same columns) each keep half of their kBit live values, the upper half when the bit is set, and
// combine them with the partner's copy of that half (the per-row rule's column maxima).
template <int kBit, class Combine>
__device__ __forceinline__ void butterfly_step(float (&v)[32], int lane, Combine combine) {
  const bool upper = lane & kBit;
#pragma unroll
  for (int k = 0; k < kBit; ++k) {
    const float keep = upper ? v[k + kBit] : v[k], give = upper ? v[k] : v[k + kBit];
    v[k] = combine(keep, __shfl_xor_sync(0xffffffffu, give, kBit));
  }
}
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// One CTA per (tile, KV head), 2 warpgroups of 64 rows. Per chunk of 128 pooled blocks one wgmma, then:
// Tile energy (SelectionRule::kTileEnergy): S^T = K_mean Q^T, each thread holding 2 blocks x 32 query rows. Per block
// J the quad of lanes that holds its 128 rows takes m_J = max over the rows that see J of s_rJ and
// sum_J = sum_r exp2(scale_log2 (s_rJ - m_J)), and keeps log2 E_J = scale_log2 m_J + log2 sum_J in energy[]: the
// energies relative to any common reference, so the keep test E_J >= alpha max E is log2 E_J >= log2 max E +
// log2 alpha, with no rescale and no cross-warp step (each warpgroup stages its own 64 pooled rows and syncs alone).
// kRowMax (SelectionRule::kRowMax): S = Q K_mean^T, two passes over the chunks through the same double-buffered
// pipeline. Pass 1 keeps each thread's 2 row maxima m_r (reduced over the 4 lanes of a row at its end); pass 2
// recomputes the GEMM of every chunk but pass 1's last (no L/B x 128 score buffer: shared memory stays bounded) and
// takes per block C_J = max over the rows that see J of s_rJ - m_r (raw dot products; the scale is folded into the
// threshold), by a max butterfly over the warp's 8 row groups (28 shuffles) and a max over the 8 warps, into
// energy[]; keep iff
// C_J >= ln(alpha) / scale = log2(alpha) / scale_log2.
// The last tiles (last_n), which keep every visible block, skip the GEMM.
// kBitsOnly (the per-key rules, is_per_key_rule: key_max.cu / exact_max.cu computed their bits): no GEMM at all, the
// keep rules with the bits in place of the threshold test.
template <typename T, int D, bool kRowMax, bool kBitsOnly = false>
__global__ void __launch_bounds__(kScoreThreads, 2) score_select_kernel(
    SeqArgs seq, QArgs qa, SelectArgs sel, int group_size, int num_kv_heads, int subgroups, int kv_heads_mem,
    const int32_t* cu_tiles, const int32_t* cu_blocks, const lowp_t<T>* k_mean_lowp,
    const uint32_t* probe_bits, int64_t probe_words, int32_t* segment_start,
    int32_t* segment_end, int32_t* block_ids, int64_t capacity, unsigned long long* counters) {
  using namespace cute;
  using Cfg = ScoreConfig<T, D>;
  using Element = typename Cfg::Element;
  constexpr int kN = Cfg::kN;
  constexpr int kWarps = kScoreWarps;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  float* energy = reinterpret_cast<float*>(smem_raw + sizeof(typename Cfg::Smem));

  const SelectTile st = select_tile(seq, cu_tiles);
  if (st.b < 0) return;
  const int kvh = st.kvh, b = st.b;
  const int64_t t = st.t, tiles = st.tiles, q_len = st.q_len, k_len = st.k_len, off = st.off;
  const int64_t nb = cu_blocks[b + 1] - cu_blocks[b];
  const int64_t rows = min(int64_t(kTileRows), q_len * group_size - t * kTileRows);
  const int64_t first_pos = t * kTileRows / group_size, last_pos = (t * kTileRows + rows - 1) / group_size;
  const int64_t hi_first = min(k_len - 1, first_pos + off), hi_last = min(k_len - 1, last_pos + off);
  const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * tiles + t;
  const int B = sel.block_size;
  const int64_t nvis = hi_last >= 0 ? hi_last / B + 1 : 0;  // blocks 0 .. nvis-1 are visible to the tile
  uint32_t* keep_bits = reinterpret_cast<uint32_t*>(energy + ((nb + 3) & ~int64_t(3)));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename Cfg::SmemLayoutK{});

  // stage_chunk(c, buf): the pooled keys of chunk c into stage `buf` with cp.async (16 B each).
  // (num_kv_heads, group_size: virtual KV heads with head sub-groups; the pooled means are per KV head in memory.)
  const Element* pooled =
      reinterpret_cast<const Element*>(k_mean_lowp) + (int64_t(cu_blocks[b]) * kv_heads_mem + kvh / subgroups) * D;
  const int pooled_row_stride = kv_heads_mem * D;  // elements between consecutive blocks' means of one KV head
  const int nb32 = int(nb);
  // Each thread copies the same 16-byte column v of rows n0, n0 + kRowsPerPass, ... of every chunk: its shared
  // addresses are fixed per stage, and the passes of the swizzled tile lie a fixed byte distance apart (whole 8-row
  // swizzle atoms), so a chunk costs kPasses copies and adds (index math per copy was ~1/3 of the loop's issue
  // slots). Rows past the sequence's blocks copy its last block's mean (32-bit offsets, no zero-fill select: 117 ->
  // ~50 instructions per chunk): every chunk that holds them is masked, and both rules set their scores to -inf.
  // Who copies what: the per-row rule's S = Q K_mean^T needs all 128 rows of a chunk in each warpgroup (its B
  // operand), so the 256 threads copy them and the CTA syncs (sync_stage). The tile energy's S^T = K_mean Q^T reads
  // in each warpgroup only its own 64 rows (its A operand): each warpgroup copies its half and syncs alone on a
  // 128-thread named barrier, so the two drift apart instead of meeting every chunk (the CTA barrier was 1.26 of
  // 7.4 stall cycles per issued instruction at 128K, docs/design/index_stage.md).
  constexpr int kCopyThreads = kRowMax ? kScoreThreads : 128, kCopyRows = kRowMax ? kN : kN / 2;
  constexpr int kVec = D / 8, kRowsPerPass = kCopyThreads / kVec, kPasses = kCopyRows / kRowsPerPass;
  const int wg = threadIdx.x / 128;
  const int copier = kRowMax ? int(threadIdx.x) : int(threadIdx.x) % 128;  // this thread among its copiers
  const int v = copier % kVec, n0 = (kRowMax ? 0 : wg * kCopyRows) + copier / kVec;
  const auto smem_addr = [](const Element& e) { return static_cast<uint32_t>(__cvta_generic_to_shared(&e)); };
  const uint32_t dst0 = smem_addr(sK(n0, v * 8, 0));
  const uint32_t pass_bytes = smem_addr(sK(n0 + kRowsPerPass, v * 8, 0)) - dst0;
  const uint32_t stage_bytes = smem_addr(sK(n0, v * 8, 1)) - dst0;
  const char* src0 = reinterpret_cast<const char*>(pooled + v * 8);
  const uint32_t row_bytes = uint32_t(pooled_row_stride) * uint32_t(sizeof(Element));
  auto stage_chunk = [&](int c, int buf) {
    const uint32_t dst = dst0 + uint32_t(buf) * stage_bytes;
    CUTE_UNROLL
    for (int p = 0; p < kPasses; ++p) {
      const int row = min(c * kN + n0 + p * kRowsPerPass, nb32 - 1);  // nb_max x row_bytes < 2^32 (smem limit)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + p * pass_bytes),
                   "l"(src0 + uint32_t(row) * row_bytes));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  // Step `step`'s keys (and, at step 0, Q) visible to the wgmma of every thread that reads them, and the other
  // stage's last reader done, before it is refilled.
  auto sync_stage = [&](int step) {
    if (kRowMax || step == 0) {
      __syncthreads();  // step 0: Q, copied by all 256 threads
    } else if (wg == 0) {  // barriers 1 and 2 as immediates (a register id makes ptxas reserve all 16)
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
    } else {
      asm volatile("bar.sync 2, 128;\n" ::: "memory");
    }
  };

  const bool last_tile = t >= tiles - sel.last_n;
  const int nchunks = (last_tile || kBitsOnly) ? 0 : int((nvis + kN - 1) / kN);
  if (threadIdx.x == 0) sm.nan_flag = 0;  // read after the loop's barriers
  if constexpr (is_fp8_v<T>) {
    if (nchunks > 0) {
      stage_chunk(0, 0);  // chunk 0's keys in flight under the Q gather
      gather_q_fp8<D, kScoreThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh,
                                     qa.descale.at(b, kvh / subgroups));
    }
  } else if (nchunks > 0) {  // Q (q_gather.cuh) and chunk 0 in one cp.async group
    if (qa.vec16) {
      gather_q_cp_async<T, D, 8, kScoreThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh);
    } else {
      gather_q_cp_async<T, D, 2, kScoreThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh);
    }
    stage_chunk(0, 0);  // commits Q and chunk 0 as one group
  }

  typename Cfg::TiledMma mma;
  auto wg_mma = mma.get_slice((threadIdx.x / 128) * 128);
  auto thr_mma = mma.get_slice(threadIdx.x);
  // (MMA, MMA_M | MMA_N, MMA_K) descriptors; the pooled keys with their stage mode. The tile energy multiplies the
  // other way round (rows = blocks).
  Tensor tSrQ = [&] {
    if constexpr (kRowMax) return wg_mma.partition_fragment_A(sQ);
    else return wg_mma.partition_fragment_B(sQ);
  }();
  Tensor tSrK = [&] {
    if constexpr (kRowMax) return wg_mma.partition_fragment_B(sK);
    else return wg_mma.partition_fragment_A(sK);
  }();
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kTileRows>, Int<kN>>{});
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));  // (2 rows, kN / 4 columns) of this thread
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kCols = decltype(size<1>(S))::value;  // 32: column c is tile column 8 (c / 2) + 2 (lane % 4) + c % 2
  static_assert(decltype(size<0>(S))::value == 2 && kCols == 32, "accumulator layout assumed by the reductions");

  // kRowMax: the last block each of this thread's 2 query rows sees (-1: none, or past the tile's rows). Chunks that
  // every row of the tile sees whole skip the mask (causal: all but the last one or two).
  int row_last_block[2] = {-1, -1};
  if constexpr (kRowMax) {
    for (int i = 0; i < 2; ++i) {
      const int r = get<0>(cS_rc(i, 0));
      const int64_t hi = r < rows ? min(k_len - 1, (t * kTileRows + r) / group_size + off) : -1;
      row_last_block[i] = hi >= 0 ? int(hi / B) : -1;
    }
  }
  const int tile_min_last_block = (rows == kTileRows && hi_first >= 0) ? int(hi_first / B) : -1;

  // Steps: the chunks once (kRowMax: pass 1 over chunks 0 .. n-1, then pass 2 backwards from chunk n-1, whose masked
  // S pass 1's last step still holds: that step goes on into pass 2 with no second load, barrier or GEMM; a one-chunk
  // tile, every tile up to 16K tokens, runs one GEMM instead of two). Step l reads load l, in stage l % 2.
  const int steps = kRowMax ? 2 * nchunks - 1 : nchunks;
  auto step_chunk = [&](int l) { return l < nchunks ? l : 2 * nchunks - 2 - l; };
  float row_max[2] = {-INFINITY, -INFINITY};  // kRowMax: m_r of this thread's 2 rows (raw dot products)
  for (int step = 0; step < steps; ++step) {
    const int c = step_chunk(step);
    const int buf = step & 1;
    asm volatile("cp.async.wait_group 0;\n" ::);
    cutlass::arch::fence_view_async_shared();  // cp.async and Q stores (generic proxy) -> visible to wgmma
    sync_stage(step);
    if (step + 1 < steps) stage_chunk(step_chunk(step + 1), buf ^ 1);

    if constexpr (kRowMax) {
      wgmma_batch<false>(mma, tSrQ, tSrK(_, _, _, buf), tSrS, /*zero_init=*/true);
    } else {
      wgmma_batch<false>(mma, tSrK(_, _, _, buf), tSrQ, tSrS, /*zero_init=*/true);
    }
    warpgroup_wait<0>();
    const int chunk_first = c * kN;
    const bool unmasked = chunk_first + kN - 1 <= tile_min_last_block;

    if constexpr (kRowMax) {
      if (!unmasked) {  // -inf where the row does not see the block (or lies past the tile)
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i)
          CUTE_UNROLL
          for (int k = 0; k < kCols; ++k) {
            const int J = chunk_first + 8 * (k / 2) + 2 * (lane % 4) + k % 2;
            if (J > row_last_block[i]) S(i, k) = -INFINITY;
          }
      }
      if (step < nchunks) {  // pass 1: row maxima
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i)
          CUTE_UNROLL
          for (int k = 0; k < kCols; ++k) row_max[i] = fmax_nan(row_max[i], S(i, k));
        if (step == nchunks - 1) {
          if (row_max[0] != row_max[0] || row_max[1] != row_max[1]) atomicOr(&sm.nan_flag, 1);
          CUTE_UNROLL
          for (int i = 0; i < 2; ++i) {  // the 4 lanes of a quad hold one row's columns
            row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 1));
            row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 2));
            if (row_max[i] == -INFINITY) row_max[i] = 0.f;  // a row that sees nothing: its -inf scores stay -inf
          }
        }
        if (step < nchunks - 1) continue;  // pass 2 begins with this step's S
      }
      // Pass 2: per column max over this thread's rows of s - m_r, then over the warp's 8 row groups.
      float v[kCols];
      CUTE_UNROLL
      for (int k = 0; k < kCols; ++k) v[k] = fmaxf(S(0, k) - row_max[0], S(1, k) - row_max[1]);
      butterfly_step<16>(v, lane, MaxOp{});
      butterfly_step<8>(v, lane, MaxOp{});
      butterfly_step<4>(v, lane, MaxOp{});
      {
        const int c0 = ((lane >> 4) & 1) * 16 + ((lane >> 3) & 1) * 8 + ((lane >> 2) & 1) * 4;
        const int col = 8 * (c0 / 2) + 2 * (lane % 4);
        *reinterpret_cast<float2*>(&sm.partial[warp][col]) = make_float2(v[0], v[1]);
        *reinterpret_cast<float2*>(&sm.partial[warp][col + 8]) = make_float2(v[2], v[3]);
      }
      __syncthreads();
      if (threadIdx.x < kN) {  // max over the warps: C_J of the tile (-inf: no row sees J)
        float cm = sm.partial[0][threadIdx.x];
        for (int w = 1; w < kWarps; ++w) cm = fmaxf(cm, sm.partial[w][threadIdx.x]);
        const int J = chunk_first + threadIdx.x;
        if (J < nb32) energy[J] = cm;
      }
    } else {
      // Tile energy. Row i of this thread is block J; column k is query row r. Query row r sees J iff r < rows and
      // J B <= its position + off, i.e. (J B - off) g <= t 128 + r (the position is floor((t 128 + r) / g)).
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) {
        const int J = chunk_first + get<0>(cS_rc(i, 0));
        if (!unmasked) {
          const int64_t lo = (int64_t(J) * B - off) * group_size - t * kTileRows;  // first query row that sees J
          // rows [r_lo, rows) see J; relative to this thread's first column (column offsets are compile-time)
          const int r_base = get<1>(cS_rc(i, 0));
          const int lo_k = int(max(int64_t(0), min(lo, int64_t(kTileRows)))) - r_base, hi_k = int(rows) - r_base;
          CUTE_UNROLL
          for (int k = 0; k < kCols; ++k) {
            const int dk = get<1>(cS_rc(i, k)) - r_base;
            if (dk < lo_k || dk >= hi_k) S(i, k) = -INFINITY;
          }
        }
        // m_J over the quad's 128 rows (NaN-propagating: a NaN score flags the tile), four chains for the latency
        float m4[4] = {S(i, 0), S(i, 1), S(i, 2), S(i, 3)};
        CUTE_UNROLL
        for (int k = 4; k < kCols; ++k) m4[k % 4] = fmax_nan(m4[k % 4], S(i, k));
        float m = fmax_nan(fmax_nan(m4[0], m4[1]), fmax_nan(m4[2], m4[3]));
        m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmax_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (m != m) atomicOr(&sm.nan_flag, 1);
        const float m_log2 = m == -INFINITY ? 0.f : m * sel.scale_log2;  // no row sees J: every term exp2(-inf) = 0
        float e4[4] = {0.f, 0.f, 0.f, 0.f};
        CUTE_UNROLL
        for (int k = 0; k < kCols; ++k) e4[k % 4] += fast_exp2(fmaf(S(i, k), sel.scale_log2, -m_log2));
        float e = (e4[0] + e4[1]) + (e4[2] + e4[3]);
        e += __shfl_xor_sync(0xffffffffu, e, 1);
        e += __shfl_xor_sync(0xffffffffu, e, 2);
        if ((lane & 3) == 0 && J < nb32) energy[J] = m_log2 + __log2f(e);  // -inf when no row sees J
      }
    }
  }
  __syncthreads();

  float threshold;
  if constexpr (kRowMax) {
    threshold = log2f(sel.alpha) / sel.scale_log2;  // ln(alpha) / scale; alpha = 0: -inf, every visible block
  } else {
    // log2 E_max over the visible blocks; keep iff log2 E_J >= log2 E_max + log2 alpha (alpha = 0: -inf, every block)
    float local_emax = -INFINITY;
    for (int64_t J = threadIdx.x; J < (last_tile ? 0 : nvis); J += kScoreThreads)
      local_emax = fmaxf(local_emax, energy[J]);
    for (int o = 16; o > 0; o /= 2) local_emax = fmaxf(local_emax, __shfl_xor_sync(0xffffffffu, local_emax, o));
    if (lane == 0) sm.red[warp] = local_emax;
    __syncthreads();
    float emax = sm.red[0];
    for (int w = 1; w < kWarps; ++w) emax = fmaxf(emax, sm.red[w]);
    threshold = emax + log2f(sel.alpha);
  }

  // Keep rules (causal): threshold, not prunable (crosses the diagonal), sink, window band, last tiles (whose
  // energies were never computed: the force term). 32-bit and branch-free: key positions < 2^31 (int32 cu_seqlens);
  // the 64-bit short-circuit form was ~100 instructions per round of 256 blocks.
  const int kl = int(k_len), hf = int(max(hi_first, int64_t(-1)));  // hf -1: no block is prunable
  const int64_t diag_first = first_pos + off, diag_last = last_pos + off;
  const int band_lo = int(max(int64_t(0), diag_first - sel.window + 1)), band_hi = int(min(k_len - 1, diag_last));
  const bool has_band = sel.window > 0 && diag_last >= 0;
  const bool force = sm.nan_flag != 0 || last_tile;  // nan_flag: written before the loop's last barrier
  const int nvis32 = int(nvis);
  // Count pass: the keep decisions in rounds of 256 blocks, each warp's ballot stored as the word of its 32 blocks.
  for (int round = 0; round < nvis32; round += kScoreThreads) {
    const int J = round + threadIdx.x;
    bool keep = false;
    if (J < nvis32) {
      const int first_key = J * B, last_key = first_key + min(B - 1, kl - 1 - first_key);
      const bool probe = probe_bits != nullptr && ((probe_bits[seg * probe_words + J / 32] >> (J % 32)) & 1u);
      keep = force | (last_key > hf) | (kBitsOnly ? false : energy[J] >= threshold) | (first_key < sel.sink) |
             (has_band & (first_key <= band_hi) & (last_key >= band_lo)) | probe;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) keep_bits[round / 32 + warp] = ballot;
  }
  __syncthreads();
  // Warp 0: exclusive prefix of the words' popcounts into word_prefix (energy[]'s room, no longer read), the
  // segment's total, and one slot range per segment from the global cursor (64-bit: it never wraps, whatever the
  // budget); a segment that does not fit is marked, and runs its full list.
  int* word_prefix = reinterpret_cast<int*>(energy);
  const int words = (nvis32 + 31) / 32;
  if (warp == 0) {
    int total = 0;
    for (int w0 = 0; w0 < words; w0 += 32) {
      const int w = w0 + lane;
      const int n = w < words ? __popc(keep_bits[w]) : 0;
      int incl = n;
      for (int o = 1; o < 32; o *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      if (w < words) word_prefix[w] = total + incl - n;
      total += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      const unsigned long long at = total ? atomicAdd(&counters[kCursor], (unsigned long long)total) : 0ull;
      const bool fits = at + total <= (unsigned long long)capacity;
      sm.base = fits ? int64_t(at) : kOverflowStart;
      segment_start[seg] = fits ? int32_t(at) : kOverflowStart;
      segment_end[seg] = int32_t(fits ? at + total : nvis);
      atomicAdd(&counters[kKept], (unsigned long long)(fits ? total : nvis));
      atomicAdd(&counters[kVisible], (unsigned long long)nvis);
      if (!fits) atomicAdd(&counters[kOverflow], 1ull);
    }
  }
  __syncthreads();
  const int64_t base = sm.base;
  if (base == kOverflowStart) return;
  // Write pass: ids ascending at base, lane l of word w at its word's prefix plus the kept bits below l.
  for (int w = warp; w < words; w += kWarps) {
    const uint32_t bits = keep_bits[w];
    if ((bits >> lane) & 1u) block_ids[base + word_prefix[w] + __popc(bits & ((1u << lane) - 1u))] = w * 32 + lane;
  }
}

// The scorer's dynamic shared memory limit on this device (device_info.h: the opt-in maximum less the kernel's static
// shared memory), past the 48 KB default. Set once per instantiation together with all of the unified L1 as shared
// memory, so that two ~100 KB CTAs fit on an SM (the default carve-out may leave room for one); attributes are not
// stream operations, so there is no per-call host cost.
template <typename T, int D, bool kRowMax, bool kBitsOnly = false>
size_t score_smem_limit() {
  static const size_t limit = opt_in_all_shared_memory(score_select_kernel<T, D, kRowMax, kBitsOnly>,
                                                        "cudaFuncSetAttribute(score_select_kernel)");
  return limit;
}

template <typename T, int D, bool kRowMax, bool kBitsOnly = false>
void launch_score(dim3 grid, size_t dyn_smem, cudaStream_t stream, const SeqArgs& seq, const QArgs& qa,
                  const SelectArgs& sel, const VirtualHeads& heads, int kv_heads_mem, const DeviceIndex& d) {
  auto kernel = score_select_kernel<T, D, kRowMax, kBitsOnly>;
  (void)score_smem_limit<T, D, kRowMax, kBitsOnly>();  // the attributes, before the first launch
  kernel<<<grid, kScoreThreads, dyn_smem, stream>>>(seq, qa, sel, heads.group, heads.kv, heads.num_subgroups, kv_heads_mem,
                                                    d.cu_tiles, d.cu_blocks,
                                                    static_cast<const lowp_t<T>*>(d.k_mean_lowp), d.probe_bits,
                                                    d.probe_words, d.segment_start, d.segment_end, d.block_ids,
                                                    d.capacity, d.counters);
}

}  // namespace

void launch_select(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                   const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                   const SelectArgs& sel, const DeviceIndex& d) {
  if (bd.max_tiles <= 0) return;
  const dim3 grid(unsigned(bd.max_tiles), unsigned(heads.kv));
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    const size_t dyn_smem = ScoreConfig<T, kD>::smem_bytes(bd.nb_max);
    const bool probe = is_probe_rule(params.rule);
    const bool row_max = params.rule == SelectionRule::kRowMax || probe;
    const size_t limit = row_max ? score_smem_limit<T, kD, true>() : score_smem_limit<T, kD, false>();
    if (dyn_smem > limit) {  // energies of every visible block stay in shared memory: ~3.2M keys at block 128
      throw NotImplementedError("build_index on CUDA: " + std::to_string(bd.nb_max) +
                                " blocks per sequence exceed the scorer's shared memory (max_seqlen_k too long)");
    }
    if (is_per_key_rule(params.rule)) {
      // the per-key pass's bits, merged with the always-kept rules into the CSR (no pooled GEMM here)
      if (params.rule == SelectionRule::kKeyMax) {
        launch_key_max(stream, p, params, bd, heads, seq, qa, kv, sel, d);
      } else {
        launch_exact_max(stream, p, params, bd, heads, seq, qa, kv, sel, d);
      }
      launch_score<T, kD, true, true>(grid, dyn_smem, stream, seq, qa, sel, heads, p.num_kv_heads, d);
    } else if (probe) {
      // the probe rows' bits at alpha, then the pooled-means row max at params.mean_alpha ORs them in
      launch_probe(stream, p.dtype, kD, grid, seq, qa, kv, sel, heads,
                   params.rule == SelectionRule::kProbeRowMass, d);
      SelectArgs mean_sel = sel;
      mean_sel.alpha = params.mean_alpha;
      launch_score<T, kD, true>(grid, dyn_smem, stream, seq, qa, mean_sel, heads, p.num_kv_heads, d);
    } else if (params.rule == SelectionRule::kRowMax) {
      launch_score<T, kD, true>(grid, dyn_smem, stream, seq, qa, sel, heads, p.num_kv_heads, d);
    } else {
      launch_score<T, kD, false>(grid, dyn_smem, stream, seq, qa, sel, heads, p.num_kv_heads, d);
    }
  };
  with_index_types(p.dtype, p.head_dim, launch);
  check_cuda(cudaGetLastError(), "score_select_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage
