// Dense and block-sparse attention rows: both are "softmax over a set of keys (plus virtual mean keys)", computed
// exactly in double with two passes (max, then exp-sum and weighted values).
#include <algorithm>
#include <cmath>

#include "core/contract.h"
#include "core/dtype_convert.h"
#include "reference/parallel.h"
#include "reference/reference.h"

namespace sparse_prefill::reference {
namespace {

struct VirtualKey {  // a pooled block standing in for |B_J| tokens (mean correction)
  const float* k;
  const float* v;
  double log_weight;
};

constexpr int64_t kRowsPerItem = 16;


// Softmax attention of one query row over the keys in `ranges` of `kv` and the virtual keys; writes out (D doubles)
// and returns the natural-log LSE (-inf when there is no key).
double attend_row(const float* q, int D, double scale, const SequenceKV& kv, const std::vector<KeyRange>& ranges,
                  const std::vector<VirtualKey>& virtuals, std::vector<double>& logits, double* out) {
  logits.clear();
  double m = -std::numeric_limits<double>::infinity();
  for (const KeyRange& r : ranges) {
    for (int64_t j = r.lo; j <= r.hi; ++j) {
      logits.push_back(scale * dot(q, &kv.k[size_t(j) * D], D));
      m = std::max(m, logits.back());
    }
  }
  for (const VirtualKey& vk : virtuals) {
    logits.push_back(scale * dot(q, vk.k, D) + vk.log_weight);
    m = std::max(m, logits.back());
  }
  std::fill(out, out + D, 0.0);
  if (logits.empty()) return -std::numeric_limits<double>::infinity();
  double l = 0;
  size_t n = 0;
  auto accumulate = [&](const float* v) {
    const double w = std::exp(logits[n++] - m);
    l += w;
    for (int d = 0; d < D; ++d) out[d] += w * double(v[d]);
  };
  for (const KeyRange& r : ranges) {
    for (int64_t j = r.lo; j <= r.hi; ++j) accumulate(&kv.v[size_t(j) * D]);
  }
  for (const VirtualKey& vk : virtuals) accumulate(vk.v);
  for (int d = 0; d < D; ++d) out[d] /= l;
  return m + std::log(l);
}

// Runs `rows_of(b, h, i, ranges, virtuals)` to define each query row's key set, then attends and writes outputs.
template <typename KeySetFn>
void run_rows(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p,
              const std::vector<SequenceKV>& kv, KeySetFn&& key_set) {
  struct Item { int b, h; int64_t i0; };
  std::vector<Item> items;
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.num_q_heads; ++h)
      for (int64_t i0 = 0; i0 < p.seqs[b].q_len; i0 += kRowsPerItem) items.push_back({b, h, i0});
  const int D = p.head_dim;
  parallel_for(int64_t(items.size()), [&](int64_t n) {
    const Item it = items[n];
    const SequenceInfo& s = p.seqs[it.b];
    const SequenceKV& skv = kv[size_t(it.b) * p.num_kv_heads + it.h / p.group_size];
    std::vector<float> q(D);
    std::vector<double> o(D), logits;
    std::vector<KeyRange> ranges;
    std::vector<VirtualKey> virtuals;
    for (int64_t i = it.i0; i < std::min(s.q_len, it.i0 + kRowsPerItem); ++i) {
      const int64_t row = s.q_start + i;
      const int64_t qo = row * in.q.stride[0] + it.h * in.q.stride[1];
      const float q_scale = descale_at(in.q_descale, it.b, it.h, p.num_q_heads);
      for (int d = 0; d < D; ++d) q[d] = load_as_float(in.q.data, p.dtype, qo + d) * q_scale;
      ranges.clear();
      virtuals.clear();
      key_set(it.b, it.h, i, ranges, virtuals);
      const double lse = attend_row(q.data(), D, p.softmax_scale, skv, ranges, virtuals, logits, o.data());
      const int64_t oo = row * outs.out.stride[0] + it.h * outs.out.stride[1];
      for (int d = 0; d < D; ++d) store_from_float(outs.out.data, p.out_dtype, oo + d, float(o[d]));
      if (outs.lse) outs.lse->ptr<float>()[it.h * outs.lse->stride[0] + row * outs.lse->stride[1]] = float(lse);
    }
  });
}

}  // namespace

void attention(const AttentionInputs& in, const AttentionOutputs& outs, const Problem& p) {
  const std::vector<SequenceKV> kv = gather_kv(in, p);
  run_rows(in, outs, p, kv, [&](int b, int, int64_t i, std::vector<KeyRange>& ranges, std::vector<VirtualKey>&) {
    const SequenceInfo& s = p.seqs[b];
    const KeyRange r = visible_keys(i, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
    if (!r.empty()) ranges.push_back(r);
  });
}

void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      const Problem& p) {
  if (index.num_subgroups > 1) {  // the S = 1 path on the model with Hkv * S KV heads
    const VirtualHeadCopies virt = virtual_head_copies(in, p, index.num_subgroups);
    BlockIndexView one = index;
    one.num_subgroups = 1;
    return sparse_attention(virt.in, one, outs, virt.p);
  }
  const std::vector<SequenceKV> kv = gather_kv(in, p);
  const int B = index.block_size, g = p.group_size;
  const int32_t* seg_start = index.segment_start.ptr<const int32_t>();
  const int32_t* seg_end = index.segment_end.ptr<const int32_t>();
  const int32_t* ids = index.block_ids.ptr<const int32_t>();
  const int32_t* cu_blocks = index.cu_blocks.ptr<const int32_t>();
  std::vector<int64_t> seg_offset(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) {
    seg_offset[b + 1] = seg_offset[b] + int64_t(p.num_kv_heads) * num_tiles(p.seqs[b].q_len, g);
  }
  run_rows(in, outs, p, kv, [&](int b, int h, int64_t i, std::vector<KeyRange>& ranges,
                                std::vector<VirtualKey>& virtuals) {
    const SequenceInfo& s = p.seqs[b];
    const KeyRange vis = visible_keys(i, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
    const int kvh = h / g;
    const int64_t tile = geometry::packed_row(i, h % g, g) / geometry::kTileRows;
    const int64_t seg = seg_offset[b] + kvh * num_tiles(s.q_len, g) + tile;
    const int64_t nb = num_blocks(s.k_len, B);
    std::vector<char> listed(size_t(nb), 0);
    for (int64_t n = seg_start[seg]; n < seg_end[seg]; ++n) {
      const int64_t J = ids[n];
      listed[J] = 1;
      const KeyRange r{std::max(vis.lo, J * B), std::min(vis.hi, std::min<int64_t>(J * B + B, s.k_len) - 1)};
      if (!r.empty()) ranges.push_back(r);
    }
    if (!index.correction) return;
    const TileGeometry geo = tile_geometry(tile, s.q_len, g);
    for (int64_t J = 0; J < nb; ++J) {
      if (listed[J] || !block_fully_visible(in, s, geo, J, B)) continue;
      const int64_t count = std::min<int64_t>(J * B + B, s.k_len) - J * B;
      const int64_t pooled_row = cu_blocks[b] + J;
      virtuals.push_back({index.k_mean.ptr<const float>() + pooled_row * index.k_mean.stride[0] +
                              kvh * index.k_mean.stride[1],
                          index.v_mean.ptr<const float>() + pooled_row * index.v_mean.stride[0] +
                              kvh * index.v_mean.stride[1],
                          std::log(double(count))});
    }
  });
}

}  // namespace sparse_prefill::reference
