// The warp-specialised sm90 forward kernel: one producer warpgroup (a single thread issues TMA for Q once and for the
// K/V blocks of the tile's block iterator into 3-stage (default) mbarrier pipelines), two consumer warpgroups of 64 query rows
// each (wgmma S = Q K^T from smem, online softmax in registers, wgmma O += P V with P from registers).
//
// Consumer schedule (FA3 "intra-warpgroup overlap"): while the tensor cores run S(i) = Q K(i)^T and
// O += P(i-1) V(i-1), the softmax of block i waits only for S(i) (warpgroup_wait<1>), so the exp2 work of block i
// overlaps the PV GEMM of block i-1.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/attention/block_schedule.h"
#include "cuda/device_checks.h"
#include "cuda/fwd_config.h"
#include "cuda/softmax.h"
#include "cuda/wgmma.h"

namespace sparse_prefill::cuda {

template <class Config>
struct FwdParams {
  typename Config::TmaQ tma_q;
  typename Config::TmaKV tma_k;
  typename Config::TmaKV tma_v;
  typename Config::TmaKVHalf tma_k_half;  // 64-row boxes: paged KV with page_size % 128 == 64 (else unused)
  typename Config::TmaKVHalf tma_v_half;
  int half_boxes;                         // 1: load each K/V block as two 64-row boxes (page_size % 128 == 64)
  const void* q;                          // sparse mode gathers Q rows itself (PackGQA)
  int64_t q_row_stride, q_head_stride;
  const void* k;                          // kGatherKV (paged, page_size % 64 != 0): K/V rows gathered by cp.async
  const void* v;
  int64_t k_row_stride, k_head_stride, v_row_stride, v_head_stride;
  void* out;
  float* lse;
  int64_t o_row_stride, o_head_stride, lse_head_stride, lse_row_stride;
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* block_table;
  const int* seqused_k;
  int64_t block_table_stride;
  // Sparse mode with head sub-groups: num_kv_heads and group_size count virtual KV heads (tiles, segments), K/V and
  // the pooled means are read from head kv_head / kv_split of the num_kv_heads_mem heads in memory.
  int total_q, total_k_rows, num_q_heads, num_kv_heads, group_size, page_size;
  int num_kv_heads_mem, kv_split;
  int num_m_blocks;
  int num_tiles;  // num_q_heads * num_m_blocks * batch
  float softmax_scale, scale_log2;
  int window_left, window_right;  // right = 0 for causal; -1 = unbounded

  // Block-sparse mode (fwd_kernel<Config, true>): tiles are PackGQA tiles of the CSR index, one per
  // (sequence, KV head, tile of 128 packed rows); num_m_blocks holds the largest tile count of a sequence.
  typename Config::TmaKV tma_k_mean;      // pooled means [mean_rows, Hkv, D] in the input dtype (correction keys)
  typename Config::TmaKV tma_v_mean;
  const int32_t* seg_start;
  const int32_t* seg_end;
  const int32_t* block_ids;
  const int32_t* cu_tiles;                // [B+1] tiles per sequence, prefix-summed
  const int32_t* cu_blocks;               // [B+1] pooled blocks per sequence, prefix-summed
  // Scheduler counter and split-KV plan (SparseLaunchWorkspace, fwd_args.h). num_tiles = max_split_units +
  // num_coord_tiles bounds the work units; the real count is plan[kSplitUnits] + num_coord_tiles.
  int* tile_counter;                      // sparse persistent: dynamic scheduler counter, zero at launch
  const int* plan;                        // counters (null: no split)
  const int32_t* split_tiles;             // [.][4] {tile, nsplit, 0, 0}
  const int32_t* slot_tile;
  float* o_partial;                       // [slot, 128, D]
  float* lse_partial;                     // [slot, 128]
  int num_coord_tiles, batch;
  int block_size, correction;
  int mean_rows;                          // rows of the pooled-means tensors (TMA zero-fills beyond)
  float corr_bias_full;                   // log2(block_size) / scale_log2: log|B_J| in raw logit units
  // Dense attention through the sparse kernel (SparseFwdArgs::full_list): every tile visits the full list of the
  // blocks it sees (SparseBlockIterator::full_list_blocks), causal when window_right == 0, non-causal when < 0.
  int full_list;

  // Device-side checks (device_checks.h): the device error word, what a sequence's span may be, the pages of a paged
  // cache (block_table ids are checked where the producer loads them), and the extents of the index's segment and
  // block id arrays (sparse).
  DeviceError* err;
  SeqLimits limits;
  int num_pages;
  int num_segments, num_block_ids;
};

// Sparse launches are persistent (one CTA per SM, tiles from the dynamic scheduler); dense launches run one tile per
// CTA, whose loop has a trip count of 1 and compiles to straight-line code. A persistent dense kernel was measured
// (its tile loop costs registers: at 240 per consumer thread ptxas spilled ~60 bytes) and removed (bench/NOTES.md).
#define SP_TILE_LOOP(t)                                                                              \
  for (int t = tile_first(), t##_n = 0; kPersistent ? (t < params.num_tiles) : (t##_n < 1);        \
       t = kPersistent ? tile_next(t) : t, ++t##_n)

// Tile order: heads fastest (the g query heads of a KV head share its K/V blocks in L2), then m-blocks from the
// last (heaviest under causal) to the first, then sequences. A CTA processes tiles blockIdx.x, + gridDim.x, ...:
// one tile per CTA (grid = num_tiles) or persistent (grid = #SMs; the static stride over a heaviest-first order
// is an LPT-like schedule, and the next tile's K/V loads overlap the current epilogue).
struct TileCoord {
  int head, m_block, batch;
};
__device__ __forceinline__ TileCoord tile_coord(int t, int num_q_heads, int num_m_blocks) {
  TileCoord c;
  c.head = t % num_q_heads;
  const int r = t / num_q_heads;
  c.m_block = num_m_blocks - 1 - r % num_m_blocks;
  c.batch = r / num_m_blocks;
  return c;
}

// Block-sparse tile order (SparseTileCoord, block_iterator.h): KV heads fastest, then sequences, then tiles from the
// last (most blocks visible) to the first, so the heavy tiles of every sequence come first.

// Everything one role needs to know about its tile, evaluated identically by producer and consumers.
template <class Iterator>
struct TileWork {
  Iterator iter;
  SeqSpan seq;
  int batch, kv_head;
  int slot;      // sparse split-KV: float32 partial slot of this unit (-1: the unit is the whole tile, writes out)
  int q_head;    // dense: the tile's query head
  int row0;      // sparse: first packed row (tile * 128); dense: first query row (m_block * 128)
  bool valid;    // false: the tile lies beyond its sequence (or, sparse, is run as split units elsewhere)
  int bad;       // DeviceErrorCode of the tile's sequence / segment (device_checks.h); then `seq` is the clipped span,
                 // the iterator is empty and the consumers write NaN rows
};

// Sparse work unit u (the split-KV plan of split_kv.cu, read from its counters): units [0, n_split_units) are the
// parts of the split tiles (unit u = partial slot u), then unit n_split_units + t is tile t of the work order, unless
// that tile has more planned steps than the plan's cap (its parts are the split units).
template <class Config, bool kSparse, bool kSplit, class Iterator>
__device__ __forceinline__ TileWork<Iterator> tile_work(FwdParams<Config> const& params, int u) {
  TileWork<Iterator> w;
  if constexpr (kSparse) {
    const int n_split_units = kSplit ? params.plan[SparseLaunchWorkspace::kSplitUnits] : 0;
    int t = u - n_split_units, split = 0, nsplit = 1;
    w.slot = -1;
    if (kSplit && u < n_split_units) {
      const int v = params.slot_tile[u];
      const int4 e = reinterpret_cast<const int4*>(params.split_tiles)[v & 0xffff];
      t = e.x;
      split = v >> 16;
      nsplit = e.y;
      w.slot = u;
    }
    w.valid = t < params.num_coord_tiles;
    if (!w.valid) return w;
    const SparseTileCoord c = sparse_tile_coord(t, params.num_kv_heads, params.batch, params.num_m_blocks);
    w.batch = c.batch;
    w.kv_head = c.kv_head;
    w.q_head = c.kv_head * params.group_size;
    w.seq = load_seq_span(params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_k, c.batch);
    w.row0 = c.tile * Config::kBlockM;
    // Device-side checks (device_checks.h), the split plan's tile_steps makes the same ones: a bad sequence's tiles
    // (over its clipped rows) and a tile whose segment or pooled rows lie outside the index run no step and write NaN.
    const bool full = params.full_list != 0;  // dense over PackGQA tiles: no index arrays
    const bool corr = params.correction != 0;
    w.bad = seq_violation(w.seq, c.batch, params.limits);
    int tile_base = 0, tiles = 0, lo = 0, n_listed = 0;
    if (!w.bad) {
      tile_base = full ? 0 : params.cu_tiles[c.batch];
      tiles = full ? Iterator::packed_tiles(w.seq.q_len, params.group_size) : params.cu_tiles[c.batch + 1] - tile_base;
      w.valid = c.tile < tiles;
      if (!w.valid) return w;
      if (full) {
        n_listed = Iterator::full_list_blocks(w.row0, params.group_size, w.seq.q_len, w.seq.k_len,
                                              params.window_right >= 0);
      } else {
        w.bad = sparse_index_violation(params.seg_start, params.seg_end, params.num_kv_heads * tile_base +
                                       c.kv_head * tiles + c.tile, params.num_segments, params.num_block_ids,
                                       nullptr, c.batch, w.seq.k_len, params.block_size,
                                       params.mean_rows, lo, n_listed);
      }
    }
    if (w.bad) {
      if (seq_violation(w.seq, c.batch, params.limits)) w.seq = clip_bad_span(w.seq, params.total_q);
      // Tile 0 of KV head 0 always runs (possibly with no row): it reports a sequence left without rows.
      w.valid = c.tile < Iterator::packed_tiles(w.seq.q_len, params.group_size) || (c.tile == 0 && c.kv_head == 0);
      w.iter = Iterator::make(nullptr, 0, 0, w.seq.q_len, 0, params.block_size, false);
      return w;
    }
    const int p_first = w.row0 / params.group_size;
    if (kSplit && nsplit == 1 &&
        SplitRule::nsplit(
            Iterator::planned_steps(n_listed, p_first, w.seq.q_len, w.seq.k_len, params.block_size, corr),
            params.plan[SparseLaunchWorkspace::kCap]) > 1) {
      w.valid = false;  // a split tile: its parts are units [0, n_split_units)
      return w;
    }
    w.iter = Iterator::make(full ? nullptr : params.block_ids + lo, n_listed, p_first, w.seq.q_len, w.seq.k_len,
                            params.block_size, corr);
    if (full && params.window_right < 0) w.iter.make_non_causal();
    if (kSplit && nsplit > 1) w.iter.split(split, nsplit);
  } else {
    const TileCoord c = tile_coord(u, params.num_q_heads, params.num_m_blocks);
    w.batch = c.batch;
    w.q_head = c.head;
    w.kv_head = c.head / params.group_size;
    w.seq = load_seq_span(params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_k, c.batch);
    // Device-side check (device_checks.h): a bad sequence runs no step over its clipped rows, which come out NaN.
    w.bad = seq_violation(w.seq, c.batch, params.limits);
    if (w.bad) w.seq = clip_bad_span(w.seq, params.total_q);
    w.row0 = c.m_block * Config::kBlockM;
    // (a bad sequence: m-block 0 of head 0 always runs, possibly with no row, and reports it)
    w.valid = w.row0 < w.seq.q_len || (w.bad && c.m_block == 0 && c.head == 0);
    if (!w.valid) return w;
    w.iter = Iterator::make(c.m_block, w.seq, params.window_left, params.window_right);
  }
  return w;
}

// Reports the violation `code` of a bad tile (TileWork::bad) with the values that show it (re-read: cold path).
template <class Config>
__device__ __forceinline__ void report_tile_error(FwdParams<Config> const& params, int code, int b, int kv_head,
                                                  int tile) {
  if (code == kErrSegment || code == kErrCuBlocks) {
    const int tile_base = params.cu_tiles[b], tiles = params.cu_tiles[b + 1] - tile_base;
    const int seg = params.num_kv_heads * tile_base + kv_head * tiles + tile;
    if (code == kErrCuBlocks) {
      report_device_error(params.err, code, b, b, params.cu_blocks[b], params.cu_blocks[b + 1]);
    } else {
      const bool in = seg >= 0 && seg < params.num_segments;
      report_device_error(params.err, code, b, seg, in ? params.seg_start[seg] : -1, in ? params.seg_end[seg] : -1);
    }
    return;
  }
  const SeqSpan s = load_seq_span(params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_k, b);
  report_seq_error(params.err, code, b, s, params.limits);
}

// kSplit (sparse, persistent): the launch runs the split-KV plan's units (split_kv.cu). A separate instantiation
// because the split branch costs the consumers ~3 registers and with them 3 spill reloads per step in the mainloop
// (ptxas + SASS: 414 vs 260 bytes of spill stores); one-shot launches, which are never planned, do without it.
//
// kGatherKV (dense, one tile per CTA): paged KV whose page_size is not a multiple of 64 (vLLM's 16, or 1). TMA boxes
// cannot follow pages that small (boxes of 16 rows, one per page, measured 2.4-2.7x slower than contiguous KV, and
// compiled into the TMA producer they cost every other path 1.5-5 %, bench/NOTES.md), so in this instantiation the
// whole producer warpgroup gathers K/V with cp.async: each lane reads the block_table entry of one of its warp's 32
// key rows once per block (gather_row), and each warp copies those rows as whole 256-byte rows (16 lanes per row, the
// row's page offset shuffled from the lane that loaded it) into the same swizzled stage layout TMA writes.
template <class Config, bool kSparse, bool kSplit = false, bool kGatherKV = false>
__global__ void __launch_bounds__(Config::kNumThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT FwdParams<Config> const params) {
  using namespace cute;
  using Element = typename Config::Element;
  using SharedStorage = typename Config::SharedStorage;
  constexpr bool kPersistent = kSparse;
  static_assert(!kGatherKV || !kSparse, "the cp.async gather producer is dense, one tile per CTA");
  using Pipeline = std::conditional_t<kGatherKV, typename Config::PipelineGather, typename Config::Pipeline>;
  using PipelineState = typename Config::PipelineState;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kHeadDim = Config::kHeadDim;
  using Iterator = std::conditional_t<kSparse, SparseBlockIterator<kBlockN>, DenseBlockIterator<kBlockM, kBlockN>>;

  extern __shared__ char smem_raw[];
  SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int wg_idx = cutlass::canonical_warp_group_idx();

  if (warp_idx == 0 && cute::elect_one_sync()) {
    if constexpr (!kSparse) cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    if (params.half_boxes) {
      cute::prefetch_tma_descriptor(params.tma_k_half.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_v_half.get_tma_descriptor());
    }
    storage.barrier_q.init(1);
    storage.barrier_q_empty.init(Config::kNumMmaThreads);
    for (int s = 0; s < 4; ++s) storage.poisoned[s] = 0;
    for (int s = 0; s < 2; ++s) {
      storage.tile_full[s].init(1);
      storage.tile_empty[s].init(Config::kNumMmaThreads);
    }
  }
  // Dynamic tile scheduler (sparse, persistent): tile work varies by orders of magnitude (a few listed blocks to
  // hundreds), so a static stride leaves SMs idle (measured 128K: 7.85 ms vs 6.79 ms one CTA per tile). The producer
  // thread takes tiles from an atomic counter (the next one fetched while the current one loads) and publishes each
  // in a two-slot mailbox; the consumers read it from there. Slot s is reused every second tile.
  constexpr bool kDynamic = kPersistent;
  typename Pipeline::Params pipe_params;
  pipe_params.role = wg_idx == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  auto make_pipeline = [&](typename Config::KVPipelineStorage& ps) {
    if constexpr (kGatherKV) {
      pipe_params.producer_arv_count = 128;  // every producer thread's cp.async arrive (noinc)
      pipe_params.consumer_arv_count = Config::kNumMmaThreads;
      return Pipeline(ps.gather, pipe_params);
    } else {
      pipe_params.transaction_bytes = Config::kTmaBytesKV;
      pipe_params.is_leader = threadIdx.x == 0;
      pipe_params.num_consumers = Config::kNumMmaThreads;
      return Pipeline(ps.tma, pipe_params, Shape<_1, _1, _1>{});
    }
  };
  Pipeline pipeline_k = make_pipeline(storage.pipeline_k);
  Pipeline pipeline_v = make_pipeline(storage.pipeline_v);
  __syncthreads();

  if (wg_idx == 0) {
    // ================================ producer ================================
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (!kGatherKV && threadIdx.x != 0) return;  // TMA: one thread issues everything
    const bool issuer = threadIdx.x == 0;       // Q (and, TMA, K/V)
    PipelineState st_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState st_v = cutlass::make_producer_start_state<Pipeline>();
    int q_loads = 0;
    int published = 0, pending = 0;
    auto publish = [&](int t) {
      if constexpr (kDynamic) {
        // Units past the plan's real count (num_tiles is the host's bound) end the loop at once: publish the
        // sentinel. Read per tile, not held: the producer thread runs with 24 registers.
        if (kSplit && t >= params.plan[SparseLaunchWorkspace::kSplitUnits] + params.num_coord_tiles)
          t = params.num_tiles;
        const int s = published & 1;
        if (published >= 2) storage.tile_empty[s].wait(((published >> 1) - 1) & 1);
        storage.tile_ids[s] = t;
        storage.tile_full[s].arrive();
        ++published;
        if (t < params.num_tiles) pending = atomicAdd(params.tile_counter, 1);  // used by the next tile_next()
      }
      return t;
    };
    auto tile_first = [&]() { return publish(int(blockIdx.x)); };
    auto tile_next = [&](int t) { return kDynamic ? publish(int(gridDim.x) + pending) : t + int(gridDim.x); };
    SP_TILE_LOOP(t) {
      // ---- Tile metadata: evaluated identically by every role. ----
      const TileWork<Iterator> work = tile_work<Config, kSparse, kSplit, Iterator>(params, t);
      if (!work.valid) continue;  // beyond this sequence
      const Iterator& iter = work.iter;
      const SeqSpan& seq = work.seq;
      const int batch = work.batch, kv_head = kSparse ? work.kv_head / params.kv_split : work.kv_head;  // in memory
      const int n_count = iter.count();
      if (n_count == 0) continue;  // consumers write zeros without smem
      Tensor mK = params.tma_k.get_tma_tensor(make_shape(params.total_k_rows, kHeadDim, params.num_kv_heads_mem));
      Tensor mV = params.tma_v.get_tma_tensor(make_shape(params.total_k_rows, kHeadDim, params.num_kv_heads_mem));
      Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Config::SmemLayoutK{});
      Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Config::SmemLayoutV{});
      if (!kSparse && issuer) {  // sparse mode: the consumers gather the PackGQA rows of Q themselves
        // The Q buffer is reused as O staging: wait until both consumer warpgroups finished the previous epilogue.
        if (q_loads > 0) storage.barrier_q_empty.wait((q_loads - 1) & 1);
        ++q_loads;
        Tensor mQ = params.tma_q.get_tma_tensor(make_shape(params.total_q, kHeadDim, params.num_q_heads));
        Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
        Tensor gQ = local_tile(domain_offset(make_coord(seq.q_start, _0{}), mQ(_, _, work.q_head)),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(work.row0 / kBlockM, _0{}));
        auto [tQgQ, tQsQ] =
            tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        storage.barrier_q.arrive_and_expect_tx(Config::kTmaBytesQ);
        copy(params.tma_q.with(reinterpret_cast<uint64_t&>(storage.barrier_q), 0), tQgQ, tQsQ);
      }

      // A bad value met while loading this tile (device_checks.h; cold path): what it was, and the tile's slot of
      // storage.poisoned so that the consumers make its rows NaN and report it to the error word in their epilogue.
      // The slot is the tile's publication number mod 4 (the producer runs at most 2 tiles ahead of the consumers),
      // marked with that number + 1, so it needs no reset; the mark is stored before the stage's full-barrier arrive,
      // which the consumers wait on before the epilogue. Reporting here instead costs the producer's 24 registers the
      // error word's arguments: the sparse kernel's spills went from 296/404 to 472/592 bytes (ptxas).
      auto poison = [&](int code, int index, int value) {
        const int n = kDynamic ? published - 1 : 0;
        storage.poison_info[n & 3] = make_int4(code, index, value, 0);
        atomicMax(&storage.poisoned[n & 3], n + 1);
        if constexpr (kGatherKV) __threadfence_block();  // before the cp.async arrive (no release of its own)
      };
      // Page of key token `tok` (paged KV), or -1 for an id outside [0, num_pages) (poisons the tile).
      auto page_of = [&](int tok) -> int {
        const int col = tok / params.page_size;
        const int page = __ldg(params.block_table + batch * params.block_table_stride + col);
        if (unsigned(page) < unsigned(params.num_pages)) return page;
        poison(kErrBlockTable, col, page);
        return -1;
      };
      // Row of the K/V row space where key block n starts: contiguous (k_start + n*N) or paged (page % N == 0).
      // A step without keys (sparse n < 0) or a bad page: a box past the end, zero-filled by TMA.
      auto block_row = [&](int n) -> int {
        const int tok = n * kBlockN;
        if constexpr (kSparse) {
          if (n < 0) return params.total_k_rows;
        }
        if (params.page_size == 0) return seq.k_start + tok;
        const int page = page_of(tok);
        return page < 0 ? params.total_k_rows : page * params.page_size + tok % params.page_size;
      };
      // Page size % 128 == 64: row of the 64-row half h of key block n, each half from its own page. A half that
      // lies entirely beyond seqused_k reads no block_table entry (the table may have no such page) and points the
      // box past the end of the row space: TMA zero-fills it and still counts its bytes on the mbarrier.
      constexpr int kHalfN = Config::kHalfN;
      auto half_row = [&](int n, int h) -> int {
        const int tok = n * kBlockN + h * kHalfN;
        if (n < 0 || tok >= seq.k_len) return params.total_k_rows;
        const int page = page_of(tok);
        return page < 0 ? params.total_k_rows : page * params.page_size + tok % params.page_size;
      };
      Tensor mKh = params.tma_k_half.get_tma_tensor(make_shape(params.total_k_rows, kHeadDim, params.num_kv_heads_mem));
      Tensor mVh = params.tma_v_half.get_tma_tensor(make_shape(params.total_k_rows, kHeadDim, params.num_kv_heads_mem));
      // Rows of the K/V row space for one key block: {block row} or {half 0 row, half 1 row} (paged: block_table
      // loads), computed at each K and at each V issue. Computing them once per block and one block ahead was
      // measured slower on the H200 at causal 128K (paged/contiguous 1.057 (page 64) and 1.073 (page 128) against
      // 1.031 and 1.042) and removed (bench/NOTES.md).
      struct BlockRows {
        int r0, r1;
      };
      auto rows_of = [&](int n) -> BlockRows {
        if (!params.half_boxes) return {block_row(n), 0};
        return {half_row(n, 0), half_row(n, 1)};
      };
      auto load_block = [&](auto const& tma, auto const& tma_half, auto const& mX, auto const& mXh, auto& sX,
                            Pipeline& pipe, PipelineState& st, BlockRows const& rows) {
        pipe.producer_acquire(st);  // expects kTmaBytesKV on the stage's mbarrier, whatever the box split
        if (!params.half_boxes) {
          Tensor gX = local_tile(domain_offset(make_coord(rows.r0, _0{}), mX(_, _, kv_head)),
                                 Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
          auto [tXgX, tXsX] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
          copy(tma.with(*pipe.producer_get_barrier(st), 0), tXgX, tXsX(_, st.index()));
        } else {
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            Tensor gX = local_tile(domain_offset(make_coord(h == 0 ? rows.r0 : rows.r1, _0{}), mXh(_, _, kv_head)),
                                   Shape<Int<kHalfN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
            Tensor sXh = local_tile(sX(_, _, st.index()), Shape<Int<kHalfN>, Int<kHeadDim>>{}, make_coord(h, _0{}));
            auto [tXgX, tXsX] = tma_partition(tma_half, _0{}, Layout<_1>{}, group_modes<0, 2>(sXh),
                                              group_modes<0, 2>(gX));
            copy(tma_half.with(*pipe.producer_get_barrier(st), 0), tXgX, tXsX);
          }
        }
        ++st;
      };
      // K runs one block ahead of V: the consumer issues S(i) = Q K(i)^T before O += P(i-1) V(i-1).
      // Correction step (sparse mode): one full box of kBlockN pooled means, rows cu_blocks[b] + chunk * kBlockN.
      auto load_means = [&](auto const& tma, auto& sX, Pipeline& pipe, PipelineState& st, int chunk) {
        Tensor mX = tma.get_tma_tensor(make_shape(params.mean_rows, kHeadDim, params.num_kv_heads_mem));
        pipe.producer_acquire(st);
        Tensor gX = local_tile(domain_offset(make_coord(params.cu_blocks[batch] + chunk * kBlockN, _0{}),
                                             mX(_, _, kv_head)),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
        auto [tXgX, tXsX] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
        copy(tma.with(*pipe.producer_get_barrier(st), 0), tXgX, tXsX(_, st.index()));
        ++st;
      };
      auto load_k = [&](BlockRows const& r) {
        load_block(params.tma_k, params.tma_k_half, mK, mKh, sK, pipeline_k, st_k, r);
      };
      auto load_v = [&](BlockRows const& r) {
        load_block(params.tma_v, params.tma_v_half, mV, mVh, sV, pipeline_v, st_v, r);
      };
      // kGatherKV: the paged row (row space of the cache) of one row of key block n per lane, -1 past seqused_k
      // (zero-filled: the tail rows of the last page are never read, so NaN there cannot leak). Lane l of warp w
      // holds block row 32 w + kRowsPerCopy * (l % kChunks) + l / kChunks: copy j then takes its rows from lane j of
      // each kChunks-lane segment, a shuffle with an immediate lane index.
      constexpr int kChunks = kHeadDim * int(sizeof(Element)) / 16;  // 16-byte chunks per K/V row
      constexpr int kRowsPerCopy = 32 / kChunks;                     // rows one warp-wide cp.async covers
      const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
      auto gather_row = [&](int n) -> int {
        const int tok = n * kBlockN + 32 * warp + kRowsPerCopy * (lane % kChunks) + lane / kChunks;
        if (tok >= seq.k_len) return -1;
        const int page = page_of(tok);
        return page < 0 ? 0 : page * params.page_size + tok % params.page_size;  // bad page: row 0, in bounds
      };
      // Each warp copies its 32 rows, kRowsPerCopy per instruction (the lanes of a row read its contiguous bytes).
      // Smem address of (row, 16-byte chunk c) in a stage, in the 128-byte-swizzled K-major layout the GMMA
      // descriptors read (64-column atoms of 8 x 128-byte rows, stacked along the rows; the 16-byte unit index
      // XOR row % 8): stage + (c / 8) * kBlockN * 128 + row * 128 + ((c % 8) ^ (row % 8)) * 16. A lane's rows are
      // row0 + j * kRowsPerCopy with row0 < kRowsPerCopy (a power of two), so row % 8 = row0 | (j * kRowsPerCopy % 8):
      // the 8 / kRowsPerCopy XOR patterns are computed once per block and the rest of the address is an immediate.
      // A copy is then a shuffle, a wide multiply-add and the cp.async (5 SASS instructions with the 64-bit add;
      // these 4 warps share issue slots with the consumers, and every instruction per copy shows in the time: see
      // the unroll note below). Only the block holding seqused_k pays for predicates (zero-fill past it).
      auto gather_block = [&](const void* base, int64_t head_stride, uint32_t row_bytes, auto& sX, Pipeline& pipe,
                              PipelineState& st, int n) {
        constexpr int kPatterns = 8 / kRowsPerCopy;
        static_assert(kRowsPerCopy == 2 || kRowsPerCopy == 4, "rows of 256 or 128 bytes");
        static_assert(sizeof(Element) == 2);
        using SmemLayoutK = typename Config::SmemLayoutK;  // the layout the formula above assumes
        static_assert(std::is_same_v<decltype(get_swizzle_portion(SmemLayoutK{})), Swizzle<3, 4, 3>>);
        static_assert(get_nonswizzle_portion(SmemLayoutK{})(1, 0, 0) == 64 &&
                      get_nonswizzle_portion(SmemLayoutK{})(kBlockN - 1, 63, 0) == (kBlockN - 1) * 64 + 63 &&
                      get_nonswizzle_portion(SmemLayoutK{})(0, kHeadDim - 1, 0) ==
                          (kHeadDim / 64 - 1) * kBlockN * 64 + 63);
        const int my_row = gather_row(n);  // before the wait: its block_table load overlaps it
        const int ch = lane % kChunks, row0 = lane / kChunks;
        const uint64_t src0 = reinterpret_cast<uint64_t>(base) + uint64_t(int64_t(kv_head) * head_stride + ch * 8) * 2;
        const uint32_t dst0 = cast_smem_ptr_to_uint(&sX(0, 0, st.index())) + (ch / 8) * (kBlockN * 128) +
                              (32 * warp + row0) * 128;
        uint32_t dst[kPatterns];
        CUTE_UNROLL
        for (int k = 0; k < kPatterns; ++k)
          dst[k] = dst0 + ((uint32_t((ch % 8) ^ row0) ^ uint32_t(k * kRowsPerCopy)) * 16);
        auto src_of = [&](uint32_t row) {  // one IMAD.WIDE.U32 with the 64-bit addend
          uint64_t a;
          asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(a) : "r"(row), "r"(row_bytes), "l"(src0));
          return a;
        };
        pipe.producer_acquire(st);
        if ((n + 1) * kBlockN <= seq.k_len) {
          // Fully unrolled (immediate shuffle lanes and smem offsets): at page 16, causal 32K / 128K, the
          // paged/contiguous ratio was 1.19 / 1.26 unrolled, 1.31 / 1.40 unrolled by 4, 1.38 / 1.46 by 2 (H200).
          CUTE_UNROLL
          for (int j = 0; j < kChunks; ++j) {
            const int src_row = __shfl_sync(0xffffffffu, my_row, j, kChunks);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                         ::"r"(dst[j % kPatterns] + j * kRowsPerCopy * 128), "l"(src_of(uint32_t(src_row))));
          }
        } else {  // the block holding seqused_k: rows past it are zero-filled (src-size 0), never read
#pragma unroll 1
          for (int j = 0; j < kChunks; ++j) {
            const int src_row = __shfl_sync(0xffffffffu, my_row, j, kChunks);
            const uint32_t d = dst0 + j * kRowsPerCopy * 128 +
                               ((uint32_t((ch % 8) ^ row0) ^ uint32_t(j * kRowsPerCopy % 8)) * 16);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d),
                         "l"(src_of(uint32_t(src_row < 0 ? 0 : src_row))), "r"(src_row < 0 ? 0 : 16));
          }
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(pipe.producer_get_barrier(st));
        ++st;
      };
      // Step i of the iterator: a key block, or (sparse) a chunk of pooled means.
      auto load_k_step = [&](int i) {
        if constexpr (kGatherKV) {
          return gather_block(params.k, params.k_head_stride, uint32_t(params.k_row_stride * 2), sK, pipeline_k,
                              st_k, iter.block(i));
        }
        if constexpr (kSparse) {
          if (iter.is_corr(i)) return load_means(params.tma_k_mean, sK, pipeline_k, st_k, iter.chunk(i));
          if (iter.bad_id(i))  // reported once per step (at the K load)
            poison(kErrBlockId, i, iter.listed_id(i));
          return load_k(rows_of(iter.block(i)));
        }
        load_k(rows_of(iter.block(i)));
      };
      auto load_v_step = [&](int i) {
        if constexpr (kGatherKV) {
          return gather_block(params.v, params.v_head_stride, uint32_t(params.v_row_stride * 2), sV, pipeline_v,
                              st_v, iter.block(i));
        }
        if constexpr (kSparse) {
          if (iter.is_corr(i)) return load_means(params.tma_v_mean, sV, pipeline_v, st_v, iter.chunk(i));
        }
        load_v(rows_of(iter.block(i)));
      };
      if constexpr (kGatherKV) {
        // One inlined copy of each gather (K and V), not three: page 16, causal 32K went from 1.35x to 1.20x the
        // contiguous time with this loop (H200).
        for (int i = 0; i <= n_count; ++i) {
          if (i < n_count) load_k_step(i);
          if (i > 0) load_v_step(i - 1);
        }
      } else {
        load_k_step(0);
        for (int i = 1; i < n_count; ++i) {
          load_k_step(i);
          load_v_step(i - 1);
        }
        load_v_step(n_count - 1);
      }
    }
    return;
  }

  // ================================ consumers ================================
  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  const int mma_tidx = threadIdx.x - 128;
  const int cwg = wg_idx - 1;  // consumer warpgroup: query rows [64*cwg, 64*cwg + 64) of the tile
  Element* out_base = static_cast<Element*>(params.out);
  PipelineState st;  // consumer read state (same sequence for K and V), carried across tiles
  int q_phase = 0;
  int taken = 0;
  auto take = [&]() {
    const int s = taken & 1;
    storage.tile_full[s].wait((taken >> 1) & 1);
    const int t = storage.tile_ids[s];
    storage.tile_empty[s].arrive();
    ++taken;
    return t;
  };
  auto tile_first = [&]() { return kDynamic ? take() : int(blockIdx.x); };
  auto tile_next = [&](int t) { return kDynamic ? take() : t + int(gridDim.x); };
  SP_TILE_LOOP(t) {
    const TileWork<Iterator> work = tile_work<Config, kSparse, kSplit, Iterator>(params, t);
    if (!work.valid) continue;
    const Iterator& iter = work.iter;
    const SeqSpan& seq = work.seq;
    const int n_count = iter.count();

    // Tile row -> (query row of the sequence, query head): dense, row0 + row of the tile's head; sparse (PackGQA),
    // packed row row0 + row = position * g + head % g. Rows past the sequence are computed but never stored.
    const int tile_rows = kSparse ? seq.q_len * params.group_size - work.row0 : seq.q_len - work.row0;
    auto row_pos = [&](int row) -> int {
      if constexpr (kSparse) return (work.row0 + row) / params.group_size;
      else return work.row0 + row;
    };
    auto row_head = [&](int row) -> int {
      if constexpr (kSparse) return work.q_head + (work.row0 + row) % params.group_size;
      else return work.q_head;
    };
    auto out_ptr = [&](int row) -> Element* {
      return out_base + int64_t(seq.q_start + row_pos(row)) * params.o_row_stride +
             int64_t(row_head(row)) * params.o_head_stride;
    };
    auto lse_ptr = [&](int row) -> float* {
      return params.lse + int64_t(row_head(row)) * params.lse_head_stride +
             int64_t(seq.q_start + row_pos(row)) * params.lse_row_stride;
    };

    // Split-KV partial outputs of this unit's rows.
    auto partial_o = [&](int row) -> float* {
      return params.o_partial + (int64_t(work.slot) * kBlockM + row) * kHeadDim;
    };
    auto partial_lse = [&](int row) -> float* { return params.lse_partial + int64_t(work.slot) * kBlockM + row; };
    const bool split_out = kSparse && kSplit && work.slot >= 0;

    if (n_count == 0 && split_out) {  // an empty share of the tile's steps: O = 0, lse = -inf
      for (int idx = mma_tidx; idx < kBlockM * (kHeadDim / 4); idx += Config::kNumMmaThreads) {
        const int row = idx / (kHeadDim / 4), ch = idx % (kHeadDim / 4);
        if (row < tile_rows) *reinterpret_cast<float4*>(partial_o(row) + ch * 4) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      if (mma_tidx < kBlockM && mma_tidx < tile_rows) *partial_lse(mma_tidx) = -INFINITY;
      continue;
    }
    if (n_count == 0) {  // no visible key for any row of the tile: O = 0, lse = -inf; a bad tile: NaN (work.bad)
      constexpr int kChunks = kHeadDim / 8;
      constexpr uint32_t kNaN = std::is_same_v<Element, cutlass::bfloat16_t> ? 0x7fc07fc0u : 0x7e007e00u;
      const uint32_t fill = work.bad ? kNaN : 0u;
      for (int idx = mma_tidx; idx < kBlockM * kChunks; idx += Config::kNumMmaThreads) {
        const int row = idx / kChunks, ch = idx % kChunks;
        if (row < tile_rows) *reinterpret_cast<uint4*>(out_ptr(row) + ch * 8) = make_uint4(fill, fill, fill, fill);
      }
      if (params.lse != nullptr && mma_tidx < kBlockM && mma_tidx < tile_rows)
        *lse_ptr(mma_tidx) = work.bad ? __int_as_float(0x7fc00000) : -INFINITY;
      if (work.bad && mma_tidx == 0) report_tile_error(params, work.bad, work.batch, work.kv_head, work.row0 / kBlockM);
      continue;
    }

    typename Config::TiledMmaQK mma_qk;
    typename Config::TiledMmaPV mma_pv;
    auto wg_qk = mma_qk.get_slice(cwg * 128);
    auto wg_pv = mma_pv.get_slice(cwg * 128);
    auto thr_qk = mma_qk.get_slice(mma_tidx);
    auto thr_pv = mma_pv.get_slice(mma_tidx);

    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Config::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Config::SmemLayoutVt{});
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
    Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    Tensor tOrP = make_tensor<Element>(acc_to_a_layout(tSrS.layout()));
    Tensor S_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    Tensor O_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    constexpr int kRows = decltype(size<0>(S_rc))::value;

    // Tile coordinates of this thread's accumulator elements (for the mask and the epilogue).
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

    auto apply_mask = [&](int n_block) {
      const int col0 = n_block * kBlockN;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        int lo, hi;
        iter.col_range(row_pos(get<0>(cS_rc(r, 0))), lo, hi);
        lo -= col0;
        hi -= col0;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S_rc); ++c) {
          const int col = get<1>(cS_rc(r, c));
          S_rc(r, c) = (col >= lo && col <= hi) ? S_rc(r, c) : -INFINITY;
        }
      }
    };
    // Correction step (sparse mode): column j of chunk c is pooled block J = c * kBlockN + j. Blocks to correct
    // (prunable, not listed) get logit + log|B_J| (raw units: log2|B_J| / scale_log2), all other columns -inf.
    // The listed bits of a correction step are gathered right after its S GEMM is issued (prepare_step), so their
    // global loads overlap the GEMM instead of delaying the softmax.
    uint32_t listed[kBlockN / 32] = {0, 0, 0, 0};
    int corr_chunk = 0, corr_cursor = 0;
    auto prepare_step = [&](int i) {
      if constexpr (kSparse) {
        if (iter.is_corr(i)) {
          corr_chunk = iter.chunk(i);
          if (corr_chunk < Config::kMaxCorrChunks) {
            CUTE_UNROLL
            for (int w = 0; w < kBlockN / 32; ++w) listed[w] = storage.listed_bits[corr_chunk * (kBlockN / 32) + w];
          } else {
            iter.listed_bits(corr_chunk, listed, corr_cursor);
          }
        }
      }
    };
    auto apply_correction = [&](int chunk) {
      if constexpr (kSparse) {
        const int J0 = chunk * kBlockN;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S_rc); ++c) {
          const int j = get<1>(cS_rc(0, c));
          const int J = J0 + j;
          // Selects, not listed[j / 32]: j is a runtime value and a dynamically indexed array would go to local memory.
          const uint32_t word = j < 64 ? (j < 32 ? listed[0] : listed[1]) : (j < 96 ? listed[2] : listed[3]);
          const bool todo = J < iter.n_prunable && !((word >> (j % 32)) & 1u);
          const int cnt = sp_min(params.block_size, seq.k_len - J * params.block_size);
          const float bias = cnt == params.block_size ? params.corr_bias_full
                                                      : __log2f(float(cnt)) / params.scale_log2;
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) S_rc(r, c) = todo ? S_rc(r, c) + bias : -INFINITY;
        }
      }
    };
    // Element-wise mask of step i (only called when iter.needs_mask(i)).
    auto mask_step = [&](int i) {
      if constexpr (kSparse) {
        if (iter.is_corr(i)) return apply_correction(corr_chunk);
      }
      apply_mask(iter.block(i));
    };
    // Key block of step i for the paged V-tail check (-1 for correction steps, which hold pooled means).
    auto v_block = [&](int i) -> int {
      if constexpr (kSparse) {
        if (iter.is_corr(i)) return -1;
      }
      return iter.block(i);
    };
    auto convert_p = [&]() {
      constexpr int N = decltype(size(tSrS))::value;
      cutlass::NumericArrayConverter<Element, float, N> conv;
      *reinterpret_cast<cutlass::Array<Element, N>*>(tOrP.data()) =
          conv(*reinterpret_cast<cutlass::Array<float, N> const*>(tSrS.data()));
    };
    auto rescale_o = [&](float (&scale)[kRows]) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O_rc); ++c) O_rc(r, c) *= scale[r];
      }
    };

    // A pingpong between the two consumer warpgroups (named barriers ordering their GEMM issue) was measured slower
    // with this mainloop on the H200 (causal 32K: 580 vs 614 TFLOP/s, 128K: 593 vs 602) and removed (bench/NOTES.md).

    // Paged KV: the rows of the last page beyond seqused_k are whatever the engine's cache holds (possibly NaN bit
    // patterns). Their keys are masked (the select replaces even a NaN logit by -inf, so P is exactly 0), but
    // 0 x NaN = NaN in O += P V, so the V rows of the tail block beyond k_len are zeroed in smem before the PV GEMM.
    // At most once per tile; contiguous KV never needs it (rows past a sequence belong to the next sequence or are
    // TMA zero-fill). Each warpgroup zeroes all tail rows itself and syncs only its own 128 threads (the other one
    // writes the same zeros: no cross-warpgroup barrier, so it cannot deadlock with the optional pingpong).
    // (The cp.async gather zero-fills those rows itself.)
    const int v_tail_block =
        (!kGatherKV && params.page_size != 0 && (seq.k_len % kBlockN) != 0) ? seq.k_len / kBlockN : -1;
    auto sanitize_v = [&](int stage, int n_block) {
      if (n_block < 0 || n_block != v_tail_block) return;
      Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), typename Config::SmemLayoutV{});
      constexpr int kChunks = kHeadDim / 8;
      const int valid = seq.k_len - n_block * kBlockN;
      for (int idx = mma_tidx % 128; idx < (kBlockN - valid) * kChunks; idx += 128) {
        const int row = valid + idx / kChunks, ch = idx % kChunks;
        *reinterpret_cast<uint4*>(&sV(row, ch * 8, stage)) = make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> visible to wgmma (async proxy)
      cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
    };

    // A stage filled by cp.async (generic proxy) is read by wgmma (async proxy): fence after the barrier wait, as
    // the PTX memory model asks. Measured free (H200, page 16, causal 32K: 19.62 ms with it, 19.63 without, 19.78
    // with one fence per step after waiting V(i-1) early), so it stays.
    auto wait_kv = [&](Pipeline& pipe, PipelineState const& s) {
      pipe.consumer_wait(s);
      if constexpr (kGatherKV) cutlass::arch::fence_view_async_shared();
    };

    OnlineSoftmax<kRows> softmax(params.scale_log2);
    float o_scale[kRows];

    if constexpr (kSparse) {
      // PackGQA gather of Q: this warpgroup's 64 tile rows, 16-byte loads into the swizzled tile (addressed
      // through the tensor, as in the epilogue), zeros for rows past the sequence; then make the generic-proxy
      // stores visible to wgmma. Each warpgroup's S GEMM reads only its own 64 rows.
      Tensor sQw = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
      constexpr int kChunks = kHeadDim / 8;
      const Element* q_base = static_cast<const Element*>(params.q);
      const int tq = mma_tidx % 128;
      if constexpr (kPersistent) cutlass::arch::NamedBarrier::sync(128, 1 + cwg);  // previous epilogue read these rows
      uint4 vals[64 * kChunks / 128];
      CUTE_UNROLL
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const int idx = tq + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        vals[k] = row < tile_rows
                      ? __ldg(reinterpret_cast<const uint4*>(q_base + int64_t(seq.q_start + row_pos(row)) *
                                                                          params.q_row_stride +
                                                             int64_t(row_head(row)) * params.q_head_stride + ch * 8))
                      : make_uint4(0, 0, 0, 0);
      }
      CUTE_UNROLL
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const int idx = tq + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        *reinterpret_cast<uint4*>(&sQw(row, ch * 8)) = vals[k];
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
      // Bitmap of the listed blocks in the correction chunks (both warpgroups, named barrier 5): the first sync
      // also ensures the previous tile's correction steps are done with it.
      const int words = sp_min(iter.n_chunks, Config::kMaxCorrChunks) * (kBlockN / 32);
      if (words > 0) {
        cutlass::arch::NamedBarrier::sync(Config::kNumMmaThreads, 5);
        for (int w = mma_tidx; w < words; w += Config::kNumMmaThreads) storage.listed_bits[w] = 0u;
        cutlass::arch::NamedBarrier::sync(Config::kNumMmaThreads, 5);
        for (int k = mma_tidx; k < iter.n_listed; k += Config::kNumMmaThreads) {
          const int J = __ldg(iter.ids + k);
          if (J >= 0 && J < words * 32) atomicOr(&storage.listed_bits[J / 32], 1u << (J % 32));
        }
        cutlass::arch::NamedBarrier::sync(Config::kNumMmaThreads, 5);
      }
    } else {
      storage.barrier_q.wait(q_phase);
      q_phase ^= 1;
    }

    // Block 0 (descending order: the diagonal block first under causal).
    wait_kv(pipeline_k, st);
    wgmma_batch<false>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS, true);
    prepare_step(0);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(st);
    if (iter.needs_mask(0)) mask_step(0);
    softmax.template step<true>(S_rc, o_scale);
    convert_p();

    CUTE_NO_UNROLL
    for (int i = 1; i < n_count; ++i) {
      PipelineState st_v = st;  // V of block i-1
      ++st;
      wait_kv(pipeline_k, st);
      wgmma_batch<false>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS, true);
      if (i > 1) rescale_o(o_scale);
      wait_kv(pipeline_v, st_v);
      sanitize_v(st_v.index(), v_block(i - 1));
      wgmma_batch<true>(mma_pv, tOrP, tOrV(_, _, _, st_v.index()), tOrO, i == 1);
      prepare_step(i);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(st);
      if (iter.needs_mask(i)) mask_step(i);
      softmax.template step<false>(S_rc, o_scale);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      pipeline_v.consumer_release(st_v);
      convert_p();
    }
    wait_kv(pipeline_v, st);
    sanitize_v(st.index(), v_block(n_count - 1));
    if (n_count > 1) rescale_o(o_scale);
    wgmma_batch<true>(mma_pv, tOrP, tOrV(_, _, _, st.index()), tOrO, n_count == 1);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    pipeline_v.consumer_release(st);
    ++st;

    // ================================ epilogue ================================
    float inv_sum[kRows], lse[kRows];
    softmax.finalize(params.softmax_scale, inv_sum, lse);
    {  // a bad page or block id met by the producer while loading this tile (device_checks.h): its rows are NaN
      const int n = kDynamic ? taken - 1 : 0;
      if (storage.poisoned[n & 3] == n + 1) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) inv_sum[r] = lse[r] = __int_as_float(0x7fc00000);
        if (mma_tidx == 0) {
          const int4 bad = storage.poison_info[n & 3];
          const int bound = bad.x == kErrBlockTable ? params.num_pages
                                                    : (seq.k_len + params.block_size - 1) / params.block_size;
          report_device_error(params.err, bad.x, work.batch, bad.y, bad.z, bound);
        }
      }
    }
    rescale_o(inv_sum);

    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    if (split_out) {  // float32 partial O and LSE straight from registers (column pairs are adjacent: 8-byte stores)
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rc(r, 0));
        if (row >= tile_rows) continue;
        float* dst = partial_o(row);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O_rc); c += 2)
          *reinterpret_cast<float2*>(dst + get<1>(cO_rc(r, c))) = make_float2(O_rc(r, c), O_rc(r, c + 1));
        if ((mma_tidx % 4) == 0) *partial_lse(row) = lse[r];
      }
      continue;
    }
    if (params.lse != nullptr && (mma_tidx % 4) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rc(r, 0));
        if (row < tile_rows) *lse_ptr(row) = lse[r];
      }
    }

    // O: registers -> smem (this warpgroup's 64 rows of the Q buffer; its own QK GEMMs are complete) -> 16-byte stores.
    Tensor sO = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
    Tensor tOsO = thr_pv.partition_C(sO);
    {
      constexpr int N = decltype(size(tOrO))::value;
      cutlass::NumericArrayConverter<Element, float, N> conv;
      Tensor tOrOc = make_tensor_like<Element>(tOrO);
      *reinterpret_cast<cutlass::Array<Element, N>*>(tOrOc.data()) =
          conv(*reinterpret_cast<cutlass::Array<float, N> const*>(tOrO.data()));
      copy(tOrOc, tOsO);
    }
    cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
    {
      constexpr int kChunks = kHeadDim / 8;
      const int t = mma_tidx % 128;
      CUTE_UNROLL
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const int idx = t + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        // Address through the tensor: the swizzle of a GMMA smem layout acts on byte addresses of the smem pointer,
        // so SmemLayoutQ{}(row, col) alone is not the element offset.
        const uint4 val = *reinterpret_cast<const uint4*>(&sO(row, ch * 8));
        if (row < tile_rows) *reinterpret_cast<uint4*>(out_ptr(row) + ch * 8) = val;
      }
    }
    if constexpr (!kSparse) storage.barrier_q_empty.arrive();  // done with the Q/O smem buffer of this tile
  }  // tile loop
}

}  // namespace sparse_prefill::cuda
