// Helpers of the gpu tests that run every CUDA call in forked children (a
// process that initialised CUDA cannot use it in a child after fork).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "parallel/nccl_communicator.h"

namespace tandem::gputest {

// A group name unique to this process and call: "<prefix>-<what>-<pid>-<n>".
inline std::string UniqueGroup(const std::string& prefix, const std::string& what) {
  static int counter = 0;
  return prefix + "-" + what + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

// Runs `body(i)` in `n` forked children; their exit codes (128 + signal
// when killed; SIGALRM after `alarm_s` seconds ends a hang).
inline std::vector<int> RunInChildren(int n, const std::function<int(int)>& body,
                                      unsigned alarm_s) {
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(alarm_s);
      _exit(body(i));
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

// The device count as a child sees it (exit code), and why it is 0.
inline int DeviceCountInChild(std::string* why) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return 0;
  const auto codes = RunInChildren(
      1,
      [&](int) {
        close(pipefd[0]);
        std::string reason;
        const int n = parallel::NcclDeviceCount(&reason);
        if (write(pipefd[1], reason.data(), reason.size()) < 0) return 0;
        return n;
      },
      60);
  close(pipefd[1]);
  char buf[512];
  const ssize_t got = read(pipefd[0], buf, sizeof(buf));
  close(pipefd[0]);
  if (why != nullptr && got > 0) why->assign(buf, static_cast<size_t>(got));
  return codes[0];
}

}  // namespace tandem::gputest
