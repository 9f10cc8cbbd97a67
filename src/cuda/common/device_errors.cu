// The device error word (device_checks.h): one per device, read and cleared by check_errors().
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/check.h"
#include "cuda/common/device_checks.h"
#include "cuda/cuda_backend.h"

namespace sparse_prefill::cuda {
namespace {

__device__ DeviceError g_device_error;

std::string num(long long x) { return std::to_string(x); }

}  // namespace

DeviceError* device_error_word() {
  static DeviceError* cache[64] = {nullptr};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 0 || dev >= 64) return nullptr;
  if (cache[dev] == nullptr) {
    void* ptr = nullptr;
    check_cuda(cudaGetSymbolAddress(&ptr, g_device_error), "cudaGetSymbolAddress(error word)");
    cache[dev] = static_cast<DeviceError*>(ptr);
  }
  return cache[dev];
}

std::optional<ArgumentError> take_device_error(void* stream_) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return std::nullopt;  // a CUDA build on a machine without a GPU: no kernel ever ran
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  DeviceError* word = device_error_word();
  if (word == nullptr) return std::nullopt;
  DeviceError e{};
  check_cuda(cudaMemcpyAsync(&e, word, sizeof(e), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync(error word)");
  check_cuda(cudaStreamSynchronize(stream), "check_errors");
  if (e.code == kErrNone) return std::nullopt;
  check_cuda(cudaMemsetAsync(word, 0, sizeof(DeviceError), stream), "cudaMemsetAsync(error word)");
  check_cuda(cudaStreamSynchronize(stream), "check_errors");
  return device_error_message(e.code, e.seq, e.index, e.value, e.bound);
}

namespace {
// The four cu_seqlens violations (start, decreasing, rows, last entry; DeviceErrorCode order) of `name` over the rows
// of `array`.
ArgumentError cu_seqlens_error(const char* name, const char* array, int which, const std::string& s,
                               const std::string& i, const std::string& v, const std::string& b,
                               const std::string& note) {
  const std::string n = name;
  switch (which) {
    case 0: return ArgumentError(name, n + "[0] = " + v + " must be 0" + note);
    case 1: return ArgumentError(name, "must be non-decreasing; " + n + "[" + i + "] = " + v + " < " + n + "[" + s +
                                           "] = " + b + note);
    case 2: return ArgumentError(name, n + "[" + i + "] = " + v + " exceeds the " + b + " rows of " + array + note);
    default:
      return ArgumentError(name, "last entry " + n + "[" + i + "] = " + v + " must equal the number of rows of " +
                                     array + " (" + b + ")" + note);
  }
}
}  // namespace

// The messages name the argument first, as the host validation's do (validate.cpp).
ArgumentError device_error_message(int code, int seq, int index, int value, int bound) {
  const std::string s = num(seq), i = num(index), v = num(value), b = num(bound);
  const std::string note = " (detected on the device)";
  switch (code) {
    case kErrCuQStart: case kErrCuQDecreasing: case kErrCuQRows: case kErrCuQLast:
      return cu_seqlens_error("cu_seqlens_q", "q", code - kErrCuQStart, s, i, v, b, note);
    case kErrMaxSeqlenQ:
      return ArgumentError("max_seqlen_q", "sequence " + s + " has length " + v + " > max_seqlen_q = " + b + note);
    case kErrCuKStart: case kErrCuKDecreasing: case kErrCuKRows: case kErrCuKLast:
      return cu_seqlens_error("cu_seqlens_k", "k", code - kErrCuKStart, s, i, v, b, note);
    case kErrMaxSeqlenK:
      return ArgumentError("max_seqlen_k", "sequence " + s + " has " + v + " keys > max_seqlen_k = " + b + note);
    case kErrSequsedNegative:
      return ArgumentError("seqused_k", "seqused_k[" + s + "] = " + v + " is negative" + note);
    case kErrSequsedPages:
      return ArgumentError("seqused_k", "seqused_k[" + s + "] = " + v + " exceeds the " + b + " rows that block_table row " +
                                            s + "'s pages hold" + note);
    case kErrBlockTable:
      return ArgumentError("block_table", "page id block_table[" + s + ", " + i + "] = " + v +
                                              " is out of range [0, " + b + ")" + note);
    case kErrSegment:
      return ArgumentError("index.segment_start", "segment " + i + " (sequence " + s + ") has the range [" + v + ", " +
                                                      b + ") outside the index's block ids" + note);
    case kErrBlockId:
      return ArgumentError("index.block_ids", "a segment of sequence " + s + " lists block id " + v +
                                                  " outside [0, " + b + ")" + note);
    case kErrCuBlocks:
      return ArgumentError("index.cu_blocks", "cu_blocks[" + s + "] .. cu_blocks[" + s + " + 1] = " + v + " .. " + b +
                                                  " do not match sequence " + s + "'s pooled blocks" + note);
    case kErrDescale: {
      const char* name = value == 0 ? "q_descale" : value == 1 ? "k_descale" : "v_descale";
      return ArgumentError(name, std::string(name) + "[" + s + ", " + i + "] is negative; descales must be >= 0" + note);
    }
    default:
      return ArgumentError("(device)", "unknown device error code " + num(code) + note);
  }
}

}  // namespace sparse_prefill::cuda
