// The CPU time the bench commands charge to a process (cli/proc_stats.h),
// read from another process as `tandem bench proxy` reads the fleet's.
#include "cli/proc_stats.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <thread>

namespace tandem::cli {
namespace {

double OwnCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

void BurnUntil(double cpu_s) {
  volatile unsigned long x = 0;
  while (OwnCpuSeconds() < cpu_s) {
    for (int i = 0; i < 100000; ++i) x = x + static_cast<unsigned long>(i);
  }
}

// A child burns CPU on a thread that then exits and on its main thread,
// reports its own CPU time (nanoseconds) on a pipe and waits to be killed.
// The reading from outside must include the exited thread and must not
// lag the child's own figure: utime + stime in 10 ms ticks would (by up
// to a tick; the lower bound below catches it).
TEST(ProcStats, ProcessCpuSecondsReadsAnotherProcessToTheNanosecond) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    std::thread([] { BurnUntil(0.025); }).join();
    BurnUntil(0.047);
    const double own = OwnCpuSeconds();
    if (write(fds[1], &own, sizeof own) != sizeof own) _exit(1);
    pause();
    _exit(0);
  }
  close(fds[1]);
  double own = 0;
  ASSERT_EQ(read(fds[0], &own, sizeof own), static_cast<ssize_t>(sizeof own));
  close(fds[0]);
  const double seen = ProcessCpuSeconds(child);
  const double ticks = ProcessCpuSecondsFromStat(child);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_GE(own, 0.047);
  EXPECT_GE(seen, own);            // not behind the child's own clock
  EXPECT_LT(seen, own + 0.010);    // the child only wrote and paused since
  EXPECT_LE(ticks, seen + 0.010);  // the tick count agrees within a tick
  EXPECT_GT(ticks, seen - 0.020);
}

TEST(ProcStats, AProcessThatIsGoneReadsAsUnknown) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  EXPECT_LT(ProcessCpuSeconds(child), 0);
}

}  // namespace
}  // namespace tandem::cli
