// The runner against a fake client that answers on its own thread after a
// set delay: bounds, arrival processes, concurrency caps, multi-turn
// prompts and failures, with real timing but no server.
#include <gtest/gtest.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "loadgen/runner.h"

namespace tandem::loadgen {
namespace {

class FakeClient final : public Client {
 public:
  explicit FakeClient(std::chrono::milliseconds delay) : delay_(delay) {
    worker_ = std::jthread([this](std::stop_token st) { Loop(st); });
  }
  ~FakeClient() override {
    worker_.request_stop();
    cv_.notify_all();
  }

  void Start(Request r, std::function<void(Reply)> done) override {
    std::lock_guard lk(mu_);
    seen_.push_back(r);
    ++inflight_;
    max_inflight_ = std::max(max_inflight_, inflight_);
    queue_.push_back({Clock::now() + delay_, std::move(r), std::move(done), Clock::now()});
    cv_.notify_all();
  }
  void CancelAll() override {}
  Result<ModelInfo> GetModelInfo(const std::string&) override {
    return ModelInfo{"fake", 1024, 4096, 16};
  }
  std::string Describe() const override { return "fake"; }

  // Every `fail_every`-th request (1-based) fails with RESOURCE_EXHAUSTED.
  int fail_every = 0;
  std::vector<Request> seen() {
    std::lock_guard lk(mu_);
    return seen_;
  }
  int max_inflight() {
    std::lock_guard lk(mu_);
    return max_inflight_;
  }

 private:
  struct Item {
    Clock::time_point due;
    Request req;
    std::function<void(Reply)> done;
    Clock::time_point sent;
  };

  void Loop(std::stop_token st) {
    int n = 0;
    while (!st.stop_requested()) {
      Item it;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return st.stop_requested() || !queue_.empty(); });
        if (queue_.empty()) return;
        it = std::move(queue_.front());
        queue_.pop_front();
      }
      std::this_thread::sleep_until(it.due);
      ++n;
      Reply r;
      r.sent = it.sent;
      r.done = Clock::now();
      if (fail_every > 0 && n % fail_every == 0) {
        r.status = ResourceExhaustedError("full");
      } else {
        // Tokens 1000 + k, the first alone, then two per message.
        const auto step = (r.done - r.sent) / (it.req.max_tokens + 1);
        uint32_t k = 0;
        while (k < it.req.max_tokens) {
          const uint32_t m = k == 0 ? 1 : std::min<uint32_t>(2, it.req.max_tokens - k);
          r.chunks.push_back({r.sent + step * (k + 1), m});
          for (uint32_t i = 0; i < m; ++i) r.token_ids.push_back(1000 + k + i);
          k += m;
        }
        r.finish_reason = "length";
        r.has_usage = true;
        r.prompt_tokens = uint32_t(it.req.prompt_token_ids.size());
        r.completion_tokens = it.req.max_tokens;
        r.cached_prompt_tokens = r.prompt_tokens / 2;
      }
      {
        std::lock_guard lk(mu_);
        --inflight_;
      }
      it.done(std::move(r));
    }
  }

  std::chrono::milliseconds delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::vector<Request> seen_;
  int inflight_ = 0, max_inflight_ = 0;
  std::jthread worker_;  // last: joins before the members it uses go away
};

std::vector<Session> Sessions(int n, uint32_t turns, uint32_t max_tokens, double gap_s = 0) {
  std::vector<Session> out;
  for (int i = 0; i < n; ++i) {
    Session s;
    s.id = i;
    s.start_s = gap_s * i;
    for (uint32_t t = 0; t < turns; ++t) {
      s.turns.push_back({SeededTokens(i * 100 + t, 8, 4096), max_tokens});
    }
    out.push_back(std::move(s));
  }
  return out;
}

TEST(Runner, CountBoundAllAtOnce) {
  FakeClient c(std::chrono::milliseconds(5));
  SyntheticOptions so;
  so.vocab = 4096;
  so.output = {LengthDist::Kind::kUniform, 2, 9};
  auto src = MakeSyntheticSource(so);
  RunOptions o;
  o.num_requests = 25;
  o.ignore_eos = true;
  o.seed = 11;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->records.size(), 25u);
  EXPECT_EQ(c.seen().size(), 25u);
  uint64_t requested = 0, got = 0;
  for (const auto& rec : r->records) {
    EXPECT_TRUE(rec.ok);
    requested += rec.requested_tokens;
    got += rec.output_tokens;
    EXPECT_EQ(rec.prompt_tokens, 128u);
    EXPECT_GE(rec.ttft_s, 0.0);
    // ITL: one gap per token after the first (zeros inside a message).
    EXPECT_EQ(rec.itl_s.size(), rec.output_tokens - 1);
  }
  EXPECT_EQ(requested, got);
  const auto seen = c.seen();
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_TRUE(seen[i].ignore_eos);
    ASSERT_TRUE(seen[i].seed.has_value());
    EXPECT_EQ(*seen[i].seed, 11 + i);  // request i samples with seed + i
  }
  // Request ids are unique.
  std::set<std::string> ids;
  for (const auto& req : c.seen()) ids.insert(req.request_id);
  EXPECT_EQ(ids.size(), 25u);
}

TEST(Runner, FixedConcurrencyIsHeld) {
  FakeClient c(std::chrono::milliseconds(20));
  auto src = MakeListSource(Sessions(12, 1, 4), "list");
  RunOptions o;
  o.arrival.kind = ArrivalKind::kConcurrency;
  o.arrival.concurrency = 3;
  auto r = loadgen::Run(c, *src, o);  // the list bounds the run
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->records.size(), 12u);
  EXPECT_EQ(c.max_inflight(), 3);
}

TEST(Runner, MaxConcurrencyCapsPoisson) {
  FakeClient c(std::chrono::milliseconds(20));
  auto src = MakeListSource(Sessions(10, 1, 4), "list");
  RunOptions o;
  o.arrival.kind = ArrivalKind::kPoisson;
  o.arrival.rate = 1000;
  o.arrival.max_concurrency = 2;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->records.size(), 10u);
  EXPECT_LE(c.max_inflight(), 2);
}

TEST(Runner, MultiTurnExtendsTheConversation) {
  FakeClient c(std::chrono::milliseconds(1));
  auto sessions = Sessions(2, 3, 4);
  auto copy = sessions;
  auto src = MakeListSource(std::move(sessions), "list");
  RunOptions o;
  o.arrival.kind = ArrivalKind::kConcurrency;
  o.arrival.concurrency = 1;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok());
  const auto seen = c.seen();
  ASSERT_EQ(seen.size(), 6u);
  const std::vector<uint32_t> reply = {1000, 1001, 1002, 1003};
  std::vector<uint32_t> conv;
  for (int t = 0; t < 3; ++t) {
    conv.insert(conv.end(), copy[0].turns[t].new_tokens.begin(), copy[0].turns[t].new_tokens.end());
    EXPECT_EQ(seen[t].prompt_token_ids, conv) << "turn " << t;
    conv.insert(conv.end(), reply.begin(), reply.end());
  }
  EXPECT_EQ(seen[3].prompt_token_ids, copy[1].turns[0].new_tokens);  // a new conversation
  EXPECT_EQ(r->records[2].turn, 2u);
}

TEST(Runner, CountBoundStopsMidConversation) {
  FakeClient c(std::chrono::milliseconds(1));
  auto src = MakeListSource(Sessions(5, 3, 2), "list");
  RunOptions o;
  o.arrival.kind = ArrivalKind::kConcurrency;
  o.arrival.concurrency = 2;
  o.num_requests = 4;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->records.size(), 4u);
  EXPECT_EQ(c.seen().size(), 4u);
  EXPECT_EQ(r->dropped_turns, 2u);  // two sessions of 3 turns, 2 sent each
}

TEST(Runner, TraceTimestampsAreNeverEarly) {
  FakeClient c(std::chrono::milliseconds(1));
  auto src = MakeListSource(Sessions(4, 1, 2, /*gap_s=*/0.1), "list");
  RunOptions o;
  o.arrival.kind = ArrivalKind::kTrace;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->records.size(), 4u);
  for (const auto& rec : r->records) {
    EXPECT_GE(rec.send_s, 0.1 * rec.session - 1e-6) << rec.session;
  }
}

TEST(Runner, DurationBound) {
  FakeClient c(std::chrono::milliseconds(2));
  SyntheticOptions so;
  so.vocab = 4096;
  so.output = {LengthDist::Kind::kFixed, 2, 0};
  auto src = MakeSyntheticSource(so);  // endless
  RunOptions o;
  o.arrival.kind = ArrivalKind::kPoisson;
  o.arrival.rate = 100;
  o.arrival.seed = 5;
  o.duration_s = 0.3;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok());
  EXPECT_GT(r->records.size(), 0u);
  EXPECT_LT(r->records.size(), 200u);
  for (const auto& rec : r->records) EXPECT_LT(rec.send_s, 0.3 + 1.0);
}

TEST(Runner, FailuresAreCountedAndCutConversations) {
  FakeClient c(std::chrono::milliseconds(1));
  c.fail_every = 2;
  auto src = MakeListSource(Sessions(4, 2, 2), "list");
  RunOptions o;
  o.arrival.kind = ArrivalKind::kConcurrency;
  o.arrival.concurrency = 1;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_TRUE(r.ok());
  // Sequential: session 0 turn 0 ok, turn 1 fails; session 1 turn 0 ok,
  // turn 1 fails; ... every second request fails, no conversation is cut.
  const Summary s = Summarize(r->records, Slo{});
  EXPECT_EQ(s.ok, 4u);
  EXPECT_EQ(s.failed, 4u);
  EXPECT_EQ(s.failed_by_status.at("RESOURCE_EXHAUSTED"), 4u);
  EXPECT_EQ(r->aborted_sessions, 0u);

  FakeClient c2(std::chrono::milliseconds(1));
  c2.fail_every = 1;  // everything fails: every 2-turn conversation is cut
  auto src2 = MakeListSource(Sessions(3, 2, 2), "list");
  auto r2 = loadgen::Run(c2, *src2, o);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->records.size(), 3u);
  EXPECT_EQ(r2->aborted_sessions, 3u);
}

TEST(Runner, RefusesUnboundedAllAtOnce) {
  FakeClient c(std::chrono::milliseconds(1));
  SyntheticOptions so;
  so.vocab = 4096;
  auto src = MakeSyntheticSource(so);
  RunOptions o;  // rate inf, no count
  o.duration_s = 1;
  auto r = loadgen::Run(c, *src, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "an infinite --request-rate needs --num-requests");
}

}  // namespace
}  // namespace tandem::loadgen
