// RPC adapter for the public API: converts tandem.v1 messages to and from
// the lifecycle's plain structs, and streams with one write in flight.
#include "proxy/generation_service.h"

#include <fmt/format.h>

#include <atomic>
#include <mutex>

#include "common/rpc_server.h"
#include "common/stream_writer.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

ClientRequest FromProto(const pb::wire::GenerateRequestBytes& r) {
  ClientRequest c;
  c.request_id = r.request_id();
  c.model = r.model();
  c.has_prompt = !r.prompt().empty();
  c.prompt = r.prompt();
  c.prompt_token_ids.assign(r.prompt_token_ids().begin(), r.prompt_token_ids().end());
  if (r.has_max_tokens()) c.max_tokens = r.max_tokens();
  if (r.has_sampling()) {
    const auto& s = r.sampling();
    if (s.has_temperature()) c.temperature = s.temperature();
    if (s.has_top_p()) c.top_p = s.top_p();
    if (s.has_top_k()) c.top_k = s.top_k();
    if (s.has_seed()) c.seed = s.seed();
  }
  c.stop.assign(r.stop().begin(), r.stop().end());
  c.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
  c.ignore_eos = r.ignore_eos();
  return c;
}

// An empty prompt string is "not set" in proto3; say "empty" when the
// client clearly sent neither ids nor text.
Status ExplainEmptyPrompt(const pb::wire::GenerateRequestBytes& r) {
  if (r.prompt().empty() && r.prompt_token_ids().empty()) {
    return InvalidArgumentError(
        "prompt is empty and prompt_token_ids is empty: give exactly one of them");
  }
  return Status::Ok();
}

pb::FinishReason ToProto(Finish f) {
  switch (f) {
    case Finish::kStop: return pb::FINISH_REASON_STOP;
    case Finish::kLength: return pb::FINISH_REASON_LENGTH;
    default: return pb::FINISH_REASON_UNSPECIFIED;
  }
}

class GenerateReactor final : public grpc::ServerWriteReactor<pb::GenerateResponse> {
 public:
  // Writes and Finish made here are held by gRPC until the handler returns
  // this reactor, so nothing can end the call while the constructor runs.
  GenerateReactor(Frontend* fe, grpc::CallbackServerContext* ctx,
                  const pb::wire::GenerateRequestBytes* req)
      : fe_(fe), ctx_(ctx), writer_(this) {
    // TTFT and e2e count from here: validation and tokenization included.
    const auto arrival = std::chrono::steady_clock::now();
    writer_.Open();
    Status st = Authorize();
    if (st.ok()) st = ExplainEmptyPrompt(*req);
    if (st.ok() && fe_->draining()) st = UnavailableError("the fleet is draining");
    Result<ValidatedRequest> v = st.ok() ? fe_->Validate(FromProto(*req), tenant_) : Result<ValidatedRequest>(st);
    if (v.ok()) st = fe_->Admit(v->request_id);
    if (!v.ok() || !st.ok()) {
      const Status& why = v.ok() ? st : v.status();
      CountRejected(why);
      writer_.Finish(ToGrpcStatus(why));
      return;
    }
    admitted_ = true;
    request_id_ = v->request_id;
    ResponseSink sink;
    sink.on_delta = [this](std::vector<uint32_t> ids, std::string text) {
      pb::GenerateResponse r;
      r.set_request_id(request_id_);
      for (uint32_t t : ids) r.add_token_ids(t);
      r.set_text(std::move(text));
      writer_.Write(std::move(r));
    };
    sink.on_finish = [this](proxy::Finish reason, Usage usage) {
      pb::GenerateResponse r;
      r.set_request_id(request_id_);
      r.set_finish_reason(ToProto(reason));
      r.mutable_usage()->set_prompt_tokens(usage.prompt_tokens);
      r.mutable_usage()->set_completion_tokens(usage.completion_tokens);
      r.mutable_usage()->set_cached_prompt_tokens(usage.cached_prompt_tokens);
      writer_.Write(std::move(r));
      // The id is free before the client can see the end of its stream, so a
      // client reusing it right after is not refused (OnDone runs later).
      ReleaseId();
      writer_.Finish(grpc::Status::OK);
    };
    sink.on_error = [this](Status s) {
      ReleaseId();
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
    ReleaseId();
    CancelLifecycle();  // no-op when it finished
    delete this;
  }

 private:
  // Once per call: after the first release a new request may hold the same id.
  void ReleaseId() {
    if (admitted_ && !released_.exchange(true)) fe_->Release(request_id_);
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

  Frontend* fe_;
  const Tenant* tenant_ = nullptr;
  grpc::CallbackServerContext* ctx_;
  StreamWriter<pb::GenerateResponse> writer_;
  bool admitted_ = false;
  std::atomic<bool> released_{false};
  std::string request_id_;
  std::mutex mu_;
  std::shared_ptr<RequestLifecycle> lifecycle_;  // guarded by mu_
};

}  // namespace

GenerationService::GenerationService(Frontend* frontend) : frontend_(frontend) {
  // Method 0 is Generate: replace the generated handler with one that
  // parses the bytes-typed twin of GenerateRequest.
  MarkMethodCallback(
      0, new grpc::internal::CallbackServerStreamingHandler<pb::wire::GenerateRequestBytes,
                                                            pb::GenerateResponse>(
             [this](grpc::CallbackServerContext* ctx,
                    const pb::wire::GenerateRequestBytes* request) {
               return GenerateBytes(ctx, request);
             }));
}

grpc::ServerWriteReactor<pb::GenerateResponse>* GenerationService::GenerateBytes(
    grpc::CallbackServerContext* ctx, const pb::wire::GenerateRequestBytes* request) {
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
