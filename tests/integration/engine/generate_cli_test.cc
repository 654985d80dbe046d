// `tandem generate` as a user runs it: the real binary, its stdout and exit code.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

namespace {

struct CmdResult {
  int code;
  std::string out;  // stdout
  std::string err;  // stderr
};

CmdResult Tandem(const std::string& args) {
  // One file per process and call: ctest runs each test case as its own
  // process, in parallel, and a shared file let one case read another's
  // (empty) stderr.
  static int calls = 0;
  const std::string err_file = std::string(TANDEM_BINARY_DIR) + "/generate_cli_test." +
                               std::to_string(getpid()) + "." + std::to_string(calls++) + ".err";
  const std::string cmd =
      std::string(TANDEM_BINARY_DIR) + "/tandem generate " + args + " 2>" + err_file;
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  std::ifstream e(err_file);
  std::string err((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
  std::filesystem::remove(err_file);
  return {WEXITSTATUS(status), out, err};
}

std::string Fixture(const std::string& name) {
  return std::string(TANDEM_SOURCE_DIR) + "/tests/fixtures/golden/" + name;
}

TEST(GenerateCli, JsonGreedyEqualsTransformers) {
  std::ifstream in(Fixture("tiny-llama") + "/golden.json");
  const auto golden = nlohmann::json::parse(in);
  const auto& c = golden.at("cases").at(2);
  std::string ids;
  for (uint32_t id : c.at("prompt_ids").get<std::vector<uint32_t>>()) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id);
  }
  const auto r = Tandem(std::string("--model ") + Fixture("tiny-llama") + " --prompt-ids " + ids +
                        " --max-tokens 64 --temperature 0 --ignore-eos --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(r.out.rfind("{\"token_ids\":", 0), 0u) << r.out;  // documented key order
  EXPECT_EQ(j.at("token_ids").get<std::vector<uint32_t>>(),
            c.at("greedy_ids").get<std::vector<uint32_t>>());
  EXPECT_TRUE(j.at("text").is_string());
}

TEST(GenerateCli, SeededSamplingRepeats) {
  const std::string args = std::string("--model ") + Fixture("tiny-qwen2") +
                           " --prompt-ids 5,6,7 --max-tokens 12 --temperature 0.9 --seed 11 "
                           "--ignore-eos --json";
  const auto a = Tandem(args), b = Tandem(args);
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(nlohmann::json::parse(a.out).at("token_ids").size(), 12u);
}

TEST(GenerateCli, ErrorsSayWhatIsWrong) {
  auto r = Tandem(std::string("--model ") + Fixture("tiny-qwen2") + " --prompt-ids 5,6 --max-tokens 600");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("prompt has 2 tokens and max_tokens is 600"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("512"), std::string::npos) << r.err;
  r = Tandem(std::string("--model ") + Fixture("tiny-qwen2") + " --prompt-ids 5,x --max-tokens 2");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("'x'"), std::string::npos) << r.err;
  r = Tandem(std::string("--model ") + Fixture("tiny-qwen2") + " --max-tokens 2");
  EXPECT_NE(r.code, 0);
  r = Tandem("--model /nonexistent --prompt-ids 1 --max-tokens 2");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("/nonexistent"), std::string::npos) << r.err;
}

TEST(GenerateCli, BundledModelPrintsText) {
  if (!std::filesystem::exists(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv/config.json")) {
    GTEST_SKIP() << "models/tandem-kjv is absent";
  }
  const auto r = Tandem("--prompt \"In the beginning\" --max-tokens 16 --temperature 0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GT(r.out.size(), 16u) << r.out;  // words, not ids
  const auto j = nlohmann::json::parse(
      Tandem("--prompt \"In the beginning\" --max-tokens 16 --temperature 0 --json").out);
  EXPECT_EQ(j.at("text").get<std::string>() + "\n", r.out);  // streamed text == --json text
}

}  // namespace
