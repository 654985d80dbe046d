// Keeps one worker registered with every proxy of its fleet (issue 21,
// docs/serving-workers.md "Proxy replicas" and "Discovery"):
//   - the --join list (A,B,...), fixed for the worker's lifetime;
//   - with --join-dns HOST:PORT, every A record of HOST at PORT, re-resolved
//     every `discovery_interval`: a new address is registered with, one that
//     vanished from the answer is dropped (no longer registered with; a
//     proxy that is still alive keeps watching the worker until it stops
//     answering or drains).
// A proxy whose last registration failed (down, not started yet) is tried
// again every `refresh_interval`; one that accepted it only every
// `registered_refresh_interval`, and at once on Kick() — which the worker
// calls when a proxy's Watch stream is cancelled (the proxy died or
// restarted, or dropped this worker). The proxy treats a registration of a
// worker it already watches (same name, address and epoch) as a no-op. So
// a proxy that restarted (same address, empty registry) has every worker
// back within about `refresh_interval` of its start, and an idle fleet
// sends one small unary call per proxy per `registered_refresh_interval`
// (issue 23: it was one per second).
//
// Thread-safety: RegisterInitial, Start and Stop from the owning thread;
// targets() from any thread. The refresh thread runs the register and
// resolve functions; they must be thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace tandem::worker {

struct RegistrarOptions {
  std::vector<std::string> join;  // "host:port" of each proxy's internal listener
  std::string join_dns;           // "HOST:PORT"; empty: no DNS discovery
  std::chrono::milliseconds discovery_interval{10000};
  std::chrono::milliseconds refresh_interval{1000};
  std::chrono::milliseconds registered_refresh_interval{10000};
  // A proxy that had accepted the registration and now refuses the
  // connection is most often one stopping in order (a fleet stop drains
  // the proxy first, and every worker, kicked by its Watch ending, tries
  // it before its own SIGTERM comes): logged at info at once, and a
  // warning only if it still fails this long after. A proxy never
  // registered with warns at its first failure.
  std::chrono::milliseconds lost_warn_after{10000};
};

// Registers the worker with the proxy at `address`, retrying an unreachable
// proxy for up to `retry_for` (RegisterWithProxy).
using RegisterFn =
    std::function<Status(const std::string& address, std::chrono::milliseconds retry_for)>;
// The addresses HOST resolves to, sorted, no duplicates: IPs as text
// ("10.0.0.5", "fd00::5"; an IPv6 one is put in brackets before its port).
using ResolveFn = std::function<Result<std::vector<std::string>>(const std::string& host)>;

// getaddrinfo of `host`: its IPv4 addresses (A records) when it has any,
// else its IPv6 ones (AAAA), so that an IPv6-only cluster's proxies are
// found and a dual-stack name is not registered with twice per proxy
// (once per family, the IPv6 address perhaps not listened on).
Result<std::vector<std::string>> ResolveProxyAddresses(const std::string& host);

// "a:1, b:2" -> {"a:1", "b:2"}; every entry must be host:port (the error
// names `flag`).
Result<std::vector<std::string>> ParseJoinList(const std::string& list, const std::string& flag);

class ProxyRegistrar {
 public:
  // Checks the addresses (errors name --join / --join-dns).
  static Result<std::unique_ptr<ProxyRegistrar>> Create(RegistrarOptions options,
                                                         RegisterFn register_fn,
                                                         ResolveFn resolve_fn = ResolveProxyAddresses);
  ~ProxyRegistrar();  // Stop()

  // Registers with every --join proxy (each retried for up to `retry_for`;
  // the first failure is returned) and, with --join-dns, resolves and
  // registers until at least one proxy accepted, for up to `retry_for`.
  Status RegisterInitial(std::chrono::milliseconds retry_for);
  // The refresh thread (re-registration and re-resolution).
  void Start();
  // Registers with every target again now (on the refresh thread); a
  // no-op once stopped. From any thread.
  void Kick();
  // Joins the refresh thread: call before the worker drains, so that a
  // draining worker is not registered again.
  void Stop();

  // The proxies registered with now (join list first, then DNS), with
  // whether the last attempt succeeded.
  std::map<std::string, bool> targets() const;
  // One refresh step: re-resolve (when `resolve`), then register with every
  // target once (with `only_failing`: only those whose last attempt
  // failed or that were never tried). The refresh thread runs it; tests may
  // call it directly.
  void RefreshOnce(bool resolve, bool only_failing = false);

 private:
  ProxyRegistrar(RegistrarOptions options, RegisterFn register_fn, ResolveFn resolve_fn);
  // Re-resolves the DNS name; returns the DNS targets (unchanged on error).
  std::vector<std::string> Resolve();

  const RegistrarOptions options_;
  const RegisterFn register_;
  const ResolveFn resolve_;
  std::string dns_host_;
  uint16_t dns_port_ = 0;
  mutable std::mutex mu_;
  std::vector<std::string> dns_targets_;  // guarded by mu_
  std::map<std::string, bool> ok_;        // guarded by mu_: address -> last attempt ok
  // guarded by mu_: a proxy registered with before, failing since (until
  // its warning is logged or it answers again).
  std::map<std::string, std::chrono::steady_clock::time_point> lost_since_;
  bool stop_ = false;                     // guarded by mu_
  bool kicked_ = false;                   // guarded by mu_
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace tandem::worker
