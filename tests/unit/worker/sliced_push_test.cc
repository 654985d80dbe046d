// PushStream's sliced mode (issue 18, push_stream.h PushPlan::Sliced) over
// real UCX transports in one process: prefill rank 0's part runs on its own
// transport, the follower ranks' parts through FollowerPushFn (here: a
// RankSlicePusher on the follower's own transport, called directly instead
// of through a push-KV step), and the one notice reaches decode rank 0 only
// after every rank's slices landed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvtransfer/slice_push.h"
#include "kvtransfer/transport.h"
#include "prefiller/push_stream.h"

namespace tandem::prefiller {
namespace {

namespace kv = kvtransfer;
using parallel::KvDims;
using parallel::ParallelLayout;
using parallel::RankKvShapeOf;

constexpr KvDims kKjv{.num_layers = 5, .num_kv_heads = 2, .head_dim = 32, .block_size = 16};

std::unique_ptr<kv::Transport> MakeRank(const std::string& name, uint64_t block_bytes) {
  kv::TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = 8;
  o.peer_timeout_s = 1.5;
  auto t = kv::CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// Every float of rank `r`'s block for prompt block `b`: (b, model layer,
// kv, model head, token, dim) packed (exact in f32).
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

class SlicedPushTest : public ::testing::Test {
 protected:
  void Build(ParallelLayout p, ParallelLayout d, const std::string& tag) {
    prefill_layout_ = p;
    decode_layout_ = d;
    for (uint32_t r = 0; r < p.world(); ++r) {
      prefill_.push_back(
          MakeRank(fmt::format("sliced-{}-p{}", tag, r), RankKvShapeOf(p, kKjv, r).block_bytes()));
      ASSERT_NE(prefill_.back(), nullptr);
      for (size_t b = 0; b < blocks_.size(); ++b) {
        Fill(p, r, static_cast<uint32_t>(b),
             reinterpret_cast<float*>(prefill_.back()->block(blocks_[b])));
      }
    }
    for (uint32_t r = 0; r < d.world(); ++r) {
      decode_.push_back(
          MakeRank(fmt::format("sliced-{}-d{}", tag, r), RankKvShapeOf(d, kKjv, r).block_bytes()));
      ASSERT_NE(decode_.back(), nullptr);
      std::memset(decode_.back()->pool(), 0, decode_.back()->pool_bytes());
    }
    decode_[0]->SetNotificationCallback([this](kv::Notification n) {
      const bool complete = AllLanded();
      std::lock_guard lock(mu_);
      notices_.push_back(n.payload);
      complete_at_notice_.push_back(complete);
      cv_.notify_all();
    });
    for (uint32_t r = 0; r < p.world(); ++r) {
      pushers_.push_back(std::make_unique<kv::RankSlicePusher>(*prefill_[r], r));
    }
  }

  // Every decode rank holds exactly its slices of the pushed blocks.
  bool AllLanded() {
    for (uint32_t r = 0; r < decode_layout_.world(); ++r) {
      std::vector<float> expect(decode_[r]->block_bytes() / sizeof(float));
      for (size_t b = kCached; b < slots_.size(); ++b) {
        Fill(decode_layout_, r, static_cast<uint32_t>(b), expect.data());
        if (std::memcmp(decode_[r]->block(slots_[b]), expect.data(), decode_[r]->block_bytes()) !=
            0) {
          return false;
        }
      }
    }
    return true;
  }

  PushPlan Plan(FollowerPushFn followers) {
    auto peer = prefill_[0]->ImportPeer(decode_[0]->LocalDescriptor());
    EXPECT_TRUE(peer.ok());
    PushPlan plan;
    plan.peer = *peer;
    plan.slots = slots_;
    plan.cached_blocks = kCached;
    plan.prompt_tokens = 60;
    plan.block_size = kKjv.block_size;
    plan.num_layers = 1;
    plan.block_bytes = prefill_[0]->block_bytes();
    PushPlan::Sliced sliced;
    sliced.spec.request_id = "sliced-req";
    sliced.spec.prefill = prefill_layout_;
    sliced.spec.decode = decode_layout_;
    sliced.spec.dims = kKjv;
    for (const auto& t : decode_) sliced.spec.decode_descriptors.push_back(t->LocalDescriptor());
    sliced.spec.slots = slots_;
    sliced.spec.cached_blocks = kCached;
    sliced.pusher = pushers_[0].get();
    sliced.followers = std::move(followers);
    plan.sliced = std::move(sliced);
    return plan;
  }

  struct Ended {
    kv::XferStatus status = kv::XferStatus::kInProgress;
    Status detail;
  };
  void Finish(PushStream& s, Ended* out) {
    s.Finish(blocks_, std::string("the-notice"), [this, out](kv::XferStatus st, const Status& d) {
      std::lock_guard lock(mu_);
      out->status = st;
      out->detail = d;
      cv_.notify_all();
    });
  }
  template <typename Pred>
  bool Wait(Pred pred) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(20), pred);
  }

  static constexpr uint32_t kCached = 1;
  std::vector<uint32_t> blocks_ = {2, 3, 4, 6};  // prompt blocks in every prefill rank's pool
  std::vector<uint32_t> slots_ = {5, 0, 1, 7};   // ... in every decode rank's pool
  ParallelLayout prefill_layout_, decode_layout_;
  std::vector<std::unique_ptr<kv::Transport>> prefill_, decode_;
  std::vector<std::unique_ptr<kv::RankSlicePusher>> pushers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> notices_;
  std::vector<bool> complete_at_notice_;
};

TEST_F(SlicedPushTest, PrefillTp2DecodeTp1NoticeOnlyAfterTheFollowerReported) {
  Build({2, 1}, {1, 1}, "tp2tp1");
  // The follower's part runs at once, but reports only when the test says
  // so: until then the notice must not be posted.
  kv::RankSlicePusher::Done held;
  kv::RankSlicePusher::Outcome follower_outcome;
  bool follower_called = false;
  auto followers = [&](const kv::SlicePushSpec& spec, kv::RankSlicePusher::Done done) {
    auto decoded = kv::SlicePushSpec::Decode(spec.Encode());  // as a step plan carries it
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->block_ids, blocks_);
    auto out = pushers_[1]->PushAndWait(*decoded);
    std::lock_guard lock(mu_);
    follower_outcome = out;
    held = std::move(done);
    follower_called = true;
    cv_.notify_all();
  };
  auto s = PushStream::Create(*prefill_[0], Plan(followers), PushMode::kStreaming);
  Ended r;
  Finish(*s, &r);
  ASSERT_TRUE(Wait([&] { return follower_called; }));
  EXPECT_TRUE(follower_outcome.status.ok()) << follower_outcome.status.ToString();
  EXPECT_EQ(follower_outcome.writes, 1u);
  {
    std::lock_guard lock(mu_);
    EXPECT_TRUE(notices_.empty()) << "the notice left before every rank reported";
    EXPECT_EQ(r.status, kv::XferStatus::kInProgress);
  }
  held(follower_outcome);
  ASSERT_TRUE(Wait([&] { return r.status != kv::XferStatus::kInProgress && !notices_.empty(); }));
  EXPECT_EQ(r.status, kv::XferStatus::kSuccess) << r.detail.ToString();
  std::lock_guard lock(mu_);
  ASSERT_EQ(notices_.size(), 1u);
  EXPECT_EQ(notices_[0], "the-notice");
  EXPECT_TRUE(complete_at_notice_[0]) << "decode rank 0 saw the notice before every slice landed";
  // 3 pushed blocks of the TP=1 decoder's block, half from each prefill rank.
  EXPECT_EQ(s->bytes_posted(), 3 * decode_[0]->block_bytes());
}

TEST_F(SlicedPushTest, PrefillTp1DecodePp2BothStagesGetTheirLayers) {
  Build({1, 1}, {1, 2}, "tp1pp2");
  auto s = PushStream::Create(*prefill_[0], Plan({}), PushMode::kStreaming);
  Ended r;
  Finish(*s, &r);
  ASSERT_TRUE(Wait([&] { return r.status != kv::XferStatus::kInProgress && !notices_.empty(); }));
  EXPECT_EQ(r.status, kv::XferStatus::kSuccess) << r.detail.ToString();
  std::lock_guard lock(mu_);
  ASSERT_EQ(notices_.size(), 1u);
  EXPECT_TRUE(complete_at_notice_[0]);
  EXPECT_EQ(s->transfers_posted(), 3u);  // one write per decode rank, then the notice
}

TEST_F(SlicedPushTest, AFollowerFailureFailsThePushAndNoNoticeIsSent) {
  Build({2, 1}, {1, 1}, "fail");
  auto followers = [](const kv::SlicePushSpec&, kv::RankSlicePusher::Done done) {
    done({.status = UnavailableError("prefill rank 1: decode rank 0 unreachable"),
          .bytes = 0,
          .writes = 0});
  };
  auto s = PushStream::Create(*prefill_[0], Plan(followers), PushMode::kAfterPrefill);
  Ended r;
  Finish(*s, &r);
  ASSERT_TRUE(Wait([&] { return r.status != kv::XferStatus::kInProgress; }));
  EXPECT_EQ(r.status, kv::XferStatus::kErrBackend);
  EXPECT_NE(r.detail.message().find("decode rank 0 unreachable"), std::string::npos)
      << r.detail.ToString();
  std::lock_guard lock(mu_);
  EXPECT_TRUE(notices_.empty());
}

}  // namespace
}  // namespace tandem::prefiller
