// Block-schedule policies: which tiles a launch has and what one tile's work is (its sequence, the key blocks it
// visits through the iterators of block_schedule.h, and the device-side checks of its sequence and index segment).
//   DenseRange: tiles of 128 query rows of one query head; the dense key range of DenseBlockIterator (causal, window).
//   CsrBlocks:  PackGQA tiles of 128 packed rows per (sequence, KV head); the CSR list of the tile's index segment, or
//               the full list (SparseFwdArgs::full_list, dense attention through the split-KV plan), plus the mean
//               correction chunks when the fusion policy asks for them (SparseBlockIterator).
// Producer and consumers evaluate work() identically for a unit, so no block list travels between warpgroups.
#pragma once

#include <cstdint>

#include "cuda/attention/block_schedule.h"
#include "cuda/attention/fwd_problem.h"
#include "cuda/attention/scheduler.h"
#include "cuda/common/device_checks.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

// Tile order: heads fastest (the g query heads of a KV head share its K/V blocks in L2), then m-blocks from the
// last (heaviest under causal) to the first, then sequences.
template <class Config>
struct DenseRange {
  static constexpr bool kPackGqa = false;
  static constexpr bool kEmptySteps = false;  // no step without keys
  static constexpr bool kListedIds = false;   // no block ids read from an index
  using Iterator = DenseBlockIterator<Config::kBlockM, Config::kBlockN>;
  struct Params {};
  static Params to_params(const FwdArgs&, const SparseFwdArgs*) { return {}; }
  static int64_t num_tiles(const FwdProblem& pr) { return int64_t(pr.num_q_heads) * pr.num_m_blocks * pr.batch; }

  struct Work {
    Iterator iter;
    SeqSpan seq;
    int batch, q_head, kv_head;
    int row0;    // first query row (m_block * 128)
    bool valid;  // false: the tile lies beyond its sequence
    int bad;     // DeviceErrorCode of the tile's sequence: `seq` is the clipped span, no step, NaN rows
    __device__ __forceinline__ int kv_head_mem(const FwdProblem&) const { return kv_head; }
    __device__ __forceinline__ int tile_rows(const FwdProblem&) const { return seq.q_len - row0; }
    __device__ __forceinline__ int row_pos(const FwdProblem&, int row) const { return row0 + row; }
    __device__ __forceinline__ int row_head(const FwdProblem&, int) const { return q_head; }
  };

  template <class Scheduler, class Fusion, class P>
  __device__ __forceinline__ static Work work(const P& p, const typename Scheduler::Params&, const WorkUnit& u) {
    const FwdProblem& pr = p.problem;
    Work w;
    const int t = u.tile;
    w.q_head = t % pr.num_q_heads;
    const int r = t / pr.num_q_heads;
    const int m_block = pr.num_m_blocks - 1 - r % pr.num_m_blocks;
    w.batch = r / pr.num_m_blocks;
    w.kv_head = w.q_head / pr.group_size;
    w.seq = load_seq_span(pr.cu_seqlens_q, pr.cu_seqlens_k, pr.seqused_k, w.batch);
    // Device-side check (device_checks.h): a bad sequence runs no step over its clipped rows, which come out NaN.
    w.bad = seq_violation(w.seq, w.batch, pr.limits);
    if (w.bad) w.seq = clip_bad_span(w.seq, pr.total_q);
    w.row0 = m_block * Config::kBlockM;
    // (a bad sequence: m-block 0 of head 0 always runs, possibly with no row, and reports it)
    w.valid = w.row0 < w.seq.q_len || (w.bad && m_block == 0 && w.q_head == 0);
    if (!w.valid) return w;
    w.iter = Iterator::make(m_block, w.seq, pr.window_left, pr.window_right);
    return w;
  }

  // Reports the violation of a bad tile (Work::bad) with the values that show it (re-read: cold path).
  template <class P>
  __device__ __forceinline__ static void report_bad_tile(const P& p, const Work& w) {
    const FwdProblem& pr = p.problem;
    const SeqSpan s = load_seq_span(pr.cu_seqlens_q, pr.cu_seqlens_k, pr.seqused_k, w.batch);
    report_seq_error(pr.err, w.bad, w.batch, s, pr.limits);
  }
  // Bound of a bad block id the producer met (none here).
  template <class P>
  __device__ __forceinline__ static int id_bound(const P&, const SeqSpan&) { return 0; }
};

// Block-sparse tile order (sparse_tile_coord, block_schedule.h): the heavy tiles of every sequence first, KV heads
// fastest or (SparseFwdArgs::order_band > 1) in turn within bands.
template <class Config>
struct CsrBlocks {
  static constexpr bool kPackGqa = true;
  static constexpr bool kEmptySteps = true;  // block(i) = -1: past the keys, or a bad id (zero-filled, masked)
  static constexpr bool kListedIds = true;
  using Iterator = SparseBlockIterator<Config::kBlockN>;
  // The CSR index (SparseFwdArgs, docs/semantics.md). Segment of (b, kvh, tile):
  // H * cu_tiles[b] + kvh * (cu_tiles[b+1] - cu_tiles[b]) + tile over H virtual KV heads.
  struct Params {
    const int32_t* seg_start;
    const int32_t* seg_end;
    const int32_t* block_ids;
    const int32_t* cu_tiles;   // [B+1] tiles per sequence, prefix-summed
    const int32_t* cu_blocks;  // [B+1] pooled blocks per sequence, prefix-summed
    int num_segments, num_block_ids;  // extents the kernel never reads beyond (device_checks.h)
    int block_size;
    int overflow_marks;  // SparseFwdArgs::overflow_marks
    // Dense attention through the sparse kernel (SparseFwdArgs::full_list): every tile visits the full list of the
    // blocks it sees (SparseBlockIterator::full_list_blocks), causal when window_right == 0, non-causal when < 0.
    int full_list;
    int order_band;  // sparse_tile_coord's band (SparseFwdArgs::order_band)
  };
  static Params to_params(const FwdArgs&, const SparseFwdArgs* s) {
    Params p;
    p.seg_start = s->segment_start;
    p.seg_end = s->segment_end;
    p.block_ids = s->block_ids;
    p.cu_tiles = s->cu_tiles;
    p.cu_blocks = s->cu_blocks;
    p.num_segments = s->num_segments;
    p.num_block_ids = s->num_block_ids;
    p.block_size = s->block_size;
    p.overflow_marks = s->overflow_marks ? 1 : 0;
    p.full_list = s->full_list ? 1 : 0;
    p.order_band = s->order_band;
    return p;
  }
  static int64_t num_tiles(const FwdProblem& pr) { return int64_t(pr.num_kv_heads) * pr.num_m_blocks * pr.batch; }

  struct Work {
    Iterator iter;
    SeqSpan seq;
    int batch, kv_head;  // kv_head: virtual with head sub-groups
    int slot;            // split-KV: float32 partial slot of this unit (-1: the unit is the whole tile, writes out)
    int q_head;          // first query head of the tile (kv_head * g)
    int row0;            // first packed row (tile * 128)
    bool valid;          // false: beyond its sequence, or run as split-KV units elsewhere
    int bad;             // DeviceErrorCode of the sequence / segment: the clipped span, no step, NaN rows
    __device__ __forceinline__ int kv_head_mem(const FwdProblem& pr) const {
      return geometry::memory_kv_head(kv_head, pr.num_subgroups);
    }
    // Packed row row0 + row = position * g + head % g. Rows past the sequence are computed but never stored.
    __device__ __forceinline__ int tile_rows(const FwdProblem& pr) const { return seq.q_len * pr.group_size - row0; }
    __device__ __forceinline__ int row_pos(const FwdProblem& pr, int row) const {
      return pr.group_div.position(row0 + row);
    }
    __device__ __forceinline__ int row_head(const FwdProblem& pr, int row) const {
      return q_head + pr.group_div.head(row0 + row);
    }
  };

  template <class Scheduler, class Fusion, class P>
  __device__ __forceinline__ static Work work(const P& p, const typename Scheduler::Params& sp, const WorkUnit& u) {
    const FwdProblem& pr = p.problem;
    const Params& ix = p.schedule;
    Work w;
    w.slot = u.slot;
    w.valid = u.valid;
    if (!w.valid) return w;
    const SparseTileCoord c = sparse_tile_coord(u.tile, pr.num_kv_heads, pr.batch, pr.num_m_blocks, ix.order_band);
    w.batch = c.batch;
    w.kv_head = c.kv_head;
    w.q_head = c.kv_head * pr.group_size;
    w.seq = load_seq_span(pr.cu_seqlens_q, pr.cu_seqlens_k, pr.seqused_k, c.batch);
    w.row0 = c.tile * Config::kBlockM;
    // Device-side checks (device_checks.h), the split plan's tile_steps makes the same ones: a bad sequence's tiles
    // (over its clipped rows) and a tile whose segment lies outside the index run no step and write NaN.
    const bool full = ix.full_list != 0;  // dense over PackGQA tiles: no index arrays
    const bool corr = Fusion::on(p.fusion);
    w.bad = seq_violation(w.seq, c.batch, pr.limits);
    int tile_base = 0, tiles = 0, lo = 0, n_listed = 0;
    if (!w.bad) {
      tile_base = full ? 0 : ix.cu_tiles[c.batch];
      tiles = full ? Iterator::packed_tiles(w.seq.q_len, pr.group_size) : ix.cu_tiles[c.batch + 1] - tile_base;
      w.valid = c.tile < tiles;
      if (!w.valid) return w;
      if (full) {
        n_listed = Iterator::full_list_blocks(w.row0, pr.group_size, w.seq.q_len, w.seq.k_len, pr.window_right >= 0);
      } else {
        w.bad = sparse_index_violation(ix.seg_start, ix.seg_end, pr.num_kv_heads * tile_base + c.kv_head * tiles +
                                       c.tile, ix.num_segments, ix.num_block_ids, ix.overflow_marks != 0, nullptr,
                                       c.batch, w.seq.k_len, ix.block_size, Fusion::mean_rows(p.fusion), lo,
                                       n_listed);
        if (!w.bad && lo == kOverflowStart) {  // an overflowed segment (the index is causal)
          n_listed = Iterator::full_list_blocks(w.row0, pr.group_size, w.seq.q_len, w.seq.k_len, true, ix.block_size);
        }
      }
    }
    if (w.bad) {
      if (seq_violation(w.seq, c.batch, pr.limits)) w.seq = clip_bad_span(w.seq, pr.total_q);
      // Tile 0 of KV head 0 always runs (possibly with no row): it reports a sequence left without rows.
      w.valid = c.tile < Iterator::packed_tiles(w.seq.q_len, pr.group_size) || (c.tile == 0 && c.kv_head == 0);
      w.iter = Iterator::make(nullptr, 0, 0, w.seq.q_len, 0, ix.block_size, false);
      return w;
    }
    const int p_first = pr.group_div.position(w.row0);
    if (Scheduler::split_elsewhere(sp, u, [&] {
          return Iterator::planned_steps(n_listed, p_first, w.seq.q_len, w.seq.k_len, ix.block_size, corr);
        })) {
      w.valid = false;  // a split tile: its parts are units [0, n_split_units)
      return w;
    }
    w.iter = Iterator::make(full || lo == kOverflowStart ? nullptr : ix.block_ids + lo, n_listed, p_first,
                            w.seq.q_len, w.seq.k_len, ix.block_size, corr);
    if (full && pr.window_right < 0) w.iter.make_non_causal();
    Scheduler::apply_split(u, w.iter);
    return w;
  }

  template <class P>
  __device__ __forceinline__ static void report_bad_tile(const P& p, const Work& w) {
    const FwdProblem& pr = p.problem;
    const Params& ix = p.schedule;
    const int code = w.bad, b = w.batch;
    if (code == kErrSegment || code == kErrCuBlocks) {
      const int tile_base = ix.cu_tiles[b], tiles = ix.cu_tiles[b + 1] - tile_base;
      const int seg = pr.num_kv_heads * tile_base + w.kv_head * tiles + w.row0 / Config::kBlockM;
      if (code == kErrCuBlocks) {
        report_device_error(pr.err, code, b, b, ix.cu_blocks[b], ix.cu_blocks[b + 1]);
      } else {
        const bool in = seg >= 0 && seg < ix.num_segments;
        report_device_error(pr.err, code, b, seg, in ? ix.seg_start[seg] : -1, in ? ix.seg_end[seg] : -1);
      }
      return;
    }
    const SeqSpan s = load_seq_span(pr.cu_seqlens_q, pr.cu_seqlens_k, pr.seqused_k, b);
    report_seq_error(pr.err, code, b, s, pr.limits);
  }
  // Bound of a bad block id the producer met: the sequence's block count.
  template <class P>
  __device__ __forceinline__ static int id_bound(const P& p, const SeqSpan& s) {
    return (s.k_len + p.schedule.block_size - 1) / p.schedule.block_size;
  }
};

}  // namespace sparse_prefill::cuda
