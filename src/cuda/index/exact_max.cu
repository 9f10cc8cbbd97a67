// Index stage, the exact_max rule (SelectionRule::kExactMax, docs/design/exact_max_spec.md): two stages in one kernel
// per (tile, virtual KV head), on tensor cores, after the pooling, no host synchronisation.
//   Stage 1, the candidates: kRowMax at candidate_alpha over the pooled means (the default rule's index), less the
//   always-kept blocks, plus the blocks not fully visible to the tile (spec step 2); and each row's maximum pooled
//   score over the blocks it sees whole, the bound's first term.
//   Stage 2, the block maxima on e4m3 operands (spec step 3): the keys in units of 64, rounded to e4m3 with a scale
//   per unit by a pre-pass (exact_keys_kernel, once per call into the workspace), Q rounded per row in shared memory;
//   S = Q K^T on FP8 wgmma (float accumulators). First the sink keys' units: their maxima complete the bound (spec
//   step 4). Then the candidates' from the diagonal down: per row the block's maximum e_rJ (times the row's and the
//   unit's scales), the running maximum m_r (started at the bound), the per-row test e_rJ >= m_r + log2(alpha), a
//   warp vote per block.
// The tile's keep bits go to d.probe_bits, which score_select's bits-only kernel merges with the always-kept rules into
// the CSR (as key_max's). Scores are in log2 units (scale_log2; FP8 inputs: the units carry the k descale in their
// scales).
// It is key_max.cu's scorer without the projection: the same Q gather and pooled passes (not its sink batches: the
// sink keys are units here); where key_max scores K' units (64 x r fp16, 2 KB) behind a bound, this scores K itself
// (64 x D e4m3, 8 KB at D 128) for every candidate, so it keeps its own shared memory plan (below) rather than being
// a mode of key_max.
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_fp8.h>
#include <cutlass/arch/barrier.h>  // stage 2's bulk copies: mbarriers

#include "cuda/attention/config.h"  // CuTe / CUTLASS: GMMA atoms, swizzled K-major smem atoms, proxy fence
#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/common/wgmma.h"
#include "cuda/index/device_args.cuh"
#include "cuda/index/per_key.cuh"
#include "cuda/index/q_gather.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

constexpr int kExactThreads = 256;  // 2 warpgroups x 64 packed rows
static_assert(kTileRows == 2 * 64, "the scorer's tile is two warpgroups' m64 GEMM rows");
constexpr int kUnitKeys = kExactUnitKeys;  // keys per exact wgmma (N): any block_size % 64 == 0 is whole units
// Stage 2's ring: kStages stages of kStageUnits e4m3 units (8 KB each at D 128): 64 KB, the room the bf16 units'
// two stages of two took. The wait for a stage's units was the top stall with two stages (ncu at 32K, 43ef6ad).
constexpr int kStageUnits = 2;
constexpr int kStages = 4;
// Pooled blocks per pooled wgmma (N): 64, half the chunks (each a CTA barrier, a cp.async round trip and a GEMM's
// wait) of 32, which the sink batches' share of the room had set; the accumulators (32 a thread) are stage 2's.
constexpr int kPooledN = 64;

template <typename T, int D>
struct ExactMaxConfig {
  // the pooled GEMMs' operands: q's dtype (bf16 for FP8 inputs: q dequantised on the way in); stage 2's: e4m3
  // (Element8)
  using Element = std::conditional_t<std::is_same_v<T, __half>, cutlass::half_t, cutlass::bfloat16_t>;
  using Element8 = cutlass::float_e4m3_t;
  template <class E, int kN>
  using Mma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E, E, float, cute::Shape<cute::Int<kTileRows>, cute::Int<kN>, cute::Int<D>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using PooledMma = Mma<Element, kPooledN>;
  using ExactMma = Mma<Element8, kUnitKeys>;
  template <class E, int kRows>
  using Atom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, E,
                                                                            cute::Int<kRows>, cute::Int<D>>());
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(Atom<Element, kTileRows>{}, cute::Shape<cute::Int<kTileRows>, cute::Int<D>>{}));
  using SmemLayoutQ8 =  // stage 2's Q, in the bf16 tile's room (its GEMMs are done by then)
      decltype(cute::tile_to_shape(Atom<Element8, kTileRows>{}, cute::Shape<cute::Int<kTileRows>, cute::Int<D>>{}));
  using SmemLayoutKm =  // two stages: chunk c + 1's means load while chunk c is scored
      decltype(cute::tile_to_shape(Atom<Element, kPooledN>{},
                                   cute::Shape<cute::Int<kPooledN>, cute::Int<D>, cute::_2>{}));
  using SmemLayoutK8 =  // e4m3 K units: slot = stage * kStageUnits + unit of the stage
      decltype(cute::tile_to_shape(Atom<Element8, kUnitKeys>{},
                                   cute::Shape<cute::Int<kUnitKeys>, cute::Int<D>, cute::Int<kStages * kStageUnits>>{}));
  // One unit's layout: the pre-pass writes each unit in this (swizzled) order, so that one bulk copy lands it.
  using SmemLayoutUnit8 = decltype(cute::take<0, 2>(SmemLayoutK8{}));
  static constexpr int kUnitBytes = kUnitKeys * D;  // e4m3
  static constexpr int kRoomBytes = int(cute::cosize_v<SmemLayoutK8>);
  struct Smem {
    union {  // the bf16 tile (the pooled GEMMs), then the e4m3 tile (stage 2)
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
      cute::array_aligned<Element8, cute::cosize_v<SmemLayoutQ8>, 1024> q8;
    } t;
    union {  // in turn: the pooled means (stage 1), the K units (stage 2)
      cute::array_aligned<Element8, cute::cosize_v<SmemLayoutK8>, 1024> k8;
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutKm>, 1024> km;
    } u;
    uint64_t unit_full[kStages];   // stage buf's units landed (transaction bytes)
    uint64_t unit_empty[kStages];  // every warp past its GEMMs on stage buf (one arrival a warp)
    float q_scale[kTileRows];      // each packed row's e4m3 scale (amax / 448)
    int candidates;                // the tile's candidate blocks (the list's length)
    int nan_flag;
  };
  static_assert(cute::cosize_v<SmemLayoutKm> * sizeof(Element) <= kRoomBytes, "the pooled stages fit the units' room");
  static_assert(cute::cosize_v<SmemLayoutQ8> <= cute::cosize_v<SmemLayoutQ> * sizeof(Element),
                "the e4m3 tile fits the bf16 tile's room");
  // After Smem: the tile's keep bits and candidate bits (a word per 32 blocks each), then the candidates and the
  // units stage 2 scores (the sink's, then the candidates'; key rows / 64 of the sequence) as uint16. ~98 KB at D 128
  // and 32K keys: two CTAs per SM.
  static size_t smem_bytes(int64_t nb_max, int block_size, int64_t sink_units) {
    const size_t words = size_t((nb_max + 31) / 32);
    return sizeof(Smem) + 2 * words * sizeof(uint32_t) +
           (words * 32 + size_t(sink_units) + size_t(nb_max) * (block_size / kUnitKeys)) * sizeof(uint16_t);
  }
};

// Spec step 3's rounding, shared by the pre-pass (keys) and the scorer (Q): a group whose largest magnitude is amax
// is multiplied by e4m3_inv(amax) (0 when amax is 0) and rounded to e4m3 (nearest even, saturated); its scale is
// amax / 448. IEEE divisions, as the CPU reference's float32 arithmetic.
__device__ __forceinline__ float e4m3_inv(float amax) { return amax > 0.f ? __fdiv_rn(448.f, amax) : 0.f; }
__device__ __forceinline__ float e4m3_scale(float amax) { return __fdiv_rn(amax, 448.f); }
// 16 values times inv as 16 e4m3 bytes, in order.
__device__ __forceinline__ uint4 to_e4m3x16(const float (&x)[16], float inv) {
  union {
    uint4 u;
    __nv_fp8x2_storage_t p[8];
  } out;
  CUTE_UNROLL
  for (int e = 0; e < 8; ++e)
    out.p[e] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * e] * inv, x[2 * e + 1] * inv), __NV_SATFINITE, __NV_E4M3);
  return out.u;
}

// The pre-pass (exact_max_spec.md step 3): one CTA per (unit of 64 key rows of the pooled blocks, KV head); the keys
// in real units (FP8: times the k descale; zeros past the sequence and on a bad page), scaled so that the unit's
// largest magnitude is 448 (float32: inv = 448 / amax, 0 when amax is 0), rounded to e4m3 (nearest even, saturated),
// written in the swizzled order of the scorer's shared-memory slot (SmemLayoutUnit8), and the unit's scale amax / 448.
// Thread x takes key x / 4 and its 16-element parts x % 4, x % 4 + 4, ... (16-byte stores).
constexpr int kKeyThreads = 256;
template <typename T, int D>
__global__ void __launch_bounds__(kKeyThreads) exact_keys_kernel(SeqArgs seq, KVArgs kv, bool k_vec,
                                                                 const int32_t* cu_blocks, int upb,
                                                                 int64_t units_total, uint8_t* keys8,
                                                                 float* scales) {
  using Cfg = ExactMaxConfig<T, D>;
  using Element = typename Cfg::Element;
  constexpr int kThreadsPerKey = kKeyThreads / kUnitKeys, kParts = D / 16 / kThreadsPerKey;
  static_assert(kKeyThreads % kUnitKeys == 0 && (D / 16) % kThreadsPerKey == 0, "whole 16-element parts");
  __shared__ float warp_amax[kKeyThreads / 32];
  const int64_t U = blockIdx.x;  // unit of the pooled rows' keys: cu_blocks[b] * upb + unit of sequence b
  const int h = blockIdx.y;
  if (U >= int64_t(cu_blocks[seq.batch]) * upb) return;
  const int b = find_sequence(cu_blocks, seq.batch, U / upb);
  const int key = threadIdx.x / kThreadsPerKey, part0 = threadIdx.x % kThreadsPerKey;
  const int64_t j = (U - int64_t(cu_blocks[b]) * upb) * kUnitKeys + key;
  const float descale = is_fp8_v<T> ? kv.k_descale.at(b, h) : 1.f;
  bool ok;
  const T* row = key_row(kv, static_cast<const T*>(kv.k), b, seq.k_start(b), h, j, j < seq.k_len(b), ok);
  float x[kParts][16];
  float amax = 0.f;  // fmaxf: a NaN is not a magnitude
  CUTE_UNROLL
  for (int i = 0; i < kParts; ++i) {
    const int c = (i * kThreadsPerKey + part0) * 16;
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      union {
        uint4 u;
        Element e[8];
      } v;
      v.u = ok ? load_key8<T, Element>(row + c + 8 * half, k_vec) : make_uint4(0u, 0u, 0u, 0u);
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        x[i][8 * half + e] = float(v.e[e]) * descale;
        amax = fmaxf(amax, fabsf(x[i][8 * half + e]));
      }
    }
  }
  for (int o = 16; o >= 1; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  CUTE_UNROLL
  for (int w = 0; w < kKeyThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  const float inv = e4m3_inv(amax);
  uint8_t* unit = keys8 + (int64_t(h) * units_total + U) * Cfg::kUnitBytes;
  CUTE_UNROLL
  for (int i = 0; i < kParts; ++i) {
    const int c = (i * kThreadsPerKey + part0) * 16;
    *reinterpret_cast<uint4*>(unit + typename Cfg::SmemLayoutUnit8{}(key, c)) = to_e4m3x16(x[i], inv);
  }
  if (threadIdx.x == 0) scales[int64_t(h) * units_total + U] = e4m3_scale(amax);
}

// One CTA per (tile, virtual KV head). Writes the tile's keep bits (words [0, ceil(nvis / 32)) of its segment) of the
// candidate blocks some row keeps by the per-row test (spec step 4), every bit when a score is NaN; the last tiles
// (which keep everything) exit at once.
template <typename T, int D>
__global__ void __launch_bounds__(kExactThreads, 2) exact_max_kernel(
    SeqArgs seq, QArgs qa, SelectArgs sel, float log2_candidate_alpha, int group_size,
    int num_kv_heads, int subgroups, int kv_heads_mem, const int32_t* cu_tiles, const int32_t* cu_blocks,
    const lowp_t<T>* k_mean_lowp, const uint8_t* keys8, const float* key_scales, int64_t units_total,
    uint32_t* bits_out, int64_t words_out) {
  using namespace cute;
  using Cfg = ExactMaxConfig<T, D>;
  using Element = typename Cfg::Element;
  using Element8 = typename Cfg::Element8;
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

  Tensor sQ = make_tensor(make_smem_ptr(sm.t.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sQ8 = make_tensor(make_smem_ptr(sm.t.q8.data()), typename Cfg::SmemLayoutQ8{});
  Tensor sKm = make_tensor(make_smem_ptr(sm.u.km.data()), typename Cfg::SmemLayoutKm{});
  Tensor sK8 = make_tensor(make_smem_ptr(sm.u.k8.data()), typename Cfg::SmemLayoutK8{});
  const auto smem_addr = [](const auto& e) { return static_cast<uint32_t>(__cvta_generic_to_shared(&e)); };

  for (int w = threadIdx.x; w < words; w += kExactThreads) bits[w] = cand_bits[w] = 0u;
  if (threadIdx.x == 0) {
    sm.nan_flag = 0;
    for (int i = 0; i < kStages; ++i) {  // stage 2's; visible after the barriers below
      cutlass::arch::ClusterTransactionBarrier::init(&sm.unit_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&sm.unit_empty[i], kExactThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }

  // Q as score_select gathers it, in flight with the first pooled chunk (the first stage barrier waits for both).
  gather_q_tile<T, D, kExactThreads>(qa, sQ, seq.q_start(b), t, rows, group_size, kvh,
                                is_fp8_v<T> ? qa.descale.at(b, kvh_mem) : 1.f);
  asm volatile("cp.async.commit_group;\n" ::);

  typename Cfg::PooledMma pmma;
  typename Cfg::ExactMma emma;
  auto wg_p = pmma.get_slice((threadIdx.x / 128) * 128);
  auto wg_e = emma.get_slice((threadIdx.x / 128) * 128);
  Tensor tPrQ = wg_p.partition_fragment_A(sQ);
  Tensor tPrK = wg_p.partition_fragment_B(sKm);
  Tensor tPrS = partition_fragment_C(pmma, Shape<Int<kTileRows>, Int<kPooledN>>{});
  Tensor cP = pmma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kPooledN>>{}));
  Tensor tErQ = wg_e.partition_fragment_A(sQ8);
  Tensor tErK = wg_e.partition_fragment_B(sK8);
  Tensor cE = emma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kTileRows>, Int<kUnitKeys>>{}));
  static_assert(decltype(size(cE))::value == 32, "float accumulators: 32 a thread per unit");

  // This thread's two packed rows (the float accumulators' rows 0 and 8 of its quad, the same in both GEMMs: value v
  // is in row (v / 2) % 2 of these, v % 2 the next column, v / 4 columns + 8): the last key each sees (-1: none), the
  // last block, the last block it sees whole (every block when it sees the sequence's last key).
  int hi_row[2], last_block[2], whole_last[2];
  for (int i = 0; i < 2; ++i) {
    const RowLimits lim = row_limits(get<0>(cP(2 * i)), rows, t, group_size, off, k_len, nb, B);
    hi_row[i] = lim.hi, last_block[i] = lim.last_block, whole_last[i] = lim.whole_last;
  }
  const int tile_min_hi = rows == kTileRows ? int(hi_first) : -1;  // keys <= it: seen by every row of the tile

  // Pooled chunk c: kPooledN blocks into stage `buf` of sKm (one cp.async group, waited at the next
  // stage barrier). A thread's 16-byte chunks are the same in every chunk: their stage-0 addresses computed once.
  const Element* pooled_src =
      reinterpret_cast<const Element*>(k_mean_lowp) + (int64_t(cu_blocks[b]) * kv_heads_mem + kvh_mem) * D;
  constexpr int kVec = D / 8;                                   // 16-byte chunks per row of D
  constexpr int kMeanLoads = kPooledN * kVec / kExactThreads;   // per thread and chunk
  static_assert(kPooledN * kVec % kExactThreads == 0, "whole 16-byte chunks per thread");
  static_assert(kPooledN * D * sizeof(Element) % 1024 == 0, "a pooled stage is whole swizzle periods");
  constexpr uint32_t kMeanStageBytes = kPooledN * D * sizeof(Element);
  uint32_t km_mine[kMeanLoads];
  CUTE_UNROLL
  for (int k = 0; k < kMeanLoads; ++k) {
    const int i = threadIdx.x + k * kExactThreads;
    km_mine[k] = smem_addr(sKm(i / kVec, (i % kVec) * 8, 0));
  }
  auto load_pooled = [&](int c, int buf) {  // blocks [N c, N c + N), those past the sequence clamped to its last
    CUTE_UNROLL
    for (int k = 0; k < kMeanLoads; ++k) {
      const int i = threadIdx.x + k * kExactThreads;
      const int J = min(c * kPooledN + i / kVec, int(nb - 1));
      const Element* src = pooled_src + int64_t(J) * (kv_heads_mem * D) + (i % kVec) * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(km_mine[k] + buf * kMeanStageBytes), "l"(src));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  auto pooled_gemm = [&](int buf) {
    wgmma_batch<false>(pmma, tPrQ, tPrK(_, _, _, buf), tPrS, /*zero_init=*/true);
    warpgroup_wait<0>();
  };
  auto stage_barrier = [] { cp_async_stage_barrier(); };

  float m_row[2] = {-INFINITY, -INFINITY};  // the rows' running maxima (log2 units): the bound, then stage 2's
  const int64_t sink_end = min(k_len, geometry::num_blocks(sel.sink, B) * B);  // the sink blocks' keys (spec step 4)

  // Pass 1 over the pooled chunks: per row the maximum over every block it sees (m_all, NaN-propagating: a NaN score
  // flags the tile) and over the blocks it sees whole (the bound's first term; the sink keys' maxima are its second).
  // Pass 2, backwards from pass 1's last chunk (its scores still in tPrS), the candidates: the blocks J some row sees
  // with pooled_rJ >= m_all_r + log2(candidate_alpha) (kRowMax's test). Chunk c is in stage c % 2 in both passes.
  float m_all[2] = {-INFINITY, -INFINITY}, cand_threshold[2];
  const int nchunks = (nvis + kPooledN - 1) / kPooledN;
  auto pooled_tests = [&](auto pass, int c) {  // chunk c's scores, in tPrS
    constexpr int kPass = decltype(pass)::value;
    // A thread's values v hold columns 8 (v / 4) + [0, 8): word w of the chunk's bits is values [w V, w V + V), V
    // = size(tPrS) / kWords.
    constexpr int kWords = kPooledN / 32, kPerWord = int(decltype(size(tPrS))::value) / kWords;
    uint32_t mask[kWords] = {};
    CUTE_UNROLL
    for (int v = 0; v < size(tPrS); ++v) {
      const int i = (v / 2) % 2, col = get<1>(cP(v)), J = c * kPooledN + col;
      const float s = tPrS(v) * sel.scale_log2;
      if constexpr (kPass == 0) {
        m_all[i] = J <= last_block[i] ? fmax_nan(m_all[i], s) : m_all[i];
        m_row[i] = J <= whole_last[i] ? fmaxf(m_row[i], s) : m_row[i];
      } else {
        mask[v / kPerWord] |= uint32_t((J <= last_block[i]) & (s >= cand_threshold[i])) << (col % 32);
      }
    }
    if constexpr (kPass == 1) {
      CUTE_UNROLL
      for (int w = 0; w < kWords; ++w) {  // a word past nvis's has no bit set: not written
        const uint32_t m = __reduce_or_sync(0xffffffffu, mask[w]);
        if (lane == 0 && m) atomicOr(&cand_bits[c * kWords + w], m);
      }
    }
  };
  load_pooled(0, 0);
  for (int c = 0; c < nchunks; ++c) {
    stage_barrier();  // chunk c landed; chunk c - 1's GEMM (the other stage) finished in both warpgroups
    const int next = c + 1 < nchunks ? c + 1 : c - 1;  // pass 1's next chunk, then pass 2's second
    if (next >= 0) load_pooled(next, next & 1);
    pooled_gemm(c & 1);
    pooled_tests(std::integral_constant<int, 0>{}, c);
  }
  for (int i = 0; i < 2; ++i) {
    for (int o = 1; o <= 2; o *= 2) {
      m_row[i] = fmaxf(m_row[i], __shfl_xor_sync(0xffffffffu, m_row[i], o));
      m_all[i] = fmax_nan(m_all[i], __shfl_xor_sync(0xffffffffu, m_all[i], o));
    }
    if (m_all[i] != m_all[i]) sm.nan_flag = 1;  // read after the barriers below
    cand_threshold[i] = m_all[i] + log2_candidate_alpha;
  }
  if (nchunks > 0) pooled_tests(std::integral_constant<int, 1>{}, nchunks - 1);
  for (int c = nchunks - 2; c >= 0; --c) {
    stage_barrier();  // chunk c landed; chunk c + 1's GEMM finished in both warpgroups
    if (c > 0) load_pooled(c - 1, (c - 1) & 1);
    pooled_gemm(c & 1);
    pooled_tests(std::integral_constant<int, 1>{}, c);
  }
  __syncthreads();  // pass 2's candidate bits set; both warpgroups past its last GEMM before the room is reloaded

  // Of the always-kept blocks (score_select keeps them whatever the bits say) only those not fully visible to the tile
  // are scored: the diagonal's, which hold the row's nearest keys and so most often its maximum. The window band's
  // other blocks and the sink blocks are not, even where the pooled pass proposed them (exact_max_spec.md step 2):
  // the sink keys' maxima are in the bound (stage 2's first units), and the band's whole blocks are in it through
  // their pooled means (a partial sink block's maxima are those of its sink keys: in the bound already).
  // Scoring the band cost ~4 of the ~8 blocks a tile scored at 32K (topic workload) and bought 0.01-0.02 less density
  // at the same alpha (offline, SmolLM2 8K; bench/lab/results/exact_band_offline_smollm2_cpu.md). Round r's warp w
  // owns word r / 32 + w.
  {
    const int hf = int(max(hi_first, int64_t(-1)));
    const int64_t diag_first = first_pos + off, diag_last = last_pos + off;
    const int band_lo = int(max(int64_t(0), diag_first - sel.window + 1)), band_hi = int(min(k_len - 1, diag_last));
    const bool has_band = sel.window > 0 && diag_last >= 0;
    for (int round = 0; round < nvis; round += kExactThreads) {
      const int J = round + threadIdx.x;
      bool partial = false, kept_whole = false;  // scored (added) / not scored (dropped; sink blocks either way)
      if (J < nvis) {
        const int first_key = J * B, last_key = first_key + min(B - 1, int(k_len) - 1 - first_key);
        partial = last_key > hf;
        kept_whole = (first_key < sel.sink) | (!partial & has_band & (first_key <= band_hi) & (last_key >= band_lo));
      }
      const uint32_t add = __ballot_sync(0xffffffffu, partial), drop = __ballot_sync(0xffffffffu, kept_whole);
      if (lane == 0 && round / 32 + warp < words)
        cand_bits[round / 32 + warp] = (cand_bits[round / 32 + warp] | add) & ~drop;
    }
  }
  __syncthreads();

  // The candidates as a list, from the diagonal down.
  if (warp == 0) {
    const int n = list_candidates(cand_bits, words, cand, lane);
    if (lane == 0) sm.candidates = n;
  }
  __syncthreads();
  // Stage 2's units: the sink keys' (ns, keys [0, sink_end): the bound's second term, spec step 4), then the
  // candidates'. Scored at 64 keys a QGMMA from the pre-pass's e4m3 units, the sink costs what ns candidate units
  // cost; as 32-key bf16 batches through kv.offsets it was ~29 % of the kernel's instructions at 32K (ncu, 8b85de5).
  const int ncand = sm.candidates;
  const int upb = B / kUnitKeys;
  const int ns = int((sink_end + kUnitKeys - 1) / kUnitKeys);
  const int units = ns + ncand * upb, nstages = (units + kStageUnits - 1) / kStageUnits;
  for (int n = threadIdx.x; n < ns; n += kExactThreads) cand_units[n] = uint16_t(n);
  list_units<kExactThreads>(cand, ncand * upb, upb, cand_units + ns);

  // Q in e4m3 (spec step 3), in place of the bf16 tile, whose GEMMs are done: two threads a packed row, D / 2
  // columns each; the row's largest magnitude scaled to 448 (inv = 448 / amax, 0 when amax is 0), nearest even.
  // 16-bit q: the tile's values are q's. FP8 q: the tile holds bf16(q * descale), so the row is read again from q
  // and dequantised in float32 (the CPU reference's q * descale; from the bf16 values ~1.6 % of the elements would
  // round to another e4m3 step).
  {
    constexpr int kHalf = D / 2, kRaw = is_fp8_v<T> ? kHalf / 16 : kHalf / 8;  // 16-byte chunks of the half row
    const int r = threadIdx.x / 2, c0 = (threadIdx.x % 2) * kHalf;
    uint4 raw[kRaw];
    float descale = 1.f;
    if constexpr (is_fp8_v<T>) {
      descale = qa.descale.at(b, kvh_mem);
      const int pr = int(t) * kTileRows + r;  // packed row within the sequence, as gather_q_tile
      const uint8_t* src = static_cast<const uint8_t*>(qa.q) + (seq.q_start(b) + pr / group_size) * qa.stride_row +
                           (kvh * group_size + pr % group_size) * qa.stride_head + c0;
      CUTE_UNROLL
      for (int c = 0; c < kRaw; ++c) {
        raw[c] = make_uint4(0u, 0u, 0u, 0u);
        if (r >= rows) continue;
        if (qa.vec16) {
          raw[c] = __ldg(reinterpret_cast<const uint4*>(src + 16 * c));
        } else {
          uint32_t w[4] = {0u, 0u, 0u, 0u};
          for (int e = 0; e < 16; ++e) w[e / 4] |= uint32_t(__ldg(src + 16 * c + e)) << (8 * (e % 4));
          raw[c] = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    } else {
      CUTE_UNROLL
      for (int c = 0; c < kRaw; ++c) raw[c] = *reinterpret_cast<const uint4*>(&sQ(r, c0 + 8 * c));  // 16-byte swizzle
    }
    auto value = [&](int i) {  // element c0 + i of the row, in real units
      if constexpr (is_fp8_v<T>) {
        __nv_fp8_e4m3 x;
        x.__x = reinterpret_cast<const __nv_fp8_storage_t*>(raw)[i];
        return float(x) * descale;
      } else {
        return float(reinterpret_cast<const Element*>(raw)[i]);
      }
    };
    float amax = 0.f;  // fmaxf: a NaN is not a magnitude
    CUTE_UNROLL
    for (int i = 0; i < kHalf; ++i) amax = fmaxf(amax, fabsf(value(i)));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float inv = e4m3_inv(amax);
    __syncthreads();  // every row read before the e4m3 tile overwrites the bf16 one
    CUTE_UNROLL
    for (int c = 0; c < kHalf / 16; ++c) {
      float x[16];
      CUTE_UNROLL
      for (int i = 0; i < 16; ++i) x[i] = value(16 * c + i);
      *reinterpret_cast<uint4*>(&sQ8(r, c0 + 16 * c)) = to_e4m3x16(x, inv);
    }
    if (threadIdx.x % 2 == 0) sm.q_scale[r] = e4m3_scale(amax);
  }
  cutlass::arch::fence_view_async_shared();  // the e4m3 tile and the lists before wgmma and the bulk copies
  __syncthreads();

  // Stage 2, the exact maxima unit by unit (64 keys) in cand_units' order, in stages of kStageUnits units on a ring
  // of kStages: thread 0 brings each unit with one bulk copy from the pre-pass's workspace (8 KB, already in the
  // slot's swizzled order: one path for every KV layout and dtype) onto unit_full[buf]; each warp releases a stage
  // on unit_empty[buf] once its GEMMs are done; no CTA barrier in the loop, no address work but thread 0's.
  const uint8_t* unit_src =
      keys8 + (int64_t(kvh_mem) * units_total + int64_t(cu_blocks[b]) * upb) * Cfg::kUnitBytes;
  const float* kappa_src = key_scales + int64_t(kvh_mem) * units_total + int64_t(cu_blocks[b]) * upb;
  auto load_stage = [&](int s) {
    const int buf = s % kStages, n0 = s * kStageUnits, n = min(kStageUnits, units - n0);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&sm.unit_full[buf], uint32_t(n * Cfg::kUnitBytes));
    for (int u = 0; u < n; ++u) {
      cute::SM90_BULK_COPY_G2S::copy(unit_src + int64_t(cand_units[n0 + u]) * Cfg::kUnitBytes, &sm.unit_full[buf],
                                     &sK8(0, 0, buf * kStageUnits + u), Cfg::kUnitBytes);
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < min(kStages, nstages); ++s) load_stage(s);
  }

  // This thread's rows' factor: the row's e4m3 scale in log2 units.
  float row_factor[2];
  for (int i = 0; i < 2; ++i) row_factor[i] = sm.q_scale[get<0>(cP(2 * i))] * sel.scale_log2;
  const float log2_alpha = log2f(sel.alpha);  // alpha 0: -inf, every candidate
  float run[2] = {-INFINITY, -INFINITY};      // the current block's maxima so far, per row (times the units' scales)
  // Unit n scored in acc, its scale kappa. Masked to the keys each row sees, the unit's row maxima times kappa. A sink
  // unit (n < ns): into the rows' bound (maxima over the quad's columns, fmaxf: a NaN key is the pooled stage's to
  // flag). A candidate unit (ci, sub): into the running block maximum (a row that sees none of its keys adds
  // nothing: no -inf * 0); at the block's last unit (sub 0) the score e_rJ, the running row maximum and the test.
  // (ci, sub) advance with the units, as before the sink's units joined the list: a division per unit (c / upb, a
  // runtime block size) cost ~20 instructions of the ~194 a unit step issued at 32K (ncu, 58c336c).
  auto unit_maxima = [&](auto& acc, int key0, float (&um)[2]) {
    if (key0 + kUnitKeys - 1 > tile_min_hi) {  // some key of the unit is past some row's last key
      CUTE_UNROLL
      for (int v = 0; v < size(acc); ++v) {
        if (key0 + get<1>(cE(v)) > hi_row[(v / 2) % 2]) acc(v) = -INFINITY;
      }
    }
    CUTE_UNROLL
    for (int v = 0; v < size(acc); ++v) um[(v / 2) % 2] = fmax_nan(um[(v / 2) % 2], acc(v));
  };
  auto consume_sink = [&](auto& acc, int n, float kappa) {
    float um[2] = {-INFINITY, -INFINITY};
    unit_maxima(acc, n * kUnitKeys, um);
    for (int i = 0; i < 2; ++i) {
      float e = fmaxf(um[i], __shfl_xor_sync(0xffffffffu, um[i], 1));
      e = fmaxf(e, __shfl_xor_sync(0xffffffffu, e, 2));
      if (e != -INFINITY) m_row[i] = fmaxf(m_row[i], e * kappa * row_factor[i]);
    }
  };
  auto consume_candidate = [&](auto& acc, int ci, int sub, float kappa) {
    const int J = cand[ci];
    float um[2] = {-INFINITY, -INFINITY};
    unit_maxima(acc, J * B + sub * kUnitKeys, um);
    for (int i = 0; i < 2; ++i) {
      if (um[i] != -INFINITY) run[i] = fmax_nan(run[i], um[i] * kappa);
    }
    if (sub != 0) return;
    bool keep = false;
    for (int i = 0; i < 2; ++i) {
      float e = fmax_nan(run[i], __shfl_xor_sync(0xffffffffu, run[i], 1));
      e = fmax_nan(e, __shfl_xor_sync(0xffffffffu, e, 2)) * row_factor[i];
      run[i] = -INFINITY;
      if (J > last_block[i]) continue;
      if (e != e) sm.nan_flag = 1;  // a NaN key or query reached the scores
      m_row[i] = fmaxf(m_row[i], e);
      keep |= e >= m_row[i] + log2_alpha;
    }
    if (__any_sync(0xffffffffu, keep) && lane == 0) atomicOr(&bits[J / 32], 1u << (J % 32));
  };
  int ci = 0, sub = upb - 1;  // the next candidate unit: candidate ci's unit sub (a block's units last to first)

  Tensor accA = partition_fragment_C(emma, Shape<Int<kTileRows>, Int<kUnitKeys>>{});
  Tensor accB = partition_fragment_C(emma, Shape<Int<kTileRows>, Int<kUnitKeys>>{});
  for (int s = 0; s < nstages; ++s) {
    const int buf = s % kStages;
    // Thread 0 refills the previous stage's slots (stage s - 1 + kStages) once every warp released them.
    if (threadIdx.x == 0 && s >= 1 && s - 1 + kStages < nstages) {
      const int prev = (s - 1) % kStages;
      cutlass::arch::ClusterBarrier::wait(&sm.unit_empty[prev], ((s - 1) / kStages) & 1);
      load_stage(s - 1 + kStages);
    }
    float kappa[kStageUnits];  // the stage's units' scales, in flight with the copies
    CUTE_UNROLL
    for (int uu = 0; uu < kStageUnits; ++uu) {
      const int n = s * kStageUnits + uu;
      kappa[uu] = n < units ? __ldg(kappa_src + cand_units[n]) : 0.f;
    }
    __syncwarp();
    cutlass::arch::ClusterTransactionBarrier::wait(&sm.unit_full[buf], (s / kStages) & 1);
    const int slot0 = buf * kStageUnits;
    // unit uu + 1's wgmma runs while unit uu is reduced (two accumulators); every slot's wgmma is issued (a wgmma
    // under a branch is serialized by ptxas, C7518): a slot past the last unit holds stale keys and is not reduced.
    wgmma_batch<false>(emma, tErQ, tErK(_, _, _, slot0), accA, /*zero_init=*/true);
    CUTE_UNROLL
    for (int uu = 0; uu < kStageUnits; ++uu) {
      auto& cur = (uu & 1) ? accB : accA;
      auto& nxt = (uu & 1) ? accA : accB;
      if (uu + 1 < kStageUnits) {
        wgmma_batch<false>(emma, tErQ, tErK(_, _, _, slot0 + uu + 1), nxt, /*zero_init=*/true);
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
        __syncwarp();  // this warp's GEMMs on the stage's slots are done: thread 0 may refill them
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&sm.unit_empty[buf]);
      }
      const int n = s * kStageUnits + uu;
      if (n < ns) {
        consume_sink(cur, n, kappa[uu]);
      } else if (n < units) {
        consume_candidate(cur, ci, sub, kappa[uu]);
        ci += sub == 0;
        sub = sub == 0 ? upb - 1 : sub - 1;
      }
    }
  }
  __syncthreads();
  uint32_t* out = bits_out + seg * words_out;
  const bool all = sm.nan_flag != 0;  // a NaN score keeps every visible block of the tile
  for (int w = threadIdx.x; w < words; w += kExactThreads) out[w] = all ? 0xffffffffu : bits[w];
}

template <typename T, int D>
size_t exact_max_smem_limit() {
  static const size_t limit =
      opt_in_all_shared_memory(exact_max_kernel<T, D>, "cudaFuncSetAttribute(exact_max_kernel)");
  return limit;
}

template <typename T, int D>
void launch_exact(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                  const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                  const SelectArgs& sel, const DeviceIndex& d) {
  const int B = sel.block_size;
  // the lists hold block and unit indices as uint16: <= 65535 units (check_index_supported)
  const int64_t sink_units = (std::min(geometry::num_blocks(sel.sink, B), bd.nb_max) * B + kUnitKeys - 1) / kUnitKeys;
  const size_t dyn = ExactMaxConfig<T, D>::smem_bytes(bd.nb_max, B, sink_units);
  if (dyn > exact_max_smem_limit<T, D>()) {
    throw NotImplementedError("build_index on CUDA, rule exact_max: " + std::to_string(bd.nb_max) +
                              " blocks per sequence exceed the scorer's shared memory (max_seqlen_k too long)");
  }
  const bool k_vec = rows_vec8(kv.k, kv.k_stride, kv.block_table != nullptr);  // 16-byte loads of K rows
  const float log2_candidate_alpha = std::log2(params.candidate_alpha);        // 0: -inf, every visible block
  // The pre-pass: every unit of the pooled blocks' key rows in e4m3 into the workspace (~0.13 ms at 128K, Hkv 8, on
  // an H100 by its bytes: K read once, half of it written).
  const int upb = B / kUnitKeys;
  const int64_t units_total = d.key_rows / kUnitKeys;
  if (bd.max_blocks > 0) {
    exact_keys_kernel<T, D><<<dim3(unsigned(bd.max_blocks * upb), unsigned(p.num_kv_heads)), kKeyThreads, 0,
                              stream>>>(seq, kv, k_vec, d.cu_blocks, upb, units_total,
                                        static_cast<uint8_t*>(d.exact_keys), d.exact_key_scales);
  }
  exact_max_kernel<T, D><<<dim3(unsigned(bd.max_tiles), unsigned(heads.kv)), kExactThreads, dyn, stream>>>(
      seq, qa, sel, log2_candidate_alpha, heads.group, heads.kv, heads.num_subgroups, p.num_kv_heads,
      d.cu_tiles, d.cu_blocks, static_cast<const lowp_t<T>*>(d.k_mean_lowp), static_cast<const uint8_t*>(d.exact_keys),
      d.exact_key_scales, units_total, d.probe_bits, d.probe_words);
}

}  // namespace

void launch_exact_max(cudaStream_t stream, const Problem& p, const SelectionParams& params, const Bounds& bd,
                      const VirtualHeads& heads, const SeqArgs& seq, const QArgs& qa, const KVArgs& kv,
                      const SelectArgs& sel, const DeviceIndex& d) {
  if (bd.max_tiles <= 0) return;
  auto launch = [&](auto tag, auto dim) {
    launch_exact<decltype(tag), decltype(dim)::value>(stream, p, params, bd, heads, seq, qa, kv, sel, d);
  };
  with_index_types(p.dtype, p.head_dim, launch);
  check_cuda(cudaGetLastError(), "exact_max_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage
