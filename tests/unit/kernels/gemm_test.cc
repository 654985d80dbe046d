// GEMM: optimized vs reference over a shape sweep, every instruction set
// bit-identical, and batch invariance bit for bit (rows across M, row
// positions and thread counts).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/reference/ops.h"
#include "tests/unit/kernels/test_util.h"

namespace tandem::kernels {
namespace {

using testing::BitEqual;
using testing::Guarded;
using testing::Random;

// Normalized error of one output: |cpu - ref| / (sum_k |x w| + |bias|). An
// f32 fma chain over k terms stays within a few ulps of that magnitude.
constexpr double kGemmTol = 2e-6;

const cpu::Isa kIsas[] = {cpu::Isa::kPortable, cpu::Isa::kAvx2, cpu::Isa::kAvx512};

class IsaGuard {
 public:
  IsaGuard() : saved_(cpu::ActiveIsa()) {}
  ~IsaGuard() { cpu::SetIsa(saved_); }

 private:
  cpu::Isa saved_;
};

TEST(GemmTest, MatchesReferenceOverShapeSweepOnEveryIsa) {
  IsaGuard guard;
  size_t shapes = 0;
  double max_err = 0.0;
  for (int m : {1, 2, 3, 5, 7, 8, 9, 16, 33}) {
    for (int n : {1, 15, 16, 17, 48, 100, 129}) {
      for (int k : {1, 7, 16, 64, 255, 256, 257, 600}) {
        const auto x = Random(static_cast<size_t>(m) * k, 1000 + m * 7 + k);
        const auto w = Random(static_cast<size_t>(n) * k, 2000 + n * 13 + k);
        const auto bias = Random(n, 3000 + n);
        const bool use_bias = (m + n + k) % 2 == 0;
        const float* b = use_bias ? bias.data() : nullptr;
        std::vector<float> want(static_cast<size_t>(m) * n);
        ref::Gemm(x.data(), w.data(), b, want.data(), m, n, k);
        // Scale of each output: sum_k |x w| + |bias|.
        std::vector<float> mag(static_cast<size_t>(m) * n);
        {
          std::vector<float> ax(x.size()), aw(w.size()), ab(bias.size());
          for (size_t i = 0; i < x.size(); ++i) ax[i] = std::fabs(x[i]);
          for (size_t i = 0; i < w.size(); ++i) aw[i] = std::fabs(w[i]);
          for (size_t i = 0; i < bias.size(); ++i) ab[i] = std::fabs(bias[i]);
          ref::Gemm(ax.data(), aw.data(), use_bias ? ab.data() : nullptr, mag.data(), m, n, k);
        }
        const cpu::PackedWeights packed = cpu::PackWeights(w.data(), n, k);
        std::vector<float> first;
        for (cpu::Isa isa : kIsas) {
          cpu::SetIsa(isa);
          if (cpu::ActiveIsa() != isa) continue;  // not on this CPU
          Guarded got(static_cast<size_t>(m) * n);
          cpu::Gemm(x.data(), packed, b, got.data(), m);
          ASSERT_TRUE(got.GuardsIntact()) << m << "x" << n << "x" << k;
          size_t bad = 0, nans = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            if (!std::isfinite(got[i])) ++nans;
            const double err = std::fabs(static_cast<double>(got[i]) - want[i]) /
                               std::max(static_cast<double>(mag[i]), 1e-30);
            max_err = std::max(max_err, err);
            if (err > kGemmTol) ++bad;
          }
          EXPECT_EQ(nans, 0u) << m << "x" << n << "x" << k << " " << cpu::IsaName(isa);
          EXPECT_EQ(bad, 0u) << m << "x" << n << "x" << k << " " << cpu::IsaName(isa);
          if (first.empty()) {
            first.assign(got.data(), got.data() + got.size());
          } else {
            EXPECT_TRUE(BitEqual(first.data(), got.data(), first.size()))
                << "ISA " << cpu::IsaName(isa) << " differs from portable at " << m << "x" << n
                << "x" << k;
          }
        }
        ++shapes;
      }
    }
  }
  EXPECT_EQ(shapes, 9u * 7u * 8u);
  std::printf("gemm: %zu shapes, max normalized error %.3g (tolerance %.3g)\n", shapes, max_err,
              kGemmTol);
}

TEST(GemmTest, UnpackedEqualsPacked) {
  const int m = 5, n = 37, k = 300;
  const auto x = Random(static_cast<size_t>(m) * k, 1);
  const auto w = Random(static_cast<size_t>(n) * k, 2);
  std::vector<float> a(static_cast<size_t>(m) * n), b(a.size());
  cpu::Gemm(x.data(), w.data(), nullptr, a.data(), m, n, k);
  const auto packed = cpu::PackWeights(w.data(), n, k);
  cpu::Gemm(x.data(), packed, nullptr, b.data(), m);
  EXPECT_TRUE(BitEqual(a.data(), b.data(), a.size()));
}

// A pack of 2 MiB or more is allocated on a 2 MiB boundary (advised for
// transparent huge pages, session 43) and holds the same weights: a decode
// (m < 4) and a prefill-shaped GEMM on it equal the unpacked GEMM's bits.
TEST(GemmTest, LargePackStartsOnA2MiBBoundaryAndEqualsUnpacked) {
  const int n = 1030, k = 1024;  // 65 panels x 1024 x 16 floats: 4.26 MB
  const auto w = Random(static_cast<size_t>(n) * k, 5);
  const auto packed = cpu::PackWeights(w.data(), n, k);
  ASSERT_GE(packed.bytes(), size_t{2} << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(packed.data()) % (uintptr_t{2} << 20), 0u);
  const auto small = cpu::PackWeights(w.data(), 17, 64);  // 8 KB: 64-byte aligned only
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 64, 0u);
  for (int m : {1, 3, 9}) {
    const auto x = Random(static_cast<size_t>(m) * k, 6 + m);
    std::vector<float> a(static_cast<size_t>(m) * n), b(a.size());
    cpu::Gemm(x.data(), w.data(), nullptr, a.data(), m, n, k);
    cpu::Gemm(x.data(), packed, nullptr, b.data(), m);
    EXPECT_TRUE(BitEqual(a.data(), b.data(), a.size())) << "m " << m;
  }
}

// The allocator of the packs, also the read probe's of `tandem bench
// engine`: from 2 MiB on a 2 MiB boundary, below on 64 bytes, writable to
// the last byte.
TEST(GemmTest, StreamedMemoryIsAlignedForItsSize) {
  for (size_t bytes :
       {size_t{1}, size_t{100}, (size_t{2} << 20) - 1, size_t{2} << 20, (size_t{5} << 20) + 8}) {
    auto* p = static_cast<unsigned char*>(cpu::AllocateStreamed(bytes));
    ASSERT_NE(p, nullptr) << bytes;
    const uintptr_t align = bytes >= (size_t{2} << 20) ? uintptr_t{2} << 20 : 64;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % align, 0u) << bytes;
    std::memset(p, 0xab, bytes);
    EXPECT_EQ(p[bytes - 1], 0xab) << bytes;
    std::free(p);
  }
}

TEST(GemmTest, NanInputPropagatesOnlyToItsRow) {
  const int m = 4, n = 20, k = 33;
  auto x = Random(static_cast<size_t>(m) * k, 3);
  const auto w = Random(static_cast<size_t>(n) * k, 4);
  x[2 * k + 5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> y(static_cast<size_t>(m) * n);
  cpu::Gemm(x.data(), w.data(), nullptr, y.data(), m, n, k);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      EXPECT_EQ(std::isnan(y[static_cast<size_t>(i) * n + j]), i == 2) << i << "," << j;
    }
  }
}

// Each row's bits must equal the M = 1 result for that row, for every M, at
// every row position, for 1 and 2 threads and every instruction set.
// The M = 1 reference bits come from the portable path when `with_portable`
// (slow: scalar fma calls), else from the best instruction set.
void CheckBatchInvariance(int n, int k, const std::vector<int>& ms, bool with_portable) {
  IsaGuard guard;
  const int max_m = 512 + 5;
  const auto x = Random(static_cast<size_t>(max_m) * k, 77 + n);
  const auto w = Random(static_cast<size_t>(n) * k, 78 + k);
  const auto bias = Random(n, 79);
  const auto packed = cpu::PackWeights(w.data(), n, k);
  cpu::SetIsa(with_portable ? cpu::Isa::kPortable : cpu::BestIsa());
  std::vector<float> single(static_cast<size_t>(max_m) * n);
  for (int i = 0; i < max_m; ++i) {
    cpu::Gemm(x.data() + static_cast<size_t>(i) * k, packed, bias.data(),
              single.data() + static_cast<size_t>(i) * n, 1);
  }
  cpu::ThreadPool two(2);
  for (cpu::Isa isa : kIsas) {
    if (isa == cpu::Isa::kPortable && !with_portable) continue;
    cpu::SetIsa(isa);
    if (cpu::ActiveIsa() != isa) continue;
    for (cpu::ThreadPool* pool : {static_cast<cpu::ThreadPool*>(nullptr), &two}) {
      for (int m : ms) {
        for (int start : {0, 5}) {  // shifts every row to another position
          if (start + m > max_m) continue;
          Guarded y(static_cast<size_t>(m) * n);
          cpu::Gemm(x.data() + static_cast<size_t>(start) * k, packed, bias.data(), y.data(), m,
                    pool);
          ASSERT_TRUE(y.GuardsIntact());
          int bad_rows = 0;
          for (int r = 0; r < m; ++r) {
            if (!BitEqual(y.data() + static_cast<size_t>(r) * n,
                          single.data() + static_cast<size_t>(start + r) * n, n)) {
              ++bad_rows;
            }
          }
          EXPECT_EQ(bad_rows, 0) << "n=" << n << " k=" << k << " M=" << m << " start=" << start
                                 << " threads=" << (pool ? 2 : 1) << " " << cpu::IsaName(isa);
        }
      }
    }
  }
}

TEST(GemmTest, BatchInvariantRaggedShape) { CheckBatchInvariance(100, 300, {1, 2, 7, 16, 33, 512}, true); }

TEST(GemmTest, BatchInvariantModelShapes) {
  // The bundled model's MLP (hidden 256 -> intermediate 688) and down proj.
  CheckBatchInvariance(688, 256, {1, 2, 7, 16, 33, 512}, false);
  CheckBatchInvariance(256, 688, {1, 2, 7, 16, 33, 512}, false);
}

// Matrices wide enough that every thread of 2, 3 and 4 gets three or more
// units (ParallelForStealing, gemm.cc ForPanels): 97 panels, the last
// ragged. Whichever thread runs a unit, Gemm and GemmSplitK give the bits
// of one thread, for decode and prefill row counts.
TEST(GemmTest, StolenPanelUnitsGiveTheBitsOfOneThread) {
  IsaGuard guard;
  const int n = 96 * 16 + 5, k = 72;
  ASSERT_GE(cpu::ThreadPool::StealingUnits((n + 15) / 16, 8), 3 * 4);
  const auto w = Random(static_cast<size_t>(n) * k, 901);
  const auto bias = Random(n, 902);
  const auto packed = cpu::PackWeights(w.data(), n, k);
  const int bounds[3] = {0, 40, k};
  for (cpu::Isa isa : kIsas) {
    cpu::SetIsa(isa);
    if (cpu::ActiveIsa() != isa) continue;
    for (int m : {1, 2, 3, 5, 8, 33}) {
      const auto x = Random(static_cast<size_t>(m) * k, 903 + m);
      std::vector<float> one(static_cast<size_t>(m) * n), one_split(one.size());
      std::vector<float> scratch(one.size());
      cpu::Gemm(x.data(), packed, bias.data(), one.data(), m);
      cpu::GemmSplitK(x.data(), packed, bounds, 2, one_split.data(), scratch.data(), m, nullptr);
      for (int threads : {2, 3, 4}) {
        cpu::ThreadPool pool(threads);
        for (int rep = 0; rep < 3; ++rep) {
          Guarded y(one.size()), ys(one.size());
          cpu::Gemm(x.data(), packed, bias.data(), y.data(), m, &pool);
          cpu::GemmSplitK(x.data(), packed, bounds, 2, ys.data(), scratch.data(), m, &pool);
          ASSERT_TRUE(y.GuardsIntact());
          ASSERT_TRUE(ys.GuardsIntact());
          EXPECT_TRUE(BitEqual(y.data(), one.data(), one.size()))
              << "Gemm m=" << m << " threads=" << threads << " " << cpu::IsaName(isa);
          EXPECT_TRUE(BitEqual(ys.data(), one_split.data(), one.size()))
              << "GemmSplitK m=" << m << " threads=" << threads << " " << cpu::IsaName(isa);
        }
      }
    }
  }
}

// GemmSplitK (tensor parallelism, issue 18): each shard's partial is the
// plain Gemm of that k range, and the shards add as the fixed tree — equal
// bits to doing it by hand, on every instruction set, for 1 and 2 threads and
// every M; and a rank holding half the k range (its two shards) gives the
// left or right half of the tree exactly.
TEST(GemmTest, SplitKIsTheFixedTreeOfShardGemms) {
  IsaGuard guard;
  const int n = 100, k = 172 * 4;  // the bundled model's down_proj shape (n 256 in the model)
  const int bounds[5] = {0, k / 4, k / 2, 3 * k / 4, k};
  cpu::ThreadPool two(2);
  for (int m : {1, 3, 8, 33}) {
    const auto x = Random(static_cast<size_t>(m) * k, 500 + m);
    const auto w = Random(static_cast<size_t>(n) * k, 600);
    // By hand: shard s = Gemm of x[:, ks..ke) and w[:, ks..ke).
    std::vector<std::vector<float>> part(4, std::vector<float>(static_cast<size_t>(m) * n));
    for (int s = 0; s < 4; ++s) {
      const int ks = bounds[s], kl = bounds[s + 1] - bounds[s];
      std::vector<float> xs(static_cast<size_t>(m) * kl), ws(static_cast<size_t>(n) * kl);
      for (int i = 0; i < m; ++i) {
        for (int c = 0; c < kl; ++c) xs[static_cast<size_t>(i) * kl + c] = x[static_cast<size_t>(i) * k + ks + c];
      }
      for (int j = 0; j < n; ++j) {
        for (int c = 0; c < kl; ++c) ws[static_cast<size_t>(j) * kl + c] = w[static_cast<size_t>(j) * k + ks + c];
      }
      cpu::Gemm(xs.data(), ws.data(), nullptr, part[s].data(), m, n, kl);
    }
    std::vector<float> want(static_cast<size_t>(m) * n), left(want.size()), right(want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      left[i] = part[0][i] + part[1][i];
      right[i] = part[2][i] + part[3][i];
      want[i] = left[i] + right[i];
    }
    const auto packed = cpu::PackWeights(w.data(), n, k);
    // The two halves as a tp = 2 rank packs them: columns [0, k/2) and [k/2, k).
    std::vector<float> wl(static_cast<size_t>(n) * k / 2), wr(wl.size());
    for (int j = 0; j < n; ++j) {
      for (int c = 0; c < k / 2; ++c) {
        wl[static_cast<size_t>(j) * k / 2 + c] = w[static_cast<size_t>(j) * k + c];
        wr[static_cast<size_t>(j) * k / 2 + c] = w[static_cast<size_t>(j) * k + k / 2 + c];
      }
    }
    const auto pl = cpu::PackWeights(wl.data(), n, k / 2), pr = cpu::PackWeights(wr.data(), n, k / 2);
    std::vector<float> xl(static_cast<size_t>(m) * k / 2), xr(xl.size());
    for (int i = 0; i < m; ++i) {
      for (int c = 0; c < k / 2; ++c) {
        xl[static_cast<size_t>(i) * k / 2 + c] = x[static_cast<size_t>(i) * k + c];
        xr[static_cast<size_t>(i) * k / 2 + c] = x[static_cast<size_t>(i) * k + k / 2 + c];
      }
    }
    const int half[3] = {0, k / 4, k / 2};
    for (cpu::Isa isa : kIsas) {
      cpu::SetIsa(isa);
      if (cpu::ActiveIsa() != isa) continue;
      for (cpu::ThreadPool* pool : {static_cast<cpu::ThreadPool*>(nullptr), &two}) {
        Guarded y(want.size());
        std::vector<float> scratch(3 * want.size());
        cpu::GemmSplitK(x.data(), packed, bounds, 4, y.data(), scratch.data(), m, pool);
        ASSERT_TRUE(y.GuardsIntact());
        EXPECT_TRUE(BitEqual(y.data(), want.data(), want.size()))
            << "m=" << m << " " << cpu::IsaName(isa) << " threads=" << (pool ? 2 : 1);
        Guarded yl(want.size()), yr(want.size());
        cpu::GemmSplitK(xl.data(), pl, half, 2, yl.data(), scratch.data(), m, pool);
        cpu::GemmSplitK(xr.data(), pr, half, 2, yr.data(), scratch.data(), m, pool);
        EXPECT_TRUE(BitEqual(yl.data(), left.data(), left.size())) << "m=" << m;
        EXPECT_TRUE(BitEqual(yr.data(), right.data(), right.size())) << "m=" << m;
        // One shard is Gemm itself.
        const int whole[2] = {0, k};
        Guarded y1(want.size());
        std::vector<float> plain(want.size());
        cpu::GemmSplitK(x.data(), packed, whole, 1, y1.data(), nullptr, m, pool);
        cpu::Gemm(x.data(), packed, nullptr, plain.data(), m, pool);
        EXPECT_TRUE(BitEqual(y1.data(), plain.data(), plain.size())) << "m=" << m;
      }
    }
  }
}

}  // namespace
}  // namespace tandem::kernels
