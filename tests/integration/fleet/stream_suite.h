// What the transport suites on a real 1P1D fleet share (decode_stream_test,
// prefill_transport_test): concurrent Generate streams whose outputs must
// equal `tandem generate` token for token, one of them cancelled by its
// client after a few messages (what it got is the start of the same
// completion), then nothing held anywhere; and a metric summed over the
// workers of one role.
#pragma once

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <future>
#include <string>
#include <vector>

#include "fleet_harness.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {

// `name` summed over the fleet's workers of `role` ("decode", "prefill").
inline double RoleMetric(const Fleet& fleet, const std::string& role, const std::string& name) {
  double v = 0;
  for (const auto& w : fleet.workers()) {
    if (w.role != role) continue;
    auto m = Scrape(w.metrics);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (m.ok()) v += MetricValue(*m, name);
  }
  return v;
}

struct StreamOutcome {
  std::vector<uint32_t> tokens;
  int messages = 0;
  grpc::Status status;
};

// One Generate stream (greedy, ignore_eos) on `channel`; with
// `cancel_after` > 0 the client cancels it after that many messages.
inline StreamOutcome StreamGenerate(const std::shared_ptr<grpc::Channel>& channel,
                                    const std::vector<uint32_t>& prompt, uint32_t max_tokens,
                                    int cancel_after) {
  auto stub = tandem::v1::Generation::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  tandem::v1::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  StreamOutcome o;
  tandem::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    o.tokens.insert(o.tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    if (++o.messages == cancel_after) ctx.TryCancel();
  }
  o.status = reader->Finish();
  return o;
}

// ... on a channel of its own.
inline StreamOutcome StreamGenerate(const std::string& proxy, const std::vector<uint32_t>& prompt,
                                    uint32_t max_tokens, int cancel_after) {
  return StreamGenerate(grpc::CreateChannel(proxy, grpc::InsecureChannelCredentials()), prompt,
                        max_tokens, cancel_after);
}

struct StreamSuite {
  uint32_t streams = 0;
  uint32_t max_tokens = 0;
  std::function<std::vector<uint32_t>(uint32_t)> prompt;  // stream i's prompt
  uint32_t cancelled = 0;             // this stream is cancelled (when asked for)
  uint32_t cancelled_max_tokens = 400;
  int cancel_after = 1;               // messages
  // Set: every stream on this one channel (one HTTP/2 connection); else
  // each on a channel of its own.
  std::shared_ptr<grpc::Channel> channel;

  // `tandem generate`'s output for every stream (computed once per suite).
  const std::vector<std::vector<uint32_t>>& References() const {
    if (refs_.empty()) {
      for (uint32_t i = 0; i < streams; ++i) {
        auto ids = ReferenceGenerate(prompt(i), max_tokens);
        EXPECT_TRUE(ids.ok()) << ids.status().ToString();
        refs_.push_back(ids.ok() ? *ids : std::vector<uint32_t>{});
      }
    }
    return refs_;
  }

  // Runs every stream at once through the fleet's proxy and checks them.
  void Run(const Fleet& fleet, bool cancel_one) const {
    const auto& refs = References();
    std::vector<std::future<StreamOutcome>> futures;
    for (uint32_t i = 0; i < streams; ++i) {
      const bool cancel = cancel_one && i == cancelled;
      futures.push_back(std::async(std::launch::async, [&, i, cancel] {
        const uint32_t n = cancel ? cancelled_max_tokens : max_tokens;
        const int after = cancel ? cancel_after : 0;
        return channel ? StreamGenerate(channel, prompt(i), n, after)
                       : StreamGenerate(fleet.proxy_grpc(), prompt(i), n, after);
      }));
    }
    for (uint32_t i = 0; i < streams; ++i) {
      StreamOutcome o = futures[i].get();
      if (cancel_one && i == cancelled) {
        EXPECT_EQ(o.status.error_code(), grpc::StatusCode::CANCELLED) << o.status.error_message();
        EXPECT_LT(o.tokens.size(), cancelled_max_tokens);
        // What it got before the cancel is the start of the same completion.
        const size_t n = std::min<size_t>(o.tokens.size(), refs[i].size());
        EXPECT_EQ(std::vector<uint32_t>(o.tokens.begin(), o.tokens.begin() + n),
                  std::vector<uint32_t>(refs[i].begin(), refs[i].begin() + n));
        continue;
      }
      ASSERT_TRUE(o.status.ok()) << "stream " << i << ": " << o.status.error_message();
      EXPECT_EQ(o.tokens, refs[i]) << "stream " << i;
    }
    // Nothing is held anywhere once they ended (the cancelled one included).
    EXPECT_EQ(WaitFleetIdle(fleet.workers(), fleet.proxy_metrics(), std::chrono::seconds(20)), "");
  }

 private:
  mutable std::vector<std::vector<uint32_t>> refs_;
};

// `streams` streams of `max_tokens` tokens, stream i asking `prompt(i)`;
// stream `cancelled` (when a run cancels one) asks 400 tokens and is
// cancelled after `cancel_after` messages.
inline StreamSuite CancellingSuite(uint32_t streams, uint32_t max_tokens,
                                   std::function<std::vector<uint32_t>(uint32_t)> prompt,
                                   uint32_t cancelled, int cancel_after) {
  StreamSuite s;
  s.streams = streams;
  s.max_tokens = max_tokens;
  s.prompt = std::move(prompt);
  s.cancelled = cancelled;
  s.cancelled_max_tokens = 400;
  s.cancel_after = cancel_after;
  return s;
}

}  // namespace tandem::testing
