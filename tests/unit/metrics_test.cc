#include "common/metrics.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

TEST(Metrics, RendersWithConstantLabels) {
  MetricsRegistry m({"tandem-kjv", "prefill", "prefill-0"});
  auto& c = m.Counter("tandem_test_total", "a test counter", {{"outcome", "ok"}});
  c.Increment(3);
  auto& h = m.Histogram("tandem_test_seconds", "a test histogram", {0.1, 1.0});
  h.Observe(0.5);
  h.Observe(2.0);
  const std::string text = m.Render();
  EXPECT_NE(text.find(R"(tandem_test_total{model="tandem-kjv",outcome="ok",role="prefill",worker="prefill-0"} 3)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(tandem_test_seconds_count{model="tandem-kjv",role="prefill",worker="prefill-0"} 2)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"(le="1"} 1)"), std::string::npos) << text;
}

TEST(Metrics, SameNameAndLabelsIsTheSameSeries) {
  MetricsRegistry m({"m", "proxy", "proxy"});
  m.Counter("tandem_x_total", "x").Increment();
  m.Counter("tandem_x_total", "x").Increment();
  EXPECT_DOUBLE_EQ(m.Counter("tandem_x_total", "x").Value(), 2.0);
}

TEST(Metrics, ServesOnAFreePort) {
  MetricsRegistry m({"m", "proxy", "proxy"});
  ASSERT_TRUE(m.Serve("127.0.0.1:0").ok());
  EXPECT_NE(m.bound_address(), "127.0.0.1:0");
  EXPECT_EQ(m.bound_address().rfind("127.0.0.1:", 0), 0u);
}

TEST(Metrics, BadAddressIsAnError) {
  MetricsRegistry m({"m", "proxy", "proxy"});
  EXPECT_EQ(m.Serve("nonsense").code(), StatusCode::kInvalidArgument);
}

TEST(Metrics, ExponentialBuckets) {
  const auto b = MetricsRegistry::ExponentialBuckets(0.001, 2, 4);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_DOUBLE_EQ(b[3], 0.008);
}

}  // namespace
}  // namespace tandem
