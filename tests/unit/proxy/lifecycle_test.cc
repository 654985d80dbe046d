// The proxy's request lifecycle against a scripted WorkerClient (the real
// gRPC workers are exercised by the serving integration tests): first token
// exactly once whichever path brings it, stop strings, re-routing when a
// decoder has no room, errors, cancellation. Retries and migrations:
// lifecycle_retry_test.cc.
#include "proxy/lifecycle.h"

#include <gtest/gtest.h>

#include "lifecycle_test_util.h"

namespace tandem::proxy {
namespace {

using namespace lifecycle_testing;

// a cancel costs a lookup, or a frame and a wake-up). A client that goes away cancels both.
TEST_F(LifecycleTest, CallsThatEndedAreNotCancelledAtTheEnd) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  enum Order { kClientLeaves, kPrefillReplyFirst, kDecoderFinishesFirst };
  for (const Order order : {kClientLeaves, kPrefillReplyFirst, kDecoderFinishesFirst}) {
    SCOPED_TRACE(order);
    HeldWorkers held;
    client_ = &held;
    Collected c;
    auto lifecycle = Run(c);
    held.events.on_registered();
    ASSERT_TRUE(held.prefill_done);
    if (order == kClientLeaves) {
      lifecycle->Cancel();
      EXPECT_TRUE(held.decode_call->cancelled);
      EXPECT_TRUE(held.prefill_call->cancelled);
      continue;
    }
    const PrefillResult r = {.first_token_id = 5};
    if (order == kPrefillReplyFirst) held.prefill_done(r);
    const std::vector<uint32_t> ids = {5, 6};
    held.events.on_tokens(0, ids);
    held.events.on_finished(Finish::kLength, 2, 0, 0);
    if (order == kDecoderFinishesFirst) held.prefill_done(r);  // the reply comes late: ignored
    EXPECT_TRUE(c.finished);
    EXPECT_EQ(c.ids, ids);
    EXPECT_FALSE(held.decode_call->cancelled);
    EXPECT_FALSE(held.prefill_call->cancelled);
  }
  client_ = nullptr;
}

// Prefill with the start (docs/decode-stream.md): to a decoder whose Reserve
// waits for the registration, the Prefill goes out right after the start,
// which asks for `registered` with the first item; the `registered` that
// comes later starts nothing more. To any other decoder the Prefill waits
// for `registered`, as before.
TEST_F(LifecycleTest, ThePrefillGoesWithTheStartWhereTheDecoderWaitsForTheRegistration) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  for (const bool with_start : {true, false}) {
    SCOPED_TRACE(with_start);
    AddWorker("d0", router::WorkerRole::kDecode, with_start);  // registers again: replaced
    HeldWorkers held;
    client_ = &held;
    Collected c;
    auto lifecycle = Run(c);
    ASSERT_TRUE(held.decode_args.has_value());
    EXPECT_EQ(held.decode_args->registered_with_first_item, with_start);
    if (with_start) {
      EXPECT_EQ(held.calls, (std::vector<std::string>{"decode", "prefill"}));
      ASSERT_TRUE(held.prefill_done);
    } else {
      EXPECT_EQ(held.calls, std::vector<std::string>{"decode"});
      EXPECT_FALSE(held.prefill_done);
    }
    // `registered` with the first token (with the start), or alone before.
    held.events.on_registered();
    EXPECT_EQ(held.calls, (std::vector<std::string>{"decode", "prefill"}));
    held.prefill_done(PrefillResult{.first_token_id = 5});
    const std::vector<uint32_t> ids = {5, 6};
    held.events.on_tokens(0, ids);
    held.events.on_finished(Finish::kLength, 2, 0, 0);
    EXPECT_TRUE(c.finished);
    EXPECT_EQ(c.ids, ids);
  }
  client_ = nullptr;
}

// The prompt goes once (docs/decode-stream.md): to a decoder that takes the
// prompt from the prefiller's Reserve, the start names it by reference (the
// worker client then sends its length and digest instead of its tokens);
// the Prefill carries the prompt either way. Any other decoder gets it.
TEST_F(LifecycleTest, TheStartNamesThePromptWhereTheDecoderTakesItFromTheReserve) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  for (const bool by_reference : {true, false}) {
    SCOPED_TRACE(by_reference);
    AddWorker("d0", router::WorkerRole::kDecode, true, by_reference);  // registers again: replaced
    HeldWorkers held;
    client_ = &held;
    Collected c;
    auto lifecycle = Run(c);
    ASSERT_TRUE(held.decode_args.has_value());
    EXPECT_EQ(held.decode_args->prompt_by_reference, by_reference);
    EXPECT_FALSE(held.decode_args->prefill_locally);
    ASSERT_TRUE(held.decode_args->prompt_ids);
    ASSERT_TRUE(held.prefill_args.has_value());
    ASSERT_TRUE(held.prefill_args->prompt_ids);
    EXPECT_EQ(*held.prefill_args->prompt_ids, *held.decode_args->prompt_ids);
    held.prefill_done(PrefillResult{.first_token_id = 5});
    held.events.on_registered();
    const std::vector<uint32_t> ids = {5, 6};
    held.events.on_tokens(0, ids);
    held.events.on_finished(Finish::kLength, 2, 0, 0);
    EXPECT_TRUE(c.finished);
  }
  client_ = nullptr;
}

// A decoder that refuses a start whose Prefill went with it: the Prefill is
// cancelled (its prefiller's Reserve, waiting for the registration, is
// answered with the refusal by the decoder) and the request ends or moves on.
TEST_F(LifecycleTest, ARefusedStartCancelsThePrefillThatWentWithIt) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode, /*waits_for_registration=*/true);
  HeldWorkers held;
  client_ = &held;
  Collected c;
  auto lifecycle = Run(c);
  ASSERT_TRUE(held.prefill_done);
  EXPECT_FALSE(held.prefill_call->cancelled);
  held.events.on_error(InvalidArgumentError("prompt too long for this decoder"), true);
  EXPECT_TRUE(held.prefill_call->cancelled);
  EXPECT_FALSE(c.finished);
  EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument) << c.error.ToString();
  client_ = nullptr;
}

// The decode call names what its token callback reads first, for the reader to prefetch:
// its state inside the lifecycle (make_shared's count just before it), and its sink's.
TEST_F(LifecycleTest, TheDecodeCallNamesWhatItsTokensReadFirst) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  HeldWorkers held;
  client_ = &held;
  const char outbox[100] = {};
  sink_hot_ = {HotBytes{outbox, 8}, HotBytes{outbox + 50, 50}};
  Collected c;
  auto lifecycle = Run(c);
  const auto* begin = reinterpret_cast<const char*>(lifecycle.get());
  const auto* state = static_cast<const char*>(held.events.hot[1].addr);
  EXPECT_EQ(static_cast<const char*>(held.events.hot[0].addr) + 16, begin);
  EXPECT_GE(state, begin);
  EXPECT_GT(held.events.hot[1].bytes, 0u);
  EXPECT_LE(held.events.hot[1].bytes, HotBytes::kMaxBytes);
  EXPECT_LE(state + held.events.hot[1].bytes, begin + sizeof(RequestLifecycle));
  EXPECT_EQ(held.events.hot[2].addr, outbox);
  EXPECT_EQ(held.events.hot[3].bytes, 50u);
  lifecycle->Cancel();
}

// Every route puts its prompt's uncached tokens on the prefilling worker's
// predicted queue (docs/router.md, "Load"); whatever becomes of the
// attempt, the lifecycle ends that prefill at the router exactly once, so
// no finished or abandoned request keeps a worker looking busy.
TEST_F(LifecycleTest, EveryRoutesPrefillEndsAtTheRouter) {
  using router::WorkerRole;
  const struct {
    const char* name;
    std::vector<std::pair<const char*, WorkerRole>> workers;
    std::function<void(ScriptedWorkers&)> script;
    bool cancel;  // the client goes away before anything comes back
    bool ok;
  } kCases[] = {
      {"prefill reply first",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}},
       [](ScriptedWorkers&) {},
       false,
       true},
      {"decode stream first",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}},
       [](ScriptedWorkers& w) { w.decode_first = true; },
       false,
       true},
      {"full decoder, retried",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}, {"d1", WorkerRole::kDecode}},
       [](ScriptedWorkers& w) { w.full_decoders = {"d0:1"}; },
       false,
       true},
      {"every decoder full",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}},
       [](ScriptedWorkers& w) { w.full_decoders = {"d0:1"}; },
       false,
       false},
      {"prefill error",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}},
       [](ScriptedWorkers& w) { w.prefill_error = InvalidArgumentError("bad prompt"); },
       false,
       false},
      {"local prefill", {{"b0", WorkerRole::kBoth}}, [](ScriptedWorkers&) {}, false, true},
      {"decoder lost mid-stream, migrated",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}, {"d1", WorkerRole::kDecode}},
       [](ScriptedWorkers& w) {
         w.dying_decodes = 1;
         w.die_after = 2;
       },
       false,
       true},
      {"cancelled while the prefill runs",
       {{"p0", WorkerRole::kPrefill}, {"d0", WorkerRole::kDecode}},
       [](ScriptedWorkers& w) { w.hold_prefill = true; },
       true,
       false},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    SetUp();
    workers_ = ScriptedWorkers{};
    workers_.completion = tokenizer_->Encode("In the beginning was the Word");
    for (const auto& [name, role] : c.workers) AddWorker(name, role);
    c.script(workers_);
    Collected col;
    auto lifecycle = Run(col);
    if (c.cancel) {
      const uint64_t routes =
          fleet_->router().counters().routes[static_cast<size_t>(router::Policy::kRoundRobin)];
      EXPECT_EQ(routes, 1u);
      EXPECT_GT(fleet_->router().load(*fleet_->router().FindWorker("p0"))->queued_prefill_tokens,
                0);
      lifecycle->Cancel();
    }
    EXPECT_EQ(col.finished, c.ok) << col.error.ToString();
    const router::RouterCounters counters = fleet_->router().counters();
    const uint64_t routes = counters.routes[static_cast<size_t>(router::Policy::kRoundRobin)];
    EXPECT_GE(routes, 1u);
    EXPECT_EQ(counters.prefills_ended, routes);
    for (const auto& w : fleet_->Workers()) {
      auto load = fleet_->router().load(*fleet_->router().FindWorker(w.name));
      ASSERT_TRUE(load.ok());
      EXPECT_EQ(load->queued_prefill_tokens, 0) << w.name;
    }
  }
}

TEST_F(LifecycleTest, FirstTokenOnceFromPrefillReplyThenStream) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("In the beginning was the Word");
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);  // index 0 came twice, forwarded once
  EXPECT_EQ(c.text, "In the beginning was the Word");
  EXPECT_EQ(c.reason, Finish::kLength);
  EXPECT_EQ(c.usage.prompt_tokens, 40u);
  EXPECT_EQ(c.usage.completion_tokens, workers_.completion.size());
  EXPECT_EQ(c.usage.cached_prompt_tokens, 16u);  // the prefiller's prefix-cache hits
  EXPECT_EQ(workers_.decode_addresses, std::vector<std::string>{"d0:1"});
  EXPECT_EQ(workers_.prefill_addresses, std::vector<std::string>{"p0:1"});
}

TEST_F(LifecycleTest, FirstTokenOnceWhenTheStreamWins) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("and the earth was without form");
  workers_.decode_first = true;
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished);
  EXPECT_EQ(c.ids, workers_.completion);
  // The stream finished before the prefill reply came: the usage still has
  // the prefiller's hits, relayed by the decoder (seen once in CI: the
  // OpenAI test's repeated prompt reported 0 cached tokens).
  EXPECT_EQ(c.usage.cached_prompt_tokens, 16u);
}

// SLO admission's calibration hears of each admitted request's first token
// once, with the time since its arrival, whichever side delivers it first.
TEST_F(LifecycleTest, TheFirstTokenTellsTheCalibrationOnceHowLateItCame) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  TtftCalibration::Options o;
  o.attainment = 0.9;
  o.min_samples = 2;
  TtftCalibration cal(o);
  calibration_ = &cal;
  workers_.completion = tokenizer_->Encode("In the beginning was the Word");
  // Arrived 1.5 s ago, predicted 1 s, SLO 2 s: at least (1500 - 1000) / 2000
  // late.
  const auto now = std::chrono::steady_clock::now();
  arrival_ = now - std::chrono::milliseconds(1500);
  predicted_ttft_ms_ = 1000;
  ttft_slo_ms_ = 2000;
  Collected c;
  Run(c);  // the first token comes in the prefill reply and again on the stream
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(cal.Margin(std::chrono::steady_clock::now()), 0);  // one error known, not two
  Collected again;
  Run(again);
  ASSERT_TRUE(again.finished) << again.error.ToString();
  const double margin = cal.Margin(std::chrono::steady_clock::now());
  EXPECT_GE(margin, 0.25);
  EXPECT_LE(margin, TtftCalibration::kMaxMargin);
  // A request admission did not predict (no SLO, or queue mode) adds none.
  TtftCalibration fresh(o);
  calibration_ = &fresh;
  predicted_ttft_ms_ = -1;
  for (int i = 0; i < 2; ++i) {
    Collected unpredicted;
    Run(unpredicted);
    ASSERT_TRUE(unpredicted.finished);
  }
  EXPECT_EQ(fresh.Margin(std::chrono::steady_clock::now()), 0);
}

// A frame's tokens share one clock reading (DeliveryScope::Now) and still
// get one ITL sample each: the first of a frame the gap since the last
// frame, the others 0 (they arrived together), as with a reading per token.
TEST_F(LifecycleTest, EveryTokenOfABatchKeepsItsOwnItlSample) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  MetricsRegistry registry{MetricLabels{"m", "proxy", "proxy"}};
  ProxyMetrics metrics(registry);
  metrics_ = &metrics;
  workers_.completion = tokenizer_->Encode("In the beginning God created the heaven and the earth.");
  ASSERT_GE(workers_.completion.size(), 7u);
  workers_.scope_per_chunk = true;
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);
  const size_t n = workers_.completion.size();
  metrics.FoldTokenMetrics();  // (a scrape's collect hook does this)
  const auto itl = metrics.itl.Collect().histogram;
  EXPECT_EQ(itl.sample_count, n - 1);  // every token but the first
  EXPECT_EQ(metrics.ttft.Collect().histogram.sample_count, 1u);
  EXPECT_EQ(metrics.generation_tokens.Value(), static_cast<double>(n));
  EXPECT_GE(itl.sample_sum, 0.0);
  // The prefill reply's token came alone; the stream's first chunk then
  // holds only tokens 1-2 (index 0 is a duplicate): gaps at tokens 1, 3,
  // 6, ...; the rest are 0 and fall in the first bucket.
  const size_t chunks = (n + workers_.chunk - 1) / workers_.chunk;
  EXPECT_GE(itl.bucket.front().cumulative_count, (n - 1) - chunks);
}

TEST_F(LifecycleTest, StopStringEndsTheRequestAndCancelsTheDecoder) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Let there be light. And there was light.");
  workers_.finish = Finish::kLength;
  Collected c;
  Run(c, {"."});
  ASSERT_TRUE(c.finished);
  EXPECT_EQ(c.text, "Let there be light");
  EXPECT_EQ(c.reason, Finish::kStop);
  EXPECT_LT(c.usage.completion_tokens, workers_.completion.size());
  EXPECT_EQ(c.usage.completion_tokens, c.ids.size());
  ASSERT_EQ(workers_.decode_calls.size(), 1u);
  EXPECT_TRUE(workers_.decode_calls[0]->cancelled);
}

TEST_F(LifecycleTest, FullDecoderIsAvoidedOnRetry) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  AddWorker("d1", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.full_decoders = {"d0:1"};
  // Round robin: whichever decoder comes first, the request ends on d1.
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);
  EXPECT_EQ(workers_.decode_addresses.back(), "d1:1");
  if (workers_.decode_addresses.size() == 2) {
    EXPECT_EQ(workers_.decode_addresses[0], "d0:1");
    EXPECT_TRUE(workers_.decode_calls[0]->cancelled);  // the refused attempt is closed
  }
}

// Each route is its own attempt on the workers (worker/attempt_key.h): the
// Decode and Prefill of one attempt carry the same number, a retry a new
// one, so a worker still holding the abandoned attempt never meets it.
TEST_F(LifecycleTest, EveryAttemptHasItsOwnNumber) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("p1", router::WorkerRole::kPrefill);
  AddWorker("p2", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.prefill_error = UnavailableError("prefiller lost");  // every route is retried
  Collected c;
  Run(c);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable) << c.error.ToString();
  ASSERT_EQ(workers_.decode_args.size(), 3u);  // max_attempts
  ASSERT_EQ(workers_.prefill_args.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_GE(workers_.decode_args[i].attempt, 1u);
    EXPECT_EQ(workers_.prefill_args[i].attempt, workers_.decode_args[i].attempt) << i;
    EXPECT_EQ(workers_.prefill_args[i].request_id, "r1");
    EXPECT_EQ(workers_.decode_args[i].request_id, "r1");
    if (i > 0) {
      EXPECT_GT(workers_.decode_args[i].attempt, workers_.decode_args[i - 1].attempt);
    }
  }
}

TEST_F(LifecycleTest, EveryDecoderFullIsResourceExhausted) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.full_decoders = {"d0:1"};
  Collected c;
  Run(c);
  EXPECT_FALSE(c.finished);
  EXPECT_EQ(c.error.code(), StatusCode::kResourceExhausted) << c.error.ToString();
}

TEST_F(LifecycleTest, NoWorkersIsUnavailable) {
  Collected c;
  Run(c);
  EXPECT_FALSE(c.finished);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable) << c.error.ToString();
}

TEST_F(LifecycleTest, PrefillErrorReachesTheClient) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("x");
  workers_.prefill_error = InvalidArgumentError("bad prompt");
  Collected c;
  Run(c);
  EXPECT_EQ(c.error, InvalidArgumentError("bad prompt"));
  EXPECT_TRUE(workers_.decode_calls.at(0)->cancelled);
}

// A prefiller whose own transport refused the push (prefiller.cc,
// OnTransferDone) answers INTERNAL: the same push would be refused again,
// so the client hears at once, with another pair free to try.
TEST_F(LifecycleTest, APushThePrefillerCouldNotPrepareIsNotRetried) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("p1", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  AddWorker("d1", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("x");
  const Status refused = InternalError(
      "KV push to decoder 'd0' could not be prepared (ERR_INVALID_ARGUMENT): notice has 65638 "
      "bytes; this transport sends at most 65536; not retried: the same push would be refused "
      "again");
  workers_.prefill_error = refused;
  Collected c;
  Run(c);
  EXPECT_EQ(c.error, refused);
  EXPECT_EQ(workers_.prefill_addresses.size(), 1u);  // one prefill, no retry
  EXPECT_TRUE(workers_.decode_calls.at(0)->cancelled);
}

// The quiet end (session 41, docs/decode-stream.md): with one token to go
// and a remote prefill, the start asks the decoder for silence and the
// Prefill's reply ends the request, forgetting the decode call (no cancel,
// no wait for the decoder); with more to go the start does not ask and the
// call ends with the decoder's items, as before.
TEST_F(LifecycleTest, WithOneTokenToGoThePrefillReplyEndsTheRequestAndForgetsTheDecodeCall) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode, /*waits_for_registration=*/true);
  for (const uint32_t max_tokens : {1u, 2u}) {
    SCOPED_TRACE(max_tokens);
    max_tokens_ = max_tokens;
    HeldWorkers held;
    client_ = &held;
    Collected c;
    auto lifecycle = Run(c);
    ASSERT_TRUE(held.decode_args.has_value());
    EXPECT_EQ(held.decode_args->quiet_end_on_first_token, max_tokens == 1);
    ASSERT_TRUE(held.prefill_done);
    held.prefill_done(PrefillResult{.first_token_id = 5});
    if (max_tokens == 1) {
      EXPECT_TRUE(c.finished);
      EXPECT_EQ(c.ids, std::vector<uint32_t>{5});
      EXPECT_TRUE(held.decode_call->forgotten);
    } else {
      EXPECT_FALSE(c.finished);
      const std::vector<uint32_t> ids = {5, 6};
      held.events.on_tokens(0, ids);
      held.events.on_finished(Finish::kLength, 2, 0, 0);
      EXPECT_TRUE(c.finished);
      EXPECT_EQ(c.ids, ids);
      EXPECT_FALSE(held.decode_call->forgotten);
    }
    EXPECT_FALSE(held.decode_call->cancelled);
    EXPECT_FALSE(held.prefill_call->cancelled);
  }
  client_ = nullptr;
}

// A local prefill has no Prefill reply to end on: its start never asks.
TEST_F(LifecycleTest, ALocalPrefillIsNeverQuiet) {
  AddWorker("b0", router::WorkerRole::kBoth);
  max_tokens_ = 1;
  workers_.completion = {5};
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  ASSERT_EQ(workers_.decode_args.size(), 1u);
  EXPECT_TRUE(workers_.decode_args[0].prefill_locally);
  EXPECT_FALSE(workers_.decode_args[0].quiet_end_on_first_token);
  EXPECT_FALSE(workers_.decode_calls[0]->forgotten);
}

TEST_F(LifecycleTest, AggregatedWorkerPrefillsLocally) {
  AddWorker("b0", router::WorkerRole::kBoth);
  workers_.completion = tokenizer_->Encode("Blessed are the meek");
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);
  EXPECT_TRUE(workers_.prefill_addresses.empty());
  EXPECT_EQ(c.usage.cached_prompt_tokens, 32u);  // the decoder's own cache hits
}

TEST_F(LifecycleTest, FleetRefusesMismatchedWorkersNamingTheField) {
  auto worker = [] {
    WorkerRecord w;
    w.name = "x";
    w.role = router::WorkerRole::kDecode;
    w.grpc_address = "x:1";
    w.protocol_version = 1;
    w.model = "m";
    w.block_size = 16;
    w.kv_dtype = "f32";
    w.block_bytes = 4096;
    w.num_blocks = 10;
    return w;
  };
  WorkerRecord w = worker();
  w.model = "other";
  Status st = fleet_->Register(w);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("model 'other' differs from the fleet's 'm'"), std::string::npos)
      << st.message();
  w = worker();
  w.block_size = 32;
  st = fleet_->Register(w);
  EXPECT_NE(st.message().find("block_size 32 differs from the fleet's 16"), std::string::npos)
      << st.message();
  w = worker();
  w.kv_dtype = "bf16";
  st = fleet_->Register(w);
  EXPECT_NE(st.message().find("KV dtype 'bf16' differs from the fleet's 'f32'"), std::string::npos)
      << st.message();
  w = worker();
  w.node = "rack a";
  st = fleet_->Register(w);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("label 'node' must be at most 63 characters of A-Z a-z 0-9 . _ -, got "
                              "'rack a'"),
            std::string::npos)
      << st.message();
  w = worker();
  w.zone = std::string(100, 'z');
  st = fleet_->Register(w);
  EXPECT_NE(st.message().find("label 'zone' must be at most 63 characters"), std::string::npos)
      << st.message();
  EXPECT_TRUE(fleet_->Workers().empty());  // none of them joined
  w = worker();
  w.node = "host-b";
  w.zone = "zone-1";
  EXPECT_TRUE(fleet_->Register(w).ok());
}

// Readiness of the HTTP /health (issue 21): a worker counts as indexed only
// once its watch's snapshot was applied, and every registration (a restart,
// a rejoin) clears it again until the new snapshot lands.
TEST_F(LifecycleTest, WorkerIsIndexedFromItsSnapshotUntilItRegistersAgain) {
  AddWorker("p", router::WorkerRole::kPrefill);
  auto find = [&] { return fleet_->Find("p"); };
  ASSERT_TRUE(find().has_value());
  EXPECT_FALSE(find()->indexed);
  fleet_->MarkIndexed("p");
  EXPECT_TRUE(find()->indexed);
  fleet_->MarkIndexed("nobody");  // unknown names are ignored
  EXPECT_EQ(fleet_->Workers().size(), 1u);
  WorkerRecord again = *find();  // a record that still says indexed
  ASSERT_TRUE(fleet_->Register(again).ok());
  EXPECT_FALSE(find()->indexed);
}

// The rest of the block-hash context: the fleet salt is compared as a
// fingerprint (the salt itself never travels), then the root hash itself.
TEST(FleetHashContext, RefusesAnotherSaltOrRootNamingTheField) {
  RouterConfig rc;
  rc.policy = "round_robin";
  auto router = router::Router::Create(rc, router::RouterOptions{});
  ASSERT_TRUE(router.ok());
  HashContext ctx{.model_id = "m", .block_size = 16, .kv_dtype = "bf16", .fleet_salt = "s3cret"};
  FleetRequirements req;
  req.model = "m";
  req.kv_dtype = "bf16";
  req.fleet_salt_fingerprint = FleetSaltFingerprint(ctx.fleet_salt);
  req.hash_root = RootHash(ctx);
  Fleet fleet(req, std::move(router).value());
  auto worker = [&] {
    WorkerRecord w;
    w.name = "x";
    w.role = router::WorkerRole::kPrefill;
    w.grpc_address = "x:1";
    w.protocol_version = 1;
    w.model = "m";
    w.block_size = 16;
    w.kv_dtype = "bf16";
    w.fleet_salt_fingerprint = FleetSaltFingerprint("s3cret");
    w.hash_root = RootHash(ctx);
    w.block_bytes = 4096;
    w.num_blocks = 10;
    return w;
  };
  WorkerRecord w = worker();
  w.fleet_salt_fingerprint = FleetSaltFingerprint("other");
  Status st = fleet.Register(w);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("fleet salt (cache.salt) differs from the fleet's (fingerprint " +
                              FleetSaltFingerprint("other") + " vs " +
                              FleetSaltFingerprint("s3cret") + ")"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(st.message().find("s3cret"), std::string::npos) << "the salt itself leaked";
  w = worker();
  w.fleet_salt_fingerprint.clear();  // a worker that sends none
  st = fleet.Register(w);
  EXPECT_NE(st.message().find("fingerprint none vs"), std::string::npos) << st.message();
  w = worker();
  w.hash_root ^= 1;
  st = fleet.Register(w);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("block-hash root"), std::string::npos) << st.message();
  EXPECT_TRUE(fleet.Workers().empty());
  EXPECT_TRUE(fleet.Register(worker()).ok());
  EXPECT_EQ(fleet.Workers().size(), 1u);
}

}  // namespace
}  // namespace tandem::proxy
