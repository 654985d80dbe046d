// The harness kills its fleet when the test process dies (reaper.h): a
// helper process (fleet_holder) starts a real fleet with `tandem launch`,
// stops one worker, and is SIGKILLed; every process of that fleet must
// then exit, waited on through pidfds (no sleeps, bounded).
#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Through syscall(): glibc 2.36's <sys/pidfd.h> lacks C linkage in C++.
int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }
void PidfdKill(int fd) { syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0); }

TEST(Reaper, FleetDiesWithTheTestProcess) {
  if (!std::filesystem::exists(BundledModel() + "/model.safetensors")) {
    GTEST_SKIP() << "bundled model missing";
  }
  int out[2];
  ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);
  const pid_t holder = fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    dup2(out[1], 1);
    const int null = open("/dev/null", O_WRONLY);  // not ctest's output pipe
    dup2(null, 2);
    execl(FLEET_HOLDER_BIN, FLEET_HOLDER_BIN, nullptr);
    _exit(127);
  }
  close(out[1]);
  // Whatever fails below, the holder does not outlive this test.
  struct KillHolder {
    pid_t pid;
    ~KillHolder() {
      if (pid > 0) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
    }
  } guard{holder};
  // Its one line of pids (bounded by the harness's own launch timeout).
  std::string line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  close(out[0]);
  std::vector<pid_t> pids;
  std::istringstream in(line);
  for (pid_t p; in >> p;) pids.push_back(p);
  ASSERT_GE(pids.size(), 5u) << "fleet_holder printed '" << line << "'";  // launcher, proxy, 2 workers, reaper
  // pidfds before the kill: immune to pid reuse, readable once the process exits.
  std::vector<int> fds;
  for (pid_t p : pids) {
    const int fd = p > 0 ? PidfdOpen(p) : -1;
    EXPECT_GE(fd, 0) << "process " << p << " is not there (no reaper?)";
    fds.push_back(fd);
  }

  ASSERT_EQ(kill(holder, SIGKILL), 0);
  int st = 0;
  EXPECT_EQ(waitpid(holder, &st, 0), holder);
  guard.pid = -1;
  EXPECT_TRUE(WIFSIGNALED(st));

  // Every fleet process (the stopped decoder too) and the reaper exit.
  const auto give_up = Clock::now() + std::chrono::seconds(20);
  std::vector<bool> gone(fds.size(), false);
  size_t left = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    gone[i] = fds[i] < 0;
    if (!gone[i]) ++left;
  }
  while (left > 0 && Clock::now() < give_up) {
    std::vector<pollfd> p;
    for (int fd : fds) p.push_back({fd, POLLIN, 0});  // poll ignores negative fds
    if (poll(p.data(), p.size(), 1000) < 0 && errno != EINTR) break;
    for (size_t i = 0; i < p.size(); ++i) {
      if (!gone[i] && (p[i].revents & POLLIN)) {
        gone[i] = true;
        --left;
      }
    }
  }
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) continue;
    EXPECT_TRUE(gone[i]) << "process " << pids[i] << " outlived the test process that started it";
    if (!gone[i]) PidfdKill(fds[i]);  // leave nothing behind
    close(fds[i]);
  }
}

}  // namespace
}  // namespace tandem::testing
