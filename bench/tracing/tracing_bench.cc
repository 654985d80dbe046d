// The cost of tracing on the request path (docs/observability.md), off and
// on: the per-request hooks of the proxy (front end + lifecycle: the
// sampling decision, then one `if (ctx.sampled)` per hook) and, when on,
// building and queueing the proxy's four spans of one request. The
// exporter here discards batches (the network part runs on the exporter
// thread, off the request path). Results: bench/results/tracing_cost.md.
#include <benchmark/benchmark.h>

#include <atomic>
#include <string>

#include "common/tracing.h"

namespace tandem::tracing {
namespace {

constexpr const char* kSampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

std::atomic<uint64_t> g_exported{0};

// What the proxy does for one request: the decision, then each hook.
// Returns the number of spans it made.
int ProxyRequestHooks(std::string_view traceparent) {
  const SpanContext trace = Tracer::Get().StartRequest(traceparent);
  int spans = 0;
  if (trace.sampled) {  // admission
    SpanBuilder("tandem.admission", ChildOf(trace), SpanKind::kInternal, NowUnixNs())
        .Attr("tandem.prompt_tokens", int64_t{512})
        .Attr("tandem.max_tokens", int64_t{128})
        .End();
    ++spans;
  }
  const uint64_t route_start = trace.sampled ? NowUnixNs() : 0;
  if (trace.sampled) {  // route
    SpanBuilder("tandem.route", ChildOf(trace), SpanKind::kInternal, route_start)
        .Attr("tandem.attempt", int64_t{1})
        .Attr("tandem.route.prefill", std::string("prefill-7001"))
        .Attr("tandem.route.decode", std::string("decode-7002"))
        .Attr("tandem.route.local_prefill", false)
        .Attr("tandem.route.predicted_hit_tokens", int64_t{256})
        .End();
    ++spans;
  }
  std::string header;  // the traceparent for the two worker calls
  if (trace.sampled) header = FormatTraceparent(trace);
  benchmark::DoNotOptimize(header);
  if (trace.sampled) {  // stream + request
    SpanBuilder("tandem.stream", ChildOf(trace), SpanKind::kInternal, NowUnixNs())
        .Attr("tandem.completion_tokens", int64_t{128})
        .End();
    SpanBuilder("tandem.request", trace, SpanKind::kServer, NowUnixNs())
        .Attr("tandem.request_id", std::string("req-1"))
        .Attr("tandem.prompt_tokens", int64_t{512})
        .Attr("tandem.completion_tokens", int64_t{128})
        .End();
    spans += 2;
  }
  return spans;
}

void BM_ProxyHooksOff(benchmark::State& state) {
  // Tracing off (no otlp_endpoint): the header is not even read.
  for (auto _ : state) benchmark::DoNotOptimize(ProxyRequestHooks(""));
  state.counters["spans"] = 0;
}
BENCHMARK(BM_ProxyHooksOff);

void EnsureOn() {
  static bool started = [] {
    TracerOptions o;
    o.otlp_endpoint = "127.0.0.1:1";  // never dialled: the exporter below discards
    o.sample_ratio = 0;
    Status s = Tracer::Get().Start(o, [](const TracerOptions&, std::vector<SpanRecord> spans) {
      g_exported.fetch_add(spans.size());
      return Status::Ok();
    });
    return s.ok();
  }();
  if (!started) std::abort();
}

void BM_ProxyHooksOnNotSampled(benchmark::State& state) {
  // Tracing on, ratio 0, the client sent no traceparent.
  EnsureOn();
  for (auto _ : state) benchmark::DoNotOptimize(ProxyRequestHooks(""));
}
BENCHMARK(BM_ProxyHooksOnNotSampled);

void BM_ProxyHooksOnSampled(benchmark::State& state) {
  // Tracing on, the client's sampled traceparent: four spans queued.
  EnsureOn();
  const uint64_t dropped0 = Tracer::Get().dropped();
  int64_t spans = 0;
  for (auto _ : state) spans += ProxyRequestHooks(kSampled);
  state.counters["spans/request"] = static_cast<double>(spans) / static_cast<double>(state.iterations());
  state.counters["dropped"] = static_cast<double>(Tracer::Get().dropped() - dropped0);
}
BENCHMARK(BM_ProxyHooksOnSampled);

// The reference: one wall-clock read (a span takes at least two).
void BM_WallClockRead(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(NowUnixNs());
}
BENCHMARK(BM_WallClockRead);

void BM_ParseTraceparent(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(ParseTraceparent(kSampled));
}
BENCHMARK(BM_ParseTraceparent);

}  // namespace
}  // namespace tandem::tracing

BENCHMARK_MAIN();
