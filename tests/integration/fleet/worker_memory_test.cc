// A cpu worker holds one copy of its model's weights in memory (session 43,
// docs/engine.md "Weights in memory"): the packed copy its backend reads,
// not also the tensors as they were loaded, neither once serving nor at its
// peak while loading. Measured as the worker process's resident memory
// (VmRSS) and its peak (VmHWM) in real fleets on two models: the bundled one
// (18 MB as bf16) and a generated one ten times its size; the two workers
// differ by one copy of the difference between the models, not two.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;

// The /proc/PID/status field `key` ("VmRSS:", "VmHWM:") in bytes (0 when
// it cannot be read).
uint64_t StatusBytes(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      return std::strtoull(line.c_str() + key.size(), nullptr, 10) * 1024;
    }
  }
  return 0;
}

// Bytes the model's matrices and vectors take as f32 (what the loader makes
// of them): twice its bf16 safetensors files' tensor bytes, headers aside.
uint64_t F32Bytes(const std::string& dir) {
  uint64_t bf16 = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") bf16 += e.file_size();
  }
  return 2 * bf16;
}

struct Measured {
  uint64_t rss = 0, peak = 0;
  std::vector<uint32_t> tokens;
};

// A fleet of one `both` worker on `model` (empty: the bundled model); one
// greedy completion through it, then the worker's VmRSS.
Measured RunOne(const std::string& model, const std::vector<uint32_t>& prompt) {
  FleetOptions o;
  o.prefill = 0;
  o.decode = 0;
  o.both = 1;
  o.num_blocks = 64;
  o.model_path = model;
  auto fleet = Fleet::Launch(o);
  EXPECT_TRUE(fleet.ok()) << fleet.status().ToString();
  if (!fleet.ok()) return {};
  GenerateArgs g;
  g.prompt_ids = prompt;
  g.max_tokens = 8;
  auto c = Generate((*fleet)->proxy_grpc(), g);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  Measured m;
  if (c.ok()) m.tokens = c->token_ids;
  EXPECT_EQ((*fleet)->workers().size(), 1u);
  if ((*fleet)->workers().size() == 1) {
    m.rss = StatusBytes((*fleet)->workers()[0].pid, "VmRSS:");
    m.peak = StatusBytes((*fleet)->workers()[0].pid, "VmHWM:");
  }
  return m;
}

TEST(WorkerMemory, CpuWorkerHoldsOneCopyOfTheWeights) {
  if (!HaveBundledModel()) GTEST_SKIP() << "the bundled model's weights are not there";
  char tmpl[] = "/tmp/tandem-model-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct RemoveAtExit {  // the ~100 MB model goes whichever way the test ends
    std::string path;
    ~RemoveAtExit() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } remove_at_exit{dir};
  // ~50M parameters (198 MB as f32), the bundled tokenizer's vocabulary.
  const std::string cmd = fmt::format(
      "python3 {}/tools/make_random_model.py {} --layers 4 --hidden 1024 --intermediate 2496 "
      "--heads 16 --kv-heads 4 --head-dim 64 --vocab 4096 --layers-per-shard 4 > /dev/null",
      TANDEM_SOURCE_DIR, dir);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(BundledModel() + "/" + f, dir + "/" + f);
  }
  const std::vector<uint32_t> prompt = PromptIds(7, 24, 4096);

  const Measured small = RunOne("", prompt);
  const Measured large = RunOne(dir, prompt);
  // The large model serves what `tandem generate` makes of it.
  auto want = ReferenceGenerateWith(dir, prompt, 8);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  EXPECT_EQ(large.tokens, *want);
  EXPECT_EQ(large.tokens.size(), 8u);

  ASSERT_GT(small.rss, 0u);
  ASSERT_GT(large.rss, 0u);
  const double one_copy = static_cast<double>(F32Bytes(dir)) - F32Bytes(BundledModel());
  const double grew = static_cast<double>(large.rss) - static_cast<double>(small.rss);
  // One copy each: the workers differ by ~one_copy (their KV pools by ~8
  // MB); both copies kept would make it ~2 x one_copy.
  EXPECT_LT(grew, 1.5 * one_copy) << fmt::format(
      "worker VmRSS {:.1f} MiB on the bundled model, {:.1f} MiB on the generated one; one "
      "copy of the difference in weights is {:.1f} MiB",
      small.rss / 1048576.0, large.rss / 1048576.0, one_copy / 1048576.0);
  EXPECT_GT(grew, 0.5 * one_copy) << "the generated model's weights are not resident at all?";
  // The peak: loading frees each tensor's file pages once it is converted
  // and each converted tensor once the backend copied it, so it too stays
  // near one copy (two before: the loaded model and the packs at once; one
  // layer's tensors and packs and the embedding copy are in flight at the
  // peak, ~0.3 copies of this model).
  const double peak_grew = static_cast<double>(large.peak) - static_cast<double>(small.peak);
  EXPECT_LT(peak_grew, 1.7 * one_copy) << fmt::format(
      "worker VmHWM {:.1f} MiB on the bundled model, {:.1f} MiB on the generated one; one copy "
      "of the difference in weights is {:.1f} MiB",
      small.peak / 1048576.0, large.peak / 1048576.0, one_copy / 1048576.0);
  std::printf(
      "worker VmRSS / VmHWM: %.1f / %.1f MiB (bundled model), %.1f / %.1f MiB "
      "(generated); one copy of the difference in weights %.1f MiB\n",
      small.rss / 1048576.0, small.peak / 1048576.0, large.rss / 1048576.0, large.peak / 1048576.0,
      one_copy / 1048576.0);
}

}  // namespace
}  // namespace tandem::testing
