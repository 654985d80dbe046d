// Helpers shared by the kvtransfer tests: deterministic data, checksums, a
// child process speaking a line protocol over pipes, bounded waits.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace tandem::kvtransfer::testing {

// Fills [p, p + n) with bytes from a seeded generator.
inline void FillRandom(std::byte* p, uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (uint64_t v = rng(); i < n; ++i, v >>= 8) p[i] = static_cast<std::byte>(v & 0xff);
}

inline uint64_t Checksum(const std::byte* p, uint64_t n) { return XXH3_64bits(p, n); }

// Polls `pred` every millisecond until it holds or `timeout` passes.
inline bool WaitFor(const std::function<bool()>& pred,
                    std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return pred();
}

// A child process (posix_spawn = fork+exec) with its stdin and stdout on
// pipes. Destruction closes stdin, waits up to 5 s, then kills.
class ChildProcess {
 public:
  explicit ChildProcess(const std::vector<std::string>& argv) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
  }
  ~ChildProcess() {
    if (to_child_ >= 0) close(to_child_);
    if (pid_ > 0 && !Reap(std::chrono::seconds(5))) Kill();
    if (from_child_ >= 0) close(from_child_);
  }
  bool ok() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  bool Send(const std::string& line) {
    const std::string l = line + "\n";
    return write(to_child_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
  }
  // The next line (without '\n'), or nullopt on EOF or timeout.
  std::optional<std::string> ReadLine(
      std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{from_child_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[65536];
      const ssize_t n = read(from_child_, chunk, sizeof(chunk));
      if (n <= 0) return std::nullopt;
      buf_.append(chunk, static_cast<size_t>(n));
    }
  }
  // Reads lines until one starts with `prefix`; returns the rest of it.
  std::optional<std::string> Expect(const std::string& prefix,
                                    std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int i = 0; i < 100000; ++i) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      auto line = ReadLine(left);
      if (!line) return std::nullopt;
      if (line->rfind(prefix, 0) == 0) return line->substr(prefix.size());
    }
    return std::nullopt;
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // SIGSTOP; returns once the child is stopped (waitpid WUNTRACED).
  bool Stop() {
    if (pid_ <= 0 || ::kill(pid_, SIGSTOP) != 0) return false;
    int st = 0;
    return waitpid(pid_, &st, WUNTRACED) == pid_ && WIFSTOPPED(st);
  }
  // Waits for exit; true if it exited within `timeout`.
  bool Reap(std::chrono::milliseconds timeout, int* exit_code = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        if (exit_code) *exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        pid_ = -1;
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buf_;
};

}  // namespace tandem::kvtransfer::testing
