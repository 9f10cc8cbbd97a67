// Index stage, step 1: the plan. Per-sequence prefix sums of tiles and pooled blocks, read from cu_seqlens /
// seqused_k on the device, and the counters (the block_ids cursor among them) reset.
#include "cuda/common/check.h"
#include "cuda/index/device_args.cuh"

namespace sparse_prefill::cuda::index_stage {
namespace {

// Serial prefix sums over the batch (B is small; microseconds) and counter reset. Device-side checks
// (device_checks.h): a sequence whose span is invalid gets no tile and no block (so no later kernel of the index stage
// addresses memory from its values; the sparse kernel writes its rows NaN) and is reported. The valid spans bound the
// sums by the workspace's host-side bounds (Bounds): lengths within max_seqlen, rows within q and k.
__global__ void plan_kernel(SeqArgs seq, SeqLimits limits, DeviceError* err, int group_size, int block_size,
                            int32_t* cu_tiles, int32_t* cu_blocks, unsigned long long* counters) {
  int64_t tiles = 0, blocks = 0;
  cu_tiles[0] = 0; cu_blocks[0] = 0;
  for (int b = 0; b < seq.batch; ++b) {
    const SeqSpan span = load_seq_span(seq.cu_q, seq.cu_k, seq.seqused_k, b);
    const int bad = seq_violation(span, b, limits);
    if (bad) report_seq_error(err, bad, b, span, limits);
    const int64_t t = bad ? 0 : geometry::num_tiles(seq.q_len(b), group_size);
    const int64_t nb = bad ? 0 : geometry::num_blocks(seq.k_len(b), block_size);
    tiles += t; blocks += nb;
    cu_tiles[b + 1] = int32_t(tiles); cu_blocks[b + 1] = int32_t(blocks);
  }
  for (int i = 0; i < kNumCounters; ++i) counters[i] = 0;
}

}  // namespace

void launch_plan(cudaStream_t stream, const SeqArgs& seq, const SeqLimits& limits, const VirtualHeads& heads,
                 int block_size, const DeviceIndex& d) {
  plan_kernel<<<1, 1, 0, stream>>>(seq, limits, device_error_word(), heads.group, block_size, d.cu_tiles,
                                   d.cu_blocks, d.counters);
  check_cuda(cudaGetLastError(), "plan_kernel launch");
}

}  // namespace sparse_prefill::cuda::index_stage
