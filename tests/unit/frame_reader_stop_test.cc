// A framed client stopped (SIGSTOP) while it waits, past its own deadline,
// with its peer's frame arriving meanwhile: after SIGCONT the frame is read
// before the owner's deadline work runs. The wait's poll/epoll_wait fails
// with EINTR after a stop and a continue (signal(7)) and says nothing of
// what is ready; before session 16 the reader then served its deadlines
// first, so a Reserve reply sitting in the socket ended as
// DEADLINE_EXCEEDED (cont-wake, docs/failure-handling.md "Quarantine").
//
// Both waits are covered: the frame loop's epoll_wait (the Watch, Prefill
// and Reserve connections), which failed this way, and a reader's own
// thread's poll, which the kernel restarts after a stop (it passed before
// too; a signal handler would interrupt it, and the same re-poll guards it).
//
// The client runs in a forked child (a stop applies to a whole process),
// which exits 0 when the frame comes first and 3 when its deadline work
// runs without the frame.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "common/frame_conn.h"
#include "common/frame_loop.h"
#include "common/frame_reader.h"
#include "frame_addr_support.h"

namespace tandem {
namespace {

using frame_testing::LocalPort;
using SteadyClock = std::chrono::steady_clock;

constexpr int kFrameFirst = 0, kDeadlineFirst = 3, kEnded = 4, kNoFrame = 5;

// /proc/PID/task/*/syscall of the thread called `name`: its system call
// number while it is blocked in one ("running" or absent otherwise).
long BlockedSyscall(pid_t pid, const std::string& name) {
  std::error_code ec;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream comm(t.path() / "comm");
    std::string c;
    if (!(comm >> c) || c != name) continue;
    std::ifstream sc(t.path() / "syscall");
    long nr = -1;
    return sc >> nr ? nr : -1;
  }
  return -1;
}

char ProcessState(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string pid_s, comm;
  char state = '?';
  stat >> pid_s >> comm >> state;
  return state;
}

// The child: one plaintext client whose owner's deadline is `deadline`.
[[noreturn]] void Client(const std::string& port, bool on_loop, SteadyClock::time_point deadline) {
  std::unique_ptr<FrameLoop> loop;
  if (on_loop) loop = std::make_unique<FrameLoop>("stop-loop");
  auto conn = FrameConn::Client("127.0.0.1:" + port, nullptr, FrameOptions{});
  FrameReader reader(conn, loop.get());
  FrameReader::Hooks hooks;
  hooks.on_frame = [](std::string_view) -> Status { _exit(kFrameFirst); };
  hooks.before_wait = [deadline] {
    if (SteadyClock::now() >= deadline) _exit(kDeadlineFirst);
    return deadline;
  };
  hooks.on_end = [](const Status&) { _exit(kEnded); };
  reader.Start("stop-reader", std::move(hooks), nullptr);
  for (;;) pause();
  _exit(kNoFrame);
}

class FrameReaderStopTest : public ::testing::TestWithParam<bool> {};

TEST_P(FrameReaderStopTest, AFrameThatCameWhileStoppedIsReadBeforeTheDeadlineWork) {
  const bool on_loop = GetParam();
  LocalPort listener(true);
  const auto deadline = SteadyClock::now() + std::chrono::seconds(2);
  const pid_t parent = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // A test process that dies (crash, or killed by ctest) takes the
    // client with it, even while the client is stopped.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    Client(listener.port(), on_loop, deadline);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{child};

  // The child's connection, accepted.
  pollfd p{listener.fd(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10000), 1) << "the client never connected";
  const int peer = accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(peer, 0);
  // Stop it while its waiting thread sleeps in poll (7) or epoll_wait (232).
  const std::string waiter = on_loop ? "stop-loop" : "stop-reader";
  const long wait_nr = on_loop ? 232 : 7;
  while (BlockedSyscall(child, waiter) != wait_nr) {
    ASSERT_LT(SteadyClock::now(), deadline) << "the client never waited";
    std::this_thread::yield();
  }
  ASSERT_EQ(kill(child, SIGSTOP), 0);
  while (ProcessState(child) != 'T') {
    ASSERT_LT(SteadyClock::now(), deadline) << "the client did not stop";
    std::this_thread::yield();
  }
  // Past its deadline, the frame arrives; then it runs again.
  std::this_thread::sleep_until(deadline + std::chrono::milliseconds(50));
  const std::string frame("\x02\x00\x00\x00hi", 6);  // u32 LE length, payload
  ASSERT_EQ(send(peer, frame.data(), frame.size(), MSG_NOSIGNAL), ssize_t(frame.size()));
  ASSERT_EQ(kill(child, SIGCONT), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  reap.pid = -1;
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), kFrameFirst)
      << (WEXITSTATUS(status) == kDeadlineFirst ? "the deadline work ran before the frame was read"
                                                 : "the connection ended");
  ::close(peer);
}

INSTANTIATE_TEST_SUITE_P(OwnThreadAndLoop, FrameReaderStopTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Loop" : "OwnThread"; });

}  // namespace
}  // namespace tandem
