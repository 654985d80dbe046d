// Tensor parallel on the cuda backend (issue 18, docs/parallelism.md
// "CUDA"), label gpu. Every CUDA call happens in forked children: the parent
// never initialises CUDA (a process that did cannot use it in a child after
// fork).
//   - RefusesWhatItCannotRun: any machine (0 devices included): pipeline
//     parallel, a layout that cannot split the model, tp > 1 without a
//     group name, a KV pool of the wrong geometry -- each refused at
//     creation with an error naming it.
//   - CudaTpOneDevice.*: the same script with both tensor ranks on device 0
//     and their collectives staged through the host over the shm
//     communicator (CudaBackendOptions::tp_comm_factory; NCCL refuses two
//     ranks on one device): the sharding itself -- slices, row-parallel
//     sums, the gathered vocabulary -- on any machine with one GPU. Skipped,
//     saying so, without a device.
//   - CudaTpTwoDevices.*: TP = 2, two processes on devices 0 and 1, against
//     TP = 1 on device 0: a batch of three prompts prefilled, then greedy
//     decode steps (a batch of three pads to the bucket of four); the greedy
//     tokens must be equal and the largest logit difference is printed and
//     bounded (NCCL promises no fixed summation order, so bits may differ).
//     Skipped, saying so, with fewer than 2 devices (tests/gpu/device_check.sh
//     runs them only where two devices exist).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/kv_pool.h"
#include "engine/llama_forward.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/nccl_communicator.h"
#include "gpu_children.h"

namespace tandem::engine {
namespace {

// bf16 weights and activations: TP = 2 rounds partial sums in another order
// than TP = 1; the logits (O(10)) may move by a few bf16 steps, not more.
// Same tolerance as the cuda backend's golden test against transformers.
constexpr double kLogitTolerance = 0.25;
constexpr uint32_t kBlockSize = 16;
constexpr uint32_t kDecodeSteps = 8;

std::string Repo(const std::string& rel) { return std::string(TANDEM_SOURCE_DIR) + "/" + rel; }

std::string UniqueGroup(const std::string& what) { return gputest::UniqueGroup("cudatp", what); }

std::vector<int> RunInChildren(int n, const std::function<int(int)>& body) {
  return gputest::RunInChildren(n, body, 150);
}

using gputest::DeviceCountInChild;

#define CHILD_CHECK(cond, ...)           \
  do {                                   \
    if (!(cond)) {                       \
      std::fprintf(stderr, __VA_ARGS__); \
      std::fprintf(stderr, "\n");        \
      return 10 + __LINE__ % 100;        \
    }                                    \
  } while (0)

struct Model {
  model::ModelConfig config;
  model::ModelWeights weights;
};

// Loaded in the parent (no CUDA), bf16 as workers load for cuda.
bool LoadModel(const std::string& rel_dir, Model* m, std::string* why) {
  auto cfg = model::LoadModelConfig(Repo(rel_dir));
  if (!cfg.ok()) {
    *why = cfg.status().ToString();
    return false;
  }
  auto w = model::LoadWeights(Repo(rel_dir), *cfg, model::WeightFormat::kBf16);
  if (!w.ok()) {
    *why = w.status().ToString();
    return false;
  }
  m->config = *cfg;
  m->weights = std::move(*w);
  return true;
}

// A tensor rank's collectives on device buffers, staged through host memory
// over a shm communicator (ordered after the backend's stream).
class HostStagedCommunicator final : public parallel::Communicator {
 public:
  HostStagedCommunicator(std::unique_ptr<parallel::Communicator> inner, cudaStream_t stream)
      : inner_(std::move(inner)), stream_(stream) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view kind() const override { return "host-staged shm"; }

  Status AllReduceSum(std::span<float> data) override {
    a_.resize(data.size());
    TANDEM_RETURN_IF_ERROR(Copy(a_.data(), data.data(), data.size(), cudaMemcpyDeviceToHost));
    TANDEM_RETURN_IF_ERROR(inner_->AllReduceSum(a_));
    return Copy(data.data(), a_.data(), data.size(), cudaMemcpyHostToDevice);
  }
  Status AllGather(std::span<const float> in, std::span<float> out) override {
    a_.resize(in.size());
    b_.resize(out.size());
    TANDEM_RETURN_IF_ERROR(Copy(a_.data(), in.data(), in.size(), cudaMemcpyDeviceToHost));
    TANDEM_RETURN_IF_ERROR(inner_->AllGather(a_, b_));
    return Copy(out.data(), b_.data(), out.size(), cudaMemcpyHostToDevice);
  }
  Status Broadcast(std::span<std::byte>, int) override { return Unused("Broadcast"); }
  Status Send(std::span<const std::byte>, int) override { return Unused("Send"); }
  Status Recv(std::span<std::byte>, int) override { return Unused("Recv"); }
  Status Barrier() override { return inner_->Barrier(); }

 private:
  static Status Unused(const char* what) {
    return UnimplementedError(std::string("host-staged communicator: ") + what);
  }
  Status Copy(float* dst, const float* src, size_t n, cudaMemcpyKind kind) {
    cudaError_t err = cudaMemcpyAsync(dst, src, n * sizeof(float), kind, stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) return InternalError(std::string("staging: ") + cudaGetErrorString(err));
    return Status::Ok();
  }
  std::unique_ptr<parallel::Communicator> inner_;
  cudaStream_t stream_;
  std::vector<float> a_, b_;
};

// Greedy tokens and every logit row of the script, as one rank saw them.
struct Trace {
  std::vector<uint32_t> tokens;
  std::vector<float> logits;
};

uint32_t Greedy(const float* row, uint32_t vocab) {
  uint32_t best = 0;
  for (uint32_t j = 1; j < vocab; ++j) {
    if (row[j] > row[best]) best = j;
  }
  return best;
}

// The script every rank runs: three prompts prefilled in one batch, then
// kDecodeSteps greedy decode steps of all three; the trace goes to `path`.
int RunScript(const Model& m, const ShardSpec& shard, int device, const std::string& group,
              const std::string& path, bool host_staged = false) {
  const uint32_t vocab = m.config.vocab_size;
  AlignedKvPoolAllocator alloc;
  auto pool = KvPool::Create(ShardKvLayout(m.config, shard, kBlockSize), 16, alloc);
  CHILD_CHECK(pool.ok(), "%s", pool.status().ToString().c_str());
  CudaBackendOptions o;
  o.device = device;
  o.shard = shard;
  o.tp_group = group;
  if (host_staged) {
    o.tp_comm_factory = [&](void* stream) -> Result<std::unique_ptr<parallel::Communicator>> {
      auto shm = parallel::CreateShmCommunicator(group, static_cast<int>(shard.rank),
                                                 static_cast<int>(shard.layout.tp), 60000);
      if (!shm.ok()) return shm.status();
      return std::unique_ptr<parallel::Communicator>(std::make_unique<HostStagedCommunicator>(
          std::move(shm).value(), static_cast<cudaStream_t>(stream)));
    };
  }
  auto backend = CreateCudaBackend(m.config, m.weights, pool->get(), o);
  CHILD_CHECK(backend.ok(), "rank %u: %s", shard.rank, backend.status().ToString().c_str());
  const size_t lens[3] = {11, 6, 17};
  std::vector<std::vector<uint32_t>> seqs(3), tables(3);
  for (size_t s = 0; s < 3; ++s) {
    for (size_t i = 0; i < lens[s]; ++i) {
      seqs[s].push_back(static_cast<uint32_t>((s * 131 + i * 37 + 5) % vocab));
    }
    tables[s] = {static_cast<uint32_t>(2 * s), static_cast<uint32_t>(2 * s + 1)};  // 32 positions
  }
  Trace trace;
  std::vector<float> logits(3 * size_t{vocab});
  for (uint32_t step = 0; step <= kDecodeSteps; ++step) {
    std::vector<SeqChunk> batch(3);
    for (size_t s = 0; s < 3; ++s) {
      const size_t n = step == 0 ? seqs[s].size() : 1;
      batch[s].tokens = std::span<const uint32_t>(seqs[s]).last(n);
      batch[s].start_pos = static_cast<uint32_t>(seqs[s].size() - n);
      batch[s].block_table = tables[s];
      batch[s].num_logits = 1;
    }
    std::fill(logits.begin(), logits.end(), std::nanf(""));
    const Status st = (*backend)->Forward(batch, logits);
    CHILD_CHECK(st.ok(), "rank %u step %u: %s", shard.rank, step, st.ToString().c_str());
    for (size_t s = 0; s < 3; ++s) {
      const uint32_t t = Greedy(logits.data() + s * vocab, vocab);
      seqs[s].push_back(t);
      trace.tokens.push_back(t);
    }
    trace.logits.insert(trace.logits.end(), logits.begin(), logits.end());
  }
  std::ofstream out(path, std::ios::binary);
  const uint64_t nt = trace.tokens.size(), nl = trace.logits.size();
  out.write(reinterpret_cast<const char*>(&nt), sizeof(nt));
  out.write(reinterpret_cast<const char*>(trace.tokens.data()), nt * sizeof(uint32_t));
  out.write(reinterpret_cast<const char*>(&nl), sizeof(nl));
  out.write(reinterpret_cast<const char*>(trace.logits.data()), nl * sizeof(float));
  CHILD_CHECK(out.good(), "writing %s", path.c_str());
  return 0;
}

bool ReadTrace(const std::string& path, Trace* t) {
  std::ifstream in(path, std::ios::binary);
  uint64_t nt = 0, nl = 0;
  if (!in.read(reinterpret_cast<char*>(&nt), sizeof(nt))) return false;
  t->tokens.resize(nt);
  if (!in.read(reinterpret_cast<char*>(t->tokens.data()), nt * sizeof(uint32_t))) return false;
  if (!in.read(reinterpret_cast<char*>(&nl), sizeof(nl))) return false;
  t->logits.resize(nl);
  return static_cast<bool>(in.read(reinterpret_cast<char*>(t->logits.data()), nl * sizeof(float)));
}

// Creation of `shard` with `pool_layout` on device 0, in a child; the
// status code and message through a pipe.
Status CreateInChild(const Model& m, const ShardSpec& shard, const KvLayout& pool_layout,
                     const std::string& group) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return InternalError("pipe");
  const auto codes = RunInChildren(1, [&](int) {
    close(pipefd[0]);
    AlignedKvPoolAllocator alloc;
    auto pool = KvPool::Create(pool_layout, 4, alloc);
    if (!pool.ok()) return 99;
    CudaBackendOptions o;
    o.shard = shard;
    o.tp_group = group;
    o.tp_join_timeout_ms = 2000;
    auto b = CreateCudaBackend(m.config, m.weights, pool->get(), o);
    const std::string msg = b.ok() ? "" : b.status().message();
    if (write(pipefd[1], msg.data(), msg.size()) < 0) return 98;
    return b.ok() ? 0 : static_cast<int>(b.status().code());
  });
  close(pipefd[1]);
  std::string msg;
  char buf[1024];
  ssize_t got = 0;
  while ((got = read(pipefd[0], buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(got));
  close(pipefd[0]);
  if (codes[0] == 0) return Status::Ok();
  if (codes[0] >= 98) return InternalError("child failed before creation: " + std::to_string(codes[0]));
  return Status(static_cast<StatusCode>(codes[0]), msg);
}

TEST(CudaTpForward, RefusesWhatItCannotRun) {
  Model m;
  std::string why;
  ASSERT_TRUE(LoadModel("models/tandem-kjv", &m, &why)) << why;  // 8 heads, 2 KV heads, 5 layers
  const std::string group = UniqueGroup("refuse");
  auto layout_of = [&](const ShardSpec& s) { return ShardKvLayout(m.config, s, kBlockSize); };

  const ShardSpec pp2{{1, 2}, 0};
  Status s = CreateInChild(m, pp2, layout_of(pp2), group);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.ToString();
  EXPECT_NE(s.message().find("pipeline_parallel 2"), std::string::npos) << s.ToString();

  const ShardSpec tp3{{3, 1}, 0};  // 3 divides no dimension of the model
  s = CreateInChild(m, tp3, KvLayout{5, 1, m.config.head_dim, kBlockSize}, group);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("tensor_parallel 3"), std::string::npos) << s.ToString();

  const ShardSpec tp2{{2, 1}, 1};
  s = CreateInChild(m, tp2, layout_of(tp2), "");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("tp_group"), std::string::npos) << s.ToString();

  // The whole model's pool for one tensor rank of two: 2 KV heads, not 1.
  s = CreateInChild(m, tp2, layout_of(ShardSpec{}), group);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("2 KV heads"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("rank 1 of tp2pp1"), std::string::npos) << s.ToString();
}

// Runs the script at TP = 1 on device 0 and at TP = 2 (ranks on devices
// `dev0`, `dev1`; host-staged collectives when asked), then compares.
void CompareTp2WithTp1(const char* model_dir, int dev0, int dev1, bool host_staged) {
  Model m;
  std::string why;
  ASSERT_TRUE(LoadModel(model_dir, &m, &why)) << why;
  const uint32_t vocab = m.config.vocab_size;
  const std::string dir = ::testing::TempDir();
  const std::string tag = std::to_string(getpid());
  const std::string one = dir + "/cuda_tp1." + tag, two = dir + "/cuda_tp2." + tag;

  auto codes = RunInChildren(1, [&](int) { return RunScript(m, ShardSpec{}, 0, "", one); });
  ASSERT_EQ(codes[0], 0) << "TP = 1 on device 0";
  const std::string group = UniqueGroup("tp2");
  codes = RunInChildren(2, [&](int r) {
    return RunScript(m, ShardSpec{{2, 1}, static_cast<uint32_t>(r)}, r == 0 ? dev0 : dev1, group,
                     two + "." + std::to_string(r), host_staged);
  });
  ASSERT_EQ(codes[0], 0) << "TP = 2, rank 0 on device " << dev0;
  ASSERT_EQ(codes[1], 0) << "TP = 2, rank 1 on device " << dev1;

  Trace ref, r0, r1;
  ASSERT_TRUE(ReadTrace(one, &ref));
  ASSERT_TRUE(ReadTrace(two + ".0", &r0));
  ASSERT_TRUE(ReadTrace(two + ".1", &r1));
  std::remove(one.c_str());
  std::remove((two + ".0").c_str());
  std::remove((two + ".1").c_str());
  ASSERT_EQ(ref.tokens.size(), 3u * (kDecodeSteps + 1));
  ASSERT_EQ(ref.logits.size(), ref.tokens.size() * vocab);
  EXPECT_EQ(r0.tokens, ref.tokens) << "TP = 2 rank 0 vs TP = 1";
  EXPECT_EQ(r1.tokens, ref.tokens) << "TP = 2 rank 1 vs TP = 1";
  ASSERT_EQ(r0.logits.size(), ref.logits.size());
  ASSERT_EQ(r1.logits.size(), ref.logits.size());
  double max_diff = 0, max_ranks = 0;
  size_t bits_equal = 0;
  for (size_t i = 0; i < ref.logits.size(); ++i) {
    ASSERT_TRUE(std::isfinite(r0.logits[i]) && std::isfinite(ref.logits[i])) << "logit " << i;
    max_diff = std::max(max_diff, std::fabs(double(r0.logits[i]) - ref.logits[i]));
    max_ranks = std::max(max_ranks, std::fabs(double(r0.logits[i]) - r1.logits[i]));
    bits_equal += std::memcmp(&r0.logits[i], &ref.logits[i], sizeof(float)) == 0;
  }
  std::printf("%s (%s): TP=2 vs TP=1 on cuda: %zu greedy tokens equal, max |logit difference| "
              "%.6g (%zu of %zu logits bit-identical), rank 0 vs rank 1 %.6g\n",
              model_dir, host_staged ? "both ranks on device 0, host-staged" : "devices 0 and 1, NCCL",
              ref.tokens.size(), max_diff, bits_equal, ref.logits.size(), max_ranks);
  ::testing::Test::RecordProperty("max_logit_difference", std::to_string(max_diff));
  EXPECT_LT(max_diff, kLogitTolerance);
  EXPECT_LT(max_ranks, kLogitTolerance);
}

class CudaTpOneDevice : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaTpOneDevice, TwoRanksStagedThroughTheHostGiveTheTokensOfOneRank) {
  std::string why;
  const int devices = DeviceCountInChild(&why);
  if (devices < 1) {
    GTEST_SKIP() << "needs 1 CUDA device, found 0" << (why.empty() ? "" : ": " + why);
  }
  CompareTp2WithTp1(GetParam(), 0, 0, /*host_staged=*/true);
}

class CudaTpTwoDevices : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaTpTwoDevices, TwoRanksGiveTheTokensOfOneDevice) {
  std::string why;
  const int devices = DeviceCountInChild(&why);
  if (devices < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices (one per tensor rank), found " << devices
                 << (why.empty() ? "" : ": " + why);
  }
  CompareTp2WithTp1(GetParam(), 0, 1, /*host_staged=*/false);
}

// The bundled model (tied embeddings, KV heads split 2 -> 1 + 1), a model
// whose single KV head is replicated on both ranks (untied LM head), and
// one with q/k/v and o_proj biases (o's bias added once after the
// all-reduce).
const char* const kModels[] = {"models/tandem-kjv", "tests/fixtures/golden/tiny-llama",
                               "tests/fixtures/golden/tiny-llama-bias"};

std::string ModelName(const ::testing::TestParamInfo<const char*>& info) {
  std::string n = info.param;
  n = n.substr(n.rfind('/') + 1);
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

INSTANTIATE_TEST_SUITE_P(Models, CudaTpOneDevice, ::testing::ValuesIn(kModels), ModelName);
INSTANTIATE_TEST_SUITE_P(Models, CudaTpTwoDevices, ::testing::ValuesIn(kModels), ModelName);

}  // namespace
}  // namespace tandem::engine
