#include "cli/autoscaler.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "common/net.h"

namespace tandem::cli {

std::optional<uint32_t> DesiredWorkers(const std::string& metrics_text, const std::string& role) {
  static constexpr std::string_view kName = "tandem_planner_desired_workers{";
  const std::string label = fmt::format("role=\"{}\"", role);
  std::istringstream in(metrics_text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(kName, 0) != 0) continue;
    const size_t close = line.find('}');
    if (close == std::string::npos || line.find(label) > close) continue;
    char* end = nullptr;
    const double v = std::strtod(line.c_str() + close + 1, &end);
    if (end == line.c_str() + close + 1 || v < 0 || v > 1e6) return std::nullopt;
    return static_cast<uint32_t>(v + 0.5);
  }
  return std::nullopt;
}

std::optional<uint32_t> DesiredAcrossReplicas(const std::vector<std::string>& metrics_texts,
                                              const std::string& role) {
  std::optional<uint32_t> most;
  for (const auto& text : metrics_texts) {
    const auto d = DesiredWorkers(text, role);
    if (d && *d > 0 && (!most || *d > *most)) most = d;
  }
  return most;
}

Result<std::string> FetchMetrics(const std::string& address) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp.port);
  if (inet_pton(AF_INET, hp.host.c_str(), &sa.sin_addr) != 1) {
    return InvalidArgumentError(fmt::format("the proxy's metrics address {} is not IPv4", address));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return UnavailableError("socket failed");
  timeval tv{2, 0};  // connect, send and every read
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return UnavailableError(fmt::format("cannot connect to {}", address));
  }
  const std::string req = fmt::format("GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", address);
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return UnavailableError(fmt::format("cannot send to {}", address));
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    resp.append(buf, static_cast<size_t>(n));
    if (resp.size() > (64u << 20)) break;
  }
  close(fd);
  const auto body = resp.find("\r\n\r\n");
  if (n < 0 || body == std::string::npos) {
    return UnavailableError(fmt::format("no complete answer from {}", address));
  }
  return resp.substr(body + 4);
}

Autoscaler::Autoscaler(const AutoscaleConfig& config, std::vector<std::string> proxy_metrics,
                       Supervisor* supervisor, StartWorker start,
                       std::map<std::string, uint32_t> next_index)
    : config_(config),
      proxy_metrics_(std::move(proxy_metrics)),
      sup_(supervisor),
      start_(std::move(start)),
      next_index_(std::move(next_index)) {}

uint32_t Autoscaler::Serving(const std::string& role) const {
  uint32_t n = 0;
  // A worker is its rank 0 (a group of ranks counts once; issue 18).
  for (const auto& c : sup_->children()) {
    n += c.alive && !c.draining && c.spec.role == role && c.spec.rank == 0;
  }
  return n;
}

bool Autoscaler::Poll() {
  std::vector<std::string> texts;
  std::string unreachable;
  for (const auto& address : proxy_metrics_) {
    auto text = FetchMetrics(address);
    if (text.ok()) {
      texts.push_back(std::move(*text));
    } else {
      unreachable += fmt::format("{}{}", unreachable.empty() ? "" : "; ", text.status().message());
    }
  }
  if (texts.empty()) {
    if (!warned_unreachable_) {
      spdlog::warn("autoscale: cannot read any proxy's planner ({}); the fleet stays as it is",
                   unreachable);
      warned_unreachable_ = true;
    }
    return false;
  }
  warned_unreachable_ = false;
  bool changed = false;
  for (auto [role, bounds] : {std::pair{"decode", &config_.decode},
                              std::pair{"prefill", &config_.prefill}}) {
    const auto desired = DesiredAcrossReplicas(texts, role);
    if (!desired) continue;  // the proxies' planners are off or not there yet
    changed = Follow(role, *bounds, *desired) || changed;
  }
  return changed;
}

bool Autoscaler::Follow(const std::string& role, const AutoscaleRoleConfig& bounds,
                        uint32_t desired) {
  desired = std::clamp(desired, bounds.min, bounds.max);
  const uint32_t serving = Serving(role);
  if (serving < desired) {
    const uint32_t index = next_index_[role]++;
    spdlog::info("autoscale: {} {} serving, planner wants {}: starting {}-{}", serving, role,
                 desired, role, index);
    if (Status s = start_(role, index); !s.ok()) {
      spdlog::error("autoscale: {}-{} did not start: {}", role, index, s.message());
      return false;
    }
    return true;
  }
  if (serving > desired) {
    const auto& kids = sup_->children();
    for (auto it = kids.rbegin(); it != kids.rend(); ++it) {
      if (!it->alive || it->draining || it->spec.role != role || it->spec.rank != 0) continue;
      spdlog::info("autoscale: {} {} serving, planner wants {}: draining {} (pid {})", serving,
                   role, desired, it->spec.name, it->pid);
      return sup_->Drain(it->spec.name);
    }
  }
  return false;
}

}  // namespace tandem::cli
