// The RPC edge of the prefiller: worker.proto messages <-> prefiller structs.
#include "prefiller/prefiller_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

#include "common/rpc_server.h"
#include "common/tracing.h"
#include "common/wire_ids.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/attempt_key.h"
#include "worker/engine_params.h"

namespace tandem::prefiller {

namespace {

namespace pb = ::tandem::v1;

using worker::ToSampling;

Status FromErrorInfo(const pb::ErrorInfo& e) {
  const int code = e.code();
  const StatusCode c = code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown;
  return Status(c, e.message());
}

class PrefillReactor final : public grpc::ServerUnaryReactor {
 public:
  PrefillReactor(Prefiller& prefiller, std::string request_id)
      : prefiller_(prefiller), request_id_(std::move(request_id)) {}
  void OnCancel() override { prefiller_.Cancel(request_id_); }
  void OnDone() override { delete this; }

 private:
  Prefiller& prefiller_;
  const std::string request_id_;
};

class PrefillerServiceImpl final : public pb::Prefiller::CallbackService {
 public:
  explicit PrefillerServiceImpl(Prefiller& prefiller) : prefiller_(prefiller) {}

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx, const pb::PrefillRequest* req,
                                    pb::PrefillResponse* resp) override {
    // Each attempt is its own job (worker/attempt_key.h): a retry reaching
    // us before the abandoned attempt's cancel never collides with it.
    std::string_view traceparent;
    if (tracing::Tracer::Get().enabled()) {
      auto it = ctx->client_metadata().find("traceparent");
      if (it != ctx->client_metadata().end()) {
        traceparent = std::string_view(it->second.data(), it->second.size());
      }
    }
    PrefillJob job = ToPrefillJob(*req, traceparent);
    auto* reactor = new PrefillReactor(prefiller_, job.request_id);
    const std::string id = req->request_id();
    Status s = prefiller_.Submit(std::move(job), [reactor, resp, id](Result<PrefillResult> r) {
      if (!r.ok()) {
        reactor->Finish(ToGrpcStatus(r.status()));
        return;
      }
      ToPrefillResponse(id, *r, resp);
      reactor->Finish(grpc::Status::OK);
    });
    // A cancel before the reactor is returned still reaches OnCancel later.
    if (!s.ok()) reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }

 private:
  Prefiller& prefiller_;
};

class GrpcDecoderLink final : public DecoderLink {
 public:
  GrpcDecoderLink(RpcCredentials credentials, std::string prefiller_descriptor,
                  parallel::ParallelLayout layout)
      : credentials_(std::move(credentials)),
        prefiller_descriptor_(std::move(prefiller_descriptor)),
        layout_(layout) {}

  void Reserve(const PrefillJob& job, const std::string& prefiller_name, ReserveDone done) override {
    struct Call {
      grpc::ClientContext ctx;
      pb::ReserveRequest req;
      pb::ReserveResponse resp;
    };
    auto call = std::make_shared<Call>();
    FillReserveRequest(job, prefiller_name, prefiller_descriptor_, layout_, &call->req);
    call->ctx.set_deadline(ReserveDeadline(job));
    if (job.trace.sampled) call->ctx.AddMetadata("traceparent", tracing::FormatTraceparent(job.trace));
    pb::Decoder::Stub* stub = StubFor(job.decoder_address);
    stub->async()->Reserve(&call->ctx, &call->req, &call->resp,
                           [call, done = std::move(done)](grpc::Status st) {
                             // An unreachable decoder is the proxy's to re-route.
                             if (!st.ok()) {
                               done(FromGrpcStatus(st));
                             } else {
                               done(FromReserveResponse(call->resp));
                             }
                           });
  }

  std::string EncodeNotice(const NoticeSpec& n) override {
    pb::KvNotice m;
    m.set_request_id(n.request_id);
    m.set_reservation_id(n.reservation_id);
    m.set_generation(n.generation);
    m.set_first_token_id(n.first_token_id);
    m.set_prefill_cached_prompt_tokens(n.cached_prompt_tokens);
    m.set_capability(n.capability);
    m.set_kv_tags(n.kv_tags);
    m.mutable_block_checksums()->Add(n.block_checksums.begin(), n.block_checksums.end());
    m.set_ranks_pushed(n.ranks_pushed);
    if (!n.error.ok()) {
      m.mutable_error()->set_code(static_cast<int>(n.error.code()));
      m.mutable_error()->set_message(n.error.message());
    }
    return m.SerializeAsString();
  }

 private:
  pb::Decoder::Stub* StubFor(const std::string& address) {
    std::lock_guard lock(mu_);
    auto& stub = stubs_[address];
    if (!stub) {
      stub = pb::Decoder::NewStub(credentials_.Dial(address));
    }
    return stub.get();
  }

  const RpcCredentials credentials_;
  const std::string prefiller_descriptor_;
  const parallel::ParallelLayout layout_;  // this prefiller's (ReserveRequest fields 190-191)
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<pb::Decoder::Stub>> stubs_;  // never erased
};

}  // namespace

void FillReserveRequest(const PrefillJob& job, const std::string& prefiller_name,
                        const std::string& prefiller_descriptor, parallel::ParallelLayout layout,
                        v1::ReserveRequest* req) {
  req->set_request_id(job.request_id);
  req->set_prefiller(prefiller_name);
  req->set_prefiller_transport_descriptor(prefiller_descriptor);
  req->set_prefill_tensor_parallel(layout.tp);
  req->set_prefill_pipeline_parallel(layout.pp);
  req->mutable_prompt_token_ids()->Add(job.prompt_ids.begin(), job.prompt_ids.end());
  // A decoder whose seats are all taken may hold the call for one: for
  // most of the call's time, leaving room for its refusal to arrive.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      ReserveDeadline(job) - std::chrono::system_clock::now());
  const auto margin = std::min<std::chrono::milliseconds>(kSeatWaitMargin, left / 4);
  req->set_seat_wait_ms(static_cast<uint32_t>(std::max<int64_t>(0, (left - margin).count())));
}

std::chrono::system_clock::time_point ReserveDeadline(const PrefillJob& job) {
  auto deadline = std::chrono::system_clock::now() + kReserveTimeout;
  if (job.deadline && *job.deadline < deadline) deadline = *job.deadline;
  return deadline;
}

Result<ReserveTarget> FromReserveResponse(const v1::ReserveResponse& resp) {
  if (resp.has_error()) return FromErrorInfo(resp.error());
  const pb::KvTarget& t = resp.target();
  ReserveTarget out;
  out.reservation_id = t.reservation_id();
  out.generation = t.generation();
  out.transport_descriptor = t.transport_descriptor();
  out.slots.assign(t.slots().begin(), t.slots().end());
  out.cached_blocks = t.cached_blocks();
  out.capability = t.capability();
  out.kv_key = t.kv_key();
  out.decode_layout = {.tp = std::max(1u, t.decode_tensor_parallel()),
                       .pp = std::max(1u, t.decode_pipeline_parallel())};
  out.rank_descriptors.assign(t.rank_transport_descriptors().begin(),
                              t.rank_transport_descriptors().end());
  if (t.lease_expiry_unix_ms() > 0) {
    out.lease_expiry = std::chrono::system_clock::time_point(
        std::chrono::milliseconds(t.lease_expiry_unix_ms()));
  }
  return out;
}

PrefillJob ToPrefillJob(const pb::PrefillRequest& req, std::string_view traceparent) {
  PrefillJob job;
  job.request_id = worker::AttemptKey(req.request_id(), req.attempt());
  // Either encoding (common/wire_ids.h): a proxy of this version sends fixed32.
  const std::span<const uint32_t> prompt = PromptIdsOf(req);
  job.prompt_ids.assign(prompt.begin(), prompt.end());
  job.sampling = ToSampling(req.params());
  job.first_sample_index = req.params().first_sample_index();
  job.cache_salt = req.tenant_salt();
  job.priority = req.priority();
  job.tenant = req.tenant();
  job.tenant_weight = req.tenant_weight() > 0 ? req.tenant_weight() : 1.0;
  job.waited = std::chrono::microseconds(
      std::min<uint64_t>(req.waited_us(), static_cast<uint64_t>(kMaxWaited.count())));
  if (req.deadline_unix_ms() > 0) {
    job.deadline = std::chrono::system_clock::time_point(
        std::chrono::milliseconds(req.deadline_unix_ms()));
  }
  job.decoder_address = req.decoder_address();
  job.decoder_name = req.decoder_name().empty() ? req.decoder_address() : req.decoder_name();
  job.decoder_reserve_address = req.decoder_reserve_address();
  if (!traceparent.empty() && tracing::Tracer::Get().enabled()) {
    job.trace = tracing::Tracer::Get().ContinueFrom(traceparent);
  }
  return job;
}

void ToPrefillResponse(const std::string& request_id, const PrefillResult& r,
                       pb::PrefillResponse* resp) {
  resp->set_request_id(request_id);
  resp->set_first_token_id(r.first_token_id);
  resp->set_cached_prompt_tokens(r.cached_prompt_tokens);
  resp->set_decoder_cached_blocks(r.decoder_cached_blocks);
  resp->set_transferred_blocks(r.transferred_blocks);
  resp->set_transferred_bytes(r.transferred_bytes);
  resp->set_prefill_seconds(r.prefill_seconds);
  resp->set_transfer_seconds(r.transfer_seconds);
}

std::unique_ptr<grpc::Service> MakePrefillerService(Prefiller& prefiller) {
  return std::make_unique<PrefillerServiceImpl>(prefiller);
}

std::unique_ptr<DecoderLink> MakeGrpcDecoderLink(const RpcCredentials& credentials,
                                                 std::string prefiller_descriptor,
                                                 parallel::ParallelLayout layout) {
  return std::make_unique<GrpcDecoderLink>(credentials, std::move(prefiller_descriptor), layout);
}

}  // namespace tandem::prefiller
