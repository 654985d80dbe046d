// The staging path (kvtransfer/staging) on the CPU: two StagedTransports
// over loopback host transports, each with a HostCopyEngine (real threads
// standing in for a CUDA copy stream). Its real-UCX counterpart, two
// processes, is tests/integration/kvtransfer/staged_two_process_test.cc.
#include "kvtransfer/staging/staged_transport.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <numeric>
#include <random>

#include "kv_test_util.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "kvtransfer/staging/host_copy_engine.h"
#include "kvtransfer/staging/staging_notice.h"

namespace tandem::kvtransfer {
namespace {

namespace kvt = testing;
using namespace std::chrono_literals;
using Kind = StageEvent::Kind;

std::string UniqueName(const std::string& base) {
  static std::atomic<int> n{0};
  return base + "-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

class Recorder {
 public:
  void Add(const StageEvent& e) {
    std::lock_guard lock(mu_);
    events_.push_back(e);
    if (e.kind == Kind::kPutDone && !first_put_done_set_) {
      first_put_done_set_ = true;
      first_put_done_.set_value();
    }
  }
  std::vector<StageEvent> events() {
    std::lock_guard lock(mu_);
    return events_;
  }
  std::future<void> first_put_done() { return first_put_done_.get_future(); }

 private:
  std::mutex mu_;
  std::vector<StageEvent> events_;
  std::promise<void> first_put_done_;
  bool first_put_done_set_ = false;
};

struct Pair {
  std::unique_ptr<StagedTransport> writer, reader;
  HostCopyEngine* writer_engine = nullptr;
  HostCopyEngine* reader_engine = nullptr;
  PeerId peer = 0;
};

struct PairOptions {
  uint64_t block_bytes = 256;
  uint32_t blocks = 64;
  StagedTransportOptions staged;
  HostCopyEngineOptions writer_copy;
  uint32_t delay_per_put_us = 0;
};

Pair MakePair(const PairOptions& po) {
  Pair p;
  auto make = [&](const std::string& name, HostCopyEngineOptions eo, StagedTransportOptions so,
                  HostCopyEngine** engine_out) {
    TransportOptions o;
    o.backend = "loopback";
    o.agent_name = UniqueName(name);
    o.block_bytes = po.block_bytes;
    o.num_blocks = po.blocks;
    o.loopback_delay_per_put_us = po.delay_per_put_us;
    auto engine = std::make_unique<HostCopyEngine>(eo);
    *engine_out = engine.get();
    auto t = CreateStagedTransport(o, std::move(engine), std::move(so));
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  };
  p.writer = make("writer", po.writer_copy, po.staged, &p.writer_engine);
  p.reader = make("reader", {}, {}, &p.reader_engine);
  if (p.writer && p.reader) {
    auto peer = p.writer->ImportPeer(p.reader->LocalDescriptor());
    EXPECT_TRUE(peer.ok()) << peer.status().ToString();
    if (peer.ok()) p.peer = *peer;
  }
  return p;
}

// Waits for a write's callback; the test's bound, not a speed assertion.
struct Done {
  std::promise<std::pair<XferStatus, Status>> promise;
  std::future<std::pair<XferStatus, Status>> future = promise.get_future();
  XferCallback cb() {
    return [this](XferId, XferStatus st, const Status& d) { promise.set_value({st, d}); };
  }
  std::pair<XferStatus, Status> Wait() {
    if (future.wait_for(20s) != std::future_status::ready) {
      return {XferStatus::kInProgress, DeadlineExceededError("no completion within 20 s")};
    }
    return future.get();
  }
};

// A notice received, with what the reader's device pool held at that moment.
struct NoticeProbe {
  std::promise<std::pair<std::string, uint64_t>> promise;
  std::future<std::pair<std::string, uint64_t>> future = promise.get_future();
};

TEST(StagingNotice, RoundTripsAndRejectsCorruption) {
  staging::StagingNotice m;
  m.kind = staging::StagingNotice::Kind::kManifest;
  m.count = 7;
  m.ranges = {{0, 10}, {4096, 1}};
  auto d = staging::DecodeStagingNotice(staging::EncodeStagingNotice(m));
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_EQ((*d)->count, 7u);
  ASSERT_EQ((*d)->ranges.size(), 2u);
  EXPECT_EQ((*d)->ranges[1].offset, 4096u);
  std::string wire = staging::EncodeStagingNotice(m);
  wire.pop_back();
  EXPECT_EQ(staging::DecodeStagingNotice(wire).status().code(), StatusCode::kDataLoss);
  auto plain = staging::DecodeStagingNotice("req-1 gen 2");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->has_value());
}

// Integrity: 1 ... 4096 blocks at random local blocks and remote slots, and
// sub-block byte ranges (groups of layers); the reader's device pool is
// compared by checksum inside its notice callback, so the data must be in
// device memory before the notice is handed on. Bytes nobody wrote stay 0.
TEST(StagedTransport, DataIntegrityFromOneTo4096BlocksAtRandomOffsets) {
  for (uint32_t n : {1u, 2u, 3u, 17u, 255u, 4096u}) {
    SCOPED_TRACE(n);
    PairOptions po;
    po.block_bytes = 96;  // small blocks: 4096 of them stay a small test
    po.blocks = 4096 + 8;
    po.staged.blocks_per_buffer = 16;
    Pair p = MakePair(po);
    ASSERT_TRUE(p.writer && p.reader);
    std::mt19937_64 rng(n);
    kvt::FillRandom(p.writer->pool(), p.writer->pool_bytes(), n);
    std::vector<uint32_t> local(po.blocks), remote(po.blocks);
    std::iota(local.begin(), local.end(), 0u);
    std::iota(remote.begin(), remote.end(), 0u);
    std::shuffle(local.begin(), local.end(), rng);
    std::shuffle(remote.begin(), remote.end(), rng);
    std::vector<Segment> segs;
    std::vector<std::byte> expect(p.reader->pool_bytes(), std::byte{0});
    for (uint32_t i = 0; i < n; ++i) {
      // Every third block goes as a random sub-block byte range.
      uint64_t off = 0, len = po.block_bytes;
      if (i % 3 == 2) {
        off = rng() % po.block_bytes;
        len = 1 + rng() % (po.block_bytes - off);
      }
      Segment s{uint64_t{local[i]} * po.block_bytes + off, uint64_t{remote[i]} * po.block_bytes + off, len};
      segs.push_back(s);
      std::memcpy(expect.data() + s.remote_offset_bytes, p.writer->pool() + s.local_offset_bytes, len);
    }
    const uint64_t want = kvt::Checksum(expect.data(), expect.size());
    NoticeProbe probe;
    StagedTransport* reader = p.reader.get();
    p.reader->SetNotificationCallback([&probe, reader](Notification note) {
      probe.promise.set_value({note.payload, kvt::Checksum(reader->pool(), reader->pool_bytes())});
    });
    auto x = p.writer->PrepareWrite(p.peer, segs, "req-" + std::to_string(n));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    Done done;
    ASSERT_TRUE(p.writer->Post(*x, done.cb()).ok());
    const auto [st, detail] = done.Wait();
    EXPECT_EQ(st, XferStatus::kSuccess) << detail.ToString();
    ASSERT_EQ(probe.future.wait_for(20s), std::future_status::ready);
    const auto [payload, sum] = probe.future.get();
    EXPECT_EQ(payload, "req-" + std::to_string(n));
    EXPECT_EQ(sum, want) << "device pool differs from what was written";
    uint64_t total = 0;
    for (const Segment& s : segs) total += s.length_bytes;
    EXPECT_EQ(p.writer->BytesDone(*x), total);
    EXPECT_TRUE(p.writer->Release(*x).ok());
    const StagingStats ws = p.writer->staging_stats();
    EXPECT_EQ(ws.free_buffers, ws.buffers);
    EXPECT_TRUE(ws.host_pool_pinned);
    EXPECT_EQ(p.writer_engine->live_pinned_ranges(), 1u);  // the host pool
    EXPECT_EQ(p.reader->staging_stats().notices_held, 0u);
    EXPECT_EQ(p.writer->stats().live_requests, 0u);
    EXPECT_TRUE(kvt::WaitFor([&] { return p.writer->host_transport().stats().live_requests == 0; }));
  }
}

// A send-only transport (a prefill-only worker: StagedTransportOptions::
// receive false) keeps no host mirror of its device pool — its host pool is
// the staging buffers alone — and still delivers verified data; a staging
// notice sent to it is dropped, never read against a mirror it lacks.
TEST(StagedTransport, SendOnlyKeepsNoMirrorAndStillDeliversVerifiedData) {
  PairOptions po;
  po.blocks = 300;
  po.staged.blocks_per_buffer = 4;
  po.staged.staging_buffers = 2;
  po.staged.receive = false;  // the writer only
  Pair p = MakePair(po);
  ASSERT_TRUE(p.writer && p.reader);
  EXPECT_EQ(p.writer->host_transport().pool_bytes(), 2u * 4u * po.block_bytes);
  EXPECT_GE(p.reader->host_transport().pool_bytes(), 300u * po.block_bytes);  // the mirror
  kvt::FillRandom(p.writer->pool(), p.writer->pool_bytes(), 7);
  std::vector<BlockPair> pairs;
  for (uint32_t b = 0; b < 37; ++b) pairs.push_back({b * 7 % 300, 299 - b * 5});
  NoticeProbe probe;
  StagedTransport* reader = p.reader.get();
  p.reader->SetNotificationCallback([&probe, reader](Notification n) {
    probe.promise.set_value({n.payload, kvt::Checksum(reader->pool(), reader->pool_bytes())});
  });
  std::vector<std::byte> expect(p.reader->pool_bytes(), std::byte{0});
  for (const BlockPair& bp : pairs) {
    std::memcpy(expect.data() + uint64_t{bp.remote_slot} * po.block_bytes,
                p.writer->block(bp.local_block), po.block_bytes);
  }
  auto x = p.writer->PrepareBlockWrite(p.peer, pairs, "send-only");
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  Done done;
  ASSERT_TRUE(p.writer->Post(*x, done.cb()).ok());
  EXPECT_EQ(done.Wait().first, XferStatus::kSuccess);
  ASSERT_EQ(probe.future.wait_for(20s), std::future_status::ready);
  const auto [payload, sum] = probe.future.get();
  EXPECT_EQ(payload, "send-only");
  EXPECT_EQ(sum, kvt::Checksum(expect.data(), expect.size()));
  EXPECT_TRUE(p.writer->Release(*x).ok());
  EXPECT_EQ(p.writer->staging_stats().free_buffers, 2u);

  // The other way: the send-only side drops the staging notices it gets.
  auto back = p.reader->ImportPeer(p.writer->LocalDescriptor());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  auto y = p.reader->PrepareBlockWrite(*back, std::vector<BlockPair>{{0, 0}}, "to-a-prefiller");
  ASSERT_TRUE(y.ok()) << y.status().ToString();
  Done back_done;
  ASSERT_TRUE(p.reader->Post(*y, back_done.cb()).ok());
  back_done.Wait();
  EXPECT_TRUE(kvt::WaitFor([&] { return p.writer->staging_stats().malformed_notices >= 2; }))
      << "manifest and notice not dropped";
  EXPECT_EQ(p.writer->staging_stats().manifests_received, 0u);
  EXPECT_TRUE(p.writer->TakeNotifications().empty());
  EXPECT_TRUE(p.reader->Release(*y).ok());
}

// Overlap and back-pressure, from the recorded order of the pipeline's steps
// (not from timing): the copy of chunk i+1 is queued before the put of
// chunk i completes, and never more chunks are staged than buffers.
TEST(StagedTransport, CopyOfNextChunkStartsBeforePutOfThisOneCompletes) {
  for (uint32_t buffers : {2u, 3u}) {
    SCOPED_TRACE(buffers);
    Recorder rec;
    PairOptions po;
    po.staged.staging_buffers = buffers;
    po.staged.blocks_per_buffer = 1;
    po.staged.trace = [&rec](const StageEvent& e) { rec.Add(e); };
    po.delay_per_put_us = 200;  // puts slower than copies, as over a network
    Pair p = MakePair(po);
    ASSERT_TRUE(p.writer && p.reader);
    std::vector<BlockPair> pairs;
    for (uint32_t b = 0; b < 32; ++b) pairs.push_back({b, 63 - b});
    auto x = p.writer->PrepareBlockWrite(p.peer, pairs, std::nullopt);
    ASSERT_TRUE(x.ok());
    Done done;
    ASSERT_TRUE(p.writer->Post(*x, done.cb()).ok());
    EXPECT_EQ(done.Wait().first, XferStatus::kSuccess);
    const auto ev = rec.events();
    auto at = [&](Kind k, uint32_t chunk) {
      for (size_t i = 0; i < ev.size(); ++i) {
        if (ev[i].kind == k && ev[i].chunk == chunk) return static_cast<long>(i);
      }
      return -1L;
    };
    for (uint32_t i = 0; i + 1 < 32; ++i) {
      ASSERT_GE(at(Kind::kCopyStart, i + 1), 0) << i;
      EXPECT_LT(at(Kind::kCopyStart, i + 1), at(Kind::kPutDone, i)) << "chunk " << i;
    }
    long staged = 0, most = 0;
    for (const StageEvent& e : ev) {
      staged += e.kind == Kind::kCopyStart ? 1 : e.kind == Kind::kPutDone ? -1 : 0;
      most = std::max(most, staged);
    }
    EXPECT_EQ(most, static_cast<long>(buffers)) << "back-pressure: staged chunks beyond the buffers";
    EXPECT_TRUE(p.writer->Release(*x).ok());
  }
}

TEST(StagedTransport, AbortMidPipelineFreesEveryBufferAndSendsNoNotice) {
  Recorder rec;
  PairOptions po;
  po.staged.blocks_per_buffer = 1;
  po.staged.trace = [&rec](const StageEvent& e) { rec.Add(e); };
  po.delay_per_put_us = 2000;
  Pair p = MakePair(po);
  ASSERT_TRUE(p.writer && p.reader);
  std::vector<BlockPair> pairs;
  for (uint32_t b = 0; b < 64; ++b) pairs.push_back({b, b});
  auto x = p.writer->PrepareBlockWrite(p.peer, pairs, "never");
  ASSERT_TRUE(x.ok());
  Done done;
  auto first = rec.first_put_done();
  ASSERT_TRUE(p.writer->Post(*x, done.cb()).ok());
  ASSERT_EQ(first.wait_for(20s), std::future_status::ready);  // mid-pipeline
  ASSERT_TRUE(p.writer->Abort(*x).ok());
  const auto [st, detail] = done.Wait();
  EXPECT_EQ(st, XferStatus::kErrCanceled) << detail.ToString();
  const StagingStats s = p.writer->staging_stats();
  EXPECT_EQ(s.free_buffers, s.buffers);
  EXPECT_EQ(s.writes_waiting_for_buffer, 0u);
  EXPECT_LT(p.writer->BytesDone(*x), 64u * po.block_bytes);
  // The host transport frees its (released) requests on its progress thread.
  EXPECT_TRUE(kvt::WaitFor([&] { return p.writer->host_transport().stats().live_requests == 0; }));
  EXPECT_EQ(p.writer->host_transport().stats().inflight_requests, 0u);
  EXPECT_TRUE(p.writer->Release(*x).ok());
  EXPECT_EQ(p.writer->stats().live_requests, 0u);
  // Whatever chunks landed were copied up; the notice was never sent.
  p.reader_engine->Drain();
  EXPECT_TRUE(p.reader->TakeNotifications().empty());
  for (const StageEvent& e : rec.events()) EXPECT_NE(e.kind, Kind::kNoticeSent);
}

TEST(StagedTransport, CopyFailureEndsTheWriteWithTheErrorAndFreesBuffers) {
  PairOptions po;
  po.staged.blocks_per_buffer = 1;
  po.writer_copy.fail_batch = 3;
  Pair p = MakePair(po);
  ASSERT_TRUE(p.writer && p.reader);
  std::vector<BlockPair> pairs;
  for (uint32_t b = 0; b < 8; ++b) pairs.push_back({b, b});
  auto x = p.writer->PrepareBlockWrite(p.peer, pairs, "never");
  ASSERT_TRUE(x.ok());
  Done done;
  ASSERT_TRUE(p.writer->Post(*x, done.cb()).ok());
  const auto [st, detail] = done.Wait();
  EXPECT_EQ(st, XferStatus::kErrBackend);
  EXPECT_NE(detail.message().find("injected copy failure"), std::string::npos) << detail.ToString();
  Status polled;
  EXPECT_EQ(p.writer->Poll(*x, &polled), XferStatus::kErrBackend);
  const StagingStats s = p.writer->staging_stats();
  EXPECT_EQ(s.free_buffers, s.buffers);
  p.reader_engine->Drain();
  EXPECT_TRUE(p.reader->TakeNotifications().empty());
}

// The reader drops dead mid-transfer: the write fails with the host
// transport's disconnect status and gives its buffers back.
TEST(StagedTransport, PeerLostMidTransferSurfacesAnError) {
  Recorder rec;
  PairOptions po;
  po.staged.blocks_per_buffer = 1;
  po.staged.trace = [&rec](const StageEvent& e) { rec.Add(e); };
  po.delay_per_put_us = 2000;
  Pair p = MakePair(po);
  ASSERT_TRUE(p.writer && p.reader);
  std::vector<BlockPair> pairs;
  for (uint32_t b = 0; b < 64; ++b) pairs.push_back({b, b});
  auto x = p.writer->PrepareBlockWrite(p.peer, pairs, "never");
  ASSERT_TRUE(x.ok());
  Done done;
  auto first = rec.first_put_done();
  ASSERT_TRUE(p.writer->Post(*x, done.cb()).ok());
  ASSERT_EQ(first.wait_for(20s), std::future_status::ready);
  ASSERT_TRUE(LoopbackDropPeer(p.reader->agent_name()).ok());
  const auto [st, detail] = done.Wait();
  EXPECT_EQ(st, XferStatus::kErrRemoteDisconnect) << detail.ToString();
  const StagingStats s = p.writer->staging_stats();
  EXPECT_EQ(s.free_buffers, s.buffers);
  // Later writes to it are refused at once.
  EXPECT_FALSE(p.writer->PrepareBlockWrite(p.peer, pairs, std::nullopt).ok());
}

// A restarted reader (new generation): the old PeerId is stale and so is
// the old descriptor.
TEST(StagedTransport, StaleReservationOfARestartedPeerIsRefused) {
  Pair p = MakePair({});
  ASSERT_TRUE(p.writer && p.reader);
  const std::string old_desc = p.reader->LocalDescriptor();
  ASSERT_TRUE(LoopbackRestartPeer(p.reader->host_transport().agent_name()).ok());
  const std::vector<BlockPair> pairs = {{0, 1}};
  auto x = p.writer->PrepareBlockWrite(p.peer, pairs, "stale");
  if (x.ok()) {
    Done done;
    const Status posted = p.writer->Post(*x, done.cb());
    if (posted.ok()) {
      EXPECT_EQ(done.Wait().first, XferStatus::kErrStaleDescriptor);
    }
    EXPECT_EQ(p.writer->Poll(*x), XferStatus::kErrStaleDescriptor);
  } else {
    EXPECT_EQ(x.status().code(), StatusCode::kFailedPrecondition) << x.status().ToString();
    EXPECT_NE(x.status().message().find("stale"), std::string::npos) << x.status().ToString();
  }
  EXPECT_EQ(p.reader->staging_stats().notices_held, 0u);
  p.reader_engine->Drain();
  EXPECT_TRUE(p.reader->TakeNotifications().empty());
}

// The streaming push: several writes per reservation, the notice on the
// last. The notice reaches the reader only once every write's data is in
// its device pool, even with the earlier writes still staging when the last
// one is posted.
TEST(StagedTransport, NoticeOfTheLastWriteFollowsEveryEarlierWrite) {
  PairOptions po;
  po.staged.blocks_per_buffer = 1;
  po.delay_per_put_us = 300;
  Pair p = MakePair(po);
  ASSERT_TRUE(p.writer && p.reader);
  kvt::FillRandom(p.writer->pool(), p.writer->pool_bytes(), 42);
  NoticeProbe probe;
  StagedTransport* reader = p.reader.get();
  p.reader->SetNotificationCallback([&probe, reader](Notification n) {
    probe.promise.set_value({n.payload, kvt::Checksum(reader->pool(), 24 * 256)});
  });
  // Three "layer groups" of blocks 0..23, the last one carrying the notice.
  std::vector<XferId> ids;
  Done d[3];
  for (int g = 0; g < 3; ++g) {
    std::vector<BlockPair> pairs;
    for (uint32_t b = 0; b < 8; ++b) pairs.push_back({g * 8 + b, g * 8 + b});
    auto x = p.writer->PrepareBlockWrite(p.peer, pairs,
                                         g == 2 ? std::optional<std::string>("req-7") : std::nullopt);
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE(p.writer->Post(*x, d[g].cb()).ok());
    ids.push_back(*x);
  }
  for (auto& done : d) EXPECT_EQ(done.Wait().first, XferStatus::kSuccess);
  ASSERT_EQ(probe.future.wait_for(20s), std::future_status::ready);
  const auto [payload, sum] = probe.future.get();
  EXPECT_EQ(payload, "req-7");
  EXPECT_EQ(sum, kvt::Checksum(p.writer->pool(), 24 * 256));
  for (XferId x : ids) EXPECT_TRUE(p.writer->Release(x).ok());
}

TEST(StagedTransport, RefusesOutOfRangeSegmentsAndOversizedNotices) {
  Pair p = MakePair({});
  ASSERT_TRUE(p.writer && p.reader);
  const uint64_t pool = p.writer->pool_bytes();
  EXPECT_EQ(p.writer->PrepareWrite(p.peer, {{pool - 1, 0, 2}}, std::nullopt).status().code(),
            StatusCode::kOutOfRange);
  // Remote bounds are the host transport's: the reader's host pool (mirror + staging buffers).
  const uint64_t remote = p.reader->host_transport().pool_bytes();
  EXPECT_EQ(p.writer->PrepareWrite(p.peer, {{0, remote, 1}}, std::nullopt).status().code(),
            StatusCode::kOutOfRange);
  const std::string big(p.writer->capabilities().max_notification_bytes + 1, 'x');
  EXPECT_EQ(p.writer->PrepareWrite(p.peer, {}, big).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(p.writer->capabilities().device_memory);
  EXPECT_EQ(p.writer->capabilities().backend, "loopback+staging");
}

TEST(StagedTransport, DestroyingWithWritesInFlightLeavesNothingBehind) {
  PairOptions po;
  po.staged.blocks_per_buffer = 1;
  po.delay_per_put_us = 1000;
  Pair p = MakePair(po);
  ASSERT_TRUE(p.writer && p.reader);
  std::vector<BlockPair> pairs;
  for (uint32_t b = 0; b < 32; ++b) pairs.push_back({b, b});
  for (int i = 0; i < 3; ++i) {
    auto x = p.writer->PrepareBlockWrite(p.peer, pairs, "n");
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE(p.writer->Post(*x).ok());
  }
  p.writer.reset();  // must not hang or crash; its device pool is freed
  p.reader.reset();
}

}  // namespace
}  // namespace tandem::kvtransfer
