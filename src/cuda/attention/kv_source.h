// KV-source policies: how the producer warpgroup fills a K or V stage with the 128 keys of one key block.
//   KvTma:           one thread issues TMA. Contiguous KV: one 128-row box at row k_start + n * 128. Paged KV
//                    (page_size % 64 == 0, runtime): page_size % 128 == 0 one box per block from its page; % 128 == 64
//                    two 64-row boxes, each from its own page, into the two row halves of the stage (same mbarrier,
//                    same byte count).
//   KvCpAsyncGather: paged KV whose page_size is not a multiple of 64 (vLLM's 16, or 1). TMA boxes cannot follow pages
//                    that small (boxes of 16 rows, one per page, measured 2.4-2.7x slower than contiguous KV, and
//                    compiled into the TMA producer they cost every other path 1.5-5 %, docs/design/dense_kernel.md), so the whole
//                    producer warpgroup gathers K/V rows with cp.async into the same swizzled stage layout TMA writes.
// Both check block_table ids where they load them and poison the tile on a bad one (device_checks.h).
#pragma once

#include "cuda/attention/kv_gather.h"
#include "cuda/attention/kv_tma.h"
