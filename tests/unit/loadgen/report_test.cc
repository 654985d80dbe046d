#include <gtest/gtest.h>

#include "loadgen/report.h"

namespace tandem::loadgen {
namespace {

std::vector<RequestRecord> Records() {
  std::vector<RequestRecord> rs;
  for (int i = 0; i < 20; ++i) {
    RequestRecord r;
    r.session = i;
    r.send_s = 0.1 * i;
    r.ok = i != 7;
    if (!r.ok) r.error = "UNAVAILABLE";
    r.ttft_s = r.ok ? 0.01 * (i + 1) : -1;
    r.e2e_s = 0.5;
    if (r.ok) {
      r.itl_s = {0.02, 0.0, 0.03};
      r.chunk_times_s = {r.send_s + r.ttft_s, r.send_s + 0.3, r.send_s + 0.5};
      r.chunk_tokens = {1, 2, 1};
      r.output_tokens = 4;
    }
    r.requested_tokens = 4;
    r.prompt_tokens = 64;
    r.usage_prompt_tokens = r.ok ? 64 : 0;
    r.cached_prompt_tokens = r.ok ? 16 : 0;
    rs.push_back(r);
  }
  return rs;
}

RunInfo Info() {
  // Built with assign() from std::string: GCC 12 warns falsely (-Wrestrict)
  // about operator=(const char*) inlined here.
  RunInfo info;
  info.label.assign(std::string("t<1>"));
  info.command.assign(std::string("tandem bench serve --num-requests 20"));
  info.model.assign(std::string("m"));
  info.slo.ttft_s = 0.1;
  return info;
}

TEST(Report, TableJsonAndHtmlAgree) {
  const auto rs = Records();
  const auto info = Info();
  const Summary s = Summarize(rs, info.slo);
  const std::string table = FormatTable(info, s);
  EXPECT_NE(table.find("Successful requests:                              19"), std::string::npos)
      << table;
  EXPECT_NE(table.find("Failed requests:                                   1"), std::string::npos);
  EXPECT_NE(table.find("  UNAVAILABLE:"), std::string::npos);
  EXPECT_NE(table.find("Goodput (req/s):"), std::string::npos);
  EXPECT_NE(table.find("P99 TTFT (ms):"), std::string::npos);

  const auto j = ToJson(info, s, rs);
  EXPECT_EQ(j["completed"], 19);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_EQ(j["failed_by_status"]["UNAVAILABLE"], 1);
  EXPECT_EQ(j["total_output_tokens"], 76);
  EXPECT_EQ(j["requested_output_tokens"], 80);
  EXPECT_EQ(j["good_requests"], 9);  // TTFT 10..100 ms minus the failed one (#7, 80 ms)
  EXPECT_DOUBLE_EQ(j["cached_token_ratio"].get<double>(), 0.25);
  EXPECT_EQ(j["per_request"].size(), 20u);
  // 19 values 10, 20, .., 200 without 80: the 10th is 110.
  EXPECT_NEAR(j["median_ttft_ms"].get<double>(), 110.0, 1e-9);
  double tokens = 0;
  for (double x : j["output_throughput_over_time"]) tokens += x * j["throughput_bin_s"].get<double>();
  EXPECT_NEAR(tokens, 76.0, 1e-6);

  const std::string html = HtmlReport(info, s, rs);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  size_t svgs = 0;
  for (size_t p = html.find("<svg"); p != std::string::npos; p = html.find("<svg", p + 1)) ++svgs;
  EXPECT_EQ(svgs, 3u);
  EXPECT_NE(html.find("TTFT CDF"), std::string::npos);
  EXPECT_NE(html.find("ITL CDF"), std::string::npos);
  EXPECT_NE(html.find("t&lt;1&gt;"), std::string::npos);  // escaped
  EXPECT_EQ(html.find("<script"), std::string::npos);      // self-contained, no scripts
  EXPECT_EQ(html.find("http://www.w3.org/2000/svg\""), html.find("http://"));  // nothing fetched
}

TEST(Report, EmptyRunHasNullLatencies) {
  const Summary s = Summarize({}, Slo{});
  const auto j = ToJson(Info(), s, {});
  EXPECT_TRUE(j["mean_ttft_ms"].is_null());
  EXPECT_EQ(j["completed"], 0);
  const std::string html = HtmlReport(Info(), s, {});
  EXPECT_NE(html.find("no data"), std::string::npos);
}

}  // namespace
}  // namespace tandem::loadgen
