// Checks of a block index against a call (values, shapes, the binding to the call it was built for) and of the
// pooled-means cache (validate.h).
#include <cstdint>
#include <string>
#include <tuple>

#include "api/validate.h"

namespace sparse_prefill {

void validate_index(const Problem& p, const BlockIndexView& index) {
  if (index.block_size <= 0 || index.block_size % 64 != 0) {
    throw ArgumentError("index", "block_size must be a positive multiple of 64, got " +
                                     std::to_string(index.block_size));
  }
  // Head sub-groups: segments and pooled means are over heads = Hkv * S virtual KV heads of g' = g / S query heads
  // each (sparse.h); `g` below is g'.
  check_head_subgroups(index.head_subgroups, p.group_size, "index.head_subgroups");
  const int S = index.head_subgroups, heads = p.num_kv_heads * S, g = p.group_size / S;
  const std::string heads_note =
      S == 1 ? std::string()
             : " (head_subgroups = " + std::to_string(S) + ": " + std::to_string(heads) + " virtual KV heads of " +
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
                                    " (index built for other inputs or another head_subgroups?)");
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

IndexBinding bind_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params) {
  IndexBinding b;
  b.set = true;
  b.causal = in.causal;
  b.window_left = in.window_left;
  b.window_right = in.window_right;
  b.softmax_scale = p.softmax_scale;
  b.block_size = params.block_size;
  b.head_subgroups = params.head_subgroups;
  b.dense_fraction = params.dense_fraction;
  b.union_lists = params.union_lists;
  b.v_means = params.correction;
  b.split_kv = in.options.split_kv;
  b.batch = p.batch;
  b.num_q_heads = p.num_q_heads;
  b.num_kv_heads = p.num_kv_heads;
  b.head_dim = p.head_dim;
  b.total_q = p.total_q;
  b.total_k = p.total_k;
  b.max_seqlen_q = in.max_seqlen_q;
  b.max_seqlen_k = in.max_seqlen_k;
  b.paged = p.paged;
  b.page_size = p.page_size;
  b.dtype = p.dtype;
  b.device = p.device;
  b.device_id = in.q.device_id;
  b.q = in.q.data;
  b.k = in.k.data;
  b.v = in.v.data;
  b.cu_seqlens_q = in.cu_seqlens_q.data;
  b.cu_seqlens_k = in.cu_seqlens_k ? in.cu_seqlens_k->data : nullptr;
  b.block_table = in.block_table ? in.block_table->data : nullptr;
  b.seqused_k = in.seqused_k ? in.seqused_k->data : nullptr;
  return b;
}

void check_binding(const IndexBinding& b, const AttentionInputs& in, const Problem& p, bool reuse_index) {
  if (!b.set) return;
  const std::string built = " the index was built for ";
  auto differs = [&](const char* name, const std::string& now, const std::string& then) {
    throw ArgumentError(name, "is " + now + " but" + built + then + " (build an index for this call)");
  };
  auto num = [](auto x) { return std::to_string(x); };
  if (b.causal != in.causal) differs("causal", in.causal ? "True" : "False", b.causal ? "True" : "False");
  if (b.window_left != in.window_left || b.window_right != in.window_right) {
    differs("window", "(" + num(in.window_left) + ", " + num(in.window_right) + ")",
            "(" + num(b.window_left) + ", " + num(b.window_right) + ")");
  }
  if (b.softmax_scale != p.softmax_scale) differs("softmax_scale", num(p.softmax_scale), num(b.softmax_scale));
  if (b.num_q_heads != p.num_q_heads || b.num_kv_heads != p.num_kv_heads || b.head_dim != p.head_dim) {
    differs("q", num(p.num_q_heads) + " query heads, " + num(p.num_kv_heads) + " KV heads and head dim " +
                     num(p.head_dim),
            num(b.num_q_heads) + ", " + num(b.num_kv_heads) + " and " + num(b.head_dim));
  }
  if (b.batch != p.batch) differs("cu_seqlens_q", num(p.batch) + " sequences", num(b.batch));
  if (b.total_q != p.total_q) differs("q", num(p.total_q) + " rows", num(b.total_q));
  if (b.paged != p.paged) differs("k", p.paged ? "a paged cache" : "contiguous", b.paged ? "a paged cache" : "contiguous KV");
  if (b.total_k != p.total_k || b.page_size != p.page_size) {
    differs("k", num(p.total_k) + " rows (page size " + num(p.page_size) + ")",
            num(b.total_k) + " (page size " + num(b.page_size) + ")");
  }
  if (b.max_seqlen_q != in.max_seqlen_q) differs("max_seqlen_q", num(in.max_seqlen_q), num(b.max_seqlen_q));
  if (b.max_seqlen_k != in.max_seqlen_k) differs("max_seqlen_k", num(in.max_seqlen_k), num(b.max_seqlen_k));
  if (reuse_index) return;  // the data: where it lives, its dtype, the arrays themselves
  if (b.device != p.device || b.device_id != in.q.device_id) {
    throw ArgumentError("q", "is on another device than the arrays the index was built from (pass reuse_index=True "
                             "to apply this selection there)", true);
  }
  if (b.dtype != p.dtype) differs("q", dtype_name(p.dtype), dtype_name(b.dtype));
  const void* cu_k = in.cu_seqlens_k ? in.cu_seqlens_k->data : nullptr;
  const void* bt = in.block_table ? in.block_table->data : nullptr;
  const void* used = in.seqused_k ? in.seqused_k->data : nullptr;
  using Pair = std::tuple<const void*, const void*, const char*>;
  for (const auto& [now, then, name] :
       {Pair{in.q.data, b.q, "q"}, Pair{in.k.data, b.k, "k"}, Pair{in.v.data, b.v, "v"},
        Pair{in.cu_seqlens_q.data, b.cu_seqlens_q, "cu_seqlens_q"}, Pair{cu_k, b.cu_seqlens_k, "cu_seqlens_k"},
        Pair{bt, b.block_table, "block_table"}, Pair{used, b.seqused_k, "seqused_k"}}) {
    if (now != then) {
      throw ArgumentError(name, std::string("is not the array the index was built from (pass reuse_index=True to "
                                            "apply this selection to other data of the same problem)"));
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
