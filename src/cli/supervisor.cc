#include "cli/supervisor.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

extern char** environ;

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

int RemainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

}  // namespace

Supervisor::Supervisor() {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGCHLD);
  // Blocked here and delivered through the signalfd; children unblock them.
  sigprocmask(SIG_BLOCK, &mask, nullptr);
  signal_fd_ = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
}

Supervisor::~Supervisor() {
  StopAll(std::chrono::milliseconds(2000));
  if (signal_fd_ >= 0) close(signal_fd_);
}

std::string ChildLabel(const Child& c) {
  return c.spec.ranks > 1 ? fmt::format("{} rank {}", c.spec.name, c.spec.rank) : c.spec.name;
}

std::string DescribeExit(const Child& c) {
  if (WIFSIGNALED(c.exit_status)) {
    return fmt::format("{} (pid {}) was killed by signal {}", ChildLabel(c), c.pid,
                       WTERMSIG(c.exit_status));
  }
  return fmt::format("{} (pid {}) exited with status {}", ChildLabel(c), c.pid,
                     WEXITSTATUS(c.exit_status));
}

Result<Child*> Supervisor::Start(ChildSpec spec, std::chrono::milliseconds timeout) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return InternalError(fmt::format("pipe: {}", std::strerror(errno)));
  }
  std::vector<std::string> args = spec.argv;
  args.push_back("--ready-fd");
  args.push_back(std::to_string(fds[1]));
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The environment, built before fork (nothing to allocate in the child).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const bool replaced = std::any_of(spec.env.begin(), spec.env.end(), [&](const std::string& s) {
      return kv.substr(0, kv.find('=') + 1) == std::string_view(s).substr(0, s.find('=') + 1);
    });
    if (!replaced) env_strings.emplace_back(kv);
  }
  env_strings.insert(env_strings.end(), spec.env.begin(), spec.env.end());
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return InternalError(fmt::format("fork: {}", std::strerror(errno)));
  }
  if (pid == 0) {
    // Child: own process group, die with the launcher, default signals.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the launcher died before prctl
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    fcntl(fds[1], F_SETFD, 0);  // the ready fd survives exec
    execve(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  children_.push_back(Child{std::move(spec), pid, "", "", "", true, 0, "", false, false});
  Child* child = &children_.back();

  // Read the ready line, watching for the child's death meanwhile.
  const auto deadline = Clock::now() + timeout;
  std::string line;
  Status failure;
  while (true) {
    pollfd p{fds[0], POLLIN, 0};
    const int n = poll(&p, 1, std::min(RemainingMs(deadline), 200));
    if (n > 0) {
      char buf[512];
      const ssize_t got = read(fds[0], buf, sizeof(buf));
      if (got > 0) {
        line.append(buf, static_cast<size_t>(got));
        if (line.find('\n') != std::string::npos) break;
        continue;
      }
      // EOF without a line: the child died (or closed the pipe). Give a
      // dying child a moment so the message can say how it ended.
      int status = 0;
      for (int i = 0; i < 50; ++i) {
        if (waitpid(pid, &status, WNOHANG) == pid) {
          child->alive = false;
          child->exit_status = status;
          break;
        }
        usleep(20 * 1000);
      }
      failure = UnavailableError(child->alive ? fmt::format("{} closed its ready pipe before it "
                                                            "was ready", ChildLabel(*child))
                                              : DescribeExit(*child) + " before it was ready");
      break;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      child->alive = false;
      child->exit_status = status;
      failure = UnavailableError(DescribeExit(*child) + " before it was ready");
      break;
    }
    if (RemainingMs(deadline) == 0) {
      failure = DeadlineExceededError(fmt::format("{} (pid {}) was not ready within {} s",
                                                  ChildLabel(*child), pid, timeout.count() / 1000.0));
      break;
    }
  }
  close(fds[0]);
  if (failure.ok()) {
    try {
      const auto j = nlohmann::json::parse(line.substr(0, line.find('\n')));
      child->grpc = j.value("grpc", "");
      child->metrics = j.value("metrics", "");
      child->http = j.value("http", "");
      child->internal = j.value("internal", "");
    } catch (const std::exception& e) {
      failure = InternalError(fmt::format("{} sent a bad ready line '{}': {}", child->spec.name,
                                          line, e.what()));
    }
  }
  if (!failure.ok()) {
    if (child->alive) {
      kill(pid, SIGKILL);
      waitpid(pid, &child->exit_status, 0);
      child->alive = false;
    }
    return failure;
  }
  return child;
}

void Supervisor::ReapExited() {
  while (true) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (auto& c : children_) {
      if (c.pid == pid && c.alive) {
        c.alive = false;
        c.exit_status = status;
        if (c.group_stopped) {
          spdlog::info("{} (stopped with its worker group)", DescribeExit(c));
        } else if (c.draining) {
          spdlog::info("{} after draining", DescribeExit(c));
        } else if (stopping_) {
          spdlog::info("{} (the fleet is stopping)", DescribeExit(c));
        } else if (c.spec.ranks > 1) {
          spdlog::error("{}: worker {} cannot compute without it and is stopped (all its ranks); "
                        "it leaves routing and the rest of the fleet keeps serving",
                        DescribeExit(c), c.spec.name);
        } else {
          spdlog::error("{}; the rest of the fleet keeps serving", DescribeExit(c));
        }
        if (c.spec.ranks > 1) StopRestOfGroup(c);
      }
    }
  }
}

void Supervisor::StopRestOfGroup(const Child& dead) {
  for (auto& c : children_) {
    if (&c == &dead || !c.alive || c.group_stopped || c.spec.name != dead.spec.name ||
        c.spec.ranks <= 1) {
      continue;
    }
    c.group_stopped = true;
    if (!c.draining && !stopping_) {
      spdlog::warn("stopping {} (pid {}): {} exited", ChildLabel(c), c.pid, ChildLabel(dead));
    }
    kill(c.pid, SIGKILL);  // reaped by the next ReapExited
  }
}

int Supervisor::KillGroup(const std::string& name) {
  int killed = 0;
  for (auto& c : children_) {
    if (!c.alive || c.spec.name != name) continue;
    c.group_stopped = true;
    kill(c.pid, SIGKILL);
    waitpid(c.pid, &c.exit_status, 0);
    c.alive = false;
    ++killed;
  }
  return killed;
}

int Supervisor::WaitForSignalOrDeath(const std::vector<std::string>& stop_if_dead,
                                     std::string* died) {
  while (true) {
    const int r = WaitForSignalOrDeath(stop_if_dead, std::chrono::hours(24), died);
    if (r >= 0) return r;
  }
}

bool Supervisor::Drain(const std::string& name) {
  ReapExited();
  bool sent = false;
  for (auto& c : children_) {
    if (c.alive && !c.draining && c.spec.name == name) {
      c.draining = true;
      // Rank 0 drains; the other ranks stop with it (StopRestOfGroup).
      if (c.spec.rank == 0) {
        kill(c.pid, SIGTERM);
        sent = true;
      }
    }
  }
  return sent;
}

int Supervisor::WaitForSignalOrDeath(const std::vector<std::string>& stop_if_dead,
                                     std::chrono::milliseconds max_wait, std::string* died) {
  const auto deadline = Clock::now() + max_wait;
  while (true) {
    const int left = RemainingMs(deadline);
    if (left == 0) {
      ReapExited();
      return -1;
    }
    pollfd p{signal_fd_, POLLIN, 0};
    if (poll(&p, 1, std::min(left, 1000)) > 0) {
      signalfd_siginfo info{};
      while (read(signal_fd_, &info, sizeof(info)) == sizeof(info)) {
        if (info.ssi_signo == SIGINT || info.ssi_signo == SIGTERM) {
          ReapExited();
          return static_cast<int>(info.ssi_signo);
        }
      }
    }
    ReapExited();
    for (auto& c : children_) {
      for (const auto& name : stop_if_dead) {
        if (!c.alive && !c.death_reported && c.spec.name == name) {
          c.death_reported = true;
          if (died != nullptr) *died = name;
          return 0;
        }
      }
    }
  }
}

int Supervisor::StopAll(std::chrono::milliseconds grace) { return StopRole("", grace); }

int Supervisor::StopRole(const std::string& role, std::chrono::milliseconds grace) {
  const auto chosen = [&role](const Child& c) {
    return c.alive && (role.empty() || c.spec.role == role);
  };
  stopping_ = true;
  ReapExited();
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) {
    if (chosen(*it)) kill(it->pid, SIGTERM);
  }
  const auto deadline = Clock::now() + grace;
  while (Clock::now() < deadline) {
    ReapExited();
    bool any = false;
    for (const auto& c : children_) any = any || chosen(c);
    if (!any) return 0;
    usleep(20 * 1000);
  }
  int killed = 0;
  for (auto& c : children_) {
    if (!chosen(c)) continue;
    kill(c.pid, SIGKILL);
    waitpid(c.pid, &c.exit_status, 0);
    c.alive = false;
    ++killed;
    spdlog::warn("{} did not stop within {} ms and was killed", c.spec.name, grace.count());
  }
  return killed;
}

}  // namespace tandem::cli
