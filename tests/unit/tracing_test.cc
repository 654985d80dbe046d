// common/tracing: W3C traceparent, the parent-based sampling decision, the
// bounded export queue. The OTLP/gRPC exporter's real counterpart (spans
// from a real fleet at a Python OTLP receiver) is
// tests/integration/tracing/tracing_fleet_test.py.
#include "common/tracing.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

namespace tandem::tracing {
namespace {

constexpr const char* kSampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
constexpr const char* kUnsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

TEST(Traceparent, ParsesAndFormatsTheW3cExample) {
  auto c = ParseTraceparent(kSampled);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->sampled);
  EXPECT_EQ(ToHex(c->trace_id.data(), 16), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(ToHex(c->span_id.data(), 8), "00f067aa0ba902b7");
  EXPECT_EQ(FormatTraceparent(*c), kSampled);
  auto u = ParseTraceparent(kUnsampled);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->sampled);
}

TEST(Traceparent, RefusesMalformedValuesNamingThePart) {
  EXPECT_EQ(ParseTraceparent("").status().code(), StatusCode::kNotFound);
  const std::pair<std::string, std::string> bad[] = {
      {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "expected"},
      {"00-00000000000000000000000000000000-00f067aa0ba902b7-01", "trace id"},
      {"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "span id"},
      {"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "trace id"},
      {"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version"},
      {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x", "flags"},
      {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", "version 00"},
  };
  for (const auto& [value, part] : bad) {
    auto r = ParseTraceparent(value);
    ASSERT_FALSE(r.ok()) << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << value;
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
  }
  // A later version may append fields.
  EXPECT_TRUE(ParseTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x").ok());
}

TEST(Tracing, ChildKeepsTheTraceAndLinksItsParent) {
  auto parent = ParseTraceparent(kSampled);
  ASSERT_TRUE(parent.ok());
  SpanContext c = ChildOf(*parent);
  EXPECT_TRUE(c.sampled);
  EXPECT_EQ(c.trace_id, parent->trace_id);
  EXPECT_EQ(c.parent_span_id, parent->span_id);
  EXPECT_NE(c.span_id, parent->span_id);
  EXPECT_NE(c.span_id, SpanId{});
  EXPECT_FALSE(ChildOf(SpanContext{}).sampled);
}

// Records what it is asked to export; blocks while `hold` is set.
struct FakeExporter {
  std::mutex mu;
  std::condition_variable cv;
  bool hold = false;
  size_t calls = 0;
  std::vector<SpanRecord> spans;
  ExportFn Fn() {
    return [this](const TracerOptions&, std::vector<SpanRecord> batch) {
      std::unique_lock lock(mu);
      ++calls;
      cv.notify_all();
      cv.wait(lock, [this] { return !hold; });
      for (auto& s : batch) spans.push_back(std::move(s));
      return Status::Ok();
    };
  }
};

SpanRecord Span(const SpanContext& ctx, const std::string& name) {
  SpanRecord r;
  r.name = name;
  r.ctx = ctx;
  return r;
}

TEST(Tracer, OffUntilStartedAndWithoutAnEndpoint) {
  Tracer t;
  EXPECT_FALSE(t.enabled());
  EXPECT_FALSE(t.StartRequest(kSampled).sampled);
  FakeExporter fx;
  ASSERT_TRUE(t.Start(TracerOptions{}, fx.Fn()).ok());  // no endpoint: stays off
  EXPECT_FALSE(t.enabled());
  EXPECT_FALSE(t.StartRequest(kSampled).sampled);
}

TEST(Tracer, ParentBasedSampling) {
  Tracer t;
  FakeExporter fx;
  TracerOptions o;
  o.otlp_endpoint = "127.0.0.1:1";
  o.sample_ratio = 0;
  ASSERT_TRUE(t.Start(o, fx.Fn()).ok());
  EXPECT_EQ(t.Start(o, fx.Fn()).code(), StatusCode::kFailedPrecondition);
  // A client's sampled context is always traced, in the client's trace.
  SpanContext c = t.StartRequest(kSampled);
  ASSERT_TRUE(c.sampled);
  EXPECT_EQ(ToHex(c.trace_id.data(), 16), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(ToHex(c.parent_span_id.data(), 8), "00f067aa0ba902b7");
  // An unsampled one is followed too; none at ratio 0: not traced.
  EXPECT_FALSE(t.StartRequest(kUnsampled).sampled);
  EXPECT_FALSE(t.StartRequest("").sampled);
  EXPECT_FALSE(t.StartRequest("garbage").sampled);
  // Workers follow their caller only.
  EXPECT_TRUE(t.ContinueFrom(FormatTraceparent(c)).sampled);
  EXPECT_FALSE(t.ContinueFrom("").sampled);
  t.Stop();
}

TEST(Tracer, SampleRatioStartsNewTraces) {
  Tracer all, half;
  FakeExporter fx;
  TracerOptions o;
  o.otlp_endpoint = "127.0.0.1:1";
  o.sample_ratio = 1;
  ASSERT_TRUE(all.Start(o, fx.Fn()).ok());
  SpanContext a = all.StartRequest(""), b = all.StartRequest("");
  ASSERT_TRUE(a.sampled && b.sampled);
  EXPECT_NE(a.trace_id, b.trace_id);
  EXPECT_EQ(a.parent_span_id, SpanId{});  // a root span
  o.sample_ratio = 0.5;
  ASSERT_TRUE(half.Start(o, fx.Fn()).ok());
  int sampled = 0;
  for (int i = 0; i < 4000; ++i) sampled += half.StartRequest("").sampled ? 1 : 0;
  // Binomial(4000, 0.5): mean 2000, sd ~32; the bounds are ~9 sd away.
  EXPECT_GT(sampled, 1700);
  EXPECT_LT(sampled, 2300);
  all.Stop();
  half.Stop();
}

TEST(Tracer, FullQueueDropsAndCountsWithoutBlocking) {
  Tracer t;
  FakeExporter fx;
  TracerOptions o;
  o.otlp_endpoint = "127.0.0.1:1";
  o.max_queue = 4;
  o.max_batch = 1;  // the first span wakes the exporter at once
  ASSERT_TRUE(t.Start(o, fx.Fn()).ok());
  const SpanContext ctx = t.StartRequest(kSampled);
  {
    std::unique_lock lock(fx.mu);
    fx.hold = true;
  }
  t.Submit(Span(ctx, "first"));
  {
    // The exporter holds "first"; the queue fills behind it.
    std::unique_lock lock(fx.mu);
    fx.cv.wait(lock, [&] { return fx.calls == 1; });
  }
  for (int i = 0; i < 10; ++i) t.Submit(Span(ctx, "more"));
  EXPECT_EQ(t.dropped(), 6u);  // 4 queued, 6 dropped; Submit returned each time
  t.Submit(Span(SpanContext{}, "unsampled"));  // never queued
  {
    std::lock_guard lock(fx.mu);
    fx.hold = false;
  }
  fx.cv.notify_all();
  t.Stop();  // exports the queue
  EXPECT_EQ(fx.spans.size(), 5u);
  EXPECT_EQ(t.exported(), 5u);
  EXPECT_EQ(t.dropped(), 6u);
  t.Submit(Span(ctx, "after stop"));
  EXPECT_EQ(fx.spans.size(), 5u);
}

TEST(Tracer, FailedExportsDropTheirSpans) {
  Tracer t;
  TracerOptions o;
  o.otlp_endpoint = "127.0.0.1:1";
  o.max_batch = 2;
  ASSERT_TRUE(t.Start(o, [](const TracerOptions&, std::vector<SpanRecord>) {
                return UnavailableError("collector down");
              }).ok());
  const SpanContext ctx = t.StartRequest(kSampled);
  for (int i = 0; i < 3; ++i) t.Submit(Span(ctx, "x"));
  t.Stop();
  EXPECT_EQ(t.exported(), 0u);
  EXPECT_EQ(t.dropped(), 3u);
  EXPECT_GE(t.export_failures(), 1u);
}

}  // namespace
}  // namespace tandem::tracing
