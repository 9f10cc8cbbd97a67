// The index's workspace layout (host only): bounds from the shapes it is bound to, the virtual heads of head
// sub-groups, and the carving of one caller workspace into the index's arrays.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/index/index_stage.h"

namespace sparse_prefill::cuda::index_stage {

constexpr int kProbeTilesPerCta = 8;  // probe.cu: the tiles of one probe CTA, whose K loads they share

struct Bounds {
  int64_t max_tiles, max_blocks, max_segments, capacity, nb_max;
  int64_t probe_words;  // is_probe_rule(params.rule): words of each segment's probe bitmap (else 0)
  int probe_splits;     // is_probe_rule(params.rule): key splits of each probe CTA (probe_splits(), else 0)
  int key_rank;         // SelectionRule::kKeyMax: SelectionParams::key_rank (its basis and K' arrays), else 0
  bool exact_keys;      // SelectionRule::kExactMax: its e4m3 key units and their scales (exact_max.cu)
  bool split_kv;  // the attention launch over this index may run split-KV (split_planned): carve the split arrays
};

// The index's heads: with head sub-groups S, tiles and segments are over Hkv * S virtual KV heads of g / S query
// heads each (sparse.h); pooling and the pooled means stay per KV head in memory (virtual head v reads head v / S).
struct VirtualHeads {
  int kv;             // virtual KV heads: Hkv * S
  int group;          // query heads per virtual KV head: g / S
  int num_subgroups;  // S (BlockIndex::num_subgroups)
};
inline VirtualHeads virtual_heads(int num_kv_heads, int group_size, int num_subgroups) {
  return {geometry::virtual_kv_heads(num_kv_heads, num_subgroups),
          geometry::virtual_group_size(group_size, num_subgroups), num_subgroups};
}
inline VirtualHeads virtual_heads(const Problem& p, int num_subgroups) {
  return virtual_heads(p.num_kv_heads, p.group_size, num_subgroups);
}

// Block-id slots any selection can fill (the default budget): the sum over segments of the blocks their tiles' last
// rows see, bounded from the shapes alone (max_tiles tiles of group_size rows per position over `batch` sequences of
// at most max_seqlen_k keys), times the virtual KV heads.
int64_t causal_capacity(int64_t max_tiles, int batch, int64_t max_seqlen_k, int group_size, int block_size,
                        int kv_heads);

// Workspace bounds from the shapes the index is bound to (no device reads): the layout of a device index is a
// function of its binding and parameters alone, so sparse_attention and to_host re-carve the same pointers.
Bounds bounds_of(const IndexBinding& b, const SelectionParams& params);

// Key splits of the probe pass (probe.cu): its CTAs take 8 tiles each, so a chunk step has few of them (chunk 1024
// at num_subgroups = g: one per virtual KV head, 32 for Llama's heads) and each would stream the whole cache. With
// S > 1 every CTA takes 1/S of the key blocks (whole 32-block words of the bitmap), in two launches: pass 1 writes
// each split's partial row references, pass 2 merges them in split order and tests its blocks. S fills at most two
// probe CTAs per SM (the kernel's occupancy: one wave) from an estimate of the CTAs, at most one split per bitmap
// word.
int probe_splits(int64_t total_q, int group_size, int kv_heads, int64_t probe_words, int sms);

// Carves the workspace; with base == nullptr only sums the sizes. Returns the bytes of the layout.
size_t carve(const IndexBinding& b, const Bounds& bd, char* base, DeviceIndex* idx);

}  // namespace sparse_prefill::cuda::index_stage
