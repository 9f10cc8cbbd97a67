// How many split units a tile runs as: the one rule the device plan (plan_combine.cu) and the planned scheduler
// (attention/scheduler.h) both apply.
#pragma once

#include <cstdint>

#include "cuda/attention/block_schedule.h"  // SP_HOST_DEVICE

namespace sparse_prefill::cuda {

// The split-KV rule (plan_combine.cu; sizes in SparseLaunchWorkspace, workspace.h): a tile with more planned steps than
// cap = max(kMinCap, ceil(total / SMs)) runs as nsplit = min(32, ceil(steps / cap)) units. As steps > cap,
// nsplit < 2 * steps / cap: all split units sum to < 2 * total / cap <= 2 * SMs, and the split tiles number < SMs.
// Measured (H200, 128K, last chunk, docs/design/sparse_kernel.md): one unit per SM beats 2 and 4 on every shape (chunk
// 1024 x batch 1 attention 0.68 / 0.77 / 1.10 ms): a tile no heavier than an SM's share needs no split, since the
// heaviest-first order already runs it first, and every extra unit pays its partials and the combine.
struct SplitRule {
  static constexpr int kMinCap = 32;     // steps; below this a unit's fixed cost (Q gather, epilogue) dominates
  static constexpr int kMaxSplits = 32;  // one combine lane per split
  SP_HOST_DEVICE static int cap(unsigned long long total_steps, int num_sms) {
    const unsigned long long parts = (unsigned long long)num_sms;
    const unsigned long long share = (total_steps + parts - 1) / parts;
    const unsigned long long c = share > (unsigned long long)kMinCap ? share : (unsigned long long)kMinCap;
    return c < 0x7fffffffull ? int(c) : 0x7fffffff;
  }
  SP_HOST_DEVICE static int nsplit(int steps, int cap) {
    if (steps <= cap) return 1;
    const int want = int((int64_t(steps) + cap - 1) / cap);
    return want < kMaxSplits ? want : kMaxSplits;
  }
};

}  // namespace sparse_prefill::cuda
