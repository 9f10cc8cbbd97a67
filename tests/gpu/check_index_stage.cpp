// GPU index stage vs the CPU reference, then index-stage timings on the topic workload.
//   check_index_stage [results.json]
// Correctness: for varlen / paged / GQA / odd-length cases, every segment's kept list on the GPU must equal the CPU
// reference's, except blocks whose reference energy lies within kTieBand of the threshold alpha * max E (bf16
// pooled keys and fp32 accumulation on the GPU vs double on the CPU); their count is printed. Pooled means are
// compared too. Exit code 1 on any failure.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "api/validate.h"
#include "core/dtype_convert.h"
#include "cuda/index_stage.h"
#include "sparse_prefill/sparse.h"
#include "sparse_prefill/workload.h"

namespace sp = sparse_prefill;

namespace {

constexpr double kTieBand = 0.10;  // relative band around the threshold in which GPU and CPU may disagree

#define CHECK_CUDA(x)                                                                            \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(1, h.size() * sizeof(T))));
  if (!h.empty()) CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

struct Case {
  std::string name;
  std::vector<int> q_lens, k_lens;
  int hq, hkv, d;
  int page_size;  // 0 = contiguous
  float q_scale;  // sharpens the scores so that selection drops blocks
};

// Random bf16 data whose keys cluster per 128-token block (topics), so selection is non-trivial.
void fill(std::vector<uint16_t>& x, std::mt19937& rng, float scale) {
  std::normal_distribution<float> n;
  for (auto& e : x) e = sp::float_to_bf16(scale * n(rng));
}

bool run_case(const Case& c, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  const int B = int(c.q_lens.size()), D = c.d;
  std::vector<int32_t> cu_q(B + 1, 0), cu_k(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    cu_q[b + 1] = cu_q[b] + c.q_lens[b];
    cu_k[b + 1] = cu_k[b] + c.k_lens[b];
  }
  const int64_t total_q = cu_q[B], total_k = cu_k[B];
  std::vector<uint16_t> q(total_q * c.hq * D), k(total_k * c.hkv * D), v(total_k * c.hkv * D);
  fill(q, rng, c.q_scale);
  fill(v, rng, 1.f);
  // keys: per-block topic + noise
  {
    std::normal_distribution<float> n;
    std::vector<float> topic(D);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < c.hkv; ++h)
        for (int64_t j = 0; j < c.k_lens[b]; ++j) {
          if (j % 128 == 0)
            for (auto& t : topic) t = n(rng);
          for (int d = 0; d < D; ++d)
            k[((cu_k[b] + j) * c.hkv + h) * D + d] = sp::float_to_bf16(topic[d] + n(rng));
        }
  }
  // Host inputs (contiguous or paged with a shuffled page order) for the CPU reference, mirrored on the device.
  sp::AttentionInputs host;
  std::vector<uint16_t> kc, vc;
  std::vector<int32_t> block_table, seqused;
  int64_t max_pages = 0, num_pages = 0;
  if (c.page_size > 0) {
    for (int b = 0; b < B; ++b) max_pages = std::max<int64_t>(max_pages, (c.k_lens[b] + c.page_size - 1) / c.page_size);
    num_pages = max_pages * B + 3;
    std::vector<int32_t> perm(num_pages);
    for (int i = 0; i < num_pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    block_table.assign(B * max_pages, 0);
    kc.assign(num_pages * c.page_size * c.hkv * D, sp::float_to_bf16(NAN));
    vc = kc;
    int next = 0;
    for (int b = 0; b < B; ++b) {
      seqused.push_back(c.k_lens[b]);
      for (int64_t pg = 0; pg < (c.k_lens[b] + c.page_size - 1) / c.page_size; ++pg) {
        const int page = perm[next++];
        block_table[b * max_pages + pg] = page;
        for (int s = 0; s < c.page_size && pg * c.page_size + s < c.k_lens[b]; ++s) {
          const int64_t src = (cu_k[b] + pg * c.page_size + s) * c.hkv * D;
          const int64_t dst = (int64_t(page) * c.page_size + s) * c.hkv * D;
          std::memcpy(&kc[dst], &k[src], c.hkv * D * 2);
          std::memcpy(&vc[dst], &v[src], c.hkv * D * 2);
        }
      }
    }
  }
  auto make_inputs = [&](sp::Device dev, void* dq, void* dk, void* dv, void* dcuq, void* dcuk, void* dbt, void* dsu) {
    sp::AttentionInputs in;
    in.q = sp::make_view(dq, sp::DType::kBFloat16, {total_q, c.hq, D}, dev);
    if (c.page_size > 0) {
      in.k = sp::make_view(dk, sp::DType::kBFloat16, {num_pages, c.page_size, c.hkv, D}, dev);
      in.v = sp::make_view(dv, sp::DType::kBFloat16, {num_pages, c.page_size, c.hkv, D}, dev);
      in.block_table = sp::make_view(dbt, sp::DType::kInt32, {B, max_pages}, dev);
      in.seqused_k = sp::make_view(dsu, sp::DType::kInt32, {B}, dev);
    } else {
      in.k = sp::make_view(dk, sp::DType::kBFloat16, {total_k, c.hkv, D}, dev);
      in.v = sp::make_view(dv, sp::DType::kBFloat16, {total_k, c.hkv, D}, dev);
      in.cu_seqlens_k = sp::make_view(dcuk, sp::DType::kInt32, {B + 1}, dev);
    }
    in.cu_seqlens_q = sp::make_view(dcuq, sp::DType::kInt32, {B + 1}, dev);
    in.max_seqlen_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
    in.max_seqlen_k = *std::max_element(c.k_lens.begin(), c.k_lens.end());
    return in;
  };
  const bool paged = c.page_size > 0;
  host = make_inputs(sp::Device::kCPU, q.data(), paged ? kc.data() : k.data(), paged ? vc.data() : v.data(),
                     cu_q.data(), cu_k.data(), block_table.data(), seqused.data());
  sp::SelectionParams params;  // defaults: alpha 0.1, block 128, sink 256, window 512, last_n 2
  const sp::BlockIndex ref = sp::build_index(host, params);

  uint16_t* dq = to_device(q);
  uint16_t* dk = to_device(paged ? kc : k);
  uint16_t* dv = to_device(paged ? vc : v);
  int32_t* dcuq = to_device(cu_q);
  int32_t* dcuk = to_device(cu_k);
  int32_t* dbt = to_device(block_table);
  int32_t* dsu = to_device(seqused);
  const sp::AttentionInputs dev = make_inputs(sp::Device::kCUDA, dq, dk, dv, dcuq, dcuk, dbt, dsu);
  const sp::Problem p = sp::validate_inputs(dev, nullptr);
  const size_t bytes = sp::cuda::index_workspace_bytes(dev, p, params);
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, bytes));
  CHECK_CUDA(cudaMemset(ws, 0xff, bytes));  // poison: every value read back must have been written
  const sp::cuda::DeviceIndex gi = sp::cuda::build_index(dev, p, params, ws, bytes);
  CHECK_CUDA(cudaDeviceSynchronize());

  const size_t S = ref.segment_start.size();
  const auto g_start = to_host(gi.segment_start, S), g_end = to_host(gi.segment_end, S);
  const auto g_ids = to_host(gi.block_ids, size_t(gi.capacity));
  const auto g_counters = to_host(gi.counters, 2);
  const auto g_cu_blocks = to_host(gi.cu_blocks, B + 1);
  const auto g_kmean = to_host(gi.k_mean, ref.k_mean.size());
  bool ok = g_cu_blocks == ref.cu_blocks;
  double pool_err = 0;
  for (size_t i = 0; i < ref.k_mean.size(); ++i) pool_err = std::max(pool_err, double(std::fabs(g_kmean[i] - ref.k_mean[i])));
  if (pool_err > 1e-4) ok = false;

  // Compare kept sets segment by segment; recompute reference energies for disagreements to classify ties.
  int64_t mismatches = 0, ties = 0;
  std::vector<int64_t> seg_offset(B + 1, 0);
  for (int b = 0; b < B; ++b) seg_offset[b + 1] = seg_offset[b] + int64_t(c.hkv) * sp::num_tiles(c.q_lens[b], c.hq / c.hkv);
  const int g = c.hq / c.hkv;
  for (int b = 0; b < B; ++b) {
    const int64_t tiles = sp::num_tiles(c.q_lens[b], g), nb = sp::num_blocks(c.k_lens[b], params.block_size);
    for (int kvh = 0; kvh < c.hkv; ++kvh)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t s = seg_offset[b] + kvh * tiles + t;
        std::vector<char> in_ref(nb, 0), in_gpu(nb, 0);
        for (int32_t n = ref.segment_start[s]; n < ref.segment_end[s]; ++n) in_ref[ref.block_ids[n]] = 1;
        if (g_start[s] < 0 || g_end[s] < g_start[s] || g_end[s] > gi.capacity) { ok = false; continue; }
        for (int32_t n = g_start[s]; n < g_end[s]; ++n) {
          if (g_ids[n] < 0 || g_ids[n] >= nb || in_gpu[g_ids[n]]) { ok = false; break; }
          in_gpu[g_ids[n]] = 1;
        }
        if (in_ref == in_gpu) continue;
        // Reference energies of this tile (double, from the reference's float pooled keys).
        const int64_t off = c.k_lens[b] - c.q_lens[b];
        const int64_t row0 = t * 128, row1 = std::min<int64_t>(row0 + 128, int64_t(c.q_lens[b]) * g);
        std::vector<std::vector<double>> sc(row1 - row0, std::vector<double>(nb, -INFINITY));
        double m = -INFINITY;
        for (int64_t r = row0; r < row1; ++r) {
          const int64_t pos = r / g, hi = std::min<int64_t>(c.k_lens[b] - 1, pos + off);
          const int h = kvh * g + int(r % g);
          for (int64_t J = 0; hi >= 0 && J <= hi / params.block_size; ++J) {
            double dot = 0;
            for (int d = 0; d < D; ++d)
              dot += double(sp::bf16_to_float(q[((cu_q[b] + pos) * c.hq + h) * D + d])) *
                     ref.k_mean[((ref.cu_blocks[b] + J) * c.hkv + kvh) * D + d];
            sc[r - row0][J] = dot / std::sqrt(double(D));
            m = std::max(m, sc[r - row0][J]);
          }
        }
        std::vector<double> e(nb, 0.0);
        double emax = 0;
        for (int64_t J = 0; J < nb; ++J) {
          for (auto& row : sc) if (row[J] != -INFINITY) e[J] += std::exp(row[J] - m);
          emax = std::max(emax, e[J]);
        }
        for (int64_t J = 0; J < nb; ++J) {
          if (in_ref[J] == in_gpu[J]) continue;
          const double ratio = e[J] / (params.alpha * emax);
          if (std::fabs(ratio - 1.0) <= kTieBand) ++ties; else { ++mismatches; ok = false; }
        }
      }
  }
  std::printf("%-34s %s  segments %zu  density ref %.4f gpu %.4f  ties %lld  mismatches %lld  pool max err %.2e\n",
              c.name.c_str(), ok ? "PASS" : "FAIL", S, ref.density(),
              g_counters[1] ? double(g_counters[0]) / double(g_counters[1]) : 1.0, (long long)ties,
              (long long)mismatches, pool_err);
  for (void* ptr : {(void*)dq, (void*)dk, (void*)dv, (void*)dcuq, (void*)dcuk, (void*)dbt, (void*)dsu, ws}) cudaFree(ptr);
  return ok;
}

// Index-stage time on the topic workload (Hq=32, Hkv=8, D=128, bf16, batch 1), median of 20 runs.
void bench(const char* json_path, const std::vector<int64_t>& lengths, const std::string& command) {
  FILE* f = json_path ? std::fopen(json_path, "w") : nullptr;
  if (f) {
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    const char* commit = std::getenv("SP_COMMIT");
    std::fprintf(f,
                 "{\"device\": \"%s\", \"commit\": \"%s\", \"date\": \"%s\", \"command\": \"%s\",\n"
                 " \"workload\": \"topic, Hq=32 Hkv=8 D=128 bf16 batch 1, alpha 0.1 block 128 sink 256 window 512 "
                 "last_n 2\",\n \"rows\": [\n",
                 prop.name, commit ? commit : "unknown", date, command.c_str());
  }
  bool first = true;
  for (int64_t L : lengths) {
    sp::workload::Shape shape{L, 32, 8, 128};
    std::vector<float> qf(L * 32 * 128), kf(L * 8 * 128), vf(L * 8 * 128);
    sp::workload::generate_topic(shape, sp::workload::TopicParams{}, 1, qf.data(), kf.data(), vf.data());
    auto bf = [](const std::vector<float>& x) {
      std::vector<uint16_t> y(x.size());
      for (size_t i = 0; i < x.size(); ++i) y[i] = sp::float_to_bf16(x[i]);
      return y;
    };
    uint16_t* dq = to_device(bf(qf));
    uint16_t* dk = to_device(bf(kf));
    uint16_t* dv = to_device(bf(vf));
    std::vector<int32_t> cu = {0, int32_t(L)};
    int32_t* dcu = to_device(cu);
    sp::AttentionInputs in;
    in.q = sp::make_view(dq, sp::DType::kBFloat16, {L, 32, 128}, sp::Device::kCUDA);
    in.k = sp::make_view(dk, sp::DType::kBFloat16, {L, 8, 128}, sp::Device::kCUDA);
    in.v = sp::make_view(dv, sp::DType::kBFloat16, {L, 8, 128}, sp::Device::kCUDA);
    in.cu_seqlens_q = sp::make_view(dcu, sp::DType::kInt32, {2}, sp::Device::kCUDA);
    in.cu_seqlens_k = in.cu_seqlens_q;
    in.max_seqlen_q = in.max_seqlen_k = L;
    const sp::Problem p = sp::validate_inputs(in, nullptr);
    sp::SelectionParams params;
    const size_t bytes = sp::cuda::index_workspace_bytes(in, p, params);
    void* ws = nullptr;
    CHECK_CUDA(cudaMalloc(&ws, bytes));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> times;
    sp::cuda::DeviceIndex gi;
    for (int it = 0; it < 23; ++it) {
      cudaEventRecord(e0);
      gi = sp::cuda::build_index(in, p, params, ws, bytes);
      cudaEventRecord(e1);
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      if (it >= 3) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    const auto counters = to_host(gi.counters, 2);
    const double density = double(counters[0]) / double(counters[1]);
    std::printf("index stage  L=%7lld  density %6.2f %%  index %.3f ms  (workspace %.1f MB)\n", (long long)L,
                100 * density, times[times.size() / 2], bytes / 1e6);
    if (f) {
      std::fprintf(f, "%s  {\"L\": %lld, \"density\": %.5f, \"index_ms\": %.4f, \"workspace_mb\": %.1f}", first ? "" : ",\n",
                   (long long)L, density, times[times.size() / 2], bytes / 1e6);
      first = false;
    }
    for (void* ptr : {(void*)dq, (void*)dk, (void*)dv, (void*)dcu, ws}) cudaFree(ptr);
  }
  if (f) {
    std::fprintf(f, "\n]}\n");
    std::fclose(f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 0;
  }
  // --only L: timing at one length, no checks (for ncu).
  if (argc > 2 && std::string(argv[1]) == "--only") {
    bench(nullptr, {std::atoll(argv[2])}, "");
    return 0;
  }
  const uint64_t seed = std::random_device{}();
  std::printf("seed %llu\n", (unsigned long long)seed);
  const std::vector<Case> cases = {
      {"single L=1 g=4", {1}, {1}, 8, 2, 128, 0, 4.f},
      {"single L=11 g=1", {11}, {11}, 2, 2, 128, 0, 4.f},
      {"single L=1763 g=4", {1763}, {1763}, 8, 2, 128, 0, 3.f},
      {"single L=4096 g=8 d64", {4096}, {4096}, 8, 1, 64, 0, 3.f},
      {"varlen mixed g=4", {129, 1, 700, 2048}, {129, 1, 700, 2048}, 8, 2, 128, 0, 3.f},
      {"chunk Lq<Lk g=4", {300, 1024}, {3000, 5000}, 8, 2, 128, 0, 3.f},
      {"paged page=16 g=4", {1000, 513}, {1000, 2100}, 8, 2, 128, 16, 3.f},
      {"paged page=64 g=8", {1763}, {1763}, 8, 1, 128, 64, 3.f},
      {"paged page=1 g=1", {127}, {400}, 2, 2, 64, 1, 3.f},
  };
  bool ok = true;
  for (size_t i = 0; i < cases.size(); ++i) ok = run_case(cases[i], seed + i) && ok;
  std::printf("index stage checks: %s\n", ok ? "PASS" : "FAIL");
  if (argc > 1 && std::string(argv[1]) == "--checks-only") return ok ? 0 : 1;
  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  bench(argc > 1 ? argv[1] : nullptr, {4096, 8192, 16384, 32768, 65536, 131072}, command);
  return ok ? 0 : 1;
}
