// The geometry of a call, defined once for every layer: host code (validation, the CPU reference, the CUDA backend's
// host side, the Python binding) and device code (the index stage, the split-KV plan). No CUDA dependency when the
// host compiler reads it: the functions are __host__ __device__ only under nvcc.
//
//   tiles        a sequence of Lq queries and GQA group g has ceil(Lq * g / 128) PackGQA tiles of 128 packed rows;
//   packed rows  row r of a sequence <-> (query position r / g, query head kv_head * g + r % g);
//   virtual heads  head sub-groups S split each KV head's g query heads into S virtual KV heads of g / S
//                (Hkv * S in all), virtual head v reading the K/V (and pooled means) of KV head v / S;
//   pages        key j of a sequence lies in block_table column j / page_size, slot j % page_size of that page;
//   mean cache   the pooled means of complete block J live in the slot of the page of its last key;
//   span         causal attention is bottom-right aligned: query position i sees keys 0 .. i + (Lk - Lq).
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "sparse_prefill/sparse.h"  // kTileRows, the public API's tile height: defined there once

namespace sparse_prefill::geometry {

constexpr int kTileRows = ::sparse_prefill::kTileRows;  // packed query rows per PackGQA / selection tile
// Keys per step of the CUDA attention kernels (their S GEMM's N): a listed key block is block_size / kKeyStep steps,
// so the CUDA sparse paths need block_size % kKeyStep == 0.
constexpr int kKeyStep = 128;

// --- tiles and blocks ---------------------------------------------------------------------------------------------
// Tiles of a sequence with q_len queries and group size g (packed rows q_len * g).
SP_HOST_DEVICE int64_t num_tiles(int64_t q_len, int64_t group_size) {
  return (q_len * group_size + kTileRows - 1) / kTileRows;
}
// Key blocks of block_size keys covering k_len keys (the last one may be partial).
SP_HOST_DEVICE int64_t num_blocks(int64_t k_len, int64_t block_size) { return (k_len + block_size - 1) / block_size; }
// Packed rows of tile t (128, or fewer for the sequence's last tile).
SP_HOST_DEVICE int64_t tile_rows(int64_t tile, int64_t q_len, int64_t group_size) {
  const int64_t rows = q_len * group_size - tile * kTileRows;
  return rows < kTileRows ? rows : kTileRows;
}

// --- PackGQA rows -------------------------------------------------------------------------------------------------
SP_HOST_DEVICE int64_t row_position(int64_t row, int64_t group_size) { return row / group_size; }
SP_HOST_DEVICE int64_t row_head(int64_t row, int64_t group_size, int64_t kv_head) {
  return kv_head * group_size + row % group_size;
}
SP_HOST_DEVICE int64_t packed_row(int64_t position, int64_t head_in_group, int64_t group_size) {
  return position * group_size + head_in_group;
}
// Packed row -> (position, head in group) for the kernels, whose rows are < 2^31: the division by g as a multiply
// and a shift (the round-up method: m = ceil(2^(31 + l) / g) with l = ceil(log2 g), so x m / 2^(31 + l) exceeds x / g
// by less than 1 / g and its floor is x / g for every x in [0, 2^31)). A runtime int division is ~17 instructions on
// the GPU (MUFU.RCP and corrections); the sparse kernel's consumers did ~38 per tile (Q gather, mask, epilogue).
struct RowDivider {
  int32_t g = 1;
  uint32_t m = 0;      // unused for g == 1
  uint32_t shift = 0;  // l - 1, applied to the high 32 bits of x m
  RowDivider() = default;
  explicit RowDivider(int32_t group_size) : g(group_size) {
    int l = 0;
    while ((int64_t(1) << l) < group_size) ++l;
    if (group_size > 1) {
      m = uint32_t(((uint64_t(1) << (31 + l)) + uint64_t(group_size) - 1) / uint64_t(group_size));
      shift = uint32_t(l - 1);
    }
  }
  SP_HOST_DEVICE int32_t position(int32_t row) const {  // row / g, row in [0, 2^31)
#if defined(__CUDA_ARCH__)
    return g == 1 ? row : int32_t(__umulhi(uint32_t(row), m) >> shift);
#else
    return g == 1 ? row : int32_t((uint64_t(uint32_t(row)) * m) >> (32 + shift));
#endif
  }
  SP_HOST_DEVICE int32_t head(int32_t row) const { return row - position(row) * g; }  // row % g
};

// --- virtual heads (head sub-groups) ------------------------------------------------------------------------------
SP_HOST_DEVICE int virtual_kv_heads(int num_kv_heads, int subgroups) { return num_kv_heads * subgroups; }
SP_HOST_DEVICE int virtual_group_size(int group_size, int subgroups) { return group_size / subgroups; }
SP_HOST_DEVICE int memory_kv_head(int virtual_kv_head, int subgroups) { return virtual_kv_head / subgroups; }

// --- pages --------------------------------------------------------------------------------------------------------
// In the arguments' common integer type: the kernels' loaders call them with int (32-bit division and remainder; a
// 64-bit one is a software routine on the GPU), the host with int64_t.
template <class Key, class Size>
SP_HOST_DEVICE auto page_column(Key key, Size page_size) { return key / page_size; }
template <class Key, class Size>
SP_HOST_DEVICE auto page_slot(Key key, Size page_size) { return key % page_size; }
// Row of key `key` in the [num_pages * page_size] row space of a paged cache whose block_table entry is `page`.
template <class Page, class Key, class Size>
SP_HOST_DEVICE auto paged_row(Page page, Key key, Size page_size) {
  return page * page_size + page_slot(key, page_size);
}

// --- mean cache (MeanCache, sparse.h) -----------------------------------------------------------------------------
// Slots per page: page_size / block_size when pages hold whole blocks, else 1 (a block spans pages).
SP_HOST_DEVICE int64_t mean_cache_slots_per_page(int64_t page_size, int64_t block_size) {
  return page_size >= block_size ? page_size / block_size : 1;
}
// Slot of complete block J whose last key (J + 1) * block_size - 1 lies on `page` (per_page: the value above, for
// callers that keep it).
SP_HOST_DEVICE int64_t mean_cache_slot(int64_t page, int64_t block, int64_t page_size, int64_t block_size,
                                       int64_t per_page) {
  const int64_t last_key = (block + 1) * block_size - 1;
  return page * per_page + (per_page > 1 ? page_slot(last_key, page_size) / block_size : 0);
}
SP_HOST_DEVICE int64_t mean_cache_slot(int64_t page, int64_t block, int64_t page_size, int64_t block_size) {
  return mean_cache_slot(page, block, page_size, block_size, mean_cache_slots_per_page(page_size, block_size));
}

// --- span (bottom-right causal) -----------------------------------------------------------------------------------
// Offset of the keys against the queries: query position i sees keys 0 .. i + causal_offset (causal).
SP_HOST_DEVICE int64_t causal_offset(int64_t q_len, int64_t k_len) { return k_len - q_len; }

}  // namespace sparse_prefill::geometry
