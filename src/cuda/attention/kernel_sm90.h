// The warp-specialised sm90 attention kernel: FwdKernel<Mainloop, Epilogue, Scheduler>. One producer warpgroup (TMA:
// a single thread; the cp.async gather: all 128) loads Q once per tile and the K/V blocks of the tile's block
// iterator into 3-stage mbarrier pipelines; two consumer warpgroups of 64 query rows each run the mainloop and the
// epilogue. This file holds only the roles, the pipelines and barriers, and the tile loop; what differs between
// variants is in the policies (mainloop_sm90.h, epilogue.h, scheduler.h) and the variants are named in variants.h.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/attention/epilogue.h"
#include "cuda/attention/mainloop_sm90.h"
#include "cuda/attention/scheduler.h"
#include "cuda/common/device_checks.h"
#include "cuda/attention/softmax.h"

namespace sparse_prefill::cuda {

template <class Mainloop_, template <class> class Epilogue_, template <class> class Scheduler_>
struct FwdKernel {
  using Mainloop = Mainloop_;
  using Config = typename Mainloop::Config;
  using Epilogue = Epilogue_<Config>;
  using Scheduler = Scheduler_<Config>;
  using QLoad = typename Mainloop::QLoad;
  using KvSource = typename Mainloop::KvSource;
  using Schedule = typename Mainloop::Schedule;
  using Fusion = typename Mainloop::Fusion;
  using Work = typename Mainloop::Work;
  using Pipeline = typename Mainloop::Pipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using SharedStorage = typename Config::SharedStorage;
  static constexpr int kRows = Mainloop::kRows;
  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    LaunchGate gate;
  };
  // Host: every policy builds its own parameters from the launch arguments.
  static Params to_underlying_arguments(const FwdArgs& a, const SparseFwdArgs* s) {
    Params p;
    p.mainloop = Mainloop::to_params(a, s);
    p.epilogue = Epilogue::to_params(a, s);
    p.scheduler = Scheduler::to_params(Schedule::num_tiles(p.mainloop.problem), s);
    p.gate = a.gate;
    return p;
  }
  static int grid(const Params& p) { return Scheduler::grid(p.scheduler); }

  template <class Unit>
  __device__ __forceinline__ static Work work_of(const Params& params, const Unit& u) {
    return Schedule::template work<Scheduler, Fusion>(params.mainloop, params.scheduler, u);
  }
  // make(t) for the schedulers' roles: the Work of tile t.
  __device__ __forceinline__ static auto work_maker(const Params& params) {
    return [&params](int t) { return work_of(params, Scheduler::unit(params.scheduler, t)); };
  }

  __device__ __forceinline__ static void run(const Params& params, char* smem_raw) {
    using namespace cute;
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int wg_idx = cutlass::canonical_warp_group_idx();

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Mainloop::prefetch(params.mainloop);
      storage.barrier_q.init(1);
      storage.barrier_q_empty.init(Config::kNumMmaThreads);
      if constexpr (KvSource::kTransposeV) KvSource::init_barriers(storage);
      for (int s = 0; s < 4; ++s) storage.poisoned[s] = 0;
      for (int s = 0; s < 2; ++s) {  // the tile mailbox (persistent schedulers): consumers and V transposers read it
        storage.tile_full[s].init(1);
        storage.tile_empty[s].init(Config::kNumMmaThreads + KvSource::kTransposeThreads);
      }
    }
    typename Pipeline::Params pipe_params;
    pipe_params.role = wg_idx == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    Pipeline pipeline_k = KvSource::make_pipeline(storage.pipeline_k, pipe_params);
    Pipeline pipeline_v = KvSource::make_pipeline(storage.pipeline_v, pipe_params);
    __syncthreads();

    if (wg_idx == 0) {
      producer(params, storage, pipeline_k, pipeline_v);
    } else {
      consumer(params, storage, pipeline_k, pipeline_v, wg_idx);
    }
  }

  __device__ __forceinline__ static void producer(const Params& params, SharedStorage& storage, Pipeline& pipeline_k,
                                                  Pipeline& pipeline_v) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if constexpr (KvSource::kTransposeV) {  // warps 1-3: the V transpose (KvTmaTransposeV)
      if (threadIdx.x >= 32) return transposer(params, storage, pipeline_v);
    }
    if (KvSource::kProducerThreads == 1 && threadIdx.x != 0) return;  // TMA: one thread issues everything
    const bool issuer = threadIdx.x == 0;                              // Q (and, TMA, K/V)
    PipelineState st_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState st_v = cutlass::make_producer_start_state<Pipeline>();
    typename QLoad::Producer q;
    using Loop = typename Scheduler::template Producer<SharedStorage, Work>;
    Loop sched{storage};
    // A bad value met while loading a tile (poison_tile, mainloop_sm90.h).
    auto poison = [&](int code, int index, int value) {
      poison_tile<KvSource::kGenericProxy>(storage, sched.publication(), code, index, value);
    };
    const auto make = work_maker(params);
    for (int t = sched.first(params.scheduler, make), n = 0; sched.more(params.scheduler, t, n);
         t = sched.next(params.scheduler, t, make), ++n) {
      // Tile metadata: made by the producer and published with the tile (persistent schedulers), or made by every
      // role alike (one tile per CTA).
      const Work& work = sched.work();
      if (!work.valid) continue;            // beyond this sequence
      if (work.iter.count() == 0) continue;  // consumers write zeros without smem
      Mainloop::load_tile(params.mainloop, storage, work, pipeline_k, pipeline_v, st_k, st_v, q, issuer, poison);
    }
  }

  // The V transpose warps (KvTmaTransposeV): the tiles of the producer loop, each V step of each tile. They read the
  // tiles as the consumers do (a persistent scheduler's mailbox counts their arrivals too).
  __device__ __forceinline__ static void transposer(const Params& params, SharedStorage& storage,
                                                    Pipeline& pipeline_v) {
    PipelineState st;  // read state of the V pipeline (like a consumer's)
    typename Scheduler::template Consumer<SharedStorage, Work> sched{storage};
    const auto make = work_maker(params);
    for (int t = sched.first(params.scheduler, make), n = 0; sched.more(params.scheduler, t, n);
         t = sched.next(params.scheduler, t, make), ++n) {
      const Work& work = sched.work();
      if (!work.valid || work.iter.count() == 0) continue;
      KvSource::transpose_tile(params.mainloop.kv, storage, work, pipeline_v, st, int(threadIdx.x) - 32);
    }
  }

  __device__ __forceinline__ static void consumer(const Params& params, SharedStorage& storage, Pipeline& pipeline_k,
                                                  Pipeline& pipeline_v, int wg_idx) {
    using namespace cute;
    constexpr int kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
    const FwdProblem& pr = params.mainloop.problem;
    const int mma_tidx = threadIdx.x - 128;
    const int cwg = wg_idx - 1;  // consumer warpgroup: query rows [64*cwg, 64*cwg + 64) of the tile
    PipelineState st;            // consumer read state (same sequence for K and V), carried across tiles
    typename QLoad::template Consumer<Scheduler::kPersistent> q;
    typename Scheduler::template Consumer<SharedStorage, Work> sched{storage};
    const auto make = work_maker(params);
    for (int t = sched.first(params.scheduler, make), n = 0; sched.more(params.scheduler, t, n);
         t = sched.next(params.scheduler, t, make), ++n) {
      const Work& work = sched.work();
      if (!work.valid) continue;
      if (work.iter.count() == 0) {  // no step: zeros, or NaN for a bad tile (Work::bad), reported here
        if (Epilogue::store_empty(params.epilogue, pr, work, mma_tidx) && work.bad && mma_tidx == 0)
          Schedule::report_bad_tile(params.mainloop, work);
        continue;
      }
      typename Config::TiledMmaPV mma_pv;
      Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      // FP8 (Fp8Descale): q_descale * k_descale scales the logits, v_descale the normalised O.
      float scale_log2 = pr.scale_log2, softmax_scale = pr.softmax_scale, v_descale = 1.f;
      if constexpr (Fusion::kDescale) {
        const auto d = Fusion::scales(params.mainloop.fusion, pr, work);
        scale_log2 *= d.qk;
        softmax_scale *= d.qk;
        v_descale = d.v;
        if (d.negative >= 0) {  // cold path: the tile's rows (and LSE) are NaN, check_errors() names the descale
          v_descale = softmax_scale = __int_as_float(0x7fc00000);
          if (mma_tidx == 0) report_device_error(pr.err, kErrDescale, work.batch, work.kv_head_mem(pr), d.negative, 0);
        }
      }
      OnlineSoftmax<kRows, Config::kMaxOffset> softmax(scale_log2);
      Mainloop::mma(params.mainloop, storage, work, pipeline_k, pipeline_v, st, q, mma_pv, tOrO, softmax, mma_tidx,
                    cwg);

      // ---- epilogue ----
      float inv_sum[kRows], lse[kRows];
      softmax.finalize(softmax_scale, inv_sum, lse);
      if constexpr (Fusion::kDescale) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) inv_sum[r] *= v_descale;
      }
      // A bad page or block id met by the producer while loading this tile (poison_tile, mainloop_sm90.h): its rows
      // are NaN.
      {
        const int n_pub = sched.publication();
        if (storage.poisoned[n_pub & 3] == n_pub + 1) {
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) inv_sum[r] = lse[r] = __int_as_float(0x7fc00000);
          if (mma_tidx == 0) {
            const int4 bad = storage.poison_info[n_pub & 3];
            const int bound = bad.x == kErrBlockTable ? params.mainloop.kv.num_pages
                                                      : Schedule::id_bound(params.mainloop, work.seq);
            report_device_error(pr.err, bad.x, work.batch, bad.y, bad.z, bound);
          }
        }
      }
      Mainloop::rescale_o(tOrO, inv_sum);
      Epilogue::store(params.epilogue, pr, storage, work, mma_pv.get_slice(mma_tidx), tOrO, lse, mma_tidx, cwg);
      q.release(storage);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::Config::kNumThreads, 1)
    fwd_device_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ char smem_raw[];
  // A gated launch whose word says otherwise: every CTA returns before any barrier or load (LaunchGate).
  if (params.gate.word != nullptr && *params.gate.word != params.gate.run_if) return;
  Kernel::run(params, smem_raw);
}

}  // namespace sparse_prefill::cuda
