// The rank-group side of sliced KV pushes (slice_push_ranks.h) with real
// parts: ranks are threads joined by the shared-memory communicator, each
// with its own UCX transport. Decode ranks hand rank 0 their descriptors;
// prefill rank 0 sends its follower the spec (as the push_kv step plan
// would), pushes its own part and collects the follower's report.
#include "kvtransfer/slice_push_ranks.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using parallel::KvDims;
using parallel::ParallelLayout;
using parallel::RankKvShapeOf;

constexpr KvDims kKjv{.num_layers = 5, .num_kv_heads = 2, .head_dim = 32, .block_size = 16};

std::unique_ptr<Transport> MakeRank(const std::string& name, uint64_t block_bytes) {
  TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = 4;
  o.peer_timeout_s = 1.5;
  auto t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

std::unique_ptr<parallel::Communicator> Join(const std::string& group, int rank, int size) {
  auto c = parallel::CreateShmCommunicator(group, rank, size, 20000, 1 << 16);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

void Fill(const ParallelLayout& l, uint32_t r, uint32_t b, float* out) {
  const auto s = RankKvShapeOf(l, kKjv, r);
  size_t i = 0;
  for (uint32_t layer = s.layers.begin; layer < s.layers.end; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = s.kv_heads.begin; h < s.kv_heads.end; ++h) {
        for (uint32_t t = 0; t < kKjv.block_size * kKjv.head_dim; ++t) {
          out[i++] = static_cast<float>((((b * 5 + layer) * 2 + kv) * 2 + h) * 512 + t + 1);
        }
      }
    }
  }
}

// Rank 0 sends `bytes` to every rank (size first), as a push_kv plan would.
std::string BroadcastBytes(parallel::Communicator& c, std::string bytes) {
  std::byte len[8] = {};
  uint64_t n = bytes.size();
  std::memcpy(len, &n, 8);
  EXPECT_TRUE(c.Broadcast(len, 0).ok());
  std::memcpy(&n, len, 8);
  bytes.resize(n);
  EXPECT_TRUE(c.Broadcast({reinterpret_cast<std::byte*>(bytes.data()), n}, 0).ok());
  return bytes;
}

TEST(SlicePushRanks, DecodeRanksShareDescriptorsAndPrefillTp2PushesIntoDecodePp2) {
  const ParallelLayout p{2, 1}, d{1, 2};
  const std::string tag = fmt::format("{}", getpid());
  std::vector<std::unique_ptr<Transport>> decode(2), prefill(2);
  for (uint32_t r = 0; r < 2; ++r) {
    decode[r] =
        MakeRank(fmt::format("spr-d{}-{}", r, tag), RankKvShapeOf(d, kKjv, r).block_bytes());
    prefill[r] =
        MakeRank(fmt::format("spr-p{}-{}", r, tag), RankKvShapeOf(p, kKjv, r).block_bytes());
    ASSERT_NE(decode[r], nullptr);
    ASSERT_NE(prefill[r], nullptr);
    std::memset(decode[r]->pool(), 0, decode[r]->pool_bytes());
  }
  const std::vector<uint32_t> blocks = {3, 1}, slots = {2, 0};
  for (uint32_t r = 0; r < 2; ++r) {
    for (uint32_t b = 0; b < 2; ++b)
      Fill(p, r, b, reinterpret_cast<float*>(prefill[r]->block(blocks[b])));
  }

  // Decoder start-up: rank 0 learns every rank's descriptor.
  std::vector<std::string> descriptors;
  {
    std::jthread follower([&] {
      auto c = Join("tkvr-desc-" + tag, 1, 2);
      ASSERT_NE(c, nullptr);
      auto got = ExchangeRankDescriptors(*c, decode[1]->LocalDescriptor());
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_TRUE(got->empty());
    });
    auto c = Join("tkvr-desc-" + tag, 0, 2);
    ASSERT_NE(c, nullptr);
    auto got = ExchangeRankDescriptors(*c, decode[0]->LocalDescriptor());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    descriptors = *got;
  }
  ASSERT_EQ(descriptors.size(), 2u);
  EXPECT_EQ(descriptors[0], decode[0]->LocalDescriptor());
  EXPECT_EQ(descriptors[1], decode[1]->LocalDescriptor());

  // The push: rank 0 broadcasts the spec, both push, rank 0 collects.
  SlicePushSpec spec;
  spec.request_id = "spr";
  spec.prefill = p;
  spec.decode = d;
  spec.dims = kKjv;
  spec.decode_descriptors = descriptors;
  spec.block_ids = blocks;
  spec.slots = slots;
  RankSlicePusher p0(*prefill[0], 0), p1(*prefill[1], 1);
  RankSlicePusher::Outcome own, followers;
  std::mutex own_mu;
  std::condition_variable own_cv;
  bool own_done = false;
  {
    std::jthread follower([&] {
      auto c = Join("tkvr-push-" + tag, 1, 2);
      ASSERT_NE(c, nullptr);
      const std::string bytes = BroadcastBytes(*c, "");
      EXPECT_TRUE(
          RunFollowerPush({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}, p1, *c)
              .ok());
    });
    auto c = Join("tkvr-push-" + tag, 0, 2);
    ASSERT_NE(c, nullptr);
    // As PrefillerOptions::follower_push does it (PushStream posts rank
    // 0's own part first).
    std::vector<XferId> mine = p0.Push(spec, [&](RankSlicePusher::Outcome o) {
      std::lock_guard lock(own_mu);
      own = o;
      own_done = true;
      own_cv.notify_all();
    });
    EXPECT_EQ(mine.size(), 2u);
    followers = PushThroughFollowers(
        spec,
        [&](std::string bytes) {
          BroadcastBytes(*c, std::move(bytes));
          return Status::Ok();
        },
        *c);
    std::unique_lock lock(own_mu);
    own_cv.wait(lock, [&] { return own_done; });
  }
  EXPECT_TRUE(own.status.ok()) << own.status.ToString();
  EXPECT_TRUE(followers.status.ok()) << followers.status.ToString();
  EXPECT_EQ(own.writes, 2u);        // rank 0 feeds both decode stages
  EXPECT_EQ(followers.writes, 2u);  // ... and so does rank 1
  EXPECT_EQ(own.bytes + followers.bytes, 2 * (decode[0]->block_bytes() + decode[1]->block_bytes()));
  for (uint32_t r = 0; r < 2; ++r) {
    std::vector<float> expect(decode[r]->block_bytes() / sizeof(float));
    for (uint32_t b = 0; b < 2; ++b) {
      Fill(d, r, b, expect.data());
      EXPECT_EQ(std::memcmp(decode[r]->block(slots[b]), expect.data(), decode[r]->block_bytes()), 0)
          << "decode rank " << r << " prompt block " << b;
    }
  }
}

TEST(SlicePushRanks, AFollowerThatCannotReadTheSpecReportsItAndRankZeroNamesTheRank) {
  const std::string tag = fmt::format("{}", getpid());
  auto t1 = MakeRank("spr-bad-" + tag, 4096);
  ASSERT_NE(t1, nullptr);
  RankSlicePusher p1(*t1, 1);
  RankSlicePusher::Outcome got;
  {
    std::jthread follower([&] {
      auto c = Join("tkvr-bad-" + tag, 1, 2);
      ASSERT_NE(c, nullptr);
      const std::string junk = "not a spec";
      EXPECT_TRUE(
          RunFollowerPush({reinterpret_cast<const std::byte*>(junk.data()), junk.size()}, p1, *c)
              .ok());
    });
    auto c = Join("tkvr-bad-" + tag, 0, 2);
    ASSERT_NE(c, nullptr);
    got = CollectPushReports(*c);
  }
  ASSERT_FALSE(got.status.ok());
  EXPECT_EQ(got.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(got.status.message().find("prefill rank 1"), std::string::npos)
      << got.status.ToString();
  EXPECT_NE(got.status.message().find("bad magic"), std::string::npos) << got.status.ToString();
}

TEST(SlicePushRanks, APlanThatCannotBeSentIsTheFailureAndNothingIsCollected) {
  const std::string tag = fmt::format("{}", getpid());
  auto c = Join("tkvr-solo-" + tag, 0, 1);
  ASSERT_NE(c, nullptr);
  SlicePushSpec spec;
  spec.request_id = "solo";
  auto out = PushThroughFollowers(
      spec, [](std::string) { return UnavailableError("rank 1 (pid 42) exited"); }, *c);
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), StatusCode::kUnavailable);
  EXPECT_NE(
      out.status.message().find("request 'solo': sending the follower ranks the KV push: rank 1"),
      std::string::npos)
      << out.status.ToString();
}

TEST(SlicePushRanks, ReportsRoundTripAndJunkIsRefused) {
  RankSlicePusher::Outcome o{
      .status = UnavailableError(std::string(5000, 'x')), .bytes = 123456789012ull, .writes = 3};
  auto back = DecodePushReport(EncodePushReport(o));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(back->status.message().size(), kPushReportBytes - 24);  // truncated to fit
  EXPECT_EQ(back->bytes, 123456789012ull);
  EXPECT_EQ(back->writes, 3u);
  auto ok = DecodePushReport(EncodePushReport({}));
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->status.ok());
  std::vector<std::byte> junk(kPushReportBytes, std::byte{7});
  EXPECT_FALSE(DecodePushReport(junk).ok());
  EXPECT_FALSE(DecodePushReport(std::span<const std::byte>(junk).first(10)).ok());
}

}  // namespace
}  // namespace tandem::kvtransfer
