#include "common/lifeline.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <future>
#include <string>
#include <thread>

namespace tandem {
namespace {

TEST(Lifeline, GuardedCallbacksRunUntilEndAndNotAfter) {
  Lifeline life;
  int runs = 0;
  std::function<void(int)> add = life.Guard([&](int n) { runs += n; });
  std::function<std::string()> name = life.Guard([] { return std::string("kept"); });
  add(2);
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(name(), "kept");
  EXPECT_FALSE(life.ended());
  life.End();
  EXPECT_TRUE(life.ended());
  add(5);
  EXPECT_EQ(runs, 2) << "a guarded callback ran after End";
  EXPECT_EQ(name(), "") << "after End a guarded callback returns a value-initialized result";
  life.End();  // idempotent
}

// End waits for a callback that is running on another thread, and nested
// guarded callbacks do not deadlock it.
TEST(Lifeline, EndWaitsForARunningCallback) {
  Lifeline life;
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> finished{false};
  auto inner = life.Guard([] {});
  auto slow = life.Guard([&] {
    inner();  // nested
    entered.set_value();
    released.wait();
    finished = true;
  });
  std::thread t([&] { slow(); });
  entered.get_future().wait();
  std::atomic<bool> finished_when_ended{false};
  std::thread stopper([&] {
    life.End();
    finished_when_ended = finished.load();
  });
  // End has begun (no callback may start now) while `slow` still runs.
  while (!life.ended()) std::this_thread::yield();
  EXPECT_FALSE(life.Guard([] { return true; })()) << "a callback started after End began";
  release.set_value();
  stopper.join();
  t.join();
  EXPECT_TRUE(finished_when_ended.load()) << "End returned before the running callback finished";
}

// A component's entry point holds a Pass: End waits for it to be given
// back, and once End began an entry gets an empty one (it does nothing).
TEST(Lifeline, EndWaitsForAHeldPassAndLaterEntriesGetNone) {
  Lifeline life;
  {
    const auto pass = life.Enter();
    EXPECT_TRUE(static_cast<bool>(pass));
    const auto nested = life.Enter();  // an entry point calling another
    EXPECT_TRUE(static_cast<bool>(nested));
  }
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> left{false};
  std::thread holder([&] {
    const auto pass = life.Enter();
    entered.set_value();
    released.wait();
    left = true;
  });
  entered.get_future().wait();
  std::atomic<bool> left_when_ended{false};
  std::thread stopper([&] {
    life.End();
    left_when_ended = left.load();
  });
  while (!life.ended()) std::this_thread::yield();
  EXPECT_FALSE(static_cast<bool>(life.Enter())) << "an entry got a Pass after End began";
  release.set_value();
  stopper.join();
  holder.join();
  EXPECT_TRUE(left_when_ended.load()) << "End returned while a Pass was held";
}

}  // namespace
}  // namespace tandem
