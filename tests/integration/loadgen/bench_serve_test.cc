// Issue 8: `tandem bench serve` against a launched 1P1D fleet of the
// bundled model prints the table, writes JSON whose counts equal what was
// sent and an HTML report with SVG plots; shared prefixes, multi-turn
// conversations and a Mooncake-format trace show cached prompt tokens;
// the HTTP backend counts the same;
// bad input is refused with the field and the limit.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../fleet/fleet_harness.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

struct CmdResult {
  int exit_code = -1;
  std::string out, err;
};

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/tandem-bench-serve-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    if (!getenv("TANDEM_KEEP_TEST_DIRS")) fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `tandem bench serve ARGS` (bounded by `timeout 300`).
CmdResult BenchServe(const TempDir& dir, const std::string& args) {
  const std::string err = dir / "stderr.txt";
  const std::string cmd = "timeout 300 " + std::string(TANDEM_BINARY_DIR) +
                          "/tandem bench serve --no-progress " + args + " 2>" + err;
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.err = Slurp(err);
  return r;
}

// The value of a table row ("Successful requests:      24").
std::string Row(const std::string& table, const std::string& key) {
  const size_t p = table.find(key);
  if (p == std::string::npos) return "";
  const size_t eol = table.find('\n', p);
  std::string v = table.substr(p + key.size(), eol - p - key.size());
  v.erase(0, v.find_first_not_of(' '));
  return v;
}

TEST(BenchServe, BadInputIsRefusedBeforeSending) {
  TempDir dir;
  // No server at this address: every case below must fail before any call.
  const std::string nowhere = "--proxy 127.0.0.1:1 ";
  auto r = BenchServe(dir, nowhere);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("give a bound: --num-requests N and/or --duration SECONDS"),
            std::string::npos)
      << r.err;

  r = BenchServe(dir, nowhere + "--num-requests 3 --input-len uniform:9:3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--input-len 'uniform:9:3': needs whole numbers 1 <= LO <= HI"),
            std::string::npos)
      << r.err;

  r = BenchServe(dir, nowhere + "--num-requests 3 --request-rate fast");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--request-rate must be a number > 0"), std::string::npos) << r.err;

  {
    std::ofstream t(dir / "bad.jsonl");
    t << "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n"
      << "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [1]}\n";
  }
  r = BenchServe(dir, nowhere + "--trace " + (dir / "bad.jsonl"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("bad.jsonl:2: field 'hash_ids' has 1 ids; input_length 600 needs 2"),
            std::string::npos)
      << r.err;

  r = BenchServe(dir, nowhere + "--num-requests 3 --priority high");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--priority: 'high' is not an integer priority"), std::string::npos) << r.err;
  r = BenchServe(dir, nowhere + "--num-requests 3 --tenant-api-keys just-a-key");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--tenant-api-keys: 'just-a-key' is not NAME=KEY[:WEIGHT]"),
            std::string::npos)
      << r.err;
  r = BenchServe(dir, nowhere + "--num-requests 3 --tenant-api-keys a=k:0");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("weight '0'"), std::string::npos) << r.err;

  // Well-formed flags, nothing listening: exit 4, naming the address.
  r = BenchServe(dir, nowhere + "--num-requests 1");
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_NE(r.err.find("127.0.0.1:1"), std::string::npos) << r.err;
}

TEST(BenchServe, OneP1DTableJsonAndReport) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions fo;
  fo.policy = "kv_aware";
  auto fleet = Fleet::Launch(fo);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = "--proxy " + (*fleet)->proxy_grpc() + " ";
  TempDir dir;

  // 1. Synthetic, fixed concurrency, ignore_eos: every request returns
  //    exactly its max_tokens.
  const int kRequests = 24;
  auto r = BenchServe(dir, proxy + "--num-requests 24 --concurrency 4 --input-len uniform:16:96 "
                                   "--output-len uniform:4:12 --ignore-eos --seed 7 "
                                   "--slo-ttft-ms 600000 --label it --json " +
                               (dir / "a.json") + " --report " + (dir / "a.html"));
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(Row(r.out, "Successful requests:"), std::to_string(kRequests)) << r.out;
  EXPECT_EQ(Row(r.out, "Failed requests:"), "0");
  EXPECT_NE(r.out.find("P99 TTFT (ms):"), std::string::npos);
  EXPECT_NE(r.out.find("Median ITL (ms):"), std::string::npos);
  EXPECT_NE(r.out.find("Goodput (req/s):"), std::string::npos);

  auto j = nlohmann::json::parse(Slurp(dir / "a.json"));
  EXPECT_EQ(j["requests"], kRequests);
  EXPECT_EQ(j["completed"], kRequests);
  EXPECT_EQ(j["failed"], 0);
  ASSERT_EQ(j["per_request"].size(), size_t(kRequests));
  uint64_t requested = 0, output = 0;
  for (const auto& x : j["per_request"]) {
    requested += x["requested_tokens"].get<uint64_t>();
    output += x["output_tokens"].get<uint64_t>();
    EXPECT_EQ(x["output_tokens"], x["requested_tokens"]);
    EXPECT_EQ(x["finish_reason"], "length");
    EXPECT_GE(x["requested_tokens"].get<int>(), 4);
    EXPECT_LE(x["requested_tokens"].get<int>(), 12);
  }
  EXPECT_EQ(j["total_output_tokens"].get<uint64_t>(), output);
  EXPECT_EQ(j["requested_output_tokens"].get<uint64_t>(), requested);
  EXPECT_EQ(output, requested);
  EXPECT_EQ(j["good_requests"], kRequests);  // a 600 s TTFT SLO
  EXPECT_GT(j["median_ttft_ms"].get<double>(), 0.0);
  EXPECT_GT(j["output_throughput"].get<double>(), 0.0);
  EXPECT_LE(j["max_inflight"].get<double>(), 4.0);
  EXPECT_EQ(j["label"], "it");
  const std::string html = Slurp(dir / "a.html");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_NE(html.find("TTFT CDF"), std::string::npos);
  EXPECT_NE(html.find("Output throughput over time"), std::string::npos);

  // 2. Shared prefixes and two-turn conversations, Poisson arrivals, JSON
  //    on stdout: turn 2 resends turn 1, so the prefix caches must hit.
  r = BenchServe(dir, proxy + "--num-requests 8 --request-rate 5 --turns 2 --input-len 24 "
                              "--output-len 8 --shared-prefix-groups 2 --shared-prefix-len 64 "
                              "--ignore-eos --seed 3 --json -");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);  // only JSON on stdout
  EXPECT_EQ(j["completed"], 8);
  EXPECT_EQ(j["total_output_tokens"], 64);
  EXPECT_GT(j["cached_prompt_tokens"].get<uint64_t>(), 0u);
  EXPECT_GT(j["cached_token_ratio"].get<double>(), 0.0);
  int first_turns = 0, second_turns = 0;
  for (const auto& x : j["per_request"]) {
    if (x["turn"] == 0) ++first_turns;
    if (x["turn"] == 1) {
      ++second_turns;
      // Turn 2 = shared prefix 64 + 24 + 8 answered + 24 new.
      EXPECT_EQ(x["prompt_tokens"], 120);
    }
  }
  // How many of the 8 are second turns depends on how soon first turns
  // finish against the Poisson arrivals of new sessions (4 when every
  // first turn ends before the next session arrives; fewer on a slow
  // machine): at least one, and never a second turn without its first.
  EXPECT_GE(second_turns, 1);
  EXPECT_GE(first_turns, second_turns);
  EXPECT_EQ(first_turns + second_turns, 8);
  EXPECT_NE(r.err.find("Successful requests:"), std::string::npos);  // the table moved to stderr

  // 3. A Mooncake-format trace: requests 2 and 3 share request 1's first
  //    two hash blocks, scaled to 16 tokens per block.
  {
    std::ofstream t(dir / "trace.jsonl");
    t << "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 12, \"hash_ids\": [1, 2, 3]}\n"
      << "{\"timestamp\": 100, \"input_length\": 1100, \"output_length\": 6, \"hash_ids\": [1, 2, 4]}\n"
      << "{\"timestamp\": 300, \"input_length\": 1200, \"output_length\": 10, \"hash_ids\": [1, 2, 5]}\n"
      << "{\"timestamp\": 400, \"input_length\": 300, \"output_length\": 4, \"hash_ids\": [6]}\n";
  }
  r = BenchServe(dir, proxy + "--trace " + (dir / "trace.jsonl") +
                          " --trace-block-tokens 16 --trace-output-scale 0.5 --time-scale 5 "
                          "--ignore-eos --json " + (dir / "t.json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(Slurp(dir / "t.json"));
  EXPECT_EQ(j["completed"], 4);
  EXPECT_EQ(j["total_input_tokens"], 48 + 35 + 38 + 10);
  EXPECT_EQ(j["total_output_tokens"], 6 + 3 + 5 + 2);
  // Requests 2 and 3 find at least request 1's two shared 16-token blocks.
  EXPECT_GE(j["cached_prompt_tokens"].get<uint64_t>(), 64u);
  // Trace time 400 ms x 5: the last request is not sent before 2 s.
  double last_send = 0;
  for (const auto& x : j["per_request"]) last_send = std::max(last_send, x["send_s"].get<double>());
  EXPECT_GE(last_send, 2.0);

  // 4. The OpenAI HTTP API (/v1/completions, SSE) through the same runner:
  //    counts from the final usage event.
  r = BenchServe(dir, "--backend http --proxy " + (*fleet)->proxy_http() +
                          " --vocab-size 4096 --num-requests 6 --concurrency 3 --input-len 40 "
                          "--output-len 7 --ignore-eos --json " + (dir / "h.json"));
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  j = nlohmann::json::parse(Slurp(dir / "h.json"));
  EXPECT_EQ(j["completed"], 6);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_output_tokens"], 42);
  EXPECT_EQ(j["usage_prompt_tokens"], 240);
  EXPECT_GT(j["median_ttft_ms"].get<double>(), 0.0);
  EXPECT_NE(j["target"].get<std::string>().find("HTTP"), std::string::npos);
  r = BenchServe(dir, "--backend http --proxy " + (*fleet)->proxy_http() +
                          " --num-requests 1 --turns 2 --vocab-size 4096");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--turns > 1 needs --backend grpc"), std::string::npos) << r.err;

  // 5. A workload that cannot fit the context is refused, naming the limit.
  r = BenchServe(dir, proxy + "--num-requests 2 --input-len 1000 --output-len 100");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("the model accepts at most 1024 (prompt + completion)"),
            std::string::npos)
      << r.err;
}

// Issue 22: a mix of tenants (--tenant-api-keys) and priorities
// (--priority) is sent as asked and reported per tenant and per priority.
TEST(BenchServe, TenantAndPriorityMixesAreReportedPerGroup) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  TempDir dir;
  {
    std::ofstream k(dir / "keys.yaml");
    k << "- key: key-a\n  tenant: alpha\n- key: key-b\n  tenant: beta\n  min_priority: 5\n"
         "  priority: 5\n";
  }
  FleetOptions fo;
  fo.extra_yaml = "security:\n  api_keys_file: " + (dir / "keys.yaml") + "\n";
  auto fleet = Fleet::Launch(fo);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = "--proxy " + (*fleet)->proxy_grpc() + " ";
  // Sessions i % 4 in {0,1,2}: alpha, 3: beta; i % 2 == 0: priority 10, else 20.
  auto r = BenchServe(dir, proxy + "--num-requests 16 --concurrency 4 --input-len 16 "
                                   "--output-len 4 --ignore-eos --tenant-api-keys "
                                   "alpha=key-a:3,beta=key-b:1 --priority 10:1,20:1 --json " +
                               (dir / "m.json"));
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(Row(r.out, "Successful requests:"), "16") << r.out;
  EXPECT_NE(r.out.find(" Tenant alpha "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" Priority 20 "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("key-a"), std::string::npos);  // keys are never printed
  auto j = nlohmann::json::parse(Slurp(dir / "m.json"));
  EXPECT_EQ(j["by_tenant"]["alpha"]["requests"], 12);
  EXPECT_EQ(j["by_tenant"]["alpha"]["completed"], 12);
  EXPECT_EQ(j["by_tenant"]["beta"]["completed"], 4);
  EXPECT_EQ(j["by_tenant"]["beta"]["output_tokens"], 16);
  EXPECT_EQ(j["by_priority"]["10"]["completed"], 8);
  EXPECT_EQ(j["by_priority"]["20"]["completed"], 8);
  EXPECT_GT(j["by_priority"]["10"]["median_ttft_ms"].get<double>(), 0.0);
  for (const auto& x : j["per_request"]) {
    const uint64_t session = x["session"].get<uint64_t>();
    EXPECT_EQ(x["tenant"], session % 4 == 3 ? "beta" : "alpha");
    EXPECT_EQ(x["priority"], session % 2 == 0 ? 10 : 20);
  }
  // beta may not ask for better than 5.
  r = BenchServe(dir, proxy + "--num-requests 2 --input-len 16 --output-len 2 "
                              "--tenant-api-keys beta=key-b --priority 1");
  EXPECT_EQ(r.exit_code, 3) << r.err << r.out;
  EXPECT_NE(r.err.find("min_priority"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tandem::testing
