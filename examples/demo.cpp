// SparsePrefill demo: one sequence of the structured workload; dense attention vs block-sparse prefill (the default
// selection, SelectionParams{}, + sparse attention with and without the mean correction). Prints sequence length,
// selected density, relative error against dense attention (with and without correction) and times.
//
//   sparse_prefill_demo [--seqlen L] [--gpu-seqlen L] [--alpha A] [--seed S] [--cpu] [--help]
// With a GPU and the CUDA backend it first runs the GPU path (default L = 32768, Llama-3.1-8B heads: Hq=32, Hkv=8):
// dense attention on the GPU (checked against the CPU reference on the last 64 queries), the GPU index stage
// (density, time) and the sparse kernel with and without correction (time, error against the GPU dense output).
// Then the CPU reference backend on a small input (default L = 4096, Hq=4, Hkv=1), the only path without a GPU.
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

void run_cpu(const sp::workload::Shape& shape, const sp::SelectionParams& sel, uint64_t seed) {
  const int64_t L = shape.seqlen, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim;
  progress("generating the structured workload (L=" + std::to_string(L) + ") for the CPU reference backend");
  std::vector<float> q(L * Hq * D), k(L * Hkv * D), v(L * Hkv * D);
  sp::workload::generate_structured(shape, sp::workload::StructuredParams{}, seed, q.data(), k.data(), v.data());

  std::vector<int32_t> cu = {0, int32_t(L)};
  sp::AttentionInputs in;
  in.q = sp::make_view(q.data(), sp::DType::kFloat32, {L, Hq, D});
  in.k = sp::make_view(k.data(), sp::DType::kFloat32, {L, Hkv, D});
  in.v = sp::make_view(v.data(), sp::DType::kFloat32, {L, Hkv, D});
  in.cu_seqlens_q = sp::make_view(cu.data(), sp::DType::kInt32, {2});
  in.cu_seqlens_k = in.cu_seqlens_q;
  in.max_seqlen_q = in.max_seqlen_k = L;
  in.causal = true;

  std::printf("SparsePrefill demo, CPU reference backend: structured workload, L=%lld, Hq=%lld, Hkv=%lld, D=%lld\n",
              (long long)L, (long long)Hq, (long long)Hkv, (long long)D);
  std::vector<float> dense(q.size()), sparse(q.size()), sparse_nc(q.size());
  progress("dense attention (exact, double accumulation)...");
  auto t0 = std::chrono::steady_clock::now();
  sp::attention(in, {sp::make_view(dense.data(), sp::DType::kFloat32, {L, Hq, D}), std::nullopt});
  const double t_dense = seconds_since(t0);

  progress("index stage (block selection)...");
  t0 = std::chrono::steady_clock::now();
  sp::SelectionParams with_means = sel;
  with_means.correction = true;  // V means for the run with the correction (the selection does not depend on it)
  sp::BlockIndex index = sp::build_index(in, with_means);
  const double t_index = seconds_since(t0);
  progress("sparse attention over the selected blocks, with and without the mean correction...");
  index.correction = true;  // the default selection is off; the same index serves both runs
  t0 = std::chrono::steady_clock::now();
  sp::sparse_attention(in, sp::view_of(index), {sp::make_view(sparse.data(), sp::DType::kFloat32, {L, Hq, D}), {}});
  const double t_sparse = seconds_since(t0);
  index.correction = false;
  sp::sparse_attention(in, sp::view_of(index), {sp::make_view(sparse_nc.data(), sp::DType::kFloat32, {L, Hq, D}), {}});

  std::printf("  seqlen              %lld\n", (long long)L);
  std::printf("  selected density    %.1f %% (alpha=%.3g, block=%d, sink=%d, window=%d, last_n=%d)\n",
              100.0 * index.density(), sel.alpha, sel.block_size, sel.sink, sel.window, sel.last_n);
  std::printf("  rel. error vs dense %.3e with mean correction, %.3e without\n", rel_err(sparse, dense),
              rel_err(sparse_nc, dense));
  std::printf("  time (CPU, exact)   dense %.2f s, index %.2f s, sparse attention %.2f s\n", t_dense, t_index,
              t_sparse);
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

// Dense attention and the index stage on the GPU, bf16, one sequence of the structured workload.
void run_gpu(const sp::workload::Shape& shape, const sp::SelectionParams& sel, uint64_t seed) {
  const int64_t L = shape.seqlen, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim;
  std::vector<float> q(L * Hq * D), k(L * Hkv * D), v(L * Hkv * D);
  sp::workload::generate_structured(shape, sp::workload::StructuredParams{}, seed, q.data(), k.data(), v.data());
  auto to_bf16 = [](const std::vector<float>& x) {
    std::vector<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(x[i]);
    return y;
  };
  progress("generating the structured workload (L=" + std::to_string(L) + ") and copying it to the GPU");
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

  std::printf("SparsePrefill demo, GPU path: structured workload, L=%lld, Hq=%lld, Hkv=%lld, D=%lld, bf16\n",
              (long long)L, (long long)Hq, (long long)Hkv, (long long)D);
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
  // The GPU index stage.
  // The GPU index stage into a workspace of our own (the engine path: no allocation, no synchronisation).
  const int64_t bytes = sp::index_workspace_bytes(in, sel);
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, size_t(bytes)));
  const sp::TensorView workspace = sp::make_view(ws, sp::DType::kInt32, {(bytes + 3) / 4}, gpu);
  sp::DeviceBlockIndex index;
  const float index_ms = median_ms([&] { index = sp::build_index(in, sel, workspace); }, 5);
  const auto [kept, visible] = sp::index_counts(index, nullptr);

  std::printf("  seqlen              %lld\n", (long long)L);
  std::printf("  dense attention     %.3f ms (%.0f TFLOP/s); rel. error vs CPU reference (last %lld queries) %.2e\n",
              dense_ms, tflops, (long long)tail, std::sqrt(num / den));
  std::printf("  index stage         %.3f ms (%.2f %% of dense); selected density %.2f %%\n", index_ms,
              100.0 * index_ms / dense_ms, 100.0 * double(kept) / double(visible));

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
  sp::SelectionParams with_means = sel;
  with_means.correction = true;
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

constexpr const char* kUsage =
    "usage: sparse_prefill_demo [--seqlen L] [--gpu-seqlen L] [--alpha A] [--seed S] [--cpu] [--help]\n"
    "\n"
    "Dense attention against block-sparse prefill (the default selection + sparse attention, with and without\n"
    "the mean correction) on one sequence of the structured workload: density, relative error, times.\n"
    "\n"
    "  --seqlen L      sequence length of the CPU reference run (default 4096; Hq=4, Hkv=1, D=128, float32)\n"
    "  --gpu-seqlen L  sequence length of the GPU run (default 32768; Hq=32, Hkv=8, D=128, bf16)\n"
    "  --alpha A       selection threshold in [0, 1] (default 0.1; 0 keeps every visible block)\n"
    "  --seed S        workload seed (default 1)\n"
    "  --cpu           skip the GPU run even where there is a GPU\n"
    "  --help, -h      print this help and exit\n"
    "Values may also be given as --option=value.\n";

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
  sp::workload::Shape gpu_shape{32768, 32, 8, 128};
  sp::workload::Shape cpu_shape{4096, 4, 1, 128};
  sp::SelectionParams sel;
  uint64_t seed = 1;
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
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--cpu") {
      if (has_value) return usage_error("--cpu takes no value, got '" + value + "'");
      force_cpu = true;
      continue;
    }
    if (a != "--seqlen" && a != "--gpu-seqlen" && a != "--alpha" && a != "--seed")
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
    } else if (a == "--alpha") {
      if (!parse_float(value, 0.0, 1.0, &x))
        return usage_error("--alpha: expected a number in [0, 1], got '" + value + "'");
      sel.alpha = float(x);
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
    run_cpu(cpu_shape, sel, seed);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
