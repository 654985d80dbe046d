#include "loadgen/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace tandem::loadgen {
namespace {

std::string Ms(double s) {
  if (std::isnan(s)) return "-";
  return fmt::format("{:.2f}", s * 1000.0);
}

nlohmann::json MsOrNull(double s) {
  if (std::isnan(s)) return nullptr;
  return s * 1000.0;
}

void AddDist(nlohmann::json& j, const std::string& name, const Distribution& d) {
  j["mean_" + name + "_ms"] = MsOrNull(d.mean);
  j["median_" + name + "_ms"] = MsOrNull(d.p50);
  j["p90_" + name + "_ms"] = MsOrNull(d.p90);
  j["p99_" + name + "_ms"] = MsOrNull(d.p99);
  j["max_" + name + "_ms"] = MsOrNull(d.max);
}

std::string SloText(const Slo& slo) {
  std::vector<std::string> parts;
  if (slo.ttft_s) parts.push_back(fmt::format("TTFT <= {} ms", *slo.ttft_s * 1000));
  if (slo.itl_s) parts.push_back(fmt::format("every ITL <= {} ms", *slo.itl_s * 1000));
  if (slo.tpot_s) parts.push_back(fmt::format("TPOT <= {} ms", *slo.tpot_s * 1000));
  if (slo.e2e_s) parts.push_back(fmt::format("e2e <= {} ms", *slo.e2e_s * 1000));
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : ", ") + p;
  return out;
}

}  // namespace

double ThroughputBinSeconds(const std::vector<RequestRecord>& records) {
  double last = 0;
  for (const auto& r : records) last = std::max(last, r.send_s + r.e2e_s);
  return std::max(0.1, last / 60.0);
}

std::string FormatTable(const RunInfo& info, const Summary& s) {
  std::string t;
  const auto row = [&](const std::string& k, const std::string& v) {
    t += fmt::format("{:<36}{:>16}\n", k, v);
  };
  const auto head = [&](const std::string& h) {
    t += fmt::format("{:-^52}\n", " " + h + " ");
  };
  t += fmt::format("{:=^52}\n", " Serving Benchmark Result ");
  if (!info.label.empty()) row("Label:", info.label);
  row("Model:", info.model);
  row("Successful requests:", std::to_string(s.ok));
  row("Failed requests:", std::to_string(s.failed));
  for (const auto& [code, n] : s.failed_by_status) row("  " + code + ":", std::to_string(n));
  row("Benchmark duration (s):", fmt::format("{:.2f}", s.duration_s));
  row("Total input tokens:", std::to_string(s.prompt_tokens));
  row("Total generated tokens:", std::to_string(s.output_tokens));
  row("Requested output tokens:", std::to_string(s.requested_tokens));
  row("Request throughput (req/s):", fmt::format("{:.2f}", s.request_throughput));
  row("Output token throughput (tok/s):", fmt::format("{:.2f}", s.output_throughput));
  row("Total token throughput (tok/s):", fmt::format("{:.2f}", s.total_token_throughput));
  row("Max requests in flight:", fmt::format("{:.0f}", s.max_inflight));
  row("Cached prompt token ratio:", fmt::format("{:.3f}", s.cached_token_ratio));
  if (info.slo.any()) {
    row("Good requests (SLO):", std::to_string(s.good));
    row("Goodput (req/s):", fmt::format("{:.2f}", s.goodput));
  }
  head("Time to First Token");
  row("Mean TTFT (ms):", Ms(s.ttft_s.mean));
  row("Median TTFT (ms):", Ms(s.ttft_s.p50));
  row("P90 TTFT (ms):", Ms(s.ttft_s.p90));
  row("P99 TTFT (ms):", Ms(s.ttft_s.p99));
  head("Time per Output Token (excl. 1st token)");
  row("Mean TPOT (ms):", Ms(s.tpot_s.mean));
  row("Median TPOT (ms):", Ms(s.tpot_s.p50));
  row("P99 TPOT (ms):", Ms(s.tpot_s.p99));
  head("Inter-token Latency");
  row("Mean ITL (ms):", Ms(s.itl_s.mean));
  row("Median ITL (ms):", Ms(s.itl_s.p50));
  row("P99 ITL (ms):", Ms(s.itl_s.p99));
  head("End-to-end Latency");
  row("Mean E2EL (ms):", Ms(s.e2e_s.mean));
  row("Median E2EL (ms):", Ms(s.e2e_s.p50));
  row("P99 E2EL (ms):", Ms(s.e2e_s.p99));
  for (const GroupSummary& g : s.groups) {
    head(fmt::format("{} {}", g.kind == "tenant" ? "Tenant" : "Priority", g.label));
    row("Requests (ok/sent):", fmt::format("{}/{}", g.ok, g.requests));
    row("Output token throughput (tok/s):", fmt::format("{:.2f}", g.output_throughput));
    row("Median / P90 / P99 TTFT (ms):",
        fmt::format("{} / {} / {}", Ms(g.ttft_s.p50), Ms(g.ttft_s.p90), Ms(g.ttft_s.p99)));
    row("Median / P99 TPOT (ms):", fmt::format("{} / {}", Ms(g.tpot_s.p50), Ms(g.tpot_s.p99)));
    row("Median / P99 E2EL (ms):", fmt::format("{} / {}", Ms(g.e2e_s.p50), Ms(g.e2e_s.p99)));
  }
  t += std::string(52, '=') + "\n";
  if (info.slo.any()) t += "SLO: " + SloText(info.slo) + "\n";
  if (info.dropped_turns > 0 || info.aborted_sessions > 0) {
    t += fmt::format("Not sent: {} follow-up turns (bound reached), {} conversations cut by a "
                     "failed turn\n",
                     info.dropped_turns, info.aborted_sessions);
  }
  return t;
}

nlohmann::json ToJson(const RunInfo& info, const Summary& s,
                      const std::vector<RequestRecord>& records) {
  nlohmann::json j;
  j["label"] = info.label;
  j["command"] = info.command;
  j["target"] = info.target;
  j["model"] = info.model;
  j["max_model_len"] = info.max_model_len;
  j["workload"] = info.workload;
  j["arrival"] = info.arrival;
  j["bounds"] = info.bounds;
  j["started_utc"] = info.started_utc;
  j["ignore_eos"] = info.ignore_eos;
  j["requests"] = s.requests;
  j["completed"] = s.ok;
  j["failed"] = s.failed;
  j["failed_by_status"] = s.failed_by_status;
  j["dropped_turns"] = info.dropped_turns;
  j["aborted_sessions"] = info.aborted_sessions;
  j["duration_s"] = s.duration_s;
  j["total_input_tokens"] = s.prompt_tokens;
  j["total_output_tokens"] = s.output_tokens;
  j["requested_output_tokens"] = s.requested_tokens;
  j["usage_prompt_tokens"] = s.usage_prompt_tokens;
  j["cached_prompt_tokens"] = s.cached_prompt_tokens;
  j["cached_token_ratio"] = s.cached_token_ratio;
  j["request_throughput"] = s.request_throughput;
  j["output_throughput"] = s.output_throughput;
  j["total_token_throughput"] = s.total_token_throughput;
  j["max_inflight"] = s.max_inflight;
  AddDist(j, "ttft", s.ttft_s);
  AddDist(j, "tpot", s.tpot_s);
  AddDist(j, "itl", s.itl_s);
  AddDist(j, "e2el", s.e2e_s);
  nlohmann::json slo = nlohmann::json::object();
  if (info.slo.ttft_s) slo["ttft_ms"] = *info.slo.ttft_s * 1000;
  if (info.slo.itl_s) slo["itl_ms"] = *info.slo.itl_s * 1000;
  if (info.slo.tpot_s) slo["tpot_ms"] = *info.slo.tpot_s * 1000;
  if (info.slo.e2e_s) slo["e2el_ms"] = *info.slo.e2e_s * 1000;
  j["slo"] = slo;
  // "by_tenant" / "by_priority": {label: {requests, completed, output_tokens, ...}}.
  for (const GroupSummary& g : s.groups) {
    nlohmann::json x;
    x["requests"] = g.requests;
    x["completed"] = g.ok;
    x["output_tokens"] = g.output_tokens;
    x["output_throughput"] = g.output_throughput;
    AddDist(x, "ttft", g.ttft_s);
    AddDist(x, "tpot", g.tpot_s);
    AddDist(x, "e2el", g.e2e_s);
    j[g.kind == "tenant" ? "by_tenant" : "by_priority"][g.label] = std::move(x);
  }
  j["good_requests"] = s.good;
  j["goodput"] = s.goodput;
  const double bin = ThroughputBinSeconds(records);
  j["throughput_bin_s"] = bin;
  auto bins = TokensPerBin(records, bin);
  for (double& b : bins) b /= bin;
  j["output_throughput_over_time"] = bins;
  nlohmann::json per = nlohmann::json::array();
  for (const auto& r : records) {
    nlohmann::json x;
    x["session"] = r.session;
    x["turn"] = r.turn;
    x["send_s"] = r.send_s;
    x["ok"] = r.ok;
    if (!r.ok) {
      x["error"] = r.error;
      x["message"] = r.message;
    }
    x["ttft_ms"] = r.ttft_s >= 0 ? nlohmann::json(r.ttft_s * 1000) : nlohmann::json(nullptr);
    x["e2el_ms"] = r.e2e_s * 1000;
    x["prompt_tokens"] = r.prompt_tokens;
    x["requested_tokens"] = r.requested_tokens;
    x["output_tokens"] = r.output_tokens;
    x["cached_prompt_tokens"] = r.cached_prompt_tokens;
    x["finish_reason"] = r.finish_reason;
    if (!r.tenant.empty()) x["tenant"] = r.tenant;
    if (r.priority) x["priority"] = *r.priority;
    // With a mix, when each token arrived (fair-share analysis).
    if ((!r.tenant.empty() || r.priority) && !r.chunk_times_s.empty()) {
      x["chunk_times_s"] = r.chunk_times_s;
      x["chunk_tokens"] = r.chunk_tokens;
    }
    per.push_back(std::move(x));
  }
  j["per_request"] = std::move(per);
  return j;
}

}  // namespace tandem::loadgen
