// Transport::SetNotificationCallback returns only once no call of the
// callback it replaces is running: a component that unsets its callback in
// its Stop (the decoder's service, in its destructor) is not called
// afterwards, on the progress thread of whichever transport delivers the
// notice. Over every in-process backend.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

#include "kv_test_util.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using testing::WaitFor;
using namespace std::chrono_literals;

class CallbackSetterTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Transport> Make(const std::string& name) {
    TransportOptions o;
    o.backend = GetParam();
    o.agent_name = name + "-" + GetParam();
    o.block_bytes = 4096;
    o.num_blocks = 4;
    auto t = CreateTransport(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  }
  static void PostNotice(Transport& t, PeerId peer, const std::string& payload) {
    auto x = t.PrepareWrite(peer, {}, payload);
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    ASSERT_TRUE(t.Post(*x, [&t](XferId id, XferStatus, const Status&) {
      t.Release(id).IgnoreError();
    }).ok());
  }
};

TEST_P(CallbackSetterTest, UnsettingTheNoticeCallbackWaitsForTheRunningCall) {
  auto a = Make("setter-a");
  auto b = Make("setter-b");
  ASSERT_TRUE(a && b);
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> calls{0};
  std::atomic<bool> finished{false};
  b->SetNotificationCallback([&](Notification) {
    if (++calls != 1) return;
    entered.set_value();
    released.wait();
    finished = true;
  });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  PostNotice(*a, *peer, "one");
  entered.get_future().wait();  // the callback runs, held
  std::atomic<bool> returned{false}, finished_when_returned{false};
  std::thread stopper([&] {
    b->SetNotificationCallback({});
    finished_when_returned = finished.load();
    returned = true;
  });
  // While the call is held the setter does not return (it returned at once
  // before the setters waited).
  EXPECT_FALSE(WaitFor([&] { return returned.load(); }, 300ms))
      << "SetNotificationCallback returned while the callback it replaced was running";
  release.set_value();
  stopper.join();
  EXPECT_TRUE(finished_when_returned.load());
  // Unset: the next notice is queued, the old callback is not called.
  PostNotice(*a, *peer, "two");
  ASSERT_TRUE(WaitFor([&] { return b->stats().notifications_received == 2; }));
  EXPECT_EQ(calls.load(), 1);
  auto queued = b->TakeNotifications();
  ASSERT_EQ(queued.size(), 1u);
  EXPECT_EQ(queued[0].payload, "two");
}

// A callback may replace itself (a setter called from inside a call does
// not wait for that call).
TEST_P(CallbackSetterTest, ACallbackMayUnsetItself) {
  auto a = Make("self-a");
  auto b = Make("self-b");
  ASSERT_TRUE(a && b);
  std::atomic<int> calls{0};
  Transport* reader = b.get();
  b->SetNotificationCallback([&calls, reader](Notification) {
    ++calls;
    reader->SetNotificationCallback({});
  });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  PostNotice(*a, *peer, "one");
  PostNotice(*a, *peer, "two");
  ASSERT_TRUE(WaitFor([&] { return b->stats().notifications_received == 2; }));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(b->TakeNotifications().size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Backends, CallbackSetterTest, ::testing::Values("loopback", "ucx"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem::kvtransfer
