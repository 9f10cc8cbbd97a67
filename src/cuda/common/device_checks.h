// Device-side argument checks: what every kernel checks about the values that live on the device
// (cu_seqlens, seqused_k, block_table, index arrays) before it uses them to address memory, and the device error word
// that records the first violation for check_errors() (sparse_prefill/attention.h).
//
// The rule: a kernel never addresses memory from a device value it has not bounded. The checks sit where the values
// are read once per tile or per sequence (tile setup, the index stage's plan), not in the inner loops; the exceptions
// are the block_table page ids and listed block ids, checked where the producer already loads them (one compare).
// A sequence that fails is skipped (its tiles run no step) and its rows that lie inside q come out NaN; a bad page or
// block id turns its load into a zero-filled box / masked step and the tile's rows NaN. Either way the first
// violation lands in the error word, with the argument, the sequence and the offending value.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "cuda/attention/block_schedule.h"

namespace sparse_prefill::cuda {

// Codes of DeviceError::code; the host turns them into messages naming the argument (device_errors.cu).
enum DeviceErrorCode : int {
  kErrNone = 0,
  kErrCuQStart = 1,        // cu_seqlens_q[0] = value != 0
  kErrCuQDecreasing = 2,   // cu_seqlens_q[seq + 1] = value < cu_seqlens_q[seq] = bound
  kErrCuQRows = 3,         // cu_seqlens_q[seq + 1] = value > bound = the rows of q
  kErrCuQLast = 4,         // cu_seqlens_q[B] = value != bound = the rows of q
  kErrMaxSeqlenQ = 5,      // sequence seq has value queries > max_seqlen_q = bound
  kErrCuKStart = 6,        // the same four for cu_seqlens_k against the rows of k
  kErrCuKDecreasing = 7,
  kErrCuKRows = 8,
  kErrCuKLast = 9,
  kErrMaxSeqlenK = 10,     // sequence seq has value keys > max_seqlen_k = bound
  kErrSequsedNegative = 11,  // seqused_k[seq] = value < 0
  kErrSequsedPages = 12,   // seqused_k[seq] = value > bound = the rows block_table row seq's pages hold
  kErrBlockTable = 13,     // block_table[seq, index] = value outside [0, bound = num_pages)
  kErrSegment = 14,        // index segment `index` of sequence seq: [value, bound) outside the block id array
  kErrBlockId = 15,        // a segment of sequence seq lists block id value outside [0, bound = its block count)
  kErrCuBlocks = 16,       // index.cu_blocks[seq] .. [seq + 1] = value .. bound do not hold seq's pooled blocks
  kErrDescale = 17,        // FP8 descale `value` (0 q, 1 k, 2 v) of (sequence seq, KV head index) is negative
  kErrNumCodes
};

// The device error word: 32 bytes, one per device (a __device__ variable of the library, device_errors.cu), so it
// needs no allocation, survives CUDA-graph capture (kernels take its fixed address) and works with any workspace.
// The first violation wins (atomicCAS on code); check_errors() reads and clears it.
struct DeviceError {
  int code, seq, index, value, bound, pad0, pad1, pad2;
};
static_assert(sizeof(DeviceError) == 32, "the error word is read as 32 bytes");

// The word of the current device (cached per device; cudaGetSymbolAddress is not a stream operation).
DeviceError* device_error_word();

#if defined(__CUDACC__)
// Records the first violation of the launch. Cold path: only taken on a bad value.
__device__ __forceinline__ void report_device_error(DeviceError* e, int code, int seq, int index, int value,
                                                    int bound) {
  if (e == nullptr) return;
  if (atomicCAS(&e->code, 0, code) == 0) {
    e->seq = seq;
    e->index = index;
    e->value = value;
    e->bound = bound;
  }
}
#endif

// What a sequence's span may be: the extents of the arrays its values address and the launch's bounds.
struct SeqLimits {
  int batch = 0;
  int total_q = 0;         // rows of q
  int total_k = 0;         // contiguous KV: rows of k
  int64_t kv_capacity = 0; // paged KV: max_pages * page_size (0 with contiguous KV)
  int max_seqlen_q = 0, max_seqlen_k = 0;  // clamped to INT32_MAX
  bool paged = false;
};
// The limits of a call's validated problem: the one builder for the attention kernel, the split plan and the index
// stage, so that they agree on which sequences are skipped.
inline SeqLimits seq_limits(const AttentionInputs& in, const Problem& p) {
  SeqLimits l;
  l.batch = p.batch;
  l.total_q = int(p.total_q < INT32_MAX ? p.total_q : INT32_MAX);
  l.total_k = p.paged ? 0 : int(p.total_k < INT32_MAX ? p.total_k : INT32_MAX);
  l.kv_capacity = p.paged ? p.max_pages * p.page_size : 0;
  l.max_seqlen_q = int(in.max_seqlen_q < INT32_MAX ? in.max_seqlen_q : INT32_MAX);
  l.max_seqlen_k = int(in.max_seqlen_k < INT32_MAX ? in.max_seqlen_k : INT32_MAX);
  l.paged = p.paged;
  return l;
}

// 0 when sequence b's span (read by load_seq_span from cu_q[b], cu_q[b + 1] and cu_k / seqused_k) is valid, else
// the first violated DeviceErrorCode. Exactly the host's element checks (validate.cpp): first entries 0, monotone,
// last entries equal to the rows, lengths within max_seqlen_q / max_seqlen_k, seqused_k within the pages given.
// Every kernel that derives addresses from a span calls it first (same function: the index stage, the split plan and
// the attention kernel agree on which sequences are skipped).
SP_HOST_DEVICE int seq_violation(const SeqSpan& s, int b, const SeqLimits& lim) {
  const int q_end = s.q_start + s.q_len;  // = cu_q[b + 1] (load_seq_span)
  if (b == 0 && s.q_start != 0) return kErrCuQStart;
  // q_start < 0: an earlier entry decreased (cu_q[0] = 0); this sequence's rows would lie before q
  if (s.q_len < 0 || s.q_start < 0) return kErrCuQDecreasing;
  if (q_end > lim.total_q) return kErrCuQRows;
  if (b == lim.batch - 1 && q_end != lim.total_q) return kErrCuQLast;
  if (s.q_len > lim.max_seqlen_q) return kErrMaxSeqlenQ;
  if (lim.paged) {
    if (s.k_len < 0) return kErrSequsedNegative;
    if (s.k_len > lim.kv_capacity) return kErrSequsedPages;
  } else {
    const int k_end = s.k_start + s.k_len;
    if (b == 0 && s.k_start != 0) return kErrCuKStart;
    if (s.k_len < 0 || s.k_start < 0) return kErrCuKDecreasing;
    if (k_end > lim.total_k) return kErrCuKRows;
    if (b == lim.batch - 1 && k_end != lim.total_k) return kErrCuKLast;
  }
  if (s.k_len > lim.max_seqlen_k) return kErrMaxSeqlenK;
  return kErrNone;
}

// The span a skipped sequence's NaN rows are written to: its rows clipped to [0, total_q), no keys.
SP_HOST_DEVICE SeqSpan clip_bad_span(SeqSpan s, int total_q) {
  const int lo = sp_min(sp_max(s.q_start, 0), total_q);
  const int hi = sp_min(sp_max(s.q_start + sp_max(s.q_len, 0), lo), total_q);
  s.q_start = lo;
  s.q_len = hi - lo;
  s.k_start = 0;
  s.k_len = 0;
  return s;
}

// segment_start of a device index's segment that did not fit its block-id budget (SelectionParams::max_kept_blocks):
// the segment lists every block its tile sees (the full list, taken from the geometry), and its segment_end holds
// that count for the host copy. Only the index stage writes it (SparseFwdArgs::overflow_marks); in a caller's view it
// is a bad segment like any other negative start.
constexpr int32_t kOverflowStart = -1;

// 0, or kErrSegment / kErrCuBlocks, for segment `seg` of a valid sequence b with k_len keys. The segment is read only
// when it lies inside the segment arrays, and its range [lo, lo + n) must lie inside the block ids; with
// overflow_marks, lo = kOverflowStart is a full list (n = 0 here: the caller counts it from the geometry). With
// cu_blocks (correction on), the sequence's pooled rows must be its ceil(k_len / block_size) blocks, inside the mean
// rows. The attention kernel (tile_work) and the split plan (tile_steps) both decide from it.
SP_HOST_DEVICE int sparse_index_violation(const int32_t* seg_start, const int32_t* seg_end, int seg, int num_segments,
                                          int num_ids, bool overflow_marks, const int32_t* cu_blocks, int b,
                                          int k_len, int block_size, int mean_rows, int& lo, int& n) {
  if (seg < 0 || seg >= num_segments) return kErrSegment;
  lo = seg_start[seg];
  const int hi = seg_end[seg];
  const bool full = overflow_marks && lo == kOverflowStart;
  if (!full && (lo < 0 || hi < lo || hi > num_ids)) return kErrSegment;
  n = full ? 0 : hi - lo;
  if (cu_blocks != nullptr) {
    const int c0 = cu_blocks[b], c1 = cu_blocks[b + 1];
    if (c0 < 0 || c1 - c0 != (k_len + block_size - 1) / block_size || c1 > mean_rows) return kErrCuBlocks;
  }
  return kErrNone;
}

#if defined(__CUDACC__)
// Reports sequence b's violation `code` with the values that show it (re-read: cold path).
__device__ __forceinline__ void report_seq_error(DeviceError* e, int code, int b, const SeqSpan& s,
                                              const SeqLimits& lim) {
  int index = b, value = 0, bound = 0;
  switch (code) {
    case kErrCuQStart: index = 0, value = s.q_start; break;
    case kErrCuQDecreasing: index = b + 1, value = s.q_start + s.q_len, bound = s.q_start; break;
    case kErrCuQRows: index = b + 1, value = s.q_start + s.q_len, bound = lim.total_q; break;
    case kErrCuQLast: index = b + 1, value = s.q_start + s.q_len, bound = lim.total_q; break;
    case kErrMaxSeqlenQ: value = s.q_len, bound = lim.max_seqlen_q; break;
    case kErrCuKStart: index = 0, value = s.k_start; break;
    case kErrCuKDecreasing: index = b + 1, value = s.k_start + s.k_len, bound = s.k_start; break;
    case kErrCuKRows: index = b + 1, value = s.k_start + s.k_len, bound = lim.total_k; break;
    case kErrCuKLast: index = b + 1, value = s.k_start + s.k_len, bound = lim.total_k; break;
    case kErrSequsedNegative: value = s.k_len; break;
    case kErrSequsedPages:
      value = s.k_len, bound = int(lim.kv_capacity < 0x7fffffff ? lim.kv_capacity : 0x7fffffff);
      break;
    case kErrMaxSeqlenK: value = s.k_len, bound = lim.max_seqlen_k; break;
    default: break;
  }
  report_device_error(e, code, b, index, value, bound);
}

// The page holding key `tok` of sequence `batch`: block_table[batch, tok / page_size], or -1 for an id outside
// [0, num_pages), which poison(kErrBlockTable, column, id) reports. Every paged K/V read looks its pages up here.
// Two widths, each as its caller had it: the attention kernel's KV sources (int keys: a 64-bit division is a software
// routine on the GPU; contiguous columns, read through the read-only cache, one unsigned compare) and the index stage
// (int64_t keys, KVArgs: any column stride). Both give the same page for num_pages >= 0.
template <class KvParams, class Key, class Poison>
__device__ __forceinline__ Key checked_page(const KvParams& p, int batch, Key tok, Poison& poison) {
  const Key col = geometry::page_column(tok, p.page_size);
  if constexpr (sizeof(Key) == 4) {
    const int page = __ldg(p.block_table + batch * p.block_table_stride + col);
    if (unsigned(page) < unsigned(p.num_pages)) return page;
    poison(kErrBlockTable, col, page);
  } else {
    const Key page = p.block_table[batch * p.block_table_stride + col * p.block_table_col_stride];
    if (page >= 0 && page < p.num_pages) return page;
    poison(kErrBlockTable, col, page);
  }
  return -1;
}
#endif

}  // namespace sparse_prefill::cuda
