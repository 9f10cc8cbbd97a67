// SparsePrefill demo: dense attention against block-sparse prefill (the library's default selection,
// SelectionParams{}, then sparse attention with and without the mean correction) on one sequence. Prints what the
// selection kept and why (density, whether the dense rule fired and its threshold), the relative error against dense
// attention and times.
//
//   sparse_prefill_demo [--seqlen L] [--workload W] [--gpu-seqlen L] [--alpha A] [--dense-fraction F] [--seed S]
//                       [--cpu] [--help]
// With a GPU and the CUDA backend it first runs the GPU path (default L = 32768, topic workload, Llama-3.1-8B
// heads: Hq=32, Hkv=8): dense attention on the GPU (checked against the CPU reference on the last 64 queries), the
// GPU index stage (density, the dense rule, time) and the sparse kernel with and without correction (time, error
// against the GPU dense output). Then the CPU reference backend on a small input (kCpuSeqlen etc. below: the topic
// workload at 8K tokens, where the default selection keeps a minority of the blocks), the only path without a GPU.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "sparse_prefill/attention.h"
#include "sparse_prefill/sparse.h"
#include "sparse_prefill/workload.h"

#ifdef SPARSE_PREFILL_WITH_CUDA
#include <cuda_runtime.h>
#endif

// SP_CUDA_REASON: why the library was built with or without the CUDA backend, in words (CMakeLists.txt writes it,
// e.g. "no nvcc found", "SPARSE_PREFILL_CUDA=OFF", or scripts/demo.sh's "no GPU found ...").
#if __has_include("sp_build_info.h")
#include "sp_build_info.h"
#else
#define SP_CUDA_REASON "not recorded: built outside CMakeLists.txt"
#endif

namespace sp = sparse_prefill;

namespace {

// bfloat16 <-> float (round to nearest even; the demo's inputs are finite).
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Progress on stdout, flushed at once: the exact CPU reference takes seconds to minutes on long inputs.
void progress(const std::string& what) {
  std::printf("[demo] %s\n", what.c_str());
  std::fflush(stdout);
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

// The demo's inputs. Lengths and head counts are the demo's own choice; every selection parameter is the library's
// (SelectionParams{}), changed only by the options given.
enum class Workload { kTopic, kStructured };
const char* workload_name(Workload w) { return w == Workload::kTopic ? "topic" : "structured"; }
// The CPU run: the topic workload (the speed reference of docs/workload.md, whose density falls with length) at 8K
// tokens, where the default selection keeps a minority of the blocks (ctest Demo.DefaultRunPrunes checks it). One KV
// head with Llama-3's group of 4 query heads keeps the exact, double-accumulating reference at ~10 s on 2 cores.
constexpr int64_t kCpuSeqlen = 8192;
constexpr int kCpuQHeads = 4, kCpuKvHeads = 1;
constexpr Workload kCpuWorkload = Workload::kTopic;
// The GPU run: the topic workload at Llama-3.1-8B's attention heads and 32K tokens, where the default selection
// keeps ~13 % of the blocks (bench/results/selection_h200.json) and the call runs ~5x faster than dense; the
// structured workload keeps ~82 % there, just under the dense rule's 0.85, and shows little.
constexpr Workload kGpuWorkload = Workload::kTopic;
constexpr int64_t kGpuSeqlen = 32768;
constexpr int kGpuQHeads = 32, kGpuKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr uint64_t kSeed = 1;

void generate(Workload w, const sp::workload::Shape& shape, uint64_t seed, float* q, float* k, float* v) {
  if (w == Workload::kTopic) {
    sp::workload::generate_topic(shape, sp::workload::TopicParams{}, seed, q, k, v);
  } else {
    sp::workload::generate_structured(shape, sp::workload::StructuredParams{}, seed, q, k, v);
  }
}

// A float parameter as the help and the report print it (%g: 0.003, 0.85), so a test can format the library's values
// alike; integers print with std::to_string.
std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// The rule's name as the Python API spells it (sp.build_index(rule=...)).
const char* rule_name(sp::SelectionRule rule) {
  switch (rule) {
    case sp::SelectionRule::kTileEnergy: return "tile_energy";
    case sp::SelectionRule::kRowMax: return "row_max";
    case sp::SelectionRule::kProbeRowMax: return "probe_row_max";
    case sp::SelectionRule::kProbeRowMass: return "probe_row_mass";
  }
  return "?";
}

// Every selection parameter the demo's runs depend on, "name value" each (the help prints SelectionParams{} this way).
std::string selection_text(const sp::SelectionParams& s) {
  std::string t = std::string("rule ") + rule_name(s.rule) + ", alpha " + num(s.alpha);
  if (sp::is_probe_rule(s.rule)) t += ", mean_alpha " + num(s.mean_alpha);
  t += ", block " + std::to_string(s.block_size) + ", sink " + std::to_string(s.sink) + ", window " +
       std::to_string(s.window) + ", last_n " + std::to_string(s.last_n) + ", head_subgroups " +
       std::to_string(s.head_subgroups) + (s.head_subgroups == 0 ? " (one selection per query head)" : "") +
       ", correction " + (s.correction ? "on" : "off") + ", dense_fraction " + num(s.dense_fraction);
  return t;
}

// A comma-separated list broken after its commas into lines of at most `width` characters (so "name value" pairs stay
// on one line), every line after the first indented by `indent` (the caller prints the first line's prefix).
std::string wrap(const std::string& text, size_t indent, size_t width = 118) {
  std::string out, line;
  for (size_t pos = 0; pos < text.size();) {
    size_t next = text.find(", ", pos);
    next = next == std::string::npos ? text.size() : next + 1;  // the item with its comma
    const std::string item = text.substr(pos, next - pos);
    if (!line.empty() && indent + line.size() + 1 + item.size() > width) {
      out += line + "\n" + std::string(indent, ' ');
      line.clear();
    }
    line += (line.empty() ? "" : " ") + item;
    pos = next + 1;  // past the space after the comma
  }
  return out + line;
}

std::string percent(int64_t part, int64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %%", whole ? 100.0 * double(part) / double(whole) : 100.0);
  return buf;
}

// What the selection kept and why. selected / visible: the selection as selected (built with dense_fraction 1, the
// rule off); ran: the blocks the library's index (built with `sel`) holds, what sparse attention ran over. The dense
// rule's decision is the library's own test (keeps_all), so this report cannot disagree with the index.
void report_selection(const sp::SelectionParams& sel, int64_t selected, int64_t visible, int64_t ran) {
  const sp::SelectionParams defaults{};
  const bool is_default = selection_text(sel) == selection_text(defaults);
  const std::string which =
      is_default ? "the library's default (SelectionParams{}): " : "SelectionParams{} with the options given: ";
  std::printf("  selection           %s\n", wrap(which + selection_text(sel), 22).c_str());
  std::printf("  selected density    %s of the visible key blocks (%lld of %lld, over tiles and KV heads)\n",
              percent(selected, visible).c_str(), (long long)selected, (long long)visible);
  const std::string threshold = "dense_fraction " + num(sel.dense_fraction);
  if (sp::keeps_all(selected, visible, sel.dense_fraction)) {
    std::printf("  dense rule          fired: %s >= %s, so the index keeps every visible block (%s):\n"
                "                      the sparse path computes exact dense attention here, nothing is pruned.\n"
                "                      Longer prompts prune more (try a larger --seqlen); --dense-fraction 1 runs the\n"
                "                      selection as selected\n",
                percent(selected, visible).c_str(), threshold.c_str(), percent(ran, visible).c_str());
  } else if (sel.dense_fraction >= 1.f) {
    std::printf("  dense rule          off (dense_fraction 1): sparse attention ran over the %s selected\n",
                percent(ran, visible).c_str());
  } else {
    std::printf("  dense rule          did not fire: %s < %s, so sparse attention ran over the %s selected only\n",
                percent(selected, visible).c_str(), threshold.c_str(), percent(ran, visible).c_str());
  }
}

void run_cpu(Workload workload, const sp::workload::Shape& shape, const sp::SelectionParams& sel, uint64_t seed) {
  const int64_t L = shape.seqlen, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim;
  progress(std::string("generating the ") + workload_name(workload) + " workload (L=" + std::to_string(L) +
           ") for the CPU reference backend");
  std::vector<float> q(L * Hq * D), k(L * Hkv * D), v(L * Hkv * D);
  generate(workload, shape, seed, q.data(), k.data(), v.data());

  std::vector<int32_t> cu = {0, int32_t(L)};
  sp::AttentionInputs in;
  in.q = sp::make_view(q.data(), sp::DType::kFloat32, {L, Hq, D});
  in.k = sp::make_view(k.data(), sp::DType::kFloat32, {L, Hkv, D});
  in.v = sp::make_view(v.data(), sp::DType::kFloat32, {L, Hkv, D});
  in.cu_seqlens_q = sp::make_view(cu.data(), sp::DType::kInt32, {2});
  in.cu_seqlens_k = in.cu_seqlens_q;
  in.max_seqlen_q = in.max_seqlen_k = L;
  in.causal = true;

  std::printf("SparsePrefill demo, CPU reference backend (exact, double accumulation: it shows what the selection "
              "keeps, not the speed)\n");
  std::printf("  input               %s workload%s, L=%lld, Hq=%lld, Hkv=%lld, D=%lld, float32, seed %llu\n",
              workload_name(workload),
              workload == Workload::kTopic ? " (the speed reference, docs/workload.md)" : " (the accuracy workload)",
              (long long)L, (long long)Hq, (long long)Hkv, (long long)D, (unsigned long long)seed);
  std::vector<float> dense(q.size()), sparse(q.size()), sparse_nc(q.size());
  progress("dense attention (exact, double accumulation)...");
  auto t0 = std::chrono::steady_clock::now();
  sp::attention(in, {sp::make_view(dense.data(), sp::DType::kFloat32, {L, Hq, D}), std::nullopt});
  const double t_dense = seconds_since(t0);

  progress("index stage (block selection)...");
  // The selection as selected (the dense rule off), only to report what it kept before the rule decided.
  sp::SelectionParams as_selected = sel;
  as_selected.dense_fraction = 1.f;
  const sp::BlockIndex selected = sp::build_index(in, as_selected);
  sp::SelectionParams with_means = sel;
  with_means.correction = true;  // V means for the run with the correction (the selection does not depend on it)
  t0 = std::chrono::steady_clock::now();
  sp::BlockIndex index = sp::build_index(in, with_means);  // the index the library runs: `sel`, dense rule included
  const double t_index = seconds_since(t0);
  progress("sparse attention over the selected blocks, with and without the mean correction...");
  index.correction = false;
  t0 = std::chrono::steady_clock::now();
  sp::sparse_attention(in, sp::view_of(index), {sp::make_view(sparse_nc.data(), sp::DType::kFloat32, {L, Hq, D}), {}});
  const double t_sparse = seconds_since(t0);
  index.correction = true;  // the same index serves both runs
  sp::sparse_attention(in, sp::view_of(index), {sp::make_view(sparse.data(), sp::DType::kFloat32, {L, Hq, D}), {}});

  report_selection(sel, selected.kept_blocks, selected.visible_blocks, index.kept_blocks);
  const double err_on = rel_err(sparse, dense), err_off = rel_err(sparse_nc, dense);
  std::printf("  rel. error vs dense %.2e %s, %.2e %s\n", sel.correction ? err_on : err_off,
              sel.correction ? "with the mean correction (on in this selection)"
                             : "without the mean correction (off in this selection)",
              sel.correction ? err_off : err_on, sel.correction ? "without it" : "with it");
  std::printf("  time (CPU, exact)   dense attention %.2f s, index stage %.2f s, sparse attention %.2f s "
              "(%.2f of dense)\n",
              t_dense, t_index, t_sparse, t_sparse / t_dense);
}

#ifdef SPARSE_PREFILL_WITH_CUDA
#define CHECK_CUDA(x)                                                                                \
  do {                                                                                               \
    const cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "CUDA error: %s (%s:%d)\n", cudaGetErrorString(e_), __FILE__, __LINE__);  \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <typename Fn>
float median_ms(Fn&& fn, int reps) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  fn();  // warm-up
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    fn();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Dense attention and the index stage on the GPU, bf16, one sequence of kGpuWorkload.
void run_gpu(const sp::workload::Shape& shape, const sp::SelectionParams& sel, uint64_t seed) {
  const int64_t L = shape.seqlen, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim;
  progress(std::string("generating the ") + workload_name(kGpuWorkload) + " workload (L=" + std::to_string(L) +
           ") and copying it to the GPU");
  std::vector<float> q(L * Hq * D), k(L * Hkv * D), v(L * Hkv * D);
  generate(kGpuWorkload, shape, seed, q.data(), k.data(), v.data());
  auto to_bf16 = [](const std::vector<float>& x) {
    std::vector<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(x[i]);
    return y;
  };
  const std::vector<uint16_t> qh = to_bf16(q), kh = to_bf16(k), vh = to_bf16(v);
  std::vector<int32_t> cu = {0, int32_t(L)};
  void *dq, *dk, *dv, *dout, *dcu;
  CHECK_CUDA(cudaMalloc(&dq, qh.size() * 2));
  CHECK_CUDA(cudaMalloc(&dk, kh.size() * 2));
  CHECK_CUDA(cudaMalloc(&dv, vh.size() * 2));
  CHECK_CUDA(cudaMalloc(&dout, qh.size() * 2));
  CHECK_CUDA(cudaMalloc(&dcu, 8));
  CHECK_CUDA(cudaMemcpy(dq, qh.data(), qh.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, kh.data(), kh.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, vh.data(), vh.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dcu, cu.data(), 8, cudaMemcpyHostToDevice));
  const sp::Device gpu = sp::Device::kCUDA;
  sp::AttentionInputs in;
  in.q = sp::make_view(dq, sp::DType::kBFloat16, {L, Hq, D}, gpu);
  in.k = sp::make_view(dk, sp::DType::kBFloat16, {L, Hkv, D}, gpu);
  in.v = sp::make_view(dv, sp::DType::kBFloat16, {L, Hkv, D}, gpu);
  in.cu_seqlens_q = sp::make_view(dcu, sp::DType::kInt32, {2}, gpu);
  in.cu_seqlens_k = in.cu_seqlens_q;
  in.max_seqlen_q = in.max_seqlen_k = L;
  const sp::AttentionOutputs outs{sp::make_view(dout, sp::DType::kBFloat16, {L, Hq, D}, gpu), std::nullopt};

  std::printf("SparsePrefill demo, GPU path: %s workload, L=%lld, Hq=%lld, Hkv=%lld, D=%lld, bf16\n",
              workload_name(kGpuWorkload), (long long)L, (long long)Hq, (long long)Hkv, (long long)D);
  progress("GPU dense attention (median of 5)...");
  const float dense_ms = median_ms([&] { sp::attention(in, outs); }, 5);
  const double tflops = 4.0 * double(L) * double(L) * double(D) * double(Hq) / 2.0 / (dense_ms * 1e-3) / 1e12;

  // The dense GPU output of the last 64 queries against the CPU reference (a 64-query chunk over all L keys).
  const int64_t tail = std::min<int64_t>(64, L);
  std::vector<uint16_t> out(qh.size());
  CHECK_CUDA(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> ref(tail * Hq * D);
  std::vector<int32_t> cu_tail = {0, int32_t(tail)}, cu_k = {0, int32_t(L)};
  std::vector<uint16_t> q_tail(qh.end() - tail * Hq * D, qh.end());
  std::vector<float> out_tail_ref(tail * Hq * D);
  std::vector<uint16_t> out_tail(tail * Hq * D);
  sp::AttentionInputs cpu;
  cpu.q = sp::make_view(q_tail.data(), sp::DType::kBFloat16, {tail, Hq, D});
  cpu.k = sp::make_view(const_cast<uint16_t*>(kh.data()), sp::DType::kBFloat16, {L, Hkv, D});
  cpu.v = sp::make_view(const_cast<uint16_t*>(vh.data()), sp::DType::kBFloat16, {L, Hkv, D});
  cpu.cu_seqlens_q = sp::make_view(cu_tail.data(), sp::DType::kInt32, {2});
  cpu.cu_seqlens_k = sp::make_view(cu_k.data(), sp::DType::kInt32, {2});
  cpu.max_seqlen_q = tail;
  cpu.max_seqlen_k = L;
  sp::attention(cpu, {sp::make_view(out_tail.data(), sp::DType::kBFloat16, {tail, Hq, D}), std::nullopt});
  double num = 0, den = 0;
  for (int64_t i = 0; i < tail * Hq * D; ++i) {
    const double g = bf16_to_float(out[(L - tail) * Hq * D + i]), r = bf16_to_float(out_tail[i]);
    num += (g - r) * (g - r);
    den += r * r;
  }

  progress("GPU index stage (median of 5)...");
  // The GPU index stage into a workspace of our own (the engine path: no allocation, no synchronisation), large
  // enough for each selection built in it below: as selected (the dense rule off, for the report), `sel`, and `sel`
  // with the V means of the run with the correction.
  sp::SelectionParams as_selected = sel, with_means = sel;
  as_selected.dense_fraction = 1.f;
  with_means.correction = true;
  const int64_t bytes = std::max({sp::index_workspace_bytes(in, sel), sp::index_workspace_bytes(in, as_selected),
                                  sp::index_workspace_bytes(in, with_means)});
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, size_t(bytes)));
  const sp::TensorView workspace = sp::make_view(ws, sp::DType::kInt32, {(bytes + 3) / 4}, gpu);
  const auto [selected, visible] = sp::index_counts(sp::build_index(in, as_selected, workspace), nullptr);
  sp::DeviceBlockIndex index;
  const float index_ms = median_ms([&] { index = sp::build_index(in, sel, workspace); }, 5);
  const int64_t kept = sp::index_counts(index, nullptr).first;

  std::printf("  seqlen              %lld\n", (long long)L);
  std::printf("  dense attention     %.3f ms (%.0f TFLOP/s); rel. error vs CPU reference (last %lld queries) %.2e\n",
              dense_ms, tflops, (long long)tail, std::sqrt(num / den));
  report_selection(sel, selected, visible, kept);
  std::printf("  index stage         %.3f ms (%.2f %% of dense)\n", index_ms, 100.0 * index_ms / dense_ms);

  // The sparse kernel over that index (the engine path: no allocation, no synchronisation), with and without the
  // mean correction; error against the GPU dense output.
  void* dsparse = nullptr;
  CHECK_CUDA(cudaMalloc(&dsparse, qh.size() * 2));
  const sp::AttentionOutputs sparse_outs{sp::make_view(dsparse, sp::DType::kBFloat16, {L, Hq, D}, gpu),
                                         std::nullopt};
  std::vector<uint16_t> sparse_out(qh.size());
  auto rel_error_vs_dense = [&]() {
    CHECK_CUDA(cudaMemcpy(sparse_out.data(), dsparse, sparse_out.size() * 2, cudaMemcpyDeviceToHost));
    double n2 = 0, d2 = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double g = bf16_to_float(sparse_out[i]), r = bf16_to_float(out[i]);
      n2 += (g - r) * (g - r);
      d2 += r * r;
    }
    return std::sqrt(n2 / d2);
  };
  progress("GPU sparse attention, with and without the mean correction (median of 5 each)...");
  // The index above has no V means (sel: no correction, the default): the run with the correction takes one built
  // with it (the same selection) in the same workspace; the correction only decides whether the means are read.
  sp::DeviceBlockIndex with = sp::build_index(in, with_means, workspace), without = with;
  without.params.correction = false;
  const float corr_ms = median_ms([&] { sp::sparse_attention(in, with, sparse_outs); }, 5);
  const double corr_err = rel_error_vs_dense();
  const float plain_ms = median_ms([&] { sp::sparse_attention(in, without, sparse_outs); }, 5);
  const double plain_err = rel_error_vs_dense();
  std::printf("  sparse attention    %.3f ms with correction (rel. error vs dense %.2e), %.3f ms without (%.2e)\n",
              corr_ms, corr_err, plain_ms, plain_err);
  std::printf("  index + sparse      %.3f ms = %.1fx faster than our dense attention\n\n", index_ms + corr_ms,
              dense_ms / (index_ms + corr_ms));
  for (void* ptr : {dq, dk, dv, dout, dcu, ws, dsparse}) cudaFree(ptr);
}
#endif

// The help, its defaults read from the demo's constants and from SelectionParams{} (ctest Demo.HelpShowsDefaults
// compares them with the library's values).
std::string usage() {
  const sp::SelectionParams d{};
  auto heads = [](int hq, int hkv) {
    return "Hq=" + std::to_string(hq) + ", Hkv=" + std::to_string(hkv) + ", D=" + std::to_string(kHeadDim);
  };
  return "usage: sparse_prefill_demo [--seqlen L] [--workload W] [--gpu-seqlen L] [--alpha A] [--dense-fraction F]\n"
         "                           [--seed S] [--cpu] [--help]\n"
         "\n"
         "Dense attention against block-sparse prefill (the library's default selection, then sparse attention with\n"
         "and without the mean correction) on one sequence: what the selection kept and why (density, whether the\n"
         "dense rule fired), the relative error against dense attention, times. With a GPU and the CUDA backend the\n"
         "GPU run comes first; the CPU reference run always follows.\n"
         "\n"
         "  --seqlen L          sequence length of the CPU reference run (default " + std::to_string(kCpuSeqlen) +
         "; " + heads(kCpuQHeads, kCpuKvHeads) + ", float32)\n"
         "  --workload W        workload of the CPU run (default " + workload_name(kCpuWorkload) +
         "): topic (the speed reference) or structured\n"
         "                      (the accuracy workload: sinks, recall, needles; the selection keeps more of it)\n"
         "  --gpu-seqlen L      sequence length of the GPU run (default " + std::to_string(kGpuSeqlen) +
         "; " + workload_name(kGpuWorkload) + " workload, " + heads(kGpuQHeads, kGpuKvHeads) + ", bf16)\n"
         "  --alpha A           selection threshold of rule " + rule_name(d.rule) + ", in [0, 1] (default " +
         num(d.alpha) + "; 0 keeps every visible block)\n"
         "  --dense-fraction F  the dense rule: a selection keeping at least this fraction of the visible blocks\n"
         "                      keeps them all and runs as dense attention, in (0, 1] (default " +
         num(d.dense_fraction) + "; 1 turns it off)\n"
         "  --seed S            workload seed (default " + std::to_string(kSeed) + ")\n"
         "  --cpu               skip the GPU run even where there is a GPU\n"
         "  --help, -h          print this help and exit\n"
         "Values may also be given as --option=value.\n"
         "\n" +
         wrap("The selection is the library's default, SelectionParams{}, but for the options above: " +
                  selection_text(d) + ".",
              0) +
         "\n";
}

// A command-line error: names the argument, prints the usage hint, exit code 2.
int usage_error(const std::string& message) {
  std::fprintf(stderr, "sparse_prefill_demo: error: %s\n(run sparse_prefill_demo --help for the options)\n",
               message.c_str());
  return 2;
}

bool parse_int(const std::string& text, long long lo, long long hi, long long* value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *value = v;
  return true;
}

bool parse_float(const std::string& text, double lo, double hi, double* value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0' || !(v >= lo && v <= hi)) return false;
  *value = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  sp::workload::Shape gpu_shape{kGpuSeqlen, kGpuQHeads, kGpuKvHeads, kHeadDim};
  sp::workload::Shape cpu_shape{kCpuSeqlen, kCpuQHeads, kCpuKvHeads, kHeadDim};
  Workload cpu_workload = kCpuWorkload;
  sp::SelectionParams sel;  // the library's defaults; --alpha / --dense-fraction change one field each
  uint64_t seed = kSeed;
  bool force_cpu = false;
  constexpr long long kMaxSeqlen = 1ll << 20;  // the contract's range (4K to 1M tokens)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], value;
    bool has_value = false;
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    if (a == "--help" || a == "-h") {
      std::fputs(usage().c_str(), stdout);
      return 0;
    }
    if (a == "--cpu") {
      if (has_value) return usage_error("--cpu takes no value, got '" + value + "'");
      force_cpu = true;
      continue;
    }
    if (a != "--seqlen" && a != "--gpu-seqlen" && a != "--workload" && a != "--alpha" && a != "--dense-fraction" &&
        a != "--seed")
      return usage_error("unknown argument '" + a + "'");
    if (!has_value) {
      if (i + 1 >= argc) return usage_error(a + " needs a value");
      value = argv[++i];
    }
    long long n = 0;
    double x = 0;
    if (a == "--seqlen" || a == "--gpu-seqlen") {
      if (!parse_int(value, 1, kMaxSeqlen, &n))
        return usage_error(a + ": expected an integer in [1, " + std::to_string(kMaxSeqlen) + "], got '" + value +
                           "'");
      (a == "--seqlen" ? cpu_shape : gpu_shape).seqlen = n;
    } else if (a == "--workload") {
      if (value == workload_name(Workload::kTopic)) {
        cpu_workload = Workload::kTopic;
      } else if (value == workload_name(Workload::kStructured)) {
        cpu_workload = Workload::kStructured;
      } else {
        return usage_error("--workload: expected topic or structured, got '" + value + "'");
      }
    } else if (a == "--alpha") {
      if (!parse_float(value, 0.0, 1.0, &x))
        return usage_error("--alpha: expected a number in [0, 1], got '" + value + "'");
      sel.alpha = float(x);
    } else if (a == "--dense-fraction") {
      if (!parse_float(value, 0.0, 1.0, &x) || x == 0.0)
        return usage_error("--dense-fraction: expected a number in (0, 1], got '" + value + "'");
      sel.dense_fraction = float(x);
    } else {  // --seed
      if (!parse_int(value, 0, std::numeric_limits<long long>::max(), &n))
        return usage_error("--seed: expected a non-negative integer, got '" + value + "'");
      seed = uint64_t(n);
    }
  }
  try {
#ifdef SPARSE_PREFILL_WITH_CUDA
    progress(std::string("built with the CUDA backend (") + SP_CUDA_REASON + ")");
    if (force_cpu) {
      progress("--cpu: skipping the GPU run");
    } else if (have_gpu()) {
      progress("GPU found: running the GPU path first (L=" + std::to_string(gpu_shape.seqlen) + ")");
      run_gpu(gpu_shape, sel, seed);
    } else {
      progress("no GPU found at run time (cudaGetDeviceCount): running the CPU reference backend only");
    }
#else
    progress(std::string("built without the CUDA backend (") + SP_CUDA_REASON + "): CPU reference backend only");
#endif
    run_cpu(cpu_workload, cpu_shape, sel, seed);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
