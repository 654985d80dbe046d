#include "proxy/h2/grpc_calls.h"

#include <fmt/format.h>
#include <google/protobuf/io/coded_stream.h>

#include <algorithm>
#include <cmath>

#include "common/tracing.h"
#include "proxy/generate_convert.h"
#include "proxy/h2/grpc_reflection.h"
#include "proxy/h2/grpc_wire.h"
#include "proxy/h2/h2_connection.h"
#include "proxy/h2/h2_server.h"

namespace tandem::proxy::h2 {
namespace {

namespace pb = ::tandem::v1;

// As generation_service.cc: requests of token ids up to this size are
// parsed and validated on the thread that received them; text prompts and
// larger requests go to the work pool.
constexpr size_t kInlineRequestBytes = 256 << 10;

Frontend& Fe(H2Connection& c) { return *c.server()->frontend(); }

long long RetryAfterSeconds(double seconds) {
  return static_cast<long long>(std::ceil(std::max(seconds, 1.0)));
}

void ReleaseSlot(Frontend& fe, H2Stream& s) {
  if (s.admitted && !s.released.exchange(true)) fe.Release();
}

void CountRejected(Frontend& fe, const Status& st) {
  if (auto* m = fe.deps().metrics) {
    m->CountOutcome(st.code() == StatusCode::kResourceExhausted ? "rejected" : "invalid");
  }
}

// Authentication, draining, the tenant's request rate, in the gRPC front
// end's order; `*retry_after_s` set on a rate refusal.
Status Authorize(Frontend& fe, H2Stream& s, long long* retry_after_s) {
  auto t = fe.Authenticate(s.authorization);
  if (!t.ok()) return t.status();
  s.tenant = *t;
  if (fe.draining()) return UnavailableError("the fleet is draining");
  RateRefusal r = fe.ChargeRequest(s.tenant);
  if (!r.status.ok()) *retry_after_s = RetryAfterSeconds(r.retry_after_seconds);
  return r.status;
}

// On the event thread or a work-pool thread: starts the lifecycle unless
// the stream is gone.
void Validated(const std::shared_ptr<H2Connection>& conn, const std::shared_ptr<H2Stream>& s,
               Result<ValidatedRequest> v, double retry_after,
               std::chrono::steady_clock::time_point arrival) {
  Frontend& fe = Fe(*conn);
  if (!v.ok()) {
    CountRejected(fe, v.status());
    ReleaseSlot(fe, *s);
    conn->PostStatus(s, v.status(), retry_after > 0 ? RetryAfterSeconds(retry_after) : 0);
    return;
  }
  s->request_id = v->client_request_id;
  ResponseSink sink;
  // The stream's messages are kept as fields and encoded when the session
  // takes them (H2Connection::PostDelta/PostFinal): no GenerateResponse per
  // token. The per-token callback captures the stream only (its `conn` is
  // the connection's weak pointer): ResponseSink::on_delta keeps it inline
  // (an InlineFunction: std::function put this non-trivially-copyable
  // capture in a heap block), so a delta touches no separate heap block
  // (issue 23).
  sink.on_delta = [s](std::span<const uint32_t> ids, std::string_view text) {
    if (auto c = s->conn.lock()) c->PostDelta(s, ids, text);
  };
  // What it reads first: the stream's connection, then its outbox (the
  // decode stream's reader prefetches both with the batch: issue 23).
  const auto* outbox = reinterpret_cast<const char*>(&s->delta_queued);
  const auto* outbox_end = reinterpret_cast<const char*>(&s->dirty + 1);
  sink.hot[0] = {&s->conn, sizeof(s->conn)};
  sink.hot[1] = {outbox, static_cast<uint32_t>(outbox_end - outbox)};
  sink.on_finish = [s, fe = &fe](Finish reason, Usage usage) {
    // The slot is free before the client can see the end of its stream.
    ReleaseSlot(*fe, *s);
    auto c = s->conn.lock();
    if (!c) return;
    c->PostFinal(s, FinishToProto(reason), usage.prompt_tokens, usage.completion_tokens,
                 usage.cached_prompt_tokens);
  };
  sink.on_error = [s, fe = &fe](Status st) {
    ReleaseSlot(*fe, *s);
    if (auto c = s->conn.lock()) c->PostStatus(s, st);
  };
  std::lock_guard lock(s->call_mu);
  if (s->call_closed) {  // the client went away while it was validated
    ReleaseSlot(fe, *s);
    return;
  }
  s->lifecycle =
      RequestLifecycle::Start(fe.deps(), std::move(v).value(), std::move(sink),
                              SystemDeadlineOf(s->deadline, std::chrono::steady_clock::now(),
                                               std::chrono::system_clock::now()),
                              arrival);
}

void Generate(H2Connection& c, const std::shared_ptr<H2Stream>& s) {
  const auto arrival = std::chrono::steady_clock::now();
  Frontend& fe = Fe(c);
  long long retry = 0;
  Status st = Authorize(fe, *s, &retry);
  if (st.ok()) {
    st = fe.Admit();
    if (!st.ok()) retry = 1;
  }
  if (!st.ok()) {
    CountRejected(fe, st);
    c.PostStatus(s, st, retry);
    return;
  }
  s->admitted = true;
  std::string traceparent;
  if (tracing::Tracer::Get().enabled()) traceparent = s->traceparent;
  auto conn = c.shared_from_this();
  auto req = std::make_shared<GenerateRequestParts>();
  if (s->body.size() <= kInlineRequestBytes) {
    // The body moves into the request: its prompt's bytes may go to the
    // workers as they came (GenerateRequestParts::prompt_varints).
    Status parsed = ParseGenerateRequest(std::move(s->body), *req);
    if (!parsed.ok() || req->rest.prompt().empty()) {
      double retry_after = 0;
      auto v = PrepareGenerate(fe, parsed, *req, s->tenant, traceparent, &retry_after);
      Validated(conn, s, std::move(v), retry_after, arrival);
      return;
    }
  } else {
    req.reset();
  }
  // A text prompt (tokenized) or a large request: on the work pool.
  fe.work().Submit([conn, s, req = std::move(req), arrival,
                    traceparent = std::move(traceparent)]() mutable {
    Frontend& f = Fe(*conn);
    Status parsed = Status::Ok();
    if (!req) {
      req = std::make_shared<GenerateRequestParts>();
      parsed = ParseGenerateRequest(std::move(s->body), *req);
    }
    double retry_after = 0;
    auto v = PrepareGenerate(f, parsed, *req, s->tenant, traceparent, &retry_after);
    Validated(conn, s, std::move(v), retry_after, arrival);
  });
}

void ListModels(H2Connection& c, const std::shared_ptr<H2Stream>& s) {
  Frontend& fe = Fe(c);
  pb::ListModelsRequest req;
  if (!req.ParseFromString(s->body)) {
    c.PostStatus(s, InvalidArgumentError("the request is not a valid tandem.v1.ListModelsRequest"));
    return;
  }
  pb::ListModelsResponse resp;
  auto* m = resp.add_models();
  m->set_id(fe.limits().model);
  m->set_max_model_len(fe.limits().max_model_len);
  m->set_vocab_size(fe.limits().vocab_size);
  m->set_block_size(fe.deps().block_size);
  c.PostUnary(s, resp.SerializeAsString());
}

// grpc.health.v1 Check and Watch: HealthCheckRequest { string service = 1; },
// HealthCheckResponse { ServingStatus status = 1; } (SERVING 1,
// NOT_SERVING 2), read and written by hand (no generated code for them
// here). The overall status ("") is the only service, as with gRPC's
// default health service.
void HealthCheck(H2Connection& c, const std::shared_ptr<H2Stream>& s, bool watch) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(s->body.data()),
                                            static_cast<int>(s->body.size()));
  std::string service;
  for (uint32_t tag; (tag = in.ReadTag()) != 0;) {
    if (tag == ((1 << 3) | 2)) {
      if (!in.ReadString(&service, 1 << 16)) tag = 0;
    } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) {
      tag = 0;
    }
    if (tag == 0) {
      c.PostStatus(s, InvalidArgumentError("the request is not a valid grpc.health.v1.HealthCheckRequest"));
      return;
    }
  }
  if (watch) {
    // Watch: the status now and at every change; an unknown service is
    // SERVICE_UNKNOWN (3) in the stream, as the health protocol says.
    if (!service.empty()) {
      c.PostStreamed(s, std::string{'\x08', '\x03'});
      return;
    }
    c.server()->AddWatcher(c.shared_from_this(), s);
    c.PostStreamed(s, std::string{'\x08', static_cast<char>(c.server()->serving() ? 1 : 2)});
    return;
  }
  if (!service.empty()) {
    c.PostStatus(s, NotFoundError(fmt::format("unknown service '{}'", service)));
    return;
  }
  const char status = c.server()->serving() ? 1 : 2;
  c.PostUnary(s, std::string{'\x08', status});
}

bool IsGrpcContentType(const std::string& ct) {
  constexpr std::string_view kGrpc = "application/grpc";
  if (ct.compare(0, kGrpc.size(), kGrpc) != 0) return false;
  return ct.size() == kGrpc.size() || ct[kGrpc.size()] == '+' || ct[kGrpc.size()] == ';';
}

}  // namespace

void OnRequestHeaders(H2Connection& c, const std::shared_ptr<H2Stream>& s) {
  if (s->method != "POST") {
    c.PostStatus(s, UnimplementedError(fmt::format("gRPC calls are POST, not {}", s->method)), 0,
                 405);
    return;
  }
  if (!IsGrpcContentType(s->content_type)) {
    c.PostStatus(s,
                 InvalidArgumentError(fmt::format(
                     "content-type '{}' is not application/grpc", s->content_type)),
                 0, 415);
    return;
  }
  if (!s->grpc_timeout.empty()) {
    auto t = ParseGrpcTimeout(s->grpc_timeout);
    if (!t) {
      c.PostStatus(s, InvalidArgumentError(fmt::format(
                          "grpc-timeout '{}' is malformed (1-8 digits and one of H M S m u n)",
                          s->grpc_timeout)));
      return;
    }
    // A deadline past what the clock holds is none (gRPC: infinite).
    const auto now = std::chrono::steady_clock::now();
    if (*t < std::chrono::steady_clock::time_point::max() - now) {
      s->deadline = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(*t);
      c.server()->AddDeadline(c.shared_from_this(), s);
    }
  }
  static const std::pair<std::string_view, Method> kMethods[] = {
      {"/tandem.v1.Generation/Generate", Method::kGenerate},
      {"/tandem.v1.Generation/ListModels", Method::kListModels},
      {"/grpc.health.v1.Health/Check", Method::kHealthCheck},
      {"/grpc.health.v1.Health/Watch", Method::kHealthWatch},
      {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Method::kReflection},
  };
  for (const auto& [path, kind] : kMethods) {
    if (s->path == path) s->kind = kind;
  }
  if (s->kind == Method::kUnknown) {
    c.PostStatus(s, UnimplementedError(fmt::format("unknown method {}", s->path)));
  }
}

void OnMessagePrefix(H2Connection& c, const std::shared_ptr<H2Stream>& s) {
  const MessagePrefix p = ReadMessagePrefix(s->prefix);
  s->msg_len = p.length;
  if (p.compressed) {
    c.PostStatus(s, UnimplementedError(
                        "compressed messages are not supported: send without grpc-encoding"));
    return;
  }
  Frontend& fe = Fe(c);
  if (p.length > fe.limits().max_request_bytes) {
    // As the gRPC front end: who is asking, and within its rate, first.
    long long retry = 0;
    Status st = s->kind == Method::kGenerate ? Authorize(fe, *s, &retry) : Status::Ok();
    if (st.ok()) st = RequestTooLarge(fe, p.length);
    CountRejected(fe, st);
    c.PostStatus(s, st, retry);
    return;
  }
  s->body.reserve(p.length);
}

void OnStreamMessage(H2Connection& c, const std::shared_ptr<H2Stream>& s) {
  c.PostStreamed(s, AnswerReflection(s->body));
}

void OnRequestComplete(H2Connection& c, const std::shared_ptr<H2Stream>& s) {
  if (s->answered) return;
  if (s->kind == Method::kReflection) {
    // Every message was answered as it came; a message left unfinished is
    // the client's error.
    if (s->prefix_got > 0) {
      c.PostStatus(s, InvalidArgumentError(fmt::format(
                          "the request ended inside its gRPC message ({} of {} bytes)",
                          s->body.size(), s->msg_len)));
    } else {
      c.PostStatus(s, Status::Ok());
    }
    return;
  }
  if (s->prefix_got < 5) {
    c.PostStatus(s, InvalidArgumentError("the request carries no gRPC message"));
    return;
  }
  if (s->body.size() < s->msg_len) {
    c.PostStatus(s, InvalidArgumentError(fmt::format(
                        "the request ended inside its gRPC message ({} of {} bytes)",
                        s->body.size(), s->msg_len)));
    return;
  }
  if (s->extra_bytes > 0) {
    c.PostStatus(s, InvalidArgumentError(
                        "the request carries more than one message; this method takes one"));
    return;
  }
  switch (s->kind) {
    case Method::kGenerate: Generate(c, s); break;
    case Method::kListModels: ListModels(c, s); break;
    case Method::kHealthCheck: HealthCheck(c, s, /*watch=*/false); break;
    case Method::kHealthWatch: HealthCheck(c, s, /*watch=*/true); break;
    default: c.PostStatus(s, UnimplementedError(fmt::format("unknown method {}", s->path)));
  }
}

void OnStreamClosed(H2Stream& s, Frontend& fe) {
  std::shared_ptr<RequestLifecycle> lc;
  {
    std::lock_guard lock(s.call_mu);
    s.call_closed = true;
    lc = std::move(s.lifecycle);
  }
  if (lc) lc->Cancel();  // no-op when it finished
  ReleaseSlot(fe, s);
}

void AbortCall(H2Connection& c, const std::shared_ptr<H2Stream>& s, const Status& st) {
  OnStreamClosed(*s, Fe(c));
  c.PostStatus(s, st);
}

}  // namespace tandem::proxy::h2
