// Runs the real `tandem bench kvtransfer` (two processes over UCX) with small
// sizes and checks what it reports.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace {

struct CmdRun {
  int code = -1;
  std::string out;  // stdout only
};

CmdRun Tandem(const std::string& args) {
  const std::string cmd = std::string(TANDEM_BINARY_DIR) + "/tandem " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  CmdRun r;
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  for (int i = 0; i < 100000; ++i) {
    const size_t n = fread(buf.data(), 1, buf.size(), p);
    if (n == 0) break;
    r.out.append(buf.data(), n);
  }
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

nlohmann::json LastJsonLine(const std::string& out) {
  const size_t start = out.rfind("\n{") == std::string::npos ? out.find('{') : out.rfind("\n{") + 1;
  if (start == std::string::npos) return {};
  return nlohmann::json::parse(out.substr(start, out.find('\n', start) - start), nullptr, false);
}

TEST(BenchKvTransfer, JsonReportsBandwidthLatencyAndVerifiedData) {
  const CmdRun r =
      Tandem("bench kvtransfer --block-bytes 65536 --blocks 8 --requests 30 --warmup 2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = LastJsonLine(r.out);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_GT(j.at("bandwidth_bytes_per_s").get<double>(), 0);
  EXPECT_GT(j.at("p50_latency_s").get<double>(), 0);
  EXPECT_LE(j.at("p50_latency_s").get<double>(), j.at("p99_latency_s").get<double>());
  EXPECT_EQ(j.at("bytes_per_request").get<uint64_t>(), 8u * 65536u);
  EXPECT_EQ(j.at("puts_per_request").get<uint64_t>(), 1u);  // 8 contiguous blocks, one put
  EXPECT_TRUE(j.at("data_verified").get<bool>());
  EXPECT_EQ(j.at("notices_received").get<uint64_t>(), 32u);
  EXPECT_FALSE(j.at("transports").get<std::string>().empty());
}

TEST(BenchKvTransfer, ScatterDefeatsCoalescingAndConcurrencyWorks) {
  const CmdRun r = Tandem(
      "bench kvtransfer --block-bytes 4096 --blocks 16 --requests 40 --scatter --concurrency 3 "
      "--json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = LastJsonLine(r.out);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j.at("puts_per_request").get<uint64_t>(), 16u);
  EXPECT_EQ(j.at("concurrency").get<uint64_t>(), 3u);
  EXPECT_TRUE(j.at("data_verified").get<bool>());
  EXPECT_EQ(j.at("notices_received").get<uint64_t>(), 45u);
}

TEST(BenchKvTransfer, TextOutputNamesTransports) {
  const CmdRun r = Tandem("bench kvtransfer --block-bytes 4096 --blocks 4 --requests 10");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("transports ["), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("p99"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("data verified: yes"), std::string::npos) << r.out;
}

// Issue 16: the staging pipeline (host stand-in copy engine) through real
// UCX between the two processes; the target checksums its "device" pool
// after the notices, and memcpy of the same bytes is measured beside it.
TEST(BenchKvTransfer, StagedMemoryRunsThePipelineAndVerifiesTheData) {
  const CmdRun r = Tandem(
      "bench kvtransfer --memory staged --block-bytes 65536 --blocks 80 --requests 12 --warmup 2 "
      "--concurrency 2 --scatter --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = LastJsonLine(r.out);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j.at("memory").get<std::string>(), "staged");
  EXPECT_EQ(j.at("path").get<std::string>(), "staged");
  EXPECT_TRUE(j.at("data_verified").get<bool>());
  EXPECT_EQ(j.at("notices_received").get<uint64_t>(), 14u);  // manifests are not counted
  EXPECT_GT(j.at("memcpy_bytes_per_s").get<double>(), 0);
  EXPECT_GT(j.at("fraction_of_memcpy").get<double>(), 0);
  // Delivered = until the target handed on the last notice: never faster
  // than the writer's own completions.
  EXPECT_LE(j.at("delivered_bandwidth_bytes_per_s").get<double>(),
            j.at("bandwidth_bytes_per_s").get<double>());
}

// Without a GPU (or a CUDA build) --memory device is refused, naming why.
TEST(BenchKvTransfer, DeviceMemoryWithoutAGpuIsRefusedClearly) {
  const CmdRun version = Tandem("version");
  if (version.out.find("cuda devices: 0") == std::string::npos &&
      version.out.find("cuda kernels: not compiled") == std::string::npos) {
    GTEST_SKIP() << "this machine has a CUDA device; tests/gpu/device_check.sh runs --memory device";
  }
  const std::string cmd = std::string(TANDEM_BINARY_DIR) +
                          "/tandem bench kvtransfer --memory device --requests 2 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_NE(out.find("--memory device: "), std::string::npos) << out;
  EXPECT_TRUE(out.find("no usable CUDA device") != std::string::npos ||
              out.find("no CUDA") != std::string::npos)
      << out;
}

}  // namespace
