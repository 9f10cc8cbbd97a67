// The index's workspace layout: bounds, carving, and the public sizing / re-carving entry points.
#include "cuda/index/layout.h"

#include <algorithm>

#include "core/contract.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/common/workspace.h"
#include "cuda/cuda_backend.h"

namespace sparse_prefill::cuda {
namespace index_stage {

int64_t causal_capacity(int64_t max_tiles, int batch, int64_t max_seqlen_k, int group_size, int block_size,
                        int kv_heads) {
  // Tile j places before the last of its sequence (j >= 1) ends at least 128 (j - 1) packed rows before the
  // sequence's last row, so its last row lies d_j >= floor(128 (j - 1) / g) positions before the last query and sees
  // at most V(j) = ceil((max_seqlen_k - d_j) / B) blocks (V(0) = nb_max). V falls with j, so over at most max_tiles
  // tiles in `batch` sequences the sum of V is largest for equal sequences: P(q) or P(q + 1) tiles each, P the
  // prefix sums of V.
  if (batch <= 0 || max_tiles <= 0) return 0;
  const int64_t q = max_tiles / batch, r = max_tiles % batch;
  int64_t p_q = 0, p_q1 = 0;
  for (int64_t j = 0; j <= q; ++j) {
    const int64_t d = j == 0 ? 0 : kTileRows * (j - 1) / group_size;
    const int64_t v = d >= max_seqlen_k ? 0 : (max_seqlen_k - d + block_size - 1) / block_size;
    if (v == 0) {  // and every later tile: P stops growing
      p_q1 = p_q;
      break;
    }
    p_q1 = p_q + v;
    if (j < q) p_q = p_q1;
  }
  return kv_heads * ((batch - r) * p_q + r * p_q1);
}

int probe_splits(int64_t total_q, int group_size, int kv_heads, int64_t probe_words, int sms) {
  if (probe_words <= 0) return 0;
  const int64_t tiles = std::max<int64_t>(1, geometry::num_tiles(total_q, group_size));
  const int64_t ctas = (tiles + kProbeTilesPerCta - 1) / kProbeTilesPerCta * kv_heads;  // ignores per-sequence rounding
  const int64_t want = 2 * int64_t(sms) / ctas;  // rounded down: all split CTAs in one wave
  return int(std::max<int64_t>(1, std::min(want, probe_words)));
}

Bounds bounds_of(const IndexBinding& b, const SelectionParams& params) {
  const VirtualHeads h = virtual_heads(b.num_kv_heads, b.num_q_heads / b.num_kv_heads, b.num_subgroups);
  const int block_size = params.block_size;
  Bounds bd;
  bd.max_tiles = b.total_q * h.group / kTileRows + b.batch;
  bd.nb_max = geometry::num_blocks(b.max_seqlen_k, block_size);
  bd.max_blocks = int64_t(b.batch) * bd.nb_max;
  if (!b.paged) bd.max_blocks = std::min(bd.max_blocks, b.total_k / block_size + b.batch);
  bd.max_segments = int64_t(h.kv) * bd.max_tiles;
  // Per-tile lists within the causal bound; union mode adds one list of at most nb_b ids per (sequence, head).
  const int64_t causal = causal_capacity(bd.max_tiles, b.batch, b.max_seqlen_k, h.group, block_size, h.kv) +
                         (params.union_lists ? int64_t(h.kv) * bd.max_blocks : 0);
  if (params.max_kept_blocks < 0 && causal > INT32_MAX) {
    throw ArgumentError("max_kept_blocks", "the default budget, the causal bound of these shapes, is " +
                                               std::to_string(causal) + " block ids, past the int32 offsets of "
                                               "the index: pass a budget below 2^31");
  }
  bd.capacity = params.max_kept_blocks < 0 ? causal : std::min(params.max_kept_blocks, causal);
  bd.probe_words = is_probe_rule(params.rule) || is_per_key_rule(params.rule) ? (bd.nb_max + 31) / 32 : 0;
  bd.probe_splits = is_probe_rule(params.rule) ? probe_splits(b.total_q, h.group, h.kv, bd.probe_words, num_sms()) : 0;
  bd.key_rank = params.rule == SelectionRule::kKeyMax ? params.key_rank : 0;
  bd.exact_keys = params.rule == SelectionRule::kExactMax;
  bd.split_kv = split_planned(b.split_kv, b.max_seqlen_q, b.max_seqlen_k);
  return bd;
}

// Carves the workspace; with base == nullptr only sums the sizes.
size_t carve(const IndexBinding& b, const Bounds& bd, char* base, DeviceIndex* idx) {
  WorkspaceCarver ws(base);
  auto take = [&](size_t bytes) { return ws.take(bytes); };
  const size_t pooled = size_t(bd.max_blocks) * b.num_kv_heads * b.head_dim;
  DeviceIndex d;
  d.segment_start = reinterpret_cast<int32_t*>(take(bd.max_segments * 4));
  d.segment_end = reinterpret_cast<int32_t*>(take(bd.max_segments * 4));
  d.block_ids = reinterpret_cast<int32_t*>(take(bd.capacity * 4));
  d.cu_blocks = reinterpret_cast<int32_t*>(take((b.batch + 1) * 4));
  d.cu_tiles = reinterpret_cast<int32_t*>(take((b.batch + 1) * 4));
  d.k_mean = reinterpret_cast<float*>(take(pooled * 4));
  d.v_mean = reinterpret_cast<float*>(take(pooled * 4));
  d.k_mean_lowp = take(pooled * 2);
  d.v_mean_lowp = take(pooled * 2);
  if (b.dtype == DType::kFloat8E4M3) {  // the sparse kernel's e4m3 copies (index_stage.h)
    d.k_mean_kernel = take(pooled);
    d.v_mean_kernel = take(pooled);
  } else {
    d.k_mean_kernel = d.k_mean_lowp;
    d.v_mean_kernel = d.v_mean_lowp;
  }
  d.counters = reinterpret_cast<unsigned long long*>(take(kNumCounters * 8));
  if (bd.probe_words) {
    d.probe_bits = reinterpret_cast<uint32_t*>(take(size_t(bd.max_segments * bd.probe_words) * 4));
    d.probe_words = bd.probe_words;
    d.probe_splits = bd.probe_splits;
    if (bd.probe_splits > 1)  // [split][virtual KV head][tile][row][2]: (reference, sum) of each packed row
      d.probe_partials = reinterpret_cast<float*>(
          take(size_t(bd.probe_splits) * bd.max_segments * kTileRows * 2 * sizeof(float)));
  }
  if (bd.key_rank) {  // key_basis.cu: moment and basis per (sequence, KV head), K' per key row of the pooled blocks
    const size_t heads = size_t(b.batch) * b.num_kv_heads;
    const size_t splits = size_t(key_moment_splits(b.batch, b.num_kv_heads));
    d.key_moment = reinterpret_cast<float*>(take(splits * heads * b.head_dim * b.head_dim * sizeof(float)));
    d.key_basis = reinterpret_cast<float*>(take(heads * b.head_dim * bd.key_rank * sizeof(float)));
    d.key_rows = bd.max_blocks * b.block_size;
    d.key_proj = take(size_t(b.num_kv_heads) * d.key_rows * bd.key_rank * 2);
    d.key_radius = reinterpret_cast<float*>(take(size_t(b.num_kv_heads) * bd.max_blocks * sizeof(float)));
  }
  if (bd.exact_keys) {  // exact_max.cu: every key row of the pooled blocks in e4m3 units of 64, and their scales
    d.key_rows = bd.max_blocks * b.block_size;
    d.exact_keys = take(size_t(b.num_kv_heads) * d.key_rows * b.head_dim);
    d.exact_key_scales =
        reinterpret_cast<float*>(take(size_t(b.num_kv_heads) * (d.key_rows / kExactUnitKeys) * sizeof(float)));
  }
  const int sms = num_sms();
  char* launch = take(sparse_launch_workspace_bytes(sms, b.head_dim, bd.split_kv));
  if (base) d.launch = carve_sparse_launch_workspace(launch, sms, b.head_dim, bd.split_kv);
  if (idx) *idx = d;
  return ws.bytes();
}

}  // namespace index_stage

using index_stage::Bounds;

size_t index_workspace_bytes(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  const IndexBinding b = bind_index(in, p, params);
  return index_stage::carve(b, index_stage::bounds_of(b, params), nullptr, nullptr);
}

DeviceIndex carve_index(const IndexBinding& b, const SelectionParams& params, void* workspace) {
  const Bounds bd = index_stage::bounds_of(b, params);
  DeviceIndex d;
  const size_t bytes = index_stage::carve(b, bd, static_cast<char*>(workspace), &d);
  d.workspace_bytes = bytes;
  d.block_size = params.block_size;
  d.correction = params.correction;
  d.max_segments = bd.max_segments;
  d.max_blocks = bd.max_blocks;
  d.capacity = bd.capacity;
  d.num_subgroups = b.num_subgroups;
  return d;
}

}  // namespace sparse_prefill::cuda
