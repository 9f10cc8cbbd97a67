// Checks of a block index against a call (values, shapes; its binding: core/contract.cpp) and of the pooled-means
// cache (validate.h).
#include <cstdint>
#include <string>

#include "api/validate.h"

namespace sparse_prefill {

void validate_index(const Problem& p, const BlockIndexView& index) {
  if (index.block_size <= 0 || index.block_size % 64 != 0) {
    throw ArgumentError("index", "block_size must be a positive multiple of 64, got " +
                                     std::to_string(index.block_size));
  }
  // Head sub-groups: segments and pooled means are over heads = Hkv * S virtual KV heads of g' = g / S query heads
  // each (sparse.h); `g` below is g'.
  check_head_subgroups(index.num_subgroups, p.group_size, "index.num_subgroups");
  const int S = index.num_subgroups, heads = p.num_kv_heads * S, g = p.group_size / S;
  const std::string heads_note =
      S == 1 ? std::string()
             : " (num_subgroups = " + std::to_string(S) + ": " + std::to_string(heads) + " virtual KV heads of " +
                   std::to_string(g) + " query heads)";
  // On CUDA the sequence lengths live on the device (p.seqs is empty): shapes that depend on them are not checked
  // there (the segment count and pooled rows are trusted, as cu_seqlens are).
  const bool host = p.device == Device::kCPU;
  int64_t segments = 0, total_blocks = 0;
  for (const SequenceInfo& s : p.seqs) {
    segments += heads * num_tiles(s.q_len, g);
    total_blocks += num_blocks(s.k_len, index.block_size);
  }
  for (const auto& [t, name] : {std::pair{&index.segment_start, "index.segment_start"},
                                std::pair{&index.segment_end, "index.segment_end"}}) {
    check_rank(*t, 1, name);
    check_dtype(*t, DType::kInt32, name);
    if (t->device != p.device) throw ArgumentError(name, "must be on the device of q", true);
    if (host && t->shape[0] != segments) {
      throw ArgumentError(name, "expected " + std::to_string(segments) + " segments for these sequences" +
                                    heads_note + ", got " + std::to_string(t->shape[0]) +
                                    " (index built for other inputs or another num_subgroups?)");
    }
  }
  check_rank(index.block_ids, 1, "index.block_ids");
  check_dtype(index.block_ids, DType::kInt32, "index.block_ids");
  check_rank(index.cu_blocks, 1, "index.cu_blocks");
  check_dtype(index.cu_blocks, DType::kInt32, "index.cu_blocks");
  // v_mean: only the correction reads it; an index built without it has none (is_absent).
  if (index.correction && is_absent(index.v_mean)) {
    throw ArgumentError("index.v_mean", "is missing, but index.correction is set: the mean correction needs the "
                                        "pooled V means (build the index with correction=True)");
  }
  for (const auto& [t, name] : {std::pair{&index.block_ids, "index.block_ids"},
                                std::pair{&index.cu_blocks, "index.cu_blocks"},
                                std::pair{&index.k_mean, "index.k_mean"}, std::pair{&index.v_mean, "index.v_mean"}}) {
    if (t == &index.v_mean && is_absent(*t)) continue;
    if (t->device != p.device) throw ArgumentError(name, "must be on the device of q", true);
  }
  if (index.cu_blocks.shape[0] != p.batch + 1) {
    throw ArgumentError("index.cu_blocks", "expected " + std::to_string(p.batch + 1) + " entries");
  }
  if (index.correction) {
    for (const auto& [t, name] : {std::pair{&index.k_mean, "index.k_mean"}, std::pair{&index.v_mean, "index.v_mean"}}) {
      check_rank(*t, 3, name);
      check_dtype(*t, DType::kFloat32, name);
      if ((host && t->shape[0] != total_blocks) || t->shape[1] != heads || t->shape[2] != p.head_dim) {
        throw ArgumentError(name, "expected shape [" + std::to_string(total_blocks) + ", " + std::to_string(heads) +
                                      ", " + std::to_string(p.head_dim) + "]" + heads_note + ", got " +
                                      shape_string(*t));
      }
      check_last_dim_contiguous(*t, name);
    }
  }
  if (p.device != Device::kCPU) return;
  int64_t expect = 0;
  for (int b = 0; b < p.batch; ++b) {
    if (at1(index.cu_blocks, b) != expect) {
      throw ArgumentError("index.cu_blocks", "does not match the key lengths (index built for other inputs?)");
    }
    expect += num_blocks(p.seqs[b].k_len, index.block_size);
  }
  if (at1(index.cu_blocks, p.batch) != expect) {
    throw ArgumentError("index.cu_blocks", "does not match the key lengths (index built for other inputs?)");
  }
  const int64_t n = index.block_ids.shape[0];
  int64_t seg = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t tiles = num_tiles(p.seqs[b].q_len, g);
    const int64_t nb = num_blocks(p.seqs[b].k_len, index.block_size);
    for (int64_t i = 0; i < heads * tiles; ++i, ++seg) {
      const int64_t lo = at1(index.segment_start, seg), hi = at1(index.segment_end, seg);
      if (lo < 0 || hi < lo || hi > n) {
        throw ArgumentError("index.segment_start", "segment " + std::to_string(seg) + " range [" +
                                                       std::to_string(lo) + ", " + std::to_string(hi) +
                                                       ") is invalid for " + std::to_string(n) + " block ids");
      }
      int64_t prev = -1;
      for (int64_t j = lo; j < hi; ++j) {
        const int64_t id = at1(index.block_ids, j);
        if (id <= prev || id >= nb) {
          throw ArgumentError("index.block_ids", "segment " + std::to_string(seg) + " must list ascending block ids in [0, " +
                                                     std::to_string(nb) + "), got " + std::to_string(id));
        }
        prev = id;
      }
    }
  }
}

int64_t mean_cache_slots(int64_t num_pages, int64_t page_size, int block_size) {
  if (num_pages < 0 || page_size <= 0 || block_size <= 0) return 0;
  return num_pages * geometry::mean_cache_slots_per_page(page_size, block_size);
}

void validate_mean_cache(const AttentionInputs& in, const Problem& p, int block_size, const MeanCache& cache) {
  if (!in.paged())
    throw ArgumentError("mean_cache", "needs a paged KV cache (block_table and seqused_k): its slots follow the pages");
  if (cache.block_size != 0 && cache.block_size != block_size) {
    throw ArgumentError("mean_cache", "was made for block_size " + std::to_string(cache.block_size) +
                                          " but this call selects with block_size " + std::to_string(block_size));
  }
  if (p.page_size % block_size != 0 && block_size % p.page_size != 0) {
    throw ArgumentError("mean_cache", "needs page_size % block_size == 0 or block_size % page_size == 0, got "
                                      "page_size " + std::to_string(p.page_size) + " and block_size " +
                                      std::to_string(block_size));
  }
  const int64_t slots = mean_cache_slots(p.num_pages, p.page_size, block_size);
  for (const auto& [t, name] : {std::pair{&cache.k_mean, "mean_cache.k_mean"},
                                std::pair{&cache.v_mean, "mean_cache.v_mean"}}) {
    check_rank(*t, 3, name);
    check_dtype(*t, DType::kFloat32, name);
    check_same_device(*t, in.q, name, "q");
    if (t->shape[0] != slots || t->shape[1] != p.num_kv_heads || t->shape[2] != p.head_dim) {
      throw ArgumentError(name, "expected shape [" + std::to_string(slots) + ", " + std::to_string(p.num_kv_heads) +
                                    ", " + std::to_string(p.head_dim) + "] (mean_cache_slots(num_pages, page_size, "
                                    "block_size), Hkv, D), got " + shape_string(*t));
    }
    if (t->stride[2] != 1 || t->stride[1] != p.head_dim || t->stride[0] != int64_t(p.num_kv_heads) * p.head_dim)
      throw ArgumentError(name, "must be contiguous");
  }
  if (cache.k_mean.data == cache.v_mean.data && slots > 0)
    throw ArgumentError("mean_cache.v_mean", "must not share memory with mean_cache.k_mean");
}

}  // namespace sparse_prefill
