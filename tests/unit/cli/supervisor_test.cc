// The launcher's process supervision, with /bin/sh children standing in for
// tandem processes (the real fleet is exercised by the serving integration
// tests through `tandem launch`).
#include "cli/supervisor.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>

namespace tandem::cli {
namespace {

using namespace std::chrono_literals;

// A child that runs `before`, writes its ready line to the fd given as
// `--ready-fd N` ($2), then runs `then`. Through /proc/self/fd/N: dash's
// `>&N` takes single-digit descriptors only, and N is 10 or more when the
// test process has enough open.
ChildSpec ShChild(const std::string& name, const std::string& then,
                  const std::string& before = "") {
  const std::string script =
      before +
      "printf '{\"grpc\":\"127.0.0.1:1%s\",\"metrics\":\"127.0.0.1:2%s\"}\\n' $$ $$ >\"/proc/self/fd/$2\"; " +
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

// Issue 18: a worker of several ranks is one group; the death of any rank
// stops the rest of it (and nothing else).
ChildSpec RankChild(const std::string& name, uint32_t rank, uint32_t ranks,
                    const std::string& then = "exec sleep 30") {
  ChildSpec spec = ShChild(name, then);
  spec.role = "decode";
  spec.rank = rank;
  spec.ranks = ranks;
  return spec;
}

// Waits (bounded by `rounds` of at most 5 s) until every child named `name` is reaped.
bool WaitGroupGone(Supervisor& sup, const std::string& name, int rounds = 6) {
  for (int i = 0; i < rounds; ++i) {
    bool any = false;
    for (const auto& c : sup.children()) any = any || (c.alive && c.spec.name == name);
    if (!any) return true;
    sup.WaitForSignalOrDeath({name}, 5s);
  }
  return false;
}

TEST(Supervisor, DeathOfOneRankStopsItsWorkerGroupOnly) {
  Supervisor sup;
  auto other = sup.Start(ShChild("prefill-0", "exec sleep 30"), 10s);
  auto r1 = sup.Start(RankChild("decode-0", 1, 2), 10s);
  auto r0 = sup.Start(RankChild("decode-0", 0, 2), 10s);
  ASSERT_TRUE(other.ok() && r1.ok() && r0.ok());
  const pid_t pid1 = (*r1)->pid;
  ASSERT_EQ(kill(pid1, SIGKILL), 0);
  ASSERT_TRUE(WaitGroupGone(sup, "decode-0"));
  const Child& c1 = sup.children()[1];
  const Child& c0 = sup.children()[2];
  EXPECT_EQ(DescribeExit(c1),
            "decode-0 rank 1 (pid " + std::to_string(pid1) + ") was killed by signal 9");
  EXPECT_FALSE(c1.group_stopped);  // it died by itself
  EXPECT_TRUE(c0.group_stopped);   // rank 0 was stopped because of it
  EXPECT_TRUE(WIFSIGNALED(c0.exit_status));
  EXPECT_EQ(WTERMSIG(c0.exit_status), SIGKILL);
  EXPECT_TRUE(sup.children()[0].alive);  // another worker keeps serving
}

TEST(Supervisor, DeathOfRankZeroStopsTheFollowers) {
  Supervisor sup;
  auto r2 = sup.Start(RankChild("decode-0", 2, 3), 10s);
  auto r1 = sup.Start(RankChild("decode-0", 1, 3), 10s);
  // Rank 0 exits with status 4 when the test tells it to (SIGUSR1; the trap is set before
  // its ready line), once all three run.
  ChildSpec rank0 = RankChild("decode-0", 0, 3);
  rank0.argv = ShChild("decode-0", "sleep 30 & wait", "trap 'kill $!; exit 4' USR1; ").argv;
  auto r0 = sup.Start(rank0, 10s);
  ASSERT_TRUE(r2.ok() && r1.ok() && r0.ok());
  ASSERT_EQ(kill((*r0)->pid, SIGUSR1), 0);
  ASSERT_TRUE(WaitGroupGone(sup, "decode-0"));
  EXPECT_EQ(DescribeExit(sup.children()[2]),
            "decode-0 rank 0 (pid " + std::to_string(sup.children()[2].pid) +
                ") exited with status 4");
  for (int i : {0, 1}) {
    EXPECT_TRUE(sup.children()[i].group_stopped) << i;
    EXPECT_EQ(WTERMSIG(sup.children()[i].exit_status), SIGKILL) << i;
  }
}

TEST(Supervisor, DrainSignalsRankZeroAndTheFollowersGoWithIt) {
  Supervisor sup;
  // The follower ignores SIGTERM (kept across exec): only rank 0's exit may end it.
  auto r1 = sup.Start(RankChild("decode-0", 1, 2, "trap '' TERM; exec sleep 30"), 10s);
  auto r0 = sup.Start(RankChild("decode-0", 0, 2), 10s);
  ASSERT_TRUE(r1.ok() && r0.ok());
  EXPECT_TRUE(sup.Drain("decode-0"));
  ASSERT_TRUE(WaitGroupGone(sup, "decode-0"));
  EXPECT_EQ(WTERMSIG(sup.children()[1].exit_status), SIGTERM);  // rank 0 drained
  EXPECT_TRUE(sup.children()[0].draining);
  EXPECT_EQ(WTERMSIG(sup.children()[0].exit_status), SIGKILL);  // then its follower stopped
}

TEST(Supervisor, KillGroupKillsEveryRank) {
  Supervisor sup;
  auto r1 = sup.Start(RankChild("decode-0", 1, 2), 10s);
  auto other = sup.Start(ShChild("prefill-0", "exec sleep 30"), 10s);
  ASSERT_TRUE(r1.ok() && other.ok());
  EXPECT_EQ(sup.KillGroup("decode-0"), 1);
  EXPECT_FALSE(sup.children()[0].alive);
  EXPECT_TRUE(sup.children()[1].alive);
}

// ChildSpec::env replaces or adds variables in the child's environment
// only (a cuda rank's CUDA_VISIBLE_DEVICES).
TEST(Supervisor, ChildEnvironmentReplacesTheLaunchersValue) {
  setenv("TANDEM_SUPERVISOR_TEST_A", "launcher", 1);
  ChildSpec spec{"decode-0", "decode",
                 {"/bin/sh", "-c",
                  "printf '{\"grpc\":\"%s\",\"metrics\":\"%s\"}\\n' \"$TANDEM_SUPERVISOR_TEST_A\" "
                  "\"$TANDEM_SUPERVISOR_TEST_B\" >\"/proc/self/fd/$2\"; exec sleep 30",
                  "sh"}};
  spec.env = {"TANDEM_SUPERVISOR_TEST_A=child", "TANDEM_SUPERVISOR_TEST_B=2"};
  Supervisor sup;
  auto a = sup.Start(spec, 10s);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->grpc, "child");
  EXPECT_EQ((*a)->metrics, "2");
  EXPECT_STREQ(getenv("TANDEM_SUPERVISOR_TEST_A"), "launcher");  // the launcher's own is kept
  spec.env.clear();
  auto b = sup.Start(spec, 10s);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->grpc, "launcher");
  EXPECT_EQ((*b)->metrics, "");
}

}  // namespace
}  // namespace tandem::cli
