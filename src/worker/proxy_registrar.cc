#include "worker/proxy_registrar.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

#include "common/net.h"

namespace tandem::worker {

Result<std::vector<std::string>> ResolveProxyAddresses(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;  // A, else AAAA
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    return UnavailableError(fmt::format("resolving '{}': {}", host, gai_strerror(rc)));
  }
  std::set<std::string> v4, v6;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = "";
    if (a->ai_family == AF_INET) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf)) != nullptr) v4.insert(buf);
    } else if (a->ai_family == AF_INET6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      if (inet_ntop(AF_INET6, &sin6->sin6_addr, buf, sizeof(buf)) != nullptr) v6.insert(buf);
    }
  }
  freeaddrinfo(res);
  const std::set<std::string>& found = v4.empty() ? v6 : v4;
  return std::vector<std::string>(found.begin(), found.end());
}

Result<std::vector<std::string>> ParseJoinList(const std::string& list, const std::string& flag) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) {
      auto hp = ParseHostPort(item);
      if (!hp.ok() || hp->port == 0) {
        return InvalidArgumentError(fmt::format(
            "{}: '{}' is not host:port with a non-zero port (a list is A,B,...)", flag, item));
      }
      if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
    }
    start = end + 1;
  }
  return out;
}

Result<std::unique_ptr<ProxyRegistrar>> ProxyRegistrar::Create(RegistrarOptions options,
                                                                RegisterFn register_fn,
                                                                ResolveFn resolve_fn) {
  std::string host;
  uint16_t port = 0;
  if (!options.join_dns.empty()) {
    auto hp = ParseHostPort(options.join_dns);
    if (!hp.ok() || hp->port == 0 || hp->host.empty()) {
      return InvalidArgumentError(fmt::format(
          "--join-dns: '{}' is not HOST:PORT with a non-zero port (HOST is resolved to its A "
          "records, else its AAAA records; PORT is the proxies' internal listener)",
          options.join_dns));
    }
    host = hp->host;
    port = hp->port;
  }
  if (options.refresh_interval.count() <= 0 || options.discovery_interval.count() <= 0 ||
      options.registered_refresh_interval.count() <= 0) {
    return InvalidArgumentError("--discovery-interval-ms must be > 0");
  }
  std::unique_ptr<ProxyRegistrar> r(
      new ProxyRegistrar(std::move(options), std::move(register_fn), std::move(resolve_fn)));
  r->dns_host_ = host;
  r->dns_port_ = port;
  return r;
}

ProxyRegistrar::ProxyRegistrar(RegistrarOptions options, RegisterFn register_fn,
                               ResolveFn resolve_fn)
    : options_(std::move(options)), register_(std::move(register_fn)),
      resolve_(std::move(resolve_fn)) {}

ProxyRegistrar::~ProxyRegistrar() { Stop(); }

std::vector<std::string> ProxyRegistrar::Resolve() {
  auto ips = resolve_(dns_host_);
  std::lock_guard lock(mu_);
  if (!ips.ok()) {
    // Keep the last answer: a DNS hiccup must not drop every proxy.
    spdlog::warn("--join-dns {}: {}; keeping the {} proxies found before", options_.join_dns,
                 ips.status().message(), dns_targets_.size());
    return dns_targets_;
  }
  std::vector<std::string> now;
  for (const auto& ip : *ips) {
    now.push_back(ip.find(':') == std::string::npos ? fmt::format("{}:{}", ip, dns_port_)
                                                    : fmt::format("[{}]:{}", ip, dns_port_));
  }
  std::sort(now.begin(), now.end());
  for (const auto& a : now) {
    if (!std::binary_search(dns_targets_.begin(), dns_targets_.end(), a)) {
      spdlog::info("--join-dns {}: found proxy {}", options_.join_dns, a);
    }
  }
  for (const auto& a : dns_targets_) {
    if (!std::binary_search(now.begin(), now.end(), a)) {
      spdlog::info("--join-dns {}: proxy {} vanished from the answer; no longer registering "
                   "with it",
                   options_.join_dns, a);
      if (std::find(options_.join.begin(), options_.join.end(), a) == options_.join.end()) {
        ok_.erase(a);
        lost_since_.erase(a);
      }
    }
  }
  dns_targets_ = now;
  return now;
}

Status ProxyRegistrar::RegisterInitial(std::chrono::milliseconds retry_for) {
  for (const auto& a : options_.join) {
    Status s = register_(a, retry_for);
    {
      std::lock_guard lock(mu_);
      ok_[a] = s.ok();
    }
    if (!s.ok()) return s;
  }
  if (dns_host_.empty()) return Status::Ok();
  const auto give_up = std::chrono::steady_clock::now() + retry_for;
  Status last = UnavailableError("no address yet");
  while (true) {
    int registered = 0;
    for (const auto& a : Resolve()) {
      Status s = register_(a, std::chrono::milliseconds(0));
      {
        std::lock_guard lock(mu_);
        ok_[a] = s.ok();
      }
      if (s.ok()) {
        ++registered;
      } else if (s.code() == StatusCode::kFailedPrecondition ||
                 s.code() == StatusCode::kPermissionDenied ||
                 s.code() == StatusCode::kUnauthenticated) {
        return s;  // a refusal: retrying cannot help
      } else {
        last = s;
      }
    }
    if (registered > 0) return Status::Ok();
    if (std::chrono::steady_clock::now() >= give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  return UnavailableError(fmt::format(
      "--join-dns {}: no proxy registered this worker within {} s (last: {})", options_.join_dns,
      retry_for.count() / 1000.0, last.message()));
}

void ProxyRegistrar::RefreshOnce(bool resolve, bool only_failing) {
  std::vector<std::string> targets = options_.join;
  std::vector<std::string> dns;
  if (!dns_host_.empty()) {
    if (resolve) {
      dns = Resolve();
    } else {
      std::lock_guard lock(mu_);
      dns = dns_targets_;
    }
  }
  for (const auto& a : dns) {
    if (std::find(targets.begin(), targets.end(), a) == targets.end()) targets.push_back(a);
  }
  for (const auto& a : targets) {
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      if (only_failing) {
        auto it = ok_.find(a);
        if (it != ok_.end() && it->second) continue;
      }
    }
    Status s = register_(a, std::chrono::milliseconds(0));
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard lock(mu_);
    auto it = ok_.find(a);
    const bool was = it != ok_.end() && it->second;
    auto lost = lost_since_.find(a);
    if (s.ok()) {
      if (!was) spdlog::info("registered with the proxy at {}", a);
      lost_since_.erase(a);
    } else if (was) {
      // Most often a proxy stopping in order (RegistrarOptions::lost_warn_after).
      spdlog::info("registering again with the proxy at {}, registered with until now, "
                   "failed (retried every {} ms; a warning if it still fails after {} ms): {}",
                   a, options_.refresh_interval.count(), options_.lost_warn_after.count(),
                   s.message());
      lost = lost_since_.insert_or_assign(a, now).first;
    } else if (it == ok_.end()) {
      spdlog::warn("registering with the proxy at {} failed (retried every {} ms): {}", a,
                   options_.refresh_interval.count(), s.message());
    }
    if (!s.ok() && lost != lost_since_.end() && now - lost->second >= options_.lost_warn_after) {
      spdlog::warn("registering with the proxy at {}, registered with before, has failed for "
                   "{} ms (retried every {} ms): {}",
                   a, std::chrono::duration_cast<std::chrono::milliseconds>(now - lost->second).count(),
                   options_.refresh_interval.count(), s.message());
      lost_since_.erase(lost);
    }
    ok_[a] = s.ok();
  }
}

void ProxyRegistrar::Start() {
  thread_ = std::thread([this] {
    using Clock = std::chrono::steady_clock;
    const auto slow = options_.registered_refresh_interval;
    auto next_resolve = Clock::now() + options_.discovery_interval;
    auto next_full = Clock::now() + slow;
    while (true) {
      bool kicked = false;
      {
        std::unique_lock lock(mu_);
        // Failing targets (or none known yet) are retried every
        // refresh_interval; otherwise the next wake-up is the slow refresh
        // or the next DNS lookup, unless a Kick comes first.
        bool failing = ok_.empty();
        for (const auto& [_, ok] : ok_) failing |= !ok;
        auto until = std::min(next_full, failing ? Clock::now() + options_.refresh_interval
                                                 : Clock::time_point::max());
        if (!dns_host_.empty()) until = std::min(until, next_resolve);
        cv_.wait_until(lock, until, [this] { return stop_ || kicked_; });
        if (stop_) return;
        kicked = kicked_;
        kicked_ = false;
      }
      const auto now = Clock::now();
      const bool resolve = !dns_host_.empty() && now >= next_resolve;
      if (resolve) next_resolve = now + options_.discovery_interval;
      const bool full = kicked || now >= next_full;
      if (full) next_full = now + slow;
      RefreshOnce(resolve, !full);
    }
  });
}

void ProxyRegistrar::Kick() {
  {
    std::lock_guard lock(mu_);
    if (stop_) return;
    kicked_ = true;
  }
  cv_.notify_all();
}

void ProxyRegistrar::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::map<std::string, bool> ProxyRegistrar::targets() const {
  std::lock_guard lock(mu_);
  return ok_;
}

}  // namespace tandem::worker
