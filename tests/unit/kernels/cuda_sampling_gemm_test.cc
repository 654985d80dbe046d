// CUDA argmax and sampling against ref::Argmax and the engine's CPU Sampler
// (the same token, exactly, for every row and seed: both follow the same
// order and draw; see kernels/cuda/sampling.h for the one theoretical
// difference), and the cuBLASLt GEMM against ref::Gemm (bf16 output:
// normalized error <= 1e-2 with floor 1; f32 output: <= 1e-4), plus the
// batch-invariant GEMM mode (a row's bits equal between m = 1 and m = 64).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "engine/sampler.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "kernels/reference/ops.h"
#include "tests/unit/kernels/cuda_test_util.h"

namespace tandem::kernels::cuda {
namespace {

using kernels::testing::Compare;
using kernels::testing::Random;
using testing::DeviceBuffer;
using testing::ExpectClose;
using testing::ToBf16;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(CudaGemm, LoadsCublasLtAtFirstUse) {
  // Runs without a device: cuBLASLt is dlopen'ed (not linked, see gemm.cc),
  // so a missing library must surface here as a clear error. Without a
  // device cublasLtCreate itself may fail, but never the loading.
  std::unique_ptr<GemmContext> ctx;
  const KernelStatus st = GemmContext::Create(nullptr, 0, false, &ctx);
  if (!st.ok()) {
    EXPECT_EQ(std::string(st.message).find("cannot load libcublasLt"), std::string::npos) << st.message;
  }
}

TEST(CudaSampling, UniformDrawMatchesTheEngine) {
  // Host code only: runs without a device.
  for (uint64_t seed : {0ull, 1ull, 42ull, 0xFFFFFFFFFFFFFFFFull}) {
    for (uint64_t i = 0; i < 100; ++i) {
      EXPECT_EQ(UniformDrawHost(seed, i), engine::UniformDraw(seed, i)) << seed << " " << i;
    }
  }
}

TEST(CudaSampling, ArgmaxMatchesReferenceWithTiesNaNAndInf) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int vocab : {1, 7, 4096, 128256}) {
    const int m = 64;
    std::vector<float> logits = Random(static_cast<size_t>(m) * vocab, 60, -10.0f, 10.0f);
    std::mt19937 rng(61);
    for (int i = 0; i < m; ++i) {
      float* row = logits.data() + static_cast<size_t>(i) * vocab;
      switch (i % 8) {
        case 1: row[rng() % vocab] = kNaN; break;
        case 2: std::fill_n(row, vocab, kNaN); break;             // all NaN: 0
        case 3: std::fill_n(row, vocab, -kInf); break;            // all -inf: 0
        case 4: row[vocab - 1] = 20.0f; row[vocab / 2] = 20.0f; break;  // tie: lower id
        case 5: row[rng() % vocab] = kInf; break;
        default: break;
      }
    }
    std::vector<int32_t> want(m);
    ref::Argmax(logits.data(), want.data(), m, vocab);
    DeviceBuffer<float> dl(logits.size());
    DeviceBuffer<int32_t> dout(m);
    dl.Upload(logits);
    ASSERT_KERNEL_OK(Argmax(dl.get(), dout.get(), m, vocab, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dout.Download(), want) << "vocab " << vocab;
    EXPECT_TRUE(dout.GuardsIntact());
  }
}

TEST(CudaSampling, SampleMatchesTheCpuSamplerExactly) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  struct P {
    float temperature, top_p;
    uint32_t top_k;
  };
  const std::vector<P> params = {{1.0f, 1.0f, 0},  {0.7f, 1.0f, 0},  {1.3f, 0.9f, 0},
                                 {1.0f, 0.5f, 0},  {0.8f, 1.0f, 50}, {1.0f, 0.95f, 40},
                                 {0.0f, 1.0f, 0},  {1.0f, 1.0f, 1},  {2.0f, 0.3f, 5},
                                 {1.0f, 1.0f, 100000}};
  for (int vocab : {7, 4096, 128256}) {
    const int m = 64;
    // Peaked rows (a few large logits) and flat rows; some NaN and ties.
    std::vector<float> logits = Random(static_cast<size_t>(m) * vocab, 70, -4.0f, 4.0f);
    std::mt19937 rng(71);
    for (int i = 0; i < m; ++i) {
      float* row = logits.data() + static_cast<size_t>(i) * vocab;
      if (i % 3 == 0) {
        for (int j = 0; j < 5; ++j) row[rng() % vocab] = 9.0f + j;
      }
      if (i % 5 == 1) row[rng() % vocab] = kNaN;
      if (i % 7 == 2 && vocab > 3) row[1] = row[2];
    }
    std::vector<SampleParams> sp(m);
    std::vector<engine::SamplingParams> ep(m);
    for (int i = 0; i < m; ++i) {
      const P& p = params[i % params.size()];
      sp[i].temperature = ep[i].temperature = p.temperature;
      sp[i].top_p = ep[i].top_p = p.top_p;
      sp[i].top_k = ep[i].top_k = p.top_k;
      sp[i].seed = 1000 + i;
      sp[i].index = static_cast<uint64_t>(i) * 3;
    }
    DeviceBuffer<float> dl(logits.size());
    DeviceBuffer<SampleParams> dp(m);
    DeviceBuffer<int32_t> dout(m);
    dl.Upload(logits);
    dp.Upload(sp);
    ASSERT_KERNEL_OK(Sample(dl.get(), dp.get(), dout.get(), m, vocab, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const auto got = dout.Download();
    engine::Sampler sampler;
    for (int i = 0; i < m; ++i) {
      const uint32_t want = sampler.Sample(
          std::span<const float>(logits.data() + static_cast<size_t>(i) * vocab, vocab), ep[i],
          sp[i].seed, sp[i].index);
      EXPECT_EQ(got[i], static_cast<int32_t>(want)) << "vocab " << vocab << " row " << i;
    }
    EXPECT_TRUE(dout.GuardsIntact());
  }
}

struct GemmFixture {
  DeviceBuffer<unsigned char> ws{32u << 20};
  std::unique_ptr<GemmContext> ctx;
};

TEST(CudaGemm, MatchesReferenceAtModelShapes) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  GemmFixture f;
  ASSERT_KERNEL_OK(GemmContext::Create(f.ws.get(), f.ws.size(), false, &f.ctx));
  struct S {
    int n, k;
  };
  for (const S s : {S{256, 256}, S{688, 256}, S{4096, 4096}, S{1024, 4096}, S{128256, 512}}) {
    for (int m : {1, 7, 64, 256}) {
      // Keeps the double-precision reference under a second per shape.
      if (static_cast<double>(m) * s.n * s.k > 1073741824.0) continue;
      std::vector<float> x = Random(static_cast<size_t>(m) * s.k, 80);
      std::vector<float> w = Random(static_cast<size_t>(s.n) * s.k, 81);
      std::vector<float> bias = Random(s.n, 82);
      const auto xb = ToBf16(x);
      const auto wb = ToBf16(w);
      const auto bb = ToBf16(bias);
      DeviceBuffer<uint16_t> dx(xb.size()), dw(wb.size()), db(bb.size()),
          dy(static_cast<size_t>(m) * s.n);
      DeviceBuffer<float> dyf(static_cast<size_t>(m) * s.n);
      dx.Upload(xb);
      dw.Upload(wb);
      db.Upload(bb);
      std::vector<float> want(static_cast<size_t>(m) * s.n), want_bias(want.size());
      ref::Gemm(x.data(), w.data(), nullptr, want.data(), m, s.n, s.k);
      for (size_t i = 0; i < want.size(); ++i) want_bias[i] = want[i] + bias[i % s.n];
      const std::string what = "m " + std::to_string(m) + " n " + std::to_string(s.n) + " k " + std::to_string(s.k);
      auto* xp = reinterpret_cast<bf16*>(dx.get());
      auto* wp = reinterpret_cast<bf16*>(dw.get());
      ASSERT_KERNEL_OK(f.ctx->Gemm(xp, wp, nullptr, dyf.get(), GemmOutType::kF32, m, s.n, s.k, nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      const auto yf = dyf.Download();
      // Errors relative to the output's scale (its RMS), not each element's:
      // tensor cores accumulate in f32 in their own order, so an output near
      // zero among outputs of O(sqrt(k)) carries their absolute rounding
      // (~1e-4 at k = 4096 on an H100). 1e-4 of the RMS still fails an f32
      // GEMM that rounds to bf16 anywhere (2^-9 ~ 2e-3 of each output).
      double sq = 0;
      for (float v : want) sq += static_cast<double>(v) * v;
      const double rms = std::sqrt(sq / static_cast<double>(want.size()));
      const auto st = Compare(yf.data(), want.data(), yf.size(), 1e-4, std::max(1.0, rms));
      EXPECT_EQ(st.mismatches + st.nans, 0u) << what << " f32: " << st.first << " max " << st.max_err;
      ASSERT_KERNEL_OK(f.ctx->Gemm(xp, wp, reinterpret_cast<bf16*>(db.get()), dy.get(),
                                   GemmOutType::kBf16, m, s.n, s.k, nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      ExpectClose(dy.Download(), want_bias, 1e-2, 1.0, what + " bf16+bias");
      EXPECT_TRUE(dy.GuardsIntact() && dyf.GuardsIntact()) << what;
    }
  }
}

TEST(CudaGemm, BatchInvariantModeGivesTheSameRowBitsForEveryM) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  GemmFixture f;
  ASSERT_KERNEL_OK(GemmContext::Create(f.ws.get(), f.ws.size(), true, &f.ctx));
  const int n = 4096, k = 4096;
  std::vector<float> x = Random(static_cast<size_t>(64) * k, 90);
  std::vector<float> w = Random(static_cast<size_t>(n) * k, 91);
  const auto xb = ToBf16(x);
  const auto wb = ToBf16(w);
  DeviceBuffer<uint16_t> dx(xb.size()), dw(wb.size());
  dx.Upload(xb);
  dw.Upload(wb);
  std::vector<std::vector<float>> row3;
  for (int m : {4, 64, 17}) {
    DeviceBuffer<float> dy(static_cast<size_t>(m) * n);
    ASSERT_KERNEL_OK(f.ctx->Gemm(reinterpret_cast<bf16*>(dx.get()), reinterpret_cast<bf16*>(dw.get()),
                                 nullptr, dy.get(), GemmOutType::kF32, m, n, k, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const auto y = dy.Download();
    row3.emplace_back(y.begin() + 3 * n, y.begin() + 4 * n);
  }
  EXPECT_EQ(row3[0], row3[1]) << "m 4 vs m 64";
  EXPECT_EQ(row3[0], row3[2]) << "m 4 vs m 17";
}

}  // namespace
}  // namespace tandem::kernels::cuda
