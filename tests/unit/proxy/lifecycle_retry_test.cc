// The proxy's request lifecycle when a worker fails or drains: decode
// migration without a gap or a duplicate token, retries of a cancelled
// prefill, the migration limit, a stream broken after its last token.
#include <gtest/gtest.h>

#include "lifecycle_test_util.h"
#include "proxy/lifecycle.h"
#include "proxy/prefill_tcp_client.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {
namespace {

using namespace lifecycle_testing;

TEST_F(LifecycleTest, DecoderLostMidStreamMigratesWithoutGapOrDuplicate) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  AddWorker("d1", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("In the beginning God created the heaven and the earth");
  ASSERT_GT(workers_.completion.size(), 8u);
  workers_.dying_decodes = 1;
  workers_.die_after = 5;
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);  // token 5 onwards from the new pair, once each
  EXPECT_EQ(c.text, "In the beginning God created the heaven and the earth");
  EXPECT_EQ(c.usage.prompt_tokens, 40u);  // the client's prompt, not the migrated one
  EXPECT_EQ(c.usage.completion_tokens, workers_.completion.size());
  ASSERT_EQ(workers_.decode_args.size(), 2u);
  EXPECT_NE(workers_.decode_addresses[0], workers_.decode_addresses[1]);  // the lost one is avoided
  const DecodeArgs& moved = workers_.decode_args[1];
  ASSERT_EQ(moved.prompt_ids->size(), 45u);  // prompt + the 5 tokens already sent
  EXPECT_EQ(std::vector<uint32_t>(moved.prompt_ids->begin() + 40, moved.prompt_ids->end()),
            std::vector<uint32_t>(workers_.completion.begin(), workers_.completion.begin() + 5));
  EXPECT_EQ(moved.params.first_sample_index, 5u);
  EXPECT_EQ(moved.params.max_tokens, 64u - 5u);
  // The client's varints (session 14) go with the client's prompt only:
  // the migrated prompt is re-encoded from its ids.
  EXPECT_EQ(workers_.decode_args[0].prompt_varints, std::string(40, '\x07'));
  EXPECT_EQ(workers_.prefill_args[0].prompt_varints, std::string(40, '\x07'));
  EXPECT_TRUE(moved.prompt_varints.empty());
  ASSERT_EQ(workers_.prefill_args.size(), 2u);
  EXPECT_TRUE(workers_.prefill_args[1].prompt_varints.empty());
}

// A draining worker's gRPC server cancels the calls still open when its
// drain ends: CANCELLED that the proxy did not ask for. The client never
// sees it: the prefill is retried on another pair, the decode migrated.
TEST_F(LifecycleTest, CancelledByADrainingPrefillerIsRetried) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("p1", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.first_prefill_errors = {Status(StatusCode::kCancelled, "")};
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);
  ASSERT_EQ(workers_.prefill_addresses.size(), 2u);
  EXPECT_NE(workers_.prefill_addresses[0], workers_.prefill_addresses[1]);  // the cut one avoided
  // A retry sends the client's prompt again: its varints too (session 14).
  for (const PrefillArgs& a : workers_.prefill_args) {
    EXPECT_EQ(a.prompt_varints, std::string(40, '\x07'));
  }
}

// Every prefill attempt tells the prefiller how long the request has
// waited since the proxy received it (PrefillRequest.waited_us), so that a
// retry keeps its place in the next prefiller's queue instead of going to
// the back (docs/scheduling.md).
TEST_F(LifecycleTest, EveryPrefillAttemptCarriesTheWaitSinceTheRequestArrived) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("p1", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.first_prefill_errors = {Status(StatusCode::kCancelled, "")};
  arrival_ = std::chrono::steady_clock::now() - std::chrono::seconds(3);
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  ASSERT_EQ(workers_.prefill_args.size(), 2u);
  EXPECT_GE(workers_.prefill_args[0].waited, std::chrono::seconds(3));
  EXPECT_LT(workers_.prefill_args[0].waited, std::chrono::hours(1));
  EXPECT_GE(workers_.prefill_args[1].waited, workers_.prefill_args[0].waited);
  // ... and the wire carries it.
  v1::PrefillRequest req;
  FillPrefillRequestFields(workers_.prefill_args[1], &req);
  EXPECT_EQ(req.waited_us(), static_cast<uint64_t>(workers_.prefill_args[1].waited.count()));
}

// A prefiller that answered that its prefill outlasted the decoder's lease
// (a short lease on a loaded host) is excluded from the retry, but it is
// the only one and still in routing (alive): the retry goes back to it
// instead of failing the request (docs/failure-handling.md, "Prefiller
// lost before the first token"). Before, the client got UNAVAILABLE
// "every worker that could take the request refused it" (session 14:
// Retry.PausedDecoderRetriesReachTheSamePrefiller under load).
TEST_F(LifecycleTest, RetryGoesBackToAnExcludedWorkerStillInRoutingWhenNoOtherPairExists) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.first_prefill_errors = {UnavailableError(
      "request 'r1#1': the KV was ready too late for the decoder's lease on its slots (2 s); "
      "dropped without writing (was this prefiller paused?)")};
  Collected c;
  Run(c);
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);
  ASSERT_EQ(workers_.prefill_addresses.size(), 2u);
  EXPECT_EQ(workers_.prefill_addresses[1], "p0:1");
  EXPECT_GT(workers_.prefill_args[1].attempt, workers_.prefill_args[0].attempt);
}

// A worker that left routing (the liveness check gave it up) is not gone
// back to: with no other prefiller the request fails, naming the reason.
TEST_F(LifecycleTest, RetryNeverGoesBackToAWorkerThatLeftRouting) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  HeldWorkers held;
  client_ = &held;
  Collected c;
  auto life = Run(c);
  held.events.on_registered();
  ASSERT_TRUE(held.prefill_done);
  fleet_->Remove("p0");
  held.prefill_done(UnavailableError("worker 'p0' stopped answering (no update for 1000 ms)"));
  EXPECT_FALSE(c.finished);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable) << c.error.ToString();
  EXPECT_NE(c.error.message().find("stopped answering"), std::string::npos) << c.error.ToString();
}

// A new attempt after a failed one is handed to deps.defer_launch (the
// frontend's work pool), never run on the thread that delivered the
// failure: that is a transport thread (the shared frame loop, a decode
// stream's reader), and an attempt may wait for the registry or connect.
TEST_F(LifecycleTest, RetryAfterAFailureRunsWhereDeferLaunchSays) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("p1", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen");
  workers_.first_prefill_errors = {Status(StatusCode::kUnavailable, "gone")};
  std::vector<std::function<void()>> deferred;
  defer_launch_ = [&deferred](std::function<void()> job) { deferred.push_back(std::move(job)); };
  Collected c;
  auto lifecycle = Run(c);
  // The first attempt failed; the second waits in the queue, not started.
  ASSERT_EQ(deferred.size(), 1u);
  EXPECT_EQ(workers_.prefill_addresses.size(), 1u);
  EXPECT_FALSE(c.finished);
  EXPECT_TRUE(c.error.ok()) << c.error.ToString();
  std::move(deferred.front())();
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.ids, workers_.completion);
  ASSERT_EQ(workers_.prefill_addresses.size(), 2u);
  EXPECT_NE(workers_.prefill_addresses[0], workers_.prefill_addresses[1]);
  EXPECT_EQ(deferred.size(), 1u);  // the successful attempt needed no other
}

TEST_F(LifecycleTest, DecodeCancelledByADrainingDecoderMigrates) {
  for (const bool in_band : {false, true}) {
    SCOPED_TRACE(in_band ? "in band" : "stream status");
    workers_ = ScriptedWorkers();
    fleet_.reset();
    SetUp();
    AddWorker("p0", router::WorkerRole::kPrefill);
    AddWorker("d0", router::WorkerRole::kDecode);
    AddWorker("d1", router::WorkerRole::kDecode);
    workers_.completion = tokenizer_->Encode("In the beginning God created the heaven and the earth");
    workers_.dying_decodes = 1;
    workers_.die_after = 5;
    workers_.die_status = in_band ? CancelledError("request aborted") : Status(StatusCode::kCancelled, "");
    workers_.die_in_band = in_band;
    Collected c;
    Run(c);
    ASSERT_TRUE(c.finished) << c.error.ToString();
    EXPECT_EQ(c.ids, workers_.completion);
    ASSERT_EQ(workers_.decode_args.size(), 2u);
    EXPECT_EQ(workers_.decode_args[1].params.first_sample_index, 5u);
  }
}

TEST_F(LifecycleTest, MigrationLimitEndsWithUnavailableNamingIt) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  AddWorker("d1", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("In the beginning God created the heaven and the earth");
  workers_.dying_decodes = 100;  // every decoder breaks after 3 tokens
  workers_.die_after = 3;
  Collected c;
  Run(c, {}, /*max_migrations=*/1);
  EXPECT_FALSE(c.finished);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable) << c.error.ToString();
  EXPECT_NE(c.error.message().find("proxy.max_migrations = 1"), std::string::npos)
      << c.error.message();
  EXPECT_EQ(workers_.decode_args.size(), 2u);
  // What the client got is a prefix of the right completion: 3 + 3 tokens.
  EXPECT_EQ(c.ids, std::vector<uint32_t>(workers_.completion.begin(), workers_.completion.begin() + 6));
}

TEST_F(LifecycleTest, MigrationOffFailsAtOnce) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  AddWorker("d1", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("and God said, Let there be light");
  workers_.dying_decodes = 1;
  workers_.die_after = 2;
  Collected c;
  Run(c, {}, /*max_migrations=*/0);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable);
  EXPECT_NE(c.error.message().find("migration is off"), std::string::npos) << c.error.message();
  EXPECT_EQ(workers_.decode_args.size(), 1u);
}

TEST_F(LifecycleTest, NoDecoderLeftToMigrateToSaysSo) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("and God said, Let there be light");
  workers_.dying_decodes = 1;
  workers_.die_after = 2;
  Collected c;
  Run(c);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable);
  EXPECT_NE(c.error.message().find("was lost after 2 completion tokens"), std::string::npos)
      << c.error.message();
}

TEST_F(LifecycleTest, StreamBrokenAfterTheLastTokenCompletes) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  workers_.completion = tokenizer_->Encode("Amen amen amen");
  workers_.dying_decodes = 1;
  workers_.die_after = static_cast<uint32_t>(workers_.completion.size());
  max_tokens_ = static_cast<uint32_t>(workers_.completion.size());
  Collected c;
  Run(c);
  // Nothing was left to generate: no migration (there is no other decoder
  // anyway), the request ends as it would have.
  ASSERT_TRUE(c.finished) << c.error.ToString();
  EXPECT_EQ(c.reason, Finish::kLength);
  EXPECT_EQ(c.ids, workers_.completion);
  EXPECT_EQ(workers_.decode_args.size(), 1u);
}

// An attempt that is over (finished, or abandoned for a retry) stops
// counting its decode blocks on its decoder at once, not at the decoder's
// next load report: requests that follow each other between two reports
// do not add up to "no decoder has room" (docs/router.md, "Room").
TEST_F(LifecycleTest, AttemptsThatAreOverLeaveTheDecoderItsRoom) {
  AddWorker("p0", router::WorkerRole::kPrefill);
  AddWorker("p1", router::WorkerRole::kPrefill);
  AddWorker("d0", router::WorkerRole::kDecode);
  const router::WorkerId d0 = *fleet_->router().FindWorker("d0");
  workers_.completion = tokenizer_->Encode("Amen");
  Collected done;
  Run(done);
  ASSERT_TRUE(done.finished) << done.error.ToString();
  EXPECT_EQ(fleet_->router().load(d0)->free_blocks, 1000);
  // A prefiller that is lost before the first token: the retry's attempt
  // counts, the abandoned one does not.
  workers_.first_prefill_errors = {UnavailableError("worker 'p0' stopped answering")};
  workers_.prefill_addresses.clear();
  Collected retried;
  Run(retried);
  ASSERT_TRUE(retried.finished) << retried.error.ToString();
  EXPECT_EQ(workers_.prefill_addresses.size(), 2u);
  EXPECT_EQ(fleet_->router().load(d0)->free_blocks, 1000);
  EXPECT_EQ(fleet_->router().load(d0)->running_requests, 0);
}

// --join compatibility: a worker that differs in model, block size or KV
// dtype is refused with a message naming the field and both values.
}  // namespace
}  // namespace tandem::proxy
