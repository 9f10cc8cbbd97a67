// Head sub-groups for the reference: the inputs of the equivalent model with Hkv * S KV heads (reference.h).
#include <algorithm>
#include <cstring>

#include "reference/reference.h"

namespace sparse_prefill::reference {

Problem virtual_problem(const Problem& p, int subgroups) {
  Problem v = p;
  v.num_kv_heads = p.num_kv_heads * subgroups;
  v.group_size = p.group_size / subgroups;
  return v;
}

namespace {

// Copies `src` (contiguous [total_k, H, D] or paged [num_pages, page_size, H, D], last dim contiguous, any strides
// otherwise) into `bytes` as a row-major tensor whose head axis holds every head `subgroups` times in a row; returns
// the view of the copy.
TensorView repeat_heads(const TensorView& src, int subgroups, std::vector<uint8_t>& bytes) {
  const int rank = src.ndim, head_axis = rank - 2;
  const int64_t H = src.shape[head_axis], D = src.shape[rank - 1], elem = dtype_bytes(src.dtype);
  const int64_t rows = rank == 4 ? src.shape[0] * src.shape[1] : src.shape[0];  // tokens (page slots)
  bytes.assign(size_t(std::max<int64_t>(rows * H * subgroups * D * elem, 1)), 0);
  const uint8_t* base = static_cast<const uint8_t*>(src.data);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row_off = rank == 4 ? (r / src.shape[1]) * src.stride[0] + (r % src.shape[1]) * src.stride[1]
                                      : r * src.stride[0];
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t* from = base + (row_off + h * src.stride[head_axis]) * elem;
      for (int s = 0; s < subgroups; ++s) {
        std::memcpy(&bytes[size_t(((r * H + h) * subgroups + s) * D * elem)], from, size_t(D * elem));
      }
    }
  }
  TensorView t = src;
  t.data = bytes.data();
  t.shape[head_axis] = H * subgroups;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    t.stride[i] = stride;
    stride *= t.shape[i];
  }
  return t;
}

}  // namespace

VirtualHeadCopies virtual_head_copies(const AttentionInputs& in, const Problem& p, int subgroups) {
  VirtualHeadCopies out;
  out.p = virtual_problem(p, subgroups);
  out.in = in;
  out.in.k = repeat_heads(in.k, subgroups, out.k);
  out.in.v = repeat_heads(in.v, subgroups, out.v);
  return out;
}

}  // namespace sparse_prefill::reference
