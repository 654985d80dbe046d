// KV pushed between different rank layouts by the real prefill path (issue
// 18): the Prefiller on rank 0's engine (ParallelBackend) with its follower
// rank running parallel::RunFollowerRank in a thread (shared-memory
// communicators, as `tandem prefill` ranks would be processes), every rank
// with its own UCX transport (worker/rank_kv.h), pushes a prompt's KV into
// the decode ranks' UCX pools; the bytes each decode rank then holds must
// equal, slice for slice, the KV a one-process engine computed for the same
// prompt. The decoder side is UCX pools only (its gRPC edge is a fake
// DecoderLink here; the fleet tests run the whole path).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "engine/engine.h"
#include "engine/parallel_backend.h"
#include "kvtransfer/slice_push_ranks.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/follower.h"
#include "parallel/step_plan.h"
#include "prefiller/prefiller.h"
#include "worker/rank_kv.h"

namespace tandem::worker {
namespace {

using namespace std::chrono_literals;
using parallel::ParallelLayout;
using parallel::RankKvShapeOf;

constexpr uint32_t kBlockSize = 16;
constexpr uint32_t kNumBlocks = 32;

std::string ModelDir() { return std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv"; }

struct Model {
  model::ModelConfig config;
  model::ModelWeights weights;
};
const Model& Kjv() {
  static Model* m = [] {
    auto* x = new Model();
    auto c = model::LoadModelConfig(ModelDir());
    if (!c.ok()) std::abort();
    x->config = *c;
    auto w = model::LoadWeights(ModelDir(), *c);
    if (!w.ok()) std::abort();
    x->weights = std::move(w).value();
    return x;
  }();
  return *m;
}

std::vector<uint32_t> Prompt() {
  std::vector<uint32_t> p;
  for (uint32_t i = 0; i < 70; ++i) p.push_back(5 + (i * 37) % 4000);  // 5 blocks, the last partial
  return p;
}
uint32_t PromptBlocks() { return (Prompt().size() + kBlockSize - 1) / kBlockSize; }

engine::EngineOptions BaseEngine() {
  engine::EngineOptions eo;
  eo.block_size = kBlockSize;
  eo.num_blocks = kNumBlocks;
  eo.scheduler.max_batched_tokens = 32;  // three chunks
  return eo;
}

// Prefill-only run; returns the prompt blocks' ids once done (pinned until
// ReleasePrefill).
std::vector<uint32_t> PrefillBlocks(engine::Engine& e, const std::string& id) {
  std::promise<std::vector<uint32_t>> done;
  engine::GenerateRequest r;
  r.request_id = id;
  r.prompt_ids = Prompt();
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 1;
  r.prefill_only = true;
  r.on_output = [&done](const engine::RequestOutput& o) {
    if (o.finished) done.set_value(o.block_ids);
  };
  EXPECT_TRUE(e.Submit(std::move(r)).ok());
  auto f = done.get_future();
  EXPECT_EQ(f.wait_for(60s), std::future_status::ready);
  return f.get();
}

// The one-process engine's KV of the prompt: [prompt blocks][full block].
const std::vector<std::vector<float>>& ReferenceKv() {
  static std::vector<std::vector<float>> kv = [] {
    auto e = engine::Engine::Create(Kjv().config, Kjv().weights, BaseEngine());
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    (*e)->Start();
    const auto blocks = PrefillBlocks(**e, "ref");
    std::vector<std::vector<float>> out;
    const engine::KvPool& pool = (*e)->pool();
    for (uint32_t b : blocks) {
      out.emplace_back(pool.block(b), pool.block(b) + pool.layout().block_floats());
    }
    (*e)->Stop();
    return out;
  }();
  return kv;
}

// Rank `r` of `layout`'s slice of the reference block `b`.
std::vector<float> ReferenceSlice(const ParallelLayout& layout, uint32_t r, uint32_t b) {
  const auto dims = KvDimsOf(Kjv().config, kBlockSize);
  const auto whole = RankKvShapeOf({1, 1}, dims, 0);
  const auto s = RankKvShapeOf(layout, dims, r);
  std::vector<float> out;
  const size_t plane = s.head_plane_bytes / sizeof(float);
  for (uint32_t l = s.layers.begin; l < s.layers.end; ++l) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = s.kv_heads.begin; h < s.kv_heads.end; ++h) {
        const float* p = ReferenceKv()[b].data() + whole.offset(l, kv, h) / sizeof(float);
        out.insert(out.end(), p, p + plane);
      }
    }
  }
  return out;
}

// The engine's KV pool is the transport's memory (as in a worker).
class PoolAllocator final : public engine::KvPoolAllocator {
 public:
  explicit PoolAllocator(kvtransfer::Transport& t) : t_(t) {}
  Result<std::span<std::byte>> Allocate(size_t bytes) override {
    if (bytes != t_.pool_bytes()) return InternalError("pool size mismatch");
    return std::span<std::byte>(t_.pool(), bytes);
  }

 private:
  kvtransfer::Transport& t_;
};

std::unique_ptr<kvtransfer::Transport> Ucx(const std::string& name, uint64_t block_bytes) {
  kvtransfer::TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = kNumBlocks;
  o.peer_timeout_s = 1.5;
  auto t = kvtransfer::CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// Answers every Reserve at once with `target` (on another thread, as gRPC).
class Link final : public prefiller::DecoderLink {
 public:
  explicit Link(prefiller::ReserveTarget target) : target_(std::move(target)) {}
  void Reserve(const prefiller::PrefillJob&, const std::string&, ReserveDone done) override {
    std::thread([done = std::move(done), t = target_]() mutable { done(std::move(t)); }).detach();
  }
  std::string EncodeNotice(const prefiller::NoticeSpec& n) override {
    return fmt::format("{}|{}|{}", n.request_id, static_cast<int>(n.error.code()), n.ranks_pushed);
  }

 private:
  prefiller::ReserveTarget target_;
};

struct Decoder {
  std::vector<std::unique_ptr<kvtransfer::Transport>> ranks;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> notices;
};

void MakeDecoder(Decoder& d, const ParallelLayout& layout, const std::string& tag) {
  const auto dims = KvDimsOf(Kjv().config, kBlockSize);
  for (uint32_t r = 0; r < layout.world(); ++r) {
    d.ranks.push_back(
        Ucx(fmt::format("rp-d{}-{}", r, tag), RankKvShapeOf(layout, dims, r).block_bytes()));
    ASSERT_NE(d.ranks.back(), nullptr);
    std::memset(d.ranks.back()->pool(), 0, d.ranks.back()->pool_bytes());
  }
  d.ranks[0]->SetNotificationCallback([&d](kvtransfer::Notification n) {
    std::lock_guard lock(d.mu);
    d.notices.push_back(n.payload);
    d.cv.notify_all();
  });
}

prefiller::ReserveTarget TargetFor(Decoder& d, const ParallelLayout& layout,
                                   const std::vector<uint32_t>& slots) {
  prefiller::ReserveTarget t;
  t.reservation_id = 7;
  t.generation = d.ranks[0]->generation();
  t.transport_descriptor = d.ranks[0]->LocalDescriptor();
  t.slots = slots;
  t.cached_blocks = 0;
  t.decode_layout = layout;
  if (layout.world() > 1) {
    for (auto& r : d.ranks) t.rank_descriptors.push_back(r->LocalDescriptor());
  }
  return t;
}

// Every decode rank's slots hold exactly its slice of the reference KV.
void ExpectDecodeHoldsReference(Decoder& d, const ParallelLayout& layout,
                                const std::vector<uint32_t>& slots) {
  for (uint32_t r = 0; r < layout.world(); ++r) {
    for (uint32_t b = 0; b < slots.size(); ++b) {
      const auto want = ReferenceSlice(layout, r, b);
      ASSERT_EQ(want.size() * sizeof(float), d.ranks[r]->block_bytes());
      const float* got = reinterpret_cast<const float*>(d.ranks[r]->block(slots[b]));
      double max_diff = 0;
      size_t differ = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (got[i] != want[i]) {
          ++differ;
          max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
        }
      }
      EXPECT_EQ(differ, 0u) << "decode rank " << r << " prompt block " << b << ": " << differ
                            << " floats differ, max |diff| " << max_diff;
    }
  }
}

prefiller::PrefillJob Job(const std::string& id) {
  prefiller::PrefillJob j;
  j.request_id = id;
  j.prompt_ids = Prompt();
  j.sampling.temperature = 0;
  j.sampling.max_tokens = 4;
  j.decoder_address = "fake:1";
  j.decoder_name = "decode-fake";
  return j;
}

Result<prefiller::PrefillResult> RunPrefill(prefiller::Prefiller& p, const std::string& id) {
  std::promise<Result<prefiller::PrefillResult>> done;
  Status s = p.Submit(
      Job(id), [&done](Result<prefiller::PrefillResult> r) { done.set_value(std::move(r)); });
  if (!s.ok()) return s;
  auto f = done.get_future();
  if (f.wait_for(60s) != std::future_status::ready)
    return DeadlineExceededError("prefill did not end");
  return f.get();
}

TEST(RankPush, PrefillTp2RanksPushIntoADecodeTp1PoolExactlyTheOneProcessKv) {
  ASSERT_EQ(ReferenceKv().size(), PromptBlocks());
  const std::string tag = fmt::format("{}", getpid());
  const ParallelLayout p{2, 1}, d{1, 1};
  const auto dims = KvDimsOf(Kjv().config, kBlockSize);
  const std::string group = "rank-push-" + tag;

  // Follower rank 1: its own transport and pool, the push_kv hook.
  kvtransfer::TransportOptions base;
  base.backend = "ucx";
  base.agent_name = "rp-p-" + tag;
  base.num_blocks = kNumBlocks;
  base.peer_timeout_s = 1.5;
  auto follower_kv = FollowerRankKv::Create(base, p, dims, 1);
  ASSERT_TRUE(follower_kv.ok()) << follower_kv.status().ToString();
  parallel::FollowerOptions fo;
  fo.model_dir = ModelDir();
  fo.layout = p;
  fo.rank = 1;
  fo.group = group;
  fo.num_blocks = kNumBlocks;
  fo.block_size = kBlockSize;
  fo.join_timeout_ms = 30000;
  // The hooks a worker's follower rank sets (worker/worker_runtime.cc).
  FollowerRankKv& fkv = **follower_kv;
  fo.allocator = &fkv.allocator();
  fo.on_joined = [&fkv](parallel::Communicator& world) { return fkv.OnJoined(world); };
  fo.on_push_kv = [&fkv](const parallel::StepPlan& plan, engine::KvPool&,
                         parallel::Communicator& world) {
    for (const parallel::PlanField& f : plan.extensions) {
      if (f.tag == kvtransfer::kPushKvSpecTag) return fkv.OnPushKv(f.bytes, world);
    }
    return fkv.OnPushKv({}, world);
  };
  std::promise<Status> follower_exit;
  std::thread follower([&] { follower_exit.set_value(parallel::RunFollowerRank(fo)); });

  // Rank 0: transport of its slice, the engine over it (joins the group).
  auto rank0 = Ucx("rp-p0-" + tag, RankKvShapeOf(p, dims, 0).block_bytes());
  ASSERT_NE(rank0, nullptr);
  auto alloc = std::make_unique<PoolAllocator>(*rank0);
  engine::EngineOptions eo = BaseEngine();
  eo.parallel = p;
  eo.parallel_group = group;
  eo.parallel_join_timeout_ms = 30000;
  eo.allocator = alloc.get();
  auto e = engine::Engine::Create(Kjv().config, Kjv().weights, eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto* backend = dynamic_cast<engine::ParallelBackend*>(&(*e)->backend());
  ASSERT_NE(backend, nullptr);
  // Rank 0's half of the descriptor exchange, before the first step.
  auto descriptors =
      kvtransfer::ExchangeRankDescriptors(backend->world(), rank0->LocalDescriptor());
  ASSERT_TRUE(descriptors.ok()) << descriptors.status().ToString();
  EXPECT_EQ(descriptors->at(1), (*follower_kv)->transport().LocalDescriptor());

  Decoder dec;
  MakeDecoder(dec, d, tag);
  const std::vector<uint32_t> slots = {9, 3, 4, 20, 11};
  Link link(TargetFor(dec, d, slots));
  prefiller::PrefillerOptions po;
  po.name = "prefill-tp2";
  po.push_mode =
      prefiller::PushMode::kStreaming;  // a sliced push is after-prefill whatever this says
  po.checksum = false;
  po.layout = p;
  po.kv_dims = dims;
  // Rank 0's follower_push (as a worker's): a push_kv plan carrying the
  // spec, then every follower's report.
  po.follower_push = [backend](const kvtransfer::SlicePushSpec& spec,
                               kvtransfer::RankSlicePusher::Done done) {
    auto send = [backend](std::string bytes) {
      parallel::StepPlan plan;
      plan.kind = parallel::StepKind::kPushKv;
      parallel::PlanField f;
      f.tag = kvtransfer::kPushKvSpecTag;
      f.bytes.resize(bytes.size());
      std::memcpy(f.bytes.data(), bytes.data(), bytes.size());
      plan.extensions.push_back(std::move(f));
      return backend->BroadcastPlan(std::move(plan));
    };
    done(kvtransfer::PushThroughFollowers(spec, send, backend->world()));
  };
  {
    (*e)->Start();
    prefiller::Prefiller prefiller(**e, *rank0, link, po);
    prefiller.Start();
    auto r = RunPrefill(prefiller, "tp2-req");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->transferred_blocks, PromptBlocks());
    // Both ranks' halves of every block: the whole TP=1 block's bytes.
    EXPECT_EQ(r->transferred_bytes, uint64_t{PromptBlocks()} * dec.ranks[0]->block_bytes());
    std::unique_lock lock(dec.mu);
    ASSERT_TRUE(dec.cv.wait_for(lock, 20s, [&] { return !dec.notices.empty(); }));
    EXPECT_EQ(dec.notices[0], "tp2-req|0|2");  // no error, 2 prefill ranks pushed
    lock.unlock();
    prefiller.Stop();
  }
  ExpectDecodeHoldsReference(dec, d, slots);
  e->reset();  // ParallelBackend's shutdown plan: the follower leaves its loop
  follower.join();
  EXPECT_TRUE(follower_exit.get_future().get().ok());
}

TEST(RankPush, PrefillTp1PushesEachDecodePp2StageItsLayers) {
  ASSERT_EQ(ReferenceKv().size(), PromptBlocks());
  const std::string tag = fmt::format("{}-pp", getpid());
  const ParallelLayout d{1, 2};
  const auto dims = KvDimsOf(Kjv().config, kBlockSize);
  auto t = Ucx("rp-p1-" + tag, RankKvShapeOf({1, 1}, dims, 0).block_bytes());
  ASSERT_NE(t, nullptr);
  auto alloc = std::make_unique<PoolAllocator>(*t);
  engine::EngineOptions eo = BaseEngine();
  eo.allocator = alloc.get();
  auto e = engine::Engine::Create(Kjv().config, Kjv().weights, eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  (*e)->Start();
  Decoder dec;
  MakeDecoder(dec, d, tag);
  const std::vector<uint32_t> slots = {0, 1, 2, 30, 31};
  Link link(TargetFor(dec, d, slots));
  prefiller::PrefillerOptions po;
  po.name = "prefill-tp1";
  po.checksum = false;
  {
    prefiller::Prefiller prefiller(**e, *t, link, po);
    prefiller.Start();
    auto r = RunPrefill(prefiller, "pp2-req");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::unique_lock lock(dec.mu);
    ASSERT_TRUE(dec.cv.wait_for(lock, 20s, [&] { return !dec.notices.empty(); }));
    EXPECT_EQ(dec.notices[0], "pp2-req|0|1");
    lock.unlock();
    prefiller.Stop();
  }
  ExpectDecodeHoldsReference(dec, d, slots);
  (*e)->Stop();
}

TEST(RankPush, ChecksumsOnARankedPushAreRefusedNamingTheKey) {
  const std::string tag = fmt::format("{}-ck", getpid());
  const ParallelLayout d{1, 2};
  const auto dims = KvDimsOf(Kjv().config, kBlockSize);
  auto t = Ucx("rp-ck-" + tag, RankKvShapeOf({1, 1}, dims, 0).block_bytes());
  ASSERT_NE(t, nullptr);
  auto alloc = std::make_unique<PoolAllocator>(*t);
  engine::EngineOptions eo = BaseEngine();
  eo.allocator = alloc.get();
  auto e = engine::Engine::Create(Kjv().config, Kjv().weights, eo);
  ASSERT_TRUE(e.ok());
  (*e)->Start();
  Decoder dec;
  MakeDecoder(dec, d, tag);
  Link link(TargetFor(dec, d, {0, 1, 2, 3, 4}));
  prefiller::PrefillerOptions po;
  po.name = "prefill-ck";
  po.checksum = true;
  prefiller::Prefiller prefiller(**e, *t, link, po);
  prefiller.Start();
  auto r = RunPrefill(prefiller, "ck-req");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("transport.checksum"), std::string::npos)
      << r.status().ToString();
  // The decoder hears that the reservation is abandoned (an error notice).
  std::unique_lock lock(dec.mu);
  ASSERT_TRUE(dec.cv.wait_for(lock, 20s, [&] { return !dec.notices.empty(); }));
  EXPECT_EQ(dec.notices[0].rfind("ck-req|9|", 0), 0u) << dec.notices[0];
  EXPECT_EQ((*e)->stats().free_blocks, kNumBlocks) << "nothing of the refused request stays held";
  lock.unlock();
  prefiller.Stop();
  (*e)->Stop();
}

}  // namespace
}  // namespace tandem::worker
