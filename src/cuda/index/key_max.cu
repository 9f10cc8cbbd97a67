// Index stage, the key_max rule (SelectionRule::kKeyMax, docs/design/key_max_spec.md): per-key block maxima on a
// low-rank projection of each key's deviation from its block mean, on tensor cores. On the stage's stream, after the
// pooling, no host synchronisation: key_basis.cu's three kernels (the residuals' second moment, the basis P, the
// projected keys K' = P^T x and each block's radius), then the scorer, key_max_kernel: per (tile, virtual KV head),
// the bound b_r over the blocks each row sees whole and the sink keys' exact maximum, the tile's candidates (blocks
// whose pooled score + |Q'| radius some row cannot rule out), then one pass over the candidates from the diagonal
// down: the pooled score (bf16 / fp16 wgmma, float accumulators) plus the residual block maximum (fp16 wgmma with fp16
// accumulators: two (row, key) pairs per packed max), where a warpgroup's vote against its running maxima asks for
// it, the running row maximum and the per-row test; the tile's keep bits go to d.probe_bits, which score_select's
// bits-only kernel merges with the always-kept rules into the CSR (as the probe rules' bits). The blocks it does not
// score could not pass: the selection is the spec's.
// Scores are in log2 units: Q' carries softmax_scale * log2(e), the pooled scores are scaled on their way to shared
// memory, so the test is sh - m >= log2(alpha).
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/attention/config.h"  // CuTe / CUTLASS: GMMA atoms, swizzled K-major smem atoms, proxy fence
#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/common/wgmma.h"
#include "cuda/index/device_args.cuh"
#include "cuda/index/per_key.cuh"
#include "cuda/index/q_gather.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kKeyMaxThreads = 256;  // 2 warpgroups x 64 packed rows
static_assert(kTileRows == 2 * 64, "the scorer's tile is two warpgroups' m64 GEMM rows");
constexpr int kUnitKeys = 64;        // keys per residual wgmma (N): any block_size % 64 == 0 is whole units
constexpr int kStageUnits = 8;       // units per K' stage (512 keys), double-buffered
constexpr int kPooledN = 32;         // pooled blocks per pooled wgmma (N)
// The bound on a block's residual maxima, |Q'_r| radius_J, is widened by 1/32 for the fp16 residual GEMM: its 16
// (or 32) products summed with fp16 roundings err by at most ~2^-7 of sum |q'_d k'_d| <= |Q'| |K'|.
constexpr float kBoundMargin = 1.f + 1.f / 32;

// ---- 4. the scorer --------------------------------------------------------------------------------------------------
template <typename T, int D, int R>
struct KeyMaxConfig {
  // the pooled GEMM's operands: q's dtype (bf16 for FP8 inputs, dequantised on the way in); the residual GEMM in fp16
  using Element = std::conditional_t<std::is_same_v<T, __half>, cutlass::half_t, cutlass::bfloat16_t>;
  using Half = cutlass::half_t;
  using PooledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kTileRows>, cute::Int<kPooledN>, cute::Int<D>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  // Q P in the prologue: P^T as kPParts bf16 / fp16 parts (P = p0 + p1 + p2 + O(2^-24 |P|), as exact as the fp32 P)
  using ProjMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kTileRows>, cute::Int<R>, cute::Int<D>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using ResidMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Half, Half, Half,
                                 cute::Shape<cute::Int<kTileRows>, cute::Int<kUnitKeys>, cute::Int<R>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  template <class E, int kRows, int kCols>
  using Atom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, E, cute::Int<kRows>,
                                                                            cute::Int<kCols>>());
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom<Element, kTileRows, D>{},
                                                   cute::Shape<cute::Int<kTileRows>, cute::Int<D>>{}));
  // two stages: chunk c - 1's means load while chunk c is scored
  using SmemLayoutKm = decltype(cute::tile_to_shape(Atom<Element, kPooledN, D>{},
                                                    cute::Shape<cute::Int<kPooledN>, cute::Int<D>, cute::_2>{}));
  static constexpr int kPParts = 3;
  using SmemLayoutP = decltype(cute::tile_to_shape(
      Atom<Element, R, D>{}, cute::Shape<cute::Int<R>, cute::Int<D>, cute::Int<kPParts>>{}));
  using SmemLayoutQp = decltype(cute::tile_to_shape(Atom<Half, kTileRows, R>{},
                                                    cute::Shape<cute::Int<kTileRows>, cute::Int<R>>{}));
  // K' units: slot = stage * kStageUnits + unit % kStageUnits
  using SmemLayoutKp = decltype(cute::tile_to_shape(
      Atom<Half, kUnitKeys, R>{}, cute::Shape<cute::Int<kUnitKeys>, cute::Int<R>, cute::Int<2 * kStageUnits>>{}));
  // The sink keys' chunks in the K' stages' room (free from the end of the prologue to pass 3): as many 32-key
  // chunks as fit, at most the 8 of the default sink (256 keys): 4 at rank 16 and D 128, else 8.
  static constexpr int kSinkStages =
      std::min<int>(8, int(cute::cosize_v<SmemLayoutKp> * sizeof(Half) / (kPooledN * D * sizeof(Element))));
  using SmemLayoutSink = decltype(cute::tile_to_shape(
      Atom<Element, kPooledN, D>{}, cute::Shape<cute::Int<kPooledN>, cute::Int<D>, cute::Int<kSinkStages>>{}));
  struct Smem {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Half, cute::cosize_v<SmemLayoutQp>, 1024> qp;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKm>, 1024> km;
    union {  // P^T's parts for the Q' projection of the prologue, the sink keys in pass 1, then the K' stages
      cute::array_aligned<Half, cute::cosize_v<SmemLayoutKp>, 1024> kp;
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutP>, 1024> p;
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutSink>, 1024> sink;
    } u;
    float pooled[kTileRows][kPooledN + 1];  // the current pooled chunk's scores (log2 units), rows by their warp
    float radius[2][kPooledN];              // the radii of each stage's pooled blocks
    float qnorm[kTileRows];                 // |Q'_r| of each packed row (log2 units, of its fp16 values)
    int candidates;                         // the tile's candidate blocks (the list's length)
    int nan_flag;
  };
  static_assert(cute::cosize_v<SmemLayoutP> * sizeof(Element) <= cute::cosize_v<SmemLayoutKp> * sizeof(Half),
                "P fits the K' stages");
  static_assert(kSinkStages >= 2 && cute::cosize_v<SmemLayoutSink> * sizeof(Element) <=
                                        cute::cosize_v<SmemLayoutKp> * sizeof(Half),
                "the sink chunks fit the K' stages");
  // after Smem: the tile's keep bits and candidate bits (a word per 32 blocks each), then the candidates and their
  // units (key rows / 64 of the sequence) as uint16
  static size_t smem_bytes(int64_t nb_max, int block_size) {
    const size_t words = size_t((nb_max + 31) / 32);
    return sizeof(Smem) + 2 * words * sizeof(uint32_t) +
           (words * 32 + size_t(nb_max) * (block_size / kUnitKeys)) * sizeof(uint16_t);
  }
};

// A warpgroup's OR of p (named barrier 1 + warpgroup, 128 threads: a vote of its 4 warps in one instruction).
__device__ __forceinline__ bool warpgroup_any(bool p) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(uint32_t(p)), "r"(1 + int(threadIdx.x / 128)));
  return r != 0;
}

// One CTA per (tile, virtual KV head). Writes the tile's keep bits (words [0, ceil(nvis / 32)) of its segment) of the
// blocks some row keeps by the per-row test (spec step 4); the last tiles (which keep everything) exit at once.
// Residual maxima only where they can matter: a block's residual maximum for row r is at most |Q'_r| times the block's
// radius (Cauchy-Schwarz, times kBoundMargin for the fp16 rounding of the residual GEMM), so a block whose pooled score
// plus that bound is below the row's threshold is neither kept nor raises the row's maximum (the threshold is below
// the maximum), for every row: its keys need not be scored. The tile's candidates are the blocks some row cannot rule
// out against its starting bound b_r (pass 2, CTA-wide: only their K' is loaded); each warpgroup scores a candidate
// only if one of its rows cannot rule it out against its running maximum (a vote per block). On the topic workload at
// 32K about 23 % of the visible blocks are candidates and 12 % are scored (emulated); the selection is the spec's.
template <typename T, int D, int R>
__global__ void __launch_bounds__(kKeyMaxThreads, 2) key_max_kernel(
    SeqArgs seq, QArgs qa, KVArgs kv, bool k_vec, SelectArgs sel, int group_size, int num_kv_heads, int subgroups,
    int kv_heads_mem, const int32_t* cu_tiles, const int32_t* cu_blocks, const lowp_t<T>* k_mean_lowp,
    const float* basis, const __half* proj, const float* radius, int64_t key_rows, uint32_t* bits_out,
    int64_t words_out) {
  using namespace cute;
  using Cfg = KeyMaxConfig<T, D, R>;
  using Element = typename Cfg::Element;
  using Half = typename Cfg::Half;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem_raw + sizeof(typename Cfg::Smem));
  uint32_t* cand_bits = bits + words_out;
  uint16_t* cand = reinterpret_cast<uint16_t*>(cand_bits + words_out);
  uint16_t* cand_units = cand + (words_out * 32);  // after room for nb_max candidates (words_out * 32 >= nb_max)

  const SelectTile st = select_tile(seq, cu_tiles);
  if (st.b < 0) return;
  const int kvh = st.kvh, b = st.b, kvh_mem = kvh / subgroups;
  const int64_t t = st.t, q_len = st.q_len, k_len = st.k_len, off = st.off;
  if (t >= st.tiles - sel.last_n) return;  // the last tiles keep every visible block (score_select's force)
  const int64_t nb = cu_blocks[b + 1] - cu_blocks[b];
  const int64_t rows = min(int64_t(kTileRows), q_len * group_size - t * kTileRows);
  const int64_t first_pos = t * kTileRows / group_size, last_pos = (t * kTileRows + rows - 1) / group_size;
  const int64_t hi_first = min(k_len - 1, first_pos + off), hi_last = min(k_len - 1, last_pos + off);
  const int B = sel.block_size;
  const int nvis = hi_last >= 0 ? int(hi_last / B + 1) : 0;
  const int64_t seg = int64_t(num_kv_heads) * cu_tiles[b] + kvh * st.tiles + t;
  const int words = (nvis + 31) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (nvis == 0) return;

  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sQp = make_tensor(make_smem_ptr(sm.qp.data()), typename Cfg::SmemLayoutQp{});
  Tensor sKm = make_tensor(make_smem_ptr(sm.km.data()), typename Cfg::SmemLayoutKm{});
  Tensor sKp = make_tensor(make_smem_ptr(sm.u.kp.data()), typename Cfg::SmemLayoutKp{});
  const auto smem_addr = [](const auto& e) { return static_cast<uint32_t>(__cvta_generic_to_shared(&e)); };

  for (int w = threadIdx.x; w < words; w += kKeyMaxThreads) bits[w] = cand_bits[w] = 0u;
  if (threadIdx.x == 0) sm.nan_flag = 0;

  // Prologue: Q (as score_select gathers it) and P^T, then Q' = P^T q * scale_log2 in fp16 and |Q'| per row, on the
  // tensor cores (64 x R x D per warpgroup, once per part of P). The same product in FFMA from shared memory was 15 %
  // of the scorer's instructions at 32K (ncu, H100, docs/design/selection.md). Parts: with two, 1.5 % of Q''s fp16
  // values round differently from the exact product's (bf16 q, CPU emulation), with three 0.04 % (the FFMA's 0.1 %).
  Tensor sP = make_tensor(make_smem_ptr(sm.u.p.data()), typename Cfg::SmemLayoutP{});
  gather_q_tile<T, D, kKeyMaxThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh,
                                is_fp8_v<T> ? qa.descale.at(b, kvh_mem) : 1.f);
  asm volatile("cp.async.commit_group;\n" ::);
  const float* p_global = basis + (int64_t(b) * kv_heads_mem + kvh_mem) * D * R;
  for (int i = threadIdx.x; i < D * R; i += kKeyMaxThreads) {  // P [D][R] float -> P^T's parts
    float x = p_global[i];
    CUTE_UNROLL
    for (int k = 0; k < Cfg::kPParts; ++k) {
      const Element part = Element(x);
      sP(i % R, i / R, k) = part;
      x -= float(part);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  cutlass::arch::fence_view_async_shared();  // Q (cp.async / generic stores) and P^T -> visible to wgmma
  __syncthreads();
  {
    typename Cfg::ProjMma qmma;
    auto wg_q = qmma.get_slice((threadIdx.x / 128) * 128);
    Tensor tQrQ = wg_q.partition_fragment_A(sQ);
    Tensor tQrP = wg_q.partition_fragment_B(sP);
    Tensor acc = partition_fragment_C(qmma, Shape<Int<kTileRows>, Int<R>>{});
    CUTE_UNROLL
    for (int k = 0; k < Cfg::kPParts; ++k) wgmma_batch<false>(qmma, tQrQ, tQrP(_, _, _, k), acc, /*zero_init=*/k == 0);
    warpgroup_wait<0>();
    Tensor cQ = qmma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<R>>{}));
    float n2[2] = {0.f, 0.f};  // value v is in the thread's row (v / 2) % 2 (the GMMA C layout, as below)
    CUTE_UNROLL
    for (int v = 0; v < size(acc); ++v) {
      const Half h = Half(acc(v) * sel.scale_log2);
      sQp(get<0>(cQ(v)), get<1>(cQ(v))) = h;
      n2[(v / 2) % 2] = fmaf(float(h), float(h), n2[(v / 2) % 2]);
    }
    for (int i = 0; i < 2; ++i) {  // the row's R values are spread over the quad's four threads
      n2[i] += __shfl_xor_sync(0xffffffffu, n2[i], 1);
      n2[i] += __shfl_xor_sync(0xffffffffu, n2[i], 2);
      if (lane % 4 == 0) sm.qnorm[get<0>(cQ(2 * i))] = sqrtf(n2[i]);
    }
  }
  cutlass::arch::fence_view_async_shared();  // Q' stores (generic proxy) -> visible to wgmma
  __syncthreads();  // Q' written; P no longer read (its room becomes the K' stages)

  typename Cfg::PooledMma pmma;
  typename Cfg::ResidMma rmma;
  auto wg_p = pmma.get_slice((threadIdx.x / 128) * 128);
  auto wg_r = rmma.get_slice((threadIdx.x / 128) * 128);
  Tensor tPrQ = wg_p.partition_fragment_A(sQ);
  Tensor tPrK = wg_p.partition_fragment_B(sKm);
  Tensor tPrS = partition_fragment_C(pmma, Shape<Int<kTileRows>, Int<kPooledN>>{});
  Tensor cP = pmma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kPooledN>>{}));
  Tensor tRrQ = wg_r.partition_fragment_A(sQp);
  Tensor tRrK = wg_r.partition_fragment_B(sKp);
  Tensor cR = rmma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kUnitKeys>>{}));
  static_assert(decltype(size(cR))::value == 32, "fp16 accumulators: 16 registers of (row pair, 2 columns)");

  // This thread's two packed rows (the accumulators' rows 0 and 8 of its quad; the same in both GEMMs): the last key
  // each sees (-1: none), the last block, |Q'| times the bound's margin.
  // Value v of either accumulator is in row (v / 2) % 2 of these (the GMMA C layout: v % 2 next column, (v / 2) % 2
  // row + 8, v / 4 column + 8).
  int row_of[2], hi_row[2], last_block[2], whole_last[2];
  float qn[2];
  for (int i = 0; i < 2; ++i) {
    row_of[i] = get<0>(cR(2 * i));  // value 2i: register i, row i of the thread (PTX fp16 accumulator layout)
    const RowLimits lim = row_limits(row_of[i], rows, t, group_size, off, k_len, nb, B);
    hi_row[i] = lim.hi, last_block[i] = lim.last_block, whole_last[i] = lim.whole_last;
    qn[i] = sm.qnorm[row_of[i]] * kBoundMargin;
  }
  const int tile_min_hi = rows == kTileRows ? int(hi_first) : -1;  // keys <= it: seen by every row of the tile

  // Pooled chunk c: 32 blocks (block_of(n), n < 32) into stage `buf` of sKm with their radii (one cp.async group,
  // waited at the next stage barrier); pooled_gemm: the chunk's scores into tPrS.
  // A thread's 16-byte chunks (block n of the chunk, part v) are the same in every chunk it loads: their shared
  // addresses in stage 0 are computed once, stage 1 is stage 0 moved by whole swizzle periods. Through the swizzled
  // layout at every load (64-bit block indices, the generic loop) a pass ran 337 instructions per chunk before its
  // GEMM, now 67 (SASS, bf16 D 128).
  const Element* pooled_src =
      reinterpret_cast<const Element*>(k_mean_lowp) + (int64_t(cu_blocks[b]) * kv_heads_mem + kvh_mem) * D;
  const float* radius_src = radius + int64_t(kvh_mem) * (key_rows / B) + cu_blocks[b];
  constexpr int kMeanVec = D / 8;                                            // 16-byte chunks per pooled mean
  constexpr int kMeanLoads = kPooledN * kMeanVec / kKeyMaxThreads;           // per thread and chunk
  static_assert(kPooledN * kMeanVec % kKeyMaxThreads == 0, "whole 16-byte chunks per thread");
  static_assert(kPooledN * D % 1024 == 0, "a pooled stage is whole swizzle periods: stage 1 = stage 0 + its bytes");
  constexpr uint32_t kMeanStageBytes = kPooledN * D * sizeof(Element);
  uint32_t km_mine[kMeanLoads];
  CUTE_UNROLL
  for (int k = 0; k < kMeanLoads; ++k) {
    const int i = threadIdx.x + k * kKeyMaxThreads;
    km_mine[k] = smem_addr(sKm(i / kMeanVec, (i % kMeanVec) * 8, 0));
  }
  auto load_pooled = [&](auto block_of, int buf) {
    CUTE_UNROLL
    for (int k = 0; k < kMeanLoads; ++k) {
      const int i = threadIdx.x + k * kKeyMaxThreads;
      const Element* src = pooled_src + int64_t(block_of(i / kMeanVec)) * (kv_heads_mem * D) + (i % kMeanVec) * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(km_mine[k] + buf * kMeanStageBytes),
                   "l"(src));
    }
    if (threadIdx.x < kPooledN) {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(sm.radius[buf][threadIdx.x])),
                   "l"(radius_src + block_of(threadIdx.x)));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  const int last_J = int(nb - 1);
  auto range_chunk = [&](int c) {  // blocks [32 c, 32 c + 32), rows past the sequence clamped to its last block
    return [=](int n) { return min(c * kPooledN + n, last_J); };
  };
  auto pooled_gemm = [&](int buf) {
    wgmma_batch<false>(pmma, tPrQ, tPrK(_, _, _, buf), tPrS, /*zero_init=*/true);
    warpgroup_wait<0>();
  };
  auto stage_barrier = [] { cp_async_stage_barrier(); };
  const float log2_alpha = log2f(sel.alpha);  // alpha 0: -inf, every visible block

  // The sink keys, the bound's other term: keys [0, sink_end), those of the always-kept sink blocks, as the pooled
  // GEMM's operand (bf16 / fp16 as they are, e4m3 exactly in bf16: their scores times the descale), zeros past the
  // sink and on a bad page; aligned bf16 / fp16 rows by cp.async, e4m3 or unaligned rows by loads and shared stores.
  // In batches of Cfg::kSinkStages 32-key chunks in the K' stages' room: a batch's loads are issued together and
  // waited once, then its GEMMs. One chunk at a time through the pooled stages (8 dependent loads a tile) cost
  // +14.6 % of the index at 32K, +6.9 % at 128K (H100).
  float m_row[2] = {-INFINITY, -INFINITY}, threshold[2];  // the rows' running maxima (log2 units), their tests
  const int64_t sink_end = min(k_len, geometry::num_blocks(sel.sink, B) * B);
  const int sink_chunks = int((sink_end + kPooledN - 1) / kPooledN);
  const float sink_scale = sel.scale_log2 * (is_fp8_v<T> ? kv.k_descale.at(b, kvh_mem) : 1.f);
  const T* k_src = static_cast<const T*>(kv.k);
  const int64_t k_start = seq.k_start(b);
  Tensor sSink = make_tensor(make_smem_ptr(sm.u.sink.data()), typename Cfg::SmemLayoutSink{});
  Tensor tPrSink = wg_p.partition_fragment_B(sSink);
  // a sink slot is laid out as a pooled stage (the same atom and 32 x D shape, whole swizzle periods): this thread's
  // addresses are its pooled ones moved to the sink's room
  const uint32_t sink_from_km = smem_addr(sSink(0, 0, 0)) - smem_addr(sKm(0, 0, 0));
  auto load_sink = [&](int c, int slot) {
    CUTE_UNROLL
    for (int k = 0; k < kMeanLoads; ++k) {  // the pooled loads' (key, 16-byte part) of this thread
      const int i = threadIdx.x + k * kKeyMaxThreads;
      const int64_t j = int64_t(c) * kPooledN + i / kMeanVec;
      load_key_part<T, Element>(kv, k_src, b, k_start, kvh_mem, j, j < sink_end, i % kMeanVec, k_vec,
                                km_mine[k] + sink_from_km + slot * kMeanStageBytes);
    }
  };
  auto sink_max = [&](const auto& acc, int c) {  // chunk c's scores: keys c * 32 + col
    CUTE_UNROLL
    for (int v = 0; v < size(acc); ++v) {
      const int i = (v / 2) % 2, j = c * kPooledN + get<1>(cP(v));
      m_row[i] = j < sink_end && j <= hi_row[i] ? fmaxf(m_row[i], acc(v) * sink_scale) : m_row[i];
    }
  };
  for (int c0 = 0; c0 < sink_chunks; c0 += Cfg::kSinkStages) {
    const int n = min(Cfg::kSinkStages, sink_chunks - c0);
    for (int u = 0; u < n; ++u) load_sink(c0 + u, u);
    stage_barrier();  // the batch landed and is visible to wgmma
    for (int u = 0; u < n; ++u) {
      wgmma_batch<false>(pmma, tPrQ, tPrSink(_, _, _, u), tPrS, /*zero_init=*/true);
      warpgroup_wait<0>();
      sink_max(tPrS, c0 + u);
    }
    __syncthreads();  // both warpgroups past the batch's GEMMs before the next batch (or pass 3's K') is loaded
  }

  // Pass 1, the bound: b_r = the larger of the sink keys' maximum (above) and the row's pooled scores' over the blocks
  // it sees whole (log2 units). The chunks stream through the two stages (chunk c + 1 loads under chunk c's GEMM).
  // Pass 2, the candidates: the blocks J some row sees and cannot rule out, pooled + |Q'_r| radius_J >= b_r +
  // log2(alpha) (NaN: a candidate). It walks the chunks backwards from pass 1's last, whose scores tPrS still holds:
  // that chunk needs no second load, barrier or GEMM, and pass 2's next chunk loads under pass 1's last GEMM (chunk c
  // is in stage c % 2 in both passes).
  // Each pass's tests compiled apart (kPass a constant): predicated, not branches around the radius's load (a branch
  // per value in pass 2 when the two passes shared one loop body).
  const int nchunks = (nvis + kPooledN - 1) / kPooledN;
  auto pooled_tests = [&](auto pass, int c) {  // chunk c's scores, in tPrS
    constexpr int kPass = decltype(pass)::value;
    uint32_t mask = 0;
    CUTE_UNROLL
    for (int v = 0; v < size(tPrS); ++v) {
      const int i = (v / 2) % 2, col = get<1>(cP(v)), J = c * kPooledN + col;
      const float s = tPrS(v) * sel.scale_log2;
      if constexpr (kPass == 0) {
        m_row[i] = J <= whole_last[i] ? fmaxf(m_row[i], s) : m_row[i];
      } else {
        const bool cand = (J <= last_block[i]) & !(fmaf(qn[i], sm.radius[c & 1][col], s) < threshold[i]);
        mask |= uint32_t(cand) << col;
      }
    }
    if constexpr (kPass == 1) {
      mask = __reduce_or_sync(0xffffffffu, mask);
      if (lane == 0 && mask) atomicOr(&cand_bits[c], mask);
    }
  };
  load_pooled(range_chunk(0), 0);
  for (int c = 0; c < nchunks; ++c) {
    stage_barrier();  // chunk c landed; chunk c - 1's GEMM (the other stage) finished in both warpgroups
    const int next = c + 1 < nchunks ? c + 1 : c - 1;  // pass 1's next chunk, then pass 2's second
    if (next >= 0) load_pooled(range_chunk(next), next & 1);
    pooled_gemm(c & 1);
    pooled_tests(std::integral_constant<int, 0>{}, c);
  }
  for (int i = 0; i < 2; ++i) {
    m_row[i] = fmaxf(m_row[i], __shfl_xor_sync(0xffffffffu, m_row[i], 1));
    m_row[i] = fmaxf(m_row[i], __shfl_xor_sync(0xffffffffu, m_row[i], 2));
    threshold[i] = m_row[i] + log2_alpha;
  }
  if (nchunks > 0) pooled_tests(std::integral_constant<int, 1>{}, nchunks - 1);
  for (int c = nchunks - 2; c >= 0; --c) {
    stage_barrier();  // chunk c landed; chunk c + 1's GEMM finished in both warpgroups
    if (c > 0) load_pooled(range_chunk(c - 1), (c - 1) & 1);
    pooled_gemm(c & 1);
    pooled_tests(std::integral_constant<int, 1>{}, c);
  }
  __syncthreads();  // both warpgroups past pass 2's last GEMM and candidate bits before the stages are reloaded

  // The candidates as a list, from the diagonal down.
  if (warp == 0) {
    const int n = list_candidates(cand_bits, words, cand, lane);
    if (lane == 0) sm.candidates = n;
  }
  __syncthreads();
  const int ncand = sm.candidates;
  // the units' scoring order as key rows / 64 (the K' loads' addresses without a division each)
  const int upb = B / kUnitKeys;
  const int units = ncand * upb, nstages = (units + kStageUnits - 1) / kStageUnits;
  list_units<kKeyMaxThreads>(cand, units, upb, cand_units);
  __syncthreads();

  // Pass 3, the residual maxima of the candidates, unit by unit (64 keys) in cand_units' order. Stages of 8 units; a
  // pooled chunk (32 candidates = 32 * upb units) starts at a stage boundary, so its scores are set at the top of the
  // stage that first needs them.
  const Half* proj_src =
      reinterpret_cast<const Half*>(proj) + (int64_t(kvh_mem) * key_rows + int64_t(cu_blocks[b]) * B) * R;
  // A thread's 16-byte chunk (key row, part) is the same in every unit it loads: its shared address in slot 0 and its
  // element offset in a unit of K' are computed once, a load adds the slot's and the unit's bases (a slot is whole
  // swizzle periods, so slot s is slot 0 moved by s units). The per-load index arithmetic (two divisions and the
  // swizzle per 16 bytes) was 16 % of the scorer's instructions at 32K (ncu, H100, docs/design/selection.md); the
  // scorer then took 1.636 -> 1.495 ms at 32K and 18.58 -> 16.77 ms at 128K (H100, the same selection bit for bit).
  constexpr int kVec = R / 8;                                            // 16-byte chunks per key row
  constexpr int kUnitsPerPass = kKeyMaxThreads / (kVec * kUnitKeys);    // units one pass of the CTA loads
  constexpr uint32_t kUnitBytes = kUnitKeys * R * sizeof(Half);
  static_assert(kKeyMaxThreads % (kVec * kUnitKeys) == 0 && kStageUnits % kUnitsPerPass == 0, "whole units per pass");
  static_assert(kUnitBytes % 1024 == 0, "a K' slot is whole swizzle periods: slot s = slot 0 + s * kUnitBytes");
  const int my_part = threadIdx.x % kVec, my_key = (threadIdx.x / kVec) % kUnitKeys;
  const int my_unit = threadIdx.x / (kVec * kUnitKeys);
  const uint32_t kp_mine = smem_addr(sKp(my_key, my_part * 8, 0));
  const int proj_mine = my_key * R + my_part * 8;
  auto load_stage = [&](int s, int buf) {
#pragma unroll
    for (int pass = 0; pass < kStageUnits / kUnitsPerPass; ++pass) {
      const int u = pass * kUnitsPerPass + my_unit, n = s * kStageUnits + u;
      if (n < units) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(kp_mine +
                                                                          uint32_t(buf * kStageUnits + u) * kUnitBytes),
                     "l"(proj_src + int(cand_units[n]) * (kUnitKeys * R) + proj_mine));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  auto list_chunk = [&](int c) {  // candidates [32 c, 32 c + 32), past the list clamped to its last
    return [=](int n) { return int(cand[min(c * kPooledN + n, ncand - 1)]); };
  };

  const __half2 neg2 = __halves2half2(__ushort_as_half(0xFC00u), __ushort_as_half(0xFC00u));
  __half2 run2[2] = {neg2, neg2};  // the current block's residual maxima so far, per row (pairs of columns)
  int rbuf = 0;                    // the stage of sm.radius holding the current chunk's radii

  // Does this warpgroup score candidate ci: some row sees it and cannot rule it out against its running maximum.
  auto wanted = [&](int ci) {
    const int J = cand[ci], col = ci % kPooledN;
    bool want = false;
    for (int i = 0; i < 2; ++i)
      want |= J <= last_block[i] &&
              !(sm.pooled[row_of[i]][col] + qn[i] * sm.radius[rbuf][col] < m_row[i] + log2_alpha);
    return warpgroup_any(want);
  };
  // Unit (ci, sub) scored in acc: mask, running maximum; at the block's last unit (sub 0) the score, the running row
  // maximum and the per-row test.
  auto consume = [&](auto& acc, int ci, int sub) {
    const int J = cand[ci];
    const int key0 = J * B + sub * kUnitKeys;
    if (key0 + kUnitKeys - 1 > tile_min_hi) {  // some key of the unit is past some row's last key
      CUTE_UNROLL
      for (int v = 0; v < size(acc); ++v) {
        if (key0 + get<1>(cR(v)) > hi_row[(v / 2) % 2]) acc(v) = Half(-INFINITY);
      }
    }
    const __half2* acc2 = reinterpret_cast<const __half2*>(acc.data());
    CUTE_UNROLL
    for (int k = 0; k < 16; k += 2) {
      run2[0] = __hmax2_nan(run2[0], acc2[k]);
      run2[1] = __hmax2_nan(run2[1], acc2[k + 1]);
    }
    if (sub != 0) return;
    // (row 0, row 1) maxima packed, reduced over the quad's four threads in two shuffles
    __half2 res2 = __hmax2_nan(__lows2half2(run2[0], run2[1]), __highs2half2(run2[0], run2[1]));
    res2 = __hmax2_nan(res2, __shfl_xor_sync(0xffffffffu, res2, 1));
    res2 = __hmax2_nan(res2, __shfl_xor_sync(0xffffffffu, res2, 2));
    run2[0] = run2[1] = neg2;
    bool keep = false;
    const int col = ci % kPooledN;
    for (int i = 0; i < 2; ++i) {
      if (J > last_block[i]) continue;
      const float sh = sm.pooled[row_of[i]][col] + (i == 0 ? __low2float(res2) : __high2float(res2));
      if (sh != sh) sm.nan_flag = 1;  // a NaN key or query reached the scores
      m_row[i] = fmaxf(m_row[i], sh);
      keep |= sh >= m_row[i] + log2_alpha;
    }
    if (__any_sync(0xffffffffu, keep) && lane == 0) atomicOr(&bits[J / 32], 1u << (J % 32));
  };

  int cur_chunk = -1, pbuf = 0;
  if (units > 0) {
    load_stage(0, 0);
    load_pooled(list_chunk(0), pbuf);
  }
  Tensor accA = partition_fragment_C(rmma, Shape<Int<kTileRows>, Int<kUnitKeys>>{});
  Tensor accB = partition_fragment_C(rmma, Shape<Int<kTileRows>, Int<kUnitKeys>>{});
  bool block_take = false;  // the current candidate's vote (its units are scored or skipped together)
  for (int s = 0; s < nstages; ++s) {
    const int buf = s & 1;
    stage_barrier();  // stage s and any pooled chunk issued before it landed; the other stage's readers done
    if (s + 1 < nstages) load_stage(s + 1, buf ^ 1);
    const int chunk = s * kStageUnits / (kPooledN * upb);
    if (chunk != cur_chunk) {
      pooled_gemm(pbuf);
      CUTE_UNROLL
      for (int v = 0; v < size(tPrS); ++v) sm.pooled[get<0>(cP(v))][get<1>(cP(v))] = tPrS(v) * sel.scale_log2;
      __syncwarp();  // a row's pooled scores are written and read by its own warp
      cur_chunk = chunk;
      rbuf = pbuf;
      pbuf ^= 1;
      if ((chunk + 1) * kPooledN < ncand) load_pooled(list_chunk(chunk + 1), pbuf);  // lands by a later barrier
    }
    const int slot0 = buf * kStageUnits;
    // units n = s * 8 + uu: unit uu + 1's wgmma runs while unit uu is reduced (two accumulators). Every slot's wgmma
    // is issued (a wgmma under a vote's branch is serialized by ptxas, C7518); the votes skip the maxima, the ALU work.
    int ci = s * kStageUnits / upb, sub = upb - 1 - s * kStageUnits % upb;
    wgmma_batch<false>(rmma, tRrQ, tRrK(_, _, _, slot0), accA, /*zero_init=*/true);
    CUTE_UNROLL
    for (int uu = 0; uu < kStageUnits; ++uu) {
      auto& cur = (uu & 1) ? accB : accA;
      auto& nxt = (uu & 1) ? accA : accB;
      if (uu + 1 < kStageUnits) {
        wgmma_batch<false>(rmma, tRrQ, tRrK(_, _, _, slot0 + uu + 1), nxt, /*zero_init=*/true);
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
      }
      if (s * kStageUnits + uu < units) {
        if (sub == upb - 1) block_take = wanted(ci);  // the vote at a candidate's first unit; its units follow it
        if (block_take) consume(cur, ci, sub);
      }
      if (sub == 0) {
        ++ci;
        sub = upb - 1;
      } else {
        --sub;
      }
    }
  }
  __syncthreads();
  uint32_t* out = bits_out + seg * words_out;
  const bool all = sm.nan_flag != 0;  // a NaN score keeps every visible block of the tile
  for (int w = threadIdx.x; w < words; w += kKeyMaxThreads) out[w] = all ? 0xffffffffu : bits[w];
}

template <typename T, int D, int R>
size_t key_max_smem_limit() {
  // two ~100 KB CTAs per SM at rank 16: one's wgmma under the other's maxima
  static const size_t limit = opt_in_all_shared_memory(key_max_kernel<T, D, R>, "cudaFuncSetAttribute(key_max_kernel)");
  return limit;
}

// The scorer's limits checked before anything is enqueued, then key_basis.cu's kernels (rank R) and the scorer.
template <typename T, int D, int R>
void launch_all(cudaStream_t stream, const Problem& p, const Bounds& bd, const VirtualHeads& heads,
                const SeqArgs& seq, const QArgs& qa, const KVArgs& kv, const SelectArgs& sel, const DeviceIndex& d) {
  const int B = sel.block_size;
  // the lists hold block and unit indices as uint16: <= 65535 units (check_index_supported)
  const size_t dyn = KeyMaxConfig<T, D, R>::smem_bytes(bd.nb_max, B);
  if (dyn > key_max_smem_limit<T, D, R>()) {
    throw NotImplementedError("build_index on CUDA, rule key_max: " + std::to_string(bd.nb_max) +
                              " blocks per sequence exceed the scorer's shared memory (max_seqlen_k too long)");
  }
  const bool k_vec = rows_vec8(kv.k, kv.k_stride, kv.block_table != nullptr);  // the sink keys' 16-byte loads
  launch_key_basis(stream, p, R, bd, seq, kv, B, d);
  key_max_kernel<T, D, R><<<dim3(unsigned(bd.max_tiles), unsigned(heads.kv)), kKeyMaxThreads, dyn, stream>>>(
      seq, qa, kv, k_vec, sel, heads.group, heads.kv, heads.num_subgroups, p.num_kv_heads, d.cu_tiles, d.cu_blocks,
      static_cast<const lowp_t<T>*>(d.k_mean_lowp), d.key_basis, static_cast<const __half*>(d.key_proj), d.key_radius,
      d.key_rows, d.probe_bits, d.probe_words);
}

}  // namespace

void launch_key_max(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                    const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                    const SelectArgs& sel, const DeviceIndex& d) {
  if (bd.max_tiles <= 0) return;
  auto launch = [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int kD = decltype(dim)::value;
    if (params.key_rank == 32) {
      launch_all<T, kD, 32>(stream, p, bd, heads, seq, qa, kv, sel, d);
    } else {
      launch_all<T, kD, 16>(stream, p, bd, heads, seq, qa, kv, sel, d);
    }
  };
  with_index_types(p.dtype, p.head_dim, launch);
  check_cuda(cudaGetLastError(), "key_max kernels launch");
}

}  // namespace sparse_prefill::cuda::index_stage
