// Paged KV writes and causal GQA attention: optimized vs reference over a
// sweep (head dims 32/64/128, GQA 1/2/4, block sizes 16/32, contexts 1..600),
// and bit-for-bit invariance of a query's output between a full prefill,
// chunked prefills, decode steps, batches of sequences and thread counts.
// Every cache slot not written holds NaN, so a read outside the causal window
// or the block table shows up as a NaN in the output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/reference/ops.h"
#include "tests/unit/kernels/test_util.h"

namespace tandem::kernels {
namespace {

// The scores kernel sums 16 keys' dot products together (Reduce16); each
// lane must carry Reduce's exact bits, or decode and prefill rows computed
// through different paths (whole groups of 16 vs a tail) would differ.
TEST(SimdReduceTest, Reduce16IsReduceBitForBitPerLane) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-30.0f, 30.0f);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int round = 0; round < 2000; ++round) {
    cpu::internal::V16 v[16];
    for (auto& x : v) {
      for (int l = 0; l < 16; ++l) x[l] = u(rng) * std::exp2(mag(rng));  // wide range: rounding matters
    }
    const cpu::internal::V16 r = cpu::internal::Reduce16(v);
    for (int k = 0; k < 16; ++k) {
      const float want = cpu::internal::Reduce(v[k]);
      ASSERT_EQ(std::memcmp(&r[k], &want, sizeof(float)), 0)
          << "round " << round << " lane " << k << ": " << r[k] << " vs " << want;
    }
  }
}

using testing::BitEqual;
using testing::Compare;
using testing::Guarded;
using testing::Random;

// Outputs are convex combinations of V rows in [-1, 1]: absolute tolerance.
constexpr double kAttnTol = 2e-6, kAttnFloor = 1.0;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A pool of NaN-filled blocks (with padding between blocks), two layers; the
// tested layer is 1 so that layer strides matter.
struct Cache {
  Cache(int kv_heads, int head_dim, int block_size, int num_blocks)
      : pool(static_cast<size_t>(num_blocks) *
                 (KvBlockFloats(2, kv_heads, head_dim, block_size) + 16),
             kNaN) {
    view.pool = pool.data();
    view.block_stride = KvBlockFloats(2, kv_heads, head_dim, block_size) + 16;
    view.num_layers = 2;
    view.kv_heads = kv_heads;
    view.head_dim = head_dim;
    view.block_size = block_size;
  }
  std::vector<float> pool;
  KvCacheView view;
};

// A sequence's data: K, V for every position and a scattered block table.
struct Seq {
  Seq(int context, int kv_heads, int heads, int head_dim, int block_size, std::vector<int>& free,
      uint32_t seed)
      : k(Random(static_cast<size_t>(context) * kv_heads * head_dim, seed)),
        v(Random(static_cast<size_t>(context) * kv_heads * head_dim, seed + 1)),
        q(Random(static_cast<size_t>(context) * heads * head_dim, seed + 2, -3.0f, 3.0f)) {
    const int blocks = (context + block_size - 1) / block_size;
    for (int b = 0; b < blocks; ++b) {
      table.push_back(free.back());
      free.pop_back();
    }
    for (int p = 0; p < context; ++p) {
      slots.push_back(table[static_cast<size_t>(p / block_size)] * block_size + p % block_size);
    }
  }
  std::vector<float> k, v, q;
  std::vector<int32_t> table, slots;
};

std::vector<int> ShuffledBlocks(int n, uint32_t seed) {
  std::vector<int> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
  return ids;
}

TEST(AttentionTest, WriteKvMatchesReferenceBytes) {
  for (int bs : {16, 32}) {
    Cache a(2, 64, bs, 12), b(2, 64, bs, 12);
    auto free = ShuffledBlocks(12, 5);
    Seq s(150, 2, 4, 64, bs, free, 9);
    ref::WriteKv(a.view, 1, s.k.data(), s.v.data(), s.slots.data(), 150);
    cpu::WriteKv(b.view, 1, s.k.data(), s.v.data(), s.slots.data(), 150);
    EXPECT_EQ(std::memcmp(a.pool.data(), b.pool.data(), a.pool.size() * 4), 0);
    // Spot-check the layout: [layer][K,V][kv_head][token][head_dim].
    const int p = 37, h = 1;
    const float* k_row = a.view.K(s.table[p / bs], 1, h, p % bs);
    EXPECT_EQ(std::memcmp(k_row, s.k.data() + (static_cast<size_t>(p) * 2 + h) * 64, 64 * 4), 0);
    const size_t plane = static_cast<size_t>(2) * bs * 64;
    EXPECT_EQ(k_row, a.pool.data() + s.table[p / bs] * a.view.block_stride + 2 * plane +
                         (static_cast<size_t>(h) * bs + p % bs) * 64);
    EXPECT_EQ(a.view.V(s.table[p / bs], 1, h, p % bs), k_row + plane);
  }
}

TEST(AttentionTest, MatchesReferenceOverSweep) {
  cpu::ThreadPool two(2);
  int cases = 0;
  double max_err = 0.0;
  for (int hd : {32, 64, 128}) {
    for (int gqa : {1, 2, 4}) {
      for (int bs : {16, 32}) {
        for (int context : {1, 2, 15, 16, 17, 33, 100, 257, 600}) {
          const int kvh = 2, heads = kvh * gqa;
          const int blocks = (context + bs - 1) / bs + 3;
          Cache cache(kvh, hd, bs, blocks);
          auto free = ShuffledBlocks(blocks, static_cast<uint32_t>(context));
          Seq s(context, kvh, heads, hd, bs, free, static_cast<uint32_t>(hd * 1000 + context));
          cpu::WriteKv(cache.view, 1, s.k.data(), s.v.data(), s.slots.data(), context);
          const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
          // The last few rows as one chunk, and the whole prompt when short.
          std::vector<int> starts = {std::max(0, context - 4)};
          if (context <= 64) starts.push_back(0);
          for (int q_start : starts) {
            const int t = context - q_start;
            const size_t n = static_cast<size_t>(t) * heads * hd;
            const float* q = s.q.data() + static_cast<size_t>(q_start) * heads * hd;
            std::vector<float> want(n);
            ref::PagedAttention(cache.view, 1, q, want.data(), s.table.data(), q_start, t, heads,
                                scale);
            Guarded got(n);
            cpu::PagedAttention(cache.view, 1, q, got.data(), s.table.data(), q_start, t, heads,
                                scale, (context % 2) ? &two : nullptr);
            ASSERT_TRUE(got.GuardsIntact());
            const auto st = Compare(got.data(), want.data(), n, kAttnTol, kAttnFloor);
            max_err = std::max(max_err, st.max_err);
            EXPECT_EQ(st.nans, 0u) << "hd=" << hd << " gqa=" << gqa << " bs=" << bs
                                   << " ctx=" << context << " " << st.first;
            EXPECT_EQ(st.mismatches, 0u) << "hd=" << hd << " gqa=" << gqa << " bs=" << bs
                                         << " ctx=" << context << " " << st.first
                                         << " max err " << st.max_err;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 100);
  std::printf("attention: %d cases, max normalized error %.3g (tolerance %.3g)\n", cases, max_err,
              kAttnTol);
}

// The AVX-512, AVX2 and portable paths give the same bits.
TEST(AttentionTest, EveryIsaGivesTheSameBits) {
  const cpu::Isa saved = cpu::ActiveIsa();
  for (int hd : {32, 48, 64, 128}) {  // 48: not a multiple of 16 (generic path)
    const int kvh = 2, heads = 8, bs = 16, context = 300;
    const int blocks = (context + bs - 1) / bs;
    Cache cache(kvh, hd, bs, blocks);
    auto free = ShuffledBlocks(blocks, 4);
    Seq s(context, kvh, heads, hd, bs, free, 99);
    cpu::WriteKv(cache.view, 1, s.k.data(), s.v.data(), s.slots.data(), context);
    const size_t n = static_cast<size_t>(context) * heads * hd;
    std::vector<float> first;
    for (cpu::Isa isa : {cpu::Isa::kPortable, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
      cpu::SetIsa(isa);
      if (cpu::ActiveIsa() != isa) continue;
      std::vector<float> out(n);
      cpu::PagedAttention(cache.view, 1, s.q.data(), out.data(), s.table.data(), 0, context, heads,
                          0.2f);
      if (first.empty()) {
        first = out;
      } else {
        EXPECT_TRUE(BitEqual(first.data(), out.data(), n)) << "hd=" << hd << " " << cpu::IsaName(isa);
      }
    }
  }
  cpu::SetIsa(saved);
}

// The output rows of a full prefill, of prefills chunked at several sizes
// (KV written chunk by chunk, later slots still NaN), and of decode steps
// (chunk size 1) are bit-identical, with 1 or 2 threads.
void CheckChunkInvariance(int hd, int gqa, int bs, int context) {
  const int kvh = 2, heads = kvh * gqa;
  const int blocks = (context + bs - 1) / bs + 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto free = ShuffledBlocks(blocks, 3);
  Seq s(context, kvh, heads, hd, bs, free, 1234);
  const size_t row = static_cast<size_t>(heads) * hd;

  Cache full_cache(kvh, hd, bs, blocks);
  cpu::WriteKv(full_cache.view, 1, s.k.data(), s.v.data(), s.slots.data(), context);
  std::vector<float> full(static_cast<size_t>(context) * row);
  cpu::PagedAttention(full_cache.view, 1, s.q.data(), full.data(), s.table.data(), 0, context,
                      heads, scale);
  for (size_t i = 0; i < full.size(); ++i) ASSERT_TRUE(std::isfinite(full[i]));

  cpu::ThreadPool two(2);
  for (int chunk : {1, 7, 64, 100, 256}) {
    for (cpu::ThreadPool* pool : {static_cast<cpu::ThreadPool*>(nullptr), &two}) {
      Cache cache(kvh, hd, bs, blocks);
      Guarded out(static_cast<size_t>(context) * row);
      for (int start = 0; start < context; start += chunk) {
        const int t = std::min(chunk, context - start);
        cpu::WriteKv(cache.view, 1, s.k.data() + static_cast<size_t>(start) * kvh * hd,
                     s.v.data() + static_cast<size_t>(start) * kvh * hd,
                     s.slots.data() + start, t);
        cpu::PagedAttention(cache.view, 1, s.q.data() + start * row, out.data() + start * row,
                            s.table.data(), start, t, heads, scale, pool);
      }
      ASSERT_TRUE(out.GuardsIntact());
      int bad = 0;
      for (int p = 0; p < context; ++p) {
        if (!BitEqual(out.data() + p * row, full.data() + p * row, row)) ++bad;
      }
      EXPECT_EQ(bad, 0) << "hd=" << hd << " gqa=" << gqa << " bs=" << bs << " chunk=" << chunk
                        << " threads=" << (pool ? 2 : 1);
    }
  }
}

TEST(AttentionTest, ChunkAndDecodeInvariantHd64Gqa4) { CheckChunkInvariance(64, 4, 16, 600); }
TEST(AttentionTest, ChunkAndDecodeInvariantHd128Gqa2) { CheckChunkInvariance(128, 2, 32, 333); }
TEST(AttentionTest, ChunkAndDecodeInvariantHd32Gqa1) { CheckChunkInvariance(32, 1, 16, 130); }

// A batch mixing decode steps and a prefill chunk of several sequences gives
// each row the bits it gets alone.
TEST(AttentionTest, BatchOfSequencesEqualsEachAlone) {
  const int hd = 64, kvh = 2, heads = 8, bs = 16, blocks = 80;
  const float scale = 0.125f;
  Cache cache(kvh, hd, bs, blocks);
  auto free = ShuffledBlocks(blocks, 8);
  const int contexts[] = {600, 150, 1, 77};
  std::vector<Seq> seqs;
  for (int i = 0; i < 4; ++i) {
    seqs.emplace_back(contexts[i], kvh, heads, hd, bs, free, 500 + i);
    cpu::WriteKv(cache.view, 1, seqs.back().k.data(), seqs.back().v.data(),
                 seqs.back().slots.data(), contexts[i]);
  }
  const size_t row = static_cast<size_t>(heads) * hd;
  // seq 0: decode at 599; seq 1: chunk 100..149; seq 2: decode at 0; seq 3: decode at 76.
  const AttentionSeq batch[] = {{seqs[0].table.data(), 599, 1},
                                {seqs[1].table.data(), 100, 50},
                                {seqs[2].table.data(), 0, 1},
                                {seqs[3].table.data(), 76, 1}};
  std::vector<float> q;
  for (int i = 0; i < 4; ++i) {
    const float* src = seqs[static_cast<size_t>(i)].q.data() + batch[i].q_start * row;
    q.insert(q.end(), src, src + batch[i].q_len * row);
  }
  const size_t rows = q.size() / row;
  cpu::ThreadPool two(2);
  Guarded got(q.size());
  cpu::PagedAttentionBatch(cache.view, 1, q.data(), got.data(), batch, 4, heads, scale, &two);
  ASSERT_TRUE(got.GuardsIntact());
  std::vector<float> want(q.size());
  ref::PagedAttentionBatch(cache.view, 1, q.data(), want.data(), batch, 4, heads, scale);
  const auto st = Compare(got.data(), want.data(), q.size(), kAttnTol, kAttnFloor);
  EXPECT_EQ(st.mismatches + st.nans, 0u) << st.first;
  size_t r = 0;
  for (int i = 0; i < 4; ++i) {
    std::vector<float> alone(batch[i].q_len * row);
    cpu::PagedAttention(cache.view, 1, q.data() + r * row, alone.data(), batch[i].block_table,
                        batch[i].q_start, batch[i].q_len, heads, scale);
    EXPECT_TRUE(BitEqual(alone.data(), got.data() + r * row, alone.size())) << "seq " << i;
    r += static_cast<size_t>(batch[i].q_len);
  }
  EXPECT_EQ(r, rows);
}

}  // namespace
}  // namespace tandem::kernels
