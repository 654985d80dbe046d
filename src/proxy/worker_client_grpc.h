// WorkerClient over gRPC (worker.proto), with one channel per worker
// address, reused by every call.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "proxy/worker_client.h"

namespace grpc {
class Channel;
}

namespace tandem::proxy {

class GrpcWorkerClient final : public WorkerClient {
 public:
  std::shared_ptr<Call> Decode(const std::string& address, DecodeArgs args,
                               DecodeEvents events) override;
  std::shared_ptr<Call> Prefill(const std::string& address, PrefillArgs args,
                                std::function<void(Result<PrefillResult>)> done) override;

  // The shared channel to `address` (created on first use).
  std::shared_ptr<grpc::Channel> Channel(const std::string& address);

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
};

}  // namespace tandem::proxy
