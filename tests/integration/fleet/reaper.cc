#include "reaper.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <mutex>

namespace tandem::testing {
namespace {

std::mutex mu;
int write_fd = -1;  // guarded by mu
pid_t reaper = -1;  // guarded by mu

// The reaper's whole life. Forked from a multithreaded process, so only
// async-signal-safe calls: no allocation, no locks, no stdio.
[[noreturn]] void ReaperMain(int read_fd) {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) sigaction(s, &ignore, nullptr);
  // Its own process group: a ^C to the test's group must not stop it first.
  setpgid(0, 0);
  // Hold no other descriptor of the test process: a pipe's write end kept
  // open here would hide an end-of-file from its reader (ctest's output
  // pipe, a child's ready pipe).
  const int null = open("/dev/null", O_RDWR);
  if (null >= 0) {
    dup2(null, 0);
    dup2(null, 1);
    dup2(null, 2);
  }
  for (int fd = 3; fd < 65536; ++fd) {
    if (fd != read_fd) close(fd);
  }
  constexpr size_t kMax = 8192;
  static pid_t pids[kMax];
  size_t n = 0;
  for (;;) {
    int32_t rec = 0;
    const ssize_t got = read(read_fd, &rec, sizeof(rec));
    if (got == static_cast<ssize_t>(sizeof(rec))) {
      if (rec > 0 && n < kMax) {
        pids[n++] = rec;
      } else if (rec < 0) {
        for (size_t i = 0; i < n; ++i) {
          if (pids[i] == -rec) pids[i] = 0;
        }
      }
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    break;  // end of file: the test process is gone
  }
  for (size_t i = 0; i < n; ++i) {
    if (pids[i] <= 0) continue;
    kill(-pids[i], SIGKILL);  // its group, when it leads one (supervised workers do)
    kill(pids[i], SIGKILL);
  }
  _exit(0);
}

// With mu held.
bool StartLocked() {
  if (write_fd >= 0) return true;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return false;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return false;
  }
  if (pid == 0) {
    close(fds[1]);
    ReaperMain(fds[0]);
  }
  close(fds[0]);
  write_fd = fds[1];
  reaper = pid;
  return true;
}

void Send(int32_t rec) {
  std::lock_guard lock(mu);
  if (!StartLocked()) {
    std::fprintf(stderr, "reaper: cannot start; processes of this test may outlive it\n");
    return;
  }
  // 4 bytes: atomic on a pipe, never split between writers.
  while (write(write_fd, &rec, sizeof(rec)) < 0 && errno == EINTR) {
  }
}

}  // namespace

void ReapOnExit(pid_t pid) {
  if (pid > 0) Send(static_cast<int32_t>(pid));
}

void Forget(pid_t pid) {
  if (pid > 0) Send(-static_cast<int32_t>(pid));
}

pid_t ReaperPid() {
  std::lock_guard lock(mu);
  return reaper;
}

}  // namespace tandem::testing
