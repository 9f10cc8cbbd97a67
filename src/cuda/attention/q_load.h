// Q-load policies: how a tile's 128 query rows reach the Q buffer in shared memory (also the O staging buffer).
//   QTma:           one TMA box of 128 rows of one query head, issued by the producer thread; the consumers wait on
//                   barrier_q and give the buffer back (barrier_q_empty) after the epilogue.
//   QPackGqaGather: PackGQA tiles (row = position * g + head % g) are not a box: the consumers gather their own rows.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory.h>

#include "cuda/attention/fwd_problem.h"
#include "cuda/attention/fwd_args.h"

namespace sparse_prefill::cuda {

template <class Config>
struct QTma {
  struct Params {
    typename Config::TmaQ tma_q;
  };
  template <class MakeGmem>
  static Params to_params(const FwdArgs& a, MakeGmem&& gmem) {
    using namespace cute;
    return {make_tma_copy(SM90_TMA_LOAD{}, gmem(a.in.q, a.total_q, a.num_q_heads, a.in.q_stride[0], a.in.q_stride[1]),
                          typename Config::SmemLayoutQ{}, select<0, 2>(typename Config::TileShapeQK{}), _1{})};
  }
  __device__ __forceinline__ static void prefetch(const Params& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
  }

  struct Producer {
    int q_loads = 0;
    template <class Storage, class Work>
    __device__ __forceinline__ void load(const Params& p, const FwdProblem& pr, Storage& storage, const Work& work) {
      using namespace cute;
      constexpr int kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
      // The Q buffer is reused as O staging: wait until both consumer warpgroups finished the previous epilogue.
      if (q_loads > 0) storage.barrier_q_empty.wait((q_loads - 1) & 1);
      ++q_loads;
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(pr.total_q, kHeadDim, pr.num_q_heads));
      Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
      Tensor gQ = local_tile(domain_offset(make_coord(work.seq.q_start, _0{}), mQ(_, _, work.q_head)),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(work.row0 / kBlockM, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      storage.barrier_q.arrive_and_expect_tx(Config::kTmaBytesQ);
      copy(p.tma_q.with(reinterpret_cast<uint64_t&>(storage.barrier_q), 0), tQgQ, tQsQ);
    }
  };

  template <bool kPersistent>
  struct Consumer {
    int q_phase = 0;
    template <class Storage, class Work>
    __device__ __forceinline__ void acquire(const Params&, const FwdProblem&, Storage& storage, const Work&, int,
                                            int) {
      storage.barrier_q.wait(q_phase);
      q_phase ^= 1;
    }
    template <class Storage>
    __device__ __forceinline__ void release(Storage& storage) {
      storage.barrier_q_empty.arrive();  // done with the Q/O smem buffer of this tile
    }
  };
};

template <class Config>
struct QPackGqaGather {
  struct Params {
    const void* q;
    int64_t q_row_stride, q_head_stride;  // elements
  };
  template <class MakeGmem>
  static Params to_params(const FwdArgs& a, MakeGmem&&) { return {a.in.q, a.in.q_stride[0], a.in.q_stride[1]}; }
  __device__ __forceinline__ static void prefetch(const Params&) {}

  struct Producer {
    template <class Storage, class Work>
    __device__ __forceinline__ void load(const Params&, const FwdProblem&, Storage&, const Work&) {}
  };

  // This warpgroup's 64 tile rows, 16-byte loads into the swizzled tile (addressed through the tensor, as in the
  // epilogue), zeros for rows past the sequence; then the generic-proxy stores are made visible to wgmma. Each
  // warpgroup's S GEMM reads only its own 64 rows.
  //
  // Global address of element col of tile row `row` (row < the tile's rows).
  template <class Work>
  __device__ __forceinline__ static const typename Config::Element* row_src(const Params& p, const FwdProblem& pr,
                                                                             const Work& w, int row, int col) {
    return static_cast<const typename Config::Element*>(p.q) +
           int64_t(w.seq.q_start + w.row_pos(pr, row)) * p.q_row_stride +
           int64_t(w.row_head(pr, row)) * p.q_head_stride + col;
  }

  template <bool kPersistent>
  struct Consumer {
    template <class Storage, class Work>
    __device__ __forceinline__ void acquire(const Params& p, const FwdProblem& pr, Storage& storage, const Work& work,
                                            int mma_tidx, int cwg) {
      using namespace cute;
      using Element = typename Config::Element;
      Tensor sQw = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Config::SmemLayoutQ{});
      constexpr int kPerChunk = 16 / int(sizeof(Element));  // elements per 16-byte load: 8 (16-bit), 16 (FP8)
      constexpr int kChunks = Config::kHeadDim / kPerChunk;
      const int tq = mma_tidx % 128;
      const int tile_rows = work.tile_rows(pr);  // rows past the sequence are zeros
      if constexpr (kPersistent) cutlass::arch::NamedBarrier::sync(128, 1 + cwg);  // previous epilogue read these rows
      uint4 vals[64 * kChunks / 128];
      CUTE_UNROLL
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const int idx = tq + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        vals[k] = row < tile_rows ? __ldg(reinterpret_cast<const uint4*>(row_src(p, pr, work, row, ch * kPerChunk)))
                                  : make_uint4(0, 0, 0, 0);
      }
      CUTE_UNROLL
      for (int k = 0; k < 64 * kChunks / 128; ++k) {
        const int idx = tq + 128 * k;
        const int row = cwg * 64 + idx / kChunks, ch = idx % kChunks;
        cutlass::arch::shared_store<16>(cast_smem_ptr_to_uint(&sQw(row, ch * kPerChunk)), &vals[k]);
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
    }
    template <class Storage>
    __device__ __forceinline__ void release(Storage&) {}
  };
};

}  // namespace sparse_prefill::cuda
