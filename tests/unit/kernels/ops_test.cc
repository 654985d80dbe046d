// Row-wise kernels (RMSNorm, fused add + RMSNorm, RoPE, SwiGLU, argmax,
// softmax, log-softmax): optimized vs reference over shape sweeps with a
// stated tolerance, guard bytes, and rows bit-identical whatever m/threads.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/reference/ops.h"
#include "tests/unit/kernels/test_util.h"

namespace tandem::kernels {
namespace {

using testing::BitEqual;
using testing::Compare;
using testing::Guarded;
using testing::Random;

// Per-op tolerances on |cpu - ref| / max(|ref|, floor).
constexpr double kNormTol = 1e-5, kNormFloor = 1e-3;
constexpr double kRopeTol = 1e-5, kRopeFloor = 1.0;  // absolute for |x| <= ~1
constexpr double kSiluTol = 1e-5, kSiluFloor = 1e-3;
constexpr double kSoftmaxTol = 1e-5, kSoftmaxFloor = 1e-30;  // relative
constexpr double kLogSoftmaxTol = 1e-5, kLogSoftmaxFloor = 1.0;

const int kRows[] = {1, 2, 3, 7, 16, 33};
const int kDims[] = {1, 15, 16, 17, 64, 255, 256, 688, 768, 1000};

#define EXPECT_CLEAN(stats, what)                                          \
  do {                                                                     \
    EXPECT_EQ((stats).nans, 0u) << what << " " << (stats).first;           \
    EXPECT_EQ((stats).mismatches, 0u) << what << " " << (stats).first      \
                                      << " max err " << (stats).max_err;  \
  } while (0)

TEST(OpsTest, RmsNormMatchesReference) {
  cpu::ThreadPool two(2);
  for (int m : kRows) {
    for (int d : kDims) {
      const size_t n = static_cast<size_t>(m) * d;
      const auto x = Random(n, 11 + m * d, -3.0f, 3.0f);
      const auto w = Random(d, 12 + d, 0.5f, 1.5f);
      std::vector<float> want(n);
      ref::RmsNorm(x.data(), w.data(), 1e-5f, want.data(), m, d);
      Guarded got(n), got2(n);
      cpu::RmsNorm(x.data(), w.data(), 1e-5f, got.data(), m, d);
      cpu::RmsNorm(x.data(), w.data(), 1e-5f, got2.data(), m, d, &two);
      ASSERT_TRUE(got.GuardsIntact() && got2.GuardsIntact());
      EXPECT_CLEAN(Compare(got.data(), want.data(), n, kNormTol, kNormFloor),
                   "m=" << m << " d=" << d);
      EXPECT_TRUE(BitEqual(got.data(), got2.data(), n));
      // Row 0 alone gives the same bits as row 0 in the batch; so does the last row.
      std::vector<float> one(static_cast<size_t>(d));
      cpu::RmsNorm(x.data() + n - d, w.data(), 1e-5f, one.data(), 1, d);
      EXPECT_TRUE(BitEqual(one.data(), got.data() + n - d, d));
    }
  }
}

TEST(OpsTest, AddRmsNormMatchesReference) {
  for (int m : kRows) {
    for (int d : kDims) {
      const size_t n = static_cast<size_t>(m) * d;
      const auto x = Random(n, 21 + m * d);
      const auto res0 = Random(n, 22 + m * d);
      const auto w = Random(d, 23 + d, 0.5f, 1.5f);
      std::vector<float> want(n), res_ref = res0;
      ref::AddRmsNorm(res_ref.data(), x.data(), w.data(), 1e-6f, want.data(), m, d);
      Guarded got(n), res(n);
      std::copy(res0.begin(), res0.end(), res.data());
      cpu::AddRmsNorm(res.data(), x.data(), w.data(), 1e-6f, got.data(), m, d);
      ASSERT_TRUE(got.GuardsIntact() && res.GuardsIntact());
      // The residual add is one f32 add in both.
      EXPECT_TRUE(BitEqual(res.data(), res_ref.data(), n));
      EXPECT_CLEAN(Compare(got.data(), want.data(), n, kNormTol, kNormFloor),
                   "m=" << m << " d=" << d);
    }
  }
}

TEST(OpsTest, RopeMatchesReference) {
  cpu::ThreadPool two(2);
  RopeLlama3Scaling llama3;
  for (int hd : {32, 64, 128}) {
    for (int variant = 0; variant < 2; ++variant) {
      std::vector<float> inv_freq(static_cast<size_t>(hd / 2));
      ref::RopeInvFreq(inv_freq.data(), hd, variant == 0 ? 10000.0 : 500000.0,
                       variant == 0 ? nullptr : &llama3);
      for (int t : {1, 5, 37}) {
        for (int kvh : {1, 2}) {
          const int heads = kvh * 4;
          std::vector<int32_t> pos(static_cast<size_t>(t));
          for (int i = 0; i < t; ++i) pos[static_cast<size_t>(i)] = i * 97 + variant * 5000;
          const auto q0 = Random(static_cast<size_t>(t) * heads * hd, 31 + t);
          const auto k0 = Random(static_cast<size_t>(t) * kvh * hd, 32 + t);
          auto qr = q0, kr = k0;
          ref::Rope(qr.data(), kr.data(), pos.data(), inv_freq.data(), t, heads, kvh, hd);
          Guarded qc(q0.size()), kc(k0.size());
          std::copy(q0.begin(), q0.end(), qc.data());
          std::copy(k0.begin(), k0.end(), kc.data());
          cpu::Rope(qc.data(), kc.data(), pos.data(), inv_freq.data(), t, heads, kvh, hd, &two);
          ASSERT_TRUE(qc.GuardsIntact() && kc.GuardsIntact());
          EXPECT_CLEAN(Compare(qc.data(), qr.data(), qr.size(), kRopeTol, kRopeFloor), "q hd=" << hd);
          EXPECT_CLEAN(Compare(kc.data(), kr.data(), kr.size(), kRopeTol, kRopeFloor), "k hd=" << hd);
          // The last token alone gives the same bits.
          std::vector<float> q1(q0.end() - heads * hd, q0.end()), k1(k0.end() - kvh * hd, k0.end());
          cpu::Rope(q1.data(), k1.data(), &pos.back(), inv_freq.data(), 1, heads, kvh, hd);
          EXPECT_TRUE(BitEqual(q1.data(), qc.data() + q0.size() - q1.size(), q1.size()));
        }
      }
    }
  }
}

TEST(OpsTest, RopeInvFreqLlama3KnownValues) {
  // Llama-3.1: theta 500000, factor 8, low 1, high 4, original 8192, hd 128.
  RopeLlama3Scaling s;
  std::vector<float> f(64), plain(64);
  ref::RopeInvFreq(f.data(), 128, 500000.0, &s);
  ref::RopeInvFreq(plain.data(), 128, 500000.0);
  EXPECT_FLOAT_EQ(f[0], 1.0f);             // high frequency: unchanged
  EXPECT_FLOAT_EQ(f[63], plain[63] / 8);   // low frequency: divided by factor
  // Medium frequencies (wavelength between 2048 and 8192: i = 29..35) are
  // smoothed strictly between the two.
  EXPECT_GT(f[32], plain[32] / 8);
  EXPECT_LT(f[32], plain[32]);
}

TEST(OpsTest, SiluMulMatchesReference) {
  for (int m : kRows) {
    for (int n : kDims) {
      const size_t total = static_cast<size_t>(m) * n;
      const auto g = Random(total, 41 + m * n, -8.0f, 8.0f);
      const auto u = Random(total, 42 + m * n);
      std::vector<float> want(total);
      ref::SiluMul(g.data(), u.data(), want.data(), m, n);
      Guarded got(total);
      cpu::SiluMul(g.data(), u.data(), got.data(), m, n);
      ASSERT_TRUE(got.GuardsIntact());
      EXPECT_CLEAN(Compare(got.data(), want.data(), total, kSiluTol, kSiluFloor), "m=" << m);
      // In place on gate gives the same bits.
      auto inplace = g;
      cpu::SiluMul(inplace.data(), u.data(), inplace.data(), m, n);
      EXPECT_TRUE(BitEqual(inplace.data(), got.data(), total));
    }
  }
}

TEST(OpsTest, SoftmaxAndLogSoftmaxMatchReference) {
  cpu::ThreadPool two(2);
  for (int m : {1, 3, 8}) {
    for (int n : {1, 2, 17, 256, 4096, 32000}) {
      const size_t total = static_cast<size_t>(m) * n;
      const auto x = Random(total, 51 + n, -20.0f, 20.0f);
      std::vector<float> want(total), want_log(total);
      ref::Softmax(x.data(), want.data(), m, n);
      ref::LogSoftmax(x.data(), want_log.data(), m, n);
      Guarded got(total), got_log(total);
      cpu::Softmax(x.data(), got.data(), m, n, &two);
      cpu::LogSoftmax(x.data(), got_log.data(), m, n);
      ASSERT_TRUE(got.GuardsIntact() && got_log.GuardsIntact());
      EXPECT_CLEAN(Compare(got.data(), want.data(), total, kSoftmaxTol, kSoftmaxFloor), "n=" << n);
      EXPECT_CLEAN(Compare(got_log.data(), want_log.data(), total, kLogSoftmaxTol,
                           kLogSoftmaxFloor), "n=" << n);
      // Last row alone: same bits.
      std::vector<float> one(static_cast<size_t>(n));
      cpu::LogSoftmax(x.data() + total - n, one.data(), 1, n);
      EXPECT_TRUE(BitEqual(one.data(), got_log.data() + total - n, n));
    }
  }
}

TEST(OpsTest, ArgmaxMatchesReferenceTiesAndNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> logits = {1, 3, 3, 2,           // tie: lowest index (1)
                               nan, -1, nan, -0.5f,  // NaN skipped (3)
                               nan, nan, nan, nan,   // all NaN: 0
                               -5, -4, -3, -2};
  std::vector<int32_t> want(4), got(4);
  ref::Argmax(logits.data(), want.data(), 4, 4);
  cpu::Argmax(logits.data(), got.data(), 4, 4);
  EXPECT_EQ(want, (std::vector<int32_t>{1, 3, 0, 3}));
  EXPECT_EQ(got, want);
  for (int n : {1, 100, 32000}) {
    const auto x = Random(static_cast<size_t>(5) * n, 61 + n);
    std::vector<int32_t> a(5), b(5);
    ref::Argmax(x.data(), a.data(), 5, n);
    cpu::Argmax(x.data(), b.data(), 5, n);
    EXPECT_EQ(a, b);
  }
}

// The AVX-512, AVX2 and portable bodies give the same bits.
TEST(OpsTest, EveryIsaGivesTheSameBits) {
  const cpu::Isa saved = cpu::ActiveIsa();
  const int m = 3, d = 777;
  const size_t n = static_cast<size_t>(m) * d;
  const auto x = Random(n, 71, -10.0f, 10.0f);
  const auto y = Random(n, 72);
  const auto w = Random(d, 73);
  std::vector<std::vector<float>> first;
  for (cpu::Isa isa : {cpu::Isa::kPortable, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    cpu::SetIsa(isa);
    if (cpu::ActiveIsa() != isa) continue;
    std::vector<std::vector<float>> outs(5, std::vector<float>(n));
    cpu::RmsNorm(x.data(), w.data(), 1e-5f, outs[0].data(), m, d);
    outs[1] = x;
    cpu::AddRmsNorm(outs[1].data(), y.data(), w.data(), 1e-5f, outs[2].data(), m, d);
    cpu::SiluMul(x.data(), y.data(), outs[3].data(), m, d);
    cpu::Softmax(x.data(), outs[4].data(), m, d);
    if (first.empty()) {
      first = outs;
      continue;
    }
    for (size_t o = 0; o < outs.size(); ++o) {
      EXPECT_TRUE(BitEqual(first[o].data(), outs[o].data(), n)) << "output " << o << " "
                                                                 << cpu::IsaName(isa);
    }
  }
  cpu::SetIsa(saved);
}

}  // namespace
}  // namespace tandem::kernels
