// The routes of the API (docs/http-api.md) and what a connection answers
// without the lifecycle: /health, /metrics, /v1/models, 404 and 405.
#include <fmt/format.h>

#include "common/tracing.h"
#include "http/http_session.h"

namespace tandem::http::detail {

// "" when a request could be served now; otherwise why not.
std::string Unready(Shared& sh) {
  if (sh.fe->draining()) return "draining";
  bool prefill = false, decode = false, both = false;
  size_t indexed = 0;
  const auto workers = sh.fleet->Workers();
  for (const auto& w : workers) {
    prefill |= w.role == router::WorkerRole::kPrefill;
    decode |= w.role == router::WorkerRole::kDecode;
    both |= w.role == router::WorkerRole::kBoth;
    indexed += w.indexed ? 1 : 0;
  }
  if (!both && !(prefill && decode)) {
    return "starting: no prefill/decode pair (or aggregated worker) has registered yet";
  }
  // Ready means routable with a warm index (issue 21): a (re)started proxy
  // waits until the registered workers' snapshots rebuilt its prefix index.
  if (!sh.warm.load()) {
    if (indexed < workers.size()) {
      return fmt::format("starting: index warming ({} of {} workers' KV snapshots applied)",
                         indexed, workers.size());
    }
    sh.warm.store(true);
  }
  return "";
}

void Session::Serve(const Request& req) {
  std::string_view target(req.target().data(), req.target().size());
  target = target.substr(0, target.find('?'));
  // HEAD is GET without the body (probes such as aiperf's use it).
  head_ = req.method() == bhttp::verb::head;
  const auto method = head_ ? bhttp::verb::get : req.method();
  request_id_header_ = std::string(req["X-Request-Id"]);
  // W3C trace context (read only when tracing is on).
  traceparent_header_.clear();
  if (tracing::Tracer::Get().enabled()) traceparent_header_ = std::string(req["traceparent"]);
  auto only = [&](bhttp::verb v) {
    if (method == v) return true;
    Respond(405, "application/json",
            ErrorBody(405, fmt::format("{} takes {} only", target,
                                       std::string_view(bhttp::to_string(v)))));
    return false;
  };
  if (target == "/health") {
    if (!only(bhttp::verb::get)) return;
    const std::string why = Unready(*sh_);
    if (why.empty()) return Respond(200, "application/json", R"({"status":"ok"})");
    return Respond(503, "application/json", Dump({{"status", why}}));
  }
  if (target == "/metrics") {
    if (!only(bhttp::verb::get)) return;
    return Respond(200, "text/plain; version=0.0.4; charset=utf-8", sh_->metrics->Render());
  }
  const bool v1 = target.rfind("/v1/", 0) == 0;
  const proxy::Tenant* tenant = nullptr;
  if (v1) {
    // proxy::Tenants owns the check (the gRPC front end asks it too).
    const auto h = req[bhttp::field::authorization];
    auto t = sh_->fe->Authenticate(std::string_view(h.data(), h.size()));
    if (!t.ok()) return Respond(401, "application/json", ErrorBody(401, t.status().message()));
    tenant = *t;
  }
  if (target == "/v1/models") {
    if (!only(bhttp::verb::get)) return;
    const auto& lim = sh_->fe->limits();
    nlohmann::json m = {{"id", lim.model},         {"object", "model"},
                        {"created", sh_->started}, {"owned_by", "tandem"},
                        {"root", lim.model},       {"max_model_len", lim.max_model_len}};
    return Respond(200, "application/json",
                   Dump({{"object", "list"}, {"data", nlohmann::json::array({m})}}));
  }
  if (target == "/v1/completions") {
    if (!only(bhttp::verb::post)) return;
    return StartGeneration(Endpoint::kCompletions, req.body(), tenant);
  }
  if (target == "/v1/chat/completions") {
    if (!only(bhttp::verb::post)) return;
    return StartGeneration(Endpoint::kChat, req.body(), tenant);
  }
  Respond(404, "application/json",
          ErrorBody(404, fmt::format("no route {} {}; see docs/http-api.md",
                                     std::string_view(req.method_string().data(),
                                                      req.method_string().size()),
                                     target)));
}

}  // namespace tandem::http::detail
