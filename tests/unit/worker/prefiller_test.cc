// The prefiller core without gRPC: a fake DecoderLink answers Reserve with
// the slots of a second loopback transport ("the decoder's pool"), so the
// pushed bytes and the notice can be checked.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <map>
#include <sstream>

#include "prefiller/prefiller.h"
#include "worker_test_util.h"

namespace tandem::worker_test {
namespace {

using prefiller::NoticeSpec;
using prefiller::PrefillerOptions;
using prefiller::PrefillJob;
using prefiller::PrefillResult;
using prefiller::ReserveTarget;

// Encodes notices as "id|reservation|generation|first|code".
class FakeLink final : public prefiller::DecoderLink {
 public:
  void Reserve(const PrefillJob& job, const std::string&, ReserveDone done) override {
    std::lock_guard lock(mu_);
    ++reserves;
    pending.push_back(std::move(done));
    pending_ids.push_back(job.request_id);
    max_pending = std::max(max_pending, pending.size());
    last_prompt = job.prompt_ids;
  }
  std::string EncodeNotice(const NoticeSpec& n) override {
    std::ostringstream s;
    s << n.request_id << "|" << n.reservation_id << "|" << n.generation << "|" << n.first_token_id
      << "|" << static_cast<int>(n.error.code());
    return s.str();
  }
  // Answers the oldest pending Reserve (on another thread, as gRPC would).
  void Answer(Result<ReserveTarget> r) {
    ReserveDone done;
    {
      std::lock_guard lock(mu_);
      ASSERT_FALSE(pending.empty());
      done = std::move(pending.front());
      pending.erase(pending.begin());
      pending_ids.erase(pending_ids.begin());
    }
    std::thread([done = std::move(done), r = std::move(r)]() mutable { done(std::move(r)); }).join();
  }
  // Answers the pending Reserve of request `id`.
  void AnswerId(const std::string& id, Result<ReserveTarget> r) {
    ReserveDone done;
    {
      std::lock_guard lock(mu_);
      auto it = std::find(pending_ids.begin(), pending_ids.end(), id);
      ASSERT_NE(it, pending_ids.end()) << "no Reserve pending for " << id;
      done = std::move(pending[it - pending_ids.begin()]);
      pending.erase(pending.begin() + (it - pending_ids.begin()));
      pending_ids.erase(it);
    }
    std::thread([done = std::move(done), r = std::move(r)]() mutable { done(std::move(r)); }).join();
  }
  std::vector<std::string> PendingIds() {
    std::lock_guard lock(mu_);
    return pending_ids;
  }
  void SetSeatWaitHandler(SeatWait handler) override {
    std::lock_guard lock(mu_);
    seat_wait = std::move(handler);
  }
  // The decoder holds `id`'s call waiting for a seat (as the TCP link reports it).
  void SeatWaitFor(const std::string& id) {
    SeatWait handler;
    {
      std::lock_guard lock(mu_);
      handler = seat_wait;
    }
    ASSERT_TRUE(handler) << "the prefiller set no seat-wait handler";
    std::thread([&] { handler(id); }).join();
  }
  size_t NumPending() {
    std::lock_guard lock(mu_);
    return pending.size();
  }
  int Reserves() {
    std::lock_guard lock(mu_);
    return reserves;
  }
  void SetLateTargetHandler(LateTarget handler) override {
    std::lock_guard lock(mu_);
    late = std::move(handler);
  }
  // A target that came after its call ended (as the TCP link reports it).
  void Late(const std::string& request_id, ReserveTarget t) {
    LateTarget handler;
    {
      std::lock_guard lock(mu_);
      handler = late;
    }
    ASSERT_TRUE(handler) << "the prefiller set no late-target handler";
    std::thread([&] { handler(request_id, std::move(t)); }).join();
  }

  std::mutex mu_;
  int reserves = 0;
  size_t max_pending = 0;  // Reserves in flight at once, at most
  std::vector<ReserveDone> pending;
  std::vector<std::string> pending_ids;  // pending's request ids
  std::vector<uint32_t> last_prompt;
  LateTarget late;
  SeatWait seat_wait;
};

class PrefillerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = Node::Make("prefill-unit", 64, progress_);
    ASSERT_NE(node_, nullptr);
    kvtransfer::TransportOptions o;
    o.backend = "loopback";
    o.agent_name = "decode-target";
    o.block_bytes = TinyLayout().block_bytes();
    o.num_blocks = 16;
    auto t = kvtransfer::CreateTransport(o);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    target_ = std::move(t).value();
    target_->SetNotificationCallback([this](kvtransfer::Notification n) {
      std::lock_guard lock(mu_);
      notices_.push_back(n.payload);
    });
  }
  // `max_batched_tokens`: the prompt tokens reserving at once (one request
  // always); the default, one 20-token test prompt, dispatches one at a time.
  void MakePrefiller(uint32_t max_queue = 8,
                     prefiller::PushMode mode = prefiller::PushMode::kStreaming,
                     uint32_t max_batched_tokens = 20) {
    PrefillerOptions o;
    o.name = "prefill-unit";
    o.max_queue = max_queue;
    o.push_mode = mode;
    o.max_batched_tokens = max_batched_tokens;
    o.engine_progress = progress_;  // the dispatcher waits for the engine's events, no polling
    prefiller_ = std::make_unique<prefiller::Prefiller>(*node_->engine, *node_->transport, link_, o);
    prefiller_->Start();
  }
  PrefillJob Job(const std::string& id, const std::vector<uint32_t>& prompt) {
    PrefillJob j;
    j.request_id = id;
    j.prompt_ids = prompt;
    j.sampling = Greedy(4);
    j.decoder_address = "fake:1";
    j.decoder_name = "fake";
    return j;
  }
  // Submits `jobs` in order (the first is dispatched at once and the others
  // queue behind its reservation), refuses each Reserve in turn, and returns
  // the jobs' ids in the order the service queue dispatched them; every job
  // then ended RESOURCE_EXHAUSTED, so nothing reached the engine.
  std::vector<std::string> DispatchOrder(std::vector<PrefillJob> jobs) {
    // Shared with the callbacks: a job still queued when a check below
    // fails ends later, in the prefiller's Stop.
    auto done = std::make_shared<std::vector<std::promise<Result<PrefillResult>>>>(jobs.size());
    std::map<std::vector<uint32_t>, std::string> by_prompt;
    std::vector<std::string> order;
    for (size_t i = 0; i < jobs.size(); ++i) {
      by_prompt[jobs[i].prompt_ids] = jobs[i].request_id;
      const Status st = prefiller_->Submit(std::move(jobs[i]), [done, i](Result<PrefillResult> r) {
        (*done)[i].set_value(std::move(r));
      });
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return order;
      if (i == 0 && !WaitFor([&] { return link_.NumPending() == 1; })) return order;
    }
    for (size_t i = 0; i < done->size(); ++i) {
      if (!WaitFor([&] { return link_.NumPending() == 1; })) {
        ADD_FAILURE() << "no Reserve for the job dispatched " << i << "th";
        return order;
      }
      {
        std::lock_guard lock(link_.mu_);
        order.push_back(by_prompt[link_.last_prompt]);
      }
      link_.Answer(ResourceExhaustedError("no room"));
    }
    for (auto& d : *done) {
      EXPECT_EQ(d.get_future().get().status().code(), StatusCode::kResourceExhausted);
    }
    return order;
  }
  ReserveTarget Target(std::vector<uint32_t> slots, uint32_t cached, uint64_t reservation = 42) {
    ReserveTarget t;
    t.reservation_id = reservation;
    t.generation = target_->generation();
    t.transport_descriptor = target_->LocalDescriptor();
    t.slots = std::move(slots);
    t.cached_blocks = cached;
    return t;
  }
  std::vector<std::string> Notices() {
    std::lock_guard lock(mu_);
    return notices_;
  }
  bool BlockIsZero(uint32_t slot) {
    const std::byte* p = target_->block(slot);
    for (uint64_t i = 0; i < target_->block_bytes(); ++i) {
      if (p[i] != std::byte{0}) return false;
    }
    return true;
  }

  std::shared_ptr<prefiller::EngineProgress> progress_ = std::make_shared<prefiller::EngineProgress>();
  std::unique_ptr<Node> node_;
  std::unique_ptr<kvtransfer::Transport> target_;
  FakeLink link_;
  std::unique_ptr<prefiller::Prefiller> prefiller_;
  std::mutex mu_;
  std::vector<std::string> notices_;
};

TEST_F(PrefillerTest, PushesOnlyTheBlocksTheDecoderLacksThenTheNotice) {
  MakePrefiller();
  const auto prompt = Prompt(40, 1);  // 3 blocks, the last one partial
  std::promise<Result<PrefillResult>> done;
  ASSERT_TRUE(prefiller_->Submit(Job("a", prompt), [&](Result<PrefillResult> r) {
    done.set_value(std::move(r));
  }).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  EXPECT_EQ(link_.last_prompt, prompt);
  link_.Answer(Target({5, 6, 7}, /*cached=*/1));
  auto r = done.get_future().get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->transferred_blocks, 2u);
  EXPECT_EQ(r->decoder_cached_blocks, 1u);
  EXPECT_EQ(r->transferred_bytes, 2 * target_->block_bytes());
  EXPECT_GT(r->prefill_seconds, 0);
  EXPECT_TRUE(BlockIsZero(5));  // the decoder had it: not written
  EXPECT_FALSE(BlockIsZero(6));
  EXPECT_FALSE(BlockIsZero(7));
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; }));
  EXPECT_EQ(Notices()[0], "a|42|" + std::to_string(target_->generation()) + "|" +
                              std::to_string(r->first_token_id) + "|0");
  // Everything is released: parked blocks back to the cache.
  ASSERT_TRUE(WaitFor([&] { return node_->engine->stats().num_parked == 0; }));
  EXPECT_EQ(node_->engine->stats().free_blocks, 64u);
  EXPECT_EQ(prefiller_->counts().inflight, 0u);
}

// A push this prefiller's transport refuses to prepare (here: slots past
// the decoder's pool of 16 blocks) would be refused again however often the
// proxy retried it: INTERNAL (not retried), not UNAVAILABLE (re-routed, a
// new prefill each time). The decoder hears, and nothing stays held.
TEST_F(PrefillerTest, APushRefusedAsInvalidHereFailsInternalAndIsNotAnUnavailableDecoder) {
  for (const auto mode : {prefiller::PushMode::kStreaming, prefiller::PushMode::kAfterPrefill}) {
    SCOPED_TRACE(mode == prefiller::PushMode::kStreaming ? "streaming" : "after prefill");
    MakePrefiller(/*max_queue=*/8, mode);
    const size_t notices = Notices().size();
    std::promise<Result<PrefillResult>> done;
    ASSERT_TRUE(prefiller_->Submit(Job("bad", Prompt(40, 3)), [&](Result<PrefillResult> r) {
      done.set_value(std::move(r));
    }).ok());
    ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
    link_.Answer(Target({100, 101, 102}, /*cached=*/0, /*reservation=*/9));
    auto r = done.get_future().get();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status().ToString();
    for (const char* part : {"decoder 'fake'", "could not be prepared", "ERR_INVALID_ARGUMENT",
                             "outside the pools", "not retried"}) {
      EXPECT_NE(r.status().message().find(part), std::string::npos) << part << ": " << r.status().ToString();
    }
    // The decoder is told, so that it frees the reservation at once.
    ASSERT_TRUE(WaitFor([&] { return Notices().size() == notices + 1; }));
    EXPECT_EQ(Notices().back(), "bad|9|" + std::to_string(target_->generation()) + "|0|" +
                                    std::to_string(static_cast<int>(StatusCode::kInternal)));
    ASSERT_TRUE(WaitFor([&] { return node_->engine->stats().num_parked == 0; }));
    EXPECT_EQ(node_->engine->stats().free_blocks, 64u);
    EXPECT_EQ(prefiller_->counts().inflight, 0u);
    EXPECT_EQ(prefiller_->counts().dropped_target_lost, 0u);  // not a lost decoder
    prefiller_->Stop();
  }
}

// A prompt of three 64-token chunks: streamed per chunk and layer group, the
// decoder's slots end up with the same bytes as one push after the prefill.
TEST_F(PrefillerTest, StreamingPushWritesTheSameBytesAsAfterPrefill) {
  const auto prompt = Prompt(150, 7);  // 10 blocks, the last one partial
  auto run = [&](prefiller::PushMode mode, std::vector<uint32_t> slots, const std::string& id) {
    MakePrefiller(8, mode);
    std::promise<Result<PrefillResult>> done;
    EXPECT_TRUE(prefiller_->Submit(Job(id, prompt), [&](Result<PrefillResult> r) {
      done.set_value(std::move(r));
    }).ok());
    EXPECT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
    link_.Answer(Target(std::move(slots), /*cached=*/0));
    auto r = done.get_future().get();
    prefiller_.reset();
    return r;
  };
  std::vector<uint32_t> a, b;
  for (uint32_t i = 0; i < 10; ++i) {
    a.push_back(i);
    b.push_back(15 - i);  // reversed: no two slots coalesce
  }
  auto s = run(prefiller::PushMode::kStreaming, a, "s");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto f = run(prefiller::PushMode::kAfterPrefill, {10, 11, 12, 13, 14, 15, 6, 7, 8, 9}, "f");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(s->first_token_id, f->first_token_id);
  EXPECT_EQ(s->transferred_bytes, 10 * target_->block_bytes());
  EXPECT_GE(s->transfers, 3u);  // at least one per chunk
  EXPECT_EQ(f->transfers, 1u);
  // Slots 0..9 hold the streamed blocks; the second run overwrote 6..15,
  // so compare the streamed blocks 0..5 with the second run's 10..15.
  for (uint32_t i = 0; i < 6; ++i) {
    EXPECT_EQ(std::memcmp(target_->block(i), target_->block(10 + i), target_->block_bytes()), 0)
        << "block " << i;
    EXPECT_FALSE(BlockIsZero(i));
  }
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 2; }));
}

TEST_F(PrefillerTest, RefusedReservationIsResourceExhaustedAndNothingRuns) {
  MakePrefiller();
  std::promise<Result<PrefillResult>> done;
  ASSERT_TRUE(prefiller_->Submit(Job("a", Prompt(30, 2)), [&](Result<PrefillResult> r) {
    done.set_value(std::move(r));
  }).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  link_.Answer(ResourceExhaustedError("no room"));
  auto r = done.get_future().get();
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(node_->engine->stats().prefix_query_tokens, 0u);  // never reached the engine
  EXPECT_EQ(prefiller_->counts().reservations_refused, 1u);
}

TEST_F(PrefillerTest, OneReservationAtATimeAndAFullQueueRefusesAtOnce) {
  MakePrefiller(/*max_queue=*/1);
  std::atomic<int> finished{0};
  auto count = [&](Result<PrefillResult>) { ++finished; };
  ASSERT_TRUE(prefiller_->Submit(Job("a", Prompt(20, 3)), count).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  // "a" is reserving; "b" waits in the queue without a reservation.
  ASSERT_TRUE(prefiller_->Submit(Job("b", Prompt(20, 4)), count).ok());
  EXPECT_EQ(prefiller_->Submit(Job("c", Prompt(20, 5)), count).code(),
            StatusCode::kResourceExhausted);
  // Cancel while queued: done at once (in Cancel), never reserved.
  prefiller_->Cancel("b");
  EXPECT_EQ(finished.load(), 1);
  // "d" queues behind "a" and is reserved only once "a"'s answer came:
  // waiting for its Reserve (the event) shows the order, and the link
  // never saw two at once.
  ASSERT_TRUE(prefiller_->Submit(Job("d", Prompt(20, 6)), count).ok());
  link_.Answer(ResourceExhaustedError("no room"));
  EXPECT_EQ(finished.load(), 2);
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1 && link_.reserves == 2; }));
  EXPECT_EQ(link_.max_pending, 1u);
  EXPECT_EQ(link_.last_prompt, Prompt(20, 6));  // "d", not the cancelled "b"
  link_.Answer(ResourceExhaustedError("no room"));
  EXPECT_EQ(finished.load(), 3);
  EXPECT_EQ(link_.reserves, 2);
}

// Requests that fit the engine's next step together are reserved together
// (docs/serving-workers.md): with a budget of 64 tokens, three 20-token
// prompts reserve at once and the fourth waits for an answer; a prompt
// larger than the budget is reserved alone. Before, the dispatcher reserved
// one request at a time, so the engine took one new prefill per step.
TEST_F(PrefillerTest, ReservesAStepsWorthOfRequestsAtOnce) {
  MakePrefiller(/*max_queue=*/8, prefiller::PushMode::kStreaming, /*max_batched_tokens=*/64);
  std::atomic<int> finished{0};
  auto count = [&](Result<PrefillResult> r) {
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    ++finished;
  };
  for (uint32_t i = 0; i < 4; ++i) {
    const std::string id = "small-" + std::to_string(i);
    ASSERT_TRUE(prefiller_->Submit(Job(id, Prompt(20, i + 1)), count).ok());
  }
  ASSERT_TRUE(prefiller_->Submit(Job("big", Prompt(100, 9)), count).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 3; }));
  EXPECT_EQ(prefiller_->counts().queued, 2u);  // small-3 and big
  link_.Answer(ResourceExhaustedError("no room"));
  // small-3 fits beside the two still reserving; big does not.
  ASSERT_TRUE(WaitFor([&] { return link_.Reserves() == 4; }));
  EXPECT_EQ(link_.NumPending(), 3u);
  EXPECT_EQ(link_.last_prompt, Prompt(20, 4));
  EXPECT_EQ(prefiller_->counts().queued, 1u);
  for (int answered = 1; answered < 4; ++answered) {
    EXPECT_EQ(link_.Reserves(), 4) << "big was reserved beside " << 4 - answered << " others";
    link_.Answer(ResourceExhaustedError("no room"));
  }
  // Alone now: larger than the budget, and reserved all the same.
  ASSERT_TRUE(WaitFor([&] { return link_.Reserves() == 5 && link_.NumPending() == 1; }));
  EXPECT_EQ(link_.last_prompt, Prompt(100, 9));
  link_.Answer(ResourceExhaustedError("no room"));
  EXPECT_EQ(finished.load(), 5);
  EXPECT_EQ(link_.max_pending, 3u);
  EXPECT_EQ(node_->engine->stats().prefix_query_tokens, 0u);  // nothing reached the engine
}

// Decode seats (docs/serving-workers.md): a call that waits on its decoder
// for a seat leaves the admission budget, so that a request for another
// decoder is reserved meanwhile; a later request for the waiting decoder
// keeps its place in the queue until that call is answered. Before, the
// waiting call held the budget (here: one request) and every request behind
// it waited, whichever its decoder.
TEST_F(PrefillerTest, ACallWaitingForASeatLeavesTheBudgetAndHoldsBackOnlyItsDecoder) {
  MakePrefiller(/*max_queue=*/8);  // a budget of one 20-token request
  std::atomic<int> finished{0};
  auto count = [&](Result<PrefillResult> r) {
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    ++finished;
  };
  auto job = [&](const std::string& id, uint32_t seed, const std::string& decoder) {
    PrefillJob j = Job(id, Prompt(20, seed));
    j.decoder_address = decoder;
    return j;
  };
  ASSERT_TRUE(prefiller_->Submit(job("x1", 1, "decoder-x:1"), count).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  ASSERT_TRUE(prefiller_->Submit(job("x2", 2, "decoder-x:1"), count).ok());
  ASSERT_TRUE(prefiller_->Submit(job("y1", 3, "decoder-y:1"), count).ok());
  ASSERT_TRUE(prefiller_->Submit(job("y2", 4, "decoder-y:1"), count).ok());
  EXPECT_EQ(prefiller_->counts().queued, 3u);
  // x1 waits on decoder x: y1 is reserved, x2 (earlier) is held back.
  link_.SeatWaitFor("x1");
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 2; }));
  EXPECT_EQ(link_.PendingIds(), (std::vector<std::string>{"x1", "y1"}));
  EXPECT_EQ(prefiller_->counts().reserve_seat_waits, 1u);
  link_.SeatWaitFor("x1");  // told twice: counted once
  EXPECT_EQ(prefiller_->counts().reserve_seat_waits, 1u);
  // y1's answer frees the budget: y2 goes before x2, whose decoder still
  // holds x1.
  link_.AnswerId("y1", ResourceExhaustedError("no room"));
  ASSERT_TRUE(WaitFor([&] { return link_.Reserves() == 3; }));
  EXPECT_EQ(link_.PendingIds(), (std::vector<std::string>{"x1", "y2"}));
  // x1 answered: x2 is reserved once the budget has room (y2's answer).
  link_.AnswerId("x1", ResourceExhaustedError("no seat came free"));
  link_.AnswerId("y2", ResourceExhaustedError("no room"));
  ASSERT_TRUE(WaitFor([&] { return link_.Reserves() == 4; }));
  EXPECT_EQ(link_.PendingIds(), std::vector<std::string>{"x2"});
  link_.AnswerId("x2", ResourceExhaustedError("no room"));
  EXPECT_EQ(finished.load(), 4);
  EXPECT_EQ(prefiller_->counts().inflight, 0u);
  EXPECT_EQ(link_.max_pending, 2u);
}

TEST_F(PrefillerTest, CancelWhileReservingTellsTheDecoderToFreeTheSlots) {
  MakePrefiller();
  std::promise<Result<PrefillResult>> done;
  ASSERT_TRUE(prefiller_->Submit(Job("a", Prompt(20, 6)), [&](Result<PrefillResult> r) {
    done.set_value(std::move(r));
  }).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  prefiller_->Cancel("a");
  link_.Answer(Target({1, 2}, 0, /*reservation=*/7));
  auto r = done.get_future().get();
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled);
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; }));
  EXPECT_EQ(Notices()[0], "a|7|" + std::to_string(target_->generation()) + "|0|" +
                              std::to_string(static_cast<int>(StatusCode::kCancelled)));
  EXPECT_TRUE(BlockIsZero(1));
  EXPECT_TRUE(BlockIsZero(2));
}

// A decoder's target that came after the Reserve call had ended here (its
// deadline passed while this process was stopped): the job is over, nothing
// writes into those slots, and the decoder hears so at once (an error
// notice), instead of keeping them quarantined until this prefiller dies.
TEST_F(PrefillerTest, ATargetAfterTheReserveCallEndedIsGivenBackAtOnce) {
  MakePrefiller();
  std::promise<Result<PrefillResult>> done;
  ASSERT_TRUE(prefiller_->Submit(Job("a#1", Prompt(20, 6)), [&](Result<PrefillResult> r) {
    done.set_value(std::move(r));
  }).ok());
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  link_.Answer(DeadlineExceededError("Deadline Exceeded"));
  EXPECT_EQ(done.get_future().get().status().code(), StatusCode::kDeadlineExceeded);
  link_.Late("a#1", Target({1, 2}, 0, /*reservation=*/9));
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; }));
  EXPECT_EQ(Notices()[0], "a#1|9|" + std::to_string(target_->generation()) + "|0|" +
                              std::to_string(static_cast<int>(StatusCode::kDeadlineExceeded)));
  EXPECT_TRUE(BlockIsZero(1));
  EXPECT_TRUE(BlockIsZero(2));
}

// The prefiller's transport declares the decoder's endpoint lost at its
// first data write while the decoder is alive (TANDEM_KV_FAULT
// lose_peer_at=1): that request fails naming the decoder, the decoder still
// hears that its reservation is abandoned (an error notice over a fresh
// endpoint, so it can free the slots), and the next request to the same
// decoder is pushed over that fresh endpoint instead of the lost one.
TEST_F(PrefillerTest, DecoderEndpointDeclaredLostIsToldOverAFreshOneAndUsedAgain) {
  setenv(kvtransfer::kKvFaultEnv, "lose_peer_at=1,agent=prefill-lost", 1);
  auto node = Node::Make("prefill-lost", 64, progress_);
  unsetenv(kvtransfer::kKvFaultEnv);
  ASSERT_NE(node, nullptr);
  PrefillerOptions o;
  o.name = "prefill-lost";
  o.push_mode = prefiller::PushMode::kAfterPrefill;  // one data write per request
  o.engine_progress = progress_;
  prefiller::Prefiller p(*node->engine, *node->transport, link_, o);
  p.Start();
  auto run = [&](const std::string& id, uint32_t seed, ReserveTarget target) {
    std::promise<Result<PrefillResult>> done;
    EXPECT_TRUE(p.Submit(Job(id, Prompt(20, seed)), [&](Result<PrefillResult> r) {
      done.set_value(std::move(r));
    }).ok());
    EXPECT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
    link_.Answer(std::move(target));
    return done.get_future().get();
  };
  auto a = run("a", 8, Target({1, 2}, 0, /*reservation=*/7));
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(a.status().message().find("decoder 'fake'"), std::string::npos)
      << a.status().ToString();
  EXPECT_NE(a.status().message().find("ERR_REMOTE_DISCONNECT"), std::string::npos);
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 1; })) << "the decoder never heard";
  EXPECT_EQ(Notices()[0], "a|7|" + std::to_string(target_->generation()) + "|0|" +
                              std::to_string(static_cast<int>(StatusCode::kUnavailable)));
  auto b = run("b", 9, Target({3, 4}, 0, /*reservation=*/8));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_FALSE(BlockIsZero(3));
  EXPECT_FALSE(BlockIsZero(4));
  ASSERT_TRUE(WaitFor([&] { return Notices().size() == 2; }));
  EXPECT_EQ(Notices()[1], "b|8|" + std::to_string(target_->generation()) + "|" +
                              std::to_string(b->first_token_id) + "|0");
  // The lost endpoint was released: one live endpoint, the fresh one.
  EXPECT_TRUE(WaitFor([&] { return node->transport->stats().live_peers == 1; }));
  EXPECT_EQ(node->transport->stats().faults_injected, 1u);
  p.Stop();
}

// A prefiller for the Stop tests on `node` (stop_wait_seconds 50 ms) with
// `job` submitted; `dones` counts its ends and `status` holds the last.
struct StopCase {
  std::unique_ptr<prefiller::Prefiller> p;
  std::atomic<int> dones{0};
  Status status;
};
std::unique_ptr<StopCase> StartStopCase(Node& node, const std::string& name,
                                        prefiller::PushMode mode, prefiller::DecoderLink& link,
                                        std::shared_ptr<prefiller::EngineProgress> progress,
                                        PrefillJob job) {
  auto c = std::make_unique<StopCase>();
  PrefillerOptions o;
  o.name = name;
  o.push_mode = mode;
  o.engine_progress = std::move(progress);
  o.stop_wait_seconds = 0.05;
  c->p = std::make_unique<prefiller::Prefiller>(*node.engine, *node.transport, link, o);
  c->p->Start();
  StopCase* raw = c.get();
  EXPECT_TRUE(c->p->Submit(std::move(job), [raw](Result<PrefillResult> r) {
    raw->status = r.status();
    ++raw->dones;
  }).ok());
  return c;
}

// Stop with a push on the wire (its data write held back by TANDEM_KV_FAULT
// delay_ms, as a slow link would): Stop aborts it, and when its end does
// not come within stop_wait_seconds it ends the request itself, before it
// returns. The write's completion, which the transport runs after the
// prefiller is gone, runs nothing of the prefiller.
TEST_F(PrefillerTest, StopEndsAPushOnTheWireAndItsLateCompletionRunsNothing) {
  setenv(kvtransfer::kKvFaultEnv, "delay_ms=1000,delay_writes=1,agent=prefill-stop", 1);
  auto node = Node::Make("prefill-stop", 64, progress_);
  unsetenv(kvtransfer::kKvFaultEnv);
  ASSERT_NE(node, nullptr);
  auto c = StartStopCase(*node, "prefill-stop", prefiller::PushMode::kAfterPrefill, link_,
                         progress_, Job("a", Prompt(20, 8)));
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  link_.Answer(Target({1, 2}, 0, /*reservation=*/7));
  ASSERT_TRUE(WaitFor([&] { return node->transport->stats().faults_injected == 1; }))
      << "the data write never went on the wire";
  c->p->Stop();
  EXPECT_EQ(c->dones.load(), 1) << "Stop returned with the request still open";
  EXPECT_EQ(c->status.code(), StatusCode::kUnavailable) << c->status.ToString();
  EXPECT_NE(c->status.message().find("shutting down"), std::string::npos) << c->status.ToString();
  c->p.reset();
  // The held write lands, then ends ERR_CANCELED: its completion finds no prefiller.
  ASSERT_TRUE(WaitFor([&] { return node->transport->stats().inflight_requests == 0; }));
  EXPECT_EQ(c->dones.load(), 1);
  EXPECT_TRUE(Notices().empty()) << "a notice went out after Stop";
}

// A Reserve still unanswered at Stop: the request ends before Stop returns,
// and the answer that comes after the prefiller is gone runs nothing.
TEST_F(PrefillerTest, StopEndsAReserveInFlightAndItsLateAnswerRunsNothing) {
  auto c = StartStopCase(*node_, "prefill-unit", prefiller::PushMode::kStreaming, link_, progress_,
                         Job("a", Prompt(20, 6)));
  ASSERT_TRUE(WaitFor([&] { return link_.NumPending() == 1; }));
  c->p->Stop();
  EXPECT_EQ(c->dones.load(), 1) << "Stop returned with the request still open";
  EXPECT_EQ(c->status.code(), StatusCode::kUnavailable) << c->status.ToString();
  c->p.reset();
  link_.Answer(Target({1, 2}, 0, /*reservation=*/7));
  EXPECT_EQ(c->dones.load(), 1);
  EXPECT_EQ(node_->transport->stats().puts_posted, 0u);
  EXPECT_TRUE(Notices().empty());
}

TEST_F(PrefillerTest, ExpiredDeadlineIsRefusedAndDrainingRefusesNewWork) {
  MakePrefiller();
  PrefillJob j = Job("late", Prompt(10, 7));
  j.deadline = std::chrono::system_clock::now() - 1s;
  EXPECT_EQ(prefiller_->Submit(j, [](Result<PrefillResult>) {}).code(),
            StatusCode::kDeadlineExceeded);
  prefiller_->SetDraining();
  EXPECT_EQ(prefiller_->Submit(Job("x", Prompt(10, 8)), [](Result<PrefillResult>) {}).code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tandem::worker_test

namespace tandem::worker_test {
namespace {

// Issue 22 (docs/scheduling.md): the service queue dispatches by priority,
// then by fair share between tenants (charged with prompt tokens), then by
// arrival. Each Reserve is refused, so nothing reaches the engine.
TEST_F(PrefillerTest, ServiceQueueOrdersByPriorityThenFairShareThenArrival) {
  MakePrefiller();
  struct Spec {
    std::string id;
    int32_t priority;
    std::string tenant;
    uint32_t salt;
  };
  // "first" is dispatched at once (and charges tenant "a"); the others queue
  // behind its reservation.
  const std::vector<Spec> specs = {{"first", 10, "a", 1}, {"a-low", 10, "a", 2},
                                   {"b-low", 10, "b", 3}, {"a-high", 0, "a", 4},
                                   {"a-low2", 10, "a", 5}};
  std::vector<PrefillJob> jobs;
  for (const Spec& sp : specs) {
    jobs.push_back(Job(sp.id, Prompt(20, sp.salt)));
    jobs.back().priority = sp.priority;
    jobs.back().tenant = sp.tenant;
  }
  EXPECT_EQ(DispatchOrder(std::move(jobs)),
            (std::vector<std::string>{"first", "a-high", "b-low", "a-low", "a-low2"}));
  EXPECT_EQ(node_->engine->stats().free_blocks, 64u);
}

// A retry keeps its place (docs/scheduling.md): a request that the proxy
// says has waited 5 s (PrefillJob::waited, from PrefillRequest.waited_us)
// is served before one that reached this prefiller earlier but arrived at
// the proxy after it; equal keys keep their submission order. Before, the
// service queue ordered by arrival here only: a request retried after its
// prefiller died went to the back of the new one's queue.
TEST_F(PrefillerTest, ARetriedRequestKeepsItsPlaceInTheServiceQueue) {
  MakePrefiller();
  struct Spec {
    std::string id;
    std::chrono::microseconds waited;
    uint32_t salt;
  };
  const std::vector<Spec> specs = {{"first", {}, 1},
                                   {"later", {}, 2},
                                   {"retried", std::chrono::seconds(5), 3},
                                   {"retried-later", std::chrono::seconds(2), 4},
                                   {"last", {}, 5}};
  std::vector<PrefillJob> jobs;
  for (const Spec& sp : specs) {
    jobs.push_back(Job(sp.id, Prompt(20, sp.salt)));
    jobs.back().waited = sp.waited;
  }
  EXPECT_EQ(DispatchOrder(std::move(jobs)),
            (std::vector<std::string>{"first", "retried", "retried-later", "later", "last"}));
}

TEST(ArrivalKey, CountsTheWaitUpToTheBoundAndNeverReachesZero) {
  using std::chrono::microseconds;
  const auto now = std::chrono::steady_clock::time_point(std::chrono::hours(3));
  const uint64_t at = 3ull * 3600 * 1'000'000'000;
  EXPECT_EQ(prefiller::ArrivalKey(now, microseconds(0)), at);
  EXPECT_EQ(prefiller::ArrivalKey(now, microseconds(1500)), at - 1'500'000);
  EXPECT_EQ(prefiller::ArrivalKey(now, microseconds(-7)), at);  // nothing negative
  // A claim beyond the bound counts as the bound (one hour).
  EXPECT_EQ(prefiller::ArrivalKey(now, std::chrono::hours(5)), at - 3600ull * 1'000'000'000);
  const auto early = std::chrono::steady_clock::time_point(std::chrono::seconds(2));
  EXPECT_EQ(prefiller::ArrivalKey(early, std::chrono::seconds(30)), 1u);
}

}  // namespace
}  // namespace tandem::worker_test
