// Shared by the Reserve transport tests (reserve_tcp_test, reserve_grpc_test):
// a registered request, one DecoderLink::Reserve call's outcome.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>

#include "prefiller/prefiller.h"
#include "worker_test_util.h"

namespace tandem::worker_test {

// Registers request `id` on `decoder` (greedy, 4 tokens); its stream's sink.
inline std::shared_ptr<RecordingSink> RegisterRequest(decoder::Decoder& decoder,
                                                      const std::string& id,
                                                      const std::vector<uint32_t>& prompt) {
  auto sink = std::make_shared<RecordingSink>();
  decoder::DecodeSpec s;
  s.request_id = id;
  s.prompt_ids = prompt;
  s.sampling = Greedy(4);
  EXPECT_TRUE(decoder.Register(s, sink).ok());
  return sink;
}

// One call's outcome (its `done` must run exactly once).
struct Outcome {
  std::promise<Result<prefiller::ReserveTarget>> p;
  std::future<Result<prefiller::ReserveTarget>> f = p.get_future();
  std::atomic<int> runs{0};
  prefiller::DecoderLink::ReserveDone Done() {
    return [this](Result<prefiller::ReserveTarget> r) {
      if (runs.fetch_add(1) == 0) p.set_value(std::move(r));
    };
  }
  Result<prefiller::ReserveTarget> Get() {
    EXPECT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    return f.get();
  }
};

}  // namespace tandem::worker_test
