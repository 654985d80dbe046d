// Registration with the proxies (Registry.Register over kept channels, or
// framed RegisterRequest/RegisterResponse over kept connections) and
// the WorkerInfo every registration and GetInfo carries; split from
// worker_service.cc.
#include <fmt/format.h>

#include <poll.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "common/frame_conn.h"
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
  out->set_decode_seats(id.decode_seats);
  out->set_epoch(id.epoch);
  out->set_transport_backend(id.transport_backend);
  out->set_fleet_salt_fingerprint(id.fleet_salt_fingerprint);
  out->set_hash_root(id.hash_root);
  // Every decoder serves Decoder.DecodeStream (issue 23, docs/decode-stream.md).
  out->set_decode_stream(id.role == "decode" || id.role == "both");
  out->set_decode_mux_address(id.decode_mux_address);
  out->set_prefill_frame_address(id.prefill_frame_address);
  out->set_watch_address(id.watch_address);
  // Session 8 (prompt-copy): DecodeSpecFromProto and ToPrefillJob read the
  // fixed32 prompt (docs/serving-workers.md, "Prompt and hash encoding").
  out->set_reads_fixed32_prompt(true);
  out->set_reserve_address(id.reserve_address);
  // Session 38: every decoder of this version holds a Reserve that comes
  // before its request's registration (decode_seats.cc), so the proxy may
  // send the Prefill with the decode start (docs/decode-stream.md).
  out->set_reserve_waits_for_registration(id.role == "decode" || id.role == "both");
  // Session 39: and it takes a prompt by reference from the prefiller's
  // Reserve (DecodeSpec::prompt_ref; docs/decode-stream.md "The prompt goes once").
  out->set_takes_prompt_from_reserve(id.role == "decode" || id.role == "both");
  out->set_tensor_parallel(id.tensor_parallel);
  out->set_pipeline_parallel(id.pipeline_parallel);
  for (const auto& [k, v] : id.labels) (*out->mutable_labels())[k] = v;
}

// A failed TLS handshake is not transient: retrying cannot fix a
// certificate of another CA (gRPC reports it as UNAVAILABLE).
bool IsTlsFailure(std::string_view message, std::string_view proxy_address) {
  std::string m(message);
  // Every mention of the proxy's address, host or port, is blanked first.
  const std::string_view host = proxy_address.substr(0, proxy_address.rfind(':'));
  for (const std::string_view name : {proxy_address, host}) {
    if (name.empty()) continue;
    for (size_t at = m.find(name); at != std::string::npos; at = m.find(name, at + name.size())) {
      m.replace(at, name.size(), name.size(), ' ');
    }
  }
  for (char& c : m) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return m.find("handshake") != std::string::npos || m.find("ssl") != std::string::npos ||
         m.find("certificate") != std::string::npos || m.find("tls") != std::string::npos;
}

namespace {

// A failed attempt that retrying cannot fix, or OK. A connection the proxy
// accepts and closes at once, again and again (`closed_in_a_row`), is
// refused, not early (a proxy that is not up refuses the connect): over TLS
// 1.3 a client certificate the proxy does not trust shows so, and so does
// plaintext to a proxy that speaks TLS.
Status Refusal(const std::string& proxy_address, const RpcCredentials& credentials,
               const Status& st, int closed_in_a_row) {
  if (credentials.secure() &&
      (IsTlsFailure(st.message(), proxy_address) || closed_in_a_row >= 3)) {
    return UnauthenticatedError(fmt::format(
        "registering with the proxy at {}: the TLS handshake failed or the proxy refused this "
        "worker's certificate ({}); the internal plane uses mutual TLS: this worker's "
        "--tls-ca/--tls-cert/--tls-key must come from the fleet's CA (the state file's tls "
        "entry names it), --join must name the proxy's internal listener (proxy.internal), and "
        "proxy.register_transport must be the proxy's",
        proxy_address, st.message()));
  }
  if (!credentials.secure() && closed_in_a_row >= 3) {
    return UnauthenticatedError(fmt::format(
        "registering with the proxy at {}: it closes every plaintext connection ({}); it most "
        "likely requires mutual TLS (security.internal_tls auto): give this worker "
        "--tls-ca/--tls-cert/--tls-key of the fleet's CA",
        proxy_address, st.message()));
  }
  return Status::Ok();
}

bool Retryable(const Status& st) {
  return st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kDeadlineExceeded;
}

Status GaveUp(const std::string& proxy_address, const RpcCredentials& credentials,
              const Status& last) {
  return last.WithContext(fmt::format(
      "registering with the proxy at {}{}", proxy_address,
      credentials.secure()
          ? ""
          : " over plaintext (security.internal_tls: off; a proxy with mutual TLS drops "
            "plaintext connections)"));
}

// The proxy's answer; a refusal is FAILED_PRECONDITION with its reason.
Status Answer(const std::string& proxy_address, const pb::RegisterResponse& resp,
              std::chrono::milliseconds* heartbeat) {
  if (resp.has_error()) {
    return FailedPreconditionError(fmt::format("the proxy at {} refused this worker: {}",
                                               proxy_address, resp.error().message()));
  }
  if (heartbeat != nullptr) {
    *heartbeat = std::chrono::milliseconds(
        static_cast<int64_t>(std::min<uint64_t>(resp.heartbeat_interval_ms(), 3'600'000)));
  }
  return Status::Ok();
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
    if (st.ok()) return Answer(proxy_address, resp, heartbeat);
    last = FromGrpcStatus(st);
    closed_in_a_row = st.error_message().find("Socket closed") != std::string::npos
                          ? closed_in_a_row + 1
                          : 0;
    if (Status refused = Refusal(proxy_address, credentials, last, closed_in_a_row);
        !refused.ok()) {
      return refused;
    }
    if (!Retryable(last) || std::chrono::steady_clock::now() >= give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return GaveUp(proxy_address, credentials, last);
}

// ---- framed registration (proxy.register_transport tcp; proxy/register_tcp.h)

struct ProxyChannels::Framed {
  Result<std::shared_ptr<FrameTls>> tls = std::shared_ptr<FrameTls>();
  // One kept connection per proxy address; one registration on it at a time.
  struct Kept {
    std::mutex mu;                    // held for a whole exchange
    std::shared_ptr<FrameConn> conn;  // guarded by mu; null or closed: dial anew
  };
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Kept>> kept;  // guarded by mu
};

namespace {

// One RegisterRequest frame and its RegisterResponse on `conn`, driven from
// this thread (nobody else reads the connection), by `deadline`.
Result<pb::RegisterResponse> Exchange(FrameConn& conn, const pb::RegisterRequest& req,
                                      std::chrono::steady_clock::time_point deadline) {
  TANDEM_RETURN_IF_ERROR(conn.Send(req));
  std::optional<pb::RegisterResponse> got;
  while (!got) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      conn.Close(DeadlineExceededError("no answer to the registration in time"));
      return DeadlineExceededError(
          fmt::format("the proxy at {} did not answer the registration in time", conn.peer()));
    }
    // Before it opens, Progress also runs at the connection's own deadline
    // (a pending TCP connect's: it dials the proxy name's next address).
    const auto until = conn.open() ? deadline : std::min(deadline, conn.progress_deadline());
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
    pollfd p{conn.fd(), conn.Events(), 0};
    if (poll(&p, 1, static_cast<int>(std::max<int64_t>(wait.count(), 0)) + 1) < 0 && errno != EINTR) {
      return UnavailableError(fmt::format("poll: {}", std::strerror(errno)));
    }
    Status st = conn.Progress(p.revents, [&](std::string_view payload) {
      pb::RegisterResponse resp;
      if (!resp.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
        return InvalidArgumentError(fmt::format(
            "the answer of {} is not a RegisterResponse; does it serve the framed Register "
            "(proxy.register_transport tcp on the proxy and this worker alike)?",
            conn.peer()));
      }
      got = std::move(resp);
      return Status::Ok();
    });
    if (st.ok() && !conn.open() && std::chrono::steady_clock::now() >= conn.handshake_deadline()) {
      st = conn.Expire();
    }
    if (!st.ok() && !got) return st;
  }
  return *std::move(got);
}

// A kept connection the proxy closed meanwhile (it restarted, or dropped
// it): reads what is pending without waiting; true when it is still usable.
bool StillOpen(FrameConn& conn) {
  if (conn.closed()) return false;
  pollfd p{conn.fd(), conn.Events(), 0};
  if (poll(&p, 1, 0) <= 0) return true;
  return conn.Progress(p.revents, [](std::string_view) { return Status::Ok(); }).ok();
}

}  // namespace

ProxyChannels::ProxyChannels(RpcCredentials credentials, bool tcp)
    : credentials_(std::move(credentials)) {
  if (!tcp) return;
  framed_ = std::make_unique<Framed>();
  framed_->tls = InternalFrameTls(credentials_);
}

ProxyChannels::~ProxyChannels() = default;

Status ProxyChannels::RegisterFramed(const std::string& proxy_address,
                                     const WorkerIdentity& identity,
                                     std::chrono::milliseconds retry_for,
                                     std::chrono::milliseconds* heartbeat) {
  if (!framed_->tls.ok()) {
    return framed_->tls.status().WithContext("proxy.register_transport tcp");
  }
  std::shared_ptr<Framed::Kept> kept;
  {
    std::lock_guard lock(framed_->mu);
    auto& k = framed_->kept[proxy_address];
    if (!k) k = std::make_shared<Framed::Kept>();
    kept = k;
  }
  pb::RegisterRequest req;
  FillWorkerInfo(identity, req.mutable_worker());
  const auto give_up = std::chrono::steady_clock::now() + retry_for;
  std::lock_guard lock(kept->mu);
  Status last;
  int closed_in_a_row = 0;
  while (true) {
    const bool fresh = !kept->conn || !StillOpen(*kept->conn);
    if (fresh) {
      FrameOptions options;
      options.max_frame_bytes = 1u << 20;
      options.handshake_timeout = std::chrono::seconds(5);
      kept->conn = FrameConn::Client(proxy_address, *framed_->tls, options);
      kept->conn->SetWake([] {});  // this thread flushes (Exchange polls for POLLOUT)
      {
        std::lock_guard dl(mu_);
        ++dials_;
      }
    }
    Status st = fresh ? kept->conn->Connect() : Status::Ok();
    Result<pb::RegisterResponse> resp =
        st.ok() ? Exchange(*kept->conn, req,
                           std::chrono::steady_clock::now() + std::chrono::seconds(5))
                : Result<pb::RegisterResponse>(st);
    if (resp.ok()) return Answer(proxy_address, *resp, heartbeat);
    kept->conn->Close(resp.status());
    kept->conn.reset();  // the next attempt dials afresh
    // A kept connection that broke (a restarted proxy) is retried at once
    // on a new one, without counting against the refusal checks.
    if (!fresh) continue;
    last = resp.status();
    // The peer closed it before answering: no connect error, no TLS alert.
    const std::string& m = last.message();
    closed_in_a_row = m.find("closed the connection") != std::string::npos ||
                              m.find("reset by peer") != std::string::npos ||
                              m.find("Broken pipe") != std::string::npos
                          ? closed_in_a_row + 1
                          : 0;
    if (Status refused = Refusal(proxy_address, credentials_, last, closed_in_a_row);
        !refused.ok()) {
      return refused;
    }
    if (last.code() == StatusCode::kInvalidArgument) {
      // Not frames of the framed Register (e.g. a gRPC server's HTTP/2 preface).
      return last.WithContext(fmt::format(
          "registering with the proxy at {}: it does not answer the framed Register; "
          "proxy.register_transport (tcp here) must be the proxy's",
          proxy_address));
    }
    if (!Retryable(last) || std::chrono::steady_clock::now() >= give_up) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return GaveUp(proxy_address, credentials_, last);
}

Status ProxyChannels::Register(const std::string& proxy_address, const WorkerIdentity& identity,
                               std::chrono::milliseconds retry_for,
                               std::chrono::milliseconds* heartbeat) {
  if (framed_) return RegisterFramed(proxy_address, identity, retry_for, heartbeat);
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
