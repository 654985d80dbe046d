// /v1/completions and /v1/chat/completions on a connection: admission,
// parsing and tokenization on the work pool, the request lifecycle, and its
// answer as one JSON body or as server-sent events (http_session.h).
#include <fmt/format.h>

#include <ctime>
#include <vector>

#include "common/tracing.h"
#include "http/http_session.h"

namespace tandem::http::detail {

void Session::CountOutcome(const Status& st) {
  if (auto* m = sh_->fe->deps().metrics) {
    m->CountOutcome(st.code() == StatusCode::kResourceExhausted ? "rejected" : "invalid");
  }
}

// Before the lifecycle starts: gives back the admission slot, if taken.
void Session::Refuse(const OpenAiRequest* r, const Status& st) {
  if (admitted_ && !active_) {
    sh_->fe->Release();
    admitted_ = false;
  }
  CountOutcome(st);
  const int code = HttpStatus(st.code());
  Respond(code, "application/json",
          ErrorBody(code, r ? ToOpenAiMessage(*r, st.message()) : st.message()));
}

// What the work pool hands back: the parsed request and its validation.
struct Session::Prepared {
  Endpoint endpoint = Endpoint::kCompletions;
  Status error;         // parse, chat template or validation; ok otherwise
  bool parsed = false;  // `request` holds the parsed request
  OpenAiRequest request;
  std::optional<proxy::ValidatedRequest> validated;
  double retry_after = 0;
};

// On a work-pool thread: JSON, chat template, tokenization, validation.
Session::Prepared Session::Prepare(Shared* sh, Endpoint ep, const std::string& body,
                                   const proxy::Tenant* tenant, const std::string& request_id) {
  Prepared p;
  p.endpoint = ep;
  auto parsed = ParseRequest(ep, body);
  if (!parsed.ok()) {
    p.error = parsed.status();
    return p;
  }
  p.parsed = true;
  p.request = std::move(parsed).value();
  OpenAiRequest& r = p.request;
  if (ep == Endpoint::kChat) {
    if (!sh->chat) {
      p.error = InvalidArgumentError("messages: " + sh->chat_error);
      return p;
    }
    auto text = sh->chat->Render(r.messages);
    if (!text.ok()) {
      p.error = text.status();
      return p;
    }
    r.request.prompt_token_ids = sh->fe->deps().tokenizer->Encode(*text, false);
  }
  r.request.request_id = request_id;
  auto v = sh->fe->Validate(r.request, tenant, &p.retry_after);
  if (!v.ok()) {
    p.error = v.status();
    return p;
  }
  p.validated = std::move(v).value();
  return p;
}

void Session::StartGeneration(Endpoint ep, const std::string& body, const proxy::Tenant* tenant) {
  // TTFT and e2e count from here (the body is read): parsing, the chat
  // template and tokenization included.
  const auto arrival = std::chrono::steady_clock::now();
  // Nothing is parsed or tokenized before the caller is within its rate
  // and admitted (the body's size is bounded by the parser already).
  if (sh_->fe->draining()) {
    return Refuse(nullptr, UnavailableError("the proxy is draining; send new requests elsewhere"));
  }
  if (proxy::RateRefusal r = sh_->fe->ChargeRequest(tenant); !r.status.ok()) {
    retry_after_seconds_ = r.retry_after_seconds;
    return Refuse(nullptr, r.status);
  }
  if (Status st = sh_->fe->Admit(); !st.ok()) return Refuse(nullptr, st);
  admitted_ = true;
  // The work runs on the proxy's work pool, off this I/O thread; the
  // result comes back to this connection's strand (busy_ stays set, so
  // pipelined requests wait their turn).
  sh_->jobs.fetch_add(1);
  sh_->fe->work().Submit([self = shared_from_this(), sh = sh_, ex = socket_.get_executor(), ep,
                          body, tenant, id = request_id_header_, arrival,
                          traceparent = traceparent_header_] {
    Prepared p = Prepare(sh, ep, body, tenant, id);
    if (p.validated) p.validated->trace = tracing::Tracer::Get().StartRequest(traceparent);
    net::post(ex, [self, p = std::move(p), arrival]() mutable {
      self->OnPrepared(std::move(p), arrival);
    });
    sh->jobs.fetch_sub(1);
  });
}

void Session::OnPrepared(Prepared p, std::chrono::steady_clock::time_point arrival) {
  if (gone_) {  // the client left meanwhile
    if (admitted_) sh_->fe->Release();
    admitted_ = false;
    return;
  }
  if (!p.error.ok()) {
    retry_after_seconds_ = p.retry_after;
    return Refuse(p.parsed ? &p.request : nullptr, p.error);
  }
  OpenAiRequest& r = p.request;
  proxy::ValidatedRequest* v = &*p.validated;
  const Endpoint ep = p.endpoint;

  active_ = true;
  stream_ = r.stream;
  include_usage_ = r.include_usage;
  meta_.endpoint = ep;
  meta_.id = (ep == Endpoint::kChat ? "chatcmpl-" : "cmpl-") + v->client_request_id;
  meta_.created = static_cast<int64_t>(std::time(nullptr));
  meta_.model = v->model;
  openai_req_ = std::move(r);

  // The response head goes out with the first event (an error before it
  // is answered with its own status).
  outbox_->BeginGeneration(
      stream_,
      fmt::format("HTTP/1.1 200 OK\r\nServer: tandem\r\nContent-Type: text/event-stream\r\n"
                  "Cache-Control: no-cache\r\nX-Request-Id: {}\r\nTransfer-Encoding: "
                  "chunked\r\n{}\r\n",
                  meta_.id, keep_alive_ ? "" : "Connection: close\r\n"),
      stream_ ? SseEncoder(meta_, include_usage_) : SseEncoder());

  std::weak_ptr<Session> w = weak_from_this();
  auto ex = socket_.get_executor();
  proxy::ResponseSink sink;
  // A token goes to the socket from the thread that delivers it (no
  // hand-off to the strand; http_outbox.h).
  sink.on_delta = [out = outbox_](std::span<const uint32_t>, std::string_view text) {
    out->Delta(text);
  };
  sink.on_finish = [w, ex](proxy::Finish reason, proxy::Usage usage) {
    net::post(ex, [w, reason, usage] {
      if (auto s = w.lock()) s->OnFinish(reason, usage);
    });
  };
  sink.on_error = [w, ex](Status st) {
    net::post(ex, [w, st = std::move(st)] {
      if (auto s = w.lock()) s->OnError(st);
    });
  };
  auto lc = proxy::RequestLifecycle::Start(sh_->fe->deps(), std::move(*v), std::move(sink),
                                           std::chrono::system_clock::time_point::max(), arrival);
  {
    std::lock_guard lock(lc_mu_);
    lc_ = std::move(lc);
  }
  bool stopping;
  {
    std::lock_guard lock(sh_->mu);
    stopping = sh_->stopping;
  }
  if (stopping) CancelLifecycle();
}

void Session::OnFinish(proxy::Finish reason, proxy::Usage usage) {
  if (gone_ || !active_) return;
  EndGeneration();
  if (!stream_) {
    return Respond(200, "application/json",
                   FullResponse(meta_, outbox_->TakeText(), reason, usage));
  }
  outbox_->EndStream(Chunk(StreamEnd(meta_, reason, usage, include_usage_)) + "0\r\n\r\n");
  Finished();
}

void Session::OnError(const Status& st) {
  if (gone_ || !active_) return;
  EndGeneration();
  const int code = HttpStatus(st.code());
  const std::string msg = ToOpenAiMessage(openai_req_, st.message());
  if (stream_ && outbox_->HeadSent()) {
    Enqueue(Chunk(StreamError(code, msg)) + "0\r\n\r\n");
    return Finished();
  }
  Respond(code, "application/json", ErrorBody(code, msg));
}

void Session::EndGeneration() {
  {
    std::lock_guard lock(lc_mu_);
    lc_.reset();
  }
  if (admitted_) sh_->fe->Release();
  admitted_ = false;
  active_ = false;
}

}  // namespace tandem::http::detail
