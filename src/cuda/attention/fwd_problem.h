// What every policy of the attention kernel reads: the shape of the problem (sequences, heads, tiles), the softmax
// scale, the visibility window and the device-side checks. The policies' own parameters (TMA descriptors, the index,
// the outputs, the scheduler's counters) live in their Params (mainloop_sm90.h, epilogue.h, scheduler.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/common/device_checks.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

struct FwdProblem {
  SeqLimits limits;  // what a sequence's span may be (device_checks.h)
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_k;  // paged KV only (null: contiguous)
  int total_q, total_k_rows, num_q_heads;
  // Tiles run over num_kv_heads KV heads; with head sub-groups (PackGQA tiles, SparseFwdArgs::num_subgroups) these
  // are virtual heads of group_size query heads each, and K/V (and the pooled means) are read from head
  // kv_head / num_subgroups of the num_kv_heads_mem heads in memory.
  int num_kv_heads, group_size, num_kv_heads_mem, num_subgroups;
  geometry::RowDivider group_div;  // group_size: PackGQA row -> (position, head) without an integer division
  int num_m_blocks;  // m-blocks (PackGQA: packed tiles) of the longest sequence
  int batch;
  float softmax_scale, scale_log2;
  int window_left, window_right;  // right = 0 for causal; -1 = unbounded
  DeviceError* err;               // device-side checks (device_checks.h)
  // kPackGqa: tiles of 128 packed rows (position * g + head % g) per (sequence, KV head), else 128 query rows of one
  // query head.
  static FwdProblem make(const FwdArgs& a, bool pack_gqa, int num_subgroups, int block_m) {
    FwdProblem p;
    p.cu_seqlens_q = a.in.cu_seqlens_q;
    p.cu_seqlens_k = a.in.cu_seqlens_k;
    p.seqused_k = a.in.seqused_k;  // null for contiguous KV (launch_inputs)
    p.total_q = a.total_q;
    p.total_k_rows = a.total_k_rows;
    p.batch = a.batch;
    p.num_q_heads = a.num_q_heads;
    p.num_kv_heads_mem = a.num_kv_heads;
    p.num_subgroups = pack_gqa ? num_subgroups : 1;
    p.num_kv_heads = geometry::virtual_kv_heads(a.num_kv_heads, p.num_subgroups);
    p.group_size = geometry::virtual_group_size(a.num_q_heads / a.num_kv_heads, p.num_subgroups);
    p.group_div = geometry::RowDivider(p.group_size);
    const int64_t rows = pack_gqa ? int64_t(a.max_seqlen_q) * p.group_size : int64_t(a.max_seqlen_q);
    p.num_m_blocks = int((rows + block_m - 1) / block_m);
    p.softmax_scale = a.softmax_scale;
    p.scale_log2 = a.softmax_scale * float(M_LOG2E);
    p.window_left = a.window_left;
    p.window_right = a.causal ? 0 : a.window_right;
    p.err = device_error_word();
    p.limits = a.in.limits;
    return p;
  }
};

}  // namespace sparse_prefill::cuda
