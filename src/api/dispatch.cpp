// The public entry points: validate once, ask the call's backend (core/backend.h: backend_for(p.device), the CPU
// reference or CUDA; a build without CUDA links src/no_cuda/, whose checks say so) whether it supports the call, then
// run it there.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/validate.h"
#include "core/backend.h"
#include "core/contract.h"
#include "core/problem.h"
#include "reference/reference.h"
#include "sparse_prefill/sparse.h"

namespace sparse_prefill {
namespace {

[[noreturn]] void not_on_cuda(const char* what) {
  throw NotImplementedError(std::string(what) + " is not implemented for CUDA yet; pass CPU arrays to use the "
                                                "CPU reference backend");
}

Problem validate_host(const AttentionInputs& in, const AttentionOutputs* outs, const char* what) {
  Problem p = validate_inputs(in, outs);
  if (p.device != Device::kCPU) not_on_cuda(what);
  return p;
}

// Checked mode (LaunchOptions::checked), before a CUDA launch: the device-resident index values copied to the host
// and validated as CPU arrays are (synchronises in.stream); with `view`, the caller's index arrays too. Returns the
// host-resolved problem (p.seqs filled) for the index check.
void checked_before(const AttentionInputs& in, const Problem& p, const BlockIndexView* view = nullptr) {
  if (!in.options.checked || p.device == Device::kCPU) return;
  const Backend& be = backend_for(p.device);
  std::vector<int32_t> cu_q, cu_k, bt, used;
  const TensorView h_cu_q = be.download_int32(in.cu_seqlens_q, in.stream, cu_q);
  std::optional<TensorView> h_cu_k, h_bt, h_used;
  if (in.cu_seqlens_k) h_cu_k = be.download_int32(*in.cu_seqlens_k, in.stream, cu_k);
  if (in.block_table) h_bt = be.download_int32(*in.block_table, in.stream, bt);
  if (in.seqused_k) h_used = be.download_int32(*in.seqused_k, in.stream, used);
  Problem hp = p;
  hp.device = Device::kCPU;
  validate_values(in, h_cu_q, h_cu_k ? &*h_cu_k : nullptr, h_bt ? &*h_bt : nullptr, h_used ? &*h_used : nullptr, hp);
  for (const auto& [t, name] : {std::pair{&in.q_descale, "q_descale"}, std::pair{&in.k_descale, "k_descale"},
                                std::pair{&in.v_descale, "v_descale"}}) {
    std::vector<int32_t> bits;  // float32 values moved as 4-byte words
    if (t->has_value()) check_descale_values(be.download_int32(**t, in.stream, bits), name);
  }
  if (view == nullptr) return;
  std::vector<int32_t> s0, s1, ids, cu_blocks;
  BlockIndexView hv = *view;
  hv.segment_start = be.download_int32(view->segment_start, in.stream, s0);
  hv.segment_end = be.download_int32(view->segment_end, in.stream, s1);
  hv.block_ids = be.download_int32(view->block_ids, in.stream, ids);
  hv.cu_blocks = be.download_int32(view->cu_blocks, in.stream, cu_blocks);
  hv.k_mean.device = Device::kCPU;  // shapes only: validate_index never reads the means
  if (!is_absent(hv.v_mean)) hv.v_mean.device = Device::kCPU;
  validate_index(hp, hv);
}
// ... and after it: the kernels' own checks (the device error word), synchronising in.stream.
void checked_after(const AttentionInputs& in, const Problem& p) {
  if (!in.options.checked || p.device == Device::kCPU) return;
  if (std::optional<ArgumentError> e = backend_for(p.device).take_device_error(in.stream)) throw *e;
}

}  // namespace

void check_errors(void* stream) {  // the device error word is the CUDA backend's (device_checks.h)
  if (std::optional<ArgumentError> e = cuda_backend().take_device_error(stream)) throw *e;
}

void attention(const AttentionInputs& in, const AttentionOutputs& outs) {
  const Problem p = validate_inputs(in, &outs);
  const Backend& be = backend_for(p.device);
  checked_before(in, p);
  be.check_attention(in, outs, p);
  be.attention(in, outs, p);
  checked_after(in, p);
}

LaunchOptions::DensePath attention_path(const AttentionInputs& in) {
  const Problem p = validate_inputs(in, nullptr);
  if (backend_for(p.device).dense_uses_full_list(in, p)) return LaunchOptions::DensePath::kSplitKV;
  return LaunchOptions::DensePath::kDenseKernel;
}

std::string fp8_attention_support(int head_dim, int64_t page_size) {
  if (page_size < 0) {
    throw ArgumentError("page_size", "must be >= 0 (0: contiguous KV), got " + std::to_string(page_size));
  }
  return cuda_backend().fp8_attention_support(head_dim, page_size);
}

int64_t attention_workspace_bytes(int head_dim) {  // the workspace of CUDA attention (the CPU needs none)
  check_head_dim(head_dim, "head_dim");
  return cuda_backend().attention_workspace_bytes(head_dim);
}

void pool_kv(const AttentionInputs& in, int block_size, std::vector<int32_t>& cu_blocks, std::vector<float>& k_mean,
             std::vector<float>& v_mean) {
  SelectionParams params;
  params.block_size = block_size;
  check_selection_params(params);
  const Problem p = validate_host(in, nullptr, "pool_kv");
  reference::pool_kv(p, reference::gather_kv(in, p), block_size, cu_blocks, k_mean, &v_mean);
}

namespace {

// The problem of a selection call (parameters, inputs, head sub-groups, and the mean cache when given) and its
// parameters, as requested (head_subgroups 0: one per query head; the index's resolved S is its binding's).
struct SelectionCall {
  Problem p;
  SelectionParams params;
};
SelectionCall validate_selection(const AttentionInputs& in, const SelectionParams& params,
                                 const AttentionOutputs* outs, const MeanCache* cache = nullptr) {
  check_selection_params(params);
  SelectionCall c{validate_inputs(in, outs), params};
  if (params.rule == SelectionRule::kKeyMax && params.key_rank > c.p.head_dim) {  // a basis of r directions in D
    throw ArgumentError("key_rank", "must be <= the head dim " + std::to_string(c.p.head_dim) + " under rule "
                                    "kKeyMax, got " + std::to_string(params.key_rank));
  }
  if (params.head_subgroups != 0) check_head_subgroups(params.head_subgroups, c.p.group_size, "head_subgroups");
  if (cache) validate_mean_cache(in, c.p, c.params.block_size, *cache);
  return c;
}

// The index stage writes V means only with the correction (pool.cu): a device index built without it, its params
// edited to the correction, must not have unwritten means read (by the kernel or to_host).
void check_device_v_means(const DeviceBlockIndex& index) {
  if (index.params.correction && !index.binding.v_means) {
    throw ArgumentError("index.v_mean", "is missing, but index.correction is set: the index was built without the "
                                        "correction, so it holds no pooled V means (build it with correction=True)");
  }
}

// A device index's params are its request (head_subgroups 0: one per query head); the backend reads the resolved S
// from its binding. A request that resolves to another S than the built one is an error.
const DeviceBlockIndex& as_built(const DeviceBlockIndex& index) {
  const int requested = index.params.head_subgroups;
  if (requested != 0 && requested != index.binding.num_subgroups) {
    throw ArgumentError("index", "its params.head_subgroups (" + std::to_string(requested) +
                                     ") differ from the sub-groups it was built with (binding.num_subgroups " +
                                     std::to_string(index.binding.num_subgroups) + ")");
  }
  return index;
}

}  // namespace

BlockIndex build_index(const AttentionInputs& in, const SelectionParams& requested) {
  const auto [p, params] = validate_selection(in, requested, nullptr);
  const Backend& be = backend_for(p.device);
  checked_before(in, p);
  be.check_index(in, p, params);
  BlockIndex index = be.build_index(in, p, params);
  checked_after(in, p);
  index.binding = bind_index(in, p, params);
  return index;
}

void sparse_attention(const AttentionInputs& in, const BlockIndexView& index, const AttentionOutputs& outs,
                      bool reuse_index) {
  const Problem p = validate_inputs(in, &outs);
  check_binding(index.binding, in, p, reuse_index);
  validate_index(p, index);
  const Backend& be = backend_for(p.device);
  checked_before(in, p, &index);
  be.check_sparse(in, p, index.block_size);
  be.check_attention(in, outs, p);
  be.check_index_view(index);
  be.sparse_attention(in, index, outs, p);
  checked_after(in, p);
}

int64_t sparse_attention_workspace_bytes(const AttentionInputs& in, const BlockIndexView& index) {
  const Problem p = validate_inputs(in, nullptr);
  return int64_t(backend_for(p.device).sparse_attention_workspace_bytes(in, index, p));
}

int64_t index_workspace_bytes(const AttentionInputs& in, const SelectionParams& requested) {
  const auto [p, params] = validate_selection(in, requested, nullptr);
  return int64_t(backend_for(p.device).index_workspace_bytes(in, p, params));
}

int64_t sparse_prefill_workspace_bytes(const AttentionInputs& in, const SelectionParams& params) {
  return index_workspace_bytes(in, params);  // the index and the launch state of its sparse_attention
}

DeviceBlockIndex build_index(const AttentionInputs& in, const SelectionParams& requested,
                             const TensorView& workspace, const MeanCache* mean_cache) {
  const auto [p, params] = validate_selection(in, requested, nullptr, mean_cache);
  if (p.device == Device::kCPU) no_device_index();
  DeviceBlockIndex index{workspace, params, bind_index(in, p, params)};
  const Backend& be = backend_for(p.device);
  checked_before(in, p);
  be.check_index(in, p, params);
  be.build_index(in, p, params, workspace, mean_cache);
  checked_after(in, p);
  return index;
}

void sparse_attention(const AttentionInputs& in, const DeviceBlockIndex& given, const AttentionOutputs& outs,
                      bool reuse_index) {
  const Problem p = validate_inputs(in, &outs);
  const DeviceBlockIndex& index = as_built(given);
  if (p.device == Device::kCPU) no_device_index();
  if (!index.binding.set) throw ArgumentError("index", "is not a built device index (its binding is unset)");
  check_binding(index.binding, in, p, reuse_index);
  check_device_v_means(index);
  // A device index keeps its correction means in the kernel operand type of the arrays it was built on (16-bit, or
  // e4m3 in k's / v's raw units): other dtypes would read them as their own.
  if (index.params.correction && index.binding.dtype != p.dtype) {
    throw ArgumentError("index", std::string("was built on ") + dtype_name(index.binding.dtype) +
                                     " arrays with the correction: its pooled means cannot serve " +
                                     dtype_name(p.dtype) + " inputs (build the index on these arrays, or with "
                                     "correction=False)");
  }
  const Backend& be = backend_for(p.device);
  checked_before(in, p);
  be.check_sparse(in, p, index.params.block_size);
  be.check_attention(in, outs, p);
  be.sparse_attention(in, outs, p, index);
  checked_after(in, p);
}

std::pair<int64_t, int64_t> index_counts(const DeviceBlockIndex& index, void* stream) {
  const IndexStats s = index_stats(index, stream);
  return {s.kept_blocks, s.visible_blocks};
}

IndexStats index_stats(const DeviceBlockIndex& index, void* stream) {
  return backend_for(index.binding.device).index_stats(as_built(index), stream);
}

BlockIndex to_host(const DeviceBlockIndex& index, void* stream) {
  check_device_v_means(index);
  return backend_for(index.binding.device).to_host(as_built(index), stream);
}

namespace {

void sparse_prefill_impl(const AttentionInputs& in, const SelectionParams& requested, const AttentionOutputs& outs,
                         const MeanCache* cache) {
  const auto [p, params] = validate_selection(in, requested, &outs, cache);
  const Backend& be = backend_for(p.device);
  checked_before(in, p);
  // the kernel's checks before the index stage's: nothing launches for a call the kernel cannot run
  be.check_sparse(in, p, params.block_size);
  be.check_attention(in, outs, p);
  be.check_index(in, p, params);
  be.sparse_prefill(in, params, outs, p, cache);
  checked_after(in, p);
}

}  // namespace

void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs) {
  sparse_prefill_impl(in, params, outs, nullptr);
}

std::string sparse_prefill_support(const AttentionInputs& in, const SelectionParams& requested) {
  const auto [p, params] = validate_selection(in, requested, nullptr);
  // sparse_prefill_impl's checks, in its order, with the output the call allocates (q's shape, contiguous: the
  // alignment checks then read q, k and v only)
  AttentionOutputs outs;
  outs.out = make_view(nullptr, p.out_dtype, {in.q.shape[0], in.q.shape[1], in.q.shape[2]}, p.device,
                       in.q.device_id);
  const Backend& be = backend_for(p.device);
  try {
    be.check_sparse(in, p, params.block_size);
    be.check_attention(in, outs, p);
    be.check_index(in, p, params);
  } catch (const NotImplementedError& e) {
    return e.what();
  }
  return {};
}

void sparse_prefill(const AttentionInputs& in, const SelectionParams& params, const AttentionOutputs& outs,
                    const MeanCache& cache) {
  sparse_prefill_impl(in, params, outs, &cache);
}

BlockIndex union_index(const AttentionInputs& in, const BlockIndex& index) {
  const Problem p = validate_host(in, nullptr, "union_index");
  BlockIndex copy = index;
  const BlockIndexView view = view_of(copy);
  check_binding(view.binding, in, p, /*reuse_index=*/true);  // the union depends on the problem's geometry only
  validate_index(p, view);
  BlockIndex u = reference::union_index(in, p, index, index.binding.dense_fraction);
  u.binding = index.binding;
  u.binding.union_lists = true;
  return u;
}

BlockIndexView view_of(BlockIndex& index) {
  BlockIndexView v;
  v.binding = index.binding;
  v.block_size = index.block_size;
  v.correction = index.correction;
  v.num_subgroups = index.num_subgroups;
  v.segment_start = make_view(index.segment_start.data(), DType::kInt32, {int64_t(index.segment_start.size())});
  v.segment_end = make_view(index.segment_end.data(), DType::kInt32, {int64_t(index.segment_end.size())});
  v.block_ids = make_view(index.block_ids.data(), DType::kInt32, {int64_t(index.block_ids.size())});
  v.cu_blocks = make_view(index.cu_blocks.data(), DType::kInt32, {int64_t(index.cu_blocks.size())});
  // Pooled-mean views take their extent from the vectors themselves, so a mismatched index fails validation
  // instead of being read out of bounds. num_kv_heads is the index's (virtual, Hkv * num_subgroups) head count.
  const int64_t row = int64_t(index.num_kv_heads) * index.head_dim;
  auto pooled_view = [&](std::vector<float>& m, const char* name) {
    if (row <= 0 || int64_t(m.size()) % row != 0) {
      throw ArgumentError(name, "holds " + std::to_string(m.size()) + " floats, not a multiple of Hkv * D = " +
                                    std::to_string(row));
    }
    return make_view(m.data(), DType::kFloat32, {int64_t(m.size()) / row, index.num_kv_heads, index.head_dim});
  };
  v.k_mean = pooled_view(index.k_mean, "index.k_mean");
  // V means exist when there are as many as K means; otherwise (built without the correction) an absent view, which
  // validate_index accepts only without the correction (write_mean_cache asks the same question).
  if (index.v_mean.size() == index.k_mean.size()) v.v_mean = pooled_view(index.v_mean, "index.v_mean");
  return v;
}

}  // namespace sparse_prefill
