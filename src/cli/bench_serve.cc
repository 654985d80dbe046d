// `tandem bench serve`: load generator over the public API (src/loadgen).
// Flags, definitions and output: docs/bench-serve.md.
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "loadgen/grpc_client.h"
#include "loadgen/http_client.h"
#include "loadgen/mooncake_trace.h"
#include "loadgen/report.h"
#include "loadgen/runner.h"
#include "loadgen/workload.h"

namespace tandem::cli {
namespace {

namespace lg = tandem::loadgen;

struct ServeArgs {
  std::string proxy;  // empty: 127.0.0.1:50051 (grpc) or 127.0.0.1:8000 (http)
  std::string state_file;
  bool all_proxies = false;  // --all-proxies: round-robin over the state file's `proxies`
  std::string api_key;
  std::string tenant_api_keys;  // NAME=KEY[:WEIGHT],...
  std::string priority;         // P or P:WEIGHT,...
  std::string backend = "grpc";
  uint32_t vocab_size = 0;  // http: /v1/models does not list it
  std::string model;
  std::string request_id_prefix;  // empty: bench-<pid>
  std::string label;
  // Workload.
  std::string trace;
  std::string input_len = "128";
  std::string output_len = "128";
  uint32_t prefix_groups = 0;
  uint32_t prefix_len = 0;
  uint32_t turns = 1;
  uint64_t trace_skip = 0;
  uint32_t trace_block_tokens = lg::kMooncakeBlockTokens;
  double trace_output_scale = 1.0;
  double time_scale = 1.0;
  // Arrival and bounds.
  std::string request_rate;  // "" = unset, a number or "inf"
  uint32_t concurrency = 0;
  uint32_t max_concurrency = 0;
  uint64_t num_requests = 0;
  double duration_s = 0;
  // Sampling.
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  double request_timeout_s = 300;
  // SLOs (ms; < 0 = unset).
  double slo_ttft_ms = -1, slo_itl_ms = -1, slo_tpot_ms = -1, slo_e2e_ms = -1;
  // Output.
  std::string json_path;
  std::string report_path;
  bool progress = false, no_progress = false;
};

std::string CommandLine() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string out;
  size_t start = 0;
  bool first = true;
  while (start < raw.size()) {
    size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    std::string arg = raw.substr(start, end - start);
    if (first) {
      arg = "tandem";
      first = false;
    }
    const bool quote = arg.find_first_of(" \t'\"$") != std::string::npos || arg.empty();
    out += (out.empty() ? "" : " ") + (quote ? "'" + arg + "'" : arg);
    start = end + 1;
  }
  return out;
}

std::string NowUtc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Status Fail(const std::string& msg) { return InvalidArgumentError(msg); }

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

Result<uint32_t> ParseWeight(const std::string& w, const std::string& flag, const std::string& item) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(w.c_str(), &end, 10);
  if (w.empty() || *end != '\0' || v < 1 || v > 1000000) {
    return Fail(fmt::format("{}: weight '{}' in '{}' must be an integer in [1, 1000000]", flag, w,
                            item));
  }
  return static_cast<uint32_t>(v);
}

// --tenant-api-keys NAME=KEY[:WEIGHT],...
Result<std::vector<lg::RunOptions::TenantClass>> ParseTenantKeys(const std::string& spec) {
  std::vector<lg::RunOptions::TenantClass> out;
  for (const std::string& item : SplitComma(spec)) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      return Fail(fmt::format("--tenant-api-keys: '{}' is not NAME=KEY[:WEIGHT]", item));
    }
    lg::RunOptions::TenantClass t;
    t.name = item.substr(0, eq);
    std::string key = item.substr(eq + 1);
    if (const size_t colon = key.rfind(':'); colon != std::string::npos) {
      auto w = ParseWeight(key.substr(colon + 1), "--tenant-api-keys", t.name);
      if (!w.ok()) return w.status();
      t.weight = *w;
      key.resize(colon);
    }
    if (key.empty()) return Fail(fmt::format("--tenant-api-keys: tenant '{}' has an empty key", t.name));
    t.api_key = key;
    out.push_back(std::move(t));
  }
  if (out.empty()) return Fail("--tenant-api-keys is empty; give NAME=KEY[:WEIGHT],...");
  return out;
}

// --priority P or P:WEIGHT,...
Result<std::vector<lg::RunOptions::PriorityClass>> ParsePriorities(const std::string& spec) {
  std::vector<lg::RunOptions::PriorityClass> out;
  for (const std::string& item : SplitComma(spec)) {
    lg::RunOptions::PriorityClass p;
    std::string value = item;
    if (const size_t colon = item.find(':'); colon != std::string::npos) {
      auto w = ParseWeight(item.substr(colon + 1), "--priority", item);
      if (!w.ok()) return w.status();
      p.weight = *w;
      value = item.substr(0, colon);
    }
    char* end = nullptr;
    const long v = std::strtol(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || v < std::numeric_limits<int32_t>::min() ||
        v > std::numeric_limits<int32_t>::max()) {
      return Fail(fmt::format("--priority: '{}' is not an integer priority (P or P:WEIGHT)", item));
    }
    p.priority = static_cast<int32_t>(v);
    out.push_back(p);
  }
  if (out.empty()) return Fail("--priority is empty; give P or P:WEIGHT,...");
  return out;
}

Result<std::string> ProxyFromState(const std::string& path, const std::string& api) {
  std::ifstream in(path);
  if (!in) return NotFoundError(fmt::format("cannot open --state-file '{}'", path));
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.contains("proxy") || !j["proxy"].contains(api) ||
      !j["proxy"][api].is_string()) {
    return InvalidArgumentError(
        fmt::format("--state-file '{}' has no string proxy.{} (write it with tandem launch "
                    "--state-file)",
                    path, api));
  }
  return j["proxy"][api].get<std::string>();
}

// --all-proxies: every proxy replica's address for `api` (issue 21).
Result<std::vector<std::string>> ProxiesFromState(const std::string& path, const std::string& api) {
  std::ifstream in(path);
  if (!in) return NotFoundError(fmt::format("cannot open --state-file '{}'", path));
  auto j = nlohmann::json::parse(in, nullptr, false);
  std::vector<std::string> out;
  if (!j.is_discarded() && j.contains("proxies") && j["proxies"].is_array()) {
    for (const auto& p : j["proxies"]) {
      if (p.contains(api) && p[api].is_string()) out.push_back(p[api].get<std::string>());
    }
  }
  if (out.empty()) {
    return InvalidArgumentError(fmt::format(
        "--all-proxies: --state-file '{}' lists no proxies[].{} (tandem launch writes them)", path,
        api));
  }
  return out;
}

// Requests go to the proxies in turn (--all-proxies): clients of a fleet with
// proxy.replicas spread over them, each proxy routing with its own index.
class RoundRobinClient final : public lg::Client {
 public:
  explicit RoundRobinClient(std::vector<std::unique_ptr<lg::Client>> clients)
      : clients_(std::move(clients)) {}
  void Start(lg::Request request, std::function<void(lg::Reply)> done) override {
    const size_t i = next_.fetch_add(1) % clients_.size();
    clients_[i]->Start(std::move(request), std::move(done));
  }
  void CancelAll() override {
    for (auto& c : clients_) c->CancelAll();
  }
  Result<lg::ModelInfo> GetModelInfo(const std::string& model) override {
    return clients_[0]->GetModelInfo(model);
  }
  std::string Describe() const override {
    std::string d;
    for (const auto& c : clients_) d += (d.empty() ? "" : ", ") + c->Describe();
    return fmt::format("{} proxies in turn: {}", clients_.size(), d);
  }

 private:
  std::vector<std::unique_ptr<lg::Client>> clients_;
  std::atomic<size_t> next_{0};
};

void PrintProgress(const lg::Progress& p, bool final_line) {
  std::string bound;
  if (p.num_requests > 0) bound = fmt::format("/{}", p.num_requests);
  std::string time = p.duration_s > 0 ? fmt::format("{:.1f}/{:.0f}s", p.elapsed_s, p.duration_s)
                                      : fmt::format("{:.1f}s", p.elapsed_s);
  const double tps = p.elapsed_s > 0 ? double(p.output_tokens) / p.elapsed_s : 0.0;
  std::cerr << fmt::format("\r[{}] sent {}{}  done {}  failed {}  in flight {}  {:.0f} out tok/s   ",
                           time, p.sent, bound, p.done, p.failed, p.inflight, tps);
  if (final_line) std::cerr << "\n";
  std::cerr << std::flush;
}

Status WriteFile(const std::string& path, const std::string& text, const char* flag) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return InvalidArgumentError(fmt::format("{}: cannot write '{}'", flag, path));
  out << text;
  out.close();
  if (!out) return InternalError(fmt::format("{}: writing '{}' failed", flag, path));
  return Status::Ok();
}

// Returns the exit code: 0 ran (some request succeeded), 1 bad input,
// 3 the run happened but no request succeeded, 4 the server was unreachable
// (or did not describe its model).
int RunServe(ServeArgs a) {
  const auto bad = [](const Status& s) {
    std::cerr << "tandem bench serve: " << s.message() << "\n";
    return 1;
  };
  // ---- flags ----
  if (a.backend != "grpc" && a.backend != "http") {
    return bad(Fail(fmt::format("--backend must be grpc or http, got '{}'", a.backend)));
  }
  const bool http = a.backend == "http";
  if (http && a.turns > 1) {
    return bad(Fail("--turns > 1 needs --backend grpc: a turn resends the reply's token ids, "
                    "which the OpenAI HTTP API does not return"));
  }
  if (!a.state_file.empty()) {
    if (!a.proxy.empty()) return bad(Fail("give either --proxy or --state-file, not both"));
    auto p = ProxyFromState(a.state_file, a.backend);
    if (!p.ok()) return bad(p.status());
    a.proxy = *p;
  }
  std::vector<std::string> proxies;
  if (a.all_proxies) {
    if (a.state_file.empty()) return bad(Fail("--all-proxies needs --state-file"));
    auto p = ProxiesFromState(a.state_file, a.backend);
    if (!p.ok()) return bad(p.status());
    proxies = *p;
  }
  if (a.proxy.empty()) a.proxy = http ? "127.0.0.1:8000" : "127.0.0.1:50051";
  lg::RunOptions ro;
  ro.num_requests = a.num_requests;
  ro.duration_s = a.duration_s;
  if (a.duration_s < 0 || a.duration_s > 7 * 86400) {
    return bad(Fail(fmt::format("--duration must be in [0, 604800] seconds, got {}", a.duration_s)));
  }
  const bool trace = !a.trace.empty();
  if (!trace && a.num_requests == 0 && a.duration_s == 0) {
    return bad(Fail("give a bound: --num-requests N and/or --duration SECONDS"));
  }
  if (!a.request_rate.empty() && a.concurrency > 0) {
    return bad(Fail("give either --request-rate or --concurrency, not both"));
  }
  lg::ArrivalOptions& arr = ro.arrival;
  arr.seed = a.seed;
  arr.max_concurrency = a.max_concurrency;
  if (a.concurrency > 0) {
    if (a.concurrency > 100000) {
      return bad(Fail(fmt::format("--concurrency must be in [1, 100000], got {}", a.concurrency)));
    }
    arr.kind = lg::ArrivalKind::kConcurrency;
    arr.concurrency = a.concurrency;
  } else if (!a.request_rate.empty()) {
    arr.kind = lg::ArrivalKind::kPoisson;
    if (a.request_rate == "inf") {
      arr.rate = std::numeric_limits<double>::infinity();
    } else {
      char* end = nullptr;
      arr.rate = std::strtod(a.request_rate.c_str(), &end);
      if (end == a.request_rate.c_str() || *end != '\0' || !(arr.rate > 0) ||
          !std::isfinite(arr.rate)) {
        return bad(Fail(fmt::format(
            "--request-rate must be a number > 0 (sessions per second) or 'inf', got '{}'",
            a.request_rate)));
      }
    }
    if (std::isinf(arr.rate) && a.num_requests == 0 && !trace) {
      return bad(Fail("--request-rate inf needs --num-requests"));
    }
  } else if (trace) {
    arr.kind = lg::ArrivalKind::kTrace;
  } else {
    // As vLLM's benchmark: everything at once unless told otherwise.
    arr.kind = lg::ArrivalKind::kPoisson;
    arr.rate = std::numeric_limits<double>::infinity();
    if (a.num_requests == 0) {
      return bad(Fail("without --request-rate or --concurrency all requests start at once, "
                      "which needs --num-requests"));
    }
  }
  if (!(a.request_timeout_s > 0) || a.request_timeout_s > 86400) {
    return bad(Fail(fmt::format("--request-timeout must be in (0, 86400] seconds, got {}",
                                a.request_timeout_s)));
  }
  if (a.temperature < 0 || a.temperature > 100) {
    return bad(Fail(fmt::format("--temperature must be in [0, 100], got {}", a.temperature)));
  }
  lg::Slo slo;
  for (auto [v, name, dst] : {std::tuple{a.slo_ttft_ms, "--slo-ttft-ms", &slo.ttft_s},
                              {a.slo_itl_ms, "--slo-itl-ms", &slo.itl_s},
                              {a.slo_tpot_ms, "--slo-tpot-ms", &slo.tpot_s},
                              {a.slo_e2e_ms, "--slo-e2e-ms", &slo.e2e_s}}) {
    if (v == -1) continue;
    if (!(v > 0) || v > 86'400'000) {
      return bad(Fail(fmt::format("{} must be in (0, 86400000] ms, got {}", name, v)));
    }
    *dst = v / 1000.0;
  }
  if (!a.tenant_api_keys.empty()) {
    auto t = ParseTenantKeys(a.tenant_api_keys);
    if (!t.ok()) return bad(t.status());
    ro.tenants = std::move(*t);
  }
  if (!a.priority.empty()) {
    auto p = ParsePriorities(a.priority);
    if (!p.ok()) return bad(p.status());
    ro.priorities = std::move(*p);
  }
  ro.temperature = a.temperature;
  ro.seed = a.seed;
  ro.ignore_eos = a.ignore_eos;
  ro.model = a.model;
  // Ids must be unique among the requests in flight at the proxy (it refuses
  // a duplicate): the pid keeps two generators against one fleet apart.
  ro.request_id_prefix =
      a.request_id_prefix.empty() ? fmt::format("bench-{}", getpid()) : a.request_id_prefix;
  ro.request_timeout = std::chrono::milliseconds(int64_t(a.request_timeout_s * 1000));

  // ---- what can be checked without the server ----
  std::vector<lg::TraceRecord> records;
  lg::LengthDist in_dist, out_dist;
  if (trace) {
    auto recs = lg::ReadMooncakeTrace(
        a.trace, a.num_requests > 0 ? a.trace_skip + a.num_requests : 0);
    if (!recs.ok()) return bad(recs.status());
    if (a.trace_skip >= recs->size()) {
      return bad(Fail(fmt::format("--trace-skip {}: the trace '{}' has only {} requests",
                                  a.trace_skip, a.trace, recs->size())));
    }
    records.assign(std::make_move_iterator(recs->begin() + a.trace_skip),
                   std::make_move_iterator(recs->end()));
  } else {
    auto in = lg::LengthDist::Parse(a.input_len, "--input-len");
    if (!in.ok()) return bad(in.status());
    auto out = lg::LengthDist::Parse(a.output_len, "--output-len");
    if (!out.ok()) return bad(out.status());
    in_dist = *in;
    out_dist = *out;
  }

  // ---- the server ----
  auto make_client = [&](const std::string& proxy) {
    return http ? lg::MakeHttpClient({proxy, a.api_key, a.vocab_size})
                : lg::MakeGrpcClient({proxy, a.api_key, 4});
  };
  std::unique_ptr<lg::Client> client;
  if (proxies.size() > 1) {
    std::vector<std::unique_ptr<lg::Client>> all;
    for (const auto& p : proxies) all.push_back(make_client(p));
    client = std::make_unique<RoundRobinClient>(std::move(all));
  } else {
    client = make_client(a.proxy);
  }
  auto info_or = client->GetModelInfo(a.model);
  if (!info_or.ok()) {
    std::cerr << "tandem bench serve: " << info_or.status().ToString() << "\n";
    return 4;
  }
  const lg::ModelInfo mi = *info_or;
  ro.model = mi.id;

  // ---- the workload ----
  std::unique_ptr<lg::SessionSource> source;
  uint64_t truncated = 0;
  if (trace) {
    lg::TraceReplayOptions to;
    to.block_tokens = a.trace_block_tokens;
    to.output_scale = a.trace_output_scale;
    to.time_scale = a.time_scale;
    to.vocab = mi.vocab_size;
    to.max_model_len = mi.max_model_len;
    auto replay = lg::BuildTraceReplay(records, to);
    if (!replay.ok()) return bad(replay.status());
    truncated = replay->truncated_prompts;
    source = lg::MakeListSource(std::move(replay->sessions), replay->description);
  } else {
    lg::SyntheticOptions so;
    so.input = in_dist;
    so.output = out_dist;
    so.prefix_groups = a.prefix_groups;
    so.prefix_len = a.prefix_len;
    so.turns = a.turns;
    so.seed = a.seed;
    so.vocab = mi.vocab_size;
    so.max_model_len = mi.max_model_len;
    if (Status s = lg::ValidateSynthetic(so); !s.ok()) return bad(s);
    source = lg::MakeSyntheticSource(so);
  }

  // ---- run ----
  const bool show_progress = !a.no_progress && (a.progress || isatty(STDERR_FILENO));
  lg::RunInfo info;
  info.label = a.label;
  info.command = CommandLine();
  info.target = client->Describe();
  info.model = mi.id;
  info.max_model_len = mi.max_model_len;
  info.workload = source->Describe();
  info.arrival = lg::Describe(arr);
  std::vector<std::string> bounds;
  if (a.num_requests > 0) bounds.push_back(fmt::format("{} requests", a.num_requests));
  if (a.duration_s > 0) bounds.push_back(fmt::format("{} s", a.duration_s));
  if (bounds.empty()) bounds.push_back("the whole trace");
  for (const auto& b : bounds) info.bounds += (info.bounds.empty() ? "" : " or ") + b;
  info.started_utc = NowUtc();
  info.slo = slo;
  info.ignore_eos = a.ignore_eos;
  std::cerr << fmt::format("tandem bench serve: {} -> {}; {}; arrival: {}; bound: {}\n",
                           info.model, proxies.size() > 1 ? info.target : a.proxy,
                           info.workload, info.arrival, info.bounds);
  if (truncated > 0) {
    std::cerr << fmt::format("tandem bench serve: {} trace prompts were cut to fit the "
                             "model's context of {} tokens\n",
                             truncated, mi.max_model_len);
  }
  std::function<void(const lg::Progress&)> progress;
  if (show_progress) progress = [](const lg::Progress& p) { PrintProgress(p, false); };
  auto run = lg::Run(*client, *source, ro, progress);
  if (show_progress) std::cerr << "\n";
  if (!run.ok()) return bad(run.status());
  info.dropped_turns = run->dropped_turns;
  info.aborted_sessions = run->aborted_sessions;
  const lg::Summary s = lg::Summarize(run->records, slo);

  // ---- output ----
  const bool json_stdout = a.json_path == "-";
  (json_stdout ? std::cerr : std::cout) << lg::FormatTable(info, s) << std::flush;
  if (!a.json_path.empty()) {
    const std::string text = lg::ToJson(info, s, run->records).dump(2) + "\n";
    if (json_stdout) {
      std::cout << text << std::flush;
    } else if (Status st = WriteFile(a.json_path, text, "--json"); !st.ok()) {
      return bad(st);
    }
  }
  if (!a.report_path.empty()) {
    if (Status st = WriteFile(a.report_path, lg::HtmlReport(info, s, run->records), "--report");
        !st.ok()) {
      return bad(st);
    }
  }
  // Show what failed: the first message of each status.
  for (const auto& [code, msg] : lg::FirstFailureMessages(run->records)) {
    std::cerr << fmt::format("tandem bench serve: {} requests failed with {}, e.g.: {}\n",
                             s.failed_by_status.at(code), code, msg);
  }
  return s.ok > 0 ? 0 : 3;
}

}  // namespace

void RegisterBenchServe(CLI::App& bench, GlobalOptions& g) {
  auto* cmd = bench.add_subcommand(
      "serve", "Load generator against a running fleet (docs/bench-serve.md)");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("--proxy", a->proxy,
                  "server address (default 127.0.0.1:50051; with --backend http 127.0.0.1:8000)");
  cmd->add_option("--state-file", a->state_file,
                  "read the proxy's address from a tandem launch state file");
  cmd->add_flag("--all-proxies", a->all_proxies,
               "with --state-file: send requests in turn to every proxy it lists "
               "(proxy.replicas), not only the first");
  cmd->add_option("--api-key", a->api_key, "sent as 'authorization: Bearer KEY'");
  cmd->add_option("--tenant-api-keys", a->tenant_api_keys,
                  "a mix of tenants: NAME=KEY[:WEIGHT],...; session i uses the tenant at i "
                  "modulo the total weight; results per tenant");
  cmd->add_option("--priority", a->priority,
                  "request priority (lower = earlier), or a mix P:WEIGHT,...; results per "
                  "priority");
  cmd->add_option("--backend", a->backend,
                  "API to drive: grpc (tandem.v1, default) or http (OpenAI /v1/completions, SSE)");
  cmd->add_option("--vocab-size", a->vocab_size,
                  "with --backend http: the model's vocabulary size (HTTP does not report it)");
  cmd->add_option("--model", a->model, "model id (default: the fleet's default model)");
  cmd->add_option("--label", a->label, "name of this run in the table, JSON and report");
  cmd->add_option("--trace", a->trace, "replay a Mooncake-format trace (JSONL) instead of "
                                       "the synthetic workload");
  cmd->add_option("--input-len", a->input_len,
                  "synthetic prompt length: N, uniform:LO:HI or normal:MEAN:STDDEV (default 128)");
  cmd->add_option("--output-len", a->output_len, "max_tokens per request, same forms (default 128)");
  cmd->add_option("--shared-prefix-groups", a->prefix_groups,
                  "sessions share one of G prefixes (session i: group i % G)");
  cmd->add_option("--shared-prefix-len", a->prefix_len, "tokens of each shared prefix");
  cmd->add_option("--turns", a->turns,
                  "turns per conversation; each turn resends the conversation so far (default 1)");
  cmd->add_option("--trace-skip", a->trace_skip,
                  "replay from the trace's request N+1 on (its timestamps count from there)");
  cmd->add_option("--trace-block-tokens", a->trace_block_tokens,
                  "tokens per trace hash block (512 = unscaled; 16 scales lengths by 1/32)");
  cmd->add_option("--trace-output-scale", a->trace_output_scale,
                  "factor on the trace's output lengths (default 1)");
  cmd->add_option("--time-scale", a->time_scale,
                  "factor on the trace's timestamps (0.5 = twice as fast; default 1)");
  cmd->add_option("--request-rate", a->request_rate,
                  "Poisson arrivals: sessions per second, or inf (all at once)");
  cmd->add_option("--concurrency", a->concurrency, "fixed number of sessions in flight");
  cmd->add_option("--max-concurrency", a->max_concurrency,
                  "cap on requests in flight with --request-rate or a trace");
  cmd->add_option("--num-requests", a->num_requests,
                  "stop after sending this many requests (a trace: N lines after --trace-skip)");
  cmd->add_option("--duration", a->duration_s, "stop sending after this many seconds");
  cmd->add_option("--temperature", a->temperature, "sampling temperature (default 0: greedy)");
  cmd->add_option("--seed", a->seed,
                  "seed of the workload and arrivals; request i samples with seed+i (default 0)");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "generate exactly max_tokens per request");
  cmd->add_option("--request-id-prefix", a->request_id_prefix,
                  "request ids are PREFIX-i (default bench-<pid>; ids in flight must be unique)");
  cmd->add_option("--request-timeout", a->request_timeout_s,
                  "per-request deadline in seconds (default 300)");
  cmd->add_option("--slo-ttft-ms", a->slo_ttft_ms, "goodput SLO: TTFT at most this");
  cmd->add_option("--slo-itl-ms", a->slo_itl_ms, "goodput SLO: every inter-token gap at most this");
  cmd->add_option("--slo-tpot-ms", a->slo_tpot_ms, "goodput SLO: TPOT at most this");
  cmd->add_option("--slo-e2e-ms", a->slo_e2e_ms, "goodput SLO: end-to-end latency at most this");
  cmd->add_option("--json", a->json_path,
                  "write the results as JSON to PATH ('-': stdout, the table then goes to stderr)");
  cmd->add_option("--report", a->report_path, "write a self-contained HTML report to PATH");
  cmd->add_flag("--progress", a->progress, "live progress line on stderr even when not a TTY");
  cmd->add_flag("--no-progress", a->no_progress, "no progress line");
  cmd->callback([&g, a] { g.exit_code = RunServe(*a); });
}

}  // namespace tandem::cli
