// Split-KV of the block-sparse kernel, host side (plain C++, no CUDA headers): the launch workspace that holds the
// plan and the partials, when a launch is planned, and the plan and combine launches around it (plan_combine.cu).
// The rest of split-KV lives beside this file: rule.h (how many units a tile runs as), partials.h (the epilogue of
// split units); the planned scheduler is PersistentScheduler<Config, true> (attention/scheduler.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparse_prefill::cuda {

struct FwdArgs;
struct SparseFwdArgs;

// Per-launch device state of the sparse kernel, carved from caller memory (sparse_launch_workspace_bytes):
//   counters [kCounters]: the persistent scheduler's tile counter and the split-KV plan (zeroed before each launch);
//   split_tiles [max_split_tiles]: {tile, nsplit, 0, 0} of every tile run as nsplit > 1 units, sorted by nsplit
//     (descending) then tile;
//   slot_tile [max_split_units]: unit u (= its partial slot) -> entry | split << 16. Units are ordered split-major
//     (split 0 of every split tile, then split 1, ...): split s of entry e is unit counters[kSplitBase + s] + e, so
//     the tiles that read the same key range at the same time (the g-head tiles of one KV head) share it in L2;
//   o_partial [max_split_units, 128, D] / lse_partial [max_split_units, 128]: float32 partials, one slot per unit.
// Split plan (SplitRule, rule.h): fewer than SMs split tiles and twice as many split units, always.
struct SparseLaunchWorkspace {
  enum : int {
    kTileCounter = 0, kSplitTiles = 1, kSplitUnits = 2, kCap = 3, kTotalLo = 4, kTotalHi = 5, kSplitBase = 8,
    kCounters = 8 + 32
  };
  int* counters = nullptr;
  int32_t* split_tiles = nullptr;       // [max_split_tiles][4]
  int32_t* slot_tile = nullptr;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  int num_sms = 0;
  int max_split_tiles = 0, max_split_units = 0;  // 0: carved without the split arrays (counters only)
  bool plan = true;                      // set per launch by run_sparse (split_planned and room for it)
};

// with_split = false: the counters only (launches that are never planned: split_planned() is false).
size_t sparse_launch_workspace_bytes(int num_sms, int head_dim, bool with_split);
SparseLaunchWorkspace carve_sparse_launch_workspace(void* base, int num_sms, int head_dim, bool with_split);

// Whether a sparse launch with these bounds runs the split-KV plan: chunk shapes (max_seqlen_k > max_seqlen_q) unless
// LaunchOptions::split_kv is off. Sizes the launch workspace and gates the plan. Only chunk shapes are planned: there
// a few tiles (the final chunk's dense last_n tiles) can each outweigh an SM's share of the work. In one-shot prefill
// (Lq = Lk) the heaviest tile is far below that share (128K: 1032 steps against ~3500 per SM) and the heaviest-first
// order balances the SMs; the plan and combine launches would only add their cost (~20 us at 8K in the A/B that
// decided it, whose results file is in git history only).
inline bool split_planned(bool split_kv, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  return split_kv && max_seqlen_k > max_seqlen_q;
}

// Split-KV around a sparse launch (plan_combine.cu): zero the counters and build the plan before it, combine the
// partials into out / lse after it. All stream-ordered, no host synchronisation.
void run_split_plan(const FwdArgs& args, const SparseFwdArgs& sparse);
void run_split_combine(const FwdArgs& args, const SparseFwdArgs& sparse, bool bf16);

}  // namespace sparse_prefill::cuda
