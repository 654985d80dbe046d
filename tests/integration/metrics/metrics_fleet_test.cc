// The metrics of a real fleet (tandem launch, gRPC, UCX on 127.0.0.1)
// against what the test sent: histogram counts equal requests and tokens,
// prefix-cache counters move by the shared prefixes, transfer bytes equal
// the blocks moved times the block size, every series exists at start-up,
// and every metric the Grafana dashboard queries is exported.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fleet_harness.h"
#include "prom_text.h"

namespace tandem::testing {
namespace {

using Labels = std::map<std::string, std::string>;

constexpr uint32_t kBlockSize = 16;  // the harness's fleet file
constexpr uint32_t kVocab = 4096;

const std::vector<std::string> kProxyHistograms = {
    "tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
    "tandem_time_per_output_token_seconds", "tandem_e2e_request_latency_seconds"};
const std::vector<std::string> kWorkerHistograms = {
    "tandem_kv_transfer_seconds", "tandem_kv_transfer_overhead_ratio", "tandem_prefill_seconds",
    "tandem_decode_step_seconds", "tandem_decoder_inter_token_latency_seconds"};
const std::vector<std::string> kWorkerScalars = {
    "tandem_kv_cache_usage_ratio",           "tandem_num_requests_running",
    "tandem_num_requests_waiting",           "tandem_prefix_cache_queries_tokens_total",
    "tandem_prefix_cache_hits_tokens_total", "tandem_kv_transfer_bytes_total",
    "tandem_preemptions_total",              "tandem_kv_reservations",
    "tandem_prefill_queue_requests",         "tandem_kv_lease_expired_total"};

// Bytes of one KV block of the bundled model: [layer][K,V][kv_head][token][head_dim] f32.
uint64_t BlockBytes() {
  std::ifstream in(BundledModel() + "/config.json");
  const auto c = nlohmann::json::parse(in);
  return uint64_t{c.at("num_hidden_layers").get<uint32_t>()} * 2 *
         c.at("num_key_value_heads").get<uint32_t>() * kBlockSize * c.at("head_dim").get<uint32_t>() *
         sizeof(float);
}

PromText ScrapeOrDie(const std::string& address) {
  auto text = Scrape(address);
  EXPECT_TRUE(text.ok()) << address << ": " << text.status().ToString();
  return text.ok() ? PromText::Parse(*text) : PromText{};
}

// A worker's scrape is current (its counters are sampled on every scrape,
// docs/metrics.md "When values are current"): wait (bounded) for the event
// "this worker is idle" — nothing running, waiting, reserved, parked or
// queued — and return that scrape.
PromText SettledScrape(const std::string& address) {
  PromText last;
  const bool idle = WaitUntil(
      [&] {
        last = ScrapeOrDie(address);
        for (const char* n : {"tandem_num_requests_running", "tandem_num_requests_waiting",
                              "tandem_kv_reservations", "tandem_kv_parked_prefills",
                              "tandem_prefill_queue_requests"}) {
          if (last.Sum(n) != 0) return false;
        }
        return true;
      },
      std::chrono::seconds(15));
  EXPECT_TRUE(idle) << "worker at " << address << " did not become idle";
  return last;
}

const WorkerAddr* FindRole(const Fleet& f, const std::string& role) {
  for (const auto& w : f.workers()) {
    if (w.role == role) return &w;
  }
  return nullptr;
}

// Every series of DESIGN.md section 7 (and the extras) exists before any
// request, at zero, with the labels model, role and worker.
void ExpectStartupSeries(const Fleet& f) {
  const PromText proxy = ScrapeOrDie(f.proxy_metrics());
  const Labels pl = {{"model", "tandem-kjv"}, {"role", "proxy"}, {"worker", "proxy"}};
  for (const auto& h : kProxyHistograms) {
    EXPECT_EQ(proxy.types.count(h) ? proxy.types.at(h) : "", "histogram") << h;
    EXPECT_EQ(proxy.Count(h + "_count", pl), 1u) << h;
    EXPECT_EQ(proxy.Sum(h + "_count", pl), 0) << h;
  }
  for (const char* o : {"ok", "invalid", "rejected", "failed", "cancelled"}) {
    Labels l = pl;
    l["outcome"] = o;
    EXPECT_EQ(proxy.Count("tandem_requests_total", l), 1u) << o;
    EXPECT_EQ(proxy.Sum("tandem_requests_total", l), 0) << o;
  }
  EXPECT_EQ(proxy.Count("tandem_requests_inflight", pl), 1u);
  EXPECT_EQ(proxy.Count("tandem_request_retries_total", pl), 1u);
  EXPECT_EQ(proxy.Count("tandem_kv_transfer_overhead_ratio_recent_p50", pl), 1u);

  for (const auto& w : f.workers()) {
    const PromText t = ScrapeOrDie(w.metrics);
    const Labels wl = {{"model", "tandem-kjv"}, {"role", w.role}, {"worker", w.name}};
    for (const auto& h : kWorkerHistograms) {
      EXPECT_EQ(t.types.count(h) ? t.types.at(h) : "", "histogram") << w.name << " " << h;
      EXPECT_EQ(t.Count(h + "_count", wl), 1u) << w.name << " " << h;
      EXPECT_EQ(t.Sum(h + "_count", wl), 0) << w.name << " " << h;
    }
    for (const auto& s : kWorkerScalars) {
      EXPECT_EQ(t.Count(s, wl), 1u) << w.name << " " << s;
      EXPECT_EQ(t.Sum(s, wl), 0) << w.name << " " << s;
    }
    EXPECT_EQ(t.types.count("tandem_kv_cache_usage_ratio") ? t.types.at("tandem_kv_cache_usage_ratio")
                                                           : "",
              "gauge");
  }
}

struct Req {
  std::vector<uint32_t> prompt;
  uint32_t max_tokens;
  uint32_t shared_full_blocks;  // full blocks shared with an earlier request (0: cold)
};

// Two groups sharing a long prefix (4 and 3 full blocks), one cold prompt,
// and max_tokens of 1 (no ITL gap, no TPOT) up to 12.
std::vector<Req> Workload() {
  return {
      {PromptIds(11, 80, kVocab, 1, 64), 5, 0},  {PromptIds(12, 90, kVocab, 1, 64), 8, 4},
      {PromptIds(21, 50, kVocab, 2, 48), 1, 0},  {PromptIds(22, 70, kVocab, 2, 48), 12, 3},
      {PromptIds(23, 60, kVocab, 2, 48), 3, 3},  {PromptIds(31, 30, kVocab), 7, 0},
  };
}

uint32_t Blocks(size_t tokens) { return static_cast<uint32_t>((tokens + kBlockSize - 1) / kBlockSize); }

// Hits a prompt can have at most: full blocks, leaving the last token to compute.
uint32_t MaxHitTokens(size_t n) { return static_cast<uint32_t>((n - 1) / kBlockSize * kBlockSize); }

void ExpectProxyCounts(const PromText& proxy, const std::vector<Req>& reqs) {
  double itl = 0, tpot = 0, out = 0, prompt = 0;
  for (const auto& r : reqs) {
    itl += r.max_tokens - 1;
    tpot += r.max_tokens > 1 ? 1 : 0;
    out += r.max_tokens;
    prompt += static_cast<double>(r.prompt.size());
  }
  const double n = static_cast<double>(reqs.size());
  EXPECT_EQ(proxy.Sum("tandem_time_to_first_token_seconds_count"), n);
  EXPECT_EQ(proxy.Sum("tandem_e2e_request_latency_seconds_count"), n);
  EXPECT_EQ(proxy.Sum("tandem_inter_token_latency_seconds_count"), itl);
  EXPECT_EQ(proxy.Sum("tandem_time_per_output_token_seconds_count"), tpot);
  EXPECT_EQ(proxy.Sum("tandem_requests_total", {{"outcome", "ok"}}), n);
  EXPECT_EQ(proxy.Sum("tandem_requests_total"), n);  // no other outcome
  EXPECT_EQ(proxy.Sum("tandem_requests_inflight"), 0);
  EXPECT_EQ(proxy.Sum("tandem_generation_tokens_total"), out);
  EXPECT_EQ(proxy.Sum("tandem_prompt_tokens_total"), prompt);
  // The +Inf bucket holds every observation; the sums are real durations.
  EXPECT_EQ(proxy.Sum("tandem_time_to_first_token_seconds_bucket", {{"le", "+Inf"}}), n);
  EXPECT_GT(proxy.Sum("tandem_time_to_first_token_seconds_sum"), 0);
  // e2e >= TTFT for every request, so the sums are ordered too.
  EXPECT_GE(proxy.Sum("tandem_e2e_request_latency_seconds_sum"),
            proxy.Sum("tandem_time_to_first_token_seconds_sum"));
}

TEST(MetricsFleet, DisaggregatedCountsMatchTheRequestsSent) {
  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const Fleet& f = **fleet;
  const WorkerAddr* p = FindRole(f, "prefill");
  const WorkerAddr* d = FindRole(f, "decode");
  ASSERT_TRUE(p && d);
  EXPECT_EQ(p->name, "prefill-0");
  ExpectStartupSeries(f);

  const uint64_t block_bytes = BlockBytes();
  const std::vector<Req> reqs = Workload();
  PromText p_before = SettledScrape(p->metrics);
  PromText d_before = SettledScrape(d->metrics);
  uint64_t bytes_expected = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const Req& r = reqs[i];
    GenerateArgs a;
    a.prompt_ids = r.prompt;
    a.max_tokens = r.max_tokens;
    auto c = Generate(f.proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->completion_tokens, r.max_tokens);
    const PromText p_after = SettledScrape(p->metrics);
    const PromText d_after = SettledScrape(d->metrics);
    auto delta = [](const PromText& a, const PromText& b, const std::string& name) {
      return b.Sum(name) - a.Sum(name);
    };
    const double n = static_cast<double>(r.prompt.size());
    // The prefiller looks up every prompt token once; a shared prefix hits
    // at least its full blocks (and never the last token).
    const double p_hits = delta(p_before, p_after, "tandem_prefix_cache_hits_tokens_total");
    EXPECT_EQ(delta(p_before, p_after, "tandem_prefix_cache_queries_tokens_total"), n);
    if (r.shared_full_blocks == 0) {
      EXPECT_EQ(p_hits, 0);
    } else {
      EXPECT_GE(p_hits, r.shared_full_blocks * kBlockSize);
    }
    EXPECT_LE(p_hits, MaxHitTokens(r.prompt.size()));
    EXPECT_EQ(c->cached_prompt_tokens, p_hits);  // usage reports the prefiller's hits
    // The decoder looks the prompt up when it reserves; it holds the shared
    // blocks of the finished earlier request.
    const double d_hits = delta(d_before, d_after, "tandem_prefix_cache_hits_tokens_total");
    EXPECT_EQ(delta(d_before, d_after, "tandem_prefix_cache_queries_tokens_total"), n);
    if (r.shared_full_blocks == 0) {
      EXPECT_EQ(d_hits, 0);
    } else {
      EXPECT_GE(d_hits, r.shared_full_blocks * kBlockSize);
    }
    // Transferred: every prompt block the decoder lacked, whole blocks.
    const uint64_t moved = Blocks(r.prompt.size()) - static_cast<uint64_t>(d_hits) / kBlockSize;
    EXPECT_EQ(delta(p_before, p_after, "tandem_kv_transfer_bytes_total"),
              static_cast<double>(moved * block_bytes));
    bytes_expected += moved * block_bytes;
    EXPECT_EQ(delta(p_before, p_after, "tandem_prefill_seconds_count"), 1);
    EXPECT_EQ(delta(p_before, p_after, "tandem_kv_transfer_seconds_count"), 1);
    EXPECT_EQ(delta(p_before, p_after, "tandem_kv_transfer_overhead_ratio_count"), 1);
    // The decoder hands off every token, the prefiller's first included (its
    // KV notice): as many gaps as the client's (one per token after the first).
    EXPECT_EQ(delta(d_before, d_after, "tandem_decoder_inter_token_latency_seconds_count"),
              r.max_tokens - 1);
    EXPECT_EQ(delta(p_before, p_after, "tandem_decoder_inter_token_latency_seconds_count"), 0);
    p_before = p_after;
    d_before = d_after;
  }

  const PromText proxy = ScrapeOrDie(f.proxy_metrics());
  ExpectProxyCounts(proxy, reqs);
  EXPECT_GT(proxy.Sum("tandem_kv_transfer_overhead_ratio_recent_p50"), 0);
  const double n = static_cast<double>(reqs.size());
  // Prefill happens on the prefiller only; decode steps on the decoder only.
  EXPECT_EQ(p_before.Sum("tandem_prefill_seconds_count"), n);
  EXPECT_EQ(d_before.Sum("tandem_prefill_seconds_count"), 0);
  EXPECT_GT(d_before.Sum("tandem_decode_step_seconds_count"), 0);
  EXPECT_EQ(p_before.Sum("tandem_decode_step_seconds_count"), 0);
  // The decoder's gaps are the proxy's, one for one; real durations.
  EXPECT_EQ(d_before.Sum("tandem_decoder_inter_token_latency_seconds_count"),
            proxy.Sum("tandem_inter_token_latency_seconds_count"));
  EXPECT_GT(d_before.Sum("tandem_decoder_inter_token_latency_seconds_sum"), 0);
  EXPECT_EQ(p_before.Sum("tandem_kv_transfer_bytes_total"), static_cast<double>(bytes_expected));
  EXPECT_GT(bytes_expected, 0u);
  EXPECT_EQ(d_before.Sum("tandem_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(p_before.Sum("tandem_preemptions_total") + d_before.Sum("tandem_preemptions_total"), 0);
  EXPECT_EQ(d_before.Sum("tandem_kv_lease_expired_total"), 0);
}

TEST(MetricsFleet, AggregatedCountsMatchTheRequestsSent) {
  FleetOptions o;
  o.prefill = 0;
  o.decode = 0;
  o.both = 1;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const Fleet& f = **fleet;
  const WorkerAddr* b = FindRole(f, "both");
  ASSERT_TRUE(b);
  ExpectStartupSeries(f);

  const std::vector<Req> reqs = Workload();
  PromText before = SettledScrape(b->metrics);
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const Req& r = reqs[i];
    GenerateArgs a;
    a.prompt_ids = r.prompt;
    a.max_tokens = r.max_tokens;
    auto c = Generate(f.proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->completion_tokens, r.max_tokens);
    const PromText after = SettledScrape(b->metrics);
    const double hits = after.Sum("tandem_prefix_cache_hits_tokens_total") -
                        before.Sum("tandem_prefix_cache_hits_tokens_total");
    EXPECT_EQ(after.Sum("tandem_prefix_cache_queries_tokens_total") -
                  before.Sum("tandem_prefix_cache_queries_tokens_total"),
              static_cast<double>(r.prompt.size()));
    if (r.shared_full_blocks == 0) {
      EXPECT_EQ(hits, 0);
    } else {
      EXPECT_GE(hits, r.shared_full_blocks * kBlockSize);
    }
    EXPECT_LE(hits, MaxHitTokens(r.prompt.size()));
    EXPECT_EQ(c->cached_prompt_tokens, hits);
    EXPECT_EQ(after.Sum("tandem_decoder_inter_token_latency_seconds_count") -
                  before.Sum("tandem_decoder_inter_token_latency_seconds_count"),
              r.max_tokens - 1);
    before = after;
  }
  const PromText proxy = ScrapeOrDie(f.proxy_metrics());
  ExpectProxyCounts(proxy, reqs);
  const double n = static_cast<double>(reqs.size());
  EXPECT_EQ(before.Sum("tandem_prefill_seconds_count"), n);  // local prefills
  EXPECT_GT(before.Sum("tandem_decode_step_seconds_count"), 0);
  // Nothing moves between processes.
  EXPECT_EQ(before.Sum("tandem_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(before.Sum("tandem_kv_transfer_seconds_count"), 0);
  EXPECT_EQ(before.Sum("tandem_kv_transfer_overhead_ratio_count"), 0);
  EXPECT_EQ(proxy.Sum("tandem_kv_transfer_overhead_ratio_recent_p50"), 0);
}

// Metric names in PromQL expressions: tandem_ identifiers.
std::set<std::string> DashboardMetrics(const nlohmann::json& j) {
  std::set<std::string> out;
  static const std::regex re("tandem_[a-zA-Z0-9_:]+");
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) {
      if (v.is_string() && (k == "expr" || k == "query" || k == "definition")) {
        const std::string s = v.get<std::string>();
        for (std::sregex_iterator it(s.begin(), s.end(), re), end; it != end; ++it) {
          out.insert(it->str());
        }
      } else {
        for (const auto& m : DashboardMetrics(v)) out.insert(m);
      }
    }
  } else if (j.is_array()) {
    for (const auto& v : j) {
      for (const auto& m : DashboardMetrics(v)) out.insert(m);
    }
  }
  return out;
}

TEST(MetricsFleet, EveryDashboardMetricIsExported) {
  std::ifstream in(std::string(TANDEM_SOURCE_DIR) + "/deploy/grafana/tandem.json");
  ASSERT_TRUE(in.good());
  const auto dash = nlohmann::json::parse(in);
  const std::set<std::string> wanted = DashboardMetrics(dash);
  // The dashboard shows the metrics of DESIGN.md section 7 at least.
  for (const char* m : {"tandem_time_to_first_token_seconds_bucket",
                        "tandem_inter_token_latency_seconds_bucket",
                        "tandem_kv_cache_usage_ratio", "tandem_num_requests_waiting",
                        "tandem_kv_transfer_bytes_total", "tandem_kv_transfer_overhead_ratio_bucket",
                        "tandem_generation_tokens_total"}) {
    EXPECT_TRUE(wanted.count(m)) << "the dashboard does not query " << m;
  }

  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  // The targets Prometheus would scrape: deploy/prometheus/tandem_file_sd.py
  // run on the launch state file (next to the fleet file).
  const std::string dir = (*fleet)->config_path().substr(0, (*fleet)->config_path().rfind('/'));
  const std::string sd = dir + "/targets.json";
  const std::string cmd = std::string("python3 ") + TANDEM_SOURCE_DIR +
                          "/deploy/prometheus/tandem_file_sd.py " + dir + "/state.json --out " + sd +
                          " --fleet test >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream sd_in(sd);
  const auto groups = nlohmann::json::parse(sd_in);
  std::set<std::string> targets, processes;
  for (const auto& g : groups) {
    for (const auto& t : g.at("targets")) targets.insert(t.get<std::string>());
    processes.insert(g.at("labels").at("process").get<std::string>());
    EXPECT_EQ(g.at("labels").at("fleet"), "test");
  }
  std::set<std::string> want_targets = {(*fleet)->proxy_metrics()};
  for (const auto& w : (*fleet)->workers()) want_targets.insert(w.metrics);
  EXPECT_EQ(targets, want_targets);
  EXPECT_EQ(processes, (std::set<std::string>{"proxy", "prefill-0", "decode-0"}));

  std::set<std::string> exported;
  for (const auto& t : targets) {
    for (const auto& n : ScrapeOrDie(t).QueryableNames()) exported.insert(n);
  }
  for (const auto& m : wanted) EXPECT_TRUE(exported.count(m)) << m << " is not exported";
  // And the dashboard is the one an operator imports: it has panels and a
  // datasource variable.
  EXPECT_GE(dash.at("panels").size(), 8u);
  EXPECT_EQ(dash.at("uid"), "tandem");
}

// --log-format json: every process writes JSON lines, and the lines about
// one request carry its id in every process it passes through.
TEST(MetricsFleet, RequestIdOnTheLogLinesOfEveryProcess) {
  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  o.log_level = "debug";
  o.log_format = "json";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string id = "obs-trace-7";
  GenerateArgs a;
  a.prompt_ids = PromptIds(5, 40, kVocab);
  a.max_tokens = 4;
  a.request_id = id;
  auto c = Generate((*fleet)->proxy_grpc(), a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();

  // What each process must say about the request (docs/metrics.md, "Logs").
  const std::map<std::string, std::vector<std::string>> expected = {
      {"proxy", {"arrived", "attempt 1", "finished"}},
      {"prefill-0", {"queued", "pushed"}},
      {"decode-0", {"registered", "reserved", "KV notice"}},
  };
  std::map<std::string, std::vector<std::string>> seen;  // proc -> msgs about `id`
  int json_lines = 0;
  auto complete = [&] {
    for (const auto& [proc, words] : expected) {
      for (const auto& w : words) {
        bool found = false;
        for (const auto& m : seen[proc]) found = found || m.find(w) != std::string::npos;
        if (!found) return false;
      }
    }
    return true;
  };
  // The event: every process has logged its lines about the request (bounded).
  WaitUntil([&] {
    seen.clear();
    json_lines = 0;
    std::ifstream in((*fleet)->log_path());
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] != '{') continue;  // the launcher's table on stdout
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "not JSON: " << line;
        continue;
      }
      ++json_lines;
      for (const char* k : {"ts", "level", "proc", "msg"}) EXPECT_TRUE(j.contains(k)) << line;
      if (j.value("request_id", "") == id) seen[j.at("proc")].push_back(j.at("msg"));
    }
    return complete();
  }, std::chrono::seconds(10));
  EXPECT_GT(json_lines, 0);
  for (const auto& [proc, words] : expected) {
    for (const auto& w : words) {
      bool found = false;
      for (const auto& m : seen[proc]) found = found || m.find(w) != std::string::npos;
      EXPECT_TRUE(found) << proc << " logged no line with request_id " << id << " saying '" << w
                         << "'";
    }
  }
}

}  // namespace
}  // namespace tandem::testing
