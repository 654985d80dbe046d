// Runs the real `tandem` binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

namespace {

struct CmdResult {
  int code;
  std::string out;  // stdout and stderr together
};

CmdResult Tandem(const std::string& args) {
  const std::string cmd = std::string(TANDEM_BINARY_DIR) + "/tandem " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

TEST(Cli, HelpListsSubcommands) {
  const CmdResult r = Tandem("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* sub : {"launch", "proxy", "prefill", "decode", "both", "generate", "bench",
                          "version"}) {
    EXPECT_NE(r.out.find(sub), std::string::npos) << sub << "\n" << r.out;
  }
}

TEST(Cli, VersionSaysRevisionAndCuda) {
  const CmdResult r = Tandem("version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("tandem 0."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("git revision: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cuda kernels: "), std::string::npos) << r.out;
}

TEST(Cli, ConfigCheckReportsLineAndKey) {
  const std::string bad = std::string(TANDEM_BINARY_DIR) + "/cli_test_bad.yaml";
  FILE* f = fopen(bad.c_str(), "w");
  fputs("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\nprefil: {}\n", f);
  fclose(f);
  const CmdResult r = Tandem("config-check " + bad);
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.out, bad + ":7: unknown key 'prefil' (did you mean 'prefill'?)\n");
}

TEST(Cli, ShippedConfigIsValid) {
  const CmdResult r = Tandem(std::string("config-check ") + TANDEM_SOURCE_DIR + "/configs/1p1d.yaml");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("workers: 1 prefill, 1 decode, 0 both"), std::string::npos) << r.out;
}

// Issue 16: the shipped cuda fleet is valid, and on a machine without a GPU
// `tandem launch` refuses it at once with one line naming the missing CUDA
// device (before, every cuda worker was refused at --join for its KV dtype).
// `timeout 30` is the test's limit; the test waits on the process's exit.
TEST(Cli, CudaFleetWithoutAGpuIsRefusedNamingTheDevice) {
  const std::string config = std::string(TANDEM_SOURCE_DIR) + "/configs/cuda-1p1d.yaml";
  const CmdResult check = Tandem("config-check " + config);
  EXPECT_EQ(check.code, 0) << check.out;
  EXPECT_NE(check.out.find("backend cuda"), std::string::npos) << check.out;
  EXPECT_NE(check.out.find("workers: 1 prefill, 1 decode, 0 both"), std::string::npos) << check.out;
  const CmdResult version = Tandem("version");
  if (version.out.find("cuda devices: 0") == std::string::npos &&
      version.out.find("cuda kernels: not compiled") == std::string::npos) {
    GTEST_SKIP() << "this machine has a CUDA device; tests/gpu/device_check.sh runs the cuda fleet";
  }
  const std::string cmd = "timeout 30 " + std::string(TANDEM_BINARY_DIR) + "/tandem launch " +
                          config + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_NE(WEXITSTATUS(status), 124) << "still running after 30 s:\n" << out;
  EXPECT_NE(WEXITSTATUS(status), 0) << out;
  size_t lines = 0;
  for (char c : out) lines += c == '\n';
  EXPECT_EQ(lines, 1u) << out;
  EXPECT_NE(out.find("fleet not started: model.backend is cuda but "), std::string::npos) << out;
  EXPECT_NE(out.find("CUDA device"), std::string::npos) << out;
  for (const char* wrong : {"kv_dtype", "KV dtype", "refused", "join"}) {
    EXPECT_EQ(out.find(wrong), std::string::npos) << wrong << " in:\n" << out;
  }
}

// Issue 16: transport.device_path direct where this machine's UCX cannot
// register CUDA memory (Debian's UCX) is refused by `tandem launch` before
// anything starts — before the missing-GPU check — in one line naming the
// key and the missing capability. Waits on the process's exit.
TEST(Cli, DirectDevicePathOnAUcxWithoutCudaIsRefusedNamingTheKey) {
  const std::string src = std::string(TANDEM_SOURCE_DIR) + "/configs/cuda-1p1d.yaml";
  std::string text;
  {
    FILE* f = fopen(src.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::array<char, 4096> buf;
    while (size_t n = fread(buf.data(), 1, buf.size(), f)) text.append(buf.data(), n);
    fclose(f);
  }
  for (auto [from, to] : {std::pair<std::string, std::string>{"../models/", std::string(TANDEM_SOURCE_DIR) + "/models/"},
                          {"transport:\n  backend: ucx\n", "transport:\n  backend: ucx\n  device_path: direct\n"}}) {
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
  }
  const std::string config = std::string(TANDEM_BINARY_DIR) + "/cli_test_cuda_direct.yaml";
  FILE* f = fopen(config.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fputs(text.c_str(), f);
  fclose(f);
  const CmdResult check = Tandem("config-check " + config);
  EXPECT_EQ(check.code, 0) << check.out;
  const CmdResult version = Tandem("version");
  if (version.out.find("cuda kv transfer path: direct") != std::string::npos) {
    GTEST_SKIP() << "this machine's UCX supports CUDA memory; tests/gpu/device_check.sh covers it";
  }
  const std::string cmd = "timeout 30 " + std::string(TANDEM_BINARY_DIR) + "/tandem launch " +
                          config + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_NE(WEXITSTATUS(status), 124) << "still running after 30 s:\n" << out;
  EXPECT_NE(WEXITSTATUS(status), 0) << out;
  size_t lines = 0;
  for (char c : out) lines += c == '\n';
  EXPECT_EQ(lines, 1u) << out;
  EXPECT_NE(out.find("fleet not started: transport.device_path is direct but UCX "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("has no CUDA memory support"), std::string::npos) << out;
  EXPECT_EQ(out.find("CUDA device"), std::string::npos) << "the device check ran first:\n" << out;
}

// `bench engine --isa` runs the kernels' other vector paths on this CPU
// (issue 23: the AVX2 tiles measured on an AVX-512 machine); a name it
// does not know is refused naming the flag, before any model is loaded.
TEST(Cli, BenchEngineRunsTheChosenKernelsAndRefusesAnUnknownOne) {
  const CmdResult bad = Tandem("bench engine --isa avx10");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_EQ(bad.out,
            "tandem bench engine: --isa: 'avx10' is not one of best, avx512, avx2, "
            "portable\n");
  const CmdResult r = Tandem(std::string("bench engine --model ") + TANDEM_SOURCE_DIR +
                             "/models/tandem-kjv --isa portable --threads 1 --batch 1"
                             " --prompt-tokens 8 --decode-tokens 2 --decode-prompt 4 --reps 1"
                             " --bandwidth-mib 8");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("kernels: portable\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("threads 1  decode batch   1:"), std::string::npos) << r.out;
}

// A read probe needs a buffer: `--bandwidth-mib 0` is refused naming the
// flag, before any model is loaded.
TEST(Cli, BenchEngineRefusesAnEmptyProbeBuffer) {
  const CmdResult r = Tandem("bench engine --model /nonexistent --bandwidth-mib 0");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out,
            "tandem bench engine: --reps, --prompt-tokens, --decode-tokens, --decode-prompt and "
            "--bandwidth-mib must be >= 1\n");
}

// `bench engine` measures the read bandwidth again after each batch-1
// decode repetition (issue 23: this host's bandwidth moves within a
// minute), and its JSON pairs every repetition with its probe; other batch
// sizes get no probe.
TEST(Cli, BenchEnginePairsEachBatch1RepetitionWithAReadProbe) {
  char dir[] = "/tmp/tandem-cli-bench-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string json_path = std::string(dir) + "/engine.json";
  const CmdResult r = Tandem(std::string("bench engine --model ") + TANDEM_SOURCE_DIR +
                             "/models/tandem-kjv --threads 1 --batch 1,2 --prompt-tokens 8"
                             " --decode-tokens 4 --decode-prompt 4 --reps 3 --bandwidth-mib 8"
                             " --json " +
                             json_path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("of the read probe after each repetition"), std::string::npos) << r.out;
  std::ifstream f(json_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  const double weight_bytes = j.at("weight_bytes").get<double>();
  ASSERT_GT(weight_bytes, 0);
  const auto& d1 = j.at("runs").at(0).at("decode_tps").at("1");
  const auto& tps = d1.at("values");
  const auto& read = d1.at("paired_read_GBps").at("values");
  const auto& fraction = d1.at("paired_fraction").at("values");
  ASSERT_EQ(tps.size(), 3u);
  ASSERT_EQ(read.size(), 3u);
  ASSERT_EQ(fraction.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_GT(read[i].get<double>(), 0) << i;
    EXPECT_NEAR(fraction[i].get<double>(),
                tps[i].get<double>() * weight_bytes / 1e9 / read[i].get<double>(),
                1e-9 * fraction[i].get<double>())
        << i;
  }
  const auto& d2 = j.at("runs").at(0).at("decode_tps").at("2");
  EXPECT_EQ(d2.at("values").size(), 3u);
  EXPECT_FALSE(d2.contains("paired_read_GBps"));
  std::remove(json_path.c_str());
  rmdir(dir);
}

TEST(Cli, UnknownSubcommandFails) {
  const CmdResult r = Tandem("frobnicate");
  EXPECT_NE(r.code, 0);
}

}  // namespace

namespace {

// Every option of the process subcommands parses (a dangling option target
// once crashed here) and reaches the command, which then reports the
// missing config file.
TEST(Cli, ProcessSubcommandsParseEveryOption) {
  const CmdResult proxy = Tandem(
      "proxy --config /nonexistent.yaml --grpc 127.0.0.1:0 --metrics 127.0.0.1:0 --ready-fd 9");
  EXPECT_EQ(proxy.code, 1) << proxy.out;
  EXPECT_EQ(proxy.out, "/nonexistent.yaml: cannot open the config file\n");
  for (const char* role : {"prefill", "decode", "both"}) {
    const CmdResult r = Tandem(std::string(role) +
                               " --config /nonexistent.yaml --join 127.0.0.1:1 --grpc 127.0.0.1:0"
                               " --metrics 127.0.0.1:0 --name w-0 --ready-fd 9");
    EXPECT_EQ(r.code, 1) << role << ": " << r.out;
    EXPECT_NE(r.out.find("/nonexistent.yaml: cannot open the config file"), std::string::npos)
        << role << ": " << r.out;
  }
}

TEST(Cli, LaunchRejectsABadConfig) {
  const CmdResult r = Tandem("launch /nonexistent.yaml");
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.out, "/nonexistent.yaml: cannot open the config file\n");
}

// Issue 18: a rank layout the model cannot split is refused by `tandem
// launch` before any process starts, in one line naming the key; a worker
// refuses bad --rank/--group flags naming them.
std::string WriteRankFleet(const std::string& decode_extra) {
  char dir[] = "/tmp/tandem-cli-ranks-XXXXXX";
  if (mkdtemp(dir) == nullptr) return "";
  const std::string path = std::string(dir) + "/fleet.yaml";
  FILE* f = fopen(path.c_str(), "w");
  if (f == nullptr) return "";
  fprintf(f,
          "model:\n  path: %s/models/tandem-kjv\nprefill:\n  replicas: 1\ndecode:\n"
          "  replicas: 1\n%s",
          TANDEM_SOURCE_DIR, decode_extra.c_str());
  fclose(f);
  return path;
}

TEST(Cli, LaunchRefusesALayoutTheModelCannotSplitNamingTheKey) {
  const std::string config = WriteRankFleet("  tensor_parallel: 3\n");
  ASSERT_FALSE(config.empty());
  const CmdResult r = Tandem("launch " + config + " --state-file " + config + ".state");
  EXPECT_EQ(r.code, 1) << r.out;
  size_t lines = 0;
  for (char c : r.out) lines += c == '\n';
  EXPECT_EQ(lines, 1u) << r.out;
  EXPECT_NE(r.out.find("fleet not started: decode.tensor_parallel 3 does not divide "
                       "num_attention_heads 8"),
            std::string::npos)
      << r.out;
  const CmdResult pp = Tandem("launch " + WriteRankFleet("  pipeline_parallel: 6\n"));
  EXPECT_EQ(pp.code, 1) << pp.out;
  EXPECT_NE(pp.out.find("fleet not started: decode.pipeline_parallel 6 exceeds num_hidden_layers 5"),
            std::string::npos)
      << pp.out;
}

TEST(Cli, WorkerRefusesBadRankFlagsNamingThem) {
  const std::string config = WriteRankFleet("");
  ASSERT_FALSE(config.empty());
  const CmdResult no_group = Tandem("decode --config " + config + " --tensor-parallel 2");
  EXPECT_EQ(no_group.code, 1) << no_group.out;
  EXPECT_NE(no_group.out.find("--group is required for a worker of 2 ranks"), std::string::npos)
      << no_group.out;
  const CmdResult bad_rank =
      Tandem("decode --config " + config + " --tensor-parallel 2 --rank 2 --group g");
  EXPECT_EQ(bad_rank.code, 1) << bad_rank.out;
  EXPECT_NE(bad_rank.out.find("--rank 2 is out of range: the worker has 2 rank(s)"),
            std::string::npos)
      << bad_rank.out;
  const CmdResult bad_tp = Tandem("prefill --config " + config + " --tensor-parallel 3 --group g");
  EXPECT_EQ(bad_tp.code, 1) << bad_tp.out;
  EXPECT_NE(bad_tp.out.find("prefill.tensor_parallel 3 does not divide num_attention_heads 8"),
            std::string::npos)
      << bad_tp.out;
}

}  // namespace
