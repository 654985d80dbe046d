// floor-step and floor-step+ack: the floor of a proxy that is woken once per
// decode step and sends once per client connection. See
// bench_proxy_floor_step.h.
#include "cli/bench_proxy_floor_step.h"

#include <fmt/format.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cli/proc_stats.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kConnections = 4;    // as the gRPC client's channels
constexpr size_t kFeedBytes = 64;       // the feeder's message per step (a decode record's header)
constexpr uint32_t kAckBytes = 13;      // an HTTP/2 WINDOW_UPDATE frame: 9 + 4
constexpr char kFeederAccepted = 'F';   // the server's reply once the feeder is accepted

}  // namespace

int ServeStepFloor(int listen_fd, uint32_t connections, uint32_t streams, uint64_t messages,
                   uint32_t bytes, bool ack) {
  if (connections == 0 || streams == 0 || bytes == 0) return 2;
  // The feeder first: the bench connects the clients only after this byte.
  const std::vector<int> feed = floor_detail::AcceptNoDelay(listen_fd, 1);
  if (feed.empty() || send(feed[0], &kFeederAccepted, 1, MSG_NOSIGNAL) != 1) return 1;
  const std::vector<int> fds = floor_detail::AcceptNoDelay(listen_fd, connections);
  if (fds.empty()) return 1;
  // One token message per stream of a connection, back to back.
  const std::string out(size_t(bytes) * ((streams + connections - 1) / connections), 'x');
  std::vector<char> in(4096), acks(4096);
  size_t pending = 0;  // feed bytes not yet a whole step
  uint64_t left = messages;
  while (left > 0) {
    const ssize_t n = recv(feed[0], in.data(), in.size(), 0);
    if (n <= 0) return 1;  // the feeder stopped early
    pending += size_t(n);
    for (; pending >= kFeedBytes && left > 0; pending -= kFeedBytes) {
      const uint32_t k = uint32_t(std::min<uint64_t>(streams, left));
      left -= k;
      for (uint32_t c = 0; c < connections && c < k; ++c) {
        if (ack) recv(fds[c], acks.data(), acks.size(), MSG_DONTWAIT);
        const size_t len = size_t(bytes) * ((k - c + connections - 1) / connections);
        if (send(fds[c], out.data(), len, MSG_NOSIGNAL) != ssize_t(len)) return 1;
      }
    }
  }
  for (int fd : fds) shutdown(fd, SHUT_WR);  // not close: unread acks would reset the connection
  pause();  // CPU is read, then we are killed
  return 0;
}

namespace {

// One reader thread per connection (RunStepFloor's reader_per_connection):
// every connection's bytes, whether each closed in time, and the longest
// reader's duration.
floor_detail::ReadResult ReadEachOnItsOwn(const std::vector<int>& fds, double duration_s,
                                          uint32_t ack_bytes) {
  std::vector<floor_detail::ReadResult> got(fds.size());
  std::vector<std::thread> readers;
  for (size_t i = 0; i < fds.size(); ++i) {
    readers.emplace_back(
        [&, i] { got[i] = floor_detail::ReadUntilClosed({fds[i]}, duration_s, ack_bytes); });
  }
  for (auto& t : readers) t.join();
  floor_detail::ReadResult all;
  all.all_closed = true;
  for (const auto& g : got) {
    all.bytes += g.bytes;
    all.all_closed = all.all_closed && g.all_closed;
    all.duration_s = std::max(all.duration_s, g.duration_s);
  }
  return all;
}

}  // namespace

Result<FloorRow> RunStepFloor(const std::string& self, const FloorSpec& spec, bool ack,
                              bool reader_per_connection) {
  const uint32_t bytes = floor_detail::TokenWireBytes();
  const uint64_t messages = uint64_t(spec.requests) * spec.output;
  const uint64_t steps = (messages + spec.concurrency - 1) / spec.concurrency;
  TANDEM_ASSIGN_OR_RETURN(
      floor_detail::Child child,
      floor_detail::SpawnServer(
          self, {"--mode", ack ? "step-ack" : "step", "--connections",
                 std::to_string(kConnections), "--streams", std::to_string(spec.concurrency),
                 "--messages", std::to_string(messages), "--bytes", std::to_string(bytes)}));
  FloorRow row;
  row.name = std::string(reader_per_connection ? "floor-4r" : "floor-step") + (ack ? "+ack" : "");
  row.grpc = false;
  std::vector<int> fds;
  auto feed = floor_detail::ConnectLoopback(child.port, 1);
  char accepted = 0;
  if (feed.ok() && recv((*feed)[0], &accepted, 1, MSG_WAITALL) == 1 &&
      accepted == kFeederAccepted) {
    auto clients = floor_detail::ConnectLoopback(child.port, kConnections);
    if (clients.ok()) fds = std::move(*clients);
  }
  if (fds.empty()) {
    if (feed.ok()) close((*feed)[0]);
    floor_detail::StopChild(child);
    return UnavailableError(fmt::format("{}: cannot connect to the floor server", row.name));
  }
  const int feed_fd = (*feed)[0];
  const double cpu0 = ProcessCpuSeconds(child.pid);
  const double load0 = LoadAverage1();
  std::atomic<bool> stop{false};
  // The decoder's part: one message per step at the cadence, from its own
  // thread so that the reader's wake-ups are the clients' alone.
  std::thread feeder([&] {
    const std::string msg(kFeedBytes, 'd');
    const auto step = std::chrono::microseconds(int64_t(spec.step_ms * 1000));
    auto next = Clock::now();
    for (uint64_t s = 0; s < steps && !stop.load(std::memory_order_relaxed); ++s) {
      next += step;
      std::this_thread::sleep_until(next);
      if (send(feed_fd, msg.data(), msg.size(), MSG_NOSIGNAL) != ssize_t(msg.size())) return;
    }
  });
  const uint32_t ack_bytes = ack ? kAckBytes : 0;
  const auto got = reader_per_connection
                       ? ReadEachOnItsOwn(fds, spec.duration_s, ack_bytes)
                       : floor_detail::ReadUntilClosed(fds, spec.duration_s, ack_bytes);
  row.server_cpu_s = ProcessCpuSeconds(child.pid) - cpu0;
  row.load1 = (load0 + LoadAverage1()) / 2;
  stop = true;
  feeder.join();
  for (int f : fds) close(f);
  close(feed_fd);
  floor_detail::StopChild(child);
  row.summary.duration_s = got.duration_s;
  row.tokens = got.bytes / bytes;
  row.summary.output_tokens = row.tokens;
  row.requests_ok = got.all_closed ? spec.requests : 0;
  row.requests_failed = got.all_closed ? 0 : spec.requests;
  return row;
}

}  // namespace tandem::cli
