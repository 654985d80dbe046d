// Registration with the proxies (Registry.Register over kept channels) and
// the WorkerInfo every registration and GetInfo carries; split from
// worker_service.cc.
#include <fmt/format.h>

#include <cctype>
#include <thread>

#include "common/rpc_server.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/worker_service.h"

namespace tandem::worker {

namespace pb = ::tandem::v1;

namespace {

pb::WorkerRole RoleToProto(const std::string& role) {
  if (role == "prefill") return pb::WORKER_ROLE_PREFILL;
  if (role == "decode") return pb::WORKER_ROLE_DECODE;
  if (role == "both") return pb::WORKER_ROLE_BOTH;
  return pb::WORKER_ROLE_UNSPECIFIED;
}

}  // namespace

void FillWorkerInfo(const WorkerIdentity& id, pb::WorkerInfo* out) {
  out->set_name(id.name);
  out->set_role(RoleToProto(id.role));
  out->set_grpc_address(id.grpc_address);
  out->set_metrics_address(id.metrics_address);
  out->set_protocol_version(1);
  out->set_model(id.model);
  out->set_revision(id.revision);
  out->set_block_size(id.block_size);
  out->set_kv_dtype(id.kv_dtype);
  out->set_num_layers(id.num_layers);
  out->set_num_kv_heads(id.num_kv_heads);
  out->set_head_dim(id.head_dim);
  out->set_block_bytes(id.block_bytes);
  out->set_num_blocks(id.num_blocks);
  out->set_epoch(id.epoch);
  out->set_transport_backend(id.transport_backend);
  out->set_fleet_salt_fingerprint(id.fleet_salt_fingerprint);
  out->set_hash_root(id.hash_root);
  // Every decoder serves Decoder.DecodeStream (issue 23, docs/decode-stream.md).
  out->set_decode_stream(id.role == "decode" || id.role == "both");
  out->set_decode_mux_address(id.decode_mux_address);
  out->set_prefill_frame_address(id.prefill_frame_address);
  out->set_watch_address(id.watch_address);
  out->set_tensor_parallel(id.tensor_parallel);
  out->set_pipeline_parallel(id.pipeline_parallel);
  for (const auto& [k, v] : id.labels) (*out->mutable_labels())[k] = v;
}

namespace {

// A failed TLS handshake is not transient: retrying cannot fix a
// certificate of another CA (gRPC reports it as UNAVAILABLE).
bool IsTlsFailure(const std::string& message) {
  std::string m = message;
  for (char& c : m) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return m.find("handshake") != std::string::npos || m.find("ssl") != std::string::npos ||
         m.find("certificate") != std::string::npos || m.find("tls") != std::string::npos;
}

}  // namespace

Status RegisterWithProxy(const std::string& proxy_address, const WorkerIdentity& identity,
                         const RpcCredentials& credentials, std::chrono::milliseconds retry_for,
                         std::shared_ptr<grpc::Channel> channel,
                         std::chrono::milliseconds* heartbeat) {
  auto stub = pb::Registry::NewStub(channel ? std::move(channel) : credentials.Dial(proxy_address));
  pb::RegisterRequest req;
  FillWorkerInfo(identity, req.mutable_worker());
  const auto give_up = std::chrono::steady_clock::now() + retry_for;
  Status last;
  int closed_in_a_row = 0;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    pb::RegisterResponse resp;
    grpc::Status st = stub->Register(&ctx, req, &resp);
    if (st.ok()) {
      if (resp.has_error()) {
        return FailedPreconditionError(fmt::format("the proxy at {} refused this worker: {}",
                                                   proxy_address, resp.error().message()));
      }
      if (heartbeat != nullptr) {
        *heartbeat = std::chrono::milliseconds(static_cast<int64_t>(
            std::min<uint64_t>(resp.heartbeat_interval_ms(), 3'600'000)));
      }
      return Status::Ok();
    }
    last = FromGrpcStatus(st);
    // A connection the proxy accepts and closes at once, again and again,
    // is refused, not early (a proxy that is not up refuses the connect):
    // over TLS 1.3 a client certificate the proxy does not trust shows so,
    // and so does plaintext to a proxy that speaks TLS.
    closed_in_a_row = st.error_message().find("Socket closed") != std::string::npos
                          ? closed_in_a_row + 1
                          : 0;
    if (credentials.secure() && (IsTlsFailure(st.error_message()) || closed_in_a_row >= 3)) {
      return UnauthenticatedError(fmt::format(
          "registering with the proxy at {}: the TLS handshake failed or the proxy refused this "
          "worker's certificate ({}); the internal plane uses mutual TLS: this worker's "
          "--tls-ca/--tls-cert/--tls-key must come from the fleet's CA (the state file's tls "
          "entry names it), and --join must name the proxy's internal listener (proxy.internal)",
          proxy_address, st.error_message()));
    }
    if (!credentials.secure() && closed_in_a_row >= 3) {
      return UnauthenticatedError(fmt::format(
          "registering with the proxy at {}: it closes every plaintext connection ({}); it most "
          "likely requires mutual TLS (security.internal_tls auto): give this worker "
          "--tls-ca/--tls-cert/--tls-key of the fleet's CA",
          proxy_address, st.error_message()));
    }
    const bool retryable = st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!retryable || std::chrono::steady_clock::now() >= give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return last.WithContext(fmt::format(
      "registering with the proxy at {}{}", proxy_address,
      credentials.secure()
          ? ""
          : " over plaintext (security.internal_tls: off; a proxy with mutual TLS drops "
            "plaintext connections)"));
}

Status ProxyChannels::Register(const std::string& proxy_address, const WorkerIdentity& identity,
                               std::chrono::milliseconds retry_for,
                               std::chrono::milliseconds* heartbeat) {
  std::shared_ptr<grpc::Channel> channel;
  {
    std::lock_guard lock(mu_);
    auto& kept = channels_[proxy_address];
    if (!kept) {
      kept = credentials_.Dial(proxy_address);
      ++dials_;
    }
    channel = kept;
  }
  Status s = RegisterWithProxy(proxy_address, identity, credentials_, retry_for, channel, heartbeat);
  if (!s.ok()) {
    std::lock_guard lock(mu_);
    auto it = channels_.find(proxy_address);
    if (it != channels_.end() && it->second == channel) channels_.erase(it);
  }
  return s;
}

uint64_t ProxyChannels::dials() const {
  std::lock_guard lock(mu_);
  return dials_;
}

}  // namespace tandem::worker
