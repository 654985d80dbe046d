// The HTML report: one self-contained file (inline CSS and SVG, no scripts,
// nothing fetched) that a person opens in a browser.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "loadgen/report.h"

namespace tandem::loadgen {
namespace {

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// A "nice" step for about `n` ticks over [0, span].
double NiceStep(double span, int n) {
  if (!(span > 0)) return 1;
  const double raw = span / n;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * mag) return m * mag;
  }
  return 10 * mag;
}

std::string Num(double v) {
  if (v == 0) return "0";
  if (std::fabs(v) >= 100) return fmt::format("{:.0f}", v);
  if (std::fabs(v) >= 1) return fmt::format("{:.3g}", v);
  return fmt::format("{:.2g}", v);
}

struct Series {
  std::vector<std::pair<double, double>> points;  // (x, y), x increasing
  bool step = false;                              // draw as a step function (CDF)
};

// A line plot with axes from 0 (or the data's minimum for x) to the maximum.
std::string Plot(const std::string& title, const std::string& xlabel, const std::string& ylabel,
                 const Series& s, double ymax_fixed = 0) {
  const double W = 560, H = 320, L = 64, R = 16, T = 32, B = 48;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "viewBox=\"0 0 {} {}\" role=\"img\"><title>{}</title>"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>"
      "<text x=\"{}\" y=\"20\" font-size=\"14\" text-anchor=\"middle\" font-weight=\"bold\">{}</text>",
      W, H, W, H, Escape(title), W / 2, Escape(title));
  if (s.points.empty()) {
    return svg + fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no data</text></svg>",
                             W / 2, H / 2);
  }
  double xmax = 0, ymax = ymax_fixed;
  for (auto [x, y] : s.points) {
    xmax = std::max(xmax, x);
    if (ymax_fixed == 0) ymax = std::max(ymax, y);
  }
  if (!(xmax > 0)) xmax = 1;
  if (!(ymax > 0)) ymax = 1;
  const double xstep = NiceStep(xmax, 6), ystep = NiceStep(ymax, 5);
  xmax = std::ceil(xmax / xstep) * xstep;
  ymax = std::ceil(ymax / ystep - 1e-9) * ystep;
  const auto px = [&](double x) { return L + x / xmax * (W - L - R); };
  const auto py = [&](double y) { return H - B - y / ymax * (H - T - B); };
  // Grid and ticks.
  for (double x = 0; x <= xmax + xstep / 2; x += xstep) {
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#ddd\"/>"
        "<text x=\"{0:.1f}\" y=\"{3}\" font-size=\"11\" text-anchor=\"middle\">{4}</text>",
        px(x), T, H - B, H - B + 16, Num(x));
  }
  for (double y = 0; y <= ymax + ystep / 2; y += ystep) {
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#ddd\"/>"
        "<text x=\"{3}\" y=\"{4:.1f}\" font-size=\"11\" text-anchor=\"end\">{5}</text>",
        L, py(y), W - R, L - 6, py(y) + 4, Num(y));
  }
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"black\"/>"
      "<line x1=\"{0}\" y1=\"{3}\" x2=\"{0}\" y2=\"{1}\" stroke=\"black\"/>"
      "<text x=\"{4}\" y=\"{5}\" font-size=\"12\" text-anchor=\"middle\">{6}</text>"
      "<text x=\"14\" y=\"{7}\" font-size=\"12\" text-anchor=\"middle\" "
      "transform=\"rotate(-90 14 {7})\">{8}</text>",
      L, H - B, W - R, T, (L + W - R) / 2, H - 10, Escape(xlabel), (T + H - B) / 2,
      Escape(ylabel));
  std::string path;
  double prev_y = 0;
  bool first = true;
  for (auto [x, y] : s.points) {
    if (first) {
      path += fmt::format("M{:.1f},{:.1f}", px(x), py(s.step ? 0 : y));
      if (s.step) path += fmt::format(" L{:.1f},{:.1f}", px(x), py(y));
      first = false;
    } else if (s.step) {
      path += fmt::format(" L{:.1f},{:.1f} L{:.1f},{:.1f}", px(x), py(prev_y), px(x), py(y));
    } else {
      path += fmt::format(" L{:.1f},{:.1f}", px(x), py(y));
    }
    prev_y = y;
  }
  svg += fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\"/>", path);
  return svg + "</svg>";
}

// Empirical CDF of `values` in milliseconds; at most ~400 points.
Series Cdf(std::vector<double> values_s) {
  Series s;
  s.step = true;
  std::sort(values_s.begin(), values_s.end());
  const size_t n = values_s.size();
  const size_t stride = std::max<size_t>(1, n / 400);
  for (size_t i = 0; i < n; i += stride) {
    // The last of a run of equal values carries the CDF's height there.
    size_t j = std::min(n - 1, i + stride - 1);
    s.points.push_back({values_s[j] * 1000.0, double(j + 1) / double(n)});
  }
  if (n > 0 && s.points.back().second < 1.0) s.points.push_back({values_s.back() * 1000.0, 1.0});
  return s;
}

std::string Row(const std::string& k, const std::string& v) {
  return fmt::format("<tr><th>{}</th><td>{}</td></tr>", Escape(k), Escape(v));
}

std::string Ms(double s) { return std::isnan(s) ? "-" : fmt::format("{:.2f}", s * 1000); }

}  // namespace

std::string HtmlReport(const RunInfo& info, const Summary& s,
                       const std::vector<RequestRecord>& records) {
  std::vector<double> ttft, itl;
  for (const auto& r : records) {
    if (!r.ok) continue;
    if (r.ttft_s >= 0) ttft.push_back(r.ttft_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
  }
  const double bin = ThroughputBinSeconds(records);
  Series thr;
  const auto bins = TokensPerBin(records, bin);
  for (size_t i = 0; i < bins.size(); ++i) thr.points.push_back({(i + 0.5) * bin, bins[i] / bin});

  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">";
  h += "<title>tandem bench serve" + (info.label.empty() ? "" : ": " + Escape(info.label)) +
       "</title>";
  h += "<style>body{font-family:sans-serif;margin:24px;max-width:1200px}"
       "table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ccc;padding:3px 8px;"
       "text-align:left}td{text-align:right}code{background:#f4f4f4;padding:2px 4px}"
       ".plots svg{margin:8px;border:1px solid #eee}</style></head><body>\n";
  h += "<h1>tandem bench serve" + (info.label.empty() ? "" : ": " + Escape(info.label)) + "</h1>\n";
  h += "<p>Command: <code>" + Escape(info.command) + "</code></p>\n";
  h += "<table>";
  h += Row("target", info.target);
  h += Row("model", fmt::format("{} (context {} tokens)", info.model, info.max_model_len));
  h += Row("workload", info.workload);
  h += Row("arrival", info.arrival);
  h += Row("bounds", info.bounds);
  h += Row("started (UTC)", info.started_utc);
  h += Row("ignore_eos", info.ignore_eos ? "yes" : "no");
  h += "</table>\n<h2>Summary</h2><table>";
  h += Row("successful requests", std::to_string(s.ok));
  h += Row("failed requests", std::to_string(s.failed));
  for (const auto& [code, n] : s.failed_by_status) h += Row("failed: " + code, std::to_string(n));
  h += Row("duration (s)", fmt::format("{:.2f}", s.duration_s));
  h += Row("input tokens", std::to_string(s.prompt_tokens));
  h += Row("output tokens (requested)", fmt::format("{} ({})", s.output_tokens, s.requested_tokens));
  h += Row("request throughput (req/s)", fmt::format("{:.2f}", s.request_throughput));
  h += Row("output throughput (tok/s)", fmt::format("{:.2f}", s.output_throughput));
  h += Row("cached prompt token ratio", fmt::format("{:.3f}", s.cached_token_ratio));
  if (info.slo.any()) {
    h += Row("good requests / goodput (req/s)", fmt::format("{} / {:.2f}", s.good, s.goodput));
  }
  h += "</table>\n<table><tr><th>ms</th><th>mean</th><th>p50</th><th>p90</th><th>p99</th>"
       "<th>max</th></tr>";
  for (const auto& [name, d] : {std::pair<const char*, const Distribution&>{"TTFT", s.ttft_s},
                                {"ITL", s.itl_s}, {"TPOT", s.tpot_s}, {"E2E", s.e2e_s}}) {
    h += fmt::format("<tr><th>{}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                     name, Ms(d.mean), Ms(d.p50), Ms(d.p90), Ms(d.p99), Ms(d.max));
  }
  h += "</table>\n<h2>Plots</h2><div class=\"plots\">\n";
  h += Plot("TTFT CDF", "time to first token (ms)", "fraction of requests", Cdf(ttft), 1.0) + "\n";
  h += Plot("ITL CDF", "inter-token latency (ms)", "fraction of gaps", Cdf(itl), 1.0) + "\n";
  h += Plot(fmt::format("Output throughput over time ({:.2g} s bins)", bin), "time (s)",
            "output tokens/s", thr) +
       "\n";
  h += "</div>\n<p>Definitions: docs/bench-serve.md. TTFT and ITL are measured at the client.</p>\n";
  h += "</body></html>\n";
  return h;
}

}  // namespace tandem::loadgen
