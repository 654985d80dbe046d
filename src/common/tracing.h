// Distributed tracing (docs/observability.md): W3C trace context, the
// sampling decision, and a process-wide span queue drained by a background
// exporter thread (OTLP/gRPC: common/tracing_otlp.h). No protobuf here, so
// the request path (proxy lifecycle, prefiller, decoder) can include it.
//
// Cost when off: a request's SpanContext is not sampled, and every hook is
// `if (ctx.sampled)` — no clock read, no allocation, no lock.
//
// Thread-safety: Tracer's methods may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "common/status.h"

namespace tandem::tracing {

using TraceId = std::array<uint8_t, 16>;
using SpanId = std::array<uint8_t, 8>;

// One span's identity. `sampled` false: nothing is recorded or propagated.
struct SpanContext {
  TraceId trace_id{};
  SpanId span_id{};
  SpanId parent_span_id{};  // all zero: a root span
  bool sampled = false;
};

// A W3C `traceparent` value ("00-<32 hex>-<16 hex>-<2 hex>"): the remote
// parent's trace id and span id and its sampled flag (parent_span_id is
// left zero). NotFound for an empty value; InvalidArgument (naming the
// part) for a malformed one, an all-zero id or version ff.
Result<SpanContext> ParseTraceparent(std::string_view value);
// "00-<trace id>-<span id>-01|00" for `ctx` (its own span id).
std::string FormatTraceparent(const SpanContext& ctx);
std::string ToHex(const uint8_t* data, size_t n);

// A child of `parent`: same trace, a new random span id, `parent`'s span as
// its parent. Not sampled when `parent` is not.
SpanContext ChildOf(const SpanContext& parent);

uint64_t NowUnixNs();
// A steady-clock instant on the wall clock (for spans timed with steady_clock).
uint64_t ToUnixNs(std::chrono::steady_clock::time_point t);

// The same, for several instants of one span tree: both clocks are read
// once, so instants keep their order exactly.
class ClockMap {
 public:
  ClockMap();
  uint64_t operator()(std::chrono::steady_clock::time_point t) const;
  uint64_t now() const { return unix_now_; }

 private:
  std::chrono::steady_clock::time_point steady_now_;
  uint64_t unix_now_;
};

enum class SpanKind { kInternal = 1, kServer = 2, kClient = 3 };

struct Attribute {
  std::string key;
  std::variant<std::string, int64_t, double, bool> value;
};

struct SpanRecord {
  std::string name;
  SpanContext ctx;  // its ids; parent_span_id links it
  SpanKind kind = SpanKind::kInternal;
  uint64_t start_unix_ns = 0;
  uint64_t end_unix_ns = 0;
  std::vector<Attribute> attributes;
  bool error = false;
  std::string status_message;  // with error
};

// The process's identity in every export (OTLP resource).
struct TracerOptions {
  std::string otlp_endpoint;  // host:port; "" = off
  double sample_ratio = 0;    // for requests without a client traceparent
  std::string service_name;   // tandem-proxy | tandem-prefill | tandem-decode
  std::string instance_id;    // the worker's (or proxy's) name
  size_t max_queue = 4096;    // spans waiting for export; past it: dropped and counted
  size_t max_batch = 512;     // spans per export call
  std::chrono::milliseconds flush_interval{200};
};

// Sends one batch; runs on the exporter thread only.
using ExportFn = std::function<Status(const TracerOptions& opts, std::vector<SpanRecord> spans)>;

class Tracer {
 public:
  // The process's tracer; off until Start. (Tests may make their own.)
  static Tracer& Get();
  Tracer() = default;

  // Turns tracing on (a non-empty endpoint) and starts the exporter thread.
  // Once per process; a second call is FailedPrecondition.
  Status Start(TracerOptions opts, ExportFn exporter);
  // Exports what is queued and joins the thread (idempotent). After Stop,
  // spans are no longer accepted.
  void Stop();

  bool enabled() const { return enabled_.load(std::memory_order_acquire); }

  // The sampling decision for a request arriving at the proxy, from the
  // client's `traceparent` (may be empty): parent-based — a valid client
  // context is followed (sampled or not); without one, a new trace is
  // sampled with probability sample_ratio. The result is the proxy's
  // request span, a child of the client's span.
  SpanContext StartRequest(std::string_view traceparent);
  // A worker's span for a call from `traceparent` (gRPC metadata): sampled
  // only when tracing is on here and the caller's context is sampled.
  SpanContext ContinueFrom(std::string_view traceparent);

  // Never blocks: a full queue drops the span (counted).
  void Submit(SpanRecord span);

  uint64_t exported() const { return exported_.load(std::memory_order_relaxed); }
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  uint64_t export_failures() const { return export_failures_.load(std::memory_order_relaxed); }

  ~Tracer();

 private:
  void Loop();

  TracerOptions opts_;
  ExportFn exporter_;
  std::atomic<bool> enabled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SpanRecord> queue_;  // guarded by mu_
  bool stopping_ = false;         // guarded by mu_
  bool started_ = false;          // guarded by mu_
  std::thread thread_;
  std::atomic<uint64_t> exported_{0}, dropped_{0}, export_failures_{0};
};

// Builds and submits one span (when `ctx.sampled` and tracing is on).
class SpanBuilder {
 public:
  SpanBuilder(std::string name, const SpanContext& ctx, SpanKind kind, uint64_t start_unix_ns);
  SpanBuilder& Attr(std::string key, std::string value);
  SpanBuilder& Attr(std::string key, const char* value) { return Attr(std::move(key), std::string(value)); }
  SpanBuilder& Attr(std::string key, int64_t value);
  SpanBuilder& Attr(std::string key, double value);
  SpanBuilder& Attr(std::string key, bool value);
  SpanBuilder& Error(std::string message);
  void End(uint64_t end_unix_ns = NowUnixNs());

 private:
  SpanRecord rec_;
};

}  // namespace tandem::tracing
