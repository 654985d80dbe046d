// CUDA paged attention against ref::PagedAttention on bf16-representable
// Q/K/V: head dims 64/128, GQA ratios 1/4/8, block sizes 16/32, contexts
// 1 .. 8192 (decode) and prefill chunks over cached prefixes, batches 1 .. 64
// (and head dims 16/32 for the small test models).
// Block tables are shuffled; every cache block no sequence owns holds NaN, so
// a read outside a block table or past a context shows up as NaN. Outputs
// are convex combinations of V rows in [-1, 1]: tolerance 1e-2 absolute
// (bf16 output rounding is <= 2^-9, bf16 probabilities in prefill add about
// as much). Zero mismatches allowed beyond it; no NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/reference/ops.h"
#include "tests/unit/kernels/cuda_test_util.h"

namespace tandem::kernels::cuda {
namespace {

using kernels::testing::Random;
using testing::DeviceBuffer;
using testing::ExpectClose;
using testing::ToBf16;

constexpr double kAttnTol = 1e-2, kAttnFloor = 1.0;
constexpr int kLayers = 2, kLayer = 1;

struct Seq {
  int q_start;  // cached prefix
  int q_len;    // new rows (1 for decode)
};

// One randomly filled paged cache shared by the sequences, in f32 (for the
// reference) and bf16 (for the kernel), and each sequence's block table.
struct Cache {
  int hd, kv_heads, bs, blocks;
  size_t block_elems;
  std::vector<float> pool;          // f32 copy, NaN in unowned blocks
  std::vector<uint16_t> pool_bf16;  // what the kernel reads
  std::vector<std::vector<int32_t>> tables;
  int max_blocks = 0;

  Cache(int hd_, int kv_heads_, int bs_, const std::vector<Seq>& seqs, uint32_t seed)
      : hd(hd_), kv_heads(kv_heads_), bs(bs_) {
    int owned = 0;
    for (const Seq& s : seqs) {
      const int n = (s.q_start + s.q_len + bs - 1) / bs;
      owned += n;
      max_blocks = std::max(max_blocks, n);
    }
    blocks = owned + 5;  // a few blocks nobody owns
    block_elems = KvBlockFloats(kLayers, kv_heads, hd, bs);
    pool = Random(block_elems * blocks, seed);
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed + 1));
    size_t next = 0;
    for (const Seq& s : seqs) {
      const int n = (s.q_start + s.q_len + bs - 1) / bs;
      tables.emplace_back(ids.begin() + next, ids.begin() + next + n);
      next += n;
    }
    for (size_t i = next; i < ids.size(); ++i) {
      std::fill_n(pool.begin() + ids[i] * block_elems, block_elems, std::nanf(""));
    }
    pool_bf16 = ToBf16(pool);
  }
  KvCacheView View() { return {pool.data(), block_elems, kLayers, kv_heads, hd, bs}; }
  std::vector<int32_t> PaddedTables() const {
    std::vector<int32_t> t(tables.size() * max_blocks, -1);
    for (size_t s = 0; s < tables.size(); ++s) std::copy(tables[s].begin(), tables[s].end(), t.begin() + s * max_blocks);
    return t;
  }
};

// Runs decode (every q_len == 1) or prefill attention on the GPU; returns
// [total rows][heads][hd] as bf16 bits, and expects guards intact.
std::vector<uint16_t> RunGpu(Cache& c, const std::vector<Seq>& seqs, int heads,
                             const std::vector<uint16_t>& q, bool decode, float scale) {
  const int hd = c.hd;
  int total = 0, max_q = 0, max_ctx = 0;
  for (const Seq& s : seqs) {
    total += s.q_len;
    max_q = std::max(max_q, s.q_len);
    max_ctx = std::max(max_ctx, s.q_start + s.q_len);
  }
  DeviceBuffer<uint16_t> dpool(c.pool_bf16.size()), dq(q.size()),
      dout(static_cast<size_t>(total) * heads * hd);
  const auto tables = c.PaddedTables();
  DeviceBuffer<int32_t> dtables(tables.size());
  dpool.Upload(c.pool_bf16);
  dq.Upload(q);
  dtables.Upload(tables);
  DeviceKvView view{reinterpret_cast<bf16*>(dpool.get()), c.block_elems, kLayers, c.kv_heads, hd, c.bs};
  if (decode) {
    std::vector<int32_t> ctx;
    for (const Seq& s : seqs) ctx.push_back(s.q_start + 1);
    DeviceBuffer<int32_t> dctx(ctx.size());
    dctx.Upload(ctx);
    const size_t ws = DecodeAttentionWorkspaceBytes(static_cast<int>(seqs.size()), heads, hd, max_ctx);
    DeviceBuffer<unsigned char> dws(std::max<size_t>(ws, 1));
    EXPECT_TRUE(PagedDecodeAttention(view, kLayer, reinterpret_cast<bf16*>(dq.get()),
                                     reinterpret_cast<bf16*>(dout.get()), dtables.get(), dctx.get(),
                                     static_cast<int>(seqs.size()), heads, heads * hd, c.max_blocks,
                                     max_ctx, scale, dws.get(), ws, nullptr)
                    .ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(dws.GuardsIntact());
  } else {
    std::vector<int32_t> starts, cu = {0};
    for (const Seq& s : seqs) {
      starts.push_back(s.q_start);
      cu.push_back(cu.back() + s.q_len);
    }
    DeviceBuffer<int32_t> dstarts(starts.size()), dcu(cu.size());
    dstarts.Upload(starts);
    dcu.Upload(cu);
    EXPECT_TRUE(PagedPrefillAttention(view, kLayer, reinterpret_cast<bf16*>(dq.get()),
                                      reinterpret_cast<bf16*>(dout.get()), dtables.get(),
                                      dstarts.get(), dcu.get(), static_cast<int>(seqs.size()), heads,
                                      heads * hd, c.max_blocks, max_q, scale, nullptr)
                    .ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  EXPECT_TRUE(dout.GuardsIntact());
  EXPECT_TRUE(dpool.GuardsIntact());
  return dout.Download();
}

void CheckCase(int hd, int group, int bs, const std::vector<Seq>& seqs, bool decode, uint32_t seed) {
  const int kv_heads = decode ? 2 : 1;
  const int heads = kv_heads * group;
  Cache c(hd, kv_heads, bs, seqs, seed);
  int total = 0;
  for (const Seq& s : seqs) total += s.q_len;
  // |q| up to 3: softmax weights far from uniform.
  std::vector<float> q = Random(static_cast<size_t>(total) * heads * hd, seed + 2, -3.0f, 3.0f);
  const auto qb = ToBf16(q);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<AttentionSeq> as;
  for (size_t s = 0; s < seqs.size(); ++s) as.push_back({c.tables[s].data(), seqs[s].q_start, seqs[s].q_len});
  std::vector<float> want(q.size());
  ref::PagedAttentionBatch(c.View(), kLayer, q.data(), want.data(), as.data(),
                           static_cast<int>(as.size()), heads, scale);
  const auto got = RunGpu(c, seqs, heads, qb, decode, scale);
  ExpectClose(got, want, kAttnTol, kAttnFloor,
              std::string(decode ? "decode" : "prefill") + " hd " + std::to_string(hd) + " group " +
                  std::to_string(group) + " bs " + std::to_string(bs) + " seqs " +
                  std::to_string(seqs.size()));
}

std::vector<Seq> DecodeBatch(int n, int max_ctx, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Seq> seqs;
  for (int i = 0; i < n; ++i) seqs.push_back({static_cast<int>(rng() % max_ctx), 1});
  return seqs;
}

class CudaAttention : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(CudaAttention, DecodeMatchesReference) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  const auto [hd, group, bs] = GetParam();
  // Split edges (512), one 8k context, a batch of 64 mixed lengths.
  CheckCase(hd, group, bs, {{0, 1}, {16, 1}, {510, 1}, {511, 1}, {512, 1}, {1023, 1}, {2049, 1}}, true, 20);
  CheckCase(hd, group, bs, {{8191, 1}}, true, 21);
  CheckCase(hd, group, bs, DecodeBatch(64, 1200, 22), true, 23);
}

TEST_P(CudaAttention, PrefillMatchesReference) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  const auto [hd, group, bs] = GetParam();
  CheckCase(hd, group, bs, {{0, 300}}, false, 30);                        // fresh prompt
  CheckCase(hd, group, bs, {{0, 64}, {100, 1}, {37, 129}, {5, 3}}, false, 31);  // mixed chunks
  CheckCase(hd, group, bs, {{8100, 92}}, false, 32);  // the tail of an 8k prompt
  std::mt19937 rng(33);
  std::vector<Seq> batch;
  for (int i = 0; i < 64; ++i) batch.push_back({static_cast<int>(rng() % 300), 1 + static_cast<int>(rng() % 40)});
  CheckCase(hd, group, bs, batch, false, 34);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention,
                         ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 4, 8),
                                            ::testing::Values(16, 32)),
                         [](const auto& info) {
                           return "hd" + std::to_string(std::get<0>(info.param)) + "_gqa" +
                                  std::to_string(std::get<1>(info.param)) + "_bs" +
                                  std::to_string(std::get<2>(info.param));
                         });

// The small head dims exist for the tiny test models (golden fixtures).
TEST(CudaAttentionSmallHeads, DecodeAndPrefillMatchReference) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  for (int hd : {16, 32}) {
    for (int group : {2, 4}) {
      CheckCase(hd, group, 16, {{0, 1}, {15, 1}, {600, 1}, {1100, 1}}, true, 35);
      CheckCase(hd, group, 16, {{0, 150}, {70, 1}, {30, 65}}, false, 36);
    }
  }
}

TEST(CudaAttentionLong, PrefillOf1024FreshTokens) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  CheckCase(128, 8, 16, {{0, 1024}}, false, 40);
}

// A sequence's decode output bits do not depend on the rest of the batch.
TEST(CudaAttentionInvariance, DecodeRowBitsDoNotDependOnTheBatch) {
  TANDEM_REQUIRE_CUDA_DEVICE();
  const int hd = 128, group = 4, bs = 16, heads = 2 * group;
  std::vector<Seq> batch = DecodeBatch(32, 3000, 50);
  batch[5] = {2500, 1};
  Cache c(hd, 2, bs, batch, 51);
  std::vector<float> q = Random(batch.size() * heads * hd, 52, -3.0f, 3.0f);
  const auto qb = ToBf16(q);
  const float scale = 1.0f / std::sqrt(128.0f);
  const auto all = RunGpu(c, batch, heads, qb, true, scale);
  // Sequence 5 alone: its own table and query.
  Cache one = c;
  one.tables = {c.tables[5]};
  one.max_blocks = static_cast<int>(c.tables[5].size());
  const std::vector<uint16_t> q5(qb.begin() + 5 * heads * hd, qb.begin() + 6 * heads * hd);
  const auto alone = RunGpu(one, {batch[5]}, heads, q5, true, scale);
  EXPECT_EQ(alone, std::vector<uint16_t>(all.begin() + 5 * heads * hd, all.begin() + 6 * heads * hd));
}

TEST(CudaAttentionArgs, UnsupportedShapesAreRefused) {
  DeviceKvView view{reinterpret_cast<bf16*>(uintptr_t{256}), 96 * 2 * 2 * 16, 1, 2, 96, 16};
  EXPECT_EQ(PagedDecodeAttention(view, 0, nullptr, nullptr, nullptr, nullptr, 1, 4, 4 * 96, 1, 16,
                                 1.0f, nullptr, 0, nullptr)
                .code,
            KernelCode::kUnsupported);
  view.head_dim = 64;
  EXPECT_EQ(PagedPrefillAttention(view, 0, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 3,
                                  3 * 64, 1, 16, 1.0f, nullptr)
                .code,
            KernelCode::kInvalidArgument)
      << "heads not a multiple of kv_heads";
  EXPECT_EQ(PagedDecodeAttention(view, 0, nullptr, nullptr, nullptr, nullptr, 1, 4, 4 * 64, 1,
                                 1000, 1.0f, nullptr, 0, nullptr)
                .code,
            KernelCode::kInvalidArgument)
      << "1000 tokens need more than one block of 16";
}

}  // namespace
}  // namespace tandem::kernels::cuda
