// Decoder.DecodeStream: requests in, one batch per delivery out.
#include "decoder/decode_mux.h"

#include <fmt/format.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/delivery_scope.h"
#include "common/tracing.h"
#include "common/wire_ids.h"
#include "decoder/decode_mux_batch.h"
#include "worker/attempt_key.h"
#include "worker/engine_params.h"

namespace tandem::decoder {

namespace pb = ::tandem::v1;

DecodeSpec DecodeSpecFromProto(const pb::DecodeRequest& req) {
  DecodeSpec spec;
  // Registered under the attempt's key (worker/attempt_key.h); the
  // prefiller reserves and notifies under the same key.
  spec.request_id = worker::AttemptKey(req.request_id(), req.attempt());
  // Either encoding (common/wire_ids.h): a proxy of this version sends fixed32.
  const std::span<const uint32_t> prompt = PromptIdsOf(req);
  spec.prompt_ids.assign(prompt.begin(), prompt.end());
  if (req.prompt_length() != 0 || req.prompt_digest() != 0) {
    spec.prompt_ref = DecodeSpec::PromptRef{req.prompt_length(), req.prompt_digest()};
  }
  spec.sampling = worker::ToSampling(req.params());
  if (req.deadline_unix_ms() > 0) {
    spec.deadline =
        std::chrono::system_clock::time_point(std::chrono::milliseconds(req.deadline_unix_ms()));
  }
  spec.prefill_locally = req.prefill_locally();
  spec.first_sample_index = req.params().first_sample_index();
  spec.cache_salt = req.tenant_salt();
  spec.priority = req.priority();
  spec.tenant = req.tenant();
  spec.tenant_weight = req.tenant_weight() > 0 ? req.tenant_weight() : 1.0;
  return spec;
}

pb::FinishReason FinishReasonToProto(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop: return pb::FINISH_REASON_STOP;
    case engine::FinishReason::kLength: return pb::FINISH_REASON_LENGTH;
    default: return pb::FINISH_REASON_UNSPECIFIED;
  }
}

using Reactor = grpc::ServerBidiReactor<pb::DecodeStreamRequest, pb::DecodeStreamResponse>;

namespace {

// One request on the stream. Its fields are guarded by the state's mutex.
class MuxSink final : public DecodeSink {
 public:
  MuxSink(std::shared_ptr<MuxState> state, uint64_t handle, std::string request_id,
          tracing::SpanContext trace, bool fold_registered, bool quiet_first)
      : handle_(handle),
        fold_registered_(fold_registered),
        quiet_first_(quiet_first),
        state_(std::move(state)),
        request_id_(std::move(request_id)),
        trace_(trace),
        start_unix_ns_(trace.sampled ? tracing::NowUnixNs() : 0) {}

  void OnTokens(uint32_t first_index, std::span<const uint32_t> token_ids) override;
  void OnFinished(const DecodeResult& r) override;
  void OnError(const Status& status) override;

  // An event that came before Register returned (a local prefill's first
  // token can): kept until the `registered` item is in the batch.
  struct Early {
    uint32_t first_index = 0;
    std::vector<uint32_t> token_ids;
    bool end = false;
    std::optional<pb::DecodeFinished> finished;  // with end: finished, else error
    Status status;
  };

  const uint64_t handle_;
  // DecodeStreamStart.registered_with_first_item: `registered` goes with
  // the request's first item instead of alone (registered_due_ until then).
  const bool fold_registered_;
  // DecodeStreamStart.quiet_end_on_first_token: ending on the first token
  // (the prefiller's) with that token's item still unsent, nothing is sent.
  const bool quiet_first_;
  bool registered_due_ = false;
  bool open_ = false;    // registered (its item in the batch, or due)
  bool closed_ = false;  // ended, cancelled, or the stream is over
  std::vector<Early> early_;

 private:
  void Trace(const std::string& error, uint32_t completion, uint32_t cached, uint32_t prefill_cached);

  std::shared_ptr<MuxState> state_;
  const std::string request_id_;
  const tracing::SpanContext trace_;
  const uint64_t start_unix_ns_;
};

struct Registration {
  std::string key;  // the Decoder's request id (attempt key)
  std::shared_ptr<MuxSink> sink;
};

}  // namespace

// What the session, the sinks and the delivery scopes share. The output
// is used only until Finish has been called on it. It holds nothing of the
// Decoder but its stream tally: a step's batch may be flushed (at the end
// of the engine's delivery, or when a write is done) after Decoder::Stop.
class MuxState final : public Flushable, public std::enable_shared_from_this<MuxState> {
 public:
  MuxState(MuxOutput* out, std::shared_ptr<MuxOutput> keep, std::shared_ptr<StreamTally> tally)
      : out_(out), keep_(std::move(keep)), tally_(std::move(tally)) {}

  // ---- from the sinks (engine thread, KV notice and lease threads) ----
  void Tokens(MuxSink& s, uint32_t first_index, std::span<const uint32_t> ids) {
    std::unique_lock lock(mu_);
    if (final_ || s.closed_) return;
    if (!s.open_) {
      s.early_.push_back({first_index, std::vector<uint32_t>(ids.begin(), ids.end()), false,
                          std::nullopt, Status::Ok()});
      return;
    }
    RegisteredIfDue(s);
    pending_.Tokens(s.handle_, first_index, ids);
    Schedule(lock);
  }
  void End(MuxSink& s, std::optional<pb::DecodeFinished> finished, const Status& status) {
    std::unique_lock lock(mu_);
    if (final_ || s.closed_) return;
    if (!s.open_) {
      s.early_.push_back({0, {}, true, std::move(finished), status});
      return;
    }
    EndLocked(s, finished, status);
    Schedule(lock);
  }

  // ---- from the reactor ----
  // Takes a handle for a request about to be registered; false (and an
  // error item) when the handle is in use, or when the stream is over.
  bool Claim(uint64_t handle, Registration reg) {
    std::unique_lock lock(mu_);
    if (final_) return false;
    if (handle == 0 || live_.count(handle) > 0) {
      pending_.Error(handle, InvalidArgumentError(fmt::format(
                                 "decode stream handle {} is {}", handle,
                                 handle == 0 ? "reserved" : "already in use on this stream")));
      Schedule(lock);
      return false;
    }
    live_.emplace(handle, std::move(reg));
    return true;
  }
  // Register refused the request: its error goes in band.
  void Refused(MuxSink& s, const Status& status) {
    std::unique_lock lock(mu_);
    live_.erase(s.handle_);
    if (final_ || s.closed_) return;
    s.closed_ = true;
    pending_.Error(s.handle_, status);
    Schedule(lock);
  }
  // Register accepted it: `registered`, then what came meanwhile. False
  // when the stream ended meanwhile (the caller cancels the registration).
  bool Opened(MuxSink& s) {
    std::unique_lock lock(mu_);
    if (final_) return false;
    s.open_ = true;
    if (s.closed_) return true;  // cancelled by the proxy meanwhile
    if (s.fold_registered_ && s.early_.empty()) {
      s.registered_due_ = true;  // with the request's first item
      return true;
    }
    pending_.Registered(s.handle_);
    for (auto& e : s.early_) {
      if (e.end) {
        EndLocked(s, e.finished, e.status);
        break;
      }
      pending_.Tokens(s.handle_, e.first_index, e.token_ids);
    }
    s.early_.clear();
    Schedule(lock);
    return true;
  }
  // The proxy cancelled `handle`: the registration to cancel, if live.
  std::optional<Registration> Cancelled(uint64_t handle) {
    std::lock_guard lock(mu_);
    auto it = live_.find(handle);
    if (it == live_.end()) return std::nullopt;
    Registration reg = std::move(it->second);
    live_.erase(it);
    reg.sink->closed_ = true;
    return reg;
  }
  // The stream is over: nothing more is sent; the registrations still on
  // it, to cancel. Idempotent.
  std::vector<Registration> Close() {
    std::unique_lock lock(mu_);
    final_ = true;
    pending_.Clear();
    std::vector<Registration> regs;
    regs.reserve(live_.size());
    for (auto& [h, reg] : live_) {
      reg.sink->closed_ = true;
      regs.push_back(std::move(reg));
    }
    live_.clear();
    Pump(lock);
    return regs;
  }
  void OnWriteDone(bool ok) {
    std::unique_lock lock(mu_);
    writing_ = false;
    Pump(lock);
    (void)ok;  // a failed write: the reactor closes the stream
  }

  void FlushDeferred() override {
    std::unique_lock lock(mu_);
    deferred_ = false;
    Pump(lock);
  }

 private:
  void EndLocked(MuxSink& s, const std::optional<pb::DecodeFinished>& finished,
                 const Status& status) {
    // The quiet end: the proxy ended the request on the prefiller's reply
    // and forgot the handle; the first token's item (and a folded
    // `registered` in it) would reach nobody. Only while that item is
    // still in the batch being built (AddPrefilled delivers the token and
    // the end together); once sent, the end follows it as usual.
    if (finished && s.quiet_first_ && finished->completion_tokens() == 1 &&
        pending_.DropFirstTokenItem(s.handle_)) {
      s.closed_ = true;
      live_.erase(s.handle_);
      return;
    }
    RegisteredIfDue(s);
    s.closed_ = true;
    if (finished) {
      pending_.Finished(s.handle_, *finished);
    } else {
      pending_.Error(s.handle_, status);
    }
    live_.erase(s.handle_);
  }
  // A folded `registered` goes first in the request's first item.
  void RegisteredIfDue(MuxSink& s) {
    if (!s.registered_due_) return;
    s.registered_due_ = false;
    pending_.Registered(s.handle_);
  }
  // Sends the batch at the end of this thread's delivery (one message per
  // step), or now outside a delivery.
  void Schedule(std::unique_lock<std::mutex>& lock) {
    if (deferred_) return;  // a scope (of this or another thread) flushes it
    if (DeliveryScope::Defer(shared_from_this())) {
      deferred_ = true;
      return;
    }
    Pump(lock);
  }
  // Starts the next write (written inline when the output can: then the
  // next batch follows at once), or Finish once the stream is over and idle.
  void Pump(std::unique_lock<std::mutex>& lock) {
    while (!writing_ && !finish_called_) {
      if (!pending_.empty()) {
        pending_.TakeInto(&current_);
        writing_ = true;
        tally_->Count(static_cast<size_t>(current_.items_size()));
        lock.unlock();
        if (!out_->Write(current_)) return;  // OnWriteDone follows
        lock.lock();
        writing_ = false;
        continue;
      }
      if (final_) {
        finish_called_ = true;
        lock.unlock();
        out_->EndStream();
      }
      return;
    }
  }

  MuxOutput* const out_;
  const std::shared_ptr<MuxOutput> keep_;
  const std::shared_ptr<StreamTally> tally_;
  std::mutex mu_;
  MuxBatcher pending_;                              // guarded by mu_
  pb::DecodeStreamResponse current_;                // the batch being written
  std::unordered_map<uint64_t, Registration> live_;  // guarded by mu_
  bool writing_ = false;                             // guarded by mu_
  bool deferred_ = false;                            // guarded by mu_
  bool final_ = false;                               // guarded by mu_
  bool finish_called_ = false;                       // guarded by mu_
};

namespace {

void MuxSink::OnTokens(uint32_t first_index, std::span<const uint32_t> token_ids) {
  state_->Tokens(*this, first_index, token_ids);
}

void MuxSink::OnFinished(const DecodeResult& r) {
  pb::DecodeFinished f;
  f.set_finish_reason(FinishReasonToProto(r.finish_reason));
  f.set_completion_tokens(r.completion_tokens);
  f.set_decoder_cached_prompt_tokens(r.cached_prompt_tokens);
  f.set_prefill_cached_prompt_tokens(r.prefill_cached_prompt_tokens);
  state_->End(*this, std::move(f), Status::Ok());
  if (trace_.sampled) {
    Trace("", r.completion_tokens, r.cached_prompt_tokens, r.prefill_cached_prompt_tokens);
  }
}

void MuxSink::OnError(const Status& status) {
  state_->End(*this, std::nullopt, status);
  if (trace_.sampled) Trace(status.ToString(), 0, 0, 0);
}

void MuxSink::Trace(const std::string& error, uint32_t completion, uint32_t cached,
                    uint32_t prefill_cached) {
  tracing::SpanBuilder b("tandem.decode", trace_, tracing::SpanKind::kServer, start_unix_ns_);
  b.Attr("tandem.request_id", request_id_).Attr("tandem.decode_stream", true);
  if (error.empty()) {
    b.Attr("tandem.completion_tokens", static_cast<int64_t>(completion))
        .Attr("tandem.cached_prompt_tokens", static_cast<int64_t>(cached))
        .Attr("tandem.prefill_cached_prompt_tokens", static_cast<int64_t>(prefill_cached));
  } else {
    b.Error(error);
  }
  b.End();
}

tracing::SpanContext TraceOf(const std::string& traceparent) {
  if (traceparent.empty() || !tracing::Tracer::Get().enabled()) return {};
  return tracing::Tracer::Get().ContinueFrom(traceparent);
}

class DecodeMuxReactor final : public Reactor, public MuxOutput {
 public:
  explicit DecodeMuxReactor(Decoder& decoder) : session_(decoder, this) { StartRead(&req_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the proxy closed its side, or the stream broke
      session_.Close();
      return;
    }
    session_.OnRequest(req_);
    StartRead(&req_);
  }
  void OnWriteDone(bool ok) override {
    session_.OnWriteDone(ok);
    if (!ok) session_.Close();  // the proxy is gone
  }
  void OnCancel() override { session_.Close(); }
  void OnDone() override {
    session_.Close();
    delete this;
  }

  // ---- MuxOutput ----
  bool Write(const pb::DecodeStreamResponse& batch) override {
    StartWrite(&batch);
    return false;
  }
  void EndStream() override { Finish(grpc::Status::OK); }

 private:
  MuxSession session_;
  pb::DecodeStreamRequest req_;
};

}  // namespace

Reactor* NewDecodeMuxReactor(Decoder& decoder) { return new DecodeMuxReactor(decoder); }

MuxSession::MuxSession(Decoder& decoder, MuxOutput* out, std::shared_ptr<MuxOutput> keep)
    : decoder_(decoder),
      state_(std::make_shared<MuxState>(out, std::move(keep), decoder.stream_tally())) {}

void MuxSession::OnRequest(const pb::DecodeStreamRequest& req) {
  if (req.has_start()) {
    Start(req.start());
  } else if (req.kind_case() == pb::DecodeStreamRequest::kCancel) {
    if (auto reg = state_->Cancelled(req.cancel())) decoder_.Cancel(reg->key, reg->sink.get());
  }
}

void MuxSession::OnWriteDone(bool ok) { state_->OnWriteDone(ok); }

void MuxSession::Close() {
  for (auto& reg : state_->Close()) decoder_.Cancel(reg.key, reg.sink.get());
}

void MuxSession::Start(const pb::DecodeStreamStart& start) {
  DecodeSpec spec = DecodeSpecFromProto(start.request());
  const std::string key = spec.request_id;
  auto sink = std::make_shared<MuxSink>(
      state_, start.handle(), start.request().request_id(), TraceOf(start.traceparent()),
      start.registered_with_first_item(), start.quiet_end_on_first_token());
  if (!state_->Claim(start.handle(), Registration{key, sink})) return;
  Status s = decoder_.Register(std::move(spec), sink);
  if (!s.ok()) {
    state_->Refused(*sink, s);
    return;
  }
  // The stream ended while it registered: nobody will read its tokens.
  if (!state_->Opened(*sink)) decoder_.Cancel(key, sink.get());
}

}  // namespace tandem::decoder
