// Membership at the proxy: the Registry service workers join through, and
// one Watch stream per worker that feeds the router (KV events, snapshots,
// load reports) and doubles as liveness: a worker whose stream breaks or
// stays silent past `liveness_timeout` leaves routing until it registers
// again.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "proxy/fleet.h"
#include "proxy/worker_client_grpc.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::proxy {

class WorkerWatch;

class RegistryService final : public tandem::v1::Registry::CallbackService {
 public:
  RegistryService(Fleet* fleet, GrpcWorkerClient* channels,
                  std::chrono::milliseconds liveness_timeout);
  ~RegistryService() override;

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const tandem::v1::RegisterRequest* request,
                                     tandem::v1::RegisterResponse* response) override;

  // Stops watching every worker (at shutdown).
  void Shutdown();

 private:
  friend class WorkerWatch;
  void StartWatch(const std::string& name, const std::string& address, uint64_t epoch);
  // A watch stream ended; `resync` restarts it from a snapshot, otherwise
  // the worker leaves routing.
  void WatchEnded(const std::string& name, WorkerWatch* watch, const std::string& why,
                  bool resync, const std::string& address, uint64_t epoch);
  void Housekeeping(std::stop_token stop);

  Fleet* fleet_;
  GrpcWorkerClient* channels_;
  const std::chrono::milliseconds liveness_timeout_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<WorkerWatch>> watches_;  // guarded by mu_
  bool shut_down_ = false;                                       // guarded by mu_
  std::jthread housekeeping_;
};

}  // namespace tandem::proxy
