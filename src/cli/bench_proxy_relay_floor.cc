// relay-tcp: the least a disaggregating proxy does per prompt, in raw
// loopback TCP. See bench_proxy_relay_floor.h.
#include "cli/bench_proxy_relay_floor.h"

#include <errno.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_proxy_floor.h"
#include "cli/proc_stats.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kRegisterBytes = 64;  // the decoder's registration
constexpr size_t kTokenBytes = 32;     // the decoder's first token
constexpr size_t kResponseBytes = 32;  // the client's response

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

// Reads exactly `n` bytes; false on EOF, error or the socket's timeout.
bool RecvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

}  // namespace

int ServeRelayFloor(int listen_fd, uint64_t calls, uint32_t prompt_bytes) {
  if (prompt_bytes == 0) return 2;
  const std::vector<int> fds = floor_detail::AcceptNoDelay(listen_fd, 3);
  if (fds.empty()) return 1;
  const int prefiller = fds[0], decoder = fds[1], client = fds[2];
  // One call at a time: the request is read straight into the buffer it is
  // forwarded from, never past its end.
  std::string prompt(prompt_bytes, '\0');
  const std::string registration(kRegisterBytes, 'r'), response(kResponseBytes, 'a');
  char scratch[256];
  size_t have = 0, token_bytes = 0;
  uint64_t answered = 0;
  pollfd p[2] = {{client, POLLIN, 0}, {decoder, POLLIN, 0}};
  while (answered < calls) {
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return 1;
    }
    if (p[0].revents != 0) {
      const ssize_t n = recv(client, prompt.data() + have, prompt.size() - have, 0);
      if (n <= 0) return 1;
      have += size_t(n);
      if (have == prompt.size()) {
        have = 0;
        if (!SendAll(prefiller, prompt.data(), prompt.size()) ||
            !SendAll(decoder, registration.data(), registration.size())) {
          return 1;
        }
      }
    }
    if (p[1].revents != 0) {
      const ssize_t n = recv(decoder, scratch, sizeof scratch, 0);
      if (n <= 0) return 1;
      for (token_bytes += size_t(n); token_bytes >= kTokenBytes && answered < calls;
           token_bytes -= kTokenBytes, ++answered) {
        if (!SendAll(client, response.data(), response.size())) return 1;
      }
    }
  }
  for (int fd : fds) shutdown(fd, SHUT_WR);
  pause();  // CPU is read, then we are killed
  return 0;
}

Result<RelayPass> RunRelayFloor(const std::string& self, uint32_t calls, uint32_t prompt_bytes,
                                double rate_per_s) {
  if (calls == 0 || prompt_bytes == 0) {
    return InvalidArgumentError("relay floor: calls and prompt bytes must be at least 1");
  }
  TANDEM_ASSIGN_OR_RETURN(
      floor_detail::Child child,
      floor_detail::SpawnServer(self, {"--mode", "relay", "--messages", std::to_string(calls + 1),
                                       "--bytes", std::to_string(prompt_bytes)}));
  // Prefiller, decoder, client: in the order the server accepts them
  // (ConnectLoopback connects one at a time, each once its handshake is
  // done, so the accept queue holds them in this order).
  auto conns = floor_detail::ConnectLoopback(child.port, 3);
  if (!conns.ok()) {
    floor_detail::StopChild(child);
    return UnavailableError("relay floor: cannot connect to the floor server");
  }
  const std::vector<int> fds = std::move(*conns);
  const auto close_all = [&] {
    for (int f : fds) close(f);
    floor_detail::StopChild(child);
  };
  // A server that stops relaying fails the pass instead of hanging it.
  const timeval timeout{10, 0};
  for (int f : fds) setsockopt(f, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  const int prefiller = fds[0], decoder = fds[1], client = fds[2];
  const auto gap = std::chrono::duration<double>(rate_per_s > 0 ? 0.5 / rate_per_s : 0.0);
  // The prefiller's and the decoder's part: take the prompt and the
  // registration, then send the first token (paced: half a period later).
  std::thread workers([&] {
    std::vector<char> in(prompt_bytes);
    char registration[kRegisterBytes];
    const std::string token(kTokenBytes, 't');
    for (uint32_t i = 0; i <= calls; ++i) {
      if (!RecvAll(prefiller, in.data(), in.size()) ||
          !RecvAll(decoder, registration, sizeof registration)) {
        return;
      }
      if (i > 0 && gap.count() > 0) std::this_thread::sleep_for(gap);
      if (!SendAll(decoder, token.data(), token.size())) return;
    }
  });
  const std::string request(prompt_bytes, 'q');
  char response[kResponseBytes];
  const auto call = [&] {
    return SendAll(client, request.data(), request.size()) &&
           RecvAll(client, response, sizeof response);
  };
  RelayPass pass;
  if (call()) {  // unmeasured: the server's code and buffers touched once
    const double cpu0 = ProcessCpuSeconds(child.pid);
    const auto t0 = Clock::now();
    for (uint32_t i = 0; i < calls; ++i) {
      if (rate_per_s > 0) {
        std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(i / rate_per_s)));
      }
      if (!call()) break;
      ++pass.ok;
    }
    pass.server_s = ProcessCpuSeconds(child.pid) - cpu0;
    pass.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  // Unblocks the workers' thread if the server stopped early.
  shutdown(prefiller, SHUT_RDWR);
  shutdown(decoder, SHUT_RDWR);
  workers.join();
  close_all();
  return pass;
}

}  // namespace tandem::cli
