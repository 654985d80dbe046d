// ReactorDrain (proxy/reactor_drain.h): the owner's wait ends when the last
// armed token is destroyed, on whatever thread; a token left alive is
// reported when the bound passes; a token armed twice counts once.
#include "proxy/reactor_drain.h"

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <thread>

namespace tandem::proxy {
namespace {

using namespace std::chrono_literals;

TEST(ReactorDrain, WaitEndsWhenTheLastTokenGoesOnAnotherThread) {
  ReactorDrain drain;
  EXPECT_EQ(drain.WaitForNone(0ms), 0u);  // nothing armed
  auto a = std::make_unique<ReactorDrain::Token>();
  auto b = std::make_unique<ReactorDrain::Token>();
  drain.Arm(*a);
  drain.Arm(*b);
  drain.Arm(*b);  // once per token
  EXPECT_EQ(drain.live(), 2u);
  a.reset();
  EXPECT_EQ(drain.live(), 1u);
  std::promise<void> waiting;
  std::thread reactor([&b, ready = waiting.get_future()]() mutable {
    ready.wait();
    b.reset();  // as a reactor destroyed on a gRPC thread
  });
  waiting.set_value();
  EXPECT_EQ(drain.WaitForNone(60s), 0u);  // 60 s: the failure bound only
  reactor.join();
}

TEST(ReactorDrain, ATokenStillAliveIsReportedAtTheBound) {
  ReactorDrain drain;
  ReactorDrain::Token held;
  drain.Arm(held);
  EXPECT_EQ(drain.WaitForNone(1ms), 1u);
  ReactorDrain::Token never_armed;  // a default token counts nothing
  EXPECT_EQ(drain.live(), 1u);
}

TEST(ReactorDrain, TokensMayOutliveTheDrain) {
  auto token = std::make_unique<ReactorDrain::Token>();
  {
    ReactorDrain drain;
    drain.Arm(*token);
  }
  token.reset();  // its state is shared: no use after the drain is gone
}

}  // namespace
}  // namespace tandem::proxy
