// ParseWatchBatch (the proxy's read of a Watch batch without protobuf's
// messages, issue 23) against protobuf's parse of the same frame: every
// frame it takes is one protobuf reads as a batch with the same events
// (KvEventViewFromProto) and load report, for the batches workers send and
// for random corruptions of them; the other shapes are left to protobuf.
#include "proxy/watch_batch.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "wire_corrupt.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

pb::WorkerUpdate Batch(uint64_t first_id, bool with_load) {
  pb::WorkerUpdate u;
  u.set_epoch(77);
  auto* s = u.add_events();
  s->set_event_id(first_id);
  s->set_epoch(77);
  s->mutable_stored()->set_parent_hash(0xabcdef);
  for (uint64_t h = 1; h <= 40; ++h) {
    s->mutable_stored()->add_block_hashes_fixed64(h * 0x9e3779b97f4a7c15ull);
  }
  auto* r = u.add_events();
  r->set_event_id(first_id + 1);
  r->set_epoch(77);
  r->mutable_removed()->set_tier(pb::KV_TIER_HOST);
  for (uint64_t h = 1; h <= 7; ++h) r->mutable_removed()->add_block_hashes_fixed64(h);
  auto* c = u.add_events();
  c->set_event_id(first_id + 2);
  c->set_epoch(77);
  c->mutable_cleared();
  if (with_load) {
    u.mutable_batched_load()->set_queued_prefill_tokens(8000);
    u.mutable_batched_load()->set_free_blocks(1234);
    u.mutable_batched_load()->set_prefill_seconds_total(1.5);
  }
  return u;
}

void ExpectSameEvent(const router::KvEventView& got, const router::KvEventView& want) {
  EXPECT_EQ(got.kind, want.kind);
  EXPECT_EQ(got.epoch, want.epoch);
  EXPECT_EQ(got.event_id, want.event_id);
  EXPECT_EQ(got.parent_hash, want.parent_hash);
  EXPECT_EQ(got.tier, want.tier);
  EXPECT_EQ(std::vector<uint64_t>(got.hashes.begin(), got.hashes.end()),
            std::vector<uint64_t>(want.hashes.begin(), want.hashes.end()));
}

// True when ParseWatchBatch took the frame (and then agrees with protobuf).
bool ExpectSame(const std::string& frame, WatchBatch& b) {
  pb::WorkerUpdate u;
  const bool proto_ok = u.ParseFromString(frame);
  if (!ParseWatchBatch(frame, b)) return false;
  EXPECT_TRUE(proto_ok);
  if (!proto_ok) return true;
  EXPECT_EQ(u.kind_case(), pb::WorkerUpdate::KIND_NOT_SET);
  EXPECT_FALSE(u.watch_ended());
  EXPECT_EQ(b.epoch, u.epoch());
  EXPECT_EQ(b.events.size(), static_cast<size_t>(u.events_size()));
  for (int i = 0; i < u.events_size() && i < static_cast<int>(b.events.size()); ++i) {
    ExpectSameEvent(b.events[i], KvEventViewFromProto(u.events(i)));
  }
  EXPECT_EQ(b.has_load, u.has_batched_load());
  if (b.has_load) {
    EXPECT_EQ(b.load.SerializeAsString(), u.batched_load().SerializeAsString());
  }
  return true;
}

TEST(WatchBatchTest, TheBatchesWorkersSendAreReadAsProtobufReadsThem) {
  WatchBatch b;
  for (const bool load : {false, true}) {
    SCOPED_TRACE(load);
    EXPECT_TRUE(ExpectSame(Batch(5, load).SerializeAsString(), b));
    EXPECT_EQ(b.events.size(), 3u);
    EXPECT_EQ(b.events[0].hashes.size(), 40u);
    EXPECT_EQ(b.events[1].tier, router::KvTier::kHost);
    EXPECT_EQ(b.events[2].kind, router::KvEventKind::kCleared);
  }
  pb::WorkerUpdate load_only;
  load_only.mutable_batched_load()->set_free_blocks(3);
  EXPECT_TRUE(ExpectSame(load_only.SerializeAsString(), b));
  EXPECT_TRUE(ExpectSame("", b));  // an empty batch
  EXPECT_TRUE(b.events.empty());
}

// Snapshots, single events and loads, watch_ended, varint hashes and
// fields protobuf would merge go to protobuf.
TEST(WatchBatchTest, OtherShapesAreLeftToProtobuf) {
  WatchBatch b;
  std::vector<pb::WorkerUpdate> others(5);
  others[0].mutable_snapshot()->add_block_hashes_fixed64(1);
  *others[1].mutable_event() = Batch(1, false).events(0);
  others[2].mutable_load()->set_free_blocks(1);
  others[3].set_watch_ended(true);
  others[4] = Batch(1, false);
  others[4].mutable_events(0)->mutable_stored()->add_block_hashes(9);
  std::string twice_load = Batch(1, true).SerializeAsString();
  twice_load += twice_load;  // batched_load twice: protobuf merges the two
  for (const auto& u : others) EXPECT_FALSE(ParseWatchBatch(u.SerializeAsString(), b));
  EXPECT_FALSE(ParseWatchBatch(twice_load, b));
  const std::string unknown = std::string("\xf8\x06\x01", 3);  // field 111, varint 1
  EXPECT_FALSE(ParseWatchBatch(Batch(1, false).SerializeAsString() + unknown, b));
}

// An epoch field whose tag is zero-padded past 5 bytes: protobuf refuses
// the frame, and so does this reader (it took it until session 47).
TEST(WatchBatchTest, ATagPastFiveBytesIsLeftToProtobuf) {
  WatchBatch b;
  const std::string batch = Batch(1, true).SerializeAsString();
  for (size_t bytes = 1; bytes <= 7; ++bytes) {
    const std::string epoch = wire_test::PaddedVarint(5 << 3, bytes) + std::string(1, 77);
    SCOPED_TRACE(bytes);
    pb::WorkerUpdate u;
    EXPECT_EQ(u.ParseFromString(epoch + batch), bytes <= 5);
    EXPECT_EQ(ExpectSame(epoch + batch, b), bytes <= 5);
  }
}

TEST(WatchBatchTest, CorruptedBatchesAreTakenOnlyAsProtobufReadsThem) {
  const std::string valid = Batch(9, true).SerializeAsString();
  std::mt19937 rng(23);
  WatchBatch b;
  int taken = 0;
  for (int round = 0; round < 20000; ++round) {
    const std::string frame = wire_test::Corrupt(valid, rng);
    SCOPED_TRACE(round);
    taken += ExpectSame(frame, b);
    if (HasFailure()) return;
  }
  EXPECT_GT(taken, 1000);  // the reader was exercised, not only the fallback
}

}  // namespace
}  // namespace tandem::proxy
