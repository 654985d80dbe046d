// PushStream over real loopback transports: which bytes a streaming push
// moves when, and that the notice leaves only after every data transfer of
// the reservation completed. A recording Transport wraps the writer's
// loopback transport to see the order of posts and completions; the real
// counterpart (UCX, whole fleets) runs in tests/integration/serving and
// tests/integration/sim.
#include <atomic>
#include <cstring>
#include <future>

#include <xxhash.h>

#include <optional>

#include "prefiller/push_stream.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

namespace kv = kvtransfer;
using prefiller::PushMode;
using prefiller::PushPlan;
using prefiller::PushStream;

constexpr uint32_t kLayers = 4;
constexpr uint64_t kLayerBytes = 512;
constexpr uint64_t kBlockBytes = kLayers * kLayerBytes;
constexpr uint32_t kTokensPerBlock = 16;

// Delegates to a loopback transport and records, for every post, how many
// earlier data transfers had not completed yet.
class RecordingTransport final : public kv::Transport {
 public:
  explicit RecordingTransport(std::unique_ptr<kv::Transport> inner)
      : kv::Transport(inner->agent_name(), inner->generation(), inner->block_bytes(),
                      inner->num_blocks(), inner->staging_blocks()),
        inner_(std::move(inner)) {
    set_pool(inner_->pool());
  }
  kv::Capabilities capabilities() const override { return inner_->capabilities(); }
  std::string LocalDescriptor() const override { return inner_->LocalDescriptor(); }
  Result<kv::PeerId> ImportPeer(std::string_view d) override { return inner_->ImportPeer(d); }
  Status ReleasePeer(kv::PeerId p) override { return inner_->ReleasePeer(p); }
  Result<std::string> TransportsInUse(kv::PeerId p) override { return inner_->TransportsInUse(p); }
  Result<kv::XferId> PrepareWrite(kv::PeerId peer, std::vector<kv::Segment> segments,
                                  std::optional<std::string> notice) override {
    const bool has_notice = notice.has_value();
    auto x = inner_->PrepareWrite(peer, std::move(segments), std::move(notice));
    if (x.ok()) {
      std::lock_guard lock(mu_);
      has_notice_[*x] = has_notice;
    }
    return x;
  }
  Status Post(kv::XferId x, kv::XferCallback on_done) override {
    {
      std::lock_guard lock(mu_);
      if (has_notice_[x]) {
        notice_posts_.push_back(data_inflight_);
      } else {
        ++data_inflight_;
        ++data_posts_;
      }
    }
    return inner_->Post(x, [this, on_done](kv::XferId id, kv::XferStatus st, const Status& d) {
      {
        std::lock_guard lock(mu_);
        if (!has_notice_[id]) --data_inflight_;
        statuses_.push_back(st);
      }
      if (on_done) on_done(id, st, d);
    });
  }
  kv::XferStatus Poll(kv::XferId x, Status* d) override { return inner_->Poll(x, d); }
  uint64_t BytesDone(kv::XferId x) override { return inner_->BytesDone(x); }
  Status Abort(kv::XferId x) override { return inner_->Abort(x); }
  Status Release(kv::XferId x) override { return inner_->Release(x); }
  std::vector<kv::Notification> TakeNotifications() override { return inner_->TakeNotifications(); }
  void SetNotificationCallback(kv::NotificationCallback cb) override {
    inner_->SetNotificationCallback(std::move(cb));
  }
  kv::TransportStats stats() const override { return inner_->stats(); }

  // For each post carrying a notice: data transfers still in flight then.
  std::vector<int> notice_posts() {
    std::lock_guard lock(mu_);
    return notice_posts_;
  }
  int data_posts() {
    std::lock_guard lock(mu_);
    return data_posts_;
  }

 private:
  std::unique_ptr<kv::Transport> inner_;
  std::mutex mu_;
  std::map<kv::XferId, bool> has_notice_;
  int data_inflight_ = 0;
  int data_posts_ = 0;
  std::vector<int> notice_posts_;
  std::vector<kv::XferStatus> statuses_;
};

std::unique_ptr<kv::Transport> Loopback(const std::string& name, uint32_t delay_us,
                                        uint32_t staging_blocks = 0) {
  kv::TransportOptions o;
  o.staging_blocks = staging_blocks;
  o.backend = "loopback";
  o.agent_name = name;
  o.block_bytes = kBlockBytes;
  o.num_blocks = 16;
  o.loopback_delay_per_put_us = delay_us;
  auto t = kv::CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

class PushStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    writer_ = std::make_unique<RecordingTransport>(
        Loopback("prefill", /*delay_us=*/3000, /*staging_blocks=*/16));
    target_ = Loopback("decode", 0);
    ASSERT_NE(target_, nullptr);
    // Every byte of the writer's pool distinct-ish, so misplaced bytes show.
    for (uint64_t i = 0; i < writer_->pool_bytes(); ++i) {
      writer_->pool()[i] = std::byte(static_cast<uint8_t>(1 + (i * 7 + i / 251) % 255));
    }
    target_->SetNotificationCallback([this](kv::Notification n) {
      // At notice time every pushed byte must already be visible.
      bool ok = true;
      for (size_t b = kCached; b < slots_.size(); ++b) {
        ok = ok && std::memcmp(target_->block(slots_[b]), writer_->block(blocks_[b]), kBlockBytes) == 0;
      }
      std::lock_guard lock(mu_);
      notices_.push_back(n.payload);
      data_complete_at_notice_.push_back(ok);
    });
    auto peer = writer_->ImportPeer(target_->LocalDescriptor());
    ASSERT_TRUE(peer.ok());
    peer_ = *peer;
  }

  PushPlan Plan() const {
    PushPlan p;
    p.peer = peer_;
    p.slots = slots_;
    p.cached_blocks = kCached;
    p.prompt_tokens = kPromptTokens;
    p.block_size = kTokensPerBlock;
    p.num_layers = kLayers;
    p.block_bytes = kBlockBytes;
    return p;
  }
  // What the engine reports for a chunk of tokens [start, end): one call
  // per layer group of one layer, the last once "Forward returned".
  void Chunk(PushStream& s, uint32_t start, uint32_t end, uint32_t attempt = 0) {
    for (uint32_t l = 1; l <= kLayers; ++l) {
      engine::KvProgress p;
      p.final_tokens = start;
      p.chunk_end = end;
      p.layers_done = l;
      p.num_layers = kLayers;
      p.attempt = attempt;
      p.block_table = blocks_;
      s.OnProgress(p);
    }
  }
  bool SlotMatches(size_t b) {
    return std::memcmp(target_->block(slots_[b]), writer_->block(blocks_[b]), kBlockBytes) == 0;
  }
  bool SlotIsZero(size_t b) {
    const std::byte* p = target_->block(slots_[b]);
    for (uint64_t i = 0; i < kBlockBytes; ++i) {
      if (p[i] != std::byte{0}) return false;
    }
    return true;
  }
  std::vector<std::string> Notices() {
    std::lock_guard lock(mu_);
    return notices_;
  }

  static constexpr uint32_t kCached = 1;          // the decoder holds block 0
  static constexpr uint32_t kPromptTokens = 70;   // 5 blocks, the last one partial
  std::vector<uint32_t> blocks_ = {2, 3, 4, 9, 10};  // local blocks (3,4 and 9,10 coalesce)
  std::vector<uint32_t> slots_ = {7, 8, 9, 12, 11};  // remote slots
  std::unique_ptr<RecordingTransport> writer_;
  std::unique_ptr<kv::Transport> target_;
  kv::PeerId peer_ = 0;
  std::mutex mu_;
  std::vector<std::string> notices_;
  std::vector<bool> data_complete_at_notice_;
};

TEST_F(PushStreamTest, StreamsFinalLayersAndPostsTheNoticeOnlyAfterEveryDataTransfer) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kStreaming);
  // Chunk 1 covers tokens [0, 40): blocks 1 (ends at 32) is final per layer
  // group; block 2 (ends at 48) is cut by the chunk and must wait.
  Chunk(*s, 0, 40);
  EXPECT_EQ(writer_->data_posts(), int{kLayers});  // one run of block 1 per layer group
  EXPECT_EQ(s->bytes_posted(), kBlockBytes);
  Chunk(*s, 40, kPromptTokens);  // blocks 2..4 become final
  EXPECT_EQ(s->bytes_posted(), 4 * kBlockBytes);
  std::promise<std::pair<kv::XferStatus, Status>> done;
  s->Finish(blocks_, "notice-1", [&](kv::XferStatus st, const Status& why) { done.set_value({st, why}); });
  auto [st, why] = done.get_future().get();
  ASSERT_EQ(st, kv::XferStatus::kSuccess) << why.ToString();
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; }));
  EXPECT_EQ(Notices()[0], "notice-1");
  {
    std::lock_guard lock(mu_);
    EXPECT_TRUE(data_complete_at_notice_[0]);
  }
  // The notice's transfer was posted with no data transfer in flight.
  ASSERT_EQ(writer_->notice_posts().size(), 1u);
  EXPECT_EQ(writer_->notice_posts()[0], 0);
  EXPECT_EQ(s->bytes_posted(), 4 * kBlockBytes);  // nothing sent twice
  EXPECT_TRUE(SlotIsZero(0));                     // the decoder's cached block: untouched
  for (size_t b = 1; b < blocks_.size(); ++b) EXPECT_TRUE(SlotMatches(b)) << "block " << b;
  // Released (the transport frees a request released in its callback just after it returns).
  EXPECT_TRUE(WaitFor([&] { return writer_->stats().live_requests == 0; }));
}

// Checksums: the notice builder gets XXH3-64 of every pushed block (not the
// cached one), in prompt order, equal to the decoder's slots when the notice
// arrives — in both push modes.
TEST_F(PushStreamTest, NoticeCarriesTheChecksumOfEveryPushedBlock) {
  for (PushMode mode : {PushMode::kStreaming, PushMode::kAfterPrefill}) {
    for (uint32_t slot : slots_) std::memset(target_->block(slot), 0, kBlockBytes);
    PushPlan plan = Plan();
    plan.checksum = true;
    auto s = PushStream::Create(*writer_, plan, mode);
    Chunk(*s, 0, 40);
    Chunk(*s, 40, kPromptTokens);
    std::vector<uint64_t> sums;
    std::promise<kv::XferStatus> done;
    s->Finish(
        blocks_,
        [&](std::vector<uint64_t> got) {
          sums = got;
          return std::string("with-sums");
        },
        [&](kv::XferStatus st, const Status&) { done.set_value(st); });
    ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
    ASSERT_EQ(sums.size(), blocks_.size() - kCached);
    for (size_t b = kCached; b < blocks_.size(); ++b) {
      EXPECT_EQ(sums[b - kCached], XXH3_64bits(writer_->block(blocks_[b]), kBlockBytes)) << "block " << b;
      EXPECT_EQ(sums[b - kCached], XXH3_64bits(target_->block(slots_[b]), kBlockBytes)) << "block " << b;
    }
  }
  // Off: the builder gets none.
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kAfterPrefill);
  std::optional<size_t> count;
  std::promise<kv::XferStatus> done;
  s->Finish(
      blocks_, [&](std::vector<uint64_t> got) { count = got.size(); return std::string("n"); },
      [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
  EXPECT_EQ(count, std::optional<size_t>(0));
}

TEST_F(PushStreamTest, AfterPrefillPushesEverythingInOneTransferWithTheNotice) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kAfterPrefill);
  Chunk(*s, 0, 40);
  Chunk(*s, 40, kPromptTokens);
  EXPECT_EQ(writer_->data_posts(), 0);
  std::promise<kv::XferStatus> done;
  s->Finish(blocks_, "n", [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
  EXPECT_EQ(s->transfers_posted(), 1u);
  EXPECT_EQ(s->bytes_posted(), 4 * kBlockBytes);
  for (size_t b = 1; b < blocks_.size(); ++b) EXPECT_TRUE(SlotMatches(b)) << "block " << b;
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; }));
}

TEST_F(PushStreamTest, AbortMidStreamEndsOnceNothingCanLandAndSendsNoNotice) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kStreaming);
  Chunk(*s, 0, 40);
  std::atomic<bool> aborted{false};
  std::atomic<uint64_t> inflight_at_abort{99};
  s->Abort([&] {
    inflight_at_abort = writer_->stats().inflight_requests;
    aborted = true;
  });
  ASSERT_TRUE(WaitFor([&] { return aborted.load(); }));
  EXPECT_EQ(inflight_at_abort.load(), 0u);
  // Progress after the abort posts nothing; Finish reports the cancel.
  const int posts = writer_->data_posts();
  Chunk(*s, 40, kPromptTokens);
  EXPECT_EQ(writer_->data_posts(), posts);
  std::promise<kv::XferStatus> done;
  s->Finish(blocks_, "never", [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  EXPECT_EQ(done.get_future().get(), kv::XferStatus::kErrCanceled);
  EXPECT_TRUE(writer_->notice_posts().empty());
  EXPECT_TRUE(Notices().empty());
  EXPECT_TRUE(WaitFor([&] { return writer_->stats().live_requests == 0; }));
}

TEST_F(PushStreamTest, PreemptedRequestResendsEveryBlockWithTheNotice) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kStreaming);
  Chunk(*s, 0, 40, /*attempt=*/0);
  // The engine preempted it (blocks freed, recomputed): stop streaming.
  const uint64_t before = s->bytes_posted();
  Chunk(*s, 0, 40, /*attempt=*/1);
  Chunk(*s, 40, kPromptTokens, /*attempt=*/1);
  EXPECT_EQ(s->bytes_posted(), before);
  std::promise<kv::XferStatus> done;
  s->Finish(blocks_, "n", [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
  EXPECT_EQ(s->bytes_posted(), before + 4 * kBlockBytes);
  ASSERT_EQ(writer_->notice_posts().size(), 1u);
  EXPECT_EQ(writer_->notice_posts()[0], 0);
  for (size_t b = 1; b < blocks_.size(); ++b) EXPECT_TRUE(SlotMatches(b)) << "block " << b;
}

// transport.encrypt: the decoder's slot holds block b sealed under the
// reservation's key at position b, and the tag opens it to the plaintext.
class SealedPushStreamTest : public PushStreamTest {
 protected:
  void SetUp() override {
    PushStreamTest::SetUp();
    sealer_ = std::make_unique<prefiller::KvSealer>(*writer_);
    auto key = kv::NewKvKey();
    ASSERT_TRUE(key.ok());
    key_ = *key;
  }
  // Opens the decoder's copy of prompt block b with its tag.
  Status OpenSlot(size_t b, const std::string& tags, std::vector<std::byte>& plain) {
    auto cipher = kv::KvCipher::Create(key_, kReservation);
    if (!cipher.ok()) return cipher.status();
    plain.assign(target_->block(slots_[b]), target_->block(slots_[b]) + kBlockBytes);
    return cipher->Open(static_cast<uint32_t>(b), plain.data(), plain.size(),
                        reinterpret_cast<const std::byte*>(tags.data()) +
                            (b - kCached) * kv::kKvTagBytes);
  }
  void ExpectEveryPushedBlockOpens(const std::string& tags) {
    ASSERT_EQ(tags.size(), (blocks_.size() - kCached) * kv::kKvTagBytes);
    EXPECT_TRUE(SlotIsZero(0));  // the decoder's cached block: untouched
    for (size_t b = kCached; b < blocks_.size(); ++b) {
      EXPECT_FALSE(SlotMatches(b)) << "block " << b << " travelled in plaintext";
      std::vector<std::byte> plain;
      Status s = OpenSlot(b, tags, plain);
      ASSERT_TRUE(s.ok()) << "block " << b << ": " << s.ToString();
      EXPECT_EQ(std::memcmp(plain.data(), writer_->block(blocks_[b]), kBlockBytes), 0) << b;
    }
  }
  static constexpr uint64_t kReservation = 42;
  std::unique_ptr<prefiller::KvSealer> sealer_;
  std::string key_;
};

TEST_F(SealedPushStreamTest, StreamsWholeSealedBlocksAndTheTagsOpenThem) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kStreaming);
  ASSERT_TRUE(s->EnableSealing(*sealer_, key_, kReservation).ok());
  // Chunk 1 finishes no block for every layer (final_tokens stays 0 in its
  // reports): a sealed push never sends a partial block.
  Chunk(*s, 0, 40);
  EXPECT_EQ(writer_->data_posts(), 0);
  // Chunk 2's reports say tokens [0, 40) are final: block 1 is sealed and
  // pushed whole, once.
  Chunk(*s, 40, kPromptTokens);
  EXPECT_EQ(writer_->data_posts(), 1);
  EXPECT_EQ(s->bytes_posted(), kBlockBytes);
  EXPECT_EQ(sealer_->free_blocks(), 15u);
  auto tags = s->SealRest(blocks_);  // blocks 2..4, before the notice is built
  ASSERT_TRUE(tags.ok()) << tags.status().ToString();
  EXPECT_EQ(sealer_->free_blocks(), 12u);
  std::promise<kv::XferStatus> done;
  s->Finish(blocks_, "sealed", [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
  EXPECT_EQ(s->bytes_posted(), 4 * kBlockBytes);  // nothing sent twice
  ASSERT_EQ(writer_->notice_posts().size(), 1u);
  EXPECT_EQ(writer_->notice_posts()[0], 0);
  ExpectEveryPushedBlockOpens(*tags);
  // A flipped bit in the ciphertext fails its tag.
  target_->block(slots_[2])[100] ^= std::byte{1};
  std::vector<std::byte> plain;
  EXPECT_EQ(OpenSlot(2, *tags, plain).code(), StatusCode::kDataLoss);
  s->ReleaseStaging();
  EXPECT_EQ(sealer_->free_blocks(), 16u);
}

TEST_F(SealedPushStreamTest, AfterPrefillSealsEverythingBeforeTheNotice) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kAfterPrefill);
  ASSERT_TRUE(s->EnableSealing(*sealer_, key_, kReservation).ok());
  Chunk(*s, 0, 40);
  Chunk(*s, 40, kPromptTokens);
  EXPECT_EQ(writer_->data_posts(), 0);
  auto tags = s->SealRest(blocks_);
  ASSERT_TRUE(tags.ok()) << tags.status().ToString();
  std::promise<kv::XferStatus> done;
  s->Finish(blocks_, "n", [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
  EXPECT_EQ(s->transfers_posted(), 1u);
  ExpectEveryPushedBlockOpens(*tags);
}

TEST_F(SealedPushStreamTest, PreemptionNeitherResealsNorResendsSealedBlocks) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kStreaming);
  ASSERT_TRUE(s->EnableSealing(*sealer_, key_, kReservation).ok());
  Chunk(*s, 0, 40, /*attempt=*/0);
  Chunk(*s, 40, kPromptTokens, /*attempt=*/0);  // block 1 sealed and pushed
  ASSERT_EQ(s->bytes_posted(), kBlockBytes);
  // Preempted: the sealed copy of block 1 is the stream's own, so the
  // recomputation neither reseals position 1 (same GCM nonce) nor resends it.
  Chunk(*s, 0, 40, /*attempt=*/1);
  Chunk(*s, 40, kPromptTokens, /*attempt=*/1);
  EXPECT_EQ(s->bytes_posted(), kBlockBytes);
  auto tags = s->SealRest(blocks_);
  ASSERT_TRUE(tags.ok()) << tags.status().ToString();
  std::promise<kv::XferStatus> done;
  s->Finish(blocks_, "n", [&](kv::XferStatus st, const Status&) { done.set_value(st); });
  ASSERT_EQ(done.get_future().get(), kv::XferStatus::kSuccess);
  EXPECT_EQ(s->bytes_posted(), 4 * kBlockBytes);
  ExpectEveryPushedBlockOpens(*tags);
}

TEST_F(SealedPushStreamTest, TooFewStagingBlocksFailsSealRestAndHoldsNothingExtra) {
  // Another push holds 14 of the 16 staging blocks.
  auto other = kv::KvCipher::Create(key_, 7);
  ASSERT_TRUE(other.ok());
  std::vector<uint32_t> pos(14), local(14, 2);
  for (uint32_t i = 0; i < 14; ++i) pos[i] = i;
  auto held = sealer_->Seal(*other, pos, local);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kAfterPrefill);
  ASSERT_TRUE(s->EnableSealing(*sealer_, key_, kReservation).ok());
  auto tags = s->SealRest(blocks_);
  ASSERT_FALSE(tags.ok());
  EXPECT_EQ(tags.status().code(), StatusCode::kResourceExhausted) << tags.status().ToString();
  EXPECT_EQ(sealer_->free_blocks(), 2u);
  s->ReleaseStaging();
  sealer_->Release(held->staging);
  EXPECT_EQ(sealer_->free_blocks(), 16u);
}

TEST_F(SealedPushStreamTest, AKeyOfTheWrongSizeIsRefused) {
  auto s = PushStream::Create(*writer_, Plan(), PushMode::kStreaming);
  Status st = s->EnableSealing(*sealer_, "short", kReservation);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_FALSE(s->sealing());
}

}  // namespace
}  // namespace tandem::worker_test
