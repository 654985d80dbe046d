// The launcher's process supervision, with /bin/sh children standing in for
// tandem processes (the real fleet is exercised by the serving integration
// tests through `tandem launch`).
#include "cli/supervisor.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>

namespace tandem::cli {
namespace {

using namespace std::chrono_literals;

// A child that runs `before`, writes its ready line to the fd given as
// `--ready-fd N` ($2), then runs `then`.
ChildSpec ShChild(const std::string& name, const std::string& then,
                  const std::string& before = "") {
  const std::string script =
      before +
      "printf '{\"grpc\":\"127.0.0.1:1%s\",\"metrics\":\"127.0.0.1:2%s\"}\\n' $$ $$ >&\"$2\"; " +
      then;
  return {name, "prefill", {"/bin/sh", "-c", script, "sh"}};
}

TEST(Supervisor, StartsChildrenAndReadsReadyLines) {
  Supervisor sup;
  auto a = sup.Start(ShChild("prefill-0", "exec sleep 30"), 10s);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE((*a)->alive);
  EXPECT_EQ((*a)->grpc, "127.0.0.1:1" + std::to_string((*a)->pid));
  EXPECT_EQ((*a)->metrics, "127.0.0.1:2" + std::to_string((*a)->pid));
  auto b = sup.Start(ShChild("decode-0", "exec sleep 30"), 10s);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(sup.StopAll(5s), 0);  // both stop on SIGTERM
  for (const auto& c : sup.children()) {
    EXPECT_FALSE(c.alive);
    EXPECT_TRUE(WIFSIGNALED(c.exit_status));
    EXPECT_EQ(WTERMSIG(c.exit_status), SIGTERM);
  }
}

TEST(Supervisor, ChildDyingBeforeReadyIsAnError) {
  Supervisor sup;
  auto r = sup.Start({"proxy", "proxy", {"/bin/sh", "-c", "exit 3", "sh"}}, 10s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exited with status 3 before it was ready"),
            std::string::npos)
      << r.status().message();
}

TEST(Supervisor, ChildNeverReadyTimesOut) {
  Supervisor sup;
  auto r = sup.Start({"slow", "decode", {"/bin/sh", "-c", "exec sleep 30", "sh"}}, 500ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(sup.children().back().alive);  // killed and reaped
}

TEST(Supervisor, DeathOfOneChildLeavesTheOthers) {
  Supervisor sup;
  auto a = sup.Start(ShChild("prefill-0", "exec sleep 30"), 10s);
  auto b = sup.Start(ShChild("decode-0", "exec sleep 30"), 10s);
  ASSERT_TRUE(a.ok() && b.ok());
  kill((*a)->pid, SIGKILL);
  EXPECT_EQ(sup.WaitForSignalOrDeath({"prefill-0"}), 0);
  EXPECT_FALSE(sup.children()[0].alive);
  EXPECT_TRUE(sup.children()[1].alive);
  EXPECT_EQ(DescribeExit(sup.children()[0]),
            "prefill-0 (pid " + std::to_string(sup.children()[0].pid) +
                ") was killed by signal 9");
}

TEST(Supervisor, StubbornChildIsKilledAfterGrace) {
  Supervisor sup;
  // The ignored SIGTERM is set before the ready line and survives exec.
  auto a = sup.Start(ShChild("stubborn", "exec sleep 30", "trap '' TERM; "), 10s);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(sup.StopAll(300ms), 1);
  EXPECT_FALSE(sup.children()[0].alive);
}

TEST(Supervisor, SigtermToTheLauncherIsReported) {
  Supervisor sup;
  auto a = sup.Start(ShChild("prefill-0", "exec sleep 30"), 10s);
  ASSERT_TRUE(a.ok());
  kill(getpid(), SIGTERM);  // blocked, delivered through the signalfd
  EXPECT_EQ(sup.WaitForSignalOrDeath({}), SIGTERM);
}

}  // namespace
}  // namespace tandem::cli
