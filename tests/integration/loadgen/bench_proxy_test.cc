// `tandem bench proxy` (issue 23) against a launched 1P1D fleet of the
// bundled model: the gRPC `stream` workload and its HTTP twin `sse` (SSE
// over the OpenAI API) each count every token they asked for; a bad
// workload name is refused naming the list; prompt-floor calls its bare
// server over both kinds of channel; floor streams every token from each
// of its bare servers.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
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

// Runs `tandem bench proxy ARGS` (bounded by `timeout 300`); stderr goes to `err_path`.
CmdResult BenchProxy(const std::string& args, const std::string& err_path) {
  const std::string cmd = "timeout 300 " + std::string(TANDEM_BINARY_DIR) + "/tandem bench proxy " +
                          args + " 2>" + err_path;
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  return r;
}

std::string TempPath(const std::string& name) {
  return (fs::temp_directory_path() / fmt::format("tandem-bench-proxy-{}-{}", getpid(), name))
      .string();
}

// `tandem bench proxy --state-file FLEET ARGS --json TMP`: the command's
// result and the JSON rows it wrote (not an array when it wrote none).
struct JsonRun {
  CmdResult cmd;
  nlohmann::json rows;
};
JsonRun BenchProxyJson(const Fleet& fleet, const std::string& args, const std::string& tag) {
  const std::string json_path = TempPath(tag + ".json"), err = TempPath(tag + ".err");
  JsonRun r;
  r.cmd =
      BenchProxy("--state-file " + fleet.state_path() + " " + args + " --json " + json_path, err);
  fs::remove(err);
  std::ifstream in(json_path);
  r.rows = nlohmann::json::parse(in, nullptr, false);
  fs::remove(json_path);
  return r;
}

TEST(BenchProxy, UnknownWorkloadIsRefusedNamingTheList) {
  const std::string err = TempPath("err1");
  auto r = BenchProxy("--state-file /nonexistent.json --workloads stream,nope", err);
  fs::remove(err);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("unknown workload 'nope' (give a list of idle, stream, sse, prompt, "
                       "open, floor, prompt-floor)"),
            std::string::npos)
      << r.err;
}

TEST(BenchProxy, StreamAndSseCountEveryTokenOnBothApis) {
  if (!fs::exists(BundledModel() + "/model.safetensors")) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const auto run = BenchProxyJson(**fleet,
                                  "--workloads idle,stream,sse --idle-seconds 2"
                                  " --stream-requests 4 --stream-concurrency 2"
                                  " --stream-input 16 --stream-output 12",
                                  "out");
  const CmdResult& r = run.cmd;
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto& j = run.rows;
  ASSERT_TRUE(j.is_array()) << r.out;
  ASSERT_EQ(j.size(), 3u);
  // idle (issue 23): one row per fleet process, before any request; each
  // ran a little (the workers' keep-alives, the proxy reading them).
  {
    const auto& idle = j[0];
    SCOPED_TRACE(idle.dump());
    EXPECT_EQ(idle["workload"], "idle");
    ASSERT_EQ(idle["processes"].size(), 1 + (*fleet)->workers().size());
    EXPECT_EQ(idle["processes"][0]["role"], "proxy");
    EXPECT_EQ(idle["processes"][0]["pid"], (*fleet)->proxy_pid());
    for (const auto& p : idle["processes"]) {
      EXPECT_GT(p["cpu_ms_per_s"].get<double>(), 0.0);
      EXPECT_GT(p["voluntary_switches_per_s"].get<double>(), 0.0);
    }
  }
  for (size_t i = 1; i < 3; ++i) {
    const auto& w = j[i];
    SCOPED_TRACE(w.dump());
    EXPECT_EQ(w["workload"], i == 1 ? "stream" : "sse");
    EXPECT_EQ(w["requests_ok"], 4);
    EXPECT_EQ(w["requests_failed"], 0);
    EXPECT_EQ(w["output_tokens"], 4 * 12);
    // The proxy's CPU clock (nanoseconds): serving never costs nothing.
    ASSERT_TRUE(w["cpu_s"].contains("proxy"));
    EXPECT_GT(w["cpu_s"]["proxy"].get<double>(), 0.0);
  }
  // The table has a row per workload.
  EXPECT_NE(r.out.find("\nsse "), std::string::npos) << r.out;
}

// prompt-floor: a bare Prefill server in a child process, called over
// plaintext and mutual TLS, back to back and at the prompt workload's
// cadence; every call succeeds and both sides are charged CPU. Then the
// raw TCP relay relays and answers every prompt.
TEST(BenchProxy, PromptFloorCallsABareServerOverEveryChannel) {
  if (!fs::exists(BundledModel() + "/model.safetensors")) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const auto run = BenchProxyJson(**fleet,
                                  "--workloads prompt,prompt-floor --prompt-requests 4"
                                  " --prompt-concurrency 2 --prompt-input 64",
                                  "floor");
  const CmdResult& r = run.cmd;
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto& j = run.rows;
  ASSERT_TRUE(j.is_array()) << r.out;
  // prompt, then per mode (back-to-back, paced): plaintext, mtls,
  // framed-mtls, then the estimates (framed worker calls, gRPC worker calls);
  // then relay-tcp, back to back and paced.
  constexpr size_t kPerMode = 5;
  ASSERT_EQ(j.size(), 1 + 2 * kPerMode + 2) << j.dump();
  EXPECT_EQ(j[0]["workload"], "prompt");
  EXPECT_EQ(j[0]["requests_ok"], 4);
  // The prefiller's CPU per request (session 29): it ran every prompt.
  ASSERT_TRUE(j[0]["cpu_s"].contains("prefill")) << j[0].dump();
  const double prefill_s = j[0]["cpu_s"]["prefill"].get<double>();
  EXPECT_GT(prefill_s, 0.0);
  EXPECT_DOUBLE_EQ(j[0]["prefiller_ms_per_request"].get<double>(), prefill_s / 4 * 1e3);
  const char* modes[] = {"back-to-back", "paced"};
  const char* channels[] = {"plaintext", "mtls", "framed-mtls"};
  for (size_t m = 0; m < 2; ++m) {
    const size_t at = 1 + m * kPerMode;
    for (size_t c = 0; c < 3; ++c) {
      const auto& w = j[at + c];
      SCOPED_TRACE(w.dump());
      EXPECT_EQ(w["workload"], "prompt-floor");
      EXPECT_EQ(w["channel"], channels[c]);
      EXPECT_EQ(w["mode"], modes[m]);
      EXPECT_EQ(w["requests_ok"], 4);
      EXPECT_EQ(w["input_len"], 64);
      // getrusage counts microseconds: a served call is never free.
      EXPECT_GT(w["server_us_per_call"].get<double>(), 0.0);
      EXPECT_GT(w["client_us_per_call"].get<double>(), 0.0);
    }
    // The framed calls carry the prompt as the proxy forwards a client's:
    // packed varints (ids < 32,000: 1-3 bytes each), not fixed32 (4 bytes
    // each), after a head of well under 100 bytes.
    ASSERT_TRUE(j[at + 2].contains("request_bytes")) << j[at + 2].dump();
    const size_t request_bytes = j[at + 2]["request_bytes"].get<size_t>();
    EXPECT_GT(request_bytes, 64u);
    EXPECT_LT(request_bytes, 64u * 3 + 100);
    // The proxy's estimate: the public (plaintext) server's call plus two
    // worker calls as a client, over the framed transport or over gRPC mTLS.
    const double server = j[at]["server_us_per_call"].get<double>();
    const auto& framed = j[at + 3];
    EXPECT_EQ(framed["channel"], "proxy-estimate-framed");
    EXPECT_NEAR(framed["proxy_ms_per_request"].get<double>(),
                (server + 2 * j[at + 2]["client_us_per_call"].get<double>()) / 1e3, 1e-9);
    const auto& grpc = j[at + 4];
    EXPECT_EQ(grpc["channel"], "proxy-estimate");
    EXPECT_NEAR(grpc["proxy_ms_per_request"].get<double>(),
                (server + 2 * j[at + 1]["client_us_per_call"].get<double>()) / 1e3, 1e-9);
  }
  EXPECT_GT(j[1 + kPerMode]["paced_per_s"].get<double>(), 0.0);
  // relay-tcp: every prompt relayed (each as many bytes as a framed
  // request, all of them read by the bench's prefiller before it answers)
  // and answered; the relay's process is charged CPU.
  for (size_t m = 0; m < 2; ++m) {
    const auto& w = j[1 + 2 * kPerMode + m];
    SCOPED_TRACE(w.dump());
    EXPECT_EQ(w["workload"], "prompt-floor");
    EXPECT_EQ(w["channel"], "relay-tcp");
    EXPECT_EQ(w["mode"], modes[m]);
    EXPECT_EQ(w["requests_ok"], 4);
    EXPECT_EQ(w["requests_failed"], 0);
    EXPECT_EQ(w["request_bytes"], j[1 + m * kPerMode + 2]["request_bytes"]);
    EXPECT_EQ(w["paced_per_s"], j[1 + m * kPerMode]["paced_per_s"]);
    EXPECT_GT(w["server_us_per_call"].get<double>(), 0.0);
  }
  EXPECT_NE(r.out.find("\npfloor "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" relay-tcp "), std::string::npos) << r.out;
}

// floor: each bare server (callback, async, async + callback, raw TCP per
// token, raw TCP per step with and without the clients' acks, and with a
// reader thread per client connection) in its own process streams every
// token of every request to the client.
TEST(BenchProxy, FloorServersStreamEveryToken) {
  if (!fs::exists(BundledModel() + "/model.safetensors")) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const auto run = BenchProxyJson(**fleet,
                                  "--workloads floor --floor-requests 3 --stream-concurrency 2"
                                  " --stream-output 20 --floor-step-ms 2",
                                  "sfloor");
  const CmdResult& r = run.cmd;
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto& j = run.rows;
  ASSERT_TRUE(j.is_array()) << r.out;
  const char* rows[] = {"floor-cb",   "floor-cq",       "floor-cq+cb", "floor-tcp",
                        "floor-step", "floor-step+ack", "floor-4r+ack"};
  ASSERT_EQ(j.size(), std::size(rows)) << j.dump();
  for (size_t i = 0; i < std::size(rows); ++i) {
    const auto& w = j[i];
    SCOPED_TRACE(w.dump());
    EXPECT_EQ(w["workload"], rows[i]);
    EXPECT_EQ(w["requests_ok"], 3);
    EXPECT_EQ(w["requests_failed"], 0);
    EXPECT_EQ(w["output_tokens"], 3 * 20);
    EXPECT_EQ(w["floor_step_ms"], 2.0);
    EXPECT_GT(w["cpu_s"]["floor_server"].get<double>(), 0.0);
    EXPECT_NE(r.out.find(fmt::format("\n{} ", rows[i])), std::string::npos) << r.out;
  }
}

// floor-step with more streams than connections, and a last step with fewer
// tokens than streams (3 x 7 tokens over 5 streams: 21 = 4 x 5 + 1): every
// token arrives once, in whole messages.
TEST(BenchProxy, FloorStepCountsEveryTokenOfAPartialLastStep) {
  if (!fs::exists(BundledModel() + "/model.safetensors")) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const auto run = BenchProxyJson(**fleet,
                                  "--workloads floor --floor-requests 3 --stream-concurrency 5"
                                  " --stream-output 7 --floor-step-ms 1",
                                  "stepfloor");
  const CmdResult& r = run.cmd;
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto& j = run.rows;
  ASSERT_TRUE(j.is_array()) << r.out;
  size_t seen = 0;
  for (const auto& w : j) {
    if (w["workload"] != "floor-step" && w["workload"] != "floor-step+ack" &&
        w["workload"] != "floor-4r+ack") {
      continue;
    }
    SCOPED_TRACE(w.dump());
    ++seen;
    EXPECT_EQ(w["requests_ok"], 3);
    EXPECT_EQ(w["output_tokens"], 3 * 7);
  }
  EXPECT_EQ(seen, 3u) << j.dump();
}

}  // namespace
}  // namespace tandem::testing
