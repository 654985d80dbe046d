#include "loadgen/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace tandem::loadgen {

std::optional<double> RequestRecord::Tpot() const {
  if (!ok || output_tokens < 2 || ttft_s < 0) return std::nullopt;
  return (e2e_s - ttft_s) / double(output_tokens - 1);
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
}

Distribution Summarize(const std::vector<double>& v) {
  Distribution d;
  d.count = v.size();
  if (v.empty()) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    d.mean = d.p50 = d.p90 = d.p99 = d.min = d.max = nan;
    return d;
  }
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  d.mean = std::accumulate(s.begin(), s.end(), 0.0) / double(s.size());
  d.p50 = Percentile(s, 50);
  d.p90 = Percentile(s, 90);
  d.p99 = Percentile(s, 99);
  d.min = s.front();
  d.max = s.back();
  return d;
}

bool MeetsSlo(const RequestRecord& r, const Slo& slo) {
  if (!r.ok) return false;
  if (slo.ttft_s && (r.ttft_s < 0 || r.ttft_s > *slo.ttft_s)) return false;
  if (slo.itl_s) {
    for (double g : r.itl_s) {
      if (g > *slo.itl_s) return false;
    }
  }
  if (slo.tpot_s) {
    const auto t = r.Tpot();
    if (t && *t > *slo.tpot_s) return false;
  }
  if (slo.e2e_s && r.e2e_s > *slo.e2e_s) return false;
  return true;
}

std::map<std::string, std::string> FirstFailureMessages(const std::vector<RequestRecord>& records) {
  std::map<std::string, std::string> first;
  for (const auto& r : records) {
    if (!r.ok) first.emplace(r.error.empty() ? "UNKNOWN" : r.error, r.message);
  }
  return first;
}

Summary Summarize(const std::vector<RequestRecord>& records, const Slo& slo) {
  Summary s;
  s.requests = records.size();
  std::vector<double> ttft, itl, tpot, e2e;
  double first = std::numeric_limits<double>::infinity(), last = 0;
  // Requests in flight over time, from send/finish events.
  std::vector<std::pair<double, int>> events;
  for (const auto& r : records) {
    first = std::min(first, r.send_s);
    last = std::max(last, r.send_s + r.e2e_s);
    events.push_back({r.send_s, +1});
    events.push_back({r.send_s + r.e2e_s, -1});
    s.prompt_tokens += r.prompt_tokens;
    s.requested_tokens += r.requested_tokens;
    if (!r.ok) {
      ++s.failed;
      ++s.failed_by_status[r.error.empty() ? "UNKNOWN" : r.error];
      continue;
    }
    ++s.ok;
    s.output_tokens += r.output_tokens;
    s.cached_prompt_tokens += r.cached_prompt_tokens;
    s.usage_prompt_tokens += r.usage_prompt_tokens;
    if (r.ttft_s >= 0) ttft.push_back(r.ttft_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    if (auto t = r.Tpot()) tpot.push_back(*t);
    e2e.push_back(r.e2e_s);
    if (MeetsSlo(r, slo)) ++s.good;
  }
  std::sort(events.begin(), events.end());  // a finish (-1) sorts before a send at the same time
  int inflight = 0;
  for (const auto& [t, d] : events) {
    inflight += d;
    s.max_inflight = std::max<double>(s.max_inflight, inflight);
  }
  s.duration_s = records.empty() ? 0.0 : last - first;
  s.ttft_s = Summarize(ttft);
  s.itl_s = Summarize(itl);
  s.tpot_s = Summarize(tpot);
  s.e2e_s = Summarize(e2e);
  if (s.duration_s > 0) {
    s.request_throughput = double(s.ok) / s.duration_s;
    s.output_throughput = double(s.output_tokens) / s.duration_s;
    s.total_token_throughput = double(s.usage_prompt_tokens + s.output_tokens) / s.duration_s;
    s.goodput = double(s.good) / s.duration_s;
  }
  s.cached_token_ratio =
      s.usage_prompt_tokens > 0 ? double(s.cached_prompt_tokens) / double(s.usage_prompt_tokens) : 0;

  // Per tenant, then per priority (in order of value).
  struct Acc {
    GroupSummary g;
    std::vector<double> ttft, tpot, e2e;
  };
  std::map<std::string, Acc> by_tenant;
  std::map<int32_t, Acc> by_priority;
  for (const auto& r : records) {
    std::vector<Acc*> accs;
    if (!r.tenant.empty()) accs.push_back(&by_tenant[r.tenant]);
    if (r.priority) accs.push_back(&by_priority[*r.priority]);
    for (Acc* a : accs) {
      ++a->g.requests;
      if (!r.ok) continue;
      ++a->g.ok;
      a->g.output_tokens += r.output_tokens;
      if (r.ttft_s >= 0) a->ttft.push_back(r.ttft_s);
      if (auto t = r.Tpot()) a->tpot.push_back(*t);
      a->e2e.push_back(r.e2e_s);
    }
  }
  auto finish = [&](Acc& a, std::string kind, std::string label) {
    a.g.kind = std::move(kind);
    a.g.label = std::move(label);
    a.g.ttft_s = Summarize(a.ttft);
    a.g.tpot_s = Summarize(a.tpot);
    a.g.e2e_s = Summarize(a.e2e);
    if (s.duration_s > 0) a.g.output_throughput = double(a.g.output_tokens) / s.duration_s;
    s.groups.push_back(std::move(a.g));
  };
  for (auto& [name, a] : by_tenant) finish(a, "tenant", name);
  for (auto& [p, a] : by_priority) finish(a, "priority", std::to_string(p));
  return s;
}

std::vector<double> TokensPerBin(const std::vector<RequestRecord>& records, double bin_s) {
  std::vector<double> bins;
  if (!(bin_s > 0)) return bins;
  for (const auto& r : records) {
    for (size_t i = 0; i < r.chunk_times_s.size(); ++i) {
      const size_t b = size_t(std::max(0.0, r.chunk_times_s[i]) / bin_s);
      if (b >= bins.size()) bins.resize(b + 1, 0.0);
      bins[b] += r.chunk_tokens[i];
    }
  }
  return bins;
}

}  // namespace tandem::loadgen
