// Bad arguments: every case must throw sparse_prefill::ArgumentError naming the argument (Python names), never crash.
#include "test_util.h"

namespace sptest {
namespace {

const DType F32 = DType::kFloat32;

class Errors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(1234);
    Case c;
    c.Hq = 4;
    c.Hkv = 2;
    c.D = 64;
    c.lq = {5, 70};
    c.lk = {9, 130};
    C = build(c, rng);
    c.paged = true;
    c.page_size = 16;
    c.extra_pages = 2;
    c.extra_cols = 1;
    P = build(c, rng);
    co = C->outputs();
    po = P->outputs();
  }
  std::unique_ptr<Built> C, P;  // contiguous, paged
  AttentionOutputs co, po;

  // A valid index for C, and its view
  BlockIndex index_for(Built& B, int bs = 64) {
    SelectionParams p;
    p.head_subgroups = 1;  // the segment counts below are per KV head
    p.block_size = bs;
    p.correction = true;  // the index checks below include its pooled means
    p.rule = SelectionRule::kTileEnergy;
    return build_index(B.in, p);
  }
};

TEST_F(Errors, ValidInputsDoNotThrow) {
  EXPECT_NO_THROW(attention(C->in, co));
  EXPECT_NO_THROW(attention(P->in, po));
  BlockIndex ic = index_for(*C), ip = index_for(*P);
  EXPECT_NO_THROW(sparse_attention(C->in, view_of(ic), co));
  EXPECT_NO_THROW(sparse_attention(P->in, view_of(ip), po));
  EXPECT_NO_THROW(union_index(P->in, ip));
}

// Launch options are enums a C++ caller may fill with any int: checked at the boundary, on every entry point.
TEST_F(Errors, LaunchOptionCodes) {
  AttentionInputs in = C->in;
  in.options.dense_path = static_cast<LaunchOptions::DensePath>(3);
  EXPECT_ARG_ERROR(attention(in, co), "options.dense_path");
  BlockIndex ic = index_for(*C);
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(ic), co), "options.dense_path");
  in.options.dense_path = static_cast<LaunchOptions::DensePath>(-1);
  EXPECT_ARG_ERROR(build_index(in, SelectionParams{}), "options.dense_path");
  in = C->in;
  in.options.dense_path = LaunchOptions::DensePath::kSplitKV;  // valid; the CPU reference has one path
  EXPECT_NO_THROW(attention(in, co));
}

// ---- ranks and shapes -------------------------------------------------------------------------------------------
TEST_F(Errors, QRank) {
  AttentionInputs in = C->in;
  in.q = make_view(C->q.data(), F32, {C->total_q, 4 * 64});
  EXPECT_ARG_ERROR(attention(in, co), "q");
  in.q = make_view(C->q.data(), F32, {1, C->total_q, 4, 64});
  EXPECT_ARG_ERROR(attention(in, co), "q");
}
TEST_F(Errors, Workspace) {
  std::vector<int32_t> buf(64, 0);
  AttentionOutputs o = co;
  o.workspace = make_view(buf.data(), DType::kInt32, {64});
  EXPECT_NO_THROW(attention(C->in, o));  // the CPU backend accepts and ignores it
  o.workspace = make_view(buf.data(), DType::kInt32, {8, 8});
  EXPECT_ARG_ERROR(attention(C->in, o), "workspace");
  TensorView strided = make_view(buf.data(), DType::kInt32, {32});
  strided.stride[0] = 2;
  o.workspace = strided;
  EXPECT_ARG_ERROR(attention(C->in, o), "workspace");
  TensorView other_device = make_view(buf.data(), DType::kInt32, {64}, Device::kCUDA);
  o.workspace = other_device;
  EXPECT_ARG_ERROR(attention(C->in, o), "workspace");
}

TEST_F(Errors, KRank) {
  AttentionInputs in = C->in;
  in.k = make_view(C->k.data(), F32, {C->total_k, 2 * 64});
  EXPECT_ARG_ERROR(attention(in, co), "k");
  AttentionInputs pin = P->in;  // paged k must be 4-D
  pin.k = make_view(P->k.data(), F32, {P->num_pages * 16, 2, 64});
  EXPECT_ARG_ERROR(attention(pin, po), "k");
}
TEST_F(Errors, VShapeMismatch) {
  AttentionInputs in = C->in;
  in.v = make_view(C->v.data(), F32, {C->total_k, 1, 64});
  EXPECT_ARG_ERROR(attention(in, co), "v");
  in = C->in;
  in.v = make_view(C->v.data(), F32, {C->total_k - 1, 2, 64});
  EXPECT_ARG_ERROR(attention(in, co), "v");
  AttentionInputs pin = P->in;
  pin.v = make_view(P->v.data(), F32, {P->num_pages, 8, 2, 64});  // page size differs from k
  EXPECT_ARG_ERROR(attention(pin, po), "v");
}
TEST_F(Errors, HeadDimMismatch) {
  AttentionInputs in = C->in;
  in.k = make_view(C->k.data(), F32, {C->total_k, 4, 32});  // same numel, D differs from q
  EXPECT_ARG_ERROR(attention(in, co), "k", "v");
}
TEST_F(Errors, HeadsNotDivisible) {
  AttentionInputs in = C->in;
  in.q = make_view(C->q.data(), F32, {C->total_q, 3, 64});
  AttentionOutputs o = co;
  o.out = make_view(C->out.data(), F32, {C->total_q, 3, 64});
  o.lse = std::nullopt;
  EXPECT_ARG_ERROR(attention(in, o), "q", "k");
  EXPECT_ARG_ERROR(build_index(in, SelectionParams{}), "q", "k");
}
TEST_F(Errors, UnsupportedHeadDim) {
  std::vector<float> q(C->total_q * 4 * 96), k(C->total_k * 2 * 96), v(C->total_k * 2 * 96), o(C->total_q * 4 * 96);
  AttentionInputs in = C->in;
  in.q = make_view(q.data(), F32, {C->total_q, 4, 96});
  in.k = make_view(k.data(), F32, {C->total_k, 2, 96});
  in.v = make_view(v.data(), F32, {C->total_k, 2, 96});
  AttentionOutputs outs;
  outs.out = make_view(o.data(), F32, {C->total_q, 4, 96});
  EXPECT_ARG_ERROR(attention(in, outs), "q", "k", "v");
  EXPECT_ARG_ERROR(build_index(in, SelectionParams{}), "q", "k", "v");
}

TEST_F(Errors, ZeroOrNegativeExtents) {
  AttentionInputs in = C->in;
  in.k.shape[1] = 0;  // Hkv = 0 must not divide by zero
  in.v.shape[1] = 0;
  EXPECT_ARG_ERROR(attention(in, co), "k", "q");
  EXPECT_ARG_ERROR(build_index(in, SelectionParams{}), "k", "q");
  in = C->in;
  in.q.shape[1] = 0;
  AttentionOutputs o = co;
  o.out.shape[1] = 0;
  o.lse = std::nullopt;
  EXPECT_ARG_ERROR(attention(in, o), "q");
  in = C->in;
  in.q.shape[2] = in.k.shape[2] = in.v.shape[2] = 0;
  o = co;
  o.out.shape[2] = 0;
  EXPECT_ARG_ERROR(attention(in, o), "q", "k", "v");
  in = C->in;
  in.q.shape[0] = -1;
  EXPECT_ARG_ERROR(attention(in, co), "q");
}
TEST_F(Errors, NullPointers) {
  AttentionInputs in = C->in;
  in.q.data = nullptr;
  EXPECT_ARG_ERROR(attention(in, co), "q");
  in = C->in;
  in.k.data = nullptr;
  EXPECT_ARG_ERROR(attention(in, co), "k");
  in = C->in;
  in.cu_seqlens_q.data = nullptr;
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  AttentionInputs pin = P->in;
  pin.block_table->data = nullptr;
  EXPECT_ARG_ERROR(attention(pin, po), "block_table");
  AttentionOutputs o = co;
  o.out.data = nullptr;
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
  o = co;
  o.lse->data = nullptr;
  EXPECT_ARG_ERROR(attention(C->in, o), "lse");
}

// ---- cu_seqlens -------------------------------------------------------------------------------------------------
TEST_F(Errors, CuSeqlensQ) {
  AttentionInputs in = C->in;
  std::vector<int32_t> bad{0, 70, 75};  // last matches total_q but not monotone? -> 0,70,75 is monotone; use below
  std::vector<int32_t> nonmono{0, 80, 75};
  in.cu_seqlens_q = make_view(nonmono.data(), DType::kInt32, {3});
  in.max_seqlen_q = 100;
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  std::vector<int32_t> short_total{0, 5, 74};
  in.cu_seqlens_q = make_view(short_total.data(), DType::kInt32, {3});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  std::vector<int32_t> nonzero{1, 5, 75};
  in.cu_seqlens_q = make_view(nonzero.data(), DType::kInt32, {3});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  std::vector<float> fl{0, 5, 75};
  in.cu_seqlens_q = make_view(fl.data(), F32, {3});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  in.cu_seqlens_q = make_view(C->cu_q.data(), DType::kInt32, {3, 1});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  in.cu_seqlens_q = make_view(C->cu_q.data(), DType::kInt32, {0});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_q");
  (void)bad;
}
TEST_F(Errors, CuSeqlensK) {
  AttentionInputs in = C->in;
  in.cu_seqlens_k = std::nullopt;  // contiguous KV needs cu_seqlens_k
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_k");
  std::vector<int32_t> two{0, 139};  // batch size differs from cu_seqlens_q
  in.cu_seqlens_k = make_view(two.data(), DType::kInt32, {2});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_k");
  std::vector<int32_t> nonmono{0, 140, 139};
  in.cu_seqlens_k = make_view(nonmono.data(), DType::kInt32, {3});
  in.max_seqlen_k = 1000;
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_k");
  std::vector<int32_t> total{0, 9, 138};
  in.cu_seqlens_k = make_view(total.data(), DType::kInt32, {3});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_k");
  std::vector<int32_t> over{0, 9, 140};
  in.cu_seqlens_k = make_view(over.data(), DType::kInt32, {3});
  EXPECT_ARG_ERROR(attention(in, co), "cu_seqlens_k");
}
TEST_F(Errors, MaxSeqlen) {
  AttentionInputs in = C->in;
  in.max_seqlen_q = 69;  // sequence 1 has 70 queries
  EXPECT_ARG_ERROR(attention(in, co), "max_seqlen_q");
  in = C->in;
  in.max_seqlen_k = 129;  // sequence 1 has 130 keys
  EXPECT_ARG_ERROR(attention(in, co), "max_seqlen_k");
  AttentionInputs pin = P->in;
  pin.max_seqlen_k = 100;
  EXPECT_ARG_ERROR(attention(pin, po), "max_seqlen_k");
  in = C->in;
  in.max_seqlen_q = -1;
  EXPECT_ARG_ERROR(attention(in, co), "max_seqlen_q");
}

// ---- paged KV -----------------------------------------------------------------------------------------------------
TEST_F(Errors, BlockTable) {
  AttentionInputs in = P->in;
  std::vector<int32_t> bt = P->block_table;
  in.block_table = make_view(bt.data(), DType::kInt32, {2, P->max_pages});
  bt[0] = int32_t(P->num_pages);  // out of range
  EXPECT_ARG_ERROR(attention(in, po), "block_table");
  bt = P->block_table;
  bt[P->max_pages] = -1;  // negative (sequence 1, first page, which is used)
  in.block_table = make_view(bt.data(), DType::kInt32, {2, P->max_pages});
  EXPECT_ARG_ERROR(attention(in, po), "block_table");
  in.block_table = make_view(P->block_table.data(), DType::kInt32, {1, P->max_pages});  // rows != B
  EXPECT_ARG_ERROR(attention(in, po), "block_table");
  std::vector<float> fl(P->block_table.size());
  in.block_table = make_view(fl.data(), F32, {2, P->max_pages});
  EXPECT_ARG_ERROR(attention(in, po), "block_table");
  in.block_table = make_view(P->block_table.data(), DType::kInt32, {2 * P->max_pages});
  EXPECT_ARG_ERROR(attention(in, po), "block_table");
}
TEST_F(Errors, SequsedK) {
  AttentionInputs in = P->in;
  std::vector<int32_t> su = P->seqused;
  su[1] = int32_t(P->max_pages * 16 + 1);  // beyond the pages given
  in.seqused_k = make_view(su.data(), DType::kInt32, {2});
  in.max_seqlen_k = 100000;
  EXPECT_ARG_ERROR(attention(in, po), "seqused_k");
  su = P->seqused;
  su[0] = -1;
  in.seqused_k = make_view(su.data(), DType::kInt32, {2});
  EXPECT_ARG_ERROR(attention(in, po), "seqused_k");
  in.seqused_k = make_view(P->seqused.data(), DType::kInt32, {1});
  EXPECT_ARG_ERROR(attention(in, po), "seqused_k");
  in.seqused_k = std::nullopt;
  EXPECT_ARG_ERROR(attention(in, po), "seqused_k");
  std::vector<float> fl{9, 130};
  in.seqused_k = make_view(fl.data(), F32, {2});
  EXPECT_ARG_ERROR(attention(in, po), "seqused_k");
}
TEST_F(Errors, SequsedWithoutBlockTable) {
  AttentionInputs in = C->in;
  std::vector<int32_t> su{9, 130};
  in.seqused_k = make_view(su.data(), DType::kInt32, {2});
  in.cu_seqlens_k = std::nullopt;
  EXPECT_ARG_ERROR(attention(in, co), "block_table", "seqused_k", "cu_seqlens_k");
}

// ---- strides, dtypes, devices -----------------------------------------------------------------------------------
TEST_F(Errors, LastDimNotContiguous) {
  AttentionInputs in = C->in;
  in.q.stride[2] = 2;
  EXPECT_ARG_ERROR(attention(in, co), "q");
  in = C->in;
  in.k.stride[2] = 2;
  EXPECT_ARG_ERROR(attention(in, co), "k");
  in = C->in;
  in.v.stride[2] = 0;
  EXPECT_ARG_ERROR(attention(in, co), "v");
  AttentionInputs pin = P->in;
  pin.k.stride[3] = 2;
  EXPECT_ARG_ERROR(attention(pin, po), "k");
  AttentionOutputs o = co;
  o.out.stride[2] = 2;
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
}
TEST_F(Errors, DTypes) {
  AttentionInputs in = C->in;
  in.k.dtype = DType::kFloat16;
  EXPECT_ARG_ERROR(attention(in, co), "k");
  in = C->in;
  in.v.dtype = DType::kBFloat16;
  EXPECT_ARG_ERROR(attention(in, co), "v");
  in = C->in;
  in.q.dtype = DType::kInt32;
  in.k.dtype = DType::kInt32;
  in.v.dtype = DType::kInt32;
  EXPECT_ARG_ERROR(attention(in, co), "q");
}
TEST_F(Errors, TypeErrorsAreTypeErrors) {
  AttentionInputs in = C->in;
  in.k.dtype = DType::kFloat16;
  try {
    attention(in, co);
    FAIL() << "no throw";
  } catch (const ArgumentError& e) {
    EXPECT_TRUE(e.is_type_error()) << e.what();
  }
  in = C->in;
  in.max_seqlen_q = 1;
  try {
    attention(in, co);
    FAIL() << "no throw";
  } catch (const ArgumentError& e) {
    EXPECT_FALSE(e.is_type_error()) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind(e.argument(), 0), 0u) << "message must start with the argument name";
  }
}
TEST_F(Errors, Devices) {
  AttentionInputs in = C->in;
  in.q.device = Device::kCUDA;  // data stays a host pointer: nothing crashes even if it is read
  EXPECT_ARG_ERROR(attention(in, co), "q", "k");
  in = C->in;
  in.k.device = Device::kCUDA;
  EXPECT_ARG_ERROR(attention(in, co), "k", "q");
  in = C->in;
  in.v.device = Device::kCUDA;
  EXPECT_ARG_ERROR(attention(in, co), "v", "q");
  AttentionOutputs o = co;
  o.out.device = Device::kCUDA;
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
}

#ifndef SPARSE_PREFILL_WITH_CUDA
// Every tensor on the GPU in a CPU-only build: a valid call the build cannot run -> NotImplementedError (or an
// ArgumentError), never a crash. The data pointers are host memory, so even a wrong host read would not fault.
TEST_F(Errors, AllOnCudaInCpuOnlyBuild) {
  auto on_cuda = [](TensorView t) {
    t.device = Device::kCUDA;
    return t;
  };
  AttentionInputs in = P->in;
  in.q = on_cuda(in.q);
  in.k = on_cuda(in.k);
  in.v = on_cuda(in.v);
  in.cu_seqlens_q = on_cuda(in.cu_seqlens_q);
  in.block_table = on_cuda(*in.block_table);
  in.seqused_k = on_cuda(*in.seqused_k);
  AttentionOutputs o = po;
  o.out = on_cuda(o.out);
  o.lse = on_cuda(*o.lse);
  auto expect_clean_refusal = [](auto&& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << ": a CUDA call ran in a CPU-only build";
    } catch (const NotImplementedError&) {
    } catch (const ArgumentError& e) {
      std::cout << "[errors] " << what << " on CUDA: ArgumentError " << e.what() << "\n";
    }
  };
  expect_clean_refusal([&] { attention(in, o); }, "attention");
  expect_clean_refusal([&] { build_index(in, SelectionParams{}); }, "build_index");
  // the support question answers without raising: the backend's own reason (here: no CUDA backend)
  const std::string why = sparse_prefill_support(in, SelectionParams{});
  EXPECT_NE(why.find("no CUDA backend"), std::string::npos) << why;
  EXPECT_NE(fp8_attention_support(128, 0).find("no CUDA backend"), std::string::npos);
}
#else
TEST_F(Errors, Fp8AttentionSupport) {  // support.cpp's FP8 constraint, by dimensions
  EXPECT_EQ(fp8_attention_support(128, 0), "");
  EXPECT_EQ(fp8_attention_support(128, 64), "");
  EXPECT_NE(fp8_attention_support(64, 0).find("head dim 128 only, got head dim 64"), std::string::npos);
  EXPECT_NE(fp8_attention_support(128, 16).find("got page_size 16"), std::string::npos);
}
#endif

// sparse_prefill_support: "" where the call runs sparse (the CPU reference: every valid call), an ArgumentError for
// a bad argument as the call raises it.
TEST_F(Errors, SparsePrefillSupport) {
  SelectionParams p;
  EXPECT_EQ(sparse_prefill_support(C->in, p), "");
  EXPECT_EQ(sparse_prefill_support(P->in, p), "");
  p.block_size = 100;
  EXPECT_ARG_ERROR(sparse_prefill_support(C->in, p), "block_size");
  AttentionInputs in = C->in;
  in.max_seqlen_q = -1;
  EXPECT_ARG_ERROR(sparse_prefill_support(in, SelectionParams{}), "max_seqlen_q");
  EXPECT_ARG_ERROR(fp8_attention_support(128, -1), "page_size");
}

// ---- window, scale ----------------------------------------------------------------------------------------------
TEST_F(Errors, Window) {
  AttentionInputs in = C->in;
  in.window_left = -2;
  EXPECT_ARG_ERROR(attention(in, co), "window");
  in = C->in;
  in.window_right = -7;
  EXPECT_ARG_ERROR(attention(in, co), "window");
}
TEST_F(Errors, SoftmaxScale) {
  AttentionInputs in = C->in;
  in.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_ARG_ERROR(attention(in, co), "softmax_scale");
  in.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_ARG_ERROR(attention(in, co), "softmax_scale");
}

// ---- out / lse --------------------------------------------------------------------------------------------------
TEST_F(Errors, OutShapeDtype) {
  AttentionOutputs o = co;
  o.out = make_view(C->out.data(), F32, {C->total_q - 1, 4, 64});
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
  o.out = make_view(C->out.data(), F32, {C->total_q, 2, 128});
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
  o.out = make_view(C->out.data(), F32, {C->total_q * 4, 64});
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
  o.out = make_view(C->out.data(), DType::kBFloat16, {C->total_q, 4, 64});
  EXPECT_ARG_ERROR(attention(C->in, o), "out");
}
TEST_F(Errors, LseShapeDtype) {
  AttentionOutputs o = co;
  o.lse = make_view(C->lse.data(), F32, {C->total_q, 4});  // transposed
  EXPECT_ARG_ERROR(attention(C->in, o), "lse");
  o.lse = make_view(C->lse.data(), F32, {4 * C->total_q});
  EXPECT_ARG_ERROR(attention(C->in, o), "lse");
  o.lse = make_view(C->lse.data(), DType::kFloat16, {4, C->total_q});
  EXPECT_ARG_ERROR(attention(C->in, o), "lse");
  o.lse = make_view(C->lse.data(), F32, {4, C->total_q});
  o.lse->device = Device::kCUDA;
  EXPECT_ARG_ERROR(attention(C->in, o), "lse");
}

// ---- selection parameters -----------------------------------------------------------------------------------------
TEST_F(Errors, BlockSize) {
  for (int bs : {96, 0, -64, 32, 100}) {
    SelectionParams p;
    p.block_size = bs;
    EXPECT_ARG_ERROR(build_index(C->in, p), "block_size") << " block_size " << bs;
    std::vector<int32_t> cu;
    std::vector<float> km, vm;
    EXPECT_ARG_ERROR(pool_kv(P->in, bs, cu, km, vm), "block_size") << " block_size " << bs;
  }
}
TEST_F(Errors, SelectionParams) {
  SelectionParams p;
  p.alpha = -0.1f;
  EXPECT_ARG_ERROR(build_index(C->in, p), "alpha");
  p.alpha = std::numeric_limits<float>::quiet_NaN();
  EXPECT_ARG_ERROR(build_index(C->in, p), "alpha");
  p = SelectionParams{};
  p.rule = SelectionRule::kProbeRowMax;
  p.mean_alpha = 1.5f;
  EXPECT_ARG_ERROR(build_index(C->in, p), "mean_alpha");
  p.mean_alpha = std::numeric_limits<float>::quiet_NaN();
  EXPECT_ARG_ERROR(build_index(C->in, p), "mean_alpha");
  p = SelectionParams{};
  p.sink = -1;
  EXPECT_ARG_ERROR(build_index(C->in, p), "sink");
  p = SelectionParams{};
  p.window = -1;
  EXPECT_ARG_ERROR(build_index(C->in, p), "window");
  p = SelectionParams{};
  p.last_n = -1;
  EXPECT_ARG_ERROR(build_index(C->in, p), "last_n");
  // The device index's budget: -1 (the causal bound) or [0, 2^31 - 1] int32 slots, checked on every backend.
  for (int64_t budget : {int64_t(-2), int64_t(INT32_MAX) + 1, int64_t(1) << 40}) {
    p = SelectionParams{};
    p.max_kept_blocks = budget;
    EXPECT_ARG_ERROR(build_index(C->in, p), "max_kept_blocks") << " max_kept_blocks " << budget;
    EXPECT_ARG_ERROR(index_workspace_bytes(C->in, p), "max_kept_blocks") << " max_kept_blocks " << budget;
  }
  for (int64_t budget : {int64_t(-1), int64_t(0), int64_t(INT32_MAX)}) {  // the CPU reference takes no budget
    p = SelectionParams{};
    p.max_kept_blocks = budget;
    EXPECT_NO_THROW(build_index(C->in, p)) << " max_kept_blocks " << budget;
  }
}
TEST_F(Errors, BuildIndexValidatesInputs) {
  AttentionInputs in = P->in;
  std::vector<int32_t> bt = P->block_table;
  bt[0] = 1 << 20;
  in.block_table = make_view(bt.data(), DType::kInt32, {2, P->max_pages});
  EXPECT_ARG_ERROR(build_index(in, SelectionParams{}), "block_table");
  std::vector<int32_t> cu;
  std::vector<float> km, vm;
  EXPECT_ARG_ERROR(pool_kv(in, 64, cu, km, vm), "block_table");
}

// ---- index ------------------------------------------------------------------------------------------------------
// An index is bound to the call it was built for (IndexBinding): another mask, scale, length bound or array is
// refused with the argument's name; reuse_index applies the selection to other arrays of the same problem.
TEST_F(Errors, IndexBoundToItsProblem) {
  BlockIndex idx = index_for(*C);
  ASSERT_TRUE(idx.binding.set);
  AttentionInputs in = C->in;
  in.causal = false;
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co), "causal");
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co, /*reuse_index=*/true), "causal");
  in = C->in;
  in.softmax_scale = 0.3f;
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co), "softmax_scale");
  in = C->in;
  in.max_seqlen_k += 1;
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co), "max_seqlen_k");
  // Another array of the same shape (the paged case's q is a different buffer of C's shape class): data check.
  HostTensor q2 = C->q;
  in = C->in;
  in.q.data = q2.data();
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co), "q");
  EXPECT_NO_THROW(sparse_attention(in, view_of(idx), co, /*reuse_index=*/true));
  // An index of the paged case used with the contiguous one: the KV layout differs.
  BlockIndex ip = index_for(*P);
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(ip), co, true), "k", "cu_seqlens_q", "q");
  // A view made by hand (binding unset) is trusted as before.
  BlockIndex hand = idx;
  hand.binding = IndexBinding{};
  in = C->in;
  in.q.data = q2.data();
  EXPECT_NO_THROW(sparse_attention(in, view_of(hand), co));
}
TEST_F(Errors, IndexSegmentCount) {
  BlockIndex idx = index_for(*C);
  idx.segment_start.pop_back();
  idx.segment_end.pop_back();
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(idx), co), "index*");
  EXPECT_ARG_ERROR(union_index(C->in, idx), "index*");
}
TEST_F(Errors, IndexBlockIdsOutOfRange) {
  BlockIndex idx = index_for(*C);
  ASSERT_FALSE(idx.block_ids.empty());
  BlockIndex a = idx;
  a.block_ids.back() = 1000;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(a), co), "index*");
  BlockIndex b = idx;
  b.block_ids[0] = -1;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(b), co), "index*");
}
TEST_F(Errors, IndexNotAscending) {
  BlockIndex idx = index_for(*C);
  std::vector<std::vector<int>> lists = lists_of(idx);
  size_t s = 0;
  while (s < lists.size() && lists[s].size() < 2) ++s;
  ASSERT_LT(s, lists.size());
  auto dup = lists;
  dup[s][1] = dup[s][0];  // duplicate block: would double-count its keys
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(*std::make_unique<BlockIndex>(index_with_lists(idx, dup, true))), co),
                   "index*");
  auto desc = lists;
  std::reverse(desc[s].begin(), desc[s].end());
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(*std::make_unique<BlockIndex>(index_with_lists(idx, desc, true))), co),
                   "index*");
}
TEST_F(Errors, IndexRanges) {
  BlockIndex idx = index_for(*C);
  BlockIndex a = idx;
  a.segment_end.back() = int32_t(a.block_ids.size()) + 5;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(a), co), "index*");
  BlockIndex b = idx;
  b.segment_start[0] = b.segment_end[0] + 1;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(b), co), "index*");
}
TEST_F(Errors, IndexPooledMeans) {
  BlockIndex idx = index_for(*C);
  BlockIndex a = idx;
  a.cu_blocks.back() += 1;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(a), co), "index*");
  BlockIndex b = idx;
  b.k_mean.resize(b.k_mean.size() - 64);
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(b), co), "index*");
  BlockIndex c = idx;
  c.v_mean.resize(c.v_mean.size() + 64);
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(c), co), "index*");
}
TEST_F(Errors, IndexDTypesAndDevices) {
  BlockIndex idx = index_for(*C);
  {
    BlockIndexView v = view_of(idx);
    v.block_ids.dtype = F32;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.segment_start.dtype = DType::kFloat16;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.k_mean.dtype = DType::kBFloat16;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.v_mean.device = Device::kCUDA;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.block_ids.device = Device::kCUDA;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.cu_blocks.device = Device::kCUDA;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.cu_blocks.stride[0] = 2;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
  {
    BlockIndexView v = view_of(idx);
    v.k_mean.shape[2] = 32;  // head dim differs from q
    v.k_mean.shape[1] = 4;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index*");
  }
}
TEST_F(Errors, IndexBlockSize) {
  BlockIndex idx = index_for(*C);
  idx.block_size = 96;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(idx), co), "index*", "block_size");
  BlockIndex other = index_for(*C, 128);  // right shape for bs 128, declared as 64
  other.block_size = 64;
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(other), co), "index*");
}
TEST_F(Errors, IndexOfAnotherProblem) {
  BlockIndex idx = index_for(*C);  // lk {9, 130}: cu_blocks {0, 1, 4}
  AttentionInputs in = C->in;
  std::vector<int32_t> cu_k{0, 9, 70};  // lk {9, 61}: 2 blocks
  in.cu_seqlens_k = make_view(cu_k.data(), DType::kInt32, {3});
  in.k.shape[0] = 70;
  in.v.shape[0] = 70;
  // The binding names the first argument that differs (k's rows); a hand-made view (no binding) fails on its arrays.
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co), "k");
  EXPECT_ARG_ERROR(union_index(in, idx), "k");
  BlockIndex hand = idx;
  hand.binding = IndexBinding{};
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(hand), co), "index*");
  EXPECT_ARG_ERROR(union_index(in, hand), "index*");
}
TEST_F(Errors, SparseAttentionValidatesInputsAndOutputs) {
  BlockIndex idx = index_for(*C);
  AttentionInputs in = C->in;
  in.k.dtype = DType::kFloat16;
  EXPECT_ARG_ERROR(sparse_attention(in, view_of(idx), co), "k");
  AttentionOutputs o = co;
  o.out = make_view(C->out.data(), F32, {C->total_q, 4, 32});
  EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(idx), o), "out");
}

// ---- head sub-groups ----------------------------------------------------------------------------------------------
// Fixture: Hq 4, Hkv 2 (g = 2); lq {5, 70}: 1 + 2 tiles per KV head (6 segments) with S = 1, 1 + 1 tiles per virtual
// head (8 segments) with S = 2.
TEST_F(Errors, HeadSubgroups) {
  for (int S : {-1, 3, 4}) {
    SelectionParams p;
    p.block_size = 64;
    p.head_subgroups = S;
    EXPECT_ARG_ERROR(build_index(C->in, p), "head_subgroups") << " S " << S;
    EXPECT_ARG_ERROR(build_index(P->in, p), "head_subgroups") << " S " << S;
    EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(C->in, p, co), "head_subgroups") << " S " << S;
    const int64_t slots = mean_cache_slots(P->num_pages, 16, 64);
    std::vector<float> km(size_t(slots) * 2 * 64, 0.f), vm(km.size(), 0.f);
    const MeanCache cache{make_view(km.data(), F32, {slots, 2, 64}), make_view(vm.data(), F32, {slots, 2, 64})};
    EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(P->in, p, po, cache), "head_subgroups") << " S " << S;
  }
  try {
    SelectionParams p;
    p.head_subgroups = 3;
    build_index(C->in, p);
    ADD_FAILURE() << "S = 3 with g = 2 did not throw";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("divide"), std::string::npos) << e.what();
  }
  SelectionParams p;
  p.block_size = 64;
  p.head_subgroups = 2;
  EXPECT_NO_THROW(build_index(C->in, p));
  EXPECT_NO_THROW(::sparse_prefill::sparse_prefill(C->in, p, co));
  p.head_subgroups = 0;  // one selection per query head: S = g = 2
  const BlockIndex per_head = build_index(C->in, p);
  EXPECT_EQ(per_head.num_subgroups, 2);
  EXPECT_EQ(per_head.segment_start.size(), 8u);
  EXPECT_EQ(per_head.binding.num_subgroups, 2);
}
// A device index's params are its request; a request that resolves to another count than the one it was built with
// (binding.num_subgroups) is refused before anything else (as_built), with both numbers; 0 (one per query head) and
// the built count are accepted. Reachable without a GPU: the check precedes the device checks.
TEST_F(Errors, DeviceIndexRequestDiffersFromBuiltSubgroups) {
  DeviceBlockIndex index;
  index.binding.num_subgroups = 2;
  index.params.head_subgroups = 1;
  index.params.correction = false;  // to_host's V-means check would answer first
  try {
    sparse_attention(C->in, index, co);
    ADD_FAILURE() << "a device index whose params.head_subgroups differ from its build did not throw";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "index");
    const std::string m = e.what();
    EXPECT_NE(m.find("params.head_subgroups (1)"), std::string::npos) << m;
    EXPECT_NE(m.find("binding.num_subgroups 2"), std::string::npos) << m;
  }
  EXPECT_ARG_ERROR(index_stats(index, nullptr), "index");
  EXPECT_ARG_ERROR(to_host(index, nullptr), "index");
  for (int requested : {0, 2}) {  // past as_built: a CPU call with a device index is refused as such
    index.params.head_subgroups = requested;
    try {
      sparse_attention(C->in, index, co);
      ADD_FAILURE() << "a device index on CPU inputs did not throw";
    } catch (const std::exception& e) {
      EXPECT_EQ(std::string(e.what()).find("params.head_subgroups"), std::string::npos) << e.what();
    }
  }
}
TEST_F(Errors, IndexHeadSubgroups) {
  BlockIndex one = index_for(*C);  // S = 1
  SelectionParams p;
  p.block_size = 64;
  p.head_subgroups = 2;
  p.correction = true;  // the means are read (and checked) with the correction only
  BlockIndex two = build_index(C->in, p);
  ASSERT_EQ(one.segment_start.size(), 6u);
  ASSERT_EQ(two.segment_start.size(), 8u);
  EXPECT_NO_THROW(sparse_attention(C->in, view_of(two), co));
  EXPECT_NO_THROW(union_index(C->in, two));
  for (int S : {0, -2, 3}) {  // < 1, or not dividing g = 2
    BlockIndexView v = view_of(two);
    v.num_subgroups = S;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index.num_subgroups") << " S " << S;
    BlockIndex bad = two;
    bad.num_subgroups = S;
    EXPECT_ARG_ERROR(union_index(C->in, bad), "index.num_subgroups") << " S " << S;
  }
  {  // num_subgroups that does not match the segment count
    BlockIndexView v = view_of(one);
    v.num_subgroups = 2;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index.segment_start");
    v = view_of(two);
    v.num_subgroups = 1;
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index.segment_start");
    BlockIndex bad = one;
    bad.num_subgroups = 2;
    EXPECT_ARG_ERROR(union_index(C->in, bad), "index.segment_start");
  }
  {  // segments of S = 2 but the pooled means of the real KV heads (Hkv, not Hkv * S)
    BlockIndexView v = view_of(two);
    v.k_mean = make_view(one.k_mean.data(), F32, {int64_t(one.cu_blocks.back()), 2, 64});
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index.k_mean");
    v = view_of(two);
    v.v_mean = make_view(one.v_mean.data(), F32, {int64_t(one.cu_blocks.back()), 2, 64});
    EXPECT_ARG_ERROR(sparse_attention(C->in, v, co), "index.v_mean");
    v.correction = false;  // without correction the means are not read, hence not checked
    EXPECT_NO_THROW(sparse_attention(C->in, v, co));
  }
  {  // an index of S = 1 whose declared head count is virtual: view_of sizes the means by num_kv_heads
    BlockIndex bad = one;
    bad.num_kv_heads = 4;
    bad.num_subgroups = 2;
    EXPECT_ARG_ERROR(sparse_attention(C->in, view_of(bad), co), "index*");
  }
}

// ---- pooled-means cache (chunked prefill) --------------------------------------------------------------------------
TEST_F(Errors, MeanCache) {
  SelectionParams p;
  p.block_size = 64;  // P: page_size 16, Hkv 2, D 64: one slot per page (the block's last page)
  const int64_t slots = mean_cache_slots(P->num_pages, 16, 64);
  ASSERT_EQ(slots, P->num_pages);
  EXPECT_EQ(mean_cache_slots(10, 256, 128), 20);  // pages holding two blocks: two slots each
  std::vector<float> km(size_t(slots) * 2 * 64, 0.f), vm(km.size(), 0.f);
  const MeanCache cache{make_view(km.data(), F32, {slots, 2, 64}), make_view(vm.data(), F32, {slots, 2, 64})};
  EXPECT_NO_THROW(::sparse_prefill::sparse_prefill(P->in, p, po, cache));
  EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(C->in, p, co, cache), "mean_cache");  // contiguous KV: no pages to key slots by
  MeanCache bad = cache;
  bad.k_mean = make_view(km.data(), F32, {slots - 1, 2, 64});
  EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(P->in, p, po, bad), "mean_cache.k_mean");
  bad = cache;
  bad.v_mean = make_view(vm.data(), F32, {slots, 2, 32});
  EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(P->in, p, po, bad), "mean_cache.v_mean");
  std::vector<uint16_t> half(km.size());
  bad = cache;
  bad.v_mean = make_view(half.data(), DType::kFloat16, {slots, 2, 64});
  EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(P->in, p, po, bad), "mean_cache.v_mean");
  bad = cache;
  bad.v_mean = cache.k_mean;
  EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(P->in, p, po, bad), "mean_cache.v_mean");
  bad = cache;
  bad.k_mean.stride[0] = 2 * 64 + 1;  // not contiguous
  EXPECT_ARG_ERROR(::sparse_prefill::sparse_prefill(P->in, p, po, bad), "mean_cache.k_mean");
}

}  // namespace
}  // namespace sptest
