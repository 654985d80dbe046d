#include "common/tracing.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>

#include "common/splitmix.h"

namespace tandem::tracing {
namespace {

// Ids need uniqueness, not secrecy: a per-thread SplitMix64 stream seeded
// from the OS.
uint64_t RandomU64() {
  thread_local uint64_t state = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return SplitMix64Next(state);
}

template <size_t N>
void FillRandom(std::array<uint8_t, N>& out) {
  do {
    for (size_t i = 0; i < N; i += 8) {
      const uint64_t v = RandomU64();
      for (size_t j = 0; j < 8 && i + j < N; ++j) out[i + j] = static_cast<uint8_t>(v >> (8 * j));
    }
  } while (std::all_of(out.begin(), out.end(), [](uint8_t b) { return b == 0; }));
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // W3C trace context: lowercase hex only
}

bool ParseHex(std::string_view s, uint8_t* out) {
  for (size_t i = 0; i < s.size() / 2; ++i) {
    const int hi = HexDigit(s[2 * i]), lo = HexDigit(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

template <size_t N>
bool AllZero(const std::array<uint8_t, N>& a) {
  return std::all_of(a.begin(), a.end(), [](uint8_t b) { return b == 0; });
}

}  // namespace

std::string ToHex(const uint8_t* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kDigits[data[i] >> 4];
    s[2 * i + 1] = kDigits[data[i] & 15];
  }
  return s;
}

Result<SpanContext> ParseTraceparent(std::string_view v) {
  if (v.empty()) return NotFoundError("no traceparent");
  // version "-" trace-id "-" parent-id "-" flags; a future version may
  // append fields after another "-".
  if (v.size() < 55 || v[2] != '-' || v[35] != '-' || v[52] != '-' ||
      (v.size() > 55 && v[55] != '-')) {
    return InvalidArgumentError(fmt::format(
        "traceparent: expected 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, got {} bytes",
        v.size()));
  }
  uint8_t version = 0, flags = 0;
  SpanContext c;
  if (!ParseHex(v.substr(0, 2), &version) || version == 0xff) {
    return InvalidArgumentError("traceparent: bad version");
  }
  if (version == 0 && v.size() != 55) return InvalidArgumentError("traceparent: version 00 has 55 bytes");
  if (!ParseHex(v.substr(3, 32), c.trace_id.data()) || AllZero(c.trace_id)) {
    return InvalidArgumentError("traceparent: bad trace id");
  }
  if (!ParseHex(v.substr(36, 16), c.span_id.data()) || AllZero(c.span_id)) {
    return InvalidArgumentError("traceparent: bad parent span id");
  }
  if (!ParseHex(v.substr(53, 2), &flags)) return InvalidArgumentError("traceparent: bad flags");
  c.sampled = (flags & 1) != 0;
  return c;
}

std::string FormatTraceparent(const SpanContext& c) {
  return fmt::format("00-{}-{}-{}", ToHex(c.trace_id.data(), 16), ToHex(c.span_id.data(), 8),
                     c.sampled ? "01" : "00");
}

SpanContext ChildOf(const SpanContext& parent) {
  SpanContext c;
  c.sampled = parent.sampled;
  if (!parent.sampled) return c;
  c.trace_id = parent.trace_id;
  c.parent_span_id = parent.span_id;
  FillRandom(c.span_id);
  return c;
}

uint64_t NowUnixNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

uint64_t ToUnixNs(std::chrono::steady_clock::time_point t) {
  const auto ago = std::chrono::steady_clock::now() - t;
  return NowUnixNs() -
         static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(ago).count());
}

ClockMap::ClockMap() : steady_now_(std::chrono::steady_clock::now()), unix_now_(NowUnixNs()) {}

uint64_t ClockMap::operator()(std::chrono::steady_clock::time_point t) const {
  return unix_now_ - static_cast<uint64_t>(
                         std::chrono::duration_cast<std::chrono::nanoseconds>(steady_now_ - t).count());
}

Tracer& Tracer::Get() {
  static Tracer* t = new Tracer();  // never destroyed: spans may end during exit
  return *t;
}

Tracer::~Tracer() { Stop(); }

Status Tracer::Start(TracerOptions opts, ExportFn exporter) {
  std::lock_guard lock(mu_);
  if (started_) return FailedPreconditionError("tracing is already started");
  if (opts.otlp_endpoint.empty()) return Status::Ok();
  started_ = true;
  opts_ = std::move(opts);
  exporter_ = std::move(exporter);
  thread_ = std::thread([this] { Loop(); });
  enabled_.store(true, std::memory_order_release);
  return Status::Ok();
}

void Tracer::Stop() {
  {
    std::lock_guard lock(mu_);
    if (!started_ || stopping_) return;
    stopping_ = true;
    enabled_.store(false, std::memory_order_relaxed);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

SpanContext Tracer::StartRequest(std::string_view traceparent) {
  if (!enabled()) return {};
  auto parent = ParseTraceparent(traceparent);
  if (parent.ok()) return ChildOf(*parent);
  // No (or a malformed) client context: a new trace, sampled by ratio.
  const double ratio = opts_.sample_ratio;
  if (ratio <= 0 || (ratio < 1 && static_cast<double>(RandomU64() >> 11) * 0x1.0p-53 >= ratio)) {
    return {};
  }
  SpanContext root;
  root.sampled = true;
  FillRandom(root.trace_id);
  FillRandom(root.span_id);
  return root;
}

SpanContext Tracer::ContinueFrom(std::string_view traceparent) {
  if (!enabled()) return {};
  auto parent = ParseTraceparent(traceparent);
  if (!parent.ok()) return {};
  return ChildOf(*parent);
}

void Tracer::Submit(SpanRecord span) {
  if (!enabled() || !span.ctx.sampled) return;
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    if (queue_.size() >= opts_.max_queue) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queue_.push_back(std::move(span));
    wake = queue_.size() >= opts_.max_batch;
  }
  if (wake) cv_.notify_one();
}

void Tracer::Loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait_for(lock, opts_.flush_interval,
                 [this] { return stopping_ || queue_.size() >= opts_.max_batch; });
    while (!queue_.empty()) {
      const size_t n = std::min(queue_.size(), opts_.max_batch);
      std::vector<SpanRecord> batch(std::make_move_iterator(queue_.begin()),
                                    std::make_move_iterator(queue_.begin() + static_cast<long>(n)));
      queue_.erase(queue_.begin(), queue_.begin() + static_cast<long>(n));
      lock.unlock();
      Status st = exporter_(opts_, std::move(batch));
      if (st.ok()) {
        exported_.fetch_add(n, std::memory_order_relaxed);
      } else {
        // Spans of a failed export are dropped (a collector that is down
        // must not grow the queue); the first failure of a run is logged.
        if (export_failures_.fetch_add(1, std::memory_order_relaxed) == 0) {
          spdlog::warn("tracing: exporting {} spans to {} failed: {}", n, opts_.otlp_endpoint,
                       st.ToString());
        }
        dropped_.fetch_add(n, std::memory_order_relaxed);
      }
      lock.lock();
      if (!stopping_ && queue_.size() < opts_.max_batch) break;
    }
    if (stopping_ && queue_.empty()) return;
  }
}

SpanBuilder::SpanBuilder(std::string name, const SpanContext& ctx, SpanKind kind,
                         uint64_t start_unix_ns) {
  rec_.name = std::move(name);
  rec_.ctx = ctx;
  rec_.kind = kind;
  rec_.start_unix_ns = start_unix_ns;
}

SpanBuilder& SpanBuilder::Attr(std::string key, std::string value) {
  rec_.attributes.push_back({std::move(key), std::move(value)});
  return *this;
}
SpanBuilder& SpanBuilder::Attr(std::string key, int64_t value) {
  rec_.attributes.push_back({std::move(key), value});
  return *this;
}
SpanBuilder& SpanBuilder::Attr(std::string key, double value) {
  rec_.attributes.push_back({std::move(key), value});
  return *this;
}
SpanBuilder& SpanBuilder::Attr(std::string key, bool value) {
  rec_.attributes.push_back({std::move(key), value});
  return *this;
}
SpanBuilder& SpanBuilder::Error(std::string message) {
  rec_.error = true;
  rec_.status_message = std::move(message);
  return *this;
}

void SpanBuilder::End(uint64_t end_unix_ns) {
  rec_.end_unix_ns = std::max(end_unix_ns, rec_.start_unix_ns);
  Tracer::Get().Submit(std::move(rec_));
}

}  // namespace tandem::tracing
