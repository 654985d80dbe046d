// Decode seats (DecoderOptions::max_seats, docs/serving-workers.md "Decode
// seats"): a Reserve past the running batch waits for a seat, in arrival
// order, and is answered when one frees; the sync Reserve is refused; a
// waiting call ends with its request, its caller, its wait bound or Stop,
// holding nothing. A Reserve short of free KV blocks waits the same way
// for blocks to come free. Real engine and loopback transport; the wire
// paths run in reserve_tcp_test and reserve_grpc_test.
#include "worker_test_util.h"

#include <fmt/format.h>

#include <deque>
#include <optional>

#include "common/metrics.h"

namespace tandem::worker_test {
namespace {

using decoder::Decoder;
using decoder::DecoderOptions;
using decoder::DecodeSpec;
using decoder::KvNoticeInfo;
using decoder::KvTargetInfo;

class DecodeSeatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = Node::Make("seats-unit", 32);
    ASSERT_NE(node_, nullptr);
  }
  void MakeDecoder(uint32_t max_seats, HeldHistogram* reserve_wait = nullptr) {
    DecoderOptions o;
    o.verify_checksums = false;
    o.max_seats = max_seats;
    o.reserve_wait = reserve_wait;
    decoder_ = std::make_unique<Decoder>(*node_->engine, *node_->transport, o);
    decoder_->Start();
  }
  std::shared_ptr<RecordingSink> Register(const std::string& id, uint32_t max_tokens = 3) {
    auto sink = std::make_shared<RecordingSink>();
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ids = PromptOf(id);
    s.sampling = Greedy(max_tokens);
    EXPECT_TRUE(decoder_->Register(s, sink).ok());
    return sink;
  }
  // 20 tokens (2 blocks), different per request.
  static std::vector<uint32_t> PromptOf(const std::string& id) {
    return Prompt(20, static_cast<uint32_t>(std::hash<std::string>{}(id) % 1000));
  }
  uint64_t ReserveOrWait(const std::string& id, Answer& answer,
                         std::chrono::milliseconds wait = 10s) {
    const auto prompt = PromptOf(id);
    return decoder_->ReserveOrWait(id, "p", prompt, {}, {}, std::chrono::steady_clock::now() + wait,
                                   answer.Done());
  }
  uint32_t FreeBlocks() { return node_->engine->stats().free_blocks; }
  // Reserves `n` requests r0.. (2 blocks each), answered at once.
  std::vector<KvTargetInfo> ReserveMany(int n, std::vector<std::shared_ptr<RecordingSink>>* sinks) {
    std::vector<KvTargetInfo> targets;
    for (int i = 0; i < n; ++i) {
      const std::string id = fmt::format("r{}", i);
      sinks->push_back(Register(id));
      Answer answer;
      EXPECT_EQ(ReserveOrWait(id, answer), 0u) << id;
      EXPECT_TRUE(answer.Has() && answer.Get().ok()) << id;
      if (answer.Has() && answer.Get().ok()) targets.push_back(*answer.Get());
    }
    return targets;
  }
  // The prefiller of `t` gives up: its reservation is released.
  void GiveUp(const KvTargetInfo& t) {
    KvNoticeInfo n = SuccessNotice(t, 0);
    n.error = UnavailableError("prefill failed");
    decoder_->OnKvNotice(n);
  }

  std::unique_ptr<Node> node_;
  std::unique_ptr<Decoder> decoder_;
};

TEST_F(DecodeSeatsTest, AReservePastTheSeatsWaitsAndIsSeatedWhenOneFrees) {
  MakeDecoder(2);
  Register("a");
  Register("b");
  Register("c");
  Register("d");
  Answer a, b, c;
  EXPECT_EQ(ReserveOrWait("a", a), 0u);  // answered inline
  EXPECT_EQ(ReserveOrWait("b", b), 0u);
  ASSERT_TRUE(a.Get().ok());
  ASSERT_TRUE(b.Get().ok());
  const uint64_t ticket = ReserveOrWait("c", c);
  EXPECT_NE(ticket, 0u);
  EXPECT_FALSE(c.Has());
  // The sync Reserve does not wait: refused, nothing held.
  const auto d = decoder_->Reserve("d", "p", PromptOf("d"));
  EXPECT_EQ(d.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("scheduler.max_num_seqs 2"), std::string::npos)
      << d.status().message();
  auto counts = decoder_->counts();
  EXPECT_EQ(counts.seats_taken, 2u);
  EXPECT_EQ(counts.reserves_waiting, 1u);
  EXPECT_EQ(counts.reserve_waits, 1u);
  EXPECT_EQ(counts.reservations, 2u);
  EXPECT_EQ(FreeBlocks(), 32u - 4u);
  // a's stream goes away: its seat goes to c (its blocks wait for the
  // prefiller's notice, as any cancelled reservation's).
  decoder_->Cancel("a");
  ASSERT_TRUE(WaitFor([&] { return c.Has(); }));
  const auto target = c.Get();
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  EXPECT_EQ(target->request_id, "c");
  EXPECT_EQ(target->slots.size(), 2u);
  counts = decoder_->counts();
  EXPECT_EQ(counts.seats_taken, 2u);
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 3u);
  decoder_->AbandonReserve(ticket);  // answered already: nothing happens
  EXPECT_EQ(c.calls(), 1);
  EXPECT_EQ(decoder_->counts().reservations, 3u);
}

TEST_F(DecodeSeatsTest, SeatsGoInArrivalOrderAsRequestsFinishOrTheirPrefillerGivesUp) {
  MakeDecoder(1);
  auto sink_a = Register("a");
  Register("b");
  Register("c");
  Answer a, b, c;
  ReserveOrWait("a", a);
  ASSERT_TRUE(a.Has());
  ASSERT_TRUE(a.Get().ok());
  EXPECT_NE(ReserveOrWait("b", b), 0u);
  EXPECT_NE(ReserveOrWait("c", c), 0u);
  // a decodes to its end: the seat goes to b, the earlier of the two.
  decoder_->OnKvNotice(SuccessNotice(*a.Get(), 9));
  ASSERT_TRUE(WaitFor([&] { return sink_a->Ended(); }));
  EXPECT_TRUE(sink_a->finished);
  ASSERT_TRUE(WaitFor([&] { return b.Has(); }));
  ASSERT_TRUE(b.Get().ok()) << b.Get().status().ToString();
  EXPECT_FALSE(c.Has());
  EXPECT_EQ(decoder_->counts().reserves_waiting, 1u);
  // b's prefiller gives up (the request waits for the proxy's retry, seatless):
  // the seat goes to c.
  KvNoticeInfo gave_up = SuccessNotice(*b.Get(), 0);
  gave_up.error = UnavailableError("prefill failed");
  decoder_->OnKvNotice(gave_up);
  ASSERT_TRUE(WaitFor([&] { return c.Has(); }));
  ASSERT_TRUE(c.Get().ok()) << c.Get().status().ToString();
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.seats_taken, 1u);
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reserve_waits, 2u);
  EXPECT_EQ(counts.reservations, 1u);  // c's; a's was consumed, b's released
  EXPECT_EQ(FreeBlocks(), 32u - 2u);
}

// The seat turnover the decoder reports (LoadReport.seats_released_total,
// seat_seconds_total; docs/router.md "Seat waits in the TTFT prediction"):
// every seat given back is counted, and seat-seconds grow only while seats
// are taken.
TEST_F(DecodeSeatsTest, SeatsGivenBackAndSeatSecondsAreCounted) {
  MakeDecoder(2);
  const auto start = std::chrono::steady_clock::now();
  auto sink_a = Register("a");
  Register("b");
  Answer a, b;
  ReserveOrWait("a", a);
  ReserveOrWait("b", b);
  ASSERT_TRUE(a.Has() && a.Get().ok());
  ASSERT_TRUE(b.Has() && b.Get().ok());
  auto counts = decoder_->counts();
  EXPECT_EQ(counts.seats_taken, 2u);
  EXPECT_EQ(counts.seats_released, 0u);
  // a decodes to its end, b's stream goes away: both seats come back.
  decoder_->OnKvNotice(SuccessNotice(*a.Get(), 9));
  ASSERT_TRUE(WaitFor([&] { return sink_a->Ended(); }));
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().seats_released == 1; }));
  decoder_->Cancel("b");
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().seats_taken == 0; }));
  counts = decoder_->counts();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(counts.seats_released, 2u);
  EXPECT_GT(counts.seat_seconds, 0.0);
  EXPECT_LE(counts.seat_seconds, 2 * elapsed);  // two seats at most, never longer than the test
  // No seat taken: the integral stands still.
  EXPECT_EQ(decoder_->counts().seat_seconds, counts.seat_seconds);
}

TEST_F(DecodeSeatsTest, ARetryKeepsItsRequestsSeat) {
  MakeDecoder(1);
  Register("a");
  ASSERT_TRUE(decoder_->Reserve("a", "p1", PromptOf("a")).ok());
  // A second prefiller takes the request over: not refused for want of a seat.
  auto again = decoder_->Reserve("a", "p2", PromptOf("a"));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(decoder_->counts().seats_taken, 1u);
  EXPECT_EQ(decoder_->counts().seats_released, 0u);  // nothing given back
  EXPECT_EQ(decoder_->counts().reservations_refused, 0u);
}

TEST_F(DecodeSeatsTest, AWaitingCallEndsWithItsRequestOrItsCallerHoldingNothing) {
  MakeDecoder(1);
  Register("a");
  Register("b");
  Register("c");
  Answer a, b, c;
  ReserveOrWait("a", a);
  ASSERT_TRUE(a.Get().ok());
  const uint32_t free_blocks = FreeBlocks();
  EXPECT_NE(ReserveOrWait("b", b), 0u);
  const uint64_t ticket_c = ReserveOrWait("c", c);
  EXPECT_NE(ticket_c, 0u);
  decoder_->Cancel("b");  // its stream went away
  ASSERT_TRUE(b.Has());
  EXPECT_EQ(b.Get().status().code(), StatusCode::kCancelled);
  decoder_->AbandonReserve(ticket_c);  // its caller went away
  ASSERT_TRUE(c.Has());
  EXPECT_EQ(c.Get().status().code(), StatusCode::kCancelled);
  decoder_->AbandonReserve(ticket_c);  // once only
  EXPECT_EQ(c.calls(), 1);
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.seats_taken, 1u);
  EXPECT_EQ(counts.reservations, 1u);
  EXPECT_EQ(FreeBlocks(), free_blocks);
  // c is still registered and reserves once a seat frees.
  decoder_->Cancel("a");
  auto t = decoder_->Reserve("c", "p", PromptOf("c"));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
}

TEST_F(DecodeSeatsTest, AWaitThatRunsOutIsRefusedAndCounted) {
  MakeDecoder(1);
  Register("a");
  Register("b");
  Answer a, b;
  ReserveOrWait("a", a);
  ASSERT_TRUE(a.Get().ok());
  EXPECT_NE(ReserveOrWait("b", b, 50ms), 0u);
  ASSERT_TRUE(WaitFor([&] { return b.Has(); }));
  EXPECT_EQ(b.Get().status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.Get().status().message().find("scheduler.max_num_seqs 1"), std::string::npos)
      << b.Get().status().message();
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserve_waits_expired, 1u);
  EXPECT_EQ(counts.reservations_refused, 1u);
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 1u);
}

TEST_F(DecodeSeatsTest, StopAnswersEveryWaitingCallUnavailable) {
  MakeDecoder(1);
  Register("a");
  Register("b");
  Answer a, b, late;
  ReserveOrWait("a", a);
  EXPECT_NE(ReserveOrWait("b", b), 0u);
  decoder_->Stop();
  ASSERT_TRUE(b.Has());
  EXPECT_EQ(b.Get().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(ReserveOrWait("b", late), 0u);  // after Stop: answered at once
  EXPECT_EQ(late.Get().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(FreeBlocks(), 32u);
}

TEST_F(DecodeSeatsTest, NoLimitWithoutMaxSeats) {
  MakeDecoder(0);
  for (const char* id : {"a", "b", "c", "d"}) {
    Register(id);
    Answer answer;
    EXPECT_EQ(ReserveOrWait(id, answer), 0u);
    EXPECT_TRUE(answer.Get().ok());
  }
  EXPECT_EQ(decoder_->counts().seats_taken, 4u);
  EXPECT_EQ(decoder_->counts().reserve_waits, 0u);
}

// The noted gap of session 23: with more seats than the pool's blocks hold
// at once, a burst was refused RESOURCE_EXHAUSTED where vLLM would queue.
TEST_F(DecodeSeatsTest, AReserveShortOfKvBlocksWaitsAndGetsThemWhenARequestEnds) {
  MakeDecoder(0);  // no seat limit: only the pool's 32 blocks (2 per prompt)
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  const auto targets = ReserveMany(16, &sinks);
  ASSERT_EQ(targets.size(), 16u);
  EXPECT_EQ(FreeBlocks(), 0u);
  Register("w");
  Answer w;
  EXPECT_NE(ReserveOrWait("w", w), 0u);
  EXPECT_FALSE(w.Has());
  auto counts = decoder_->counts();
  EXPECT_EQ(counts.kv_waits, 1u);
  EXPECT_EQ(counts.reserve_waits, 0u);  // no seat wait
  EXPECT_EQ(counts.reserves_waiting, 1u);
  EXPECT_EQ(counts.reservations_refused, 0u);
  // The sync Reserve does not pass the waiting call: refused, nothing held.
  Register("s");
  const auto s = decoder_->Reserve("s", "p", PromptOf("s"));
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.status().message().find("1 earlier reserve calls wait"), std::string::npos)
      << s.status().message();
  // r0 decodes to its end: its blocks come free and go to w.
  decoder_->OnKvNotice(SuccessNotice(targets[0], 9));
  ASSERT_TRUE(WaitFor([&] { return sinks[0]->Ended(); }));
  EXPECT_TRUE(sinks[0]->finished);
  ASSERT_TRUE(WaitFor([&] { return w.Has(); }));
  const auto target = w.Get();
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  EXPECT_EQ(target->request_id, "w");
  EXPECT_EQ(target->slots.size(), 2u);
  EXPECT_EQ(w.calls(), 1);
  counts = decoder_->counts();
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 16u);  // r1..r15 and w
  EXPECT_EQ(counts.kv_waits, 1u);
  EXPECT_EQ(counts.reservations_refused, 1u);  // s
  EXPECT_EQ(FreeBlocks(), 0u);
}

TEST_F(DecodeSeatsTest, CallsShortOfKvBlocksGoInArrivalOrderAsReservationsAreReleased) {
  MakeDecoder(0);
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  const auto targets = ReserveMany(16, &sinks);
  ASSERT_EQ(targets.size(), 16u);
  Register("x");
  Register("y");
  Register("z");
  Answer x, y, z;
  EXPECT_NE(ReserveOrWait("x", x), 0u);
  EXPECT_NE(ReserveOrWait("y", y), 0u);
  EXPECT_NE(ReserveOrWait("z", z), 0u);
  // x was refused blocks; y and z wait in line behind it, untried.
  auto counts = decoder_->counts();
  EXPECT_EQ(counts.kv_waits, 1u);
  EXPECT_EQ(counts.reserve_waits, 0u);
  EXPECT_EQ(counts.reserves_waiting, 3u);
  // z's stream goes away while it waits: CANCELLED, nothing held.
  decoder_->Cancel("z");
  ASSERT_TRUE(z.Has());
  EXPECT_EQ(z.Get().status().code(), StatusCode::kCancelled);
  // r0's prefiller gives up: its two blocks go to x, the earlier call.
  GiveUp(targets[0]);
  ASSERT_TRUE(WaitFor([&] { return x.Has(); }));
  ASSERT_TRUE(x.Get().ok()) << x.Get().status().ToString();
  EXPECT_FALSE(y.Has());
  EXPECT_EQ(decoder_->counts().reserves_waiting, 1u);
  // r1's stream goes away while its prefiller may be writing: the blocks
  // stay held until its notice; then they go to y.
  decoder_->Cancel("r1");
  EXPECT_EQ(FreeBlocks(), 0u);
  EXPECT_FALSE(y.Has());
  GiveUp(targets[1]);
  ASSERT_TRUE(WaitFor([&] { return y.Has(); }));
  ASSERT_TRUE(y.Get().ok()) << y.Get().status().ToString();
  counts = decoder_->counts();
  EXPECT_EQ(counts.kv_waits, 2u);  // x, and y once first in line
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 16u);  // r2..r15, x, y
  EXPECT_EQ(counts.reservations_refused, 0u);
  EXPECT_EQ(FreeBlocks(), 0u);
}

// A retry of a request that holds its seat (a second prefiller takes it
// over) needs blocks, not a seat: blocks that come free while every seat is
// taken (a reservation an earlier retry left behind is released) go to it
// at once (until session 25 it waited for a seat it did not need).
TEST_F(DecodeSeatsTest, ARetryShortOfKvBlocksIsServedWithoutAFreeSeat) {
  MakeDecoder(2);
  const auto reg = [&](const std::string& id, uint32_t seed) {
    DecodeSpec s;
    s.request_id = id;
    s.prompt_ids = Prompt(160, seed);  // 10 blocks
    s.sampling = Greedy(3);
    EXPECT_TRUE(decoder_->Register(s, std::make_shared<RecordingSink>()).ok());
    return s.prompt_ids;
  };
  const std::vector<uint32_t> a = reg("a", 1);
  const std::vector<uint32_t> b = reg("b", 2);
  auto first = decoder_->Reserve("a", "p1", a);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(decoder_->Reserve("b", "p", b).ok());
  // p2 takes a over: 10 more blocks (p1's stay held until its notice).
  ASSERT_TRUE(decoder_->Reserve("a", "p2", a).ok());
  EXPECT_EQ(FreeBlocks(), 2u);
  // p3 takes a over as well: short of blocks, it waits.
  Answer third;
  EXPECT_NE(decoder_->ReserveOrWait("a", "p3", a, {}, {}, std::chrono::steady_clock::now() + 5s,
                                    third.Done()),
            0u);
  EXPECT_FALSE(third.Has());
  auto counts = decoder_->counts();
  EXPECT_EQ(counts.kv_waits, 1u);
  EXPECT_EQ(counts.seats_taken, 2u);
  // p1's notice releases its reservation: 12 blocks free, no seat.
  GiveUp(*first);
  ASSERT_TRUE(WaitFor([&] { return third.Has(); }));
  const auto target = third.Get();
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  EXPECT_EQ(target->slots.size(), 10u);
  counts = decoder_->counts();
  EXPECT_EQ(counts.seats_taken, 2u);
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 3u);  // b, a's by p2 (until its notice) and by p3
  EXPECT_EQ(counts.reservations_refused, 0u);
  EXPECT_EQ(FreeBlocks(), 2u);
}

// tandem_decode_reserve_wait_seconds: every Reserve call that got its
// reservation, with the time it waited here (0 for one reserved at once);
// a refused call is not observed.
TEST_F(DecodeSeatsTest, TheReserveWaitHistogramHasEachReservationsWait) {
  MetricsRegistry registry({"m", "decode", "seats-unit"});
  const std::vector<double> bounds = {0.001, 0.01, 0.1, 1, 10};
  HeldHistogram wait(registry, "tandem_decode_reserve_wait_seconds", "wait", bounds);
  auto& series = registry.Histogram("tandem_decode_reserve_wait_seconds", "wait", bounds);
  const auto observed = [&] {
    registry.RunCollectHooks();
    return series.Collect().histogram;
  };
  MakeDecoder(1, &wait);
  Register("a");
  Register("b");
  Register("c");
  Answer a, b, c;
  EXPECT_EQ(ReserveOrWait("a", a), 0u);  // at once
  ASSERT_TRUE(a.Get().ok());
  EXPECT_EQ(observed().sample_count, 1u);
  EXPECT_EQ(observed().sample_sum, 0.0);
  const auto queued = std::chrono::steady_clock::now();
  EXPECT_NE(ReserveOrWait("b", b), 0u);  // waits for a's seat
  EXPECT_NE(ReserveOrWait("c", c, 1ms), 0u);  // waits, then is refused
  ASSERT_TRUE(WaitFor([&] { return c.Has(); }));
  EXPECT_EQ(c.Get().status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(observed().sample_count, 1u);  // refused: not observed
  // A sync Reserve refused (no seat): not observed either.
  EXPECT_FALSE(decoder_->Reserve("c", "p", PromptOf("c")).ok());
  EXPECT_EQ(observed().sample_count, 1u);
  // b's wait, bounded by the test's own clock.
  decoder_->Cancel("a");
  ASSERT_TRUE(WaitFor([&] { return b.Has(); }));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count();
  ASSERT_TRUE(b.Get().ok()) << b.Get().status().ToString();
  const auto h = observed();
  EXPECT_EQ(h.sample_count, 2u);
  EXPECT_GT(h.sample_sum, 0.0);
  EXPECT_LE(h.sample_sum, waited);
  // A sync Reserve that gets its reservation counts 0.
  decoder_->Cancel("b");
  ASSERT_TRUE(WaitFor([&] { return decoder_->counts().seats_taken == 0; }));
  EXPECT_TRUE(decoder_->Reserve("c", "p", PromptOf("c")).ok());
  EXPECT_EQ(observed().sample_count, 3u);
  EXPECT_EQ(observed().sample_sum, h.sample_sum);
}

TEST_F(DecodeSeatsTest, AWaitForKvBlocksThatRunsOutIsRefusedNamingTheBlocks) {
  MakeDecoder(0);
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  ASSERT_EQ(ReserveMany(16, &sinks).size(), 16u);
  Register("w");
  Answer w;
  EXPECT_NE(ReserveOrWait("w", w, 50ms), 0u);
  ASSERT_TRUE(WaitFor([&] { return w.Has(); }));
  const Status s = w.Get().status();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("no KV blocks came free for its 20-token prompt"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("0 of 32 blocks free"), std::string::npos) << s.message();
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserve_waits_expired, 1u);
  EXPECT_EQ(counts.reservations_refused, 1u);
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 16u);
  EXPECT_EQ(FreeBlocks(), 0u);
}

// A reservation that will not decode stops counting its growth in the
// growth reserve at once (session 28), though its blocks stay held until
// its prefiller's notice (docs/failure-handling.md "Quarantine"): `a`, to
// generate 200 tokens, makes the reserve keep blocks free; once the other
// reservations leave too few beside them, `w` waits though its 2 blocks are
// free. Cancelling `a` (orphaned: its prefiller may still write) lets `w`
// reserve at once, before `a`'s blocks come back. Before, `w` waited for
// `a`'s notice (or its own wait's end, then refused).
TEST_F(DecodeSeatsTest, AReservationThatWillNotDecodeLeavesTheGrowthReserve) {
  MakeDecoder(0);
  Register("a", /*max_tokens=*/200);
  Answer a;
  EXPECT_EQ(ReserveOrWait("a", a), 0u);
  ASSERT_TRUE(a.Has() && a.Get().ok());
  const uint32_t reserve = node_->engine->stats().growth_reserve_blocks;
  ASSERT_GT(reserve, 2u);  // ratio x (219 - 32) tokens
  // 2-block reservations (3 tokens to generate: no growth) until one, w,
  // waits.
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  std::deque<Answer> answers;  // stable: a waiting call holds its Answer
  for (int i = 0; i < 16; ++i) {
    const std::string id = fmt::format("r{}", i);
    sinks.push_back(Register(id));
    if (ReserveOrWait(id, answers.emplace_back()) != 0) break;
    ASSERT_TRUE(answers.back().Has() && answers.back().Get().ok()) << id;
  }
  Answer& w = answers.back();
  ASSERT_FALSE(w.Has());
  const uint32_t free_blocks = FreeBlocks();
  EXPECT_GE(free_blocks, 2u);  // it fits but for the reserve
  decoder_->Cancel("a");
  ASSERT_TRUE(WaitFor([&] { return w.Has(); }));
  ASSERT_TRUE(w.Get().ok()) << w.Get().status().ToString();
  EXPECT_EQ(FreeBlocks(), free_blocks - 2);  // a's blocks still held
  EXPECT_EQ(node_->engine->stats().growth_reserve_blocks, 0u);
  // a's prefiller gives up: its blocks come back.
  GiveUp(*a.Get());
  EXPECT_EQ(FreeBlocks(), free_blocks);
}

// A request cancelled while its step is in flight: Engine::Abort frees its
// blocks only after the step, so the waiting Reserves the cancel tried
// found none; the request's final output, which the decoder no longer
// tracks, then wakes them (session 28, found in a fleet run; before, the
// waiting call sat until its wait ran out and was refused).
TEST_F(DecodeSeatsTest, BlocksOfARequestCancelledDuringItsStepGoToTheWaitingReserve) {
  auto gate = std::make_shared<StepGate>();
  decoder_.reset();
  node_ = Node::Make("seats-unit-gate", 32, nullptr, [gate](engine::EngineOptions& o) {
    o.on_forward_for_tests = [gate] { gate->AtStep(); };
  });
  ASSERT_NE(node_, nullptr);
  GateRelease release{*gate};  // never leave the engine thread held
  MakeDecoder(0);
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  const auto targets = ReserveMany(16, &sinks);  // the whole pool
  ASSERT_EQ(targets.size(), 16u);
  Register("w");
  Answer w;
  EXPECT_NE(ReserveOrWait("w", w, 60s), 0u);
  EXPECT_FALSE(w.Has());
  // r0's KV lands: it decodes, and its first step is held in flight.
  gate->Hold();
  decoder_->OnKvNotice(SuccessNotice(targets[0], 9));
  ASSERT_TRUE(gate->WaitParked());
  decoder_->Cancel("r0");  // the engine finishes it after the step
  EXPECT_FALSE(w.Has());
  EXPECT_EQ(FreeBlocks(), 0u);
  EXPECT_EQ(decoder_->counts().reserves_waiting, 1u);
  gate->Release();
  ASSERT_TRUE(WaitFor([&] { return w.Has(); }));
  ASSERT_TRUE(w.Get().ok()) << w.Get().status().ToString();
  EXPECT_EQ(w.Get()->slots.size(), 2u);
  const auto counts = decoder_->counts();
  EXPECT_EQ(counts.reserves_waiting, 0u);
  EXPECT_EQ(counts.reservations, 16u);  // r1..r15 and w
  EXPECT_EQ(FreeBlocks(), 0u);
}

}  // namespace
}  // namespace tandem::worker_test
