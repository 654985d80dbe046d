// The proxy's request lifecycle against a scripted WorkerClient (the real
// gRPC workers are exercised by the serving integration tests): first token
// exactly once whichever path brings it, stop strings, re-routing when a
// decoder has no room, errors, cancellation.
#include "proxy/lifecycle.h"

#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "common/config.h"

namespace tandem::proxy {
namespace {

class FakeCall : public Call {
 public:
  void Cancel() override { cancelled = true; }
  std::atomic<bool> cancelled{false};
};

// Decoders answer `registered` at once. A Prefill returns the first token,
// then the decoder streams the whole completion from index 0 (so index 0
// arrives twice) in chunks of `chunk`.
class ScriptedWorkers : public WorkerClient {
 public:
  std::vector<uint32_t> completion;
  uint32_t chunk = 3;
  Finish finish = Finish::kLength;
  std::set<std::string> full_decoders;  // their Prefill fails with RESOURCE_EXHAUSTED
  Status prefill_error;                 // when set, every Prefill fails with it
  bool decode_first = false;            // stream the decode tokens before the Prefill reply
  std::vector<std::string> decode_addresses, prefill_addresses;
  std::vector<std::shared_ptr<FakeCall>> decode_calls;

  std::shared_ptr<Call> Decode(const std::string& address, DecodeArgs args,
                               DecodeEvents events) override {
    decode_addresses.push_back(address);
    events_[address] = std::move(events);
    prefill_locally_ = args.prefill_locally;
    auto call = std::make_shared<FakeCall>();
    decode_calls.push_back(call);
    events_[address].on_registered();
    if (prefill_locally_) Stream(address);
    return call;
  }

  std::shared_ptr<Call> Prefill(const std::string& address, PrefillArgs args,
                                std::function<void(Result<PrefillResult>)> done) override {
    prefill_addresses.push_back(address);
    if (!prefill_error.ok()) {
      done(prefill_error);
    } else if (full_decoders.count(args.decoder_address)) {
      done(ResourceExhaustedError("decoder has no room"));
    } else {
      PrefillResult r;
      r.first_token_id = completion.at(0);
      r.cached_prompt_tokens = 16;
      if (decode_first) Stream(args.decoder_address);
      done(r);
      if (!decode_first) Stream(args.decoder_address);
    }
    return std::make_shared<FakeCall>();
  }

 private:
  void Stream(const std::string& decoder) {
    auto& ev = events_[decoder];
    for (uint32_t i = 0; i < completion.size(); i += chunk) {
      const auto end = std::min<size_t>(completion.size(), i + chunk);
      ev.on_tokens(i, std::vector<uint32_t>(completion.begin() + i, completion.begin() + end));
    }
    ev.on_finished(finish, static_cast<uint32_t>(completion.size()), 32);
  }
  std::map<std::string, DecodeEvents> events_;
  bool prefill_locally_ = false;
};

struct Collected {
  std::vector<uint32_t> ids;
  std::string text;
  int deltas = 0;
  bool finished = false;
  Finish reason = Finish::kNone;
  Usage usage;
  Status error;
};

class LifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tok = model::Tokenizer::Load(std::string(TANDEM_SOURCE_DIR) +
                                      "/tests/fixtures/model/tokenizers/gpt2_style");
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tokenizer_ = std::move(tok).value();
    RouterConfig rc;
    rc.policy = "round_robin";
    router::RouterOptions ro;
    auto router = router::Router::Create(rc, ro);
    ASSERT_TRUE(router.ok());
    FleetRequirements req;
    req.model = "m";
    fleet_ = std::make_unique<Fleet>(req, std::move(router).value());
  }

  void AddWorker(const std::string& name, router::WorkerRole role) {
    WorkerRecord w;
    w.name = name;
    w.role = role;
    w.grpc_address = name + ":1";
    w.protocol_version = 1;
    w.model = "m";
    w.block_size = 16;
    w.kv_dtype = "f32";
    w.block_bytes = 4096;
    w.num_blocks = 1000;
    ASSERT_TRUE(fleet_->Register(w).ok());
  }

  std::shared_ptr<RequestLifecycle> Run(Collected& c, std::vector<std::string> stop = {}) {
    LifecycleDeps deps;
    deps.fleet = fleet_.get();
    deps.client = &workers_;
    deps.tokenizer = tokenizer_.get();
    deps.root_hash = 1;
    deps.block_size = 16;
    ValidatedRequest req;
    req.request_id = "r1";
    req.prompt_ids = std::vector<uint32_t>(40, 7);
    req.max_tokens = 64;
    req.stop = std::move(stop);
    ResponseSink sink;
    sink.on_delta = [&c](std::vector<uint32_t> ids, std::string text) {
      c.ids.insert(c.ids.end(), ids.begin(), ids.end());
      c.text += text;
      ++c.deltas;
    };
    sink.on_finish = [&c](Finish r, Usage u) {
      c.finished = true;
      c.reason = r;
      c.usage = u;
    };
    sink.on_error = [&c](Status s) { c.error = s; };
    return RequestLifecycle::Start(deps, req, sink, std::chrono::system_clock::time_point::max());
  }

  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::unique_ptr<Fleet> fleet_;
  ScriptedWorkers workers_;
};

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

}  // namespace
}  // namespace tandem::proxy
