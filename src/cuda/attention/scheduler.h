// Tile schedulers: which work unit a CTA runs next, and how the producer tells the consumers.
//   SingleTileScheduler:        one tile per CTA (grid = tiles); the tile loop has a trip count of 1 and compiles to
//                               straight-line code. A persistent dense kernel was measured (its tile loop costs
//                               registers: at 240 per consumer thread ptxas spilled ~60 bytes) and removed
//                               (docs/design/dense_kernel.md).
//   DynamicPersistentScheduler: one CTA per SM; the producer thread takes tiles from an atomic counter and publishes
//                               them in a two-slot mailbox the consumers read. Tile work varies by orders of magnitude
//                               (a few listed blocks to hundreds), so a static stride leaves SMs idle (measured 128K:
//                               7.85 ms vs 6.79 ms one CTA per tile).
//   PlannedScheduler:           the dynamic scheduler over the split-KV plan's units (split_kv/plan_combine.cu): units
//                               [0, n_split_units) are the parts of the split tiles (unit u = partial slot u), then
//                               unit n_split_units + t is tile t of the work order, unless that tile is split.
// A separate instantiation for the plan: its branch costs the consumers ~3 registers and with them 3 spill reloads per
// step in the mainloop (ptxas + SASS: 414 vs 260 bytes of spill stores); one-shot launches are never planned.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include <cutlass/arch/barrier.h>

#include "cuda/attention/block_schedule.h"
#include "cuda/attention/fwd_args.h"
#include "cuda/split_kv/rule.h"

namespace sparse_prefill::cuda {

// One work unit: tile `tile` of the work order, or split-KV part `split` of `nsplit` of it.
struct WorkUnit {
  int tile;
  int split, nsplit;
  int slot;    // float32 partial slot of a split-KV part (-1: the unit is the whole tile and writes out)
  bool valid;  // false: past the work order's tiles
};

template <class Config>
struct SingleTileScheduler {
  static constexpr bool kPersistent = false;
  static constexpr bool kPlanned = false;
  struct Params {
    int num_tiles;
  };
  static Params to_params(int64_t num_tiles, const SparseFwdArgs*) {
    if (num_tiles > INT32_MAX) throw std::runtime_error("sparse_prefill cuda: too many tiles");
    return {int(num_tiles)};
  }
  static int grid(const Params& p) { return p.num_tiles; }

  __device__ __forceinline__ static WorkUnit unit(const Params&, int u) { return {u, 0, 1, -1, true}; }
  template <class Steps>
  __device__ __forceinline__ static bool split_elsewhere(const Params&, const WorkUnit&, Steps&&) { return false; }
  template <class It>
  __device__ __forceinline__ static void apply_split(const WorkUnit&, It&) {}

  // The loop state of one role: its counters and the current tile's Work (the parameters come with every call).
  // make(t): the Work of tile t; every role makes its own (there is no mailbox).
  template <class Storage, class Work>
  struct Loop {  // the same for producer and consumers
    Storage& storage;
    Work work_;
    template <class Make>
    __device__ __forceinline__ int first(const Params&, Make&& make) {
      work_ = make(int(blockIdx.x));
      return int(blockIdx.x);
    }
    __device__ __forceinline__ const Work& work() const { return work_; }
    __device__ __forceinline__ bool more(const Params&, int, int n) const { return n < 1; }
    template <class Make>
    __device__ __forceinline__ int next(const Params&, int t, Make&&) { return t; }
    __device__ __forceinline__ int publication() const { return 0; }  // the tile's number in this CTA
  };
  template <class Storage, class Work>
  using Producer = Loop<Storage, Work>;
  template <class Storage, class Work>
  using Consumer = Loop<Storage, Work>;
};

template <class Config, bool kPlanned_>
struct PersistentScheduler {
  static constexpr bool kPersistent = true;
  static constexpr bool kPlanned = kPlanned_;
  struct Params {
    int num_tiles;        // bound of the work units: num_coord_tiles (+ max_split_units when planned)
    int num_coord_tiles;  // tiles of the work order
    int* tile_counter;    // zero at launch (SparseLaunchWorkspace::kTileCounter)
    // Planned: the real unit count is plan[kSplitUnits] + num_coord_tiles (SparseLaunchWorkspace, split_kv/split_kv.h).
    const int* plan;
    const int32_t* split_tiles;  // [.][4] {tile, nsplit, 0, 0}
    const int32_t* slot_tile;    // unit -> entry | split << 16
  };
  static Params to_params(int64_t coord_tiles, const SparseFwdArgs* s) {
    const SparseLaunchWorkspace& w = s->launch;
    // Persistent with the dynamic scheduler (it tied one CTA per tile on the H200, 128K: 6.64 vs 6.49 ms,
    // docs/design/sparse_kernel.md, and is the base for the split-KV plan), so it needs the launch counters.
    if (w.counters == nullptr && coord_tiles > 0)  // (a launch without tiles returns before it runs)
      throw std::runtime_error("sparse_prefill cuda: a sparse launch needs its launch workspace (counters)");
    Params p;
    p.num_coord_tiles = int(std::min<int64_t>(coord_tiles, INT32_MAX));
    p.tile_counter = w.counters != nullptr ? w.counters + SparseLaunchWorkspace::kTileCounter : nullptr;
    p.plan = kPlanned ? w.counters : nullptr;
    p.split_tiles = w.split_tiles;
    p.slot_tile = w.slot_tile;
    const int64_t units = coord_tiles + (kPlanned ? w.max_split_units : 0);
    if (units > INT32_MAX) throw std::runtime_error("sparse_prefill cuda: too many tiles");
    p.num_tiles = int(units);
    return p;
  }
  static int grid(const Params& p) { return std::min(p.num_tiles, num_sms()); }

  __device__ __forceinline__ static WorkUnit unit(const Params& p, int u) {
    WorkUnit w;
    const int n_split_units = kPlanned ? p.plan[SparseLaunchWorkspace::kSplitUnits] : 0;
    w.tile = u - n_split_units;
    w.split = 0;
    w.nsplit = 1;
    w.slot = -1;
    if (kPlanned && u < n_split_units) {
      const int v = p.slot_tile[u];
      const int4 e = reinterpret_cast<const int4*>(p.split_tiles)[v & 0xffff];
      w.tile = e.x;
      w.split = v >> 16;
      w.nsplit = e.y;
      w.slot = u;
    }
    w.valid = w.tile < p.num_coord_tiles;
    return w;
  }
  // A whole tile whose planned steps exceed the plan's cap runs as split units instead (the plan made the same call).
  template <class Steps>
  __device__ __forceinline__ static bool split_elsewhere(const Params& p, const WorkUnit& w, Steps&& steps) {
    if constexpr (kPlanned) {
      return w.nsplit == 1 && SplitRule::nsplit(steps(), p.plan[SparseLaunchWorkspace::kCap]) > 1;
    } else {
      return false;
    }
  }
  template <class It>
  __device__ __forceinline__ static void apply_split(const WorkUnit& w, It& it) {
    if constexpr (kPlanned) {
      if (w.nsplit > 1) it.split(w.split, w.nsplit);
    }
  }

  // The producer thread fetches the next unit while the current one loads, makes its Work (the tile metadata: a
  // chain of dependent global loads, sequence span -> tile base -> segment) and publishes both in slot
  // `published & 1` of the mailbox; slot s is reused every second tile. Every role reads the tile's Work from its
  // slot, which the consumers hold until they take the next tile. Made by each consumer, the Work stood between one
  // tile's epilogue and the next tile's first GEMM (ncu at 128K: 4.4 % of the sparse kernel's warp samples); the
  // producer makes it under the consumers' last steps. Read in place, its fields cost no registers between uses
  // (copied into registers at the take, the consumers spilled 3x as many bytes).
  template <class Storage, class Work>
  struct Producer {
    static_assert(sizeof(Work) <= sizeof(Storage::tile_work[0]), "the tile mailbox's slots hold a Work");
    Storage& storage;
    int published = 0, pending = 0;
    template <class Make>
    __device__ __forceinline__ int publish(const Params& p, int t, Make&& make) {
      // Units past the plan's real count (num_tiles is the host's bound) end the loop at once: publish the sentinel.
      // Read per tile, not held: the producer thread runs with 24 registers.
      if (kPlanned && t >= p.plan[SparseLaunchWorkspace::kSplitUnits] + p.num_coord_tiles) t = p.num_tiles;
      const int s = published & 1;
      if (published >= 2) storage.tile_empty[s].wait(((published >> 1) - 1) & 1);
      asm volatile("" ::: "memory");  // the slot's writes stay after the wait
      storage.tile_ids[s] = t;
      // Made into the slot (after the wait: held in registers across it, its fields spilled).
      if (t < p.num_tiles) *reinterpret_cast<Work*>(storage.tile_work[s]) = make(t);
      storage.tile_full[s].arrive();  // release: the slot's stores before it
      ++published;
      if (t < p.num_tiles) pending = atomicAdd(p.tile_counter, 1);  // used by the next next()
      return t;
    }
    template <class Make>
    __device__ __forceinline__ int first(const Params& p, Make&& make) {
      return publish(p, int(blockIdx.x), make);
    }
    __device__ __forceinline__ bool more(const Params& p, int t, int) const { return t < p.num_tiles; }
    template <class Make>
    __device__ __forceinline__ int next(const Params& p, int, Make&& make) {
      return publish(p, int(gridDim.x) + pending, make);
    }
    __device__ __forceinline__ int publication() const { return published - 1; }
    __device__ __forceinline__ const Work& work() const {
      return *reinterpret_cast<const Work*>(storage.tile_work[(published - 1) & 1]);
    }
  };
  template <class Storage, class Work>
  struct Consumer {
    Storage& storage;
    int taken = 0;
    __device__ __forceinline__ int take() {
      const int s = taken & 1;
      storage.tile_full[s].wait((taken >> 1) & 1);
      asm volatile("" ::: "memory");  // the slot's reads stay after the wait (cutlass's wait has no memory clobber)
      ++taken;
      return storage.tile_ids[s];
    }
    template <class Make>
    __device__ __forceinline__ int first(const Params&, Make&&) { return take(); }
    __device__ __forceinline__ bool more(const Params& p, int t, int) const { return t < p.num_tiles; }
    __device__ __forceinline__ int publication() const { return taken - 1; }  // the current tile's
    template <class Make>
    __device__ __forceinline__ int next(const Params&, int, Make&&) {
      storage.tile_empty[publication() & 1].arrive();  // done with the current tile's slot (its Work)
      return take();
    }
    __device__ __forceinline__ const Work& work() const {
      return *reinterpret_cast<const Work*>(storage.tile_work[publication() & 1]);
    }
  };
};

template <class Config>
using DynamicPersistentScheduler = PersistentScheduler<Config, false>;
template <class Config>
using PlannedScheduler = PersistentScheduler<Config, true>;

}  // namespace sparse_prefill::cuda
