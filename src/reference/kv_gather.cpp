#include "core/dtype_convert.h"
#include "core/geometry.h"
#include "reference/parallel.h"
#include "reference/reference.h"

namespace sparse_prefill::reference {

std::vector<SequenceKV> gather_kv(const AttentionInputs& in, const Problem& p) {
  std::vector<SequenceKV> out(size_t(p.batch) * p.num_kv_heads);
  const int D = p.head_dim;
  parallel_for(int64_t(out.size()), [&](int64_t item) {
    const int b = int(item / p.num_kv_heads), h = int(item % p.num_kv_heads);
    SequenceKV& s = out[item];
    s.len = p.seqs[b].k_len;
    s.k.resize(size_t(s.len) * D);
    s.v.resize(size_t(s.len) * D);
    const float k_scale = descale_at(in.k_descale, b, h, p.num_kv_heads);
    const float v_scale = descale_at(in.v_descale, b, h, p.num_kv_heads);
    for (int64_t j = 0; j < s.len; ++j) {
      int64_t ko, vo;  // element offsets of key j's row in k and v
      if (p.paged) {
        const TensorView& bt = *in.block_table;
        const int64_t col = geometry::page_column(j, p.page_size);
        const int64_t page = bt.ptr<const int32_t>()[b * bt.stride[0] + col * bt.stride[1]];
        const int64_t slot = geometry::page_slot(j, p.page_size);
        ko = page * in.k.stride[0] + slot * in.k.stride[1] + h * in.k.stride[2];
        vo = page * in.v.stride[0] + slot * in.v.stride[1] + h * in.v.stride[2];
      } else {
        const int64_t row = p.seqs[b].k_start + j;
        ko = row * in.k.stride[0] + h * in.k.stride[1];
        vo = row * in.v.stride[0] + h * in.v.stride[1];
      }
      for (int d = 0; d < D; ++d) {
        s.k[size_t(j) * D + d] = load_as_float(in.k.data, p.dtype, ko + d) * k_scale;
        s.v[size_t(j) * D + d] = load_as_float(in.v.data, p.dtype, vo + d) * v_scale;
      }
    }
  });
  return out;
}

TileGeometry tile_geometry(int64_t tile, int64_t q_len, int group_size) {
  TileGeometry t;
  t.row_begin = tile * geometry::kTileRows;
  t.row_end = t.row_begin + geometry::tile_rows(tile, q_len, group_size);
  t.first_pos = geometry::row_position(t.row_begin, group_size);
  t.last_pos = geometry::row_position(t.row_end - 1, group_size);
  return t;
}

bool block_fully_visible(const AttentionInputs& in, const SequenceInfo& s, const TileGeometry& tile, int64_t block,
                         int block_size) {
  const int64_t first_key = block * block_size;
  const int64_t last_key = std::min<int64_t>(first_key + block_size, s.k_len) - 1;
  // lo(p) and hi(p) are non-decreasing in p, so the first row bounds hi and the last row bounds lo.
  const KeyRange first = visible_keys(tile.first_pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
  const KeyRange last = visible_keys(tile.last_pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
  return !first.empty() && !last.empty() && last_key <= first.hi && first_key >= last.lo;
}

}  // namespace sparse_prefill::reference
