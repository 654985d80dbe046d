// RPC adapter for the public API: converts tandem.v1 messages to and from
// the lifecycle's plain structs, and streams with one write in flight.
#include "proxy/generation_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "common/rpc_server.h"
#include "common/stream_writer.h"
#include "common/token_merge.h"
#include "common/tracing.h"
#include "proxy/generate_convert.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

// Requests up to this size that carry token ids (no text to tokenize) are
// parsed and validated on the gRPC thread that received them: for an
// 8k-token prompt (~24 KB) that is tens of microseconds, less than handing
// the request to the work pool and back (a thread wake-up each way; issue
// 23). Text prompts and larger requests go to the work pool.
constexpr size_t kInlineRequestBytes = 256 << 10;

class GenerateReactor final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  // Writes and Finish made here are held by gRPC until the handler returns
  // this reactor, so nothing can end the call while the constructor runs.
  GenerateReactor(Frontend* fe, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes)
      : fe_(fe), ctx_(ctx), writer_(this, &MergeGenerateDelta) {
    // TTFT and e2e count from here: validation and tokenization included.
    const auto arrival = std::chrono::steady_clock::now();
    writer_.Open();
    // Nothing is parsed or tokenized before the caller is authenticated,
    // within its rate, admitted, and its request within the byte limit.
    Status st = Authorize();
    if (st.ok() && fe_->draining()) st = UnavailableError("the fleet is draining");
    if (st.ok()) {
      RateRefusal r = fe_->ChargeRequest(tenant_);
      st = r.status;
      if (!st.ok()) SetRetryAfter(r.retry_after_seconds);
    }
    if (st.ok() && bytes->Length() > fe_->limits().max_request_bytes) {
      st = RequestTooLarge(*fe_, bytes->Length());
    }
    if (st.ok()) {
      st = fe_->Admit();
      if (!st.ok()) SetRetryAfter(1);
    }
    admitted_ = st.ok();
    if (!st.ok()) {
      CountRejected(st);
      writer_.Finish(ToGrpcStatus(st));
      return;
    }
    // W3C trace context in the metadata (read only when tracing is on).
    std::string traceparent;
    if (tracing::Tracer::Get().enabled()) {
      auto it = ctx_->client_metadata().find("traceparent");
      if (it != ctx_->client_metadata().end()) traceparent.assign(it->second.data(), it->second.size());
    }
    std::shared_ptr<pb::wire::GenerateRequestBytes> parsed_req;
    if (bytes->Length() <= kInlineRequestBytes) {
      auto req = std::make_shared<pb::wire::GenerateRequestBytes>();
      Status parsed = Parse(*bytes, *req);
      if (!parsed.ok() || req->prompt().empty()) {
        // Token ids (or an error): no tokenization, so done here.
        double retry_after = 0;
        Result<ValidatedRequest> v =
            PrepareGenerate(*fe_, parsed, *req, tenant_, traceparent, &retry_after);
        Validated(std::move(v), retry_after, arrival);
        return;
      }
      parsed_req = std::move(req);
    }
    // Tokenizing (and parsing a large request) runs on the proxy's work
    // pool, not on this gRPC thread; the result comes back through guard_
    // unless the call ended.
    guard_ = std::make_shared<Guard>();
    guard_->owner = this;
    grpc::ByteBuffer unparsed = parsed_req ? grpc::ByteBuffer() : grpc::ByteBuffer(*bytes);
    fe_->work().Submit([guard = guard_, fe = fe_, req = std::move(parsed_req),
                        bytes = std::move(unparsed),
                        tenant = tenant_, arrival, traceparent = std::move(traceparent)]() mutable {
      Status st = Status::Ok();
      if (!req) {
        req = std::make_shared<pb::wire::GenerateRequestBytes>();
        st = Parse(bytes, *req);
      }
      double retry_after = 0;
      Result<ValidatedRequest> v =
          PrepareGenerate(*fe, st, *req, tenant, traceparent, &retry_after);
      std::lock_guard lock(guard->mu);
      if (guard->owner != nullptr) guard->owner->Validated(std::move(v), retry_after, arrival);
    });
  }

  // In the constructor (a small request of token ids), or on a work-pool
  // thread with guard_->mu held (so OnDone waits for it).
  void Validated(Result<ValidatedRequest> v, double retry_after,
                 std::chrono::steady_clock::time_point arrival) {
    if (!v.ok()) {
      if (retry_after > 0) SetRetryAfter(retry_after);
      CountRejected(v.status());
      ReleaseSlot();
      writer_.Finish(ToGrpcStatus(v.status()));
      return;
    }
    request_id_ = v->client_request_id;
    ResponseSink sink;
    sink.on_delta = [this](std::span<const uint32_t> ids, std::string_view text) {
      pb::GenerateResponse r;
      r.set_request_id(request_id_);
      r.mutable_token_ids()->Add(ids.begin(), ids.end());
      r.set_text(std::string(text));
      writer_.Write(std::move(r));
    };
    sink.on_finish = [this](proxy::Finish reason, Usage usage) {
      pb::GenerateResponse r;
      r.set_request_id(request_id_);
      r.set_finish_reason(FinishToProto(reason));
      r.mutable_usage()->set_prompt_tokens(usage.prompt_tokens);
      r.mutable_usage()->set_completion_tokens(usage.completion_tokens);
      r.mutable_usage()->set_cached_prompt_tokens(usage.cached_prompt_tokens);
      // The slot is free before the client can see the end of its stream
      // (OnDone runs later), so a client's next request finds it free.
      ReleaseSlot();
      // The last message and the status in one operation.
      writer_.WriteAndFinish(std::move(r), grpc::Status::OK);
    };
    sink.on_error = [this](Status s) {
      ReleaseSlot();
      writer_.Finish(ToGrpcStatus(s));
    };
    auto lc = RequestLifecycle::Start(fe_->deps(), std::move(v).value(), std::move(sink),
                                      ctx_->deadline(), arrival);
    std::lock_guard lock(mu_);
    lifecycle_ = std::move(lc);
  }

  // Every RPC must be finished, cancelled ones too: the writer does it.
  void OnCancel() override {
    CancelLifecycle();
    writer_.OnCancel();
  }

  void OnWriteDone(bool ok) override { writer_.OnWriteDone(ok); }

  void OnDone() override {
    if (guard_) {
      std::lock_guard lock(guard_->mu);
      guard_->owner = nullptr;  // a validation still queued finds no one
    }
    ReleaseSlot();
    CancelLifecycle();  // no-op when it finished
    delete this;
  }

 private:
  // Once per call: the admission slot is free before the client can see
  // its stream end.
  void ReleaseSlot() {
    if (admitted_ && !released_.exchange(true)) fe_->Release();
  }

  // RESOURCE_EXHAUSTED answers carry when to retry, as trailing metadata
  // `retry-after` (whole seconds, at least 1), like HTTP's Retry-After.
  void SetRetryAfter(double seconds) {
    const auto whole = static_cast<long long>(std::ceil(std::max(seconds, 1.0)));
    ctx_->AddTrailingMetadata("retry-after", std::to_string(whole));
  }

  static Status Parse(const grpc::ByteBuffer& bytes, pb::wire::GenerateRequestBytes& out) {
    grpc::Slice slice;
    if (!bytes.TrySingleSlice(&slice).ok() && !bytes.DumpToSingleSlice(&slice).ok()) {
      return InternalError("cannot read the request's bytes");
    }
    if (!out.ParseFromArray(slice.begin(), static_cast<int>(slice.size()))) {
      return InvalidArgumentError("the request is not a valid tandem.v1.GenerateRequest");
    }
    return Status::Ok();
  }

  void CancelLifecycle() {
    std::shared_ptr<RequestLifecycle> lc;
    {
      std::lock_guard lock(mu_);
      lc = std::move(lifecycle_);
    }
    if (lc) lc->Cancel();
  }

  Status Authorize() {
    const auto& md = ctx_->client_metadata();
    auto it = md.find("authorization");
    const std::string_view v =
        it == md.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
    auto t = fe_->Authenticate(v);
    if (!t.ok()) return t.status();
    tenant_ = *t;
    return Status::Ok();
  }

  void CountRejected(const Status& st) {
    if (auto* m = fe_->deps().metrics) {
      m->CountOutcome(st.code() == StatusCode::kResourceExhausted ? "rejected" : "invalid");
    }
  }

  // Between this reactor and its job on the work pool.
  struct Guard {
    std::mutex mu;
    GenerateReactor* owner = nullptr;  // guarded by mu; null once OnDone ran
  };

  Frontend* fe_;
  std::shared_ptr<Guard> guard_;
  const Tenant* tenant_ = nullptr;
  grpc::CallbackServerContext* ctx_;
  StreamWriter<pb::GenerateResponse> writer_;
  bool admitted_ = false;  // holds an admission slot (Frontend::Admit)
  std::atomic<bool> released_{false};
  std::string request_id_;
  std::mutex mu_;
  std::shared_ptr<RequestLifecycle> lifecycle_;  // guarded by mu_
};

}  // namespace

GenerationService::GenerationService(Frontend* frontend) : frontend_(frontend) {
  // Method 0 is Generate: replace the generated handler with one that takes
  // the raw bytes (counted against proxy.limits.max_request_bytes before
  // anything parses them) and parses the bytes-typed twin of GenerateRequest.
  MarkMethodCallback(
      0, new grpc::internal::CallbackServerStreamingHandler<grpc::ByteBuffer, pb::GenerateResponse>(
             [this](grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
               return GenerateBytes(ctx, request);
             }));
}

grpc::ServerWriteReactor<pb::GenerateResponse>* GenerationService::GenerateBytes(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  return new GenerateReactor(frontend_, ctx, request);
}

grpc::ServerUnaryReactor* GenerationService::ListModels(grpc::CallbackServerContext* ctx,
                                                        const pb::ListModelsRequest*,
                                                        pb::ListModelsResponse* response) {
  auto* m = response->add_models();
  m->set_id(frontend_->limits().model);
  m->set_max_model_len(frontend_->limits().max_model_len);
  m->set_vocab_size(frontend_->limits().vocab_size);
  m->set_block_size(frontend_->deps().block_size);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace tandem::proxy
