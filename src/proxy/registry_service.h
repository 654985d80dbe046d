// Membership at the proxy: the Registry service workers join through, and
// one Watch stream per worker that feeds the router (KV events, snapshots,
// load reports) and doubles as liveness: a worker whose stream breaks or
// stays silent past `liveness_timeout` leaves routing. The proxy keeps
// probing it (a new Watch every kProbeInterval, for kForgetAfter) and puts
// it back in routing as soon as a probe delivers its snapshot (a paused or
// overloaded worker that answers again); registering again also does. A
// worker that ends its streams itself (OK: it is draining) is forgotten.
//
// A registration of a worker the proxy already watches (same name, gRPC
// address and epoch) is a no-op: workers repeat theirs now and then, and at
// once when their Watch stream is cancelled, so that a restarted proxy gets
// them back (worker/proxy_registrar.h). The registration's answer asks for
// an update on the Watch stream at least every liveness_timeout / 4
// (heartbeat_interval_ms): an idle worker's keep-alive.
// WaitForSnapshots tells a restarted proxy when its index is warm.
//
// Issue 23 (docs/serving-workers.md "Watch transport"): the Watch stream goes
// over the worker's framed TCP listener when it advertises one and
// proxy.watch_transport is tcp, with the same semantics as the gRPC one.
//
// A worker name is bound to the certificate identity (common name) that
// first registered it; a registration of that name under another identity
// is refused with PERMISSION_DENIED (docs/security.md).
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "common/frame_conn.h"
#include "common/tls.h"
#include "proxy/fleet.h"
#include "proxy/worker_client_grpc.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::proxy {

class WorkerWatch;

class RegistryService final : public tandem::v1::Registry::CallbackService {
 public:
  // `watch_tcp` (proxy.watch_transport tcp; issue 23): a worker that
  // advertises a framed TCP Watch listener (WorkerInfo.watch_address) is
  // watched there, with `credentials`' mutual TLS identity
  // (proxy/watch_tcp_client.h); otherwise, and for the others, over gRPC.
  RegistryService(Fleet* fleet, GrpcWorkerClient* channels,
                  std::chrono::milliseconds liveness_timeout, bool watch_tcp = false,
                  const RpcCredentials& credentials = RpcCredentials());
  ~RegistryService() override;

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const tandem::v1::RegisterRequest* request,
                                     tandem::v1::RegisterResponse* response) override;
  // One registration, from the gRPC Register above or the framed listener
  // (proxy/register_tcp.h): `identity` is the caller's verified certificate
  // common name ("" over plaintext). A refusal is response->error.
  void HandleRegister(const tandem::v1::RegisterRequest& request, const std::string& identity,
                      tandem::v1::RegisterResponse* response);

  // Stops watching every worker (at shutdown).
  void Shutdown();

  // Waits up to `limit` until `n` distinct workers have delivered a
  // snapshot (their cached blocks are in the router's index); returns how
  // many have.
  size_t WaitForSnapshots(size_t n, std::chrono::milliseconds limit);

  static constexpr std::chrono::milliseconds kProbeInterval{500};
  static constexpr std::chrono::minutes kForgetAfter{10};

 private:
  friend class WorkerWatch;
  // `rejoin`: a probe of a worker out of routing; its first update puts
  // `rejoin` back into the fleet.
  void StartWatch(const std::string& name, const std::string& address, uint64_t epoch,
                  std::optional<WorkerRecord> rejoin = std::nullopt);
  // A watch stream ended; `resync` restarts it from a snapshot, otherwise
  // the worker leaves routing (and is probed unless it left `graceful`ly).
  void WatchEnded(const std::string& name, WorkerWatch* watch, const std::string& why,
                  bool resync, bool graceful, const std::string& address, uint64_t epoch,
                  const std::optional<WorkerRecord>& probe_of);
  // A probe's first update arrived: back into the fleet (false: stale probe
  // or refused).
  bool Rejoin(const std::string& name, WorkerWatch* watch, WorkerRecord rec, uint64_t epoch);
  void Housekeeping(std::stop_token stop);
  void SnapshotApplied(const std::string& name);

  Fleet* fleet_;
  GrpcWorkerClient* channels_;
  bool watch_tcp_ = false;
  std::shared_ptr<FrameTls> watch_tls_;  // the framed Watch connections' TLS; null: plaintext
  // Worker gRPC address -> its framed TCP Watch listener (watch_tcp_ only).
  std::map<std::string, std::string> watch_addresses_;  // guarded by mu_
  const std::chrono::milliseconds liveness_timeout_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<WorkerWatch>> watches_;  // guarded by mu_
  bool shut_down_ = false;                                       // guarded by mu_
  struct Lost {
    WorkerRecord record;
    std::chrono::steady_clock::time_point since, next_probe;
  };
  std::map<std::string, Lost> lost_;  // guarded by mu_: out of routing, being probed
  // Worker name -> the certificate identity that first registered it (for
  // the proxy's lifetime; "" over plaintext). guarded by mu_
  std::map<std::string, std::string> identities_;
  std::set<std::string> snapshotted_;  // guarded by mu_: workers whose snapshot arrived
  std::condition_variable snapshot_cv_;
  // Wakes Housekeeping for a deadline sooner than the one it sleeps to.
  std::condition_variable_any housekeeping_cv_;
  bool housekeeping_kick_ = false;  // guarded by mu_
  std::jthread housekeeping_;
};

}  // namespace tandem::proxy
