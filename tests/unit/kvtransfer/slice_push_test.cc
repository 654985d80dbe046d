// One rank's part of a KV push between different layouts (slice_push.h),
// over real UCX transports in one process: every prefill rank's pool holds
// rank-local blocks with every float tagged (block, layer, kv, head, token,
// dim); after every prefill rank pushed its slices, every decode rank's
// pool must hold exactly its rank-local blocks in the reserved slots, and
// nothing elsewhere.
#include "kvtransfer/slice_push.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>

#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using parallel::KvDims;
using parallel::ParallelLayout;
using parallel::RankKvShapeOf;

constexpr KvDims kKjv{.num_layers = 5, .num_kv_heads = 2, .head_dim = 32, .block_size = 16};
constexpr KvDims kTinyLlama{.num_layers = 2, .num_kv_heads = 1, .head_dim = 32, .block_size = 16};
constexpr uint32_t kPoolBlocks = 8;

float Tag(const KvDims& d, uint32_t block, uint32_t layer, uint32_t kv, uint32_t head,
          uint32_t token, uint32_t dim) {
  const uint32_t per_block = d.num_layers * 2 * d.num_kv_heads * d.block_size * d.head_dim;
  const uint32_t t =
      (((layer * 2 + kv) * d.num_kv_heads + head) * d.block_size + token) * d.head_dim + dim;
  return static_cast<float>(block * per_block + t + 1);
}

// Rank `rank`'s block holding prompt block `block` (tags), or zeros.
void FillRankBlock(const ParallelLayout& l, const KvDims& d, uint32_t rank, uint32_t block,
                   float* out) {
  const auto s = RankKvShapeOf(l, d, rank);
  size_t i = 0;
  for (uint32_t layer = s.layers.begin; layer < s.layers.end; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t head = s.kv_heads.begin; head < s.kv_heads.end; ++head) {
        for (uint32_t t = 0; t < d.block_size; ++t) {
          for (uint32_t dim = 0; dim < d.head_dim; ++dim)
            out[i++] = Tag(d, block, layer, kv, head, t, dim);
        }
      }
    }
  }
}

std::unique_ptr<Transport> MakeRank(const std::string& name, uint64_t block_bytes) {
  TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = kPoolBlocks;
  o.peer_timeout_s = 1.5;
  auto t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

struct Fleet {
  std::vector<std::unique_ptr<Transport>> prefill, decode;
};

Fleet MakeFleet(const ParallelLayout& p, const ParallelLayout& d, const KvDims& dims,
                const std::string& tag) {
  Fleet f;
  for (uint32_t r = 0; r < p.world(); ++r) {
    f.prefill.push_back(
        MakeRank(fmt::format("sp-{}-p{}", tag, r), RankKvShapeOf(p, dims, r).block_bytes()));
  }
  for (uint32_t r = 0; r < d.world(); ++r) {
    f.decode.push_back(
        MakeRank(fmt::format("sp-{}-d{}", tag, r), RankKvShapeOf(d, dims, r).block_bytes()));
    if (f.decode.back()) std::memset(f.decode.back()->pool(), 0, f.decode.back()->pool_bytes());
  }
  return f;
}

// Pushes blocks (block_ids -> slots, first `cached` skipped) from every
// prefill rank (concurrently, as separate rank processes would) and checks
// every decode rank's whole pool.
void PushAndCheck(const ParallelLayout& p, const ParallelLayout& d, const KvDims& dims) {
  const std::string name = fmt::format("{}to{}l{}h{}", parallel::ToString(p), parallel::ToString(d),
                                       dims.num_layers, dims.num_kv_heads);
  SCOPED_TRACE(name);
  Fleet f = MakeFleet(p, d, dims, name);
  for (const auto& t : f.prefill) ASSERT_NE(t, nullptr);
  for (const auto& t : f.decode) ASSERT_NE(t, nullptr);
  SlicePushSpec spec;
  spec.request_id = "req-" + name;
  spec.prefill = p;
  spec.decode = d;
  spec.dims = dims;
  spec.block_ids = {3, 1, 4, 5};  // prompt blocks 0..3 in the prefiller's pools
  spec.slots = {6, 2, 3, 7};      // ... and at the decoder
  spec.cached_blocks = 1;         // the decoder already holds block 0
  for (const auto& t : f.decode) spec.decode_descriptors.push_back(t->LocalDescriptor());
  for (uint32_t r = 0; r < p.world(); ++r) {
    for (uint32_t b = 0; b < spec.block_ids.size(); ++b) {
      FillRankBlock(p, dims, r, b,
                    reinterpret_cast<float*>(f.prefill[r]->block(spec.block_ids[b])));
    }
  }
  // The spec travels to follower ranks encoded.
  auto decoded = SlicePushSpec::Decode(spec.Encode());
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();

  std::vector<RankSlicePusher::Outcome> outcomes(p.world());
  {
    std::vector<std::unique_ptr<RankSlicePusher>> pushers;
    std::vector<std::jthread> threads;
    for (uint32_t r = 0; r < p.world(); ++r) {
      pushers.push_back(std::make_unique<RankSlicePusher>(*f.prefill[r], r));
    }
    for (uint32_t r = 0; r < p.world(); ++r) {
      threads.emplace_back([&, r] { outcomes[r] = pushers[r]->PushAndWait(*decoded); });
    }
  }
  uint64_t total = 0;
  for (uint32_t r = 0; r < p.world(); ++r) {
    EXPECT_TRUE(outcomes[r].status.ok())
        << "prefill rank " << r << ": " << outcomes[r].status.ToString();
    total += outcomes[r].bytes;
  }
  uint64_t expect_total = 0;
  for (uint32_t r = 0; r < d.world(); ++r) {
    expect_total += 3 * RankKvShapeOf(d, dims, r).block_bytes();
  }
  EXPECT_EQ(total, expect_total) << "every decode rank's pushed blocks, each byte sent once";

  for (uint32_t r = 0; r < d.world(); ++r) {
    Transport& t = *f.decode[r];
    const size_t floats = t.block_bytes() / sizeof(float);
    std::vector<float> expect(floats);
    for (uint32_t slot = 0; slot < kPoolBlocks; ++slot) {
      std::fill(expect.begin(), expect.end(), 0.0f);
      for (uint32_t b = spec.cached_blocks; b < spec.slots.size(); ++b) {
        if (spec.slots[b] == slot) FillRankBlock(d, dims, r, b, expect.data());
      }
      const float* got = reinterpret_cast<const float*>(t.block(slot));
      size_t wrong = 0;
      for (size_t i = 0; i < floats; ++i) wrong += got[i] != expect[i];
      EXPECT_EQ(wrong, 0u) << "decode rank " << r << " slot " << slot;
    }
  }
}

TEST(SlicePush, PrefillTp2IntoDecodeTp1) { PushAndCheck({2, 1}, {1, 1}, kKjv); }
TEST(SlicePush, PrefillTp1IntoDecodePp2) { PushAndCheck({1, 1}, {1, 2}, kKjv); }
TEST(SlicePush, PrefillPp2IntoDecodeTp2) { PushAndCheck({1, 2}, {2, 1}, kKjv); }
TEST(SlicePush, PrefillTp4IntoDecodeTp2ReplicatedHeads) { PushAndCheck({4, 1}, {2, 1}, kKjv); }
TEST(SlicePush, OneKvHeadReplicatedOnBothSides) { PushAndCheck({2, 1}, {2, 2}, kTinyLlama); }

TEST(SlicePush, SpecRoundTripsAndBadBytesAreRefusedNamingTheField) {
  SlicePushSpec s;
  s.request_id = "r1";
  s.prefill = {2, 1};
  s.decode = {1, 2};
  s.dims = kKjv;
  s.decode_descriptors = {"a", std::string("b\0c", 3)};
  s.block_ids = {1, 2};
  s.slots = {7, 8};
  s.cached_blocks = 1;
  const std::string bytes = s.Encode();
  auto d = SlicePushSpec::Decode(bytes);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->request_id, "r1");
  EXPECT_EQ(d->prefill, s.prefill);
  EXPECT_EQ(d->decode, s.decode);
  EXPECT_EQ(d->decode_descriptors, s.decode_descriptors);
  EXPECT_EQ(d->block_ids, s.block_ids);
  EXPECT_EQ(d->slots, s.slots);
  EXPECT_EQ(d->cached_blocks, 1u);
  EXPECT_EQ(d->dims.head_dim, 32u);

  auto cut = SlicePushSpec::Decode(bytes.substr(0, bytes.size() - 2));
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("truncated at cached_blocks"), std::string::npos)
      << cut.status().ToString();
  EXPECT_FALSE(SlicePushSpec::Decode("XXXX").ok());

  SlicePushSpec short_desc = s;
  short_desc.decode_descriptors.pop_back();
  auto v = SlicePushSpec::Decode(short_desc.Encode());
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("1 decode rank descriptors for decode layout tp1pp2"),
            std::string::npos)
      << v.status().ToString();
  SlicePushSpec bad_tp = s;
  bad_tp.prefill = {3, 1};
  EXPECT_FALSE(bad_tp.Validate().ok());
}

TEST(SlicePush, WrongPoolBlockSizeIsRefusedBeforeAnyWrite) {
  // A prefill rank whose pool was built for another layout (here: the
  // whole model's block instead of its TP=2 half) must not push.
  auto p = MakeRank("sp-wrong-p", RankKvShapeOf({1, 1}, kKjv, 0).block_bytes());
  auto dcd = MakeRank("sp-wrong-d", RankKvShapeOf({1, 1}, kKjv, 0).block_bytes());
  ASSERT_NE(p, nullptr);
  ASSERT_NE(dcd, nullptr);
  SlicePushSpec s;
  s.request_id = "r-wrong";
  s.prefill = {2, 1};
  s.decode = {1, 1};
  s.dims = kKjv;
  s.decode_descriptors = {dcd->LocalDescriptor()};
  s.block_ids = {0};
  s.slots = {0};
  RankSlicePusher pusher(*p, 0);
  auto out = pusher.PushAndWait(s);
  ASSERT_FALSE(out.status.ok());
  EXPECT_NE(out.status.message().find("pool's blocks are"), std::string::npos)
      << out.status.ToString();
  EXPECT_EQ(out.writes, 0u);
  EXPECT_EQ(p->stats().puts_posted, 0u);
}

TEST(SliceSegments, WholeRankBlocksIntoConsecutiveSlotsMerge) {
  parallel::KvRankPairPlan pair{.src_rank = 0, .dst_rank = 0, .runs = {{0, 0, 100}}};
  const uint32_t ids[] = {4, 5, 9};
  const uint32_t slots[] = {1, 2, 3};
  auto segs = SliceSegments(pair, ids, slots, 0, 100, 100);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].local_offset_bytes, 400u);
  EXPECT_EQ(segs[0].remote_offset_bytes, 100u);
  EXPECT_EQ(segs[0].length_bytes, 200u);
  EXPECT_EQ(segs[1].local_offset_bytes, 900u);
  EXPECT_EQ(segs[1].remote_offset_bytes, 300u);
}

}  // namespace
}  // namespace tandem::kvtransfer
