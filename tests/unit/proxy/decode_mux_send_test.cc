// The decode stream's sends and its reader (proxy/decode_mux_client.h,
// issue 23 session 36): a transport that sends inline releases the
// stream's handle lock for the send, and then nothing of a start keeps a
// batch read meanwhile from its requests. Here on a transport whose sends
// the test holds; framed TCP (the same release) runs in
// decode_mux_tcp_client_test and, with real decoders, decode_stream_test.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "proxy/decode_mux_client.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

// Records every send ("start 1", "cancel 1", ...). While held, a start
// waits in its send (the handle lock released, as framed TCP does) until
// the test lets it go.
class HeldMux final : public DecodeMux {
 public:
  using DecodeMux::Deliver;

  void Hold() {
    std::lock_guard lock(test_mu_);
    hold_ = true;
  }
  // Waits until a start is held in its send.
  void WaitHeld() {
    std::unique_lock lock(test_mu_);
    cv_.wait(lock, [this] { return held_; });
  }
  void Release() {
    std::lock_guard lock(test_mu_);
    hold_ = held_ = false;
    cv_.notify_all();
  }
  std::vector<std::string> sent() {
    std::lock_guard lock(test_mu_);
    return sent_;
  }

 private:
  void SendLocked(std::unique_lock<std::mutex>& lock, pb::DecodeStreamRequest msg) override {
    lock.unlock();
    std::unique_lock t(test_mu_);
    if (msg.has_start() && hold_) {
      held_ = true;
      cv_.notify_all();
      cv_.wait(t, [this] { return !hold_; });
    }
    sent_.push_back(msg.has_start() ? "start " + std::to_string(msg.start().handle())
                                    : "cancel " + std::to_string(msg.cancel()));
  }
  void CancelRpc() override {}

  std::mutex test_mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  bool held_ = false;
  std::vector<std::string> sent_;
};

DecodeArgs Args() {
  DecodeArgs a;
  a.request_id = "req";
  a.prompt_ids = std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>{1, 2, 3});
  a.params.max_tokens = 4;
  a.deadline = std::chrono::system_clock::time_point::max();
  a.attempt = 1;
  return a;
}

// What one request saw.
struct Seen {
  std::mutex mu;
  std::vector<uint32_t> tokens;
  DecodeEvents Events() {
    DecodeEvents e;
    e.on_tokens = [this](uint32_t, std::span<const uint32_t> ids) {
      std::lock_guard lock(mu);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
    };
    return e;
  }
};

TEST(DecodeMuxSend, ABatchIsDeliveredWhileAStartIsOnTheWire) {
  auto mux = std::make_shared<HeldMux>();
  Seen a, b;
  DecodeEvents ea = a.Events(), eb = b.Events();
  ASSERT_NE(mux->Start(Args(), ea), nullptr);  // handle 1, sent at once
  mux->Hold();
  std::thread starter([&] { ASSERT_NE(mux->Start(Args(), eb), nullptr); });  // handle 2, held
  mux->WaitHeld();
  // Handle 1's tokens arrive while handle 2's start is being sent.
  const std::vector<uint32_t> ids = {7, 8};
  DecodeItem item;
  item.handle = 1;
  item.first_index = 1;
  item.token_ids = ids;
  mux->Deliver(std::span<const DecodeItem>(&item, 1));
  {
    std::lock_guard lock(a.mu);
    EXPECT_EQ(a.tokens, ids);
  }
  EXPECT_EQ(mux->sent(), (std::vector<std::string>{"start 1"}));  // still held
  mux->Release();
  starter.join();
  EXPECT_EQ(mux->sent(), (std::vector<std::string>{"start 1", "start 2"}));
}

}  // namespace
}  // namespace tandem::proxy
