// `tandem generate --tensor-parallel N --pipeline-parallel M` as a user runs
// it (issue 18): the real binary starting its follower ranks as processes.
// Greedy tokens equal the one-process run (and the transformers golden
// tokens) on the bundled model — short prompts and a 950-token one — and on
// the tiny golden fixtures; bad degrees are refused naming the dimension; a
// follower killed with SIGKILL mid-generate fails the command naming the
// rank, and killing rank 0 leaves no follower behind.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

namespace {

struct CmdResult {
  int code;
  std::string out;
  std::string err;
};

std::string TempFile(const std::string& what) {
  static int calls = 0;
  return std::string(TANDEM_BINARY_DIR) + "/tp_generate_test." + std::to_string(getpid()) + "." +
         std::to_string(calls++) + "." + what;
}

std::string ReadFile(const std::string& path) {
  std::ifstream e(path);
  return std::string((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
}

CmdResult Generate(const std::string& args) {
  const std::string err_file = TempFile("err");
  const std::string cmd =
      std::string(TANDEM_BINARY_DIR) + "/tandem generate " + args + " 2>" + err_file;
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  std::string err = ReadFile(err_file);
  std::filesystem::remove(err_file);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out, err};
}

std::string Ids(const std::vector<uint32_t>& ids) {
  std::string s;
  for (uint32_t id : ids) {
    if (!s.empty()) s.push_back(',');
    s.append(std::to_string(id));
  }
  return s;
}

std::string GoldenPath(const std::string& model) {
  return std::string(TANDEM_SOURCE_DIR) + "/tests/fixtures/golden/" + model + "/golden.json";
}

std::string ModelDir(const std::string& model) {
  return model == "tandem-kjv" ? std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv"
                               : std::string(TANDEM_SOURCE_DIR) + "/tests/fixtures/golden/" + model;
}

std::vector<uint32_t> GreedyTokens(const std::string& model, const std::vector<uint32_t>& prompt,
                                   const std::string& parallel) {
  const auto r = Generate("--model " + ModelDir(model) + " --prompt-ids " + Ids(prompt) +
                          " --max-tokens 64 --temperature 0 --ignore-eos --json " + parallel);
  EXPECT_EQ(r.code, 0) << parallel << ": " << r.err;
  if (r.code != 0) return {};
  EXPECT_EQ(r.err, "") << parallel;  // the ranks say nothing when all is well
  return nlohmann::json::parse(r.out).at("token_ids").get<std::vector<uint32_t>>();
}

struct Layout {
  uint32_t tp, pp;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << "tp" << l.tp << "pp" << l.pp; }

class TpGenerate : public ::testing::TestWithParam<Layout> {
 protected:
  std::string Flags() const {
    return "--tensor-parallel " + std::to_string(GetParam().tp) + " --pipeline-parallel " +
           std::to_string(GetParam().pp);
  }
  // Every listed golden case of `model`: the layout's tokens == TP 1's.
  void CheckModel(const std::string& model, const std::vector<std::string>& cases) {
    std::ifstream in(GoldenPath(model));
    const auto golden = nlohmann::json::parse(in);
    size_t checked = 0;
    for (const auto& c : golden.at("cases")) {
      const std::string name = c.at("name").get<std::string>();
      if (std::find(cases.begin(), cases.end(), name) == cases.end()) continue;
      ++checked;
      const auto prompt = c.at("prompt_ids").get<std::vector<uint32_t>>();
      const auto one = GreedyTokens(model, prompt, "");
      const auto many = GreedyTokens(model, prompt, Flags());
      ASSERT_EQ(one.size(), 64u) << model << "/" << name;
      EXPECT_EQ(many, one) << model << "/" << name << " " << Flags();
      // And both equal transformers (a near-tie would show in TP 1 too).
      EXPECT_EQ(many, c.at("greedy_ids").get<std::vector<uint32_t>>()) << model << "/" << name;
    }
    EXPECT_EQ(checked, cases.size()) << model;
  }
};

TEST_P(TpGenerate, BundledModelTokensEqualOneProcess) {
  CheckModel("tandem-kjv", {"in_the_beginning", "chatml", "genesis24_950"});
}

TEST_P(TpGenerate, GoldenFixturesTokensEqualOneProcess) {
  CheckModel("tiny-llama", {"random_7", "random_70"});
  CheckModel("tiny-qwen2", {"random_16", "random_70"});
  CheckModel("tiny-llama-bias", {"random_1", "random_37"});
}

INSTANTIATE_TEST_SUITE_P(Layouts, TpGenerate,
                         ::testing::Values(Layout{2, 1}, Layout{4, 1}, Layout{1, 2}, Layout{2, 2}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "pp" +
                                  std::to_string(info.param.pp);
                         });

TEST(TpGenerateErrors, BadDegreesAreRefusedNamingTheDimension) {
  const std::string base = "--prompt-ids 1,2,3 --max-tokens 2 ";
  auto r = Generate(base + "--tensor-parallel 3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("tensor_parallel 3 does not divide num_attention_heads 8"),
            std::string::npos)
      << r.err;
  r = Generate(base + "--pipeline-parallel 6");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("pipeline_parallel 6 exceeds num_hidden_layers 5"), std::string::npos)
      << r.err;
  r = Generate(base + "--tensor-parallel 0");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("must be at least 1"), std::string::npos) << r.err;
}

// A running `tandem generate` with its stdout on a pipe.
struct Running {
  pid_t pid = -1;
  int out_fd = -1;
  std::string err_file;
};

Running Spawn(const std::vector<std::string>& args) {
  Running r;
  r.err_file = TempFile("err");
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  std::vector<std::string> argv{std::string(TANDEM_BINARY_DIR) + "/tandem", "generate"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  r.pid = fork();
  if (r.pid == 0) {
    dup2(fds[1], 1);
    const int err = open(r.err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(err, 2);
    close(fds[0]);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  close(fds[1]);
  r.out_fd = fds[0];
  return r;
}

// Blocks until the process wrote its first bytes to stdout (a token was
// generated: every rank joined and computed), at most `timeout_ms`.
bool WaitForOutput(const Running& r, int timeout_ms) {
  pollfd p{r.out_fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return false;
  char buf[256];
  return read(r.out_fd, buf, sizeof(buf)) > 0;
}

// Children of `pid` (scanning /proc/*/stat).
std::vector<pid_t> ChildrenOf(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = ReadFile(e.path().string() + "/stat");
    const auto close_paren = stat.rfind(')');
    if (close_paren == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(stat.c_str() + close_paren + 1, " %c %d", &state, &ppid) == 2 && ppid == pid) {
      out.push_back(std::stoi(name));
    }
  }
  return out;
}

// The --rank of a `tandem rank` process (from its command line); -1 if none.
int RankOf(pid_t pid) {
  const std::string cmdline = ReadFile("/proc/" + std::to_string(pid) + "/cmdline");
  std::vector<std::string> args;
  size_t at = 0;
  while (at < cmdline.size()) {
    const size_t end = cmdline.find('\0', at);
    args.push_back(cmdline.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--rank") return std::stoi(args[i + 1]);
  }
  return -1;
}

// Waits (on the process's pidfd, at most `timeout_ms`) until `pid` is gone.
bool WaitGone(pid_t pid, int timeout_ms) {
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return errno == ESRCH;
  pollfd p{fd, POLLIN, 0};
  const bool gone = poll(&p, 1, timeout_ms) == 1;
  close(fd);
  return gone;
}

// waitpid with a bound: the exit status, or -1 after `timeout_ms`.
int WaitExit(pid_t pid, int timeout_ms) {
  if (!WaitGone(pid, timeout_ms)) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return status;
}

const std::vector<std::string> kLongRun{"--prompt", "In the beginning", "--max-tokens", "1000",
                                        "--temperature", "0", "--ignore-eos"};

TEST(TpGenerateFailures, KilledFollowerFailsNamingTheRankAndLeavesNoProcess) {
  auto args = kLongRun;
  args.insert(args.end(), {"--tensor-parallel", "2", "--pipeline-parallel", "2"});
  Running r = Spawn(args);
  ASSERT_TRUE(WaitForOutput(r, 120000)) << ReadFile(r.err_file);
  const auto ranks = ChildrenOf(r.pid);
  ASSERT_EQ(ranks.size(), 3u);
  // Rank 2: stage 1, tensor rank 0.
  pid_t victim = -1;
  for (pid_t p : ranks) {
    if (RankOf(p) == 2) victim = p;
  }
  ASSERT_NE(victim, -1);
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  const int status = WaitExit(r.pid, 60000);
  const std::string err = ReadFile(r.err_file);
  ASSERT_NE(status, -1) << "generate did not exit after rank 2 was killed; " << err;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << " " << err;
  EXPECT_NE(err.find("rank 2 (pid " + std::to_string(victim) + ") was killed by signal 9"),
            std::string::npos)
      << err;
  for (pid_t p : ranks) EXPECT_TRUE(WaitGone(p, 30000)) << "rank pid " << p << " left behind";
  close(r.out_fd);
  std::filesystem::remove(r.err_file);
}

TEST(TpGenerateFailures, KilledRankZeroLeavesNoFollower) {
  auto args = kLongRun;
  args.insert(args.end(), {"--pipeline-parallel", "2"});
  Running r = Spawn(args);
  ASSERT_TRUE(WaitForOutput(r, 120000)) << ReadFile(r.err_file);
  const auto ranks = ChildrenOf(r.pid);
  ASSERT_EQ(ranks.size(), 1u);
  ASSERT_EQ(kill(r.pid, SIGKILL), 0);
  ASSERT_NE(WaitExit(r.pid, 60000), -1);
  // PR_SET_PDEATHSIG: the follower dies with its rank 0.
  EXPECT_TRUE(WaitGone(ranks[0], 30000)) << "rank 1 (pid " << ranks[0] << ") outlived rank 0";
  close(r.out_fd);
  std::filesystem::remove(r.err_file);
}

}  // namespace
