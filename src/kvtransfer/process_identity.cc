#include "kvtransfer/process_identity.h"

#include <errno.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cstring>
#include <chrono>
#include <string>
#include <thread>

namespace tandem::kvtransfer {
namespace {

// Reads at most `cap` bytes of a small /proc file; empty on any error.
std::string ReadSmallFile(const char* path, size_t cap, int* error = nullptr) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (error) *error = errno;
    return {};
  }
  std::string out(cap, '\0');
  ssize_t n = 0;
  do {
    n = read(fd, out.data(), cap);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && error) *error = errno;
  close(fd);
  out.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return out;
}

// /proc/PID/stat is one line; field 22 ends well within this.
constexpr size_t kStatReadBytes = 1024;

ProcessIdentity ReadLocalIdentity() {
  ProcessIdentity id;
  char state = 0;
  uint64_t start = 0;
  uint32_t proc_pid = 0;
  if (!ParseProcStat(ReadSmallFile("/proc/self/stat", kStatReadBytes), &state, &start, &proc_pid) ||
      proc_pid != static_cast<uint32_t>(getpid())) {
    return {};  // no /proc, or one mounted for another pid namespace
  }
  struct stat ns {};
  if (stat("/proc/self/ns/pid", &ns) != 0 || ns.st_ino == 0) return {};
  std::string boot = ReadSmallFile("/proc/sys/kernel/random/boot_id", kMaxBootIdBytes + 1);
  while (!boot.empty() && (boot.back() == '\n' || boot.back() == ' ')) boot.pop_back();
  if (boot.empty() || boot.size() > kMaxBootIdBytes) return {};
  id.pid = proc_pid;
  id.start_time_ticks = start;
  id.pid_namespace = ns.st_ino;
  id.boot_id = std::move(boot);
  return id;
}

}  // namespace

bool ParseProcStat(std::string_view stat, char* state, uint64_t* start_time_ticks, uint32_t* pid) {
  // "PID (COMM) S f4 f5 ... f22 ...": COMM may contain anything but is
  // closed by the line's last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string_view::npos || close + 2 >= stat.size()) return false;
  if (pid != nullptr) {
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(stat.data(), stat.data() + stat.size(), v);
    if (ec != std::errc() || end == stat.data() || *end != ' ') return false;
    *pid = v;
  }
  std::string_view rest = stat.substr(close + 2);  // from field 3
  for (int field = 3; field <= 22; ++field) {
    const size_t end = rest.find(' ');
    const std::string_view value = rest.substr(0, end);
    if (value.empty()) return false;
    if (field == 3) *state = value[0];
    if (field == 22) {
      uint64_t v = 0;
      const auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (ec != std::errc() || p != value.data() + value.size()) return false;
      *start_time_ticks = v;
      return true;
    }
    if (end == std::string_view::npos) return false;
    rest.remove_prefix(end + 1);
  }
  return false;
}

const ProcessIdentity& LocalProcessIdentity() {
  // Fixed for the life of the process (fork+exec gets its own; a forked
  // child without exec refuses to use its transports, docs/kvtransfer.md).
  static const ProcessIdentity id = ReadLocalIdentity();
  return id;
}

namespace {

// One read of /proc/PID/stat: kExited when it is gone, kUnknown when it
// cannot be read or parsed, else kAlive with its state and start time.
Liveness ReadStat(uint32_t pid, char* state, uint64_t* start) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  int error = 0;
  const std::string stat = ReadSmallFile(path.c_str(), kStatReadBytes, &error);
  if (stat.empty()) {
    // ESRCH: the process went away between open and read. ENOENT is also
    // what a /proc mounted with hidepid shows for another user's process:
    // kill(pid, 0) tells (EPERM: it exists).
    if (error != ENOENT && error != ESRCH) return Liveness::kUnknown;
    return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH ? Liveness::kExited
                                                                   : Liveness::kUnknown;
  }
  return ParseProcStat(stat, state, start) ? Liveness::kAlive : Liveness::kUnknown;
}

}  // namespace

Liveness CheckLiveness(const ProcessIdentity& peer) {
  char state = 0;
  uint64_t start = 0;
  if (const Liveness l = ReadStat(peer.pid, &state, &start); l != Liveness::kAlive) return l;
  if (start != peer.start_time_ticks) return Liveness::kPidReused;
  // A zombie is dead, only not reaped yet by its parent; 'X' is its last breath.
  if (state == 'Z' || state == 'X') return Liveness::kExited;
  return Liveness::kAlive;
}

Status StopLocalProcess(const ProcessIdentity& peer) {
  const ProcessIdentity& self = LocalProcessIdentity();
  if (!peer.SameHostAndNamespace(self) || peer.pid == self.pid) {
    return FailedPreconditionError("not another process on this host and in this pid namespace");
  }
  if (CheckLiveness(peer) != Liveness::kAlive) {
    return FailedPreconditionError(fmt::format("process {} is not alive", peer.pid));
  }
  if (kill(static_cast<pid_t>(peer.pid), SIGSTOP) != 0) {
    return InternalError(fmt::format("kill({}, SIGSTOP): {}", peer.pid, std::strerror(errno)));
  }
  // SIGSTOP takes effect asynchronously.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < deadline) {
    char state = 0;
    uint64_t start = 0;
    if (ReadStat(peer.pid, &state, &start) != Liveness::kAlive) break;
    if (state == 'T') return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return DeadlineExceededError(fmt::format("process {} did not stop within 1 s", peer.pid));
}

}  // namespace tandem::kvtransfer
