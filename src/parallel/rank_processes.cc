#include "parallel/rank_processes.h"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

namespace tandem::parallel {
namespace {

int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

bool RankProcesses::Exit::clean() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

std::string RankProcesses::Exit::Describe() const {
  if (WIFSIGNALED(status)) {
    return fmt::format("rank {} (pid {}) was killed by signal {}", rank, pid, WTERMSIG(status));
  }
  return fmt::format("rank {} (pid {}) exited with status {}", rank, pid, WEXITSTATUS(status));
}

Result<std::unique_ptr<RankProcesses>> RankProcesses::Start(
    uint32_t world, const std::function<std::vector<std::string>(uint32_t)>& argv_of) {
  std::unique_ptr<RankProcesses> p(new RankProcesses());
  p->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (p->stop_fd_ < 0) return InternalError(fmt::format("eventfd: {}", std::strerror(errno)));
  for (uint32_t rank = 1; rank < world; ++rank) {
    std::vector<std::string> args = argv_of(rank);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return InternalError(fmt::format("fork of rank {}: {}", rank, std::strerror(errno)));
    if (pid == 0) {
      // Only async-signal-safe calls between fork and exec.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // rank 0 died before prctl
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      dup2(2, 1);  // a rank's output is diagnostics only: rank 0's stdout stays its own
      execv(argv[0], argv.data());
      static const char kMsg[] = "tandem rank: exec failed\n";
      (void)!write(2, kMsg, sizeof(kMsg) - 1);
      _exit(127);
    }
    Child c;
    c.rank = rank;
    c.pid = pid;
    c.pidfd = PidfdOpen(pid);
    p->children_.push_back(c);
    if (c.pidfd < 0) {
      return InternalError(fmt::format("pidfd_open of rank {}: {}", rank, std::strerror(errno)));
    }
  }
  return p;
}

RankProcesses::~RankProcesses() {
  StopWatching();
  KillAll();
  for (size_t i = 0; i < children_.size(); ++i) {
    if (!children_[i].reaped) {
      int status = 0;
      if (waitpid(children_[i].pid, &status, 0) == children_[i].pid) {
        children_[i].reaped = true;
        children_[i].status = status;
      }
    }
    if (children_[i].pidfd >= 0) close(children_[i].pidfd);
  }
  if (stop_fd_ >= 0) close(stop_fd_);
}

bool RankProcesses::Reap(size_t i) {
  Child& c = children_[i];
  if (c.reaped) return true;
  int status = 0;
  if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
    c.reaped = true;
    c.status = status;
  }
  return c.reaped;
}

void RankProcesses::Watch(std::function<void(const Exit&)> on_exit) {
  watcher_ = std::thread([this, on_exit = std::move(on_exit)] {
    while (true) {
      std::vector<pollfd> fds;
      std::vector<size_t> which;
      fds.push_back({stop_fd_, POLLIN, 0});
      for (size_t i = 0; i < children_.size(); ++i) {
        if (children_[i].reaped) continue;
        fds.push_back({children_[i].pidfd, POLLIN, 0});
        which.push_back(i);
      }
      if (which.empty()) return;
      if (poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents != 0) return;  // StopWatching
      // Reap every rank that exited (a pidfd is readable once its process
      // has). When several did at once, name the one killed by a signal: the
      // others most likely exited because their communicators saw it die.
      std::optional<Exit> first;
      for (size_t k = 0; k < which.size(); ++k) {
        if (fds[k + 1].revents == 0) continue;
        const size_t i = which[k];
        int status = 0;
        if (waitpid(children_[i].pid, &status, 0) != children_[i].pid) continue;
        children_[i].reaped = true;
        children_[i].status = status;
        const Exit e{children_[i].rank, children_[i].pid, status};
        if (!first || (WIFSIGNALED(status) && !WIFSIGNALED(first->status))) first = e;
      }
      if (first) {
        on_exit(*first);
        return;
      }
    }
  });
}

void RankProcesses::StopWatching() {
  if (!watcher_.joinable()) return;
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof(one));
  watcher_.join();
}

void RankProcesses::KillAll() {
  for (const Child& c : children_) {
    if (!c.reaped) kill(c.pid, SIGKILL);
  }
}

Status RankProcesses::WaitAll(int64_t timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (size_t i = 0; i < children_.size(); ++i) {
    while (!Reap(i)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) {
        return DeadlineExceededError(fmt::format(
            "rank {} (pid {}) did not exit within {} ms of the shutdown plan", children_[i].rank,
            children_[i].pid, timeout_ms));
      }
      pollfd p{children_[i].pidfd, POLLIN, 0};
      (void)poll(&p, 1, static_cast<int>(left));
    }
    const Exit e{children_[i].rank, children_[i].pid, children_[i].status};
    if (!e.clean()) return UnavailableError(e.Describe());
  }
  return Status::Ok();
}

std::vector<pid_t> RankProcesses::pids() const {
  std::vector<pid_t> out;
  for (const Child& c : children_) out.push_back(c.pid);
  return out;
}

}  // namespace tandem::parallel
