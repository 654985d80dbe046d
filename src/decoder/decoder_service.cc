// The RPC edge of the decoder: worker.proto messages <-> decoder structs.
#include "decoder/decoder_service.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <span>

#include "common/rpc_server.h"
#include "common/stream_writer.h"
#include "common/token_merge.h"
#include "common/tracing.h"
#include "decoder/decode_mux.h"
#include "decoder/kv_notice.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/attempt_key.h"
#include "worker/engine_params.h"

namespace tandem::decoder {

namespace {

namespace pb = ::tandem::v1;

// The Decode stream: a reactor plus the sink the decoder writes into. The
// sink (shared with the engine's callbacks) outlives the reactor safely:
// StreamWriter drops writes once the stream is finished.
class DecodeReactor final : public grpc::ServerWriteReactor<pb::DecodeResponse> {
 public:
  class Sink final : public DecodeSink {
   public:
    Sink(DecodeReactor* stream, std::string request_id, tracing::SpanContext trace)
        : writer_(stream, &MergeDecodeTokens), request_id_(std::move(request_id)), trace_(trace),
          start_unix_ns_(trace.sampled ? tracing::NowUnixNs() : 0) {}
    void OnTokens(uint32_t first_index, std::span<const uint32_t> token_ids) override {
      pb::DecodeResponse m;
      m.set_request_id(request_id_);
      m.mutable_tokens()->set_first_index(first_index);
      m.mutable_tokens()->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
      writer_.Write(std::move(m));
    }
    void OnFinished(const DecodeResult& r) override {
      pb::DecodeResponse m;
      m.set_request_id(request_id_);
      auto* f = m.mutable_finished();
      f->set_finish_reason(FinishReasonToProto(r.finish_reason));
      f->set_completion_tokens(r.completion_tokens);
      f->set_decoder_cached_prompt_tokens(r.cached_prompt_tokens);
      f->set_prefill_cached_prompt_tokens(r.prefill_cached_prompt_tokens);
      writer_.Write(std::move(m));
      writer_.Finish(grpc::Status::OK);
      if (trace_.sampled && !traced_.exchange(true)) {
        tracing::SpanBuilder("tandem.decode", trace_, tracing::SpanKind::kServer, start_unix_ns_)
            .Attr("tandem.request_id", request_id_)
            .Attr("tandem.completion_tokens", static_cast<int64_t>(r.completion_tokens))
            .Attr("tandem.cached_prompt_tokens", static_cast<int64_t>(r.cached_prompt_tokens))
            .Attr("tandem.prefill_cached_prompt_tokens",
                  static_cast<int64_t>(r.prefill_cached_prompt_tokens))
            .End();
      }
    }
    void OnError(const Status& status) override {
      pb::DecodeResponse m;
      m.set_request_id(request_id_);
      m.mutable_error()->set_code(static_cast<int>(status.code()));
      m.mutable_error()->set_message(status.message());
      writer_.Write(std::move(m));
      writer_.Finish(ToGrpcStatus(status));
      if (trace_.sampled && !traced_.exchange(true)) {
        tracing::SpanBuilder("tandem.decode", trace_, tracing::SpanKind::kServer, start_unix_ns_)
            .Attr("tandem.request_id", request_id_)
            .Error(status.ToString())
            .End();
      }
    }
    StreamWriter<pb::DecodeResponse>& writer() { return writer_; }

   private:
    StreamWriter<pb::DecodeResponse> writer_;
    const std::string request_id_;
    const tracing::SpanContext trace_;  // this decode's span (common/tracing.h)
    const uint64_t start_unix_ns_;
    std::atomic<bool> traced_{false};
  };

  DecodeReactor(Decoder& decoder, const pb::DecodeRequest& req, tracing::SpanContext trace)
      : decoder_(decoder), request_id_(worker::AttemptKey(req.request_id(), req.attempt())),
        sink_(std::make_shared<Sink>(this, req.request_id(), trace)) {
    pb::DecodeResponse first;
    first.set_request_id(req.request_id());
    first.set_registered(true);
    sink_->writer().Write(std::move(first));

    DecodeSpec spec = DecodeSpecFromProto(req);
    Status s = decoder_.Register(std::move(spec), sink_);
    if (!s.ok()) {
      sink_->writer().Abandon(ToGrpcStatus(s));  // `registered` is never sent
      return;
    }
    registered_ = true;
    sink_->writer().Open();  // a cancel before this still reaches OnCancel
  }

  void OnWriteDone(bool ok) override {
    if (!ok && registered_) decoder_.Cancel(request_id_, sink_.get());
    sink_->writer().OnWriteDone(ok);
  }
  void OnCancel() override {
    if (registered_) decoder_.Cancel(request_id_, sink_.get());
    sink_->writer().OnCancel();
  }
  void OnDone() override { delete this; }

 private:
  Decoder& decoder_;
  const std::string request_id_;
  std::shared_ptr<Sink> sink_;
  bool registered_ = false;
};

// Decoder.Reserve's reply. gRPC drops a reply that reaches the client after
// its deadline, and one lost with a broken connection never arrives; the
// decoder reserved all the same, and a live prefiller that never heard of
// the target would leave it quarantined for good once the lease ran out
// (docs/failure-handling.md "Quarantine"). Two checks release such a
// reservation at once, as the prefiller's error notice would:
// - Reply: the call's deadline as this server sees it (the client's
//   timeout counted from the request's arrival here: never before the
//   client's own deadline) passed while reserving. The client has given
//   up (or its timer is late and would still take the target): the call
//   ends DEADLINE_EXCEEDED without the target, which is released.
// - OnDone: IsCancelled, gRPC's final word once the call is over, says the
//   call failed before the server's status reached the client (client
//   cancel, deadline, connection reset): the client never took the target.
// A reply that left before the server learnt of the cancel, then reached
// the client too late or not at all (IsCancelled false), is still the
// lease's and the quarantine's.
// A call waiting for a decode seat (Decoder::ReserveOrWait) is answered
// on the decoder's lease thread; one the client cancels meanwhile is taken
// out of the queue (OnCancel), nothing reserved.
class ReserveReactor final : public grpc::ServerUnaryReactor {
 public:
  // `ctx`, `req` and `resp` are gRPC's, valid until OnDone returns.
  ReserveReactor(Decoder& decoder, grpc::CallbackServerContext* ctx,
                 const pb::ReserveRequest* req, pb::ReserveResponse* resp)
      : decoder_(decoder), ctx_(ctx), req_(req), resp_(resp) {}

  void Start(tracing::SpanContext trace) {
    ticket_.store(ServeReserve(decoder_, *req_, trace, [this](const Result<KvTargetInfo>& target) {
      FillReserveResponse(target, resp_);
      Reply();
    }));
  }

  void OnCancel() override { decoder_.AbandonReserve(ticket_.load()); }

  // Finishes the call with `resp` as FillReserveResponse filled it.
  void Reply() {
    if (resp_->has_target() && std::chrono::system_clock::now() >= ctx_->deadline()) {
      Release("the call's deadline passed before the decoder replied");
      resp_->Clear();
      Finish(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "the deadline passed before the decoder replied; nothing is reserved"));
      return;
    }
    Finish(grpc::Status::OK);
  }

  void OnDone() override {
    if (ctx_->IsCancelled() && resp_->has_target()) {
      Release("the gRPC call ended first (deadline, cancel or broken connection)");
    }
    delete this;
  }

 private:
  void Release(std::string_view why) {
    ReleaseUnreceivedTarget(
        decoder_, resp_->target(),
        UnavailableError(fmt::format("prefiller '{}' never received the reserve reply: {}",
                                     req_->prefiller(), why)));
  }

  Decoder& decoder_;
  grpc::CallbackServerContext* const ctx_;
  const pb::ReserveRequest* const req_;
  pb::ReserveResponse* const resp_;
  std::atomic<uint64_t> ticket_{0};  // while the call waits for a seat
};

class DecoderServiceImpl final : public pb::Decoder::CallbackService {
 public:
  DecoderServiceImpl(Decoder& decoder, kvtransfer::Transport& transport)
      : decoder_(decoder), transport_(transport) {
    transport_.SetNotificationCallback(
        [this](kvtransfer::Notification n) { OnNotification(std::move(n)); });
  }
  ~DecoderServiceImpl() override { transport_.SetNotificationCallback({}); }

  grpc::ServerWriteReactor<pb::DecodeResponse>* Decode(grpc::CallbackServerContext* ctx,
                                                       const pb::DecodeRequest* req) override {
    return new DecodeReactor(decoder_, *req, TraceOf(ctx));
  }

  grpc::ServerBidiReactor<pb::DecodeStreamRequest, pb::DecodeStreamResponse>* DecodeStream(
      grpc::CallbackServerContext*) override {
    return NewDecodeMuxReactor(decoder_);
  }

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* ctx,
                                    const pb::ReserveRequest* req,
                                    pb::ReserveResponse* resp) override {
    // gRPC runs neither OnCancel nor OnDone before this returns.
    auto* reactor = new ReserveReactor(decoder_, ctx, req, resp);
    reactor->Start(TraceOf(ctx));
    return reactor;
  }

  // The caller's W3C trace context (gRPC metadata `traceparent`).
  static tracing::SpanContext TraceOf(grpc::CallbackServerContext* ctx) {
    if (!tracing::Tracer::Get().enabled()) return {};
    auto it = ctx->client_metadata().find("traceparent");
    if (it == ctx->client_metadata().end()) return {};
    return tracing::Tracer::Get().ContinueFrom(std::string_view(it->second.data(), it->second.size()));
  }

  void OnNotification(kvtransfer::Notification n) {
    auto info = ParseKvNotice(n.payload);
    if (!info.ok()) {
      decoder_.OnUnreadableNotice(n.sender, n.payload.size());
      return;
    }
    decoder_.OnKvNotice(*info);
  }

  Decoder& decoder_;
  kvtransfer::Transport& transport_;
};

}  // namespace

uint64_t ServeReserve(Decoder& decoder, const v1::ReserveRequest& req, tracing::SpanContext trace,
                      ReserveAnswer answer, bool* for_registration) {
  const parallel::ParallelLayout prefill_layout{
      .tp = std::max(1u, req.prefill_tensor_parallel()),
      .pp = std::max(1u, req.prefill_pipeline_parallel())};
  const std::span<const uint32_t> prompt(req.prompt_token_ids().data(),
                                         static_cast<size_t>(req.prompt_token_ids().size()));
  const auto wait_until =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(std::min<uint32_t>(req.seat_wait_ms(), kMaxSeatWaitMs));
  if (trace.sampled) {
    // The prefiller's reservation of KV slots here (its span's child),
    // a wait for a decode seat included.
    answer = [answer = std::move(answer), trace, start = tracing::NowUnixNs(),
              prefiller = req.prefiller(),
              prompt_tokens = prompt.size()](const Result<KvTargetInfo>& target) {
      tracing::SpanBuilder b("tandem.decode.reserve", trace, tracing::SpanKind::kServer, start);
      b.Attr("tandem.prefiller", prefiller)
          .Attr("tandem.prompt_tokens", static_cast<int64_t>(prompt_tokens));
      if (target.ok()) {
        b.Attr("tandem.kv.slots", static_cast<int64_t>(target->slots.size()))
            .Attr("tandem.kv.cached_blocks", static_cast<int64_t>(target->cached_blocks));
      } else {
        b.Error(target.status().ToString());
      }
      b.End();
      answer(target);
    };
  }
  return decoder.ReserveOrWait(req.request_id(), req.prefiller(), prompt,
                               req.prefiller_transport_descriptor(), prefill_layout, wait_until,
                               std::move(answer), for_registration);
}

void FillReserveResponse(const Result<KvTargetInfo>& target, v1::ReserveResponse* resp) {
  resp->Clear();
  if (!target.ok()) {
    resp->mutable_error()->set_code(static_cast<int>(target.status().code()));
    resp->mutable_error()->set_message(target.status().message());
    return;
  }
  auto* t = resp->mutable_target();
  t->set_request_id(target->request_id);
  t->set_reservation_id(target->reservation_id);
  t->set_generation(target->generation);
  t->set_transport_descriptor(target->transport_descriptor);
  t->mutable_slots()->Add(target->slots.begin(), target->slots.end());
  t->set_cached_blocks(target->cached_blocks);
  t->set_lease_expiry_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  target->lease_expiry.time_since_epoch())
                                  .count());
  t->set_capability(target->capability);
  t->set_kv_key(target->kv_key);
  t->set_decode_tensor_parallel(target->layout.tp);
  t->set_decode_pipeline_parallel(target->layout.pp);
  for (const auto& d : target->rank_descriptors) t->add_rank_transport_descriptors(d);
}

void ReleaseUnreceivedTarget(Decoder& decoder, const v1::KvTarget& target, const Status& why) {
  KvNoticeInfo n;
  n.request_id = target.request_id();
  n.reservation_id = target.reservation_id();
  n.generation = target.generation();
  n.capability = target.capability();
  n.error = why;
  n.unreceived_reply = true;
  decoder.OnKvNotice(n);
}

std::unique_ptr<grpc::Service> MakeDecoderService(Decoder& decoder,
                                                  kvtransfer::Transport& transport) {
  return std::make_unique<DecoderServiceImpl>(decoder, transport);
}

}  // namespace tandem::decoder
