// The KV side of a worker's follower ranks (worker/rank_kv.h) with real
// parts: UCX transports, the shared-memory communicator between thread
// ranks, the bundled model's KV geometry. A decode worker of PP=2 and a
// prefill worker of TP=2, each rank 1 a FollowerRankKv: decode rank 0
// learns both descriptors, prefill rank 0 pushes through its follower, and
// both decode pools hold exactly their slices.
#include "worker/rank_kv.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvtransfer/slice_push_ranks.h"

namespace tandem::worker {
namespace {

using parallel::ParallelLayout;
using parallel::RankKvShapeOf;

parallel::KvDims KjvDims() {
  auto c = model::LoadModelConfig(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? KvDimsOf(*c, 16) : parallel::KvDims{};
}

kvtransfer::TransportOptions Base(const std::string& name, uint32_t blocks) {
  kvtransfer::TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.num_blocks = blocks;
  o.peer_timeout_s = 1.5;
  return o;
}

std::unique_ptr<parallel::Communicator> Join(const std::string& group, int rank, int size) {
  auto c = parallel::CreateShmCommunicator(group, rank, size, 20000, 1 << 16);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

void Fill(const ParallelLayout& l, const parallel::KvDims& d, uint32_t r, uint32_t b, float* out) {
  const auto s = RankKvShapeOf(l, d, r);
  size_t i = 0;
  for (uint32_t layer = s.layers.begin; layer < s.layers.end; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = s.kv_heads.begin; h < s.kv_heads.end; ++h) {
        for (uint32_t t = 0; t < d.block_size * d.head_dim; ++t) {
          out[i++] = static_cast<float>((((b * 5 + layer) * 2 + kv) * 2 + h) * 512 + t + 1);
        }
      }
    }
  }
}

TEST(RankKv, MultiRankWorkersRefuseChecksumAndEncryptNamingTheKey) {
  TransportConfig t;  // checksum on by default
  EXPECT_TRUE(CheckTransportForLayout("prefill", {1, 1}, t).ok());
  Status s = CheckTransportForLayout("prefill", {2, 1}, t);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("transport.checksum is on, but prefill.tensor_parallel 2 x "
                             "prefill.pipeline_parallel 1"),
            std::string::npos)
      << s.ToString();
  t.encrypt = true;
  s = CheckTransportForLayout("decode", {1, 2}, t);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("set transport.encrypt: false"), std::string::npos) << s.ToString();
  t.encrypt = false;
  t.checksum = false;
  EXPECT_TRUE(CheckTransportForLayout("decode", {2, 2}, t).ok());
}

TEST(RankKv, FollowerPoolIsItsTransportsAndHoldsItsSliceOnly) {
  const auto dims = KjvDims();
  ASSERT_EQ(dims.num_layers, 5u);
  ASSERT_EQ(dims.num_kv_heads, 2u);
  auto kv = FollowerRankKv::Create(Base(fmt::format("rkv-pool-{}", getpid()), 6), {2, 1}, dims, 1);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  // Half the kv heads of every layer: 5 x 2 x 1 x 16 x 32 floats.
  EXPECT_EQ((*kv)->transport().block_bytes(), 5u * 2 * 1 * 16 * 32 * 4);
  EXPECT_EQ((*kv)->transport().agent_name(), fmt::format("rkv-pool-{}-rank1", getpid()));
  const engine::KvLayout local{
      .num_layers = 5, .num_kv_heads = 1, .head_dim = 32, .block_size = 16};
  auto pool = engine::KvPool::Create(local, 6, (*kv)->allocator());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ(reinterpret_cast<std::byte*>((*pool)->base()), (*kv)->transport().pool());
  // A pool of the whole model's blocks does not fit the rank's transport.
  const engine::KvLayout whole{
      .num_layers = 5, .num_kv_heads = 2, .head_dim = 32, .block_size = 16};
  auto kv2 =
      FollowerRankKv::Create(Base(fmt::format("rkv-pool2-{}", getpid()), 6), {2, 1}, dims, 1);
  ASSERT_TRUE(kv2.ok());
  EXPECT_FALSE(engine::KvPool::Create(whole, 6, (*kv2)->allocator()).ok());
  EXPECT_FALSE(FollowerRankKv::Create(Base("rkv-bad", 6), {2, 1}, dims, 0).ok());
  EXPECT_FALSE(FollowerRankKv::Create(Base("rkv-bad", 6), {3, 1}, dims, 1).ok());
}

TEST(RankKv, PrefillTp2FollowerPushesIntoDecodePp2WorkerThroughTheGroups) {
  const auto dims = KjvDims();
  const std::string tag = fmt::format("{}", getpid());
  const ParallelLayout p{2, 1}, d{1, 2};
  // Rank 0 of each worker: its transport as the worker creates it (rank 0's
  // slice); rank 1: a FollowerRankKv.
  auto rank0 = [&](const ParallelLayout& l, const std::string& name) {
    auto o = Base(name, 4);
    o.block_bytes = RankKvShapeOf(l, dims, 0).block_bytes();
    auto t = kvtransfer::CreateTransport(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  };
  auto d0 = rank0(d, "rkv-d-" + tag), p0 = rank0(p, "rkv-p-" + tag);
  auto d1 = FollowerRankKv::Create(Base("rkv-d-" + tag, 4), d, dims, 1);
  auto p1 = FollowerRankKv::Create(Base("rkv-p-" + tag, 4), p, dims, 1);
  ASSERT_TRUE(d0 && p0 && d1.ok() && p1.ok());
  std::memset(d0->pool(), 0, d0->pool_bytes());
  std::memset((*d1)->transport().pool(), 0, (*d1)->transport().pool_bytes());
  const std::vector<uint32_t> blocks = {1, 2, 3}, slots = {3, 0, 2};
  for (uint32_t b = 0; b < 3; ++b) {
    Fill(p, dims, 0, b, reinterpret_cast<float*>(p0->block(blocks[b])));
    Fill(p, dims, 1, b, reinterpret_cast<float*>((*p1)->transport().block(blocks[b])));
  }

  // The decoder's start-up.
  std::vector<std::string> descriptors;
  {
    std::jthread follower([&] {
      auto c = Join("trkv-d-" + tag, 1, 2);
      ASSERT_NE(c, nullptr);
      EXPECT_TRUE((*d1)->OnJoined(*c).ok());
    });
    auto c = Join("trkv-d-" + tag, 0, 2);
    ASSERT_NE(c, nullptr);
    auto got = kvtransfer::ExchangeRankDescriptors(*c, d0->LocalDescriptor());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    descriptors = *got;
  }
  ASSERT_EQ(descriptors.size(), 2u);

  kvtransfer::SlicePushSpec spec;
  spec.request_id = "rkv";
  spec.prefill = p;
  spec.decode = d;
  spec.dims = dims;
  spec.decode_descriptors = descriptors;
  spec.block_ids = blocks;
  spec.slots = slots;
  spec.cached_blocks = 1;  // the decoder already holds prompt block 0
  kvtransfer::RankSlicePusher own_pusher(*p0, 0);
  kvtransfer::RankSlicePusher::Outcome own, followers;
  std::mutex mu;
  std::condition_variable cv;
  bool own_done = false;
  {
    std::jthread follower([&] {
      auto c = Join("trkv-p-" + tag, 1, 2);
      ASSERT_NE(c, nullptr);
      std::byte len[8];
      ASSERT_TRUE(c->Broadcast(len, 0).ok());  // the push_kv plan (size, then bytes)
      uint64_t n = 0;
      std::memcpy(&n, len, 8);
      std::vector<std::byte> bytes(n);
      ASSERT_TRUE(c->Broadcast(bytes, 0).ok());
      EXPECT_TRUE((*p1)->OnPushKv(bytes, *c).ok());
    });
    auto c = Join("trkv-p-" + tag, 0, 2);
    ASSERT_NE(c, nullptr);
    own_pusher.Push(spec, [&](kvtransfer::RankSlicePusher::Outcome o) {
      std::lock_guard lock(mu);
      own = o;
      own_done = true;
      cv.notify_all();
    });
    followers = kvtransfer::PushThroughFollowers(
        spec,
        [&](std::string bytes) -> Status {
          std::byte len[8];
          const uint64_t n = bytes.size();
          std::memcpy(len, &n, 8);
          TANDEM_RETURN_IF_ERROR(c->Broadcast(len, 0));
          return c->Broadcast({reinterpret_cast<std::byte*>(bytes.data()), n}, 0);
        },
        *c);
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return own_done; });
  }
  EXPECT_TRUE(own.status.ok()) << own.status.ToString();
  EXPECT_TRUE(followers.status.ok()) << followers.status.ToString();
  kvtransfer::Transport* decode_rank[2] = {d0.get(), &(*d1)->transport()};
  for (uint32_t r = 0; r < 2; ++r) {
    std::vector<float> expect(decode_rank[r]->block_bytes() / sizeof(float));
    for (uint32_t b = 0; b < 3; ++b) {
      if (b < spec.cached_blocks) {
        std::fill(expect.begin(), expect.end(), 0.0f);  // cached: not written
      } else {
        Fill(d, dims, r, b, expect.data());
      }
      EXPECT_EQ(std::memcmp(decode_rank[r]->block(slots[b]), expect.data(),
                            decode_rank[r]->block_bytes()),
                0)
          << "decode rank " << r << " prompt block " << b;
    }
  }
}

}  // namespace
}  // namespace tandem::worker
