// Shared by the lifecycle tests (lifecycle_test.cc, lifecycle_retry_test.cc):
// a scripted WorkerClient, the collected outcome of one request, and the
// fixture that runs requests through a Lifecycle.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "common/block_hash.h"
#include "common/config.h"
#include "common/delivery_scope.h"
#include "proxy/lifecycle.h"

namespace tandem::proxy::lifecycle_testing {

class FakeCall : public Call {
 public:
  void Cancel() override { cancelled = true; }
  void Forget() override { forgotten = true; }
  std::atomic<bool> cancelled{false};
  std::atomic<bool> forgotten{false};
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
  std::vector<Status> first_prefill_errors;  // the first Prefills fail with these, in order
  bool decode_first = false;            // stream the decode tokens before the Prefill reply
  // What a real decoder relays, at the end of its stream, from the
  // prefiller's KV notice: the prefiller's prefix-cache hits (as its reply).
  uint32_t notice_cached = 16;
  bool hold_prefill = false;            // a Prefill never answers (until cancelled)
  std::vector<std::string> decode_addresses, prefill_addresses;
  std::vector<std::shared_ptr<FakeCall>> decode_calls;
  std::vector<DecodeArgs> decode_args;
  std::vector<PrefillArgs> prefill_args;
  // The first `dying_decodes` Decode streams break (as a killed decoder's
  // would) after `die_after` tokens.
  uint32_t dying_decodes = 0;
  uint32_t die_after = 0;
  Status die_status = UnavailableError("Socket closed");  // how they break
  bool die_in_band = false;                                // ... and whether in band
  // Each chunk is delivered inside a DeliveryScope, as the decode stream
  // delivers one frame (DecodeMux::Deliver).
  bool scope_per_chunk = false;

  std::shared_ptr<Call> Decode(const std::string& address, DecodeArgs args,
                               DecodeEvents events) override {
    decode_addresses.push_back(address);
    decode_args.push_back(args);
    base_[address] = args.params.first_sample_index;
    dies_[address] = decode_addresses.size() <= dying_decodes;
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
    prefill_args.push_back(args);
    if (hold_prefill) {
      // no answer
    } else if (prefill_addresses.size() <= first_prefill_errors.size()) {
      done(first_prefill_errors[prefill_addresses.size() - 1]);
    } else if (!prefill_error.ok()) {
      done(prefill_error);
    } else if (full_decoders.count(args.decoder_address)) {
      done(ResourceExhaustedError("decoder has no room"));
    } else {
      PrefillResult r;
      r.first_token_id = completion.at(base_[args.decoder_address]);
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
    const uint32_t base = base_[decoder];
    const uint32_t n = static_cast<uint32_t>(completion.size()) - base;
    const uint32_t stop = dies_[decoder] ? std::min(n, die_after) : n;
    for (uint32_t i = 0; i < stop; i += chunk) {
      const auto end = std::min<size_t>(stop, i + chunk);
      std::optional<DeliveryScope> scope;
      if (scope_per_chunk) scope.emplace();
      ev.on_tokens(i, std::vector<uint32_t>(completion.begin() + base + i,
                                            completion.begin() + base + end));
    }
    if (dies_[decoder]) {
      ev.on_error(die_status, die_in_band);
      return;
    }
    ev.on_finished(finish, n, 32, notice_cached);
  }
  std::map<std::string, DecodeEvents> events_;
  std::map<std::string, uint32_t> base_;
  std::map<std::string, bool> dies_;
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

  // `waits_for_registration`: a decoder's WorkerInfo.reserve_waits_for_registration.
  void AddWorker(const std::string& name, router::WorkerRole role,
                 bool waits_for_registration = false, bool takes_prompt_from_reserve = false) {
    WorkerRecord w;
    w.name = name;
    w.role = role;
    w.reserve_waits_for_registration = waits_for_registration;
    w.takes_prompt_from_reserve = takes_prompt_from_reserve;
    w.grpc_address = name + ":1";
    w.protocol_version = 1;
    w.model = "m";
    w.block_size = 16;
    w.kv_dtype = "f32";
    w.block_bytes = 4096;
    w.num_blocks = 1000;
    ASSERT_TRUE(fleet_->Register(w).ok());
  }

  std::shared_ptr<RequestLifecycle> Run(Collected& c, std::vector<std::string> stop = {},
                                        uint32_t max_migrations = 3) {
    LifecycleDeps deps;
    deps.max_migrations = max_migrations;
    deps.fleet = fleet_.get();
    deps.client = client_ != nullptr ? client_ : &workers_;
    deps.tokenizer = tokenizer_.get();
    deps.root_hash = 1;
    deps.block_size = 16;
    deps.defer_launch = defer_launch_;
    deps.metrics = metrics_;
    deps.calibration = calibration_;
    ValidatedRequest req;
    req.predicted_ttft_ms = predicted_ttft_ms_;
    req.ttft_slo_ms = ttft_slo_ms_;
    req.request_id = "r1";
    req.prompt_ids = std::vector<uint32_t>(40, 7);
    // As the native front end keeps them: the packed field in the body.
    req.prompt_varints.owner = "\x22\x28" + std::string(40, '\x07');
    req.prompt_varints.at = 2;
    req.prompt_varints.size = 40;
    req.max_tokens = max_tokens_;
    req.stop = std::move(stop);
    ResponseSink sink;
    sink.on_delta = [&c](std::span<const uint32_t> ids, std::string_view text) {
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
    sink.hot = sink_hot_;
    return RequestLifecycle::Start(deps, req, sink, std::chrono::system_clock::time_point::max(),
                                   arrival_ ? *arrival_ : std::chrono::steady_clock::now());
  }

  std::unique_ptr<model::Tokenizer> tokenizer_;
  std::unique_ptr<Fleet> fleet_;
  ScriptedWorkers workers_;
  WorkerClient* client_ = nullptr;  // instead of workers_ when set
  uint32_t max_tokens_ = 64;
  std::function<void(std::function<void()>)> defer_launch_;
  // When the request arrived at the front end (unset: when Run starts it).
  std::optional<std::chrono::steady_clock::time_point> arrival_;
  ProxyMetrics* metrics_ = nullptr;
  // SLO admission's calibration, and what admission left on the request.
  TtftCalibration* calibration_ = nullptr;
  double predicted_ttft_ms_ = -1;
  uint32_t ttft_slo_ms_ = 0;
  std::array<HotBytes, 2> sink_hot_{};  // the sink's HotBytes
};

// Workers that answer only when the test says so.
class HeldWorkers : public WorkerClient {
 public:
  DecodeEvents events;
  std::function<void(Result<PrefillResult>)> prefill_done;
  std::shared_ptr<FakeCall> decode_call = std::make_shared<FakeCall>();
  std::shared_ptr<FakeCall> prefill_call = std::make_shared<FakeCall>();
  // What happened, in order ("decode", "prefill"), and the calls' args.
  std::vector<std::string> calls;
  std::optional<DecodeArgs> decode_args;
  std::optional<PrefillArgs> prefill_args;
  std::shared_ptr<Call> Decode(const std::string&, DecodeArgs args, DecodeEvents ev) override {
    calls.push_back("decode");
    decode_args = std::move(args);
    events = std::move(ev);
    return decode_call;
  }
  std::shared_ptr<Call> Prefill(const std::string&, PrefillArgs args,
                                std::function<void(Result<PrefillResult>)> done) override {
    calls.push_back("prefill");
    prefill_args = std::move(args);
    prefill_done = std::move(done);
    return prefill_call;
  }
};

// Calls that ended by themselves (the prefill replied, or the decoder finished: it had the KV;
// the decode stream's finished item ended its handle) are not cancelled at the end (issue 23:

}  // namespace tandem::proxy::lifecycle_testing
