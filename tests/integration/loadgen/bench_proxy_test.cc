// `tandem bench proxy` (issue 23) against a launched 1P1D fleet of the
// bundled model: the gRPC `stream` workload and its HTTP twin `sse` (SSE
// over the OpenAI API) each count every token they asked for; a bad
// workload name is refused naming the list.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

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

// Runs `tandem bench proxy ARGS` (bounded by `timeout 300`); stderr goes to `err_path`.
CmdResult BenchProxy(const std::string& args, const std::string& err_path) {
  const std::string cmd = "timeout 300 " + std::string(TANDEM_BINARY_DIR) +
                          "/tandem bench proxy " + args + " 2>" + err_path;
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

TEST(BenchProxy, UnknownWorkloadIsRefusedNamingTheList) {
  const std::string err = TempPath("err1");
  auto r = BenchProxy("--state-file /nonexistent.json --workloads stream,nope", err);
  fs::remove(err);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("unknown workload 'nope' (give a list of stream, sse, prompt, open, "
                       "floor)"),
            std::string::npos)
      << r.err;
}

TEST(BenchProxy, StreamAndSseCountEveryTokenOnBothApis) {
  if (!fs::exists(BundledModel() + "/model.safetensors")) GTEST_SKIP() << "bundled model missing";
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string json_path = TempPath("out.json"), err = TempPath("err2");
  auto r = BenchProxy("--state-file " + (*fleet)->state_path() +
                          " --workloads stream,sse --stream-requests 4 --stream-concurrency 2"
                          " --stream-input 16 --stream-output 12 --json " + json_path,
                      err);
  fs::remove(err);
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::ifstream in(json_path);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  fs::remove(json_path);
  ASSERT_TRUE(j.is_array()) << r.out;
  ASSERT_EQ(j.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto& w = j[i];
    SCOPED_TRACE(w.dump());
    EXPECT_EQ(w["workload"], i == 0 ? "stream" : "sse");
    EXPECT_EQ(w["requests_ok"], 4);
    EXPECT_EQ(w["requests_failed"], 0);
    EXPECT_EQ(w["output_tokens"], 4 * 12);
    // CPU comes in clock ticks (10 ms): a run this short may be charged
    // none, so only its presence is checked.
    ASSERT_TRUE(w["cpu_s"].contains("proxy"));
    EXPECT_GE(w["cpu_s"]["proxy"].get<double>(), 0.0);
  }
  // The table has a row per workload.
  EXPECT_NE(r.out.find("\nsse "), std::string::npos) << r.out;
}

}  // namespace
}  // namespace tandem::testing
